#!/usr/bin/env bash
# Sequence length as a scale axis (issue 31) on one H200 in one device call: builds dflash_train alone
# (Release, sm_90), then runs scripts/gpu_train.sh's q27_seq<L> runs: the Qwen3.6-27B recipe (random
# target weights) at SEQ_LENS (default 4096 8192 16384 32768), SEQ_PRECISION (default fp8), SEQ_ANCHORS
# (default recipe: 512 anchors; "density": L/8 in passes of 512 blocks; "recipe density": both),
# SEQ_STEPS (default 15, logged every 5: the rows average the last 10), SEQ_DRAFTER (default bf16; fp8:
# the FP8 drafter's linears, runs q27_seq<L>_d8, shapes drafter=5x16-fp8).
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_seqlen.sh
# Writes 5 files to $OUT: env.txt, build.log, train.txt (each run's command, memory plan, step lines,
# summary and step split), train.tgz (logs, metrics.jsonl) and train_rows.csv (the bench rows
# dflash_train,step,cuda,train: trained_tok_s_per_gpu, mfu, peak_mem_gib, step_s, target_fwd_s,
# drafter_s, ...; shape "qwen3_5 L64 H5120 seq=L fp8 tp=1 dp=1 drafter=5x16 anchors=A batch=1x1").
# Expected ~80 s build on 16 cores + ~190 s of runs (gpu_train.sh's header says per length); every run
# is stopped in time before DFLASH_DEADLINE (default: 570 s after the start), keeping its rows.
set -uo pipefail
source "$(dirname "$0")/common.sh"
set +e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export DFLASH_DEADLINE=${DFLASH_DEADLINE:-$(( $(date +%s) + 570 ))}
export DFLASH_GIT_COMMIT=${DFLASH_GIT_COMMIT:-}
B=$DFLASH_BUILD  # (common.sh: the tree's build/ unless the caller set DFLASH_BUILD)
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total,memory.used --format=csv; date -u; } >"$OUT/env.txt" 2>&1
t0=$(date +%s)
cmake -S "$DFLASH_ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
  ninja -C "$B" -j "$DFLASH_JOBS" dflash_train >>"$OUT/build.log" 2>&1 ||
  { echo "build failed"; grep -E "error|FAILED" "$OUT/build.log" | head -n 30; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
cd "$DFLASH_ROOT"
DFLASH_BUILD=$B TRAIN_RUNS='q27_seq.*' SEQ_LENS=${SEQ_LENS:-4096 8192 16384 32768} TRAIN_CSV="$OUT/train_rows.csv" \
  bash scripts/gpu_train.sh "$OUT"
rc=$?
grep -E "^== |summary:|step time|rc=" "$OUT/train.txt"
grep -E "trained_tok_s_per_gpu|peak_mem_gib|,step_s," "$OUT/train_rows.csv" 2>/dev/null | cut -d, -f5,7,8
echo "total $(( $(date +%s) - t0 )) s, rc=$rc"
exit $rc
