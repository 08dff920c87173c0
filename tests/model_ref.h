/* model_ref.h - an fp64 reference forward of the DeepSeek-V3 family, written apart from
 * src/model so that it can judge it: the plain (non-absorbed) MLA form, transformers' RoPE
 * convention (de-interleave, then rotate_half) and YaRN tables computed here from the config, not
 * the model's own tables. Header-only (static functions).
 *
 * Users: tests/test_model_forward.c compares the CPU forward's logits and taps with it;
 * tests/gpu/test_model_gpu.c takes only each row's routing margin from it (below).
 *
 * Routing margin: a bf16 KV cache moves router scores by ~1e-4, so where two experts (or two
 * groups) are closer than that, CPU and GPU may route a token differently, legitimately. A row's
 * margin in a MoE layer is the gap between the k-th and (k+1)-th biased score among the allowed
 * experts, and between the last kept and the first dropped group. A different choice at (row t,
 * layer l) changes row t, and later rows only from layer l + 1 on (through t's KV rows), so a row
 * is "excused" when its own margin is below MREF_ROUTE_MARGIN in some layer, or it follows such a
 * row whose near tie sits in a layer before the last. */
#ifndef KDT_TEST_MODEL_REF_H
#define KDT_TEST_MODEL_REF_H

#include "t.h"

#include "fp.h"
#include "kdtree/model.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MREF_ROUTE_MARGIN 2e-3

/* element (r, c); plain f32 / bf16 read directly (the Kimi-size checkpoints make this the loop
 * that counts), any other format through kdt_weight_at */
static double mref_w(const kdt_weight *w, int64_t r, int64_t c) {
    const int64_t i = r * w->cols + c;
    if (w->format == KDT_WF_PLAIN && w->dtype == KDT_W_F32) return ((const float *)w->data)[i];
    if (w->format == KDT_WF_PLAIN && w->dtype == KDT_W_BF16) return kdt_bf16_to_f32(((const uint16_t *)w->data)[i]);
    return kdt_weight_at(w, i);
}

static void mref_matvec(const kdt_weight *w, const double *x, double *y) {
    for (int64_t r = 0; r < w->rows; r++) {
        double a = 0;
        for (int64_t c = 0; c < w->cols; c++) a += mref_w(w, r, c) * x[c];
        y[r] = a;
    }
}

static void mref_rmsnorm(const double *x, const kdt_weight *w, double eps, int n, double *out) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = kdt_weight_at(w, i) * x[i] * inv;
}

static double mref_mscale(double f, double m) { return f <= 1 ? 1.0 : 0.1 * m * log(f) + 1.0; }

/* v[0, dr) rotated for position pos; the output is in transformers' (de-interleaved) order */
static void mref_rope(const kdt_model_config *c, double *v, int pos) {
    const int dr = c->qk_rope_head_dim, half = dr / 2;
    double tmp[256];
    for (int i = 0; i < half; i++) {
        tmp[i] = c->rope_interleave ? v[2 * i] : v[i];
        tmp[i + half] = c->rope_interleave ? v[2 * i + 1] : v[i + half];
    }
    double af = 1.0;
    if (c->rope_kind == KDT_ROPE_YARN)
        af = (c->rope_mscale && c->rope_mscale_all_dim)
                 ? mref_mscale(c->rope_factor, c->rope_mscale) / mref_mscale(c->rope_factor, c->rope_mscale_all_dim)
                 : mref_mscale(c->rope_factor, 1.0);
    for (int i = 0; i < half; i++) {
        double inv = pow(c->rope_theta, -2.0 * i / dr);
        if (c->rope_kind == KDT_ROPE_YARN) {
            const double om = c->rope_original_max_position;
            double lo = floor(dr * log(om / (c->rope_beta_fast * 2 * M_PI)) / (2 * log(c->rope_theta)));
            double hi = ceil(dr * log(om / (c->rope_beta_slow * 2 * M_PI)) / (2 * log(c->rope_theta)));
            lo = lo < 0 ? 0 : lo;
            hi = hi > dr - 1 ? dr - 1 : hi;
            if (lo == hi) hi += 0.001;
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            inv = inv / c->rope_factor * ramp + inv * (1 - ramp);
        }
        const double cs = cos(pos * inv) * af, sn = sin(pos * inv) * af;
        const double a = tmp[i], b = tmp[i + half];
        v[i] = a * cs - b * sn;
        v[i + half] = b * cs + a * sn;
    }
}

