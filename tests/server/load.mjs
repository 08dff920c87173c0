// load.mjs - a small load generator for `kdtree serve`: C concurrent clients, each sending
// streaming requests back to back for a fixed time, then a summary of what a user sees:
// time to first token (p50/p90), tokens/s per stream (after the first token: decode speed as a
// client sees it), aggregate tokens/s, errors, and the server's mean tau from the responses.
//
// usage: node tests/server/load.mjs --url http://127.0.0.1:8080 [--clients 32] [--seconds 30]
//        [--max-tokens 64] [--chat] [--spec ddtree] [--budget 32] [--prompt TEXT]
//        [--ignore-eos] [--json]
// Greedy (temperature 0). With --ignore-eos every answer is exactly --max-tokens long, which
// makes runs comparable across models and modes.
const args = process.argv.slice(2);
const opt = { url: 'http://127.0.0.1:8080', clients: 32, seconds: 30, maxTokens: 64, chat: false,
              spec: null, budget: null, prompt: null, ignoreEos: false, json: false };
for (let i = 0; i < args.length; i++) {
  const a = args[i], v = args[i + 1];
  switch (a) {
    case '--url': opt.url = v; i++; break;
    case '--clients': opt.clients = Number(v); i++; break;
    case '--seconds': opt.seconds = Number(v); i++; break;
    case '--max-tokens': opt.maxTokens = Number(v); i++; break;
    case '--spec': opt.spec = v; i++; break;
    case '--budget': opt.budget = Number(v); i++; break;
    case '--prompt': opt.prompt = v; i++; break;
    case '--chat': opt.chat = true; break;
    case '--ignore-eos': opt.ignoreEos = true; break;
    case '--json': opt.json = true; break;
    default:
      console.error(`load.mjs: unknown argument ${a}\n` +
        'usage: node load.mjs --url URL [--clients N] [--seconds S] [--max-tokens N] [--chat] ' +
        '[--spec ar|chain|ddtree|auto] [--budget B] [--prompt TEXT] [--ignore-eos] [--json]');
      process.exit(2);
  }
}

function body(clientIdx, n) {
  const b = { temperature: 0, max_tokens: opt.maxTokens, stream: true,
              stream_options: { include_usage: true } };
  const text = opt.prompt || `Client ${clientIdx}, request ${n}: tell me about trees.`;
  if (opt.chat) b.messages = [{ role: 'user', content: text }];
  else b.prompt = text;
  const ext = {};
  if (opt.spec) ext.spec = opt.spec;
  if (opt.budget) ext.budget = opt.budget;
  if (opt.ignoreEos) ext.ignore_eos = true;
  if (Object.keys(ext).length) b.kdtree = ext;
  return JSON.stringify(b);
}

// One streamed request: { ttft, tokens, decodeSeconds, tau } or throws.
async function one(clientIdx, n) {
  const t0 = performance.now();
  const r = await fetch(opt.url + (opt.chat ? '/v1/chat/completions' : '/v1/completions'), {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: body(clientIdx, n) });
  if (r.status !== 200) throw new Error(`HTTP ${r.status}: ${(await r.text()).slice(0, 200)}`);
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = '', tFirst = 0, tLast = 0, tokens = 0, tau = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const line = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (!line.startsWith('data: ') || line === 'data: [DONE]') continue;
      const ev = JSON.parse(line.slice(6));
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) tokens = ev.usage.completion_tokens;
      if (ev.kdtree) tau = ev.kdtree.tau;
      const c = ev.choices && ev.choices[0];
      const piece = c && (opt.chat ? c.delta && c.delta.content : c.text);
      if (piece) {
        const now = performance.now();
        if (!tFirst) tFirst = now;
        tLast = now;
      }
    }
  }
  return { ttft: (tFirst || performance.now()) - t0, tokens, decodeSeconds: (tLast - tFirst) / 1000, tau };
}

const pct = (xs, p) => {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(p * s.length))];
};

const results = [], errors = [];
const tStart = performance.now();
const until = tStart + opt.seconds * 1000;
await Promise.all(Array.from({ length: opt.clients }, async (_, c) => {
  for (let n = 0; performance.now() < until; n++) {
    try { results.push(await one(c, n)); } catch (e) { errors.push(String(e.message || e)); }
  }
}));
const wall = (performance.now() - tStart) / 1000;
const totalTokens = results.reduce((s, r) => s + r.tokens, 0);
const perStream = results.filter((r) => r.tokens > 1 && r.decodeSeconds > 0)
  .map((r) => (r.tokens - 1) / r.decodeSeconds);
const taus = results.filter((r) => r.tau != null).map((r) => r.tau);
const summary = {
  clients: opt.clients, seconds: Number(wall.toFixed(2)), requests: results.length,
  errors: errors.length, tokens: totalTokens,
  ttft_ms_p50: Number(pct(results.map((r) => r.ttft), 0.5).toFixed(1)),
  ttft_ms_p90: Number(pct(results.map((r) => r.ttft), 0.9).toFixed(1)),
  stream_tokens_per_s_p50: Number(pct(perStream, 0.5).toFixed(2)),
  stream_tokens_per_s_p10: Number(pct(perStream, 0.1).toFixed(2)),
  aggregate_tokens_per_s: Number((totalTokens / wall).toFixed(1)),
  mean_tau: taus.length ? Number((taus.reduce((a, b) => a + b, 0) / taus.length).toFixed(3)) : null,
};
if (opt.json) {
  console.log(JSON.stringify(summary));
} else {
  console.log(`load: ${summary.clients} clients, ${summary.seconds} s, ${summary.requests} requests, ` +
              `${summary.errors} errors, ${summary.tokens} tokens`);
  console.log(`  time to first token   p50 ${summary.ttft_ms_p50} ms   p90 ${summary.ttft_ms_p90} ms`);
  console.log(`  tokens/s per stream   p50 ${summary.stream_tokens_per_s_p50}   p10 ${summary.stream_tokens_per_s_p10}`);
  console.log(`  aggregate tokens/s    ${summary.aggregate_tokens_per_s}`);
  console.log(`  mean tau              ${summary.mean_tau}`);
}
if (errors.length) {
  console.error(`first errors: ${errors.slice(0, 3).join(' | ')}`);
  process.exitCode = 1;
}
