/* gpu_forward.c - the GPU forward pass: the runner (scratch, stream, staging, outputs), staging of
 * prefill / decode / verify batches, the kernel sequence of one pass (kdt_gpu_run), CUDA graphs,
 * the synchronous host API, KV commit and the benchmark helpers.
 *
 * A pass is a list of rows (query tokens) described on the host (kdt_grow: token, position, cache
 * slot, visible keys, output indices) and copied to the device with one cudaMemcpyAsync from
 * pinned staging. kdt_gpu_run then only enqueues kernels that read the row count and the row
 * descriptions from device memory, so it never syncs, allocates or copies: a captured graph
 * serves every later batch that fits its max_rows.
 *
 * Per layer (R rows; partials = split-K partial sums, finished by the next kernel):
 *   xn = RMSNorm(x)                          k_rmsnorm
 *   [q_a | kv_a] xn                          GEMM -> post_a: qa = RMSNorm(q_a xn); cache row =
 *                                            [RMSNorm(c_kv) | RoPE(k_pe)] (bf16)
 *   q = q_b qa                               GEMM -> post_q: q_nope, RoPE(q_pe) -> q_abs[.., d_c:]
 *   q_lat = W_UK^T q_nope (per head)         GEMM -> sum -> q_abs[.., :d_c]
 *   o_lat = attention over the cache         attention partials -> combine
 *   o = W_UV o_lat (per head)                GEMM -> sum -> heads
 *   x += o_proj heads; xn = RMSNorm(x)       GEMM -> post_o
 *   dense: x += down(silu(gate xn) * up xn)  GEMM -> SwiGLU -> GEMM -> residual
 *   MoE: router GEMM -> route -> plan -> grouped gate/up -> SwiGLU -> grouped down -> combine,
 *        the shared expert meanwhile on a second stream as a dense MLP (shared_apart)
 *   taps
 * then for the rows that want outputs: RMSNorm -> lm_head with the fused argmax (+ logits). */
#include "attn_plan.h"
#include "gpu_internal.h"
#include "kernels/cuda/device_limits.h"

#include "model/model_internal.h"

#include <stdlib.h>
#include <string.h>

#define LOG2E 1.4426950408889634f

static kdt_status cuda_fail(cudaError_t e, const char *what) {
    return kdt_fail(KDT_ERR_CUDA, "%s: %s", what, cudaGetErrorString(e));
}


/* max(cur, the floats of w's split-K partials for R rows: splits x R x N x batch; none without w) */
static size_t max_partials(size_t cur, const kdt_gmat *w, int32_t R) {
    if (!w->w) return cur;
    int32_t splits, chunk;
    kdt_gemm_plan(w->rows, w->ld, w->batch, &splits, &chunk);
    const size_t need = (size_t)splits * R * (size_t)w->rows * (size_t)w->batch;
    return need > cur ? need : cur;
}

static kdt_status ralloc(kdt_gpu_runner *r, void **p, size_t bytes, const char *what) {
    *p = NULL;
    if (bytes == 0) return KDT_OK;
    if (r->n_allocs == r->cap_allocs) {
        int32_t cap = r->cap_allocs ? 2 * r->cap_allocs : 64;
        void **a = realloc(r->allocs, (size_t)cap * sizeof *a);
        if (!a) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU runner: allocation list");
        r->allocs = a;
        r->cap_allocs = cap;
    }
    const cudaError_t e = cudaMalloc(p, bytes);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU runner: %s: %zu MB: %s", what, bytes >> 20, cudaGetErrorString(e));
    r->allocs[r->n_allocs++] = *p;
    return KDT_OK;
}

static size_t align16(size_t v) { return (v + 15) & ~(size_t)15; }

/* The most attention splits a row with up to max_keys keys can have (n_splits is not monotone:
 * at most 32 up to 16384 keys, then ceil(n / KDT_G_ATT_SPLIT) up to 64 * KDT_G_ATT_SPLIT keys,
 * where the split grows instead). */
static int32_t max_row_splits(int32_t max_keys) {
    /* the split size steps up at KDT_G_ATT_SHORT_KEYS, so the most splits may come below it (the
     * 32 of 4096 keys bound every row up to 16384 keys) */
    const int32_t short_max = kdt_attn_n_splits(max_keys < KDT_G_ATT_SHORT_KEYS ? max_keys : KDT_G_ATT_SHORT_KEYS);
    const int32_t long_max = max_keys > 64 * KDT_G_ATT_SPLIT ? KDT_G_ATT_MAX_SPLITS : kdt_attn_n_splits(max_keys);
    return short_max > long_max ? short_max : long_max;
}

int32_t kdt_gpu_gemm_stages(const kdt_gpu_model *g) {
    int per_sm = 0;
    kdt_smem_per_sm(g->device, &per_sm);
    return kdt_gemm_stages_for(per_sm, (int)g->smem_optin);
}

static int hg64_supported(const kdt_gpu_model *g) {
    const size_t b = kdt_attn_smem_bytes(64, g->cfg.kv_lora_rank, g->cfg.kv_lora_rank + g->cfg.qk_rope_head_dim);
    return b > 0 && b <= g->smem_optin;
}

void kdt_gpu_runner_free(kdt_gpu_runner *r) {
    if (!r) return;
    if (r->stream) cudaStreamSynchronize(r->stream);
    for (int32_t i = 0; i < r->n_allocs; i++) cudaFree(r->allocs[i]);
    free(r->allocs);
    free(r->plain_segs);
    free(r->win_row);
    for (int i = 0; i < 2; i++) {
        if (r->h_stage[i]) cudaFreeHost(r->h_stage[i]);
        if (r->stage_done[i]) cudaEventDestroy(r->stage_done[i]);
    }
    if (r->commit_buf) cudaFree(r->commit_buf);
    if (r->flush_buf) cudaFree(r->flush_buf);
    if (r->side) {
        cudaStreamSynchronize(r->side);
        cudaStreamDestroy(r->side);
    }
    if (r->ev_fork) cudaEventDestroy(r->ev_fork);
    if (r->ev_join) cudaEventDestroy(r->ev_join);
    if (r->own_stream && r->stream) cudaStreamDestroy(r->stream);
    free(r);
}

/* The plain prefill form's scratch and instance (gpu_plain.cu) for a runner asking for plain or
 * auto: per-head K [cap][d_n + d_r, padded to 16] and V [cap][d_v, padded to a power of two] as
 * bf16 hi / lo planes, cap = min(max_keys, KDT_GPU_PLAIN_MAX_KEYS) rounded up to 64 (tests may
 * lower the bound with KDT_GPU_PLAIN_BLOCK_KEYS, a multiple of 64); where max_keys is larger, a
 * chunk runs in blocks of cap keys with each row's softmax state kept between them, [max_rows][H]
 * [dv_p + 8] floats (71 MB for Kimi at 2,048 rows). Dimensions without an instance: plain is
 * refused, auto keeps the absorbed form. */
static kdt_status plain_setup(kdt_gpu_runner *r) {
    const kdt_gpu_model *g = r->g;
    const kdt_model_config *c = &g->cfg;
    const int32_t dqk_p = (int32_t)kdt_g_round_up(c->qk_nope_head_dim + c->qk_rope_head_dim, 16);
    const int32_t dv_p = kdt_ap_plain_dv_pad(c->v_head_dim);
    int32_t stages = kdt_g_env_is("KDT_GPU_PLAIN_STAGES", '1') ? 1 : 2; /* 1: the small-smem path (tests) */
    while (stages >= 1 && (kdt_ap_plain_smem(dqk_p, dv_p, stages) == 0 ||
                           kdt_ap_plain_smem(dqk_p, dv_p, stages) > g->smem_optin))
        stages--;
    if (dv_p == 0 || stages == 0) {
        if (r->opt.prefill_attention == KDT_PREFILL_PLAIN)
            return kdt_fail(KDT_ERR_UNSUPPORTED,
                            "kdt_gpu_runner_create: plain prefill attention has no kernel for d_n + d_r = %d, d_v = %d "
                            "on this device (at most 256 each, within %zu bytes of shared memory)",
                            c->qk_nope_head_dim + c->qk_rope_head_dim, c->v_head_dim, g->smem_optin);
        r->opt.prefill_attention = KDT_PREFILL_ABSORBED;
        return KDT_OK;
    }
    int32_t bound = KDT_GPU_PLAIN_MAX_KEYS;
    const char *bk = getenv("KDT_GPU_PLAIN_BLOCK_KEYS"); /* tests: blocks on small models */
    if (bk && atoi(bk) >= 64 && atoi(bk) % 64 == 0 && atoi(bk) < bound) bound = atoi(bk);
    const int32_t keys = r->opt.max_keys < bound ? r->opt.max_keys : bound;
    r->plain_cap = (int32_t)kdt_g_round_up(keys, 64);
    r->plain_dqk = dqk_p;
    r->plain_dv = dv_p;
    r->plain_stages = stages;
    /* the wgmma attention where the device runs it (mma.sync's bits; session 49's racecheck was
     * clean); KDT_GPU_PLAIN_WG=0 keeps the mma.sync kernel */
    const size_t wg_smem = kdt_ap_plain_wg_smem(dqk_p, dv_p);
    r->plain_wg = !kdt_g_env_is("KDT_GPU_PLAIN_WG", '0') && wg_smem > 0 && wg_smem <= g->smem_optin &&
                  kdt_plain_wg_device();
    KDT_TRY(kdt_plain_init(dqk_p, dv_p, stages, r->plain_wg));
    const size_t n = (size_t)c->n_heads * r->plain_cap;
    KDT_TRY(ralloc(r, (void **)&r->plain_k, 2 * n * dqk_p * 2, "plain prefill keys"));
    KDT_TRY(ralloc(r, (void **)&r->plain_v, 2 * n * dv_p * 2, "plain prefill values"));
    if (r->opt.max_keys <= r->plain_cap) return KDT_OK;
    return ralloc(r, (void **)&r->plain_state, (size_t)r->opt.max_rows * c->n_heads * (dv_p + 8) * sizeof(float),
                  "plain prefill softmax states");
}

