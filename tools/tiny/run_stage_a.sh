#!/usr/bin/env bash
# Stage A of the tiny pair, one device command (<= 9 min): corpus, tokenizer, target training,
# then a short stage-B smoke test against the fresh target (its log tells whether stage B's
# transformers paths work before the second command is spent).
# Usage (repo root): bash tools/tiny/run_stage_a.sh [--smoke]
# (TINY_A_ARGS / TINY_B_ARGS add arguments to stage_a.py / the stage-B smoke, for local tests.)
# Writes to $OUT: stage_a.tar.partNN (<= 15 MiB each; tar rooted at the repo root:
# models/tiny-target/, build-tiny/stage_a/) and stage_a.log.
set -u
T0=$(date +%s.%N)
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$(pwd)/build-tiny/out}
PY=${PYTHON:-python3}
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; fi
WORK=$(mktemp -d /tmp/tiny_stage_a.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
{
  echo "run_stage_a.sh: start $(date -u +%FT%TZ) work=$WORK out=$OUT smoke=${SMOKE:-no}"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 || true
  "$PY" -c "import torch, transformers, tokenizers, tiktoken, safetensors, numpy; print('versions: torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'tiktoken', getattr(tiktoken, '__version__', '?'), 'safetensors', safetensors.__version__, 'numpy', numpy.__version__)" 2>&1
  if [ -n "$SMOKE" ]; then BUDGET=150; else BUDGET=430; fi
  timeout -k 5 $((BUDGET + 20)) "$PY" "$HERE/stage_a.py" --root "$WORK" $SMOKE --t0 "$T0" --budget-s "$BUDGET" ${TINY_A_ARGS:-}
  RC=$?
  echo "stage_a.py exit code $RC at $(awk "BEGIN{print $(date +%s.%N) - $T0}") s"
  "$PY" -c "import sys; sys.path.insert(0, '$HERE'); import common; common.set_t0($T0); common.pack_outputs('$OUT', 'stage_a.tar', ['models/tiny-target', 'build-tiny/stage_a'], '$WORK')"
  if [ $RC -eq 0 ]; then
    echo "---- stage B smoke test against the new target (not shipped) ----"
    timeout -k 5 70 "$PY" "$HERE/stage_b.py" --root "$WORK" --out-root "$WORK/bsmoke" --smoke --budget-s 60 ${TINY_B_ARGS:-}
    echo "stage_b.py --smoke exit code $? at $(awk "BEGIN{print $(date +%s.%N) - $T0}") s"
  fi
  ls -la "$OUT"
  echo "run_stage_a.sh: end, wall $(awk "BEGIN{print $(date +%s.%N) - $T0}") s"
} 2>&1 | tee "$OUT/stage_a.log"
