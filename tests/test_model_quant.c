/* test_model_quant.c - quantized checkpoints: block-FP8 (e4m3 weight + weight_scale_inv per
 * block, DeepSeek-V3 / K2-Instruct layout) and INT4 pack-quantized routed experts
 * (compressed-tensors weight_packed / weight_scale / weight_shape, K2.5/K2.6 layout). Each
 * quantized checkpoint must compute bitwise what an F32 checkpoint holding the dequantized
 * values computes (the dequantization is one exact-or-rounded fp32 product either way); the
 * test has its own e4m3 decoder and nibble packer. Malformed quantized tensors give clear
 * errors. */
#include "t.h"

#ifdef KDT_WITH_MODEL
#include "test_model_util.h"

#include "kdtree/model.h"
#include "model/model_internal.h"

typedef struct raw_tensor {
    char name[256];
    const char *dtype;
    int ndim;
    int64_t shape[2];
    void *data;
    size_t nbytes;
} raw_tensor;

typedef struct raw_list {
    raw_tensor t[1024];
    int n;
} raw_list;

static raw_tensor *raw_add(raw_list *l, const char *name, const char *dtype, int ndim, int64_t r, int64_t c,
                           size_t nbytes) {
    raw_tensor *t = &l->t[l->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dtype;
    t->ndim = ndim;
    t->shape[0] = r;
    t->shape[1] = c;
    t->nbytes = nbytes;
    t->data = calloc(1, nbytes ? nbytes : 1);
    return t;
}

static void raw_write(const char *path, const raw_list *l) {
    size_t cap = 256 + (size_t)l->n * 256, hl = 0, off = 0;
    char *h = malloc(cap);
    hl += (size_t)snprintf(h, cap, "{");
    for (int i = 0; i < l->n; i++) {
        const raw_tensor *t = &l->t[i];
        char shape[64];
        if (t->ndim == 2) snprintf(shape, sizeof shape, "[%lld,%lld]", (long long)t->shape[0], (long long)t->shape[1]);
        else snprintf(shape, sizeof shape, "[%lld]", (long long)t->shape[0]);
        hl += (size_t)snprintf(h + hl, cap - hl, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%zu,%zu]}",
                               i ? "," : "", t->name, t->dtype, shape, off, off + t->nbytes);
        off += t->nbytes;
    }
    hl += (size_t)snprintf(h + hl, cap - hl, "}");
    while (hl % 8) h[hl++] = ' ';
    FILE *f = fopen(path, "wb");
    unsigned char len8[8];
    tm_put_le64(len8, hl);
    fwrite(len8, 1, 8, f);
    fwrite(h, 1, hl, f);
    for (int i = 0; i < l->n; i++) fwrite(l->t[i].data, 1, l->t[i].nbytes, f);
    fclose(f);
    free(h);
}

static void raw_free(raw_list *l) {
    for (int i = 0; i < l->n; i++) free(l->t[i].data);
    l->n = 0;
}

/* the test's own e4m3 decoder: sign, 4-bit exponent (bias 7), 3-bit mantissa */
static double e4m3_value(int b) {
    int e = (b >> 3) & 15, mnt = b & 7;
    double v = e ? ldexp(1.0 + mnt / 8.0, e - 7) : ldexp(mnt / 8.0, -6);
    return (b & 128) ? -v : v;
}

/* Inserts `text` right after the first '{' of DIR/config.json. */
static void config_insert(const char *dir, const char *text) {
    char p[700];
    size_t n;
    snprintf(p, sizeof p, "%s/config.json", dir);
    char *c = tm_read_bytes(p, &n);
    char *out = malloc(n + strlen(text) + 4);
    sprintf(out, "{%s,%s", text, c + 1);
    tm_write_bytes(p, out, strlen(out));
    free(c);
    free(out);
}

enum { QUANT_FP8 = 1, QUANT_INT4 = 2 };

