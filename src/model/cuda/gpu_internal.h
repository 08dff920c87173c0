/* gpu_internal.h - what the GPU forward's files share (src/model/cuda/): the device weight
 * layout of kdt_gpu_model, the GPU KV cache and runner structs, the staged batch description
 * (one row per query token), and the launchers of the kernels in gpu_gemm.cu, gpu_attn.cu and
 * gpu_ops.cu. Plain C so gpu_kv.c can include it; not part of the public API.
 *
 * Conventions: every 2-D weight is bf16 [rows][ld] with ld = cols rounded up to 64 and the
 * padding columns zero (the GEMM walks K in 64-wide blocks); activations are fp32; "rows" are
 * the query tokens of one pass (R <= max_rows), numbered as staged; M (the row count) is read
 * from device memory by every kernel, so one launch sequence serves any batch that fits it. */
#ifndef KDT_GPU_INTERNAL_H
#define KDT_GPU_INTERNAL_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kdtree/model.h"
#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An environment switch of the GPU forward: true when it is set and starts with c ('1' for the
 * opt-in switches, '0' for turning a default off; unset is neither). */
static inline int kdt_g_env_is(const char *name, char c) {
    const char *e = getenv(name);
    return e != NULL && e[0] == c;
}

#define KDT_G_BK 64           /* K block of the GEMM: every weight ld is a multiple of it */
#define KDT_G_BN 64           /* output columns per GEMM CTA */
#define KDT_G_BM 64           /* rows per GEMM pass */
#define KDT_G_ITEM_ROWS_MIN 32 /* smallest item of the MoE plan (sizes the item list) */
#define KDT_G_GU_BLOCK 32     /* gate/up interleave: 32 gate rows then 32 up rows per 64 */
#define KDT_G_ATT_TILE 32     /* keys per attention tile */
/* The attention's split rule (gpu_attn.cu split_keys) sets every GPU result's bits, so it is fixed
 * at build time; the #ifndef lets a measurement build try another rule (pass the -D to both
 * CMAKE_C_FLAGS and CMAKE_CUDA_FLAGS: gpu_forward.c sizes the partials with them too). */
#ifndef KDT_G_ATT_SPLIT
#define KDT_G_ATT_SPLIT 512   /* most keys per attention split of rows with 4097..32768 keys */
#endif
#ifndef KDT_G_ATT_SPLIT_SHORT
#define KDT_G_ATT_SPLIT_SHORT 128 /* keys per split of rows with <= KDT_G_ATT_SHORT_KEYS keys: short
                                     rows get more CTAs (a decode row is otherwise one serial CTA) */
#endif
#ifndef KDT_G_ATT_TARGET_SPLITS
#define KDT_G_ATT_TARGET_SPLITS 32 /* splits a row of KDT_G_ATT_SHORT_KEYS.. keys aims at */
#endif
#define KDT_G_ATT_SHORT_KEYS 4096
#define KDT_G_ATT_MAX_SPLITS 64
#define KDT_GPU_TREE_STREAMS 64 /* streams of one device-staged verify pass */
#define KDT_G_SPLIT_TARGET 264 /* CTAs the split-K rule aims at (2 x 132 SMs), a constant so
                                  results never depend on the device */

static inline int64_t kdt_g_round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* The "rows x column chunks" grid of the row-wise kernels (gpu_ops.cu, attn_combine): each row's
 * `width` columns are cut into chunks of a multiple of `unit` columns, one CTA per (row, chunk),
 * so that a pass over few rows (a decode) still gets about KDT_G_SPLIT_TARGET CTAs; from
 * KDT_G_SPLIT_TARGET rows up a row is one chunk. The rule reads the launch bound and the shape
 * only, never the device-side row count, so a captured graph serves every batch that fits it; the
 * kernels keep a column's arithmetic the same in any chunk, so results never depend on the rule.
 * Returns the columns per chunk (chunks per row: width divided by it, rounded up). */
static inline int32_t kdt_g_chunk_cols(int32_t max_rows, int32_t width, int32_t unit) {
    const int64_t units = width > unit ? ((int64_t)width + unit - 1) / unit : 1;
    int64_t want = (KDT_G_SPLIT_TARGET + (int64_t)max_rows - 1) / (max_rows > 1 ? max_rows : 1);
    if (want > units) want = units;
    if (want < 1) want = 1;
    return (int32_t)((units + want - 1) / want * unit);
}

