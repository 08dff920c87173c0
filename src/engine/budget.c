/* budget.c - the auto budget controller (see budget.h for the rule). */
#include "budget.h"

#include "kdtree/kernels.h" /* KDT_MAX_NODES */

#include <math.h>
#include <stdlib.h>

#define VERIFY_DECAY 0.97   /* per round: about the last 30 rounds dominate the fit */
#define ACCEPT_DECAY 0.95
#define PRIOR_WEIGHT 1.0    /* each prior point starts as one round's worth and decays */
#define CALIB_PRIOR 4.0     /* pseudo-tokens behind the prior calibration 1.0 */
#define RANK_PRIOR 4.0      /* pseudo-tokens of the global calibration behind a rank bin's own */
#define RANK_STALE_DECAY 0.995 /* per round, for a bin no verified pop reached */
#define KIND_DECAY 0.99     /* per round of a kind: about the last 100 rounds. Runs of low tau last
                               10-30 rounds; a leader that followed them switched to plain too late
                               and stayed too long (H200, batch 1: auto's drafted rounds made 5,100
                               tokens/s, its plain rounds 2,180, yet 20 % of rounds were plain) */
#define WARM_PLAIN 2        /* a new bucket first runs this many plain rounds (cheap), */
#define WARM_DRAFTED 3      /* then up to this many drafted ones, before choosing; */
#define WARM_GIVE_UP 0.5    /* fewer once a drafted round ran below this share of plain's rate
                               (a drafted round with tau 1 still makes ~0.6 on an H200 at batch 1) */
#define LEAD_MIN_WEIGHT 8.0 /* drafting keeps the lead until its history holds this many rounds */
#define TRY_DRAFTED 4       /* a try of the trailing kind: drafted rounds vary with tau, so more */
#define TRY_PLAIN 1         /* plain rounds take the same time each (H200: 458 +- 5 us at batch 1) */
#define TRY_COST_PLAIN 0.005 /* plain tries are spaced to cost this share of the time */
#define TRY_COST 0.01       /* drafted tries: the spacing stops growing once tries cost this share */
#define TRY_COST_MAX 0.10   /* and they never cost more than this share (less when far behind) */
#define TRY_MIN_ROUNDS 8    /* first spacing in leader rounds, doubling with each try in a row that
                               left the leader in place */
#define TRY_MAX_STREAK 3    /* 8 << 3 = at most 64 leader rounds between tries */
#define TRY_PLAIN_STREAK 2  /* plain tries: spacing x 2 per try that left drafting in the lead, up to
                               x 4 (0.125 % of the time). A plain round's rate hardly varies, and
                               drafting loses the lead on its own history without a try; session 5
                               put the plain tries at ~1 % of the time at batch 1 on the H200 (with
                               the drafter-context flush each one causes) */

void kdt_budget_init(kdt_budget_ctl *c, double base_s, double per_node_s) {
    *c = (kdt_budget_ctl){0};
    c->prior_a = base_s > 0 ? base_s : 1e-3;
    c->prior_b = per_node_s > 0 ? per_node_s : 1e-4;
    for (int i = 0; i < KDT_BUDGET_BUCKETS; i++) c->bucket[i].leader = -1;
}

void kdt_budget_set_padding(kdt_budget_ctl *c, int32_t pad_first, int32_t pad_step) {
    c->pad_first = pad_first > 0 ? pad_first : 1;
    c->pad_step = pad_step > 0 ? pad_step : 0;
}

int64_t kdt_budget_cost_rows(const kdt_budget_ctl *c, int32_t S, int32_t stride, int64_t nodes) {
    if (c->pad_step <= 0) return nodes;
    const int64_t r = (int64_t)S * stride;
    return r <= c->pad_first ? c->pad_first : (r + c->pad_step - 1) / c->pad_step * c->pad_step;
}

