/* gpu_plain.cu - the plain (non-absorbed) MLA attention of a prefill chunk on the GPU, the twin of
 * forward.c's plain form (kdt_model_options / kdt_gpu_runner_options.prefill_attention):
 *
 *   plain_up:   for every visible key t < T of the chunk's stream and every head h,
 *               k_nope[h][t] = W_UK[h] c_kv_t and v[h][t] = W_UV[h] c_kv_t (bf16 cache rows times
 *               the bf16 weights on tensor cores, fp32 sums), plus k_pe copied beside k_nope:
 *               K[h][t] = [k_nope | k_pe | 0 pad], V[h][t] = [v | 0 pad], each stored as a bf16
 *               pair hi = bf16(x), lo = bf16(x - hi) (~16 bits): the absorbed form scores and sums
 *               the cache's own bf16 rows and applies W_UV in fp32, so a single bf16 rounding of
 *               K and V here would make this form's error about twice the absorbed one's.
 *   plain_attn: per head, a causal flash attention of the chunk's rows (row r at slot
 *               first + r sees keys 0..first + r) over K and V: S = [q_nope | q_pe] K^T,
 *               online softmax in fp32 (exp2 of the scaled scores), O += P V with P in bf16,
 *               O / l into the heads buffer o_proj reads ([R][H * d_v] fp32). Q and P are bf16
 *               as in the absorbed form; K and V enter as hi then lo (two products each).
 *
 * Both are mma.sync m16n8k16 kernels (sm_80 and later; no wgmma), CTAs of 4 warps, 16 rows per
 * warp, 64-key tiles. Bits: a key's K / V row is a function of its cache row alone; a query row
 * walks the keys in 64-key tiles from key 0 by absolute index, and tiles past its slot only add
 * exact zeros (p = exp2(-inf) = 0, the max unchanged), so its result depends on its token,
 * position and keys only: not on the chunk size, the other rows, or which warp holds it. It is
 * not the absorbed form's bits (another order of the same sums).
 *
 * Key blocks: the scratch holds cap keys (KDT_GPU_PLAIN_MAX_KEYS at most); a chunk that sees more
 * runs plain_up, plain_kpe and plain_attn once per block of cap keys, in key order, and
 * plain_attn carries each row's softmax state (the fp32 O, max and partial sums its threads
 * hold) from one block to the next through a state buffer: the same tiles in the same order with
 * the same values, so the same bits as one pass over a scratch of T keys. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attn_plan.h"
#include "gpu_internal.h"
#include "gpu_mma.cuh"
#include "kernels/cuda/wgmma_sm90.cuh"

namespace {
using namespace kg;

constexpr int BM = KDT_AP_PLAIN_ROWS; /* query rows (up-projection: keys) per CTA */
constexpr int BN = KDT_AP_PLAIN_KEYS; /* keys per tile (up-projection: output columns per CTA) */
constexpr int PAD = KDT_AP_PLAIN_PAD; /* bf16 per smem row beyond its data: conflict-free ldmatrix rows */
constexpr int THREADS = 128;
static_assert(BM <= 2 * BN, "one stage keeps Q's rows in K's tile");

/* ---- up-projection ------------------------------------------------------------------------- */

/* One CTA: 64 keys x 64 output columns of one head, K = d_c in 64-wide steps. TRANS: the weight
 * is stored [d_c][n] (uk_t, W_UK transposed), else [n][d_c] (uv); its rows (columns) past n_out
 * read as zero. Writes columns [0, n_store) of out_hi / out_lo[h][t][ld_out] for t < T (the bf16
 * pair): V's padding columns get zeros. */
