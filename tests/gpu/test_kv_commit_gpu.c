/* test_kv_commit_gpu.c - kdt_kv_commit_cuda against the CPU twin, byte for byte over the whole
 * cache: random paths / prefixes / permuted block tables / row widths (1152 and widths that
 * force the 8-, 4- and 2-byte paths, plus misaligned cache pointers), 1..61 layers, S 1..64,
 * the overlap cases [0,2,3] and [0,1,5,9], no-op paths and bad streams mixed in (the GPU must
 * leave them untouched, as the CPU does). The cache is filled with random non-zero bytes, so
 * any row written wrongly or not at all shows. KDT_TEST_QUICK=1 runs fewer cases. Exits
 * non-zero with a message when no GPU is present.
 */
#include <cuda_runtime_api.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree/kernels.h"
#include "t.h"

#define P KDT_MAX_PATH

#include "gpu_test_util.h"

typedef struct shape {
    int S, n_layers, row_bytes, page_size, max_pages, misalign; /* misalign: bytes added to the
                                                                   cache pointer (even) */
} shape;

/* Random paths for every stream (some no-op, some bad when with_bad), then CPU vs CUDA. */
static void run_case(const shape *sh, uint64_t *rng, int with_bad, const int32_t *fixed_paths,
                     const int *fixed_tau, const char *what) {
    const int S = sh->S, page_size = sh->page_size, max_pages = sh->max_pages;
    const int n_pages = S * max_pages + 1;
    const int64_t layer_bytes = (int64_t)n_pages * page_size * sh->row_bytes;
    const int64_t stride = layer_bytes + 2 * t_rand_int(rng, 3) * (sh->misalign ? 1 : 8);
    const int64_t cache_bytes = (int64_t)(sh->n_layers - 1) * stride + layer_bytes;
    unsigned char *host = (unsigned char *)xmalloc((size_t)cache_bytes);
    for (int64_t i = 0; i < cache_bytes; i += 8) {
        uint64_t r = t_rand_u64(rng) | 0x0101010101010101ull; /* no zero byte */
        memcpy(host + i, &r, (size_t)(cache_bytes - i < 8 ? cache_bytes - i : 8));
    }
    int32_t *table = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S * max_pages);
    int32_t *perm = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)n_pages);
    for (int i = 0; i < n_pages; i++) perm[i] = i;
    for (int i = n_pages - 1; i > 0; i--) {
        int j = t_rand_int(rng, i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    memcpy(table, perm, sizeof(int32_t) * (size_t)S * max_pages);
    int32_t *prefix = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S);
    int32_t *tau = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S);
    int32_t *acc = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S * P);
    const int slots = max_pages * page_size;
    for (int s = 0; s < S; s++) {
        int32_t *a = acc + (size_t)s * P;
        for (int k = 0; k < P; k++) a[k] = -9;
        int t = t_rand_int(rng, P + 1), style = t_rand_int(rng, 4);
        if (fixed_paths) {
            t = fixed_tau[s];
            memcpy(a, fixed_paths + (size_t)s * P, sizeof(int32_t) * (size_t)t);
        } else {
            a[0] = 0;
            for (int k = 1; k < t; k++)
                a[k] = a[k - 1] + 1 + (style == 0 ? 0 : t_rand_int(rng, style == 1 ? 2 : 9));
        }
        while (t > 0 && a[t - 1] >= slots) t--; /* keep the part that fits the table */
        tau[s] = t;
        prefix[s] = t > 0 ? t_rand_int(rng, slots - a[t - 1]) : t_rand_int(rng, 5);
        if (with_bad && t > 1 && t_rand_int(rng, 4) == 0) {
            switch (t_rand_int(rng, 7)) {
            case 0: tau[s] = t_rand_int(rng, 2) ? -1 : P + 1 + t_rand_int(rng, 100); break;
            case 1: a[0] = 1; break;
            case 2: a[t - 1] = a[t - 2]; break;
            case 3: prefix[s] = -1 - t_rand_int(rng, 5); break;
            case 4: prefix[s] = slots - a[t - 1] + t_rand_int(rng, 3); break;
            case 5: table[(size_t)s * max_pages + (prefix[s] + a[t - 1]) / page_size] = -1; break;
            default: table[(size_t)s * max_pages + (prefix[s] + 1) / page_size] = n_pages; break;
            }
        }
    }
    /* device copies; the cache pointer is offset by misalign bytes */
    unsigned char *d_base = NULL;
    CUDA_OK(cudaMalloc((void **)&d_base, (size_t)cache_bytes + 16));
    unsigned char *d_cache = d_base + sh->misalign;
    CUDA_OK(cudaMemcpy(d_cache, host, (size_t)cache_bytes, cudaMemcpyHostToDevice));
    int32_t *d_table = (int32_t *)dev_copy(table, sizeof(int32_t) * (size_t)S * max_pages);
    int32_t *d_prefix = (int32_t *)dev_copy(prefix, sizeof(int32_t) * (size_t)S);
    int32_t *d_tau = (int32_t *)dev_copy(tau, sizeof(int32_t) * (size_t)S);
    int32_t *d_acc = (int32_t *)dev_copy(acc, sizeof(int32_t) * (size_t)S * P);

    kdt_kv_commit_params hp = {S, sh->n_layers, sh->row_bytes, page_size, n_pages, host, stride,
                               table, max_pages, prefix, acc, tau};
    kdt_status cst = kdt_kv_commit_cpu(&hp);
    CHECK_MSG(cst == KDT_OK || (with_bad && cst == KDT_ERR_INVALID_ARG), "%s: cpu %s (%s)", what,
              kdt_status_name(cst), kdt_last_error());
    kdt_kv_commit_params dp = hp;
    dp.cache = d_cache;
    dp.block_table = d_table;
    dp.prefix_len = d_prefix;
    dp.accepted = d_acc;
    dp.tau = d_tau;
    kdt_status gst = kdt_kv_commit_cuda(&dp, NULL);
    CHECK_MSG(gst == KDT_OK, "%s: cuda %s (%s)", what, kdt_status_name(gst), kdt_last_error());
    CUDA_OK(cudaDeviceSynchronize());
    unsigned char *got = (unsigned char *)xmalloc((size_t)cache_bytes);
    CUDA_OK(cudaMemcpy(got, d_cache, (size_t)cache_bytes, cudaMemcpyDeviceToHost));
    int64_t first_bad = -1;
    for (int64_t i = 0; i < cache_bytes && first_bad < 0; i++)
        if (got[i] != host[i]) first_bad = i;
    CHECK_MSG(first_bad < 0, "%s: cache differs at byte %lld (layer %lld)", what,
              (long long)first_bad, (long long)(first_bad / stride));
    cudaFree(d_base); cudaFree(d_table); cudaFree(d_prefix); cudaFree(d_tau); cudaFree(d_acc);
    free(host); free(got); free(table); free(perm); free(prefix); free(tau); free(acc);
}

