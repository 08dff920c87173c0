/* test_dflash.c - the DFlash drafter: forward against an fp64 reference written from the
 * research notes' dataflow (§3.1), context-cache lifecycle (§3.4: incremental appends equal one
 * append, block K/V never persist, batching changes nothing), RoPE tables against the model's
 * own YaRN code, load-time validation (clear errors; 300 random config corruptions), and the
 * engine end to end with a real (random) DFlash drafter: chain / ddtree / auto greedy output
 * equals plain greedy decoding.
 * Target: tests/fixtures/models/kimi_tiny (hidden 64, vocab 320, 2 layers).
 */
#ifdef KDT_WITH_MODEL /* the engine is built with the model (jansson) */
#include "t_mutate.h"
#include "engine_test_util.h"

#include "engine/dflash.h"
#include "model/model_internal.h"

static kdt_model *g_target;
static char g_tmp[256];

/* ---- fp64 reference --------------------------------------------------------------------------- */
static void ref_rmsnorm(const double *x, const float *w, int n, double eps, double *y) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * x[i] * inv;
}

static void ref_matvec(const float *w, int rows, int cols, const double *x, double *y) {
    for (int r = 0; r < rows; r++) {
        double a = 0;
        for (int c = 0; c < cols; c++) a += (double)w[(size_t)r * cols + c] * x[c];
        y[r] = a;
    }
}

static void ref_rope(double *x, int hd, const float *inv_freq, long pos, double amp) {
    for (int i = 0; i < hd / 2; i++) {
        double ang = (double)(float)((float)pos * inv_freq[i]);
        double cs = cos(ang) * amp, sn = sin(ang) * amp, a = x[i], b = x[i + hd / 2];
        x[i] = a * cs - b * sn;
        x[i + hd / 2] = b * cs + a * sn;
    }
}

static const float *W(const tm_list *l, const char *fmt, int layer) {
    char n[128];
    snprintf(n, sizeof n, fmt, layer);
    const float *p = et_find(l, n);
    if (!p) {
        fprintf(stderr, "missing %s\n", n);
        exit(1);
    }
    return p;
}

