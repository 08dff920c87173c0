/* test_model_fixtures.c - the CPU forward against transformers' own DeepseekV3ForCausalLM:
 * tiny random checkpoints saved by tools/make_model_fixtures.py (transformers 5.17, fp32, eager)
 * in tests/fixtures/models/, with the reference's outputs in expected.json.
 *
 * Tolerances (fp32 on both sides, different summation orders):
 *   RoPE inv_freq, cos/sin amplitude, softmax scale   relative 1e-6
 *   logits (first 64 vocab ids, every position)       max |err| <= 1e-4 * max |logit| per prompt
 *   decoder-layer outputs (HF hidden_states[i+1])     max |err| <= 1e-4 * max |value|
 *   argmax per position (full vocabulary)             exact where the reference's top-2 gap >= 1e-3
 *   greedy continuations (24 tokens, through the KV cache, fused argmax)   exact, unless the
 *                                                     reference's smallest top-2 gap on that
 *                                                     path is below 1e-3 (reported, not failed)
 * kimi_tiny_published holds kimi_tiny's weights as BF16 with the "language_model." prefix and a
 * K2.5-style config (text_config wrapper, rope_theta + rope_scaling): it must give exactly the
 * same results as kimi_tiny. */
#include "t.h"

#ifdef KDT_WITH_MODEL
#include "kdtree/model.h"
#include "model/model_internal.h"

#include <jansson.h>
#include <string.h>

#define FIXTURES KDT_SOURCE_DIR "/tests/fixtures/models"

static int fixtures_present(void) {
    FILE *f = fopen(FIXTURES "/kimi_tiny/expected.json", "rb");
    if (f) fclose(f);
    return f != NULL;
}

static kdt_model *load(const char *name) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", FIXTURES, name);
    kdt_model *m = NULL;
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    if (kdt_model_load(dir, &o, &m) != KDT_OK) fprintf(stderr, "  %s: %s\n", name, kdt_last_error());
    return m;
}

static json_t *load_expected(const char *name) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s/expected.json", FIXTURES, name);
    json_error_t e;
    json_t *j = json_load_file(p, 0, &e);
    if (!j) fprintf(stderr, "  %s: %s\n", p, e.text);
    return j;
}

static double num(json_t *a, size_t i) { return json_number_value(json_array_get(a, i)); }

static void check_meta(const kdt_model *m, json_t *meta, const char *name) {
    const kdt_model_config *c = kdt_model_get_config(m);
    double ss = json_number_value(json_object_get(meta, "softmax_scale"));
    double af = json_number_value(json_object_get(meta, "rope_attention_scaling"));
    CHECK_MSG(fabs(c->softmax_scale - ss) <= 1e-6 * ss, "%s: softmax_scale %.9g vs %.9g", name, c->softmax_scale, ss);
    CHECK_MSG(fabs(c->rope_attention_factor - af) <= 1e-6 * af, "%s: rope attention factor %.9g vs %.9g", name,
              c->rope_attention_factor, af);
    json_t *inv = json_object_get(meta, "rope_inv_freq");
    CHECK_EQ_INT(json_array_size(inv), c->qk_rope_head_dim / 2);
    for (size_t i = 0; i < json_array_size(inv) && (int)i < c->qk_rope_head_dim / 2; i++)
        CHECK_MSG(fabs(m->rope_inv_freq[i] - num(inv, i)) <= 1e-6 * num(inv, i), "%s: inv_freq[%zu] %.9g vs %.9g",
                  name, i, m->rope_inv_freq[i], num(inv, i));
    json_t *dense = json_object_get(meta, "dense_layers");
    for (int l = 0; l < c->n_layers; l++) {
        int is_dense = 0;
        for (size_t i = 0; i < json_array_size(dense); i++) is_dense |= (int)num(dense, i) == l;
        CHECK_EQ_INT(m->layers[l].is_moe, !is_dense);
    }
}

/* Runs every prompt of expected.json; the logits of all prompts are appended to *all_logits
 * (for comparing two checkpoints of one model bitwise). */
