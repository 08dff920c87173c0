/* round.c - kdt_engine_step: prefill of the streams that joined, then one decoding round over
 * all active streams together (research ddtree-dflash.md §2, §5.2):
 *
 *   draft (DFlash or the test hook)  -> top-K log-softmax (kernel) -> tree build (kernel)
 *   -> one target verify pass over every stream's tree (model API, taps included)
 *   -> target token per node (argmax, or a per-node sample: lossless, §2.3)
 *   -> tree accept (kernel) -> emit with stop / length truncation
 *   -> KV commit (kernel) + drafter context of the accepted path.
 *
 * Streams are ordered inside a round as [ddtree/auto | chain | no draft] so the drafted rows
 * are one contiguous top-K launch and each group is one tree_build launch. Kernels go through
 * e->kern (kernel_ops.c), which is where the CUDA launchers plug in.
 */
#include "engine_internal.h"
#include "engine_gpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double kdt_engine_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

kdt_status kdt_round_grow_f32(float **buf, int64_t *cap, int64_t need, const char *what) {
    if (need <= *cap) return KDT_OK;
    float *p = realloc(*buf, sizeof(float) * (size_t)need);
    if (!p) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine: %s (%lld floats)", what, (long long)need);
    *buf = p;
    *cap = need;
    return KDT_OK;
}

kdt_sampler_params kdt_round_sampler_of(const eng_stream *s) {
    kdt_sampler_params sp = {s->params.temperature, s->params.top_k, s->params.top_p};
    return sp;
}

static int is_stop(const eng_stream *s, int32_t tok) {
    for (int32_t i = 0; i < s->params.n_stop; i++)
        if (s->stop[i] == tok) return 1;
    return 0;
}

/* Appends up to n tokens, truncating at the first stop token (kept) and at max_new_tokens;
 * writes them to ev[] and returns how many were taken. Sets s->finish when the stream ends. */
int32_t kdt_round_emit(eng_stream *s, const int32_t *toks, int32_t n, int32_t *ev) {
    int32_t k = 0;
    while (k < n && s->finish == KDT_FINISH_NONE) {
        const int32_t t = toks[k];
        s->tokens[s->n_tokens++] = t;
        s->n_emitted++;
        ev[k++] = t;
        if (is_stop(s, t)) s->finish = KDT_FINISH_STOP;
        else if (s->n_emitted >= s->params.max_new_tokens) s->finish = KDT_FINISH_LENGTH;
    }
    return k;
}

void kdt_round_event(kdt_stream_event *events, int32_t *n_ev, const eng_stream *s,
                      const int32_t *toks, int32_t n, int32_t tau) {
    kdt_stream_event *ev = &events[(*n_ev)++];
    ev->stream_id = s->id;
    ev->tokens = toks;
    ev->n_tokens = n;
    ev->tau = tau;
    ev->finish = s->finish;
}

/* ---- prefill ------------------------------------------------------------------------------- */

int32_t kdt_prefill_place(int32_t cap, int32_t n_chunks, const int32_t *stream, const int32_t *rows, int32_t *pass,
                          int32_t *pass_rows) {
    int32_t n_pass = 0;
    for (int32_t c = 0; c < n_chunks; c++) {
        /* after the pass of the stream's previous chunk (listed just before it) */
        int32_t p = c > 0 && stream[c - 1] == stream[c] ? pass[c - 1] + 1 : 0;
        while (p < n_pass && pass_rows[p] + rows[c] > cap) p++;
        if (p == n_pass) pass_rows[n_pass++] = 0;
        pass_rows[p] += rows[c];
        pass[c] = p;
    }
    return n_pass;
}

kdt_status kdt_round_pass_segments(const kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from,
                                   const int32_t *n_rows, kdt_prefill_segment *sg, round_pass *info) {
    const int32_t q = e->prefill_quantum;
    memset(info, 0, sizeof *info);
    if (n < 1 || n > e->max_streams) return kdt_fail(KDT_ERR_INTERNAL, "engine prefill: %d segments", n);
    for (int32_t k = 0; k < n; k++) {
        const eng_stream *s = &e->streams[slots[k]];
        const int32_t end = from[k] + n_rows[k];
        if (from[k] % q || n_rows[k] < 1 || n_rows[k] > q || end > s->n_prompt || from[k] != s->prefix_len)
            return kdt_fail(KDT_ERR_INTERNAL,
                            "engine prefill: slot %d rows %d..%d of a %d-token prompt (%d done) in %d-row passes",
                            slots[k], from[k], end, s->n_prompt, s->prefix_len, q);
        sg[k] = (kdt_prefill_segment){slots[k], s->tokens + from[k], n_rows[k]};
        info->rows += n_rows[k];
        if (end == s->n_prompt) {
            if (s->params.temperature > 0.0f) info->any_sampled = 1;
            else info->any_greedy = 1;
        }
        if (kdt_round_prefill_taps(e, s)) info->any_taps = 1;
    }
    if (info->rows > q) return kdt_fail(KDT_ERR_INTERNAL, "engine prefill: %d rows in a %d-row pass", info->rows, q);
    return KDT_OK;
}

