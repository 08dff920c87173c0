/* common.h - internal helpers every subsystem uses: error reporting and argument checks.
 *
 * kdt_fail() records a printf-style message as this thread's last error and returns the status,
 * so a check reads `if (n < 1) return kdt_fail(KDT_ERR_INVALID_ARG, "tree_build: n_streams = %d", n);`.
 */
#ifndef KDT_COMMON_H
#define KDT_COMMON_H

#include "kdtree/kdtree.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KDT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KDT_PRINTF(a, b)
#endif

kdt_status kdt_fail(kdt_status s, const char *fmt, ...) KDT_PRINTF(2, 3);

/* Shorthand for argument checks: returns KDT_ERR_INVALID_ARG with "<what>: <message>". */
#define KDT_CHECK_ARG(cond, ...)                                   \
    do {                                                           \
        if (!(cond)) return kdt_fail(KDT_ERR_INVALID_ARG, __VA_ARGS__); \
    } while (0)

/* Propagates a failed kdt_status: `KDT_TRY(load_config(...));`. */
#define KDT_TRY(x)                                 \
    do {                                           \
        kdt_status kdt_try_st_ = (x);              \
        if (kdt_try_st_ != KDT_OK) return kdt_try_st_; \
    } while (0)

/* ---- CPU threads and SIMD level (cpu.c) ---- */
/* 1 if the CPU code may use its AVX2 forms (x86-64 with AVX2, not turned off by a test). */
int kdt_cpu_avx2(void);
/* 1 if the CPU code may use its SSE2 forms (every x86-64, unless a test turned them off). */
int kdt_cpu_sse2(void);
/* Tests: 1 = the plain C forms everywhere, 0 = back to the fastest the CPU has. */
void kdt_cpu_force_plain(int on);

#define KDT_MAX_CPU_THREADS 1024
/* work (in multiply-adds) below which a parallel loop keeps a thread to itself */
#define KDT_PARALLEL_MIN_COST 65536.0

/* fn(ctx, worker, begin, end) over a piece [begin, end) of [0, n); worker < the thread count. */
typedef void (*kdt_range_fn)(void *ctx, int worker, int64_t begin, int64_t end);

/* Threads kdt_parallel_for uses now (kdt_set_cpu_threads, else OpenMP's default; 1 without OpenMP). */
int kdt_cpu_threads(void);

/* Runs fn over [0, n) cut into contiguous pieces of whole `grain`s (the last may be shorter), one
 * per thread, on up to kdt_cpu_threads() threads (and at most max_workers, if > 0). Jobs under
 * KDT_PARALLEL_MIN_COST per thread (cost_per_item x n) use fewer threads; a call from inside a
 * parallel piece runs inline. Callers must make each output the work of one piece. */
void kdt_parallel_for(int64_t n, int64_t grain, double cost_per_item, int max_workers, kdt_range_fn fn, void *ctx);

/* Tests: the per-thread minimum in place of KDT_PARALLEL_MIN_COST (tiny jobs then split as far as
 * they go); <= 0 restores it. */
void kdt_parallel_set_min_cost(double cost);

#ifdef __cplusplus
}
#endif
#endif
