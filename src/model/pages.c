/* pages.c - the host bookkeeping of a paged KV cache, shared by the CPU cache (kv_cache.c) and
 * the GPU cache (cuda/gpu_kv.c): per stream a block table of pages, a free list, the committed and
 * written lengths. The rules (model_internal.h, kdt_pages): reservations are all-or-nothing, pages
 * are handed out in increasing id order after a reset, a stream shrinks to the pages its committed
 * length needs. */
#include "model_internal.h"

#include <string.h>

void kdt_pages_reset(const kdt_pages *p) {
    for (int64_t i = 0; i < (int64_t)p->max_streams * p->max_pages; i++) p->block_table[i] = -1;
    memset(p->n_stream_pages, 0, (size_t)p->max_streams * sizeof(int32_t));
    memset(p->length, 0, (size_t)p->max_streams * sizeof(int32_t));
    memset(p->written, 0, (size_t)p->max_streams * sizeof(int32_t));
    *p->n_free = p->n_pages;
    for (int32_t i = 0; i < p->n_pages; i++) p->free_list[i] = p->n_pages - 1 - i;
}

static int64_t pages_for(const kdt_pages *p, int32_t slots) {
    return ((int64_t)slots + p->page_size - 1) / p->page_size;
}

kdt_status kdt_pages_count_new(const kdt_pages *p, int32_t n, const int32_t *streams, const int32_t *need,
                               int64_t *total) {
    int64_t t = 0;
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = streams[i];
        const int64_t pages = pages_for(p, need[i]);
        if (pages > p->max_pages)
            return kdt_fail(KDT_ERR_CAPACITY,
                            "%s: stream %d needs %d slots, more than its block table holds (%d pages of %d)",
                            p->who, s, need[i], p->max_pages, p->page_size);
        if (pages > p->n_stream_pages[s]) t += pages - p->n_stream_pages[s];
    }
    if (t > *p->n_free)
        return kdt_fail(KDT_ERR_CAPACITY, "%s exhausted: %lld more pages needed, %d free of %d", p->who,
                        (long long)t, *p->n_free, p->n_pages);
    *total = t;
    return KDT_OK;
}

void kdt_pages_assign(const kdt_pages *p, int32_t n, const int32_t *streams, const int32_t *need,
                      void (*on_page)(void *user, int32_t index, int32_t page), void *user) {
    for (int32_t i = 0; i < n; i++) {
        const int32_t s = streams[i];
        const int64_t pages = pages_for(p, need[i]);
        while (p->n_stream_pages[s] < pages) {
            const int64_t idx = (int64_t)s * p->max_pages + p->n_stream_pages[s]++;
            p->block_table[idx] = p->free_list[--*p->n_free];
            if (on_page) on_page(user, (int32_t)idx, p->block_table[idx]);
        }
    }
}

void kdt_pages_release_from(const kdt_pages *p, int32_t s, int32_t keep_pages) {
    while (p->n_stream_pages[s] > keep_pages) {
        const int64_t idx = (int64_t)s * p->max_pages + --p->n_stream_pages[s];
        p->free_list[(*p->n_free)++] = p->block_table[idx];
        p->block_table[idx] = -1;
    }
}

kdt_status kdt_pages_release(const kdt_pages *p, const char *fn, int32_t stream) {
    KDT_CHECK_ARG(stream >= 0 && stream < p->max_streams, "%s: stream %d (0..%d)", fn, stream, p->max_streams - 1);
    kdt_pages_release_from(p, stream, 0);
    p->length[stream] = 0;
    p->written[stream] = 0;
    return KDT_OK;
}

kdt_status kdt_pages_set_length(const kdt_pages *p, const char *fn, int32_t stream, int32_t len) {
    KDT_CHECK_ARG(stream >= 0 && stream < p->max_streams, "%s: stream %d (0..%d)", fn, stream, p->max_streams - 1);
    KDT_CHECK_ARG(len >= 0 && len <= p->written[stream], "%s: stream %d: length %d but only %d slots were written",
                  fn, stream, len, p->written[stream]);
    p->length[stream] = len;
    p->written[stream] = len; /* rows beyond len (tree leftovers) are no longer valid */
    kdt_pages_release_from(p, stream, (int32_t)pages_for(p, len));
    return KDT_OK;
}
