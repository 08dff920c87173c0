/* test_model_forward.c - the CPU forward on tiny random checkpoints:
 *  - against the independent fp64 reference of tests/model_ref.h (plain, non-absorbed MLA form,
 *    transformers' RoPE convention, fp64 YaRN tables from the config): max |logit error| <=
 *    1e-4 * max |logit| and the same argmax wherever the top-2 gap exceeds 1e-3;
 *  - bitwise equalities: prefill == token-by-token decode, any prefill chunk size, decode of a
 *    stream alone == with other streams, tree verify at every node == decode along that node's
 *    path (logits, argmax, taps, KV rows), and decoding after kdt_kv_cache_commit == decoding the
 *    accepted path directly, and a model whose latent is 2^+-14 times larger (the same model)
 *    gives the same logits;
 *  - bad inputs: token ids, over-long prompts, exhausted KV pages, malformed trees, bad streams
 *    give clear errors and leave the cache as it was. */
#include "t.h"

#ifdef KDT_WITH_MODEL
#include "model_ref.h"
#include "test_model_util.h"

#include "kdtree/model.h"
#include "model/model_internal.h"

static kdt_model *load_spec_form(const tm_spec *s, int chunk, int form, char *dir, size_t dn) {
    tm_mkdtemp(dir, dn);
    tm_write_model(dir, s);
    kdt_model *m = NULL;
    kdt_model_options o = {0, chunk, form};
    kdt_status st = kdt_model_load(dir, &o, &m);
    if (st != KDT_OK) fprintf(stderr, "load: %s\n", kdt_last_error());
    return m;
}

static kdt_model *load_spec(const tm_spec *s, int chunk, char *dir, size_t dn) {
    return load_spec_form(s, chunk, KDT_PREFILL_ABSORBED, dir, dn);
}

static kdt_kv_cache *new_cache(const kdt_model *m, int pages, int streams) {
    kdt_kv_cache_options o = {pages, streams, 0};
    kdt_kv_cache *c = NULL;
    if (kdt_kv_cache_create(m, &o, &c) != KDT_OK) fprintf(stderr, "cache: %s\n", kdt_last_error());
    return c;
}

/* ---- tests ------------------------------------------------------------------------------------ */

static void check_against_reference_form(const tm_spec *s, int form, const char *label) {
    char dir[600];
    kdt_model *m = load_spec_form(s, 0, form, dir, sizeof dir);
    CHECK(m != NULL);
    if (!m) return;
    const kdt_model_config *c = kdt_model_get_config(m);
    const int n = 37, V = c->vocab_size, D = c->hidden_size, NL = c->n_layers;
    int32_t toks[37];
    uint64_t rng = s->seed ^ 77;
    for (int i = 0; i < n; i++) toks[i] = t_rand_int(&rng, V);
    float *logits = malloc((size_t)n * V * sizeof *logits), *taps = malloc((size_t)n * NL * D * sizeof *taps);
    int32_t argmax[37], tap_layers[16];
    for (int l = 0; l < NL; l++) tap_layers[l] = l;
    kdt_model_outputs out = {logits, argmax, 0, NL, tap_layers, taps};
    kdt_kv_cache *kv = new_cache(m, 4, 1);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, n, &out), KDT_OK);
    double *rl = malloc((size_t)n * V * sizeof *rl), *rt = malloc((size_t)n * NL * D * sizeof *rt);
    mref_forward(m, toks, n, rl, rt, NULL);
    double max_err = 0, max_ref = 0, tap_err = 0, tap_ref = 0;
    int argmax_bad = 0;
    for (int t = 0; t < n; t++) {
        int best = 0, second = -1;
        for (int v = 0; v < V; v++) {
            double e = fabs(logits[(size_t)t * V + v] - rl[(size_t)t * V + v]);
            max_err = e > max_err ? e : max_err;
            max_ref = fabs(rl[(size_t)t * V + v]) > max_ref ? fabs(rl[(size_t)t * V + v]) : max_ref;
            if (v && rl[(size_t)t * V + v] > rl[(size_t)t * V + best]) best = v;
        }
        for (int v = 0; v < V; v++)
            if (v != best && (second < 0 || rl[(size_t)t * V + v] > rl[(size_t)t * V + second])) second = v;
        if (rl[(size_t)t * V + best] - rl[(size_t)t * V + second] > 1e-3 && argmax[t] != best) argmax_bad++;
        for (int i = 0; i < NL * D; i++) {
            double e = fabs(taps[(size_t)t * NL * D + i] - rt[(size_t)t * NL * D + i]);
            tap_err = e > tap_err ? e : tap_err;
            tap_ref = fabs(rt[(size_t)t * NL * D + i]) > tap_ref ? fabs(rt[(size_t)t * NL * D + i]) : tap_ref;
        }
    }
    printf("  %-28s max |logit err| %.3g of max |logit| %.3g; max |tap err| %.3g of %.3g\n", label, max_err,
           max_ref, tap_err, tap_ref);
    CHECK_MSG(max_err <= 1e-4 * max_ref, "%s: logit error %g", label, max_err);
    CHECK_MSG(tap_err <= 1e-4 * tap_ref, "%s: tap error %g", label, tap_err);
    CHECK_EQ_INT(argmax_bad, 0);
    free(logits); free(taps); free(rl); free(rt);
    kdt_kv_cache_free(kv);
    kdt_model_free(m);
    tm_rmdir(dir);
}

static void check_against_reference(const tm_spec *s, const char *label) {
    check_against_reference_form(s, KDT_PREFILL_ABSORBED, label);
}

static void test_vs_reference(void) {
    tm_spec s = tm_default_spec(); /* q_lora, YaRN 32/1 with mscale_all_dim 0.8, n_group 2 */
    check_against_reference(&s, "q_lora + YaRN + groups");
    s = tm_default_spec();
    s.q_lora = 0; s.yarn = 0; s.n_group = 1; s.topk_group = 1; s.norm_topk = 0; s.first_dense = 2;
    s.layers = 3; s.seed = 99;
    check_against_reference(&s, "no q_lora + default RoPE");
    s = tm_default_spec();
    s.beta_fast = 1; s.beta_slow = 1; s.mscale_all_dim = 1; s.theta = 50000; s.n_group = 1; s.topk_group = 1;
    s.shared = 2; s.bf16 = 1; s.seed = 5; s.heads = 3; s.eps = 1e-6;
    check_against_reference(&s, "Kimi-like (beta 1/1) BF16");
    s = tm_default_spec();
    s.no_interleave = 1; s.seed = 8; s.layers = 2; s.experts = 8; s.topk = 4; s.n_group = 4; s.topk_group = 4;
    check_against_reference(&s, "rope_interleave false");
}

/* Random small specs (tm_random_spec) against the fp64 reference. The four named specs above are
 * what transformers' fixtures cover; this reaches the combinations between them.
 * KDT_FUZZ_SCALE / KDT_FUZZ_SEED (tests/t.h) widen or reseed it. */
static void test_random_specs(void) {
    uint64_t rng = t_fuzz_seed(0x5bec5);
    const int n = t_fuzz_iters(8);
    for (int it = 0; it < n; it++) {
        const tm_spec s = tm_random_spec(&rng);
        char label[160];
        tm_spec_label(&s, it, label, sizeof label);
        check_against_reference(&s, label);
    }
}

