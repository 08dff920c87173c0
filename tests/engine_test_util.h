/* engine_test_util.h - helpers for the engine and drafter tests (header-only, static):
 *   - the TEST-ONLY oracle drafter: per-position logits from the target's own greedy
 *     continuation, with seeded corruption, plugged in through kdt_engine_set_test_drafter();
 *   - a writer for tiny random DFlash drafter checkpoints (z-lab layout);
 *   - the plain-greedy reference (model API only: prefill + decode, no engine);
 *   - a driver that runs a batch of prompts through an engine and collects every stream's output.
 * Target checkpoints come from tests/fixtures/models/ (the model owner's fixtures) or from
 * test_model_util.h's random writer.
 */
#ifndef KDT_ENGINE_TEST_UTIL_H
#define KDT_ENGINE_TEST_UTIL_H

#include "t.h"
#include "test_model_util.h"

#include "engine/engine_internal.h"
#include "kdtree/engine.h"
#include "kdtree/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ET_FIXTURE KDT_SOURCE_DIR "/tests/fixtures/models/kimi_tiny"

static inline uint64_t et_hash(uint64_t a, uint64_t b) {
    uint64_t s = a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull);
    return t_rand_u64(&s);
}

/* ---- the oracle drafter ----------------------------------------------------------------------
 * For a stream whose history ends in the anchor at position n-1, the oracle computes the
 * target's greedy continuation g_1..g_L (its own model + KV cache) and writes logits where, per
 * position d and seeded by (seed, history, d):
 *   with probability p_top        g_d ranks first (so acceptance runs deep),
 *   else with probability p_second  a wrong token ranks first and g_d second (side branches),
 *   else                           g_d gets a low logit (a miss, so trees get rejected).
 * Other tokens get small seeded noise. The draws depend on the history only, never on call
 * order, so one prompt drafts the same way in any batch. */
#define ET_ORACLE_SLOTS 64
#define ET_ORACLE_MAX_HIST 512

typedef struct et_oracle {
    kdt_model *model;
    kdt_kv_cache *kv;         /* one cache stream per slot = stream_id % ET_ORACLE_SLOTS */
    uint64_t seed;
    double p_top, p_second;
    int32_t *greedy;          /* [KDT_MAX_DEPTH] scratch */
    int32_t *hist;            /* [slots][ET_ORACLE_MAX_HIST] tokens whose KV the slot holds */
    int32_t *n_hist;          /* [slots] */
    int64_t calls;
} et_oracle;

static inline int et_oracle_init(et_oracle *o, const char *model_dir, uint64_t seed, double p_top,
                                 double p_second) {
    memset(o, 0, sizeof *o);
    kdt_model_options mo = {0, 0, KDT_PREFILL_ABSORBED};
    if (kdt_model_load(model_dir, &mo, &o->model) != KDT_OK) return -1;
    const int32_t pages = (ET_ORACLE_MAX_HIST + KDT_MAX_DEPTH) / KDT_KV_PAGE_SIZE + 2;
    kdt_kv_cache_options ko = {ET_ORACLE_SLOTS * pages, ET_ORACLE_SLOTS, pages};
    if (kdt_kv_cache_create(o->model, &ko, &o->kv) != KDT_OK) return -1;
    o->seed = seed;
    o->p_top = p_top;
    o->p_second = p_second;
    o->greedy = calloc(KDT_MAX_DEPTH, sizeof(int32_t));
    o->hist = calloc((size_t)ET_ORACLE_SLOTS * ET_ORACLE_MAX_HIST, sizeof(int32_t));
    o->n_hist = calloc(ET_ORACLE_SLOTS, sizeof(int32_t));
    return 0;
}

static inline void et_oracle_free(et_oracle *o) {
    kdt_kv_cache_free(o->kv);
    kdt_model_free(o->model);
    free(o->greedy);
    free(o->hist);
    free(o->n_hist);
}

/* g_1..g_L: the target's greedy continuation after history[0..n). The slot's cache keeps the
 * KV of the history it saw last; only the part after the common prefix is prefilled again. */
