#!/usr/bin/env bash
# End-to-end tests of dflash_train on the CPU backend (the tiny embedded default config; every run
# sets parallel.device=cpu, so the figures below hold on a machine with GPUs too). With
# DFLASH_TRAIN_DEVICE=cuda the same modes run on the GPU backend (scripts/gpu_train.sh): the
# margins of learn, the bit-exact resume and the checks of the other modes are the same; the
# cross-layout tolerances of mpi are bf16-level there (dp2 1e-3, tp2 2e-2: the bf16 target and
# drafter sum in other orders).
#   train_test.sh MODE DFLASH_TRAIN TARGET_CONFIG WORKDIR [MPIRUN...]
# MODE:
#   learn   the tiny run, 40 steps: the loss falls by >= 2.0 nats and the mean accuracy over block positions
#           1..B-1 rises by >= 0.025 (step 1 vs the mean of steps 31-40); checkpoint and exported drafter exist;
#           the export warm-starts a new run whose first loss is closer to the trained loss than to the fresh one;
#           dflash_eval with the trained drafter gives the target's greedy output and a tau equal to the trainer's
#           estimate at the same blocks.
#   resume  12 steps straight == 6 steps, stop (--stop-after-steps), resume, 6 steps: identical losses and
#           grad norms (bit-exact: the JSON numbers are compared as text); and resuming from the straight run's
#           ckpt-8 (written in the background while steps 9.. ran) gives its losses 9..12 bit-exact.
#   mpi     1 rank (batch 4) vs mpirun -n 2 with tp=1 (dp=2, batch 2 per group) and with tp=2 (batch 4):
#           the same loss per step within a relative 1e-9 (dp2) and 1e-4 (tp2: f32 TP target); then resuming the 1-rank checkpoint on 2 ranks is refused.
#   microbatch  batch 4 in 1 micro-batch vs batch 2 x 2 micro-batches: the same losses within 1e-9 (relative;
#           the loss is normalized by the step's global sum of weights, so the split must not matter; 1e-3 on
#           the GPU backend, whose bf16 sums run in another order).
#   world   world sizes 4 and 8 (mpirun --oversubscribe): tp=1 (dp 4 / dp 8) and tp=2 (2 / 4 groups), the
#           global batch always 8 sequences: the same loss per step as 1 rank within 1e-9 (dp) and 1e-4 (tp2);
#           tp=4 on the tiny model (2 GDN key heads) is refused on every rank with the numbers that disagree.
#   nonfinite  non-finite gradient norms injected (DFLASH_FAULT_NONFINITE_STEPS): steps 3 and 4 are skipped,
#           counted and logged and the run finishes; 3 in a row with training.skip_nonfinite_limit=3 stop the
#           run non-zero with the message naming the limit.
#   sigterm SIGTERM during a run: checkpoint at the next step boundary, exit 0; running again resumes and finishes.
#   ckptfail  a background checkpoint write that fails (DFLASH_FAULT_CHECKPOINT_WRITE) stops the run non-zero
#           before the next checkpoint, naming it; the partial directory is never resumed.
#   baddata a data file whose vocabulary is larger than the target's, a file that is not HDF5, a token id beyond the
#           vocabulary inside a file, a loss_mask value 2, and a corpus without supervised tokens are refused at
#           start-up (before the backend is made) naming the file, the dataset and the sequence; a corpus where 30% of
#           the sequences have no anchor trains with a warning that counts them.
#   never   checkpoint.resume: never in a run directory holding an earlier run's checkpoints is refused naming them,
#           and nothing of the earlier run is touched; resuming an older checkpoint into a directory with later ones
#           is refused likewise; a start in a directory whose metrics.jsonl reached no checkpoint keeps that file as
#           metrics.before-1.jsonl.
#   fulldisk  every log / metrics write fails as on a full disk from step 6 (DFLASH_FAULT_FULL_DISK_AT_STEP): the run
#           stops non-zero at step 6 naming the file, with the cut line last; the resumed run trims metrics.jsonl to
#           the checkpoint's step, finishes, and its metrics.jsonl is steps 1..12, every line valid (dflash_plot reads it).
#   baddirs a checkpoint.dir that is a file, a run dir under a file, a read-only checkpoint dir
#           (DFLASH_FAULT_READONLY) and one without room for a checkpoint (DFLASH_FAULT_FREE_BYTES) are refused at
#           start-up, before any step and before the backend is made, naming the path.
#   kill9   kill -9 mid-run (after the first checkpoint): the same command resumes from the newest complete checkpoint
#           and ends with the losses of an uninterrupted run, bit for bit, and metrics steps 1..12 once each. With
#           MPIRUN (mpi label): mpirun -n 2 (dp 2), rank 1 killed: the job ends non-zero, and resumes likewise.
#   corrupt a checkpoint whose state.json is not JSON is refused at start-up naming the file and the older complete
#           checkpoint to resume from instead; with no older one, the message says so.
set -u
mode=$1 bin=$2 tcfg=$3 work=$4
shift 4
mpirun=("$@")
device=${DFLASH_TRAIN_DEVICE:-cpu}
if [ "$device" = cuda ]; then tol_dp=1e-3 tol_tp=2e-2; else tol_dp=1e-9 tol_tp=1e-4; fi
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
# run NAME ARGS...: runs dflash_train (prefix with the mpirun words in $pre) on the tiny default, with
# 4 sequences of 4 anchor blocks per step (cheaper and less noisy than the demo's 1 sequence x 32 blocks).
run() {
  local name=$1
  shift
  echo "+ dflash_train $* (run dir $work/$name)"
  "${pre[@]}" "$bin" --set parallel.device="$device" --set "model.target.config=$tcfg" --set "logging.run_dir=$work/$name" \
    --set "data.synth.path=$work/synth.h5" --set training.batch_size=4 --set training.num_anchors=4 "$@" >"$work/$name.log" 2>&1
  local rc=$?
  tail -n 5 "$work/$name.log"
  return $rc
}
# col FILE KEY: the KEY value of every metrics line, one a line, as written.
col() { grep -o "\"$2\":[^,}]*" "$1" | cut -d: -f2; }
mean_acc() { sed -n "$2p" "$1" | grep -o '"acc":\[[^]]*\]' | sed 's/.*\[//; s/\]//' | tr , '\n' | awk '{s+=$1; n++} END {printf "%.6f", s/n}'; }
pre=()

