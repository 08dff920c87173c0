/* test_model_util.h - helpers for the model tests: writes tiny random DeepSeek-V3-family
 * checkpoints (config.json + safetensors, single file or index + shards, F32 or BF16) into a
 * temporary directory, plus small file utilities used to build malformed checkpoints.
 * Header-only (static functions); included by tests/test_model_*.c. */
#ifndef KDT_TEST_MODEL_UTIL_H
#define KDT_TEST_MODEL_UTIL_H

#include "t.h"

#include "fp.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct tm_spec {
    int vocab, hidden, inter, moe_inter, layers, heads;
    int q_lora; /* 0 = null */
    int kv_lora, nope, rope, v;
    int experts, topk, shared, n_group, topk_group, first_dense;
    int max_pos;
    double eps, theta, rsf;
    int norm_topk;
    int yarn; /* 0 default RoPE, 1 YaRN */
    double factor, beta_fast, beta_slow, mscale, mscale_all_dim;
    int orig_max;
    int old_form;   /* write rope_theta + rope_scaling instead of rope_parameters */
    int wrapper;    /* K2.5 style: text_config wrapper + "language_model." tensor prefix */
    int no_interleave; /* write "rope_interleave": false (rotate (x[i], x[i+d/2]) pairs) */
    int bf16;       /* store weights as BF16 (else F32) */
    int shards;     /* 0/1 = model.safetensors, 2+ = index + shards */
    int latent_shift; /* kv_a_layernorm x 2^shift, kv_b_proj x 2^-shift: the same model with its
                         latent (KV cache) values 2^shift larger, exactly */
    uint64_t seed;
} tm_spec;

/* A small Kimi-like spec: q_lora, YaRN, one dense layer then MoE with n_group 2. */
static inline tm_spec tm_default_spec(void) {
    tm_spec s = {0};
    s.vocab = 96; s.hidden = 32; s.inter = 48; s.moe_inter = 16; s.layers = 3; s.heads = 2;
    s.q_lora = 24; s.kv_lora = 16; s.nope = 8; s.rope = 8; s.v = 12;
    s.experts = 8; s.topk = 3; s.shared = 1; s.n_group = 2; s.topk_group = 1; s.first_dense = 1;
    s.max_pos = 512; s.eps = 1e-5; s.theta = 50000; s.rsf = 2.5; s.norm_topk = 1;
    s.yarn = 1; s.factor = 4; s.beta_fast = 32; s.beta_slow = 1; s.mscale = 1; s.mscale_all_dim = 0.8;
    s.orig_max = 128;
    s.seed = 1234;
    return s;
}

/* A random small spec the loader accepts: every dimension drawn (even rope), q_lora or none, YaRN
 * (random factor, betas, mscales, original window) or default RoPE, group routing (n_group
 * dividing the experts, topk_group and top-k any the groups can supply), 0-2 shared experts,
 * 0..all dense first layers, norm_topk either way, eps, theta, routed scaling, pair or half-split
 * rotation, bf16 or fp32 weights, one or two shards (tests/test_model_forward.c against its fp64
 * reference, tests/gpu/test_model_gpu.c against the CPU). */
