/* fuzz_kernel_params.c - the plain-C kernel twins whose parameters carry caller-supplied indices:
 * verify_attn (block tables, prefix lengths, node counts, masks) and KV commit (block tables,
 * accepted paths), on small random shapes. Input byte 0 bit 0 picks the kernel; the rest fills
 * the parameters, sometimes out of range. Promises (include/kdtree/kernels.h):
 *   - verify_attn: an error with a message and no output written, or KDT_OK with every row
 *     i < n_nodes written (finite, or all-zero with lse -inf when no key is visible) and every
 *     other row untouched;
 *   - KV commit: each stream whose path and pages are valid moved as the header defines (row at
 *     prefix + accepted[k] -> prefix + k; checked against a copy moved by this oracle), every
 *     other stream untouched, and an error naming the first bad stream exactly when one is bad.
 * Physical pages are never shared between streams, so the in-place order cannot matter. */
#include <math.h>
#include <string.h>

#include "common/fp.h"
#include "fuzz.h"
#include "kdtree/kernels.h"

enum { S_MAX = 3, NODES_MAX = 8, PAGES_MAX = 12 };

static uint16_t small_bf16(fuzz_reader *r) { return kdt_f32_to_bf16((float)(fuzz_byte(r) - 128) / 32.0f); }

static void fuzz_verify_attn(fuzz_reader *r) {
    const int S = fuzz_pick(r, 1, S_MAX), H = fuzz_pick(r, 1, 9), max_nodes = fuzz_pick(r, 1, NODES_MAX);
    const int d_qk = fuzz_pick(r, 1, 24), d_v = fuzz_byte(r) < 240 ? fuzz_pick(r, 1, d_qk) : d_qk + 1;
    const int page_size = fuzz_pick(r, 1, 6), max_pages = fuzz_pick(r, 1, 4), n_pages = fuzz_pick(r, 1, PAGES_MAX);
    int32_t table[S_MAX * 4], prefix[S_MAX], n_nodes[S_MAX];
    for (int i = 0; i < S * max_pages; i++) table[i] = fuzz_byte(r) < 230 ? fuzz_pick(r, 0, n_pages - 1) : fuzz_pick(r, -2, n_pages + 1);
    for (int s = 0; s < S; s++) {
        n_nodes[s] = fuzz_byte(r) < 230 ? fuzz_pick(r, 1, max_nodes) : fuzz_pick(r, -1, max_nodes + 1);
        const int room = max_pages * page_size - n_nodes[s]; /* the prefix that still fits */
        prefix[s] = fuzz_byte(r) < 230 && room >= 0 ? fuzz_pick(r, 0, room) : fuzz_pick(r, -2, 40);
    }
    const size_t nq = (size_t)S * max_nodes * H * d_qk, nkv = (size_t)n_pages * page_size * d_qk;
    const size_t nout = (size_t)S * max_nodes * H * (d_v > 0 ? d_v : 1), nrows = (size_t)S * max_nodes * H;
    uint16_t *q = malloc(nq * 2), *kv = malloc(nkv * 2), *out = malloc(nout * 2);
    float *lse = malloc(nrows * sizeof *lse);
    uint64_t mask[S_MAX * NODES_MAX];
    if (!q || !kv || !out || !lse) FUZZ_FAIL("out of memory");
    for (size_t i = 0; i < nq; i++) q[i] = small_bf16(r);
    for (size_t i = 0; i < nkv; i++) kv[i] = small_bf16(r);
    for (int i = 0; i < S * max_nodes; i++) mask[i] = (uint64_t)fuzz_byte(r) | 1u; /* a row sees itself mostly */
    for (size_t i = 0; i < nout; i++) out[i] = 0x7fc1; /* poison: a NaN the kernel never writes */
    for (size_t i = 0; i < nrows; i++) lse[i] = 12345.0f;
    const kdt_verify_attn_params p = {
        .n_streams = S, .n_heads = H, .max_nodes = max_nodes, .d_qk = d_qk, .d_v = d_v,
        .softmax_scale = (float)fuzz_pick(r, 1, 40) / 16.0f, .q = q, .kv_cache = kv, .n_pages = n_pages,
        .page_size = page_size, .block_table = table, .max_pages = max_pages, .prefix_len = prefix,
        .n_nodes = n_nodes, .anc_mask = mask, .out = out, .lse = lse, .kv_format = KDT_KV_BF16};
    const kdt_status st = kdt_verify_attn_cpu(&p);
    if (st != KDT_OK) {
        FUZZ_CHECK(kdt_last_error()[0], "status %d without a message", (int)st);
        for (size_t i = 0; i < nout; i++) FUZZ_CHECK(out[i] == 0x7fc1, "refused, but out[%zu] was written", i);
        for (size_t i = 0; i < nrows; i++) FUZZ_CHECK(lse[i] == 12345.0f, "refused, but lse[%zu] was written", i);
        fuzz_note("verify_attn refused: %s", kdt_last_error());
        goto done;
    }
    for (int s = 0; s < S; s++)
        for (int i = 0; i < max_nodes; i++)
            for (int h = 0; h < H; h++) {
                const size_t row = ((size_t)s * max_nodes + i) * H + h;
                const uint16_t *o = out + row * d_v;
                if (i >= n_nodes[s]) {
                    FUZZ_CHECK(lse[row] == 12345.0f, "stream %d node %d >= n_nodes written", s, i);
                    for (int d = 0; d < d_v; d++) FUZZ_CHECK(o[d] == 0x7fc1, "stream %d node %d >= n_nodes written", s, i);
                    continue;
                }
                FUZZ_CHECK(isfinite(lse[row]) || lse[row] == -INFINITY, "stream %d node %d head %d: lse %g", s, i, h,
                           lse[row]);
                for (int d = 0; d < d_v; d++) {
                    const float v = kdt_bf16_to_f32(o[d]);
                    FUZZ_CHECK(isfinite(v) && (lse[row] != -INFINITY || v == 0), "stream %d node %d head %d: out %g",
                               s, i, h, v);
                }
            }
    fuzz_note("verify_attn: %d streams, %d heads, d_qk %d", S, H, d_qk);
done:
    free(q), free(kv), free(out), free(lse);
}

