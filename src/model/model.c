/* model.c - kdt_model_load / kdt_model_free: reads config.json, maps the checkpoint, and binds
 * every tensor the config implies to a kdt_weight after checking its presence, shape and dtype.
 * Nothing is computed until every check has passed. */
#include "model_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static kdt_status read_file(const char *path, char **text, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return kdt_fail(KDT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        if (cap > (64u << 20)) {
            free(buf);
            fclose(f);
            return kdt_fail(KDT_ERR_FORMAT, "%s: larger than 64 MB", path);
        }
        char *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    int err = ferror(f);
    fclose(f);
    if (!buf) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", path);
    if (err) {
        free(buf);
        return kdt_fail(KDT_ERR_IO, "%s: read error", path);
    }
    *text = buf;
    *len = n;
    return KDT_OK;
}

static void shape_text(const kdt_st_tensor *t, char *got, size_t n) {
    size_t o = 0;
    got[0] = 0;
    for (int32_t d = 0; d < t->ndim && d < KDT_MAX_DIMS && o + 24 < n; d++)
        o += (size_t)snprintf(got + o, n - o, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
}

/* Finds `full` and checks it is a float tensor of shape [rows][cols] (rows = 0: 1-D [cols]). */
static kdt_status find_float(const kdt_model *m, const char *full, int64_t rows, int64_t cols,
                             const kdt_st_tensor **out) {
    const kdt_st_tensor *t = kdt_st_find(&m->st, full);
    if (!t)
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\" is missing from the checkpoint (%lld tensors in %d files)",
                        m->dir, full, (long long)m->st.n_tensors, m->st.n_files);
    const char *file = m->st.files[t->file].path;
    if (t->dtype != KDT_W_F32 && t->dtype != KDT_W_BF16 && t->dtype != KDT_W_F16)
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": dtype %s, expected F32, BF16 or F16", file, full,
                        t->dtype_name);
    int ok = rows ? (t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols)
                  : (t->ndim == 1 && t->shape[0] == cols);
    if (!ok) {
        char got[128];
        shape_text(t, got, sizeof got);
        if (rows)
            return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": shape [%s], expected [%lld, %lld]", file, full,
                            got, (long long)rows, (long long)cols);
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": shape [%s], expected [%lld]", file, full, got,
                        (long long)cols);
    }
    *out = t;
    return KDT_OK;
}

/* Block-FP8 weight: `full` is e4m3 [rows][cols], its `_scale_inv` [ceil(rows/br)][ceil(cols/bc)]. */
static kdt_status bind_fp8(kdt_model *m, kdt_weight *w, const kdt_st_tensor *t, const char *full, int64_t rows,
                           int64_t cols) {
    const char *file = m->st.files[t->file].path;
    const kdt_model_config *c = &m->cfg;
    if (c->weight_quant != KDT_QUANT_FP8_BLOCK)
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\" is FP8 but config.json declares no fp8 quantization",
                        file, full);
    if (!(t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols)) {
        char got[128];
        shape_text(t, got, sizeof got);
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": shape [%s], expected [%lld, %lld]", file, full, got,
                        (long long)rows, (long long)cols);
    }
    char sname[600];
    snprintf(sname, sizeof sname, "%s_scale_inv", full);
    const int64_t br = c->quant_block_rows, bc = c->quant_block_cols;
    const kdt_st_tensor *sc;
    kdt_status st = find_float(m, sname, (rows + br - 1) / br, (cols + bc - 1) / bc, &sc);
    if (st != KDT_OK) return st;
    w->format = KDT_WF_FP8_BLOCK;
    w->dtype = t->dtype;
    w->data = t->data;
    w->scale = sc->data;
    w->scale_dtype = sc->dtype;
    w->group_rows = (int32_t)br;
    w->group_cols = (int32_t)bc;
    return KDT_OK;
}

/* INT4 pack-quantized weight: `<base>.weight_packed` int32 [rows][cols/8], `.weight_scale`
 * [rows][cols/group], optional `.weight_shape` = [rows, cols]. */