/* A bf16 weight on the device: `batch` matrices [rows][ld] at batch_stride elements apart. */
typedef struct kdt_gmat {
    uint16_t *w;
    int32_t rows, cols, ld;
    int32_t batch;
    int64_t batch_stride;
    int32_t tiled;          /* in kdt_gemm_tile64's layout (KDT_GPU_TILED_DENSE / _EXPERTS) */
} kdt_gmat;

/* One expert of the grouped MoE GEMMs (device array per layer: E routed, then the shared
 * expert(s) as one more). */
typedef struct kdt_gpu_expert {
    const uint16_t *gu;     /* [2 * i_pad][ld_d]: per 64 rows, 32 gate rows then 32 up rows */
    const uint16_t *down;   /* [D][ld_i] */
    int32_t inter;          /* I */
    int32_t i_pad;          /* I rounded up to 32 */
    int32_t ld_d;           /* ld of gu (D rounded up to 64) */
    int32_t ld_i;           /* ld of down (I rounded up to 64) */
} kdt_gpu_expert;

typedef struct kdt_gpu_layer {
    float *input_norm, *post_norm;  /* [D] */
    float *q_a_norm;                /* [q_lora] or NULL */
    float *kv_a_norm;               /* [d_c] */
    kdt_gmat w_a;                   /* [q_lora + d_c + d_r][D]: q_a rows, then kv_a rows */
    kdt_gmat q_b;                   /* [H * (d_n + d_r)][q_lora] (or q_proj [..][D]) */
    kdt_gmat uk_t;                  /* batch H: [d_c][d_n]  W_UK[h] transposed */
    kdt_gmat uv;                    /* batch H: [d_v][d_c]  W_UV[h] */
    kdt_gmat o_proj;                /* [D][H * d_v] */
    int32_t is_moe;
    kdt_gmat dense_gu;              /* [2 * i_pad][D] interleaved like kdt_gpu_expert.gu */
    kdt_gmat dense_down;            /* [D][I] */
    int32_t dense_inter;
    kdt_gmat router;                /* [E][D] */
    float *router_bias;             /* [E] */
    kdt_gmat experts_gu;            /* batch E: [2 * i_pad][D] */
    kdt_gmat experts_down;          /* batch E: [D][I] */
    kdt_gmat shared_gu, shared_down;/* n_shared * I wide; rows 0 when there is none */
    kdt_gpu_expert *experts;        /* device [E + has_shared] */
    int32_t n_expert_desc;
} kdt_gpu_layer;

struct kdt_gpu_model {
    kdt_model_config cfg;
    int32_t device;
    int32_t n_sm;
    size_t smem_optin;              /* max dynamic shared memory per block */
    kdt_gmat embed;                 /* [V][D] */
    kdt_gmat lm_head;               /* [V][D] (may share embed's memory) */
    float *final_norm;              /* [D] */
    float *rope_cs;                 /* [rope_rows][d_r / 2] (cos, sin) pairs, attention factor in */
    int32_t rope_rows;
    int32_t kv_row_stride;          /* elements per cache row: d_c + d_r rounded up to 8 */
    kdt_gpu_layer *layers;          /* host array [n_layers] */
    int32_t has_shared;
    int32_t max_inter_pad;          /* widest i_pad over routed / shared / dense MLPs */
    int32_t experts_tiled;          /* expert gu / down in kdt_gemm_tile64's layout */
    void **allocs;                  /* every cudaMalloc of the model, freed together */
    int32_t n_allocs, cap_allocs;
    size_t total_bytes;
};

/* ---- the GPU KV cache (page logic mirrors kv_cache.c) ----------------------------------- */
struct kdt_gpu_kv {
    int32_t device;
    int32_t n_layers, n_pages, page_size, row_elems, row_stride, max_streams, max_pages;
    int32_t max_position;
    uint16_t *cache;                /* device bf16 [n_layers][n_pages][page_size][row_stride] */
    int64_t layer_stride;           /* elements */
    int32_t *d_block_table;         /* device [max_streams][max_pages] */
    int32_t *block_table;           /* host mirror */
    int32_t *n_stream_pages, *length, *written, *free_list;
    int32_t n_free;
    int32_t *pending;               /* (table index, page) pairs not yet on the device */
    int64_t n_pending, cap_pending;
};

/* Ensures every stream in streams[0..n) has pages for need[i] slots; all-or-nothing. New
 * entries go to the pending list. */
kdt_status kdt_gkv_reserve_many(kdt_gpu_kv *c, int32_t n, const int32_t *streams, const int32_t *need);
/* Copies every pending block-table entry to the device now (synchronous). */
kdt_status kdt_gkv_flush_pending_sync(kdt_gpu_kv *c);

