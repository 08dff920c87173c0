/* cpu.c - what the CPU code may use: threads (one setting and one parallel loop; OpenMP where the
 * compiler has it, inline otherwise) and the SIMD level (AVX2 or not, asked once). Every caller
 * splits work so that each output value is computed by exactly one thread with the code a single
 * thread runs, and every SIMD form computes the plain C form's operations in its order, so
 * neither the thread count nor the SIMD level changes a bit of any result. */
#include "common.h"

#include <stdatomic.h>
#if defined(KDT_PTHREAD_PARALLEL)
/* ThreadSanitizer builds: plain pthreads, whose create / join TSan understands (it does not see
 * libgomp's barriers, so an OpenMP build reports every shared read as a race) */
#include <pthread.h>
#include <unistd.h>
#elif defined(_OPENMP)
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
#if defined(KDT_PTHREAD_PARALLEL)
    const long t = n > 0 ? n : sysconf(_SC_NPROCESSORS_ONLN);
    return t < 1 ? 1 : t > KDT_MAX_CPU_THREADS ? KDT_MAX_CPU_THREADS : (int)t;
#elif defined(_OPENMP)
    const int t = n > 0 ? n : omp_get_max_threads();
    return t < 1 ? 1 : t > KDT_MAX_CPU_THREADS ? KDT_MAX_CPU_THREADS : t;
#else
    (void)n;
    return 1;
#endif
}

#if defined(KDT_PTHREAD_PARALLEL)
typedef struct piece_arg {
    kdt_range_fn fn;
    void *ctx;
    int worker;
    int64_t b, e;
} piece_arg;

static _Thread_local int in_piece; /* a call from inside a piece runs inline */

static void *run_piece(void *p) {
    const piece_arg *a = p;
    in_piece = 1;
    a->fn(a->ctx, a->worker, a->b, a->e);
    return NULL;
}
#endif

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
#if defined(KDT_PTHREAD_PARALLEL)
    if (t >= 2 && !in_piece) {
        piece_arg args[64];
        pthread_t tid[64];
        int started[64] = {0};
        if (t > 64) t = 64;
        for (int64_t w = 0; w < t; w++) {
            const int64_t b = w * pieces / t * grain, e = (w + 1) * pieces / t * grain;
            args[w] = (piece_arg){fn, ctx, (int)w, b < n ? b : n, e < n ? e : n};
        }
        for (int64_t w = 1; w < t; w++)
            if (args[w].b < args[w].e) started[w] = pthread_create(&tid[w], NULL, run_piece, &args[w]) == 0;
        in_piece = 1;
        fn(ctx, 0, args[0].b, args[0].e);
        for (int64_t w = 1; w < t; w++) {
            if (started[w]) pthread_join(tid[w], NULL);
            else if (args[w].b < args[w].e) fn(ctx, (int)w, args[w].b, args[w].e); /* could not start */
        }
        in_piece = 0;
        return;
    }
#elif defined(_OPENMP)
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
