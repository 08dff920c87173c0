/* forward.c - the CPU forward pass (the reference for the GPU one): prefill, decode and tree
 * verify all turn their input into "rows" (token, position, cache slot, visible keys) and run
 * the same per-row code, layer by layer over a chunk of rows: first every row's latent KV is
 * written to the cache, then every row attends, so a row can see rows of its own chunk.
 *
 * Per row and layer (D hidden, H heads, d_n/d_r/d_v head dims, d_c latent):
 *   xn = RMSNorm(x)                                   [D]
 *   q  = q_b(RMSNorm(q_a xn)) or q_proj xn            [H][d_n + d_r], RoPE on the d_r part
 *   [c_kv | k_pe] = kv_a xn; c_kv = RMSNorm(c_kv); RoPE(k_pe) -> cache row [d_c + d_r]
 *   per head: q_lat = W_UK[h]^T q_nope (d_c) ; score_t = scale * [q_lat | q_pe] . row_t
 *             o_lat = softmax-weighted sum of c_kv_t ; o_h = W_UV[h] o_lat (d_v)
 *   x += o_proj concat(o_h); x += MLP or MoE (RMSNorm(x))
 * A prefill chunk may take the plain form instead (kdt_model_options.prefill_attention): every
 * visible key's [k_nope | v] per head = kv_b c_kv once per chunk, then per head
 * score_t = scale * [q_nope | q_pe] . [k_nope_t | k_pe_t] and o_h = softmax-weighted sum of v_t.
 * Every reduction runs in one fixed order (see kdt_weight_matvec), keys in increasing slot
 * order, so a row's results never depend on the other rows (batch invariance). The matrix
 * products of a chunk's rows run together (kdt_weight_matmul: each weight row read once per block
 * of rows, every row's sum still its own, in that order); only the attention runs row by row. */
#include "model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One query row: which token, where it sits, which keys it sees, where its outputs go. */
typedef struct row_desc {
    int32_t stream;             /* cache stream */
    int32_t token;
    int32_t pos;                /* RoPE position */
    int32_t slot;               /* cache slot its KV row is written to */
    int32_t n_prefix;           /* slots 0..n_prefix-1 are visible */
    const uint64_t *tail_mask;  /* verify: bit j set -> slot n_prefix + j visible; NULL = none */
    int32_t tail_n;             /* bits used in tail_mask */
    float *logits;              /* [V] or NULL */
    int32_t *argmax;            /* or NULL */
    float *taps;                /* [n_taps][D] or NULL */
} row_desc;

/* Scratch for one chunk of rows; sized once per call. [R] marks one slot per row of the chunk:
 * the projections, the MLPs and lm_head run over all rows at once (kdt_weight_matmul reads each
 * weight row once per block of rows), with exactly the per-row arithmetic. [W] marks one slot per
 * CPU worker: the attention's (row, head group) items, the MoE's experts and lm_head's vocabulary
 * blocks are cut among the workers, each with its own scratch. */
typedef struct run_state {
    int32_t max_rows, max_keys;
    int32_t n_workers;  /* W */
    int64_t expert_inter; /* the widest expert MLP (routed or the shared experts together) */
    float *x;           /* [R][D] residual stream */
    float *q;           /* [R][H][d_n + d_r] queries after RoPE */
    float *rope_cos;    /* [R][d_r/2] (times the YaRN attention factor) */
    float *rope_sin;    /* [R][d_r/2] */
    float *xn;          /* [R][D] normed inputs */
    float *qa;          /* [R][q_lora] */
    float *kva;         /* [R][d_c + d_r] */
    float *heads;       /* [R][H * d_v] */
    float *tmp;         /* [R][D] */
    float *gate;        /* [R][intermediate] dense MLP */
    float *up;          /* [R][intermediate] */
    float *router;      /* [R][E] router logits, then sigmoid scores */
    float *choice;      /* [E] biased scores of one row */
    float *group;       /* [n_group] */
    uint8_t *allowed;   /* [E] expert may still be selected */
    uint8_t *group_open; /* [n_group] group not yet kept */
    uint8_t *group_kept; /* [n_group] */
    int32_t *selected;  /* [R][top_k] */
    float *weights;     /* [R][top_k] */
    float *pair_out;    /* [R][top_k][D] each (row, chosen expert)'s output */
    float *shared_out;  /* [R][D] the shared experts' output */
    int32_t *jobs;      /* [E + 1] MoE jobs: experts some row chose, in increasing index; -1 = shared */
    int32_t *rowlist;   /* [R] rows needing lm_head */
    /* per worker */
    float *qlat_w;      /* [W][ATTN_GROUP][d_c + d_r] a head group's absorbed queries */
    float *qt_w;        /* [W][d_c + d_r][8] the same, transposed (attn_cpu.c's AVX2 form) */
    float *wrow_w;      /* [W][d_c] one converted weight row */
    float *p_w;         /* [W][ATTN_GROUP][max_keys] scores, then softmax weights */
    const float **key_rows_w; /* [W][max_keys] the visible keys' cache rows */
    float *olat_w;      /* [W][ATTN_GROUP][d_c] */
    float *xg_w;        /* [W][R][D] the rows one expert takes, gathered */
    float *yg_w;        /* [W][R][D] that expert's outputs */
    float *gate_w;      /* [W][R][expert intermediate] */
    float *up_w;        /* [W][R][expert intermediate] */
    int32_t *rows_w;    /* [W][R] rows taking one expert */
    int32_t *kslot_w;   /* [W][R] which of its top_k that expert is */
    float *logit_w;     /* [W][R][LOGIT_BLOCK] lm_head logits, one block of the vocabulary */
    int32_t *best_id_w; /* [W][R] lm_head: the row's best id in the worker's blocks */
    float *best_v_w;    /* [W][R] its logit */
    /* the plain prefill form only (NULL otherwise) */
    float *ckv;         /* [K][d_c] the chunk's visible latent rows, gathered */
    float *kup_w;       /* [W][K][d_n + d_v] one head's up-projected keys and values */
    float *krow_w;      /* [W][K][d_n + d_r] the same head's keys [k_nope | k_pe] */
    const float **vrows_w; /* [W][K] its value rows (in kup_w) */
    float *qt_plain_w;  /* [W][d_n + d_r][8] up to 8 rows' queries of that head, transposed */
} run_state;

#define LOGIT_BLOCK 256
#define ATTN_GROUP 8  /* heads per attention item (attn_cpu.c's AVX2 lanes) */
#define MAX_WORKERS 64 /* scratch grows with the workers; more rarely pays at these sizes */

static void *carve(char **p, size_t bytes) {
    void *r = *p;
    *p += (bytes + 63) & ~(size_t)63;
    return r;
}

