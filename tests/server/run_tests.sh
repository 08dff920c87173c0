#!/usr/bin/env bash
# run_tests.sh - end-to-end tests of `kdtree serve` on 127.0.0.1: starts the binary on free
# ports and checks it with the official `openai` npm client (client_test.mjs: completions, chat,
# streaming, errors, 32 concurrent clients vs solo answers, disconnects, 429), curl (raw SSE
# framing, events arriving as produced), promtool (`promtool check metrics` on /metrics), headless
# chromium (browser_test.mjs: the web chat page streams an answer; screenshot saved), and a
# graceful shutdown on SIGTERM. Every server it starts is killed at the end, whatever happens.
# Prints "N passed, N failed" last and exits 1 on any failure.
#
# usage: tests/server/run_tests.sh [--bin PATH] [--mock | --random] [--out DIR]
#   --bin PATH   the kdtree executable (default: $KDTREE_BIN, else build/kdtree, else the newest
#                build*/kdtree)
#   --mock       use the built-in deterministic mock model (no engine) whatever else exists
#   --random     use the random test checkpoint even if a trained pair exists
#   --out DIR    artifacts: server logs, chat_page.png (default: <bin dir>/server-test)
# Model, first found: $KDT_SERVE_MODEL (+ $KDT_SERVE_DRAFT); the trained tiny pair under models/
# (a directory with config.json; one whose name contains "draft" or "dflash" is the drafter);
# the random checkpoint tests/fixtures/models/kimi_tiny served with `--tokenizer bytes` (the real
# engine, ar only); else --model mock. The output says which one runs.
# Environment: KDT_MAX_TOKENS (answer length, default 24), KDT_CONC_SECONDS (32-client check,
# default 10), KDT_SKIP_BROWSER=1 (skip chromium, reported as a failure-free skip line),
# KDT_TOOLS_DIR (where promtool is unpacked; default <out>/tools).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

BIN=${KDTREE_BIN:-}
FORCE_MOCK=0
FORCE_RANDOM=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --mock) FORCE_MOCK=1; shift ;;
    --random) FORCE_RANDOM=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "run_tests.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$BIN" ]; then
  if [ -x build/kdtree ]; then BIN=build/kdtree
  else BIN=$(ls -t build*/kdtree 2>/dev/null | head -1); fi
fi
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
  echo "run_tests.sh: no kdtree executable (build it, or pass --bin PATH / set KDTREE_BIN)"
  echo "0 passed, 1 failed"
  exit 1
fi
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
OUT=${OUT:-$(dirname "$BIN")/server-test}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
TOOLS=${KDT_TOOLS_DIR:-$OUT/tools}
export KDT_MAX_TOKENS=${KDT_MAX_TOKENS:-24}
export KDT_CONC_SECONDS=${KDT_CONC_SECONDS:-10}

PASS=0
FAIL=0
ok() { PASS=$((PASS + 1)); echo "ok - $*"; }
bad() { FAIL=$((FAIL + 1)); echo "FAIL - $*"; }
# Adds the "N passed, N failed" of a sub-suite's output file.
add_counts() {
  local line
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -1)
  if [ -z "$line" ]; then bad "$2: no summary line (crashed?)"; return; fi
  PASS=$((PASS + $(echo "$line" | cut -d' ' -f1)))
  FAIL=$((FAIL + $(echo "$line" | cut -d' ' -f3)))
}

# ---- servers: started on port 0, always killed on exit ----------------------------------------
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM "$pid" 2>/dev/null
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -KILL "$pid" 2>/dev/null
    fi
  done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# start_server NAME ARGS...: sets PORT_<NAME> and PID_<NAME>; 0 on success.
