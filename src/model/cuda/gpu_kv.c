/* gpu_kv.c - the paged latent KV cache on the GPU (kdt_gpu_kv): a bf16 page pool
 * [n_layers][n_pages][64][row_stride] in device memory, block tables on the device with a host
 * mirror, and the host-side page bookkeeping (free list, per-stream pages, committed and written
 * lengths) through pages.c, the CPU cache's rules. Page assignments are recorded in a pending list
 * and reach the device with the next staged forward pass (or synchronously, see
 * kdt_gkv_flush_pending_sync), so a captured forward never waits on the host. */
#include "gpu_internal.h"
#include "model/model_internal.h"

#include <stdlib.h>
#include <string.h>

static kdt_status cuda_fail(cudaError_t e, const char *what) {
    return kdt_fail(KDT_ERR_CUDA, "%s: %s", what, cudaGetErrorString(e));
}

kdt_status kdt_gpu_kv_create(const kdt_gpu_model *g, const kdt_kv_cache_options *opt, kdt_gpu_kv **out) {
    KDT_CHECK_ARG(out, "kdt_gpu_kv_create: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(g && opt, "kdt_gpu_kv_create: model or options is NULL");
    const kdt_model_config *c = &g->cfg;
    KDT_CHECK_ARG(opt->n_pages >= 1 && opt->n_pages <= (1 << 26), "kdt_gpu_kv_create: n_pages = %d", opt->n_pages);
    KDT_CHECK_ARG(opt->max_streams >= 1 && opt->max_streams <= KDT_MAX_STREAMS,
                  "kdt_gpu_kv_create: max_streams = %d (1..%d)", opt->max_streams, KDT_MAX_STREAMS);
    int32_t max_pages = opt->max_pages_per_stream;
    if (max_pages == 0) max_pages = (c->max_position_embeddings + KDT_KV_PAGE_SIZE - 1) / KDT_KV_PAGE_SIZE;
    KDT_CHECK_ARG(max_pages >= 1 && max_pages <= (1 << 24), "kdt_gpu_kv_create: max_pages_per_stream = %d",
                  opt->max_pages_per_stream);
    kdt_gpu_kv *k = calloc(1, sizeof *k);
    if (!k) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_kv_create");
    k->device = g->device;
    k->n_layers = c->n_layers;
    k->n_pages = opt->n_pages;
    k->page_size = KDT_KV_PAGE_SIZE;
    k->row_elems = c->kv_lora_rank + c->qk_rope_head_dim;
    k->row_stride = g->kv_row_stride;
    k->max_streams = opt->max_streams;
    k->max_pages = max_pages;
    k->max_position = c->max_position_embeddings;
    k->layer_stride = (int64_t)k->n_pages * k->page_size * k->row_stride;
    const size_t cache_bytes = (size_t)k->layer_stride * (size_t)k->n_layers * 2;
    const size_t table_n = (size_t)opt->max_streams * (size_t)max_pages;
    kdt_status st = KDT_OK;
    cudaError_t e = cudaSetDevice(g->device);
    if (e == cudaSuccess) e = cudaMalloc((void **)&k->cache, cache_bytes);
    if (e != cudaSuccess) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_kv_create: %zu MB of GPU KV cache: %s", cache_bytes >> 20,
                      cudaGetErrorString(e));
        goto fail;
    }
    /* NaN poison (bf16 0xffff): a read of a never-written row shows up in any result */
    if ((e = cudaMemset(k->cache, 0xff, cache_bytes)) != cudaSuccess ||
        (e = cudaMalloc((void **)&k->d_block_table, table_n * sizeof(int32_t))) != cudaSuccess ||
        (e = cudaMemset(k->d_block_table, 0xff, table_n * sizeof(int32_t))) != cudaSuccess) {
        st = cuda_fail(e, "kdt_gpu_kv_create");
        goto fail;
    }
    /* the memsets run on the legacy stream; the forward runs on non-blocking streams */
    if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
        st = cuda_fail(e, "kdt_gpu_kv_create");
        goto fail;
    }
    k->block_table = malloc(table_n * sizeof(int32_t));
    k->n_stream_pages = calloc((size_t)opt->max_streams, sizeof(int32_t));
    k->length = calloc((size_t)opt->max_streams, sizeof(int32_t));
    k->written = calloc((size_t)opt->max_streams, sizeof(int32_t));
    k->free_list = malloc((size_t)opt->n_pages * sizeof(int32_t));
    k->cap_pending = 256;
    k->pending = malloc((size_t)k->cap_pending * 2 * sizeof(int32_t));
    if (!k->block_table || !k->n_stream_pages || !k->length || !k->written || !k->free_list || !k->pending) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_kv_create");
        goto fail;
    }
    kdt_gpu_kv_reset(k);
    *out = k;
    return KDT_OK;