/* prefill logits == one prefill token then decode steps; any chunk size; bitwise */
static void test_prefill_decode_bitwise(void) {
    tm_spec s = tm_default_spec();
    char d1[600], d2[600];
    kdt_model *m = load_spec(&s, 0, d1, sizeof d1), *m5 = load_spec(&s, 5, d2, sizeof d2);
    CHECK(m && m5);
    if (!m || !m5) return;
    const int n = 70, V = s.vocab; /* crosses a page boundary */
    int32_t toks[70];
    uint64_t rng = 3;
    for (int i = 0; i < n; i++) toks[i] = t_rand_int(&rng, V);
    float *a = malloc((size_t)n * V * 4), *b = malloc((size_t)n * V * 4), *cc = malloc((size_t)n * V * 4);
    kdt_kv_cache *k1 = new_cache(m, 4, 1), *k2 = new_cache(m, 4, 1), *k3 = new_cache(m5, 4, 1);
    kdt_model_outputs o = {0};
    o.logits = a;
    CHECK_EQ_INT(kdt_model_prefill(m, k1, 0, toks, n, &o), KDT_OK);
    o.logits = cc;
    CHECK_EQ_INT(kdt_model_prefill(m5, k3, 0, toks, n, &o), KDT_OK);
    o.logits = b;
    CHECK_EQ_INT(kdt_model_prefill(m, k2, 0, toks, 1, &o), KDT_OK);
    for (int i = 1; i < n; i++) {
        o.logits = b + (size_t)i * V;
        CHECK_EQ_INT(kdt_model_decode(m, k2, 1, NULL, toks + i, &o), KDT_OK);
    }
    CHECK(memcmp(a, b, (size_t)n * V * 4) == 0);
    CHECK(memcmp(a, cc, (size_t)n * V * 4) == 0);
    CHECK_EQ_INT(kdt_kv_stream_length(k2, 0), n);
    /* last_only + fused argmax == the last row's logits and their argmax */
    int32_t am = -1;
    float last[96];
    kdt_kv_cache *k4 = new_cache(m, 4, 1);
    kdt_model_outputs ol = {last, &am, 1, 0, NULL, NULL};
    CHECK_EQ_INT(kdt_model_prefill(m, k4, 0, toks, n, &ol), KDT_OK);
    CHECK(memcmp(last, a + (size_t)(n - 1) * V, (size_t)V * 4) == 0);
    int best = 0;
    for (int v = 1; v < V; v++) if (last[v] > last[best]) best = v;
    CHECK_EQ_INT(am, best);
    /* the KV rows are identical too */
    for (int l = 0; l < s.layers; l++)
        for (int t = 0; t < n; t++)
            CHECK(memcmp(kdt_kv_row(k1, l, 0, t), kdt_kv_row(k2, l, 0, t), (size_t)k1->row_elems * 4) == 0);
    free(a); free(b); free(cc);
    kdt_kv_cache_free(k1); kdt_kv_cache_free(k2); kdt_kv_cache_free(k3); kdt_kv_cache_free(k4);
    kdt_model_free(m); kdt_model_free(m5);
    tm_rmdir(d1); tm_rmdir(d2);
}

/* The plain prefill form (kdt_model_options.prefill_attention) against the same fp64 reference,
 * on the named specs and random ones: its 37-row prompt is one chunk (64 rows), all of it plain. */
static void test_plain_vs_reference(void) {
    tm_spec s = tm_default_spec();
    check_against_reference_form(&s, KDT_PREFILL_PLAIN, "plain: q_lora + YaRN + groups");
    s = tm_default_spec();
    s.q_lora = 0; s.yarn = 0; s.n_group = 1; s.topk_group = 1; s.norm_topk = 0; s.first_dense = 2;
    s.layers = 3; s.seed = 99;
    check_against_reference_form(&s, KDT_PREFILL_PLAIN, "plain: no q_lora");
    s = tm_default_spec();
    s.beta_fast = 1; s.beta_slow = 1; s.mscale_all_dim = 1; s.theta = 50000; s.n_group = 1; s.topk_group = 1;
    s.shared = 2; s.bf16 = 1; s.seed = 5; s.heads = 3; s.eps = 1e-6;
    check_against_reference_form(&s, KDT_PREFILL_PLAIN, "plain: Kimi-like BF16");
    uint64_t rng = t_fuzz_seed(0x91a1);
    const int n = t_fuzz_iters(6);
    for (int it = 0; it < n; it++) {
        const tm_spec r = tm_random_spec(&rng);
        char label[180] = "plain: ";
        tm_spec_label(&r, it, label + 7, sizeof label - 7);
        check_against_reference_form(&r, KDT_PREFILL_PLAIN, label);
    }
}

/* Several streams' prefill chunks in one call (kdt_model_prefill_many) == each segment alone
 * (kdt_model_prefill), bitwise: every row's logits and taps, the last rows' argmax (last_only), the
 * cache rows and a decode step after; in each form, auto mixing plain first chunks with an absorbed
 * 3-row chunk after a 70-token prefix. Bad segment lists are refused with nothing changed. */
static void test_prefill_many(void) {
    tm_spec sp = tm_default_spec();
    enum { NS = 3, PRE = 70 };
    static const int n_seg[NS] = {40, 3, 17}, prefix[NS] = {0, PRE, 0};
    static const int forms[3] = {KDT_PREFILL_AUTO, KDT_PREFILL_ABSORBED, KDT_PREFILL_PLAIN};
    const int V = sp.vocab;
    int32_t toks[NS][PRE + 40];
    uint64_t rng = 77;
    for (int k = 0; k < NS; k++)
        for (int i = 0; i < PRE + 40; i++) toks[k][i] = t_rand_int(&rng, V);
    const int rows = n_seg[0] + n_seg[1] + n_seg[2];
    for (int f = 0; f < 3; f++) {
        char dir[600];
        kdt_model *m = load_spec_form(&sp, 0, forms[f], dir, sizeof dir);
        CHECK(m != NULL);
        if (!m) continue;
        const int D = m->cfg.hidden_size;
        if (f == 0)
            CHECK_MSG(kdt_prefill_takes_plain(&m->cfg, KDT_PREFILL_AUTO, n_seg[0], 0) &&
                          !kdt_prefill_takes_plain(&m->cfg, KDT_PREFILL_AUTO, n_seg[1], PRE),
                      "the default spec no longer mixes the forms in this test's pass");
        kdt_kv_cache *k1 = new_cache(m, 8, NS), *kn = new_cache(m, 8, NS), *kl = new_cache(m, 8, NS);
        float *ref = malloc((size_t)rows * V * 4), *got = malloc((size_t)rows * V * 4);
        float *tref = malloc((size_t)rows * D * 4), *tgot = malloc((size_t)rows * D * 4);
        float *dref = malloc((size_t)NS * V * 4), *dgot = malloc((size_t)NS * V * 4);
        const int32_t tap_layer[1] = {0};
        int32_t am[64], last_ref[NS], last_got[NS];
        kdt_kv_cache *kc[3] = {k1, kn, kl};
        for (int i = 0; i < 3; i++) CHECK_EQ_INT(kdt_model_prefill(m, kc[i], 1, toks[1], PRE, NULL), KDT_OK);
        kdt_model_outputs o = {0};
        o.n_taps = 1;
        o.tap_layers = tap_layer;
        int row = 0;
        for (int k = 0; k < NS; k++) {
            o.logits = ref + (size_t)row * V;
            o.argmax = am;
            o.taps = tref + (size_t)row * D;
            CHECK_EQ_INT(kdt_model_prefill(m, k1, k, toks[k] + prefix[k], n_seg[k], &o), KDT_OK);
            last_ref[k] = am[n_seg[k] - 1];
            row += n_seg[k];
        }
        kdt_prefill_segment sg[NS];
        for (int k = 0; k < NS; k++) sg[k] = (kdt_prefill_segment){k, toks[k] + prefix[k], n_seg[k]};
        o.logits = got;
        o.argmax = NULL;
        o.taps = tgot;
        CHECK_EQ_INT(kdt_model_prefill_many(m, kn, NS, sg, &o), KDT_OK);
        CHECK_MSG(!memcmp(got, ref, (size_t)rows * V * 4), "form %d: logits of the shared pass differ", forms[f]);
        CHECK_MSG(!memcmp(tgot, tref, (size_t)rows * D * 4), "form %d: taps of the shared pass differ", forms[f]);
        kdt_model_outputs ol = {0};
        ol.argmax = last_got;
        ol.last_only = 1;
        CHECK_EQ_INT(kdt_model_prefill_many(m, kl, NS, sg, &ol), KDT_OK);
        CHECK_MSG(!memcmp(last_got, last_ref, sizeof last_ref), "form %d: last_only argmax differs", forms[f]);
        for (int k = 0; k < NS; k++)
            for (int l = 0; l < sp.layers; l++)
                for (int t = 0; t < prefix[k] + n_seg[k]; t++)
                    CHECK(!memcmp(kdt_kv_row(k1, l, k, t), kdt_kv_row(kn, l, k, t), (size_t)k1->row_elems * 4));
        int32_t next[NS];
        for (int k = 0; k < NS; k++) next[k] = toks[(k + 1) % NS][k];
        kdt_model_outputs od = {0};
        od.logits = dref;
        CHECK_EQ_INT(kdt_model_decode(m, k1, NS, NULL, next, &od), KDT_OK);
        od.logits = dgot;
        CHECK_EQ_INT(kdt_model_decode(m, kl, NS, NULL, next, &od), KDT_OK);
        CHECK_MSG(!memcmp(dgot, dref, (size_t)NS * V * 4), "form %d: decode after the shared pass differs", forms[f]);
        if (f == 0) { /* refused, nothing changed */
            int32_t len0[NS];
            for (int k = 0; k < NS; k++) len0[k] = kn->length[k];
            kdt_prefill_segment twice[2] = {{0, toks[0], 4}, {0, toks[0], 4}};
            CHECK_EQ_INT(kdt_model_prefill_many(m, kn, 2, twice, NULL), KDT_ERR_INVALID_ARG);
            CHECK(strstr(kdt_last_error(), "stream 0 in segments 0 and 1") != NULL);
            kdt_prefill_segment big[1] = {{2, toks[2], m->opt.prefill_chunk + 1}};
            CHECK_EQ_INT(kdt_model_prefill_many(m, kn, 1, big, NULL), KDT_ERR_INVALID_ARG);
            CHECK(strstr(kdt_last_error(), "prefill_chunk") != NULL);
            int32_t bad_tok[4] = {1, 2, V, 3};
            kdt_prefill_segment badt[2] = {{0, toks[0], 4}, {2, bad_tok, 4}};
            CHECK_EQ_INT(kdt_model_prefill_many(m, kn, 2, badt, NULL), KDT_ERR_INVALID_ARG);
            CHECK(strstr(kdt_last_error(), "tokens[2]") != NULL);
            CHECK_EQ_INT(kdt_model_prefill_many(m, kn, 0, sg, NULL), KDT_ERR_INVALID_ARG);
            kdt_prefill_segment far[1] = {{NS, toks[0], 4}};
            CHECK_EQ_INT(kdt_model_prefill_many(m, kn, 1, far, NULL), KDT_ERR_INVALID_ARG);
            CHECK_EQ_INT(kdt_model_prefill_many(m, kn, 1, NULL, NULL), KDT_ERR_INVALID_ARG);
            for (int k = 0; k < NS; k++) CHECK_EQ_INT(kn->length[k], len0[k]);
        }
        free(ref), free(got), free(tref), free(tgot), free(dref), free(dgot);
        kdt_kv_cache_free(k1); kdt_kv_cache_free(kn); kdt_kv_cache_free(kl);
        kdt_model_free(m);
        tm_rmdir(dir);
    }
}

