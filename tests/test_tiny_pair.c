/* test_tiny_pair.c - the bundled tiny pair (models/tiny-target + models/tiny-dflash) against the
 * reference values its training scripts computed with PyTorch (tools/tiny/stage_b.py, float32
 * from the bf16 checkpoints): the target's greedy continuation, the tapped hidden states, the
 * drafter's top-8 log-probs at every block position, and the DDTree (B = 8) built from them.
 * This is the cross-check that the C engine runs the same drafter the scripts trained.
 * Tolerances: taps 1e-4 relative (fp32 vs fp32, different summation order), draft log-probs
 * 2e-3 absolute; ids and trees exact.
 */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/engine/dflash.h"
#include "kdtree/kernels.h"
#include "kdtree/model.h"
#include "t.h"

#define TARGET KDT_SOURCE_DIR "/models/tiny-target"
#define DRAFT KDT_SOURCE_DIR "/models/tiny-dflash"
#define FIXTURE KDT_SOURCE_DIR "/tests/fixtures/tiny_pair/dflash_expected.json"

static kdt_model *model;
static kdt_dflash *draft;
static json_t *fx;

static int32_t *ids_of(json_t *a, int32_t *n) {
    *n = (int32_t)json_array_size(a);
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(*n ? *n : 1));
    for (int32_t i = 0; i < *n; i++) v[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return v;
}

static kdt_kv_cache *new_cache(void) {
    kdt_kv_cache_options o = {64, 1, 0};
    kdt_kv_cache *c = NULL;
    CHECK_EQ_INT(kdt_kv_cache_create(model, &o, &c), KDT_OK);
    return c;
}

/* The target's greedy continuation equals PyTorch's, token for token. */
static void test_target_greedy(void) {
    json_t *cases = json_object_get(fx, "cases");
    CHECK(json_array_size(cases) > 0);
    for (size_t ci = 0; ci < json_array_size(cases); ci++) {
        json_t *c = json_array_get(cases, ci);
        int32_t n, ng;
        int32_t *prompt = ids_of(json_object_get(c, "prompt_ids"), &n);
        int32_t *greedy = ids_of(json_object_get(c, "greedy_ids"), &ng);
        kdt_kv_cache *kv = new_cache();
        int32_t tok = -1;
        kdt_model_outputs out = {0};
        out.argmax = &tok;
        out.last_only = 1;
        CHECK_EQ_INT(kdt_model_prefill(model, kv, 0, prompt, n, &out), KDT_OK);
        int32_t same = 0;
        for (int32_t i = 0; i < ng; i++) {
            if (tok != greedy[i]) break;
            same++;
            int32_t next = -1;
            kdt_model_outputs o2 = {0};
            o2.argmax = &next;
            CHECK_EQ_INT(kdt_model_decode(model, kv, 1, NULL, &tok, &o2), KDT_OK);
            tok = next;
        }
        CHECK_MSG(same == ng, "case %zu: greedy matches for %d of %d tokens", ci, same, ng);
        free(prompt);
        free(greedy);
        kdt_kv_cache_free(kv);
    }
}

