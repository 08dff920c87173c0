/* tree_build.cu - CUDA tree_build (kdt_tree_build_cuda): the DDTree best-first heap and the
 * DFlash chain for all streams in one launch. Same candidates, keys and score adds as the CPU
 * twin (cpu/tree_build.c, ../tree_build_internal.h), so the trees are identical bit for bit.
 * One warp (one 32-thread CTA) per stream. Two kernels; v2 is the default, v1 (the previous
 * kernel, unchanged) runs with KDT_TREE_BUILD_V1=1 and for trees of more than 129 nodes.
 *
 * v2 (B <= 128). Why it is faster: a pop of v1 is a chain of two dependent warp reductions
 * (score word, then tie word), a shared-memory load of the child's log-prob and the child's key
 * arithmetic, all before the next reduction can start. v2 keeps the frontier SORTED across the
 * warp (position p = register p/32 of lane p%32; position 0 is the head), so a pop needs no
 * reduction: the head is already known to every lane. Every candidate carries the keys of its
 * own two successors (next sibling, first child) and its parent's score, computed when the
 * candidate was created, so popping H yields the two new candidates S and C with no memory
 * access on the critical path; their own successor keys (4 broadcast shared loads + adds) are
 * computed alongside. Insertion is two ballots (how many entries beat S, beat C) and one
 * shuffle per field (each position takes S, C or its right neighbour shifted by 0, 1 or 2); the
 * next head is S, C or the old position 1 (fetched by a shuffle that overlaps the ballots).
 * The critical path of a pop is compare -> ballot -> popc -> shuffle instead of
 * reduce -> reduce -> load -> add -> reduce. Also: one global round trip up front (the
 * per-stream values and every row x rank any budget / depth limit could use, always in
 * bounds, so nothing waits for budget first); for max_nodes <= 64 the ancestor mask row
 * travels with the candidate (row = parent row | own bit), replacing the final walk up the
 * parents. Live candidates never exceed B (one pop removes one, adds at most two, and the
 * last pop adds none), so 32 * M >= B positions suffice.
 *
 * v1: the frontier lives in registers, slot j is register j/32 of lane j%32; each lane caches
 *   its best key; a pop is two __reduce_max_sync (score words, then tie words among lanes
 *   holding that score word); the holder writes the record and refills the slot with the
 *   precomputed next sibling, the child goes to the next free slot.
 *
 * Launch: with programmatic dependent launch (PDL, sm_90+, unless KDT_TREE_PDL=0) the kernel
 * may start while the previous kernel in the stream finishes; it waits (griddepcontrol.wait)
 * before its first global access, so the result is the same, only the launch latency overlaps.
 * It then allows its own dependents to launch. PDL is only used when the loaded kernel was
 * compiled for sm_90+ (cudaFuncGetAttributes().ptxVersion), i.e. contains the wait.
 *
 * Both kernels finish with the lanes writing the nodes in parallel (token from the staged ids,
 * links, position, score, mask row). Per-stream values live in device memory and cannot be
 * checked by the launcher; the kernels clamp them so that nothing out of bounds is ever touched
 * and the tree is well formed:
 *   budget -> clamp(budget, 0, max_nodes - 1), depth_limit -> clamp(depth_limit, 1, max_depth),
 *   position = prefix_len + depth with 32-bit wrap-around (the CPU twin rejects such input;
 *   with clamped values in the CPU's input, both produce the same tree).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kdtree/kernels.h"
#include "kernels/tree_build_internal.h"

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

/* Programmatic dependent launch (sm_90+; no-ops elsewhere and when launched without PDL). */
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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

template <int M>
__global__ void __launch_bounds__(32) tree_build_kernel(const Args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int s = blockIdx.x, lane = threadIdx.x;
    pdl_wait(); /* no-op unless launched as a PDL secondary (the v2 path's large-tree fallback) */
    pdl_launch_dependents();
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
        n = run_heap<M>(sm, budget, depth_limit, kc, lane);
    }
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

/* ---------------------------------------------------------------------------------------------
 * v2 (default): sorted frontier, one warp per stream (see the top of this file).
 * ------------------------------------------------------------------------------------------- */

/* One frontier candidate. Its key is (hi << 32) | lo; hi == 0 marks an empty position (a real
 * candidate's score key is never 0, tree_build_internal.h). Everything the pop of a candidate
 * needs travels with it, so a pop reads no shared memory on its critical path. */
