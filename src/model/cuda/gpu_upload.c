/* gpu_upload.c - kdt_gpu_model: the device weight layout (kdt_gpu_model_alloc), the upload of a
 * loaded checkpoint (kdt_model_to_gpu), random models for benchmarks (kdt_gpu_model_random),
 * and weight-byte figures for rooflines.
 *
 * Upload: every 2-D weight becomes bf16 [rows][ld] (ld = cols rounded up to 64, zero padding).
 * Plain BF16 rows are copied as they are; F32 / F16 / FP8-block / INT4-group rows go through
 * kdt_weight_row_f32 (the CPU's own dequantization) and are rounded to bf16 once. Layout changes
 * made on the way: q_a and kv_a are stacked into one [q_lora + d_c + d_r][D] matrix (one GEMM),
 * gate and up are interleaved by 32-row blocks (the SwiGLU finish pairs them), kv_b is split into
 * W_UK^T [H][d_c][d_n] and W_UV [H][d_v][d_c]. The copy jobs run in checkpoint file order
 * (shard by shard, offset order inside a shard) through two pinned staging buffers, with a
 * progress bar on a terminal. The RoPE table is computed on the host exactly as forward.c
 * computes cos/sin, and uploaded. */
#include "gpu_internal.h"
#include "kernels/cuda/device_limits.h"

#include "fp.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define STAGE_BYTES ((size_t)32 << 20)

static kdt_status cuda_fail(cudaError_t e, const char *what) {
    return kdt_fail(KDT_ERR_CUDA, "%s: %s", what, cudaGetErrorString(e));
}

static kdt_status galloc(kdt_gpu_model *g, void **p, size_t bytes, const char *what) {
    *p = NULL;
    if (bytes == 0) return KDT_OK;
    if (g->n_allocs == g->cap_allocs) {
        int32_t cap = g->cap_allocs ? 2 * g->cap_allocs : 256;
        void **a = realloc(g->allocs, (size_t)cap * sizeof *a);
        if (!a) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU model: allocation list");
        g->allocs = a;
        g->cap_allocs = cap;
    }
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU model: %s: %zu MB: %s (%zu MB allocated so far)", what,
                        bytes >> 20, cudaGetErrorString(e), g->total_bytes >> 20);
    g->allocs[g->n_allocs++] = *p;
    g->total_bytes += bytes;
    return KDT_OK;
}

static kdt_status alloc_mat(kdt_gpu_model *g, kdt_gmat *m, int64_t rows, int64_t cols, int32_t batch,
                            const char *what) {
    memset(m, 0, sizeof *m);
    m->rows = (int32_t)rows;
    m->cols = (int32_t)cols;
    m->ld = (int32_t)kdt_g_round_up(cols, KDT_G_BK);
    m->batch = batch;
    m->batch_stride = rows * m->ld;
    return galloc(g, (void **)&m->w, (size_t)batch * (size_t)rows * (size_t)m->ld * 2, what);
}


