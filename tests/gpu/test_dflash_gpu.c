/* test_dflash_gpu.c - the DFlash drafter on the GPU (engine/dflash_gpu.h) against the CPU drafter
 * (engine/dflash.h), on models/tiny-target + models/tiny-dflash. Needs a CUDA device.
 *
 * Features are real: the CPU target's prefill taps (the drafter's tap layers) of random prompts
 * (5, 37 and 70 tokens, plus 8 continuation tokens per prompt for the accepted-path appends).
 *   accuracy      CPU contexts (kdt_dflash_ctx_append) vs GPU slots (kdt_dflash_gpu_append in
 *                 two interleaved calls, scrambled slots, a device count below the launch bound,
 *                 an out-of-range item that must be skipped): per stream
 *                 max |gpu - cpu| / max |cpu| <= 1e-3 over all logits, and the argmax equal at
 *                 >= 95% of all (stream, depth) positions.
 *   batch         3 streams drafted together == each alone == in another order, bit for bit.
 *   accepted      kdt_dflash_gpu_append_accepted (hand-made tau / acc_nodes into a padded tree
 *                 feature buffer) == the same rows through kdt_dflash_gpu_append into twin slots:
 *                 the next draft's logits are bitwise equal; both match the CPU (tolerance above).
 *   graph         append + draft captured in a CUDA graph and replayed == eager, bit for bit.
 *   bad inputs    host-side checks give KDT_ERR_INVALID_ARG with a message.
 * Device outputs are NaN-poisoned before every draft. KDT_TEST_QUICK=1 drops the 70-token prompt
 * and the graph test.
 */
#include <cuda_runtime_api.h>

#include "t.h"

#ifdef KDT_WITH_MODEL
#include "gpu/gpu_test_util.h"

#include "engine/dflash.h"
#include "engine/dflash_gpu.h"
#include "kdtree/model.h"

#include <string.h>

#define TARGET_DIR KDT_SOURCE_DIR "/models/tiny-target"
#define DRAFT_DIR KDT_SOURCE_DIR "/models/tiny-dflash"
#define REL_TOL 1e-3
#define ARGMAX_MIN 0.95
#define N_EXTRA 8          /* continuation tokens per prompt (accepted-path features) */
#define MAX_SLOTS 24
#define MAX_LEN 256
#define MAX_DRAFT 4
#define MAX_APPEND 128
#define MAX_PROMPTS 3

static int quick;
static kdt_model *g_m;
static kdt_dflash *g_d;
static kdt_gpu_model *g_gm;
static kdt_dflash_gpu *g_dg;
static cudaStream_t g_stream;
static int g_V, g_L, g_D, g_nt, g_row; /* vocab, draft depth, hidden, taps, floats per feature row */

typedef struct prompt {
    int n;              /* context tokens */
    int32_t tok[128];
    float *feat;        /* [n + N_EXTRA][n_taps * D] */
    float *d_feat;      /* device copy */
    kdt_dflash_ctx *ctx;/* CPU context (first n rows) */
    int slot;           /* GPU slot holding the same context */
} prompt;

static prompt g_p[MAX_PROMPTS];
static int g_np;

/* ---- helpers ---------------------------------------------------------------------------------- */

static int32_t *dev_ints(const int32_t *h, int n) { return dev_copy(h, (size_t)n * sizeof(int32_t)); }

static void sync(void) { CUDA_OK(cudaStreamSynchronize(g_stream)); }

/* GPU append of host item lists (device copies made here) */
static kdt_status gpu_append(int n, int max_items, const int32_t *slot, const int32_t *pos, const int32_t *row,
                             const float *d_feat, int64_t stride) {
    int32_t *dn = dev_ints(&n, 1), *ds = dev_ints(slot, max_items), *dp = dev_ints(pos, max_items),
            *dr = dev_ints(row, max_items);
    const kdt_status st = kdt_dflash_gpu_append(g_dg, dn, max_items, ds, dp, dr, d_feat, stride);
    if (st != KDT_OK) fprintf(stderr, "  gpu append: %s\n", kdt_last_error());
    sync();
    cudaFree(dn);
    cudaFree(ds);
    cudaFree(dp);
    cudaFree(dr);
    return st;
}

