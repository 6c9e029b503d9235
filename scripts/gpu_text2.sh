#!/usr/bin/env bash
# Issue 29, second round, in one call on the GPU machine (one H200, 16 cores): make the text target
# again (scripts/make_text_target.py with the pip-installed packages in the corpus, the chat examples
# repeated, a longer training), build dflash meanwhile, regenerate the training prompts with it on the
# GPU, then at once: GPU drafters (5-layer, block 16; steps and number of sequences) and single-core
# CPU-backend recipes (the demo's, the two mask bugs, 3 seeds); then dflash_eval on the held-out prompts.
# Everything ends before $DEADLINE seconds; what comes back: $OUT/target.tar.xz (the checkpoint, prompt
# lists, README, goldens), $OUT/runs.tar.xz (logs, eval reports, metrics), $OUT/summary.txt.
# That machine's build has no tokenizer (no libonig-dev / libicu-dev there): the prompt lists are prepared
# here first (dflash_data prepare into $PREPARED: train.h5, shuf.h5 (shuffled, seed 0), heldout.h5, ho_chat.h5),
# every token of a prompt unsupervised: `dflash_data prepare --prompts` (since 58d9d6d; the second call
# still sent every file through `dflash_data dump`, loss_mask set to 0, `dflash_data convert --vocab-size 4096`).
# With MAKE_TARGET=1 the target is made there first (the first call did; the second used the committed one).
# Usage (repo root): PREPARED=dir DEADLINE=480 bash scripts/gpu_text2.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
R=$(pwd) W=/tmp/t2 T0=$(date +%s) DEADLINE=${DEADLINE:-480}
rm -rf "$W" && mkdir -p "$W/runs"
S=$OUT/summary.txt
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv,noheader >>"$S" 2>&1
nproc >>"$S"
B=$W/build
( cmake -S "$R" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 &&
  ninja -C "$B" -j 13 dflash_train dflash_data_tool dflash_eval ) >"$W/runs/build.log" 2>&1 &
BPID=$!
TT=$R/configs/text-target
if [ -n "${MAKE_TARGET:-}" ]; then
TT=$W/text-target
python3 scripts/make_text_target.py --out "$TT" --golden "$W/golden" --pip-packages --chat-repeat "${CHAT_REPEAT:-4}" \
  --max-train-prompts 16000 --train-seconds "${TSEC:-150}" --eval-every 250 >"$W/runs/target.log" 2>&1
