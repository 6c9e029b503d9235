#!/usr/bin/env bash
# Device call for fp8_gemm_probe.cu: build it (sm_90a) and run its variants (GEMM_PROBE_VARIANTS, default all) at
# M 8192 (or GEMM_PROBE_M, e.g. "8192 4096"); writes gemm_probe.txt and gemm_probe_build.txt to $OUT.
#   run: bash bench/probes/run_gemm_probe.sh   (DFLASH_GIT_COMMIT=<sha>: the commit kernel_bench's rows name)
# The comparison is cuBLASLt's block-scaled kernels on the same shapes: with GEMM_PROBE_CUBLAS=1 the same call builds
# kernel_bench (Release, sm_90, into ${DFLASH_BUILD:-/tmp/build-probe}; build.log) and runs --only fp8 --quick
# (kernel_bench_fp8.csv / .log: the gemm_fp8 M8192 rows). At most 7 files come back.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT/bench/probes"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/env.txt" 2>&1
nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I../.. -Xptxas -v fp8_gemm_probe.cu -o /tmp/gemm_probe \
  >"$OUT/gemm_probe_build.txt" 2>&1 || { tail -n 30 "$OUT/gemm_probe_build.txt"; exit 1; }
: >"$OUT/gemm_probe.txt"
for m in ${GEMM_PROBE_M:-8192}; do
  for v in ${GEMM_PROBE_VARIANTS:-0 1 2 3 4 5 6 7 8 9 10}; do  # one process a variant: a trapped (stuck) kernel ends only its own
    timeout "${GEMM_PROBE_TIMEOUT:-90}" /tmp/gemm_probe "$m" "$v" >>"$OUT/gemm_probe.txt" 2>&1
    echo "gemm_probe M $m variant $v rc=$?" | tee -a "$OUT/gemm_probe.txt"
  done
done
grep -E "TFLOP|FAIL|mismatch|skipped|error" "$OUT/gemm_probe.txt"
# GEMM_PROBE_NCU="1 4": Nsight Compute's speed-of-light and memory sections of those variants' gate/up GEMM (shape 3)
# at the first M, one launch each (ncu.txt): which of L2, shared memory and the tensor pipes is near its peak.
# GEMM_PROBE_NCU_SECTIONS: other sections (e.g. "WarpStateStats SchedulerStats SourceCounters": where the warps
# stall and on which instructions).
for v in ${GEMM_PROBE_NCU:-}; do
  m=${GEMM_PROBE_M:-8192}
  sections=()
  for sec in ${GEMM_PROBE_NCU_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis ComputeWorkloadAnalysis}; do sections+=(--section "$sec"); done
  timeout 150 ncu --clock-control none -k regex:gemm_kernel -c 1 "${sections[@]}" /tmp/gemm_probe "${m%% *}" "$v" 3 \
    >>"$OUT/ncu.txt" 2>&1
  echo "ncu variant $v rc=$?" | tee -a "$OUT/ncu.txt"
done
if [ "${GEMM_PROBE_CUBLAS:-0}" = 1 ]; then
  B=${DFLASH_BUILD:-/tmp/build-probe}
  { cmake -S "$ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 &&
    ninja -C "$B" kernel_bench; } >"$OUT/build.log" 2>&1 || { echo "kernel_bench build failed"; tail -n 20 "$OUT/build.log"; exit 1; }
  timeout 200 "$B/bench/kernel_bench" --only fp8 --quick --csv "$OUT/kernel_bench_fp8.csv" >"$OUT/kernel_bench_fp8.log" 2>&1
  echo "kernel_bench fp8 rc=$?"
  grep gemm_fp8 "$OUT/kernel_bench_fp8.log" | grep M8192 | head -n 24
fi
