/* test_attn_plan.c - the GPU attention's instance plan (src/model/cuda/attn_plan.h) against the
 * shared memory of every device class the engine targets, without a GPU: H100 / H200 (227 KB per
 * block), A100 (163 KB), and the 99 KB parts (RTX PRO 6000 Blackwell sm_120, sm_86 / sm_89).
 *
 * Until session 24 the model load asked for the largest instance of a head group, so Kimi's
 * d_c 512 (whose 16-warp decode instance takes 103,360 bytes) was refused on sm_120 although the
 * 8-warp instance (99,136 bytes) runs every launch with the same bits. These checks pin the
 * layout's sizes by hand-computed values and check, over a sweep of shapes, limits and launches,
 * that the load check and the launch's warp count agree: a model the load accepts gets a count
 * that exists and fits for every launch, and a forced count is taken whenever it fits.
 */
#include "model/cuda/attn_plan.h"
#include "t.h"

#include <string.h>

enum { OPT_HOPPER = 232448, OPT_A100 = 166912, OPT_99K = 101376 };

/* Kimi K2 / DeepSeek-V3: d_c 512 + rope 64. Sizes by hand, 2 stages (qs = 576 + 8 = 584):
 * Q 16 x 584 x 2 = 18,688; ring 2 x 32 x 584 x 2 = 74,752; planes 1 / 2 / 4 x 16 x 33 x 4;
 * P 16 x 40 x 2 = 1,280; row state 3 x 16 x 4 = 192. */
static void test_sizes_by_hand(void) {
    CHECK_EQ_INT(kdt_ap_pick_nt(4, 512), 16);
    CHECK_EQ_INT(kdt_ap_pick_nt(8, 512), 8);
    CHECK_EQ_INT(kdt_ap_pick_nt(16, 512), 4);
    CHECK_EQ_INT(kdt_ap_pick_nt(16, 64), 2); /* at least 2, even */
    CHECK_EQ_INT(kdt_ap_pick_nt(8, 48), 2);
    CHECK_EQ_INT(kdt_ap_qs_stride(16, 4, 576), 584);
    CHECK_EQ_INT(kdt_ap_qs_stride(4, 16, 72), 520); /* P V columns wider than d_q */
    CHECK_EQ_INT(kdt_ap_smem(16, 4, 16, 576, 2), 18688 + 74752 + 1 * 2112 + 1280 + 192);
    CHECK_EQ_INT(kdt_ap_smem(16, 8, 8, 576, 2), 18688 + 74752 + 2 * 2112 + 1280 + 192);
    CHECK_EQ_INT(kdt_ap_smem(16, 16, 4, 576, 2), 103360);
    CHECK_EQ_INT(kdt_ap_smem(16, 16, 4, 576, 3), 103360 + 37376);
    /* 64 heads on 8 warps: two score planes (each warp one m-tile's rows, half the chains) */
    CHECK_EQ_INT(kdt_ap_planes(64, 8), 2);
    CHECK_EQ_INT(kdt_ap_planes(16, 8), 2);
    CHECK_EQ_INT(kdt_ap_planes(16, 4), 1);
    CHECK_EQ_INT(kdt_ap_planes(16, 16), 4);
    CHECK_EQ_INT(kdt_ap_smem(64, 8, 8, 576, 2), 64 * 584 * 2 + 74752 + 2 * 64 * 33 * 4 + 64 * 40 * 2 + 3 * 64 * 4 + 1024);
    CHECK(kdt_ap_smem(64, 8, 8, 576, 3) <= OPT_HOPPER); /* the 3-stage ring the H100 / H200 run */
    /* the 64-head d_q 576 instance keeps Q and the ring as wgmma slabs on sm_90a (gpu_attn.cu):
     * Q's 9 x 8 KB inside Q's row-major region, whose end (the ring's start) is 1,024-aligned, and
     * each stage's 9 x 4 KB at 36 KB steps inside the row-major ring */
    CHECK_EQ_INT(kdt_ap_slab(64, 576), 1);
    CHECK_EQ_INT(kdt_ap_slab(16, 576), 0);
    CHECK_EQ_INT(kdt_ap_slab(64, 192), 0);
    {
        const int qs = kdt_ap_qs_stride(8, 8, 576);
        CHECK(9 * 64 * 128 <= 64 * qs * 2 && (64 * qs * 2) % 1024 == 0);
        for (int st = 2; st <= 3; st++) CHECK(st * 9 * 32 * 128 <= st * 32 * qs * 2);
    }
    /* the 16-warp decode instance alone does not fit a 99 KB part; the head group does */
    CHECK(kdt_ap_smem(16, 16, 4, 576, 2) > OPT_99K);
    CHECK_EQ_INT(kdt_ap_min_smem(16, 512, 576), 97024);
    CHECK(kdt_ap_min_smem(16, 512, 576) <= OPT_99K);
    /* 64-head items need a Hopper's opt-in: an A100 (and a 99 KB part) runs 16-head items (since
     * the second score plane, session 32: 172,288 B against the A100's 166,912) */
    CHECK(kdt_ap_min_smem(64, 512, 576) > OPT_A100 && kdt_ap_min_smem(64, 512, 576) <= OPT_HOPPER);
    /* no instance: d_c past 512, d_c > d_q, d_q not a multiple of 8, other head groups */
    CHECK_EQ_INT(kdt_ap_min_smem(16, 520, 584), 0);
    CHECK_EQ_INT(kdt_ap_min_smem(16, 64, 48), 0);
    CHECK_EQ_INT(kdt_ap_min_smem(16, 64, 92), 0);
    CHECK_EQ_INT(kdt_ap_min_smem(32, 64, 96), 0);
}

