/* dflash_gpu.c - the DFlash drafter on the GPU (see dflash_gpu.h): weight upload, the per-slot
 * context K/V, and the launch sequences of the context append and the draft block.
 *
 * Device layout: every 2-D weight is bf16 [rows][ld] (ld = cols rounded up to 64, zero padding),
 * the layout the target's GEMM (kdt_gemm_launch) reads. Per layer the k, v and q projections are
 * stacked as one [2 KV*hd + H*hd][D] matrix (one GEMM in the draft); the layers' stacks sit at a
 * fixed stride in one allocation, so the append computes every layer's k/v as one batched GEMM
 * over the first 2 KV*hd rows of each stack. gate and up are stacked [2 I][D].
 *
 * Draft of S streams (rows r = s * T + t): embed -> per layer RMSNorm, kvq GEMM, q/k norm + RoPE,
 * attention, o_proj GEMM + residual + RMSNorm (kdt_op_post_o), gate/up GEMM, SwiGLU, down GEMM +
 * residual -> final RMSNorm of rows t >= 1 -> target lm_head GEMM straight into the logits (or
 * through split-K partials when the lm_head's plan has several splits). Row counts reach the
 * GEMMs and row kernels through device ints (written by the embedding kernel); the launch bounds
 * are S * T and S * L.
 */
#include "engine/dflash_gpu.h"

#include "dflash_gpu_kernels.h"
#include "fp.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SLOTS 64
#define MAX_APPEND_ROWS (1 << 16)

typedef struct df_layer {
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* views into the norm blocks */
    kdt_gmat kvq;                   /* [2 kvd + qd][D]: k rows, v rows, q rows */
    kdt_gmat o;                     /* [D][qd] */
    kdt_gmat gu;                    /* [2 I][D]: gate rows, then up rows */
    kdt_gmat down;                  /* [D][I] */
} df_layer;

struct kdt_dflash_gpu {
    kdt_dflash_config cfg;
    const kdt_gpu_model *target;
    kdt_dflash_gpu_options opt;
    cudaStream_t stream;
    int32_t D, H, KV, hd, T, L, I, V, n_layers, n_taps, kvd, qd;
    int32_t stages;
    float eps, scale;
    kdt_gmat fc;                    /* [D][n_taps * D] */
    uint16_t *kvq_all;              /* the layers' kvq stacks */
    int64_t kvq_stride;             /* elements between two layers' stacks */
    float *hidden_norm, *norm;      /* [D] */
    float *k_norm_all;              /* [n_layers][hd] */
    df_layer *layers;
    float *rope_cs;                 /* [rope_rows][hd / 2] (cos, sin) */
    int32_t rope_rows;
    float *ck, *cv;                 /* [n_layers][max_streams][max_len][kvd] */
    int64_t ctx_layer_floats;
    /* scratch */
    float *x, *h, *q, *kb, *vb, *att, *act;  /* draft rows [max_draft_streams * T][...] */
    float *xn_head;                 /* [max_draft_streams * L][D] */
    float *c;                       /* append rows [max_append_rows][D] */
    float *part;                    /* split-K partials */
    size_t part_floats;
    int32_t lm_splits, lm_chunk;
    int32_t *counts;                /* [2] block rows, lm_head rows of the current draft */
    int32_t *rowmap;                /* [max_draft_streams * L] lm_head row -> block row */
    int32_t *acc_n, *acc_slot, *acc_pos, *acc_row; /* accepted-path item list */
    int32_t attn_pairs, attn_chunks, attn_warps;
    void **allocs;
    int32_t n_allocs, cap_allocs;
    size_t total_bytes;
};

static kdt_status cuda_fail(cudaError_t e, const char *what) {
    return kdt_fail(KDT_ERR_CUDA, "GPU drafter: %s: %s", what, cudaGetErrorString(e));
}

static kdt_status dalloc(kdt_dflash_gpu *g, void **p, size_t bytes, const char *what) {
    *p = NULL;
    if (bytes == 0) return KDT_OK;
    if (g->n_allocs == g->cap_allocs) {
        const int32_t cap = g->cap_allocs ? 2 * g->cap_allocs : 64;
        void **a = realloc(g->allocs, (size_t)cap * sizeof *a);
        if (!a) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: allocation list");
        g->allocs = a;
        g->cap_allocs = cap;
    }
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* an OOM is not sticky; keep it from the next launch check */
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: %s: %zu bytes: %s (%zu bytes allocated so far)", what,
                        bytes, cudaGetErrorString(e), g->total_bytes);
    }
    g->allocs[g->n_allocs++] = *p;
    g->total_bytes += bytes;
    return KDT_OK;
}

