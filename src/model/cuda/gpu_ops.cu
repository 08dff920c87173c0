/* gpu_ops.cu - the row-wise kernels of the GPU forward around the GEMMs and the attention:
 * block-table updates, embedding, RMSNorm, the "post" kernels that sum split-K partials (in split
 * order) and finish a stage (latent KV row -> cache, q RoPE, residual adds), SwiGLU, the MoE
 * router (sigmoid, bias, group filter, top-k with ties to the lower index, as forward.c), the
 * MoE plan (pair lists and the grouped-GEMM item list, deterministic), the MoE combine, the
 * final argmax, taps, and the random fills used by kdt_gpu_model_random / kv_fill_random.
 *
 * Every reduction runs in a fixed order with a fixed block size (256 threads; the block sum is a
 * shuffle tree per warp, then the 8 warp sums added in warp order), so a row's results never
 * depend on the other rows. The order of arithmetic follows forward.c where it matters for
 * reading the code; bitwise agreement with the CPU is not a goal (the GPU contracts a*b+c).
 *
 * Grids: the row-wise kernels run one CTA per (row, column chunk) item (kdt_g_chunk_cols), so a
 * decode of one row is not one serial CTA. A kernel with a row reduction (RMSNorm) has every
 * chunk's CTA compute the whole row's sum with the one fixed tree and then write only its own
 * columns; an element's arithmetic is the same in whichever chunk it lands. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu_internal.h"
#include "gpu_mma.cuh"
#include "kernels/cuda/pdl.cuh"

namespace {
using kg::bf16_to_f32;
using kg::f32_to_bf16;

constexpr int RB = 256; /* threads of every row-wise kernel */

__device__ __forceinline__ float block_sum(float v, float *red) { return kg::block_sum<RB>(v, red); }

/* Sum of the split-K partials of element i, one addition chain in split order. The loads go
 * out SB at a time (a router has ~28 splits: a few memory latencies instead of one per split);
 * the additions are the plain loop's, so are the bits. */
template <int SB = 8>
__device__ __forceinline__ float split_sum(const float *part, int splits, int64_t split_stride, int64_t i) {
    float v = part[i];
    for (int s0 = 1; s0 < splits; s0 += SB) {
        float t[SB];
#pragma unroll
        for (int j = 0; j < SB; j++) t[j] = s0 + j < splits ? part[(s0 + j) * split_stride + i] : 0.0f;
#pragma unroll
        for (int j = 0; j < SB; j++)
            if (s0 + j < splits) v += t[j];
    }
    return v;
}

/* Block sum of x[d]^2 over d < n: thread t adds d = t, t + RB, ... in that order with fma (what
 * `ss += x[d] * x[d]` compiles to), loads going out 8 at a time, then block_sum. */
__device__ __forceinline__ float sum_squares(const float *x, int n, float *red) {
    float ss = 0.0f;
    for (int d0 = threadIdx.x; d0 < n; d0 += 8 * RB) {
        float t[8];
#pragma unroll
        for (int j = 0; j < 8; j++) t[j] = d0 + j * RB < n ? x[d0 + j * RB] : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (d0 + j * RB < n) ss = __fmaf_rn(t[j], t[j], ss);
    }
    return block_sum(ss, red);
}

/* Column chunks of one launch (kdt_g_chunk_cols): n per row, cols each; item it of the grid is
 * row it / n, columns [lo, hi). */
struct Chunks {
    int n, cols;
};
struct Item {
    int r, c, lo, hi;
};
__device__ __forceinline__ Item item_of(int it, Chunks ch, int width) {
    Item t;
    t.r = it / ch.n;
    t.c = it % ch.n;
    t.lo = t.c * ch.cols;
    t.hi = min(t.lo + ch.cols, width);
    return t;
}

/* Every kernel here may be launched with programmatic dependence (kdt_g_pdl_rows): it waits for
 * the previous kernel before its first global access, then lets the next kernel launch (a GEMM
 * streams its first weight stages meanwhile; a row kernel gets its CTAs placed and waits). A
 * kernel triggers only after its own wait, so whatever runs before a wait may read the outputs
 * of the kernel two back (the MoE down GEMM reads the plan's items: two back with the SwiGLU in
 * the gate/up GEMM, three with k_swiglu). */
#define PDL_ENTRY()                 \
    do {                            \
        pdl::wait();                \
        pdl::launch_dependents();   \
    } while (0)

__device__ __forceinline__ int clamp_rows(int m, int max_rows) { return m < 0 ? 0 : (m > max_rows ? max_rows : m); }

__global__ void k_scatter(int32_t *table, const int32_t *updates, const kdt_gstage_hdr *hdr) {
    const int n = hdr->n_updates;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        table[updates[2 * i]] = updates[2 * i + 1];
}

__global__ void __launch_bounds__(RB) k_embed(const kdt_gstage_hdr *hdr, const kdt_grow *rows, kdt_gmat embed,
                                               float *x, int D, int max_rows, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(hdr->n_rows, max_rows);
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, D);
        const uint16_t *e = embed.w + (int64_t)rows[t.r].token * embed.ld;
        for (int d = t.lo + threadIdx.x; d < t.hi; d += RB) x[(int64_t)t.r * D + d] = bf16_to_f32(e[d]);
    }
}

/* out[m] = RMSNorm(x[rowmap ? rowmap[m] : m]) * w for m < *m_dev; every chunk of row m sums the
 * whole row (the same tree), then writes its columns (so out must not alias x) */
__global__ void __launch_bounds__(RB) k_rmsnorm(const float *x, const int32_t *rowmap, const float *w, float eps,
                                                 int D, float *out, const int32_t *m_dev, int max_rows, Chunks ch) {
    PDL_ENTRY();
    __shared__ float red[RB / 32];
    const int n = clamp_rows(*m_dev, max_rows);
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, D);
        const float *xr = x + (int64_t)(rowmap ? rowmap[t.r] : t.r) * D;
        const float ss = sum_squares(xr, D, red);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int d = t.lo + threadIdx.x; d < t.hi; d += RB) out[(int64_t)t.r * D + d] = w[d] * (xr[d] * inv);
    }
}

/* Rotates pair i of v (d_r values) in place for table row cs (cos, sin pairs). */
__device__ __forceinline__ void rope_pair(float *v, const float *cs, int i, int dr, int interleave) {
    const int a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + dr / 2;
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x1 * c + x0 * s;
}

struct PostA {
    const float *part; int splits; int64_t split_stride; int ldp;
    int q_lora, dc, dr;
    const float *q_a_norm, *kv_a_norm;
    const float *rope_cs; int interleave;
    const kdt_gstage_hdr *hdr; const kdt_grow *rows;
    uint16_t *cache; const int32_t *block_table; int max_pages, page_size, n_pages, row_stride;
    float *qa;
    int max_rows;
};

/* [q_a | kv_a] partials -> qa = RMSNorm(q_a x) and the cache row [RMSNorm(c_kv) | RoPE(k_pe)].
 * Chunks cut the q_lora + d_c normalised columns; a chunk's CTA sums the partials of the
 * section(s) it touches (q_a, c_kv) into shared memory and takes their RMS with the one tree, so
 * each section's norm is the same bits in every chunk; the last chunk also ropes and writes k_pe. */
