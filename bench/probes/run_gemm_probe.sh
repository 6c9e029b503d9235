#!/usr/bin/env bash
# Device call for fp8_gemm_probe.cu: build it (sm_90a) and run it at M 8192 (and GEMM_PROBE_M, e.g. "8192 4096").
#   run: bash bench/probes/run_gemm_probe.sh   (writes gemm_probe.txt and gemm_probe_build.txt to $OUT)
# The comparison is cuBLASLt's block-scaled kernels on the same shapes: kernel_bench --only fp8 (gemm_fp8 M8192 rows)
# in the same call.
set -u
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")"
nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -I../.. -Xptxas -v fp8_gemm_probe.cu -o /tmp/gemm_probe \
  >"$OUT/gemm_probe_build.txt" 2>&1 || { tail -n 30 "$OUT/gemm_probe_build.txt"; exit 1; }
: >"$OUT/gemm_probe.txt"
for m in ${GEMM_PROBE_M:-8192}; do
  for v in ${GEMM_PROBE_VARIANTS:-0 1 2 3 4 5 6 7}; do  # one process a variant: a trapped (stuck) kernel ends only its own
    timeout "${GEMM_PROBE_TIMEOUT:-90}" /tmp/gemm_probe "$m" "$v" >>"$OUT/gemm_probe.txt" 2>&1
    echo "gemm_probe M $m variant $v rc=$?" | tee -a "$OUT/gemm_probe.txt"
  done
done