/* The plain form's own invariances, bitwise: any prefill chunk size, one call or a prefix then the
 * rest, and a stream prefilled beside another. Against the absorbed form: the same function (a
 * few ulps apart), and decoding after either prefill continues alike. */
static void test_plain_prefill_chunks(void) {
    tm_spec s = tm_default_spec();
    char d0[600], d1[600], d2[600];
    kdt_model *m = load_spec_form(&s, 0, KDT_PREFILL_PLAIN, d0, sizeof d0);
    kdt_model *m5 = load_spec_form(&s, 5, KDT_PREFILL_PLAIN, d1, sizeof d1);
    kdt_model *ma = load_spec(&s, 0, d2, sizeof d2);
    CHECK(m && m5 && ma);
    if (!m || !m5 || !ma) return;
    const int n = 70, V = s.vocab;
    int32_t toks[71];
    uint64_t rng = 31;
    for (int i = 0; i < n + 1; i++) toks[i] = t_rand_int(&rng, V);
    float *a = malloc((size_t)(n + 1) * V * 4), *b = malloc((size_t)(n + 1) * V * 4), *c = malloc((size_t)(n + 1) * V * 4),
          *ab = malloc((size_t)(n + 1) * V * 4);
    kdt_kv_cache *k1 = new_cache(m, 8, 2), *k2 = new_cache(m5, 4, 1), *k3 = new_cache(m, 4, 1), *ka = new_cache(ma, 4, 1);
    kdt_model_outputs o = {0};
    o.logits = a;
    CHECK_EQ_INT(kdt_model_prefill(m, k1, 1, toks + 1, 9, NULL), KDT_OK); /* another stream first */
    CHECK_EQ_INT(kdt_model_prefill(m, k1, 0, toks, n, &o), KDT_OK);
    o.logits = b;
    CHECK_EQ_INT(kdt_model_prefill(m5, k2, 0, toks, n, &o), KDT_OK);
    o.logits = c;
    CHECK_EQ_INT(kdt_model_prefill(m, k3, 0, toks, 23, &o), KDT_OK);
    o.logits = c + (size_t)23 * V;
    CHECK_EQ_INT(kdt_model_prefill(m, k3, 0, toks + 23, n - 23, &o), KDT_OK);
    o.logits = ab;
    CHECK_EQ_INT(kdt_model_prefill(ma, ka, 0, toks, n, &o), KDT_OK);
    CHECK(memcmp(a, b, (size_t)n * V * 4) == 0);
    CHECK(memcmp(a, c, (size_t)n * V * 4) == 0);
    for (int l = 0; l < s.layers; l++)
        for (int t = 0; t < n; t++) {
            CHECK(memcmp(kdt_kv_row(k1, l, 0, t), kdt_kv_row(k2, l, 0, t), (size_t)k1->row_elems * 4) == 0);
            CHECK(memcmp(kdt_kv_row(k1, l, 0, t), kdt_kv_row(k3, l, 0, t), (size_t)k1->row_elems * 4) == 0);
        }
    /* one decode step after each prefill: the plain form's cache serves the absorbed decode */
    o.logits = a + (size_t)n * V;
    CHECK_EQ_INT(kdt_model_decode(m, k1, 1, NULL, toks + n, &o), KDT_OK);
    o.logits = ab + (size_t)n * V;
    CHECK_EQ_INT(kdt_model_decode(ma, ka, 1, NULL, toks + n, &o), KDT_OK);
    double err = 0, ref = 0;
    int same_bits = 1;
    for (size_t i = 0; i < (size_t)(n + 1) * V; i++) {
        const double e = fabs((double)a[i] - ab[i]);
        err = e > err ? e : err;
        ref = fabs(ab[i]) > ref ? fabs(ab[i]) : ref;
        same_bits &= a[i] == ab[i];
    }
    printf("  plain vs absorbed prefill (70 rows + 1 decode): max |diff| %.3g of max |logit| %.3g%s\n", err, ref,
           same_bits ? " (bitwise equal)" : "");
    CHECK_MSG(err <= 1e-5 * ref, "plain vs absorbed: %g", err);
    free(a); free(b); free(c); free(ab);
    kdt_kv_cache_free(k1); kdt_kv_cache_free(k2); kdt_kv_cache_free(k3); kdt_kv_cache_free(ka);
    kdt_model_free(m); kdt_model_free(m5); kdt_model_free(ma);
    tm_rmdir(d0); tm_rmdir(d1); tm_rmdir(d2);
}

/* The GPU engine's default prefill chunk (kdt_prefill_chunk_for) at published dimensions: Kimi
 * K2.6's layer holds ~34x the weights a row uses (384 experts, 8 + 1 used), so its point is
 * ~34 x the device's FLOPs per byte: 2,048 rows at an H100's ~38, 1,024 at an H200's ~26, and
 * down to the 256 floor; DeepSeek-V3 (256 experts, 128 heads) ~20x; a dense model 1x (256); the
 * bundled tiny target 256 at an H100's ridge (its GPU default as before the rule). */
