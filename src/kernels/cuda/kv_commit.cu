/* kv_commit.cu - CUDA KV commit: moves the accepted rows of every stream and layer to their
 * committed slots in one launch, in place, through the paged block table. Semantics and the
 * per-stream checks are those of cpu/kv_commit.c (a bad stream is skipped, never touched).
 *
 * Grid: blockIdx.y = stream, blockIdx.x strides over (layer, column) items, a column being one
 * VEC-byte piece of a row (16 B when rows and the cache are 16-byte aligned). Warp 0 of each CTA
 * validates the stream and computes the byte offsets of the moved source/destination rows into
 * shared memory. A thread then owns one column of one layer for all moved rows and moves them in
 * batches of KV_COMMIT_BATCH rows (increasing k), loading every source piece of a batch into
 * registers before storing any. No other thread touches that column, and a destination slot is
 * only ever the source of an earlier row (see cpu/kv_commit.c), so the in-place hazard (e.g.
 * path [0, 2, 3]: slot P+2 is read and written) is resolved inside the thread, with no barrier,
 * while up to 8 loads per thread are in flight. Columns of a row are consecutive threads: 32
 * lanes move 512 contiguous bytes of a row per access.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.h"
#include "kdtree/kernels.h"

extern "C" kdt_status kdt_kv_commit_check_args(const kdt_kv_commit_params *p, const char *who);

namespace {

constexpr int BLOCK = 256;
constexpr int KV_COMMIT_BATCH = 8;   /* rows per load-then-store batch; same as cpu/kv_commit.c */
constexpr int MAX_GRID_X = 65535;

struct CommitArgs {
    unsigned char *cache;
    int64_t layer_stride;
    const int32_t *__restrict__ block_table;
    const int32_t *__restrict__ prefix_len;
    const int32_t *__restrict__ accepted;
    const int32_t *__restrict__ tau;
    int n_layers, row_bytes, page_size, n_pages, max_pages;
    int64_t cols;      /* row_bytes / VEC */
};

template <typename VEC>
__global__ void __launch_bounds__(BLOCK) kv_commit_kernel(const CommitArgs a) {
    __shared__ int64_t src_off[KDT_MAX_PATH], dst_off[KDT_MAX_PATH]; /* bytes within a layer */
    __shared__ int first_moved, n_rows;                              /* rows [first, n_rows) */
    const int s = blockIdx.y;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int tau = __ldg(a.tau + s);
        const int64_t prefix = __ldg(a.prefix_len + s);
        const int acc = lane < KDT_MAX_PATH ? __ldg(a.accepted + (int64_t)s * KDT_MAX_PATH + lane) : 0;
        const int prev = __shfl_up_sync(0xffffffffu, acc, 1);
        bool bad = tau < 0 || tau > KDT_MAX_PATH || prefix < 0; /* warp-uniform */
        int first = tau;
        if (!bad && tau > 0) {
            const bool in = lane < tau;
            const bool order_bad = in && (lane == 0 ? acc != 0 : acc <= prev);
            bad = __any_sync(0xffffffffu, order_bad);
            const unsigned moved = __ballot_sync(0xffffffffu, in && acc != lane);
            if (moved) first = __ffs(moved) - 1;
            if (!bad && first < tau) {
                bool row_bad = false;
                if (lane >= first && lane < tau) {
                    const int64_t from = prefix + acc, to = prefix + lane;
                    if (from >= (int64_t)a.max_pages * a.page_size) {
                        row_bad = true;
                    } else {
                        const int32_t *table = a.block_table + (int64_t)s * a.max_pages;
                        const int page_from = __ldg(table + from / a.page_size);
                        const int page_to = __ldg(table + to / a.page_size);
                        row_bad = page_from < 0 || page_from >= a.n_pages || page_to < 0 ||
                                  page_to >= a.n_pages;
                        src_off[lane] = ((int64_t)page_from * a.page_size + from % a.page_size) * a.row_bytes;
                        dst_off[lane] = ((int64_t)page_to * a.page_size + to % a.page_size) * a.row_bytes;
                    }
                }
                bad = __any_sync(0xffffffffu, row_bad);
            }
        }
        if (lane == 0) {
            first_moved = bad ? 0 : first;
            n_rows = bad ? 0 : tau; /* bad or no-op: first_moved >= n_rows, nothing to do */
        }
    }
    __syncthreads();
    const int first = first_moved, tau = n_rows;
    if (first >= tau) return;

    const int64_t items = (int64_t)a.n_layers * a.cols;
    for (int64_t item = (int64_t)blockIdx.x * BLOCK + threadIdx.x; item < items;
         item += (int64_t)gridDim.x * BLOCK) {
        const int64_t layer = item / a.cols, col = item - layer * a.cols;
        unsigned char *base = a.cache + layer * a.layer_stride + col * (int64_t)sizeof(VEC);
        /* Batches of rows in increasing k; inside a batch all loads are issued before the
         * stores (memory-level parallelism, and the in-place order of cpu/kv_commit.c). */
        for (int kb = first; kb < tau; kb += KV_COMMIT_BATCH) {
            VEC v[KV_COMMIT_BATCH];
#pragma unroll
            for (int j = 0; j < KV_COMMIT_BATCH; j++)
                if (kb + j < tau) v[j] = *reinterpret_cast<const VEC *>(base + src_off[kb + j]);
#pragma unroll
            for (int j = 0; j < KV_COMMIT_BATCH; j++)
                if (kb + j < tau) *reinterpret_cast<VEC *>(base + dst_off[kb + j]) = v[j];
        }
    }
}

} // namespace

