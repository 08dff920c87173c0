/* tree_accept.cu - CUDA tree_accept: validation + greedy walk, one warp per stream, all on the
 * GPU (no host walk). The flags are defined in cpu/tree_accept.c; these kernels evaluate the same
 * per-node predicates in parallel, so outputs match the CPU twin bit for bit. Two kernels; v2 is
 * the default for max_nodes <= 65, v1 (the previous kernel) runs with KDT_TREE_ACCEPT_V1=1 and
 * for larger trees.
 *
 * At these sizes the time is latency: dependent global round trips, shared-memory atomics and
 * barriers, the launch itself, and, with one warp per stream, the length of the warp's
 * instruction stream. v2 (one warp per stream and per CTA, no shared memory, no atomics, no
 * barrier) keeps the nodes in C slot registers per lane, slot x in register x/32 of lane x%32:
 * up to 32 nodes node x is slot x; past 32 the root is kept apart, in every lane's registers
 * (broadcast loads), and node x >= 1 is slot x - 1, so a B = 32 tree (33 nodes) needs one slot
 * register per lane instead of two (every predicate, gather and walk round done once, not twice;
 * no duplicate-key loop) and a B = 64 tree fits two (it ran the v1 kernel before):
 *   1. one global round trip: n_nodes and all six arrays of every slot < 32*C are loaded
 *      together (slots past max_nodes clamped to node 0, so nothing waits for n_nodes);
 *   2. the gathers at the parent / link targets (depth, target, parent) are warp shuffles;
 *      counted in-links are OR-reduced into a bitmask (no per-node counts are needed: see the
 *      in-link comment in the kernel); duplicate (parent, token) keys are found by
 *      __match_any_sync (slots 0..31) plus a broadcast loop over slots 32..n-1;
 *   3. the walk is pointer doubling on "ancestor still to check" (log2(max_depth) rounds of one
 *      shuffle), which runs alongside the validation instead of after it; an accepted node
 *      writes its own row element (accepted[depth], emit[depth] = its target), so the emit
 *      values need no gather after the walk.
 * v1 had two dependent global round trips (the second for every gather), 64-bit atomicCAS
 * hashing and atomicOr in-link counting in shared memory (32 lanes contending on one word for
 * B <= 32), a sequential shared-memory walk and a third round trip for emit[].
 *   v1 per stream (one warp, up to 4 streams per CTA): lanes load their nodes (the first
 *   PREFETCH_CHUNKS chunks before n_nodes arrives), check them with gathers from global memory
 *   and three per-warp shared tables (seen[] in-link bitmap, dup[] (parent, token) set,
 *   child[] = the child of p whose token equals target[p]), OR-reduce the flags, follow child[]
 *   from the root, and write the rows.
 * Launch: with programmatic dependent launch (PDL, sm_90+, unless KDT_TREE_PDL=0) the kernel
 * may start while the previous kernel in the stream finishes; it waits (griddepcontrol.wait)
 * before its first global access, so only the launch latency overlaps. PDL is only used when
 * the loaded kernel was compiled for sm_90+ (cudaFuncGetAttributes().ptxVersion).
 * Every index is range-checked (or clamped) before it is dereferenced; loops are bounded.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kdtree/kernels.h"
#include "pdl.cuh"

extern "C" kdt_status kdt_tree_accept_check_args(const kdt_tree_accept_params *p, const char *who);

namespace {

constexpr int WARPS_PER_CTA_MAX = 4;
constexpr int PREFETCH_CHUNKS = 5;       /* nodes 0..159 (B <= 159) load before n_nodes arrives */
constexpr int SMEM_BUDGET = 48 * 1024;   /* default dynamic shared memory limit per CTA */
constexpr uint64_t EMPTY_KEY = ~0ull;    /* keys have a parent >= 0, so bit 63 is clear */

constexpr unsigned FULL = 0xffffffffu;


/* Per-warp shared layout, sized by max_nodes on the host. */
struct WarpSmemLayout {
    int hash_cap;     /* power of two >= 2 * max_nodes (min 32) */
    int child_off;    /* bytes: int32 child[max_nodes] after the hash table */
    int seen_off;     /* bytes: uint32 seen[ceil(max_nodes/32)] */
    int bytes;        /* per warp, multiple of 8 */
};

