#!/usr/bin/env bash
# gpu_check.sh - the one GPU script: on a GPU host, build for its GPU (sm_90a plus the portable
# sm_80 path on a Hopper, sm_120 on an RTX PRO 6000 Blackwell, sm_80 on Ampere; KDT_CUDA_ARCHS
# overrides), run every GPU test, run them again under compute-sanitizer (memcheck, racecheck), run
# build/bench_kernels, bench_model, the engine bench and a 64-client server load (ar / ddtree /
# auto), and print a short summary table last.
#   scripts/gpu_check.sh [--no-sanitizer] [--no-bench] [--quick-bench] [--only-tests REGEX] [--experiments]
#                        [--small-smem]
# --small-smem: after the tests, every GPU test again with KDT_GPU_SMEM_LIMIT=101376, the shared
# memory of the RTX PRO 6000 Blackwell (sm_120) and sm_86 / 89: every launcher then picks the
# configuration such a part takes (portable verify_attn at BN 16, 8-warp decode attention, smaller
# GEMM pools; src/kernels/cuda/device_limits.h), checked against the CPU twins as usual.
# --experiments: after the tests, the opt-in variants and the previous defaults (docs/model_gpu.md,
# docs/verify_attn_notes.md): the model test under them, the wave / access-pattern probes,
# verify_attn with and without KDT_VA_FUSED=1, and the Kimi layer bench (quick) per variant set,
# each printing its summary lines.
# Order: tests, bench, then the sanitizer runs (KDT_TEST_QUICK=1), bounded by KDT_CHECK_DEADLINE.
# Environment: KDT_PREBUILT=DIR uses binaries built elsewhere (e.g. carried build dir) instead of
# building; OUT=DIR receives logs and bench/RESULTS-style markdown (default /tmp/kdt_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
T_START=$(date +%s)
DEADLINE=${KDT_CHECK_DEADLINE:-3000}   # seconds; sanitizer runs past it are skipped
SAN_LIMIT=${KDT_SAN_LIMIT:-120}        # seconds per sanitizer run
BENCH_LIMIT=${KDT_BENCH_LIMIT:-900}    # seconds per benchmark binary (a hung kernel must not eat the run)
LOG=${OUT:-/tmp/kdt_gpu_check}
mkdir -p "$LOG"
SAN=1; BENCH=1; BENCH_FLAGS=""; ONLY=""; EXPER=0; SMALL=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-sanitizer) SAN=0 ;;
    --no-bench) BENCH=0 ;;
    --quick-bench) BENCH_FLAGS="--quick" ;;
    --only-tests) ONLY="$2"; shift ;;
    --experiments) EXPER=1 ;;
    --small-smem) SMALL=1 ;;
    *) echo "usage: $0 [--no-sanitizer] [--no-bench] [--quick-bench] [--only-tests REGEX] [--experiments] [--small-smem]" >&2; exit 2 ;;
  esac
  shift
done
export PATH="$PATH:/usr/local/cuda/bin"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit --format=csv,noheader | tee "$LOG/gpu.txt"

t0=$(date +%s)
if [ -n "${KDT_PREBUILT:-}" ]; then
  BUILD=$KDT_PREBUILT
  echo "using prebuilt binaries in $BUILD"
else
  BUILD=build-gpu
  # the GPU's own architecture (compute capability from nvidia-smi), so its SASS is built, not JIT'ed
  CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  case "$CAP" in
    9.*) ARCHS="90a;80" ;;
    12.*) ARCHS="120" ;;
    8.*) ARCHS="80" ;;
    *) ARCHS="90a;80;120" ;;
  esac
  ARCHS=${KDT_CUDA_ARCHS:-$ARCHS}
  echo "building for CUDA architectures $ARCHS (compute capability ${CAP:-unknown})"
  if command -v cmake >/dev/null 2>&1; then
    cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=Release -DKDT_CUDA_ARCHS="$ARCHS" >"$LOG/build.log" 2>&1 &&
      cmake --build $BUILD -j "$(nproc)" >>"$LOG/build.log" 2>&1 || { tail -40 "$LOG/build.log"; echo "BUILD FAILED"; exit 1; }
  else
    scripts/build_nvcc.sh --out $BUILD --archs "${ARCHS//;/ }" >"$LOG/build.log" 2>&1 || { tail -40 "$LOG/build.log"; echo "BUILD FAILED"; exit 1; }
  fi