static void check_prompts(const kdt_model *m, json_t *exp, const char *name, float **all_logits, size_t *n_all) {
    const kdt_model_config *c = kdt_model_get_config(m);
    const int V = c->vocab_size, D = c->hidden_size, NL = c->n_layers;
    const int slice = (int)json_integer_value(json_object_get(json_object_get(exp, "meta"), "logit_slice"));
    json_t *prompts = json_object_get(exp, "prompts");
    CHECK(json_array_size(prompts) >= 3);
    size_t pi;
    json_t *p;
    json_array_foreach(prompts, pi, p) {
        json_t *jt = json_object_get(p, "tokens"), *jl = json_object_get(p, "logits_first"),
               *ja = json_object_get(p, "argmax"), *jg = json_object_get(p, "top2_gap"),
               *jlo = json_object_get(p, "layer_out"), *jgr = json_object_get(p, "greedy");
        const int n = (int)json_array_size(jt);
        int32_t *toks = malloc((size_t)n * 4), *am = malloc((size_t)n * 4), tap_layers[64];
        float *logits = malloc((size_t)n * V * 4), *taps = malloc((size_t)n * NL * D * 4);
        for (int i = 0; i < n; i++) toks[i] = (int32_t)num(jt, (size_t)i);
        for (int l = 0; l < NL; l++) tap_layers[l] = l;
        kdt_kv_cache_options ko = {2, 1, 0};
        kdt_kv_cache *kv = NULL;
        CHECK_EQ_INT(kdt_kv_cache_create(m, &ko, &kv), KDT_OK);
        kdt_model_outputs out = {logits, am, 0, NL, tap_layers, taps};
        CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, n, &out), KDT_OK);

        double max_err = 0, max_ref = 0;
        int argmax_bad = 0;
        for (int t = 0; t < n; t++) {
            json_t *row = json_array_get(jl, (size_t)t);
            for (int v = 0; v < slice; v++) {
                double r = num(row, (size_t)v), e = fabs(logits[(size_t)t * V + v] - r);
                max_err = e > max_err ? e : max_err;
                max_ref = fabs(r) > max_ref ? fabs(r) : max_ref;
            }
            if (am[t] != (int32_t)num(ja, (size_t)t) && num(jg, (size_t)t) >= 1e-3) argmax_bad++;
        }
        CHECK_MSG(max_err <= 1e-4 * max_ref, "%s prompt %zu: max |logit err| %.3g of max |logit| %.3g", name, pi,
                  max_err, max_ref);
        CHECK_MSG(argmax_bad == 0, "%s prompt %zu: %d positions with a different argmax", name, pi, argmax_bad);
        if (jlo) {
            double terr = 0, tref = 0;
            CHECK_EQ_INT(json_array_size(jlo), NL);
            for (int l = 0; l < NL; l++)
                for (int t = 0; t < n; t++)
                    for (int d = 0; d < D; d++) {
                        double r = num(json_array_get(json_array_get(jlo, (size_t)l), (size_t)t), (size_t)d);
                        double e = fabs(taps[((size_t)t * NL + l) * D + d] - r);
                        terr = e > terr ? e : terr;
                        tref = fabs(r) > tref ? fabs(r) : tref;
                    }
            CHECK_MSG(terr <= 1e-4 * tref, "%s prompt %zu: layer outputs max |err| %.3g of %.3g", name, pi, terr, tref);
        }
        /* greedy continuation through the cache, argmax only */
        int32_t tok = am[n - 1];
        int diverged = -1;
        const int n_new = (int)json_array_size(jgr);
        for (int k = 0; k < n_new; k++) {
            if (tok != (int32_t)num(jgr, (size_t)k)) {
                diverged = k;
                break;
            }
            kdt_model_outputs og = {NULL, &tok, 0, 0, NULL, NULL};
            int32_t in = tok;
            CHECK_EQ_INT(kdt_model_decode(m, kv, 1, NULL, &in, &og), KDT_OK);
        }
        double min_gap = json_number_value(json_object_get(p, "greedy_min_gap"));
        if (diverged >= 0 && min_gap < 1e-3)
            printf("  note: %s prompt %zu: greedy differs at step %d where the reference path has a top-2 gap of "
                   "%.3g (below fp32 reproducibility; not a failure)\n", name, pi, diverged, min_gap);
        else
            CHECK_MSG(diverged < 0, "%s prompt %zu: greedy continuation differs at step %d", name, pi, diverged);
        printf("  %-20s prompt %zu (%2d tokens): max |logit err| %.2g of %.2g, greedy %s\n", name, pi, n, max_err,
               max_ref, diverged < 0 ? "identical" : "near-tie divergence");
        if (all_logits) {
            *all_logits = realloc(*all_logits, (*n_all + (size_t)n * V) * 4);
            memcpy(*all_logits + *n_all, logits, (size_t)n * V * 4);
            *n_all += (size_t)n * V;
        }
        kdt_kv_cache_free(kv);
        free(toks); free(am); free(logits); free(taps);
    }
}

static void run_fixture(const char *name, const char *expected_from, float **all, size_t *n_all) {
    kdt_model *m = load(name);
    json_t *exp = load_expected(expected_from);
    CHECK(m && exp);
    if (m && exp) {
        check_meta(m, json_object_get(exp, "meta"), name);
        check_prompts(m, exp, name, all, n_all);
    }
    json_decref(exp);
    kdt_model_free(m);
}

static void test_dsv3_tiny(void) { run_fixture("dsv3_tiny", "dsv3_tiny", NULL, NULL); }
static void test_nolora_tiny(void) { run_fixture("nolora_tiny", "nolora_tiny", NULL, NULL); }

static void test_kimi_tiny_and_published(void) {
    float *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    run_fixture("kimi_tiny", "kimi_tiny", &a, &na);
    run_fixture("kimi_tiny_published", "kimi_tiny", &b, &nb);
    CHECK(na == nb && na > 0 && memcmp(a, b, na * 4) == 0);
    kdt_model *p = load("kimi_tiny_published");
    if (p) {
        CHECK(strcmp(p->prefix, "language_model.") == 0);
        CHECK(strcmp(kdt_model_weight_dtype(p), "BF16") == 0);
        CHECK(strcmp(kdt_model_get_config(p)->model_type, "kimi_k2") == 0);
    }
    kdt_model_free(p);
    free(a);
    free(b);
}

int main(void) {
    if (!fixtures_present()) {
        printf("tests/fixtures/models not present: skipped (run tools/make_model_fixtures.py)\n");
        return t_summary();
    }
    T_RUN(test_dsv3_tiny);
    T_RUN(test_kimi_tiny_and_published);
    T_RUN(test_nolora_tiny);
    return t_summary();
}
#else
int main(void) {
    printf("model subsystem not built (no jansson): skipped\n");
    return t_summary();
}
#endif