kdt_status kdt_gpu_model_alloc(kdt_gpu_model *g, const kdt_gpu_options *opt, const float *rope_inv_freq,
                               int32_t share_lm_head) {
    const kdt_model_config *c = &g->cfg;
    const int32_t D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
                  dv = c->v_head_dim, dc = c->kv_lora_rank, ql = c->q_lora_rank, dqk = dn + dr, dq = dc + dr,
                  E = c->n_routed_experts;
    g->device = opt ? opt->device : 0;
    cudaError_t e = cudaSetDevice(g->device);
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "GPU model: device %d: %s", g->device, cudaGetErrorString(e));
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, g->device)) != cudaSuccess) return cuda_fail(e, "GPU model: device");
    g->n_sm = prop.multiProcessorCount;
    int optin = 0;
    if ((e = kdt_smem_optin(g->device, &optin)) != cudaSuccess) return cuda_fail(e, "GPU model: device");
    g->smem_optin = (size_t)optin;
    /* what the kernels support */
    if (dq % 8)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "GPU forward: kv_lora_rank + qk_rope_head_dim = %d must be a multiple of 8",
                        dq);
    const size_t att = kdt_attn_smem_bytes(16, dc, dq);
    if (att == 0 || att > g->smem_optin)
        return kdt_fail(KDT_ERR_UNSUPPORTED,
                        "GPU forward: kv_lora_rank %d with rope %d needs %zu bytes of shared memory per block "
                        "(device: %zu); kv_lora_rank <= 512 is supported",
                        dc, dr, att, g->smem_optin);
    if (E + 1 > 1024)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "GPU forward: %d routed experts (at most 1023)", E);
    if ((size_t)(ql + dq) * 4 > 48 * 1024)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "GPU forward: q_lora_rank + kv_lora_rank + rope = %d is too wide",
                        ql + dq);
    g->kv_row_stride = (int32_t)kdt_g_round_up(dq, 8);
    g->has_shared = c->n_shared_experts > 0;

    KDT_TRY(alloc_mat(g, &g->embed, c->vocab_size, D, 1, "embed_tokens"));
    if (share_lm_head) g->lm_head = g->embed;
    else KDT_TRY(alloc_mat(g, &g->lm_head, c->vocab_size, D, 1, "lm_head"));
    KDT_TRY(galloc(g, (void **)&g->final_norm, (size_t)D * 4, "norm"));

    g->layers = calloc((size_t)c->n_layers, sizeof *g->layers);
    if (!g->layers) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU model: layer table");
    const int32_t moe_ipad = (int32_t)kdt_g_round_up(c->moe_intermediate_size, KDT_G_GU_BLOCK);
    const int32_t shared_i = c->n_shared_experts * c->moe_intermediate_size;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kdt_gpu_layer *L = &g->layers[l];
        L->is_moe = E > 0 && l >= c->first_k_dense_replace && l % c->moe_layer_freq == 0;
        KDT_TRY(galloc(g, (void **)&L->input_norm, (size_t)D * 4, "input_layernorm"));
        KDT_TRY(galloc(g, (void **)&L->post_norm, (size_t)D * 4, "post_attention_layernorm"));
        if (ql > 0) KDT_TRY(galloc(g, (void **)&L->q_a_norm, (size_t)ql * 4, "q_a_layernorm"));
        KDT_TRY(galloc(g, (void **)&L->kv_a_norm, (size_t)dc * 4, "kv_a_layernorm"));
        KDT_TRY(alloc_mat(g, &L->w_a, ql + dq, D, 1, "q_a_proj + kv_a_proj_with_mqa"));
        KDT_TRY(alloc_mat(g, &L->q_b, (int64_t)H * dqk, ql > 0 ? ql : D, 1, "q_b_proj / q_proj"));
        KDT_TRY(alloc_mat(g, &L->uk_t, dc, dn, H, "kv_b_proj (W_UK)"));
        KDT_TRY(alloc_mat(g, &L->uv, dv, dc, H, "kv_b_proj (W_UV)"));
        KDT_TRY(alloc_mat(g, &L->o_proj, D, (int64_t)H * dv, 1, "o_proj"));
        if (!L->is_moe) {
            L->dense_inter = c->intermediate_size;
            KDT_TRY(alloc_mat(g, &L->dense_gu, 2 * kdt_g_round_up(L->dense_inter, KDT_G_GU_BLOCK), D, 1, "mlp gate/up"));
            KDT_TRY(alloc_mat(g, &L->dense_down, D, L->dense_inter, 1, "mlp down"));
            continue;
        }
        KDT_TRY(alloc_mat(g, &L->router, E, D, 1, "mlp.gate"));
        KDT_TRY(galloc(g, (void **)&L->router_bias, (size_t)E * 4, "e_score_correction_bias"));
        KDT_TRY(alloc_mat(g, &L->experts_gu, 2 * (int64_t)moe_ipad, D, E, "experts gate/up"));
        KDT_TRY(alloc_mat(g, &L->experts_down, D, c->moe_intermediate_size, E, "experts down"));
        if (g->has_shared) {
            KDT_TRY(alloc_mat(g, &L->shared_gu, 2 * kdt_g_round_up(shared_i, KDT_G_GU_BLOCK), D, 1, "shared_experts gate/up"));
            KDT_TRY(alloc_mat(g, &L->shared_down, D, shared_i, 1, "shared_experts down"));
        }
        L->n_expert_desc = E + g->has_shared;
        kdt_gpu_expert *desc = calloc((size_t)L->n_expert_desc, sizeof *desc);
        if (!desc) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU model: expert table");
        for (int32_t x = 0; x < L->n_expert_desc; x++) {
            const int shared = x == E;
            desc[x].gu = shared ? L->shared_gu.w : L->experts_gu.w + (int64_t)x * L->experts_gu.batch_stride;
            desc[x].down = shared ? L->shared_down.w : L->experts_down.w + (int64_t)x * L->experts_down.batch_stride;
            desc[x].inter = shared ? shared_i : c->moe_intermediate_size;
            desc[x].i_pad = (int32_t)kdt_g_round_up(desc[x].inter, KDT_G_GU_BLOCK);
            desc[x].ld_d = shared ? L->shared_gu.ld : L->experts_gu.ld;
            desc[x].ld_i = shared ? L->shared_down.ld : L->experts_down.ld;
        }
        kdt_status st = galloc(g, (void **)&L->experts, (size_t)L->n_expert_desc * sizeof *desc, "expert table");
        if (st == KDT_OK && (e = cudaMemcpy(L->experts, desc, (size_t)L->n_expert_desc * sizeof *desc,
                                            cudaMemcpyHostToDevice)) != cudaSuccess)
            st = cuda_fail(e, "GPU model: expert table");
        free(desc);
        if (st != KDT_OK) return st;
    }
    g->max_inter_pad = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kdt_gpu_layer *L = &g->layers[l];
        int32_t w = L->is_moe ? moe_ipad : (int32_t)kdt_g_round_up(L->dense_inter, KDT_G_GU_BLOCK);
        if (L->is_moe && g->has_shared && (int32_t)kdt_g_round_up(shared_i, KDT_G_GU_BLOCK) > w)
            w = (int32_t)kdt_g_round_up(shared_i, KDT_G_GU_BLOCK);
        if (w > g->max_inter_pad) g->max_inter_pad = w;
    }

    /* RoPE: cos/sin of (float)pos * inv_freq[i] times the attention factor, as forward.c */
    int32_t rows = c->max_position_embeddings;
    if (opt && opt->max_position > 0 && opt->max_position < rows) rows = opt->max_position;
    g->rope_rows = rows;
    const int32_t half = dr / 2;
    float *cs = malloc((size_t)rows * (size_t)half * 2 * sizeof(float));
    if (!cs) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU model: RoPE table");
    for (int32_t p = 0; p < rows; p++)
        for (int32_t i = 0; i < half; i++) {
            const float angle = (float)p * rope_inv_freq[i];
            cs[((size_t)p * half + i) * 2] = cosf(angle) * c->rope_attention_factor;
            cs[((size_t)p * half + i) * 2 + 1] = sinf(angle) * c->rope_attention_factor;
        }
    kdt_status st = galloc(g, (void **)&g->rope_cs, (size_t)rows * half * 2 * sizeof(float), "RoPE table");
    if (st == KDT_OK && (e = cudaMemcpy(g->rope_cs, cs, (size_t)rows * half * 2 * sizeof(float),
                                        cudaMemcpyHostToDevice)) != cudaSuccess)
        st = cuda_fail(e, "GPU model: RoPE table");
    free(cs);
    /* pageable copies may still be in flight; the forward runs on other streams */
    if (st == KDT_OK && (e = cudaDeviceSynchronize()) != cudaSuccess) st = cuda_fail(e, "GPU model");
    return st;
}

