/* test_topk.c - CPU tests of kdt_topk_logsoftmax_cpu against a straightforward reference (sanitize,
 * full sort by (value desc, id asc), log-sum-exp in long double): random shapes in fp32 and bf16,
 * ties, -inf / NaN / +inf, row_stride > V (the gap is poisoned with values that would win if
 * read), K = 1 and K = V, V up to 163,840, and every argument error. */
#include "kdtree/kernels.h"
#include "t.h"

#include <float.h>
#include <math.h>
#include <string.h>

#include "fp.h"

typedef struct entry { float v; int32_t id; } entry;

static int cmp_entry(const void *a, const void *b) {
    const entry *x = a, *y = b;
    if (x->v > y->v) return -1;
    if (x->v < y->v) return 1;
    return (x->id > y->id) - (x->id < y->id); /* equal values (-0 == +0): lower id first */
}

static float ref_sanitize(float v) { return isnan(v) ? -INFINITY : (v == INFINITY ? FLT_MAX : v); }

/* Reference for one row: ids[K], logp[K]. */
static void reference_row(const float *vals /* [V] raw */, int32_t V, int32_t K, int32_t *ids,
                          float *logp) {
    entry *e = malloc(sizeof(entry) * (size_t)V);
    long double mx = -INFINITY, sum = 0;
    for (int32_t i = 0; i < V; i++) {
        e[i].v = ref_sanitize(vals[i]);
        e[i].id = i;
        if (e[i].v > mx) mx = e[i].v;
    }
    long double lse = -INFINITY;
    if (mx != -INFINITY) {
        for (int32_t i = 0; i < V; i++) sum += expl((long double)e[i].v - mx);
        lse = mx + logl(sum);
    }
    qsort(e, (size_t)V, sizeof(entry), cmp_entry);
    for (int32_t j = 0; j < K; j++) {
        ids[j] = e[j].id;
        logp[j] = e[j].v == -INFINITY ? -INFINITY : e[j].v - (float)lse;
    }
    free(e);
}

typedef enum fill_kind {
    FILL_NORMAL,     /* N(0, scale) */
    FILL_TIES,       /* few distinct values */
    FILL_SPECIALS,   /* normal with -inf, NaN and +inf sprinkled in */
    FILL_ALL_NEGINF, /* every value -inf (or NaN) */
    FILL_ASCENDING,  /* increasing with the id: every new value beats the old ones */
} fill_kind;

static float draw(uint64_t *rng, fill_kind kind, int32_t i, int32_t V) {
    switch (kind) {
    case FILL_NORMAL: return (float)(3.0 * t_rand_normal(rng));
    case FILL_TIES: return (float)(t_rand_int(rng, 5) - 2) * 0.5f;
    case FILL_SPECIALS: {
        int c = t_rand_int(rng, 20);
        if (c == 0) return -INFINITY;
        if (c == 1) return NAN;
        if (c == 2 && t_rand_int(rng, 10) == 0) return INFINITY;
        if (c == 3) return -0.0f;
        if (c == 4) return 0.0f;
        return (float)(2.0 * t_rand_normal(rng));
    }
    case FILL_ALL_NEGINF: return t_rand_int(rng, 2) ? -INFINITY : NAN;
    case FILL_ASCENDING: return (float)i / (float)V * 8.0f - 4.0f;
    }
    return 0;
}

