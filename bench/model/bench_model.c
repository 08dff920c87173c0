/* bench_model.c - benchmark of the GPU forward (kdt_gpu_*), a program of its own (bench_model).
 *
 * 1. Tiny models (the tests/fixtures/models checkpoints): decode steps per second at S = 1, 8, 64 streams
 *    (64-token contexts, argmax output), as CUDA-graph replays.
 * 2. Kimi K2.6 MoE layers at true dimensions with random bf16 weights drawn on the GPU, as many
 *    as fit (up to 4; ~34.3 GB each; KDT_BENCH_MODEL_LAYERS=n) (hidden 7168, 64 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, 384 experts
 *    top-8 + 1 shared, moe_intermediate 2048, sigmoid noaux_tc routing, routed scale 2.827, YaRN
 *    factor 64 / theta 50000 / beta 1, 1; weights N(0, 0.02), router bias N(0, 0.001) so routing
 *    is near-uniform, see research/kimi-layer-cost.md). Contexts of 4096 random latent rows.
 *    Timed per layer: the marginal cost of a layer, (L-layer pass - the pass cut after layer 0) /
 *    (L - 1), so the pass's fixed costs (graph launch, embedding gather, the first fetch of each
 *    kernel's code) stay out as in a 61-layer model; the 1-layer pass (embedding + layer 0, no
 *    lm_head) is reported too, and is the time itself when only one layer fits. Decode at S = 1, 8, 64 and tree
 *    verify of one stream with N = 9, 17, 33, 65 nodes (random tree shapes), each with random
 *    tokens and with correlated tokens (rows sharing a base embedding, sigma 0.05), and prefill
 *    of one stream's first 512 and 2,048 tokens (one causal chunk, random tokens; a runner of its
 *    own, skipped when it does not fit). For each:
 *    distinct experts touched per layer D (the mean over the layers timed, 1..L-1; each layer's
 *    count is printed), the bytes floor (D routed experts + the shared expert + attention and
 *    router weights + KV read and written, over the measured copy bandwidth), time / floor, and
 *    time / decode(S = 1) time. A prefill chunk's line also prints its matrix FLOPs (projections,
 *    the D experts' rows, attention) over its time, since at 2,048 rows (~43 per expert) the pass
 *    nears the point where bytes stop bounding it.
 * Timing: CUDA-graph replays, L2 evicted by a 4x-L2 read before each replay, CUDA events around
 * the replay, median of 25 (7 with --quick) after 3 warm-ups; each Kimi shape draws its inputs
 * from a seed of its own and starts after 3 s of idle GPU, so its number does not depend on the
 * shapes before it. A table is printed last; --md FILE
 * writes it as markdown. Needs ~45 GB of GPU memory for part 2 (skipped when it does not fit).
 *
 *   bench_model [--quick] [--md FILE] [--only tiny|kimi]
 * KDT_BENCH_MODEL_PAUSE_MS=n: idle time before each Kimi shape (default 3000; see pause_before_shape).
 * KDT_BENCH_MODEL_SHAPE=decode,S[,corr], verify,N[,corr] or prefill,N (corr 0 or 1; default 0; prefill
 * also N 128, 256 and 1,024, which the table skips) times that
 * Kimi shape alone, then replays it once more between cudaProfilerStart / Stop (for
 * `ncu --profile-from-start off`: the kernels of one pass); with KDT_BENCH_MODEL_STEPS=1 it
 * also times the pass cut after each of its steps (a per-step breakdown at real clocks).
 * KDT_BENCH_MODEL_AB=NAME=VALUE[;NAME=VALUE...] with KDT_BENCH_MODEL_REPS=n (1..8): an A/B inside
 * one process, on the same weights and inputs: the Kimi shapes run n times without the variables
 * (A) and n times with them set (B), in the order A B B A A B ..., every graph captured afresh
 * (the forward reads its switches at capture; those read at weight upload, KDT_GPU_TILED_*, do
 * not change); rows of B are marked "+ab". A process builds the weights once, so an A/B costs one
 * model build instead of one per reading.
 * KDT_BENCH_MODEL_ATT_KB=n: the prefill runner's attention-partials budget in KiB (default 512 MiB:
 * a 2,048-row chunk's absorbed attention then runs in windows of rows; a large n, one launch). */
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kdtree/model.h"

#ifndef KDT_SOURCE_DIR
#define KDT_SOURCE_DIR "."
#endif

#define BENCH_OK(call)                                                                          \
    do {                                                                                        \
        kdt_status st_ = (call);                                                                \
        if (st_ != KDT_OK) {                                                                    \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kdt_last_error());    \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)
