/* checks.c - argument checks the CPU forward (forward.c) and the GPU forward (cuda/gpu_forward.c)
 * share, so both refuse the same input with the same message: stream ids, token ids, the segments
 * of a multi-stream prefill and the shape of a verify tree (model_internal.h). */
#include "model_internal.h"

#include <stdlib.h>

kdt_status kdt_resolve_stream_ids(const char *fn, const int32_t *stream_ids, int32_t n, int32_t max_streams,
                                  int32_t *ids) {
    uint8_t *seen = calloc((size_t)(max_streams > 0 ? max_streams : 1), 1);
    if (!seen) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: stream ids", fn);
    kdt_status st = KDT_OK;
    for (int32_t s = 0; s < n; s++) {
        const int32_t id = stream_ids ? stream_ids[s] : s;
        if (id < 0 || id >= max_streams || seen[id]) {
            st = kdt_fail(KDT_ERR_INVALID_ARG, "%s: stream_ids[%d] = %d is out of range or repeated", fn, s, id);
            break;
        }
        seen[id] = 1;
        ids[s] = id;
    }
    free(seen);
    return st;
}

kdt_status kdt_check_token(const char *fn, const kdt_model_config *cfg, int32_t tok, const char *what, int64_t i) {
    if (tok < 0 || tok >= cfg->vocab_size)
        return kdt_fail(KDT_ERR_INVALID_ARG, "%s: %s[%lld] = %d is not a token id (vocab %d)", fn, what,
                        (long long)i, tok, cfg->vocab_size);
    return KDT_OK;
}

kdt_status kdt_check_prefill_segments(const char *fn, const kdt_model_config *cfg, int32_t n_segments,
                                      const kdt_prefill_segment *segs, int32_t max_streams, const int32_t *length,
                                      int32_t seg_max, const char *seg_max_what, int32_t total_max,
                                      const char *total_max_what) {
    KDT_CHECK_ARG(segs, "%s: segments is NULL", fn);
    KDT_CHECK_ARG(n_segments >= 1 && n_segments <= max_streams, "%s: n_segments = %d (1..%d, the cache's streams)",
                  fn, n_segments, max_streams);
    int64_t total = 0;
    for (int32_t k = 0; k < n_segments; k++) {
        const kdt_prefill_segment *sg = &segs[k];
        KDT_CHECK_ARG(sg->stream >= 0 && sg->stream < max_streams, "%s: segment %d: stream %d (0..%d)", fn, k,
                      sg->stream, max_streams - 1);
        for (int32_t j = 0; j < k; j++)
            KDT_CHECK_ARG(segs[j].stream != sg->stream, "%s: stream %d in segments %d and %d", fn, sg->stream, j, k);
        KDT_CHECK_ARG(sg->tokens, "%s: segment %d: tokens is NULL", fn, k);
        KDT_CHECK_ARG(sg->n >= 1 && sg->n <= seg_max, "%s: segment %d: n = %d (1..%d, %s)", fn, k, sg->n, seg_max,
                      seg_max_what);
        total += sg->n;
        KDT_CHECK_ARG(total <= total_max, "%s: %lld rows in %d segments exceed %s %d", fn, (long long)total, k + 1,
                      total_max_what, total_max);
        for (int32_t i = 0; i < sg->n; i++) KDT_TRY(kdt_check_token(fn, cfg, sg->tokens[i], "tokens", i));
        const int32_t len = length[sg->stream];
        if ((int64_t)len + sg->n > cfg->max_position_embeddings)
            return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: %d + %d tokens exceed max_position_embeddings %d", fn,
                            sg->stream, len, sg->n, cfg->max_position_embeddings);
    }
    return KDT_OK;
}

kdt_status kdt_check_tree_stream(const char *fn, const kdt_model_config *cfg, const kdt_tree *t, int32_t s, int32_t P,
                                 int32_t *max_depth) {
    const int32_t n = t->n_nodes[s], W = KDT_MASK_WORDS(t->max_nodes);
    const int64_t base = (int64_t)s * t->max_nodes;
    if (n < 1 || n > t->max_nodes)
        return kdt_fail(KDT_ERR_MALFORMED_TREE, "%s: stream %d: n_nodes = %d (1..%d)", fn, s, n, t->max_nodes);
    int32_t deepest = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t p = t->parent[base + i], d = t->depth[base + i];
        const int32_t want_depth = i == 0 ? 0 : (p >= 0 && p < i ? t->depth[base + p] + 1 : -1);
        if ((i == 0 && p != -1) || (i > 0 && (p < 0 || p >= i)))
            return kdt_fail(KDT_ERR_MALFORMED_TREE, "%s: stream %d: node %d has parent %d", fn, s, i, p);
        if (d != want_depth)
            return kdt_fail(KDT_ERR_MALFORMED_TREE, "%s: stream %d: node %d has depth %d, expected %d", fn, s, i, d,
                            want_depth);
        if (t->position[base + i] != P + d)
            return kdt_fail(KDT_ERR_MALFORMED_TREE,
                            "%s: stream %d: node %d has position %d, expected stream length %d + depth %d", fn, s, i,
                            t->position[base + i], P, d);
        if ((int64_t)P + d >= cfg->max_position_embeddings)
            return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: position %d reaches max_position_embeddings %d", fn, s,
                            P + d, cfg->max_position_embeddings);
        KDT_TRY(kdt_check_token(fn, cfg, t->token[base + i], "tree token", base + i));
        const uint64_t *row = t->anc_mask + (base + i) * W;
        const uint64_t *prow = i ? t->anc_mask + (base + p) * W : NULL;
        for (int32_t w = 0; w < W; w++) {
            uint64_t want = prow ? prow[w] : 0;
            if (w == i / 64) want |= (uint64_t)1 << (i % 64);
            if (row[w] != want)
                return kdt_fail(KDT_ERR_MALFORMED_TREE,
                                "%s: stream %d: ancestor mask of node %d is not {itself} + its parent's", fn, s, i);
        }
        if (d > deepest) deepest = d;
    }
    if (max_depth) *max_depth = deepest;
    return KDT_OK;
}
