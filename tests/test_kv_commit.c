/* test_kv_commit.c - CPU tests of the KV commit: the in-place result must equal a naive gather
 * into a separate buffer, for random paths, block tables (non-contiguous, permuted pages), row
 * widths, layer counts and streams; hand overlap cases ([0,2,3], [0,1,5,9]); no-op paths; bad
 * streams (skipped and reported, the others still moved) and argument errors. The cache and
 * every table are exact-size allocations so ASan catches any out-of-bounds access.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree/kernels.h"
#include "t.h"

#define P KDT_MAX_PATH

typedef struct kvcase {
    int S, n_layers, row_bytes, page_size, n_pages, max_pages;
    int64_t layer_stride, cache_bytes;
    unsigned char *cache, *orig;   /* [cache_bytes] the cache, and its state before the commit */
    int32_t *block_table;          /* [S][max_pages] */
    int32_t *prefix_len, *tau;     /* [S] */
    int32_t *accepted;             /* [S][P] */
    kdt_kv_commit_params prm;
} kvcase;

/* Allocates the case; layer_gap extra bytes between layers; block table = a random
 * permutation of the pages dealt out to the streams (needs n_pages >= S * max_pages); paths
 * all "tau 0" until set. */
static void kv_init(kvcase *c, int S, int n_layers, int row_bytes, int page_size, int max_pages,
                    int extra_pages, int layer_gap, uint64_t *rng) {
    memset(c, 0, sizeof *c);
    c->S = S; c->n_layers = n_layers; c->row_bytes = row_bytes; c->page_size = page_size;
    c->max_pages = max_pages; c->n_pages = S * max_pages + extra_pages;
    c->layer_stride = (int64_t)c->n_pages * page_size * row_bytes + layer_gap;
    c->cache_bytes = (int64_t)(n_layers - 1) * c->layer_stride +
                     (int64_t)c->n_pages * page_size * row_bytes;
    c->cache = (unsigned char *)xmalloc((size_t)c->cache_bytes);
    c->orig = (unsigned char *)xmalloc((size_t)c->cache_bytes);
    for (int64_t i = 0; i < c->cache_bytes; i++) c->cache[i] = (unsigned char)(1 + t_rand_int(rng, 255));
    int32_t *perm = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)c->n_pages);
    for (int i = 0; i < c->n_pages; i++) perm[i] = i;
    for (int i = c->n_pages - 1; i > 0; i--) {
        int j = t_rand_int(rng, i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    c->block_table = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S * max_pages);
    for (int i = 0; i < S * max_pages; i++) c->block_table[i] = perm[i];
    free(perm);
    c->prefix_len = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S);
    c->tau = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S);
    c->accepted = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S * P);
    for (int s = 0; s < S; s++) {
        c->prefix_len[s] = 0;
        c->tau[s] = 0;
        for (int k = 0; k < P; k++) c->accepted[s * P + k] = -7; /* beyond tau: never read */
    }
    c->prm = (kdt_kv_commit_params){S, n_layers, row_bytes, page_size, c->n_pages, c->cache,
                                    c->layer_stride, c->block_table, max_pages, c->prefix_len,
                                    c->accepted, c->tau};
}

static void kv_free(kvcase *c) {
    free(c->cache); free(c->orig); free(c->block_table); free(c->prefix_len); free(c->tau);
    free(c->accepted);
}

static void set_path(kvcase *c, int s, int prefix, const int32_t *path, int tau) {
    c->prefix_len[s] = prefix;
    c->tau[s] = tau;
    for (int k = 0; k < tau; k++) c->accepted[s * P + k] = path[k];
}

static int64_t slot_offset(const kvcase *c, int s, int64_t slot) {
    int32_t page = c->block_table[(int64_t)s * c->max_pages + slot / c->page_size];
    return ((int64_t)page * c->page_size + slot % c->page_size) * c->row_bytes;
}

/* The expected cache: a copy of orig where each stream not in `skip` gets, in every layer,
 * slot prefix + k <- orig slot prefix + accepted[k]; gathered from orig, so no in-place issue. */