template <bool TRANS>
__global__ void __launch_bounds__(THREADS) plain_up(kdt_plain_args a, const uint16_t *__restrict__ w, int32_t ldw,
                                                    int64_t w_batch, int32_t n_out, int32_t n_store,
                                                    uint16_t *__restrict__ out_hi, uint16_t *__restrict__ out_lo,
                                                    int32_t ld_out) {
    __shared__ __align__(16) uint16_t As[BM][64 + PAD];
    __shared__ __align__(16) uint16_t Bs[64][64 + PAD];
    const int h = blockIdx.y, t0 = a.k0 + blockIdx.x * BM, n0 = blockIdx.z * BN, t_end = a.k0 + a.kn;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint16_t *wh = w + (int64_t)h * w_batch;
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    for (int e0 = 0; e0 < a.dc; e0 += 64) {
        /* A: 64 cache rows' c_kv[e0, e0 + 64) (zero past d_c or T), 8 chunks of 16 bytes a row */
        for (int i = threadIdx.x; i < BM * 8; i += THREADS) {
            const int r = i >> 3, ch = i & 7, t = t0 + r, e = e0 + ch * 8;
            const uint16_t *src = a.kv;
            int bytes = 0;
            if (t < t_end && e < a.dc) {
                const int32_t page = a.block_table[(int64_t)a.stream * a.max_pages + t / a.page_size];
                src = a.kv + ((int64_t)page * a.page_size + t % a.page_size) * a.row_stride + e;
                bytes = 16;
            }
            cp_async16(&As[r][ch * 8], src, bytes);
        }
        /* B: the weight block, as stored (TRANS: rows e, columns n; else rows n, columns e) */
        for (int i = threadIdx.x; i < 64 * 8; i += THREADS) {
            const int r = i >> 3, ch = i & 7;
            const uint16_t *src = wh;
            int bytes = 0;
            if (TRANS) {
                if (e0 + r < a.dc && n0 + ch * 8 < ldw) src = wh + (int64_t)(e0 + r) * ldw + n0 + ch * 8, bytes = 16;
            } else {
                if (n0 + r < n_out && e0 + ch * 8 < ldw) src = wh + (int64_t)(n0 + r) * ldw + e0 + ch * 8, bytes = 16;
            }
            cp_async16(&Bs[r][ch * 8], src, bytes);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t af[4];
            ldsm_x4(af, &As[warp * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int nb = 0; nb < 4; nb++) { /* two 8-column blocks per ldmatrix */
                uint32_t bf[4];
                if (TRANS) ldsm_x4_trans(bf, &Bs[kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][nb * 16 + (lane >> 4) * 8]);
                else ldsm_x4(bf, &Bs[nb * 16 + (lane & 7) + (lane >> 4) * 8][kk * 16 + ((lane >> 3) & 1) * 8]);
                mma16816(acc[2 * nb], af, bf[0], bf[1]);
                mma16816(acc[2 * nb + 1], af, bf[2], bf[3]);
            }
        }
        __syncthreads();
    }
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int t = t0 + warp * 16 + g + half * 8, n = n0 + nb * 8 + 2 * c;
            if (t >= t_end) continue;
            const int64_t at = ((int64_t)h * a.cap + (t - a.k0)) * ld_out + n;
            for (int j = 0; j < 2; j++)
                if (n + j < n_store) {
                    const float x = acc[nb][2 * half + j];
                    const uint16_t hi = f32_to_bf16(x);
                    out_hi[at + j] = hi;
                    out_lo[at + j] = f32_to_bf16(x - bf16_to_f32(hi));
                }
        }
}

/* K[h][t - k0][dn .. dqk_p) = [k_pe_t | 0] for every head (the rope part is shared), t in the block */
__global__ void plain_kpe(kdt_plain_args a) {
    const int t = a.k0 + blockIdx.x, width = a.dqk_p - a.dn;
    const int32_t page = a.block_table[(int64_t)a.stream * a.max_pages + t / a.page_size];
    const uint16_t *row = a.kv + ((int64_t)page * a.page_size + t % a.page_size) * a.row_stride + a.dc;
    for (int i = threadIdx.x; i < a.H * width; i += blockDim.x) {
        const int h = i / width, j = i % width;
        const int64_t at = ((int64_t)h * a.cap + (t - a.k0)) * a.dqk_p + a.dn + j;
        a.k_hi[at] = j < a.dr ? row[j] : (uint16_t)0; /* k_pe is bf16 already: lo = 0 */
        a.k_lo[at] = 0;
    }
}

/* ---- attention ----------------------------------------------------------------------------- */

/* One CTA: 64 rows of the chunk (later tiles first: they have the most keys), one head, over the
 * launch's block of keys [k0, k0 + kn): its tiles of the rows' causal range, from the state the
 * previous block saved (k0 > 0), to the state for the next block or, in the block that ends at T,
 * O / l into heads. The blocks cut the one walk over the tiles at tile boundaries and the state
 * is the registers' fp32 values, so the bits do not depend on the block size. DVP: d_v padded
 * (16..256); dqk_p <= MAXK * 16. Two kernels share everything but the products: plain_attn
 * (mma.sync, ldmatrix from padded rows; ST K / V stages, 2: the next tile loads during this one)
 * and plain_attn_wg (sm_90a wgmma from swizzled slabs, 2 stages, d_v padded to 64 or 128), whose
 * accumulators have mma.sync's layout and whose chains the same k16 order (per element: hi then lo
 * per step), so the same bits (gpu_test_model_gpu compares the two). */
constexpr int MAXK = KDT_AP_PLAIN_MAX_DQK / 16;