static kdt_status bind_int4(kdt_model *m, kdt_weight *w, const kdt_st_tensor *packed, const char *base,
                            int64_t rows, int64_t cols) {
    const char *file = m->st.files[packed->file].path;
    const kdt_model_config *c = &m->cfg;
    char n[600];
    snprintf(n, sizeof n, "%s.weight_packed", base);
    if (c->weight_quant != KDT_QUANT_INT4_GROUP)
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\" is INT4-packed but config.json declares no "
                        "compressed-tensors quantization", file, n);
    const int64_t g = c->quant_block_cols;
    if (cols % 8 || cols % g)
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": %lld input columns do not split into int4 groups of "
                        "%lld", file, n, (long long)cols, (long long)g);
    if (packed->dtype != KDT_W_I32 || packed->ndim != 2 || packed->shape[0] != rows || packed->shape[1] != cols / 8) {
        char got[128];
        shape_text(packed, got, sizeof got);
        return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": %s [%s], expected I32 [%lld, %lld]", file, n,
                        packed->dtype_name, got, (long long)rows, (long long)(cols / 8));
    }
    snprintf(n, sizeof n, "%s.weight_scale", base);
    const kdt_st_tensor *sc;
    kdt_status st = find_float(m, n, rows, cols / g, &sc);
    if (st != KDT_OK) return st;
    snprintf(n, sizeof n, "%s.weight_shape", base);
    const kdt_st_tensor *ws = kdt_st_find(&m->st, n);
    if (ws) {
        int64_t r = -1, cc = -1;
        if (ws->ndim == 1 && ws->shape[0] == 2 && ws->dtype == KDT_W_I32) {
            r = ((const int32_t *)ws->data)[0];
            cc = ((const int32_t *)ws->data)[1];
        } else if (ws->ndim == 1 && ws->shape[0] == 2 && ws->dtype == KDT_W_I64) {
            r = ((const int64_t *)ws->data)[0];
            cc = ((const int64_t *)ws->data)[1];
        }
        if (r != rows || cc != cols)
            return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\" does not say [%lld, %lld]",
                            m->st.files[ws->file].path, n, (long long)rows, (long long)cols);
    }
    w->format = KDT_WF_INT4_GROUP;
    w->dtype = packed->dtype;
    w->data = packed->data;
    w->scale = sc->data;
    w->scale_dtype = sc->dtype;
    w->group_rows = 1;
    w->group_cols = (int32_t)g;
    return KDT_OK;
}

/* Binds weight `name` (prefix + model-relative name) with the expected shape. rows = 0 means a
 * 1-D tensor of `cols` elements. 2-D weights may be stored plain, block-FP8 or INT4-packed. */
static kdt_status bind(kdt_model *m, kdt_weight *w, const char *name, int64_t rows, int64_t cols) {
    char full[512];
    snprintf(full, sizeof full, "%s%s", m->prefix, name);
    memset(w, 0, sizeof *w);
    const kdt_st_tensor *t = kdt_st_find(&m->st, full);
    kdt_status st;
    size_t fl = strlen(full);
    if (rows && !t && fl > 7 && strcmp(full + fl - 7, ".weight") == 0) {
        char base[512], pn[600];
        snprintf(base, sizeof base, "%.*s", (int)(fl - 7), full);
        snprintf(pn, sizeof pn, "%s.weight_packed", base);
        const kdt_st_tensor *packed = kdt_st_find(&m->st, pn);
        if (packed) {
            st = bind_int4(m, w, packed, base, rows, cols);
            t = packed;
        } else {
            st = find_float(m, full, rows, cols, &t); /* reports the missing tensor */
        }
    } else if (rows && t && t->dtype == KDT_W_F8_E4M3) {
        st = bind_fp8(m, w, t, full, rows, cols);
    } else {
        st = find_float(m, full, rows, cols, &t);
        if (st == KDT_OK) {
            w->format = KDT_WF_PLAIN;
            w->dtype = t->dtype;
            w->data = t->data;
        }
    }
    if (st != KDT_OK) return st;
    w->rows = rows ? rows : 1;
    w->cols = cols;
    w->name = t ? t->name : NULL;
    return KDT_OK;
}