/* GPU draft of n streams into host logits [n][L][V] (device buffer NaN-poisoned first) */
static kdt_status gpu_draft(int n, const int32_t *slot, const int32_t *prefix, const int32_t *anchor, float *out) {
    const size_t bytes = (size_t)n * g_L * g_V * sizeof(float);
    float *dl = NULL;
    CUDA_OK(cudaMalloc((void **)&dl, bytes));
    CUDA_OK(cudaMemset(dl, 0xff, bytes));
    int32_t *ds = dev_ints(slot, n), *dp = dev_ints(prefix, n), *da = dev_ints(anchor, n);
    const kdt_status st = kdt_dflash_gpu_draft(g_dg, n, ds, dp, da, dl);
    if (st != KDT_OK) fprintf(stderr, "  gpu draft: %s\n", kdt_last_error());
    sync();
    CUDA_OK(cudaMemcpy(out, dl, bytes, cudaMemcpyDeviceToHost));
    cudaFree(dl);
    cudaFree(ds);
    cudaFree(dp);
    cudaFree(da);
    return st;
}

static int row_argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return best;
}

static int all_finite(const float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i])) return 0;
    return 1;
}

/* Compares one stream's [L][V] logits; adds its argmax agreement to *agree / *total. */
static void compare_stream(const char *what, int s, int P, const float *gpu, const float *cpu, int *agree,
                           int *total) {
    double err = 0, mag = 0;
    const size_t n = (size_t)g_L * g_V;
    for (size_t i = 0; i < n; i++) {
        const double e = isfinite(gpu[i]) ? fabs((double)gpu[i] - cpu[i]) : INFINITY;
        if (e > err) err = e;
        if (fabs(cpu[i]) > mag) mag = fabs(cpu[i]);
    }
    int same = 0;
    for (int t = 0; t < g_L; t++)
        same += row_argmax(gpu + (size_t)t * g_V, g_V) == row_argmax(cpu + (size_t)t * g_V, g_V);
    *agree += same;
    *total += g_L;
    const double rel = mag > 0 ? err / mag : err;
    printf("  %s stream %d (P=%d): max|diff| %.3e  max|ref| %.3e  rel %.3e  argmax %d/%d\n", what, s, P, err, mag,
           rel, same, g_L);
    CHECK_MSG(all_finite(gpu, n), "%s stream %d: non-finite logits", what, s);
    CHECK_MSG(rel <= REL_TOL, "%s stream %d: relative error %.3e > %g", what, s, rel, REL_TOL);
}

/* ---- setup ------------------------------------------------------------------------------------ */

