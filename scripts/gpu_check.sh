#!/usr/bin/env bash
# One whole check on the GPU machine: configure (Release, sm_90), build with every core, run the
# gpu-labelled tests and then the rest, run the benchmarks that exist, and leave logs and CSVs in
# one folder ($OUT on the device machine, else runs/gpu_check). At most 8 files come back from the
# device machine, so the end result is: environment.txt, test_gpu.log, doctor.txt,
# target_bench.csv, kernel_bench.csv, logs.tgz (build log, cpu test log, JUnit XML, kernel_bench.txt,
# doctor.json, target_bench.txt, dref.tgz) and train.txt / train.tgz (scripts/gpu_train.sh).
# A whole check no longer fits one 10-minute call; these switches pick the stages:
#   GPU_TESTS / CPU_TESTS (ctest -R regexes), GPU_TESTS_EXCLUDE / CPU_TESTS_EXCLUDE (ctest -E; the cpu
#   default leaves out train_quality, the CI gate: minutes on one core), SKIP_TARGET_BENCH=1,
#   SKIP_TP2_BENCH=1 (no 2-GPU doctor / target_bench), TARGET_BENCH_ARGS, KERNEL_BENCH_ONLY=dattn,ce,
#   SKIP_DOCTOR=1, SKIP_TRAIN=1, TRAIN_STEPS=N, DFLASH_DREF=1.
#   device: run("DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_check.sh")  (the copied tree has no .git)
source "$(dirname "$0")/common.sh"
RESULTS="${OUT:-$DFLASH_ROOT/runs/gpu_check}"
mkdir -p "$RESULTS"
export DFLASH_BUILD="${DFLASH_BUILD:-$DFLASH_ROOT/build-gpu}"
{
  echo "commit ${DFLASH_GIT_COMMIT:-$(git -C "$DFLASH_ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  nvcc --version | tail -2
  cmake --version | head -1
} > "$RESULTS/environment.txt" 2>&1
cat "$RESULTS/environment.txt"

status=0
configure_and_build -DDFLASH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${DFLASH_CUDA_ARCHS:-90}" 2>&1 | tee "$RESULTS/build.log" | tail -5 \
  || { say "build failed (see build.log)"; exit 1; }
cd "$DFLASH_BUILD"
say "gpu tests"
ctest -L gpu ${GPU_TESTS:+-R "$GPU_TESTS"} ${GPU_TESTS_EXCLUDE:+-E "$GPU_TESTS_EXCLUDE"} --output-on-failure --timeout 600 --output-junit "$RESULTS/ctest_gpu.xml" 2>&1 | tee "$RESULTS/test_gpu.log" | tail -15 || status=1
say "cpu and mpi tests"
CPU_EXCLUDE="${CPU_TESTS_EXCLUDE-train_quality}"  # set CPU_TESTS_EXCLUDE= (empty) to run them all
ctest -LE gpu ${CPU_TESTS:+-R "$CPU_TESTS"} ${CPU_EXCLUDE:+-E "$CPU_EXCLUDE"} -j "$DFLASH_JOBS" --timeout 600 --output-junit "$RESULTS/ctest_cpu.xml" 2>&1 | tee "$RESULTS/test_cpu.log" | tail -5 || status=1

# Diagnostics and benchmarks (CSV rows carry the GPU name and commit).
Q27=$DFLASH_ROOT/configs/qwen3.6-27b/config.json
if [ "${SKIP_DOCTOR:-0}" != 1 ]; then
  say "dflash_doctor (Qwen3.6-27B shapes)"
  "$DFLASH_BUILD/target_model/dflash_doctor" --config "$Q27" --json "$RESULTS/doctor.json" 2>&1 | tee "$RESULTS/doctor.txt" || status=1
fi
if [ -x "$DFLASH_BUILD/bench/target_bench" ] && [ "${SKIP_TARGET_BENCH:-0}" != 1 ]; then
  say "target_bench (Qwen3.6-27B shapes, random weights), with the per-op profile"
  "$DFLASH_BUILD/bench/target_bench" --config "$Q27" --random-weights --profile ${TARGET_BENCH_ARGS:-} --csv "$RESULTS/target_bench.csv" \
    2>&1 | tee "$RESULTS/target_bench.txt" || status=1
  if [ "${TARGET_BENCH_AUTOTUNE:-0}" = 1 ]; then
    say "target_bench, fast path with GEMM autotuning"
    "$DFLASH_BUILD/bench/target_bench" --config "$Q27" --random-weights --path fast --gemm-autotune --rounds 1 \
      --csv "$RESULTS/target_bench.csv" 2>&1 | tee -a "$RESULTS/target_bench.txt" || status=1
  fi
fi
# Two or more GPUs (kind nvidia-h200-x2 and up): tensor parallelism across 2 of them.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${NGPU:-0}" -ge 2 ] && [ -x "$DFLASH_BUILD/bench/target_bench" ] && [ "${SKIP_TARGET_BENCH:-0}" != 1 ] &&
   [ "${SKIP_TP2_BENCH:-0}" != 1 ]; then
  say "tp=2 on 2 GPUs: NCCL bandwidth (doctor under mpirun) and target_bench --tp 2"
  mpirun -n 2 "$DFLASH_BUILD/target_model/dflash_doctor" --config "$Q27" --no-live 2>&1 | grep -A8 "NCCL all-reduce" \
    | tee -a "$RESULTS/doctor.txt" || status=1
  mpirun -n 2 "$DFLASH_BUILD/bench/target_bench" --config "$Q27" --random-weights --tp 2 ${TARGET_BENCH_ARGS:-} \
    --csv "$RESULTS/target_bench.csv" 2>&1 | tee -a "$RESULTS/target_bench.txt" || status=1
fi
if [ -x "$DFLASH_BUILD/bench/kernel_bench" ]; then
  say "kernel_bench"
  "$DFLASH_BUILD/bench/kernel_bench" ${KERNEL_BENCH_ONLY:+--only "$KERNEL_BENCH_ONLY"} --csv "$RESULTS/kernel_bench.csv" 2>&1 | tee "$RESULTS/kernel_bench.txt" || status=1
fi
# Reference data made with the machine's PyTorch (CPU) when asked: DFLASH_DREF=1.
if [ "${DFLASH_DREF:-0}" = 1 ]; then
  say "drafter reference data (PyTorch, float64, CPU)"
  python3 "$DFLASH_ROOT/tests/reference/make_drafter_reference.py" "$RESULTS/drafter_ref" > "$RESULTS/dref.log" 2>&1 || status=1
  tar czf "$RESULTS/dref.tgz" -C "$RESULTS" drafter_ref dref.log 2>/dev/null && rm -rf "$RESULTS/drafter_ref" "$RESULTS/dref.log"
fi
# Bundle the logs now, so that at most 6 files are in $RESULTS before the training stage adds its
# two (the device returns 8; a call cut by its time limit returns the first 8 it finds).
(cd "$RESULTS" && tar czf logs.tgz --remove-files $(ls build.log test_cpu.log ctest_gpu.xml ctest_cpu.xml kernel_bench.txt \
  doctor.json target_bench.txt dref.tgz 2>/dev/null) 2>/dev/null) || true
# Training: the tiny run on a GPU and the Qwen3.6-27B-shaped runs (1 GPU; 2 GPUs tp=1 and tp=2).
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  (cd "$DFLASH_ROOT" && bash scripts/gpu_train.sh "$RESULTS") || status=1
fi
ls -l "$RESULTS"
exit $status
