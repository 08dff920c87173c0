/* dflash_gpu.cu - the drafter's own kernels (see dflash_gpu_kernels.h): block embedding, the
 * q/k/v finish (per-head RMSNorm + rotate-half RoPE), the non-causal block attention, SwiGLU, the
 * fc finish and the context-append finish, and the accepted-path item list.
 *
 * Every reduction has a fixed order that depends on the row alone: per-head norms are a lane
 * partial (elements lane, lane + 32, ...) then an xor shuffle tree; row norms the same per warp,
 * then the 8 warp sums in warp order; the attention walks keys in 32-key tiles in key order. So a
 * stream's results never depend on the other streams of the batch. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "dflash_gpu_kernels.h"
#include "model/cuda/gpu_mma.cuh"

namespace {

constexpr int RB = 256;  /* threads of the row kernels */
constexpr int KT = 32;   /* keys per attention tile */

using kg::bf16_to_f32;
using kg::warp_sum;

__device__ __forceinline__ int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float block_sum(float v, float *red) { return kg::block_sum<RB>(v, red); }

__device__ __forceinline__ float split_sum(const float *part, int splits, int64_t split_stride, int64_t i) {
    float v = part[i];
    for (int s = 1; s < splits; s++) v += part[s * split_stride + i];
    return v;
}

/* One warp: buf[hd] (this warp's, filled by its lanes) -> RMSNorm * w -> rotate-half RoPE with the
 * table row cs -> dst[hd]. */
__device__ void norm_rope_head(float *buf, const float *w, float eps, int hd, const float *cs, float *dst) {
    const int lane = threadIdx.x & 31, half = hd / 2;
    float ss = 0.0f;
    for (int e = lane; e < hd; e += 32) ss += buf[e] * buf[e];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
    for (int e = lane; e < hd; e += 32) buf[e] = w[e] * (buf[e] * inv);
    __syncwarp();
    for (int i = lane; i < half; i += 32) {
        const float a = buf[i], b = buf[i + half], c = cs[2 * i], s = cs[2 * i + 1];
        dst[i] = a * c - b * s;
        dst[i + half] = b * c + a * s;
    }
    __syncwarp();
}

__global__ void __launch_bounds__(RB) k_df_embed(const kdt_df_embed_args a) {
    const int rows = a.n_streams * a.T;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        a.counts[0] = rows;
        a.counts[1] = a.n_streams * (a.T - 1);
    }
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const int s = r / a.T, t = r % a.T;
        const int tok = clampi(t == 0 ? a.anchor[s] : a.mask_id, 0, a.V - 1);
        const uint16_t *e = a.embed + (int64_t)tok * a.ld;
        for (int d = threadIdx.x; d < a.D; d += RB) a.x[(int64_t)r * a.D + d] = bf16_to_f32(e[d]);
    }
}

