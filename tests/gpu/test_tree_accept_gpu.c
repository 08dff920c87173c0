/* test_tree_accept_gpu.c - kdt_tree_accept_cuda against the CPU twin, bit for bit: random valid
 * trees (S 1..64, B 1..256 plus a few up to KDT_MAX_BUDGET, L 1..16) with malformed streams
 * mixed in (cycles, out-of-range links and parents, bad depths and sizes, duplicate siblings),
 * outputs poisoned before every launch so an unwritten element shows, and launcher argument
 * errors. KDT_TEST_QUICK=1 (used under compute-sanitizer) runs fewer seeds. Exits non-zero
 * with a message when no GPU is present.
 */
#include <cuda_runtime_api.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "kdtree/kernels.h"
#include "t.h"

#define P KDT_MAX_PATH

#include "gpu_test_util.h"

/* Host batch: tree arrays [S][maxn] (n_nodes [S]) and target [S][maxn]. */
typedef struct batch {
    int S, maxn, L;
    int32_t *n_nodes, *token, *parent, *depth, *fc, *ns, *target;
} batch;

#define AT(b, arr, s, i) ((b)->arr[(size_t)(s) * (b)->maxn + (i)])

static void batch_init(batch *b, int S, int maxn, int L) {
    size_t sn = (size_t)S * maxn;
    b->S = S; b->maxn = maxn; b->L = L;
    b->n_nodes = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)S);
    b->token = (int32_t *)xmalloc(sizeof(int32_t) * sn);
    b->parent = (int32_t *)xmalloc(sizeof(int32_t) * sn);
    b->depth = (int32_t *)xmalloc(sizeof(int32_t) * sn);
    b->fc = (int32_t *)xmalloc(sizeof(int32_t) * sn);
    b->ns = (int32_t *)xmalloc(sizeof(int32_t) * sn);
    b->target = (int32_t *)xmalloc(sizeof(int32_t) * sn);
}

static void batch_free(batch *b) {
    free(b->n_nodes); free(b->token); free(b->parent); free(b->depth); free(b->fc); free(b->ns);
    free(b->target);
}

/* A valid random tree with n nodes in stream s (parents < index, depth <= L, distinct sibling
 * tokens, links from parent[], padding -1) and targets that often follow a child. */
static void random_tree(batch *b, int s, int n, uint64_t *rng) {
    const int V = 5 + t_rand_int(rng, 60);
    for (int i = 0; i < b->maxn; i++)
        AT(b, token, s, i) = AT(b, parent, s, i) = AT(b, depth, s, i) = AT(b, fc, s, i) =
            AT(b, ns, s, i) = -1;
    AT(b, depth, s, 0) = 0;
    AT(b, token, s, 0) = t_rand_int(rng, V);
    for (int i = 1; i < n; i++) {
        int p;
        if (AT(b, depth, s, i - 1) < b->L && t_rand_int(rng, 3) != 0) p = i - 1;
        else do p = t_rand_int(rng, i); while (AT(b, depth, s, p) >= b->L);
        AT(b, parent, s, i) = p;
        AT(b, depth, s, i) = AT(b, depth, s, p) + 1;
        int tok = t_rand_int(rng, V);
        for (int again = 1; again;) { /* walk the sibling list built so far */
            again = 0;
            for (int c = AT(b, fc, s, p); c >= 0; c = AT(b, ns, s, c))
                if (AT(b, token, s, c) == tok) { tok++; again = 1; }
        }
        AT(b, token, s, i) = tok;
        /* append i to p's child list (indices increase, so it goes last) */
        if (AT(b, fc, s, p) < 0) AT(b, fc, s, p) = i;
        else {
            int c = AT(b, fc, s, p);
            while (AT(b, ns, s, c) >= 0) c = AT(b, ns, s, c);
            AT(b, ns, s, c) = i;
        }
    }
    b->n_nodes[s] = n;
    for (int i = 0; i < b->maxn; i++) {
        int t = t_rand_int(rng, V);
        if (i < n && AT(b, fc, s, i) >= 0 && t_rand_int(rng, 5) != 0) {
            int c = AT(b, fc, s, i);
            for (int hops = t_rand_int(rng, 3); hops > 0 && AT(b, ns, s, c) >= 0; hops--)
                c = AT(b, ns, s, c);
            t = AT(b, token, s, c);
        }
        AT(b, target, s, i) = t;
    }
}

