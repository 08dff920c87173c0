/* dflash_gpu_stub.c - the GPU drafter API (engine/dflash_gpu.h) in a build without CUDA: every
 * entry point says so with KDT_ERR_NO_CUDA; free is a harmless no-op. */
#include "common.h"
#include "engine/dflash_gpu.h"

#define NO_CUDA(name) kdt_fail(KDT_ERR_NO_CUDA, "%s: this kdtree build has no CUDA support (rebuild with nvcc)", name)

kdt_status kdt_dflash_to_gpu(const kdt_dflash *d, const kdt_gpu_model *target, const kdt_dflash_gpu_options *opt,
                             kdt_dflash_gpu **out) {
    (void)d;
    (void)target;
    (void)opt;
    if (out) *out = NULL;
    return NO_CUDA("kdt_dflash_to_gpu");
}

void kdt_dflash_gpu_free(kdt_dflash_gpu *g) { (void)g; }

kdt_status kdt_dflash_gpu_append(kdt_dflash_gpu *g, const int32_t *d_n_items, int32_t max_items,
                                 const int32_t *d_slot, const int32_t *d_pos, const int32_t *d_row,
                                 const float *d_feat, int64_t feat_row_stride) {
    (void)g;
    (void)d_n_items;
    (void)max_items;
    (void)d_slot;
    (void)d_pos;
    (void)d_row;
    (void)d_feat;
    (void)feat_row_stride;
    return NO_CUDA("kdt_dflash_gpu_append");
}

kdt_status kdt_dflash_gpu_append_accepted(kdt_dflash_gpu *g, int32_t n_streams, const int32_t *d_slot,
                                          const int32_t *d_prefix, const int32_t *d_tau,
                                          const int32_t *d_acc_nodes, int32_t tree_stride,
                                          const float *d_feat, int64_t feat_row_stride) {
    (void)g;
    (void)n_streams;
    (void)d_slot;
    (void)d_prefix;
    (void)d_tau;
    (void)d_acc_nodes;
    (void)tree_stride;
    (void)d_feat;
    (void)feat_row_stride;
    return NO_CUDA("kdt_dflash_gpu_append_accepted");
}

kdt_status kdt_dflash_gpu_draft(kdt_dflash_gpu *g, int32_t n_streams, const int32_t *d_slot,
                                const int32_t *d_prefix, const int32_t *d_anchor, float *d_logits) {
    (void)g;
    (void)n_streams;
    (void)d_slot;
    (void)d_prefix;
    (void)d_anchor;
    (void)d_logits;
    return NO_CUDA("kdt_dflash_gpu_draft");
}
