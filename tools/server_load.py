#!/usr/bin/env python3
"""server_load.py - the load generator of tests/server/load.mjs for hosts that have Python but no
Node (the GPU host): C concurrent clients send streaming requests back to back for a fixed time;
then time to first token (p50/p90), tokens/s per stream after the first token, aggregate tokens/s,
errors and the server's mean tau. Standard library only; a benchmark tool, never used by the engine.

usage: python3 tools/server_load.py --url http://127.0.0.1:8080 [--clients 64] [--seconds 30]
       [--max-tokens 128] [--chat] [--spec ddtree] [--budget 8] [--prompt TEXT] [--ignore-eos]
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse


def one(opt, host, port, client, n):
    text = opt.prompt or f"Client {client}, request {n}: tell me about trees."
    body = {"temperature": 0, "max_tokens": opt.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if opt.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    ext = {}
    if opt.spec:
        ext["spec"] = opt.spec
    if opt.budget:
        ext["budget"] = opt.budget
    if opt.ignore_eos:
        ext["ignore_eos"] = True
    if ext:
        body["kdtree"] = ext
    path = "/v1/chat/completions" if opt.chat else "/v1/completions"
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    t_first = t_last = 0.0
    tokens, tau = 0, None
    for raw in r:  # SSE: "data: {...}" lines separated by blank lines
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(ev["error"].get("message"))
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        if ev.get("kdtree"):
            tau = ev["kdtree"].get("tau")
        ch = (ev.get("choices") or [None])[0]
        piece = ch and ((ch.get("delta") or {}).get("content") if opt.chat else ch.get("text"))
        if piece:
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
    conn.close()
    return {"ttft": ((t_first or time.perf_counter()) - t0) * 1000, "tokens": tokens,
            "decode_s": t_last - t_first, "tau": tau}


def pct(xs, p):
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--spec")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--prompt")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json", action="store_true")
    opt = ap.parse_args()
    u = urllib.parse.urlparse(opt.url)
    results, errors, lock = [], [], threading.Lock()
    t_start = time.perf_counter()
    until = t_start + opt.seconds

    def client(c):
        n = 0
        while time.perf_counter() < until:
            try:
                res = one(opt, u.hostname, u.port or 80, c, n)
                with lock:
                    results.append(res)
            except Exception as e:  # a failed request is counted, the client goes on
                with lock:
                    errors.append(str(e))
            n += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(opt.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    total = sum(r["tokens"] for r in results)
    per_stream = [(r["tokens"] - 1) / r["decode_s"] for r in results if r["tokens"] > 1 and r["decode_s"] > 0]
    taus = [r["tau"] for r in results if r["tau"] is not None]
    s = {"clients": opt.clients, "seconds": round(wall, 2), "requests": len(results), "errors": len(errors),
         "tokens": total, "ttft_ms_p50": round(pct([r["ttft"] for r in results], 0.5), 1),
         "ttft_ms_p90": round(pct([r["ttft"] for r in results], 0.9), 1),
         "stream_tokens_per_s_p50": round(pct(per_stream, 0.5), 2),
         "stream_tokens_per_s_p10": round(pct(per_stream, 0.1), 2),
         "aggregate_tokens_per_s": round(total / wall, 1),
         "mean_tau": round(sum(taus) / len(taus), 3) if taus else None}
    if opt.json:
        print(json.dumps(s))
    else:
        print(f"load: {s['clients']} clients, {s['seconds']} s, {s['requests']} requests, "
              f"{s['errors']} errors, {s['tokens']} tokens")
        print(f"  time to first token   p50 {s['ttft_ms_p50']} ms   p90 {s['ttft_ms_p90']} ms")
        print(f"  tokens/s per stream   p50 {s['stream_tokens_per_s_p50']}   p10 {s['stream_tokens_per_s_p10']}")
        print(f"  aggregate tokens/s    {s['aggregate_tokens_per_s']}")
        print(f"  mean tau              {s['mean_tau']}")
    if errors:
        print("first errors: " + " | ".join(errors[:3]))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
