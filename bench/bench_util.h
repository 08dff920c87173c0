/* bench_util.h - shared timing for bench_kernels: CUDA events, warm-up, medians, CUDA-graph
 * replay for tiny kernels, optional L2 flush for large ones (device METHOD: never time zeros,
 * never time a cache-resident repeat of a big problem).
 *
 * Each kernel's benchmark is one function bench_<kernel>(opts) in bench/bench_<kernel>.c that
 * prints its own table to stdout and appends the same rows to opts->md (markdown) when set.
 */
#ifndef KDT_BENCH_UTIL_H
#define KDT_BENCH_UTIL_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdint.h>

typedef struct bench_opts {
    int quick;          /* fewer shapes and samples (smoke run) */
    const char *only;   /* run only this kernel's section, or NULL */
    FILE *md;           /* markdown copy of every table, or NULL */
} bench_opts;

/* One call of the kernel under test, enqueued on stream; returns 0 or prints and returns != 0. */
typedef int (*bench_fn)(void *ctx, cudaStream_t stream);

typedef struct bench_timing {
    double median_us;   /* per call */
    double p10_us, p90_us;
} bench_timing;

/* Times fn: `warmup` untimed calls, then `samples` timed samples. graph_batch > 0 captures that
 * many back-to-back calls in one CUDA graph and times replays (per-call time = replay /
 * graph_batch): use it for kernels of a few microseconds. flush_l2 reads a buffer twice the L2
 * size before each sample, outside the timed region (reads: a memset would leave dirty lines
 * whose write-back lands inside the timed region). Returns 0 on success. */
int bench_time(bench_fn fn, void *ctx, cudaStream_t stream, int warmup, int samples,
               int graph_batch, int flush_l2, bench_timing *out);

/* Aborts the whole benchmark with a message if a CUDA call failed. */
#define BENCH_CUDA(call)                                                                     \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

/* Random fills on the host (never zeros). */
void bench_fill_normal_bf16(uint16_t *dst, size_t n, uint64_t seed, float scale);
void bench_fill_normal_f32(float *dst, size_t n, uint64_t seed, float scale);

/* Measured device facts for roofline columns (filled once by bench_kernels main). */
typedef struct bench_device {
    char name[256];
    int sm_count;
    size_t l2_bytes;
    double copy_gbps;   /* measured device-to-device copy, bytes read + written per second / 1e9 */
} bench_device;
extern bench_device g_bench_device;

int bench_topk(const bench_opts *o);
int bench_tree_build(const bench_opts *o);
int bench_tree_accept(const bench_opts *o);
int bench_kv_commit(const bench_opts *o);
int bench_verify_attn(const bench_opts *o);
int bench_launch(const bench_opts *o);

#endif
