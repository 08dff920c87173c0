/* model.h - the target model runtime: loading a DeepSeek-V3-family checkpoint (Kimi K2.x,
 * DeepSeek-V3) from a Hugging Face directory, the paged latent KV cache, and the forward pass in
 * its three modes (prefill, decode, tree verify). This header owns kdt_model, kdt_kv_cache and
 * every kdt_model_* / kdt_kv_* function; the CPU reference lives in src/model/.
 *
 * Loading
 *   kdt_model_load() reads DIR/config.json (a plain DeepseekV3/Kimi text config, or a multimodal
 *   wrapper such as Kimi K2.5/K2.6 whose text model sits under "text_config"), then
 *   DIR/model.safetensors.index.json + its shards, or DIR/model.safetensors. Files are mmap'ed and
 *   the weights are used in place (zero-copy) on the CPU. Every tensor the config implies is
 *   checked for presence, shape and dtype before anything runs; a bad file gives KDT_ERR_FORMAT
 *   (or KDT_ERR_IO / KDT_ERR_UNSUPPORTED) with a message naming the file and the tensor.
 *   Weight dtypes: F32, BF16, F16, and the two quantized forms the published checkpoints use:
 *   block FP8 (DeepSeek-V3, K2-Instruct: e4m3 `weight` + fp32 `weight_scale_inv` per 128x128
 *   block) and INT4 pack-quantized (K2-Thinking/K2.5/K2.6 routed experts: int32 `weight_packed`,
 *   `weight_scale` per group of 32, `weight_shape`), each tensor in whichever form the file has.
 *   MTP weights (num_nextn_predict_layers) and vision-tower weights are ignored.
 *
 * The math (matches transformers' DeepseekV3ForCausalLM):
 *   RMSNorm -> MLA (q_lora or plain q_proj; latent c_kv after kv_a RMSNorm; RoPE on a shared
 *   k_pe with DeepSeek's interleaved pairs unless rope_interleave is false; YaRN or default RoPE;
 *   softmax scale (d_nope+d_rope)^-0.5 * mscale(factor, mscale_all_dim)^2) in the absorbed form
 *   (q_lat = W_UK^T q_nope attends over [c_kv | k_pe]) -> residual -> RMSNorm -> dense SwiGLU MLP
 *   or MoE (sigmoid scores, e_score_correction_bias for selection only, group filter by the sum
 *   of each group's top-2 biased scores, top-k with ties to the lower index, unbiased weights,
 *   optional normalisation, routed_scaling_factor, plus shared experts) -> residual; final
 *   RMSNorm, lm_head. Experts outside the kept groups are never selected.
 *
 * KV cache
 *   Paged: page size KDT_KV_PAGE_SIZE (64) tokens, a block table per stream, a page pool with
 *   all-or-nothing allocation (KDT_ERR_CAPACITY when exhausted). Memory layout
 *   [n_layers][n_pages][64][kv_lora + rope] fp32 on the CPU; each row is [c_kv | k_pe], stored
 *   after the kv_a RMSNorm and after RoPE (k_pe in the checkpoint's pair order). The layout is
 *   the one kdt_kv_commit_cpu() expects (see kdt_kv_cache_layout()).
 *
 * Streams and slots
 *   A stream s has a committed length len(s): slots 0..len-1 hold its tokens at positions
 *   0..len-1. prefill appends n tokens (slots len..len+n-1) and decode one token; both advance
 *   len. verify writes its N tree nodes at slots len..len+N-1 without advancing len; after
 *   tree_accept + kdt_kv_commit_cpu() (or a greedy walk of your own) call
 *   kdt_kv_stream_set_length(len + tau).
 *
 * Determinism and batch invariance
 *   Every per-row result (logits, argmax, taps, KV rows) is a function of that row's token,
 *   position and visible keys only, computed with fixed reduction orders: it does not change,
 *   bit for bit, with the number or content of other rows, with the prefill chunk size, or
 *   between prefill, decode and tree verify of the same path (in verify the visible keys are the
 *   committed prefix then the node's ancestors in increasing slot order, the same key order as
 *   decoding that path).
 *
 * Thread safety: a loaded kdt_model is read-only and may be shared by threads; a kdt_kv_cache
 * must be used by one thread at a time.
 */
#ifndef KDTREE_MODEL_H
#define KDTREE_MODEL_H

#include "kdtree/kdtree.h"
#include "kdtree/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KDT_KV_PAGE_SIZE 64
#define KDT_MODEL_MAX_EOS 8
#define KDT_MODEL_MAX_TAPS 64

typedef struct kdt_model kdt_model;
typedef struct kdt_kv_cache kdt_kv_cache;

typedef enum kdt_rope_kind { KDT_ROPE_DEFAULT = 0, KDT_ROPE_YARN = 1 } kdt_rope_kind;

/* Weight quantization declared by config.json's quantization_config. Quantized tensors are
 * dequantized to fp32 per element (value * scale) on the CPU; activations stay fp32. */