static int setup(void) {
    kdt_model_options mo = {0, 0, KDT_PREFILL_ABSORBED};
    if (kdt_model_load(TARGET_DIR, &mo, &g_m) != KDT_OK) {
        fprintf(stderr, "load %s: %s\n", TARGET_DIR, kdt_last_error());
        return 0;
    }
    if (kdt_dflash_load(DRAFT_DIR, g_m, NULL, &g_d) != KDT_OK) {
        fprintf(stderr, "load %s: %s\n", DRAFT_DIR, kdt_last_error());
        return 0;
    }
    kdt_gpu_options go = {0, 0, 0};
    if (kdt_model_to_gpu(g_m, &go, &g_gm) != KDT_OK) {
        fprintf(stderr, "kdt_model_to_gpu: %s\n", kdt_last_error());
        return 0;
    }
    CUDA_OK(cudaStreamCreate(&g_stream));
    kdt_dflash_gpu_options o = {MAX_SLOTS, MAX_LEN, MAX_DRAFT, MAX_APPEND, (void *)g_stream};
    if (kdt_dflash_to_gpu(g_d, g_gm, &o, &g_dg) != KDT_OK) {
        fprintf(stderr, "kdt_dflash_to_gpu: %s\n", kdt_last_error());
        return 0;
    }
    const kdt_dflash_config *c = kdt_dflash_get_config(g_d);
    g_V = kdt_model_get_config(g_m)->vocab_size;
    g_L = c->block_size - 1;
    g_D = c->hidden_size;
    g_nt = c->n_taps;
    g_row = g_nt * g_D;
    printf("  drafter: D %d, layers %d, heads %d/%d x %d, block %d, taps %d; target vocab %d\n", g_D, c->n_layers,
           c->n_heads, c->n_kv_heads, c->head_dim, c->block_size, g_nt, g_V);

    /* prompts: CPU prefill with taps gives the features of n + N_EXTRA tokens */
    const int lens[MAX_PROMPTS] = {5, 37, 70};
    const int slots[MAX_PROMPTS] = {5, 2, 7};
    g_np = quick ? 2 : 3;
    kdt_kv_cache_options ko = {16, MAX_PROMPTS, 0};
    kdt_kv_cache *kv = NULL;
    if (kdt_kv_cache_create(g_m, &ko, &kv) != KDT_OK) {
        fprintf(stderr, "kv cache: %s\n", kdt_last_error());
        return 0;
    }
    uint64_t rng = 1234;
    for (int i = 0; i < g_np; i++) {
        prompt *p = &g_p[i];
        p->n = lens[i];
        p->slot = slots[i];
        const int n_all = p->n + N_EXTRA;
        for (int t = 0; t < n_all; t++) p->tok[t] = t_rand_int(&rng, g_V);
        p->feat = xmalloc((size_t)n_all * g_row * sizeof(float));
        kdt_model_outputs out = {NULL, NULL, 0, g_nt, c->tap_layers, p->feat};
        if (kdt_model_prefill(g_m, kv, i, p->tok, n_all, &out) != KDT_OK) {
            fprintf(stderr, "prefill: %s\n", kdt_last_error());
            return 0;
        }
        p->d_feat = dev_copy(p->feat, (size_t)n_all * g_row * sizeof(float));
        if (kdt_dflash_ctx_create(g_d, MAX_LEN, &p->ctx) != KDT_OK ||
            kdt_dflash_ctx_append(g_d, p->ctx, p->feat, p->n) != KDT_OK) {
            fprintf(stderr, "cpu context: %s\n", kdt_last_error());
            return 0;
        }
    }
    kdt_kv_cache_free(kv);
    return 1;
}

/* Appends the first n rows of every prompt to its slot (or slot + slot_shift) in two interleaved
 * calls, with a launch bound above the device count and an out-of-range item inside it. */
static void append_prompts(int slot_shift) {
    /* all prompts' features in one buffer, prompt-major */
    int total = 0;
    for (int i = 0; i < g_np; i++) total += g_p[i].n;
    float *d_all = NULL;
    CUDA_OK(cudaMalloc((void **)&d_all, (size_t)total * g_row * sizeof(float)));
    int base[MAX_PROMPTS], off = 0;
    for (int i = 0; i < g_np; i++) {
        base[i] = off;
        CUDA_OK(cudaMemcpy(d_all + (size_t)off * g_row, g_p[i].feat, (size_t)g_p[i].n * g_row * sizeof(float),
                           cudaMemcpyHostToDevice));
        off += g_p[i].n;
    }
    for (int half = 0; half < 2; half++) {
        int32_t slot[MAX_APPEND], pos[MAX_APPEND], row[MAX_APPEND];
        int n = 0;
        for (int k = 0; k < 128; k++)
            for (int i = 0; i < g_np; i++) {
                const int lo = half ? g_p[i].n / 2 : 0, hi = half ? g_p[i].n : g_p[i].n / 2;
                if (lo + k >= hi) continue;
                slot[n] = g_p[i].slot + slot_shift;
                pos[n] = lo + k;
                row[n] = base[i] + lo + k;
                n++;
            }
        /* inside the count: a slot out of range (skipped); beyond it: items that would corrupt */
        slot[n] = MAX_SLOTS + 3;
        pos[n] = 0;
        row[n] = 0;
        n++;
        const int max_items = n + 3;
        for (int j = n; j < max_items; j++) {
            slot[j] = g_p[0].slot + slot_shift;
            pos[j] = 0;
            row[j] = total - 1;
        }
        CHECK(max_items <= MAX_APPEND);
        CHECK_EQ_INT(gpu_append(n, max_items, slot, pos, row, d_all, g_row), KDT_OK);
    }
    cudaFree(d_all);
}

