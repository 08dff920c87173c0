/* test_model_load.c - the model loader: config.json parsing (transformers-5 and published forms,
 * the K2.5 text_config wrapper, YaRN-derived values), safetensors reading (single file, index +
 * shards, BF16/F32), and every malformed-input case giving a clear error, never a crash: the
 * named cases one by one, then 400 random corruptions (fixed seed) and 400 configs with edge
 * values in their fields, each accepted one run forward. */
#include "t.h"

#ifdef KDT_WITH_MODEL
#include <jansson.h>

#include "test_model_util.h"

#include "kdtree/model.h"
#include "model/model_internal.h"

/* status == want and the last error mentions every given fragment */
static int err_is(kdt_status st, kdt_status want, const char *frag1, const char *frag2) {
    const char *e = kdt_last_error();
    int ok = st == want && (!frag1 || strstr(e, frag1)) && (!frag2 || strstr(e, frag2));
    if (!ok)
        fprintf(stderr, "    got %s \"%s\", wanted %s with \"%s\" \"%s\"\n", kdt_status_name(st), e,
                kdt_status_name(want), frag1 ? frag1 : "", frag2 ? frag2 : "");
    return ok;
}

static kdt_status parse(const char *json, kdt_model_config *cfg) {
    return kdt_config_parse(json, strlen(json), "cfg.json", cfg);
}

/* A complete DeepSeek-V3 config in the published form (values of the real checkpoint). */
static const char *DSV3_PUBLISHED =
    "{\"architectures\":[\"DeepseekV3ForCausalLM\"],\"model_type\":\"deepseek_v3\",\"vocab_size\":129280,"
    "\"hidden_size\":7168,\"intermediate_size\":18432,\"moe_intermediate_size\":2048,\"num_hidden_layers\":61,"
    "\"num_nextn_predict_layers\":1,\"num_attention_heads\":128,\"num_key_value_heads\":128,"
    "\"n_shared_experts\":1,\"n_routed_experts\":256,\"ep_size\":1,\"routed_scaling_factor\":2.5,"
    "\"kv_lora_rank\":512,\"q_lora_rank\":1536,\"qk_rope_head_dim\":64,\"v_head_dim\":128,"
    "\"qk_nope_head_dim\":128,\"topk_method\":\"noaux_tc\",\"n_group\":8,\"topk_group\":4,"
    "\"num_experts_per_tok\":8,\"moe_layer_freq\":1,\"first_k_dense_replace\":3,\"norm_topk_prob\":true,"
    "\"scoring_func\":\"sigmoid\",\"hidden_act\":\"silu\",\"max_position_embeddings\":163840,"
    "\"rms_norm_eps\":1e-06,\"rope_theta\":10000,\"rope_scaling\":{\"beta_fast\":32,\"beta_slow\":1,"
    "\"factor\":40,\"mscale\":1.0,\"mscale_all_dim\":1.0,\"original_max_position_embeddings\":4096,"
    "\"type\":\"yarn\"},\"bos_token_id\":0,\"eos_token_id\":1,\"tie_word_embeddings\":false,"
    "\"attention_bias\":false}";

/* Kimi K2.6 as published: the text model under text_config (values from the research notes). */
static const char *K26_PUBLISHED =
    "{\"architectures\":[\"KimiK25ForConditionalGeneration\"],\"model_type\":\"kimi_k25\","
    "\"vision_config\":{\"hidden_size\":1152},\"text_config\":{\"model_type\":\"kimi_k2\",\"vocab_size\":163840,"
    "\"hidden_size\":7168,\"intermediate_size\":18432,\"moe_intermediate_size\":2048,\"num_hidden_layers\":61,"
    "\"num_attention_heads\":64,\"num_key_value_heads\":64,\"n_shared_experts\":1,\"n_routed_experts\":384,"
    "\"routed_scaling_factor\":2.827,\"kv_lora_rank\":512,\"q_lora_rank\":1536,\"qk_rope_head_dim\":64,"
    "\"v_head_dim\":128,\"qk_nope_head_dim\":128,\"topk_method\":\"noaux_tc\",\"n_group\":1,\"topk_group\":1,"
    "\"num_experts_per_tok\":8,\"moe_layer_freq\":1,\"first_k_dense_replace\":1,\"norm_topk_prob\":true,"
    "\"scoring_func\":\"sigmoid\",\"max_position_embeddings\":262144,\"rms_norm_eps\":1e-05,"
    "\"rope_theta\":50000.0,\"rope_scaling\":{\"beta_fast\":1.0,\"beta_slow\":1.0,\"factor\":64.0,"
    "\"mscale\":1.0,\"mscale_all_dim\":1.0,\"original_max_position_embeddings\":4096,\"type\":\"yarn\"},"
    "\"num_nextn_predict_layers\":0,\"bos_token_id\":163584,\"eos_token_id\":163585}}";