__host__ __device__ inline int pow2_at_least(int x) {
    int v = 1;
    while (v < x) v <<= 1;
    return v;
}

inline WarpSmemLayout warp_smem_layout(int max_nodes) {
    WarpSmemLayout w;
    w.hash_cap = pow2_at_least(2 * max_nodes);
    if (w.hash_cap < 32) w.hash_cap = 32;
    w.child_off = w.hash_cap * 8;
    w.seen_off = w.child_off + ((max_nodes * 4 + 7) & ~7);
    w.bytes = w.seen_off + ((((max_nodes + 31) / 32) * 4 + 7) & ~7);
    return w;
}

__device__ __forceinline__ uint32_t hash_key(uint64_t key) {
    uint32_t h = (uint32_t)key * 0x9E3779B1u ^ (uint32_t)(key >> 32) * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    return h;
}

struct TreeArgs {
    const int32_t *__restrict__ n_nodes;
    const int32_t *__restrict__ token;
    const int32_t *__restrict__ parent;
    const int32_t *__restrict__ depth;
    const int32_t *__restrict__ first_child;
    const int32_t *__restrict__ next_sibling;
    const int32_t *__restrict__ target;
    int32_t *__restrict__ accepted;
    int32_t *__restrict__ emit;
    int32_t *__restrict__ tau;
    int32_t *__restrict__ bonus;
    int32_t *__restrict__ error;
    int n_streams, max_nodes, max_depth, warps_per_cta;
    WarpSmemLayout smem;
};

struct NodeIn {
    int par, dep, tok, fc, ns;
};

__device__ __forceinline__ NodeIn load_node(const TreeArgs &a, int64_t base, int i) {
    NodeIn v;
    v.par = __ldg(a.parent + base + i);
    v.dep = __ldg(a.depth + base + i);
    v.tok = __ldg(a.token + base + i);
    v.fc = __ldg(a.first_child + base + i);
    v.ns = __ldg(a.next_sibling + base + i);
    return v;
}

/* Counts one in-link of node x; a second one is BAD_LINK. */
__device__ __forceinline__ int mark_in_link(uint32_t *seen, int x) {
    const uint32_t bit = 1u << (x & 31);
    return (atomicOr(seen + (x >> 5), bit) & bit) ? KDT_TREE_BAD_LINK : 0;
}

/* Flags of node i of a stream with n nodes (the per-node predicates of cpu/tree_accept.c). */
__device__ __forceinline__ int check_node(const TreeArgs &a, int64_t base, int n, int i,
                                          const NodeIn v, unsigned long long *dup_set,
                                          int hash_mask, int *child, uint32_t *seen) {
    int f = 0;
    const bool parent_ok = i > 0 && v.par >= 0 && v.par < i;
    const bool fc_fwd = v.fc > i && v.fc < n, ns_fwd = v.ns > i && v.ns < n;
    /* Gathers with clamped (always in-bounds) indices, issued together. */
    const int par_c = parent_ok ? v.par : 0;
    const int dep_par = __ldg(a.depth + base + par_c);
    const int tgt_par = __ldg(a.target + base + par_c);
    const int par_of_fc = __ldg(a.parent + base + (fc_fwd ? v.fc : 0));
    const int par_of_ns = __ldg(a.parent + base + (ns_fwd ? v.ns : 0));

    if (i == 0) {
        if (v.par != -1) f |= KDT_TREE_BAD_PARENT;
        if (v.dep != 0) f |= KDT_TREE_BAD_DEPTH;
    } else {
        if (!parent_ok) f |= KDT_TREE_BAD_PARENT;
        if (v.dep < 1 || v.dep > a.max_depth) f |= KDT_TREE_BAD_DEPTH;
        else if (parent_ok && dep_par != v.dep - 1) f |= KDT_TREE_BAD_DEPTH;
        if (parent_ok) {
            const unsigned long long key =
                ((unsigned long long)(uint32_t)v.par << 32) | (uint32_t)v.tok;
            int h = (int)(hash_key(key) & (uint32_t)hash_mask);
            for (int probe = 0; probe <= hash_mask; probe++) { /* table is never full */
                const unsigned long long old = atomicCAS(dup_set + h, EMPTY_KEY, key);
                if (old == EMPTY_KEY) break;
                if (old == key) {
                    f |= KDT_TREE_DUP_TOKEN;
                    break;
                }
                h = (h + 1) & hash_mask;
            }
            /* Two matching children carry the same token (DUP_TOKEN, no walk); the atomic only
             * keeps such a tree free of a shared-memory race. */
            if (v.tok == tgt_par) atomicExch(child + v.par, i);
        }
    }
    if (v.fc != -1) {
        if (v.fc < -1 || v.fc >= n) f |= KDT_TREE_BAD_LINK;
        else if (v.fc <= i) f |= KDT_TREE_CYCLE;
        else if (par_of_fc != i) f |= KDT_TREE_BAD_LINK;
        else f |= mark_in_link(seen, v.fc);
    }
    if (v.ns != -1) {
        if (v.ns < -1 || v.ns >= n) f |= KDT_TREE_BAD_LINK;
        else if (v.ns <= i) f |= KDT_TREE_CYCLE;
        else if (i == 0 || par_of_ns != v.par) f |= KDT_TREE_BAD_LINK;
        else f |= mark_in_link(seen, v.ns);
    }
    return f;
}

