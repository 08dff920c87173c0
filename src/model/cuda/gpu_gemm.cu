/* gpu_gemm.cu - the GEMMs of the GPU forward: Y = X W^T with X fp32 activations [M][K] and W a
 * bf16 weight [N][ld] (nn.Linear layout), on tensor cores (mma.sync m16n8k16, fp32 accumulate).
 * Three kernels:
 *   gemm      dense projections; split-K partials Y_s, batched over heads for W_UK / W_UV;
 *   grouped   MoE experts: walks the (expert, pair range) item list built on the device;
 *   head      lm_head with the fused argmax (per 64-column vocabulary tile) and optional logits.
 * Each CTA owns 64 output columns (4 warps, warp w owns 16 = two n8 tiles) and walks K in 64-wide
 * blocks. X enters the tensor cores as bf16 hi + lo (two products per step), so the activations
 * keep ~16 mantissa bits while the weights are bf16.
 *
 * Three implementations of the same arithmetic:
 *   v2 (default)  built for decode / tree verify (1..64 rows): the X block is converted to hi / lo
 *                 once per CTA (not once per warp) into its own double buffer, fragments come from
 *                 ldmatrix, and the pipeline depth follows the rows of the pass: the shared-memory
 *                 pool holds as many (W, X) stages as fit (9 for <= 8 rows, 3 for 64), so a CTA
 *                 keeps up to 64 KB of weights in flight; weights stream with an L2 evict-first
 *                 hint. Rows are processed in passes of at most `cap` rows (64 on H100 / H200).
 *                 Launches of more than 8 rows take WIDE instances, whose full-tile k step is
 *                 unrolled over a compile-time m-tile count (k64_full); decode launches keep the
 *                 run-time m-tile loop, whose instances compile as they did before.
 *   v3            (KDT_GEMM_V3=1, dense launch bounds <= 64 rows and grouped launches; opt-in:
 *                 slower than v2 on the H200 so far, see the v3 section) persistent CTAs that
 *                 stream the weights across units with v2's pipeline and a balanced grid;
 *   v1            the original kernels (4 m-tiles x fp32 X tile per stage, per-warp conversion),
 *                 selected by KDT_GEMM_V1=1 (read once per process) for A/B runs.
 *
 * Batch invariance, the rule that keeps all three bitwise identical (and must keep holding for any
 * future variant): an output element (m, n) is the fp32 accumulator chain, starting from +0, of
 *     for each 64-wide K block of its split, ascending: for kk = 0..3: mma(hi), then mma(lo)
 * where every mma is m16n8k16 bf16 x bf16 -> fp32, its A row holds bf16_rn(x) (hi) or
 * bf16_rn(x - hi) (lo) of X row m at k = block + 16 kk + 0..15 in the standard fragment positions
 * (zero beyond kx), and its B column holds W row n at the same k. The split comes from
 * kdt_gemm_plan(N, ld, batch) alone. A tensor-core C element depends only on its own A row, B
 * column and C input - rows never mix - so tiling in M and N, rows per pass, which rows share a
 * CTA or a fragment position, pipeline depth, warp layout, grid shape and the v1 / v2 / v3 choice
 * cannot change a bit. That is also why v2 may choose its pipeline from the device-side row count
 * and the host may choose variants (v2 / v3, v3's schedule) from launch bounds: none of these
 * choices reaches the chain. tests/gpu/test_gemm_ab_gpu.cu checks v1 == v2 == v3 bitwise.
 * Changing the split plan, the k16 order, hi-before-lo, the mma shape or the hi / lo rounding
 * WOULD change results (and break speculative decoding == greedy decoding).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <type_traits>

#include "gemm_tiles.cuh"
#include "gpu_internal.h"
#include "kernels/cuda/device_limits.h"
#include "gpu_mma.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/wgmma_sm90.cuh"

namespace {
using namespace kg;

constexpr int BN = KDT_G_BN, BM = KDT_G_BM, BK = KDT_G_BK, THREADS = 128;

/* Shared-memory pool of one CTA for a runner's `stages` (kdt_gemm_smem_bytes). Index 4 is the
 * H100 / H200 size: two CTAs fill a 228 KB SM (2 x (113 + 1 reserved) KB); 3 fits two CTAs on
 * an A100; every entry also holds the v1 kernels' `stages` x 27 KB. */
constexpr int POOL_BYTES[5] = {0, 0, 55296, 82944, 115712};

int pool_bytes(int stages) { return POOL_BYTES[stages < 2 ? 2 : (stages > 4 ? 4 : stages)]; }

struct Identity {
    __device__ int operator()(int m) const { return m; }
};
struct Gather {
    const int32_t *rows;
    __device__ int operator()(int m) const { return rows[m]; }
};

/* Every accumulator of a CTA pass (4 m-tiles x this warp's two n8 tiles) to +0: the start of the
 * chain (top of file). */
__device__ __forceinline__ void zero_acc(float (&acc)[4][2][4]) {
#pragma unroll
    for (int mt = 0; mt < 4; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.0f;
}

/* Writes a pass's accumulators (rows of 4 m-tiles, this warp's two n8 tiles) to y (row i of the
 * pass at y + i * ldy), rows < m_valid, columns < n_valid. */
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

/* lm_head epilogue of one pass, the tile [m_valid][BN + 1] in shared memory: logits rows, then
 * every row's first maximum of the tile (strict >; -inf / INT_MAX when there is none, a NaN row). */
__device__ __forceinline__ void head_epilogue(const kdt_head_args &a, const float *tile, int m0, int m_valid,
                                              int n0, int n_valid) {
    const int V = a.w.rows;
    if (a.logits)
        for (int i = threadIdx.x; i < m_valid * BN; i += THREADS) {
            const int r = i / BN, c = i % BN;
            if (c < n_valid) {
                const int out = a.rows[a.head_rows[m0 + r]].out_index;
                a.logits[(int64_t)out * V + n0 + c] = tile[r * (BN + 1) + c];
            }
        }
    for (int r = threadIdx.x; r < m_valid; r += THREADS) {
        float best = -INFINITY;
        int idx = 0x7fffffff;
        for (int c = 0; c < n_valid; c++) {
            const float v = tile[r * (BN + 1) + c];
            if (v > best) best = v, idx = n0 + c;
        }
        a.am_val[(int64_t)blockIdx.x * a.am_ld + m0 + r] = best;
        a.am_idx[(int64_t)blockIdx.x * a.am_ld + m0 + r] = idx;
    }
}

__device__ __forceinline__ int clamp_m(const int32_t *m_dev, int m_max) {
    const int M = *m_dev;
    return M < 0 ? 0 : (M > m_max ? m_max : M);
}

/* 4 fp32 of X row `src` (NULL: a row past the pass) at columns k.. into dst: one 16-byte copy
 * when the row is aligned and all 4 lie below kx, element by element for ragged K or an
 * unaligned row, zeros past kx or past the rows. The X loaders of v1, v3 and the wgmma kernels
 * (v2's keeps its own copy: the decode instances, whose code is left as measured). */
__device__ __forceinline__ void load_x4(float *dst, const float *src, int k, int kx, bool aligned) {
    if (src && k + 4 <= kx && aligned) {
        cp_async16(dst, src + k, 16);
    } else if (src && k < kx) {
        float4 v;
        v.x = src[k];
        v.y = k + 1 < kx ? src[k + 1] : 0.0f;
        v.z = k + 2 < kx ? src[k + 2] : 0.0f;
        v.w = k + 3 < kx ? src[k + 3] : 0.0f;
        *reinterpret_cast<float4 *>(dst) = v;
    } else {
        *reinterpret_cast<float4 *>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

#include "gemm_wg.cuh" /* the wgmma kernels for many rows (KDT_GEMM_WG=0 turns them off) */

/* ============================ v1: the original kernels (KDT_GEMM_V1=1) ============================
 * CTA tile: 64 columns x all M rows in passes of 64, 4 warps (warp w owns 16 columns, all four
 * 16-row m-tiles), K in 64-wide blocks through a cp.async pipeline of STAGES stages: W tile
 * [64][64+8] bf16 and X tile [64][64+8] fp32 (the +8 padding makes the fragment loads bank-conflict
 * free); every warp converts the X fragments it needs to hi / lo itself. */
/* The W side of a grouped pass (v1's Pass or v2's V2Pass): expert ex's gate/up (which 0) or down
 * (which 1) rows n0.., K from 0; the caller sets where K ends in its own terms. */
template <class P>
__device__ __forceinline__ void set_grouped_w(P &p, const kdt_grouped_args &a, const kdt_gpu_expert &ex, int n0, int N) {
    p.ldw = a.which == 0 ? ex.ld_d : ex.ld_i;
    p.w = (a.which == 0 ? ex.gu : ex.down) + (int64_t)n0 * p.ldw;
    p.n_valid = min(BN, N - n0);
    p.kx = a.which == 0 ? a.kd : ex.inter;
    p.k_begin = 0;
}

namespace v1 {

constexpr int WS = BK + 8;                       /* bf16 per W smem row (144 B) */
constexpr int XS = BK + 8;                       /* floats per X smem row (288 B) */
constexpr int W_STAGE = BN * WS * 2;             /* 9216 B */
constexpr int X_STAGE = BM * XS * 4;             /* 18432 B */
constexpr int STAGE_BYTES = W_STAGE + X_STAGE;
constexpr int W_ROWS_PER_THREAD = BN * (BK / 8) / THREADS;  /* 4: 16-byte W chunks per thread */
constexpr int X_ROWS_PER_THREAD = BM * (BK / 4) / THREADS;  /* 8: 16-byte X chunks per thread */
static_assert(W_ROWS_PER_THREAD == 4 && X_ROWS_PER_THREAD == 8, "loader layout");
static_assert(BM * (BN + 1) * 4 <= 2 * STAGE_BYTES, "argmax tile fits two stages");
static_assert(4 * STAGE_BYTES <= 115712 && 3 * STAGE_BYTES <= 82944 && 2 * STAGE_BYTES <= 55296, "pool sizes");

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
        load_x4(xs + r * XS + xch * 4, p.xrow[i], k, p.kx, p.xalign[i]);
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
    zero_acc(acc);
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

template <int STAGES>
__global__ void __launch_bounds__(THREADS) gemm_kernel(const kdt_gemm_args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n0 = blockIdx.x * BN, split = blockIdx.y, b = blockIdx.z;
    const int M = clamp_m(a.m_dev, a.m_max);
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
        set_grouped_w(p, a, ex, n0, N);
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
    const int M = clamp_m(a.m_dev, a.m_max);
    Pass p;
    p.ldw = a.w.ld;
    p.w = a.w.w + (int64_t)n0 * p.ldw;
    p.n_valid = min(BN, a.w.rows - n0);
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
        head_epilogue(a, tile, m0, p.m_valid, n0, p.n_valid);
        __syncthreads();
    }
}

} // namespace v1

/* ================================= v2: the default kernels =====================================
 * Per pass of m_valid <= cap rows, with R = 8 (m_valid <= 8) or m_valid rounded up to 16:
 *   pool = [ hi / lo double buffer: 2 x 2 planes x R rows x 72 bf16 ]
 *          [ stage 0 .. S-1: W [64][72] bf16 (9216 B) | X [R][64] fp32 (R x 256 B) ]
 * with S = as many stages as the pool holds (at most MAX_STAGES). cp.async group g carries W block
 * g and X block g + 1 (group 0 also X block 0), so when block `it` is computed, X block it + 1 has
 * landed too and is converted (each thread converts the 16-byte chunks it loaded itself) into the
 * other hi / lo buffer while the tensor cores work: one __syncthreads per block. Rows m_valid..R-1
 * of the hi / lo planes are zero for the whole pass. With R = 8 the A fragment's rows 8..15 are the
 * zero registers and one ldmatrix.x4 fetches hi and lo; otherwise two ldmatrix.x4 per m-tile. */
constexpr int V2_ROWS = GT_V2_ROWS;              /* rows per pass the kernels are compiled for */
constexpr int V2_MT = V2_ROWS / 16;              /* m-tiles: 4 (store_acc's layout) */
constexpr int V2_HALF_ROWS = GT_V2_HALF_ROWS;    /* passes of <= 8 rows take the half path; launches
                                                    of more take the WIDE instances (gt_v2_wide) */
constexpr int V2_XROWS = V2_ROWS / 8;            /* X rows per thread: (tid >> 4) + 8 i */
constexpr int V2_WP = BK + 8;                    /* bf16 per W row in shared memory (144 B) */
constexpr int V2_XCP = GT_V2_XCP;                /* bf16 per hi / lo row (144 B) */
constexpr int V2_W_STAGE = GT_V2_W_STAGE;        /* 9216 B; an X row is 256 B (GT_V2_X_ROW: one warp
                                                    reads two whole rows, conflict-free) */
constexpr int V2_MAX_STAGES = GT_V2_MAX_STAGES;
static_assert(V2_W_STAGE == BN * V2_WP * 2, "W stage: 64 padded rows");
static_assert(V2_MT == 4, "store_acc covers 4 m-tiles");

/* the pool arithmetic lives in gemm_tiles.cuh (plain C: tests/test_gemm_tiles.c checks it) */
__host__ __device__ constexpr int v2_tile_rows(int m) { return gt_v2_tile_rows(m); }
static_assert(v2_tile_rows(V2_HALF_ROWS) == V2_HALF_ROWS && v2_tile_rows(V2_HALF_ROWS + 1) == 16, "half passes");
__host__ __device__ constexpr int v2_xc_bytes(int R) { return gt_v2_xc_bytes(R); }
__host__ __device__ constexpr int v2_stage_bytes(int R) { return gt_v2_stage_bytes(R); }
__host__ __device__ inline int v2_stages(int R, int pool) { return gt_v2_stages(R, pool); }
/* The bulk-copy W loader (KDT_GEMM_BULK_W=1, tiled weights only): the pool starts with one
 * mbarrier per stage, and a W stage is the tiled block verbatim, [64][64] bf16 with the layout's
 * XOR swizzle (8192 B, no padding: the swizzle keeps ldmatrix conflict-free). Never fewer stages
 * than v2_stages gives the same pool. */
constexpr int V2_BAR_BYTES = GT_V2_BAR_BYTES;
constexpr int V2_W_STAGE_BULK = GT_V2_W_STAGE_BULK; /* 8192 B */
__host__ __device__ constexpr int v2_stage_bytes_bulk(int R) { return gt_v2_stage_bytes_bulk(R); }
__host__ __device__ inline int v2_stages_bulk(int R, int pool) { return gt_v2_stages_bulk(R, pool); }
static_assert(V2_MAX_STAGES * 8 <= V2_BAR_BYTES, "one mbarrier per stage");

/* Launch configuration: dynamic shared memory of the launch and rows per pass (<= V2_ROWS). */
struct V2Cfg {
    int pool;
    int cap;
};

/* One CTA pass: W rows [n0, n0 + n_valid) (w points at row n0, k = 0), K blocks
 * k_begin / 64 + [0, nk), X rows [0, m_valid) (this thread's rows at xrow[i]). */
struct V2Pass {
    const uint16_t *w;
    int64_t ldw;
    int n_valid, kx, m_valid, k_begin, nk;
    uint32_t xalign;                             /* bit i: xrow[i] is 16-byte aligned */
    const float *xrow[V2_XROWS];
};

__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
    return p;
}

/* cp_async16 with an L2 cache policy (weights are read once per pass: keep X and partials). */
__device__ __forceinline__ void cp_async16_pol(void *dst, const void *src, int src_bytes, uint64_t pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(src_bytes), "l"(pol));
}

