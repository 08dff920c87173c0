/* verify_attn.c - CPU reference of the tree-masked MLA verify attention (kdt_verify_attn_cpu),
 * and the argument check shared with the CUDA launcher (kdt_verify_attn_check_args).
 *
 * Semantics (kernels.h, section verify_attn): per stream s, node i < n_nodes[s], head h, the
 * keys are the T = prefix_len + n_nodes slots of the stream's paged cache; slot t < prefix_len
 * is always visible, tree slot t = prefix_len + j is visible iff bit j of anc_mask row i is set.
 *   score_t = softmax_scale * dot(q[0:d_qk], kv[t][0:d_qk])      (double)
 *   out     = sum_t softmax(score)_t * kv[t][0:d_v]              (double, rounded once to bf16 RNE)
 *   lse     = max + log(sum_t exp(score_t - max))                 (double, rounded once to fp32)
 * A row that sees no key at all (only possible with a malformed mask: the root sees itself) gets
 * out = 0 and lse = -inf; the CUDA kernel does the same.
 *
 * How: rows (node, head) of a stream are taken ROW_GROUP at a time; each visible key row is
 * converted to double once per group, then dotted with every row of the group (4 partial sums
 * per dot, a fixed order), so the exact two-pass softmax costs about one multiply-add per element
 * and the scratch is ROW_GROUP * T doubles. Products of two bf16 values are exact in double.
 *
 * Cache rows are bf16 or FP8 with per-128 scales (kdt_kv_format); an FP8 latent's value is
 * e4m3 * scale, exact in double, so the reference measures what a kernel's dequantisation loses.
 *
 * Checks: the scalar fields (shared with the CUDA launcher), then every stream's n_nodes,
 * prefix_len, the prefix_len + n_nodes <= max_pages * page_size bound and each block-table entry
 * it uses. Any failure returns KDT_ERR_INVALID_ARG naming it before anything is written.
 */
#include "common.h"
#include "fp.h"
#include "kdtree/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define VA_MAX_DIM 4096  /* d_qk bound on the CPU (the model uses 576) */
#define ROW_GROUP 16     /* query rows sharing one pass over the keys */

/* Shared with the CUDA launcher (declared in cuda/verify_attn.cu). */
kdt_status kdt_verify_attn_check_args(const kdt_verify_attn_params *p, const char *who);

kdt_status kdt_verify_attn_check_args(const kdt_verify_attn_params *p, const char *who) {
    KDT_CHECK_ARG(p != NULL, "%s: params is NULL", who);
    KDT_CHECK_ARG(p->n_streams >= 1 && p->n_streams <= KDT_MAX_STREAMS,
                  "%s: n_streams = %d, expected 1..%d", who, p->n_streams, KDT_MAX_STREAMS);
    KDT_CHECK_ARG(p->n_heads >= 1 && p->n_heads <= 128, "%s: n_heads = %d, expected 1..128", who,
                  p->n_heads);
    KDT_CHECK_ARG(p->max_nodes >= 1 && p->max_nodes <= KDT_MAX_NODES,
                  "%s: max_nodes = %d, expected 1..%d", who, p->max_nodes, KDT_MAX_NODES);
    KDT_CHECK_ARG(p->d_qk >= 1 && p->d_qk <= VA_MAX_DIM, "%s: d_qk = %d, expected 1..%d", who,
                  p->d_qk, VA_MAX_DIM);
    KDT_CHECK_ARG(p->d_v >= 1 && p->d_v <= p->d_qk, "%s: d_v = %d, expected 1..d_qk (%d)", who,
                  p->d_v, p->d_qk);
    KDT_CHECK_ARG(isfinite(p->softmax_scale), "%s: softmax_scale = %g is not finite", who,
                  (double)p->softmax_scale);
    KDT_CHECK_ARG(p->q != NULL, "%s: q is NULL", who);
    KDT_CHECK_ARG(p->kv_cache != NULL, "%s: kv_cache is NULL", who);
    KDT_CHECK_ARG(p->block_table != NULL, "%s: block_table is NULL", who);
    KDT_CHECK_ARG(p->prefix_len != NULL, "%s: prefix_len is NULL", who);
    KDT_CHECK_ARG(p->n_nodes != NULL, "%s: n_nodes is NULL", who);
    KDT_CHECK_ARG(p->anc_mask != NULL, "%s: anc_mask is NULL", who);
    KDT_CHECK_ARG(p->out != NULL, "%s: out is NULL", who);
    KDT_CHECK_ARG(p->lse != NULL, "%s: lse is NULL", who);
    KDT_CHECK_ARG(p->n_pages >= 1, "%s: n_pages = %d, expected >= 1", who, p->n_pages);
    KDT_CHECK_ARG(p->page_size >= 1, "%s: page_size = %d, expected >= 1", who, p->page_size);
    KDT_CHECK_ARG(p->max_pages >= 1, "%s: max_pages = %d, expected >= 1", who, p->max_pages);
    KDT_CHECK_ARG((int64_t)p->max_pages * p->page_size <= INT32_MAX,
                  "%s: max_pages * page_size = %lld slots per stream, expected <= %d", who,
                  (long long)p->max_pages * p->page_size, INT32_MAX);
    KDT_CHECK_ARG(p->kv_format == KDT_KV_BF16 || p->kv_format == KDT_KV_FP8_SCALED,
                  "%s: kv_format = %d, expected %d (bf16) or %d (fp8 with scales)", who, p->kv_format,
                  KDT_KV_BF16, KDT_KV_FP8_SCALED);
    KDT_CHECK_ARG(kdt_kv_row_bytes(p->kv_format, p->d_qk, p->d_v) > 0,
                  "%s: kv_format %d (fp8 with scales) needs d_v a multiple of %d, got d_v = %d", who,
                  p->kv_format, KDT_KV_FP8_GROUP, p->d_v);
    return KDT_OK;
}