/* Runs one case through the CPU kernel and the reference; returns 1 if all matched. */
static int run_case(uint64_t *rng, int32_t R, int32_t V, int32_t K, int64_t stride, kdt_dtype dt,
                    fill_kind kind, int verbose) {
    size_t n = (size_t)R * (size_t)stride;
    float *vals = malloc(sizeof(float) * n);     /* [R][stride], values as the kernel sees them */
    uint16_t *bf = malloc(sizeof(uint16_t) * n); /* bf16 copy */
    for (int32_t r = 0; r < R; r++)
        for (int64_t i = 0; i < stride; i++) {
            /* the gap beyond V holds values that would rank first if it were read */
            float x = i < V ? draw(rng, kind, (int32_t)i, V) : (i % 2 ? INFINITY : 1e30f);
            size_t at = (size_t)r * stride + (size_t)i;
            if (dt == KDT_BF16) {
                bf[at] = kdt_f32_to_bf16(x);
                vals[at] = kdt_bf16_to_f32(bf[at]);
            } else {
                vals[at] = x;
            }
        }
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)R * K), *ref_ids = malloc(sizeof(int32_t) * (size_t)K);
    float *logp = malloc(sizeof(float) * (size_t)R * K), *ref_logp = malloc(sizeof(float) * (size_t)K);
    memset(ids, 0x5a, sizeof(int32_t) * (size_t)R * K);
    memset(logp, 0x5a, sizeof(float) * (size_t)R * K);
    kdt_topk_params p;
    memset(&p, 0, sizeof p);
    p.n_rows = R;
    p.vocab = V;
    p.k = K;
    p.dtype = dt;
    p.logits = dt == KDT_BF16 ? (const void *)bf : (const void *)vals;
    p.row_stride = stride;
    p.top_ids = ids;
    p.top_logp = logp;
    int ok = kdt_topk_logsoftmax_cpu(&p) == KDT_OK;
    if (!ok) fprintf(stderr, "    error: %s\n", kdt_last_error());
    for (int32_t r = 0; ok && r < R; r++) {
        reference_row(vals + (size_t)r * stride, V, K, ref_ids, ref_logp);
        for (int32_t j = 0; j < K; j++) {
            int32_t id = ids[(size_t)r * K + j];
            float lp = logp[(size_t)r * K + j], want = ref_logp[j];
            int same = id == ref_ids[j] &&
                       ((isinf(want) && lp == want) ||
                        fabsf(lp - want) <= 1e-6f * (1.0f + fabsf(want) + fabsf(vals[(size_t)r * stride + id])));
            if (!same) {
                if (verbose)
                    fprintf(stderr, "    R %d V %d K %d stride %lld %s kind %d: row %d rank %d: id %d logp %.9g, "
                            "expected id %d logp %.9g\n", R, V, K, (long long)stride,
                            dt == KDT_BF16 ? "bf16" : "f32", (int)kind, r, j, id, lp, ref_ids[j], want);
                ok = 0;
                break;
            }
        }
    }
    free(vals); free(bf); free(ids); free(ref_ids); free(logp); free(ref_logp);
    return ok;
}

static void test_random_shapes(void) {
    uint64_t rng = t_fuzz_seed(2718);
    int fails = 0;
    for (int it = 0, iters = t_fuzz_iters(300); it < iters; it++) {
        int32_t V = 1 + t_rand_int(&rng, it % 4 == 0 ? 3000 : 300);
        int32_t kmax = V < KDT_MAX_TOPK ? V : KDT_MAX_TOPK;
        int32_t K = it % 5 == 0 ? 1 : (it % 5 == 1 ? kmax : 1 + t_rand_int(&rng, kmax));
        int32_t R = 1 + t_rand_int(&rng, 4);
        int64_t stride = V + (it % 3 == 0 ? 0 : t_rand_int(&rng, 9));
        kdt_dtype dt = it % 2 ? KDT_BF16 : KDT_F32;
        fill_kind kind = (fill_kind)(it % 5);
        fails += !run_case(&rng, R, V, K, stride, dt, kind, fails < 5);
    }
    CHECK_EQ_INT(fails, 0);
}

static void test_edges(void) {
    uint64_t rng = 99;
    /* K = V = KDT_MAX_TOPK, K = 1, all equal, all -inf, ascending, both dtypes */
    for (int dt = 0; dt < 2; dt++) {
        kdt_dtype d = dt ? KDT_BF16 : KDT_F32;
        CHECK(run_case(&rng, 2, KDT_MAX_TOPK, KDT_MAX_TOPK, KDT_MAX_TOPK + 1, d, FILL_NORMAL, 1));
        CHECK(run_case(&rng, 3, 1, 1, 1, d, FILL_NORMAL, 1));
        CHECK(run_case(&rng, 3, 1, 1, 4, d, FILL_ALL_NEGINF, 1));
        CHECK(run_case(&rng, 2, 500, 37, 503, d, FILL_TIES, 1));
        CHECK(run_case(&rng, 2, 700, 100, 700, d, FILL_ALL_NEGINF, 1));
        CHECK(run_case(&rng, 2, 5000, 64, 5003, d, FILL_ASCENDING, 1));
        CHECK(run_case(&rng, 4, 4096, 256, 4096, d, FILL_SPECIALS, 1));
    }
    /* Kimi's vocabulary, one bf16 row, K = 1024 */
    CHECK(run_case(&rng, 1, 163840, 1024, 163840 + 3, KDT_BF16, FILL_NORMAL, 1));
}