/* cp.async.wait_group with a run-time count (n <= MAX_STAGES - 2). */
__device__ __forceinline__ void cp_async_wait_n(int n) {
    switch (n) {
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    case 7: cp_async_wait<7>(); break;
    case 8: cp_async_wait<8>(); break;
    default: cp_async_wait<0>(); break;
    }
}
static_assert(V2_MAX_STAGES - 2 <= 8, "cp_async_wait_n covers the deepest pipeline");

/* How a kernel instance reads W: row-major [rows][ldw] by cp.async; kdt_gemm_tile64's tiled layout
 * by cp.async (KDT_GPU_TILED_EXPERTS / _DENSE=1); or tiled by one bulk copy per stage (+
 * KDT_GEMM_BULK_W=1, in v2_pass). A W pointer at row n0 (a multiple of 64) starts tile n0 / 64 in
 * both layouts. */
enum WLoad { W_ROWS = 0, W_TILED = 1, W_BULK = 2 };

/* W block kb of the pass into a stage: thread tid copies chunk (tid & 7) of rows (tid >> 3) + 16 i;
 * rows >= n_valid are zero-filled. */
template <int WL = W_ROWS>
__device__ __forceinline__ void v2_load_w(const V2Pass &p, uint16_t *ws, int kb, uint64_t pol) {
    const int tid = threadIdx.x, r0 = gt_load_row(tid, 0), c = gt_load_chunk(tid) * 8;
    /* tiled: block (k_begin / 64 + kb) of the tile (gemm_tiles.cuh); rows r0 + 16 i share r0's
     * swizzle, so copy i is 16 block rows further */
    const uint16_t *src = WL == W_TILED
                              ? p.w + (int64_t)(p.k_begin / BK + kb) * (BN * BK) + gt_block_chunk(r0, gt_load_chunk(tid))
                              : p.w + (int64_t)r0 * p.ldw + p.k_begin + kb * BK + c;
    const int64_t step = WL == W_TILED ? (int64_t)(gt_load_row(tid, 1) - r0) * BK : 16 * p.ldw;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const bool ok = r0 + 16 * i < p.n_valid;
        cp_async16_pol(ws + (r0 + 16 * i) * V2_WP + c, ok ? src + i * step : p.w, ok ? 16 : 0, pol);
    }
}

/* X block kb of the pass (fp32, zero at k >= kx): thread tid copies chunk (tid & 15) of its rows
 * (tid >> 4) + 8 i < m_valid. Same values as v1's X tile. */
__device__ __forceinline__ void v2_load_x(const V2Pass &p, float *xs, int kb) {
    const int tid = threadIdx.x, xch = tid & 15, k = p.k_begin + kb * BK + xch * 4;
#pragma unroll
    for (int i = 0; i < V2_XROWS; i++) {
        const int r = (tid >> 4) + 8 * i;
        if (r >= p.m_valid) break;
        float *dst = xs + r * BK + xch * 4;
        const float *src = p.xrow[i];
        if (k + 4 <= p.kx && ((p.xalign >> i) & 1)) {
            cp_async16(dst, src + k, 16);
        } else if (k < p.kx) { /* ragged K or unaligned rows: element by element */
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

/* The thread's own X chunks of a staged block -> hi / lo planes (split_bf16, as v1 per fragment). */
__device__ __forceinline__ void v2_convert(const V2Pass &p, const float *xs, uint16_t *hi, uint16_t *lo) {
    const int tid = threadIdx.x, xch = tid & 15;
#pragma unroll
    for (int i = 0; i < V2_XROWS; i++) {
        const int r = (tid >> 4) + 8 * i;
        if (r >= p.m_valid) break;
        const float4 v = *reinterpret_cast<const float4 *>(xs + r * BK + xch * 4);
        uint2 h, l;
        split_bf16(make_float2(v.x, v.y), h.x, l.x);
        split_bf16(make_float2(v.z, v.w), h.y, l.y);
        *reinterpret_cast<uint2 *>(hi + r * V2_XCP + xch * 4) = h;
        *reinterpret_cast<uint2 *>(lo + r * V2_XCP + xch * 4) = l;
    }
}

/* The W fragment address of k step kk for this lane (WSWZ: W is a swizzled [64][64] tiled block,
 * gemm_tiles.cuh). B: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
 * of the warp's 16 columns -> b[0] b[1] (n8 tile 0), b[2] b[3] (n8 tile 1): v1's b[j][0], b[j][1]. */
template <int WST, bool WSWZ>
__device__ __forceinline__ const uint16_t *k64_w_frag(const uint16_t *ws, int kk) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wrow = gt_w_frag_row(warp, lane);
    return WSWZ ? ws + gt_block_chunk(wrow, gt_w_frag_chunk(lane, kk))
                : ws + wrow * WST + gt_w_frag_chunk(lane, 0) * 8 + kk * 16;
}

/* ldmatrix.x4 at a shared-space byte address: a compile-time offset added to one base register
 * folds into the instruction's immediate, where a generic pointer per load cost an address
 * conversion and a multiply each (ncu, session 30). */
__device__ __forceinline__ void ldsm_x4_at(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* The full-tile body for MT m-tiles, a compile-time count: with no branch between the m-tiles the
 * scheduler interleaves the 2 MT independent accumulators, where a run-time `mt < mtiles` test
 * left only two in each basic block and a NOP between every dependent hi / lo pair (ncu, session
 * 30). Per accumulator the order is still hi then lo, per kk ascending: the same chain. */
template <int MT, int WST, int XST, bool WSWZ>
__device__ __forceinline__ void k64_full(const uint16_t *ws, const uint16_t *hi, const uint16_t *lo,
                                         float (&acc)[V2_MT][2][4]) {
    const int lane = threadIdx.x & 31;
    /* A of m-tile mt: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
     * (rows 8-15, k 8-15) -> a0 a1 a2 a3 */
    const int xo = (((lane >> 3) & 1) * 8 + (lane & 7)) * XST + (lane >> 4) * 8;
    const uint32_t hb = smem_u32(hi + xo), lb = smem_u32(lo + xo);
    uint32_t wa[BK / 16]; /* the W fragment of each k step (swizzled: no common stride) */
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) wa[kk] = smem_u32(k64_w_frag<WST, WSWZ>(ws, kk));
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        uint32_t b[4], ah[MT][4], al[MT][4];
        ldsm_x4_at(b, wa[kk]);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            ldsm_x4_at(ah[mt], hb + (mt * 16 * XST + kk * 16) * 2);
            ldsm_x4_at(al[mt], lb + (mt * 16 * XST + kk * 16) * 2);
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            mma16816(acc[mt][0], ah[mt], b[0], b[1]);
            mma16816(acc[mt][1], ah[mt], b[2], b[3]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            mma16816(acc[mt][0], al[mt], b[0], b[1]);
            mma16816(acc[mt][1], al[mt], b[2], b[3]);
        }
    }
}

/* acc[mt][j] += X W^T over one 64-wide K block: per kk, per accumulator, hi then lo (the v1 order).
 * WST / XST: elements per W / X row in shared memory. This is the one place the mma chain of the
 * batch-invariance rule (top of file) is written; v2 and v3 both call it. mtiles: 1..4 (rows of
 * the pass rounded up to 16, over 16); half: rows 0-7 only. WIDE (instances for launches of more
 * than 8 rows): the full tiles through k64_full; else a run-time m-tile loop, which keeps the
 * decode instances' code as it was (the WIDE code in them cost the H200's decode S 1 ~7 us per
 * layer, session 30). */
template <int WST, int XST, bool WSWZ = false, bool WIDE = false>
__device__ __forceinline__ void k64_compute(const uint16_t *ws, const uint16_t *hi, const uint16_t *lo, bool half,
                                            int mtiles, float (&acc)[V2_MT][2][4]) {
    const int lane = threadIdx.x & 31;
    if (half) {
        /* rows 0-7 only: matrices hi k 0-7, hi k 8-15, lo k 0-7, lo k 8-15 -> a0, a2 of hi and lo */
        const uint16_t *xp = (lane < 16 ? hi : lo) + (lane & 7) * XST + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            uint32_t b[4], x[4];
            ldsm_x4(b, k64_w_frag<WST, WSWZ>(ws, kk));
            ldsm_x4(x, xp + kk * 16);
            const uint32_t ah[4] = {x[0], 0u, x[1], 0u}, al[4] = {x[2], 0u, x[3], 0u};
            mma16816(acc[0][0], ah, b[0], b[1]);
            mma16816(acc[0][0], al, b[0], b[1]);
            mma16816(acc[0][1], ah, b[2], b[3]);
            mma16816(acc[0][1], al, b[2], b[3]);
        }
        return;
    }
    if (WIDE) {
        switch (mtiles) {
        case 1: k64_full<1, WST, XST, WSWZ>(ws, hi, lo, acc); break;
        case 2: k64_full<2, WST, XST, WSWZ>(ws, hi, lo, acc); break;
        case 3: k64_full<3, WST, XST, WSWZ>(ws, hi, lo, acc); break;
        default: k64_full<4, WST, XST, WSWZ>(ws, hi, lo, acc); break;
        }
        return;
    }
    /* A of m-tile mt: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
     * (rows 8-15, k 8-15) -> a0 a1 a2 a3 */
    const int xo = (((lane >> 3) & 1) * 8 + (lane & 7)) * XST + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        uint32_t b[4];
        ldsm_x4(b, k64_w_frag<WST, WSWZ>(ws, kk));
#pragma unroll
        for (int mt = 0; mt < V2_MT; mt++) {
            if (mt < mtiles) {
                uint32_t ah[4], al[4];
                ldsm_x4(ah, hi + mt * 16 * XST + xo + kk * 16);
                ldsm_x4(al, lo + mt * 16 * XST + xo + kk * 16);
                mma16816(acc[mt][0], ah, b[0], b[1]);
                mma16816(acc[mt][0], al, b[0], b[1]);
                mma16816(acc[mt][1], ah, b[2], b[3]);
                mma16816(acc[mt][1], al, b[2], b[3]);
            }
        }
    }
}

template <bool WIDE>
__device__ __forceinline__ void v2_compute(const uint16_t *ws, const uint16_t *hi, const uint16_t *lo, bool half,
                                           int mtiles, float (&acc)[V2_MT][2][4]) {
    k64_compute<V2_WP, V2_XCP, false, WIDE>(ws, hi, lo, half, mtiles, acc);
}

/* One pass: acc = the pass's X rows times the CTA's 64 W rows over its K blocks. Ends with the
 * pipeline drained and a barrier (shared memory free for the caller).
 * BULK (tiled weights, KDT_GEMM_BULK_W=1): thread 0 fetches each W block with one 8 KB bulk copy
 * onto the stage's mbarrier (the pool's first V2_BAR_BYTES; v2_bulk_init set them up), every
 * thread waits on it where the cp.async path waits on its group; wpar holds the parity of each
 * barrier's next phase across the CTA's passes (each pass waits once per copy it issues). The X
 * blocks, the hi / lo conversion and the mma chain are the same. */
/* W blocks 0 .. S-2 of pass p into their stages, as its prologue would issue them (cp.async: one
 * group of their own, which the prologue's waits count as the oldest): a kernel issues them before
 * pdl::wait (weights are never written by a predecessor), then runs the pass with w_pre. */
template <int WL>
__device__ __forceinline__ void v2_prefetch_w(const V2Pass &p, unsigned char *smem, int pool, uint64_t pol) {
    constexpr bool BULK = WL == W_BULK;
    const int R = v2_tile_rows(p.m_valid);
    const int sb = BULK ? v2_stage_bytes_bulk(R) : v2_stage_bytes(R);
    const int S = BULK ? v2_stages_bulk(R, pool) : v2_stages(R, pool);
    unsigned char *st = smem + (BULK ? V2_BAR_BYTES : 0) + v2_xc_bytes(R);
    for (int g = 0; g < S - 1 && g < p.nk; g++) {
        uint16_t *dst = reinterpret_cast<uint16_t *>(st + g * sb);
        if (BULK) {
            if (threadIdx.x == 0) {
                bulk_fence_proxy();
                bulk_copy_g2s(smem_u32(dst), p.w + (int64_t)(p.k_begin / BK + g) * (BN * BK), V2_W_STAGE_BULK,
                              smem_u32(smem) + 8 * g, pol);
            }
        } else {
            v2_load_w<WL>(p, dst, g, pol);
        }
    }
    if (!BULK) cp_async_commit();
}

