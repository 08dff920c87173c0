/* weights.c - the one place where stored weights become fp32: row conversion and the
 * matrix-vector / matrix products the CPU forward uses, for plain F32 / BF16 / F16 weights,
 * block-FP8 (e4m3 + per-block scale) and INT4 group-quantized (compressed-tensors pack-quantized)
 * weights. A quantized element is dequantized as one fp32 product (value * scale) and then used
 * like a plain weight, so a quantized checkpoint computes exactly what an F32 checkpoint holding
 * those dequantized values computes. Every product sums over c ascending in one accumulator per
 * output; the SSE2 / AVX2 forms only put independent outputs side by side in a register, and the
 * weight rows are cut among the CPU threads, so neither changes a bit. */
#include "model_internal.h"

#include "fp.h"

#include <math.h>
#include <stdlib.h>
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
            dst[c - c0] = kdt_e4m3_to_f32(p[c]) * scalar_f32(w->scale_dtype, w->scale, scale_row + c / gc);
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

/* Plain rows r0..r1-1 of an [rows][n] matrix of element type T (converted by CVT) times x, MV_ROWS
 * rows at a time: each row keeps its own accumulator and sums over c ascending exactly as a row
 * alone would (the same products, the same additions, in the same order), but the rows' chains
 * are independent, so the CPU overlaps them instead of waiting on one add after another. */
#define MV_ROWS 8
#define DEFINE_MATVEC(name, T, CVT)                                                                  \
    static void name(const T *w, int64_t n, const float *x, float *y, int64_t r0, int64_t r1) {      \
        int64_t r = r0;                                                                              \
        for (; r + MV_ROWS <= r1; r += MV_ROWS) {                                                    \
            const T *p = w + r * n;                                                                  \
            float acc[MV_ROWS] = {0};                                                                \
            for (int64_t c = 0; c < n; c++) {                                                        \
                const float xc = x[c];                                                               \
                for (int j = 0; j < MV_ROWS; j++) acc[j] += CVT(p[j * n + c]) * xc;                  \
            }                                                                                        \
            for (int j = 0; j < MV_ROWS; j++) y[r - r0 + j] = acc[j];                                \
        }                                                                                            \
        for (; r < r1; r++) {                                                                        \
            const T *p = w + r * n;                                                                  \
            float acc = 0.0f;                                                                        \
            for (int64_t c = 0; c < n; c++) acc += CVT(p[c]) * x[c];                                 \
            y[r - r0] = acc;                                                                         \
        }                                                                                            \
    }
static inline float f32_id(float v) { return v; }
DEFINE_MATVEC(matvec_f32, float, f32_id)
DEFINE_MATVEC(matvec_bf16, uint16_t, kdt_bf16_to_f32)
DEFINE_MATVEC(matvec_f16, uint16_t, f16_to_f32)

#if defined(__SSE2__)
#include <emmintrin.h>
/* col[k] = (W[0][c + k], ..., W[7][c + k]): an 8 x 8 block of bf16 rows p (n apart) transposed in
 * registers (three rounds of 16-, 32- and 64-bit interleaves) */
static inline void bf16_tile8_transpose(const uint16_t *p, int64_t n, int64_t c, __m128i col[8]) {
    __m128i r[8];
    for (int j = 0; j < 8; j++) r[j] = _mm_loadu_si128((const __m128i *)(p + j * n + c));
    const __m128i t0 = _mm_unpacklo_epi16(r[0], r[1]), t1 = _mm_unpacklo_epi16(r[2], r[3]);
    const __m128i t2 = _mm_unpacklo_epi16(r[4], r[5]), t3 = _mm_unpacklo_epi16(r[6], r[7]);
    const __m128i t4 = _mm_unpackhi_epi16(r[0], r[1]), t5 = _mm_unpackhi_epi16(r[2], r[3]);
    const __m128i t6 = _mm_unpackhi_epi16(r[4], r[5]), t7 = _mm_unpackhi_epi16(r[6], r[7]);
    const __m128i u0 = _mm_unpacklo_epi32(t0, t1), u1 = _mm_unpacklo_epi32(t2, t3);
    const __m128i u2 = _mm_unpackhi_epi32(t0, t1), u3 = _mm_unpackhi_epi32(t2, t3);
    const __m128i u4 = _mm_unpacklo_epi32(t4, t5), u5 = _mm_unpacklo_epi32(t6, t7);
    const __m128i u6 = _mm_unpackhi_epi32(t4, t5), u7 = _mm_unpackhi_epi32(t6, t7);
    col[0] = _mm_unpacklo_epi64(u0, u1), col[1] = _mm_unpackhi_epi64(u0, u1);
    col[2] = _mm_unpacklo_epi64(u2, u3), col[3] = _mm_unpackhi_epi64(u2, u3);
    col[4] = _mm_unpacklo_epi64(u4, u5), col[5] = _mm_unpackhi_epi64(u4, u5);
    col[6] = _mm_unpacklo_epi64(u6, u7), col[7] = _mm_unpackhi_epi64(u6, u7);
}