/* ---- one staged pass ---------------------------------------------------------------------- */
/* A query row. Visible keys, in list order: slots 0..n_prefix-1, then slot n_prefix + j for
 * every bit j set in its mask row (verify), ascending. n_keys counts them. */
typedef struct kdt_grow {
    int32_t stream;     /* cache stream (block-table row) */
    int32_t token;
    int32_t pos;        /* RoPE position */
    int32_t slot;       /* where its KV row is written */
    int32_t n_prefix;
    int32_t n_keys;
    int32_t mask_off;   /* first uint64 of its mask row in the staged masks, -1 = none */
    int32_t mask_words;
    int32_t split_off;  /* its first attention split (prefix sum over rows) */
    int32_t out_index;  /* logits / argmax row, -1 = none */
    int32_t tap_index;  /* taps row, -1 = none */
    int32_t pad;
} kdt_grow;

typedef struct kdt_gstage_hdr {
    int32_t n_rows;
    int32_t n_head;         /* rows that need the lm_head (out_index >= 0) */
    int32_t total_splits;   /* attention splits over all rows */
    int32_t n_updates;      /* block-table updates (applied by the staging itself) */
    int32_t pad[4];
} kdt_gstage_hdr;

enum { KDT_GPU_STEP_NAMES = 256 };

/* One prefill segment that takes the plain attention form: `rows` rows of the pass from row0 on,
 * the stream's slots first .. first + rows - 1. */
typedef struct kdt_plain_seg {
    int32_t stream, first, rows, row0;
} kdt_plain_seg;

struct kdt_gpu_runner {
    const kdt_gpu_model *g;
    kdt_gpu_runner_options opt;
    cudaStream_t stream;
    int32_t own_stream;
    /* staging: the same byte layout in pinned host memory (two, alternating) and on the device */
    unsigned char *h_stage[2];
    cudaEvent_t stage_done[2];
    int32_t stage_idx;
    unsigned char *d_stage;
    size_t off_rows, off_head, off_updates, off_streams, off_windows, off_masks, stage_bytes;
    int32_t cap_updates, mask_words_max;
    int32_t staged_rows;            /* rows of the last staged pass (host copy) */
    kdt_tree dtree;                 /* kdt_gpu_stage_verify_device: the device tree whose rows */
    int32_t dtree_pending;          /* kdt_gpu_run numbers first (1 until the next staging) */
    int32_t stages;                 /* GEMM pipeline depth for this device */
    int32_t max_splits_total;       /* attention partial slots */
    int32_t tree_rows;              /* opt.max_tree_rows resolved: device-staged passes' rows */
    /* attention windows of the staged pass (stage_end): consecutive rows whose splits fit the
     * partials; window w is rows [win_row[w], win_row[w + 1]), its header (n_rows, total_splits)
     * at off_windows + w in the staging. One window runs off the main header, as before. */
    int32_t n_windows, max_windows;
    int *win_row;                   /* [max_windows + 1] (host) */
    int *win_splits;                /* [max_windows] (host) */
    int *cut_row, *cut_splits;      /* the same for the pass being staged (stage_end), and */
    int *row_splits;                /* [max_rows] its rows' splits, then their offsets */
    /* activations and scratch (device) */
    float *x, *xn;                  /* [max_rows][D] */
    float *qa;                      /* [max_rows][q_lora] */
    float *q_nope;                  /* [max_rows][H][d_n] */
    float *q_abs;                   /* [max_rows][H][d_c + d_r] */
    float *o_lat;                   /* [max_rows][H][d_c] */
    float *heads;                   /* [max_rows][H * d_v] */
    float *part;                    /* split-K partials of the dense GEMMs */
    size_t part_floats;
    uint16_t *x_hl, *x_hl_side;     /* kdt_gemm_wg_ss_on at creation: X's bf16 hi / lo planes for the
                                       wgmma GEMMs (kdt_gemm_launch_ws, kdt_grouped_launch_ws): the
                                       main stream's (dense and MoE), the side stream's (dense) */
    int64_t x_hl_elems, x_hl_side_elems;
    float *att_o, *att_m, *att_l;   /* attention partials [splits][H][d_c], [splits][H] */
    int32_t *sel;                   /* [max_rows][top_k] selected experts, ascending */
    float *wgt;                     /* [max_rows][top_k] their weights */
    int32_t *pos_of;                /* [max_rows][top_k] pair index of (row, slot) */
    int32_t *pos_shared;            /* [max_rows] pair index of the row's shared-expert pair */
    int32_t *pair_row, *pair_expert;/* [max_pairs] */
    int32_t *items;                 /* [max_items][3] (expert, first pair, rows) */
    int32_t *moe_counts;            /* [2]: n_items, n_pairs */
    int32_t *expert_counts;         /* [n_layers][E + 1] rows per expert, last pass */
    int32_t max_pairs, max_items;
    float *moe_part;                /* [max_pairs][2 * max_inter_pad] */
    float *h;                       /* [max(max_pairs, max_rows)][ld of the widest MLP] */
    int32_t ld_h;
    float *moe_y;                   /* [max_pairs][D] */
    /* the shared expert apart (gpu_forward.c, shared_apart): a dense MLP on a second stream
     * forked after post_o, with its own split-K partials (the main stream's router uses part) */
    cudaStream_t side;
    cudaEvent_t ev_fork, ev_join;
    float *part_sh;                 /* split-K partials of its gate/up, then of its down */
    size_t part_sh_floats;
    float *h_sh;                    /* [max_rows][ld_h] its SwiGLU output */
    float *xn_head;                 /* [max_rows][D] */
    float *am_val;                  /* [vocab tiles][max_rows] */
    int32_t *am_idx;
    /* outputs */
    int32_t *d_argmax;              /* [max_rows] */
    float *d_logits;                /* [max_rows][V] or NULL */
    float *d_taps;                  /* [max_rows][max_taps][D] or NULL */
    /* misc */
    int32_t *commit_buf;            /* device scratch for kdt_gpu_kv_commit */
    size_t commit_bytes;
    float *flush_buf;
    size_t flush_bytes;
    void **allocs;
    int32_t n_allocs, cap_allocs;
    /* the plain prefill form (gpu_plain.cu): scratch when opt.prefill_attention allows it */
    uint16_t *plain_k, *plain_v;    /* [2][H][plain_cap][plain_dqk], [2][H][plain_cap][plain_dv]: hi, lo */
    int32_t plain_cap, plain_dqk, plain_dv, plain_stages;
    int32_t plain_wg;               /* the attention on wgmma (plain_attn_wg): on a device that
                                       runs it, d_v padded to 64 or 128, its shared memory allowed,
                                       unless KDT_GPU_PLAIN_WG=0 */
    float *plain_state;             /* [max_rows][H][plain_dv + 8] softmax states between key blocks
                                       (only when max_keys > plain_cap) */
    /* the staged pass's attention forms: the absorbed one over every row (decode, verify, and
     * prefill segments that take it), then the plain one per prefill segment that takes it (its
     * rows' heads overwritten; kdt_gpu_stage_prefill_many) */
    int32_t staged_absorbed;
    kdt_plain_seg *plain_segs;
    int32_t n_plain, cap_plain;
    /* profiling (kdt_gpu_runner_set_step_limit): steps of a pass, the last full pass's names */
    int32_t step_limit, n_steps;
    const char *step_names[KDT_GPU_STEP_NAMES];
};