void kdt_round_pass_finish(kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from, const int32_t *n_rows,
                           const float *logits, const int32_t *argmax, int32_t *first_token) {
    const int32_t V = e->mc->vocab_size;
    for (int32_t k = 0; k < n; k++) {
        eng_stream *s = &e->streams[slots[k]];
        s->prefix_len = from[k] + n_rows[k];
        first_token[k] = -1;
        if (s->prefix_len < s->n_prompt) continue; /* the rest in a later pass or step */
        if (s->params.temperature > 0.0f) {
            kdt_sampler_params sp = kdt_round_sampler_of(s);
            first_token[k] = kdt_sample_token(logits + (int64_t)k * V, V, &sp, kdt_rng_uniform(&s->rng), &e->sampler);
        } else {
            first_token[k] = argmax[k];
        }
    }
}

/* CPU: a pass as one kdt_model_prefill_many call. */
static kdt_status prefill_pass_cpu(kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from,
                                   const int32_t *n_rows, int32_t *first_token) {
    const int32_t V = e->mc->vocab_size, D = e->mc->hidden_size;
    kdt_prefill_segment sg[KDT_ENGINE_MAX_STREAMS];
    round_pass info;
    KDT_TRY(kdt_round_pass_segments(e, n, slots, from, n_rows, sg, &info));
    kdt_model_outputs out = {0};
    out.last_only = 1; /* output row k: segment k's last row (read where it ends the prompt) */
    out.argmax = info.any_greedy ? e->argmax : NULL;
    if (info.any_sampled) {
        KDT_TRY(kdt_round_grow_f32(&e->logits, &e->logits_cap, (int64_t)n * V, "prefill logits"));
        out.logits = e->logits;
    }
    if (info.any_taps) {
        KDT_TRY(kdt_round_grow_f32(&e->taps, &e->taps_cap, (int64_t)info.rows * e->n_taps * D, "prefill taps"));
        out.n_taps = e->n_taps;
        out.tap_layers = e->tap_layers;
        out.taps = e->taps;
    }
    KDT_TRY(kdt_model_prefill_many(e->model, e->kv, n, sg, &out));
    for (int32_t k = 0, row = 0; k < n; row += n_rows[k], k++) {
        const eng_stream *s = &e->streams[slots[k]];
        if (kdt_round_prefill_taps(e, s)) /* its rows join its drafter context */
            KDT_TRY(kdt_dflash_ctx_append(e->drafter, s->dctx, e->taps + (int64_t)row * e->n_taps * D, n_rows[k]));
    }
    kdt_round_pass_finish(e, n, slots, from, n_rows, e->logits, e->argmax, first_token);
    return KDT_OK;
}

/* The step's chunks in shared passes. A pass holds at most prefill_quantum rows, at most one chunk
 * per stream; chunks are placed first-fit in arrival order, each after its stream's previous
 * chunk's pass (kdt_prefill_place). On the GPU a MoE pass streams every expert whatever its rows,
 * so eight 64-token prompts cost one 512-row pass instead of eight; each row still gets the bits of
 * its own chunk's pass (kdt_gpu_stage_prefill_many), so outputs do not depend on which prompts
 * arrived together. err[i] is set for the streams of a pass that failed (their later chunks are
 * skipped). */
static void prefill_passes(kdt_engine *e, int32_t n, const int32_t *slot, const int32_t *take, int32_t *first,
                           kdt_status *err) {
    const int32_t q = e->prefill_quantum;
    int64_t n_chunks = 0;
    for (int32_t i = 0; i < n; i++) n_chunks += (take[i] + q - 1) / q;
    /* per chunk: stream index, first row, rows, pass; per pass: rows */
    int32_t *ck = malloc((size_t)n_chunks * 5 * sizeof(int32_t));
    if (!ck) {
        const kdt_status st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine: prefill plan of %lld chunks", (long long)n_chunks);
        for (int32_t i = 0; i < n; i++) err[i] = st;
        return;
    }
    int32_t *c_idx = ck, *c_from = ck + n_chunks, *c_rows = ck + 2 * n_chunks, *c_pass = ck + 3 * n_chunks,
            *p_rows = ck + 4 * n_chunks;
    int64_t c = 0;
    for (int32_t i = 0; i < n; i++)
        for (int32_t off = 0; off < take[i]; off += q, c++) {
            c_idx[c] = i;
            c_from[c] = e->streams[slot[i]].prefix_len + off;
            c_rows[c] = take[i] - off < q ? take[i] - off : q;
        }
    const int32_t n_pass = kdt_prefill_place(q, (int32_t)n_chunks, c_idx, c_rows, c_pass, p_rows);
    int32_t s_slot[KDT_ENGINE_MAX_STREAMS], s_from[KDT_ENGINE_MAX_STREAMS], s_rows[KDT_ENGINE_MAX_STREAMS],
        s_idx[KDT_ENGINE_MAX_STREAMS], s_first[KDT_ENGINE_MAX_STREAMS];
    for (int32_t p = 0; p < n_pass; p++) {
        int32_t m = 0, rows = 0;
        for (int64_t j = 0; j < n_chunks; j++) {
            if (c_pass[j] != p || err[c_idx[j]] != KDT_OK) continue;
            s_idx[m] = c_idx[j];
            s_slot[m] = slot[c_idx[j]];
            s_from[m] = c_from[j];
            s_rows[m] = c_rows[j];
            rows += c_rows[j];
            m++;
        }
        if (m == 0) continue;
        const double t0 = kdt_engine_now();
        const kdt_status st = e->gpu ? kdt_engine_gpu_prefill_pass(e, m, s_slot, s_from, s_rows, s_first)
                                     : prefill_pass_cpu(e, m, s_slot, s_from, s_rows, s_first);
        e->stats.t_prefill += kdt_engine_now() - t0;
        if (st == KDT_OK) {
            e->stats.prompt_tokens += (uint64_t)rows;
            e->stats.prefill_passes++;
        }
        for (int32_t k = 0; k < m; k++) {
            if (st != KDT_OK) err[s_idx[k]] = st;
            else if (s_first[k] >= 0) first[s_idx[k]] = s_first[k];
        }
    }
    free(ck);
}