/* The counts the H200 measurements were taken with stay (sessions 9-11): 16 warps for a one-row
 * decode of d_c 512, 8 otherwise, 8 for 64-head items; on a 99 KB part the decode takes 8. */
static void test_choices(void) {
    const int sms = 132;
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 104, sms, 512, 576, OPT_HOPPER, 0), 16);
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 1000, sms, 512, 576, OPT_HOPPER, 0), 8);
    CHECK_EQ_INT(kdt_ap_pick_warps(64, 100, sms, 512, 576, OPT_HOPPER, 0), 8);
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 100, sms, 64, 96, OPT_HOPPER, 0), 8); /* d_c 64: 16 warps would idle */
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 100, sms, 512, 576, OPT_HOPPER, 4), 4);
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 1000, sms, 512, 576, OPT_HOPPER, 16), 16);
    CHECK_EQ_INT(kdt_ap_pick_warps(64, 100, sms, 512, 576, OPT_HOPPER, 16), 8); /* no such instance */
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 104, 188, 512, 576, OPT_99K, 0), 8);
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 104, 188, 512, 576, OPT_99K, 16), 8); /* forced, but it does not fit */
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 104, 188, 512, 576, 98000, 0), 4);
    CHECK_EQ_INT(kdt_ap_pick_warps(16, 104, 188, 512, 576, 90000, 0), 0);
    CHECK_EQ_INT(kdt_ap_pick_warps(64, 100, 188, 512, 576, OPT_99K, 0), 0);
}

/* Over d_c, d_q, limits, launches and forced counts: the pick exists and fits, a fitting forced
 * count wins, and the load check (min_smem) accepts exactly the shapes every launch can run. */