size_t kdt_kv_row_bytes(int32_t kv_format, int32_t d_qk, int32_t d_v) {
    if (d_qk < 1 || d_v < 1 || d_v > d_qk) return 0;
    switch (kv_format) {
    case KDT_KV_BF16: return 2 * (size_t)d_qk;
    case KDT_KV_FP8_SCALED:
        if (d_v % KDT_KV_FP8_GROUP) return 0;
        return (size_t)d_v + 4 * (size_t)(d_v / KDT_KV_FP8_GROUP) + 2 * (size_t)(d_qk - d_v);
    default: return 0;
    }
}

/* Key row `slot` as exact values: the first n columns (n <= d_qk) into dst. Reads go through
 * memcpy: an FP8 row's scales and rope values need not be aligned. */
static void key_row(const kdt_verify_attn_params *p, size_t row_bytes, int64_t slot, int32_t n, double *dst) {
    const unsigned char *row = (const unsigned char *)p->kv_cache + (size_t)slot * row_bytes;
    if (p->kv_format == KDT_KV_BF16) {
        for (int32_t d = 0; d < n; d++) {
            uint16_t h;
            memcpy(&h, row + 2 * (size_t)d, 2);
            dst[d] = kdt_bf16_to_f32(h);
        }
        return;
    }
    const int32_t dv = p->d_v;
    const unsigned char *scales = row + dv, *rope = scales + 4 * (dv / KDT_KV_FP8_GROUP);
    for (int32_t d = 0; d < n; d++) {
        if (d < dv) {
            float sc;
            memcpy(&sc, scales + 4 * (d / KDT_KV_FP8_GROUP), 4);
            dst[d] = (double)kdt_e4m3_to_f32(row[d]) * (double)sc; /* exact in double */
        } else {
            uint16_t h;
            memcpy(&h, rope + 2 * (size_t)(d - dv), 2);
            dst[d] = kdt_bf16_to_f32(h);
        }
    }
}

