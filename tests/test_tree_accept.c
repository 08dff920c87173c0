/* test_tree_accept.c - CPU tests of tree_accept and kdt_tree_errors_check: hand cases (the
 * paper example, full / no acceptance, a deep side branch), every malformed-tree flag next to
 * well-formed streams, random valid trees against a recursive reference walk, random corruptions
 * against an independent O(n^2) reference validator, and argument errors. All arrays are
 * allocated at their exact size so ASan catches any out-of-bounds access.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree/kernels.h"
#include "t.h"

#define P KDT_MAX_PATH

/* A batch of trees on the host, every array exact-size. */
typedef struct htree {
    int S, maxn;
    int32_t *n_nodes;                                     /* [S] */
    int32_t *token, *parent, *depth, *fc, *ns, *target;   /* [S][maxn] */
    int32_t *accepted, *emit;                             /* [S][P] */
    int32_t *tau, *bonus, *error;                         /* [S] */
    kdt_tree tree;
    kdt_tree_accept_params prm;
} htree;

static int32_t *alloc_i32(size_t n, int32_t fill) {
    int32_t *p = (int32_t *)malloc(n * sizeof(int32_t));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    for (size_t i = 0; i < n; i++) p[i] = fill;
    return p;
}

static void ht_init(htree *h, int S, int maxn, int max_depth) {
    memset(h, 0, sizeof *h);
    h->S = S;
    h->maxn = maxn;
    size_t sn = (size_t)S * maxn;
    h->n_nodes = alloc_i32((size_t)S, 1);
    h->token = alloc_i32(sn, -1);
    h->parent = alloc_i32(sn, -1);
    h->depth = alloc_i32(sn, -1);
    h->fc = alloc_i32(sn, -1);
    h->ns = alloc_i32(sn, -1);
    h->target = alloc_i32(sn, 777);
    h->accepted = alloc_i32((size_t)S * P, 12345);
    h->emit = alloc_i32((size_t)S * P, 12345);
    h->tau = alloc_i32((size_t)S, 12345);
    h->bonus = alloc_i32((size_t)S, 12345);
    h->error = alloc_i32((size_t)S, 12345);
    /* position, score and anc_mask stay NULL: tree_accept must not need them. */
    h->tree = (kdt_tree){S, maxn, h->n_nodes, h->token, h->parent, h->depth, h->fc, h->ns,
                         NULL, NULL, NULL};
    h->prm = (kdt_tree_accept_params){&h->tree, max_depth, h->target, h->accepted, h->emit,
                                      h->tau, h->bonus, h->error};
}

static void ht_free(htree *h) {
    free(h->n_nodes); free(h->token); free(h->parent); free(h->depth); free(h->fc); free(h->ns);
    free(h->target); free(h->accepted); free(h->emit); free(h->tau); free(h->bonus);
    free(h->error);
}

#define AT(h, arr, s, i) ((h)->arr[(size_t)(s) * (h)->maxn + (i)])

/* Sets n nodes of stream s from parent[] (nodes 1..n-1 must have parent < index): depth,
 * first_child (lowest child), next_sibling (next higher sibling), padding -1. */
static void ht_finish(htree *h, int s, int n) {
    h->n_nodes[s] = n;
    for (int i = 0; i < h->maxn; i++) {
        AT(h, fc, s, i) = AT(h, ns, s, i) = -1;
        if (i >= n) AT(h, token, s, i) = AT(h, parent, s, i) = AT(h, depth, s, i) = -1;
    }
    AT(h, parent, s, 0) = -1;
    AT(h, depth, s, 0) = 0;
    for (int i = 1; i < n; i++) AT(h, depth, s, i) = AT(h, depth, s, AT(h, parent, s, i)) + 1;
    for (int i = n - 1; i >= 1; i--) {
        int p = AT(h, parent, s, i);
        AT(h, ns, s, i) = AT(h, fc, s, p);
        AT(h, fc, s, p) = i;
    }
}

/* The paper's worked example (research ddtree-dflash.md section 1.6), tokens a..h as chars:
 * 0 root, 1 a (p0), 2 d (p1), 3 g (p2), 4 b (p0), 5 d (p4); target root->b, 4->d, 5->x. */