__global__ void __launch_bounds__(RB) k_post_a(const PostA a, Chunks ch) {
    PDL_ENTRY();
    extern __shared__ float v[]; /* [q_lora + d_c + d_r] */
    __shared__ float red[RB / 32];
    const int n = clamp_rows(a.hdr->n_rows, a.max_rows), qkv = a.q_lora + a.dc, width = qkv + a.dr;
    const float latent_eps = 1e-6f;
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, qkv);
        const int r = t.r;
        const bool in_q = t.lo < a.q_lora, in_kv = t.hi > a.q_lora, last = t.c == ch.n - 1;
        const int s0 = in_q ? 0 : a.q_lora, s1 = last ? width : (in_kv ? qkv : a.q_lora);
        const kdt_grow row = a.rows[r];
        __syncthreads();
        for (int i = s0 + threadIdx.x; i < s1; i += RB)
            v[i] = split_sum(a.part, a.splits, a.split_stride, (int64_t)r * a.ldp + i);
        __syncthreads();
        if (in_q) {
            const float ss = sum_squares(v, a.q_lora, red);
            const float inv = 1.0f / sqrtf(ss / (float)a.q_lora + latent_eps);
            for (int i = t.lo + threadIdx.x; i < min(t.hi, a.q_lora); i += RB)
                a.qa[(int64_t)r * a.q_lora + i] = a.q_a_norm[i] * (v[i] * inv);
        }
        if (!in_kv) continue;
        const float *kv = v + a.q_lora;
        const float ss = sum_squares(kv, a.dc, red);
        const float inv = 1.0f / sqrtf(ss / (float)a.dc + latent_eps);
        int page = a.block_table[(int64_t)row.stream * a.max_pages + row.slot / a.page_size];
        if (page < 0 || page >= a.n_pages) page = 0; /* host-validated; never write out of bounds */
        uint16_t *dst = a.cache + ((int64_t)page * a.page_size + row.slot % a.page_size) * a.row_stride;
        for (int i = max(t.lo - a.q_lora, 0) + threadIdx.x; i < t.hi - a.q_lora; i += RB)
            dst[i] = f32_to_bf16(a.kv_a_norm[i] * (kv[i] * inv));
        if (!last) continue;
        float *pe = v + a.q_lora + a.dc;
        const float *cs = a.rope_cs + (int64_t)row.pos * a.dr;
        for (int i = threadIdx.x; i < a.dr / 2; i += RB) rope_pair(pe, cs, i, a.dr, a.interleave);
        __syncthreads();
        for (int i = threadIdx.x; i < a.dr; i += RB) dst[a.dc + i] = f32_to_bf16(pe[i]);
    }
}

struct PostQ {
    const float *part; int splits; int64_t split_stride; int ldp;
    int H, dn, dr, dc;
    const float *rope_cs; int interleave;
    const kdt_gstage_hdr *hdr; const kdt_grow *rows;
    float *q_nope; float *q_abs;
    int max_rows;
};

/* q partials -> q_nope [R][H][d_n] and the RoPE'd q_pe into q_abs[r][h][d_c..]. A row's items are
 * H d_n q_nope elements, then H d_r / 2 rotated pairs; chunks cut that list. */
__global__ void __launch_bounds__(RB) k_post_q(const PostQ a, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(a.hdr->n_rows, a.max_rows), dqk = a.dn + a.dr, dq = a.dc + a.dr, half = a.dr / 2;
    const int n_nope = a.H * a.dn;
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, n_nope + a.H * half);
        const int r = t.r;
        for (int i = t.lo + threadIdx.x; i < min(t.hi, n_nope); i += RB) {
            const int h = i / a.dn, d = i % a.dn;
            a.q_nope[(int64_t)r * a.H * a.dn + i] =
                split_sum(a.part, a.splits, a.split_stride, (int64_t)r * a.ldp + h * dqk + d);
        }
        if (t.hi <= n_nope) continue;
        const kdt_grow row = a.rows[r];
        const float *cs = a.rope_cs + (int64_t)row.pos * a.dr;
        for (int i = max(t.lo - n_nope, 0) + threadIdx.x; i < t.hi - n_nope; i += RB) {
            const int h = i / half, p = i % half;
            const int ia = a.interleave ? 2 * p : p, ib = a.interleave ? 2 * p + 1 : p + half;
            const int64_t base = (int64_t)r * a.ldp + h * dqk + a.dn;
            const float x0 = split_sum(a.part, a.splits, a.split_stride, base + ia);
            const float x1 = split_sum(a.part, a.splits, a.split_stride, base + ib);
            const float c = cs[2 * p], s = cs[2 * p + 1];
            float *dst = a.q_abs + ((int64_t)r * a.H + h) * dq + a.dc;
            dst[ia] = x0 * c - x1 * s;
            dst[ib] = x1 * c + x0 * s;
        }
    }
}

/* dst[r][b * d_bstride + c] = sum_s part[s][r][b * p_bstride + c], c < ncols, b < batch */
__global__ void __launch_bounds__(RB) k_sum_splits(const float *part, int splits, int64_t split_stride, int ldp,
                                                    int batch, int p_bstride, int ncols, float *dst, int ldd,
                                                    int d_bstride, const int32_t *m_dev, int max_rows, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(*m_dev, max_rows);
    const int per_row = batch * ncols;
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, per_row);
        for (int i = t.lo + threadIdx.x; i < t.hi; i += RB) {
            const int b = i / ncols, c = i % ncols;
            dst[(int64_t)t.r * ldd + (int64_t)b * d_bstride + c] =
                split_sum(part, splits, split_stride, (int64_t)t.r * ldp + (int64_t)b * p_bstride + c);
        }
    }
}

/* x += partials (the o_proj finish is this, then k_rmsnorm: the row's new x must be complete
 * before any chunk sums its squares) */
__global__ void __launch_bounds__(RB) k_residual(float *x, const float *part, int splits, int64_t split_stride,
                                                  int D, const int32_t *m_dev, int max_rows, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(*m_dev, max_rows);
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, D);
        for (int d = t.lo + threadIdx.x; d < t.hi; d += RB)
            x[(int64_t)t.r * D + d] += split_sum(part, splits, split_stride, (int64_t)t.r * D + d);
    }
}

/* h[p][j] = silu(gate) * up for j < I (the row's expert's I, or `inter`); gate/up interleaved
 * by 32-column blocks in the partials. Chunks cut `width` (>= every I) columns. */
__global__ void __launch_bounds__(RB) k_swiglu(const float *part, int splits, int64_t split_stride, int ldp,
                                                const int32_t *n_dev, int max_n, const int32_t *pair_expert,
                                                const kdt_gpu_expert *experts, int inter, float *h, int ldh,
                                                int width, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(*n_dev, max_n);
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, width);
        const int p = t.r;
        const int I = pair_expert ? experts[pair_expert[p]].inter : inter;
        for (int j = t.lo + threadIdx.x; j < min(t.hi, I); j += RB) {
            const int gc = (j / KDT_G_GU_BLOCK) * 2 * KDT_G_GU_BLOCK + j % KDT_G_GU_BLOCK;
            const float gt = split_sum(part, splits, split_stride, (int64_t)p * ldp + gc);
            const float up = split_sum(part, splits, split_stride, (int64_t)p * ldp + gc + KDT_G_GU_BLOCK);
            h[(int64_t)p * ldh + j] = kdt_g_swiglu(gt, up);
        }
    }
}