/* One or two random corruptions of stream s (the malformed-tree classes of kernels.h). */
static void corrupt(batch *b, int s, uint64_t *rng) {
    const int n = b->n_nodes[s], maxn = b->maxn;
    for (int m = 1 + t_rand_int(rng, 2); m > 0; m--) {
        const int i = t_rand_int(rng, n);
        const int32_t vals[] = {-2, -1, 0, 1, i - 1, i, i + 1, n - 1, n, maxn, INT_MAX, INT_MIN,
                                t_rand_int(rng, n + 1) - 1, b->L, b->L + 1};
        const int32_t v = vals[t_rand_int(rng, (int)(sizeof vals / sizeof vals[0]))];
        switch (t_rand_int(rng, 8)) {
        case 0: AT(b, parent, s, i) = v; break;
        case 1: AT(b, depth, s, i) = v; break;
        case 2: AT(b, fc, s, i) = v; break;
        case 3: AT(b, ns, s, i) = v; break;
        case 4: AT(b, token, s, i) = AT(b, token, s, t_rand_int(rng, n)); break;
        case 5: b->n_nodes[s] = v; break;
        default: /* random links: the seed's cyclic trees */
            for (int k = 0; k < n; k++) {
                if (t_rand_int(rng, 3) == 0) AT(b, fc, s, k) = t_rand_int(rng, n + 1) - 1;
                if (t_rand_int(rng, 3) == 0) AT(b, ns, s, k) = t_rand_int(rng, n + 1) - 1;
            }
        }
    }
}

/* Runs CPU and CUDA on the batch and compares every output element. Returns the number of
 * flagged streams. */
static int compare_batch(const batch *b, const char *what) {
    const int S = b->S, maxn = b->maxn;
    const size_t sn = (size_t)S * maxn, i32 = sizeof(int32_t);
    kdt_tree ht = {S, maxn, b->n_nodes, b->token, b->parent, b->depth, b->fc, b->ns, NULL, NULL, NULL};
    int32_t *acc = (int32_t *)xmalloc(i32 * S * P), *emit = (int32_t *)xmalloc(i32 * S * P);
    int32_t *tau = (int32_t *)xmalloc(i32 * S), *bonus = (int32_t *)xmalloc(i32 * S);
    int32_t *err = (int32_t *)xmalloc(i32 * S);
    kdt_tree_accept_params hp = {&ht, b->L, b->target, acc, emit, tau, bonus, err};
    kdt_status cst = kdt_tree_accept_cpu(&hp);

    kdt_tree dt = {S, maxn, dev_copy(b->n_nodes, i32 * S), dev_copy(b->token, i32 * sn),
                   dev_copy(b->parent, i32 * sn), dev_copy(b->depth, i32 * sn),
                   dev_copy(b->fc, i32 * sn), dev_copy(b->ns, i32 * sn), NULL, NULL, NULL};
    int32_t *d_target = (int32_t *)dev_copy(b->target, i32 * sn);
    int32_t *d_out = NULL; /* one allocation: accepted, emit [S][P], tau, bonus, error [S] */
    const size_t out_n = (size_t)S * (2 * P + 3);
    CUDA_OK(cudaMalloc((void **)&d_out, i32 * out_n));
    kdt_tree_accept_params dp = {&dt, b->L, d_target, d_out, d_out + (size_t)S * P,
                                 d_out + (size_t)S * 2 * P, d_out + (size_t)S * (2 * P + 1),
                                 d_out + (size_t)S * (2 * P + 2)};
    int32_t *got = (int32_t *)xmalloc(i32 * out_n);
    for (int poison = 0; poison < 2; poison++) {
        CUDA_OK(cudaMemset(d_out, poison ? 0x5a : 0xa5, i32 * out_n));
        kdt_status gst = kdt_tree_accept_cuda(&dp, NULL);
        CHECK_MSG(gst == KDT_OK, "%s: launch %s (%s)", what, kdt_status_name(gst), kdt_last_error());
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(got, d_out, i32 * out_n, cudaMemcpyDeviceToHost));
        const int32_t *g_acc = got, *g_emit = got + (size_t)S * P, *g_tau = got + (size_t)S * 2 * P;
        const int32_t *g_bonus = g_tau + S, *g_err = g_bonus + S;
        int bad = 0;
        for (int s = 0; s < S && bad < 5; s++) {
            int ok = g_tau[s] == tau[s] && g_bonus[s] == bonus[s] && g_err[s] == err[s];
            for (int k = 0; k < P; k++)
                ok &= g_acc[(size_t)s * P + k] == acc[(size_t)s * P + k] &&
                      g_emit[(size_t)s * P + k] == emit[(size_t)s * P + k];
            if (!ok) {
                bad++;
                CHECK_MSG(0, "%s: stream %d (n_nodes %d): cuda tau %d bonus %d error 0x%x, cpu "
                          "tau %d bonus %d error 0x%x", what, s, b->n_nodes[s], g_tau[s],
                          g_bonus[s], (unsigned)g_err[s], tau[s], bonus[s], (unsigned)err[s]);
            }
        }
    }
    int flagged = 0;
    for (int s = 0; s < S; s++) flagged += err[s] != 0;
    CHECK_EQ_INT(cst, flagged ? KDT_ERR_MALFORMED_TREE : KDT_OK);
    cudaFree(dt.n_nodes); cudaFree(dt.token); cudaFree(dt.parent); cudaFree(dt.depth);
    cudaFree(dt.first_child); cudaFree(dt.next_sibling); cudaFree(d_target); cudaFree(d_out);
    free(acc); free(emit); free(tau); free(bonus); free(err); free(got);
    return flagged;
}

