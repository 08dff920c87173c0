/* test_engine.c - the engine's lossless proof and bad-input tests (CPU, tiny model).
 *
 * Greedy output of chain, ddtree (budgets 1, 4, 16, 64) and auto equals plain greedy decoding of
 * the target token for token, at batch sizes 1, 3 and 8, with mixed modes in one batch and with
 * streams joining mid-run. Drafts come from the TEST-ONLY oracle drafter (engine_test_util.h):
 * the target's own greedy continuation with seeded corruption, so acceptance is high but partial
 * (deep paths, accepted side branches, rejections and commits all happen). The reference is the
 * model API alone (prefill + decode), independent of the engine. Prefill chunks of 1, 5 and 4,096
 * rows give the same output.
 * Target: tests/fixtures/models/kimi_tiny (MLA + MoE + YaRN, 320-token vocabulary).
 */
#ifdef KDT_WITH_MODEL /* the engine is built with the model (jansson) */
#include "engine_test_util.h"

#define N_PROMPTS 8
#define DEPTH 7

static int32_t *g_prompts[N_PROMPTS];
static int32_t g_n_prompt[N_PROMPTS];
static int32_t g_new[N_PROMPTS];
static int32_t *g_ref[N_PROMPTS];
static et_oracle g_oracle;
static int g_have_fixture;

static void setup(void) {
    static const int32_t lens[N_PROMPTS] = {1, 3, 5, 9, 17, 23, 33, 40};
    uint64_t rng = 99;
    for (int i = 0; i < N_PROMPTS; i++) {
        g_n_prompt[i] = lens[i];
        g_new[i] = 18 + (i % 3) * 3;
        g_prompts[i] = malloc(sizeof(int32_t) * (size_t)lens[i]);
        for (int j = 0; j < lens[i]; j++) g_prompts[i][j] = t_rand_int(&rng, 300);
        g_ref[i] = malloc(sizeof(int32_t) * (size_t)g_new[i]);
        kdt_status st = et_greedy_reference(ET_FIXTURE, g_prompts[i], lens[i], g_new[i], g_ref[i]);
        if (st != KDT_OK) {
            fprintf(stderr, "reference failed: %s\n", kdt_last_error());
            exit(1);
        }
    }
    if (et_oracle_init(&g_oracle, ET_FIXTURE, 7, 0.7, 0.2) != 0) {
        fprintf(stderr, "oracle init failed: %s\n", kdt_last_error());
        exit(1);
    }
}

static int32_t g_prefill_chunk;      /* the engines' prefill_chunk (0: the default) */
static int32_t g_max_prefill_tokens; /* and max_prefill_tokens (0: no limit) */
static int32_t g_prefill_attention;  /* and prefill_attention (0: absorbed) */

static kdt_engine *make_engine(int32_t max_streams, int32_t max_context) {
    kdt_engine_options o;
    memset(&o, 0, sizeof o);
    o.device = KDT_DEVICE_CPU; /* the reference is the CPU model */
    o.prefill_chunk = g_prefill_chunk;
    o.max_prefill_tokens = g_max_prefill_tokens;
    o.prefill_attention = g_prefill_attention;
    o.model_dir = ET_FIXTURE;
    o.max_streams = max_streams;
    o.max_budget = 64;
    o.max_context = max_context;
    kdt_engine *e = NULL;
    kdt_status st = kdt_engine_create(&o, &e);
    CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
    if (st != KDT_OK) return NULL;
    st = kdt_engine_set_test_drafter(e, DEPTH, et_oracle_draft, &g_oracle);
    CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
    return e;
}

/* Runs prompts [0, batch) with the given mode and budget; checks equality with the reference. */
static void run_and_compare(kdt_engine *e, int32_t batch, kdt_spec_mode spec, int32_t budget,
                            double *tau_mean, int64_t *tau_max) {
    kdt_gen_params p[N_PROMPTS];
    for (int i = 0; i < batch; i++) {
        kdt_gen_params_default(&p[i]);
        p[i].spec = spec;
        p[i].budget = budget;
        p[i].max_new_tokens = g_new[i];
    }
    et_run r;
    kdt_status st = et_run_batch(e, batch, g_prompts, g_n_prompt, p, &r);
    CHECK_MSG(st == KDT_OK, "%s %d batch %d: %s", kdt_spec_mode_name(spec), budget, batch, kdt_last_error());
    if (st == KDT_OK) {
        char what[64];
        snprintf(what, sizeof what, "%s budget %d batch %d", kdt_spec_mode_name(spec), budget, batch);
        et_check_outputs(&r, g_new, g_ref, what);
        for (int i = 0; i < batch; i++) CHECK_EQ_INT(r.finish[i], KDT_FINISH_LENGTH);
    }
    if (tau_mean) *tau_mean = r.events_with_tau ? (double)r.tau_sum / (double)r.events_with_tau : 0.0;
    if (tau_max) *tau_max = r.tau_max;
    et_run_free(&r);
}