__global__ void __launch_bounds__(32 * WARPS_PER_CTA_MAX)
tree_accept_kernel(const TreeArgs a) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int s = blockIdx.x * a.warps_per_cta + warp;
    pdl::wait(); /* no-op unless launched as a PDL secondary (the v2 path's large-tree fallback) */
    pdl::launch_dependents();
    if (s >= a.n_streams) return; /* whole warp leaves together */
    unsigned char *ws = smem_raw + (size_t)warp * a.smem.bytes;
    unsigned long long *dup_set = reinterpret_cast<unsigned long long *>(ws);
    int *child = reinterpret_cast<int *>(ws + a.smem.child_off);
    uint32_t *seen = reinterpret_cast<uint32_t *>(ws + a.smem.seen_off);
    const int maxn = a.max_nodes;
    const int64_t base = (int64_t)s * maxn;

    NodeIn pre[PREFETCH_CHUNKS] = {};
#pragma unroll
    for (int c = 0; c < PREFETCH_CHUNKS; c++) {
        const int i = c * 32 + lane;
        if (i < maxn) pre[c] = load_node(a, base, i);
    }
    const int n = __ldg(a.n_nodes + s);

    int flags = 0;
    if (n < 1 || n > maxn) {
        flags = KDT_TREE_BAD_SIZE; /* uniform over the warp; nothing else is read */
    } else {
        int hash_n = pow2_at_least(2 * n);
        if (hash_n < 32) hash_n = 32;
        for (int k = lane; k < hash_n; k += 32) dup_set[k] = EMPTY_KEY;
        for (int k = lane; k < n; k += 32) child[k] = -1;
        for (int k = lane; k < (n + 31) / 32; k += 32) seen[k] = 0u;
        __syncwarp();
#pragma unroll
        for (int c = 0; c < PREFETCH_CHUNKS; c++) {
            const int i = c * 32 + lane;
            if (i < n) flags |= check_node(a, base, n, i, pre[c], dup_set, hash_n - 1, child, seen);
        }
        for (int i = PREFETCH_CHUNKS * 32 + lane; i < n; i += 32)
            flags |= check_node(a, base, n, i, load_node(a, base, i), dup_set, hash_n - 1, child,
                                seen);
        __syncwarp();
        for (int i = lane; i < n; i += 32)
            if (i > 0 && !((seen[i >> 5] >> (i & 31)) & 1u)) flags |= KDT_TREE_BAD_LINK;
    }
    flags = (int)__reduce_or_sync(0xffffffffu, (unsigned)flags);

    /* Greedy walk (warp-uniform): lane k keeps the k-th accepted node. */
    int tau = 0, acc = -1;
    if (flags == 0) {
        int cur = 0;
        tau = 1;
        acc = lane == 0 ? 0 : -1;
        while (tau < KDT_MAX_PATH) {
            const int next = child[cur];
            if (next < 0) break;
            if (lane == tau) acc = next;
            cur = next;
            tau++;
        }
    }
    if (lane < KDT_MAX_PATH) {
        /* emit[k] = target[accepted[k]]: the next accepted token, or the bonus at k = tau-1. */
        const int e = lane < tau ? __ldg(a.target + base + acc) : -1;
        const int64_t o = (int64_t)s * KDT_MAX_PATH + lane;
        a.accepted[o] = acc;
        a.emit[o] = e;
        if (lane == tau - 1) a.bonus[s] = e;
    }
    if (lane == 0) {
        a.tau[s] = tau;
        a.error[s] = flags;
        if (tau == 0) a.bonus[s] = -1;
    }
}

