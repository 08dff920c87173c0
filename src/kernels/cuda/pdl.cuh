/* pdl.cuh - programmatic dependent launch (PDL) for the small tree kernels (tree_build,
 * tree_accept) and the GPU forward (src/model/cuda: the weight-streaming GEMMs issue their first
 * weight stages before the wait; the row kernels, attention and router only hide their launch):
 * launched with cudaLaunchAttributeProgrammaticStreamSerialization, a kernel may
 * start while the previous kernel in the stream is still finishing, and waits (pdl::wait) before
 * its first global access, so only the launch latency overlaps (about 0.4 us a call on an H200).
 * sm_90+ only: the device must be one and the loaded kernel must be compiled for one (older PTX
 * has no wait); KDT_TREE_PDL=0 turns it off. */
#ifndef KDT_PDL_CUH
#define KDT_PDL_CUH

#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

namespace pdl {

__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Whether `kernel` may be launched with PDL on the current device (call once, keep the answer);
 * off_env = "0" turns it off (KDT_TREE_PDL for the tree kernels, KDT_GPU_PDL for the forward's
 * GEMMs). */
template <typename Kernel>
bool usable(Kernel kernel, const char *off_env = "KDT_TREE_PDL") {
    const char *v = getenv(off_env);
    if (v && v[0] && !strcmp(v, "0")) return false;
    int dev = 0, major = 0;
    cudaFuncAttributes fa;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return major >= 9 && fa.ptxVersion >= 90;
}

/* Adds the PDL attribute to cfg (attr must outlive the launch). */
inline void enable(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *attr) {
    attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr->val.programmaticStreamSerializationAllowed = 1;
    cfg->attrs = attr;
    cfg->numAttrs = 1;
}

/* kernel<<<grid, block, smem, s>>>(args...), with the PDL attribute when `on`; the kernel must
 * call wait() before touching anything the previous kernel writes or reads. A launch error is
 * left for cudaGetLastError, as with <<<>>>. */
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool on, Args... args) {
    if (!on) {
        kernel<<<grid, block, smem, s>>>(args...);
        return;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at;
    enable(&cfg, &at);
    (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

} // namespace pdl

#endif