/* logits [L][V] of one draft call: context features feat [P][n_taps*D], anchor at position P */
static void ref_draft(const et_dflash_spec *s, const tm_list *l, const float *inv_freq, double amp,
                      const float *feat, int P, int anchor, double *logits) {
    const int D = s->hidden, H = s->heads, KV = s->kv_heads, hd = s->head_dim, T = s->block_size,
              I = s->inter, V = s->vocab, nt = s->n_taps, grp = H / KV;
    const double eps = 1e-6;
    double *kc = calloc((size_t)s->layers * (P + T) * KV * hd, sizeof(double));
    double *vc = calloc((size_t)s->layers * (P + T) * KV * hd, sizeof(double));
    double *tmp = calloc((size_t)(nt * D + I + D), sizeof(double)), *c = calloc((size_t)D, sizeof(double));
#define KC(layer, j) (kc + ((size_t)(layer) * (P + T) + (j)) * KV * hd)
#define VC(layer, j) (vc + ((size_t)(layer) * (P + T) + (j)) * KV * hd)
    for (int p = 0; p < P; p++) {
        double *f = calloc((size_t)nt * D, sizeof(double));
        for (int i = 0; i < nt * D; i++) f[i] = feat[(size_t)p * nt * D + i];
        ref_matvec(et_find(l, "fc.weight"), D, nt * D, f, tmp);
        ref_rmsnorm(tmp, et_find(l, "hidden_norm.weight"), D, eps, c);
        free(f);
        for (int L = 0; L < s->layers; L++) {
            ref_matvec(W(l, "layers.%d.self_attn.k_proj.weight", L), KV * hd, D, c, KC(L, p));
            ref_matvec(W(l, "layers.%d.self_attn.v_proj.weight", L), KV * hd, D, c, VC(L, p));
            for (int g = 0; g < KV; g++) {
                double hn[64];
                ref_rmsnorm(KC(L, p) + g * hd, W(l, "layers.%d.self_attn.k_norm.weight", L), hd, eps, hn);
                memcpy(KC(L, p) + g * hd, hn, sizeof(double) * hd);
                ref_rope(KC(L, p) + g * hd, hd, inv_freq, p, amp);
            }
        }
    }
    double *x = calloc((size_t)T * D, sizeof(double)), *h = calloc((size_t)T * D, sizeof(double));
    double *q = calloc((size_t)T * H * hd, sizeof(double)), *att = calloc((size_t)T * H * hd, sizeof(double));
    float *row = malloc(sizeof(float) * D);
    for (int t = 0; t < T; t++) {
        kdt_weight_row_f32(&g_target->embed, t == 0 ? anchor : s->mask_id, row);
        for (int i = 0; i < D; i++) x[t * D + i] = row[i];
    }
    for (int L = 0; L < s->layers; L++) {
        for (int t = 0; t < T; t++) {
            ref_rmsnorm(x + t * D, W(l, "layers.%d.input_layernorm.weight", L), D, eps, h + t * D);
            ref_matvec(W(l, "layers.%d.self_attn.q_proj.weight", L), H * hd, D, h + t * D, q + t * H * hd);
            ref_matvec(W(l, "layers.%d.self_attn.k_proj.weight", L), KV * hd, D, h + t * D, KC(L, P + t));
            ref_matvec(W(l, "layers.%d.self_attn.v_proj.weight", L), KV * hd, D, h + t * D, VC(L, P + t));
            double hn[64];
            for (int hh = 0; hh < H; hh++) {
                ref_rmsnorm(q + (t * H + hh) * hd, W(l, "layers.%d.self_attn.q_norm.weight", L), hd, eps, hn);
                memcpy(q + (t * H + hh) * hd, hn, sizeof(double) * hd);
                ref_rope(q + (t * H + hh) * hd, hd, inv_freq, P + t, amp);
            }
            for (int g = 0; g < KV; g++) {
                ref_rmsnorm(KC(L, P + t) + g * hd, W(l, "layers.%d.self_attn.k_norm.weight", L), hd, eps, hn);
                memcpy(KC(L, P + t) + g * hd, hn, sizeof(double) * hd);
                ref_rope(KC(L, P + t) + g * hd, hd, inv_freq, P + t, amp);
            }
        }
        for (int t = 0; t < T; t++)
            for (int hh = 0; hh < H; hh++) {
                const int g = hh / grp;
                double sc[512], mx = -1e300, sum = 0;
                for (int j = 0; j < P + T; j++) {
                    double a = 0;
                    for (int e = 0; e < hd; e++) a += q[(t * H + hh) * hd + e] * KC(L, j)[g * hd + e];
                    sc[j] = a / sqrt((double)hd);
                    if (sc[j] > mx) mx = sc[j];
                }
                for (int j = 0; j < P + T; j++) sum += (sc[j] = exp(sc[j] - mx));
                for (int e = 0; e < hd; e++) {
                    double a = 0;
                    for (int j = 0; j < P + T; j++) a += sc[j] / sum * VC(L, j)[g * hd + e];
                    att[(t * H + hh) * hd + e] = a;
                }
            }
        for (int t = 0; t < T; t++) {
            ref_matvec(W(l, "layers.%d.self_attn.o_proj.weight", L), D, H * hd, att + t * H * hd, tmp);
            for (int i = 0; i < D; i++) x[t * D + i] += tmp[i];
            ref_rmsnorm(x + t * D, W(l, "layers.%d.post_attention_layernorm.weight", L), D, eps, h + t * D);
            double *ga = tmp, *up = tmp + I;
            ref_matvec(W(l, "layers.%d.mlp.gate_proj.weight", L), I, D, h + t * D, ga);
            ref_matvec(W(l, "layers.%d.mlp.up_proj.weight", L), I, D, h + t * D, up);
            for (int i = 0; i < I; i++) ga[i] = ga[i] / (1 + exp(-ga[i])) * up[i];
            double *dn = calloc((size_t)D, sizeof(double));
            ref_matvec(W(l, "layers.%d.mlp.down_proj.weight", L), D, I, ga, dn);
            for (int i = 0; i < D; i++) x[t * D + i] += dn[i];
            free(dn);
        }
    }
    for (int t = 1; t < T; t++) {
        ref_rmsnorm(x + t * D, et_find(l, "norm.weight"), D, eps, h);
        for (int v = 0; v < V; v++) {
            kdt_weight_row_f32(&g_target->lm_head, v, row);
            double a = 0;
            for (int i = 0; i < D; i++) a += (double)row[i] * h[i];
            logits[(size_t)(t - 1) * V + v] = a;
        }
    }
#undef KC
#undef VC
    free(kc); free(vc); free(tmp); free(c); free(x); free(h); free(q); free(att); free(row);
}

