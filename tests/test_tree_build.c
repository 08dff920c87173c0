/* test_tree_build.c - CPU tests of kdt_tree_build_cpu: the paper's worked example, optimality
 * against brute-force enumeration, structural invariants over many random cases, chain mode,
 * root-only trees, deterministic ties (including -0 / +0), the NaN policy, padding, several
 * streams with their own B and L in one call, and every argument error. */
#include "kdtree/kernels.h"
#include "t.h"

#include <math.h>
#include <string.h>

#include "fp.h"

/* ---- fixtures ------------------------------------------------------------------------------ */

typedef struct fixture {
    int32_t S, L, K, max_nodes, W;
    int32_t *ids;      /* [S][L][K] */
    float *logp;       /* [S][L][K] */
    int32_t *budget, *depth_limit, *root, *prefix; /* [S] */
    kdt_tree t;
} fixture;

static void fx_init(fixture *f, int32_t S, int32_t L, int32_t K, int32_t max_nodes) {
    memset(f, 0, sizeof *f);
    f->S = S;
    f->L = L;
    f->K = K;
    f->max_nodes = max_nodes;
    f->W = KDT_MASK_WORDS(max_nodes);
    size_t lk = (size_t)S * L * K, sn = (size_t)S * max_nodes;
    f->ids = calloc(lk, sizeof(int32_t));
    f->logp = calloc(lk, sizeof(float));
    f->budget = calloc((size_t)S, sizeof(int32_t));
    f->depth_limit = calloc((size_t)S, sizeof(int32_t));
    f->root = calloc((size_t)S, sizeof(int32_t));
    f->prefix = calloc((size_t)S, sizeof(int32_t));
    f->t.n_streams = S;
    f->t.max_nodes = max_nodes;
    f->t.n_nodes = calloc((size_t)S, sizeof(int32_t));
    f->t.token = calloc(sn, sizeof(int32_t));
    f->t.parent = calloc(sn, sizeof(int32_t));
    f->t.depth = calloc(sn, sizeof(int32_t));
    f->t.first_child = calloc(sn, sizeof(int32_t));
    f->t.next_sibling = calloc(sn, sizeof(int32_t));
    f->t.position = calloc(sn, sizeof(int32_t));
    f->t.score = calloc(sn, sizeof(float));
    f->t.anc_mask = calloc(sn * (size_t)f->W, sizeof(uint64_t));
    for (int32_t s = 0; s < S; s++) {
        f->depth_limit[s] = L;
        f->root[s] = 1000 + s;
        f->prefix[s] = 17 * s + 3;
    }
}

static void fx_free(fixture *f) {
    free(f->ids); free(f->logp); free(f->budget); free(f->depth_limit); free(f->root);
    free(f->prefix); free(f->t.n_nodes); free(f->t.token); free(f->t.parent); free(f->t.depth);
    free(f->t.first_child); free(f->t.next_sibling); free(f->t.position); free(f->t.score);
    free(f->t.anc_mask);
}

static kdt_tree_build_params fx_params(const fixture *f, int chain) {
    kdt_tree_build_params p;
    p.n_streams = f->S;
    p.max_depth = f->L;
    p.top_k = f->K;
    p.top_ids = f->ids;
    p.top_logp = f->logp;
    p.depth_limit = f->depth_limit;
    p.budget = f->budget;
    p.root_token = f->root;
    p.prefix_len = f->prefix;
    p.chain = chain;
    return p;
}

/* Fills every output byte with a pattern no builder writes (checks that all is written). */
static void fx_poison(fixture *f) {
    size_t sn = (size_t)f->S * f->max_nodes;
    memset(f->t.n_nodes, 0x5a, sizeof(int32_t) * (size_t)f->S);
    memset(f->t.token, 0x5a, sizeof(int32_t) * sn);
    memset(f->t.parent, 0x5a, sizeof(int32_t) * sn);
    memset(f->t.depth, 0x5a, sizeof(int32_t) * sn);
    memset(f->t.first_child, 0x5a, sizeof(int32_t) * sn);
    memset(f->t.next_sibling, 0x5a, sizeof(int32_t) * sn);
    memset(f->t.position, 0x5a, sizeof(int32_t) * sn);
    memset(f->t.score, 0x5a, sizeof(float) * sn);
    memset(f->t.anc_mask, 0x5a, sizeof(uint64_t) * sn * (size_t)f->W);
}