/* The step's prefill: the waiting streams' prompts in arrival order, in whole chunks of the
 * device's pass size, within the step's token budget (a chunk is taken while it fits what is left,
 * and the step's first chunk always); a stream the budget stops keeps its place for the next step.
 * Streams whose prompt is in emit their first token and join the next step's round. */
static kdt_status prefill_step(kdt_engine *e, kdt_stream_event *events, int32_t *n_events) {
    int32_t slot[KDT_ENGINE_MAX_STREAMS], take[KDT_ENGINE_MAX_STREAMS], first[KDT_ENGINE_MAX_STREAMS], n = 0;
    kdt_status err[KDT_ENGINE_MAX_STREAMS];
    for (int32_t i = 0; i < e->max_streams; i++) {
        if (e->streams[i].state != SLOT_WAITING) continue;
        int32_t j = n++;
        for (; j > 0 && e->arrival[slot[j - 1]] > e->arrival[i]; j--) slot[j] = slot[j - 1];
        slot[j] = i;
    }
    const int32_t q = e->prefill_quantum;
    int64_t budget_left = e->max_prefill_tokens > 0 ? e->max_prefill_tokens : INT64_MAX, taken = 0;
    int32_t n_take = 0;
    for (; n_take < n; n_take++) {
        const eng_stream *s = &e->streams[slot[n_take]];
        const int32_t left = s->n_prompt - s->prefix_len;
        int32_t t = 0;
        while (t < left) {
            const int32_t rows = left - t < q ? left - t : q;
            if (taken > 0 && rows > budget_left) break;
            t += rows;
            taken += rows;
            budget_left -= rows;
        }
        take[n_take] = t;
        first[n_take] = -1;
        err[n_take] = KDT_OK;
        if (t < left) { /* the budget is spent: this stream goes on next step, later ones wait */
            if (t > 0) n_take++;
            break;
        }
    }
    if (n_take == 0) return KDT_OK;
    prefill_passes(e, n_take, slot, take, first, err);
    kdt_status first_err = KDT_OK;
    for (int32_t i = 0; i < n_take; i++) {
        eng_stream *s = &e->streams[slot[i]];
        if (err[i] == KDT_OK && s->prefix_len < s->n_prompt) continue; /* more next step */
        int32_t *evt = e->ev_tokens + (int64_t)slot[i] * KDT_MAX_PATH;
        int32_t emitted = 0;
        if (err[i] == KDT_OK) {
            emitted = kdt_round_emit(s, &first[i], 1, evt);
            e->stats.tokens_emitted += (uint64_t)emitted;
        } else {
            if (first_err == KDT_OK) first_err = err[i];
            s->finish = KDT_FINISH_ERROR;
        }
        kdt_round_event(events, n_events, s, evt, emitted, 0);
        if (s->finish != KDT_FINISH_NONE) {
            kdt_engine_release_stream(e, slot[i]);
            s->state = SLOT_FREE;
        } else {
            s->state = SLOT_ACTIVE;
        }
    }
    return first_err;
}

/* ---- the round ----------------------------------------------------------------------------- */

kdt_tree kdt_round_tree_view(const round_bufs *b, int32_t s0, int32_t n, int32_t stride) {
    const int64_t base = (int64_t)s0 * stride, W = KDT_MASK_WORDS(stride);
    kdt_tree t = {n, stride, b->n_nodes + s0, b->token + base, b->parent + base,
                  b->depth + base, b->first_child + base, b->next_sibling + base,
                  b->position + base, b->score + base, b->mask + base * W};
    return t;
}

round_bufs kdt_round_host_bufs(kdt_engine *e) {
    round_bufs b = {e->t_n_nodes, e->t_token, e->t_parent, e->t_depth, e->t_first_child, e->t_next_sibling,
                    e->t_position, e->t_score, e->t_mask, e->top_ids, e->top_logp, e->b_depth_limit,
                    e->b_budget, e->b_root, e->b_prefix};
    return b;
}

round_bufs kdt_round_probe_bufs(kdt_engine *e) {
    const int64_t sm = (int64_t)e->max_streams * e->max_nodes;
    int32_t *t = e->p_tree;
    round_bufs b = {e->p_n_nodes, t, t + sm, t + 2 * sm, t + 3 * sm, t + 4 * sm, t + 5 * sm,
                    e->p_score, e->p_mask, e->top_ids, e->top_logp, e->b_depth_limit,
                    e->b_budget, e->b_root, e->b_prefix};
    return b;
}