kdt_status kdt_gpu_runner_create(const kdt_gpu_model *g, const kdt_gpu_runner_options *opt, kdt_gpu_runner **out) {
    KDT_CHECK_ARG(out, "kdt_gpu_runner_create: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(g && opt, "kdt_gpu_runner_create: model or options is NULL");
    const kdt_model_config *c = &g->cfg;
    kdt_gpu_runner_options o = *opt;
    if (o.max_keys == 0) o.max_keys = c->max_position_embeddings;
    if (o.max_nodes == 0) o.max_nodes = 64;
    KDT_CHECK_ARG(o.max_rows >= 1 && o.max_rows <= (1 << 16), "kdt_gpu_runner_create: max_rows = %d (1..65536)",
                  o.max_rows);
    KDT_CHECK_ARG(o.max_keys >= 1 && o.max_keys <= (1 << 28), "kdt_gpu_runner_create: max_keys = %d", o.max_keys);
    KDT_CHECK_ARG(o.max_nodes >= 1 && o.max_nodes <= KDT_MAX_NODES, "kdt_gpu_runner_create: max_nodes = %d (1..%d)",
                  o.max_nodes, KDT_MAX_NODES);
    KDT_CHECK_ARG(o.max_taps >= 0 && o.max_taps <= KDT_MODEL_MAX_TAPS, "kdt_gpu_runner_create: max_taps = %d (0..%d)",
                  o.max_taps, KDT_MODEL_MAX_TAPS);
    KDT_CHECK_ARG(o.logits == 0 || o.logits == 1, "kdt_gpu_runner_create: logits = %d (0 or 1)", o.logits);
    KDT_CHECK_ARG(o.attn_heads_per_item == 0 || o.attn_heads_per_item == 16 || o.attn_heads_per_item == 64,
                  "kdt_gpu_runner_create: attn_heads_per_item = %d (0, 16 or 64)", o.attn_heads_per_item);
    KDT_CHECK_ARG(o.prefill_attention >= KDT_PREFILL_ABSORBED && o.prefill_attention <= KDT_PREFILL_AUTO,
                  "kdt_gpu_runner_create: prefill_attention = %d (0 absorbed, 1 plain, 2 auto)", o.prefill_attention);
    KDT_CHECK_ARG(o.max_tree_rows >= 0 && o.max_tree_rows <= o.max_rows,
                  "kdt_gpu_runner_create: max_tree_rows = %d (0 = max_nodes, or up to max_rows %d)", o.max_tree_rows,
                  o.max_rows);
    KDT_CHECK_ARG(o.attn_workspace_kb >= 0, "kdt_gpu_runner_create: attn_workspace_kb = %d (0 = 512 MiB)",
                  o.attn_workspace_kb);
    if (o.attn_heads_per_item == 64 && !hg64_supported(g))
        return kdt_fail(KDT_ERR_UNSUPPORTED,
                        "kdt_gpu_runner_create: 64 heads per attention item do not fit this device's shared memory "
                        "with kv_lora_rank %d", c->kv_lora_rank);
    cudaError_t e = cudaSetDevice(g->device);
    if (e != cudaSuccess) return cuda_fail(e, "kdt_gpu_runner_create");
    kdt_gpu_runner *r = calloc(1, sizeof *r);
    if (!r) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_runner_create");
    r->g = g;
    r->opt = o;
    kdt_status st = KDT_OK;
    const int32_t R = o.max_rows, D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim,
                  dr = c->qk_rope_head_dim, dv = c->v_head_dim, dc = c->kv_lora_rank, dq = dc + dr,
                  ql = c->q_lora_rank, E = c->n_routed_experts, K = c->n_experts_per_tok, V = c->vocab_size;
    const int32_t stages = kdt_gpu_gemm_stages(g);
    if (o.stream) {
        r->stream = (cudaStream_t)o.stream;
    } else {
        if ((e = cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking)) != cudaSuccess) {
            free(r);
            return cuda_fail(e, "kdt_gpu_runner_create: stream");
        }
        r->own_stream = 1;
    }
#define STEP(x)                           \
    do {                                  \
        if (st == KDT_OK) st = (x);       \
    } while (0)
    STEP(kdt_gemm_init(stages));
    STEP(kdt_attn_init(16, dc, dq));
    if (hg64_supported(g)) STEP(kdt_attn_init(64, dc, dq));

    /* the attention's split partials: what a device-staged pass needs in one launch, else what
     * the pass's rows could need, up to the workspace budget (host-staged passes past it run in
     * windows: stage_end) */
    const int32_t row_splits = max_row_splits(o.max_keys);
    r->tree_rows = o.max_tree_rows > 0 ? o.max_tree_rows : (o.max_nodes < R ? o.max_nodes : R);
    {
        const int64_t split_bytes = (int64_t)H * (dc + 2) * (int64_t)sizeof(float);
        const int64_t budget = (o.attn_workspace_kb > 0 ? (int64_t)o.attn_workspace_kb : 524288) * 1024 / split_bytes;
        const long long cap = kdt_ap_partial_slots(R, row_splits, r->tree_rows, budget);
        r->max_splits_total = (int32_t)cap; /* <= 2^16 rows x 64 splits */
        r->max_windows = (int32_t)kdt_ap_max_windows(R, row_splits, cap);
    }
    const size_t mw = (size_t)r->max_windows;
    r->win_row = malloc((4 * mw + 2 + (size_t)R) * sizeof(int));
    if (!r->win_row) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_runner_create: attention windows");
    } else {
        r->win_splits = r->win_row + mw + 1;
        r->cut_row = r->win_splits + mw;
        r->cut_splits = r->cut_row + mw + 1;
        r->row_splits = r->cut_splits + mw;
        r->win_row[0] = r->win_row[1] = 0;
    }
    r->n_windows = 1;

    /* staging layout: header | rows | head rows | block-table updates | tree streams | attention
     * window headers | mask rows */
    r->mask_words_max = KDT_MASK_WORDS(o.max_nodes);
    const int32_t cap_updates = 4 * R + 1024;
    r->cap_updates = cap_updates;
    r->stages = stages;
    r->off_rows = align16(sizeof(kdt_gstage_hdr));
    r->off_head = align16(r->off_rows + (size_t)R * sizeof(kdt_grow));
    r->off_updates = align16(r->off_head + (size_t)R * sizeof(int32_t));
    r->off_streams = align16(r->off_updates + (size_t)cap_updates * 2 * sizeof(int32_t));
    r->off_windows = align16(r->off_streams + (size_t)KDT_GPU_TREE_STREAMS * 3 * sizeof(int32_t));
    r->off_masks = align16(r->off_windows + (size_t)r->max_windows * sizeof(kdt_gstage_hdr));
    r->stage_bytes = align16(r->off_masks + (size_t)R * r->mask_words_max * sizeof(uint64_t));
    for (int i = 0; i < 2 && st == KDT_OK; i++) {
        if ((e = cudaHostAlloc((void **)&r->h_stage[i], r->stage_bytes, cudaHostAllocDefault)) != cudaSuccess ||
            (e = cudaEventCreateWithFlags(&r->stage_done[i], cudaEventDisableTiming)) != cudaSuccess ||
            (e = cudaEventRecord(r->stage_done[i], r->stream)) != cudaSuccess)
            st = cuda_fail(e, "kdt_gpu_runner_create: staging");
        else memset(r->h_stage[i], 0, r->stage_bytes);
    }
    STEP(ralloc(r, (void **)&r->d_stage, r->stage_bytes, "staging"));
    if (st == KDT_OK && (e = cudaMemset(r->d_stage, 0, r->stage_bytes)) != cudaSuccess) st = cuda_fail(e, "staging");

    /* split-K partial buffer: the largest splits x rows x N over the dense GEMMs */
    size_t part = 0;
    for (int32_t l = 0; l < c->n_layers; l++) {
        const kdt_gpu_layer *L = &g->layers[l];
        const kdt_gmat *mats[] = {&L->w_a, &L->q_b, &L->uk_t, &L->uv, &L->o_proj, &L->router, &L->dense_gu, &L->dense_down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) part = max_partials(part, mats[i], R);
    }
    r->part_floats = part;
    const int32_t E_tot = E + g->has_shared;
    r->max_pairs = E > 0 ? R * K + (g->has_shared ? R : 0) : 0;
    r->max_items = E > 0 ? E_tot + (r->max_pairs + KDT_G_ITEM_ROWS_MIN - 1) / KDT_G_ITEM_ROWS_MIN + 1 : 0;
    r->ld_h = (int32_t)kdt_g_round_up(g->max_inter_pad, 4);
    const int32_t n_vtiles = (V + KDT_G_BN - 1) / KDT_G_BN;
    const size_t f = sizeof(float);
    STEP(ralloc(r, (void **)&r->x, (size_t)R * D * f, "x"));
    STEP(ralloc(r, (void **)&r->xn, (size_t)R * D * f, "xn"));
    if (ql > 0) STEP(ralloc(r, (void **)&r->qa, (size_t)R * ql * f, "qa"));
    STEP(ralloc(r, (void **)&r->q_nope, (size_t)R * H * dn * f, "q_nope"));
    STEP(ralloc(r, (void **)&r->q_abs, (size_t)R * H * dq * f, "q_abs"));
    STEP(ralloc(r, (void **)&r->o_lat, (size_t)R * H * dc * f, "o_lat"));
    STEP(ralloc(r, (void **)&r->heads, (size_t)R * H * dv * f, "heads"));
    STEP(ralloc(r, (void **)&r->part, part * f, "split-K partials"));
    if (kdt_gemm_wg_ss_on()) {
        /* X's hi / lo planes for the wgmma GEMMs' ss forms (kdt_gemm_launch_ws, kdt_grouped_launch_ws),
         * as wide as the widest K they serve: the main stream's dense GEMMs (unbatched ones only, so
         * not W_UK / W_UV) over R rows, its MoE gate/up over R rows and down over the pairs (the
         * shared expert's included); the side stream's shared expert over R rows */
        int32_t ld_main = 0, ld_pairs = 0, ld_side = 0;
        for (int32_t l = 0; l < c->n_layers; l++) {
            const kdt_gpu_layer *L = &g->layers[l];
            const kdt_gmat *mats[] = {&L->w_a, &L->q_b, &L->o_proj, &L->router, &L->dense_gu, &L->dense_down,
                                      &L->experts_gu};
            for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
                if (mats[i]->w && mats[i]->ld > ld_main) ld_main = mats[i]->ld;
            if (L->experts_down.ld > ld_pairs) ld_pairs = L->experts_down.ld;
            if (L->shared_down.ld > ld_pairs) ld_pairs = L->shared_down.ld;
            if (L->shared_gu.ld > ld_side) ld_side = L->shared_gu.ld;
            if (L->shared_down.ld > ld_side) ld_side = L->shared_down.ld;
        }
        const int64_t pairs = r->max_pairs > 0 ? kdt_gemm_wg_ss_elems(r->max_pairs, ld_pairs) : 0;
        r->x_hl_elems = kdt_gemm_wg_ss_elems(R, ld_main);
        if (pairs > r->x_hl_elems) r->x_hl_elems = pairs;
        r->x_hl_side_elems = kdt_gemm_wg_ss_elems(R, ld_side);
        STEP(ralloc(r, (void **)&r->x_hl, (size_t)r->x_hl_elems * 2, "wgmma GEMM X planes"));
        STEP(ralloc(r, (void **)&r->x_hl_side, (size_t)r->x_hl_side_elems * 2, "wgmma GEMM X planes (side stream)"));
    }
    STEP(ralloc(r, (void **)&r->att_o, (size_t)r->max_splits_total * H * dc * f, "attention partials"));
    STEP(ralloc(r, (void **)&r->att_m, (size_t)r->max_splits_total * H * f, "attention partials"));
    STEP(ralloc(r, (void **)&r->att_l, (size_t)r->max_splits_total * H * f, "attention partials"));
    if (E > 0) {
        STEP(ralloc(r, (void **)&r->sel, (size_t)R * K * sizeof(int32_t), "MoE selection"));
        STEP(ralloc(r, (void **)&r->wgt, (size_t)R * K * f, "MoE weights"));
        STEP(ralloc(r, (void **)&r->pos_of, (size_t)R * K * sizeof(int32_t), "MoE pairs"));
        STEP(ralloc(r, (void **)&r->pos_shared, (size_t)R * sizeof(int32_t), "MoE pairs"));
        STEP(ralloc(r, (void **)&r->pair_row, (size_t)r->max_pairs * sizeof(int32_t), "MoE pairs"));
        STEP(ralloc(r, (void **)&r->pair_expert, (size_t)r->max_pairs * sizeof(int32_t), "MoE pairs"));
        STEP(ralloc(r, (void **)&r->items, (size_t)r->max_items * 3 * sizeof(int32_t), "MoE items"));
        STEP(ralloc(r, (void **)&r->moe_counts, 2 * sizeof(int32_t), "MoE counts"));
        STEP(ralloc(r, (void **)&r->expert_counts, (size_t)c->n_layers * (E + 1) * sizeof(int32_t), "expert counts"));
        STEP(ralloc(r, (void **)&r->moe_part, (size_t)r->max_pairs * 2 * g->max_inter_pad * f, "MoE partials"));
        STEP(ralloc(r, (void **)&r->moe_y, (size_t)r->max_pairs * D * f, "MoE outputs"));
        if (st == KDT_OK && (e = cudaMemset(r->expert_counts, 0, (size_t)c->n_layers * (E + 1) * 4)) != cudaSuccess)
            st = cuda_fail(e, "expert counts");
        /* the shared expert apart: its split-K partials (gate/up, then down) and SwiGLU rows */
        size_t psh = 0;
        for (int32_t l = 0; g->has_shared && l < c->n_layers; l++)
            psh = max_partials(max_partials(psh, &g->layers[l].shared_gu, R), &g->layers[l].shared_down, R);
        if (psh > 0) {
            r->part_sh_floats = psh;
            STEP(ralloc(r, (void **)&r->part_sh, psh * f, "shared expert partials"));
            STEP(ralloc(r, (void **)&r->h_sh, (size_t)R * r->ld_h * f, "shared expert hidden"));
            if (st == KDT_OK && ((e = cudaStreamCreateWithFlags(&r->side, cudaStreamNonBlocking)) != cudaSuccess ||
                                 (e = cudaEventCreateWithFlags(&r->ev_fork, cudaEventDisableTiming)) != cudaSuccess ||
                                 (e = cudaEventCreateWithFlags(&r->ev_join, cudaEventDisableTiming)) != cudaSuccess))
                st = cuda_fail(e, "kdt_gpu_runner_create: shared expert stream");
        }
    }
    STEP(ralloc(r, (void **)&r->h, (size_t)(r->max_pairs > R ? r->max_pairs : R) * r->ld_h * f, "MLP hidden"));
    STEP(ralloc(r, (void **)&r->xn_head, (size_t)R * D * f, "head rows"));
    STEP(ralloc(r, (void **)&r->am_val, (size_t)n_vtiles * R * f, "argmax partials"));
    STEP(ralloc(r, (void **)&r->am_idx, (size_t)n_vtiles * R * sizeof(int32_t), "argmax partials"));
    STEP(ralloc(r, (void **)&r->d_argmax, (size_t)R * sizeof(int32_t), "argmax"));
    if (o.logits) STEP(ralloc(r, (void **)&r->d_logits, (size_t)R * V * f, "logits"));
    if (o.max_taps) STEP(ralloc(r, (void **)&r->d_taps, (size_t)R * o.max_taps * D * f, "taps"));
    if (o.prefill_attention != KDT_PREFILL_ABSORBED && st == KDT_OK) STEP(plain_setup(r));
