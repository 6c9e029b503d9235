#!/usr/bin/env bash
# MoE targets on the GPU in one device call (issue 33): builds what it needs, then
#   1. the MoE gpu tests: test_cuda_moe (op cases, pad rows, forced routing), the HF tiny MoE golden
#      (CudaMoeGolden.*: T = 1, and T = 37 / 130 with routing forced and free), the MoE decoder
#      (CudaDecoder.Moe*: verify rows = decode steps bit for bit, speculative = greedy with CUDA graphs);
#   2. target_bench on Qwen3.6-35B-A3B shapes (random weights; 2048 and 8192 tokens, bf16 and FP8 experts;
#      SKIP_BENCH=1 skips it), then dflash_eval on those shapes (random weights, an untrained 8-layer drafter, a 4096-token
#      prompt): the decode step, the verify step against the block size (--verify-sweep), the op profile
#      of a decode step, and --decode-variants $EVAL_VARIANTS (default fused,moe_decode,moe_wgmma: the
#      grouped mma.sync GEMMs against the MoE decode kernels and against the expert GEMMs on wgmma,
#      decode / propose / verify / commit each); again with the
#      routed experts in FP8 (--fp8-experts; EVAL_FP8X=0 skips it) and with --no-cuda-graphs (EVAL_EAGER=0
#      skips it);
#   3. the tiny MoE end to end on the GPU (ctest moe_pipeline_gpu: capture, regenerate, train, eval);
#   4. the 35B-A3B recipe's training rate on one GPU (gpu_train.sh's runs q35_1gpu, with FP8 experts
#      q35_1gpu_fp8x and with the FP8 drafter q35_1gpu_d8: MOE_TRAIN_RUNS, a regex; TRAIN_STEPS, default 20).
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_moe.sh
# Writes at most 8 files to $OUT: env.txt, build.log, tests.log, eval35b.log, eval35b.csv, pipeline.log,
# train.txt, train.tgz (with train_rows.csv). NCU_MOE_DETAIL=1 adds the one-token expert GEMMs' ncu sections (stall reasons).
# KB_DECODE_GEMM=1 adds kernel_bench's decode_gemm rows (skinny vs cuBLASLt at the 27B / 35B-A3B decode shapes).
# NCU_MOE=1 adds the decode-sized MoE blocks kernel by kernel under ncu (CSV in tests.log). MOE_BENCH=1 adds test_cuda_moe's timing rows (moe_bench,...: the
# block and its expert GEMMs at 35B-A3B shapes, both tilings, the decode kernels, FP8 experts) to tests.log. SKIP_TESTS / SKIP_EVAL / SKIP_PIPELINE / SKIP_TRAIN=1 skip a
# stage; every stage after the build is skipped or stopped (SIGTERM: dflash_train keeps its rows) before
# DFLASH_DEADLINE (default 540 s after the start).
source "$(dirname "$0")/gpu_call.sh"
export DFLASH_DEADLINE=${DFLASH_DEADLINE:-$(( $(date +%s) + 540 ))}
NINJA_TARGETS=${NINJA_TARGETS:-test_cuda_moe test_cuda_model test_cuda_decoder target_bench kernel_bench dflash_eval dflash_train dflash_features dflash_data_tool}
gpu_call_start
left() { echo $(( DFLASH_DEADLINE - $(date +%s) )); }
cd "$DFLASH_ROOT"

if [ -z "${SKIP_TESTS:-}" ]; then
  t0=$(date +%s)
  {
    DFLASH_MOE_BENCH=${MOE_BENCH:-} timeout 150 "$B/tests/test_cuda_moe" --gtest_filter='CudaMoe.*'
    timeout 120 "$B/tests/test_cuda_model" --gtest_filter='CudaMoeGolden.*'
    timeout 150 "$B/tests/test_cuda_decoder" --gtest_filter='CudaDecoder.Moe*'
  } >"$OUT/tests.log" 2>&1
  # NCU_MOE=1: the decode-sized MoE blocks (1 and 16 tokens, every implementation) kernel by kernel under
  # ncu, each kernel from a flushed cache (time, DRAM bytes read, share of the DRAM and SM peaks), as CSV
  # after a '=== ncu moe' line in tests.log.
  if [ -n "${NCU_MOE:-}" ]; then
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    echo "=== ncu moe" >>"$OUT/tests.log"
    DFLASH_MOE_BENCH=1 DFLASH_MOE_PROFILE=1 timeout 240 "$NCU" --profile-from-start off --clock-control none --csv \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
      "$B/tests/test_cuda_moe" --gtest_filter='CudaMoe.Bench35bA3b' >>"$OUT/tests.log" 2>&1
    echo "ncu moe rc=$?"
  fi
  # NCU_MOE_DETAIL=1: the first two mma.sync grouped GEMMs on 16-row blocks of the profiled region (the one-token
  # deep16 gate|up and down) with ncu's speed-of-light, memory, warp-state (stall reasons) and
  # occupancy sections, as text after a '=== ncu moe detail' line in tests.log.
  if [ -n "${NCU_MOE_DETAIL:-}" ]; then
    NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    echo "=== ncu moe detail" >>"$OUT/tests.log"
    DFLASH_MOE_BENCH=1 DFLASH_MOE_PROFILE=1 timeout 180 "$NCU" --profile-from-start off --clock-control none \
      --kernel-name-base demangled --kernel-name "regex:grouped_gemm_kernel<.int.16" --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
      "$B/tests/test_cuda_moe" --gtest_filter='CudaMoe.Bench35bA3b' >>"$OUT/tests.log" 2>&1
    echo "ncu moe detail rc=$?"
  fi
  # KB_DECODE_GEMM=1: kernel_bench's decode_gemm section (gemm_skinny vs cuBLASLt at M 16 on the 27B and
  # 35B-A3B projections) after a '=== kernel_bench decode_gemm' line in tests.log.
  if [ -n "${KB_DECODE_GEMM:-}" ]; then
    echo "=== kernel_bench decode_gemm" >>"$OUT/tests.log"
    timeout 120 "$B/bench/kernel_bench" --only decode_gemm --rounds 2 --csv "$OUT/eval35b.csv" >>"$OUT/tests.log" 2>&1
    echo "kernel_bench decode_gemm rc=$?"
  fi
  echo "tests $(( $(date +%s) - t0 )) s"
  grep -E "^\[  (PASSED|FAILED) |^tiny_moe gpu .*(forced|free)|moe greedy|^moe_bench" "$OUT/tests.log" | head -n 40