static void test_sweep(void) {
    static const size_t limits[] = {OPT_HOPPER, OPT_A100, OPT_99K, 98000, 60000, 48 * 1024};
    static const int forced[] = {0, 4, 8, 16, 7, -1};
    static const int rope[] = {0, 8, 32, 64};
    int cases = 0, bad = 0, accepted_99k = 0;
    for (int hg = 16; hg <= 64; hg += 48)
        for (int dc = 8; dc <= 520 && bad < 5; dc += 8)
            for (int r = 0; r < 4; r++) {
                const int dq = dc + rope[r];
                const size_t need = kdt_ap_min_smem(hg, dc, dq);
                for (int l = 0; l < 6; l++)
                    for (int g = 0; g < 3; g++)
                        for (int f = 0; f < 6; f++) {
                            const long long grid = g == 0 ? 1 : (g == 1 ? 132 : 5000);
                            const int w = kdt_ap_pick_warps(hg, grid, 132, dc, dq, limits[l], forced[f]);
                            int ok = 1;
                            if (need == 0 || need > limits[l]) ok = w == 0;
                            else ok = w > 0 && kdt_ap_has_w(hg, w) && kdt_ap_pick_nt(w, dc) <= kdt_ap_max_nt(w) &&
                                      kdt_ap_smem(hg, w, kdt_ap_pick_nt(w, dc), dq, 2) <= limits[l] &&
                                      (!kdt_ap_w_fits(hg, forced[f], dc, dq, limits[l]) || w == forced[f]);
                            if (!ok && bad++ < 5)
                                CHECK_MSG(0, "hg %d d_c %d d_q %d limit %zu grid %lld forced %d: w %d (load needs %zu)",
                                          hg, dc, dq, limits[l], grid, forced[f], w, need);
                            accepted_99k += l == 2 && need > 0 && need <= limits[l];
                            cases++;
                        }
            }
    printf("  %d (heads, d_c, d_q, limit, launch, forced) cases\n", cases);
    CHECK_EQ_INT(bad, 0);
    CHECK(accepted_99k > 0);
    /* the engine's models on a 99 KB part: Kimi / DeepSeek-V3, the bundled tiny target (d_c 64,
     * rope 32), the test fixture (d_c 48, rope 16) */
    CHECK(kdt_ap_min_smem(16, 512, 576) <= OPT_99K);
    CHECK(kdt_ap_min_smem(16, 64, 96) <= OPT_99K);
    CHECK(kdt_ap_min_smem(16, 48, 64) <= OPT_99K);
}

/* The plain prefill attention (gpu_plain.cu): Q [64][dqk_p + 8], then per stage K hi / lo
 * [2][64][dqk_p + 8] and V hi / lo [2][64][dv_p + 8], bf16. At Kimi's d_n + d_r = 192, d_v = 128:
 * 2 stages (64 + 256) x 200 x 2 + 256 x 136 x 2 = 197,632; 1 stage, where Q's 64 rows reuse
 * the K tile's, 128 x 200 x 2 + 128 x 136 x 2 = 86,016. (Session 44: a helper that called itself here hung every runner that
 * asked for the plain form, on the GPU only; these sizes are now plain C, checked in CI.) */
