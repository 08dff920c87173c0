/* bench_util.c - timing helpers for bench_kernels (see bench_util.h). */
#include "bench_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp.h"

/* bench_flush.cu */
int bench_flush_l2_read(const void *buf, size_t bytes, unsigned *sink, cudaStream_t s, int n_sm);

bench_device g_bench_device;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int bench_time(bench_fn fn, void *ctx, cudaStream_t stream, int warmup, int samples,
               int graph_batch, int flush_l2, bench_timing *out) {
    void *flush = NULL;
    size_t flush_bytes = 0;
    if (flush_l2) {
        flush_bytes = 2 * (g_bench_device.l2_bytes ? g_bench_device.l2_bytes : (64u << 20));
        BENCH_CUDA(cudaMalloc(&flush, flush_bytes));
        BENCH_CUDA(cudaMemset(flush, 1, flush_bytes)); /* defined contents, written once */
    }
    cudaGraphExec_t exec = NULL;
    cudaGraph_t graph = NULL;
    for (int i = 0; i < warmup; i++)
        if (fn(ctx, stream)) return 1;
    BENCH_CUDA(cudaStreamSynchronize(stream));
    if (graph_batch > 0) {
        BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < graph_batch; i++)
            if (fn(ctx, stream)) {
                cudaStreamEndCapture(stream, &graph);
                return 1;
            }
        BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
        BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        BENCH_CUDA(cudaGraphLaunch(exec, stream)); /* warm the graph itself */
        BENCH_CUDA(cudaStreamSynchronize(stream));
    }
    cudaEvent_t a, b;
    BENCH_CUDA(cudaEventCreate(&a));
    BENCH_CUDA(cudaEventCreate(&b));
    double *t = (double *)malloc(sizeof(double) * (size_t)samples);
    if (!t) return 1;
    for (int i = 0; i < samples; i++) {
        if (flush && bench_flush_l2_read(flush, flush_bytes - 64, (unsigned *)((char *)flush + flush_bytes - 64), stream,
                                         g_bench_device.sm_count ? g_bench_device.sm_count : 132))
            return 1;
        BENCH_CUDA(cudaEventRecord(a, stream));
        if (exec) {
            BENCH_CUDA(cudaGraphLaunch(exec, stream));
        } else if (fn(ctx, stream)) {
            free(t);
            return 1;
        }
        BENCH_CUDA(cudaEventRecord(b, stream));
        BENCH_CUDA(cudaEventSynchronize(b));
        float ms = 0;
        BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
        t[i] = ms * 1000.0 / (exec ? graph_batch : 1);
    }
    BENCH_CUDA(cudaGetLastError());
    qsort(t, (size_t)samples, sizeof(double), cmp_double);
    out->median_us = t[samples / 2];
    out->p10_us = t[samples / 10];
    out->p90_us = t[(samples * 9) / 10];
    free(t);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    if (flush) cudaFree(flush);
    return 0;
}

static uint64_t mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float normal(uint64_t *s) {
    double u1 = ((mix(s) >> 11) + 1) * (1.0 / 9007199254740993.0);
    double u2 = (mix(s) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void bench_fill_normal_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale) {
    for (size_t i = 0; i < n; i++) dst[i] = kdt_f32_to_bf16(scale * normal(&seed));
}

void bench_fill_normal_f32(float *dst, size_t n, uint64_t seed, float scale) {
    for (size_t i = 0; i < n; i++) dst[i] = scale * normal(&seed);
}
