/* dflash.c - DFlash drafter: config + weight loading with validation against the target, the
 * per-stream context K/V cache, and the CPU forward of one draft block (see dflash.h).
 *
 * Numerics: fp32 everywhere with fixed summation orders (the model's kdt_weight_matvec), so a
 * stream's draft does not depend on which other streams are drafted with it.
 */
#include "dflash.h"

#include "model/model_internal.h"
#include "target_adapter.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct dflash_layer {
    kdt_weight in_norm, post_norm;  /* [D] */
    kdt_weight q, k, v, o;          /* [H*hd][D], [KV*hd][D], [KV*hd][D], [D][H*hd] */
    kdt_weight q_norm, k_norm;      /* [hd] */
    kdt_weight gate, up, down;      /* [I][D], [I][D], [D][I] */
} dflash_layer;

struct kdt_dflash {
    kdt_dflash_config cfg;
    const kdt_model *target;
    int32_t vocab;                  /* target V */
    kdt_st_set st;
    int st_open;
    kdt_weight fc;                  /* [D][n_taps*D] */
    kdt_weight hidden_norm, norm;   /* [D] */
    dflash_layer *layers;           /* [n_layers] */
    float *inv_freq;                /* [hd/2] */
};

struct kdt_dflash_ctx {
    int32_t len, cap, max_len;
    int32_t n_layers, kv_dim;       /* kv_dim = KV*hd */
    float **k, **v;                 /* [n_layers] -> [cap][kv_dim], K after k_norm + RoPE */
};

/* ---- config --------------------------------------------------------------------------------- */

/* Field lookup in the top level, then in dflash_config (z-lab nests some fields there). */
static json_t *field(json_t *root, const char *name) {
    json_t *v = json_object_get(root, name);
    if (v && !json_is_null(v)) return v;
    json_t *dc = json_object_get(root, "dflash_config");
    if (json_is_object(dc)) {
        v = json_object_get(dc, name);
        if (v && !json_is_null(v)) return v;
    }
    return NULL;
}

static kdt_status get_int(json_t *root, const char *path, const char *name, int required,
                          int32_t def, int32_t lo, int32_t hi, int32_t *out) {
    json_t *v = field(root, name);
    if (!v) {
        if (required) return kdt_fail(KDT_ERR_FORMAT, "%s: \"%s\" is missing", path, name);
        *out = def;
        return KDT_OK;
    }
    if (!json_is_integer(v))
        return kdt_fail(KDT_ERR_FORMAT, "%s: \"%s\" is not an integer", path, name);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return kdt_fail(KDT_ERR_FORMAT, "%s: \"%s\" = %lld, expected %d..%d", path, name,
                        (long long)x, lo, hi);
    *out = (int32_t)x;
    return KDT_OK;
}

static double num_or(json_t *obj, const char *name, double def) {
    json_t *v = obj ? json_object_get(obj, name) : NULL;
    return json_is_number(v) ? json_number_value(v) : def;
}


static kdt_status parse_rope(json_t *root, const char *path, const kdt_dflash_options *opt,
                             kdt_dflash_config *c) {
    /* transformers >= 5 writes rope_parameters {rope_type, rope_theta, ...}; older files write
     * rope_theta at the top and rope_scaling {type|rope_type, factor, ...} (or null). */
    json_t *rp = json_object_get(root, "rope_parameters");
    if (!json_is_object(rp)) rp = json_object_get(root, "rope_scaling");
    if (!json_is_object(rp)) rp = NULL;
    c->rope_theta = num_or(rp, "rope_theta", num_or(root, "rope_theta", 10000.0));
    KDT_TRY(kdt_rope_check_theta(path, c->rope_theta)); /* the target's bounds */
    const char *type = "default";
    if (rp) {
        json_t *t = json_object_get(rp, "rope_type");
        if (!json_is_string(t)) t = json_object_get(rp, "type");
        if (json_is_string(t)) type = json_string_value(t);
    }
    c->rope_yarn = 0;
    c->rope_factor = 1.0;
    c->rope_attention_factor = 1.0f;
    if (strcmp(type, "default") == 0) return KDT_OK;
    if (strcmp(type, "yarn") != 0)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: rope type \"%s\" is not supported (default, yarn)",
                        path, type);
    c->rope_yarn = 1;
    c->rope_factor = num_or(rp, "factor", 1.0);
    c->rope_beta_fast = num_or(rp, "beta_fast", 32.0);
    c->rope_beta_slow = num_or(rp, "beta_slow", 1.0);
    c->rope_mscale = num_or(rp, "mscale", 0.0);
    c->rope_mscale_all_dim = num_or(rp, "mscale_all_dim", 0.0);
    /* the target's bounds, tested before the int32 cast (1e20 positions overflowed it, a negative
     * beta drafted NaN logits: found by tests/fuzz/fuzz_dflash_config.c) */
    const double omax = num_or(rp, "original_max_position_embeddings", (double)c->max_position);
    KDT_TRY(kdt_rope_settle_yarn(path, c->rope_factor, &c->rope_beta_fast, &c->rope_beta_slow, c->rope_mscale,
                                 c->rope_mscale_all_dim, omax));
    c->rope_original_max_position = (int32_t)omax;
    double amp;
    json_t *af = json_object_get(rp, "attention_factor");
    if (json_is_number(af)) amp = json_number_value(af);
    else if (c->rope_mscale != 0.0 && c->rope_mscale_all_dim != 0.0)
        amp = kdt_yarn_mscale(c->rope_factor, c->rope_mscale) /
              kdt_yarn_mscale(c->rope_factor, c->rope_mscale_all_dim);
    else amp = kdt_yarn_mscale(c->rope_factor, 1.0);
    if (opt && opt->yarn_amplitude == KDT_YARN_AMP_LEGACY) amp = kdt_yarn_mscale(c->rope_factor, 1.0);
    if (!(amp > 0) || !(amp <= 1e3))
        return kdt_fail(KDT_ERR_FORMAT, "%s: yarn attention factor %g, expected in (0, 1e3]", path, amp);
    c->rope_attention_factor = (float)amp;
    return KDT_OK;
}