/* y[0..8) for 8 bf16 rows p (n apart) on x86-64: tiles of 8 rows x 8 columns are transposed in
 * registers, so that one vector pair holds column c of the 8 rows and the 8 accumulators (lane j =
 * row j) take W[j][c] * x[c] as two vector multiplies and adds: per lane the same product and sum,
 * in the same c order, as matvec_bf16 (a bf16 becomes fp32 by moving its bits to the high half,
 * exactly kdt_bf16_to_f32). */
static void matvec8_bf16_sse2(const uint16_t *p, int64_t n, const float *x, float *y) {
    __m128 a_lo = _mm_setzero_ps(), a_hi = _mm_setzero_ps(); /* rows 0-3, rows 4-7 */
    const __m128i z = _mm_setzero_si128();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m128i col[8];
        bf16_tile8_transpose(p, n, c, col);
        for (int k = 0; k < 8; k++) {
            const __m128 xc = _mm_set1_ps(x[c + k]);
            a_lo = _mm_add_ps(a_lo, _mm_mul_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(z, col[k])), xc));
            a_hi = _mm_add_ps(a_hi, _mm_mul_ps(_mm_castsi128_ps(_mm_unpackhi_epi16(z, col[k])), xc));
        }
    }
    float acc[8];
    _mm_storeu_ps(acc, a_lo);
    _mm_storeu_ps(acc + 4, a_hi);
    for (; c < n; c++)
        for (int j = 0; j < 8; j++) acc[j] += kdt_bf16_to_f32(p[j * n + c]) * x[c];
    for (int j = 0; j < 8; j++) y[j] = acc[j];
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* 16 bf16 rows (two tiles of 8, two independent chains) with AVX2: each tile's 8 x 8 block is
 * transposed as in matvec8_bf16_sse2, a column becomes 8 fp32 lanes (lane j = row j) in one
 * widening move and shift, and takes W[j][c] * x[c] as a separate multiply and add: per lane the
 * scalar product and sum in c order, the same bits. */
__attribute__((target("avx2"))) static void matvec16_bf16_avx2(const uint16_t *p, int64_t n, const float *x, float *y) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 xc[8];
        for (int k = 0; k < 8; k++) xc[k] = _mm256_broadcast_ss(x + c + k);
        for (int t = 0; t < 2; t++) {
            __m128i col[8];
            bf16_tile8_transpose(p + (int64_t)t * 8 * n, n, c, col);
            for (int k = 0; k < 8; k++) {
                const __m256 wk = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(col[k]), 16));
                acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(wk, xc[k]));
            }
        }
    }
    float a[16];
    _mm256_storeu_ps(a, acc[0]);
    _mm256_storeu_ps(a + 8, acc[1]);
    for (; c < n; c++)
        for (int j = 0; j < 16; j++) a[j] += kdt_bf16_to_f32(p[j * n + c]) * x[c];
    for (int j = 0; j < 16; j++) y[j] = a[j];
}
#endif

/* bf16 rows: 16-row AVX2 tiles where the CPU has AVX2, the SSE2 tiles of 8 (every x86-64),
 * matvec_bf16 for the rest; all the same bits */
