/* bench_topk.c - log-softmax + top-K over Kimi's vocabulary (V = 163,840, bf16 logits) for
 * R = 1, 8 and 64 streams x 7 positions, K = 8 / 32 / 64 / 256. The logits are far larger than
 * L2 only at R = 448, so L2 is flushed before every timed call (graph of one call). GB/s = bytes
 * of logits read / time, and its share of the measured device copy bandwidth. Without --quick it
 * also sweeps the number of chunks each row is split into (R = 448 and 56, K = 32) and times an
 * fp32 case. */
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kdtree/kernels.h"

/* Bench/test hook of cuda/topk.cu: forces fewer chunks per row (0 = automatic). */
extern int kdt_topk_bench_chunks;

typedef struct topk_ctx {
    kdt_topk_params p;
} topk_ctx;

static int run_topk(void *ctx, cudaStream_t stream) {
    topk_ctx *c = (topk_ctx *)ctx;
    kdt_status st = kdt_topk_logsoftmax_cuda(&c->p, stream);
    if (st != KDT_OK) {
        fprintf(stderr, "topk: %s\n", kdt_last_error());
        return 1;
    }
    return 0;
}

/* Fills [rows][V] from a pool of random values at pseudo-random offsets (fast, never zeros). */
static void fill_rows(void *dst, size_t elem, int rows, int V, const void *pool, size_t pool_n) {
    uint64_t s = 12345;
    for (int r = 0; r < rows; r++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        size_t off = (size_t)(s >> 33) % (pool_n - (size_t)V);
        memcpy((char *)dst + (size_t)r * V * elem, (const char *)pool + off * elem, (size_t)V * elem);
    }
}

/* Times one configuration and prints a row. */
static int bench_one(const bench_opts *o, const void *d_logits, kdt_dtype dt, int R, int V, int K,
                     int chunks, int32_t *d_ids, float *d_logp, cudaStream_t stream) {
    topk_ctx c;
    memset(&c, 0, sizeof c);
    c.p.n_rows = R;
    c.p.vocab = V;
    c.p.k = K;
    c.p.dtype = dt;
    c.p.logits = d_logits;
    c.p.row_stride = V;
    c.p.top_ids = d_ids;
    c.p.top_logp = d_logp;
    c.p.workspace_bytes = kdt_topk_workspace_bytes(R, V, K);
    if (c.p.workspace_bytes) BENCH_CUDA(cudaMalloc(&c.p.workspace, c.p.workspace_bytes));
    kdt_topk_bench_chunks = chunks;
    bench_timing t;
    int rc = bench_time(run_topk, &c, stream, 3, o->quick ? 10 : 30, 1, 1, &t);
    kdt_topk_bench_chunks = 0;
    if (c.p.workspace) cudaFree(c.p.workspace);
    if (rc) return rc;
    double bytes = (double)R * V * (dt == KDT_BF16 ? 2 : 4);
    double gbps = bytes / (t.median_us * 1e-6) / 1e9;
    double pct = g_bench_device.copy_gbps > 0 ? 100.0 * gbps / g_bench_device.copy_gbps : 0;
    char split[16];
    if (chunks) snprintf(split, sizeof split, "%d", chunks);
    else snprintf(split, sizeof split, "auto");
    printf("%-5s %5d %7d %5d %6s %9.2f %9.2f %9.2f %8.0f %7.1f%%\n", dt == KDT_BF16 ? "bf16" : "f32",
           R, V, K, split, t.median_us, t.p10_us, t.p90_us, gbps, pct);
    if (o->md)
        fprintf(o->md, "| %s | %d | %d | %d | %s | %.2f | %.2f | %.2f | %.0f | %.1f%% |\n",
                dt == KDT_BF16 ? "bf16" : "f32", R, V, K, split, t.median_us, t.p10_us, t.p90_us,
                gbps, pct);
    fflush(stdout);
    return 0;
}

