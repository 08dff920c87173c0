/* tree_build.cu - CUDA tree_build (kdt_tree_build_cuda): the DDTree best-first heap and the
 * DFlash chain for all streams in one launch. Same candidates, keys and score adds as the CPU
 * twin (cpu/tree_build.c, ../tree_build_internal.h), so the trees are identical bit for bit.
 *
 * One warp (one 32-thread CTA) per stream:
 *   1. Stage the stream's usable log-probs, top_logp[s][0..L)[0..min(K, B+1)), in shared memory
 *      (ranks above B can never be scored: a rank-r node needs r earlier siblings), and the
 *      matching top_ids too when everything fits in 48 KB (saves a global round trip later).
 *   2. Pops. The frontier lives in registers: slot j is register j/32 of lane j%32, M registers
 *      per lane (M = 1 for B <= 32). Each lane caches the best key of its slots. A pop is two
 *      warp reductions (__reduce_max_sync) over the packed key: the high words (score order
 *      keys), then the low words (depth/parent/rank tie bits) among lanes holding that high word.
 *      Every lane then knows the popped candidate and its score (the key is invertible) and
 *      computes the child's key identically; the lane that held it writes the node record and
 *      refills that slot with the next sibling, whose key was precomputed when the slot was
 *      filled (or with the child when there is no sibling); when there are both, the child goes
 *      to the next free slot. Slots carry their parent's score, so no lane reads a record
 *      written by another lane during the pops: no shared-memory frontier, no barrier per pop,
 *      and nothing for racecheck to flag.
 *   3. After the pops, lanes write the nodes in parallel: token gathered from top_ids, links,
 *      position, score, and the ancestor mask row by walking up the parents (depth <= 16).
 * Per-stream values live in device memory and cannot be checked by the launcher; the kernel
 * clamps them so that nothing out of bounds is ever touched and the tree is well formed:
 *   budget -> clamp(budget, 0, max_nodes - 1), depth_limit -> clamp(depth_limit, 1, max_depth),
 *   position = prefix_len + depth with 32-bit wrap-around (the CPU twin rejects such input;
 *   with clamped values in the CPU's input, both produce the same tree).
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

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
    kernel<<<(unsigned)p->n_streams, 32, smem, (cudaStream_t)stream>>>(a);
    e = cudaGetLastError();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", who, cudaGetErrorString(e));
    return KDT_OK;
}
