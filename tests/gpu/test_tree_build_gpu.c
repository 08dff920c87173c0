/* test_tree_build_gpu.c - kdt_tree_build_cuda against the CPU twin, bit for bit: many seeds and
 * shapes (S 1-64, B 0-256 and the 1024 maximum, L 1-16, K 1-1024, DDTree and chain, per-stream
 * B and L, ties, NaN / inf log-probs), outputs poisoned before every run (GPU and CPU with
 * different patterns, so an element the GPU does not write cannot match), out-of-range
 * per-stream values in device memory (the kernel clamps them: compared with the CPU on clamped
 * input), and the launcher's argument errors. `--quick` runs fewer seeds.
 * Exits non-zero with a message when no CUDA device is present. */
#include <cuda_runtime_api.h>
#include <string.h>

#include "kdtree/kernels.h"
#include "t.h"

#include "gpu_test_util.h"

/* Host inputs of one case. */
typedef struct inputs {
    int32_t S, L, K, max_nodes, chain;
    int32_t *ids;     /* [S][L][K] */
    float *logp;      /* [S][L][K] */
    int32_t *budget, *depth_limit, *root, *prefix; /* [S] */
} inputs;

/* A tree's arrays in one allocation (host or device), carved in a fixed order. */
typedef struct tree_buf {
    kdt_tree t;
    void *base;
    size_t bytes;
} tree_buf;

static size_t tree_bytes(int32_t S, int32_t M) {
    size_t sn = (size_t)S * M;
    return sizeof(int32_t) * ((size_t)S + 6 * sn) + sizeof(float) * sn +
           sizeof(uint64_t) * sn * KDT_MASK_WORDS(M) + 64;
}

static void tree_carve(tree_buf *b, int32_t S, int32_t M) {
    size_t sn = (size_t)S * M;
    char *p = (char *)b->base;
    b->t.n_streams = S;
    b->t.max_nodes = M;
    b->t.anc_mask = (uint64_t *)p;   p += sizeof(uint64_t) * sn * KDT_MASK_WORDS(M);
    b->t.score = (float *)p;         p += sizeof(float) * sn;
    b->t.token = (int32_t *)p;       p += sizeof(int32_t) * sn;
    b->t.parent = (int32_t *)p;      p += sizeof(int32_t) * sn;
    b->t.depth = (int32_t *)p;       p += sizeof(int32_t) * sn;
    b->t.first_child = (int32_t *)p; p += sizeof(int32_t) * sn;
    b->t.next_sibling = (int32_t *)p; p += sizeof(int32_t) * sn;
    b->t.position = (int32_t *)p;    p += sizeof(int32_t) * sn;
    b->t.n_nodes = (int32_t *)p;
}

static void gen_inputs(inputs *in, uint64_t *rng, int32_t S, int32_t L, int32_t K, int32_t M,
                       int chain, int ties, int specials) {
    in->S = S; in->L = L; in->K = K; in->max_nodes = M; in->chain = chain;
    size_t lk = (size_t)S * L * K;
    in->ids = malloc(sizeof(int32_t) * lk);
    in->logp = malloc(sizeof(float) * lk);
    in->budget = malloc(sizeof(int32_t) * (size_t)S);
    in->depth_limit = malloc(sizeof(int32_t) * (size_t)S);
    in->root = malloc(sizeof(int32_t) * (size_t)S);
    in->prefix = malloc(sizeof(int32_t) * (size_t)S);
    for (size_t row = 0; row < (size_t)S * L; row++) {
        int32_t base = t_rand_int(rng, 160000);
        double acc = -2.0 * t_rand_unit(rng), scale = 0.2 + 3.0 * t_rand_unit(rng);
        for (int32_t r = 0; r < K; r++) {
            in->ids[row * K + r] = base + 3 * r; /* distinct within a row */
            acc -= scale * t_rand_unit(rng) * t_rand_unit(rng);
            double v = ties ? 0.5 * floor(acc / 0.5) : acc;
            float f = (float)v;
            if (r > 0 && f > in->logp[row * K + r - 1]) f = in->logp[row * K + r - 1];
            if (specials) {
                int c = t_rand_int(rng, 40);
                if (c == 0) f = NAN;
                else if (c == 1) f = -INFINITY;
                else if (c == 2) f = INFINITY;
                else if (c == 3) f = -0.0f;
            }
            in->logp[row * K + r] = f;
        }
    }
    for (int32_t s = 0; s < S; s++) {
        in->budget[s] = t_rand_int(rng, M);
        if (t_rand_int(rng, 4) == 0) in->budget[s] = M - 1;
        in->depth_limit[s] = 1 + t_rand_int(rng, L);
        if (t_rand_int(rng, 3) == 0) in->depth_limit[s] = L;
        in->root[s] = t_rand_int(rng, 160000);
        in->prefix[s] = t_rand_int(rng, 100000);
    }
}