struct Entry {
    uint32_t hi, lo; /* packed key: score order key, tie bits (depth, parent, rank) */
    uint32_t shi;    /* key hi of its next sibling (rank + 1), 0 = none; that sibling's lo is lo - 1 */
    uint32_t chi;    /* key hi of its first child, 0 = none */
    float ps;        /* its parent's score */
    int32_t prev;    /* node index of its previous sibling (-1 for rank 0) */
    uint64_t anc;    /* ANC only: ancestor mask row of its parent (max_nodes <= 64, one word) */
};

__device__ __forceinline__ uint64_t key_of(const Entry &e) { return ((uint64_t)e.hi << 32) | e.lo; }

__device__ __forceinline__ Entry empty_entry() {
    Entry e;
    e.hi = e.lo = e.shi = e.chi = 0;
    e.ps = 0.0f;
    e.prev = -1;
    e.anc = 0;
    return e;
}

__device__ __forceinline__ Entry pick(bool c, const Entry &x, const Entry &y) {
    Entry e;
    e.hi = c ? x.hi : y.hi;
    e.lo = c ? x.lo : y.lo;
    e.shi = c ? x.shi : y.shi;
    e.chi = c ? x.chi : y.chi;
    e.ps = c ? x.ps : y.ps;
    e.prev = c ? x.prev : y.prev;
    e.anc = c ? x.anc : y.anc;
    return e;
}

template <bool ANC>
__device__ __forceinline__ Entry shfl_entry(const Entry &x, int src) {
    Entry e;
    e.hi = __shfl_sync(FULL, x.hi, src);
    e.lo = __shfl_sync(FULL, x.lo, src);
    e.shi = __shfl_sync(FULL, x.shi, src);
    e.chi = __shfl_sync(FULL, x.chi, src);
    e.ps = __shfl_sync(FULL, x.ps, src);
    e.prev = __shfl_sync(FULL, x.prev, src);
    e.anc = ANC ? __shfl_sync(FULL, x.anc, src) : 0;
    return e;
}

/* Order key of a score (never -0 here; folded anyway, as kdt_f32_order_key) and its inverse. */
__device__ __forceinline__ uint32_t okey(float score) {
    return kdt_tb_order_key_bits(__float_as_uint(score == 0.0f ? 0.0f : score));
}
__device__ __forceinline__ float score_of(uint32_t hi) { return __uint_as_float(kdt_tb_key_to_bits(hi)); }

/* Shared memory of one stream (v2): log-probs staged at row stride ks = min(K, max_nodes). */
struct SmemV2 {
    uint64_t *row;        /* ANC: [max_nodes] ancestor mask row of each node */
    float *logp;          /* [max_depth][ks] */
    int32_t *ids;         /* [max_depth][ks] (if Args::stage_ids) */
    uint32_t *node_tie;   /* [max_nodes] */
    float *node_score;    /* [max_nodes] */
    int32_t *first_child; /* [max_nodes] */
    int32_t *next_sib;    /* [max_nodes] */
};

size_t smem_bytes_v2(int max_depth, int top_k, int max_nodes, int stage_ids) {
    return smem_bytes(max_depth, top_k, max_nodes, stage_ids) +
           (max_nodes <= 64 ? (size_t)max_nodes * 8 : 0);
}

/* The pops of one stream; returns the node count. M = sorted-frontier registers per lane
 * (position p = 32 * m + lane, 32 * M >= B); ANC: max_nodes <= 64, mask rows carried in the
 * entries. Lane 0 writes the node records (tie bits, score, links, mask row); they are read
 * after the caller's __syncwarp, so no lane reads shared memory written by another lane during
 * the pops. Every collective below runs on the full warp (all control flow is warp-uniform). */
