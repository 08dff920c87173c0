/* test_wgmma_sm90.cu - the Hopper wgmma pieces (src/kernels/cuda/wgmma_sm90.cuh) on the two products
 * of MLA attention, one warpgroup, one tile, against the CPU:
 *   1. S = Q K^T: Q [64][576], KV [64][576] in 128B-swizzled slabs, 36 steps of m64n64k16 with
 *      both operands K-major from shared memory (the verify_attn score tile).
 *   2. O = P V: P = bf16(S * scale) taken straight from the S accumulator as the register A
 *      operand (columns 0-255) and, written to a swizzled slab, as the shared-memory A operand
 *      (columns 256-511: how verify_attn's second warpgroup reads it), V = the first 512 columns
 *      of the same KV slabs read N-major, 2 x 4 steps of m64n256k16 (the verify_attn output tile).
 * The CPU reference is fp64 over the same bf16 inputs (for O: over the P the GPU formed from its
 * own S, so only the product is compared). If O fails with the layout wgmma_sm90.cuh documents,
 * the test also tries the N-major operand with the LBO / SBO roles swapped and says which works.
 *   3. The same k16 steps as wgmma m64n32k16 chains (Q [64][576] and 32 keys from slabs, 4 chains of
 *      9 steps from the same accumulators) and as mma.sync m16n8k16 chains: the fp32 results must
 *      agree bitwise, on normal inputs, on inputs whose exponents spread over 2^-8..2^8, from zero
 *      and from random accumulators. The GPU model's attention (src/model/cuda/gpu_attn.cu) forms
 *      its 64-head scores with the first and its 16-head ones with the second, and its batch
 *      invariance (decode == tree verify, bitwise) rests on this.
 *   4. O = alpha O + P V as the model's 64-head attention forms it for a 32-key tile: P [64][32] bf16
 *      row-major in shared memory (ldmatrix into the register A operand), V the first 512 columns
 *      of 32 key rows in 32-row slabs read N-major, 2 k16 steps of wgmma m64n256k16 per 256
 *      columns, from random accumulators; against the same steps as mma.sync m16n8k16 (fragments
 *      from global): bitwise, as check 3, on normal and spread inputs.
 * On a GPU that is not sm_90 it prints "skip" and exits 0; on an sm_90 GPU without sm_90a code in
 * the binary it fails. Built by CMake as gpu_test_wgmma_sm90 (label gpu). */
#include "gpu_mma.cuh"
#include "gpu_test_util.h"
#include "wgmma_sm90.cuh"

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