static void set_paper_tree(htree *h, int s) {
    const int32_t par[6] = {-1, 0, 1, 2, 0, 4};
    const int32_t tok[6] = {'r', 'a', 'd', 'g', 'b', 'd'};
    const int32_t tgt[6] = {'b', 'z', 'z', 'z', 'd', 'x'};
    for (int i = 0; i < 6; i++) {
        AT(h, parent, s, i) = par[i];
        AT(h, token, s, i) = tok[i];
        AT(h, target, s, i) = tgt[i];
    }
    ht_finish(h, s, 6);
}

static void check_row(const int32_t *row, const int32_t *want, int n_want) {
    for (int k = 0; k < P; k++) CHECK_EQ_INT(row[k], k < n_want ? want[k] : -1);
}

static void check_flagged(const htree *h, int s, int32_t flags) {
    CHECK_EQ_INT(h->error[s], flags);
    CHECK_EQ_INT(h->tau[s], 0);
    CHECK_EQ_INT(h->bonus[s], -1);
    check_row(h->accepted + (size_t)s * P, NULL, 0);
    check_row(h->emit + (size_t)s * P, NULL, 0);
}

static void test_paper_example(void) {
    htree h;
    ht_init(&h, 1, 8, 3);
    set_paper_tree(&h, 0);
    CHECK_EQ_INT(kdt_tree_accept_cpu(&h.prm), KDT_OK);
    const int32_t acc[3] = {0, 4, 5}, emit[3] = {'b', 'd', 'x'};
    CHECK_EQ_INT(h.error[0], 0);
    CHECK_EQ_INT(h.tau[0], 3);
    CHECK_EQ_INT(h.bonus[0], 'x');
    check_row(h.accepted, acc, 3);
    check_row(h.emit, emit, 3);
    ht_free(&h);
}

/* A chain of 16 nodes (depth 1..16) with a side child at every level; the target follows the
 * chain all the way: tau = 17 (= KDT_MAX_PATH), bonus = target at the deepest node. */
static void test_full_acceptance_deep_path(void) {
    htree h;
    const int L = 16, n = 1 + 2 * L;
    ht_init(&h, 1, n, L);
    int chain[17];
    chain[0] = 0;
    int idx = 1;
    for (int d = 1; d <= L; d++) {
        /* side node first (lower index), then the chain node, both children of chain[d-1] */
        AT(&h, parent, 0, idx) = chain[d - 1];
        AT(&h, token, 0, idx) = 1000 + d;
        AT(&h, target, 0, idx) = 5;
        idx++;
        AT(&h, parent, 0, idx) = chain[d - 1];
        AT(&h, token, 0, idx) = 2000 + d;
        chain[d] = idx++;
    }
    for (int d = 0; d < L; d++) AT(&h, target, 0, chain[d]) = 2000 + d + 1;
    AT(&h, target, 0, chain[L]) = 4242;
    AT(&h, token, 0, 0) = 1;
    ht_finish(&h, 0, n);
    CHECK_EQ_INT(kdt_tree_accept_cpu(&h.prm), KDT_OK);
    CHECK_EQ_INT(h.tau[0], L + 1);
    CHECK_EQ_INT(h.bonus[0], 4242);
    int32_t emit[17];
    for (int d = 0; d < L; d++) emit[d] = 2000 + d + 1;
    emit[L] = 4242;
    check_row(h.accepted, chain, L + 1);
    check_row(h.emit, emit, L + 1);
    ht_free(&h);
}

static void test_none_accepted_and_root_only(void) {
    htree h;
    ht_init(&h, 2, 8, 3);
    set_paper_tree(&h, 0);
    AT(&h, target, 0, 0) = 'q'; /* no child of the root carries q */
    /* stream 1: a root-only tree (B = 0) */
    AT(&h, token, 1, 0) = 9;
    AT(&h, target, 1, 0) = 31;
    ht_finish(&h, 1, 1);
    CHECK_EQ_INT(kdt_tree_accept_cpu(&h.prm), KDT_OK);
    const int32_t acc[1] = {0}, e0[1] = {'q'}, e1[1] = {31};
    CHECK_EQ_INT(h.tau[0], 1);
    CHECK_EQ_INT(h.bonus[0], 'q');
    check_row(h.accepted, acc, 1);
    check_row(h.emit, e0, 1);
    CHECK_EQ_INT(h.tau[1], 1);
    CHECK_EQ_INT(h.bonus[1], 31);
    check_row(h.accepted + P, acc, 1);
    check_row(h.emit + P, e1, 1);
    ht_free(&h);
}

