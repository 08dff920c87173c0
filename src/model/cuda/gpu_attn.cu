/* gpu_attn.cu - the GPU forward's MLA attention in absorbed form over the paged bf16 latent
 * cache: for every row (query token) and head, softmax(scale * [q_lat | q_pe] . [c_kv | k_pe])
 * over the row's visible keys, weighted sum of c_kv -> o_lat [R][H][d_c] (fp32).
 *
 * Batch invariance is the design constraint, so nothing here depends on the batch: a row's
 * visible keys are taken in list order (committed slots 0..n_prefix-1, then its tree ancestors'
 * slots ascending: the same list a decode of that path sees), cut into splits of
 * kdt_attn_split_keys(n_keys) keys and tiles of 32 keys *by list index*, so the tile boundaries,
 * the online-softmax rescaling points and every reduction order are functions of the row alone.
 *
 * attn_partial: one item = (row, split, group of HG heads). Q (HG heads x d_q, bf16) stays in
 * shared memory; 32-key tiles of the cache rows are gathered through the block table with
 * cp.async (double-buffered). Per tile: S = Q K^T on tensor cores (k16 steps ascending), an
 * online softmax in fp32 (8 threads per head, 4 keys each, fixed shuffle tree), P as bf16, then
 * O += P V (V = the first d_c columns of the same tile, via ldmatrix.trans). The item writes its
 * unnormalised O, running max (log2 domain) and sum. HG = 16 (4 warps, fits 99 KB of shared
 * memory) or 64 (8 warps, a quarter of the KV re-reads when there are many heads); the per-head
 * arithmetic is identical, so the choice never changes a bit and is made per launch.
 * attn_combine: per row and head, merges the splits in order. One CTA per (row, chunk of the
 * row's H x d_c outputs) (kdt_g_chunk_cols, so a decode row gets a CTA per half head, not one
 * for all); the chunk's heads' max, sum and split weights are computed once per item and every
 * output element is one fma chain over its splits in order: the same operations, whatever the
 * chunk.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu_internal.h"
#include "gpu_mma.cuh"

namespace {
using namespace kg;

constexpr int TILE = KDT_G_ATT_TILE;
constexpr int SS = TILE + 1;   /* floats per score row in shared memory */
constexpr int PS = TILE + 8;   /* bf16 per probability row (80 B: conflict-free fragment loads) */
constexpr int TPR = 8;         /* softmax threads per head row, TILE / TPR keys each */

__host__ __device__ inline int split_keys(int n_keys) {
    if (n_keys <= KDT_G_ATT_SHORT_KEYS) return KDT_G_ATT_SPLIT_SHORT;
    if (n_keys <= 64 * KDT_G_ATT_SPLIT) return KDT_G_ATT_SPLIT;
    const int per = (n_keys + KDT_G_ATT_MAX_SPLITS - 1) / KDT_G_ATT_MAX_SPLITS;
    return (per + TILE - 1) / TILE * TILE;
}
__host__ __device__ inline int n_splits(int n_keys) {
    const int c = split_keys(n_keys);
    return n_keys < 1 ? 1 : (n_keys + c - 1) / c;
}
/* shared-memory row stride of Q / K tiles: d_q rounded up to 64, plus 8 (16 bytes): the fragment
 * loads of 8 consecutive rows then hit 8 different bank groups */
__host__ __device__ inline int qs_stride(int dq) { return (dq + 63) / 64 * 64 + 8; }

template <int HG>
struct AttCfg {
    static constexpr int WARPS = HG == 16 ? 4 : 8;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int MT = HG / 16;
    static constexpr int TPK = THREADS / TILE; /* loader threads per key */
    static_assert(HG == 16 || HG == 64, "heads per item");
};

__host__ __device__ inline size_t att_smem(int hg, int dq) {
    const size_t qs = (size_t)qs_stride(dq);
    return (size_t)hg * qs * 2 + 2 * (size_t)TILE * qs * 2 + (size_t)hg * SS * 4 + (size_t)hg * PS * 2 +
           3 * (size_t)hg * 4;
}