namespace {

constexpr int ROWS = 64, KEYS = 64, DQK = 576, DV = 512, SLABS = DQK / 64;
constexpr uint32_t SLAB_BYTES = ROWS * 128; /* 64 rows x 128 B (KEYS == ROWS here) */
constexpr size_t SMEM = 2 * (size_t)SLABS * SLAB_BYTES + 1024; /* Q, KV, alignment slack */

#if KDT_HAS_WGMMA
/* Copies a [64][576] bf16 matrix into 9 swizzled slabs at dst (1024-aligned). */
__device__ __forceinline__ void to_slabs(const uint16_t *src, unsigned char *dst) {
    for (int i = threadIdx.x; i < ROWS * (DQK / 8); i += blockDim.x) {
        const int r = i / (DQK / 8), c = i % (DQK / 8); /* 16-byte chunk c of row r */
        const int slab = c / 8, col = (c % 8) * 8;
        const uint4 v = *reinterpret_cast<const uint4 *>(src + (size_t)r * DQK + c * 8);
        *reinterpret_cast<uint4 *>(dst + slab * SLAB_BYTES + wg::sw128_offset(r, col)) = v;
    }
}
#endif

__global__ void __launch_bounds__(128, 1)
    qk_pv_kernel(const uint16_t *q, const uint16_t *kv, float *s_out, float *o_out, float p_scale,
                 uint32_t lbo, uint32_t sbo, int *ran) {
    if (threadIdx.x == 0) *ran = KDT_HAS_WGMMA;
#if KDT_HAS_WGMMA
    extern __shared__ unsigned char smem_raw[];
    unsigned char *smem = reinterpret_cast<unsigned char *>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *sq = smem, *skv = smem + SLABS * SLAB_BYTES;
    to_slabs(q, sq);
    to_slabs(kv, skv);
    wg::fence_proxy_async();
    __syncthreads();
    const uint32_t qb = (uint32_t)__cvta_generic_to_shared(sq), kb = (uint32_t)__cvta_generic_to_shared(skv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    float s[32];
    for (int i = 0; i < 32; i++) s[i] = 0.f;
    wg::fence();
    for (int kk = 0; kk < DQK / 16; kk++)
        wg::mma_m64n64k16_ss(s, wg::desc_kmajor(qb, ROWS, kk), wg::desc_kmajor(kb, KEYS, kk), kk > 0);
    wg::commit();
    wg::wait<0>();
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < 2; h++) {
            const int row = 16 * warp + g + 8 * h, col = 8 * j + 2 * t;
            s_out[row * KEYS + col] = s[4 * j + 2 * h];
            s_out[row * KEYS + col + 1] = s[4 * j + 2 * h + 1];
        }

    float p[32];
    for (int i = 0; i < 32; i++) p[i] = s[i] * p_scale;
    uint32_t a[KEYS / 16][4];
    for (int kk = 0; kk < KEYS / 16; kk++) wg::s_to_a_frag(p, kk, a[kk]);
    /* P also as a K-major swizzled slab (over Q's first slab, no longer needed), for the shared-A form */
    for (int kk = 0; kk < KEYS / 16; kk++)
        for (int i = 0; i < 4; i++) {
            const int row = 16 * warp + g + 8 * (i & 1), col = 16 * kk + 8 * (i >> 1) + 2 * t;
            *reinterpret_cast<uint32_t *>(sq + wg::sw128_offset(row, col)) = a[kk][i];
        }
    wg::fence_proxy_async();
    __syncthreads();
    for (int half = 0; half < 2; half++) {
        float o[128];
        for (int i = 0; i < 128; i++) o[i] = 0.f;
        wg::fence();
        for (int kk = 0; kk < KEYS / 16; kk++) {
            const uint64_t dv = wg::desc_v(kb, KEYS, 4 * half, kk, lbo, sbo);
            if (half == 0) wg::mma_m64n256k16_rs_tb(o, a[kk], dv, kk > 0); /* P from registers */
            else wg::mma_m64n256k16_ss_tb(o, wg::desc_kmajor(qb, ROWS, kk), dv, kk > 0); /* P from the slab */
        }
        wg::commit();
        wg::wait<0>();
        for (int j = 0; j < 32; j++)
            for (int h = 0; h < 2; h++) {
                const int row = 16 * warp + g + 8 * h, col = 256 * half + 8 * j + 2 * t;
                o_out[row * DV + col] = o[4 * j + 2 * h];
                o_out[row * DV + col + 1] = o[4 * j + 2 * h + 1];
            }
    }
#else
    (void)q, (void)kv, (void)s_out, (void)o_out, (void)p_scale, (void)lbo, (void)sbo;
#endif
}

uint16_t f32_to_bf16(float f) { /* round to nearest even, as __float2bfloat16_rn (finite inputs) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
double bf16_to_f64(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
double normal(uint64_t *st) { /* Box-Muller on a xorshift */
    auto u01 = [&]() {
        *st ^= *st << 13, *st ^= *st >> 7, *st ^= *st << 17;
        return ((*st >> 11) + 0.5) / 9007199254740992.0;
    };
    const double a = u01(), b = u01();
    return sqrt(-2.0 * log(a)) * cos(6.283185307179586 * b);
}

uint64_t splitmix(uint64_t *st) { /* the next raw draw of the same xorshift */
    *st ^= *st << 13, *st ^= *st >> 7, *st ^= *st << 17;
    return *st;
}

double rel_err(const std::vector<float> &got, const std::vector<double> &ref) {
    double num = 0, den = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        const double d = (double)got[i] - ref[i];
        num += d * d, den += ref[i] * ref[i];
        if (!isfinite(got[i])) return INFINITY;
    }
    return sqrt(num / (den > 0 ? den : 1));
}