/* The accepted path leaves the main branch and goes down a late-indexed side branch:
 * 0 -> 1 -> 2 -> 3 -> 4 (main, tokens 10..13), 5 (p1, token 20), 6 (p5, 21), 7 (p6, 22),
 * 8 (p7, 23), 9 (p2, 30). Target: 0 -> 10, 1 -> 20, 5 -> 21, 6 -> 22, 7 -> 23, 8 -> 99. */
static void test_deep_side_branch(void) {
    htree h;
    ht_init(&h, 1, 12, 8);
    const int32_t par[10] = {-1, 0, 1, 2, 3, 1, 5, 6, 7, 2};
    const int32_t tok[10] = {0, 10, 11, 12, 13, 20, 21, 22, 23, 30};
    const int32_t tgt[10] = {10, 20, 12, 13, 0, 21, 22, 23, 99, 5};
    for (int i = 0; i < 10; i++) {
        AT(&h, parent, 0, i) = par[i];
        AT(&h, token, 0, i) = tok[i];
        AT(&h, target, 0, i) = tgt[i];
    }
    ht_finish(&h, 0, 10);
    CHECK_EQ_INT(kdt_tree_accept_cpu(&h.prm), KDT_OK);
    const int32_t acc[6] = {0, 1, 5, 6, 7, 8}, emit[6] = {10, 20, 21, 22, 23, 99};
    CHECK_EQ_INT(h.tau[0], 6);
    CHECK_EQ_INT(h.bonus[0], 99);
    check_row(h.accepted, acc, 6);
    check_row(h.emit, emit, 6);
    ht_free(&h);
}

/* Each malformed case sits in stream 1 between two copies of the paper tree (streams 0 and 2),
 * which must come out exactly as when run alone. */
typedef void (*corrupt_fn)(htree *h, int s);

static void run_malformed(const char *name, corrupt_fn corrupt, int32_t want_flags, int max_depth) {
    htree h;
    ht_init(&h, 3, 8, max_depth);
    for (int s = 0; s < 3; s++) set_paper_tree(&h, s);
    corrupt(&h, 1);
    kdt_clear_error();
    kdt_status st = kdt_tree_accept_cpu(&h.prm);
    CHECK_MSG(st == KDT_ERR_MALFORMED_TREE, "%s: status %s", name, kdt_status_name(st));
    CHECK_MSG(strstr(kdt_last_error(), "stream 1") != NULL, "%s: message '%s'", name,
              kdt_last_error());
    CHECK_MSG(h.error[1] == want_flags, "%s: flags 0x%x, expected 0x%x", name,
              (unsigned)h.error[1], (unsigned)want_flags);
    check_flagged(&h, 1, want_flags);
    const int32_t acc[3] = {0, 4, 5}, emit[3] = {'b', 'd', 'x'};
    for (int s = 0; s < 3; s += 2) {
        CHECK_EQ_INT(h.error[s], 0);
        CHECK_EQ_INT(h.tau[s], 3);
        CHECK_EQ_INT(h.bonus[s], 'x');
        check_row(h.accepted + (size_t)s * P, acc, 3);
        check_row(h.emit + (size_t)s * P, emit, 3);
    }
    ht_free(&h);
}

