/* config.c - config.json -> kdt_model_config: reads the fields that change the math, in both the
 * transformers-5 form (rope_parameters) and the published form (rope_theta + rope_scaling), and
 * unwraps multimodal configs (Kimi K2.5/K2.6: the text model under "text_config"). Missing
 * optional fields take transformers' DeepseekV3Config defaults; unknown fields are ignored;
 * values that cannot describe a model, or incoherent RoPE settings, are KDT_ERR_FORMAT; valid
 * settings this runtime does not implement are KDT_ERR_UNSUPPORTED. Also computes the RoPE
 * inverse frequencies exactly as transformers does (fp32). */
#include "model_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct cfg_ctx {
    const char *path;
    json_t *obj;    /* the text model's config object */
} cfg_ctx;

/* Integer field. Absent or null: *out = def, or an error if required. */
static kdt_status get_int(const cfg_ctx *c, const char *key, int required, int64_t def, int64_t lo,
                          int64_t hi, int32_t *out) {
    json_t *v = json_object_get(c->obj, key);
    if (!v || json_is_null(v)) {
        if (required) return kdt_fail(KDT_ERR_FORMAT, "%s: field \"%s\" is missing", c->path, key);
        *out = (int32_t)def;
        return KDT_OK;
    }
    int64_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (int64_t)json_real_value(v);
    } else {
        return kdt_fail(KDT_ERR_FORMAT, "%s: field \"%s\" must be an integer", c->path, key);
    }
    if (x < lo || x > hi)
        return kdt_fail(KDT_ERR_FORMAT, "%s: field \"%s\" = %lld is outside %lld..%lld", c->path, key,
                        (long long)x, (long long)lo, (long long)hi);
    *out = (int32_t)x;
    return KDT_OK;
}

static kdt_status get_num_in(const char *path, json_t *obj, const char *where, const char *key,
                             int required, double def, double *out, int *present) {
    json_t *v = json_object_get(obj, key);
    if (present) *present = v && !json_is_null(v);
    if (!v || json_is_null(v)) {
        if (required)
            return kdt_fail(KDT_ERR_FORMAT, "%s: field \"%s%s\" is missing", path, where, key);
        *out = def;
        return KDT_OK;
    }
    if (!json_is_number(v) || !isfinite(json_number_value(v)))
        return kdt_fail(KDT_ERR_FORMAT, "%s: field \"%s%s\" must be a number", path, where, key);
    *out = json_number_value(v);
    return KDT_OK;
}

static kdt_status get_bool(const cfg_ctx *c, const char *key, int def, int32_t *out) {
    json_t *v = json_object_get(c->obj, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return KDT_OK;
    }
    if (json_is_boolean(v)) {
        *out = json_is_true(v);
        return KDT_OK;
    }
    if (json_is_integer(v) && (json_integer_value(v) == 0 || json_integer_value(v) == 1)) {
        *out = (int32_t)json_integer_value(v);
        return KDT_OK;
    }
    return kdt_fail(KDT_ERR_FORMAT, "%s: field \"%s\" must be true or false", c->path, key);
}