static unsigned char *naive_commit(const kvcase *c, const int *skip) {
    unsigned char *want = (unsigned char *)xmalloc((size_t)c->cache_bytes);
    memcpy(want, c->orig, (size_t)c->cache_bytes);
    for (int s = 0; s < c->S; s++) {
        if (skip && skip[s]) continue;
        for (int l = 0; l < c->n_layers; l++)
            for (int k = 0; k < c->tau[s]; k++) {
                if (c->accepted[s * P + k] == k) continue; /* in place already; not looked up */
                int64_t lb = (int64_t)l * c->layer_stride;
                memcpy(want + lb + slot_offset(c, s, c->prefix_len[s] + k),
                       c->orig + lb + slot_offset(c, s, c->prefix_len[s] + c->accepted[s * P + k]),
                       (size_t)c->row_bytes);
            }
    }
    return want;
}

/* Runs the commit and compares every byte of the cache with the naive gather. */
static void run_and_compare(kvcase *c, const int *skip, kdt_status want_status, const char *what) {
    memcpy(c->orig, c->cache, (size_t)c->cache_bytes);
    unsigned char *want = naive_commit(c, skip);
    kdt_clear_error();
    kdt_status st = kdt_kv_commit_cpu(&c->prm);
    CHECK_MSG(st == want_status, "%s: status %s (%s)", what, kdt_status_name(st), kdt_last_error());
    int64_t bad = -1;
    for (int64_t i = 0; i < c->cache_bytes && bad < 0; i++)
        if (c->cache[i] != want[i]) bad = i;
    CHECK_MSG(bad < 0, "%s: cache differs from the naive gather at byte %lld", what, (long long)bad);
    free(want);
}

static void test_overlap_cases(void) {
    uint64_t rng = 11;
    kvcase c;
    kv_init(&c, 4, 3, 1152, 64, 3, 2, 0, &rng);
    const int32_t p0[3] = {0, 2, 3};        /* 2 -> 1 and 3 -> 2: slot 2 is read and written */
    const int32_t p1[4] = {0, 1, 5, 9};     /* rows 0, 1 stay */
    const int32_t p2[5] = {0, 3, 60, 64, 100}; /* crosses page boundaries */
    const int32_t p3[6] = {0, 1, 2, 3, 4, 5};  /* no-op */
    set_path(&c, 0, 10, p0, 3);
    set_path(&c, 1, 62, p1, 4);  /* tree straddles pages 0 and 1 */
    set_path(&c, 2, 27, p2, 5);
    set_path(&c, 3, 5, p3, 6);
    run_and_compare(&c, NULL, KDT_OK, "overlap");
    /* the no-op stream is bit-identical to before (trivially), and [0,2,3] moved its rows */
    CHECK(memcmp(c.cache + slot_offset(&c, 0, 11), c.orig + slot_offset(&c, 0, 12), 1152) == 0);
    CHECK(memcmp(c.cache + slot_offset(&c, 0, 12), c.orig + slot_offset(&c, 0, 13), 1152) == 0);
    kv_free(&c);
}

/* A full-length path (tau = KDT_MAX_PATH) with every row moving, and a one-node path. */
static void test_long_and_trivial_paths(void) {
    uint64_t rng = 12;
    kvcase c;
    kv_init(&c, 3, 2, 64, 16, 8, 0, 32, &rng);
    int32_t longp[P], root[1] = {0};
    longp[0] = 0;
    for (int k = 1; k < P; k++) longp[k] = longp[k - 1] + 1 + k % 3;
    set_path(&c, 0, 3, longp, P);
    set_path(&c, 1, 0, root, 1);
    set_path(&c, 2, 100, longp, 0); /* tau 0: nothing */
    run_and_compare(&c, NULL, KDT_OK, "long path");
    kv_free(&c);
}

/* Random paths, prefixes, block tables, row widths (incl. ones not a multiple of 16) and
 * layer counts. */