static void mref_swiglu(const kdt_expert_weights *e, const double *x, double *out) {
    const int64_t I = e->gate.rows;
    double *g = xmalloc((size_t)I * sizeof *g), *u = xmalloc((size_t)I * sizeof *u);
    mref_matvec(&e->gate, x, g);
    mref_matvec(&e->up, x, u);
    for (int64_t i = 0; i < I; i++) g[i] = g[i] / (1 + exp(-g[i])) * u[i];
    mref_matvec(&e->down, g, out);
    free(g);
    free(u);
}

/* One row's MoE output (sigmoid noaux_tc routing); returns its routing margin */
static double mref_moe(const kdt_model *m, const kdt_layer_weights *L, const double *x, double *out) {
    const kdt_model_config *c = &m->cfg;
    const int E = c->n_routed_experts, D = c->hidden_size, K = c->n_experts_per_tok;
    const int G = c->n_group > 1 ? c->n_group : 1, per = E / G;
    double *s = xmalloc((size_t)E * sizeof *s), *key = xmalloc((size_t)E * sizeof *key), gs[64];
    int *ok = xmalloc((size_t)E * sizeof *ok), sel[64], kept[64] = {0};
    double margin = INFINITY;
    mref_matvec(&L->router, x, s);
    for (int e = 0; e < E; e++) {
        s[e] = 1 / (1 + exp(-s[e]));
        key[e] = s[e] + kdt_weight_at(&L->router_bias, e);
        ok[e] = 1;
    }
    if (G > 1) { /* a group's score: the sum of its top two keys; keep the best topk_group */
        for (int g = 0; g < G; g++) {
            double t1 = -INFINITY, t2 = -INFINITY;
            for (int i = 0; i < per; i++) {
                const double v = key[g * per + i];
                if (v > t1) t2 = t1, t1 = v;
                else if (v > t2) t2 = v;
            }
            gs[g] = t1 + t2;
        }
        double last_kept = INFINITY;
        for (int t = 0; t < c->topk_group; t++) {
            int b = -1;
            for (int g = 0; g < G; g++)
                if (!kept[g] && (b < 0 || gs[g] > gs[b])) b = g;
            kept[b] = 1;
            last_kept = gs[b];
        }
        for (int g = 0; g < G; g++)
            if (!kept[g] && last_kept - gs[g] < margin) margin = last_kept - gs[g];
        for (int e = 0; e < E; e++) ok[e] = kept[e / per];
    }
    double sum = 0, last = INFINITY;
    for (int k = 0; k < K; k++) { /* selection by the biased key, weights from the unbiased score */
        int b = -1;
        for (int e = 0; e < E; e++)
            if (ok[e] && (b < 0 || key[e] > key[b])) b = e;
        ok[b] = 0;
        sel[k] = b;
        sum += s[b];
        last = key[b];
    }
    for (int e = 0; e < E; e++)
        if (ok[e] && last - key[e] < margin) margin = last - key[e];
    double *tmp = xmalloc((size_t)D * sizeof *tmp);
    for (int d = 0; d < D; d++) out[d] = 0;
    for (int k = 0; k < K; k++) {
        const double wk = (c->norm_topk_prob ? s[sel[k]] / sum : s[sel[k]]) * c->routed_scaling_factor;
        mref_swiglu(&L->experts[sel[k]], x, tmp);
        for (int d = 0; d < D; d++) out[d] += wk * tmp[d];
    }
    if (c->n_shared_experts) {
        mref_swiglu(&L->shared, x, tmp);
        for (int d = 0; d < D; d++) out[d] += tmp[d];
    }
    free(tmp);
    free(s);
    free(key);
    free(ok);
    return margin;
}

/* The forward of toks[0, n) as one causal sequence from position 0. Each output may be NULL:
 * logits [n][V]; taps [n][n_layers][D] (every decoder layer's output, residual included);
 * excused [n] (see the top). Returns the number of excused rows. */
