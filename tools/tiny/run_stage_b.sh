#!/usr/bin/env bash
# Stage B of the tiny pair, one device command (<= 9 min): drafter data from the target's greedy
# continuations, DFlash drafter training, engine fixtures, DDTree/chain evaluation.
# Needs models/tiny-target/ and build-tiny/stage_a/ (from stage A's tar) in the repo root.
# Usage (repo root): bash tools/tiny/run_stage_b.sh [--smoke]
# Writes to $OUT: stage_b.tar.partNN (tar rooted at the repo root: models/tiny-dflash/,
# build-tiny/stage_b/ with stage_b.json and fixtures/dflash_expected.json) and stage_b.log.
set -u
T0=$(date +%s.%N)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build-tiny/out}
PY=${PYTHON:-python3}
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; fi
WORK=$(mktemp -d /tmp/tiny_stage_b.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "run_stage_b.sh: start $(date -u +%FT%TZ) root=$ROOT work=$WORK out=$OUT smoke=${SMOKE:-no}"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 || true
  ls -la "$ROOT/models/tiny-target" "$ROOT/build-tiny/stage_a" 2>&1
  if [ -n "$SMOKE" ]; then BUDGET=90; else BUDGET=495; fi
  timeout -k 5 $((BUDGET + 20)) "$PY" "$HERE/stage_b.py" --root "$ROOT" --out-root "$WORK" $SMOKE --t0 "$T0" --budget-s "$BUDGET" ${TINY_B_ARGS:-}
  RC=$?
  echo "stage_b.py exit code $RC at $(awk "BEGIN{print $(date +%s.%N) - $T0}") s"
  "$PY" -c "import sys; sys.path.insert(0, '$HERE'); import common; common.set_t0($T0); common.pack_outputs('$OUT', 'stage_b.tar', ['models/tiny-dflash', 'build-tiny/stage_b'], '$WORK')"
  ls -la "$OUT"
  echo "run_stage_b.sh: end, wall $(awk "BEGIN{print $(date +%s.%N) - $T0}") s"
} 2>&1 | tee "$OUT/stage_b.log"