static kdt_status run_state_alloc(const kdt_model *m, int32_t max_rows, int32_t max_keys, int plain, run_state *rs,
                                  void **block) {
    const kdt_model_config *c = &m->cfg;
    const size_t D = (size_t)c->hidden_size, H = (size_t)c->n_heads, dqk = (size_t)(c->qk_nope_head_dim + c->qk_rope_head_dim),
                 dc = (size_t)c->kv_lora_rank, dr = (size_t)c->qk_rope_head_dim, E = (size_t)c->n_routed_experts + 1;
    const size_t shared_inter = (size_t)c->moe_intermediate_size * (size_t)(c->n_shared_experts > 1 ? c->n_shared_experts : 1);
    const size_t expert_inter = shared_inter > (size_t)c->moe_intermediate_size ? shared_inter : (size_t)c->moe_intermediate_size;
    const size_t f = sizeof(float), R = (size_t)max_rows, K = (size_t)max_keys, TK = (size_t)c->n_experts_per_tok + 1;
    const int32_t workers = kdt_cpu_threads() < MAX_WORKERS ? kdt_cpu_threads() : MAX_WORKERS;
    const size_t W = (size_t)workers, i32 = sizeof(int32_t);
    const size_t sizes[] = {
        R * D * f, R * H * dqk * f, R * (dr / 2) * f, R * (dr / 2) * f, R * D * f,
        R * (size_t)(c->q_lora_rank + 1) * f, R * (dc + dr) * f, R * H * (size_t)c->v_head_dim * f, R * D * f,
        R * (size_t)c->intermediate_size * f, R * (size_t)c->intermediate_size * f, R * E * f, E * f,
        (size_t)(c->n_group + 1) * f, E, (size_t)c->n_group + 1, (size_t)c->n_group + 1, R * TK * i32, R * TK * f,
        R * TK * D * f, R * D * f, E * i32, R * i32,
        W * ATTN_GROUP * (dc + dr) * f, W * (dc + dr) * 8 * f, W * dc * f, W * ATTN_GROUP * K * f,
        W * K * sizeof(float *), W * ATTN_GROUP * dc * f, W * R * D * f, W * R * D * f,
        W * R * expert_inter * f, W * R * expert_inter * f, W * R * i32, W * R * i32, W * R * LOGIT_BLOCK * f,
        W * R * i32, W * R * f,
        plain ? K * dc * f : 0, plain ? W * K * (size_t)(c->qk_nope_head_dim + c->v_head_dim) * f : 0,
        plain ? W * K * dqk * f : 0, plain ? W * K * sizeof(float *) : 0, plain ? W * dqk * 8 * f : 0,
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) total += (sizes[i] + 63) & ~(size_t)63;
    char *p = malloc(total);
    if (!p) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "forward: %zu bytes of scratch", total);
    *block = p;
    rs->max_rows = max_rows;
    rs->max_keys = max_keys;
    rs->n_workers = workers;
    rs->expert_inter = (int64_t)expert_inter;
    size_t i = 0;
    rs->x = carve(&p, sizes[i++]);
    rs->q = carve(&p, sizes[i++]);
    rs->rope_cos = carve(&p, sizes[i++]);
    rs->rope_sin = carve(&p, sizes[i++]);
    rs->xn = carve(&p, sizes[i++]);
    rs->qa = carve(&p, sizes[i++]);
    rs->kva = carve(&p, sizes[i++]);
    rs->heads = carve(&p, sizes[i++]);
    rs->tmp = carve(&p, sizes[i++]);
    rs->gate = carve(&p, sizes[i++]);
    rs->up = carve(&p, sizes[i++]);
    rs->router = carve(&p, sizes[i++]);
    rs->choice = carve(&p, sizes[i++]);
    rs->group = carve(&p, sizes[i++]);
    rs->allowed = carve(&p, sizes[i++]);
    rs->group_open = carve(&p, sizes[i++]);
    rs->group_kept = carve(&p, sizes[i++]);
    rs->selected = carve(&p, sizes[i++]);
    rs->weights = carve(&p, sizes[i++]);
    rs->pair_out = carve(&p, sizes[i++]);
    rs->shared_out = carve(&p, sizes[i++]);
    rs->jobs = carve(&p, sizes[i++]);
    rs->rowlist = carve(&p, sizes[i++]);
    rs->qlat_w = carve(&p, sizes[i++]);
    rs->qt_w = carve(&p, sizes[i++]);
    rs->wrow_w = carve(&p, sizes[i++]);
    rs->p_w = carve(&p, sizes[i++]);
    rs->key_rows_w = carve(&p, sizes[i++]);
    rs->olat_w = carve(&p, sizes[i++]);
    rs->xg_w = carve(&p, sizes[i++]);
    rs->yg_w = carve(&p, sizes[i++]);
    rs->gate_w = carve(&p, sizes[i++]);
    rs->up_w = carve(&p, sizes[i++]);
    rs->rows_w = carve(&p, sizes[i++]);
    rs->kslot_w = carve(&p, sizes[i++]);
    rs->logit_w = carve(&p, sizes[i++]);
    rs->best_id_w = carve(&p, sizes[i++]);
    rs->best_v_w = carve(&p, sizes[i++]);
    rs->ckv = plain ? carve(&p, sizes[i]) : NULL;
    rs->kup_w = plain ? carve(&p, sizes[i + 1]) : NULL;
    rs->krow_w = plain ? carve(&p, sizes[i + 2]) : NULL;
    rs->vrows_w = plain ? carve(&p, sizes[i + 3]) : NULL;
    rs->qt_plain_w = plain ? carve(&p, sizes[i + 4]) : NULL;
    return KDT_OK;
}

/* ---- building blocks ---------------------------------------------------------------------- */

static void rmsnorm(const float *x, const kdt_weight *w, float eps, int32_t n, float *out) {
    float ss = 0.0f;
    for (int32_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int32_t i = 0; i < n; i++) out[i] = kdt_weight_at(w, i) * (x[i] * inv);
}

/* Rotates the d_r-dim vector v in place for one position (cos/sin already scaled). */
static void rope_apply(float *v, const float *cs, const float *sn, int32_t dr, int interleave) {
    for (int32_t i = 0; i < dr / 2; i++) {
        const int32_t a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + dr / 2;
        const float x0 = v[a], x1 = v[b];
        v[a] = x0 * cs[i] - x1 * sn[i];
        v[b] = x1 * cs[i] + x0 * sn[i];
    }
}

/* out[i][D] = down(silu(gate xn_i) * up xn_i) for R rows (xn rows ldx apart, out rows ldo apart);
 * g, u: R x the MLP's intermediate floats of scratch */
static void swiglu_rows(const kdt_expert_weights *e, const float *xn, int64_t ldx, int32_t R, float *out, int64_t ldo,
                        float *g, float *u) {
    kdt_weight_swiglu_rows(&e->gate, &e->up, &e->down, xn, ldx, R, g, u, out, ldo);
}