static void test_published_configs(void) {
    kdt_model_config c;
    CHECK_EQ_INT(parse(DSV3_PUBLISHED, &c), KDT_OK);
    CHECK_EQ_INT(c.n_layers, 61);
    CHECK_EQ_INT(c.n_group, 8);
    CHECK_EQ_INT(c.topk_group, 4);
    CHECK_EQ_INT(c.first_k_dense_replace, 3);
    CHECK_EQ_INT(c.rope_kind, KDT_ROPE_YARN);
    CHECK_NEAR(c.rope_factor, 40.0, 0);
    CHECK_NEAR(c.softmax_scale, 0.135234, 5e-7);      /* research notes §2.4 */
    CHECK_NEAR(c.rope_attention_factor, 1.0, 0);      /* mscale == mscale_all_dim */
    CHECK_EQ_INT(c.n_eos, 1);
    CHECK_EQ_INT(c.eos_token_ids[0], 1);

    CHECK_EQ_INT(parse(K26_PUBLISHED, &c), KDT_OK);
    CHECK(strcmp(c.model_type, "kimi_k2") == 0);
    CHECK_EQ_INT(c.n_heads, 64);
    CHECK_EQ_INT(c.n_routed_experts, 384);
    CHECK_EQ_INT(c.vocab_size, 163840);
    CHECK_NEAR(c.rope_theta, 50000.0, 0);
    CHECK_NEAR(c.rms_norm_eps, 1e-5, 1e-12);
    CHECK_NEAR(c.routed_scaling_factor, 2.827, 1e-6);
    CHECK_NEAR(c.softmax_scale, 0.144680, 5e-7);      /* 192^-0.5 * (0.1 ln 64 + 1)^2 */
    /* YaRN with beta 1/1 at theta 50000: pairs 0..19 keep theta^(-2i/64), 20..31 are divided by 64 */
    float inv[32];
    kdt_rope_inv_freq(&c, inv);
    for (int i = 0; i < 32; i++) {
        double plain = pow(50000.0, -2.0 * i / 64.0);
        CHECK_NEAR(inv[i], i < 20 ? plain : plain / 64.0, 1e-6 * plain);
    }
    /* DeepSeek-V3 (theta 1e4, beta 32/1): low 10, high 23, a linear ramp between */
    CHECK_EQ_INT(parse(DSV3_PUBLISHED, &c), KDT_OK);
    kdt_rope_inv_freq(&c, inv);
    for (int i = 0; i < 32; i++) {
        double plain = pow(10000.0, -2.0 * i / 64.0), ramp = (i - 10) / 13.0;
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double want = plain / 40.0 * ramp + plain * (1 - ramp);
        CHECK_NEAR(inv[i], want, 2e-6 * plain);
    }
}

static void test_new_form_equals_old_form(void) {
    tm_spec s = tm_default_spec();
    char a[600], b[600];
    tm_mkdtemp(a, sizeof a);
    tm_mkdtemp(b, sizeof b);
    tm_write_config(a, &s);
    s.old_form = 1;
    tm_write_config(b, &s);
    kdt_model_config ca, cb;
    size_t n;
    char p[700];
    snprintf(p, sizeof p, "%s/config.json", a);
    char *ta = tm_read_bytes(p, &n);
    CHECK_EQ_INT(kdt_config_parse(ta, n, p, &ca), KDT_OK);
    snprintf(p, sizeof p, "%s/config.json", b);
    char *tb = tm_read_bytes(p, &n);
    CHECK_EQ_INT(kdt_config_parse(tb, n, p, &cb), KDT_OK);
    CHECK(memcmp(&ca, &cb, sizeof ca) == 0);
    CHECK_EQ_INT(ca.rope_kind, KDT_ROPE_YARN);
    CHECK_NEAR(ca.rope_mscale_all_dim, 0.8, 0);
    /* mscale 1 vs mscale_all_dim 0.8: cos/sin get (0.1 ln4 + 1) / (0.08 ln4 + 1) */
    CHECK_NEAR(ca.rope_attention_factor, (0.1 * log(4.0) + 1) / (0.08 * log(4.0) + 1), 1e-6);
    free(ta);
    free(tb);
    tm_rmdir(a);
    tm_rmdir(b);
}