/* ---- tests ------------------------------------------------------------------------------------ */

static int32_t g_anchor[MAX_PROMPTS];

static void test_accuracy(void) {
    append_prompts(0);
    uint64_t rng = 77;
    int32_t slot[MAX_PROMPTS], prefix[MAX_PROMPTS];
    kdt_dflash_ctx *ctx[MAX_PROMPTS];
    for (int i = 0; i < g_np; i++) {
        g_anchor[i] = t_rand_int(&rng, g_V);
        slot[i] = g_p[i].slot;
        prefix[i] = g_p[i].n;
        ctx[i] = g_p[i].ctx;
    }
    const size_t per = (size_t)g_L * g_V;
    float *cpu = xmalloc(g_np * per * sizeof(float)), *gpu = xmalloc(g_np * per * sizeof(float));
    CHECK_EQ_INT(kdt_dflash_draft(g_d, ctx, g_np, g_anchor, cpu), KDT_OK);
    CHECK_EQ_INT(gpu_draft(g_np, slot, prefix, g_anchor, gpu), KDT_OK);
    int agree = 0, total = 0;
    for (int i = 0; i < g_np; i++) compare_stream("accuracy", i, prefix[i], gpu + i * per, cpu + i * per, &agree, &total);
    printf("  accuracy: argmax agreement %d/%d (%.1f%%)\n", agree, total, 100.0 * agree / total);
    CHECK_MSG(agree >= ARGMAX_MIN * total, "argmax agreement %d/%d below %.0f%%", agree, total, 100 * ARGMAX_MIN);
    free(cpu);
    free(gpu);
}

static void test_batch_invariance(void) {
    const size_t per = (size_t)g_L * g_V;
    int32_t slot[MAX_PROMPTS], prefix[MAX_PROMPTS];
    for (int i = 0; i < g_np; i++) {
        slot[i] = g_p[i].slot;
        prefix[i] = g_p[i].n;
    }
    float *all = xmalloc(g_np * per * sizeof(float)), *one = xmalloc(per * sizeof(float));
    CHECK_EQ_INT(gpu_draft(g_np, slot, prefix, g_anchor, all), KDT_OK);
    for (int i = 0; i < g_np; i++) {
        CHECK_EQ_INT(gpu_draft(1, slot + i, prefix + i, g_anchor + i, one), KDT_OK);
        CHECK_MSG(memcmp(one, all + i * per, per * sizeof(float)) == 0, "stream %d alone != within %d streams", i,
                  g_np);
    }
    /* reversed order, plus a repeat of stream 0 (n + 1 <= MAX_DRAFT) */
    int32_t ps[MAX_DRAFT], pp[MAX_DRAFT], pa[MAX_DRAFT];
    for (int j = 0; j < g_np; j++) {
        ps[j] = slot[g_np - 1 - j];
        pp[j] = prefix[g_np - 1 - j];
        pa[j] = g_anchor[g_np - 1 - j];
    }
    ps[g_np] = slot[0];
    pp[g_np] = prefix[0];
    pa[g_np] = g_anchor[0];
    float *rev = xmalloc((g_np + 1) * per * sizeof(float));
    CHECK_EQ_INT(gpu_draft(g_np + 1, ps, pp, pa, rev), KDT_OK);
    for (int j = 0; j < g_np; j++)
        CHECK_MSG(memcmp(rev + j * per, all + (g_np - 1 - j) * per, per * sizeof(float)) == 0,
                  "reversed batch: stream %d differs", g_np - 1 - j);
    CHECK_MSG(memcmp(rev + g_np * per, all, per * sizeof(float)) == 0, "repeated stream 0 differs");
    printf("  batch invariance: %d streams together == alone == reversed (memcmp)\n", g_np);
    free(all);
    free(one);
    free(rev);
}

