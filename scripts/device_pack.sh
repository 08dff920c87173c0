#!/usr/bin/env bash
# device_pack.sh - builds the GPU binaries on this machine (Release, sm_90a by default) and packs
# them for the lent GPU host, which has no libjansson-dev, libmicrohttpd or network: every GPU test,
# bench_kernels, bench_model and kdtree, stripped, plus the shared libraries kdtree needs beyond
# glibc and CUDA, in .device/pack/bin.tar.xz (.device/ is git-ignored; name .device/pack in the
# device tool's `carry`). Prints the command that unpacks and runs scripts/gpu_check.sh there.
#   scripts/device_pack.sh [--build DIR] [--archs "90a"]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-device
ARCHS=90a
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --archs) ARCHS=$2; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "device_pack.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
export PATH="$PATH:/usr/local/cuda/bin"
command -v nvcc >/dev/null || { echo "device_pack.sh: nvcc not found (CUDA toolkit needed)" >&2; exit 1; }
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKDT_CUDA_ARCHS="$ARCHS" >/dev/null
cmake --build "$BUILD" -j "$(nproc)" >/dev/null
STAGE=.device/stage
rm -rf "$STAGE"
mkdir -p "$STAGE/lib" .device/pack
shopt -s nullglob
BINS=( "$BUILD"/gpu_test_* "$BUILD"/bench_kernels "$BUILD"/bench_model "$BUILD"/kdtree )
[ ${#BINS[@]} -gt 0 ] || { echo "device_pack.sh: nothing built in $BUILD" >&2; exit 1; }
cp "${BINS[@]}" "$STAGE/"
strip "$STAGE"/* 2>/dev/null || true
# libraries beyond glibc, libstdc++ and CUDA (the host has those): the server's libmicrohttpd and
# GnuTLS chain, jansson, pcre2
for b in "${BINS[@]}"; do ldd "$b"; done | awk '/=> \// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcudart|libcuda|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$STAGE/lib/"; done
# -9e: the binaries share most of their device code, which only a large xz window finds (23 MB ->
# 9 MB; the device tool carries at most 64 MiB with the work tree)
XZ_OPT="-9e -T0" tar -cJf .device/pack/bin.tar.xz -C "$STAGE" .
echo "packed $(ls "$STAGE" | grep -vc '^lib$') binaries and $(ls "$STAGE/lib" | wc -l) libraries:" \
     "$(du -h .device/pack/bin.tar.xz | cut -f1) in .device/pack/bin.tar.xz (built for $ARCHS in $BUILD)"
cat <<EOF
on the device (run with carry [".device/pack"]; tests find models via KDT_SOURCE_DIR=$PWD; gpu_check
writes ~40 logs and only a few files come back, so they return as one archive plus the two tables):
  mkdir -p $(dirname "$PWD") && ln -sfn \$PWD $PWD && mkdir -p /tmp/r && tar -xJf .device/pack/bin.tar.xz -C /tmp/r && LD_LIBRARY_PATH=/tmp/r/lib KDT_PREBUILT=/tmp/r OUT=/tmp/check scripts/gpu_check.sh; tar -cJf \$OUT/check.tar.xz -C /tmp check; cp /tmp/check/bench.md /tmp/check/bench_model.md \$OUT/
EOF
