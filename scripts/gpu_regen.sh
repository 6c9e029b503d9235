#!/usr/bin/env bash
# Regeneration and the drafter-quality gate on the GPU machine in one call (issue 17): builds
# everything, runs the gpu tests, times batched generation on Qwen3.6-27B shapes over the sequences
# in flight (generate_bench: random weights, 512-token prompts, 512 new tokens), and runs the tiny
# quality gate on one GPU (tests/train_test.sh quality: regenerate, train 300 steps, dflash_eval on
# held-out prompts; the time of each part); on a 2-GPU machine also dflash_data regenerate and
# dflash_eval with tp = 2.
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_regen.sh
# Writes at most 8 files to $OUT: env.txt, build.log, tests.log, genbench.log, genbench.csv, gate.log,
# tp2.log. Switches: SKIP_TESTS=1, GPU_TESTS (ctest -L gpu -R regex, default every gpu test),
# SKIP_GENBENCH=1, GENBENCH_SLOTS (default 1,8,32,64,128), GENBENCH_NEW (default 512),
# GENBENCH_STEP_TOKENS (default 0,256,1024: each point with separate prefills and chunked prefill),
# GENBENCH_VARIANT (generate_bench --decode-variant, e.g. prefetch; default fused: the plan as is),
# SKIP_GATE=1, SKIP_TP2=1.
source "$(dirname "$0")/gpu_call.sh"
gpu_call_start
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
gpu_call_tests . -E Timing
if [ -z "${SKIP_GENBENCH:-}" ]; then
  timeout 540 "$B/bench/generate_bench" --config configs/qwen3.6-27b/config.json --slots "${GENBENCH_SLOTS:-1,8,32,64,128}" \
    --prompt-len 512 --max-new-tokens "${GENBENCH_NEW:-512}" \
    --step-tokens "${GENBENCH_STEP_TOKENS:-0,256,1024}" --decode-variant "${GENBENCH_VARIANT:-fused}" \
    --csv "$OUT/genbench.csv" >"$OUT/genbench.log" 2>&1
  echo "generate_bench rc=$?"
  cat "$OUT/genbench.log"
fi
if [ -z "${SKIP_GATE:-}" ]; then
  t1=$(date +%s)
  DFLASH_TRAIN_DEVICE=cuda bash tests/train_test.sh quality "$B/trainer/dflash_train" configs/tiny/config.json /tmp/gate \
    >"$OUT/gate.log" 2>&1
  echo "quality gate (1 GPU) rc=$? in $(( $(date +%s) - t1 )) s"
  grep -E "demo|tau|FAIL|^OK" "$OUT/gate.log"
fi
if [ -z "${SKIP_TP2:-}" ] && [ "$ngpu" -ge 2 ]; then
  {
    w=/tmp/gate
    t2=$(date +%s)
    mpirun -n 2 "$B/data/dflash_data" regenerate $w/trained/data/synth.h5 --out /tmp/regen_tp2.h5 --config configs/tiny/config.json \
      --random-weights --max-new-tokens 40 --device cuda --tp 2 --no-progress
    echo "regenerate tp 2: rc=$? in $(( $(date +%s) - t2 )) s"
    mpirun -n 2 "$B/bench/dflash_eval" --config configs/tiny/config.json --random-weights --drafter $w/trained/drafter \
      --prompts $w/heldout.h5 --max-new-tokens 40 --device cuda --tp 2
    echo "eval tp 2: rc=$?"
  } >"$OUT/tp2.log" 2>&1
  grep -E "regenerate|^tau|estimate on|outputs|rc=" "$OUT/tp2.log"
fi