static inline kdt_status et_oracle_greedy(et_oracle *o, int32_t slot, const int32_t *history, int32_t n,
                                          int32_t L) {
    int32_t *h = o->hist + (int64_t)slot * ET_ORACLE_MAX_HIST;
    if (n > ET_ORACLE_MAX_HIST) return kdt_fail(KDT_ERR_CAPACITY, "oracle: history of %d tokens", n);
    int32_t common = 0;
    while (common < o->n_hist[slot] && common < n && h[common] == history[common]) common++;
    if (common > n - 1) common = n - 1; /* the last token is prefilled again for its argmax */
    kdt_status st = common > 0 ? kdt_kv_stream_set_length(o->kv, slot, common) : kdt_kv_stream_release(o->kv, slot);
    if (st != KDT_OK) return st;
    int32_t tok = -1;
    kdt_model_outputs out = {0};
    out.argmax = &tok;
    out.last_only = 1;
    st = kdt_model_prefill(o->model, o->kv, slot, history + common, n - common, &out);
    if (st != KDT_OK) return st;
    memcpy(h, history, sizeof(int32_t) * (size_t)n);
    o->n_hist[slot] = n;
    for (int32_t d = 0; d < L; d++) {
        o->greedy[d] = tok;
        if (d + 1 < L) {
            kdt_model_outputs od = {0};
            od.argmax = &tok;
            int32_t sid = slot;
            st = kdt_model_decode(o->model, o->kv, 1, &sid, &o->greedy[d], &od);
            if (st != KDT_OK) return st;
        }
    }
    return kdt_kv_stream_set_length(o->kv, slot, n); /* drop the continuation's KV */
}

static inline kdt_status et_oracle_draft(void *user, int32_t stream_id, const int32_t *history,
                                         int32_t n_history, int32_t n_positions, int32_t vocab,
                                         float *logits) {
    et_oracle *o = user;
    o->calls++;
    kdt_status st = et_oracle_greedy(o, stream_id % ET_ORACLE_SLOTS, history, n_history, n_positions);
    if (st != KDT_OK) return st;
    uint64_t h = o->seed;
    for (int32_t i = 0; i < n_history; i++) h = et_hash(h, (uint64_t)history[i]);
    for (int32_t d = 0; d < n_positions; d++) {
        float *row = logits + (int64_t)d * vocab;
        uint64_t hd = et_hash(h, (uint64_t)d + 1000);
        for (int32_t v = 0; v < vocab; v++) {
            uint64_t x = et_hash(hd, (uint64_t)v);
            row[v] = (float)((x >> 11) * (1.0 / 9007199254740992.0)); /* noise in [0, 1) */
        }
        const int32_t g = o->greedy[d];
        uint64_t r = et_hash(hd, 77);
        double u = (r >> 11) * (1.0 / 9007199254740992.0);
        int32_t wrong = (int32_t)(et_hash(hd, 99) % (uint64_t)vocab);
        if (wrong == g) wrong = (wrong + 1) % vocab;
        if (u < o->p_top) {
            row[g] = 8.0f;
            row[wrong] = 5.0f;
        } else if (u < o->p_top + o->p_second) {
            row[wrong] = 8.0f;
            row[g] = 6.0f;
        } else {
            row[wrong] = 8.0f;
            row[g] = -4.0f;
        }
    }
    return KDT_OK;
}

/* ---- plain greedy reference: model API only ----------------------------------------------- */
static inline kdt_status et_greedy_reference(const char *model_dir, const int32_t *prompt, int32_t n,
                                             int32_t n_new, int32_t *out_tokens) {
    kdt_model *m = NULL;
    kdt_kv_cache *kv = NULL;
    kdt_model_options mo = {0, 0, KDT_PREFILL_ABSORBED};
    kdt_status st = kdt_model_load(model_dir, &mo, &m);
    if (st != KDT_OK) return st;
    kdt_kv_cache_options ko = {(n + n_new) / KDT_KV_PAGE_SIZE + 2, 1, 0};
    st = kdt_kv_cache_create(m, &ko, &kv);
    int32_t tok = -1;
    if (st == KDT_OK) {
        kdt_model_outputs out = {0};
        out.argmax = &tok;
        out.last_only = 1;
        st = kdt_model_prefill(m, kv, 0, prompt, n, &out);
    }
    for (int32_t i = 0; i < n_new && st == KDT_OK; i++) {
        out_tokens[i] = tok;
        if (i + 1 < n_new) {
            kdt_model_outputs od = {0};
            od.argmax = &tok;
            st = kdt_model_decode(m, kv, 1, NULL, &out_tokens[i], &od);
        }
    }
    kdt_kv_cache_free(kv);
    kdt_model_free(m);
    return st;
}

