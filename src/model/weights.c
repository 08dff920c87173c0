/* weights.c - the one place where stored weights become fp32: row conversion and the
 * matrix-vector product the CPU forward uses, for plain F32 / BF16 / F16 weights, block-FP8
 * (e4m3 + per-block scale) and INT4 group-quantized (compressed-tensors pack-quantized) weights.
 * A quantized element is dequantized as one fp32 product (value * scale) and then used like a
 * plain weight, so a quantized checkpoint computes exactly what an F32 checkpoint holding those
 * dequantized values computes. */
#include "model_internal.h"

#include "fp.h"

#include <math.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* OCP FP8 E4M3 (fn): bias 7, no infinities, S.1111.111 is NaN, exponent 0 is subnormal. */
static inline float e4m3_to_f32(uint8_t b) {
    const int exp = (b >> 3) & 0xf, man = b & 7;
    float v;
    if ((b & 0x7f) == 0x7f) v = NAN;
    else if (exp == 0) v = ldexpf((float)man, -9);       /* man/8 * 2^-6 */
    else v = ldexpf((float)(8 + man), exp - 10);         /* (1 + man/8) * 2^(exp-7) */
    return (b & 0x80) ? -v : v;
}

static inline float scalar_f32(kdt_wtype t, const void *p, int64_t i) {
    switch (t) {
    case KDT_W_F32: return ((const float *)p)[i];
    case KDT_W_BF16: return kdt_bf16_to_f32(((const uint16_t *)p)[i]);
    case KDT_W_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0f;
    }
}

/* dst[c - c0] = W[r][c] for c in [c0, c1), quantized formats */
static void quant_range(const kdt_weight *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const int64_t n = w->cols, gc = w->group_cols;
    if (w->format == KDT_WF_FP8_BLOCK) {
        const uint8_t *p = (const uint8_t *)w->data + r * n;
        const int64_t scale_row = (r / w->group_rows) * ((n + gc - 1) / gc);
        for (int64_t c = c0; c < c1; c++)
            dst[c - c0] = e4m3_to_f32(p[c]) * scalar_f32(w->scale_dtype, w->scale, scale_row + c / gc);
    } else { /* KDT_WF_INT4_GROUP */
        const uint32_t *p = (const uint32_t *)w->data + r * (n / 8);
        const int64_t scale_row = r * (n / gc);
        for (int64_t c = c0; c < c1; c++) {
            const int nib = (int)((p[c / 8] >> (4 * (c % 8))) & 0xfu);
            dst[c - c0] = (float)(nib - 8) * scalar_f32(w->scale_dtype, w->scale, scale_row + c / gc);
        }
    }
}

void kdt_weight_row_f32(const kdt_weight *w, int64_t r, float *dst) {
    const int64_t n = w->cols, off = r * n;
    if (w->format != KDT_WF_PLAIN) {
        quant_range(w, r, 0, n, dst);
        return;
    }
    switch (w->dtype) {
    case KDT_W_F32:
        memcpy(dst, (const float *)w->data + off, (size_t)n * sizeof(float));
        break;
    case KDT_W_BF16: {
        const uint16_t *p = (const uint16_t *)w->data + off;
        for (int64_t c = 0; c < n; c++) dst[c] = kdt_bf16_to_f32(p[c]);
        break;
    }
    case KDT_W_F16: {
        const uint16_t *p = (const uint16_t *)w->data + off;
        for (int64_t c = 0; c < n; c++) dst[c] = f16_to_f32(p[c]);
        break;
    }
    default: /* refused at load */
        memset(dst, 0, (size_t)n * sizeof(float));
        break;
    }
}

float kdt_weight_at(const kdt_weight *w, int64_t i) {
    if (w->format != KDT_WF_PLAIN) return 0.0f; /* 1-D weights are never quantized */
    return scalar_f32(w->dtype, w->data, i);
}

/* One fixed summation order (c ascending, one fp32 accumulator) for every caller: this is what
 * makes a row's result independent of batch composition. */
void kdt_weight_matvec(const kdt_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    const int64_t n = w->cols;
    if (w->format != KDT_WF_PLAIN) {
        /* dequantize a block of columns at a time; the sum runs over c ascending as for plain */
        float blk[512];
        for (int64_t r = r0; r < r1; r++) {
            float acc = 0.0f;
            for (int64_t c0 = 0; c0 < n; c0 += 512) {
                const int64_t c1 = c0 + 512 < n ? c0 + 512 : n;
                quant_range(w, r, c0, c1, blk);
                for (int64_t c = c0; c < c1; c++) acc += blk[c - c0] * x[c];
            }
            y[r - r0] = acc;
        }
        return;
    }
    switch (w->dtype) {
    case KDT_W_F32:
        for (int64_t r = r0; r < r1; r++) {
            const float *p = (const float *)w->data + r * n;
            float acc = 0.0f;
            for (int64_t c = 0; c < n; c++) acc += p[c] * x[c];
            y[r - r0] = acc;
        }
        break;
    case KDT_W_BF16:
        for (int64_t r = r0; r < r1; r++) {
            const uint16_t *p = (const uint16_t *)w->data + r * n;
            float acc = 0.0f;
            for (int64_t c = 0; c < n; c++) acc += kdt_bf16_to_f32(p[c]) * x[c];
            y[r - r0] = acc;
        }
        break;
    case KDT_W_F16:
        for (int64_t r = r0; r < r1; r++) {
            const uint16_t *p = (const uint16_t *)w->data + r * n;
            float acc = 0.0f;
            for (int64_t c = 0; c < n; c++) acc += f16_to_f32(p[c]) * x[c];
            y[r - r0] = acc;
        }
        break;
    default:
        for (int64_t r = r0; r < r1; r++) y[r - r0] = 0.0f;
        break;
    }
}