#define CUDA_OK(call)                                                                           \
    do {                                                                                        \
        cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

static int quick;

typedef struct row {
    char model[24], mode[16], variant[16];
    int S, N;
    int distinct;       /* -1: not a MoE measurement */
    double us, floor_us, ratio_decode;
    double tok_per_s;
    double us_one;      /* Kimi: the pass cut after its first layer (embedding + 1 layer); 0 otherwise */
    int layers;         /* Kimi: layers in the model (us is then the marginal per-layer time) */
    int ab;             /* 1: timed with KDT_BENCH_MODEL_AB's variables set */
} row;

static row rows[256];
static int n_rows;

static row *new_row(void) {
    if (n_rows >= (int)(sizeof rows / sizeof rows[0])) {
        fprintf(stderr, "bench_model: more than %d rows\n", (int)(sizeof rows / sizeof rows[0]));
        exit(1);
    }
    return &rows[n_rows++];
}

static uint64_t rng_state = 0x1234567;
static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rnd_int(int n) { return (int)(rnd() % (uint64_t)n); }
/* Each Kimi shape draws its tokens and tree from a seed of its own (mode, size, variant), so a
 * shape's inputs do not depend on which shapes ran before it (KDT_BENCH_MODEL_SHAPE alone or in the
 * full table: the same routing, the same tree) */
static void rnd_seed_shape(int mode, int n, int corr) {
    rng_state = 0x1234567ull + (uint64_t)(mode * 1000 + n * 2 + corr) * 0x100000001b3ull;
}
/* The GPU idles KDT_BENCH_MODEL_PAUSE_MS ms (default 3000, 0 = none) before each Kimi shape, so
 * every shape is timed from the same idle state, as when it runs alone. Without it a shape timed
 * right after the S = 64 shapes (the power cap's clock-event reason active at 700 W) reads
 * slower: verify N 9 1,839-1,901 us per layer against 1,578-1,584 alone or paused (session 27,
 * bench/RESULTS.md), which had read as a machine-dependent N 9. */
static void pause_before_shape(void) {
    const char *e = getenv("KDT_BENCH_MODEL_PAUSE_MS");
    const long ms = e ? atol(e) : 3000;
    if (ms <= 0) return;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* median replay time of graph g in microseconds; flush: evict L2 before each replay */
static double time_graph(kdt_gpu_runner *r, kdt_gpu_graph *g, int samples, int flush) {
    cudaStream_t s = (cudaStream_t)kdt_gpu_runner_stream(r);
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) BENCH_OK(kdt_gpu_graph_launch(g));
    BENCH_OK(kdt_gpu_runner_sync(r));
    double *t = malloc(sizeof(double) * (size_t)samples);
    for (int i = 0; i < samples; i++) {
        if (flush) BENCH_OK(kdt_gpu_runner_flush_l2(r));
        CUDA_OK(cudaEventRecord(a, s));
        BENCH_OK(kdt_gpu_graph_launch(g));
        CUDA_OK(cudaEventRecord(b, s));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        t[i] = ms * 1000.0;
    }
    qsort(t, (size_t)samples, sizeof(double), cmp_double);
    const double med = t[samples / 2];
    free(t);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return med;
}

/* device-to-device copy bandwidth, bytes read + written per second / 1e9 */
static double copy_bandwidth(void) {
    const size_t bytes = (size_t)1 << 31;
    void *x, *y;
    if (cudaMalloc(&x, bytes) != cudaSuccess) return 0;
    if (cudaMalloc(&y, bytes) != cudaSuccess) {
        cudaFree(x);
        return 0;
    }
    CUDA_OK(cudaMemset(x, 0x3c, bytes));
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    double t[16];
    const int n = quick ? 5 : 11;
    for (int i = 0; i < n + 2; i++) {
        CUDA_OK(cudaEventRecord(a, 0));
        CUDA_OK(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, 0));
        CUDA_OK(cudaEventRecord(b, 0));
        CUDA_OK(cudaEventSynchronize(b));
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 2) t[i - 2] = ms;
    }
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    cudaFree(x);
    cudaFree(y);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return 2.0 * (double)bytes / (t[n / 2] * 1e-3) / 1e9;
}

/* ---- part 1: tiny models ---------------------------------------------------------------------- */
static void bench_tiny(const char *name) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/fixtures/models/%s", KDT_SOURCE_DIR, name);
    kdt_model *m = NULL;
    kdt_model_options mo = {0, 0, KDT_PREFILL_ABSORBED};
    if (kdt_model_load(dir, &mo, &m) != KDT_OK) {
        fprintf(stderr, "bench_model: %s: %s (skipped)\n", name, kdt_last_error());
        return;
    }
    kdt_gpu_model *g = NULL;
    kdt_gpu_options go = {0, 0, 0};
    BENCH_OK(kdt_model_to_gpu(m, &go, &g));
    const int V = kdt_model_get_config(m)->vocab_size, ctx = 64;
    const int Ss[3] = {1, 8, 64};
    for (int k = 0; k < 3; k++) {
        const int S = Ss[k];
        kdt_gpu_runner_options ro = {S > ctx ? S : ctx, 0, 0, 0, 0, 0, NULL, KDT_PREFILL_ABSORBED, 0, 0};
        kdt_gpu_runner *r;
        BENCH_OK(kdt_gpu_runner_create(g, &ro, &r));
        kdt_kv_cache_options ko = {S * 4 + 4, S, 0};
        kdt_gpu_kv *kv;
        BENCH_OK(kdt_gpu_kv_create(g, &ko, &kv));
        int32_t *tok = malloc(sizeof(int32_t) * (size_t)(S > ctx ? S : ctx));
        for (int s = 0; s < S; s++) {
            for (int i = 0; i < ctx; i++) tok[i] = rnd_int(V);
            BENCH_OK(kdt_gpu_prefill(r, kv, s, tok, ctx, NULL));
        }
        for (int s = 0; s < S; s++) tok[s] = rnd_int(V);
        BENCH_OK(kdt_gpu_stage_decode(r, kv, S, NULL, tok));
        const kdt_gpu_run_config rc = {S, 0, 1, 0, NULL};
        kdt_gpu_graph *gr;
        BENCH_OK(kdt_gpu_graph_capture(r, kv, &rc, &gr));
        const double us = time_graph(r, gr, quick ? 50 : 200, 0);
        row *w = new_row();
        memset(w, 0, sizeof *w);
        snprintf(w->model, sizeof w->model, "%s", name);
        snprintf(w->mode, sizeof w->mode, "decode");
        snprintf(w->variant, sizeof w->variant, "random");
        w->S = S;
        w->N = 1;
        w->distinct = -1;
        w->us = us;
        w->tok_per_s = S / (us * 1e-6);
        printf("  %-12s decode S=%-3d %8.1f us/step  %10.0f tokens/s\n", name, S, us, w->tok_per_s);
        kdt_gpu_graph_free(gr);
        kdt_gpu_kv_free(kv);
        kdt_gpu_runner_free(r);
        free(tok);
    }
    kdt_gpu_model_free(g);
    kdt_model_free(m);
}