fail:
    kdt_gpu_kv_free(k);
    return st;
}

void kdt_gpu_kv_free(kdt_gpu_kv *k) {
    if (!k) return;
    cudaFree(k->cache);
    cudaFree(k->d_block_table);
    free(k->block_table);
    free(k->n_stream_pages);
    free(k->length);
    free(k->written);
    free(k->free_list);
    free(k->pending);
    free(k);
}

static kdt_pages pages_of(kdt_gpu_kv *k) {
    kdt_pages p = {"GPU KV cache", k->max_streams, k->max_pages, k->n_pages, k->page_size, k->block_table,
                   k->n_stream_pages, k->length, k->written, k->free_list, &k->n_free};
    return p;
}

kdt_status kdt_gpu_kv_reset(kdt_gpu_kv *k) {
    KDT_CHECK_ARG(k, "kdt_gpu_kv_reset: cache is NULL");
    const kdt_pages p = pages_of(k);
    kdt_pages_reset(&p);
    k->n_pending = 0; /* stale device entries are never read: only reserved slots are */
    return KDT_OK;
}

/* kdt_pages_assign's callback: the new block-table entry goes to the pending list (room for it was
 * made before the assignment, so this cannot fail). */
static void push_pending(void *user, int32_t index, int32_t page) {
    kdt_gpu_kv *k = user;
    k->pending[2 * k->n_pending] = index;
    k->pending[2 * k->n_pending + 1] = page;
    k->n_pending++;
}

kdt_status kdt_gkv_reserve_many(kdt_gpu_kv *k, int32_t n, const int32_t *streams, const int32_t *need) {
    const kdt_pages p = pages_of(k);
    int64_t total = 0;
    KDT_TRY(kdt_pages_count_new(&p, n, streams, need, &total));
    /* room in the pending list first, so the reservation below cannot fail half-way */
    while (k->n_pending + total > k->cap_pending) {
        int32_t *q = realloc(k->pending, (size_t)k->cap_pending * 4 * sizeof(int32_t));
        if (!q) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU KV cache: page list");
        k->pending = q;
        k->cap_pending *= 2;
    }
    kdt_pages_assign(&p, n, streams, need, push_pending, k);
    return KDT_OK;
}

kdt_status kdt_gkv_flush_pending_sync(kdt_gpu_kv *k) {
    for (int64_t i = 0; i < k->n_pending; i++) {
        const cudaError_t e = cudaMemcpy(k->d_block_table + k->pending[2 * i], &k->pending[2 * i + 1],
                                         sizeof(int32_t), cudaMemcpyHostToDevice);
        if (e != cudaSuccess) return cuda_fail(e, "GPU KV cache: block-table update");
    }
    k->n_pending = 0;
    /* a pageable cudaMemcpy may return before the data lands; later work runs on other streams */
    const cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "GPU KV cache: block-table update");
}

kdt_status kdt_gpu_kv_stream_reserve(kdt_gpu_kv *k, int32_t stream, int32_t n_slots) {
    KDT_CHECK_ARG(k, "kdt_gpu_kv_stream_reserve: cache is NULL");
    KDT_CHECK_ARG(stream >= 0 && stream < k->max_streams, "kdt_gpu_kv_stream_reserve: stream %d (0..%d)", stream,
                  k->max_streams - 1);
    KDT_CHECK_ARG(n_slots >= 0, "kdt_gpu_kv_stream_reserve: n_slots = %d", n_slots);
    return kdt_gkv_reserve_many(k, 1, &stream, &n_slots);
}