static float *random_feat(int P, int width, uint64_t seed) {
    float *f = malloc(sizeof(float) * (size_t)P * width);
    for (int i = 0; i < P * width; i++) f[i] = (float)t_rand_normal(&seed);
    return f;
}

static void check_forward(int yarn, int legacy, int max_pos) {
    et_dflash_spec s = et_dflash_default(64, 320);
    s.yarn = yarn;
    s.max_pos = max_pos;
    s.theta = yarn ? 50000.0 : 10000.0;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/fwd_%d_%d_%d", g_tmp, yarn, legacy, max_pos);
    tm_list l;
    et_dflash_write(dir, &s, &l);
    kdt_dflash_options o = {legacy ? KDT_YARN_AMP_LEGACY : KDT_YARN_AMP_HF, 0};
    kdt_dflash *d = NULL;
    kdt_status st = kdt_dflash_load(dir, g_target, &o, &d);
    CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
    if (st != KDT_OK) return;
    const kdt_dflash_config *c = kdt_dflash_get_config(d);
    CHECK_EQ_INT(c->block_size, 5);
    CHECK_EQ_INT(c->n_taps, 2);
    double amp = legacy ? 0.1 * log(4.0) + 1.0 : 1.0;
    CHECK_NEAR(c->rope_attention_factor, amp, 1e-6);
    float inv[32];
    kdt_dflash_rope_inv_freq(c, inv);
    const int P = 13, L = 4, V = 320, width = 2 * 64;
    float *feat = random_feat(P, width, 5 + yarn);
    kdt_dflash_ctx *ctx = NULL;
    CHECK(kdt_dflash_ctx_create(d, 100, &ctx) == KDT_OK);
    CHECK(kdt_dflash_ctx_append(d, ctx, feat, P) == KDT_OK);
    float *lg = malloc(sizeof(float) * L * V);
    CHECK(kdt_dflash_draft(d, &ctx, 1, (const int32_t[]){17}, lg) == KDT_OK);
    double *ref = malloc(sizeof(double) * L * V), *got = malloc(sizeof(double) * L * V);
    ref_draft(&s, &l, inv, amp, feat, P, 17, ref);
    for (int i = 0; i < L * V; i++) got[i] = lg[i];
    double err = t_rel_err(got, ref, (size_t)L * V);
    if (err > 2e-5) printf("  got %g %g ref %g %g\n", got[0], got[1], ref[0], ref[1]);
    printf("  forward (yarn %d, legacy %d%s): rel err %.2e\n", yarn, legacy,
           max_pos ? ", block past max_position_embeddings" : "", err);
    CHECK(err < 2e-5);
    free(ref); free(got); free(lg); free(feat);
    kdt_dflash_ctx_free(ctx);
    kdt_dflash_free(d);
    tm_list_free(&l);
}

static void test_forward_vs_fp64(void) {
    check_forward(0, 0, 0);
    check_forward(1, 0, 0);
    check_forward(1, 1, 0);
    /* context 13 and block positions 13..17 past a window of 8: RoPE extrapolated, as transformers
     * does (a short-window drafter keeps drafting for a long context) */
    check_forward(0, 0, 8);
    check_forward(1, 0, 8);
}