#undef STEP
    if (st == KDT_OK && (e = cudaDeviceSynchronize()) != cudaSuccess) st = cuda_fail(e, "kdt_gpu_runner_create");
    if (st != KDT_OK) {
        kdt_gpu_runner_free(r);
        return st;
    }
    *out = r;
    return KDT_OK;
}

void *kdt_gpu_runner_stream(kdt_gpu_runner *r) { return r ? (void *)r->stream : NULL; }

kdt_status kdt_gpu_runner_set_prefill_attention(kdt_gpu_runner *r, int32_t prefill_attention) {
    KDT_CHECK_ARG(r, "kdt_gpu_runner_set_prefill_attention: runner is NULL");
    KDT_CHECK_ARG(prefill_attention >= KDT_PREFILL_ABSORBED && prefill_attention <= KDT_PREFILL_AUTO,
                  "kdt_gpu_runner_set_prefill_attention: %d (0 absorbed, 1 plain, 2 auto)", prefill_attention);
    KDT_CHECK_ARG(prefill_attention == KDT_PREFILL_ABSORBED || r->plain_k,
                  "kdt_gpu_runner_set_prefill_attention: the runner was created with absorbed prefill attention "
                  "(no plain-form scratch)");
    r->opt.prefill_attention = prefill_attention;
    return KDT_OK;
}

kdt_status kdt_gpu_runner_sync(kdt_gpu_runner *r) {
    KDT_CHECK_ARG(r, "kdt_gpu_runner_sync: runner is NULL");
    const cudaError_t e = cudaStreamSynchronize(r->stream);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "GPU forward");
}

kdt_status kdt_gpu_runner_outputs(kdt_gpu_runner *r, kdt_gpu_outputs *out) {
    KDT_CHECK_ARG(r && out, "kdt_gpu_runner_outputs: NULL argument");
    out->argmax = r->d_argmax;
    out->logits = r->d_logits;
    out->taps = r->d_taps;
    out->max_rows = r->opt.max_rows;
    out->vocab = r->g->cfg.vocab_size;
    out->max_taps = r->opt.max_taps;
    out->hidden = r->g->cfg.hidden_size;
    return KDT_OK;
}

/* ---- staging ------------------------------------------------------------------------------- */

typedef struct stage_view {
    kdt_gstage_hdr *hdr;
    kdt_grow *rows;
    int32_t *head;
    int32_t *updates;
    uint64_t *masks;
} stage_view;

/* The host buffer the next stage fills (waits until its previous copy has left). */
static kdt_status stage_begin(kdt_gpu_runner *r, stage_view *v) {
    const int i = r->stage_idx ^ 1;
    const cudaError_t e = cudaEventSynchronize(r->stage_done[i]);
    if (e != cudaSuccess) return cuda_fail(e, "GPU staging");
    unsigned char *b = r->h_stage[i];
    v->hdr = (kdt_gstage_hdr *)b;
    v->rows = (kdt_grow *)(b + r->off_rows);
    v->head = (int32_t *)(b + r->off_head);
    v->updates = (int32_t *)(b + r->off_updates);
    v->masks = (uint64_t *)(b + r->off_masks);
    memset(v->hdr, 0, sizeof *v->hdr);
    r->staged_absorbed = 1;
    r->n_plain = 0;
    return KDT_OK;
}

/* Finishes the row list (attention windows and split offsets, head rows), takes the pending
 * block-table entries, and enqueues the copy plus the table update. The attention windows:
 * consecutive rows while their splits fit the partials (r->max_splits_total), each window's
 * split offsets from 0 and its header in the staging; a row's splits are its own (n_keys), so the
 * windows never change a bit. */
static kdt_status stage_end(kdt_gpu_runner *r, kdt_gpu_kv *c, stage_view *v, int32_t n_rows, size_t mask_words) {
    int32_t splits = 0, n_head = 0;
    for (int32_t i = 0; i < n_rows; i++) {
        splits += r->row_splits[i] = kdt_attn_n_splits(v->rows[i].n_keys);
        if (v->rows[i].out_index >= 0) v->head[n_head++] = i;
    }
    /* the runner's bounds make a refusal unreachable (check_reach bounds n_keys, max_windows the
     * count); the pass's windows become the runner's once its copy is enqueued */
    const int nw = kdt_ap_cut_windows(r->row_splits, n_rows, r->max_splits_total, r->max_windows, r->cut_row,
                                      r->cut_splits);
    if (nw < 0)
        return kdt_fail(KDT_ERR_INTERNAL, "GPU staging: the rows' attention splits do not fit the workspace (%d "
                        "splits, %d windows)", r->max_splits_total, r->max_windows);
    kdt_gstage_hdr *wh = (kdt_gstage_hdr *)((unsigned char *)v->hdr + r->off_windows);
    for (int k = 0; k < nw; k++) {
        memset(&wh[k], 0, sizeof wh[k]);
        wh[k].n_rows = r->cut_row[k + 1] - r->cut_row[k];
        wh[k].total_splits = r->cut_splits[k];
    }
    for (int32_t i = 0; i < n_rows; i++) v->rows[i].split_off = r->row_splits[i];
    v->hdr->n_rows = n_rows;
    v->hdr->n_head = n_head;
    v->hdr->total_splits = splits;
    if (c->n_pending > r->cap_updates) { /* rare: a large reservation outside a pass */
        cudaError_t e = cudaStreamSynchronize(r->stream);
        if (e != cudaSuccess) return cuda_fail(e, "GPU staging");
        KDT_TRY(kdt_gkv_flush_pending_sync(c));
    }
    const int32_t nu = (int32_t)c->n_pending;
    memcpy(v->updates, c->pending, (size_t)nu * 2 * sizeof(int32_t));
    c->n_pending = 0;
    v->hdr->n_updates = nu;
    const size_t bytes = r->off_masks + mask_words * sizeof(uint64_t);
    const int i = r->stage_idx ^ 1;
    cudaError_t e = cudaMemcpyAsync(r->d_stage, r->h_stage[i], bytes, cudaMemcpyHostToDevice, r->stream);
    if (e == cudaSuccess) e = cudaEventRecord(r->stage_done[i], r->stream);
    if (e != cudaSuccess) return cuda_fail(e, "GPU staging copy");
    r->stage_idx = i;
    r->staged_rows = n_rows;
    r->n_windows = nw;
    memcpy(r->win_row, r->cut_row, ((size_t)nw + 1) * sizeof(int));
    memcpy(r->win_splits, r->cut_splits, (size_t)nw * sizeof(int));
    r->dtree_pending = 0;
    if (nu > 0)
        KDT_TRY(kdt_op_scatter(c->d_block_table, (const int32_t *)(r->d_stage + r->off_updates),
                           (const kdt_gstage_hdr *)r->d_stage, nu, r->stream));
    return KDT_OK;
}

static kdt_status check_kv(const char *fn, const kdt_gpu_runner *r, const kdt_gpu_kv *c) {
    KDT_CHECK_ARG(r && c, "%s: runner or cache is NULL", fn);
    const kdt_model_config *m = &r->g->cfg;
    KDT_CHECK_ARG(c->n_layers == m->n_layers && c->row_elems == m->kv_lora_rank + m->qk_rope_head_dim,
                  "%s: the KV cache was made for another model", fn);
    return KDT_OK;
}

static kdt_status check_token(const char *fn, const kdt_gpu_runner *r, int32_t tok, const char *what, int64_t i) {
    return kdt_check_token(fn, &r->g->cfg, tok, what, i);
}

/* Positions beyond the RoPE table / keys beyond the attention workspace. */
static kdt_status check_reach(const char *fn, const kdt_gpu_runner *r, int32_t stream, int64_t last_pos,
                              int64_t last_keys) {
    if (last_pos >= r->g->cfg.max_position_embeddings)
        return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: position %lld reaches max_position_embeddings %d", fn, stream,
                        (long long)last_pos, r->g->cfg.max_position_embeddings);
    if (last_pos >= r->g->rope_rows)
        return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: position %lld is beyond the GPU RoPE table (%d rows)", fn,
                        stream, (long long)last_pos, r->g->rope_rows);
    if (last_keys > r->opt.max_keys)
        return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: %lld visible keys, the runner was sized for %d", fn, stream,
                        (long long)last_keys, r->opt.max_keys);
    return KDT_OK;
}

kdt_status kdt_gpu_stage_prefill_many(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_segments,
                                      const kdt_prefill_segment *segs, int32_t last_only) {
    static const char fn[] = "kdt_gpu_stage_prefill_many";
    KDT_TRY(check_kv(fn, r, c));
    /* every check before any state changes: a refused call leaves the cache as it was */
    KDT_TRY(kdt_check_prefill_segments(fn, &r->g->cfg, n_segments, segs, c->max_streams, c->length, r->opt.max_rows,
                                       "the runner's max_rows", r->opt.max_rows, "the runner's max_rows"));
    for (int32_t k = 0; k < n_segments; k++) {
        const int32_t len = c->length[segs[k].stream];
        KDT_TRY(check_reach(fn, r, segs[k].stream, (int64_t)len + segs[k].n - 1, (int64_t)len + segs[k].n));
    }
    if (n_segments > r->cap_plain) {
        kdt_plain_seg *ps = realloc(r->plain_segs, (size_t)n_segments * sizeof *ps);
        if (!ps) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: segment list", fn);
        r->plain_segs = ps;
        r->cap_plain = n_segments;
    }
    int32_t *ids = malloc(2 * (size_t)n_segments * sizeof(int32_t));
    if (!ids) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", fn);
    int32_t *need = ids + n_segments;
    for (int32_t k = 0; k < n_segments; k++) {
        ids[k] = segs[k].stream;
        need[k] = c->length[segs[k].stream] + segs[k].n;
    }
    kdt_status st = kdt_gkv_reserve_many(c, n_segments, ids, need);
    free(ids);
    KDT_TRY(st);
    stage_view v;
    memset(&v, 0, sizeof v);
    KDT_TRY(stage_begin(r, &v));
    int32_t row = 0, n_absorbed = 0;
    r->n_plain = 0;
    for (int32_t k = 0; k < n_segments; k++) {
        const int32_t stream = segs[k].stream, n = segs[k].n, len = c->length[stream];
        for (int32_t i = 0; i < n; i++, row++) {
            kdt_grow *w = &v.rows[row];
            memset(w, 0, sizeof *w);
            w->stream = stream;
            w->token = segs[k].tokens[i];
            w->pos = w->slot = len + i;
            w->n_prefix = w->n_keys = len + i + 1; /* causal: itself and everything before */
            w->mask_off = -1;
            w->out_index = last_only ? (i == n - 1 ? k : -1) : row;
            w->tap_index = row;
        }
        /* the segment's attention form, as a pass of its rows alone would take it (decided here,
         * on the host, so a pass stays kernels only) */
        if (r->plain_k && (len + n <= r->plain_cap || r->plain_state) &&
            kdt_prefill_takes_plain(&r->g->cfg, r->opt.prefill_attention, n, len)) {
            kdt_plain_seg *ps = &r->plain_segs[r->n_plain++];
            ps->stream = stream;
            ps->first = len;
            ps->rows = n;
            ps->row0 = row - n;
        } else {
            n_absorbed++;
        }
    }
    KDT_TRY(stage_end(r, c, &v, row, 0));
    for (int32_t k = 0; k < n_segments; k++)
        c->length[segs[k].stream] = c->written[segs[k].stream] = c->length[segs[k].stream] + segs[k].n;
    r->staged_absorbed = n_absorbed > 0;
    return KDT_OK;
}