/* Per-stream checks (host-readable prefix_len, n_nodes, block_table). */
static kdt_status check_streams(const kdt_verify_attn_params *p, const char *who, int32_t *max_keys) {
    const int64_t slots = (int64_t)p->max_pages * p->page_size;
    *max_keys = 0;
    for (int32_t s = 0; s < p->n_streams; s++) {
        const int32_t n = p->n_nodes[s], prefix = p->prefix_len[s];
        KDT_CHECK_ARG(n >= 1 && n <= p->max_nodes, "%s: stream %d: n_nodes = %d, expected 1..max_nodes (%d)",
                      who, s, n, p->max_nodes);
        KDT_CHECK_ARG(prefix >= 0, "%s: stream %d: prefix_len = %d, expected >= 0", who, s, prefix);
        KDT_CHECK_ARG((int64_t)prefix + n <= slots,
                      "%s: stream %d: prefix_len + n_nodes = %lld exceeds max_pages * page_size = %lld",
                      who, s, (long long)prefix + n, (long long)slots);
        const int32_t keys = prefix + n;
        const int32_t pages_used = (int32_t)(((int64_t)keys + p->page_size - 1) / p->page_size);
        const int32_t *table = p->block_table + (int64_t)s * p->max_pages;
        for (int32_t k = 0; k < pages_used; k++)
            KDT_CHECK_ARG(table[k] >= 0 && table[k] < p->n_pages,
                          "%s: stream %d: block_table[%d] = %d, expected 0..n_pages-1 (%d)", who, s,
                          k, table[k], p->n_pages - 1);
        if (keys > *max_keys) *max_keys = keys;
    }
    return KDT_OK;
}

/* Round-to-nearest-even of a double to bf16, with one rounding (a double -> float -> bf16 chain
 * rounds twice, which is wrong when the float lands exactly on a bf16 halfway point). */
static uint16_t double_to_bf16(double d) {
    float f = (float)d;
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) < 0x7f800000u && (u & 0xffffu) == 0x8000u && (double)f != d) {
        /* f is a halfway point only because of the first rounding: |d| is above or below it. */
        const int above = fabs(d) > fabs((double)f);
        return (uint16_t)((u >> 16) + (above ? 1u : 0u));
    }
    return kdt_f32_to_bf16(f);
}

static double dot_double(const double *a, const double *b, int32_t n) {
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int32_t d = 0;
    for (; d + 4 <= n; d += 4) {
        s0 += a[d] * b[d];
        s1 += a[d + 1] * b[d + 1];
        s2 += a[d + 2] * b[d + 2];
        s3 += a[d + 3] * b[d + 3];
    }
    for (; d < n; d++) s0 += a[d] * b[d];
    return (s0 + s1) + (s2 + s3);
}

