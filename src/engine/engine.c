/* engine.c - the engine's lifecycle and bookkeeping: create/free (target, drafter, KV cache,
 * round buffers), stream admission (kdt_engine_add), cancel, stats, and the small enum helpers.
 * The decoding itself (prefill and the round) lives in round.c.
 *
 * Admission accounting: a stream is admitted only if the KV pool can hold its worst case, i.e.
 * ceil((prompt + max_new_tokens + budget_cap + 1) / 64) + 1 pages (the tree of a round occupies
 * up to 1 + B slots past the committed prefix). The model allocates pages lazily; because the sum
 * of admitted worst cases never exceeds the pool, a running stream never hits KDT_ERR_CAPACITY.
 */
#include "engine_internal.h"
#include "engine_gpu.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


kdt_status kdt_spec_mode_parse(const char *s, kdt_spec_mode *out) {
    KDT_CHECK_ARG(s != NULL && out != NULL, "kdt_spec_mode_parse: NULL argument");
    static const char *names[] = {"ar", "chain", "ddtree", "auto"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (kdt_spec_mode)i;
            return KDT_OK;
        }
    return kdt_fail(KDT_ERR_INVALID_ARG, "spec mode \"%s\": expected ar, chain, ddtree or auto", s);
}

const char *kdt_spec_mode_name(kdt_spec_mode m) {
    switch (m) {
    case KDT_SPEC_AR: return "ar";
    case KDT_SPEC_CHAIN: return "chain";
    case KDT_SPEC_DDTREE: return "ddtree";
    case KDT_SPEC_AUTO: return "auto";
    }
    return "?";
}

const char *kdt_finish_reason_name(kdt_finish_reason r) {
    switch (r) {
    case KDT_FINISH_NONE: return "none";
    case KDT_FINISH_STOP: return "stop";
    case KDT_FINISH_LENGTH: return "length";
    case KDT_FINISH_CANCELLED: return "cancelled";
    case KDT_FINISH_ERROR: return "error";
    }
    return "?";
}

void kdt_gen_params_default(kdt_gen_params *p) {
    if (!p) return;
    memset(p, 0, sizeof *p);
    p->spec = KDT_SPEC_DDTREE;
    p->budget = 32;
    p->temperature = 0.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->seed = 0;
    p->max_new_tokens = 256;
}

/* ---- create / free ------------------------------------------------------------------------- */

static void *xcalloc(size_t n, size_t size, kdt_status *st) {
    if (*st != KDT_OK) return NULL;
    void *p = calloc(n ? n : 1, size);
    if (!p) *st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine: %zu x %zu bytes", n, size);
    return p;
}

static kdt_status alloc_buffers(kdt_engine *e) {
    kdt_status st = KDT_OK;
    const size_t S = (size_t)e->max_streams, MN = (size_t)e->max_nodes;
    const size_t W = (size_t)KDT_MASK_WORDS(e->max_nodes);
    const size_t L = (size_t)(e->depth > 0 ? e->depth : 1), K = (size_t)e->top_k_max;
    e->streams = xcalloc(S, sizeof *e->streams, &st);
    e->arrival = xcalloc(S, sizeof *e->arrival, &st);
    e->t_n_nodes = xcalloc(S, sizeof(int32_t), &st);
    e->t_token = xcalloc(S * MN, sizeof(int32_t), &st);
    e->t_parent = xcalloc(S * MN, sizeof(int32_t), &st);
    e->t_depth = xcalloc(S * MN, sizeof(int32_t), &st);
    e->t_first_child = xcalloc(S * MN, sizeof(int32_t), &st);
    e->t_next_sibling = xcalloc(S * MN, sizeof(int32_t), &st);
    e->t_position = xcalloc(S * MN, sizeof(int32_t), &st);
    e->t_score = xcalloc(S * MN, sizeof(float), &st);
    e->t_mask = xcalloc(S * MN * W, sizeof(uint64_t), &st);
    e->slot_of = xcalloc(S, sizeof(int32_t), &st);
    e->b_depth_limit = xcalloc(S, sizeof(int32_t), &st);
    e->b_budget = xcalloc(S, sizeof(int32_t), &st);
    e->b_root = xcalloc(S, sizeof(int32_t), &st);
    e->b_prefix = xcalloc(S, sizeof(int32_t), &st);
    e->top_ids = xcalloc(S * L * K, sizeof(int32_t), &st);
    e->top_logp = xcalloc(S * L * K, sizeof(float), &st);
    e->argmax = xcalloc(S * MN, sizeof(int32_t), &st);
    e->target_token = xcalloc(S * MN, sizeof(int32_t), &st);
    e->feat = xcalloc((size_t)KDT_MAX_PATH * (size_t)(e->n_taps ? e->n_taps : 1) *
                          (size_t)e->mc->hidden_size, sizeof(float), &st);
    e->acc_nodes = xcalloc(S * KDT_MAX_PATH, sizeof(int32_t), &st);
    e->acc_emit = xcalloc(S * KDT_MAX_PATH, sizeof(int32_t), &st);
    e->acc_tau = xcalloc(S, sizeof(int32_t), &st);
    e->acc_bonus = xcalloc(S, sizeof(int32_t), &st);
    e->acc_error = xcalloc(S, sizeof(int32_t), &st);
    e->commit_tau = xcalloc(S, sizeof(int32_t), &st);
    e->ev_tokens = xcalloc(S * KDT_MAX_PATH, sizeof(int32_t), &st);
    e->auto_scores = xcalloc(S * MN, sizeof(float), &st);
    e->p_n_nodes = xcalloc(S, sizeof(int32_t), &st);
    e->p_tree = xcalloc(6 * S * MN, sizeof(int32_t), &st);
    e->p_score = xcalloc(S * MN, sizeof(float), &st);
    e->p_mask = xcalloc(S * MN * W, sizeof(uint64_t), &st);
    if (st == KDT_OK && kdt_sampler_scratch_reserve(&e->sampler, e->mc->vocab_size) != 0)
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine: sampler scratch");
    return st;
}

