#!/usr/bin/env bash
# Issue 29, third round, in one call on the GPU machine (one H200, 16 cores): the held-out tau curve of
# the 5-layer drafter on configs/text-target. Build dflash; regenerate the training prompts with the target
# (all of them, and the first quarter and sixteenth of the shuffled list, for the curve against sequences);
# a 300-step probe times a step; then at once on the one GPU: the long run (all sequences, as many steps as
# the time allows, checkpoints for the curve against steps) and three short runs of S1 steps (all, 1/4, 1/16 of
# the sequences); dflash_eval on the held-out prompts (held-out documents) for every short run as it ends, for
# the long run's checkpoints, and an untrained drafter. (The training-mask bugs, DFLASH_FAULT_MASK, are a
# CPU-backend hook: the GPU trainer refuses them, as the first call of this script found.)
# Everything ends before $DEADLINE seconds; what comes back: $OUT/summary.txt, $OUT/runs.tar.xz (logs, eval
# reports (JSON: every prompt), metrics), $OUT/drafter.tar.xz (the long run's last exported drafter).
# The prompt files are made on the development machine first (that machine's build has no tokenizer):
#   python3 scripts/make_text_prompts.py --out P --chars-per-window 900 --max-per-doc 60
#   dflash_data prepare P/train.jsonl --prompts --tokenizer configs/text-target --out P/train.h5   (and heldout)
# Usage (repo root): PREPARED=P DEADLINE=340 bash scripts/gpu_text3.sh
# A dry run of the logic on the CPU (no GPU): DEV=cpu B=build-cpu SMALL=1 PREPARED=P DEADLINE=300 bash scripts/gpu_text3.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
R=$(pwd) W=${W:-/tmp/t3} T0=$(date +%s) DEADLINE=${DEADLINE:-340} DEV=${DEV:-cuda}
rm -rf "$W" && mkdir -p "$W/runs"
S=$OUT/summary.txt
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$S"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,memory.total --format=csv,noheader >>"$S" 2>&1
nproc >>"$S"
git -C "$R" log -1 --format=%H >>"$S" 2>/dev/null
if [ -z "${B:-}" ]; then
  B=$W/build
  ( cmake -S "$R" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 &&
    ninja -C "$B" -j 16 dflash_train dflash_data_tool dflash_eval ) >"$W/runs/build.log" 2>&1
  say "build rc=$? ($(tail -n 1 "$W/runs/build.log"))"
fi
B=$(cd "$B" && pwd)
D=$B/data/dflash_data TR=$B/trainer/dflash_train EV=$B/bench/dflash_eval TT=$R/configs/text-target
[ -x "$TR" ] && [ -x "$EV" ] && [ -x "$D" ] || { tail -n 30 "$W/runs/build.log" >>"$S"; tar -C "$W" -cJf "$OUT/runs.tar.xz" runs; exit 1; }
P=$(cd "${PREPARED:?prepared prompt files}" && pwd)
cd "$W"
# Sizes: NEW new tokens a training response (prompts of more than MAXP tokens skipped: prompt + response
# fit data.max_length 512), the curve's subsets (the first rows of the shuffled list), held-out NEW_EV.
NEW=${NEW:-128} MAXP=${MAXP:-320} NQ=${NQ:-13524} NS=${NS:-3381} NHO=${NHO:-126} NEW_EV=${NEW_EV:-64}
[ -n "${SMALL:-}" ] && NQ=64 NS=16 NHO=4 NEW=24 NEW_EV=8 MAXP=200
regen() {  # OUT MAX_NEW [ARGS]
  local o=$1 n=$2
  shift 2
  $D regenerate "$P/train.h5" --model "$TT" --device "$DEV" --max-new-tokens "$n" --stop-token 4092 --stop-token 4090 \
    --slots "${SLOTS:-2048}" --max-prompt-len "$MAXP" --out "$o" --no-progress "$@" >"runs/$o.log" 2>&1
  grep -E "^regenerated|this run|skipped" "runs/$o.log" >>"$S"
}
if [ -n "${SMALL:-}" ]; then regen regen_all.h5 "$NEW" --num-prompts 256; else regen regen_all.h5 "$NEW"; fi
regen regen_q.h5 "$NEW" --num-prompts "$NQ"
regen regen_s.h5 "$NEW" --num-prompts "$NS"
say "data made"
common=(--set "model.target.path=$TT" --set data.synth.enabled=false --set data.regenerate.enabled=false
  --set logging.progress_bar=false --set model.drafter.mask_token_id=4095 --set "parallel.device=$DEV" --set data.max_length=512
  --set model.drafter.num_layers=5 --set model.drafter.block_size=16 --set "model.drafter.target_layer_ids=[0,1,2,3]"
  --set training.batch_size="${BS:-16}" --set training.num_anchors="${NA:-16}" --set training.lr="${LR:-3e-3}")