static const char *get_str(const cfg_ctx *c, const char *key) {
    json_t *v = json_object_get(c->obj, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}


kdt_status kdt_rope_check_theta(const char *path, double theta) {
    /* the frequencies are theta^(-2i/d) in fp32 and YaRN divides by ln(theta): beyond these bounds
     * they are 0, infinite or reversed (published models use 1e4 .. 1e7) */
    if (!(theta > 1) || !(theta <= 1e30))
        return kdt_fail(KDT_ERR_FORMAT, "%s: rope_theta = %g must be in (1, 1e30]", path, theta);
    return KDT_OK;
}

kdt_status kdt_rope_settle_yarn(const char *path, double factor, double *beta_fast, double *beta_slow,
                                double mscale, double mscale_all_dim, double original_max) {
    if (*beta_fast == 0) *beta_fast = 32.0; /* transformers: `beta_fast or 32` */
    if (*beta_slow == 0) *beta_slow = 1.0;
    const double bf = *beta_fast, bs = *beta_slow;
    if (!(factor >= 1.0) || !(factor <= 1e6)) /* published: 4 .. 64; 1/factor stays a normal fp32 */
        return kdt_fail(KDT_ERR_FORMAT, "%s: incoherent RoPE config: YaRN factor %g outside [1, 1e6]", path, factor);
    if (!(bf > 0) || !(bs > 0) || bf < bs) /* a negative beta makes the correction range NaN */
        return kdt_fail(KDT_ERR_FORMAT, "%s: incoherent RoPE config: need beta_fast >= beta_slow > 0 (got %g, %g)",
                        path, bf, bs);
    if (!(mscale >= 0) || !(mscale_all_dim >= 0))
        return kdt_fail(KDT_ERR_FORMAT, "%s: incoherent RoPE config: negative mscale", path);
    if (!(original_max >= 1) || original_max != floor(original_max) || original_max > 1e9)
        return kdt_fail(KDT_ERR_FORMAT, "%s: incoherent RoPE config: original_max_position_embeddings = %g", path,
                        original_max);
    return KDT_OK;
}

/* RoPE settings from rope_parameters (new) or rope_theta + rope_scaling (published). */
static kdt_status parse_rope(const cfg_ctx *c, kdt_model_config *cfg) {
    json_t *rp = json_object_get(c->obj, "rope_parameters");
    json_t *rs = json_object_get(c->obj, "rope_scaling");
    json_t *top_theta = json_object_get(c->obj, "rope_theta");
    if (rp && !json_is_null(rp) && !json_is_object(rp))
        return kdt_fail(KDT_ERR_FORMAT, "%s: \"rope_parameters\" must be an object", c->path);
    if (rs && !json_is_null(rs) && !json_is_object(rs))
        return kdt_fail(KDT_ERR_FORMAT, "%s: \"rope_scaling\" must be an object or null", c->path);
    if (top_theta && !json_is_null(top_theta) &&
        (!json_is_number(top_theta) || !(json_number_value(top_theta) > 0)))
        return kdt_fail(KDT_ERR_FORMAT, "%s: \"rope_theta\" must be a positive number", c->path);

    json_t *src = NULL; /* the object holding type + YaRN fields */
    const char *where;
    double theta = 10000.0; /* DeepseekV3Config.default_theta */
    if (json_is_object(rp)) {
        src = rp;
        where = "rope_parameters.";
        int have;
        KDT_TRY(get_num_in(c->path, rp, where, "rope_theta", 0, 0, &theta, &have));
        if (!have) {
            if (json_is_number(top_theta)) theta = json_number_value(top_theta);
            else return kdt_fail(KDT_ERR_FORMAT, "%s: \"rope_parameters\" has no rope_theta", c->path);
        } else if (json_is_number(top_theta) && json_number_value(top_theta) != theta) {
            return kdt_fail(KDT_ERR_FORMAT,
                            "%s: incoherent RoPE config: rope_theta %g but rope_parameters.rope_theta %g",
                            c->path, json_number_value(top_theta), theta);
        }
        if (json_is_object(rs)) {
            /* both forms present: they must agree on the type and factor */
            json_t *t1 = json_object_get(rp, "rope_type"), *t2 = json_object_get(rs, "rope_type");
            if (!t2) t2 = json_object_get(rs, "type");
            json_t *f1 = json_object_get(rp, "factor"), *f2 = json_object_get(rs, "factor");
            if (!json_equal(t1, t2) || (f1 && f2 && json_number_value(f1) != json_number_value(f2)))
                return kdt_fail(KDT_ERR_FORMAT,
                                "%s: incoherent RoPE config: rope_parameters and rope_scaling disagree",
                                c->path);
        }
    } else {
        where = "rope_scaling.";
        if (json_is_number(top_theta)) theta = json_number_value(top_theta);
        if (json_is_object(rs)) {
            src = rs;
            json_t *t = json_object_get(rs, "rope_theta");
            if (t && json_is_number(t) && json_is_number(top_theta) && json_number_value(t) != theta)
                return kdt_fail(KDT_ERR_FORMAT, "%s: incoherent RoPE config: two rope_theta values", c->path);
        }
    }
    KDT_TRY(kdt_rope_check_theta(c->path, theta));
    cfg->rope_theta = theta;
    cfg->rope_kind = KDT_ROPE_DEFAULT;
    cfg->rope_factor = 1.0;
    cfg->rope_beta_fast = 32.0;
    cfg->rope_beta_slow = 1.0;
    cfg->rope_mscale = 0;
    cfg->rope_mscale_all_dim = 0;
    cfg->rope_original_max_position = cfg->max_position_embeddings;
    cfg->rope_attention_factor = 1.0f;

    const char *type = "default";
    if (src) {
        json_t *t = json_object_get(src, "rope_type");
        if (!t || json_is_null(t)) t = json_object_get(src, "type");
        if (t && !json_is_null(t)) {
            if (!json_is_string(t))
                return kdt_fail(KDT_ERR_FORMAT, "%s: \"%srope_type\" must be a string", c->path, where);
            type = json_string_value(t);
        } else if (src == rs) {
            return kdt_fail(KDT_ERR_FORMAT, "%s: \"rope_scaling\" has no type / rope_type", c->path);
        }
    }
    if (strcmp(type, "default") == 0) return KDT_OK;
    if (strcmp(type, "yarn") != 0)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: RoPE type \"%s\" is not supported (default, yarn)",
                        c->path, type);

    cfg->rope_kind = KDT_ROPE_YARN;
    double factor = 0, bf = 0, bs = 0, ms = 0, msad = 0, omax = 0, af = 0;
    int have_af;
    KDT_TRY(get_num_in(c->path, src, where, "factor", 1, 0, &factor, NULL));
    KDT_TRY(get_num_in(c->path, src, where, "beta_fast", 0, 0, &bf, NULL));
    KDT_TRY(get_num_in(c->path, src, where, "beta_slow", 0, 0, &bs, NULL));
    KDT_TRY(get_num_in(c->path, src, where, "mscale", 0, 0, &ms, NULL));
    KDT_TRY(get_num_in(c->path, src, where, "mscale_all_dim", 0, 0, &msad, NULL));
    KDT_TRY(get_num_in(c->path, src, where, "original_max_position_embeddings", 0,
                   cfg->max_position_embeddings, &omax, NULL));
    KDT_TRY(get_num_in(c->path, src, where, "attention_factor", 0, 0, &af, &have_af));
    json_t *trunc = json_object_get(src, "truncate");
    if (trunc && !json_is_null(trunc) && !json_is_boolean(trunc))
        return kdt_fail(KDT_ERR_FORMAT, "%s: \"%struncate\" must be true or false", c->path, where);
    if (trunc && json_is_false(trunc))
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: YaRN with truncate = false is not supported", c->path);
    KDT_TRY(kdt_rope_settle_yarn(c->path, factor, &bf, &bs, ms, msad, omax));
    if (have_af && !(af > 0))
        return kdt_fail(KDT_ERR_FORMAT, "%s: incoherent RoPE config: attention_factor %g", c->path, af);
    cfg->rope_factor = factor;
    cfg->rope_beta_fast = bf;
    cfg->rope_beta_slow = bs;
    cfg->rope_mscale = ms;
    cfg->rope_mscale_all_dim = msad;
    cfg->rope_original_max_position = (int32_t)omax;
    /* cos/sin amplitude, as transformers' _compute_yarn_parameters */
    if (have_af) cfg->rope_attention_factor = (float)af;
    else if (ms != 0 && msad != 0)
        cfg->rope_attention_factor = (float)(kdt_yarn_mscale(factor, ms) / kdt_yarn_mscale(factor, msad));
    else cfg->rope_attention_factor = (float)kdt_yarn_mscale(factor, 1.0);
    return KDT_OK;
}