/* The YaRN table agrees bit for bit with the model subsystem's (independently written) one. */
static void test_rope_table_matches_model(void) {
    kdt_dflash_config c;
    memset(&c, 0, sizeof c);
    c.head_dim = 128;
    c.rope_yarn = 1;
    c.rope_theta = 50000.0;
    c.rope_factor = 64.0;
    c.rope_beta_fast = 32.0;
    c.rope_beta_slow = 1.0;
    c.rope_original_max_position = 4096;
    kdt_model_config mc;
    memset(&mc, 0, sizeof mc);
    mc.qk_rope_head_dim = 128;
    mc.rope_kind = KDT_ROPE_YARN;
    mc.rope_theta = 50000.0;
    mc.rope_factor = 64.0;
    mc.rope_beta_fast = 32.0;
    mc.rope_beta_slow = 1.0;
    mc.rope_original_max_position = 4096;
    float a[64], b[64];
    kdt_dflash_rope_inv_freq(&c, a);
    kdt_rope_inv_freq(&mc, b);
    for (int i = 0; i < 64; i++) CHECK_MSG(a[i] == b[i], "yarn inv_freq[%d]: %g vs %g", i, a[i], b[i]);
    c.rope_yarn = 0;
    mc.rope_kind = KDT_ROPE_DEFAULT;
    kdt_dflash_rope_inv_freq(&c, a);
    kdt_rope_inv_freq(&mc, b);
    for (int i = 0; i < 64; i++) CHECK_MSG(a[i] == b[i], "default inv_freq[%d]", i);
}

/* §3.4: context K/V computed once per position, block K/V never persist, batching is invisible */
static void test_context_lifecycle(void) {
    et_dflash_spec s = et_dflash_default(64, 320);
    char dir[300];
    snprintf(dir, sizeof dir, "%s/life", g_tmp);
    et_dflash_write(dir, &s, NULL);
    kdt_dflash *d = NULL;
    CHECK(kdt_dflash_load(dir, g_target, NULL, &d) == KDT_OK);
    if (!d) return;
    const int P = 70, L = 4, V = 320, width = 128; /* 70 > 64: the cache grows past one chunk */
    float *feat = random_feat(P, width, 11);
    kdt_dflash_ctx *one = NULL, *inc = NULL, *other = NULL;
    CHECK(kdt_dflash_ctx_create(d, 128, &one) == KDT_OK);
    CHECK(kdt_dflash_ctx_create(d, 128, &inc) == KDT_OK);
    CHECK(kdt_dflash_ctx_create(d, 128, &other) == KDT_OK);
    CHECK(kdt_dflash_ctx_append(d, one, feat, P) == KDT_OK);
    int pos = 0, step = 1;
    while (pos < P) {
        int n = P - pos < step ? P - pos : step;
        CHECK(kdt_dflash_ctx_append(d, inc, feat + (size_t)pos * width, n) == KDT_OK);
        pos += n;
        step = step % 7 + 1;
    }
    CHECK(kdt_dflash_ctx_append(d, other, feat, 9) == KDT_OK);
    float *a = malloc(sizeof(float) * L * V), *b = malloc(sizeof(float) * L * V);
    float *batch = malloc(sizeof(float) * 3 * L * V);
    CHECK(kdt_dflash_draft(d, &one, 1, (const int32_t[]){5}, a) == KDT_OK);
    CHECK(kdt_dflash_draft(d, &inc, 1, (const int32_t[]){5}, b) == KDT_OK);
    CHECK(memcmp(a, b, sizeof(float) * L * V) == 0);
    CHECK_EQ_INT(kdt_dflash_ctx_length(one), P); /* the block did not stay */
    CHECK(kdt_dflash_draft(d, &one, 1, (const int32_t[]){5}, b) == KDT_OK);
    CHECK(memcmp(a, b, sizeof(float) * L * V) == 0);
    kdt_dflash_ctx *three[3] = {other, one, other};
    CHECK(kdt_dflash_draft(d, three, 3, (const int32_t[]){9, 5, 9}, batch) == KDT_OK);
    CHECK(memcmp(batch + L * V, a, sizeof(float) * L * V) == 0);
    CHECK(memcmp(batch, batch + 2 * L * V, sizeof(float) * L * V) == 0);
    /* capacity and bad anchors */
    kdt_dflash_ctx *small = NULL;
    CHECK(kdt_dflash_ctx_create(d, 4, &small) == KDT_OK);
    CHECK(kdt_dflash_ctx_append(d, small, feat, 5) == KDT_ERR_CAPACITY);
    CHECK_EQ_INT(kdt_dflash_ctx_length(small), 0);
    CHECK(kdt_dflash_draft(d, &one, 1, (const int32_t[]){320}, a) == KDT_ERR_INVALID_ARG);
    kdt_dflash_ctx_free(small);
    free(a); free(b); free(batch); free(feat);
    kdt_dflash_ctx_free(one);
    kdt_dflash_ctx_free(inc);
    kdt_dflash_ctx_free(other);
    kdt_dflash_free(d);
}

