/* gpu_test_util.h - what every GPU test shares: CUDA_OK aborts the test with the failing call
 * and CUDA's message (a GPU test cannot go on after a CUDA error). */
#ifndef KDT_GPU_TEST_UTIL_H
#define KDT_GPU_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

/* 1 if there is a CUDA device; else says that `test` needs a GPU (and why) on stderr and gives 0
 * (the test then exits 1: a GPU test never passes without running). */
static inline int gpu_test_have_device(const char *test) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess && n > 0) return 1;
    fprintf(stderr, "%s: no CUDA device (%s): this test needs a GPU\n", test,
            e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 0;
}

/* The compute capability major of device 0 (0 if it cannot be read). */
static inline int gpu_test_cc_major(void) {
    int major = 0;
    return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess ? major : 0;
}

/* 1 when KDT_GPU_SMEM_LIMIT lowers the shared memory the launchers see (gpu_check.sh
 * --small-smem: a large GPU playing a 99 KB part), so paths that need more are not expected. */
static inline int gpu_test_smem_capped(void) {
    const char *e = getenv("KDT_GPU_SMEM_LIMIT");
    return e && atol(e) > 0;
}

/* A switch set for part of a test: env_save copies its value (NULL: unset), env_restore puts it
 * back (or unsets it) and frees the copy. */
static inline char *env_save(const char *name) {
    const char *v = getenv(name);
    return v ? strdup(v) : NULL;
}
static inline void env_restore(const char *name, char *saved) {
    if (saved) setenv(name, saved, 1);
    else unsetenv(name);
    free(saved);
}

/* A device copy of host bytes (at least 4 bytes allocated, so a zero-size array is still a valid
 * pointer); the test frees it or exits. */
static inline void *dev_copy(const void *h, size_t bytes) {
    void *d = NULL;
    CUDA_OK(cudaMalloc(&d, bytes ? bytes : 4));
    if (bytes) CUDA_OK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

#endif