/* The CTA's place: its rows, tiles and block. */
struct AttnTile {
    int h, q0, rows, nks, tile_lo, tile_hi;
    bool final;
};
__device__ __forceinline__ AttnTile attn_tile(const kdt_plain_args &a) {
    AttnTile t;
    t.h = blockIdx.y;
    t.q0 = (gridDim.x - 1 - blockIdx.x) * BM;
    t.rows = a.R - t.q0 < BM ? a.R - t.q0 : BM;
    const int last_slot = a.first + t.q0 + t.rows - 1, n_tiles = last_slot / BN + 1;
    t.nks = a.dqk_p / 16;
    t.tile_lo = a.k0 / BN;
    const int block_end = (a.k0 + a.kn + BN - 1) / BN;
    t.tile_hi = n_tiles < block_end ? n_tiles : block_end;
    t.final = a.k0 + a.kn == a.T;
    return t;
}

/* Q: [q_nope | q_pe | 0] as bf16 (rows past R zero) into Qs [BM][qp] */
__device__ __forceinline__ void load_q(const kdt_plain_args &a, const AttnTile &t, uint16_t *Qs, int qp) {
    for (int i = threadIdx.x; i < BM * a.dqk_p; i += THREADS) {
        const int r = i / a.dqk_p, j = i % a.dqk_p, row = t.q0 + r;
        float v = 0.0f;
        if (row < a.R) {
            if (j < a.dn) v = a.q_nope[((int64_t)row * a.H + t.h) * a.dn + j];
            else if (j < a.dn + a.dr) v = a.q_abs[((int64_t)row * a.H + t.h) * (a.dc + a.dr) + a.dc + (j - a.dn)];
        }
        Qs[r * qp + j] = f32_to_bf16(v);
    }
}

/* One tile's K and V rows (keys tile * BN .., zeros past the block) of both planes by cp.async:
 * 16-byte chunk ch of key r of plane part to kdst(part, r, ch), resp. vdst(part, r, ch). */
template <int DVP, class KDst, class VDst>
__device__ __forceinline__ void load_kv(const kdt_plain_args &a, int h, int tile, KDst kdst, VDst vdst) {
    const int kt0 = tile * BN, t_end = a.k0 + a.kn, kch = a.dqk_p / 8;
    constexpr int VCH = DVP / 8;
    for (int part = 0; part < 2; part++) {
        const uint16_t *kh = (part ? a.k_lo : a.k_hi) + (int64_t)h * a.cap * a.dqk_p;
        const uint16_t *vh = (part ? a.v_lo : a.v_hi) + (int64_t)h * a.cap * DVP;
        for (int i = threadIdx.x; i < BN * kch; i += THREADS) {
            const int r = i / kch, ch = i % kch, k = kt0 + r;
            cp_async16(kdst(part, r, ch), k < t_end ? kh + (int64_t)(k - a.k0) * a.dqk_p + ch * 8 : kh,
                       k < t_end ? 16 : 0);
        }
        for (int i = threadIdx.x; i < BN * VCH; i += THREADS) {
            const int r = i / VCH, ch = i % VCH, k = kt0 + r;
            cp_async16(vdst(part, r, ch), k < t_end ? vh + (int64_t)(k - a.k0) * DVP + ch * 8 : vh, k < t_end ? 16 : 0);
        }
    }
}

/* The state the previous block left (k0 > 0): this thread's O columns, the rows' max, its partial
 * sums; otherwise O 0, max -inf, sums 0. */
template <int DVP>
__device__ __forceinline__ void state_in(const kdt_plain_args &a, const AttnTile &t, float (&o)[DVP / 8][4],
                                         float (&m_run)[2], float (&l_run)[2]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int i = 0; i < DVP / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.0f;
    if (a.k0 == 0) return;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = t.q0 + warp * 16 + g + 8 * half;
        if (row >= a.R) continue;
        const float *sv = a.state + ((int64_t)row * a.H + t.h) * a.state_ld;
#pragma unroll
        for (int vb = 0; vb < DVP / 8; vb++) {
            o[vb][2 * half] = sv[vb * 8 + 2 * c];
            o[vb][2 * half + 1] = sv[vb * 8 + 2 * c + 1];
        }
        m_run[half] = sv[DVP];
        l_run[half] = sv[DVP + 1 + c];
    }
}

/* The tile's scores s (this thread's of rows slot0, slot0 + 8; keys kt0 + 8 nb + 2 c + {0, 1}):
 * mask (key t visible to the row at slot iff t <= slot), scale, the online softmax's new max;
 * s becomes P, l_run gains its sums, O is rescaled. */