/* The CPU threads (every loop split as far as it goes) and the plain C forms change no bit of a
 * draft, for head dims that take each form of the AVX2 attention output (16: per column, 32 and
 * 64: 32 columns in registers), with a context that is not a multiple of 8 keys. */
static void test_draft_threads_simd(void) {
    static const int dims[] = {16, 32, 64};
    const int P = 37, L = 4, V = 320, width = 128;
    float *feat = random_feat(P, width, 5);
    float *ref = malloc(sizeof(float) * L * V), *got = malloc(sizeof(float) * L * V);
    kdt_parallel_set_min_cost(1.0);
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        et_dflash_spec s = et_dflash_default(64, 320);
        s.head_dim = dims[di];
        char dir[300];
        snprintf(dir, sizeof dir, "%s/simd%d", g_tmp, dims[di]);
        et_dflash_write(dir, &s, NULL);
        kdt_dflash *d = NULL;
        CHECK(kdt_dflash_load(dir, g_target, NULL, &d) == KDT_OK);
        if (!d) continue;
        kdt_dflash_ctx *c = NULL;
        CHECK(kdt_dflash_ctx_create(d, 64, &c) == KDT_OK);
        CHECK(kdt_dflash_ctx_append(d, c, feat, P) == KDT_OK);
        for (int threads = 1; threads <= 3; threads++)
            for (int plain = 1; plain >= 0; plain--) {
                CHECK_EQ_INT(kdt_set_cpu_threads(threads), KDT_OK);
                kdt_cpu_force_plain(plain);
                float *out = threads == 1 && plain ? ref : got;
                CHECK(kdt_dflash_draft(d, &c, 1, (const int32_t[]){7}, out) == KDT_OK);
                CHECK_MSG(memcmp(ref, out, sizeof(float) * L * V) == 0, "head_dim %d: draft with %d threads%s differs",
                          dims[di], threads, plain ? ", plain C" : "");
            }
        kdt_dflash_ctx_free(c);
        kdt_dflash_free(d);
    }
    kdt_cpu_force_plain(0);
    kdt_parallel_set_min_cost(0);
    CHECK_EQ_INT(kdt_set_cpu_threads(0), KDT_OK);
    free(feat), free(ref), free(got);
}

static void expect_load_error(const et_dflash_spec *s, const char *name, kdt_status want, const char *needle) {
    char dir[300];
    snprintf(dir, sizeof dir, "%s/bad_%s", g_tmp, name);
    et_dflash_write(dir, s, NULL);
    kdt_dflash *d = NULL;
    kdt_status st = kdt_dflash_load(dir, g_target, NULL, &d);
    CHECK_MSG(st == want, "%s: got %s (%s)", name, kdt_status_name(st), kdt_last_error());
    CHECK_MSG(strstr(kdt_last_error(), needle) != NULL, "%s: message \"%s\" lacks \"%s\"", name,
              kdt_last_error(), needle);
    CHECK(d == NULL);
    /* the same through the engine */
    kdt_engine_options o;
    memset(&o, 0, sizeof o);
    o.device = KDT_DEVICE_CPU; /* the reference is the CPU model */
    o.model_dir = ET_FIXTURE;
    o.draft_dir = dir;
    kdt_engine *e = NULL;
    st = kdt_engine_create(&o, &e);
    CHECK_MSG(st == want, "engine %s: %s", name, kdt_last_error());
    CHECK(e == NULL);
}