static int mref_forward(const kdt_model *m, const int32_t *toks, int n, double *logits, double *taps,
                        uint8_t *excused) {
    const kdt_model_config *c = &m->cfg;
    const int D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
              dv = c->v_head_dim, dc = c->kv_lora_rank, dqk = dn + dr, ql = c->q_lora_rank;
    double scale = 1 / sqrt((double)dqk);
    if (c->rope_kind == KDT_ROPE_YARN && c->rope_mscale_all_dim)
        scale *= pow(mref_mscale(c->rope_factor, c->rope_mscale_all_dim), 2);
    double *x = xmalloc((size_t)n * D * sizeof *x), *xn = xmalloc((size_t)D * sizeof *xn);
    double *q = xmalloc((size_t)n * H * dqk * sizeof *q), *k = xmalloc((size_t)n * H * dqk * sizeof *k);
    double *v = xmalloc((size_t)n * H * dv * sizeof *v), *kva = xmalloc((size_t)(dc + dr) * sizeof *kva);
    double *cn = xmalloc((size_t)dc * sizeof *cn), *qa = xmalloc((size_t)(ql + 1) * sizeof *qa);
    double *kvb = xmalloc((size_t)H * (dn + dv) * sizeof *kvb), *att = xmalloc((size_t)H * dv * sizeof *att);
    double *o = xmalloc((size_t)D * sizeof *o), *p = xmalloc((size_t)n * sizeof *p);
    uint8_t *own = calloc((size_t)n, 1);
    int early = n; /* the first row with a near tie in a layer before the last */
    for (int t = 0; t < n; t++)
        for (int d = 0; d < D; d++) x[(size_t)t * D + d] = mref_w(&m->embed, toks[t], d);
    for (int l = 0; l < c->n_layers; l++) {
        const kdt_layer_weights *L = &m->layers[l];
        for (int t = 0; t < n; t++) { /* q, and the plain k and v of every head */
            mref_rmsnorm(x + (size_t)t * D, &L->input_norm, c->rms_norm_eps, D, xn);
            double *qt = q + (size_t)t * H * dqk;
            if (ql) {
                mref_matvec(&L->q_a, xn, qa);
                mref_rmsnorm(qa, &L->q_a_norm, 1e-6, ql, qa);
                mref_matvec(&L->q_b, qa, qt);
            } else {
                mref_matvec(&L->q_proj, xn, qt);
            }
            mref_matvec(&L->kv_a, xn, kva);
            mref_rmsnorm(kva, &L->kv_a_norm, 1e-6, dc, cn);
            mref_matvec(&L->kv_b, cn, kvb);
            mref_rope(c, kva + dc, t);
            for (int h = 0; h < H; h++) {
                mref_rope(c, qt + h * dqk + dn, t);
                double *kt = k + ((size_t)t * H + h) * dqk;
                for (int i = 0; i < dn; i++) kt[i] = kvb[h * (dn + dv) + i];
                for (int i = 0; i < dr; i++) kt[dn + i] = kva[dc + i];
                for (int i = 0; i < dv; i++) v[((size_t)t * H + h) * dv + i] = kvb[h * (dn + dv) + dn + i];
            }
        }
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < H; h++) {
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= t; j++) {
                    double a = 0;
                    for (int i = 0; i < dqk; i++) a += q[((size_t)t * H + h) * dqk + i] * k[((size_t)j * H + h) * dqk + i];
                    p[j] = a * scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int j = 0; j <= t; j++) sum += (p[j] = exp(p[j] - mx));
                for (int i = 0; i < dv; i++) {
                    double a = 0;
                    for (int j = 0; j <= t; j++) a += p[j] / sum * v[((size_t)j * H + h) * dv + i];
                    att[h * dv + i] = a;
                }
            }
            mref_matvec(&L->o_proj, att, o);
            double *xt = x + (size_t)t * D;
            for (int d = 0; d < D; d++) xt[d] += o[d];
            mref_rmsnorm(xt, &L->post_norm, c->rms_norm_eps, D, xn);
            if (L->is_moe) {
                if (mref_moe(m, L, xn, o) < MREF_ROUTE_MARGIN) {
                    own[t] = 1;
                    if (l < c->n_layers - 1 && t < early) early = t;
                }
            } else {
                mref_swiglu(&L->dense, xn, o);
            }
            for (int d = 0; d < D; d++) xt[d] += o[d];
            if (taps) memcpy(taps + ((size_t)t * c->n_layers + l) * D, xt, (size_t)D * sizeof *xt);
        }
    }
    if (logits)
        for (int t = 0; t < n; t++) {
            mref_rmsnorm(x + (size_t)t * D, &m->final_norm, c->rms_norm_eps, D, xn);
            mref_matvec(&m->lm_head, xn, logits + (size_t)t * c->vocab_size);
        }
    int n_excused = 0;
    for (int t = 0; t < n; t++) {
        const int ex = own[t] || t >= early;
        if (excused) excused[t] = (uint8_t)ex;
        n_excused += ex;
    }
    free(x); free(xn); free(q); free(k); free(v); free(kva); free(cn); free(qa); free(kvb); free(att);
    free(o); free(p); free(own);
    return n_excused;
}

#endif
