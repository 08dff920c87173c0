/* kernels.h - the DDTree kernels: log-softmax + top-K, tree_build, tree_accept, KV commit and
 * tree-masked MLA verify attention.
 *
 * Every kernel has two entry points with the same parameter struct:
 *   kdt_<op>_cpu(...)          plain C reference, host pointers, deterministic;
 *   kdt_<op>_cuda(..., stream) CUDA launcher, device pointers, asynchronous on `stream`
 *                              (a cudaStream_t passed as void*, NULL = default stream).
 * Both validate their arguments first and return KDT_ERR_INVALID_ARG with a message naming the
 * field (see kdt_last_error()). In a build without CUDA the _cuda functions return
 * KDT_ERR_NO_CUDA. CUDA launchers never synchronize and never allocate; where scratch memory is
 * needed the caller passes a workspace sized by the matching *_workspace_bytes() function, so
 * every launcher can be captured in a CUDA graph.
 *
 * Element types: bf16 values travel as their raw uint16_t bits (the top half of an IEEE fp32).
 *
 * ----------------------------------------------------------------------------------------------
 * Tree layout, shared by every kernel (one struct, host or device pointers)
 * ----------------------------------------------------------------------------------------------
 * A batch holds S streams. Stream s owns a draft tree of n_nodes[s] = 1 + B_s nodes, stored at a
 * fixed per-stream stride max_nodes (1 <= n_nodes[s] <= max_nodes <= KDT_MAX_NODES):
 *   node 0            the root: the previous round's bonus token, depth 0, parent -1;
 *   nodes 1..B_s      draft nodes in best-first pop order, hence parent[i] < i and siblings
 *                     (children of one parent) in increasing index order with distinct tokens.
 * Per stream s, node i (index s*max_nodes + i):
 *   token[i]          token id
 *   parent[i]         parent node index, -1 for the root
 *   depth[i]          0 for the root, depth[parent]+1 otherwise, <= L
 *   first_child[i]    lowest-index child, -1 if none
 *   next_sibling[i]   next child of the same parent (higher index), -1 if none
 *   position[i]       prefix_len[s] + depth[i]: the RoPE position used in verification
 *   score[i]          sum of the draft log-probs on the root path (root 0): the DDTree surrogate
 *   anc_mask          [S][max_nodes][KDT_MASK_WORDS(max_nodes)] uint64: bit j of row i is set iff
 *                     j == i or j is an ancestor of i (bit j lives in word j/64, bit j%64)
 * Slots i >= n_nodes[s] are padding: token/parent/depth/first_child/next_sibling/position = -1,
 * score = -INFINITY, mask row all zero. Every builder writes the padding, so outputs compare
 * bit-exactly.
 */
#ifndef KDTREE_KERNELS_H
#define KDTREE_KERNELS_H

#include "kdtree/kdtree.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KDT_MAX_BUDGET 1024                 /* B <= 1024 draft nodes per stream */
#define KDT_MAX_NODES (KDT_MAX_BUDGET + 1)  /* plus the root */
#define KDT_MAX_DEPTH 16                    /* L <= 16 draft positions */
#define KDT_MAX_PATH (KDT_MAX_DEPTH + 1)    /* accepted path: root + up to L nodes */
#define KDT_MAX_TOPK 1024                   /* K <= B */
#define KDT_MAX_VOCAB (1 << 20)
#define KDT_MAX_STREAMS 4096
#define KDT_MASK_WORDS(n) (((n) + 63) / 64)

typedef enum kdt_dtype { KDT_F32 = 0, KDT_BF16 = 1 } kdt_dtype;

typedef struct kdt_tree {
    int32_t n_streams;      /* S, 1..KDT_MAX_STREAMS */
    int32_t max_nodes;      /* per-stream stride, 1..KDT_MAX_NODES */
    int32_t *n_nodes;       /* [S]             1 + B_s */
    int32_t *token;         /* [S][max_nodes] */
    int32_t *parent;        /* [S][max_nodes]  -1 for the root and padding */
    int32_t *depth;         /* [S][max_nodes] */
    int32_t *first_child;   /* [S][max_nodes]  -1 = none */
    int32_t *next_sibling;  /* [S][max_nodes]  -1 = none */
    int32_t *position;      /* [S][max_nodes]  prefix_len + depth */
    float *score;           /* [S][max_nodes]  root path log-prob sum */
    uint64_t *anc_mask;     /* [S][max_nodes][KDT_MASK_WORDS(max_nodes)] */
} kdt_tree;