static void test_lossless_greedy(void) {
    kdt_engine *e = make_engine(8, 0);
    if (!e) return;
    static const int32_t batches[3] = {1, 3, 8};
    static const int32_t budgets[4] = {1, 4, 16, 64};
    for (int b = 0; b < 3; b++) {
        double tm = 0;
        int64_t tx = 0;
        run_and_compare(e, batches[b], KDT_SPEC_AR, 1, &tm, &tx);
        CHECK_MSG(tx == 1, "ar tau max %lld", (long long)tx);
        run_and_compare(e, batches[b], KDT_SPEC_CHAIN, 1, &tm, &tx);
        printf("  chain     batch %d: tau mean %.2f max %lld\n", batches[b], tm, (long long)tx);
        CHECK(tx >= 4);  /* deep paths are accepted */
        for (int k = 0; k < 4; k++) {
            run_and_compare(e, batches[b], KDT_SPEC_DDTREE, budgets[k], &tm, &tx);
            printf("  ddtree %2d batch %d: tau mean %.2f max %lld\n", budgets[k], batches[b], tm, (long long)tx);
            if (budgets[k] >= 4) CHECK(tx >= 3);
            CHECK(tm < DEPTH + 1); /* partial: rejections happen */
        }
        kdt_engine_stats s0, s1;
        kdt_engine_get_stats(e, &s0);
        run_and_compare(e, batches[b], KDT_SPEC_AUTO, 64, &tm, &tx);
        kdt_engine_get_stats(e, &s1);
        printf("  auto      batch %d: tau mean %.2f max %lld, %llu of %llu rounds plain\n", batches[b], tm,
               (long long)tx, (unsigned long long)(s1.plain_rounds - s0.plain_rounds),
               (unsigned long long)(s1.rounds - s0.rounds));
        /* each new batch size starts with 2 plain rounds, then at least one drafted (budget.c) */
        CHECK(s1.plain_rounds > s0.plain_rounds);
        CHECK(s1.rounds - s1.plain_rounds > s0.rounds - s0.plain_rounds);
        /* the same with drafted and plain rounds forced to alternate (D, P, D, ...): deep trees
         * right after plain rounds (verify rows priced near zero, so that auto takes its whole
         * cap whatever this machine's timing says) */
        kdt_budget_test_kinds(&e->budget, 0x5u, 3);
        kdt_budget_test_verify_line(&e->budget, 1e-3, 1e-9);
        run_and_compare(e, batches[b], KDT_SPEC_AUTO, 64, &tm, &tx);
        kdt_budget_test_kinds(&e->budget, 0, 0);
        kdt_budget_test_verify_line(&e->budget, 0, 0);
        CHECK(tx >= 3);
    }
    kdt_engine_stats s;
    kdt_engine_get_stats(e, &s);
    CHECK(s.rounds > 0 && s.tokens_emitted > 0);
    CHECK_EQ_INT(s.active_streams, 0);
    CHECK_EQ_INT(s.kv_pages_used, 0);  /* every finished stream returned its pages */
    kdt_engine_free(e);
}

/* The prompt's prefill in chunks of 1, 5 and 4,096 rows (the reference's model prefills in 64):
 * the absorbed form's bits do not depend on the chunk, so every mode still equals the reference. */
static void test_prefill_chunk(void) {
    static const int32_t chunks[3] = {1, 5, KDT_MAX_PREFILL_CHUNK};
    /* the CPU's default for the absorbed form (these engines' form): the model's 64 rows */
    kdt_engine *d = make_engine(2, 0);
    if (d) CHECK_EQ_INT(kdt_engine_prefill_chunk(d), KDT_DEFAULT_PREFILL_CHUNK);
    kdt_engine_free(d);
    CHECK_EQ_INT(kdt_engine_prefill_chunk(NULL), 0);
    for (int c = 0; c < 3; c++) {
        g_prefill_chunk = chunks[c];
        kdt_engine *e = make_engine(8, 0);
        g_prefill_chunk = 0;
        if (!e) return;
        CHECK_EQ_INT(kdt_engine_prefill_chunk(e), chunks[c]); /* a given chunk is used as given */
        kdt_engine_stats s0, s1;
        kdt_engine_get_stats(e, &s0);
        run_and_compare(e, 8, KDT_SPEC_AR, 1, NULL, NULL);
        kdt_engine_get_stats(e, &s1);
        /* the 8 prompts (131 tokens) arrive together: passes of 1 row hold one token each; passes
         * of 4,096 rows hold them all */
        if (c != 1) CHECK_EQ_INT((int)(s1.prefill_passes - s0.prefill_passes), c == 0 ? 131 : 1);
        CHECK_EQ_INT((int)(s1.prompt_tokens - s0.prompt_tokens), 131);
        run_and_compare(e, 8, KDT_SPEC_DDTREE, 16, NULL, NULL);
        run_and_compare(e, 3, KDT_SPEC_CHAIN, 1, NULL, NULL);
        kdt_engine_free(e);
    }
}