void kdt_round_tree_prefix(const kdt_tree *src, const kdt_tree *dst, const int32_t *budget) {
    const int32_t Ns = src->max_nodes, Nd = dst->max_nodes;
    const int32_t Ws = KDT_MASK_WORDS(Ns), Wd = KDT_MASK_WORDS(Nd);
    for (int32_t s = 0; s < dst->n_streams; s++) {
        const int32_t b = budget[s] < 0 ? 0 : budget[s] > Nd - 1 ? Nd - 1 : budget[s];
        int32_t n = src->n_nodes[s] < 1 + b ? src->n_nodes[s] : 1 + b;
        if (n > Ns) n = Ns;
        if (n < 1) n = 1;
        const int64_t si = (int64_t)s * Ns, di = (int64_t)s * Nd;
        for (int32_t i = 0; i < Nd; i++) {
            uint64_t *row = dst->anc_mask + (di + i) * Wd;
            if (i >= n) { /* tree_build's padding */
                dst->token[di + i] = dst->parent[di + i] = dst->depth[di + i] = -1;
                dst->first_child[di + i] = dst->next_sibling[di + i] = dst->position[di + i] = -1;
                dst->score[di + i] = -INFINITY;
                for (int32_t w = 0; w < Wd; w++) row[w] = 0;
                continue;
            }
            /* children and later siblings come later in pop order: a link past the prefix ends */
            const int32_t fc = src->first_child[si + i], ns = src->next_sibling[si + i];
            dst->token[di + i] = src->token[si + i];
            dst->parent[di + i] = src->parent[si + i];
            dst->depth[di + i] = src->depth[si + i];
            dst->first_child[di + i] = fc < n ? fc : -1;
            dst->next_sibling[di + i] = ns < n ? ns : -1;
            dst->position[di + i] = src->position[si + i];
            dst->score[di + i] = src->score[si + i];
            const uint64_t *srow = src->anc_mask + (si + i) * Ws;
            for (int32_t w = 0; w < Wd; w++) row[w] = w < Ws ? srow[w] : 0; /* ancestors are < i < Nd */
        }
        dst->n_nodes[s] = n;
    }
}

kdt_status kdt_round_build_trees(const kdt_engine *e, const round_bufs *b, const int32_t *budget_host,
                                 const kdt_engine_kernels *kern, void *stream, const round_groups *g, int32_t S,
                                 int32_t K, int32_t *stride_out) {
    int32_t stride = *stride_out > 1 ? *stride_out : 1; /* a caller may ask for a wider stride */
    for (int32_t s = 0; s < S; s++)
        if (1 + budget_host[s] > stride) stride = 1 + budget_host[s];
    const int32_t L = e->depth > 0 ? e->depth : 1;
    const int64_t per_stream = (int64_t)L * K;
    struct {
        int32_t s0, n, chain;
    } parts[3] = {{0, g->n_tree, 0}, {g->n_tree, g->n_chain, 1}, {g->n_draft, g->n_plain, 0}};
    for (int i = 0; i < 3; i++) {
        if (parts[i].n == 0) continue;
        const int32_t s0 = parts[i].s0;
        kdt_tree view = kdt_round_tree_view(b, s0, parts[i].n, stride);
        /* the no-draft group has budget 0: its top-K rows are never read */
        const int64_t top_off = i == 2 ? 0 : s0 * per_stream;
        kdt_tree_build_params bp = {parts[i].n, L, K, b->top_ids + top_off, b->top_logp + top_off,
                                    b->depth_limit + s0, b->budget + s0, b->root + s0,
                                    b->prefix + s0, parts[i].chain};
        kdt_status st = kern->tree_build(&bp, &view, stream);
        if (st != KDT_OK) return st;
    }
    *stride_out = stride;
    return KDT_OK;
}

double kdt_round_surrogate(const kdt_engine *e, const kdt_tree *tree, int32_t s) {
    double sum = 0.0;
    for (int32_t i = 1; i < tree->n_nodes[s]; i++) sum += exp((double)tree->score[(int64_t)s * tree->max_nodes + i]);
    return sum < e->b_depth_limit[s] ? sum : e->b_depth_limit[s];
}

/* Orders the round's streams [ddtree/auto | chain | no draft] into e->slot_of and fills the
 * per-stream parameters (root, prefix, depth limit, budget); returns S. */