template <int M, bool ANC>
__device__ int run_heap_v2(const SmemV2 &sm, int ks, int kc, int depth_limit, int budget,
                           int lane) {
    constexpr int NONE = 1 << 20; /* insert position of a successor that does not exist */
    Entry A[M];                   /* the sorted frontier; position 0 (lane 0, A[0]) is the head */
#pragma unroll
    for (int m = 0; m < M; m++) A[m] = empty_entry();
    /* The first candidate: depth 1, parent 0 (the root, score +0), rank 0. */
    Entry H;
    {
        const float s1 = add_score(0.0f, sm.logp[0]);
        H.hi = okey(s1);
        H.lo = kdt_tb_tie_bits(1, 0, 0);
        H.shi = 1 < kc ? okey(add_score(0.0f, sm.logp[1])) : 0u;
        H.chi = 1 < depth_limit ? okey(add_score(s1, sm.logp[ks])) : 0u;
        H.ps = 0.0f;
        H.prev = -1;
        H.anc = 1; /* the root's row */
    }
    if (lane == 0) A[0] = H;
    int n = 1;
    for (;;) { /* H = A[position 0] (uniform), never empty here */
        const int i = n++;
        const uint32_t lo = H.lo;
        const int d = kdt_tb_depth(lo), par = kdt_tb_parent(lo), r = kdt_tb_rank(lo);
        const float sc = score_of(H.hi);
        if (lane == 0) {
            sm.node_tie[i] = lo;
            sm.node_score[i] = sc;
            if (r == 0) sm.first_child[par] = i;
            else sm.next_sib[H.prev] = i;
            if (ANC) sm.row[i] = H.anc | (1ull << i);
        }
        if (n > budget) break; /* the last pop's successors are never needed */

        /* The successors: S = next sibling (d, par, r + 1), C = first child (d + 1, i, 0), each
         * with its own successor keys precomputed. Uniform loads (broadcast), clamped. */
        const bool has_s = H.shi != 0u;            /* r + 1 < kc */
        const bool has_c = H.chi != 0u;            /* d < depth_limit */
        const bool s_sib = has_s && r + 2 < kc;
        const bool c_sib = has_c && 1 < kc;
        const bool c_child = has_c && d + 1 < depth_limit;
        const float lp_s_sib = sm.logp[s_sib ? (d - 1) * ks + r + 2 : 0];
        const float lp_child = sm.logp[has_c ? d * ks : 0];
        const float lp_c_sib = sm.logp[c_sib ? d * ks + 1 : 0];
        const float lp_c_child = sm.logp[c_child ? (d + 1) * ks : 0];
        /* (computed unconditionally, then selected: straight-line code, no branches) */
        const uint32_t k_s_sib = okey(add_score(H.ps, lp_s_sib));
        const uint32_t k_s_child = okey(add_score(score_of(H.shi), lp_child));
        const uint32_t k_c_sib = okey(add_score(sc, lp_c_sib));
        const uint32_t k_c_child = okey(add_score(score_of(H.chi), lp_c_child));
        Entry S, C;
        S.hi = H.shi;
        S.lo = has_s ? lo - 1u : 0u;
        S.shi = s_sib ? k_s_sib : 0u;
        S.chi = has_s && has_c ? k_s_child : 0u;
        S.ps = H.ps;
        S.prev = i;
        S.anc = H.anc;
        C.hi = H.chi;
        C.lo = has_c ? kdt_tb_tie_bits(d + 1, i, 0) : 0u;
        C.shi = c_sib ? k_c_sib : 0u;
        C.chi = c_child ? k_c_child : 0u;
        C.ps = sc;
        C.prev = -1;
        C.anc = ANC ? (H.anc | (1ull << i)) : 0;
        const uint64_t key_s = key_of(S), key_c = key_of(C); /* 0 when absent */

        /* Insert positions among the remaining entries (positions 1..): two ballots. */
        int cnt_s = 0, cnt_c = 0;
#pragma unroll
        for (int m = 0; m < M; m++) {
            if (m * 32 >= n) break; /* warp-uniform: these positions are empty */
            const uint64_t k = key_of(A[m]);
            unsigned bs = __ballot_sync(FULL, k > key_s), bc = __ballot_sync(FULL, k > key_c);
            if (m == 0) {
                bs &= ~1u; /* position 0 is the popped head */
                bc &= ~1u;
            }
            cnt_s += __popc(bs);
            cnt_c += __popc(bc);
        }
        const int pos_s = has_s ? cnt_s + (key_c > key_s) : NONE;
        const int pos_c = has_c ? cnt_c + (key_s > key_c) : NONE;
        /* The next head: S, C or the old position 1. */
        const Entry E1 = shfl_entry<ANC>(A[0], 1);
        const Entry Hn = pick(pos_s == 0, S, pick(pos_c == 0, C, E1));

        /* Shift: new position p takes S, C, or old position p + 1 - (inserts before p). */
        if constexpr (M == 1) {
            const int delta = (pos_s < lane) + (pos_c < lane);
            const int src = lane + 1 - delta; /* 0..32; 32 = past the end */
            Entry g = shfl_entry<ANC>(A[0], src & 31);
            if (src > 31) g = empty_entry();
            A[0] = pick(lane == pos_s, S, pick(lane == pos_c, C, g));
        } else {
            Entry nxt[M], prv[M];
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m * 32 < n) { /* warp-uniform */
                    nxt[m] = shfl_entry<ANC>(A[m], (lane + 1) & 31);
                    prv[m] = shfl_entry<ANC>(A[m], (lane + 31) & 31);
                } else {
                    nxt[m] = empty_entry();
                    prv[m] = empty_entry();
                }
            }
#pragma unroll
            for (int m = 0; m < M; m++) {
                if (m * 32 >= n) break; /* warp-uniform: stays empty */
                const int p = m * 32 + lane;
                const int delta = (pos_s < p) + (pos_c < p);
                /* position p + 1 lives in lane + 1, or lane 0 of register m + 1 */
                const Entry up = lane == 31 ? (m + 1 < M ? nxt[m + 1] : empty_entry()) : nxt[m];
                /* position p - 1 lives in lane - 1, or lane 31 of register m - 1 */
                const Entry down = lane == 0 ? (m > 0 ? prv[m - 1] : empty_entry()) : prv[m];
                const Entry g = pick(delta == 0, up, pick(delta == 1, A[m], down));
                A[m] = pick(p == pos_s, S, pick(p == pos_c, C, g));
            }
        }
        H = Hn;
        if (H.hi == 0u) break; /* frontier exhausted */
    }
    return n;
}

