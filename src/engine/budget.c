/* budget.c - the auto budget controller (see budget.h for the rule). */
#include "budget.h"

#include <math.h>
#include <stdlib.h>

#define VERIFY_DECAY 0.97   /* per round: about the last 30 rounds dominate the fit */
#define ACCEPT_DECAY 0.95
#define PRIOR_WEIGHT 1.0    /* each prior point starts as one round's worth and decays */
#define CALIB_PRIOR 4.0     /* pseudo-tokens behind the prior calibration 1.0 */

void kdt_budget_init(kdt_budget_ctl *c, double base_s, double per_node_s) {
    *c = (kdt_budget_ctl){0};
    c->prior_a = base_s > 0 ? base_s : 1e-3;
    c->prior_b = per_node_s > 0 ? per_node_s : 1e-4;
}

void kdt_budget_verify_line(const kdt_budget_ctl *c, double *a, double *b) {
    /* data plus two prior points at N = 1 and N = 64; the prior fades like an old measurement
     * but keeps a small floor so the slope stays defined when every round verifies the same N */
    const double x1 = 1.0, x2 = 64.0;
    const double y1 = c->prior_a + c->prior_b * x1, y2 = c->prior_a + c->prior_b * x2;
    double w = PRIOR_WEIGHT * pow(VERIFY_DECAY, c->n_rounds);
    if (w < 1e-3) w = 1e-3;
    double sw = c->sw + 2 * w, sx = c->sx + w * (x1 + x2), sxx = c->sxx + w * (x1 * x1 + x2 * x2),
           sy = c->sy + w * (y1 + y2), sxy = c->sxy + w * (x1 * y1 + x2 * y2);
    double den = sw * sxx - sx * sx;
    double bb = den > 0 ? (sw * sxy - sx * sy) / den : c->prior_b;
    if (!(bb > 1e-9 * c->prior_b)) bb = 1e-9 * c->prior_b; /* never free, never negative */
    double aa = (sy - bb * sx) / sw;
    if (!(aa >= 0)) aa = 0;
    *a = aa;
    *b = bb;
}

double kdt_budget_calibration(const kdt_budget_ctl *c) {
    double r = (c->acc_real + CALIB_PRIOR) / (c->acc_pred + CALIB_PRIOR);
    return r < 0.05 ? 0.05 : r > 4.0 ? 4.0 : r;
}

typedef struct gain_item {
    double gain;
    int32_t stream, index;
} gain_item;

static int cmp_gain(const void *pa, const void *pb) {
    const gain_item *a = pa, *b = pb;
    if (a->gain != b->gain) return a->gain > b->gain ? -1 : 1;
    if (a->stream != b->stream) return a->stream < b->stream ? -1 : 1;
    return (a->index > b->index) - (a->index < b->index);
}

void kdt_budget_choose(const kdt_budget_ctl *c, int32_t n, const kdt_budget_stream *st,
                       int64_t fixed_nodes, double fixed_tokens, int32_t *budget) {
    int64_t total = 0;
    for (int32_t s = 0; s < n; s++) total += st[s].cap > 0 ? st[s].cap : 0;
    gain_item *items = total ? malloc(sizeof *items * (size_t)total) : NULL;
    if (total && !items) {
        for (int32_t s = 0; s < n; s++) budget[s] = st[s].cap;
        return;
    }
    const double calib = kdt_budget_calibration(c);
    int64_t m = 0;
    for (int32_t s = 0; s < n; s++)
        for (int32_t i = 0; i < st[s].cap; i++) {
            double g = exp((double)st[s].score[i]) * calib;
            items[m++] = (gain_item){isfinite(g) ? g : 0.0, s, i};
        }
    /* pop order gives non-increasing gains per stream, so the sorted order keeps each stream's
     * nodes in pop order (ties by index) and every prefix is a valid set of per-stream budgets */
    qsort(items, (size_t)m, sizeof *items, cmp_gain);
    double a, b;
    kdt_budget_verify_line(c, &a, &b);
    double *acc = calloc((size_t)(n > 0 ? n : 1), sizeof *acc); /* accepted so far per stream */
    double tokens = fixed_tokens + n; /* every stream emits at least its bonus */
    int64_t nodes = fixed_nodes + n;  /* roots */
    double best = tokens / (c->fixed_s + a + b * (double)nodes);
    int64_t best_m = 0;
    for (int64_t k = 0; k < m && acc; k++) {
        const int32_t s = items[k].stream;
        double room = st[s].depth_limit - acc[s];
        double g = items[k].gain < room ? items[k].gain : (room > 0 ? room : 0);
        acc[s] += g;
        tokens += g;
        nodes++;
        double rate = tokens / (c->fixed_s + a + b * (double)nodes);
        if (rate > best) {
            best = rate;
            best_m = k + 1;
        }
    }
    for (int32_t s = 0; s < n; s++) budget[s] = 0;
    if (!acc) { /* no memory for the scan: fall back to the caps */
        for (int32_t s = 0; s < n; s++) budget[s] = st[s].cap;
    } else {
        for (int64_t k = 0; k < best_m; k++) budget[items[k].stream]++;
    }
    free(acc);
    free(items);
}

void kdt_budget_observe_round(kdt_budget_ctl *c, double fixed_s, int64_t nodes, double verify_s) {
    const double x = (double)nodes, y = verify_s;
    c->sw = c->sw * VERIFY_DECAY + 1.0;
    c->sx = c->sx * VERIFY_DECAY + x;
    c->sxx = c->sxx * VERIFY_DECAY + x * x;
    c->sy = c->sy * VERIFY_DECAY + y;
    c->sxy = c->sxy * VERIFY_DECAY + x * y;
    c->fixed_s = c->n_rounds == 0 ? fixed_s : 0.9 * c->fixed_s + 0.1 * fixed_s;
    c->n_rounds++;
}

void kdt_budget_observe_accept(kdt_budget_ctl *c, double predicted, double realised) {
    c->acc_pred = c->acc_pred * ACCEPT_DECAY + predicted;
    c->acc_real = c->acc_real * ACCEPT_DECAY + realised;
}