/* Index of the largest value among v[i] for i < n with ok[i] (ties -> lower index); -1 if none. */
static int32_t argmax_allowed(const float *v, const uint8_t *ok, int32_t n) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++)
        if (ok[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* The routing of one row (sigmoid noaux_tc): router[E] holds its logits and becomes the sigmoid
 * scores; selected[K] / weights[K] get the chosen experts in increasing index and their weights. */
static void route_row(const kdt_model *m, const kdt_layer_weights *L, float *router, int32_t *selected, float *weights,
                      run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const int32_t E = c->n_routed_experts, K = c->n_experts_per_tok, G = c->n_group;
    for (int32_t e = 0; e < E; e++) {
        router[e] = 1.0f / (1.0f + expf(-router[e]));
        rs->choice[e] = router[e] + kdt_weight_at(&L->router_bias, e); /* bias: selection only */
        rs->allowed[e] = 1;
    }
    if (G > 1) {
        /* keep the topk_group groups with the largest (top-1 + top-2) biased score */
        const int32_t per = E / G;
        for (int32_t g = 0; g < G; g++) {
            const float *v = rs->choice + g * per;
            int32_t i1 = 0;
            for (int32_t i = 1; i < per; i++)
                if (v[i] > v[i1]) i1 = i;
            int32_t i2 = i1 == 0 ? 1 : 0;
            for (int32_t i = 0; i < per; i++)
                if (i != i1 && v[i] > v[i2]) i2 = i;
            rs->group[g] = v[i1] + v[i2];
            rs->group_open[g] = 1;
            rs->group_kept[g] = 0;
        }
        for (int32_t t = 0; t < c->topk_group; t++) {
            const int32_t g = argmax_allowed(rs->group, rs->group_open, G);
            rs->group_open[g] = 0;
            rs->group_kept[g] = 1;
        }
        for (int32_t e = 0; e < E; e++) rs->allowed[e] = rs->group_kept[e / per];
    }
    for (int32_t k = 0; k < K; k++) {
        int32_t e = argmax_allowed(rs->choice, rs->allowed, E);
        rs->allowed[e] = 0;
        selected[k] = e;
        weights[k] = router[e]; /* the unbiased score weighs the expert */
    }
    if (c->norm_topk_prob) {
        float sum = 0.0f;
        for (int32_t k = 0; k < K; k++) sum += weights[k];
        sum += 1e-20f;
        for (int32_t k = 0; k < K; k++) weights[k] /= sum;
    }
    for (int32_t k = 0; k < K; k++) weights[k] *= c->routed_scaling_factor;
    /* accumulate in increasing expert index */
    for (int32_t i = 1; i < K; i++)
        for (int32_t j = i; j > 0 && selected[j] < selected[j - 1]; j--) {
            int32_t te = selected[j];
            selected[j] = selected[j - 1];
            selected[j - 1] = te;
            float tw = weights[j];
            weights[j] = weights[j - 1];
            weights[j - 1] = tw;
        }
}

typedef struct moe_job {
    const kdt_model *m;
    const kdt_layer_weights *L;
    const float *xn;
    int32_t R;
    run_state *rs;
} moe_job;

/* MoE jobs [b, e): an expert over the rows that chose it (gathered), or the shared experts over
 * all rows; each writes only its own (row, expert) outputs */
static void moe_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const moe_job *j = ctx;
    run_state *rs = j->rs;
    const kdt_model_config *c = &j->m->cfg;
    const int32_t K = c->n_experts_per_tok, D = c->hidden_size, R = j->R;
    const int64_t wr = (int64_t)worker * rs->max_rows;
    float *xg = rs->xg_w + wr * D, *yg = rs->yg_w + wr * D;
    float *g = rs->gate_w + wr * rs->expert_inter, *u = rs->up_w + wr * rs->expert_inter;
    int32_t *rowlist = rs->rows_w + wr, *kslot = rs->kslot_w + wr;
    for (int64_t it = b; it < e; it++) {
        const int32_t ex = rs->jobs[it];
        if (ex < 0) {
            swiglu_rows(&j->L->shared, j->xn, D, R, rs->shared_out, D, g, u);
            continue;
        }
        int32_t n = 0;
        for (int32_t r = 0; r < R; r++)
            for (int32_t k = 0; k < K; k++)
                if (rs->selected[(int64_t)r * K + k] == ex) {
                    rowlist[n] = r, kslot[n] = k;
                    memcpy(xg + (int64_t)n * D, j->xn + (int64_t)r * D, (size_t)D * sizeof(float));
                    n++;
                }
        swiglu_rows(&j->L->experts[ex], xg, D, n, yg, D, g, u);
        for (int32_t i = 0; i < n; i++)
            memcpy(rs->pair_out + ((int64_t)rowlist[i] * K + kslot[i]) * D, yg + (int64_t)i * D, (size_t)D * sizeof(float));
    }
}

/* out[R][D] = routed experts + shared experts for R rows of xn [R][D]. Each chosen expert runs
 * once over the rows that chose it (gathered), the experts spread over the CPU workers; then
 * every row sums its experts in increasing index (selected is sorted so), as it did alone. out
 * may be rs->tmp. */
static void moe_rows(const kdt_model *m, const kdt_layer_weights *L, const float *xn, int32_t R, float *out,
                     run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const int32_t E = c->n_routed_experts, K = c->n_experts_per_tok, D = c->hidden_size;
    kdt_weight_matmul(&L->router, xn, D, R, rs->router, E, 0, E);
    for (int32_t r = 0; r < R; r++)
        route_row(m, L, rs->router + (int64_t)r * E, rs->selected + (int64_t)r * K, rs->weights + (int64_t)r * K, rs);
    int32_t n_jobs = 0;
    if (c->n_shared_experts > 0) rs->jobs[n_jobs++] = -1; /* the largest job first */
    for (int32_t e = 0; e < E; e++)
        for (int64_t i = 0; i < (int64_t)R * K; i++)
            if (rs->selected[i] == e) {
                rs->jobs[n_jobs++] = e;
                break;
            }
    /* per job about (rows x top_k / experts chosen) rows through three inter x D products */
    const double cost = 3.0 * c->moe_intermediate_size * D * ((double)R * K / (n_jobs > 0 ? n_jobs : 1) + 1);
    moe_job j = {m, L, xn, R, rs};
    kdt_parallel_for(n_jobs, 1, cost, rs->n_workers, moe_piece, &j);
    for (int32_t r = 0; r < R; r++) {
        float *o = out + (int64_t)r * D;
        for (int32_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int32_t k = 0; k < K; k++) {
            const float w = rs->weights[(int64_t)r * K + k];
            const float *y = rs->pair_out + ((int64_t)r * K + k) * D;
            for (int32_t d = 0; d < D; d++) o[d] += y[d] * w;
        }
        if (c->n_shared_experts > 0)
            for (int32_t d = 0; d < D; d++) o[d] = o[d] + rs->shared_out[(int64_t)r * D + d];
    }
}

/* Stage 1 of a layer for rows[0..R): queries (kept in q, [R][H * dqk]) and each row's latent KV
 * row (into the cache). */
static void attn_project_rows(const kdt_model *m, kdt_kv_cache *kv, int32_t l, const row_desc *rows, int32_t R,
                              run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const kdt_layer_weights *L = &m->layers[l];
    const int32_t D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
                  dc = c->kv_lora_rank, dqk = dn + dr, ql = c->q_lora_rank, half = dr / 2;
    const int64_t dq = (int64_t)H * dqk;
    const float latent_eps = 1e-6f; /* q_a_layernorm / kv_a_layernorm use the RMSNorm default */
    for (int32_t r = 0; r < R; r++)
        rmsnorm(rs->x + (int64_t)r * D, &L->input_norm, c->rms_norm_eps, D, rs->xn + (int64_t)r * D);
    if (ql > 0) {
        kdt_weight_matmul(&L->q_a, rs->xn, D, R, rs->qa, ql, 0, ql);
        for (int32_t r = 0; r < R; r++) rmsnorm(rs->qa + (int64_t)r * ql, &L->q_a_norm, latent_eps, ql, rs->qa + (int64_t)r * ql);
        kdt_weight_matmul(&L->q_b, rs->qa, ql, R, rs->q, dq, 0, dq);
    } else {
        kdt_weight_matmul(&L->q_proj, rs->xn, D, R, rs->q, dq, 0, dq);
    }
    for (int32_t r = 0; r < R; r++)
        for (int32_t h = 0; h < H; h++)
            rope_apply(rs->q + r * dq + h * dqk + dn, rs->rope_cos + (int64_t)r * half, rs->rope_sin + (int64_t)r * half,
                       dr, c->rope_interleave);
    kdt_weight_matmul(&L->kv_a, rs->xn, D, R, rs->kva, dc + dr, 0, dc + dr);
    for (int32_t r = 0; r < R; r++) {
        const float *kva = rs->kva + (int64_t)r * (dc + dr);
        float *dst = kdt_kv_row(kv, l, rows[r].stream, rows[r].slot);
        rmsnorm(kva, &L->kv_a_norm, latent_eps, dc, dst);
        memcpy(dst + dc, kva + dc, (size_t)dr * sizeof(float));
        rope_apply(dst + dc, rs->rope_cos + (int64_t)r * half, rs->rope_sin + (int64_t)r * half, dr, c->rope_interleave);
    }
}

/* Stage 2: absorbed MLA attention of one row, heads [h0, h0 + n) (n <= ATTN_GROUP), over the
 * row's visible keys (key_rows[n_keys], increasing slots) -> those heads' d_v outputs in heads.
 * q_lat = W_UK[h]^T q_nope (i ascending) here, the scores / softmax / latent output in
 * kdt_cpu_attend (attn_cpu.c), o_h = W_UV[h] o_lat here. w: one worker's scratch. */
typedef struct attn_scratch {
    float *qlat;              /* [ATTN_GROUP][d_c + d_r] */
    float *qt;                /* [d_c + d_r][8] */
    float *wrow;              /* [d_c] */
    float *p;                 /* [ATTN_GROUP][max_keys] */
    float *olat;              /* [ATTN_GROUP][d_c] */
    const float **key_rows;   /* [max_keys] */
} attn_scratch;

static void attn_group(const kdt_model *m, int32_t l, const float *const *key_rows, int32_t n_keys, int32_t h0,
                       int32_t n, const float *q, float *heads, const attn_scratch *w) {
    const kdt_model_config *c = &m->cfg;
    const kdt_weight *kvb = &m->layers[l].kv_b;
    const int32_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, dc = c->kv_lora_rank,
                  dqk = dn + dr;
    for (int32_t g = 0; g < n; g++) {
        const int32_t h = h0 + g;
        const float *q_nope = q + h * dqk, *q_pe = q_nope + dn;
        float *qlat = w->qlat + (int64_t)g * (dc + dr);
        for (int32_t e = 0; e < dc; e++) qlat[e] = 0.0f;
        for (int32_t i = 0; i < dn; i++) {
            kdt_weight_row_f32(kvb, (int64_t)h * (dn + dv) + i, w->wrow);
            const float qi = q_nope[i];
            for (int32_t e = 0; e < dc; e++) qlat[e] += w->wrow[e] * qi;
        }
        memcpy(qlat + dc, q_pe, (size_t)dr * sizeof(float));
    }
    kdt_cpu_attend(key_rows, n_keys, dc, dr, c->softmax_scale, n, w->qlat, w->p, w->olat, w->qt);
    for (int32_t g = 0; g < n; g++) { /* inside a parallel piece this runs on the piece's thread */
        const int64_t r0 = (int64_t)(h0 + g) * (dn + dv) + dn;
        kdt_weight_matvec(kvb, w->olat + (int64_t)g * dc, heads + (int64_t)(h0 + g) * dv, r0, r0 + dv);
    }
}

typedef struct attn_job {
    const kdt_model *m;
    const kdt_kv_cache *kv;
    int32_t l;
    const row_desc *rows;
    run_state *rs;
} attn_job;

/* (row, group of ATTN_GROUP heads) items [b, e), row-major: each item's outputs are its own, so any
 * cut of the items among threads gives the same values */
static void attn_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const attn_job *j = ctx;
    const kdt_model_config *c = &j->m->cfg;
    run_state *rs = j->rs;
    const int32_t H = c->n_heads, dc = c->kv_lora_rank, dr = c->qk_rope_head_dim, groups = (H + ATTN_GROUP - 1) / ATTN_GROUP;
    const int64_t dq = (int64_t)H * (c->qk_nope_head_dim + dr), dh = (int64_t)H * c->v_head_dim, K = rs->max_keys;
    const attn_scratch w = {rs->qlat_w + (int64_t)worker * ATTN_GROUP * (dc + dr), rs->qt_w + (int64_t)worker * (dc + dr) * 8,
                            rs->wrow_w + (int64_t)worker * dc, rs->p_w + (int64_t)worker * ATTN_GROUP * K,
                            rs->olat_w + (int64_t)worker * ATTN_GROUP * dc, rs->key_rows_w + (int64_t)worker * K};
    int64_t keys_row = -1;
    int32_t n_keys = 0;
    for (int64_t it = b; it < e; it++) {
        const int64_t r = it / groups;
        const row_desc *row = &j->rows[r];
        if (r != keys_row) { /* the row's visible slots, increasing */
            n_keys = 0;
            for (int32_t t = 0; t < row->n_prefix; t++) w.key_rows[n_keys++] = kdt_kv_row(j->kv, j->l, row->stream, t);
            if (row->tail_mask)
                for (int32_t i = 0; i < row->tail_n; i++)
                    if ((row->tail_mask[i / 64] >> (i % 64)) & 1u)
                        w.key_rows[n_keys++] = kdt_kv_row(j->kv, j->l, row->stream, row->n_prefix + i);
            keys_row = r;
        }
        const int32_t h0 = (int32_t)(it % groups) * ATTN_GROUP, n = H - h0 < ATTN_GROUP ? H - h0 : ATTN_GROUP;
        attn_group(j->m, j->l, w.key_rows, n_keys, h0, n, rs->q + r * dq, rs->heads + r * dh, &w);
    }
}

