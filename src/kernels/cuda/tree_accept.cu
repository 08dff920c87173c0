/* tree_accept.cu - CUDA tree_accept: validation + greedy walk, one warp per stream, all on the
 * GPU (no host walk). The flags are defined in cpu/tree_accept.c; this kernel evaluates the same
 * per-node predicates in parallel, so outputs match the CPU twin bit for bit.
 *
 * Per stream (one warp, WARPS_PER_CTA streams per CTA):
 *   1. lanes load their nodes (lane l owns nodes l, l+32, ...); the first PREFETCH_CHUNKS chunks
 *      are loaded before n_nodes arrives, so the two global round trips overlap;
 *   2. per-node checks (parent, depth, links), gathers of depth/parent/target at the parent or
 *      link target; three small per-warp shared tables:
 *        seen[]   bitmap of counted in-links (atomicOr; a bit already set = second in-link),
 *        dup[]    open-addressing set of (parent, token) keys (atomicCAS; equal key = DUP_TOKEN),
 *        child[]  child[p] = the child of p whose token equals target[p] (the walk's next hop);
 *   3. flags OR-reduced over the warp; a clean tree is walked by following child[] from the root
 *      (every hop goes one level deeper, so at most L + 1 <= KDT_MAX_PATH nodes);
 *   4. lanes 0..KDT_MAX_PATH-1 write one row element each.
 * Every index is range-checked before it is dereferenced; the loops are bounded by n_nodes.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.h"
#include "kdtree/kernels.h"

extern "C" kdt_status kdt_tree_accept_check_args(const kdt_tree_accept_params *p, const char *who);

namespace {

constexpr int WARPS_PER_CTA_MAX = 4;
constexpr int PREFETCH_CHUNKS = 5;       /* nodes 0..159 (B <= 159) load before n_nodes arrives */
constexpr int SMEM_BUDGET = 48 * 1024;   /* default dynamic shared memory limit per CTA */
constexpr uint64_t EMPTY_KEY = ~0ull;    /* keys have a parent >= 0, so bit 63 is clear */

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
    while (warps > 1 && warps * a.smem.bytes > SMEM_BUDGET) warps >>= 1;
    if (warps * a.smem.bytes > SMEM_BUDGET)
        return kdt_fail(KDT_ERR_INTERNAL, "kdt_tree_accept_cuda: %d B of shared memory per warp",
                        a.smem.bytes);
    if (warps > t->n_streams) warps = t->n_streams;
    a.warps_per_cta = warps;
    const int grid = (t->n_streams + warps - 1) / warps;
    tree_accept_kernel<<<grid, 32 * warps, (size_t)warps * a.smem.bytes, (cudaStream_t)stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_tree_accept_cuda: launch failed: %s",
                        cudaGetErrorString(e));
    return KDT_OK;
}
