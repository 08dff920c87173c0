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

#ifdef __cplusplus
}
#endif
#endif