/* KDT_BENCH_MODEL_STEPS=1 (with KDT_BENCH_MODEL_SHAPE): the pass cut after each of its steps in
 * turn (kdt_gpu_runner_set_step_limit), each cut captured and timed like the full pass; the
 * differences attribute the time to the steps at real clocks, launch gaps included. */
static void step_profile(kdt_gpu_runner *r, kdt_gpu_kv *kv, const kdt_gpu_run_config *rc, int samples, double full) {
    const char *e = getenv("KDT_BENCH_MODEL_STEPS");
    if (!e || strcmp(e, "1")) return;
    const char *names[128];
    const int n = kdt_gpu_runner_steps(r, names, 128);
    if (n < 1 || n > 128) {
        printf("  step profile: %d steps (1..128 supported)\n", n);
        return;
    }
    printf("  step profile (pass cut after step k; median of %d, L2 flushed; full pass %.1f us):\n", samples, full);
    printf("  %4s %-14s %10s %10s\n", "k", "step", "cut_us", "delta_us");
    double prev = 0;
    for (int k = 1; k <= n; k++) {
        BENCH_OK(kdt_gpu_runner_set_step_limit(r, k));
        kdt_gpu_graph *gr;
        BENCH_OK(kdt_gpu_graph_capture(r, kv, rc, &gr));
        const double us = time_graph(r, gr, samples, 1);
        kdt_gpu_graph_free(gr);
        printf("  %4d %-14s %10.1f %10.1f\n", k, names[k - 1], us, us - prev);
        prev = us;
    }
    BENCH_OK(kdt_gpu_runner_set_step_limit(r, 0));
}

/* The time of a Kimi shape staged in r: the full pass (layers layers) and the pass cut after its
 * first layer (embedding + layer 0); per-layer = their difference over layers - 1, the marginal
 * cost of a layer in a deep model (the pass's fixed costs, the graph launch and the embedding, and
 * the first fetch of every kernel's code stay out), or the 1-layer pass itself when layers = 1. */
static double time_layers(kdt_gpu_runner *r, kdt_gpu_kv *kv, const kdt_gpu_run_config *rc, int samples, int layers,
                          kdt_gpu_graph **full, double *one) {
    BENCH_OK(kdt_gpu_graph_capture(r, kv, rc, full));
    const double t_full = time_graph(r, *full, samples, 1);
    *one = t_full;
    if (layers < 2) return t_full;
    const int n_steps = kdt_gpu_runner_steps(r, NULL, 0); /* 1 (embedding) + layers x per layer */
    BENCH_OK(kdt_gpu_runner_set_step_limit(r, 1 + (n_steps - 1) / layers));
    kdt_gpu_graph *g1;
    BENCH_OK(kdt_gpu_graph_capture(r, kv, rc, &g1));
    BENCH_OK(kdt_gpu_runner_set_step_limit(r, 0));
    *one = time_graph(r, g1, samples, 1);
    kdt_gpu_graph_free(g1);
    return (t_full - *one) / (layers - 1);
}

/* ---- part 2: one Kimi K2.6 MoE layer ---------------------------------------------------------- */
static const char *KIMI_LAYER_CONFIG =
    "{\"model_type\": \"kimi_k2\", \"vocab_size\": 4096, \"hidden_size\": 7168, \"intermediate_size\": 18432,"
    " \"moe_intermediate_size\": 2048, \"num_hidden_layers\": %d, \"num_attention_heads\": 64,"
    " \"num_key_value_heads\": 64, \"q_lora_rank\": 1536, \"kv_lora_rank\": 512, \"qk_nope_head_dim\": 128,"
    " \"qk_rope_head_dim\": 64, \"v_head_dim\": 128, \"n_routed_experts\": 384, \"num_experts_per_tok\": 8,"
    " \"n_shared_experts\": 1, \"n_group\": 1, \"topk_group\": 1, \"first_k_dense_replace\": 0,"
    " \"moe_layer_freq\": 1, \"norm_topk_prob\": true, \"routed_scaling_factor\": 2.827,"
    " \"scoring_func\": \"sigmoid\", \"topk_method\": \"noaux_tc\", \"rms_norm_eps\": 1e-05,"
    " \"max_position_embeddings\": 262144, \"tie_word_embeddings\": false, \"rope_theta\": 50000.0,"
    " \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 64.0, \"beta_fast\": 1.0, \"beta_slow\": 1.0,"
    " \"mscale\": 1.0, \"mscale_all_dim\": 1.0, \"original_max_position_embeddings\": 4096},"
    " \"bos_token_id\": 1, \"eos_token_id\": 2}";

enum { CORR_BLOCK = 32 };
/* the Kimi shapes' committed context: 4096 (the issue's), KDT_BENCH_MODEL_PREFIX=n (1..32768) for
 * probes of the attention's share */
static int bench_prefix = 4096;
/* KDT_BENCH_MODEL_PREFILL_PREFIX=P (0..131072, default 0): the prefill chunk follows P committed
 * keys (random cache rows), as a long prompt's later chunks do; past KDT_GPU_PLAIN_MAX_KEYS keys
 * the plain form runs in key blocks */
static int prefill_prefix = 0;
/* KDT_BENCH_MODEL_PREFILL_STREAMS=k (1..8, default 1): the N prefill rows are k streams' first N / k
 * prompt tokens in one pass (kdt_gpu_stage_prefill_many; the engine's shared prefill passes); the
 * prefix is then 0 */