/* Row (s, d) of the top-K input: K distinct ids and descending log-probs <= 0. quant > 0 rounds
 * the log-probs to multiples of quant (many ties). */
static void fx_random_row(fixture *f, int32_t s, int32_t d, uint64_t *rng, double quant) {
    int32_t *ids = f->ids + ((size_t)s * f->L + d) * f->K;
    float *lp = f->logp + ((size_t)s * f->L + d) * f->K;
    int32_t base = t_rand_int(rng, 100000);
    for (int32_t r = 0; r < f->K; r++) ids[r] = base + 7 * r;
    double scale = 0.3 + 3.0 * t_rand_unit(rng), acc = -t_rand_unit(rng) * 2.0;
    for (int32_t r = 0; r < f->K; r++) {
        acc -= scale * t_rand_unit(rng) * t_rand_unit(rng);
        double v = acc;
        if (quant > 0) v = quant * floor(v / quant);
        lp[r] = (float)v;
    }
    for (int32_t r = 1; r < f->K; r++) /* keep descending after rounding */
        if (lp[r] > lp[r - 1]) lp[r] = lp[r - 1];
}

static void fx_random(fixture *f, uint64_t *rng, double quant) {
    for (int32_t s = 0; s < f->S; s++)
        for (int32_t d = 0; d < f->L; d++) fx_random_row(f, s, d, rng, quant);
}

static int64_t available_prefixes(int32_t K, int32_t L, int64_t cap) {
    int64_t total = 0, level = 1;
    for (int32_t d = 1; d <= L; d++) {
        level *= K;
        total += level;
        if (total >= cap || level >= cap) return cap;
    }
    return total;
}

static float add_score(float a, float b) {
    float s = a + b;
    return isnan(s) ? -INFINITY : s;
}

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

