# ab_common.sh - the parts va_ab.sh and model_ab.sh share (sourced, not run): reading the variants
# NAME=DIR[:ENV ...] into $OUT_DIR/variants (name, dir, env, tab-separated) and AB_NAMES, and the
# table of medians from $OUT_DIR/times (lines "shape name value", value "fail" for a failed call).

# ab_variants SCRIPT BINARY VARIANT...: every variant's DIR must hold an executable BINARY
ab_variants() {
  local script=$1 binary=$2 v name rest dir env_part
  shift 2
  AB_NAMES=()
  for v in "$@"; do
    name=${v%%=*}; rest=${v#*=}; dir=${rest%%:*}; env_part=""
    [ "$rest" != "$dir" ] && env_part=${rest#*:}
    [ -x "$dir/$binary" ] || { echo "$script: $dir/$binary not found (variant $name)" >&2; exit 2; }
    AB_NAMES+=("$name")
    printf '%s\t%s\t%s\n' "$name" "$dir" "$env_part" >>"$OUT_DIR/variants"
  done
}

# ab_table HEADER WIDTH SHAPE...: one row per shape, one column per variant: the median of its
# values (the mean of the middle two for an even count), "fail" if any call failed or none ran
ab_table() {
  local header=$1 width=$2 shape n vals med
  shift 2
  printf '%-14s' "$header"
  for n in "${AB_NAMES[@]}"; do printf " %${width}s" "$n"; done
  echo
  for shape in "$@"; do
    printf '%-14s' "$shape"
    for n in "${AB_NAMES[@]}"; do
      vals=$(awk -v s="$shape" -v n="$n" '$1 == s && $2 == n {print $3}' "$OUT_DIR/times")
      if [ -z "$vals" ] || echo "$vals" | grep -q fail; then med=fail
      else med=$(echo "$vals" | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'); fi
      printf " %${width}s" "$med"
    done
    echo
  done
}
