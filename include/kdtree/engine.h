/* engine.h - the decoding engine: a target model plus a DFlash drafter, running DDTree (or chain,
 * or plain autoregressive) rounds over many streams at once.
 *
 * Ownership: one kdt_engine owns the loaded target and drafter, the paged KV caches and every
 * stream's state. It is NOT thread-safe: exactly one thread (the "inference thread") calls
 * kdt_engine_add / _step / _cancel; other threads talk to that thread (e.g. through a queue).
 *
 * A stream's life: kdt_engine_add() queues a prompt (prefill runs inside the next step, or the
 * next few with kdt_engine_options.max_prefill_tokens), each
 * kdt_engine_step() runs one round for every active stream (continuous batching: a stream added
 * between steps joins at the next round, a finished or cancelled one leaves and frees its KV
 * pages), and reports the tokens each stream produced in that round. Greedy output (temperature 0)
 * is token-for-token what plain greedy decoding of the target gives, whatever the mode, budget or
 * batch composition.
 */
#ifndef KDTREE_ENGINE_H
#define KDTREE_ENGINE_H

#include "kdtree/kdtree.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kdt_engine kdt_engine;

typedef enum kdt_spec_mode {
    KDT_SPEC_AR = 0,      /* plain decoding: one target token per round (the reference) */
    KDT_SPEC_CHAIN = 1,   /* DFlash: verify the drafter's top-1 chain of L tokens */
    KDT_SPEC_DDTREE = 2,  /* DDTree: verify the best-B tree */
    KDT_SPEC_AUTO = 3,    /* DDTree with the budget chosen per round for tokens/s */
} kdt_spec_mode;

/* Parses "ar", "chain", "ddtree", "auto". */
kdt_status kdt_spec_mode_parse(const char *s, kdt_spec_mode *out);
const char *kdt_spec_mode_name(kdt_spec_mode m);

typedef enum kdt_device { KDT_DEVICE_AUTO = 0, KDT_DEVICE_CPU = 1, KDT_DEVICE_CUDA = 2 } kdt_device;

typedef struct kdt_engine_options {
    const char *model_dir;   /* target checkpoint directory (HF layout) */
    const char *draft_dir;   /* DFlash drafter directory, or NULL (then only "ar" is possible) */
    kdt_device device;       /* AUTO: CUDA when built with it and a GPU is present */
    int32_t max_streams;     /* streams decoded together, 1..64 (default 8 when 0) */
    int32_t max_context;     /* per-stream tokens (prompt + output); 0 = model's maximum */
    int32_t kv_pages;        /* pages of 64 tokens in the KV pool; 0 = enough for max_streams x max_context */
    int32_t max_budget;      /* largest tree budget a stream may ask for (default 64 when 0) */
    int verbose;             /* progress on stderr while loading (only when it is a terminal) */
    /* Added by the engine (zero = default). The auto mode's prior verify cost line, refined
     * online from measured verify times (docs/engine.md). */
    double verify_cost_base_s;     /* seconds per verify pass (0: 1e-3) */
    double verify_cost_per_node_s; /* seconds per verified tree node (0: 1e-4) */
    int32_t yarn_legacy_amplitude; /* drafter YaRN cos/sin amplitude: 0 = transformers'
                                      mscale ratio, 1 = legacy 0.1 ln(factor) + 1 (research §3.6) */
    int32_t prefill_attention;     /* a kdt_prefill_attention (model.h) for the prompt's prefill;
                                      0 = absorbed. Auto takes, per chunk, the form with fewer
                                      FLOPs (kdt_prefill_plain_pays), on the CPU and the GPU. */
    int32_t prefill_chunk;         /* prompt rows per forward pass of a prefill, 1..4096; 0 = the
                                      device's default (CPU: 64 for the absorbed form, 256 for
                                      plain or auto; GPU: kdt_prefill_chunk_for the model and the
                                      device, 256..2,048, halved while its scratch does not fit;
                                      kdt_engine_prefill_chunk says which). Larger chunks read each
                                      weight once for more rows (a MoE layer's experts stream once
                                      per chunk) and let the plain attention pay more. The GPU's
                                      scratch grows in proportion (each row's activations,
                                      attention partials and logits); a chunk too large for
                                      the device fails kdt_engine_create naming the buffer.
                                      With absorbed or plain prefill attention the output does
                                      not depend on it; auto picks each chunk's form from the
                                      chunk's size, so there it may (within rounding). */
    int32_t max_prefill_tokens;    /* prompt tokens one kdt_engine_step prefills at most, over
                                      all waiting streams; 0 = no limit (each prompt is prefilled
                                      whole in the step after its add). A long prompt then takes
                                      several steps while the decoding streams keep running a
                                      round each step. Prefill goes in whole chunks counted from
                                      the prompt's start (so the bits do not depend on it), in
                                      arrival order, a chunk while it fits what is left: a step
                                      runs at most this many, or its one first chunk if that is
                                      larger. On the GPU the step's chunks share passes of up to
                                      prefill_chunk rows (one chunk per stream per pass). */
} kdt_engine_options;

typedef struct kdt_gen_params {
    kdt_spec_mode spec;
    int32_t budget;          /* tree budget B (ddtree), ignored by ar/chain; auto: upper bound */
    float temperature;       /* 0 = greedy */
    int32_t top_k;           /* 0 = off */
    float top_p;             /* 1 = off */
    uint64_t seed;
    int32_t max_new_tokens;  /* exact cap on emitted tokens */
    const int32_t *stop_ids; /* tokens that end the stream (emitted, then the stream finishes) */
    int32_t n_stop;
} kdt_gen_params;

