/* test_engine_budget.c - the auto controller (src/engine/budget.c): the verify-cost fit
 * recovers a measured line, the choice follows the cost (cheap nodes -> full caps, dear nodes ->
 * empty trees), gains go to the stream whose nodes are worth more, the depth cap bounds a
 * stream's expected tokens, and the choice maximises expected tokens per second (checked against
 * brute force over every budget pair, with costs per node and with padded GPU rows). The
 * draft-or-not choice, run against simulated rounds, keeps throughput within 3 % of the better
 * kind, whichever it is, and follows a change of leader. One tree build serves auto's choice and
 * its verify pass: the prefix of the tree at the cap equals a build at the budget, bit for bit. */
#ifdef KDT_WITH_MODEL /* the engine is built with the model (jansson) */
#include "t.h"

#include "engine/budget.h"
#include "engine/engine_internal.h"

#include <math.h>
#include <string.h>

static void test_fit(void) {
    kdt_budget_ctl c;
    kdt_budget_init(&c, 5e-3, 1e-3); /* a wrong prior */
    for (int r = 0; r < 200; r++) {
        int64_t n = 8 + (r * 7) % 120;
        kdt_budget_observe_round(&c, 1e-3, n, 2e-4 + 3e-5 * (double)n);
    }
    double a, b;
    kdt_budget_verify_line(&c, &a, &b);
    CHECK_NEAR(b, 3e-5, 1.5e-6);
    CHECK_NEAR(a, 2e-4, 1e-4);
    kdt_budget_init(&c, 0, 0);
    kdt_budget_verify_line(&c, &a, &b);
    CHECK_NEAR(a, 1e-3, 1e-9); /* built-in prior */
    CHECK_NEAR(b, 1e-4, 1e-12);
}

static void scores_geometric(float *s, int n, double first, double ratio) {
    double p = first;
    for (int i = 0; i < n; i++, p *= ratio) s[i] = (float)log(p);
}

static void test_extremes(void) {
    float sa[32];
    scores_geometric(sa, 32, 0.9, 0.9);
    kdt_budget_stream st = {sa, 32, 16}; /* total gain 9 < depth 16: the cap never binds */
    int32_t b = -1;
    kdt_budget_ctl c;
    kdt_budget_init(&c, 1e-3, 1e-9); /* nodes nearly free */
    kdt_budget_choose(&c, 1, &st, NULL, &b);
    CHECK_EQ_INT(b, 32);
    kdt_budget_init(&c, 1e-3, 1.0); /* a node costs a second */
    kdt_budget_choose(&c, 1, &st, NULL, &b);
    CHECK_EQ_INT(b, 0);
}

static void test_allocation_and_bruteforce(void) {
    float good[16], poor[16];
    scores_geometric(good, 16, 0.95, 0.85);
    scores_geometric(poor, 16, 0.3, 0.5);
    kdt_budget_stream st[2] = {{good, 16, 7}, {poor, 16, 7}};
    kdt_budget_ctl c;
    kdt_budget_init(&c, 2e-3, 2e-4);
    int32_t b[2];
    const kdt_budget_others others = {3, 3, 2.5, 1};
    kdt_budget_choose(&c, 2, st, &others, b);
    CHECK(b[0] > b[1]);
    /* brute force: the chosen pair maximises expected tokens per second */
    double a, slope;
    kdt_budget_verify_line(&c, &a, &slope);
    const double calib = kdt_budget_calibration(&c);
    double best = -1, got = -1;
    for (int x = 0; x <= 16; x++)
        for (int y = 0; y <= 16; y++) {
            double tok = 2.5 + 2, ex = 0, ey = 0;
            for (int i = 0; i < x; i++) ex += exp(good[i]) * calib;
            for (int i = 0; i < y; i++) ey += exp(poor[i]) * calib;
            tok += (ex < 7 ? ex : 7) + (ey < 7 ? ey : 7);
            double rate = tok / (c.fixed_s + a + slope * (3 + 2 + x + y));
            if (rate > best) best = rate;
            if (x == b[0] && y == b[1]) got = rate;
        }
    CHECK_NEAR(got, best, 1e-9 * best);
}