/* A step's prefill budget (max_prefill_tokens): prompts go in whole chunks, at least one a step.
 * 1. Budget 5 with 4-row chunks (one chunk a step): every mode still equals the reference.
 * 2. Interleaving: stream A (3-token prompt) decodes; B (40 tokens) is added. B's prefill takes
 *    ten steps of 4 tokens, B reports nothing until the tenth, and A emits tokens in every one of
 *    them (its round runs each step). Both then equal their references.
 * 3. A budget below one chunk still makes progress (one chunk a step). */
static void test_prefill_budget(void) {
    g_prefill_chunk = 4;
    g_max_prefill_tokens = 5;
    kdt_engine *e = make_engine(8, 0);
    g_prefill_chunk = g_max_prefill_tokens = 0;
    if (!e) return;
    run_and_compare(e, 8, KDT_SPEC_AR, 1, NULL, NULL);
    run_and_compare(e, 8, KDT_SPEC_DDTREE, 16, NULL, NULL);
    run_and_compare(e, 8, KDT_SPEC_AUTO, 64, NULL, NULL);

    kdt_gen_params pa, pb;
    kdt_gen_params_default(&pa);
    pa.spec = KDT_SPEC_AR; /* one token a round: A's count says how many rounds ran */
    pa.max_new_tokens = g_new[1];
    pb = pa;
    pb.spec = KDT_SPEC_DDTREE;
    pb.max_new_tokens = g_new[7];
    int32_t ida = -1, idb = -1, outa[64], outb[64], na = 0, nb = 0, b_first_step = -1, a_during = 0;
    CHECK(g_n_prompt[1] == 3 && g_n_prompt[7] == 40);
    CHECK_EQ_INT(kdt_engine_add(e, g_prompts[1], g_n_prompt[1], &pa, &ida), KDT_OK);
    kdt_stream_event ev[8];
    int32_t n_ev = 0;
    CHECK_EQ_INT(kdt_engine_step(e, ev, 8, &n_ev), KDT_OK); /* A's prefill (3 rows) and first token */
    CHECK(n_ev == 1 && ev[0].stream_id == ida && ev[0].n_tokens == 1);
    if (n_ev == 1) outa[na++] = ev[0].tokens[0];
    CHECK_EQ_INT(kdt_engine_add(e, g_prompts[7], g_n_prompt[7], &pb, &idb), KDT_OK);
    for (int step = 1; kdt_engine_busy(e) && step < 200; step++) {
        CHECK_EQ_INT(kdt_engine_step(e, ev, 8, &n_ev), KDT_OK);
        int a_here = 0;
        for (int32_t k = 0; k < n_ev; k++) {
            const int is_a = ev[k].stream_id == ida;
            int32_t *out = is_a ? outa : outb, *n = is_a ? &na : &nb;
            for (int32_t j = 0; j < ev[k].n_tokens && *n < 64; j++) out[(*n)++] = ev[k].tokens[j];
            if (is_a) a_here = ev[k].n_tokens > 0;
            else if (b_first_step < 0) b_first_step = step;
        }
        if (b_first_step < 0) a_during += a_here;
    }
    CHECK_MSG(b_first_step == 10, "B's first token at step %d, expected 10 (40 tokens, 4 a step)", b_first_step);
    CHECK_MSG(a_during >= 9, "A emitted in %d of the 9 steps B spent prefilling", a_during);
    CHECK_EQ_INT(na, g_new[1]);
    CHECK_EQ_INT(nb, g_new[7]);
    CHECK(memcmp(outa, g_ref[1], sizeof(int32_t) * (size_t)g_new[1]) == 0);
    CHECK(memcmp(outb, g_ref[7], sizeof(int32_t) * (size_t)g_new[7]) == 0);
    kdt_engine_stats s;
    kdt_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_pages_used, 0);
    kdt_engine_free(e);

    g_prefill_chunk = 8;
    g_max_prefill_tokens = 1; /* below one chunk: one chunk a step */
    e = make_engine(8, 0);
    g_prefill_chunk = g_max_prefill_tokens = 0;
    if (!e) return;
    run_and_compare(e, 8, KDT_SPEC_CHAIN, 1, NULL, NULL);
    kdt_engine_free(e);
}

