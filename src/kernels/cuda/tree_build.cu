/* tree_build.cu - CUDA tree_build (kdt_tree_build_cuda): the DDTree best-first heap and the
 * DFlash chain for all streams in one launch. Same candidates, keys and score adds as the CPU
 * twin (cpu/tree_build.c, ../tree_build_internal.h), so the trees are identical bit for bit.
 *
 * One warp (one 32-thread CTA) per stream:
 *   1. Stage the stream's usable log-probs, top_logp[s][0..L)[0..min(K, B+1)), in shared memory
 *      (ranks above B can never be scored: a rank-r node needs r earlier siblings), and the
 *      matching top_ids too when everything fits in 48 KB (saves a global round trip later).
 *   2. Pops, one of two loops; both order candidates by the same packed key.
 *      B <= 32 (max_nodes <= 33): run_list. The frontier is one list sorted by key, lane k
 *      holding the k-th largest, and every lane has a copy of the top. A pop takes the top,
 *      computes its two successors (next sibling, first child) identically in all lanes, and
 *      picks the next top as the larger of the larger successor and the list's second entry;
 *      the successors are merged into the list (shuffles of it, per-lane compares) during the
 *      next pop, beside its log-prob loads. So a pop is a chain of a shared-memory load, the
 *      key math and a compare-select, with no reduction. KDT_TREE_BUILD_SLOTS=1 (read once per
 *      process) runs run_heap<1> instead, for A/B timing; both give the same bits.
 *      B > 32: run_heap<M>. Slot j of the frontier is register j/32 of lane j%32, M registers
 *      per lane. Each lane caches the best key of its slots. A pop is two warp reductions
 *      (__reduce_max_sync) over the packed key: the high words (score order keys), then the low
 *      words (depth/parent/rank tie bits) among lanes holding that high word. Every lane then
 *      knows the popped candidate and its score (the key is invertible) and computes the
 *      child's key identically; the lane that held it writes the node record and refills that
 *      slot with the next sibling, whose key was precomputed when the slot was filled (or with
 *      the child when there is no sibling); when there are both, the child goes to the next
 *      free slot. Slots carry their parent's score.
 *      So no lane reads a record written by another lane during the pops (run_list keeps the
 *      node scores in registers, node k's in lane k): no shared-memory frontier, no barrier per
 *      pop, and nothing for racecheck to flag.
 *   3. After the pops, lanes write the nodes in parallel: token gathered from top_ids, links,
 *      position, score, and the ancestor mask row: run_list carries each node's mask in a
 *      register (parent's | self, one word), run_heap's rows walk up the parents (depth <= 16).
 * Launch: with programmatic dependent launch (pdl.cuh) where the device allows it, so the launch
 * overlaps the previous kernel's tail (0.4 us of a ~5 us call at 64 streams x B 32).
 * Per-stream values live in device memory and cannot be checked by the launcher; the kernel
 * clamps them so that nothing out of bounds is ever touched and the tree is well formed:
 *   budget -> clamp(budget, 0, max_nodes - 1), depth_limit -> clamp(depth_limit, 1, max_depth),
 *   position = prefix_len + depth with 32-bit wrap-around (the CPU twin rejects such input;
 *   with clamped values in the CPU's input, both produce the same tree).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "kdtree/kernels.h"
#include "kernels/tree_build_internal.h"
#include "device_limits.h"
#include "pdl.cuh"

namespace {

constexpr unsigned FULL = 0xffffffffu;

struct Args {
    int max_depth, top_k, max_nodes, n_words, chain;
    int stage_ids;                           /* top_ids staged in shared memory too */
    const int32_t *__restrict__ top_ids;     /* [S][max_depth][top_k] */
    const float *__restrict__ top_logp;      /* [S][max_depth][top_k] */
    const int32_t *__restrict__ depth_limit; /* [S] */
    const int32_t *__restrict__ budget;      /* [S] */
    const int32_t *__restrict__ root_token;  /* [S] */
    const int32_t *__restrict__ prefix_len;  /* [S] */
    int32_t *n_nodes;                        /* [S] */
    int32_t *token, *parent, *depth, *first_child, *next_sibling, *position; /* [S][max_nodes] */
    float *score;                            /* [S][max_nodes] */
    uint64_t *anc_mask;                      /* [S][max_nodes][n_words] */
};