static int prefill_streams = 1;

/* token of `variant` for stream s: random -> the independent half of the vocabulary; corr -> the
 * stream's block of correlated rows */
static int32_t pick_token(int corr, int s, int V) {
    if (!corr) return rnd_int(V / 2);
    const int blocks = (V / 2) / CORR_BLOCK;
    return V / 2 + (s % blocks) * CORR_BLOCK + rnd_int(CORR_BLOCK);
}

typedef struct tree_buf {
    kdt_tree t;
    int32_t n_nodes[1], token[128], parent[128], depth[128], fc[128], ns[128], pos[128];
    float score[128];
    uint64_t mask[128 * 2];
} tree_buf;

/* one random tree of n nodes (depth <= 16: chains half of the time, else a random earlier node) */
static void random_tree(tree_buf *b, int n, int prefix, int corr, int V) {
    const int N = n, W = (N + 63) / 64;
    memset(b, 0, sizeof *b);
    b->t = (kdt_tree){1, N, b->n_nodes, b->token, b->parent, b->depth, b->fc, b->ns, b->pos, b->score, b->mask};
    b->n_nodes[0] = n;
    for (int i = 0; i < n; i++) {
        int p = -1;
        if (i > 0) {
            do {
                p = (rnd() & 1) ? i - 1 : rnd_int(i);
            } while (b->depth[p] >= 16);
        }
        b->parent[i] = p;
        b->depth[i] = i ? b->depth[p] + 1 : 0;
        b->pos[i] = prefix + b->depth[i];
        b->token[i] = pick_token(corr, 0, V);
        b->fc[i] = b->ns[i] = -1;
        for (int w = 0; w < W; w++) b->mask[i * W + w] = i ? b->mask[p * W + w] : 0;
        b->mask[i * W + i / 64] |= (uint64_t)1 << (i % 64);
    }
}

/* distinct experts the last pass touched, averaged over the layers the reported time covers: the
 * marginal time (layers >= 2) is that of layers 1..L-1, so layer 0's count stays out of its floor
 * (random routing gives each layer its own count; N 9 spreads 60-70). Each layer's count goes to
 * per_layer (a printable list) when it is not NULL. */
static double distinct_experts(kdt_gpu_runner *r, int E, int layers, char *per_layer, size_t cap) {
    int32_t *counts = malloc(sizeof(int32_t) * (size_t)(E + 1));
    if (!counts) {
        fprintf(stderr, "bench_model: out of host memory\n");
        exit(1);
    }
    int sum = 0;
    size_t used = 0;
    if (per_layer && cap) per_layer[0] = 0;
    for (int l = 0; l < layers; l++) {
        BENCH_OK(kdt_gpu_runner_expert_counts(r, l, counts));
        int d = 0;
        for (int e = 0; e < E; e++) d += counts[e] > 0;
        if (layers < 2 || l > 0) sum += d;
        if (per_layer && used < cap) used += (size_t)snprintf(per_layer + used, cap - used, "%s%d", l ? "/" : "", d);
    }
    free(counts);
    return (double)sum / (layers < 2 ? 1 : layers - 1);
}

/* The Kimi table's shapes: decode S streams, tree verify of N nodes (kimi_shapes runs them). */
static const int kimi_decode_S[3] = {1, 8, 64}, kimi_verify_N[4] = {9, 17, 33, 65}, kimi_prefill_N[5] = {512, 2048, 128, 256, 1024};
enum { KIMI_PREFILL_TABLE = 2 }; /* the table runs the first two; KDT_BENCH_MODEL_SHAPE any of them (the
                                    chunk-size curve behind the engine's GPU default) */
enum { KIMI_PREFILL_MAX = 2048 };
static int in_list(int v, const int *list, int n) {
    for (int i = 0; i < n; i++)
        if (list[i] == v) return 1;
    return 0;
}

/* KDT_BENCH_MODEL_SHAPE: the one Kimi shape to run (mode 0 = all) */
static int shape_mode, shape_n, shape_corr; /* mode 1 decode, 2 verify, 3 prefill */
static void read_shape(void) {
    const char *e = getenv("KDT_BENCH_MODEL_SHAPE");
    if (!e || !e[0]) return;
    char m[16] = {0};
    int n = 0, corr = 0;
    if (sscanf(e, "%15[a-z],%d,%d", m, &n, &corr) < 2 || n < 1 ||
        (strcmp(m, "decode") && strcmp(m, "verify") && strcmp(m, "prefill"))) {
        fprintf(stderr, "bench_model: KDT_BENCH_MODEL_SHAPE=%s (decode,S[,corr], verify,N[,corr] or prefill,N)\n", e);
        exit(2);
    }
    shape_mode = !strcmp(m, "decode") ? 1 : !strcmp(m, "verify") ? 2 : 3;
    shape_n = n;
    shape_corr = corr != 0;
    /* only the table's shapes run (kimi_shapes); any other would time nothing and exit 0 */
    const int ok = shape_mode == 1   ? in_list(n, kimi_decode_S, 3)
                   : shape_mode == 2 ? in_list(n, kimi_verify_N, 4)
                                     : in_list(n, kimi_prefill_N, 5) && corr == 0;
    if (!ok || (corr != 0 && corr != 1)) {
        fprintf(stderr, "bench_model: KDT_BENCH_MODEL_SHAPE=%s is not one of the Kimi table's shapes "
                        "(decode,S with S 1, 8 or 64; verify,N with N 9, 17, 33 or 65; then corr 0 or 1; "
                        "prefill,N with N 128, 256, 512, 1024 or 2048)\n", e);
        exit(2);
    }
}
static int shape_wanted(int mode, int n, int corr) {
    return shape_mode == 0 || (shape_mode == mode && shape_n == n && shape_corr == corr);
}
/* one more replay of g inside a profiler range (single-shape runs) */
static void profile_replay(kdt_gpu_runner *r, kdt_gpu_graph *g) {
    if (shape_mode == 0) return;
    BENCH_OK(kdt_gpu_runner_flush_l2(r));
    BENCH_OK(kdt_gpu_runner_sync(r));
    CUDA_OK(cudaProfilerStart());
    BENCH_OK(kdt_gpu_graph_launch(g));
    BENCH_OK(kdt_gpu_runner_sync(r));
    CUDA_OK(cudaProfilerStop());
}

