/* tree_accept.c - CPU reference of tree_accept (tree validation + greedy walk) and the host
 * check of its error[] array (kdt_tree_errors_check). Owns the exact definition of every
 * KDT_TREE_* flag; the CUDA kernel (cuda/tree_accept.cu) computes the same predicates in
 * parallel, so flags and outputs agree bit for bit.
 *
 * Validation of stream s, n = n_nodes[s], L = max_depth (all per-node tests are independent, so a
 * warp can evaluate them in any order and OR the flags):
 *   BAD_SIZE    n outside 1..max_nodes; nothing else is read or checked then.
 *   BAD_PARENT  parent[0] != -1, or parent[i] outside 0..i-1 (i >= 1).
 *   BAD_DEPTH   depth[0] != 0; for i >= 1: depth[i] outside 1..L, or parent valid and
 *               depth[parent[i]] != depth[i] - 1.
 *   For every node i and each link x = first_child[i] / next_sibling[i]:
 *     x == -1                 fine;
 *     x < -1 or x >= n        BAD_LINK;
 *     0 <= x <= i             CYCLE (the link does not move to a higher index);
 *     x > i: first_child:     parent[x] == i, else BAD_LINK;
 *            next_sibling:    i >= 1 and parent[x] == parent[i], else BAD_LINK;
 *            a link passing this test "counts" as an in-link of x.
 *   BAD_LINK also when a node 1..n-1 has no counted in-link or more than one. With the per-link
 *   tests this is exactly "first_child = lowest-index child, next_sibling = next higher child of
 *   the same parent, -1 at the ends": per parent the counted links form one increasing path
 *   p -> c1 -> c2 ... that visits every child once.
 *   DUP_TOKEN   two nodes i != j in 1..n-1 with the same valid parent and the same token.
 * A flagged stream gets tau 0, bonus -1 and rows of -1. On a clean tree the walk follows
 * first_child / next_sibling; depth rises by one per step, so tau <= L + 1 <= KDT_MAX_PATH.
 */
#include "common.h"
#include "kdtree/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Shared with the CUDA launcher (declared there): checks the params struct, not the tree. */
kdt_status kdt_tree_accept_check_args(const kdt_tree_accept_params *p, const char *who);