/* Hand-checked policy: NaN -> -inf, +inf -> FLT_MAX (ties with FLT_MAX by id), -inf logp. */
static void test_value_policy(void) {
    const float row[6] = {NAN, INFINITY, -INFINITY, FLT_MAX, 1.0f, -0.0f};
    int32_t ids[6];
    float logp[6];
    kdt_topk_params p;
    memset(&p, 0, sizeof p);
    p.n_rows = 1;
    p.vocab = 6;
    p.k = 6;
    p.dtype = KDT_F32;
    p.logits = row;
    p.row_stride = 6;
    p.top_ids = ids;
    p.top_logp = logp;
    CHECK_EQ_INT(kdt_topk_logsoftmax_cpu(&p), KDT_OK);
    const int32_t want[6] = {1, 3, 4, 5, 0, 2};
    for (int j = 0; j < 6; j++) CHECK_EQ_INT(ids[j], want[j]);
    CHECK(logp[0] == 0.0f && logp[1] == 0.0f); /* lse = FLT_MAX (+log 2, lost to rounding) */
    CHECK(logp[2] == 1.0f - FLT_MAX && logp[3] == -FLT_MAX);
    CHECK(logp[4] == -INFINITY && logp[5] == -INFINITY);
}

static int message_has(const char *word) { return strstr(kdt_last_error(), word) != NULL; }

static void test_argument_errors(void) {
    float vals[16] = {0};
    int32_t ids[16];
    float logp[16];
    kdt_topk_params good, p;
    memset(&good, 0, sizeof good);
    good.n_rows = 2;
    good.vocab = 8;
    good.k = 4;
    good.dtype = KDT_F32;
    good.logits = vals;
    good.row_stride = 8;
    good.top_ids = ids;
    good.top_logp = logp;
    CHECK_EQ_INT(kdt_topk_logsoftmax_cpu(&good), KDT_OK);
#define BAD(word, mutate)                                                             \
    do {                                                                              \
        p = good;                                                                     \
        mutate;                                                                       \
        kdt_clear_error();                                                            \
        CHECK_EQ_INT(kdt_topk_logsoftmax_cpu(&p), KDT_ERR_INVALID_ARG);               \
        CHECK_MSG(message_has(word), "message '%s' lacks '%s'", kdt_last_error(), word); \
    } while (0)
    kdt_clear_error();
    CHECK_EQ_INT(kdt_topk_logsoftmax_cpu(NULL), KDT_ERR_INVALID_ARG);
    CHECK(message_has("params"));
    BAD("n_rows", p.n_rows = 0);
    BAD("vocab", p.vocab = 0);
    BAD("vocab", p.vocab = KDT_MAX_VOCAB + 1);
    BAD("k", p.k = 0);
    BAD("k", p.k = 9);                       /* > vocab */
    BAD("k", (p.vocab = 4000, p.row_stride = 4000, p.k = KDT_MAX_TOPK + 1));
    BAD("dtype", p.dtype = (kdt_dtype)7);
    BAD("row_stride", p.row_stride = 7);
    BAD("row_stride", p.row_stride = INT64_MAX / 4);
    BAD("logits", p.logits = NULL);
    BAD("top_ids", p.top_ids = NULL);
    BAD("top_logp", p.top_logp = NULL);
    BAD("aligned", p.logits = (const char *)vals + 2);                  /* fp32 at 2 bytes */
    BAD("aligned", (p.dtype = KDT_BF16, p.logits = (const char *)vals + 1));
#undef BAD
    /* The CUDA launcher checks the same fields (or says there is no CUDA). */
    p = good;
    p.k = 0;
    kdt_status st = kdt_topk_logsoftmax_cuda(&p, NULL);
    CHECK(st == KDT_ERR_INVALID_ARG || st == KDT_ERR_NO_CUDA);
    CHECK(kdt_topk_workspace_bytes(0, 8, 4) == 0); /* nonsense shape: no workspace, no crash */
}

int main(void) {
    T_RUN(test_random_shapes);
    T_RUN(test_edges);
    T_RUN(test_value_policy);
    T_RUN(test_argument_errors);
    return t_summary();
}