struct kdt_gpu_graph {
    kdt_gpu_runner *r;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    int32_t max_rows;               /* the captured launch bound */
    int32_t absorbed, n_plain;      /* captured for these attention forms and plain segments */
    kdt_plain_seg *plain;
    int32_t n_windows;              /* and these attention windows (row bounds: win_row) */
    int *win_row;
};

/* 1 when the forward's row kernels, attention, router and gate/up GEMM go out with programmatic
 * dependent launch (gpu_gemm.cu; KDT_GPU_PDL=0 or KDT_GPU_PDL_ROWS=0: not) */
int kdt_g_pdl_rows(void);

/* ---- kernel launchers (all asynchronous on `s`; they only fail on launch errors) ---------- */
/* Split-K rule of the dense GEMMs: a function of the weight shape only. */
void kdt_gemm_plan(int32_t n, int32_t ldw, int32_t batch, int32_t *splits, int32_t *k_chunk);

/* Y_s[m][n] = sum over K-split s of X[m][k] W[n][k]: partials, summed by the caller's next kernel
 * in split order. Batch b uses x + b*x_batch, w + b*w_batch, y + b*y_batch. */
typedef struct kdt_gemm_args {
    const float *x; int64_t ldx, x_batch; int32_t kx;  /* X fp32 [M][ldx]; columns >= kx read as 0 */
    const int32_t *x_rows;                             /* optional: pass row m reads X row x_rows[m] */
    const uint16_t *w; int32_t ldw;
    int32_t tiled;                                     /* W in kdt_gemm_tile64's layout: v2 only (in
                                                          the padding before w_batch: a field at the
                                                          end made ptxas give the default kernel 121
                                                          registers instead of 110) */
    int64_t w_batch; int32_t n;
    float *y; int64_t ldy, y_split, y_batch;
    const int32_t *m_dev; int32_t m_max;               /* rows: *m_dev on the device, <= m_max */
    int32_t batch, splits, k_chunk;
} kdt_gemm_args;
kdt_status kdt_gemm_launch(const kdt_gemm_args *a, int32_t stages, cudaStream_t s);
/* the same, launched without programmatic dependence when plain (a full dependency) */
kdt_status kdt_gemm_launch_plain(const kdt_gemm_args *a, int32_t stages, cudaStream_t s, int plain);
/* the same, with a workspace of ws_elems bf16 for X's hi / lo planes (kdt_gemm_wg_ss_elems(rows,
 * max ldw)): a launch of >= 64 rows (KDT_GEMM_WG_MIN) on a wgmma device splits X there first and
 * reads A from shared memory (gemm_wg.cuh; KDT_GEMM_WG_SS=0: not); the same bits */
