/* fp.h - bf16 <-> fp32 conversions for the CPU side (bit-exact round-to-nearest-even, NaN kept
 * quiet) and the e4m3 decoder. bf16 is the top 16 bits of an IEEE fp32; CUDA code mostly uses
 * cuda_bf16.h, which rounds the same way. Under nvcc these are host + device functions, so a
 * kernel can share a conversion with its CPU twin (verify_attn's FP8 cache loader does). */
#ifndef KDT_FP_H
#define KDT_FP_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define KDT_FP_FN static inline __host__ __device__
#else
#define KDT_FP_FN static inline
#endif

KDT_FP_FN float kdt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

KDT_FP_FN uint16_t kdt_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                        /* RNE */
    return (uint16_t)(u >> 16);
}

/* OCP FP8 E4M3 (fn) -> fp32, exact: bias 7, no infinities, S.1111.111 is NaN, exponent 0 is
 * subnormal. Checkpoint weights (block FP8) and the FP8 latent cache use it. */
KDT_FP_FN float kdt_e4m3_to_f32(uint8_t b) {
    const uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
    uint32_t u;
    if ((b & 0x7fu) == 0x7fu) {
        u = 0x7fc00000u; /* quiet NaN */
    } else if (exp == 0) {
        const float v = (float)man * (1.0f / 512.0f); /* man/8 * 2^-6, exact */
        memcpy(&u, &v, 4);
    } else {
        u = ((exp + 120u) << 23) | (man << 20); /* (1 + man/8) * 2^(exp-7) */
    }
    u |= (uint32_t)(b & 0x80u) << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Order-preserving map of an fp32 to uint32 (larger float -> larger integer; -0 and +0 map to
 * the same key). Used for deterministic max/top-K and tie-breaking on CPU and GPU alike. */
KDT_FP_FN uint32_t kdt_f32_order_key(float f) {
    uint32_t u;
    if (f == 0.0f) f = 0.0f; /* fold -0 into +0 */
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#endif