/* Bit index of the j-th set bit (0-based) of the mask words, -1 if there are fewer. */
__device__ __forceinline__ int nth_set_bit(const uint64_t *m, int words, int j) {
    for (int w = 0; w < words; w++) {
        uint64_t v = m[w];
        const int c = __popcll(v);
        if (j < c) {
            for (int q = 0; q < j; q++) v &= v - 1;
            return w * 64 + __ffsll((long long)v) - 1;
        }
        j -= c;
    }
    return -1;
}

/* Issues the copies of list keys [kb, kb + TILE) of `row` into the tile; keys >= k_end (or with a
 * broken slot) are zero-filled, so P = 0 never meets garbage. */
template <int HG>
__device__ __forceinline__ void load_kv_tile(const kdt_attn_args &a, const kdt_grow &row, uint16_t *tile,
                                             int qs, int kb, int k_end) {
    constexpr int TPK = AttCfg<HG>::TPK;
    const int key = threadIdx.x / TPK, sub = threadIdx.x % TPK;
    const int k = kb + key;
    const uint16_t *src = a.kv;
    bool ok = k < k_end;
    if (ok) {
        int slot = k;
        if (k >= row.n_prefix) {
            const int bit = row.mask_off >= 0 ? nth_set_bit(a.masks + row.mask_off, row.mask_words, k - row.n_prefix) : -1;
            slot = row.n_prefix + bit;
            ok = bit >= 0;
        }
        if (ok) {
            int page = a.block_table[(int64_t)row.stream * a.max_pages + slot / a.page_size];
            if (page < 0 || page >= a.n_pages) page = 0; /* never out of bounds; host validated */
            src = a.kv + ((int64_t)page * a.page_size + slot % a.page_size) * a.row_stride;
        }
    }
    const int chunks = a.dq / 8;
    for (int ch = sub; ch < chunks; ch += TPK)
        cp_async16(tile + key * qs + ch * 8, ok ? src + ch * 8 : a.kv, ok ? 16 : 0);
}

