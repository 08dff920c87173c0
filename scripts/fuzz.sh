#!/usr/bin/env bash
# fuzz.sh - coverage-guided fuzzing of the parsers and kernel twins that take outside input
# (tests/fuzz/fuzz_*.c; tests/fuzz/fuzz.h says what each promises). Builds the CPU library and
# the harnesses with clang, libFuzzer, AddressSanitizer and UBSan into build-fuzz/, then runs each
# harness for SECONDS seconds on its committed corpus (tests/fuzz/corpus/<harness>/). New
# coverage goes to build-fuzz/corpus/<harness>/ (not committed); an input that breaks a promise
# or trips a sanitizer is written to build-fuzz/crashes/ and ends that harness's run with its
# report. Commit a minimized crasher into the corpus with the fix: ctest replays it from then on.
#   scripts/fuzz.sh [--seconds N] [--jobs N] [harness ...]     (default: 60 s each, all harnesses)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=60
JOBS=1
HARNESSES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_EACH=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) HARNESSES+=("$1"); shift ;;
  esac
done
command -v clang >/dev/null || { echo "fuzz.sh: clang is needed (apt-get install clang)" >&2; exit 1; }
CC=clang cmake -S . -B build-fuzz -DKDT_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DKDT_FUZZ=ON \
  -DKDT_SANITIZE="address;undefined" >/dev/null
if [ ${#HARNESSES[@]} -eq 0 ]; then
  mapfile -t HARNESSES < <(ls tests/fuzz/fuzz_*.c | sed -n 's#.*/fuzz_\(.*\)\.c#\1#p' |
                           grep -vx -e util -e replay)
fi
cmake --build build-fuzz -j "$(nproc)" --target $(printf 'fuzz_%s ' "${HARNESSES[@]}") >/dev/null
mkdir -p build-fuzz/crashes
fail=0
printf '%-16s %-8s %s\n' harness result "runs, coverage"
for h in "${HARNESSES[@]}"; do
  mkdir -p "build-fuzz/corpus/$h"
  log="build-fuzz/fuzz_$h.log"
  # -jobs N > 1: N processes share the corpus, each logging to fuzz-<k>.log in build-fuzz/
  par=(); [ "$JOBS" -gt 1 ] && par=(-jobs="$JOBS" -workers="$JOBS")
  if (cd build-fuzz && ./fuzz_$h -max_total_time="$SECONDS_EACH" "${par[@]}" -timeout=20 \
       -rss_limit_mb=4096 -artifact_prefix="crashes/${h}-" -print_final_stats=1 \
       "corpus/$h" "../tests/fuzz/corpus/$h") >"$log" 2>&1; then r=clean; else r=FAILED; fail=1; fi
  stats=$(grep -E '^stat::number_of_executed_units|^#[0-9]+.*DONE' "$log" | tail -1 | sed 's/ *$//')
  printf '%-16s %-8s %s\n' "$h" "$r" "$stats"
  [ $r = FAILED ] && grep -E 'ERROR|fuzz: |SUMMARY|Test unit written' "$log" | head -8
done
exit $fail