kdt_status kdt_gpu_stage_prefill(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, const int32_t *tokens, int32_t n,
                                 int32_t last_only) {
    KDT_CHECK_ARG(r && c, "kdt_gpu_stage_prefill: runner or cache is NULL");
    KDT_CHECK_ARG(stream >= 0 && stream < c->max_streams, "kdt_gpu_stage_prefill: stream %d (0..%d)", stream,
                  c->max_streams - 1);
    const kdt_prefill_segment sg = {stream, tokens, n};
    return kdt_gpu_stage_prefill_many(r, c, 1, &sg, last_only);
}

kdt_status kdt_gpu_stage_decode(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams, const int32_t *stream_ids,
                                const int32_t *tokens) {
    static const char fn[] = "kdt_gpu_stage_decode";
    KDT_TRY(check_kv(fn, r, c));
    KDT_CHECK_ARG(tokens, "%s: tokens is NULL", fn);
    KDT_CHECK_ARG(n_streams >= 1 && n_streams <= c->max_streams && n_streams <= r->opt.max_rows,
                  "%s: n_streams = %d (1..%d)", fn, n_streams,
                  c->max_streams < r->opt.max_rows ? c->max_streams : r->opt.max_rows);
    int32_t *ids = malloc((size_t)n_streams * 2 * sizeof(int32_t));
    kdt_status st = KDT_OK;
    if (!ids) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", fn);
        goto done;
    }
    int32_t *need = ids + n_streams;
    stage_view v;
    memset(&v, 0, sizeof v);
    if ((st = kdt_resolve_stream_ids(fn, stream_ids, n_streams, c->max_streams, ids)) != KDT_OK) goto done;
    for (int32_t s = 0; s < n_streams; s++) {
        const int32_t id = ids[s];
        if ((st = check_token(fn, r, tokens[s], "tokens", s)) != KDT_OK) goto done;
        if (c->length[id] >= r->g->cfg.max_position_embeddings) {
            st = kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d is at max_position_embeddings %d", fn, id,
                          r->g->cfg.max_position_embeddings);
            goto done;
        }
        if ((st = check_reach(fn, r, id, c->length[id], (int64_t)c->length[id] + 1)) != KDT_OK) goto done;
        need[s] = c->length[id] + 1;
    }
    if ((st = kdt_gkv_reserve_many(c, n_streams, ids, need)) != KDT_OK) goto done;
    if ((st = stage_begin(r, &v)) != KDT_OK) goto done;
    for (int32_t s = 0; s < n_streams; s++) {
        kdt_grow *w = &v.rows[s];
        memset(w, 0, sizeof *w);
        w->stream = ids[s];
        w->token = tokens[s];
        w->pos = w->slot = c->length[ids[s]];
        w->n_prefix = w->n_keys = w->slot + 1;
        w->mask_off = -1;
        w->out_index = w->tap_index = s;
    }
    if ((st = stage_end(r, c, &v, n_streams, 0)) != KDT_OK) goto done;
    for (int32_t s = 0; s < n_streams; s++) c->length[ids[s]] = c->written[ids[s]] = need[s];
done:
    free(ids);
    return st;
}

/* One stream of a tree against the layout contract (as forward.c checks it); P = its length. */
static kdt_status check_tree_stream(const kdt_gpu_runner *r, const kdt_tree *t, int32_t s, int32_t P, int32_t stream) {
    static const char fn[] = "kdt_gpu_verify";
    int32_t max_depth = 0;
    KDT_TRY(kdt_check_tree_stream(fn, &r->g->cfg, t, s, P, &max_depth));
    return check_reach(fn, r, stream, (int64_t)P + max_depth, (int64_t)P + max_depth + 1);
}

kdt_status kdt_gpu_stage_verify(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *tree, const int32_t *stream_ids) {
    static const char fn[] = "kdt_gpu_verify";
    KDT_TRY(check_kv(fn, r, c));
    KDT_CHECK_ARG(tree, "%s: tree is NULL", fn);
    const int32_t S = tree->n_streams, N = tree->max_nodes;
    KDT_CHECK_ARG(S >= 1 && S <= c->max_streams, "%s: n_streams = %d (1..%d)", fn, S, c->max_streams);
    KDT_CHECK_ARG(N >= 1 && N <= KDT_MAX_NODES, "%s: max_nodes = %d (1..%d)", fn, N, KDT_MAX_NODES);
    KDT_CHECK_ARG(tree->n_nodes && tree->token && tree->parent && tree->depth && tree->position && tree->anc_mask,
                  "%s: a tree array (n_nodes, token, parent, depth, position, anc_mask) is NULL", fn);
    KDT_CHECK_ARG(N <= r->opt.max_nodes, "%s: max_nodes = %d, the runner was made for %d", fn, N, r->opt.max_nodes);
    KDT_CHECK_ARG((int64_t)S * N <= r->opt.max_rows, "%s: %d streams x max_nodes %d exceed the runner's max_rows %d",
                  fn, S, N, r->opt.max_rows);
    const int32_t W = KDT_MASK_WORDS(N);
    int32_t *ids = malloc((size_t)S * 2 * sizeof(int32_t));
    kdt_status st = KDT_OK;
    if (!ids) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", fn);
        goto done;
    }
    int32_t *need = ids + S;
    stage_view v;
    memset(&v, 0, sizeof v);
    if ((st = kdt_resolve_stream_ids(fn, stream_ids, S, c->max_streams, ids)) != KDT_OK) goto done;
    for (int32_t s = 0; s < S; s++) {
        const int32_t id = ids[s];
        if ((st = check_tree_stream(r, tree, s, c->length[id], id)) != KDT_OK) goto done;
        need[s] = c->length[id] + tree->n_nodes[s];
    }
    if ((st = kdt_gkv_reserve_many(c, S, ids, need)) != KDT_OK) goto done;
    if ((st = stage_begin(r, &v)) != KDT_OK) goto done;
    int32_t k = 0;
    for (int32_t s = 0; s < S; s++) {
        const int32_t P = c->length[ids[s]];
        for (int32_t i = 0; i < tree->n_nodes[s]; i++, k++) {
            const int64_t idx = (int64_t)s * N + i;
            kdt_grow *w = &v.rows[k];
            memset(w, 0, sizeof *w);
            w->stream = ids[s];
            w->token = tree->token[idx];
            w->pos = tree->position[idx];
            w->slot = P + i;
            w->n_prefix = P;
            int32_t bits = 0;
            for (int32_t q = 0; q < W; q++) {
                v.masks[(int64_t)k * W + q] = tree->anc_mask[idx * W + q];
                bits += __builtin_popcountll(tree->anc_mask[idx * W + q]);
            }
            w->n_keys = P + bits;
            w->mask_off = k * W;
            w->mask_words = W;
            w->out_index = w->tap_index = (int32_t)idx;
        }
    }
    if ((st = stage_end(r, c, &v, k, (size_t)k * W)) != KDT_OK) goto done;
    for (int32_t s = 0; s < S; s++) c->written[ids[s]] = need[s];
done:
    free(ids);
    return st;
}

kdt_status kdt_gpu_stage_verify_device(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *d_tree,
                                       const int32_t *stream_ids, const int32_t *node_bound,
                                       const int32_t *depth_bound) {
    static const char fn[] = "kdt_gpu_stage_verify_device";
    KDT_TRY(check_kv(fn, r, c));
    KDT_CHECK_ARG(d_tree && stream_ids, "%s: tree or stream_ids is NULL", fn);
    const int32_t S = d_tree->n_streams, N = d_tree->max_nodes;
    KDT_CHECK_ARG(S >= 1 && S <= c->max_streams && S <= KDT_GPU_TREE_STREAMS, "%s: n_streams = %d (1..%d)", fn, S,
                  c->max_streams < KDT_GPU_TREE_STREAMS ? c->max_streams : KDT_GPU_TREE_STREAMS);
    KDT_CHECK_ARG(N >= 1 && N <= r->opt.max_nodes, "%s: max_nodes = %d, the runner was made for %d", fn, N,
                  r->opt.max_nodes);
    KDT_CHECK_ARG(node_bound && depth_bound, "%s: node_bound or depth_bound is NULL", fn);
    KDT_CHECK_ARG((int64_t)S * N <= r->tree_rows,
                  "%s: %d streams x max_nodes %d exceed the runner's max_tree_rows %d (its attention runs in one "
                  "launch; kdt_gpu_runner_options.max_tree_rows)", fn, S, N, r->tree_rows);
    KDT_CHECK_ARG(d_tree->n_nodes && d_tree->token && d_tree->position && d_tree->anc_mask,
                  "%s: a tree array (n_nodes, token, position, anc_mask) is NULL", fn);
    int32_t ids[KDT_GPU_TREE_STREAMS], need[KDT_GPU_TREE_STREAMS];
    int64_t splits = 0;
    KDT_TRY(kdt_resolve_stream_ids(fn, stream_ids, S, c->max_streams, ids));
    for (int32_t s = 0; s < S; s++) {
        const int32_t id = ids[s];
        const int32_t P = c->length[id], nb = node_bound[s], db = depth_bound[s];
        KDT_CHECK_ARG(nb >= 1 && nb <= N && db >= 0 && db < nb, "%s: stream %d: node bound %d, depth bound %d (max_nodes %d)",
                      fn, s, nb, db, N);
        KDT_TRY(check_reach(fn, r, id, (int64_t)P + db, (int64_t)P + nb));
        need[s] = P + nb; /* the host does not know n_nodes: room for the bound */
        splits += (int64_t)nb * kdt_attn_n_splits(P + nb);
    }
    if (splits > r->max_splits_total)
        return kdt_fail(KDT_ERR_CAPACITY, "%s: up to %lld attention splits exceed the workspace (%d)", fn,
                        (long long)splits, r->max_splits_total);
    KDT_TRY(kdt_gkv_reserve_many(c, S, ids, need));
    stage_view v;
    memset(&v, 0, sizeof v);
    KDT_TRY(stage_begin(r, &v));
    int32_t *tab = (int32_t *)(r->h_stage[r->stage_idx ^ 1] + r->off_streams);
    for (int32_t s = 0; s < S; s++) {
        tab[3 * s] = ids[s];
        tab[3 * s + 1] = c->length[ids[s]];
        tab[3 * s + 2] = node_bound[s];
    }
    /* copies header, updates and the stream table (rows and masks are written on the device) */
    KDT_TRY(stage_end(r, c, &v, 0, 0));
    r->staged_rows = S * N;
    r->dtree = *d_tree; /* the rows are numbered by kdt_gpu_run, after tree_build has run */
    r->dtree_pending = 1;
    for (int32_t s = 0; s < S; s++) c->written[ids[s]] = need[s];
    return KDT_OK;
}

/* ---- the pass --------------------------------------------------------------------------------- */

typedef struct pass {
    kdt_gpu_runner *r;
    kdt_gpu_kv *c;
    const kdt_gpu_model *g;
    cudaStream_t s;
    float *part;                /* split-K partials of its GEMMs (r->part; the side pass's own) */
    size_t part_floats;
    int32_t M;                  /* launch bound */
    int32_t stages;
    const kdt_gstage_hdr *hdr;
    const kdt_grow *rows;
    const int32_t *head;
    const uint64_t *masks;
    const int32_t *m_dev;
    int32_t step;               /* operations issued so far (kdt_gpu_runner_set_step_limit) */
    int32_t plain_next;         /* the next GEMM launches without programmatic dependence */
    uint16_t *x_hl;             /* the wgmma GEMMs' X planes for this stream (NULL: none) */
    int64_t x_hl_elems;
} pass;

/* 1 when the pass is cut before this step (profiling); else counts and names the step. Once cut,
 * every later step is cut too, so a caller just returns. */
static int step_cut(pass *p, const char *name) {
    kdt_gpu_runner *r = p->r;
    if (r->step_limit > 0 && p->step >= r->step_limit) return 1;
    if (p->step < KDT_GPU_STEP_NAMES) r->step_names[p->step] = name;
    p->step++;
    return 0;
}
#define PASS_STEP(p, name, call)                  \
    do {                                          \
        if (step_cut((p), (name))) return KDT_OK; \
        KDT_TRY(call);                            \
    } while (0)

