/* test_topk_gpu.c - kdt_topk_logsoftmax_cuda against the CPU twin: ids exactly, log-probs to
 * 1e-5 relative (|gpu - cpu| <= 1e-5 (1 + |cpu|), -inf exactly). Shapes up to V = 163,840 with
 * R = 448 (64 streams x 7), K 1..1024, bf16 and fp32, row_stride > V (odd strides: rows not
 * 16-byte aligned; the gap holds values that would win if read), ties, ascending rows, -inf,
 * NaN and +inf; outputs and workspace poisoned before every run; the split into chunks both
 * automatic and forced to one chunk per row; repeat runs bit-identical; a workspace sized for
 * the largest shape reused by smaller calls; launcher errors.
 * `--quick` or KDT_TEST_QUICK=1 runs fewer, smaller cases. Exits non-zero with a message when
 * no CUDA device is present. */
#include <cuda_runtime_api.h>
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "fp.h"
#include "kdtree/kernels.h"
#include "t.h"

/* Bench/test hook of cuda/topk.cu: forces fewer chunks per row (0 = automatic). */
extern int kdt_topk_bench_chunks;

#include "gpu_test_util.h"

/* SPREAD_TOP puts K distinct top values at elements 0, 8, 16, ... (one per 16-byte vector, so
 * one per thread in the first tile): the first threshold is then exactly the K-th value.
 * TREND rises along the row with noise, so the candidate buffer overflows again and again and
 * later elements keep landing next to the current K-th key. PLATEAU ramps up over the first
 * fifth (forcing compactions), then stays dense just below the ramp's top, right at the K-th key.
 * BINARY is 0 or 1 at random: thousands of tied top values per tile overflow the buffer in one
 * round, and the ids still pending after a compaction interleave with the kept ones.
 * NEGINF_MIX has -inf among finite values but no NaN / +inf, so it stays on the fast path
 * (SPECIALS, with NaN, takes the sanitizing path). NEGATIVE is all below zero (thresholds raised
 * from the running maxima are then negative, between bf16 values for bf16). */
typedef enum fill_kind { FILL_NORMAL, FILL_TIES, FILL_SPECIALS, FILL_ALL_NEGINF, FILL_ASCENDING,
                         FILL_PEAKY, FILL_SPREAD_TOP, FILL_TREND, FILL_PLATEAU, FILL_BINARY,
                         FILL_NEGINF_MIX, FILL_NEGATIVE } fill_kind;
#define N_FILL_KINDS 12

static float draw(uint64_t *rng, fill_kind kind, int64_t i, int32_t V, int32_t K) {
    switch (kind) {
    case FILL_SPREAD_TOP:
        if (i % 8 == 0 && i / 8 < K) return 20.0f + 0.03125f * (float)(K - i / 8);
        return (float)t_rand_normal(rng);
    case FILL_TREND: return (float)(6.0 * (double)i / V + t_rand_normal(rng));
    case FILL_PLATEAU:
        if (i < V / 5) return (float)(2.0 * (double)i / (V / 5));
        return (float)(1.9 + 0.1 * t_rand_unit(rng));
    case FILL_BINARY: return (float)t_rand_int(rng, 2);
    case FILL_NEGINF_MIX: return t_rand_int(rng, 4) ? (float)(2.0 * t_rand_normal(rng)) : -INFINITY;
    case FILL_NORMAL: return (float)(2.5 * t_rand_normal(rng));
    case FILL_NEGATIVE: return (float)(-50.0 + 2.5 * t_rand_normal(rng));
    case FILL_TIES: return (float)(t_rand_int(rng, 4) - 2) * 0.25f;
    case FILL_SPECIALS: {
        int c = t_rand_int(rng, 64);
        if (c == 0) return -INFINITY;
        if (c == 1) return NAN;
        if (c == 2 && t_rand_int(rng, 64) == 0) return INFINITY;
        if (c == 3) return -0.0f;
        return (float)(2.0 * t_rand_normal(rng));
    }
    case FILL_ALL_NEGINF: return -INFINITY;
    case FILL_ASCENDING: return (float)i / (float)V * 16.0f - 8.0f;
    case FILL_PEAKY: return t_rand_int(rng, 1000) == 0 ? (float)(12.0 + t_rand_normal(rng))
                                                      : (float)(t_rand_normal(rng) - 4.0);
    }
    return 0;
}