struct Route {
    const float *part; int splits; int64_t split_stride;
    const float *bias;
    int E, K, G, topk_group, norm;
    float rsf;
    const kdt_gstage_hdr *hdr;
    int32_t *sel; float *wgt;
    int max_rows;
};

/* true if candidate (v, i) beats (bv, bi): larger value, ties to the lower index, -1 loses */
__device__ __forceinline__ bool beats(const float *val, int i, int bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return val[i] > val[bi] || (!(val[bi] > val[i]) && i < bi);
}
/* the same comparison on values already in registers (vi = val[i], vb = val[bi]) */
__device__ __forceinline__ bool beats_v(float vi, int i, float vb, int bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return vi > vb || (!(vb > vi) && i < bi);
}

constexpr int RT = 512;         /* router threads: a decode row's E scores in one pass */
constexpr int ROUTE_MAX_RPC = RT / 32;
constexpr int ROUTE_EPL = 16;   /* biased scores per lane kept in registers (E <= 512) */

/* Shared-memory scratch of one router row: scores, biased scores, group scores, allowed and kept
 * flags; rows route_row_bytes apart. */
struct RouteRow {
    float *sc, *ch, *grp;
    unsigned char *allowed, *kept;
};
__host__ __device__ inline size_t route_row_bytes(int E, int G) {
    return ((size_t)E * 8 + (size_t)E + (size_t)G * 5 + 16 + 15) / 16 * 16;
}
__device__ __forceinline__ RouteRow route_row(unsigned char *smem, int q, int E, int G) {
    RouteRow t;
    t.sc = reinterpret_cast<float *>(smem + q * route_row_bytes(E, G));
    t.ch = t.sc + E;
    t.grp = t.ch + E;
    t.allowed = reinterpret_cast<unsigned char *>(t.grp + G);
    t.kept = t.allowed + E;
    return t;
}

/* Rows per router CTA: 1 while that keeps the grid within about KDT_G_SPLIT_TARGET CTAs (a decode
 * then scores its experts with all RT threads), up to one per warp for large batches. */
int route_rows_per_cta(int max_rows, int E, int G) {
    int rpc = (max_rows + KDT_G_SPLIT_TARGET - 1) / KDT_G_SPLIT_TARGET;
    if (rpc > ROUTE_MAX_RPC) rpc = ROUTE_MAX_RPC;
    while (rpc > 1 && (size_t)rpc * route_row_bytes(E, G) > 48 * 1024) rpc--;
    return rpc < 1 ? 1 : rpc;
}

/* rpc rows per CTA: all RT threads compute the rows' sigmoid scores, then warp w runs row w's
 * biased choice, group filter, top-k, weights, sorted by id (the selection is one warp's
 * sequence of steps whatever rpc is, and a score's arithmetic does not depend on its thread).
 *
 * The top-k is K rounds of "best allowed expert": each lane scans its experts e = lane + 32 q in
 * ascending q, then a butterfly over the lanes, every comparison `beats` (larger biased score,
 * ties to the lower id); lane 0's winner is taken. With E <= 32 ROUTE_EPL and K <= 32 the lane's
 * scores and allowed flags live in registers and lane k keeps the k-th choice, so the weights'
 * normalisation (a sum in choice order), the scaling and the sort by expert id (ranks; ids
 * are distinct except the degenerate 0 fill, where the rank keeps choice order like a stable
 * sort) never touch memory; otherwise the same steps run on the shared-memory arrays. Both give
 * the bits of forward.c's sequence. */
__global__ void __launch_bounds__(RT, 1) k_route(const Route a, int rpc) {
    PDL_ENTRY();
    extern __shared__ unsigned char rsm[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int E = a.E, G = a.G;
    const RouteRow mine = route_row(rsm, warp, E, G);
    float *sc = mine.sc, *ch = mine.ch, *grp = mine.grp;
    unsigned char *allowed = mine.allowed, *kept = mine.kept;
    const int n = clamp_rows(a.hdr->n_rows, a.max_rows);
    for (int r0 = blockIdx.x * rpc; r0 < n; r0 += gridDim.x * rpc) {
        const int nr = min(rpc, n - r0);
        __syncthreads(); /* the previous rows' selections are done with the scratch */
        for (int i = threadIdx.x; i < nr * E; i += RT) {
            const int q = i / E, e = i % E;
            const RouteRow t = route_row(rsm, q, E, G);
            const float l = split_sum<32>(a.part, a.splits, a.split_stride, (int64_t)(r0 + q) * E + e);
            const float s = 1.0f / (1.0f + expf(-l));
            t.sc[e] = s;
            t.ch[e] = s + a.bias[e]; /* bias: selection only */
            t.allowed[e] = 1;
        }
        __syncthreads();
        if (warp >= nr) continue;
        const int r = r0 + warp;
        if (G > 1) {
            const int per = E / G;
            for (int g = lane; g < G; g += 32) { /* group score: top-1 + top-2 biased scores */
                const float *v = ch + g * per;
                int i1 = 0;
                for (int i = 1; i < per; i++)
                    if (v[i] > v[i1]) i1 = i;
                int i2 = i1 == 0 ? 1 : 0;
                for (int i = 0; i < per; i++)
                    if (i != i1 && v[i] > v[i2]) i2 = i;
                grp[g] = v[i1] + v[i2];
                kept[g] = 0;
            }
            __syncwarp();
            if (lane == 0)
                for (int t = 0; t < a.topk_group; t++) {
                    int best = -1;
                    for (int g = 0; g < G; g++)
                        if (!kept[g] && (best < 0 || grp[g] > grp[best])) best = g;
                    if (best >= 0) kept[best] = 1;
                }
            __syncwarp();
            for (int e = lane; e < E; e += 32) allowed[e] = kept[e / per];
            __syncwarp();
        }
        int32_t *sel = a.sel + (int64_t)r * a.K;
        float *w = a.wgt + (int64_t)r * a.K;
        if (E <= 32 * ROUTE_EPL && a.K <= 32) {
            float cv[ROUTE_EPL];
            bool al[ROUTE_EPL];
#pragma unroll
            for (int q = 0; q < ROUTE_EPL; q++) {
                const int e = lane + 32 * q;
                cv[q] = e < E ? ch[e] : 0.0f;
                al[q] = e < E && allowed[e];
            }
            int my_e = 0;
            float my_w = 0.0f;
            for (int k = 0; k < a.K; k++) {
                int best = -1;
                float bv = 0.0f;
#pragma unroll
                for (int q = 0; q < ROUTE_EPL; q++)
                    if (al[q] && beats_v(cv[q], lane + 32 * q, bv, best)) best = lane + 32 * q, bv = cv[q];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    const int other = __shfl_xor_sync(0xffffffffu, best, o);
                    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                    if (beats_v(ov, other, bv, best)) best = other, bv = ov;
                }
                best = __shfl_sync(0xffffffffu, best, 0);
                const int e = best < 0 ? 0 : best;
#pragma unroll
                for (int q = 0; q < ROUTE_EPL; q++)
                    if (lane + 32 * q == e) al[q] = false;
                if (lane == k) my_e = e, my_w = sc[e]; /* the unbiased score weighs the expert */
            }
            if (a.norm) {
                float sum = 0.0f;
                for (int k = 0; k < a.K; k++) sum += __shfl_sync(0xffffffffu, my_w, k);
                sum += 1e-20f;
                my_w /= sum;
            }
            my_w *= a.rsf;
            int rank = 0; /* position after a stable sort by expert id */
            for (int k = 0; k < a.K; k++) {
                const int ek = __shfl_sync(0xffffffffu, my_e, k);
                rank += ek < my_e || (ek == my_e && k < lane);
            }
            if (lane < a.K) {
                sel[rank] = my_e;
                w[rank] = my_w;
            }
            continue;
        }
        for (int k = 0; k < a.K; k++) {
            int best = -1;
            for (int e = lane; e < E; e += 32)
                if (allowed[e] && beats(ch, e, best)) best = e;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const int other = __shfl_xor_sync(0xffffffffu, best, o);
                if (beats(ch, other, best)) best = other;
            }
            if (lane == 0) {
                const int e = best < 0 ? 0 : best;
                allowed[e] = 0;
                sel[k] = e;
                w[k] = sc[e]; /* the unbiased score weighs the expert */
            }
            __syncwarp();
        }
        if (lane == 0) {
            if (a.norm) {
                float sum = 0.0f;
                for (int k = 0; k < a.K; k++) sum += w[k];
                sum += 1e-20f;
                for (int k = 0; k < a.K; k++) w[k] /= sum;
            }
            for (int k = 0; k < a.K; k++) w[k] *= a.rsf;
            for (int i = 1; i < a.K; i++) /* accumulate in increasing expert id (stable) */
                for (int j = i; j > 0 && sel[j] < sel[j - 1]; j--) {
                    const int te = sel[j];
                    sel[j] = sel[j - 1];
                    sel[j - 1] = te;
                    const float tw = w[j];
                    w[j] = w[j - 1];
                    w[j - 1] = tw;
                }
        }
        __syncwarp();
    }
}