static void c_cycle_sibling(htree *h, int s) { AT(h, ns, s, 4) = 1; }    /* 4 -> 1 backwards */
static void c_cycle_sibling_self(htree *h, int s) { AT(h, ns, s, 1) = 1; } /* also drops 1->4 */
static void c_cycle_child(htree *h, int s) { AT(h, fc, s, 5) = 0; }      /* leaf -> root */
static void c_cycle_child_loop(htree *h, int s) { AT(h, fc, s, 2) = 1; } /* 2 -> 1 -> 2 ... */
static void c_cycle_both(htree *h, int s) {                              /* 1 -> 2 -> 1 via ns */
    AT(h, ns, s, 2) = 1;
    AT(h, fc, s, 3) = 3;
}
static void c_parent_self(htree *h, int s) { AT(h, parent, s, 3) = 3; }
static void c_parent_later(htree *h, int s) { AT(h, parent, s, 3) = 5; }
static void c_parent_negative(htree *h, int s) { AT(h, parent, s, 5) = -7; }
static void c_parent_root(htree *h, int s) { AT(h, parent, s, 0) = 0; }
static void c_child_out_of_range(htree *h, int s) { AT(h, fc, s, 5) = 6; }      /* = n_nodes */
static void c_child_far_out(htree *h, int s) { AT(h, fc, s, 5) = 1000000; }
static void c_child_negative(htree *h, int s) { AT(h, fc, s, 3) = -2; }
static void c_sibling_huge(htree *h, int s) { AT(h, ns, s, 3) = INT_MAX; }
static void c_sibling_min(htree *h, int s) { AT(h, ns, s, 3) = INT_MIN; }
static void c_missing_child_link(htree *h, int s) { AT(h, fc, s, 4) = -1; }
static void c_missing_sibling_link(htree *h, int s) { AT(h, ns, s, 1) = -1; }
static void c_wrong_parent_link(htree *h, int s) { AT(h, fc, s, 1) = 3; }   /* 3 is 2's child */
static void c_root_sibling(htree *h, int s) { AT(h, ns, s, 0) = 4; }
static void c_skipped_sibling(htree *h, int s) {
    /* root children 1, 2, 3 (tokens distinct); links 1 -> 3 and 2 -> 3: 3 twice, 2 never */
    AT(h, parent, s, 2) = 0;
    AT(h, parent, s, 3) = 0;
    AT(h, token, s, 2) = 'e';
    ht_finish(h, s, 6);
    AT(h, ns, s, 1) = 3;
    AT(h, ns, s, 2) = 3;
}
static void c_too_deep(htree *h, int s) { /* node 5 re-hung under node 3: depth 4 > L = 3 */
    AT(h, parent, s, 5) = 3;
    ht_finish(h, s, 6);
}
static void c_depth_root(htree *h, int s) { AT(h, depth, s, 0) = 1; }
static void c_depth_mismatch(htree *h, int s) { AT(h, depth, s, 5) = 3; }
static void c_depth_huge(htree *h, int s) { AT(h, depth, s, 5) = INT_MAX; }
static void c_depth_negative(htree *h, int s) { AT(h, depth, s, 4) = INT_MIN; }
static void c_nodes_zero(htree *h, int s) { h->n_nodes[s] = 0; }
static void c_nodes_too_many(htree *h, int s) { h->n_nodes[s] = h->maxn + 1; }
static void c_nodes_negative(htree *h, int s) { h->n_nodes[s] = INT_MIN; }
static void c_dup_root_children(htree *h, int s) { AT(h, token, s, 4) = 'a'; }
static void c_dup_deep(htree *h, int s) {
    /* node 3 re-hung under node 1 next to node 2 with the same token d: 1 -> {2, 3} */
    AT(h, parent, s, 3) = 1;
    AT(h, token, s, 3) = 'd';
    ht_finish(h, s, 6);
}
static void c_cycle_and_dup(htree *h, int s) {
    AT(h, token, s, 4) = 'a';
    AT(h, ns, s, 5) = 2;
}

