/* backend_mock.c - `--model mock`: a deterministic stand-in for the engine and the tokenizer, so
 * every layer above them (HTTP, JSON, SSE, scheduling, cancellation, metrics, the web page) can be
 * tested on any machine in milliseconds, without weights.
 *
 * Tokenizer: the byte-level one of bytes_tok.c (ids 0..255 are bytes, then SRV_MOCK_EOS,
 * SRV_MOCK_IM_END and four role markers).
 * Engine: a stream's answer is a function of its prompt only (and of the seed when temperature >
 * 0), like greedy decoding: sentences of words drawn by a hash of the prompt, each ended by EOS.
 * The word list has multi-byte UTF-8 words so detokenizer hold-back is exercised. A round emits
 * 1..3 tokens per stream (1 for "ar"; the prefill round emits one with tau 0), so answers do not
 * depend on batch composition. KV pages are accounted as the real engine does: a stream takes
 * ceil((prompt + max_new_tokens) / 64) pages at admission (all or nothing, KDT_ERR_CAPACITY when
 * short) and returns them when it finishes or is cancelled. A cancelled stream reports one final
 * KDT_FINISH_CANCELLED event in the next step. Each step sleeps round_ms to simulate compute.
 */
#include "server/server.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *const mock_words[] = {
    "tree",  "draft", "verify", "token", "accept", "greedy", "budget", "round", "kernel", "stream",
    "page",  "cache", "model",  "fast",  "the",    "a",      "of",     "and",   "naïve",  "café",
    "日本語", "🙂",    "Ω",      "path",  "bonus",  "heap",   "node",   "leaf",  "depth",  "walk"};
#define MOCK_NWORDS (sizeof mock_words / sizeof *mock_words)
#define MOCK_MAX_EV_TOKENS 3
#define MOCK_PAGE 64 /* tokens per KV page, as the real engine (KDT_KV_PAGE_SIZE) */

typedef struct mock_stream {
    int32_t id;
    int used;
    int prefilled;
    int ar;
    int long_story;
    uint64_t h;                 /* hash of the prompt (+ seed when sampling) */
    int32_t n_prompt, n_gen, max_new, pages;
    int32_t stop_ids[16];
    int32_t n_stop;
    char sentence[1024];        /* bytes of the current sentence, then EOS */
    int32_t sent_len, sent_pos, sent_no;
} mock_stream;

typedef struct mock {
    srv_mock_options o;
    mock_stream *streams;       /* [max_streams] */
    int32_t next_id;
    int32_t kv_used;
    int32_t cancelled[128];     /* ids whose final CANCELLED event is due */
    int32_t n_cancelled;
    int32_t ev_tokens[64 * 2 * MOCK_MAX_EV_TOKENS];
    kdt_engine_stats stats;
    int32_t steps;              /* steps taken (fault_at_step) */
    int faulted;
} mock;

static uint64_t mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The stream's next sentence: 3..14 words (as many as fit, when the prompt asked for a "long
 * story"). */
static void next_sentence(mock_stream *s) {
    uint64_t h = mix(s->h ^ (uint64_t)s->sent_no * 0x51ed27ull);
    int words = s->long_story ? 1000 : 3 + (int)(h % 12);
    int len = 0;
    for (int w = 0; w < words; w++) {
        const char *word = mock_words[mix(h + (uint64_t)w) % MOCK_NWORDS];
        int wl = (int)strlen(word);
        if (len + wl + 2 >= (int)sizeof s->sentence) break;
        if (w) s->sentence[len++] = ' ';
        memcpy(s->sentence + len, word, (size_t)wl);
        len += wl;
    }
    s->sentence[len++] = '.';
    s->sent_len = len;
    s->sent_pos = 0;
    s->sent_no++;
}

/* The next token of the answer: sentence bytes, then EOS. */
static int32_t next_token(mock_stream *s) {
    if (s->sent_pos < s->sent_len) return (unsigned char)s->sentence[s->sent_pos++];
    s->sent_pos = s->sent_len + 1; /* EOS consumed: the next call starts a new sentence */
    return SRV_MOCK_EOS;
}

static int is_stop(const mock_stream *s, int32_t t) {
    for (int32_t i = 0; i < s->n_stop; i++)
        if (s->stop_ids[i] == t) return 1;
    return 0;
}