typedef enum kdt_weight_quant {
    KDT_QUANT_NONE = 0,
    KDT_QUANT_FP8_BLOCK = 1,  /* quant_method "fp8", e4m3 weight + weight_scale_inv per block */
    KDT_QUANT_INT4_GROUP = 2, /* compressed-tensors "pack-quantized", int4 symmetric, per group */
} kdt_weight_quant;

/* The model's configuration as read from config.json (read-only; derived values included). */
typedef struct kdt_model_config {
    char model_type[32];            /* "deepseek_v3", "kimi_k2", ... (of the text model) */
    int32_t vocab_size;             /* V */
    int32_t hidden_size;            /* D */
    int32_t intermediate_size;      /* dense MLP width */
    int32_t moe_intermediate_size;  /* one routed expert's width */
    int32_t n_layers;               /* num_hidden_layers (MTP layers excluded) */
    int32_t n_heads;                /* H */
    int32_t q_lora_rank;            /* 0 = no q LoRA (plain q_proj) */
    int32_t kv_lora_rank;           /* d_c, e.g. 512 */
    int32_t qk_nope_head_dim;       /* d_n, e.g. 128 */
    int32_t qk_rope_head_dim;       /* d_r, e.g. 64 (even) */
    int32_t v_head_dim;             /* d_v, e.g. 128 */
    int32_t n_routed_experts;       /* E (0 if no MoE layer) */
    int32_t n_shared_experts;
    int32_t n_experts_per_tok;      /* top-k */
    int32_t n_group, topk_group;
    int32_t first_k_dense_replace;
    int32_t moe_layer_freq;         /* layer l is MoE iff l >= first_k_dense_replace && l % freq == 0 */
    int32_t norm_topk_prob;         /* 0/1 */
    float routed_scaling_factor;
    float rms_norm_eps;
    int32_t max_position_embeddings;
    int32_t tie_word_embeddings;    /* 0/1 */
    /* RoPE */
    kdt_rope_kind rope_kind;
    int32_t rope_interleave;        /* 1: rotate pairs (x[2i], x[2i+1]) (DeepSeek); 0: (x[i], x[i+d/2]) */
    double rope_theta;
    double rope_factor;             /* YaRN factor (1 for default RoPE) */
    double rope_beta_fast, rope_beta_slow;
    double rope_mscale, rope_mscale_all_dim;
    int32_t rope_original_max_position;
    float rope_attention_factor;    /* multiplies cos/sin (YaRN), 1 otherwise */
    float softmax_scale;            /* (d_n+d_r)^-0.5 * mscale^2 */
    kdt_weight_quant weight_quant;
    int32_t quant_block_rows;       /* FP8: weight_block_size[0] (128); INT4: 1 */
    int32_t quant_block_cols;       /* FP8: weight_block_size[1] (128); INT4: group_size (32) */
    /* special tokens (-1 / 0 entries when absent); eos ids come from config.json, then
     * generation_config.json when the directory has one (ids outside the vocabulary dropped) */
    int32_t bos_token_id;
    int32_t n_eos;
    int32_t eos_token_ids[KDT_MODEL_MAX_EOS];
} kdt_model_config;

typedef struct kdt_model_options {
    int32_t progress;       /* 1: a progress line on stderr while loading, only when stderr is a
                               terminal and CI is not "true"; 0: silent */
    int32_t prefill_chunk;  /* rows per forward chunk in prefill (scratch memory bound); 0 = 64 */
} kdt_model_options;

/* Loads the model in directory `dir`. opt may be NULL (defaults: progress 1, chunk 64). On
 * failure *out is NULL and nothing is left open. */
kdt_status kdt_model_load(const char *dir, const kdt_model_options *opt, kdt_model **out);
void kdt_model_free(kdt_model *m);
/* Read-only view of the configuration, valid while the model lives. NULL if m is NULL. */
const kdt_model_config *kdt_model_get_config(const kdt_model *m);
/* Name of the embedding's dtype ("F32", "BF16", ...): the dtype of the unquantized weights. */
const char *kdt_model_weight_dtype(const kdt_model *m);

/* ---------------------------------------------------------------------------------------------
 * Paged latent KV cache
 * ------------------------------------------------------------------------------------------- */
typedef struct kdt_kv_cache_options {
    int32_t n_pages;                /* pages in the pool, >= 1 */
    int32_t max_streams;            /* stream ids 0..max_streams-1, 1..KDT_MAX_STREAMS */
    int32_t max_pages_per_stream;   /* block-table stride; 0 = ceil(max_position_embeddings/64) */
} kdt_kv_cache_options;

kdt_status kdt_kv_cache_create(const kdt_model *m, const kdt_kv_cache_options *opt,
                               kdt_kv_cache **out);
void kdt_kv_cache_free(kdt_kv_cache *c);
/* Releases every stream's pages; all lengths become 0. */
kdt_status kdt_kv_cache_reset(kdt_kv_cache *c);

