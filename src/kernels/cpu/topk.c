/* topk.c - CPU reference of the log-softmax + top-K kernel (kdt_topk_logsoftmax_cpu).
 *
 * Value policy, shared with cuda/topk.cu (both sides apply it before anything else):
 *   NaN  -> -inf   (a NaN logit never outranks a number and adds nothing to the sum);
 *   +inf -> FLT_MAX (so a row holding +inf still has a finite log-sum-exp; it ties with FLT_MAX).
 * Order: descending value, equal values (as order keys, -0 == +0) by ascending token id. That is
 * the descending order of the 64-bit key (order_key(value) << 32) | (0xffffffff - id), which the
 * GPU selects with.
 * Log-probs: lse = max + log(sum exp(x - max)) in double, rounded to fp32 once; then
 * top_logp = x - lse in fp32, and -inf for a -inf value (so an all -inf row gives -inf, not NaN).
 */
#include "common.h"
#include "fp.h"
#include "kdtree/kernels.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Checks shared by both launchers (declared in cuda/topk.cu). */
kdt_status kdt_topk_check_args(const kdt_topk_params *p, const char *who);

kdt_status kdt_topk_check_args(const kdt_topk_params *p, const char *who) {
    KDT_CHECK_ARG(p != NULL, "%s: params is NULL", who);
    KDT_CHECK_ARG(p->n_rows >= 1, "%s: n_rows = %d, expected >= 1", who, p->n_rows);
    KDT_CHECK_ARG(p->vocab >= 1 && p->vocab <= KDT_MAX_VOCAB, "%s: vocab = %d, expected 1..%d",
                  who, p->vocab, KDT_MAX_VOCAB);
    const int32_t k_max = p->vocab < KDT_MAX_TOPK ? p->vocab : KDT_MAX_TOPK;
    KDT_CHECK_ARG(p->k >= 1 && p->k <= k_max, "%s: k = %d, expected 1..min(vocab, %d) = %d", who,
                  p->k, KDT_MAX_TOPK, k_max);
    KDT_CHECK_ARG(p->dtype == KDT_F32 || p->dtype == KDT_BF16,
                  "%s: dtype = %d, expected KDT_F32 or KDT_BF16", who, (int)p->dtype);
    KDT_CHECK_ARG(p->row_stride >= p->vocab, "%s: row_stride = %lld, expected >= vocab = %d", who,
                  (long long)p->row_stride, p->vocab);
    KDT_CHECK_ARG(p->row_stride <= INT64_MAX / 8 / p->n_rows,
                  "%s: row_stride = %lld is too large for n_rows = %d", who,
                  (long long)p->row_stride, p->n_rows);
    KDT_CHECK_ARG(p->logits != NULL, "%s: logits is NULL", who);
    KDT_CHECK_ARG(p->top_ids != NULL, "%s: top_ids is NULL", who);
    KDT_CHECK_ARG(p->top_logp != NULL, "%s: top_logp is NULL", who);
    const size_t elem = p->dtype == KDT_BF16 ? 2 : 4;
    KDT_CHECK_ARG((uintptr_t)p->logits % elem == 0,
                  "%s: logits pointer is not aligned to its %zu-byte element", who, elem);
    return KDT_OK;
}

/* Applies the value policy above. */
static inline float sanitize(float v) {
    if (isnan(v)) return -INFINITY;
    if (v == INFINITY) return FLT_MAX;
    return v;
}

static inline uint64_t sort_key(float v, int32_t id) {
    return ((uint64_t)kdt_f32_order_key(v) << 32) | (uint32_t)(0xffffffffu - (uint32_t)id);
}

/* Min-heap on key, heap[0] the smallest of the K kept so far. */
static void sift_down(uint64_t *heap, int32_t n, int32_t i) {
    uint64_t v = heap[i];
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap[c + 1] < heap[c]) c++;
        if (heap[c] >= v) break;
        heap[i] = heap[c];
        i = c;
    }
    heap[i] = v;
}

static int cmp_desc_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

kdt_status kdt_topk_logsoftmax_cpu(const kdt_topk_params *p) {
    kdt_status st = kdt_topk_check_args(p, "kdt_topk_logsoftmax_cpu");
    if (st != KDT_OK) return st;
    const int32_t V = p->vocab, K = p->k;
    float *row = (float *)malloc(sizeof(float) * (size_t)V);   /* [V] sanitized values */
    uint64_t *heap = (uint64_t *)malloc(sizeof(uint64_t) * (size_t)K); /* [K] */
    if (!row || !heap) {
        free(row);
        free(heap);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_topk_logsoftmax_cpu: %d-element row buffer", V);
    }
    for (int32_t r = 0; r < p->n_rows; r++) {
        const int64_t off = (int64_t)r * p->row_stride;
        if (p->dtype == KDT_BF16) {
            const uint16_t *src = (const uint16_t *)p->logits + off;
            for (int32_t i = 0; i < V; i++) row[i] = sanitize(kdt_bf16_to_f32(src[i]));
        } else {
            const float *src = (const float *)p->logits + off;
            for (int32_t i = 0; i < V; i++) row[i] = sanitize(src[i]);
        }
        /* log-sum-exp in double */
        double mx = -INFINITY;
        for (int32_t i = 0; i < V; i++) mx = row[i] > mx ? row[i] : mx;
        double lse = -INFINITY;
        if (mx != -INFINITY) {
            double sum = 0;
            for (int32_t i = 0; i < V; i++) sum += exp((double)row[i] - mx);
            lse = mx + log(sum);
        }
        const float lse32 = (float)lse;
        /* top-K by a K-element min-heap of sort keys */
        for (int32_t i = 0; i < K; i++) heap[i] = sort_key(row[i], i);
        for (int32_t i = K / 2 - 1; i >= 0; i--) sift_down(heap, K, i);
        for (int32_t i = K; i < V; i++) {
            uint64_t key = sort_key(row[i], i);
            if (key > heap[0]) {
                heap[0] = key;
                sift_down(heap, K, 0);
            }
        }
        qsort(heap, (size_t)K, sizeof(uint64_t), cmp_desc_u64);
        int32_t *ids = p->top_ids + (int64_t)r * K;
        float *logp = p->top_logp + (int64_t)r * K;
        for (int32_t j = 0; j < K; j++) {
            int32_t id = (int32_t)(0xffffffffu - (uint32_t)heap[j]);
            float v = row[id];
            ids[j] = id;
            logp[j] = v == -INFINITY ? -INFINITY : v - lse32;
        }
    }
    free(row);
    free(heap);
    return KDT_OK;
}
