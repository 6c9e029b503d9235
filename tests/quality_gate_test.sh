#!/usr/bin/env bash
# The drafter-quality gate (issue 29) on configs/text-target, a small Qwen3.5-shaped target that has learned
# real text (Python sources; configs/text-target/README.md), on the CPU backend:
#   1. the demo's pipeline with a cheaper recipe: code-completion prompts of training documents
#      (prompts_train.jsonl, kind "code") -> dflash_train prepares them as prompts (data.prepare.prompts_only),
#      the target writes its greedy responses (data.regenerate), a 2-layer DFlash drafter (block 4) trains on
#      them and is exported;
#   2. the same data trains a drafter with the published anchor-inclusive training-mask bug (DFLASH_FAULT_MASK,
#      a CPU-backend hook: context keys up to the anchor itself), and an untrained drafter is the baseline;
#   3. dflash_eval runs speculative decoding with each on held-out code prompts of held-out documents
#      (prompts_heldout.jsonl; the two files share no document, checked here).
# It asserts, with margins from measured runs (below): every output equals the target's greedy decoding
# token for token; the trained drafter's tau is >= the untrained one's + MIN_GAIN; the measured tau equals
# the trainer's estimate at the same blocks within 1e-3 (the CPU proposer and the training forward share
# their arithmetic bit for bit); the anchor-inclusive bug measures a tau at least MASK_GAP below the correct
# mask's while its training log's acceptance is LOG_GAP above it (training with the anchor's own features in
# view learns to read the next token from them, which decoding never has: the "high training accuracy, low
# acceptance" that users report). The causal-in-block bug (a drafter trained causal inside the block, served
# the full block) is trained and printed with GATE_CAUSAL=1, not asserted: on this target it measured within
# -0.03 .. +0.03 of the correct mask in five settings (docs/evaluation.md): nothing to separate.
# Usage: quality_gate_test.sh DFLASH_TRAIN DFLASH_EVAL TEXT_CONFIG (configs/text.yaml) WORKDIR
set -uo pipefail
train=$1 ev=$2 cfg=$3 work=$4
T=$(cd "$(dirname "$cfg")/text-target" && pwd)
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
# The gate's recipe (the demo's, configs/text.yaml, is larger: every code prompt, 3,000 steps).
prompts=${GATE_PROMPTS:-1200} steps=${GATE_STEPS:-1500} anchors=${GATE_ANCHORS:-16} heldout=${GATE_HELDOUT:-48}
block=${GATE_BLOCK:-4} gamma=${GATE_GAMMA:-4}
grep '"kind": "code"' "$T/prompts_train.jsonl" | head -n "$prompts" >prompts.jsonl
grep '"kind": "code"' "$T/prompts_heldout.jsonl" | head -n "$heldout" >heldout.jsonl
docs() { sed -n 's/.*"doc": "\([^"]*\)".*/\1/p' "$1" | sort -u; }
shared=$(comm -12 <(docs prompts.jsonl) <(docs heldout.jsonl) | head -n 3)
[ -z "$shared" ] || fail "training and held-out prompts share documents: $shared"
[ "$(wc -l <heldout.jsonl)" -eq "$heldout" ] || fail "expected $heldout held-out code prompts"

# gate NAME [ARGS]: train NAME's drafter with the gate's recipe (after the first run, on the first run's data).
gate() {
  local name=$1
  shift
  "$train" "$cfg" --set parallel.device=cpu --set "model.target.path=$T" --set "logging.run_dir=$work/$name" \
    --set data.train=prompts.jsonl --set data.regenerate.num_prompts=0 --set training.max_steps="$steps" \
    --set training.num_anchors="$anchors" --set model.drafter.block_size="$block" --set training.gamma="$gamma" \
    --set training.seed="${GATE_SEED:-0}" --set logging.progress_bar=false \
    --set checkpoint.interval=100000 "$@" >"$work/$name.log" 2>&1 || { tail -n 5 "$work/$name.log"; fail "dflash_train ($name)"; }
}
# evaluate NAME [ARGS]: speculative decoding on the held-out prompts; the output must be the target's greedy decoding.
evaluate() {
  local name=$1
  shift
  "$ev" --model "$T" --prompts heldout.jsonl --num-prompts "$heldout" --max-new-tokens 40 --json "$work/$name.json" "$@" \
    >"$work/$name.eval" 2>&1 || { tail -n 5 "$work/$name.eval"; fail "dflash_eval ($name)"; }
  grep -q '"mismatches": 0' "$work/$name.json" || fail "$name: speculative decoding differs from the target's greedy decoding"
}
tau_of() { sed -n 's/^tau (mean acceptance length over [0-9]* steps): //p' "$work/$1.eval"; }
est_of() { sed -n "s/^  the trainer's estimate on the same prompts: \([0-9.]*\) at the same blocks.*/\1/p" "$work/$1.eval"; }
# within A B TOL: |A - B| <= TOL;  above A B M: A >= B + M.
within() { awk -v a="$1" -v b="$2" -v t="$3" 'BEGIN {d = a - b; if (d < 0) d = -d; exit !(d <= t)}'; }
above() { awk -v a="$1" -v b="$2" -v m="$3" 'BEGIN {exit !(a >= b + m)}'; }