/* ---------------------------------------------------------------------------------------------
 * log-softmax + top-K over the vocabulary, for the L draft positions of every stream.
 * Output rows are sorted by descending log-prob; equal logits are ordered by ascending token id,
 * so the ids are identical on CPU and GPU. top_logp = logit - logsumexp(row), computed in fp32
 * (CPU and GPU agree to float rounding, not bitwise).
 * Special values, same on CPU and GPU: a NaN logit counts as -inf, +inf as FLT_MAX (ties with
 * FLT_MAX by id); a -inf logit gets top_logp -inf (an all -inf row gives -inf, never NaN).
 * logits must be aligned to its element size. The CUDA launcher needs a 16-byte aligned
 * workspace when kdt_topk_workspace_bytes() > 0 (0 for vocab < 8192). That size never decreases
 * with n_rows or k (at most about 33 KB per row, for up to 1056 rows), so one buffer sized for
 * the largest (n_rows, k) serves every smaller call.
 * ------------------------------------------------------------------------------------------- */
typedef struct kdt_topk_params {
    int32_t n_rows;         /* R = S * L, 1.. */
    int32_t vocab;          /* V, 1..KDT_MAX_VOCAB */
    int32_t k;              /* 1..min(V, KDT_MAX_TOPK) */
    kdt_dtype dtype;        /* of logits */
    const void *logits;     /* [R][row_stride] of dtype, first V used */
    int64_t row_stride;     /* elements between rows, >= V */
    int32_t *top_ids;       /* [R][k] out */
    float *top_logp;        /* [R][k] out */
    void *workspace;        /* device scratch of kdt_topk_workspace_bytes(), may be NULL if 0 */
    size_t workspace_bytes;
} kdt_topk_params;

size_t kdt_topk_workspace_bytes(int32_t n_rows, int32_t vocab, int32_t k);
kdt_status kdt_topk_logsoftmax_cpu(const kdt_topk_params *p);
kdt_status kdt_topk_logsoftmax_cuda(const kdt_topk_params *p, void *stream);

/* ---------------------------------------------------------------------------------------------
 * tree_build: the DDTree best-first heap (Ringel & Romano, Alg. 1), all streams in one launch.
 * Candidate = (depth d, parent p, rank r) with score = score[p] + top_logp[s][d-1][r] (fp32 add).
 * Pop the best candidate, give it the next node index, push its next sibling (r+1 < top_k,
 * same parent) and its first child (rank 0 at depth d+1, if d < L_s). Stops after B_s pops or
 * when no candidate is left. Order: higher score first; equal scores (as fp32 bit patterns,
 * -0 == +0) -> lower depth, then lower parent index, then lower rank. This total order makes
 * CPU and GPU trees identical bit for bit.
 * chain = 1 builds the DFlash baseline instead: node d (d = 1..min(B_s, L_s)) is the rank-0
 * token at depth d, parent d-1, in the same output format.
 * A NaN sum (a NaN log-prob, or -inf + +inf) scores -inf. Rows that are not descending still
 * give a well-defined (deterministic, identical) tree, only not the optimal one.
 * The CPU twin rejects per-stream values out of range (budget, depth_limit, prefix_len >= 0);
 * the CUDA launcher cannot read them, so its kernel clamps budget to 0..max_nodes-1 and
 * depth_limit to 1..max_depth (same tree as the CPU on clamped input) and never goes out of
 * bounds. Token ids are copied, not checked.
 * ------------------------------------------------------------------------------------------- */
typedef struct kdt_tree_build_params {
    int32_t n_streams;          /* S, must equal out->n_streams */
    int32_t max_depth;          /* L stride of the top-K arrays, 1..KDT_MAX_DEPTH */
    int32_t top_k;              /* K stride, 1..KDT_MAX_TOPK */
    const int32_t *top_ids;     /* [S][max_depth][top_k] */
    const float *top_logp;      /* [S][max_depth][top_k], each row descending */
    const int32_t *depth_limit; /* [S] L_s in 1..max_depth */
    const int32_t *budget;      /* [S] B_s in 0..out->max_nodes-1 (B_s = 0: root-only tree) */
    const int32_t *root_token;  /* [S] */
    const int32_t *prefix_len;  /* [S] >= 0: position of the root */
    int32_t chain;              /* 0 = DDTree, 1 = DFlash chain */
} kdt_tree_build_params;

kdt_status kdt_tree_build_cpu(const kdt_tree_build_params *p, kdt_tree *out);
kdt_status kdt_tree_build_cuda(const kdt_tree_build_params *p, kdt_tree *out, void *stream);

/* ---------------------------------------------------------------------------------------------
 * tree_accept (greedy walk) + validation.
 * From the root: while target_token[cur] equals the token of a child of cur, move to that
 * child. accepted[] lists the visited nodes (root first, tau of them); emit[] holds the tau
 * tokens this round produces: the tokens of accepted nodes 1..tau-1, then the bonus
 * (target_token at the last accepted node). The walk is bounded by n_nodes steps whatever the
 * input. A stream whose tree is malformed gets error[s] != 0 (KDT_TREE_* bits), tau 0, bonus -1,
 * and nothing out of bounds is read or written; the CPU twin then returns
 * KDT_ERR_MALFORMED_TREE naming the first bad stream, the CUDA launcher leaves the check of
 * error[] to the host (kdt_tree_errors_check()).
 * ------------------------------------------------------------------------------------------- */