static void test_random(void) {
    uint64_t rng = t_fuzz_seed(0xabcdef);
    const int rows[] = {2, 6, 16, 40, 1152, 1154};
    for (int iter = 0, iters = t_fuzz_iters(200); iter < iters; iter++) {
        const int S = 1 + t_rand_int(&rng, 6), n_layers = 1 + t_rand_int(&rng, 4);
        const int row = rows[t_rand_int(&rng, 6)], page_size = 1 << t_rand_int(&rng, 7);
        const int max_pages = 1 + t_rand_int(&rng, 6);
        kvcase c;
        kv_init(&c, S, n_layers, row, page_size, max_pages, t_rand_int(&rng, 3),
                2 * t_rand_int(&rng, 3), &rng);
        const int slots = max_pages * page_size;
        for (int s = 0; s < S; s++) {
            int32_t path[P];
            int tau = t_rand_int(&rng, P + 1), style = t_rand_int(&rng, 4);
            path[0] = 0;
            for (int k = 1; k < tau; k++)
                path[k] = path[k - 1] + 1 + (style == 0 ? 0 : t_rand_int(&rng, style == 1 ? 2 : 9));
            while (tau > 0 && path[tau - 1] >= slots) tau--; /* keep what fits the table */
            int prefix = tau > 0 ? t_rand_int(&rng, slots - path[tau - 1]) : t_rand_int(&rng, 9);
            set_path(&c, s, prefix, path, tau);
        }
        run_and_compare(&c, NULL, KDT_OK, "random");
        kv_free(&c);
    }
}

/* Only pages the moved rows touch are looked up: a -1 entry elsewhere is fine. */
static void test_untouched_pages_not_checked(void) {
    uint64_t rng = 13;
    kvcase c;
    kv_init(&c, 2, 2, 32, 8, 4, 0, 0, &rng);
    const int32_t path[3] = {0, 2, 5};
    set_path(&c, 0, 8, path, 3);   /* slots 8..13: page index 1 only */
    set_path(&c, 1, 0, path, 2);   /* slots 0..2: page 0 */
    c.block_table[0] = -1;
    c.block_table[2] = c.block_table[3] = 1 << 30;
    c.block_table[4 + 1] = -5;
    run_and_compare(&c, NULL, KDT_OK, "untouched pages");
    /* a no-op path is skipped without looking at its pages at all */
    const int32_t noop[3] = {0, 1, 2};
    set_path(&c, 1, 8, noop, 3);
    c.block_table[4 + 1] = -5;
    run_and_compare(&c, NULL, KDT_OK, "no-op with bad pages");
    kv_free(&c);
}

/* Each bad stream sits at index 1 between good ones: it is untouched and named in the error,
 * the good ones are still moved. */
static void bad_stream_case(const char *what, void (*spoil)(kvcase *c)) {
    uint64_t rng = 14;
    kvcase c;
    kv_init(&c, 3, 2, 48, 8, 4, 1, 0, &rng);
    const int32_t path[4] = {0, 2, 3, 7};
    for (int s = 0; s < 3; s++) set_path(&c, s, 5 + s, path, 4);
    spoil(&c);
    const int skip[3] = {0, 1, 0};
    run_and_compare(&c, skip, KDT_ERR_INVALID_ARG, what);
    CHECK_MSG(strstr(kdt_last_error(), "stream 1") != NULL, "%s: message '%s'", what,
              kdt_last_error());
    kv_free(&c);
}

static void s_tau_negative(kvcase *c) { c->tau[1] = -1; }
static void s_tau_too_big(kvcase *c) { c->tau[1] = P + 1; }
static void s_tau_huge(kvcase *c) { c->tau[1] = INT_MAX; }
static void s_root_not_zero(kvcase *c) { c->accepted[P + 0] = 1; }
static void s_not_increasing(kvcase *c) { c->accepted[P + 2] = 2; }
static void s_decreasing(kvcase *c) { c->accepted[P + 3] = -4; }
static void s_prefix_negative(kvcase *c) { c->prefix_len[1] = -3; }
static void s_slot_past_table(kvcase *c) { c->accepted[P + 3] = 4 * 8 - 6; } /* 6 + 26 = 32 */
static void s_slot_far_past(kvcase *c) { c->accepted[P + 3] = INT_MAX; c->prefix_len[1] = INT_MAX; }
static void s_page_negative(kvcase *c) { c->block_table[4 + 0] = -1; }
static void s_page_too_big(kvcase *c) { c->block_table[4 + 1] = c->n_pages; }