template <int WL, bool WIDE = false>
__device__ __forceinline__ void v2_pass(const V2Pass &p, unsigned char *smem, int pool, uint64_t pol,
                                        float (&acc)[V2_MT][2][4], uint32_t &wpar, bool w_pre = false) {
    constexpr bool BULK = WL == W_BULK;
    const int tid = threadIdx.x;
    const int R = v2_tile_rows(p.m_valid), plane = R * V2_XCP;
    const int sb = BULK ? v2_stage_bytes_bulk(R) : v2_stage_bytes(R);
    const int S = BULK ? v2_stages_bulk(R, pool) : v2_stages(R, pool), nk = p.nk;
    const int wbytes = BULK ? V2_W_STAGE_BULK : V2_W_STAGE;
    const bool half = p.m_valid <= 8;
    const uint32_t bar0 = smem_u32(smem);
    uint16_t *xc = reinterpret_cast<uint16_t *>(smem + (BULK ? V2_BAR_BYTES : 0)); /* [buffer][hi, lo][R][V2_XCP] */
    unsigned char *st = reinterpret_cast<unsigned char *>(xc) + v2_xc_bytes(R);
#define V2_W(s) reinterpret_cast<uint16_t *>(st + (s) * sb)
#define V2_X(s) reinterpret_cast<float *>(st + (s) * sb + wbytes)
    /* W block kb into stage s: a bulk copy (thread 0) or every thread's cp.async chunks */
    auto load_w = [&](int kb, int s) {
        if (BULK) {
            if (tid == 0) {
                bulk_fence_proxy(); /* earlier reads of the stage */
                bulk_copy_g2s(smem_u32(V2_W(s)), p.w + (int64_t)(p.k_begin / BK + kb) * (BN * BK), V2_W_STAGE_BULK,
                              bar0 + 8 * s, pol);
            }
        } else {
            v2_load_w<WL>(p, V2_W(s), kb, pol);
        }
    };
    zero_acc(acc);
    {   /* rows m_valid..R-1 of both buffers' planes: zero (64 used columns = 8 chunks per row) */
        const int per_plane = (R - p.m_valid) * 8;
        for (int i = tid; i < 4 * per_plane; i += THREADS) {
            const int pl = i / per_plane, c = i - pl * per_plane;
            *reinterpret_cast<uint4 *>(xc + pl * plane + (p.m_valid + (c >> 3)) * V2_XCP + (c & 7) * 8) =
                make_uint4(0u, 0u, 0u, 0u);
        }
    }
    /* prologue: groups 0 .. S-2; group g = W block g + X block g + 1 (group 0: + X block 0); with
     * BULK the W blocks go by bulk copy and the groups carry the X blocks only; w_pre: the W
     * blocks are in flight already (v2_prefetch_w), cp.async ones in one older group */
    if (nk > 0) v2_load_x(p, V2_X(0), 0);
    for (int g = 0; g < S - 1; g++) {
        if (g < nk && !w_pre) load_w(g, g);
        if (g + 1 < nk) v2_load_x(p, V2_X(g + 1), g + 1);
        cp_async_commit();
    }
    cp_async_wait_n(S - 2);                       /* group 0 */
    if (nk > 0) v2_convert(p, V2_X(0), xc, xc + plane);
    /* The K loop; MT > 0 (WIDE instances, passes of more than 8 rows): the m-tile count fixed for
     * the whole pass (k64_full<MT> straight, no switch per K block) and a 2-stage pipeline's wait
     * without the run-time count's jump table (session 34); MT = 0: as it was. */
    auto k_loop = [&](auto mt_c) {
        constexpr int MT = decltype(mt_c)::value;
        int cs = 0;                               /* stage of block it; X block it + S goes there */
        int ls = S - 1;                           /* stage of W block it + S - 1 */
        int xs = 1;                               /* stage of X block it + 1 */
        for (int it = 0; it < nk; it++) {
            if (MT > 0 && S == 2) cp_async_wait<0>();
            else cp_async_wait_n(S - 2);          /* groups <= it: W block it, X block it + 1 */
            if (BULK) {
                bulk_bar_wait(bar0 + 8 * cs, (wpar >> cs) & 1u); /* W block it */
                wpar ^= 1u << cs;
            }
            __syncthreads();                      /* ... of every thread; block it - 1 consumed */
            const int j = it + S - 1;
            if (j < nk) load_w(j, ls);
            if (j + 1 < nk) v2_load_x(p, V2_X(cs), j + 1);
            cp_async_commit();
            uint16_t *cur = xc + (it & 1) * 2 * plane, *nxt = xc + ((it + 1) & 1) * 2 * plane;
            if (it + 1 < nk) v2_convert(p, V2_X(xs), nxt, nxt + plane);
            if constexpr (MT > 0) {
                if (BULK) k64_full<MT, BK, V2_XCP, true>(V2_W(cs), cur, cur + plane, acc);
                else k64_full<MT, V2_WP, V2_XCP, false>(V2_W(cs), cur, cur + plane, acc);
            } else if (BULK) {
                k64_compute<BK, V2_XCP, true, WIDE>(V2_W(cs), cur, cur + plane, half, R >> 4, acc);
            } else {
                v2_compute<WIDE>(V2_W(cs), cur, cur + plane, half, R >> 4, acc);
            }
            cs = cs + 1 == S ? 0 : cs + 1;
            ls = ls + 1 == S ? 0 : ls + 1;
            xs = xs + 1 == S ? 0 : xs + 1;
        }
    };
    if (WIDE && !half) {
        switch (R >> 4) {
        case 1: k_loop(std::integral_constant<int, 1>{}); break;
        case 2: k_loop(std::integral_constant<int, 2>{}); break;
        case 3: k_loop(std::integral_constant<int, 3>{}); break;
        default: k_loop(std::integral_constant<int, 4>{}); break;
        }
    } else {
        k_loop(std::integral_constant<int, 0>{});
    }
#undef V2_W
#undef V2_X
    cp_async_wait<0>();
    /* BULK: the next pass's bulk copies may land where this pass's X chunks were written */
    if (BULK) bulk_fence_proxy();
    __syncthreads();
}

/* The bulk loader's mbarriers (one per stage, at the pool's start): once per CTA, before any pass. */
__device__ __forceinline__ void v2_bulk_init(unsigned char *smem) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < V2_MAX_STAGES; i++) bulk_bar_init(smem_u32(smem) + 8 * i);
        bulk_bar_fence_init();
    }
    __syncthreads();
}

/* This thread's X row pointers for rows [m0, m0 + m_valid) of a pass; row i of the pass is X row
 * rowmap(m0 + i). */
template <typename RowMap>
__device__ __forceinline__ void v2_set_x_rows(V2Pass &p, const float *x, int64_t ldx, int m0, RowMap rowmap) {
    p.xalign = 0;
#pragma unroll
    for (int i = 0; i < V2_XROWS; i++) {
        const int r = (threadIdx.x >> 4) + 8 * i;
        p.xrow[i] = r < p.m_valid ? x + (int64_t)rowmap(m0 + r) * ldx : nullptr;
        if (((uintptr_t)p.xrow[i] & 15) == 0) p.xalign |= 1u << i;
    }
}

/* WL: how W is read (WLoad; the tiled loaders only for kdt_gemm_args.tiled); WIDE: launches of more
 * than 8 rows (k64_compute). Same chain, same bits. */
template <int WL, bool WIDE = false>
__global__ void __launch_bounds__(THREADS) v2_gemm_kernel(const kdt_gemm_args a, const V2Cfg c) {
    extern __shared__ __align__(16) unsigned char smem[];
    uint32_t wpar = 0; /* bulk loader: its barriers' phases across passes */
    if (WL == W_BULK) v2_bulk_init(smem);
    const int n0 = blockIdx.x * BN, split = blockIdx.y, b = blockIdx.z;
    const int M = clamp_m(a.m_dev, a.m_max);
    const uint64_t pol = evict_first_policy();
    V2Pass p;
    p.w = a.w + b * a.w_batch + (int64_t)n0 * a.ldw;
    p.ldw = a.ldw;
    p.n_valid = min(BN, a.n - n0);
    p.kx = a.kx;
    p.k_begin = split * a.k_chunk;
    p.nk = max(0, (min(p.k_begin + a.k_chunk, a.ldw) - p.k_begin) / BK);
    const float *x = a.x + b * a.x_batch;
    float *y = a.y + split * a.y_split + b * a.y_batch + n0;
    float acc[V2_MT][2][4];
    /* the first pass's weights go out before the wait for the previous kernel (launched with
     * programmatic dependence, they stream while it finishes; else the wait is a no-op) */
    const bool pre = M > 0;
    if (pre) {
        p.m_valid = min(c.cap, M);
        v2_prefetch_w<WL>(p, smem, c.pool, pol);
    }
    pdl::wait();
    for (int m0 = 0; m0 < M; m0 += c.cap) {
        p.m_valid = min(c.cap, M - m0);
        if (a.x_rows) v2_set_x_rows(p, x, a.ldx, m0, Gather{a.x_rows});
        else v2_set_x_rows(p, x, a.ldx, m0, Identity{});
        v2_pass<WL, WIDE>(p, smem, c.pool, pol, acc, wpar, pre && m0 == 0);
        if (m0 + c.cap >= M) pdl::launch_dependents(); /* last pass: see v2_grouped_kernel */
        store_acc(acc, y + (int64_t)m0 * a.ldy, a.ldy, p.m_valid, p.n_valid);
    }
}

/* The fused SwiGLU epilogue of a gate/up pass (kdt_grouped_args.h): the CTA's 64 columns are 32
 * gate rows (warps 0-1) then the 32 up rows of the same intermediate columns (warps 2-3;
 * KDT_G_GU_BLOCK), so warps 2-3 park their accumulators in shared memory and warps 0-1 write
 * h = kdt_g_swiglu(gate, up) for intermediate columns < i_valid of the pass's rows: the values
 * k_swiglu would compute from the stored y. sm: >= 64 x 33 floats no copy is landing in (the
 * pass has drained); ends with a barrier, so the next pass may reuse it. */
__device__ __forceinline__ void store_swiglu(const float (&acc)[4][2][4], float *sm, float *h, int64_t ldh,
                                             int m_valid, int i_valid) {
    static_assert(BN == 2 * KDT_G_GU_BLOCK && KDT_G_GU_BLOCK == 32, "one gate/up block per CTA, 2 warps each");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    constexpr int SP = KDT_G_GU_BLOCK + 1;
    /* f(r, c, mt, j, hh) for each accumulator pair (row r, columns c and c + 1 of the warp's 16) */
    auto each_pair = [&](auto &&f) {
#pragma unroll
        for (int mt = 0; mt < 4; mt++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) f(mt * 16 + g + 8 * hh, j * 8 + 2 * t, mt, j, hh);
    };
    if (warp >= 2)
        each_pair([&](int r, int c, int mt, int j, int hh) {
            c += (warp - 2) * 16;
            if (r < m_valid) {
                sm[r * SP + c] = acc[mt][j][2 * hh];
                sm[r * SP + c + 1] = acc[mt][j][2 * hh + 1];
            }
        });
    __syncthreads();
    if (warp < 2)
        each_pair([&](int r, int c, int mt, int j, int hh) {
            c += warp * 16;
            if (r < m_valid) {
                if (c < i_valid) h[(int64_t)r * ldh + c] = kdt_g_swiglu(acc[mt][j][2 * hh], sm[r * SP + c]);
                if (c + 1 < i_valid)
                    h[(int64_t)r * ldh + c + 1] = kdt_g_swiglu(acc[mt][j][2 * hh + 1], sm[r * SP + c + 1]);
            }
        });
    __syncthreads();
}

/* The W side of a grouped pass: expert ex's gate/up (which 0) or down (which 1) rows n0.. */
__device__ __forceinline__ V2Pass v2_grouped_w(const kdt_grouped_args &a, const kdt_gpu_expert &ex, int n0, int N) {
    V2Pass p;
    set_grouped_w(p, a, ex, n0, N);
    p.nk = (int)(p.ldw / BK);
    return p;
}

/* MINB: CTAs per SM the registers must allow. 0 (no bound: __launch_bounds__ with a minimum of 1
 * raises ptxas's register use from 124 to 132) is the default instance, 4 CTAs per SM at most;
 * 5 (96 registers, no spills) serves the opt-in wave shaping of decode-sized launches
 * (v2_config_grouped). WL: how W is read (WLoad). WIDE: items of more than 8 rows (k64_compute;
 * MINB 0 only), bounded to 4 CTAs per SM (128 registers: unbounded, the row-major one took 162).
 * The same chain in every instance, so the same bits. */
