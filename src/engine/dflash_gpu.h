/* dflash_gpu.h - the DFlash drafter's forward on the GPU (src/engine/cuda/; a build without CUDA
 * links src/engine/no_cuda/, where every function returns KDT_ERR_NO_CUDA). Internal to the engine.
 *
 * The math is dflash.c's (context append and draft block), with the GPU target's numerics: bf16
 * weights (the drafter's 2-D weights are rounded to bf16 once at upload), fp32 activations, norms
 * and context K/V, the target's split-K GEMMs. Per-slot context K/V live on the GPU
 * ([layer][slot][max_len][KV*hd] fp32, K after k_norm + RoPE), written by the append calls.
 *
 * Every call after kdt_dflash_to_gpu is asynchronous on opt.stream, never synchronizes, never
 * allocates and never copies from the host: capturable in a CUDA graph. Device-side values
 * (counts, slots, positions, anchors) are trusted but clamped so that nothing is written outside
 * the buffers: an item whose slot or position is out of range is skipped.
 *
 * Batch invariance: a stream's logits are a function of its slot's context, its prefix length
 * and its anchor only, bit for bit, whatever other streams are drafted with it (GEMM split counts
 * depend on the weight shapes only; the attention walks a row's keys in fixed 32-key tiles).
 */
#ifndef KDT_ENGINE_DFLASH_GPU_H
#define KDT_ENGINE_DFLASH_GPU_H

#include "dflash.h"
#include "kdtree/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kdt_dflash_gpu kdt_dflash_gpu;

typedef struct kdt_dflash_gpu_options {
    int32_t max_streams;      /* context slots 0..max_streams-1 (1..64) */
    int32_t max_len;          /* context positions per slot */
    int32_t max_draft_streams;/* streams per draft call, <= max_streams */
    int32_t max_append_rows;  /* items per append call */
    void *stream;             /* cudaStream_t all work is enqueued on (NULL = default stream) */
} kdt_dflash_gpu_options;

/* Uploads the drafter (bf16 weights like the target's; fp32 norms; a host-computed RoPE cos/sin
 * table computed exactly like dflash.c does, amplitude included) and allocates per-slot context
 * K/V on the GPU. `target` is the GPU target (its embed and lm_head are used for the block
 * embedding and the logits). Errors: dimension mismatch between drafter and GPU target ->
 * KDT_ERR_INVALID_ARG naming the field; CUDA OOM -> KDT_ERR_OUT_OF_MEMORY with bytes. */
kdt_status kdt_dflash_to_gpu(const kdt_dflash *d, const kdt_gpu_model *target,
                             const kdt_dflash_gpu_options *opt, kdt_dflash_gpu **out);
void kdt_dflash_gpu_free(kdt_dflash_gpu *g);

/* Appends context rows. Item i < *d_n_items (clamped to max_items, the host-side launch bound,
 * <= opt.max_append_rows) writes slot d_slot[i] at position d_pos[i] from the feature row
 * d_feat + d_row[i] * feat_row_stride ([n_taps][D] fp32, the layout of kdt_model_outputs.taps):
 * fc -> hidden_norm -> per layer k_proj, k_norm, RoPE(pos) and v_proj (kdt_dflash_ctx_append). */
kdt_status kdt_dflash_gpu_append(kdt_dflash_gpu *g, const int32_t *d_n_items, int32_t max_items,
                                 const int32_t *d_slot, const int32_t *d_pos, const int32_t *d_row,
                                 const float *d_feat, int64_t feat_row_stride);

/* The accepted-path form (all pointers device): for tree stream s < n_streams with tau = d_tau[s]
 * (0 = nothing), items k = 0..tau-1 go to slot d_slot[s], position d_prefix[s] + k, feature row
 * s * tree_stride + d_acc_nodes[s * KDT_MAX_PATH + k]. Builds the item list on the device into
 * internal buffers, then does what kdt_dflash_gpu_append does. n_streams * KDT_MAX_PATH must fit
 * opt.max_append_rows. */
kdt_status kdt_dflash_gpu_append_accepted(kdt_dflash_gpu *g, int32_t n_streams, const int32_t *d_slot,
                                          const int32_t *d_prefix, const int32_t *d_tau,
                                          const int32_t *d_acc_nodes, int32_t tree_stride,
                                          const float *d_feat, int64_t feat_row_stride);

/* Drafts n_streams (1..opt.max_draft_streams) streams: stream s uses slot d_slot[s], context
 * positions 0..d_prefix[s]-1 and the anchor token d_anchor[s] at position d_prefix[s] (block
 * [anchor, MASK x L] at positions P..P+L, non-causal layers, final norm, target lm_head of block
 * rows 1..L). d_logits [n_streams][L][V] fp32 (L = block_size - 1, V = target vocab). Contexts
 * are not changed. */
kdt_status kdt_dflash_gpu_draft(kdt_dflash_gpu *g, int32_t n_streams, const int32_t *d_slot,
                                const int32_t *d_prefix, const int32_t *d_anchor, float *d_logits);

#ifdef __cplusplus
}
#endif
#endif
