#!/usr/bin/env bash
# The demo, end to end on the CPU: a DFlash drafter for configs/text-target, a small Qwen3.5-shaped target that
# has learned real text (Python sources; configs/text-target/README.md says how scripts/make_text_target.py made
# it). dflash_train on configs/text.yaml prepares the code-completion prompts of training documents as prompts,
# has the target write its own greedy completions (made on first use, reused after), trains a 2-layer drafter
# on them (loss / accuracy / acceptance length logged, checkpoints under runs/text/checkpoints) and exports it
# in Hugging Face format to runs/text/drafter; then dflash_eval runs speculative decoding with it on the code
# prompts of held-out documents (no document is in both files: checked here) and prints the measured
# acceptance length (tau) beside the trainer's estimate, two decoded outputs with the drafter's accepted tokens
# marked, and that the output is the target's own greedy decoding, token for token.
# Running it again resumes from the newest complete checkpoint (checkpoint.resume: auto) and reuses the data.
# It ends by saying what the numbers mean and what to run next on your own model and data.
# Usage: scripts/demo.sh [dflash_train options, e.g. --set training.max_steps=300]
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
T=configs/text-target
docs() { sed -n 's/.*"doc": "\([^"]*\)".*/\1/p' "$1" | sort -u; }
shared=$(comm -12 <(docs $T/prompts_code.jsonl) <(docs $T/prompts_heldout.jsonl) | head -n 3)
[ -z "$shared" ] || { say "prompts_code.jsonl and prompts_heldout.jsonl share documents: $shared"; exit 1; }
say "training a drafter for the text target (dflash_train configs/text.yaml)"
"$DFLASH_BUILD/trainer/dflash_train" configs/text.yaml "$@"
"$DFLASH_BUILD/bench/dflash_plot" runs/text
say "speculative decoding with the trained drafter on the 48 code prompts of held-out documents (dflash_eval)"
grep '"kind": "code"' $T/prompts_heldout.jsonl >runs/text/data/heldout_code.jsonl
"$DFLASH_BUILD/bench/dflash_eval" --model $T --drafter runs/text/drafter --prompts runs/text/data/heldout_code.jsonl \
  --num-prompts 48 --max-new-tokens 40 --show 2 --json runs/text/eval.json --html runs/text/eval.html |
  grep -vE "^prompt +[0-9]+:|^== dflash_eval|^target |^drafter |^[0-9]+ prompt\(s\)|^stop tokens|^$"
say "exported drafter: $DFLASH_ROOT/runs/text/drafter (metrics: runs/text/metrics.jsonl, charts: runs/text/metrics.html, speculative decoding: runs/text/eval.json, runs/text/eval.html)"
B="${DFLASH_BUILD#"$DFLASH_ROOT"/}"
cat >&2 <<EOF

What the numbers mean
  tau       tokens accepted per target step in speculative decoding: the drafter proposes a block, the
            target checks it in one step and keeps the longest prefix it agrees with plus its own next
            token. An untrained drafter gives 1.00 (the target's own token only); every token above it
            is a target step saved. The speed-up follows tau, less the drafter's own time (on this
            4.3 M-parameter target the drafter costs about as much as the target: the speed-up here is not
            the point, the acceptance is).
  estimate  the trainer's prediction of tau from the drafter's accuracy at each block position (the
            "accept" column of dflash_train's log), on the same prompts: "at the same blocks" equals the
            measured tau, so the training log tells what decoding will get; "at every generated
            position" starts a block at each position of the output, as training draws its anchors
            (decoding starts a block only where the previous one ended, so the two differ).
  [..]      in the decoded outputs, the tokens of each step that the drafter proposed and the target kept.
  outputs   speculative decoding changes the speed, never the text: equal to the target's greedy output.

Next, on your own model and data (a Qwen3.5 / Qwen3.6 hybrid in Hugging Face format, chat JSONL):
  $B/data/dflash_data prepare chat.jsonl --tokenizer /models/MyModel --out data/train.h5   # messages / ShareGPT / text rows
  $B/trainer/dflash_train configs/my-model.yaml --set model.target.path=/models/MyModel --set data.train=chat.jsonl
  $B/bench/dflash_eval --model /models/MyModel --drafter runs/my-model/drafter --prompts heldout.jsonl --device cuda --show 2
  $B/target_model/dflash_doctor --model /models/MyModel             # on a GPU: which kernels run, checked live
configs/my-model.yaml says what each key does; the run's first log lines show every setting and where it came from.
EOF