static kdt_status parse_config(json_t *root, const char *path, const kdt_model_config *tc,
                               const kdt_dflash_options *opt, kdt_dflash_config *c) {
    memset(c, 0, sizeof *c);
    if (!json_is_object(root)) return kdt_fail(KDT_ERR_FORMAT, "%s: not a JSON object", path);
    KDT_TRY(get_int(root, path, "hidden_size", 1, 0, 1, 1 << 16, &c->hidden_size));
    KDT_TRY(get_int(root, path, "intermediate_size", 1, 0, 1, 1 << 20, &c->intermediate_size));
    KDT_TRY(get_int(root, path, "num_hidden_layers", 1, 0, 1, 256, &c->n_layers));
    KDT_TRY(get_int(root, path, "num_attention_heads", 1, 0, 1, 1024, &c->n_heads));
    KDT_TRY(get_int(root, path, "num_key_value_heads", 0, c->n_heads, 1, 1024, &c->n_kv_heads));
    KDT_TRY(get_int(root, path, "head_dim", 0, c->hidden_size / c->n_heads, 2, 4096, &c->head_dim));
    KDT_TRY(get_int(root, path, "block_size", 1, 0, 2, KDT_MAX_DEPTH + 1, &c->block_size));
    KDT_TRY(get_int(root, path, "mask_token_id", 1, 0, 0, INT32_MAX, &c->mask_token_id));
    KDT_TRY(get_int(root, path, "max_position_embeddings", 0, 1 << 20, 1, INT32_MAX,
                &c->max_position));
    if (c->n_heads % c->n_kv_heads != 0)
        return kdt_fail(KDT_ERR_FORMAT, "%s: num_attention_heads %d is not a multiple of "
                        "num_key_value_heads %d", path, c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return kdt_fail(KDT_ERR_FORMAT, "%s: head_dim %d is odd", path, c->head_dim);
    c->rms_eps = (float)num_or(root, "rms_norm_eps", 1e-6);
    if (!(c->rms_eps > 0.0f)) return kdt_fail(KDT_ERR_FORMAT, "%s: rms_norm_eps must be > 0", path);

    json_t *v = json_object_get(root, "hidden_act");
    if (json_is_string(v) && strcmp(json_string_value(v), "silu") != 0)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: hidden_act \"%s\" (only silu)", path,
                        json_string_value(v));
    if (json_is_true(json_object_get(root, "attention_bias")))
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: attention_bias true is not supported", path);
    if (json_is_true(json_object_get(root, "use_sliding_window"))) {
        json_t *lt = json_object_get(root, "layer_types");
        size_t i;
        json_t *x;
        json_array_foreach(lt, i, x) {
            if (json_is_string(x) && strcmp(json_string_value(x), "full_attention") != 0)
                return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: layer_types[%zu] = \"%s\": sliding-window "
                                "draft layers are not supported", path, i, json_string_value(x));
        }
    }

    /* taps: dflash_config.target_layer_ids (or top level); the default spacing otherwise */
    json_t *taps = field(root, "target_layer_ids");
    if (taps) {
        if (!json_is_array(taps) || json_array_size(taps) < 1 ||
            json_array_size(taps) > KDT_MODEL_MAX_TAPS)
            return kdt_fail(KDT_ERR_FORMAT, "%s: target_layer_ids must be an array of 1..%d ids",
                            path, KDT_MODEL_MAX_TAPS);
        c->n_taps = (int32_t)json_array_size(taps);
        for (int32_t i = 0; i < c->n_taps; i++) {
            json_t *x = json_array_get(taps, (size_t)i);
            if (!json_is_integer(x))
                return kdt_fail(KDT_ERR_FORMAT, "%s: target_layer_ids[%d] is not an integer", path, i);
            json_int_t id = json_integer_value(x);
            if (id < 0 || id >= tc->n_layers)
                return kdt_fail(KDT_ERR_FORMAT, "%s: target_layer_ids[%d] = %lld, but the target "
                                "has decoder layers 0..%d", path, i, (long long)id, tc->n_layers - 1);
            if (i > 0 && id <= c->tap_layers[i - 1])
                return kdt_fail(KDT_ERR_FORMAT, "%s: target_layer_ids must be strictly increasing "
                                "(entry %d = %lld)", path, i, (long long)id);
            c->tap_layers[i] = (int32_t)id;
        }
    } else {
        /* z-lab build_target_layer_ids: n = 1 -> [N/2]; else round(1 + i (N-4)/(n-1)) */
        int32_t n = c->n_layers, N = tc->n_layers;
        int32_t nt = 0;
        KDT_TRY(get_int(root, path, "num_target_layers", 0, N, 1, 4096, &nt));
        if (nt != N)
            return kdt_fail(KDT_ERR_FORMAT, "%s: num_target_layers = %d, the target has %d layers",
                            path, nt, N);
        if (n > KDT_MODEL_MAX_TAPS || N < 5)
            return kdt_fail(KDT_ERR_FORMAT, "%s: no target_layer_ids and the default spacing does "
                            "not fit (%d draft layers, %d target layers)", path, n, N);
        c->n_taps = n;
        for (int32_t i = 0; i < n; i++)
            c->tap_layers[i] = n == 1 ? N / 2 : (int32_t)rint(1.0 + (double)i * (N - 4) / (n - 1)); /* Python round(): half to even */
    }

    /* fit with the target */
    if (c->hidden_size != tc->hidden_size)
        return kdt_fail(KDT_ERR_FORMAT, "%s: hidden_size %d does not match the target's %d", path,
                        c->hidden_size, tc->hidden_size);
    if (c->mask_token_id >= tc->vocab_size)
        return kdt_fail(KDT_ERR_FORMAT, "%s: mask_token_id %d is outside the target vocabulary "
                        "(0..%d)", path, c->mask_token_id, tc->vocab_size - 1);
    v = json_object_get(root, "vocab_size");
    if (json_is_integer(v) && json_integer_value(v) != tc->vocab_size)
        return kdt_fail(KDT_ERR_FORMAT, "%s: vocab_size %lld does not match the target's %d", path,
                        (long long)json_integer_value(v), tc->vocab_size);
    return parse_rope(root, path, opt, c);
}