static void test_bad_streams(void) {
    bad_stream_case("tau -1", s_tau_negative);
    bad_stream_case("tau 18", s_tau_too_big);
    bad_stream_case("tau INT_MAX", s_tau_huge);
    bad_stream_case("accepted[0] != 0", s_root_not_zero);
    bad_stream_case("accepted not increasing", s_not_increasing);
    bad_stream_case("accepted negative", s_decreasing);
    bad_stream_case("prefix_len < 0", s_prefix_negative);
    bad_stream_case("slot past the block table", s_slot_past_table);
    bad_stream_case("slot far past", s_slot_far_past);
    bad_stream_case("page id -1", s_page_negative);
    bad_stream_case("page id n_pages", s_page_too_big);
}

static void expect_arg_error(const kdt_kv_commit_params *p, const char *field) {
    kdt_clear_error();
    kdt_status st = kdt_kv_commit_cpu(p);
    CHECK_MSG(st == KDT_ERR_INVALID_ARG, "%s: status %s", field, kdt_status_name(st));
    CHECK_MSG(strstr(kdt_last_error(), field) != NULL, "message '%s' should name %s",
              kdt_last_error(), field);
}

static void test_argument_errors(void) {
    uint64_t rng = 15;
    kvcase c;
    kv_init(&c, 2, 2, 16, 4, 2, 0, 0, &rng);
    const int32_t path[2] = {0, 3};
    set_path(&c, 0, 1, path, 2);
    memcpy(c.orig, c.cache, (size_t)c.cache_bytes);
    kdt_kv_commit_params p = c.prm;
    CHECK_EQ_INT(kdt_kv_commit_cpu(NULL), KDT_ERR_INVALID_ARG);
#define BAD_INT(f, v) do { int32_t keep = p.f; p.f = v; expect_arg_error(&p, #f); p.f = keep; } while (0)
#define BAD_PTR(f) do { void *keep = (void *)p.f; p.f = NULL; expect_arg_error(&p, #f); p.f = keep; } while (0)
    BAD_INT(n_streams, 0); BAD_INT(n_streams, KDT_MAX_STREAMS + 1);
    BAD_INT(n_layers, 0); BAD_INT(n_layers, -1);
    BAD_INT(row_bytes, 0); BAD_INT(row_bytes, 15); BAD_INT(row_bytes, -16);
    BAD_INT(page_size, 0); BAD_INT(n_pages, 0); BAD_INT(max_pages, 0);
    BAD_PTR(cache); BAD_PTR(block_table); BAD_PTR(prefix_len); BAD_PTR(accepted); BAD_PTR(tau);
#undef BAD_INT
#undef BAD_PTR
    p.layer_stride_bytes = c.layer_stride - 1;
    expect_arg_error(&p, "layer_stride_bytes");
    p.layer_stride_bytes = INT64_MAX / 2; /* three layers overflow */
    p.n_layers = 3;
    expect_arg_error(&p, "overflows");
    p.n_layers = 2;
    p.layer_stride_bytes = c.layer_stride;
    p.row_bytes = INT_MAX - 1;
    p.page_size = INT_MAX;
    p.n_pages = INT_MAX;
    expect_arg_error(&p, "overflows");
    /* nothing was touched by the rejected calls */
    CHECK(memcmp(c.cache, c.orig, (size_t)c.cache_bytes) == 0);
    kv_free(&c);
}

int main(void) {
    T_RUN(test_overlap_cases);
    T_RUN(test_long_and_trivial_paths);
    T_RUN(test_random);
    T_RUN(test_untouched_pages_not_checked);
    T_RUN(test_bad_streams);
    T_RUN(test_argument_errors);
    return t_summary();
}