/* The GPU's shared prefill passes (kdt_prefill_place): first-fit in arrival order, a stream's
 * chunks in later and later passes, no pass over its rows; then random plans against those rules
 * and against a brute-force first fit. */
static void test_prefill_place(void) {
    {   /* eight 64-row first chunks at 512 rows a pass: one pass */
        int32_t st[8], rows[8], pass[8], pr[8];
        for (int i = 0; i < 8; i++) st[i] = i, rows[i] = 64;
        CHECK_EQ_INT(kdt_prefill_place(512, 8, st, rows, pass, pr), 1);
        CHECK_EQ_INT(pr[0], 512);
    }
    {   /* A: 3 chunks (256, 256, 40), B: 100, C: 200, D: 256 at 256 rows a pass:
         * A0 -> 0; A1 -> 1; A2 -> 2; B -> 2 (140); C -> 3 (0: 256, 1: 256, 2: 140 + 200 > 256);
         * D -> 4 */
        const int32_t st[6] = {0, 0, 0, 1, 2, 3}, rows[6] = {256, 256, 40, 100, 200, 256};
        const int32_t want[6] = {0, 1, 2, 2, 3, 4};
        int32_t pass[6], pr[6];
        CHECK_EQ_INT(kdt_prefill_place(256, 6, st, rows, pass, pr), 5);
        CHECK(!memcmp(pass, want, sizeof want));
    }
    uint64_t rng = 4242;
    for (int t = 0; t < 500; t++) {
        const int32_t cap = 1 + t_rand_int(&rng, 64);
        int32_t st[200], rows[200], pass[200], pr[200], n = 0;
        const int32_t streams = 1 + t_rand_int(&rng, 12);
        for (int32_t s = 0; s < streams; s++) {
            const int32_t chunks = 1 + t_rand_int(&rng, 4);
            for (int32_t c = 0; c < chunks && n < 200; c++, n++) {
                st[n] = s;
                rows[n] = c + 1 < chunks ? cap : 1 + t_rand_int(&rng, cap); /* only a last chunk is short */
            }
        }
        const int32_t np = kdt_prefill_place(cap, n, st, rows, pass, pr);
        int32_t used[200] = {0};
        int bad = 0;
        for (int32_t c = 0; c < n; c++) {
            bad |= pass[c] < 0 || pass[c] >= np;
            if (bad) break;
            used[pass[c]] += rows[c];
            if (c > 0 && st[c - 1] == st[c]) bad |= pass[c] <= pass[c - 1];
            /* first fit: every earlier allowed pass was too full when this chunk came */
            int32_t fill[200] = {0};
            for (int32_t d = 0; d < c; d++) fill[pass[d]] += rows[d];
            const int32_t lo = c > 0 && st[c - 1] == st[c] ? pass[c - 1] + 1 : 0;
            for (int32_t p = lo; p < pass[c]; p++) bad |= fill[p] + rows[c] <= cap;
        }
        for (int32_t p = 0; p < np && !bad; p++) bad |= used[p] != pr[p] || used[p] > cap || used[p] == 0;
        CHECK_MSG(!bad, "plan %d (cap %d, %d chunks): a rule broken", t, cap, n);
        if (bad) break;
    }
}

/* Shared prefill passes in the plain and auto forms (the first chunks plain, later short chunks
 * absorbed; 8-row chunks, with and without a 24-token step budget): every prompt decoded alone
 * gives what it gave beside the seven others, whose chunks shared its passes. */
