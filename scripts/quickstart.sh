#!/usr/bin/env bash
# quickstart.sh - the README's main command. On a fresh Debian machine: installs the packages the
# build needs (apt-get, when run as root and something is missing), builds kdtree (with CUDA when
# nvcc is present), then runs `kdtree generate` with the bundled tiny target + DFlash drafter on a
# code prompt, printing the completion as it is produced and a stats table (tau, tokens/s, vs ar).
#   scripts/quickstart.sh [extra kdtree generate flags, e.g. --spec chain --budget 16]
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="cmake gcc make pkg-config libjansson-dev libpcre2-dev libmicrohttpd-dev"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "quickstart: installing$missing"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  else
    echo "quickstart: missing packages:$missing (run: sudo apt-get install$missing)" >&2
    exit 1
  fi
fi
export PATH="$PATH:/usr/local/cuda/bin"
BUILD=${BUILD:-build}
DEVICE=cpu
if command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  DEVICE=cuda
  # this GPU's architecture only: the full 90a/80/120 set is for CI and packaging
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKDT_CUDA_ARCHS=native >/dev/null
else
  # no GPU: a CPU-only build is enough and builds in a fraction of the time
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKDT_CUDA=OFF >/dev/null
fi
echo "quickstart: building ($DEVICE) into $BUILD/ ..."
cmake --build "$BUILD" -j "$(nproc)" --target kdtree_cli >/dev/null
PROMPT='def quicksort(items):
    """Sort a list with quicksort and return the new list."""
'
exec "$BUILD/kdtree" generate --model models/tiny-target --draft models/tiny-dflash \
  --device auto --prompt "$PROMPT" --spec ddtree --budget 32 --max-tokens 128 --compare-ar "$@"