struct Dev {
    uint16_t *q, *kv;
    float *s, *o;
    int *ran;
};

/* Runs the kernel with the N-major operand's (lbo, sbo); returns the relative errors of S and O. */
void run(const Dev &d, const std::vector<uint16_t> &q, const std::vector<uint16_t> &kv, float p_scale,
         uint32_t lbo, uint32_t sbo, int *ran, double *err_s, double *err_o) {
    CUDA_OK(cudaMemset(d.s, 0xff, sizeof(float) * ROWS * KEYS)); /* NaN: unwritten output shows */
    CUDA_OK(cudaMemset(d.o, 0xff, sizeof(float) * ROWS * DV));
    qk_pv_kernel<<<1, 128, SMEM>>>(d.q, d.kv, d.s, d.o, p_scale, lbo, sbo, d.ran);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(ran, d.ran, sizeof(int), cudaMemcpyDeviceToHost));
    std::vector<float> s(ROWS * KEYS), o(ROWS * DV);
    CUDA_OK(cudaMemcpy(s.data(), d.s, sizeof(float) * s.size(), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o.data(), d.o, sizeof(float) * o.size(), cudaMemcpyDeviceToHost));
    std::vector<double> s_ref(ROWS * KEYS), o_ref(ROWS * DV, 0.0);
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < KEYS; j++) {
            double acc = 0;
            for (int k = 0; k < DQK; k++) acc += bf16_to_f64(q[i * DQK + k]) * bf16_to_f64(kv[j * DQK + k]);
            s_ref[i * KEYS + j] = acc;
        }
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < KEYS; j++) {
            /* P as the device forms it: fp32 product of its own S, rounded to bf16 */
            const double pij = isfinite(s[i * KEYS + j]) ? bf16_to_f64(f32_to_bf16(s[i * KEYS + j] * p_scale)) : NAN;
            for (int c = 0; c < DV; c++) o_ref[i * DV + c] += pij * bf16_to_f64(kv[j * DQK + c]);
        }
    *err_s = rel_err(s, s_ref);
    *err_o = rel_err(o, o_ref);
    for (int half = 0; half < 2; half++) { /* which A form failed, if one did */
        std::vector<float> oh;
        std::vector<double> rh;
        for (int i = 0; i < ROWS; i++)
            for (int c = 256 * half; c < 256 * half + 256; c++) oh.push_back(o[i * DV + c]), rh.push_back(o_ref[i * DV + c]);
        const double e = rel_err(oh, rh);
        if (!(e <= 1e-5)) printf("# O columns %d-%d (P from %s): relative error %.3g\n", 256 * half, 256 * half + 255,
                                 half ? "the shared slab" : "registers", e);
    }
}

/* 3: 4 chains x 9 k16 steps over [64][576] x [32][576], from c0 [4][64][32]; out [4][64][32]. */
constexpr int CK = 32, CHAINS = 4, CSTEPS = DQK / 16 / CHAINS;
constexpr size_t CSMEM = (size_t)SLABS * (ROWS + CK) * 128 + 1024;
__global__ void __launch_bounds__(128, 1)
    chains_kernel(const uint16_t *q, const uint16_t *k, const float *c0, float *out_wg, float *out_mma) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    auto at = [&](int ch, int r, int c) { return ((size_t)ch * ROWS + r) * CK + c; };