static void test_prefill_chunk_rule(void) {
    kdt_model_config k = {0};
    k.hidden_size = 7168; k.n_heads = 64; k.q_lora_rank = 1536; k.kv_lora_rank = 512;
    k.qk_nope_head_dim = 128; k.qk_rope_head_dim = 64; k.v_head_dim = 128;
    k.intermediate_size = 18432; k.moe_intermediate_size = 2048; k.n_routed_experts = 384;
    k.n_shared_experts = 1; k.n_experts_per_tok = 8; k.first_k_dense_replace = 1; k.n_layers = 61;
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, 38.0), 2048);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, 26.0), 1024);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, 14.0), 512);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, 7.0), 256);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, 1e6), KDT_GPU_PREFILL_CHUNK_MAX);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, 0.0), KDT_GPU_PREFILL_CHUNK_MIN);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, -1.0), KDT_GPU_PREFILL_CHUNK_MIN);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, NAN), KDT_GPU_PREFILL_CHUNK_MIN);
    CHECK_EQ_INT(kdt_prefill_chunk_for(NULL, 38.0), KDT_GPU_PREFILL_CHUNK_MIN);
    kdt_model_config v3 = k; /* DeepSeek-V3: 128 heads, 256 experts */
    v3.n_heads = 128; v3.n_routed_experts = 256; v3.first_k_dense_replace = 3;
    CHECK_EQ_INT(kdt_prefill_chunk_for(&v3, 38.0), 1024);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&v3, 26.0), 512);
    kdt_model_config dense = k; /* every layer dense (or no experts at all) */
    dense.first_k_dense_replace = dense.n_layers;
    CHECK_EQ_INT(kdt_prefill_chunk_for(&dense, 38.0), 256);
    dense = k;
    dense.n_routed_experts = 0;
    CHECK_EQ_INT(kdt_prefill_chunk_for(&dense, 200.0), 256);
    /* the device side: an H100 SXM reports 132 SMs, 1,980 MHz, memory 2,619 MHz x 5,120 bits
     * (session 47's probe): 114.0 TFLOP/s over 3,017 GB/s = 37.8, so Kimi 2,048 rows; an H200's
     * ~3.1 GHz x 6,144 bits gives ~26 and 1,024 rows; without wgmma (major 8) the rate halves */
    const double h100 = kdt_gpu_flop_per_byte(132, 1980000, 2619000, 5120, 9);
    CHECK_MSG(fabs(h100 - 37.78) < 0.05, "H100: %.3f FLOP/byte", h100);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, h100), 2048);
    const double h200 = kdt_gpu_flop_per_byte(132, 1980000, 3125000, 6144, 9);
    CHECK(h200 > 25 && h200 < 27);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, h200), 1024);
    CHECK(fabs(kdt_gpu_flop_per_byte(132, 1980000, 2619000, 5120, 8) - h100 * 55 / 114) < 1e-9);
    CHECK(kdt_gpu_flop_per_byte(0, 1980000, 2619000, 5120, 9) == 0);
    CHECK(kdt_gpu_flop_per_byte(132, 1980000, -1, 5120, 9) == 0);
    CHECK_EQ_INT(kdt_prefill_chunk_for(&k, kdt_gpu_flop_per_byte(132, 0, 0, 0, 0)), KDT_GPU_PREFILL_CHUNK_MIN);
    kdt_model_config zero = {0}; /* no weights: no rows to amortize */
    CHECK_EQ_INT(kdt_prefill_chunk_for(&zero, 38.0), KDT_GPU_PREFILL_CHUNK_MIN);
    char path[1024];
    snprintf(path, sizeof path, "%s/models/tiny-target", KDT_SOURCE_DIR);
    kdt_model *m = NULL;
    kdt_model_options o = {0, 0, 0};
    CHECK_EQ_INT(kdt_model_load(path, &o, &m), KDT_OK);
    if (m) CHECK_EQ_INT(kdt_prefill_chunk_for(kdt_model_get_config(m), 38.0), 256);
    kdt_model_free(m);
}

/* KDT_PREFILL_AUTO: the FLOP rule at Kimi K2.6's dimensions (a prompt's first chunk always pays;
 * after a long prefix a chunk pays from 171 rows), and the forms it picks on a tiny model: its
 * outputs equal the plain form's bitwise where every chunk pays and the absorbed form's where
 * none does. A form outside 0..2 is refused at load. */
static void test_prefill_auto(void) {
    kdt_model_config k = {0};
    k.kv_lora_rank = 512; k.qk_nope_head_dim = 128; k.qk_rope_head_dim = 64; k.v_head_dim = 128;
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 1, 0), 1);
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 2048, 0), 1);
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 1, 4096), 0);
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 64, 4096), 0);
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 170, 100000), 0);
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 171, 100000), 1);
    CHECK_EQ_INT(kdt_prefill_plain_pays(&k, 0, 0), 0);
    CHECK_EQ_INT(kdt_prefill_plain_pays(NULL, 8, 0), 0);

    tm_spec s = tm_default_spec();
    char da[600], dp[600];
    kdt_model *mauto = load_spec_form(&s, 32, KDT_PREFILL_AUTO, da, sizeof da);
    kdt_model *mplain = load_spec_form(&s, 32, KDT_PREFILL_PLAIN, dp, sizeof dp);
    CHECK(mauto && mplain);
    if (!mauto || !mplain) return;
    const kdt_model_config *c = kdt_model_get_config(mauto);
    const int V = s.vocab;
    enum { NP = 64, NT = 84 };
    int32_t toks[NT];
    uint64_t rng = 5;
    for (int i = 0; i < NT; i++) toks[i] = t_rand_int(&rng, V);
    /* d_c 16, d_n 8, d_r 8, d_v 12: kv_b costs 640 FLOPs per key and head, the plain form saves 24
     * per (row, key) pair, so 32-row chunks pay (from 0 and after 32) and 1-row chunks never do */
    const int all_pay = kdt_prefill_plain_pays(c, 32, 0) && kdt_prefill_plain_pays(c, 32, 32);
    int none_pays = !kdt_prefill_plain_pays(c, 8, 32);
    for (int i = NP; i < NT; i++) none_pays &= !kdt_prefill_plain_pays(c, 1, i);
    CHECK(all_pay && none_pays);
    float *la = malloc((size_t)NT * V * 4), *lp = malloc((size_t)NT * V * 4), *lb = malloc((size_t)NT * V * 4);
    kdt_kv_cache *ka = new_cache(mauto, 4, 1), *kp = new_cache(mplain, 4, 1);
    kdt_model_outputs o = {0};
    o.logits = la;
    CHECK_EQ_INT(kdt_model_prefill(mauto, ka, 0, toks, NP, &o), KDT_OK);
    o.logits = lp;
    CHECK_EQ_INT(kdt_model_prefill(mplain, kp, 0, toks, NP, &o), KDT_OK);
    CHECK(memcmp(la, lp, (size_t)NP * V * 4) == 0);
    for (int i = NP; i < NT; i++) { /* both caches from the plain prefix, so only the form differs */
        o.logits = la + (size_t)i * V;
        CHECK_EQ_INT(kdt_model_prefill(mauto, ka, 0, toks + i, 1, &o), KDT_OK);
        o.logits = lb + (size_t)i * V;
        CHECK_EQ_INT(kdt_model_decode(mplain, kp, 1, NULL, toks + i, &o), KDT_OK);
    }
    CHECK(memcmp(la + (size_t)NP * V, lb + (size_t)NP * V, (size_t)(NT - NP) * V * 4) == 0);
    free(la); free(lp); free(lb);
    kdt_kv_cache_free(ka); kdt_kv_cache_free(kp);
    kdt_model_free(mauto); kdt_model_free(mplain);
    tm_rmdir(da); tm_rmdir(dp);
    /* a form outside the enum */
    char dx[600];
    tm_mkdtemp(dx, sizeof dx);
    tm_write_model(dx, &s);
    kdt_model *mx = NULL;
    kdt_model_options ox = {0, 0, 3};
    CHECK_EQ_INT(kdt_model_load(dx, &ox, &mx), KDT_ERR_INVALID_ARG);
    CHECK(mx == NULL && strstr(kdt_last_error(), "prefill_attention = 3") != NULL);
    tm_rmdir(dx);
}

/* tm_spec.latent_shift makes the same model with its latent (KV cache) 2^shift larger: the CPU
 * forward's logits are bitwise the same, which is what lets tests/gpu/test_model_gpu.c demand the
 * same of the GPU (where a lossy format on the latent's way would show) */
static void test_latent_shift_same_model(void) {
    const int n = 40;
    float *lg[3];
    int32_t toks[40];
    uint64_t rng = 11;
    tm_spec s = tm_default_spec();
    for (int i = 0; i < n; i++) toks[i] = t_rand_int(&rng, s.vocab);
    const int shifts[3] = {0, 14, -14};
    for (int v = 0; v < 3; v++) {
        s.latent_shift = shifts[v];
        char d[600];
        kdt_model *m = load_spec(&s, 0, d, sizeof d);
        lg[v] = calloc((size_t)n * s.vocab, 4);
        CHECK(m != NULL);
        if (m) {
            kdt_kv_cache *k = new_cache(m, 2, 1);
            kdt_model_outputs o = {lg[v], NULL, 0, 0, NULL, NULL};
            CHECK_EQ_INT(kdt_model_prefill(m, k, 0, toks, n, &o), KDT_OK);
            kdt_kv_cache_free(k);
            kdt_model_free(m);
        }
        tm_rmdir(d);
        if (v) CHECK_MSG(memcmp(lg[0], lg[v], (size_t)n * s.vocab * 4) == 0, "latent x 2^%d changed the logits", shifts[v]);
    }
    for (int v = 0; v < 3; v++) free(lg[v]);
}

