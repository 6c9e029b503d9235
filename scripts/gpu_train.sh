#!/usr/bin/env bash
# The training runs of the GPU check (called by gpu_check.sh; or alone after a build):
#   1. the tiny default config on one GPU (parallel.device=cuda): the loss must fall; then
#      tests/train_test.sh's learn, resume (bit-exact) and, on 2 GPUs, mpi modes on the GPU backend;
#   2. the Qwen3.6-27B-shaped recipe (random target weights, synthetic 4096-token sequences, 512
#      anchors, 5-layer drafter) on 1 GPU, on 2 GPUs with tp=1 (data parallel) and tp=2, and on 8
#      GPUs with tp=1, 2 and 8 (TRAIN_RUNS=q27_8gpu_.* for issue 8 alone); the Qwen3.6-35B-A3B recipe
#      (an MoE target, issue 33) on 1 GPU (run q35_1gpu);
#   3. with SEQ_LENS="4096 8192 16384 32768" (issue 31) the recipe on 1 GPU at each sequence length
#      (runs q27_seq<L>): SEQ_PRECISION (default fp8) target, SEQ_DRAFTER (default bf16; fp8: the FP8
#      drafter, runs q27_seq<L>_d8), SEQ_WGRAD_X (default auto = 128 x 128 blocks; "auto 128x1": with the FP8
#      drafter each length also with the weight gradients' x in 128 x 1 tiles, runs <name>_wgx1), SEQ_HEADS (default bf16; "bf16 fp8": each length with the LM-head CE in
#      bf16 and in FP8, model.drafter.lm_head_precision, runs ..._h8), one sequence of L tokens a step, SEQ_STEPS
#      (default 15) steps logged every 5, so the rows average the last 10; SEQ_ANCHORS (default recipe)
#      "recipe" keeps the recipe's 512 anchors per sequence, "density" its one anchor per 8 tokens (L/8,
#      in drafter passes of 512 blocks: training.blocks_per_pass; runs q27_seq<L>_density), "recipe
#      density" both, a number N that many anchors (runs q27_seq<L>_aN: e.g. 2048 tokens with 256 fit an H100). Expected at the last measured step's rates (fp8 0.451 s at 4096: target 0.227,
#      drafter 0.203; scaled by FLOPs, TrainFlops.SequenceLengthAxis) plus ~30 s a run (start-up, drafter
#      export): recipe 37 / 41 / 48 / 65 s at 4096 / 8192 / 16384 / 32768 (~190 s; the attention layers
#      run slower than the GEMMs, so 32768 may take ~15 s more), density 37 / 44 / 58 / ~100 s;
# leaving train.txt (the commands and their last log lines) and train.tgz (logs, metrics.jsonl, and the
# benchmark rows train_rows.csv unless TRAIN_CSV names another file) in $RESULTS. Every 27B-shaped run
# appends its rows (dflash_train --csv: trained_tok_s_per_gpu, mfu, peak_mem_gib, the step split) to
# TRAIN_CSV (default $W/train_rows.csv, tarred into train.tgz; gpu_seqlen.sh passes $OUT/train_rows.csv).
# TRAIN_STEPS (default 40) sets the 27B-shaped runs' length; TRAIN_RUNS (a regex over the
# run names: tiny_gpu tiny_gpu_d8 tt_learn tt_resume tt_nonfinite tt_microbatch tt_sigterm tt_mpi q27_refuse_d256 q27_1gpu q35_1gpu q35_1gpu_fp8x q35_1gpu_d8
# q27_seq<L>[_density] q27_2gpu_tp1 q27_2gpu_tp2 q27_8gpu_tp1 q27_8gpu_tp2 q27_8gpu_tp8 q27_ckpt q27_resume) picks
# runs; DFLASH_DEADLINE (epoch seconds) stops each run with SIGTERM in time (dflash_train then writes
# its rows and a checkpoint and exits cleanly) so that a device call's time limit never cuts a run's log.
#   bash scripts/gpu_train.sh RESULTS_DIR   (DFLASH_BUILD = the build directory)
source "$(dirname "$0")/common.sh"
set +e  # (common.sh sets -e) a failing run is logged and counted in status; under -e it ended the script before its log lines
RESULTS=${1:?results dir}
# Work outside $OUT (the device returns at most 8 files, and nothing at all when more are there at a
# timeout): after each run train.txt and train.tgz are brought up to date, so a run cut by the time
# limit still returns the ones before it.
W=${DFLASH_TRAIN_WORK:-/tmp/dflash_gpu_train}
rm -rf "$W"
mkdir -p "$W"
T=$DFLASH_BUILD/trainer/dflash_train
STEPS=${TRAIN_STEPS:-40}
CSV=${TRAIN_CSV:-$W/train_rows.csv}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
status=0
run() {  # run NAME CMD...: logs to $W/NAME.log, appends the command and the summary lines to train.txt
  local name=$1; shift
  if [ -n "${TRAIN_RUNS:-}" ] && ! [[ $name =~ ^($TRAIN_RUNS)$ ]]; then return 0; fi
  local limit=()
  if [ -n "${DFLASH_DEADLINE:-}" ]; then
    local left=$((DFLASH_DEADLINE - $(date +%s) - 25))
    if [ $left -lt 30 ]; then say "train: $name skipped (${left}s left before the deadline)"
      echo "== $name skipped: ${left}s left before DFLASH_DEADLINE" >> "$RESULTS/train.txt"; return 0; fi
    limit=(timeout -s TERM -k 20 $left)
  fi
  say "train: $name"
  { echo "== $name"; echo "\$ $*"; } >> "$RESULTS/train.txt"
  local t0=$SECONDS
  "${limit[@]}" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  grep -E "backend:|initialised|fast path|memory|step [0-9]+/|step time|written|resumed|error|done:|summary:|signal|refus|FAIL|^OK|loss |differ|max relative|--csv" "$W/$name.log" | tail -n 18 >> "$RESULTS/train.txt"
  echo "rc=$rc wall=$((SECONDS - t0))s" >> "$RESULTS/train.txt"
  tail -n 3 "$W/$name.log"
  [ $rc = 0 ] || status=1
  # Logs and metrics so far (not data or exported weights).
  tar czf "$RESULTS/train.tgz" -C "$W" $(cd "$W" && ls -d *.log */metrics.jsonl */logs train_rows.csv 2>/dev/null) 2>/dev/null
}
run tiny_gpu "$T" --set parallel.device=cuda --set training.max_steps=60 --set logging.run_dir="$W/tiny_gpu" \
  --set data.synth.path="$W/tiny_synth.h5" --set checkpoint.at_end=false
