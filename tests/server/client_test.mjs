// client_test.mjs - end-to-end checks of a running `kdtree serve` through the official `openai`
// npm client and raw fetch: completions, chat, streaming, the kdtree extension, stop strings,
// every error status, 32 concurrent clients whose greedy answers equal the solo answers, no KV
// page left in use afterwards, a client that disconnects mid-stream freeing its pages, and 429
// with Retry-After when the queue is full.
//
// Environment (set by run_tests.sh):
//   KDT_BASE        http://127.0.0.1:PORT of the main server
//   KDT_BASE_SMALL  a second server started with --max-streams 1 --max-queue 1 (429 checks)
//   KDT_MAX_BODY    the main server's --max-body-bytes
//   KDT_MAX_TOKENS  answer length for the comparisons (default 24)
//   KDT_CONC_SECONDS how long the 32-client check keeps going (default 10; at least one round)
import OpenAI from 'openai';
import { reporter, assert, assertEq, postJson, metrics, waitMetrics, readSse, sleep,
         withTimeout } from './lib.mjs';

const BASE = process.env.KDT_BASE;
const BASE_SMALL = process.env.KDT_BASE_SMALL;
const MAX_BODY = Number(process.env.KDT_MAX_BODY || 65536);
const MAX_TOKENS = Number(process.env.KDT_MAX_TOKENS || 24);
const CONC_SECONDS = Number(process.env.KDT_CONC_SECONDS || 10);
const N_CLIENTS = 32;

const watchdog = setTimeout(() => { console.log('FAIL - client: watchdog: the suite took over 600 s'); process.exit(1); }, 600e3);
const t = reporter('client');
const client = new OpenAI({ baseURL: BASE + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 120e3 });
const health = await (await fetch(BASE + '/health')).json();
const MODEL = health.model;
const specs = health.draft ? ['ar', 'chain', 'ddtree', 'auto'] : ['ar'];
const longTokens = Math.max(8, Math.min(2000, health.max_context - 64));
console.log(`server: ${JSON.stringify(health)}`);

await t.check('GET /v1/models lists the served model', async () => {
  const list = await client.models.list();
  const ids = [];
  for await (const m of list) ids.push(m.id);
  assert(ids.includes(MODEL), `models: ${ids}`);
  const one = await client.models.retrieve(MODEL);
  assertEq(one.id, MODEL, 'retrieve');
});

let plainChat = null;
await t.check('chat completion (non-streaming): message, usage, finish_reason, kdtree.tau', async () => {
  const r = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Say something.' }], temperature: 0,
    max_tokens: MAX_TOKENS });
  assert(r.id.startsWith('chatcmpl-'), r.id);
  assertEq(r.object, 'chat.completion');
  assertEq(r.choices.length, 1);
  assertEq(r.choices[0].message.role, 'assistant');
  assert(typeof r.choices[0].message.content === 'string', 'content');
  assert(['stop', 'length'].includes(r.choices[0].finish_reason), r.choices[0].finish_reason);
  assert(r.usage.prompt_tokens > 0 && r.usage.completion_tokens >= 1 &&
         r.usage.completion_tokens <= MAX_TOKENS, JSON.stringify(r.usage));
  assertEq(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens, 'total');
  assert(typeof r.kdtree.tau === 'number' && r.kdtree.tau >= 0, JSON.stringify(r.kdtree));
  plainChat = r;
});