kdt_status kdt_tree_accept_check_args(const kdt_tree_accept_params *p, const char *who) {
    KDT_CHECK_ARG(p != NULL, "%s: params is NULL", who);
    const kdt_tree *t = p->tree;
    KDT_CHECK_ARG(t != NULL, "%s: tree is NULL", who);
    KDT_CHECK_ARG(t->n_streams >= 1 && t->n_streams <= KDT_MAX_STREAMS,
                  "%s: tree->n_streams = %d, expected 1..%d", who, t->n_streams, KDT_MAX_STREAMS);
    KDT_CHECK_ARG(t->max_nodes >= 1 && t->max_nodes <= KDT_MAX_NODES,
                  "%s: tree->max_nodes = %d, expected 1..%d", who, t->max_nodes, KDT_MAX_NODES);
    KDT_CHECK_ARG(p->max_depth >= 1 && p->max_depth <= KDT_MAX_DEPTH,
                  "%s: max_depth = %d, expected 1..%d", who, p->max_depth, KDT_MAX_DEPTH);
    KDT_CHECK_ARG(t->n_nodes != NULL, "%s: tree->n_nodes is NULL", who);
    KDT_CHECK_ARG(t->token != NULL, "%s: tree->token is NULL", who);
    KDT_CHECK_ARG(t->parent != NULL, "%s: tree->parent is NULL", who);
    KDT_CHECK_ARG(t->depth != NULL, "%s: tree->depth is NULL", who);
    KDT_CHECK_ARG(t->first_child != NULL, "%s: tree->first_child is NULL", who);
    KDT_CHECK_ARG(t->next_sibling != NULL, "%s: tree->next_sibling is NULL", who);
    KDT_CHECK_ARG(p->target_token != NULL, "%s: target_token is NULL", who);
    KDT_CHECK_ARG(p->accepted != NULL, "%s: accepted is NULL", who);
    KDT_CHECK_ARG(p->emit != NULL, "%s: emit is NULL", who);
    KDT_CHECK_ARG(p->tau != NULL, "%s: tau is NULL", who);
    KDT_CHECK_ARG(p->bonus != NULL, "%s: bonus is NULL", who);
    KDT_CHECK_ARG(p->error != NULL, "%s: error is NULL", who);
    return KDT_OK;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* One link x leaving node i (first_child when is_first, else next_sibling). */
static int32_t check_link(const kdt_tree *t, int64_t base, int32_t n, int32_t i, int32_t x,
                          int is_first, uint8_t *in_links /* [n] */) {
    if (x == -1) return 0;
    if (x < -1 || x >= n) return KDT_TREE_BAD_LINK;
    if (x <= i) return KDT_TREE_CYCLE;
    int ok = is_first ? t->parent[base + x] == i
                      : (i >= 1 && t->parent[base + x] == t->parent[base + i]);
    if (!ok) return KDT_TREE_BAD_LINK;
    if (in_links[x] < 2) in_links[x]++;
    return 0;
}

/* The KDT_TREE_* flags of stream s (0 = well formed). */
static int32_t validate_stream(const kdt_tree *t, int32_t s, int32_t max_depth) {
    const int32_t n = t->n_nodes[s];
    if (n < 1 || n > t->max_nodes) return KDT_TREE_BAD_SIZE;
    const int64_t base = (int64_t)s * t->max_nodes;
    const int32_t *parent = t->parent + base, *depth = t->depth + base, *token = t->token + base;
    uint8_t in_links[KDT_MAX_NODES];   /* counted in-links per node, saturating at 2 */
    uint64_t sibling_keys[KDT_MAX_NODES]; /* (parent, token) of nodes with a valid parent */
    int32_t flags = 0, n_keys = 0;
    memset(in_links, 0, (size_t)n);

    if (parent[0] != -1) flags |= KDT_TREE_BAD_PARENT;
    if (depth[0] != 0) flags |= KDT_TREE_BAD_DEPTH;
    for (int32_t i = 1; i < n; i++) {
        const int32_t par = parent[i], d = depth[i];
        const int parent_ok = par >= 0 && par < i;
        if (!parent_ok) flags |= KDT_TREE_BAD_PARENT;
        if (d < 1 || d > max_depth) flags |= KDT_TREE_BAD_DEPTH;
        else if (parent_ok && depth[par] != d - 1) flags |= KDT_TREE_BAD_DEPTH;
        if (parent_ok)
            sibling_keys[n_keys++] = ((uint64_t)(uint32_t)par << 32) | (uint32_t)token[i];
    }
    for (int32_t i = 0; i < n; i++) {
        flags |= check_link(t, base, n, i, t->first_child[base + i], 1, in_links);
        flags |= check_link(t, base, n, i, t->next_sibling[base + i], 0, in_links);
    }
    for (int32_t i = 1; i < n; i++)
        if (in_links[i] != 1) flags |= KDT_TREE_BAD_LINK;
    qsort(sibling_keys, (size_t)n_keys, sizeof sibling_keys[0], cmp_u64);
    for (int32_t k = 1; k < n_keys; k++)
        if (sibling_keys[k] == sibling_keys[k - 1]) flags |= KDT_TREE_DUP_TOKEN;
    return flags;
}

kdt_status kdt_tree_accept_cpu(const kdt_tree_accept_params *p) {
    kdt_status st = kdt_tree_accept_check_args(p, "kdt_tree_accept_cpu");
    if (st != KDT_OK) return st;
    const kdt_tree *t = p->tree;
    int any_flagged = 0;
    for (int32_t s = 0; s < t->n_streams; s++) {
        int32_t *accepted = p->accepted + (int64_t)s * KDT_MAX_PATH;
        int32_t *emit = p->emit + (int64_t)s * KDT_MAX_PATH;
        for (int k = 0; k < KDT_MAX_PATH; k++) accepted[k] = emit[k] = -1;
        const int32_t flags = validate_stream(t, s, p->max_depth);
        p->error[s] = flags;
        if (flags) {
            p->tau[s] = 0;
            p->bonus[s] = -1;
            any_flagged = 1;
            continue;
        }
        /* Greedy walk over a validated tree: every link moves to a higher index and every step
         * one level deeper, so the loop ends within n_nodes and KDT_MAX_PATH steps. */
        const int64_t base = (int64_t)s * t->max_nodes;
        const int32_t *target = p->target_token + base;
        int32_t cur = 0, tau = 1;
        accepted[0] = 0;
        for (;;) {
            int32_t next = -1;
            for (int32_t c = t->first_child[base + cur]; c != -1; c = t->next_sibling[base + c])
                if (t->token[base + c] == target[cur]) {
                    next = c;
                    break;
                }
            if (next < 0 || tau >= KDT_MAX_PATH) break;
            accepted[tau++] = next;
            cur = next;
        }
        /* The token of accepted node k+1 equals target[accepted[k]], and the bonus is
         * target[accepted[tau-1]], so emit[k] = target[accepted[k]] for every k < tau. */
        for (int32_t k = 0; k < tau; k++) emit[k] = target[accepted[k]];
        p->tau[s] = tau;
        p->bonus[s] = emit[tau - 1];
    }
    if (any_flagged) return kdt_tree_errors_check(p->error, t->n_streams);
    return KDT_OK;
}

kdt_status kdt_tree_errors_check(const int32_t *error, int32_t n_streams) {
    KDT_CHECK_ARG(error != NULL, "kdt_tree_errors_check: error is NULL");
    KDT_CHECK_ARG(n_streams >= 1 && n_streams <= KDT_MAX_STREAMS,
                  "kdt_tree_errors_check: n_streams = %d, expected 1..%d", n_streams,
                  KDT_MAX_STREAMS);
    int32_t first = -1, n_bad = 0;
    for (int32_t s = 0; s < n_streams; s++)
        if (error[s] != 0) {
            if (first < 0) first = s;
            n_bad++;
        }
    if (first < 0) return KDT_OK;
    static const struct { int32_t bit; const char *words; } names[] = {
        {KDT_TREE_BAD_SIZE, "n_nodes out of range"},
        {KDT_TREE_BAD_PARENT, "parent out of range"},
        {KDT_TREE_BAD_DEPTH, "bad depth"},
        {KDT_TREE_BAD_LINK, "first_child/next_sibling inconsistent with parent"},
        {KDT_TREE_CYCLE, "cycle"},
        {KDT_TREE_DUP_TOKEN, "duplicate sibling token"},
    };
    char words[256] = "";
    size_t len = 0;
    int32_t known = 0;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        known |= names[k].bit;
        if (error[first] & names[k].bit)
            len += (size_t)snprintf(words + len, sizeof words - len, "%s%s", len ? ", " : "",
                                    names[k].words);
    }
    if (error[first] & ~known)
        snprintf(words + len, sizeof words - len, "%sunknown flags 0x%x", len ? ", " : "",
                 (unsigned)(error[first] & ~known));
    return kdt_fail(KDT_ERR_MALFORMED_TREE, "stream %d: malformed tree (%s); %d of %d streams flagged",
                    first, words, n_bad, n_streams);
}