/* Shared memory of one stream, carved from the dynamic allocation. */
struct Smem {
    float *logp;          /* [L][kc] staged log-probs, row stride kc */
    int32_t *ids;         /* [L][kc] staged token ids (if Args::stage_ids) */
    uint32_t *node_tie;   /* [max_nodes] tie bits (depth, parent, rank) of each node */
    float *node_score;    /* [max_nodes] */
    int32_t *first_child; /* [max_nodes] */
    int32_t *next_sib;    /* [max_nodes] */
};

size_t smem_bytes(int max_depth, int top_k, int max_nodes, int stage_ids) {
    const int kc_max = top_k < max_nodes ? top_k : max_nodes;
    return (size_t)max_depth * kc_max * 4 * (stage_ids ? 2 : 1) + (size_t)max_nodes * 16;
}

/* score[parent] + log-prob: one fp32 add, NaN -> -inf (tree_build_internal.h). */
__device__ __forceinline__ float add_score(float parent_score, float logp) {
    const float s = __fadd_rn(parent_score, logp);
    return s != s ? -INFINITY : s;
}

__device__ __forceinline__ uint64_t make_key(float score, int depth, int parent, int rank) {
    if (score == 0.0f) score = 0.0f; /* -0 -> +0, as kdt_f32_order_key */
    return ((uint64_t)kdt_tb_order_key_bits(__float_as_uint(score)) << 32) |
           kdt_tb_tie_bits(depth, parent, rank);
}

/* Builds one stream's pop sequence into sm; returns the node count. M = frontier registers per
 * lane, 32 * M >= max(1, max_nodes - 1).
 * Slot m of a lane holds a candidate: its key (0 = empty), the node index of its previous
 * sibling (-1 for rank 0), its parent's score, and the precomputed key of its next sibling
 * (0 = none). With the parent score in the slot no lane ever reads another lane's node record
 * during the pops, and the popped slot's replacement (usually that sibling) is ready without a
 * shared-memory load. The node records (tie bits, score, links) are written by the winning lane
 * only and read after the caller's __syncwarp: race-free by construction. */