template <int HG, int NT>
__global__ void __launch_bounds__(AttCfg<HG>::THREADS, 1) attn_partial(const kdt_attn_args a) {
    using C = AttCfg<HG>;
    constexpr int MT = C::MT, WARPS = C::WARPS, THREADS = C::THREADS;
    extern __shared__ __align__(16) unsigned char smem[];
    const int qs = qs_stride(a.dq), dq16 = (a.dq + 15) / 16;
    uint16_t *Qs = reinterpret_cast<uint16_t *>(smem);                  /* [HG][qs] */
    uint16_t *Ks = Qs + (size_t)HG * qs;                                 /* [2][TILE][qs] */
    float *Ss = reinterpret_cast<float *>(Ks + 2 * (size_t)TILE * qs);   /* [HG][SS] */
    uint16_t *Ps = reinterpret_cast<uint16_t *>(Ss + HG * SS);           /* [HG][PS] */
    float *row_m = reinterpret_cast<float *>(Ps + HG * PS), *row_l = row_m + HG, *row_alpha = row_l + HG;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n_hg = (a.H + HG - 1) / HG;
    const int n_rows = a.hdr->n_rows;
    const long long total = (long long)a.hdr->total_splits * n_hg;

    /* pad columns [d_q, qs) of both K stages are never written by the loads: zero them once */
    for (int i = tid; i < 2 * TILE * (qs - a.dq); i += THREADS) {
        const int r = i / (qs - a.dq), c = a.dq + i % (qs - a.dq);
        Ks[r * qs + c] = 0;
    }

    for (long long item = blockIdx.x; item < total; item += gridDim.x) {
        const int gs = (int)(item / n_hg), hg = (int)(item % n_hg);
        int lo = 0, hi = n_rows - 1; /* the row holding split gs: last row with split_off <= gs */
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (a.rows[mid].split_off <= gs) lo = mid;
            else hi = mid - 1;
        }
        const int r = lo;
        const kdt_grow row = a.rows[r];
        const int chunk = split_keys(row.n_keys);
        const int k_begin = (gs - row.split_off) * chunk;
        const int k_end = min(k_begin + chunk, row.n_keys);
        const int n_tiles = (k_end - k_begin + TILE - 1) / TILE;

        __syncthreads(); /* the previous item is done with Q, P and the row state */
        for (int i = tid; i < HG * qs; i += THREADS) {
            const int h = i / qs, d = i % qs, head = hg * HG + h;
            const float v = (head < a.H && d < a.dq) ? a.q_abs[((int64_t)r * a.H + head) * a.dq + d] : 0.0f;
            Qs[i] = f32_to_bf16(v);
        }
        for (int i = tid; i < HG; i += THREADS) row_m[i] = -INFINITY, row_l[i] = 0.0f;
        load_kv_tile<HG>(a, row, Ks, qs, k_begin, k_end);
        cp_async_commit();

        float acc[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.0f;

        for (int ti = 0; ti < n_tiles; ti++) {
            const int kb = k_begin + ti * TILE;
            const uint16_t *Kc = Ks + (size_t)(ti & 1) * TILE * qs;
            cp_async_wait<0>();
            __syncthreads(); /* tile ti landed; everyone is past tile ti-1 */
            if (ti + 1 < n_tiles) load_kv_tile<HG>(a, row, Ks + (size_t)((ti + 1) & 1) * TILE * qs, qs, kb + TILE, k_end);
            cp_async_commit();

            /* S = Q K^T: (m-tile, 8-key tile) pairs spread over the warps */
#pragma unroll
            for (int id = warp; id < MT * (TILE / 8); id += WARPS) {
                const int mt = id / (TILE / 8), nt = id % (TILE / 8);
                float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const uint16_t *qa = Qs + (mt * 16 + g) * qs + 2 * t;
                const uint16_t *kp = Kc + (nt * 8 + g) * qs + 2 * t;
                for (int kk = 0; kk < dq16; kk++) {
                    uint32_t af[4];
                    af[0] = *reinterpret_cast<const uint32_t *>(qa + kk * 16);
                    af[1] = *reinterpret_cast<const uint32_t *>(qa + 8 * qs + kk * 16);
                    af[2] = *reinterpret_cast<const uint32_t *>(qa + kk * 16 + 8);
                    af[3] = *reinterpret_cast<const uint32_t *>(qa + 8 * qs + kk * 16 + 8);
                    mma16816(s, af, *reinterpret_cast<const uint32_t *>(kp + kk * 16),
                             *reinterpret_cast<const uint32_t *>(kp + kk * 16 + 8));
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = nt * 8 + 2 * t + (e & 1), hr = mt * 16 + g + (e >> 1) * 8;
                    Ss[hr * SS + key] = kb + key < k_end ? s[e] * a.scale_log2 : -INFINITY;
                }
            }
            __syncthreads();

            /* online softmax: 8 threads per head row, 4 keys each, fixed reduction tree */
#pragma unroll
            for (int rr = tid; rr < HG * TPR; rr += THREADS) {
                const int hr = rr / TPR, part = rr % TPR;
                float v[TILE / TPR];
                float mx = -INFINITY;
#pragma unroll
                for (int i = 0; i < TILE / TPR; i++) {
                    v[i] = Ss[hr * SS + part * (TILE / TPR) + i];
                    mx = fmaxf(mx, v[i]);
                }
#pragma unroll
                for (int o = TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                const float m_old = row_m[hr];
                const float m_new = fmaxf(m_old, mx);
                const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
                float sum = 0.0f;
#pragma unroll
                for (int i = 0; i < TILE / TPR; i++) {
                    const float p = exp2f(v[i] - m_ref);
                    sum += p;
                    Ps[hr * PS + part * (TILE / TPR) + i] = f32_to_bf16(p);
                }
#pragma unroll
                for (int o = TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
                __syncwarp();
                if (part == 0) {
                    const float alpha = exp2f(m_old - m_ref);
                    row_alpha[hr] = alpha;
                    row_l[hr] = row_l[hr] * alpha + sum;
                    row_m[hr] = m_new;
                }
            }
            __syncthreads();

            /* O = alpha O + P V over this warp's columns [cb, cb + 8 NT) */
            const int cb = warp * NT * 8;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const float a0 = row_alpha[mt * 16 + g], a1 = row_alpha[mt * 16 + g + 8];
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    acc[mt][j][0] *= a0;
                    acc[mt][j][1] *= a0;
                    acc[mt][j][2] *= a1;
                    acc[mt][j][3] *= a1;
                }
            }
#pragma unroll
            for (int kk = 0; kk < TILE / 16; kk++) {
                uint32_t pf[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const uint16_t *pp = Ps + (mt * 16 + g) * PS + kk * 16 + 2 * t;
                    pf[mt][0] = *reinterpret_cast<const uint32_t *>(pp);
                    pf[mt][1] = *reinterpret_cast<const uint32_t *>(pp + 8 * PS);
                    pf[mt][2] = *reinterpret_cast<const uint32_t *>(pp + 8);
                    pf[mt][3] = *reinterpret_cast<const uint32_t *>(pp + 8 * PS + 8);
                }
#pragma unroll
                for (int jj = 0; jj < NT / 2; jj++) {
                    uint32_t bv[4];
                    ldsm_x4_trans(bv, Kc + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * qs + cb + jj * 16 +
                                          (lane >> 4) * 8);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma16816(acc[mt][2 * jj], pf[mt], bv[0], bv[1]);
                        mma16816(acc[mt][2 * jj + 1], pf[mt], bv[2], bv[3]);
                    }
                }
            }
        }

        /* partial results of this split */
        const int cb = warp * NT * 8;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int h2 = 0; h2 < 2; h2++) {
                    const int head = hg * HG + mt * 16 + g + 8 * h2, col = cb + j * 8 + 2 * t;
                    if (head < a.H) {
                        float *dst = a.att_o + ((int64_t)gs * a.H + head) * a.dc;
                        if (col < a.dc) dst[col] = acc[mt][j][2 * h2];
                        if (col + 1 < a.dc) dst[col + 1] = acc[mt][j][2 * h2 + 1];
                    }
                }
        for (int i = tid; i < HG; i += THREADS) {
            const int head = hg * HG + i;
            if (head < a.H) {
                a.att_m[(int64_t)gs * a.H + head] = row_m[i];
                a.att_l[(int64_t)gs * a.H + head] = row_l[i];
            }
        }
    }
}