/* Stage 2 for rows[0..R): every (row, head group) item, cut among the CPU threads */
static void attn_rows(const kdt_model *m, const kdt_kv_cache *kv, int32_t l, const row_desc *rows, int32_t R,
                      run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const int32_t groups = (c->n_heads + ATTN_GROUP - 1) / ATTN_GROUP;
    int64_t keys = 0;
    for (int32_t r = 0; r < R; r++) keys += rows[r].n_prefix + rows[r].tail_n;
    /* per item: the keys' two passes over a cache row, q_lat and W_UV, for its heads */
    const double cost = ((double)keys / R * (2 * c->kv_lora_rank + c->qk_rope_head_dim) +
                         (double)c->kv_lora_rank * (c->qk_nope_head_dim + c->v_head_dim)) *
                        (c->n_heads < ATTN_GROUP ? c->n_heads : ATTN_GROUP);
    attn_job j = {m, kv, l, rows, rs};
    kdt_parallel_for((int64_t)R * groups, 1, cost, rs->n_workers, attn_piece, &j);
}

/* ---- the plain form of a prefill chunk's attention ----------------------------------------- */

int kdt_prefill_plain_pays(const kdt_model_config *c, int32_t n_rows, int32_t prefix_len) {
    if (!c || n_rows < 1 || prefix_len < 0) return 0;
    const double dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, dc = c->kv_lora_rank;
    const double R = n_rows, T = (double)prefix_len + n_rows;
    const double pairs = R * prefix_len + R * (R + 1) / 2; /* row i sees prefix_len + i + 1 keys */
    /* per head: absorbed = W_UK and W_UV per row + [q_lat | q_pe] . row and the c_kv sum per pair;
     * plain = kv_b per key + [q_nope | q_pe] . [k_nope | k_pe] and the v sum per pair */
    const double absorbed = R * 2 * dc * (dn + dv) + pairs * (2 * (dc + dr) + 2 * dc);
    const double plain = T * 2 * dc * (dn + dv) + pairs * (2 * (dn + dr) + 2 * dv);
    return plain < absorbed;
}