static int quick(void) { return getenv("KDT_TEST_QUICK") != NULL; }

static void test_random_valid_and_malformed(void) {
    uint64_t rng = 0x5eed;
    const int iters = quick() ? 12 : 400;
    int flagged = 0, streams = 0;
    for (int it = 0; it < iters; it++) {
        const int S = it % 7 == 0 ? 64 : 1 + t_rand_int(&rng, 64);
        const int B = it % 40 == 39 ? KDT_MAX_BUDGET - t_rand_int(&rng, 300)
                                    : 1 + t_rand_int(&rng, 256);
        const int L = 1 + t_rand_int(&rng, KDT_MAX_DEPTH);
        batch b;
        batch_init(&b, S, B + 1, L);
        for (int s = 0; s < S; s++) {
            /* mostly full trees (n = B + 1) as tree_build makes them, some smaller */
            int n = t_rand_int(&rng, 3) ? B + 1 : 1 + t_rand_int(&rng, B + 1);
            random_tree(&b, s, n, &rng);
            if (it % 3 != 0 && t_rand_int(&rng, 5) == 0) corrupt(&b, s, &rng);
        }
        char what[96];
        snprintf(what, sizeof what, "iter %d S %d B %d L %d", it, S, B, L);
        flagged += compare_batch(&b, what);
        streams += S;
        batch_free(&b);
    }
    printf("  %d streams compared, %d flagged malformed\n", streams, flagged);
    CHECK(flagged > 0);
}

/* Every stream of a big batch malformed in a different way, and the widest shapes. */
static void test_shapes(void) {
    uint64_t rng = 77;
    const int shapes[][3] = {{1, 1, 1}, {1, 2, 16}, {4096, 9, 4}, {3, KDT_MAX_NODES, 16},
                             {64, 33, 7}, {64, 33, 15}, {5, 63, 3}, {5, 64, 3}, {5, 65, 3}};
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        if (quick() && shapes[k][0] > 64) continue;
        batch b;
        batch_init(&b, shapes[k][0], shapes[k][1], shapes[k][2]);
        for (int s = 0; s < b.S; s++) {
            random_tree(&b, s, b.maxn - (s % 3 == 2 ? t_rand_int(&rng, b.maxn) : 0), &rng);
            if (s % 4 == 3) corrupt(&b, s, &rng);
        }
        char what[64];
        snprintf(what, sizeof what, "shape S %d maxn %d L %d", b.S, b.maxn, b.L);
        compare_batch(&b, what);
        batch_free(&b);
    }
}

static void test_argument_errors(void) {
    int32_t *d = NULL;
    CUDA_OK(cudaMalloc((void **)&d, 64 * sizeof(int32_t)));
    kdt_tree t = {1, 4, d, d, d, d, d, d, NULL, NULL, NULL};
    kdt_tree_accept_params p = {&t, 3, d, d, d, d, d, d};
    CHECK_EQ_INT(kdt_tree_accept_cuda(NULL, NULL), KDT_ERR_INVALID_ARG);
    p.max_depth = 0;
    CHECK_EQ_INT(kdt_tree_accept_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    CHECK(strstr(kdt_last_error(), "max_depth") != NULL);
    p.max_depth = 3;
    t.max_nodes = KDT_MAX_NODES + 1;
    CHECK_EQ_INT(kdt_tree_accept_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    t.max_nodes = 4;
    t.parent = NULL;
    CHECK_EQ_INT(kdt_tree_accept_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    CHECK(strstr(kdt_last_error(), "parent") != NULL);
    t.parent = d;
    p.error = NULL;
    CHECK_EQ_INT(kdt_tree_accept_cuda(&p, NULL), KDT_ERR_INVALID_ARG);
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(d);
}

int main(void) {
    if (!gpu_test_have_device("test_tree_accept_gpu")) return 1;
    T_RUN(test_random_valid_and_malformed);
    T_RUN(test_shapes);
    T_RUN(test_argument_errors);
    return t_summary();
}