template <int MINB, int WL, bool WIDE = false>
__global__ void __launch_bounds__(THREADS, WIDE ? 4 : MINB) v2_grouped_kernel(const kdt_grouped_args a, const V2Cfg c) {
    constexpr bool BULK = WL == W_BULK;
    extern __shared__ __align__(16) unsigned char smem[];
    const int n0 = blockIdx.x * BN;
    /* a two-kernel launch whose plan the ss kernel runs: down's counts are complete already (as
     * for its prefetch below), gate/up's after the wait */
    if (a.ss_min_rows > 0 && a.which == 1 && wgg::ss_takes(a.n_items, a.ss_min_rows)) return;
    int n_items = a.which == 1 ? *a.n_items : 0; /* gate/up: after the wait */
    const uint64_t pol = evict_first_policy();
    float acc[V2_MT][2][4];
    uint32_t wpar = 0;
    if (BULK) v2_bulk_init(smem);
    /* which = 1 (down): the items come from the plan kernel before the gate/up GEMM, complete
     * before this grid can start (every gate/up CTA triggers only after its own wait for the plan;
     * with the separate SwiGLU kernel between, the same holds one step further), so the first
     * pass's weights go out before the wait; gate/up reads its items after it */
    bool pre = false;
    if (a.which == 1 && (int)blockIdx.y < n_items && n0 < a.kd) {
        const int e = a.items[3 * blockIdx.y], rows = a.items[3 * blockIdx.y + 2];
        V2Pass p = v2_grouped_w(a, a.experts[e], n0, a.kd);
        p.m_valid = min(c.cap, rows);
        pre = rows > 0;
        if (pre) v2_prefetch_w<WL>(p, smem, c.pool, pol);
    }
    pdl::wait();
    if (a.which != 1) n_items = *a.n_items;
    if (a.ss_min_rows > 0 && a.which != 1 && wgg::ss_takes(a.n_items, a.ss_min_rows)) return;
    for (int it = blockIdx.y; it < n_items; it += gridDim.y) {
        const int e = a.items[3 * it], p0 = a.items[3 * it + 1], rows = a.items[3 * it + 2];
        const kdt_gpu_expert ex = a.experts[e];
        const int N = a.which == 0 ? 2 * ex.i_pad : a.kd;
        if (n0 >= N) continue;
        V2Pass p = v2_grouped_w(a, ex, n0, N);
        for (int m0 = 0; m0 < rows; m0 += c.cap) {
            p.m_valid = min(c.cap, rows - m0);
            if (a.which == 0) v2_set_x_rows(p, a.x, a.ldx, p0 + m0, Gather{a.pair_row});
            else v2_set_x_rows(p, a.x, a.ldx, p0 + m0, Identity{});
            v2_pass<WL, WIDE>(p, smem, c.pool, pol, acc, wpar, pre && it == (int)blockIdx.y && m0 == 0);
            if (a.h) /* gate/up with the fused SwiGLU: past the barriers (BULK) */
                store_swiglu(acc, reinterpret_cast<float *>(smem + (BULK ? V2_BAR_BYTES : 0)),
                             a.h + (int64_t)(p0 + m0) * a.ldh + n0 / 2, a.ldh, p.m_valid,
                             min(KDT_G_GU_BLOCK, ex.inter - n0 / 2));
            else store_acc(acc, a.y + (int64_t)(p0 + m0) * a.ldy + n0, a.ldy, p.m_valid, p.n_valid);
        }
    }
    /* the next kernel (kdt_g_pdl_rows) may be placed once every CTA is here: not earlier, where its
     * waiting CTAs would hold slots that later waves of this grid need */
    pdl::launch_dependents();
}

__global__ void __launch_bounds__(THREADS) v2_head_kernel(const kdt_head_args a, const V2Cfg c) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int n0 = blockIdx.x * BN;
    const int M = clamp_m(a.m_dev, a.m_max);
    const uint64_t pol = evict_first_policy();
    V2Pass p;
    p.ldw = a.w.ld;
    p.w = a.w.w + (int64_t)n0 * p.ldw;
    p.n_valid = min(BN, a.w.rows - n0);
    p.kx = a.kx;
    p.k_begin = 0;
    p.nk = a.w.ld / BK;
    float acc[V2_MT][2][4];
    float *tile = reinterpret_cast<float *>(smem); /* [cap][BN + 1], after the pipeline drained */
    for (int m0 = 0; m0 < M; m0 += c.cap) {
        p.m_valid = min(c.cap, M - m0);
        v2_set_x_rows(p, a.x, a.kx, m0, Identity{});
        uint32_t wpar = 0;
        v2_pass<W_ROWS>(p, smem, c.pool, pol, acc, wpar);
        store_acc(acc, tile, BN + 1, p.m_valid, p.n_valid);
        __syncthreads();
        head_epilogue(a, tile, m0, p.m_valid, n0, p.n_valid);
        __syncthreads();
    }
}

/* ====================== v3: persistent weight-streaming kernels (launch bounds <= 64 rows) ======================
 * The v1 / v2 arithmetic (the chain above), scheduled for decode and tree verify, where a pass has
 * few rows and the GEMM is a stream of weights. v2 gives every 64 columns a CTA of their own, whose
 * pipeline fills and drains by itself, and lets the hardware place the CTAs in waves (the 576
 * column tiles of a decode's 9 experts are 2.2 waves of 264). v3 keeps v2's pipeline (every
 * thread issues its W and X chunks by cp.async, group g = W block g + X block g + 1, X converted
 * once per CTA into a hi / lo double buffer, ldmatrix fragments, one barrier per stage block) and
 * changes what a CTA walks:
 *   - persistent CTAs: CTA b walks units b, b + gridDim.x, ... (dense: (column tile, split,
 *     batch); grouped: (item, column tile)); the stream of stage blocks runs on across unit
 *     boundaries, so a CTA fills its pipeline once, and a unit with more rows than a pass holds is
 *     walked once per pass;
 *   - a balanced grid: the fewest rounds of units the resident CTAs (`cps` per SM) allow, then just
 *     enough CTAs that every CTA gets the same number of units (576 units: 192 CTAs x 3, not
 *     264 CTAs with 48 of them doing a third);
 *   - a stage block may hold KB 64-wide K blocks (fewer barriers per byte);
 *   - a dense launch issues its first stages of weights before it reads the row count.
 * Measured on the H200 (docs/model_gpu.md, "GEMM v3"): bitwise equal to v1 / v2 under every
 * schedule, but slower than v2 in the Kimi layer (decode S = 1: 580 vs 450 us; verify: 1.9x vs
 * 1.4x the floor), hence opt-in (KDT_GEMM_V3=1). Suspected causes, not yet measured apart: each
 * cursor's unit change is a dependent chain of global loads (items, then the expert table) in
 * the CTA's loop, four cursors per unit; the pass's rows come from the launch bound, so a verify
 * pass of 17..64 rows gives 1-row items a 32- to 64-row X slot per stage and a 5-stage ring. An
 * earlier form (a producer warp issuing one 1-D bulk copy per W row and stage) was issue-bound:
 * ~2.4 us per stage block per CTA whatever the stage size, 1.3-1.8 TB/s.
 * A stage block is computed 64-wide block by block, k16 steps ascending, hi then lo per accumulator
 * (v2_compute's order): KB, the ring depth, CTAs per SM, the grid, the unit order and rows per pass
 * never reach an output's chain. Rows of a pass beyond its valid rows hold stale hi / lo values:
 * they only reach output rows that are never stored (rows never mix in mma). */
namespace v3 {

constexpr int NTHREADS = THREADS;              /* 4 warps; warp w owns columns 16w .. 16w + 15 */
constexpr int MAX_STAGES = V2_MAX_STAGES;      /* cp_async_wait_n covers the ring */
constexpr int ROWS = 64;                       /* most rows per pass (store_acc's 4 m-tiles) */

/* Launch configuration, chosen on the host (v3_plan) and passed by value. */
struct Layout {
    int stages;  /* ring depth (2..MAX_STAGES) */
    int rcap;    /* rows per pass: 8, 16, 32, 48 or 64 (rcap * KB <= 64) */
};

__host__ __device__ constexpr int bks(int kb) { return BK * kb; }                  /* K per stage block */
__host__ __device__ constexpr int row_elems(int kb) { return BK * kb + 8; }        /* bf16 per W / hi / lo row:
                                                                                      (64 kb + 8) * 2 B = 16 mod 128,
                                                                                      ldmatrix conflict-free */
__host__ __device__ constexpr int w_stage_bytes(int kb) { return BN * row_elems(kb) * 2; }
__host__ __device__ constexpr int x_slot_bytes(int kb, int rcap) { return rcap * bks(kb) * 4; }
__host__ __device__ constexpr int stage_bytes(int kb, int rcap) { return w_stage_bytes(kb) + x_slot_bytes(kb, rcap); }
__host__ __device__ constexpr int plane_bytes(int kb, int rcap) { return rcap * row_elems(kb) * 2; }
/* [hi, lo of buffer 0][hi, lo of buffer 1][stage 0: W | X] ... [stage S-1] */
__host__ __device__ constexpr int smem_bytes(int kb, int rcap, int stages) {
    return 4 * plane_bytes(kb, rcap) + stages * stage_bytes(kb, rcap);
}

/* One unit: 64 (or fewer) output columns over a K range, for all of its rows. */
struct Unit {
    const uint16_t *w;       /* W row n0 at the unit's first K column */
    int64_t ldw;
    int n_valid, nk;         /* valid columns; 64-wide K blocks (0: an empty split, stored as zeros) */
    int rows;                /* X rows of the unit, all passes */
    int kx, k_begin;         /* X columns >= kx read as 0; X column of the unit's first K */
    const float *x;          /* X row i of the unit: x + (gather ? gather[row0 + i] : row0 + i) * ldx */
    int64_t ldx;
    const int32_t *gather;
    int row0;
    float *y;                /* output row i of the unit: y + i * ldy (column n0) */
    int64_t ldy;
};

struct DenseP {
    kdt_gemm_args a;
    int n_tiles, n_units;
    int M;                   /* the pass's rows: set after the dependency wait */
    static constexpr bool GROUPED = false;
    __device__ int count() const { return n_units; }
    __device__ bool unit(int id, Unit &u) const {
        const int tile = id % n_tiles, rest = id / n_tiles, split = rest % a.splits, b = rest / a.splits;
        const int n0 = tile * BN;
        u.k_begin = split * a.k_chunk;
        u.nk = max(0, (min(u.k_begin + a.k_chunk, a.ldw) - u.k_begin) / BK);
        u.ldw = a.ldw;
        u.w = a.w + b * a.w_batch + (int64_t)n0 * a.ldw + u.k_begin;
        u.n_valid = min(BN, a.n - n0);
        u.rows = M;
        u.kx = a.kx;
        u.x = a.x + b * a.x_batch;
        u.ldx = a.ldx;
        u.gather = a.x_rows;
        u.row0 = 0;
        u.y = a.y + split * a.y_split + b * a.y_batch + n0;
        u.ldy = a.ldy;
        return true;
    }
};

struct GroupedP {
    kdt_grouped_args a;
    int n_tiles;
    static constexpr bool GROUPED = true;
    __device__ int count() const { return *a.n_items * n_tiles; }
    __device__ bool unit(int id, Unit &u) const {
        const int item = id / n_tiles, n0 = (id % n_tiles) * BN;
        const int e = a.items[3 * item], p0 = a.items[3 * item + 1];
        const kdt_gpu_expert ex = a.experts[e];
        const int N = a.which == 0 ? 2 * ex.i_pad : a.kd;
        if (n0 >= N) return false;
        u.ldw = a.which == 0 ? ex.ld_d : ex.ld_i;
        u.w = (a.which == 0 ? ex.gu : ex.down) + (int64_t)n0 * u.ldw;
        u.n_valid = min(BN, N - n0);
        u.nk = (int)(u.ldw / BK);
        u.rows = a.items[3 * item + 2];
        u.kx = a.which == 0 ? a.kd : ex.inter;
        u.k_begin = 0;
        u.x = a.x;
        u.ldx = a.ldx;
        u.gather = a.which == 0 ? a.pair_row : nullptr;
        u.row0 = p0;
        u.y = a.y + (int64_t)p0 * a.ldy + n0;
        u.ldy = a.ldy;
        return true;
    }
};

/* A position in a CTA's sequence of stage blocks: (unit, pass, stage block). Every cursor of a
 * CTA walks the same sequence. */
template <int KB, typename P>
struct Seq {
    Unit u;
    int id, n_units, n_pass, pass, n_sb, sb;
    bool valid;
    __device__ void next_unit(const P &p, int rcap) {
        for (;;) {
            id += gridDim.x;
            if (id >= n_units) {
                valid = false;
                return;
            }
            if (!p.unit(id, u)) continue;
            n_pass = P::GROUPED ? (u.rows + rcap - 1) / rcap : 1; /* dense: M <= rcap (launch bound) */
            if (n_pass <= 0) continue;
            n_sb = u.nk > 0 ? (u.nk + KB - 1) / KB : 1;
            pass = 0;
            sb = 0;
            valid = true;
            return;
        }
    }
    __device__ void start(const P &p, int rcap, int n) {
        n_units = n;
        id = (int)blockIdx.x - (int)gridDim.x;
        valid = false;
        next_unit(p, rcap);
    }
    __device__ void advance(const P &p, int rcap) {
        if (!valid) return;
        if (++sb < n_sb) return;
        sb = 0;
        if (++pass < n_pass) return;
        next_unit(p, rcap);
    }
    __device__ int nsub() const { return max(0, min(KB, u.nk - sb * KB)); } /* 64-wide blocks here */
    __device__ int m_valid(int rcap) const { return min(rcap, u.rows - pass * rcap); }
};

/* X chunks of a thread: 16-byte chunk (tid % CPR) of rows tid / CPR + RPI * i, i < 8. */
template <int KB>
struct XMap {
    static constexpr int CPR = bks(KB) / 4;    /* chunks per row */
    static constexpr int RPI = NTHREADS / CPR; /* rows per step: rcap <= 8 RPI (rcap * KB <= 64) */
    static_assert(RPI * CPR == NTHREADS, "X chunk map");
};

/* The X row pointers of a pass for this thread's chunks. */
struct XRows {
    const float *row[8];
    uint32_t align;        /* bit i: row[i] is 16-byte aligned */
    int id, pass;          /* the (unit, pass) they belong to */
};

template <int KB, typename P>
__device__ __forceinline__ void x_rows(const Seq<KB, P> &q, int rcap, XRows &xr) {
    using M = XMap<KB>;
    const int mv = q.m_valid(rcap), r0 = threadIdx.x / M::CPR;
    xr.align = 0;
    xr.id = q.id;
    xr.pass = q.pass;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = r0 + M::RPI * i;
        xr.row[i] = nullptr;
        if (r < mv) {
            const int idx = q.u.row0 + q.pass * rcap + r;
            xr.row[i] = q.u.x + (int64_t)(q.u.gather ? q.u.gather[idx] : idx) * q.u.ldx;
            if (((uintptr_t)xr.row[i] & 15) == 0) xr.align |= 1u << i;
        }
    }
}

/* X of stage block q (fp32, zero at k >= kx; v1's X tile values) into an X slot [rcap][bks]:
 * this thread's chunks. */
template <int KB, typename P>
__device__ __forceinline__ void load_x(const Seq<KB, P> &q, int rcap, const XRows &xr, float *slot) {
    using M = XMap<KB>;
    const int mv = q.m_valid(rcap), cc = threadIdx.x % M::CPR, r0 = threadIdx.x / M::CPR;
    if (cc * 4 >= q.nsub() * BK) return;
    const int k = q.u.k_begin + q.sb * bks(KB) + cc * 4, kx = q.u.kx;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = r0 + M::RPI * i;
        if (r >= mv) break;
        load_x4(slot + r * bks(KB) + cc * 4, xr.row[i], k, kx, (xr.align >> i) & 1);
    }
}