static void test_append_accepted(void) {
    /* twin slots (slot + 10) get the same context through the plain append */
    append_prompts(10);
    const int tree_stride = 12, row_stride = g_row + g_D; /* padded rows, as a runner with max_taps > n_taps */
    const int taus[MAX_PROMPTS] = {3, 0, 5};
    const int nodes[MAX_PROMPTS][KDT_MAX_PATH] = {{0, 4, 9}, {0}, {0, 1, 7, 8, 11}};
    /* tree feature buffer: garbage (another prompt's rows) except at the accepted nodes */
    float *tree = xmalloc((size_t)g_np * tree_stride * row_stride * sizeof(float));
    for (int s = 0; s < g_np; s++)
        for (int j = 0; j < tree_stride; j++) {
            const prompt *o = &g_p[(s + 1) % g_np];
            float *dst = tree + ((size_t)s * tree_stride + j) * row_stride;
            memcpy(dst, o->feat + (size_t)(j % o->n) * g_row, (size_t)g_row * sizeof(float));
            for (int e = g_row; e < row_stride; e++) dst[e] = NAN;
        }
    int32_t slot[MAX_PROMPTS], prefix[MAX_PROMPTS], tau[MAX_PROMPTS], acc[MAX_PROMPTS * KDT_MAX_PATH];
    int32_t islot[MAX_APPEND], ipos[MAX_APPEND], irow[MAX_APPEND];
    int n_items = 0;
    for (int s = 0; s < g_np; s++) {
        slot[s] = g_p[s].slot;
        prefix[s] = g_p[s].n;
        tau[s] = taus[s];
        for (int k = 0; k < KDT_MAX_PATH; k++) acc[s * KDT_MAX_PATH + k] = k < taus[s] ? nodes[s][k] : 999;
        for (int k = 0; k < taus[s]; k++) {
            memcpy(tree + ((size_t)s * tree_stride + nodes[s][k]) * row_stride,
                   g_p[s].feat + (size_t)(g_p[s].n + k) * g_row, (size_t)g_row * sizeof(float));
            islot[n_items] = g_p[s].slot + 10;
            ipos[n_items] = g_p[s].n + k;
            irow[n_items] = s * tree_stride + nodes[s][k];
            n_items++;
        }
    }
    float *d_tree = dev_copy(tree, (size_t)g_np * tree_stride * row_stride * sizeof(float));
    int32_t *ds = dev_ints(slot, g_np), *dp = dev_ints(prefix, g_np), *dt = dev_ints(tau, g_np),
            *da = dev_ints(acc, g_np * KDT_MAX_PATH);
    CHECK_EQ_INT(kdt_dflash_gpu_append_accepted(g_dg, g_np, ds, dp, dt, da, tree_stride, d_tree, row_stride), KDT_OK);
    sync();
    CHECK_EQ_INT(gpu_append(n_items, n_items, islot, ipos, irow, d_tree, row_stride), KDT_OK);

    /* CPU: the same continuation rows */
    for (int s = 0; s < g_np; s++)
        CHECK_EQ_INT(kdt_dflash_ctx_append(g_d, g_p[s].ctx, g_p[s].feat + (size_t)g_p[s].n * g_row, taus[s]), KDT_OK);
    const size_t per = (size_t)g_L * g_V;
    int32_t pre2[MAX_PROMPTS], twin[MAX_PROMPTS], anchor[MAX_PROMPTS];
    kdt_dflash_ctx *ctx[MAX_PROMPTS];
    uint64_t rng = 99;
    for (int s = 0; s < g_np; s++) {
        pre2[s] = g_p[s].n + taus[s];
        twin[s] = g_p[s].slot + 10;
        anchor[s] = t_rand_int(&rng, g_V);
        ctx[s] = g_p[s].ctx;
    }
    float *a = xmalloc(g_np * per * sizeof(float)), *b = xmalloc(g_np * per * sizeof(float)),
          *cpu = xmalloc(g_np * per * sizeof(float));
    CHECK_EQ_INT(gpu_draft(g_np, slot, pre2, anchor, a), KDT_OK);
    CHECK_EQ_INT(gpu_draft(g_np, twin, pre2, anchor, b), KDT_OK);
    CHECK_EQ_INT(kdt_dflash_draft(g_d, ctx, g_np, anchor, cpu), KDT_OK);
    for (int s = 0; s < g_np; s++)
        CHECK_MSG(memcmp(a + s * per, b + s * per, per * sizeof(float)) == 0,
                  "stream %d (tau %d): append_accepted != append of the same rows", s, taus[s]);
    int agree = 0, total = 0;
    for (int s = 0; s < g_np; s++) compare_stream("accepted", s, pre2[s], a + s * per, cpu + s * per, &agree, &total);
    printf("  accepted: argmax agreement %d/%d (%.1f%%)\n", agree, total, 100.0 * agree / total);
    CHECK_MSG(agree >= ARGMAX_MIN * total, "argmax agreement %d/%d below %.0f%%", agree, total, 100 * ARGMAX_MIN);
    for (int s = 0; s < g_np; s++) g_p[s].n = pre2[s]; /* contexts grew */
    free(tree);
    free(a);
    free(b);
    free(cpu);
    cudaFree(d_tree);
    cudaFree(ds);
    cudaFree(dp);
    cudaFree(dt);
    cudaFree(da);
}