/* ---- weights -------------------------------------------------------------------------------- */

static kdt_status bind(kdt_dflash *d, const char *dir, const char *prefix, const char *name,
                       kdt_weight *w, int64_t rows, int64_t cols) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    const kdt_st_tensor *t = kdt_st_find(&d->st, full);
    if (!t) return kdt_fail(KDT_ERR_FORMAT, "drafter %s: tensor \"%s\" is missing", dir, full);
    if (t->dtype != KDT_W_F32 && t->dtype != KDT_W_BF16 && t->dtype != KDT_W_F16)
        return kdt_fail(KDT_ERR_FORMAT, "drafter %s: tensor \"%s\": dtype %s, expected F32, BF16 "
                        "or F16", dir, full, t->dtype_name);
    int ok = rows == 0 ? (t->ndim == 1 && t->shape[0] == cols)
                       : (t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols);
    if (!ok) {
        char got[96] = "";
        size_t o = 0;
        for (int32_t i = 0; i < t->ndim && o < sizeof got; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%s%lld", i ? ", " : "",
                                  (long long)t->shape[i]);
        if (rows == 0)
            return kdt_fail(KDT_ERR_FORMAT, "drafter %s: tensor \"%s\": shape [%s], expected [%lld]",
                            dir, full, got, (long long)cols);
        return kdt_fail(KDT_ERR_FORMAT, "drafter %s: tensor \"%s\": shape [%s], expected [%lld, %lld]",
                        dir, full, got, (long long)rows, (long long)cols);
    }
    w->dtype = t->dtype;
    w->data = t->data;
    w->rows = rows == 0 ? 1 : rows;
    w->cols = cols;
    w->name = t->name;
    return KDT_OK;
}