/* KDT_BENCH_MODEL_AB's variables ("NAME=VALUE;NAME=VALUE") set (on) or unset (off) */
static void set_ab_env(const char *spec, int on) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *t = strtok_r(buf, ";", &save); t; t = strtok_r(NULL, ";", &save)) {
        char *eq = strchr(t, '=');
        if (!eq || eq == t) {
            fprintf(stderr, "bench_model: KDT_BENCH_MODEL_AB=%s: '%s' is not NAME=VALUE\n", spec, t);
            exit(2);
        }
        *eq = 0;
        if (on) setenv(t, eq + 1, 1);
        else unsetenv(t);
    }
}

/* The Kimi shapes the runner and cache of kb serve (all, or KDT_BENCH_MODEL_SHAPE's one); ab marks
 * the rows of an A/B's variant */
typedef struct kimi_bench {
    kdt_gpu_runner *r;
    kdt_gpu_kv *kv;
    kdt_gpu_runner *rp; /* prefill: a runner of KIMI_PREFILL_MAX rows and a one-stream cache, or NULL */
    kdt_gpu_kv *kvp;
    const kdt_gpu_weight_bytes *wb;
    int layers, V, E;
    double row_bytes, copy_gbps;
    int samples;
    int heads, d_qk, d_v, experts_per_token; /* for a prefill chunk's FLOPs (d_qk, d_v: absorbed) */
    int d_nope, d_rope, d_vh;                 /* the plain form's head dims */
} kimi_bench;
static double decode1[2][2]; /* [ab][corr]: decode S = 1 of the latest pass, for verify / decode */
/* A Kimi table row: mode, variant, S streams x N rows, distinct experts D, us per layer (and the
 * 1-layer pass), the bytes floor in us and time / decode S 1 (0: not timed). */
