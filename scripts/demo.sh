#!/usr/bin/env bash
# The main job on the embedded default, end to end: dflash_train regenerates the responses of a
# synthetic prompt corpus with the tiny Qwen3.5-style target (configs/tiny, seeded random weights)
# on first use, trains a 2-layer DFlash drafter on the target's own responses on the CPU backend
# (loss / accuracy / acceptance length logged, checkpoints under runs/tiny/checkpoints), exports it
# (Hugging Face format) to runs/tiny/drafter; then dflash_eval runs speculative decoding with it on
# held-out prompts and prints the measured acceptance length (tau) beside the trainer's estimate,
# and checks that the output is the target's own greedy decoding, token for token.
# Running it again resumes from the newest complete checkpoint (checkpoint.resume: auto) and
# reuses the regenerated data.
# It ends by saying what the numbers mean and what to run next on your own model and data.
# Usage: scripts/demo.sh [dflash_train options, e.g. --set training.max_steps=100]
source "$(dirname "$0")/common.sh"
ensure_packages
# What the demo runs, and the programs the README names next: dflash_doctor (which kernels run, and
# a live check of them on a GPU), dflash_features (the target's hidden states), and in a CUDA build
# target_bench (the target forward's speed). scripts/test.sh builds the rest.
DFLASH_TARGETS="dflash_train dflash_plot dflash_data_tool dflash_eval dflash_doctor dflash_features" configure_and_build
if grep -qE '^build (bench/)?target_bench:' "$DFLASH_BUILD/build.ninja"; then
  DFLASH_TARGETS="target_bench" configure_and_build
fi
cd "$DFLASH_ROOT"
say "training the tiny drafter (dflash_train on the embedded configs/tiny.yaml)"
"$DFLASH_BUILD/trainer/dflash_train" "$@"
"$DFLASH_BUILD/bench/dflash_plot" runs/tiny
say "speculative decoding with the trained drafter on 16 held-out prompts (dflash_eval)"
"$DFLASH_BUILD/data/dflash_data" synth --out runs/tiny/data/heldout.h5 --sequences 16 --min-len 24 --max-len 64 \
  --vocab-size 16 --seed 1 >/dev/null
"$DFLASH_BUILD/bench/dflash_eval" --config configs/tiny/config.json --random-weights --drafter runs/tiny/drafter \
  --prompts runs/tiny/data/heldout.h5 --max-new-tokens 40 --json runs/tiny/eval.json |
  grep -E "^tau|estimate on the same|histogram|^outputs"
say "exported drafter: $DFLASH_ROOT/runs/tiny/drafter (metrics: runs/tiny/metrics.jsonl, charts: runs/tiny/metrics.html, speculative decoding: runs/tiny/eval.json)"
B="${DFLASH_BUILD#"$DFLASH_ROOT"/}"
cat >&2 <<EOF

What the numbers mean
  tau       tokens accepted per target step in speculative decoding: the drafter proposes a block, the
            target checks it in one step and keeps the longest prefix it agrees with plus its own next
            token. An untrained drafter gives 1.00 (the target's own token only); every token above it
            is a target step saved. The speed-up follows tau, less the drafter's own time.
  estimate  the trainer's prediction of tau from the drafter's accuracy at each block position (the
            "accept" column of dflash_train's log), on the same prompts: "at the same blocks" equals the
            measured tau, so the training log tells what decoding will get; "at every generated
            position" starts a block at each position of the output, as training draws its anchors
            (decoding starts a block only where the previous one ended, so the two differ).
  outputs   speculative decoding changes the speed, never the text: equal to the target's greedy output.

Next, on your own model and data (a Qwen3.5 / Qwen3.6 hybrid in Hugging Face format):
  $B/data/dflash_data convert rows.jsonl --vocab-size 248320 --out data/train.h5    # tokenized JSONL rows -> HDF5
  $B/trainer/dflash_train configs/my-model.yaml --set model.target.path=/models/MyModel --set data.files=[data/train.h5]
  $B/bench/dflash_eval --model /models/MyModel --drafter runs/my-model/drafter --prompts heldout.h5 --device cuda
  $B/target_model/dflash_doctor --model /models/MyModel             # on a GPU: which kernels run, checked live
configs/my-model.yaml says what each key does; the run's first log lines show every setting and where it came from.
EOF