/* Rank of token tok in row (s, d), -1 if absent (ids are distinct per row). */
static int32_t rank_of(const fixture *f, int32_t s, int32_t d, int32_t tok) {
    const int32_t *ids = f->ids + ((size_t)s * f->L + d) * f->K;
    for (int32_t r = 0; r < f->K; r++)
        if (ids[r] == tok) return r;
    return -1;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int cmp_float_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Checks the structural contract of stream s; returns the number of violations (printed). */
static int check_stream(const fixture *f, int32_t s, int chain, int monotone) {
    int bad = 0;
#define EXPECT(cond, ...)                                                                  \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            if (bad++ < 5) {                                                               \
                fprintf(stderr, "    stream %d: %s: ", s, #cond);                          \
                fprintf(stderr, __VA_ARGS__);                                              \
                fprintf(stderr, "\n");                                                     \
            }                                                                              \
        }                                                                                  \
    } while (0)
    const kdt_tree *t = &f->t;
    const int32_t M = f->max_nodes, W = f->W, B = f->budget[s], L = f->depth_limit[s];
    const int64_t base = (int64_t)s * M;
    const int32_t n = t->n_nodes[s];
    int64_t want = chain ? 1 + (B < L ? B : L) : 1 + available_prefixes(f->K, L, B);
    EXPECT(n == want, "n_nodes %d, expected %lld", n, (long long)want);
    if (n < 1 || n > M) return bad + 1;
    EXPECT(t->token[base] == f->root[s], "root token %d", t->token[base]);
    EXPECT(t->parent[base] == -1 && t->depth[base] == 0, "root parent/depth");
    EXPECT(t->position[base] == f->prefix[s], "root position");
    EXPECT(bits_of(t->score[base]) == 0, "root score");
    for (int32_t i = 1; i < n; i++) {
        int32_t p = t->parent[base + i], d = t->depth[base + i];
        EXPECT(p >= 0 && p < i, "node %d parent %d", i, p);
        if (p < 0 || p >= i) continue;
        EXPECT(d == t->depth[base + p] + 1 && d >= 1 && d <= L, "node %d depth %d", i, d);
        if (d < 1 || d > f->L) continue;
        EXPECT(t->position[base + i] == f->prefix[s] + d, "node %d position", i);
        int32_t r = rank_of(f, s, d - 1, t->token[base + i]);
        EXPECT(r >= 0, "node %d token %d not in its row", i, t->token[base + i]);
        if (r < 0) continue;
        if (chain) EXPECT(r == 0 && p == i - 1 && d == i, "chain node %d", i);
        float want_score = add_score(t->score[base + p], f->logp[((size_t)s * f->L + d - 1) * f->K + r]);
        EXPECT(bits_of(t->score[base + i]) == bits_of(want_score), "node %d score %.9g vs %.9g", i,
               t->score[base + i], want_score);
        if (monotone && i + 1 < n) { /* pops come out in decreasing key order */
            uint32_t k0 = kdt_f32_order_key(t->score[base + i]);
            uint32_t k1 = kdt_f32_order_key(t->score[base + i + 1]);
            EXPECT(k0 >= k1, "node %d score below node %d", i, i + 1);
        }
    }
    if (bad) return bad;
    /* links against the parent array: children in increasing index order; and distinct
     * sibling tokens (sort (parent, token) pairs) */
    int32_t fc[KDT_MAX_NODES], ns[KDT_MAX_NODES], last[KDT_MAX_NODES];
    uint64_t pairs[KDT_MAX_NODES];
    for (int32_t i = 0; i < n; i++) fc[i] = ns[i] = last[i] = -1;
    for (int32_t i = 1; i < n; i++) {
        int32_t p = t->parent[base + i];
        if (last[p] < 0) fc[p] = i;
        else ns[last[p]] = i;
        last[p] = i;
        pairs[i - 1] = ((uint64_t)(uint32_t)p << 32) | (uint32_t)t->token[base + i];
    }
    qsort(pairs, (size_t)(n - 1), sizeof(uint64_t), cmp_u64);
    for (int32_t i = 1; i + 1 < n; i++) EXPECT(pairs[i] != pairs[i - 1], "two siblings share a token");
    for (int32_t i = 0; i < n; i++) {
        EXPECT(t->first_child[base + i] == fc[i], "node %d first_child %d, expected %d", i,
               t->first_child[base + i], fc[i]);
        EXPECT(t->next_sibling[base + i] == ns[i], "node %d next_sibling %d, expected %d", i,
               t->next_sibling[base + i], ns[i]);
    }
    /* masks: ancestors and self */
    for (int32_t i = 0; i < n; i++) {
        uint64_t want_row[KDT_MASK_WORDS(KDT_MAX_NODES)];
        memset(want_row, 0, sizeof want_row);
        for (int32_t a = i, steps = 0; a >= 0 && steps <= M; a = t->parent[base + a], steps++) {
            if (a >= n) break;
            want_row[a / 64] |= 1ull << (a % 64);
        }
        EXPECT(!memcmp(want_row, t->anc_mask + (base + i) * W, sizeof(uint64_t) * (size_t)W),
               "node %d mask", i);
    }
    /* padding */
    for (int32_t i = n; i < M; i++) {
        EXPECT(t->token[base + i] == -1 && t->parent[base + i] == -1 && t->depth[base + i] == -1 &&
                   t->first_child[base + i] == -1 && t->next_sibling[base + i] == -1 &&
                   t->position[base + i] == -1 && t->score[base + i] == -INFINITY,
               "padding slot %d", i);
        for (int32_t w = 0; w < W; w++) EXPECT(t->anc_mask[(base + i) * W + w] == 0, "padding mask %d", i);
    }
#undef EXPECT
    return bad;
}

/* ---- tests --------------------------------------------------------------------------------- */

