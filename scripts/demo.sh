#!/usr/bin/env bash
# The main job on the embedded default: dflash_train trains a 2-layer DFlash drafter for the tiny
# Qwen3.5-style target (configs/tiny, seeded random weights) on a synthetic corpus made on first use,
# on the CPU backend, logging loss / accuracy / acceptance length, checkpointing under
# runs/tiny/checkpoints and exporting the drafter (Hugging Face format) to runs/tiny/drafter.
# Running it again resumes from the newest complete checkpoint (checkpoint.resume: auto).
# Usage: scripts/demo.sh [dflash_train options, e.g. --set training.max_steps=100]
#        mpirun -n 2 is not used here; see tests/train_test.sh for the multi-rank runs.
source "$(dirname "$0")/common.sh"
ensure_packages
DFLASH_TARGETS="dflash_train dflash_plot" configure_and_build  # only what the demo runs (scripts/test.sh builds the rest)
say "training the tiny drafter (dflash_train on the embedded configs/tiny.yaml)"
cd "$DFLASH_ROOT"
"$DFLASH_BUILD/trainer/dflash_train" "$@"
"$DFLASH_BUILD/trainer/dflash_plot" runs/tiny
say "exported drafter: $DFLASH_ROOT/runs/tiny/drafter (metrics: runs/tiny/metrics.jsonl, charts: runs/tiny/metrics.html)"
