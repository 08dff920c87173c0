/* gpu_gemm.cu - the GEMMs of the GPU forward: Y = X W^T with X fp32 activations [M][K] and W a
 * bf16 weight [N][ld] (nn.Linear layout), on tensor cores (mma.sync m16n8k16, fp32 accumulate).
 * Three kernels share one CTA tile:
 *   gemm_kernel     dense projections; split-K partials Y_s, batched over heads for W_UK / W_UV;
 *   grouped_kernel  MoE experts: walks the (expert, pair range) item list built on the device;
 *   head_kernel     lm_head with the fused argmax (per vocabulary tile) and optional logits.
 *
 * CTA tile: 64 output columns x all M rows in passes of 64, 4 warps (warp w owns 16 columns,
 * all four 16-row m-tiles), K in 64-wide blocks through a cp.async pipeline of STAGES stages:
 * W tile [64][64+8] bf16 and X tile [64][64+8] fp32 (the +8 padding makes the fragment loads
 * bank-conflict free). X enters the tensor cores as bf16 hi + lo (two products per step), so the
 * activations keep ~16 mantissa bits while the weights are bf16.
 *
 * Batch invariance: an output element (m, n) is accumulated over K in one fixed sequence - K
 * blocks ascending inside its split, the four k16 steps of a block ascending, hi then lo - and the
 * split count comes from kdt_gemm_plan(N, ld, batch) alone. M only decides how many m-tiles are
 * computed and which pass holds a row; tensor-core rows never mix. So a row's result is the same
 * bits whatever the other rows are, and whatever the pipeline depth (STAGES) is.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu_internal.h"
#include "gpu_mma.cuh"

namespace {
using namespace kg;

constexpr int BN = KDT_G_BN, BM = KDT_G_BM, BK = KDT_G_BK, THREADS = 128;
constexpr int WS = BK + 8;                       /* bf16 per W smem row (144 B) */
constexpr int XS = BK + 8;                       /* floats per X smem row (288 B) */
constexpr int W_STAGE = BN * WS * 2;             /* 9216 B */
constexpr int X_STAGE = BM * XS * 4;             /* 18432 B */
constexpr int STAGE_BYTES = W_STAGE + X_STAGE;
constexpr int W_ROWS_PER_THREAD = BN * (BK / 8) / THREADS;  /* 4: 16-byte W chunks per thread */
constexpr int X_ROWS_PER_THREAD = BM * (BK / 4) / THREADS;  /* 8: 16-byte X chunks per thread */
static_assert(W_ROWS_PER_THREAD == 4 && X_ROWS_PER_THREAD == 8, "loader layout");
static_assert(BM * (BN + 1) * 4 <= 2 * STAGE_BYTES, "argmax tile fits two stages");

/* One CTA pass: W rows [n0, n0 + n_valid) (w points at row n0), X rows [0, m_valid) of the pass
 * (row i at xrow[i]), K blocks [k_begin, k_end). */
struct Pass {
    const uint16_t *w;
    int ldw, n_valid;
    int kx;                                      /* X columns >= kx read as zero */
    int m_valid;
    int k_begin, k_end;
    const float *xrow[X_ROWS_PER_THREAD];        /* this thread's X rows (NULL = beyond m_valid) */
    bool xalign[X_ROWS_PER_THREAD];
};

/* Thread tid loads W chunk column (tid & 7) of rows (tid >> 3) + 16 i, and X chunk column
 * (tid & 15) of rows (tid >> 4) + 8 i. */