await t.check('chat completion streamed through the client equals the non-streamed answer', async () => {
  const stream = await client.chat.completions.create({
    model: MODEL, messages: [{ role: 'user', content: 'Say something.' }], temperature: 0,
    max_tokens: MAX_TOKENS, stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, ext = null, role = null, n = 0;
  for await (const chunk of stream) {
    n++;
    if (chunk.usage) usage = chunk.usage;
    if (chunk.kdtree) ext = chunk.kdtree;
    const c = chunk.choices[0];
    if (!c) continue;
    if (c.delta.role) role = c.delta.role;
    if (c.delta.content) text += c.delta.content;
    if (c.finish_reason) finish = c.finish_reason;
  }
  assertEq(role, 'assistant', 'first delta role');
  assertEq(text, plainChat.choices[0].message.content, 'streamed text');
  assertEq(finish, plainChat.choices[0].finish_reason, 'finish_reason');
  assert(usage && usage.completion_tokens === plainChat.usage.completion_tokens, JSON.stringify(usage));
  assert(ext && typeof ext.tau === 'number', 'kdtree extension on the final chunk');
  assert(n >= 2, 'chunks');
});

let plainText = null;
await t.check('text completion, streamed and not, agree', async () => {
  const r = await client.completions.create({ model: MODEL, prompt: 'Once upon a time',
    temperature: 0, max_tokens: MAX_TOKENS });
  assert(r.id.startsWith('cmpl-'), r.id);
  assertEq(r.object, 'text_completion');
  assert(typeof r.choices[0].text === 'string');
  plainText = r.choices[0].text;
  const s = await client.completions.create({ model: MODEL, prompt: 'Once upon a time',
    temperature: 0, max_tokens: MAX_TOKENS, stream: true });
  let text = '';
  for await (const chunk of s) if (chunk.choices[0]) text += chunk.choices[0].text;
  assertEq(text, plainText, 'streamed text');
  const ids = await client.completions.create({ model: MODEL, prompt: [1, 2, 3], max_tokens: 2,
    temperature: 0 });
  assertEq(ids.usage.prompt_tokens, 3, 'prompt as token ids');
});

await t.check('kdtree extension: ignore_eos gives exactly max_tokens, spec and budget echoed', async () => {
  for (const spec of specs) {
    const r = await postJson(BASE, '/v1/completions', { model: MODEL, prompt: 'abc',
      temperature: 0, max_tokens: 12, kdtree: { spec, budget: 4, ignore_eos: true } });
    assertEq(r.status, 200, r.text);
    assertEq(r.json.usage.completion_tokens, 12, `${spec} completion_tokens`);
    assertEq(r.json.choices[0].finish_reason, 'length');
    assertEq(r.json.kdtree.spec, spec);
    assertEq(r.json.kdtree.budget, 4);
    assert(r.json.kdtree.tau >= 1, `tau ${r.json.kdtree.tau}`);
  }
});

await t.check('stop strings truncate the answer (plain and streamed)', async () => {
  const body = { model: MODEL, prompt: 'The list:', temperature: 0, max_tokens: 48,
                 kdtree: { ignore_eos: true } };
  const full = (await postJson(BASE, '/v1/completions', body)).json.choices[0].text;
  const cps = Array.from(full);
  assert(cps.length >= 8, `answer too short to pick a stop string: ${JSON.stringify(full)}`);
  const mid = Math.floor(cps.length / 2);
  const stop = cps.slice(mid, mid + 3).join('');
  const want = full.slice(0, full.indexOf(stop));
  const r = await postJson(BASE, '/v1/completions', { ...body, stop: ['@@never@@', stop] });
  assertEq(r.json.choices[0].text, want, `stop ${JSON.stringify(stop)}`);
  assertEq(r.json.choices[0].finish_reason, 'stop');
  assert(r.json.usage.completion_tokens < 48, 'tokens after the stop are not generated');
  const s = await client.completions.create({ ...body, stop, stream: true });
  let text = '', finish = null;
  for await (const chunk of s) {
    if (!chunk.choices[0]) continue;
    text += chunk.choices[0].text;
    finish = chunk.choices[0].finish_reason || finish;
  }
  assertEq(text, want, 'streamed');
  assertEq(finish, 'stop');
});

await t.check('the client maps errors: 404 unknown model, 400 for n=2', async () => {
  let e = null;
  try { await client.chat.completions.create({ model: 'no-such-model', messages: [{ role: 'user', content: 'x' }] }); } catch (x) { e = x; }
  assert(e && e.status === 404, `status ${e && e.status}`);
  assertEq(e.error && e.error.code, 'model_not_found');
  e = null;
  try { await client.chat.completions.create({ model: MODEL, n: 2, messages: [{ role: 'user', content: 'x' }] }); } catch (x) { e = x; }
  assert(e && e.status === 400, `status ${e && e.status}`);
  assertEq(e.error && e.error.param, 'n');
});

await t.check('bad requests get their status and an OpenAI error body', async () => {
  const huge = 'word '.repeat(Math.min(200000, MAX_BODY / 8));
  const cases = [
    ['malformed JSON', '/v1/completions', 'POST', '{"prompt": ', 400, null],
    ['body not an object', '/v1/chat/completions', 'POST', '[]', 400, null],
    ['prompt wrong type', '/v1/completions', 'POST', { prompt: 5 }, 400, 'prompt'],
    ['messages missing', '/v1/chat/completions', 'POST', { model: MODEL }, 400, 'messages'],
    ['role unknown', '/v1/chat/completions', 'POST', { messages: [{ role: 'tool', content: 'x' }] }, 400, 'messages[0].role'],
    ['max_tokens wrong type', '/v1/completions', 'POST', { prompt: 'x', max_tokens: 'many' }, 400, 'max_tokens'],
    ['temperature out of range', '/v1/completions', 'POST', { prompt: 'x', temperature: 9 }, 400, 'temperature'],
    ['stop wrong type', '/v1/completions', 'POST', { prompt: 'x', stop: [1] }, 400, 'stop'],
    ['n = 3', '/v1/completions', 'POST', { prompt: 'x', n: 3 }, 400, 'n'],
    ['kdtree.spec unknown', '/v1/completions', 'POST', { prompt: 'x', kdtree: { spec: 'beam' } }, 400, 'kdtree.spec'],
    ['kdtree.budget too large', '/v1/completions', 'POST', { prompt: 'x', kdtree: { budget: 100000 } }, 400, 'kdtree.budget'],
    ['unknown model', '/v1/completions', 'POST', { model: 'gpt-5', prompt: 'x' }, 404, 'model'],
    ['prompt over the context', '/v1/completions', 'POST', { prompt: huge }, 400, 'prompt'],
    ['max_tokens over the context', '/v1/completions', 'POST', { prompt: 'x', max_tokens: 100000000 }, 400, 'max_tokens'],
    ['body over --max-body-bytes', '/v1/completions', 'POST', { prompt: 'y'.repeat(MAX_BODY + 10) }, 413, null],
    ['unknown route', '/v1/embeddings', 'POST', { input: 'x' }, 404, null],
    ['unknown route (GET)', '/nope', 'GET', null, 404, null],
    ['wrong method on a POST route', '/v1/chat/completions', 'GET', null, 405, null],
    ['wrong method on a GET route', '/metrics', 'POST', '{}', 405, null],
    ['unknown model id', '/v1/models/nope', 'GET', null, 404, 'model'],
  ];
  const bad = [];
  for (const [name, path, method, body, status, param] of cases) {
    const init = { method };
    if (body !== null) {
      init.body = typeof body === 'string' ? body : JSON.stringify(body);
      init.headers = { 'Content-Type': 'application/json' };
    }
    const r = await fetch(BASE + path, init);
    const text = await r.text();
    let j = null;
    try { j = JSON.parse(text); } catch { /* checked below */ }
    const shapeOk = j && j.error && typeof j.error.message === 'string' && j.error.message &&
      typeof j.error.type === 'string' && 'param' in j.error && 'code' in j.error;
    if (r.status !== status || !shapeOk || (param !== null && j.error.param !== param))
      bad.push(`${name}: ${r.status} ${text.slice(0, 160)}`);
    if (status === 405 && !r.headers.get('allow')) bad.push(`${name}: no Allow header`);
  }
  assert(bad.length === 0, bad.join(' || '));
});

// ---- 32 concurrent clients, greedy answers equal to the solo ones ----
function concurrentRequests() {
  const reqs = [];
  for (let i = 0; i < N_CLIENTS; i++) {
    const spec = specs[i % specs.length];
    const common = { model: MODEL, temperature: 0, max_tokens: MAX_TOKENS - (i % 5),
                     kdtree: { spec, budget: 1 + (i % 16) } };
    if (i % 2) reqs.push({ kind: 'chat', stream: (i >> 1) % 2 === 1, body: { ...common,
      messages: [{ role: 'system', content: 'You are client ' + i }, { role: 'user', content: `Question ${i}: count to ${i}.` }] } });
    else reqs.push({ kind: 'text', stream: (i >> 1) % 2 === 1, body: { ...common, prompt: `Prompt ${i}:` + ' and'.repeat(i) } });
  }
  return reqs;
}

async function runOne(req) {
  if (req.kind === 'chat') {
    if (!req.stream) {
      const r = await client.chat.completions.create(req.body);
      return { text: r.choices[0].message.content, finish: r.choices[0].finish_reason, n: r.usage.completion_tokens };
    }
    const s = await client.chat.completions.create({ ...req.body, stream: true, stream_options: { include_usage: true } });
    let text = '', finish = null, n = null;
    for await (const c of s) {
      if (c.usage) n = c.usage.completion_tokens;
      if (c.choices[0]) { text += c.choices[0].delta.content || ''; finish = c.choices[0].finish_reason || finish; }
    }
    return { text, finish, n };
  }
  if (!req.stream) {
    const r = await client.completions.create(req.body);
    return { text: r.choices[0].text, finish: r.choices[0].finish_reason, n: r.usage.completion_tokens };
  }
  const s = await client.completions.create({ ...req.body, stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, n = null;
  for await (const c of s) {
    if (c.usage) n = c.usage.completion_tokens;
    if (c.choices[0]) { text += c.choices[0].text; finish = c.choices[0].finish_reason || finish; }
  }
  return { text, finish, n };
}

await t.check(`${N_CLIENTS} concurrent clients for ${CONC_SECONDS} s: zero errors, answers equal the solo answers, no KV page leaked`, async () => {
  const reqs = concurrentRequests();
  const solo = [];
  for (const r of reqs) solo.push(await runOne(r));
  const until = Date.now() + CONC_SECONDS * 1000;
  let rounds = 0, answers = 0;
  const errors = [];
  do {
    const results = await Promise.allSettled(reqs.map((r) => runOne(r)));
    results.forEach((res, i) => {
      if (res.status === 'rejected') errors.push(`client ${i}: ${res.reason}`);
      else {
        answers++;
        const a = res.value, b = solo[i];
        if (a.text !== b.text || a.finish !== b.finish || a.n !== b.n)
          errors.push(`client ${i}: ${JSON.stringify(a)} != solo ${JSON.stringify(b)}`);
      }
    });
    rounds++;
  } while (Date.now() < until && errors.length === 0);
  console.log(`  ${rounds} rounds, ${answers} answers`);
  assert(errors.length === 0, errors.slice(0, 4).join(' || '));
  await waitMetrics(BASE, 5000, 'engine empty after the load', (m) =>
    m.kdtree_kv_pages_used === 0 && m.kdtree_active_streams === 0 && m.kdtree_queue_depth === 0);
});

await t.check('a client that disconnects mid-stream frees its KV pages', async () => {
  const before = await metrics(BASE);
  const ac = new AbortController();
  const resp = await fetch(BASE + '/v1/completions', { method: 'POST', signal: ac.signal,
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ model: MODEL, prompt: 'a long story', stream: true,
                           max_tokens: longTokens, kdtree: { ignore_eos: true } }) });
  assertEq(resp.status, 200);
  let third;
  const gotThree = new Promise((r) => { third = r; });
  const reading = readSse(resp, { onEvent: (_, n) => { if (n === 3) third(); } }).catch(() => null);
  await withTimeout(60000, 'first events', () => gotThree);
  const during = await metrics(BASE);
  assert(during.kdtree_kv_pages_used > 0, 'pages in use while streaming');
  ac.abort();
  await reading;
  await waitMetrics(BASE, 5000, 'pages freed after the disconnect', (m) =>
    m.kdtree_kv_pages_used === 0 && m.kdtree_active_streams === 0 &&
    m.kdtree_streams_cancelled_total >= before.kdtree_streams_cancelled_total + 1);
});

await t.check('a client that gives up on a non-streaming answer frees its KV pages', async () => {
  const before = await metrics(BASE);
  const ac = new AbortController();
  const pending = fetch(BASE + '/v1/completions', { method: 'POST', signal: ac.signal,
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ model: MODEL, prompt: 'a long story', max_tokens: longTokens,
                           kdtree: { ignore_eos: true } }) }).catch(() => null);
  await waitMetrics(BASE, 60000, 'the request decoding', (m) => m.kdtree_kv_pages_used > 0);
  ac.abort(); /* what a client's timeout does; run_tests.sh then finds no error line in the log */
  await pending;
  await waitMetrics(BASE, 5000, 'pages freed after the client gave up', (m) =>
    m.kdtree_kv_pages_used === 0 && m.kdtree_active_streams === 0 &&
    m.kdtree_streams_cancelled_total >= before.kdtree_streams_cancelled_total + 1);
});

