#!/usr/bin/env bash
# The streaming FP8 decode GEMM's open questions (issue 30) in one device call, any GPU kind: builds what it needs,
# runs the GPU tests of the code that has not run on a GPU yet, times the streaming kernel's variants against
# cuBLASLt, and the Qwen3.6-27B fp8 decode step with the gate fusion and the streaming kernel under each setting.
#   stages (STREAM_STAGES, default "tests kbench eval"; each skipped when the call's time would not hold it):
#   tests:  CudaFp8 (the streaming kernel at ring depths 2 / 3 / 4 and with the warp fix-up, sigmoid_gate_quant_fp8,
#           add_rms_norm_quant_fp8), CudaOps.GemmSkinny* (the bf16 twin with the warp fix-up), CudaModel.Fp8* (the
#           gate fusion toggled), CudaDecoder.Fp8* / L2Prefetch*, and
#           the attention kernels on their shared qk_scores (CudaAttention, CudaBlockAttention, CudaDecode attention),
#           CudaProposer (the FP8 context update)
#   kbench: kernel_bench --only fp8 at the decode rows (M 16 / 4 / 1): cuBLASLt, the register ring at depths 2 (the
#           default since session 41) / 3 / 4 (stream_e4m3{,_packed}{,_d3,_d4}), and into an f32 output the block
#           fix-up, the warp fix-up and atomics with no fix-up (stream_e4m3_f32acc{,_warpfix,_atomic}{,_d4}): what
#           holds the kernel below cuBLASLt and the probe's 2.4-2.6 TB/s on an H100 (session 41: the fix-up,
#           bench/results/h100-stream-f683da9); then --only decode_gemm (the bf16 twin, skinny_streamk{,_warpfix})
#   eval:   dflash_eval on Qwen3.6-27B shapes (random weights, FP8 propose, context ~4100), the default plan:
#           a 2-step op profile and the decode-plan variants no_gate_quant / fused alternated (the gate fusion's A/B)
#           and packed (the streaming kernel on packed weights), and the commit probe (the target's commit and the
#           drafter's context update apart and together, the context update on bf16 weights and on the FP8 copies:
#           DFLASH_CONTEXT_FP8's A/B); then once more with STREAM_EVAL_ENV (default "DFLASH_CONTEXT_GRAPHS=1": the
#           commit probe's context update as CUDA graphs), fused / packed alternated
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_stream.sh
# Writes to $OUT (at most 8 files): env.txt, build.log, tests.log, kernel_bench.log / .csv, eval27b.log / .csv,
# summary.txt. STREAM_BUDGET (s, default 560): when the last stage must end; gpu_call.sh's switches (GPU_TESTS,
# NINJA_TARGETS, DFLASH_BUILD) apply.
T0=$(date +%s)
END=$(( T0 + ${STREAM_BUDGET:-560} ))
left() { echo $(( END - $(date +%s) )); }
source "$(dirname "$0")/gpu_call.sh"
NINJA_TARGETS=${NINJA_TARGETS:-kernel_bench dflash_eval test_cuda_fp8 test_cuda_ops test_cuda_model test_cuda_decoder \
test_cuda_attention test_cuda_block_attention test_cuda_decode test_cuda_drafter_decode}
gpu_call_start
R=$OUT
cat "$R/env.txt"
echo "build done at $(( $(date +%s) - T0 )) s" >"$R/summary.txt"
cd "$DFLASH_ROOT" || exit 1
for s in ${STREAM_STAGES:-tests kbench eval}; do
  case "$s" in
    tests)
      [ "$(left)" -gt 150 ] || { echo "tests skipped: $(left) s left" | tee -a "$R/summary.txt"; continue; }
      gpu_call_tests 'CudaFp8\.(SigmoidGate|Streaming|AddRmsNorm)|CudaOps\.GemmSkinny|CudaModel\.Fp8|CudaDecoder\.(Fp8|L2Prefetch)|CudaAttention\.|CudaBlockAttention\.|CudaDecode\.(.*Attention|Kv)|CudaProposer\.' \
        -E Timing | tee -a "$R/summary.txt" ;;
    kbench)
      [ "$(left)" -gt 100 ] || { echo "kbench skipped: $(left) s left" | tee -a "$R/summary.txt"; continue; }
      DFLASH_BENCH_FP8_DECODE=1 timeout $(( $(left) < 150 ? $(left) - 10 : 140 )) "$B/bench/kernel_bench" --only fp8 \
        --csv "$R/kernel_bench.csv" >"$R/kernel_bench.log" 2>&1
      echo "kernel_bench fp8 rc=$?" | tee -a "$R/summary.txt"
      [ "$(left)" -gt 150 ] && { timeout 60 "$B/bench/kernel_bench" --only decode_gemm --csv "$R/kernel_bench.csv" \
        >>"$R/kernel_bench.log" 2>&1; echo "kernel_bench decode_gemm rc=$?" | tee -a "$R/summary.txt"; }
      grep -E "(stream_e4m3|cublaslt_e4m3|skinny_streamk)" "$R/kernel_bench.log" | grep -v ceiling | head -n 80 >>"$R/summary.txt" ;;
    eval)
      [ "$(left)" -gt 120 ] || { echo "eval skipped: $(left) s left" | tee -a "$R/summary.txt"; continue; }
      python3 -c "import random; random.seed(0); print(' '.join(str(random.randrange(248000)) for _ in range(4096)))" >/tmp/p4k.txt
      eval27b() {  # eval27b VARIANTS [VAR=VALUE...]: one dflash_eval, its lines into eval27b.log
        local variants=$1
        shift
        echo "=== env: ${*:-none}; variants $variants" >>"$R/eval27b.log"
        env "$@" timeout $(( $(left) < 200 ? $(left) - 5 : 200 )) stdbuf -oL "$B/bench/dflash_eval" \
          --config configs/qwen3.6-27b/config.json --random-weights --random-drafter 5 --precision fp8 --draft-precision fp8 \
          --prompts /tmp/p4k.txt --num-prompts 1 --max-new-tokens 32 --device cuda --no-estimate --require-fast-path \
          --profile 2 --commit-probe 8 --decode-variants "$variants" --csv "$R/eval27b.csv" >>"$R/eval27b.log" 2>&1
        echo "eval ${*:-default} rc=$?" | tee -a "$R/summary.txt"
      }
      : >"$R/eval27b.log"
      eval27b "no_gate_quant,fused,no_gate_quant,fused,no_gate_quant,fused,packed"
      # shellcheck disable=SC2086
      [ "$(left)" -gt 100 ] && eval27b "fused,packed,fused,packed" ${STREAM_EVAL_ENV:-DFLASH_CONTEXT_GRAPHS=1}
      grep -E "^===|^(fused|no_gate_quant|packed) |decode  |verify  |outputs|FAILED|sigmoid_gate|fp8_quant|commit step apart|FP8 copies" "$R/eval27b.log" |
        head -n 60 >>"$R/summary.txt" ;;
    *) echo "unknown stage $s" | tee -a "$R/summary.txt" ;;
  esac
  echo "$s done at $(( $(date +%s) - T0 )) s" | tee -a "$R/summary.txt"
done
cat "$R/summary.txt"