/* Ringel & Romano §1.6: L = 3, B = 5; q1 a .6 b .3 c .1; q2 d .7 e .2; q3 g .8 h .1. */
static void test_paper_example(void) {
    enum { A = 10, Bt = 11, C = 12, D = 20, E = 21, G = 30, H = 31 };
    fixture f;
    fx_init(&f, 1, 3, 3, 8);
    const int32_t ids[3][3] = {{A, Bt, C}, {D, E, 22}, {G, H, 32}};
    const float lp[3][3] = {{logf(.6f), logf(.3f), logf(.1f)},
                            {logf(.7f), logf(.2f), -INFINITY},
                            {logf(.8f), logf(.1f), -INFINITY}};
    memcpy(f.ids, ids, sizeof ids);
    memcpy(f.logp, lp, sizeof lp);
    f.budget[0] = 5;
    f.prefix[0] = 40;
    fx_poison(&f);
    kdt_tree_build_params p = fx_params(&f, 0);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    CHECK_EQ_INT(f.t.n_nodes[0], 6);
    const int32_t tok[6] = {1000, A, D, G, Bt, D}, par[6] = {-1, 0, 1, 2, 0, 4};
    const int32_t dep[6] = {0, 1, 2, 3, 1, 2}, pos[6] = {40, 41, 42, 43, 41, 42};
    const int32_t fc[6] = {1, 2, 3, -1, 5, -1}, ns[6] = {-1, 4, -1, -1, -1, -1};
    const uint64_t rows[6] = {0x1, 0x3, 0x7, 0xf, 0x11, 0x31};
    for (int i = 0; i < 6; i++) {
        CHECK_EQ_INT(f.t.token[i], tok[i]);
        CHECK_EQ_INT(f.t.parent[i], par[i]);
        CHECK_EQ_INT(f.t.depth[i], dep[i]);
        CHECK_EQ_INT(f.t.position[i], pos[i]);
        CHECK_EQ_INT(f.t.first_child[i], fc[i]);
        CHECK_EQ_INT(f.t.next_sibling[i], ns[i]);
        CHECK_EQ_INT(f.t.anc_mask[i], rows[i]);
    }
    /* scores: one fp32 add per edge from the root's 0 */
    float s1 = 0.0f + lp[0][0], s2 = s1 + lp[1][0], s3 = s2 + lp[2][0], s4 = 0.0f + lp[0][1];
    float s5 = s4 + lp[1][0];
    const float want[6] = {0.0f, s1, s2, s3, s4, s5};
    for (int i = 0; i < 6; i++) CHECK_EQ_INT(bits_of(f.t.score[i]), bits_of(want[i]));
    CHECK_NEAR(expf(f.t.score[3]), 0.336, 1e-6);
    CHECK_NEAR(expf(f.t.score[5]), 0.21, 1e-6);
    CHECK_EQ_INT(check_stream(&f, 0, 0, 1), 0);
    fx_free(&f);
}

/* All prefixes (rank tuples) of depth <= L with ranks < K, scored like the builder. */
typedef struct prefix { float score; int32_t depth; int32_t ranks[KDT_MAX_DEPTH]; } prefix;

static int32_t enumerate(const fixture *f, int32_t s, int32_t L, prefix *out, prefix cur, int32_t n) {
    if (cur.depth == L) return n;
    for (int32_t r = 0; r < f->K; r++) {
        prefix c = cur;
        c.ranks[c.depth] = r;
        c.score = add_score(cur.score, f->logp[((size_t)s * f->L + cur.depth) * f->K + r]);
        c.depth++;
        out[n++] = c;
        n = enumerate(f, s, L, out, c, n);
    }
    return n;
}

static int cmp_prefix_desc(const void *a, const void *b) {
    float x = ((const prefix *)a)->score, y = ((const prefix *)b)->score;
    return (x < y) - (x > y);
}

static int same_ranks(const prefix *a, const prefix *b) {
    if (a->depth != b->depth) return 0;
    for (int32_t d = 0; d < a->depth; d++)
        if (a->ranks[d] != b->ranks[d]) return 0;
    return 1;
}

/* The built node set is exactly the top-B prefixes (continuous random scores: no ties). */
static void test_optimal_vs_brute_force(void) {
    uint64_t rng = t_fuzz_seed(12345);
    static prefix all[4 + 16 + 64 + 256 + 1024];
    int cases = 0;
    for (int it = 0, iters = t_fuzz_iters(300); it < iters; it++) {
        int32_t K = 1 + t_rand_int(&rng, 4), L = 1 + t_rand_int(&rng, K <= 2 ? 5 : 4);
        if (K == 4 && L == 5) L = 4;
        int64_t avail = available_prefixes(K, L, 1 << 20);
        int32_t B = t_rand_int(&rng, (int)(avail < 60 ? avail + 3 : 60));
        fixture f;
        fx_init(&f, 1, L, K, B + 1 + t_rand_int(&rng, 3));
        fx_random(&f, &rng, 0);
        f.budget[0] = B;
        fx_poison(&f);
        kdt_tree_build_params p = fx_params(&f, 0);
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
        CHECK_EQ_INT(check_stream(&f, 0, 0, 1), 0);
        prefix root;
        memset(&root, 0, sizeof root);
        int32_t n_all = enumerate(&f, 0, L, all, root, 0);
        qsort(all, (size_t)n_all, sizeof(prefix), cmp_prefix_desc);
        int32_t n = f.t.n_nodes[0];
        float tree_scores[64];
        for (int32_t i = 1; i < n; i++) {
            prefix node;
            memset(&node, 0, sizeof node);
            node.depth = f.t.depth[i];
            for (int32_t a = i; a > 0; a = f.t.parent[a])
                node.ranks[f.t.depth[a] - 1] = rank_of(&f, 0, f.t.depth[a] - 1, f.t.token[a]);
            int found = 0;
            for (int32_t j = 0; j < n - 1; j++) found |= same_ranks(&node, &all[j]);
            CHECK_MSG(found, "case %d: node %d is not among the top %d prefixes", it, i, n - 1);
            tree_scores[i - 1] = f.t.score[i];
        }
        /* same scores as the best n - 1 prefixes, so the same total */
        qsort(tree_scores, (size_t)(n - 1), sizeof(float), cmp_float_desc);
        for (int32_t i = 0; i + 1 < n; i++)
            CHECK_MSG(bits_of(tree_scores[i]) == bits_of(all[i].score), "case %d: score %d: %.9g vs %.9g",
                      it, i, tree_scores[i], all[i].score);
        cases++;
        fx_free(&f);
    }
    CHECK(cases == t_fuzz_iters(300));
}