static void test_depth_cap_and_calibration(void) {
    float flat[64];
    for (int i = 0; i < 64; i++) flat[i] = 0.0f; /* every node "certain": gains of 1 */
    kdt_budget_stream st = {flat, 64, 3};
    kdt_budget_ctl c;
    kdt_budget_init(&c, 1e-3, 1e-5);
    int32_t b;
    kdt_budget_choose(&c, 1, &st, NULL, &b);
    CHECK_EQ_INT(b, 3); /* past the depth cap, nodes add cost and no tokens */
    /* a drafter that delivers half of what it predicts lowers the calibration */
    for (int r = 0; r < 100; r++) kdt_budget_observe_accept(&c, 4.0, 2.0);
    CHECK_NEAR(kdt_budget_calibration(&c), 0.5, 0.05);
}

static void test_cost_rows(void) {
    kdt_budget_ctl c;
    kdt_budget_init(&c, 0, 0);
    CHECK_EQ_INT((int)kdt_budget_cost_rows(&c, 4, 16, 37), 37); /* CPU: verified nodes */
    kdt_budget_set_padding(&c, 8, 16);                          /* the GPU GEMMs' steps */
    CHECK_EQ_INT((int)kdt_budget_cost_rows(&c, 1, 2, 2), 8);
    CHECK_EQ_INT((int)kdt_budget_cost_rows(&c, 1, 8, 5), 8);
    CHECK_EQ_INT((int)kdt_budget_cost_rows(&c, 1, 9, 9), 16);
    CHECK_EQ_INT((int)kdt_budget_cost_rows(&c, 3, 4, 7), 16);
    CHECK_EQ_INT((int)kdt_budget_cost_rows(&c, 3, 11, 7), 48);
}

/* Padded rows: the pass costs by its power-of-two stride, so the best budget fills the stride
 * (B = stride - 1) unless the depth cap stops the gains first; brute force over every budget
 * (each paying its own stride) agrees with the choice. */
static void test_padded_choice(void) {
    kdt_budget_ctl c;
    kdt_budget_init(&c, 0, 0);
    kdt_budget_set_padding(&c, 8, 16);
    for (int r = 0; r < 200; r++) { /* a measured line: 300 us + 2 us per padded row */
        int64_t rows = 8 << (r % 4);
        kdt_budget_observe_round(&c, 2e-4, rows, 3e-4 + 2e-6 * (double)rows);
    }
    double a, slope;
    kdt_budget_verify_line(&c, &a, &slope);
    CHECK_NEAR(slope, 2e-6, 1e-7);
    const double calib = kdt_budget_calibration(&c);
    float sc[64];
    const double firsts[3] = {0.95, 0.8, 0.5}, ratios[3] = {0.93, 0.85, 0.6};
    for (int v = 0; v < 3; v++) {
        scores_geometric(sc, 64, firsts[v], ratios[v]);
        kdt_budget_stream st = {sc, 64, 16};
        int32_t b = -1;
        kdt_budget_choose(&c, 1, &st, NULL, &b);
        double best = -1, got = -1;
        for (int x = 0; x <= 64; x++) {
            int32_t stride = 2;
            while (stride < 1 + x) stride *= 2;
            double ex = 0;
            for (int i = 0; i < x; i++) ex += exp(sc[i]) * calib;
            const double tok = 1 + (ex < 16 ? ex : 16);
            const double rate = tok / (c.fixed_s + a + slope * (double)kdt_budget_cost_rows(&c, 1, stride, 0));
            if (rate > best) best = rate;
            if (x == b) got = rate;
        }
        CHECK_NEAR(got, best, 1e-9 * best);
        CHECK_MSG(((b + 1) & b) == 0, "variant %d: budget %d does not fill a power-of-two stride", v, b);
    }
    /* another stream in the batch forces stride 16: the auto stream fills it for free */
    scores_geometric(sc, 64, 0.5, 0.6);
    kdt_budget_stream st = {sc, 64, 16};
    const kdt_budget_others big = {1, 16, 3.0, 16};
    int32_t b = -1;
    kdt_budget_choose(&c, 1, &st, &big, &b);
    CHECK(b >= 15);
    /* the depth cap: gains of 1 stop counting at L = 3, so no node past it is kept */
    float flat[64] = {0};
    kdt_budget_stream capped = {flat, 64, 3};
    kdt_budget_choose(&c, 1, &capped, NULL, &b);
    CHECK_EQ_INT(b, 3);
}

