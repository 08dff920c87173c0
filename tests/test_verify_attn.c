/* test_verify_attn.c - CPU tests of kdt_verify_attn_cpu (tree-masked MLA verify attention).
 *
 * The twin is checked against a naive fp64 computation written here that derives visibility
 * from the parent links (not from anc_mask), one row and one key at a time: every bf16 output
 * must be the correctly rounded value of the naive result (within half a bf16 ulp, plus a hair
 * for the different summation order), lse within fp32 rounding. Also: masked keys and slots past
 * prefix+N contribute nothing (planted huge / NaN values leave outputs bit-identical), a chain
 * tree equals causal attention, random trees, prefixes that are not a multiple of the page,
 * random non-contiguous block tables, the real 576/512 shape, a row with no visible key, and the
 * argument errors (each must name its field).
 *
 * The second half emulates the CUDA kernel (cuda/verify_attn.cu) on the CPU: the same tile index
 * maps (cuda/verify_attn_tiles.cuh: swizzle, ldmatrix addresses, fragment coordinates, split
 * schedule), ldmatrix and mma.sync executed per the PTX ISA fragment layouts for all 32 lanes of
 * all 8 warps, the same online softmax and split combine. It checks the kernel's index math and
 * schedule without a GPU (bank-conflict-free ldmatrix phases included) and must match the twin to
 * the GPU test's tolerance; tests/gpu/test_verify_attn_gpu.c then checks the real thing.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp.h"
#include "kdtree/kernels.h"
#include "kernels/cuda/verify_attn_tiles.cuh"
#include "t.h"

enum tree_kind { TREE_RANDOM, TREE_CHAIN, TREE_STAR };

/* One test problem; every array is a host array. */
typedef struct va_case {
    int S, H, max_nodes, dqk, dv, page_size, n_pages, max_pages, words;
    int32_t *prefix;   /* [S] */
    int32_t *n_nodes;  /* [S] */
    int32_t *parent;   /* [S][max_nodes] -1 for root and padding */
    int32_t *table;    /* [S][max_pages] -1 past the used pages */
    uint64_t *mask;    /* [S][max_nodes][words] */
    uint16_t *q;       /* [S][max_nodes][H][dqk] */
    uint16_t *kv;      /* [n_pages][page_size][dqk] */
    unsigned char *kv8; /* NULL, or the same keys as FP8 rows (case_to_fp8): the emulation loads these */
    uint16_t *out;     /* [S][max_nodes][H][dv] */
    float *lse;        /* [S][max_nodes][H] */
    float scale;
} va_case;

static void case_free(va_case *c) {
    free(c->prefix), free(c->n_nodes), free(c->parent), free(c->table), free(c->mask);
    free(c->q), free(c->kv), free(c->kv8), free(c->out), free(c->lse);
    memset(c, 0, sizeof *c);
}

/* Builds a case: stream s gets n_nodes[s] nodes over prefix[s] committed tokens, a tree of the
 * given kind, pages scattered at random over a pool with spare pages, q and kv ~ N(0, 1). */