/* partials of X W^T into y (r->part when NULL) as [splits][M][ldy] (+ y_batch per batch);
 * returns the split count */
static kdt_status gemm_into(pass *p, const char *name, const float *x, int64_t ldx, int64_t x_batch, int32_t kx,
                            const kdt_gmat *w, float *y, int64_t ldy, int64_t y_batch, int32_t *splits,
                            int64_t *split_stride) {
    int32_t k_chunk;
    kdt_gemm_plan(w->rows, w->ld, w->batch, splits, &k_chunk);
    *split_stride = (int64_t)p->M * ldy;
    if (y && *splits != 1) return kdt_fail(KDT_ERR_INTERNAL, "GPU forward: %s: a direct GEMM output needs one split", name);
    if (!y && (size_t)*splits * (size_t)*split_stride > p->part_floats)
        return kdt_fail(KDT_ERR_INTERNAL, "GPU forward: split-K partials overflow");
    kdt_gemm_args a;
    memset(&a, 0, sizeof a);
    a.x = x;
    a.ldx = ldx;
    a.x_batch = x_batch;
    a.kx = kx;
    a.w = w->w;
    a.ldw = w->ld;
    a.w_batch = w->batch_stride;
    a.n = w->rows;
    a.y = y ? y : p->part;
    a.ldy = ldy;
    a.y_split = *split_stride;
    a.y_batch = y_batch;
    a.m_dev = p->m_dev;
    a.m_max = p->M;
    a.batch = w->batch;
    a.splits = *splits;
    a.k_chunk = k_chunk;
    a.tiled = w->tiled;
    if (step_cut(p, name)) return KDT_OK;
    const int plain = p->plain_next;
    p->plain_next = 0;
    return kdt_gemm_launch_ws(&a, p->stages, p->s, plain, p->x_hl, p->x_hl_elems);
}
static kdt_status gemm(pass *p, const char *name, const float *x, int64_t ldx, int64_t x_batch, int32_t kx,
                       const kdt_gmat *w, int64_t ldy, int64_t y_batch, int32_t *splits, int64_t *split_stride) {
    return gemm_into(p, name, x, ldx, x_batch, kx, w, NULL, ldy, y_batch, splits, split_stride);
}

static kdt_status attention(pass *p, int32_t l) {
    const kdt_gpu_model *g = p->g;
    const kdt_model_config *c = &g->cfg;
    kdt_gpu_runner *r = p->r;
    int32_t hg = r->opt.attn_heads_per_item;
    if (hg == 0) hg = (hg64_supported(g) && c->n_heads >= 64 && p->M >= 16) ? 64 : 16;
    const int32_t n_hg = (c->n_heads + hg - 1) / hg;
    const int64_t cap = (int64_t)g->n_sm * (hg == 16 ? 2 : 1);
    kdt_attn_args a;
    memset(&a, 0, sizeof a);
    a.q_abs = r->q_abs;
    a.kv = p->c->cache + (int64_t)l * p->c->layer_stride;
    a.row_stride = p->c->row_stride;
    a.page_size = p->c->page_size;
    a.n_pages = p->c->n_pages;
    a.max_pages = p->c->max_pages;
    a.block_table = p->c->d_block_table;
    a.hdr = p->hdr;
    a.rows = p->rows;
    a.masks = p->masks;
    a.att_o = r->att_o;
    a.att_m = r->att_m;
    a.att_l = r->att_l;
    a.o_lat = r->o_lat;
    a.H = c->n_heads;
    a.dc = c->kv_lora_rank;
    a.dq = c->kv_lora_rank + c->qk_rope_head_dim;
    a.scale_log2 = c->softmax_scale * LOG2E;
    a.heads_per_item = hg;
    if (step_cut(p, "attention")) return KDT_OK;
    if (r->n_windows <= 1) { /* the pass's rows in one launch, off the main header */
        const int64_t bound = (int64_t)p->M * max_row_splits(r->opt.max_keys) * n_hg;
        a.grid = (int32_t)(bound < cap ? bound : cap);
        a.max_rows = p->M;
        return kdt_attn_launch(&a, p->s);
    }
    /* windows (stage_end): each launch sees its rows as a pass of those rows alone (row, query
     * and output pointers moved, the window's header) and reuses the partials from slot 0 */
    const kdt_gstage_hdr *wh = (const kdt_gstage_hdr *)((const unsigned char *)p->hdr + r->off_windows);
    const float *q_abs = a.q_abs;
    const kdt_grow *rows = a.rows;
    float *o_lat = a.o_lat;
    for (int32_t w = 0; w < r->n_windows; w++) {
        const int64_t r0 = r->win_row[w], bound = (int64_t)r->win_splits[w] * n_hg;
        a.hdr = wh + w;
        a.rows = rows + r0;
        a.q_abs = q_abs + r0 * a.H * a.dq;
        a.o_lat = o_lat + r0 * a.H * a.dc;
        a.grid = (int32_t)(bound < cap ? bound : cap); /* a window has rows, each >= 1 split */
        a.max_rows = r->win_row[w + 1] - r->win_row[w];
        KDT_TRY(kdt_attn_launch(&a, p->s));
    }
    return KDT_OK;
}

/* The shared expert apart (the default; KDT_GPU_SHARED_APART=0, read per pass, keeps it as the
 * last item of the grouped launches): it needs only the layer's normed rows, not the routing, so
 * it runs as a dense MLP (split-K GEMMs over all rows, 320 + 336 CTAs for Kimi instead of the 64 +
 * 112 a grouped item gets) on a second stream forked after post_o and joined before the MoE
 * combine. Its 88 MB (Kimi) then stream while the router and the plan, latency steps, leave the
 * HBM idle. H200, Kimi layer, decode S 1: 315-318 -> 309.5-312.5 us (session 17, A/B in four
 * calls); verify N 9 -4 %, the other shapes within 1 %. Its bits differ from the grouped form's
 * (the split-K chain), and are the same in every pass, as the batch-invariance rule needs. A
 * 64-CTA grouped launch of its own on the second stream measured +35-45 us (a lone expert's
 * item streams at ~0.7 TB/s): the split is what makes it pay. */
static int shared_apart(const pass *p) {
    return p->g->has_shared && p->r->side && !kdt_g_env_is("KDT_GPU_SHARED_APART", '0');
}

static kdt_status moe_routed(pass *p, const kdt_gpu_layer *L, int32_t l, int32_t hs, int32_t sh_splits,
                             int64_t sh_ss);

/* The shared expert as a dense MLP on r->side (forked by the caller): gate/up, SwiGLU, down;
 * the down's split partials stay in r->part_sh for the combine. */
static kdt_status shared_expert(pass *p, const kdt_gpu_layer *L, int32_t *dn_splits, int64_t *dn_ss) {
    kdt_gpu_runner *r = p->r;
    const kdt_model_config *c = &p->g->cfg;
    const int32_t D = c->hidden_size, inter = c->n_shared_experts * c->moe_intermediate_size;
    pass q = *p;
    q.s = r->side;
    q.part = r->part_sh;
    q.part_floats = r->part_sh_floats;
    q.x_hl = r->x_hl_side;
    q.x_hl_elems = r->x_hl_side_elems;
    /* its first GEMM launches when post_o has finished, without programmatic dependence: placed at
     * post_o's trigger (KDT_GPU_SHARED_PDL=1), its CTAs (320 for Kimi) compete for SM slots with the
     * router GEMM, which is on the critical path. Plain: Kimi 2-layer decode S 1 passes 805-818 us
     * against 826-868 on an H100 (session 28, docs/model_gpu.md); the cause is inferred, not
     * profiled. Scheduling only: the same bits. */
    q.plain_next = !kdt_g_env_is("KDT_GPU_SHARED_PDL", '1');
    int32_t splits;
    int64_t ss;
    kdt_status st = gemm(&q, "shared_gate_up", r->xn, D, 0, D, &L->shared_gu, L->shared_gu.rows, 0, &splits, &ss);
    if (st == KDT_OK && !step_cut(&q, "shared_swiglu"))
        st = kdt_op_swiglu(q.part, splits, ss, L->shared_gu.rows, p->m_dev, p->M, NULL, NULL, inter, r->h_sh, r->ld_h,
                           q.s);
    if (st == KDT_OK)
        st = gemm(&q, "shared_down", r->h_sh, r->ld_h, 0, inter, &L->shared_down, D, 0, dn_splits, dn_ss);
    p->step = q.step;
    return st;
}

/* from -> to: `to` waits for what `from` has enqueued so far (ev records it; capturable) */
static kdt_status stream_after(cudaStream_t to, cudaStream_t from, cudaEvent_t ev, const char *what) {
    cudaError_t e = cudaEventRecord(ev, from);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(to, ev, 0);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, what);
}

static kdt_status moe(pass *p, const kdt_gpu_layer *L, int32_t l) {
    if (!shared_apart(p)) return moe_routed(p, L, l, p->g->has_shared, 0, 0);
    kdt_gpu_runner *r = p->r;
    KDT_TRY(stream_after(r->side, p->s, r->ev_fork, "GPU forward: shared expert fork"));
    int32_t sh_splits = 0;
    int64_t sh_ss = 0;
    kdt_status st = shared_expert(p, L, &sh_splits, &sh_ss);
    if (st == KDT_OK) st = moe_routed(p, L, l, 2, sh_splits, sh_ss);
    /* joined on every path (a cut pass or an error too): a capture must not end forked */
    const kdt_status sj = stream_after(p->s, r->side, r->ev_join, "GPU forward: shared expert join");
    return st != KDT_OK ? st : sj;
}

/* Rows per MoE plan item: 32 cuts an expert's pairs into items that a grouped launch at 4 per SM
 * (32-row passes) runs in one pass each, in CTAs side by side (an expert's items are adjacent),
 * so they stream its W slice together through L2, where a 64-row item passed twice in one CTA.
 * H100, correlated verify N 65: routed gate/up 566 -> 446 us, down 268 -> 238 (session 34).
 * KDT_GPU_ITEM_ROWS=n (32..64, read per pass) sets it; the rows' bits do not depend on it. Where
 * the grouped GEMM runs on wgmma (a pass of many pairs) items of 64 rows fill its CTAs. */
static int32_t plan_item_rows(int32_t max_pairs) {
    const char *e = getenv("KDT_GPU_ITEM_ROWS");
    const int v = e ? atoi(e) : 0;
    if (v <= 0) return kdt_gemm_wg_item_rows(max_pairs) ? KDT_G_BM : KDT_G_ITEM_ROWS_MIN;
    return v < KDT_G_ITEM_ROWS_MIN ? KDT_G_ITEM_ROWS_MIN : (v > KDT_G_BM ? KDT_G_BM : v);
}

/* The router, the plan, the routed experts and the combine. hs: the plan's has_shared (1: the
 * shared expert's pairs in the grouped launches; 2: it ran apart, its down partials in
 * r->part_sh, sh_splits x sh_ss). */
