/* engine_gpu_ops.cu - the small kernels the GPU round needs beyond the library's: gathering the
 * block-table rows of the round's streams (tree stream order) for kdt_kv_commit_cuda, which
 * indexes its block table by tree stream, and scattering feature rows into the per-slot buffer
 * where auto's plain rounds park them until the drafter needs them. */
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

__global__ void k_scatter_rows(float *dst, int64_t dst_stride, int n_dst_rows, const float *src, int64_t src_stride,
                               const int32_t *dst_row, int width) {
    const int r = blockIdx.x, d = dst_row[r];
    if (d < 0 || d >= n_dst_rows) return;
    const float *a = src + (int64_t)r * src_stride;
    float *b = dst + (int64_t)d * dst_stride;
    for (int c = threadIdx.x; c < width; c += blockDim.x) b[c] = a[c];
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

/* dst row dst_row[r] = src + r * src_stride, width floats, for r < n (dst_row on the device, read
 * at run time so a graph replays it with new rows; a row outside 0..n_dst_rows-1 is skipped). */
extern "C" kdt_status kdt_eng_scatter_rows(float *dst, int64_t dst_stride, int32_t n_dst_rows, const float *src,
                                           int64_t src_stride, const int32_t *dst_row, int32_t n, int32_t width,
                                           void *stream) {
    if (n < 1 || width < 1) return kdt_fail(KDT_ERR_INVALID_ARG, "scatter rows: n %d, width %d", n, width);
    k_scatter_rows<<<n, 256, 0, (cudaStream_t)stream>>>(dst, dst_stride, n_dst_rows, src, src_stride, dst_row, width);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "scatter rows: %s", cudaGetErrorString(e));
}