template <int DVP>
__device__ __forceinline__ void softmax_tile(float (&s)[8][4], float (&o)[DVP / 8][4], float (&m_run)[2],
                                             float (&l_run)[2], int kt0, int slot0, float scale_log2) {
    const int c = threadIdx.x & 3;
    float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int t = kt0 + nb * 8 + 2 * c + (e & 1), half = e >> 1;
            const float v = t <= slot0 + 8 * half ? s[nb][e] * scale_log2 : -INFINITY;
            s[nb][e] = v;
            mt[half] = fmaxf(mt[half], v);
        }
    float corr[2];
#pragma unroll
    for (int half = 0; half < 2; half++) {
        mt[half] = fmaxf(mt[half], __shfl_xor_sync(0xffffffffu, mt[half], 1));
        mt[half] = fmaxf(mt[half], __shfl_xor_sync(0xffffffffu, mt[half], 2));
        const float m_new = fmaxf(m_run[half], mt[half]); /* finite: key 0 is in tile 0, the first block's */
        corr[half] = exp2f(m_run[half] - m_new);
        m_run[half] = m_new;
        l_run[half] *= corr[half];
    }
#pragma unroll
    for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int half = e >> 1;
            const float p = exp2f(s[nb][e] - m_run[half]);
            s[nb][e] = p;
            l_run[half] += p;
        }
#pragma unroll
    for (int i = 0; i < DVP / 8; i++) {
        o[i][0] *= corr[0], o[i][1] *= corr[0];
        o[i][2] *= corr[1], o[i][3] *= corr[1];
    }
}