run() {  # NAME DATA STEPS INTERVAL MASK(correct | anchor_inclusive | causal_in_block) (exec: a SIGTERM reaches dflash_train)
  local m=$5
  [ "$m" = correct ] && m=
  exec env ${m:+DFLASH_FAULT_MASK=$m} "$TR" "${common[@]}" --set "data.files=[$2]" --set training.max_steps="$3" \
    --set checkpoint.interval="$4" --set checkpoint.keep_last=20 --set logging.interval="${LOGI:-250}" --set "logging.run_dir=runs/$1" \
    >"runs/$1.log" 2>&1
}
ev() {  # NAME DRAFTER [ARGS]: speculative decoding on the held-out prompts
  local n=$1 d=$2
  shift 2
  $EV --model "$TT" --drafter "$d" --prompts "$P/heldout.h5" --num-prompts "$NHO" --max-new-tokens "$NEW_EV" --stop-token 4092 \
    --stop-token 4090 --device "$DEV" --json "runs/$n.json" "$@" >"runs/$n.eval" 2>&1
  say "$n: $(grep -E '^tau|estimate on the same|^outputs' "runs/$n.eval" | tr '\n' ' ')"
}
# The probe: the long run's recipe alone for PROBE steps; a step's time from the log's clock, steps PROBE0 .. PROBE.
PROBE=${PROBE:-300} PROBE0=${PROBE0:-100}
(LOGI=$PROBE0 run probe regen_all.h5 "$PROBE" 100000 correct)
ts() { grep -E "step $1/" "runs/probe.log" | head -n 1 | sed -E 's/^\[[0-9-]+ ([0-9:.]+)\].*/\1/' |
  awk -F: '{ printf "%.3f", $1 * 3600 + $2 * 60 + $3 }'; }