static kdt_status upload(void *dst, const void *src, size_t bytes, const char *what) {
    const cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, what);
}

static const kdt_weight *W(const kdt_dflash *d, int32_t layer, kdt_dflash_wid id) {
    return (const kdt_weight *)kdt_dflash_weight(d, layer, id);
}

/* Rows of w as bf16 into dst [w->rows][ld] (zero padding); plain BF16 rows are copied as they are,
 * anything else through the CPU's own dequantization, rounded once. tmp: [w->cols] floats. */
static void put_rows(uint16_t *dst, int32_t ld, const kdt_weight *w, float *tmp) {
    for (int64_t r = 0; r < w->rows; r++) {
        uint16_t *out = dst + r * ld;
        if (w->format == KDT_WF_PLAIN && w->dtype == KDT_W_BF16) {
            memcpy(out, (const uint16_t *)w->data + r * w->cols, (size_t)w->cols * 2);
        } else {
            kdt_weight_row_f32(w, r, tmp);
            for (int64_t i = 0; i < w->cols; i++) out[i] = kdt_f32_to_bf16(tmp[i]);
        }
        memset(out + w->cols, 0, (size_t)(ld - w->cols) * 2);
    }
}

static void set_mat(kdt_gmat *m, uint16_t *w, int64_t rows, int64_t cols) {
    memset(m, 0, sizeof *m);
    m->w = w;
    m->rows = (int32_t)rows;
    m->cols = (int32_t)cols;
    m->ld = (int32_t)kdt_g_round_up(cols, KDT_G_BK);
    m->batch = 1;
    m->batch_stride = rows * m->ld;
}

/* Allocates m [sum of the parts' rows][cols] and uploads the parts stacked in order. */
static kdt_status upload_stack(kdt_dflash_gpu *g, kdt_gmat *m, const kdt_weight *const *parts, int32_t n_parts,
                               uint16_t *at, const char *what) {
    int64_t rows = 0;
    for (int32_t i = 0; i < n_parts; i++) rows += parts[i]->rows;
    const int64_t cols = parts[0]->cols;
    uint16_t *w = at;
    if (!w) KDT_TRY(dalloc(g, (void **)&w, (size_t)rows * (size_t)kdt_g_round_up(cols, KDT_G_BK) * 2, what));
    set_mat(m, w, rows, cols);
    uint16_t *host = malloc((size_t)rows * (size_t)m->ld * 2);
    float *tmp = malloc((size_t)cols * sizeof(float));
    kdt_status st = KDT_OK;
    if (!host || !tmp) st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: %s: staging", what);
    int64_t r0 = 0;
    for (int32_t i = 0; i < n_parts && st == KDT_OK; i++) {
        put_rows(host + r0 * m->ld, m->ld, parts[i], tmp);
        r0 += parts[i]->rows;
    }
    if (st == KDT_OK) st = upload(w, host, (size_t)rows * (size_t)m->ld * 2, what);
    free(host);
    free(tmp);
    return st;
}

/* n consecutive fp32 vectors of length len (one per weight in ws) -> dst [n][len]. */
static kdt_status upload_vecs(float *dst, const kdt_weight *const *ws, int32_t n, int32_t len, const char *what) {
    float *h = malloc((size_t)n * (size_t)len * sizeof(float));
    if (!h) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: %s", what);
    for (int32_t i = 0; i < n; i++)
        for (int32_t j = 0; j < len; j++) h[(size_t)i * len + j] = kdt_weight_at(ws[i], j);
    const kdt_status st = upload(dst, h, (size_t)n * (size_t)len * sizeof(float), what);
    free(h);
    return st;
}

/* splits * rows * n * batch: the partials a GEMM of that shape needs. */
static size_t part_need(int32_t n, int32_t ld, int32_t batch, int32_t rows) {
    int32_t splits, chunk;
    kdt_gemm_plan(n, ld, batch, &splits, &chunk);
    return (size_t)splits * (size_t)rows * (size_t)n * (size_t)batch;
}