static row *kimi_row(const char *mode, const char *variant, int S, int N, double D, double us, double one, int layers,
                     int ab, double floor_us, double ratio_decode) {
    row *w = new_row();
    memset(w, 0, sizeof *w);
    snprintf(w->model, sizeof w->model, "kimi-k2.6 layer");
    snprintf(w->mode, sizeof w->mode, "%s", mode);
    snprintf(w->variant, sizeof w->variant, "%s", variant);
    w->S = S;
    w->N = N;
    w->distinct = (int)(D + 0.5);
    w->us = us;
    w->us_one = one;
    w->layers = layers;
    w->ab = ab;
    w->floor_us = floor_us;
    w->ratio_decode = ratio_decode;
    return w;
}
static void kimi_shapes(const kimi_bench *kb, int ab) {
    kdt_gpu_runner *r = kb->r;
    kdt_gpu_kv *kv = kb->kv;
    const kdt_gpu_weight_bytes *wb = kb->wb;
    const int layers = kb->layers, V = kb->V, E = kb->E, samples = kb->samples;
    const double row_bytes = kb->row_bytes, copy_gbps = kb->copy_gbps;
    for (int corr = 0; corr < 2; corr++)
        for (int k = 0; k < 3; k++) {
            const int S = kimi_decode_S[k];
            if (!shape_wanted(1, S, corr)) continue;
            rnd_seed_shape(1, S, corr);
            pause_before_shape();
            int32_t tok[64];
            for (int s = 0; s < S; s++) tok[s] = pick_token(corr, s, V);
            BENCH_OK(kdt_gpu_stage_decode(r, kv, S, NULL, tok));
            const kdt_gpu_run_config rc = {S, 0, 0, 0, NULL};
            kdt_gpu_graph *gr;
            double one;
            const double us = time_layers(r, kv, &rc, samples, layers, &gr, &one);
            char dl[64];
            const double D = distinct_experts(r, E, layers, dl, sizeof dl);
            const double bytes = (double)D * wb->routed_expert + wb->shared_expert + wb->attention + wb->router +
                                 S * ((bench_prefix + 1) * row_bytes + row_bytes);
            if (S == 1) decode1[ab][corr] = us;
            row *w = kimi_row("decode", corr ? "corr0.05" : "random", S, 1, D, us, one, layers, ab,
                              bytes / (copy_gbps * 1e3), us / decode1[ab][corr]);
            printf("  decode S=%-2d %-8s D=%5.1f %9.1f us/layer  floor %8.1f us  %.2fx  (1-layer pass %.1f us; D by layer %s)\n",
                   S, w->variant, D, us, w->floor_us, us / w->floor_us, one, dl);
            profile_replay(r, gr);
            if (shape_mode) step_profile(r, kv, &rc, samples, us);
            kdt_gpu_graph_free(gr);
            for (int s = 0; s < S; s++) BENCH_OK(kdt_gpu_kv_stream_set_length(kv, s, bench_prefix));
        }
    for (int corr = 0; corr < 2; corr++)
        for (int k = 0; k < 4; k++) {
            const int N = kimi_verify_N[k];
            if (!shape_wanted(2, N, corr)) continue;
            rnd_seed_shape(2, N, corr);
            pause_before_shape();
            tree_buf tb;
            random_tree(&tb, N, bench_prefix, corr, V);
            BENCH_OK(kdt_gpu_stage_verify(r, kv, &tb.t, NULL));
            const kdt_gpu_run_config rc = {N, 0, 0, 0, NULL};
            kdt_gpu_graph *gr;
            double one;
            const double us = time_layers(r, kv, &rc, samples, layers, &gr, &one);
            char dl[64];
            const double D = distinct_experts(r, E, layers, dl, sizeof dl);
            const double bytes = (double)D * wb->routed_expert + wb->shared_expert + wb->attention + wb->router +
                                 (bench_prefix + N) * row_bytes + N * row_bytes;
            row *w = kimi_row("verify", corr ? "corr0.05" : "random", 1, N, D, us, one, layers, ab,
                              bytes / (copy_gbps * 1e3), us / decode1[ab][corr]);
            printf("  verify N=%-2d %-8s D=%5.1f %9.1f us/layer  floor %8.1f us  %.2fx  (%.2fx decode; 1-layer pass "
                   "%.1f us; D by layer %s)\n", N, w->variant, D, us, w->floor_us, us / w->floor_us, w->ratio_decode, one, dl);
            profile_replay(r, gr);
            if (shape_mode) step_profile(r, kv, &rc, samples, us);
            kdt_gpu_graph_free(gr);
            BENCH_OK(kdt_gpu_kv_stream_set_length(kv, 0, bench_prefix));
        }
    for (int k = 0; kb->rp && k < 10; k++) {
        const int N = kimi_prefill_N[k / 2], plain = k % 2; /* each N in the absorbed, then the plain form */
        if ((shape_mode == 0 && k / 2 >= KIMI_PREFILL_TABLE) || !shape_wanted(3, N, 0)) continue;
        if (plain && kdt_gpu_runner_set_prefill_attention(kb->rp, KDT_PREFILL_PLAIN) != KDT_OK) {
            printf("  prefill N=%d plain: %s\n", N, kdt_last_error());
            continue;
        }
        if (!plain) BENCH_OK(kdt_gpu_runner_set_prefill_attention(kb->rp, KDT_PREFILL_ABSORBED));
        rnd_seed_shape(3, N, 0);
        pause_before_shape();
        int32_t tok[KIMI_PREFILL_MAX];
        for (int i = 0; i < N; i++) tok[i] = pick_token(0, 0, V);
        if (prefill_streams > 1) {
            kdt_prefill_segment sg[8];
            for (int k2 = 0; k2 < prefill_streams; k2++) {
                BENCH_OK(kdt_gpu_kv_stream_set_length(kb->kvp, k2, 0));
                sg[k2] = (kdt_prefill_segment){k2, tok + k2 * (N / prefill_streams), N / prefill_streams};
            }
            BENCH_OK(kdt_gpu_stage_prefill_many(kb->rp, kb->kvp, prefill_streams, sg, 1));
        } else {
            BENCH_OK(kdt_gpu_kv_stream_set_length(kb->kvp, 0, 0));
            if (prefill_prefix > 0) BENCH_OK(kdt_gpu_kv_fill_random(kb->rp, kb->kvp, 0, prefill_prefix, 77));
            BENCH_OK(kdt_gpu_stage_prefill(kb->rp, kb->kvp, 0, tok, N, 1));
        }
        const kdt_gpu_run_config rc = {N, 0, 0, 0, NULL};
        kdt_gpu_graph *gr;
        double one;
        const double us = time_layers(kb->rp, kb->kvp, &rc, samples, layers, &gr, &one);
        char dl[64];
        const double D = distinct_experts(kb->rp, E, layers, dl, sizeof dl);
        /* row i sees keys 0..P + i: N P + N (N + 1) / 2 (row, key) pairs, each a 576-wide score and
         * a 512-wide sum */
        const double P = prefill_prefix;
        const double n1 = (double)N / prefill_streams, keys = (double)N * P + prefill_streams * n1 * (n1 + 1) / 2;
        const double bytes = (double)D * wb->routed_expert + wb->shared_expert + wb->attention + wb->router +
                             (P + 2.0 * N) * row_bytes;
        /* the attention's FLOPs in the form timed: absorbed 2 (d_c + d_r) + 2 d_c per (row, key,
         * head); plain 2 (d_n + d_r) + 2 d_v, plus kv_b's up-projection of the N keys (its bytes
         * are in wb->attention already, so N x those bytes counts it) */
        const double pair = plain ? 2.0 * (kb->d_nope + kb->d_rope) + 2.0 * kb->d_vh : 2.0 * (kb->d_qk + kb->d_v);
        const double flops = (double)N * ((double)wb->attention + wb->router + wb->shared_expert +
                                          (double)wb->routed_expert * kb->experts_per_token) + /* 2 per bf16 weight */
                             keys * kb->heads * pair +
                             (plain ? P * 2.0 * kb->d_v * kb->heads * (kb->d_nope + kb->d_vh) : 0.0); /* prefix keys' kv_b */
        /* time / decode S 1: 0 when decode S 1 was not timed in this run */
        row *w = kimi_row("prefill", plain ? "random plain" : "random", 1, N, D, us, one, layers, ab,
                          bytes / (copy_gbps * 1e3), decode1[ab][0] > 0 ? us / decode1[ab][0] : 0);
        printf("  prefill N=%-4d %-6s D=%5.1f %9.1f us/layer  floor %8.1f us  %.2fx  (%.1fx decode; %.0f TFLOP/s "
               "of %.2f TFLOP; 1-layer pass %.1f us; D by layer %s; prefix %d)\n", N, plain ? "plain" : "absorb", D, us,
               w->floor_us, us / w->floor_us, w->ratio_decode, flops / (us * 1e6), flops / 1e12, one, dl, prefill_prefix);
        if (prefill_streams > 1) printf("    (the %d rows are %d streams' first %d prompt tokens, one pass)\n", N,
                                        prefill_streams, N / prefill_streams);
        profile_replay(kb->rp, gr);
        if (shape_mode) step_profile(kb->rp, kb->kvp, &rc, samples, us);
        kdt_gpu_graph_free(gr);
    }
}