# The same with the FP8 drafter (issue 31: the tiny drafter's sizes are multiples of 128).
run tiny_gpu_d8 "$T" --set parallel.device=cuda --set training.max_steps=60 --set logging.run_dir="$W/tiny_gpu_d8" \
  --set data.synth.path="$W/tiny_synth.h5" --set checkpoint.at_end=false --set model.drafter.precision=fp8

# The CPU backend's end-to-end checks on the GPU backend: learning, bit-exact resume, and (2 GPUs)
# 1 rank vs dp2 / tp2.
TT=$DFLASH_ROOT/tests/train_test.sh
TINY=$DFLASH_ROOT/configs/tiny/config.json
export DFLASH_TRAIN_DEVICE=cuda
run tt_learn bash "$TT" learn "$T" "$TINY" "$W/tt_learn"
run tt_resume bash "$TT" resume "$T" "$TINY" "$W/tt_resume"
run tt_nonfinite bash "$TT" nonfinite "$T" "$TINY" "$W/tt_nonfinite"
run tt_microbatch bash "$TT" microbatch "$T" "$TINY" "$W/tt_microbatch"
run tt_sigterm bash "$TT" sigterm "$T" "$TINY" "$W/tt_sigterm"
if [ "${NGPU:-0}" -ge 2 ]; then run tt_mpi bash "$TT" mpi "$T" "$TINY" "$W/tt_mpi" mpirun; fi
unset DFLASH_TRAIN_DEVICE

