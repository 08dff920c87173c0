/* target_adapter.c - embedding and lm_head access to a loaded target for the drafter (see
 * target_adapter.h). Uses the model's internal weight views read-only. */
#include "target_adapter.h"

#include "model/model_internal.h"

kdt_status kdt_target_embed_rows(const kdt_model *m, const int32_t *ids, int32_t n, float *out) {
    const int32_t V = m->cfg.vocab_size, D = m->cfg.hidden_size;
    for (int32_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= V)
            return kdt_fail(KDT_ERR_INVALID_ARG, "embedding: token %d at row %d is outside 0..%d",
                            ids[i], i, V - 1);
        kdt_weight_row_f32(&m->embed, ids[i], out + (int64_t)i * D);
    }
    return KDT_OK;
}

void kdt_target_lm_head_rows(const kdt_model *m, const float *x, int32_t n, float *logits) {
    const int32_t V = m->cfg.vocab_size, D = m->cfg.hidden_size;
    kdt_weight_matmul(&m->lm_head, x, D, n, logits, V, 0, V); /* each row as kdt_weight_matvec alone */
}
