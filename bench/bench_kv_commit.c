/* bench_kv_commit.c - KV commit timing: us per call and GB/s for S {1, 8, 64} streams x 61
 * layers x tau {1, 4, 8}, rows of 1152 B (576 bf16: MLA latent + rope key), pages of 64 slots
 * placed by a random permutation (non-contiguous). Path [0, 2, 3, 5, 8, ...]: tau - 1 rows
 * move per stream and layer; tau = 1 is the no-op fast path (nothing moves). Two timings:
 * "warm" = CUDA-graph replay of 50 back-to-back calls (rows L2-resident after the first), and
 * "cold" = one call per graph replay after an L2 flush. GB/s counts bytes read + written by the
 * moved rows; %copy compares with the measured device-to-device copy bandwidth.
 */
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kdtree/kernels.h"

typedef struct commit_ctx {
    kdt_kv_commit_params p;
} commit_ctx;

static int run_commit(void *ctx, cudaStream_t stream) {
    kdt_status st = kdt_kv_commit_cuda(&((commit_ctx *)ctx)->p, stream);
    if (st != KDT_OK) {
        fprintf(stderr, "kv_commit: %s\n", kdt_last_error());
        return 1;
    }
    return 0;
}

int bench_kv_commit(const bench_opts *o) {
    const int streams[] = {1, 8, 64}, taus[] = {1, 4, 8};
    const int n_layers = 61, row_bytes = 1152, page_size = 64, max_pages = 4;
    const int32_t path[KDT_MAX_PATH] = {0, 2, 3, 5, 8, 9, 12, 14, 15, 17, 20, 22, 23, 25, 28, 30, 31};
    const int samples = o->quick ? 10 : 40;
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    printf("%4s %6s %4s %10s %10s %9s %10s %9s %7s\n", "S", "layers", "tau", "MB moved",
           "warm us", "warm GB/s", "cold us", "cold GB/s", "%copy");
    if (o->md)
        fprintf(o->md, "| S | layers | tau | MB moved | warm us | warm GB/s | cold us | cold GB/s | %% copy |\n"
                       "|---|---|---|---|---|---|---|---|---|\n");
    int rc = 0;
    for (int si = 0; si < 3; si++) {
        const int S = streams[si], n_pages = S * max_pages + 1;
        const int64_t layer_bytes = (int64_t)n_pages * page_size * row_bytes;
        void *cache = NULL;
        BENCH_CUDA(cudaMalloc(&cache, (size_t)(layer_bytes * n_layers)));
        BENCH_CUDA(cudaMemset(cache, 0x5a, (size_t)(layer_bytes * n_layers))); /* not zeros */
        /* host tables: block_table [S][max_pages] (a permutation of the pages), prefix [S],
         * accepted [S][P], tau [S] */
        const size_t n_i32 = (size_t)S * max_pages + (size_t)S * (KDT_MAX_PATH + 2);
        int32_t *h = (int32_t *)malloc(sizeof(int32_t) * n_i32);
        int32_t *perm = (int32_t *)malloc(sizeof(int32_t) * (size_t)n_pages);
        if (!h || !perm) return 1;
        uint64_t rng = 12345;
        for (int i = 0; i < n_pages; i++) perm[i] = i;
        for (int i = n_pages - 1; i > 0; i--) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            int j = (int)((rng >> 33) % (uint64_t)(i + 1)), t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        int32_t *table = h, *prefix = h + (size_t)S * max_pages, *acc = prefix + S,
                *tau = acc + (size_t)S * KDT_MAX_PATH;
        memcpy(table, perm, sizeof(int32_t) * (size_t)S * max_pages);
        for (int s = 0; s < S; s++) {
            prefix[s] = 100 + (s * 37) % 60; /* the tree straddles pages 1 and 2 */
            memcpy(acc + (size_t)s * KDT_MAX_PATH, path, sizeof path);
        }
        int32_t *d = NULL;
        BENCH_CUDA(cudaMalloc((void **)&d, sizeof(int32_t) * n_i32));
        for (int ti = 0; ti < 3; ti++) {
            for (int s = 0; s < S; s++) tau[s] = taus[ti];
            BENCH_CUDA(cudaMemcpy(d, h, sizeof(int32_t) * n_i32, cudaMemcpyHostToDevice));
            commit_ctx ctx;
            ctx.p = (kdt_kv_commit_params){S, n_layers, row_bytes, page_size, n_pages, cache,
                                           layer_bytes, d, max_pages, d + (size_t)S * max_pages,
                                           d + (size_t)S * max_pages + S,
                                           d + (size_t)S * max_pages + S + (size_t)S * KDT_MAX_PATH};
            bench_timing warm, cold;
            if (bench_time(run_commit, &ctx, stream, 5, samples, 50, 0, &warm) ||
                bench_time(run_commit, &ctx, stream, 2, samples, 1, 1, &cold)) {
                rc = 1;
                continue;
            }
            const double bytes = 2.0 * S * n_layers * (taus[ti] - 1) * (double)row_bytes;
            const double warm_gbs = bytes / (warm.median_us * 1e3), cold_gbs = bytes / (cold.median_us * 1e3);
            const double pct = g_bench_device.copy_gbps > 0 ? 100.0 * cold_gbs / g_bench_device.copy_gbps : 0;
            printf("%4d %6d %4d %10.2f %10.2f %9.0f %10.2f %9.0f %6.0f%%\n", S, n_layers, taus[ti],
                   bytes / 1e6, warm.median_us, warm_gbs, cold.median_us, cold_gbs, pct);
            if (o->md)
                fprintf(o->md, "| %d | %d | %d | %.2f | %.2f | %.0f | %.2f | %.0f | %.0f%% |\n", S,
                        n_layers, taus[ti], bytes / 1e6, warm.median_us, warm_gbs, cold.median_us,
                        cold_gbs, pct);
        }
        free(h);
        free(perm);
        cudaFree(d);
        cudaFree(cache);
    }
    cudaStreamDestroy(stream);
    return rc;
}