static void test_invariants_random(void) {
    uint64_t rng = t_fuzz_seed(777);
    for (int it = 0, iters = t_fuzz_iters(400); it < iters; it++) {
        int32_t S = 1 + t_rand_int(&rng, 4), L = 1 + t_rand_int(&rng, KDT_MAX_DEPTH);
        int32_t K = 1 + t_rand_int(&rng, it % 10 == 0 ? 300 : 40);
        int32_t max_nodes = 1 + t_rand_int(&rng, it % 7 == 0 ? KDT_MAX_NODES : 200);
        fixture f;
        fx_init(&f, S, L, K, max_nodes);
        fx_random(&f, &rng, it % 3 == 0 ? 0.5 : 0);
        for (int32_t s = 0; s < S; s++) {
            f.budget[s] = t_rand_int(&rng, max_nodes);
            f.depth_limit[s] = 1 + t_rand_int(&rng, L);
        }
        int chain = it % 5 == 4;
        fx_poison(&f);
        kdt_tree_build_params p = fx_params(&f, chain);
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
        for (int32_t s = 0; s < S; s++) CHECK_EQ_INT(check_stream(&f, s, chain, 1), 0);
        fx_free(&f);
    }
}

static void test_chain(void) {
    uint64_t rng = 99;
    fixture f;
    fx_init(&f, 3, 7, 4, 12);
    fx_random(&f, &rng, 0);
    f.budget[0] = 11; /* > L: chain of L */
    f.budget[1] = 3;  /* < L */
    f.budget[2] = 0;
    f.depth_limit[1] = 5;
    fx_poison(&f);
    kdt_tree_build_params p = fx_params(&f, 1);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    CHECK_EQ_INT(f.t.n_nodes[0], 8);
    CHECK_EQ_INT(f.t.n_nodes[1], 4);
    CHECK_EQ_INT(f.t.n_nodes[2], 1);
    for (int32_t d = 1; d < 8; d++) {
        CHECK_EQ_INT(f.t.token[d], f.ids[(size_t)(d - 1) * 4]);
        CHECK_EQ_INT(f.t.parent[d], d - 1);
        CHECK_EQ_INT(f.t.first_child[d - 1], d);
        CHECK_EQ_INT(f.t.anc_mask[d], (2ull << d) - 1);
    }
    for (int32_t s = 0; s < 3; s++) CHECK_EQ_INT(check_stream(&f, s, 1, 1), 0);
    fx_free(&f);
}

static void test_root_only(void) {
    uint64_t rng = 5;
    for (int chain = 0; chain < 2; chain++) {
        fixture f;
        fx_init(&f, 2, 4, 3, 1); /* max_nodes 1: B must be 0 */
        fx_random(&f, &rng, 0);
        fx_poison(&f);
        kdt_tree_build_params p = fx_params(&f, chain);
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
        for (int32_t s = 0; s < 2; s++) {
            CHECK_EQ_INT(f.t.n_nodes[s], 1);
            CHECK_EQ_INT(f.t.token[s], f.root[s]);
            CHECK_EQ_INT(f.t.first_child[s], -1);
            CHECK_EQ_INT(f.t.anc_mask[s], 1);
            CHECK_EQ_INT(check_stream(&f, s, chain, 1), 0);
        }
        fx_free(&f);
    }
    fixture f; /* B = 0 with room to spare: the rest is padding */
    fx_init(&f, 1, 4, 3, 70);
    fx_random(&f, &rng, 0);
    fx_poison(&f);
    kdt_tree_build_params p = fx_params(&f, 0);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    CHECK_EQ_INT(f.t.n_nodes[0], 1);
    CHECK_EQ_INT(check_stream(&f, 0, 0, 1), 0);
    fx_free(&f);
}