/* quantization_config (text config or top level): block FP8 or INT4 pack-quantized. */
static kdt_status parse_quant(const char *path, json_t *obj, json_t *root, kdt_model_config *cfg) {
    json_t *q = json_object_get(obj, "quantization_config");
    if (!q || json_is_null(q)) q = json_object_get(root, "quantization_config");
    cfg->weight_quant = KDT_QUANT_NONE;
    cfg->quant_block_rows = cfg->quant_block_cols = 0;
    if (!q || json_is_null(q)) return KDT_OK;
    json_t *qm = json_object_get(q, "quant_method");
    const char *method = json_is_string(qm) ? json_string_value(qm) : "?";
    if (strcmp(method, "fp8") == 0) {
        json_t *fmt = json_object_get(q, "fmt"), *bs = json_object_get(q, "weight_block_size");
        if (fmt && (!json_is_string(fmt) || strcmp(json_string_value(fmt), "e4m3") != 0))
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: quantization_config.fmt is not \"e4m3\"", path);
        int64_t br = 128, bc = 128;
        if (bs) {
            if (!json_is_array(bs) || json_array_size(bs) != 2 || !json_is_integer(json_array_get(bs, 0)) ||
                !json_is_integer(json_array_get(bs, 1)))
                return kdt_fail(KDT_ERR_FORMAT, "%s: quantization_config.weight_block_size must be [rows, cols]",
                                path);
            br = json_integer_value(json_array_get(bs, 0));
            bc = json_integer_value(json_array_get(bs, 1));
        }
        if (br < 1 || bc < 1 || br > 65536 || bc > 65536)
            return kdt_fail(KDT_ERR_FORMAT, "%s: quantization_config.weight_block_size [%lld, %lld]", path,
                            (long long)br, (long long)bc);
        cfg->weight_quant = KDT_QUANT_FP8_BLOCK;
        cfg->quant_block_rows = (int32_t)br;
        cfg->quant_block_cols = (int32_t)bc;
        return KDT_OK;
    }
    if (strcmp(method, "compressed-tensors") == 0) {
        json_t *fmt = json_object_get(q, "format"), *groups = json_object_get(q, "config_groups");
        if (!json_is_string(fmt) || strcmp(json_string_value(fmt), "pack-quantized") != 0)
            return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: compressed-tensors format \"%s\" is not supported "
                            "(pack-quantized)", path, json_is_string(fmt) ? json_string_value(fmt) : "?");
        if (!json_is_object(groups) || json_object_size(groups) == 0)
            return kdt_fail(KDT_ERR_FORMAT, "%s: quantization_config.config_groups is missing", path);
        int64_t gsize = 0;
        const char *gname;
        json_t *g;
        json_object_foreach(groups, gname, g) {
            json_t *w = json_object_get(g, "weights"), *ia = json_object_get(g, "input_activations");
            json_t *nb = json_object_get(w, "num_bits"), *ty = json_object_get(w, "type"),
                   *sym = json_object_get(w, "symmetric"), *strat = json_object_get(w, "strategy"),
                   *gs = json_object_get(w, "group_size");
            if (!json_is_object(w) || !json_is_integer(nb) || json_integer_value(nb) != 4 || !json_is_string(ty) ||
                strcmp(json_string_value(ty), "int") != 0 || !json_is_true(sym) || !json_is_string(strat) ||
                strcmp(json_string_value(strat), "group") != 0 || !json_is_integer(gs) ||
                json_integer_value(gs) < 1 || json_integer_value(gs) > 65536 || (ia && !json_is_null(ia)))
                return kdt_fail(KDT_ERR_UNSUPPORTED,
                                "%s: config_groups.%s: only symmetric int4 weights with group strategy and "
                                "bf16 activations (W4A16) are supported", path, gname);
            if (gsize && json_integer_value(gs) != gsize)
                return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: config_groups with different group sizes", path);
            gsize = json_integer_value(gs);
        }
        cfg->weight_quant = KDT_QUANT_INT4_GROUP;
        cfg->quant_block_rows = 1;
        cfg->quant_block_cols = (int32_t)gsize;
        return KDT_OK;
    }
    return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: quantization_config.quant_method \"%s\" is not supported "
                    "(fp8, compressed-tensors)", path, method);
}