__global__ void __launch_bounds__(RB) k_df_qkv_post(const kdt_df_qkv_args a) {
    extern __shared__ float hbuf[]; /* [RB / 32][hd] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = a.hd, kvd = a.KV * hd, qd = a.H * hd;
    float *buf = hbuf + warp * hd;
    for (int r = blockIdx.x; r < a.rows; r += gridDim.x) {
        const int s = r / a.T, t = r % a.T;
        const int pos = min(clampi(a.prefix[s], 0, a.max_len) + t, a.rope_rows - 1);
        const float *cs = a.rope_cs + (int64_t)pos * hd;
        const int64_t base = (int64_t)r * a.ldp;
        for (int i = threadIdx.x; i < kvd; i += RB)
            a.vb[(int64_t)r * kvd + i] = split_sum(a.part, a.splits, a.split_stride, base + kvd + i);
        for (int h = warp; h < a.KV + a.H; h += RB / 32) {
            const bool isk = h < a.KV;
            const int64_t col = isk ? (int64_t)h * hd : 2 * (int64_t)kvd + (int64_t)(h - a.KV) * hd;
            for (int e = lane; e < hd; e += 32) buf[e] = split_sum(a.part, a.splits, a.split_stride, base + col + e);
            __syncwarp();
            float *dst = isk ? a.kb + (int64_t)r * kvd + (int64_t)h * hd : a.q + (int64_t)r * qd + (int64_t)(h - a.KV) * hd;
            norm_rope_head(buf, isk ? a.k_norm : a.q_norm, a.eps, hd, cs, dst);
        }
    }
}

__global__ void k_df_attn(const kdt_df_attn_args a) {
    extern __shared__ float sm[];
    const int hd = a.hd, PC = a.pairs_per_cta, kvd = a.KV * hd, qd = a.H * hd;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float *qs = sm;                      /* [PC][hd] */
    float *os = qs + PC * hd;            /* [PC][hd] */
    float *ms = os + PC * hd;            /* [PC] running max */
    float *ls = ms + PC;                 /* [PC] running sum */
    float *ks = ls + PC;                 /* [KT][hd + 1] (odd stride: lane j reads row j conflict-free) */
    float *vs = ks + KT * (hd + 1);      /* [KT][hd] */
    float *ps = vs + KT * hd;            /* [warps][KT] probabilities of the tile */

    const int chunk = blockIdx.x % a.n_chunks, g = (blockIdx.x / a.n_chunks) % a.KV;
    const int s = blockIdx.x / (a.n_chunks * a.KV);
    if (s >= a.n_streams) return;
    const int group = a.H / a.KV, n_pairs = a.T * group, p0 = chunk * PC;
    const int np = min(PC, n_pairs - p0);
    if (np <= 0) return;
    int slot = a.slot[s];
    if (slot < 0 || slot >= a.max_streams) slot = 0; /* trusted, but never read out of bounds */
    const int P = clampi(a.prefix[s], 0, a.max_len), n_keys = P + a.T;

    for (int i = threadIdx.x; i < np * hd; i += blockDim.x) {
        const int pl = i / hd, e = i % hd, p = p0 + pl, t = p / group, hq = g * group + p % group;
        qs[i] = a.q[(int64_t)(s * a.T + t) * qd + (int64_t)hq * hd + e];
        os[i] = 0.0f;
    }
    for (int i = threadIdx.x; i < np; i += blockDim.x) {
        ms[i] = -INFINITY;
        ls[i] = 0.0f;
    }
    const int64_t cbase = (int64_t)slot * a.max_len * kvd + (int64_t)g * hd;
    const int64_t bbase = (int64_t)s * a.T * kvd + (int64_t)g * hd;
    for (int k0 = 0; k0 < n_keys; k0 += KT) {
        const int tn = min(KT, n_keys - k0);
        __syncthreads();
        for (int i = threadIdx.x; i < tn * hd; i += blockDim.x) {
            const int j = i / hd, e = i % hd, key = k0 + j;
            if (key < P) {
                const int64_t off = cbase + (int64_t)key * kvd + e;
                ks[j * (hd + 1) + e] = a.ck[off];
                vs[j * hd + e] = a.cv[off];
            } else {
                const int64_t off = bbase + (int64_t)(key - P) * kvd + e;
                ks[j * (hd + 1) + e] = a.kb[off];
                vs[j * hd + e] = a.vb[off];
            }
        }
        __syncthreads();
        for (int pl = warp; pl < np; pl += nw) {
            const float *qp = qs + pl * hd;
            float sc = -INFINITY;
            if (lane < tn) {
                /* four independent partial sums: the dot is a latency chain otherwise (hd is even;
                 * a fixed order, so results stay batch-invariant) */
                const float *kp = ks + lane * (hd + 1);
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
                int e = 0;
                for (; e + 4 <= hd; e += 4) {
                    d0 += qp[e] * kp[e];
                    d1 += qp[e + 1] * kp[e + 1];
                    d2 += qp[e + 2] * kp[e + 2];
                    d3 += qp[e + 3] * kp[e + 3];
                }
                for (; e < hd; e++) d0 += qp[e] * kp[e];
                sc = ((d0 + d1) + (d2 + d3)) * a.scale;
            }
            const float m_old = ms[pl], m_new = fmaxf(m_old, warp_max(sc));
            const float p = lane < tn ? expf(sc - m_new) : 0.0f;
            const float corr = expf(m_old - m_new); /* 0 on the first tile (m_old = -inf) */
            const float tsum = warp_sum(p);
            ps[warp * KT + lane] = p;
            __syncwarp();
            float *op = os + pl * hd;
            const float *pw = ps + warp * KT;
            for (int e = lane; e < hd; e += 32) {
                float a0 = 0.0f, a1 = 0.0f; /* two chains over the tile's keys */
                int j = 0;
                for (; j + 2 <= tn; j += 2) {
                    a0 += pw[j] * vs[j * hd + e];
                    a1 += pw[j + 1] * vs[(j + 1) * hd + e];
                }
                if (j < tn) a0 += pw[j] * vs[j * hd + e];
                op[e] = op[e] * corr + (a0 + a1);
            }
            __syncwarp(); /* every lane has read ms[pl] and ps */
            if (lane == 0) {
                ms[pl] = m_new;
                ls[pl] = ls[pl] * corr + tsum;
            }
            __syncwarp();
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < np * hd; i += blockDim.x) {
        const int pl = i / hd, e = i % hd, p = p0 + pl, t = p / group, hq = g * group + p % group;
        a.out[(int64_t)(s * a.T + t) * qd + (int64_t)hq * hd + e] = os[i] / ls[pl];
    }
}

__global__ void __launch_bounds__(RB) k_df_swiglu(const float *part, int splits, int64_t split_stride, int rows,
                                                   int I, float *act) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x)
        for (int i = threadIdx.x; i < I; i += RB) {
            const int64_t base = (int64_t)r * 2 * I;
            const float gt = split_sum(part, splits, split_stride, base + i);
            const float up = split_sum(part, splits, split_stride, base + I + i);
            act[(int64_t)r * I + i] = gt / (1.0f + expf(-gt)) * up;
        }
}

