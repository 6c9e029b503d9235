#!/usr/bin/env bash
# The open issues' goal figures at one commit in one device call (issues 30, 31, 33; meant for an H200,
# where the goals are stated), each stage skipped when the call's time would not hold it:
#   1. train:  the 27B recipe at 4096 tokens, fp8 target, FP8 drafter linears and LM head (gpu_seqlen.sh,
#              15 steps; FIGURES_WGRAD_X, default "auto": the weight gradients' x operand, "auto 128x1" both;
#              FIGURES_SEQ_LENS / FIGURES_SEQ_ANCHORS, default 4096 / recipe: on an H100 2048 / 256 fit)
#   2. target: target_bench fp8 at 8192 tokens (Qwen3.6-27B shapes, random weights)
#   3. decode: dflash_eval on Qwen3.6-27B shapes, fp8 (fused residual quantization, FP8 propose) and bf16,
#              one op profile each (gpu_fused.sh's 27B stage; FIGURES_DECODE_VARIANTS, default fused;
#              FIGURES_DECODE_PRECISIONS, default "fp8+anq+dfp8 bf16+dfp8": the bf16 target's steps do not
#              depend on the propose precision, and its row gives the FP8 propose against the bf16 verify;
#              "bf16" alone for the bf16 propose)
#   4. moe:    dflash_eval on Qwen3.6-35B-A3B shapes with CUDA graphs (gpu_moe.sh's eval stage)
#   optional stages (name them in FIGURES_STAGES):
#   train_bf16: the same recipe all in bf16 (target, drafter, LM head: issue 31's bf16 goal)
#   regen:     generate_bench on Qwen3.6-27B shapes, 64 and 256 sequences in flight (FIGURES_REGEN_SLOTS, default
#              64,256: the goal's point and the top of issue 30's curve, which no run has reached), 512-token prompts,
#              512 new tokens, bf16 and fp8 (FIGURES_REGEN_PRECISIONS), separate prefills and prefill inside the decode
#              steps (FIGURES_REGEN_STEP_TOKENS, default 0,256: separate prefills and the regeneration default)
#   stream:    generate_bench as regen, bf16, on a stream: 3 waves of 64 prompts, each response 256-768 tokens
#              (--min-new-tokens: sequences end and new prompts come in at different steps), separate prefills
#              against prefill inside the decode steps (FIGURES_STREAM_STEP_TOKENS, default 0,256,1024), with
#              generate_bench --profile 3: the op tables of a 64-sequence decode step and of a mixed step
#   tests:     GPU tests not yet run on a GPU: builds FIGURES_TEST_TARGETS (default test_cuda_drafter_decode) and
#              runs `ctest -L gpu -R FIGURES_TESTS` (default 'CudaProposer\.': the refactored proposer tests of c4002f0)
#   e.g. a second call on the warm machine: FIGURES_STAGES="tests train_bf16 regen"
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_figures.sh
# One build of dflash_train, dflash_eval and target_bench first (~110 s on 16 cores). Writes to $OUT:
# env.txt, build.log, summary.txt (each stage's key lines) and a tarball a stage (train.tgz, target.tgz,
# decode.tgz, moe.tgz, train_bf16.tgz, regen.tgz, stream.tgz): at most 8 files for the stages of one call. FIGURES_BUDGET (s, default 560) is when the last stage must end;
# FIGURES_STAGES (default "train target decode moe") picks and orders them.
set -uo pipefail
source "$(dirname "$0")/common.sh"
set +e
R=${OUT:-/tmp/out}
STAGES=${FIGURES_STAGES:-train target decode moe}
if [ "$(echo "$STAGES" | wc -w)" -gt 5 ]; then  # 3 files + a tarball a stage; the device returns at most 8
  echo "FIGURES_STAGES='$STAGES': at most 5 stages a call (the device returns 8 files); split them over two calls" >&2
  exit 2