int32_t kdt_round_plan(kdt_engine *e, const int32_t *slots, int32_t n_slots, round_groups *gout) {
    const int32_t L = e->depth;
    round_groups g = {0};
    int32_t S = 0;
    for (int pass = 0; pass < 3; pass++)
        for (int32_t i = 0; i < n_slots; i++) {
            const eng_stream *s = &e->streams[slots[i]];
            const int32_t remaining = s->params.max_new_tokens - s->n_emitted;
            /* A drafting stream with one token left stays in its group with a root-only tree: a
             * group change would make a new round shape (a new CUDA graph) whenever streams
             * finish, which on a busy server is nearly every round. */
            const int draft = s->drafts && L > 0;
            const int chain = s->params.spec == KDT_SPEC_CHAIN;
            const int group = !draft ? 2 : chain ? 1 : 0;
            if (group != pass) continue;
            e->slot_of[S] = slots[i];
            e->b_root[S] = s->tokens[s->n_tokens - 1];
            e->b_prefix[S] = s->prefix_len;
            /* a round emits at most depth + 1 tokens: deeper nodes could never be kept */
            e->b_depth_limit[S] = draft && remaining >= 2 ? (remaining - 1 < L ? remaining - 1 : L) : 1;
            e->b_budget[S] = !draft || remaining < 2 ? 0 : chain ? e->b_depth_limit[S] : s->budget_cap;
            if (group == 0) g.n_tree++;
            else if (group == 1) g.n_chain++;
            else g.n_plain++;
            if (draft && s->params.spec == KDT_SPEC_AUTO) g.n_auto++;
            S++;
        }
    g.n_draft = g.n_tree + g.n_chain;

    *gout = g;
    return S;
}

/* K of the round's top-K: the largest budget of a tree stream, bounded by top_k_max. */
int32_t kdt_round_topk_k(const kdt_engine *e, const round_groups *g) {
    int32_t K = 1;
    for (int32_t s = 0; s < g->n_tree; s++) {
        int32_t k = e->b_budget[s] < e->top_k_max ? e->b_budget[s] : e->top_k_max;
        if (k > K) K = k;
    }
    return K;
}

void kdt_round_auto_choose(kdt_engine *e, const round_groups *gp, int32_t S, const kdt_tree *probe) {
    const round_groups g = *gp;
    /* The probe trees were built at each auto stream's cap; the best-B tree is their first B
     * pops, so their scores give the surrogate of every budget (budget.h). */
    kdt_budget_stream bs[64] = {{0}};
    int32_t auto_idx[64], n_auto = 0;
    kdt_budget_others others = {0, 0, 0.0, 1};
    for (int32_t s = 0; s < S; s++) {
        const eng_stream *es = &e->streams[e->slot_of[s]];
        if (s < g.n_tree && es->params.spec == KDT_SPEC_AUTO) {
            float *sc = e->auto_scores + (int64_t)n_auto * e->max_nodes;
            const int32_t cap = probe->n_nodes[s] - 1;
            memcpy(sc, probe->score + (int64_t)s * probe->max_nodes + 1, sizeof(float) * (size_t)cap);
            bs[n_auto] = (kdt_budget_stream){sc, cap, e->b_depth_limit[s]};
            auto_idx[n_auto++] = s;
        } else {
            others.n_streams++;
            others.nodes += probe->n_nodes[s];
            if (probe->n_nodes[s] > others.min_stride) others.min_stride = probe->n_nodes[s];
            others.tokens += 1.0 + (s < g.n_draft ? kdt_budget_calibration(&e->budget) *
                                                        kdt_round_surrogate(e, probe, s) : 0.0);
        }
    }
    kdt_round_choose_budgets(e, n_auto, bs, auto_idx, &others);
}

void kdt_round_choose_budgets(kdt_engine *e, int32_t n, const kdt_budget_stream *bs, const int32_t *idx,
                              const kdt_budget_others *others) {
    int32_t chosen[64], last = 0;
    kdt_budget_choose(&e->budget, n, bs, others, chosen);
    for (int32_t i = 0; i < n; i++) {
        e->b_budget[idx[i]] = chosen[i];
        if (chosen[i] > last) last = chosen[i];
    }
    e->stats.last_budget = last;
}

/* Draft or not (budget.h): asked only when every drafting stream of the round is auto, since
 * the drafter pass is one batched call. A plain round gives the auto streams root-only trees and
 * skips the drafter, top-K and the probe, but still keeps the accepted token's taps for their
 * drafter contexts (appended at once here, parked until the next draft on the GPU: engine_gpu.c),
 * so the next drafted round finds them complete. Returns 1 to draft. */
static int auto_decides(const round_groups *g) { return g->n_auto > 0 && g->n_auto == g->n_draft; }

int kdt_round_auto_drafts(kdt_engine *e, const round_groups *g, int32_t S) {
    if (!auto_decides(g)) return 1;
    if (kdt_budget_next_round_drafts(&e->budget, S)) return 1;
    for (int32_t s = 0; s < g->n_tree; s++) e->b_budget[s] = 0;
    return 0;
}

void kdt_round_observe(kdt_engine *e, const round_groups *g, const round_timing *t) {
    const int64_t rows = kdt_budget_cost_rows(&e->budget, t->S, t->stride, t->nodes);
    if (t->drafts && !t->setup) {
        kdt_budget_observe_round(&e->budget, t->fixed_s, rows, t->verify_s);
    } else {
        kdt_budget_observe_plain_verify(&e->budget, rows, t->verify_s); /* GPU-timed: setup-free */
    }
    if (t->drafts && t->have_accept) kdt_budget_observe_accept(&e->budget, t->predicted, t->realised);
    if (!t->drafts) e->stats.plain_rounds++;
    if (auto_decides(g) && !t->setup) kdt_budget_observe_kind(&e->budget, t->S, t->drafts, t->emitted, t->wall_s);
    if (auto_decides(g) && t->setup) kdt_budget_observe_setup(&e->budget, t->S, t->drafts, t->wall_s);
    /* KDT_AUTO_TRACE=1: one stderr line per auto round, to see the draft-or-not choices */
    static int trace = -1;
    if (trace < 0) {
        const char *v = getenv("KDT_AUTO_TRACE");
        trace = v && v[0] == '1';
    }
    if (trace && auto_decides(g))
        fprintf(stderr, "auto S=%d %s%s tokens=%.0f stride=%d wall_us=%.1f verify_us=%.1f rate plain=%.0f drafted=%.0f\n",
                t->S, t->drafts ? "drafted" : "plain", t->setup ? " setup" : "", t->emitted, t->stride, t->wall_s * 1e6,
                t->verify_s * 1e6, kdt_budget_kind_rate(&e->budget, t->S, 0), kdt_budget_kind_rate(&e->budget, t->S, 1));
}