/* Selection key of expert e with biased score c: larger key = preferred (larger score, ties to
 * the lower id; `beats`' order). The float's bits are made to order as unsigned integers (+0 and
 * -0 alike); a NaN score ranks below every number. Keys are distinct (the id is in them). */
__device__ __forceinline__ unsigned long long route_key(float c, int e) {
    unsigned u = __float_as_uint(c);
    if (c == 0.0f) u = 0u;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    if (c != c) u = 0u;
    return ((unsigned long long)u << 32) | (unsigned)~e;
}

/* The router for one row per CTA with n_group 1 (decode and verify batches; k_route keeps the
 * group filter and the many-rows-per-CTA case): thread e scores expert e as k_route does, each warp
 * sorts its 32 keys (bitonic, shuffles), its top K become candidates, and candidate i's rank is
 * the number of candidates above it: ranks 0..K-1 are the top K in choice order, what K rounds of
 * "best remaining" give. A few short parallel steps instead of K serial warp rounds (k_route's
 * register path: ~13 us for one Kimi row, 384 experts, top 8). The weights then follow k_route's
 * register path operation for operation (sum in choice order, scale, stable sort by id): the same
 * bits. Needs K <= 32 and K <= E <= RT. */
/* The MoE plan of a one-row pass (k_moe_plan's outputs for R <= 1), written by the router's CTA
 * (k_route_wide<true>): with the row's experts sorted by id, pair k is slot k's (row 0, expert
 * sel[k]) and item k is (sel[k], k, 1); the shared expert's pair and item come last. */
struct Plan1 {
    int has_shared;
    int32_t *pair_row, *pair_expert, *pos_of, *pos_shared, *items, *counts, *expert_counts;
};

template <bool PLAN>
__global__ void __launch_bounds__(RT, 1) k_route_wide(const Route a, const Plan1 pl) {
    PDL_ENTRY();
    __shared__ float sc[RT];
    __shared__ unsigned long long cand[RT];
    __shared__ unsigned long long chosen[32];
    const int e = threadIdx.x, warp = e >> 5, lane = e & 31, E = a.E, K = a.K;
    const int C = (E + 31) / 32 * K;
    const int n = clamp_rows(a.hdr->n_rows, a.max_rows);
    for (int r = blockIdx.x; r < n; r += gridDim.x) {
        unsigned long long key = 0; /* below every expert's key */
        if (e < E) {
            const float l = split_sum<32>(a.part, a.splits, a.split_stride, (int64_t)r * E + e);
            const float s = 1.0f / (1.0f + expf(-l));
            sc[e] = s;
            key = route_key(s + a.bias[e], e); /* bias: selection only */
        }
        for (int k = 2; k <= 32; k <<= 1) /* descending bitonic sort of the warp's 32 keys */
            for (int j = k >> 1; j > 0; j >>= 1) {
                const unsigned long long o = __shfl_xor_sync(0xffffffffu, key, j);
                key = (((lane & j) == 0) == ((lane & k) == 0)) ? (key > o ? key : o) : (key < o ? key : o);
            }
        if (lane < K) cand[warp * K + lane] = key;
        __syncthreads();
        if (e < C) {
            const unsigned long long mine = cand[e];
            int rank = 0;
            for (int j = 0; j < C; j++) rank += cand[j] > mine;
            if (rank < K) chosen[rank] = mine; /* E >= K: padding keys rank >= K */
        }
        __syncthreads();
        if (warp == 0) {
            int my_e = 0;
            float my_w = 0.0f;
            if (lane < K) {
                my_e = (int)~(unsigned)(chosen[lane] & 0xffffffffu);
                my_w = sc[my_e]; /* the unbiased score weighs the expert */
            }
            if (a.norm) {
                float sum = 0.0f;
                for (int k = 0; k < K; k++) sum += __shfl_sync(0xffffffffu, my_w, k);
                sum += 1e-20f;
                my_w /= sum;
            }
            my_w *= a.rsf;
            int rank = 0; /* position after a stable sort by expert id */
            for (int k = 0; k < K; k++) {
                const int ek = __shfl_sync(0xffffffffu, my_e, k);
                rank += ek < my_e || (ek == my_e && k < lane);
            }
            if (lane < K) {
                a.sel[(int64_t)r * K + rank] = my_e;
                a.wgt[(int64_t)r * K + rank] = my_w;
                if (PLAN) { /* r = 0, the only row */
                    pl.pair_row[rank] = 0;
                    pl.pair_expert[rank] = my_e;
                    pl.pos_of[rank] = rank;
                    pl.items[3 * rank] = my_e;
                    pl.items[3 * rank + 1] = rank;
                    pl.items[3 * rank + 2] = 1;
                }
            }
        }
        if (PLAN) { /* every expert's count: 1 if chosen (the keys in `chosen` hold the ids) */
            int c = 0;
            for (int k = 0; k < K; k++) c += (int)~(unsigned)(chosen[k] & 0xffffffffu) == e;
            if (e < E) pl.expert_counts[e] = c;
        }
        __syncthreads(); /* the next row reuses sc, cand and chosen */
    }
    if (PLAN && blockIdx.x == 0 && threadIdx.x == 0) {
        const int R = n < 1 ? n : 1, hs = pl.has_shared == 1; /* 2: the shared expert runs apart */
        pl.counts[0] = R * (K + hs);
        pl.counts[1] = R * (K + hs);
        pl.expert_counts[E] = pl.has_shared ? R : 0;
        if (R == 1 && hs) {
            pl.pair_row[K] = 0;
            pl.pair_expert[K] = E;
            pl.pos_shared[0] = K;
            pl.items[3 * K] = E;
            pl.items[3 * K + 1] = K;
            pl.items[3 * K + 2] = 1;
        }
    }
    if (PLAN && n < 1) /* no rows: no expert has any */
        for (int i = threadIdx.x; i < E; i += blockDim.x) pl.expert_counts[i] = 0;
}