template <int M>
__device__ int run_heap(const Smem &sm, int budget, int depth_limit, int kc, int lane) {
    uint64_t slot_key[M], slot_sib[M];
    int32_t slot_prev[M];
    float slot_ps[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        slot_key[m] = 0;
        slot_sib[m] = 0;
        slot_prev[m] = -1;
        slot_ps[m] = 0.0f;
    }
    if (lane == 0) {
        slot_key[0] = make_key(add_score(0.0f, sm.logp[0]), 1, 0, 0);
        if (1 < kc) slot_sib[0] = make_key(add_score(0.0f, sm.logp[1]), 1, 0, 1);
    }
    uint64_t best = slot_key[0]; /* this lane's best slot key */
    int n = 1, n_slots = 1;
    for (;;) {
        const uint32_t hi = __reduce_max_sync(FULL, (uint32_t)(best >> 32));
        if (hi == 0) break; /* frontier exhausted */
        const uint32_t lo =
            __reduce_max_sync(FULL, (uint32_t)(best >> 32) == hi ? (uint32_t)best : 0u);
        const uint64_t popped = ((uint64_t)hi << 32) | lo;
        const int d = kdt_tb_depth(lo), par = kdt_tb_parent(lo), r = kdt_tb_rank(lo);
        const float sp = __uint_as_float(kdt_tb_key_to_bits(hi));
        const int i = n++;
        const bool has_child = d < depth_limit && n <= budget;
        /* Loads every lane may need, issued together (addresses are warp-uniform). */
        const float lp_child = has_child ? sm.logp[d * kc] : 0.0f;
        const float lp_child_sib = has_child && 1 < kc ? sm.logp[d * kc + 1] : 0.0f;
        const float lp_sib2 = r + 2 < kc && n <= budget ? sm.logp[(d - 1) * kc + r + 2] : 0.0f;
        const uint64_t child_key = has_child ? make_key(add_score(sp, lp_child), d + 1, i, 0) : 0;
        const uint64_t child_sib =
            has_child && 1 < kc ? make_key(add_score(sp, lp_child_sib), d + 1, i, 1) : 0;
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (slot_key[m] != popped) continue; /* exactly one slot of one lane matches */
            sm.node_tie[i] = lo;
            sm.node_score[i] = sp;
            if (r == 0) sm.first_child[par] = i;
            else sm.next_sib[slot_prev[m]] = i;
            const uint64_t sib = slot_sib[m];
            if (sib != 0) { /* next sibling takes the slot; the child (if any) is appended */
                slot_key[m] = sib;
                slot_prev[m] = i;
                slot_sib[m] = r + 2 < kc ? make_key(add_score(slot_ps[m], lp_sib2), d, par, r + 2) : 0;
            } else {
                slot_key[m] = child_key;
                slot_prev[m] = -1;
                slot_ps[m] = sp;
                slot_sib[m] = child_sib;
            }
        }
        if (n > budget) break; /* the last pop's successors are never needed */
        /* The winner kept the sibling (r + 1 < kc, warp-uniform) and the child needs a slot. */
        const bool append = r + 1 < kc && has_child;
        const int app_lane = n_slots & 31, app_m = n_slots >> 5;
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (append && lane == app_lane && m == app_m) {
                slot_key[m] = child_key;
                slot_prev[m] = -1;
                slot_ps[m] = sp;
                slot_sib[m] = child_sib;
            }
        }
        n_slots += append;
        const int used_m = (n_slots + 31) >> 5; /* registers in use, warp-uniform */
        best = slot_key[0];
#pragma unroll
        for (int m = 1; m < M; m++) {
            if (m >= used_m) break;
            if (slot_key[m] > best) best = slot_key[m];
        }
    }
    return n;
}

/* add_score + the score half of make_key, for run_list: the same bits in fewer dependent steps.
 * fmaxf(s, -inf) is -inf for a NaN s and s otherwise. There is no -0 fold because no sum is -0
 * there: a sum is -0 only when both terms are, and no parent score is (the root's is +0, every
 * other is a sum, recovered exactly from its key; a missing successor's is -inf). */
__device__ __forceinline__ uint32_t list_score_key(float parent_score, float logp) {
    const uint32_t u = __float_as_uint(fmaxf(__fadd_rn(parent_score, logp), -INFINITY));
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u); /* kdt_tb_order_key_bits */
}

/* kdt_tb_key_to_bits in two steps: a key with its top bit set flips it, any other flips all. */
__device__ __forceinline__ float list_key_score(uint32_t key) {
    return __uint_as_float(key ^ (~(uint32_t)((int32_t)key >> 31) | 0x80000000u));
}