void kdt_gpu_model_free(kdt_gpu_model *g) {
    if (!g) return;
    for (int32_t i = 0; i < g->n_allocs; i++) cudaFree(g->allocs[i]);
    free(g->allocs);
    free(g->layers);
    free(g);
}

const kdt_model_config *kdt_gpu_model_get_config(const kdt_gpu_model *g) { return g ? &g->cfg : NULL; }

static size_t mat_bytes(const kdt_gmat *m) { return m->w ? (size_t)m->batch * m->rows * m->ld * 2 : 0; }

kdt_status kdt_gpu_model_weight_bytes(const kdt_gpu_model *g, int32_t layer, kdt_gpu_weight_bytes *out) {
    KDT_CHECK_ARG(g && out, "kdt_gpu_model_weight_bytes: NULL argument");
    KDT_CHECK_ARG(layer >= 0 && layer < g->cfg.n_layers, "kdt_gpu_model_weight_bytes: layer %d (0..%d)", layer,
                  g->cfg.n_layers - 1);
    const kdt_gpu_layer *L = &g->layers[layer];
    const kdt_model_config *c = &g->cfg;
    memset(out, 0, sizeof *out);
    out->attention = mat_bytes(&L->w_a) + mat_bytes(&L->q_b) + mat_bytes(&L->uk_t) + mat_bytes(&L->uv) +
                     mat_bytes(&L->o_proj) + (size_t)(2 * c->hidden_size + c->q_lora_rank + c->kv_lora_rank) * 4;
    if (!L->is_moe) {
        out->dense_mlp = mat_bytes(&L->dense_gu) + mat_bytes(&L->dense_down);
    } else {
        out->router = mat_bytes(&L->router) + (size_t)c->n_routed_experts * 4;
        out->routed_expert = (mat_bytes(&L->experts_gu) + mat_bytes(&L->experts_down)) / (size_t)c->n_routed_experts;
        out->shared_expert = mat_bytes(&L->shared_gu) + mat_bytes(&L->shared_down);
    }
    out->total = g->total_bytes;
    return KDT_OK;
}

/* ---- tiled weights: large models' experts by default (KDT_GPU_TILED_EXPERTS), dense opt-in ---- */

/* Rewrites weight matrices in place with kdt_gemm_tile64, so each stage block a GEMM loads (64
 * rows x 64 K) is 8 KB of contiguous memory, which the grouped GEMM fetches with one bulk copy
 * (sm_90+). Values and results are unchanged (the GEMM reads the layout; the bits are the
 * row-major ones). Measured on the H200 (bench/RESULTS.md, session 8): with the grouped GEMM's
 * 4-5 CTAs per SM, tiled experts + the bulk loader take the Kimi layer's decode from 402 to 365 us
 * and verify N 65 from 8,090 to 7,119 us; tiled dense matrices gained nothing measurable, so
 * KDT_GPU_TILED_DENSE=1 stays opt-in.
 * EXPERTS: every routed and shared expert's gate/up and down, all or none (one grouped launch
 * reads them all; a model whose expert matrices are not whole 64-row tiles stays row-major).
 * DENSE: the attention projections, o_proj, the router and dense MLPs, each on its own (a matrix
 * that is not whole tiles stays row-major); not the embedding or lm_head, and not W_UK / W_UV,
 * which the plain prefill attention (gpu_plain.cu) reads row by row besides the GEMMs. iid_fill: the values
 * are i.i.d. random (kdt_gpu_model_random); where a matrix has no padding columns any
 * permutation of it is an equally random matrix, so the layout is only declared, not rewritten. */