int32_t kdt_prefill_chunk_for(const kdt_model_config *c, double flop_per_byte) {
    if (!c || !(flop_per_byte > 0)) return KDT_GPU_PREFILL_CHUNK_MIN;
    const double D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const double dv = c->v_head_dim, dc = c->kv_lora_rank, ql = c->q_lora_rank;
    /* weights per layer: q (through q_a / q_b or q_proj), kv_a, kv_b, o_proj; then the MLP */
    const double attn = (ql > 0 ? D * ql + ql * H * (dn + dr) : D * H * (dn + dr)) + D * (dc + dr) +
                        dc * H * (dn + dv) + H * dv * D;
    const double expert = 3.0 * D * c->moe_intermediate_size, E = c->n_routed_experts;
    const int moe = c->n_routed_experts > 0 && c->n_layers > c->first_k_dense_replace;
    const double all = moe ? attn + D * E + (c->n_shared_experts + E) * expert : attn + 3.0 * D * c->intermediate_size;
    const double used = moe ? attn + D * E + (double)(c->n_shared_experts + c->n_experts_per_tok) * expert : all;
    if (!(all > 0) || !(used > 0)) return KDT_GPU_PREFILL_CHUNK_MIN;
    /* rows at which 2 * used FLOPs a row reach 2 * all bytes (bf16) times the ridge */
    const double knee = flop_per_byte * all / used;
    int32_t rows = KDT_GPU_PREFILL_CHUNK_MIN;
    while (rows < KDT_GPU_PREFILL_CHUNK_MAX && rows < knee) rows *= 2;
    return rows;
}

double kdt_gpu_flop_per_byte(int sms, int clock_khz, int mem_clock_khz, int bus_bits, int cc_major) {
    if (sms <= 0 || clock_khz <= 0 || mem_clock_khz <= 0 || bus_bits <= 0 || cc_major <= 0) return 0;
    const double rate = (cc_major == 9 ? 114e12 : 55e12) * (sms / 132.0) * (clock_khz / 1.98e6);
    const double bandwidth = 0.9 * 2.0 * mem_clock_khz * 1e3 * (bus_bits / 8.0); /* DDR: 2 transfers a clock */
    return rate / bandwidth;
}

typedef struct plain_job {
    const kdt_model *m;
    const kdt_kv_cache *kv;
    int32_t l;
    const row_desc *rows;   /* the segment's rows (one stream's consecutive slots) */
    int32_t R, T;           /* rows; keys 0..T-1 (the last row's visible slots) */
    int32_t row0;           /* the segment's first row in the chunk (its q and heads rows) */
    run_state *rs;
} plain_job;

/* Heads [b, e): a head's [k_nope | v] for keys 0..T-1 (kv_b rows of that head over the gathered
 * c_kv), then for every row: score_t = (sum over i ascending of [q_nope | q_pe][i] *
 * [k_nope_t | k_pe_t][i]) * scale for t < n_prefix, softmax, o = (sum over t ascending of
 * p_t v_t) / l: attn_cpu.c's scores, softmax and weighted sum (the absorbed form's AVX2 code),
 * eight rows of the head at a time over the last one's keys (a score does not depend on the other
 * keys, so a row's first n_prefix are what it would get alone). Each head's outputs are its own,
 * so any cut of the heads gives the same values. */
static void plain_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const plain_job *j = ctx;
    const kdt_model_config *c = &j->m->cfg;
    run_state *rs = j->rs;
    const int32_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim, dc = c->kv_lora_rank,
                  dqk = dn + dr, du = dn + dv, H = c->n_heads, T = j->T, stream = j->rows[0].stream;
    const int64_t K = rs->max_keys;
    float *kup = rs->kup_w + (int64_t)worker * K * du, *krow = rs->krow_w + (int64_t)worker * K * dqk;
    float *p = rs->p_w + (int64_t)worker * ATTN_GROUP * K, *qt = rs->qt_plain_w + (int64_t)worker * dqk * 8;
    const float **keys = rs->key_rows_w + (int64_t)worker * K, **vrows = rs->vrows_w + (int64_t)worker * K;
    const kdt_weight *kvb = &j->m->layers[j->l].kv_b;
    for (int64_t h = b; h < e; h++) {
        kdt_weight_matmul(kvb, rs->ckv, dc, T, kup, du, h * du, (h + 1) * du);
        for (int32_t t = 0; t < T; t++) {
            float *k = krow + (int64_t)t * dqk;
            memcpy(k, kup + (int64_t)t * du, (size_t)dn * sizeof(float));
            memcpy(k + dn, kdt_kv_row(j->kv, j->l, stream, t) + dc, (size_t)dr * sizeof(float));
            keys[t] = k;
            vrows[t] = kup + (int64_t)t * du + dn;
        }
        for (int32_t r0 = 0; r0 < j->R; r0 += ATTN_GROUP) {
            const int32_t nq = j->R - r0 < ATTN_GROUP ? j->R - r0 : ATTN_GROUP, nk = j->rows[r0 + nq - 1].n_prefix;
            kdt_cpu_scores(keys, nk, dqk, c->softmax_scale, nq, rs->q + (int64_t)(j->row0 + r0) * H * dqk + h * dqk,
                           (int64_t)H * dqk, p, qt);
            for (int32_t g = 0; g < nq; g++) {
                const int32_t n = j->rows[r0 + g].n_prefix;
                float *s = p + (int64_t)g * nk, *o = rs->heads + (int64_t)(j->row0 + r0 + g) * H * dv + h * dv;
                const float lsum = kdt_cpu_softmax_weights(s, n);
                kdt_cpu_weighted_sum(s, vrows, n, dv, o);
                for (int32_t v = 0; v < dv; v++) o[v] /= lsum;
            }
        }
    }
}

/* Stage 2 in the plain form for a prefill segment: the chunk's rows row0 .. row0 + R - 1 (rows
 * points at the first), one stream's consecutive slots, row r seeing slots 0..n_prefix-1: the
 * visible latent rows gathered once, then the heads cut among the CPU threads. */
static void attn_rows_plain(const kdt_model *m, const kdt_kv_cache *kv, int32_t l, const row_desc *rows, int32_t R,
                            int32_t row0, run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const int32_t dc = c->kv_lora_rank, T = rows[R - 1].n_prefix;
    for (int32_t t = 0; t < T; t++)
        memcpy(rs->ckv + (int64_t)t * dc, kdt_kv_row(kv, l, rows[0].stream, t), (size_t)dc * sizeof(float));
    const double cost = (double)T * dc * (c->qk_nope_head_dim + c->v_head_dim) +
                        (double)R * T * (c->qk_nope_head_dim + c->qk_rope_head_dim + c->v_head_dim);
    plain_job j = {m, kv, l, rows, R, T, row0, rs};
    kdt_parallel_for(c->n_heads, 1, cost, rs->n_workers, plain_piece, &j);
}