/* W of stage block q into a stage: per 64-wide block, thread tid copies chunk (tid & 7) of rows
 * (tid >> 3) + 16 i (v2_load_w); rows >= n_valid are zero-filled. */
template <int KB, typename P>
__device__ __forceinline__ void load_w(const Seq<KB, P> &q, uint16_t *ws, uint64_t pol) {
    const int tid = threadIdx.x, r0 = tid >> 3, c = (tid & 7) * 8, ns = q.nsub();
    const uint16_t *src = q.u.w + (int64_t)r0 * q.u.ldw + q.sb * bks(KB) + c;
    const int64_t step = 16 * q.u.ldw;
#pragma unroll
    for (int b = 0; b < KB; b++) {
        if (b < ns) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const bool ok = r0 + 16 * i < q.u.n_valid;
                cp_async16_pol(ws + (r0 + 16 * i) * row_elems(KB) + b * BK + c, ok ? src + i * step + b * BK : q.u.w,
                               ok ? 16 : 0, pol);
            }
        }
    }
}

/* This thread's chunks of an X slot -> hi / lo planes (split_bf16, as v1 per fragment). */
template <int KB>
__device__ __forceinline__ void convert_x(int mv, int ncols, const float *slot, uint16_t *hi, uint16_t *lo) {
    using M = XMap<KB>;
    const int cc = threadIdx.x % M::CPR, r0 = threadIdx.x / M::CPR;
    if (cc * 4 >= ncols) return;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int r = r0 + M::RPI * i;
        if (r >= mv) break;
        const float4 v = *reinterpret_cast<const float4 *>(slot + r * bks(KB) + cc * 4);
        uint2 h, l;
        split_bf16(make_float2(v.x, v.y), h.x, l.x);
        split_bf16(make_float2(v.z, v.w), h.y, l.y);
        *reinterpret_cast<uint2 *>(hi + r * row_elems(KB) + cc * 4) = h;
        *reinterpret_cast<uint2 *>(lo + r * row_elems(KB) + cc * 4) = l;
    }
}

/* acc += X W^T over the nsub 64-wide blocks of a stage block, each as v2_compute: per k16 step,
 * per accumulator, hi then lo. */
template <int KB>
__device__ __forceinline__ void compute(const uint16_t *ws, const uint16_t *hi, const uint16_t *lo, int nsub,
                                        bool half, int mtiles, float (&acc)[V2_MT][2][4]) {
    constexpr int RE = row_elems(KB);
#pragma unroll
    for (int q = 0; q < KB; q++)
        if (q < nsub) k64_compute<RE, RE>(ws + q * BK, hi + q * BK, lo + q * BK, half, mtiles, acc);
}

/* Stage block b of a CTA's sequence lives in stage b % S (its W and its X); cp.async group g
 * holds W block g and X block g + 1 (group 0: W blocks 0 .. S-2 and X blocks 0, 1; groups
 * 1 .. S-2 of the prologue: X only), so when block j is computed, groups <= j have landed: W j
 * and X j + 1, which is converted while the tensor cores work on j. */
template <int KB, typename P>
__global__ void __launch_bounds__(NTHREADS, P::GROUPED ? 2 : 3) v3_kernel(const P prob, const Layout L) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int S = L.stages, rcap = L.rcap;
    const int plane = rcap * row_elems(KB);      /* elements of one hi or lo plane */
    const int sbytes = stage_bytes(KB, rcap);
    uint16_t *xc = reinterpret_cast<uint16_t *>(smem);
    unsigned char *st = smem + 4 * plane_bytes(KB, rcap);
#define V3_W(s) reinterpret_cast<uint16_t *>(st + (s) * sbytes)
#define V3_X(s) reinterpret_cast<float *>(st + (s) * sbytes + w_stage_bytes(KB))
    P p = prob;
    const uint64_t pol = evict_first_policy();
    Seq<KB, P> Wc;                               /* the next W block to load */
    int wj = 0;                                  /* W blocks issued */
    if constexpr (!P::GROUPED) {                 /* the first weights before the row count */
        p.M = 0;
        Wc.start(p, rcap, p.count());
        for (; wj < S - 1 && Wc.valid; wj++) {
            load_w(Wc, V3_W(wj), pol);
            Wc.advance(p, rcap);
        }
    }
    if constexpr (!P::GROUPED) p.M = clamp_m(p.a.m_dev, p.a.m_max);
    Seq<KB, P> C;                                /* block j (compute) */
    C.start(p, rcap, p.count());
    if constexpr (P::GROUPED) {
        Wc = C;
        for (; wj < S - 1 && Wc.valid; wj++) {
            load_w(Wc, V3_W(wj), pol);
            Wc.advance(p, rcap);
        }
    }
    if (!C.valid) {
        cp_async_wait<0>();
        return;
    }
    Seq<KB, P> Xc = C, V = C;                    /* the next X block to load; block j + 1 (convert) */
    V.advance(p, rcap);
    XRows xr;
    xr.id = -1;
    xr.pass = -1;
    for (int g = 0; g <= S - 1; g++) {           /* X blocks 0 .. S-1: 0 and 1 in group 0, g + 1 in group g */
        if (Xc.valid) {
            if (Xc.id != xr.id || Xc.pass != xr.pass) x_rows(Xc, rcap, xr);
            load_x(Xc, rcap, xr, V3_X(g));
            Xc.advance(p, rcap);
        }
        if (g >= 1) cp_async_commit();
    }
    cp_async_wait_n(S - 2);                      /* group 0 */
    convert_x<KB>(C.m_valid(rcap), C.nsub() * BK, V3_X(0), xc, xc + plane);
    float acc[V2_MT][2][4];
    zero_acc(acc);
    int cs = 0;                                  /* stage of block j */
    for (int j = 0; C.valid; j++) {
        cp_async_wait_n(S - 2);                  /* groups <= j: W j, X j + 1 (this thread's chunks) */
        __syncthreads();                         /* ... of every thread; block j - 1 consumed */
        const int ls = cs == 0 ? S - 1 : cs - 1; /* stage of block j - 1 = of block j + S - 1 */
        if (Wc.valid) {
            load_w(Wc, V3_W(ls), pol);
            Wc.advance(p, rcap);
        }
        if (Xc.valid) {                          /* X j + S into block j's X slot (converted) */
            if (Xc.id != xr.id || Xc.pass != xr.pass) x_rows(Xc, rcap, xr);
            load_x(Xc, rcap, xr, V3_X(cs));
            Xc.advance(p, rcap);
        }
        cp_async_commit();
        const int xs = cs + 1 == S ? 0 : cs + 1; /* stage of block j + 1 */
        uint16_t *cur = xc + (j & 1) * 2 * plane, *nxt = xc + ((j + 1) & 1) * 2 * plane;
        if (V.valid) convert_x<KB>(V.m_valid(rcap), V.nsub() * BK, V3_X(xs), nxt, nxt + plane);
        const int mv = C.m_valid(rcap);
        compute<KB>(V3_W(cs), cur, cur + plane, C.nsub(), mv <= 8, (mv + 15) >> 4, acc);
        if (C.sb == C.n_sb - 1) {                /* the pass is complete */
            store_acc(acc, C.u.y + (int64_t)C.pass * rcap * C.u.ldy, C.u.ldy, mv, C.u.n_valid);
#pragma unroll
            for (int mt = 0; mt < V2_MT; mt++)
#pragma unroll
                for (int jj = 0; jj < 2; jj++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[mt][jj][e] = 0.0f;
        }
        cs = xs;
        C = V;
        V.advance(p, rcap);
    }
#undef V3_W
#undef V3_X
    cp_async_wait<0>();
}

} // namespace v3

/* Rows per pass for a pool (gt_v2_cap): cap 0 when the pool runs nothing, which every caller
 * that builds a pool from a device's size checks (v2_config_grid, v2_config_per_sm). */
V2Cfg v2_config_pool(int pool) {
    V2Cfg c;
    c.pool = pool;
    c.cap = gt_v2_cap(pool);
    return c;
}
V2Cfg v2_config(int stages) { return v2_config_pool(pool_bytes(stages)); }

struct DevSm {
    int n_sm, smem_per_sm; /* 0 when the query failed */
};
DevSm dev_sm() {
    DevSm d = {0, 0};
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&d.n_sm, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        kdt_smem_per_sm(dev, &d.smem_per_sm) != cudaSuccess) {
        cudaGetLastError(); /* a failed query only forgoes the shaping */
        d.n_sm = d.smem_per_sm = 0;
    }
    return d;
}
int pool_per_sm(int smem_per_sm, int k) { return gt_pool_per_sm(smem_per_sm, k); }

/* Wave shaping of a dense GEMM (scheduling only: the pool and rows per pass never reach the
 * chain). The runner's pool puts two CTAs on an SM; a grid a little larger than two per SM (o_proj
 * (112, 3) = 336 CTAs, q_b (192, 2) = 384, W_UK (8, 1, 64) = 512 at 132 SMs) would then run as
 * a full wave plus a thin tail wave. When 3 or 4 CTAs per SM with a proportionally smaller pool
 * hold the whole grid at once and that pool still runs every row of the launch bound in one pass
 * with >= 3 stages (decode-sized bounds), use it: one wave, the same bytes in flight per SM.
 * Launches of more than 32 rows (tree verify of 33+ nodes) whose grid fits 3 per SM may take that
 * pool too (wide3_on), with passes of up to 48 rows at 2 stages, where that adds no pass (bounds
 * of 33-48, 65-96, 129-144, ... rows read the W stream as often as at 2 per SM; 49-64 rows, a
 * decode of 64 streams, and 97-128 stay). At 2 per SM these launches (q_b, o_proj, the shared
 * expert's two GEMMs at Kimi's shapes) ran 1.2-1.45 waves of 64-row passes, and a 65-row bound
 * passed 64 rows, then 1 (here 48 + 17). H100, in-process A B B A (sessions 33 and 34): correlated
 * verify N 65 1,845 / 1,859 -> 1,679 / 1,678 us per layer, N 33 1,173 / 1,169 -> 1,084 / 1,071,
 * random N 65 -1.7 %; gpu_test_gemm_ab runs o_proj's shape through the launcher with it on and
 * off. The default; KDT_GEMM_WIDE3=0 (read per launch, so an in-process A/B can switch it) keeps
 * session 32's 2 per SM. */
constexpr int V2_WIDE3_ROWS = 48;
bool wide3_on(int m_max) {
    return m_max > 32 && (m_max + V2_WIDE3_ROWS - 1) / V2_WIDE3_ROWS <= (m_max + V2_ROWS - 1) / V2_ROWS &&
           !kdt_g_env_is("KDT_GEMM_WIDE3", '0');
}
V2Cfg v2_config_grid(int stages, int64_t ctas, int m_max, int k_max = 4, int *per_sm_used = nullptr) {
    const V2Cfg c = v2_config(stages);
    if (per_sm_used) *per_sm_used = 2;
    const DevSm d = dev_sm();
    if (d.smem_per_sm <= 0) return c;
    const int n_sm = d.n_sm, per_sm = d.smem_per_sm;
    const int rows = m_max < V2_ROWS ? m_max : V2_ROWS;
    if ((2 * (c.pool + 1024) > per_sm) || ctas <= 2 * (int64_t)n_sm) return c;
    for (int k = 3; k <= k_max; k++) {
        if (ctas > k * (int64_t)n_sm) continue;
        const int pool = pool_per_sm(per_sm, k);
        if (pool >= c.pool) return c;
        V2Cfg ck = v2_config_pool(pool);
        /* passes of up to 48 rows at >= 2 stages (wide3_on, 3 per SM), else every row in one pass
         * at >= 3 stages */
        const int r = rows < V2_WIDE3_ROWS ? rows : V2_WIDE3_ROWS;
        const bool wide3 = k == 3 && wide3_on(m_max) && v2_stages(v2_tile_rows(r), pool) >= 2 &&
                           v2_stages_bulk(v2_tile_rows(r), pool) >= 2;
        const bool whole = ck.cap >= rows && v2_stages(v2_tile_rows(rows), pool) >= 3 &&
                           v2_stages_bulk(v2_tile_rows(rows), pool) >= 3;
        if ((wide3 || whole) && V2_ROWS * (BN + 1) * 4 <= pool) {
            if (wide3) ck.cap = r;
            if (per_sm_used) *per_sm_used = k;
            return ck;
        }
        return c;
    }
    return c;
}

/* The bulk-copy W loader for tiled weights (the default on compute capability >= 9;
 * KDT_GEMM_BULK_W=0 keeps cp.async; read once): one 8 KB bulk copy per stage (the TMA engine)
 * instead of 512 cp.async. Measured with 5 CTAs per SM (H200, bench/RESULTS.md session 8): the
 * decode's gate/up 127 us instead of 146 (tiled, cp.async) and 151 (row-major); with 2 CTAs per
 * SM it was slower than cp.async, so it comes with the grouped policy below. */
bool read_bulk_w() {
    if (kdt_g_env_is("KDT_GEMM_BULK_W", '0')) return false;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return major >= 9;
}
bool bulk_w() {
    static const bool on = read_bulk_w();
    return on;
}
/* CTAs per SM of a grouped launch (scheduling only: the bits stay v1's). The runner's pool
 * puts 2 CTAs on an SM; grouped launches stream expert weights for very few rows per item, and
 * more, smaller CTAs per SM stream them faster (H200, session 8, gpu_test_gemm_ab --wave and the
 * Kimi layer: bench/RESULTS.md). The policy:
 *  - rows per item <= 8 (decode, S <= 8): 5 per SM (v2_grouped_kernel<5>, whose 45.5 KB pool
 *    holds 3 stages of 8-row passes), or 4 when that fills the last wave clearly better (the
 *    wave efficiency ctas / (slots * waves) of the launch's item hint: a decode's down GEMM,
 *    1,008 CTAs, is 0.76 at 5 and 0.95 at 4);
 *  - more rows but <= 16 per item on average (tree verify, where only the shared expert has
 *    them all; prefill chunks up to ~600 tokens): 4 per SM, 3 stages of 16-row passes; an item
 *    with more rows takes more passes;
 *  - more rows on average (large prefill chunks): the runner's pool, 64-row passes;
 *  - a grid of <= 2 CTAs per SM (small models, a few experts): the runner's pool, which keeps
 *    more of each CTA's stream in flight (E 1 / 2 / 4 experts x 1 row at K 7168: 59 / 60 / 73 us
 *    at 2 per SM, 63 / 64 / 77 at 4, 83 / 83 / 92 at 5); cp.async, not bulk copies, there
 *    (bulk at 2 per SM: 69 us for E 1).
 * Decode S 1 of the Kimi layer: 439 -> 360 us with tiled weights and the bulk loader; verify
 * N 9..65: 1.35..1.41x -> 1.12..1.20x of the floor.
 * The choice itself is gt_grouped_per_sm (gemm_tiles.cuh; its cases in tests/test_gemm_tiles.c).
 * KDT_GEMM_GROUPED_PER_SM=k (2..5; read once) forces k (2 = the runner's pool, the old default). */