kdt_status kdt_gpu_kv_stream_release(kdt_gpu_kv *k, int32_t stream) {
    KDT_CHECK_ARG(k, "kdt_gpu_kv_stream_release: cache is NULL");
    const kdt_pages p = pages_of(k);
    return kdt_pages_release(&p, "kdt_gpu_kv_stream_release", stream);
}

int32_t kdt_gpu_kv_stream_length(const kdt_gpu_kv *k, int32_t stream) {
    if (!k || stream < 0 || stream >= k->max_streams) return -1;
    return k->length[stream];
}

kdt_status kdt_gpu_kv_stream_set_length(kdt_gpu_kv *k, int32_t stream, int32_t len) {
    KDT_CHECK_ARG(k, "kdt_gpu_kv_stream_set_length: cache is NULL");
    const kdt_pages p = pages_of(k);
    return kdt_pages_set_length(&p, "kdt_gpu_kv_stream_set_length", stream, len);
}

int32_t kdt_gpu_kv_free_pages(const kdt_gpu_kv *k) { return k ? k->n_free : 0; }

kdt_status kdt_gpu_kv_layout(kdt_gpu_kv *k, kdt_kv_layout *out) {
    KDT_CHECK_ARG(k && out, "kdt_gpu_kv_layout: NULL argument");
    /* staged block-table updates still queued on some stream must land before these */
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) return cuda_fail(e, "kdt_gpu_kv_layout");
    kdt_status st = kdt_gkv_flush_pending_sync(k);
    if (st != KDT_OK) return st;
    out->cache = k->cache;
    out->dtype = KDT_BF16;
    out->n_layers = k->n_layers;
    out->n_pages = k->n_pages;
    out->page_size = k->page_size;
    out->row_elems = k->row_elems;
    out->row_bytes = k->row_stride * 2;
    out->layer_stride_bytes = k->layer_stride * 2;
    out->block_table = k->d_block_table;
    out->max_streams = k->max_streams;
    out->max_pages = k->max_pages;
    return KDT_OK;
}

kdt_status kdt_gpu_kv_read_row(kdt_gpu_kv *k, int32_t layer, int32_t stream, int32_t slot, float *row) {
    KDT_CHECK_ARG(k && row, "kdt_gpu_kv_read_row: NULL argument");
    KDT_CHECK_ARG(layer >= 0 && layer < k->n_layers, "kdt_gpu_kv_read_row: layer %d (0..%d)", layer, k->n_layers - 1);
    KDT_CHECK_ARG(stream >= 0 && stream < k->max_streams, "kdt_gpu_kv_read_row: stream %d (0..%d)", stream,
                  k->max_streams - 1);
    KDT_CHECK_ARG(slot >= 0 && slot < k->n_stream_pages[stream] * k->page_size,
                  "kdt_gpu_kv_read_row: stream %d has no page for slot %d", stream, slot);
    const int32_t page = k->block_table[(int64_t)stream * k->max_pages + slot / k->page_size];
    uint16_t tmp[4096];
    KDT_CHECK_ARG(k->row_elems <= 4096, "kdt_gpu_kv_read_row: rows of %d elements", k->row_elems);
    const uint16_t *src = k->cache + (int64_t)layer * k->layer_stride +
                          ((int64_t)page * k->page_size + slot % k->page_size) * k->row_stride;
    const cudaError_t e = cudaMemcpy(tmp, src, (size_t)k->row_elems * 2, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) return cuda_fail(e, "kdt_gpu_kv_read_row");
    for (int32_t i = 0; i < k->row_elems; i++) {
        const uint32_t u = (uint32_t)tmp[i] << 16;
        memcpy(&row[i], &u, 4);
    }
    return KDT_OK;
}