typedef struct lm_head_job {
    const kdt_model *m;
    const row_desc *rows;
    int32_t n;          /* rows in rs->rowlist, their normed inputs in rs->xn */
    run_state *rs;
} lm_head_job;

/* vocabulary blocks [b, e) of LOGIT_BLOCK ids for every listed row: logits copied out, and the
 * first id of the largest logit above -inf in these blocks kept (-1: none; NaN never wins) */
static void lm_head_piece(void *ctx, int worker, int64_t b, int64_t e) {
    const lm_head_job *j = ctx;
    run_state *rs = j->rs;
    const int32_t V = j->m->cfg.vocab_size, D = j->m->cfg.hidden_size;
    float *blk = rs->logit_w + (int64_t)worker * rs->max_rows * LOGIT_BLOCK;
    int32_t *best_id = rs->best_id_w + (int64_t)worker * rs->max_rows;
    float *best_v = rs->best_v_w + (int64_t)worker * rs->max_rows;
    for (int32_t i = 0; i < j->n; i++) best_id[i] = -1, best_v[i] = -INFINITY;
    for (int64_t bi = b; bi < e; bi++) {
        const int32_t v0 = (int32_t)bi * LOGIT_BLOCK, v1 = v0 + LOGIT_BLOCK < V ? v0 + LOGIT_BLOCK : V;
        kdt_weight_matmul(&j->m->lm_head, rs->xn, D, j->n, blk, LOGIT_BLOCK, v0, v1);
        for (int32_t i = 0; i < j->n; i++) {
            const row_desc *row = &j->rows[rs->rowlist[i]];
            const float *vals = blk + (int64_t)i * LOGIT_BLOCK;
            if (row->logits) memcpy(row->logits + v0, vals, (size_t)(v1 - v0) * sizeof(float));
            for (int32_t v = v0; v < v1; v++)
                if (vals[v - v0] > best_v[i]) best_v[i] = vals[v - v0], best_id[i] = v;
        }
    }
}

/* Final norm + lm_head for the rows that want outputs: the logits row and/or the fused argmax
 * (the first id of the largest logit; 0 if none is above -inf), the vocabulary's blocks cut among
 * the CPU workers. The workers' bests, compared in block order with the same strict >, give what
 * one pass over all the ids gives. */
static void lm_head_rows(const kdt_model *m, const row_desc *rows, int32_t R, run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const int32_t V = c->vocab_size, D = c->hidden_size;
    int32_t n = 0;
    for (int32_t r = 0; r < R; r++)
        if (rows[r].logits || rows[r].argmax) {
            rmsnorm(rs->x + (int64_t)r * D, &m->final_norm, c->rms_norm_eps, D, rs->xn + (int64_t)n * D);
            rs->rowlist[n++] = r;
        }
    if (n == 0) return;
    const int64_t n_blocks = (V + LOGIT_BLOCK - 1) / LOGIT_BLOCK;
    for (int32_t w = 0; w < rs->n_workers; w++) /* workers given no block keep "none" */
        for (int32_t i = 0; i < n; i++) rs->best_id_w[(int64_t)w * rs->max_rows + i] = -1;
    lm_head_job j = {m, rows, n, rs};
    kdt_parallel_for(n_blocks, 1, (double)LOGIT_BLOCK * D * n, rs->n_workers, lm_head_piece, &j);
    for (int32_t i = 0; i < n; i++) {
        int32_t best = 0;
        float best_v = -INFINITY;
        for (int32_t w = 0; w < rs->n_workers; w++) {
            const int64_t at = (int64_t)w * rs->max_rows + i;
            if (rs->best_id_w[at] >= 0 && rs->best_v_w[at] > best_v) best = rs->best_id_w[at], best_v = rs->best_v_w[at];
        }
        if (rows[rs->rowlist[i]].argmax) *rows[rs->rowlist[i]].argmax = best;
    }
}

/* A prefill segment that takes the plain attention form: rows row0 .. row0 + n - 1 of a chunk. */
typedef struct plain_seg {
    int32_t row0, n;
} plain_seg;

/* Runs rows[0..R) through the whole model: per layer, every row's projections and KV row, then
 * every row's attention, then o_proj and the MLP over all rows. The attention: the absorbed form
 * over every row where `absorbed`, then the plain form for each of the n_plain segments (their
 * heads overwritten; rows are independent, so each row gets what its form gives it alone). */
static void forward_chunk(const kdt_model *m, kdt_kv_cache *kv, const row_desc *rows, int32_t R, int absorbed,
                          const plain_seg *plain, int32_t n_plain, const kdt_model_outputs *out, run_state *rs) {
    const kdt_model_config *c = &m->cfg;
    const int32_t D = c->hidden_size, half = c->qk_rope_head_dim / 2;
    const int64_t dh = (int64_t)c->n_heads * c->v_head_dim;
    for (int32_t r = 0; r < R; r++) {
        kdt_weight_row_f32(&m->embed, rows[r].token, rs->x + (int64_t)r * D);
        for (int32_t i = 0; i < half; i++) {
            const float angle = (float)rows[r].pos * m->rope_inv_freq[i]; /* fp32, as transformers */
            rs->rope_cos[(int64_t)r * half + i] = cosf(angle) * c->rope_attention_factor;
            rs->rope_sin[(int64_t)r * half + i] = sinf(angle) * c->rope_attention_factor;
        }
    }
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kdt_layer_weights *L = &m->layers[l];
        attn_project_rows(m, kv, l, rows, R, rs);
        if (absorbed) attn_rows(m, kv, l, rows, R, rs);
        for (int32_t k = 0; k < n_plain; k++) attn_rows_plain(m, kv, l, rows + plain[k].row0, plain[k].n, plain[k].row0, rs);
        kdt_weight_matmul(&L->o_proj, rs->heads, dh, R, rs->tmp, D, 0, D);
        for (int32_t r = 0; r < R; r++) {
            float *x = rs->x + (int64_t)r * D;
            const float *t = rs->tmp + (int64_t)r * D;
            for (int32_t d = 0; d < D; d++) x[d] += t[d];
            rmsnorm(x, &L->post_norm, c->rms_norm_eps, D, rs->xn + (int64_t)r * D);
        }
        if (L->is_moe) moe_rows(m, L, rs->xn, R, rs->tmp, rs);
        else swiglu_rows(&L->dense, rs->xn, D, R, rs->tmp, D, rs->gate, rs->up);
        for (int32_t r = 0; r < R; r++) {
            float *x = rs->x + (int64_t)r * D;
            const float *t = rs->tmp + (int64_t)r * D;
            for (int32_t d = 0; d < D; d++) x[d] += t[d];
            if (rows[r].taps)
                for (int32_t t2 = 0; t2 < out->n_taps; t2++)
                    if (out->tap_layers[t2] == l) memcpy(rows[r].taps + (int64_t)t2 * D, x, (size_t)D * sizeof(float));
        }
    }
    lm_head_rows(m, rows, R, rs);
}

/* ---- argument checks shared by the three entry points -------------------------------------- */

