/* cpu.c - what the CPU code may use: threads (one setting and one parallel loop; OpenMP where the
 * compiler has it, inline otherwise) and the SIMD level (AVX2 or not, asked once). Every caller
 * splits work so that each output value is computed by exactly one thread with the code a single
 * thread runs, and every SIMD form computes the plain C form's operations in its order, so
 * neither the thread count nor the SIMD level changes a bit of any result. */
#include "common.h"

#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static atomic_int cpu_threads; /* 0: OpenMP's default (OMP_NUM_THREADS, else every core) */
static _Atomic double min_cost = KDT_PARALLEL_MIN_COST;

static atomic_int force_plain;

void kdt_cpu_force_plain(int on) { atomic_store(&force_plain, on != 0); }

int kdt_cpu_avx2(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    static atomic_int has = -1; /* asked once; every thread gets the same answer */
    int h = atomic_load(&has);
    if (h < 0) {
        h = __builtin_cpu_supports("avx2") ? 1 : 0;
        atomic_store(&has, h);
    }
    return h && !atomic_load(&force_plain);
#else
    return 0;
#endif
}

int kdt_cpu_sse2(void) {
#if defined(__SSE2__)
    return !atomic_load(&force_plain);
#else
    return 0;
#endif
}

void kdt_parallel_set_min_cost(double cost) { atomic_store(&min_cost, cost > 0 ? cost : KDT_PARALLEL_MIN_COST); }

kdt_status kdt_set_cpu_threads(int n) {
    KDT_CHECK_ARG(n >= 0 && n <= KDT_MAX_CPU_THREADS, "kdt_set_cpu_threads: n = %d (0 = all cores, or 1..%d)", n,
                  KDT_MAX_CPU_THREADS);
    atomic_store(&cpu_threads, n);
    return KDT_OK;
}

int kdt_cpu_threads(void) {
    const int n = atomic_load(&cpu_threads);
#ifdef _OPENMP
    const int t = n > 0 ? n : omp_get_max_threads();
    return t < 1 ? 1 : t > KDT_MAX_CPU_THREADS ? KDT_MAX_CPU_THREADS : t;
#else
    (void)n;
    return 1;
#endif
}

void kdt_parallel_for(int64_t n, int64_t grain, double cost_per_item, int max_workers, kdt_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    int64_t t = kdt_cpu_threads();
    if (max_workers > 0 && t > max_workers) t = max_workers;
    const int64_t pieces = (n + grain - 1) / grain;
    if (t > pieces) t = pieces;
    /* below ~KDT_PARALLEL_MIN_COST per thread, waking the others costs more than it saves */
    const double per_min = atomic_load(&min_cost);
    if ((double)n * cost_per_item < per_min * (double)t) t = (int64_t)((double)n * cost_per_item / per_min);
#ifdef _OPENMP
    if (t >= 2 && !omp_in_parallel()) {
#pragma omp parallel num_threads((int)t)
        {
            const int64_t w = omp_get_thread_num(), nw = omp_get_num_threads();
            /* whole grains, as even as they go: worker w takes pieces [w P / nw, (w + 1) P / nw) */
            const int64_t b = w * pieces / nw * grain, e = (w + 1) * pieces / nw * grain;
            if (b < n) fn(ctx, (int)w, b, e < n ? e : n);
        }
        return;
    }
#endif
    fn(ctx, 0, 0, n);
}
