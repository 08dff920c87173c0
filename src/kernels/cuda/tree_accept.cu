/* tree_accept.cu - CUDA tree_accept: validation + greedy walk, one warp per stream, all on the
 * GPU (no host walk). The flags are defined in cpu/tree_accept.c; this kernel evaluates the same
 * per-node predicates in parallel, so outputs match the CPU twin bit for bit.
 *
 * Per stream (one warp, up to WARPS_PER_CTA_MAX streams per CTA) there is ONE global round trip:
 *   1. lanes load n_nodes and all six node arrays (parent, depth, token, first_child,
 *      next_sibling, target) for every slot < max_nodes (always in bounds, so nothing waits for
 *      n_nodes), clear the per-warp tables while the loads are in flight, and stage the values in
 *      shared memory;
 *   2. per-node checks read only shared memory (gathers at the parent or link target), with
 *      three small tables:
 *        seen[]   bitmap of counted in-links (atomicOr; a bit already set = second in-link),
 *        dup[]    open-addressing set of node indices keyed by (parent, token) (atomicCAS on the
 *                 index; an occupied slot with an equal key = DUP_TOKEN),
 *        child[]  child[p] = the child of p whose token equals target[p] (the walk's next hop);
 *   3. flags OR-reduced over the warp; a clean tree is walked by following child[] from the root
 *      (every hop goes one level deeper, so at most L + 1 <= KDT_MAX_PATH nodes);
 *   4. lanes 0..KDT_MAX_PATH-1 write one row element each (emit from the staged target).
 * Every index is range-checked before it is dereferenced; the loops are bounded by n_nodes.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.h"
#include "kdtree/kernels.h"

extern "C" kdt_status kdt_tree_accept_check_args(const kdt_tree_accept_params *p, const char *who);

namespace {

constexpr int WARPS_PER_CTA_MAX = 4;
constexpr int LOAD_CHUNKS = 4;           /* 32-node chunks whose loads are in flight together */
constexpr int SMEM_BUDGET = 48 * 1024;   /* default dynamic shared memory limit per CTA */
constexpr int EMPTY_SLOT = -1;

/* Per-warp shared layout, sized by max_nodes on the host (all int32). */
struct WarpSmemLayout {
    int hash_cap;     /* power of two >= 2 * max_nodes (min 32): dup[hash_cap] node indices */
    int nodes_off;    /* words: 6 staged arrays of max_nodes each (parent, depth, token, fc, ns,
                         target), then child[max_nodes], then seen[ceil(max_nodes/32)] */
    int words;        /* per warp, even (8-byte multiple) */
};

inline int pow2_at_least(int x) {
    int v = 1;
    while (v < x) v <<= 1;
    return v;
}

inline WarpSmemLayout warp_smem_layout(int max_nodes) {
    WarpSmemLayout w;
    w.hash_cap = pow2_at_least(2 * max_nodes);
    if (w.hash_cap < 32) w.hash_cap = 32;
    w.nodes_off = w.hash_cap;
    w.words = w.nodes_off + 7 * max_nodes + (max_nodes + 31) / 32;
    w.words += w.words & 1;
    return w;
}