/* a stream's decode results do not depend on the other streams in the call */
static void test_decode_batch_invariance(void) {
    tm_spec s = tm_default_spec();
    char d[600];
    kdt_model *m = load_spec(&s, 0, d, sizeof d);
    CHECK(m != NULL);
    if (!m) return;
    const int S = 4, V = s.vocab, D = s.hidden;
    int lens[4] = {5, 1, 33, 12};
    int32_t ids[4] = {3, 0, 2, 1}; /* cache streams, in a scrambled order */
    int32_t hist[4][40], next[4];
    uint64_t rng = 11;
    kdt_kv_cache *joint = new_cache(m, 16, 4);
    for (int s_ = 0; s_ < S; s_++) {
        for (int i = 0; i < lens[s_]; i++) hist[s_][i] = t_rand_int(&rng, V);
        next[s_] = t_rand_int(&rng, V);
        CHECK_EQ_INT(kdt_model_prefill(m, joint, ids[s_], hist[s_], lens[s_], NULL), KDT_OK);
    }
    float lj[4 * 96], tj[4 * 32];
    int32_t aj[4], tap = 1;
    kdt_model_outputs o = {lj, aj, 0, 1, &tap, tj};
    CHECK_EQ_INT(kdt_model_decode(m, joint, S, ids, next, &o), KDT_OK);
    for (int s_ = 0; s_ < S; s_++) {
        kdt_kv_cache *alone = new_cache(m, 4, 1);
        float la[96], ta[32];
        int32_t aa;
        kdt_model_outputs oa = {la, &aa, 0, 1, &tap, ta};
        CHECK_EQ_INT(kdt_model_prefill(m, alone, 0, hist[s_], lens[s_], NULL), KDT_OK);
        CHECK_EQ_INT(kdt_model_decode(m, alone, 1, NULL, &next[s_], &oa), KDT_OK);
        CHECK(memcmp(la, lj + s_ * V, (size_t)V * 4) == 0);
        CHECK(memcmp(ta, tj + s_ * D, (size_t)D * 4) == 0);
        CHECK_EQ_INT(aa, aj[s_]);
        CHECK_EQ_INT(kdt_kv_stream_length(joint, ids[s_]), lens[s_] + 1);
        kdt_kv_cache_free(alone);
    }
    kdt_kv_cache_free(joint);
    kdt_model_free(m);
    tm_rmdir(d);
}

/* A random tree per stream in the kdt_tree layout (padding written as the contract says). */
typedef struct test_tree {
    kdt_tree t;
    int32_t n_nodes[4], token[4 * 40], parent[4 * 40], depth[4 * 40], fc[4 * 40], ns[4 * 40], pos[4 * 40];
    float score[4 * 40];
    uint64_t mask[4 * 40];
} test_tree;

static void make_tree(test_tree *tt, int S, const int *n_nodes, const int *prefix, const int32_t *roots, int V,
                      uint64_t *rng) {
    const int N = 40;
    memset(tt, 0, sizeof *tt);
    tt->t = (kdt_tree){S, N, tt->n_nodes, tt->token, tt->parent, tt->depth, tt->fc, tt->ns, tt->pos, tt->score, tt->mask};
    for (int s = 0; s < S; s++) {
        tt->n_nodes[s] = n_nodes[s];
        for (int i = 0; i < N; i++) {
            int k = s * N + i;
            tt->token[k] = tt->parent[k] = tt->depth[k] = tt->fc[k] = tt->ns[k] = tt->pos[k] = -1;
            tt->score[k] = -INFINITY;
            tt->mask[k] = 0;
        }
        for (int i = 0; i < n_nodes[s]; i++) {
            int k = s * N + i;
            int p = i ? t_rand_int(rng, i) : -1;
            if (i && t_rand_unit(rng) < 0.4) p = i - 1; /* some long chains */
            tt->parent[k] = p;
            tt->depth[k] = i ? tt->depth[s * N + p] + 1 : 0;
            tt->token[k] = i ? t_rand_int(rng, V) : roots[s];
            tt->pos[k] = prefix[s] + tt->depth[k];
            tt->mask[k] = (i ? tt->mask[s * N + p] : 0) | ((uint64_t)1 << i);
            tt->score[k] = 0;
        }
    }
}

/* tree verify at every node == decode along the node's path, bitwise; KV rows too */
static void test_verify_equals_decode(void) {
    tm_spec s = tm_default_spec();
    char d[600];
    kdt_model *m = load_spec(&s, 7, d, sizeof d); /* a small chunk: trees span several chunks */
    CHECK(m != NULL);
    if (!m) return;
    const int S = 3, N = 40, V = s.vocab, D = s.hidden;
    int prefix[3] = {9, 1, 66}, n_nodes[3] = {23, 1, 31};
    int32_t ids[3] = {2, 0, 1}, roots[3], hist[3][70];
    uint64_t rng = 21;
    kdt_kv_cache *kv = new_cache(m, 12, 3);
    for (int k = 0; k < S; k++) {
        for (int i = 0; i < prefix[k]; i++) hist[k][i] = t_rand_int(&rng, V);
        roots[k] = t_rand_int(&rng, V);
        CHECK_EQ_INT(kdt_model_prefill(m, kv, ids[k], hist[k], prefix[k], NULL), KDT_OK);
    }
    test_tree tt;
    make_tree(&tt, S, n_nodes, prefix, roots, V, &rng);
    float *logits = malloc((size_t)S * N * V * 4), *taps = malloc((size_t)S * N * 2 * D * 4);
    int32_t *argmax = malloc((size_t)S * N * 4), tap_layers[2] = {2, 0};
    for (int i = 0; i < S * N; i++) argmax[i] = -7; /* padding rows must stay untouched */
    kdt_model_outputs o = {logits, argmax, 0, 2, tap_layers, taps};
    CHECK_EQ_INT(kdt_model_verify(m, kv, &tt.t, ids, &o), KDT_OK);
    for (int k = 0; k < S; k++) {
        CHECK_EQ_INT(kdt_kv_stream_length(kv, ids[k]), prefix[k]); /* verify does not commit */
        for (int i = n_nodes[k]; i < N; i++) CHECK_EQ_INT(argmax[k * N + i], -7);
        for (int i = 0; i < n_nodes[k]; i++) {
            /* path root..i */
            int path[40], len = 0;
            for (int j = i; j >= 0; j = tt.parent[k * N + j]) path[len++] = j;
            kdt_kv_cache *ref = new_cache(m, 4, 1);
            CHECK_EQ_INT(kdt_model_prefill(m, ref, 0, hist[k], prefix[k], NULL), KDT_OK);
            float lr[96], tr[2 * 32];
            int32_t ar;
            kdt_model_outputs orr = {lr, &ar, 0, 2, tap_layers, tr};
            for (int p = len - 1; p >= 0; p--) {
                int32_t tok = tt.token[k * N + path[p]];
                CHECK_EQ_INT(kdt_model_decode(m, ref, 1, NULL, &tok, &orr), KDT_OK);
            }
            CHECK_MSG(memcmp(lr, logits + ((size_t)k * N + i) * V, (size_t)V * 4) == 0, "stream %d node %d", k, i);
            CHECK(memcmp(tr, taps + ((size_t)k * N + i) * 2 * D, (size_t)2 * D * 4) == 0);
            CHECK_EQ_INT(ar, argmax[k * N + i]);
            for (int l = 0; l < s.layers; l++)
                CHECK(memcmp(kdt_kv_row(ref, l, 0, prefix[k] + len - 1), kdt_kv_row(kv, l, ids[k], prefix[k] + i),
                             (size_t)kv->row_elems * 4) == 0);
            kdt_kv_cache_free(ref);
        }
    }
    /* the same trees verified one stream at a time give the same rows (batch invariance) */
    for (int k = 0; k < S; k++) {
        kdt_kv_cache *one = new_cache(m, 4, 1);
        CHECK_EQ_INT(kdt_model_prefill(m, one, 0, hist[k], prefix[k], NULL), KDT_OK);
        test_tree t1;
        make_tree(&t1, 1, &n_nodes[k], &prefix[k], &roots[k], V, &rng);
        memcpy(t1.token, tt.token + k * N, N * 4);
        memcpy(t1.parent, tt.parent + k * N, N * 4);
        memcpy(t1.depth, tt.depth + k * N, N * 4);
        memcpy(t1.pos, tt.pos + k * N, N * 4);
        memcpy(t1.mask, tt.mask + k * N, N * 8);
        float *l1 = malloc((size_t)N * V * 4);
        kdt_model_outputs o1 = {l1, NULL, 0, 0, NULL, NULL};
        CHECK_EQ_INT(kdt_model_verify(m, one, &t1.t, NULL, &o1), KDT_OK);
        CHECK(memcmp(l1, logits + (size_t)k * N * V, (size_t)n_nodes[k] * V * 4) == 0);
        free(l1);
        kdt_kv_cache_free(one);
    }
    free(logits); free(taps); free(argmax);
    kdt_kv_cache_free(kv);
    kdt_model_free(m);
    tm_rmdir(d);
}

