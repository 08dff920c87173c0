/* tree_build.c - CPU reference of tree_build (the DDTree best-first heap and the DFlash chain)
 * and the argument check it shares with the CUDA launcher (kdt_tree_build_check_args, declared
 * in ../tree_build_internal.h).
 *
 * Per stream: a binary max-heap of candidates ordered by the packed 64-bit key of
 * tree_build_internal.h. Pop the largest key, make it node i (i = 1, 2, ...), push its next
 * sibling (rank + 1 < top_k) and its first child (depth < L). Each candidate carries the index of
 * its previous sibling (the node whose pop pushed it) so first_child / next_sibling are filled as
 * nodes appear. The ancestor mask row of node i is its parent's row plus bit i.
 *
 * The pop sequence only depends on the set of candidates and the total order of their keys, so
 * the GPU kernel, which keeps the frontier in a completely different structure, pops the same
 * nodes in the same order and produces the same bits.
 */
#include "common.h"
#include "fp.h"
#include "kdtree/kernels.h"
#include "kernels/tree_build_internal.h"

#include <math.h>
#include <string.h>

kdt_status kdt_tree_build_check_args(const kdt_tree_build_params *p, const kdt_tree *out,
                                     int host_arrays, const char *who) {
    KDT_CHECK_ARG(p != NULL, "%s: params is NULL", who);
    KDT_CHECK_ARG(out != NULL, "%s: out tree is NULL", who);
    KDT_CHECK_ARG(p->n_streams >= 1 && p->n_streams <= KDT_MAX_STREAMS,
                  "%s: n_streams = %d, expected 1..%d", who, p->n_streams, KDT_MAX_STREAMS);
    KDT_CHECK_ARG(out->n_streams == p->n_streams,
                  "%s: out->n_streams = %d does not match params n_streams = %d", who,
                  out->n_streams, p->n_streams);
    KDT_CHECK_ARG(out->max_nodes >= 1 && out->max_nodes <= KDT_MAX_NODES,
                  "%s: out->max_nodes = %d, expected 1..%d", who, out->max_nodes, KDT_MAX_NODES);
    KDT_CHECK_ARG(p->max_depth >= 1 && p->max_depth <= KDT_MAX_DEPTH,
                  "%s: max_depth = %d, expected 1..%d", who, p->max_depth, KDT_MAX_DEPTH);
    KDT_CHECK_ARG(p->top_k >= 1 && p->top_k <= KDT_MAX_TOPK, "%s: top_k = %d, expected 1..%d",
                  who, p->top_k, KDT_MAX_TOPK);
    KDT_CHECK_ARG(p->chain == 0 || p->chain == 1, "%s: chain = %d, expected 0 or 1", who,
                  p->chain);
    KDT_CHECK_ARG(p->top_ids != NULL, "%s: top_ids is NULL", who);
    KDT_CHECK_ARG(p->top_logp != NULL, "%s: top_logp is NULL", who);
    KDT_CHECK_ARG(p->depth_limit != NULL, "%s: depth_limit is NULL", who);
    KDT_CHECK_ARG(p->budget != NULL, "%s: budget is NULL", who);
    KDT_CHECK_ARG(p->root_token != NULL, "%s: root_token is NULL", who);
    KDT_CHECK_ARG(p->prefix_len != NULL, "%s: prefix_len is NULL", who);
    KDT_CHECK_ARG(out->n_nodes != NULL, "%s: out->n_nodes is NULL", who);
    KDT_CHECK_ARG(out->token != NULL, "%s: out->token is NULL", who);
    KDT_CHECK_ARG(out->parent != NULL, "%s: out->parent is NULL", who);
    KDT_CHECK_ARG(out->depth != NULL, "%s: out->depth is NULL", who);
    KDT_CHECK_ARG(out->first_child != NULL, "%s: out->first_child is NULL", who);
    KDT_CHECK_ARG(out->next_sibling != NULL, "%s: out->next_sibling is NULL", who);
    KDT_CHECK_ARG(out->position != NULL, "%s: out->position is NULL", who);
    KDT_CHECK_ARG(out->score != NULL, "%s: out->score is NULL", who);
    KDT_CHECK_ARG(out->anc_mask != NULL, "%s: out->anc_mask is NULL", who);
    if (host_arrays) {
        for (int32_t s = 0; s < p->n_streams; s++) {
            KDT_CHECK_ARG(p->budget[s] >= 0 && p->budget[s] <= out->max_nodes - 1,
                          "%s: budget[%d] = %d, expected 0..out->max_nodes-1 = %d", who, s,
                          p->budget[s], out->max_nodes - 1);
            KDT_CHECK_ARG(p->depth_limit[s] >= 1 && p->depth_limit[s] <= p->max_depth,
                          "%s: depth_limit[%d] = %d, expected 1..max_depth = %d", who, s,
                          p->depth_limit[s], p->max_depth);
            KDT_CHECK_ARG(p->prefix_len[s] >= 0 && p->prefix_len[s] <= INT32_MAX - KDT_MAX_DEPTH,
                          "%s: prefix_len[%d] = %d, expected 0..%d", who, s, p->prefix_len[s],
                          INT32_MAX - KDT_MAX_DEPTH);
        }
    }
    return KDT_OK;
}

/* One frontier entry. */
typedef struct candidate {
    uint64_t key;      /* packed order key (tree_build_internal.h) */
    float score;       /* score[parent] + top_logp[depth-1][rank] */
    int32_t prev_sib;  /* node index of the previous sibling (rank - 1), -1 for rank 0 */
} candidate;