constexpr int CT = 256;                      /* attn_combine threads */
constexpr int CH = 16;                       /* most heads one combine item spans */
constexpr int CS = KDT_G_ATT_MAX_SPLITS;     /* n_splits never exceeds it */

/* o_lat[r][h] = sum_j O_j 2^(m_j - M) / sum_j l_j 2^(m_j - M), splits j in order, M = max_j m_j.
 * Item = (row, outputs [lo, hi) of the row's H x d_c, spanning heads h_lo..). Per head: M by
 * fmaxf in split order, L by an fma chain in split order, w_j = exp2f(m_j - M); per element:
 * o = fma(O_j, w_j, o) in split order, then o / L: what `o += O_j * exp2f(m_j - M)` and
 * `L += l_j * exp2f(m_j - M)` compile to, so the chunking never changes a bit. */
__global__ void __launch_bounds__(CT) attn_combine(const kdt_attn_args a, int cols) {
    __shared__ float sw[CH][CS + 1], sl[CH][CS + 1]; /* m_j, then w_j; l_j (+1: a thread per head) */
    __shared__ float sM[CH], sL[CH];
    const int n_rows = a.hdr->n_rows, width = a.H * a.dc, per_row = (width + cols - 1) / cols;
    const int64_t stride = (int64_t)a.H * a.dc; /* one split's outputs */
    for (long long it = blockIdx.x; it < (long long)n_rows * per_row; it += gridDim.x) {
        const int r = (int)(it / per_row), lo = (int)(it % per_row) * cols, hi = min(lo + cols, width);
        const int h_lo = lo / a.dc, nh = (hi - 1) / a.dc - h_lo + 1; /* <= CH (launcher) */
        const kdt_grow row = a.rows[r];
        const int ns = min(n_splits(row.n_keys), CS), base = row.split_off;
        __syncthreads(); /* the previous item is done with the weights */
        for (int i = threadIdx.x; i < nh * ns; i += CT) {
            const int j = i / nh, h = i % nh;
            const int64_t sj = (int64_t)(base + j) * a.H + h_lo + h;
            sw[h][j] = a.att_m[sj];
            sl[h][j] = a.att_l[sj];
        }
        __syncthreads();
        if (threadIdx.x < nh) {
            const int h = threadIdx.x;
            float M = -INFINITY;
            for (int j = 0; j < ns; j++) M = fmaxf(M, sw[h][j]);
            float L = 0.0f;
            for (int j = 0; j < ns; j++) L = __fmaf_rn(sl[h][j], exp2f(sw[h][j] - M), L);
            sM[h] = M;
            sL[h] = L;
        }
        __syncthreads(); /* every m_j is read: overwrite them with the weights */
        for (int i = threadIdx.x; i < nh * ns; i += CT) {
            const int j = i / nh, h = i % nh;
            sw[h][j] = exp2f(sw[h][j] - sM[h]);
        }
        __syncthreads();
        for (int i = lo + threadIdx.x; i < hi; i += CT) {
            const int h = i / a.dc - h_lo;
            const float *src = a.att_o + (int64_t)base * stride + i;
            float o = 0.0f;
            for (int j0 = 0; j0 < ns; j0 += 16) { /* loads 16 splits at a time, fmas in order */
                float t[16];
#pragma unroll
                for (int u = 0; u < 16; u++) t[u] = j0 + u < ns ? src[(j0 + u) * stride] : 0.0f;
#pragma unroll
                for (int u = 0; u < 16; u++)
                    if (j0 + u < ns) o = __fmaf_rn(t[u], sw[h][j0 + u], o);
            }
            a.o_lat[(int64_t)r * width + i] = o / sL[h];
        }
    }
}