/* Appends eos_token_id (an integer or a list of them) to cfg's eos ids, without repeats, up to
 * KDT_MODEL_MAX_EOS. An id outside the vocabulary can never be produced: it is dropped rather than
 * failed, and tested as the JSON's 64-bit value, so 2^32 + 5 is not taken for 5. */
static void add_eos_ids(kdt_model_config *cfg, json_t *eos) {
    const size_t n = json_is_array(eos) ? json_array_size(eos) : 1;
    for (size_t i = 0; i < n && cfg->n_eos < KDT_MODEL_MAX_EOS; i++) {
        json_t *v = json_is_array(eos) ? json_array_get(eos, i) : eos;
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= cfg->vocab_size) continue;
        const int32_t id = (int32_t)json_integer_value(v);
        int dup = 0;
        for (int32_t k = 0; k < cfg->n_eos; k++) dup |= cfg->eos_token_ids[k] == id;
        if (!dup) cfg->eos_token_ids[cfg->n_eos++] = id;
    }
}

kdt_status kdt_config_parse(const char *text, size_t len, const char *path, kdt_model_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root)
        return kdt_fail(KDT_ERR_FORMAT, "%s: not valid JSON (%s, line %d)", path, jerr.text, jerr.line);
    kdt_status st = KDT_OK;
    if (!json_is_object(root)) {
        st = kdt_fail(KDT_ERR_FORMAT, "%s: not a JSON object", path);
        goto done;
    }
    cfg_ctx c = {path, root};
    json_t *tc = json_object_get(root, "text_config");
    if (tc && !json_is_null(tc)) {
        if (!json_is_object(tc)) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: \"text_config\" must be an object", path);
            goto done;
        }
        c.obj = tc;
    }
    const char *mt = get_str(&c, "model_type");
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", mt ? mt : "");
    /* A config of another architecture (no MLA latent rank) is refused for what it is, not at its
     * first missing field: kdtree runs DeepSeek-V3-family models only. */
    if (!json_object_get(c.obj, "kv_lora_rank")) {
        json_t *arch = json_object_get(c.obj, "architectures");
        if (!json_is_array(arch)) arch = json_object_get(root, "architectures");
        const char *a0 = json_is_array(arch) ? json_string_value(json_array_get(arch, 0)) : NULL;
        st = kdt_fail(KDT_ERR_UNSUPPORTED,
                      "%s: not a DeepSeek-V3-family config (model_type \"%s\"%s%s%s): it has no \"kv_lora_rank\" "
                      "(MLA); kdtree runs deepseek_v3 / kimi_k2 / kimi_k25 checkpoints",
                      path, mt ? mt : "", a0 ? ", " : "", a0 ? a0 : "", a0 ? "" : "");
        goto done;
    }