static kdt_status check_target(const kdt_dflash *d, const kdt_gpu_model *t) {
    const kdt_dflash_config *c = kdt_dflash_get_config(d);
    const kdt_model_config *tc = &t->cfg;
    if (tc->hidden_size != c->hidden_size)
        return kdt_fail(KDT_ERR_INVALID_ARG, "kdt_dflash_to_gpu: hidden_size: drafter %d, GPU target %d",
                        c->hidden_size, tc->hidden_size);
    if (t->embed.cols != c->hidden_size || t->lm_head.cols != c->hidden_size)
        return kdt_fail(KDT_ERR_INVALID_ARG, "kdt_dflash_to_gpu: hidden_size: drafter %d, GPU target embed / lm_head "
                        "width %d / %d", c->hidden_size, t->embed.cols, t->lm_head.cols);
    if (t->embed.rows != tc->vocab_size || t->lm_head.rows != tc->vocab_size)
        return kdt_fail(KDT_ERR_INVALID_ARG, "kdt_dflash_to_gpu: vocab_size: GPU target %d, embed / lm_head rows "
                        "%d / %d", tc->vocab_size, t->embed.rows, t->lm_head.rows);
    if (c->mask_token_id >= tc->vocab_size)
        return kdt_fail(KDT_ERR_INVALID_ARG, "kdt_dflash_to_gpu: mask_token_id %d is outside the GPU target's "
                        "vocabulary (vocab_size %d)", c->mask_token_id, tc->vocab_size);
    for (int32_t i = 0; i < c->n_taps; i++)
        if (c->tap_layers[i] >= tc->n_layers)
            return kdt_fail(KDT_ERR_INVALID_ARG, "kdt_dflash_to_gpu: tap_layers[%d] = %d, the GPU target has %d layers",
                            i, c->tap_layers[i], tc->n_layers);
    return KDT_OK;
}