t0=$(date +%s)
gate trained
grep -q "data: regenerated .*regenerated.h5" "$work/trained.log" || fail "the first run did not regenerate its data"
echo "correct mask: dflash_train $(( $(date +%s) - t0 )) s ($(grep -o 'regenerated .*regenerated.h5: [0-9]* sequences' "$work/trained.log"))"
data=(--set "data.prepare.path=$work/trained/data/prepared.h5" --set "data.regenerate.path=$work/trained/data/regenerated.h5")
bugs=(anchor_inclusive)
[ -n "${GATE_CAUSAL:-}" ] && bugs+=(causal_in_block)
for v in "${bugs[@]}"; do
  t0=$(date +%s)
  DFLASH_FAULT_MASK=$v gate "mask_$v" "${data[@]}"
  grep -q "data: using the regenerated data" "$work/mask_$v.log" || fail "mask_$v did not reuse the first run's data"
  echo "mask bug $v: dflash_train $(( $(date +%s) - t0 )) s"
done
evaluate trained --drafter "$work/trained/drafter" --show 1
evaluate untrained --random-drafter 2 --block-size "$block" --no-estimate
for v in "${bugs[@]}"; do evaluate "mask_$v" --drafter "$work/mask_$v/drafter" --no-estimate; done

tt=$(tau_of trained) te=$(est_of trained) tu=$(tau_of untrained)
ta=$(tau_of mask_anchor_inclusive)
acc() { grep -o 'acceptance length [0-9.]*' "$work/$1.log" | tail -n 1 | cut -d' ' -f3; }
echo "held-out code prompts ($heldout, 40 new tokens), tau:"
echo "  correct mask      $tt (the trainer's estimate at the same blocks $te; training log's acceptance $(acc trained))"
echo "  anchor-inclusive  $ta (training log's acceptance $(acc mask_anchor_inclusive))"
[ -n "${GATE_CAUSAL:-}" ] && echo "  causal-in-block   $(tau_of mask_causal_in_block) (training log's acceptance $(acc mask_causal_in_block))"
echo "  untrained         $tu"
awk '/^--- prompt 0 /{on=1} /^prompt +1:/{on=0} on' "$work/trained.eval" | head -n 16
# Margins from measured runs (GATE_SEED 0 / 1 / 2 on the 2-core development machine, commit of docs/evaluation.md's
# table): correct mask 1.664 / 1.661 / 1.621, anchor-inclusive 1.411 / 1.497 / 1.423 (gaps 0.253 / 0.164 / 0.198),
# untrained 1.000; training log's acceptance correct 1.899 / 1.885 / 1.892, anchor-inclusive 2.169 / 2.259 / 2.238.
# Each margin sits well below the smallest measured gap.
min_gain=${GATE_MIN_GAIN:-0.4} mask_gap=${GATE_MASK_GAP:-0.10} log_gap=${GATE_LOG_GAP:-0.15}
above "$tt" "$tu" "$min_gain" || fail "trained tau $tt is not >= untrained $tu + $min_gain"
within "$tt" "$te" 1e-3 || fail "measured tau $tt and the training estimate $te differ by more than 1e-3 (a train / inference mismatch)"
above "$tt" "$ta" "$mask_gap" || fail "the anchor-inclusive mask bug ($ta) is not $mask_gap below the correct mask ($tt)"
# The bug's signature that users report: its training log promises more than the correct mask's while it serves less.
above "$(acc mask_anchor_inclusive)" "$(acc trained)" "$log_gap" ||
  fail "the anchor-inclusive bug's training acceptance $(acc mask_anchor_inclusive) is not $log_gap above the correct mask's $(acc trained)"
echo OK
