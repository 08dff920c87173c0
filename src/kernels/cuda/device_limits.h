/* device_limits.h - the device's shared-memory limits as every kernel launcher reads them (per
 * block with opt-in, per SM), in one place so that they can be lowered for a test:
 * KDT_GPU_SMEM_LIMIT=B caps the per-block figure at B bytes and the per-SM one at B + 1 KB (one
 * block's reservation), which makes a large GPU pick every kernel configuration a smaller part
 * picks. KDT_GPU_SMEM_LIMIT=101376 is the RTX PRO 6000 Blackwell (sm_120) and sm_86 / sm_89: on
 * an H200 the GPU tests then run the portable verify_attn kernel in its BN 16 configuration, the
 * 8-warp decode attention and the smaller GEMM pools (`scripts/gpu_check.sh --small-smem`).
 * Plain C (the model's .c launchers include it too). Read once per process.
 */
#ifndef KDT_DEVICE_LIMITS_H
#define KDT_DEVICE_LIMITS_H

#include <cuda_runtime_api.h>
#include <stdlib.h>

/* KDT_GPU_SMEM_LIMIT in bytes, or 0 (no cap); values below 48 KB are taken as 48 KB. */
static inline long kdt_smem_cap(void) {
    static long cap = -1;
    if (cap < 0) {
        const char *e = getenv("KDT_GPU_SMEM_LIMIT");
        long v = e && *e ? strtol(e, NULL, 10) : 0;
        cap = v <= 0 ? 0 : (v < 48 * 1024 ? 48 * 1024 : v);
    }
    return cap;
}

/* Shared memory one block may opt in to on `dev`, capped by KDT_GPU_SMEM_LIMIT. */
static inline cudaError_t kdt_smem_optin(int dev, int *out) {
    const cudaError_t e = cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    const long cap = kdt_smem_cap();
    if (e == cudaSuccess && cap > 0 && *out > cap) *out = (int)cap;
    return e;
}

/* Shared memory of one SM on `dev`, capped at KDT_GPU_SMEM_LIMIT + 1 KB. */
static inline cudaError_t kdt_smem_per_sm(int dev, int *out) {
    const cudaError_t e = cudaDeviceGetAttribute(out, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    const long cap = kdt_smem_cap();
    if (e == cudaSuccess && cap > 0 && *out > cap + 1024) *out = (int)(cap + 1024);
    return e;
}

#endif
