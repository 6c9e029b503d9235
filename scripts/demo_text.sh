#!/usr/bin/env bash
# The text demo (issue 29), end to end on the CPU: dflash_train on configs/text.yaml prepares the chat
# prompts of configs/text-target/prompts_train.jsonl (documents of the training split) with the target's
# chat template, regenerates their responses with the text target (a small Qwen3.5-shaped model trained on
# real text: configs/text-target/README.md), trains the 2-layer DFlash drafter on them and exports it to
# runs/text/drafter; then the held-out chat prompts (prompts_heldout.jsonl: held-out documents only,
# checked here) are prepared the same way and dflash_eval measures the drafter by speculative decoding
# on them: tau, the trainer's estimate, and that the output is the target's greedy decoding.
# Running it again resumes from the newest checkpoint and reuses the prepared and regenerated data.
# Usage: scripts/demo_text.sh [dflash_train options, e.g. --set training.max_steps=100]
source "$(dirname "$0")/common.sh"
ensure_packages
DFLASH_TARGETS="dflash_train dflash_plot dflash_data_tool dflash_eval" configure_and_build
cd "$DFLASH_ROOT"
T=configs/text-target
# The two prompt lists come from disjoint documents (each row names its "doc").
docs() { sed -n 's/.*"doc": "\([^"]*\)".*/\1/p' "$1" | sort -u; }
shared=$(comm -12 <(docs $T/prompts_train.jsonl) <(docs $T/prompts_heldout.jsonl) | head -n 3)
[ -z "$shared" ] || { say "prompts_train.jsonl and prompts_heldout.jsonl share documents: $shared"; exit 1; }
say "training the drafter on the text target (dflash_train configs/text.yaml)"
"$DFLASH_BUILD/trainer/dflash_train" configs/text.yaml "$@"
"$DFLASH_BUILD/bench/dflash_plot" runs/text
say "speculative decoding with the trained drafter on 16 held-out chat prompts (dflash_eval)"
grep '"messages"' $T/prompts_heldout.jsonl >runs/text/data/heldout_chat.jsonl
"$DFLASH_BUILD/data/dflash_data" prepare runs/text/data/heldout_chat.jsonl --tokenizer $T --out runs/text/data/heldout.h5 \
  --no-progress >/dev/null
"$DFLASH_BUILD/bench/dflash_eval" --model $T --drafter runs/text/drafter --prompts runs/text/data/heldout.h5 --num-prompts 16 \
  --max-new-tokens 40 --stop-token 4092 --stop-token 4090 --json runs/text/eval.json |
  grep -E "^tau|estimate on the same|histogram|per block position|^outputs"
say "exported drafter: $DFLASH_ROOT/runs/text/drafter (metrics: runs/text/metrics.jsonl, charts: runs/text/metrics.html, speculative decoding: runs/text/eval.json)"
