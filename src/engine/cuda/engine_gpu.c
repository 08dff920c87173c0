/* engine_gpu.c - the decoding round on one GPU (engine_gpu.h).
 *
 * Per round, in stream order on the runner's CUDA stream:
 *   params up (slot, root, prefix, depth limit, budget per tree stream: one pinned copy)
 *   -> stage the verify pass on the host (page reservation, block-table updates; no tree needed)
 *   -> DFlash draft (dflash_gpu) -> top-K -> tree_build (auto: at the caps, then the prefixes at
 *      the chosen budgets) -> verify forward (rows numbered on the device from the built trees)
 *      -> tree_accept on the argmax -> KV commit -> drafter context of the accepted path
 *      -> tau / error / emitted tokens (and auto's probe scores) down (one pinned copy) -> one sync.
 * auto's plain rounds (no drafter) park the accepted token's feature row per slot instead of
 * appending it to the drafter context (a launch-bound chain of small kernels); the next
 * drafted round, or a plain round that finds a slot's buffer full, appends every parked row in one
 * batched call first (flush_pending), so each draft still sees positions 0..P-1 complete.
 * Everything after the staging is one CUDA graph per round shape (streams per group, tree
 * stride, K), captured on first use and kept in an LRU cache of MAX_GRAPHS; once the cache is
 * full, a new shape is captured only the second time it comes up (the first runs eagerly), so
 * shapes that come once do not evict the ones that recur. T > 0 streams and the test drafter
 * hook run the same steps eagerly with one extra host round trip each (engine_gpu.h).
 * Stage times come from CUDA events; the round's wall time minus the draft and verify passes is
 * the per-round overhead the stats report as build + accept.
 */
#include "engine/engine_gpu.h"

#include "engine/dflash_gpu.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kdt_status kdt_eng_gather_rows(int32_t *dst, const int32_t *src, const int32_t *idx, int32_t n, int32_t width,
                               int64_t src_stride, int32_t n_src_rows, void *stream);
kdt_status kdt_eng_scatter_rows(float *dst, int64_t dst_stride, int32_t n_dst_rows, const float *src,
                                int64_t src_stride, const int32_t *dst_row, int32_t n, int32_t width, void *stream);
kdt_status kdt_eng_tree_prefix(const kdt_tree *src, const kdt_tree *dst, const int32_t *budget, int32_t *probe_n,
                               float *probe_score, void *stream);

/* The device's FLOPs per byte for the default prefill chunk (kdt_gpu_flop_per_byte of what it
 * reports); 0 when it does not say. KDT_GPU_FLOP_PER_BYTE=x overrides it, for a card the formula
 * misjudges (and for the tests' larger default chunks). */
static double device_flop_per_byte(void) {
    const char *fb = getenv("KDT_GPU_FLOP_PER_BYTE");
    if (fb && fb[0]) {
        char *end = NULL;
        const double v = strtod(fb, &end);
        if (end != fb && *end == '\0' && v > 0 && v < 1e6) return v;
        fprintf(stderr, "kdtree: KDT_GPU_FLOP_PER_BYTE=%s is not a positive number; using the device's\n", fb);
    }
    int dev = 0, sms = 0, khz = 0, mem_khz = 0, bus_bits = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return kdt_gpu_flop_per_byte(sms, khz, mem_khz, bus_bits, major);
}
/* A 64-client server run with auto met ~130 shapes (batch size x plain/drafted x stride); with a
 * 32-graph cache it recaptured 1,557 times in 12 s (4.6 s of capture, auto at 0.81x ar). */
#define MAX_GRAPHS 256
#define MAX_SEEN 64 /* shapes seen once, not captured yet (LRU) */
#define N_EVENTS 8 /* draft start, draft end, build end, verify end, commit end, context end, flush start, end */
#define EV_FLUSH 6
/* Feature rows parked per slot by plain rounds. A flush is one batched append (about what one
 * plain round's append used to cost), so 16 amortizes it; <= KDT_MAX_PATH keeps a flush of every
 * slot (MS x PEND_MAX rows) within the drafter's max_append_rows (>= MS x KDT_MAX_PATH): one call. */
#define PEND_MAX 16
_Static_assert(PEND_MAX <= KDT_MAX_PATH, "a flush must fit one append call");

/* drafts 0 also marks the graphs that park feature rows instead of appending them */
typedef struct round_key {
    int32_t S, n_tree, n_chain, n_plain, n_auto, stride, K, L, taps, caps_stride, drafts;
} round_key;

typedef struct round_graph {
    round_key key;
    cudaGraphExec_t exec;
    uint64_t last_use;
} round_graph;

struct eng_gpu {
    kdt_gpu_model *model;
    kdt_gpu_kv *kv;
    kdt_gpu_runner *run;
    kdt_dflash_gpu *draft;
    cudaStream_t stream;
    kdt_kv_layout kl;           /* device cache + block table (stable pointers) */
    kdt_gpu_outputs outs;       /* the runner's device outputs */
    int32_t MS, MN, Lmax, Kmax, V, D;
    /* device */
    int32_t *d_par;             /* [7][MS]: slot, root, prefix, depth limit, budget, cap (auto), parked row */
    float *d_draft_logits;      /* [MS][Lmax][V] */
    int32_t *d_top_ids;
    float *d_top_logp;          /* [MS][Lmax][Kmax] */
    void *d_topk_ws;
    size_t topk_ws_bytes;
    int32_t *d_tree_i;          /* n_nodes [MS] + 6 x [MS][MN] */
    float *d_score;             /* [MS][MN] */
    uint64_t *d_mask;           /* [MS][MN][W] */
    int32_t *d_target;          /* [MS][MN] target tokens when some stream samples */
    int32_t *d_acc;             /* tau [MS] | error [MS] | bonus [MS] | emit [MS][PATH] | nodes [MS][PATH]
                                   | auto's probe: n_nodes [MS] | scores [S][probe stride] (fp32 bits) */
    int32_t *d_bt;              /* [MS][max_pages] block-table rows in tree-stream order */
    int32_t *d_items;           /* prefill context items: count | slot [C] | pos [C] | row [C] */
    round_bufs db;              /* device views for kdt_round_build_trees */
    /* auto: a drafted round builds its trees once, at the caps (pb, budgets = the caps row); the
     * verified trees are their prefixes at the chosen budgets (kdt_eng_tree_prefix), and their
     * scores come down with the results and choose the next round's budgets (lagged by one) */
    int32_t *d_ptree_i;         /* like d_tree_i */
    float *d_pscore;
    uint64_t *d_pmask;
    round_bufs pb;
    float *probe;               /* [MS slot][MN] last probe scores of nodes 1.. per slot */
    int32_t *n_probe;           /* [MS slot] valid entries (0: none yet) */
    int32_t caps[64];           /* the round's cap per tree stream */
    double accept_mean;         /* running mean of accepted draft tokens per stream-round */
    /* auto's plain rounds park each drafting stream's feature row (row 6 of d_par: where) until a
     * flush appends them; NULL without a drafter */
    float *d_pend;              /* [MS slot][PEND_MAX][max_taps * D] */
    int32_t *pend_n, *pend_first; /* [MS slot] host: parked rows, position of the first */
    int32_t *h_flush, *d_flush; /* flush items: count | slot [n] | pos [n] | row [n] */
    int32_t append_max;         /* the drafter's max_append_rows */
    /* pinned host */
    int32_t *h_par, *h_acc, *h_items;
    cudaEvent_t ev[N_EVENTS];
    round_graph graphs[MAX_GRAPHS];
    int32_t n_graphs;
    round_graph seen[MAX_SEEN]; /* exec unused */
    int32_t n_seen;
    uint64_t use_clock;
    int graphs_on;
    int capturing;
    char device_name[300];      /* "cuda (NVIDIA H200)" */
    int profile;                /* KDT_ENGINE_PROFILE=1: per-stage means on stderr at free */
    double prof[6];             /* seconds: draft pass, top-K + build, verify, accept + commit,
                                   context append, host (wall minus GPU stages) */
    uint64_t prof_rounds;
};