/* Writes the quantized checkpoint to qdir and the dequantized F32 twin to fdir. */
static void write_pair(const tm_spec *s, int kind, int block, const char *qdir, const char *fdir) {
    tm_list l = {0};
    tm_build_tensors(s, &l);
    uint64_t rng = s->seed ^ 0xabcdef;
    raw_list *q = calloc(1, sizeof *q);
    for (int i = 0; i < l.n; i++) {
        tm_tensor *t = &l.t[i];
        const int64_t r = t->shape[0], c = t->shape[1];
        int is_linear = t->ndim == 2 && tm_ends_with(t->name, "_proj.weight");
        int is_expert = is_linear && strstr(t->name, "mlp.experts.") != NULL;
        if (kind == QUANT_FP8 && (is_linear || tm_ends_with(t->name, "kv_a_proj_with_mqa.weight"))) {
            const int64_t sr = (r + block - 1) / block, sc = (c + block - 1) / block;
            raw_tensor *w = raw_add(q, t->name, "F8_E4M3", 2, r, c, (size_t)(r * c));
            char sn[sizeof t->name + 16];
            snprintf(sn, sizeof sn, "%s_scale_inv", t->name);
            raw_tensor *st = raw_add(q, sn, "F32", 2, sr, sc, (size_t)(sr * sc) * 4);
            float *scales = st->data;
            for (int64_t k = 0; k < sr * sc; k++) scales[k] = (float)((0.5 + t_rand_unit(&rng)) / sqrt((double)c) / 2);
            for (int64_t rr = 0; rr < r; rr++)
                for (int64_t cc = 0; cc < c; cc++) {
                    /* codes with exponent field <= 9 (|value| <= 7.5), random sign; no NaN code */
                    int b = t_rand_int(&rng, 80) | (t_rand_int(&rng, 2) << 7);
                    ((uint8_t *)w->data)[rr * c + cc] = (uint8_t)b;
                    t->data[rr * c + cc] = (float)e4m3_value(b) * scales[(rr / block) * sc + cc / block];
                }
        } else if (kind == QUANT_INT4 && is_expert) {
            char base[200], n1[240];
            snprintf(base, sizeof base, "%.*s", (int)(strlen(t->name) - 7), t->name);
            snprintf(n1, sizeof n1, "%s.weight_packed", base);
            raw_tensor *pk = raw_add(q, n1, "I32", 2, r, c / 8, (size_t)(r * c / 8) * 4);
            snprintf(n1, sizeof n1, "%s.weight_scale", base);
            raw_tensor *sc = raw_add(q, n1, "BF16", 2, r, c / block, (size_t)(r * c / block) * 2);
            snprintf(n1, sizeof n1, "%s.weight_shape", base);
            raw_tensor *sh = raw_add(q, n1, "I32", 1, 2, 0, 8);
            ((int32_t *)sh->data)[0] = (int32_t)r;
            ((int32_t *)sh->data)[1] = (int32_t)c;
            uint16_t *scales = sc->data;
            uint32_t *words = pk->data;
            for (int64_t k = 0; k < r * c / block; k++)
                scales[k] = kdt_f32_to_bf16((float)((0.5 + t_rand_unit(&rng)) / sqrt((double)c) / 3));
            for (int64_t rr = 0; rr < r; rr++)
                for (int64_t cc = 0; cc < c; cc++) {
                    int nib = 1 + t_rand_int(&rng, 15); /* symmetric levels -7..7 */
                    words[(rr * c + cc) / 8] |= (uint32_t)nib << (4 * (cc % 8));
                    t->data[rr * c + cc] = (float)(nib - 8) * kdt_bf16_to_f32(scales[rr * (c / block) + cc / block]);
                }
        } else {
            int64_t cnt = t->ndim == 2 ? r * c : r;
            raw_tensor *w = raw_add(q, t->name, "BF16", t->ndim, t->ndim == 2 ? r : r, c, (size_t)cnt * 2);
            for (int64_t k = 0; k < cnt; k++) {
                ((uint16_t *)w->data)[k] = kdt_f32_to_bf16(t->data[k]);
                t->data[k] = kdt_bf16_to_f32(((uint16_t *)w->data)[k]);
            }
        }
    }
    char p[700];
    mkdir(qdir, 0755);
    mkdir(fdir, 0755);
    tm_write_config(qdir, s);
    tm_write_config(fdir, s);
    snprintf(p, sizeof p, "%s/model.safetensors", qdir);
    raw_write(p, q);
    snprintf(p, sizeof p, "%s/model.safetensors", fdir);
    tm_write_safetensors(p, &l, 0, l.n, 0);
    char qc[512];
    if (kind == QUANT_FP8)
        snprintf(qc, sizeof qc, "\"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                 "\"activation_scheme\": \"dynamic\", \"weight_block_size\": [%d, %d]}", block, block);
    else
        snprintf(qc, sizeof qc, "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": "
                 "\"pack-quantized\", \"config_groups\": {\"group_0\": {\"targets\": [\"Linear\"], \"weights\": "
                 "{\"num_bits\": 4, \"type\": \"int\", \"symmetric\": true, \"strategy\": \"group\", "
                 "\"group_size\": %d, \"dynamic\": false}, \"input_activations\": null}}, \"ignore\": [\"lm_head\"]}",
                 block);
    config_insert(qdir, qc);
    raw_free(q);
    free(q);
    tm_list_free(&l);
}

