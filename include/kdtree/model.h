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
 *   decoding that path). The last holds for prefill with the default absorbed attention; the
 *   plain form (kdt_model_options.prefill_attention) computes the same function in another order.
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

/* The form of a prefill chunk's attention (decode and tree verify always take the absorbed one).
 * Absorbed: each head's query is folded through W_UK into the 576-wide latent space and scores
 * the cache rows directly (per row, key and head 2 (d_c + d_r) + 2 d_c FLOPs, plus W_UK and W_UV
 * per row). Plain: the chunk's visible keys are first up-projected through kv_b into per-head
 * k_nope and v (2 d_c (d_n + d_v) FLOPs per key and head), then each head attends over 192-wide
 * keys and 128-wide values (2 (d_n + d_r) + 2 d_v per row, key and head): about a third of the
 * absorbed form's attention FLOPs at Kimi's dimensions, so it pays once a chunk's rows outnumber
 * ~170 (or the chunk is the prompt's start, where keys = rows). */
typedef enum kdt_prefill_attention {
    KDT_PREFILL_ABSORBED = 0, /* the decode form: prefill, decode and verify of one path give the
                                 same bits, for any prefill chunk size */
    KDT_PREFILL_PLAIN = 1,    /* the plain form for every prefill chunk: prefill's bits differ from
                                 decode's (the same math in another order, ~1e-6 relative on the
                                 CPU) but not with the chunk size */
    KDT_PREFILL_AUTO = 2,     /* per chunk, the form with fewer FLOPs (kdt_prefill_plain_pays) */
} kdt_prefill_attention;

#define KDT_MAX_PREFILL_CHUNK 4096   /* the most rows of one prefill chunk (CPU model, engine) */
#define KDT_DEFAULT_PREFILL_CHUNK 64 /* the CPU model's chunk when its options say 0 */

typedef struct kdt_model_options {
    int32_t progress;       /* 1: a progress line on stderr while loading, only when stderr is a
                               terminal and CI is not "true"; 0: silent */
    int32_t prefill_chunk;  /* rows per forward chunk in prefill, 1..KDT_MAX_PREFILL_CHUNK (scratch
                               memory bound); 0 = KDT_DEFAULT_PREFILL_CHUNK */
    int32_t prefill_attention; /* a kdt_prefill_attention; 0 = KDT_PREFILL_ABSORBED */
} kdt_model_options;

/* 1 when a prefill chunk of n_rows rows after prefix_len committed tokens costs fewer attention
 * FLOPs in the plain form than in the absorbed one (the rule KDT_PREFILL_AUTO applies; a
 * function of the config's dimensions, n_rows and prefix_len only). */
int kdt_prefill_plain_pays(const kdt_model_config *c, int32_t n_rows, int32_t prefix_len);

/* The GPU engine's default prefill chunk (kdt_engine_options.prefill_chunk 0): the smallest power
 * of two in [KDT_GPU_PREFILL_CHUNK_MIN, KDT_GPU_PREFILL_CHUNK_MAX] rows whose matrix FLOPs (2 per
 * weight a row uses: attention, router, shared and top-k experts) reach the bf16 bytes of the
 * heaviest layer's weights (all experts: a chunk streams each once) times flop_per_byte, the
 * device's rate over its bandwidth. Below that a pass costs about its bytes whatever its rows;
 * past it the time per prompt token hardly falls while a pass, which decode rounds wait behind,
 * grows (Kimi K2.6 on an H100, bench/RESULTS.md session 47: 45 / 25 / 14 / 9.2 us per token at
 * 256 / 512 / 1,024 / 2,048 rows). Dense and small models get the minimum; MIN for c NULL or a
 * flop_per_byte not > 0. A function of the config's dimensions and flop_per_byte only. */
#define KDT_GPU_PREFILL_CHUNK_MIN 256
#define KDT_GPU_PREFILL_CHUNK_MAX 2048
int32_t kdt_prefill_chunk_for(const kdt_model_config *c, double flop_per_byte);
/* A GPU's FLOPs per byte for kdt_prefill_chunk_for, from what the device reports (SMs, SM clock
 * and memory clock in kHz, memory bus width in bits, compute capability major): a coarse model
 * anchored on one measurement, a 2,048-row Kimi K2.6 prefill layer's matrices at ~114 TFLOP/s on
 * an H100 (132 SMs at 1,980 MHz, the wgmma GEMMs; ~55 for the mma.sync ones, major != 9), scaled
 * by SMs x clock, over 90 % of the memory's peak bandwidth (the H100 copies 3,015 GB/s of 3,352).
 * 0 when any input is not positive. */
