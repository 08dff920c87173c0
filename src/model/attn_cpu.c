/* attn_cpu.c - the CPU forward's attention core: one query row, up to 8 heads, over the row's
 * visible keys (absorbed MLA: a key is a cache row [c_kv | k_pe], its value the c_kv part).
 *
 * The arithmetic is fixed (it is the reference every other path is checked against):
 *   s_t   = (sum over e ascending of q_lat[e] * key_t[e]) * scale       for each key t
 *   m     = max_t s_t;  p_t = expf(s_t - m);  l = sum over t ascending of p_t
 *   o[e]  = (sum over t ascending of p_t * c_kv_t[e]) / l
 * Two forms compute it with the same bits: plain C (any CPU), and AVX2 where the CPU has it (chosen
 * at run time), whose lanes are independent sums: the 8 heads for the scores (each key's values
 * broadcast, no transposes) and 8 columns of o. AVX2 without FMA: every product is rounded before
 * its add, as in the plain form (the build also passes -ffp-contract=off). The scores, the softmax
 * weights and the weighted sum of rows serve the drafter's attention too (dflash.c). */
#include "model_internal.h"

#include <math.h>
#include <string.h>

float kdt_cpu_softmax_weights(float *s, int32_t n) {
    float m = -INFINITY, l = 0.0f;
    for (int32_t t = 0; t < n; t++)
        if (s[t] > m) m = s[t];
    for (int32_t t = 0; t < n; t++) {
        s[t] = expf(s[t] - m);
        l += s[t];
    }
    return l;
}

/* plain form of one head's scores: 8 keys' dots side by side (each its own sum) */
static void scores_plain(const float *const *keys, int32_t n_keys, int32_t drow, float scale, const float *q, float *s) {
    int32_t k = 0;
    for (; k + 8 <= n_keys; k += 8) {
        float dot[8] = {0};
        for (int32_t e = 0; e < drow; e++)
            for (int j = 0; j < 8; j++) dot[j] += q[e] * keys[k + j][e];
        for (int j = 0; j < 8; j++) s[k + j] = dot[j] * scale;
    }
    for (; k < n_keys; k++) {
        float dot = 0.0f;
        for (int32_t e = 0; e < drow; e++) dot += q[e] * keys[k][e];
        s[k] = dot * scale;
    }
}

static void weighted_sum_plain(const float *w, const float *const *rows, int32_t n, int32_t cols, float *out) {
    for (int32_t e = 0; e < cols; e++) out[e] = 0.0f;
    for (int32_t t = 0; t < n; t++)
        for (int32_t e = 0; e < cols; e++) out[e] += w[t] * rows[t][e];
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* AVX2 scores of up to 8 queries: the queries transposed to [e][8] (unused lanes zero), then per
 * block of 8 keys one accumulator per key whose lane h is query h's dot */
__attribute__((target("avx2"))) static void scores_avx2(const float *const *keys, int32_t n_keys, int32_t drow,
                                                         float scale, int32_t n_q, const float *q, int64_t q_stride,
                                                         float *p, float *qt) {
    for (int32_t e = 0; e < drow; e++)
        for (int h = 0; h < 8; h++) qt[(int64_t)e * 8 + h] = h < n_q ? q[(int64_t)h * q_stride + e] : 0.0f;
    float tile[8][8] __attribute__((aligned(32)));
    for (int32_t k = 0; k < n_keys; k += 8) {
        const int nk = n_keys - k < 8 ? n_keys - k : 8;
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        if (nk == 8) {
            const float *k0 = keys[k], *k1 = keys[k + 1], *k2 = keys[k + 2], *k3 = keys[k + 3], *k4 = keys[k + 4],
                        *k5 = keys[k + 5], *k6 = keys[k + 6], *k7 = keys[k + 7];
            for (int32_t e = 0; e < drow; e++) {
                const __m256 qv = _mm256_loadu_ps(qt + (int64_t)e * 8);
                a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(qv, _mm256_broadcast_ss(k0 + e)));
                a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(qv, _mm256_broadcast_ss(k1 + e)));
                a[2] = _mm256_add_ps(a[2], _mm256_mul_ps(qv, _mm256_broadcast_ss(k2 + e)));
                a[3] = _mm256_add_ps(a[3], _mm256_mul_ps(qv, _mm256_broadcast_ss(k3 + e)));
                a[4] = _mm256_add_ps(a[4], _mm256_mul_ps(qv, _mm256_broadcast_ss(k4 + e)));
                a[5] = _mm256_add_ps(a[5], _mm256_mul_ps(qv, _mm256_broadcast_ss(k5 + e)));
                a[6] = _mm256_add_ps(a[6], _mm256_mul_ps(qv, _mm256_broadcast_ss(k6 + e)));
                a[7] = _mm256_add_ps(a[7], _mm256_mul_ps(qv, _mm256_broadcast_ss(k7 + e)));
            }
        } else {
            for (int j = 0; j < nk; j++)
                for (int32_t e = 0; e < drow; e++)
                    a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(_mm256_loadu_ps(qt + (int64_t)e * 8),
                                                             _mm256_broadcast_ss(keys[k + j] + e)));
        }
        for (int j = 0; j < nk; j++) _mm256_store_ps(tile[j], a[j]);
        for (int32_t h = 0; h < n_q; h++)
            for (int j = 0; j < nk; j++) p[(int64_t)h * n_keys + k + j] = tile[j][h] * scale;
    }
}