static void test_malformed_trees(void) {
    const int BL = KDT_TREE_BAD_LINK, CY = KDT_TREE_CYCLE, BP = KDT_TREE_BAD_PARENT;
    const int BD = KDT_TREE_BAD_DEPTH;
    run_malformed("cycle next_sibling", c_cycle_sibling, CY, 3);
    run_malformed("self next_sibling", c_cycle_sibling_self, CY | BL, 3);
    run_malformed("cycle first_child to root", c_cycle_child, CY, 3);
    run_malformed("cycle first_child loop", c_cycle_child_loop, CY | BL, 3);
    run_malformed("cycle both links", c_cycle_both, CY, 3);
    run_malformed("parent == index", c_parent_self, BP | BL, 3);
    run_malformed("parent > index", c_parent_later, BP | BL, 3);
    run_malformed("parent negative", c_parent_negative, BP | BL, 3);
    run_malformed("root parent 0", c_parent_root, BP, 3);
    run_malformed("child == n_nodes", c_child_out_of_range, BL, 3);
    run_malformed("child far out", c_child_far_out, BL, 3);
    run_malformed("child -2", c_child_negative, BL, 3);
    run_malformed("sibling INT_MAX", c_sibling_huge, BL, 3);
    run_malformed("sibling INT_MIN", c_sibling_min, BL, 3);
    run_malformed("missing first_child", c_missing_child_link, BL, 3);
    run_malformed("missing next_sibling", c_missing_sibling_link, BL, 3);
    run_malformed("first_child of another parent", c_wrong_parent_link, BL, 3);
    run_malformed("root has a sibling", c_root_sibling, BL, 3);
    run_malformed("skipped sibling", c_skipped_sibling, BL, 3);
    run_malformed("depth != parent depth + 1", c_depth_mismatch, BD, 3);
    run_malformed("depth > L", c_too_deep, BD, 3);
    run_malformed("root depth 1", c_depth_root, BD, 3);
    run_malformed("depth INT_MAX", c_depth_huge, BD, 3);
    run_malformed("depth INT_MIN", c_depth_negative, BD, 3);
    run_malformed("n_nodes 0", c_nodes_zero, KDT_TREE_BAD_SIZE, 3);
    run_malformed("n_nodes > max_nodes", c_nodes_too_many, KDT_TREE_BAD_SIZE, 3);
    run_malformed("n_nodes INT_MIN", c_nodes_negative, KDT_TREE_BAD_SIZE, 3);
    run_malformed("duplicate root children", c_dup_root_children, KDT_TREE_DUP_TOKEN, 3);
    run_malformed("duplicate deep siblings", c_dup_deep, KDT_TREE_DUP_TOKEN, 3);
    run_malformed("cycle and duplicate", c_cycle_and_dup, CY | KDT_TREE_DUP_TOKEN, 3);
}

/* max_depth applies to the whole batch: the paper tree (depth 3) fails at L = 2 while a depth-2
 * chain next to it passes. */
static void test_depth_limit_whole_batch(void) {
    htree h;
    ht_init(&h, 2, 6, 2);
    set_paper_tree(&h, 0);
    AT(&h, parent, 1, 1) = 0;
    AT(&h, parent, 1, 2) = 1;
    AT(&h, token, 1, 1) = 7;
    AT(&h, token, 1, 2) = 8;
    AT(&h, target, 1, 0) = 7;
    AT(&h, target, 1, 1) = 8;
    AT(&h, target, 1, 2) = 66;
    ht_finish(&h, 1, 3);
    CHECK_EQ_INT(kdt_tree_accept_cpu(&h.prm), KDT_ERR_MALFORMED_TREE);
    check_flagged(&h, 0, KDT_TREE_BAD_DEPTH);
    const int32_t acc[3] = {0, 1, 2}, emit[3] = {7, 8, 66};
    CHECK_EQ_INT(h.error[1], 0);
    CHECK_EQ_INT(h.tau[1], 3);
    check_row(h.accepted + P, acc, 3);
    check_row(h.emit + P, emit, 3);
    ht_free(&h);
}

/* ---- random trees ---------------------------------------------------------------------------- */

/* A valid random tree in stream s: n nodes, depth <= L, distinct sibling tokens from a small
 * vocabulary, target tokens that often pick a child (so walks go deep). */
static void random_tree(htree *h, int s, int n, int L, uint64_t *rng) {
    const int V = 6;
    AT(h, depth, s, 0) = 0;
    for (int i = 1; i < n; i++) {
        int p;
        if (AT(h, depth, s, i - 1) < L && t_rand_int(rng, 2) == 0) {
            p = i - 1;
        } else {
            do p = t_rand_int(rng, i); while (AT(h, depth, s, p) >= L);
        }
        AT(h, parent, s, i) = p;
        AT(h, depth, s, i) = AT(h, depth, s, p) + 1;
        int tok = t_rand_int(rng, V);
        for (int again = 1; again;) {
            again = 0;
            for (int j = 1; j < i; j++)
                if (AT(h, parent, s, j) == p && AT(h, token, s, j) == tok) {
                    tok++;
                    again = 1;
                }
        }
        AT(h, token, s, i) = tok;
    }
    AT(h, token, s, 0) = t_rand_int(rng, V);
    ht_finish(h, s, n);
    for (int i = 0; i < h->maxn; i++) {
        int t = t_rand_int(rng, V + 2);
        if (i < n && AT(h, fc, s, i) >= 0 && t_rand_int(rng, 4) != 0) {
            int c = AT(h, fc, s, i), hops = t_rand_int(rng, 3);
            while (hops-- > 0 && AT(h, ns, s, c) >= 0) c = AT(h, ns, s, c);
            t = AT(h, token, s, c);
        }
        AT(h, target, s, i) = t;
    }
}

