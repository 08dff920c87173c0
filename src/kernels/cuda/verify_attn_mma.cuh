/* verify_attn_mma.cuh - the warp-level PTX verify_attn's portable path is built from: 16-byte
 * cp.async with zero fill, ldmatrix (plain and transposed) and the bf16 tensor-core product
 * mma.sync m16n8k16 with fp32 accumulation. All of them exist on sm_80, sm_90 and sm_120; nothing
 * here is Hopper-only (no wgmma, no TMA).
 */
#ifndef KDT_VERIFY_ATTN_MMA_CUH
#define KDT_VERIFY_ATTN_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace va {

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Copies 16 bytes global -> shared, L2 only; with src_bytes = 0 nothing is read and the 16
 * shared bytes are zeroed (the source address must still be a valid pointer value). */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
/* Waits until at most N of this thread's newest cp.async groups are still in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

/* Four 8x8 b16 matrices; lane l addresses row (l % 8) of matrix (l / 8). */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/* Two matrices; lanes 0..15 give the addresses (the others' are ignored but must be valid). */
__device__ __forceinline__ void ldsm_x2(uint32_t r[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

/* d += a * b: a 16x16 (row-major fragment, 4 regs), b 16x8 (column-major fragment, 2 regs),
 * d 16x8 fp32 (c0,c1: row lane/4, cols 2*(lane%4)+{0,1}; c2,c3: the same 8 rows below). */
__device__ __forceinline__ void mma_bf16_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* lo -> lower address */
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi); /* lo -> lower address */
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The fp16 split partials: a (row, 64-column group)'s normalized values x are stored as
 * half(x * up), up = 2^k with k chosen from the group's max |x| (mx) so that the largest lands in
 * [2^14, 2^15) (fp16 keeps 11 significant bits; its largest finite value is 65,504); the combine
 * multiplies by down = 2^-k. Both are exact powers of two (k clamped to +-126: a group of zeros or
 * subnormals gets 2^126; NaN passes through). */
__device__ __forceinline__ void part_scales(float mx, float *up, float *down) {
    const int e = ((__float_as_int(mx) >> 23) & 255) - 127; /* mx's exponent; -127 for 0 */
    int k = 14 - e;
    k = k < -126 ? -126 : (k > 126 ? 126 : k);
    *up = __int_as_float((127 + k) << 23);
    *down = __int_as_float((127 - k) << 23);
}
/* part_scales of the max over a quad (4 lanes holding one row's group; every lane must call it) */
__device__ __forceinline__ void quad_part_scales(float mx, float *up, float *down) {
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    part_scales(mx, up, down);
}

} // namespace va

#endif