static kdt_status moe_routed(pass *p, const kdt_gpu_layer *L, int32_t l, int32_t hs, int32_t sh_splits,
                             int64_t sh_ss) {
    const kdt_gpu_model *g = p->g;
    const kdt_model_config *c = &g->cfg;
    kdt_gpu_runner *r = p->r;
    const int32_t D = c->hidden_size, E = c->n_routed_experts, K = c->n_experts_per_tok;
    const int32_t in_plan = hs == 1; /* the shared expert's pairs and item are the plan's */
    const int32_t ir = plan_item_rows(p->M * K + (in_plan ? p->M : 0));
    int32_t splits;
    int64_t ss;
    KDT_TRY(gemm(p, "router", r->xn, D, 0, D, &L->router, E, 0, &splits, &ss));
    int32_t *ec = r->expert_counts + (int64_t)l * (E + 1);
    if (kdt_op_route_plan1_ok(c, p->M)) { /* a one-row pass: the router's CTA also writes the plan */
        PASS_STEP(p, "route_plan", kdt_op_route_plan1(r->part, splits, ss, L->router_bias, c, p->hdr, r->sel, r->wgt,
                                                      hs, r->pair_row, r->pair_expert, r->pos_of,
                                                      r->pos_shared, r->items, r->moe_counts, ec, p->s));
    } else {
        PASS_STEP(p, "route", kdt_op_route(r->part, splits, ss, L->router_bias, c, p->hdr, r->sel, r->wgt, p->M, p->s));
        PASS_STEP(p, "moe_plan", kdt_op_moe_plan(p->hdr, r->sel, K, E, hs, p->M, ir, r->pair_row, r->pair_expert,
                                                 r->pos_of, r->pos_shared, r->items, r->moe_counts, ec, p->s));
    }
    const int32_t max_pairs = p->M * K + (in_plan ? p->M : 0);
    const int32_t E_tot = E + in_plan;
    int32_t item_bound = (p->M * K + in_plan) < E_tot ? p->M * K + in_plan : E_tot;
    item_bound += (max_pairs + ir - 1) / ir;
    const int32_t ldp = 2 * g->max_inter_pad;
    kdt_grouped_args a;
    memset(&a, 0, sizeof a);
    a.which = 0;
    a.x = r->xn;
    a.ldx = D;
    a.pair_row = r->pair_row;
    a.experts = L->experts;
    a.items = r->items;
    a.n_items = r->moe_counts;
    a.y = r->moe_part;
    a.ldy = ldp;
    a.n_max = ldp;
    a.kd = D;
    a.grid_items = item_bound < 128 ? item_bound : 128;
    a.max_item_rows = p->M < ir ? p->M : ir; /* an item: one expert's pairs, <= one per row */
    /* up to ir rows every touched expert is one item: at most min(M K, E) routed + the shared one */
    a.n_items_hint = p->M <= ir ? (p->M * K < E ? p->M * K : E) + in_plan : item_bound;
    a.n_pairs_hint = max_pairs;
    a.tiled = g->experts_tiled;
    const int fused = kdt_grouped_fuses_swiglu(&a); /* the gate/up CTAs write h themselves */
    if (fused) {
        a.h = r->h;
        a.ldh = r->ld_h;
    }
    /* the wgmma kernel's X planes (kdt_gemm_wg_ss_on): widths over every expert of the launch */
    const int32_t ld_gu = L->experts_gu.ld,
                  ld_dn = in_plan && L->shared_down.ld > L->experts_down.ld ? L->shared_down.ld : L->experts_down.ld;
    PASS_STEP(p, "moe_gate_up", kdt_grouped_launch_ws(&a, p->stages, p->s, p->x_hl, p->x_hl_elems, p->m_dev, p->M,
                                                      r->pair_expert, ld_gu));
    if (!fused)
        PASS_STEP(p, "moe_swiglu", kdt_op_swiglu(r->moe_part, 1, 0, ldp, r->moe_counts + 1, max_pairs, r->pair_expert,
                                                 L->experts, 0, r->h, r->ld_h, p->s));
    a.h = NULL;
    a.which = 1;
    a.x = r->h;
    a.ldx = r->ld_h;
    a.y = r->moe_y;
    a.ldy = D;
    a.n_max = D;
    PASS_STEP(p, "moe_down", kdt_grouped_launch_ws(&a, p->stages, p->s, p->x_hl, p->x_hl_elems, p->m_dev, p->M,
                                                   r->pair_expert, ld_dn));
    if (hs == 2) /* the combine reads the shared expert's partials: join first */
        KDT_TRY(stream_after(p->s, r->side, r->ev_join, "GPU forward: shared expert join"));
    PASS_STEP(p, "moe_combine", kdt_op_moe_combine(r->x, r->moe_y, r->part_sh, sh_splits, sh_ss, D, K, r->pos_of,
                                                   r->pos_shared, r->wgt, hs, p->hdr, p->M, p->s));
    return KDT_OK;
}

static kdt_status dense_mlp(pass *p, const kdt_gpu_layer *L) {
    kdt_gpu_runner *r = p->r;
    const int32_t D = p->g->cfg.hidden_size;
    int32_t splits;
    int64_t ss;
    KDT_TRY(gemm(p, "dense_gate_up", r->xn, D, 0, D, &L->dense_gu, L->dense_gu.rows, 0, &splits, &ss));
    PASS_STEP(p, "dense_swiglu", kdt_op_swiglu(r->part, splits, ss, L->dense_gu.rows, p->m_dev, p->M, NULL, NULL, L->dense_inter, r->h, r->ld_h,
                      p->s));
    KDT_TRY(gemm(p, "dense_down", r->h, r->ld_h, 0, L->dense_inter, &L->dense_down, D, 0, &splits, &ss));
    PASS_STEP(p, "dense_residual", kdt_op_residual(r->x, r->part, splits, ss, D, p->m_dev, p->M, p->s));
    return KDT_OK;
}

/* The plain form of a prefill segment's attention (gpu_plain.cu) straight into the heads o_proj
 * reads: it replaces W_UK, the absorbed attention and W_UV for the segment's rows. A segment's rows
 * are addressed by moving the row pointers, so the kernels see what a pass of that segment alone
 * would give them (the same bits). */
static kdt_status plain_attention(pass *p, int32_t l) {
    const kdt_model_config *c = &p->g->cfg;
    kdt_gpu_runner *r = p->r;
    const int32_t H = c->n_heads;
    kdt_plain_args a;
    memset(&a, 0, sizeof a);
    a.kv = p->c->cache + (int64_t)l * p->c->layer_stride;
    a.row_stride = p->c->row_stride;
    a.page_size = p->c->page_size;
    a.max_pages = p->c->max_pages;
    a.block_table = p->c->d_block_table;
    const size_t planes = (size_t)H * r->plain_cap;
    a.k_hi = r->plain_k;
    a.k_lo = r->plain_k + planes * r->plain_dqk;
    a.v_hi = r->plain_v;
    a.v_lo = r->plain_v + planes * r->plain_dv;
    a.cap = r->plain_cap;
    a.H = H;
    a.dn = c->qk_nope_head_dim;
    a.dr = c->qk_rope_head_dim;
    a.dc = c->kv_lora_rank;
    a.dv = c->v_head_dim;
    a.dqk_p = r->plain_dqk;
    a.dv_p = r->plain_dv;
    a.stages = r->plain_stages;
    a.scale_log2 = c->softmax_scale * LOG2E;
    a.state_ld = r->plain_dv + 8;
    a.wg = r->plain_wg;
    if (step_cut(p, "plain_attention")) return KDT_OK;
    p->plain_next = 1; /* o_proj follows plain launches: no programmatic dependence to inherit */
    for (int32_t sg = 0; sg < r->n_plain; sg++) {
        const kdt_plain_seg *ps = &r->plain_segs[sg];
        const int64_t row0 = ps->row0;
        a.q_nope = r->q_nope + row0 * H * a.dn;
        a.q_abs = r->q_abs + row0 * H * (a.dc + a.dr);
        a.heads = r->heads + row0 * H * a.dv;
        a.state = r->plain_state ? r->plain_state + row0 * H * a.state_ld : NULL;
        a.stream = ps->stream;
        a.R = ps->rows;
        a.first = ps->first;
        a.T = ps->first + ps->rows;
        for (a.k0 = 0; a.k0 < a.T; a.k0 += a.cap) { /* blocks of cap keys, in key order (gpu_plain.cu) */
            a.kn = a.T - a.k0 < a.cap ? a.T - a.k0 : a.cap;
            KDT_TRY(kdt_plain_launch(&a, &p->g->layers[l].uk_t, &p->g->layers[l].uv, p->s));
        }
    }
    return KDT_OK;
}

/* The absorbed form (decode, verify, and prefill by default): W_UK folds q_nope into the latent,
 * the attention runs over the cache rows (o_lat), W_UV lifts o_lat into the heads o_proj reads. */
static kdt_status absorbed_attention(pass *p, const kdt_gpu_layer *L, int32_t l) {
    const kdt_model_config *c = &p->g->cfg;
    kdt_gpu_runner *r = p->r;
    const int32_t H = c->n_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim, dc = c->kv_lora_rank,
                  dq = dc + c->qk_rope_head_dim;
    int32_t splits;
    int64_t ss;
    /* q_lat = q_nope W_UK per head, into q_abs's first d_c columns: directly when K is one split
     * (Kimi: d_n = 128; the split sum would be a copy: same bits), else via the partials */
    int32_t uk_splits, uk_chunk;
    kdt_gemm_plan(L->uk_t.rows, L->uk_t.ld, L->uk_t.batch, &uk_splits, &uk_chunk);
    if (uk_splits == 1) {
        KDT_TRY(gemm_into(p, "w_uk", r->q_nope, (int64_t)H * dn, dn, dn, &L->uk_t, r->q_abs, (int64_t)H * dq, dq,
                          &splits, &ss));
    } else {
        KDT_TRY(gemm(p, "w_uk", r->q_nope, (int64_t)H * dn, dn, dn, &L->uk_t, (int64_t)H * dc, dc, &splits, &ss));
        PASS_STEP(p, "sum_uk", kdt_op_sum_splits(r->part, splits, ss, H * dc, H, dc, dc, r->q_abs, H * dq, dq,
                                                 p->m_dev, p->M, p->s));
    }
    KDT_TRY(attention(p, l));
    /* W_UV keeps its two K splits and the split sum: one split (writing the heads directly, as
     * W_UK does) made the Kimi decode layer ~2 us slower (H200, session 10) */
    KDT_TRY(gemm(p, "w_uv", r->o_lat, (int64_t)H * dc, dc, dc, &L->uv, (int64_t)H * dv, dv, &splits, &ss));
    PASS_STEP(p, "sum_uv", kdt_op_sum_splits(r->part, splits, ss, H * dv, H, dv, dv, r->heads, H * dv, dv, p->m_dev, p->M, p->s));
    return KDT_OK;
}

static kdt_status layer(pass *p, int32_t l, const kdt_gpu_run_config *rc) {
    const kdt_gpu_model *g = p->g;
    const kdt_model_config *c = &g->cfg;
    const kdt_gpu_layer *L = &g->layers[l];
    kdt_gpu_runner *r = p->r;
    kdt_gpu_kv *kv = p->c;
    const int32_t D = c->hidden_size, H = c->n_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim,
                  dv = c->v_head_dim, dc = c->kv_lora_rank, ql = c->q_lora_rank, dqk = dn + dr;
    int32_t splits;
    int64_t ss;
    PASS_STEP(p, "input_norm", kdt_op_rmsnorm(r->x, NULL, L->input_norm, c->rms_norm_eps, D, r->xn, p->m_dev, p->M, p->s));
    KDT_TRY(gemm(p, "q_a_kv_a", r->xn, D, 0, D, &L->w_a, L->w_a.rows, 0, &splits, &ss));
    PASS_STEP(p, "post_a", kdt_op_post_a(r->part, splits, ss, L->w_a.rows, ql, dc, dr, L->q_a_norm, L->kv_a_norm, g->rope_cs,
                      c->rope_interleave, p->hdr, p->rows, kv->cache + (int64_t)l * kv->layer_stride,
                      kv->d_block_table, kv->max_pages, kv->page_size, kv->n_pages, kv->row_stride, r->qa, p->M, p->s));
    if (ql > 0) KDT_TRY(gemm(p, "q_b", r->qa, ql, 0, ql, &L->q_b, (int64_t)H * dqk, 0, &splits, &ss));
    else KDT_TRY(gemm(p, "q_proj", r->xn, D, 0, D, &L->q_b, (int64_t)H * dqk, 0, &splits, &ss));
    PASS_STEP(p, "post_q", kdt_op_post_q(r->part, splits, ss, H * dqk, H, dn, dr, dc, g->rope_cs, c->rope_interleave, p->hdr, p->rows,
                      r->q_nope, r->q_abs, p->M, p->s));
    /* a pass mixing the forms runs the absorbed one over every row first (rows are independent),
     * then the plain segments overwrite their rows' heads */
    if (r->staged_absorbed) KDT_TRY(absorbed_attention(p, L, l));
    if (r->n_plain > 0) KDT_TRY(plain_attention(p, l));
    KDT_TRY(gemm(p, "o_proj", r->heads, (int64_t)H * dv, 0, H * dv, &L->o_proj, D, 0, &splits, &ss));
    PASS_STEP(p, "post_o", kdt_op_post_o(r->x, r->part, splits, ss, L->post_norm, c->rms_norm_eps, D, r->xn, p->m_dev, p->M, p->s));
    if (L->is_moe) KDT_TRY(moe(p, L, l));
    else KDT_TRY(dense_mlp(p, L));
    for (int32_t t = 0; t < rc->n_taps; t++)
        if (rc->tap_layers[t] == l)
            PASS_STEP(p, "taps", kdt_op_taps(r->x, D, p->hdr, p->rows, r->d_taps, r->opt.max_taps, t, p->M, p->s));
    return KDT_OK;
}