static kdt_status cuda_fail(cudaError_t err, const char *what) {
    return kdt_fail(KDT_ERR_CUDA, "engine GPU: %s: %s", what, cudaGetErrorString(err));
}
#define CU(x, what)                                            \
    do {                                                       \
        cudaError_t err_ = (x);                                \
        if (err_ != cudaSuccess) return cuda_fail(err_, what); \
    } while (0)

int kdt_engine_gpu_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver: clear the sticky-free error */
        return 0;
    }
    return n > 0;
}

static kdt_status dalloc(void **p, size_t bytes, const char *what) {
    const cudaError_t err = cudaMalloc(p, bytes ? bytes : 16);
    if (err != cudaSuccess) {
        *p = NULL;
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine GPU: %s (%zu bytes): %s", what, bytes, cudaGetErrorString(err));
    }
    return KDT_OK;
}

static kdt_status halloc(void **p, size_t bytes, const char *what) {
    const cudaError_t err = cudaHostAlloc(p, bytes ? bytes : 16, cudaHostAllocDefault);
    if (err != cudaSuccess) {
        *p = NULL;
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine GPU: pinned %s (%zu bytes): %s", what, bytes,
                        cudaGetErrorString(err));
    }
    return KDT_OK;
}

void kdt_engine_gpu_free(kdt_engine *e) {
    eng_gpu *g = e ? e->gpu : NULL;
    if (!g) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    if (g->profile && g->prof_rounds) {
        static const char *names[6] = {"draft pass", "top-K + tree build", "verify pass", "accept + KV commit",
                                       "drafter context", "host + syncs"};
        fprintf(stderr, "engine GPU profile, mean over %llu rounds (microseconds):\n",
                (unsigned long long)g->prof_rounds);
        for (int i = 0; i < 6; i++) fprintf(stderr, "  %-20s %9.1f\n", names[i], 1e6 * g->prof[i] / (double)g->prof_rounds);
    }
    for (int32_t i = 0; i < g->n_graphs; i++) cudaGraphExecDestroy(g->graphs[i].exec);
    for (int i = 0; i < N_EVENTS; i++)
        if (g->ev[i]) cudaEventDestroy(g->ev[i]);
    void *dev[] = {g->d_par, g->d_draft_logits, g->d_top_ids, g->d_top_logp, g->d_topk_ws, g->d_tree_i,
                   g->d_score, g->d_mask, g->d_target, g->d_acc, g->d_bt, g->d_items,
                   g->d_ptree_i, g->d_pscore, g->d_pmask, g->d_pend, g->d_flush};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) cudaFree(dev[i]);
    cudaFreeHost(g->h_par);
    cudaFreeHost(g->h_acc);
    cudaFreeHost(g->h_items);
    cudaFreeHost(g->h_flush);
    free(g->probe);
    free(g->n_probe);
    free(g->pend_n);
    free(g->pend_first);
    kdt_dflash_gpu_free(g->draft);
    kdt_gpu_runner_free(g->run);
    kdt_gpu_kv_free(g->kv);
    kdt_gpu_model_free(g->model);
    free(g);
    e->gpu = NULL;
}

/* The results buffer (d_acc / h_acc), in int32 words: accept outputs, then auto's probe. */
static size_t acc_probe_n(int32_t MS) { return (size_t)(3 * MS + 2 * MS * KDT_MAX_PATH); }
static size_t acc_probe_scores(int32_t MS) { return acc_probe_n(MS) + (size_t)MS; }
static size_t acc_words(int32_t MS, int32_t MN) { return acc_probe_scores(MS) + (size_t)MS * (size_t)MN; }

