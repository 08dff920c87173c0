/* engine_internal.h - what the engine's files share (engine.c: lifecycle, add/cancel, stats;
 * round.c: prefill and the decoding round; kernel_ops.c: the one place where the round calls
 * kernels), plus the TEST-ONLY drafter hook. Not part of the public API: the CLI and the server
 * never include it.
 */
#ifndef KDT_ENGINE_INTERNAL_H
#define KDT_ENGINE_INTERNAL_H

#include "kdtree/engine.h"
#include "kdtree/kernels.h"
#include "kdtree/model.h"

#include "budget.h"
#include "common.h"
#include "dflash.h"
#include "sampler.h"

/* ---- kernels: one table per device, the same parameter structs on both ------------------------ */
typedef struct kdt_engine_kernels {
    const char *name;
    kdt_status (*topk)(const kdt_topk_params *p, void *stream);
    kdt_status (*tree_build)(const kdt_tree_build_params *p, kdt_tree *out, void *stream);
    kdt_status (*tree_accept)(const kdt_tree_accept_params *p, void *stream);
    kdt_status (*kv_commit)(const kdt_kv_commit_params *p, void *stream);
} kdt_engine_kernels;

extern const kdt_engine_kernels kdt_engine_kernels_cpu;
/* The CUDA launchers (device pointers); their _cuda functions say KDT_ERR_NO_CUDA without CUDA. */
extern const kdt_engine_kernels kdt_engine_kernels_cuda;

/* ---- TEST-ONLY drafter hook ----------------------------------------------------------------------
 * Replaces the DFlash drafter by a callback that fills the draft logits of one stream:
 * history[0..n_history) = prompt + emitted tokens (the anchor is history[n_history-1], at
 * position n_history-1), logits [n_positions][vocab] for the positions after the anchor.
 * Set it right after kdt_engine_create with no draft_dir and before any kdt_engine_add; chain,
 * ddtree and auto then use it with depth n_positions. Exists only for the lossless-proof tests. */
typedef kdt_status (*kdt_engine_test_draft_fn)(void *user, int32_t stream_id, const int32_t *history,
                                              int32_t n_history, int32_t n_positions, int32_t vocab,
                                              float *logits);
kdt_status kdt_engine_set_test_drafter(kdt_engine *e, int32_t n_positions, kdt_engine_test_draft_fn fn,
                                       void *user);

/* Test access to the target the engine loaded. */
const kdt_model *kdt_engine_model(const kdt_engine *e);

/* ---- streams ------------------------------------------------------------------------------------ */
#define KDT_ENGINE_MAX_STREAMS 64 /* kdt_engine_options.max_streams' bound */
typedef enum slot_state {
    SLOT_FREE = 0,
    SLOT_WAITING,   /* added, prefill in the next step */
    SLOT_ACTIVE,    /* prefilled, decoding */
    SLOT_CLOSING,   /* finished outside a step (cancelled): its final event is still owed */
} slot_state;

typedef struct eng_stream {
    slot_state state;
    int32_t id;                 /* public stream id */
    kdt_gen_params params;      /* stop_ids points at stop[] below */
    int32_t budget_cap;         /* largest budget this stream's trees use (ar 0, chain L) */
    int32_t *stop;              /* [n_stop] */
    int32_t *tokens;            /* [cap_tokens] prompt then emitted tokens */
    int32_t n_prompt, n_tokens, cap_tokens;
    int32_t n_emitted;
    int32_t prefix_len;         /* committed KV slots (= n_tokens - 1 once prefilled; while
                                   SLOT_WAITING, the prompt tokens prefilled so far) */
    int32_t pages_reserved;     /* admission accounting, see engine.c */
    int drafts;                 /* uses the drafter (chain / ddtree / auto with a drafter) */
    kdt_rng rng;
    kdt_dflash_ctx *dctx;       /* DFlash context K/V, NULL otherwise */
    kdt_finish_reason finish;   /* set when it finished; reported in the next event */
} eng_stream;

/* ---- the engine --------------------------------------------------------------------------------- */
struct kdt_engine {
    char fault[256];            /* non-empty: the device failed for good (kdt_engine_fault) */
    kdt_model *model;
    const kdt_model_config *mc;
    kdt_kv_cache *kv;
    kdt_kv_layout kv_layout;
    kdt_dflash *drafter;
    kdt_engine_test_draft_fn test_draft;
    void *test_user;
    int32_t depth;              /* L: draft positions per block (0 without a drafter) */
    int32_t n_taps;
    const int32_t *tap_layers;
    const kdt_engine_kernels *kern;
    void *cuda_stream;          /* NULL: default stream (GPU path) */
    struct eng_gpu *gpu;        /* the GPU side (engine_gpu.h), NULL on the CPU; then kv is NULL */