fi
echo "build: $(( $(date +%s) - t0 )) s"

# --experiments: the tests also check the opt-in variants that have suites of their own
[ $EXPER = 1 ] && export KDT_TEST_VA_VARIANTS=1
mapfile -t TESTS < <(ls "$BUILD"/gpu_test_* 2>/dev/null | grep -E "${ONLY:-.}" | sort)
[ ${#TESTS[@]} -gt 0 ] || { echo "no GPU tests found in $BUILD"; exit 1; }
declare -A RES MEM RACE SECS SMALLRES
fail=0
# every test once; with --small-smem again as a 99 KB part
for lim in "" $([ $SMALL = 1 ] && echo 101376); do
  for t in "${TESTS[@]}"; do
    n=$(basename "$t")
    log="$LOG/$n${lim:+.smem99k}.log"
    s=$(date +%s)
    if env ${lim:+KDT_GPU_SMEM_LIMIT=$lim} timeout "${KDT_TEST_LIMIT:-600}" "$t" >"$log" 2>&1; then r=pass; else r=FAIL; fail=1; fi
    if [ -n "$lim" ]; then SMALLRES[$n]=$r; else RES[$n]=$r; SECS[$n]=$(( $(date +%s) - s )); fi
    echo "--- $n${lim:+ with KDT_GPU_SMEM_LIMIT=$lim}: $r ($(( $(date +%s) - s )) s): $(tail -1 "$log")"
    [ $r = pass ] || tail -30 "$log"
  done
done
# The wgmma GEMMs (gemm_wg.cuh) take the runner's launches of >= 64 rows (their ss forms) and
# others of >= 128 (register forms), which the model tests' 64-row runners reach only at the
# edge: two quick passes with them from 2 rows (ss forms; register forms, KDT_GEMM_WG_SS=0) put
# every multi-row dense and MoE launch on each form, so the suite's bitwise checks (chunked
# prefill, decode vs verify, batch invariance) run across the kernels. A device without wgmma
# runs the suite as it is.
WG2=""
if [ -x "$BUILD/gpu_test_model_gpu" ] && [[ " ${TESTS[*]} " == *"/gpu_test_model_gpu "* ]]; then
  for ss in 1 0; do
    s=$(date +%s); r=pass
    KDT_GEMM_WG_SS=$ss KDT_GEMM_WG_MIN=2 KDT_TEST_QUICK=1 timeout "${KDT_TEST_LIMIT:-600}" "$BUILD/gpu_test_model_gpu" \
      >"$LOG/gpu_test_model_gpu.wg2ss$ss.log" 2>&1 || { r=FAIL; fail=1; tail -30 "$LOG/gpu_test_model_gpu.wg2ss$ss.log"; }
    WG2="$WG2${WG2:+ / }$r"
    echo "--- gpu_test_model_gpu with KDT_GEMM_WG_SS=$ss KDT_GEMM_WG_MIN=2 (quick): $r ($(( $(date +%s) - s )) s): $(tail -1 "$LOG/gpu_test_model_gpu.wg2ss$ss.log")"
  done
fi
# KDT_EXP_PARTS (default "model,probes,va,layer") picks the experiment parts, so a run that would
# pass the device's 10-minute call limit can be split into two calls
EXP_PARTS=",${KDT_EXP_PARTS:-model,probes,va,layer},"
exp_part() { [[ "$EXP_PARTS" == *",$1,"* ]]; }
if [ $EXPER = 1 ]; then
  # opt-in variants: correctness first (the model test's fixtures, bitwise contracts and greedy
  # runs with all GEMM variants on), then the probes, verify_attn, the layer bench per variant
  # ALL: every opt-in model variant at once (tiled experts forced: the small test models are
  # row-major by default; the wgmma GEMMs from 2 rows); OLD: session 7's defaults (2 CTAs per SM for the grouped GEMM,
  # row-major experts; dense launches of > 32 rows at 2 per SM and 64-row MoE items, as before
  # session 34); OLD8: session 8's (no programmatic dependent launch, 4 warps per 16-head
  # attention item, tiled experts everywhere, 3-stage grouped passes); OLD9: session 9's; kept
  # reachable for A/B runs
  ALL="KDT_GPU_TILED_DENSE=1 KDT_GPU_TILED_EXPERTS=1 KDT_GEMM_WG_MIN=2 ${KDT_EXP_ALL_EXTRA:-}"
  OLD="KDT_GEMM_GROUPED_PER_SM=2 KDT_GPU_TILED_EXPERTS=0 KDT_GEMM_WIDE3=0 KDT_GPU_ITEM_ROWS=64"
  OLD8="KDT_GPU_PDL=0 KDT_GPU_ATT_WARPS=4 KDT_GPU_TILED_EXPERTS=1 KDT_GEMM_GROUPED_CAP2=0"
  OLD9="KDT_GPU_PDL_ROWS=0 KDT_GPU_ROUTE_V1=1" # session 9's: GEMM-only PDL, the one-warp router
  if exp_part model && [ -x "$BUILD/gpu_test_gemm_ab" ]; then
    env $ALL timeout "${KDT_TEST_LIMIT:-600}" "$BUILD/gpu_test_gemm_ab" >"$LOG/exp_gemm_ab.log" 2>&1 &&
      r=pass || { r=FAIL; fail=1; tail -30 "$LOG/exp_gemm_ab.log"; }
    echo "--- gpu_test_gemm_ab with $ALL: $r: $(tail -1 "$LOG/exp_gemm_ab.log")"
  fi
  if exp_part model && [ -x "$BUILD/gpu_test_model_gpu" ]; then
    for v in "$ALL" "$OLD" "$OLD8" "$OLD9"; do
      env $v timeout "${KDT_TEST_LIMIT:-600}" "$BUILD/gpu_test_model_gpu" >"$LOG/exp_model_gpu.log" 2>&1 &&
        r=pass || { r=FAIL; fail=1; tail -30 "$LOG/exp_model_gpu.log"; }
      echo "--- gpu_test_model_gpu with $v: $r: $(tail -1 "$LOG/exp_model_gpu.log")"
    done
  fi
  exp_part probes && [ -x "$BUILD/gpu_test_gemm_ab" ] && KDT_TEST_QUICK=1 timeout 300 "$BUILD/gpu_test_gemm_ab" --wave 2>&1 |
    tee "$LOG/exp_wave.log" | grep -vE '^\s*$' | tail -40
  if exp_part va && [ -x "$BUILD/bench_kernels" ] && nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q '^9\.'; then
    # verify_attn v4 and v5 (seesaw), each with and without the fused softmax (KDT_VA_FUSED=1):
    # the target shapes and the phase stamps of the headline one
    for v in "KDT_EXP=default" "KDT_VA_FUSED=1" "KDT_VA_SEESAW=1" "KDT_VA_SEESAW=1 KDT_VA_FUSED=1"; do
      f="$LOG/exp_va_$(echo "$v" | tr ' =' '_-').log"
      env $v timeout "$BENCH_LIMIT" "$BUILD/bench_kernels" --quick --only verify_attn >"$f" 2>&1 || fail=1
      { echo "== bench_kernels --only verify_attn with $v"
        grep -E '^ *(64|8|1) +(4096|16384|256) +(33|65|9|1) ' "$f"
        env $v KDT_VA_PROFILE=1 KDT_BENCH_VA_SHAPE=64,4096,33 timeout 60 "$BUILD/bench_kernels" --only verify_attn 2>&1 |
          grep -A2 'phases'; } | tee -a "$LOG/exp_va.txt"
    done
  fi
  if exp_part layer && [ -x "$BUILD/bench_model" ]; then
    # KDT_EXP_VARIANTS (';'-separated env sets) overrides the list, e.g. to split it over two calls
    IFS=';' read -r -a VARS <<< "${KDT_EXP_VARIANTS:-KDT_EXP=default;$OLD9;KDT_GPU_ROUTE_PLAN=0;$OLD8;$OLD;$ALL}"
    : >"$LOG/exp_summary.txt"
    for v in "${VARS[@]}"; do
      f="$LOG/exp_bench_model_$(echo "$v" | tr ' =' '_-').log"
      s=$(date +%s)
      env $v timeout "$BENCH_LIMIT" "$BUILD/bench_model" --quick --only kimi --md "$f.md" >"$f" 2>&1 || fail=1
      { echo "== bench_model --quick --only kimi with $v ($(( $(date +%s) - s )) s)"
        grep -E '^\| kimi-k2.6 layer \| (decode \| random \| 1 |verify \| (random|corr))' "$f.md"; } | tee -a "$LOG/exp_summary.txt"
    done
    # where a one-layer decode S 1 pass spends its time, step by step at real clocks (bench_model's
    # pass cut after each step)
    { echo "== bench_model step profile, decode S 1, one layer"
      KDT_BENCH_MODEL_LAYERS=1 KDT_BENCH_MODEL_SHAPE=decode,1 KDT_BENCH_MODEL_STEPS=1 timeout "$BENCH_LIMIT" \
        "$BUILD/bench_model" --only kimi 2>&1 | grep -E '^  decode |^ +[0-9]+ +[a-z_]'; } | tee -a "$LOG/exp_summary.txt"
    # KDT_EXP_NCU=1: per-kernel times of one decode S 1 layer replay, default and all variants on
    # (ncu serialises the kernels and flushes the caches: the sum exceeds the graph replay)
    if [ "${KDT_EXP_NCU:-0}" = 1 ] && command -v ncu >/dev/null 2>&1; then
      for v in "KDT_EXP=default" "$ALL"; do
        echo "== ncu, decode S 1, $v" | tee -a "$LOG/exp_summary.txt"
        env $v KDT_BENCH_MODEL_SHAPE=decode,1 timeout "$BENCH_LIMIT" ncu --profile-from-start off --clock-control none \
          --cache-control all --csv --metrics gpu__time_duration.sum "$BUILD/bench_model" --quick --only kimi 2>/dev/null |
          awk -F'","' '$0 ~ /gpu__time_duration/ {
              n = $5; gsub(/\(anonymous namespace\)::/, "", n); sub(/\(.*/, "", n)
              v = $NF; gsub(/[",]/, "", v); u = $(NF - 1)
              f = (u ~ /^(ns|nsecond)/) ? 0.001 : ((u ~ /^(ms|msecond)/) ? 1000 : 1)
              t[n] += v * f; c[n]++; all += v * f }
            END { for (k in t) printf "  %9.1f us %3d x %s\n", t[k], c[k], k
                  printf "  %9.1f us       total (serialised)\n", all }' |
          sort -n -r | tee -a "$LOG/exp_summary.txt"
      done
    fi
  fi
fi
if [ $BENCH = 1 ] && [ -x "$BUILD/bench_kernels" ]; then
  s=$(date +%s)
  timeout "$BENCH_LIMIT" "$BUILD/bench_kernels" $BENCH_FLAGS --md "$LOG/bench.md" 2>&1 | tee "$LOG/bench.log" || fail=1
  echo "bench_kernels: $(( $(date +%s) - s )) s"
  if nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q '^9\.'; then
    # bench_kernels ran the sm_90a verify_attn kernel (the default on a Hopper); now the portable
    # mma.sync one (the sm_80 / sm_120 path), same shapes
    echo "verify_attn, portable path (KDT_VERIFY_ATTN=mma):"
    KDT_VERIFY_ATTN=mma timeout "$BENCH_LIMIT" "$BUILD/bench_kernels" $BENCH_FLAGS --only verify_attn --md "$LOG/bench_mma.md" 2>&1 |
      tee "$LOG/bench_mma.log" || fail=1
    # where the sm_90a kernel's cycles go on the headline shape (phase stamps of one CTA)
    KDT_VA_PROFILE=1 KDT_BENCH_VA_SHAPE=64,4096,33 timeout 60 "$BUILD/bench_kernels" --only verify_attn 2>&1 |
      grep -A2 'phases' | tee "$LOG/va_phases.txt"
  fi
fi
if [ $BENCH = 1 ] && [ -x "$BUILD/bench_model" ]; then
  s=$(date +%s)
  timeout "$BENCH_LIMIT" "$BUILD/bench_model" $BENCH_FLAGS --md "$LOG/bench_model.md" 2>&1 | tee "$LOG/bench_model.log" || fail=1
  echo "bench_model: $(( $(date +%s) - s )) s"
fi
# KDT_AUTO_TRACE lines -> per batch size: plain and drafted rounds, tokens per round, mean wall
auto_summary() {
  grep -E '^auto S=' "$1" 2>/dev/null | grep -v ' setup ' | awk '{
      split($2, a, "="); S = a[1] == "S" ? a[2] : 0; k = $3
      for (i = 4; i <= NF; i++) { split($i, v, "="); if (v[1] == "tokens") t = v[2]; if (v[1] == "wall_us") w = v[2] }
      n[S " " k]++; tok[S " " k] += t; us[S " " k] += w }
    END { for (x in n) printf "  auto trace: S=%s rounds=%d tokens/round=%.2f us/round=%.0f tokens/s=%.0f\n",
            x, n[x], tok[x] / n[x], us[x] / n[x], tok[x] / us[x] * 1e6 }' | sort -t= -k2 -n
}
if [ $BENCH = 1 ] && [ -x "$BUILD/kdtree" ]; then
  # the engine on the GPU with the bundled tiny pair: batch 1 and batch 16, greedy, held-out prompts
  s=$(date +%s)
  for b in 1 16; do
    KDT_AUTO_TRACE=1 timeout "$BENCH_LIMIT" "$BUILD/kdtree" bench --device cuda --model models/tiny-target \
      --draft models/tiny-dflash --prompt-file bench/prompts_heldout_ids.txt \
      --budgets ${KDT_ENGINE_BUDGETS:-4,7,8,15,16,31,32,64} --auto --max-tokens ${KDT_ENGINE_TOKENS:-256} \
      --ignore-eos --batch $b 2>"$LOG/auto_trace_b$b.txt" | tee "$LOG/bench_engine_b$b.log" || fail=1
    auto_summary "$LOG/auto_trace_b$b.txt"
  done
  # batch 1 again after one untimed pass over the first 2 prompts per mode (--warmup): graph
  # captures and auto's first measurements out of the timing, as in a long-running server
  KDT_AUTO_TRACE=1 timeout "$BENCH_LIMIT" "$BUILD/kdtree" bench --device cuda --model models/tiny-target \
    --draft models/tiny-dflash --prompt-file bench/prompts_heldout_ids.txt --budgets 7,15 --auto \
    --max-tokens ${KDT_ENGINE_TOKENS:-256} --ignore-eos --batch 1 --warmup 2 2>"$LOG/auto_trace_b1w.txt" |
    tee "$LOG/bench_engine_b1w.log" || fail=1
  auto_summary "$LOG/auto_trace_b1w.txt"
  echo "engine bench: $(( $(date +%s) - s )) s"
fi
if [ $BENCH = 1 ] && [ -x "$BUILD/kdtree" ] && command -v python3 >/dev/null 2>&1 &&
   "$BUILD/kdtree" serve --help >/dev/null 2>&1; then
  # the server on the GPU: 64 streaming clients, ar vs ddtree B 8 vs auto (cap 32)
  s=$(date +%s)
  port=$(( 20000 + RANDOM % 20000 ))
  KDT_AUTO_TRACE=1 "$BUILD/kdtree" serve --device ${KDT_LOAD_DEVICE:-cuda} --model models/tiny-target \
    --draft models/tiny-dflash --max-streams 64 --port $port >"$LOG/serve.log" 2>&1 &
  spid=$!
  http_get() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' "$1"; }
  for _ in $(seq 60); do http_get "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 1; done
  for spec in ar "ddtree --budget 8" "auto --budget 32"; do
    echo "server load: --spec $spec"
    python3 tools/server_load.py --url "http://127.0.0.1:$port" --clients 64 --seconds ${KDT_LOAD_SECONDS:-12} \
      --max-tokens 128 --ignore-eos --spec $spec 2>&1 | tee -a "$LOG/server_load.log" | tail -6 || fail=1
  done
  http_get "http://127.0.0.1:$port/metrics" | grep -E '^kdtree_engine_(rounds_total|auto_plain_rounds_total)' | tee -a "$LOG/server_load.log"
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
  auto_summary "$LOG/serve.log"
  echo "server load: $(( $(date +%s) - s )) s"
fi
# A binary whose sanitizer run never fits the limit runs there one test at a time (KDT_TEST_ONLY),
# each as its own row; TEST:TOOL runs only that tool on it. Racecheck of the whole engine test did
# not finish in 470 s (H200, session 22), its oracle half alone in 161 s, 0 hazards; its tiny-pair
# test did not finish in 540 s, so racecheck takes the pair's kernels from test_pair_brief (a few
# rounds of each mode; racecheck 0 hazards in 291 s, session 23) and memcheck keeps the whole
# tiny-pair test. SAN_PART_LIMIT: parts that need more than KDT_SAN_LIMIT seconds.
# The model test's wgmma plain attention also gets a racecheck of its own (session 48: the quick
# test_plain_prefill with it did not finish racecheck in 280 s on an H100), of its kernels only
# (SAN_PART_KERNEL: compute-sanitizer --kernel-name kns=...; 16 s on an H100, session 49).
declare -A SAN_PARTS=([gpu_test_engine_gpu]="test_lossless_oracle test_tiny_pair:memcheck test_pair_brief test_random_ops_gpu"
                      [gpu_test_model_gpu]="- test_plain_wg:racecheck")
declare -A SAN_PART_LIMIT=([test_pair_brief]=360 [test_random_ops_gpu]=300 [test_plain_wg]=120)
declare -A SAN_PART_KERNEL=([test_plain_wg]=plain_attn_wg)
SAN_ROWS=()
if [ $SAN = 1 ] && command -v compute-sanitizer >/dev/null 2>&1; then
  for t in "${TESTS[@]}"; do
    n=$(basename "$t")
    parts=${SAN_PARTS[$n]:-"-"}
    for part in $parts; do
      row=$n; only=""; tools="memcheck racecheck"
      [ "$part" != "-" ] && { only=${part%%:*}; row="$n:$only"; }
      [ "$part" != "${part#*:}" ] && tools=${part#*:}
      SAN_ROWS+=("$row")
      for tool in $tools; do
        left=$(( DEADLINE - ($(date +%s) - T_START) ))
        if [ $left -lt 20 ]; then r="skipped"; else
          cap=${SAN_PART_LIMIT[${only:--}]:-$SAN_LIMIT}
          lim=$(( left < cap ? left : cap ))
          kern=${SAN_PART_KERNEL[${only:--}]:-}
          KDT_TEST_ONLY=$only KDT_TEST_QUICK=1 timeout $lim compute-sanitizer --tool $tool --error-exitcode 86 \
            ${kern:+--kernel-name kns=$kern} "$t" \
            >"$LOG/${row//:/.}.$tool.log" 2>&1
          rc=$?
          if [ $rc = 0 ]; then r=clean; elif [ $rc = 124 ]; then r="timeout"; else r=ERRORS; fail=1; fi
          [ $r = ERRORS ] && tail -30 "$LOG/${row//:/.}.$tool.log"
        fi
        [ $tool = memcheck ] && MEM[$row]=$r || RACE[$row]=$r
      done
    done
  done
fi

echo
echo "== gpu_check summary ($(head -1 "$LOG/gpu.txt")) =="
printf '%-36s %-6s %-9s %-9s %6s %s\n' test result memcheck racecheck secs "$([ $SMALL = 1 ] && echo '99KB')"
for t in "${TESTS[@]}"; do
  n=$(basename "$t")
  printf '%-36s %-6s %-9s %-9s %6s %s\n' "$n" "${RES[$n]}" "${MEM[$n]:--}" "${RACE[$n]:--}" "${SECS[$n]}" "${SMALLRES[$n]:-}"
  for row in "${SAN_ROWS[@]}"; do
    [[ "$row" == "$n:"* ]] && printf '  %-34s %-6s %-9s %-9s %6s\n' "${row#*:}" "" "${MEM[$row]:--}" "${RACE[$row]:--}" ""
  done
  [ $n = gpu_test_model_gpu ] && [ -n "$WG2" ] && printf '  %-34s %-6s\n' "wgmma from 2 rows, ss / reg (quick)" "$WG2"
done
[ -f "$LOG/bench.log" ] && grep -E '^TARGET' "$LOG/bench.log"
exit $fail