static kdt_status create_buffers(kdt_engine *e, eng_gpu *g) {
    const size_t MS = (size_t)g->MS, MN = (size_t)g->MN, W = (size_t)KDT_MASK_WORDS(g->MN);
    const size_t L = (size_t)g->Lmax, K = (size_t)g->Kmax, V = (size_t)g->V, I4 = sizeof(int32_t);
    KDT_TRY(dalloc((void **)&g->d_par, 7 * MS * I4, "round parameters"));
    KDT_TRY(dalloc((void **)&g->d_draft_logits, MS * L * V * sizeof(float), "draft logits"));
    KDT_TRY(dalloc((void **)&g->d_top_ids, MS * L * K * I4, "top-K ids"));
    KDT_TRY(dalloc((void **)&g->d_top_logp, MS * L * K * sizeof(float), "top-K log-probs"));
    g->topk_ws_bytes = kdt_topk_workspace_bytes((int32_t)(MS * L), g->V, g->Kmax);
    if (g->topk_ws_bytes) KDT_TRY(dalloc(&g->d_topk_ws, g->topk_ws_bytes, "top-K workspace"));
    KDT_TRY(dalloc((void **)&g->d_tree_i, (MS + 6 * MS * MN) * I4, "trees"));
    KDT_TRY(dalloc((void **)&g->d_score, MS * MN * sizeof(float), "tree scores"));
    KDT_TRY(dalloc((void **)&g->d_mask, MS * MN * W * sizeof(uint64_t), "tree masks"));
    KDT_TRY(dalloc((void **)&g->d_target, MS * MN * I4, "target tokens"));
    KDT_TRY(dalloc((void **)&g->d_acc, acc_words(g->MS, g->MN) * I4, "accept outputs"));
    KDT_TRY(dalloc((void **)&g->d_bt, MS * (size_t)g->kl.max_pages * I4, "block-table rows"));
    KDT_TRY(dalloc((void **)&g->d_items, (1 + 3 * (size_t)e->prefill_quantum) * I4, "context items"));
    KDT_TRY(halloc((void **)&g->h_par, 7 * MS * I4, "round parameters"));
    KDT_TRY(dalloc((void **)&g->d_ptree_i, (MS + 6 * MS * MN) * I4, "probe trees"));
    KDT_TRY(dalloc((void **)&g->d_pscore, MS * MN * sizeof(float), "probe scores"));
    KDT_TRY(dalloc((void **)&g->d_pmask, MS * MN * W * sizeof(uint64_t), "probe masks"));
    g->probe = calloc(MS * MN, sizeof(float));
    g->n_probe = calloc(MS, sizeof(int32_t));
    if (!g->probe || !g->n_probe) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine GPU: probe scores");
    KDT_TRY(halloc((void **)&g->h_acc, acc_words(g->MS, g->MN) * I4, "accept outputs"));
    KDT_TRY(halloc((void **)&g->h_items, (1 + 3 * (size_t)e->prefill_quantum) * I4, "context items"));
    if (g->draft && e->n_taps > 0) {
        const size_t rows = MS * PEND_MAX;
        KDT_TRY(dalloc((void **)&g->d_pend, rows * (size_t)g->outs.max_taps * (size_t)g->D * sizeof(float),
                       "parked feature rows"));
        KDT_TRY(dalloc((void **)&g->d_flush, (1 + 3 * rows) * I4, "flush items"));
        KDT_TRY(halloc((void **)&g->h_flush, (1 + 3 * rows) * I4, "flush items"));
        g->pend_n = calloc(MS, sizeof(int32_t));
        g->pend_first = calloc(MS, sizeof(int32_t));
        if (!g->pend_n || !g->pend_first) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine GPU: parked rows");
    }
    for (int i = 0; i < N_EVENTS; i++) CU(cudaEventCreate(&g->ev[i]), "events");
    int32_t *t = g->d_tree_i;
    const size_t sm = MS * MN;
    round_bufs b = {t, t + MS, t + MS + sm, t + MS + 2 * sm, t + MS + 3 * sm, t + MS + 4 * sm, t + MS + 5 * sm,
                    g->d_score, g->d_mask, g->d_top_ids, g->d_top_logp, g->d_par + 3 * MS, g->d_par + 4 * MS,
                    g->d_par + 1 * MS, g->d_par + 2 * MS};
    g->db = b;
    int32_t *p = g->d_ptree_i;
    round_bufs pb = {p, p + MS, p + MS + sm, p + MS + 2 * sm, p + MS + 3 * sm, p + MS + 4 * sm, p + MS + 5 * sm,
                     g->d_pscore, g->d_pmask, g->d_top_ids, g->d_top_logp, b.depth_limit, g->d_par + 5 * MS,
                     b.root, b.prefix};
    g->pb = pb;
    (void)e;
    return KDT_OK;
}

/* The forward runner for e->prefill_quantum-row prefill passes and MS x MN-row rounds, then the
 * drafter's GPU side. */
static kdt_status create_runner(kdt_engine *e, eng_gpu *g) {
    /* test only: a device on which chunks above this many rows do not fit (the halving below) */
    const char *fit = getenv("KDT_GPU_TEST_CHUNK_FITS");
    if (fit && fit[0] && e->prefill_quantum > atoi(fit))
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "GPU runner: a %d-row prefill chunk (KDT_GPU_TEST_CHUNK_FITS=%s)",
                        e->prefill_quantum, fit);
    kdt_gpu_runner_options ro;
    memset(&ro, 0, sizeof ro);
    const int32_t C = e->prefill_quantum;
    ro.max_rows = g->MS * g->MN > C ? g->MS * g->MN : C;
    ro.max_keys = e->max_context + g->MN;
    ro.max_nodes = g->MN;
    ro.max_tree_rows = g->MS * g->MN; /* a round's verify pass (device-staged) */
    ro.max_taps = e->n_taps;
    ro.logits = 1; /* T > 0 streams sample from the logits */
    ro.prefill_attention = e->prefill_attention; /* auto: per chunk, gpu_forward.c */
    KDT_TRY(kdt_gpu_runner_create(g->model, &ro, &g->run));
    g->stream = (cudaStream_t)kdt_gpu_runner_stream(g->run);
    KDT_TRY(kdt_gpu_kv_layout(g->kv, &g->kl));
    KDT_TRY(kdt_gpu_runner_outputs(g->run, &g->outs));
    if (e->drafter) {
        kdt_dflash_gpu_options dopt = {g->MS, e->max_context, g->MS, g->MS * KDT_MAX_PATH > C
                                                                       ? g->MS * KDT_MAX_PATH : C,
                                       g->stream};
        KDT_TRY(kdt_dflash_to_gpu(e->drafter, g->model, &dopt, &g->draft));
        g->append_max = dopt.max_append_rows;
    }
    return KDT_OK;
}

kdt_status kdt_engine_gpu_create(kdt_engine *e, int verbose) {
    eng_gpu *g = calloc(1, sizeof *g);
    if (!g) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "engine GPU");
    e->gpu = g;
    g->MS = e->max_streams;
    g->MN = e->max_nodes;
    /* rows per prefill pass: the caller's, else the model's and device's default, halved while the
     * runner or drafter for it does not fit (below) */
    const int chunk_given = e->prefill_chunk > 0;
    e->prefill_quantum = chunk_given ? e->prefill_chunk : kdt_prefill_chunk_for(e->mc, device_flop_per_byte());
    /* a step's prefill budget bounds the default chunk too (a step prefills at least one chunk) */
    while (!chunk_given && e->max_prefill_tokens > 0 && e->prefill_quantum > e->max_prefill_tokens &&
           e->prefill_quantum > KDT_GPU_PREFILL_CHUNK_MIN)
        e->prefill_quantum /= 2;
    g->Lmax = e->depth > 0 ? e->depth : KDT_MAX_DEPTH; /* room for a test drafter */
    g->Kmax = e->top_k_max;
    g->V = e->mc->vocab_size;
    g->D = e->mc->hidden_size;
    const char *pf = getenv("KDT_ENGINE_PROFILE");
    g->profile = pf && pf[0] == '1';
    const char *ng = getenv("KDT_NO_GRAPHS");
    g->graphs_on = !(ng && ng[0] && strcmp(ng, "0") != 0);
    struct cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
        snprintf(g->device_name, sizeof g->device_name, "cuda (%s)", prop.name);
    else
        snprintf(g->device_name, sizeof g->device_name, "cuda");
    kdt_gpu_options go = {0, verbose ? 1 : 0, 0};
    KDT_TRY(kdt_model_to_gpu(e->model, &go, &g->model));
    kdt_kv_cache_options ko = {e->pages_total, e->max_streams, e->pages_per_stream_max};
    KDT_TRY(kdt_gpu_kv_create(g->model, &ko, &g->kv));
    for (;;) {
        const kdt_status st = create_runner(e, g);
        if (st == KDT_OK) break;
        /* a default chunk too large for the memory the weights and KV pool left: halve it (a
         * chunk the caller chose fails, naming the buffer) */
        if (chunk_given || st != KDT_ERR_OUT_OF_MEMORY || e->prefill_quantum <= KDT_GPU_PREFILL_CHUNK_MIN) return st;
        kdt_dflash_gpu_free(g->draft);
        g->draft = NULL;
        kdt_gpu_runner_free(g->run);
        g->run = NULL;
        g->stream = NULL;
        (void)cudaGetLastError(); /* the failed allocation's error is not sticky */
        e->prefill_quantum /= 2;
        if (verbose)
            fprintf(stderr, "kdtree: the default prefill chunk does not fit on the GPU (%s); trying %d rows\n",
                    kdt_last_error(), e->prefill_quantum);
    }
    KDT_TRY(create_buffers(e, g));
    CU(cudaStreamSynchronize(g->stream), "create");
    return KDT_OK;
}