double kdt_gpu_flop_per_byte(int sms, int clock_khz, int mem_clock_khz, int bus_bits, int cc_major);

/* Loads the model in directory `dir`. opt may be NULL (defaults: progress 1, chunk 64, absorbed
 * prefill attention). On failure *out is NULL and nothing is left open. */
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

/* One stream's rows of a multi-stream prefill pass: its next n prompt tokens. */
typedef struct kdt_prefill_segment {
    int32_t stream;
    const int32_t *tokens; /* [n] */
    int32_t n;             /* >= 1 */
} kdt_prefill_segment;
/* Several streams' prefill chunks in one pass: segment k's rows follow segment k - 1's, each
 * causal over its own stream; a stream appears at most once; each segment at most the model's
 * prefill_chunk rows (one chunk of kdt_model_prefill's), the pass at most KDT_MAX_PREFILL_CHUNK.
 * Each segment takes the attention form its own chunk would, so every row's outputs equal those of
 * kdt_model_prefill of that segment alone, bitwise. out->last_only: output row k is segment k's
 * last row; else output row i is the pass's row i; taps cover every row. The GPU form is
 * kdt_gpu_stage_prefill_many. */
kdt_status kdt_model_prefill_many(const kdt_model *m, kdt_kv_cache *c, int32_t n_segments,
                                  const kdt_prefill_segment *segs, const kdt_model_outputs *out);

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


/* =============================================================================================
 * GPU forward (src/model/cuda/; a build without CUDA links src/model/no_cuda/, where every
 * function below returns KDT_ERR_NO_CUDA). Owned by the GPU-forward contributor; nothing above
 * this line changes.
 *
 * kdt_gpu_model   the weights on one GPU: every 2-D weight as bf16 (quantized and F32/F16 weights
 *                 are converted once at upload: FP8/INT4 dequantized exactly as weights.c does,
 *                 then rounded to bf16), norms, router bias and the RoPE cos/sin table (computed on
 *                 the host exactly as forward.c computes it) as fp32. Activations stay fp32.
 * kdt_gpu_kv      the paged latent cache on the GPU: bf16 [n_layers][n_pages][64][row_stride]
 *                 (row = [c_kv | k_pe] as on the CPU, row_stride = kv_lora + rope rounded up to 8,
 *                 576 for Kimi/DeepSeek: the layout kdt_kv_commit_cuda() moves and
 *                 kdt_verify_attn_cuda() reads), with the same stream/page/length rules as
 *                 kdt_kv_cache. Block tables live on the GPU, mirrored on the host.
 * kdt_gpu_runner  the scratch of one forward pass (sized by max_rows and max_keys), a CUDA stream,
 *                 pinned staging for the batch description and the device outputs.
 *
 * Determinism and batch invariance: as on the CPU, every per-row result (logits, argmax, taps,
 * KV row) is a function of the row's token, position and visible keys only, bit for bit: the
 * GEMMs reduce every output over K in one fixed blocking (split-K counts depend on the weight
 * shape only, never on the row count), the attention walks a row's visible keys in their list
 * order (committed prefix, then its tree ancestors by slot) in fixed 32-key tiles and fixed
 * splits (128 keys up to 4096 keys, then 512, a function of the row's key count only), MoE rows are routed and weighted in
 * a fixed order. So prefill, decode and tree verify of one path give identical bits, alone or in
 * any batch; graph replays equal eager runs. The GPU does not reproduce the CPU's bits: the KV
 * cache and the attention operands are bf16 (relative error ~1e-3 in the logits).
 *
 * Two ways to run:
 *   synchronous  kdt_gpu_prefill / kdt_gpu_decode / kdt_gpu_verify: host inputs and outputs,
 *                the semantics and checks of kdt_model_prefill / _decode / _verify.
 *   asynchronous kdt_gpu_stage_* (host: validate, reserve pages, enqueue the copy of the batch
 *                description) then kdt_gpu_run (kernels only: no host sync, no allocation, no
 *                copy; capturable with kdt_gpu_graph_capture), outputs in the runner's device
 *                buffers (kdt_gpu_runner_outputs). A captured graph replays whatever batch was
 *                staged last, as long as its rows fit the graph's max_rows.
 * ------------------------------------------------------------------------------------------- */
typedef struct kdt_gpu_model kdt_gpu_model;
typedef struct kdt_gpu_kv kdt_gpu_kv;
typedef struct kdt_gpu_runner kdt_gpu_runner;
typedef struct kdt_gpu_graph kdt_gpu_graph;

