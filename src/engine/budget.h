/* budget.h - the `auto` mode's controller (docs/engine.md, "auto budget"). It makes two choices
 * per round:
 *
 * 1. Draft or not. A drafted round costs a drafter pass; with many streams, or a target whose
 *    verify of a tree costs much more than a decode step, plain decoding emits more tokens per
 *    second. The controller measures both: per batch-size bucket it keeps the tokens per second
 *    that drafted and plain rounds achieved (decayed sums), runs the better kind (the leader) and
 *    now and then tries the other. Plain rounds hardly vary: one-round plain tries, spaced so that
 *    they cost 0.5 % of the time, the spacing doubling with each try that leaves drafting in the
 *    lead (twice at most: 0.125 %). Drafted rounds vary with tau: 4-round drafted tries every 8
 *    leader rounds at first, the spacing doubling with each try that confirms plain, costing at
 *    most 1-10 % of the time (the farther behind, the less). A drafted try that beats plain on
 *    its own makes drafting the leader at once and replaces the drafted history (tau changed);
 *    drafting loses the lead only on its decayed history of 8 or more rounds.
 *
 * 2. The tree budgets of a drafted round:
 *   expected tokens of stream s with budget B = 1 + min(L_s, c * sum_{i=1..B} exp(score_i))
 *     (score_i = the i-th popped node's surrogate log-prob; the best-B tree is the first B pops
 *      of the best-B_max tree, so one build at B_max gives every prefix; c = running calibration
 *      of realised over predicted accepted tokens)
 *   round time = t_fixed + a + b * x   (t_fixed = running mean of draft + build + accept time;
 *      a, b = exponentially weighted least-squares fit of measured verify times, seeded with a
 *      prior line; x = the cost rows of the pass, see kdt_budget_cost_rows)
 *   With x = verified nodes (the CPU forward), each stream's node gains are non-increasing, so
 *   the best allocation for any total takes the largest gains over all streams: the controller
 *   scans the total and keeps the best ratio. With padded rows (the GPU forward: S x stride rows
 *   rounded up to its GEMM tiles, power-of-two strides), a pass costs the same whatever nodes fill
 *   the stride, so it scans the strides and fills each stream up to stride - 1, each pop with the
 *   calibration of its pop-index bin (below).
 */
#ifndef KDT_ENGINE_BUDGET_H
#define KDT_ENGINE_BUDGET_H

#include <stdint.h>

#define KDT_BUDGET_BUCKETS 7    /* batch sizes 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64 */
#define KDT_BUDGET_RANK_BINS 8  /* pop index 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64-127, 128+ */

/* Measured throughput of one kind of round (drafted or plain) in one batch-size bucket. */
typedef struct kdt_budget_arm {
    double tokens, seconds, weight; /* decayed sums (x 0.9 per round of this kind); weight: rounds */
    int32_t rounds;                 /* rounds of this kind seen in the bucket */
} kdt_budget_arm;

typedef struct kdt_budget_bucket {
    kdt_budget_arm arm[2]; /* [0] plain rounds, [1] drafted rounds */
    int32_t leader;        /* the kind run between tries; -1 until the warm-up is over */
    double since_s;        /* seconds of leader rounds since the last try */
    int32_t trying;        /* rounds of the try still to run (0: no try running) */
    int32_t try_kind;      /* the kind being tried */
    double try_tokens, try_seconds; /* what the running try's rounds emitted, and took */
    int32_t streak;        /* tries in a row that left the leader in place (spacing x 2 each) */
} kdt_budget_bucket;

typedef struct kdt_budget_ctl {
    double prior_a, prior_b;          /* prior verify cost line, seconds and seconds per cost row */
    double sw, sx, sxx, sy, sxy;      /* decayed weighted sums of (cost rows, verify seconds) */
    double fixed_s;                   /* running mean of the non-verify time of drafted rounds */
    int32_t n_rounds;
    double acc_real, acc_pred;        /* decayed sums of realised / predicted accepted tokens */
    double rank_real[KDT_BUDGET_RANK_BINS], rank_pred[KDT_BUDGET_RANK_BINS]; /* the same per pop-index bin */
    int32_t have_ranks;               /* rank bins observed (the GPU engine reports them) */
    int32_t pad_first, pad_step;      /* 0: cost rows = verified nodes; else see cost_rows */
    kdt_budget_bucket bucket[KDT_BUDGET_BUCKETS];
    uint32_t test_kinds;              /* tests only: bit r % test_len = kind of round r */
    int32_t test_len, test_round;
    double test_a, test_b;            /* tests only: test_b > 0 pins the verify line to these */
} kdt_budget_ctl;

/* base_s, per_node_s <= 0 pick the built-in prior (1 ms + 0.1 ms per node). */
void kdt_budget_init(kdt_budget_ctl *c, double base_s, double per_node_s);

/* Declares that a verify pass runs S x stride rows padded up to pad_first, then to multiples of
 * pad_step (the GPU forward's GEMM tiles), and that auto rounds use power-of-two strides. */