void kdt_engine_gpu_release(kdt_engine *e, int32_t slot) {
    if (!e || !e->gpu) return;
    kdt_gpu_kv_stream_release(e->gpu->kv, slot);
    if (e->gpu->pend_n) e->gpu->pend_n[slot] = 0; /* its parked rows die with the stream */
}

const char *kdt_engine_gpu_device_name(const kdt_engine *e) {
    return e && e->gpu ? e->gpu->device_name : "cpu";
}

const char *kdt_engine_gpu_fault(kdt_engine *e) {
    if (!e || !e->gpu) return NULL;
    (void)cudaGetLastError(); /* a non-sticky error of the failed call: cleared */
    const cudaError_t err = cudaDeviceSynchronize();
    return err == cudaSuccess ? NULL : cudaGetErrorString(err);
}

int32_t kdt_engine_gpu_free_pages(const kdt_engine *e) {
    return e && e->gpu ? kdt_gpu_kv_free_pages(e->gpu->kv) : 0;
}

/* ---- prefill --------------------------------------------------------------------------------- */

kdt_status kdt_engine_gpu_prefill_pass(kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from,
                                       const int32_t *n_rows, int32_t *first_token) {
    eng_gpu *g = e->gpu;
    const int32_t C = e->prefill_quantum;
    kdt_prefill_segment sg[KDT_ENGINE_MAX_STREAMS];
    round_pass info;
    KDT_TRY(kdt_round_pass_segments(e, n, slots, from, n_rows, sg, &info));
    for (int32_t k = 0; k < n; k++)
        if (from[k] == 0 && g->pend_n) g->pend_n[slots[k]] = 0; /* a new context: nothing parked from a former stream */
    /* output row k = segment k's last row (used where it ends its prompt) */
    KDT_TRY(kdt_gpu_stage_prefill_many(g->run, g->kv, n, sg, 1));
    kdt_gpu_run_config rc = {info.rows, info.any_sampled, info.any_greedy, info.any_taps ? e->n_taps : 0, e->tap_layers};
    KDT_TRY(kdt_gpu_run(g->run, g->kv, &rc));
    if (info.any_taps) { /* the drafting streams' rows join their drafter contexts (taps row = pass row) */
        int32_t *h = g->h_items, m = 0, row = 0;
        for (int32_t k = 0; k < n; k++) {
            const eng_stream *s = &e->streams[slots[k]];
            for (int32_t i = 0; i < n_rows[k]; i++, row++) {
                if (!s->drafts) continue;
                h[1 + m] = slots[k];
                h[1 + C + m] = from[k] + i;
                h[1 + 2 * C + m] = row;
                m++;
            }
        }
        h[0] = m;
        CU(cudaMemcpyAsync(g->d_items, h, (1 + 3 * (size_t)C) * sizeof(int32_t), cudaMemcpyHostToDevice, g->stream),
           "prefill items");
        KDT_TRY(kdt_dflash_gpu_append(g->draft, g->d_items, m, g->d_items + 1, g->d_items + 1 + C, g->d_items + 1 + 2 * C,
                                      g->outs.taps, (int64_t)g->outs.max_taps * g->D));
    }
    if (info.any_greedy)
        CU(cudaMemcpyAsync(e->argmax, g->outs.argmax, sizeof(int32_t) * (size_t)n, cudaMemcpyDeviceToHost, g->stream),
           "prefill argmax");
    if (info.any_sampled) {
        KDT_TRY(kdt_round_grow_f32(&e->logits, &e->logits_cap, (int64_t)n * g->V, "prefill logits"));
        CU(cudaMemcpyAsync(e->logits, g->outs.logits, sizeof(float) * (size_t)n * g->V, cudaMemcpyDeviceToHost, g->stream),
           "prefill logits");
    }
    CU(cudaStreamSynchronize(g->stream), "prefill"); /* h_items and the outputs are reused by the next pass */
    kdt_round_pass_finish(e, n, slots, from, n_rows, e->logits, e->argmax, first_token);
    for (int32_t k = 0; k < n; k++)
        if (first_token[k] >= 0) g->n_probe[slots[k]] = 0; /* a new stream: its first auto round uses its cap */
    return KDT_OK;
}

/* ---- the round ------------------------------------------------------------------------------- */

typedef struct round_ctx {
    round_groups gr;
    int32_t S, K, L, stride, want_taps, any_sampled, any_greedy;
    int32_t pstride;  /* auto drafted round: the stride of the build at the caps (1 + largest cap),
                         set on the host before the round, since a replayed graph sets nothing */
    int32_t drafts;   /* 0: auto chose a plain round (no drafter, root-only trees; budget.h) */
    int32_t captured; /* this round captured its graph, or ran a new shape eagerly: its wall time
                         is not a round's cost */
    int32_t flushed;  /* parked rows were appended before this round (events EV_FLUSH, +1) */
} round_ctx;

/* Inside a capture the event becomes an external record node (so replays time the stages too);
 * outside one that flag is refused, hence the two forms. */
static kdt_status record(eng_gpu *g, int i) {
    if (g->capturing) CU(cudaEventRecordWithFlags(g->ev[i], g->stream, cudaEventRecordExternal), "event");
    else CU(cudaEventRecord(g->ev[i], g->stream), "event");
    return KDT_OK;
}