/* Equal log-probs: the order falls back to depth, then parent index, then rank. */
static void test_ties(void) {
    fixture f;
    fx_init(&f, 1, 2, 3, 8);
    for (int i = 0; i < 6; i++) {
        f.ids[i] = 50 + i;
        f.logp[i] = -1.0f;
    }
    f.budget[0] = 6;
    fx_poison(&f);
    kdt_tree_build_params p = fx_params(&f, 0);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    const int32_t par[7] = {-1, 0, 0, 0, 1, 1, 1}, tok[7] = {1000, 50, 51, 52, 53, 54, 55};
    for (int i = 0; i < 7; i++) {
        CHECK_EQ_INT(f.t.parent[i], par[i]);
        CHECK_EQ_INT(f.t.token[i], tok[i]);
    }
    CHECK_EQ_INT(check_stream(&f, 0, 0, 1), 0);
    fx_free(&f);

    /* Ties across depths (a log-prob of 0): lower depth first, then lower parent index. After
     * node 1 = (d1 r0): (d1 r1) and (d2 under 1) both score -1 -> the depth-1 sibling first;
     * then (d2 under 1) and (d2 under 2) both score -1 -> parent 1 first. */
    fx_init(&f, 1, 2, 2, 5);
    const int32_t ids2[4] = {60, 61, 70, 71};
    const float lp2[4] = {-1.0f, -1.0f, 0.0f, -5.0f};
    memcpy(f.ids, ids2, sizeof ids2);
    memcpy(f.logp, lp2, sizeof lp2);
    f.budget[0] = 4;
    fx_poison(&f);
    p = fx_params(&f, 0);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    const int32_t par2[5] = {-1, 0, 0, 1, 2}, tok2[5] = {1000, 60, 61, 70, 70};
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(f.t.parent[i], par2[i]);
        CHECK_EQ_INT(f.t.token[i], tok2[i]);
    }
    CHECK_EQ_INT(check_stream(&f, 0, 0, 1), 0);
    fx_free(&f);

    /* A heavily tied random case is reproducible, and -0 behaves exactly like +0. */
    uint64_t rng = 4242;
    fixture a, b;
    fx_init(&a, 1, 6, 8, 200);
    fx_init(&b, 1, 6, 8, 200);
    fx_random(&a, &rng, 1.0);
    memcpy(b.ids, a.ids, sizeof(int32_t) * 48);
    for (int i = 0; i < 48; i++) {
        if (i % 8 < 3) a.logp[i] = 0.0f; /* the first ranks: +0 in a, -0 in b */
        b.logp[i] = a.logp[i] == 0.0f ? (i % 2 ? -0.0f : 0.0f) : a.logp[i];
    }
    a.budget[0] = b.budget[0] = 150;
    kdt_tree_build_params pa = fx_params(&a, 0), pb = fx_params(&b, 0);
    fx_poison(&a);
    fx_poison(&b);
    CHECK_EQ_INT(kdt_tree_build_cpu(&pa, &a.t), KDT_OK);
    CHECK_EQ_INT(kdt_tree_build_cpu(&pb, &b.t), KDT_OK);
    CHECK(!memcmp(a.t.parent, b.t.parent, sizeof(int32_t) * 200));
    CHECK(!memcmp(a.t.token, b.t.token, sizeof(int32_t) * 200));
    CHECK(!memcmp(a.t.score, b.t.score, sizeof(float) * 200));
    CHECK(!memcmp(a.t.anc_mask, b.t.anc_mask, sizeof(uint64_t) * 200 * 4));
    CHECK_EQ_INT(check_stream(&a, 0, 0, 1), 0);
    fx_free(&a);
    fx_free(&b);
}