static kdt_status check_common(const char *fn, const kdt_model *m, const kdt_kv_cache *kv,
                               const kdt_model_outputs *out) {
    KDT_CHECK_ARG(m && kv, "%s: model or cache is NULL", fn);
    KDT_CHECK_ARG(kv->n_layers == m->cfg.n_layers &&
                      kv->row_elems == m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim,
                  "%s: the KV cache was made for another model", fn);
    if (!out) return KDT_OK;
    KDT_CHECK_ARG(out->n_taps >= 0 && out->n_taps <= KDT_MODEL_MAX_TAPS, "%s: n_taps = %d (0..%d)", fn,
                  out->n_taps, KDT_MODEL_MAX_TAPS);
    if (out->n_taps > 0) {
        KDT_CHECK_ARG(out->tap_layers && out->taps, "%s: n_taps = %d but tap_layers or taps is NULL", fn,
                      out->n_taps);
        for (int32_t t = 0; t < out->n_taps; t++)
            KDT_CHECK_ARG(out->tap_layers[t] >= 0 && out->tap_layers[t] < m->cfg.n_layers,
                          "%s: tap_layers[%d] = %d (0..%d)", fn, t, out->tap_layers[t], m->cfg.n_layers - 1);
    }
    return KDT_OK;
}

static kdt_status check_token(const char *fn, const kdt_model *m, int32_t tok, const char *what, int64_t i) {
    return kdt_check_token(fn, &m->cfg, tok, what, i);
}

static void fill_outputs(const kdt_model *m, const kdt_model_outputs *out, int64_t out_row, int64_t tap_row,
                         row_desc *r) {
    const int64_t V = m->cfg.vocab_size, D = m->cfg.hidden_size;
    r->logits = NULL;
    r->argmax = NULL;
    r->taps = NULL;
    if (!out) return;
    if (out_row >= 0 && out->logits) r->logits = out->logits + out_row * V;
    if (out_row >= 0 && out->argmax) r->argmax = out->argmax + out_row;
    if (out->n_taps > 0) r->taps = out->taps + tap_row * out->n_taps * D;
}

int kdt_prefill_takes_plain(const kdt_model_config *c, int32_t form, int32_t n_rows, int32_t prefix_len) {
    return form == KDT_PREFILL_PLAIN || (form == KDT_PREFILL_AUTO && kdt_prefill_plain_pays(c, n_rows, prefix_len));
}

/* Whether a prefill chunk of R rows whose first row is at slot `first` takes the plain form. */
static int chunk_plain(const kdt_model *m, int32_t R, int32_t first) {
    return kdt_prefill_takes_plain(&m->cfg, m->opt.prefill_attention, R, first);
}

/* Runs `n` rows in chunks of the model's prefill_chunk. prefill: the rows are one stream's
 * consecutive slots, each seeing every slot up to its own (the plain form may apply). */
static kdt_status run_rows(const kdt_model *m, kdt_kv_cache *kv, const row_desc *rows, int64_t n, int prefill,
                           const kdt_model_outputs *out) {
    int32_t max_keys = 1;
    for (int64_t i = 0; i < n; i++)
        if (rows[i].n_prefix + rows[i].tail_n > max_keys) max_keys = rows[i].n_prefix + rows[i].tail_n;
    const int32_t chunk = (int32_t)(n < m->opt.prefill_chunk ? n : m->opt.prefill_chunk);
    int any_plain = 0;
    for (int64_t i = 0; prefill && i < n; i += chunk)
        any_plain |= chunk_plain(m, (int32_t)(n - i < chunk ? n - i : chunk), rows[i].slot);
    run_state rs = {0}; /* every field is set by run_state_alloc; zeroed so that gcc can see it */
    void *block = NULL;
    kdt_status st = run_state_alloc(m, chunk, max_keys, any_plain, &rs, &block);
    if (st != KDT_OK) return st;
    for (int64_t i = 0; i < n; i += chunk) {
        const int32_t R = (int32_t)(n - i < chunk ? n - i : chunk);
        const plain_seg whole = {0, R};
        const int plain = prefill && chunk_plain(m, R, rows[i].slot);
        forward_chunk(m, kv, rows + i, R, !plain, &whole, plain, out, &rs);
    }
    free(block);
    return KDT_OK;
}

/* ---- entry points --------------------------------------------------------------------------- */

kdt_status kdt_model_prefill(const kdt_model *m, kdt_kv_cache *kv, int32_t stream, const int32_t *tokens,
                             int32_t n, const kdt_model_outputs *out) {
    static const char fn[] = "kdt_model_prefill";
    kdt_status st = check_common(fn, m, kv, out);
    if (st != KDT_OK) return st;
    KDT_CHECK_ARG(tokens, "%s: tokens is NULL", fn);
    KDT_CHECK_ARG(n >= 1, "%s: n = %d", fn, n);
    KDT_CHECK_ARG(stream >= 0 && stream < kv->max_streams, "%s: stream %d (0..%d)", fn, stream, kv->max_streams - 1);
    for (int32_t i = 0; i < n; i++)
        if ((st = check_token(fn, m, tokens[i], "tokens", i)) != KDT_OK) return st;
    const int32_t len = kv->length[stream];
    if ((int64_t)len + n > m->cfg.max_position_embeddings)
        return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: %d + %d tokens exceed max_position_embeddings %d", fn,
                        stream, len, n, m->cfg.max_position_embeddings);
    const int32_t need = len + n;
    if ((st = kdt_kv_reserve_many(kv, 1, &stream, &need)) != KDT_OK) return st;
    row_desc *rows = malloc((size_t)n * sizeof *rows);
    if (!rows) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: %d rows", fn, n);
    for (int32_t i = 0; i < n; i++) {
        row_desc *r = &rows[i];
        memset(r, 0, sizeof *r);
        r->stream = stream;
        r->token = tokens[i];
        r->pos = r->slot = len + i;
        r->n_prefix = len + i + 1; /* causal: itself and everything before */
        int64_t out_row = out && out->last_only ? (i == n - 1 ? 0 : -1) : i;
        fill_outputs(m, out, out_row, i, r);
    }
    st = run_rows(m, kv, rows, n, 1, out);
    free(rows);
    if (st == KDT_OK) kv->length[stream] = kv->written[stream] = len + n;
    return st;
}

