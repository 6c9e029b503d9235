#!/usr/bin/env bash
# The fault matrix on the GPU backend (issue 32), in one device call: tests/train_test.sh's fault
# modes with DFLASH_TRAIN_DEVICE=cuda (parallel.device: cuda) on the tiny config, the Qwen3.6-27B
# recipe's shapes (random weights) for determinism, the memory plan's prediction and its start-up
# refusal, and the tiny run's device memory over 6,000 steps. Leaves in $OUT: faults.log (every
# row's output), faults.md (the table: fault, device, result, evidence), faults.csv, env.txt,
# build.log, logs.tgz (the runs' logs and metrics).
#   OUT=DIR DFLASH_DEADLINE=EPOCH bash scripts/gpu_faults.sh   (DFLASH_BUILD: the build dir)
# FAULT_ROWS (a regex over the row names below) picks rows; rows that would run past DFLASH_DEADLINE
# are written down as not run.
source "$(dirname "$0")/gpu_call.sh"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
B=${DFLASH_BUILD:-$DFLASH_ROOT/build}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total,driver_version --format=csv >"$OUT/env.txt" 2>&1
t0=$(date +%s)
cmake -S "$DFLASH_ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
  ninja -C "$B" dflash_train dflash_plot >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -n 30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" | tee -a "$OUT/faults.log"
T=$B/trainer/dflash_train PLOT=$B/bench/dflash_plot
TT=$DFLASH_ROOT/tests/train_test.sh TINY=$DFLASH_ROOT/configs/tiny/config.json
W=${DFLASH_FAULTS_WORK:-/tmp/dflash_gpu_faults}
rm -rf "$W"
mkdir -p "$W"
LOG=$OUT/faults.log
echo "| fault | device | result | evidence |" >"$OUT/faults.md"
echo "|---|---|---|---|" >>"$OUT/faults.md"
echo "fault,device,result,evidence" >"$OUT/faults.csv"
DEV="cuda (1 x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1))"
# row NAME FAULT NEEDS_S EVIDENCE_REGEX CMD...: runs CMD (logs under $W/NAME.out, appended to faults.log),
# PASS when it exits 0, and a table row with the last lines matching EVIDENCE_REGEX.
row() {
  local name=$1 fault=$2 need=$3 ev=$4
  shift 4
  if [ -n "${FAULT_ROWS:-}" ] && ! [[ $name =~ ^($FAULT_ROWS)$ ]]; then return 0; fi
  if [ -n "${DFLASH_DEADLINE:-}" ]; then
    local left=$((DFLASH_DEADLINE - $(date +%s) - 5))
    if [ $left -lt "$need" ]; then
      echo "== $name: not run (${left}s left before the call's deadline, needs ~${need}s)" >>"$LOG"
      printf '| %s | %s | not run | %ss left in the device call |\n' "$fault" "$DEV" "$left" >>"$OUT/faults.md"
      return 0
    fi
  fi
  echo "== $name ($fault)" >>"$LOG"
  echo "\$ $*" >>"$LOG"
  local s=$SECONDS
  "$@" >"$W/$name.out" 2>&1
  local rc=$?
  grep -v "^\[20" "$W/$name.out" | tail -n 25 >>"$LOG"
  echo "rc=$rc wall=$((SECONDS - s))s" >>"$LOG"
  local res=PASS
  [ $rc = 0 ] || res="FAIL (rc $rc)"
  local e
  e=$(grep -Eh "$ev" "$W/$name.out" | grep -v "^+ " | tail -n 3 | sed 's/^\[[^]]*\] \[rank [0-9]*\] \[[a-z]*\] //' | cut -c1-300 |
    tr '\n' ' ' | sed 's/|/\\|/g; s/  */ /g')
  printf '| %s | %s | %s | %s (%ss) |\n' "$fault" "$DEV" "$res" "$e" $((SECONDS - s)) >>"$OUT/faults.md"
  printf '"%s","%s","%s","%s"\n' "$fault" "$DEV" "$res" "${e//\"/\'}" >>"$OUT/faults.csv"
  echo "$name: $res ($((SECONDS - s)) s)"
  tar czf "$OUT/logs.tgz" -C "$W" $(cd "$W" && ls -d *.out *.log *.samples */*.log */metrics.jsonl */*/metrics.jsonl */*/logs 2>/dev/null) 2>/dev/null
}
export DFLASH_TRAIN_DEVICE=cuda
tt() { bash "$TT" "$1" "$T" "$TINY" "$W/$1" "${@:2}"; }
row cudaerror "CUDA error inside a step (DFLASH_FAULT_CUDA_ERROR: a failing launch in the drafter step, a device trap in the target forward, a failing launch in AdamW)" 60 \
  "^(drafter|target|optimizer):|checkpoints:|^OK|FAIL" tt cudaerror