/* Per pop-index calibration: the surrogate overrates a big tree's last pops (here pops 8-15 are
 * accepted at 0.2 of their surrogate, pops 1-7 at 1.0). One global calibration, fitted on the
 * rounds it chose (mostly 16-row trees), underrates the 8-row tree and keeps choosing 16; the
 * per-bin calibration sees every verified pop in its own bin and settles on 8, the better one. */
static void run_rank_sim(int with_ranks, int *n8, int *n16) {
    kdt_budget_ctl c;
    kdt_budget_init(&c, 0, 0);
    kdt_budget_set_padding(&c, 8, 16);
    for (int r = 0; r < 200; r++) { /* the measured cost line: 300 us + 10 us per padded row */
        const int64_t rows = 8 << (r % 3);
        kdt_budget_observe_round(&c, 250e-6, rows, 300e-6 + 10e-6 * (double)rows);
    }
    float sc[32];
    scores_geometric(sc, 32, 0.9, 0.85);
    *n8 = *n16 = 0;
    for (int r = 0; r < 600; r++) {
        kdt_budget_stream st = {sc, 31, 7};
        int32_t b = -1;
        kdt_budget_choose(&c, 1, &st, NULL, &b);
        int32_t stride = 2;
        while (stride < 1 + b) stride *= 2;
        double pred = 0, real = 0, bp[KDT_BUDGET_RANK_BINS] = {0}, br[KDT_BUDGET_RANK_BINS] = {0};
        for (int i = 0; i < b; i++) {
            const double g = exp(sc[i]), a = g * (i < 7 ? 1.0 : 0.2);
            pred += g, real += a;
            bp[kdt_budget_rank_bin(i + 1)] += g, br[kdt_budget_rank_bin(i + 1)] += a;
        }
        const int64_t rows = kdt_budget_cost_rows(&c, 1, stride, 0);
        kdt_budget_observe_round(&c, 250e-6, rows, 300e-6 + 10e-6 * (double)rows);
        kdt_budget_observe_accept(&c, pred < 7 ? pred : 7, real < 7 ? real : 7);
        if (with_ranks) kdt_budget_observe_ranks(&c, bp, br);
        if (r >= 300) *n8 += stride == 8, *n16 += stride == 16;
    }
}

static void test_rank_calibration(void) {
    CHECK_EQ_INT(kdt_budget_rank_bin(1), 0);
    CHECK_EQ_INT(kdt_budget_rank_bin(3), 1);
    CHECK_EQ_INT(kdt_budget_rank_bin(4), 2);
    CHECK_EQ_INT(kdt_budget_rank_bin(15), 3);
    CHECK_EQ_INT(kdt_budget_rank_bin(16), 4);
    CHECK_EQ_INT(kdt_budget_rank_bin(1024), KDT_BUDGET_RANK_BINS - 1);
    int n8, n16;
    run_rank_sim(0, &n8, &n16);
    printf("  global calibration: stride 8 in %d, stride 16 in %d of the last 300 rounds\n", n8, n16);
    CHECK(n16 >= 270); /* the failure the bins fix */
    run_rank_sim(1, &n8, &n16);
    printf("  per pop-index calibration: stride 8 in %d, stride 16 in %d of the last 300 rounds\n", n8, n16);
    CHECK(n8 >= 290);
    /* bad input is ignored */
    kdt_budget_ctl c;
    kdt_budget_init(&c, 0, 0);
    double bad[KDT_BUDGET_RANK_BINS] = {1, NAN}, ok[KDT_BUDGET_RANK_BINS] = {1};
    kdt_budget_observe_ranks(&c, bad, ok);
    CHECK_EQ_INT(c.have_ranks, 0);
    CHECK_NEAR(kdt_budget_calibration_rank(&c, 5), kdt_budget_calibration(&c), 1e-12);
}