static void matvec_bf16_fast(const uint16_t *w, int64_t n, const float *x, float *y, int64_t r0, int64_t r1) {
    int64_t r = r0;
#if defined(__x86_64__) && defined(__GNUC__)
    if (kdt_cpu_avx2())
        for (; r + 16 <= r1; r += 16) matvec16_bf16_avx2(w + r * n, n, x, y + (r - r0));
#endif
#if defined(__SSE2__)
    if (kdt_cpu_sse2())
        for (; r + 8 <= r1; r += 8) matvec8_bf16_sse2(w + r * n, n, x, y + (r - r0));
#endif
    matvec_bf16(w, n, x, y + (r - r0), r, r1);
}

/* MM_ROWS input rows against one weight row at a time: the weight row is read once for all of them,
 * and each (input row, weight row) pair sums over c ascending in its own accumulator, exactly as
 * kdt_weight_matvec does for that input row alone. XT is the block of input rows transposed
 * ([n][MM_ROWS]), so the MM_ROWS accumulators update as one vector per column (lane j = row j: the
 * same multiply and add per lane as the scalar code, nothing reassociated). */
#define MM_ROWS 8
#define DEFINE_MATMUL8(name, T, CVT)                                                                 \
    static void name(const T *w, int64_t n, const float *XT, int nb, float *Y, int64_t ldy,         \
                     int64_t r0, int64_t r1) {                                                       \
        int64_t r = r0;                                                                              \
        for (; r + 4 <= r1; r += 4) { /* 4 weight rows: 4 x MM_ROWS independent sums in flight */   \
            const T *p = w + r * n;                                                                  \
            float a0[MM_ROWS] = {0}, a1[MM_ROWS] = {0}, a2[MM_ROWS] = {0}, a3[MM_ROWS] = {0};        \
            for (int64_t c = 0; c < n; c++) {                                                        \
                const float w0 = CVT(p[c]), w1 = CVT(p[n + c]), w2 = CVT(p[2 * n + c]),              \
                            w3 = CVT(p[3 * n + c]);                                                  \
                const float *xt = XT + c * MM_ROWS;                                                  \
                for (int j = 0; j < MM_ROWS; j++) {                                                  \
                    a0[j] += w0 * xt[j];                                                             \
                    a1[j] += w1 * xt[j];                                                             \
                    a2[j] += w2 * xt[j];                                                             \
                    a3[j] += w3 * xt[j];                                                             \
                }                                                                                    \
            }                                                                                        \
            for (int j = 0; j < nb; j++) {                                                           \
                float *yj = Y + j * ldy + (r - r0);                                                  \
                yj[0] = a0[j], yj[1] = a1[j], yj[2] = a2[j], yj[3] = a3[j];                          \
            }                                                                                        \
        }                                                                                            \
        for (; r < r1; r++) {                                                                        \
            const T *p = w + r * n;                                                                  \
            float acc[MM_ROWS] = {0};                                                                \
            for (int64_t c = 0; c < n; c++) {                                                        \
                const float wc = CVT(p[c]);                                                          \
                const float *xt = XT + c * MM_ROWS;                                                  \
                for (int j = 0; j < MM_ROWS; j++) acc[j] += wc * xt[j];                              \
            }                                                                                        \
            for (int j = 0; j < nb; j++) Y[j * ldy + (r - r0)] = acc[j];                             \
        }                                                                                            \
    }
DEFINE_MATMUL8(matmul8_f32, float, f32_id)
DEFINE_MATMUL8(matmul8_bf16, uint16_t, kdt_bf16_to_f32)
DEFINE_MATMUL8(matmul8_f16, uint16_t, f16_to_f32)

#if defined(__x86_64__) && defined(__GNUC__)
#define KDT_HAVE_AVX2_PATH 1
/* The block products with 8-lane vectors where the CPU has AVX2 (chosen at run time): lane j =
 * input row j of a block, one vector of XT per column, each weight broadcast to all lanes, and a
 * separate multiply and add (AVX2 without FMA, so nothing can be fused): per lane the scalar
 * code's product and sum in the same c order, so the same bits. Four weight rows at a time are
 * converted to fp32 once, AVX_COLS columns at a stretch, and serve every block of input rows
 * from L1; each block's four accumulators live in acc between stretches. */