/* Reference walk, independent of the links: recurse into the child whose token matches. */
static int ref_walk(const htree *h, int s, int cur, int32_t *path, int len) {
    path[len++] = cur;
    for (int j = cur + 1; j < h->n_nodes[s]; j++)
        if (AT(h, parent, s, j) == cur && AT(h, token, s, j) == AT(h, target, s, cur))
            return ref_walk(h, s, j, path, len);
    return len;
}

static void test_random_trees_vs_reference_walk(void) {
    uint64_t rng = t_fuzz_seed(0x1234);
    int max_tau_seen = 0;
    for (int iter = 0, iters = t_fuzz_iters(300); iter < iters; iter++) {
        const int S = 1 + t_rand_int(&rng, 6);
        const int maxn = iter % 50 == 0 ? KDT_MAX_NODES : 1 + t_rand_int(&rng, 80);
        const int L = 1 + t_rand_int(&rng, KDT_MAX_DEPTH);
        htree h;
        ht_init(&h, S, maxn, L);
        for (int s = 0; s < S; s++) random_tree(&h, s, 1 + t_rand_int(&rng, maxn), L, &rng);
        kdt_status st = kdt_tree_accept_cpu(&h.prm);
        CHECK_EQ_INT(st, KDT_OK);
        for (int s = 0; s < S; s++) {
            int32_t path[KDT_MAX_NODES], emit[P];
            int len = ref_walk(&h, s, 0, path, 0);
            CHECK(len <= L + 1);
            for (int k = 0; k < len; k++) emit[k] = AT(&h, target, s, path[k]);
            CHECK_EQ_INT(h.error[s], 0);
            CHECK_EQ_INT(h.tau[s], len);
            CHECK_EQ_INT(h.bonus[s], AT(&h, target, s, path[len - 1]));
            check_row(h.accepted + (size_t)s * P, path, len);
            check_row(h.emit + (size_t)s * P, emit, len);
            if (len > max_tau_seen) max_tau_seen = len;
        }
        ht_free(&h);
    }
    CHECK(max_tau_seen >= 8); /* the generator does produce deep acceptances */
}

/* Independent O(n^2) validator written from the flag definitions in kernels.h: BAD_LINK when a
 * link differs from the lowest child / next higher sibling computed from parent[] (a backward
 * link is CYCLE, and also BAD_LINK when a link was due there). Exact when parents are valid. */
static int32_t ref_flags(const htree *h, int s, int L) {
    const int n = h->n_nodes[s];
    if (n < 1 || n > h->maxn) return KDT_TREE_BAD_SIZE;
    int32_t f = 0;
    if (AT(h, parent, s, 0) != -1) f |= KDT_TREE_BAD_PARENT;
    if (AT(h, depth, s, 0) != 0) f |= KDT_TREE_BAD_DEPTH;
    for (int i = 1; i < n; i++) {
        int p = AT(h, parent, s, i);
        if (p < 0 || p >= i) { f |= KDT_TREE_BAD_PARENT; continue; }
        long long d = AT(h, depth, s, i);
        if (d > L || d != (long long)AT(h, depth, s, p) + 1) f |= KDT_TREE_BAD_DEPTH;
        for (int j = 1; j < i; j++)
            if (AT(h, parent, s, j) == p && AT(h, token, s, j) == AT(h, token, s, i))
                f |= KDT_TREE_DUP_TOKEN;
    }
    for (int i = 0; i < n; i++) {
        for (int which = 0; which < 2; which++) {
            int want = -1;
            for (int j = i + 1; j < n && want < 0; j++) {
                if (which == 0 && AT(h, parent, s, j) == i) want = j;
                if (which == 1 && i > 0 && AT(h, parent, s, j) == AT(h, parent, s, i)) want = j;
            }
            int x = which == 0 ? AT(h, fc, s, i) : AT(h, ns, s, i);
            if (x == want) continue;
            if (x < -1 || x >= n) f |= KDT_TREE_BAD_LINK;
            else if (x >= 0 && x <= i) f |= KDT_TREE_CYCLE | (want >= 0 ? KDT_TREE_BAD_LINK : 0);
            else f |= KDT_TREE_BAD_LINK;
        }
    }
    return f;
}

