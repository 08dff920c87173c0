/* bench_kernels.c - the kernel benchmark: `build/bench_kernels [--only KERNEL] [--quick]
 * [--md FILE]`. KERNEL is one of tree_accept, tree_build, topk, kv_commit, verify_attn, launch (the
 * floor of a chain of dependent launches, plain and with PDL).
 * Prints the card, a measured copy bandwidth (the memory roofline used by the tables), then one
 * table per kernel: CUDA events, warm-up, medians; tiny kernels timed as CUDA-graph replays.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

static int measure_copy_bandwidth(int quick) {
    size_t bytes = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    BENCH_CUDA(cudaMalloc(&a, bytes));
    BENCH_CUDA(cudaMalloc(&b, bytes));
    BENCH_CUDA(cudaMemset(a, 0x5a, bytes));
    cudaEvent_t e0, e1;
    BENCH_CUDA(cudaEventCreate(&e0));
    BENCH_CUDA(cudaEventCreate(&e1));
    float best_ms = 1e30f, ms;
    float samples[32];
    int n = quick ? 5 : 21;
    for (int i = 0; i < n + 2; i++) {
        BENCH_CUDA(cudaEventRecord(e0, 0));
        BENCH_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        BENCH_CUDA(cudaEventRecord(e1, 0));
        BENCH_CUDA(cudaEventSynchronize(e1));
        BENCH_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 2) samples[i - 2] = ms;
        if (ms < best_ms) best_ms = ms;
    }
    /* median by insertion sort */
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && samples[j] < samples[j - 1]; j--) {
            float t = samples[j]; samples[j] = samples[j - 1]; samples[j - 1] = t;
        }
    g_bench_device.copy_gbps = 2.0 * (double)bytes / (samples[n / 2] * 1e-3) / 1e9;
    cudaFree(a);
    cudaFree(b);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* rows show as they finish, also piped under a timeout */
    bench_opts o = {0, NULL, NULL};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) o.quick = 1;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) o.only = argv[++i];
        else if (!strcmp(argv[i], "--md") && i + 1 < argc) {
            o.md = fopen(argv[++i], "w");
            if (!o.md) { perror(argv[i]); return 2; }
        } else {
            fprintf(stderr, "usage: %s [--only tree_accept|tree_build|topk|kv_commit|verify_attn|launch] "
                            "[--quick] [--md FILE]\n", argv[0]);
            return 2;
        }
    }
    static const struct { const char *name; int (*fn)(const bench_opts *); } sections[] = {
        {"tree_accept", bench_tree_accept}, {"tree_build", bench_tree_build},
        {"topk", bench_topk},               {"kv_commit", bench_kv_commit},
        {"verify_attn", bench_verify_attn}, {"launch", bench_launch},
    };
    const int n_sections = (int)(sizeof sections / sizeof sections[0]);
    if (o.only) {
        int found = 0;
        for (int i = 0; i < n_sections; i++) found |= !strcmp(o.only, sections[i].name);
        if (!found) { fprintf(stderr, "bench_kernels: unknown kernel '%s'\n", o.only); return 2; }
    }
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
        fprintf(stderr, "bench_kernels: no CUDA device\n");
        return 1;
    }
    snprintf(g_bench_device.name, sizeof g_bench_device.name, "%s", prop.name);
    g_bench_device.sm_count = prop.multiProcessorCount;
    g_bench_device.l2_bytes = (size_t)prop.l2CacheSize;
    if (measure_copy_bandwidth(o.quick)) return 1;
    printf("device: %s, sm_%d%d, %d SMs, L2 %zu MiB, measured D2D copy %.0f GB/s (read+write)\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount,
           g_bench_device.l2_bytes >> 20, g_bench_device.copy_gbps);
    if (o.md)
        fprintf(o.md, "device: %s, %d SMs, measured copy %.0f GB/s\n\n", prop.name,
                prop.multiProcessorCount, g_bench_device.copy_gbps);
    int rc = 0;
    for (int i = 0; i < n_sections; i++) {
        if (o.only && strcmp(o.only, sections[i].name)) continue;
        printf("\n== %s ==\n", sections[i].name);
        if (o.md) fprintf(o.md, "\n### %s\n\n", sections[i].name);
        fflush(stdout);
        if (sections[i].fn(&o)) {
            fprintf(stderr, "bench_kernels: %s failed\n", sections[i].name);
            rc = 1;
        }
    }
    if (o.md) fclose(o.md);
    return rc;
}
