/* chat.js - the web chat page's logic: keeps the conversation, streams each answer from
 * POST /v1/chat/completions (SSE, read with fetch + ReadableStream) and shows per-answer stats
 * (tokens, tau = mean accepted length, tokens/s, time to first token).
 *
 * For automated checks: `/?prompt=TEXT&autosend=1` sends TEXT once the page is ready;
 * document.body.dataset.state and window.kdtChat.state go idle -> streaming -> done | error,
 * and window.kdtChat.lastAnswer holds the last answer's text.
 */
'use strict';
(function () {
  const $ = (id) => document.getElementById(id);
  const history = [];
  let model = null;
  let controller = null;
  window.kdtChat = { state: 'idle', lastAnswer: '', error: null, chunks: 0, stats: null };

  function setState(s) {
    window.kdtChat.state = s;
    document.body.dataset.state = s;
    $('send').disabled = s === 'streaming';
    $('stop').disabled = s !== 'streaming';
  }

  function addMessage(role, text) {
    const el = document.createElement('div');
    el.className = 'msg ' + role;
    const r = document.createElement('div');
    r.className = 'role';
    r.textContent = role;
    const t = document.createElement('div');
    t.className = 'text';
    t.textContent = text;
    const s = document.createElement('div');
    s.className = 'stats';
    el.append(r, t, s);
    $('log').append(el);
    $('log').scrollTop = $('log').scrollHeight;
    return { el, text: t, stats: s };
  }

  async function loadModel() {
    try {
      const r = await fetch('/v1/models');
      const j = await r.json();
      model = j.data[0].id;
      $('model').textContent = 'model: ' + model;
    } catch (e) {
      $('model').textContent = 'server unreachable: ' + e.message;
    }
  }

  function requestBody() {
    const body = { model, messages: history.slice(), stream: true,
                   stream_options: { include_usage: true } };
    const temperature = parseFloat($('temperature').value);
    if (!Number.isNaN(temperature)) body.temperature = temperature;
    const maxTokens = parseInt($('max_tokens').value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const ext = {};
    if ($('spec').value) ext.spec = $('spec').value;
    const budget = parseInt($('budget').value, 10);
    if (budget > 0) ext.budget = budget;
    if (Object.keys(ext).length) body.kdtree = ext;
    return body;
  }

  async function send(text) {
    history.push({ role: 'user', content: text });
    addMessage('user', text);
    const m = addMessage('assistant', '');
    let answer = '';
    let finish = null, usage = null, ext = null, tFirst = 0;
    const t0 = performance.now();
    controller = new AbortController();
    window.kdtChat.lastAnswer = '';
    window.kdtChat.chunks = 0;
    setState('streaming');

    function onEvent(block) {
      const data = block.split('\n').filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).replace(/^ /, '')).join('\n');
      if (!data || data === '[DONE]') return;
      const obj = JSON.parse(data);
      if (obj.error) throw new Error(obj.error.message);
      if (obj.usage) usage = obj.usage;
      if (obj.kdtree) ext = obj.kdtree;
      const c = obj.choices && obj.choices[0];
      if (!c) return;
      if (c.finish_reason) finish = c.finish_reason;
      const piece = c.delta && c.delta.content;
      if (piece) {
        if (!tFirst) tFirst = performance.now();
        answer += piece;
        m.text.textContent = answer;
        window.kdtChat.lastAnswer = answer;
        window.kdtChat.chunks++;
        $('log').scrollTop = $('log').scrollHeight;
      }
    }

    try {
      const resp = await fetch('/v1/chat/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json' },
        body: JSON.stringify(requestBody()), signal: controller.signal });
      if (!resp.ok) {
        const j = await resp.json().catch(() => null);
        throw new Error((j && j.error && j.error.message) || ('HTTP ' + resp.status));
      }
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf('\n\n')) >= 0) {
          onEvent(buf.slice(0, i));
          buf = buf.slice(i + 2);
        }
      }
      history.push({ role: 'assistant', content: answer });
      const secs = (performance.now() - (tFirst || t0)) / 1000;
      const n = usage ? usage.completion_tokens : 0;
      const stats = { tokens: n, tau: ext ? ext.tau : null, finish,
                      ttft_ms: tFirst ? Math.round(tFirst - t0) : null,
                      tokens_per_s: secs > 0 && n > 1 ? (n - 1) / secs : null };
      window.kdtChat.stats = stats;
      m.stats.textContent = [
        n + ' tokens',
        stats.tau != null ? 'τ ' + stats.tau.toFixed(2) : null,
        stats.tokens_per_s != null ? stats.tokens_per_s.toFixed(1) + ' tok/s' : null,
        stats.ttft_ms != null ? 'first token ' + stats.ttft_ms + ' ms' : null,
        ext ? ext.spec + (ext.spec === 'ar' ? '' : ' B=' + ext.budget) : null,
        'finish: ' + finish,
      ].filter(Boolean).join(' · ');
      setState('done');
    } catch (e) {
      if (e.name === 'AbortError') {
        history.push({ role: 'assistant', content: answer });
        m.stats.textContent = 'stopped';
        setState('done');
      } else {
        m.el.classList.add('error');
        m.text.textContent = answer + (answer ? '\n' : '') + 'error: ' + e.message;
        window.kdtChat.error = e.message;
        history.pop(); /* the failed question is not part of the conversation */
        setState('error');
      }
    } finally {
      controller = null;
    }
  }

  $('form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const text = $('input').value.trim();
    if (!text || controller) return;
    $('input').value = '';
    send(text);
  });
  $('input').addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && !ev.shiftKey) {
      ev.preventDefault();
      $('form').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => controller && controller.abort());
  $('clear').addEventListener('click', () => {
    if (controller) controller.abort();
    history.length = 0;
    $('log').textContent = '';
    setState('idle');
  });

  const params = new URLSearchParams(location.search);
  setState('idle');
  loadModel().then(() => {
    if (params.get('autosend') === '1' && params.get('prompt')) send(params.get('prompt'));
  });
})();