extern "C" kdt_status kdt_kv_commit_cuda(const kdt_kv_commit_params *p, void *stream) {
    kdt_status st = kdt_kv_commit_check_args(p, "kdt_kv_commit_cuda");
    if (st != KDT_OK) return st;
    CommitArgs a;
    a.cache = (unsigned char *)p->cache;
    a.layer_stride = p->layer_stride_bytes;
    a.block_table = p->block_table;
    a.prefix_len = p->prefix_len;
    a.accepted = p->accepted;
    a.tau = p->tau;
    a.n_layers = p->n_layers;
    a.row_bytes = p->row_bytes;
    a.page_size = p->page_size;
    a.n_pages = p->n_pages;
    a.max_pages = p->max_pages;
    /* Widest access every row start is aligned to: rows start at multiples of row_bytes from
     * the layer base. */
    const uint64_t align_bits = (uint64_t)(uintptr_t)p->cache | (uint64_t)p->layer_stride_bytes |
                                (uint64_t)p->row_bytes;
    const int vec = (align_bits % 16 == 0) ? 16 : (align_bits % 8 == 0) ? 8 : (align_bits % 4 == 0) ? 4 : 2;
    a.cols = p->row_bytes / vec;
    const int64_t items = (int64_t)p->n_layers * a.cols;
    int64_t gx = (items + BLOCK - 1) / BLOCK;
    if (gx > MAX_GRID_X) gx = MAX_GRID_X;
    const dim3 grid((unsigned)gx, (unsigned)p->n_streams);
    cudaStream_t cs = (cudaStream_t)stream;
    switch (vec) {
    case 16: kv_commit_kernel<uint4><<<grid, BLOCK, 0, cs>>>(a); break;
    case 8: kv_commit_kernel<uint2><<<grid, BLOCK, 0, cs>>>(a); break;
    case 4: kv_commit_kernel<uint32_t><<<grid, BLOCK, 0, cs>>>(a); break;
    default: kv_commit_kernel<uint16_t><<<grid, BLOCK, 0, cs>>>(a); break;
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_kv_commit_cuda: launch failed: %s", cudaGetErrorString(e));
    return KDT_OK;
}