static void test_config_errors(void) {
    kdt_model_config c;
    char buf[4096];
    /* replaces the first occurrence of `from` in DSV3_PUBLISHED by `to` */
#define EDIT(from, to)                                                                     \
    do {                                                                                   \
        const char *p_ = strstr(DSV3_PUBLISHED, from);                                     \
        CHECK(p_ != NULL);                                                                 \
        snprintf(buf, sizeof buf, "%.*s%s%s", (int)(p_ - DSV3_PUBLISHED), DSV3_PUBLISHED, to, \
                 p_ + strlen(from));                                                       \
    } while (0)
    /* eos ids: tested as 64-bit values (2^32 + 5 is not 5), outside the vocabulary dropped,
     * repeats kept once; a generation config adds its own the same way */
    EDIT("\"eos_token_id\":1,", "\"eos_token_id\":[4294967301,-1,129280,7,7,2],");
    CHECK_EQ_INT(parse(buf, &c), KDT_OK);
    CHECK(c.n_eos == 2 && c.eos_token_ids[0] == 7 && c.eos_token_ids[1] == 2);
    const char *gen = "{\"eos_token_id\":[4294967298,2,3]}";
    CHECK_EQ_INT(kdt_config_merge_generation(gen, strlen(gen), "gen.json", &c), KDT_OK);
    CHECK(c.n_eos == 3 && c.eos_token_ids[2] == 3);
    EDIT("\"eos_token_id\":1,", "\"eos_token_id\":4294967297,");
    CHECK_EQ_INT(parse(buf, &c), KDT_OK);
    CHECK_EQ_INT(c.n_eos, 0);
    EDIT("\"hidden_size\":7168,", "");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "cfg.json", "hidden_size"));
    /* another architecture is named as such, not by its first missing field */
    CHECK(err_is(parse("{\"architectures\":[\"Qwen3ForCausalLM\"],\"model_type\":\"qwen3\",\"vocab_size\":151936,"
                       "\"hidden_size\":1024,\"num_attention_heads\":16,\"num_key_value_heads\":8}", &c),
                 KDT_ERR_UNSUPPORTED, "\"qwen3\", Qwen3ForCausalLM", "not a DeepSeek-V3-family config"));
    EDIT("\"kv_lora_rank\":512,", "");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "kv_lora_rank", "deepseek_v3"));
    EDIT("\"vocab_size\":129280", "\"vocab_size\":\"many\"");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "vocab_size", "integer"));
    EDIT("\"scoring_func\":\"sigmoid\"", "\"scoring_func\":\"softmax\"");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "scoring_func", "softmax"));
    EDIT("\"topk_method\":\"noaux_tc\"", "\"topk_method\":\"greedy\"");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "topk_method", NULL));
    EDIT("\"n_group\":8", "\"n_group\":7");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "n_group", NULL));
    EDIT("\"topk_group\":4", "\"topk_group\":9");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "topk_group", NULL));
    EDIT("\"num_experts_per_tok\":8", "\"num_experts_per_tok\":300");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "num_experts_per_tok", NULL));
    EDIT("\"hidden_act\":\"silu\"", "\"hidden_act\":\"gelu\"");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "hidden_act", NULL));
    EDIT("\"qk_rope_head_dim\":64", "\"qk_rope_head_dim\":63");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "qk_rope_head_dim", NULL));
    EDIT("\"num_key_value_heads\":128", "\"num_key_value_heads\":8");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "num_key_value_heads", NULL));
    EDIT("\"attention_bias\":false", "\"attention_bias\":true");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "attention_bias", NULL));
    EDIT("\"eos_token_id\":1,", "\"quantization_config\":{\"quant_method\":\"awq\"},");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "awq", NULL));
    EDIT("\"eos_token_id\":1,", "\"quantization_config\":{\"quant_method\":\"fp8\",\"fmt\":\"e4m3\","
         "\"activation_scheme\":\"dynamic\",\"weight_block_size\":[128,128]},");
    CHECK_EQ_INT(parse(buf, &c), KDT_OK);
    CHECK(c.weight_quant == KDT_QUANT_FP8_BLOCK && c.quant_block_rows == 128 && c.quant_block_cols == 128);
    EDIT("\"eos_token_id\":1,", "\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
         "\"format\":\"pack-quantized\",\"config_groups\":{\"group_0\":{\"weights\":{\"num_bits\":4,"
         "\"type\":\"int\",\"symmetric\":true,\"strategy\":\"group\",\"group_size\":32},"
         "\"input_activations\":null}}},");
    CHECK_EQ_INT(parse(buf, &c), KDT_OK);
    CHECK(c.weight_quant == KDT_QUANT_INT4_GROUP && c.quant_block_cols == 32);
    EDIT("\"eos_token_id\":1,", "\"quantization_config\":{\"quant_method\":\"compressed-tensors\","
         "\"format\":\"pack-quantized\",\"config_groups\":{\"group_0\":{\"weights\":{\"num_bits\":8,"
         "\"type\":\"int\",\"symmetric\":true,\"strategy\":\"group\",\"group_size\":32}}}},");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "int4", NULL));
    /* incoherent or unsupported RoPE settings */
    EDIT("\"factor\":40", "\"factor\":0.5");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "incoherent RoPE", "factor"));
    EDIT("\"beta_fast\":32", "\"beta_fast\":0.5");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "incoherent RoPE", "beta_fast"));
    EDIT("\"factor\":40,", "");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "rope_scaling.factor", "missing"));
    EDIT("\"type\":\"yarn\"", "\"type\":\"dynamic\"");
    CHECK(err_is(parse(buf, &c), KDT_ERR_UNSUPPORTED, "dynamic", NULL));
    EDIT("\"type\":\"yarn\"", "\"note\":\"no type\"");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "rope_scaling", "type"));
    /* RoPE values out of range: a negative theta; then the bounds found by
     * tests/fuzz/fuzz_model_config.c: a theta past fp32 (every frequency 0), a theta of 1 (YaRN
     * divides by its log), a factor whose reciprocal underflows */
    static const struct { const char *from, *to, *frag1, *frag2; } rope_bad[] = {
        {"\"rope_theta\":10000,", "\"rope_theta\":-5,", "rope_theta", NULL},
        {"\"rope_theta\":10000,", "\"rope_theta\":5e65,", "rope_theta = 5e+65", "(1, 1e30]"},
        {"\"rope_theta\":10000,", "\"rope_theta\":1,", "rope_theta = 1 ", NULL},
        {"\"factor\":40", "\"factor\":1e300", "incoherent RoPE", "factor"},
    };
    for (size_t i = 0; i < sizeof rope_bad / sizeof rope_bad[0]; i++) {
        EDIT(rope_bad[i].from, rope_bad[i].to);
        CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, rope_bad[i].frag1, rope_bad[i].frag2));
    }
    EDIT("\"rope_theta\":10000,",
         "\"rope_theta\":10000,\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":10000},");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "incoherent RoPE", "disagree"));
    EDIT("\"rope_theta\":10000,", "\"rope_theta\":10000,\"rope_parameters\":{\"rope_type\":\"yarn\",\"rope_theta\":20000,"
         "\"factor\":40},");
    CHECK(err_is(parse(buf, &c), KDT_ERR_FORMAT, "incoherent RoPE", "rope_theta"));
    CHECK(err_is(parse("{\"vocab_size\": 3", &c), KDT_ERR_FORMAT, "not valid JSON", NULL));
    CHECK(err_is(parse("[1, 2]", &c), KDT_ERR_FORMAT, "object", NULL));
    /* null q_lora_rank means no q LoRA; rope_scaling null means default RoPE */
    EDIT("\"q_lora_rank\":1536", "\"q_lora_rank\":null");
    CHECK_EQ_INT(parse(buf, &c), KDT_OK);
    CHECK_EQ_INT(c.q_lora_rank, 0);
    EDIT("\"rope_scaling\":{", "\"rope_scaling\":null,\"unused\":{");
    CHECK_EQ_INT(parse(buf, &c), KDT_OK);
    CHECK_EQ_INT(c.rope_kind, KDT_ROPE_DEFAULT);
    CHECK_NEAR(c.softmax_scale, 1.0 / sqrt(192.0), 1e-7);
