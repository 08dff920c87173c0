/* bench_tree_build.c - the DDTree heap kernel: us per call for streams {1, 8, 64} x budget
 * {8, 32, 64, 128} at L = 7 and 15, plus the chain mode, timed as CUDA-graph replays of 20
 * back-to-back calls (a call is a few microseconds). The input is real top-K output: the CPU
 * top-K (K = B, as the paper's K = min(B, V)) of random logits over a 4,096-token vocabulary,
 * so log-probs are sorted and peaked like a drafter's. Each configuration is checked once
 * against the CPU twin (n_nodes and parents) before it is timed. */
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kdtree/kernels.h"

typedef struct tree_ctx {
    kdt_tree_build_params p;
    kdt_tree t;
} tree_ctx;

static int run_tree(void *ctx, cudaStream_t stream) {
    tree_ctx *c = (tree_ctx *)ctx;
    kdt_status st = kdt_tree_build_cuda(&c->p, &c->t, stream);
    if (st != KDT_OK) {
        fprintf(stderr, "tree_build: %s\n", kdt_last_error());
        return 1;
    }
    return 0;
}

enum { S_MAX = 64, B_MAX = 128, L_MAX = 15, V_IN = 4096 };

/* Host top-K of all S_MAX x L_MAX positions at K = B_MAX; a (S, L, B) case takes a prefix. */
typedef struct topk_table {
    int32_t ids[S_MAX][L_MAX][B_MAX];
    float logp[S_MAX][L_MAX][B_MAX];
} topk_table;

static int make_table(topk_table *tab) {
    const size_t n = (size_t)S_MAX * L_MAX * V_IN;
    float *logits = (float *)malloc(n * sizeof(float));
    if (!logits) return 1;
    bench_fill_normal_f32(logits, n, 99, 3.0f); /* scale 3: a peaked softmax over 4,096 */
    kdt_topk_params p;
    memset(&p, 0, sizeof p);
    p.n_rows = S_MAX * L_MAX;
    p.vocab = V_IN;
    p.k = B_MAX;
    p.dtype = KDT_F32;
    p.logits = logits;
    p.row_stride = V_IN;
    p.top_ids = &tab->ids[0][0][0];
    p.top_logp = &tab->logp[0][0][0];
    kdt_status st = kdt_topk_logsoftmax_cpu(&p);
    free(logits);
    if (st != KDT_OK) {
        fprintf(stderr, "bench_tree_build: %s\n", kdt_last_error());
        return 1;
    }
    return 0;
}

/* Device tree of S streams x M nodes, one allocation. */
static int alloc_tree(kdt_tree *t, void **base, int S, int M) {
    size_t sn = (size_t)S * M, words = sn * KDT_MASK_WORDS(M);
    size_t bytes = words * 8 + sn * 4 * 7 + (size_t)S * 4;
    BENCH_CUDA(cudaMalloc(base, bytes));
    char *q = (char *)*base;
    t->n_streams = S;
    t->max_nodes = M;
    t->anc_mask = (uint64_t *)q; q += words * 8;
    t->score = (float *)q; q += sn * 4;
    t->token = (int32_t *)q; q += sn * 4;
    t->parent = (int32_t *)q; q += sn * 4;
    t->depth = (int32_t *)q; q += sn * 4;
    t->first_child = (int32_t *)q; q += sn * 4;
    t->next_sibling = (int32_t *)q; q += sn * 4;
    t->position = (int32_t *)q; q += sn * 4;
    t->n_nodes = (int32_t *)q;
    return 0;
}

