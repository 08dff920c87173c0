#!/usr/bin/env bash
# model_ab.sh - interleaved A/B timing of GPU model builds on the GPU host: one Kimi K2.6 layer shape
# at a time (bench_model --quick --only kimi with KDT_BENCH_MODEL_SHAPE), the variants taken in
# turn, first to last then last to first (A B B A ...), so that clock and machine drift hit them
# alike; prints every reading (µs per layer, the marginal layer) and the median per variant. A
# variant is
#   NAME=DIR[:ENV ...]    bench_model from DIR/bench_model, run with the environment ENV
# e.g. scripts/model_ab.sh old=/tmp/o new=/tmp/n "wide=/tmp/n:KDT_GEMM_WIDE3=0"
# Shapes are bench_model's: decode,S[,corr] or verify,N[,corr] (corr 1: correlated routing).
# Options: --rounds N (A B B A rounds, default 2), --shapes "..." (default: verify,65,1 verify,33,1
# verify,17,1 verify,9,1 verify,65,0 decode,64,0 decode,1,0), --reps N (KDT_BENCH_MODEL_REPS per
# call, default 2), --limit S (seconds per call, default 90).
set -uo pipefail
ROUNDS=2
REPS=2
LIMIT=90
SHAPES="verify,65,1 verify,33,1 verify,17,1 verify,9,1 verify,65,0 decode,64,0 decode,1,0"
VARIANTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --limit) LIMIT=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *=*) VARIANTS+=("$1"); shift ;;
    *) echo "model_ab.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#VARIANTS[@]} -gt 0 ] || { echo "model_ab.sh: no variant given (see --help)" >&2; exit 2; }
case "$ROUNDS$REPS" in *[!0-9]*) echo "model_ab.sh: --rounds and --reps take counts" >&2; exit 2 ;; esac
OUT_DIR=$(mktemp -d)
trap 'rm -rf "$OUT_DIR"' EXIT
. "$(dirname "$0")/ab_common.sh"
ab_variants model_ab.sh bench_model "${VARIANTS[@]}"
tac "$OUT_DIR/variants" >"$OUT_DIR/variants_rev"
# one call: the shape's "us/layer" figures (one per KDT_BENCH_MODEL_REPS rep), or "fail"
one() {
  local shape=$1 name=$2 dir=$3 env_part=$4 out us
  out=$(env $env_part KDT_BENCH_MODEL_SHAPE="$shape" KDT_BENCH_MODEL_REPS="$REPS" KDT_BENCH_MODEL_PAUSE_MS=300 \
        timeout "$LIMIT" "$dir/bench_model" --quick --only kimi 2>&1)
  us=$(echo "$out" | awk '/^  (decode|verify) / {for (i = 1; i < NF; i++) if ($(i + 1) == "us/layer") print $i}')
  [ -n "$us" ] || us=fail
  for u in $us; do echo "$shape $name $u" >>"$OUT_DIR/times"; done
  echo "  $shape  $name: $(echo $us)" >&2
}
for shape in $SHAPES; do
  for r in $(seq "$ROUNDS"); do
    for order in variants variants_rev; do
      while IFS=$'\t' read -r name dir env_part; do one "$shape" "$name" "$dir" "$env_part"; done <"$OUT_DIR/$order"
    done
  done
done
# table: the median over every reading of the variant (a failed or hung call shows as "fail")
ab_table shape 12 $SHAPES
