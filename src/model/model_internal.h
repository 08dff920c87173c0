/* model_internal.h - what the model subsystem's files share: the safetensors reader, the weight
 * view (dtype tag + pointer + shape, converted to fp32 in one place), the per-layer weight
 * structs, the model and KV-cache structs. Not part of the public API. */
#ifndef KDT_MODEL_INTERNAL_H
#define KDT_MODEL_INTERNAL_H

#include "kdtree/model.h"
#include "common.h"

#include <stddef.h>
#include <stdint.h>
#include <math.h>

/* DeepSeek's yarn_get_mscale: the YaRN attention-magnitude factor for a context-extension
 * `scale` (1 when the context is not extended). Shared by the target's and the drafter's RoPE. */
static inline double kdt_yarn_mscale(double scale, double mscale) {
    return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* ---- tensor dtypes as safetensors names them ------------------------------------------------ */
typedef enum kdt_wtype {
    KDT_W_F32 = 0,
    KDT_W_BF16,
    KDT_W_F16,
    KDT_W_F8_E4M3,   /* FP8 e4m3 (block-quantized weights, see KDT_WF_FP8_BLOCK) */
    KDT_W_I32,       /* int32 (INT4 weight_packed words, weight_shape) */
    KDT_W_I64,
    KDT_W_OTHER,     /* any other dtype string: valid file, never a usable weight */
} kdt_wtype;

/* bytes per element, 0 for KDT_W_OTHER */
size_t kdt_wtype_size(kdt_wtype t);
const char *kdt_wtype_name(kdt_wtype t);

#define KDT_MAX_DIMS 4

/* One tensor of a safetensors file: a view into the mmap'ed data. */
typedef struct kdt_st_tensor {
    char *name;
    kdt_wtype dtype;
    char dtype_name[16];
    int32_t ndim;
    int64_t shape[KDT_MAX_DIMS];
    const void *data;       /* aligned to the element size (else an owned copy) */
    size_t nbytes;
    int32_t file;           /* index into kdt_st_set.files */
} kdt_st_tensor;

typedef struct kdt_st_file {
    char *path;
    void *map;              /* whole-file mapping */
    size_t map_size;
} kdt_st_file;

/* All tensors of a checkpoint (one file or the shards of an index), with a name hash. */
typedef struct kdt_st_set {
    kdt_st_file *files;
    int32_t n_files;
    kdt_st_tensor *tensors;
    int64_t n_tensors, cap_tensors;
    int64_t *hash;          /* [hash_cap] tensor index or -1 */
    int64_t hash_cap;
    void **owned;           /* aligned copies of misaligned tensors */
    int64_t n_owned;
} kdt_st_set;

/* Opens DIR's checkpoint (index + shards, or model.safetensors). */
kdt_status kdt_st_open_dir(const char *dir, int progress, kdt_st_set *out);
void kdt_st_close(kdt_st_set *s);
const kdt_st_tensor *kdt_st_find(const kdt_st_set *s, const char *name);

/* ---- weights ------------------------------------------------------------------------------- */
/* How a 2-D weight is stored. */
typedef enum kdt_wformat {
    KDT_WF_PLAIN = 0,   /* data [rows][cols] of dtype F32 / BF16 / F16 */
    KDT_WF_FP8_BLOCK,   /* data e4m3 [rows][cols]; scale fp32/bf16 [ceil(rows/gr)][ceil(cols/gc)];
                           W = e4m3 * scale (DeepSeek-V3, K2-Instruct: weight_scale_inv, 128x128) */
    KDT_WF_INT4_GROUP,  /* data int32 [rows][cols/8], 8 nibbles LSB first, value = nibble - 8;
                           scale [rows][cols/gc]; W = (nibble - 8) * scale (K2-Thinking/K2.5/K2.6
                           compressed-tensors pack-quantized routed experts, group 32) */
} kdt_wformat;

/* A 2-D (or 1-D) weight used by the forward: format + dtype tag + pointer + shape. Rows are
 * output features, columns input features ([out][in], as nn.Linear stores them). Every use goes
 * through kdt_weight_row_f32 / kdt_weight_matvec / kdt_weight_at (weights.c), the one place where
 * stored values become fp32. */
typedef struct kdt_weight {
    kdt_wformat format;
    kdt_wtype dtype;        /* of data (PLAIN) */
    const void *data;
    int64_t rows, cols;     /* logical shape; 1-D tensors: rows = 1, cols = n */
    const void *scale;      /* quantized formats */
    kdt_wtype scale_dtype;  /* F32 / BF16 / F16 */
    int32_t group_rows;     /* FP8: block rows (128); INT4: 1 */
    int32_t group_cols;     /* FP8: block cols (128); INT4: group size (32) */
    const char *name;       /* the tensor's name in the checkpoint (owned by the st_set) */
} kdt_weight;

/* y[r] = sum_c W[r][c] * x[c] for r in [r0, r1), sequential over c in fp32 (the rows spread over
 * the CPU threads; inside a parallel piece, on the calling thread). */
void kdt_weight_matvec(const kdt_weight *w, const float *x, float *y, int64_t r0, int64_t r1);
/* The same for R input rows: Y[i][r - r0] (rows ldy apart) = kdt_weight_matvec of X[i] (rows ldx
 * apart), bit for bit; each weight row is read once per block of rows. */
void kdt_weight_matmul(const kdt_weight *w, const float *X, int64_t ldx, int32_t R, float *Y, int64_t ldy,
                       int64_t r0, int64_t r1);
/* out[i] (rows ldo apart) = down(silu(gate x_i) * up x_i) for R rows x (ldx apart), every value as a
 * row alone computes it; g and u: R x gate->rows floats of scratch. */
void kdt_weight_swiglu_rows(const kdt_weight *gate, const kdt_weight *up, const kdt_weight *down, const float *x,
                            int64_t ldx, int32_t R, float *g, float *u, float *out, int64_t ldo);
/* dst[0..cols-1] = row r of W as fp32. */
void kdt_weight_row_f32(const kdt_weight *w, int64_t r, float *dst);
/* element i of a 1-D weight (or of row 0) as fp32 */
float kdt_weight_at(const kdt_weight *w, int64_t i);

typedef struct kdt_expert_weights {
    kdt_weight gate;        /* [I][D] */
    kdt_weight up;          /* [I][D] */
    kdt_weight down;        /* [D][I] */
} kdt_expert_weights;

typedef struct kdt_layer_weights {
    kdt_weight input_norm;  /* [D] */
    kdt_weight q_a;         /* [q_lora][D]          (q_lora_rank > 0) */
    kdt_weight q_a_norm;    /* [q_lora] */
    kdt_weight q_b;         /* [H*(d_n+d_r)][q_lora] */
    kdt_weight q_proj;      /* [H*(d_n+d_r)][D]     (q_lora_rank == 0) */
    kdt_weight kv_a;        /* [d_c+d_r][D] */
    kdt_weight kv_a_norm;   /* [d_c] */
    kdt_weight kv_b;        /* [H*(d_n+d_v)][d_c]: head h rows h*(d_n+d_v).. = W_UK[h] then W_UV[h] */
    kdt_weight o_proj;      /* [D][H*d_v] */
    kdt_weight post_norm;   /* [D] */
    int32_t is_moe;
    kdt_expert_weights dense;   /* dense MLP: I = intermediate_size */
    kdt_weight router;          /* [E][D] */
    kdt_weight router_bias;     /* [E] e_score_correction_bias */
    kdt_expert_weights *experts;/* [E], I = moe_intermediate_size */
    kdt_expert_weights shared;  /* I = n_shared * moe_intermediate_size */
} kdt_layer_weights;

struct kdt_model {
    kdt_model_config cfg;
    kdt_model_options opt;
    kdt_st_set st;
    char *dir;                  /* the checkpoint directory (for error messages) */
    char prefix[64];            /* tensor-name prefix ("" or "language_model.") */
    kdt_weight embed;           /* [V][D] */
    kdt_weight final_norm;      /* [D] */
    kdt_weight lm_head;         /* [V][D] (the embedding when tied) */
    kdt_layer_weights *layers;  /* [n_layers] */
    float *rope_inv_freq;       /* [d_r/2] fp32, computed like transformers does */
    kdt_wtype main_dtype;
};

/* config.json -> cfg (validated). text_config wrappers are unwrapped. `path` names the file. */
kdt_status kdt_config_parse(const char *json_text, size_t len, const char *path,
                            kdt_model_config *cfg);
/* Adds generation_config.json's eos_token_id(s) (int or list) to cfg's eos ids, without repeats. */
kdt_status kdt_config_merge_generation(const char *json_text, size_t len, const char *path,
                                       kdt_model_config *cfg);
/* The RoPE values a config may carry (the target's here, the DFlash drafter's in
 * src/engine/dflash.c); beyond them the fp32 frequencies are 0, NaN or reversed, or an int32 cast
 * overflows. Theta in (1, 1e30]. With YaRN: transformers' defaults for a 0 beta (fast 32, slow 1)
 * applied in place, then factor in [1, 1e6], beta_fast >= beta_slow > 0, mscales >= 0 and
 * original_max_position_embeddings an integer in 1..1e9, tested as a double before any cast.
 * KDT_ERR_FORMAT naming `path` otherwise. */
kdt_status kdt_rope_check_theta(const char *path, double theta);
kdt_status kdt_rope_settle_yarn(const char *path, double factor, double *beta_fast, double *beta_slow,
                                double mscale, double mscale_all_dim, double original_max);
/* inv_freq[d_r/2] for the config's RoPE, in fp32 as transformers computes it. */
void kdt_rope_inv_freq(const kdt_model_config *cfg, float *inv_freq);

/* ---- KV cache -------------------------------------------------------------------------------- */
/* The host bookkeeping of a paged KV cache (pages.c), as a view into the owning cache's arrays:
 * the CPU cache and the GPU cache's host mirror follow the same rules through it. */
typedef struct kdt_pages {
    const char *who;              /* "KV cache" / "GPU KV cache", for messages */
    int32_t max_streams, max_pages, n_pages, page_size;
    int32_t *block_table;         /* [max_streams][max_pages], -1 = none */
    int32_t *n_stream_pages;      /* [max_streams] pages held (a prefix of the block-table row) */
    int32_t *length, *written;    /* [max_streams] committed tokens; slots written (>= length) */
    int32_t *free_list;           /* [n_pages] stack of free page ids */
    int32_t *n_free;
} kdt_pages;

/* Empty block tables and lengths; every page free, handed out in increasing id order. */
void kdt_pages_reset(const kdt_pages *p);
/* New pages that streams[i] need for need[i] slots, summed into *total; KDT_ERR_CAPACITY (nothing
 * changed) when a stream outgrows its block table or the pool is short. */
kdt_status kdt_pages_count_new(const kdt_pages *p, int32_t n, const int32_t *streams, const int32_t *need,
                               int64_t *total);
/* Hands those pages out (cannot fail once kdt_pages_count_new succeeded); on_page, if given, sees
 * each (block-table index, page). */
void kdt_pages_assign(const kdt_pages *p, int32_t n, const int32_t *streams, const int32_t *need,
                      void (*on_page)(void *user, int32_t index, int32_t page), void *user);
/* Returns stream s's pages past the first keep_pages to the pool. */
void kdt_pages_release_from(const kdt_pages *p, int32_t s, int32_t keep_pages);
/* All of a stream's pages back, lengths 0 (fn names the caller in errors). */
kdt_status kdt_pages_release(const kdt_pages *p, const char *fn, int32_t stream);
/* Committed length = written = len (len <= written) and the pages past it back to the pool. */
kdt_status kdt_pages_set_length(const kdt_pages *p, const char *fn, int32_t stream, int32_t len);

struct kdt_kv_cache {
    int32_t n_layers, n_pages, page_size, row_elems, max_streams, max_pages;
    float *data;                /* [n_layers][n_pages][page_size][row_elems] */
    int32_t *block_table;       /* [max_streams][max_pages], -1 = none */
    int32_t *n_stream_pages;    /* [max_streams] pages held (a prefix of the block-table row) */
    int32_t *length;            /* [max_streams] committed tokens */
    int32_t *written;           /* [max_streams] slots written so far (>= length) */
    int32_t *free_list;         /* [n_pages] stack of free page ids */
    int32_t n_free;
    int32_t max_position;       /* model's max_position_embeddings */
};

/* &row (fp32 [row_elems]) of slot t of stream s in layer l; the page must exist. */
static inline float *kdt_kv_row(const kdt_kv_cache *c, int32_t l, int32_t s, int32_t t) {
    int32_t page = c->block_table[(int64_t)s * c->max_pages + t / c->page_size];
    return c->data + (((int64_t)l * c->n_pages + page) * c->page_size + t % c->page_size) *
                         (int64_t)c->row_elems;
}

/* ---- the CPU attention core (attn_cpu.c) ---- */
/* One query row, n_heads <= 8 heads, over keys[n_keys] (cache rows [dc + dr], increasing slots):
 * qlat [n_heads][dc + dr] absorbed queries in; p [n_heads][n_keys] scratch (the softmax weights
 * after); olat [n_heads][dc] the normalised latent outputs; qt [dc + dr][8] scratch. Plain C or
 * AVX2 (run-time choice), the same bits. */
void kdt_cpu_attend(const float *const *keys, int32_t n_keys, int32_t dc, int32_t dr, float scale, int32_t n_heads,
                    const float *qlat, float *p, float *olat, float *qt);
/* p[h][t] = (sum over e ascending of q_h[e] * keys[t][e]) * scale for n_q <= 8 queries q_h = q +
 * h q_stride (p rows n_keys apart); qt [dim][8] scratch. Plain C or AVX2, the same bits. */
void kdt_cpu_scores(const float *const *keys, int32_t n_keys, int32_t dim, float scale, int32_t n_q, const float *q,
                    int64_t q_stride, float *p, float *qt);
/* s[t] = expf(s[t] - max s) for t < n; returns their sum (t ascending). */
float kdt_cpu_softmax_weights(float *s, int32_t n);
/* out[e] = sum over t ascending of w[t] * rows[t][e], e < cols (plain C or AVX2, the same bits). */
void kdt_cpu_weighted_sum(const float *w, const float *const *rows, int32_t n, int32_t cols, float *out);

/* Whether a prefill chunk of n_rows rows after prefix_len committed tokens takes the plain form
 * under `form` (a kdt_prefill_attention): plain always, auto when kdt_prefill_plain_pays. The CPU
 * forward and the GPU staging both decide by it. */
int kdt_prefill_takes_plain(const kdt_model_config *c, int32_t form, int32_t n_rows, int32_t prefix_len);

/* Ensures every stream in streams[0..n) has pages for need[i] slots; all-or-nothing. */
kdt_status kdt_kv_reserve_many(kdt_kv_cache *c, int32_t n, const int32_t *streams,
                               const int32_t *need);

/* ---- argument checks the CPU and GPU forward passes share (checks.c) ---- */
/* ids[s] = stream_ids[s] (or s when stream_ids is NULL) for s < n, checked: each in
 * 0..max_streams-1 and none repeated; otherwise KDT_ERR_INVALID_ARG naming fn and the entry. */
kdt_status kdt_resolve_stream_ids(const char *fn, const int32_t *stream_ids, int32_t n, int32_t max_streams,
                                  int32_t *ids);
/* tok is a token id of the vocabulary; otherwise KDT_ERR_INVALID_ARG naming fn and what[i]. */
kdt_status kdt_check_token(const char *fn, const kdt_model_config *cfg, int32_t tok, const char *what, int64_t i);
/* The segments of a multi-stream prefill (kdt_model_prefill_many, kdt_gpu_stage_prefill_many): 1 ..
 * max_streams of them, streams in range and distinct, tokens in the vocabulary, each 1 .. seg_max
 * rows and all together at most total_max (the *_what strings name those bounds), every stream's
 * length[] + n within max_position_embeddings. KDT_ERR_INVALID_ARG / KDT_ERR_CAPACITY naming fn. */
kdt_status kdt_check_prefill_segments(const char *fn, const kdt_model_config *cfg, int32_t n_segments,
                                      const kdt_prefill_segment *segs, int32_t max_streams, const int32_t *length,
                                      int32_t seg_max, const char *seg_max_what, int32_t total_max,
                                      const char *total_max_what);
/* Tree stream s of a verify call for a stream of committed length P: 1..max_nodes nodes, parents
 * before children, depths and positions (P + depth) consistent and below max_position_embeddings,
 * tokens in the vocabulary, ancestor masks = {itself} + the parent's. KDT_ERR_MALFORMED_TREE /
 * KDT_ERR_CAPACITY / KDT_ERR_INVALID_ARG naming fn, the stream and the node. *max_depth (if not
 * NULL): the deepest node's depth. */
kdt_status kdt_check_tree_stream(const char *fn, const kdt_model_config *cfg, const kdt_tree *t, int32_t s, int32_t P,
                                 int32_t *max_depth);

#endif