enum {
    KDT_TREE_BAD_SIZE = 1,     /* n_nodes outside 1..max_nodes */
    KDT_TREE_BAD_PARENT = 2,   /* parent[0] != -1, or parent[i] outside 0..i-1 */
    KDT_TREE_BAD_DEPTH = 4,    /* depth[0] != 0, depth[i] != depth[parent]+1, or depth > L */
    KDT_TREE_BAD_LINK = 8,     /* first_child / next_sibling out of range or not matching parent[] */
    KDT_TREE_CYCLE = 16,       /* a child/sibling link that does not move to a higher index */
    KDT_TREE_DUP_TOKEN = 32,   /* two children of one parent carry the same token */
};

typedef struct kdt_tree_accept_params {
    const kdt_tree *tree;           /* the tree (host struct; its arrays on the kernel's side) */
    int32_t max_depth;              /* L for the depth check, 1..KDT_MAX_DEPTH */
    const int32_t *target_token;    /* [S][max_nodes] the target's token at every node */
    int32_t *accepted;              /* [S][KDT_MAX_PATH] out: node indices, root first */
    int32_t *emit;                  /* [S][KDT_MAX_PATH] out: tau tokens to emit */
    int32_t *tau;                   /* [S] out */
    int32_t *bonus;                 /* [S] out */
    int32_t *error;                 /* [S] out: 0 or KDT_TREE_* bits */
} kdt_tree_accept_params;

kdt_status kdt_tree_accept_cpu(const kdt_tree_accept_params *p);
kdt_status kdt_tree_accept_cuda(const kdt_tree_accept_params *p, void *stream);

/* Checks a host copy of tree_accept's error[]: KDT_OK if no stream is flagged, else
 * KDT_ERR_MALFORMED_TREE with a last-error message naming the first bad stream and its flags
 * ("stream 3: malformed tree (parent out of range, cycle)"). */
kdt_status kdt_tree_errors_check(const int32_t *error, int32_t n_streams);

/* ---------------------------------------------------------------------------------------------
 * KV commit: after acceptance, move the accepted nodes' cache rows from their tree slots
 * (prefix_len + node index) to prefix_len + k (k-th accepted node), for all layers and streams
 * in one launch, in place. A stream whose path is already 0..tau-1 is skipped. Slot t of stream s
 * lives in page block_table[s][t / page_size], row t % page_size.
 * ------------------------------------------------------------------------------------------- */
typedef struct kdt_kv_commit_params {
    int32_t n_streams;          /* S */
    int32_t n_layers;           /* 1.. */
    int32_t row_bytes;          /* bytes of one token's row in one layer (576 bf16 = 1152), %2==0 */
    int32_t page_size;          /* tokens per page (64) */
    int32_t n_pages;            /* pages in the cache (bounds check of block_table entries) */
    void *cache;                /* [n_layers] x [n_pages][page_size][row_bytes] */
    int64_t layer_stride_bytes; /* bytes between layers, >= n_pages*page_size*row_bytes */
    const int32_t *block_table; /* [S][max_pages] */
    int32_t max_pages;          /* block-table stride */
    const int32_t *prefix_len;  /* [S] slot of the root */
    const int32_t *accepted;    /* [S][KDT_MAX_PATH] from tree_accept */
    const int32_t *tau;         /* [S] 0 (skip) .. KDT_MAX_PATH */
} kdt_kv_commit_params;

kdt_status kdt_kv_commit_cpu(const kdt_kv_commit_params *p);
kdt_status kdt_kv_commit_cuda(const kdt_kv_commit_params *p, void *stream);

/* ---------------------------------------------------------------------------------------------
 * verify_attn: MLA attention in absorbed form over a paged latent cache with a tree mask.
 * Per stream s and node i (i < n_nodes[s]) and head h:
 *   keys t = 0 .. prefix_len[s] + n_nodes[s] - 1 in the paged cache; the committed prefix
 *   t < prefix_len is always visible; tree slot t = prefix_len + j is visible iff bit j of
 *   anc_mask row i is set.
 *   score_t = softmax_scale * dot(q[s][i][h][0:d_qk], kv[t][0:d_qk])
 *   out[s][i][h] = sum_t softmax(score)_t * kv[t][0:d_v]      (bf16)
 *   lse[s][i][h] = log(sum_t exp(score_t))                       (natural log, fp32)
 * Rows i >= n_nodes[s] are not written. n_nodes = 1 with mask bit 0 is plain decode.
 * kv[t] is the cache row's value in its format (kdt_kv_format), taken exactly.
 * ------------------------------------------------------------------------------------------- */