kdt_status kdt_model_prefill_many(const kdt_model *m, kdt_kv_cache *kv, int32_t n_segments,
                                  const kdt_prefill_segment *segs, const kdt_model_outputs *out) {
    static const char fn[] = "kdt_model_prefill_many";
    kdt_status st = check_common(fn, m, kv, out);
    if (st != KDT_OK) return st;
    /* every check before any state changes: a refused call leaves the cache as it was; a segment
     * is one chunk of kdt_model_prefill's, so that its rows get that call's bits */
    KDT_TRY(kdt_check_prefill_segments(fn, &m->cfg, n_segments, segs, kv->max_streams, kv->length, m->opt.prefill_chunk,
                                       "the model's prefill_chunk", KDT_MAX_PREFILL_CHUNK, "the most rows of a pass"));
    int32_t R = 0, max_keys = 1; /* the check bounds the rows by KDT_MAX_PREFILL_CHUNK */
    for (int32_t k = 0; k < n_segments; k++) R += segs[k].n;
    int32_t *ids = malloc((size_t)n_segments * 2 * sizeof(int32_t));
    row_desc *rows = malloc((size_t)R * sizeof *rows);
    plain_seg *plain = calloc((size_t)n_segments, sizeof *plain);
    void *block = NULL;
    if (!ids || !rows || !plain) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: %d rows", fn, R);
        goto done;
    }
    int32_t *need = ids + n_segments;
    for (int32_t k = 0; k < n_segments; k++) {
        ids[k] = segs[k].stream;
        need[k] = kv->length[segs[k].stream] + segs[k].n;
        if (need[k] > max_keys) max_keys = need[k];
    }
    if ((st = kdt_kv_reserve_many(kv, n_segments, ids, need)) != KDT_OK) goto done;
    int32_t row = 0, n_plain = 0, absorbed = 0;
    for (int32_t k = 0; k < n_segments; k++) {
        const int32_t len = kv->length[segs[k].stream], n = segs[k].n;
        for (int32_t i = 0; i < n; i++, row++) {
            row_desc *r = &rows[row];
            memset(r, 0, sizeof *r);
            r->stream = segs[k].stream;
            r->token = segs[k].tokens[i];
            r->pos = r->slot = len + i;
            r->n_prefix = len + i + 1; /* causal: itself and everything before */
            fill_outputs(m, out, out && out->last_only ? (i == n - 1 ? k : -1) : row, row, r);
        }
        if (chunk_plain(m, n, len)) plain[n_plain++] = (plain_seg){row - n, n};
        else absorbed = 1;
    }
    run_state rs = {0};
    if ((st = run_state_alloc(m, R, max_keys, n_plain > 0, &rs, &block)) != KDT_OK) goto done;
    forward_chunk(m, kv, rows, R, absorbed, plain, n_plain, out, &rs);
    for (int32_t k = 0; k < n_segments; k++) kv->length[segs[k].stream] = kv->written[segs[k].stream] = need[k];
done:
    free(block);
    free(ids);
    free(rows);
    free(plain);
    return st;
}

kdt_status kdt_model_decode(const kdt_model *m, kdt_kv_cache *kv, int32_t n_streams, const int32_t *stream_ids,
                            const int32_t *tokens, const kdt_model_outputs *out) {
    static const char fn[] = "kdt_model_decode";
    kdt_status st = check_common(fn, m, kv, out);
    if (st != KDT_OK) return st;
    KDT_CHECK_ARG(tokens, "%s: tokens is NULL", fn);
    KDT_CHECK_ARG(n_streams >= 1 && n_streams <= kv->max_streams, "%s: n_streams = %d (1..%d)", fn, n_streams,
                  kv->max_streams);
    int32_t *ids = malloc((size_t)n_streams * 2 * sizeof(int32_t));
    row_desc *rows = malloc((size_t)n_streams * sizeof *rows);
    if (!ids || !rows) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", fn);
        goto done;
    }
    int32_t *need = ids + n_streams;
    if ((st = kdt_resolve_stream_ids(fn, stream_ids, n_streams, kv->max_streams, ids)) != KDT_OK) goto done;
    for (int32_t s = 0; s < n_streams; s++) {
        const int32_t id = ids[s];
        if ((st = check_token(fn, m, tokens[s], "tokens", s)) != KDT_OK) goto done;
        if (kv->length[id] >= m->cfg.max_position_embeddings) {
            st = kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d is at max_position_embeddings %d", fn, id,
                          m->cfg.max_position_embeddings);
            goto done;
        }
        need[s] = kv->length[id] + 1;
    }
    if ((st = kdt_kv_reserve_many(kv, n_streams, ids, need)) != KDT_OK) goto done;
    for (int32_t s = 0; s < n_streams; s++) {
        row_desc *r = &rows[s];
        memset(r, 0, sizeof *r);
        r->stream = ids[s];
        r->token = tokens[s];
        r->pos = r->slot = kv->length[ids[s]];
        r->n_prefix = r->slot + 1;
        fill_outputs(m, out, s, s, r);
    }
    if ((st = run_rows(m, kv, rows, n_streams, 0, out)) != KDT_OK) goto done;
    for (int32_t s = 0; s < n_streams; s++) kv->length[ids[s]] = kv->written[ids[s]] = need[s];
done:
    free(ids);
    free(rows);
    return st;
}

/* Checks one stream of a tree against the layout contract; P is the stream's length. */
static kdt_status check_tree_stream(const kdt_model *m, const kdt_tree *t, int32_t s, int32_t P) {
    return kdt_check_tree_stream("kdt_model_verify", &m->cfg, t, s, P, NULL);
}

kdt_status kdt_model_verify(const kdt_model *m, kdt_kv_cache *kv, const kdt_tree *tree, const int32_t *stream_ids,
                            const kdt_model_outputs *out) {
    static const char fn[] = "kdt_model_verify";
    kdt_status st = check_common(fn, m, kv, out);
    if (st != KDT_OK) return st;
    KDT_CHECK_ARG(tree, "%s: tree is NULL", fn);
    const int32_t S = tree->n_streams, N = tree->max_nodes;
    KDT_CHECK_ARG(S >= 1 && S <= kv->max_streams, "%s: n_streams = %d (1..%d)", fn, S, kv->max_streams);
    KDT_CHECK_ARG(N >= 1 && N <= KDT_MAX_NODES, "%s: max_nodes = %d (1..%d)", fn, N, KDT_MAX_NODES);
    KDT_CHECK_ARG(tree->n_nodes && tree->token && tree->parent && tree->depth && tree->position && tree->anc_mask,
                  "%s: a tree array (n_nodes, token, parent, depth, position, anc_mask) is NULL", fn);
    const int32_t W = KDT_MASK_WORDS(N);
    int32_t *ids = malloc((size_t)S * 2 * sizeof(int32_t));
    row_desc *rows = NULL;
    if (!ids) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", fn);
        goto done;
    }
    int32_t *need = ids + S;
    int64_t n_rows = 0;
    if ((st = kdt_resolve_stream_ids(fn, stream_ids, S, kv->max_streams, ids)) != KDT_OK) goto done;
    for (int32_t s = 0; s < S; s++) {
        const int32_t id = ids[s];
        if ((st = check_tree_stream(m, tree, s, kv->length[id])) != KDT_OK) goto done;
        need[s] = kv->length[id] + tree->n_nodes[s];
        n_rows += tree->n_nodes[s];
    }
    if ((st = kdt_kv_reserve_many(kv, S, ids, need)) != KDT_OK) goto done;
    rows = malloc((size_t)n_rows * sizeof *rows);
    if (!rows) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: %lld rows", fn, (long long)n_rows);
        goto done;
    }
    int64_t k = 0;
    for (int32_t s = 0; s < S; s++) {
        const int32_t P = kv->length[ids[s]];
        for (int32_t i = 0; i < tree->n_nodes[s]; i++, k++) {
            const int64_t idx = (int64_t)s * N + i;
            row_desc *r = &rows[k];
            memset(r, 0, sizeof *r);
            r->stream = ids[s];
            r->token = tree->token[idx];
            r->pos = tree->position[idx];
            r->slot = P + i;
            r->n_prefix = P;
            r->tail_mask = tree->anc_mask + idx * W;
            r->tail_n = tree->n_nodes[s];
            fill_outputs(m, out, idx, idx, r);
        }
    }
    if ((st = run_rows(m, kv, rows, n_rows, 0, out)) != KDT_OK) goto done;
    for (int32_t s = 0; s < S; s++) kv->written[ids[s]] = need[s];
done:
    free(ids);
    free(rows);
    return st;
}