static void bench_kimi(double copy_gbps) {
    const char *pe = getenv("KDT_BENCH_MODEL_PREFIX");
    if (pe && atoi(pe) >= 1 && atoi(pe) <= 32768) bench_prefix = atoi(pe);
    const char *pp = getenv("KDT_BENCH_MODEL_PREFILL_PREFIX");
    if (pp && atoi(pp) >= 0 && atoi(pp) <= 131072) prefill_prefix = atoi(pp);
    const char *ps = getenv("KDT_BENCH_MODEL_PREFILL_STREAMS");
    if (ps && atoi(ps) >= 2 && atoi(ps) <= 8) {
        prefill_streams = atoi(ps);
        prefill_prefix = 0;
    }
    size_t free_b = 0, total_b = 0;
    CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
    if (free_b < ((size_t)40 << 30)) {
        printf("  Kimi layer skipped: %.1f GB of GPU memory free, ~40 GB needed\n", free_b / 1e9);
        return;
    }
    kdt_gpu_random_init init = {2026, 0, 0, CORR_BLOCK, 0};
    /* RoPE rows for the decode / verify context and for a prefill after its prefix */
    const int rope_rows = prefill_prefix + KIMI_PREFILL_MAX + 1 > 8192 ? prefill_prefix + KIMI_PREFILL_MAX + 1 : 8192;
    kdt_gpu_options go = {0, 0, rope_rows};
    kdt_gpu_model *g = NULL;
    /* as many layers as fit (a layer is ~34.3 GB), at most 4, keeping ~10 GB for the cache and the
     * runner; KDT_BENCH_MODEL_LAYERS=n asks for n (1..4); a failed allocation retries with fewer */
    int layers = (int)((double)(free_b - ((size_t)10 << 30)) / 34.3e9);
    const char *le = getenv("KDT_BENCH_MODEL_LAYERS");
    if (le && atoi(le) >= 1) layers = atoi(le);
    layers = layers < 1 ? 1 : (layers > 4 ? 4 : layers);
    char config[4096];
    for (;; layers--) {
        snprintf(config, sizeof config, KIMI_LAYER_CONFIG, layers);
        if (kdt_gpu_model_random(config, &init, &go, &g) == KDT_OK) break;
        if (layers == 1) {
            fprintf(stderr, "bench_model: Kimi layer: %s\n", kdt_last_error());
            exit(1);
        }
        fprintf(stderr, "bench_model: %d Kimi layers: %s; trying %d\n", layers, kdt_last_error(), layers - 1);
    }
    const kdt_model_config *c = kdt_gpu_model_get_config(g);
    kdt_gpu_weight_bytes wb;
    BENCH_OK(kdt_gpu_model_weight_bytes(g, 0, &wb));
    printf("  Kimi K2.6: %d layer(s), %.2f GB on the GPU; per layer: attention %.1f MB, router %.1f MB, expert "
           "%.1f MB, shared %.1f MB\n", layers, wb.total / 1e9, wb.attention / 1e6, wb.router / 1e6,
           wb.routed_expert / 1e6, wb.shared_expert / 1e6);
    const int V = c->vocab_size, E = c->n_routed_experts, Smax = 64, Nmax = 65;
    const double row_bytes = (double)(c->kv_lora_rank + c->qk_rope_head_dim) * 2;
    kdt_gpu_runner_options ro = {Nmax, bench_prefix + Nmax + 1, Nmax, 0, 0, 0, NULL, KDT_PREFILL_ABSORBED, 0, 0};
    kdt_gpu_runner *r;
    BENCH_OK(kdt_gpu_runner_create(g, &ro, &r));
    kdt_kv_cache_options ko = {Smax * ((bench_prefix + Nmax + 63) / 64 + 1), Smax, 0};
    kdt_gpu_kv *kv;
    BENCH_OK(kdt_gpu_kv_create(g, &ko, &kv));
    for (int s = 0; s < Smax; s++) BENCH_OK(kdt_gpu_kv_fill_random(r, kv, s, bench_prefix, 1000 + s));
    /* prefill: its own runner of KIMI_PREFILL_MAX rows and a one-stream cache; skipped with a
     * message if they do not fit beside the weights */
    kdt_gpu_runner *rp = NULL;
    kdt_gpu_kv *kvp = NULL;
    if (shape_mode == 0 || shape_mode == 3) {
        kdt_gpu_runner_options po = {KIMI_PREFILL_MAX, prefill_prefix + KIMI_PREFILL_MAX + 1, 0, 0, 0, 0, NULL,
                                     KDT_PREFILL_AUTO, 0, 0};
        /* KDT_BENCH_MODEL_ATT_KB=n: the attention partials' budget (attn_workspace_kb; an A/B of the
         * windows a long chunk's absorbed attention runs in) */
        const char *ak = getenv("KDT_BENCH_MODEL_ATT_KB");
        if (ak && atoi(ak) > 0) po.attn_workspace_kb = atoi(ak);
        kdt_kv_cache_options pk = {prefill_streams * ((prefill_prefix + KIMI_PREFILL_MAX) / 64 + 2), prefill_streams, 0};
        if (kdt_gpu_runner_create(g, &po, &rp) != KDT_OK || kdt_gpu_kv_create(g, &pk, &kvp) != KDT_OK) {
            printf("  prefill rows skipped: %s\n", kdt_last_error());
            kdt_gpu_runner_free(rp);
            rp = NULL;
        }
    }
    const int samples = quick ? 7 : 25;
    const kimi_bench k = {r, kv, rp, kvp, &wb, layers, V, E, row_bytes, copy_gbps, samples, c->n_heads,
                          c->kv_lora_rank + c->qk_rope_head_dim, c->kv_lora_rank, c->n_experts_per_tok,
                          c->qk_nope_head_dim, c->qk_rope_head_dim, c->v_head_dim};
    const char *ab = getenv("KDT_BENCH_MODEL_AB");
    const char *re = getenv("KDT_BENCH_MODEL_REPS");
    const int reps = re && atoi(re) >= 1 ? (atoi(re) > 8 ? 8 : atoi(re)) : 1;
    if (!ab || !ab[0]) {
        for (int i = 0; i < reps; i++) kimi_shapes(&k, 0);
    } else {
        for (int i = 0; i < 2 * reps; i++) {
            const int variant = (i % 4 == 1 || i % 4 == 2); /* A B B A A B B A ... */
            set_ab_env(ab, variant);
            printf("  -- %s (%s)\n", variant ? "B" : "A", variant ? ab : "base");
            kimi_shapes(&k, variant);
        }
        set_ab_env(ab, 0);
    }
    kdt_gpu_kv_free(kvp);
    kdt_gpu_runner_free(rp);
    kdt_gpu_kv_free(kv);
    kdt_gpu_runner_free(r);
    kdt_gpu_model_free(g);
}