fi

# The target forward at 35B-A3B shapes (the prefill's grouped GEMMs: wgmma on sm_90), bf16 experts and
# FP8 experts; its rows join eval35b.csv, its log eval35b.log (SKIP_BENCH=1 skips it).
if [ -z "${SKIP_BENCH:-}" ] && [ "$(left)" -gt 150 ]; then
  : >"$OUT/eval35b.log"
  for fx in "" --fp8-experts; do
    echo "=== target_bench 35b-a3b $fx" >>"$OUT/eval35b.log"
    timeout 90 "$B/bench/target_bench" --config configs/qwen3.6-35b-a3b/config.json --random-weights --seq 2048,8192 \
      --path fast --warmup 1 --iters 3 --rounds 1 $fx --csv "$OUT/eval35b.csv" >>"$OUT/eval35b.log" 2>&1
    echo "target_bench $fx rc=$?"
  done
  grep -E "^===|tok/s|T8192|T2048" "$OUT/eval35b.log" | head -n 16
fi

if [ -z "${SKIP_EVAL:-}" ] && [ "$(left)" -gt 120 ]; then
  python3 -c "import random; random.seed(0); print(' '.join(str(random.randrange(248000)) for _ in range(4096)))" >/tmp/p4k.txt
  for graphs in on fp8x off; do
    [ "$graphs" = off ] && [ "${EVAL_EAGER:-1}" = 0 ] && continue
    [ "$graphs" = fp8x ] && [ "${EVAL_FP8X:-1}" = 0 ] && continue
    [ "$(left)" -gt 90 ] || { echo "eval graphs $graphs skipped: $(left) s left" | tee -a "$OUT/eval35b.log"; continue; }
    extra=(--verify-sweep 1,2,4,8,16 --profile 8 --decode-variants "${EVAL_VARIANTS:-fused,moe_decode,moe_wgmma}")
    [ "$graphs" = fp8x ] && extra=(--fp8-experts --verify-sweep 1,4,16 --decode-variants fused,moe_decode)
    [ "$graphs" = off ] && extra=(--no-cuda-graphs --profile 0)
    echo "=== dflash_eval 35b-a3b bf16 graphs $graphs" >>"$OUT/eval35b.log"
    timeout 150 "$B/bench/dflash_eval" --config configs/qwen3.6-35b-a3b/config.json --random-weights --random-drafter 8 \
      --prompts /tmp/p4k.txt --num-prompts 1 --max-new-tokens 64 --device cuda --no-estimate --require-fast-path \
      "${extra[@]}" --csv "$OUT/eval35b.csv" >>"$OUT/eval35b.log" 2>&1
    echo "eval graphs $graphs rc=$?"
  done
  grep -E "^===|^kernels|step|roofline|decode  |verify  |propose |speed-up|outputs|FAILED|error|^ +[0-9]+ +[0-9.]+ |moe_block|gemm|variant|moe_decode" \
    "$OUT/eval35b.log" | head -n 70
fi

if [ -z "${SKIP_PIPELINE:-}" ] && [ "$(left)" -gt 100 ]; then
  (cd "$B" && timeout 120 ctest -R '^moe_pipeline_gpu$' --output-on-failure) >"$OUT/pipeline.log" 2>&1
  echo "pipeline rc=$?"
  grep -E "tau:|eval on|Passed|Failed|FAIL" "$OUT/pipeline.log" | head -n 8
fi

if [ -z "${SKIP_TRAIN:-}" ]; then
  DFLASH_BUILD=$B TRAIN_RUNS=${MOE_TRAIN_RUNS:-q35_1gpu.*} TRAIN_STEPS=${TRAIN_STEPS:-20} DFLASH_TRAIN_WORK=/tmp/dflash_q35 \
    bash scripts/gpu_train.sh "$OUT"
  grep -E "^== |memory|summary:|step time|rc=" "$OUT/train.txt" | head -n 20
  grep -E "trained_tok_s_per_gpu|peak_mem_gib|,step_s,|target_fwd_s|drafter_s" /tmp/dflash_q35/train_rows.csv 2>/dev/null | cut -d, -f5,8
fi
echo "total: deadline $(left) s ahead"