template <int HG, int NT>
cudaError_t set_attr(int dq) {
    return cudaFuncSetAttribute(attn_partial<HG, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)att_smem(HG, dq));
}

int pick_nt(int hg, int dc) {
    const int warps = hg == 16 ? 4 : 8;
    int nt = (dc + warps * 8 - 1) / (warps * 8);
    nt += nt & 1;
    if (nt < 2) nt = 2;
    return nt;
}


/* Verify rows from a tree that lives on the device (kdt_gpu_stage_verify_device): one CTA numbers
 * the nodes of every stream compactly (stream-major), fills each row exactly as the host staging
 * does, and scans the attention split counts for split_off. The host already wrote n_updates. */
constexpr int STAGE_THREADS = 1024;
__global__ void __launch_bounds__(STAGE_THREADS) k_stage_tree(kdt_gstage_hdr *hdr, kdt_grow *rows, int32_t *head,
                                                              uint64_t *masks, const int32_t *streams, int S, int N,
                                                              int W, const int32_t *n_nodes, const int32_t *token,
                                                              const int32_t *position, const uint64_t *anc_mask) {
    __shared__ int row_off[65];
    __shared__ int scan[STAGE_THREADS];
    __shared__ int carry;
    const int t = threadIdx.x;
    if (t == 0) {
        int acc = 0;
        for (int s = 0; s < S; s++) {
            row_off[s] = acc;
            const int n = n_nodes[s], bound = streams[3 * s + 2];
            acc += n < 1 ? 1 : (n > bound ? bound : n); /* never past the slots the host reserved */
        }
        row_off[S] = acc;
        carry = 0;
    }
    __syncthreads();
    const int R = row_off[S];
    for (int base = 0; base < R; base += STAGE_THREADS) {
        const int k = base + t;
        int ns = 0, s = 0;
        if (k < R) {
            while (s + 1 < S && row_off[s + 1] <= k) s++;
            const int i = k - row_off[s];
            const int64_t idx = (int64_t)s * N + i;
            const int P = streams[3 * s + 1];
            int bits = 0;
            for (int q = 0; q < W; q++) {
                const uint64_t m = anc_mask[idx * W + q];
                masks[(int64_t)k * W + q] = m;
                bits += __popcll(m);
            }
            kdt_grow w;
            w.stream = streams[3 * s];
            w.token = token[idx];
            w.pos = position[idx];
            w.slot = P + i;
            w.n_prefix = P;
            w.n_keys = P + bits;
            w.mask_off = k * W;
            w.mask_words = W;
            w.split_off = 0;
            w.out_index = w.tap_index = (int32_t)idx;
            w.pad = 0;
            rows[k] = w;
            head[k] = k;
            ns = n_splits(w.n_keys);
        }
        scan[t] = ns;
        __syncthreads();
        for (int off = 1; off < STAGE_THREADS; off <<= 1) { /* inclusive Hillis-Steele scan */
            const int v = t >= off ? scan[t - off] : 0;
            __syncthreads();
            scan[t] += v;
            __syncthreads();
        }
        if (k < R) rows[k].split_off = carry + scan[t] - ns;
        __syncthreads();
        if (t == STAGE_THREADS - 1) carry += scan[t];
        __syncthreads();
    }
    if (t == 0) {
        hdr->n_rows = R;
        hdr->n_head = R;
        hdr->total_splits = carry;
    }
}
} // namespace