static kdt_status bind_mlp(kdt_model *m, kdt_expert_weights *e, const char *pre, int64_t inter) {
    char n[256];
    const int64_t D = m->cfg.hidden_size;
    snprintf(n, sizeof n, "%sgate_proj.weight", pre);
    KDT_TRY(bind(m, &e->gate, n, inter, D));
    snprintf(n, sizeof n, "%sup_proj.weight", pre);
    KDT_TRY(bind(m, &e->up, n, inter, D));
    snprintf(n, sizeof n, "%sdown_proj.weight", pre);
    KDT_TRY(bind(m, &e->down, n, D, inter));
    return KDT_OK;
}

static kdt_status bind_layer(kdt_model *m, int32_t l) {
    const kdt_model_config *c = &m->cfg;
    kdt_layer_weights *L = &m->layers[l];
    const int64_t D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
                  dv = c->v_head_dim, dc = c->kv_lora_rank;
    char p[96], n[256];
    snprintf(p, sizeof p, "model.layers.%d.", l);
#define B(w, suffix, r, cols)                         \
    do {                                              \
        snprintf(n, sizeof n, "%s%s", p, suffix);     \
        KDT_TRY(bind(m, w, n, r, cols));                  \
    } while (0)
    B(&L->input_norm, "input_layernorm.weight", 0, D);
    B(&L->post_norm, "post_attention_layernorm.weight", 0, D);
    if (c->q_lora_rank > 0) {
        B(&L->q_a, "self_attn.q_a_proj.weight", c->q_lora_rank, D);
        B(&L->q_a_norm, "self_attn.q_a_layernorm.weight", 0, c->q_lora_rank);
        B(&L->q_b, "self_attn.q_b_proj.weight", H * (dn + dr), c->q_lora_rank);
    } else {
        B(&L->q_proj, "self_attn.q_proj.weight", H * (dn + dr), D);
    }
    B(&L->kv_a, "self_attn.kv_a_proj_with_mqa.weight", dc + dr, D);
    B(&L->kv_a_norm, "self_attn.kv_a_layernorm.weight", 0, dc);
    B(&L->kv_b, "self_attn.kv_b_proj.weight", H * (dn + dv), dc);
    B(&L->o_proj, "self_attn.o_proj.weight", D, H * dv);
    L->is_moe = l >= c->first_k_dense_replace && l % c->moe_layer_freq == 0;
    if (!L->is_moe) {
        snprintf(n, sizeof n, "%smlp.", p);
        return bind_mlp(m, &L->dense, n, c->intermediate_size);
    }
    const int64_t E = c->n_routed_experts;
    B(&L->router, "mlp.gate.weight", E, D);
    B(&L->router_bias, "mlp.gate.e_score_correction_bias", 0, E);
    L->experts = calloc((size_t)E, sizeof *L->experts);
    if (!L->experts) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "layer %d: expert table", l);
    for (int64_t e = 0; e < E; e++) {
        snprintf(n, sizeof n, "%smlp.experts.%lld.", p, (long long)e);
        KDT_TRY(bind_mlp(m, &L->experts[e], n, c->moe_intermediate_size));
    }
    if (c->n_shared_experts > 0) {
        snprintf(n, sizeof n, "%smlp.shared_experts.", p);
        KDT_TRY(bind_mlp(m, &L->shared, n, (int64_t)c->n_shared_experts * c->moe_intermediate_size));
    }
#undef B
    return KDT_OK;
}

static kdt_status bind_all(kdt_model *m) {
    static const char *prefixes[] = {"", "language_model.", "model.language_model."};
    char n[256];
    int found = 0;
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0] && !found; i++) {
        snprintf(n, sizeof n, "%smodel.embed_tokens.weight", prefixes[i]);
        if (kdt_st_find(&m->st, n)) {
            snprintf(m->prefix, sizeof m->prefix, "%s", prefixes[i]);
            found = 1;
        }
    }
    if (!found)
        return kdt_fail(KDT_ERR_FORMAT,
                        "%s: tensor \"model.embed_tokens.weight\" (or \"language_model.model.embed_tokens.weight\") "
                        "is missing from the checkpoint (%lld tensors in %d files)",
                        m->dir, (long long)m->st.n_tensors, m->st.n_files);
    const kdt_model_config *c = &m->cfg;
    KDT_TRY(bind(m, &m->embed, "model.embed_tokens.weight", c->vocab_size, c->hidden_size));
    KDT_TRY(bind(m, &m->final_norm, "model.norm.weight", 0, c->hidden_size));
    snprintf(n, sizeof n, "%slm_head.weight", m->prefix);
    if (c->tie_word_embeddings && !kdt_st_find(&m->st, n)) m->lm_head = m->embed;
    else KDT_TRY(bind(m, &m->lm_head, "lm_head.weight", c->vocab_size, c->hidden_size));
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (!m->layers) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "layer table");
    for (int32_t l = 0; l < c->n_layers; l++) KDT_TRY(bind_layer(m, l));
    m->main_dtype = m->embed.dtype;
    return KDT_OK;
}