#undef EDIT
}

static void test_load_variants(void) {
    /* the same weights as F32 single file, BF16 index + 3 shards, and K2.5-wrapped old form */
    tm_spec s = tm_default_spec();
    s.bf16 = 1; /* bf16-exact values, so all three describe one function */
    char a[600], b[600], w[600];
    tm_mkdtemp(a, sizeof a);
    tm_mkdtemp(b, sizeof b);
    tm_mkdtemp(w, sizeof w);
    tm_spec sa = s;
    sa.bf16 = 0;
    /* writing F32 from bf16-exact values: build with bf16 rounding, store as F32 */
    {
        tm_list l = {0};
        tm_build_tensors(&s, &l);
        tm_write_config(a, &sa);
        char p[700];
        snprintf(p, sizeof p, "%s/model.safetensors", a);
        tm_write_safetensors(p, &l, 0, l.n, 0);
        tm_list_free(&l);
    }
    tm_spec sb = s;
    sb.shards = 3;
    tm_write_model(b, &sb);
    tm_spec sw = s;
    sw.wrapper = 1;
    sw.old_form = 1;
    tm_write_model(w, &sw);

    kdt_model *ma = NULL, *mb = NULL, *mw = NULL;
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    CHECK_EQ_INT(kdt_model_load(a, &o, &ma), KDT_OK);
    CHECK_EQ_INT(kdt_model_load(b, &o, &mb), KDT_OK);
    CHECK_EQ_INT(kdt_model_load(w, &o, &mw), KDT_OK);
    if (ma && mb && mw) {
        CHECK(strcmp(kdt_model_weight_dtype(ma), "F32") == 0);
        CHECK(strcmp(kdt_model_weight_dtype(mb), "BF16") == 0);
        CHECK(strcmp(mw->prefix, "language_model.") == 0);
        CHECK_EQ_INT(mb->st.n_files, 3);
        const kdt_model_config *c = kdt_model_get_config(mw);
        CHECK_EQ_INT(c->n_layers, s.layers);
        CHECK_EQ_INT(c->n_eos, 1);
        CHECK_EQ_INT(c->eos_token_ids[0], s.vocab - 1);
        CHECK_EQ_INT(c->bos_token_id, s.vocab - 2);
        CHECK(ma->layers[0].is_moe == 0 && ma->layers[1].is_moe == 1);
        /* same forward on all three: bitwise (the fp32 math sees identical values) */
        kdt_kv_cache_options ko = {8, 1, 0};
        int32_t toks[5] = {3, 17, 42, 5, 90};
        float la[5 * 96], lb[5 * 96], lw[5 * 96];
        kdt_model *ms[3] = {ma, mb, mw};
        float *ls[3] = {la, lb, lw};
        for (int i = 0; i < 3; i++) {
            kdt_kv_cache *kv = NULL;
            CHECK_EQ_INT(kdt_kv_cache_create(ms[i], &ko, &kv), KDT_OK);
            kdt_model_outputs out = {0};
            out.logits = ls[i];
            CHECK_EQ_INT(kdt_model_prefill(ms[i], kv, 0, toks, 5, &out), KDT_OK);
            kdt_kv_cache_free(kv);
        }
        CHECK(memcmp(la, lb, sizeof la) == 0);
        CHECK(memcmp(la, lw, sizeof la) == 0);
    }
    kdt_model_free(ma);
    kdt_model_free(mb);
    kdt_model_free(mw);
    tm_rmdir(a);
    tm_rmdir(b);
    tm_rmdir(w);
}

/* Loads dir and expects `want` with both fragments in the message; never a model. */
static int load_fails(const char *dir, kdt_status want, const char *f1, const char *f2) {
    kdt_model *m = (kdt_model *)0x1;
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    kdt_status st = kdt_model_load(dir, &o, &m);
    int ok = err_is(st, want, f1, f2) && m == NULL;
    if (st == KDT_OK) kdt_model_free(m);
    return ok;
}

/* Overwrites `from` (first occurrence) with `to` (same length) in a file. */
static void patch_file(const char *path, const char *from, const char *to) {
    size_t n;
    char *b = tm_read_bytes(path, &n);
    char *p = b ? memmem(b, n, from, strlen(from)) : NULL;
    if (!p || strlen(from) != strlen(to)) {
        fprintf(stderr, "patch_file: cannot patch %s\n", path);
        exit(2);
    }
    memcpy(p, to, strlen(to));
    tm_write_bytes(path, b, n);
    free(b);
}