kdt_status kdt_verify_attn_cpu(const kdt_verify_attn_params *p) {
    const char *who = "kdt_verify_attn_cpu";
    kdt_status st = kdt_verify_attn_check_args(p, who);
    if (st != KDT_OK) return st;
    int32_t max_keys = 0;
    st = check_streams(p, who, &max_keys);
    if (st != KDT_OK) return st;

    const int32_t H = p->n_heads, dqk = p->d_qk, dv = p->d_v;
    const int32_t words = KDT_MASK_WORDS(p->max_nodes);
    const size_t row_bytes = kdt_kv_row_bytes(p->kv_format, dqk, dv);
    double *score = malloc(sizeof(double) * (size_t)ROW_GROUP * (size_t)max_keys); /* [G][T] */
    unsigned char *vis = malloc((size_t)ROW_GROUP * (size_t)max_keys);           /* [G][T] */
    double *qd = malloc(sizeof(double) * (size_t)ROW_GROUP * (size_t)dqk);        /* [G][d_qk] */
    double *acc = malloc(sizeof(double) * (size_t)ROW_GROUP * (size_t)dv);        /* [G][d_v] */
    double *krow = malloc(sizeof(double) * (size_t)dqk);                          /* [d_qk] */
    if (!score || !vis || !qd || !acc || !krow) {
        free(score), free(vis), free(qd), free(acc), free(krow);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: no memory for %d keys of scratch", who, max_keys);
    }
    const double scale = (double)p->softmax_scale;

    for (int32_t s = 0; s < p->n_streams; s++) {
        const int32_t n = p->n_nodes[s], prefix = p->prefix_len[s], keys = prefix + n;
        const int32_t *table = p->block_table + (int64_t)s * p->max_pages;
        const int64_t row0 = (int64_t)s * p->max_nodes * H; /* first (node, head) row of stream */
        for (int32_t g0 = 0; g0 < n * H; g0 += ROW_GROUP) {
            const int32_t G = (n * H - g0) < ROW_GROUP ? (n * H - g0) : ROW_GROUP;
            for (int32_t r = 0; r < G; r++) {
                const uint16_t *qrow = p->q + (row0 + g0 + r) * dqk;
                for (int32_t d = 0; d < dqk; d++) qd[(size_t)r * dqk + d] = kdt_bf16_to_f32(qrow[d]);
                const int32_t node = (g0 + r) / H;
                const uint64_t *mask = p->anc_mask + ((int64_t)s * p->max_nodes + node) * words;
                for (int32_t t = 0; t < keys; t++) {
                    const int32_t j = t - prefix;
                    vis[(size_t)r * keys + t] = (unsigned char)(t < prefix || ((mask[j >> 6] >> (j & 63)) & 1u));
                }
            }
            /* Pass 1: scores of visible keys. */
            for (int32_t t = 0; t < keys; t++) {
                int any = 0;
                for (int32_t r = 0; r < G; r++) any |= vis[(size_t)r * keys + t];
                if (!any) continue;
                const int64_t slot = (int64_t)table[t / p->page_size] * p->page_size + t % p->page_size;
                key_row(p, row_bytes, slot, dqk, krow);
                for (int32_t r = 0; r < G; r++)
                    if (vis[(size_t)r * keys + t])
                        score[(size_t)r * keys + t] = scale * dot_double(qd + (size_t)r * dqk, krow, dqk);
            }
            /* Softmax weights in place of the scores; row sums. */
            double row_max[ROW_GROUP], row_sum[ROW_GROUP];
            for (int32_t r = 0; r < G; r++) {
                double m = -INFINITY;
                for (int32_t t = 0; t < keys; t++)
                    if (vis[(size_t)r * keys + t] && score[(size_t)r * keys + t] > m) m = score[(size_t)r * keys + t];
                double sum = 0;
                for (int32_t t = 0; t < keys; t++)
                    if (vis[(size_t)r * keys + t]) {
                        const double w = exp(score[(size_t)r * keys + t] - m);
                        score[(size_t)r * keys + t] = w;
                        sum += w;
                    }
                row_max[r] = m;
                row_sum[r] = sum;
            }
            /* Pass 2: weighted sum of the value columns. */
            memset(acc, 0, sizeof(double) * (size_t)G * dv);
            for (int32_t t = 0; t < keys; t++) {
                int any = 0;
                for (int32_t r = 0; r < G; r++) any |= vis[(size_t)r * keys + t];
                if (!any) continue;
                const int64_t slot = (int64_t)table[t / p->page_size] * p->page_size + t % p->page_size;
                key_row(p, row_bytes, slot, dv, krow);
                for (int32_t r = 0; r < G; r++) {
                    if (!vis[(size_t)r * keys + t]) continue;
                    const double w = score[(size_t)r * keys + t];
                    double *a = acc + (size_t)r * dv;
                    for (int32_t d = 0; d < dv; d++) a[d] += w * krow[d];
                }
            }
            for (int32_t r = 0; r < G; r++) {
                uint16_t *o = p->out + (row0 + g0 + r) * dv;
                const double sum = row_sum[r];
                if (sum > 0) { /* also false for a NaN sum, handled below */
                    for (int32_t d = 0; d < dv; d++) o[d] = double_to_bf16(acc[(size_t)r * dv + d] / sum);
                    p->lse[row0 + g0 + r] = (float)(row_max[r] + log(sum));
                } else if (isnan(sum)) {
                    for (int32_t d = 0; d < dv; d++) o[d] = double_to_bf16(NAN);
                    p->lse[row0 + g0 + r] = NAN;
                } else { /* no visible key */
                    for (int32_t d = 0; d < dv; d++) o[d] = 0;
                    p->lse[row0 + g0 + r] = -INFINITY;
                }
            }
        }
    }
    free(score), free(vis), free(qd), free(acc), free(krow);
    return KDT_OK;
}