Q27=(configs/qwen3.6-27b.yaml --set model.target.path= --set model.target.config=configs/qwen3.6-27b/config.json
     --set model.target.random_weights=true --set data.files=[] --set data.synth.enabled=true
     --set data.synth.path="$W/q27_synth.h5" --set data.synth.num_sequences=512 --set data.synth.min_length=4096
     --set data.synth.max_length=4096 --set data.synth.vocab_size=0 --set training.epochs=null
     --set training.max_steps="$STEPS" --set logging.interval=10 --set checkpoint.at_end=false
     --set parallel.device=cuda --set kernels.require_fast_path=true)
cd "$DFLASH_ROOT"
# The drafter with the target's attention shape (head_dim 256: no tensor-core kernel) must be refused
# under require_fast_path, before any weights are loaded.
run q27_refuse_d256 bash -c 'out=$("$@" 2>&1); rc=$?; echo "$out" | tail -n 4
  [ $rc != 0 ] && echo "$out" | grep -q "drafter.s attention would run the fallback kernel" && echo "OK: refused"' _ \
  "$T" "${Q27[@]}" --set model.drafter.num_attention_heads=null --set model.drafter.num_key_value_heads=null \
  --set model.drafter.head_dim=null --set logging.run_dir="$W/q27_refuse"
run q27_1gpu "$T" "${Q27[@]}" --set parallel.tp=1 --set logging.run_dir="$W/q27_1gpu" --csv "$CSV"
# The Qwen3.6-35B-A3B recipe (issue 33: an MoE target, bf16, random weights; the z-lab drafter's shape)
# on one GPU, the same synthetic 4096-token corpus.
Q35=(configs/qwen3.6-35b-a3b.yaml --set model.target.path= --set model.target.config=configs/qwen3.6-35b-a3b/config.json
     --set model.target.random_weights=true --set data.files=[] --set data.synth.enabled=true
     --set data.regenerate.enabled=false --set data.synth.path="$W/q27_synth.h5" --set data.synth.num_sequences=512
     --set data.synth.min_length=4096 --set data.synth.max_length=4096 --set data.synth.vocab_size=0
     --set training.epochs=null --set training.max_steps="$STEPS" --set logging.interval=10 --set checkpoint.at_end=false
     --set parallel.device=cuda --set kernels.require_fast_path=true)
run q35_1gpu "$T" "${Q35[@]}" --set parallel.tp=1 --set logging.run_dir="$W/q35_1gpu" --csv "$CSV"
# The same with the routed experts in FP8 (W8A16: the grouped GEMMs read e4m3 tiles) and with the FP8 drafter.
run q35_1gpu_fp8x "$T" "${Q35[@]}" --set parallel.tp=1 --set model.target.fp8_experts=true \
  --set logging.run_dir="$W/q35_1gpu_fp8x" --csv "$CSV"
run q35_1gpu_d8 "$T" "${Q35[@]}" --set parallel.tp=1 --set model.drafter.precision=fp8 \
  --set logging.run_dir="$W/q35_1gpu_d8" --csv "$CSV"