__device__ __forceinline__ uint32_t hash_key(uint32_t par, uint32_t tok) {
    uint32_t h = tok * 0x9E3779B1u ^ par * 0x85EBCA77u;
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

/* One warp's staged copy of its tree and its tables (pointers into shared memory). */
struct WarpTables {
    int *dup;                                 /* [hash_cap] node index or EMPTY_SLOT */
    const int *par, *dep, *tok, *fc, *ns, *tgt; /* [max_nodes] staged node arrays */
    int *child;                               /* [max_nodes] */
    uint32_t *seen;                           /* [ceil(max_nodes/32)] */
};

/* Counts one in-link of node x; a second one is BAD_LINK. */
__device__ __forceinline__ int mark_in_link(uint32_t *seen, int x) {
    const uint32_t bit = 1u << (x & 31);
    return (atomicOr(seen + (x >> 5), bit) & bit) ? KDT_TREE_BAD_LINK : 0;
}

/* Flags of node i of a stream with n nodes (the per-node predicates of cpu/tree_accept.c). */
__device__ __forceinline__ int check_node(const WarpTables &t, int n, int i, int max_depth,
                                          int hash_mask) {
    const int par = t.par[i], dep = t.dep[i], tok = t.tok[i], fc = t.fc[i], ns = t.ns[i];
    int f = 0;
    const bool parent_ok = i > 0 && par >= 0 && par < i;
    const bool fc_fwd = fc > i && fc < n, ns_fwd = ns > i && ns < n;
    /* Gathers with clamped (always in-bounds) indices, issued together. */
    const int par_c = parent_ok ? par : 0;
    const int dep_par = t.dep[par_c];
    const int tgt_par = t.tgt[par_c];
    const int par_of_fc = t.par[fc_fwd ? fc : 0];
    const int par_of_ns = t.par[ns_fwd ? ns : 0];

    if (i == 0) {
        if (par != -1) f |= KDT_TREE_BAD_PARENT;
        if (dep != 0) f |= KDT_TREE_BAD_DEPTH;
    } else {
        if (!parent_ok) f |= KDT_TREE_BAD_PARENT;
        if (dep < 1 || dep > max_depth) f |= KDT_TREE_BAD_DEPTH;
        else if (parent_ok && dep_par != dep - 1) f |= KDT_TREE_BAD_DEPTH;
        if (parent_ok) {
            int h = (int)(hash_key((uint32_t)par, (uint32_t)tok) & (uint32_t)hash_mask);
            for (int probe = 0; probe <= hash_mask; probe++) { /* table is never full */
                const int old = atomicCAS(t.dup + h, EMPTY_SLOT, i);
                if (old == EMPTY_SLOT) break;
                /* old is a node < n with a valid parent, staged before the __syncwarp */
                if (t.par[old] == par && t.tok[old] == tok) {
                    f |= KDT_TREE_DUP_TOKEN;
                    break;
                }
                h = (h + 1) & hash_mask;
            }
            /* Two matching children carry the same token (DUP_TOKEN, no walk); the atomic only
             * keeps such a tree free of a shared-memory race. */
            if (tok == tgt_par) atomicExch(t.child + par, i);
        }
    }
    if (fc != -1) {
        if (fc < -1 || fc >= n) f |= KDT_TREE_BAD_LINK;
        else if (fc <= i) f |= KDT_TREE_CYCLE;
        else if (par_of_fc != i) f |= KDT_TREE_BAD_LINK;
        else f |= mark_in_link(t.seen, fc);
    }
    if (ns != -1) {
        if (ns < -1 || ns >= n) f |= KDT_TREE_BAD_LINK;
        else if (ns <= i) f |= KDT_TREE_CYCLE;
        else if (i == 0 || par_of_ns != par) f |= KDT_TREE_BAD_LINK;
        else f |= mark_in_link(t.seen, ns);
    }
    return f;
}

__global__ void __launch_bounds__(32 * WARPS_PER_CTA_MAX)
tree_accept_kernel(const TreeArgs a) {
    extern __shared__ __align__(16) int smem_words[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int s = blockIdx.x * a.warps_per_cta + warp;
    if (s >= a.n_streams) return; /* whole warp leaves together */
    const int maxn = a.max_nodes;
    const int64_t base = (int64_t)s * maxn;
    int *ws = smem_words + (size_t)warp * a.smem.words;
    int *staged = ws + a.smem.nodes_off; /* [6][maxn] */
    WarpTables t;
    t.dup = ws;
    t.par = staged;
    t.dep = staged + maxn;
    t.tok = staged + 2 * maxn;
    t.fc = staged + 3 * maxn;
    t.ns = staged + 4 * maxn;
    t.tgt = staged + 5 * maxn;
    t.child = staged + 6 * maxn;
    t.seen = reinterpret_cast<uint32_t *>(staged + 7 * maxn);

    /* 1. one round trip: n_nodes and every slot's six values in flight together */
    const int n = __ldg(a.n_nodes + s);
    const int32_t *const src[6] = {a.parent, a.depth, a.token, a.first_child, a.next_sibling,
                                   a.target};
    for (int c0 = 0; c0 * 32 < maxn; c0 += LOAD_CHUNKS) {
        int v[LOAD_CHUNKS][6];
#pragma unroll
        for (int c = 0; c < LOAD_CHUNKS; c++) {
            const int i = (c0 + c) * 32 + lane;
#pragma unroll
            for (int k = 0; k < 6; k++) v[c][k] = i < maxn ? __ldg(src[k] + base + i) : 0;
        }
        if (c0 == 0) { /* table clears overlap the first loads */
            for (int k = lane; k < a.smem.hash_cap; k += 32) t.dup[k] = EMPTY_SLOT;
            for (int k = lane; k < maxn; k += 32) t.child[k] = -1;
            for (int k = lane; k < (maxn + 31) / 32; k += 32) t.seen[k] = 0u;
        }
#pragma unroll
        for (int c = 0; c < LOAD_CHUNKS; c++) {
            const int i = (c0 + c) * 32 + lane;
            if (i < maxn) {
#pragma unroll
                for (int k = 0; k < 6; k++) staged[k * maxn + i] = v[c][k];
            }
        }
    }
    __syncwarp();

    /* 2. per-node checks from shared memory */
    int flags = 0;
    if (n < 1 || n > maxn) {
        flags = KDT_TREE_BAD_SIZE; /* uniform over the warp; nothing else is read */
    } else {
        for (int i = lane; i < n; i += 32)
            flags |= check_node(t, n, i, a.max_depth, a.smem.hash_cap - 1);
        __syncwarp();
        for (int i = lane; i < n; i += 32)
            if (i > 0 && !((t.seen[i >> 5] >> (i & 31)) & 1u)) flags |= KDT_TREE_BAD_LINK;
    }
    flags = (int)__reduce_or_sync(0xffffffffu, (unsigned)flags);

    /* 3. greedy walk (warp-uniform): lane k keeps the k-th accepted node. */
    int tau = 0, acc = -1;
    if (flags == 0) {
        int cur = 0;
        tau = 1;
        acc = lane == 0 ? 0 : -1;
        while (tau < KDT_MAX_PATH) {
            const int next = t.child[cur];
            if (next < 0) break;
            if (lane == tau) acc = next;
            cur = next;
            tau++;
        }
    }
    /* 4. rows; emit[k] = target[accepted[k]]: the next accepted token, or the bonus at tau-1 */
    if (lane < KDT_MAX_PATH) {
        const int e = lane < tau ? t.tgt[acc] : -1;
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

} // namespace

extern "C" kdt_status kdt_tree_accept_cuda(const kdt_tree_accept_params *p, void *stream) {
    kdt_status st = kdt_tree_accept_check_args(p, "kdt_tree_accept_cuda");
    if (st != KDT_OK) return st;
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
    int warps = WARPS_PER_CTA_MAX;
    const int warp_bytes = a.smem.words * 4;
    while (warps > 1 && warps * warp_bytes > SMEM_BUDGET) warps >>= 1;
    if (warps * warp_bytes > SMEM_BUDGET)
        return kdt_fail(KDT_ERR_INTERNAL, "kdt_tree_accept_cuda: %d B of shared memory per warp",
                        warp_bytes);
    if (warps > t->n_streams) warps = t->n_streams;
    a.warps_per_cta = warps;
    const int grid = (t->n_streams + warps - 1) / warps;
    tree_accept_kernel<<<grid, 32 * warps, (size_t)warps * warp_bytes, (cudaStream_t)stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_tree_accept_cuda: launch failed: %s",
                        cudaGetErrorString(e));
    return KDT_OK;
}
