#!/usr/bin/env bash
# dflash_data regenerate end to end on the CPU reference (tiny target, random weights):
#   resume  a run killed (kill -9) after two parts continues from them and writes the same file; a
#           complete output is reused; other settings are refused while parts or the output exist
#   mpi     mpirun -n 2 (two TP groups sharing the parts) writes the same file as one process;
#           mpirun -n 2 --tp 2 writes a valid file of the same sequences
#   bad     bad options and inputs get one clear message each
# Usage: regenerate_test.sh MODE DFLASH_DATA TINY_CONFIG WORKDIR [MPIRUN [OPTIONS...]]
set -uo pipefail
mode=$1 data=$2 cfg=$3 work=$4
mpirun=("${@:5}")  # MPIRUN and its options (mpiexec --oversubscribe)
[ ${#mpirun[@]} -gt 0 ] || mpirun=(mpirun)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
expect() {  # expect "message regex" command...: the command fails and says it
  local want=$1; shift
  if "$@" > out.txt 2>&1; then cat out.txt; fail "expected a failure: $*"; fi
  grep -Eq -- "$want" out.txt || { cat out.txt; fail "expected '$want' from: $*"; }
}
"$data" synth --out prompts.h5 --sequences 23 --min-len 8 --max-len 30 --vocab-size 16 > /dev/null || fail synth
common=(--config "$cfg" --random-weights --max-new-tokens 12 --part-size 5 --no-progress)
"$data" regenerate prompts.h5 --out ref.h5 "${common[@]}" --slots 4 > ref.txt 2>&1 || { cat ref.txt; fail "reference run"; }
grep -q "regenerated ref.h5: 23 sequences (.* + 276 new tokens" ref.txt || { cat ref.txt; fail "reference summary"; }
"$data" dump ref.h5 > ref.jsonl || fail dump

case $mode in
resume)
  DFLASH_FAULT_KILL_AFTER_PARTS=2 "$data" regenerate prompts.h5 --out out.h5 "${common[@]}" > kill.txt 2>&1
  rc=$?
  [ $rc -eq 137 ] || { cat kill.txt; fail "the killed run exited $rc, not 137 (SIGKILL)"; }
  [ -f out.h5 ] && fail "a killed run left out.h5"
  [ -f out.h5.parts/part-000000.h5 ] && [ -f out.h5.parts/part-000001.h5 ] || fail "the parts of the killed run are not on disk"
  expect "holds parts of another regeneration \(decoding.max_new_tokens: the parts were made with 12, this run has 13\)" \
    "$data" regenerate prompts.h5 --out out.h5 --config "$cfg" --random-weights --max-new-tokens 13 --part-size 5
  "$data" regenerate prompts.h5 --out out.h5 "${common[@]}" --slots 7 > resume.txt 2>&1 || { cat resume.txt; fail "resumed run"; }
  grep -q "2 of 5 parts were on disk from an earlier run" resume.txt || { cat resume.txt; fail "resume summary"; }
  "$data" dump out.h5 > out.jsonl || fail dump
  cmp -s ref.jsonl out.jsonl || fail "the resumed output differs from the uninterrupted one"
  [ -d out.h5.parts ] && fail "out.h5.parts is left after the join"
  "$data" regenerate prompts.h5 --out out.h5 "${common[@]}" > again.txt 2>&1 || { cat again.txt; fail "run on a complete output"; }
  grep -q "is already complete (23 sequences, made with these settings): nothing to do" again.txt || { cat again.txt; fail "reuse"; }
  expect "out.h5 exists and was not made with these settings \(decoding.sampling: the parts were made with \"greedy\"" \
    "$data" regenerate prompts.h5 --out out.h5 "${common[@]}" --temperature 0.7
  "$data" validate out.h5 > /dev/null || fail validate
  ;;
mpi)
  "${mpirun[@]}" -n 2 "$data" regenerate prompts.h5 --out dp.h5 "${common[@]}" > dp.txt 2>&1 || { cat dp.txt; fail "mpirun -n 2"; }
  "$data" dump dp.h5 > dp.jsonl || fail dump
  cmp -s ref.jsonl dp.jsonl || fail "two TP groups wrote another file than one process"
  "${mpirun[@]}" -n 2 "$data" regenerate prompts.h5 --out tp.h5 "${common[@]}" --tp 2 > tp.txt 2>&1 || { cat tp.txt; fail "--tp 2"; }
  "$data" validate tp.h5 | grep -q "23 sequences" || fail "tp 2 output"
  "$data" dump tp.h5 > tp.jsonl || fail dump
  # tp = 2 sums each layer's output in another order (f32): tokens may differ at near-ties only.
  same=$(paste -d'\n' ref.jsonl tp.jsonl | awk 'NR%2{a=$0;next} a==$0{n++} END{print n+0}')
  echo "tp 2: $same of 23 sequences equal the tp 1 output"
  [ "$same" -ge 20 ] || fail "tp 2 differs from tp 1 in $((23 - same)) sequences"
  ;;
bad)
  expect "--top-p 0.9 needs --temperature > 0" "$data" regenerate prompts.h5 --out x.h5 "${common[@]}" --top-p 0.9
  expect "--temperature -1 must be >= 0" "$data" regenerate prompts.h5 --out x.h5 "${common[@]}" --temperature -1
  expect "sampling: top_p = 1.5 must be in \(0, 1\]" "$data" regenerate prompts.h5 --out x.h5 "${common[@]}" --temperature 1 --top-p 1.5
  expect "stop token 4096 is outside the vocabulary \[0, 4096\)" "$data" regenerate prompts.h5 --out x.h5 "${common[@]}" --stop-token 4096
  expect "the output prompts.h5 is also an input" "$data" regenerate prompts.h5 --out prompts.h5 "${common[@]}"
  expect "no_such.h5" "$data" regenerate no_such.h5 --out x.h5 "${common[@]}"
  expect "no target given" "$data" regenerate prompts.h5 --out x.h5
  "$data" synth --out wide.h5 --sequences 3 --vocab-size 5000 > /dev/null || fail synth
  expect "the inputs have vocab_size 5000, larger than the target's vocabulary of 4096" \
    "$data" regenerate wide.h5 --out x.h5 "${common[@]}"
  [ -e x.h5 ] && fail "a refused run left x.h5"
  ;;
*) fail "unknown mode $mode" ;;
esac
echo
echo OK