typedef struct tcase {
    int32_t R, V, K;
    int64_t stride;
    kdt_dtype dt;
    fill_kind kind;
} tcase;

/* One case: GPU (automatic split, then one chunk per row) vs CPU. Returns 1 if all matched.
 * shared_ws / shared_ws_bytes: a caller's workspace to use instead of an exact-size one. */
static int run_case_ws(uint64_t *rng, tcase c, void *shared_ws, size_t shared_ws_bytes) {
    const size_t n = (size_t)c.R * (size_t)c.stride, es = c.dt == KDT_BF16 ? 2 : 4;
    void *host = malloc(n * es);
    for (int32_t r = 0; r < c.R; r++) {
        /* FILL_SPECIALS: every third row holds nothing but -inf and NaN */
        int row_kind = c.kind == FILL_SPECIALS && r % 3 == 2 ? FILL_ALL_NEGINF : (int)c.kind;
        for (int64_t i = 0; i < c.stride; i++) {
            float x = i < c.V ? draw(rng, (fill_kind)row_kind, i, c.V, c.K) : (i % 2 ? INFINITY : 1e30f);
            if (c.kind == FILL_SPECIALS && row_kind == FILL_ALL_NEGINF && i < c.V && i % 3 == 1)
                x = NAN; /* a row of -inf and NaN only */
            size_t at = (size_t)r * c.stride + (size_t)i;
            if (c.dt == KDT_BF16) ((uint16_t *)host)[at] = kdt_f32_to_bf16(x);
            else ((float *)host)[at] = x;
        }
    }
    const size_t out_n = (size_t)c.R * c.K;
    int32_t *ids_cpu = malloc(sizeof(int32_t) * out_n), *ids_gpu = malloc(sizeof(int32_t) * out_n);
    float *lp_cpu = malloc(sizeof(float) * out_n), *lp_gpu = malloc(sizeof(float) * out_n);
    int32_t *ids_first = malloc(sizeof(int32_t) * out_n);
    float *lp_first = malloc(sizeof(float) * out_n);
    kdt_topk_params p;
    memset(&p, 0, sizeof p);
    p.n_rows = c.R;
    p.vocab = c.V;
    p.k = c.K;
    p.dtype = c.dt;
    p.row_stride = c.stride;
    p.logits = host;
    p.top_ids = ids_cpu;
    p.top_logp = lp_cpu;
    int ok = kdt_topk_logsoftmax_cpu(&p) == KDT_OK;
    if (!ok) fprintf(stderr, "  CPU failed: %s\n", kdt_last_error());

    void *d_logits, *d_ws = NULL;
    int32_t *d_ids;
    float *d_lp;
    const size_t ws = shared_ws ? shared_ws_bytes : kdt_topk_workspace_bytes(c.R, c.V, c.K);
    CUDA_OK(cudaMalloc(&d_logits, n * es));
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(int32_t) * out_n));
    CUDA_OK(cudaMalloc((void **)&d_lp, sizeof(float) * out_n));
    if (shared_ws) d_ws = shared_ws;
    else if (ws) CUDA_OK(cudaMalloc(&d_ws, ws));
    CUDA_OK(cudaMemcpy(d_logits, host, n * es, cudaMemcpyHostToDevice));
    p.logits = d_logits;
    p.top_ids = d_ids;
    p.top_logp = d_lp;
    p.workspace = d_ws;
    p.workspace_bytes = ws;
    for (int pass = 0; ok && pass < 3; pass++) {
        /* pass 0: automatic split; 1: the same again (must be bit-identical); 2: one chunk */
        kdt_topk_bench_chunks = pass == 2 ? 1 : 0;
        CUDA_OK(cudaMemset(d_ids, 0x5a, sizeof(int32_t) * out_n));
        CUDA_OK(cudaMemset(d_lp, 0xff, sizeof(float) * out_n)); /* NaN */
        if (ws) CUDA_OK(cudaMemset(d_ws, 0xa5, ws));
        kdt_status st = kdt_topk_logsoftmax_cuda(&p, NULL);
        kdt_topk_bench_chunks = 0;
        if (st != KDT_OK) {
            fprintf(stderr, "  CUDA failed: %s\n", kdt_last_error());
            ok = 0;
            break;
        }
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(ids_gpu, d_ids, sizeof(int32_t) * out_n, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(lp_gpu, d_lp, sizeof(float) * out_n, cudaMemcpyDeviceToHost));
        for (size_t j = 0; j < out_n; j++) {
            float g = lp_gpu[j], want = lp_cpu[j];
            int lp_ok = isinf(want) ? g == want : fabs((double)g - want) <= 1e-5 * (1.0 + fabs(want));
            if (ids_gpu[j] != ids_cpu[j] || !lp_ok) {
                fprintf(stderr, "  R %d V %d K %d stride %lld %s kind %d pass %d: row %zu rank %zu: "
                        "id %d logp %.9g, expected id %d logp %.9g\n", c.R, c.V, c.K,
                        (long long)c.stride, c.dt == KDT_BF16 ? "bf16" : "f32", (int)c.kind, pass,
                        j / (size_t)c.K, j % (size_t)c.K, ids_gpu[j], g, ids_cpu[j], want);
                ok = 0;
                break;
            }
        }
        if (pass == 0) {
            memcpy(ids_first, ids_gpu, sizeof(int32_t) * out_n);
            memcpy(lp_first, lp_gpu, sizeof(float) * out_n);
        } else if (pass == 1 && (memcmp(ids_first, ids_gpu, sizeof(int32_t) * out_n) ||
                                 memcmp(lp_first, lp_gpu, sizeof(float) * out_n))) {
            fprintf(stderr, "  R %d V %d K %d: a repeated run differs\n", c.R, c.V, c.K);
            ok = 0;
        }
    }
    cudaFree(d_logits); cudaFree(d_ids); cudaFree(d_lp);
    if (d_ws && !shared_ws) cudaFree(d_ws);
    free(host); free(ids_cpu); free(ids_gpu); free(lp_cpu); free(lp_gpu); free(ids_first);
    free(lp_first);
    return ok;
}