/* P's accumulator layout is the A fragment of keys [16 kk, 16 kk + 16) */
__device__ __forceinline__ void p_frag(const float (&s)[8][4], int kk, uint32_t (&pf)[4]) {
    pf[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    pf[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pf[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pf[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

/* After the block's tiles: the state for the next block, as held, or (the block that ends at T)
 * O / l into heads. */
template <int DVP>
__device__ __forceinline__ void state_out(const kdt_plain_args &a, const AttnTile &t, const float (&o)[DVP / 8][4],
                                          const float (&m_run)[2], float (&l_run)[2]) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    if (!t.final) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int row = t.q0 + warp * 16 + g + 8 * half;
            if (row >= a.R) continue;
            float *sv = a.state + ((int64_t)row * a.H + t.h) * a.state_ld;
#pragma unroll
            for (int vb = 0; vb < DVP / 8; vb++) {
                sv[vb * 8 + 2 * c] = o[vb][2 * half];
                sv[vb * 8 + 2 * c + 1] = o[vb][2 * half + 1];
            }
            if (c == 0) sv[DVP] = m_run[half];
            sv[DVP + 1 + c] = l_run[half];
        }
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 1);
        l_run[half] += __shfl_xor_sync(0xffffffffu, l_run[half], 2);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = t.q0 + warp * 16 + g + 8 * half;
        if (row >= a.R) continue;
        float *dst = a.heads + (int64_t)row * a.H * a.dv + (int64_t)t.h * a.dv;
        const float inv = 1.0f / l_run[half];
#pragma unroll
        for (int vb = 0; vb < DVP / 8; vb++) {
            const int col = vb * 8 + 2 * c;
            if (col < a.dv) dst[col] = o[vb][2 * half] * inv;
            if (col + 1 < a.dv) dst[col + 1] = o[vb][2 * half + 1] * inv;
        }
    }
}

template <int DVP, int ST>
__global__ void __launch_bounds__(THREADS) plain_attn(kdt_plain_args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int qp = a.dqk_p + PAD, vp = DVP + PAD;
    uint16_t *Qs = reinterpret_cast<uint16_t *>(smem_raw);
    /* one stage: Q's rows are K's first tile's (Q moves to registers before K loads), so Kimi's
     * instance fits the 99 KB parts; two stages keep Q apart, so tile 0 loads while Q is read */
    uint16_t *Ks = ST == 1 ? Qs : Qs + BM * qp; /* [ST][hi, lo][BN][qp] */
    uint16_t *Vs = Ks + ST * 2 * BN * qp; /* [ST][hi, lo][BN][vp] */
    const AttnTile t = attn_tile(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    if (t.tile_lo >= t.tile_hi && !t.final) return; /* no key of the block is visible to these rows */
    load_q(a, t, Qs, qp);
    auto load_tile = [&](int tile, int st) { /* padded rows */
        load_kv<DVP>(
            a, t.h, tile, [&](int part, int r, int ch) { return Ks + (st * 2 + part) * BN * qp + r * qp + ch * 8; },
            [&](int part, int r, int ch) { return Vs + (st * 2 + part) * BN * vp + r * vp + ch * 8; });
    };
    const bool any = t.tile_lo < t.tile_hi;
    if (ST == 2 && any) {
        load_tile(t.tile_lo, 0);
        cp_async_commit();
    }
    __syncthreads(); /* Q */
    uint32_t qf[MAXK][4];
#pragma unroll
    for (int ks = 0; ks < MAXK; ks++)
        if (ks < t.nks) ldsm_x4(qf[ks], Qs + (warp * 16 + (lane & 15)) * qp + ks * 16 + (lane >> 4) * 8);
    if (ST == 1 && any) {
        __syncthreads(); /* every warp holds its Q fragments: their shared memory is K's now */
        load_tile(t.tile_lo, 0);
        cp_async_commit();
    }

    float o[DVP / 8][4], m_run[2], l_run[2];
    state_in<DVP>(a, t, o, m_run, l_run);
    const int slot0 = a.first + t.q0 + warp * 16 + g; /* this thread's rows: slot0, slot0 + 8 */

    for (int tile = t.tile_lo; tile < t.tile_hi; tile++) {
        const int st = ST == 2 ? (tile - t.tile_lo) & 1 : 0;
        if (ST == 1 && tile > t.tile_lo) { /* one stage: this tile loads now (the last one's readers are done) */
            load_tile(tile, 0);
            cp_async_commit();
        }
        if (ST == 2 && tile + 1 < t.tile_hi) {
            load_tile(tile + 1, (tile + 1 - t.tile_lo) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t *kd = Ks + st * 2 * BN * qp, *vd = Vs + st * 2 * BN * vp; /* hi; lo one plane on */
        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < MAXK; ks++) {
            if (ks >= t.nks) break;
#pragma unroll
            for (int nb = 0; nb < 4; nb++) {
                const int off = (nb * 16 + (lane & 7) + (lane >> 4) * 8) * qp + ks * 16 + ((lane >> 3) & 1) * 8;
                uint32_t bh[4], bl[4];
                ldsm_x4(bh, kd + off);
                ldsm_x4(bl, kd + BN * qp + off);
                mma16816(s[2 * nb], qf[ks], bh[0], bh[1]);
                mma16816(s[2 * nb + 1], qf[ks], bh[2], bh[3]);
                mma16816(s[2 * nb], qf[ks], bl[0], bl[1]);
                mma16816(s[2 * nb + 1], qf[ks], bl[2], bl[3]);
            }
        }
        softmax_tile<DVP>(s, o, m_run, l_run, tile * BN, slot0, a.scale_log2);
        /* O += P V */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t pf[4];
            p_frag(s, kk, pf);
#pragma unroll
            for (int vb = 0; vb < DVP / 16; vb++) {
                const int off = (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * vp + vb * 16 + (lane >> 4) * 8;
                uint32_t bh[4], bl[4];
                ldsm_x4_trans(bh, vd + off);
                ldsm_x4_trans(bl, vd + BN * vp + off);
                mma16816(o[2 * vb], pf, bh[0], bh[1]);
                mma16816(o[2 * vb + 1], pf, bh[2], bh[3]);
                mma16816(o[2 * vb], pf, bl[0], bl[1]);
                mma16816(o[2 * vb + 1], pf, bl[2], bl[3]);
            }
        }
        __syncthreads(); /* this stage is loaded again (two tiles on, or next with one stage) */
    }
    state_out<DVP>(a, t, o, m_run, l_run);
}

/* ---- the sm_90a form: wgmma from 128-byte-swizzled slabs (kernels/cuda/wgmma_sm90.cuh) --------
 * K and V tiles as slabs of [64 keys][64 bf16] (8 KB each: K ceil(dqk_p / 64) per plane, V DVP /
 * 64), hi and lo planes, 2 stages, after Q's padded rows (read once into registers, as above).
 * S = Q K^T: m64n64k16 per k step, A = Q's fragments, B = the K slabs (K-major), hi then lo;
 * O += P V: m64n{DVP}k16 per 16 keys, A = P's fragments, B = the V slabs read N-major (trans-b;
 * LBO the slab stride, SBO 8 rows), hi then lo. The accumulators s[8][4] and o[DVP / 8][4] are
 * the wgmma fragments d[4 j + e] (row g / g + 8, columns 8 j + 2 c + {0, 1}): mma.sync's. */
[[maybe_unused]] constexpr int WG_SLAB = BN * 128; /* bytes of one slab: 64 keys x 128 bytes */

/* the operand list of an m64nN f32 accumulator held as float[N / 8][4] */
#define KDT_PW_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define KDT_PW_D32 KDT_PW_D4(0), KDT_PW_D4(1), KDT_PW_D4(2), KDT_PW_D4(3), KDT_PW_D4(4), KDT_PW_D4(5), KDT_PW_D4(6), \
                   KDT_PW_D4(7)
#define KDT_PW_D64 KDT_PW_D32, KDT_PW_D4(8), KDT_PW_D4(9), KDT_PW_D4(10), KDT_PW_D4(11), KDT_PW_D4(12), KDT_PW_D4(13), \
                   KDT_PW_D4(14), KDT_PW_D4(15)
#define KDT_PW_R32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
                   "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
#define KDT_PW_R64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
                   "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
                   "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
                   "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
/* d += A(registers) B(desc), always accumulating; TB: B N-major (trans-b) */
template <bool TB>
__device__ __forceinline__ void wg_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
#if KDT_HAS_WGMMA
    asm volatile("{\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " KDT_PW_R32
                 "{%32,%33,%34,%35}, %36, 1, 1, 1, %37;\n}\n"
                 : KDT_PW_D32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB ? 1 : 0));
#else
    (void)d, (void)a, (void)db;
#endif
}
[[maybe_unused]] __device__ __forceinline__ void wg_n128_tb(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
#if KDT_HAS_WGMMA
    asm volatile("{\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " KDT_PW_R64
                 "{%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n}\n"
                 : KDT_PW_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#else
    (void)d, (void)a, (void)db;
#endif
}
/* an empty asm that reads and writes an accumulator: keeps its writes by ordinary instructions
 * on their side of wg::fence */
template <int NB>
__device__ __forceinline__ void pin(float (&d)[NB][4]) {
#pragma unroll
    for (int j = 0; j < NB; j++) asm volatile("" : KDT_PW_D4(j) : : "memory");
}
#undef KDT_PW_R64
#undef KDT_PW_R32
#undef KDT_PW_D64
#undef KDT_PW_D32
template <int DVP>
__device__ __forceinline__ void wg_pv(float (&o)[DVP / 8][4], const uint32_t (&pf)[4], uint64_t db) {
    if constexpr (DVP == 128) wg_n128_tb(o, pf, db);
    else wg_n64<true>(o, pf, db);
}

/* 1 in a device pass that has wgmma (read back once per runner: plain_setup) */
__global__ void plain_wg_probe(int *out) { *out = KDT_HAS_WGMMA; }

/* NKS: the k steps of S when fixed at compile time (12: d_n + d_r = 192, DeepSeek-V3 and Kimi),
 * 0 for dqk_p / 16 at run time. With a runtime bound ptxas injects a warpgroup.arrive before
 * every product (C7519: 17 per instance); a fixed one needs none. */
template <int DVP, int NKS>
__global__ void __launch_bounds__(THREADS) plain_attn_wg(kdt_plain_args a) {
    static_assert(DVP == 64 || DVP == 128, "plain_attn_wg: d_v padded to 64 or 128");
    static_assert(NKS >= 0 && NKS <= MAXK, "plain_attn_wg: k steps");
#if KDT_HAS_WGMMA
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int qp = a.dqk_p + PAD;
    uint16_t *Qs = reinterpret_cast<uint16_t *>(smem_raw);
    const uint32_t raw = smem_u32(smem_raw);
    const uint32_t ring = (raw + (uint32_t)(BM * qp * 2) + 1023u) & ~1023u; /* slabs 1024-byte aligned */
    unsigned char *ring_p = smem_raw + (ring - raw);
    const int plane_k = (a.dqk_p + 63) / 64 * WG_SLAB;
    constexpr int PLANE_V = DVP / 64 * WG_SLAB;
    const int stage_bytes = 2 * plane_k + 2 * PLANE_V; /* K hi, K lo, V hi, V lo */
    const AttnTile t = attn_tile(a);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    if (t.tile_lo >= t.tile_hi && !t.final) return; /* no key of the block is visible to these rows */
    load_q(a, t, Qs, qp);
    auto load_tile = [&](int tile, int st) { /* swizzled slabs */
        unsigned char *sb = ring_p + st * stage_bytes;
        load_kv<DVP>(
            a, t.h, tile,
            [&](int part, int r, int ch) { return sb + part * plane_k + (ch >> 3) * WG_SLAB + wg::sw128_offset(r, (ch & 7) * 8); },
            [&](int part, int r, int ch) {
                return sb + 2 * plane_k + part * PLANE_V + (ch >> 3) * WG_SLAB + wg::sw128_offset(r, (ch & 7) * 8);
            });
    };
    const bool any = t.tile_lo < t.tile_hi;
    if (any) {
        load_tile(t.tile_lo, 0);
        cp_async_commit();
    }
    __syncthreads(); /* Q */
    uint32_t qf[MAXK][4];
#pragma unroll
    for (int ks = 0; ks < MAXK; ks++)
        if (ks < t.nks) ldsm_x4(qf[ks], Qs + (warp * 16 + (lane & 15)) * qp + ks * 16 + (lane >> 4) * 8);

    float o[DVP / 8][4], m_run[2], l_run[2];
    state_in<DVP>(a, t, o, m_run, l_run);
    const int slot0 = a.first + t.q0 + warp * 16 + g; /* this thread's rows: slot0, slot0 + 8 */

    for (int tile = t.tile_lo; tile < t.tile_hi; tile++) {
        const int st = (tile - t.tile_lo) & 1;
        if (tile + 1 < t.tile_hi) {
            load_tile(tile + 1, st ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        wg::fence_proxy_async(); /* this thread's cp.async writes, for wgmma's async proxy */
        __syncthreads();
        const uint32_t kb = ring + (uint32_t)(st * stage_bytes), vb = kb + 2u * (uint32_t)plane_k;
        float s[8][4];
#pragma unroll
        for (int i = 0; i < 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        pin<8>(s);
        wg::fence();
#pragma unroll
        for (int ks = 0; ks < (NKS ? NKS : MAXK); ks++) {
            if (!NKS && ks >= t.nks) break;
            wg_n64<false>(s, qf[ks], wg::desc_kmajor(kb, BN, ks));
            wg_n64<false>(s, qf[ks], wg::desc_kmajor(kb + (uint32_t)plane_k, BN, ks));
        }
        wg::commit();
        wg::wait<0>();
        pin<8>(s);
        softmax_tile<DVP>(s, o, m_run, l_run, tile * BN, slot0, a.scale_log2);
        /* O += P V */
        uint32_t pf[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) p_frag(s, kk, pf[kk]);
        pin<DVP / 8>(o);
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            wg_pv<DVP>(o, pf[kk], wg::desc_sw128(vb + (uint32_t)kk * 16u * 128u, (uint32_t)WG_SLAB, 1024u));
            wg_pv<DVP>(o, pf[kk], wg::desc_sw128(vb + (uint32_t)PLANE_V + (uint32_t)kk * 16u * 128u, (uint32_t)WG_SLAB, 1024u));
        }
        wg::commit();
        wg::wait<0>();
        pin<DVP / 8>(o);
        __syncthreads(); /* this stage is loaded again two tiles on */
    }
    state_out<DVP>(a, t, o, m_run, l_run);
#else
    (void)a; /* never launched: plain_setup's probe finds no wgmma in such a pass */
#endif
}
#undef KDT_PW_D4

template <int DVP, int ST>
size_t attn_smem(int dqk_p) {
    return kdt_ap_plain_smem(dqk_p, DVP, ST);
}

template <int DVP, int ST>
kdt_status launch_attn(const kdt_plain_args *a, cudaStream_t s) {
    const dim3 grid((unsigned)((a->R + BM - 1) / BM), (unsigned)a->H);
    if constexpr (DVP == 64 || DVP == 128) {
        if (a->wg) {
            const size_t smem = kdt_ap_plain_wg_smem(a->dqk_p, DVP);
            if (a->dqk_p == 12 * 16) plain_attn_wg<DVP, 12><<<grid, THREADS, smem, s>>>(*a);
            else plain_attn_wg<DVP, 0><<<grid, THREADS, smem, s>>>(*a);
            const cudaError_t e = cudaGetLastError();
            return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "plain attention (wgmma): %s", cudaGetErrorString(e));
        }
    }
    plain_attn<DVP, ST><<<grid, THREADS, attn_smem<DVP, ST>(a->dqk_p), s>>>(*a);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "plain attention: %s", cudaGetErrorString(e));
}

template <int DVP>
kdt_status launch_attn_st(const kdt_plain_args *a, cudaStream_t s) {
    return a->stages == 2 ? launch_attn<DVP, 2>(a, s) : launch_attn<DVP, 1>(a, s);
}

/* the instance's shared-memory limit, raised once per runner (outside any graph capture) */
template <int DVP>
kdt_status init_attn(int32_t dqk_p, int32_t stages, int32_t wg) {
    const size_t smem = stages == 2 ? attn_smem<DVP, 2>(dqk_p) : attn_smem<DVP, 1>(dqk_p);
    cudaError_t e = stages == 2
                        ? cudaFuncSetAttribute(plain_attn<DVP, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)
                        : cudaFuncSetAttribute(plain_attn<DVP, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "plain attention: shared memory %zu B: %s", smem, cudaGetErrorString(e));
    if constexpr (DVP == 64 || DVP == 128) {
        if (wg) {
            const size_t wsm = kdt_ap_plain_wg_smem(dqk_p, DVP);
            e = dqk_p == 12 * 16
                    ? cudaFuncSetAttribute(plain_attn_wg<DVP, 12>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wsm)
                    : cudaFuncSetAttribute(plain_attn_wg<DVP, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)wsm);
            if (e != cudaSuccess)
                return kdt_fail(KDT_ERR_CUDA, "plain attention (wgmma): shared memory %zu B: %s", wsm, cudaGetErrorString(e));
        }
    }
    return KDT_OK;
}

} // namespace