static void test_bad_drafters(void) {
    et_dflash_spec s = et_dflash_default(64, 320);
    et_dflash_spec b = s;
    b.hidden = 32;
    expect_load_error(&b, "hidden", KDT_ERR_FORMAT, "hidden_size");
    b = s;
    b.vocab = 321;
    expect_load_error(&b, "vocab", KDT_ERR_FORMAT, "vocab_size");
    b = s;
    b.taps[1] = 2; /* the target has layers 0..1 */
    expect_load_error(&b, "taps", KDT_ERR_FORMAT, "target_layer_ids");
    b = s;
    b.taps[1] = 0;
    expect_load_error(&b, "taps_order", KDT_ERR_FORMAT, "target_layer_ids");
    b = s;
    b.mask_id = 320;
    expect_load_error(&b, "mask", KDT_ERR_FORMAT, "mask_token_id");
    b = s;
    b.skip_tensor = "layers.1.mlp.up_proj.weight";
    expect_load_error(&b, "missing", KDT_ERR_FORMAT, "layers.1.mlp.up_proj.weight");
    b = s;
    b.bad_tensor = "fc.weight";
    expect_load_error(&b, "shape", KDT_ERR_FORMAT, "fc.weight");
    b = s;
    b.bad_tensor = "layers.0.self_attn.k_norm.weight";
    expect_load_error(&b, "shape1d", KDT_ERR_FORMAT, "k_norm");
    b = s;
    b.block_size = 40;
    expect_load_error(&b, "block", KDT_ERR_FORMAT, "block_size");
    b = s;
    b.heads = 3;
    b.kv_heads = 2;
    expect_load_error(&b, "gqa", KDT_ERR_FORMAT, "num_key_value_heads");
    /* RoPE values past what fp32 frequencies carry (tests/fuzz/fuzz_dflash_config.c found these
     * accepted; a negative beta and 1e20 positions are corpus inputs there) */
    b = s;
    b.theta = 5e65;
    expect_load_error(&b, "theta", KDT_ERR_FORMAT, "rope_theta");
    b = s;
    b.yarn = 1;
    b.theta = 50000.0;
    b.factor = 1e300;
    expect_load_error(&b, "factor", KDT_ERR_FORMAT, "YaRN factor");
    /* fields at the top level are accepted too */
    b = s;
    b.taps_top_level = 1;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/toplevel", g_tmp);
    et_dflash_write(dir, &b, NULL);
    kdt_dflash *d = NULL;
    CHECK_MSG(kdt_dflash_load(dir, g_target, NULL, &d) == KDT_OK, "%s", kdt_last_error());
    kdt_dflash_free(d);
    /* no directory / not JSON */
    CHECK(kdt_dflash_load("/nonexistent/drafter", g_target, NULL, &d) == KDT_ERR_IO);
    snprintf(dir, sizeof dir, "%s/notjson", g_tmp);
    mkdir(dir, 0755);
    char path[400];
    snprintf(path, sizeof path, "%s/config.json", dir);
    tm_write_bytes(path, "{\"block_size\": 4,", 17);
    CHECK(kdt_dflash_load(dir, g_target, NULL, &d) == KDT_ERR_FORMAT);
}

/* 300 random corruptions of a drafter's config.json (bytes replaced, digits changed, spans
 * deleted or duplicated, JSON fragments inserted, truncation): every load ends in a drafter that
 * drafts a block over a short context, or a clear error and no drafter; a value that changes the
 * architecture is either refused or used consistently (the draft runs with the loaded sizes). */