static inline tm_spec tm_random_spec(uint64_t *rng) {
    tm_spec s = tm_default_spec();
    s.vocab = 40 + t_rand_int(rng, 90);
    s.hidden = 8 * (2 + t_rand_int(rng, 5));
    s.inter = 8 * (1 + t_rand_int(rng, 8));
    s.moe_inter = 8 * (1 + t_rand_int(rng, 4));
    s.layers = 1 + t_rand_int(rng, 3);
    s.heads = 1 + t_rand_int(rng, 4);
    s.q_lora = t_rand_int(rng, 2) ? 8 * (1 + t_rand_int(rng, 4)) : 0;
    s.kv_lora = 8 * (1 + t_rand_int(rng, 3));
    s.nope = 2 * (1 + t_rand_int(rng, 6));
    s.rope = 2 * (1 + t_rand_int(rng, 6));
    s.v = 2 * (1 + t_rand_int(rng, 8));
    static const int groups[3] = {1, 2, 4};
    s.n_group = groups[t_rand_int(rng, 3)];
    const int per_group = 2 + t_rand_int(rng, 3);
    s.experts = s.n_group * per_group;
    s.topk_group = 1 + t_rand_int(rng, s.n_group);
    s.topk = 1 + t_rand_int(rng, s.topk_group * per_group);
    s.shared = t_rand_int(rng, 3);
    s.first_dense = t_rand_int(rng, s.layers + 1);
    s.norm_topk = t_rand_int(rng, 2);
    s.rsf = 1.0 + 2.0 * t_rand_unit(rng);
    s.eps = t_rand_int(rng, 2) ? 1e-6 : 1e-5;
    s.theta = t_rand_int(rng, 2) ? 10000.0 : 50000.0 * (1 + t_rand_int(rng, 20));
    s.yarn = t_rand_int(rng, 2);
    s.factor = 1.0 + 7.0 * t_rand_unit(rng);
    s.beta_fast = 8 + t_rand_int(rng, 25);
    s.beta_slow = 1 + t_rand_int(rng, 2);
    s.mscale = t_rand_int(rng, 2);
    s.mscale_all_dim = t_rand_int(rng, 2) ? 0.0 : t_rand_unit(rng);
    s.orig_max = 32 << t_rand_int(rng, 3);
    s.no_interleave = t_rand_int(rng, 2);
    s.bf16 = t_rand_int(rng, 2);
    s.shards = t_rand_int(rng, 2) ? 2 : 1;
    s.seed = t_rand_u64(rng);
    return s;
}

/* A one-line description of a random spec for test output. */
static inline void tm_spec_label(const tm_spec *s, int i, char *out, size_t n) {
    snprintf(out, n, "random spec %d (L%d H%d q%d kv%d r%d E%d/G%d/g%d/k%d sh%d %s%s)", i, s->layers, s->heads,
             s->q_lora, s->kv_lora, s->rope, s->experts, s->n_group, s->topk_group, s->topk, s->shared,
             s->yarn ? "yarn" : "rope", s->no_interleave ? " half" : "");
}

/* ---- one tensor list --------------------------------------------------------------------- */
typedef struct tm_tensor {
    char name[192];
    int ndim;
    int64_t shape[2];
    float *data;
} tm_tensor;

typedef struct tm_list {
    tm_tensor *t;
    int n, cap;
} tm_list;

/* Elements of a tensor of the list (1-D or 2-D). */
static inline int64_t tm_numel(const tm_tensor *t) { return t->ndim == 2 ? t->shape[0] * t->shape[1] : t->shape[0]; }

/* 1 if `s` ends with `suffix` (tensor names: "model.layers.3.self_attn.kv_b_proj.weight"). */
static inline int tm_ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

static inline void tm_add(tm_list *l, const char *prefix, const char *name, int64_t r, int64_t c, int kind, uint64_t *rng) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->t = realloc(l->t, (size_t)l->cap * sizeof *l->t);
    }
    tm_tensor *t = &l->t[l->n++];
    snprintf(t->name, sizeof t->name, "%s%s", prefix, name);
    t->ndim = r ? 2 : 1;
    t->shape[0] = r ? r : c;
    t->shape[1] = c;
    int64_t n = r ? r * c : c;
    t->data = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) {
        double v;
        if (kind == 1) v = 1.0 + 0.25 * t_rand_normal(rng);          /* norm weight */
        else if (kind == 2) v = 0.3 * t_rand_unit(rng);               /* router bias */
        else if (kind == 3) v = t_rand_normal(rng);                   /* embedding */
        else if (kind == 4) v = 3.0 * t_rand_normal(rng) / sqrt((double)c); /* lm_head */
        else v = t_rand_normal(rng) / sqrt((double)c);                /* linear [out][in] */
        t->data[i] = (float)v;
    }
}

static inline void tm_list_free(tm_list *l) {
    for (int i = 0; i < l->n; i++) free(l->t[i].data);
    free(l->t);
    memset(l, 0, sizeof *l);
}