case "$mode" in
learn)
  run learn --set training.max_steps=40 --set logging.interval=1 || fail "dflash_train exited non-zero"
  m=$work/learn/metrics.jsonl
  [ "$(wc -l <"$m")" -eq 40 ] || fail "expected 40 metric lines in $m"
  l0=$(col "$m" loss | head -n 1) l1=$(col "$m" loss | tail -n 10 | awk '{s+=$1} END {printf "%.6f", s/NR}')
  a0=$(mean_acc "$m" 1)
  a1=$(for i in $(seq 31 40); do mean_acc "$m" $i; echo; done | awk '{s+=$1} END {printf "%.6f", s/NR}')
  echo "loss at step 1 $l0 -> mean of steps 31-40 $l1; mean accuracy (positions 1..B-1) $a0 -> $a1"
  awk -v a="$l0" -v b="$l1" 'BEGIN {exit !(a - b >= 2.0)}' || fail "the loss fell by less than 2.0 ($l0 -> $l1)"
  awk -v a="$a0" -v b="$a1" 'BEGIN {exit !(b - a >= 0.025)}' || fail "the accuracy rose by less than 0.025 ($a0 -> $a1)"
  for f in drafter/config.json drafter/model.safetensors checkpoints/ckpt-40/COMMIT checkpoints/ckpt-40/optimizer.safetensors \
           checkpoints/ckpt-40/state.json checkpoints/ckpt-40/loader-g0.json checkpoints/ckpt-40/drafter/model.safetensors; do
    [ -f "$work/learn/$f" ] || fail "missing $f"
  done
  grep -q "drafter exported to $work/learn/drafter" "$work/learn.log" || fail "no 'drafter exported to' line"
  # The run ended with a checkpoint of its last step: the final drafter is that checkpoint's export
  # (the same files, hard-linked), not a second export of the same weights.
  for f in config.json model.safetensors; do
    cmp "$work/learn/drafter/$f" "$work/learn/checkpoints/ckpt-40/drafter/$f" || fail "drafter/$f differs from ckpt-40's"
    [ "$(stat -c %i "$work/learn/drafter/$f")" = "$(stat -c %i "$work/learn/checkpoints/ckpt-40/drafter/$f")" ] ||
      fail "drafter/$f is not the checkpoint's file (hard link expected on one file system)"
  done
  # The exported (Hugging Face, bf16) drafter loads back as a warm start and keeps what it learned:
  # its first loss is near the trained level, far below a fresh drafter's.
  # fast_path.json: this rank's record, rewritten at the end with the target steps that ran (the tiny
  # target: 6 GatedDeltaNet + 2 attention layers, one forward per step).
  fp=$work/learn/fast_path.json
  grep -q '"when": "end of run"' "$fp" || fail "no end-of-run fast_path.json"
  [ "$(grep -c '"rank":' "$fp")" -eq 1 ] || fail "fast_path.json should hold 1 rank"
  tr -d ' \n' <"$fp" | grep -q '"delta_rule":{"cpu":240,' || fail "fast_path.json does not count 40 x 6 delta-rule steps"
  # The trained drafter in speculative decoding (dflash_eval, beside dflash_train in the build): the
  # output is the target's own greedy decoding, and the trainer's estimate at the same blocks is the
  # measured acceptance length.
  ev=$(dirname "$bin")/../bench/dflash_eval
  if [ -x "$ev" ]; then
    "$ev" --config "$tcfg" --random-weights --drafter "$work/learn/drafter" --prompts "$work/synth.h5" --num-prompts 3 \
      --max-new-tokens 24 --device "$device" >"$work/eval.log" 2>&1 || { tail -n 5 "$work/eval.log"; fail "dflash_eval of the trained drafter failed"; }
    grep -q "outputs: all 3 prompt(s) equal target-only greedy decoding, token for token" "$work/eval.log" ||
      fail "speculative decoding with the trained drafter differs from greedy decoding"
    t=$(sed -n 's/^tau (mean acceptance length over [0-9]* steps): //p' "$work/eval.log")
    e=$(sed -n "s/^  the trainer's estimate on the same prompts: \([0-9.]*\) at the same blocks.*/\1/p" "$work/eval.log")
    echo "trained drafter: measured tau $t, the trainer's estimate at the same blocks $e"
    [ -n "$t" ] && [ "$t" = "$e" ] || fail "measured tau ($t) and the estimate at the same blocks ($e) differ"
  fi
  run warm --set training.max_steps=1 --set logging.interval=1 --set "model.drafter.warm_start=$work/learn/drafter" \
    --set checkpoint.at_end=false || fail "warm start from the exported drafter failed"
  w0=$(col "$work/warm/metrics.jsonl" loss | head -n 1)
  echo "warm start from the export: first loss $w0 (fresh: $l0, trained: $l1)"
  awk -v w="$w0" -v a="$l0" -v b="$l1" 'BEGIN {exit !(w < b + 0.5 * (a - b))}' ||
    fail "the warm-started drafter did not keep the training ($w0 vs fresh $l0, trained $l1)"
  ;;