    int32_t max_streams, max_context, max_budget, max_nodes; /* max_nodes = 1 + max(max_budget, L) */
    int32_t prefill_attention;                   /* kdt_prefill_attention of the CPU and GPU prefill */
    int32_t prefill_chunk;                       /* prompt rows per prefill pass; 0 = the device's default */
    int32_t prefill_quantum;                     /* rows of the device's prefill chunk (CPU: the model's,
                                                    GPU: a pass): a step's prefill is whole ones */
    int32_t max_prefill_tokens;                  /* per step, 0 = no limit (kdt_engine_options) */
    int32_t pages_total, pages_reserved, pages_per_stream_max;
    int32_t next_id;
    eng_stream *streams;        /* [max_streams]; KV cache stream = slot index */
    uint64_t add_seq;           /* order of arrival, for fair prefill order */
    uint64_t *arrival;          /* [max_streams] */

    /* round buffers, [S] = max_streams, [MN] = max_nodes, W = KDT_MASK_WORDS(max_nodes) */
    int32_t *t_n_nodes;                          /* [S] */
    int32_t *t_token, *t_parent, *t_depth, *t_first_child, *t_next_sibling, *t_position; /* [S][MN] */
    float *t_score;                              /* [S][MN] */
    uint64_t *t_mask;                            /* [S][MN][W] */
    int32_t *slot_of;                            /* [S] tree stream -> slot */
    int32_t *b_depth_limit, *b_budget, *b_root, *b_prefix; /* [S] */
    int32_t top_k_max;                           /* K stride bound: min(max(max_budget,1), V, KDT_MAX_TOPK) */
    int32_t *top_ids;                            /* [S][L][K] */
    float *top_logp;                             /* [S][L][K] */
    float *draft_logits;                         /* [S][L][V], grown on demand */
    int64_t draft_logits_cap;
    int32_t *argmax;                             /* [S][MN] */
    int32_t *target_token;                       /* [S][MN] */
    float *logits;                               /* [S*MN][V] when sampling, grown on demand */
    int64_t logits_cap;
    float *taps;                                 /* [S*MN][n_taps][D], grown on demand */
    int64_t taps_cap;
    float *feat;                                 /* [KDT_MAX_PATH][n_taps][D] gather for the drafter */
    int32_t *acc_nodes, *acc_emit;               /* [S][KDT_MAX_PATH] */
    int32_t *acc_tau, *acc_bonus, *acc_error;    /* [S] */
    int32_t *commit_tau;                         /* [S] tau, or 0 for streams that leave */
    int32_t *ev_tokens;                          /* [slot][KDT_MAX_PATH] event tokens */
    float *auto_scores;                          /* [S][MN] copy of the probe tree's scores */
    /* auto's probe trees at the caps (CPU round): the round's trees are their prefixes */
    int32_t *p_n_nodes;                          /* [S] */
    int32_t *p_tree;                             /* 6 x [S][MN]: token, parent, depth, links, position */
    float *p_score;                              /* [S][MN] */
    uint64_t *p_mask;                            /* [S][MN][W] */
    kdt_sampler_scratch sampler;

    kdt_budget_ctl budget;
    kdt_engine_stats stats;
};

/* ---- round.c pieces the GPU round (cuda/engine_gpu.c) shares ---------------------------------- */
double kdt_engine_now(void); /* monotonic seconds */

typedef struct round_groups {
    int32_t n_tree, n_chain, n_plain; /* [0, n_tree) ddtree/auto, then chain, then no draft */
    int32_t n_draft;                  /* n_tree + n_chain */
    int32_t n_auto;
} round_groups;

/* The arrays one round's trees are built in (host arrays on the CPU, device arrays on the GPU). */
typedef struct round_bufs {
    int32_t *n_nodes, *token, *parent, *depth, *first_child, *next_sibling, *position; /* [S][MN] */
    float *score;
    uint64_t *mask;
    int32_t *top_ids;
    float *top_logp;
    int32_t *depth_limit, *budget, *root, *prefix; /* [S] */
} round_bufs;

int32_t kdt_round_plan(kdt_engine *e, const int32_t *slots, int32_t n_slots, round_groups *g);
int32_t kdt_round_topk_k(const kdt_engine *e, const round_groups *g);
round_bufs kdt_round_host_bufs(kdt_engine *e);
/* The host buffers of auto's probe trees (CPU round), with the same inputs as kdt_round_host_bufs. */
round_bufs kdt_round_probe_bufs(kdt_engine *e);
kdt_tree kdt_round_tree_view(const round_bufs *b, int32_t s0, int32_t n, int32_t stride);
/* tree_build of every group at the budgets in b->budget; budget_host is the host copy of them
 * (for the stride). *stride: in, the smallest stride wanted (1 = as the budgets need); out, the
 * stride used. */
kdt_status kdt_round_build_trees(const kdt_engine *e, const round_bufs *b, const int32_t *budget_host,
                                 const kdt_engine_kernels *kern, void *stream, const round_groups *g, int32_t S,
                                 int32_t K, int32_t *stride);