static inline void tm_build_tensors(const tm_spec *s, tm_list *l) {
    uint64_t rng = s->seed;
    const char *pre = s->wrapper ? "language_model." : "";
    char n[128];
    tm_add(l, pre, "model.embed_tokens.weight", s->vocab, s->hidden, 3, &rng);
    for (int L = 0; L < s->layers; L++) {
#define A(suffix, r, c, kind)                                  \
    do {                                                       \
        snprintf(n, sizeof n, "model.layers.%d.%s", L, suffix); \
        tm_add(l, pre, n, r, c, kind, &rng);                   \
    } while (0)
        A("input_layernorm.weight", 0, s->hidden, 1);
        if (s->q_lora) {
            A("self_attn.q_a_proj.weight", s->q_lora, s->hidden, 0);
            A("self_attn.q_a_layernorm.weight", 0, s->q_lora, 1);
            A("self_attn.q_b_proj.weight", s->heads * (s->nope + s->rope), s->q_lora, 0);
        } else {
            A("self_attn.q_proj.weight", s->heads * (s->nope + s->rope), s->hidden, 0);
        }
        A("self_attn.kv_a_proj_with_mqa.weight", s->kv_lora + s->rope, s->hidden, 0);
        A("self_attn.kv_a_layernorm.weight", 0, s->kv_lora, 1);
        A("self_attn.kv_b_proj.weight", s->heads * (s->nope + s->v), s->kv_lora, 0);
        A("self_attn.o_proj.weight", s->hidden, s->heads * s->v, 0);
        A("post_attention_layernorm.weight", 0, s->hidden, 1);
        if (L < s->first_dense || s->experts == 0) {
            A("mlp.gate_proj.weight", s->inter, s->hidden, 0);
            A("mlp.up_proj.weight", s->inter, s->hidden, 0);
            A("mlp.down_proj.weight", s->hidden, s->inter, 0);
        } else {
            A("mlp.gate.weight", s->experts, s->hidden, 0);
            A("mlp.gate.e_score_correction_bias", 0, s->experts, 2);
            for (int e = 0; e < s->experts; e++) {
                char en[96];
                snprintf(en, sizeof en, "mlp.experts.%d.gate_proj.weight", e);
                A(en, s->moe_inter, s->hidden, 0);
                snprintf(en, sizeof en, "mlp.experts.%d.up_proj.weight", e);
                A(en, s->moe_inter, s->hidden, 0);
                snprintf(en, sizeof en, "mlp.experts.%d.down_proj.weight", e);
                A(en, s->hidden, s->moe_inter, 0);
            }
            if (s->shared) {
                A("mlp.shared_experts.gate_proj.weight", s->shared * s->moe_inter, s->hidden, 0);
                A("mlp.shared_experts.up_proj.weight", s->shared * s->moe_inter, s->hidden, 0);
                A("mlp.shared_experts.down_proj.weight", s->hidden, s->shared * s->moe_inter, 0);
            }
        }
#undef A
    }
    tm_add(l, pre, "model.norm.weight", 0, s->hidden, 1, &rng);
    tm_add(l, pre, "lm_head.weight", s->vocab, s->hidden, 4, &rng);
    if (s->latent_shift) /* powers of two: exact, so the scaled model is the same model */
        for (int i = 0; i < l->n; i++) {
            tm_tensor *t = &l->t[i];
            const double f = tm_ends_with(t->name, "kv_a_layernorm.weight") ? ldexp(1.0, s->latent_shift)
                             : tm_ends_with(t->name, "kv_b_proj.weight")    ? ldexp(1.0, -s->latent_shift)
                                                                            : 0.0;
            if (f == 0) continue;
            for (int64_t k = 0, cnt = tm_numel(t); k < cnt; k++) t->data[k] = (float)(t->data[k] * f);
        }
    if (s->bf16) /* make the values bf16-exact so F32 and BF16 files hold the same model */
        for (int i = 0; i < l->n; i++) {
            for (int64_t k = 0, cnt = tm_numel(&l->t[i]); k < cnt; k++)
                l->t[i].data[k] = kdt_bf16_to_f32(kdt_f32_to_bf16(l->t[i].data[k]));
        }
}