static kdt_status bind_all(kdt_dflash *d, const char *dir) {
    const kdt_dflash_config *c = &d->cfg;
    const int64_t D = c->hidden_size, H = c->n_heads, KV = c->n_kv_heads, hd = c->head_dim,
                  I = c->intermediate_size;
    const char *prefix = kdt_st_find(&d->st, "fc.weight") ? "" :
                         kdt_st_find(&d->st, "model.fc.weight") ? "model." : "";
    KDT_TRY(bind(d, dir, prefix, "fc.weight", &d->fc, D, (int64_t)c->n_taps * D));
    KDT_TRY(bind(d, dir, prefix, "hidden_norm.weight", &d->hidden_norm, 0, D));
    KDT_TRY(bind(d, dir, prefix, "norm.weight", &d->norm, 0, D));
    d->layers = calloc((size_t)c->n_layers, sizeof *d->layers);
    if (!d->layers) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter: layer table");
    for (int32_t l = 0; l < c->n_layers; l++) {
        dflash_layer *L = &d->layers[l];
        char n[128];
#define B(w, suffix, r, cols)                                      \
    do {                                                           \
        snprintf(n, sizeof n, "layers.%d.%s", l, suffix);          \
        KDT_TRY(bind(d, dir, prefix, n, w, r, cols));                  \
    } while (0)
        B(&L->in_norm, "input_layernorm.weight", 0, D);
        B(&L->post_norm, "post_attention_layernorm.weight", 0, D);
        B(&L->q, "self_attn.q_proj.weight", H * hd, D);
        B(&L->k, "self_attn.k_proj.weight", KV * hd, D);
        B(&L->v, "self_attn.v_proj.weight", KV * hd, D);
        B(&L->o, "self_attn.o_proj.weight", D, H * hd);
        B(&L->q_norm, "self_attn.q_norm.weight", 0, hd);
        B(&L->k_norm, "self_attn.k_norm.weight", 0, hd);
        B(&L->gate, "mlp.gate_proj.weight", I, D);
        B(&L->up, "mlp.up_proj.weight", I, D);
        B(&L->down, "mlp.down_proj.weight", D, I);
#undef B
    }
    return KDT_OK;
}