static int run_case(uint64_t *rng, tcase c) { return run_case_ws(rng, c, NULL, 0); }

static int g_quick;

/* kdt_topk_workspace_bytes never decreases with n_rows or k, and one buffer sized for the
 * largest shape serves smaller calls. */
static void test_workspace_bound(void) {
    const int32_t V = 163840, Ks[] = {1, 8, 31, 32, 33, 64, 128, 129, 256, 511, 512, 513, 1000, 1024};
    const int nk = (int)(sizeof Ks / sizeof Ks[0]);
    int bad = 0;
    for (int32_t R = 1; R <= 1200; R++)
        for (int ki = 0; ki < nk; ki++) {
            size_t w = kdt_topk_workspace_bytes(R, V, Ks[ki]);
            if (w > kdt_topk_workspace_bytes(R + 1, V, Ks[ki])) bad++;
            if (ki + 1 < nk && w > kdt_topk_workspace_bytes(R, V, Ks[ki + 1])) bad++;
        }
    CHECK_EQ_INT(bad, 0);
    CHECK(kdt_topk_workspace_bytes(448, 4096, 32) == 0); /* small vocabularies are never split */
    const size_t big = kdt_topk_workspace_bytes(64 * 16, V, KDT_MAX_TOPK);
    void *ws;
    CUDA_OK(cudaMalloc(&ws, big));
    uint64_t rng = 11;
    const tcase cases[] = {{7, V, 8, V, KDT_BF16, FILL_NORMAL}, {7, V, 1024, V, KDT_BF16, FILL_NORMAL},
                           {56, V, 256, V, KDT_BF16, FILL_PEAKY}, {3, 20000, 100, 20000, KDT_F32, FILL_TIES}};
    for (int i = 0; i < 4; i++) {
        if (g_quick && (i == 1 || i == 2)) continue;
        CHECK(run_case_ws(&rng, cases[i], ws, big));
    }
    cudaFree(ws);
}