static void test_malformed_files(void) {
    tm_spec s = tm_default_spec();
    char d[600], p[700];
    size_t n;
    tm_mkdtemp(d, sizeof d);
    tm_write_model(d, &s);
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    char *orig = tm_read_bytes(p, &n);
    CHECK(load_fails("/nonexistent/kdt/dir", KDT_ERR_IO, "config.json", NULL));

    /* missing tensor */
    patch_file(p, "\"model.norm.weight\"", "\"model.norm.weighX\"");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "model.norm.weight", "missing"));
    tm_write_bytes(p, orig, n);
    /* wrong dtype (same element size, so offsets stay valid) */
    patch_file(p, "\"dtype\":\"F32\"", "\"dtype\":\"I32\"");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "model.embed_tokens.weight", "dtype I32"));
    tm_write_bytes(p, orig, n);
    /* unknown dtype string */
    patch_file(p, "\"dtype\":\"F32\"", "\"dtype\":\"Q32\"");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "unknown dtype", "model.safetensors"));
    tm_write_bytes(p, orig, n);
    /* truncated file */
    tm_write_bytes(p, orig, n - 100);
    CHECK(load_fails(d, KDT_ERR_FORMAT, "model.safetensors", "truncated"));
    /* bad header length */
    {
        char *b = malloc(n);
        memcpy(b, orig, n);
        b[6] = 0x7f;
        tm_write_bytes(p, b, n);
        CHECK(load_fails(d, KDT_ERR_FORMAT, "bad header length", "model.safetensors"));
        memcpy(b, orig, n);
        memset(b, 0, 8);
        b[0] = 1;
        tm_write_bytes(p, b, n);
        CHECK(load_fails(d, KDT_ERR_FORMAT, "bad header length", NULL));
        tm_write_bytes(p, b, 5); /* shorter than the length field */
        CHECK(load_fails(d, KDT_ERR_FORMAT, "too short", NULL));
        free(b);
    }
    tm_write_bytes(p, orig, n);
    /* bad JSON in the header */
    patch_file(p, "{\"__metadata__\"", "[\"__metadata__\"");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "not valid JSON", "model.safetensors"));
    tm_write_bytes(p, orig, n);
    /* size not matching the shape */
    patch_file(p, "\"shape\":[96,32]", "\"shape\":[96,31]");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "model.embed_tokens.weight", "need"));
    tm_write_bytes(p, orig, n);
    /* overlapping tensors: a hand-made file */
    {
        const char *hdr = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                          "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}";
        size_t hl = strlen(hdr), tot = 8 + hl + 12;
        unsigned char *b = calloc(1, tot);
        b[0] = (unsigned char)hl;
        memcpy(b + 8, hdr, hl);
        tm_write_bytes(p, b, tot);
        free(b);
        kdt_st_set st;
        CHECK(err_is(kdt_st_open_dir(d, 0, &st), KDT_ERR_FORMAT, "overlap", "model.safetensors"));
    }
    /* the data section not tiled exactly: a hole between tensors, bytes after the last one (what a
     * header length off by a padding byte gives: every tensor shifted, so never loaded) */
    {
        const char *hdrs[2] = {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}"};
        const size_t data[2] = {20, 9};
        const char *want[2] = {"hole", "cover 8 of the 9"};
        for (int k = 0; k < 2; k++) {
            size_t hl = strlen(hdrs[k]), tot = 8 + hl + data[k];
            unsigned char *b = calloc(1, tot);
            b[0] = (unsigned char)hl;
            memcpy(b + 8, hdrs[k], hl);
            tm_write_bytes(p, b, tot);
            free(b);
            kdt_st_set st;
            CHECK(err_is(kdt_st_open_dir(d, 0, &st), KDT_ERR_FORMAT, want[k], "model.safetensors"));
        }
    }
    /* the real file with 8 padding spaces after its header and a header length one byte short of
     * them: the JSON still parses, but the data would start one byte early */
    {
        const uint64_t hl = tm_get_le64(orig);
        char *b = malloc(n + 8);
        memcpy(b + 8, orig + 8, (size_t)hl);
        memset(b + 8 + hl, ' ', 8);
        memcpy(b + 16 + hl, orig + 8 + hl, n - 8 - (size_t)hl);
        tm_put_le64(b, hl + 7);
        tm_write_bytes(p, b, n + 8);
        CHECK(load_fails(d, KDT_ERR_FORMAT, "model.safetensors", "data bytes"));
        tm_put_le64(b, hl + 8); /* the same file with the right length loads */
        tm_write_bytes(p, b, n + 8);
        kdt_model *m = NULL;
        kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
        CHECK(kdt_model_load(d, &o, &m) == KDT_OK);
        kdt_model_free(m);
        free(b);
    }
    tm_write_bytes(p, orig, n);
    /* a config that does not match the weights: wrong shapes */
    {
        tm_spec s2 = s;
        s2.v = 10;
        tm_write_config(d, &s2);
        CHECK(load_fails(d, KDT_ERR_FORMAT, "kv_b_proj", "expected ["));
        s2 = s;
        s2.layers = 4;
        tm_write_config(d, &s2);
        CHECK(load_fails(d, KDT_ERR_FORMAT, "model.layers.3.", "missing"));
        s2 = s;
        s2.q_lora = 0;
        tm_write_config(d, &s2);
        CHECK(load_fails(d, KDT_ERR_FORMAT, "q_proj", "missing"));
        tm_write_config(d, &s);
    }
    /* config.json problems */
    snprintf(p, sizeof p, "%s/config.json", d);
    tm_write_bytes(p, "{\"vocab_size\":", 14);
    CHECK(load_fails(d, KDT_ERR_FORMAT, "config.json", "not valid JSON"));
    unlink(p);
    CHECK(load_fails(d, KDT_ERR_IO, "config.json", NULL));
    tm_write_config(d, &s);
    snprintf(p, sizeof p, "%s/model.safetensors", d);
    unlink(p);
    CHECK(load_fails(d, KDT_ERR_IO, "model.safetensors", NULL));
    free(orig);
    tm_rmdir(d);

    /* index + shards: a missing shard, a tensor mapped to the wrong shard, a bad shard name */
    tm_mkdtemp(d, sizeof d);
    s.shards = 2;
    tm_write_model(d, &s);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", d);
    char *idx = tm_read_bytes(p, &n);
    patch_file(p, "\"model.norm.weight\": \"model-00002", "\"model.norm.weight\": \"model-00001");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "model.norm.weight", "does not contain"));
    tm_write_bytes(p, idx, n);
    patch_file(p, "\"model.norm.weight\": \"model-00002-of-00002.safetensors\"",
               "\"model.norm.weight\": \"model-00003-of-00002.safetensors\"");
    CHECK(load_fails(d, KDT_ERR_IO, "model-00003-of-00002.safetensors", "cannot open"));
    tm_write_bytes(p, idx, n);
    patch_file(p, "\"model.norm.weight\": \"model-00002-of-00002.safetensors\"",
               "\"model.norm.weight\": \"../00002-of-00002.safetensors/xy\"");
    CHECK(load_fails(d, KDT_ERR_FORMAT, "model.norm.weight", "shard file name"));
    tm_write_bytes(p, "{\"weight_map\": 5}", 17);
    CHECK(load_fails(d, KDT_ERR_FORMAT, "weight_map", NULL));
    tm_write_bytes(p, "{\"weight_map\": {", 16);
    CHECK(load_fails(d, KDT_ERR_FORMAT, "index.json", "not valid JSON"));
    free(idx);
    tm_rmdir(d);
}