static void fuzz_kv_commit(fuzz_reader *r) {
    const int S = fuzz_pick(r, 1, S_MAX), layers = fuzz_pick(r, 1, 3), row_bytes = 2 * fuzz_pick(r, 1, 4);
    const int page_size = fuzz_pick(r, 1, 5), max_pages = fuzz_pick(r, 1, 4);
    const int n_pages = S * max_pages + fuzz_pick(r, 0, 2);
    int32_t table[S_MAX * 4], prefix[S_MAX], tau[S_MAX], acc[S_MAX * KDT_MAX_PATH];
    for (int i = 0; i < S * max_pages; i++) /* distinct physical pages (7 is prime to S * max_pages <= 12); sometimes an id out of range */
        table[i] = fuzz_byte(r) < 240 ? (i * 7 + 3) % (S * max_pages) : (fuzz_byte(r) & 1 ? -1 - (fuzz_byte(r) & 1) : n_pages + (fuzz_byte(r) & 1));
    const int slots = max_pages * page_size;
    for (int s = 0; s < S; s++) {
        prefix[s] = fuzz_byte(r) < 240 ? fuzz_pick(r, 0, slots / 2) : fuzz_pick(r, -2, slots + 2);
        tau[s] = fuzz_byte(r) < 245 ? fuzz_pick(r, 0, 6) : fuzz_pick(r, -1, KDT_MAX_PATH + 1);
        /* mostly an increasing path from the root, often 0, 1, 2, ... at first; sometimes not */
        acc[s * KDT_MAX_PATH] = fuzz_byte(r) < 250 ? 0 : 1;
        for (int k = 1, a = 0; k < KDT_MAX_PATH; k++) {
            a += 1 + (fuzz_byte(r) < 128 ? 0 : fuzz_pick(r, 1, 3));
            acc[s * KDT_MAX_PATH + k] = fuzz_byte(r) < 245 ? a : fuzz_pick(r, -1, 8);
        }
    }
    const int64_t layer_stride = (int64_t)n_pages * page_size * row_bytes + 2 * fuzz_pick(r, 0, 3);
    const size_t bytes = (size_t)(layer_stride * layers);
    unsigned char *cache = malloc(bytes), *want = malloc(bytes);
    if (!cache || !want) FUZZ_FAIL("out of memory");
    for (size_t i = 0; i < bytes; i++) cache[i] = (unsigned char)(i * 131 + (i >> 8));
    memcpy(want, cache, bytes);
    /* the oracle: per stream, validity as the header and the error text define it, then the moves */
    int n_bad = 0;
    for (int s = 0; s < S; s++) {
        const int t = tau[s], *a = acc + s * KDT_MAX_PATH;
        if (t == 0) continue;
        int ok = t >= 0 && t <= KDT_MAX_PATH && a[0] == 0 && prefix[s] >= 0;
        for (int k = 1; ok && k < t; k++) ok = a[k] > a[k - 1];
        int first = 0;
        while (ok && first < t && a[first] == first) first++;
        for (int k = first; ok && k < t; k++) {
            const int from = prefix[s] + a[k], to = prefix[s] + k;
            ok = from < slots;
            if (ok) {
                const int pf = table[s * max_pages + from / page_size], pt = table[s * max_pages + to / page_size];
                ok = pf >= 0 && pf < n_pages && pt >= 0 && pt < n_pages;
            }
        }
        if (!ok) { n_bad++; continue; }
        for (int l = 0; l < layers; l++)
            for (int k = first; k < t; k++) {
                const int from = prefix[s] + a[k], to = prefix[s] + k;
                const int pf = table[s * max_pages + from / page_size], pt = table[s * max_pages + to / page_size];
                memcpy(want + l * layer_stride + ((int64_t)pt * page_size + to % page_size) * row_bytes,
                       cache + l * layer_stride + ((int64_t)pf * page_size + from % page_size) * row_bytes,
                       (size_t)row_bytes);
            }
    }
    for (int s = 0; s < S; s++) {
        char line[256];
        int at = snprintf(line, sizeof line, "stream %d: prefix %d tau %d pages", s, (int)prefix[s], (int)tau[s]);
        for (int i = 0; i < max_pages; i++) at += snprintf(line + at, sizeof line - at, " %d", (int)table[s * max_pages + i]);
        at += snprintf(line + at, sizeof line - at, " path");
        for (int k = 0; k < tau[s] && k < 8; k++) at += snprintf(line + at, sizeof line - at, " %d", (int)acc[s * KDT_MAX_PATH + k]);
        fuzz_note("%s (page size %d, %d pages)", line, page_size, n_pages);
    }
    const kdt_kv_commit_params p = {S, layers, row_bytes, page_size, n_pages, cache, layer_stride,
                                    table, max_pages, prefix, acc, tau};
    const kdt_status st = kdt_kv_commit_cpu(&p);
    FUZZ_CHECK((st == KDT_OK) == (n_bad == 0), "status %d with %d bad streams: %s", (int)st, n_bad,
               st == KDT_OK ? "" : kdt_last_error());
    FUZZ_CHECK(memcmp(cache, want, bytes) == 0, "the cache differs from the oracle's (%d bad streams)", n_bad);
    fuzz_note("kv_commit: %d streams, %d bad", S, n_bad);
    free(cache);
    free(want);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    fuzz_reader r = {data, size, 1};
    if (data[0] & 1) fuzz_kv_commit(&r);
    else fuzz_verify_attn(&r);
    return 0;
}
