#!/usr/bin/env bash
# Drafter exports through transformers on the GPU machine, where torch and transformers are
# (issue 26): builds dump_drafter_logits and test_export (a CPU-only build: the export and the
# reference drafter are host code), runs test_export, exports two small random drafters with
# dflash's logits for fixed inputs, and runs tests/reference/check_automodel.py: each export loaded
# with AutoModel.from_pretrained(dir, trust_remote_code=True) in float64 / float32 / bf16, its logits
# against dflash's (bounds in the script), the KV-cache path, and spec_generate against the greedy
# output of a random tiny Qwen3 target.
#   device run: DFLASH_JOBS=16 bash scripts/gpu_export.sh
# ZLAB_MODEL_PY=<file>: also load the full-attention export with z-lab's DFlashDraftModel from that
# file (z-lab/dflash's dflash/model.py, not part of dflash) and compare it the same way.
# Writes to $OUT: env.txt, build.log, export.log, automodel.json, export.tgz (exports + references).
set -uo pipefail
source "$(dirname "$0")/common.sh"
set +e
OUT=${OUT:-/tmp/out}
B=$DFLASH_BUILD  # (common.sh: the tree's build/ unless the caller set DFLASH_BUILD)
W=/tmp/export_check
mkdir -p "$OUT"
rm -rf "$W"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1
} >"$OUT/env.txt"
cat "$OUT/env.txt"
t0=$(date +%s)
cmake -S "$DFLASH_ROOT" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA=OFF >"$OUT/build.log" 2>&1 &&
  ninja -C "$B" -j "$DFLASH_JOBS" dump_drafter_logits test_export >>"$OUT/build.log" 2>&1 ||
  { echo "build failed"; grep -E "error|FAILED" "$OUT/build.log" | head -n 30; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
{
  "$B/tests/test_export"
  echo "test_export rc=$?"
  zlab=()
  [ -n "${ZLAB_MODEL_PY:-}" ] && zlab=(--zlab "$ZLAB_MODEL_PY")
  python3 "$DFLASH_ROOT/tests/reference/check_automodel.py" --dump "$B/tests/dump_drafter_logits" \
    --out "$OUT/automodel.json" "${zlab[@]}" "$W"
  echo "check_automodel rc=$?"
} >"$OUT/export.log" 2>&1
grep -E "PASSED|FAILED|rc=|bound|spec_generate|check_automodel|not run|Error" "$OUT/export.log" | head -n 40
tar czf "$OUT/export.tgz" -C /tmp export_check 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