/* draft -> top-K -> trees (device). */
static kdt_status enqueue_draft_build(kdt_engine *e, eng_gpu *g, round_ctx *rc) {
    const int32_t S = rc->S, L = rc->L, V = g->V;
    KDT_TRY(record(g, 0));
    if (rc->gr.n_draft > 0 && rc->drafts) {
        if (e->test_draft) {
            const int64_t need = (int64_t)rc->gr.n_draft * L * V;
            KDT_TRY(kdt_round_grow_f32(&e->draft_logits, &e->draft_logits_cap, need, "draft logits"));
            for (int32_t s = 0; s < rc->gr.n_draft; s++) {
                const eng_stream *es = &e->streams[e->slot_of[s]];
                KDT_TRY(e->test_draft(e->test_user, es->id, es->tokens, es->n_tokens, L, V,
                                      e->draft_logits + (int64_t)s * L * V));
            }
            CU(cudaMemcpyAsync(g->d_draft_logits, e->draft_logits, sizeof(float) * (size_t)need,
                               cudaMemcpyHostToDevice, g->stream),
               "test draft logits");
        } else {
            KDT_TRY(kdt_dflash_gpu_draft(g->draft, rc->gr.n_draft, g->d_par, g->db.prefix, g->db.root,
                                         g->d_draft_logits));
        }
    }
    KDT_TRY(record(g, 1));
    if (rc->gr.n_draft > 0 && rc->drafts) {
        kdt_topk_params tp = {rc->gr.n_draft * L, V, rc->K, KDT_F32, g->d_draft_logits, V, g->d_top_ids,
                              g->d_top_logp, g->d_topk_ws, g->topk_ws_bytes};
        KDT_TRY(kdt_topk_logsoftmax_cuda(&tp, g->stream));
    }
    int32_t stride = rc->stride, pstride = 1;
    if (rc->gr.n_auto > 0 && rc->drafts) {
        /* one build, at the caps (the probe): the verified trees are its prefixes at the chosen
         * budgets (the best-B tree is the first B pops), and its node count and scores land in the
         * results buffer for the next round's choice */
        KDT_TRY(kdt_round_build_trees(e, &g->pb, g->caps, &kdt_engine_kernels_cuda, g->stream, &rc->gr, S, rc->K,
                                      &pstride));
        for (int32_t s = 0; s < S; s++)
            if (1 + e->b_budget[s] > stride)
                return kdt_fail(KDT_ERR_INTERNAL, "engine GPU: budget %d in a stride of %d", e->b_budget[s], stride);
        const kdt_tree probe = kdt_round_tree_view(&g->pb, 0, S, pstride);
        const kdt_tree verified = kdt_round_tree_view(&g->db, 0, S, stride);
        KDT_TRY(kdt_eng_tree_prefix(&probe, &verified, g->db.budget, g->d_acc + acc_probe_n(g->MS),
                                    (float *)(g->d_acc + acc_probe_scores(g->MS)), g->stream));
    } else {
        KDT_TRY(kdt_round_build_trees(e, &g->db, e->b_budget, &kdt_engine_kernels_cuda, g->stream, &rc->gr, S, rc->K,
                                      &stride));
    }
    if (stride != rc->stride || (rc->gr.n_auto > 0 && rc->drafts && pstride != rc->pstride))
        return kdt_fail(KDT_ERR_INTERNAL, "engine GPU: tree strides %d / %d, staged for %d / %d", stride, pstride,
                        rc->stride, rc->pstride);
    KDT_TRY(record(g, 2));
    return KDT_OK;
}

/* target tokens of sampled streams: logits down, one host draw per node, tokens up (eager only) */
static kdt_status sample_targets(kdt_engine *e, eng_gpu *g, const round_ctx *rc) {
    const int32_t S = rc->S, N = rc->stride, V = g->V;
    CU(cudaMemcpyAsync(e->t_n_nodes, g->db.n_nodes, sizeof(int32_t) * (size_t)S, cudaMemcpyDeviceToHost, g->stream),
       "sampling");
    CU(cudaMemcpyAsync(e->argmax, g->outs.argmax, sizeof(int32_t) * (size_t)S * N, cudaMemcpyDeviceToHost, g->stream),
       "sampling");
    CU(cudaStreamSynchronize(g->stream), "sampling");
    KDT_TRY(kdt_round_grow_f32(&e->logits, &e->logits_cap, (int64_t)N * V, "sampling logits"));
    for (int32_t s = 0; s < S; s++) {
        eng_stream *es = &e->streams[e->slot_of[s]];
        const int64_t base = (int64_t)s * N;
        const int32_t n = e->t_n_nodes[s] < 1 ? 1 : e->t_n_nodes[s] > N ? N : e->t_n_nodes[s];
        if (!(es->params.temperature > 0.0f)) {
            memcpy(e->target_token + base, e->argmax + base, sizeof(int32_t) * (size_t)n);
            continue;
        }
        CU(cudaMemcpy(e->logits, g->outs.logits + base * V, sizeof(float) * (size_t)n * V, cudaMemcpyDeviceToHost),
           "sampling logits");
        kdt_sampler_params sp = kdt_round_sampler_of(es);
        for (int32_t i = 0; i < n; i++)
            e->target_token[base + i] = kdt_sample_token(e->logits + (int64_t)i * V, V, &sp, kdt_rng_uniform(&es->rng),
                                                         &e->sampler);
    }
    CU(cudaMemcpyAsync(g->d_target, e->target_token, sizeof(int32_t) * (size_t)S * N, cudaMemcpyHostToDevice,
                       g->stream),
       "sampled tokens");
    return KDT_OK;
}

/* verify -> accept -> KV commit -> drafter context -> results down. */
static kdt_status enqueue_verify_accept(kdt_engine *e, eng_gpu *g, const round_ctx *rc) {
    const int32_t S = rc->S, N = rc->stride, MS = g->MS;
    kdt_gpu_run_config run = {S * N, rc->any_sampled, 1, rc->want_taps ? e->n_taps : 0, e->tap_layers};
    KDT_TRY(kdt_gpu_run(g->run, g->kv, &run));
    KDT_TRY(record(g, 3));
    const int32_t *target = g->outs.argmax;
    if (rc->any_sampled) {
        KDT_TRY(sample_targets(e, g, rc));
        target = g->d_target;
    }
    int32_t *tau = g->d_acc, *err = g->d_acc + MS, *bonus = g->d_acc + 2 * MS, *emit = g->d_acc + 3 * MS;
    int32_t *nodes = emit + (int64_t)MS * KDT_MAX_PATH;
    kdt_tree tree = kdt_round_tree_view(&g->db, 0, S, N);
    kdt_tree_accept_params ap = {&tree, rc->L, target, nodes, emit, tau, bonus, err};
    KDT_TRY(kdt_tree_accept_cuda(&ap, g->stream));
    KDT_TRY(kdt_eng_gather_rows(g->d_bt, g->kl.block_table, g->d_par, S, g->kl.max_pages, g->kl.max_pages,
                                g->kl.max_streams, g->stream));
    kdt_kv_commit_params cp = {S, g->kl.n_layers, g->kl.row_bytes, g->kl.page_size, g->kl.n_pages, g->kl.cache,
                               g->kl.layer_stride_bytes, g->d_bt, g->kl.max_pages, g->db.prefix, nodes, tau};
    KDT_TRY(kdt_kv_commit_cuda(&cp, g->stream));
    KDT_TRY(record(g, 4));
    const int64_t frow = (int64_t)g->outs.max_taps * g->D;
    if (rc->want_taps && (rc->drafts || !g->d_pend))
        KDT_TRY(kdt_dflash_gpu_append_accepted(g->draft, rc->gr.n_draft, g->d_par, g->db.prefix, tau, nodes, N,
                                               g->outs.taps, frow));
    else if (rc->want_taps) /* plain round: tau is 1 (root-only trees), park row s * N (the root) */
        KDT_TRY(kdt_eng_scatter_rows(g->d_pend, frow, MS * PEND_MAX, g->outs.taps, (int64_t)N * frow,
                                     g->d_par + 6 * MS, rc->gr.n_draft, e->n_taps * g->D, g->stream));
    KDT_TRY(record(g, 5));
    /* tau | error | bonus | emit rows | accepted nodes (they feed auto's per-pop-index calibration)
     * | in an auto drafted round the probe's node counts and scores: one copy */
    const size_t words = rc->gr.n_auto > 0 && rc->drafts ? acc_probe_scores(MS) + (size_t)S * (size_t)rc->pstride
                                                         : acc_probe_n(MS);
    CU(cudaMemcpyAsync(g->h_acc, g->d_acc, sizeof(int32_t) * words, cudaMemcpyDeviceToHost, g->stream), "results");
    return KDT_OK;
}