resume)
  common=(--set training.max_steps=12 --set logging.interval=1 --set checkpoint.interval=4 --set checkpoint.keep_last=2)
  run straight "${common[@]}" || fail "straight run failed"
  run split "${common[@]}" --stop-after-steps 6 || fail "first half failed"
  grep -q "stopped at step 6" "$work/split.log" || fail "the first half did not stop at step 6"
  [ -f "$work/split/checkpoints/ckpt-6/COMMIT" ] || fail "no checkpoint at step 6"
  # An interrupted checkpoint write (no COMMIT) must be ignored by resume.
  mkdir -p "$work/split/checkpoints/ckpt-9" && echo junk >"$work/split/checkpoints/ckpt-9/state.json"
  run split "${common[@]}" || fail "second half failed"
  grep -q "resumed from .*ckpt-6 at step 6/12" "$work/split.log" || fail "the second half did not resume from ckpt-6"
  ls "$work/split/checkpoints"
  [ -d "$work/split/checkpoints/ckpt-4" ] && fail "keep_last 2 did not prune ckpt-4"
  for k in step loss grad_norm lr accept_len; do
    a=$(col "$work/straight/metrics.jsonl" $k | tr '\n' ' ') b=$(col "$work/split/metrics.jsonl" $k | tr '\n' ' ')
    echo "$k straight: $a"
    echo "$k resumed:  $b"
    [ "$a" = "$b" ] || fail "$k differs between the straight and the resumed run"
  done
  cmp "$work/straight/drafter/model.safetensors" "$work/split/drafter/model.safetensors" || fail "exported drafters differ"
  # Periodic checkpoints are written in the background while training goes on: the straight run's
  # ckpt-8 was; resuming from it gives steps 9..12 bit-exact too.
  grep -q "ckpt-8 written (.* while training went on)" "$work/straight.log" || fail "ckpt-8 was not written in the background"
  run from8 "${common[@]}" --set "checkpoint.resume=$work/straight/checkpoints/ckpt-8" || fail "resume from ckpt-8 failed"
  a=$(col "$work/straight/metrics.jsonl" loss | tail -n 4 | tr '\n' ' ') b=$(col "$work/from8/metrics.jsonl" loss | tr '\n' ' ')
  echo "loss 9..12 straight: $a"
  echo "loss 9..12 from ckpt-8: $b"
  [ "$a" = "$b" ] || fail "the run resumed from the background-written ckpt-8 differs"
  ;;