row kill9bg "kill -9 while the background checkpoint writer is active" 40 "killed at|^OK|FAIL|all .* equal" tt kill9bg
row kill9 "kill -9 mid-step" 60 "killed at|resumed from ckpt|all .* losses equal|^OK|FAIL" tt kill9
row sigterm "SIGTERM" 40 "stopped at step|resumed from|^OK|FAIL" tt sigterm
row determinism_tiny "determinism, tiny config, 200 steps run twice" 40 "two identical|differs|^OK|FAIL" env DFLASH_DET_STEPS=200 bash "$TT" determinism "$T" "$TINY" "$W/determinism_tiny"
# The 27B recipe's shapes (random target weights, 16 synthetic 4096-token sequences, 512 anchors):
# the same 6 steps twice; the memory plan against the measured peak of the same run.
Q27=(configs/qwen3.6-27b.yaml --set model.target.path= --set model.target.config=configs/qwen3.6-27b/config.json
     --set model.target.random_weights=true --set data.files=[] --set data.synth.enabled=true
     --set data.synth.path="$W/q27_synth.h5" --set data.synth.num_sequences=16 --set data.synth.min_length=4096
     --set data.synth.max_length=4096 --set data.synth.vocab_size=0 --set training.epochs=null
     --set training.max_steps=6 --set logging.interval=1 --set checkpoint.at_end=false
     --set checkpoint.interval=100000 --set parallel.device=cuda --set kernels.require_fast_path=true --set parallel.tp=1)