/* The best-first tree of budget B is the first B pops of the tree at any larger budget (same
 * top-K input): dst stream s = the first min(src n_nodes, 1 + budget[s]) nodes of src stream s,
 * links to later nodes cut, padded as tree_build pads (budget clamped to 0..dst->max_nodes - 1,
 * as tree_build clamps it). So one build at the caps serves auto's choice and its verify pass,
 * bit for bit equal to a second build at the chosen budgets. Host arrays; the GPU round's twin is
 * kdt_eng_tree_prefix (cuda/engine_gpu_ops.cu). src and dst must not overlap. */
void kdt_round_tree_prefix(const kdt_tree *src, const kdt_tree *dst, const int32_t *budget);
/* The auto streams' budgets into e->b_budget, from the probe trees in `probe` (stride pstride,
 * built at the caps). */
void kdt_round_auto_choose(kdt_engine *e, const round_groups *g, int32_t S, const kdt_tree *probe);
/* kdt_budget_choose over the auto streams bs[i] (tree stream idx[i]), then their budgets into
 * e->b_budget and stats.last_budget: the CPU round and the GPU round's lagged choice both end here. */
void kdt_round_choose_budgets(kdt_engine *e, int32_t n, const kdt_budget_stream *bs, const int32_t *idx,
                              const kdt_budget_others *others);
/* auto's draft-or-not for this round (budget.h); on 0 the tree streams' budgets are set to 0 */
int kdt_round_auto_drafts(kdt_engine *e, const round_groups *g, int32_t S);
/* What a finished round tells the auto controller (seconds are wall or device time). */
typedef struct round_timing {
    int32_t S, stride;
    int64_t nodes;            /* verified tree nodes */
    int drafts;               /* 0: a plain round */
    double fixed_s, verify_s; /* non-verify and verify time */
    int have_accept;          /* predicted / realised accepted tokens are meaningful */
    double predicted, realised, emitted, wall_s;
    int setup;                /* the round paid one-time setup (a CUDA graph captured): its wall time
                                 says nothing about the kind of round, so only the verify fit sees it */
} round_timing;
/* Feeds the round to the controller: the verify cost line, the calibration and fixed time of
 * drafted rounds, the plain-round count, and the draft-or-not rates (CPU and GPU rounds alike). */
void kdt_round_observe(kdt_engine *e, const round_groups *g, const round_timing *t);
/* expected accepted draft tokens of stream s of `tree` under the drafter's surrogate (§1.2) */
double kdt_round_surrogate(const kdt_engine *e, const kdt_tree *tree, int32_t s);
/* Grows a host float buffer (engine-owned, e.g. e->logits) to at least `need` floats. */
kdt_status kdt_round_grow_f32(float **buf, int64_t *cap, int64_t need, const char *what);
kdt_sampler_params kdt_round_sampler_of(const eng_stream *s);
/* whether stream s's prefill rows produce taps for its drafter context */
static inline int kdt_round_prefill_taps(const kdt_engine *e, const eng_stream *s) {
    return s->drafts && e->drafter && e->n_taps > 0;
}
int32_t kdt_round_emit(eng_stream *s, const int32_t *toks, int32_t n, int32_t *ev);
void kdt_round_event(kdt_stream_event *events, int32_t *n_ev, const eng_stream *s, const int32_t *toks,
                     int32_t n, int32_t tau);

/* Places a step's prefill chunks into shared passes of at most `cap` rows: chunks listed in arrival
 * order, each stream's consecutive and in prompt order (stream[c] its stream, rows[c] <= cap its
 * rows); each goes first-fit into the first pass after its stream's previous chunk's. pass[c] gets
 * its pass; pass_rows [n_chunks] the passes' rows. Returns the number of passes. */
int32_t kdt_prefill_place(int32_t cap, int32_t n_chunks, const int32_t *stream, const int32_t *rows, int32_t *pass,
                          int32_t *pass_rows);

/* One prefill pass (CPU and GPU alike): its segments checked against the plan's rules (slot k's
 * rows [from[k], from[k] + n_rows[k]), from[k] its prefix_len and a multiple of prefill_quantum,
 * the rows together at most that) and listed in sg; info says what the pass must produce. */
typedef struct round_pass {
    int32_t rows;                    /* the pass's rows */
    int32_t any_greedy, any_sampled; /* some stream's prompt ends in it, greedy / sampled */
    int32_t any_taps;                /* some stream drafts: its rows' taps join its drafter context */
} round_pass;
kdt_status kdt_round_pass_segments(const kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from,
                                   const int32_t *n_rows, kdt_prefill_segment *sg, round_pass *info);
/* After the pass: each stream's prefix_len advanced; first_token[k] its first token where its rows
 * end the prompt (sampled from logits row k, or argmax[k]), else -1. */
void kdt_round_pass_finish(kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from, const int32_t *n_rows,
                           const float *logits, const int32_t *argmax, int32_t *first_token);

/* engine.c: releases a stream's KV pages, drafter context and admission pages (state unchanged) */
void kdt_engine_release_stream(kdt_engine *e, int32_t slot);

#endif