static kdt_status run_round(kdt_engine *e, const int32_t *slots, int32_t n_slots,
                            kdt_stream_event *events, int32_t *n_ev) {
    if (e->gpu) return kdt_engine_gpu_round(e, slots, n_slots, events, n_ev);
    const int32_t V = e->mc->vocab_size, D = e->mc->hidden_size, L = e->depth;
    const double t0 = kdt_engine_now();
    kdt_status st = KDT_OK;

    round_groups g;
    const int32_t S = kdt_round_plan(e, slots, n_slots, &g);
    const round_bufs hb = kdt_round_host_bufs(e);
    const int drafts = kdt_round_auto_drafts(e, &g, S);

    /* 1. draft: logits [n_draft][L][V] */
    if (g.n_draft > 0 && drafts) {
        st = kdt_round_grow_f32(&e->draft_logits, &e->draft_logits_cap, (int64_t)g.n_draft * L * V, "draft logits");
        if (st != KDT_OK) return st;
        if (e->test_draft) {
            for (int32_t s = 0; s < g.n_draft && st == KDT_OK; s++) {
                const eng_stream *es = &e->streams[e->slot_of[s]];
                st = e->test_draft(e->test_user, es->id, es->tokens, es->n_tokens, L, V,
                                   e->draft_logits + (int64_t)s * L * V);
            }
        } else {
            kdt_dflash_ctx *ctx[64];
            for (int32_t s = 0; s < g.n_draft; s++) {
                const eng_stream *es = &e->streams[e->slot_of[s]];
                ctx[s] = es->dctx;
                /* the context must cover exactly the committed positions 0..P-1 */
                if (kdt_dflash_ctx_length(es->dctx) != es->prefix_len)
                    return kdt_fail(KDT_ERR_INTERNAL, "stream %d: drafter context %d != prefix %d", es->id,
                                    kdt_dflash_ctx_length(es->dctx), es->prefix_len);
            }
            st = kdt_dflash_draft(e->drafter, ctx, g.n_draft, e->b_root, e->draft_logits);
        }
        if (st != KDT_OK) return st;
    }
    const double t1 = kdt_engine_now();

    /* 2. top-K over the drafted rows, then the trees */
    const int32_t K = kdt_round_topk_k(e, &g);
    if (g.n_draft > 0 && drafts) {
        kdt_topk_params tp = {g.n_draft * L, V, K, KDT_F32, e->draft_logits, V, e->top_ids,
                              e->top_logp, NULL, 0};
        st = e->kern->topk(&tp, e->cuda_stream);
        if (st != KDT_OK) return st;
    }
    int32_t stride = 1;
    if (g.n_auto > 0 && drafts) {
        /* one build at the caps: the choice reads its scores, the verified trees are its prefixes */
        const round_bufs pb = kdt_round_probe_bufs(e);
        int32_t pstride = 1;
        st = kdt_round_build_trees(e, &pb, e->b_budget, e->kern, e->cuda_stream, &g, S, K, &pstride);
        if (st != KDT_OK) return st;
        const kdt_tree probe = kdt_round_tree_view(&pb, 0, S, pstride);
        kdt_round_auto_choose(e, &g, S, &probe);
        for (int32_t s = 0; s < S; s++)
            if (1 + e->b_budget[s] > stride) stride = 1 + e->b_budget[s];
        const kdt_tree verified = kdt_round_tree_view(&hb, 0, S, stride);
        kdt_round_tree_prefix(&probe, &verified, e->b_budget);
    } else {
        st = kdt_round_build_trees(e, &hb, e->b_budget, e->kern, e->cuda_stream, &g, S, K, &stride);
        if (st != KDT_OK) return st;
    }
    const double t2 = kdt_engine_now();

    /* 3. one verify pass over all trees */
    int any_greedy = 0, any_sampled = 0;
    for (int32_t s = 0; s < S; s++) {
        if (e->streams[e->slot_of[s]].params.temperature > 0.0f) any_sampled = 1;
        else any_greedy = 1;
    }
    const int64_t R = (int64_t)S * stride;
    const int want_taps = g.n_draft > 0 && e->drafter && e->n_taps > 0;
    if (any_sampled) {
        st = kdt_round_grow_f32(&e->logits, &e->logits_cap, R * V, "verify logits");
        if (st != KDT_OK) return st;
    }
    if (want_taps) {
        st = kdt_round_grow_f32(&e->taps, &e->taps_cap, R * e->n_taps * D, "verify taps");
        if (st != KDT_OK) return st;
    }
    kdt_tree tree = kdt_round_tree_view(&hb, 0, S, stride);
    kdt_model_outputs out = {0};
    out.argmax = any_greedy ? e->argmax : NULL;
    out.logits = any_sampled ? e->logits : NULL;
    if (want_taps) {
        out.n_taps = e->n_taps;
        out.tap_layers = e->tap_layers;
        out.taps = e->taps;
    }
    st = kdt_model_verify(e->model, e->kv, &tree, e->slot_of, &out);
    if (st != KDT_OK) return st;
    const double t3 = kdt_engine_now();

    /* 4. the target's token at every node: argmax, or one draw per node from the stream's RNG
     * (in node order; draws off the walked path are simply unused) */
    int64_t nodes_total = 0;
    for (int32_t s = 0; s < S; s++) {
        eng_stream *es = &e->streams[e->slot_of[s]];
        const int64_t base = (int64_t)s * stride;
        const int32_t n = e->t_n_nodes[s];
        nodes_total += n;
        if (es->params.temperature > 0.0f) {
            kdt_sampler_params sp = kdt_round_sampler_of(es);
            for (int32_t i = 0; i < n; i++)
                e->target_token[base + i] = kdt_sample_token(e->logits + (base + i) * V, V, &sp,
                                                             kdt_rng_uniform(&es->rng), &e->sampler);
        } else {
            memcpy(e->target_token + base, e->argmax + base, sizeof(int32_t) * (size_t)n);
        }
    }

    /* 5. accept */
    kdt_tree_accept_params ap = {&tree, L > 0 ? L : 1, e->target_token, e->acc_nodes, e->acc_emit,
                                 e->acc_tau, e->acc_bonus, e->acc_error};
    st = e->kern->tree_accept(&ap, e->cuda_stream);
    if (st != KDT_OK) return st;

    /* 6. emit; streams that finish leave without a commit */
    double predicted = 0.0, realised = 0.0, emitted = 0.0;
    for (int32_t s = 0; s < S; s++) {
        const int32_t slot = e->slot_of[s];
        eng_stream *es = &e->streams[slot];
        const int32_t tau = e->acc_tau[s];
        if (s < g.n_draft) {
            predicted += kdt_round_surrogate(e, &tree, s);
            realised += tau - 1;
        }
        int32_t *evt = e->ev_tokens + (int64_t)slot * KDT_MAX_PATH;
        const int32_t n = kdt_round_emit(es, e->acc_emit + (int64_t)s * KDT_MAX_PATH, tau, evt);
        kdt_round_event(events, n_ev, es, evt, n, tau);
        e->stats.tokens_emitted += (uint64_t)n;
        emitted += n;
        e->stats.tau_hist[tau < 17 ? tau : 17]++;
        e->commit_tau[s] = es->finish == KDT_FINISH_NONE ? tau : 0;
    }

    /* 7. KV commit of the accepted rows, then the new lengths */
    const kdt_kv_layout *kl = &e->kv_layout;
    kdt_kv_commit_params cp = {S, kl->n_layers, kl->row_bytes, kl->page_size, kl->n_pages, kl->cache,
                               kl->layer_stride_bytes, NULL, kl->max_pages, e->b_prefix,
                               e->acc_nodes, e->commit_tau};
    /* the kernel indexes block tables by tree stream: gather the rows of this round's slots */
    int32_t *bt = malloc(sizeof(int32_t) * (size_t)S * (size_t)kl->max_pages);
    if (!bt) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine: block-table gather");
    for (int32_t s = 0; s < S; s++)
        memcpy(bt + (int64_t)s * kl->max_pages, kl->block_table + (int64_t)e->slot_of[s] * kl->max_pages,
               sizeof(int32_t) * (size_t)kl->max_pages);
    cp.block_table = bt;
    st = e->kern->kv_commit(&cp, e->cuda_stream);
    free(bt);
    if (st != KDT_OK) return st;
    for (int32_t s = 0; s < S && st == KDT_OK; s++) {
        eng_stream *es = &e->streams[e->slot_of[s]];
        if (e->commit_tau[s] == 0) continue;
        es->prefix_len += e->commit_tau[s];
        st = kdt_kv_stream_set_length(e->kv, e->slot_of[s], es->prefix_len);
    }
    if (st != KDT_OK) return st;
    const double t4 = kdt_engine_now();

    /* 8. drafter context: the taps of the accepted path (positions P .. P + tau - 1) */
    if (want_taps) {
        const int64_t row = (int64_t)e->n_taps * D;
        for (int32_t s = 0; s < g.n_draft && st == KDT_OK; s++) {
            eng_stream *es = &e->streams[e->slot_of[s]];
            const int32_t tau = e->commit_tau[s];
            if (tau == 0) continue;
            for (int32_t k = 0; k < tau; k++) {
                const int64_t node = (int64_t)s * stride + e->acc_nodes[(int64_t)s * KDT_MAX_PATH + k];
                memcpy(e->feat + k * row, e->taps + node * row, sizeof(float) * (size_t)row);
            }
            st = kdt_dflash_ctx_append(e->drafter, es->dctx, e->feat, tau);
        }
        if (st != KDT_OK) return st;
    }
    const double t5 = kdt_engine_now();

    /* 9. leave */
    for (int32_t s = 0; s < S; s++) {
        const int32_t slot = e->slot_of[s];
        if (e->streams[slot].finish != KDT_FINISH_NONE) {
            kdt_engine_release_stream(e, slot);
            e->streams[slot].state = SLOT_FREE;
        }
    }

    /* 10. stats and the auto controller */
    e->stats.rounds++;
    e->stats.stream_rounds += (uint64_t)S;
    e->stats.t_draft += (t1 - t0) + (t5 - t4);
    e->stats.t_build += t2 - t1;
    e->stats.t_verify += t3 - t2;
    e->stats.t_accept += t4 - t3;
    const round_timing tm = {.S = S, .stride = stride, .nodes = nodes_total, .drafts = drafts,
                             .fixed_s = (t1 - t0) + (t2 - t1) + (t4 - t3) + (t5 - t4), .verify_s = t3 - t2,
                             .have_accept = g.n_draft > 0, .predicted = predicted, .realised = realised,
                             .emitted = emitted, .wall_s = kdt_engine_now() - t0};
    kdt_round_observe(e, &g, &tm);
    return KDT_OK;
}

