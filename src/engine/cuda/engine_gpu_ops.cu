/* engine_gpu_ops.cu - the one kernel the GPU round needs beyond the library's: gathering the
 * block-table rows of the round's streams (tree stream order) for kdt_kv_commit_cuda, which
 * indexes its block table by tree stream. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.h"

namespace {
__global__ void k_gather_rows(int32_t *dst, const int32_t *src, const int32_t *idx, int width, int64_t src_stride,
                              int n_src_rows) {
    const int r = blockIdx.x, j = idx[r];
    for (int c = threadIdx.x; c < width; c += blockDim.x)
        dst[(int64_t)r * width + c] = j >= 0 && j < n_src_rows ? src[(int64_t)j * src_stride + c] : -1;
}
} // namespace

/* dst[r][0..width) = src[idx[r]][0..width) for r < n (idx on the device; a row outside the source
 * gives -1 entries, i.e. no pages). */
extern "C" kdt_status kdt_eng_gather_rows(int32_t *dst, const int32_t *src, const int32_t *idx, int32_t n,
                                          int32_t width, int64_t src_stride, int32_t n_src_rows, void *stream) {
    if (n < 1 || width < 1) return kdt_fail(KDT_ERR_INVALID_ARG, "gather rows: n %d, width %d", n, width);
    k_gather_rows<<<n, 128, 0, (cudaStream_t)stream>>>(dst, src, idx, width, src_stride, n_src_rows);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "gather rows: %s", cudaGetErrorString(e));
}