struct Plan {
    const kdt_gstage_hdr *hdr;
    const int32_t *sel;
    int K, E, has_shared, max_rows, item_rows;
    int32_t *pair_row, *pair_expert, *pos_of, *pos_shared, *items, *counts, *expert_counts;
};

constexpr int PLAN_CHUNK = 4096;

/* How often expert e occurs in chunk[0, n) (16-byte reads: the chunk is 16-byte aligned). */
__device__ __forceinline__ int count_in(const int32_t *chunk, int n, int e) {
    const int4 *c4 = reinterpret_cast<const int4 *>(chunk);
    int c = 0;
    for (int i = 0; i < n / 4; i++) {
        const int4 v = c4[i];
        c += (v.x == e) + (v.y == e) + (v.z == e) + (v.w == e);
    }
    for (int i = n / 4 * 4; i < n; i++) c += chunk[i] == e;
    return c;
}

/* One CTA: thread e owns expert e (the shared expert is e = E). Counts its pairs, the CTA scans
 * the counts into pair offsets and item offsets (warp shuffle scans, then the warp totals: exact
 * integer sums, the serial scan's values), then thread e assigns its pairs positions in
 * (row, slot) order - deterministic - and writes its items (<= item_rows pairs each); the shared
 * expert's pairs (one per row, in row order) are written by all threads. */
__global__ void k_moe_plan(const Plan a) {
    PDL_ENTRY();
    extern __shared__ __align__(16) int32_t psm[];
    const int E_tot = a.E + (a.has_shared == 1); /* 2: the shared expert runs apart, no pairs here */
    int32_t *wsum = psm, *chunk = psm + 64; /* [2][32] warp totals; the chunk (16-byte aligned) */
    __shared__ int shared_off;
    const int R = clamp_rows(a.hdr->n_rows, a.max_rows), P = R * a.K;
    const int e = threadIdx.x, lane = e & 31, w = e >> 5;
    int c = 0;
    for (int b0 = 0; b0 < P; b0 += PLAN_CHUNK) {
        const int n = min(PLAN_CHUNK, P - b0);
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = a.sel[b0 + i];
        __syncthreads();
        if (e < a.E) c += count_in(chunk, n, e);
    }
    const int ir = a.item_rows, cnt = e < E_tot ? (e < a.E ? c : R) : 0, nit = (cnt + ir - 1) / ir;
    int cs = cnt, is = nit; /* inclusive scans within the warp */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int tc = __shfl_up_sync(0xffffffffu, cs, o), ti = __shfl_up_sync(0xffffffffu, is, o);
        if (lane >= o) cs += tc, is += ti;
    }
    if (lane == 31) wsum[w] = cs, wsum[32 + w] = is;
    __syncthreads();
    int po = cs - cnt, io = is - nit;
    for (int j = 0; j < w; j++) po += wsum[j], io += wsum[32 + j];
    if (e == E_tot - 1) {
        a.counts[0] = io + nit;
        a.counts[1] = po + cnt;
    }
    if (e < E_tot) {
        for (int i = 0; i * ir < cnt; i++) {
            int32_t *it = a.items + 3 * (int64_t)(io + i);
            it[0] = e;
            it[1] = po + i * ir;
            it[2] = min(ir, cnt - i * ir);
        }
        a.expert_counts[e] = cnt;
    }
    if (a.has_shared != 1 && e == a.E) a.expert_counts[a.E] = a.has_shared ? R : 0;
    if (a.has_shared == 1 && e == a.E) shared_off = po;
    int run = 0;
    for (int b0 = 0; b0 < P; b0 += PLAN_CHUNK) {
        const int n = min(PLAN_CHUNK, P - b0);
        if (P > PLAN_CHUNK) { /* else the chunk still holds every choice */
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = a.sel[b0 + i];
            __syncthreads();
        }
        if (e < a.E) {
            const int4 *c4 = reinterpret_cast<const int4 *>(chunk);
            for (int i4 = 0; i4 < (n + 3) / 4; i4++) {
                int v[4];
                if (4 * i4 + 3 < n) {
                    const int4 t = c4[i4];
                    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
                } else {
#pragma unroll
                    for (int u = 0; u < 4; u++) v[u] = 4 * i4 + u < n ? chunk[4 * i4 + u] : -1;
                }
                if (v[0] != e && v[1] != e && v[2] != e && v[3] != e) continue;
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (v[u] == e) { /* in (row, slot) order */
                        const int i = 4 * i4 + u, p = po + run++;
                        a.pair_row[p] = (b0 + i) / a.K;
                        a.pair_expert[p] = e;
                        a.pos_of[b0 + i] = p;
                    }
            }
        }
    }
    if (a.has_shared == 1) {
        __syncthreads(); /* shared_off */
        const int so = shared_off;
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            a.pair_row[so + r] = r;
            a.pair_expert[so + r] = a.E;
            a.pos_shared[r] = so + r;
        }
    }
}

/* x += sum_k y[pair(r, k)] w[r][k] (slots in increasing expert id) + the row's shared-expert
 * output: y[shared pair of r] (has_shared 1) or the sum of the split-K partials sh (has_shared 2:
 * it ran apart as a dense MLP, gpu_forward.c) */
__global__ void __launch_bounds__(RB) k_moe_combine(float *x, const float *y, const float *sh, int sh_splits,
                                                     int64_t sh_stride, int D, int K, const int32_t *pos_of,
                                                     const int32_t *pos_shared, const float *wgt, int has_shared,
                                                     const kdt_gstage_hdr *hdr, int max_rows, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(hdr->n_rows, max_rows);
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item t = item_of(it, ch, D);
        const int r = t.r;
        for (int d = t.lo + threadIdx.x; d < t.hi; d += RB) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += y[(int64_t)pos_of[r * K + k] * D + d] * wgt[r * K + k];
            const float out = has_shared == 2 ? acc + split_sum(sh, sh_splits, sh_stride, (int64_t)r * D + d)
                                              : (has_shared ? acc + y[(int64_t)pos_shared[r] * D + d] : acc);
            x[(int64_t)r * D + d] += out;
        }
    }
}

__global__ void __launch_bounds__(RB) k_taps(const float *x, int D, const kdt_gstage_hdr *hdr, const kdt_grow *rows,
                                              float *taps, int max_taps, int t, int max_rows, Chunks ch) {
    PDL_ENTRY();
    const int n = clamp_rows(hdr->n_rows, max_rows);
    for (int it = blockIdx.x; it < n * ch.n; it += gridDim.x) {
        const Item c = item_of(it, ch, D);
        const int ti = rows[c.r].tap_index;
        if (ti < 0) continue;
        for (int d = c.lo + threadIdx.x; d < c.hi; d += RB)
            taps[((int64_t)ti * max_taps + t) * D + d] = x[(int64_t)c.r * D + d];
    }
}