#define GI(key, req, def, lo, hi, dst)                                         \
    do {                                                                       \
        if ((st = get_int(&c, key, req, def, lo, hi, dst)) != KDT_OK) goto done; \
    } while (0)
    const int64_t BIG = 1 << 24;
    GI("vocab_size", 1, 0, 1, KDT_MAX_VOCAB, &cfg->vocab_size);
    GI("hidden_size", 1, 0, 1, 1 << 16, &cfg->hidden_size);
    GI("intermediate_size", 1, 0, 1, BIG, &cfg->intermediate_size);
    GI("num_hidden_layers", 1, 0, 1, 4096, &cfg->n_layers);
    GI("num_attention_heads", 1, 0, 1, 1024, &cfg->n_heads);
    GI("kv_lora_rank", 1, 0, 1, 1 << 16, &cfg->kv_lora_rank);
    GI("qk_nope_head_dim", 1, 0, 1, 1 << 16, &cfg->qk_nope_head_dim);
    GI("qk_rope_head_dim", 1, 0, 2, 1 << 16, &cfg->qk_rope_head_dim);
    GI("v_head_dim", 1, 0, 1, 1 << 16, &cfg->v_head_dim);
    GI("max_position_embeddings", 1, 0, 1, 1 << 30, &cfg->max_position_embeddings);
    GI("q_lora_rank", 0, 1536, 0, 1 << 16, &cfg->q_lora_rank); /* null = no q LoRA */
    if (json_is_null(json_object_get(c.obj, "q_lora_rank"))) cfg->q_lora_rank = 0;
    GI("n_routed_experts", 0, 256, 0, 1 << 16, &cfg->n_routed_experts);
    if (json_is_null(json_object_get(c.obj, "n_routed_experts"))) cfg->n_routed_experts = 0;
    GI("num_experts_per_tok", 0, 8, 0, 1 << 16, &cfg->n_experts_per_tok);
    GI("n_shared_experts", 0, 1, 0, 1 << 10, &cfg->n_shared_experts);
    if (json_is_null(json_object_get(c.obj, "n_shared_experts"))) cfg->n_shared_experts = 0;
    GI("moe_intermediate_size", 0, 2048, 1, BIG, &cfg->moe_intermediate_size);
    GI("n_group", 0, 8, 1, 1 << 16, &cfg->n_group);
    GI("topk_group", 0, 4, 1, 1 << 16, &cfg->topk_group);
    GI("first_k_dense_replace", 0, 3, 0, 1 << 16, &cfg->first_k_dense_replace);
    GI("moe_layer_freq", 0, 1, 1, 1 << 16, &cfg->moe_layer_freq);
    GI("bos_token_id", 0, -1, -1, KDT_MAX_VOCAB, &cfg->bos_token_id);
    int32_t kv_heads;
    GI("num_key_value_heads", 0, cfg->n_heads, 1, 1024, &kv_heads);
