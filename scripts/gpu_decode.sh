#!/usr/bin/env bash
# Speculative decoding on the GPU machine in one call (issue 16): builds what it needs, runs the
# decode / verify GPU tests, trains the tiny demo drafter on the GPU and evaluates it with
# dflash_eval on the GPU and on the CPU reference, and times the Qwen3.6-27B-shaped decode step,
# verify step and propose step (random weights, an untrained 5-layer drafter, a 4096-token prompt).
#   device run: DFLASH_GIT_COMMIT=<sha> bash scripts/gpu_decode.sh
# Writes at most 8 files to $OUT: build.log, tests.log, tiny_eval.log, tiny_eval.csv, eval27b.log,
# eval27b.csv, env.txt. Switches: SKIP_TESTS=1, SKIP_TINY=1, SKIP_27B=1, GPU_TESTS (ctest -L gpu -R regex,
# default the decode tests; '.' = every gpu test), EVAL27B_NEW (new tokens, default 64), EVAL27B_PROFILE
# (decode steps profiled op by op, default 8), EVAL27B_PRECISIONS (default "bf16 fp8": one dflash_eval each,
# stated against the one roofline of bench/roofline.h), EVAL27B_GRAPHS (default "on off": each precision with
# its decode / verify / commit steps replayed as CUDA graphs, then launched eagerly, --no-cuda-graphs),
# NINJA_TARGETS (build only these, e.g. "test_cuda_decoder dflash_eval").
# The op profile (--profile) times eager launches in both modes (a profiler bypasses the graphs).
source "$(dirname "$0")/gpu_call.sh"
gpu_call_start
gpu_call_tests "CudaDecode|CudaProposer|CudaSampling|CudaModel|CudaGolden"
if [ -z "${SKIP_TINY:-}" ]; then
  w=/tmp/tiny-eval
  rm -rf "$w"
  {
    "$B/trainer/dflash_train" --set parallel.device=cuda --set logging.run_dir=$w --set logging.progress_bar=false &&
      "$B/bench/dflash_eval" --config configs/tiny/config.json --random-weights --drafter $w/drafter \
        --prompts $w/data/synth.h5 --num-prompts 8 --max-new-tokens 64 --device cuda --csv "$OUT/tiny_eval.csv" &&
      "$B/bench/dflash_eval" --config configs/tiny/config.json --random-weights --drafter $w/drafter \
        --prompts $w/data/synth.h5 --num-prompts 8 --max-new-tokens 64 --device cpu --csv "$OUT/tiny_eval.csv"
  } >"$OUT/tiny_eval.log" 2>&1
  echo "tiny eval rc=$?"
  grep -E "^tau|estimate|speed-up|outputs|FAILED" "$OUT/tiny_eval.log"
fi
if [ -z "${SKIP_27B:-}" ]; then
  python3 -c "import random; random.seed(0); print(' '.join(str(random.randrange(248000)) for _ in range(4096)))" >/tmp/p4k.txt
  : >"$OUT/eval27b.log"
  for prec in ${EVAL27B_PRECISIONS:-bf16 fp8}; do
    for graphs in ${EVAL27B_GRAPHS:-on off}; do
      flag=
      [ "$graphs" = off ] && flag=--no-cuda-graphs
      echo "=== dflash_eval $prec graphs $graphs" >>"$OUT/eval27b.log"
      timeout 300 "$B/bench/dflash_eval" --config configs/qwen3.6-27b/config.json --random-weights --random-drafter 5 \
        --precision "$prec" --prompts /tmp/p4k.txt --num-prompts 1 --max-new-tokens "${EVAL27B_NEW:-64}" --device cuda \
        --no-estimate --require-fast-path --profile "${EVAL27B_PROFILE:-8}" $flag --csv "$OUT/eval27b.csv" \
        >>"$OUT/eval27b.log" 2>&1
      echo "27b eval $prec graphs $graphs rc=$?"
    done
  done
  grep -E "^===|^tau|step|roofline|decode  |verify  |propose |speed-up|outputs|FAILED|total|gemm|graphs" "$OUT/eval27b.log" | head -n 90
fi