#if KDT_HAS_WGMMA
    extern __shared__ unsigned char smem_raw[];
    unsigned char *sq = reinterpret_cast<unsigned char *>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    unsigned char *sk = sq + SLABS * ROWS * 128;
    for (int i = threadIdx.x; i < (ROWS + CK) * (DQK / 8); i += blockDim.x) {
        const int r = i / (DQK / 8), c = i % (DQK / 8), kr = r - ROWS;
        const uint16_t *src = r < ROWS ? q + (size_t)r * DQK : k + (size_t)kr * DQK;
        unsigned char *dst = r < ROWS ? sq + (c / 8) * ROWS * 128 + wg::sw128_offset(r, (c % 8) * 8)
                                      : sk + (c / 8) * CK * 128 + wg::sw128_offset(kr, (c % 8) * 8);
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src + c * 8);
    }
    wg::fence_proxy_async();
    __syncthreads();
    const uint32_t qa = (uint32_t)__cvta_generic_to_shared(sq), ka = (uint32_t)__cvta_generic_to_shared(sk);
    for (int ch = 0; ch < CHAINS; ch += 2) { /* two chains in flight, as the attention runs them */
        float d0[16], d1[16];
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int r = 16 * warp + g + 8 * (e >> 1), c = 8 * n + 2 * t + (e & 1);
                d0[4 * n + e] = c0[at(ch, r, c)];
                d1[4 * n + e] = c0[at(ch + 1, r, c)];
            }
        wg::fence_operands16(d0);
        wg::fence_operands16(d1);
        wg::fence();
        for (int i = 0; i < CSTEPS; i++) {
            const int k0 = ch * CSTEPS + i, k1 = (ch + 1) * CSTEPS + i;
            wg::mma_m64n32k16_ss(d0, wg::desc_kmajor(qa, ROWS, k0), wg::desc_kmajor(ka, CK, k0));
            wg::mma_m64n32k16_ss(d1, wg::desc_kmajor(qa, ROWS, k1), wg::desc_kmajor(ka, CK, k1));
        }
        wg::commit();
        wg::wait<0>();
        wg::fence_operands16(d0);
        wg::fence_operands16(d1);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int r = 16 * warp + g + 8 * (e >> 1), c = 8 * n + 2 * t + (e & 1);
                out_wg[at(ch, r, c)] = d0[4 * n + e];
                out_wg[at(ch + 1, r, c)] = d1[4 * n + e];
            }
    }
#endif
    /* mma.sync: warp w takes rows 16w.., fragments straight from global (PTX ISA layouts) */
    auto pk = [](uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); };
    const int r0 = 16 * warp;
    for (int ch = 0; ch < CHAINS; ch++)
        for (int n = 0; n < 4; n++) {
            float c[4];
            for (int e = 0; e < 4; e++) c[e] = c0[at(ch, r0 + g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1))];
            for (int i = 0; i < CSTEPS; i++) {
                const int kb = (ch * CSTEPS + i) * 16;
                const uint16_t *qa0 = q + (size_t)(r0 + g) * DQK + kb, *qa1 = q + (size_t)(r0 + g + 8) * DQK + kb;
                const uint16_t *kr = k + (size_t)(8 * n + g) * DQK + kb;
                const uint32_t a[4] = {pk(qa0[2 * t], qa0[2 * t + 1]), pk(qa1[2 * t], qa1[2 * t + 1]),
                                       pk(qa0[2 * t + 8], qa0[2 * t + 9]), pk(qa1[2 * t + 8], qa1[2 * t + 9])};
                kg::mma16816(c, a, pk(kr[2 * t], kr[2 * t + 1]), pk(kr[2 * t + 8], kr[2 * t + 9]));
            }
            for (int e = 0; e < 4; e++) out_mma[at(ch, r0 + g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1))] = c[e];
        }
}