__device__ __forceinline__ void load_stage(const Pass &p, unsigned char *stage, int kc) {
    const int tid = threadIdx.x;
    uint16_t *ws = reinterpret_cast<uint16_t *>(stage);
    const int wch = tid & 7;
#pragma unroll
    for (int i = 0; i < W_ROWS_PER_THREAD; i++) {
        const int r = (tid >> 3) + 16 * i;
        const bool ok = r < p.n_valid;
        const uint16_t *src = ok ? p.w + (int64_t)r * p.ldw + kc + wch * 8 : p.w;
        cp_async16(ws + r * WS + wch * 8, src, ok ? 16 : 0);
    }
    float *xs = reinterpret_cast<float *>(stage + W_STAGE);
    const int xch = tid & 15, k = kc + xch * 4;
    const int m_pad = (p.m_valid + 15) & ~15;
#pragma unroll
    for (int i = 0; i < X_ROWS_PER_THREAD; i++) {
        const int r = (tid >> 4) + 8 * i;
        if (r >= m_pad) continue;
        float *dst = xs + r * XS + xch * 4;
        const float *src = p.xrow[i];
        if (src && k + 4 <= p.kx && p.xalign[i]) {
            cp_async16(dst, src + k, 16);
        } else if (src && k < p.kx) { /* ragged K or unaligned rows: element by element */
            float4 v;
            v.x = src[k];
            v.y = k + 1 < p.kx ? src[k + 1] : 0.0f;
            v.z = k + 2 < p.kx ? src[k + 2] : 0.0f;
            v.w = k + 3 < p.kx ? src[k + 3] : 0.0f;
            *reinterpret_cast<float4 *>(dst) = v;
        } else {
            *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}

/* acc[mt][j] (m-tile mt, this warp's n8 tile j) += X W^T over one staged 64-wide K block. */
__device__ __forceinline__ void compute_stage(const unsigned char *stage, int mtiles, float (&acc)[4][2][4]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint16_t *ws = reinterpret_cast<const uint16_t *>(stage);
    const float *xs = reinterpret_cast<const float *>(stage + W_STAGE);
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        uint32_t b[2][2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const uint16_t *wp = ws + (warp * 16 + j * 8 + g) * WS + kk * 16 + 2 * t;
            b[j][0] = *reinterpret_cast<const uint32_t *>(wp);
            b[j][1] = *reinterpret_cast<const uint32_t *>(wp + 8);
        }
#pragma unroll
        for (int mt = 0; mt < 4; mt++) {
            if (mt < mtiles) {
                const float *xp = xs + (mt * 16 + g) * XS + kk * 16 + 2 * t;
                uint32_t hi[4], lo[4];
                split_bf16(*reinterpret_cast<const float2 *>(xp), hi[0], lo[0]);
                split_bf16(*reinterpret_cast<const float2 *>(xp + 8 * XS), hi[1], lo[1]);
                split_bf16(*reinterpret_cast<const float2 *>(xp + 8), hi[2], lo[2]);
                split_bf16(*reinterpret_cast<const float2 *>(xp + 8 * XS + 8), hi[3], lo[3]);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    mma16816(acc[mt][j], hi, b[j][0], b[j][1]);
                    mma16816(acc[mt][j], lo, b[j][0], b[j][1]);
                }
            }
        }
    }
}

template <int STAGES>
__device__ __forceinline__ void mainloop(const Pass &p, unsigned char *smem, float (&acc)[4][2][4]) {
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.0f;
    const int nk = (p.k_end - p.k_begin) / BK;
    const int mtiles = (p.m_valid + 15) >> 4;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nk) load_stage(p, smem + s * STAGE_BYTES, p.k_begin + s * BK);
        cp_async_commit();
    }
    for (int it = 0; it < nk; it++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nxt = it + STAGES - 1;
        if (nxt < nk) load_stage(p, smem + (nxt % STAGES) * STAGE_BYTES, p.k_begin + nxt * BK);
        cp_async_commit();
        compute_stage(smem + (it % STAGES) * STAGE_BYTES, mtiles, acc);
    }
    cp_async_wait<0>();
    __syncthreads();
}

/* Sets this thread's X row pointers for rows [m0, m0 + m_valid) of a pass; row i of the pass is
 * X row rowmap(m0 + i). */
template <typename RowMap>
__device__ __forceinline__ void set_x_rows(Pass &p, const float *x, int64_t ldx, int m0, RowMap rowmap) {
#pragma unroll
    for (int i = 0; i < X_ROWS_PER_THREAD; i++) {
        const int r = (threadIdx.x >> 4) + 8 * i;
        p.xrow[i] = r < p.m_valid ? x + (int64_t)rowmap(m0 + r) * ldx : nullptr;
        p.xalign[i] = ((uintptr_t)p.xrow[i] & 15) == 0;
    }
}

/* Writes the pass's accumulators to y (row i of the pass at y + i * ldy), columns < n_valid. */
__device__ __forceinline__ void store_acc(const float (&acc)[4][2][4], float *y, int64_t ldy, int m_valid,
                                          int n_valid) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int c = warp * 16 + j * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = mt * 16 + g + 8 * h;
                if (r < m_valid) {
                    if (c < n_valid) y[(int64_t)r * ldy + c] = acc[mt][j][2 * h];
                    if (c + 1 < n_valid) y[(int64_t)r * ldy + c + 1] = acc[mt][j][2 * h + 1];
                }
            }
        }
}

struct Identity {
    __device__ int operator()(int m) const { return m; }
};
struct Gather {
    const int32_t *rows;
    __device__ int operator()(int m) const { return rows[m]; }
};