typedef struct kdt_gpu_options {
    int32_t device;         /* CUDA device ordinal; it becomes the calling thread's device */
    int32_t progress;       /* 1: a progress bar on stderr while uploading (terminal, CI != true) */
    int32_t max_position;   /* RoPE table rows; 0 = max_position_embeddings */
} kdt_gpu_options;

/* Uploads the model's weights (shard by shard, in file order). opt may be NULL (device 0, no
 * progress). The CPU model is only read and may be freed afterwards. */
kdt_status kdt_model_to_gpu(const kdt_model *m, const kdt_gpu_options *opt, kdt_gpu_model **out);

/* A model with random weights drawn on the GPU, for benchmarks and shape tests. config_json is a
 * config.json text (parsed like kdt_model_load does). Linear weights ~ N(0, weight_std), norm
 * weights 1 + U(-0.1, 0.1), router bias ~ N(0, router_bias_std). Embedding rows [0, V/2) are
 * independent N(0, 1); rows [V/2, V) come in blocks of corr_block rows that share a N(0, 1) base
 * plus corr_sigma * N(0, 1) noise each ("correlated tokens"). */
typedef struct kdt_gpu_random_init {
    uint64_t seed;
    float weight_std;       /* 0 -> 0.02 */
    float router_bias_std;  /* 0 -> 0.001 */
    int32_t corr_block;     /* 0 -> 32 */
    float corr_sigma;       /* 0 -> 0.05 */
} kdt_gpu_random_init;
kdt_status kdt_gpu_model_random(const char *config_json, const kdt_gpu_random_init *init,
                                const kdt_gpu_options *opt, kdt_gpu_model **out);
void kdt_gpu_model_free(kdt_gpu_model *g);
const kdt_model_config *kdt_gpu_model_get_config(const kdt_gpu_model *g);

/* Bytes of weights, for rooflines: one layer's attention part (norms, q/kv projections, kv_b,
 * o_proj), its dense MLP (0 in MoE layers), router (+ bias), one routed expert, the shared
 * expert(s); and the whole model on the device. */
typedef struct kdt_gpu_weight_bytes {
    size_t attention, dense_mlp, router, routed_expert, shared_expert;
    size_t total;
} kdt_gpu_weight_bytes;
kdt_status kdt_gpu_model_weight_bytes(const kdt_gpu_model *g, int32_t layer, kdt_gpu_weight_bytes *out);

/* ---- KV cache on the GPU (page rules as kdt_kv_cache; NaN-poisoned at creation) ------------ */
kdt_status kdt_gpu_kv_create(const kdt_gpu_model *g, const kdt_kv_cache_options *opt, kdt_gpu_kv **out);
void kdt_gpu_kv_free(kdt_gpu_kv *c);
kdt_status kdt_gpu_kv_reset(kdt_gpu_kv *c);
kdt_status kdt_gpu_kv_stream_reserve(kdt_gpu_kv *c, int32_t stream, int32_t n_slots);
kdt_status kdt_gpu_kv_stream_release(kdt_gpu_kv *c, int32_t stream);
int32_t kdt_gpu_kv_stream_length(const kdt_gpu_kv *c, int32_t stream);
kdt_status kdt_gpu_kv_stream_set_length(kdt_gpu_kv *c, int32_t stream, int32_t len);
int32_t kdt_gpu_kv_free_pages(const kdt_gpu_kv *c);
/* Device pointers: cache (KDT_BF16), block_table. Page assignments made on the host since the
 * last staged forward are copied to the device first (synchronously). */
kdt_status kdt_gpu_kv_layout(kdt_gpu_kv *c, kdt_kv_layout *out);
/* Reads row `slot` of stream `stream` in `layer` as fp32 [kv_lora + rope] (synchronous; tests). */
kdt_status kdt_gpu_kv_read_row(kdt_gpu_kv *c, int32_t layer, int32_t stream, int32_t slot, float *row);