#define AVX_COLS 512
#define AVX_BLOCKS 16
__attribute__((target("avx2"))) static void matmul_blocks_avx2(const void *wdata, int is_bf16, int64_t n,
                                                                const float *XT, int32_t n_blocks, int32_t R, float *Y,
                                                                int64_t ldy, int64_t r0, int64_t r1) {
    float wbuf[4][AVX_COLS] __attribute__((aligned(32)));
    float acc[AVX_BLOCKS][4][8] __attribute__((aligned(32)));
    for (int64_t r = r0; r < r1; r += 4) {
        const int rows = r1 - r < 4 ? (int)(r1 - r) : 4;
        for (int32_t b0 = 0; b0 < n_blocks; b0 += AVX_BLOCKS) {
            const int32_t nbk = n_blocks - b0 < AVX_BLOCKS ? n_blocks - b0 : AVX_BLOCKS;
            for (int64_t c0 = 0; c0 < n; c0 += AVX_COLS) {
                const int64_t cols = n - c0 < AVX_COLS ? n - c0 : AVX_COLS;
                for (int k = 0; k < 4; k++) {
                    if (k >= rows) { /* rows past r1: zeros, their sums dropped */
                        memset(wbuf[k], 0, (size_t)cols * sizeof(float));
                        continue;
                    }
                    int64_t q = 0;
                    if (is_bf16) {
                        const uint16_t *p = (const uint16_t *)wdata + (r + k) * n + c0;
                        for (; q + 8 <= cols; q += 8) {
                            const __m128i h = _mm_loadu_si128((const __m128i *)(p + q));
                            _mm256_store_ps(wbuf[k] + q, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
                        }
                        for (; q < cols; q++) wbuf[k][q] = kdt_bf16_to_f32(p[q]);
                    } else {
                        memcpy(wbuf[k], (const float *)wdata + (r + k) * n + c0, (size_t)cols * sizeof(float));
                    }
                }
                for (int32_t bk = 0; bk < nbk; bk++) {
                    __m256 a0, a1, a2, a3;
                    if (c0 == 0) {
                        a0 = a1 = a2 = a3 = _mm256_setzero_ps();
                    } else {
                        a0 = _mm256_load_ps(acc[bk][0]), a1 = _mm256_load_ps(acc[bk][1]);
                        a2 = _mm256_load_ps(acc[bk][2]), a3 = _mm256_load_ps(acc[bk][3]);
                    }
                    const float *xt = XT + ((int64_t)(b0 + bk) * n + c0) * MM_ROWS;
                    for (int64_t q = 0; q < cols; q++) {
                        const __m256 x = _mm256_loadu_ps(xt + q * MM_ROWS);
                        a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_broadcast_ss(&wbuf[0][q]), x));
                        a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_broadcast_ss(&wbuf[1][q]), x));
                        a2 = _mm256_add_ps(a2, _mm256_mul_ps(_mm256_broadcast_ss(&wbuf[2][q]), x));
                        a3 = _mm256_add_ps(a3, _mm256_mul_ps(_mm256_broadcast_ss(&wbuf[3][q]), x));
                    }
                    _mm256_store_ps(acc[bk][0], a0), _mm256_store_ps(acc[bk][1], a1);
                    _mm256_store_ps(acc[bk][2], a2), _mm256_store_ps(acc[bk][3], a3);
                }
            }
            for (int32_t bk = 0; bk < nbk; bk++) {
                const int32_t i0 = (b0 + bk) * MM_ROWS, nb = R - i0 < MM_ROWS ? R - i0 : MM_ROWS;
                for (int j = 0; j < nb; j++)
                    for (int k = 0; k < rows; k++) Y[(int64_t)(i0 + j) * ldy + (r + k - r0)] = acc[bk][k][j];
            }
        }
    }
}

#endif

/* One fixed summation order (c ascending, one fp32 accumulator per row) for every caller: this is
 * what makes a row's result independent of batch composition. */
