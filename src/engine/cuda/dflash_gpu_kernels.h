/* dflash_gpu_kernels.h - the launchers of the drafter's own kernels (dflash_gpu.cu), shared with
 * the host code in dflash_gpu.c. The GEMMs and the generic row kernels (RMSNorm, o_proj finish,
 * residual, split-K sum) are the target's (src/model/cuda/gpu_internal.h). All launchers are
 * asynchronous on `s` and only fail on launch errors. Plain C. */
#ifndef KDT_ENGINE_DFLASH_GPU_KERNELS_H
#define KDT_ENGINE_DFLASH_GPU_KERNELS_H

#include "model/cuda/gpu_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x[r] = embedding of the block token of row r = s * T + t (anchor[s] for t = 0, else mask_id;
 * ids clamped to 0..V-1); counts[0] = n_streams * T (block rows), counts[1] = n_streams * (T - 1)
 * (lm_head rows), for the kernels that read their row count from the device. */
typedef struct kdt_df_embed_args {
    const int32_t *anchor;
    int32_t n_streams, T, mask_id, V, D;
    const uint16_t *embed; int32_t ld;
    float *x;
    int32_t *counts;
} kdt_df_embed_args;
kdt_status kdt_df_embed(const kdt_df_embed_args *a, cudaStream_t s);

/* Finish of the block's [k | v | q] projection: split-K sum, q_norm / k_norm per head, RoPE at
 * position prefix[s] + t; q [rows][H*hd], kb / vb [rows][KV*hd]. */
typedef struct kdt_df_qkv_args {
    const float *part; int32_t splits; int64_t split_stride; int32_t ldp;
    const int32_t *prefix;
    int32_t rows, T, H, KV, hd, max_len;
    const float *q_norm, *k_norm; float eps;
    const float *rope_cs; int32_t rope_rows;   /* [rope_rows][hd/2] (cos, sin) pairs */
    float *q, *kb, *vb;
} kdt_df_qkv_args;
kdt_status kdt_df_qkv_post(const kdt_df_qkv_args *a, cudaStream_t s);

/* Non-causal block attention: one CTA per (stream, KV head, chunk of pairs_per_cta (block row,
 * query head) pairs); keys = context 0..P-1 of the stream's slot, then its T block rows, in
 * 32-key tiles; online softmax in a fixed order. out [rows][H*hd]. */
typedef struct kdt_df_attn_args {
    const float *q;                 /* [rows][H*hd] */
    const float *kb, *vb;           /* [rows][KV*hd] */
    const float *ck, *cv;           /* one layer's context [max_streams][max_len][KV*hd] */
    const int32_t *slot, *prefix;
    float *out;                     /* [rows][H*hd] */
    int32_t n_streams, T, H, KV, hd, max_streams, max_len;
    int32_t pairs_per_cta, n_chunks, warps;
    float scale;
} kdt_df_attn_args;
size_t kdt_df_attn_smem(int32_t pairs_per_cta, int32_t hd, int32_t warps);
/* Raises the kernel's dynamic shared-memory limit (call before any capture). */
kdt_status kdt_df_attn_init(size_t smem);
kdt_status kdt_df_attn(const kdt_df_attn_args *a, cudaStream_t s);

/* act[r][i] = silu(gate) * up, gate / up the columns [0, I) / [I, 2I) of the summed partials. */
kdt_status kdt_df_swiglu(const float *part, int32_t splits, int64_t split_stride, int32_t rows, int32_t I,
                         float *act, cudaStream_t s);

/* out[m] = RMSNorm(sum of partials row m) * w for m < *n_dev (clamped to max_n). */
kdt_status kdt_df_sum_norm(const float *part, int32_t splits, int64_t split_stride, const int32_t *n_dev,
                           int32_t max_n, const float *w, float eps, int32_t D, float *out, cudaStream_t s);

/* Context append finish: partials [split][layer][item][k | v] of the batched k/v GEMM ->
 * k_norm + RoPE(pos[i]) -> ck, v -> cv at [layer][slot[i]][pos[i]]; items with a slot or position
 * out of range are skipped. */
typedef struct kdt_df_ctx_args {
    const float *part; int32_t splits; int64_t split_stride, layer_stride;
    const int32_t *n_dev; int32_t max_n;
    const int32_t *slot, *pos;
    int32_t n_layers, KV, hd, max_streams, max_len;
    const float *k_norm;            /* [n_layers][hd] */
    float eps;
    const float *rope_cs; int32_t rope_rows;
    float *ck, *cv;                 /* [n_layers][max_streams][max_len][KV*hd] */
} kdt_df_ctx_args;
kdt_status kdt_df_ctx_post(const kdt_df_ctx_args *a, cudaStream_t s);

/* The accepted-path item list: stream-major, k ascending; *n_items = sum of clamped tau. */
kdt_status kdt_df_accept_items(int32_t n_streams, const int32_t *slot, const int32_t *prefix, const int32_t *tau,
                               const int32_t *acc_nodes, int32_t tree_stride, int32_t *n_items, int32_t *i_slot,
                               int32_t *i_pos, int32_t *i_row, cudaStream_t s);

#ifdef __cplusplus
}
#endif
#endif
