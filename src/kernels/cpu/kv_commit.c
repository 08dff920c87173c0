/* kv_commit.c - CPU reference of the KV commit (cache compaction after acceptance), and the
 * argument check shared with the CUDA launcher.
 *
 * For stream s with tau = tau[s], path a = accepted[s][0..tau), prefix P = prefix_len[s]: every
 * layer's row at slot P + a[k] moves to slot P + k. The path starts at the root (a[0] = 0) and
 * increases strictly, so a[k] >= k; rows k < k0 (k0 = first k with a[k] != k) are already in
 * place and untouched, and a stream with k0 == tau (path 0, 1, ..., tau-1) is skipped.
 * In-place order: per (stream, layer) the moved rows go in batches of KV_COMMIT_BATCH rows in
 * increasing k; all source rows of a batch are read before any row of the batch is written.
 * That is safe: destination slot P + k is the source of row k' only if a[k'] = k, hence k' < k
 * (a[k'] >= k', and a[k'] != k' for a moved row), i.e. of an earlier row - in the same batch
 * (read first) or an earlier batch (already done). A naive parallel copy of path [0, 2, 3]
 * would instead read slot P+2 after it was overwritten. The CUDA kernel uses the same batches,
 * so both agree byte for byte even when a block table maps two slots of one stream to the same
 * row. Slots of different streams that are written must not share pages (the GPU runs streams
 * in parallel).
 *
 * Per-stream checks (a failing stream is never touched; the CUDA kernel skips it silently, this
 * twin moves every other stream and then returns KDT_ERR_INVALID_ARG naming the first bad one):
 *   tau in 0..KDT_MAX_PATH; a[0] == 0 and a strictly increasing; prefix_len >= 0; for the moved
 *   rows, slot P + a[k] < max_pages * page_size and the page ids of source and destination
 *   slots in 0..n_pages-1.
 */
#include "common.h"
#include "kdtree/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KV_COMMIT_BATCH 8 /* rows per read-then-write batch; the same in cuda/kv_commit.cu */

/* Shared with the CUDA launcher (declared there). */
kdt_status kdt_kv_commit_check_args(const kdt_kv_commit_params *p, const char *who);

kdt_status kdt_kv_commit_check_args(const kdt_kv_commit_params *p, const char *who) {
    KDT_CHECK_ARG(p != NULL, "%s: params is NULL", who);
    KDT_CHECK_ARG(p->n_streams >= 1 && p->n_streams <= KDT_MAX_STREAMS,
                  "%s: n_streams = %d, expected 1..%d", who, p->n_streams, KDT_MAX_STREAMS);
    KDT_CHECK_ARG(p->n_layers >= 1, "%s: n_layers = %d, expected >= 1", who, p->n_layers);
    KDT_CHECK_ARG(p->row_bytes >= 2 && p->row_bytes % 2 == 0,
                  "%s: row_bytes = %d, expected a positive even number", who, p->row_bytes);
    KDT_CHECK_ARG(p->page_size >= 1, "%s: page_size = %d, expected >= 1", who, p->page_size);
    KDT_CHECK_ARG(p->n_pages >= 1, "%s: n_pages = %d, expected >= 1", who, p->n_pages);
    KDT_CHECK_ARG(p->max_pages >= 1, "%s: max_pages = %d, expected >= 1", who, p->max_pages);
    KDT_CHECK_ARG(p->cache != NULL, "%s: cache is NULL", who);
    KDT_CHECK_ARG(p->block_table != NULL, "%s: block_table is NULL", who);
    KDT_CHECK_ARG(p->prefix_len != NULL, "%s: prefix_len is NULL", who);
    KDT_CHECK_ARG(p->accepted != NULL, "%s: accepted is NULL", who);
    KDT_CHECK_ARG(p->tau != NULL, "%s: tau is NULL", who);
    const int64_t page_bytes = (int64_t)p->page_size * p->row_bytes; /* < 2^62 */
    KDT_CHECK_ARG(p->n_pages <= INT64_MAX / page_bytes,
                  "%s: n_pages * page_size * row_bytes overflows int64", who);
    const int64_t layer_bytes = (int64_t)p->n_pages * page_bytes;
    KDT_CHECK_ARG(p->layer_stride_bytes >= layer_bytes,
                  "%s: layer_stride_bytes = %lld < n_pages * page_size * row_bytes = %lld", who,
                  (long long)p->layer_stride_bytes, (long long)layer_bytes);
    KDT_CHECK_ARG(p->n_layers == 1 ||
                      p->layer_stride_bytes <= (INT64_MAX - layer_bytes) / (p->n_layers - 1),
                  "%s: n_layers * layer_stride_bytes overflows int64", who);
    return KDT_OK;
}

