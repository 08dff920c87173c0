/* dflash.h - the DFlash block-diffusion drafter (z-lab layout), CPU forward. Internal to the
 * engine (src/engine/); not part of the public API.
 *
 * A drafter is a small non-causal Qwen3-style stack that borrows the target's embedding table and
 * lm_head. One draft call per stream embeds the block [anchor, MASK x L] at positions P..P+L, lets
 * every block row attend to all context K/V (positions 0..P-1) and to all L+1 block rows, and
 * returns the target lm_head logits of block rows 1..L (research ddtree-dflash.md §3.1).
 *
 * Context K/V (§3.4): the target's tapped hidden states of each committed position go through
 * fc -> hidden_norm once, then through every layer's k_proj/k_norm/RoPE and v_proj, and are kept
 * in a per-stream kdt_dflash_ctx. Block K/V live only inside one draft call and never persist.
 */
#ifndef KDT_ENGINE_DFLASH_H
#define KDT_ENGINE_DFLASH_H

#include "kdtree/model.h"

typedef struct kdt_dflash_config {
    int32_t hidden_size;        /* D, must equal the target's */
    int32_t intermediate_size;  /* SwiGLU width */
    int32_t n_layers;
    int32_t n_heads;            /* H query heads */
    int32_t n_kv_heads;         /* KV heads (GQA), H % KV == 0 */
    int32_t head_dim;           /* hd, even */
    int32_t block_size;         /* L + 1, 2..KDT_MAX_DEPTH+1 */
    int32_t mask_token_id;      /* 0..target V-1 */
    int32_t n_taps;             /* 1..KDT_MODEL_MAX_TAPS */
    int32_t tap_layers[KDT_MODEL_MAX_TAPS]; /* target decoder layers, ascending, < target layers */
    int32_t max_position;       /* max_position_embeddings (YaRN's default original window; not a draft limit) */
    float rms_eps;
    /* RoPE (Qwen3 rotate-half pairs (x[i], x[i+hd/2])) */
    int32_t rope_yarn;          /* 0 default, 1 YaRN */
    double rope_theta, rope_factor, rope_beta_fast, rope_beta_slow;
    double rope_mscale, rope_mscale_all_dim;
    int32_t rope_original_max_position;
    float rope_attention_factor; /* multiplies cos/sin; see kdt_dflash_options.yarn_amplitude */
} kdt_dflash_config;

/* How YaRN's cos/sin amplitude is chosen (research §3.6): HF computes
 * mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for the Kimi drafter); the legacy
 * vLLM path used 0.1 ln(factor) + 1 (1.4159 at factor 64), which some deployments pin. */
typedef enum kdt_yarn_amplitude {
    KDT_YARN_AMP_HF = 0,
    KDT_YARN_AMP_LEGACY = 1,
} kdt_yarn_amplitude;

typedef struct kdt_dflash_options {
    kdt_yarn_amplitude yarn_amplitude;
    int progress;               /* passed to the safetensors reader */
} kdt_dflash_options;

typedef struct kdt_dflash kdt_dflash;
typedef struct kdt_dflash_ctx kdt_dflash_ctx;

/* Loads DIR/config.json + DIR/model.safetensors (or an index) and checks it against `target`:
 * missing or misshaped tensors, a hidden size or mask id that does not fit the target, or tap
 * layers outside the target give KDT_ERR_FORMAT naming the field. opt may be NULL. */
kdt_status kdt_dflash_load(const char *dir, const kdt_model *target, const kdt_dflash_options *opt,
                           kdt_dflash **out);
void kdt_dflash_free(kdt_dflash *d);
const kdt_dflash_config *kdt_dflash_get_config(const kdt_dflash *d);

/* Per-stream context cache for up to max_len positions. */
kdt_status kdt_dflash_ctx_create(const kdt_dflash *d, int32_t max_len, kdt_dflash_ctx **out);
void kdt_dflash_ctx_free(kdt_dflash_ctx *c);
void kdt_dflash_ctx_reset(kdt_dflash_ctx *c);
int32_t kdt_dflash_ctx_length(const kdt_dflash_ctx *c);

/* Appends positions len..len+n-1. feat [n][n_taps][D] fp32: the target's taps of those positions
 * in tap order (the row layout of kdt_model_outputs.taps). KDT_ERR_CAPACITY past max_len. */
kdt_status kdt_dflash_ctx_append(const kdt_dflash *d, kdt_dflash_ctx *c, const float *feat,
                                 int32_t n);

/* Drafts S streams: stream s has its context in ctx[s] (positions 0..P_s-1) and anchor token
 * anchor[s] at position P_s. logits [S][L][V] fp32 (L = block_size - 1, V = target vocab).
 * Contexts are not changed. */
kdt_status kdt_dflash_draft(const kdt_dflash *d, kdt_dflash_ctx *const *ctx, int32_t n_streams,
                            const int32_t *anchor, float *logits);

/* RoPE inverse frequencies [hd/2] of a drafter config (exposed for tests). */
void kdt_dflash_rope_inv_freq(const kdt_dflash_config *c, float *inv_freq);

/* Read-only views of the drafter's weights, for the GPU upload (src/engine/cuda/). `layer` is
 * ignored for the global weights (FC, HIDDEN_NORM, NORM); NULL for a bad layer or id. */
typedef enum kdt_dflash_wid {
    KDT_DFW_FC, KDT_DFW_HIDDEN_NORM, KDT_DFW_NORM,
    KDT_DFW_IN_NORM, KDT_DFW_POST_NORM, KDT_DFW_Q, KDT_DFW_K, KDT_DFW_V, KDT_DFW_O,
    KDT_DFW_Q_NORM, KDT_DFW_K_NORM, KDT_DFW_GATE, KDT_DFW_UP, KDT_DFW_DOWN,
} kdt_dflash_wid;
struct kdt_weight;
const struct kdt_weight *kdt_dflash_weight(const kdt_dflash *d, int32_t layer, kdt_dflash_wid id);

#endif