static int tileable(const kdt_gmat *m) {
    return m->w && m->rows > 0 && m->rows % 64 == 0 && m->ld % 64 == 0 &&
           (m->batch <= 1 || m->batch_stride == (int64_t)m->rows * m->ld);
}
/* Tiles (or, iid_fill without padding, declares) m with scratch tmp of tmp_rows rows. */
static kdt_status tile_mat(kdt_gmat *m, int iid_fill, uint16_t *tmp, int64_t tmp_rows) {
    if (!(iid_fill && m->ld == m->cols)) {
        const int64_t batch = m->batch > 1 ? m->batch : 1;
        KDT_TRY(kdt_gemm_tile64(m->w, batch * m->rows, m->ld, tmp, tmp_rows, 0));
    }
    m->tiled = 1;
    return KDT_OK;
}
/* Experts tiled by default where a one-token decode's gate/up grid has more than 2 CTAs per SM
 * (Kimi K2.6: 64 column tiles x 9 experts = 576 on 132 SMs): there the grouped policy runs 4-5 CTAs
 * per SM with bulk copies, which the layout serves. Smaller grids run 2 per SM on cp.async, where
 * row-major measured faster (the bundled tiny model's engine, H200, session 9: batch 1 2,225 vs
 * 2,118 tokens/s autoregressive). KDT_GPU_TILED_EXPERTS=1 / =0 forces tiled / row-major. */
static int tile_experts_by_default(const kdt_gpu_model *g) {
    const kdt_model_config *c = &g->cfg;
    const int64_t tiles = (2 * (int64_t)c->moe_intermediate_size + 63) / 64;
    const int64_t ctas = tiles * (c->n_experts_per_tok + (c->n_shared_experts > 0 ? 1 : 0));
    return g->n_sm > 0 && ctas > 2 * (int64_t)g->n_sm;
}

static kdt_status tile_weights(kdt_gpu_model *g, int iid_fill) {
    const int experts = kdt_g_env_is("KDT_GPU_TILED_EXPERTS", '1') ||
                        (!kdt_g_env_is("KDT_GPU_TILED_EXPERTS", '0') && tile_experts_by_default(g));
    const int dense = kdt_g_env_is("KDT_GPU_TILED_DENSE", '1');
    if (!experts && !dense) return KDT_OK;
    const int32_t NL = g->cfg.n_layers;
    int experts_ok = experts;
    int32_t max_ld = 0;
    for (int32_t l = 0; l < NL; l++) {
        const kdt_gpu_layer *L = &g->layers[l];
        const kdt_gmat *ex[4] = {&L->experts_gu, &L->experts_down, &L->shared_gu, &L->shared_down};
        const kdt_gmat *de[6] = {&L->w_a, &L->q_b, &L->o_proj, &L->router, &L->dense_gu, &L->dense_down};
        for (int i = 0; experts && L->is_moe && i < 4; i++) {
            if (!ex[i]->w || ex[i]->rows == 0) continue;
            if (!tileable(ex[i])) experts_ok = 0;
            else if (ex[i]->ld > max_ld) max_ld = ex[i]->ld;
        }
        for (int i = 0; dense && i < 6; i++)
            if (tileable(de[i]) && de[i]->ld > max_ld) max_ld = de[i]->ld;
    }
    if (max_ld == 0) return KDT_OK;
    const int64_t tmp_rows = 4096;
    uint16_t *tmp = NULL;
    cudaError_t e = cudaMalloc((void **)&tmp, (size_t)tmp_rows * max_ld * 2);
    if (e != cudaSuccess) return cuda_fail(e, "tiled weights: scratch");
    kdt_status st = KDT_OK;
    for (int32_t l = 0; st == KDT_OK && l < NL; l++) {
        kdt_gpu_layer *L = &g->layers[l];
        kdt_gmat *ex[4] = {&L->experts_gu, &L->experts_down, &L->shared_gu, &L->shared_down};
        kdt_gmat *de[6] = {&L->w_a, &L->q_b, &L->o_proj, &L->router, &L->dense_gu, &L->dense_down};
        for (int i = 0; st == KDT_OK && experts_ok && L->is_moe && i < 4; i++)
            if (ex[i]->w && ex[i]->rows > 0) st = tile_mat(ex[i], iid_fill, tmp, tmp_rows);
        for (int i = 0; st == KDT_OK && dense && i < 6; i++)
            if (tileable(de[i])) st = tile_mat(de[i], iid_fill, tmp, tmp_rows);
    }
    if (st == KDT_OK && (e = cudaDeviceSynchronize()) != cudaSuccess) st = cuda_fail(e, "tiled weights");
    cudaFree(tmp);
    if (st == KDT_OK && experts_ok) g->experts_tiled = 1;
    return st;
}

/* ---- random models ------------------------------------------------------------------------- */