/* ---------------------------------------------------------------------------------------------
 * v2 (default, max_nodes <= 65): registers and warp intrinsics only (see the top of this file).
 * ------------------------------------------------------------------------------------------- */

/* v[x] where slot x lives in register x / 32 of lane x % 32; x in [0, 32 * C). All lanes. */
template <int C>
__device__ __forceinline__ int gather(const int (&v)[C], int x) {
    int r = __shfl_sync(FULL, v[0], x & 31);
#pragma unroll
    for (int c = 1; c < C; c++) {
        const int t = __shfl_sync(FULL, v[c], x & 31);
        r = (x >> 5) == c ? t : r;
    }
    return r;
}

/* One warp per stream and per CTA; C <= 2 slot registers per lane. R = 0: node x in slot x.
 * R = 1 ("root apart"): node x >= 1 in slot x - 1 and the root's fields in every lane's
 * registers (broadcast loads), so 1 + 32 C nodes fit: B = 32 (33 nodes) runs with one register
 * per lane instead of two, B = 64 (65 nodes) with two instead of the v1 kernel. */
template <int C, int R>
__global__ void __launch_bounds__(32) tree_accept_v2_kernel(const TreeArgs a) {
    static_assert(C == 1 || C == 2, "the duplicate test below covers at most 64 slots");
    static_assert(R == 0 || R == 1, "R: the root in slot 0 (0) or apart (1)");
    const int s = blockIdx.x, lane = threadIdx.x;
    const int maxn = a.max_nodes;
    const int64_t base = (int64_t)s * maxn;

    pdl::wait(); /* the tree and targets may come from the previous kernel in the stream */
    pdl::launch_dependents();

    /* 1. One global round trip: n_nodes and all six arrays of every slot (clamped to node 0
     *    past max_nodes, so always in bounds), and with R the root's fields; nothing waits for
     *    n_nodes. */
    int par[C], dep[C], tok[C], fc[C], ns[C], tgt[C];
    const int n_in = __ldg(a.n_nodes + s);
#pragma unroll
    for (int c = 0; c < C; c++) {
        const int i = c * 32 + lane + R;
        const int64_t at = base + (i < maxn ? i : 0);
        par[c] = __ldg(a.parent + at);
        dep[c] = __ldg(a.depth + at);
        tok[c] = __ldg(a.token + at);
        fc[c] = __ldg(a.first_child + at);
        ns[c] = __ldg(a.next_sibling + at);
        tgt[c] = __ldg(a.target + at);
    }
    int par0 = 0, dep0 = 0, fc0 = -1, ns0 = -1, tgt0 = 0; /* the root's, with R */
    if (R) {
        par0 = __ldg(a.parent + base);
        dep0 = __ldg(a.depth + base);
        fc0 = __ldg(a.first_child + base);
        ns0 = __ldg(a.next_sibling + base);
        tgt0 = __ldg(a.target + base);
    }
    const bool size_ok = n_in >= 1 && n_in <= maxn; /* else BAD_SIZE and nothing else */
    const int n = size_ok ? n_in : 0;

    /* 2. Per-node predicates of cpu/tree_accept.c, with shuffle gathers at the parent and link
     *    targets (indices clamped in range). Counted links set bits in `linked` (by slot);
     *    (parent, token) keys for the duplicate test; walk[] starts the pointer doubling. */
    int f = 0;
    uint32_t linked[C];
    uint64_t key[C];
    int walk[C];
#pragma unroll
    for (int c = 0; c < C; c++) linked[c] = 0u;
#pragma unroll
    for (int c = 0; c < C; c++) {
        const int i = c * 32 + lane + R; /* this slot's node */
        const bool node = i < n;
        const bool parent_ok = i > 0 && par[c] >= 0 && par[c] < i;
        const bool fc_fwd = fc[c] > i && fc[c] < n, ns_fwd = ns[c] > i && ns[c] < n;
        const int pc = parent_ok ? par[c] : 0;
        /* the parent's depth and target: slot pc - R, or the root's registers (R, pc == 0) */
        const int ps = pc - R > 0 ? pc - R : 0;
        int dep_par = gather<C>(dep, ps), tgt_par = gather<C>(tgt, ps);
        if (R && pc == 0) dep_par = dep0, tgt_par = tgt0;
        /* forward link targets are nodes > i >= R: slots >= 0 */
        const int par_of_fc = gather<C>(par, fc_fwd ? fc[c] - R : 0);
        const int par_of_ns = gather<C>(par, ns_fwd ? ns[c] - R : 0);
        /* The CPU's if / else-if chains as predicates (branch-free; same bits). */
        const bool root = i == 0; /* only with R = 0 */
        const bool bad_parent = root ? par[c] != -1 : !parent_ok;
        const bool bad_depth = root ? dep[c] != 0
                                    : dep[c] < 1 || dep[c] > a.max_depth ||
                                          (parent_ok && dep_par != dep[c] - 1);
        /* a link x != -1: out of range -> BAD_LINK; 0 <= x <= i -> CYCLE; forward -> checked */
        const bool fc_out = fc[c] < -1 || fc[c] >= n, ns_out = ns[c] < -1 || ns[c] >= n;
        const bool fc_cycle = fc[c] >= 0 && fc[c] <= i, ns_cycle = ns[c] >= 0 && ns[c] <= i;
        const bool fc_ok = fc_fwd && par_of_fc == i;
        const bool ns_ok = ns_fwd && !root && par_of_ns == par[c];
        int g = (bad_parent ? KDT_TREE_BAD_PARENT : 0) | (bad_depth ? KDT_TREE_BAD_DEPTH : 0);
        if (fc_out || (fc_fwd && !fc_ok) || ns_out || (ns_fwd && !ns_ok)) g |= KDT_TREE_BAD_LINK;
        if (fc_cycle || ns_cycle) g |= KDT_TREE_CYCLE;
        const bool fc_counted = node && fc_ok, ns_counted = node && ns_ok; /* in-links */
        const int fs = fc[c] - R, nss = ns[c] - R;                     /* their slots */
#pragma unroll
        for (int w = 0; w < C; w++) { /* (no dynamic register index) */
            if (fc_counted && (fs >> 5) == w) linked[w] |= 1u << (fs & 31);
            if (ns_counted && (nss >> 5) == w) linked[w] |= 1u << (nss & 31);
        }
        if (node) f |= g;
        /* (parent, token) of a node with a valid parent; else a key no other slot has */
        key[c] = node && parent_ok ? ((uint64_t)(uint32_t)par[c] << 32) | (uint32_t)tok[c]
                                   : (uint64_t)(0x80000000u | (uint32_t)i) << 32;
        /* walk: -1 = off the path; else the next ancestor still to check (the root is 0) */
        walk[c] = i == 0 ? 0 : (node && parent_ok && tok[c] == tgt_par ? par[c] : -1);
    }
    if (R) { /* the root's own tests (the same in every lane); n = 0 is BAD_SIZE below */
        const bool fc0_fwd = fc0 > 0 && fc0 < n, ns0_fwd = ns0 > 0 && ns0 < n;
        const bool fc0_ok = fc0_fwd && gather<C>(par, fc0_fwd ? fc0 - 1 : 0) == 0;
        int g = (par0 != -1 ? KDT_TREE_BAD_PARENT : 0) | (dep0 != 0 ? KDT_TREE_BAD_DEPTH : 0);
        /* a root's next_sibling can only be -1: a forward one fails "i >= 1" (BAD_LINK) */
        if (fc0 < -1 || fc0 >= n || (fc0_fwd && !fc0_ok) || ns0 < -1 || ns0 >= n || ns0_fwd)
            g |= KDT_TREE_BAD_LINK;
        if (fc0 == 0 || ns0 == 0) g |= KDT_TREE_CYCLE;
        f |= g;
#pragma unroll
        for (int w = 0; w < C; w++)
            if (fc0_ok && ((fc0 - 1) >> 5) == w) linked[w] |= 1u << ((fc0 - 1) & 31);
    }

    /* DUP_TOKEN: equal keys among slots 0..31 by one match; each slot 32.. against all. */
    bool dup = __popc(__match_any_sync(FULL, (unsigned long long)key[0])) > 1;
    if (C > 1) {
        for (int k = 32; k < n - R; k++) { /* slots of nodes < n; warp-uniform */
            const uint64_t kk = __shfl_sync(FULL, (unsigned long long)key[C - 1], k & 31);
            dup |= key[0] == kk;
#pragma unroll
            for (int c = 1; c < C; c++) dup |= c * 32 + lane != k && key[c] == kk;
        }
    }
    if (dup) f |= KDT_TREE_DUP_TOKEN;

    /* In-links. Every counted link into a sibling group (the nodes sharing a parent value)
     * comes from the parent's first_child or a member's next_sibling to a higher member, and
     * the highest member has none: at most |group| links for |group| nodes. So some node with
     * two in-links implies one with none, and "exactly one each" (the CPU's test) is the same
     * as "none without": only the set of linked nodes is needed. */
    int flags = (int)__reduce_or_sync(FULL, (unsigned)f);
#pragma unroll
    for (int c = 0; c < C; c++) {
        const uint32_t got = __reduce_or_sync(FULL, linked[c]);
        /* need the slots of nodes 1..n-1 */
        const int lo = c == 0 ? 1 - R : c * 32, hi = min(n - R, c * 32 + 32);
        const uint32_t need = hi > lo ? (0xffffffffu >> (32 - (hi - lo))) << (lo - c * 32) : 0u;
        if ((got & need) != need) flags |= KDT_TREE_BAD_LINK;
    }
    if (!size_ok) flags = KDT_TREE_BAD_SIZE;

    /* 3. The greedy walk by pointer doubling: a node is accepted iff it and every ancestor
     *    below the root matched (token == target of its parent). After k rounds walk[] is the
     *    ancestor 2^k levels up, or -1 (0, the root, stays 0); a clean tree has depth <=
     *    max_depth <= 2^rounds. */
    for (int span = 1; span < a.max_depth; span *= 2) { /* warp-uniform */
        int next[C];
#pragma unroll
        for (int c = 0; c < C; c++) {
            const int g = gather<C>(walk, walk[c] > 0 ? walk[c] - R : 0);
            next[c] = walk[c] > 0 ? g : walk[c];
        }
#pragma unroll
        for (int c = 0; c < C; c++) walk[c] = next[c];
    }
    bool on_path[C];
    int tau = 1;
#pragma unroll
    for (int c = 0; c < C; c++) {
        on_path[c] = c * 32 + lane + R > 0 && walk[c] == 0; /* walk >= 0 only for nodes */
        tau += __popc(__ballot_sync(FULL, on_path[c]));
    }

    /* 4. rows: accepted[depth] = node, emit[depth] = its target (the next accepted token, or
     *    the bonus for the deepest); -1 past tau; a flagged stream gets tau 0 and bonus -1. */
    const int64_t o = (int64_t)s * KDT_MAX_PATH;
    if (flags == 0) {
#pragma unroll
        for (int c = 0; c < C; c++) {
            if (on_path[c]) { /* a clean tree: 1 <= depth <= max_depth, one node per depth */
                a.accepted[o + dep[c]] = c * 32 + lane + R;
                a.emit[o + dep[c]] = tgt[c];
                if (dep[c] == tau - 1) a.bonus[s] = tgt[c];
            }
        }
        if (lane == 0) {
            const int root_tgt = R ? tgt0 : tgt[0]; /* lane 0's slot 0 is the root when R = 0 */
            a.accepted[o] = 0;
            a.emit[o] = root_tgt;
            if (tau == 1) a.bonus[s] = root_tgt;
            a.tau[s] = tau;
            a.error[s] = 0;
        }
        if (lane >= tau && lane < KDT_MAX_PATH) {
            a.accepted[o + lane] = -1;
            a.emit[o + lane] = -1;
        }
    } else {
        if (lane < KDT_MAX_PATH) {
            a.accepted[o + lane] = -1;
            a.emit[o + lane] = -1;
        }
        if (lane == 0) {
            a.tau[s] = 0;
            a.bonus[s] = -1;
            a.error[s] = flags;
        }
    }
}

