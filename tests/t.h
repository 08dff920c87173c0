/* t.h - the in-house test harness: CHECK macros, a relative-error helper and one summary line.
 *
 * A test file defines test functions, calls them from main() through T_RUN(), and ends with
 * `return t_summary();`, which prints "N passed, N failed" and returns the exit code. A failed
 * CHECK prints file:line and the expression and marks the current test failed; the test goes on
 * so one run shows every failure. KDT_TEST_ONLY=SUBSTRING runs only the tests whose function name
 * contains it (e.g. one test of a slow binary under compute-sanitizer); a filter that matches no
 * test fails the run, so a misspelt name never passes silently.
 *
 * Fuzz and property loops run a fixed count from a fixed seed, so every CI run sees the same
 * inputs. For a longer campaign, KDT_FUZZ_SCALE=k runs k times as many iterations of each loop
 * (t_fuzz_iters) and KDT_FUZZ_SEED=n mixes n into each loop's seed (t_fuzz_seed: a new set of
 * inputs, replayable with the same n); the first use prints both on stderr.
 */
#ifndef KDT_T_H
#define KDT_T_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <string.h>

static int t_passed, t_failed, t_cur_failed, t_skipped;

/* before main's first output (setvbuf may only come first) */
__attribute__((constructor)) static void t_line_buffered(void) { setvbuf(stdout, NULL, _IOLBF, 0); }

/* 1 when KDT_TEST_ONLY is set and `name` does not contain it */
static inline int t_filtered_out(const char *name) {
    const char *only = getenv("KDT_TEST_ONLY");
    return only && only[0] && !strstr(name, only);
}

/* malloc that ends the test on failure (tests have no recovery path for it) */
static inline void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "  FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);        \
            t_cur_failed = 1;                                                        \
        }                                                                            \
    } while (0)

#define CHECK_MSG(cond, ...)                                                         \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                            \
            fprintf(stderr, "\n");                                                   \
            t_cur_failed = 1;                                                        \
        }                                                                            \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                           \
    do {                                                                             \
        long long t_a = (long long)(a), t_b = (long long)(b);                        \
        if (t_a != t_b) {                                                            \
            fprintf(stderr, "  FAIL %s:%d: %s == %s (%lld vs %lld)\n", __FILE__,     \
                    __LINE__, #a, #b, t_a, t_b);                                     \
            t_cur_failed = 1;                                                        \
        }                                                                            \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                        \
    do {                                                                             \
        double t_a = (double)(a), t_b = (double)(b);                                 \
        if (!(fabs(t_a - t_b) <= (tol))) {                                           \
            fprintf(stderr, "  FAIL %s:%d: |%s - %s| <= %g (%.9g vs %.9g)\n",        \
                    __FILE__, __LINE__, #a, #b, (double)(tol), t_a, t_b);            \
            t_cur_failed = 1;                                                        \
        }                                                                            \
    } while (0)

/* Each test announces itself when it starts, and stdout is line-buffered: a test that hangs under
 * a timeout (its output piped to a log) still shows which test it was and how far it got. */
#define T_RUN(fn)                                                                    \
    do {                                                                             \
        if (t_filtered_out(#fn)) {                                                   \
            t_skipped++;                                                             \
            break;                                                                   \
        }                                                                            \
        printf("[ .. ] %s\n", #fn);                                                  \
        t_cur_failed = 0;                                                            \
        fn();                                                                        \
        if (t_cur_failed) {                                                          \
            t_failed++;                                                              \
            fprintf(stderr, "[FAIL] %s\n", #fn);                                     \
        } else {                                                                     \
            t_passed++;                                                              \
            printf("[ ok ] %s\n", #fn);                                              \
        }                                                                            \
        fflush(stdout);                                                              \
    } while (0)

static inline int t_summary(void) {
    if (t_skipped) printf("%d skipped (KDT_TEST_ONLY=%s)\n", t_skipped, getenv("KDT_TEST_ONLY"));
    printf("%d passed, %d failed\n", t_passed, t_failed);
    if (t_passed + t_failed == 0 && t_skipped) {
        fprintf(stderr, "no test matches KDT_TEST_ONLY=%s\n", getenv("KDT_TEST_ONLY"));
        return 1;
    }
    return t_failed ? 1 : 0;
}

/* ||a - b|| / ||b|| over n doubles; NaN anywhere gives +inf, so NaN never passes. */
static inline double t_rel_err(const double *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        double d = a[i] - b[i];
        num += d * d;
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* splitmix64: a small seedable generator for test inputs. */
static inline uint64_t t_rand_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline double t_rand_unit(uint64_t *s) { return (t_rand_u64(s) >> 11) * (1.0 / 9007199254740992.0); }
static inline int t_rand_int(uint64_t *s, int n) { return (int)(t_rand_u64(s) % (uint64_t)n); }
static inline double t_rand_normal(uint64_t *s) {
    double u1 = t_rand_unit(s), u2 = t_rand_unit(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* The campaign's settings (see the top): scale >= 1, seed 0 when KDT_FUZZ_SEED is unset. */
static inline void t_fuzz_settings(int *scale, uint64_t *seed) {
    static int done, sc = 1;
    static uint64_t sd;
    if (!done) {
        const char *e = getenv("KDT_FUZZ_SCALE"), *f = getenv("KDT_FUZZ_SEED");
        if (e && *e) {
            const long v = strtol(e, NULL, 10);
            sc = v < 1 ? 1 : (v > 100000 ? 100000 : (int)v);
        }
        if (f && *f) sd = strtoull(f, NULL, 0);
        if (sc != 1 || sd) fprintf(stderr, "fuzz campaign: KDT_FUZZ_SCALE=%d KDT_FUZZ_SEED=%llu\n", sc, (unsigned long long)sd);
        done = 1;
    }
    *scale = sc;
    *seed = sd;
}
/* n iterations of a fuzz loop, times KDT_FUZZ_SCALE */
static inline int t_fuzz_iters(int n) {
    int sc;
    uint64_t sd;
    t_fuzz_settings(&sc, &sd);
    const long long v = (long long)n * sc;
    return v > 2000000000 ? 2000000000 : (int)v;
}
/* a fuzz loop's seed: `base` itself unless KDT_FUZZ_SEED is set, then base mixed with it (never 0,
 * which an xorshift generator cannot leave) */
static inline uint64_t t_fuzz_seed(uint64_t base) {
    int sc;
    uint64_t sd;
    t_fuzz_settings(&sc, &sd);
    if (!sd) return base;
    uint64_t z = base ^ (sd * 0x9e3779b97f4a7c15ull);
    z = t_rand_u64(&z);
    return z ? z : 1;
}

#endif
