/* target_adapter.h - what the engine needs from the target model beyond include/kdtree/model.h:
 * embedding rows for arbitrary ids (the drafter's block, MASK included) and the lm_head over
 * arbitrary hidden rows (the drafter's outputs). Implemented in target_adapter.c on top of
 * src/model/model_internal.h, read-only; a candidate for the model's public API.
 */
#ifndef KDT_ENGINE_TARGET_ADAPTER_H
#define KDT_ENGINE_TARGET_ADAPTER_H

#include "kdtree/model.h"

/* out [n][D] = the target's embedding rows of ids[0..n) (ids checked against V). */
kdt_status kdt_target_embed_rows(const kdt_model *m, const int32_t *ids, int32_t n, float *out);

/* logits [n][V] = lm_head(x[r]) for the n rows x [n][D] (no final norm: the caller applies its
 * own). Row results do not depend on n (fixed summation order). */
void kdt_target_lm_head_rows(const kdt_model *m, const float *x, int32_t n, float *logits);

#endif