/* One (S, L, B, chain) configuration: build inputs, check once against the CPU, time. */
static int bench_one(const bench_opts *o, const topk_table *tab, int S, int L, int B, int chain,
                     cudaStream_t stream) {
    const int K = B, M = B + 1;
    const size_t lk = (size_t)S * L * K;
    int32_t *h_ids = (int32_t *)malloc(lk * 4), h_budget[S_MAX], h_limit[S_MAX], h_root[S_MAX],
            h_prefix[S_MAX];
    float *h_logp = (float *)malloc(lk * 4);
    if (!h_ids || !h_logp) return 1;
    for (int s = 0; s < S; s++) {
        for (int d = 0; d < L; d++)
            for (int r = 0; r < K; r++) {
                h_ids[((size_t)s * L + d) * K + r] = tab->ids[s][d][r];
                h_logp[((size_t)s * L + d) * K + r] = tab->logp[s][d][r];
            }
        h_budget[s] = B;
        h_limit[s] = L;
        h_root[s] = 7 + s;
        h_prefix[s] = 1000 + 37 * s;
    }
    int32_t *d_in;
    float *d_logp;
    BENCH_CUDA(cudaMalloc((void **)&d_in, lk * 4 + 4 * S_MAX * 4));
    BENCH_CUDA(cudaMalloc((void **)&d_logp, lk * 4));
    BENCH_CUDA(cudaMemcpy(d_in, h_ids, lk * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_logp, h_logp, lk * 4, cudaMemcpyHostToDevice));
    int32_t *d_budget = d_in + lk, *d_limit = d_budget + S_MAX, *d_root = d_limit + S_MAX,
            *d_prefix = d_root + S_MAX;
    BENCH_CUDA(cudaMemcpy(d_budget, h_budget, (size_t)S * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_limit, h_limit, (size_t)S * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_root, h_root, (size_t)S * 4, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d_prefix, h_prefix, (size_t)S * 4, cudaMemcpyHostToDevice));

    tree_ctx c;
    void *tree_mem;
    if (alloc_tree(&c.t, &tree_mem, S, M)) return 1;
    c.p.n_streams = S;
    c.p.max_depth = L;
    c.p.top_k = K;
    c.p.top_ids = d_in;
    c.p.top_logp = d_logp;
    c.p.depth_limit = d_limit;
    c.p.budget = d_budget;
    c.p.root_token = d_root;
    c.p.prefix_len = d_prefix;
    c.p.chain = chain;

    /* correctness spot check: n_nodes and parents against the CPU twin */
    if (run_tree(&c, stream)) return 1;
    BENCH_CUDA(cudaStreamSynchronize(stream));
    size_t sn = (size_t)S * M;
    int32_t *g_par = (int32_t *)malloc(sn * 4), *g_n = (int32_t *)malloc((size_t)S * 4);
    kdt_tree h;
    void *h_mem = malloc(sn * KDT_MASK_WORDS(M) * 8 + sn * 4 * 7 + (size_t)S * 4);
    char *q = (char *)h_mem;
    h.n_streams = S;
    h.max_nodes = M;
    h.anc_mask = (uint64_t *)q; q += sn * KDT_MASK_WORDS(M) * 8;
    h.score = (float *)q; q += sn * 4;
    h.token = (int32_t *)q; q += sn * 4;
    h.parent = (int32_t *)q; q += sn * 4;
    h.depth = (int32_t *)q; q += sn * 4;
    h.first_child = (int32_t *)q; q += sn * 4;
    h.next_sibling = (int32_t *)q; q += sn * 4;
    h.position = (int32_t *)q; q += sn * 4;
    h.n_nodes = (int32_t *)q;
    kdt_tree_build_params hp = c.p;
    hp.top_ids = h_ids;
    hp.top_logp = h_logp;
    hp.depth_limit = h_limit;
    hp.budget = h_budget;
    hp.root_token = h_root;
    hp.prefix_len = h_prefix;
    int ok = kdt_tree_build_cpu(&hp, &h) == KDT_OK;
    BENCH_CUDA(cudaMemcpy(g_par, c.t.parent, sn * 4, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(g_n, c.t.n_nodes, (size_t)S * 4, cudaMemcpyDeviceToHost));
    ok = ok && !memcmp(g_par, h.parent, sn * 4) && !memcmp(g_n, h.n_nodes, (size_t)S * 4);
    free(g_par);
    free(g_n);
    free(h_mem);

    bench_timing t;
    int rc = bench_time(run_tree, &c, stream, 3, o->quick ? 10 : 40, 20, 0, &t);
    if (!rc) {
        printf("%-6s %3d %4d %4d %9.2f %9.2f %9.2f %8.3f  %s\n", chain ? "chain" : "ddtree", L, S, B,
               t.median_us, t.p10_us, t.p90_us, t.median_us / S, ok ? "ok" : "MISMATCH vs CPU");
        if (o->md)
            fprintf(o->md, "| %s | %d | %d | %d | %.2f | %.2f | %.2f | %.3f | %s |\n",
                    chain ? "chain" : "ddtree", L, S, B, t.median_us, t.p10_us, t.p90_us,
                    t.median_us / S, ok ? "ok" : "MISMATCH");
        fflush(stdout);
    }
    cudaFree(d_in);
    cudaFree(d_logp);
    cudaFree(tree_mem);
    free(h_ids);
    free(h_logp);
    return rc || !ok;
}

int bench_tree_build(const bench_opts *o) {
    topk_table *tab = (topk_table *)malloc(sizeof(topk_table));
    if (!tab || make_table(tab)) {
        free(tab);
        return 1;
    }
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreate(&stream));
    printf("K = B; CUDA-graph replay of 20 calls; us per call (and per stream)\n");
    printf("%-6s %3s %4s %4s %9s %9s %9s %8s  %s\n", "mode", "L", "S", "B", "med_us", "p10_us",
           "p90_us", "us/strm", "check");
    if (o->md) {
        fprintf(o->md, "K = B; CUDA-graph replay of 20 calls.\n\n");
        fprintf(o->md, "| mode | L | S | B | median us | p10 us | p90 us | us/stream | check |\n");
        fprintf(o->md, "|---|---:|---:|---:|---:|---:|---:|---:|---|\n");
    }
    const int Ls[2] = {7, 15}, Ss[3] = {1, 8, 64}, Bs[4] = {8, 32, 64, 128};
    int rc = 0;
    /* KDT_BENCH_TB_SHAPE=S,L,B: that ddtree shape alone (for a profiler run) */
    const char *one = getenv("KDT_BENCH_TB_SHAPE");
    int oS, oL, oB;
    if (one && sscanf(one, "%d,%d,%d", &oS, &oL, &oB) == 3 && oS >= 1 && oS <= 64 && oL >= 1 && oL <= 15 &&
        oB >= 1 && oB <= 128) {
        rc = bench_one(o, tab, oS, oL, oB, 0, stream);
        cudaStreamDestroy(stream);
        free(tab);
        return rc;
    }
    for (int li = 0; li < 2 && !rc; li++)
        for (int si = 0; si < 3 && !rc; si++)
            for (int bi = 0; bi < 4 && !rc; bi++) {
                if (o->quick && bi % 2 == 0) continue; /* quick: B 32 and 128 */
                rc = bench_one(o, tab, Ss[si], Ls[li], Bs[bi], 0, stream);
            }
    for (int li = 0; li < 2 && !rc; li++) rc = bench_one(o, tab, 64, Ls[li], 32, 1, stream);
    cudaStreamDestroy(stream);
    free(tab);
    return rc;
}