/* ---- runner --------------------------------------------------------------------------------- */
typedef struct kdt_gpu_runner_options {
    int32_t max_rows;       /* rows of one pass: decode S, verify S * max_nodes, prefill chunk */
    int32_t max_keys;       /* longest visible-key list (prefix + tree) a row may have;
                               0 = the model's max_position_embeddings */
    int32_t max_nodes;      /* verify: the largest tree stride (max_nodes) accepted; 0 = 64 */
    int32_t max_taps;       /* taps per row in the output buffer, 0..KDT_MODEL_MAX_TAPS */
    int32_t logits;         /* 1: keep a [max_rows][V] fp32 logits buffer */
    int32_t attn_heads_per_item; /* 0 = automatic, 16 or 64 (tests; results do not change) */
    void *stream;           /* cudaStream_t to run on; NULL = a stream the runner creates */
    int32_t prefill_attention; /* a kdt_prefill_attention for prefill passes (0 = absorbed). Plain
                               or auto allocate per-head key / value scratch for up to
                               KDT_GPU_PLAIN_MAX_KEYS keys (4 x H x keys x ~(d_n + d_r + d_v)
                               bytes: bf16 hi / lo pairs; 1.34 GB for Kimi); a chunk that sees
                               more keys runs in blocks of that many, each row's softmax state
                               kept between them (max_rows x H x (d_v + 8) floats more; the
                               same bits). Plain needs d_n + d_r <= 256,
                               d_v <= 256 and the shared memory for them (else
                               KDT_ERR_UNSUPPORTED; auto then stays absorbed). */
    int32_t max_tree_rows;  /* the most rows of a device-staged verify pass
                               (kdt_gpu_stage_verify_device: streams x max_nodes); 0 = max_nodes.
                               Such a pass runs its attention in one launch, so the partial
                               workspace holds its worst case (max_tree_rows x the splits of a
                               max_keys row) whatever attn_workspace_kb says */
    int32_t attn_workspace_kb; /* the absorbed attention's split partials, KiB (0 = 524288, i.e.
                               512 MiB; at least what max_tree_rows needs). A host-staged pass
                               whose rows need more (a long prefill chunk over a long prefix:
                               2,048 rows x 64 splits of a Kimi row are 17 GB) runs its attention
                               in windows of consecutive rows that fit; a row's bits do not
                               depend on the windows */
} kdt_gpu_runner_options;
#define KDT_GPU_PLAIN_MAX_KEYS 16384

/* Switches a runner created with plain or auto prefill attention between the three forms (the
 * scratch stays); a runner created absorbed accepts only absorbed. For A/B measurements. */
kdt_status kdt_gpu_runner_set_prefill_attention(kdt_gpu_runner *r, int32_t prefill_attention);

kdt_status kdt_gpu_runner_create(const kdt_gpu_model *g, const kdt_gpu_runner_options *opt,
                                 kdt_gpu_runner **out);
void kdt_gpu_runner_free(kdt_gpu_runner *r);
void *kdt_gpu_runner_stream(kdt_gpu_runner *r);
kdt_status kdt_gpu_runner_sync(kdt_gpu_runner *r);

/* How a GPU pass's cost grows with its rows: a pass of r rows (streams x tree stride) costs about
 * what max(first, r rounded up to a multiple of step) rows cost, from the GEMM tiles. The engine's
 * auto budget fills trees up to these steps (docs/engine.md). */
void kdt_gpu_row_padding(int32_t *first, int32_t *step);

/* Synchronous forward passes: kdt_model_prefill / _decode / _verify on the GPU (host arrays in
 * and out; out may be NULL). prefill runs in chunks of max_rows rows. Outputs needing buffers the
 * runner was not created with (logits without opt.logits, more than max_taps taps) are refused. */
kdt_status kdt_gpu_prefill(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, const int32_t *tokens,
                           int32_t n, const kdt_model_outputs *out);
kdt_status kdt_gpu_decode(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams,
                          const int32_t *stream_ids, const int32_t *tokens,
                          const kdt_model_outputs *out);
kdt_status kdt_gpu_verify(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *tree,
                          const int32_t *stream_ids, const kdt_model_outputs *out);

/* After verify + kdt_tree_accept_cpu: moves the accepted rows with kdt_kv_commit_cuda and sets
 * each stream's length to prefix + tau (host arrays, as kdt_kv_cache_commit). Synchronous. */
kdt_status kdt_gpu_kv_commit(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams,
                             const int32_t *stream_ids, const int32_t *accepted, const int32_t *tau);
/* Benchmark helper: fills slots 0..n_slots-1 of `stream` in every layer with N(0, 1) bf16 values
 * (a stand-in for a prefilled context) and sets its length to n_slots. */
kdt_status kdt_gpu_kv_fill_random(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, int32_t n_slots,
                                  uint64_t seed);

/* Asynchronous form. Staging validates exactly like the synchronous calls, reserves pages,
 * advances the host-side lengths (decode/prefill; verify records the written tree rows) and
 * enqueues the copy of the batch description; rows are numbered in the order given (prefill:
 * token i; decode: stream s; verify: stream-major over each tree's nodes). */
kdt_status kdt_gpu_stage_prefill(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream,
                                 const int32_t *tokens, int32_t n, int32_t last_only);