/* ---- engine driver ------------------------------------------------------------------------ */
typedef struct et_run {
    int32_t n;                 /* streams */
    int32_t *ids;              /* [n] stream ids */
    int32_t **out;             /* [n][cap] emitted tokens */
    int32_t *n_out;            /* [n] */
    kdt_finish_reason *finish; /* [n] */
    int32_t cap;
    int64_t events_with_tau, tau_sum, tau_max, rounds;
} et_run;

static inline void et_run_free(et_run *r) {
    for (int32_t i = 0; i < r->n; i++) free(r->out[i]);
    free(r->out);
    free(r->ids);
    free(r->n_out);
    free(r->finish);
    memset(r, 0, sizeof *r);
}

/* After a failed add or step: cancels the run's streams still in the engine and lets them report,
 * so one failure stays one test's failure instead of filling the slots of every test after it. The
 * error message of the failure is kept (kdt_last_error). */
static inline kdt_status et_abandon(kdt_engine *e, const et_run *r, int32_t n_added, kdt_status st) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kdt_last_error());
    for (int32_t i = 0; i < n_added; i++) (void)kdt_engine_cancel(e, r->ids[i]);
    kdt_stream_event ev[64];
    for (int guard = 0; guard < 8 && kdt_engine_busy(e); guard++) {
        int32_t n_ev = 0;
        (void)kdt_engine_step(e, ev, 64, &n_ev);
    }
    return kdt_fail(st, "%s", msg);
}

/* Adds all prompts (params[i]) and steps until every stream finished. Returns the first error. */
static inline kdt_status et_run_batch(kdt_engine *e, int32_t n, int32_t *const *prompts,
                                      const int32_t *n_prompt, const kdt_gen_params *params,
                                      et_run *r) {
    memset(r, 0, sizeof *r);
    r->n = n;
    r->cap = 0;
    for (int32_t i = 0; i < n; i++)
        if (params[i].max_new_tokens > r->cap) r->cap = params[i].max_new_tokens;
    r->ids = calloc((size_t)n, sizeof(int32_t));
    r->out = calloc((size_t)n, sizeof(int32_t *));
    r->n_out = calloc((size_t)n, sizeof(int32_t));
    r->finish = calloc((size_t)n, sizeof(kdt_finish_reason));
    for (int32_t i = 0; i < n; i++) {
        r->out[i] = calloc((size_t)r->cap + 1, sizeof(int32_t));
        kdt_status st = kdt_engine_add(e, prompts[i], n_prompt[i], &params[i], &r->ids[i]);
        if (st != KDT_OK) return et_abandon(e, r, i, st);
    }
    kdt_stream_event ev[64];
    int guard = 0;
    while (kdt_engine_busy(e)) {
        int32_t n_ev = 0;
        kdt_status st = kdt_engine_step(e, ev, 64, &n_ev);
        if (st != KDT_OK) return et_abandon(e, r, n, st);
        r->rounds++;
        for (int32_t k = 0; k < n_ev; k++) {
            int32_t i = 0;
            while (i < n && r->ids[i] != ev[k].stream_id) i++;
            if (i == n) return kdt_fail(KDT_ERR_INTERNAL, "event for unknown stream %d", ev[k].stream_id);
            for (int32_t j = 0; j < ev[k].n_tokens && r->n_out[i] < r->cap; j++)
                r->out[i][r->n_out[i]++] = ev[k].tokens[j];
            if (ev[k].tau > 0) {
                r->events_with_tau++;
                r->tau_sum += ev[k].tau;
                if (ev[k].tau > r->tau_max) r->tau_max = ev[k].tau;
            }
            if (ev[k].finish != KDT_FINISH_NONE) r->finish[i] = ev[k].finish;
        }
        if (++guard > 100000) return kdt_fail(KDT_ERR_INTERNAL, "engine never finished");
    }
    return KDT_OK;
}