void kdt_budget_set_padding(kdt_budget_ctl *c, int32_t pad_first, int32_t pad_step);

/* The x of the cost line for a pass over S streams at this tree stride with `nodes` real nodes:
 * nodes, or the padded rows of S x stride (kdt_budget_set_padding). */
int64_t kdt_budget_cost_rows(const kdt_budget_ctl *c, int32_t S, int32_t stride, int64_t nodes);

/* The current verify cost line t = a + b x. */
void kdt_budget_verify_line(const kdt_budget_ctl *c, double *a, double *b);
/* The current calibration c (realised / predicted accepted tokens), in [0.05, 4]. */
double kdt_budget_calibration(const kdt_budget_ctl *c);

/* Per pop-index calibration. The surrogate overrates a big tree's last pops more than its first
 * ones (H200, tiny pair: one calibration over all nodes made auto verify 16-row trees where 8-row
 * ones were 4 % faster). A round reports, per bin of pop index (kdt_budget_rank_bin: 1, 2-3, 4-7,
 * ...), the surrogate of its verified nodes and how many of them were accepted. Every verified
 * node counts in its own bin whatever budget was chosen, so the bins compare pops, not the
 * rounds' choices. A bin's calibration is shrunk towards the global one while it has little
 * data; without bin data it is the global one. Used by the padded (GPU) choice. */
int kdt_budget_rank_bin(int32_t pop_index);
void kdt_budget_observe_ranks(kdt_budget_ctl *c, const double *predicted, const double *realised);
double kdt_budget_calibration_rank(const kdt_budget_ctl *c, int32_t pop_index);

/* One auto stream's candidates: gain[i] = exp(score of pop i+1), non-increasing, i < cap. */
typedef struct kdt_budget_stream {
    const float *score;   /* [cap] surrogate log-probs of nodes 1..cap (pop order) */
    int32_t cap;          /* largest budget allowed this round */
    int32_t depth_limit;  /* L_s: expected accepted tokens never exceed it */
} kdt_budget_stream;

/* The round's streams that are not auto: they share the verify pass. */
typedef struct kdt_budget_others {
    int32_t n_streams;
    int64_t nodes;       /* their verified nodes */
    double tokens;       /* their expected tokens */
    int32_t min_stride;  /* 1 + their largest budget (1 if none) */
} kdt_budget_others;

/* Picks budget[s] in 0..cap for every auto stream; returns the predicted tokens per second.
 * others may be NULL (no other streams). On allocation failure every stream gets its cap. */
double kdt_budget_choose(const kdt_budget_ctl *c, int32_t n, const kdt_budget_stream *st,
                         const kdt_budget_others *others, int32_t *budget);

/* Feeds one drafted round's measurements: non-verify seconds, cost rows, verify seconds. */
void kdt_budget_observe_round(kdt_budget_ctl *c, double fixed_s, int64_t rows, double verify_s);
/* Feeds one plain round's verify measurement (its non-verify time has no draft in it). */
void kdt_budget_observe_plain_verify(kdt_budget_ctl *c, int64_t rows, double verify_s);
/* Feeds one round's acceptance: predicted and realised accepted draft tokens (summed over the
 * drafting streams). */
void kdt_budget_observe_accept(kdt_budget_ctl *c, double predicted, double realised);

/* Draft or not: 1 if the next round over S streams should run the drafter. Call once per round
 * whose drafting streams are all auto, then report the round with kdt_budget_observe_kind. */
int kdt_budget_next_round_drafts(kdt_budget_ctl *c, int32_t S);
/* Tests only: replaces the draft-or-not choice by a fixed cycle (bit i of kinds: round i drafts;
 * len 1..32; len 0 restores the measured choice). */
void kdt_budget_test_kinds(kdt_budget_ctl *c, uint32_t kinds, int32_t len);
/* Tests: the verify line is t = a + b x whatever was measured (b <= 0: measured again), so that
 * the budgets auto picks do not depend on the machine's timing. */
void kdt_budget_test_verify_line(kdt_budget_ctl *c, double a, double b);
/* The round over S streams emitted `tokens` in `seconds` (wall time), drafted or not. */
void kdt_budget_observe_kind(kdt_budget_ctl *c, int32_t S, int drafted, double tokens, double seconds);
/* A round over S streams that paid one-time setup (a CUDA graph captured, a new shape run
 * eagerly): not a measurement of its kind, but when it was a try of the trailing kind its time
 * is the try's cost, so the next try waits accordingly (on a server every batch size is a new
 * shape: a drafted try at 60 streams captured for 8 ms). */
void kdt_budget_observe_setup(kdt_budget_ctl *c, int32_t S, int drafted, double seconds);
/* Measured tokens per second of one kind at S streams (0 if none measured yet). */
double kdt_budget_kind_rate(const kdt_budget_ctl *c, int32_t S, int drafted);

#endif