/* Builds one stream's pop sequence into sm when budget <= 32 (M = 1); returns the node count.
 * Same pops, node records and count as run_heap<1> (and the CPU heap), from another frontier:
 * one list sorted by key, lane k holding the k-th largest (`own`), and its top (lane 0's) in
 * every lane (`top`). Lane k also holds node k's score and where its next child gets linked,
 * so the popped candidate's parent score and link are a shuffle away and the list holds keys
 * only.
 * A pop makes `top` node i and computes, in every lane, its successors: the sibling (d, par,
 * r+1) and the child (d+1, i, 0), the CPU's pushes; a > b are the two. The next top is old lane
 * 1 if it beats both, else a: a chain of the log-prob loads, the key math and one
 * compare-select per pop. Merging a and b into the list minus its top waits for the next pop,
 * beside its loads: with pa / pb = the number of keys at lanes >= 1 above a / b (pa <= pb),
 * new lane k takes old lane k+1 for k < pa, a at pa, its own key for pa < k <= pb, b at pb+1
 * and old lane k-1 above. The list is sorted, so "k < pa" is "old lane k+1 > a", and so on:
 * per-lane compares against shuffles of the old list. Lane 0's list key is never read (the
 * top is `top`; lane 1's up compare is skipped), so the merge leaves whatever it gets there.
 * A missing successor, and every free place of the list, is `none` = (-inf, tie bits 0):
 * below every real key (a real -inf key has tie bits > 0), and a top of `none` means the
 * frontier is empty. The first pop's merge puts two of them into an all-`none` list.
 * Nothing falls off the list: before pop p the frontier holds at most p candidates (a pop
 * takes one and adds at most two), and pops stop at p = budget <= 32. So lane 31 holds `none`
 * at every merge, and its shuffle-down (its own key) never beats a. */
__device__ int run_list(const Smem &sm, int budget, int depth_limit, int kc, int lane, uint64_t &mask_lane,
                        uint64_t &mask_32) {
    /* Tie bits are edited in place (tree_build_internal.h): a candidate's sibling is its tie
     * bits - 1 (rank + 1), its child its depth field - 1 plus child_pr, the parent and rank
     * fields of (parent i, rank 0). Log-prob rows are addressed from the depth field
     * dq = 16 - d and the rank field rf = 1023 - r. */
    const uint64_t none = (uint64_t)list_score_key(0.0f, -INFINITY) << 32;
    uint64_t top = ((uint64_t)list_score_key(0.0f, sm.logp[0]) << 32) | kdt_tb_tie_bits(1, 0, 0);
    uint64_t own = none, a = none, b = none; /* a, b: the previous pop's successors */
    uint32_t child_pr = kdt_tb_tie_bits(16, 1, 0);
    const uint32_t dq_min = 16 - depth_limit; /* has a child: dq > dq_min (d < depth_limit) */
    const uint32_t rf_min = 1024 - kc;        /* has a sibling: rf > rf_min (r + 1 < kc) */
    const int row16 = 16 * kc, row15_col1024 = 15 * kc + 1024;
    float node_sc = 0.0f; /* score of node `lane`; the root's is 0 */
    /* where node `lane`'s next child is linked, as an index from first_child: its first_child,
     * then its last child's next_sib (next_sib = first_child + max_nodes, one buffer) */
    int link_at = lane;
    const int to_next_sib = (int)(sm.next_sib - sm.first_child);
    /* ancestor-or-self masks (max_nodes <= 33: one word): node `lane`'s, and node 32's in every
     * lane; a pop's is its parent's plus itself, so phase 3 needs no walk up the parents */
    mask_lane = lane == 0 ? 1ull : 0ull;
    mask_32 = 0;
    int n = 1;
    for (;;) {
        const uint64_t dn = __shfl_down_sync(FULL, own, 1), up = __shfl_up_sync(FULL, own, 1);
        const uint32_t lo = (uint32_t)top;
        const uint32_t dq = lo >> KDT_TB_DEPTH_SHIFT, rf = lo & 1023u;
        const int par = kdt_tb_parent(lo);
        const float sp = list_key_score((uint32_t)(top >> 32));
        const float ps = __shfl_sync(FULL, node_sc, par);
        const int link = __shfl_sync(FULL, link_at, par);
        const uint64_t pmask = __shfl_sync(FULL, mask_lane, par);
        const int i = n++;
        /* Both loads are made whether or not the successor exists, so they wait only for
         * their address: row d, and column r + 1 <= kc of row d - 1, are at most d * kc <=
         * max_depth * kc_max: inside the shared buffer (log-probs, then ids or node_tie[0],
         * which is never written). A missing successor gets the parent score -inf instead,
         * and -inf + anything scores -inf (NaN included). */
        const bool has_child = dq > dq_min, has_sib = rf > rf_min;
        const float lp_child = sm.logp[row16 - (int)dq * kc];
        const float lp_sib = sm.logp[row15_col1024 - (int)dq * kc - (int)rf];
        const float base_child = has_child ? sp : -INFINITY, base_sib = has_sib ? ps : -INFINITY;
        /* the previous pop's merge, beside the loads */
        const bool below_pa = dn > a;              /* k < pa */
        const bool upto_pa = own > a;              /* k <= pa */
        const bool upto_pb = own > b;              /* k <= pb */
        const bool upto_pb1 = lane <= 1 || up > b; /* k <= pb + 1 (lane 1's up is lane 0's) */
        own = below_pa ? dn : upto_pa ? a : upto_pb ? own : upto_pb1 ? b : up;
        const uint64_t l1 = __shfl_sync(FULL, own, 1);
        /* this pop's successors, `none` when missing */
        const uint64_t c = (uint64_t)list_score_key(base_child, lp_child) << 32 |
                           (has_child ? (lo & (15u << KDT_TB_DEPTH_SHIFT)) -
                                            (1u << KDT_TB_DEPTH_SHIFT) + child_pr
                                      : 0u);
        const uint64_t sib = (uint64_t)list_score_key(base_sib, lp_sib) << 32 |
                             (has_sib ? lo - 1u : 0u);
        child_pr -= 1u << KDT_TB_PARENT_SHIFT;
        if (lane == 0) { /* node record */
            sm.node_tie[i] = lo;
            sm.node_score[i] = sp;
            sm.first_child[link] = i;
        }
        if (lane == i) node_sc = sp, mask_lane = pmask | 1ull << i;
        if (i == 32) mask_32 = pmask | 1ull << 32;
        if (lane == par) link_at = to_next_sib + i;
        a = c > sib ? c : sib;
        b = a ^ c ^ sib;                    /* the other one */
        top = l1 > c && l1 > sib ? l1 : a; /* compares beside c > sib */
        /* the last pop's successors are never needed; a `none` top: the frontier is empty */
        if (n > budget || (uint32_t)top == 0) break;
    }
    return n;
}