static kdt_status build(kdt_dflash_gpu *g, const kdt_dflash *d) {
    const kdt_dflash_config *c = &g->cfg;
    const int32_t D = g->D, hd = g->hd, nl = g->n_layers, kvd = g->kvd, qd = g->qd, I = g->I, T = g->T, L = g->L;
    const int32_t Rmax = g->opt.max_draft_streams * T, Hmax = g->opt.max_draft_streams * L,
                  Amax = g->opt.max_append_rows;
    const size_t f = sizeof(float);

    /* weights */
    const kdt_weight *fcw = W(d, 0, KDT_DFW_FC);
    KDT_TRY(upload_stack(g, &g->fc, &fcw, 1, NULL, "fc"));
    const int32_t ld_d = (int32_t)kdt_g_round_up(D, KDT_G_BK);
    g->kvq_stride = (int64_t)(2 * kvd + qd) * ld_d;
    KDT_TRY(dalloc(g, (void **)&g->kvq_all, (size_t)nl * (size_t)g->kvq_stride * 2, "k/v/q projections"));
    float *norms = NULL;
    KDT_TRY(dalloc(g, (void **)&norms, ((size_t)2 * D + (size_t)nl * (2 * D + 2 * hd)) * f, "norms"));
    g->hidden_norm = norms;
    g->norm = norms + D;
    float *in_norm = g->norm + D, *post_norm = in_norm + (size_t)nl * D, *q_norm = post_norm + (size_t)nl * D;
    g->k_norm_all = q_norm + (size_t)nl * hd;
    const kdt_weight *v1[2] = {W(d, 0, KDT_DFW_HIDDEN_NORM), W(d, 0, KDT_DFW_NORM)};
    KDT_TRY(upload_vecs(g->hidden_norm, v1, 1, D, "hidden_norm"));
    KDT_TRY(upload_vecs(g->norm, v1 + 1, 1, D, "norm"));
    g->layers = calloc((size_t)nl, sizeof *g->layers);
    if (!g->layers) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: layer table");
    for (int32_t l = 0; l < nl; l++) {
        df_layer *Ly = &g->layers[l];
        const kdt_weight *kvq[3] = {W(d, l, KDT_DFW_K), W(d, l, KDT_DFW_V), W(d, l, KDT_DFW_Q)};
        KDT_TRY(upload_stack(g, &Ly->kvq, kvq, 3, g->kvq_all + (int64_t)l * g->kvq_stride, "k/v/q projections"));
        const kdt_weight *o = W(d, l, KDT_DFW_O), *down = W(d, l, KDT_DFW_DOWN);
        const kdt_weight *gu[2] = {W(d, l, KDT_DFW_GATE), W(d, l, KDT_DFW_UP)};
        KDT_TRY(upload_stack(g, &Ly->o, &o, 1, NULL, "o_proj"));
        KDT_TRY(upload_stack(g, &Ly->gu, gu, 2, NULL, "gate/up"));
        KDT_TRY(upload_stack(g, &Ly->down, &down, 1, NULL, "down"));
        const kdt_weight *in = W(d, l, KDT_DFW_IN_NORM), *post = W(d, l, KDT_DFW_POST_NORM),
                         *qn = W(d, l, KDT_DFW_Q_NORM), *kn = W(d, l, KDT_DFW_K_NORM);
        KDT_TRY(upload_vecs(in_norm + (size_t)l * D, &in, 1, D, "input_layernorm"));
        KDT_TRY(upload_vecs(post_norm + (size_t)l * D, &post, 1, D, "post_attention_layernorm"));
        KDT_TRY(upload_vecs(q_norm + (size_t)l * hd, &qn, 1, hd, "q_norm"));
        KDT_TRY(upload_vecs(g->k_norm_all + (size_t)l * hd, &kn, 1, hd, "k_norm"));
        Ly->in_norm = in_norm + (size_t)l * D;
        Ly->post_norm = post_norm + (size_t)l * D;
        Ly->q_norm = q_norm + (size_t)l * hd;
        Ly->k_norm = g->k_norm_all + (size_t)l * hd;
    }

    /* RoPE: positions 0..max_len + T - 1 (context and block), cos/sin exactly as dflash.c */
    g->rope_rows = g->opt.max_len + T;
    const int32_t half = hd / 2;
    float *inv = malloc((size_t)half * f), *cs = malloc((size_t)g->rope_rows * (size_t)hd * f);
    kdt_status st = KDT_OK;
    if (!inv || !cs) st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: RoPE table");
    if (st == KDT_OK) {
        kdt_dflash_rope_inv_freq(c, inv);
        const float amp = c->rope_attention_factor;
        for (int64_t p = 0; p < g->rope_rows; p++)
            for (int32_t i = 0; i < half; i++) {
                const float ang = (float)p * inv[i];
                cs[(size_t)p * hd + 2 * i] = (float)cos((double)ang) * amp;
                cs[(size_t)p * hd + 2 * i + 1] = (float)sin((double)ang) * amp;
            }
        st = dalloc(g, (void **)&g->rope_cs, (size_t)g->rope_rows * hd * f, "RoPE table");
    }
    if (st == KDT_OK) st = upload(g->rope_cs, cs, (size_t)g->rope_rows * hd * f, "RoPE table");
    free(inv);
    free(cs);
    KDT_TRY(st);

    /* context K/V */
    g->ctx_layer_floats = (int64_t)g->opt.max_streams * g->opt.max_len * kvd;
    KDT_TRY(dalloc(g, (void **)&g->ck, (size_t)nl * (size_t)g->ctx_layer_floats * f, "context K"));
    KDT_TRY(dalloc(g, (void **)&g->cv, (size_t)nl * (size_t)g->ctx_layer_floats * f, "context V"));

    /* scratch */
    KDT_TRY(dalloc(g, (void **)&g->x, (size_t)Rmax * D * f, "activations"));
    KDT_TRY(dalloc(g, (void **)&g->h, (size_t)Rmax * D * f, "activations"));
    KDT_TRY(dalloc(g, (void **)&g->q, (size_t)Rmax * qd * f, "q"));
    KDT_TRY(dalloc(g, (void **)&g->kb, (size_t)Rmax * kvd * f, "block K"));
    KDT_TRY(dalloc(g, (void **)&g->vb, (size_t)Rmax * kvd * f, "block V"));
    KDT_TRY(dalloc(g, (void **)&g->att, (size_t)Rmax * qd * f, "attention output"));
    KDT_TRY(dalloc(g, (void **)&g->act, (size_t)Rmax * I * f, "MLP activations"));
    KDT_TRY(dalloc(g, (void **)&g->xn_head, (size_t)Hmax * D * f, "lm_head input"));
    KDT_TRY(dalloc(g, (void **)&g->c, (size_t)Amax * D * f, "context rows"));
    const kdt_gmat *lm = &g->target->lm_head;
    kdt_gemm_plan(lm->rows, lm->ld, 1, &g->lm_splits, &g->lm_chunk);
    size_t part = 0, need;
#define NEED(x)                    \
    do {                           \
        need = (x);                \
        if (need > part) part = need; \
    } while (0)
    NEED(part_need(2 * kvd + qd, g->layers[0].kvq.ld, 1, Rmax));
    NEED(part_need(D, g->layers[0].o.ld, 1, Rmax));
    NEED(part_need(2 * I, g->layers[0].gu.ld, 1, Rmax));
    NEED(part_need(D, g->layers[0].down.ld, 1, Rmax));
    if (g->lm_splits > 1) NEED(part_need(lm->rows, lm->ld, 1, Hmax));
    NEED(part_need(D, g->fc.ld, 1, Amax));
    NEED(part_need(2 * kvd, g->layers[0].kvq.ld, nl, Amax));
#undef NEED
    g->part_floats = part;
    KDT_TRY(dalloc(g, (void **)&g->part, part * f, "split-K partials"));
    KDT_TRY(dalloc(g, (void **)&g->counts, 2 * sizeof(int32_t), "counts"));
    KDT_TRY(dalloc(g, (void **)&g->rowmap, (size_t)Hmax * sizeof(int32_t), "row map"));
    KDT_TRY(dalloc(g, (void **)&g->acc_n, sizeof(int32_t), "accepted items"));
    KDT_TRY(dalloc(g, (void **)&g->acc_slot, (size_t)Amax * sizeof(int32_t), "accepted items"));
    KDT_TRY(dalloc(g, (void **)&g->acc_pos, (size_t)Amax * sizeof(int32_t), "accepted items"));
    KDT_TRY(dalloc(g, (void **)&g->acc_row, (size_t)Amax * sizeof(int32_t), "accepted items"));
    int32_t *rm = malloc((size_t)Hmax * sizeof(int32_t));
    if (!rm) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU drafter: row map");
    for (int32_t m = 0; m < Hmax; m++) rm[m] = (m / L) * T + 1 + m % L;
    st = upload(g->rowmap, rm, (size_t)Hmax * sizeof(int32_t), "row map");
    free(rm);
    KDT_TRY(st);
    const int32_t zero[2] = {0, 0};
    KDT_TRY(upload(g->counts, zero, sizeof zero, "counts"));
    KDT_TRY(upload(g->acc_n, zero, sizeof(int32_t), "accepted items"));

    /* attention: (block row, query head) pairs per CTA, fewer when shared memory is short */
    const int32_t pairs = T * (g->H / g->KV);
    int32_t pc = pairs < 32 ? pairs : 32;
    size_t smem = 0;
    for (;;) {
        g->attn_warps = pc < 16 ? pc : 16; /* one (row, head) pair per warp for the tiny drafter */
        smem = kdt_df_attn_smem(pc, hd, g->attn_warps);
        if (smem <= g->target->smem_optin || pc == 1) break;
        pc = (pc + 1) / 2;
    }
    if (smem > g->target->smem_optin)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "GPU drafter: head_dim %d needs %zu bytes of shared memory in the "
                        "attention (device: %zu)", hd, smem, g->target->smem_optin);
    g->attn_pairs = pc;
    g->attn_chunks = (pairs + pc - 1) / pc;
    KDT_TRY(kdt_df_attn_init(smem));
    g->stages = kdt_gpu_gemm_stages(g->target);
    KDT_TRY(kdt_gemm_init(g->stages));
    const cudaError_t e = cudaDeviceSynchronize(); /* pageable uploads done before any stream runs */
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "upload");
}