static kdt_model *load_dir(const char *d) {
    kdt_model *m = NULL;
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    if (kdt_model_load(d, &o, &m) != KDT_OK) fprintf(stderr, "  load %s: %s\n", d, kdt_last_error());
    return m;
}

static void prefill_logits(const kdt_model *m, float *logits, int n) {
    int32_t toks[16];
    for (int i = 0; i < n; i++) toks[i] = (i * 37 + 5) % m->cfg.vocab_size;
    kdt_kv_cache_options ko = {2, 1, 0};
    kdt_kv_cache *kv = NULL;
    CHECK_EQ_INT(kdt_kv_cache_create(m, &ko, &kv), KDT_OK);
    kdt_model_outputs o = {0};
    o.logits = logits;
    CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, n, &o), KDT_OK);
    kdt_kv_cache_free(kv);
}

static tm_spec quant_spec(void) {
    tm_spec s = tm_default_spec();
    s.hidden = 64; s.moe_inter = 32; s.inter = 64; s.q_lora = 24; s.kv_lora = 32; s.v = 16; s.nope = 16;
    s.layers = 2; s.experts = 4; s.topk = 2; s.n_group = 1; s.topk_group = 1;
    return s;
}

static void check_pair(int kind, int block, const char *label) {
    tm_spec s = quant_spec();
    char q[600], f[600];
    tm_mkdtemp(q, sizeof q);
    tm_mkdtemp(f, sizeof f);
    write_pair(&s, kind, block, q, f);
    kdt_model *mq = load_dir(q), *mf = load_dir(f);
    CHECK(mq && mf);
    if (mq && mf) {
        CHECK_EQ_INT(mq->cfg.weight_quant, kind == QUANT_FP8 ? KDT_QUANT_FP8_BLOCK : KDT_QUANT_INT4_GROUP);
        const kdt_weight *w = kind == QUANT_FP8 ? &mq->layers[1].o_proj : &mq->layers[1].experts[2].down;
        CHECK_EQ_INT(w->format, kind == QUANT_FP8 ? KDT_WF_FP8_BLOCK : KDT_WF_INT4_GROUP);
        float a[8 * 96], b[8 * 96];
        prefill_logits(mq, a, 8);
        prefill_logits(mf, b, 8);
        CHECK_MSG(memcmp(a, b, sizeof a) == 0, "%s: quantized and dequantized-F32 checkpoints differ", label);
        printf("  %s: logits identical to the dequantized F32 twin (logit[0] = %.6g)\n", label, a[0]);
    }
    kdt_model_free(mq);
    kdt_model_free(mf);
    tm_rmdir(q);
    tm_rmdir(f);
}

static void test_fp8_block(void) {
    check_pair(QUANT_FP8, 16, "FP8 e4m3, 16x16 blocks (partial blocks)");
    check_pair(QUANT_FP8, 128, "FP8 e4m3, 128x128 blocks");
}

static void test_int4_group(void) { check_pair(QUANT_INT4, 32, "INT4 group 32 experts"); }