/* NaN log-probs score -inf (and so does -inf + +inf); the tree is still complete. */
static void test_nan_policy(void) {
    fixture f;
    fx_init(&f, 1, 2, 3, 10);
    const float lp[2][3] = {{-0.5f, NAN, -2.0f}, {INFINITY, -1.0f, -3.0f}};
    memcpy(f.logp, lp, sizeof lp);
    for (int i = 0; i < 6; i++) f.ids[i] = i;
    f.budget[0] = 9;
    fx_poison(&f);
    kdt_tree_build_params p = fx_params(&f, 0);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    CHECK_EQ_INT(f.t.n_nodes[0], 10);
    int n_neg_inf = 0;
    for (int i = 1; i < 10; i++) {
        CHECK(!isnan(f.t.score[i]));
        n_neg_inf += f.t.score[i] == -INFINITY;
    }
    CHECK(n_neg_inf >= 1); /* rank 1 at depth 1 and its subtree */
    CHECK_EQ_INT(check_stream(&f, 0, 0, 0), 0);
    fx_free(&f);
}

/* Several streams with their own B and L in one call == one call per stream. */
static void test_multi_stream(void) {
    uint64_t rng = 31337;
    const int32_t S = 6, L = 9, K = 12, M = 80;
    fixture all;
    fx_init(&all, S, L, K, M);
    fx_random(&all, &rng, 0);
    const int32_t budgets[6] = {0, 1, 79, 33, 64, 7}, limits[6] = {1, 9, 3, 9, 5, 2};
    for (int32_t s = 0; s < S; s++) {
        all.budget[s] = budgets[s];
        all.depth_limit[s] = limits[s];
    }
    for (int chain = 0; chain < 2; chain++) {
        fx_poison(&all);
        kdt_tree_build_params p = fx_params(&all, chain);
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &all.t), KDT_OK);
        for (int32_t s = 0; s < S; s++) {
            CHECK_EQ_INT(check_stream(&all, s, chain, 1), 0);
            fixture one;
            fx_init(&one, 1, L, K, M);
            memcpy(one.ids, all.ids + (size_t)s * L * K, sizeof(int32_t) * L * K);
            memcpy(one.logp, all.logp + (size_t)s * L * K, sizeof(float) * L * K);
            one.budget[0] = all.budget[s];
            one.depth_limit[0] = all.depth_limit[s];
            one.root[0] = all.root[s];
            one.prefix[0] = all.prefix[s];
            fx_poison(&one);
            kdt_tree_build_params p1 = fx_params(&one, chain);
            CHECK_EQ_INT(kdt_tree_build_cpu(&p1, &one.t), KDT_OK);
            CHECK_EQ_INT(one.t.n_nodes[0], all.t.n_nodes[s]);
            CHECK(!memcmp(one.t.token, all.t.token + s * M, sizeof(int32_t) * M));
            CHECK(!memcmp(one.t.parent, all.t.parent + s * M, sizeof(int32_t) * M));
            CHECK(!memcmp(one.t.position, all.t.position + s * M, sizeof(int32_t) * M));
            CHECK(!memcmp(one.t.score, all.t.score + s * M, sizeof(float) * M));
            CHECK(!memcmp(one.t.anc_mask, all.t.anc_mask + (size_t)s * M * all.W,
                          sizeof(uint64_t) * M * all.W));
            fx_free(&one);
        }
    }
    fx_free(&all);
}

/* The largest shape: B = 1024, L = 16, K = 1024 (several mask words, big frontier). */
static void test_max_shape(void) {
    uint64_t rng = 2024;
    fixture f;
    fx_init(&f, 2, KDT_MAX_DEPTH, KDT_MAX_TOPK, KDT_MAX_NODES);
    fx_random(&f, &rng, 0);
    f.budget[0] = KDT_MAX_BUDGET;
    f.budget[1] = 700;
    f.depth_limit[1] = 4;
    fx_poison(&f);
    kdt_tree_build_params p = fx_params(&f, 0);
    CHECK_EQ_INT(kdt_tree_build_cpu(&p, &f.t), KDT_OK);
    CHECK_EQ_INT(f.t.n_nodes[0], KDT_MAX_NODES);
    for (int32_t s = 0; s < 2; s++) CHECK_EQ_INT(check_stream(&f, s, 0, 1), 0);
    fx_free(&f);
}

static int message_has(const char *word) { return strstr(kdt_last_error(), word) != NULL; }