/* ---- files ------------------------------------------------------------------------------- */
/* A safetensors header-length field: 8 bytes, little-endian. */
static inline uint64_t tm_get_le64(const void *p) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | b[i];
    return v;
}
static inline void tm_put_le64(void *p, uint64_t v) {
    unsigned char *b = (unsigned char *)p;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
}

static inline void tm_write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
    if (n) fwrite(p, 1, n, f);
    fclose(f);
}

static inline char *tm_read_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    b[*n] = 0;
    fclose(f);
    return b;
}

/* Writes tensors [i0, i1) of l as one safetensors file (header padded to 8 bytes). */
static inline void tm_write_safetensors(const char *path, const tm_list *l, int i0, int i1, int bf16) {
    size_t esz = bf16 ? 2 : 4, hcap = 256 + (size_t)(i1 - i0) * 256, hl = 0, off = 0;
    char *h = malloc(hcap);
    hl += (size_t)snprintf(h + hl, hcap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = i0; i < i1; i++) {
        const tm_tensor *t = &l->t[i];
        size_t cnt = (size_t)tm_numel(t);
        if (t->ndim == 2)
            hl += (size_t)snprintf(h + hl, hcap - hl,
                                   ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],\"data_offsets\":[%zu,%zu]}",
                                   t->name, bf16 ? "BF16" : "F32", (long long)t->shape[0], (long long)t->shape[1],
                                   off, off + cnt * esz);
        else
            hl += (size_t)snprintf(h + hl, hcap - hl, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%zu,%zu]}",
                                   t->name, bf16 ? "BF16" : "F32", (long long)t->shape[0], off, off + cnt * esz);
        off += cnt * esz;
    }
    hl += (size_t)snprintf(h + hl, hcap - hl, "}");
    while (hl % 8) h[hl++] = ' ';
    FILE *f = fopen(path, "wb");
    unsigned char len8[8];
    tm_put_le64(len8, hl);
    fwrite(len8, 1, 8, f);
    fwrite(h, 1, hl, f);
    for (int i = i0; i < i1; i++) {
        const tm_tensor *t = &l->t[i];
        size_t cnt = (size_t)tm_numel(t);
        for (size_t k = 0; k < cnt; k++) {
            if (bf16) {
                uint16_t b = kdt_f32_to_bf16(t->data[k]);
                fwrite(&b, 2, 1, f);
            } else {
                fwrite(&t->data[k], 4, 1, f);
            }
        }
    }
    fclose(f);
    free(h);
}