kdt_status kdt_gemm_launch_ws(const kdt_gemm_args *a, int32_t stages, cudaStream_t s, int plain, uint16_t *ws,
                              int64_t ws_elems);
/* 1 when a runner on the current device should allocate that workspace (wgmma code, the ss forms
 * not switched off) */
int kdt_gemm_wg_ss_on(void);
int64_t kdt_gemm_wg_ss_elems(int32_t rows, int32_t max_ld);

/* Grouped MoE GEMM over the item list: which = 0 gate/up (X rows gathered by pair_row, K = D,
 * N = 2 i_pad of the item's expert), 1 down (X = h rows in pair order, K = I, N = D). */
typedef struct kdt_grouped_args {
    int32_t which;
    int32_t n_pairs_hint;       /* (token, expert) pairs the launch can have, shared ones included
                                   (0 = unknown): with n_items_hint, sizes the pool (in the
                                   padding after `which`) */
    const float *x; int64_t ldx;
    const int32_t *pair_row;
    const kdt_gpu_expert *experts;
    const int32_t *items, *n_items;
    float *y; int64_t ldy;
    int32_t n_max, kd;          /* widest N over experts; D (gate/up K) */
    int32_t grid_items;
    int32_t max_item_rows;      /* most rows an item can have (<= 64; 0 = 64): sizes v3's passes */
    int32_t n_items_hint;       /* expected items (0 = grid_items): balances v3's persistent grid */
    int32_t tiled;              /* the experts' gu / down are in the 64 x 64 tiled layout
                                   (kdt_gemm_tile64): only v2 reads it, so v1 / v3 are skipped */
    float *h; int64_t ldh;      /* gate/up with h != NULL: the CTAs write h = SwiGLU(gate, up)
                                   [pair][ldh] (columns < the expert's inter) instead of y, the
                                   bits k_swiglu would write (kdt_grouped_fuses_swiglu) */
    int32_t ss_min_rows;        /* set by kdt_grouped_launch_ws for its two-kernel launches: > 0,
                                   the wgmma ss kernel runs when the plan's pairs >= ss_min_rows x
                                   its items (n_items[1], n_items[0]), the v2 kernel otherwise */
} kdt_grouped_args;
kdt_status kdt_grouped_launch(const kdt_grouped_args *a, int32_t stages, cudaStream_t s);
/* with a workspace for the wgmma kernel's A planes (as kdt_gemm_launch_ws; pairs >= 256): X
 * (gate/up: xn, m_max rows of which *m_dev exist; down: h, n_pairs_hint rows, each zero past
 * experts[pair_expert[p]].inter) split into planes of ld (>= every expert's ld_d, resp. ld_i) */
kdt_status kdt_grouped_launch_ws(const kdt_grouped_args *a, int32_t stages, cudaStream_t s, uint16_t *ws,
                                 int64_t ws_elems, const int32_t *m_dev, int32_t m_max, const int32_t *pair_expert,
                                 int32_t ld);
/* 1 when a gate/up launch like `a` can write SwiGLU's output itself (tiled experts: the v2
 * kernel) and KDT_GPU_FUSED_SWIGLU is not 0; the caller then sets h / ldh and runs no SwiGLU. */
int kdt_grouped_fuses_swiglu(const kdt_grouped_args *a);
/* KDT_G_BM (64) when a grouped launch of `n_pairs` pairs would take the wgmma kernel (gemm_wg.cuh,
 * unless KDT_GEMM_WG=0), whose CTA runs 64-row items; 0 otherwise (the plan keeps 32) */