/* verify -> greedy accept -> kdt_kv_cache_commit -> decode == decoding the accepted path */
static void test_commit_then_decode(void) {
    tm_spec s = tm_default_spec();
    char d[600];
    kdt_model *m = load_spec(&s, 0, d, sizeof d);
    CHECK(m != NULL);
    if (!m) return;
    const int N = 40, V = s.vocab;
    int prefix[1] = {20}, n_nodes[1] = {17};
    int32_t hist[20], root[1];
    uint64_t rng = 5;
    for (int i = 0; i < 20; i++) hist[i] = t_rand_int(&rng, V);
    root[0] = t_rand_int(&rng, V);
    kdt_kv_cache *kv = new_cache(m, 4, 1);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, hist, 20, NULL), KDT_OK);
    test_tree tt;
    make_tree(&tt, 1, n_nodes, prefix, root, V, &rng);
    /* take a deep path as the accepted one: the deepest node's ancestors */
    int deepest = 0;
    for (int i = 0; i < n_nodes[0]; i++) if (tt.depth[i] > tt.depth[deepest]) deepest = i;
    int path[40], len = 0;
    for (int j = deepest; j >= 0; j = tt.parent[j]) path[len++] = j;
    int32_t accepted[KDT_MAX_PATH], tau = len;
    for (int i = 0; i < len; i++) accepted[i] = path[len - 1 - i];
    CHECK(tau <= KDT_MAX_PATH);
    CHECK_EQ_INT(kdt_model_verify(m, kv, &tt.t, NULL, NULL), KDT_OK);
    CHECK_EQ_INT(kdt_kv_cache_commit(kv, 1, NULL, accepted, &tau), KDT_OK);
    CHECK_EQ_INT(kdt_kv_stream_length(kv, 0), 20 + tau);
    int32_t bonus = 7;
    float a[96], b[96];
    kdt_model_outputs o = {a, NULL, 0, 0, NULL, NULL};
    CHECK_EQ_INT(kdt_model_decode(m, kv, 1, NULL, &bonus, &o), KDT_OK);
    kdt_kv_cache *ref = new_cache(m, 4, 1);
    CHECK_EQ_INT(kdt_model_prefill(m, ref, 0, hist, 20, NULL), KDT_OK);
    for (int i = 0; i < tau; i++) CHECK_EQ_INT(kdt_model_decode(m, ref, 1, NULL, &tt.token[accepted[i]], NULL), KDT_OK);
    o.logits = b;
    CHECK_EQ_INT(kdt_model_decode(m, ref, 1, NULL, &bonus, &o), KDT_OK);
    CHECK(memcmp(a, b, sizeof a) == 0);
    (void)N;
    /* bad commits are refused */
    int32_t bad_acc[KDT_MAX_PATH] = {1, 2}, two = 2;
    CHECK_EQ_INT(kdt_kv_cache_commit(kv, 1, NULL, bad_acc, &two), KDT_ERR_INVALID_ARG);
    kdt_kv_cache_free(ref);
    kdt_kv_cache_free(kv);
    kdt_model_free(m);
    tm_rmdir(d);
}

/* all logits of a row equal: the fused argmax and the kernel contract pick the lowest id */
static void test_argmax_ties(void) {
    tm_spec s = tm_default_spec();
    char d[600], p[700];
    tm_mkdtemp(d, sizeof d);
    tm_list l = {0};
    tm_build_tensors(&s, &l);
    tm_tensor *head = &l.t[l.n - 1];
    CHECK(strcmp(head->name, "lm_head.weight") == 0);
    for (int v = 1; v < s.vocab; v++) memcpy(head->data + (size_t)v * s.hidden, head->data, (size_t)s.hidden * 4);
    tm_write_config(d, &s);
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    tm_write_safetensors(p, &l, 0, l.n, 0);
    tm_list_free(&l);
    kdt_model *m = NULL;
    kdt_model_options opt = {0, 0, KDT_PREFILL_ABSORBED};
    CHECK_EQ_INT(kdt_model_load(d, &opt, &m), KDT_OK);
    if (m) {
        kdt_kv_cache *kv = new_cache(m, 2, 1);
        int32_t toks[3] = {4, 5, 6}, am[3] = {-1, -1, -1};
        kdt_model_outputs o = {NULL, am, 0, 0, NULL, NULL};
        CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 3, &o), KDT_OK);
        for (int i = 0; i < 3; i++) CHECK_EQ_INT(am[i], 0);
        kdt_kv_cache_free(kv);
    }
    kdt_model_free(m);
    tm_rmdir(d);
}

static void test_bad_inputs(void) {
    tm_spec s = tm_default_spec();
    s.max_pos = 100;
    char d[600];
    kdt_model *m = load_spec(&s, 0, d, sizeof d);
    CHECK(m != NULL);
    if (!m) return;
    kdt_kv_cache *kv = new_cache(m, 2, 2); /* 128 slots in all */
    int32_t toks[120];
    for (int i = 0; i < 120; i++) toks[i] = i % s.vocab;
    int32_t bad[3] = {1, 96, 2};
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, bad, 3, NULL), KDT_ERR_INVALID_ARG);
    CHECK(strstr(kdt_last_error(), "tokens[1] = 96") != NULL);
    bad[1] = -1;
    CHECK_EQ_INT(kdt_model_decode(m, kv, 1, NULL, bad + 1, NULL), KDT_ERR_INVALID_ARG);
    CHECK_EQ_INT(kdt_kv_stream_length(kv, 0), 0);
    CHECK_EQ_INT(kdt_kv_cache_free_pages(kv), 2);
    /* longer than max_position_embeddings */
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 101, NULL), KDT_ERR_CAPACITY);
    CHECK(strstr(kdt_last_error(), "max_position_embeddings") != NULL);
    /* KV pages exhausted: stream 0 takes 70 slots (2 pages), then stream 1 needs one more page */
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 70, NULL), KDT_OK);
    CHECK_EQ_INT(kdt_kv_cache_free_pages(kv), 0);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 1, toks, 3, NULL), KDT_ERR_CAPACITY);
    CHECK(strstr(kdt_last_error(), "exhausted") != NULL);
    CHECK_EQ_INT(kdt_kv_stream_length(kv, 1), 0);
    int32_t two[2] = {0, 1}, tk[2] = {1, 2};
    CHECK_EQ_INT(kdt_model_decode(m, kv, 2, two, tk, NULL), KDT_ERR_CAPACITY);
    CHECK_EQ_INT(kdt_kv_stream_length(kv, 0), 70); /* nothing advanced */
    int32_t dup[2] = {0, 0};
    CHECK_EQ_INT(kdt_model_decode(m, kv, 2, dup, tk, NULL), KDT_ERR_INVALID_ARG);
    CHECK_EQ_INT(kdt_model_decode(m, kv, 1, NULL, tk, NULL), KDT_OK);
    /* release gives the pages back */
    CHECK_EQ_INT(kdt_kv_stream_release(kv, 0), KDT_OK);
    CHECK_EQ_INT(kdt_kv_cache_free_pages(kv), 2);
    /* decode up to max_position_embeddings, then one more is refused */
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 1, toks, 99, NULL), KDT_OK);
    CHECK_EQ_INT(kdt_model_decode(m, kv, 1, &two[1], tk, NULL), KDT_OK);
    CHECK_EQ_INT(kdt_model_decode(m, kv, 1, &two[1], tk, NULL), KDT_ERR_CAPACITY);
    CHECK_EQ_INT(kdt_kv_stream_length(kv, 1), 100);
    /* taps: a layer out of range; a stream out of range */
    int32_t tap = 3;
    float tp[32];
    kdt_model_outputs o = {NULL, NULL, 0, 1, &tap, tp};
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 1, &o), KDT_ERR_INVALID_ARG);
    CHECK(strstr(kdt_last_error(), "tap_layers[0] = 3") != NULL);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 2, toks, 1, NULL), KDT_ERR_INVALID_ARG);
    CHECK_EQ_INT(kdt_kv_stream_set_length(kv, 0, 1), KDT_ERR_INVALID_ARG); /* nothing written */
    kdt_kv_cache_free(kv);

    /* malformed trees: each is refused before anything is written */
    kv = new_cache(m, 2, 1);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 4, NULL), KDT_OK);
    uint64_t rng = 1;
    int n_nodes = 6, prefix = 4;
    int32_t root = 3;
    test_tree tt;