/* Warp per head row: the best (value, id) over the vocabulary tiles, ties -> lower id. */
__global__ void __launch_bounds__(128) k_argmax_final(const float *am_val, const int32_t *am_idx, int am_ld,
                                                      int n_tiles, const kdt_gstage_hdr *hdr, const int32_t *head_rows,
                                                      const kdt_grow *rows, int32_t *argmax, int max_rows) {
    PDL_ENTRY();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = clamp_rows(hdr->n_head, max_rows);
    for (int m = blockIdx.x * 4 + warp; m < n; m += gridDim.x * 4) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int t = lane; t < n_tiles; t += 32) {
            const float v = am_val[(int64_t)t * am_ld + m];
            const int i = am_idx[(int64_t)t * am_ld + m];
            if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float v = __shfl_xor_sync(0xffffffffu, bv, o);
            const int i = __shfl_xor_sync(0xffffffffu, bi, o);
            if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
        }
        if (lane == 0) argmax[rows[head_rows[m]].out_index] = bi == 0x7fffffff ? 0 : bi;
    }
}

/* ---- deterministic random fills (splitmix64 of (seed, index) -> Box-Muller) ---------------- */
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float hash_normal(uint64_t seed, uint64_t i) {
    const uint64_t a = mix64(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1), b = mix64(a + 0x632be59bd9b4e019ull);
    const float u1 = ((float)(a >> 40) + 1.0f) * (1.0f / 16777217.0f); /* (0, 1] */
    const float u2 = (float)(b >> 40) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}
__device__ __forceinline__ float hash_unit(uint64_t seed, uint64_t i) {
    return (float)(mix64(seed * 0x9e3779b97f4a7c15ull + 2 * i + 1) >> 40) * (1.0f / 16777216.0f);
}

/* W[b][r][c] for c < cols: mode 0 N(0, std); padding columns 0 */
__global__ void k_fill_mat(uint16_t *w, int64_t rows, int cols, int ld, float std, uint64_t seed) {
    const int64_t n = rows * ld;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(i % ld);
        w[i] = c < cols ? f32_to_bf16(std * hash_normal(seed, (uint64_t)i)) : (uint16_t)0;
    }
}

/* embedding: rows < V/2 N(0, 1); rows >= V/2 in blocks of `block` sharing a base: base + sigma N */
__global__ void k_fill_embed(uint16_t *w, int V, int D, int ld, int block, float sigma, uint64_t seed) {
    const int64_t n = (int64_t)V * ld;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int v = (int)(i / ld), c = (int)(i % ld);
        float x = 0.0f;
        if (c < D) {
            if (v < V / 2) {
                x = hash_normal(seed, (uint64_t)i);
            } else {
                const int b = (v - V / 2) / block;
                x = hash_normal(seed ^ 0x5bd1e995ull, (uint64_t)b * D + c) + sigma * hash_normal(seed, (uint64_t)i);
            }
        }
        w[i] = f32_to_bf16(x);
    }
}

/* mode 0: 1 + U(-0.1, 0.1) (norm weights); mode 1: N(0, std) */
__global__ void k_fill_vec(float *v, int n, int mode, float std, uint64_t seed) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        v[i] = mode == 0 ? 1.0f + 0.2f * (hash_unit(seed, (uint64_t)i) - 0.5f) : std * hash_normal(seed, (uint64_t)i);
}

/* cache rows of slots [0, n_slots) of one stream (every layer): N(0, 1), padding columns 0 */
__global__ void k_fill_kv(uint16_t *cache, int64_t layer_stride, int n_layers, const int32_t *table_row,
                          int page_size, int row_stride, int row_elems, int n_slots, uint64_t seed) {
    const int64_t n = (int64_t)n_layers * n_slots * row_stride;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(i % row_stride);
        const int64_t ls = i / row_stride;
        const int slot = (int)(ls % n_slots), l = (int)(ls / n_slots);
        const int page = table_row[slot / page_size];
        cache[l * layer_stride + ((int64_t)page * page_size + slot % page_size) * row_stride + c] =
            c < row_elems ? f32_to_bf16(hash_normal(seed, (uint64_t)i)) : (uint16_t)0;
    }
}

/* Reads n floats; writes only if the sum is exactly 12345 (never), so nothing dirties L2. */
__global__ void k_flush_read(const float4 *buf, int64_t n, float *sink) {
    float s = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float4 v = buf[i];
        s += v.x + v.y + v.z + v.w;
    }
    if (s == 12345.0f) *sink = s;
}

kdt_status launched(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", what, cudaGetErrorString(e));
    return KDT_OK;
}

/* The rows x chunks launch of a row-wise kernel whose rows are `width` columns wide: chunks of a
 * multiple of RB columns (kdt_g_chunk_cols), at most 4096 CTAs (the kernels stride over items). */
Chunks row_chunks(int max_rows, int width) {
    const int cols = kdt_g_chunk_cols(max_rows, width, RB);
    Chunks c = {(width + cols - 1) / cols, cols};
    if (c.n < 1) c.n = 1;
    return c;
}
unsigned grid_of(int max_rows, Chunks c) {
    const int64_t items = (int64_t)(max_rows < 1 ? 1 : max_rows) * c.n;
    return (unsigned)(items > 4096 ? 4096 : items);
}
/* A rows x chunks kernel (its last argument is ch) on RB threads, with programmatic dependence
 * when kdt_g_pdl_rows. */
template <typename... KArgs, typename... Args>
void launch_rows(void (*kernel)(KArgs...), int max_rows, Chunks ch, size_t smem, cudaStream_t s, Args... args) {
    pdl::launch(kernel, dim3(grid_of(max_rows, ch)), dim3(RB), smem, s, kdt_g_pdl_rows(), args..., ch);
}

} // namespace

/* ---- launchers ------------------------------------------------------------------------------ */
extern "C" kdt_status kdt_op_scatter(int32_t *table, const int32_t *updates, const kdt_gstage_hdr *hdr, int32_t max_n,
                                     cudaStream_t s) {
    const unsigned blocks = (unsigned)((max_n + 255) / 256 > 0 ? (max_n + 255) / 256 : 1);
    k_scatter<<<blocks, 256, 0, s>>>(table, updates, hdr);
    return launched("GPU block-table update");
}

extern "C" kdt_status kdt_op_embed(const kdt_gstage_hdr *hdr, const kdt_grow *rows, const kdt_gmat *embed, float *x,
                                   int32_t D, int32_t max_rows, cudaStream_t s) {
    const Chunks ch = row_chunks(max_rows, D);
    launch_rows(k_embed, max_rows, ch, 0, s, hdr, rows, *embed, x, D, max_rows);
    return launched("GPU embedding");
}