kdt_status kdt_dflash_to_gpu(const kdt_dflash *d, const kdt_gpu_model *target, const kdt_dflash_gpu_options *opt,
                             kdt_dflash_gpu **out) {
    KDT_CHECK_ARG(out != NULL, "kdt_dflash_to_gpu: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(d && target && opt, "kdt_dflash_to_gpu: drafter, target or options is NULL");
    const kdt_dflash_gpu_options o = *opt;
    KDT_CHECK_ARG(o.max_streams >= 1 && o.max_streams <= MAX_SLOTS, "kdt_dflash_to_gpu: max_streams = %d (1..%d)",
                  o.max_streams, MAX_SLOTS);
    KDT_CHECK_ARG(o.max_len >= 1 && o.max_len <= (1 << 24), "kdt_dflash_to_gpu: max_len = %d (1..%d)", o.max_len,
                  1 << 24);
    KDT_CHECK_ARG(o.max_draft_streams >= 1 && o.max_draft_streams <= o.max_streams,
                  "kdt_dflash_to_gpu: max_draft_streams = %d (1..max_streams %d)", o.max_draft_streams,
                  o.max_streams);
    KDT_CHECK_ARG(o.max_append_rows >= 1 && o.max_append_rows <= MAX_APPEND_ROWS,
                  "kdt_dflash_to_gpu: max_append_rows = %d (1..%d)", o.max_append_rows, MAX_APPEND_ROWS);
    KDT_TRY(check_target(d, target));
    const kdt_dflash_config *c = kdt_dflash_get_config(d);
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int id = KDT_DFW_IN_NORM; id <= KDT_DFW_DOWN; id++)
            if (!kdt_dflash_weight(d, l, (kdt_dflash_wid)id))
                return kdt_fail(KDT_ERR_INTERNAL, "kdt_dflash_to_gpu: layer %d weight %d missing", l, id);
    cudaError_t e = cudaSetDevice(target->device);
    if (e != cudaSuccess) return cuda_fail(e, "kdt_dflash_to_gpu: device");
    kdt_dflash_gpu *g = calloc(1, sizeof *g);
    if (!g) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_dflash_to_gpu");
    g->cfg = *c;
    g->target = target;
    g->opt = o;
    g->stream = (cudaStream_t)o.stream;
    g->D = c->hidden_size;
    g->H = c->n_heads;
    g->KV = c->n_kv_heads;
    g->hd = c->head_dim;
    g->T = c->block_size;
    g->L = c->block_size - 1;
    g->I = c->intermediate_size;
    g->V = target->cfg.vocab_size;
    g->n_layers = c->n_layers;
    g->n_taps = c->n_taps;
    g->kvd = g->KV * g->hd;
    g->qd = g->H * g->hd;
    g->eps = c->rms_eps;
    g->scale = 1.0f / sqrtf((float)g->hd); /* as dflash.c */
    const kdt_status st = build(g, d);
    if (st != KDT_OK) {
        kdt_dflash_gpu_free(g);
        return st;
    }
    *out = g;
    return KDT_OK;
}