int32_t kdt_gemm_wg_item_rows(int32_t n_pairs);

/* Rewrites a bf16 weight [rows][ld] (rows % 64 == 0, ld % 64 == 0) in place into the tiled
 * layout [rows / 64][ld / 64][64][64]: every 64 x 64 block the GEMM stages at once becomes 8 KB
 * of contiguous memory instead of 64 segments of 128 B, ld * 2 bytes apart. Inside a block, the
 * 16-byte chunk c of row t sits at chunk c ^ (t & 7), so a block copied verbatim into shared
 * memory (the bulk W loader) reads without bank conflicts. A permutation: the values, and so the
 * GEMM's bits, are the same. tmp: device scratch of tmp_rows (a multiple of 64) rows. Applied to
 * every expert matrix by default (KDT_GPU_TILED_EXPERTS=0: not), to dense ones with
 * KDT_GPU_TILED_DENSE=1 (gpu_upload.c). */
kdt_status kdt_gemm_tile64(uint16_t *w, int64_t rows, int32_t ld, uint16_t *tmp, int64_t tmp_rows, cudaStream_t s);

/* lm_head with the fused argmax: per 64-column vocabulary tile, every head row's best (value,
 * id) goes to am_val/am_idx [tile][row]; logits rows are written when logits != NULL. */
typedef struct kdt_head_args {
    const float *x; int32_t kx;                 /* xn_head [n_head][kx] */
    kdt_gmat w;                                 /* lm_head (by value) */
    const int32_t *m_dev; int32_t m_max;        /* n_head */
    const kdt_grow *rows; const int32_t *head_rows;
    float *logits;                              /* [..][V] at out_index, or NULL */
    float *am_val; int32_t *am_idx; int32_t am_ld;
} kdt_head_args;
kdt_status kdt_head_launch(const kdt_head_args *a, int32_t stages, cudaStream_t s);
/* Dynamic shared memory of the GEMM kernels with `stages` pipeline stages. */
size_t kdt_gemm_smem_bytes(int32_t stages);

/* Attention (gpu_attn.cu). */
typedef struct kdt_attn_args {
    const float *q_abs;             /* [R][H][dq] */
    const uint16_t *kv;             /* one layer [n_pages][page][row_stride] */
    int32_t row_stride, page_size, n_pages, max_pages;
    const int32_t *block_table;
    const kdt_gstage_hdr *hdr; const kdt_grow *rows; const uint64_t *masks;
    float *att_o, *att_m, *att_l;
    float *o_lat;                   /* [R][H][d_c] */
    int32_t H, dc, dq;
    float scale_log2;
    int32_t heads_per_item;         /* 16 or 64 */
    int32_t grid, max_rows;
} kdt_attn_args;
kdt_status kdt_attn_launch(const kdt_attn_args *a, cudaStream_t s);
/* Keys per split of a row with n_keys visible keys (the one rule). */
int32_t kdt_attn_split_keys(int32_t n_keys);
int32_t kdt_attn_n_splits(int32_t n_keys);
/* The plain form of a prefill chunk's attention (gpu_plain.cu): R rows of one stream at slots
 * first..first+R-1, keys 0..T-1 (T = first + R) up-projected into k / v, then per head a causal
 * flash attention into heads. */
typedef struct kdt_plain_args {
    const float *q_nope;            /* [R][H][d_n] */
    const float *q_abs;             /* [R][H][d_c + d_r]: q_pe (after RoPE) at column d_c */
    const uint16_t *kv;             /* one layer of the cache [n_pages][page][row_stride] */
    int32_t row_stride, page_size, max_pages, stream;
    const int32_t *block_table;
    uint16_t *k_hi, *k_lo;          /* [H][cap][dqk_p] bf16 pairs (hi + lo): keys k0 .. k0 + kn - 1 */
    uint16_t *v_hi, *v_lo;          /* [H][cap][dv_p] */
    int32_t cap;                    /* keys the scratch holds */
    int32_t k0, kn;                 /* this launch's block of keys (k0 % cap == 0, kn <= cap); the
                                       chunk's T keys run in blocks k0 = 0, cap, 2 cap, ... */
    float *state;                   /* [R][H][state_ld] each row's softmax state between blocks
                                       (needed when T > cap): unnormalized O, the running max, the
                                       4 lanes' partial sums */
    int32_t state_ld;               /* >= dv_p + 5 */
    float *heads;                   /* [R][H * d_v] (written by the block that ends at T) */
    int32_t R, first, T, H, dn, dr, dc, dv, dqk_p, dv_p, stages;
    int32_t wg;                     /* 1: plain_attn_wg (sm_90a wgmma; dv_p 64 or 128, initialized
                                       with wg by kdt_plain_init); the same bits */
    float scale_log2;
} kdt_plain_args;
/* (its instances' sizes: kdt_ap_plain_dv_pad, kdt_ap_plain_smem in attn_plan.h) */
/* raises the instance's shared-memory limit (once per runner, before any capture) */
kdt_status kdt_plain_init(int32_t dqk_p, int32_t dv_p, int32_t stages, int32_t wg);
/* 1 when the current device runs plain_attn_wg's wgmma code (an sm_90a pass on a Hopper): a probe
 * kernel and a synchronous copy, so never during a capture */