static void test_plain_sizes(void) {
    CHECK_EQ_INT(kdt_ap_plain_smem(192, 128, 2), 197632);
    CHECK_EQ_INT(kdt_ap_plain_smem(192, 128, 1), 86016);
    CHECK_EQ_INT(kdt_ap_plain_smem(16, 16, 1), 128 * 24 * 2 + 128 * 24 * 2);
    CHECK_EQ_INT(kdt_ap_plain_smem(256, 256, 2), 320 * 264 * 2 + 256 * 264 * 2);
    /* where each fits: Kimi takes 2 stages on a Hopper, 1 on an A100 and on the 99 KB parts
     * (sm_120, sm_86 / 89) */
    CHECK(kdt_ap_plain_smem(192, 128, 2) <= OPT_HOPPER);
    CHECK(kdt_ap_plain_smem(192, 128, 2) > OPT_A100 && kdt_ap_plain_smem(192, 128, 1) <= OPT_A100);
    CHECK(kdt_ap_plain_smem(192, 128, 1) <= OPT_99K);
    /* the widest instance (d_n + d_r 256, d_v 256) needs 132 KB with one stage: not on a 99 KB part */
    CHECK(kdt_ap_plain_smem(256, 256, 1) > OPT_99K && kdt_ap_plain_smem(256, 256, 1) <= OPT_A100);
    /* shapes without an instance */
    CHECK_EQ_INT(kdt_ap_plain_smem(272, 128, 1), 0); /* Q fragments past 16 k-steps */
    CHECK_EQ_INT(kdt_ap_plain_smem(200, 128, 1), 0); /* not padded to 16 */
    CHECK_EQ_INT(kdt_ap_plain_smem(0, 128, 1), 0);
    CHECK_EQ_INT(kdt_ap_plain_smem(192, 100, 1), 0); /* d_v not padded */
    CHECK_EQ_INT(kdt_ap_plain_smem(192, 512, 1), 0);
    CHECK_EQ_INT(kdt_ap_plain_smem(192, 128, 0), 0);
    CHECK_EQ_INT(kdt_ap_plain_smem(192, 128, 3), 0);
    /* the wgmma form (2 stages): Q's padded rows, 1,023 bytes of alignment slack, then per stage
     * K hi / lo and V hi / lo as 8 KB slabs: Kimi 25,600 + 1,023 + 2 x (2 x 3 + 2 x 2) x 8,192 */
    CHECK_EQ_INT(kdt_ap_plain_wg_smem(192, 128), 25600 + 1023 + 163840);
    CHECK_EQ_INT(kdt_ap_plain_wg_smem(80, 64), 64 * 88 * 2 + 1023 + 2 * (2 * 2 + 2 * 1) * 8192);
    CHECK(kdt_ap_plain_wg_smem(192, 128) <= OPT_HOPPER);
    CHECK(kdt_ap_plain_wg_smem(256, 128) <= OPT_HOPPER); /* the widest: 231,423 */
    CHECK_EQ_INT(kdt_ap_plain_wg_smem(192, 32), 0);       /* instances for d_v 64 and 128 only */
    CHECK_EQ_INT(kdt_ap_plain_wg_smem(192, 256), 0);
    CHECK_EQ_INT(kdt_ap_plain_wg_smem(200, 128), 0);
    CHECK_EQ_INT(kdt_ap_plain_wg_smem(272, 128), 0);
    CHECK_EQ_INT(kdt_ap_plain_dv_pad(1), 16);
    CHECK_EQ_INT(kdt_ap_plain_dv_pad(128), 128);
    CHECK_EQ_INT(kdt_ap_plain_dv_pad(129), 256);
    CHECK_EQ_INT(kdt_ap_plain_dv_pad(257), 0);
}

/* The absorbed attention's partial slots and windows (gpu_forward.c's runner and stage_end).
 * Sizes by hand for a Kimi prefill runner, then a fuzz over random rows, split counts and caps:
 * the windows cover the rows in order, none is empty or past cap, each is greedy (its next row
 * would not fit), the split offsets restart at 0 and count up, and the count never passes
 * kdt_ap_max_windows (the runner's staging holds that many headers). Refusals write nothing. */