mpi)
  common=(--set training.max_steps=6 --set logging.interval=1 --set checkpoint.interval=100)
  run one "${common[@]}" --set training.batch_size=4 || fail "1-rank run failed"
  pre=("${mpirun[@]}" -n 2)
  run dp2 "${common[@]}" --set training.batch_size=2 --set parallel.tp=1 || fail "mpirun -n 2, tp=1 failed"
  run tp2 "${common[@]}" --set training.batch_size=4 --set parallel.tp=2 || fail "mpirun -n 2, tp=2 failed"
  ref=$(col "$work/one/metrics.jsonl" loss | tr '\n' ' ')
  echo "loss 1 rank:      $ref"
  # dp2 differs only in the order of f64 sums; tp2 also in the f32 sums of the tensor-parallel target.
  for r in dp2:$tol_dp tp2:$tol_tp; do
    tol=${r#*:} r=${r%%:*}
    got=$(col "$work/$r/metrics.jsonl" loss | tr '\n' ' ')
    echo "loss $r:          $got"
    paste <(col "$work/one/metrics.jsonl" loss) <(col "$work/$r/metrics.jsonl" loss) |
      awk 'BEGIN {n = 0; worst = 0} {n++; d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > worst) worst = d}
           END {printf "  max relative difference %.3g over %d steps\n", worst, n; exit !(n == 6 && worst <= tol)}' tol="$tol" ||
      fail "$r losses differ from the 1-rank run by more than $tol (relative)"
  done
  [ "$(grep -c '"rank":' "$work/tp2/fast_path.json")" -eq 2 ] || fail "tp2's fast_path.json should hold 2 ranks"
  # The 1-rank run's checkpoint cannot be resumed on 2 ranks.
  cp -r "$work/one" "$work/one2"
  if run one2 "${common[@]}" --set training.max_steps=8 --set training.batch_size=2; then fail "resume on 2 ranks was accepted"; fi
  grep -q "was written by 1 rank(s) with tp 1; this run has 2 rank(s) with tp 1" "$work/one2.log" ||
    fail "no clear message for a different world size"
  ;;
world)
  common=(--set training.max_steps=4 --set logging.interval=1 --set checkpoint.interval=100 --set checkpoint.at_end=false)
  run one "${common[@]}" --set training.batch_size=8 || fail "1-rank run failed"
  echo "loss 1 rank:  $(col "$work/one/metrics.jsonl" loss | tr '\n' ' ')"
  for cfg in 4:1:2:1e-9 4:2:4:1e-4 8:1:1:1e-9 8:2:2:1e-4; do
    IFS=: read -r n t b tol <<<"$cfg"
    name=n${n}_tp$t
    pre=("${mpirun[@]}" -n "$n")  # (mpirun already has --oversubscribe)
    run "$name" "${common[@]}" --set training.batch_size="$b" --set parallel.tp="$t" || fail "mpirun -n $n, tp=$t failed"
    echo "loss $name: $(col "$work/$name/metrics.jsonl" loss | tr '\n' ' ')"
    paste <(col "$work/one/metrics.jsonl" loss) <(col "$work/$name/metrics.jsonl" loss) |
      awk 'BEGIN {n = 0; worst = 0} {n++; d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > worst) worst = d}
           END {printf "  max relative difference %.3g over %d steps\n", worst, n; exit !(n == 4 && worst <= tol)}' tol="$tol" ||
      fail "$name losses differ from the 1-rank run by more than $tol (relative)"
    # Only rank 0 writes metrics; every rank writes its own log.
    [ "$(ls "$work/$name/logs" | wc -l)" -eq "$n" ] || fail "$name: expected $n per-rank logs in $work/$name/logs"
  done
  pre=("${mpirun[@]}" -n 4)
  if run tp4 "${common[@]}" --set parallel.tp=4; then fail "tp=4 on the tiny model was accepted"; fi
  [ "$(grep -c "linear_num_key_heads" "$work/tp4.log")" -ge 4 ] || fail "tp=4: not every rank named the GDN key heads"
  ;;