__global__ void __launch_bounds__(RB) k_df_sum_norm(const float *part, int splits, int64_t split_stride,
                                                     const int32_t *n_dev, int max_n, const float *w, float eps,
                                                     int D, float *out) {
    __shared__ float red[RB / 32];
    const int n = clampi(*n_dev, 0, max_n);
    for (int m = blockIdx.x; m < n; m += gridDim.x) {
        float *o = out + (int64_t)m * D;
        float ss = 0.0f;
        for (int d = threadIdx.x; d < D; d += RB) {
            const float v = split_sum(part, splits, split_stride, (int64_t)m * D + d);
            o[d] = v;
            ss += v * v;
        }
        ss = block_sum(ss, red);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int d = threadIdx.x; d < D; d += RB) o[d] = w[d] * (o[d] * inv);
    }
}

__global__ void __launch_bounds__(RB) k_df_ctx_post(const kdt_df_ctx_args a) {
    extern __shared__ float hbuf[]; /* [RB / 32][hd] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd = a.hd, kvd = a.KV * hd, l = blockIdx.y;
    const int n = clampi(*a.n_dev, 0, a.max_n);
    float *buf = hbuf + warp * hd;
    for (int i = blockIdx.x; i < n; i += gridDim.x) {
        const int slot = a.slot[i], pos = a.pos[i];
        if (slot < 0 || slot >= a.max_streams || pos < 0 || pos >= a.max_len || pos >= a.rope_rows) continue;
        const int64_t src = (int64_t)l * a.layer_stride + (int64_t)i * 2 * kvd;
        const int64_t dst = (((int64_t)l * a.max_streams + slot) * a.max_len + pos) * kvd;
        for (int c = threadIdx.x; c < kvd; c += RB) a.cv[dst + c] = split_sum(a.part, a.splits, a.split_stride, src + kvd + c);
        const float *cs = a.rope_cs + (int64_t)pos * hd;
        for (int h = warp; h < a.KV; h += RB / 32) {
            for (int e = lane; e < hd; e += 32)
                buf[e] = split_sum(a.part, a.splits, a.split_stride, src + (int64_t)h * hd + e);
            __syncwarp();
            norm_rope_head(buf, a.k_norm + (int64_t)l * hd, a.eps, hd, cs, a.ck + dst + (int64_t)h * hd);
        }
    }
}

__global__ void k_df_accept_items(int n_streams, const int32_t *slot, const int32_t *prefix, const int32_t *tau,
                                  const int32_t *acc, int tree_stride, int32_t *n_items, int32_t *i_slot,
                                  int32_t *i_pos, int32_t *i_row) {
    extern __shared__ int32_t off[]; /* [n_streams] first item, [n_streams] clamped tau */
    int32_t *tc = off + n_streams;
    if (threadIdx.x == 0) {
        int run = 0;
        for (int s = 0; s < n_streams; s++) {
            const int t = clampi(tau[s], 0, KDT_MAX_PATH);
            off[s] = run;
            tc[s] = t;
            run += t;
        }
        *n_items = run;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_streams * KDT_MAX_PATH; i += blockDim.x) {
        const int s = i / KDT_MAX_PATH, k = i % KDT_MAX_PATH;
        if (k >= tc[s]) continue;
        const int it = off[s] + k;
        i_slot[it] = slot[s];
        i_pos[it] = prefix[s] + k;
        i_row[it] = s * tree_stride + clampi(acc[s * KDT_MAX_PATH + k], 0, tree_stride - 1);
    }
}