int bench_topk(const bench_opts *o) {
    const int V = 163840, R_max = 448, K_max = 256;
    const int Rs[3] = {7, 56, 448}, Ks[4] = {8, 32, 64, 256};
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreate(&stream));
    /* bf16 logits for the largest R, and an fp32 copy of 56 rows */
    const size_t pool_n = (size_t)1 << 22;
    uint16_t *pool16 = (uint16_t *)malloc(pool_n * 2);
    float *pool32 = (float *)malloc(pool_n * 4);
    uint16_t *h16 = (uint16_t *)malloc((size_t)R_max * V * 2);
    float *h32 = (float *)malloc((size_t)56 * V * 4);
    if (!pool16 || !pool32 || !h16 || !h32) {
        fprintf(stderr, "bench_topk: out of host memory\n");
        return 1;
    }
    bench_fill_normal_bf16(pool16, pool_n, 7, 2.5f);
    bench_fill_normal_f32(pool32, pool_n, 8, 2.5f);
    fill_rows(h16, 2, R_max, V, pool16, pool_n);
    fill_rows(h32, 4, 56, V, pool32, pool_n);
    void *d16, *d32;
    int32_t *d_ids;
    float *d_logp;
    BENCH_CUDA(cudaMalloc(&d16, (size_t)R_max * V * 2));
    BENCH_CUDA(cudaMalloc(&d32, (size_t)56 * V * 4));
    BENCH_CUDA(cudaMalloc((void **)&d_ids, sizeof(int32_t) * R_max * K_max));
    BENCH_CUDA(cudaMalloc((void **)&d_logp, sizeof(float) * R_max * K_max));
    BENCH_CUDA(cudaMemcpy(d16, h16, (size_t)R_max * V * 2, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(d32, h32, (size_t)56 * V * 4, cudaMemcpyHostToDevice));

    printf("L2 flushed before each call; GB/s = logits bytes read / time; %% of the measured "
           "copy bandwidth (%.0f GB/s)\n", g_bench_device.copy_gbps);
    printf("%-5s %5s %7s %5s %6s %9s %9s %9s %8s %8s\n", "dtype", "R", "V", "K", "chunks",
           "med_us", "p10_us", "p90_us", "GB/s", "%copy");
    if (o->md) {
        fprintf(o->md, "L2 flushed before each call; GB/s = logits bytes read / time.\n\n");
        fprintf(o->md, "| dtype | R | V | K | chunks | median us | p10 us | p90 us | GB/s | %% of copy |\n");
        fprintf(o->md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    }
    int rc = 0;
    /* KDT_BENCH_TOPK_SHAPE=R,K: that bf16 shape alone (for a profiler run) */
    const char *one = getenv("KDT_BENCH_TOPK_SHAPE");
    int oR, oK;
    if (one && sscanf(one, "%d,%d", &oR, &oK) == 2 && oR >= 1 && oR <= R_max && oK >= 1 && oK <= K_max) {
        rc = bench_one(o, d16, KDT_BF16, oR, V, oK, 0, d_ids, d_logp, stream);
        goto done;
    }
    for (int ri = 0; ri < 3 && !rc; ri++)
        for (int ki = 0; ki < 4 && !rc; ki++)
            rc = bench_one(o, d16, KDT_BF16, Rs[ri], V, Ks[ki], 0, d_ids, d_logp, stream);
    if (!o->quick && !rc) {
        const int sweep[4] = {1, 2, 3, 8};
        for (int i = 0; i < 4 && !rc; i++)
            rc = bench_one(o, d16, KDT_BF16, 448, V, 32, sweep[i], d_ids, d_logp, stream);
        for (int i = 0; i < 4 && !rc; i++)
            rc = bench_one(o, d16, KDT_BF16, 56, V, 32, sweep[i] * 2, d_ids, d_logp, stream);
        if (!rc) rc = bench_one(o, d32, KDT_F32, 56, V, 32, 0, d_ids, d_logp, stream);
    }
done:
    cudaFree(d16);
    cudaFree(d32);
    cudaFree(d_ids);
    cudaFree(d_logp);
    cudaStreamDestroy(stream);
    free(pool16);
    free(pool32);
    free(h16);
    free(h32);
    return rc;
}