say "target rc=$?"
grep -E "corpus:|data:|chat examples|prompts:|train:|step .*held-out|golden" "$W/runs/target.log" | tail -n 40 >>"$S"
tar -C "$W" -cJf "$OUT/target.tar.xz" text-target golden
fi
wait $BPID
say "build rc=$? ($(tail -n 1 "$W/runs/build.log"))"
D=$B/data/dflash_data TR=$B/trainer/dflash_train EV=$B/bench/dflash_eval
[ -x "$TR" ] && [ -x "$EV" ] && [ -x "$D" ] || { tail -n 30 "$W/runs/build.log" >>"$S"; tar -C "$W" -cJf "$OUT/runs.tar.xz" runs; exit 1; }
cd "$W"
# Prompts: the training list as it is (chat rows first) and shuffled (seeded) for the curve against sequences.
P=${PREPARED:?prepared prompt files}
cp "$P"/*.h5 .
regen() {  # OUT INPUT MAX_NEW [ARGS]
  local o=$1 i=$2 n=$3
  shift 3
  $D regenerate "$i" --model "$TT" --device cuda --max-new-tokens "$n" --stop-token 4092 --stop-token 4090 --slots 1024 \
    --out "$o" --no-progress "$@" 2>&1 | grep -E "^regenerated|this run" >>"$S"
}
regen regen_all.h5 shuf.h5 96
regen regen_1k.h5 shuf.h5 96 --num-prompts 1000
regen regen_4k.h5 shuf.h5 96 --num-prompts 4000
# The CPU recipe's data: chat prompts (the first rows) of at most 216 tokens, 40 new: sequences of <= 256.
if [ "${CPU:-1}" = 1 ]; then
regen cpu600.h5 train.h5 40 --num-prompts 600 --max-prompt-len 216
regen cpu2000.h5 train.h5 40 --num-prompts 2000 --max-prompt-len 216
fi
say "data made"
common=(--set "model.target.path=$TT" --set data.synth.enabled=false --set data.regenerate.enabled=false
  --set logging.progress_bar=false --set model.drafter.mask_token_id=4095)
gpu_run() {  # NAME DATA STEPS INTERVAL (exec: a SIGTERM reaches dflash_train)
  exec "$TR" "${common[@]}" --set "data.files=[$2]" --set parallel.device=cuda --set data.max_length=512 \
    --set model.drafter.num_layers=5 --set model.drafter.block_size=16 --set "model.drafter.target_layer_ids=[0,1,2,3]" \
    --set training.batch_size=4 --set training.num_anchors=32 --set training.lr=3e-3 --set training.max_steps="$3" \
    --set checkpoint.interval="$4" --set checkpoint.keep_last=10 --set logging.interval=500 --set "logging.run_dir=runs/$1" \
    >"runs/$1.log" 2>&1
}
cpu_run() {  # NAME DATA SEED MASK(correct | causal_in_block | anchor_inclusive) [ARGS]
  local n=$1 d=$2 s=$3 m=$4
  shift 4
  [ "$m" = correct ] && m=
  exec env ${m:+DFLASH_FAULT_MASK=$m} "$TR" "${common[@]}" --set "data.files=[$d]" --set parallel.device=cpu --set "model.drafter.target_layer_ids=[1,3]" \
    --set training.batch_size=2 --set training.num_anchors=8 --set training.lr=1e-2 --set training.max_steps=600 \
    --set training.seed="$s" --set checkpoint.interval=100 --set checkpoint.keep_last=10 --set logging.interval=50 \
    --set "logging.run_dir=runs/$n" "$@" >"runs/$n.log" 2>&1
}
pids=()
gpu_run g5_all regen_all.h5 "${GSTEPS:-16000}" "${GINT:-4000}" & gpu=($!)
gpu_run g5_1k regen_1k.h5 "${GSTEPS_N:-8000}" "${GSTEPS_N:-8000}" & gpu+=($!)
gpu_run g5_4k regen_4k.h5 "${GSTEPS_N:-8000}" "${GSTEPS_N:-8000}" & gpu+=($!)
# CPU=0: no CPU runs here (they ran on the 2-core machine instead).
[ "${CPU:-1}" = 1 ] && for s in 0 1 2; do
  cpu_run c$s cpu600.h5 $s correct & pids+=($!)
  cpu_run a$s cpu600.h5 $s anchor_inclusive & pids+=($!)
  cpu_run k$s cpu600.h5 $s causal_in_block & pids+=($!)
done
if [ "${CPU:-1}" = 1 ]; then
cpu_run c0_n2000 cpu2000.h5 0 correct & pids+=($!)
cpu_run c0_4x4 cpu600.h5 0 correct --set training.batch_size=4 --set training.num_anchors=4 & pids+=($!)
cpu_run c0_lr2e2 cpu600.h5 0 correct --set training.lr=2e-2 & pids+=($!)
fi
ev() {  # NAME DRAFTER PROMPTS N MAX_NEW [ARGS]: GPU speculative decoding on held-out prompts
  local n=$1 d=$2 p=$3 k=$4 m=$5
  shift 5
  $EV --model "$TT" --drafter "$d" --prompts "$p" --num-prompts "$k" --max-new-tokens "$m" --stop-token 4092 --stop-token 4090 \
    --device cuda --json "runs/$n.json" "$@" >"runs/$n.eval" 2>&1
  echo "$n: $(grep -E '^tau|estimate on the same|^outputs' "runs/$n.eval" | tr '\n' ' ')" >>"$S"
}
$EV --model "$TT" --random-drafter 5 --block-size 16 --prompts heldout.h5 --num-prompts 126 --max-new-tokens 16 \
  --no-estimate --device cuda --stop-token 4092 --stop-token 4090 >runs/untrained.eval 2>&1
echo "untrained: $(grep -E '^tau|^outputs' runs/untrained.eval | tr '\n' ' ')" >>"$S"
# The GPU runs end first (or at DEADLINE - 200 s); their checkpoints are measured while the CPU runs go on.
while [ "$(left)" -gt "${GPU_STOP:-200}" ] && kill -0 "${gpu[@]}" 2>/dev/null; do sleep 2; done
for p in "${gpu[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait "${gpu[@]}"
say "gpu runs done"
for r in g5_all g5_1k g5_4k; do grep -E "summary|step time" "runs/$r.log" | sed "s/^/$r /" >>"$S"; done
for c in runs/g5_all/checkpoints/ckpt-* runs/g5_1k/checkpoints/ckpt-* runs/g5_4k/checkpoints/ckpt-*; do
  [ -d "$c/drafter" ] || continue
  [ "$(left)" -gt "${EV_MIN:-120}" ] || break
  r=${c#runs/}
  ev "${r%%/*}.${c##*/}" "$c/drafter" heldout.h5 126 64 &
  while [ "$(jobs -rp | wc -l)" -gt 15 ]; do sleep 1; done
done
# The CPU runs: until DEADLINE - 90 s, then SIGTERM (a checkpoint at the next step boundary).
wait_cpu() {
while [ "$(left)" -gt 90 ] && kill -0 "${pids[@]}" 2>/dev/null; do sleep 2; done
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
wait "${pids[@]}"
say "cpu runs stopped"
}
[ "${CPU:-1}" = 1 ] && wait_cpu
[ "${CPU:-1}" = 1 ] && for r in c0 a0 k0 c1 a1 k1 c2 a2 k2 c0_n2000 c0_4x4 c0_lr2e2; do
  echo "$r: $(grep -E 'step time|summary' "runs/$r.log" | tr '\n' ' ' | cut -c1-400)" >>"$S"
  for c in runs/$r/checkpoints/ckpt-*; do
    [ -d "$c/drafter" ] || continue
    [ "$(left)" -gt 15 ] || break
    ev "$r.${c##*/}" "$c/drafter" ho_chat.h5 48 40 &
    while [ "$(jobs -rp | wc -l)" -gt 8 ]; do sleep 1; done
  done
done
wait
say "evals done"
rm -rf runs/*/checkpoints/*/optimizer.safetensors runs/*/checkpoints/*/loader-* runs/*/data
tar --exclude='*.safetensors' -cJf "$OUT/runs.tar.xz" runs
say "end"