extern "C" int32_t kdt_attn_split_keys(int32_t n_keys) { return split_keys(n_keys); }
extern "C" int32_t kdt_attn_n_splits(int32_t n_keys) { return n_splits(n_keys); }

/* 0 when (heads_per_item, d_c, d_q) has no kernel instance or its columns overrun the tile. */
extern "C" size_t kdt_attn_smem_bytes(int32_t heads_per_item, int32_t dc, int32_t dq) {
    if ((heads_per_item != 16 && heads_per_item != 64) || dq % 8 || dc < 1 || dc > dq) return 0;
    const int nt = pick_nt(heads_per_item, dc);
    const int max_nt = heads_per_item == 16 ? 16 : 8;
    const int cols = (heads_per_item == 16 ? 4 : 8) * nt * 8;
    if (nt > max_nt || cols > qs_stride(dq)) return 0;
    return att_smem(heads_per_item, dq);
}

/* Raises the shared-memory limit of the instances this model uses (before any capture). */
extern "C" kdt_status kdt_attn_init(int32_t heads_per_item, int32_t dc, int32_t dq) {
    const int nt = pick_nt(heads_per_item, dc);
    cudaError_t e = cudaErrorInvalidValue;
    if (heads_per_item == 16) {
        switch (nt) {
        case 2: e = set_attr<16, 2>(dq); break;
        case 4: e = set_attr<16, 4>(dq); break;
        case 6: e = set_attr<16, 6>(dq); break;
        case 8: e = set_attr<16, 8>(dq); break;
        case 10: e = set_attr<16, 10>(dq); break;
        case 12: e = set_attr<16, 12>(dq); break;
        case 14: e = set_attr<16, 14>(dq); break;
        case 16: e = set_attr<16, 16>(dq); break;
        }
    } else {
        switch (nt) {
        case 2: e = set_attr<64, 2>(dq); break;
        case 4: e = set_attr<64, 4>(dq); break;
        case 6: e = set_attr<64, 6>(dq); break;
        case 8: e = set_attr<64, 8>(dq); break;
        }
    }
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "GPU attention (%d heads per item, d_c %d, d_q %d): %s", heads_per_item, dc,
                        dq, cudaGetErrorString(e));
    return KDT_OK;
}