/* Checks each stream i of a finished run against ref[i][0..n_new[i]): its length and its tokens
 * (one CHECK failure per stream, at the first token that differs, labelled `what`). Returns the
 * number of streams that differ. */
static inline int et_check_outputs(const et_run *r, const int32_t *n_new, int32_t *const *ref, const char *what) {
    int bad = 0;
    for (int32_t i = 0; i < r->n; i++) {
        int ok = r->n_out[i] == n_new[i];
        CHECK_MSG(ok, "%s stream %d: %d tokens, expected %d", what, i, r->n_out[i], n_new[i]);
        for (int32_t j = 0; j < n_new[i] && j < r->n_out[i]; j++)
            if (r->out[i][j] != ref[i][j]) {
                CHECK_MSG(0, "%s stream %d: token %d is %d, reference %d", what, i, j, r->out[i][j], ref[i][j]);
                ok = 0;
                break;
            }
        bad += !ok;
    }
    return bad;
}

/* ---- random schedules (test_random_ops on the CPU, test_random_ops_gpu) ------------------------
 * Adds (accepted; refused for a bad argument; refused for capacity: slots, KV pool or context),
 * cancels (live, finished and unknown ids) and steps in random order, with every mode, random
 * budgets, stop ids and max_new_tokens, and some sampled streams beside the greedy ones, against
 * the greedy references of su's prompts. Checked: a refused add or cancel changes nothing; events
 * name live streams only, each stream finishes once; a greedy stream's tokens are its reference up
 * to its first stop id or max_new_tokens (a prefix if cancelled); a sampled one stays in the
 * vocabulary and within its cap; at the end no stream is left and every KV page is free; and the
 * schedule reached every branch. The engine should be small (a few slots, a pool of a few pages,
 * a short context) so that every refusal happens. */
#define ET_RO_MAX_PROMPT 64
typedef struct et_ro_setup {
    int32_t *const *prompts;
    const int32_t *n_prompt, *n_new; /* n_new[i] <= 32: the reference's length */
    int32_t *const *ref;
    int n_prompts, vocab;
} et_ro_setup;

typedef struct et_ro_stream {
    int32_t id, prompt, max_new, stop, greedy, n_out, finishes;
    int cancelled;
    kdt_finish_reason fin;
    int32_t out[32];
} et_ro_stream;

static inline int et_ro_same_stats(const kdt_engine_stats *a, const kdt_engine_stats *b) {
    return a->kv_pages_used == b->kv_pages_used && a->active_streams == b->active_streams &&
           a->waiting_streams == b->waiting_streams && a->tokens_emitted == b->tokens_emitted;
}

static inline et_ro_stream *et_ro_find(et_ro_stream *rs, int n, int32_t id) {
    for (int i = 0; i < n; i++)
        if (rs[i].id == id) return &rs[i];
    return NULL;
}

static inline void et_ro_step(kdt_engine *e, et_ro_stream *rs, int n_rs, int *bad) {
    kdt_stream_event ev[4];
    int32_t n_ev = 0;
    const kdt_status st = kdt_engine_step(e, ev, 4, &n_ev);
    CHECK_MSG(st == KDT_OK, "step: %s", kdt_last_error());
    for (int32_t k = 0; k < n_ev; k++) {
        et_ro_stream *r = et_ro_find(rs, n_rs, ev[k].stream_id);
        if (!r || r->finishes) {
            CHECK_MSG(0, "event for stream %d, which is %s", ev[k].stream_id, r ? "finished" : "unknown");
            ++*bad;
            continue;
        }
        for (int32_t j = 0; j < ev[k].n_tokens; j++) {
            if (r->n_out >= r->max_new) {
                CHECK_MSG(0, "stream %d: more than its %d tokens", r->id, r->max_new);
                ++*bad;
                break;
            }
            r->out[r->n_out++] = ev[k].tokens[j];
        }
        if (ev[k].finish != KDT_FINISH_NONE) r->fin = ev[k].finish, r->finishes++;
    }
}