static void case_make(va_case *c, uint64_t seed, int S, int H, int max_nodes, int dqk, int dv,
                      int page_size, const int *prefix, const int *n_nodes, enum tree_kind kind) {
    memset(c, 0, sizeof *c);
    c->S = S, c->H = H, c->max_nodes = max_nodes, c->dqk = dqk, c->dv = dv;
    c->page_size = page_size, c->words = KDT_MASK_WORDS(max_nodes);
    c->scale = 0.144680f;
    c->prefix = malloc(sizeof(int32_t) * S);
    c->n_nodes = malloc(sizeof(int32_t) * S);
    int max_keys = 1, pages_used = 0;
    for (int s = 0; s < S; s++) {
        c->prefix[s] = prefix[s], c->n_nodes[s] = n_nodes[s];
        const int keys = prefix[s] + n_nodes[s];
        if (keys > max_keys) max_keys = keys;
        pages_used += (keys + page_size - 1) / page_size;
    }
    c->max_pages = (max_keys + page_size - 1) / page_size + 1; /* one spare entry */
    c->n_pages = pages_used + 3;                                /* spare pages nobody maps */
    c->parent = malloc(sizeof(int32_t) * S * max_nodes);
    c->mask = calloc((size_t)S * max_nodes * c->words, sizeof(uint64_t));
    c->table = malloc(sizeof(int32_t) * S * c->max_pages);
    for (int i = 0; i < S * c->max_pages; i++) c->table[i] = -1;
    /* Random permutation of the pages, dealt out in order. */
    int *perm = malloc(sizeof(int) * c->n_pages);
    for (int i = 0; i < c->n_pages; i++) perm[i] = i;
    for (int i = c->n_pages - 1; i > 0; i--) {
        int j = t_rand_int(&seed, i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int next = 0;
    for (int s = 0; s < S; s++) {
        const int used = (prefix[s] + n_nodes[s] + page_size - 1) / page_size;
        for (int k = 0; k < used; k++) c->table[s * c->max_pages + k] = perm[next++];
        int32_t *par = c->parent + s * max_nodes;
        for (int i = 0; i < max_nodes; i++) {
            if (i == 0 || i >= n_nodes[s]) par[i] = -1;
            else if (kind == TREE_CHAIN) par[i] = i - 1;
            else if (kind == TREE_STAR) par[i] = 0;
            else par[i] = t_rand_int(&seed, i);
        }
        for (int i = 0; i < n_nodes[s]; i++) {
            uint64_t *row = c->mask + ((size_t)s * max_nodes + i) * c->words;
            for (int a = i; a >= 0; a = par[a]) row[a >> 6] |= 1ull << (a & 63);
        }
    }
    free(perm);
    const size_t nq = (size_t)S * max_nodes * H * dqk, nkv = (size_t)c->n_pages * page_size * dqk;
    c->q = malloc(2 * nq);
    c->kv = malloc(2 * nkv);
    for (size_t i = 0; i < nq; i++) c->q[i] = kdt_f32_to_bf16((float)t_rand_normal(&seed));
    for (size_t i = 0; i < nkv; i++) c->kv[i] = kdt_f32_to_bf16((float)t_rand_normal(&seed));
    c->out = malloc(2 * (size_t)S * max_nodes * H * dv);
    c->lse = malloc(sizeof(float) * S * max_nodes * H);
}

static kdt_verify_attn_params case_params(const va_case *c) {
    kdt_verify_attn_params p;
    memset(&p, 0, sizeof p);
    p.n_streams = c->S, p.n_heads = c->H, p.max_nodes = c->max_nodes;
    p.d_qk = c->dqk, p.d_v = c->dv, p.softmax_scale = c->scale;
    p.q = c->q, p.kv_cache = c->kv, p.n_pages = c->n_pages, p.page_size = c->page_size;
    p.block_table = c->table, p.max_pages = c->max_pages;
    p.prefix_len = c->prefix, p.n_nodes = c->n_nodes, p.anc_mask = c->mask;
    p.out = c->out, p.lse = c->lse;
    return p;
}

/* Poisons the outputs (NaN) so unwritten elements show. */
static void case_poison(va_case *c) {
    memset(c->out, 0xff, 2 * (size_t)c->S * c->max_nodes * c->H * c->dv);
    memset(c->lse, 0xff, sizeof(float) * c->S * c->max_nodes * c->H);
}

static const uint16_t *kv_row(const va_case *c, int s, int t) {
    const int page = c->table[s * c->max_pages + t / c->page_size];
    return c->kv + ((size_t)page * c->page_size + t % c->page_size) * c->dqk;
}

/* Is key t visible to node i of stream s? From the parent links, or causal when asked. */
static int naive_visible(const va_case *c, int s, int i, int t, int causal) {
    const int P = c->prefix[s];
    if (t < P) return 1;
    const int j = t - P;
    if (causal) return j <= i;
    for (int a = i; a >= 0; a = c->parent[s * c->max_nodes + a])
        if (a == j) return 1;
    return 0;
}

/* Naive fp64 attention for one row: ref[dv], *lse. */
static void naive_row(const va_case *c, int s, int i, int h, int causal, double *ref, double *lse) {
    const int T = c->prefix[s] + c->n_nodes[s];
    const uint16_t *q = c->q + (((size_t)s * c->max_nodes + i) * c->H + h) * c->dqk;
    double *score = malloc(sizeof(double) * T);
    double m = -INFINITY;
    for (int t = 0; t < T; t++) {
        if (!naive_visible(c, s, i, t, causal)) continue;
        const uint16_t *k = kv_row(c, s, t);
        double dot = 0;
        for (int d = 0; d < c->dqk; d++) dot += (double)kdt_bf16_to_f32(q[d]) * kdt_bf16_to_f32(k[d]);
        score[t] = (double)c->scale * dot;
        if (score[t] > m) m = score[t];
    }
    double sum = 0;
    for (int d = 0; d < c->dv; d++) ref[d] = 0;
    for (int t = 0; t < T; t++) {
        if (!naive_visible(c, s, i, t, causal)) continue;
        const double w = exp(score[t] - m);
        sum += w;
        const uint16_t *v = kv_row(c, s, t);
        for (int d = 0; d < c->dv; d++) ref[d] += w * kdt_bf16_to_f32(v[d]);
    }
    for (int d = 0; d < c->dv; d++) ref[d] /= sum;
    *lse = m + log(sum);
    free(score);
}

/* bf16 output x must be the rounding of the exact value r: |x - r| <= ulp(r)/2, with a margin of
 * 1e-9 relative for the twin's different summation order. */
static int bf16_is_rounding_of(uint16_t x, double r) {
    const double xv = kdt_bf16_to_f32(x);
    if (isnan(xv) || isnan(r)) return 0;
    if (r == 0) return xv == 0;
    int e;
    frexp(r, &e);                      /* |r| = m * 2^e, m in [0.5, 1) */
    const double ulp = ldexp(1.0, e - 8); /* bf16: 8 significant bits */
    return fabs(xv - r) <= 0.5 * ulp + 1e-9 * fabs(r);
}

/* Compares every row of the twin's output with the naive computation; counts mismatches. */
static int check_against_naive(const va_case *c, int causal) {
    int bad = 0;
    double *ref = malloc(sizeof(double) * c->dv);
    for (int s = 0; s < c->S; s++)
        for (int i = 0; i < c->n_nodes[s]; i++)
            for (int h = 0; h < c->H; h++) {
                double lse;
                naive_row(c, s, i, h, causal, ref, &lse);
                const size_t row = ((size_t)s * c->max_nodes + i) * c->H + h;
                for (int d = 0; d < c->dv; d++)
                    if (!bf16_is_rounding_of(c->out[row * c->dv + d], ref[d])) {
                        if (bad < 5)
                            fprintf(stderr, "  s %d node %d head %d col %d: got %.9g want %.9g\n", s, i,
                                    h, d, (double)kdt_bf16_to_f32(c->out[row * c->dv + d]), ref[d]);
                        bad++;
                    }
                const double got = c->lse[row];
                if (!(fabs(got - lse) <= 1e-6 * fmax(1.0, fabs(lse)))) {
                    if (bad < 5)
                        fprintf(stderr, "  s %d node %d head %d: lse %.9g want %.9g\n", s, i, h, got, lse);
                    bad++;
                }
            }
    free(ref);
    return bad;
}

/* Padding rows (node >= n_nodes) must keep their poison. */
static int padding_untouched(const va_case *c) {
    for (int s = 0; s < c->S; s++)
        for (int i = c->n_nodes[s]; i < c->max_nodes; i++)
            for (int h = 0; h < c->H; h++) {
                const size_t row = ((size_t)s * c->max_nodes + i) * c->H + h;
                uint32_t u;
                memcpy(&u, c->lse + row, 4);
                if (u != 0xffffffffu) return 0;
                for (int d = 0; d < c->dv; d++)
                    if (c->out[row * c->dv + d] != 0xffff) return 0;
            }
    return 1;
}

static void run_and_check(va_case *c, int causal) {
    case_poison(c);
    kdt_verify_attn_params p = case_params(c);
    const kdt_status st = kdt_verify_attn_cpu(&p);
    CHECK_MSG(st == KDT_OK, "%s: %s", kdt_status_name(st), kdt_last_error());
    if (st != KDT_OK) return;
    const int bad = check_against_naive(c, causal);
    CHECK_MSG(bad == 0, "%d mismatches (S=%d H=%d dqk=%d dv=%d)", bad, c->S, c->H, c->dqk, c->dv);
    CHECK(padding_untouched(c));
}

static void test_small_dims_random_trees(void) {
    for (int seed = 1, seeds = t_fuzz_iters(6); seed <= seeds; seed++) {
        uint64_t rs = t_fuzz_seed(1000 + (uint64_t)seed);
        const int S = 3, max_nodes = 20;
        int prefix[3], n[3];
        for (int s = 0; s < S; s++) {
            prefix[s] = t_rand_int(&rs, 150); /* rarely a multiple of the page */
            n[s] = 1 + t_rand_int(&rs, max_nodes);
        }
        const int H = 1 + t_rand_int(&rs, 8), page = (seed & 1) ? 64 : 16;
        va_case c;
        case_make(&c, (uint64_t)seed, S, H, max_nodes, 64, 32, page, prefix, n, TREE_RANDOM);
        run_and_check(&c, 0);
        case_free(&c);
    }
}

static void test_real_dims(void) {
    const int prefix[2] = {70, 0}, n[2] = {5, 3};
    va_case c;
    case_make(&c, 77, 2, 4, 6, 576, 512, 64, prefix, n, TREE_RANDOM);
    run_and_check(&c, 0);
    case_free(&c);
}

static void test_chain_is_causal(void) {
    const int prefix[2] = {65, 127}, n[2] = {17, 9};
    va_case c;
    case_make(&c, 5, 2, 3, 17, 64, 32, 64, prefix, n, TREE_CHAIN);
    run_and_check(&c, 1); /* the reference uses the causal rule t <= prefix + i, not the mask */
    case_free(&c);
}

static void test_star_and_wide_trees(void) {
    /* More than 64 nodes: mask rows span two words. */
    const int prefix[2] = {1, 63}, n[2] = {70, 66};
    va_case c;
    case_make(&c, 9, 2, 2, 70, 32, 16, 64, prefix, n, TREE_STAR);
    run_and_check(&c, 0);
    case_free(&c);
    case_make(&c, 10, 2, 2, 70, 32, 16, 64, prefix, n, TREE_RANDOM);
    run_and_check(&c, 0);
    case_free(&c);
}

/* Planting garbage where no row may look must leave every output bit-identical, except rows
 * that legitimately see the planted slot. */
static void test_masked_keys_contribute_nothing(void) {
    const int prefix[2] = {100, 64}, n[2] = {12, 7};
    va_case c;
    case_make(&c, 21, 2, 4, 12, 64, 32, 64, prefix, n, TREE_RANDOM);
    case_poison(&c);
    kdt_verify_attn_params p = case_params(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    const size_t nout = (size_t)c.S * c.max_nodes * c.H * c.dv, nlse = (size_t)c.S * c.max_nodes * c.H;
    uint16_t *out0 = malloc(2 * nout);
    float *lse0 = malloc(4 * nlse);
    memcpy(out0, c.out, 2 * nout);
    memcpy(lse0, c.lse, 4 * nlse);

    /* 1. Everything past prefix + n in each stream's pages, and the unmapped pages: NaN / huge. */
    int mapped[256] = {0};
    for (int s = 0; s < c.S; s++) {
        const int T = c.prefix[s] + c.n_nodes[s];
        const int used = (T + c.page_size - 1) / c.page_size;
        for (int k = 0; k < used; k++) mapped[c.table[s * c.max_pages + k]] = 1;
        for (int t = T; t < used * c.page_size; t++) {
            uint16_t *row = (uint16_t *)kv_row(&c, s, t);
            for (int d = 0; d < c.dqk; d++) row[d] = (d & 1) ? 0x7fc0 /* NaN */ : 0x7f7f /* bf16 max */;
        }
    }
    for (int pg = 0; pg < c.n_pages; pg++)
        if (!mapped[pg])
            for (size_t e = 0; e < (size_t)c.page_size * c.dqk; e++) c.kv[(size_t)pg * c.page_size * c.dqk + e] = 0x7f80; /* inf */
    case_poison(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    CHECK(memcmp(out0, c.out, 2 * nout) == 0);
    CHECK(memcmp(lse0, c.lse, 4 * nlse) == 0);

    /* 2. One tree slot per stream: rows that do not see it keep their bits. */
    for (int s = 0; s < c.S; s++) {
        const int j = c.n_nodes[s] - 1; /* the last node: a leaf, seen by itself only */
        uint16_t *row = (uint16_t *)kv_row(&c, s, c.prefix[s] + j);
        for (int d = 0; d < c.dqk; d++) row[d] = 0x7f7f; /* huge finite */
    }
    case_poison(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    int changed_seen = 0, changed_unseen = 0;
    for (int s = 0; s < c.S; s++)
        for (int i = 0; i < c.n_nodes[s]; i++) {
            const int sees = naive_visible(&c, s, i, c.prefix[s] + c.n_nodes[s] - 1, 0);
            for (int h = 0; h < c.H; h++) {
                const size_t r = ((size_t)s * c.max_nodes + i) * c.H + h;
                const int same = memcmp(out0 + r * c.dv, c.out + r * c.dv, 2 * c.dv) == 0 &&
                                 memcmp(lse0 + r, c.lse + r, 4) == 0;
                if (sees) changed_seen += !same;
                else changed_unseen += !same;
            }
        }
    CHECK_EQ_INT(changed_unseen, 0);
    CHECK(changed_seen > 0); /* the planted slot is really read by the rows that see it */
    free(out0), free(lse0);
    case_free(&c);
}

static void test_no_visible_key(void) {
    const int prefix[1] = {0}, n[1] = {3};
    va_case c;
    case_make(&c, 31, 1, 2, 3, 16, 8, 64, prefix, n, TREE_RANDOM);
    memset(c.mask + 1 * c.words, 0, sizeof(uint64_t) * c.words); /* node 1 sees nothing */
    case_poison(&c);
    kdt_verify_attn_params p = case_params(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    for (int h = 0; h < c.H; h++) {
        const size_t r = (size_t)1 * c.H + h;
        CHECK(isinf(c.lse[r]) && c.lse[r] < 0);
        for (int d = 0; d < c.dv; d++) CHECK_EQ_INT(c.out[r * c.dv + d], 0);
        CHECK(isfinite(c.lse[0 * c.H + h]) && isfinite(c.lse[2 * c.H + h]));
    }
    case_free(&c);
}

/* Bit-for-bit repeatable, and independent of the other streams in the batch. */
static void test_batch_invariance(void) {
    const int prefix[3] = {90, 200, 13}, n[3] = {6, 11, 4};
    va_case c;
    case_make(&c, 41, 3, 4, 11, 64, 32, 64, prefix, n, TREE_RANDOM);
    case_poison(&c);
    kdt_verify_attn_params p = case_params(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    /* Stream 1 alone: point the params at its slices. */
    kdt_verify_attn_params one = p;
    const size_t qrow = (size_t)c.max_nodes * c.H;
    one.n_streams = 1;
    one.q = c.q + 1 * qrow * c.dqk;
    one.block_table = c.table + 1 * c.max_pages;
    one.prefix_len = c.prefix + 1, one.n_nodes = c.n_nodes + 1;
    one.anc_mask = c.mask + (size_t)1 * c.max_nodes * c.words;
    uint16_t *out1 = malloc(2 * qrow * c.dv);
    float *lse1 = malloc(4 * qrow);
    one.out = out1, one.lse = lse1;
    CHECK(kdt_verify_attn_cpu(&one) == KDT_OK);
    const size_t rows = (size_t)c.n_nodes[1] * c.H;
    CHECK(memcmp(out1, c.out + qrow * c.dv, 2 * rows * c.dv) == 0);
    CHECK(memcmp(lse1, c.lse + qrow, 4 * rows) == 0);
    free(out1), free(lse1);
    case_free(&c);
}

static int error_names(kdt_status st, kdt_status want, const char *word) {
    return st == want && strstr(kdt_last_error(), word) != NULL;
}

static void test_argument_errors(void) {
    const int prefix[2] = {30, 70}, n[2] = {4, 5};
    va_case c;
    case_make(&c, 51, 2, 2, 5, 16, 8, 64, prefix, n, TREE_RANDOM);
    kdt_verify_attn_params p = case_params(&c), b;
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    CHECK(error_names(kdt_verify_attn_cpu(NULL), KDT_ERR_INVALID_ARG, "params"));
#define BAD(field, value, word)                                                          \
    do {                                                                                 \
        b = p;                                                                           \
        b.field = value;                                                                 \
        CHECK_MSG(error_names(kdt_verify_attn_cpu(&b), KDT_ERR_INVALID_ARG, word),       \
                  "%s = %s: '%s'", #field, #value, kdt_last_error());                    \
    } while (0)
    BAD(n_streams, 0, "n_streams");
    BAD(n_streams, KDT_MAX_STREAMS + 1, "n_streams");
    BAD(n_heads, 0, "n_heads");
    BAD(n_heads, 129, "n_heads");
    BAD(max_nodes, 0, "max_nodes");
    BAD(max_nodes, KDT_MAX_NODES + 1, "max_nodes");
    BAD(d_qk, 0, "d_qk");
    BAD(d_v, 17, "d_v");
    BAD(d_v, 0, "d_v");
    BAD(softmax_scale, INFINITY, "softmax_scale");
    BAD(softmax_scale, NAN, "softmax_scale");
    BAD(q, NULL, "q");
    BAD(kv_cache, NULL, "kv_cache");
    BAD(block_table, NULL, "block_table");
    BAD(prefix_len, NULL, "prefix_len");
    BAD(n_nodes, NULL, "n_nodes");
    BAD(anc_mask, NULL, "anc_mask");
    BAD(out, NULL, "out");
    BAD(lse, NULL, "lse");
    BAD(n_pages, 0, "n_pages");
    BAD(page_size, 0, "page_size");
    BAD(max_pages, 0, "max_pages");
    BAD(max_pages, INT32_MAX, "max_pages");
    BAD(kv_format, 2, "kv_format");
    BAD(kv_format, -1, "kv_format");
    BAD(kv_format, KDT_KV_FP8_SCALED, "multiple of 128"); /* d_v 8: no whole scale group */
#undef BAD
    /* Per-stream data. */
    int32_t save;
    save = c.n_nodes[1], c.n_nodes[1] = 0;
    CHECK(error_names(kdt_verify_attn_cpu(&p), KDT_ERR_INVALID_ARG, "stream 1: n_nodes"));
    c.n_nodes[1] = c.max_nodes + 1;
    CHECK(error_names(kdt_verify_attn_cpu(&p), KDT_ERR_INVALID_ARG, "stream 1: n_nodes"));
    c.n_nodes[1] = save;
    save = c.prefix[0], c.prefix[0] = -1;
    CHECK(error_names(kdt_verify_attn_cpu(&p), KDT_ERR_INVALID_ARG, "stream 0: prefix_len"));
    c.prefix[0] = c.max_pages * c.page_size; /* prefix + n past the table */
    CHECK(error_names(kdt_verify_attn_cpu(&p), KDT_ERR_INVALID_ARG, "exceeds max_pages"));
    c.prefix[0] = save;
    save = c.table[1 * c.max_pages + 1], c.table[1 * c.max_pages + 1] = c.n_pages;
    CHECK(error_names(kdt_verify_attn_cpu(&p), KDT_ERR_INVALID_ARG, "stream 1: block_table[1]"));
    c.table[1 * c.max_pages + 1] = -1;
    CHECK(error_names(kdt_verify_attn_cpu(&p), KDT_ERR_INVALID_ARG, "block_table[1]"));
    c.table[1 * c.max_pages + 1] = save;
    /* An unused table entry may hold anything (case_make leaves -1 there). */
    CHECK(c.table[0 * c.max_pages + c.max_pages - 1] == -1);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    /* Failed calls write nothing. */
    case_poison(&c);
    c.n_nodes[1] = 0;
    CHECK(kdt_verify_attn_cpu(&p) == KDT_ERR_INVALID_ARG);
    c.n_nodes[1] = n[1];
    CHECK(c.out[0] == 0xffff && isnan(c.lse[0]));
    case_free(&c);
}

static void test_cuda_stub_or_args(void) {
    /* Without CUDA the launcher says so; with CUDA, bad arguments are caught before any launch. */
    if (!kdt_has_cuda()) {
        kdt_verify_attn_params p;
        memset(&p, 0, sizeof p);
        CHECK(kdt_verify_attn_cuda(&p, NULL) == KDT_ERR_NO_CUDA);
    } else {
        CHECK(kdt_verify_attn_cuda(NULL, NULL) == KDT_ERR_INVALID_ARG);
        /* an FP8 cache at dimensions the CUDA kernels are not built for (valid for the CPU
         * reference): refused by name before any device call, so this runs without a GPU */
        const int prefix[1] = {70}, n[1] = {3};
        va_case c;
        case_make(&c, 57, 1, 2, 3, 320, 256, 64, prefix, n, TREE_RANDOM);
        kdt_verify_attn_params p = case_params(&c);
        p.kv_format = KDT_KV_FP8_SCALED; /* the bf16 buffer is large enough for the FP8 rows */
        CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
        CHECK(error_names(kdt_verify_attn_cuda(&p, NULL), KDT_ERR_UNSUPPORTED, "d_qk"));
        case_free(&c);
    }
}

/* The FP8 latent cache (KDT_KV_FP8_SCALED) in the CPU reference. kdt_e4m3_to_f32 against the
 * format's definition for all 256 codes; the row size; then a cache of random e4m3 latents with
 * power-of-two scales (different per 128-column group) and bf16 rope values, whose values are all
 * exactly representable in bf16: the reference over it must equal, bit for bit, the reference over
 * the bf16 cache holding the same values. A NaN code in a visible key makes that row NaN; in a
 * masked key it changes nothing. */
static int fp8_code_ok(uint8_t b) { return (b & 0x7f) != 0x7f; }
static void test_fp8_cache_reference(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float want = (b & 0x7f) == 0x7f ? NAN
                                              : (b & 0x80 ? -1.0f : 1.0f) * (e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9));
        const float got = kdt_e4m3_to_f32((uint8_t)b);
        CHECK_MSG(isnan(want) ? isnan(got) : (got == want && signbit(got) == signbit(want)), "e4m3 0x%02x: %g vs %g", b,
                  (double)got, (double)want);
    }
    CHECK_EQ_INT((int)kdt_kv_row_bytes(KDT_KV_FP8_SCALED, 576, 512), 656);
    CHECK_EQ_INT((int)kdt_kv_row_bytes(KDT_KV_BF16, 576, 512), 1152);
    CHECK_EQ_INT((int)kdt_kv_row_bytes(KDT_KV_FP8_SCALED, 576, 500), 0);
    CHECK_EQ_INT((int)kdt_kv_row_bytes(7, 576, 512), 0);

    const int dqk = 320, dv = 256, page = 64; /* two scale groups, 64 rope columns */
    const int prefix[3] = {150, 0, 77}, n[3] = {9, 5, 17};
    va_case c;
    case_make(&c, 58, 3, 4, 17, dqk, dv, page, prefix, n, TREE_RANDOM);
    const size_t rows = (size_t)c.n_pages * page, rb = kdt_kv_row_bytes(KDT_KV_FP8_SCALED, dqk, dv);
    unsigned char *fp8 = malloc(rows * rb);
    uint64_t seed = 59;
    for (size_t r = 0; r < rows; r++) {
        unsigned char *row = fp8 + r * rb;
        uint16_t *bf = c.kv + r * dqk;
        for (int g = 0; g < dv / KDT_KV_FP8_GROUP; g++) {
            const float sc = ldexpf(1.0f, t_rand_int(&seed, 9) - 6); /* 2^-6 .. 2^2 */
            memcpy(row + dv + 4 * g, &sc, 4);
            for (int j = g * KDT_KV_FP8_GROUP; j < (g + 1) * KDT_KV_FP8_GROUP; j++) {
                uint8_t b;
                do b = (uint8_t)t_rand_int(&seed, 256);
                while (!fp8_code_ok(b));
                row[j] = b;
                bf[j] = kdt_f32_to_bf16(kdt_e4m3_to_f32(b) * sc); /* exact: 4 significant bits */
                CHECK(kdt_bf16_to_f32(bf[j]) == kdt_e4m3_to_f32(b) * sc);
            }
        }
        memcpy(row + dv + 4 * (dv / KDT_KV_FP8_GROUP), bf + dv, 2 * (size_t)(dqk - dv)); /* rope: the same bf16 */
    }
    const size_t n_out = (size_t)c.S * c.max_nodes * c.H;
    kdt_verify_attn_params p = case_params(&c);
    case_poison(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    uint16_t *out_bf = malloc(2 * n_out * dv);
    float *lse_bf = malloc(4 * n_out);
    memcpy(out_bf, c.out, 2 * n_out * dv), memcpy(lse_bf, c.lse, 4 * n_out);
    p.kv_cache = fp8, p.kv_format = KDT_KV_FP8_SCALED;
    case_poison(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    int same = 1;
    for (int s = 0; s < c.S; s++) /* rows past n_nodes are not written */
        for (size_t r = 0; r < (size_t)c.n_nodes[s] * c.H; r++) {
            const size_t row = (size_t)s * c.max_nodes * c.H + r;
            same &= !memcmp(out_bf + row * dv, c.out + row * dv, 2 * (size_t)dv) && !memcmp(lse_bf + row, c.lse + row, 4);
        }
    CHECK_MSG(same, "the FP8 cache's reference differs from the bf16 cache with the same values");

    /* a NaN latent in stream 2's last tree node: rows that see it are NaN, the others unchanged */
    const int s2 = 2, last = c.n_nodes[s2] - 1, t = c.prefix[s2] + last;
    const int pg = c.table[s2 * c.max_pages + t / page];
    fp8[((size_t)pg * page + t % page) * rb + 5] = 0x7f;
    case_poison(&c);
    CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
    int nan_rows = 0, bad = 0;
    for (int i = 0; i < c.n_nodes[s2]; i++) {
        int sees = 0;
        for (int a = i; a >= 0; a = c.parent[s2 * c.max_nodes + a]) sees |= a == last;
        for (int h = 0; h < c.H; h++) {
            const size_t row = ((size_t)s2 * c.max_nodes + i) * c.H + h;
            if (sees) nan_rows += isnan(c.lse[row]) && isnan(kdt_bf16_to_f32(c.out[row * dv]));
            else bad += memcmp(out_bf + row * dv, c.out + row * dv, 2 * (size_t)dv) != 0 || memcmp(lse_bf + row, c.lse + row, 4) != 0;
        }
    }
    CHECK_EQ_INT(nan_rows, c.H); /* only the last node sees itself: a leaf of any tree */
    CHECK_EQ_INT(bad, 0);
    free(fp8), free(out_bf), free(lse_bf);
    case_free(&c);
}


/* ---------------------------------------------------------------------------------------------
 * CPU emulation of the CUDA kernel's data flow (see the file comment).
 * ------------------------------------------------------------------------------------------- */

/* The kernel's per-config warp tiling (Cfg<BN, STAGES> in cuda/verify_attn.cu). */
typedef struct emu_cfg {
    int BN, MW, WM, NW, WN, MT, NT, PS;
} emu_cfg;

static emu_cfg emu_make_cfg(int BN) {
    emu_cfg k;
    k.BN = BN;
    k.MW = BN >= 64 ? 2 : 4;
    k.WM = VA_ROWS / k.MW, k.NW = 8 / k.MW, k.WN = BN / k.NW;
    k.MT = k.WM / 16, k.NT = k.WN / 8, k.PS = BN + 8;
    return k;
}

enum { EMU_TILE_BYTES = VA_ROWS * VA_QK_CHUNKS * 16 };

/* Per-lane registers of all 8 warps and the shared-memory images of one CTA. */
typedef struct emu_cta {
    uint8_t q_img[EMU_TILE_BYTES];                 /* [64][576] bf16, swizzled */
    uint8_t kv_img[EMU_TILE_BYTES];                /* [BN][576] bf16, swizzled */
    uint8_t p_img[VA_ROWS * (64 + 8) * 2];         /* [64][BN+8] bf16 */
    float red[4 * VA_ROWS];                        /* [NW][64] */
    int node[VA_ROWS];
    float o[8][32][4][8][4];
    float mq[8][32][2][2], lq[8][32][2][2], mp[8][32][4][2];
    float sc[8][32][2][2][4];
    int bad_addr, conflicts;
} emu_cta;

static float emu_lo(uint32_t v) { return kdt_bf16_to_f32((uint16_t)(v & 0xffff)); }
static float emu_hi(uint32_t v) { return kdt_bf16_to_f32((uint16_t)(v >> 16)); }
static uint32_t emu_pack(float lo, float hi) {
    return (uint32_t)kdt_f32_to_bf16(lo) | ((uint32_t)kdt_f32_to_bf16(hi) << 16);
}

/* ldmatrix .x{nmat}[.trans] over an image of `size` bytes; addr[l] from every lane l. Also
 * checks alignment, bounds and that each 8-address phase hits 8 distinct 16-byte bank groups. */
static void emu_ldsm(emu_cta *c, const uint8_t *img, size_t size, const uint32_t addr[32], int nmat,
                     int trans, uint32_t out[32][4]) {
    for (int j = 0; j < nmat; j++) {
        int groups = 0;
        for (int r = 0; r < 8; r++) {
            const uint32_t a = addr[j * 8 + r];
            if (a % 16 != 0 || a + 16 > size) { c->bad_addr++; return; }
            const int grp = (int)((a / 16) % 8);
            if (groups & (1 << grp)) c->conflicts++;
            groups |= 1 << grp;
        }
    }
    for (int l = 0; l < 32; l++)
        for (int j = 0; j < nmat; j++) {
            if (!trans) {
                memcpy(&out[l][j], img + addr[j * 8 + (l >> 2)] + 4 * (l & 3), 4);
            } else {
                uint16_t lo, hi;
                memcpy(&lo, img + addr[j * 8 + 2 * (l & 3)] + 2 * (l >> 2), 2);
                memcpy(&hi, img + addr[j * 8 + 2 * (l & 3) + 1] + 2 * (l >> 2), 2);
                out[l][j] = (uint32_t)lo | ((uint32_t)hi << 16);
            }
        }
}

/* mma.sync m16n8k16 bf16 -> fp32, d += a b, fragments as in verify_attn_tiles.cuh. */
static void emu_mma(float d[32][4], const uint32_t a[32][4], const uint32_t b[32][4], int b_first) {
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        A[g][2 * t] = emu_lo(a[l][0]), A[g][2 * t + 1] = emu_hi(a[l][0]);
        A[g + 8][2 * t] = emu_lo(a[l][1]), A[g + 8][2 * t + 1] = emu_hi(a[l][1]);
        A[g][2 * t + 8] = emu_lo(a[l][2]), A[g][2 * t + 9] = emu_hi(a[l][2]);
        A[g + 8][2 * t + 8] = emu_lo(a[l][3]), A[g + 8][2 * t + 9] = emu_hi(a[l][3]);
        B[2 * t][g] = emu_lo(b[l][b_first]), B[2 * t + 1][g] = emu_hi(b[l][b_first]);
        B[2 * t + 8][g] = emu_lo(b[l][b_first + 1]), B[2 * t + 9][g] = emu_hi(b[l][b_first + 1]);
    }
    for (int l = 0; l < 32; l++) {
        const int g = l >> 2, t = l & 3;
        for (int e = 0; e < 4; e++) {
            const int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
            double acc = 0;
            for (int k = 0; k < 16; k++) acc += (double)A[row][k] * B[k][col];
            d[l][e] = (float)((double)d[l][e] + acc);
        }
    }
}

/* Copies rows of a stream's KV (or Q) into a swizzled image; rows past `valid` are zero. */
static void emu_load_kv(const va_case *c, int s, int t0, int ke, int BN, uint8_t *img) {
    for (int r = 0; r < BN; r++)
        for (int ch = 0; ch < VA_QK_CHUNKS; ch++) {
            uint8_t *dst = img + va_swz(r, ch);
            if (t0 + r >= ke) {
                memset(dst, 0, 16);
            } else if (c->kv8) { /* the FP8 loader (load_kv_tile_fp8): convert or copy each chunk */
                const int t = t0 + r, page = c->table[s * c->max_pages + t / c->page_size];
                const unsigned char *row = c->kv8 + ((size_t)page * c->page_size + t % c->page_size) * VA_FP8_ROW;
                if (ch < 64) {
                    float sc;
                    uint16_t h[8];
                    memcpy(&sc, row + VA_FP8_SCALES + 4 * va_fp8_scale_idx(ch), 4);
                    va_fp8_chunk(row + va_fp8_src(ch), sc, h);
                    memcpy(dst, h, 16);
                } else {
                    memcpy(dst, row + va_fp8_src(ch), 16);
                }
            } else {
                memcpy(dst, kv_row(c, s, t0 + r) + ch * 8, 16);
            }
        }
}

/* The nearest e4m3 code to x (ties to the even code), by bisection over the finite codes sorted by
 * value; |x| beyond 448 saturates. For the FP8 cases' caches only. */
static uint8_t e4m3_nearest(float x) {
    static float val[127];
    static int ready;
    if (!ready) { /* codes 0x00 .. 0x7e are the non-negative finite values, ascending */
        for (int b = 0; b < 127; b++) val[b] = kdt_e4m3_to_f32((uint8_t)b);
        ready = 1;
    }
    const float a = fabsf(x);
    int lo = 0, hi = 126;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (val[mid] <= a) lo = mid;
        else hi = mid;
    }
    int b = a - val[lo] < val[hi] - a || (a - val[lo] == val[hi] - a && !(lo & 1)) ? lo : hi;
    if (a >= val[126]) b = 126;
    return (uint8_t)(b | (x < 0 ? 0x80 : 0));
}

/* The case's keys as FP8 rows (Kimi dims): per 128 latents a scale that maps the group's max |v|
 * to 448 (pow2: rounded up to a power of two, so e4m3 x scale is exact in bf16), codes the nearest
 * e4m3 to v / scale, the rope columns as they are. */
static void case_to_fp8(va_case *c, int pow2) {
    const size_t rows = (size_t)c->n_pages * c->page_size;
    c->kv8 = malloc(rows * VA_FP8_ROW);
    for (size_t r = 0; r < rows; r++) {
        const uint16_t *bf = c->kv + r * VA_D_QK;
        unsigned char *row = c->kv8 + r * VA_FP8_ROW;
        for (int g = 0; g < VA_D_V / KDT_KV_FP8_GROUP; g++) {
            float mx = 0.f;
            for (int j = g * KDT_KV_FP8_GROUP; j < (g + 1) * KDT_KV_FP8_GROUP; j++) mx = fmaxf(mx, fabsf(kdt_bf16_to_f32(bf[j])));
            float sc = mx > 0.f ? mx / 448.0f : 1.0f;
            if (pow2) sc = ldexpf(1.0f, (int)ceilf(log2f(sc)));
            memcpy(row + VA_FP8_SCALES + 4 * g, &sc, 4);
            for (int j = g * KDT_KV_FP8_GROUP; j < (g + 1) * KDT_KV_FP8_GROUP; j++)
                row[j] = e4m3_nearest(kdt_bf16_to_f32(bf[j]) / sc);
        }
        memcpy(row + VA_FP8_ROPE, bf + VA_D_V, 2 * (VA_D_QK - VA_D_V));
    }
}

/* One item: rows [g0, g0+64) of stream s over keys [kb, ke). Writes per row the normalized
 * output o[64][512] (fp32) and lse[64] (natural log), as the kernel's epilogue computes them. */
static void emu_item(emu_cta *C, const emu_cfg *k, const va_case *c, int s, int g0, int kb, int ke,
                     float *o_out, float *lse_out) {
    const int H = c->H, P = c->prefix[s], n = c->n_nodes[s];
    const int rows_valid = (n * H - g0) < VA_ROWS ? (n * H - g0) : VA_ROWS;
    const float scale_log2 = (float)((double)c->scale * 1.4426950408889634);
    for (int r = 0; r < VA_ROWS; r++) {
        C->node[r] = r < rows_valid ? (g0 + r) / H : -1;
        for (int ch = 0; ch < VA_QK_CHUNKS; ch++) {
            uint8_t *dst = C->q_img + va_swz(r, ch);
            if (r < rows_valid) memcpy(dst, c->q + ((size_t)s * c->max_nodes * H + g0 + r) * c->dqk + ch * 8, 16);
            else memset(dst, 0, 16);
        }
    }
    memset(C->o, 0, sizeof C->o);
    for (int w = 0; w < 8; w++)
        for (int l = 0; l < 32; l++)
            for (int i = 0; i < 4; i++)
                for (int h = 0; h < 2; h++) {
                    C->mp[w][l][i][h] = -INFINITY;
                    if (i < 2) C->mq[w][l][i][h] = -INFINITY, C->lq[w][l][i][h] = 0.f;
                }
    uint32_t addr[32], frag[32][4], af[2][32][4];
    for (int t0 = kb; t0 < ke; t0 += k->BN) {
        emu_load_kv(c, s, t0, ke, k->BN, C->kv_img);
        memset(C->p_img, 0xff, sizeof C->p_img); /* NaN: reading an unwritten P shows */
        const size_t kv_size = (size_t)k->BN * VA_QK_CHUNKS * 16;
        const int need_mask = t0 + k->BN > P || t0 + k->BN > ke;
        for (int w = 0; w < 8; w++) { /* S = Q K^T */
            const int mw = w % k->MW, nw = w / k->MW;
            float (*sc)[2][2][4] = C->sc[w];
            float acc[2][2][32][4];
            memset(acc, 0, sizeof acc);
            for (int kk = 0; kk < VA_D_QK / 16; kk++) {
                for (int mi = 0; mi < k->MT; mi++) {
                    for (int l = 0; l < 32; l++) addr[l] = va_qk_a_addr(mw * k->WM + mi * 16, kk, l);
                    emu_ldsm(C, C->q_img, sizeof C->q_img, addr, 4, 0, af[mi]);
                }
                for (int np = 0; np < k->NT / 2; np++) {
                    for (int l = 0; l < 32; l++) addr[l] = va_qk_b_addr_x4(nw * k->WN + np * 16, kk, l);
                    emu_ldsm(C, C->kv_img, kv_size, addr, 4, 0, frag);
                    for (int mi = 0; mi < k->MT; mi++) {
                        emu_mma(acc[mi][2 * np], af[mi], frag, 0);
                        emu_mma(acc[mi][2 * np + 1], af[mi], frag, 2);
                    }
                }
                if (k->NT & 1) {
                    for (int l = 0; l < 32; l++) addr[l] = va_qk_b_addr_x2(nw * k->WN + (k->NT - 1) * 8, kk, l);
                    emu_ldsm(C, C->kv_img, kv_size, addr, 2, 0, frag);
                    for (int mi = 0; mi < k->MT; mi++) emu_mma(acc[mi][k->NT - 1], af[mi], frag, 0);
                }
            }
            for (int l = 0; l < 32; l++) /* scale and mask */
                for (int mi = 0; mi < k->MT; mi++)
                    for (int ni = 0; ni < k->NT; ni++)
                        for (int e = 0; e < 4; e++) {
                            float v = acc[mi][ni][l][e] * scale_log2;
                            if (need_mask) {
                                const int row = mw * k->WM + mi * 16 + va_frag_row(l, e);
                                const int key = t0 + nw * k->WN + ni * 8 + va_frag_col(l, e);
                                int vis = key < ke;
                                if (vis && key >= P && C->node[row] >= 0) {
                                    const int j = key - P;
                                    vis = (int)((c->mask[((size_t)s * c->max_nodes + C->node[row]) * c->words + (j >> 6)] >> (j & 63)) & 1u);
                                }
                                if (!vis) v = -INFINITY;
                            }
                            sc[l][mi][ni][e] = v;
                        }
            for (int mi = 0; mi < k->MT; mi++) /* row maxima of the warp's keys (quad reduce) */
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 32; l += 4) {
                        float mx = -INFINITY;
                        for (int q = l; q < l + 4; q++)
                            for (int ni = 0; ni < k->NT; ni++)
                                mx = fmaxf(mx, fmaxf(sc[q][mi][ni][2 * h], sc[q][mi][ni][2 * h + 1]));
                        C->red[nw * VA_ROWS + mw * k->WM + mi * 16 + va_frag_row(l, 2 * h)] = mx;
                    }
        }
        /* barrier B: new maxima, P into shared memory, row sums; alphas of the O rows */
        float ap[8][32][4][2];
        for (int w = 0; w < 8; w++) {
            const int mw = w % k->MW, nw = w / k->MW;
            for (int l = 0; l < 32; l++) {
                for (int mi = 0; mi < k->MT; mi++)
                    for (int h = 0; h < 2; h++) {
                        const int row = mw * k->WM + mi * 16 + va_frag_row(l, 2 * h);
                        float tm = C->red[row];
                        for (int ww = 1; ww < k->NW; ww++) tm = fmaxf(tm, C->red[ww * VA_ROWS + row]);
                        const float mn = fmaxf(C->mq[w][l][mi][h], tm);
                        const float alpha = mn == -INFINITY ? 1.f : exp2f(C->mq[w][l][mi][h] - mn);
                        const float mu = mn == -INFINITY ? 0.f : mn;
                        C->mq[w][l][mi][h] = mn;
                        float ls = 0.f;
                        for (int ni = 0; ni < k->NT; ni++) {
                            const float p0 = exp2f(C->sc[w][l][mi][ni][2 * h] - mu), p1 = exp2f(C->sc[w][l][mi][ni][2 * h + 1] - mu);
                            const uint32_t pk = emu_pack(p0, p1);
                            ls += p0 + p1;
                            memcpy(C->p_img + (size_t)(row * k->PS + nw * k->WN + ni * 8 + va_frag_col(l, 0)) * 2, &pk, 4);
                        }
                        C->lq[w][l][mi][h] = C->lq[w][l][mi][h] * alpha + ls;
                    }
                for (int mi = 0; mi < 4; mi++)
                    for (int h = 0; h < 2; h++) {
                        const int row = mi * 16 + va_frag_row(l, 2 * h);
                        float tm = C->red[row];
                        for (int ww = 1; ww < k->NW; ww++) tm = fmaxf(tm, C->red[ww * VA_ROWS + row]);
                        const float mn = fmaxf(C->mp[w][l][mi][h], tm);
                        ap[w][l][mi][h] = mn == -INFINITY ? 1.f : exp2f(C->mp[w][l][mi][h] - mn);
                        C->mp[w][l][mi][h] = mn;
                    }
            }
        }
        /* barrier C: O = O * alpha + P V */
        for (int w = 0; w < 8; w++) {
            for (int l = 0; l < 32; l++)
                for (int mi = 0; mi < 4; mi++)
                    for (int nj = 0; nj < 8; nj++)
                        for (int e = 0; e < 4; e++) C->o[w][l][mi][nj][e] *= ap[w][l][mi][e >> 1];
            for (int kk = 0; kk < k->BN / 16; kk++) {
                uint32_t pa[4][32][4];
                for (int mi = 0; mi < 4; mi++) {
                    for (int l = 0; l < 32; l++) addr[l] = va_pv_a_addr(mi * 16, kk, l, k->PS);
                    emu_ldsm(C, C->p_img, (size_t)VA_ROWS * k->PS * 2, addr, 4, 0, pa[mi]);
                }
                for (int np = 0; np < 4; np++) {
                    for (int l = 0; l < 32; l++) addr[l] = va_pv_b_addr(kk, w * 64 + np * 16, l);
                    emu_ldsm(C, C->kv_img, kv_size, addr, 4, 1, frag);
                    for (int mi = 0; mi < 4; mi++) {
                        float d0[32][4], d1[32][4];
                        for (int l = 0; l < 32; l++)
                            for (int e = 0; e < 4; e++)
                                d0[l][e] = C->o[w][l][mi][2 * np][e], d1[l][e] = C->o[w][l][mi][2 * np + 1][e];
                        emu_mma(d0, pa[mi], frag, 0);
                        emu_mma(d1, pa[mi], frag, 2);
                        for (int l = 0; l < 32; l++)
                            for (int e = 0; e < 4; e++)
                                C->o[w][l][mi][2 * np][e] = d0[l][e], C->o[w][l][mi][2 * np + 1][e] = d1[l][e];
                    }
                }
            }
        }
    }
    /* Epilogue: row sums over quads and key-warps, normalize. */
    for (int w = 0; w < 8; w++) {
        const int mw = w % k->MW, nw = w / k->MW;
        for (int mi = 0; mi < k->MT; mi++)
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l += 4) {
                    float sum = 0.f;
                    for (int q = l; q < l + 4; q++) sum += C->lq[w][q][mi][h];
                    C->red[nw * VA_ROWS + mw * k->WM + mi * 16 + va_frag_row(l, 2 * h)] = sum;
                }
    }
    for (int w = 0; w < 8; w++)
        for (int l = 0; l < 32; l++)
            for (int mi = 0; mi < 4; mi++)
                for (int h = 0; h < 2; h++) {
                    const int row = mi * 16 + va_frag_row(l, 2 * h);
                    if (row >= rows_valid) continue;
                    float sum = C->red[row];
                    for (int ww = 1; ww < k->NW; ww++) sum += C->red[ww * VA_ROWS + row];
                    const int zero = sum == 0.f;
                    const float inv = sum > 0.f ? 1.f / sum : 0.f;
                    for (int nj = 0; nj < 8; nj++)
                        for (int e = 2 * h; e < 2 * h + 2; e++)
                            o_out[row * VA_D_V + w * 64 + nj * 8 + va_frag_col(l, e)] = zero ? 0.f : C->o[w][l][mi][nj][e] * inv;
                    if (w == 0 && (l & 3) == 0)
                        lse_out[row] = sum > 0.f ? (C->mp[w][l][mi][h] + log2f(sum)) * 0.693147180559945309f : -INFINITY;
                }
}

/* x rounded to fp16 (11 significant bits, round to nearest even; subnormal steps of 2^-24 below
 * 2^-14), the format of the kernel's split partials; |x| < 65,504 here. */
static float emu_round_half(float x) {
    if (x == 0.f || !isfinite(x)) return x;
    int e;
    frexpf(x, &e); /* |x| in [2^(e-1), 2^e) */
    const int step_exp = e - 1 - 10 < -24 ? -24 : e - 1 - 10;
    return ldexpf(nearbyintf(ldexpf(x, -step_exp)), step_exp);
}
/* A split item's partial row as the kernel stores it: per 64 columns, scaled by the power of two
 * that puts the group's max |x| in [2^14, 2^15) (va::part_scales), rounded to fp16, scaled back. */
static void emu_partial_to_half(float *row) {
    for (int g = 0; g < VA_D_V; g += 64) {
        float mx = 0.f;
        for (int d = g; d < g + 64; d++) mx = fmaxf(mx, fabsf(row[d]));
        int e = -127; /* the kernel reads mx's biased exponent: -127 for 0 and subnormals */
        if (mx >= 0x1p-126f) {
            frexpf(mx, &e);
            e -= 1; /* mx in [2^e, 2^(e+1)) */
        }
        int k = 14 - e;
        k = k < -126 ? -126 : (k > 126 ? 126 : k);
        for (int d = g; d < g + 64; d++) row[d] = ldexpf(emu_round_half(ldexpf(row[d], k)), -k);
    }
}

/* Every item of every stream with the kernel's schedule, then the split combine. */
static void emu_run(const va_case *c, int BN, emu_cta *C) {
    const emu_cfg k = emu_make_cfg(BN);
    float *po = malloc(sizeof(float) * VA_MAX_SPLITS * VA_ROWS * VA_D_V), *pl = malloc(sizeof(float) * VA_MAX_SPLITS * VA_ROWS);
    for (int s = 0; s < c->S; s++) {
        const int n = c->n_nodes[s], keys = c->prefix[s] + n, rt = (n * c->H + VA_ROWS - 1) / VA_ROWS;
        int splits, chunk;
        va_split(keys, rt, &splits, &chunk);
        for (int rtile = 0; rtile < rt; rtile++) {
            const int g0 = rtile * VA_ROWS, rows = (n * c->H - g0) < VA_ROWS ? (n * c->H - g0) : VA_ROWS;
            for (int sp = 0; sp < splits; sp++) {
                const int kb = sp * chunk, ke = kb + chunk < keys ? kb + chunk : keys;
                emu_item(C, &k, c, s, g0, kb, ke, po + (size_t)sp * VA_ROWS * VA_D_V, pl + sp * VA_ROWS);
                if (splits > 1)
                    for (int r = 0; r < rows; r++) emu_partial_to_half(po + ((size_t)sp * VA_ROWS + r) * VA_D_V);
            }
            for (int r = 0; r < rows; r++) { /* combine (one split: the value itself) */
                const size_t orow = (size_t)s * c->max_nodes * c->H + g0 + r;
                float mx = -INFINITY;
                for (int sp = 0; sp < splits; sp++) mx = fmaxf(mx, pl[sp * VA_ROWS + r]);
                if (splits == 1) {
                    for (int d = 0; d < VA_D_V; d++) c->out[orow * VA_D_V + d] = kdt_f32_to_bf16(po[r * VA_D_V + d]);
                    c->lse[orow] = pl[r];
                    continue;
                }
                float sum = 0.f;
                for (int sp = 0; sp < splits; sp++) sum += expf(pl[sp * VA_ROWS + r] - mx);
                for (int d = 0; d < VA_D_V; d++) {
                    float acc = 0.f;
                    for (int sp = 0; sp < splits; sp++)
                        acc += expf(pl[sp * VA_ROWS + r] - mx) / sum * po[((size_t)sp * VA_ROWS + r) * VA_D_V + d];
                    c->out[orow * VA_D_V + d] = kdt_f32_to_bf16(acc);
                }
                c->lse[orow] = mx + logf(sum);
            }
        }
    }
    free(po), free(pl);
}

/* Emulated kernel vs the twin over shapes covering H < 64, H = 64, H = 128, splits, masks. */
/* The portable kernel's FP8 loader fills a key's bf16 tile row chunk by chunk with
 * va_fp8_src / va_fp8_chunk (verify_attn_tiles.cuh, the functions the kernel calls): every
 * element must be bf16(e4m3 x its group's scale) and the rope columns the row's bf16 values, for
 * power-of-two scales (then exact: the tile equals the bf16 cache with the same values) and for
 * arbitrary ones (rounded to nearest even). NaN codes stay NaN. */
static void test_fp8_tile_rows(void) {
    uint64_t seed = t_fuzz_seed(60);
    unsigned char row[VA_FP8_ROW];
    CHECK_EQ_INT((int)kdt_kv_row_bytes(KDT_KV_FP8_SCALED, VA_D_QK, VA_D_V), VA_FP8_ROW);
    CHECK_EQ_INT(VA_FP8_SCALES, VA_D_V);
    CHECK_EQ_INT(VA_FP8_ROPE, VA_D_V + 4 * (VA_D_V / KDT_KV_FP8_GROUP));
    int bad = 0, exact = 0;
    for (int trial = 0, trials = t_fuzz_iters(200); trial < trials; trial++) {
        const int pow2 = trial % 2 == 0;
        float sc[VA_D_V / KDT_KV_FP8_GROUP];
        uint16_t want[VA_D_QK];
        for (int g = 0; g < VA_D_V / KDT_KV_FP8_GROUP; g++) {
            sc[g] = pow2 ? ldexpf(1.0f, t_rand_int(&seed, 17) - 12) : (float)(t_rand_unit(&seed) * 0.01 + 1e-5);
            memcpy(row + VA_FP8_SCALES + 4 * g, &sc[g], 4);
        }
        for (int j = 0; j < VA_D_V; j++) {
            row[j] = (uint8_t)t_rand_int(&seed, 256); /* NaN codes included */
            want[j] = kdt_f32_to_bf16(kdt_e4m3_to_f32(row[j]) * sc[j / KDT_KV_FP8_GROUP]);
        }
        for (int j = VA_D_V; j < VA_D_QK; j++) {
            want[j] = kdt_f32_to_bf16((float)t_rand_normal(&seed));
            memcpy(row + VA_FP8_ROPE + 2 * (j - VA_D_V), &want[j], 2);
        }
        uint16_t got[VA_D_QK];
        for (int c = 0; c < VA_QK_CHUNKS; c++) {
            if (c < 64) { /* the scale from the row's bytes, as the kernel reads it */
                float s;
                memcpy(&s, row + VA_FP8_SCALES + 4 * va_fp8_scale_idx(c), 4);
                va_fp8_chunk(row + va_fp8_src(c), s, got + 8 * c);
            } else {
                memcpy(got + 8 * c, row + va_fp8_src(c), 16);
            }
        }
        for (int j = 0; j < VA_D_QK; j++) {
            const int same = got[j] == want[j] || (isnan(kdt_bf16_to_f32(got[j])) && isnan(kdt_bf16_to_f32(want[j])));
            if (!same && bad++ < 3) CHECK_MSG(0, "trial %d element %d: %04x, want %04x", trial, j, got[j], want[j]);
        }
        /* power-of-two scales: every finite latent is exact in bf16 */
        if (pow2)
            for (int j = 0; j < VA_D_V; j++)
                if ((row[j] & 0x7f) != 0x7f)
                    exact += kdt_bf16_to_f32(got[j]) == kdt_e4m3_to_f32(row[j]) * sc[j / KDT_KV_FP8_GROUP];
    }
    CHECK_EQ_INT(bad, 0);
    CHECK(exact > t_fuzz_iters(200) / 2 * 500); /* the power-of-two rows, ~508 finite codes each */
}

static void test_cuda_kernel_emulation(void) {
    static const struct { int H, n, prefix, BN; enum tree_kind kind; } cases[] = {
        {64, 3, 70, 64, TREE_RANDOM},   /* one node per row tile, tree slots straddle a tile */
        {8, 9, 130, 64, TREE_RANDOM},   /* row tiles mix 8 nodes */
        {128, 2, 1, 16, TREE_CHAIN},    /* a node spans two row tiles; BN 16 (sm_120 config) */
        {16, 2, 600, 64, TREE_RANDOM},  /* split into 2 chunks, combined */
        {32, 5, 300, 16, TREE_STAR},    /* BN 16 with splits */
        {64, 1, 0, 64, TREE_RANDOM},    /* decode with nothing committed */
    };
    /* and the FP8 loader's tiles (case_to_fp8) against the twin reading the FP8 rows: power-of-two
     * scales (the tile holds the exact values) and max / 448 scales (bf16(e4m3 x scale) rounded) */
    static const struct { int H, n, prefix, BN, pow2; } fp8_cases[] = {
        {64, 9, 130, 64, 1}, {16, 5, 1100, 16, 1}, {64, 9, 130, 64, 0}, {128, 1, 2100, 16, 0}, {8, 33, 70, 64, 0},
    };
    emu_cta *C = malloc(sizeof *C);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int prefix[1] = {cases[i].prefix}, n[1] = {cases[i].n};
        va_case c;
        case_make(&c, 300 + i, 1, cases[i].H, cases[i].n + 1, 576, 512, 64, prefix, n, cases[i].kind);
        int splits, chunk;
        va_split(prefix[0] + n[0], (n[0] * cases[i].H + 63) / 64, &splits, &chunk);
        /* twin */
        case_poison(&c);
        kdt_verify_attn_params p = case_params(&c);
        CHECK(kdt_verify_attn_cpu(&p) == KDT_OK);
        const size_t rows = (size_t)c.n_nodes[0] * c.H;
        double *ref = malloc(sizeof(double) * rows * 512), *got = malloc(sizeof(double) * rows * 512);
        double *lref = malloc(sizeof(double) * rows), *lgot = malloc(sizeof(double) * rows);
        for (size_t e = 0; e < rows * 512; e++) ref[e] = kdt_bf16_to_f32(c.out[e]);
        for (size_t e = 0; e < rows; e++) lref[e] = c.lse[e];
        /* emulated kernel */
        case_poison(&c);
        memset(C, 0, sizeof *C);
        emu_run(&c, cases[i].BN, C);
        for (size_t e = 0; e < rows * 512; e++) got[e] = kdt_bf16_to_f32(c.out[e]);
        for (size_t e = 0; e < rows; e++) lgot[e] = c.lse[e];
        const double err = t_rel_err(got, ref, rows * 512);
        double lerr = 0;
        for (size_t e = 0; e < rows; e++) lerr = fmax(lerr, fabs(lgot[e] - lref[e]) / fmax(1.0, fabs(lref[e])));
        CHECK_MSG(err <= 2e-3 && lerr <= 1e-4, "case %zu (H %d n %d P %d BN %d, %d splits): rel err %.3g, lse err %.3g",
                  i, cases[i].H, n[0], prefix[0], cases[i].BN, splits, err, lerr);
        CHECK_EQ_INT(C->bad_addr, 0);
        CHECK_EQ_INT(C->conflicts, 0);
        CHECK(padding_untouched(&c));
        free(ref), free(got), free(lref), free(lgot);
        case_free(&c);
    }
    /* FP8: the kernel dequantizes each tile to bf16(e4m3 x scale) and runs the bf16 kernel on it.
     * So the emulated FP8 path must equal, bitwise, the emulated bf16 path over the cache of those
     * bf16 values, and be within the usual tolerance of the twin on that cache; with power-of-two
     * scales the values are exact, and the twin reading the FP8 rows gives the same bits. With
     * max / 448 scales the dequantization rounds, and the distance to exact FP8 arithmetic (the twin
     * reading the FP8 rows) is printed as a measurement: the bf16 path's tolerance does not cover it. */
    double dist_exact[2] = {0, 0};
    for (size_t i = 0; i < sizeof fp8_cases / sizeof fp8_cases[0]; i++) {
        const int prefix[1] = {fp8_cases[i].prefix}, n[1] = {fp8_cases[i].n}, pow2 = fp8_cases[i].pow2;
        va_case c;
        case_make(&c, 400 + i, 1, fp8_cases[i].H, n[0] + 1, 576, 512, 64, prefix, n, TREE_RANDOM);
        case_to_fp8(&c, pow2);
        const size_t keys = (size_t)c.n_pages * c.page_size, rows = (size_t)c.n_nodes[0] * c.H;
        for (size_t r = 0; r < keys; r++) /* the bf16 cache of the dequantized values */
            for (int ch = 0; ch < 64; ch++) {
                const unsigned char *row = c.kv8 + r * VA_FP8_ROW;
                float sc;
                memcpy(&sc, row + VA_FP8_SCALES + 4 * va_fp8_scale_idx(ch), 4);
                va_fp8_chunk(row + va_fp8_src(ch), sc, c.kv + r * VA_D_QK + 8 * ch);
            }
        double *ref = malloc(sizeof(double) * rows * 512), *got = malloc(sizeof(double) * rows * 512);
        uint16_t *out8 = malloc(2 * rows * 512), *exact8 = malloc(2 * rows * 512), *twin_bf = malloc(2 * rows * 512);
        float *lref = malloc(sizeof(float) * rows), *l8 = malloc(sizeof(float) * rows);
        kdt_verify_attn_params p = case_params(&c);
        case_poison(&c);
        CHECK(kdt_verify_attn_cpu(&p) == KDT_OK); /* twin on the dequantized bf16 cache */
        for (size_t e = 0; e < rows * 512; e++) ref[e] = kdt_bf16_to_f32(c.out[e]);
        memcpy(twin_bf, c.out, 2 * rows * 512);
        memcpy(lref, c.lse, sizeof(float) * rows);
        p.kv_cache = c.kv8, p.kv_format = KDT_KV_FP8_SCALED;
        case_poison(&c);
        CHECK(kdt_verify_attn_cpu(&p) == KDT_OK); /* twin on the FP8 rows: exact e4m3 x scale */
        memcpy(exact8, c.out, 2 * rows * 512);
        if (pow2) /* exact values: the twin reads the FP8 rows and the bf16 cache alike */
            CHECK_MSG(!memcmp(exact8, twin_bf, 2 * rows * 512), "FP8 case %zu: the twin differs on exact values", i);
        case_poison(&c);
        memset(C, 0, sizeof *C);
        emu_run(&c, fp8_cases[i].BN, C); /* emulated FP8 loader */
        memcpy(out8, c.out, 2 * rows * 512), memcpy(l8, c.lse, sizeof(float) * rows);
        CHECK_EQ_INT(C->bad_addr, 0);
        CHECK_EQ_INT(C->conflicts, 0);
        unsigned char *kv8 = c.kv8;
        c.kv8 = NULL;
        case_poison(&c);
        memset(C, 0, sizeof *C);
        emu_run(&c, fp8_cases[i].BN, C); /* emulated bf16 loader over the dequantized cache */
        c.kv8 = kv8;
        CHECK_MSG(!memcmp(out8, c.out, 2 * rows * 512) && !memcmp(l8, c.lse, sizeof(float) * rows),
                  "FP8 case %zu: the FP8 tiles differ from the bf16 tiles of the same values", i);
        for (size_t e = 0; e < rows * 512; e++) got[e] = kdt_bf16_to_f32(out8[e]);
        const double err = t_rel_err(got, ref, rows * 512);
        double lerr = 0;
        for (size_t e = 0; e < rows; e++) lerr = fmax(lerr, fabs(l8[e] - lref[e]) / fmax(1.0, fabs(lref[e])));
        CHECK_MSG(err <= 2e-3 && lerr <= 1e-4, "FP8 case %zu (H %d n %d P %d BN %d, %s scales): rel err %.3g, lse err %.3g",
                  i, fp8_cases[i].H, n[0], prefix[0], fp8_cases[i].BN, pow2 ? "power-of-two" : "max/448", err, lerr);
        for (size_t e = 0; e < rows * 512; e++) ref[e] = kdt_bf16_to_f32(exact8[e]);
        const double dist = t_rel_err(got, ref, rows * 512);
        dist_exact[pow2] = fmax(dist_exact[pow2], dist);
        free(ref), free(got), free(out8), free(exact8), free(twin_bf), free(lref), free(l8);
        case_free(&c);
    }
    printf("  FP8 tiles in the emulated kernel: distance to exact FP8 arithmetic %.3g (power-of-two scales), "
           "%.3g (max / 448 scales: the bf16 dequantization's rounding)\n", dist_exact[1], dist_exact[0]);
    free(C);
}

/* The split schedule: whole 64-key chunks that cover the keys, no empty split, bounded. */
static void test_split_schedule(void) {
    for (int rt = 1; rt <= 300; rt += (rt < 20 ? 1 : 7))
        for (int keys = 1; keys <= 300000; keys = keys * 3 / 2 + 1) {
            int splits, chunk;
            va_split(keys, rt, &splits, &chunk);
            CHECK(splits >= 1 && splits <= VA_MAX_SPLITS && chunk % VA_SCHED_BLOCK == 0);
            CHECK((long long)(splits - 1) * chunk < keys && (long long)splits * chunk >= keys);
            CHECK(splits <= va_split_target(keys, rt));
            CHECK(rt >= VA_TARGET_ITEMS ? splits == 1 : rt * splits <= VA_TARGET_ITEMS);
            CHECK(va_split_target(keys + 64, rt) >= va_split_target(keys, rt)); /* monotone */
        }
    /* the launch rule: when it says no stream can split, none does (the merge pass is skipped);
     * when it says one can, the longest one-node stream does */
    uint64_t rng = 77;
    for (int i = 0; i < 20000; i++) {
        const int H = 1 + t_rand_int(&rng, 128);
        const long long max_keys = 1 + t_rand_int(&rng, i % 2 ? 4096 : 300000);
        const int can = va_launch_can_split(max_keys, H);
        int splits, chunk;
        va_split((int)max_keys, (H + VA_ROWS - 1) / VA_ROWS, &splits, &chunk);
        CHECK_MSG(can == (splits > 1), "H %d, %lld keys: rule %d, one-node stream %d splits", H, max_keys, can, splits);
        const int n = 1 + t_rand_int(&rng, 129), keys = 1 + t_rand_int(&rng, (int)max_keys);
        va_split(keys, (n * H + VA_ROWS - 1) / VA_ROWS, &splits, &chunk);
        if (!can) CHECK_MSG(splits == 1, "H %d, %lld keys: rule says no split, stream (%d keys, %d nodes) has %d", H,
                            max_keys, keys, n, splits);
    }
}

int main(void) {
    T_RUN(test_small_dims_random_trees);
    T_RUN(test_real_dims);
    T_RUN(test_chain_is_causal);
    T_RUN(test_star_and_wide_trees);
    T_RUN(test_masked_keys_contribute_nothing);
    T_RUN(test_no_visible_key);
    T_RUN(test_batch_invariance);
    T_RUN(test_argument_errors);
    T_RUN(test_cuda_stub_or_args);
    T_RUN(test_fp8_cache_reference);
    T_RUN(test_fp8_tile_rows);
    T_RUN(test_split_schedule);
    T_RUN(test_cuda_kernel_emulation);
    return t_summary();
}
