/* bench_launch.cu - the floor of a chain of dependent kernels, the shape of the GPU forward's
 * decode step (~17 launches per layer, each reading its predecessor's output): a CUDA graph of
 * CHAIN kernels, timed as a replay, per kernel. Two kinds of kernel, each launched plainly and
 * with programmatic dependent launch (PDL: griddepcontrol.wait, then launch_dependents, as the
 * forward's row kernels do; sm_90+ only):
 *   empty  every thread waits, thread 0 of CTA 0 writes one word;
 *   row    a row kernel's work: 28 CTAs x 256 threads, each thread reads one float of the
 *          previous kernel's 7168-float output and writes one (a decode row of Kimi's hidden).
 * Grids of 1, 132 and 528 CTAs for the empty kernel. No inputs to randomise: the row kernel moves
 * a random-filled buffer, and nothing here is compared with a result, only timed.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "bench_util.h"
}
#include "kernels/cuda/pdl.cuh"

namespace {
constexpr int CHAIN = 16, ROW = 7168;

__global__ void k_empty(unsigned *sink, int pdl_on) {
    if (pdl_on) {
        pdl::wait();
        pdl::launch_dependents();
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *sink += 1;
}
__global__ void k_row(const float *in, float *out, int n, int pdl_on) {
    if (pdl_on) {
        pdl::wait();
        pdl::launch_dependents();
    }
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = in[i] * 1.0001f + 1.0f;
}

struct ChainCtx {
    int kind;     /* 0 empty, 1 row */
    int grid, pdl;
    unsigned *sink;
    float *a, *b;
};

int run_chain(void *vctx, cudaStream_t s) {
    const ChainCtx *c = (const ChainCtx *)vctx;
    for (int i = 0; i < CHAIN; i++) {
        if (c->kind == 0)
            pdl::launch(k_empty, dim3(c->grid), dim3(256), 0, s, c->pdl != 0, c->sink, c->pdl);
        else
            pdl::launch(k_row, dim3((ROW + 255) / 256), dim3(256), 0, s, c->pdl != 0, (const float *)(i & 1 ? c->b : c->a),
                        i & 1 ? c->a : c->b, ROW, c->pdl);
    }
    return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
} // namespace

extern "C" int bench_launch(const bench_opts *o) {
    cudaStream_t s;
    BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    ChainCtx c = {};
    BENCH_CUDA(cudaMalloc(&c.sink, sizeof(unsigned)));
    BENCH_CUDA(cudaMalloc(&c.a, ROW * sizeof(float)));
    BENCH_CUDA(cudaMalloc(&c.b, ROW * sizeof(float)));
    float *h = (float *)malloc(ROW * sizeof(float));
    if (!h) return 1;
    bench_fill_normal_f32(h, ROW, 99, 1.0f);
    BENCH_CUDA(cudaMemcpy(c.a, h, ROW * sizeof(float), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemset(c.sink, 0, sizeof(unsigned)));
    free(h);
    const int pdl_ok = pdl::usable(k_empty, "KDT_BENCH_NO_PDL");
    printf("a graph of %d dependent kernels, replayed; us per kernel (median of replays)%s\n", CHAIN,
           pdl_ok ? "" : " (no PDL on this device / build)");
    printf("%-6s %6s %12s %12s\n", "kernel", "CTAs", "plain us", "PDL us");
    if (o->md)
        fprintf(o->md, "| kernel | CTAs | plain us per kernel | PDL us per kernel |\n|---|---|---|---|\n");
    const int samples = o->quick ? 10 : 30;
    const struct { int kind, grid; } cases[] = {{0, 1}, {0, 132}, {0, 528}, {1, (ROW + 255) / 256}};
    for (unsigned i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        double us[2] = {-1, -1}; /* -1: not run (no PDL here) */
        for (int p = 0; p < 2; p++) {
            if (p && !pdl_ok) break;
            c.kind = cases[i].kind;
            c.grid = cases[i].grid;
            c.pdl = p;
            bench_timing t;
            if (bench_time(run_chain, &c, s, 3, samples, 4, 0, &t)) return 1;
            us[p] = t.median_us / CHAIN;
        }
        const char *name = cases[i].kind ? "row" : "empty";
        char pdl_us[32] = "-";
        if (us[1] >= 0) snprintf(pdl_us, sizeof pdl_us, "%.2f", us[1]);
        printf("%-6s %6d %12.2f %12s\n", name, cases[i].grid, us[0], pdl_us);
        if (o->md) fprintf(o->md, "| %s | %d | %.2f | %s |\n", name, cases[i].grid, us[0], pdl_us);
    }
    cudaFree(c.sink);
    cudaFree(c.a);
    cudaFree(c.b);
    cudaStreamDestroy(s);
    return 0;
}