#undef GI
    if (cfg->qk_rope_head_dim % 2) {
        st = kdt_fail(KDT_ERR_FORMAT, "%s: qk_rope_head_dim = %d must be even", path, cfg->qk_rope_head_dim);
        goto done;
    }
    if (kv_heads != cfg->n_heads) {
        st = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: num_key_value_heads %d != num_attention_heads %d", path,
                      kv_heads, cfg->n_heads);
        goto done;
    }
    if ((st = get_bool(&c, "norm_topk_prob", 1, &cfg->norm_topk_prob)) != KDT_OK) goto done;
    if ((st = get_bool(&c, "tie_word_embeddings", 0, &cfg->tie_word_embeddings)) != KDT_OK) goto done;
    if ((st = get_bool(&c, "rope_interleave", 1, &cfg->rope_interleave)) != KDT_OK) goto done;
    int32_t attn_bias;
    if ((st = get_bool(&c, "attention_bias", 0, &attn_bias)) != KDT_OK) goto done;
    if (attn_bias) {
        st = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: attention_bias = true is not supported", path);
        goto done;
    }
    double d = 0;
    if ((st = get_num_in(path, c.obj, "", "rms_norm_eps", 0, 1e-6, &d, NULL)) != KDT_OK) goto done;
    if (!(d > 0 && d < 1)) {
        st = kdt_fail(KDT_ERR_FORMAT, "%s: rms_norm_eps = %g", path, d);
        goto done;
    }
    cfg->rms_norm_eps = (float)d;
    if ((st = get_num_in(path, c.obj, "", "routed_scaling_factor", 0, 2.5, &d, NULL)) != KDT_OK) goto done;
    if (!(d > 0)) {
        st = kdt_fail(KDT_ERR_FORMAT, "%s: routed_scaling_factor = %g", path, d);
        goto done;
    }
    cfg->routed_scaling_factor = (float)d;

    const char *act = get_str(&c, "hidden_act");
    if (act && strcmp(act, "silu") != 0) {
        st = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: hidden_act \"%s\" is not supported (silu)", path, act);
        goto done;
    }
    const char *scoring = get_str(&c, "scoring_func");
    if (scoring && strcmp(scoring, "sigmoid") != 0) {
        st = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: scoring_func \"%s\" is not supported (sigmoid)", path, scoring);
        goto done;
    }
    const char *topk_method = get_str(&c, "topk_method");
    if (topk_method && strcmp(topk_method, "noaux_tc") != 0) {
        st = kdt_fail(KDT_ERR_UNSUPPORTED, "%s: topk_method \"%s\" is not supported (noaux_tc)", path,
                      topk_method);
        goto done;
    }
    if ((st = parse_quant(path, c.obj, root, cfg)) != KDT_OK) goto done;

    /* MoE coherence (only when some layer is MoE) */
    int any_moe = 0;
    for (int32_t l = cfg->first_k_dense_replace; l < cfg->n_layers; l++)
        if (l % cfg->moe_layer_freq == 0) any_moe = 1;
    if (cfg->n_routed_experts == 0) any_moe = 0;
    if (!any_moe) {
        cfg->first_k_dense_replace = cfg->n_layers;
    } else {
        int32_t E = cfg->n_routed_experts, G = cfg->n_group;
        if (E % G != 0) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: n_routed_experts %d is not a multiple of n_group %d", path, E, G);
            goto done;
        }
        if (cfg->topk_group > G) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: topk_group %d > n_group %d", path, cfg->topk_group, G);
            goto done;
        }
        if (cfg->n_experts_per_tok < 1 || cfg->n_experts_per_tok > E) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: num_experts_per_tok %d must be in 1..n_routed_experts (%d)",
                          path, cfg->n_experts_per_tok, E);
            goto done;
        }
        if (G > 1 && E / G < 2) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: %d experts per group; the group score needs >= 2", path, E / G);
            goto done;
        }
        if ((int64_t)cfg->topk_group * (E / G) < cfg->n_experts_per_tok) {
            st = kdt_fail(KDT_ERR_FORMAT,
                          "%s: topk_group %d groups of %d experts cannot supply num_experts_per_tok %d", path,
                          cfg->topk_group, E / G, cfg->n_experts_per_tok);
            goto done;
        }
    }

    /* special tokens */
    json_t *eos = json_object_get(c.obj, "eos_token_id");
    if (!eos || json_is_null(eos)) eos = json_object_get(root, "eos_token_id");
    add_eos_ids(cfg, eos);

    if ((st = parse_rope(&c, cfg)) != KDT_OK) goto done;
    {
        double scale = 1.0 / sqrt((double)(cfg->qk_nope_head_dim + cfg->qk_rope_head_dim));
        if (cfg->rope_kind == KDT_ROPE_YARN && cfg->rope_mscale_all_dim != 0) {
            double m = kdt_yarn_mscale(cfg->rope_factor, cfg->rope_mscale_all_dim);
            scale = scale * m * m;
        }
        cfg->softmax_scale = (float)scale;
    }