int env_int(const char *name, int lo, int hi) {
    const char *e = getenv(name);
    if (!e || !*e) return 0;
    const int v = atoi(e);
    return v >= lo && v <= hi ? v : 0;
}
int grouped_per_sm_env() {
    static const int k = env_int("KDT_GEMM_GROUPED_PER_SM", 2, 5);
    return k;
}
/* The pool of k CTAs per SM, fewer where k's pool is too small for the pipeline (gt_v2_grouped_k:
 * a 100 KB SM's 5-per-SM pool held 1 stage and its passes ran past the pool), or the runner's
 * (per_sm_used 2) when k <= 2, the device query failed or no smaller pool runs. */
V2Cfg v2_config_per_sm(int stages, int k, const DevSm &d, int *per_sm_used) {
    const V2Cfg c = v2_config(stages);
    *per_sm_used = 2;
    if (k <= 2 || d.smem_per_sm <= 0) return c;
    k = gt_v2_grouped_k(k, d.smem_per_sm, c.pool);
    if (k <= 2) return c;
    const int pool = pool_per_sm(d.smem_per_sm, k);
    *per_sm_used = k;
    V2Cfg ck = v2_config_pool(pool);
    /* passes as long as 2 stages still fit (32 rows at 4 per SM instead of 16), for items of many
     * rows (correlated routing: ~60 rows per expert took 4 passes of 16, each re-reading the
     * expert's W slice); 1-16-row passes are unchanged (a pass's stage count follows its own
     * rows). H200, session 9, Kimi layer over 4 layers: correlated verify N 17 / 33 / 65 1,006 /
     * 1,581 / 2,676 -> 920 / 1,444 / 2,394 us, random verify and decode unchanged (within 1 %).
     * KDT_GEMM_GROUPED_CAP2=0 (read once) keeps the 3-stage cap. */
    static const bool cap2 = !kdt_g_env_is("KDT_GEMM_GROUPED_CAP2", '0');
    if (cap2)
        for (int r = V2_ROWS; r > ck.cap; r -= 16)
            if (v2_stages(r, pool) >= 2 && v2_stages_bulk(r, pool) >= 2) {
                ck.cap = r;
                break;
            }
    return ck;
}
V2Cfg v2_config_grouped(int stages, const kdt_grouped_args &a, int *per_sm) {
    const DevSm d = dev_sm();
    int k = grouped_per_sm_env();
    if (k == 0) {
        const int64_t items = a.n_items_hint > 0 ? a.n_items_hint : (a.grid_items > 0 ? a.grid_items : 1);
        k = gt_grouped_per_sm(a.max_item_rows > 0 ? a.max_item_rows : V2_ROWS, items, a.n_pairs_hint,
                              items * ((a.n_max + BN - 1) / BN), d.n_sm);
    }
    return v2_config_per_sm(stages, k, d, per_sm);
}
static_assert(V2_ROWS * (BN + 1) * 4 <= 55296, "argmax tile fits the smallest pool");
static_assert(v2_xc_bytes(16) + 3 * v2_stage_bytes(16) <= 55296, "the smallest pool runs 16-row passes");

/* KDT_GEMM_V1=1: the original kernels (read once per process; both give the same bits). */
bool use_v1() {
    static const bool v1 = kdt_g_env_is("KDT_GEMM_V1", '1');
    return v1;
}

template <typename K>
cudaError_t set_smem(K kernel, size_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}

/* The wgmma GEMM (gemm_wg.cuh): whether each device runs real wgmma code with the shared memory it
 * needs (set by kdt_gemm_init: 1 yes, 2 no, 0 not asked), and the switch (on unless KDT_GEMM_WG=0). */
int g_wg_ready[16];
bool wg_on() {
    static const bool on = !kdt_g_env_is("KDT_GEMM_WG", '0');
    return on;
}
/* the A-from-shared-memory forms (on unless KDT_GEMM_WG_SS=0; a launch takes them where its caller
 * gives a workspace for X's planes) */
bool wg_ss_on() { return !kdt_g_env_is("KDT_GEMM_WG_SS", '0'); }
/* The smallest launch, in rows, for the wgmma kernels: KDT_GEMM_WG_MIN, else 64 for the ss forms
 * (session 47, H100: Kimi dense projections at M 65 0.96-1.10x of v2, a correlated 65-node verify
 * layer 1,432 -> 1,236 us) and 128 for the register forms (0.87-0.97x of v2 at M 65). Read per
 * launch (a graph captures the choice), so bench_model's in-process A/B (KDT_BENCH_MODEL_AB) can
 * set it. */
int wg_min_rows(bool ss) {
    const int v = env_int("KDT_GEMM_WG_MIN", 1, 1 << 30);
    return v ? v : ss ? 64 : 128;
}
bool wg_dev_ready() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) {
        cudaGetLastError();
        return false;
    }
    return g_wg_ready[dev] == 1;
}
bool wg_wanted(const kdt_gemm_args *a, bool ss) {
    return wg_on() && !use_v1() && a->m_max >= wg_min_rows(ss) && wg_dev_ready();
}
/* the grouped form: passes of at least KDT_GEMM_WG_PAIRS (token, expert) pairs whose items may
 * hold 32 rows or more: 256 for the ss form, 8 x the row bound (1,024) for the register form. The
 * host knows the pass's pairs, not how they spread over the experts (a correlated tree's 65 rows
 * fill ~11 experts' items, a random one's ~284), so the runner's launches leave the last word to
 * the plan on the device (kdt_grouped_launch_ws, ss_item_rows). Session 47 (ss always once the
 * bound is met): 512 neutral for random trees and decode on an H100, a gain for correlated trees,
 * 72 a loss at 9 and 17 rows. Session 50 (H200, with the device's choice): 256 takes a correlated
 * 33-node verify (264 pairs, ~15 rows per item) to ss, 914.8 / 915.9 -> 863.9 / 863.3 us per layer,
 * a random one (~1.4 per item, v2 either way) 3,996.6 / 3,992.6 -> 4,014.8 / 4,015.9. */
int wg_min_pairs(bool ss) {
    const int v = env_int("KDT_GEMM_WG_PAIRS", 1, 1 << 30);
    if (v) return v;
    if (!ss || env_int("KDT_GEMM_WG_MIN", 1, 1 << 30)) return 8 * wg_min_rows(ss); /* KDT_GEMM_WG_MIN moves it */
    return 256;
}
bool wg_grouped_wanted(int max_item_rows, int n_pairs, bool ss) {
    return wg_on() && !use_v1() && max_item_rows >= KDT_G_ITEM_ROWS_MIN && n_pairs >= wg_min_pairs(ss) &&
           wg_dev_ready();
}
/* Asks device `dev` (the current one) whether its code for wgg::wg_gemm_kernel has wgmma and
 * allows the kernel its shared memory; once per device, at runner creation unless switched off
 * (a synchronous copy: never during a capture). Any failure leaves the kernel unused. */
void wg_setup(int dev, int optin) {
    if (dev < 0 || dev >= 16 || g_wg_ready[dev]) return;
    g_wg_ready[dev] = 2;
    if (optin < wgg::SMEM) return;
    int *d = nullptr, h = 0;
    cudaError_t e = cudaMalloc(&d, sizeof(int));
    if (e == cudaSuccess) {
        wgg::wg_probe<<<1, 1>>>(d);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
    if (d) cudaFree(d);
    if (e == cudaSuccess && h == 1) e = set_smem(wgg::wg_gemm_kernel, (size_t)wgg::SMEM);
    if (e == cudaSuccess && h == 1) e = set_smem(wgg::wg_grouped_kernel, (size_t)wgg::G_SMEM);
    if (e == cudaSuccess && h == 1) e = set_smem(wgg::wg_gemm_ss_kernel, (size_t)wgg::S_SMEM);
    if (e == cudaSuccess && h == 1) e = set_smem(wgg::wg_grouped_ss_kernel, (size_t)wgg::GS_SMEM);
    if (e == cudaSuccess && h == 1) g_wg_ready[dev] = 1;
    cudaGetLastError(); /* a failure here is not the runner's */
}

template <typename K>
cudaError_t set_smem_v2(K kernel, size_t bytes) {
    cudaError_t e = set_smem(kernel, bytes);
    /* two 113 KB CTAs per SM need the largest shared-memory carveout (a hint) */
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int)cudaSharedmemCarveoutMaxShared);
    return e;
}

kdt_status launch_error(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", what, cudaGetErrorString(e));
    return KDT_OK;
}

/* ---- v3 on the host ---------------------------------------------------------------------------
 * Switches (read once per process; A/B runs and tuning, none changes a bit): KDT_GEMM_V3=1 (v3
 * for the launches it takes; default off), KDT_GEMM_V3_KB=1|2|4 (64-wide K blocks per stage
 * block), KDT_GEMM_V3_CPS=1..4 (CTAs per SM), KDT_GEMM_V3_BAL=0 (a CTA per resident slot instead
 * of the balanced grid). */
struct V3Tune {
    int on, kb, cps, bal; /* kb, cps: 0 = automatic */
};
V3Tune v3_read_env() {
    V3Tune t = {0, 0, 0, 1};
    const char *e;
    if ((e = getenv("KDT_GEMM_V3")) && e[0] == '1') t.on = 1;
    if ((e = getenv("KDT_GEMM_V3_KB"))) t.kb = atoi(e);
    if ((e = getenv("KDT_GEMM_V3_CPS"))) t.cps = atoi(e);
    if ((e = getenv("KDT_GEMM_V3_BAL"))) t.bal = atoi(e) != 0;
    return t;
}
V3Tune &v3_tune() {
    static V3Tune t = v3_read_env();
    return t;
}

/* What v3 needs to know about the current device (queried once per device, by kdt_gemm_init). */
struct V3Dev {
    int known, ok, n_sm, per_sm, optin;
    int max_cps[2][3];       /* CTAs per SM the registers allow: [grouped][kb 1, 2, 4] */
};
constexpr int V3_MAX_DEV = 16;
V3Dev g_v3dev[V3_MAX_DEV];

int kb_index(int kb) { return kb == 1 ? 0 : (kb == 2 ? 1 : 2); }

template <int KB, typename P>
int v3_reg_cps() {
    int nb = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, v3::v3_kernel<KB, P>, v3::NTHREADS, 0) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return nb;
}

const V3Dev *v3_dev() {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= V3_MAX_DEV) {
        cudaGetLastError();
        return nullptr;
    }
    V3Dev &d = g_v3dev[dev];
    if (!d.known) {
        d.ok = cudaDeviceGetAttribute(&d.n_sm, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess &&
               kdt_smem_per_sm(dev, &d.per_sm) == cudaSuccess && kdt_smem_optin(dev, &d.optin) == cudaSuccess &&
               d.n_sm > 0;
        if (d.ok) {
            d.max_cps[0][0] = v3_reg_cps<1, v3::DenseP>();
            d.max_cps[0][1] = v3_reg_cps<2, v3::DenseP>();
            d.max_cps[0][2] = v3_reg_cps<4, v3::DenseP>();
            d.max_cps[1][0] = v3_reg_cps<1, v3::GroupedP>();
            d.max_cps[1][1] = v3_reg_cps<2, v3::GroupedP>();
            d.max_cps[1][2] = v3_reg_cps<4, v3::GroupedP>();
        }
        cudaGetLastError();
        d.known = 1;
    }
    return d.ok ? &d : nullptr;
}

bool v3_on() { return !use_v1() && v3_tune().on && v3_dev() != nullptr; }

struct V3Plan {
    v3::Layout L;
    int kb;
    unsigned grid;
    size_t smem;
};

/* Scheduling of one v3 launch: rows per pass from the launch's row bound; CTAs per SM (2, or 3 / 4
 * when that makes the units one round, as far as registers allow); K blocks per stage block (1
 * unless KDT_GEMM_V3_KB, fewer where the ring would hold < 3 stages); the deepest ring the pool
 * holds; then the balanced grid: rounds = ceil(units / slots), CTAs = ceil(units / rounds).
 * `units` is exact for dense launches and an estimate for grouped ones (only the balance depends
 * on it). False: no layout fits (the caller takes v2). */
bool v3_plan(int rows_bound, int64_t units, bool grouped, V3Plan &pl) {
    const V3Dev *d = v3_dev();
    if (!d || units < 1) return false;
    const V3Tune &t = v3_tune();
    const int rcap = v2_tile_rows(rows_bound < 1 ? 1 : (rows_bound > v3::ROWS ? v3::ROWS : rows_bound));
    const int kb_max = rcap <= 16 ? 4 : (rcap <= 32 ? 2 : 1);
    int kb = t.kb >= 4 ? 4 : (t.kb >= 2 ? 2 : 1);
    if (kb > kb_max) kb = kb_max;
    int cps = t.cps;
    if (cps < 1 || cps > 4) {
        cps = 2;
        for (int k = 3; k <= 4; k++)
            if (units > 2 * (int64_t)d->n_sm && units <= k * (int64_t)d->n_sm) {
                cps = k;
                break;
            }
    }
    for (; cps >= 1; cps--) {
        for (int kbt = kb; kbt >= 1; kbt /= 2) {
            if (d->max_cps[grouped][kb_index(kbt)] < cps) continue;
            int pool = d->per_sm / cps - 1024;
            if (pool > d->optin) pool = d->optin;
            pool &= ~127;
            int stages = (pool - 4 * v3::plane_bytes(kbt, rcap)) / v3::stage_bytes(kbt, rcap);
            if (stages > v3::MAX_STAGES) stages = v3::MAX_STAGES;
            if (stages < (kbt > 1 ? 3 : 2)) continue; /* a shallow ring: fewer K blocks per stage block */
            pl.kb = kbt;
            pl.L.stages = stages;
            pl.L.rcap = rcap;
            pl.smem = (size_t)v3::smem_bytes(kbt, rcap, stages);
            const int64_t slots = (int64_t)cps * d->n_sm, rounds = (units + slots - 1) / slots;
            const int64_t ctas = t.bal ? (units + rounds - 1) / rounds : (units < slots ? units : slots);
            pl.grid = (unsigned)ctas;
            return true;
        }
    }
    return false;
}

