/* kv_cache.c - the paged latent KV cache: a pool of 64-token pages shared by all streams, a
 * block table per stream, all-or-nothing page reservation, committed lengths (bookkeeping in
 * pages.c, shared with the GPU cache), and the commit step after tree verification (through
 * kdt_kv_commit_cpu). Memory layout
 * [n_layers][n_pages][64][kv_lora + rope] fp32. */
#include "model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

kdt_status kdt_kv_cache_create(const kdt_model *m, const kdt_kv_cache_options *opt, kdt_kv_cache **out) {
    KDT_CHECK_ARG(out, "kdt_kv_cache_create: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(m && opt, "kdt_kv_cache_create: model or options is NULL");
    const kdt_model_config *c = &m->cfg;
    KDT_CHECK_ARG(opt->n_pages >= 1 && opt->n_pages <= (1 << 26), "kdt_kv_cache_create: n_pages = %d",
                  opt->n_pages);
    KDT_CHECK_ARG(opt->max_streams >= 1 && opt->max_streams <= KDT_MAX_STREAMS,
                  "kdt_kv_cache_create: max_streams = %d (1..%d)", opt->max_streams, KDT_MAX_STREAMS);
    int32_t max_pages = opt->max_pages_per_stream;
    if (max_pages == 0) max_pages = (c->max_position_embeddings + KDT_KV_PAGE_SIZE - 1) / KDT_KV_PAGE_SIZE;
    KDT_CHECK_ARG(max_pages >= 1 && max_pages <= (1 << 24), "kdt_kv_cache_create: max_pages_per_stream = %d",
                  opt->max_pages_per_stream);
    const int32_t row = c->kv_lora_rank + c->qk_rope_head_dim;
    const size_t elems = (size_t)c->n_layers * (size_t)opt->n_pages * KDT_KV_PAGE_SIZE * (size_t)row;
    kdt_kv_cache *k = calloc(1, sizeof *k);
    if (!k) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_kv_cache_create");
    k->n_layers = c->n_layers;
    k->n_pages = opt->n_pages;
    k->page_size = KDT_KV_PAGE_SIZE;
    k->row_elems = row;
    k->max_streams = opt->max_streams;
    k->max_pages = max_pages;
    k->max_position = c->max_position_embeddings;
    k->data = malloc(elems * sizeof(float));
    k->block_table = malloc((size_t)opt->max_streams * (size_t)max_pages * sizeof(int32_t));
    k->n_stream_pages = calloc((size_t)opt->max_streams, sizeof(int32_t));
    k->length = calloc((size_t)opt->max_streams, sizeof(int32_t));
    k->written = calloc((size_t)opt->max_streams, sizeof(int32_t));
    k->free_list = malloc((size_t)opt->n_pages * sizeof(int32_t));
    if (!k->data || !k->block_table || !k->n_stream_pages || !k->length || !k->written || !k->free_list) {
        kdt_kv_cache_free(k);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_kv_cache_create: %zu MB of KV cache",
                        elems * sizeof(float) >> 20);
    }
    /* NaN poison: a read of a never-written row shows up in any result */
    for (size_t i = 0; i < elems; i++) k->data[i] = NAN;
    kdt_kv_cache_reset(k);
    *out = k;
    return KDT_OK;
}

void kdt_kv_cache_free(kdt_kv_cache *k) {
    if (!k) return;
    free(k->data);
    free(k->block_table);
    free(k->n_stream_pages);
    free(k->length);
    free(k->written);
    free(k->free_list);
    free(k);
}

static kdt_pages pages_of(kdt_kv_cache *k) {
    kdt_pages p = {"KV cache", k->max_streams, k->max_pages, k->n_pages, k->page_size, k->block_table,
                   k->n_stream_pages, k->length, k->written, k->free_list, &k->n_free};
    return p;
}

kdt_status kdt_kv_cache_reset(kdt_kv_cache *k) {
    KDT_CHECK_ARG(k, "kdt_kv_cache_reset: cache is NULL");
    const kdt_pages p = pages_of(k);
    kdt_pages_reset(&p);
    return KDT_OK;
}

kdt_status kdt_kv_reserve_many(kdt_kv_cache *k, int32_t n, const int32_t *streams, const int32_t *need) {
    const kdt_pages p = pages_of(k);
    int64_t total = 0;
    KDT_TRY(kdt_pages_count_new(&p, n, streams, need, &total));
    kdt_pages_assign(&p, n, streams, need, NULL, NULL);
    return KDT_OK;
}

kdt_status kdt_kv_stream_reserve(kdt_kv_cache *k, int32_t stream, int32_t n_slots) {
    KDT_CHECK_ARG(k, "kdt_kv_stream_reserve: cache is NULL");
    KDT_CHECK_ARG(stream >= 0 && stream < k->max_streams, "kdt_kv_stream_reserve: stream %d (0..%d)", stream,
                  k->max_streams - 1);
    KDT_CHECK_ARG(n_slots >= 0, "kdt_kv_stream_reserve: n_slots = %d", n_slots);
    return kdt_kv_reserve_many(k, 1, &stream, &n_slots);
}

