#!/usr/bin/env bash
# Device call for fp8_gemv_probe.cu: build, run, and five ncu looks at gate/up M 16 (FP8).
#   run: bash bench/probes/run_probe.sh   (writes probe.txt, ncu.txt, build.txt to $OUT)
set -u
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")"
nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v fp8_gemv_probe.cu -o /tmp/probe >"$OUT/build.txt" 2>&1 || { tail -n 30 "$OUT/build.txt"; exit 1; }
timeout 240 /tmp/probe >"$OUT/probe.txt" 2>&1
echo "probe rc=$?"
: >"$OUT/ncu.txt"
# (ncu's demangled names spell the template arguments "(int)2, (bool)0": the regex matches that, "(" and ")" as ".")
for spec in "gemv_kernel<(int)2, (int)4, (bool)0, (bool)0, (bool)0, (int)8, (bool)1>:2" \
            "gemv_kernel<(int)2, (int)4, (bool)0, (bool)0, (bool)0, (int)8, (bool)1>:22" \
            "gemv_kernel<(int)2, (int)4, (bool)1, (bool)0, (bool)0, (int)8, (bool)1>:2" \
            "bulk_kernel<(int)2, (int)8, (int)4, (int)2, (bool)0, (bool)1>:2" \
            "tma_kernel<(int)2, (int)8, (int)4, (int)2, (bool)0>:2"; do
  k=${spec%:*} skip=${spec##*:}
  echo "=== $k launch-skip $skip" >>"$OUT/ncu.txt"
  re=$(printf '%s' "$k" | sed 's/[][<>()]/./g')
  timeout 90 ncu --clock-control none --kernel-name-base demangled -k "regex:$re" --launch-skip "$skip" -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
    /tmp/probe 16 1 0 >>"$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?" >>"$OUT/ncu.txt"
done