start_server() {
  local name=$1; shift
  local log="$OUT/server_$name.log"
  "$BIN" serve --host 127.0.0.1 --port 0 "$@" >"$log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  local port=""
  for _ in $(seq 1200); do # model loading may take a while on CPU: up to 120 s
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$log" 2>/dev/null | grep -o '[0-9]*$')
    [ -n "$port" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$port" ]; then
    echo "--- $log"; tail -20 "$log"
    return 1
  fi
  printf -v "PORT_$name" '%s' "$port"
  printf -v "PID_$name" '%s' "$pid"
}

# ---- model ----------------------------------------------------------------------------------
MODEL=${KDT_SERVE_MODEL:-}
DRAFT=${KDT_SERVE_DRAFT:-}
if [ -z "$MODEL" ] && [ "$FORCE_MOCK$FORCE_RANDOM" = 00 ] && [ -d models ]; then
  for d in models/*/; do
    [ -f "$d/config.json" ] || continue
    case "$(basename "$d")" in
      *draft*|*dflash*) [ -z "$DRAFT" ] && DRAFT=${d%/} ;;
      *) [ -z "$MODEL" ] && MODEL=${d%/} ;;
    esac
  done
fi
RANDOM_MODEL=tests/fixtures/models/kimi_tiny
MODE=trained
if [ "$FORCE_RANDOM" = 1 ]; then MODE=random
elif [ "$FORCE_MOCK" = 1 ]; then MODE=mock
elif [ -z "$MODEL" ]; then
  if [ -f "$RANDOM_MODEL/config.json" ]; then MODE=random; else MODE=mock; fi
fi
case $MODE in
  random)
    MODEL_ARGS=(--model "$RANDOM_MODEL" --tokenizer bytes)
    echo "NOTE: serving the random test checkpoint $RANDOM_MODEL with the byte-level tokenizer"
    echo "      (--tokenizer bytes; no drafter, so ar only): no trained tiny pair under models/." ;;
  mock)
    MODEL_ARGS=(--model mock --mock-round-ms 2)
    echo "NOTE: every check runs against the built-in mock model (--model mock): the HTTP, SSE,"
    echo "      scheduling and metrics layers are tested; the engine itself is not." ;;
  *)
    MODEL_ARGS=(--model "$MODEL")
    [ -n "$DRAFT" ] && MODEL_ARGS+=(--draft "$DRAFT")
    echo "model: $MODEL${DRAFT:+ + drafter $DRAFT}" ;;
esac
echo "binary: $BIN"
echo "artifacts: $OUT"

MAX_BODY=262144
if start_server main "${MODEL_ARGS[@]}" --max-streams 8 --max-queue 64 --max-body-bytes $MAX_BODY \
     --served-model-name kdtree-test; then
  ok "server starts (port $PORT_main)"
else
  bad "server starts"; echo "$PASS passed, $FAIL failed"; exit 1
fi
if start_server small "${MODEL_ARGS[@]}" --max-streams 1 --max-queue 1 \
     --served-model-name kdtree-test; then
  ok "second server starts with --max-streams 1 --max-queue 1 (port $PORT_small)"
else
  bad "second server starts"
fi
BASE=http://127.0.0.1:$PORT_main

# ---- the Node client suite ------------------------------------------------------------------
NODE_OK=1
if ! command -v node >/dev/null; then
  bad "node is installed"; NODE_OK=0
elif [ ! -d tests/server/node_modules/openai ]; then
  echo "installing the test client (npm ci in tests/server)"
  if ! (cd tests/server && timeout 300 npm ci --no-audit --no-fund >"$OUT/npm.log" 2>&1); then
    bad "npm ci in tests/server (see $OUT/npm.log)"; NODE_OK=0
  fi
fi
if [ "$NODE_OK" = 1 ]; then
  KDT_BASE=$BASE KDT_BASE_SMALL=http://127.0.0.1:${PORT_small:-0} KDT_MAX_BODY=$MAX_BODY \
    timeout 900 node tests/server/client_test.mjs 2>&1 | tee "$OUT/client_test.out"
  add_counts "$OUT/client_test.out" "client_test.mjs"
fi

# ---- raw SSE framing with curl --------------------------------------------------------------
sse_check() {
  local hdr="$OUT/sse.headers" body="$OUT/sse.body" timing
  timing=$(timeout 120 curl -sN -D "$hdr" -o "$body" -w '%{http_code} %{time_starttransfer} %{time_total}' \
    -H 'Content-Type: application/json' "$BASE/v1/chat/completions" \
    -d '{"messages":[{"role":"user","content":"stream please"}],"stream":true,"max_tokens":200,
         "temperature":0,"stream_options":{"include_usage":true},"kdtree":{"ignore_eos":true}}')
  local code=${timing%% *}
  [ "$code" = 200 ] || { echo "status $code"; return 1; }
  grep -qi '^content-type: text/event-stream' "$hdr" || { echo "content-type"; cat "$hdr"; return 1; }
  grep -qi '^transfer-encoding: chunked' "$hdr" || { echo "not chunked"; return 1; }
  grep -qi '^cache-control: no-cache' "$hdr" || { echo "cache-control"; return 1; }
  # every event is one "data: " line followed by an empty line; nothing else
  awk 'BEGIN { want_blank = 0; bad = 0 }
       { if (want_blank) { if ($0 != "") bad = 1; want_blank = 0 }
         else if ($0 ~ /^data: /) want_blank = 1
         else if ($0 != "") bad = 1 }
       END { exit (bad || want_blank) }' "$body" || { echo "framing"; head -c 600 "$body"; return 1; }
  [ "$(grep -v '^$' "$body" | tail -1)" = "data: [DONE]" ] || { echo "last event is not [DONE]"; return 1; }
  [ "$(grep -c '^data: \[DONE\]$' "$body")" = 1 ] || { echo "[DONE] count"; return 1; }
  [ "$(tail -c 2 "$body" | od -An -c | tr -d ' ')" = '\n\n' ] || { echo "no blank line at the end"; return 1; }
  # every data line but [DONE] is JSON; the role comes first, usage last
  node -e '
    const fs = require("fs");
    const ev = fs.readFileSync(process.argv[1], "utf8").split("\n").filter((l) => l.startsWith("data: ") && l !== "data: [DONE]").map((l) => JSON.parse(l.slice(6)));
    if (ev[0].choices[0].delta.role !== "assistant") throw new Error("first delta has no role");
    const last = ev[ev.length - 1];
    if (!last.usage || last.choices.length !== 0) throw new Error("last event is not the usage chunk");
    if (last.usage.completion_tokens !== 200) throw new Error("usage " + JSON.stringify(last.usage));
    const fin = ev[ev.length - 2];
    if (fin.choices[0].finish_reason !== "length" || !fin.kdtree) throw new Error("final chunk");
    if (new Set(ev.map((e) => e.id)).size !== 1) throw new Error("ids differ");
  ' "$body" || return 1
  # events arrive as produced, not buffered to the end
  local ttfb total
  ttfb=$(echo "$timing" | cut -d' ' -f2); total=$(echo "$timing" | cut -d' ' -f3)
  awk -v a="$ttfb" -v b="$total" 'BEGIN { exit !(a < 0.5 * b || b < 0.05) }' ||
    { echo "first byte at $ttfb s of $total s: buffered?"; return 1; }
}
if msg=$(sse_check 2>&1); then ok "curl: SSE framing (data: lines, blank separators, [DONE], chunked, streamed as produced)"
else bad "curl: SSE framing: $msg"; fi

# non-streaming answers are plain JSON with a Content-Length
if hdrs=$(timeout 60 curl -s -D - -o /dev/null "$BASE/v1/completions" -H 'Content-Type: application/json' \
      -d '{"prompt":"x","max_tokens":2}') && echo "$hdrs" | grep -qi '^content-type: application/json' &&
   echo "$hdrs" | grep -qi '^content-length:'; then
  ok "curl: non-streaming answer is application/json with Content-Length"
else bad "curl: non-streaming headers: $hdrs"; fi

# ---- promtool check metrics -----------------------------------------------------------------
get_promtool() {
  local p
  p=$(command -v promtool 2>/dev/null) && { echo "$p"; return 0; }
  p="$TOOLS/prometheus/usr/bin/promtool"
  [ -x "$p" ] && { echo "$p"; return 0; }
  mkdir -p "$TOOLS"
  ( cd "$TOOLS" && rm -f prometheus_*.deb &&
    { timeout 300 apt-get download prometheus >/dev/null 2>&1 ||
      { timeout 300 apt-get update -qq >/dev/null 2>&1 && timeout 300 apt-get download prometheus >/dev/null 2>&1; }; } &&
    dpkg-deb -x prometheus_*.deb prometheus && rm -f prometheus_*.deb ) || return 1
  [ -x "$p" ] && echo "$p"
}
if PROMTOOL=$(get_promtool); then
  curl -s "$BASE/metrics" >"$OUT/metrics.txt"
  if out=$("$PROMTOOL" check metrics <"$OUT/metrics.txt" 2>&1); then
    ok "promtool check metrics accepts /metrics"
  else bad "promtool check metrics: $out"; fi
  if grep -q '^kdtree_kv_pages_used 0$' "$OUT/metrics.txt" && grep -q '^kdtree_active_streams 0$' "$OUT/metrics.txt"; then
    ok "/metrics: every KV page free once idle"
  else bad "/metrics: KV pages still in use: $(grep -E '^kdtree_(kv_pages|active)' "$OUT/metrics.txt" | tr '\n' ' ')"; fi
else
  bad "promtool: could not get it (apt-get download prometheus + dpkg-deb -x into $TOOLS)"
fi

# ---- the web chat page in headless chromium -------------------------------------------------
if [ "${KDT_SKIP_BROWSER:-0}" = 1 ]; then
  echo "skip - browser: KDT_SKIP_BROWSER=1"
elif [ "$NODE_OK" = 1 ]; then
  CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
  if [ -z "$CHROMIUM" ] && [ "$(id -u)" = 0 ]; then
    echo "installing chromium (apt-get install chromium)"
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends chromium \
      >"$OUT/apt-chromium.log" 2>&1 || { timeout 300 apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends chromium \
      >"$OUT/apt-chromium.log" 2>&1; }
    CHROMIUM=$(command -v chromium || true)
  fi
  if [ -z "$CHROMIUM" ]; then
    bad "browser: chromium is not installed (apt-get install chromium)"
  else
    KDT_BASE=$BASE KDT_CHROMIUM=$CHROMIUM KDT_SCREENSHOT="$OUT/chat_page.png" \
      timeout 240 node --experimental-websocket tests/server/browser_test.mjs 2>&1 | tee "$OUT/browser_test.out"
    add_counts "$OUT/browser_test.out" "browser_test.mjs"
  fi
fi

# ---- graceful shutdown ----------------------------------------------------------------------
# SIGTERM while a stream runs: the stream still completes, new requests are refused, exit 0.
shutdown_check() {
  local grace=$1 expect=$2 pid port body="$OUT/drain_$1.body"
  local slow=()
  [ "${MODEL_ARGS[1]}" = mock ] && slow=(--mock-round-ms 10)
  start_server "drain$grace" "${MODEL_ARGS[@]}" "${slow[@]}" --shutdown-grace "$grace" ||
    { echo "start"; return 1; }
  eval "pid=\$PID_drain$grace; port=\$PORT_drain$grace"
  local tokens=$3
  if [ "$tokens" = long ]; then # as long as the context allows
    tokens=$(curl -s "http://127.0.0.1:$port/health" | grep -o '"max_context":[0-9]*' | cut -d: -f2)
    tokens=$((tokens - 64))
  fi
  timeout 120 curl -sN "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"prompt\":\"a long story\",\"stream\":true,\"max_tokens\":$tokens,\"kdtree\":{\"ignore_eos\":true}}" \
    >"$body" &
  local curl_pid=$!
  for _ in $(seq 600); do [ -s "$body" ] && break; sleep 0.05; done
  [ -s "$body" ] || { echo "no first event"; kill "$curl_pid" 2>/dev/null; return 1; }
  kill -TERM "$pid"
  sleep 0.2
  local late
  late=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/v1/completions" \
         -H 'Content-Type: application/json' -d '{"prompt":"x","max_tokens":2}')
  case "$late" in 503|000) ;; *) echo "request during the drain got $late"; return 1 ;; esac
  wait "$curl_pid"
  local rc=1
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then echo "still running 30 s after SIGTERM"; return 1; fi
  wait "$pid"; rc=$?
  [ "$rc" = 0 ] || { echo "exit code $rc"; return 1; }
  [ "$(grep -v '^$' "$body" | tail -1)" = "data: [DONE]" ] || { echo "stream not closed with [DONE]"; return 1; }
  grep -q "$expect" "$body" || { echo "no $expect in the stream"; tail -c 400 "$body"; return 1; }
}
if msg=$(shutdown_check 30 '"finish_reason":"length"' 60 2>&1); then
  ok "SIGTERM drains: the running stream completes, new requests get 503, exit code 0"
else bad "graceful shutdown: $msg"; fi
if msg=$(shutdown_check 0 '"error"' long 2>&1); then
  ok "SIGTERM with --shutdown-grace 0: the running stream ends with an error event, exit code 0"
else bad "shutdown without grace: $msg"; fi

# ---- an engine that fails for good (the mock's injected device fault) ---------------------------
# The running request fails (500 or an error event), /health turns 503 engine_failed with the
# reason, later requests get 503 engine_failed, /metrics says kdtree_engine_failed 1.
fault_check() {
  start_server fault --model mock --mock-round-ms 1 --mock-fault-at-step 5 || { echo "start"; return 1; }
  local port=$PORT_fault code body
  code=$(curl -s -o "$OUT/fault_first.body" -w '%{http_code}' "http://127.0.0.1:$port/v1/completions" \
         -H 'Content-Type: application/json' -d '{"prompt":"a long story","max_tokens":200,"kdtree":{"ignore_eos":true}}')
  [ "$code" = 500 ] || { echo "the request the fault hit got $code"; return 1; }
  body=$(curl -s -w ' %{http_code}' "http://127.0.0.1:$port/health")
  case "$body" in *'"status":"engine_failed"'*'"error":"'*' 503') ;; *) echo "/health: $body"; return 1 ;; esac
  body=$(curl -s -w ' %{http_code}' "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
         -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":3}')
  case "$body" in *'"engine_failed"'*' 503') ;; *) echo "request after the fault: $body"; return 1 ;; esac
  curl -s "http://127.0.0.1:$port/metrics" | grep -qx 'kdtree_engine_failed 1' || { echo "no kdtree_engine_failed 1"; return 1; }
  kill -TERM "$PID_fault"; wait "$PID_fault" 2>/dev/null
  return 0
}
if msg=$(fault_check 2>&1); then
  ok "a failed device: the hit request 500, then /health 503 engine_failed and every request 503"
else bad "engine fault: $msg"; fi

# clients that connect and leave: bare TCP probes (what a load balancer's health check does) and
# a request cut off mid-header; the server keeps answering, and the log check below finds no line
if [ -n "${PORT_main:-}" ]; then
  for _ in 1 2 3; do
    (exec 3<>"/dev/tcp/127.0.0.1/$PORT_main") 2>/dev/null
    (exec 3<>"/dev/tcp/127.0.0.1/$PORT_main" && printf 'GET /health HTTP/1.1\r\nHo' >&3) 2>/dev/null
  done
  sleep 0.3
  if curl -fsS "$BASE/health" >/dev/null; then ok "bare TCP probes and cut-off requests: /health still answers"
  else bad "/health after bare TCP probes and cut-off requests"; fi
fi

# the two main servers stop cleanly too
for name in main small; do
  eval "pid=\${PID_$name:-}"
  [ -n "$pid" ] || continue
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then bad "server $name stops within 10 s of SIGTERM"
  else wait "$pid"; rc=$?; [ "$rc" = 0 ] && ok "server $name exits 0 on SIGTERM" || bad "server $name exit code $rc"; fi
done
# clients that went away (client_test's mid-stream and mid-wait aborts, the load's cancels, the
# probes above) are not errors: the main server's log names none (libmicrohttpd's lines included)
if lines=$(grep -E 'internal error|application error|connection closed|closed by remote side|Socket has been disconnected' \
             "$OUT/server_main.log"); then
  bad "the main server logged vanished clients as errors: $(echo "$lines" | head -3 | tr '\n' ' ')"
else ok "vanished clients leave no error lines in the server's log"; fi
if grep -l -E 'AddressSanitizer|ThreadSanitizer|runtime error:|LeakSanitizer' "$OUT"/server_*.log >/dev/null 2>&1; then
  bad "sanitizer reports in $(grep -l -E 'AddressSanitizer|ThreadSanitizer|runtime error:|LeakSanitizer' "$OUT"/server_*.log | tr '\n' ' ')"
fi

echo "$PASS passed, $FAIL failed"
[ "$FAIL" = 0 ]