void kdt_dflash_rope_inv_freq(const kdt_dflash_config *c, float *inv_freq) {
    /* as transformers computes it: fp32 tensor ops, python-float correction range */
    const int32_t hd = c->head_dim, half = hd / 2;
    const float base = (float)c->rope_theta;
    double low = 0, high = 1;
    if (c->rope_yarn) { /* _compute_yarn_parameters with truncate = true */
        const double two_pi = 6.283185307179586, orig = c->rope_original_max_position;
        low = floor(hd * log(orig / (c->rope_beta_fast * two_pi)) / (2.0 * log(c->rope_theta)));
        high = ceil(hd * log(orig / (c->rope_beta_slow * two_pi)) / (2.0 * log(c->rope_theta)));
        if (low < 0) low = 0;
        if (high > hd - 1) high = hd - 1;
        if (low == high) high += 0.001;
    }
    for (int32_t i = 0; i < half; i++) {
        float pos_freq = powf(base, (float)(2 * i) / (float)hd);
        float extrapolation = 1.0f / pos_freq;
        if (!c->rope_yarn) {
            inv_freq[i] = extrapolation;
            continue;
        }
        float interpolation = 1.0f / ((float)c->rope_factor * pos_freq);
        float ramp = ((float)i - (float)low) / (float)(high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        float extrapolation_factor = 1.0f - ramp;
        inv_freq[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
}

kdt_status kdt_dflash_load(const char *dir, const kdt_model *target, const kdt_dflash_options *opt,
                           kdt_dflash **out) {
    KDT_CHECK_ARG(out != NULL, "kdt_dflash_load: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(dir != NULL && dir[0], "kdt_dflash_load: draft directory is empty");
    KDT_CHECK_ARG(target != NULL, "kdt_dflash_load: target is NULL");
    const kdt_model_config *tc = kdt_model_get_config(target);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        FILE *f = fopen(path, "rb");
        if (!f) return kdt_fail(KDT_ERR_IO, "drafter: cannot open %s", path);
        fclose(f);
        return kdt_fail(KDT_ERR_FORMAT, "%s: not valid JSON (%s, line %d)", path, jerr.text, jerr.line);
    }
    kdt_dflash *d = calloc(1, sizeof *d);
    if (!d) {
        json_decref(root);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter");
    }
    d->target = target;
    d->vocab = tc->vocab_size;
    kdt_status st = parse_config(root, path, tc, opt, &d->cfg);
    json_decref(root);
    if (st == KDT_OK) {
        st = kdt_st_open_dir(dir, opt ? opt->progress : 0, &d->st);
        if (st == KDT_OK) d->st_open = 1;
    }
    if (st == KDT_OK) st = bind_all(d, dir);
    if (st == KDT_OK) {
        d->inv_freq = malloc(sizeof(float) * (size_t)(d->cfg.head_dim / 2));
        if (!d->inv_freq) st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter: rope table");
        else kdt_dflash_rope_inv_freq(&d->cfg, d->inv_freq);
    }
    if (st != KDT_OK) {
        kdt_dflash_free(d);
        return st;
    }
    *out = d;
    return KDT_OK;
}

void kdt_dflash_free(kdt_dflash *d) {
    if (!d) return;
    if (d->st_open) kdt_st_close(&d->st);
    free(d->layers);
    free(d->inv_freq);
    free(d);
}

const kdt_dflash_config *kdt_dflash_get_config(const kdt_dflash *d) { return d ? &d->cfg : NULL; }

/* ---- context cache -------------------------------------------------------------------------- */

kdt_status kdt_dflash_ctx_create(const kdt_dflash *d, int32_t max_len, kdt_dflash_ctx **out) {
    KDT_CHECK_ARG(d && out && max_len >= 1, "kdt_dflash_ctx_create: bad arguments (max_len %d)",
                  max_len);
    kdt_dflash_ctx *c = calloc(1, sizeof *c);
    if (!c) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter context");
    c->max_len = max_len;
    c->n_layers = d->cfg.n_layers;
    c->kv_dim = d->cfg.n_kv_heads * d->cfg.head_dim;
    c->k = calloc((size_t)c->n_layers, sizeof *c->k);
    c->v = calloc((size_t)c->n_layers, sizeof *c->v);
    if (!c->k || !c->v) {
        kdt_dflash_ctx_free(c);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter context");
    }
    *out = c;
    return KDT_OK;
}

void kdt_dflash_ctx_free(kdt_dflash_ctx *c) {
    if (!c) return;
    for (int32_t l = 0; l < c->n_layers; l++) {
        if (c->k) free(c->k[l]);
        if (c->v) free(c->v[l]);
    }
    free(c->k);
    free(c->v);
    free(c);
}

void kdt_dflash_ctx_reset(kdt_dflash_ctx *c) {
    if (c) c->len = 0;
}

int32_t kdt_dflash_ctx_length(const kdt_dflash_ctx *c) { return c ? c->len : -1; }

static kdt_status ctx_grow(kdt_dflash_ctx *c, int32_t need) {
    if (need <= c->cap) return KDT_OK;
    int64_t cap = c->cap ? c->cap : 64;
    while (cap < need) cap *= 2;
    if (cap > c->max_len) cap = c->max_len;
    for (int32_t l = 0; l < c->n_layers; l++) {
        float *k = realloc(c->k[l], sizeof(float) * (size_t)cap * (size_t)c->kv_dim);
        if (!k) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter context: %lld positions", (long long)cap);
        c->k[l] = k;
        float *v = realloc(c->v[l], sizeof(float) * (size_t)cap * (size_t)c->kv_dim);
        if (!v) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter context: %lld positions", (long long)cap);
        c->v[l] = v;
    }
    c->cap = (int32_t)cap;
    return KDT_OK;
}

/* ---- math helpers --------------------------------------------------------------------------- */

/* y[n] = RMSNorm(x[n]) * w */
static void rmsnorm(const float *x, const kdt_weight *w, int32_t n, float eps, float *y) {
    float ss = 0.0f;
    for (int32_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int32_t i = 0; i < n; i++) y[i] = kdt_weight_at(w, i) * (x[i] * inv);
}

/* In place on one head vector x[hd]: rotate-half RoPE at `pos`, cos/sin scaled by amp. */
static void rope_head(float *x, int32_t hd, const float *inv_freq, int64_t pos, float amp) {
    const int32_t half = hd / 2;
    for (int32_t i = 0; i < half; i++) {
        /* fp32 angle as transformers forms it, then an accurate cos/sin of that angle */
        float ang = (float)pos * inv_freq[i];
        float cs = (float)cos((double)ang) * amp, sn = (float)sin((double)ang) * amp;
        float a = x[i], b = x[i + half];
        x[i] = a * cs - b * sn;
        x[i + half] = b * cs + a * sn;
    }
}

/* k_norm + RoPE of every KV head of one row k[KV*hd] */
static void norm_rope_heads(const kdt_dflash *d, float *x, int32_t n_heads, const kdt_weight *nw,
                            int64_t pos, float *tmp /* [hd] */) {
    const int32_t hd = d->cfg.head_dim;
    for (int32_t h = 0; h < n_heads; h++) {
        float *xh = x + (int64_t)h * hd;
        rmsnorm(xh, nw, hd, d->cfg.rms_eps, tmp);
        memcpy(xh, tmp, sizeof(float) * (size_t)hd);
        rope_head(xh, hd, d->inv_freq, pos, d->cfg.rope_attention_factor);
    }
}

kdt_status kdt_dflash_ctx_append(const kdt_dflash *d, kdt_dflash_ctx *c, const float *feat,
                                 int32_t n) {
    KDT_CHECK_ARG(d && c && (feat || n == 0) && n >= 0, "kdt_dflash_ctx_append: bad arguments");
    if ((int64_t)c->len + n > c->max_len)
        return kdt_fail(KDT_ERR_CAPACITY, "drafter context: %d + %d positions exceed %d", c->len, n,
                        c->max_len);
    KDT_TRY(ctx_grow(c, c->len + n));
    const kdt_dflash_config *cf = &d->cfg;
    const int32_t D = cf->hidden_size, hd = cf->head_dim, KV = cf->n_kv_heads;
    if (n == 0) return KDT_OK;
    float *proj = malloc(sizeof(float) * ((size_t)n * D * 2 + (size_t)hd));
    if (!proj) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter context append");
    float *ctxv = proj + (int64_t)n * D, *tmp = ctxv + (int64_t)n * D;
    const int64_t pos0 = (int64_t)c->len;
    /* c = hidden_norm(fc(feat)) feeds every layer's K/V; the n new rows go through each projection
     * together (kdt_weight_matmul: every row's values exactly as alone) */
    kdt_weight_matmul(&d->fc, feat, (int64_t)cf->n_taps * D, n, proj, D, 0, D);
    for (int32_t r = 0; r < n; r++) rmsnorm(proj + (int64_t)r * D, &d->hidden_norm, D, cf->rms_eps, ctxv + (int64_t)r * D);
    for (int32_t l = 0; l < cf->n_layers; l++) {
        const dflash_layer *L = &d->layers[l];
        float *k = c->k[l] + pos0 * c->kv_dim, *v = c->v[l] + pos0 * c->kv_dim;
        kdt_weight_matmul(&L->k, ctxv, D, n, k, c->kv_dim, 0, (int64_t)KV * hd);
        kdt_weight_matmul(&L->v, ctxv, D, n, v, c->kv_dim, 0, (int64_t)KV * hd);
        for (int32_t r = 0; r < n; r++) norm_rope_heads(d, k + (int64_t)r * c->kv_dim, KV, &L->k_norm, pos0 + r, tmp);
    }
    c->len += n;
    free(proj);
    return KDT_OK;
}

/* ---- draft attention -------------------------------------------------------------------------- */

/* One query head over all T block rows (non-causal: every row sees the same keys), fixed
 * arithmetic per (row, head): s_j = (sum over e ascending of q[e] * k_j[e]) * scale, m = max s_j,
 * p_j = expf(s_j - m), l = sum of p_j (j ascending), o[e] = sum over j ascending of (p_j / l) *
 * v_j[e]. The scores, softmax weights and weighted sum are attn_cpu.c's (plain C or AVX2, the
 * same bits; the block rows are the AVX2 score lanes). */
typedef struct draft_attn_job {
    const float *q;            /* [T][q_dim] */
    float *att;                /* [T][q_dim] */
    const float *const *kp;    /* [n_kv_heads][n_keys] key rows of each KV head */
    const float *const *vp;    /* [n_kv_heads][n_keys] value rows */
    int32_t T, n_keys, hd, q_dim, group;
    float scale;
    float *scratch;            /* per worker: [T][n_keys] scores, [hd][8] transposed queries */
} draft_attn_job;

/* row t's softmax and output from its scores s: o = sum over keys of (p_k / l) * v_k */
static void draft_softmax_out(const draft_attn_job *j, const float *const *vp, float *s, float *o) {
    const float sum = kdt_cpu_softmax_weights(s, j->n_keys);
    for (int32_t k = 0; k < j->n_keys; k++) s[k] = s[k] / sum; /* the weight of key k */
    kdt_cpu_weighted_sum(s, vp, j->n_keys, j->hd, o);
}

/* heads [b, e) of the job, one worker's scratch */
static void draft_attn_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const draft_attn_job *j = ctx;
    float *sc = j->scratch + (int64_t)worker * ((int64_t)j->T * j->n_keys + (int64_t)j->hd * 8);
    for (int64_t hh = b; hh < e; hh++) {
        const int64_t g = hh / j->group;
        const float *const *kp = j->kp + g * j->n_keys, *const *vp = j->vp + g * j->n_keys;
        for (int32_t t0 = 0; t0 < j->T; t0 += 8) /* the scores of 8 rows at a time (attn_cpu.c) */
            kdt_cpu_scores(kp, j->n_keys, j->hd, j->scale, j->T - t0 < 8 ? j->T - t0 : 8,
                           j->q + (int64_t)t0 * j->q_dim + hh * j->hd, j->q_dim, sc + (int64_t)t0 * j->n_keys,
                           sc + (int64_t)j->T * j->n_keys);
        for (int32_t t = 0; t < j->T; t++)
            draft_softmax_out(j, vp, sc + (int64_t)t * j->n_keys, j->att + (int64_t)t * j->q_dim + hh * j->hd);
    }
}

/* ---- draft forward -------------------------------------------------------------------------- */

static kdt_status draft_one(const kdt_dflash *d, const kdt_dflash_ctx *c, int32_t anchor,
                            float *logits /* [L][V] */, float *ws, const float **kp, const float **vp, int workers) {
    const kdt_dflash_config *cf = &d->cfg;
    const int32_t T = cf->block_size, D = cf->hidden_size, H = cf->n_heads, KV = cf->n_kv_heads,
                  hd = cf->head_dim, I = cf->intermediate_size, group = H / KV;
    const int32_t P = c->len, n_keys = P + T, qd = H * hd, kvd = KV * hd;
    /* workspace carve-up (sizes in drafter_ws_floats) */
    float *x = ws;                           /* [T][D] residual stream */
    float *h = x + (int64_t)T * D;           /* [T][D] normed */
    float *q = h + (int64_t)T * D;           /* [T][H*hd] */
    float *kb = q + (int64_t)T * qd;         /* [T][KV*hd] block keys */
    float *vb = kb + (int64_t)T * kvd;       /* [T][KV*hd] block values */
    float *att = vb + (int64_t)T * kvd;      /* [T][H*hd] attention output */
    float *mlp_a = att + (int64_t)T * qd;    /* [T][I] */
    float *mlp_b = mlp_a + (int64_t)T * I;   /* [T][I] */
    float *tmp = mlp_b + (int64_t)T * I;     /* [T][max(D, hd)] */
    float *scores = tmp + (int64_t)T * (D > hd ? D : hd); /* per worker: [T][n_keys] + [hd][8] */

    int32_t ids[KDT_MAX_DEPTH + 1];
    ids[0] = anchor;
    for (int32_t t = 1; t < T; t++) ids[t] = cf->mask_token_id;
    KDT_TRY(kdt_target_embed_rows(d->target, ids, T, x));
    const float scale = 1.0f / sqrtf((float)hd);

    for (int32_t l = 0; l < cf->n_layers; l++) {
        const dflash_layer *L = &d->layers[l];
        /* the block's rows go through each projection together (kdt_weight_matmul: every row's
         * values exactly as alone, each weight row read once per block of rows) */
        for (int32_t t = 0; t < T; t++) rmsnorm(x + (int64_t)t * D, &L->in_norm, D, cf->rms_eps, h + (int64_t)t * D);
        kdt_weight_matmul(&L->q, h, D, T, q, qd, 0, qd);
        kdt_weight_matmul(&L->k, h, D, T, kb, kvd, 0, kvd);
        kdt_weight_matmul(&L->v, h, D, T, vb, kvd, 0, kvd);
        for (int32_t t = 0; t < T; t++) {
            const int64_t pos = (int64_t)P + t;
            norm_rope_heads(d, q + (int64_t)t * qd, H, &L->q_norm, pos, tmp);
            norm_rope_heads(d, kb + (int64_t)t * kvd, KV, &L->k_norm, pos, tmp);
        }
        /* non-causal attention: every block row sees context keys 0..P-1 and all T block keys;
         * the query heads spread over the CPU workers */
        for (int32_t g = 0; g < KV; g++)
            for (int32_t jk = 0; jk < n_keys; jk++) {
                kp[(int64_t)g * n_keys + jk] = jk < P ? c->k[l] + (int64_t)jk * kvd + (int64_t)g * hd
                                                      : kb + (int64_t)(jk - P) * kvd + (int64_t)g * hd;
                vp[(int64_t)g * n_keys + jk] = jk < P ? c->v[l] + (int64_t)jk * kvd + (int64_t)g * hd
                                                      : vb + (int64_t)(jk - P) * kvd + (int64_t)g * hd;
            }
        draft_attn_job aj = {q, att, kp, vp, T, n_keys, hd, qd, group, scale, scores};
        kdt_parallel_for(H, 1, 2.0 * T * n_keys * hd, workers, draft_attn_piece, &aj);
        kdt_weight_matmul(&L->o, att, qd, T, tmp, D, 0, D);
        for (int32_t t = 0; t < T; t++) {
            float *xt = x + (int64_t)t * D;
            const float *ot = tmp + (int64_t)t * D;
            for (int32_t i = 0; i < D; i++) xt[i] += ot[i];
            rmsnorm(xt, &L->post_norm, D, cf->rms_eps, h + (int64_t)t * D);
        }
        kdt_weight_swiglu_rows(&L->gate, &L->up, &L->down, h, D, T, mlp_a, mlp_b, tmp, D);
        for (int32_t t = 0; t < T; t++) {
            float *xt = x + (int64_t)t * D;
            const float *dt = tmp + (int64_t)t * D;
            for (int32_t i = 0; i < D; i++) xt[i] += dt[i];
        }
    }
    /* final norm on rows 1..L, then the target's lm_head */
    for (int32_t t = 1; t < T; t++) rmsnorm(x + (int64_t)t * D, &d->norm, D, cf->rms_eps, h + (int64_t)(t - 1) * D);
    kdt_target_lm_head_rows(d->target, h, T - 1, logits);
    return KDT_OK;
}

kdt_status kdt_dflash_draft(const kdt_dflash *d, kdt_dflash_ctx *const *ctx, int32_t n_streams,
                            const int32_t *anchor, float *logits) {
    KDT_CHECK_ARG(d && ctx && anchor && logits && n_streams >= 1,
                  "kdt_dflash_draft: bad arguments (n_streams %d)", n_streams);
    const kdt_dflash_config *cf = &d->cfg;
    const int32_t T = cf->block_size, L = T - 1, D = cf->hidden_size, hd = cf->head_dim;
    int32_t max_p = 0;
    for (int32_t s = 0; s < n_streams; s++) {
        KDT_CHECK_ARG(ctx[s] != NULL, "kdt_dflash_draft: ctx[%d] is NULL", s);
        KDT_CHECK_ARG(anchor[s] >= 0 && anchor[s] < d->vocab,
                      "kdt_dflash_draft: anchor[%d] = %d outside 0..%d", s, anchor[s], d->vocab - 1);
        /* No bound by max_position_embeddings: RoPE is computed per position, so a block past it
         * is extrapolated as transformers does (and as the GPU drafter, whose table spans the
         * engine's context). Drafts there may be poorer; the output is the target's either way.
         * Refusing here failed every stream whose context outgrew a short-window drafter. */
        if (ctx[s]->len > max_p) max_p = ctx[s]->len;
    }
    const int64_t qd = (int64_t)cf->n_heads * hd, kvd = (int64_t)cf->n_kv_heads * hd;
    const int workers = kdt_cpu_threads() < cf->n_heads ? kdt_cpu_threads() : cf->n_heads;
    const int64_t max_keys = (int64_t)max_p + T;
    const int64_t n_ws = 2 * (int64_t)T * D + 2 * T * qd + 2 * T * kvd + 2 * (int64_t)T * cf->intermediate_size +
                         (int64_t)T * (D > hd ? D : hd) + workers * ((int64_t)T * max_keys + (int64_t)hd * 8);
    float *ws = malloc(sizeof(float) * (size_t)n_ws);
    const float **kv_rows = malloc(sizeof(float *) * 2 * (size_t)cf->n_kv_heads * (size_t)max_keys);
    if (!ws || !kv_rows) {
        free(ws), free(kv_rows);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "drafter workspace (%lld floats)", (long long)n_ws);
    }
    kdt_status st = KDT_OK;
    for (int32_t s = 0; s < n_streams && st == KDT_OK; s++)
        st = draft_one(d, ctx[s], anchor[s], logits + (int64_t)s * L * d->vocab, ws, kv_rows,
                       kv_rows + (int64_t)cf->n_kv_heads * max_keys, workers);
    free(ws), free(kv_rows);
    return st;
}

/* ---- weight views for the GPU upload -------------------------------------------------------- */

const struct kdt_weight *kdt_dflash_weight(const kdt_dflash *d, int32_t layer, kdt_dflash_wid id) {
    if (!d) return NULL;
    switch (id) {
    case KDT_DFW_FC: return &d->fc;
    case KDT_DFW_HIDDEN_NORM: return &d->hidden_norm;
    case KDT_DFW_NORM: return &d->norm;
    default: break;
    }
    if (layer < 0 || layer >= d->cfg.n_layers) return NULL;
    const dflash_layer *L = &d->layers[layer];
    switch (id) {
    case KDT_DFW_IN_NORM: return &L->in_norm;
    case KDT_DFW_POST_NORM: return &L->post_norm;
    case KDT_DFW_Q: return &L->q;
    case KDT_DFW_K: return &L->k;
    case KDT_DFW_V: return &L->v;
    case KDT_DFW_O: return &L->o;
    case KDT_DFW_Q_NORM: return &L->q_norm;
    case KDT_DFW_K_NORM: return &L->k_norm;
    case KDT_DFW_GATE: return &L->gate;
    case KDT_DFW_UP: return &L->up;
    case KDT_DFW_DOWN: return &L->down;
    default: return NULL;
    }
}