static inline void tm_write_config(const char *dir, const tm_spec *s) {
    char path[700], rope[512], text[4096];
    if (!s->yarn) {
        if (s->old_form) snprintf(rope, sizeof rope, "\"rope_theta\": %.17g, \"rope_scaling\": null", s->theta);
        else snprintf(rope, sizeof rope, "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %.17g}", s->theta);
    } else if (s->old_form) {
        snprintf(rope, sizeof rope,
                 "\"rope_theta\": %.17g, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": %.17g, \"beta_fast\": %.17g, "
                 "\"beta_slow\": %.17g, \"mscale\": %.17g, \"mscale_all_dim\": %.17g, "
                 "\"original_max_position_embeddings\": %d}",
                 s->theta, s->factor, s->beta_fast, s->beta_slow, s->mscale, s->mscale_all_dim, s->orig_max);
    } else {
        snprintf(rope, sizeof rope,
                 "\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": %.17g, \"factor\": %.17g, "
                 "\"beta_fast\": %.17g, \"beta_slow\": %.17g, \"mscale\": %.17g, \"mscale_all_dim\": %.17g, "
                 "\"original_max_position_embeddings\": %d}",
                 s->theta, s->factor, s->beta_fast, s->beta_slow, s->mscale, s->mscale_all_dim, s->orig_max);
    }
    char qlora[32];
    if (s->q_lora) snprintf(qlora, sizeof qlora, "%d", s->q_lora);
    else snprintf(qlora, sizeof qlora, "null");
    snprintf(text, sizeof text,
             "{\"model_type\": \"%s\", \"vocab_size\": %d, \"hidden_size\": %d, \"intermediate_size\": %d, "
             "\"moe_intermediate_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d, "
             "\"num_key_value_heads\": %d, \"q_lora_rank\": %s, \"kv_lora_rank\": %d, \"qk_nope_head_dim\": %d, "
             "\"qk_rope_head_dim\": %d, \"v_head_dim\": %d, \"n_routed_experts\": %d, \"num_experts_per_tok\": %d, "
             "\"n_shared_experts\": %d, \"n_group\": %d, \"topk_group\": %d, \"first_k_dense_replace\": %d, "
             "\"max_position_embeddings\": %d, \"rms_norm_eps\": %.17g, \"routed_scaling_factor\": %.17g, "
             "\"norm_topk_prob\": %s, \"scoring_func\": \"sigmoid\", \"topk_method\": \"noaux_tc\", "
             "\"hidden_act\": \"silu\", \"num_nextn_predict_layers\": 1, \"eos_token_id\": %d, "
             "\"bos_token_id\": %d, \"tie_word_embeddings\": false, \"some_unknown_field\": [1, 2], "
             "\"rope_interleave\": %s, %s}",
             s->wrapper ? "kimi_k2" : "deepseek_v3", s->vocab, s->hidden, s->inter, s->moe_inter, s->layers,
             s->heads, s->heads, qlora, s->kv_lora, s->nope, s->rope, s->v, s->experts, s->topk, s->shared,
             s->n_group, s->topk_group, s->first_dense, s->max_pos, s->eps, s->rsf, s->norm_topk ? "true" : "false",
             s->vocab - 1, s->vocab - 2, s->no_interleave ? "false" : "true", rope);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (s->wrapper) {
        char w[5000];
        snprintf(w, sizeof w,
                 "{\"architectures\": [\"KimiK25ForConditionalGeneration\"], \"model_type\": \"kimi_k25\", "
                 "\"text_config\": %s, \"vision_config\": {\"hidden_size\": 8}}",
                 text);
        tm_write_bytes(path, w, strlen(w));
    } else {
        tm_write_bytes(path, text, strlen(text));
    }
}

/* A fresh empty directory under /tmp. */
static inline void tm_mkdtemp(char *buf, size_t n) {
    snprintf(buf, n, "/tmp/kdt_model_test_XXXXXX");
    if (!mkdtemp(buf)) {
        perror("mkdtemp");
        exit(2);
    }
}

/* Writes the spec's checkpoint into dir (created if needed). */
static inline void tm_write_model(const char *dir, const tm_spec *s) {
    mkdir(dir, 0755);
    tm_list l = {0};
    tm_build_tensors(s, &l);
    tm_write_config(dir, s);
    char path[700];
    if (s->shards <= 1) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        tm_write_safetensors(path, &l, 0, l.n, s->bf16);
    } else {
        size_t cap = (size_t)l.n * 200 + 256, o = 0;
        char *idx = malloc(cap);
        o += (size_t)snprintf(idx + o, cap - o, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
        for (int k = 0; k < s->shards; k++) {
            int i0 = l.n * k / s->shards, i1 = l.n * (k + 1) / s->shards;
            char fname[64];
            snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", k + 1, s->shards);
            snprintf(path, sizeof path, "%s/%s", dir, fname);
            tm_write_safetensors(path, &l, i0, i1, s->bf16);
            for (int i = i0; i < i1; i++)
                o += (size_t)snprintf(idx + o, cap - o, "%s\"%s\": \"%s\"", (k || i) ? ", " : "", l.t[i].name, fname);
        }
        o += (size_t)snprintf(idx + o, cap - o, "}}");
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        tm_write_bytes(path, idx, o);
        free(idx);
    }
    tm_list_free(&l);
}

/* rm -r of a directory written by these helpers (flat). */
static inline void tm_rmdir(const char *dir) {
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
}

#endif