extern "C" kdt_status kdt_op_rmsnorm(const float *x, const int32_t *rowmap, const float *w, float eps, int32_t D,
                                     float *out, const int32_t *m_dev, int32_t max_rows, cudaStream_t s) {
    const Chunks ch = row_chunks(max_rows, D);
    launch_rows(k_rmsnorm, max_rows, ch, 0, s, x, rowmap, w, eps, D, out, m_dev, max_rows);
    return launched("GPU RMSNorm");
}

extern "C" kdt_status kdt_op_post_a(const float *part, int32_t splits, int64_t split_stride, int32_t ldp,
                                    int32_t q_lora, int32_t dc, int32_t dr, const float *q_a_norm,
                                    const float *kv_a_norm, const float *rope_cs, int32_t interleave,
                                    const kdt_gstage_hdr *hdr, const kdt_grow *rows, uint16_t *cache,
                                    const int32_t *block_table, int32_t max_pages, int32_t page_size,
                                    int32_t n_pages, int32_t row_stride, float *qa, int32_t max_rows,
                                    cudaStream_t s) {
    PostA a = {part, splits, split_stride, ldp, q_lora, dc, dr, q_a_norm, kv_a_norm, rope_cs, interleave,
               hdr, rows, cache, block_table, max_pages, page_size, n_pages, row_stride, qa, max_rows};
    const Chunks ch = row_chunks(max_rows, q_lora + dc);
    launch_rows(k_post_a, max_rows, ch, (size_t)(q_lora + dc + dr) * sizeof(float), s, a);
    return launched("GPU q_a / kv_a finish");
}

extern "C" kdt_status kdt_op_post_q(const float *part, int32_t splits, int64_t split_stride, int32_t ldp, int32_t H,
                                    int32_t dn, int32_t dr, int32_t dc, const float *rope_cs, int32_t interleave,
                                    const kdt_gstage_hdr *hdr, const kdt_grow *rows, float *q_nope, float *q_abs,
                                    int32_t max_rows, cudaStream_t s) {
    PostQ a = {part, splits, split_stride, ldp, H, dn, dr, dc, rope_cs, interleave, hdr, rows, q_nope, q_abs, max_rows};
    const Chunks ch = row_chunks(max_rows, H * dn + H * (dr / 2));
    launch_rows(k_post_q, max_rows, ch, 0, s, a);
    return launched("GPU q finish");
}

extern "C" kdt_status kdt_op_sum_splits(const float *part, int32_t splits, int64_t split_stride, int32_t ldp,
                                        int32_t batch, int32_t p_bstride, int32_t ncols, float *dst, int32_t ldd,
                                        int32_t d_bstride, const int32_t *m_dev, int32_t max_rows, cudaStream_t s) {
    const Chunks ch = row_chunks(max_rows, batch * ncols);
    launch_rows(k_sum_splits, max_rows, ch, 0, s, part, splits, split_stride, ldp, batch, p_bstride, ncols, dst, ldd,
                d_bstride, m_dev, max_rows);
    return launched("GPU split-K sum");
}

extern "C" kdt_status kdt_op_post_o(float *x, const float *part, int32_t splits, int64_t split_stride, const float *w,
                                    float eps, int32_t D, float *xn, const int32_t *m_dev, int32_t max_rows,
                                    cudaStream_t s) {
    /* x + partials, then the RMSNorm: the same arithmetic as one fused pass per row, but the row's
     * sum of squares needs all of its new x, which a chunked single pass could not wait for */
    const Chunks ch = row_chunks(max_rows, D);
    launch_rows(k_residual, max_rows, ch, 0, s, x, part, splits, split_stride, D, m_dev, max_rows);
    launch_rows(k_rmsnorm, max_rows, ch, 0, s, x, (const int32_t *)NULL, w, eps, D, xn, m_dev, max_rows);
    return launched("GPU o_proj finish");
}

extern "C" kdt_status kdt_op_residual(float *x, const float *part, int32_t splits, int64_t split_stride, int32_t D,
                                      const int32_t *m_dev, int32_t max_rows, cudaStream_t s) {
    const Chunks ch = row_chunks(max_rows, D);
    launch_rows(k_residual, max_rows, ch, 0, s, x, part, splits, split_stride, D, m_dev, max_rows);
    return launched("GPU residual");
}

extern "C" kdt_status kdt_op_swiglu(const float *part, int32_t splits, int64_t split_stride, int32_t ldp,
                                    const int32_t *n_dev, int32_t max_n, const int32_t *pair_expert,
                                    const kdt_gpu_expert *experts, int32_t inter, float *h, int32_t ldh,
                                    cudaStream_t s) {
    const int width = pair_expert ? ldp / 2 : inter; /* an expert's I is at most its i_pad <= ldp / 2 */
    const Chunks ch = row_chunks(max_n, width);
    launch_rows(k_swiglu, max_n, ch, 0, s, part, splits, split_stride, ldp, n_dev, max_n, pair_expert, experts, inter,
                h, ldh, width);
    return launched("GPU SwiGLU");
}

/* k_route_wide applies: one row per CTA, no group filter, K <= 32, K <= E <= RT; KDT_GPU_ROUTE_V1=1
 * (read per launch; for A/B and the bitwise test) keeps k_route */
static bool route_wide_ok(const Route &a, int rpc) {
    return !kdt_g_env_is("KDT_GPU_ROUTE_V1", '1') && rpc == 1 && a.G == 1 && a.K <= 32 && a.K <= a.E && a.E <= RT;
}
static Route route_args(const float *part, int32_t splits, int64_t split_stride, const float *bias,
                        const kdt_model_config *cfg, const kdt_gstage_hdr *hdr, int32_t *sel, float *wgt,
                        int32_t max_rows) {
    return Route{part, splits, split_stride, bias, cfg->n_routed_experts, cfg->n_experts_per_tok,
                 cfg->n_group > 1 ? cfg->n_group : 1, cfg->topk_group, cfg->norm_topk_prob,
                 cfg->routed_scaling_factor, hdr, sel, wgt, max_rows};
}

/* shared memory of one router row (a CTA holds route_rows_per_cta of them) */
extern "C" size_t kdt_op_route_smem(int32_t E, int32_t G) { return route_row_bytes(E, G); }

extern "C" kdt_status kdt_op_route(const float *part, int32_t splits, int64_t split_stride, const float *bias,
                                   const kdt_model_config *cfg, const kdt_gstage_hdr *hdr, int32_t *sel, float *wgt,
                                   int32_t max_rows, cudaStream_t s) {
    const Route a = route_args(part, splits, split_stride, bias, cfg, hdr, sel, wgt, max_rows);
    const int rpc = route_rows_per_cta(max_rows, a.E, a.G);
    int blocks = (max_rows + rpc - 1) / rpc;
    blocks = blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks);
    if (route_wide_ok(a, rpc)) {
        const Plan1 none = {};
        pdl::launch(k_route_wide<false>, dim3((unsigned)blocks), dim3((unsigned)((a.E + 31) / 32 * 32)), 0, s,
                    kdt_g_pdl_rows(), a, none);
        return launched("GPU MoE router");
    }
    pdl::launch(k_route, dim3((unsigned)blocks), dim3(RT), rpc * route_row_bytes(a.E, a.G), s, kdt_g_pdl_rows(), a, rpc);
    return launched("GPU MoE router");
}