void kdt_dflash_gpu_free(kdt_dflash_gpu *g) {
    if (!g) return;
    cudaStreamSynchronize(g->stream);
    for (int32_t i = 0; i < g->n_allocs; i++) cudaFree(g->allocs[i]);
    free(g->allocs);
    free(g->layers);
    free(g);
}

/* ---- launch sequences ------------------------------------------------------------------------ */

/* Y = X W^T for rows < *m_dev (<= m_max): into y directly when the plan has one split (y_out !=
 * NULL), else into the partials as [splits][batch][m_max][n]. */
typedef struct df_gemm {
    const float *x; int64_t ldx; int32_t kx; const int32_t *x_rows;
    const uint16_t *w; int32_t ldw, n, batch; int64_t w_batch;
    const int32_t *m_dev; int32_t m_max;
    float *y_out;               /* optional direct destination [m][n] (one split only) */
    int32_t splits;             /* out */
    int64_t split_stride;       /* out */
} df_gemm;

static kdt_status run_gemm(kdt_dflash_gpu *g, df_gemm *q) {
    int32_t k_chunk;
    kdt_gemm_plan(q->n, q->ldw, q->batch, &q->splits, &k_chunk);
    kdt_gemm_args a;
    memset(&a, 0, sizeof a);
    a.x = q->x;
    a.ldx = q->ldx;
    a.x_batch = 0;
    a.kx = q->kx;
    a.x_rows = q->x_rows;
    a.w = q->w;
    a.ldw = q->ldw;
    a.w_batch = q->w_batch;
    a.n = q->n;
    a.ldy = q->n;
    a.y_batch = (int64_t)q->m_max * q->n;
    q->split_stride = a.y_batch * q->batch;
    if (q->y_out && q->splits == 1) {
        a.y = q->y_out;
    } else {
        if ((size_t)q->splits * (size_t)q->split_stride > g->part_floats)
            return kdt_fail(KDT_ERR_INTERNAL, "GPU drafter: split-K partials overflow");
        a.y = g->part;
    }
    a.y_split = q->split_stride;
    a.m_dev = q->m_dev;
    a.m_max = q->m_max;
    a.batch = q->batch;
    a.splits = q->splits;
    a.k_chunk = k_chunk;
    return kdt_gemm_launch(&a, g->stages, g->stream);
}

static df_gemm mat_gemm(const float *x, int64_t ldx, int32_t kx, const kdt_gmat *w, const int32_t *m_dev,
                        int32_t m_max) {
    df_gemm q;
    memset(&q, 0, sizeof q);
    q.x = x;
    q.ldx = ldx;
    q.kx = kx;
    q.w = w->w;
    q.ldw = w->ld;
    q.n = w->rows;
    q.batch = 1;
    q.m_dev = m_dev;
    q.m_max = m_max;
    return q;
}