void kdt_budget_verify_line(const kdt_budget_ctl *c, double *a, double *b) {
    if (c->test_b > 0) {
        *a = c->test_a;
        *b = c->test_b;
        return;
    }
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

static double clamp_calibration(double r) { return r < 0.05 ? 0.05 : r > 4.0 ? 4.0 : r; }

double kdt_budget_calibration(const kdt_budget_ctl *c) {
    return clamp_calibration((c->acc_real + CALIB_PRIOR) / (c->acc_pred + CALIB_PRIOR));
}

int kdt_budget_rank_bin(int32_t i) {
    int j = 0;
    while (j < KDT_BUDGET_RANK_BINS - 1 && (2 << j) <= i) j++;
    return j;
}

void kdt_budget_observe_ranks(kdt_budget_ctl *c, const double *predicted, const double *realised) {
    for (int j = 0; j < KDT_BUDGET_RANK_BINS; j++) {
        if (!(predicted[j] >= 0) || !(realised[j] >= 0) || !isfinite(predicted[j]) || !isfinite(realised[j]))
            return;
    }
    for (int j = 0; j < KDT_BUDGET_RANK_BINS; j++) {
        if (!(predicted[j] > 0)) { /* a bin no pop reached keeps what it knew, fading slowly
                                        (at the round rate it would be back at the global value
                                        at once and undo the choice it led to; slowly, a bin is
                                        retried every few hundred rounds) */
            c->rank_pred[j] *= RANK_STALE_DECAY;
            c->rank_real[j] *= RANK_STALE_DECAY;
            continue;
        }
        c->rank_pred[j] = c->rank_pred[j] * ACCEPT_DECAY + predicted[j];
        c->rank_real[j] = c->rank_real[j] * ACCEPT_DECAY + realised[j];
    }
    c->have_ranks = 1;
}

double kdt_budget_calibration_rank(const kdt_budget_ctl *c, int32_t i) {
    const double g = kdt_budget_calibration(c);
    if (!c->have_ranks) return g;
    const int j = kdt_budget_rank_bin(i);
    return clamp_calibration((c->rank_real[j] + RANK_PRIOR * g) / (c->rank_pred[j] + RANK_PRIOR));
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

/* Stream st's first pops up to bmax, stopping once its expected accepted tokens reach the depth
 * limit (more nodes add nothing then): returns how many, and the expected tokens (capped) in *e.
 * calib[k]: the calibration of pop k + 1. */
static int32_t fill_stream(const kdt_budget_stream *st, int32_t bmax, const double *calib, double *e) {
    double sum = 0.0;
    int32_t k = 0;
    while (k < bmax && sum < st->depth_limit) {
        const double g = exp((double)st->score[k]) * calib[k];
        sum += isfinite(g) ? g : 0.0;
        k++;
    }
    *e = sum < st->depth_limit ? sum : st->depth_limit;
    return k;
}

/* Padded rows: a pass costs what its stride costs, so try every power-of-two stride and fill each
 * stream up to stride - 1 (fill_stream). */
static double choose_padded(const kdt_budget_ctl *c, int32_t n, const kdt_budget_stream *st,
                            const kdt_budget_others *o, double a, double b, int32_t *budget) {
    int32_t max_cap = 0;
    for (int32_t s = 0; s < n; s++)
        if (st[s].cap > max_cap) max_cap = st[s].cap;
    double calib[KDT_MAX_NODES];
    if (max_cap > KDT_MAX_NODES - 1) max_cap = KDT_MAX_NODES - 1; /* caps are budgets <= KDT_MAX_BUDGET */
    for (int32_t k = 0; k < max_cap; k++) calib[k] = kdt_budget_calibration_rank(c, k + 1);
    int32_t sigma = 2;
    while (sigma < o->min_stride) sigma *= 2;
    const int32_t S = n + o->n_streams;
    double best = -1.0;
    int32_t best_sigma = sigma;
    for (;; sigma *= 2) {
        double tokens = o->tokens + n, e;
        for (int32_t s = 0; s < n; s++) {
            fill_stream(&st[s], st[s].cap < sigma - 1 ? st[s].cap : sigma - 1, calib, &e);
            tokens += e;
        }
        const double rate = tokens / (c->fixed_s + a + b * (double)kdt_budget_cost_rows(c, S, sigma, 0));
        if (rate > best) {
            best = rate;
            best_sigma = sigma;
        }
        if (sigma - 1 >= max_cap) break;
    }
    for (int32_t s = 0; s < n; s++) {
        double e;
        budget[s] = fill_stream(&st[s], st[s].cap < best_sigma - 1 ? st[s].cap : best_sigma - 1, calib, &e);
    }
    return best;
}

double kdt_budget_choose(const kdt_budget_ctl *c, int32_t n, const kdt_budget_stream *st,
                         const kdt_budget_others *others, int32_t *budget) {
    const kdt_budget_others none = {0, 0, 0.0, 1};
    const kdt_budget_others *o = others ? others : &none;
    double a, b;
    kdt_budget_verify_line(c, &a, &b);
    if (c->pad_step > 0) return choose_padded(c, n, st, o, a, b, budget);

    int64_t total = 0;
    for (int32_t s = 0; s < n; s++) total += st[s].cap > 0 ? st[s].cap : 0;
    gain_item *items = total ? malloc(sizeof *items * (size_t)total) : NULL;
    double *acc = calloc((size_t)(n > 0 ? n : 1), sizeof *acc); /* accepted so far per stream */
    if ((total && !items) || !acc) { /* no memory for the scan: the caps */
        for (int32_t s = 0; s < n; s++) budget[s] = st[s].cap;
        free(items);
        free(acc);
        return 0.0;
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
    if (m > 0) qsort(items, (size_t)m, sizeof *items, cmp_gain); /* m = 0: every cap is 0 (streams with one token left) */
    double tokens = o->tokens + n;  /* every stream emits at least its bonus */
    int64_t nodes = o->nodes + n;   /* roots */
    double best = tokens / (c->fixed_s + a + b * (double)nodes);
    int64_t best_m = 0;
    for (int64_t k = 0; k < m; k++) {
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
    for (int64_t k = 0; k < best_m; k++) budget[items[k].stream]++;
    free(acc);
    free(items);
    return best;
}

static void fit_point(kdt_budget_ctl *c, double x, double y) {
    c->sw = c->sw * VERIFY_DECAY + 1.0;
    c->sx = c->sx * VERIFY_DECAY + x;
    c->sxx = c->sxx * VERIFY_DECAY + x * x;
    c->sy = c->sy * VERIFY_DECAY + y;
    c->sxy = c->sxy * VERIFY_DECAY + x * y;
    c->n_rounds++;
}

void kdt_budget_observe_round(kdt_budget_ctl *c, double fixed_s, int64_t rows, double verify_s) {
    c->fixed_s = c->n_rounds == 0 ? fixed_s : 0.9 * c->fixed_s + 0.1 * fixed_s;
    fit_point(c, (double)rows, verify_s);
}

void kdt_budget_observe_plain_verify(kdt_budget_ctl *c, int64_t rows, double verify_s) {
    fit_point(c, (double)rows, verify_s);
}

void kdt_budget_observe_accept(kdt_budget_ctl *c, double predicted, double realised) {
    c->acc_pred = c->acc_pred * ACCEPT_DECAY + predicted;
    c->acc_real = c->acc_real * ACCEPT_DECAY + realised;
}

/* ---- draft or not --------------------------------------------------------------------------- */

static int bucket_index(int32_t S) {
    int i = 0;
    while (i < KDT_BUDGET_BUCKETS - 1 && (1 << i) < S) i++;
    return i;
}

static double arm_rate(const kdt_budget_arm *a) { return a->seconds > 0 ? a->tokens / a->seconds : 0.0; }
static double arm_round_s(const kdt_budget_arm *a) { return a->weight > 0 ? a->seconds / a->weight : 0.0; }
/* Drafting loses the lead: slower than plain on a history of at least LEAD_MIN_WEIGHT rounds. */
static int drafting_lost(const kdt_budget_bucket *b) {
    return arm_rate(&b->arm[1]) < arm_rate(&b->arm[0]) && b->arm[1].weight >= LEAD_MIN_WEIGHT;
}

/* The share of a round the trailing kind loses against the leader (0 when it is not behind). */
static double trail_loss(const kdt_budget_bucket *b) {
    const double plain = arm_rate(&b->arm[0]), drafted = arm_rate(&b->arm[1]);
    const double lr = b->leader == 1 ? drafted : plain, tr = b->leader == 1 ? plain : drafted;
    return lr > 0 && tr < lr ? 1.0 - tr / lr : 0.0;
}

/* The share of the time drafted tries may cost: TRY_COST_MAX at a close race, down to TRY_COST at
 * half the leader's rate or less. */
static double drafted_try_share(double loss) {
    const double share = TRY_COST_MAX * (1.0 - 2.0 * loss);
    return share < TRY_COST ? TRY_COST : share;
}

void kdt_budget_test_kinds(kdt_budget_ctl *c, uint32_t kinds, int32_t len) {
    c->test_kinds = kinds;
    c->test_len = len > 0 && len <= 32 ? len : 0;
    c->test_round = 0;
}

void kdt_budget_test_verify_line(kdt_budget_ctl *c, double a, double b) {
    c->test_a = a > 0 ? a : 0.0;
    c->test_b = b > 0 ? b : 0.0;
}

int kdt_budget_next_round_drafts(kdt_budget_ctl *c, int32_t S) {
    if (c->test_len > 0) return (int)((c->test_kinds >> (c->test_round++ % c->test_len)) & 1u);
    kdt_budget_bucket *b = &c->bucket[bucket_index(S)];
    if (b->arm[0].rounds < WARM_PLAIN) return 0;
    if (b->arm[1].rounds < WARM_DRAFTED &&
        (b->arm[1].rounds == 0 || arm_rate(&b->arm[1]) >= WARM_GIVE_UP * arm_rate(&b->arm[0])))
        return 1;
    if (b->trying > 0) return b->try_kind;
    const double plain = arm_rate(&b->arm[0]), drafted = arm_rate(&b->arm[1]);
    if (b->leader < 0) b->leader = drafted >= plain;
    else if (b->leader == 1 && drafting_lost(b)) b->leader = 0;
    else if (b->leader == 0 && drafted > plain) b->leader = 1;
    const int lead = b->leader, trail = !lead;
    /* A try of the trailing kind loses (1 - its rate / the leader's) of its own duration; tries
     * are spaced by that loss (see budget.h). Drafted tries back off: tau stays at 1-2 for dozens
     * of rounds, then at L + 1 (H200, batch 1), so a try that confirmed plain waits 8, 16, 32, 64
     * leader rounds, within [share, TRY_COST] of the time; share falls from TRY_COST_MAX at a
     * close race to TRY_COST at half plain's rate (64 streams on the H200: drafted 30k tokens/s
     * against plain 78k, where 10 % of the time in tries cost 6 % of the throughput). */
    const double loss = trail_loss(b);
    const int try_len = trail ? TRY_DRAFTED : TRY_PLAIN;
    const double try_loss_s = try_len * arm_round_s(&b->arm[trail]) * loss; /* what one try costs */
    const double min_spacing = TRY_MIN_ROUNDS * arm_round_s(&b->arm[lead]);
    double interval;
    if (trail) {
        const double share = drafted_try_share(loss);
        interval = min_spacing * (double)(1 << b->streak);
        if (interval > try_loss_s / TRY_COST) interval = try_loss_s / TRY_COST;
        if (interval < try_loss_s / share) interval = try_loss_s / share;
    } else {
        interval = try_loss_s / TRY_COST_PLAIN *
                   (double)(1 << (b->streak < TRY_PLAIN_STREAK ? b->streak : TRY_PLAIN_STREAK));
    }
    if (interval < min_spacing) interval = min_spacing;
    if (b->since_s >= interval) {
        b->since_s = 0.0;
        b->try_kind = trail;
        b->trying = try_len;
        b->try_tokens = b->try_seconds = 0.0;
        return trail;
    }
    return lead;
}

void kdt_budget_observe_kind(kdt_budget_ctl *c, int32_t S, int drafted, double tokens, double seconds) {
    if (!(seconds > 0) || !(tokens >= 0) || !isfinite(seconds) || !isfinite(tokens)) return;
    kdt_budget_bucket *b = &c->bucket[bucket_index(S)];
    const int kind = drafted ? 1 : 0;
    kdt_budget_arm *a = &b->arm[kind];
    a->tokens = a->tokens * KIND_DECAY + tokens;
    a->seconds = a->seconds * KIND_DECAY + seconds;
    a->weight = a->weight * KIND_DECAY + 1.0;
    a->rounds++;
    if (b->trying > 0 && kind == b->try_kind) {
        b->try_tokens += tokens;
        b->try_seconds += seconds;
        if (--b->trying > 0) return;
        /* the try is over. A drafted try that beat plain on its own means tau has changed (a
         * slow start, a hard passage over): drafting leads from now, judged on the new rounds */
        const int won = kind == 1 ? b->try_tokens / b->try_seconds > arm_rate(&b->arm[0]) : drafting_lost(b);
        if (won && kind == 1) {
            a->tokens = b->try_tokens;
            a->seconds = b->try_seconds;
            a->weight = TRY_DRAFTED;
        }
        if (won) {
            b->leader = kind;
            b->streak = 0;
        } else {
            b->streak += b->streak < TRY_MAX_STREAK;
        }
    } else {
        b->since_s += seconds;
    }
}

void kdt_budget_observe_setup(kdt_budget_ctl *c, int32_t S, int drafted, double seconds) {
    if (!(seconds > 0) || !isfinite(seconds)) return;
    kdt_budget_bucket *b = &c->bucket[bucket_index(S)];
    const int kind = drafted ? 1 : 0;
    if (b->leader < 0 || kind == b->leader) return;
    /* the same share as the tries' spacing: at a close race (batch 1 on the H200, drafting 1 %
     * behind after a hard first prompt) a 4 ms capture charged at TRY_COST kept auto plain for
     * 900 rounds (420 ms) while drafting ran 2.6x faster; far behind it stays TRY_COST */
    b->since_s -= seconds / (kind ? drafted_try_share(trail_loss(b)) : TRY_COST_PLAIN);
}

double kdt_budget_kind_rate(const kdt_budget_ctl *c, int32_t S, int drafted) {
    return arm_rate(&c->bucket[bucket_index(S)].arm[drafted ? 1 : 0]);
}