unsigned grid_rows(int rows) { return (unsigned)(rows < 1 ? 1 : (rows > 4096 ? 4096 : rows)); }

kdt_status launched(const char *what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "GPU drafter: %s: launch failed: %s", what, cudaGetErrorString(e));
    return KDT_OK;
}

} // namespace

extern "C" kdt_status kdt_df_embed(const kdt_df_embed_args *a, cudaStream_t s) {
    k_df_embed<<<grid_rows(a->n_streams * a->T), RB, 0, s>>>(*a);
    return launched("block embedding");
}

extern "C" kdt_status kdt_df_qkv_post(const kdt_df_qkv_args *a, cudaStream_t s) {
    k_df_qkv_post<<<grid_rows(a->rows), RB, (size_t)(RB / 32) * a->hd * sizeof(float), s>>>(*a);
    return launched("q/k/v finish");
}

extern "C" size_t kdt_df_attn_smem(int32_t pairs_per_cta, int32_t hd, int32_t warps) {
    return sizeof(float) * ((size_t)2 * pairs_per_cta * hd + 2 * (size_t)pairs_per_cta + (size_t)KT * (hd + 1) +
                            (size_t)KT * hd + (size_t)warps * KT);
}

extern "C" kdt_status kdt_df_attn_init(size_t smem) {
    const cudaError_t e = cudaFuncSetAttribute(k_df_attn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "GPU drafter: attention: %zu bytes of shared memory: %s", smem,
                        cudaGetErrorString(e));
    return KDT_OK;
}

extern "C" kdt_status kdt_df_attn(const kdt_df_attn_args *a, cudaStream_t s) {
    const unsigned grid = (unsigned)(a->n_streams * a->KV * a->n_chunks);
    k_df_attn<<<grid, 32 * a->warps, kdt_df_attn_smem(a->pairs_per_cta, a->hd, a->warps), s>>>(*a);
    return launched("attention");
}

extern "C" kdt_status kdt_df_swiglu(const float *part, int32_t splits, int64_t split_stride, int32_t rows, int32_t I,
                                    float *act, cudaStream_t s) {
    k_df_swiglu<<<grid_rows(rows), RB, 0, s>>>(part, splits, split_stride, rows, I, act);
    return launched("SwiGLU");
}

extern "C" kdt_status kdt_df_sum_norm(const float *part, int32_t splits, int64_t split_stride, const int32_t *n_dev,
                                      int32_t max_n, const float *w, float eps, int32_t D, float *out,
                                      cudaStream_t s) {
    k_df_sum_norm<<<grid_rows(max_n), RB, 0, s>>>(part, splits, split_stride, n_dev, max_n, w, eps, D, out);
    return launched("fc finish");
}

extern "C" kdt_status kdt_df_ctx_post(const kdt_df_ctx_args *a, cudaStream_t s) {
    const dim3 grid(grid_rows(a->max_n), (unsigned)a->n_layers);
    k_df_ctx_post<<<grid, RB, (size_t)(RB / 32) * a->hd * sizeof(float), s>>>(*a);
    return launched("context K/V finish");
}

extern "C" kdt_status kdt_df_accept_items(int32_t n_streams, const int32_t *slot, const int32_t *prefix,
                                          const int32_t *tau, const int32_t *acc_nodes, int32_t tree_stride,
                                          int32_t *n_items, int32_t *i_slot, int32_t *i_pos, int32_t *i_row,
                                          cudaStream_t s) {
    k_df_accept_items<<<1, RB, (size_t)2 * n_streams * sizeof(int32_t), s>>>(n_streams, slot, prefix, tau, acc_nodes,
                                                                            tree_stride, n_items, i_slot, i_pos, i_row);
    return launched("accepted items");
}
