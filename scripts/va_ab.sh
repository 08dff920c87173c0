#!/usr/bin/env bash
# va_ab.sh - interleaved A/B timing of verify_attn variants on the GPU host: for each shape, each
# variant's bench_kernels time (graph replay, median of its reps; L2 flushed), variants taken in
# turn so that clock and machine drift hit them alike; prints one table. A variant is
#   NAME=DIR[:ENV ...]    bench_kernels from DIR/bench_kernels, run with the environment ENV
# e.g. scripts/va_ab.sh base=/tmp/r "seesaw=/tmp/r:KDT_VA_SEESAW=1" old=/tmp/old
# Options: --reps N (rounds, default 3), --shapes "S,P,q ..." (default: the issue's targets; S 1..64,
# P 0..16384, q 1..65, what bench_kernels' buffers hold: another shape reads "fail"),
# --limit S (seconds per bench call, default 60: a hung kernel costs one call, not the session).
set -uo pipefail
REPS=3
LIMIT=60
SHAPES="64,4096,33 64,16384,65 8,16384,33 1,4096,33 1,256,9 64,16384,1"
VARIANTS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --reps) REPS=$2; shift 2 ;;
    --shapes) SHAPES=$2; shift 2 ;;
    --limit) LIMIT=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *=*) VARIANTS+=("$1"); shift ;;
    *) echo "va_ab.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#VARIANTS[@]} -gt 0 ] || { echo "va_ab.sh: no variant given (see --help)" >&2; exit 2; }
OUT_DIR=$(mktemp -d)
trap 'rm -rf "$OUT_DIR"' EXIT
. "$(dirname "$0")/ab_common.sh"
ab_variants va_ab.sh bench_kernels "${VARIANTS[@]}"
for rep in $(seq "$REPS"); do
  for shape in $SHAPES; do
    while IFS=$'\t' read -r name dir env_part; do
      line=$(env $env_part KDT_BENCH_VA_SHAPE="$shape" timeout "$LIMIT" "$dir/bench_kernels" --only verify_attn 2>&1 |
             grep -E "^ *${shape%%,*} +[0-9]+ +[0-9]+ +[0-9.]+ " | head -1)
      rc=$?
      us=$(echo "$line" | awk '{print $4}')
      [ -n "$us" ] || us="fail"
      [ "$rc" = 0 ] || us="fail"
      echo "$shape $name $us" >>"$OUT_DIR/times"
      echo "rep $rep  $shape  $name: $us us" >&2
    done <"$OUT_DIR/variants"
  done
done
# table: the median over reps (a failed or hung call shows as "fail")
ab_table "S,P,q" 16 $SHAPES