/* The engine et_random_ops is meant for, on `device`: 4 slots, a 6-page pool (a 40-token prompt
 * with a 64-node tree takes 3), a 60-token context (the 40-token prompt with 21+ new tokens is
 * refused; others end near it), budgets to 64, the oracle drafter at `depth`; prefill_chunk and
 * max_prefill_tokens as kdt_engine_options takes them (0, 0: the defaults). NULL after a failed
 * CHECK. */
static inline kdt_engine *et_random_ops_engine(kdt_device device, et_oracle *oracle, int32_t depth,
                                               int32_t prefill_chunk, int32_t max_prefill_tokens) {
    kdt_engine_options o;
    memset(&o, 0, sizeof o);
    o.prefill_chunk = prefill_chunk;
    o.max_prefill_tokens = max_prefill_tokens;
    o.model_dir = ET_FIXTURE;
    o.device = device;
    o.max_streams = 4;
    o.max_budget = 64;
    o.kv_pages = 6;
    o.max_context = 60;
    kdt_engine *e = NULL;
    CHECK_MSG(kdt_engine_create(&o, &e) == KDT_OK, "engine create: %s", kdt_last_error());
    if (e && kdt_engine_set_test_drafter(e, depth, et_oracle_draft, oracle) != KDT_OK) {
        CHECK_MSG(0, "test drafter: %s", kdt_last_error());
        kdt_engine_free(e);
        e = NULL;
    }
    return e;
}