template <int STAGES>
__global__ void __launch_bounds__(THREADS) gemm_kernel(const kdt_gemm_args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n0 = blockIdx.x * BN, split = blockIdx.y, b = blockIdx.z;
    int M = *a.m_dev;
    M = M < 0 ? 0 : (M > a.m_max ? a.m_max : M);
    Pass p;
    p.w = a.w + b * a.w_batch + (int64_t)n0 * a.ldw;
    p.ldw = a.ldw;
    p.n_valid = min(BN, a.n - n0);
    p.kx = a.kx;
    p.k_begin = split * a.k_chunk;
    p.k_end = min(p.k_begin + a.k_chunk, a.ldw);
    const float *x = a.x + b * a.x_batch;
    float *y = a.y + split * a.y_split + b * a.y_batch + n0;
    float acc[4][2][4];
    for (int m0 = 0; m0 < M; m0 += BM) {
        p.m_valid = min(BM, M - m0);
        if (a.x_rows) set_x_rows(p, x, a.ldx, m0, Gather{a.x_rows});
        else set_x_rows(p, x, a.ldx, m0, Identity{});
        mainloop<STAGES>(p, smem, acc);
        store_acc(acc, y + (int64_t)m0 * a.ldy, a.ldy, p.m_valid, p.n_valid);
    }
}

template <int STAGES>
__global__ void __launch_bounds__(THREADS) grouped_kernel(const kdt_grouped_args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n0 = blockIdx.x * BN;
    const int n_items = *a.n_items;
    float acc[4][2][4];
    for (int it = blockIdx.y; it < n_items; it += gridDim.y) {
        const int e = a.items[3 * it], p0 = a.items[3 * it + 1], rows = a.items[3 * it + 2];
        const kdt_gpu_expert ex = a.experts[e];
        const int N = a.which == 0 ? 2 * ex.i_pad : a.kd;
        if (n0 >= N) continue;
        Pass p;
        p.ldw = a.which == 0 ? ex.ld_d : ex.ld_i;
        p.w = (a.which == 0 ? ex.gu : ex.down) + (int64_t)n0 * p.ldw;
        p.n_valid = min(BN, N - n0);
        p.kx = a.which == 0 ? a.kd : ex.inter;
        p.k_begin = 0;
        p.k_end = p.ldw;
        p.m_valid = min(rows, BM);
        if (a.which == 0) set_x_rows(p, a.x, a.ldx, p0, Gather{a.pair_row});
        else set_x_rows(p, a.x, a.ldx, p0, Identity{});
        mainloop<STAGES>(p, smem, acc);
        store_acc(acc, a.y + (int64_t)p0 * a.ldy + n0, a.ldy, p.m_valid, p.n_valid);
    }
}

template <int STAGES>
__global__ void __launch_bounds__(THREADS) head_kernel(const kdt_head_args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n0 = blockIdx.x * BN;
    const int V = a.w.rows;
    int M = *a.m_dev;
    M = M < 0 ? 0 : (M > a.m_max ? a.m_max : M);
    Pass p;
    p.ldw = a.w.ld;
    p.w = a.w.w + (int64_t)n0 * p.ldw;
    p.n_valid = min(BN, V - n0);
    p.kx = a.kx;
    p.k_begin = 0;
    p.k_end = p.ldw;
    float acc[4][2][4];
    float *tile = reinterpret_cast<float *>(smem); /* [BM][BN + 1], after the pipeline drained */
    for (int m0 = 0; m0 < M; m0 += BM) {
        p.m_valid = min(BM, M - m0);
        set_x_rows(p, a.x, a.kx, m0, Identity{});
        mainloop<STAGES>(p, smem, acc);
        store_acc(acc, tile, BN + 1, p.m_valid, p.n_valid);
        __syncthreads();
        if (a.logits)
            for (int i = threadIdx.x; i < p.m_valid * BN; i += THREADS) {
                const int r = i / BN, c = i % BN;
                if (c < p.n_valid) {
                    const int out = a.rows[a.head_rows[m0 + r]].out_index;
                    a.logits[(int64_t)out * V + n0 + c] = tile[r * (BN + 1) + c];
                }
            }
        if ((int)threadIdx.x < p.m_valid) {
            /* first maximum of the tile (strict >), -inf / INT_MAX when there is none (NaN row) */
            float best = -INFINITY;
            int idx = 0x7fffffff;
            for (int c = 0; c < p.n_valid; c++) {
                const float v = tile[threadIdx.x * (BN + 1) + c];
                if (v > best) best = v, idx = n0 + c;
            }
            a.am_val[(int64_t)blockIdx.x * a.am_ld + m0 + threadIdx.x] = best;
            a.am_idx[(int64_t)blockIdx.x * a.am_ld + m0 + threadIdx.x] = idx;
        }
        __syncthreads();
    }
}

template <typename K>
cudaError_t set_smem(K kernel, size_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

kdt_status launch_error(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", what, cudaGetErrorString(e));
    return KDT_OK;
}

} // namespace

extern "C" size_t kdt_gemm_smem_bytes(int32_t stages) { return (size_t)stages * STAGE_BYTES; }