cd "$DFLASH_ROOT"
q27_det() {
  for r in a b; do "$T" "${Q27[@]}" --set logging.run_dir="$W/q27det/$r" >"$W/q27det_$r.log" 2>&1 || { tail -n 5 "$W/q27det_$r.log"; return 1; }; done
  grep -E "total \(estimate\)|summary:|after loading" "$W/q27det_a.log" | sed 's/^\[[^]]*\] \[rank [0-9]*\] \[[a-z]*\] //'
  local plan peak
  plan=$(grep -o "total (estimate) *[0-9.]* GiB" "$W/q27det_a.log" | grep -o "[0-9.]* GiB" | cut -d' ' -f1)
  peak=$(grep -o "peak memory [0-9.]* GiB" "$W/q27det_a.log" | tail -n 1 | grep -o "[0-9.]*")
  echo "memory plan ${plan} GiB vs measured peak ${peak} GiB: $(awk -v a="$plan" -v b="$peak" 'BEGIN {printf "%+.1f%%", 100 * (a - b) / b}')"
  local ok=1
  for k in loss grad_norm; do
    a=$(grep -o "\"$k\":[^,}]*" "$W/q27det/a/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')
    b=$(grep -o "\"$k\":[^,}]*" "$W/q27det/b/metrics.jsonl" | cut -d: -f2 | tr '\n' ' ')
    echo "$k a: $a"
    echo "$k b: $b"
    [ "$a" = "$b" ] || ok=0
  done
  if cmp -s "$W/q27det/a/drafter/model.safetensors" "$W/q27det/b/drafter/model.safetensors"; then echo "exported drafters equal byte for byte"
  else ok=0; echo "exported drafters differ"; fi
  [ $ok = 1 ] && echo "q27 determinism: two identical 6-step runs equal bit for bit"
  rm -rf "$W/q27det/a/drafter" "$W/q27det/b/drafter"
  [ $ok = 1 ]
}
row determinism_q27 "determinism, Qwen3.6-27B recipe shapes (random weights), 6 steps run twice; memory plan vs peak" 90 \
  "memory plan .* vs measured|q27 determinism|differ|^loss a" q27_det
# Out of memory: 4 x the recipe's anchors (2048 blocks) must be refused before any weight is loaded.
oom() {
  "$T" "${Q27[@]}" --set training.num_anchors=2048 --set logging.run_dir="$W/q27oom" >"$W/q27oom.log" 2>&1
  local rc=$?
  sed 's/^\[[^]]*\] \[rank [0-9]*\] \[[a-z]*\] //' "$W/q27oom.log" | grep -A12 "does not fit" | head -n 14
  if [ $rc != 0 ] && grep -q "does not fit: the memory plan needs" "$W/q27oom.log" && ! grep -q "initialised:" "$W/q27oom.log"; then
    echo "OK: refused at start-up (rc $rc), before the target was loaded"
  else tail -n 5 "$W/q27oom.log"; return 1; fi
}
row oom "out of memory: the 27B recipe with 4 x the anchors (2048 blocks) on one H200" 30 "does not fit|total \(estimate\)|^OK" oom
# Device memory over a long run: the tiny config, MEMFLAT_STEPS (default 6,000) steps; the process's device memory
# (nvidia-smi, what the allocator holds from the driver) sampled with the step it was at, and the
# allocator's peak (metrics.jsonl mem_gib).
MEMFLAT_STEPS=${MEMFLAT_STEPS:-6000}
memflat() {
  "$T" --set parallel.device=cuda --set training.max_steps=$MEMFLAT_STEPS --set logging.interval=50 --set checkpoint.interval=1000 \
    --set logging.run_dir="$W/memflat" --set data.synth.path="$W/memflat_synth.h5" --set logging.progress_bar=false \
    --set data.regenerate.enabled=false --set training.batch_size=4 --set training.num_anchors=4 \
    >"$W/memflat.log" 2>&1 &
  local pid=$! m="$W/memflat/metrics.jsonl"
  : >"$W/memflat.samples"
  while kill -0 $pid 2>/dev/null; do
    local st used
    st=$(grep -o '"step":[0-9]*' "$m" 2>/dev/null | tail -n 1 | cut -d: -f2)
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null | awk -F', ' -v p=$pid '$1 == p {print $2}')
    [ -n "$st" ] && [ -n "$used" ] && echo "$st $used" >>"$W/memflat.samples"
    sleep 0.2
  done
  wait $pid || { tail -n 5 "$W/memflat.log"; return 1; }
  echo "allocator peak (metrics.jsonl mem_gib) at steps 50 / 1000 / $MEMFLAT_STEPS: $(awk -v n=$MEMFLAT_STEPS '{
      match($0, /"step":[0-9]+/); st = substr($0, RSTART + 7, RLENGTH - 7); match($0, /"mem_gib":[0-9.e+-]+/)
      if (st == 50 || st == 1000 || st == n) printf "%s ", substr($0, RSTART + 10, RLENGTH - 10)}' "$m")GiB"
  awk '$1 >= 50 && a == "" {a = $0} $1 >= 1000 && b == "" {b = $0} {last = $0; if ($2 + 0 > mx) mx = $2 + 0; if (mn == "" || $2 + 0 < mn) mn = $2 + 0}
       END {printf "nvidia-smi process memory [step MiB]: first at >= 50: [%s], first at >= 1000: [%s], last: [%s]; min %s max %s MiB over %d samples\n", a, b, last, mn, mx, NR}' \
    "$W/memflat.samples"
  grep -q "done: $MEMFLAT_STEPS steps" "$W/memflat.log" && echo "OK: $MEMFLAT_STEPS steps"
}
row memflat "device memory over $MEMFLAT_STEPS steps (tiny config)" 60 "allocator peak|nvidia-smi process|^OK" memflat
# A full disk at a checkpoint: checkpoint.dir on a real tmpfs where mount is permitted (root); the
# hooks' rows (fulldisk, ckptfail, baddirs) either way.
if mount -t tmpfs -o size=1m tmpfs "$W/.probe" 2>/dev/null || { mkdir -p "$W/.probe" && mount -t tmpfs -o size=1m tmpfs "$W/.probe" 2>/dev/null; }; then
  umount "$W/.probe"
  row tmpfs "full disk at a checkpoint: checkpoint.dir on a tmpfs with room for 2.5 checkpoints (real ENOSPC)" 40 \
    "could not be written|stopped at step|resumed from|^OK|FAIL" tt tmpfs
else
  echo "== tmpfs: not run: mount -t tmpfs is not permitted here (uid $(id -u)); the hooks' rows stand for it" >>"$LOG"
  printf '| %s | %s | not run | mount -t tmpfs not permitted (uid %s): see the fulldisk / ckptfail / baddirs rows (hooks) |\n' \
    "full disk at a checkpoint on a real tmpfs" "$DEV" "$(id -u)" >>"$OUT/faults.md"
fi
row ckptfail "a failed background checkpoint write (DFLASH_FAULT_CHECKPOINT_WRITE)" 30 "could not be written|^OK|FAIL" tt ckptfail
row fulldisk "full disk on a log / metrics write (DFLASH_FAULT_FULL_DISK_AT_STEP)" 30 "failed: No space|kept .* line|^OK|FAIL" tt fulldisk "$PLOT"
row baddirs "no room for a checkpoint / read-only checkpoint dir at start-up (DFLASH_FAULT_FREE_BYTES / _READONLY)" 30 "^OK|FAIL" tt baddirs
row corrupt "corrupt checkpoint (state.json)" 30 "^OK|FAIL" tt corrupt
row resume "stop and resume (bit-exact), and resume from a background-written checkpoint" 30 "^OK|FAIL|differ" tt resume
echo "2-GPU rows (a rank killed mid all-reduce): not run, this call has $(nvidia-smi -L | grep -c ^GPU) GPU" >>"$LOG"
cat "$OUT/faults.md"