static inline void et_random_ops(kdt_engine *e, const et_ro_setup *su, int ops, uint64_t seed) {
    for (int i = 0; i < su->n_prompts; i++)
        if (su->n_prompt[i] > ET_RO_MAX_PROMPT || su->n_new[i] > 32) {
            CHECK_MSG(0, "et_random_ops: prompt %d has %d tokens (at most %d) and %d new (at most 32)", i,
                      su->n_prompt[i], ET_RO_MAX_PROMPT, su->n_new[i]);
            return;
        }
    et_ro_stream *rs = calloc((size_t)ops, sizeof *rs);
    int n_rs = 0, bad = 0, refused_cap = 0, refused_arg = 0, cancels = 0;
    uint64_t rng = seed;
    static const kdt_spec_mode modes[4] = {KDT_SPEC_AR, KDT_SPEC_CHAIN, KDT_SPEC_DDTREE, KDT_SPEC_AUTO};
    for (int op = 0; op < ops && bad < 5; op++) {
        const int kind = t_rand_int(&rng, 10);
        kdt_engine_stats before, after;
        kdt_engine_get_stats(e, &before);
        if (kind <= 4) { /* add: 4 in 5 well-formed */
            const int i = t_rand_int(&rng, su->n_prompts);
            et_ro_stream r;
            memset(&r, 0, sizeof r);
            r.prompt = i;
            r.max_new = 1 + t_rand_int(&rng, su->n_new[i]);
            r.stop = t_rand_int(&rng, 3) == 0 ? su->ref[i][t_rand_int(&rng, r.max_new)] : -1;
            r.greedy = t_rand_int(&rng, 5) != 0;
            kdt_gen_params p;
            kdt_gen_params_default(&p);
            p.spec = modes[t_rand_int(&rng, 4)];
            p.budget = 1 + t_rand_int(&rng, 64);
            p.max_new_tokens = r.max_new;
            if (r.stop >= 0) p.stop_ids = &r.stop, p.n_stop = 1;
            if (!r.greedy) p.temperature = 0.8f, p.top_k = 20, p.seed = t_rand_u64(&rng);
            int32_t prompt[ET_RO_MAX_PROMPT];
            int32_t n_prompt = su->n_prompt[i];
            memcpy(prompt, su->prompts[i], sizeof(int32_t) * (size_t)n_prompt);
            const int malformed = kind == 4 ? 1 + t_rand_int(&rng, 6) : 0;
            switch (malformed) {
            case 1: { /* a token id out of range (two draws, in this order: a seed replays anywhere) */
                const int at = t_rand_int(&rng, n_prompt);
                prompt[at] = t_rand_int(&rng, 2) ? su->vocab : -1;
                break;
            }
            case 2: n_prompt = 0; break;
            case 3: p.spec = KDT_SPEC_DDTREE, p.budget = 65; break; /* ar / chain ignore the budget */
            case 4: p.max_new_tokens = 0; break;
            case 5: p.top_p = 0.0f; break;
            case 6: r.stop = 999, p.stop_ids = &r.stop, p.n_stop = 1; break;
            }
            int32_t id = -1;
            const kdt_status st = kdt_engine_add(e, prompt, n_prompt, &p, &id);
            kdt_engine_get_stats(e, &after);
            if (malformed) {
                CHECK_MSG(st == KDT_ERR_INVALID_ARG, "malformed add %d: status %d", malformed, (int)st);
                refused_arg++;
            } else if (st == KDT_OK) {
                CHECK(et_ro_find(rs, n_rs, id) == NULL);
                r.id = id;
                rs[n_rs++] = r;
                continue;
            } else {
                CHECK_MSG(st == KDT_ERR_CAPACITY, "add: status %d: %s", (int)st, kdt_last_error());
                /* every slot taken (finished and cancelled streams keep theirs until the step
                 * that reports them), the pool short, or prompt + max_new_tokens past the context */
                CHECK_MSG(strstr(kdt_last_error(), "stream slots") || strstr(kdt_last_error(), "KV pool") ||
                              strstr(kdt_last_error(), "context"),
                          "%s", kdt_last_error());
                CHECK(strstr(kdt_last_error(), "KV pool") || before.active_streams + before.waiting_streams <= e->max_streams);
                refused_cap++;
            }
            CHECK(et_ro_same_stats(&before, &after));
        } else if (kind == 5) { /* cancel */
            const int which = t_rand_int(&rng, 4);
            if (which == 0 || n_rs == 0) {
                CHECK(kdt_engine_cancel(e, 1 << 30) == KDT_ERR_INVALID_ARG);
                kdt_engine_get_stats(e, &after);
                CHECK(et_ro_same_stats(&before, &after));
            } else {
                et_ro_stream *r = &rs[t_rand_int(&rng, n_rs)]; /* any stream, or (which 1, 2) a live one */
                for (int k = n_rs - 1; which <= 2 && k >= 0; k--)
                    if (!rs[k].finishes && !rs[k].cancelled && t_rand_int(&rng, 2)) {
                        r = &rs[k];
                        break;
                    }
                const kdt_status st = kdt_engine_cancel(e, r->id);
                if (r->finishes) {
                    CHECK_MSG(st == KDT_ERR_INVALID_ARG, "cancel of finished stream %d: %d", r->id, (int)st);
                    kdt_engine_get_stats(e, &after);
                    CHECK(et_ro_same_stats(&before, &after));
                } else {
                    CHECK(st == KDT_OK);
                    r->cancelled = 1;
                    cancels++;
                }
            }
        } else {
            et_ro_step(e, rs, n_rs, &bad);
        }
    }
    for (int guard = 0; kdt_engine_busy(e) && guard < 10000 && bad < 5; guard++) et_ro_step(e, rs, n_rs, &bad);
    CHECK(!kdt_engine_busy(e));

    int greedy_full = 0, checked = 0;
    for (int k = 0; k < n_rs && bad < 5; k++) {
        const et_ro_stream *r = &rs[k];
        const int32_t *ref = su->ref[r->prompt];
        int32_t want = r->max_new; /* the reference up to its first stop id, or max_new tokens */
        for (int32_t j = 0; j < r->max_new; j++)
            if (ref[j] == r->stop) {
                want = j + 1;
                break;
            }
        int ok = r->finishes == 1;
        CHECK_MSG(r->finishes == 1, "stream %d finished %d times", r->id, r->finishes);
        if (r->greedy) {
            for (int32_t j = 0; j < r->n_out; j++) ok &= r->out[j] == ref[j];
            if (r->fin == KDT_FINISH_CANCELLED) ok &= r->cancelled && r->n_out <= want;
            else ok &= r->n_out == want && r->fin == (want < r->max_new || ref[want - 1] == r->stop ? KDT_FINISH_STOP
                                                                                              : KDT_FINISH_LENGTH);
            greedy_full += r->fin != KDT_FINISH_CANCELLED;
        } else {
            for (int32_t j = 0; j < r->n_out; j++) ok &= r->out[j] >= 0 && r->out[j] < su->vocab;
            if (r->fin == KDT_FINISH_STOP) ok &= r->n_out > 0 && r->out[r->n_out - 1] == r->stop;
            else if (r->fin == KDT_FINISH_LENGTH) ok &= r->n_out == r->max_new;
            else ok &= r->fin == KDT_FINISH_CANCELLED && r->cancelled;
        }
        CHECK_MSG(ok, "stream %d (prompt %d, %s, max_new %d, stop %d%s): %d tokens, finish %s, expected %d",
                  r->id, r->prompt, r->greedy ? "greedy" : "sampled", r->max_new, r->stop,
                  r->cancelled ? ", cancelled" : "", r->n_out, kdt_finish_reason_name(r->fin), want);
        bad += !ok;
        checked++;
    }
    kdt_engine_stats s;
    kdt_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.active_streams, 0);
    CHECK_EQ_INT(s.waiting_streams, 0);
    CHECK_EQ_INT(s.kv_pages_used, 0);
    printf("  %d ops: %d streams (%d greedy to the end, %d cancels), %d refused for capacity, %d for arguments\n",
           ops, n_rs, greedy_full, cancels, refused_cap, refused_arg);
    /* the schedule reached every branch, or it checked less than it claims */
    CHECK(checked == n_rs && greedy_full > 0 && cancels > 0 && refused_cap > 0 && refused_arg > 0);
    free(rs);
}

