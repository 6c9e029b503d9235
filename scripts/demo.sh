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
# Usage: scripts/demo.sh [dflash_train options, e.g. --set training.max_steps=100]
source "$(dirname "$0")/common.sh"
ensure_packages
# Only what the demo runs (scripts/test.sh builds the rest).
DFLASH_TARGETS="dflash_train dflash_plot dflash_data_tool dflash_eval" configure_and_build
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
