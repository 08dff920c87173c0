/* fp.h - bf16 <-> fp32 conversions for the CPU side (bit-exact round-to-nearest-even, NaN kept
 * quiet). bf16 is the top 16 bits of an IEEE fp32; CUDA code uses cuda_bf16.h instead, which
 * rounds the same way. */
#ifndef KDT_FP_H
#define KDT_FP_H

#include <stdint.h>
#include <string.h>

static inline float kdt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t kdt_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                        /* RNE */
    return (uint16_t)(u >> 16);
}

/* Order-preserving map of an fp32 to uint32 (larger float -> larger integer; -0 and +0 map to
 * the same key). Used for deterministic max/top-K and tie-breaking on CPU and GPU alike. */
static inline uint32_t kdt_f32_order_key(float f) {
    uint32_t u;
    if (f == 0.0f) f = 0.0f; /* fold -0 into +0 */
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#endif