/* Makes sure stream s has pages for slots 0..n_slots-1 (all-or-nothing; KDT_ERR_CAPACITY if the
 * pool or the block table is exhausted, nothing changed then). The forward calls reserve on
 * their own; this is for callers that want to fail early. */
kdt_status kdt_kv_stream_reserve(kdt_kv_cache *c, int32_t stream, int32_t n_slots);
/* Frees all pages of stream s; its length becomes 0. */
kdt_status kdt_kv_stream_release(kdt_kv_cache *c, int32_t stream);
/* Committed length of stream s (-1 if s is out of range). */
int32_t kdt_kv_stream_length(const kdt_kv_cache *c, int32_t stream);
/* Sets the committed length: len <= the number of slots written so far (e.g. after verify and
 * KV commit, len = prefix + tau). Pages wholly beyond len are returned to the pool. */
kdt_status kdt_kv_stream_set_length(kdt_kv_cache *c, int32_t stream, int32_t len);
/* Free pages in the pool. */
int32_t kdt_kv_cache_free_pages(const kdt_kv_cache *c);

/* The raw layout, for kdt_kv_commit_cpu() and for GPU mirrors:
 *   cache              [n_layers] x [n_pages][page_size][row_elems] of `dtype`
 *   block_table        [max_streams][max_pages] int32, -1 = no page */
typedef struct kdt_kv_layout {
    void *cache;
    kdt_dtype dtype;                /* KDT_F32 on the CPU */
    int32_t n_layers, n_pages, page_size, row_elems, row_bytes;
    int64_t layer_stride_bytes;
    int32_t *block_table;
    int32_t max_streams, max_pages;
} kdt_kv_layout;
kdt_status kdt_kv_cache_layout(kdt_kv_cache *c, kdt_kv_layout *out);

/* Copies the accepted tree rows into place with kdt_kv_commit_cpu() and sets each stream's
 * length to prefix + tau. stream_ids [S] maps tree stream s to a cache stream (NULL = identity);
 * accepted [S][KDT_MAX_PATH] and tau [S] come from kdt_tree_accept_cpu(). A stream with tau 0 is
 * left as it was. */
kdt_status kdt_kv_cache_commit(kdt_kv_cache *c, int32_t n_streams, const int32_t *stream_ids,
                               const int32_t *accepted, const int32_t *tau);

/* ---------------------------------------------------------------------------------------------
 * Forward passes. All three run the same per-row code. Outputs are written for R rows:
 *   prefill  R = n (one row per prompt token) or 1 (last_only, logits/argmax only)
 *   decode   R = S (one row per stream)
 *   verify   R = S * max_nodes (rows [S][max_nodes]; padding rows i >= n_nodes[s] untouched)
 * Every output pointer may be NULL. Inputs are validated before anything is computed or
 * written: bad token ids (outside 0..V-1), positions >= max_position_embeddings, a malformed
 * tree, or too few KV pages give an error and leave the cache unchanged.
 * ------------------------------------------------------------------------------------------- */
typedef struct kdt_model_outputs {
    float *logits;              /* [R][V] fp32, or NULL */
    int32_t *argmax;            /* [R] argmax over the vocabulary (ties -> lower id), computed by
                                   a fused lm_head->argmax that never stores a logits row; or NULL */
    int32_t last_only;          /* prefill: logits/argmax for the last token only (R = 1 for
                                   them; taps still cover every token) */
    int32_t n_taps;             /* 0..KDT_MODEL_MAX_TAPS */
    const int32_t *tap_layers;  /* [n_taps] decoder layers 0..n_layers-1: output of layer i,
                                   residual included (HF hidden_states[i+1]), before the final norm */
    float *taps;                /* [R_all][n_taps][D] fp32 (R_all = n in prefill even if last_only) */
} kdt_model_outputs;

/* Appends tokens[0..n-1] to stream `stream` at slots len..len+n-1 (positions likewise). */
kdt_status kdt_model_prefill(const kdt_model *m, kdt_kv_cache *c, int32_t stream,
                             const int32_t *tokens, int32_t n, const kdt_model_outputs *out);

/* One token per stream: tokens[s] is appended to cache stream stream_ids[s] (NULL = s).
 * Stream ids must be distinct. */
kdt_status kdt_model_decode(const kdt_model *m, kdt_kv_cache *c, int32_t n_streams,
                            const int32_t *stream_ids, const int32_t *tokens,
                            const kdt_model_outputs *out);

/* Tree verify: tree stream s uses cache stream stream_ids[s] (NULL = s); its root must sit at
 * position = the stream's length P, node i at position P + depth[i]; node i's KV row is written
 * at slot P + i; node i sees slots 0..P-1 and the slots P + j of the nodes j set in its ancestor
 * mask (which must be exactly {i} plus its parent's mask). The stream length is not changed. */
kdt_status kdt_model_verify(const kdt_model *m, kdt_kv_cache *c, const kdt_tree *tree,
                            const int32_t *stream_ids, const kdt_model_outputs *out);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_MODEL_H */