/* Defaults: ddtree, budget 32, greedy, top_k 0, top_p 1, seed 0, max_new_tokens 256. */
void kdt_gen_params_default(kdt_gen_params *p);

typedef enum kdt_finish_reason {
    KDT_FINISH_NONE = 0,     /* still running */
    KDT_FINISH_STOP = 1,     /* a stop token was emitted */
    KDT_FINISH_LENGTH = 2,   /* max_new_tokens or the context limit was reached */
    KDT_FINISH_CANCELLED = 3,
    KDT_FINISH_ERROR = 4,
} kdt_finish_reason;

/* What one stream produced in one step. tokens points into engine-owned memory valid until the
 * next kdt_engine_step call. */
typedef struct kdt_stream_event {
    int32_t stream_id;
    const int32_t *tokens;   /* newly emitted tokens (after stop/length truncation) */
    int32_t n_tokens;
    int32_t tau;             /* accepted length of this round (1 + accepted draft tokens); 0 for prefill */
    kdt_finish_reason finish;
} kdt_stream_event;

/* Per-engine counters for stats tables and /metrics. Times in seconds, cumulative. */
typedef struct kdt_engine_stats {
    uint64_t rounds;             /* verify rounds run (a round covers every active stream) */
    uint64_t stream_rounds;      /* sum over rounds of active streams */
    uint64_t tokens_emitted;
    uint64_t prompt_tokens;
    uint64_t tau_hist[18];       /* stream-rounds by tau (0..17) */
    double t_prefill, t_draft, t_build, t_verify, t_accept; /* accept includes commit + host sync */
    int32_t kv_pages_total, kv_pages_used;
    int32_t active_streams, waiting_streams;
    int32_t last_budget;         /* budget chosen by auto in the last round */
    uint64_t plain_rounds;       /* rounds auto ran without the drafter (plain decoding measured
                                    faster at that batch size; see docs/engine.md) */
    uint64_t prefill_passes;     /* prefill passes: one forward over up to one chunk of each
                                    waiting stream (CPU and GPU alike) */
} kdt_engine_stats;

kdt_status kdt_engine_create(const kdt_engine_options *opt, kdt_engine **out);
void kdt_engine_free(kdt_engine *e);

/* Queues a stream. Fails with KDT_ERR_INVALID_ARG (token out of range, bad params),
 * KDT_ERR_CAPACITY (prompt + max_new_tokens over the context, or no free stream slot / KV pages:
 * retry later) with nothing changed. */
kdt_status kdt_engine_add(kdt_engine *e, const int32_t *prompt, int32_t n_prompt,
                          const kdt_gen_params *params, int32_t *stream_id);

/* Runs one round over all active streams. events[0..*n_events) describe every stream that
 * produced tokens or finished; max_events >= max_streams is always enough. Streams added since
 * the last step are prefilled here (event with their first token, tau 0) and join the next
 * step's round; with max_prefill_tokens set, a prompt past the step's budget goes on in the next
 * steps, and its stream reports nothing until its first token. If a prefill or the round fails, the streams concerned get KDT_FINISH_ERROR
 * events (*n_events stays valid) and the error is returned. */
kdt_status kdt_engine_step(kdt_engine *e, kdt_stream_event *events, int32_t max_events,
                           int32_t *n_events);

/* Cancels a stream and frees its KV pages now; its final event reports KDT_FINISH_CANCELLED. */
kdt_status kdt_engine_cancel(kdt_engine *e, int32_t stream_id);

/* 1 if any stream is active or waiting. */
int kdt_engine_busy(const kdt_engine *e);

/* NULL while the engine works; else why it never will again in this process: its CUDA device
 * failed with a sticky error (an illegal address, a kernel trap, a lost device), found after a
 * failed step. From then on kdt_engine_add and kdt_engine_step fail with KDT_ERR_CUDA and this
 * text, and the streams still in the engine end with KDT_FINISH_ERROR; only a new process (a new
 * CUDA context) recovers. A server reports it on /health (503) so an orchestrator restarts it. */
const char *kdt_engine_fault(const kdt_engine *e);

void kdt_engine_get_stats(const kdt_engine *e, kdt_engine_stats *out);

/* Model facts the front ends need. */
int32_t kdt_engine_vocab_size(const kdt_engine *e);
int32_t kdt_engine_max_context(const kdt_engine *e);

/* Added by the engine: the drafter's depth L (block_size - 1), 0 without a drafter; the
 * target's end-of-sequence ids (from config.json, may be 0 of them): ids[0..*n) valid while the
 * engine lives; "stop", "length", ... for a finish reason. */
int32_t kdt_engine_draft_depth(const kdt_engine *e);
void kdt_engine_eos_ids(const kdt_engine *e, const int32_t **ids, int32_t *n);
const char *kdt_finish_reason_name(kdt_finish_reason r);
/* Where the engine decodes: "cpu", or "cuda (<GPU name>)". Valid while the engine lives. */
const char *kdt_engine_device_name(const kdt_engine *e);
/* Prompt rows per prefill pass: kdt_engine_options.prefill_chunk, or the device's default for
 * this model when that was 0 (0 for a NULL engine). */
int32_t kdt_engine_prefill_chunk(const kdt_engine *e);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_ENGINE_H */
