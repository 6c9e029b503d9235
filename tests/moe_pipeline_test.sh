#!/usr/bin/env bash
# An MoE target (tests/data/hf_moe/tiny_moe: the HF-made tiny qwen3_5_moe_text, 8 experts, top 2, a
# shared expert; its own bf16 weights) through the whole pipeline on the CPU reference:
#   1. dflash_features captures every layer's hidden states (and says the MoE layers ran on the CPU);
#   2. dflash_data regenerate makes the responses of a synthetic prompt corpus with the MoE target;
#   3. dflash_train trains a 1-layer drafter on them for a few steps (the drafter's MLP width defaults
#      to 3 x hidden for an MoE target) and exports it;
#   4. dflash_eval with the exported drafter: speculative decoding equals the MoE target's greedy
#      decoding token for token.
# Usage: moe_pipeline_test.sh DFLASH_FEATURES DFLASH_DATA DFLASH_TRAIN DFLASH_EVAL MODEL_DIR WORKDIR [MPIRUN...]
# With MPIRUN (the mpi test): every step on 2 CPU ranks, the target at tp 2 with ep 2 (each rank
# holds 4 of the 8 experts; target_model/tp.h). With DFLASH_PIPELINE_DEVICE=cuda (the gpu test
# moe_pipeline_gpu, one GPU, no MPIRUN): every step on the GPU backend (the MoE blocks on
# kernels/cuda/moe.h, decode and verify steps as CUDA graphs, the CUDA drafter).
set -uo pipefail
features=$1 data=$2 train=$3 eval=$4 model=$5 work=$6
shift 6
device=${DFLASH_PIPELINE_DEVICE:-cpu}
launch=() par=() tpar=()
if [ $# -gt 0 ]; then
  [ "$device" = cpu ] || { echo "FAIL: MPIRUN runs on CPU ranks (DFLASH_PIPELINE_DEVICE=$device)"; exit 1; }
  launch=("$@" -n 2) par=(--tp 2 --ep 2) tpar=(--set parallel.tp=2 --set parallel.ep=2)
fi
if [ "$device" != cpu ] && ! nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  echo "SKIP: no GPU visible (DFLASH_PIPELINE_DEVICE=$device)"
  exit 0
fi
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
t0=$(date +%s)

# 1. capture
"${launch[@]}" "$features" "${par[@]}" --device "$device" --model "$model" --tokens 3,1,4,1,5,9,2,6 --tokens 2,7,1,8 --out features.safetensors >features.log 2>&1 ||
  { cat features.log; fail "dflash_features"; }
grep -q "wrote features.safetensors (4 captured layers)" features.log || { cat features.log; fail "capture"; }

# 2. regenerate (greedy, 12 new tokens per prompt)
"$data" synth --out prompts.h5 --sequences 24 --min-len 8 --max-len 20 --vocab-size 16 >synth.log 2>&1 || { cat synth.log; fail synth; }
"${launch[@]}" "$data" regenerate "${par[@]}" --device "$device" prompts.h5 --out regen.h5 --model "$model" --max-new-tokens 12 --slots 8 >regen.log 2>&1 ||
  { cat regen.log; fail "dflash_data regenerate"; }
grep -q "regenerated regen.h5: 24 sequences" regen.log || { cat regen.log; fail "regenerated count"; }
"$data" validate regen.h5 >validate.log 2>&1 || { cat validate.log; fail "validate"; }

# 3. train a few steps on the regenerated data, export
"${launch[@]}" "$train" "${tpar[@]}" --set parallel.device="$device" --set "model.target.path=$model" --set model.drafter.num_layers=1 \
  --set model.drafter.block_size=4 --set model.drafter.mask_token_id=255 --set data.synth.enabled=false \
  --set data.regenerate.enabled=false --set "data.files=[$work/regen.h5]" --set data.max_length=64 \
  --set training.max_steps=6 --set training.num_anchors=4 --set training.warmup_ratio=0 --set logging.interval=2 \
  --set checkpoint.interval=100 --set "logging.run_dir=$work/run" --set logging.progress_bar=false >train.log 2>&1 ||
  { tail -n 30 train.log; fail "dflash_train"; }
grep -q "trained 6 steps; drafter exported" train.log || { tail -n 30 train.log; fail "training summary"; }
[ -f run/drafter/model.safetensors ] && [ -f run/drafter/config.json ] || fail "no exported drafter"
if [ "$device" = cpu ]; then  # (the load line is the CPU reference's)
  grep -qE "target MoE load: token-expert pairs per expert group \(ep ${par[3]:-1}\): [0-9 ]+ of [0-9]+" train.log ||
    { tail -n 30 train.log; fail "the MoE load line"; }
fi
grep -q '"intermediate_size": 192' run/drafter/config.json || { cat run/drafter/config.json; fail "drafter MLP width (3 x 64)"; }

# 4. speculative decoding with the trained drafter equals the target's greedy output
"${launch[@]}" "$eval" "${par[@]}" --model "$model" --drafter run/drafter --prompts prompts.h5 --num-prompts 6 --max-new-tokens 12 --device "$device" \
  --no-estimate --json eval.json >eval.log 2>&1 || { tail -n 30 eval.log; fail "dflash_eval"; }
grep -q '"mismatches": 0' eval.json || { cat eval.log; fail "speculative decoding differs from the target's greedy decoding"; }
grep -q "outputs: all 6 prompt(s) equal target-only greedy decoding, token for token" eval.log || { cat eval.log; fail "eval summary"; }
if [ ${#launch[@]} -gt 0 ]; then
  # Across ranks the target decodes as on one: the same greedy tokens as the tp 1 target.
  "$eval" --model "$model" --drafter run/drafter --prompts prompts.h5 --num-prompts 6 --max-new-tokens 12 --device cpu \
    --no-estimate --json eval_tp1.json >eval_tp1.log 2>&1 || { tail -n 30 eval_tp1.log; fail "dflash_eval at tp 1"; }
  ids() { tr -d ' \n' <"$1" | grep -o '"output_ids":\[[^]]*\]'; }
  [ -n "$(ids eval.json)" ] && [ "$(ids eval.json)" = "$(ids eval_tp1.json)" ] ||
    fail "the outputs at tp 2, ep 2 differ from the tp 1 target's: $(ids eval.json) vs $(ids eval_tp1.json)"
  echo "outputs at tp 2, ep 2 equal the tp 1 target's"
fi
sed -n 's/^tau (mean acceptance length over [0-9]* steps): /tau: /p' eval.log
echo "capture, regenerate, 6 steps, export, eval on $device: $(( $(date +%s) - t0 )) s"
echo
echo OK