/* The production shapes: Kimi's V with 1, 8 and 64 streams of 7 positions. */
static void test_production_shapes(void) {
    uint64_t rng = 163840;
    const int32_t Rs[3] = {7, 56, 448}, Ks[5] = {8, 32, 64, 256, 1024};
    int fails = 0;
    for (int ri = 0; ri < 3; ri++)
        for (int ki = 0; ki < 5; ki++) {
            if (g_quick && (ri != 0 || ki != 1)) continue; /* quick: R = 7, K = 32 only */
            if (ri == 2 && ki != 1 && ki != 4) continue; /* R = 448: K 32 and 1024 */
            tcase c = {Rs[ri], 163840, Ks[ki], 163840, KDT_BF16, ki == 2 ? FILL_PEAKY : FILL_NORMAL};
            fails += !run_case(&rng, c);
        }
    tcase f32 = {56, 163840, 32, 163840 + 5, KDT_F32, FILL_NORMAL};
    if (!g_quick) fails += !run_case(&rng, f32);
    CHECK_EQ_INT(fails, 0);
}

static void test_edge_shapes(void) {
    uint64_t rng = 31;
    const tcase cases[] = {
        {1, 1, 1, 1, KDT_BF16, FILL_NORMAL},
        {5, 1, 1, 3, KDT_F32, FILL_ALL_NEGINF},
        {3, 7, 7, 9, KDT_BF16, FILL_TIES},
        {4, 100, 100, 101, KDT_F32, FILL_NORMAL},
        {2, 1024, 1024, 1024, KDT_BF16, FILL_NORMAL},
        {2, 1024, 1024, 1027, KDT_F32, FILL_TIES},
        {3, 4095, 17, 4095, KDT_BF16, FILL_NORMAL},
        {3, 4097, 300, 4099, KDT_BF16, FILL_SPECIALS},
        {2, 8193, 513, 8200, KDT_F32, FILL_NORMAL},
        {9, 20000, 1, 20001, KDT_BF16, FILL_TIES},
        {6, 33333, 64, 33335, KDT_BF16, FILL_SPECIALS},
        {6, 33333, 64, 33335, KDT_F32, FILL_SPECIALS},
        {4, 50000, 1000, 50003, KDT_BF16, FILL_ASCENDING},
        {4, 65536, 256, 65536, KDT_F32, FILL_ASCENDING},
        {7, 163840, 32, 163847, KDT_BF16, FILL_SPECIALS},
        {3, 163840, 8, 163840, KDT_BF16, FILL_ALL_NEGINF},
        {2, 163840, 1024, 163841, KDT_BF16, FILL_TIES},
        {1, KDT_MAX_VOCAB, 64, KDT_MAX_VOCAB, KDT_BF16, FILL_NORMAL},
        {3, 40000, 32, 40000, KDT_BF16, FILL_SPREAD_TOP},
        {2, 40000, 256, 40000, KDT_BF16, FILL_SPREAD_TOP},
        {2, 40000, 1000, 40000, KDT_BF16, FILL_SPREAD_TOP},
        {2, 40000, 100, 40000, KDT_F32, FILL_SPREAD_TOP},
        {3, 60000, 32, 60001, KDT_BF16, FILL_TREND},
        {3, 60000, 300, 60000, KDT_F32, FILL_TREND},
        {2, 163840, 64, 163840, KDT_BF16, FILL_TREND},
        {3, 60000, 32, 60000, KDT_F32, FILL_PLATEAU},
        {3, 60000, 200, 60000, KDT_BF16, FILL_PLATEAU},
        {2, 163840, 1024, 163840, KDT_F32, FILL_PLATEAU},
        {2, 60000, 32, 60000, KDT_BF16, FILL_BINARY},
        {3, 50000, 64, 50001, KDT_BF16, FILL_NEGINF_MIX},
        {3, 50000, 500, 50000, KDT_F32, FILL_NEGINF_MIX},
        {1, 163840, 32, 163840, KDT_BF16, FILL_NEGINF_MIX},
        {2, 60000, 700, 60000, KDT_F32, FILL_BINARY},
        {3, 60000, 32, 60000, KDT_BF16, FILL_NEGATIVE},
        {2, 163840, 64, 163841, KDT_BF16, FILL_NEGATIVE},
        {3, 50000, 200, 50000, KDT_F32, FILL_NEGATIVE},
        {300, 3000, 16, 3001, KDT_BF16, FILL_NORMAL},
        {1200, 9000, 8, 9000, KDT_BF16, FILL_PEAKY},
    };
    int n = (int)(sizeof cases / sizeof cases[0]), fails = 0;
    for (int i = 0; i < n; i++) {
        if (g_quick && (int64_t)cases[i].R * cases[i].V > 200000) continue;
        fails += !run_case(&rng, cases[i]);
    }
    CHECK_EQ_INT(fails, 0);
}