nonfinite)
  common=(--set training.max_steps=8 --set logging.interval=1 --set checkpoint.interval=100 --set checkpoint.at_end=false)
  DFLASH_FAULT_NONFINITE_STEPS=3,4 run skip "${common[@]}" || fail "the run with two non-finite steps failed"
  [ "$(grep -c "update skipped" "$work/skip.log")" -eq 2 ] || fail "expected 2 'update skipped' warnings"
  grep -q "step 4: non-finite loss .* or grad norm nan: update skipped (2 in a row, 2 in all)" "$work/skip.log" ||
    fail "no warning for step 4 with the counts"
  [ "$(col "$work/skip/metrics.jsonl" skipped | tail -n 1)" = 2 ] || fail "metrics do not count 2 skipped steps"
  grep -q "done: 8 steps (2 skipped as non-finite)" "$work/skip.log" || fail "the summary does not count the skipped steps"
  if DFLASH_FAULT_NONFINITE_STEPS=2,3,4,5,6 run stop "${common[@]}" --set training.skip_nonfinite_limit=3; then
    fail "3 non-finite steps in a row did not stop the run"
  fi
  grep -q "3 non-finite steps in a row (training.skip_nonfinite_limit = 3): stopping at step 4" "$work/stop.log" ||
    fail "no clear message when the limit is reached"
  ;;
microbatch)
  common=(--set training.max_steps=6 --set logging.interval=1 --set checkpoint.interval=100)
  run mb1 "${common[@]}" --set training.batch_size=4 --set training.micro_batches=1 || fail "1 micro-batch run failed"
  run mb2 "${common[@]}" --set training.batch_size=2 --set training.micro_batches=2 || fail "2 micro-batch run failed"
  echo "loss 1 x 4: $(col "$work/mb1/metrics.jsonl" loss | tr '\n' ' ')"
  echo "loss 2 x 2: $(col "$work/mb2/metrics.jsonl" loss | tr '\n' ' ')"
  paste <(col "$work/mb1/metrics.jsonl" loss) <(col "$work/mb2/metrics.jsonl" loss) |
    awk 'BEGIN {n = 0; worst = 0} {n++; d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > worst) worst = d}
         END {printf "  max relative difference %.3g over %d steps\n", worst, n; exit !(n == 6 && worst <= tol)}' tol="$tol_dp" ||
    fail "the losses depend on the micro-batch split"
  ;;
sigterm)
  # SIGTERM mid-run: a checkpoint at the next step boundary, exit 0; the same command resumes and finishes.
  # (A tiny step takes ~4 ms on a GPU: enough steps there that the signal lands mid-run.)
  n=30
  [ "$device" = cuda ] && n=2000
  common=(--set training.max_steps=$n --set logging.interval=1 --set checkpoint.interval=100000)
  run sig "${common[@]}" &
  pid=$!
  for _ in $(seq 600); do
    [ -f "$work/sig/metrics.jsonl" ] && [ "$(wc -l <"$work/sig/metrics.jsonl")" -ge 3 ] && break
    sleep 0.1
  done
  kill -TERM "$(pgrep -P $pid -f dflash_train | head -n 1)" 2>/dev/null || kill -TERM $pid
  wait $pid || fail "the signalled run did not exit 0"
  grep -q "stop requested: writing a checkpoint at step" "$work/sig.log" || fail "no stop message"
  s=$(grep -o "stopped at step [0-9]*" "$work/sig.log" | grep -o "[0-9]*$")
  [ -n "$s" ] && [ "$s" -lt $n ] || fail "the run was not stopped early"
  [ -f "$work/sig/checkpoints/ckpt-$s/COMMIT" ] || fail "no checkpoint at step $s"
  run sig "${common[@]}" || fail "the resumed run failed"
  grep -q "resumed from .*ckpt-$s at step $s/$n" "$work/sig.log" || fail "did not resume from ckpt-$s"
  [ "$(col "$work/sig/metrics.jsonl" step | tr '\n' ' ')" = "$(seq 1 $n | tr '\n' ' ')" ] || fail "metrics steps are not 1..$n"
  ;;