extern "C" kdt_status kdt_attn_launch(const kdt_attn_args *a, cudaStream_t s) {
    const int hg = a->heads_per_item;
    const int nt = pick_nt(hg, a->dc);
    const size_t smem = att_smem(hg, a->dq);
    const dim3 grid((unsigned)(a->grid > 0 ? a->grid : 1));
    if (hg == 16) {
        switch (nt) {
        case 2: attn_partial<16, 2><<<grid, 128, smem, s>>>(*a); break;
        case 4: attn_partial<16, 4><<<grid, 128, smem, s>>>(*a); break;
        case 6: attn_partial<16, 6><<<grid, 128, smem, s>>>(*a); break;
        case 8: attn_partial<16, 8><<<grid, 128, smem, s>>>(*a); break;
        case 10: attn_partial<16, 10><<<grid, 128, smem, s>>>(*a); break;
        case 12: attn_partial<16, 12><<<grid, 128, smem, s>>>(*a); break;
        case 14: attn_partial<16, 14><<<grid, 128, smem, s>>>(*a); break;
        case 16: attn_partial<16, 16><<<grid, 128, smem, s>>>(*a); break;
        default: return kdt_fail(KDT_ERR_INTERNAL, "GPU attention: d_c %d", a->dc);
        }
    } else {
        switch (nt) {
        case 2: attn_partial<64, 2><<<grid, 256, smem, s>>>(*a); break;
        case 4: attn_partial<64, 4><<<grid, 256, smem, s>>>(*a); break;
        case 6: attn_partial<64, 6><<<grid, 256, smem, s>>>(*a); break;
        case 8: attn_partial<64, 8><<<grid, 256, smem, s>>>(*a); break;
        default: return kdt_fail(KDT_ERR_INTERNAL, "GPU attention: d_c %d", a->dc);
        }
    }
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) {
        /* rows x chunks of the H d_c outputs; a chunk of whole heads spans at most CH of them, a
         * shorter one at most two */
        int cols = kdt_g_chunk_cols(a->max_rows, a->H * a->dc, CT);
        if (cols >= a->dc) cols = (cols / a->dc < CH ? cols / a->dc : CH) * a->dc;
        const int64_t items = (int64_t)(a->max_rows > 1 ? a->max_rows : 1) * ((a->H * a->dc + cols - 1) / cols);
        attn_combine<<<(unsigned)(items < 4096 ? items : 4096), CT, 0, s>>>(*a, cols);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "GPU attention: launch failed: %s", cudaGetErrorString(e));
    return KDT_OK;
}

extern "C" kdt_status kdt_op_stage_tree(kdt_gstage_hdr *hdr, kdt_grow *rows, int32_t *head, uint64_t *masks,
                                        const int32_t *streams, int32_t S, int32_t N, int32_t W,
                                        const int32_t *n_nodes, const int32_t *token, const int32_t *position,
                                        const uint64_t *anc_mask, cudaStream_t s) {
    if (S < 1 || S > 64) return kdt_fail(KDT_ERR_INVALID_ARG, "GPU tree staging: %d streams (1..64)", S);
    k_stage_tree<<<1, STAGE_THREADS, 0, s>>>(hdr, rows, head, masks, streams, S, N, W, n_nodes, token, position,
                                             anc_mask);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "GPU tree staging: %s", cudaGetErrorString(e));
}