/* xorshift64: the corruption test's fixed-seed generator */
static uint64_t rnd(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* Random corruptions of a checkpoint (fixed seed; 200 loads of a two-shard one, then 200 of a
 * single model.safetensors, whose tensors no index cross-checks): 1-4 bits of a shard's length
 * field and JSON header, or of config.json / the index, flipped; bytes replaced by JSON
 * punctuation; a file cut short; a shard's header-length field replaced; a span of JSON cut out.
 * Each load must end in KDT_OK or a format / I/O / unsupported error whose message names the
 * model directory, with no model handed out; crashes and memory errors show up as such (CI runs
 * this under ASan/UBSan). */
static int corrupt_and_load(const char *d, int n_files, int n_shards, char (*path)[700], char **orig,
                            const size_t *len, uint64_t *x, int loads, int *loaded) {
    static const char punct[] = "\"{}[],:-09eE. \\";
    int failed = 0, bad = 0;
    for (int it = 0; it < loads; it++) {
        const int f = (int)(rnd(x) % (uint64_t)n_files);
        const int is_shard = f < n_shards; /* the file list starts with the shards */
        size_t n = len[f];
        unsigned char *b = malloc(n);
        memcpy(b, orig[f], n);
        size_t span = n; /* the part worth corrupting: a shard's length field and JSON header */
        if (is_shard) {
            const uint64_t hl = tm_get_le64(b);
            span = 8 + (size_t)hl < n ? 8 + (size_t)hl : n;
        }
        const int kind = (int)(rnd(x) % 4);
        if (kind == 0) {
            for (int k = 1 + (int)(rnd(x) % 4); k > 0; k--) b[rnd(x) % span] ^= (unsigned char)(1u << (rnd(x) % 8));
        } else if (kind == 1) {
            for (int k = 1 + (int)(rnd(x) % 4); k > 0; k--) b[rnd(x) % span] = (unsigned char)punct[rnd(x) % (sizeof punct - 1)];
        } else if (kind == 2) {
            n = (size_t)(rnd(x) % n);
        } else if (is_shard) {
            static const uint64_t lens[] = {0, 1, 7, 8, UINT64_MAX, (uint64_t)1 << 63, 1u << 30};
            const uint64_t v = rnd(x) % 2 ? lens[rnd(x) % (sizeof lens / sizeof lens[0])]
                                          : (uint64_t)(span - 8) + rnd(x) % 17 - 8;
            tm_put_le64(b, v);
        } else {
            const size_t a = (size_t)(rnd(x) % n), c = a + (size_t)(rnd(x) % 64);
            const size_t e = c < n ? c : n;
            memmove(b + a, b + e, n - e);
            n -= e - a;
        }
        tm_write_bytes(path[f], b, n);
        free(b);
        kdt_model *m = (kdt_model *)0x1;
        kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
        const kdt_status st = kdt_model_load(d, &o, &m);
        if (st == KDT_OK) {
            (*loaded)++;
            kdt_model_free(m);
        } else {
            failed++;
            const char *e = kdt_last_error();
            if (!((st == KDT_ERR_FORMAT || st == KDT_ERR_IO || st == KDT_ERR_UNSUPPORTED) && m == NULL && e &&
                  strstr(e, d))) {
                bad++;
                fprintf(stderr, "    load %d (%s, kind %d): %s \"%s\"%s\n", it, path[f], kind, kdt_status_name(st),
                        e ? e : "", m ? " (a model handed out)" : "");
            }
        }
        tm_write_bytes(path[f], orig[f], len[f]);
    }
    CHECK(failed > loads * 3 / 4);
    return bad;
}

static void test_random_corruptions(void) {
    static const char *two[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json",
                                "model.safetensors.index.json"};
    static const char *one[] = {"model.safetensors", "config.json"};
    uint64_t x = t_fuzz_seed(0x9E3779B97F4A7C15ull);
    int loaded = 0, bad = 0;
    for (int form = 0; form < 2; form++) {
        tm_spec s = tm_default_spec();
        s.shards = form == 0 ? 2 : 1;
        const char **names = form == 0 ? two : one;
        const int n_files = form == 0 ? 4 : 2, n_shards = form == 0 ? 2 : 1;
        char d[600], path[4][700];
        char *orig[4] = {0};
        size_t len[4] = {0};
        tm_mkdtemp(d, sizeof d);
        tm_write_model(d, &s);
        int ok = 1;
        for (int f = 0; f < n_files; f++) {
            snprintf(path[f], sizeof path[f], "%s/%s", d, names[f]);
            orig[f] = tm_read_bytes(path[f], &len[f]);
            if (!orig[f] || len[f] <= 8) ok = 0;
        }
        CHECK(ok);
        if (ok) bad += corrupt_and_load(d, n_files, n_shards, path, orig, len, &x, t_fuzz_iters(200), &loaded);
        for (int f = 0; f < n_files; f++) free(orig[f]);
        tm_rmdir(d);
    }
    printf("    %d corrupted loads: %d loaded (corruptions that left a valid checkpoint), the rest clear errors\n",
           2 * t_fuzz_iters(200), loaded);
    CHECK(bad == 0);
}

/* Field-level fuzz of config.json: 400 configs, each with 1-3 of its fields (the rope_scaling
 * block's too) set to a value from a list of edge cases (0, 1, -1, one off, doubled, halved, huge,
 * another enum string, null, a string for a number) or removed. Every load ends in a model that
 * prefills and decodes with finite logits, or a clear error naming the directory and no model;
 * this reaches the range and consistency checks (heads, ranks, experts vs top-k vs groups,
 * rope / YaRN, eps) that byte-level corruption rarely gets past the JSON parser to. */
static json_t *edge_value(json_t *v, uint64_t *rng) {
    static const char *const enums[] = {"yarn", "linear", "default", "sigmoid", "softmax", "noaux_tc", "greedy",
                                        "silu", "gelu", "deepseek_v3", "kimi_k2", ""};
    const int pick = t_rand_int(rng, 12);
    if (pick == 0) return json_null();
    if (pick == 1) return json_string(enums[t_rand_int(rng, (int)(sizeof enums / sizeof *enums))]);
    if (json_is_integer(v)) {
        const json_int_t x = json_integer_value(v);
        const json_int_t c[] = {0, 1, 2, 3, -1, x - 1, x + 1, 2 * x, x / 2, 9, 1 << 20, 2147483647};
        return json_integer(c[t_rand_int(rng, (int)(sizeof c / sizeof *c))]);
    }
    if (json_is_real(v)) {
        const double x = json_real_value(v);
        const double c[] = {0, -1, 1e-30, 1e30, 10 * x, x / 10, -x, 0.5, 1, 2};
        return json_real(c[t_rand_int(rng, (int)(sizeof c / sizeof *c))]);
    }
    if (json_is_string(v)) return json_string(enums[t_rand_int(rng, (int)(sizeof enums / sizeof *enums))]);
    if (json_is_boolean(v)) return json_boolean(!json_is_true(v));
    return json_integer(t_rand_int(rng, 3) - 1);
}

static void test_random_config_values(void) {
    tm_spec s = tm_default_spec();
    char d[600], path[700];
    tm_mkdtemp(d, sizeof d);
    tm_write_model(d, &s);
    snprintf(path, sizeof path, "%s/config.json", d);
    json_error_t je;
    json_t *base = json_load_file(path, 0, &je);
    CHECK(base != NULL);
    uint64_t rng = t_fuzz_seed(0xc0f16);
    int loaded = 0, refused = 0, bad = 0;
    for (int it = 0, iters = t_fuzz_iters(400); base && it < iters && bad < 5; it++) {
        json_t *cfg = json_deep_copy(base);
        for (int k = 1 + t_rand_int(&rng, 3); k > 0; k--) {
            json_t *obj = cfg, *rs = json_object_get(cfg, "rope_scaling");
            if (json_is_object(rs) && t_rand_int(&rng, 4) == 0) obj = rs;
            const int n_keys = (int)json_object_size(obj), at = n_keys ? t_rand_int(&rng, n_keys) : 0;
            const char *key;
            json_t *v;
            int i = 0;
            json_object_foreach(obj, key, v) {
                if (i++ != at) continue;
                if (t_rand_int(&rng, 8) == 0) json_object_del(obj, key);
                else json_object_set_new(obj, key, edge_value(v, &rng));
                break;
            }
        }
        char *text = json_dumps(cfg, JSON_COMPACT);
        json_decref(cfg);
        if (!text) continue;
        tm_write_bytes(path, text, strlen(text));
        kdt_model *m = (kdt_model *)0x1;
        const kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
        const kdt_status st = kdt_model_load(d, &o, &m);
        if (st != KDT_OK) {
            refused++;
            const char *e = kdt_last_error();
            if (!((st == KDT_ERR_FORMAT || st == KDT_ERR_IO || st == KDT_ERR_UNSUPPORTED) && m == NULL && e &&
                  strstr(e, d))) {
                bad++;
                CHECK_MSG(0, "%s \"%s\"%s: %s", kdt_status_name(st), e ? e : "", m ? " (a model handed out)" : "", text);
            }
            free(text);
            continue;
        }
        loaded++;
        const int V = kdt_model_get_config(m)->vocab_size;
        /* the forward below takes positions 0..3: a config whose max_position_embeddings is
         * shorter must refuse it by name (kdt_model_prefill / _decode), not run it */
        const int short_window = kdt_model_get_config(m)->max_position_embeddings < 4;
        kdt_kv_cache *kv = NULL;
        const kdt_kv_cache_options ko = {4, 1, 0};
        float *logits = malloc(sizeof(float) * 3 * (size_t)V);
        const int32_t toks[3] = {3, 17, 42};
        kdt_model_outputs out = {0};
        out.logits = logits;
        kdt_status fs = kdt_kv_cache_create(m, &ko, &kv);
        if (fs == KDT_OK) fs = kdt_model_prefill(m, kv, 0, toks, 3, &out);
        if (fs == KDT_OK) fs = kdt_model_decode(m, kv, 1, NULL, toks, &out);
        int finite = 1;
        for (int i = 0; fs == KDT_OK && i < V; i++) finite &= isfinite(logits[i]) != 0;
        if (short_window) {
            const char *e = kdt_last_error();
            if (fs == KDT_OK || !e || !strstr(e, "max_position_embeddings")) {
                bad++;
                CHECK_MSG(0, "positions past max_position_embeddings: %s: %s",
                          fs == KDT_OK ? "ran" : e ? e : "", text);
            }
        } else if (fs != KDT_OK || !finite) {
            bad++;
            CHECK_MSG(0, "loaded, but the forward %s: %s", fs != KDT_OK ? kdt_last_error() : "gave non-finite logits",
                      text);
        }
        free(text);
        free(logits);
        kdt_kv_cache_free(kv);
        kdt_model_free(m);
    }
    printf("    %d configs with edge values: %d loaded and ran, %d refused with a message\n", t_fuzz_iters(400), loaded,
           refused);
    CHECK(loaded >= 20 && refused >= 100); /* both outcomes are reached, or the test checks nothing */
    json_decref(base);
    tm_rmdir(d);
}

static void test_tied_and_extra_tensors(void) {
    /* a checkpoint with extra (MTP-like) tensors loads; they are ignored */
    tm_spec s = tm_default_spec();
    s.layers = 2;
    char d[600];
    tm_mkdtemp(d, sizeof d);
    tm_spec big = s;
    big.layers = 3; /* layer 2 plays the MTP layer: present in the file, not in the config */
    tm_write_model(d, &big);
    tm_write_config(d, &s);
    kdt_model *m = NULL;
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    CHECK_EQ_INT(kdt_model_load(d, &o, &m), KDT_OK);
    kdt_model_free(m);
    tm_rmdir(d);
}

/* safetensors does not align the data section: a header of odd length must still load (through
 * aligned copies) and compute the same; generation_config.json adds eos ids */
static void test_misaligned_data_and_generation_config(void) {
    tm_spec s = tm_default_spec();
    char d[600], p[700];
    tm_mkdtemp(d, sizeof d);
    tm_write_model(d, &s);
    kdt_model_options o = {0, 0, KDT_PREFILL_ABSORBED};
    int32_t toks[4] = {9, 8, 7, 6};
    float a[4 * 96], b[4 * 96];
    kdt_kv_cache_options ko = {2, 1, 0};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            size_t n;
            snprintf(p, sizeof p, "%s/model.safetensors", d);
            unsigned char *f = (unsigned char *)tm_read_bytes(p, &n);
            uint64_t hl = tm_get_le64(f);
            unsigned char *g = malloc(n + 1);
            memcpy(g, f, 8 + hl);
            g[8 + hl] = ' '; /* one more header byte: every tensor starts at an odd address */
            memcpy(g + 9 + hl, f + 8 + hl, n - 8 - hl);
            hl++;
            tm_put_le64(g, hl);
            tm_write_bytes(p, g, n + 1);
            free(f);
            free(g);
            snprintf(p, sizeof p, "%s/generation_config.json", d);
            const char *gen = "{\"eos_token_id\": [5, 7, 95, 5000]}";
            tm_write_bytes(p, gen, strlen(gen));
        }
        kdt_model *m = NULL;
        CHECK_EQ_INT(kdt_model_load(d, &o, &m), KDT_OK);
        if (!m) continue;
        if (pass == 1) {
            CHECK(m->st.n_owned > 0);
            const kdt_model_config *c = kdt_model_get_config(m);
            CHECK_EQ_INT(c->n_eos, 3);
            CHECK(c->eos_token_ids[0] == 95 && c->eos_token_ids[1] == 5 && c->eos_token_ids[2] == 7);
        }
        kdt_kv_cache *kv = NULL;
        CHECK_EQ_INT(kdt_kv_cache_create(m, &ko, &kv), KDT_OK);
        kdt_model_outputs out = {0};
        out.logits = pass ? b : a;
        CHECK_EQ_INT(kdt_model_prefill(m, kv, 0, toks, 4, &out), KDT_OK);
        kdt_kv_cache_free(kv);
        kdt_model_free(m);
    }
    CHECK(memcmp(a, b, sizeof a) == 0);
    snprintf(p, sizeof p, "%s/generation_config.json", d);
    tm_write_bytes(p, "{", 1);
    CHECK(load_fails(d, KDT_ERR_FORMAT, "generation_config.json", "not valid JSON"));
    tm_rmdir(d);
}

int main(void) {
    T_RUN(test_published_configs);
    T_RUN(test_misaligned_data_and_generation_config);
    T_RUN(test_new_form_equals_old_form);
    T_RUN(test_config_errors);
    T_RUN(test_load_variants);
    T_RUN(test_malformed_files);
    T_RUN(test_tied_and_extra_tensors);
    T_RUN(test_random_corruptions);
    T_RUN(test_random_config_values);
    return t_summary();
}
#else
int main(void) {
    printf("model subsystem not built (no jansson): skipped\n");
    return t_summary();
}
#endif