static kdt_status mock_add(void *self, const int32_t *prompt, int32_t n, const kdt_gen_params *p,
                           int32_t *stream_id) {
    mock *m = self;
    if (m->faulted) return kdt_fail(KDT_ERR_CUDA, "mock: the device failed earlier (injected)");
    KDT_CHECK_ARG(prompt && n >= 1, "mock: empty prompt");
    KDT_CHECK_ARG(p && p->max_new_tokens >= 1, "mock: max_new_tokens must be >= 1");
    KDT_CHECK_ARG(p->n_stop >= 0 && p->n_stop <= 16, "mock: n_stop = %d", p->n_stop);
    for (int32_t i = 0; i < n; i++)
        KDT_CHECK_ARG(prompt[i] >= 0 && prompt[i] < SRV_MOCK_VOCAB,
                      "prompt token %d at position %d is outside the vocabulary (0..%d)",
                      prompt[i], i, SRV_MOCK_VOCAB - 1);
    if ((int64_t)n + p->max_new_tokens > m->o.max_context)
        return kdt_fail(KDT_ERR_CAPACITY, "prompt (%d) + max_new_tokens (%d) > context %d", n,
                        p->max_new_tokens, m->o.max_context);
    int32_t pages = (n + p->max_new_tokens + MOCK_PAGE - 1) / MOCK_PAGE;
    int slot = -1;
    for (int i = 0; i < m->o.max_streams; i++)
        if (!m->streams[i].used) {
            slot = i;
            break;
        }
    if (slot < 0) return kdt_fail(KDT_ERR_CAPACITY, "mock: all %d stream slots busy", m->o.max_streams);
    if (pages > m->o.kv_pages - m->kv_used)
        return kdt_fail(KDT_ERR_CAPACITY, "mock: needs %d KV pages, %d free", pages,
                        m->o.kv_pages - m->kv_used);
    mock_stream *s = &m->streams[slot];
    memset(s, 0, sizeof *s);
    uint64_t h = 0x1234567ull;
    int long_story = 0;
    for (int32_t i = 0; i < n; i++) {
        h = mix(h ^ (uint64_t)prompt[i]);
        /* "long story" in the prompt (bytes) asks for ~1000-word sentences */
        static const char key[] = "long story";
        if (i + 10 <= n) {
            int k = 0;
            while (k < 10 && prompt[i + k] == (unsigned char)key[k]) k++;
            if (k == 10) long_story = 1;
        }
    }
    if (p->temperature > 0) h = mix(h ^ p->seed ^ 0xabcdefull);
    s->h = h;
    s->used = 1;
    s->id = m->next_id++;
    s->ar = p->spec == KDT_SPEC_AR;
    s->n_prompt = n;
    s->max_new = p->max_new_tokens;
    s->pages = pages;
    s->n_stop = p->n_stop;
    if (p->n_stop) memcpy(s->stop_ids, p->stop_ids, (size_t)p->n_stop * sizeof *p->stop_ids);
    s->long_story = long_story;
    next_sentence(s);
    m->kv_used += pages;
    m->stats.prompt_tokens += (uint64_t)n;
    *stream_id = s->id;
    return KDT_OK;
}

static void release_stream(mock *m, mock_stream *s) {
    m->kv_used -= s->pages;
    s->used = 0;
}

static kdt_status mock_step(void *self, kdt_stream_event *ev, int32_t max_ev, int32_t *n_ev) {
    mock *m = self;
    KDT_CHECK_ARG(ev && n_ev && max_ev >= m->o.max_streams, "mock: max_events %d < max_streams %d",
                  max_ev, m->o.max_streams);
    *n_ev = 0;
    if (m->o.fault_at_step > 0 && ++m->steps >= m->o.fault_at_step) { /* as kdt_engine_step after a fault */
        m->faulted = 1;
        for (int i = 0; i < m->o.max_streams; i++)
            if (m->streams[i].used) {
                ev[(*n_ev)++] = (kdt_stream_event){m->streams[i].id, NULL, 0, 0, KDT_FINISH_ERROR};
                release_stream(m, &m->streams[i]);
            }
        return kdt_fail(KDT_ERR_CUDA, "mock: the device failed (injected at step %d)", m->o.fault_at_step);
    }
    int32_t n = 0, used_tok = 0, active = 0;
    /* final events of cancelled streams, keeping room for every active stream */
    int32_t n_late = m->n_cancelled < max_ev - m->o.max_streams ? m->n_cancelled
                                                                : max_ev - m->o.max_streams;
    for (int32_t i = 0; i < n_late; i++)
        ev[n++] = (kdt_stream_event){m->cancelled[i], NULL, 0, 0, KDT_FINISH_CANCELLED};
    memmove(m->cancelled, m->cancelled + n_late,
            (size_t)(m->n_cancelled - n_late) * sizeof *m->cancelled);
    m->n_cancelled -= n_late;
    for (int i = 0; i < m->o.max_streams; i++) active += m->streams[i].used;
    if (active && m->o.round_ms > 0)
        nanosleep(&(struct timespec){m->o.round_ms / 1000, (long)(m->o.round_ms % 1000) * 1000000L},
                  NULL);
    for (int i = 0; i < m->o.max_streams; i++) {
        mock_stream *s = &m->streams[i];
        if (!s->used) continue;
        int32_t want = 1, tau = 0;
        if (s->prefilled && !s->ar) want = 1 + (int32_t)(mix(s->h + (uint64_t)s->n_gen) % 3);
        if (s->prefilled) tau = want;
        s->prefilled = 1;
        int32_t *tok = m->ev_tokens + used_tok;
        int32_t k = 0;
        kdt_finish_reason fin = KDT_FINISH_NONE;
        while (k < want && fin == KDT_FINISH_NONE) {
            if (s->sent_pos > s->sent_len) next_sentence(s);
            int32_t t = next_token(s);
            tok[k++] = t;
            s->n_gen++;
            if (is_stop(s, t)) fin = KDT_FINISH_STOP;
            else if (s->n_gen >= s->max_new || s->n_prompt + s->n_gen >= m->o.max_context)
                fin = KDT_FINISH_LENGTH;
        }
        used_tok += k;
        ev[n++] = (kdt_stream_event){s->id, tok, k, tau, fin};
        m->stats.tokens_emitted += (uint64_t)k;
        m->stats.stream_rounds++;
        m->stats.tau_hist[tau < 18 ? tau : 17]++;
        if (fin != KDT_FINISH_NONE) release_stream(m, s);
    }
    if (active) {
        m->stats.rounds++;
        m->stats.t_verify += m->o.round_ms * 1e-3;
    }
    *n_ev = n;
    return KDT_OK;
}

