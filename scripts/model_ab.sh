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
names=()
for v in "${VARIANTS[@]}"; do
  name=${v%%=*}; rest=${v#*=}; dir=${rest%%:*}; env_part=""
  [ "$rest" != "$dir" ] && env_part=${rest#*:}
  [ -x "$dir/bench_model" ] || { echo "model_ab.sh: $dir/bench_model not found (variant $name)" >&2; exit 2; }
  names+=("$name")
  printf '%s\t%s\t%s\n' "$name" "$dir" "$env_part" >>"$OUT_DIR/variants"
done
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
# table: median over every reading of the variant (a failed or hung call shows as "fail")
printf '%-14s' "shape"
for n in "${names[@]}"; do printf ' %12s' "$n"; done
echo
for shape in $SHAPES; do
  printf '%-14s' "$shape"
  for n in "${names[@]}"; do
    vals=$(awk -v s="$shape" -v n="$n" '$1 == s && $2 == n {print $3}' "$OUT_DIR/times")
    if [ -z "$vals" ] || echo "$vals" | grep -q fail; then med=fail
    else med=$(echo "$vals" | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'); fi
    printf ' %12s' "$med"
  done
  echo
done