kdt_status kdt_gpu_model_random(const char *config_json, const kdt_gpu_random_init *init, const kdt_gpu_options *opt,
                                kdt_gpu_model **out) {
    KDT_CHECK_ARG(out, "kdt_gpu_model_random: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(config_json, "kdt_gpu_model_random: config_json is NULL");
    kdt_gpu_random_init ri = {0};
    if (init) ri = *init;
    if (ri.weight_std == 0) ri.weight_std = 0.02f;
    if (ri.router_bias_std == 0) ri.router_bias_std = 0.001f;
    if (ri.corr_block == 0) ri.corr_block = 32;
    if (ri.corr_sigma == 0) ri.corr_sigma = 0.05f;
    KDT_CHECK_ARG(ri.corr_block >= 1, "kdt_gpu_model_random: corr_block = %d", ri.corr_block);
    kdt_gpu_model *g = calloc(1, sizeof *g);
    if (!g) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_model_random");
    kdt_status st = kdt_config_parse(config_json, strlen(config_json), "config_json", &g->cfg);
    float *inv = NULL;
    if (st == KDT_OK) {
        inv = malloc((size_t)(g->cfg.qk_rope_head_dim / 2 + 1) * sizeof(float));
        if (!inv) st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_model_random");
    }
    if (st == KDT_OK) {
        kdt_rope_inv_freq(&g->cfg, inv);
        st = kdt_gpu_model_alloc(g, opt, inv, g->cfg.tie_word_embeddings);
    }
    free(inv);
    const kdt_model_config *c = &g->cfg;
    uint64_t seed = ri.seed * 0x2545f4914f6cdd1dull + 1;
#define NEXT_SEED (seed += 0x9e3779b97f4a7c15ull)
#define FILL(m)                                                                                       \
    do {                                                                                              \
        if (st == KDT_OK && (m).w)                                                                    \
            st = kdt_op_fill_mat((m).w, (int64_t)(m).batch * (m).rows, (m).cols, (m).ld, ri.weight_std, \
                                 NEXT_SEED, 0);                                                       \
    } while (0)
#define FILL_NORM(v, n)                                                       \
    do {                                                                      \
        if (st == KDT_OK && (v)) st = kdt_op_fill_vec((v), (n), 0, 0, NEXT_SEED, 0); \
    } while (0)
    if (st == KDT_OK)
        st = kdt_op_fill_embed(g->embed.w, c->vocab_size, c->hidden_size, g->embed.ld, ri.corr_block, ri.corr_sigma,
                               NEXT_SEED, 0);
    if (g->lm_head.w != g->embed.w) FILL(g->lm_head);
    FILL_NORM(g->final_norm, c->hidden_size);
    for (int32_t l = 0; st == KDT_OK && l < c->n_layers; l++) {
        kdt_gpu_layer *L = &g->layers[l];
        FILL_NORM(L->input_norm, c->hidden_size);
        FILL_NORM(L->post_norm, c->hidden_size);
        FILL_NORM(L->q_a_norm, c->q_lora_rank);
        FILL_NORM(L->kv_a_norm, c->kv_lora_rank);
        FILL(L->w_a);
        FILL(L->q_b);
        FILL(L->uk_t);
        FILL(L->uv);
        FILL(L->o_proj);
        FILL(L->dense_gu);
        FILL(L->dense_down);
        FILL(L->router);
        if (st == KDT_OK && L->router_bias)
            st = kdt_op_fill_vec(L->router_bias, c->n_routed_experts, 1, ri.router_bias_std, NEXT_SEED, 0);
        FILL(L->experts_gu);
        FILL(L->experts_down);
        FILL(L->shared_gu);
        FILL(L->shared_down);
    }
#undef FILL
#undef FILL_NORM
#undef NEXT_SEED
    if (st == KDT_OK) {
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) st = cuda_fail(e, "kdt_gpu_model_random");
    }
    if (st == KDT_OK) st = tile_weights(g, 1);
    if (st != KDT_OK) {
        kdt_gpu_model_free(g);
        return st;
    }
    *out = g;
    return KDT_OK;
}

/* ---- upload of a loaded checkpoint ---------------------------------------------------------- */

typedef enum up_kind {
    UP_PLAIN,   /* dest row d = a row d (rows beyond a's are zero) */
    UP_CONCAT,  /* d < p0: a row d, else b row d - p0 */
    UP_GATEUP,  /* 64-row block k: gate rows 32k.., then up rows 32k..; rows >= p0 (= I) zero */
    UP_UV,      /* d = h * d_v + j: kv_b row h (d_n + d_v) + d_n + j   (p0 = d_n, p1 = d_v) */
    UP_UKT,     /* per head h: dest [d_c][d_n] = kv_b rows h (d_n + d_v) + i, transposed */
} up_kind;

typedef struct up_job {
    up_kind kind;
    const kdt_weight *a, *b;
    uint16_t *dst;
    int64_t rows;       /* destination rows (UKT: heads) */
    int32_t cols, ld;
    int32_t p0, p1;
    int32_t file;       /* checkpoint file of the first source (order key) */
    int64_t offset;     /* its byte offset in that file */
    size_t bytes;
} up_job;

typedef struct up_ctx {
    const kdt_model *m;
    up_job *jobs;
    int64_t n_jobs, cap_jobs;
    cudaStream_t stream;
    uint16_t *stage[2];
    cudaEvent_t done[2];
    int32_t cur;
    size_t fill;            /* bytes in stage[cur] */
    uint16_t *fill_dst;     /* where stage[cur] goes */
    float *tmp;             /* one fp32 row */
    size_t total, sent;
    int show;
    int last_pct;
} up_ctx;

static kdt_status add_job(up_ctx *u, up_kind kind, const kdt_weight *a, const kdt_weight *b, uint16_t *dst,
                          int64_t rows, int32_t cols, int32_t ld, int32_t p0, int32_t p1) {
    if (u->n_jobs == u->cap_jobs) {
        int64_t cap = u->cap_jobs ? 2 * u->cap_jobs : 1024;
        up_job *j = realloc(u->jobs, (size_t)cap * sizeof *j);
        if (!j) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU upload: job list");
        u->jobs = j;
        u->cap_jobs = cap;
    }
    up_job *j = &u->jobs[u->n_jobs++];
    memset(j, 0, sizeof *j);
    j->kind = kind;
    j->a = a;
    j->b = b;
    j->dst = dst;
    j->rows = rows;
    j->cols = cols;
    j->ld = ld;
    j->p0 = p0;
    j->p1 = p1;
    j->file = u->m->st.n_files;
    j->offset = 0;
    for (int32_t f = 0; f < u->m->st.n_files; f++) {
        const char *base = (const char *)u->m->st.files[f].map, *p = (const char *)a->data;
        if (p >= base && p < base + u->m->st.files[f].map_size) {
            j->file = f;
            j->offset = p - base;
            break;
        }
    }
    /* UKT: rows = heads of [d_c = a->cols][ld] each */
    j->bytes = (size_t)rows * (size_t)(kind == UP_UKT ? a->cols : 1) * (size_t)ld * 2;
    u->total += j->bytes;
    return KDT_OK;
}