static void test_shared_passes_forms(void) {
    static const int32_t forms[2] = {KDT_PREFILL_AUTO, KDT_PREFILL_PLAIN}, budgets[2] = {0, 24};
    for (int f = 0; f < 2; f++)
        for (int b = 0; b < 2; b++) {
            g_prefill_attention = forms[f];
            g_prefill_chunk = 8;
            g_max_prefill_tokens = budgets[b];
            kdt_engine *e = make_engine(8, 0);
            g_prefill_attention = g_prefill_chunk = g_max_prefill_tokens = 0;
            if (!e) return;
            kdt_gen_params p[N_PROMPTS];
            for (int i = 0; i < N_PROMPTS; i++) {
                kdt_gen_params_default(&p[i]);
                p[i].spec = KDT_SPEC_DDTREE;
                p[i].budget = 8;
                p[i].max_new_tokens = g_new[i];
            }
            kdt_engine_stats s0, s1;
            kdt_engine_get_stats(e, &s0);
            et_run all;
            CHECK_EQ_INT(et_run_batch(e, N_PROMPTS, g_prompts, g_n_prompt, p, &all), KDT_OK);
            kdt_engine_get_stats(e, &s1);
            for (int i = 0; i < N_PROMPTS; i++) {
                et_run one;
                CHECK_EQ_INT(et_run_batch(e, 1, &g_prompts[i], &g_n_prompt[i], &p[i], &one), KDT_OK);
                CHECK_MSG(one.n_out[0] == all.n_out[i] &&
                              !memcmp(one.out[0], all.out[i], sizeof(int32_t) * (size_t)one.n_out[0]),
                          "form %d, budget %d: prompt %d alone differs from the batch", forms[f], budgets[b], i);
                et_run_free(&one);
            }
            /* the 8 prompts (1 .. 40 tokens) are 21 chunks of at most 8 rows: fewer passes once
             * prompts share them */
            const unsigned long long passes = (unsigned long long)(s1.prefill_passes - s0.prefill_passes);
            CHECK_MSG(passes < 21, "form %d, budget %d: %llu passes for 21 chunks", forms[f], budgets[b], passes);
            printf("  form %d, budget %d: 21 chunks in %llu passes; each prompt alone == in the batch\n", forms[f],
                   budgets[b], passes);
            et_run_free(&all);
            kdt_engine_free(e);
        }
}

/* 8 streams, each with its own mode / budget, half of them joining while others run. */
static void test_mixed_batch_and_joins(void) {
    kdt_engine *e = make_engine(8, 0);
    if (!e) return;
    static const kdt_spec_mode modes[N_PROMPTS] = {KDT_SPEC_AR, KDT_SPEC_CHAIN, KDT_SPEC_DDTREE, KDT_SPEC_DDTREE,
                                                   KDT_SPEC_DDTREE, KDT_SPEC_DDTREE, KDT_SPEC_AUTO, KDT_SPEC_CHAIN};
    static const int32_t budgets[N_PROMPTS] = {1, 1, 1, 4, 16, 64, 32, 1};
    int32_t ids[N_PROMPTS], n_out[N_PROMPTS] = {0}, out[N_PROMPTS][64];
    int added = 0, steps = 0;
    kdt_stream_event ev[8];
    while (added < N_PROMPTS || kdt_engine_busy(e)) {
        /* streams 0..3 start at once, the rest one per step */
        while (added < N_PROMPTS && (added < 4 || steps >= 2 * (added - 3))) {
            kdt_gen_params p;
            kdt_gen_params_default(&p);
            p.spec = modes[added];
            p.budget = budgets[added];
            p.max_new_tokens = g_new[added];
            kdt_status st = kdt_engine_add(e, g_prompts[added], g_n_prompt[added], &p, &ids[added]);
            CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
            added++;
            if (added >= 4) break;
        }
        int32_t n_ev = 0;
        kdt_status st = kdt_engine_step(e, ev, 8, &n_ev);
        CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
        if (st != KDT_OK) break;
        steps++;
        for (int k = 0; k < n_ev; k++)
            for (int i = 0; i < added; i++)
                if (ids[i] == ev[k].stream_id)
                    for (int j = 0; j < ev[k].n_tokens && n_out[i] < 64; j++) out[i][n_out[i]++] = ev[k].tokens[j];
        if (steps > 2000) break;
    }
    for (int i = 0; i < N_PROMPTS; i++) {
        CHECK_EQ_INT(n_out[i], g_new[i]);
        for (int j = 0; j < g_new[i] && j < n_out[i]; j++)
            if (out[i][j] != g_ref[i][j]) {
                CHECK_MSG(0, "stream %d (%s %d): token %d differs", i, kdt_spec_mode_name(modes[i]), budgets[i], j);
                break;
            }
    }
    kdt_engine_free(e);
}