static void test_random_corrupt_configs(void) {
    static const char *const frags[] = {"null", "-1", "0", "1e309", "2147483648", "\"\"", "[]", "{}", "[", "{",
                                        "\"", ",", ":", "\\u0000", "true", "\"yarn\"", "\"rope_scaling\"",
                                        "\"block_size\"", "\"target_layer_ids\"", "\"num_key_value_heads\""};
    const t_mutator mut = {frags, (int)(sizeof frags / sizeof *frags), "{}[]\",:0123456789-.e ", 0, 3};
    const et_dflash_spec spec = et_dflash_default(64, 320);
    char dir[300], path[400];
    snprintf(dir, sizeof dir, "%s/fuzz", g_tmp);
    et_dflash_write(dir, &spec, NULL);
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t base_n = 0;
    char *base = tm_read_bytes(path, &base_n);
    static char buf[16384];
    CHECK(base && base_n > 0 && base_n < sizeof buf / 2);
    if (!base || base_n >= sizeof buf / 2) base_n = 0;
    uint64_t rng = t_fuzz_seed(0xdf1a5);
    int loaded = 0, refused = 0, bad = 0;
    float *feat = random_feat(9, 64 * KDT_MODEL_MAX_TAPS, 3);
    float *logits = malloc(sizeof(float) * KDT_MAX_DEPTH * 320);
    for (int it = 0, iters = t_fuzz_iters(300); it < iters && bad < 5 && base_n; it++) {
        size_t n = base_n;
        memcpy(buf, base, n);
        t_mutate(&mut, buf, &n, sizeof buf, &rng);
        tm_write_bytes(path, buf, n);
        kdt_dflash *d = NULL;
        const kdt_status st = kdt_dflash_load(dir, g_target, NULL, &d);
        if (st != KDT_OK) {
            refused++;
            const char *msg = kdt_last_error();
            if (d || !msg || !msg[0]) {
                bad++;
                CHECK_MSG(0, "refused (%s) without a message or with a drafter: %.*s", kdt_status_name(st), (int)n, buf);
            }
            continue;
        }
        loaded++;
        const kdt_dflash_config *c = kdt_dflash_get_config(d);
        kdt_dflash_ctx *ctx = NULL;
        kdt_status ds = kdt_dflash_ctx_create(d, 32, &ctx);
        if (ds == KDT_OK) ds = kdt_dflash_ctx_append(d, ctx, feat, 9);
        if (ds == KDT_OK && c->block_size - 1 <= KDT_MAX_DEPTH)
            ds = kdt_dflash_draft(d, &ctx, 1, (const int32_t[]){7}, logits);
        if (ds != KDT_OK || c->block_size - 1 > KDT_MAX_DEPTH) {
            bad++;
            CHECK_MSG(0, "loaded (block %d) but drafting failed: %s: %.*s", c->block_size, kdt_last_error(), (int)n,
                      buf);
        }
        kdt_dflash_ctx_free(ctx);
        kdt_dflash_free(d);
    }
    printf("  %d corrupted configs: %d loaded and drafted, %d refused with a message\n", t_fuzz_iters(300), loaded,
           refused);
    CHECK(loaded >= 10 && refused >= 100); /* both outcomes are reached, or the test checks nothing */
    free(base);
    free(feat);
    free(logits);
}

/* Runs 4 prompts x 16 tokens with these modes (budgets 8, 16, 24, 32) and checks each stream
 * against its greedy reference. */
static void run_4_vs_ref(kdt_engine *e, int32_t **prompts, int32_t *n_prompt, int32_t **ref,
                         const kdt_spec_mode modes[4], const char *what) {
    kdt_gen_params p[4];
    for (int i = 0; i < 4; i++) {
        kdt_gen_params_default(&p[i]);
        p[i].spec = modes[i];
        p[i].budget = 8 * (i + 1);
        p[i].max_new_tokens = 16;
    }
    et_run r;
    const kdt_status st = et_run_batch(e, 4, prompts, n_prompt, p, &r);
    CHECK_MSG(st == KDT_OK, "%s: %s", what, kdt_last_error());
    static const int32_t n_new[4] = {16, 16, 16, 16};
    if (st == KDT_OK) et_check_outputs(&r, n_new, ref, what);
    et_run_free(&r);
}

