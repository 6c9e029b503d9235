#!/usr/bin/env bash
# The main job on the embedded default. For now: the tiny Qwen3.5-style target (configs/tiny,
# seeded random weights) runs forward on the CPU reference over three token sequences and saves
# the hidden states of every layer to runs/demo/features.safetensors.
# Usage: scripts/demo.sh [extra dflash_features options]
source "$(dirname "$0")/common.sh"
ensure_packages
configure_and_build
say "running the tiny target forward"
"$DFLASH_BUILD/target_model/dflash_features" \
  --config "$DFLASH_ROOT/configs/tiny/config.json" --random-weights --seed 0 \
  --tokens-file "$DFLASH_ROOT/configs/tiny/demo_tokens.txt" --layers all --final-norm \
  --out "$DFLASH_ROOT/runs/demo/features.safetensors" "$@"