static int key_eq(const round_key *a, const round_key *b) { return memcmp(a, b, sizeof *a) == 0; }

/* Slot of the least recently used entry of list[0..n) (n > 0). */
static int32_t lru_slot(const round_graph *list, int32_t n) {
    int32_t slot = 0;
    for (int32_t i = 1; i < n; i++)
        if (list[i].last_use < list[slot].last_use) slot = i;
    return slot;
}

/* The graph of this round shape: captured on first use, or, once the cache is full, NULL the
 * first time the shape comes up (the caller runs the round eagerly) and captured the second. */
static kdt_status graph_for(kdt_engine *e, eng_gpu *g, round_ctx *rc, cudaGraphExec_t *exec) {
    round_key k;
    memset(&k, 0, sizeof k);
    const int32_t caps_stride = rc->gr.n_auto > 0 && rc->drafts ? rc->pstride : 1;
    k = (round_key){rc->S, rc->gr.n_tree, rc->gr.n_chain, rc->gr.n_plain, rc->gr.n_auto, rc->stride,
                    rc->K, rc->L,         rc->want_taps,  caps_stride,    rc->drafts};
    for (int32_t i = 0; i < g->n_graphs; i++)
        if (key_eq(&g->graphs[i].key, &k)) {
            g->graphs[i].last_use = ++g->use_clock;
            *exec = g->graphs[i].exec;
            return KDT_OK;
        }
    rc->captured = 1; /* either way, a setup round */
    int32_t seen = -1;
    for (int32_t i = 0; i < g->n_seen && seen < 0; i++)
        if (key_eq(&g->seen[i].key, &k)) seen = i;
    if (seen < 0 && g->n_graphs == MAX_GRAPHS) {
        seen = g->n_seen < MAX_SEEN ? g->n_seen++ : lru_slot(g->seen, MAX_SEEN);
        g->seen[seen] = (round_graph){k, NULL, ++g->use_clock};
        *exec = NULL;
        return KDT_OK;
    }
    if (seen >= 0) g->seen[seen] = g->seen[--g->n_seen]; /* captured from now on */
    cudaGraph_t graph = NULL;
    CU(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeThreadLocal), "graph capture");
    g->capturing = 1;
    kdt_status st = enqueue_draft_build(e, g, rc);
    if (st == KDT_OK) st = enqueue_verify_accept(e, g, rc);
    g->capturing = 0;
    const cudaError_t ce = cudaStreamEndCapture(g->stream, &graph);
    if (st != KDT_OK) {
        if (graph) cudaGraphDestroy(graph);
        return st;
    }
    if (ce != cudaSuccess) return cuda_fail(ce, "graph capture");
    cudaGraphExec_t x = NULL;
    const cudaError_t ie = cudaGraphInstantiate(&x, graph, 0);
    cudaGraphDestroy(graph);
    if (ie != cudaSuccess) return cuda_fail(ie, "graph instantiate");
    int32_t slot = g->n_graphs;
    if (slot == MAX_GRAPHS) { /* evict the least recently used shape */
        slot = lru_slot(g->graphs, MAX_GRAPHS);
        cudaGraphExecDestroy(g->graphs[slot].exec);
    } else {
        g->n_graphs++;
    }
    g->graphs[slot] = (round_graph){k, x, ++g->use_clock};
    *exec = x;
    return KDT_OK;
}

/* Host staging of the verify pass: each stream's tree has at most 1 + budget nodes, depth at most
 * its depth limit (0 for root-only trees). */
static kdt_status stage(kdt_engine *e, eng_gpu *g, const round_ctx *rc) {
    int32_t nb[64], dbnd[64];
    for (int32_t s = 0; s < rc->S; s++) {
        nb[s] = 1 + e->b_budget[s];
        dbnd[s] = e->b_budget[s] < e->b_depth_limit[s] ? e->b_budget[s] : e->b_depth_limit[s];
    }
    kdt_tree tree = kdt_round_tree_view(&g->db, 0, rc->S, rc->stride);
    return kdt_gpu_stage_verify_device(g->run, g->kv, &tree, e->slot_of, nb, dbnd);
}

static float elapsed_s(eng_gpu *g, int a, int b) {
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, g->ev[a], g->ev[b]) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0.0f;
    }
    return ms * 1e-3f;
}

/* Appends every slot's parked rows to its drafter context in one batched call (items up in one
 * copy), on the stream ahead of the round. */
static kdt_status flush_pending(eng_gpu *g, round_ctx *rc) {
    int32_t n = 0;
    for (int32_t slot = 0; slot < g->MS; slot++) n += g->pend_n[slot];
    if (n == 0) return KDT_OK;
    if (n > g->append_max)
        return kdt_fail(KDT_ERR_INTERNAL, "engine GPU: %d parked rows, an append takes %d", n, g->append_max);
    /* the previous flush's copy out of h_flush is done (the event follows it) */
    CU(cudaEventSynchronize(g->ev[EV_FLUSH]), "parked rows");
    int32_t *h = g->h_flush, *hs = h + 1, *hp = hs + n, *hr = hp + n, i = 0;
    h[0] = n;
    for (int32_t slot = 0; slot < g->MS; slot++)
        for (int32_t k = 0; k < g->pend_n[slot]; k++, i++) {
            hs[i] = slot;
            hp[i] = g->pend_first[slot] + k;
            hr[i] = slot * PEND_MAX + k;
        }
    CU(cudaMemcpyAsync(g->d_flush, h, sizeof(int32_t) * (size_t)(1 + 3 * n), cudaMemcpyHostToDevice, g->stream),
       "flush items");
    CU(cudaEventRecord(g->ev[EV_FLUSH], g->stream), "event");
    const int32_t *d = g->d_flush;
    KDT_TRY(kdt_dflash_gpu_append(g->draft, d, n, d + 1, d + 1 + n, d + 1 + 2 * n, g->d_pend,
                                  (int64_t)g->outs.max_taps * g->D));
    CU(cudaEventRecord(g->ev[EV_FLUSH + 1], g->stream), "event");
    memset(g->pend_n, 0, sizeof(int32_t) * (size_t)g->MS);
    rc->flushed = 1;
    return KDT_OK;
}