static int job_order(const void *x, const void *y) {
    const up_job *a = x, *b = y;
    if (a->file != b->file) return a->file < b->file ? -1 : 1;
    return (a->offset > b->offset) - (a->offset < b->offset);
}

static void progress(up_ctx *u) {
    if (!u->show || u->total == 0) return;
    const int pct = (int)(100.0 * (double)u->sent / (double)u->total);
    if (pct == u->last_pct) return;
    u->last_pct = pct;
    char bar[41];
    for (int i = 0; i < 40; i++) bar[i] = i < pct * 40 / 100 ? '#' : '.';
    bar[40] = 0;
    fprintf(stderr, "\rkdtree: uploading weights to the GPU [%s] %3d%% (%.1f / %.1f GB)", bar, pct,
            (double)u->sent / 1e9, (double)u->total / 1e9);
    if (u->sent >= u->total) fprintf(stderr, "\n");
}

/* Sends the filled staging buffer and switches to the other one. */
static kdt_status flush_stage(up_ctx *u) {
    if (u->fill == 0) return KDT_OK;
    cudaError_t e = cudaMemcpyAsync(u->fill_dst, u->stage[u->cur], u->fill, cudaMemcpyHostToDevice, u->stream);
    if (e == cudaSuccess) e = cudaEventRecord(u->done[u->cur], u->stream);
    if (e != cudaSuccess) return cuda_fail(e, "GPU upload");
    u->sent += u->fill;
    u->fill = 0;
    u->cur ^= 1;
    if ((e = cudaEventSynchronize(u->done[u->cur])) != cudaSuccess) return cuda_fail(e, "GPU upload");
    progress(u);
    return KDT_OK;
}

/* Appends one destination row (dst must continue the buffered run, else the buffer is sent). */
static kdt_status put_row(up_ctx *u, uint16_t *dst, int32_t ld, const kdt_weight *w, int64_t r, int32_t cols) {
    const size_t bytes = (size_t)ld * 2;
    if (u->fill && (u->fill + bytes > STAGE_BYTES || dst != u->fill_dst + u->fill / 2)) KDT_TRY(flush_stage(u));
    if (u->fill == 0) u->fill_dst = dst;
    uint16_t *out = u->stage[u->cur] + u->fill / 2;
    if (!w) {
        memset(out, 0, bytes);
    } else if (w->format == KDT_WF_PLAIN && w->dtype == KDT_W_BF16) {
        memcpy(out, (const uint16_t *)w->data + r * w->cols, (size_t)cols * 2);
        memset(out + cols, 0, (size_t)(ld - cols) * 2);
    } else {
        kdt_weight_row_f32(w, r, u->tmp);
        for (int32_t i = 0; i < cols; i++) out[i] = kdt_f32_to_bf16(u->tmp[i]);
        memset(out + cols, 0, (size_t)(ld - cols) * 2);
    }
    u->fill += bytes;
    return KDT_OK;
}

static kdt_status run_job(up_ctx *u, const up_job *j) {
    switch (j->kind) {
    case UP_PLAIN:
        for (int64_t d = 0; d < j->rows; d++)
            KDT_TRY(put_row(u, j->dst + d * j->ld, j->ld, d < j->a->rows ? j->a : NULL, d, j->cols));
        return KDT_OK;
    case UP_CONCAT:
        for (int64_t d = 0; d < j->rows; d++)
            KDT_TRY(put_row(u, j->dst + d * j->ld, j->ld, d < j->p0 ? j->a : j->b, d < j->p0 ? d : d - j->p0, j->cols));
        return KDT_OK;
    case UP_GATEUP:
        for (int64_t d = 0; d < j->rows; d++) {
            const int64_t blk = d / (2 * KDT_G_GU_BLOCK), o = d % (2 * KDT_G_GU_BLOCK);
            const int64_t i = blk * KDT_G_GU_BLOCK + o % KDT_G_GU_BLOCK;
            const kdt_weight *w = i < j->p0 ? (o < KDT_G_GU_BLOCK ? j->a : j->b) : NULL;
            KDT_TRY(put_row(u, j->dst + d * j->ld, j->ld, w, i, j->cols));
        }
        return KDT_OK;
    case UP_UV:
        for (int64_t d = 0; d < j->rows; d++) {
            const int64_t h = d / j->p1, jj = d % j->p1;
            KDT_TRY(put_row(u, j->dst + d * j->ld, j->ld, j->a, h * (j->p0 + j->p1) + j->p0 + jj, j->cols));
        }
        return KDT_OK;
    case UP_UKT: {
        /* per head: [d_c][ld(d_n)] built in the staging buffer, one row of kv_b at a time */
        const int32_t dn = j->p0, dv = j->p1, dc = (int32_t)j->a->cols;
        const size_t head_bytes = (size_t)dc * j->ld * 2;
        for (int64_t h = 0; h < j->rows; h++) {
            uint16_t *dst = j->dst + h * (int64_t)dc * j->ld;
            if (u->fill && (u->fill + head_bytes > STAGE_BYTES || dst != u->fill_dst + u->fill / 2))
                KDT_TRY(flush_stage(u));
            if (head_bytes > STAGE_BYTES) return kdt_fail(KDT_ERR_UNSUPPORTED, "GPU upload: kv_b head too large");
            if (u->fill == 0) u->fill_dst = dst;
            uint16_t *blk = u->stage[u->cur] + u->fill / 2;
            memset(blk, 0, head_bytes);
            for (int32_t i = 0; i < dn; i++) {
                kdt_weight_row_f32(j->a, h * (dn + dv) + i, u->tmp);
                for (int32_t e = 0; e < dc; e++) blk[(size_t)e * j->ld + i] = kdt_f32_to_bf16(u->tmp[e]);
            }
            u->fill += head_bytes;
        }
        return KDT_OK;
    }
    }
    return KDT_OK;
}