done:
    json_decref(root);
    return st;
}

void kdt_rope_inv_freq(const kdt_model_config *cfg, float *inv_freq) {
    const int32_t dim = cfg->qk_rope_head_dim, half = dim / 2;
    const float base = (float)cfg->rope_theta;
    for (int32_t i = 0; i < half; i++) {
        /* torch: base ** (arange(0, dim, 2).float() / dim), all fp32 */
        float pos_freq = powf(base, (float)(2 * i) / (float)dim);
        float extrapolation = 1.0f / pos_freq;
        if (cfg->rope_kind != KDT_ROPE_YARN) {
            inv_freq[i] = extrapolation;
            continue;
        }
        float interpolation = 1.0f / ((float)cfg->rope_factor * pos_freq);
        /* find_correction_range (python floats), truncated to integers */
        const double two_pi = 6.283185307179586;
        double omax = cfg->rope_original_max_position;
        double lo = dim * log(omax / (cfg->rope_beta_fast * two_pi)) / (2 * log(cfg->rope_theta));
        double hi = dim * log(omax / (cfg->rope_beta_slow * two_pi)) / (2 * log(cfg->rope_theta));
        lo = floor(lo);
        hi = ceil(hi);
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = dim - 1;
        if (lo == hi) hi += 0.001; /* transformers' singularity guard */
        float ramp = ((float)i - (float)lo) / (float)(hi - lo); /* fp32 tensor op, python scalars */
        if (ramp < 0) ramp = 0;
        if (ramp > 1) ramp = 1;
        float extrapolation_factor = 1.0f - ramp;
        inv_freq[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
}

kdt_status kdt_config_merge_generation(const char *text, size_t len, const char *path, kdt_model_config *cfg) {
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root)
        return kdt_fail(KDT_ERR_FORMAT, "%s: not valid JSON (%s, line %d)", path, jerr.text, jerr.line);
    add_eos_ids(cfg, json_object_get(root, "eos_token_id"));
    json_decref(root);
    return KDT_OK;
}