baddata)
  data_tool=${mpirun[0]}
  "$data_tool" synth --out "$work/big_vocab.h5" --sequences 20 --min-len 8 --max-len 16 --vocab-size 5000 --seed 1 || fail "synth failed"
  if run bad --set data.synth.enabled=false --set "data.files=[$work/big_vocab.h5]"; then fail "bad data was accepted"; fi
  grep -q "big_vocab.h5 has vocab_size 5000, larger than the target's vocabulary of 4096" "$work/bad.log" ||
    fail "no clear message for the bad data"
  echo "not an HDF5 file" >"$work/junk.h5"
  if run junk --set data.synth.enabled=false --set "data.files=[$work/junk.h5]"; then fail "a non-HDF5 file was accepted"; fi
  grep -q "error while opening dataset file '$work/junk.h5'" "$work/junk.log" || fail "no clear message for the non-HDF5 file"
  make_bad=${mpirun[1]}
  # Defects inside a file whose attributes are right: found at start-up, before the backend is made.
  for k in "id_out_of_range:/input_ids: sequence 13 (global sequence 13), position 5: token id 4103 is outside \[0, vocab_size = 4096)" \
           "mask_value:/loss_mask: sequence 13 (global sequence 13), position 5: value 2 is not 0 or 1" \
           "no_supervised:no token of the 20 sequences in $work/no_supervised.h5 is supervised"; do
    kind=${k%%:*} want=${k#*:}
    "$make_bad" "$kind" "$work/$kind.h5" >/dev/null || fail "make_bad_dataset $kind failed"
    if run "$kind" --set data.synth.enabled=false --set "data.files=[$work/$kind.h5]"; then fail "$kind was accepted"; fi
    grep -q -- "$want" "$work/$kind.log" || fail "$kind: no message '$want'"
    grep -q "backend:" "$work/$kind.log" && fail "$kind: found only after the backend was made"
  done
  grep -q "the target's vocabulary has 4096 ids" "$work/id_out_of_range.log" || fail "the hint does not name the target's vocabulary"
  "$make_bad" few_anchors "$work/few.h5" >/dev/null || fail "make_bad_dataset few_anchors failed"
  run few --set data.synth.enabled=false --set "data.files=[$work/few.h5]" --set training.max_steps=2 --set logging.interval=1 ||
    fail "the corpus with some anchor-less sequences was refused"
  grep -q "data: 6 of 20 sequences (30.0%) have no two consecutive supervised tokens within data.max_length" "$work/few.log" ||
    fail "no warning counting the sequences without an anchor"
  ;;
never)
  # A finished 12-step run (complete checkpoints 8 and 12, keep_last 2) is copied; the copy is started again with
  # checkpoint.resume: never and a checkpoint every 10 steps (issue 15's reproduction).
  common=(--set training.max_steps=12 --set logging.interval=1 --set checkpoint.interval=4 --set checkpoint.keep_last=2)
  run first "${common[@]}" || fail "the first run failed"
  cp -a "$work/first" "$work/copy"
  if run copy --set training.max_steps=20 --set logging.interval=1 --set checkpoint.interval=10 --set checkpoint.resume=never; then
    fail "checkpoint.resume: never beside an earlier run's checkpoints was accepted"
  fi
  grep -q "checkpoint.resume: never, but $work/copy/checkpoints holds complete checkpoints of an earlier run (ckpt-8, ckpt-12)" \
    "$work/copy.log" || fail "no message naming the earlier checkpoints"
  grep -q "backend:" "$work/copy.log" && fail "the refusal came after the backend was made"
  for f in checkpoints/ckpt-8/COMMIT checkpoints/ckpt-12/COMMIT checkpoints/ckpt-12/optimizer.safetensors metrics.jsonl; do
    cmp "$work/first/$f" "$work/copy/$f" || fail "the earlier run's $f was changed"
  done
  # An older checkpoint resumed into the directory that holds a later one: refused, nothing touched.
  if run copy --set training.max_steps=20 --set checkpoint.resume="$work/copy/checkpoints/ckpt-8"; then
    fail "resuming ckpt-8 beside ckpt-12 was accepted"
  fi
  grep -q "is at step 8, but $work/copy/checkpoints already holds later checkpoints (ckpt-12)" "$work/copy.log" ||
    fail "no message naming the later checkpoint"
  cmp "$work/first/metrics.jsonl" "$work/copy/metrics.jsonl" || fail "metrics.jsonl was changed"
  # The complete run says there is nothing to train and does not suggest checkpoint.resume: never.
  run copy "${common[@]}" || fail "re-running the complete run failed"
  grep -q "nothing to train" "$work/copy.log" || fail "no 'nothing to train' message"
  grep "nothing to train" "$work/copy.log" | grep -q "resume: never" && fail "the message still suggests checkpoint.resume: never"
  # A run directory whose metrics.jsonl reached no checkpoint (here: checkpoints off): a new start keeps it aside.
  run nockpt --set training.max_steps=3 --set logging.interval=1 --set checkpoint.interval=100 --set checkpoint.at_end=false ||
    fail "the run without checkpoints failed"
  cp "$work/nockpt/metrics.jsonl" "$work/nockpt.first.jsonl"
  run nockpt --set training.max_steps=2 --set logging.interval=1 --set checkpoint.interval=100 --set checkpoint.at_end=false ||
    fail "the second start without checkpoints failed"
  cmp "$work/nockpt.first.jsonl" "$work/nockpt/metrics.before-1.jsonl" || fail "the earlier metrics.jsonl was not kept aside"
  [ "$(wc -l <"$work/nockpt/metrics.jsonl")" -eq 2 ] || fail "the new metrics.jsonl should hold the new run's 2 lines"
  ;;
