#!/usr/bin/env bash
# build_nvcc.sh - cmake-free build: nvcc + cc only. Produces the same library (libkdtree.a), the
# tests (test_*, gpu_test_*) and bench_kernels as the CMake build, for hosts without cmake.
#   scripts/build_nvcc.sh [--out DIR] [--archs "90a 80 120"] [--cpu]
# The model, engine and tokenizer are included when pkg-config finds jansson (and PCRE2).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=build
ARCHS="90a 80 120"
USE_CUDA=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --archs) ARCHS="$2"; shift 2 ;;
    --cpu) USE_CUDA=0; shift ;;
    *) echo "usage: $0 [--out DIR] [--archs \"90a 80 120\"] [--cpu]" >&2; exit 2 ;;
  esac
done
CC=${CC:-cc}
NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
if [ "$USE_CUDA" = 1 ] && ! command -v "$NVCC" >/dev/null 2>&1; then
  [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc || { echo "nvcc not found; building CPU-only"; USE_CUDA=0; }
fi
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v "$NVCC" 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")}

mkdir -p "$OUT/obj"
CFLAGS="-std=c11 -O2 -Wall -Wextra -ffp-contract=off -D_GNU_SOURCE -Iinclude -Isrc -Isrc/common"
LIBS="-lm -lpthread"
# OpenMP (libgomp, part of gcc) spreads the CPU forward over the cores; without it the same code
# runs on one thread with the same results
if echo 'int main(void){return 0;}' | $CC -fopenmp -x c - -o /dev/null 2>/dev/null; then
  CFLAGS="$CFLAGS -fopenmp"
fi
SRC="src/common/*.c src/kernels/cpu/*.c"
if [ "$USE_CUDA" = 1 ]; then
  CFLAGS="$CFLAGS -DKDT_WITH_CUDA=1 -I$CUDA_HOME/include"
  LIBS="-L$CUDA_HOME/lib64 -lcudart $LIBS"
else
  SRC="$SRC src/kernels/no_cuda.c"
fi
if pkg-config --exists jansson 2>/dev/null; then
  CFLAGS="$CFLAGS -DKDT_WITH_MODEL=1 $(pkg-config --cflags jansson)"
  LIBS="$(pkg-config --libs jansson) $LIBS"
  SRC="$SRC src/model/*.c src/engine/*.c"
  [ "$USE_CUDA" = 1 ] || SRC="$SRC src/model/no_cuda/*.c src/engine/no_cuda/*.c"
  if pkg-config --exists libpcre2-8 2>/dev/null; then
    CFLAGS="$CFLAGS -DKDT_WITH_TOKENIZER=1 $(pkg-config --cflags libpcre2-8)"
    LIBS="$(pkg-config --libs libpcre2-8) $LIBS"
    SRC="$SRC src/tokenizer/*.c"
  fi
fi
shopt -s nullglob
C_FILES=( $SRC )
CU_FILES=()
if [ "$USE_CUDA" = 1 ]; then
  CU_FILES=( src/kernels/cuda/*.cu src/model/cuda/*.cu )
  C_FILES+=( src/kernels/cuda/*.c src/model/cuda/*.c )
  if pkg-config --exists jansson 2>/dev/null; then
    CU_FILES+=( src/engine/cuda/*.cu )
    C_FILES+=( src/engine/cuda/*.c )
  fi
fi
GENCODE=""
for a in $ARCHS; do GENCODE="$GENCODE -gencode=arch=compute_$a,code=sm_$a"; done

obj() { echo "$OUT/obj/$(echo "$1" | tr / _).o"; }
export -f obj
export OUT CC NVCC CFLAGS GENCODE
printf '%s\n' "${C_FILES[@]}" | xargs -r -P "$JOBS" -I{} bash -c '$CC $CFLAGS -c {} -o "$(obj {})"'
if [ ${#CU_FILES[@]} -gt 0 ]; then
  printf '%s\n' "${CU_FILES[@]}" | xargs -r -P "$JOBS" -I{} bash -c \
    '$NVCC -std=c++17 -O3 -lineinfo --expt-relaxed-constexpr -Iinclude -Isrc -Isrc/common -DKDT_WITH_CUDA=1 $GENCODE -c {} -o "$(obj {})"'
fi
rm -f "$OUT/libkdtree.a"
ar rcs "$OUT/libkdtree.a" "$OUT"/obj/*.o
LINK="$CC"
[ "$USE_CUDA" = 1 ] && LINK="$CC"   # cudart is a C library; no device link step is needed
build_exe() { # name sources...
  local name="$1"; shift
  $LINK $CFLAGS -Itests -Ibench -DKDT_SOURCE_DIR="\"$PWD\"" "$@" "$OUT/libkdtree.a" $LIBS -lstdc++ -o "$OUT/$name"
}
for t in tests/test_*.c; do build_exe "$(basename "$t" .c)" "$t" & done; wait
if [ "$USE_CUDA" = 1 ]; then
  for t in tests/gpu/test_*.c; do build_exe "gpu_$(basename "$t" .c)" "$t" & done; wait
  if pkg-config --exists jansson 2>/dev/null; then # the GEMM v1/v2 test compiles gpu_gemm.cu into itself
    $NVCC -std=c++17 -O3 --expt-relaxed-constexpr -Iinclude -Isrc -Isrc/common -Isrc/model/cuda $GENCODE \
      tests/gpu/test_gemm_ab_gpu.cu -o "$OUT/gpu_test_gemm_ab"
  fi
  $NVCC -std=c++17 -O3 -Isrc/kernels/cuda -Isrc/model/cuda -Itests/gpu $GENCODE tests/gpu/test_wgmma_sm90.cu -o "$OUT/gpu_test_wgmma_sm90"
  BENCH=( bench/bench_*.c )
  BENCH_CU_OBJ=()
  mkdir -p "$OUT/obj_bench" # outside obj/: never archived into libkdtree.a
  for f in bench/bench_*.cu; do
    o="$OUT/obj_bench/$(basename "$f").o"
    $NVCC -std=c++17 -O3 -Iinclude -Isrc -Isrc/common -Ibench $GENCODE -c "$f" -o "$o"
    BENCH_CU_OBJ+=( "$o" )
  done
  [ ${#BENCH[@]} -gt 0 ] && build_exe bench_kernels "${BENCH[@]}" "${BENCH_CU_OBJ[@]}"
fi
echo "build_nvcc.sh: built $OUT/libkdtree.a, tests and $( [ "$USE_CUDA" = 1 ] && echo "bench_kernels (archs: $ARCHS)" || echo "no CUDA targets")"