kdt_status kdt_engine_create(const kdt_engine_options *opt, kdt_engine **out) {
    KDT_CHECK_ARG(out != NULL, "kdt_engine_create: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(opt != NULL, "kdt_engine_create: options are NULL");
    KDT_CHECK_ARG(opt->model_dir != NULL && opt->model_dir[0],
                  "kdt_engine_create: model_dir is empty (the target checkpoint directory)");
    const int32_t max_streams = opt->max_streams ? opt->max_streams : 8;
    const int32_t max_budget = opt->max_budget ? opt->max_budget : 64;
    KDT_CHECK_ARG(max_streams >= 1 && max_streams <= KDT_ENGINE_MAX_STREAMS,
                  "kdt_engine_create: max_streams = %d, expected 1..%d", opt->max_streams, KDT_ENGINE_MAX_STREAMS);
    KDT_CHECK_ARG(max_budget >= 1 && max_budget <= KDT_MAX_BUDGET,
                  "kdt_engine_create: max_budget = %d, expected 1..%d", opt->max_budget, KDT_MAX_BUDGET);
    KDT_CHECK_ARG(opt->max_context >= 0, "kdt_engine_create: max_context = %d", opt->max_context);
    KDT_CHECK_ARG(opt->kv_pages >= 0, "kdt_engine_create: kv_pages = %d", opt->kv_pages);
    KDT_CHECK_ARG(opt->max_prefill_tokens >= 0, "kdt_engine_create: max_prefill_tokens = %d, expected >= 0 "
                  "(0 = no limit)", opt->max_prefill_tokens);
    KDT_CHECK_ARG(opt->prefill_chunk >= 0 && opt->prefill_chunk <= KDT_MAX_PREFILL_CHUNK,
                  "kdt_engine_create: prefill_chunk = %d, expected 1..%d (0 = the device's default)",
                  opt->prefill_chunk, KDT_MAX_PREFILL_CHUNK);
    KDT_CHECK_ARG(opt->device == KDT_DEVICE_AUTO || opt->device == KDT_DEVICE_CPU ||
                      opt->device == KDT_DEVICE_CUDA,
                  "kdt_engine_create: device = %d", (int)opt->device);
    if (opt->device == KDT_DEVICE_CUDA) {
        if (!kdt_has_cuda())
            return kdt_fail(KDT_ERR_NO_CUDA, "device cuda: this kdtree build has no CUDA support");
        if (!kdt_engine_gpu_available())
            return kdt_fail(KDT_ERR_CUDA, "device cuda: no usable CUDA device (driver missing or no GPU)");
    }
    const int use_gpu = opt->device == KDT_DEVICE_CUDA ||
                        (opt->device == KDT_DEVICE_AUTO && kdt_engine_gpu_available());

    kdt_engine *e = calloc(1, sizeof *e);
    if (!e) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine");
    e->kern = &kdt_engine_kernels_cpu;
    e->max_streams = max_streams;
    e->max_budget = max_budget;
    e->prefill_attention = opt->prefill_attention;
    /* the CPU's default chunk: the model's 64 rows for the absorbed form, whose time grows with the
     * chunk there, 256 where plain chunks may come, which amortize kv_b's up-projection of the
     * prefix over more rows (bench/RESULTS.md session 44: auto 0.57 s at 64, 0.48 s at 256) */
    const int32_t cpu_chunk = opt->prefill_chunk ? opt->prefill_chunk
                              : opt->prefill_attention == KDT_PREFILL_ABSORBED ? KDT_DEFAULT_PREFILL_CHUNK
                                                                               : 256;
    e->prefill_chunk = opt->prefill_chunk;
    e->prefill_quantum = cpu_chunk; /* the GPU sets its own */
    e->max_prefill_tokens = opt->max_prefill_tokens;
    e->next_id = 1;
    kdt_model_options mo = {opt->verbose ? 1 : 0, cpu_chunk, opt->prefill_attention};
    kdt_status st = kdt_model_load(opt->model_dir, &mo, &e->model);
    if (st != KDT_OK) goto fail;
    e->mc = kdt_model_get_config(e->model);
    const int32_t max_pos = e->mc->max_position_embeddings;
    if (opt->max_context > max_pos) {
        st = kdt_fail(KDT_ERR_INVALID_ARG, "max_context = %d exceeds the model's "
                      "max_position_embeddings %d", opt->max_context, max_pos);
        goto fail;
    }
    e->max_context = opt->max_context ? opt->max_context : max_pos;

    if (opt->draft_dir && opt->draft_dir[0]) {
        kdt_dflash_options dopt = {opt->yarn_legacy_amplitude ? KDT_YARN_AMP_LEGACY : KDT_YARN_AMP_HF,
                                   opt->verbose ? 1 : 0};
        st = kdt_dflash_load(opt->draft_dir, e->model, &dopt, &e->drafter);
        if (st != KDT_OK) goto fail;
        const kdt_dflash_config *dc = kdt_dflash_get_config(e->drafter);
        e->depth = dc->block_size - 1;
        e->n_taps = dc->n_taps;
        e->tap_layers = dc->tap_layers;
    }
    {
        int32_t deepest = e->depth > 0 ? e->depth : KDT_MAX_DEPTH; /* room for a test drafter */
        e->max_nodes = 1 + (max_budget > deepest ? max_budget : deepest);
        if (e->max_nodes > KDT_MAX_NODES) e->max_nodes = KDT_MAX_NODES;
        int32_t k = max_budget < e->mc->vocab_size ? max_budget : e->mc->vocab_size;
        e->top_k_max = k < KDT_MAX_TOPK ? k : KDT_MAX_TOPK;
    }
    {
        const int64_t per = ((int64_t)e->max_context + e->max_nodes + KDT_KV_PAGE_SIZE - 1) /
                                KDT_KV_PAGE_SIZE + 1;
        e->pages_per_stream_max = (int32_t)per;
        int64_t total = opt->kv_pages ? opt->kv_pages : per * max_streams;
        if (total > INT32_MAX / 2) total = INT32_MAX / 2;
        e->pages_total = (int32_t)total;
        if (!use_gpu) { /* the GPU side makes its own cache on the device */
            kdt_kv_cache_options ko = {e->pages_total, max_streams, e->pages_per_stream_max};
            st = kdt_kv_cache_create(e->model, &ko, &e->kv);
            if (st != KDT_OK) goto fail;
            st = kdt_kv_cache_layout(e->kv, &e->kv_layout);
            if (st != KDT_OK) goto fail;
        }
    }
    /* buffers are sized for the largest depth a test drafter may ask for when there is none */
    {
        int32_t saved = e->depth;
        if (e->depth == 0) e->depth = KDT_MAX_DEPTH;
        st = alloc_buffers(e);
        e->depth = saved;
        if (st != KDT_OK) goto fail;
    }
    if (use_gpu) {
        st = kdt_engine_gpu_create(e, opt->verbose);
        if (st != KDT_OK) goto fail;
    }
    kdt_budget_init(&e->budget, opt->verify_cost_base_s, opt->verify_cost_per_node_s);
    if (e->gpu) { /* the GPU pass costs by padded rows, not by nodes (budget.h) */
        int32_t pad_first = 0, pad_step = 0;
        kdt_gpu_row_padding(&pad_first, &pad_step);
        kdt_budget_set_padding(&e->budget, pad_first, pad_step);
    }
    e->stats.kv_pages_total = e->pages_total;
    *out = e;
    return KDT_OK;
fail:
    kdt_engine_free(e);
    return st;
}

void kdt_engine_free(kdt_engine *e) {
    if (!e) return;
    if (e->streams)
        for (int32_t i = 0; i < e->max_streams; i++) {
            kdt_dflash_ctx_free(e->streams[i].dctx);
            free(e->streams[i].stop);
            free(e->streams[i].tokens);
        }
    kdt_engine_gpu_free(e);
    kdt_kv_cache_free(e->kv);
    kdt_dflash_free(e->drafter);
    kdt_model_free(e->model);
    void *bufs[] = {e->streams, e->arrival, e->t_n_nodes, e->t_token, e->t_parent, e->t_depth,
                    e->t_first_child, e->t_next_sibling, e->t_position, e->t_score, e->t_mask,
                    e->slot_of, e->b_depth_limit, e->b_budget, e->b_root, e->b_prefix, e->top_ids,
                    e->top_logp, e->draft_logits, e->argmax, e->target_token, e->logits, e->taps,
                    e->feat, e->acc_nodes, e->acc_emit, e->acc_tau, e->acc_bonus, e->acc_error,
                    e->commit_tau, e->ev_tokens, e->auto_scores, e->p_n_nodes, e->p_tree, e->p_score,
                    e->p_mask};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    kdt_sampler_scratch_free(&e->sampler);
    free(e);
}

kdt_status kdt_engine_set_test_drafter(kdt_engine *e, int32_t n_positions, kdt_engine_test_draft_fn fn,
                                       void *user) {
    KDT_CHECK_ARG(e && fn, "kdt_engine_set_test_drafter: NULL argument");
    KDT_CHECK_ARG(!e->drafter, "kdt_engine_set_test_drafter: the engine already has a drafter");
    KDT_CHECK_ARG(n_positions >= 1 && n_positions <= KDT_MAX_DEPTH && 1 + n_positions <= e->max_nodes,
                  "kdt_engine_set_test_drafter: n_positions = %d, expected 1..%d", n_positions,
                  KDT_MAX_DEPTH);
    for (int32_t i = 0; i < e->max_streams; i++)
        KDT_CHECK_ARG(e->streams[i].state == SLOT_FREE,
                      "kdt_engine_set_test_drafter: streams exist already");
    e->test_draft = fn;
    e->test_user = user;
    e->depth = n_positions;
    return KDT_OK;
}

const kdt_model *kdt_engine_model(const kdt_engine *e) { return e ? e->model : NULL; }

/* ---- streams ------------------------------------------------------------------------------- */

static int32_t pages_for(int64_t slots) {
    return (int32_t)((slots + KDT_KV_PAGE_SIZE - 1) / KDT_KV_PAGE_SIZE + 1);
}

kdt_status kdt_engine_add(kdt_engine *e, const int32_t *prompt, int32_t n_prompt,
                          const kdt_gen_params *params, int32_t *stream_id) {
    KDT_CHECK_ARG(e != NULL, "kdt_engine_add: engine is NULL");
    KDT_CHECK_ARG(params != NULL, "kdt_engine_add: params is NULL");
    KDT_CHECK_ARG(n_prompt >= 1, "kdt_engine_add: n_prompt = %d, expected >= 1", n_prompt);
    KDT_CHECK_ARG(prompt != NULL, "kdt_engine_add: prompt is NULL");
    if (e->fault[0]) return kdt_fail(KDT_ERR_CUDA, "kdt_engine_add: %s", e->fault);
    const int32_t V = e->mc->vocab_size;
    for (int32_t i = 0; i < n_prompt; i++)
        KDT_CHECK_ARG(prompt[i] >= 0 && prompt[i] < V,
                      "kdt_engine_add: prompt token %d at index %d is outside the vocabulary 0..%d",
                      prompt[i], i, V - 1);
    const kdt_gen_params *p = params;
    KDT_CHECK_ARG(p->spec >= KDT_SPEC_AR && p->spec <= KDT_SPEC_AUTO, "kdt_engine_add: spec = %d",
                  (int)p->spec);
    const int has_drafter = e->drafter != NULL || e->test_draft != NULL;
    KDT_CHECK_ARG(p->spec == KDT_SPEC_AR || has_drafter,
                  "kdt_engine_add: spec \"%s\" needs a drafter (the engine was created without "
                  "draft_dir)", kdt_spec_mode_name(p->spec));
    if (p->spec == KDT_SPEC_DDTREE || p->spec == KDT_SPEC_AUTO)
        KDT_CHECK_ARG(p->budget >= 1 && p->budget <= e->max_budget,
                      "kdt_engine_add: budget = %d, expected 1..%d (the engine's max_budget)",
                      p->budget, e->max_budget);
    KDT_CHECK_ARG(isfinite(p->temperature) && p->temperature >= 0.0f,
                  "kdt_engine_add: temperature = %g, expected >= 0", (double)p->temperature);
    KDT_CHECK_ARG(p->top_k >= 0, "kdt_engine_add: top_k = %d, expected >= 0", p->top_k);
    KDT_CHECK_ARG(p->top_p > 0.0f && p->top_p <= 1.0f, "kdt_engine_add: top_p = %g, expected (0, 1]",
                  (double)p->top_p);
    KDT_CHECK_ARG(p->max_new_tokens >= 1, "kdt_engine_add: max_new_tokens = %d, expected >= 1",
                  p->max_new_tokens);
    KDT_CHECK_ARG(p->n_stop >= 0 && p->n_stop <= 4096, "kdt_engine_add: n_stop = %d, expected 0..4096",
                  p->n_stop);
    KDT_CHECK_ARG(p->n_stop == 0 || p->stop_ids != NULL, "kdt_engine_add: stop_ids is NULL");
    for (int32_t i = 0; i < p->n_stop; i++)
        KDT_CHECK_ARG(p->stop_ids[i] >= 0 && p->stop_ids[i] < V,
                      "kdt_engine_add: stop id %d at index %d is outside the vocabulary 0..%d",
                      p->stop_ids[i], i, V - 1);
    KDT_CHECK_ARG(stream_id != NULL, "kdt_engine_add: stream_id is NULL");

    if ((int64_t)n_prompt + p->max_new_tokens > e->max_context)
        return kdt_fail(KDT_ERR_CAPACITY, "kdt_engine_add: prompt (%d tokens) + max_new_tokens (%d) "
                        "exceeds the context of %d tokens", n_prompt, p->max_new_tokens,
                        e->max_context);
    int32_t slot = -1;
    for (int32_t i = 0; i < e->max_streams; i++)
        if (e->streams[i].state == SLOT_FREE) {
            slot = i;
            break;
        }
    if (slot < 0)
        return kdt_fail(KDT_ERR_CAPACITY, "kdt_engine_add: all %d stream slots are in use; retry "
                        "after a stream finishes", e->max_streams);
    int32_t cap = 0;
    if (p->spec == KDT_SPEC_CHAIN) cap = e->depth;
    else if (p->spec != KDT_SPEC_AR) cap = p->budget;
    const int32_t pages = pages_for((int64_t)n_prompt + p->max_new_tokens + cap + 1);
    if (pages > e->pages_per_stream_max)
        return kdt_fail(KDT_ERR_CAPACITY, "kdt_engine_add: the stream needs %d KV pages, a stream "
                        "may hold %d", pages, e->pages_per_stream_max);
    if (e->pages_reserved + pages > e->pages_total)
        return kdt_fail(KDT_ERR_CAPACITY, "kdt_engine_add: the KV pool has %d of %d pages free, the "
                        "stream needs %d; retry after a stream finishes",
                        e->pages_total - e->pages_reserved, e->pages_total, pages);

    eng_stream *s = &e->streams[slot];
    const int32_t cap_tokens = n_prompt + p->max_new_tokens;
    int32_t *tokens = realloc(s->tokens, sizeof(int32_t) * (size_t)cap_tokens);
    if (!tokens) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_engine_add: %d tokens", cap_tokens);
    s->tokens = tokens;
    int32_t *stop = realloc(s->stop, sizeof(int32_t) * (size_t)(p->n_stop ? p->n_stop : 1));
    if (!stop) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_engine_add: stop ids");
    s->stop = stop;
    const int drafts = p->spec != KDT_SPEC_AR && has_drafter;
    if (drafts && e->drafter && !e->gpu) { /* on the GPU the context lives in the drafter's slots */
        if (!s->dctx) KDT_TRY(kdt_dflash_ctx_create(e->drafter, e->max_context, &s->dctx));
        kdt_dflash_ctx_reset(s->dctx);
    }
    memcpy(s->tokens, prompt, sizeof(int32_t) * (size_t)n_prompt);
    if (p->n_stop) memcpy(s->stop, p->stop_ids, sizeof(int32_t) * (size_t)p->n_stop);
    s->params = *p;
    s->params.stop_ids = s->stop;
    s->budget_cap = cap;
    s->n_prompt = s->n_tokens = n_prompt;
    s->cap_tokens = cap_tokens;
    s->n_emitted = 0;
    s->prefix_len = 0;
    s->pages_reserved = pages;
    s->drafts = drafts;
    s->finish = KDT_FINISH_NONE;
    kdt_rng_seed(&s->rng, p->seed);
    s->id = e->next_id;
    e->next_id = e->next_id == INT32_MAX ? 1 : e->next_id + 1;
    s->state = SLOT_WAITING;
    e->arrival[slot] = ++e->add_seq;
    e->pages_reserved += pages;
    *stream_id = s->id;
    return KDT_OK;
}

void kdt_engine_release_stream(kdt_engine *e, int32_t slot) {
    eng_stream *s = &e->streams[slot];
    if (e->gpu) kdt_engine_gpu_release(e, slot);
    else kdt_kv_stream_release(e->kv, slot);
    if (s->dctx) kdt_dflash_ctx_reset(s->dctx);
    e->pages_reserved -= s->pages_reserved;
    s->pages_reserved = 0;
}

kdt_status kdt_engine_cancel(kdt_engine *e, int32_t stream_id) {
    KDT_CHECK_ARG(e != NULL, "kdt_engine_cancel: engine is NULL");
    for (int32_t i = 0; i < e->max_streams; i++) {
        eng_stream *s = &e->streams[i];
        if (s->id != stream_id || s->state == SLOT_FREE) continue;
        if (s->state == SLOT_CLOSING) return KDT_OK; /* already finished; its event is pending */
        kdt_engine_release_stream(e, i);
        s->state = SLOT_CLOSING;
        s->finish = KDT_FINISH_CANCELLED;
        return KDT_OK;
    }
    return kdt_fail(KDT_ERR_INVALID_ARG, "kdt_engine_cancel: no stream with id %d", stream_id);
}

const char *kdt_engine_fault(const kdt_engine *e) { return e && e->fault[0] ? e->fault : NULL; }

int kdt_engine_busy(const kdt_engine *e) {
    if (!e) return 0;
    for (int32_t i = 0; i < e->max_streams; i++)
        if (e->streams[i].state != SLOT_FREE) return 1;
    return 0;
}

void kdt_engine_get_stats(const kdt_engine *e, kdt_engine_stats *out) {
    if (!e || !out) return;
    *out = e->stats;
    out->kv_pages_total = e->pages_total;
    out->kv_pages_used = e->pages_total - (e->gpu ? kdt_engine_gpu_free_pages(e) : kdt_kv_cache_free_pages(e->kv));
    out->active_streams = out->waiting_streams = 0;
    for (int32_t i = 0; i < e->max_streams; i++) {
        if (e->streams[i].state == SLOT_ACTIVE) out->active_streams++;
        if (e->streams[i].state == SLOT_WAITING) out->waiting_streams++;
    }
}

int32_t kdt_engine_vocab_size(const kdt_engine *e) { return e ? e->mc->vocab_size : 0; }
int32_t kdt_engine_max_context(const kdt_engine *e) { return e ? e->max_context : 0; }
int32_t kdt_engine_draft_depth(const kdt_engine *e) { return e ? e->depth : 0; }

void kdt_engine_eos_ids(const kdt_engine *e, const int32_t **ids, int32_t *n) {
    if (ids) *ids = e ? e->mc->eos_token_ids : NULL;
    if (n) *n = e ? e->mc->n_eos : 0;
}

int32_t kdt_engine_prefill_chunk(const kdt_engine *e) { return e ? e->prefill_quantum : 0; }

const char *kdt_engine_device_name(const kdt_engine *e) {
    if (!e) return "none";
    return e->gpu ? kdt_engine_gpu_device_name(e) : "cpu";
}
