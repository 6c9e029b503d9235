#!/usr/bin/env bash
# The FP8 target (issue 18) on the GPU machine in one call: builds, runs the FP8 gpu tests (and the
# model / decoder tests they extend), times the forward at bf16 and fp8 on Qwen3.6-27B shapes
# (target_bench, the fp8 one profiled op by op), the FP8 GEMMs against the dense FP8 ceiling
# (kernel_bench --only fp8), measures the captured hidden states' error of the FP8 forward against
# the bf16 one on the 27B shapes (dflash_features twice + scripts/compare_features.py), the batch-1
# decode step of both (generate_bench), the tiny quality gate with the 2 x 2 tau table
# (DFLASH_GATE_FP8=1) and the 27B training recipe with the FP8 target.
#   device run: DFLASH_GIT_COMMIT=<sha> DFLASH_JOBS=16 bash scripts/gpu_fp8.sh
# Writes at most 8 files to $OUT: env.txt, build.log, tests.log, bench.tgz (target_bench, kernel_bench,
# generate_bench logs and CSVs), features.log, gate.log, train.log, train.tgz.
# Switches: SKIP_TESTS=1, GPU_TESTS (ctest -R regex; default the FP8-related ones), SKIP_BENCH=1,
# SKIP_KBENCH=1, SKIP_FEATURES=1, SKIP_DECODE=1, SKIP_GATE=1, SKIP_TRAIN=1, TRAIN_STEPS (default 40),
# TRAIN_PRECISIONS (default fp8), BENCH_PRECISIONS (default bf16 fp8), BENCH_SEQ (default 8192), DFLASH_DEADLINE (epoch s: training stops in time).
set -uo pipefail
source "$(dirname "$0")/common.sh"
set +e
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/fp8res
B=$DFLASH_BUILD  # (common.sh: the tree's build/ unless the caller set DFLASH_BUILD)
R=/tmp/fp8res
export DFLASH_GIT_COMMIT=${DFLASH_GIT_COMMIT:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv >"$OUT/env.txt" 2>&1
t0=$(date +%s)
cmake -S "$DFLASH_ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
  ninja -C "$B" -j "$DFLASH_JOBS" >>"$OUT/build.log" 2>&1 || { echo "build failed"; grep -E "error|FAILED" "$OUT/build.log" | head -n 30; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
if [ -z "${SKIP_TESTS:-}" ]; then
  (cd "$B" && ctest -L gpu -R "${GPU_TESTS:-Fp8|CudaModel|CudaDecoder}" -E Timing --output-on-failure --timeout 300 >"$OUT/tests.log" 2>&1)
  (cd "$B" && ctest -R "Fp8" -L cpu --output-on-failure >>"$OUT/tests.log" 2>&1)
  grep -E "tests passed|Failed|\*\*\*|max rel err|measured" "$OUT/tests.log" | head -n 40
fi
C27=configs/qwen3.6-27b/config.json
if [ -z "${SKIP_BENCH:-}" ]; then
  for p in ${BENCH_PRECISIONS:-bf16 fp8}; do
    extra=()
    [ "$p" = fp8 ] && extra=(--profile)
    timeout 240 "$B/bench/target_bench" --config $C27 --random-weights --precision $p --seq "${BENCH_SEQ:-8192}" --path fast \
      --csv "$R/target_bench.csv" "${extra[@]}" >"$R/target_bench_$p.log" 2>&1
    echo "target_bench $p rc=$?"
    grep -E "^[0-9]+ +fast|MFU against|weights:" "$R/target_bench_$p.log"
  done
  grep -E "gemm|fp8_quant|SLOW" "$R/target_bench_fp8.log" | head -n 30
fi
if [ -z "${SKIP_KBENCH:-}" ]; then
  timeout 200 "$B/bench/kernel_bench" --only fp8 --csv "$R/kernel_bench_fp8.csv" >"$R/kernel_bench_fp8.log" 2>&1
  echo "kernel_bench fp8 rc=$?"
  cat "$R/kernel_bench_fp8.log" | tail -n 40
fi
if [ -z "${SKIP_FEATURES:-}" ]; then
  {
    python3 -c "import random; random.seed(1); print(','.join(str(random.randrange(248320)) for _ in range(2048)))" >/tmp/ids.txt
    for p in bf16 fp8; do
      timeout 200 "$B/target_model/dflash_features" --config $C27 --random-weights --device cuda --precision $p \
        --tokens-file /tmp/ids.txt --layers 1,16,31,46,61 --out /tmp/feat_$p.safetensors
      echo "dflash_features $p rc=$?"
    done
    # How this random network amplifies rounding-level differences: the bf16 forward on the fallback
    # kernels (the same math, other summation orders) against the fast one.
    timeout 200 "$B/target_model/dflash_features" --config $C27 --random-weights --device cuda --precision bf16 \
      --conv fallback --delta-rule-kernel fallback --attention fallback \
      --tokens-file /tmp/ids.txt --layers 1,16,31,46,61 --out /tmp/feat_bf16_fallback.safetensors
    echo "dflash_features bf16 fallback rc=$?"
    echo "== the FP8 forward's captured hidden states against the bf16 forward's (Qwen3.6-27B shapes, random weights, 2048 tokens)"
    python3 scripts/compare_features.py /tmp/feat_fp8.safetensors /tmp/feat_bf16.safetensors
    echo "== calibration: the bf16 forward on the fallback kernels against the fast one (rounding-level differences)"
    python3 scripts/compare_features.py /tmp/feat_bf16_fallback.safetensors /tmp/feat_bf16.safetensors
  } >"$OUT/features.log" 2>&1
  tail -n 16 "$OUT/features.log"
fi
if [ -z "${SKIP_DECODE:-}" ]; then
  for p in bf16 fp8; do
    timeout 150 "$B/bench/generate_bench" --config $C27 --precision $p --slots 1,64 --prompt-len 512 --max-new-tokens 128 \
      --csv "$R/generate_bench.csv" >"$R/generate_bench_$p.log" 2>&1
    echo "generate_bench $p rc=$?"
    tail -n 4 "$R/generate_bench_$p.log"
  done
fi
if [ -z "${SKIP_GATE:-}" ]; then
  t1=$(date +%s)
  DFLASH_GATE_FP8=1 DFLASH_TRAIN_DEVICE=cuda bash tests/train_test.sh quality "$B/trainer/dflash_train" configs/tiny/config.json /tmp/gate \
    >"$OUT/gate.log" 2>&1
  echo "quality gate with fp8 (1 GPU) rc=$? in $(( $(date +%s) - t1 )) s"
  grep -E "demo|tau|trained on|FAIL|^OK" "$OUT/gate.log"
fi
if [ -z "${SKIP_TRAIN:-}" ]; then
  for p in ${TRAIN_PRECISIONS:-fp8}; do
    left=$(( ${DFLASH_DEADLINE:-$(( $(date +%s) + 100000 ))} - $(date +%s) - 10 ))
    [ "$left" -lt 60 ] && { echo "train $p: skipped, $left s left"; continue; }
    timeout -s TERM "$left" "$B/trainer/dflash_train" configs/qwen3.6-27b.yaml --set model.target.path= \
      --set model.target.config=$C27 --set model.target.random_weights=true --set model.target.precision=$p \
      --set data.files=[] --set data.synth.enabled=true --set data.synth.path=/tmp/q27_synth.h5 \
      --set data.synth.num_sequences=512 --set data.synth.min_length=4096 --set data.synth.max_length=4096 \
      --set data.synth.vocab_size=0 --set training.epochs=null --set training.max_steps="${TRAIN_STEPS:-40}" \
      --set logging.interval=10 --set checkpoint.at_end=false --set parallel.device=cuda \
      --set kernels.require_fast_path=true --set parallel.tp=1 --set logging.run_dir=/tmp/q27_$p \
      --set logging.progress_bar=false >"$R/train_$p.log" 2>&1
    echo "train $p rc=$?"
    grep -E "memory|target weights|tok/s|MFU|step +[0-9]+|done" "$R/train_$p.log" | tail -n 14
  done
  cat "$R"/train_*.log >"$OUT/train.log" 2>/dev/null
  tar czf "$OUT/train.tgz" -C /tmp $(cd /tmp && ls -d q27_*/metrics.jsonl 2>/dev/null) 2>/dev/null
fi
tar czf "$OUT/bench.tgz" -C "$R" . 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
