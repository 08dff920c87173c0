/* fuzz_tree_accept.c - the greedy walk and its tree validation (kdt_tree_accept_cpu,
 * include/kdtree/kernels.h) on any tree. The input fills up to 4 streams of up to 40 nodes: node
 * counts (sometimes out of range), parents, tokens and the target's tokens from a small alphabet
 * (so siblings share tokens and walks go deep); per stream, a flag derives depth and the
 * child / sibling links from the parents (a well-formed tree, up to the parents and tokens), and
 * later bytes may overwrite single fields. Promise, checked against an oracle written from the
 * header's definition: a stream is flagged exactly when its tree is malformed, a flagged one has
 * tau 0 and bonus -1, the call fails exactly when some stream is flagged, and a clean one gets the
 * longest greedy path from the root plus the bonus token. */
#include <string.h>

#include "fuzz.h"
#include "kdtree/kernels.h"

enum { S_MAX = 4, N_MAX = 40 };

/* The header's definition of a well-formed tree, written out plainly: the children of every
 * node, in ascending index order, are exactly the nodes naming it as parent; depths follow the
 * parents and stay within L; siblings carry distinct tokens. */
static int well_formed(const int32_t *n_nodes, int s, int max_nodes, int L, const int32_t *par, const int32_t *dep,
                       const int32_t *fc, const int32_t *ns, const int32_t *tok) {
    const int n = n_nodes[s];
    if (n < 1 || n > max_nodes) return 0;
    const int32_t *P = par + s * max_nodes, *D = dep + s * max_nodes, *F = fc + s * max_nodes,
                  *X = ns + s * max_nodes, *T = tok + s * max_nodes;
    if (P[0] != -1 || D[0] != 0 || X[0] != -1) return 0; /* the root has no siblings */
    for (int i = 1; i < n; i++)
        if (P[i] < 0 || P[i] >= i || D[i] != D[P[i]] + 1 || D[i] > L) return 0;
    for (int i = 0; i < n; i++) {
        int want = -1; /* the smallest child of i */
        for (int j = i + 1; j < n && want < 0; j++) if (P[j] == i) want = j;
        if (F[i] != want) return 0;
        for (int c = want; c >= 0;) { /* each child's next sibling is the next node with parent i */
            int nxt = -1;
            for (int j = c + 1; j < n && nxt < 0; j++) if (P[j] == i) nxt = j;
            if (X[c] != nxt) return 0;
            for (int j = c + 1; j < n; j++) if (P[j] == i && T[j] == T[c]) return 0;
            c = nxt;
        }
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_reader r = {data, size, 0};
    const int S = 1 + fuzz_byte(&r) % S_MAX, max_nodes = 1 + fuzz_byte(&r) % N_MAX, L = 1 + fuzz_byte(&r) % KDT_MAX_DEPTH;
    const int cells = S * max_nodes;
    int32_t n_nodes[S_MAX], par[S_MAX * N_MAX], dep[S_MAX * N_MAX], fc[S_MAX * N_MAX], ns[S_MAX * N_MAX],
        tok[S_MAX * N_MAX], pos[S_MAX * N_MAX], tgt[S_MAX * N_MAX];
    float score[S_MAX * N_MAX];
    uint64_t mask[S_MAX * N_MAX];
    for (int s = 0; s < S; s++) {
        const int b = fuzz_byte(&r);
        n_nodes[s] = b < 240 ? 1 + b % max_nodes : b - 242; /* mostly in range; -2 .. 13 otherwise */
        const int derive = fuzz_byte(&r) & 1;
        for (int i = 0; i < max_nodes; i++) {
            const int k = s * max_nodes + i;
            const int pb = fuzz_byte(&r);
            par[k] = i == 0 ? -1 : (derive ? pb % i : pb % (i + 3) - 2);
            tok[k] = fuzz_byte(&r) % 4;
            tgt[k] = fuzz_byte(&r) % 4;
            dep[k] = 0, fc[k] = -1, ns[k] = -1, pos[k] = 0, score[k] = 0, mask[k] = 0;
        }
        if (derive) {
            for (int i = max_nodes - 1; i >= 1; i--) { /* links in ascending order: prepend from the end */
                const int k = s * max_nodes + i, pk = s * max_nodes + par[k];
                ns[k] = fc[pk];
                fc[pk] = i;
            }
            for (int i = 1; i < max_nodes; i++) dep[s * max_nodes + i] = dep[s * max_nodes + par[s * max_nodes + i]] + 1;
        } else {
            for (int i = 0; i < max_nodes; i++) {
                const int k = s * max_nodes + i;
                dep[k] = fuzz_byte(&r) % (L + 3) - 1;
                fc[k] = fuzz_byte(&r) % (max_nodes + 2) - 1;
                ns[k] = fuzz_byte(&r) % (max_nodes + 2) - 1;
            }
        }
        for (int i = 0; i < max_nodes; i++) pos[s * max_nodes + i] = dep[s * max_nodes + i];
    }
    /* single-field overwrites: (field, cell, value) triples */
    while (r.at + 3 <= r.n) {
        const int f = fuzz_byte(&r) % 5, k = fuzz_byte(&r) % cells, v = fuzz_byte(&r) % (max_nodes + 3) - 2;
        int32_t *arr[5] = {par, dep, fc, ns, tok};
        arr[f][k] = f == 4 ? (v & 3) : v;
    }
    kdt_tree t = {S, max_nodes, n_nodes, tok, par, dep, fc, ns, pos, score, mask};
    int32_t accepted[S_MAX * KDT_MAX_PATH], emit[S_MAX * KDT_MAX_PATH], tau[S_MAX], bonus[S_MAX], error[S_MAX];
    const kdt_tree_accept_params p = {&t, L, tgt, accepted, emit, tau, bonus, error};
    const kdt_status st = kdt_tree_accept_cpu(&p);
    int any_bad = 0;
    for (int s = 0; s < S; s++) {
        const int ok = well_formed(n_nodes, s, max_nodes, L, par, dep, fc, ns, tok);
        any_bad |= !ok;
        FUZZ_CHECK(ok == (error[s] == 0), "stream %d: flags %d, oracle says %s", s, (int)error[s],
                   ok ? "well-formed" : "malformed");
        if (!ok) {
            FUZZ_CHECK(tau[s] == 0 && bonus[s] == -1, "stream %d flagged, tau %d bonus %d", s, (int)tau[s], (int)bonus[s]);
            continue;
        }
        /* the oracle's walk: from the root, the child whose token is the target's, while one exists */
        const int32_t *P = par + s * max_nodes, *T = tok + s * max_nodes, *G = tgt + s * max_nodes;
        int path[KDT_MAX_PATH], len = 1, cur = 0;
        path[0] = 0;
        for (;;) {
            int hit = -1;
            for (int j = cur + 1; j < n_nodes[s] && hit < 0; j++) if (P[j] == cur && T[j] == G[cur]) hit = j;
            if (hit < 0) break;
            path[len++] = cur = hit;
        }
        FUZZ_CHECK(tau[s] == len, "stream %d: tau %d, the greedy path has %d nodes", s, (int)tau[s], len);
        for (int k = 0; k < len; k++) {
            FUZZ_CHECK(accepted[s * KDT_MAX_PATH + k] == path[k], "stream %d: accepted[%d] %d, want %d", s, k,
                       (int)accepted[s * KDT_MAX_PATH + k], path[k]);
            const int want = k + 1 < len ? T[path[k + 1]] : G[path[len - 1]];
            FUZZ_CHECK(emit[s * KDT_MAX_PATH + k] == want, "stream %d: emit[%d] %d, want %d", s, k,
                       (int)emit[s * KDT_MAX_PATH + k], want);
        }
        FUZZ_CHECK(bonus[s] == G[path[len - 1]], "stream %d: bonus %d", s, (int)bonus[s]);
    }
    fuzz_note("%d streams, %s", S, any_bad ? "some malformed" : "all well-formed");
    FUZZ_CHECK((st == KDT_OK) == !any_bad, "status %d with %s streams", (int)st, any_bad ? "bad" : "only good");
    return 0;
}