template <int M, bool ANC>
__global__ void __launch_bounds__(32) tree_build_v2_kernel(const Args a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int s = blockIdx.x, lane = threadIdx.x;
    const int max_nodes = a.max_nodes, K = a.top_k, LD = a.max_depth;
    const int ks = min(K, max_nodes); /* staged ranks (row stride): rank B can never be popped */

    SmemV2 sm;
    sm.row = (uint64_t *)smem_raw;
    sm.logp = (float *)(smem_raw + (ANC ? (size_t)max_nodes * 8 : 0));
    sm.ids = (int32_t *)(sm.logp + (size_t)LD * ks);
    sm.node_tie = (uint32_t *)(sm.ids + (a.stage_ids ? (size_t)LD * ks : 0));
    sm.node_score = (float *)(sm.node_tie + max_nodes);
    sm.first_child = (int32_t *)(sm.node_score + max_nodes);
    sm.next_sib = sm.first_child + max_nodes;

    pdl_wait(); /* inputs may come from the previous kernel in the stream */
    pdl_launch_dependents();

    /* 1. One global round trip: the per-stream values and every row x rank that any budget and
     *    depth limit could use (always in bounds), so nothing waits for budget / depth_limit.
     *    Items (chunk c of 32 ranks, row d) in batches of 16 loads per lane. */
    const int budget_in = __ldg(a.budget + s), limit_in = __ldg(a.depth_limit + s);
    const int32_t prefix = __ldg(a.prefix_len + s), root_tok = __ldg(a.root_token + s);
    const int64_t in_base = (int64_t)s * LD * K;
    const int n_items = ((ks + 31) >> 5) * LD;
    for (int q0 = 0; q0 < n_items; q0 += 16) {
        float v[16];
        int32_t id[16];
        int off[16];
        int d = q0 % LD, c = q0 / LD; /* once per batch */
#pragma unroll
        for (int k = 0; k < 16; k++) {
            const int r = c * 32 + lane;
            const bool ok = q0 + k < n_items && r < ks;
            const int64_t at = in_base + (ok ? (int64_t)d * K + r : 0); /* always in bounds */
            off[k] = ok ? d * ks + r : -1;
            v[k] = __ldg(a.top_logp + at);
            id[k] = __ldg(a.top_ids + at);
            if (++d == LD) {
                d = 0;
                c++;
            }
        }
#pragma unroll
        for (int k = 0; k < 16; k++) {
            if (off[k] >= 0) {
                sm.logp[off[k]] = v[k];
                if (a.stage_ids) sm.ids[off[k]] = id[k];
            }
        }
    }
    const int budget = min(max(budget_in, 0), max_nodes - 1);
    const int depth_limit = min(max(limit_in, 1), LD);
    const int kc = min(K, budget + 1); /* ranks that can ever be scored */
    for (int i = lane; i < max_nodes; i += 32) {
        sm.first_child[i] = -1;
        sm.next_sib[i] = -1;
    }
    if (lane == 0) {
        sm.node_score[0] = 0.0f;
        if (ANC) sm.row[0] = 1;
    }
    __syncwarp();

    /* 2. pops (or the chain) */
    int n = 1;
    if (a.chain) {
        const int last = min(budget, depth_limit);
        if (lane == 0) {
            float sc = 0.0f;
            for (int d = 1; d <= last; d++) { /* sequential adds, as on the CPU */
                sc = add_score(sc, sm.logp[(d - 1) * ks]);
                sm.node_tie[d] = kdt_tb_tie_bits(d, d - 1, 0);
                sm.node_score[d] = sc;
                sm.first_child[d - 1] = d;
                if (ANC) sm.row[d] = (2ull << d) - 1; /* nodes 0..d */
            }
        }
        n = last + 1;
    } else if (budget > 0) {
        n = run_heap_v2<M, ANC>(sm, ks, kc, depth_limit, budget, lane);
    }
    __syncwarp();

    /* 3. write the nodes and padding */
    const int64_t base = (int64_t)s * max_nodes;
    const int W = a.n_words;
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
            tok = root_tok;
            par = -1;
            dep = 0;
            sc = 0.0f;
        } else {
            const uint32_t tie = sm.node_tie[i];
            dep = kdt_tb_depth(tie);
            par = kdt_tb_parent(tie);
            const int r = kdt_tb_rank(tie);
            tok = a.stage_ids ? sm.ids[(dep - 1) * ks + r]
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
        if (ANC) {
            row[0] = sm.row[i]; /* W == 1 */
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
        for (; cw >= 0; cw--) {
            row[cw] = acc;
            acc = 0;
        }
    }
    if (lane == 0) a.n_nodes[s] = n;
}

