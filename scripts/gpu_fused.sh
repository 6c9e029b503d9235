#!/usr/bin/env bash
# Issue 30's fused decode kernels in one device call: builds what it needs, runs their gpu tests
# (gemm_skinny, add_rms_norm's row kernel, the fused GatedDeltaNet chain and commit against their
# unfused twins, and the decoder's bit-for-bit and greedy tests with the fusions on), times them
# against the twins (kernel_bench --only fused), and times the Qwen3.6-27B-shaped decode / verify /
# commit steps (dflash_eval, random weights, a 4096-token prompt) with the A/B table of the decode
# plan's variants (--decode-variants) and an op profile.
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_fused.sh
# Writes to $OUT (at most 8 files): env.txt, build.log, tests.log, kernel_bench.log, kernel_bench.csv,
# eval27b.log, eval27b.csv. Switches: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_27B=1, GPU_TESTS (ctest -R
# regex), TESTS_TIMEOUT / BENCH_TIMEOUT / EVAL_TIMEOUT (s: each stage is cut there, so the call ends in time), EVAL27B_NEW (new tokens, default 32), EVAL27B_PROFILE (profiled steps, default 2), EVAL27B_COMMIT_PROBE (dflash_eval --commit-probe steps, default 10),
# EVAL27B_VARIANTS (default fused,unfused,no_pdl,no_gdn_chain,no_commit,no_overlap,skinny_no_swiglu,fused,unfused),
# EVAL27B_PRECISIONS (default bf16; "bf16 fp8": one dflash_eval each, both in eval27b.log / .csv; suffixes: "+anq"
# with DFLASH_ADD_NORM_QUANT=1, the residual steps fused with the FP8 quantization (the default since session 26: a run
# without "+anq" sets 0, the unfused side of the A/B); "+dfp8" with --draft-precision fp8,
# the FP8 propose; "+peager" with DFLASH_PROPOSE_GRAPHS=0, the propose steps launched eagerly (graphs are the
# default since 1edc71b's A/B; "+pgraphs" names the default explicitly); "+cgraphs" with DFLASH_CONTEXT_GRAPHS=1, the
# drafter's add_context of the commit step as CUDA graphs too; e.g. "fp8+anq+dfp8"), KB_ONLY
# (kernel_bench sections, default fused; e.g. "fused decode_gemm fp8": fp8 times the decode rows M 16 / 4 / 1
# only, DFLASH_BENCH_FP8_DECODE=1), NINJA_TARGETS.
# The streaming GEMMs (issue 30, kernels/cuda/gemm_stream.cu), first measured by:
#   KB_ONLY="decode_gemm fp8" EVAL27B_PRECISIONS="bf16 fp8" EVAL27B_VARIANTS=fused,skinny_streamk,skinny,fused,skinny_streamk,skinny
#   (bf16: cuBLASLt / the cluster kernel / stream-K; fp8: skinny = the streaming FP8 GEMM for every FP8 projection).
source "$(dirname "$0")/gpu_call.sh"
NINJA_TARGETS=${NINJA_TARGETS:-"test_cuda_ops test_cuda_fp8 test_cuda_decode test_cuda_decoder test_cuda_model test_cuda_drafter_decode kernel_bench dflash_eval"}
gpu_call_start
if [ -z "${SKIP_TESTS:-}" ]; then
  t0=$(date +%s)
  (cd "$B" && timeout "${TESTS_TIMEOUT:-60}" ctest -L gpu -R "${GPU_TESTS:-CudaOps\.(GemmSkinny|AddRmsNorm|Swiglu|SigmoidGate|Embedding)|CudaFp8\.Streaming|CudaDecode\.Fused|CudaDecoder\.(Pieces|Verify|Speculative|GraphReplay|Fp8|Sampling)}" \
    --output-on-failure --timeout 120 >"$OUT/tests.log" 2>&1)
  echo "tests rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "tests passed|Failed|\*\*\*|Test +#" "$OUT/tests.log" | tail -n 30
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  t0=$(date +%s)
  : >"$OUT/kernel_bench.log"
  for only in ${KB_ONLY:-fused}; do
    fp8dec=
    [ "$only" = fp8 ] && fp8dec=1
    DFLASH_BENCH_FP8_DECODE=$fp8dec timeout "${BENCH_TIMEOUT:-45}" "$B/bench/kernel_bench" --only "$only" \
      --csv "$OUT/kernel_bench.csv" >>"$OUT/kernel_bench.log" 2>&1
    echo "kernel_bench $only rc=$? $(( $(date +%s) - t0 )) s"
  done
  grep -E "fused|graph|gemm_decode|stream_e4m3|cublaslt_block_scaled" "$OUT/kernel_bench.log" | grep -vE "^==" | head -n 80
fi
if [ -z "${SKIP_27B:-}" ]; then
  t0=$(date +%s)
  python3 -c "import random; random.seed(0); print(' '.join(str(random.randrange(248000)) for _ in range(4096)))" >/tmp/p4k.txt
  # stdbuf: line-buffered stdout, so a run cut by its timeout still leaves its log (the second call of
  # this script lost the whole eval log that way: fully buffered printf, killed at 140 s).
  : >"$OUT/eval27b.log"
  for run in ${EVAL27B_PRECISIONS:-bf16}; do
    prec=${run%%+*}
    anq=0
    dprec=bf16
    case "$run" in *+anq*) anq=1 ;; esac
    case "$run" in *+dfp8*) dprec=fp8 ;; esac
    pgraphs=1
    case "$run" in *+peager*) pgraphs=0 ;; esac
    cgraphs=0
    case "$run" in *+cgraphs*) cgraphs=1 ;; esac
    echo "=== dflash_eval $run" >>"$OUT/eval27b.log"
    DFLASH_CONTEXT_GRAPHS=$cgraphs DFLASH_PROPOSE_GRAPHS=$pgraphs DFLASH_ADD_NORM_QUANT=$anq timeout "${EVAL_TIMEOUT:-240}" stdbuf -oL "$B/bench/dflash_eval" --draft-precision "$dprec" --config configs/qwen3.6-27b/config.json --random-weights --random-drafter 5 \
      --precision "$prec" --prompts /tmp/p4k.txt --num-prompts 1 --max-new-tokens "${EVAL27B_NEW:-32}" --device cuda \
      --no-estimate --require-fast-path --profile "${EVAL27B_PROFILE:-2}" --commit-probe "${EVAL27B_COMMIT_PROBE:-10}" \
      --decode-variants "${EVAL27B_VARIANTS:-fused,unfused,no_pdl,no_gdn_chain,no_commit,no_overlap,skinny_no_swiglu,fused,unfused}" \
      --csv "$OUT/eval27b.csv" >>"$OUT/eval27b.log" 2>&1
    echo "27b eval $run rc=$? $(( $(date +%s) - t0 )) s"
  done
  grep -E "^===|^tau|a step|medians|commit step apart|roofline|decode  |verify  |outputs|FAILED|variant|^fused|^no_|^unfused|^skinny|sum of ops|between|span|gdn_fused|add_rms|swiglu " \
    "$OUT/eval27b.log" | head -n 80
fi