/* Several streams' prefill rows in one pass (a MoE layer streams its experts once for all of
 * them): segment k's rows follow segment k - 1's, each row causal over its own stream's slots. A
 * stream appears at most once; the rows together fit max_rows. Each segment takes the attention
 * form a pass of its rows alone would take, so every row's outputs are bitwise those of its own
 * kdt_gpu_stage_prefill pass. last_only: output row k is segment k's last row; else output row i
 * is the pass's row i. kdt_gpu_stage_prefill is this with one segment. */
kdt_status kdt_gpu_stage_prefill_many(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_segments,
                                      const kdt_prefill_segment *segs, int32_t last_only);
kdt_status kdt_gpu_stage_decode(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams,
                                const int32_t *stream_ids, const int32_t *tokens);
kdt_status kdt_gpu_stage_verify(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *tree,
                                const int32_t *stream_ids);

/* Verify of a tree that lives on the device (built there by kdt_tree_build_cuda on the runner's
 * stream): d_tree's arrays are device pointers; only n_streams and max_nodes are read on the host.
 * The host does not know n_nodes, so tree stream s gives bounds (host arrays [S]):
 * n_nodes <= node_bound[s] <= max_nodes (slots reserved; more nodes are cut off on the device)
 * and depth <= depth_bound[s] (positions checked up to length + depth_bound). The rows
 * (stream-major, compact) are numbered by the next kdt_gpu_run, on the device, so the staging
 * may precede the tree build; outputs are indexed s * max_nodes + i like kdt_gpu_verify's. The
 * tree's contents are trusted: they must come from tree_build (well formed by construction). */
kdt_status kdt_gpu_stage_verify_device(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *d_tree,
                                       const int32_t *stream_ids, const int32_t *node_bound,
                                       const int32_t *depth_bound);

typedef struct kdt_gpu_run_config {
    int32_t max_rows;       /* launch bound, 1..runner max_rows; staged rows must fit it */
    int32_t logits;         /* write logits rows (needs runner opt.logits) */
    int32_t argmax;         /* write the fused argmax */
    int32_t n_taps;         /* 0..runner max_taps */
    const int32_t *tap_layers; /* [n_taps] (copied) */
} kdt_gpu_run_config;

/* Enqueues the forward of the staged batch on the runner's stream (capturable). */
kdt_status kdt_gpu_run(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_gpu_run_config *rc);

/* The runner's device outputs, indexed like the CPU outputs of the staged call:
 *   argmax [max_rows] int32, logits [max_rows][V] fp32 (NULL without opt.logits),
 *   taps [max_rows][max_taps][D] fp32 (tap t of a row at [row][t]; NULL when max_taps is 0).
 * Rows that the staged call does not produce are left as they were. */
typedef struct kdt_gpu_outputs {
    int32_t *argmax;
    float *logits;
    float *taps;
    int32_t max_rows, vocab, max_taps, hidden;
} kdt_gpu_outputs;
kdt_status kdt_gpu_runner_outputs(kdt_gpu_runner *r, kdt_gpu_outputs *out);

/* CUDA graph of kdt_gpu_run(r, c, rc); launch replays it on the runner's stream. */
kdt_status kdt_gpu_graph_capture(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_gpu_run_config *rc,
                                 kdt_gpu_graph **out);
kdt_status kdt_gpu_graph_launch(kdt_gpu_graph *g);
void kdt_gpu_graph_free(kdt_gpu_graph *g);

/* How many rows of the last pass each expert of MoE layer `layer` received: counts[E] routed,
 * counts[E] = shared-expert rows (synchronous). KDT_ERR_INVALID_ARG for a dense layer. */
kdt_status kdt_gpu_runner_expert_counts(kdt_gpu_runner *r, int32_t layer, int32_t *counts);
/* Benchmark helper: evicts the L2 cache by reading a buffer of 4x its size (clean lines only). */
kdt_status kdt_gpu_runner_flush_l2(kdt_gpu_runner *r);
/* Profiling helper: later passes (and captures) of r run only their first n_steps operations (one
 * kernel or GEMM launch each, in issue order; 0 = all), so timing the cut passes one after
 * another attributes a pass's time to its steps at real clocks. A cut pass's outputs are
 * meaningless. kdt_gpu_runner_steps returns the step count of the last full pass and its first
 * min(count, cap) step names (static strings such as "o_proj"; the layer follows from the order). */
kdt_status kdt_gpu_runner_set_step_limit(kdt_gpu_runner *r, int32_t n_steps);
int32_t kdt_gpu_runner_steps(const kdt_gpu_runner *r, const char **names, int32_t cap);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_MODEL_H */