static void test_argument_errors(void) {
    uint64_t rng = 1;
    fixture f;
    fx_init(&f, 2, 4, 3, 10);
    fx_random(&f, &rng, 0);
    f.budget[0] = 5;
    f.budget[1] = 9;
    kdt_tree_build_params good = fx_params(&f, 0), p;
    CHECK_EQ_INT(kdt_tree_build_cpu(&good, &f.t), KDT_OK);
#define BAD(field_word, mutate)                                                     \
    do {                                                                            \
        kdt_tree t = f.t;                                                           \
        p = good;                                                                   \
        mutate;                                                                     \
        kdt_clear_error();                                                          \
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &t), KDT_ERR_INVALID_ARG);              \
        CHECK_MSG(message_has(field_word), "message '%s' lacks '%s'", kdt_last_error(), field_word); \
    } while (0)
    kdt_clear_error();
    CHECK_EQ_INT(kdt_tree_build_cpu(NULL, &f.t), KDT_ERR_INVALID_ARG);
    CHECK(message_has("params"));
    CHECK_EQ_INT(kdt_tree_build_cpu(&good, NULL), KDT_ERR_INVALID_ARG);
    CHECK(message_has("out"));
    BAD("n_streams", p.n_streams = 0);
    BAD("n_streams", p.n_streams = KDT_MAX_STREAMS + 1);
    BAD("n_streams", t.n_streams = 1);
    BAD("max_nodes", t.max_nodes = 0);
    BAD("max_nodes", t.max_nodes = KDT_MAX_NODES + 1);
    BAD("max_depth", p.max_depth = 0);
    BAD("max_depth", p.max_depth = KDT_MAX_DEPTH + 1);
    BAD("top_k", p.top_k = 0);
    BAD("top_k", p.top_k = KDT_MAX_TOPK + 1);
    BAD("chain", p.chain = 2);
    BAD("top_ids", p.top_ids = NULL);
    BAD("top_logp", p.top_logp = NULL);
    BAD("depth_limit", p.depth_limit = NULL);
    BAD("budget", p.budget = NULL);
    BAD("root_token", p.root_token = NULL);
    BAD("prefix_len", p.prefix_len = NULL);
    BAD("n_nodes", t.n_nodes = NULL);
    BAD("token", t.token = NULL);
    BAD("parent", t.parent = NULL);
    BAD("depth", t.depth = NULL);
    BAD("first_child", t.first_child = NULL);
    BAD("next_sibling", t.next_sibling = NULL);
    BAD("position", t.position = NULL);
    BAD("score", t.score = NULL);
    BAD("anc_mask", t.anc_mask = NULL);
    int32_t bad_vals[2];
    BAD("budget[1]", (bad_vals[0] = 1, bad_vals[1] = 10, p.budget = bad_vals));    /* > max_nodes-1 */
    BAD("budget[0]", (bad_vals[0] = -1, bad_vals[1] = 1, p.budget = bad_vals));
    BAD("depth_limit[1]", (bad_vals[0] = 1, bad_vals[1] = 0, p.depth_limit = bad_vals));
    BAD("depth_limit[0]", (bad_vals[0] = 5, bad_vals[1] = 1, p.depth_limit = bad_vals)); /* > max_depth 4 */
    BAD("prefix_len[1]", (bad_vals[0] = 0, bad_vals[1] = -3, p.prefix_len = bad_vals));
    BAD("prefix_len[0]", (bad_vals[0] = INT32_MAX, bad_vals[1] = 0, p.prefix_len = bad_vals));
#undef BAD
    /* The CUDA launcher checks the same host-side fields (or says there is no CUDA). */
    kdt_tree t = f.t;
    p = good;
    p.top_k = 0;
    kdt_status st = kdt_tree_build_cuda(&p, &t, NULL);
    CHECK(st == KDT_ERR_INVALID_ARG || st == KDT_ERR_NO_CUDA);
    fx_free(&f);
}

int main(void) {
    T_RUN(test_paper_example);
    T_RUN(test_optimal_vs_brute_force);
    T_RUN(test_invariants_random);
    T_RUN(test_chain);
    T_RUN(test_root_only);
    T_RUN(test_ties);
    T_RUN(test_nan_policy);
    T_RUN(test_multi_stream);
    T_RUN(test_max_shape);
    T_RUN(test_argument_errors);
    return t_summary();
}