/* Taps, drafter top-8 and the B = 8 DDTree of every recorded round. */
static void test_draft_rounds(void) {
    const kdt_model_config *mc = kdt_model_get_config(model);
    const kdt_dflash_config *dc = kdt_dflash_get_config(draft);
    const int32_t D = mc->hidden_size, V = mc->vocab_size, L = dc->block_size - 1, T = dc->n_taps;
    json_t *cases = json_object_get(fx, "cases");
    int rounds = 0;
    for (size_t ci = 0; ci < json_array_size(cases); ci++) {
        json_t *rs = json_object_get(json_array_get(cases, ci), "rounds");
        for (size_t ri = 0; ri < json_array_size(rs); ri++, rounds++) {
            json_t *r = json_array_get(rs, ri);
            int32_t n;
            int32_t *ctx_ids = ids_of(json_object_get(r, "context_ids"), &n);
            const int32_t anchor = (int32_t)json_integer_value(json_object_get(r, "anchor_id"));
            CHECK_EQ_INT(json_integer_value(json_object_get(r, "anchor_pos")), n);
            kdt_kv_cache *kv = new_cache();
            float *taps = malloc(sizeof(float) * (size_t)n * (size_t)T * (size_t)D);
            kdt_model_outputs out = {0};
            out.n_taps = T;
            out.tap_layers = dc->tap_layers;
            out.taps = taps;
            CHECK_EQ_INT(kdt_model_prefill(model, kv, 0, ctx_ids, n, &out), KDT_OK);
            /* taps of the last context position vs the reference */
            json_t *ref = json_object_get(r, "taps_last_context_position");
            CHECK_EQ_INT(json_array_size(ref), (size_t)T * (size_t)D);
            double num = 0, den = 0;
            for (int32_t i = 0; i < T * D; i++) {
                const double a = taps[(size_t)(n - 1) * T * D + i];
                const double b = json_real_value(json_array_get(ref, (size_t)i));
                num += (a - b) * (a - b);
                den += b * b;
            }
            CHECK_MSG(sqrt(num / den) < 1e-4, "round %d: taps rel err %.3g", rounds, sqrt(num / den));
            /* drafter */
            kdt_dflash_ctx *ctx = NULL;
            CHECK_EQ_INT(kdt_dflash_ctx_create(draft, n + 16, &ctx), KDT_OK);
            CHECK_EQ_INT(kdt_dflash_ctx_append(draft, ctx, taps, n), KDT_OK);
            float *logits = malloc(sizeof(float) * (size_t)L * (size_t)V);
            CHECK_EQ_INT(kdt_dflash_draft(draft, &ctx, 1, &anchor, logits), KDT_OK);
            const int32_t K = 8;
            int32_t top_ids[16 * 8];
            float top_lp[16 * 8];
            kdt_topk_params tp = {L, V, K, KDT_F32, logits, V, top_ids, top_lp, NULL, 0};
            CHECK_EQ_INT(kdt_topk_logsoftmax_cpu(&tp), KDT_OK);
            json_t *rid = json_object_get(r, "draft_top8_ids"), *rlp = json_object_get(r, "draft_top8_logprobs");
            int id_mismatch = 0;
            double worst = 0;
            for (int32_t d = 0; d < L; d++)
                for (int32_t k = 0; k < K; k++) {
                    const int32_t want = (int32_t)json_integer_value(json_array_get(json_array_get(rid, (size_t)d), (size_t)k));
                    const double wlp = json_real_value(json_array_get(json_array_get(rlp, (size_t)d), (size_t)k));
                    const double e = fabs(top_lp[d * K + k] - wlp);
                    if (e > worst) worst = e;
                    /* ids must agree except where neighbours are tied within the tolerance */
                    if (top_ids[d * K + k] != want) {
                        const double prev = k > 0 ? json_real_value(json_array_get(json_array_get(rlp, (size_t)d), (size_t)k - 1)) : 1e9;
                        const double next = k + 1 < K ? json_real_value(json_array_get(json_array_get(rlp, (size_t)d), (size_t)k + 1)) : -1e9;
                        if (prev - wlp > 2e-3 && wlp - next > 2e-3) id_mismatch++;
                    }
                }
            CHECK_MSG(id_mismatch == 0, "round %d: %d draft ids differ", rounds, id_mismatch);
            CHECK_MSG(worst < 2e-3, "round %d: worst draft log-prob error %.3g", rounds, worst);
            /* DDTree B = 8 from the drafter's own top-8 */
            const int32_t B = 8, N = B + 1;
            int32_t nn, tok[9], par[9], dep[9], fc[9], ns[9], pos[9];
            float sc[9];
            uint64_t mask[9];
            kdt_tree tree = {1, N, &nn, tok, par, dep, fc, ns, pos, sc, mask};
            const int32_t zero = 0;
            kdt_tree_build_params bp = {1, L, K, top_ids, top_lp, &L, &B, &anchor, &zero, 0};
            CHECK_EQ_INT(kdt_tree_build_cpu(&bp, &tree), KDT_OK);
            json_t *want = json_object_get(r, "ddtree_b8");
            int32_t nt, np, nd;
            int32_t *wt = ids_of(json_object_get(want, "tokens"), &nt);
            int32_t *wp = ids_of(json_object_get(want, "parents"), &np);
            int32_t *wd = ids_of(json_object_get(want, "depths"), &nd);
            CHECK_EQ_INT(nn, N);
            int tree_same = nt == B && np == N && nd == N;
            for (int32_t i = 1; tree_same && i < N; i++)
                tree_same = tok[i] == wt[i - 1] && par[i] == wp[i] && dep[i] == wd[i];
            CHECK_MSG(tree_same, "round %d: DDTree B=8 differs from the reference", rounds);
            free(wt);
            free(wp);
            free(wd);
            free(logits);
            kdt_dflash_ctx_free(ctx);
            free(taps);
            kdt_kv_cache_free(kv);
            free(ctx_ids);
        }
    }
    CHECK(rounds > 0);
}

int main(void) {
    json_error_t err;
    fx = json_load_file(FIXTURE, 0, &err);
    kdt_model_options mo = {0, 0, KDT_PREFILL_ABSORBED};
    if (!fx || kdt_model_load(TARGET, &mo, &model) != KDT_OK ||
        kdt_dflash_load(DRAFT, model, NULL, &draft) != KDT_OK) {
        fprintf(stderr, "cannot load the tiny pair or its fixture: %s / %s\n", err.text, kdt_last_error());
        return 1;
    }
    T_RUN(test_target_greedy);
    T_RUN(test_draft_rounds);
    kdt_dflash_free(draft);
    kdt_model_free(model);
    json_decref(fx);
    return t_summary();
}
