// browser_test.mjs - the web chat page at / in headless Debian chromium, driven through the Chrome
// DevTools protocol (Node's WebSocket; run with `node --experimental-websocket` on Node 20).
// The page is opened as /?prompt=...&autosend=1; the test polls window.kdtChat until the answer
// has streamed, checks it equals the same request answered by the API (greedy), and saves a
// screenshot.
//
// Environment: KDT_BASE (server), KDT_CHROMIUM (default /usr/bin/chromium), KDT_SCREENSHOT (PNG
// path to write), KDT_MAX_TOKENS must match the page's default only through the request it sends
// (the page sends temperature 0 and max_tokens 256; the API request below does the same).
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { reporter, assert, assertEq, postJson, sleep, withTimeout } from './lib.mjs';

const BASE = process.env.KDT_BASE;
const CHROMIUM = process.env.KDT_CHROMIUM || '/usr/bin/chromium';
const SHOT = process.env.KDT_SCREENSHOT || path.join(os.tmpdir(), 'kdtree_chat_page.png');
const PROMPT = 'Hello from the browser test';
const t = reporter('browser');

if (typeof WebSocket === 'undefined') {
  console.log('FAIL - browser: no WebSocket in this Node (run with --experimental-websocket)');
  console.log('0 passed, 1 failed');
  process.exit(1);
}

const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'kdtree-chromium-'));
const chrome = spawn(CHROMIUM, [
  '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-quic',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
  '--disable-dev-shm-usage', '--window-size=1100,800', `--user-data-dir=${profile}`,
  '--remote-debugging-port=0', 'about:blank'],
  // detached: chromium gets its own process group, so cleanup can signal its
  // helper processes too (they keep writing into the profile after the main
  // process exits, which made removing the profile fail with ENOTEMPTY)
  { stdio: ['ignore', 'ignore', 'pipe'], detached: true });
let chromeErr = '';
chrome.stderr.on('data', (d) => { chromeErr = (chromeErr + d).slice(-4000); });
// never leave a browser behind: run_tests.sh's `timeout` sends SIGTERM
function killChromeGroup(sig) {
  try { process.kill(-chrome.pid, sig); } catch { /* group already gone */ }
}
// A leftover temp profile is not a test failure; say so and go on.
function removeProfile() {
  try {
    fs.rmSync(profile, { recursive: true, force: true, maxRetries: 20, retryDelay: 100 });
  } catch (e) {
    console.log(`# note: could not remove ${profile}: ${e.code || e.message}`);
  }
}
for (const sig of ['SIGTERM', 'SIGINT']) {
  process.on(sig, () => {
    killChromeGroup('SIGKILL');
    removeProfile();
    process.exit(1);
  });
}
const watchdog = setTimeout(() => {
  console.log('FAIL - browser: watchdog: over 180 s');
  killChromeGroup('SIGKILL');
  process.exit(1);
}, 180e3);

// A minimal CDP client over one WebSocket.
function cdp(url) {
  const ws = new WebSocket(url);
  let next = 1;
  const pending = new Map();
  ws.onmessage = (ev) => {
    const msg = JSON.parse(ev.data);
    if (msg.id && pending.has(msg.id)) {
      const { resolve, reject } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) reject(new Error(JSON.stringify(msg.error)));
      else resolve(msg.result);
    }
  };
  const opened = new Promise((resolve, reject) => { ws.onopen = resolve; ws.onerror = () => reject(new Error('CDP websocket error')); });
  return {
    opened,
    send(method, params = {}) {
      const id = next++;
      ws.send(JSON.stringify({ id, method, params }));
      return new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
    },
    close() { ws.close(); },
  };
}

let page = null;
try {
  let devtoolsPort = null;
  await t.check('chromium starts headless with remote debugging', async () => {
    const file = path.join(profile, 'DevToolsActivePort');
    await withTimeout(30000, 'DevToolsActivePort', async () => {
      while (!fs.existsSync(file) || fs.readFileSync(file, 'utf8').split('\n').length < 2) {
        if (chrome.exitCode !== null) throw new Error('chromium exited: ' + chromeErr);
        await sleep(100);
      }
    });
    devtoolsPort = Number(fs.readFileSync(file, 'utf8').split('\n')[0]);
    assert(devtoolsPort > 0, 'port');
  });

  await t.check('the chat page streams an answer equal to the API answer', async () => {
    assert(devtoolsPort, 'no devtools port');
    const targets = await (await fetch(`http://127.0.0.1:${devtoolsPort}/json/list`)).json();
    const target = targets.find((x) => x.type === 'page');
    assert(target, 'no page target');
    page = cdp(target.webSocketDebuggerUrl);
    await withTimeout(10000, 'CDP connect', () => page.opened);
    await page.send('Page.enable');
    await page.send('Runtime.enable');
    const url = `${BASE}/?autosend=1&prompt=${encodeURIComponent(PROMPT)}`;
    await page.send('Page.navigate', { url });
    let st = null;
    let sawStreaming = false;
    await withTimeout(120000, 'answer', async () => {
      for (;;) {
        const r = await page.send('Runtime.evaluate', {
          expression: 'JSON.stringify(window.kdtChat || null)', returnByValue: true });
        st = JSON.parse(r.result.value || 'null');
        if (st && st.state === 'streaming') sawStreaming = true;
        if (st && (st.state === 'done' || st.state === 'error')) return;
        await sleep(100);
      }
    });
    assertEq(st.state, 'done', `page state (error: ${st.error})`);
    assert(st.stats && st.stats.finish, 'stats shown');
    const api = await postJson(BASE, '/v1/chat/completions', {
      messages: [{ role: 'user', content: PROMPT }], temperature: 0, max_tokens: 256 });
    assertEq(api.status, 200, api.text);
    assertEq(st.lastAnswer, api.json.choices[0].message.content, 'page answer vs API answer');
    assert(st.lastAnswer.length > 0, 'empty answer');
    assert(sawStreaming || st.chunks >= 1, 'the answer arrived in chunks');
    const dom = await page.send('Runtime.evaluate', {
      expression: 'document.querySelector(".msg.assistant .text").textContent', returnByValue: true });
    assertEq(dom.result.value, st.lastAnswer, 'the answer is on the page');
  });

  await t.check(`a screenshot is saved (${SHOT})`, async () => {
    assert(page, 'no page');
    const shot = await page.send('Page.captureScreenshot', { format: 'png' });
    fs.mkdirSync(path.dirname(SHOT), { recursive: true });
    fs.writeFileSync(SHOT, Buffer.from(shot.data, 'base64'));
    assert(fs.statSync(SHOT).size > 1000, 'screenshot too small');
  });
} finally {
  if (page) page.close();
  const exited = new Promise((r) => {
    if (chrome.exitCode !== null || chrome.signalCode !== null) r();
    else chrome.once('exit', r);
  });
  killChromeGroup('SIGTERM');
  await Promise.race([exited, sleep(5000)]);
  killChromeGroup('SIGKILL'); // helpers that outlived the browser process
  await Promise.race([exited, sleep(2000)]);
  removeProfile();
  clearTimeout(watchdog);
}
t.done();