/* The engine with a real (random) DFlash drafter is lossless too. */
static void test_engine_with_dflash(void) {
    et_dflash_spec s = et_dflash_default(64, 320);
    s.block_size = 8;
    s.yarn = 1;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/engine", g_tmp);
    et_dflash_write(dir, &s, NULL);
    kdt_engine_options o;
    memset(&o, 0, sizeof o);
    o.device = KDT_DEVICE_CPU; /* the reference is the CPU model */
    o.model_dir = ET_FIXTURE;
    o.draft_dir = dir;
    o.max_streams = 4;
    o.max_budget = 32;
    kdt_engine *e = NULL;
    kdt_status st = kdt_engine_create(&o, &e);
    CHECK_MSG(st == KDT_OK, "%s", kdt_last_error());
    if (!e) return;
    CHECK_EQ_INT(kdt_engine_draft_depth(e), 7);
    static const int32_t lens[4] = {2, 7, 30, 290}; /* 290: two prefill calls of the drafter's context */
    int32_t *prompts[4], n_prompt[4], *ref[4];
    uint64_t rng = 3;
    for (int i = 0; i < 4; i++) {
        n_prompt[i] = lens[i];
        prompts[i] = malloc(sizeof(int32_t) * lens[i]);
        for (int j = 0; j < lens[i]; j++) prompts[i][j] = t_rand_int(&rng, 320);
        ref[i] = malloc(sizeof(int32_t) * 16);
        CHECK(et_greedy_reference(ET_FIXTURE, prompts[i], lens[i], 16, ref[i]) == KDT_OK);
    }
    const kdt_spec_mode modes[4] = {KDT_SPEC_CHAIN, KDT_SPEC_DDTREE, KDT_SPEC_AUTO, KDT_SPEC_AR};
    for (int m = 0; m < 4; m++) {
        kdt_spec_mode mix[4];
        for (int i = 0; i < 4; i++) mix[i] = modes[(m + i) % 4]; /* every batch mixes modes */
        run_4_vs_ref(e, prompts, n_prompt, ref, mix, "mixed modes");
    }
    /* every stream auto, rounds forced to drafted, plain, plain, drafted, ...: a plain round (no
     * drafter, budgets 0) must still bring its accepted tokens into the drafter context, or the
     * next drafted round fails its context check (and the output would differ) */
    kdt_engine_stats before, after;
    kdt_engine_get_stats(e, &before);
    kdt_budget_test_kinds(&e->budget, 0x1u, 3); /* bit i: round i % 3 drafts */
    const kdt_spec_mode all_auto[4] = {KDT_SPEC_AUTO, KDT_SPEC_AUTO, KDT_SPEC_AUTO, KDT_SPEC_AUTO};
    run_4_vs_ref(e, prompts, n_prompt, ref, all_auto, "all auto");
    kdt_engine_get_stats(e, &after);
    const uint64_t plain = after.plain_rounds - before.plain_rounds, all = after.rounds - before.rounds;
    CHECK_MSG(plain >= 3 && all - plain >= 3, "%llu plain rounds of %llu", (unsigned long long)plain,
              (unsigned long long)all);
    kdt_engine_free(e);
    /* prompts prefilled 3 and 300 rows a pass (300: one call of the whole 290-token prompt, its
     * taps appended at once): the same output */
    static const int32_t chunks[2] = {3, 300};
    for (int c = 0; c < 2; c++) {
        o.prefill_chunk = chunks[c];
        e = NULL;
        st = kdt_engine_create(&o, &e);
        CHECK_MSG(st == KDT_OK, "prefill chunk %d: %s", chunks[c], kdt_last_error());
        if (!e) break;
        static const kdt_spec_mode cm[4] = {KDT_SPEC_AR, KDT_SPEC_CHAIN, KDT_SPEC_AUTO, KDT_SPEC_DDTREE};
        run_4_vs_ref(e, prompts, n_prompt, ref, cm, "prefill chunk"); /* the long prompt drafts */
        kdt_engine_free(e);
    }
    for (int i = 0; i < 4; i++) {
        free(prompts[i]);
        free(ref[i]);
    }
}

int main(void) {
    FILE *f = fopen(ET_FIXTURE "/config.json", "rb");
    if (!f) {
        printf("tests/fixtures/models/kimi_tiny not present: skipped\n");
        return 0;
    }
    fclose(f);
    kdt_model_options mo = {0, 0, KDT_PREFILL_ABSORBED};
    if (kdt_model_load(ET_FIXTURE, &mo, &g_target) != KDT_OK) {
        fprintf(stderr, "target: %s\n", kdt_last_error());
        return 1;
    }
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kdt_dflash_test_XXXXXX");
    if (!mkdtemp(g_tmp)) return 1;
    T_RUN(test_rope_table_matches_model);
    T_RUN(test_forward_vs_fp64);
    T_RUN(test_context_lifecycle);
    T_RUN(test_draft_threads_simd);
    T_RUN(test_bad_drafters);
    T_RUN(test_random_corrupt_configs);
    T_RUN(test_engine_with_dflash);
    kdt_model_free(g_target);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_tmp);
    return t_summary();
}
#else
#include <stdio.h>
int main(void) {
    printf("engine not built (no jansson): skipped\n");
    return 0;
}
#endif
