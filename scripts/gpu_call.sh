# Shared by the one-call GPU scripts (gpu_decode.sh, gpu_regen.sh): the start of a call and its gpu
# test stage. Source it, don't run it; it sources common.sh.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
set +e  # (common.sh sets -e) every stage runs and reports, whatever the one before did

# gpu_call_start: $OUT exists, $B is the build dir: $DFLASH_BUILD, which common.sh sets (the tree's build/ unless
# the caller set it: a command after the script finds its binaries there); $OUT/env.txt names the GPU and its
# clocks; then a Release sm_90 build of everything (or only the targets in $NINJA_TARGETS) into $B (log
# $OUT/build.log; on failure its tail is printed and the script exits 1).
gpu_call_start() {
  OUT=${OUT:-/tmp/out}
  mkdir -p "$OUT"
  B=$DFLASH_BUILD
  export DFLASH_GIT_COMMIT=${DFLASH_GIT_COMMIT:-}
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/env.txt" 2>&1
  local t0
  t0=$(date +%s)
  cmake -S "$DFLASH_ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
    ninja -C "$B" ${NINJA_TARGETS:-} >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -n 30 "$OUT/build.log"; exit 1; }
  echo "build $(( $(date +%s) - t0 )) s"
}

# gpu_call_tests DEFAULT_REGEX [ctest args...]: unless SKIP_TESTS is set, the gpu tests matching
# $GPU_TESTS (else the default) into $OUT/tests.log, and their summary lines.
gpu_call_tests() {
  [ -n "${SKIP_TESTS:-}" ] && return 0
  local regex=${GPU_TESTS:-$1}
  shift
  (cd "$B" && ctest -L gpu -R "$regex" "$@" --output-on-failure --timeout 300 >"$OUT/tests.log" 2>&1)
  grep -E "tests passed|Failed|\*\*\*" "$OUT/tests.log" | tail -n 8
}