/* LIST: run_list instead of run_heap<M> (M = 1 only). */
template <int M, bool LIST>
__global__ void __launch_bounds__(32) tree_build_kernel(const Args a) {
    static_assert(!LIST || M == 1, "run_list holds at most 32 candidates");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    pdl::wait(); /* the top-K input may come from the previous kernel in the stream */
    pdl::launch_dependents();
    const int s = blockIdx.x, lane = threadIdx.x;
    uint64_t mask_lane = 0, mask_32 = 0; /* run_list's ancestor masks */
    const int max_nodes = a.max_nodes, K = a.top_k;
    const int budget = min(max(__ldg(a.budget + s), 0), max_nodes - 1);
    const int depth_limit = min(max(__ldg(a.depth_limit + s), 1), a.max_depth);
    const int kc = min(K, budget + 1); /* ranks that can ever be scored */
    const int kc_max = min(K, max_nodes);

    Smem sm;
    sm.logp = (float *)smem_raw;
    sm.ids = (int32_t *)(sm.logp + (size_t)a.max_depth * kc_max);
    sm.node_tie = (uint32_t *)(sm.ids + (a.stage_ids ? (size_t)a.max_depth * kc_max : 0));
    sm.node_score = (float *)(sm.node_tie + max_nodes);
    sm.first_child = (int32_t *)(sm.node_score + max_nodes);
    sm.next_sib = sm.first_child + max_nodes;

    /* 1. stage log-probs (and ids): all loads of a round in flight before the stores */
    const int64_t in_base = (int64_t)s * a.max_depth * K;
    const int n_stage = depth_limit * kc;
    for (int base = 0; base < n_stage; base += 32 * 8) {
        float v[8];
        int32_t id[8];
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const int idx = base + q * 32 + lane;
            const int64_t at = in_base + (idx / kc) * K + idx % kc;
            if (idx < n_stage) {
                v[q] = __ldg(a.top_logp + at);
                if (a.stage_ids) id[q] = __ldg(a.top_ids + at);
            }
        }
#pragma unroll
        for (int q = 0; q < 8; q++) {
            const int idx = base + q * 32 + lane;
            if (idx < n_stage) {
                sm.logp[idx] = v[q];
                if (a.stage_ids) sm.ids[idx] = id[q];
            }
        }
    }
    for (int i = lane; i < max_nodes; i += 32) {
        sm.first_child[i] = -1;
        sm.next_sib[i] = -1;
    }
    if (lane == 0) sm.node_score[0] = 0.0f;
    __syncwarp();

    /* 2. pops (or the chain) */
    int n = 1;
    if (a.chain) {
        const int last = min(budget, depth_limit);
        float sc = 0.0f;
        for (int d = 1; d <= last; d++) { /* sequential adds, as on the CPU */
            sc = add_score(sc, sm.logp[(d - 1) * kc]);
            sm.node_tie[d] = kdt_tb_tie_bits(d, d - 1, 0);
            sm.node_score[d] = sc;
            sm.first_child[d - 1] = d;
        }
        n = last + 1;
    } else if (budget > 0) {
        n = LIST ? run_list(sm, budget, depth_limit, kc, lane, mask_lane, mask_32)
                 : run_heap<M>(sm, budget, depth_limit, kc, lane);
    }
    const bool masks_known = LIST && !a.chain && budget > 0; /* warp-uniform */
    __syncwarp();

    /* 3. write the nodes and padding; mask rows by walking up the parents */
    const int64_t base = (int64_t)s * max_nodes;
    const int W = a.n_words;
    const int32_t prefix = __ldg(a.prefix_len + s);
    for (int i = lane; i < max_nodes; i += 32) {
        uint64_t *row = a.anc_mask + (base + i) * W;
        if (i >= n) {
            a.token[base + i] = -1;
            a.parent[base + i] = -1;
            a.depth[base + i] = -1;
            a.first_child[base + i] = -1;
            a.next_sibling[base + i] = -1;
            a.position[base + i] = -1;
            a.score[base + i] = -INFINITY;
            for (int w = 0; w < W; w++) row[w] = 0;
            continue;
        }
        int tok, par, dep;
        float sc;
        if (i == 0) {
            tok = __ldg(a.root_token + s);
            par = -1;
            dep = 0;
            sc = 0.0f;
        } else {
            const uint32_t tie = sm.node_tie[i];
            dep = kdt_tb_depth(tie);
            par = kdt_tb_parent(tie);
            const int r = kdt_tb_rank(tie);
            tok = a.stage_ids ? sm.ids[(dep - 1) * kc + r]
                              : __ldg(a.top_ids + in_base + (int64_t)(dep - 1) * K + r);
            sc = sm.node_score[i];
        }
        a.token[base + i] = tok;
        a.parent[base + i] = par;
        a.depth[base + i] = dep;
        a.first_child[base + i] = sm.first_child[i];
        a.next_sibling[base + i] = sm.next_sib[i];
        a.position[base + i] = (int32_t)((uint32_t)prefix + (uint32_t)dep);
        a.score[base + i] = sc;
        if (masks_known) { /* max_nodes <= 33: W == 1 */
            row[0] = i < 32 ? mask_lane : mask_32;
            continue;
        }
        /* Words above i's are zero; then ancestors come in decreasing index order, so each
         * word is finished before a lower one starts. */
        int cw = W - 1;
        for (; cw > (i >> 6); cw--) row[cw] = 0;
        uint64_t acc = 0;
        int anc = i;
        for (int step = 0; step <= KDT_MAX_DEPTH; step++) {
            const int wa = anc >> 6;
            for (; cw > wa; cw--) {
                row[cw] = acc;
                acc = 0;
            }
            acc |= 1ull << (anc & 63);
            if (anc == 0) break;
            anc = kdt_tb_parent(sm.node_tie[anc]);
        }
        for (; cw >= 0; cw--) { /* word 0 (the root's), normally the only one left */
            row[cw] = acc;
            acc = 0;
        }
    }
    if (lane == 0) a.n_nodes[s] = n;
}