fulldisk)
  plot=${mpirun[0]}
  common=(--set training.max_steps=12 --set logging.interval=1 --set checkpoint.interval=4 --set checkpoint.keep_last=2)
  if DFLASH_FAULT_FULL_DISK_AT_STEP=6 run full "${common[@]}"; then fail "the run went on with a full disk"; fi
  grep -Eq "writing '$work/full/(metrics.jsonl|logs/rank-0.log)' failed: No space left on device" "$work/full.log" ||
    fail "no message naming the file that could not be written"
  m=$work/full/metrics.jsonl
  [ "$(tail -c 1 "$m" | od -An -c | tr -d ' ')" != '\n' ] || fail "expected the cut line last in $m"
  [ "$(col "$m" step | tail -n 1 | tr -dc 0-9)" -le 6 ] || fail "the run wrote metrics past step 6"
  run full "${common[@]}" || fail "the resumed run failed"
  grep -q "resumed from .*ckpt-4 at step 4/12" "$work/full.log" || fail "did not resume from ckpt-4"
  grep -q "metrics: kept 4 line(s) of $m up to step 4; dropped 1 after it and 1 cut or invalid" "$work/full.log" ||
    fail "metrics.jsonl was not trimmed to the checkpoint's step"
  [ "$(col "$m" step | tr '\n' ' ')" = "$(seq 1 12 | tr '\n' ' ')" ] || fail "metrics steps are not 1..12"
  "$plot" "$work/full" >"$work/plot.log" 2>&1 || { cat "$work/plot.log"; fail "dflash_plot refused the resumed metrics.jsonl"; }
  grep -q "12 metric lines" "$work/plot.log" || fail "dflash_plot did not read 12 lines"
  ;;
baddirs)
  common=(--set training.max_steps=4 --set logging.interval=1)
  # each: name, expected message, settings
  check_refused() {
    local name=$1 want=$2
    shift 2
    if run "$name" "${common[@]}" "$@"; then fail "$name: accepted"; fi
    grep -q -- "$want" "$work/$name.log" || fail "$name: no message '$want'"
    grep -Eq "backend:|step 1/" "$work/$name.log" && fail "$name: refused only after the backend was made"
    return 0
  }
  touch "$work/a_file"
  check_refused ckfile "checkpoint.dir '$work/a_file' is a file, not a directory" --set checkpoint.dir="$work/a_file"
  check_refused rundir "logging.run_dir '$work/a_file/run' cannot be created: '$work/a_file' is a file, not a directory" \
    --set logging.run_dir="$work/a_file/run"
  DFLASH_FAULT_READONLY="$work/ro" check_refused readonly "checkpoint.dir '$work/ro/ck' is not writable: Read-only file system" \
    --set checkpoint.dir="$work/ro/ck"
  DFLASH_FAULT_FREE_BYTES="1000000@$work/small" check_refused full \
    "checkpoint.dir '$work/small' has 976.6 KiB free, less than one checkpoint of this drafter" --set checkpoint.dir="$work/small"
  DFLASH_FAULT_FREE_BYTES="1000000@$work/runfull" check_refused runfull "logging.run_dir '$work/runfull' has 976.6 KiB free"
  ;;
