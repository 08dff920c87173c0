/* gpu_mma.cuh - the warp-level instructions the GPU forward's GEMM and attention kernels use:
 * 16-byte cp.async with zero fill, ldmatrix.trans, the bf16 tensor-core product mma.sync
 * m16n8k16 with fp32 accumulation, and the fp32 -> bf16 (hi, lo) split that lets an fp32
 * activation meet a bf16 weight with ~16 mantissa bits. All exist on sm_80, sm_90 and sm_120.
 * Also the fixed-order warp and block sums the row kernels (gpu_ops.cu, the drafter's
 * dflash_gpu.cu) share: their order depends on the row alone, never on the batch.
 *
 * Fragment layout of m16n8k16 (PTX ISA), g = lane / 4, t = lane % 4:
 *   A 16x16 row-major: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
 *   B 16x8 (k x n):    b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
 *   C 16x8 fp32:       c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
 * (the lower 16 bits of a register hold the lower k index). Each C element is the dot product of
 * its own A row and B column: rows never mix, which the batch invariance relies on. */
#ifndef KDT_GPU_MMA_CUH
#define KDT_GPU_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

namespace kg {

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared through L2; src_bytes = 0 zero-fills (src must still be valid). */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

/* ---- 1-D bulk copies (the TMA engine, sm_90 and later) completing on an mbarrier ----------
 * Used by the GEMM's opt-in bulk W loader (KDT_GEMM_BULK_W=1); the host selects it only on a
 * device of compute capability >= 9, so the pre-sm_90 bodies (a trap) never run. Waiters pass
 * the parity of the phase they wait for: 0 for a barrier's first completion, then alternating. */
__device__ __forceinline__ void bulk_bar_init(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void bulk_bar_fence_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
/* One arrival that announces `bytes`, then the copy of `bytes` (multiple of 16, both ends
 * 16-byte aligned) from global src to shared dst, completing on bar; L2 policy pol. */
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar,
                                              uint64_t pol) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol)
                 : "memory");
#else
    __trap();
#endif
}
/* Orders this thread's (and, after a barrier, the CTA's) generic shared-memory accesses before its
 * later bulk copies into the same bytes. */
__device__ __forceinline__ void bulk_fence_proxy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void bulk_bar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .pred p;\nKDT_BULK_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra KDT_BULK_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#endif
}

/* Four 8x8 b16 matrices; lane l addresses row (l % 8) of matrix (l / 8). */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

/* Four transposed 8x8 b16 matrices; lane l addresses row (l % 8) of matrix (l / 8). */
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

/* d += a * b */
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* (x0, x1) -> hi = bf16(x), lo = bf16(x - hi): hi + lo carries x to ~2^-17 relative. */
__device__ __forceinline__ void split_bf16(float2 v, uint32_t &hi, uint32_t &lo) {
    __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
    hi = *reinterpret_cast<uint32_t *>(&h);
    lo = pack_bf16(v.x - __low2float(h), v.y - __high2float(h));
}

__device__ __forceinline__ float bf16_to_f32(uint16_t v) { return __uint_as_float((uint32_t)v << 16); }

/* Sum over the warp: an xor shuffle tree (the same order for every row). */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over a block of THREADS threads: warp sums, then the warps' sums in warp order through
 * red[THREADS / 32]. Every thread gets the result; red is free again on return. */
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; w++) s += red[w];
    __syncthreads();
    return s;
}
__device__ __forceinline__ uint16_t f32_to_bf16(float v) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    return *reinterpret_cast<uint16_t *>(&b);
}

} // namespace kg

#endif