static void matvec_rows(const kdt_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
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
    case KDT_W_F32: matvec_f32((const float *)w->data, n, x, y, r0, r1); break;
    case KDT_W_BF16: matvec_bf16_fast((const uint16_t *)w->data, n, x, y, r0, r1); break;
    case KDT_W_F16: matvec_f16((const uint16_t *)w->data, n, x, y, r0, r1); break;
    default:
        for (int64_t r = r0; r < r1; r++) y[r - r0] = 0.0f;
        break;
    }
}

typedef struct matvec_job {
    const kdt_weight *w;
    const float *x;
    float *y;
    int64_t r0;
} matvec_job;

static void matvec_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const matvec_job *j = ctx;
    (void)worker;
    matvec_rows(j->w, j->x, j->y + b, j->r0 + b, j->r0 + e);
}

/* Weight rows are cut among the CPU threads (pieces of 16 rows: the AVX2 tile); each row is one
 * thread's, so the thread count changes no bit. */
void kdt_weight_matvec(const kdt_weight *w, const float *x, float *y, int64_t r0, int64_t r1) {
    matvec_job j = {w, x, y, r0};
    kdt_parallel_for(r1 - r0, 16, (double)w->cols, 0, matvec_piece, &j);
}

/* One kdt_weight_matmul call's pieces: plain weights read the transposed blocks XT, quantized
 * ones the input rows X directly. */
typedef struct matmul_job {
    const kdt_weight *w;
    const float *XT;   /* plain: [n_blocks][n][MM_ROWS] input rows transposed, block after block */
    int32_t n_blocks;
    const float *X;    /* quantized: the input rows, ldx apart */
    int64_t ldx;
    int32_t R;         /* rows in the blocks (plain: the last block may be short; quantized: a
                          multiple of MM_ROWS) */
    float *Y;
    int64_t ldy, r0;
} matmul_job;

/* weight rows [r0 + b, r0 + e) against every block: the piece's weights stay in cache */
static void matmul_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const matmul_job *j = ctx;
    const int64_t n = j->w->cols;
    (void)worker;
#ifdef KDT_HAVE_AVX2_PATH
    if ((j->w->dtype == KDT_W_BF16 || j->w->dtype == KDT_W_F32) && kdt_cpu_avx2()) {
        matmul_blocks_avx2(j->w->data, j->w->dtype == KDT_W_BF16, n, j->XT, j->n_blocks, j->R, j->Y + b, j->ldy,
                           j->r0 + b, j->r0 + e);
        return;
    }
#endif
    for (int32_t blk = 0; blk < j->n_blocks; blk++) {
        const int nb = j->R - blk * MM_ROWS < MM_ROWS ? j->R - blk * MM_ROWS : MM_ROWS;
        const float *XT = j->XT + (int64_t)blk * n * MM_ROWS;
        float *Yb = j->Y + (int64_t)blk * MM_ROWS * j->ldy + b;
        const int64_t r0 = j->r0 + b, r1 = j->r0 + e;
        switch (j->w->dtype) {
        case KDT_W_F32: matmul8_f32((const float *)j->w->data, n, XT, nb, Yb, j->ldy, r0, r1); break;
        case KDT_W_BF16: matmul8_bf16((const uint16_t *)j->w->data, n, XT, nb, Yb, j->ldy, r0, r1); break;
        case KDT_W_F16: matmul8_f16((const uint16_t *)j->w->data, n, XT, nb, Yb, j->ldy, r0, r1); break;
        default:
            for (int jj = 0; jj < nb; jj++)
                for (int64_t r = r0; r < r1; r++) Yb[jj * j->ldy + (r - r0)] = 0.0f;
            break;
        }
    }
}