/* A stop token inside an accepted path truncates there; the rest of the path is dropped. */
static void test_stop_and_length(void) {
    kdt_engine *e = make_engine(4, 0);
    if (!e) return;
    for (int i = 0; i < 4; i++) {
        /* stop at the token the reference emits at index 5 + i (first occurrence) */
        int32_t stop = g_ref[i][5 + i];
        int first = 0;
        while (g_ref[i][first] != stop) first++;
        for (int mode = 0; mode < 3; mode++) {
            kdt_gen_params p;
            kdt_gen_params_default(&p);
            p.spec = mode == 0 ? KDT_SPEC_AR : mode == 1 ? KDT_SPEC_CHAIN : KDT_SPEC_DDTREE;
            p.budget = 16;
            p.max_new_tokens = g_new[i];
            p.stop_ids = &stop;
            p.n_stop = 1;
            et_run r;
            kdt_status st = et_run_batch(e, 1, &g_prompts[i], &g_n_prompt[i], &p, &r);
            CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
            CHECK_EQ_INT(r.n_out[0], first + 1);
            CHECK_EQ_INT(r.finish[0], KDT_FINISH_STOP);
            for (int j = 0; j <= first && j < r.n_out[0]; j++) CHECK_EQ_INT(r.out[0][j], g_ref[i][j]);
            et_run_free(&r);
        }
        /* max_new_tokens exact, even when a round accepts more */
        for (int32_t n_new = 1; n_new <= 4; n_new++) {
            kdt_gen_params p;
            kdt_gen_params_default(&p);
            p.spec = KDT_SPEC_DDTREE;
            p.budget = 16;
            p.max_new_tokens = n_new;
            et_run r;
            kdt_status st = et_run_batch(e, 1, &g_prompts[i], &g_n_prompt[i], &p, &r);
            CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
            CHECK_EQ_INT(r.n_out[0], n_new);
            CHECK_EQ_INT(r.finish[0], KDT_FINISH_LENGTH);
            for (int j = 0; j < n_new && j < r.n_out[0]; j++) CHECK_EQ_INT(r.out[0][j], g_ref[i][j]);
            et_run_free(&r);
        }
    }
    kdt_engine_free(e);
}

static void test_cancel(void) {
    kdt_engine *e = make_engine(2, 0);
    if (!e) return;
    kdt_gen_params p;
    kdt_gen_params_default(&p);
    p.max_new_tokens = 20;
    int32_t a = -1, b = -1, c = -1;
    CHECK(kdt_engine_add(e, g_prompts[4], g_n_prompt[4], &p, &a) == KDT_OK);
    CHECK(kdt_engine_add(e, g_prompts[5], g_n_prompt[5], &p, &b) == KDT_OK);
    CHECK(kdt_engine_add(e, g_prompts[6], g_n_prompt[6], &p, &c) == KDT_ERR_CAPACITY); /* 2 slots */
    kdt_stream_event ev[2];
    int32_t n_ev = 0;
    CHECK(kdt_engine_step(e, ev, 2, &n_ev) == KDT_OK);
    CHECK_EQ_INT(n_ev, 2);
    CHECK(kdt_engine_step(e, ev, 2, &n_ev) == KDT_OK);
    CHECK(kdt_engine_cancel(e, a) == KDT_OK);
    CHECK(kdt_engine_cancel(e, 12345) == KDT_ERR_INVALID_ARG);
    int saw_cancel = 0, b_tokens = 0;
    while (kdt_engine_busy(e)) {
        CHECK(kdt_engine_step(e, ev, 2, &n_ev) == KDT_OK);
        for (int k = 0; k < n_ev; k++) {
            if (ev[k].stream_id == a) {
                CHECK_EQ_INT(ev[k].finish, KDT_FINISH_CANCELLED);
                CHECK_EQ_INT(ev[k].n_tokens, 0);
                saw_cancel = 1;
            }
            if (ev[k].stream_id == b) b_tokens += ev[k].n_tokens;
        }
    }
    CHECK(saw_cancel);
    CHECK(b_tokens > 0);
    kdt_engine_stats s;
    kdt_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_pages_used, 0);
    kdt_engine_free(e);
}

/* A device that failed for good (kdt_engine_fault; on the GPU found by probing the context after
 * a failed step, which no CPU test can provoke, so the state is planted): the next step ends
 * every stream with an error event, frees their KV pages and fails with KDT_ERR_CUDA naming the
 * fault; adds fail the same way and nothing is queued. */