t1=$(ts "$PROBE0") t2=$(ts "$PROBE")
STEP_MS=$(awk -v a="$t1" -v b="$t2" -v n=$((PROBE - PROBE0)) 'BEGIN { if (a == "" || b == "" || b <= a) print 0; else printf "%.2f", (b - a) * 1000 / n }')
grep -E "step time|summary" runs/probe.log >>"$S"
[ "$STEP_MS" = 0 ] && STEP_MS=${STEP_MS_GUESS:-15}
# The GPU's time until EV_RESERVE s before the end (the long run's evaluations), less the evaluations and
# start-ups of the short runs (EV_S s), shared out as steps: 3 short runs of S1, the rest to the long run (as if
# the runs shared the GPU's time; the first call's were host-bound instead, 19 of 25 ms a step reading
# compressed chunks, since fixed by the reader's chunk cache, so the split is conservative).
EV_RESERVE=${EV_RESERVE:-70} EV_S=${EV_S:-40}
avail=$(( $(left) - EV_RESERVE - EV_S ))
steps=$(awk -v a="$avail" -v t="$STEP_MS" 'BEGIN { printf "%d", a * 1000 / t }')
S1=${S1:-$(( (steps / 8 / 250) * 250 ))}
[ "$S1" -ge 250 ] || S1=250
SA=${SA:-$(( ((steps - 3 * S1) / 1000) * 1000 ))}
[ "$SA" -ge $((2 * S1)) ] || SA=$((2 * S1))
[ -n "${SMALL:-}" ] && S1=6 SA=12
say "probe: $STEP_MS ms a step ($avail s of GPU time: $steps steps); short runs $S1 steps, the long run $SA (checkpoints every $((SA / 4)))"
run L_all regen_all.h5 "$SA" $((SA / 4)) correct & long=$!
shorts=()
run s_all regen_all.h5 "$S1" "$S1" correct & shorts+=($!)
run s_q regen_q.h5 "$S1" "$S1" correct & shorts+=($!)
run s_s regen_s.h5 "$S1" "$S1" correct & shorts+=($!)
# The untrained drafter (16 new tokens: its tau is 1, each token a step).
$EV --model "$TT" --random-drafter 5 --block-size 16 --prompts "$P/heldout.h5" --num-prompts "$NHO" --max-new-tokens 16 \
  --no-estimate --device "$DEV" --stop-token 4092 --stop-token 4090 --json runs/untrained.json >runs/untrained.eval 2>&1
say "untrained (16 new tokens): $(grep -E '^tau|^outputs' runs/untrained.eval | tr '\n' ' ')"
last_ckpt() { ls -d "$1"/checkpoints/ckpt-* 2>/dev/null | sort -t- -k2 -n | tail -n 1; }
# Each short run is measured as it ends (its last checkpoint's exported drafter).
names=(s_all s_q s_s) done_=()
while [ "$(left)" -gt "$EV_RESERVE" ] && kill -0 "$long" 2>/dev/null; do
  for i in "${!shorts[@]}"; do
    [ -n "${done_[$i]:-}" ] && continue
    kill -0 "${shorts[$i]}" 2>/dev/null && continue
    wait "${shorts[$i]}"
    done_[$i]=$?
    n=${names[$i]}
    say "$n rc=${done_[$i]}: $(grep -E 'summary|step time' "runs/$n.log" | tr '\n' ' ' | cut -c1-300)"
    c=$(last_ckpt "runs/$n")
    [ -n "$c" ] && ev "$n.${c##*/}" "$c/drafter" &
  done
  sleep 1
done
kill -TERM "$long" "${shorts[@]}" 2>/dev/null
wait "$long"
for i in "${!shorts[@]}"; do  # short runs stopped before their end: measured at their last checkpoint
  [ -n "${done_[$i]:-}" ] && continue
  wait "${shorts[$i]}"
  rc=$? n=${names[$i]}
  say "$n ended (rc=$rc): $(grep -E 'summary|step time' "runs/$n.log" | tr '\n' ' ' | cut -c1-300)"
  c=$(last_ckpt "runs/$n")
  [ -n "$c" ] && ev "$n.${c##*/}" "$c/drafter" &
done
say "long run stopped: $(grep -E 'summary|step time' runs/L_all.log | tr '\n' ' ' | cut -c1-300)"
for c in $(ls -d runs/L_all/checkpoints/ckpt-* 2>/dev/null | sort -t- -k2 -n); do
  [ -d "$c/drafter" ] || continue
  [ "$(left)" -gt 15 ] || break
  ev "L_all.${c##*/}" "$c/drafter" &
  while [ "$(jobs -rp | wc -l)" -gt 8 ]; do sleep 1; done
done
wait
say "evals done"
last=$(last_ckpt runs/L_all)
[ -n "$last" ] && tar -C "$last" -cJf "$OUT/drafter.tar.xz" drafter
rm -rf runs/*/checkpoints/*/optimizer.safetensors runs/*/checkpoints/*/loader-* runs/*/data
tar --exclude='*.safetensors' --exclude='*.h5' -cJf "$OUT/runs.tar.xz" runs
say "end"