static kdt_status copy_vec(float *dst, const kdt_weight *w, int64_t n) {
    float *h = malloc((size_t)n * sizeof(float));
    if (!h) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU upload");
    for (int64_t i = 0; i < n; i++) h[i] = kdt_weight_at(w, i);
    const cudaError_t e = cudaMemcpy(dst, h, (size_t)n * sizeof(float), cudaMemcpyHostToDevice);
    free(h);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "GPU upload: vector");
}

static kdt_status build_jobs(up_ctx *u, kdt_gpu_model *g) {
    const kdt_model *m = u->m;
    const kdt_model_config *c = &m->cfg;
    const int32_t H = c->n_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim, ql = c->q_lora_rank;
    KDT_TRY(add_job(u, UP_PLAIN, &m->embed, NULL, g->embed.w, g->embed.rows, g->embed.cols, g->embed.ld, 0, 0));
    if (g->lm_head.w != g->embed.w)
        KDT_TRY(add_job(u, UP_PLAIN, &m->lm_head, NULL, g->lm_head.w, g->lm_head.rows, g->lm_head.cols, g->lm_head.ld, 0, 0));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kdt_layer_weights *S = &m->layers[l];
        kdt_gpu_layer *L = &g->layers[l];
        if (ql > 0) KDT_TRY(add_job(u, UP_CONCAT, &S->q_a, &S->kv_a, L->w_a.w, L->w_a.rows, L->w_a.cols, L->w_a.ld, ql, 0));
        else KDT_TRY(add_job(u, UP_PLAIN, &S->kv_a, NULL, L->w_a.w, L->w_a.rows, L->w_a.cols, L->w_a.ld, 0, 0));
        KDT_TRY(add_job(u, UP_PLAIN, ql > 0 ? &S->q_b : &S->q_proj, NULL, L->q_b.w, L->q_b.rows, L->q_b.cols, L->q_b.ld, 0, 0));
        KDT_TRY(add_job(u, UP_UKT, &S->kv_b, NULL, L->uk_t.w, H, L->uk_t.cols, L->uk_t.ld, dn, dv));
        KDT_TRY(add_job(u, UP_UV, &S->kv_b, NULL, L->uv.w, (int64_t)H * dv, L->uv.cols, L->uv.ld, dn, dv));
        KDT_TRY(add_job(u, UP_PLAIN, &S->o_proj, NULL, L->o_proj.w, L->o_proj.rows, L->o_proj.cols, L->o_proj.ld, 0, 0));
        if (!L->is_moe) {
            KDT_TRY(add_job(u, UP_GATEUP, &S->dense.gate, &S->dense.up, L->dense_gu.w, L->dense_gu.rows, L->dense_gu.cols,
                        L->dense_gu.ld, L->dense_inter, 0));
            KDT_TRY(add_job(u, UP_PLAIN, &S->dense.down, NULL, L->dense_down.w, L->dense_down.rows, L->dense_down.cols,
                        L->dense_down.ld, 0, 0));
            continue;
        }
        KDT_TRY(add_job(u, UP_PLAIN, &S->router, NULL, L->router.w, L->router.rows, L->router.cols, L->router.ld, 0, 0));
        for (int32_t e = 0; e < c->n_routed_experts; e++) {
            const kdt_expert_weights *X = &S->experts[e];
            KDT_TRY(add_job(u, UP_GATEUP, &X->gate, &X->up, L->experts_gu.w + e * L->experts_gu.batch_stride,
                        L->experts_gu.rows, L->experts_gu.cols, L->experts_gu.ld, c->moe_intermediate_size, 0));
            KDT_TRY(add_job(u, UP_PLAIN, &X->down, NULL, L->experts_down.w + e * L->experts_down.batch_stride,
                        L->experts_down.rows, L->experts_down.cols, L->experts_down.ld, 0, 0));
        }
        if (g->has_shared) {
            KDT_TRY(add_job(u, UP_GATEUP, &S->shared.gate, &S->shared.up, L->shared_gu.w, L->shared_gu.rows,
                        L->shared_gu.cols, L->shared_gu.ld, c->n_shared_experts * c->moe_intermediate_size, 0));
            KDT_TRY(add_job(u, UP_PLAIN, &S->shared.down, NULL, L->shared_down.w, L->shared_down.rows,
                        L->shared_down.cols, L->shared_down.ld, 0, 0));
        }
    }
    return KDT_OK;
}

