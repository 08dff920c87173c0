/* test_engine_budget.c - the auto controller (src/engine/budget.c): the verify-cost fit
 * recovers a measured line, the choice follows the cost (cheap nodes -> full caps, dear nodes ->
 * empty trees), gains go to the stream whose nodes are worth more, the depth cap bounds a
 * stream's expected tokens, and the choice maximises expected tokens per second (checked against
 * brute force over every budget pair, with costs per node and with padded GPU rows). The
 * draft-or-not choice, run against simulated rounds, keeps throughput within 3 % of the better
 * kind, whichever it is, and follows a change of leader. */
#ifdef KDT_WITH_MODEL /* the engine is built with the model (jansson) */
#include "t.h"

#include "engine/budget.h"

#include <math.h>

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
    CHECK(nd > 950);
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

int main(void) {
    T_RUN(test_fit);
    T_RUN(test_extremes);
    T_RUN(test_allocation_and_bruteforce);
    T_RUN(test_depth_cap_and_calibration);
    T_RUN(test_cost_rows);
    T_RUN(test_padded_choice);
    T_RUN(test_rank_calibration);
    T_RUN(test_draft_or_not);
    return t_summary();
}
#else
#include <stdio.h>
int main(void) {
    printf("engine not built (no jansson): skipped\n");
    return 0;
}
#endif