/* Max-heap on key, heap[0] the largest. */
static void heap_push(candidate *heap, int32_t *n, candidate c) {
    int32_t i = (*n)++;
    while (i > 0) {
        int32_t up = (i - 1) / 2;
        if (heap[up].key >= c.key) break;
        heap[i] = heap[up];
        i = up;
    }
    heap[i] = c;
}

static candidate heap_pop(candidate *heap, int32_t *n) {
    candidate top = heap[0], last = heap[--(*n)];
    int32_t i = 0;
    for (;;) {
        int32_t child = 2 * i + 1;
        if (child >= *n) break;
        if (child + 1 < *n && heap[child + 1].key > heap[child].key) child++;
        if (heap[child].key <= last.key) break;
        heap[i] = heap[child];
        i = child;
    }
    if (*n > 0) heap[i] = last;
    return top;
}

/* score[parent] + log-prob as one fp32 add; NaN -> -inf (tree_build_internal.h). */
static float add_score(float parent_score, float logp) {
    float s = parent_score + logp;
    return isnan(s) ? -INFINITY : s;
}

static candidate make_candidate(float score, int32_t depth, int32_t parent, int32_t rank,
                                int32_t prev_sib) {
    candidate c;
    c.key = ((uint64_t)kdt_f32_order_key(score) << 32) | kdt_tb_tie_bits(depth, parent, rank);
    c.score = score;
    c.prev_sib = prev_sib;
    return c;
}

/* Builds stream s; p and out already validated. */
static void build_stream(const kdt_tree_build_params *p, kdt_tree *out, int32_t s,
                         candidate *heap /* [KDT_MAX_NODES + 1] scratch */) {
    const int32_t max_nodes = out->max_nodes, top_k = p->top_k;
    const int32_t n_words = KDT_MASK_WORDS(max_nodes);
    const int32_t budget = p->budget[s], depth_limit = p->depth_limit[s];
    const int64_t base = (int64_t)s * max_nodes;
    const int32_t *ids = p->top_ids + (int64_t)s * p->max_depth * top_k;     /* [max_depth][K] */
    const float *logp = p->top_logp + (int64_t)s * p->max_depth * top_k;    /* [max_depth][K] */
    int32_t *token = out->token + base, *parent = out->parent + base, *depth = out->depth + base;
    int32_t *first_child = out->first_child + base, *next_sibling = out->next_sibling + base;
    int32_t *position = out->position + base;
    float *score = out->score + base;
    uint64_t *mask = out->anc_mask + base * n_words;                       /* [max_nodes][W] */

    for (int32_t i = 0; i < max_nodes; i++) {
        token[i] = parent[i] = depth[i] = first_child[i] = next_sibling[i] = position[i] = -1;
        score[i] = -INFINITY;
    }
    memset(mask, 0, sizeof(uint64_t) * (size_t)max_nodes * (size_t)n_words);
    token[0] = p->root_token[s];
    depth[0] = 0;
    position[0] = p->prefix_len[s];
    score[0] = 0.0f;
    mask[0] = 1;

    int32_t n = 1; /* nodes so far */
    if (p->chain) {
        int32_t last = budget < depth_limit ? budget : depth_limit;
        for (int32_t d = 1; d <= last; d++, n++) {
            token[d] = ids[(int64_t)(d - 1) * top_k];
            parent[d] = d - 1;
            depth[d] = d;
            first_child[d - 1] = d;
            score[d] = add_score(score[d - 1], logp[(int64_t)(d - 1) * top_k]);
        }
    } else if (budget > 0) {
        int32_t heap_n = 0;
        heap_push(heap, &heap_n, make_candidate(add_score(0.0f, logp[0]), 1, 0, 0, -1));
        while (n <= budget && heap_n > 0) {
            candidate c = heap_pop(heap, &heap_n);
            const uint32_t tie = (uint32_t)c.key;
            const int32_t d = kdt_tb_depth(tie), par = kdt_tb_parent(tie), r = kdt_tb_rank(tie);
            const int32_t i = n++;
            token[i] = ids[(int64_t)(d - 1) * top_k + r];
            parent[i] = par;
            depth[i] = d;
            score[i] = c.score;
            if (r == 0) first_child[par] = i;
            else next_sibling[c.prev_sib] = i;
            if (n > budget) break; /* the last pop's successors are never needed */
            if (r + 1 < top_k)
                heap_push(heap, &heap_n,
                          make_candidate(add_score(score[par], logp[(int64_t)(d - 1) * top_k + r + 1]),
                                         d, par, r + 1, i));
            if (d < depth_limit)
                heap_push(heap, &heap_n,
                          make_candidate(add_score(c.score, logp[(int64_t)d * top_k]), d + 1, i, 0, -1));
        }
    }
    out->n_nodes[s] = n;
    for (int32_t i = 1; i < n; i++) {
        position[i] = p->prefix_len[s] + depth[i];
        const uint64_t *up = mask + (int64_t)parent[i] * n_words;
        uint64_t *row = mask + (int64_t)i * n_words;
        memcpy(row, up, sizeof(uint64_t) * (size_t)n_words);
        row[i / 64] |= 1ull << (i % 64);
    }
}

kdt_status kdt_tree_build_cpu(const kdt_tree_build_params *p, kdt_tree *out) {
    kdt_status st = kdt_tree_build_check_args(p, out, 1, "kdt_tree_build_cpu");
    if (st != KDT_OK) return st;
    /* Live candidates never exceed 1 + pops <= KDT_MAX_NODES. */
    candidate heap[KDT_MAX_NODES + 1];
    for (int32_t s = 0; s < p->n_streams; s++) build_stream(p, out, s, heap);
    return KDT_OK;
}
