#!/usr/bin/env python3
"""prefill_stall.py - how long a long prompt's prefill stalls a stream that is already decoding.

One client streams a long greedy completion; after its first --after chunks a second client sends
a long prompt. Prints the streaming client's median gap between SSE chunks, its largest gap after
the long prompt arrived (the stall), and the long request's total time. Run it against a server
started with and without --max-prefill-tokens to see the trade. Standard library only; a
benchmark tool, never used by the engine.

usage: python3 tools/prefill_stall.py --url http://127.0.0.1:8080 [--long-words 540] [--after 50]
       [--max-tokens 400]
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse


def post(host, port, body):
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    return c.getresponse()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--long-words", type=int, default=540, help="words in the long prompt")
    ap.add_argument("--after", type=int, default=50, help="chunks streamed before the long prompt is sent")
    ap.add_argument("--max-tokens", type=int, default=400, help="the streaming request's tokens")
    opt = ap.parse_args()
    u = urllib.parse.urlparse(opt.url)
    host, port = u.hostname, u.port or 80
    words = "the quick brown fox jumps over the lazy dog".split()
    long_prompt = " ".join(words[i % len(words)] for i in range(opt.long_words))
    long_time = []

    def long_request():
        t0 = time.time()
        r = post(host, port, {"prompt": long_prompt, "max_tokens": 8, "temperature": 0})
        body = json.loads(r.read())
        if "error" in body:
            raise SystemExit(f"long request refused: {body['error'].get('message')}")
        long_time.append(time.time() - t0)

    r = post(host, port, {"prompt": "Once upon a time", "max_tokens": opt.max_tokens, "temperature": 0,
                          "stream": True, "kdtree": {"spec": "ar", "ignore_eos": True}})
    if r.status != 200:
        raise SystemExit(f"streaming request: HTTP {r.status}: {r.read()[:200]!r}")
    times, sent_at, worker = [], None, None
    while True:
        line = r.fp.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        times.append(time.time())
        if len(times) == opt.after:
            worker = threading.Thread(target=long_request)
            worker.start()
            sent_at = time.time()
        if line.strip() == b"data: [DONE]":
            break
    if worker is None:
        raise SystemExit(f"the stream ended after {len(times)} chunks, before --after {opt.after}")
    worker.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    stall = max(g for t, g in zip(times[1:], gaps) if t >= sent_at)
    print(f"stream: {len(times)} chunks, median gap {sorted(gaps)[len(gaps) // 2] * 1e3:.1f} ms, "
          f"largest gap after the long prompt arrived {stall * 1e3:.1f} ms; "
          f"long request {long_time[0] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