static kdt_status append_items(kdt_dflash_gpu *g, const int32_t *n_dev, int32_t max_items, const int32_t *slot,
                               const int32_t *pos, const int32_t *row, const float *feat, int64_t stride) {
    const int32_t D = g->D, kvd = g->kvd;
    /* c = hidden_norm(fc(feat row)) */
    df_gemm q = mat_gemm(feat, stride, g->n_taps * D, &g->fc, n_dev, max_items);
    q.x_rows = row;
    KDT_TRY(run_gemm(g, &q));
    KDT_TRY(kdt_df_sum_norm(g->part, q.splits, q.split_stride, n_dev, max_items, g->hidden_norm, g->eps, D, g->c,
                            g->stream));
    /* every layer's [k | v] of c: one GEMM batched over the layers' kvq stacks (first 2 kvd rows) */
    df_gemm kv = mat_gemm(g->c, D, D, &g->layers[0].kvq, n_dev, max_items);
    kv.n = 2 * kvd;
    kv.batch = g->n_layers;
    kv.w = g->kvq_all;
    kv.w_batch = g->kvq_stride;
    KDT_TRY(run_gemm(g, &kv));
    kdt_df_ctx_args a;
    memset(&a, 0, sizeof a);
    a.part = g->part;
    a.splits = kv.splits;
    a.split_stride = kv.split_stride;
    a.layer_stride = (int64_t)max_items * 2 * kvd;
    a.n_dev = n_dev;
    a.max_n = max_items;
    a.slot = slot;
    a.pos = pos;
    a.n_layers = g->n_layers;
    a.KV = g->KV;
    a.hd = g->hd;
    a.max_streams = g->opt.max_streams;
    a.max_len = g->opt.max_len;
    a.k_norm = g->k_norm_all;
    a.eps = g->eps;
    a.rope_cs = g->rope_cs;
    a.rope_rows = g->rope_rows;
    a.ck = g->ck;
    a.cv = g->cv;
    return kdt_df_ctx_post(&a, g->stream);
}

kdt_status kdt_dflash_gpu_append(kdt_dflash_gpu *g, const int32_t *d_n_items, int32_t max_items,
                                 const int32_t *d_slot, const int32_t *d_pos, const int32_t *d_row,
                                 const float *d_feat, int64_t feat_row_stride) {
    KDT_CHECK_ARG(g != NULL, "kdt_dflash_gpu_append: drafter is NULL");
    KDT_CHECK_ARG(max_items >= 0 && max_items <= g->opt.max_append_rows,
                  "kdt_dflash_gpu_append: max_items = %d (0..max_append_rows %d)", max_items,
                  g->opt.max_append_rows);
    if (max_items == 0) return KDT_OK;
    KDT_CHECK_ARG(d_n_items && d_slot && d_pos && d_row && d_feat,
                  "kdt_dflash_gpu_append: NULL device pointer (n_items %p, slot %p, pos %p, row %p, feat %p)",
                  (const void *)d_n_items, (const void *)d_slot, (const void *)d_pos, (const void *)d_row,
                  (const void *)d_feat);
    KDT_CHECK_ARG(feat_row_stride >= (int64_t)g->n_taps * g->D,
                  "kdt_dflash_gpu_append: feat_row_stride = %lld, a feature row has n_taps * D = %d floats",
                  (long long)feat_row_stride, g->n_taps * g->D);
    return append_items(g, d_n_items, max_items, d_slot, d_pos, d_row, d_feat, feat_row_stride);
}

kdt_status kdt_dflash_gpu_append_accepted(kdt_dflash_gpu *g, int32_t n_streams, const int32_t *d_slot,
                                          const int32_t *d_prefix, const int32_t *d_tau,
                                          const int32_t *d_acc_nodes, int32_t tree_stride,
                                          const float *d_feat, int64_t feat_row_stride) {
    KDT_CHECK_ARG(g != NULL, "kdt_dflash_gpu_append_accepted: drafter is NULL");
    KDT_CHECK_ARG(n_streams >= 0 && (int64_t)n_streams * KDT_MAX_PATH <= g->opt.max_append_rows,
                  "kdt_dflash_gpu_append_accepted: n_streams = %d: n_streams * KDT_MAX_PATH (%d) must fit "
                  "max_append_rows %d", n_streams, KDT_MAX_PATH, g->opt.max_append_rows);
    if (n_streams == 0) return KDT_OK;
    KDT_CHECK_ARG(d_slot && d_prefix && d_tau && d_acc_nodes && d_feat,
                  "kdt_dflash_gpu_append_accepted: NULL device pointer (slot %p, prefix %p, tau %p, acc_nodes %p, "
                  "feat %p)", (const void *)d_slot, (const void *)d_prefix, (const void *)d_tau,
                  (const void *)d_acc_nodes, (const void *)d_feat);
    KDT_CHECK_ARG(tree_stride >= 1, "kdt_dflash_gpu_append_accepted: tree_stride = %d", tree_stride);
    KDT_CHECK_ARG(feat_row_stride >= (int64_t)g->n_taps * g->D,
                  "kdt_dflash_gpu_append_accepted: feat_row_stride = %lld, a feature row has n_taps * D = %d floats",
                  (long long)feat_row_stride, g->n_taps * g->D);
    KDT_TRY(kdt_df_accept_items(n_streams, d_slot, d_prefix, d_tau, d_acc_nodes, tree_stride, g->acc_n, g->acc_slot,
                                g->acc_pos, g->acc_row, g->stream));
    return append_items(g, g->acc_n, n_streams * KDT_MAX_PATH, g->acc_slot, g->acc_pos, g->acc_row, d_feat,
                        feat_row_stride);
}