#define BREAK_AND_CHECK(stmt, want, frag)                                     \
    do {                                                                      \
        make_tree(&tt, 1, &n_nodes, &prefix, &root, s.vocab, &rng);           \
        tt.parent[3] = 1; tt.depth[3] = tt.depth[1] + 1; tt.pos[3] = prefix + tt.depth[3]; \
        tt.mask[3] = tt.mask[1] | 8u;                                         \
        for (int i_ = 4; i_ < n_nodes; i_++) {                                \
            tt.parent[i_] = i_ - 1; tt.depth[i_] = tt.depth[i_ - 1] + 1;     \
            tt.pos[i_] = prefix + tt.depth[i_]; tt.mask[i_] = tt.mask[i_ - 1] | (1u << i_); \
        }                                                                     \
        stmt;                                                                 \
        CHECK_EQ_INT(kdt_model_verify(m, kv, &tt.t, NULL, NULL), want);       \
        CHECK_MSG(strstr(kdt_last_error(), frag) != NULL, "%s", kdt_last_error()); \
    } while (0)
    BREAK_AND_CHECK(tt.parent[2] = 2, KDT_ERR_MALFORMED_TREE, "parent");
    BREAK_AND_CHECK(tt.parent[0] = 0, KDT_ERR_MALFORMED_TREE, "parent");
    BREAK_AND_CHECK(tt.depth[4] = 9, KDT_ERR_MALFORMED_TREE, "depth");
    BREAK_AND_CHECK(tt.pos[5] += 1, KDT_ERR_MALFORMED_TREE, "position");
    BREAK_AND_CHECK(tt.pos[0] = 3, KDT_ERR_MALFORMED_TREE, "position");
    BREAK_AND_CHECK(tt.mask[4] |= 32u, KDT_ERR_MALFORMED_TREE, "mask");
    BREAK_AND_CHECK(tt.mask[2] &= ~4ull, KDT_ERR_MALFORMED_TREE, "mask");
    BREAK_AND_CHECK(tt.n_nodes[0] = 0, KDT_ERR_MALFORMED_TREE, "n_nodes");
    BREAK_AND_CHECK(tt.n_nodes[0] = 41, KDT_ERR_MALFORMED_TREE, "n_nodes");
    BREAK_AND_CHECK(tt.token[3] = s.vocab, KDT_ERR_INVALID_ARG, "token");
    BREAK_AND_CHECK(tt.t.anc_mask = NULL, KDT_ERR_INVALID_ARG, "NULL");
    BREAK_AND_CHECK((void)0, KDT_OK, "");
    CHECK_EQ_INT(kdt_kv_stream_length(kv, 0), 4);
    /* a tree whose depth runs past max_position_embeddings */
    kdt_kv_cache_free(kv);
    kv = new_cache(m, 2, 1);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 97, NULL), KDT_OK);
    prefix = 97;
    BREAK_AND_CHECK((void)0, KDT_ERR_CAPACITY, "max_position_embeddings");
#undef BREAK_AND_CHECK
    kdt_kv_cache_free(kv);
    kdt_model_free(m);
    tm_rmdir(d);
}

/* kdt_weight_matvec / kdt_weight_matmul (output rows interleaved in SSE2 / AVX2 tiles, 8 input
 * rows per weight-row read, the input block transposed, columns in stretches of 512) against the
 * plain definition: one accumulator per output, c ascending, product then sum. Bit for bit, for
 * every plain dtype, row counts that are and are not multiples of 8 and 16, sub-ranges [r0, r1),
 * strided X / Y, with the SIMD forms this CPU has and with plain C. */
static float naive_dot(const kdt_weight *w, int64_t r, const float *x) {
    float acc = 0.0f;
    for (int64_t c = 0; c < w->cols; c++) {
        float wc;
        if (w->dtype == KDT_W_F32) wc = ((const float *)w->data)[r * w->cols + c];
        else wc = kdt_bf16_to_f32(((const uint16_t *)w->data)[r * w->cols + c]); /* BF16 */
        acc += wc * x[c];
    }
    return acc;
}
static void matmul_bitwise(int plain) {
    uint64_t seed = 4242;
    static const int64_t shapes[][2] = {{37, 200}, {8, 64}, {3, 513}, {64, 31}, {40, 1030}};
    static const int32_t Rs[] = {1, 2, 7, 8, 9, 12, 17, 33, 137}; /* 137: more blocks than one AVX2 pass holds */
    for (int dt = 0; dt < 2; dt++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int64_t rows = shapes[si][0], cols = shapes[si][1], ldx = cols + 3, ldy = rows + 5;
            void *data = malloc((size_t)(rows * cols) * (dt == 0 ? 4 : 2));
            for (int64_t i = 0; i < rows * cols; i++) {
                const float v = (float)t_rand_normal(&seed);
                if (dt == 0) ((float *)data)[i] = v;
                else ((uint16_t *)data)[i] = kdt_f32_to_bf16(v);
            }
            kdt_weight w;
            memset(&w, 0, sizeof w);
            w.format = KDT_WF_PLAIN, w.dtype = dt == 0 ? KDT_W_F32 : KDT_W_BF16, w.data = data;
            w.rows = rows, w.cols = cols, w.name = "test";
            for (size_t ri = 0; ri < sizeof Rs / sizeof Rs[0]; ri++) {
                const int32_t R = Rs[ri];
                float *X = malloc(sizeof(float) * (size_t)(R * ldx)), *Y = malloc(sizeof(float) * (size_t)(R * ldy));
                for (int64_t i = 0; i < R * ldx; i++) X[i] = (float)t_rand_normal(&seed);
                const int64_t r0 = rows > 4 ? 2 : 0, r1 = rows;
                kdt_weight_matmul(&w, X, ldx, R, Y, ldy, r0, r1);
                int bad = 0;
                float one[64];
                for (int32_t i = 0; i < R; i++) {
                    kdt_weight_matvec(&w, X + i * ldx, one, r0, r1);
                    for (int64_t r = r0; r < r1; r++) {
                        const float want = naive_dot(&w, r, X + i * ldx);
                        bad |= memcmp(&Y[i * ldy + (r - r0)], &want, 4) != 0 || memcmp(&one[r - r0], &want, 4) != 0;
                    }
                }
                CHECK_MSG(!bad, "%s %lld x %lld, R %d%s: matmul / matvec differ from the plain sum", dt ? "bf16" : "f32",
                          (long long)rows, (long long)cols, R, plain ? " (plain C)" : "");
                free(X), free(Y);
            }
            free(data);
        }
}
static void test_matmul_bitwise(void) {
    matmul_bitwise(0); /* the SIMD forms this CPU has */
    kdt_cpu_force_plain(1);
    matmul_bitwise(1); /* plain C */
    kdt_cpu_force_plain(0);
}