/* A simulated engine: per round, tokens and seconds of a drafted or a plain round at S streams.
 * Drafted rounds vary (tau from a fixed pseudo-random sequence); plain rounds emit S tokens. */
typedef struct sim {
    double drafted_s, plain_s, tau_mean;
    uint64_t rng;
} sim;

static double sim_round(sim *m, int drafted, int32_t S, double *seconds) {
    if (!drafted) {
        *seconds = m->plain_s;
        return S;
    }
    double tok = 0;
    for (int32_t s = 0; s < S; s++) { /* tau uniform on 1 .. 2 tau_mean - 1 */
        const int span = (int)(2 * m->tau_mean - 1);
        tok += 1 + (double)(t_rand_int(&m->rng, span));
    }
    *seconds = m->drafted_s;
    return tok;
}

/* Runs n rounds; returns achieved tokens/s over the best kind's expected rate. */
static double sim_run(kdt_budget_ctl *c, sim *m, int32_t S, int n, int *n_drafted) {
    double tok = 0, sec = 0;
    *n_drafted = 0;
    for (int r = 0; r < n; r++) {
        const int d = kdt_budget_next_round_drafts(c, S);
        double s = 0;
        const double t = sim_round(m, d, S, &s);
        kdt_budget_observe_kind(c, S, d, t, s);
        tok += t;
        sec += s;
        *n_drafted += d;
    }
    const double best = fmax(S * m->tau_mean / m->drafted_s, S / m->plain_s);
    return tok / sec / best;
}

/* sim_run on a fresh controller, printed */
static double fresh_run(kdt_budget_ctl *c, sim *m, int32_t S, int n, const char *what) {
    kdt_budget_init(c, 0, 0);
    int nd = 0;
    const double eff = sim_run(c, m, S, n, &nd);
    printf("  %s: %.1f %% of the better kind, %d of %d rounds drafted\n", what, 100 * eff, nd, n);
    return eff;
}