/* auto on the GPU: budgets from each stream's previous probe (lagged by one round, so the round
 * stays one graph with no mid-round sync); a stream without a probe yet uses its cap. The other
 * streams of the batch count with their budgets and the running mean of accepted tokens. */
static void choose_lagged(kdt_engine *e, eng_gpu *g, const round_ctx *rc) {
    kdt_budget_stream bs[64];
    int32_t idx[64], n = 0;
    kdt_budget_others others = {0, 0, 0.0, 1};
    for (int32_t s = 0; s < rc->S; s++) {
        const int32_t slot = e->slot_of[s];
        const eng_stream *es = &e->streams[slot];
        if (s < rc->gr.n_tree && es->params.spec == KDT_SPEC_AUTO && g->n_probe[slot] > 0) {
            const int32_t cap = g->n_probe[slot] < g->caps[s] ? g->n_probe[slot] : g->caps[s];
            bs[n] = (kdt_budget_stream){g->probe + (int64_t)slot * g->MN, cap, e->b_depth_limit[s]};
            idx[n++] = s;
        } else {
            others.n_streams++;
            others.nodes += 1 + e->b_budget[s];
            if (1 + e->b_budget[s] > others.min_stride) others.min_stride = 1 + e->b_budget[s];
            others.tokens += 1.0 + (s < rc->gr.n_draft ? g->accept_mean : 0.0);
        }
    }
    if (n > 0) kdt_round_choose_budgets(e, n, bs, idx, &others);
}