static void print_table(FILE *f, int md, const char *dev, double copy_gbps) {
    if (md) {
        fprintf(f, "## bench_model (%s, copy %.0f GB/s)\n\n", dev, copy_gbps);
        fprintf(f, "Kimi rows: time = the marginal cost of one layer in an L-layer model ((L-layer pass - 1-layer "
                   "pass) / (L - 1)); D = distinct experts per layer (mean over the layers timed: 1..L-1)\n\n");
        fprintf(f, "| model | mode | tokens | S | N | D | time (us) | tokens/s | floor (us) | time/floor | vs decode S=1 "
                   "| L | 1-layer pass (us) |\n");
        fprintf(f, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    } else {
        fprintf(f, "\n== bench_model summary (%s, copy %.0f GB/s) ==\n", dev, copy_gbps);
        fprintf(f, "%-16s %-7s %-9s %3s %3s %4s %10s %11s %10s %10s %9s %2s %10s\n", "model", "mode", "tokens", "S", "N",
                "D", "time_us", "tokens/s", "floor_us", "time/floor", "vs_dec1", "L", "pass1_us");
    }
    for (int i = 0; i < n_rows; i++) {
        const row *w = &rows[i];
        char d[16] = "-", fl[32] = "-", rt[32] = "-", vs[32] = "-", tps[32] = "-";
        if (w->distinct >= 0) snprintf(d, sizeof d, "%d", w->distinct);
        if (w->floor_us > 0) {
            snprintf(fl, sizeof fl, "%.1f", w->floor_us);
            snprintf(rt, sizeof rt, "%.2f", w->us / w->floor_us);
            if (w->ratio_decode > 0) snprintf(vs, sizeof vs, "%.2f", w->ratio_decode);
        }
        snprintf(tps, sizeof tps, "%.0f", (w->S * (w->mode[0] == 'd' ? 1 : w->N)) / (w->us * 1e-6));
        char var[24];
        snprintf(var, sizeof var, "%s%s", w->variant, w->ab ? "+ab" : "");
        char nl[16] = "-", one[32] = "-";
        if (w->layers > 0) {
            snprintf(nl, sizeof nl, "%d", w->layers);
            snprintf(one, sizeof one, "%.1f", w->us_one);
        }
        if (md)
            fprintf(f, "| %s | %s | %s | %d | %d | %s | %.1f | %s | %s | %s | %s | %s | %s |\n", w->model, w->mode,
                    var, w->S, w->N, d, w->us, tps, fl, rt, vs, nl, one);
        else
            fprintf(f, "%-16s %-7s %-9s %3d %3d %4s %10.1f %11s %10s %10s %9s %2s %10s\n", w->model, w->mode, var,
                    w->S, w->N, d, w->us, tps, fl, rt, vs, nl, one);
    }
    if (md) fprintf(f, "\n");
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* rows show as they finish, also piped under a timeout */
    const char *md_path = NULL, *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--md") && i + 1 < argc) md_path = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--quick] [--md FILE] [--only tiny|kimi]\n", argv[0]);
            return 2;
        }
    }
    read_shape(); /* a bad KDT_BENCH_MODEL_SHAPE is refused before the GPU is touched */
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        fprintf(stderr, "bench_model: no CUDA device\n");
        return 1;
    }
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    const double copy_gbps = copy_bandwidth();
    printf("bench_model: %s, %d SMs, L2 %d MB, copy bandwidth %.0f GB/s%s\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, copy_gbps, quick ? " (quick)" : "");
    if (!only || !strcmp(only, "tiny")) {
        printf("-- tiny models: decode --\n");
        bench_tiny("kimi_tiny");
        bench_tiny("dsv3_tiny");
        bench_tiny("nolora_tiny");
    }
    if (!only || !strcmp(only, "kimi")) {
        printf("-- Kimi K2.6, one MoE layer, context %d --\n", bench_prefix);
        bench_kimi(copy_gbps);
    }
    print_table(stdout, 0, prop.name, copy_gbps);
    if (md_path) {
        FILE *f = fopen(md_path, "w");
        if (!f) {
            perror(md_path);
            return 2;
        }
        print_table(f, 1, prop.name, copy_gbps);
        fclose(f);
    }
    return 0;
}