static void test_random_corruptions_vs_reference_validator(void) {
    uint64_t rng = t_fuzz_seed(0xfeed);
    int n_flagged = 0, n_exact = 0;
    for (int iter = 0, iters = t_fuzz_iters(3000); iter < iters; iter++) {
        const int S = 1 + t_rand_int(&rng, 4), maxn = 1 + t_rand_int(&rng, 40);
        const int L = 1 + t_rand_int(&rng, 8);
        htree h;
        ht_init(&h, S, maxn, L);
        for (int s = 0; s < S; s++) random_tree(&h, s, 1 + t_rand_int(&rng, maxn), L, &rng);
        const int s = t_rand_int(&rng, S), n = h.n_nodes[s];
        for (int m = 1 + t_rand_int(&rng, 2); m > 0; m--) {
            const int i = t_rand_int(&rng, maxn);
            const int32_t vals[] = {-2, -1, 0, 1, i - 1, i, i + 1, n - 1, n, maxn, INT_MAX,
                                    INT_MIN, t_rand_int(&rng, n + 1) - 1, L, L + 1};
            const int32_t v = vals[t_rand_int(&rng, (int)(sizeof vals / sizeof vals[0]))];
            switch (t_rand_int(&rng, 7)) {
            case 0: AT(&h, parent, s, i) = v; break;
            case 1: AT(&h, depth, s, i) = v; break;
            case 2: AT(&h, fc, s, i) = v; break;
            case 3: AT(&h, ns, s, i) = v; break;
            case 4: AT(&h, token, s, i) = AT(&h, token, s, t_rand_int(&rng, maxn)); break;
            case 5: h.n_nodes[s] = v; break;
            default: /* the seed's failure: random links, typically cyclic */
                AT(&h, fc, s, i) = t_rand_int(&rng, maxn + 1) - 1;
                AT(&h, ns, s, i) = t_rand_int(&rng, maxn + 1) - 1;
            }
        }
        kdt_status st = kdt_tree_accept_cpu(&h.prm);
        for (int t = 0; t < S; t++) {
            const int32_t want = ref_flags(&h, t, L);
            if (want & KDT_TREE_BAD_PARENT) {
                /* links are judged against a broken parent[]: only the parent flag is exact */
                CHECK(h.error[t] & KDT_TREE_BAD_PARENT);
            } else {
                CHECK_MSG(h.error[t] == want, "iter %d stream %d: flags 0x%x, reference 0x%x",
                          iter, t, (unsigned)h.error[t], (unsigned)want);
                n_exact++;
            }
            if (h.error[t]) check_flagged(&h, t, h.error[t]);
            else CHECK(h.tau[t] >= 1 && h.tau[t] <= L + 1);
            n_flagged += h.error[t] != 0;
        }
        int any = 0;
        for (int t = 0; t < S; t++) any |= h.error[t] != 0;
        CHECK_EQ_INT(st, any ? KDT_ERR_MALFORMED_TREE : KDT_OK);
        ht_free(&h);
    }
    CHECK(n_flagged > 1000);
    CHECK(n_exact > 3000);
}

/* ---- errors ---------------------------------------------------------------------------------- */

static void expect_arg_error(const kdt_tree_accept_params *p, const char *field) {
    kdt_clear_error();
    kdt_status st = kdt_tree_accept_cpu(p);
    CHECK_MSG(st == KDT_ERR_INVALID_ARG, "%s: status %s", field, kdt_status_name(st));
    CHECK_MSG(strstr(kdt_last_error(), field) != NULL, "message '%s' should name %s",
              kdt_last_error(), field);
}