extern "C" void kdt_gemm_plan(int32_t n, int32_t ldw, int32_t batch, int32_t *splits, int32_t *k_chunk) {
    const int64_t tiles = (int64_t)((n + BN - 1) / BN) * (batch > 0 ? batch : 1);
    const int32_t kblocks = ldw / BK;
    int64_t want = (KDT_G_SPLIT_TARGET + tiles - 1) / tiles;
    int32_t max_splits = kblocks / 4; /* at least 256 of K per split */
    if (max_splits < 1) max_splits = 1;
    if (want > max_splits) want = max_splits;
    if (want < 1) want = 1;
    const int32_t chunk_blocks = (kblocks + (int32_t)want - 1) / (int32_t)want;
    *splits = (kblocks + chunk_blocks - 1) / chunk_blocks;
    *k_chunk = chunk_blocks * BK;
}

/* Raises the dynamic shared-memory limit of every GEMM instance (call before any capture). */
extern "C" kdt_status kdt_gemm_init(int32_t stages) {
    cudaError_t e = cudaSuccess;
    const size_t bytes = kdt_gemm_smem_bytes(stages);
    switch (stages) {
    case 2:
        if (e == cudaSuccess) e = set_smem(gemm_kernel<2>, bytes);
        if (e == cudaSuccess) e = set_smem(grouped_kernel<2>, bytes);
        if (e == cudaSuccess) e = set_smem(head_kernel<2>, bytes);
        break;
    case 3:
        if (e == cudaSuccess) e = set_smem(gemm_kernel<3>, bytes);
        if (e == cudaSuccess) e = set_smem(grouped_kernel<3>, bytes);
        if (e == cudaSuccess) e = set_smem(head_kernel<3>, bytes);
        break;
    case 4:
        if (e == cudaSuccess) e = set_smem(gemm_kernel<4>, bytes);
        if (e == cudaSuccess) e = set_smem(grouped_kernel<4>, bytes);
        if (e == cudaSuccess) e = set_smem(head_kernel<4>, bytes);
        break;
    default: return kdt_fail(KDT_ERR_INTERNAL, "kdt_gemm_init: %d stages", stages);
    }
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "GPU GEMM: %zu bytes of shared memory: %s", bytes, cudaGetErrorString(e));
    return KDT_OK;
}

extern "C" kdt_status kdt_gemm_launch(const kdt_gemm_args *a, int32_t stages, cudaStream_t s) {
    if (a->ldw % BK || a->k_chunk % BK || a->m_max < 1 || a->n < 1)
        return kdt_fail(KDT_ERR_INTERNAL, "GPU GEMM: ld %d, k_chunk %d, m_max %d, n %d", a->ldw, a->k_chunk,
                        a->m_max, a->n);
    const dim3 grid((unsigned)((a->n + BN - 1) / BN), (unsigned)a->splits, (unsigned)(a->batch > 0 ? a->batch : 1));
    const size_t smem = kdt_gemm_smem_bytes(stages);
    switch (stages) {
    case 2: gemm_kernel<2><<<grid, THREADS, smem, s>>>(*a); break;
    case 3: gemm_kernel<3><<<grid, THREADS, smem, s>>>(*a); break;
    default: gemm_kernel<4><<<grid, THREADS, smem, s>>>(*a); break;
    }
    return launch_error("GPU GEMM");
}

extern "C" kdt_status kdt_grouped_launch(const kdt_grouped_args *a, int32_t stages, cudaStream_t s) {
    const dim3 grid((unsigned)((a->n_max + BN - 1) / BN), (unsigned)(a->grid_items > 0 ? a->grid_items : 1));
    const size_t smem = kdt_gemm_smem_bytes(stages);
    switch (stages) {
    case 2: grouped_kernel<2><<<grid, THREADS, smem, s>>>(*a); break;
    case 3: grouped_kernel<3><<<grid, THREADS, smem, s>>>(*a); break;
    default: grouped_kernel<4><<<grid, THREADS, smem, s>>>(*a); break;
    }
    return launch_error("GPU grouped GEMM");
}

extern "C" kdt_status kdt_head_launch(const kdt_head_args *a, int32_t stages, cudaStream_t s) {
    if (a->w.ld % BK || a->m_max < 1)
        return kdt_fail(KDT_ERR_INTERNAL, "GPU lm_head: ld %d, m_max %d", a->w.ld, a->m_max);
    const dim3 grid((unsigned)((a->w.rows + BN - 1) / BN));
    const size_t smem = kdt_gemm_smem_bytes(stages);
    switch (stages) {
    case 2: head_kernel<2><<<grid, THREADS, smem, s>>>(*a); break;
    case 3: head_kernel<3><<<grid, THREADS, smem, s>>>(*a); break;
    default: head_kernel<4><<<grid, THREADS, smem, s>>>(*a); break;
    }
    return launch_error("GPU lm_head");
}