static void test_random_shapes(void) {
    uint64_t rng = 4242;
    int fails = 0, n = g_quick ? 8 : 150;
    for (int it = 0; it < n && fails < 5; it++) {
        tcase c;
        c.V = 1 + t_rand_int(&rng, g_quick ? 20000 : it % 3 == 0 ? 200000 : 20000);
        int32_t kmax = c.V < KDT_MAX_TOPK ? c.V : KDT_MAX_TOPK;
        c.K = it % 7 == 0 ? kmax : 1 + t_rand_int(&rng, kmax < 300 ? kmax : 300);
        c.R = 1 + t_rand_int(&rng, g_quick ? 4 : 24);
        c.stride = c.V + (it % 2 ? t_rand_int(&rng, 9) : 0);
        c.dt = it % 3 == 2 ? KDT_F32 : KDT_BF16;
        c.kind = (fill_kind)(it % N_FILL_KINDS);
        fails += !run_case(&rng, c);
    }
    CHECK_EQ_INT(fails, 0);
}

static void test_launcher_errors(void) {
    void *d;
    CUDA_OK(cudaMalloc(&d, 1 << 20));
    kdt_topk_params good, p;
    memset(&good, 0, sizeof good);
    good.n_rows = 7;
    good.vocab = 163840;
    good.k = 32;
    good.dtype = KDT_BF16;
    good.logits = d;
    good.row_stride = 163840;
    good.top_ids = d;
    good.top_logp = d;
    size_t ws = kdt_topk_workspace_bytes(7, 163840, 32);
    CHECK(ws > 0); /* 7 rows are split into chunks */
    CHECK(ws <= (1 << 20));
    good.workspace = d;
    good.workspace_bytes = ws;
#define BAD(mutate)                                                                   \
    do {                                                                              \
        p = good;                                                                     \
        mutate;                                                                       \
        kdt_clear_error();                                                            \
        CHECK_EQ_INT(kdt_topk_logsoftmax_cuda(&p, NULL), KDT_ERR_INVALID_ARG);        \
        CHECK(kdt_last_error()[0] != '\0');                                           \
    } while (0)
    BAD(p.workspace_bytes = 1024);
    BAD(p.workspace = NULL);
    BAD(p.workspace = (char *)d + 8);
    BAD(p.k = 0);
    BAD(p.vocab = 0);
    BAD(p.row_stride = 100);
    BAD(p.logits = NULL);
    BAD(p.logits = (char *)d + 1);
    BAD(p.dtype = (kdt_dtype)3);
#undef BAD
    CHECK_EQ_INT(kdt_topk_logsoftmax_cuda(NULL, NULL), KDT_ERR_INVALID_ARG);
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(d);
}

int main(int argc, char **argv) {
    /* Quick mode (--quick or KDT_TEST_QUICK=1, as gpu_check.sh sets under compute-sanitizer):
     * small shapes only, so racecheck finishes well inside its time limit. */
    const char *quick_env = getenv("KDT_TEST_QUICK");
    g_quick = (argc > 1 && !strcmp(argv[1], "--quick")) ||
              (quick_env && quick_env[0] && strcmp(quick_env, "0"));
    if (!gpu_test_have_device("test_topk_gpu")) return 1;
    T_RUN(test_edge_shapes);
    T_RUN(test_random_shapes);
    T_RUN(test_workspace_bound);
    T_RUN(test_production_shapes);
    T_RUN(test_launcher_errors);
    return t_summary();
}