static void test_draft_or_not(void) {
    kdt_budget_ctl c;
    kdt_budget_init(&c, 0, 0);
    int nd = 0;
    /* batch 1 on the H200 (bench/RESULTS.md): drafted 720 us, tau 3.5; plain 450 us */
    sim one = {720e-6, 450e-6, 3.5, 11};
    double eff = sim_run(&c, &one, 1, 1000, &nd);
    printf("  batch 1: %.1f %% of the better kind, %d of 1000 rounds drafted\n", 100 * eff, nd);
    CHECK(eff >= 0.97);
    CHECK(nd > 985); /* the warm-up and plain tries backing off to 0.125 % of the time */
    /* batch 64 on the H200 server run: plain 35.4k tokens/s, drafted 25.0k (tau 3.2); here
     * batch 16 with drafted 1300 us at tau 2 (24.6k) against plain 565 us (28.3k) */
    sim sixteen = {1300e-6, 565e-6, 2.0, 12};
    eff = sim_run(&c, &sixteen, 16, 1000, &nd);
    printf("  batch 16: %.1f %% of the better kind, %d of 1000 rounds drafted\n", 100 * eff, nd);
    CHECK(eff >= 0.97);
    CHECK(nd < 80); /* the warm-up plus 3-round tries at most 64 leader rounds apart */
    /* batch sizes keep their own measurements: batch 1 still drafts */
    CHECK(kdt_budget_kind_rate(&c, 1, 1) > kdt_budget_kind_rate(&c, 1, 0));
    CHECK(kdt_budget_kind_rate(&c, 16, 0) > kdt_budget_kind_rate(&c, 16, 1));
    CHECK_EQ_INT(kdt_budget_next_round_drafts(&c, 1), 1);
    /* the leader changes (a longer context made drafting pay at 16): drafting takes over */
    sixteen.drafted_s = 500e-6;
    sim_run(&c, &sixteen, 16, 400, &nd);
    eff = sim_run(&c, &sixteen, 16, 600, &nd);
    printf("  batch 16 after the change: %.1f %% of the better kind, %d of 600 rounds drafted\n", 100 * eff, nd);
    CHECK(eff >= 0.95);
    CHECK(nd > 550);
    /* drafted rounds in runs, as traced at batch 1 on the H200 (KDT_AUTO_TRACE): 30 rounds at
     * tau 1 (sometimes 2; a drafted round then loses to a plain one), then 30 at tau 5-8; drafting
     * always is 2.2x plain on average, and auto must stay within 3 % of it (the target).
     * The first controller, which judged each 3-round try on its own, made 75 % here. */
    kdt_budget_ctl r;
    kdt_budget_init(&r, 0, 0);
    uint64_t rng = 21;
    double tok = 0, sec = 0, always_tok = 0, always_sec = 0;
    for (int i = 0; i < 3000; i++) {
        const int hard = (i / 30) % 2 == 0;
        const double tau = hard ? 1 + (t_rand_int(&rng, 5) == 0) : 5 + t_rand_int(&rng, 4);
        const int d = kdt_budget_next_round_drafts(&r, 1);
        const double t = d ? tau : 1.0, sd = d ? 720e-6 : 450e-6;
        kdt_budget_observe_kind(&r, 1, d, t, sd);
        tok += t, sec += sd, always_tok += tau, always_sec += 720e-6;
    }
    printf("  batch 1, tau in runs: %.1f %% of drafting always\n", 100 * (tok / sec) / (always_tok / always_sec));
    CHECK(tok / sec >= 0.97 * always_tok / always_sec);
    /* a slow start, as traced at batch 1 on the H200 (first prompt of the held-out set): tau
     * 1-2 for the first 100 tokens (drafting loses to plain there), then 2-6. The controller
     * before this test ran 110 plain rounds after the change: 6 % behind always drafting. */
    for (int seed = 1; seed <= 4; seed++) {
        kdt_budget_ctl w;
        kdt_budget_init(&w, 0, 0);
        uint64_t g = 100 + seed;
        double wt = 0, ws = 0, at = 0, as = 0;
        while (wt < 4096) {
            const int hard = wt < 100;
            const double tau = hard ? 1 + (t_rand_int(&g, 4) == 0) : 2 + t_rand_int(&g, 5);
            const int d = kdt_budget_next_round_drafts(&w, 1);
            const double t = d ? tau : 1.0, sd = d ? 770e-6 : 458e-6;
            kdt_budget_observe_kind(&w, 1, d, t, sd);
            wt += t, ws += sd;
        }
        while (at < 4096) { /* always drafting, the same regimes */
            const double tau = at < 100 ? 1 + (t_rand_int(&g, 4) == 0) : 2 + t_rand_int(&g, 5);
            at += tau, as += 770e-6;
        }
        printf("  batch 1, slow start (seed %d): %.1f %% of drafting always\n", seed, 100 * (wt / ws) / (at / as));
        CHECK(wt / ws >= 0.98 * at / as);
    }
    /* far behind (64 streams on the H200 server: drafted 30k tokens/s, plain 78k): the drafted
     * tries must cost little, about 1 % of the time */
    kdt_budget_ctl f;
    sim wide = {5200e-6, 815e-6, 2.5, 14};
    CHECK(fresh_run(&f, &wide, 64, 4000, "batch 64, drafting far behind") >= 0.98);
    /* a drafted try that captured a graph (8 ms at 60 streams) pushes the next try back by its
     * time over the try budget; the leader's own setup rounds do not */
    kdt_budget_bucket *fb = &f.bucket[KDT_BUDGET_BUCKETS - 1];
    CHECK_EQ_INT(fb->leader, 0);
    const double before = fb->since_s;
    kdt_budget_observe_setup(&f, 64, 1, 8e-3);
    CHECK_NEAR(fb->since_s, before - 0.8, 1e-9);
    kdt_budget_observe_setup(&f, 64, 0, 8e-3);
    CHECK_NEAR(fb->since_s, before - 0.8, 1e-9);
    /* at a close race the charge follows the tries' own share (TRY_COST_MAX): a 4.2 ms capture
     * after a hard first prompt at batch 1 (drafting 1 % behind) pushes the next try back by
     * ~43 ms, not 420 ms (the H200 gpu_check of session 6 sat 900 plain rounds that way) */
    kdt_budget_ctl close;
    kdt_budget_init(&close, 400e-6, 1e-6);
    for (int i = 0; i < 40; i++) {
        kdt_budget_observe_kind(&close, 1, 0, 1.0, 465e-6);
        kdt_budget_observe_kind(&close, 1, 1, 1.49, 705e-6); /* 2,113 vs 2,151 tokens/s */
    }
    (void)kdt_budget_next_round_drafts(&close, 1); /* settles the leader (and may start a try) */
    kdt_budget_bucket *cb = &close.bucket[0];
    CHECK_EQ_INT(cb->leader, 0);
    const double close_before = cb->since_s;
    kdt_budget_observe_setup(&close, 1, 1, 4.2e-3);
    const double pushed = close_before - cb->since_s;
    printf("  close race: a 4.2 ms drafted capture pushes the next try back by %.1f ms\n", pushed * 1e3);
    CHECK(pushed > 4.2e-3 && pushed < 0.05);
    /* the CPU reference: a drafted round costs ~15 plain ones (tiny pair: 90 ms at tau 2.5
     * against 6 ms), so tries must stay rare there: at least 85 % of plain's rate */
    kdt_budget_ctl cpu;
    sim slow = {90e-3, 6e-3, 2.5, 13};
    CHECK(fresh_run(&cpu, &slow, 1, 2000, "CPU-like batch 1") >= 0.85);
    /* nonsense measurements are ignored */
    kdt_budget_observe_kind(&c, 1, 1, 5.0, 0.0);
    kdt_budget_observe_kind(&c, 1, 1, NAN, 1.0);
    CHECK(isfinite(kdt_budget_kind_rate(&c, 1, 1)));
}