/* The CPU threads change no bit: prefill (all rows' logits and taps), a 3-stream decode and a tree
 * verify give the same logits, argmax, taps and KV rows with 1, 2, 3 and 5 threads, every parallel
 * loop split as far as it goes (kdt_parallel_set_min_cost(1)), the model loaded with each count
 * too (its scratch is sized per call), and kdt_weight_matmul over a wide weight likewise. */
typedef struct fwd_run {
    float *logits, *taps, *vlogits, *kv;
    int32_t argmax[3], vargmax[3 * 40];
} fwd_run;

static void run_all_paths(const tm_spec *s, fwd_run *r) {
    char d[600];
    kdt_model *m = load_spec(s, 6, d, sizeof d);
    CHECK(m != NULL);
    if (!m) return;
    const int n = 29, V = s->vocab, S = 3;
    int32_t toks[29], tap_layers[2] = {1, 2}, step[3] = {5, 6, 7}, ids[3] = {0, 1, 2};
    uint64_t rng = 77;
    for (int i = 0; i < n; i++) toks[i] = t_rand_int(&rng, V);
    kdt_kv_cache *kv = new_cache(m, 12, 3);
    kdt_model_outputs o = {r->logits, NULL, 0, 2, tap_layers, r->taps};
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, n, &o), KDT_OK);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 1, toks, 11, NULL), KDT_OK);
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 2, toks + 3, 17, NULL), KDT_OK);
    kdt_model_outputs od = {r->logits + (size_t)n * V, r->argmax, 0, 0, NULL, NULL};
    CHECK_EQ_INT(kdt_model_decode(m, kv, S, ids, step, &od), KDT_OK);
    int n_nodes[3] = {31, 1, 17}, prefix[3] = {n + 1, 12, 18};
    int32_t roots[3] = {1, 2, 3};
    test_tree tt;
    make_tree(&tt, S, n_nodes, prefix, roots, V, &rng);
    kdt_model_outputs ov = {r->vlogits, r->vargmax, 0, 0, NULL, NULL};
    CHECK_EQ_INT(kdt_model_verify(m, kv, &tt.t, ids, &ov), KDT_OK);
    size_t at = 0;
    for (int k = 0; k < S; k++)
        for (int l = 0; l < s->layers; l++)
            for (int t = 0; t < prefix[k] + n_nodes[k]; t++, at += (size_t)kv->row_elems)
                memcpy(r->kv + at, kdt_kv_row(kv, l, k, t), (size_t)kv->row_elems * 4);
    kdt_kv_cache_free(kv);
    kdt_model_free(m);
    tm_rmdir(d);
}

static void test_threads_bitwise(void) {
    tm_spec s = tm_default_spec();
    const size_t V = (size_t)s.vocab, D = (size_t)s.hidden, rows = 29 + 3;
    const size_t kv_floats = (size_t)3 * s.layers * 72 * (size_t)(s.kv_lora + s.rope);
    fwd_run ref, got;
    fwd_run *runs[2] = {&ref, &got};
    memset(&ref, 0, sizeof ref), memset(&got, 0, sizeof got); /* padding rows' argmax stay 0 */
    for (int i = 0; i < 2; i++) {
        runs[i]->logits = calloc(rows * V, 4);
        runs[i]->taps = calloc((size_t)29 * 2 * D, 4);
        runs[i]->vlogits = calloc((size_t)3 * 40 * V, 4);
        runs[i]->kv = calloc(kv_floats, 4);
    }
    kdt_parallel_set_min_cost(1.0);
    CHECK_EQ_INT(kdt_set_cpu_threads(1), KDT_OK);
    run_all_paths(&s, &ref);
    static const int counts[] = {2, 3, 5};
    for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
        CHECK_EQ_INT(kdt_set_cpu_threads(counts[ci]), KDT_OK);
        memset(got.vargmax, 0, sizeof got.vargmax);
        run_all_paths(&s, &got);
        CHECK_MSG(memcmp(ref.logits, got.logits, rows * V * 4) == 0, "%d threads: prefill / decode logits", counts[ci]);
        CHECK_MSG(memcmp(ref.taps, got.taps, (size_t)29 * 2 * D * 4) == 0, "%d threads: taps", counts[ci]);
        CHECK_MSG(memcmp(ref.argmax, got.argmax, sizeof ref.argmax) == 0, "%d threads: decode argmax", counts[ci]);
        CHECK_MSG(memcmp(ref.vlogits, got.vlogits, (size_t)3 * 40 * V * 4) == 0, "%d threads: verify logits", counts[ci]);
        CHECK_MSG(memcmp(ref.vargmax, got.vargmax, sizeof ref.vargmax) == 0, "%d threads: verify argmax", counts[ci]);
        CHECK_MSG(memcmp(ref.kv, got.kv, kv_floats * 4) == 0, "%d threads: KV rows", counts[ci]);
    }
    /* the plain C forms (no SSE2 / AVX2) give the same values too */
    CHECK_EQ_INT(kdt_set_cpu_threads(2), KDT_OK);
    kdt_cpu_force_plain(1);
    run_all_paths(&s, &got);
    kdt_cpu_force_plain(0);
    CHECK_MSG(memcmp(ref.logits, got.logits, rows * V * 4) == 0 && memcmp(ref.vlogits, got.vlogits, (size_t)3 * 40 * V * 4) == 0 &&
                  memcmp(ref.kv, got.kv, kv_floats * 4) == 0 && memcmp(ref.taps, got.taps, (size_t)29 * 2 * D * 4) == 0,
              "plain C forms differ from the SIMD forms");
    /* a weight wide enough to split under the default cost too */
    uint64_t seed = 99;
    const int64_t wr = 301, wc = 257;
    uint16_t *data = malloc((size_t)(wr * wc) * 2);
    for (int64_t i = 0; i < wr * wc; i++) data[i] = kdt_f32_to_bf16((float)t_rand_normal(&seed));
    kdt_weight w;
    memset(&w, 0, sizeof w);
    w.format = KDT_WF_PLAIN, w.dtype = KDT_W_BF16, w.data = data, w.rows = wr, w.cols = wc, w.name = "wide";
    float *X = malloc((size_t)33 * wc * 4), *Y1 = malloc((size_t)33 * wr * 4), *Y3 = malloc((size_t)33 * wr * 4);
    for (int64_t i = 0; i < 33 * wc; i++) X[i] = (float)t_rand_normal(&seed);
    kdt_parallel_set_min_cost(0);
    for (int32_t R = 1; R <= 33; R += 8) {
        CHECK_EQ_INT(kdt_set_cpu_threads(1), KDT_OK);
        kdt_weight_matmul(&w, X, wc, R, Y1, wr, 0, wr);
        CHECK_EQ_INT(kdt_set_cpu_threads(3), KDT_OK);
        kdt_weight_matmul(&w, X, wc, R, Y3, wr, 0, wr);
        CHECK_MSG(memcmp(Y1, Y3, (size_t)R * wr * 4) == 0, "matmul R %d: 1 vs 3 threads", R);
    }
    free(data), free(X), free(Y1), free(Y3);
    CHECK_EQ_INT(kdt_set_cpu_threads(-1), KDT_ERR_INVALID_ARG);
    CHECK_EQ_INT(kdt_set_cpu_threads(100000), KDT_ERR_INVALID_ARG);
    CHECK_EQ_INT(kdt_set_cpu_threads(0), KDT_OK);
    for (int i = 0; i < 2; i++) free(runs[i]->logits), free(runs[i]->taps), free(runs[i]->vlogits), free(runs[i]->kv);
}

int main(void) {
    T_RUN(test_matmul_bitwise);
    T_RUN(test_vs_reference);
    T_RUN(test_random_specs);
    T_RUN(test_prefill_decode_bitwise);
    T_RUN(test_plain_vs_reference);
    T_RUN(test_plain_prefill_chunks);
    T_RUN(test_prefill_many);
    T_RUN(test_prefill_auto);
    T_RUN(test_prefill_chunk_rule);
    T_RUN(test_latent_shift_same_model);
    T_RUN(test_decode_batch_invariance);
    T_RUN(test_verify_equals_decode);
    T_RUN(test_commit_then_decode);
    T_RUN(test_argmax_ties);
    T_RUN(test_bad_inputs);
    T_RUN(test_threads_bitwise);
    return t_summary();
}
#else
int main(void) {
    printf("model subsystem not built (no jansson): skipped\n");
    return t_summary();
}
#endif
