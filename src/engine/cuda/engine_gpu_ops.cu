/* engine_gpu_ops.cu - the small kernels the GPU round needs beyond the library's: gathering the
 * block-table rows of the round's streams (tree stream order) for kdt_kv_commit_cuda, which
 * indexes its block table by tree stream, scattering feature rows into the per-slot buffer
 * where auto's plain rounds park them until the drafter needs them, and cutting auto's probe
 * trees (built at the caps) to the chosen budgets (the twin of kdt_round_tree_prefix). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "common.h"
#include "kdtree/kernels.h"
#include "kernels/cuda/pdl.cuh"

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

/* One warp per stream, node i in lane i % 32: kdt_round_tree_prefix on the device, plus the probe's
 * node count and scores (all src->max_nodes of them) into probe_n / probe_score for the host. */
__global__ void __launch_bounds__(32) k_tree_prefix(const kdt_tree src, const kdt_tree dst, const int32_t *budget,
                                                    int32_t *probe_n, float *probe_score) {
    pdl::wait(); /* the probe comes from the previous kernel */
    pdl::launch_dependents();
    const int s = blockIdx.x, Ns = src.max_nodes, Nd = dst.max_nodes;
    const int Ws = KDT_MASK_WORDS(Ns), Wd = KDT_MASK_WORDS(Nd);
    const int src_n = src.n_nodes[s];
    const int b = min(max(budget[s], 0), Nd - 1);
    const int n = max(min(min(src_n, 1 + b), Ns), 1);
    const int64_t si = (int64_t)s * Ns, di = (int64_t)s * Nd;
    for (int i = threadIdx.x; i < Nd; i += 32) {
        uint64_t *row = dst.anc_mask + (di + i) * Wd;
        if (i >= n) {
            dst.token[di + i] = dst.parent[di + i] = dst.depth[di + i] = -1;
            dst.first_child[di + i] = dst.next_sibling[di + i] = dst.position[di + i] = -1;
            dst.score[di + i] = -INFINITY;
            for (int w = 0; w < Wd; w++) row[w] = 0;
            continue;
        }
        const int fc = src.first_child[si + i], ns = src.next_sibling[si + i];
        dst.token[di + i] = src.token[si + i];
        dst.parent[di + i] = src.parent[si + i];
        dst.depth[di + i] = src.depth[si + i];
        dst.first_child[di + i] = fc < n ? fc : -1;
        dst.next_sibling[di + i] = ns < n ? ns : -1;
        dst.position[di + i] = src.position[si + i];
        dst.score[di + i] = src.score[si + i];
        const uint64_t *srow = src.anc_mask + (si + i) * Ws;
        for (int w = 0; w < Wd; w++) row[w] = w < Ws ? srow[w] : 0;
    }
    for (int i = threadIdx.x; i < Ns; i += 32) probe_score[si + i] = src.score[si + i];
    if (threadIdx.x == 0) {
        dst.n_nodes[s] = n;
        probe_n[s] = src_n;
    }
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

/* dst = the prefixes of src's trees at budget[] (device), as kdt_round_tree_prefix; probe_n[s] =
 * src's node count and probe_score[s * src->max_nodes + i] = src's scores, for the host. */
extern "C" kdt_status kdt_eng_tree_prefix(const kdt_tree *src, const kdt_tree *dst, const int32_t *budget,
                                          int32_t *probe_n, float *probe_score, void *stream) {
    if (!src || !dst || src->n_streams != dst->n_streams || src->n_streams < 1)
        return kdt_fail(KDT_ERR_INVALID_ARG, "tree prefix: stream counts differ or are < 1");
    static const bool use_pdl = pdl::usable(k_tree_prefix);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)src->n_streams);
    cfg.blockDim = dim3(32);
    cfg.stream = (cudaStream_t)stream;
    cudaLaunchAttribute attr[1] = {};
    if (use_pdl) pdl::enable(&cfg, attr);
    cudaError_t e = cudaLaunchKernelEx(&cfg, k_tree_prefix, *src, *dst, budget, probe_n, probe_score);
    if (e == cudaSuccess) e = cudaGetLastError();
    return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "tree prefix: %s", cudaGetErrorString(e));
}