static int quick(void) { return getenv("KDT_TEST_QUICK") != NULL; }

static void test_overlap_paths(void) {
    uint64_t rng = 1;
    const shape sh = {4, 61, 1152, 64, 3, 0};
    int32_t paths[4 * P] = {0};
    const int32_t p0[3] = {0, 2, 3}, p1[4] = {0, 1, 5, 9}, p2[5] = {0, 1, 2, 3, 4};
    int taus[4] = {3, 4, 5, P};
    memcpy(paths, p0, sizeof p0);
    memcpy(paths + P, p1, sizeof p1);
    memcpy(paths + 2 * P, p2, sizeof p2); /* no-op */
    for (int k = 0; k < P; k++) paths[3 * P + k] = k == 0 ? 0 : paths[3 * P + k - 1] + 1 + k % 4;
    run_case(&sh, &rng, 0, paths, taus, "overlap paths");
}

static void test_random_shapes(void) {
    uint64_t rng = 0xc0ffee;
    const int rows[] = {1152, 1152, 1152, 1154, 1160, 1156, 40, 16, 6, 2};
    const int iters = quick() ? 8 : 150;
    for (int it = 0; it < iters; it++) {
        shape sh;
        sh.S = it % 10 == 0 ? 64 : 1 + t_rand_int(&rng, 64);
        sh.n_layers = it % 25 == 0 ? 61 : 1 + t_rand_int(&rng, 5);
        sh.row_bytes = rows[t_rand_int(&rng, 10)];
        sh.page_size = 1 << t_rand_int(&rng, 7);
        sh.max_pages = 1 + t_rand_int(&rng, 4) + (sh.page_size < 8 ? 8 : 0);
        if (sh.n_layers > 8 && sh.page_size > 16) sh.page_size = 16; /* cache <= ~300 MB */
        sh.misalign = t_rand_int(&rng, 4) == 0 ? 2 * t_rand_int(&rng, 8) : 0;
        char what[128];
        snprintf(what, sizeof what, "iter %d S %d layers %d row %d page %d pages %d misalign %d", it,
                 sh.S, sh.n_layers, sh.row_bytes, sh.page_size, sh.max_pages, sh.misalign);
        run_case(&sh, &rng, it % 2, NULL, NULL, what);
    }
}

static void test_argument_errors(void) {
    int32_t *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, 1024));
    kdt_kv_commit_params p = {1, 1, 16, 4, 2, d, 2 * 4 * 16, d, 1, d, d, d};
    CHECK_EQ_INT(kdt_kv_commit_cuda(NULL, NULL), KDT_ERR_INVALID_ARG);
    p.row_bytes = 15;
    CHECK_EQ_INT(kdt_kv_commit_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    CHECK(strstr(kdt_last_error(), "row_bytes") != NULL);
    p.row_bytes = 16;
    p.layer_stride_bytes = 8;
    CHECK_EQ_INT(kdt_kv_commit_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    p.layer_stride_bytes = 128;
    p.tau = NULL;
    CHECK_EQ_INT(kdt_kv_commit_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(d);
}

int main(void) {
    if (!gpu_test_have_device("test_kv_commit_gpu")) return 1;
    T_RUN(test_overlap_paths);
    T_RUN(test_random_shapes);
    T_RUN(test_argument_errors);
    return t_summary();
}