int kdt_plain_wg_device(void);
/* one block of keys: up-projection of keys [k0, k0 + kn), then the attention over them */
kdt_status kdt_plain_launch(const kdt_plain_args *a, const kdt_gmat *uk_t, const kdt_gmat *uv, cudaStream_t s);

/* Fills the staged verify rows from a device tree (kdt_gpu_stage_verify_device); streams [S][3]
 * = (cache stream, committed length, node bound) in device memory. */
kdt_status kdt_op_stage_tree(kdt_gstage_hdr *hdr, kdt_grow *rows, int32_t *head, uint64_t *masks,
                             const int32_t *streams, int32_t S, int32_t N, int32_t W, const int32_t *n_nodes,
                             const int32_t *token, const int32_t *position, const uint64_t *anc_mask, cudaStream_t s);
/* Shared memory the attention kernel needs (0 if the configuration is not supported). */
size_t kdt_attn_smem_bytes(int32_t heads_per_item, int32_t dc, int32_t dq);


/* GEMM pipeline stages for this device: 4 when two CTAs of 4 fit an SM (H100/H200), else what
 * fits (results never depend on it). Used by the runner and the GPU drafter. */
int32_t kdt_gpu_gemm_stages(const kdt_gpu_model *g);
/* The same choice from a device's shared memory per SM and per block (opt-in). */
int32_t kdt_gemm_stages_for(int smem_per_sm, int smem_optin);

/* Raise the shared-memory limits of the kernel instances a runner uses (before any capture). */
kdt_status kdt_gemm_init(int32_t stages);
kdt_status kdt_attn_init(int32_t heads_per_item, int32_t dc, int32_t dq);

/* Row-wise kernels (gpu_ops.cu). m_dev / n_dev: the row count on the device; max_rows: the
 * launch bound. Partials are [splits][rows][ldp] at split_stride floats apart. */
kdt_status kdt_op_scatter(int32_t *table, const int32_t *updates, const kdt_gstage_hdr *hdr, int32_t max_n,
                          cudaStream_t s);