typedef void (*kernel_fn)(const Args);

kernel_fn pick_kernel(int max_nodes) {
    const int slots = max_nodes - 1 > 1 ? max_nodes - 1 : 1; /* frontier never exceeds B */
    if (slots <= 32) return tree_build_kernel<1>;
    if (slots <= 64) return tree_build_kernel<2>;
    if (slots <= 128) return tree_build_kernel<4>;
    if (slots <= 256) return tree_build_kernel<8>;
    if (slots <= 512) return tree_build_kernel<16>;
    return tree_build_kernel<32>;
}

/* v2 for B <= 128, else NULL (v1). */
kernel_fn pick_kernel_v2(int max_nodes) {
    const int slots = max_nodes - 1 > 1 ? max_nodes - 1 : 1;
    if (slots <= 32) return tree_build_v2_kernel<1, true>;
    if (slots <= 64) return max_nodes <= 64 ? tree_build_v2_kernel<2, true> : tree_build_v2_kernel<2, false>;
    if (slots <= 128) return tree_build_v2_kernel<4, false>;
    return NULL;
}

/* An environment switch: unset or empty -> dflt, "0" -> false, anything else -> true. */
bool env_flag(const char *name, bool dflt) {
    const char *v = getenv(name);
    if (v == NULL || v[0] == '\0') return dflt;
    return strcmp(v, "0") != 0;
}

/* PDL needs an sm_90+ device running code compiled for sm_90+ (which contains the wait). */
bool pdl_usable() {
    if (!env_flag("KDT_TREE_PDL", true)) return false;
    int dev = 0, major = 0;
    cudaFuncAttributes fa;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, tree_build_v2_kernel<1, true>) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return major >= 9 && fa.ptxVersion >= 90;
}

} // namespace

extern "C" kdt_status kdt_tree_build_cuda(const kdt_tree_build_params *p, kdt_tree *out,
                                          void *stream) {
    static const char *who = "kdt_tree_build_cuda";
    kdt_status st = kdt_tree_build_check_args(p, out, 0, who);
    if (st != KDT_OK) return st;
    /* Read once (thread-safe statics): KDT_TREE_BUILD_V1=1 selects v1 everywhere, without PDL. */
    static const bool use_v1 = env_flag("KDT_TREE_BUILD_V1", false);
    static const bool use_pdl = !use_v1 && pdl_usable();
    kernel_fn kernel = use_v1 ? NULL : pick_kernel_v2(out->max_nodes);
    const bool v2 = kernel != NULL;
    if (!v2) kernel = pick_kernel(out->max_nodes);
    size_t (*bytes)(int, int, int, int) = v2 ? smem_bytes_v2 : smem_bytes;
    const int stage_ids = bytes(p->max_depth, p->top_k, out->max_nodes, 1) <= 48 * 1024;
    const size_t smem = bytes(p->max_depth, p->top_k, out->max_nodes, stage_ids);
    cudaError_t e = cudaSuccess;
    if (smem > 48 * 1024) {
        int dev = 0, max_optin = 0;
        e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
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
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)p->n_streams);
    cfg.blockDim = dim3(32);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = (cudaStream_t)stream;
    cudaLaunchAttribute attr[1] = {};
    if (use_pdl) {
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    e = cudaLaunchKernelEx(&cfg, kernel, a);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", who, cudaGetErrorString(e));
    return KDT_OK;
}