/* Runs test 3 over `trials` fresh draws; returns the number of elements whose bits differ. */
long chain_bits(int trials, uint64_t *st, long *compared) {
    std::vector<uint16_t> q(ROWS * DQK), k(CK * DQK);
    std::vector<float> c0((size_t)CHAINS * ROWS * CK), ow(c0.size()), om(c0.size());
    uint16_t *dq, *dk;
    float *dc, *dw, *dm;
    CUDA_OK(cudaMalloc(&dq, 2 * q.size()));
    CUDA_OK(cudaMalloc(&dk, 2 * k.size()));
    CUDA_OK(cudaMalloc(&dc, 4 * c0.size()));
    CUDA_OK(cudaMalloc(&dw, 4 * c0.size()));
    CUDA_OK(cudaMalloc(&dm, 4 * c0.size()));
    long differ = 0;
    for (int trial = 0; trial < trials; trial++) {
        const int mode = trial % 4; /* 0: normal, zero start; 1: + random start; 2: Q spread; 3: both spread */
        auto spread = [&](bool on) { return on ? ldexp(1.0, (int)(splitmix(st) % 17) - 8) : 1.0; };
        for (auto &x : q) x = f32_to_bf16((float)(normal(st) * spread(mode >= 2)));
        for (auto &x : k) x = f32_to_bf16((float)(normal(st) * spread(mode == 3)));
        for (auto &x : c0) x = mode == 0 ? 0.0f : (float)(normal(st) * ldexp(1.0, (int)(splitmix(st) % 9) - 4));
        CUDA_OK(cudaMemcpy(dq, q.data(), 2 * q.size(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dk, k.data(), 2 * k.size(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dc, c0.data(), 4 * c0.size(), cudaMemcpyHostToDevice));
        chains_kernel<<<1, 128, CSMEM>>>(dq, dk, dc, dw, dm);
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(ow.data(), dw, 4 * ow.size(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(om.data(), dm, 4 * om.size(), cudaMemcpyDeviceToHost));
        long d = 0;
        for (size_t i = 0; i < ow.size(); i++) d += memcmp(&ow[i], &om[i], 4) != 0;
        if (d) printf("# chains, draw %d (mode %d): %ld of %zu results differ, e.g. wgmma %.9g mma.sync %.9g\n", trial,
                      mode, d, ow.size(), ow[0], om[0]);
        differ += d;
        *compared += (long)ow.size();
    }
    cudaFree(dq), cudaFree(dk), cudaFree(dc), cudaFree(dw), cudaFree(dm);
    return differ;
}

/* 4: O [64][512] from c0, P [64][32] (bf16), V = the first 512 columns of KV [32][576]. */
constexpr int PK = 32, PPS = PK + 8; /* keys; P's shared row stride (bf16), as the attention's PS */
constexpr size_t PSMEM = (size_t)SLABS * PK * 128 + 1024 + (size_t)ROWS * PPS * 2;
__global__ void __launch_bounds__(128, 1)
    pv_kernel(const uint16_t *p, const uint16_t *kv, const float *c0, float *out_wg, float *out_mma) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#if KDT_HAS_WGMMA
    extern __shared__ unsigned char smem_raw[];
    unsigned char *sv = reinterpret_cast<unsigned char *>(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    uint16_t *sp = reinterpret_cast<uint16_t *>(sv + SLABS * PK * 128);
    for (int i = threadIdx.x; i < PK * (DQK / 8); i += blockDim.x) {
        const int r = i / (DQK / 8), c = i % (DQK / 8);
        *reinterpret_cast<uint4 *>(sv + (c / 8) * PK * 128 + wg::sw128_offset(r, (c % 8) * 8)) =
            *reinterpret_cast<const uint4 *>(kv + (size_t)r * DQK + c * 8);
    }
    for (int i = threadIdx.x; i < ROWS * PK; i += blockDim.x) sp[(i / PK) * PPS + i % PK] = p[i];
    wg::fence_proxy_async();
    __syncthreads();
    const uint32_t vb = (uint32_t)__cvta_generic_to_shared(sv);
    uint32_t pf[PK / 16][4];
    for (int kk = 0; kk < PK / 16; kk++) kg::ldsm_x4(pf[kk], sp + (16 * warp + (lane & 15)) * PPS + kk * 16 + (lane >> 4) * 8);
    for (int half = 0; half < 2; half++) {
        float d[128];
        for (int j = 0; j < 32; j++)
            for (int e = 0; e < 4; e++)
                d[4 * j + e] = c0[(16 * warp + g + 8 * (e >> 1)) * DV + 256 * half + 8 * j + 2 * t + (e & 1)];
        wg::fence();
        for (int kk = 0; kk < PK / 16; kk++)
            wg::mma_m64n256k16_rs_tb(d, pf[kk], wg::desc_v(vb, PK, 4 * half, kk, PK * 128, 1024), 1);
        wg::commit();
        wg::wait<0>();
        for (int j = 0; j < 32; j++)
            for (int e = 0; e < 4; e++)
                out_wg[(16 * warp + g + 8 * (e >> 1)) * DV + 256 * half + 8 * j + 2 * t + (e & 1)] = d[4 * j + e];
    }
#endif
    auto pk = [](uint16_t lo, uint16_t hi) { return (uint32_t)lo | ((uint32_t)hi << 16); };
    const int r0 = 16 * warp;
    for (int n = 0; n < DV / 8; n++) {
        float c[4];
        for (int e = 0; e < 4; e++) c[e] = c0[(r0 + g + 8 * (e >> 1)) * DV + 8 * n + 2 * t + (e & 1)];
        for (int kk = 0; kk < PK / 16; kk++) {
            const uint16_t *pa0 = p + (r0 + g) * PK + 16 * kk, *pa1 = p + (r0 + g + 8) * PK + 16 * kk;
            const uint32_t a[4] = {pk(pa0[2 * t], pa0[2 * t + 1]), pk(pa1[2 * t], pa1[2 * t + 1]),
                                   pk(pa0[2 * t + 8], pa0[2 * t + 9]), pk(pa1[2 * t + 8], pa1[2 * t + 9])};
            auto vat = [&](int k) { return kv[(size_t)(16 * kk + k) * DQK + 8 * n + g]; };
            kg::mma16816(c, a, pk(vat(2 * t), vat(2 * t + 1)), pk(vat(2 * t + 8), vat(2 * t + 9)));
        }
        for (int e = 0; e < 4; e++) out_mma[(r0 + g + 8 * (e >> 1)) * DV + 8 * n + 2 * t + (e & 1)] = c[e];
    }
}

/* Runs test 4 over `trials` fresh draws; returns the number of outputs whose bits differ. */
long pv_bits(int trials, uint64_t *st, long *compared) {
    std::vector<uint16_t> p(ROWS * PK), kv(PK * DQK);
    std::vector<float> c0((size_t)ROWS * DV), ow(c0.size()), om(c0.size());
    uint16_t *dp, *dkv;
    float *dc, *dw, *dm;
    CUDA_OK(cudaMalloc(&dp, 2 * p.size()));
    CUDA_OK(cudaMalloc(&dkv, 2 * kv.size()));
    CUDA_OK(cudaMalloc(&dc, 4 * c0.size()));
    CUDA_OK(cudaMalloc(&dw, 4 * c0.size()));
    CUDA_OK(cudaMalloc(&dm, 4 * c0.size()));
    long differ = 0;
    for (int trial = 0; trial < trials; trial++) {
        const int mode = trial % 3; /* 0: P in [0, 1] (a softmax's), normal V; 1: V spread; 2: P spread too */
        auto spread = [&](bool on) { return on ? ldexp(1.0, (int)(splitmix(st) % 17) - 8) : 1.0; };
        for (auto &x : p) x = f32_to_bf16((float)(fabs(normal(st)) / 3.0 * spread(mode == 2)));
        for (auto &x : kv) x = f32_to_bf16((float)(normal(st) * spread(mode >= 1)));
        for (auto &x : c0) x = (float)(normal(st) * ldexp(1.0, (int)(splitmix(st) % 9) - 2));
        CUDA_OK(cudaMemcpy(dp, p.data(), 2 * p.size(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dkv, kv.data(), 2 * kv.size(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dc, c0.data(), 4 * c0.size(), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(dw, 0xff, 4 * c0.size()));
        pv_kernel<<<1, 128, PSMEM>>>(dp, dkv, dc, dw, dm);
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(ow.data(), dw, 4 * ow.size(), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(om.data(), dm, 4 * om.size(), cudaMemcpyDeviceToHost));
        long d = 0;
        size_t first = ow.size();
        for (size_t i = 0; i < ow.size(); i++)
            if (memcmp(&ow[i], &om[i], 4)) d++, first = first < i ? first : i;
        if (d) printf("# P V, draw %d (mode %d): %ld of %zu outputs differ, e.g. [%zu] wgmma %.9g mma.sync %.9g\n", trial,
                      mode, d, ow.size(), first, ow[first], om[first]);
        differ += d;
        *compared += (long)ow.size();
    }
    cudaFree(dp), cudaFree(dkv), cudaFree(dc), cudaFree(dw), cudaFree(dm);
    return differ;
}

} // namespace

int main() {
    cudaDeviceProp prop;
    if (!gpu_test_have_device("test_wgmma_sm90")) return 1;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    if (prop.major != 9) {
        printf("skip - wgmma: %s is sm_%d%d; wgmma needs sm_90a\n", prop.name, prop.major, prop.minor);
        return 0;
    }
    CUDA_OK(cudaFuncSetAttribute(qk_pv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM));
    CUDA_OK(cudaFuncSetAttribute(chains_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)CSMEM));
    CUDA_OK(cudaFuncSetAttribute(pv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)PSMEM));
    std::vector<uint16_t> q(ROWS * DQK), kv(KEYS * DQK);
    uint64_t st = 0x9e3779b97f4a7c15ull;
    for (auto &x : q) x = f32_to_bf16((float)normal(&st));
    for (auto &x : kv) x = f32_to_bf16((float)normal(&st));
    Dev d;
    CUDA_OK(cudaMalloc(&d.q, 2 * q.size()));
    CUDA_OK(cudaMalloc(&d.kv, 2 * kv.size()));
    CUDA_OK(cudaMalloc(&d.s, sizeof(float) * ROWS * KEYS));
    CUDA_OK(cudaMalloc(&d.o, sizeof(float) * ROWS * DV));
    CUDA_OK(cudaMalloc(&d.ran, sizeof(int)));
    CUDA_OK(cudaMemcpy(d.q, q.data(), 2 * q.size(), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d.kv, kv.data(), 2 * kv.size(), cudaMemcpyHostToDevice));
    const float p_scale = 1.0f / 24.0f; /* S ~ N(0, 576): P ~ N(0, 1) */
    const double tol = 1e-5;            /* fp32 accumulation of exact bf16 products */
    int ran = 0, fails = 0;
    double es = 0, eo = 0;
    const uint32_t lbo = KEYS * 128, sbo = 1024; /* as wgmma_sm90.cuh documents */
    run(d, q, kv, p_scale, lbo, sbo, &ran, &es, &eo);
    if (!ran) {
        printf("FAIL - wgmma: the binary has no sm_90a code (build with -arch=sm_90a / KDT_CUDA_ARCHS=90a)\n");
        return 1;
    }
    printf("%s - wgmma S = Q K^T (m64n64k16, K-major slabs): relative error %.3g\n", es <= tol ? "ok" : "FAIL", es);
    printf("%s - wgmma O = P V (m64n256k16, V N-major: LBO %u, SBO %u; columns 0-255 with P in registers, "
           "256-511 with P from a shared slab): relative error %.3g\n",
           eo <= tol ? "ok" : "FAIL", lbo, sbo, eo);
    fails += !(es <= tol) + !(eo <= tol);
    if (!(eo <= tol)) {
        double es2 = 0, eo2 = 0;
        run(d, q, kv, p_scale, sbo, lbo, &ran, &es2, &eo2);
        printf("# with LBO and SBO swapped (LBO %u, SBO %u): relative error %.3g%s\n", sbo, lbo, eo2,
               eo2 <= tol ? ": the roles in wgmma_sm90.cuh (desc_v callers) are the other way round" : "");
    }
    cudaFree(d.q), cudaFree(d.kv), cudaFree(d.s), cudaFree(d.o), cudaFree(d.ran);
    long compared = 0;
    const long differ = chain_bits(getenv("KDT_TEST_QUICK") ? 40 : 400, &st, &compared);
    printf("%s - wgmma m64n32k16 chains == mma.sync m16n8k16 chains, bitwise: %ld of %ld results differ\n",
           differ == 0 && compared > 0 ? "ok" : "FAIL", differ, compared);
    fails += !(differ == 0 && compared > 0);
    long pv_compared = 0;
    const long pv_differ = pv_bits(getenv("KDT_TEST_QUICK") ? 30 : 300, &st, &pv_compared);
    printf("%s - wgmma m64n256k16 P V (P via ldmatrix, V N-major 32-row slabs) == mma.sync, bitwise: %ld of %ld "
           "outputs differ\n", pv_differ == 0 && pv_compared > 0 ? "ok" : "FAIL", pv_differ, pv_compared);
    fails += !(pv_differ == 0 && pv_compared > 0);
    printf("%d passed, %d failed\n", 4 - fails, fails);
    return fails ? 1 : 0;
}
