/* gpu_launch.cuh - programmatic dependent launch (PDL) for the GPU forward's kernels (gpu_ops.cu,
 * gpu_attn.cu, gpu_gemm.cu). A layer is a chain of ~20 kernels that each read what the previous
 * one wrote; launched plainly, every boundary costs a drain, a launch and the next kernel's ramp
 * (for a weight-streaming GEMM: the first DRAM round trip). With PDL (sm_90+), kernel k+1 is
 * launched once every CTA of kernel k has started and called launch_dependents (pdl_trigger), so
 * it becomes resident while k still runs and waits in pdl_wait until k has completed and its
 * memory is visible. The rules every kernel launched through launch_k keeps:
 *   - pdl_wait() before its first access to memory that an earlier kernel of the pass writes, and
 *     on every path before it exits (so a kernel's completion implies its predecessors'); only
 *     data no kernel writes (weights) may be read before it;
 *   - pdl_trigger() early (at entry): only then does the next kernel start early.
 * griddepcontrol.wait returns at once when the kernel was launched without the attribute, so the
 * kernels are also correct launched plainly. kdt_gpu_pdl_on() (gpu_ops.cu) says whether launch_k
 * adds the attribute: a device of compute capability 9 or more whose kernels carry sm_90+ code,
 * unless KDT_GPU_PDL=0 (A/B runs). */
#ifndef KDT_GPU_LAUNCH_CUH
#define KDT_GPU_LAUNCH_CUH

#include <cuda_runtime.h>
#include <string.h>

#include "gpu_internal.h"

namespace kg {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* kernel<<<grid, block, smem, s>>>(args...), with the PDL attribute when kdt_gpu_pdl_on(). */
template <typename... KArgs, typename... Args>
cudaError_t launch_k(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args &&...args) {
    cudaLaunchConfig_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    if (kdt_gpu_pdl_on()) {
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args &&>(args)...);
}

} // namespace kg

#endif
