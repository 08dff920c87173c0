/* budget.h - the `auto` mode's budget controller: per round it picks each auto stream's tree
 * budget to maximise expected tokens per second (docs/engine.md, "auto budget").
 *
 *   expected tokens of stream s with budget B = 1 + min(L_s, c * sum_{i=1..B} exp(score_i))
 *     (score_i = the i-th popped node's surrogate log-prob; the best-B tree is the first B pops
 *      of the best-B_max tree, so one build at B_max gives every prefix; c = running calibration
 *      of realised over predicted accepted tokens)
 *   round time = t_fixed + a + b * N   (N = verified nodes of the whole batch)
 *     (t_fixed = running mean of draft + build + accept time; a, b = exponentially weighted
 *      least-squares fit of measured verify times, seeded with a prior line)
 * Because each stream's node gains are non-increasing, the best allocation for any total N takes
 * the N largest gains over all streams; the controller scans N and keeps the best ratio.
 */
#ifndef KDT_ENGINE_BUDGET_H
#define KDT_ENGINE_BUDGET_H

#include <stdint.h>

typedef struct kdt_budget_ctl {
    double prior_a, prior_b;          /* prior verify cost line, seconds and seconds per node */
    double sw, sx, sxx, sy, sxy;      /* decayed weighted sums of (N, verify seconds) */
    double fixed_s;                   /* running mean of the non-verify round time, seconds */
    int32_t n_rounds;
    double acc_real, acc_pred;        /* decayed sums of realised / predicted accepted tokens */
} kdt_budget_ctl;

/* base_s, per_node_s <= 0 pick the built-in prior (1 ms + 0.1 ms per node). */
void kdt_budget_init(kdt_budget_ctl *c, double base_s, double per_node_s);

/* The current verify cost line t = a + b N. */
void kdt_budget_verify_line(const kdt_budget_ctl *c, double *a, double *b);
/* The current calibration c (realised / predicted accepted tokens), in [0.05, 4]. */
double kdt_budget_calibration(const kdt_budget_ctl *c);

/* One auto stream's candidates: gain[i] = exp(score of pop i+1), non-increasing, i < cap. */
typedef struct kdt_budget_stream {
    const float *score;   /* [cap] surrogate log-probs of nodes 1..cap (pop order) */
    int32_t cap;          /* largest budget allowed this round */
    int32_t depth_limit;  /* L_s: expected accepted tokens never exceed it */
} kdt_budget_stream;

/* Picks budget[s] in 0..cap for every auto stream. fixed_nodes / fixed_tokens: verified nodes
 * and expected tokens of the batch's other streams (they share the verify pass). scratch holds
 * sum(cap) entries of 16 bytes (NULL: allocated inside; on allocation failure every stream gets
 * its cap). */
void kdt_budget_choose(const kdt_budget_ctl *c, int32_t n, const kdt_budget_stream *st,
                       int64_t fixed_nodes, double fixed_tokens, int32_t *budget);

/* Feeds one round's measurements: non-verify seconds, verified nodes, verify seconds. */
void kdt_budget_observe_round(kdt_budget_ctl *c, double fixed_s, int64_t nodes, double verify_s);
/* Feeds one round's acceptance: predicted and realised accepted draft tokens (summed over the
 * drafting streams). */
void kdt_budget_observe_accept(kdt_budget_ctl *c, double predicted, double realised);

#endif