/* quantized weights: blocks of rows dequantize each weight row once, 512 columns at a time */
static void matmul_quant_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const matmul_job *j = ctx;
    const int64_t n = j->w->cols;
    float blk[512];
    (void)worker;
    for (int64_t r = j->r0 + b; r < j->r0 + e; r++) {
        for (int32_t i = 0; i < j->R; i += MM_ROWS) {
            const float *Xb = j->X + (int64_t)i * j->ldx;
            float acc[MM_ROWS] = {0};
            for (int64_t c0 = 0; c0 < n; c0 += 512) {
                const int64_t c1 = c0 + 512 < n ? c0 + 512 : n;
                quant_range(j->w, r, c0, c1, blk);
                for (int64_t c = c0; c < c1; c++)
                    for (int jj = 0; jj < MM_ROWS; jj++) acc[jj] += blk[c - c0] * Xb[jj * j->ldx + c];
            }
            for (int jj = 0; jj < MM_ROWS; jj++) j->Y[(int64_t)(i + jj) * j->ldy + (r - j->r0)] = acc[jj];
        }
    }
}

/* Y[i][r - r0] = kdt_weight_matvec's value for input row X[i], bit for bit, for i < R: blocks of
 * MM_ROWS rows share each weight row's read (the CPU verify and prefill pay for the weights once
 * per block instead of once per row); the rest go through kdt_weight_matvec. The weight rows are
 * cut among the CPU threads, each thread running every block over its rows. */
void kdt_weight_matmul(const kdt_weight *w, const float *X, int64_t ldx, int32_t R, float *Y, int64_t ldy,
                       int64_t r0, int64_t r1) {
    const int64_t n = w->cols;
    int32_t done = 0;
    if (R >= 2 && w->format == KDT_WF_PLAIN) {
        /* blocks of up to MM_ROWS rows (a last block of 2..7 fills its spare lanes with zeros, whose
         * results are dropped); a last lone row goes through kdt_weight_matvec */
        const int32_t rows = R % MM_ROWS == 1 ? R - 1 : R, n_blocks = (rows + MM_ROWS - 1) / MM_ROWS;
        float *XT = malloc((size_t)n * MM_ROWS * (size_t)n_blocks * sizeof(float));
        if (XT) {
            for (int32_t blk = 0; blk < n_blocks; blk++) {
                const int32_t i = blk * MM_ROWS, nb = rows - i < MM_ROWS ? rows - i : MM_ROWS;
                const float *Xb = X + (int64_t)i * ldx;
                float *T = XT + (int64_t)blk * n * MM_ROWS;
                for (int64_t c = 0; c < n; c++)
                    for (int jj = 0; jj < MM_ROWS; jj++) T[c * MM_ROWS + jj] = jj < nb ? Xb[jj * ldx + c] : 0.0f;
            }
            matmul_job j = {w, XT, n_blocks, NULL, 0, rows, Y, ldy, r0};
            kdt_parallel_for(r1 - r0, 4, (double)n * n_blocks * MM_ROWS, 0, matmul_piece, &j);
            free(XT);
            done = rows;
        }
    } else if (R >= MM_ROWS && w->format != KDT_WF_PLAIN) {
        matmul_job j = {w, NULL, 0, X, ldx, R - R % MM_ROWS, Y, ldy, r0};
        kdt_parallel_for(r1 - r0, 1, (double)n * j.R, 0, matmul_quant_piece, &j);
        done = j.R;
    }
    /* the rest (a lone row, a quantized tail, or no memory for the transposed blocks) */
    for (int32_t i = done; i < R; i++) kdt_weight_matvec(w, X + (int64_t)i * ldx, Y + (int64_t)i * ldy, r0, r1);
}

/* out[i] = down(silu(gate x_i) * up x_i) for R rows, through kdt_weight_matmul; g and u hold
 * R x gate->rows floats each (g ends up as the SwiGLU input of down). */
void kdt_weight_swiglu_rows(const kdt_weight *gate, const kdt_weight *up, const kdt_weight *down, const float *x,
                            int64_t ldx, int32_t R, float *g, float *u, float *out, int64_t ldo) {
    const int64_t inter = gate->rows;
    kdt_weight_matmul(gate, x, ldx, R, g, inter, 0, inter);
    kdt_weight_matmul(up, x, ldx, R, u, inter, 0, inter);
    for (int64_t i = 0; i < (int64_t)R * inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i]; /* silu(g) * u */
    kdt_weight_matmul(down, g, inter, R, out, ldo, 0, down->rows);
}