static kdt_status upload_vectors(const kdt_model *m, kdt_gpu_model *g) {
    const kdt_model_config *c = &m->cfg;
    KDT_TRY(copy_vec(g->final_norm, &m->final_norm, c->hidden_size));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kdt_layer_weights *S = &m->layers[l];
        kdt_gpu_layer *L = &g->layers[l];
        KDT_TRY(copy_vec(L->input_norm, &S->input_norm, c->hidden_size));
        KDT_TRY(copy_vec(L->post_norm, &S->post_norm, c->hidden_size));
        if (c->q_lora_rank > 0) KDT_TRY(copy_vec(L->q_a_norm, &S->q_a_norm, c->q_lora_rank));
        KDT_TRY(copy_vec(L->kv_a_norm, &S->kv_a_norm, c->kv_lora_rank));
        if (L->is_moe) KDT_TRY(copy_vec(L->router_bias, &S->router_bias, c->n_routed_experts));
    }
    return KDT_OK;
}

static int show_progress(int progress) {
    const char *ci = getenv("CI");
    return progress && isatty(2) && !(ci && strcmp(ci, "true") == 0);
}

kdt_status kdt_model_to_gpu(const kdt_model *m, const kdt_gpu_options *opt, kdt_gpu_model **out) {
    KDT_CHECK_ARG(out, "kdt_model_to_gpu: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(m, "kdt_model_to_gpu: model is NULL");
    kdt_gpu_options o = {0, 0, 0};
    if (opt) o = *opt;
    kdt_gpu_model *g = calloc(1, sizeof *g);
    if (!g) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_model_to_gpu");
    g->cfg = m->cfg;
    up_ctx u;
    memset(&u, 0, sizeof u);
    u.m = m;
    u.show = show_progress(o.progress);
    u.last_pct = -1;
    kdt_status st = kdt_gpu_model_alloc(g, &o, m->rope_inv_freq, m->lm_head.data == m->embed.data);
    cudaError_t e = cudaSuccess;
    if (st == KDT_OK) st = upload_vectors(m, g);
    if (st == KDT_OK) st = build_jobs(&u, g);
    if (st == KDT_OK) {
        int64_t max_cols = 1;
        for (int64_t i = 0; i < u.n_jobs; i++) {
            if (u.jobs[i].a->cols > max_cols) max_cols = u.jobs[i].a->cols;
            if (u.jobs[i].cols > max_cols) max_cols = u.jobs[i].cols;
        }
        u.tmp = malloc((size_t)max_cols * sizeof(float));
        if (!u.tmp) st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_model_to_gpu");
    }
    if (st == KDT_OK &&
        ((e = cudaStreamCreateWithFlags(&u.stream, cudaStreamNonBlocking)) != cudaSuccess ||
         (e = cudaHostAlloc((void **)&u.stage[0], STAGE_BYTES, cudaHostAllocDefault)) != cudaSuccess ||
         (e = cudaHostAlloc((void **)&u.stage[1], STAGE_BYTES, cudaHostAllocDefault)) != cudaSuccess ||
         (e = cudaEventCreateWithFlags(&u.done[0], cudaEventDisableTiming)) != cudaSuccess ||
         (e = cudaEventCreateWithFlags(&u.done[1], cudaEventDisableTiming)) != cudaSuccess))
        st = cuda_fail(e, "kdt_model_to_gpu: staging");
    if (st == KDT_OK) {
        /* events start "complete" so the first switch to a buffer does not wait */
        cudaEventRecord(u.done[0], u.stream);
        cudaEventRecord(u.done[1], u.stream);
        qsort(u.jobs, (size_t)u.n_jobs, sizeof *u.jobs, job_order);
        /* Each job's destination lies in one allocation; flushing at every job end keeps one copy
         * from spanning two cudaMalloc blocks that happen to be adjacent in the address space
         * (cudaMemcpy rejects that with "invalid argument"). */
        for (int64_t i = 0; i < u.n_jobs && st == KDT_OK; i++) {
            st = run_job(&u, &u.jobs[i]);
            if (st == KDT_OK) st = flush_stage(&u);
        }
        if (st == KDT_OK) st = flush_stage(&u);
        if (st == KDT_OK && (e = cudaDeviceSynchronize()) != cudaSuccess) st = cuda_fail(e, "kdt_model_to_gpu");
        if (u.show && u.sent < u.total) fprintf(stderr, "\n");
        if (st == KDT_OK) st = tile_weights(g, 0);
    }
    if (u.stream) cudaStreamSynchronize(u.stream);
    if (u.stage[0]) cudaFreeHost(u.stage[0]);
    if (u.stage[1]) cudaFreeHost(u.stage[1]);
    if (u.done[0]) cudaEventDestroy(u.done[0]);
    if (u.done[1]) cudaEventDestroy(u.done[1]);
    if (u.stream) cudaStreamDestroy(u.stream);
    free(u.tmp);
    free(u.jobs);
    if (st != KDT_OK) {
        kdt_gpu_model_free(g);
        return st;
    }
    *out = g;
    return KDT_OK;
}