/* (errors: cudaGetLastError, as every launch here) */
template <typename P>
void v3_launch(const P &p, const V3Plan &pl, cudaStream_t s) {
    switch (pl.kb) {
    case 1: v3::v3_kernel<1, P><<<pl.grid, v3::NTHREADS, pl.smem, s>>>(p, pl.L); break;
    case 2: v3::v3_kernel<2, P><<<pl.grid, v3::NTHREADS, pl.smem, s>>>(p, pl.L); break;
    default: v3::v3_kernel<4, P><<<pl.grid, v3::NTHREADS, pl.smem, s>>>(p, pl.L); break;
    }
}

template <int KB, typename P>
cudaError_t v3_set_attrs(int bytes) {
    cudaError_t e = set_smem(v3::v3_kernel<KB, P>, (size_t)bytes);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(v3::v3_kernel<KB, P>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int)cudaSharedmemCarveoutMaxShared);
    return e;
}

/* The dense launch in v3 form, or false (v2 then runs it): row bound <= 64, aligned weights. */
bool v3_dense(const kdt_gemm_args &a, v3::DenseP &p, V3Plan &pl) {
    if (!v3_on() || a.m_max > v3::ROWS || ((uintptr_t)a.w & 15) || (a.w_batch & 7)) return false;
    p.a = a;
    p.n_tiles = (a.n + BN - 1) / BN;
    p.n_units = p.n_tiles * a.splits * (a.batch > 0 ? a.batch : 1);
    p.M = 0;
    if (p.a.batch < 1) p.a.batch = 1;
    return v3_plan(a.m_max, p.n_units, false, pl);
}

bool v3_grouped(const kdt_grouped_args &a, v3::GroupedP &p, V3Plan &pl) {
    if (!v3_on()) return false;
    p.a = a;
    p.n_tiles = (a.n_max + BN - 1) / BN;
    const int rows = a.max_item_rows > 0 && a.max_item_rows < v3::ROWS ? a.max_item_rows : v3::ROWS;
    const int items = a.n_items_hint > 0 ? a.n_items_hint : (a.grid_items > 0 ? a.grid_items : 1);
    return v3_plan(rows, (int64_t)items * p.n_tiles, true, pl);
}

} // namespace


/* v2 tiles a pass by its launch bound (v2_tile_rows: 8, then multiples of 16); v1 runs 64-row
 * passes whose cost hardly depends on the rows used. */
extern "C" void kdt_gpu_row_padding(int32_t *first, int32_t *step) {
    const int v1 = use_v1();
    if (first) *first = v1 ? BM : v2_tile_rows(1);
    if (step) *step = v1 ? BM : v2_tile_rows(9);
}

extern "C" size_t kdt_gemm_smem_bytes(int32_t stages) { return (size_t)pool_bytes(stages); }

extern "C" int32_t kdt_gemm_stages_for(int smem_per_sm, int smem_optin) {
    for (int32_t s = 4; s >= 2; s--)
        if (2 * pool_bytes(s) + 2048 <= smem_per_sm && pool_bytes(s) <= smem_optin) return s;
    for (int32_t s = 4; s >= 2; s--)
        if (pool_bytes(s) <= smem_optin) return s;
    return 2;
}

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
    if (stages < 2 || stages > 4) return kdt_fail(KDT_ERR_INTERNAL, "kdt_gemm_init: %d stages", stages);
    const size_t bytes = kdt_gemm_smem_bytes(stages);
    switch (stages) {
    case 2:
        if (e == cudaSuccess) e = set_smem(v1::gemm_kernel<2>, bytes);
        if (e == cudaSuccess) e = set_smem(v1::grouped_kernel<2>, bytes);
        if (e == cudaSuccess) e = set_smem(v1::head_kernel<2>, bytes);
        break;
    case 3:
        if (e == cudaSuccess) e = set_smem(v1::gemm_kernel<3>, bytes);
        if (e == cudaSuccess) e = set_smem(v1::grouped_kernel<3>, bytes);
        if (e == cudaSuccess) e = set_smem(v1::head_kernel<3>, bytes);
        break;
    default:
        if (e == cudaSuccess) e = set_smem(v1::gemm_kernel<4>, bytes);
        if (e == cudaSuccess) e = set_smem(v1::grouped_kernel<4>, bytes);
        if (e == cudaSuccess) e = set_smem(v1::head_kernel<4>, bytes);
        break;
    }
    /* v2 is one instance for every pool: allow the largest pool this device can take, so runners
     * with different `stages` never lower each other's limit */
    int dev = 0, optin = 0;
    if (e == cudaSuccess) e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = kdt_smem_optin(dev, &optin);
    size_t v2_bytes = bytes;
    for (int s2 = 4; s2 > stages; s2--)
        if ((size_t)pool_bytes(s2) <= (size_t)optin) {
            v2_bytes = (size_t)pool_bytes(s2);
            break;
        }
    if (e == cudaSuccess) e = set_smem_v2(v2_gemm_kernel<W_ROWS>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_gemm_kernel<W_TILED>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_gemm_kernel<W_BULK>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_gemm_kernel<W_ROWS, true>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_gemm_kernel<W_TILED, true>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_gemm_kernel<W_BULK, true>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<0, W_ROWS>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<5, W_ROWS>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<0, W_TILED>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<5, W_TILED>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<0, W_BULK>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<5, W_BULK>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<0, W_ROWS, true>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<0, W_TILED, true>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_grouped_kernel<0, W_BULK, true>, v2_bytes);
    if (e == cudaSuccess) e = set_smem_v2(v2_head_kernel, v2_bytes);
    if (e == cudaSuccess && wg_on()) wg_setup(dev, optin);
    /* v3: every instance may take the whole opt-in limit (its pool is chosen per launch) */
    if (e == cudaSuccess && v3_dev()) {
        if (e == cudaSuccess) e = v3_set_attrs<1, v3::DenseP>(optin);
        if (e == cudaSuccess) e = v3_set_attrs<2, v3::DenseP>(optin);
        if (e == cudaSuccess) e = v3_set_attrs<4, v3::DenseP>(optin);
        if (e == cudaSuccess) e = v3_set_attrs<1, v3::GroupedP>(optin);
        if (e == cudaSuccess) e = v3_set_attrs<2, v3::GroupedP>(optin);
        if (e == cudaSuccess) e = v3_set_attrs<4, v3::GroupedP>(optin);
    }
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "GPU GEMM: %zu bytes of shared memory: %s", bytes, cudaGetErrorString(e));
    return KDT_OK;
}

/* Programmatic dependent launch of the v2 GEMMs whose weights do not depend on the previous
 * kernel (every dense GEMM, the MoE down GEMM): the grid may start while the previous kernel runs
 * (the row kernels before them signal after their own wait), issues its first pass's weight stages, then
 * waits for it (pdl::wait) before touching activations. On by default on compute capability >= 9
 * with code built for it (pdl::usable; older code has no wait)
 * (H200, session 9: Kimi layer decode S 1 349.5 -> 344.9 us, verify N 9 1,640 -> 1,631; tiny
 * engine batch 1 autoregressive 2,065 -> 2,281 tokens/s, DDTree B 7 4,665 -> 4,985); KDT_GPU_PDL=0
 * (read once) launches them plainly. Scheduling only: the same chain, the same bits. */
bool pdl_on() { /* a device of compute capability >= 9 running code built for one (else no wait) */
    static const bool on = pdl::usable(v2_gemm_kernel<W_ROWS>, "KDT_GPU_PDL");
    return on;
}

/* Whether the row kernels, the attention, the router and the gate/up GEMM also go out with
 * programmatic dependence: each waits before its first global access; a row kernel triggers its
 * successor right after its wait (it is short: the next GEMM streams weights meanwhile), a GEMM
 * or the attention at the end of its work (a successor placed earlier would hold SM slots the
 * grid's later waves need: triggering right after the wait cost decode S 8 ~10 us and verify
 * ~20-30 us). H200, session 10, Kimi layer decode S 1: 334.1 -> 326.1 us (3 reps each), S 8 / S 64
 * / verify N 17-65 equal or better. KDT_GPU_PDL_ROWS=0 (read once) launches them plainly.
 * Scheduling only: the same bits. With pdl_on (KDT_GPU_PDL=0 turns both off). */
extern "C" int kdt_g_pdl_rows(void) {
    static const int on = pdl_on() && !kdt_g_env_is("KDT_GPU_PDL_ROWS", '0');
    return on;
}

template <typename... KArgs, typename... Args>
void launch_v2(void (*kernel)(KArgs...), dim3 grid, size_t smem, cudaStream_t s, bool pdl, Args... args) {
    pdl::launch(kernel, grid, dim3(THREADS), smem, s, pdl, args...); /* a failure is picked up by launch_error */
}

extern "C" kdt_status kdt_gemm_launch(const kdt_gemm_args *a, int32_t stages, cudaStream_t s) {
    return kdt_gemm_launch_plain(a, stages, s, 0);
}
extern "C" kdt_status kdt_gemm_launch_plain(const kdt_gemm_args *a, int32_t stages, cudaStream_t s, int plain) {
    if (a->ldw % BK || a->k_chunk % BK || a->m_max < 1 || a->n < 1)
        return kdt_fail(KDT_ERR_INTERNAL, "GPU GEMM: ld %d, k_chunk %d, m_max %d, n %d", a->ldw, a->k_chunk,
                        a->m_max, a->n);
    const dim3 grid((unsigned)((a->n + BN - 1) / BN), (unsigned)a->splits, (unsigned)(a->batch > 0 ? a->batch : 1));
    if (wg_wanted(a, false)) { /* many rows on wgmma (gemm_wg.cuh): the same bits */
        const unsigned mtiles = (unsigned)((a->m_max + wgg::BM - 1) / wgg::BM);
        const dim3 gw((unsigned)((a->n + wgg::BN - 1) / wgg::BN), (unsigned)a->splits, grid.z * mtiles);
        wgg::wg_gemm_kernel<<<gw, wgg::THREADS, (size_t)wgg::SMEM, s>>>(*a);
        return launch_error("GPU GEMM (wgmma)");
    }
    if (a->tiled) { /* only v2 reads the tiled layout; KDT_GEMM_BULK_W=1: by bulk copies */
        const V2Cfg c = v2_config_grid(stages, (int64_t)grid.x * grid.y * grid.z, a->m_max);
        const bool pdl = pdl_on() && !plain, wide = gt_v2_wide(a->m_max, c.cap);
        if (bulk_w() && wide) launch_v2(v2_gemm_kernel<W_BULK, true>, grid, (size_t)c.pool, s, pdl, *a, c);
        else if (bulk_w()) launch_v2(v2_gemm_kernel<W_BULK>, grid, (size_t)c.pool, s, pdl, *a, c);
        else if (wide) launch_v2(v2_gemm_kernel<W_TILED, true>, grid, (size_t)c.pool, s, pdl, *a, c);
        else launch_v2(v2_gemm_kernel<W_TILED>, grid, (size_t)c.pool, s, pdl, *a, c);
        return launch_error("GPU GEMM");
    }
    if (use_v1()) {
        const size_t smem = (size_t)(stages < 2 ? 2 : (stages > 4 ? 4 : stages)) * v1::STAGE_BYTES;
        switch (stages) {
        case 2: v1::gemm_kernel<2><<<grid, THREADS, smem, s>>>(*a); break;
        case 3: v1::gemm_kernel<3><<<grid, THREADS, smem, s>>>(*a); break;
        default: v1::gemm_kernel<4><<<grid, THREADS, smem, s>>>(*a); break;
        }
    } else {
        v3::DenseP p3;
        V3Plan pl;
        if (v3_dense(*a, p3, pl)) {
            v3_launch(p3, pl, s);
        } else {
            const V2Cfg c = v2_config_grid(stages, (int64_t)grid.x * grid.y * grid.z, a->m_max);
            if (gt_v2_wide(a->m_max, c.cap)) launch_v2(v2_gemm_kernel<W_ROWS, true>, grid, (size_t)c.pool, s, pdl_on() && !plain, *a, c);
            else launch_v2(v2_gemm_kernel<W_ROWS>, grid, (size_t)c.pool, s, pdl_on() && !plain, *a, c);
        }
    }
    return launch_error("GPU GEMM");
}

/* The SwiGLU fused into the gate/up GEMM's epilogue (store_swiglu): the separate k_swiglu launch
 * and its round trip through y go away; the same bits. KDT_GPU_FUSED_SWIGLU=0 (read per call, at
 * pass building) keeps the separate kernel. Only the v2 kernel has the epilogue, and only tiled
 * experts always take v2. */
extern "C" int kdt_grouped_fuses_swiglu(const kdt_grouped_args *a) {
    return !kdt_g_env_is("KDT_GPU_FUSED_SWIGLU", '0') && a->which == 0 && a->tiled;
}

/* The A-from-shared-memory form (on unless KDT_GEMM_WG_SS=0, read per launch): dense launches of
 * at least the ss bound take wg_gemm_ss_kernel (gemm_wg.cuh) where the caller gives a workspace
 * for X's bf16 hi / lo planes: a split pass, then the GEMM; the same bits. Session 47 (H100): Kimi
 * dense projections 1.04-1.17x the register form's speed, a 2,048-token prefill layer 20.2 -> 18.8
 * ms. kdt_gemm_wg_ss_on says whether a runner on the current device should allocate the workspace. */