/* Whether a pass of launch bound max_rows routes and plans in one kernel (kdt_op_route_plan1):
 * one row, and k_route_wide applies; KDT_GPU_ROUTE_PLAN=0 (read per call) keeps two kernels. */
extern "C" int kdt_op_route_plan1_ok(const kdt_model_config *cfg, int32_t max_rows) {
    return max_rows == 1 && route_wide_ok(route_args(NULL, 0, 0, NULL, cfg, NULL, NULL, NULL, 1), 1) && !kdt_g_env_is("KDT_GPU_ROUTE_PLAN", '0');
}

/* The router and the MoE plan of a one-row pass in one kernel (k_route_wide<true>): the outputs of
 * kdt_op_route then kdt_op_moe_plan (kdt_op_route_plan1_ok must hold). */
extern "C" kdt_status kdt_op_route_plan1(const float *part, int32_t splits, int64_t split_stride, const float *bias,
                                         const kdt_model_config *cfg, const kdt_gstage_hdr *hdr, int32_t *sel,
                                         float *wgt, int32_t has_shared, int32_t *pair_row, int32_t *pair_expert,
                                         int32_t *pos_of, int32_t *pos_shared, int32_t *items, int32_t *counts,
                                         int32_t *expert_counts, cudaStream_t s) {
    if (!kdt_op_route_plan1_ok(cfg, 1)) return kdt_fail(KDT_ERR_INTERNAL, "GPU MoE router + plan: not applicable");
    const Route a = route_args(part, splits, split_stride, bias, cfg, hdr, sel, wgt, 1);
    const Plan1 pl = {has_shared, pair_row, pair_expert, pos_of, pos_shared, items, counts, expert_counts};
    pdl::launch(k_route_wide<true>, dim3(1), dim3((unsigned)((a.E + 31) / 32 * 32)), 0, s, kdt_g_pdl_rows(), a, pl);
    return launched("GPU MoE router + plan");
}

/* warp totals and the chunk of choices (the counts and offsets live in registers) */
extern "C" size_t kdt_op_plan_smem(int32_t E_tot) {
    (void)E_tot;
    return ((size_t)64 + PLAN_CHUNK) * sizeof(int32_t);
}

extern "C" kdt_status kdt_op_moe_plan(const kdt_gstage_hdr *hdr, const int32_t *sel, int32_t K, int32_t E,
                                      int32_t has_shared, int32_t max_rows, int32_t item_rows, int32_t *pair_row,
                                      int32_t *pair_expert, int32_t *pos_of, int32_t *pos_shared, int32_t *items,
                                      int32_t *counts, int32_t *expert_counts, cudaStream_t s) {
    if (item_rows < KDT_G_ITEM_ROWS_MIN || item_rows > KDT_G_BM) /* the item list is sized for >= the minimum */
        return kdt_fail(KDT_ERR_INTERNAL, "GPU MoE plan: %d rows per item (%d..%d)", item_rows, KDT_G_ITEM_ROWS_MIN,
                        KDT_G_BM);
    Plan a = {hdr, sel, K, E, has_shared, max_rows, item_rows, pair_row, pair_expert, pos_of, pos_shared, items,
              counts, expert_counts};
    const int threads = (E + 1 + 31) / 32 * 32;
    pdl::launch(k_moe_plan, dim3(1), dim3(threads), kdt_op_plan_smem(E + (has_shared != 0)), s, kdt_g_pdl_rows(), a);
    return launched("GPU MoE plan");
}

extern "C" kdt_status kdt_op_moe_combine(float *x, const float *y, const float *sh, int32_t sh_splits,
                                         int64_t sh_stride, int32_t D, int32_t K, const int32_t *pos_of,
                                         const int32_t *pos_shared, const float *wgt, int32_t has_shared,
                                         const kdt_gstage_hdr *hdr, int32_t max_rows, cudaStream_t s) {
    if (has_shared == 2 && (!sh || sh_splits < 1))
        return kdt_fail(KDT_ERR_INTERNAL, "GPU MoE combine: no shared-expert partials");
    const Chunks ch = row_chunks(max_rows, D);
    launch_rows(k_moe_combine, max_rows, ch, 0, s, x, y, sh, sh_splits, sh_stride, D, K, pos_of, pos_shared, wgt,
                has_shared, hdr, max_rows);
    return launched("GPU MoE combine");
}

extern "C" kdt_status kdt_op_taps(const float *x, int32_t D, const kdt_gstage_hdr *hdr, const kdt_grow *rows,
                                  float *taps, int32_t max_taps, int32_t t, int32_t max_rows, cudaStream_t s) {
    const Chunks ch = row_chunks(max_rows, D);
    launch_rows(k_taps, max_rows, ch, 0, s, x, D, hdr, rows, taps, max_taps, t, max_rows);
    return launched("GPU taps");
}

extern "C" kdt_status kdt_op_argmax_final(const float *am_val, const int32_t *am_idx, int32_t am_ld, int32_t n_tiles,
                                          const kdt_gstage_hdr *hdr, const int32_t *head_rows, const kdt_grow *rows,
                                          int32_t *argmax, int32_t max_rows, cudaStream_t s) {
    pdl::launch(k_argmax_final, dim3((unsigned)((max_rows + 3) / 4)), dim3(128), 0, s, kdt_g_pdl_rows(), am_val, am_idx,
                am_ld, n_tiles, hdr, head_rows, rows, argmax, max_rows);
    return launched("GPU argmax");
}

extern "C" kdt_status kdt_op_fill_mat(uint16_t *w, int64_t rows, int32_t cols, int32_t ld, float std, uint64_t seed,
                                      cudaStream_t s) {
    k_fill_mat<<<4096, 256, 0, s>>>(w, rows, cols, ld, std, seed);
    return launched("GPU random fill");
}

extern "C" kdt_status kdt_op_fill_embed(uint16_t *w, int32_t V, int32_t D, int32_t ld, int32_t block, float sigma,
                                        uint64_t seed, cudaStream_t s) {
    k_fill_embed<<<4096, 256, 0, s>>>(w, V, D, ld, block, sigma, seed);
    return launched("GPU random embedding");
}

extern "C" kdt_status kdt_op_fill_vec(float *v, int32_t n, int32_t mode, float std, uint64_t seed, cudaStream_t s) {
    k_fill_vec<<<(unsigned)((n + 255) / 256 < 1024 ? (n + 255) / 256 + 1 : 1024), 256, 0, s>>>(v, n, mode, std, seed);
    return launched("GPU random vector");
}

extern "C" kdt_status kdt_op_fill_kv(uint16_t *cache, int64_t layer_stride, int32_t n_layers, const int32_t *table_row,
                                     int32_t page_size, int32_t row_stride, int32_t row_elems, int32_t n_slots,
                                     uint64_t seed, cudaStream_t s) {
    k_fill_kv<<<4096, 256, 0, s>>>(cache, layer_stride, n_layers, table_row, page_size, row_stride, row_elems, n_slots,
                                   seed);
    return launched("GPU random KV fill");
}

extern "C" kdt_status kdt_op_flush_read(const float *buf, int64_t n_floats, float *sink, cudaStream_t s) {
    k_flush_read<<<2048, 256, 0, s>>>(reinterpret_cast<const float4 *>(buf), n_floats / 4, sink);
    return launched("GPU L2 flush");
}