/* ---- tiny DFlash drafter checkpoints --------------------------------------------------------- */
typedef struct et_dflash_spec {
    int hidden, inter, layers, heads, kv_heads, head_dim, block_size, mask_id, vocab;
    int n_taps, taps[8];
    int taps_top_level;   /* write mask_token_id / target_layer_ids at the top level */
    int yarn;             /* YaRN rope_scaling (old form) */
    int max_pos;          /* max_position_embeddings (0: 2048) */
    double theta, factor;
    uint64_t seed;
    const char *skip_tensor;  /* leave this tensor out (bad-input tests) */
    const char *bad_tensor;   /* write this tensor with one row too many */
} et_dflash_spec;

static inline et_dflash_spec et_dflash_default(int hidden, int vocab) {
    et_dflash_spec s;
    memset(&s, 0, sizeof s);
    s.hidden = hidden;
    s.inter = 48;
    s.layers = 2;
    s.heads = 4;
    s.kv_heads = 2;
    s.head_dim = 16;
    s.block_size = 5;
    s.mask_id = vocab - 3;
    s.vocab = vocab;
    s.n_taps = 2;
    s.taps[0] = 0;
    s.taps[1] = 1;
    s.theta = 10000.0;
    s.factor = 4.0;
    s.seed = 4242;
    return s;
}