static int load_fails(const char *d, kdt_status want, const char *f1, const char *f2) {
    kdt_model *m = NULL;
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    kdt_status st = kdt_model_load(d, &o, &m);
    const char *e = kdt_last_error();
    int ok = st == want && m == NULL && (!f1 || strstr(e, f1)) && (!f2 || strstr(e, f2));
    if (!ok) fprintf(stderr, "    got %s \"%s\"\n", kdt_status_name(st), e);
    kdt_model_free(m);
    return ok;
}

static void patch(const char *path, const char *from, const char *to) {
    size_t n;
    char *b = tm_read_bytes(path, &n);
    char *p = memmem(b, n, from, strlen(from));
    CHECK(p != NULL && strlen(from) == strlen(to));
    if (p) memcpy(p, to, strlen(to));
    tm_write_bytes(path, b, n);
    free(b);
}

static void test_quant_errors(void) {
    tm_spec s = quant_spec();
    char q[600], f[600], p[700];
    size_t n;
    tm_mkdtemp(q, sizeof q);
    tm_mkdtemp(f, sizeof f);
    write_pair(&s, QUANT_INT4, 32, q, f);
    snprintf(p, sizeof p, "%s/config.json", q);
    char *cfg = tm_read_bytes(p, &n);
    snprintf(p, sizeof p, "%s/model.safetensors", q);
    char *st = tm_read_bytes(p, &n);
    /* packed tensors but no quantization_config */
    tm_write_config(q, &s);
    CHECK(load_fails(q, KDT_ERR_FORMAT, "weight_packed", "declares no"));
    snprintf(p, sizeof p, "%s/config.json", q);
    tm_write_bytes(p, cfg, strlen(cfg));
    snprintf(p, sizeof p, "%s/model.safetensors", q);
    /* a missing scale */
    patch(p, "\"model.layers.1.mlp.experts.3.up_proj.weight_scale\"", "\"model.layers.1.mlp.experts.3.up_proj.weight_scalX\"");
    CHECK(load_fails(q, KDT_ERR_FORMAT, "experts.3.up_proj.weight_scale", "missing"));
    tm_write_bytes(p, st, n);
    /* packed tensor with the wrong dtype */
    patch(p, "\"dtype\":\"I32\",\"shape\":[32,8]", "\"dtype\":\"F32\",\"shape\":[32,8]");
    CHECK(load_fails(q, KDT_ERR_FORMAT, "weight_packed", "expected I32"));
    tm_write_bytes(p, st, n);
    /* group size not dividing the input columns */
    snprintf(p, sizeof p, "%s/config.json", q);
    char *c2 = strdup(cfg), *g = strstr(c2, "\"group_size\": 32");
    memcpy(g, "\"group_size\": 24", 16);
    tm_write_bytes(p, c2, strlen(c2));
    CHECK(load_fails(q, KDT_ERR_FORMAT, "groups of 24", NULL));
    free(c2);
    free(cfg);
    free(st);
    tm_rmdir(q);
    tm_rmdir(f);

    /* FP8: a missing weight_scale_inv; FP8 tensors without an fp8 quantization_config */
    tm_mkdtemp(q, sizeof q);
    tm_mkdtemp(f, sizeof f);
    write_pair(&s, QUANT_FP8, 16, q, f);
    snprintf(p, sizeof p, "%s/model.safetensors", q);
    patch(p, "\"model.layers.0.self_attn.o_proj.weight_scale_inv\"", "\"model.layers.0.self_attn.o_proj.weight_scale_inX\"");
    CHECK(load_fails(q, KDT_ERR_FORMAT, "o_proj.weight_scale_inv", "missing"));
    tm_write_config(q, &s);
    CHECK(load_fails(q, KDT_ERR_FORMAT, "FP8", "declares no fp8"));
    tm_rmdir(q);
    tm_rmdir(f);
}

int main(void) {
    T_RUN(test_fp8_block);
    T_RUN(test_int4_group);
    T_RUN(test_quant_errors);
    return t_summary();
}
#else
int main(void) {
    printf("model subsystem not built (no jansson): skipped\n");
    return t_summary();
}
#endif