static void test_device_fault(void) {
    kdt_engine *e = make_engine(2, 0);
    if (!e) return;
    kdt_gen_params p;
    kdt_gen_params_default(&p);
    p.max_new_tokens = 20;
    int32_t a = -1, b = -1;
    CHECK(kdt_engine_fault(e) == NULL);
    CHECK(kdt_engine_add(e, g_prompts[4], g_n_prompt[4], &p, &a) == KDT_OK);
    CHECK(kdt_engine_add(e, g_prompts[5], g_n_prompt[5], &p, &b) == KDT_OK);
    kdt_stream_event ev[2];
    int32_t n_ev = 0;
    CHECK(kdt_engine_step(e, ev, 2, &n_ev) == KDT_OK);
    CHECK(kdt_engine_cancel(e, b) == KDT_OK); /* b's CANCELLED event is still due */
    snprintf(e->fault, sizeof e->fault, "the CUDA device failed (planted by the test)");
    CHECK(kdt_engine_fault(e) != NULL);
    CHECK(kdt_engine_step(e, ev, 2, &n_ev) == KDT_ERR_CUDA);
    CHECK(strstr(kdt_last_error(), "planted by the test") != NULL);
    CHECK_EQ_INT(n_ev, 2);
    for (int k = 0; k < n_ev; k++)
        CHECK_EQ_INT(ev[k].finish, ev[k].stream_id == a ? KDT_FINISH_ERROR : KDT_FINISH_CANCELLED);
    CHECK(!kdt_engine_busy(e));
    kdt_engine_stats s;
    kdt_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_pages_used, 0);
    int32_t c = -1;
    CHECK(kdt_engine_add(e, g_prompts[6], g_n_prompt[6], &p, &c) == KDT_ERR_CUDA);
    CHECK(strstr(kdt_last_error(), "planted by the test") != NULL);
    CHECK(!kdt_engine_busy(e));
    CHECK(kdt_engine_step(e, ev, 2, &n_ev) == KDT_ERR_CUDA);
    CHECK_EQ_INT(n_ev, 0);
    kdt_engine_free(e);
}

static void test_bad_input(void) {
    kdt_engine *e = make_engine(2, 64);
    if (!e) return;
    kdt_gen_params p;
    kdt_gen_params_default(&p);
    p.max_new_tokens = 8;
    int32_t id = -1, bad[3] = {1, 320, 2}, neg[2] = {-1, 4}, ok[3] = {1, 2, 3};
    CHECK(kdt_engine_add(e, bad, 3, &p, &id) == KDT_ERR_INVALID_ARG);
    CHECK_MSG(strstr(kdt_last_error(), "320") != NULL, "%s", kdt_last_error());
    CHECK(kdt_engine_add(e, neg, 2, &p, &id) == KDT_ERR_INVALID_ARG);
    CHECK(kdt_engine_add(e, ok, 0, &p, &id) == KDT_ERR_INVALID_ARG);
    CHECK(kdt_engine_add(e, NULL, 3, &p, &id) == KDT_ERR_INVALID_ARG);
    kdt_gen_params q = p;
    q.budget = 65;
    CHECK(kdt_engine_add(e, ok, 3, &q, &id) == KDT_ERR_INVALID_ARG);
    q = p;
    q.top_p = 0.0f;
    CHECK(kdt_engine_add(e, ok, 3, &q, &id) == KDT_ERR_INVALID_ARG);
    q = p;
    q.temperature = -1.0f;
    CHECK(kdt_engine_add(e, ok, 3, &q, &id) == KDT_ERR_INVALID_ARG);
    q = p;
    q.max_new_tokens = 0;
    CHECK(kdt_engine_add(e, ok, 3, &q, &id) == KDT_ERR_INVALID_ARG);
    int32_t stop_bad = 999;
    q = p;
    q.stop_ids = &stop_bad;
    q.n_stop = 1;
    CHECK(kdt_engine_add(e, ok, 3, &q, &id) == KDT_ERR_INVALID_ARG);
    /* prompt + max_new_tokens over the 64-token context: capacity, nothing changed */
    int32_t longp[60];
    for (int i = 0; i < 60; i++) longp[i] = i;
    kdt_engine_stats before, after;
    kdt_engine_get_stats(e, &before);
    CHECK(kdt_engine_add(e, longp, 60, &p, &id) == KDT_ERR_CAPACITY);
    CHECK_MSG(strstr(kdt_last_error(), "context") != NULL, "%s", kdt_last_error());
    int32_t huge[65];
    for (int i = 0; i < 65; i++) huge[i] = i;
    CHECK(kdt_engine_add(e, huge, 65, &p, &id) == KDT_ERR_CAPACITY);
    kdt_engine_get_stats(e, &after);
    CHECK(!kdt_engine_busy(e));
    CHECK_EQ_INT(after.waiting_streams, 0);
    CHECK_EQ_INT(after.kv_pages_used, before.kv_pages_used);
    /* and the engine still works */
    CHECK(kdt_engine_add(e, longp, 56, &p, &id) == KDT_OK);
    kdt_stream_event ev[2];
    int32_t n_ev;
    CHECK(kdt_engine_step(e, ev, 1, &n_ev) == KDT_OK);
    CHECK(kdt_engine_step(e, ev, 0, &n_ev) == KDT_ERR_INVALID_ARG); /* too few event slots */
    kdt_engine_free(e);

    /* no drafter: only ar */
    kdt_engine_options o;
    memset(&o, 0, sizeof o);
    o.device = KDT_DEVICE_CPU; /* the reference is the CPU model */
    o.model_dir = ET_FIXTURE;
    CHECK(kdt_engine_create(&o, &e) == KDT_OK);
    CHECK(kdt_engine_add(e, ok, 3, &p, &id) == KDT_ERR_INVALID_ARG);
    CHECK_MSG(strstr(kdt_last_error(), "drafter") != NULL, "%s", kdt_last_error());
    kdt_engine_free(e);
    o.max_streams = 65;
    CHECK(kdt_engine_create(&o, &e) == KDT_ERR_INVALID_ARG);
    o.max_streams = 0;
    static const int32_t bad_chunks[2] = {-1, KDT_MAX_PREFILL_CHUNK + 1};
    for (int i = 0; i < 2; i++) {
        o.prefill_chunk = bad_chunks[i];
        CHECK(kdt_engine_create(&o, &e) == KDT_ERR_INVALID_ARG && e == NULL);
        CHECK_MSG(strstr(kdt_last_error(), "prefill_chunk") != NULL, "%s", kdt_last_error());
    }
    o.prefill_chunk = 0;
    o.max_prefill_tokens = -1;
    CHECK(kdt_engine_create(&o, &e) == KDT_ERR_INVALID_ARG && e == NULL);
    CHECK_MSG(strstr(kdt_last_error(), "max_prefill_tokens") != NULL, "%s", kdt_last_error());
    o.max_prefill_tokens = 0;
    o.model_dir = "/nonexistent/model";
    CHECK(kdt_engine_create(&o, &e) != KDT_OK);
    CHECK(e == NULL);
}