/* ---- one build at the caps serves every budget ------------------------------------------------ */

typedef struct tree_buf {
    kdt_tree t;
    int32_t *ints; /* 7 arrays */
} tree_buf;

static void tree_alloc(tree_buf *b, int32_t S, int32_t N) {
    const size_t sn = (size_t)S * N;
    b->ints = xmalloc(sizeof(int32_t) * (S + 6 * sn));
    b->t = (kdt_tree){S, N, b->ints, b->ints + S, b->ints + S + sn, b->ints + S + 2 * sn, b->ints + S + 3 * sn,
                      b->ints + S + 4 * sn, b->ints + S + 5 * sn, xmalloc(sizeof(float) * sn),
                      xmalloc(sizeof(uint64_t) * sn * KDT_MASK_WORDS(N))};
    memset(b->ints, 0x5a, sizeof(int32_t) * (S + 6 * sn)); /* nothing left unwritten passes */
    memset(b->t.score, 0x5a, sizeof(float) * sn);
    memset(b->t.anc_mask, 0x5a, sizeof(uint64_t) * sn * KDT_MASK_WORDS(N));
}

static void tree_free(tree_buf *b) {
    free(b->ints);
    free(b->t.score);
    free(b->t.anc_mask);
}

static int trees_equal(const kdt_tree *a, const kdt_tree *b) {
    const size_t S = (size_t)a->n_streams, sn = S * (size_t)a->max_nodes;
    return a->max_nodes == b->max_nodes && !memcmp(a->n_nodes, b->n_nodes, sizeof(int32_t) * S) &&
           !memcmp(a->token, b->token, sizeof(int32_t) * sn) && !memcmp(a->parent, b->parent, sizeof(int32_t) * sn) &&
           !memcmp(a->depth, b->depth, sizeof(int32_t) * sn) &&
           !memcmp(a->first_child, b->first_child, sizeof(int32_t) * sn) &&
           !memcmp(a->next_sibling, b->next_sibling, sizeof(int32_t) * sn) &&
           !memcmp(a->position, b->position, sizeof(int32_t) * sn) && !memcmp(a->score, b->score, sizeof(float) * sn) &&
           !memcmp(a->anc_mask, b->anc_mask, sizeof(uint64_t) * sn * KDT_MASK_WORDS(a->max_nodes));
}

/* Random top-K rows (descending, often tied, some -inf tails), caps up to 100 (two mask words),
 * budgets up to the cap, verify strides narrower and wider than the cap's, both build modes:
 * kdt_round_tree_prefix of the cap tree equals tree_build at the budgets in every byte. */