kdt_status kdt_engine_gpu_round(kdt_engine *e, const int32_t *slots, int32_t n_slots, kdt_stream_event *events,
                                int32_t *n_ev) {
    eng_gpu *g = e->gpu;
    const double t0 = kdt_engine_now();
    round_ctx rc;
    memset(&rc, 0, sizeof rc);
    rc.S = kdt_round_plan(e, slots, n_slots, &rc.gr);
    const int32_t S = rc.S, MS = g->MS;
    rc.L = e->depth > 0 ? e->depth : 1;
    if (rc.gr.n_draft > 0 && e->depth > g->Lmax)
        return kdt_fail(KDT_ERR_INTERNAL, "engine GPU: draft depth %d exceeds the buffers' %d", e->depth, g->Lmax);
    memcpy(g->caps, e->b_budget, sizeof(int32_t) * (size_t)S);
    rc.drafts = kdt_round_auto_drafts(e, &rc.gr, S);
    rc.K = kdt_round_topk_k(e, &rc.gr);
    if (rc.gr.n_auto > 0 && rc.drafts) {
        choose_lagged(e, g, &rc);
        /* the probe only needs to reach past the budgets worth trying next: twice the chosen
         * one (at least 16, rounded up to a power of two), so a B 64 cap does not cost a 64-pop
         * build every round */
        int32_t K = 1;
        for (int32_t s = 0; s < rc.gr.n_tree; s++) {
            if (e->streams[e->slot_of[s]].params.spec == KDT_SPEC_AUTO) {
                int32_t want = 16; /* a power of two, so the graph keys (K, caps) stay few */
                while (want < 2 * e->b_budget[s]) want *= 2;
                if (want < g->caps[s]) g->caps[s] = want;
            }
            const int32_t k = g->caps[s] > e->b_budget[s] ? g->caps[s] : e->b_budget[s];
            if (k > K) K = k;
        }
        rc.K = K < e->top_k_max ? K : e->top_k_max;
        rc.pstride = 1; /* kdt_round_build_trees' stride for the caps */
        for (int32_t s = 0; s < S; s++)
            if (1 + g->caps[s] > rc.pstride) rc.pstride = 1 + g->caps[s];
    }
    rc.stride = 1;
    for (int32_t s = 0; s < S; s++) {
        if (1 + e->b_budget[s] > rc.stride) rc.stride = 1 + e->b_budget[s];
        if (e->streams[e->slot_of[s]].params.temperature > 0.0f) rc.any_sampled = 1;
        else rc.any_greedy = 1;
    }
    if (rc.gr.n_auto > 0 && rc.drafts) { /* auto's budgets vary per round: power-of-two strides keep the graphs few */
        int32_t b = 2;
        while (b < rc.stride) b *= 2;
        rc.stride = b < g->MN ? b : g->MN;
    }
    rc.want_taps = rc.gr.n_draft > 0 && g->draft && e->n_taps > 0;
    /* parked rows: a draft needs every context complete, a plain round one free row per slot */
    const int park = rc.want_taps && !rc.drafts && g->d_pend;
    if (rc.want_taps && g->d_pend) {
        int flush = rc.drafts;
        for (int32_t s = 0; s < rc.gr.n_draft && !flush; s++) flush = g->pend_n[e->slot_of[s]] >= PEND_MAX;
        if (flush) KDT_TRY(flush_pending(g, &rc));
    }
    for (int32_t s = 0; park && s < rc.gr.n_draft; s++) {
        const int32_t slot = e->slot_of[s];
        if (g->pend_n[slot] == 0) g->pend_first[slot] = e->b_prefix[s];
        else if (g->pend_first[slot] + g->pend_n[slot] != e->b_prefix[s])
            return kdt_fail(KDT_ERR_INTERNAL, "engine GPU: slot %d: %d rows parked from %d, prefix %d", slot,
                            g->pend_n[slot], g->pend_first[slot], e->b_prefix[s]);
        g->h_par[6 * MS + s] = slot * PEND_MAX + g->pend_n[slot];
    }
    /* per-stream parameters up */
    memcpy(g->h_par, e->slot_of, sizeof(int32_t) * (size_t)S);
    memcpy(g->h_par + MS, e->b_root, sizeof(int32_t) * (size_t)S);
    memcpy(g->h_par + 2 * MS, e->b_prefix, sizeof(int32_t) * (size_t)S);
    memcpy(g->h_par + 3 * MS, e->b_depth_limit, sizeof(int32_t) * (size_t)S);
    memcpy(g->h_par + 4 * MS, e->b_budget, sizeof(int32_t) * (size_t)S);
    memcpy(g->h_par + 5 * MS, g->caps, sizeof(int32_t) * (size_t)S);
    CU(cudaMemcpyAsync(g->d_par, g->h_par, sizeof(int32_t) * 7 * (size_t)MS, cudaMemcpyHostToDevice, g->stream),
       "round parameters");

    const int use_graph = g->graphs_on && !e->test_draft && !rc.any_sampled;
    cudaGraphExec_t exec = NULL;
    if (use_graph) {
        /* staging needs only the lengths: done first, then the whole device round as one graph
         * (NULL for a shape not captured yet: the same work eagerly below) */
        KDT_TRY(stage(e, g, &rc));
        KDT_TRY(graph_for(e, g, &rc, &exec));
    }
    if (exec) {
        CU(cudaGraphLaunch(exec, g->stream), "graph launch");
    } else {
        KDT_TRY(enqueue_draft_build(e, g, &rc));
        if (!use_graph) KDT_TRY(stage(e, g, &rc));
        KDT_TRY(enqueue_verify_accept(e, g, &rc));
    }
    CU(cudaStreamSynchronize(g->stream), "round");
    const double t_end = kdt_engine_now();

    const int32_t *h_tau = g->h_acc, *h_err = g->h_acc + MS, *h_emit = g->h_acc + 3 * MS;
    const int32_t *h_nodes = h_emit + (int64_t)MS * KDT_MAX_PATH;
    KDT_TRY(kdt_tree_errors_check(h_err, S));
    double rank_pred[KDT_BUDGET_RANK_BINS] = {0}, rank_real[KDT_BUDGET_RANK_BINS] = {0};
    int any_ranks = 0;
    int64_t nodes_total = 0;
    double realised = 0.0, predicted = 0.0, realised_auto = 0.0, emitted = 0.0;
    const int32_t *probe_n = g->h_acc + acc_probe_n(MS);
    const int32_t *probe_sc = g->h_acc + acc_probe_scores(MS); /* fp32 bits */
    kdt_status st = KDT_OK;
    for (int32_t s = 0; s < S; s++) {
        const int32_t slot = e->slot_of[s];
        eng_stream *es = &e->streams[slot];
        const int32_t tau = h_tau[s];
        if (tau < 1 || tau > KDT_MAX_PATH || (park && s < rc.gr.n_draft && tau != 1))
            return kdt_fail(KDT_ERR_INTERNAL, "engine GPU: stream %d: tau %d", es->id, tau);
        nodes_total += 1 + e->b_budget[s];
        if (s < rc.gr.n_draft) realised += tau - 1;
        if (rc.gr.n_auto > 0 && rc.drafts && s < rc.gr.n_tree && es->params.spec == KDT_SPEC_AUTO) {
            /* this round's tree is the first b_budget pops of its probe: the surrogate of what was
             * verified, then the probe is kept for the next round's choice */
            const int32_t np = probe_n[s] - 1 < 0 ? 0 : probe_n[s] - 1 > rc.pstride - 1 ? rc.pstride - 1 : probe_n[s] - 1;
            float *sc = g->probe + (int64_t)slot * g->MN; /* kept for the next round's choice */
            memcpy(sc, probe_sc + (int64_t)s * rc.pstride + 1, sizeof(float) * (size_t)np);
            double sum = 0.0;
            for (int32_t i = 0; i < np && i < e->b_budget[s]; i++) {
                const double g_i = exp((double)sc[i]);
                sum += g_i;
                rank_pred[kdt_budget_rank_bin(i + 1)] += g_i; /* node i + 1 was verified */
            }
            for (int32_t k = 1; k < tau; k++) { /* the accepted nodes past the root */
                const int32_t node = h_nodes[(int64_t)s * KDT_MAX_PATH + k];
                if (node >= 1 && node <= e->b_budget[s]) rank_real[kdt_budget_rank_bin(node)] += 1.0;
            }
            any_ranks = 1;
            predicted += sum < e->b_depth_limit[s] ? sum : e->b_depth_limit[s];
            realised_auto += tau - 1;
            g->n_probe[slot] = np;
        }
        int32_t *evt = e->ev_tokens + (int64_t)slot * KDT_MAX_PATH;
        const int32_t n = kdt_round_emit(es, h_emit + (int64_t)s * KDT_MAX_PATH, tau, evt);
        kdt_round_event(events, n_ev, es, evt, n, tau);
        e->stats.tokens_emitted += (uint64_t)n;
        emitted += n;
        e->stats.tau_hist[tau < 17 ? tau : 17]++;
        if (es->finish == KDT_FINISH_NONE) {
            if (park && s < rc.gr.n_draft) g->pend_n[slot]++; /* a finished stream's row is dropped */
            es->prefix_len += tau;
            if (st == KDT_OK) st = kdt_gpu_kv_stream_set_length(g->kv, slot, es->prefix_len);
        }
    }
    if (st != KDT_OK) return st;
    for (int32_t s = 0; s < S; s++) {
        const int32_t slot = e->slot_of[s];
        if (e->streams[slot].finish != KDT_FINISH_NONE) {
            kdt_engine_release_stream(e, slot);
            e->streams[slot].state = SLOT_FREE;
        }
    }
    /* stats: GPU stage times; host work and syncs count as accept (the overhead share) */
    const double wall = t_end - t0;
    const double t_flush = rc.flushed ? elapsed_s(g, EV_FLUSH, EV_FLUSH + 1) : 0.0;
    const double t_draft = elapsed_s(g, 0, 1) + elapsed_s(g, 4, 5) + t_flush, t_verify = elapsed_s(g, 2, 3);
    const double t_build = elapsed_s(g, 1, 2);
    double t_acc = wall - t_draft - t_verify - t_build;
    if (t_acc < 0) t_acc = 0;
    if (g->profile) {
        const double stg[5] = {elapsed_s(g, 0, 1), t_build, t_verify, elapsed_s(g, 3, 4),
                               elapsed_s(g, 4, 5) + t_flush};
        double gpu = 0;
        for (int i = 0; i < 5; i++) {
            g->prof[i] += stg[i];
            gpu += stg[i];
        }
        g->prof[5] += wall - gpu;
        g->prof_rounds++;
    }
    e->stats.rounds++;
    e->stats.stream_rounds += (uint64_t)S;
    e->stats.t_draft += t_draft;
    e->stats.t_build += t_build;
    e->stats.t_verify += t_verify;
    e->stats.t_accept += t_acc;
    /* the controller's calibration sees the auto streams only: their trees are probe prefixes */
    const round_timing tm = {.S = S, .stride = rc.stride, .nodes = nodes_total, .drafts = rc.drafts,
                             .fixed_s = wall - t_verify, .verify_s = t_verify, .have_accept = rc.gr.n_auto > 0,
                             .predicted = predicted, .realised = realised_auto, .emitted = emitted, .wall_s = wall,
                             .setup = rc.captured};
    if (any_ranks) kdt_budget_observe_ranks(&e->budget, rank_pred, rank_real);
    kdt_round_observe(e, &rc.gr, &tm);
    if (rc.drafts && rc.gr.n_draft > 0) g->accept_mean = 0.9 * g->accept_mean + 0.1 * realised / rc.gr.n_draft;
    return KDT_OK;
}