kdt_status kdt_op_embed(const kdt_gstage_hdr *hdr, const kdt_grow *rows, const kdt_gmat *embed, float *x, int32_t D,
                        int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_rmsnorm(const float *x, const int32_t *rowmap, const float *w, float eps, int32_t D, float *out,
                          const int32_t *m_dev, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_post_a(const float *part, int32_t splits, int64_t split_stride, int32_t ldp, int32_t q_lora,
                         int32_t dc, int32_t dr, const float *q_a_norm, const float *kv_a_norm, const float *rope_cs,
                         int32_t interleave, const kdt_gstage_hdr *hdr, const kdt_grow *rows, uint16_t *cache,
                         const int32_t *block_table, int32_t max_pages, int32_t page_size, int32_t n_pages,
                         int32_t row_stride, float *qa, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_post_q(const float *part, int32_t splits, int64_t split_stride, int32_t ldp, int32_t H, int32_t dn,
                         int32_t dr, int32_t dc, const float *rope_cs, int32_t interleave, const kdt_gstage_hdr *hdr,
                         const kdt_grow *rows, float *q_nope, float *q_abs, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_sum_splits(const float *part, int32_t splits, int64_t split_stride, int32_t ldp, int32_t batch,
                             int32_t p_bstride, int32_t ncols, float *dst, int32_t ldd, int32_t d_bstride,
                             const int32_t *m_dev, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_post_o(float *x, const float *part, int32_t splits, int64_t split_stride, const float *w, float eps,
                         int32_t D, float *xn, const int32_t *m_dev, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_residual(float *x, const float *part, int32_t splits, int64_t split_stride, int32_t D,
                           const int32_t *m_dev, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_swiglu(const float *part, int32_t splits, int64_t split_stride, int32_t ldp, const int32_t *n_dev,
                         int32_t max_n, const int32_t *pair_expert, const kdt_gpu_expert *experts, int32_t inter,
                         float *h, int32_t ldh, cudaStream_t s);
size_t kdt_op_route_smem(int32_t E, int32_t G);
kdt_status kdt_op_route(const float *part, int32_t splits, int64_t split_stride, const float *bias,
                        const kdt_model_config *cfg, const kdt_gstage_hdr *hdr, int32_t *sel, float *wgt,
                        int32_t max_rows, cudaStream_t s);
/* A one-row pass (decode of one stream) routes and plans in one kernel when this holds */
int kdt_op_route_plan1_ok(const kdt_model_config *cfg, int32_t max_rows);
kdt_status kdt_op_route_plan1(const float *part, int32_t splits, int64_t split_stride, const float *bias,
                              const kdt_model_config *cfg, const kdt_gstage_hdr *hdr, int32_t *sel, float *wgt,
                              int32_t has_shared, int32_t *pair_row, int32_t *pair_expert, int32_t *pos_of,
                              int32_t *pos_shared, int32_t *items, int32_t *counts, int32_t *expert_counts,
                              cudaStream_t s);
size_t kdt_op_plan_smem(int32_t E_tot);
/* item_rows: most pairs per item (KDT_G_ITEM_ROWS_MIN..KDT_G_BM); an expert's pairs are cut into
 * items of that many rows, in order, so its items sit next to each other in the list */
kdt_status kdt_op_moe_plan(const kdt_gstage_hdr *hdr, const int32_t *sel, int32_t K, int32_t E, int32_t has_shared,
                           int32_t max_rows, int32_t item_rows, int32_t *pair_row, int32_t *pair_expert,
                           int32_t *pos_of, int32_t *pos_shared, int32_t *items, int32_t *counts,
                           int32_t *expert_counts, cudaStream_t s);
/* has_shared: 0 none; 1 the shared expert's pairs are in the plan; 2 it ran apart (the plan has
 * only routed pairs, expert_counts[E] still counts its rows; the combine adds the sum of its
 * down GEMM's split partials sh [sh_splits][..][D], sh_stride floats apart) */
kdt_status kdt_op_moe_combine(float *x, const float *y, const float *sh, int32_t sh_splits, int64_t sh_stride,
                              int32_t D, int32_t K, const int32_t *pos_of, const int32_t *pos_shared,
                              const float *wgt, int32_t has_shared, const kdt_gstage_hdr *hdr, int32_t max_rows,
                              cudaStream_t s);
kdt_status kdt_op_taps(const float *x, int32_t D, const kdt_gstage_hdr *hdr, const kdt_grow *rows, float *taps,
                       int32_t max_taps, int32_t t, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_argmax_final(const float *am_val, const int32_t *am_idx, int32_t am_ld, int32_t n_tiles,
                               const kdt_gstage_hdr *hdr, const int32_t *head_rows, const kdt_grow *rows,
                               int32_t *argmax, int32_t max_rows, cudaStream_t s);
kdt_status kdt_op_fill_mat(uint16_t *w, int64_t rows, int32_t cols, int32_t ld, float std, uint64_t seed,
                           cudaStream_t s);
kdt_status kdt_op_fill_embed(uint16_t *w, int32_t V, int32_t D, int32_t ld, int32_t block, float sigma, uint64_t seed,
                             cudaStream_t s);
kdt_status kdt_op_fill_vec(float *v, int32_t n, int32_t mode, float std, uint64_t seed, cudaStream_t s);
kdt_status kdt_op_fill_kv(uint16_t *cache, int64_t layer_stride, int32_t n_layers, const int32_t *table_row,
                          int32_t page_size, int32_t row_stride, int32_t row_elems, int32_t n_slots, uint64_t seed,
                          cudaStream_t s);
kdt_status kdt_op_flush_read(const float *buf, int64_t n_floats, float *sink, cudaStream_t s);

/* Model layout (gpu_upload.c): checks the configuration is supported and allocates every
 * device weight of g (g->cfg set); the caller fills them. */
kdt_status kdt_gpu_model_alloc(kdt_gpu_model *g, const kdt_gpu_options *opt, const float *rope_inv_freq,
                               int32_t share_lm_head);

#ifdef __cplusplus
}
#endif
#ifdef __CUDACC__
/* SiLU(g) * u, the one expression every SwiGLU on the GPU uses (k_swiglu, the fused gate/up
 * epilogue), so the two paths give the same bits */
__device__ __forceinline__ float kdt_g_swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }
#endif
#endif
