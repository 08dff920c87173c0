// lib.mjs - helpers shared by the server's Node tests: a tiny reporter that prints
// "ok - name" / "FAIL - name: why" and a final "N passed, N failed" line, HTTP helpers, the
// /metrics parser, and bounded waiting.

export function reporter(suite) {
  let passed = 0, failed = 0;
  const t0 = Date.now();
  return {
    async check(name, fn) {
      try {
        await fn();
        passed++;
        console.log(`ok - ${suite}: ${name}`);
      } catch (e) {
        failed++;
        console.log(`FAIL - ${suite}: ${name}: ${e && e.stack ? e.stack.split('\n').slice(0, 3).join(' | ') : e}`);
      }
    },
    done() {
      console.log(`${suite}: ${((Date.now() - t0) / 1000).toFixed(1)} s`);
      console.log(`${passed} passed, ${failed} failed`);
      process.exitCode = failed ? 1 : 0;
      return failed;
    },
  };
}

export function assert(cond, msg) {
  if (!cond) throw new Error(msg || 'assertion failed');
}

export function assertEq(a, b, msg) {
  if (a !== b) throw new Error(`${msg || 'not equal'}: ${JSON.stringify(a)} !== ${JSON.stringify(b)}`);
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Rejects when fn takes longer than ms.
export async function withTimeout(ms, what, fn) {
  let timer;
  const t = new Promise((_, rej) => { timer = setTimeout(() => rej(new Error(`${what}: timed out after ${ms} ms`)), ms); });
  try {
    return await Promise.race([fn(), t]);
  } finally {
    clearTimeout(timer);
  }
}

export async function postJson(base, path, body, init = {}) {
  const r = await fetch(base + path, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: typeof body === 'string' ? body : JSON.stringify(body), ...init,
  });
  const text = await r.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: r.status, headers: r.headers, text, json };
}

// Parses a Prometheus text page into { 'name{labels}': value }.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

export async function metrics(base) {
  const r = await fetch(base + '/metrics');
  return parseMetrics(await r.text());
}

// Polls /metrics until pred(m) holds; returns the last sample or throws after ms.
export async function waitMetrics(base, ms, what, pred) {
  const until = Date.now() + ms;
  let m;
  while (Date.now() < until) {
    m = await metrics(base);
    if (pred(m)) return m;
    await sleep(50);
  }
  throw new Error(`${what}: not reached within ${ms} ms (kv used ${m && m.kdtree_kv_pages_used}, active ${m && m.kdtree_active_streams}, queued ${m && m.kdtree_queue_depth})`);
}

// Reads an SSE response body fully; returns the parsed data events and the raw text.
export async function readSse(resp, { onEvent, maxEvents } = {}) {
  const reader = resp.body.getReader();
  const dec = new TextDecoder();
  let buf = '', raw = '';
  const events = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    const s = dec.decode(value, { stream: true });
    buf += s;
    raw += s;
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (block.startsWith(':')) continue; // keep-alive comment
      events.push(block);
      if (onEvent) onEvent(block, events.length);
      if (maxEvents && events.length >= maxEvents) {
        await reader.cancel();
        return { events, raw, rest: buf };
      }
    }
  }
  return { events, raw, rest: buf };
}