static void test_windows(void) {
    /* Kimi: 2,048 rows x 64 splits, 64 device-staged rows, 512 MiB of 64 x 514 x 4-byte slots */
    const long long budget = 512LL * 1024 * 1024 / (64 * 514 * 4);
    CHECK_EQ_INT((int)budget, 4080);
    CHECK_EQ_INT((int)kdt_ap_partial_slots(2048, 64, 64, budget), 4096); /* 64 rows x 64 in one launch */
    CHECK_EQ_INT((int)kdt_ap_max_windows(2048, 64, 4096), 33);            /* 1 + 131,072 / 4,033 */
    CHECK_EQ_INT((int)kdt_ap_partial_slots(64, 8, 64, budget), 512);    /* small runners: every row */
    CHECK_EQ_INT((int)kdt_ap_max_windows(64, 8, 512), 1);
    CHECK_EQ_INT((int)kdt_ap_max_windows(64, 8, 8), 64); /* cap = one row: at most a window per row */
    int ns[8] = {3, 3, 2, 4, 1, 1, 1, 4}, row[9], sp[8];
    CHECK_EQ_INT(kdt_ap_cut_windows(ns, 8, 6, 8, row, sp), 4); /* {3 3} {2 4} {1 1 1} {4} */
    CHECK(row[0] == 0 && row[1] == 2 && row[2] == 4 && row[3] == 7 && row[4] == 8);
    CHECK(sp[0] == 6 && sp[1] == 6 && sp[2] == 3 && sp[3] == 4);
    CHECK(ns[0] == 0 && ns[1] == 3 && ns[2] == 0 && ns[3] == 2 && ns[4] == 0 && ns[5] == 1 && ns[6] == 2 && ns[7] == 0);
    int bad[3] = {2, 7, 1}, keep[3] = {2, 7, 1};
    row[0] = -5;
    CHECK_EQ_INT(kdt_ap_cut_windows(bad, 3, 6, 8, row, sp), -1); /* a row past cap */
    CHECK(!memcmp(bad, keep, sizeof bad) && row[0] == -5);
    int many[4] = {5, 5, 5, 5};
    CHECK_EQ_INT(kdt_ap_cut_windows(many, 4, 6, 3, row, sp), -2); /* 4 windows, 3 headers */
    CHECK(many[1] == 5 && row[0] == -5);
    CHECK_EQ_INT(kdt_ap_cut_windows(many, 0, 6, 1, row, sp), 1); /* no rows: one empty window */
    CHECK(row[0] == 0 && row[1] == 0 && sp[0] == 0);

    uint64_t rng = t_fuzz_seed(50);
    int *v = xmalloc(600 * sizeof(int)), *off = xmalloc(600 * sizeof(int));
    int *wr = xmalloc(602 * sizeof(int)), *ws = xmalloc(601 * sizeof(int));
    const int iters = t_fuzz_iters(3000);
    for (int it = 0; it < iters; it++) {
        const int rows = 1 + t_rand_int(&rng, 600), rs = 1 + t_rand_int(&rng, 64);
        const long long cap = rs + t_rand_int(&rng, 4 * rs + 2);
        const long long mw = kdt_ap_max_windows(rows, rs, cap);
        for (int i = 0; i < rows; i++) /* mostly the worst case, as a long prefix gives */
            v[i] = off[i] = t_rand_int(&rng, 4) ? rs : 1 + t_rand_int(&rng, rs);
        const int w = kdt_ap_cut_windows(off, rows, cap, (int)mw, wr, ws);
        if (w < 1 || w > mw) {
            CHECK_MSG(0, "rows %d, row splits %d, cap %lld: %d windows, bound %lld", rows, rs, cap, w, mw);
            break;
        }
        int ok = wr[0] == 0 && wr[w] == rows;
        for (int k = 0; k < w && ok; k++) {
            long long sum = 0;
            ok = wr[k + 1] > wr[k];
            for (int i = wr[k]; i < wr[k + 1] && ok; i++) {
                ok = off[i] == sum;
                sum += v[i];
            }
            ok = ok && sum == ws[k] && sum <= cap && (k + 1 == w || sum + v[wr[k + 1]] > cap);
        }
        if (!ok) {
            CHECK_MSG(0, "rows %d, row splits %d, cap %lld: a window is wrong", rows, rs, cap);
            break;
        }
    }
    free(v);
    free(off);
    free(wr);
    free(ws);
}

int main(void) {
    T_RUN(test_windows);
    T_RUN(test_sizes_by_hand);
    T_RUN(test_plain_sizes);
    T_RUN(test_choices);
    T_RUN(test_sweep);
    return t_summary();
}