/* The pass's operations in order (each STEP / gemm / attention may be cut: kdt_gpu_runner_set_step_limit). */
static kdt_status run_pass(pass *p, const kdt_gpu_run_config *rc) {
    kdt_gpu_runner *r = p->r;
    const kdt_model_config *cfg = &r->g->cfg;
    const int32_t D = cfg->hidden_size;
    if (r->dtree_pending) {
        unsigned char *d = r->d_stage;
        const kdt_tree *t = &r->dtree;
        PASS_STEP(p, "stage_tree",
             kdt_op_stage_tree((kdt_gstage_hdr *)d, (kdt_grow *)(d + r->off_rows), (int32_t *)(d + r->off_head),
                               (uint64_t *)(d + r->off_masks), (const int32_t *)(d + r->off_streams), t->n_streams,
                               t->max_nodes, KDT_MASK_WORDS(t->max_nodes), t->n_nodes, t->token, t->position,
                               t->anc_mask, r->stream));
    }
    PASS_STEP(p, "embed", kdt_op_embed(p->hdr, p->rows, &r->g->embed, r->x, D, p->M, p->s));
    for (int32_t l = 0; l < cfg->n_layers; l++) KDT_TRY(layer(p, l, rc));
    if (rc->logits || rc->argmax) {
        PASS_STEP(p, "final_norm", kdt_op_rmsnorm(r->x, p->head, r->g->final_norm, cfg->rms_norm_eps, D, r->xn_head,
                                             &p->hdr->n_head, p->M, p->s));
        kdt_head_args h;
        memset(&h, 0, sizeof h);
        h.x = r->xn_head;
        h.kx = D;
        h.w = r->g->lm_head;
        h.m_dev = &p->hdr->n_head;
        h.m_max = p->M;
        h.rows = p->rows;
        h.head_rows = p->head;
        h.logits = rc->logits ? r->d_logits : NULL;
        h.am_val = r->am_val;
        h.am_idx = r->am_idx;
        h.am_ld = r->opt.max_rows;
        PASS_STEP(p, "lm_head", kdt_head_launch(&h, p->stages, p->s));
        if (rc->argmax)
            PASS_STEP(p, "argmax", kdt_op_argmax_final(r->am_val, r->am_idx, r->opt.max_rows,
                                                  (cfg->vocab_size + KDT_G_BN - 1) / KDT_G_BN, p->hdr, p->head, p->rows,
                                                  r->d_argmax, p->M, p->s));
    }
    return KDT_OK;
}


kdt_status kdt_gpu_run(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_gpu_run_config *rc) {
    static const char fn[] = "kdt_gpu_run";
    KDT_TRY(check_kv(fn, r, c));
    KDT_CHECK_ARG(rc, "%s: config is NULL", fn);
    const kdt_model_config *cfg = &r->g->cfg;
    KDT_CHECK_ARG(rc->max_rows >= 1 && rc->max_rows <= r->opt.max_rows, "%s: max_rows = %d (1..%d)", fn, rc->max_rows,
                  r->opt.max_rows);
    KDT_CHECK_ARG(!rc->logits || r->d_logits, "%s: logits requested but the runner has no logits buffer", fn);
    KDT_CHECK_ARG(rc->n_taps >= 0 && rc->n_taps <= r->opt.max_taps, "%s: n_taps = %d (0..%d)", fn, rc->n_taps,
                  r->opt.max_taps);
    KDT_CHECK_ARG(rc->n_taps == 0 || rc->tap_layers, "%s: n_taps = %d but tap_layers is NULL", fn, rc->n_taps);
    for (int32_t t = 0; t < rc->n_taps; t++)
        KDT_CHECK_ARG(rc->tap_layers[t] >= 0 && rc->tap_layers[t] < cfg->n_layers, "%s: tap_layers[%d] = %d (0..%d)",
                      fn, t, rc->tap_layers[t], cfg->n_layers - 1);
    KDT_CHECK_ARG(r->staged_rows <= rc->max_rows, "%s: %d staged rows exceed max_rows %d", fn, r->staged_rows,
                  rc->max_rows);
    pass p;
    p.r = r;
    p.c = c;
    p.g = r->g;
    p.s = r->stream;
    p.part = r->part;
    p.part_floats = r->part_floats;
    p.x_hl = r->x_hl;
    p.x_hl_elems = r->x_hl_elems;
    p.M = rc->max_rows;
    p.stages = r->stages;
    p.hdr = (const kdt_gstage_hdr *)r->d_stage;
    p.rows = (const kdt_grow *)(r->d_stage + r->off_rows);
    p.head = (const int32_t *)(r->d_stage + r->off_head);
    p.masks = (const uint64_t *)(r->d_stage + r->off_masks);
    p.m_dev = &p.hdr->n_rows;
    p.step = 0;
    p.plain_next = 0;
    KDT_TRY(run_pass(&p, rc));
    if (r->step_limit == 0) r->n_steps = p.step;
    return KDT_OK;
}

kdt_status kdt_gpu_runner_set_step_limit(kdt_gpu_runner *r, int32_t n_steps) {
    KDT_CHECK_ARG(r, "kdt_gpu_runner_set_step_limit: runner is NULL");
    KDT_CHECK_ARG(n_steps >= 0, "kdt_gpu_runner_set_step_limit: n_steps = %d (0 = all, or more)", n_steps);
    r->step_limit = n_steps;
    return KDT_OK;
}

int32_t kdt_gpu_runner_steps(const kdt_gpu_runner *r, const char **names, int32_t cap) {
    if (!r) return 0;
    for (int32_t i = 0; names && i < cap && i < r->n_steps && i < KDT_GPU_STEP_NAMES; i++) names[i] = r->step_names[i];
    return r->n_steps;
}

/* ---- graphs -------------------------------------------------------------------------------- */

kdt_status kdt_gpu_graph_capture(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_gpu_run_config *rc, kdt_gpu_graph **out) {
    KDT_CHECK_ARG(out, "kdt_gpu_graph_capture: out is NULL");
    *out = NULL;
    KDT_CHECK_ARG(r && c && rc, "kdt_gpu_graph_capture: NULL argument");
    kdt_gpu_graph *gr = calloc(1, sizeof *gr);
    if (!gr) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_graph_capture");
    cudaError_t e = cudaStreamBeginCapture(r->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        free(gr);
        return cuda_fail(e, "kdt_gpu_graph_capture: begin");
    }
    kdt_status st = kdt_gpu_run(r, c, rc);
    cudaGraph_t graph = NULL;
    e = cudaStreamEndCapture(r->stream, &graph);
    if (st == KDT_OK && e != cudaSuccess) st = cuda_fail(e, "kdt_gpu_graph_capture: end");
    if (st == KDT_OK && (e = cudaGraphInstantiate(&gr->exec, graph, 0)) != cudaSuccess)
        st = cuda_fail(e, "kdt_gpu_graph_capture: instantiate");
    if (st != KDT_OK) {
        if (graph) cudaGraphDestroy(graph);
        free(gr);
        return st;
    }
    gr->r = r;
    gr->graph = graph;
    gr->max_rows = rc->max_rows;
    gr->absorbed = r->staged_absorbed;
    gr->n_plain = r->n_plain;
    if (r->n_plain > 0) {
        gr->plain = malloc((size_t)r->n_plain * sizeof *gr->plain);
        if (!gr->plain) {
            kdt_gpu_graph_free(gr);
            return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_graph_capture");
        }
        memcpy(gr->plain, r->plain_segs, (size_t)r->n_plain * sizeof *gr->plain);
    }
    gr->n_windows = r->n_windows;
    if (r->n_windows > 1) {
        gr->win_row = malloc(((size_t)r->n_windows + 1) * sizeof *gr->win_row);
        if (!gr->win_row) {
            kdt_gpu_graph_free(gr);
            return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "kdt_gpu_graph_capture");
        }
        memcpy(gr->win_row, r->win_row, ((size_t)r->n_windows + 1) * sizeof *gr->win_row);
    }
    *out = gr;
    return KDT_OK;
}

kdt_status kdt_gpu_graph_launch(kdt_gpu_graph *g) {
    KDT_CHECK_ARG(g, "kdt_gpu_graph_launch: graph is NULL");
    KDT_CHECK_ARG(g->r->staged_rows <= g->max_rows, "kdt_gpu_graph_launch: %d staged rows, the graph holds %d",
                  g->r->staged_rows, g->max_rows);
    /* plain prefill segments' launches carry their streams, slots and rows: such a graph replays
     * only a pass staged with the same segments */
    const kdt_gpu_runner *r = g->r;
    KDT_CHECK_ARG(g->absorbed == r->staged_absorbed && g->n_plain == r->n_plain &&
                      (g->n_plain == 0 || !memcmp(g->plain, r->plain_segs, (size_t)g->n_plain * sizeof *g->plain)),
                  "kdt_gpu_graph_launch: the graph was captured for %s, the staged pass is %s",
                  g->n_plain ? "a plain-form prefill chunk" : "an absorbed-form pass",
                  r->n_plain ? "another plain-form prefill chunk" : "an absorbed-form pass");
    /* the attention's windows are launches with their rows baked in */
    KDT_CHECK_ARG(g->n_windows == r->n_windows &&
                      (g->n_windows == 1 || !memcmp(g->win_row, r->win_row, ((size_t)g->n_windows + 1) * sizeof(int))),
                  "kdt_gpu_graph_launch: the graph was captured for %d attention window(s), the staged pass has %d "
                  "or other bounds (its rows' splits exceed the attention workspace: recapture, or raise "
                  "attn_workspace_kb)", g->n_windows, r->n_windows);
    const cudaError_t e = cudaGraphLaunch(g->exec, g->r->stream);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "kdt_gpu_graph_launch");
}

void kdt_gpu_graph_free(kdt_gpu_graph *g) {
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->graph) cudaGraphDestroy(g->graph);
    free(g->plain);
    free(g->win_row);
    free(g);
}

/* ---- synchronous API ------------------------------------------------------------------------ */

static kdt_status check_outputs(const char *fn, const kdt_gpu_runner *r, const kdt_model_outputs *out) {
    if (!out) return KDT_OK;
    KDT_CHECK_ARG(out->n_taps >= 0 && out->n_taps <= KDT_MODEL_MAX_TAPS, "%s: n_taps = %d (0..%d)", fn, out->n_taps,
                  KDT_MODEL_MAX_TAPS);
    if (out->n_taps > 0) {
        KDT_CHECK_ARG(out->tap_layers && out->taps, "%s: n_taps = %d but tap_layers or taps is NULL", fn, out->n_taps);
        for (int32_t t = 0; t < out->n_taps; t++)
            KDT_CHECK_ARG(out->tap_layers[t] >= 0 && out->tap_layers[t] < r->g->cfg.n_layers,
                          "%s: tap_layers[%d] = %d (0..%d)", fn, t, out->tap_layers[t], r->g->cfg.n_layers - 1);
        KDT_CHECK_ARG(out->n_taps <= r->opt.max_taps, "%s: %d taps, the runner holds %d", fn, out->n_taps,
                      r->opt.max_taps);
    }
    KDT_CHECK_ARG(!out->logits || r->d_logits, "%s: logits requested from a runner made without logits", fn);
    return KDT_OK;
}

static kdt_gpu_run_config run_config(int32_t rows, const kdt_model_outputs *out) {
    kdt_gpu_run_config rc = {rows, 0, 0, 0, NULL};
    if (out) {
        rc.logits = out->logits != NULL;
        rc.argmax = out->argmax != NULL;
        rc.n_taps = out->n_taps;
        rc.tap_layers = out->tap_layers;
    }
    return rc;
}

/* Copies n output rows (device rows dev0.., host rows host0..). want_head: logits/argmax too. */
static kdt_status fetch(kdt_gpu_runner *r, const kdt_model_outputs *out, int64_t dev0, int64_t host0, int64_t n,
                        int want_head, int want_taps) {
    if (!out || n <= 0) return KDT_OK;
    const int64_t V = r->g->cfg.vocab_size, D = r->g->cfg.hidden_size;
    cudaError_t e = cudaSuccess;
    if (want_head && out->argmax)
        e = cudaMemcpy(out->argmax + host0, r->d_argmax + dev0, (size_t)n * sizeof(int32_t), cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && want_head && out->logits)
        e = cudaMemcpy(out->logits + host0 * V, r->d_logits + dev0 * V, (size_t)(n * V) * sizeof(float),
                       cudaMemcpyDeviceToHost);
    if (e == cudaSuccess && want_taps && out->n_taps > 0)
        e = cudaMemcpy2D(out->taps + host0 * out->n_taps * D, (size_t)out->n_taps * D * sizeof(float),
                         r->d_taps + dev0 * r->opt.max_taps * D, (size_t)r->opt.max_taps * D * sizeof(float),
                         (size_t)out->n_taps * D * sizeof(float), (size_t)n, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "GPU forward: outputs");
}