await t.check('queue full: 429 with Retry-After, and the queue drains after cancels', async () => {
  assert(BASE_SMALL, 'KDT_BASE_SMALL is not set');
  const small = (await (await fetch(BASE_SMALL + '/health')).json());
  const longBody = JSON.stringify({ prompt: 'a long story', stream: true,
    max_tokens: Math.max(8, Math.min(2000, small.max_context - 64)), kdtree: { ignore_eos: true } });
  const acA = new AbortController(), acB = new AbortController();
  const a = await fetch(BASE_SMALL + '/v1/completions', { method: 'POST', body: longBody,
    headers: { 'Content-Type': 'application/json' }, signal: acA.signal });
  assertEq(a.status, 200, 'A admitted');
  // read A in the background (keeping its connection open) until it is aborted
  const drainA = readSse(a).catch(() => null);
  await waitMetrics(BASE_SMALL, 5000, 'A running', (m) => m.kdtree_active_streams === 1);
  // B waits for the only stream slot: its response does not come until A ends
  const b = fetch(BASE_SMALL + '/v1/completions', { method: 'POST', body: longBody,
    headers: { 'Content-Type': 'application/json' }, signal: acB.signal }).catch((e) => e);
  await waitMetrics(BASE_SMALL, 5000, 'B queued', (m) => m.kdtree_queue_depth === 1);
  const c = await postJson(BASE_SMALL, '/v1/completions', { prompt: 'x', max_tokens: 2 });
  assertEq(c.status, 429, c.text);
  assert(Number(c.headers.get('retry-after')) > 0, 'Retry-After header');
  assertEq(c.json.error.type, 'rate_limit_error');
  acA.abort();
  await drainA;
  const bResp = await withTimeout(30000, 'B admitted after A left', () => b);
  assertEq(bResp.status, 200, 'B');
  acB.abort();
  await waitMetrics(BASE_SMALL, 5000, 'small server empty', (m) =>
    m.kdtree_kv_pages_used === 0 && m.kdtree_active_streams === 0 && m.kdtree_queue_depth === 0);
});

await t.check('/health and /metrics answer', async () => {
  const h = await (await fetch(BASE + '/health')).json();
  assertEq(h.status, 'ok');
  const m = await metrics(BASE);
  assert(m['kdtree_http_requests_total{endpoint="/v1/chat/completions",status="200"}'] > 0, 'chat 200 counted');
  assert(m['kdtree_http_requests_total{endpoint="/v1/completions",status="413"}'] >= 1, '413 counted');
  assert(m.kdtree_generation_tokens_total > 0 && m.kdtree_prompt_tokens_total > 0, 'token counters');
  assert(m.kdtree_accepted_length_count > 0, 'tau histogram');
});

clearTimeout(watchdog);
t.done();
