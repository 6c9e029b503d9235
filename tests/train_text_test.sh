#!/usr/bin/env bash
# Training from text (data.train) end to end on the CPU reference: a small chat JSONL (tests/data/chat/
# train.jsonl: 40 conversations in messages and ShareGPT form, 8 prompt-only, 16 multi-turn) with the
# tiny random target (configs/tiny/config.json) and the 4,096-token Qwen3 tokenizer cut with the
# Qwen3.5 template (tests/data/tokenizers/qwen3_4k):
#   0. a random-weights target without data.tokenizer and a bad row are refused, naming the keys;
#   1. dflash_train prepares data.train into <run_dir>/data/prepared.h5, regenerates its responses with
#      the target, trains 20 steps and exports the drafter;
#   2. dflash_eval with that drafter on held-out prompts (heldout.jsonl through dflash_data prepare)
#      is lossless: its output equals the target's greedy decoding token for token;
#   3. a second start (the input touched, its bytes unchanged) reuses the prepared and the regenerated
#      data without making them again;
#   4. a changed input (one more conversation) is prepared again, the data regenerated from the old
#      file is removed and made again, and the run trains on the 41 sequences.
# Usage: train_text_test.sh DFLASH_TRAIN DFLASH_DATA DFLASH_EVAL TARGET_CONFIG TOKENIZER_DIR CHAT_DIR WORKDIR
set -uo pipefail
train=$1 data=$2 eval=$3 tcfg=$4 tok=$5 chat=$6 work=$7
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
cp "$chat/train.jsonl" chat.jsonl || fail "copy the chat corpus"
run=$work/run
# start NAME ARGS...: dflash_train on the embedded tiny recipe, from text, on the CPU.
start() {
  local name=$1
  shift
  "$train" --set parallel.device=cpu --set "model.target.config=$tcfg" --set "logging.run_dir=$run" \
    --set data.train=chat.jsonl --set "data.tokenizer=$tok" --set data.regenerate.enabled=true \
    --set data.regenerate.max_new_tokens=16 --set training.max_steps=20 --set training.batch_size=2 \
    --set training.num_anchors=4 --set checkpoint.interval=10 --set logging.progress_bar=false "$@" >"$name.log" 2>&1 ||
    { tail -n 20 "$name.log"; fail "dflash_train ($name)"; }
}
has() { grep -Eq -- "$2" "$1.log" || { cat "$1.log"; fail "$1: expected '$2'"; }; }
hasnt() { ! grep -Eq -- "$2" "$1.log" || { cat "$1.log"; fail "$1: did not expect '$2'"; }; }

# 0. refusals: no tokenizer for a random-weights target (naming both keys); a bad row (naming the file,
#    the line and the config key that skips bad rows), leaving nothing in the run's data directory.
"$train" --set parallel.device=cpu --set "model.target.config=$tcfg" --set "logging.run_dir=$work/bad" \
  --set data.train=chat.jsonl >notok.log 2>&1 && fail "a random-weights target without data.tokenizer was accepted"
has notok "data.train needs a tokenizer: data.tokenizer is not set and model.target has no model directory"
(head -n 3 chat.jsonl; echo '{"prompt": "no such form"}') >bad.jsonl
"$train" --set parallel.device=cpu --set "model.target.config=$tcfg" --set "logging.run_dir=$work/bad" \
  --set data.train=bad.jsonl --set "data.tokenizer=$tok" >badrow.log 2>&1 && fail "a bad row was accepted"
has badrow "data.train: bad.jsonl:4: the row has none of"
has badrow "data.prepare.skip_bad: true skips"
[ -z "$(ls -A "$work/bad/data" 2>/dev/null)" ] || { ls -la "$work/bad/data"; fail "a refused prepare left files"; }

# 1. first start: prepare -> regenerate -> train -> export.
t0=$(date +%s)
start first
has first "data: prepared .*/data/prepared.h5 from chat.jsonl with the tokenizer .* \(none made yet\)"
has first "data: regenerated .*regenerated.h5: 40 sequences"
has first "data: checked 40 sequences"
[ -f "$run/data/prepared.h5.key.json" ] || fail "no key beside the prepared file"
[ -f "$run/drafter/model.safetensors" ] || fail "no exported drafter"
"$data" validate "$run/data/prepared.h5" >validate.txt 2>&1 || { cat validate.txt; fail "the prepared file is not valid"; }
echo "first start (prepare, regenerate, 20 steps, export): $(( $(date +%s) - t0 )) s"
# The prepared rows: 8 prompt-only rows have no supervised token, the other 32 have some.
"$data" dump "$run/data/prepared.h5" >prepared.jsonl || fail "dump"
[ "$(grep -c '"loss_mask":\[[0,]*\]' prepared.jsonl)" -eq 8 ] || fail "expected 8 prompt-only rows (all-zero masks)"

# 2. the drafter on held-out prompts: speculative decoding equals the target's greedy decoding.
"$data" prepare "$chat/heldout.jsonl" --tokenizer "$tok" --out heldout.h5 >prep_heldout.txt 2>&1 ||
  { cat prep_heldout.txt; fail "dflash_data prepare of the held-out prompts"; }
"$eval" --config "$tcfg" --random-weights --drafter "$run/drafter" --prompts heldout.h5 --max-new-tokens 16 --device cpu --no-estimate \
  --json eval.json >eval.txt 2>&1 || { tail -n 20 eval.txt; fail "dflash_eval"; }
grep -q '"mismatches": 0' eval.json || { cat eval.txt; fail "speculative decoding differs from the target's greedy decoding"; }
grep -q "outputs: all 8 prompt(s) equal target-only greedy decoding, token for token" eval.txt || { cat eval.txt; fail "eval summary"; }
sed -n 's/^tau (mean acceptance length over [0-9]* steps): /held-out tau: /p' eval.txt

# 3. a second start: both files reused (not rewritten), the touched input not prepared again.
sum_prepared=$(cksum <"$run/data/prepared.h5") sum_regen=$(cksum <"$run/data/regenerated.h5")
touch chat.jsonl
start second
has second "data: using the prepared data .*/data/prepared.h5 \(made earlier from chat.jsonl"
has second "data: using the regenerated data .*regenerated.h5 \(made earlier with these settings\)"
hasnt second "data: prepared |data: regenerating"
[ "$sum_prepared" = "$(cksum <"$run/data/prepared.h5")" ] || fail "the prepared file was rewritten"
[ "$sum_regen" = "$(cksum <"$run/data/regenerated.h5")" ] || fail "the regenerated file was rewritten"

# 4. a changed input: prepared again (naming the change), regenerated again, trained on (a new checkpoint
#    directory: the first run's checkpoints hold a loader position over the old data).
echo '{"messages": [{"role": "user", "content": "One more about the sea."}, {"role": "assistant", "content": "The sea is wide."}]}' >>chat.jsonl
start changed --set "checkpoint.dir=$work/ckpt-changed" --set training.max_steps=2
has changed "data: prepared .*/data/prepared.h5 from chat.jsonl .*\(input.bytes: was [0-9]+, now [0-9]+\); removed the data regenerated from the earlier one"
has changed "data: regenerated .*regenerated.h5: 41 sequences"
has changed "data: checked 41 sequences"
echo "all three starts: $(( $(date +%s) - t0 )) s"
echo
echo OK
