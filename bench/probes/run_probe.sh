#!/usr/bin/env bash
# Device call for fp8_gemv_probe.cu: build, run, and three ncu looks at gate/up M 16 (FP8).
#   run: bash bench/probes/run_probe.sh   (writes probe.txt, ncu.txt, build.txt to $OUT)
set -u
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")"
nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v fp8_gemv_probe.cu -o /tmp/probe >"$OUT/build.txt" 2>&1 || { tail -n 30 "$OUT/build.txt"; exit 1; }
timeout 240 /tmp/probe >"$OUT/probe.txt" 2>&1
echo "probe rc=$?"
: >"$OUT/ncu.txt"
for spec in "gemv_kernel<2, 4, false, false, false, 8, true>:2" "gemv_kernel<2, 4, false, false, false, 8, true>:22" \
            "gemv_kernel<2, 4, true, false, false, 8, true>:2"; do
  k=${spec%:*} skip=${spec##*:}
  echo "=== $k launch-skip $skip" >>"$OUT/ncu.txt"
  timeout 90 ncu --clock-control none --kernel-name-base demangled -k "regex:${k//[<>]/.}" --launch-skip "$skip" -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    /tmp/probe 16 1 0 >>"$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" >>"$OUT/ncu.txt"
done