static void test_argument_errors(void) {
    htree h;
    ht_init(&h, 2, 8, 3);
    set_paper_tree(&h, 0);
    set_paper_tree(&h, 1);
    kdt_tree_accept_params p = h.prm;
    kdt_tree t = h.tree;
    p.tree = &t;
    CHECK_EQ_INT(kdt_tree_accept_cpu(NULL), KDT_ERR_INVALID_ARG);
    p.tree = NULL; expect_arg_error(&p, "tree"); p.tree = &t;
    t.n_streams = 0; expect_arg_error(&p, "n_streams"); t.n_streams = KDT_MAX_STREAMS + 1;
    expect_arg_error(&p, "n_streams"); t.n_streams = 2;
    t.max_nodes = 0; expect_arg_error(&p, "max_nodes"); t.max_nodes = KDT_MAX_NODES + 1;
    expect_arg_error(&p, "max_nodes"); t.max_nodes = 8;
    p.max_depth = 0; expect_arg_error(&p, "max_depth"); p.max_depth = KDT_MAX_DEPTH + 1;
    expect_arg_error(&p, "max_depth"); p.max_depth = 3;
#define NULL_FIELD(obj, f) do { void *keep = (void *)obj.f; obj.f = NULL; expect_arg_error(&p, #f); \
                                obj.f = keep; } while (0)
    NULL_FIELD(t, n_nodes); NULL_FIELD(t, token); NULL_FIELD(t, parent); NULL_FIELD(t, depth);
    NULL_FIELD(t, first_child); NULL_FIELD(t, next_sibling); NULL_FIELD(p, target_token);
    NULL_FIELD(p, accepted); NULL_FIELD(p, emit); NULL_FIELD(p, tau); NULL_FIELD(p, bonus);
    NULL_FIELD(p, error);
#undef NULL_FIELD
    /* an argument error writes no output */
    for (int s = 0; s < 2; s++) CHECK_EQ_INT(h.tau[s], 12345);
    CHECK_EQ_INT(kdt_tree_accept_cpu(&p), KDT_OK);
    CHECK_EQ_INT(h.tau[1], 3);
    ht_free(&h);
}

static void test_errors_check(void) {
    int32_t err[5] = {0, 0, 0, 0, 0};
    CHECK_EQ_INT(kdt_tree_errors_check(err, 5), KDT_OK);
    err[3] = KDT_TREE_BAD_PARENT | KDT_TREE_CYCLE;
    err[4] = KDT_TREE_DUP_TOKEN;
    CHECK_EQ_INT(kdt_tree_errors_check(err, 5), KDT_ERR_MALFORMED_TREE);
    const char *m = kdt_last_error();
    CHECK_MSG(strstr(m, "stream 3") && strstr(m, "parent out of range") && strstr(m, "cycle") &&
                  strstr(m, "2 of 5"), "message '%s'", m);
    CHECK_MSG(!strstr(m, "duplicate"), "message '%s' names stream 4's flags", m);
    err[3] = 0;
    err[4] = KDT_TREE_BAD_SIZE | KDT_TREE_BAD_DEPTH | KDT_TREE_BAD_LINK | KDT_TREE_DUP_TOKEN | 256;
    CHECK_EQ_INT(kdt_tree_errors_check(err, 5), KDT_ERR_MALFORMED_TREE);
    m = kdt_last_error();
    CHECK_MSG(strstr(m, "stream 4") && strstr(m, "n_nodes") && strstr(m, "depth") &&
                  strstr(m, "first_child") && strstr(m, "duplicate") && strstr(m, "0x100"),
              "message '%s'", m);
    CHECK_EQ_INT(kdt_tree_errors_check(NULL, 5), KDT_ERR_INVALID_ARG);
    CHECK_EQ_INT(kdt_tree_errors_check(err, 0), KDT_ERR_INVALID_ARG);
}

int main(void) {
    T_RUN(test_paper_example);
    T_RUN(test_full_acceptance_deep_path);
    T_RUN(test_none_accepted_and_root_only);
    T_RUN(test_deep_side_branch);
    T_RUN(test_malformed_trees);
    T_RUN(test_depth_limit_whole_batch);
    T_RUN(test_random_trees_vs_reference_walk);
    T_RUN(test_random_corruptions_vs_reference_validator);
    T_RUN(test_argument_errors);
    T_RUN(test_errors_check);
    return t_summary();
}