kdt_status kdt_model_load(const char *dir, const kdt_model_options *opt, kdt_model **out) {
    KDT_CHECK_ARG(out, "kdt_model_load: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(dir && dir[0], "kdt_model_load: dir is NULL or empty");
    kdt_model_options o = {1, KDT_DEFAULT_PREFILL_CHUNK, KDT_PREFILL_ABSORBED};
    if (opt) o = *opt;
    if (o.prefill_chunk == 0) o.prefill_chunk = KDT_DEFAULT_PREFILL_CHUNK;
    KDT_CHECK_ARG(o.prefill_chunk >= 1 && o.prefill_chunk <= KDT_MAX_PREFILL_CHUNK,
                  "kdt_model_load: prefill_chunk = %d (1..%d)", o.prefill_chunk, KDT_MAX_PREFILL_CHUNK);
    KDT_CHECK_ARG(o.prefill_attention >= KDT_PREFILL_ABSORBED && o.prefill_attention <= KDT_PREFILL_AUTO,
                  "kdt_model_load: prefill_attention = %d (0 absorbed, 1 plain, 2 auto)", o.prefill_attention);

    kdt_model *m = calloc(1, sizeof *m);
    if (!m) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_model_load");
    m->opt = o;
    m->dir = strdup(dir);
    size_t dl = strlen(dir);
    char *path = malloc(dl + 32);
    char *text = NULL;
    size_t len = 0;
    kdt_status st = KDT_OK;
    if (!path || !m->dir) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_model_load");
        goto fail;
    }
    snprintf(path, dl + 32, "%s/config.json", dir);
    if ((st = read_file(path, &text, &len)) != KDT_OK) goto fail;
    if ((st = kdt_config_parse(text, len, path, &m->cfg)) != KDT_OK) goto fail;
    free(text);
    text = NULL;
    snprintf(path, dl + 32, "%s/generation_config.json", dir);
    if (access(path, F_OK) == 0) {
        if ((st = read_file(path, &text, &len)) != KDT_OK) goto fail;
        if ((st = kdt_config_merge_generation(text, len, path, &m->cfg)) != KDT_OK) goto fail;
    }
    if ((st = kdt_st_open_dir(dir, o.progress, &m->st)) != KDT_OK) goto fail;
    if ((st = bind_all(m)) != KDT_OK) goto fail;
    m->rope_inv_freq = malloc((size_t)(m->cfg.qk_rope_head_dim / 2) * sizeof(float));
    if (!m->rope_inv_freq) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_model_load");
        goto fail;
    }
    kdt_rope_inv_freq(&m->cfg, m->rope_inv_freq);
    free(path);
    free(text);
    *out = m;
    return KDT_OK;
fail:
    free(path);
    free(text);
    kdt_model_free(m);
    return st;
}

void kdt_model_free(kdt_model *m) {
    if (!m) return;
    if (m->layers)
        for (int32_t l = 0; l < m->cfg.n_layers; l++) free(m->layers[l].experts);
    free(m->layers);
    free(m->rope_inv_freq);
    kdt_st_close(&m->st);
    free(m->dir);
    free(m);
}

const kdt_model_config *kdt_model_get_config(const kdt_model *m) { return m ? &m->cfg : NULL; }

const char *kdt_model_weight_dtype(const kdt_model *m) {
    return m ? kdt_wtype_name(m->main_dtype) : "none";
}