extern "C" {

kdt_status kdt_plain_init(int32_t dqk_p, int32_t dv_p, int32_t stages, int32_t wg) {
    switch (dv_p) {
    case 16: return init_attn<16>(dqk_p, stages, 0);
    case 32: return init_attn<32>(dqk_p, stages, 0);
    case 64: return init_attn<64>(dqk_p, stages, wg);
    case 128: return init_attn<128>(dqk_p, stages, wg);
    case 256: return init_attn<256>(dqk_p, stages, 0);
    default: return kdt_fail(KDT_ERR_INTERNAL, "plain attention: d_v padded to %d", dv_p);
    }
}

/* Whether the current device runs plain_attn_wg's wgmma code: a synchronous probe (never during a
 * capture), once per device and process, since every runner with the plain form asks (the default
 * since session 49) */
int kdt_plain_wg_device(void) {
    static int known[16]; /* 0: not asked yet, 1: yes, 2: no (a race only repeats the probe) */
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 16) {
        cudaGetLastError();
        return 0;
    }
    if (known[dev]) return known[dev] == 1;
    int *d = nullptr, h = 0;
    cudaError_t e = cudaMalloc(&d, sizeof(int));
    if (e == cudaSuccess) {
        plain_wg_probe<<<1, 1>>>(d);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess) e = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
    if (d) cudaFree(d);
    cudaGetLastError(); /* a failure here only means no wgmma */
    known[dev] = e == cudaSuccess && h == 1 ? 1 : 2;
    return known[dev] == 1;
}