/* ---- step ---------------------------------------------------------------------------------- */

kdt_status kdt_engine_step(kdt_engine *e, kdt_stream_event *events, int32_t max_events,
                           int32_t *n_events) {
    KDT_CHECK_ARG(e != NULL, "kdt_engine_step: engine is NULL");
    KDT_CHECK_ARG(n_events != NULL, "kdt_engine_step: n_events is NULL");
    *n_events = 0;
    int32_t occupied = 0;
    for (int32_t i = 0; i < e->max_streams; i++) occupied += e->streams[i].state != SLOT_FREE;
    KDT_CHECK_ARG(events != NULL || occupied == 0, "kdt_engine_step: events is NULL");
    KDT_CHECK_ARG(max_events >= occupied,
                  "kdt_engine_step: max_events = %d, but %d streams may report (pass >= max_streams)",
                  max_events, occupied);
    kdt_status first_err = KDT_OK;

    /* a device that failed for good runs nothing again: every stream ends with an error */
    if (e->fault[0]) {
        for (int32_t i = 0; i < e->max_streams; i++) {
            eng_stream *s = &e->streams[i];
            if (s->state == SLOT_FREE) continue;
            if (s->state != SLOT_CLOSING) { /* a cancelled stream was released and keeps its finish */
                s->finish = KDT_FINISH_ERROR;
                kdt_engine_release_stream(e, i);
            }
            kdt_round_event(events, n_events, s, e->ev_tokens + (int64_t)i * KDT_MAX_PATH, 0, 0);
            s->state = SLOT_FREE;
        }
        return kdt_fail(KDT_ERR_CUDA, "kdt_engine_step: %s", e->fault);
    }

    /* streams cancelled since the last step report and leave */
    for (int32_t i = 0; i < e->max_streams; i++) {
        eng_stream *s = &e->streams[i];
        if (s->state != SLOT_CLOSING) continue;
        kdt_round_event(events, n_events, s, e->ev_tokens + (int64_t)i * KDT_MAX_PATH, 0, 0);
        s->state = SLOT_FREE;
    }

    /* the streams already decoding run this step's round; new ones prefill now, join next step */
    int32_t round_slots[KDT_ENGINE_MAX_STREAMS], n_round = 0;
    for (int32_t i = 0; i < e->max_streams; i++)
        if (e->streams[i].state == SLOT_ACTIVE) round_slots[n_round++] = i;

    const kdt_status pst = prefill_step(e, events, n_events);
    if (pst != KDT_OK && first_err == KDT_OK) first_err = pst;

    if (n_round > 0) {
        const int32_t before = *n_events;
        kdt_status st = run_round(e, round_slots, n_round, events, n_events);
        if (st != KDT_OK) {
            /* the round failed part-way: its streams end with an error (their KV state is not
             * trustworthy any more); events already written for them are replaced */
            *n_events = before;
            for (int32_t i = 0; i < n_round; i++) {
                eng_stream *s = &e->streams[round_slots[i]];
                if (s->state != SLOT_ACTIVE) continue;
                s->finish = KDT_FINISH_ERROR;
                kdt_round_event(events, n_events, s, e->ev_tokens + (int64_t)round_slots[i] * KDT_MAX_PATH, 0, 0);
                kdt_engine_release_stream(e, round_slots[i]);
                s->state = SLOT_FREE;
            }
            if (first_err == KDT_OK) first_err = st;
        }
    }
    if (first_err == KDT_ERR_CUDA && e->gpu && !e->fault[0]) {
        /* is the context still usable? A sticky error stays: record it (kdt_engine_fault) */
        char msg[160];
        snprintf(msg, sizeof msg, "%s", kdt_last_error());
        const char *sticky = kdt_engine_gpu_fault(e);
        if (sticky) {
            snprintf(e->fault, sizeof e->fault,
                     "the CUDA device failed (%s; first seen as: %.100s); restart the process", sticky, msg);
            kdt_fail(KDT_ERR_CUDA, "%s", e->fault);
        }
    }
    return first_err;
}