/* Builds the drafter's tensors (kept in l for fp64 references) and writes DIR. */
static inline void et_dflash_tensors(const et_dflash_spec *s, tm_list *l) {
    uint64_t rng = s->seed;
    const int D = s->hidden, hd = s->head_dim;
    char n[128];
#define ADD(name, r, c, kind)                                                         \
    do {                                                                              \
        int extra_ = s->bad_tensor && strcmp(s->bad_tensor, name) == 0;              \
        if (!(s->skip_tensor && strcmp(s->skip_tensor, name) == 0))                  \
            tm_add(l, "", name, (r) ? (r) + extra_ : 0, (r) ? (c) : (c) + extra_, kind, &rng); \
    } while (0)
    ADD("fc.weight", D, s->n_taps * D, 0);
    ADD("hidden_norm.weight", 0, D, 1);
    for (int L = 0; L < s->layers; L++) {
        struct {
            const char *suffix;
            int r, c, kind;
        } w[] = {{"input_layernorm.weight", 0, D, 1},
                 {"post_attention_layernorm.weight", 0, D, 1},
                 {"self_attn.q_proj.weight", s->heads * hd, D, 0},
                 {"self_attn.k_proj.weight", s->kv_heads * hd, D, 0},
                 {"self_attn.v_proj.weight", s->kv_heads * hd, D, 0},
                 {"self_attn.o_proj.weight", D, s->heads * hd, 0},
                 {"self_attn.q_norm.weight", 0, hd, 1},
                 {"self_attn.k_norm.weight", 0, hd, 1},
                 {"mlp.gate_proj.weight", s->inter, D, 0},
                 {"mlp.up_proj.weight", s->inter, D, 0},
                 {"mlp.down_proj.weight", D, s->inter, 0}};
        for (size_t i = 0; i < sizeof w / sizeof w[0]; i++) {
            snprintf(n, sizeof n, "layers.%d.%s", L, w[i].suffix);
            ADD(n, w[i].r, w[i].c, w[i].kind);
        }
    }
    ADD("norm.weight", 0, D, 1);
#undef ADD
}

static inline void et_dflash_write(const char *dir, const et_dflash_spec *s, tm_list *keep) {
    mkdir(dir, 0755);
    tm_list l = {0};
    et_dflash_tensors(s, &l);
    char path[600], taps[128] = "", rope[400], dfl[300], text[2048];
    size_t o = 0;
    for (int i = 0; i < s->n_taps; i++) o += (size_t)snprintf(taps + o, sizeof taps - o, "%s%d", i ? ", " : "", s->taps[i]);
    if (s->yarn)
        snprintf(rope, sizeof rope, "\"rope_theta\": %.17g, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": %.17g, "
                 "\"beta_fast\": 32.0, \"beta_slow\": 1.0, \"mscale\": 1.0, \"mscale_all_dim\": 1.0, "
                 "\"original_max_position_embeddings\": 64}", s->theta, s->factor);
    else
        snprintf(rope, sizeof rope, "\"rope_theta\": %.17g, \"rope_scaling\": null", s->theta);
    if (s->taps_top_level)
        snprintf(dfl, sizeof dfl, "\"mask_token_id\": %d, \"target_layer_ids\": [%s]", s->mask_id, taps);
    else
        snprintf(dfl, sizeof dfl, "\"dflash_config\": {\"mask_token_id\": %d, \"target_layer_ids\": [%s]}",
                 s->mask_id, taps);
    snprintf(text, sizeof text,
             "{\"architectures\": [\"DFlashDraftModel\"], \"model_type\": \"qwen3\", \"block_size\": %d, "
             "\"hidden_size\": %d, \"intermediate_size\": %d, \"num_hidden_layers\": %d, "
             "\"num_attention_heads\": %d, \"num_key_value_heads\": %d, \"head_dim\": %d, "
             "\"rms_norm_eps\": 1e-06, \"max_position_embeddings\": %d, \"vocab_size\": %d, "
             "\"attention_bias\": false, \"tie_word_embeddings\": false, \"hidden_act\": \"silu\", %s, %s}",
             s->block_size, s->hidden, s->inter, s->layers, s->heads, s->kv_heads, s->head_dim,
             s->max_pos ? s->max_pos : 2048, s->vocab, rope, dfl);
    snprintf(path, sizeof path, "%s/config.json", dir);
    tm_write_bytes(path, text, strlen(text));
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    tm_write_safetensors(path, &l, 0, l.n, 0);
    if (keep) *keep = l;
    else tm_list_free(&l);
}

static inline const float *et_find(const tm_list *l, const char *name) {
    for (int i = 0; i < l->n; i++)
        if (strcmp(l->t[i].name, name) == 0) return l->t[i].data;
    return NULL;
}

#endif