static void test_graph(void) {
    if (quick) {
        printf("  (quick: skipped)\n");
        return;
    }
    /* graph: append prompt 0's current context into a fresh slot, then draft it */
    const prompt *p = &g_p[0];
    const int fresh = 20, n = p->n;
    int32_t slot[MAX_APPEND], pos[MAX_APPEND], row[MAX_APPEND];
    for (int i = 0; i < n; i++) {
        slot[i] = fresh;
        pos[i] = i;
        row[i] = i;
    }
    int32_t *dn = dev_ints(&n, 1), *ds = dev_ints(slot, n), *dp = dev_ints(pos, n), *dr = dev_ints(row, n);
    const int32_t ref_slot = p->slot, pre = n, anchor = 4242 % g_V;
    int32_t *d_fs = dev_ints(&fresh, 1), *d_pre = dev_ints(&pre, 1), *d_anchor = dev_ints(&anchor, 1);
    const size_t per = (size_t)g_L * g_V;
    float *dl = NULL;
    CUDA_OK(cudaMalloc((void **)&dl, per * sizeof(float)));
    CUDA_OK(cudaMemset(dl, 0xff, per * sizeof(float)));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
    const kdt_status s1 = kdt_dflash_gpu_append(g_dg, dn, n, ds, dp, dr, p->d_feat, g_row);
    const kdt_status s2 = kdt_dflash_gpu_draft(g_dg, 1, d_fs, d_pre, d_anchor, dl);
    CUDA_OK(cudaStreamEndCapture(g_stream, &graph));
    CHECK_EQ_INT(s1, KDT_OK);
    CHECK_EQ_INT(s2, KDT_OK);
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, g_stream));
    sync();
    float *got = xmalloc(per * sizeof(float)), *ref = xmalloc(per * sizeof(float));
    CUDA_OK(cudaMemcpy(got, dl, per * sizeof(float), cudaMemcpyDeviceToHost));
    /* eager reference: the original slot holds the same context (same rows, same positions) */
    CHECK_EQ_INT(gpu_draft(1, &ref_slot, &pre, &anchor, ref), KDT_OK);
    CHECK_MSG(memcmp(got, ref, per * sizeof(float)) == 0, "graph replay != eager draft");
    CUDA_OK(cudaMemset(dl, 0xff, per * sizeof(float)));
    CUDA_OK(cudaGraphLaunch(exec, g_stream)); /* replay again: same bits */
    sync();
    CUDA_OK(cudaMemcpy(got, dl, per * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_MSG(memcmp(got, ref, per * sizeof(float)) == 0, "second graph replay != eager draft");
    printf("  graph: append + draft replayed twice == eager (memcmp)\n");
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    free(got);
    free(ref);
    cudaFree(dl);
    cudaFree(dn);
    cudaFree(ds);
    cudaFree(dp);
    cudaFree(dr);
    cudaFree(d_fs);
    cudaFree(d_pre);
    cudaFree(d_anchor);
}

static void expect_invalid(kdt_status st, const char *what) {
    CHECK_MSG(st == KDT_ERR_INVALID_ARG, "%s: status %d, expected KDT_ERR_INVALID_ARG", what, (int)st);
    if (st != KDT_OK) {
        const char *m = kdt_last_error();
        CHECK_MSG(m && m[0], "%s: no message", what);
        printf("  %s -> %s\n", what, m ? m : "(null)");
    }
}

static void test_bad_inputs(void) {
    int32_t *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, 64 * sizeof(int32_t)));
    float *df = NULL;
    CUDA_OK(cudaMalloc((void **)&df, (size_t)g_L * g_V * sizeof(float)));
    expect_invalid(kdt_dflash_gpu_draft(g_dg, 0, d, d, d, df), "draft n_streams 0");
    expect_invalid(kdt_dflash_gpu_draft(g_dg, MAX_DRAFT + 1, d, d, d, df), "draft n_streams > max_draft_streams");
    expect_invalid(kdt_dflash_gpu_draft(g_dg, 1, d, d, d, NULL), "draft logits NULL");
    expect_invalid(kdt_dflash_gpu_draft(NULL, 1, d, d, d, df), "draft drafter NULL");
    expect_invalid(kdt_dflash_gpu_append(g_dg, d, MAX_APPEND + 1, d, d, d, df, g_row), "append max_items too large");
    expect_invalid(kdt_dflash_gpu_append(g_dg, d, 4, NULL, d, d, df, g_row), "append slot NULL");
    expect_invalid(kdt_dflash_gpu_append(g_dg, d, 4, d, d, d, df, g_row - 1), "append short row stride");
    expect_invalid(kdt_dflash_gpu_append_accepted(g_dg, MAX_APPEND / KDT_MAX_PATH + 1, d, d, d, d, 4, df, g_row),
                   "append_accepted too many streams");
    expect_invalid(kdt_dflash_gpu_append_accepted(g_dg, 2, d, d, d, d, 0, df, g_row), "append_accepted tree_stride 0");
    kdt_dflash_gpu *x = NULL;
    kdt_dflash_gpu_options o = {0, MAX_LEN, 1, 8, NULL};
    expect_invalid(kdt_dflash_to_gpu(g_d, g_gm, &o, &x), "to_gpu max_streams 0");
    CHECK(x == NULL);
    o.max_streams = 65;
    expect_invalid(kdt_dflash_to_gpu(g_d, g_gm, &o, &x), "to_gpu max_streams 65");
    o.max_streams = 2;
    o.max_draft_streams = 3;
    expect_invalid(kdt_dflash_to_gpu(g_d, g_gm, &o, &x), "to_gpu max_draft_streams > max_streams");
    expect_invalid(kdt_dflash_to_gpu(g_d, NULL, &o, &x), "to_gpu target NULL");
    sync();
    CUDA_OK(cudaGetLastError());
    cudaFree(d);
    cudaFree(df);
}

int main(void) {
    if (!gpu_test_have_device("test_dflash_gpu")) return 1;
    const char *q = getenv("KDT_TEST_QUICK");
    quick = q && q[0] == '1';
    if (!setup()) {
        printf("0 passed, 1 failed\n");
        return 1;
    }
    T_RUN(test_accuracy);
    T_RUN(test_batch_invariance);
    T_RUN(test_append_accepted);
    T_RUN(test_graph);
    T_RUN(test_bad_inputs);
    for (int i = 0; i < g_np; i++) {
        free(g_p[i].feat);
        cudaFree(g_p[i].d_feat);
        kdt_dflash_ctx_free(g_p[i].ctx);
    }
    kdt_dflash_gpu_free(g_dg);
    cudaStreamDestroy(g_stream);
    kdt_gpu_model_free(g_gm);
    kdt_dflash_free(g_d);
    kdt_model_free(g_m);
    return t_summary();
}
#else
int main(void) {
    printf("model subsystem not built (no jansson): skipped\n");
    return t_summary();
}
#endif
