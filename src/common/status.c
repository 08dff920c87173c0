/* status.c - status names, the per-thread last-error message, version. */
#include "common.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[1024];

kdt_status kdt_fail(kdt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return s;
}

const char *kdt_last_error(void) { return last_error; }

void kdt_clear_error(void) { last_error[0] = '\0'; }

const char *kdt_status_name(kdt_status s) {
    switch (s) {
    case KDT_OK: return "KDT_OK";
    case KDT_ERR_INVALID_ARG: return "KDT_ERR_INVALID_ARG";
    case KDT_ERR_MALFORMED_TREE: return "KDT_ERR_MALFORMED_TREE";
    case KDT_ERR_OUT_OF_MEMORY: return "KDT_ERR_OUT_OF_MEMORY";
    case KDT_ERR_IO: return "KDT_ERR_IO";
    case KDT_ERR_FORMAT: return "KDT_ERR_FORMAT";
    case KDT_ERR_UNSUPPORTED: return "KDT_ERR_UNSUPPORTED";
    case KDT_ERR_CUDA: return "KDT_ERR_CUDA";
    case KDT_ERR_NO_CUDA: return "KDT_ERR_NO_CUDA";
    case KDT_ERR_CAPACITY: return "KDT_ERR_CAPACITY";
    case KDT_ERR_INTERNAL: return "KDT_ERR_INTERNAL";
    }
    return "KDT_ERR_UNKNOWN";
}

#define KDT_STR2(x) #x
#define KDT_STR(x) KDT_STR2(x)
#define KDT_VERSION_TEXT KDT_STR(KDT_VERSION_MAJOR) "." KDT_STR(KDT_VERSION_MINOR) "." KDT_STR(KDT_VERSION_PATCH)

int kdt_has_cuda(void) {
#ifdef KDT_WITH_CUDA
    return 1;
#else
    return 0;
#endif
}

const char *kdt_version_string(void) {
#ifdef KDT_WITH_CUDA
    return KDT_VERSION_TEXT " (cuda)";
#else
    return KDT_VERSION_TEXT " (cpu)";
#endif
}