/* Latent cache row formats (kdt_verify_attn_params.kv_format). */
#define KDT_KV_FP8_GROUP 128 /* latents per fp32 scale in KDT_KV_FP8_SCALED rows */
typedef enum kdt_kv_format {
    KDT_KV_BF16 = 0,       /* d_qk bf16: [c_kv (d_v) | k_pe (d_qk - d_v)]; 1152 B at 576 */
    KDT_KV_FP8_SCALED = 1, /* d_v e4m3 latents, d_v / 128 fp32 scales (latent j is e4m3 * scale[j / 128]),
                            * then d_qk - d_v bf16 rope values: 656 B at 576 / 512, the layout of
                            * FlashMLA's and vLLM's FP8 MLA caches. The CPU reference reads it
                            * exactly; on the GPU the portable kernel does, dequantizing each key to
                            * bf16(e4m3 x scale) (so it matches the bf16 path over those values;
                            * exact FP8 arithmetic is ~4e-3 away with max/448 scales, exact for
                            * power-of-two ones), at 1.02-1.24x the bf16 cache's time in the same
                            * kernel. The sm_90a kernel reads KDT_KV_BF16 only, so on a Hopper an
                            * FP8 cache runs the portable kernel (2.5-2.9x the sm_90a bf16 time) */
} kdt_kv_format;
/* Bytes of one cache row of `format` (0 if the format or the dimensions are invalid for it). */
size_t kdt_kv_row_bytes(int32_t kv_format, int32_t d_qk, int32_t d_v);

typedef struct kdt_verify_attn_params {
    int32_t n_streams;          /* S */
    int32_t n_heads;            /* H, 1..128 */
    int32_t max_nodes;          /* q / out / mask stride per stream */
    int32_t d_qk;               /* 576 (latent 512 + rope 64) */
    int32_t d_v;                /* 512 (leading columns of the KV row) */
    float softmax_scale;        /* e.g. 0.144680 for Kimi K2.6 */
    const uint16_t *q;          /* bf16 [S][max_nodes][H][d_qk] */
    const void *kv_cache;       /* [n_pages][page_size] rows of kdt_kv_row_bytes(kv_format, ...) (one layer) */
    int32_t n_pages;
    int32_t page_size;          /* 64 */
    const int32_t *block_table; /* [S][max_pages] */
    int32_t max_pages;
    const int32_t *prefix_len;  /* [S] committed tokens P_s; tree rows at slots P_s.. */
    const int32_t *n_nodes;     /* [S] q_len per stream, 1..max_nodes */
    const uint64_t *anc_mask;   /* [S][max_nodes][KDT_MASK_WORDS(max_nodes)] */
    uint16_t *out;              /* bf16 [S][max_nodes][H][d_v] */
    float *lse;                 /* [S][max_nodes][H] */
    void *workspace;            /* device scratch of kdt_verify_attn_workspace_bytes() */
    size_t workspace_bytes;
    int32_t kv_format;          /* kdt_kv_format: 0 (bf16) when the struct is zero-initialized */
} kdt_verify_attn_params;

/* Scratch the CUDA launcher needs for split-KV partials; max_prefix bounds prefix_len. */
size_t kdt_verify_attn_workspace_bytes(int32_t n_streams, int32_t n_heads, int32_t max_nodes,
                                       int32_t max_prefix);
kdt_status kdt_verify_attn_cpu(const kdt_verify_attn_params *p);
/* CUDA: on a Hopper with sm_90a code in the binary, the wgmma kernel; elsewhere the portable
 * mma.sync kernel (sm_80 / sm_90 / sm_120). KDT_VERIFY_ATTN=mma forces the portable kernel,
 * KDT_VERIFY_ATTN=wgmma demands the sm_90a one (KDT_ERR_UNSUPPORTED where it cannot run).
 * KDT_VA_SEESAW=1 runs the sm_90a kernel's v5 schedule instead of v4 (same results to rounding;
 * slower on the H200 so far, see docs/verify_attn_notes.md). */
kdt_status kdt_verify_attn_cuda(const kdt_verify_attn_params *p, void *stream);
/* Which kernel kdt_verify_attn_cuda runs on the current device with the current environment:
 * "sm_90a (wgmma)", "portable (mma.sync)", or an error text starting with "error:". */
const char *kdt_verify_attn_cuda_path(void);
/* Diagnostics: with KDT_VA_PROFILE=1 in the environment the sm_90a kernel stamps the clock at its
 * phase boundaries (CTA 0, first item); this formats the last call's mean cycles per phase into
 * out (one line per warpgroup). KDT_ERR_CUDA if the stamps cannot be read. */
kdt_status kdt_verify_attn_cuda_profile(char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_KERNELS_H */