fi
mkdir -p "$R"
export DFLASH_GIT_COMMIT=${DFLASH_GIT_COMMIT:-}
B=$DFLASH_BUILD  # (common.sh: the tree's build/ unless the caller set DFLASH_BUILD)
T0=$(date +%s)
END=$(( T0 + ${FIGURES_BUDGET:-560} ))
left() { echo $(( END - $(date +%s) )); }
W=/tmp/figures
rm -rf "$W"
mkdir -p "$W"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv >"$R/env.txt" 2>&1
cmake -S "$DFLASH_ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$R/build.log" 2>&1 &&
  ninja -C "$B" -j "$DFLASH_JOBS" dflash_train dflash_eval target_bench generate_bench >>"$R/build.log" 2>&1 ||
  { echo "build failed"; grep -E "error|FAILED" "$R/build.log" | head -n 30; exit 1; }
echo "build $(( $(date +%s) - T0 )) s" | tee "$R/summary.txt"
cd "$DFLASH_ROOT"

# stage NAME NEEDED_S: whether the stage may start (and says why not).
stage() {
  if [ "$(left)" -lt "$2" ]; then
    echo "== $1 skipped: $(left) s left, needs ~$2" | tee -a "$R/summary.txt"
    return 1
  fi
  mkdir -p "$W/$1"
  echo "== $1 ($(left) s left)" >>"$R/summary.txt"
}
# train_run NAME VAR=VALUE...: the 27B recipe through gpu_seqlen.sh at FIGURES_SEQ_LENS / FIGURES_SEQ_ANCHORS with
# the precisions given, stopped within 150 s (or the call's end), its rows' key metrics into the summary.
train_run() {
  local name=$1
  shift
  env "$@" DFLASH_DEADLINE=$(( $(date +%s) + 150 < END ? $(date +%s) + 150 : END )) OUT="$W/$name" DFLASH_BUILD="$B" \
    SEQ_LENS="${FIGURES_SEQ_LENS:-4096}" SEQ_ANCHORS="${FIGURES_SEQ_ANCHORS:-recipe}" bash scripts/gpu_seqlen.sh \
    >"$W/$name/seqlen.out" 2>&1
  grep -E "trained_tok_s_per_gpu|peak_mem_gib|,step_s,|target_fwd_s|drafter_s|optimizer_s" "$W/$name/train_rows.csv" \
    2>/dev/null | cut -d, -f5,7,8 >>"$R/summary.txt"
}
for s in $STAGES; do
  t0=$(date +%s)
  case "$s" in
    train)
      stage train 90 || continue
      train_run train SEQ_DRAFTER=fp8 SEQ_HEADS=fp8 SEQ_WGRAD_X="${FIGURES_WGRAD_X:-auto}" ;;
    train_bf16)
      stage train_bf16 90 || continue
      train_run train_bf16 SEQ_PRECISION=bf16 SEQ_DRAFTER=bf16 SEQ_HEADS=bf16 ;;
    regen)
      stage regen 120 || continue
      for p in ${FIGURES_REGEN_PRECISIONS:-bf16 fp8}; do
        [ "$(left)" -gt 60 ] || { echo "regen $p skipped: $(left) s left" >>"$R/summary.txt"; continue; }
        timeout $(( $(left) < 240 ? $(left) : 240 )) "$B/bench/generate_bench" --config configs/qwen3.6-27b/config.json \
          --slots "${FIGURES_REGEN_SLOTS:-64,256}" --prompt-len 512 --max-new-tokens 512 \
          --step-tokens "${FIGURES_REGEN_STEP_TOKENS:-0,256}" --precision "$p" \
          --csv "$W/regen/genbench.csv" >"$W/regen/genbench_$p.log" 2>&1
        echo "generate_bench $p rc=$?" >>"$R/summary.txt"
        grep -E "generated|decode step|tok/s|^ +[0-9]+ +[0-9]+ " "$W/regen/genbench_$p.log" | head -n 10 >>"$R/summary.txt"
      done ;;
    stream)
      stage stream 120 || continue
      timeout $(( $(left) < 300 ? $(left) : 300 )) "$B/bench/generate_bench" --config configs/qwen3.6-27b/config.json \
        --slots 64 --waves 3 --prompt-len 512 --min-new-tokens 256 --max-new-tokens 768 \
        --step-tokens "${FIGURES_STREAM_STEP_TOKENS:-0,256,1024}" --precision bf16 --profile 3 \
        --csv "$W/stream/genbench.csv" >"$W/stream/genbench.log" 2>&1
      echo "generate_bench stream rc=$?" >>"$R/summary.txt"
      grep -E "^ +[0-9]+ +[0-9]+ |chunked prefill|CUDA graphs" "$W/stream/genbench.log" | head -n 8 >>"$R/summary.txt" ;;
    tests)
      stage tests 90 || continue
      # shellcheck disable=SC2086  # (a list of ninja targets)
      ninja -C "$B" -j "$DFLASH_JOBS" ${FIGURES_TEST_TARGETS:-test_cuda_drafter_decode} >"$W/tests/build.log" 2>&1 ||
        echo "tests: build failed (tests/build.log)" >>"$R/summary.txt"
      (cd "$B" && timeout $(( $(left) < 240 ? $(left) : 240 )) ctest -L gpu -R "${FIGURES_TESTS:-CudaProposer\.}" \
        --output-on-failure --timeout 200) >"$W/tests/tests.log" 2>&1
      echo "ctest rc=$?" >>"$R/summary.txt"
      grep -E "tests passed|Failed|\*\*\*" "$W/tests/tests.log" | tail -n 8 >>"$R/summary.txt" ;;
    target)
      stage target 60 || continue
      timeout $(( $(left) < 120 ? $(left) : 120 )) "$B/bench/target_bench" --config configs/qwen3.6-27b/config.json --random-weights \
        --precision fp8 --seq 8192 --path fast --csv "$W/target/target_bench.csv" >"$W/target/target_bench.log" 2>&1
      echo "target_bench rc=$?" >>"$R/summary.txt"
      grep -E "^[0-9]+ +fast|MFU against" "$W/target/target_bench.log" | head -n 4 >>"$R/summary.txt" ;;
    decode)
      stage decode 150 || continue
      OUT="$W/decode" DFLASH_BUILD="$B" NINJA_TARGETS=dflash_eval SKIP_TESTS=1 SKIP_BENCH=1 EVAL27B_PROFILE=1 \
        EVAL27B_PRECISIONS="${FIGURES_DECODE_PRECISIONS:-fp8+anq+dfp8 bf16+dfp8}" EVAL27B_VARIANTS="${FIGURES_DECODE_VARIANTS:-fused}" \
        EVAL_TIMEOUT=$(( $(left) / 2 < 150 ? $(left) / 2 : 150 )) bash scripts/gpu_fused.sh >"$W/decode/fused.out" 2>&1
      grep -E "^===|roofline|decode  |verify  |outputs|a step" "$W/decode/eval27b.log" | head -n 30 >>"$R/summary.txt" ;;
    moe)
      stage moe 125 || continue
      DFLASH_DEADLINE=$END OUT="$W/moe" DFLASH_BUILD="$B" NINJA_TARGETS=dflash_eval SKIP_TESTS=1 SKIP_BENCH=1 \
        SKIP_PIPELINE=1 SKIP_TRAIN=1 EVAL_EAGER=0 EVAL_FP8X=0 EVAL_VARIANTS=fused bash scripts/gpu_moe.sh >"$W/moe/moe.out" 2>&1
      grep -E "^===|roofline|decode  |verify  |outputs|^ +(B  verify|[0-9]+ +[0-9.]+ +[0-9.]+x)" "$W/moe/eval35b.log" | head -n 24 >>"$R/summary.txt" ;;
    *) echo "unknown stage $s" | tee -a "$R/summary.txt"; continue ;;
  esac
  echo "$s $(( $(date +%s) - t0 )) s" | tee -a "$R/summary.txt"
  tar czf "$R/$s.tgz" -C "$W" "$s"
done
echo "total $(( $(date +%s) - T0 )) s" | tee -a "$R/summary.txt"
cat "$R/summary.txt"