static void test_tree_prefix(void) {
    uint64_t rng = 77;
    int bad = 0;
    for (int it = 0; it < 400; it++) {
        const int32_t S = 1 + t_rand_int(&rng, 5), L = 1 + t_rand_int(&rng, 8), K = 1 + t_rand_int(&rng, 24);
        const int chain = t_rand_int(&rng, 6) == 0;
        const int32_t max_cap = it % 8 == 0 ? 100 : 31;
        int32_t *ids = xmalloc(sizeof(int32_t) * S * L * K), *caps = xmalloc(sizeof(int32_t) * S);
        int32_t *budget = xmalloc(sizeof(int32_t) * S), *dl = xmalloc(sizeof(int32_t) * S);
        int32_t *root = xmalloc(sizeof(int32_t) * S), *prefix = xmalloc(sizeof(int32_t) * S);
        float *lp = xmalloc(sizeof(float) * S * L * K);
        const double quant = t_rand_int(&rng, 2) ? 0.25 : 0.0;
        for (int32_t r = 0; r < S * L; r++) {
            double acc = -t_rand_unit(&rng);
            for (int32_t k = 0; k < K; k++) {
                ids[r * K + k] = 100 * r + k;
                acc -= 2.0 * t_rand_unit(&rng) * t_rand_unit(&rng);
                float v = (float)(quant > 0 ? quant * floor(acc / quant) : acc);
                if (k > 0 && v > lp[r * K + k - 1]) v = lp[r * K + k - 1];
                lp[r * K + k] = k >= 3 && t_rand_int(&rng, 10) == 0 ? -INFINITY : v;
                if (k > 0 && lp[r * K + k - 1] == -INFINITY) lp[r * K + k] = -INFINITY;
            }
        }
        int32_t pstride = 1, bmax = 0;
        for (int32_t s = 0; s < S; s++) {
            caps[s] = t_rand_int(&rng, max_cap + 1);
            budget[s] = t_rand_int(&rng, caps[s] + 1);
            dl[s] = 1 + t_rand_int(&rng, L);
            root[s] = 7 + s;
            prefix[s] = 40 * s + t_rand_int(&rng, 30);
            if (1 + caps[s] > pstride) pstride = 1 + caps[s];
            if (budget[s] > bmax) bmax = budget[s];
        }
        const int32_t stride = 1 + bmax + (t_rand_int(&rng, 2) ? t_rand_int(&rng, 80) : 0);
        tree_buf cap_tree, direct, cut;
        tree_alloc(&cap_tree, S, pstride);
        tree_alloc(&direct, S, stride);
        tree_alloc(&cut, S, stride);
        kdt_tree_build_params p = {S, L, K, ids, lp, dl, caps, root, prefix, chain};
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &cap_tree.t), KDT_OK);
        p.budget = budget;
        CHECK_EQ_INT(kdt_tree_build_cpu(&p, &direct.t), KDT_OK);
        kdt_round_tree_prefix(&cap_tree.t, &cut.t, budget);
        if (!trees_equal(&direct.t, &cut.t) && bad++ < 3)
            fprintf(stderr, "  case %d: S %d L %d K %d chain %d strides %d -> %d: prefix != build\n", it, S, L, K,
                    chain, pstride, stride);
        tree_free(&cap_tree);
        tree_free(&direct);
        tree_free(&cut);
        free(ids), free(caps), free(budget), free(dl), free(root), free(prefix), free(lp);
    }
    CHECK_EQ_INT(bad, 0);
}

int main(void) {
    T_RUN(test_fit);
    T_RUN(test_extremes);
    T_RUN(test_allocation_and_bruteforce);
    T_RUN(test_depth_cap_and_calibration);
    T_RUN(test_cost_rows);
    T_RUN(test_padded_choice);
    T_RUN(test_rank_calibration);
    T_RUN(test_draft_or_not);
    T_RUN(test_tree_prefix);
    return t_summary();
}
#else
#include <stdio.h>
int main(void) {
    printf("engine not built (no jansson): skipped\n");
    return 0;
}
#endif
