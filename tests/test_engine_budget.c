/* test_engine_budget.c - the auto budget controller (src/engine/budget.c): the verify-cost fit
 * recovers a measured line, the choice follows the cost (cheap nodes -> full caps, dear nodes ->
 * empty trees), gains go to the stream whose nodes are worth more, the depth cap bounds a
 * stream's expected tokens, and the choice maximises expected tokens per second (checked against
 * brute force over every budget pair). */
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
    kdt_budget_choose(&c, 1, &st, 0, 0.0, &b);
    CHECK_EQ_INT(b, 32);
    kdt_budget_init(&c, 1e-3, 1.0); /* a node costs a second */
    kdt_budget_choose(&c, 1, &st, 0, 0.0, &b);
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
    kdt_budget_choose(&c, 2, st, 3, 2.5, b);
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
    kdt_budget_choose(&c, 1, &st, 0, 0.0, &b);
    CHECK_EQ_INT(b, 3); /* past the depth cap, nodes add cost and no tokens */
    /* a drafter that delivers half of what it predicts lowers the calibration */
    for (int r = 0; r < 100; r++) kdt_budget_observe_accept(&c, 4.0, 2.0);
    CHECK_NEAR(kdt_budget_calibration(&c), 0.5, 0.05);
}

int main(void) {
    T_RUN(test_fit);
    T_RUN(test_extremes);
    T_RUN(test_allocation_and_bruteforce);
    T_RUN(test_depth_cap_and_calibration);
    return t_summary();
}
#else
#include <stdio.h>
int main(void) {
    printf("engine not built (no jansson): skipped\n");
    return 0;
}
#endif