typedef void (*kernel_fn)(const Args);

bool read_slots_env() {
    const char *e = getenv("KDT_TREE_BUILD_SLOTS");
    return e != nullptr && e[0] == '1';
}

/* KDT_TREE_BUILD_SLOTS=1: run_heap for B <= 32 too, for A/B timing (read once per process). */
bool use_slots() {
    static const bool slots = read_slots_env();
    return slots;
}

kernel_fn pick_kernel(int max_nodes) {
    const int slots = max_nodes - 1 > 1 ? max_nodes - 1 : 1; /* frontier never exceeds B */
    if (slots <= 32) return use_slots() ? tree_build_kernel<1, false> : tree_build_kernel<1, true>;
    if (slots <= 64) return tree_build_kernel<2, false>;
    if (slots <= 128) return tree_build_kernel<4, false>;
    if (slots <= 256) return tree_build_kernel<8, false>;
    if (slots <= 512) return tree_build_kernel<16, false>;
    return tree_build_kernel<32, false>;
}

} // namespace

extern "C" kdt_status kdt_tree_build_cuda(const kdt_tree_build_params *p, kdt_tree *out,
                                          void *stream) {
    static const char *who = "kdt_tree_build_cuda";
    kdt_status st = kdt_tree_build_check_args(p, out, 0, who);
    if (st != KDT_OK) return st;
    const int stage_ids = smem_bytes(p->max_depth, p->top_k, out->max_nodes, 1) <= 48 * 1024;
    const size_t smem = smem_bytes(p->max_depth, p->top_k, out->max_nodes, stage_ids);
    const kernel_fn kernel = pick_kernel(out->max_nodes);
    cudaError_t e = cudaSuccess;
    if (smem > 48 * 1024) {
        int dev = 0, max_optin = 0;
        e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = kdt_smem_optin(dev, &max_optin);
        if (e == cudaSuccess && smem > (size_t)max_optin)
            return kdt_fail(KDT_ERR_UNSUPPORTED,
                            "%s: max_depth = %d x top_k = %d needs %zu bytes of shared memory, "
                            "this device allows %d", who, p->max_depth, p->top_k, smem, max_optin);
        if (e == cudaSuccess)
            e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return kdt_fail(KDT_ERR_CUDA, "%s: shared memory setup failed: %s", who,
                            cudaGetErrorString(e));
    }
    Args a;
    a.max_depth = p->max_depth;
    a.top_k = p->top_k;
    a.max_nodes = out->max_nodes;
    a.n_words = KDT_MASK_WORDS(out->max_nodes);
    a.chain = p->chain;
    a.stage_ids = stage_ids;
    a.top_ids = p->top_ids;
    a.top_logp = p->top_logp;
    a.depth_limit = p->depth_limit;
    a.budget = p->budget;
    a.root_token = p->root_token;
    a.prefix_len = p->prefix_len;
    a.n_nodes = out->n_nodes;
    a.token = out->token;
    a.parent = out->parent;
    a.depth = out->depth;
    a.first_child = out->first_child;
    a.next_sibling = out->next_sibling;
    a.position = out->position;
    a.score = out->score;
    a.anc_mask = out->anc_mask;
    static const bool use_pdl = pdl::usable(tree_build_kernel<1, true>);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)p->n_streams);
    cfg.blockDim = dim3(32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = (cudaStream_t)stream;
    cudaLaunchAttribute attr[1] = {};
    if (use_pdl) pdl::enable(&cfg, attr);
    e = cudaLaunchKernelEx(&cfg, kernel, a);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", who, cudaGetErrorString(e));
    return KDT_OK;
}