/* An environment switch: unset or empty -> dflt, "0" -> false, anything else -> true. */
bool env_flag(const char *name, bool dflt) {
    const char *v = getenv(name);
    if (v == NULL || v[0] == '\0') return dflt;
    return strcmp(v, "0") != 0;
}


} // namespace

extern "C" kdt_status kdt_tree_accept_cuda(const kdt_tree_accept_params *p, void *stream) {
    kdt_status st = kdt_tree_accept_check_args(p, "kdt_tree_accept_cuda");
    if (st != KDT_OK) return st;
    /* Read once (thread-safe statics): KDT_TREE_ACCEPT_V1=1 selects v1 everywhere, without PDL. */
    static const bool use_v1 = env_flag("KDT_TREE_ACCEPT_V1", false);
    static const bool use_pdl = !use_v1 && pdl::usable(tree_accept_v2_kernel<1, 0>);
    const kdt_tree *t = p->tree;
    TreeArgs a;
    a.n_nodes = t->n_nodes;
    a.token = t->token;
    a.parent = t->parent;
    a.depth = t->depth;
    a.first_child = t->first_child;
    a.next_sibling = t->next_sibling;
    a.target = p->target_token;
    a.accepted = p->accepted;
    a.emit = p->emit;
    a.tau = p->tau;
    a.bonus = p->bonus;
    a.error = p->error;
    a.n_streams = t->n_streams;
    a.max_nodes = t->max_nodes;
    a.max_depth = p->max_depth;
    a.smem = warp_smem_layout(t->max_nodes);
    void (*kernel)(const TreeArgs);
    cudaLaunchConfig_t cfg = {};
    cfg.stream = (cudaStream_t)stream;
    if (!use_v1 && t->max_nodes <= 65) {
        /* one slot register per lane up to 33 nodes (the root apart past 32), two up to 65 */
        kernel = t->max_nodes <= 32   ? tree_accept_v2_kernel<1, 0>
                 : t->max_nodes <= 33 ? tree_accept_v2_kernel<1, 1>
                                      : tree_accept_v2_kernel<2, 1>;
        a.warps_per_cta = 1;
        cfg.gridDim = dim3((unsigned)t->n_streams);
        cfg.blockDim = dim3(32);
        cfg.dynamicSmemBytes = 0;
    } else {
        int warps = WARPS_PER_CTA_MAX;
        while (warps > 1 && warps * a.smem.bytes > SMEM_BUDGET) warps >>= 1;
        if (warps * a.smem.bytes > SMEM_BUDGET)
            return kdt_fail(KDT_ERR_INTERNAL, "kdt_tree_accept_cuda: %d B of shared memory per warp",
                            a.smem.bytes);
        if (warps > t->n_streams) warps = t->n_streams;
        a.warps_per_cta = warps;
        kernel = tree_accept_kernel;
        cfg.gridDim = dim3((unsigned)((t->n_streams + warps - 1) / warps));
        cfg.blockDim = dim3((unsigned)(32 * warps));
        cfg.dynamicSmemBytes = (size_t)warps * a.smem.bytes;
    }
    cudaLaunchAttribute attr[1] = {};
    if (use_pdl) pdl::enable(&cfg, attr);
    cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, a);
    if (e == cudaSuccess) e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_tree_accept_cuda: launch failed: %s",
                        cudaGetErrorString(e));
    return KDT_OK;
}