kdt_status kdt_dflash_gpu_draft(kdt_dflash_gpu *g, int32_t n_streams, const int32_t *d_slot,
                                const int32_t *d_prefix, const int32_t *d_anchor, float *d_logits) {
    KDT_CHECK_ARG(g != NULL, "kdt_dflash_gpu_draft: drafter is NULL");
    KDT_CHECK_ARG(n_streams >= 1 && n_streams <= g->opt.max_draft_streams,
                  "kdt_dflash_gpu_draft: n_streams = %d (1..max_draft_streams %d)", n_streams,
                  g->opt.max_draft_streams);
    KDT_CHECK_ARG(d_slot && d_prefix && d_anchor && d_logits,
                  "kdt_dflash_gpu_draft: NULL device pointer (slot %p, prefix %p, anchor %p, logits %p)",
                  (const void *)d_slot, (const void *)d_prefix, (const void *)d_anchor, (const void *)d_logits);
    const int32_t D = g->D, T = g->T, R = n_streams * T, HR = n_streams * g->L, kvd = g->kvd, qd = g->qd;
    const int32_t *rows_dev = g->counts, *head_dev = g->counts + 1;
    cudaStream_t s = g->stream;

    kdt_df_embed_args ea = {d_anchor, n_streams, T, g->cfg.mask_token_id, g->V, D, g->target->embed.w,
                            g->target->embed.ld, g->x, g->counts};
    KDT_TRY(kdt_df_embed(&ea, s));
    for (int32_t l = 0; l < g->n_layers; l++) {
        const df_layer *Ly = &g->layers[l];
        KDT_TRY(kdt_op_rmsnorm(g->x, NULL, Ly->in_norm, g->eps, D, g->h, rows_dev, R, s));
        df_gemm q = mat_gemm(g->h, D, D, &Ly->kvq, rows_dev, R);
        KDT_TRY(run_gemm(g, &q));
        kdt_df_qkv_args qa = {g->part, q.splits, q.split_stride, 2 * kvd + qd, d_prefix, R, T, g->H, g->KV, g->hd,
                              g->opt.max_len, Ly->q_norm, Ly->k_norm, g->eps, g->rope_cs, g->rope_rows,
                              g->q, g->kb, g->vb};
        KDT_TRY(kdt_df_qkv_post(&qa, s));
        kdt_df_attn_args aa = {g->q, g->kb, g->vb, g->ck + (int64_t)l * g->ctx_layer_floats,
                               g->cv + (int64_t)l * g->ctx_layer_floats, d_slot, d_prefix, g->att, n_streams, T,
                               g->H, g->KV, g->hd, g->opt.max_streams, g->opt.max_len, g->attn_pairs,
                               g->attn_chunks, g->attn_warps, g->scale};
        KDT_TRY(kdt_df_attn(&aa, s));
        q = mat_gemm(g->att, qd, qd, &Ly->o, rows_dev, R);
        KDT_TRY(run_gemm(g, &q));
        KDT_TRY(kdt_op_post_o(g->x, g->part, q.splits, q.split_stride, Ly->post_norm, g->eps, D, g->h, rows_dev, R,
                              s));
        q = mat_gemm(g->h, D, D, &Ly->gu, rows_dev, R);
        KDT_TRY(run_gemm(g, &q));
        KDT_TRY(kdt_df_swiglu(g->part, q.splits, q.split_stride, R, g->I, g->act, s));
        q = mat_gemm(g->act, g->I, g->I, &Ly->down, rows_dev, R);
        KDT_TRY(run_gemm(g, &q));
        KDT_TRY(kdt_op_residual(g->x, g->part, q.splits, q.split_stride, D, rows_dev, R, s));
    }
    /* final norm of block rows 1..L, then the target's lm_head */
    KDT_TRY(kdt_op_rmsnorm(g->x, g->rowmap, g->norm, g->eps, D, g->xn_head, head_dev, HR, s));
    df_gemm q = mat_gemm(g->xn_head, D, D, &g->target->lm_head, head_dev, HR);
    q.y_out = d_logits;
    KDT_TRY(run_gemm(g, &q));
    if (q.splits > 1)
        KDT_TRY(kdt_op_sum_splits(g->part, q.splits, q.split_stride, g->V, 1, 0, g->V, d_logits, g->V, 0, head_dev,
                                  HR, s));
    return KDT_OK;
}