kdt_status kdt_kv_stream_release(kdt_kv_cache *k, int32_t stream) {
    KDT_CHECK_ARG(k, "kdt_kv_stream_release: cache is NULL");
    const kdt_pages p = pages_of(k);
    return kdt_pages_release(&p, "kdt_kv_stream_release", stream);
}

int32_t kdt_kv_stream_length(const kdt_kv_cache *k, int32_t stream) {
    if (!k || stream < 0 || stream >= k->max_streams) return -1;
    return k->length[stream];
}

kdt_status kdt_kv_stream_set_length(kdt_kv_cache *k, int32_t stream, int32_t len) {
    KDT_CHECK_ARG(k, "kdt_kv_stream_set_length: cache is NULL");
    const kdt_pages p = pages_of(k);
    return kdt_pages_set_length(&p, "kdt_kv_stream_set_length", stream, len);
}

int32_t kdt_kv_cache_free_pages(const kdt_kv_cache *k) { return k ? k->n_free : 0; }

kdt_status kdt_kv_cache_layout(kdt_kv_cache *k, kdt_kv_layout *out) {
    KDT_CHECK_ARG(k && out, "kdt_kv_cache_layout: NULL argument");
    out->cache = k->data;
    out->dtype = KDT_F32;
    out->n_layers = k->n_layers;
    out->n_pages = k->n_pages;
    out->page_size = k->page_size;
    out->row_elems = k->row_elems;
    out->row_bytes = k->row_elems * (int32_t)sizeof(float);
    out->layer_stride_bytes = (int64_t)k->n_pages * k->page_size * k->row_elems * (int64_t)sizeof(float);
    out->block_table = k->block_table;
    out->max_streams = k->max_streams;
    out->max_pages = k->max_pages;
    return KDT_OK;
}

kdt_status kdt_kv_cache_commit(kdt_kv_cache *k, int32_t n_streams, const int32_t *stream_ids,
                               const int32_t *accepted, const int32_t *tau) {
    KDT_CHECK_ARG(k && accepted && tau, "kdt_kv_cache_commit: NULL argument");
    KDT_CHECK_ARG(n_streams >= 1 && n_streams <= k->max_streams, "kdt_kv_cache_commit: n_streams = %d",
                  n_streams);
    int32_t *table = malloc((size_t)n_streams * (size_t)k->max_pages * sizeof(int32_t));
    int32_t *prefix = malloc((size_t)n_streams * sizeof(int32_t));
    if (!table || !prefix) {
        free(table);
        free(prefix);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_kv_cache_commit");
    }
    kdt_status st = KDT_OK;
    for (int32_t i = 0; i < n_streams && st == KDT_OK; i++) {
        int32_t s = stream_ids ? stream_ids[i] : i;
        if (s < 0 || s >= k->max_streams) {
            st = kdt_fail(KDT_ERR_INVALID_ARG, "kdt_kv_cache_commit: stream_ids[%d] = %d", i, s);
            break;
        }
        for (int32_t j = 0; j < i; j++)
            if ((stream_ids ? stream_ids[j] : j) == s)
                st = kdt_fail(KDT_ERR_INVALID_ARG, "kdt_kv_cache_commit: stream %d listed twice", s);
        int32_t t = tau[i], P = k->length[s], tree_rows = k->written[s] - P;
        if (t < 0 || t > KDT_MAX_PATH || t > tree_rows) {
            if (st == KDT_OK)
                st = kdt_fail(KDT_ERR_INVALID_ARG, "kdt_kv_cache_commit: stream %d: tau %d (tree has %d rows)", s,
                              t, tree_rows);
            break;
        }
        for (int32_t a = 0; a < t && st == KDT_OK; a++) {
            int32_t node = accepted[(int64_t)i * KDT_MAX_PATH + a];
            int32_t prev = a ? accepted[(int64_t)i * KDT_MAX_PATH + a - 1] : -1;
            if (node <= prev || node >= tree_rows || (a == 0 && node != 0))
                st = kdt_fail(KDT_ERR_INVALID_ARG, "kdt_kv_cache_commit: stream %d: accepted[%d] = %d", s, a, node);
        }
        memcpy(table + (int64_t)i * k->max_pages, k->block_table + (int64_t)s * k->max_pages,
               (size_t)k->max_pages * sizeof(int32_t));
        prefix[i] = P;
    }
    if (st == KDT_OK) {
        kdt_kv_commit_params p = {
            .n_streams = n_streams,
            .n_layers = k->n_layers,
            .row_bytes = k->row_elems * (int32_t)sizeof(float),
            .page_size = k->page_size,
            .n_pages = k->n_pages,
            .cache = k->data,
            .layer_stride_bytes = (int64_t)k->n_pages * k->page_size * k->row_elems * (int64_t)sizeof(float),
            .block_table = table,
            .max_pages = k->max_pages,
            .prefix_len = prefix,
            .accepted = accepted,
            .tau = tau,
        };
        st = kdt_kv_commit_cpu(&p);
    }
    if (st == KDT_OK)
        for (int32_t i = 0; i < n_streams; i++) {
            int32_t s = stream_ids ? stream_ids[i] : i;
            if (tau[i] > 0) kdt_kv_stream_set_length(k, s, prefix[i] + tau[i]);
        }
    free(table);
    free(prefix);
    return st;
}