kill9)
  common=(--set training.max_steps=12 --set logging.interval=1 --set checkpoint.interval=4 --set checkpoint.keep_last=2)
  n=1
  if [ ${#mpirun[@]} -gt 0 ]; then pre=("${mpirun[@]}" -n 2) n=2; common+=(--set training.batch_size=2); fi
  run straight "${common[@]}" || fail "the uninterrupted run failed"
  run k "${common[@]}" &
  pid=$!
  for _ in $(seq 900); do
    [ -f "$work/k/metrics.jsonl" ] && [ "$(wc -l <"$work/k/metrics.jsonl")" -ge 6 ] && break
    sleep 0.1
  done
  # The last rank's process (rank 0 alone without mpirun): OMPI_COMM_WORLD_RANK tells them apart.
  victim=
  for p in $(pgrep -f "dflash_train.*$work/k"); do
    r=$(tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | sed -n 's/^OMPI_COMM_WORLD_RANK=//p')
    [ "$(cat /proc/$p/comm 2>/dev/null)" = dflash_train ] || continue
    if [ "$n" = 1 ] || [ "$r" = $((n - 1)) ]; then victim=$p; fi
  done
  [ -n "$victim" ] || fail "no dflash_train process to kill"
  kill -9 "$victim"
  if wait $pid; then fail "the killed run exited 0"; fi
  run k "${common[@]}" || fail "the run after kill -9 failed"
  grep -Eq "resumed from .*ckpt-(4|8) at step (4|8)/12" "$work/k.log" || fail "did not resume from a complete checkpoint"
  a=$(col "$work/straight/metrics.jsonl" loss | tr '\n' ' ') b=$(col "$work/k/metrics.jsonl" loss | tr '\n' ' ')
  echo "loss uninterrupted: $a"
  echo "loss after kill -9: $b"
  [ "$a" = "$b" ] || fail "the resumed run's losses differ from the uninterrupted run's"
  [ "$(col "$work/k/metrics.jsonl" step | tr '\n' ' ')" = "$(seq 1 12 | tr '\n' ' ')" ] || fail "metrics steps are not 1..12"
  ;;
corrupt)
  common=(--set training.max_steps=12 --set logging.interval=1 --set checkpoint.interval=4 --set checkpoint.keep_last=2)
  run c "${common[@]}" --set training.max_steps=8 || fail "the first run failed"
  printf '{"step": 8, "world": ' >"$work/c/checkpoints/ckpt-8/state.json"
  if run c "${common[@]}"; then fail "a corrupt state.json was accepted"; fi
  grep -q "checkpoint $work/c/checkpoints/ckpt-8 cannot be resumed: $work/c/checkpoints/ckpt-8/state.json is corrupt (.*parse error" \
    "$work/c.log" || fail "no message naming the corrupt state.json"
  grep -q "an older complete checkpoint exists: $work/c/checkpoints/ckpt-4 (step 4); move $work/c/checkpoints/ckpt-8 out of" \
    "$work/c.log" || fail "the message does not name the older checkpoint"
  grep -q "backend:" "$work/c.log" && fail "the corrupt checkpoint was found only after the backend was made"
  mv "$work/c/checkpoints/ckpt-8" "$work/ckpt-8.corrupt"  # as the hint says
  run c "${common[@]}" || fail "resuming the older checkpoint failed"
  grep -q "resumed from .*ckpt-4 at step 4/12" "$work/c.log" || fail "did not resume from ckpt-4"
  # The only checkpoint corrupt: the message says there is no older one.
  run one "${common[@]}" --set training.max_steps=4 || fail "the 4-step run failed"
  echo '[1, 2]' >"$work/one/checkpoints/ckpt-4/state.json"
  if run one "${common[@]}"; then fail "a state.json that is not an object was accepted"; fi
  grep -q "state.json is corrupt (it is not a JSON object)" "$work/one.log" || fail "no message for a non-object state.json"
  grep -q "no other complete checkpoint exists under $work/one/checkpoints" "$work/one.log" || fail "no 'no other checkpoint' hint"
  ;;
ckptfail)
  # A background checkpoint write that fails (injected at step 4) stops the run non-zero with a message
  # naming the checkpoint; it leaves no COMMIT marker, and a resume ignores it.
  common=(--set training.max_steps=12 --set logging.interval=1 --set checkpoint.interval=4 --set checkpoint.at_end=false)
  if DFLASH_FAULT_CHECKPOINT_WRITE=4 run fault "${common[@]}"; then fail "the run with a failed checkpoint write exited 0"; fi
  grep -q "checkpoint .*ckpt-4 could not be written: injected fault" "$work/fault.log" || fail "no message naming ckpt-4"
  [ -f "$work/fault/checkpoints/ckpt-4/COMMIT" ] && fail "the failed checkpoint has a COMMIT marker"
  s=$(col "$work/fault/metrics.jsonl" step | tail -n 1)
  [ "$s" -lt 8 ] || fail "the run went on to step $s after the failed write"
  run fault "${common[@]}" || fail "the run after the failed write failed"
  grep -q "no complete checkpoint under .*: starting at step 0" "$work/fault.log" || fail "the incomplete ckpt-4 was not ignored"
  ;;
*) fail "unknown mode $mode" ;;
esac
echo "OK"