kdt_status kdt_gpu_decode(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams, const int32_t *stream_ids,
                          const int32_t *tokens, const kdt_model_outputs *out) {
    static const char fn[] = "kdt_gpu_decode";
    KDT_CHECK_ARG(r, "%s: runner is NULL", fn);
    KDT_TRY(check_outputs(fn, r, out));
    KDT_TRY(kdt_gpu_stage_decode(r, c, n_streams, stream_ids, tokens));
    const kdt_gpu_run_config rc = run_config(n_streams, out);
    KDT_TRY(kdt_gpu_run(r, c, &rc));
    KDT_TRY(kdt_gpu_runner_sync(r));
    return fetch(r, out, 0, 0, n_streams, 1, 1);
}

kdt_status kdt_gpu_verify(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *tree, const int32_t *stream_ids,
                          const kdt_model_outputs *out) {
    static const char fn[] = "kdt_gpu_verify";
    KDT_CHECK_ARG(r, "%s: runner is NULL", fn);
    KDT_TRY(check_outputs(fn, r, out));
    KDT_TRY(kdt_gpu_stage_verify(r, c, tree, stream_ids));
    const kdt_gpu_run_config rc = run_config(tree->n_streams * tree->max_nodes, out);
    KDT_TRY(kdt_gpu_run(r, c, &rc));
    KDT_TRY(kdt_gpu_runner_sync(r));
    for (int32_t s = 0; s < tree->n_streams; s++) {
        const int64_t row0 = (int64_t)s * tree->max_nodes;
        KDT_TRY(fetch(r, out, row0, row0, tree->n_nodes[s], 1, 1));
    }
    return KDT_OK;
}

kdt_status kdt_gpu_prefill(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, const int32_t *tokens, int32_t n,
                           const kdt_model_outputs *out) {
    static const char fn[] = "kdt_gpu_prefill";
    KDT_CHECK_ARG(r, "%s: runner is NULL", fn);
    KDT_TRY(check_kv(fn, r, c));
    KDT_TRY(check_outputs(fn, r, out));
    KDT_CHECK_ARG(tokens, "%s: tokens is NULL", fn);
    KDT_CHECK_ARG(n >= 1, "%s: n = %d", fn, n);
    KDT_CHECK_ARG(stream >= 0 && stream < c->max_streams, "%s: stream %d (0..%d)", fn, stream, c->max_streams - 1);
    /* everything is checked and every page reserved before the first chunk runs */
    for (int32_t i = 0; i < n; i++) KDT_TRY(check_token(fn, r, tokens[i], "tokens", i));
    const int32_t len = c->length[stream];
    if ((int64_t)len + n > r->g->cfg.max_position_embeddings)
        return kdt_fail(KDT_ERR_CAPACITY, "%s: stream %d: %d + %d tokens exceed max_position_embeddings %d", fn, stream,
                        len, n, r->g->cfg.max_position_embeddings);
    KDT_TRY(check_reach(fn, r, stream, (int64_t)len + n - 1, (int64_t)len + n));
    const int32_t need = len + n;
    KDT_TRY(kdt_gkv_reserve_many(c, 1, &stream, &need));
    const int32_t chunk = r->opt.max_rows;
    const int last_only = out && out->last_only;
    for (int32_t i0 = 0; i0 < n; i0 += chunk) {
        const int32_t m = n - i0 < chunk ? n - i0 : chunk;
        const int last = i0 + m == n;
        KDT_TRY(kdt_gpu_stage_prefill(r, c, stream, tokens + i0, m, last_only));
        kdt_gpu_run_config rc = run_config(m, out);
        if (last_only && !last) rc.logits = rc.argmax = 0;
        KDT_TRY(kdt_gpu_run(r, c, &rc));
        KDT_TRY(kdt_gpu_runner_sync(r));
        if (last_only) {
            KDT_TRY(fetch(r, out, 0, i0, m, 0, 1));
            if (last) KDT_TRY(fetch(r, out, 0, 0, 1, 1, 0));
        } else {
            KDT_TRY(fetch(r, out, 0, i0, m, 1, 1));
        }
    }
    return KDT_OK;
}

/* ---- KV commit and helpers ------------------------------------------------------------------ */

kdt_status kdt_gpu_kv_commit(kdt_gpu_runner *r, kdt_gpu_kv *k, int32_t n_streams, const int32_t *stream_ids,
                             const int32_t *accepted, const int32_t *tau) {
    static const char fn[] = "kdt_gpu_kv_commit";
    KDT_TRY(check_kv(fn, r, k));
    KDT_CHECK_ARG(accepted && tau, "%s: NULL argument", fn);
    KDT_CHECK_ARG(n_streams >= 1 && n_streams <= k->max_streams, "%s: n_streams = %d", fn, n_streams);
    for (int32_t i = 0; i < n_streams; i++) {
        const int32_t s = stream_ids ? stream_ids[i] : i;
        KDT_CHECK_ARG(s >= 0 && s < k->max_streams, "%s: stream_ids[%d] = %d", fn, i, s);
        for (int32_t j = 0; j < i; j++)
            KDT_CHECK_ARG((stream_ids ? stream_ids[j] : j) != s, "%s: stream %d listed twice", fn, s);
        const int32_t t = tau[i], tree_rows = k->written[s] - k->length[s];
        KDT_CHECK_ARG(t >= 0 && t <= KDT_MAX_PATH && t <= tree_rows, "%s: stream %d: tau %d (tree has %d rows)", fn, s,
                      t, tree_rows);
        for (int32_t a = 0; a < t; a++) {
            const int32_t node = accepted[(int64_t)i * KDT_MAX_PATH + a];
            const int32_t prev = a ? accepted[(int64_t)i * KDT_MAX_PATH + a - 1] : -1;
            KDT_CHECK_ARG(!(node <= prev || node >= tree_rows || (a == 0 && node != 0)), "%s: stream %d: accepted[%d] = %d",
                          fn, s, a, node);
        }
    }
    cudaError_t e = cudaStreamSynchronize(r->stream);
    if (e != cudaSuccess) return cuda_fail(e, fn);
    KDT_TRY(kdt_gkv_flush_pending_sync(k));
    const size_t n_table = (size_t)n_streams * k->max_pages;
    const size_t bytes = (n_table + (size_t)n_streams * (2 + KDT_MAX_PATH)) * sizeof(int32_t);
    if (bytes > r->commit_bytes) {
        if (r->commit_buf) cudaFree(r->commit_buf);
        r->commit_buf = NULL;
        r->commit_bytes = 0;
        if ((e = cudaMalloc((void **)&r->commit_buf, bytes)) != cudaSuccess) return cuda_fail(e, fn);
        r->commit_bytes = bytes;
    }
    int32_t *h = malloc(bytes);
    if (!h) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s", fn);
    int32_t *table = h, *prefix = h + n_table, *tau_h = prefix + n_streams, *acc = tau_h + n_streams;
    for (int32_t i = 0; i < n_streams; i++) {
        const int32_t s = stream_ids ? stream_ids[i] : i;
        memcpy(table + (size_t)i * k->max_pages, k->block_table + (int64_t)s * k->max_pages,
               (size_t)k->max_pages * sizeof(int32_t));
        prefix[i] = k->length[s];
        tau_h[i] = tau[i];
    }
    memcpy(acc, accepted, (size_t)n_streams * KDT_MAX_PATH * sizeof(int32_t));
    e = cudaMemcpyAsync(r->commit_buf, h, bytes, cudaMemcpyHostToDevice, r->stream); /* pageable: staged */
    if (e == cudaSuccess) e = cudaStreamSynchronize(r->stream);
    free(h);
    if (e != cudaSuccess) return cuda_fail(e, fn);
    const int32_t *d = r->commit_buf;
    kdt_kv_commit_params p;
    memset(&p, 0, sizeof p);
    p.n_streams = n_streams;
    p.n_layers = k->n_layers;
    p.row_bytes = k->row_stride * 2;
    p.page_size = k->page_size;
    p.n_pages = k->n_pages;
    p.cache = k->cache;
    p.layer_stride_bytes = k->layer_stride * 2;
    p.block_table = d;
    p.max_pages = k->max_pages;
    p.prefix_len = d + n_table;
    p.tau = d + n_table + n_streams;
    p.accepted = d + n_table + 2 * (size_t)n_streams;
    KDT_TRY(kdt_kv_commit_cuda(&p, r->stream));
    KDT_TRY(kdt_gpu_runner_sync(r));
    for (int32_t i = 0; i < n_streams; i++) {
        const int32_t s = stream_ids ? stream_ids[i] : i;
        if (tau[i] > 0) KDT_TRY(kdt_gpu_kv_stream_set_length(k, s, k->length[s] + tau[i]));
    }
    return KDT_OK;
}

kdt_status kdt_gpu_kv_fill_random(kdt_gpu_runner *r, kdt_gpu_kv *k, int32_t stream, int32_t n_slots, uint64_t seed) {
    static const char fn[] = "kdt_gpu_kv_fill_random";
    KDT_TRY(check_kv(fn, r, k));
    KDT_CHECK_ARG(stream >= 0 && stream < k->max_streams, "%s: stream %d (0..%d)", fn, stream, k->max_streams - 1);
    KDT_CHECK_ARG(n_slots >= 1 && n_slots <= k->max_position, "%s: n_slots = %d", fn, n_slots);
    KDT_TRY(kdt_gkv_reserve_many(k, 1, &stream, &n_slots));
    cudaError_t e = cudaStreamSynchronize(r->stream);
    if (e != cudaSuccess) return cuda_fail(e, fn);
    KDT_TRY(kdt_gkv_flush_pending_sync(k));
    KDT_TRY(kdt_op_fill_kv(k->cache, k->layer_stride, k->n_layers, k->d_block_table + (int64_t)stream * k->max_pages,
                       k->page_size, k->row_stride, k->row_elems, n_slots, seed, r->stream));
    KDT_TRY(kdt_gpu_runner_sync(r));
    k->length[stream] = k->written[stream] = n_slots;
    return KDT_OK;
}

kdt_status kdt_gpu_runner_expert_counts(kdt_gpu_runner *r, int32_t layer, int32_t *counts) {
    KDT_CHECK_ARG(r && counts, "kdt_gpu_runner_expert_counts: NULL argument");
    const kdt_model_config *c = &r->g->cfg;
    KDT_CHECK_ARG(layer >= 0 && layer < c->n_layers && r->g->layers[layer].is_moe,
                  "kdt_gpu_runner_expert_counts: layer %d is not a MoE layer", layer);
    KDT_TRY(kdt_gpu_runner_sync(r));
    const cudaError_t e = cudaMemcpy(counts, r->expert_counts + (int64_t)layer * (c->n_routed_experts + 1),
                                     (size_t)(c->n_routed_experts + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? KDT_OK : cuda_fail(e, "kdt_gpu_runner_expert_counts");
}

kdt_status kdt_gpu_runner_flush_l2(kdt_gpu_runner *r) {
    KDT_CHECK_ARG(r, "kdt_gpu_runner_flush_l2: runner is NULL");
    if (!r->flush_buf) {
        int l2 = 0;
        cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, r->g->device);
        const size_t bytes = (size_t)(l2 > 0 ? l2 : (64 << 20)) * 4;
        cudaError_t e = cudaMalloc((void **)&r->flush_buf, bytes + 16);
        if (e == cudaSuccess) e = cudaMemsetAsync(r->flush_buf, 0x3c, bytes + 16, r->stream); /* finite floats */
        if (e != cudaSuccess) return cuda_fail(e, "kdt_gpu_runner_flush_l2");
        r->flush_bytes = bytes;
    }
    return kdt_op_flush_read(r->flush_buf, (int64_t)(r->flush_bytes / sizeof(float)),
                             r->flush_buf + r->flush_bytes / sizeof(float), r->stream);
}