static void free_inputs(inputs *in) {
    free(in->ids); free(in->logp); free(in->budget); free(in->depth_limit); free(in->root);
    free(in->prefix);
}

static kdt_tree_build_params params_of(const inputs *in, const int32_t *ids, const float *logp,
                                       const int32_t *budget, const int32_t *limit,
                                       const int32_t *root, const int32_t *prefix) {
    kdt_tree_build_params p;
    p.n_streams = in->S;
    p.max_depth = in->L;
    p.top_k = in->K;
    p.top_ids = ids;
    p.top_logp = logp;
    p.depth_limit = limit;
    p.budget = budget;
    p.root_token = root;
    p.prefix_len = prefix;
    p.chain = in->chain;
    return p;
}

static int first_diff(const void *a, const void *b, size_t elem, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (memcmp((const char *)a + i * elem, (const char *)b + i * elem, elem)) return (int)i;
    return -1;
}

/* Runs CPU (on cpu_budget / cpu_limit) and GPU (on the device copies of dev_budget / dev_limit);
 * returns 1 if every output bit matches. */
static int compare_case(const inputs *in, const int32_t *dev_budget_h, const int32_t *dev_limit_h,
                        const char *what) {
    const int32_t S = in->S, M = in->max_nodes;
    const size_t lk = (size_t)S * in->L * in->K, tb = tree_bytes(S, M);
    /* CPU */
    tree_buf cpu;
    cpu.base = malloc(tb);
    memset(cpu.base, 0xa5, tb);
    tree_carve(&cpu, S, M);
    kdt_tree_build_params pc = params_of(in, in->ids, in->logp, in->budget, in->depth_limit,
                                         in->root, in->prefix);
    if (kdt_tree_build_cpu(&pc, &cpu.t) != KDT_OK) {
        fprintf(stderr, "  %s: CPU failed: %s\n", what, kdt_last_error());
        free(cpu.base);
        return 0;
    }
    /* GPU */
    int32_t *d_ids, *d_budget, *d_limit, *d_root, *d_prefix;
    float *d_logp;
    tree_buf gpu;
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(int32_t) * lk));
    CUDA_OK(cudaMalloc((void **)&d_logp, sizeof(float) * lk));
    CUDA_OK(cudaMalloc((void **)&d_budget, sizeof(int32_t) * (size_t)S));
    CUDA_OK(cudaMalloc((void **)&d_limit, sizeof(int32_t) * (size_t)S));
    CUDA_OK(cudaMalloc((void **)&d_root, sizeof(int32_t) * (size_t)S));
    CUDA_OK(cudaMalloc((void **)&d_prefix, sizeof(int32_t) * (size_t)S));
    CUDA_OK(cudaMalloc(&gpu.base, tb));
    CUDA_OK(cudaMemcpy(d_ids, in->ids, sizeof(int32_t) * lk, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_logp, in->logp, sizeof(float) * lk, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_budget, dev_budget_h, sizeof(int32_t) * (size_t)S, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_limit, dev_limit_h, sizeof(int32_t) * (size_t)S, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_root, in->root, sizeof(int32_t) * (size_t)S, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_prefix, in->prefix, sizeof(int32_t) * (size_t)S, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(gpu.base, 0x5a, tb));
    tree_carve(&gpu, S, M);
    kdt_tree_build_params pg = params_of(in, d_ids, d_logp, d_budget, d_limit, d_root, d_prefix);
    kdt_status st = kdt_tree_build_cuda(&pg, &gpu.t, NULL);
    int ok = st == KDT_OK;
    if (!ok) fprintf(stderr, "  %s: CUDA failed: %s\n", what, kdt_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    void *back = malloc(tb);
    CUDA_OK(cudaMemcpy(back, gpu.base, tb, cudaMemcpyDeviceToHost));
    tree_buf host_copy;
    host_copy.base = back;
    tree_carve(&host_copy, S, M);
    const size_t sn = (size_t)S * M;
    struct { const char *name; const void *a, *b; size_t elem, n; } fields[] = {
        {"n_nodes", host_copy.t.n_nodes, cpu.t.n_nodes, 4, (size_t)S},
        {"token", host_copy.t.token, cpu.t.token, 4, sn},
        {"parent", host_copy.t.parent, cpu.t.parent, 4, sn},
        {"depth", host_copy.t.depth, cpu.t.depth, 4, sn},
        {"first_child", host_copy.t.first_child, cpu.t.first_child, 4, sn},
        {"next_sibling", host_copy.t.next_sibling, cpu.t.next_sibling, 4, sn},
        {"position", host_copy.t.position, cpu.t.position, 4, sn},
        {"score", host_copy.t.score, cpu.t.score, 4, sn},
        {"anc_mask", host_copy.t.anc_mask, cpu.t.anc_mask, 8, sn * KDT_MASK_WORDS(M)},
    };
    for (size_t f = 0; ok && f < sizeof fields / sizeof fields[0]; f++) {
        int at = first_diff(fields[f].a, fields[f].b, fields[f].elem, fields[f].n);
        if (at >= 0) {
            int per_stream = fields[f].n == (size_t)S ? 1 : (int)(fields[f].n / (size_t)S);
            fprintf(stderr, "  %s: S %d L %d K %d max_nodes %d chain %d: %s differs at stream %d "
                    "element %d (budget %d, depth_limit %d)\n", what, S, in->L, in->K, M, in->chain,
                    fields[f].name, at / per_stream, at % per_stream, in->budget[at / per_stream],
                    in->depth_limit[at / per_stream]);
            ok = 0;
        }
    }
    free(back);
    free(cpu.base);
    cudaFree(d_ids); cudaFree(d_logp); cudaFree(d_budget); cudaFree(d_limit); cudaFree(d_root);
    cudaFree(d_prefix); cudaFree(gpu.base);
    return ok;
}

static int g_quick;

static void test_random_seeds(void) {
    uint64_t rng = 20260101;
    const int32_t stream_counts[] = {1, 2, 7, 33, 64};
    int n_cases = g_quick ? 60 : 600, fails = 0;
    for (int it = 0; it < n_cases; it++) {
        int32_t S = stream_counts[t_rand_int(&rng, 5)];
        int32_t M = 2 + t_rand_int(&rng, it % 3 == 0 ? 256 : 64);
        int32_t L = 1 + t_rand_int(&rng, KDT_MAX_DEPTH);
        int32_t K = it % 4 == 0 ? M - 1 : 1 + t_rand_int(&rng, 64);
        inputs in;
        gen_inputs(&in, &rng, S, L, K, M, it % 4 == 3, it % 3 == 1, it % 11 == 5);
        char what[64];
        snprintf(what, sizeof what, "seed case %d", it);
        if (!compare_case(&in, in.budget, in.depth_limit, what)) fails++;
        free_inputs(&in);
        if (fails >= 5) break;
    }
    CHECK_EQ_INT(fails, 0);
}

/* B <= 32 (max_nodes <= 33): the sorted-list pop loop. 64 streams a case, each with its own
 * budget and depth limit; plain, tied and special (NaN / inf / -0) log-probs, the specials
 * making rows non-monotone (a successor can outscore the node that pushed it). */
static void test_small_budgets(void) {
    uint64_t rng = 3303;
    int n_cases = g_quick ? 40 : 400, fails = 0;
    for (int it = 0; it < n_cases; it++) {
        int32_t M = 2 + t_rand_int(&rng, 32);
        int32_t L = 1 + t_rand_int(&rng, KDT_MAX_DEPTH);
        int32_t K = it % 4 == 0 ? M : 1 + t_rand_int(&rng, 40);
        inputs in;
        gen_inputs(&in, &rng, 64, L, K, M, 0, it % 3 == 1, it % 2 == 1);
        char what[64];
        snprintf(what, sizeof what, "small budget case %d", it);
        if (!compare_case(&in, in.budget, in.depth_limit, what)) fails++;
        free_inputs(&in);
        if (fails >= 5) break;
    }
    CHECK_EQ_INT(fails, 0);
}

/* The largest trees: B = 1024 (32 frontier registers per lane, 17 mask words), K = 1024,
 * L = 16: the staged log-probs need more than 48 KB of shared memory. */
static void test_max_shapes(void) {
    uint64_t rng = 77;
    const int32_t Ms[] = {KDT_MAX_NODES, 513, 300, 65, 33, 32, 1};
    for (int i = 0; i < 7; i++) {
        for (int chain = 0; chain < 2; chain++) {
            inputs in;
            int32_t K = Ms[i] > 1 ? (Ms[i] - 1 < KDT_MAX_TOPK ? Ms[i] - 1 : KDT_MAX_TOPK) : 3;
            gen_inputs(&in, &rng, 3, KDT_MAX_DEPTH, K, Ms[i], chain, 0, 0);
            in.budget[0] = Ms[i] - 1;
            in.depth_limit[0] = KDT_MAX_DEPTH;
            char what[64];
            snprintf(what, sizeof what, "max shape max_nodes %d", Ms[i]);
            CHECK(compare_case(&in, in.budget, in.depth_limit, what));
            free_inputs(&in);
        }
    }
}

/* Device-side budget / depth_limit out of range: the kernel clamps them. */
static void test_device_values_clamped(void) {
    uint64_t rng = 5;
    inputs in;
    gen_inputs(&in, &rng, 6, 8, 20, 40, 0, 0, 0);
    const int32_t dev_budget[6] = {-5, 5000, 39, 10, INT32_MAX, INT32_MIN};
    const int32_t dev_limit[6] = {0, 99, -1, 8, INT32_MIN, INT32_MAX};
    for (int s = 0; s < 6; s++) { /* what the kernel must use */
        in.budget[s] = dev_budget[s] < 0 ? 0 : (dev_budget[s] > 39 ? 39 : dev_budget[s]);
        in.depth_limit[s] = dev_limit[s] < 1 ? 1 : (dev_limit[s] > 8 ? 8 : dev_limit[s]);
    }
    for (int chain = 0; chain < 2; chain++) {
        in.chain = chain;
        CHECK(compare_case(&in, dev_budget, dev_limit, "clamped device values"));
    }
    free_inputs(&in);
}

static void test_launcher_errors(void) {
    uint64_t rng = 9;
    inputs in;
    gen_inputs(&in, &rng, 2, 4, 3, 10, 0, 0, 0);
    tree_buf b;
    CUDA_OK(cudaMalloc(&b.base, tree_bytes(2, 10)));
    tree_carve(&b, 2, 10);
    int32_t *d;
    CUDA_OK(cudaMalloc((void **)&d, 4096));
    kdt_tree_build_params good = params_of(&in, d, (const float *)d, d, d, d, d), p;
    kdt_tree t;
#define BAD(mutate)                                                                   \
    do {                                                                              \
        p = good;                                                                     \
        t = b.t;                                                                      \
        mutate;                                                                       \
        kdt_clear_error();                                                            \
        CHECK_EQ_INT(kdt_tree_build_cuda(&p, &t, NULL), KDT_ERR_INVALID_ARG);         \
        CHECK(kdt_last_error()[0] != '\0');                                           \
    } while (0)
    BAD(p.n_streams = 0);
    BAD(t.n_streams = 3);
    BAD(t.max_nodes = KDT_MAX_NODES + 1);
    BAD(p.max_depth = 0);
    BAD(p.top_k = KDT_MAX_TOPK + 1);
    BAD(p.chain = -1);
    BAD(p.top_logp = NULL);
    BAD(p.budget = NULL);
    BAD(t.anc_mask = NULL);
#undef BAD
    CHECK_EQ_INT(kdt_tree_build_cuda(NULL, &b.t, NULL), KDT_ERR_INVALID_ARG);
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(b.base);
    cudaFree(d);
    free_inputs(&in);
}

int main(int argc, char **argv) {
    g_quick = argc > 1 && !strcmp(argv[1], "--quick");
    if (!gpu_test_have_device("test_tree_build_gpu")) return 1;
    T_RUN(test_random_seeds);
    T_RUN(test_small_budgets);
    T_RUN(test_max_shapes);
    T_RUN(test_device_values_clamped);
    T_RUN(test_launcher_errors);
    return t_summary();
}