kdt_status kdt_plain_launch(const kdt_plain_args *a, const kdt_gmat *uk_t, const kdt_gmat *uv, cudaStream_t s) {
    if (a->T < 1 || a->R < 1 || a->first + a->R != a->T || a->cap < BN || a->cap % BN || a->k0 < 0 ||
        a->k0 % a->cap || a->kn < 1 || a->kn > a->cap || a->k0 + a->kn > a->T ||
        (a->T > a->cap && (!a->state || a->state_ld < a->dv_p + 5)))
        return kdt_fail(KDT_ERR_INTERNAL, "plain attention: T %d, cap %d, keys %d + %d, rows %d from slot %d%s", a->T,
                        a->cap, a->k0, a->kn, a->R, a->first, a->T > a->cap && !a->state ? ", no state buffer" : "");
    if (uk_t->tiled || uv->tiled) /* plain_up reads them row-major (gpu_upload.c never tiles them) */
        return kdt_fail(KDT_ERR_INTERNAL, "plain attention: W_UK / W_UV in the tiled layout");
    const unsigned kt = (unsigned)((a->kn + BM - 1) / BM);
    plain_up<true><<<dim3(kt, (unsigned)a->H, (unsigned)((a->dn + BN - 1) / BN)), THREADS, 0, s>>>(
        *a, uk_t->w, uk_t->ld, uk_t->batch_stride, a->dn, a->dn, a->k_hi, a->k_lo, a->dqk_p);
    plain_up<false><<<dim3(kt, (unsigned)a->H, (unsigned)((a->dv_p + BN - 1) / BN)), THREADS, 0, s>>>(
        *a, uv->w, uv->ld, uv->batch_stride, a->dv, a->dv_p, a->v_hi, a->v_lo, a->dv_p);
    plain_kpe<<<(unsigned)a->kn, 128, 0, s>>>(*a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "plain up-projection: %s", cudaGetErrorString(e));
    switch (a->dv_p) {
    case 16: return launch_attn_st<16>(a, s);
    case 32: return launch_attn_st<32>(a, s);
    case 64: return launch_attn_st<64>(a, s);
    case 128: return launch_attn_st<128>(a, s);
    case 256: return launch_attn_st<256>(a, s);
    default: return kdt_fail(KDT_ERR_INTERNAL, "plain attention: d_v padded to %d", a->dv_p);
    }
}

} // extern "C"