/* A random schedule against the greedy reference (et_random_ops, engine_test_util.h): adds,
 * cancels and steps in random order on a 4-slot engine with a 6-page pool and a 60-token
 * context; then again with prompts prefilled 4 tokens a step (max_prefill_tokens), so adds and
 * cancels also land mid-prefill. KDT_FUZZ_SCALE / KDT_FUZZ_SEED (tests/t.h) lengthen or reseed it. */
static void test_random_ops(void) {
    kdt_engine *e = et_random_ops_engine(KDT_DEVICE_CPU, &g_oracle, DEPTH, 0, 0);
    if (!e) return;
    const et_ro_setup su = {g_prompts, g_n_prompt, g_new, g_ref, N_PROMPTS, 320};
    et_random_ops(e, &su, t_fuzz_iters(1000), t_fuzz_seed(0x0e9a11));
    kdt_engine_free(e);
    /* prompts prefilled 4 tokens a step: cancels and adds land mid-prefill */
    e = et_random_ops_engine(KDT_DEVICE_CPU, &g_oracle, DEPTH, 4, 4);
    if (!e) return;
    et_random_ops(e, &su, t_fuzz_iters(1000), t_fuzz_seed(0x0e9a12));
    kdt_engine_free(e);
}

static void test_spec_names(void) {
    kdt_spec_mode m;
    CHECK(kdt_spec_mode_parse("ddtree", &m) == KDT_OK && m == KDT_SPEC_DDTREE);
    CHECK(kdt_spec_mode_parse("auto", &m) == KDT_OK && m == KDT_SPEC_AUTO);
    CHECK(kdt_spec_mode_parse("tree", &m) == KDT_ERR_INVALID_ARG);
    CHECK(strcmp(kdt_spec_mode_name(KDT_SPEC_CHAIN), "chain") == 0);
}

int main(void) {
    FILE *f = fopen(ET_FIXTURE "/config.json", "rb");
    g_have_fixture = f != NULL;
    if (f) fclose(f);
    if (!g_have_fixture) {
        printf("tests/fixtures/models/kimi_tiny not present: skipped\n");
        return 0;
    }
    setup();
    T_RUN(test_spec_names);
    T_RUN(test_lossless_greedy);
    T_RUN(test_prefill_chunk);
    T_RUN(test_prefill_budget);
    T_RUN(test_prefill_place);
    T_RUN(test_shared_passes_forms);
    T_RUN(test_mixed_batch_and_joins);
    T_RUN(test_stop_and_length);
    T_RUN(test_cancel);
    T_RUN(test_bad_input);
    T_RUN(test_device_fault);
    T_RUN(test_random_ops);
    et_oracle_free(&g_oracle);
    for (int i = 0; i < N_PROMPTS; i++) {
        free(g_prompts[i]);
        free(g_ref[i]);
    }
    return t_summary();
}
#else
#include <stdio.h>
int main(void) {
    printf("engine not built (no jansson): skipped\n");
    return 0;
}
#endif