# Sequence length as a scale axis (issue 31): one sequence of L tokens a step, its own synthetic corpus.
for L in ${SEQ_LENS:-}; do
  for how in ${SEQ_ANCHORS:-recipe}; do
    case $how in
      recipe) name=q27_seq$L; anchors=(--set training.num_anchors=512) ;;
      density) [ $((L / 8)) = 512 ] && continue  # (the recipe's run)
        name=q27_seq${L}_density; anchors=(--set training.num_anchors=$((L / 8)) --set training.blocks_per_pass=512) ;;
      [1-9]*) name=q27_seq${L}_a$how; anchors=(--set training.num_anchors=$how) ;;  # a fixed count (what fits a smaller GPU)
      *) echo "SEQ_ANCHORS: '$how' is neither recipe, density nor a number of anchors" >&2; status=1; continue ;;
    esac
    [ "${SEQ_DRAFTER:-bf16}" = fp8 ] && name=${name}_d8
    for head in ${SEQ_HEADS:-bf16}; do  # model.drafter.lm_head_precision (fp8: runs <name>_h8)
     for wgx in ${SEQ_WGRAD_X:-auto}; do  # model.drafter.fp8_wgrad_x_tiles (128x1: runs <name>_wgx1; FP8 drafter only)
      [ "$wgx" != auto ] && [ "${SEQ_DRAFTER:-bf16}" != fp8 ] && continue
      hname=$name
      [ "$head" = fp8 ] && hname=${name}_h8
      [ "$wgx" = 128x1 ] && hname=${hname}_wgx1
      run "$hname" "$T" "${Q27[@]}" --set parallel.tp=1 --set model.target.precision="${SEQ_PRECISION:-fp8}" \
        --set model.drafter.precision="${SEQ_DRAFTER:-bf16}" --set model.drafter.lm_head_precision="$head" \
        --set model.drafter.fp8_wgrad_x_tiles="$wgx" \
        --set data.max_length=$L --set data.synth.path="$W/q27_synth_$L.h5" --set data.synth.num_sequences=32 \
        --set data.synth.min_length=$L --set data.synth.max_length=$L "${anchors[@]}" \
        --set training.max_steps="${SEQ_STEPS:-15}" --set logging.interval=5 --set logging.progress_bar=false \
        --set logging.run_dir="$W/$hname" --csv "$CSV"
     done
    done
    rm -f "$W/q27_synth_$L.h5"
  done
done
if [ "${NGPU:-0}" -ge 2 ]; then
  run q27_2gpu_tp1 mpirun -n 2 "$T" "${Q27[@]}" --set parallel.tp=1 --set logging.run_dir="$W/q27_2gpu_tp1" --csv "$CSV"
  run q27_2gpu_tp2 mpirun -n 2 "$T" "${Q27[@]}" --set parallel.tp=2 --set logging.run_dir="$W/q27_2gpu_tp2" --csv "$CSV"
fi
# Eight GPUs of one host (kind nvidia-h200-x8, issue 8): data parallel 8, tp=2 (4 groups), tp=8.
if [ "${NGPU:-0}" -ge 8 ]; then
  for tp in 1 2 8; do
    run "q27_8gpu_tp$tp" mpirun -n 8 "$T" "${Q27[@]}" --set parallel.tp=$tp --set logging.run_dir="$W/q27_8gpu_tp$tp" --csv "$CSV"
  done
fi
# Checkpoints of the 27B recipe (drafter export + fp32 masters and moments, ~22 GB): one at step 5
# written in the background while steps 6.. run, one at the end (step 10); a run of 15 steps resumes
# from ckpt-10. Sizes and times are in the log.
if [ "${NGPU:-0}" -ge 2 ]; then CK=(mpirun -n 2 "$T" "${Q27[@]}" --set parallel.tp=2); else CK=("$T" "${Q27[@]}"); fi
run q27_ckpt "${CK[@]}" --set training.max_steps=10 --set checkpoint.interval=5 --set checkpoint.at_end=true \
  --set logging.interval=1 --set logging.run_dir="$W/q27_ckpt"
run q27_resume env W="$W" bash -c '"$@" && grep -q "resumed from .*ckpt-10 at step 10/15" "$W/q27_resume.log" && echo "OK: resumed"' _ \
  "${CK[@]}" --set training.max_steps=15 --set checkpoint.at_end=false --set logging.interval=1 --set logging.run_dir="$W/q27_ckpt"
rm -rf "$W"
exit $status