static kdt_status mock_cancel(void *self, int32_t id) {
    mock *m = self;
    for (int i = 0; i < m->o.max_streams; i++) {
        mock_stream *s = &m->streams[i];
        if (s->used && s->id == id) {
            release_stream(m, s);
            if (m->n_cancelled < (int32_t)(sizeof m->cancelled / sizeof *m->cancelled))
                m->cancelled[m->n_cancelled++] = id;
            return KDT_OK;
        }
    }
    return kdt_fail(KDT_ERR_INVALID_ARG, "mock: no active stream %d", id);
}

static int mock_busy(const void *self) {
    const mock *m = self;
    if (m->n_cancelled) return 1;
    for (int i = 0; i < m->o.max_streams; i++)
        if (m->streams[i].used) return 1;
    return 0;
}

static void mock_get_stats(const void *self, kdt_engine_stats *out) {
    const mock *m = self;
    *out = m->stats;
    out->kv_pages_total = m->o.kv_pages;
    out->kv_pages_used = m->kv_used;
    out->active_streams = 0;
    for (int i = 0; i < m->o.max_streams; i++) out->active_streams += m->streams[i].used;
}

static const char *mock_fault(const void *self) {
    const mock *m = self;
    return m->faulted ? "the device failed (injected by the mock backend)" : NULL;
}

static void mock_destroy(void *self) {
    mock *m = self;
    if (!m) return;
    free(m->streams);
    free(m);
}

kdt_status srv_backend_mock_create(const srv_mock_options *opt, srv_backend **out) {
    srv_mock_options o = opt ? *opt : (srv_mock_options){0};
    if (o.max_streams <= 0) o.max_streams = 8;
    if (o.max_context <= 0) o.max_context = 1024;
    if (o.kv_pages <= 0)
        o.kv_pages = o.max_streams * ((o.max_context + MOCK_PAGE - 1) / MOCK_PAGE);
    if (o.round_ms < 0) o.round_ms = 0;
    if (o.max_budget <= 0) o.max_budget = 64;
    KDT_CHECK_ARG(o.max_streams <= 64, "mock: max_streams = %d, expected 1..64", o.max_streams);
    mock *m = calloc(1, sizeof *m);
    srv_backend *b = calloc(1, sizeof *b);
    if (m) m->streams = calloc((size_t)o.max_streams, sizeof *m->streams);
    if (!m || !b || !m->streams) {
        mock_destroy(m);
        free(b);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "mock: backend");
    }
    m->o = o;
    m->next_id = 1;
    *b = (srv_backend){
        .self = m, .kind = "mock", .vocab_size = SRV_MOCK_VOCAB, .max_context = o.max_context,
        .max_streams = o.max_streams, .max_budget = o.max_budget, .bos = -1,
        .stop_ids = {SRV_MOCK_EOS, SRV_MOCK_IM_END}, .n_stop_ids = 2, .has_draft = 1,
        .encode = srv_bytes_encode, .chat_encode = srv_bytes_chat_encode,
        .detok_new = srv_bytes_detok_new, .detok_feed = srv_bytes_detok_feed,
        .detok_finish = srv_bytes_detok_finish, .detok_free = srv_bytes_detok_free, .add = mock_add, .step = mock_step, .cancel = mock_cancel,
        .busy = mock_busy, .get_stats = mock_get_stats, .fault = mock_fault, .destroy = mock_destroy};
    *out = b;
    return KDT_OK;
}

void srv_backend_free(srv_backend *b) {
    if (!b) return;
    if (b->destroy) b->destroy(b->self);
    free(b);
}