extern "C" int kdt_gemm_wg_ss_on(void) { return wg_ss_on() && wg_on() && !use_v1() && wg_dev_ready(); }
extern "C" int64_t kdt_gemm_wg_ss_elems(int32_t rows, int32_t max_ld) { return 2 * (int64_t)rows * max_ld; }
extern "C" kdt_status kdt_gemm_launch_ws(const kdt_gemm_args *a, int32_t stages, cudaStream_t s, int plain,
                                         uint16_t *ws, int64_t ws_elems) {
    const int64_t plane = (int64_t)a->m_max * a->ldw;
    if (!ws || !wg_ss_on() || a->batch > 1 || 2 * plane > ws_elems || a->ldw % BK || a->k_chunk % BK ||
        a->m_max < 1 || a->n < 1 || !wg_wanted(a, true))
        return kdt_gemm_launch_plain(a, stages, s, plain);
    const int64_t chunks = (int64_t)a->m_max * (a->ldw / 8);
    wgg::wg_split_kernel<<<(unsigned)((chunks + 255) / 256), 256, 0, s>>>(*a, ws, plane, a->ldw);
    KDT_TRY(launch_error("GPU GEMM (wgmma): X split"));
    const dim3 gw((unsigned)((a->n + wgg::BN - 1) / wgg::BN), (unsigned)a->splits,
                  (unsigned)((a->m_max + wgg::BM - 1) / wgg::BM));
    wgg::wg_gemm_ss_kernel<<<gw, wgg::THREADS, (size_t)wgg::S_SMEM, s>>>(*a, ws, plane, a->ldw);
    return launch_error("GPU GEMM (wgmma, A from shared memory)");
}

/* A fused SwiGLU (a->h) is only for gate/up launches over tiled experts (the kernels that have the
 * epilogue); the grouped launchers refuse anything else. */
static kdt_status swiglu_args_ok(const kdt_grouped_args *a) {
    if (a->h && (a->which != 0 || !a->tiled))
        return kdt_fail(KDT_ERR_INTERNAL, "GPU grouped GEMM: a fused SwiGLU needs a gate/up launch over tiled experts");
    return KDT_OK;
}

static kdt_status grouped_launch(const kdt_grouped_args *a, int32_t stages, cudaStream_t s, bool tiled_v2_only);

/* Rows per item, on average over the plan, from which a launch that may take the ss kernel takes
 * it (the device decides: the counts come from the plan kernel). Its CTA runs an item as one
 * 64-row tile of 256 columns, 1 per SM; v2 streams small items at 4-5 CTAs per SM. H200, session
 * 50, Kimi layer (4 layers), in-process A B B A against ss whenever the bounds take it
 * (KDT_GEMM_SS_ITEM_ROWS=0, session 47's rule), us per layer: random 65-node verify (~1.8 rows
 * per item) 6,087.7 / 6,094.8 vs 7,097.8 / 7,099.7; decode S 64 6,087.6 / 6,088.6 vs 7,234.9 /
 * 7,164.3; prefill 512 (~10.7) 9,666.3 / 9,742.0 vs 10,770.5 / 10,830.1; prefill 128 7,306.2 /
 * 7,306.4 vs 8,600.6 / 8,603.7; prefill 2,048 (~43: ss either way) within 2 %; a correlated
 * 65-node verify (~33: ss either way) 1,201.1 / 1,202.6 vs 1,177.7 / 1,185.0, the v2 grid's
 * returning CTAs. Session 47 (H100): ss lost at ~5 and ~9 rows per item (corr N 9, N 17) and
 * gained at ~15. KDT_GEMM_SS_ITEM_ROWS=n (read per launch) sets it. */
static int ss_item_rows() {
    const char *e = getenv("KDT_GEMM_SS_ITEM_ROWS");
    if (!e || !*e) return 12;
    const int v = atoi(e);
    return v < 0 ? 0 : v;
}

/* The grouped launch with a workspace (unless KDT_GEMM_WG_SS=0): where the ss bounds take the
 * wgmma kernel, X is split into ws's planes first (gate/up: xn's m_max rows, of which
 * *m_dev exist; down: h's pairs, each zero past its expert's inter, by pair_expert), then the
 * A-from-shared-memory kernel. Over tiled experts v2 is launched after them as well, and the
 * plan's rows per item pick, on the device, which of the two runs (ss_item_rows; the others
 * return at once). The same bits either way. */
extern "C" kdt_status kdt_grouped_launch_ws(const kdt_grouped_args *a_in, int32_t stages, cudaStream_t s, uint16_t *ws,
                                            int64_t ws_elems, const int32_t *m_dev, int32_t m_max,
                                            const int32_t *pair_expert, int32_t ld) {
    const int64_t rows = a_in->which == 0 ? m_max : a_in->n_pairs_hint;
    const int64_t plane = rows * ld;
    if (!ws || !wg_ss_on() || rows < 1 || ld % BK || 2 * plane > ws_elems || (a_in->which == 1 && !pair_expert) ||
        !wg_grouped_wanted(a_in->max_item_rows, a_in->n_pairs_hint, true))
        return kdt_grouped_launch(a_in, stages, s);
    KDT_TRY(swiglu_args_ok(a_in));
    kdt_grouped_args dual = *a_in;
    dual.ss_min_rows = a_in->tiled ? ss_item_rows() : 0;
    const kdt_grouped_args *a = &dual;
    const int64_t chunks = rows * (ld / 8);
    const unsigned sg = (unsigned)((chunks + 255) / 256);
    if (a->which == 0) {
        kdt_gemm_args x;
        memset(&x, 0, sizeof x);
        x.x = a->x;
        x.ldx = a->ldx;
        x.kx = a->kd;
        x.m_dev = m_dev;
        x.m_max = m_max;
        wgg::wg_split_kernel<<<sg, 256, 0, s>>>(x, ws, plane, ld, a->ss_min_rows > 0 ? a->n_items : nullptr,
                                                a->ss_min_rows);
    } else {
        wgg::wg_split_pairs_kernel<<<sg, 256, 0, s>>>(*a, pair_expert, (int)rows, ws, plane, ld);
    }
    KDT_TRY(launch_error("GPU grouped GEMM (wgmma): X split"));
    const dim3 gw((unsigned)((a->n_max + wgg::GS_BN - 1) / wgg::GS_BN), (unsigned)(a->grid_items > 0 ? a->grid_items : 1));
    wgg::wg_grouped_ss_kernel<<<gw, wgg::THREADS, (size_t)wgg::GS_SMEM, s>>>(*a, ws, plane, ld);
    KDT_TRY(launch_error("GPU grouped GEMM (wgmma, A from shared memory)"));
    return a->ss_min_rows > 0 ? grouped_launch(a, stages, s, true) : KDT_OK;
}

extern "C" int32_t kdt_gemm_wg_item_rows(int32_t n_pairs) {
    return wg_grouped_wanted(KDT_G_BM, n_pairs, wg_ss_on()) ? KDT_G_BM : 0;
}

/* v2 over tiled experts (or, unless `tiled_v2_only`, the other forms the launch asks for) */
static kdt_status grouped_launch(const kdt_grouped_args *a, int32_t stages, cudaStream_t s, bool tiled_v2_only) {
    const dim3 grid((unsigned)((a->n_max + BN - 1) / BN), (unsigned)(a->grid_items > 0 ? a->grid_items : 1));
    KDT_TRY(swiglu_args_ok(a));
    if (!tiled_v2_only && wg_grouped_wanted(a->max_item_rows, a->n_pairs_hint, false)) { /* many rows on wgmma (gemm_wg.cuh): the same bits */
        const dim3 gw((unsigned)((a->n_max + wgg::BN - 1) / wgg::BN), grid.y);
        wgg::wg_grouped_kernel<<<gw, wgg::G_THREADS, (size_t)wgg::G_SMEM, s>>>(*a);
        return launch_error("GPU grouped GEMM (wgmma)");
    }
    if (a->tiled) { /* only v2 reads the tiled layout; KDT_GEMM_BULK_W=1: by bulk copies */
        int per_sm = 2;
        const V2Cfg c = v2_config_grouped(stages, *a, &per_sm);
        const bool bulk = bulk_w() && per_sm > 2; /* bulk copies only pay at >= 3 CTAs per SM */
        /* gate/up reads nothing before its wait: PDL only hides its launch (with the row kernels) */
        const bool pdl = pdl_on() && (a->which == 1 || kdt_g_pdl_rows());
        const bool wide = gt_v2_wide(a->max_item_rows, c.cap);
        if (per_sm > 4 && bulk) launch_v2(v2_grouped_kernel<5, W_BULK>, grid, (size_t)c.pool, s, pdl, *a, c);
        else if (per_sm > 4) launch_v2(v2_grouped_kernel<5, W_TILED>, grid, (size_t)c.pool, s, pdl, *a, c);
        else if (bulk && wide) launch_v2(v2_grouped_kernel<0, W_BULK, true>, grid, (size_t)c.pool, s, pdl, *a, c);
        else if (bulk) launch_v2(v2_grouped_kernel<0, W_BULK>, grid, (size_t)c.pool, s, pdl, *a, c);
        else if (wide) launch_v2(v2_grouped_kernel<0, W_TILED, true>, grid, (size_t)c.pool, s, pdl, *a, c);
        else launch_v2(v2_grouped_kernel<0, W_TILED>, grid, (size_t)c.pool, s, pdl, *a, c);
        return launch_error("GPU grouped GEMM");
    }
    if (tiled_v2_only) return kdt_fail(KDT_ERR_INTERNAL, "GPU grouped GEMM: v2 only for tiled experts");
    if (use_v1()) {
        const size_t smem = (size_t)(stages < 2 ? 2 : (stages > 4 ? 4 : stages)) * v1::STAGE_BYTES;
        switch (stages) {
        case 2: v1::grouped_kernel<2><<<grid, THREADS, smem, s>>>(*a); break;
        case 3: v1::grouped_kernel<3><<<grid, THREADS, smem, s>>>(*a); break;
        default: v1::grouped_kernel<4><<<grid, THREADS, smem, s>>>(*a); break;
        }
    } else {
        v3::GroupedP p3;
        V3Plan pl;
        if (v3_grouped(*a, p3, pl)) {
            v3_launch(p3, pl, s);
        } else {
            int per_sm = 2;
            const V2Cfg c = v2_config_grouped(stages, *a, &per_sm);
            if (per_sm > 4) v2_grouped_kernel<5, W_ROWS><<<grid, THREADS, (size_t)c.pool, s>>>(*a, c);
            else if (gt_v2_wide(a->max_item_rows, c.cap)) v2_grouped_kernel<0, W_ROWS, true><<<grid, THREADS, (size_t)c.pool, s>>>(*a, c);
            else v2_grouped_kernel<0, W_ROWS><<<grid, THREADS, (size_t)c.pool, s>>>(*a, c);
        }
    }
    return launch_error("GPU grouped GEMM");
}

extern "C" kdt_status kdt_grouped_launch(const kdt_grouped_args *a, int32_t stages, cudaStream_t s) {
    return grouped_launch(a, stages, s, false);
}

namespace {
/* [rows][ld] -> [rows / 64][ld / 64][64][64] for rows [0, n) of src into dst (16-byte chunks;
 * chunk c of block row t at chunk c ^ (t & 7)). */
__global__ void k_tile64(const uint16_t *src, uint16_t *dst, int64_t n, int ld) {
    const int64_t chunks = n * ld / 8;
    for (int64_t q = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; q < chunks; q += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = q / (ld / 8);
        const int c8 = (int)(q % (ld / 8));
        *reinterpret_cast<uint4 *>(dst + gt_tiled_chunk(r, c8, ld)) = *reinterpret_cast<const uint4 *>(src + r * ld + c8 * 8);
    }
}
} // namespace

extern "C" kdt_status kdt_gemm_tile64(uint16_t *w, int64_t rows, int32_t ld, uint16_t *tmp, int64_t tmp_rows,
                                      cudaStream_t s) {
    if (rows % BN || ld % BK || tmp_rows < BN || tmp_rows % BN)
        return kdt_fail(KDT_ERR_INTERNAL, "kdt_gemm_tile64: rows %lld, ld %d, tmp_rows %lld", (long long)rows, ld,
                        (long long)tmp_rows);
    for (int64_t r0 = 0; r0 < rows; r0 += tmp_rows) {
        const int64_t n = rows - r0 < tmp_rows ? rows - r0 : tmp_rows;
        k_tile64<<<1024, 256, 0, s>>>(w + r0 * ld, tmp, n, ld);
        const cudaError_t e = cudaMemcpyAsync(w + r0 * ld, tmp, (size_t)n * ld * 2, cudaMemcpyDeviceToDevice, s);
        if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "kdt_gemm_tile64: %s", cudaGetErrorString(e));
    }
    return launch_error("GPU weight tiling");
}

extern "C" kdt_status kdt_head_launch(const kdt_head_args *a, int32_t stages, cudaStream_t s) {
    if (a->w.ld % BK || a->m_max < 1)
        return kdt_fail(KDT_ERR_INTERNAL, "GPU lm_head: ld %d, m_max %d", a->w.ld, a->m_max);
    const dim3 grid((unsigned)((a->w.rows + BN - 1) / BN));
    if (use_v1()) {
        const size_t smem = (size_t)(stages < 2 ? 2 : (stages > 4 ? 4 : stages)) * v1::STAGE_BYTES;
        switch (stages) {
        case 2: v1::head_kernel<2><<<grid, THREADS, smem, s>>>(*a); break;
        case 3: v1::head_kernel<3><<<grid, THREADS, smem, s>>>(*a); break;
        default: v1::head_kernel<4><<<grid, THREADS, smem, s>>>(*a); break;
        }
    } else {
        const V2Cfg c = v2_config(stages);
        v2_head_kernel<<<grid, THREADS, (size_t)c.pool, s>>>(*a, c);
    }
    return launch_error("GPU lm_head");
}