/* AVX2 weighted sum: 32 columns in four registers over all rows, then the rest column by column */
__attribute__((target("avx2"))) static void weighted_sum_avx2(const float *w, const float *const *rows, int32_t n,
                                                               int32_t cols, float *out) {
    int32_t e0 = 0;
    for (; e0 + 32 <= cols; e0 += 32) {
        __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps(), o2 = _mm256_setzero_ps(), o3 = _mm256_setzero_ps();
        for (int32_t t = 0; t < n; t++) {
            const __m256 wt = _mm256_broadcast_ss(w + t);
            const float *r = rows[t] + e0;
            o0 = _mm256_add_ps(o0, _mm256_mul_ps(wt, _mm256_loadu_ps(r)));
            o1 = _mm256_add_ps(o1, _mm256_mul_ps(wt, _mm256_loadu_ps(r + 8)));
            o2 = _mm256_add_ps(o2, _mm256_mul_ps(wt, _mm256_loadu_ps(r + 16)));
            o3 = _mm256_add_ps(o3, _mm256_mul_ps(wt, _mm256_loadu_ps(r + 24)));
        }
        _mm256_storeu_ps(out + e0, o0), _mm256_storeu_ps(out + e0 + 8, o1);
        _mm256_storeu_ps(out + e0 + 16, o2), _mm256_storeu_ps(out + e0 + 24, o3);
    }
    for (int32_t e = e0; e < cols; e++) {
        float v = 0.0f;
        for (int32_t t = 0; t < n; t++) v += w[t] * rows[t][e];
        out[e] = v;
    }
}
#endif

void kdt_cpu_weighted_sum(const float *w, const float *const *rows, int32_t n, int32_t cols, float *out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (kdt_cpu_avx2()) {
        weighted_sum_avx2(w, rows, n, cols, out);
        return;
    }
#endif
    weighted_sum_plain(w, rows, n, cols, out);
}

void kdt_cpu_scores(const float *const *keys, int32_t n_keys, int32_t dim, float scale, int32_t n_q, const float *q,
                    int64_t q_stride, float *p, float *qt) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (kdt_cpu_avx2()) {
        scores_avx2(keys, n_keys, dim, scale, n_q, q, q_stride, p, qt);
        return;
    }
#endif
    (void)qt;
    for (int32_t h = 0; h < n_q; h++) scores_plain(keys, n_keys, dim, scale, q + (int64_t)h * q_stride, p + (int64_t)h * n_keys);
}

void kdt_cpu_attend(const float *const *keys, int32_t n_keys, int32_t dc, int32_t dr, float scale, int32_t n_heads,
                    const float *qlat, float *p, float *olat, float *qt) {
    kdt_cpu_scores(keys, n_keys, dc + dr, scale, n_heads, qlat, dc + dr, p, qt);
    for (int32_t h = 0; h < n_heads; h++) {
        float *s = p + (int64_t)h * n_keys, *o = olat + (int64_t)h * dc;
        const float l = kdt_cpu_softmax_weights(s, n_keys);
        kdt_cpu_weighted_sum(s, keys, n_keys, dc, o);
        for (int32_t e = 0; e < dc; e++) o[e] /= l;
    }
}