/* Plans stream s: on success *k0 .. *tau_out are the moved rows (k0 == tau: nothing to move)
 * and src/dst hold their byte offsets inside a layer. Returns 0, or 1 with msg filled. */
static int plan_stream(const kdt_kv_commit_params *p, int32_t s, int32_t *k0, int32_t *tau_out,
                       int64_t src[KDT_MAX_PATH], int64_t dst[KDT_MAX_PATH], char *msg,
                       size_t msg_size) {
    const int32_t tau = p->tau[s];
    const int32_t *a = p->accepted + (int64_t)s * KDT_MAX_PATH;
    *k0 = *tau_out = 0;
    if (tau < 0 || tau > KDT_MAX_PATH) {
        snprintf(msg, msg_size, "stream %d: tau = %d, expected 0..%d", s, tau, KDT_MAX_PATH);
        return 1;
    }
    if (tau == 0) return 0;
    if (a[0] != 0) {
        snprintf(msg, msg_size, "stream %d: accepted[0] = %d, expected 0 (the root)", s, a[0]);
        return 1;
    }
    for (int32_t k = 1; k < tau; k++)
        if (a[k] <= a[k - 1]) {
            snprintf(msg, msg_size, "stream %d: accepted[%d] = %d after %d, must increase", s, k,
                     a[k], a[k - 1]);
            return 1;
        }
    const int64_t prefix = p->prefix_len[s];
    if (prefix < 0) {
        snprintf(msg, msg_size, "stream %d: prefix_len = %lld, expected >= 0", s,
                 (long long)prefix);
        return 1;
    }
    int32_t first = 0;
    while (first < tau && a[first] == first) first++;
    const int64_t n_slots = (int64_t)p->max_pages * p->page_size;
    const int32_t *table = p->block_table + (int64_t)s * p->max_pages;
    for (int32_t k = first; k < tau; k++) {
        const int64_t from = prefix + a[k], to = prefix + k; /* to < from */
        if (from >= n_slots) {
            snprintf(msg, msg_size,
                     "stream %d: slot prefix_len + accepted[%d] = %lld outside the block table "
                     "(%lld slots)", s, k, (long long)from, (long long)n_slots);
            return 1;
        }
        const int32_t page_from = table[from / p->page_size], page_to = table[to / p->page_size];
        if (page_from < 0 || page_from >= p->n_pages || page_to < 0 || page_to >= p->n_pages) {
            snprintf(msg, msg_size, "stream %d: block_table page id %d outside 0..%d", s,
                     (page_from < 0 || page_from >= p->n_pages) ? page_from : page_to,
                     p->n_pages - 1);
            return 1;
        }
        src[k] = ((int64_t)page_from * p->page_size + from % p->page_size) * p->row_bytes;
        dst[k] = ((int64_t)page_to * p->page_size + to % p->page_size) * p->row_bytes;
    }
    *k0 = first;
    *tau_out = tau;
    return 0;
}

kdt_status kdt_kv_commit_cpu(const kdt_kv_commit_params *p) {
    kdt_status st = kdt_kv_commit_check_args(p, "kdt_kv_commit_cpu");
    if (st != KDT_OK) return st;
    const size_t row = (size_t)p->row_bytes;
    unsigned char *staged = (unsigned char *)malloc(row * KV_COMMIT_BATCH); /* [batch][row] */
    if (!staged)
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_kv_commit_cpu: %zu B of staging",
                        row * KV_COMMIT_BATCH);
    char first_msg[256] = "";
    int32_t n_bad = 0;
    for (int32_t s = 0; s < p->n_streams; s++) {
        int64_t src[KDT_MAX_PATH], dst[KDT_MAX_PATH];
        int32_t k0, tau;
        char msg[256];
        if (plan_stream(p, s, &k0, &tau, src, dst, msg, sizeof msg)) {
            if (n_bad++ == 0) snprintf(first_msg, sizeof first_msg, "%s", msg);
            continue;
        }
        for (int32_t l = 0; l < p->n_layers; l++) {
            unsigned char *layer = (unsigned char *)p->cache + (int64_t)l * p->layer_stride_bytes;
            for (int32_t kb = k0; kb < tau; kb += KV_COMMIT_BATCH) {
                const int32_t ke = kb + KV_COMMIT_BATCH < tau ? kb + KV_COMMIT_BATCH : tau;
                for (int32_t k = kb; k < ke; k++) memcpy(staged + (size_t)(k - kb) * row, layer + src[k], row);
                for (int32_t k = kb; k < ke; k++) memcpy(layer + dst[k], staged + (size_t)(k - kb) * row, row);
            }
        }
    }
    free(staged);
    if (n_bad)
        return kdt_fail(KDT_ERR_INVALID_ARG,
                        "kdt_kv_commit_cpu: %s (%d bad streams left untouched, the others moved)",
                        first_msg, n_bad);
    return KDT_OK;
}
