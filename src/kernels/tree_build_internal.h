/* tree_build_internal.h - what the CPU twin (cpu/tree_build.c) and the CUDA launcher
 * (cuda/tree_build.cu) of tree_build share: the argument check and the packed candidate key that
 * defines the pop order, so both sides order candidates by literally the same integer.
 *
 * Candidate key (64 bits, a larger key pops first):
 *   bits 63..32  kdt_f32_order_key(score)         higher score first (-0 == +0)
 *   bits 24..21  15 - (depth - 1)   (depth 1..16) then lower depth
 *   bits 20..10  2047 - parent      (parent 0..1024) then lower parent index
 *   bits  9..0   1023 - rank        (rank 0..1023) then lower rank
 * (depth, parent, rank) names a candidate uniquely, so the order is total. A real candidate's key
 * is never 0: the score key of -inf is 0x007fffff and NaN scores do not exist (see
 * kdt_tb_add), so 0 marks an empty frontier slot on the GPU.
 *
 * Score arithmetic: a candidate's score is score[parent] + top_logp[depth-1][rank], one fp32 add
 * rounded to nearest (no FMA, no subtract-then-add), and a NaN sum (a NaN log-prob, or -inf plus
 * +inf) becomes -inf. The root scores +0, so no score is ever -0 or NaN and the score is exactly
 * recoverable from its order key.
 */
#ifndef KDT_TREE_BUILD_INTERNAL_H
#define KDT_TREE_BUILD_INTERNAL_H

#include <stdint.h>

#include "kdtree/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Checks everything a launcher can see on the host: the params and tree structs, their pointers
 * and scalar fields. When host_arrays is nonzero the per-stream arrays (budget, depth_limit,
 * prefix_len) are host memory and are checked too (the CPU twin); the CUDA launcher passes 0 and
 * its kernel clamps those values instead. `who` prefixes every message. */
kdt_status kdt_tree_build_check_args(const kdt_tree_build_params *p, const kdt_tree *out,
                                     int host_arrays, const char *who);

#ifdef __cplusplus
}
#endif

#if defined(__CUDACC__)
#define KDT_TB_INLINE __host__ __device__ __forceinline__
#else
#define KDT_TB_INLINE static inline
#endif

#define KDT_TB_DEPTH_SHIFT 21
#define KDT_TB_PARENT_SHIFT 10

/* The low 32 bits of a candidate key: the tie-break fields (see the top of this file). */
KDT_TB_INLINE uint32_t kdt_tb_tie_bits(int32_t depth, int32_t parent, int32_t rank) {
    return ((uint32_t)(16 - depth) << KDT_TB_DEPTH_SHIFT) |
           ((uint32_t)(2047 - parent) << KDT_TB_PARENT_SHIFT) | (uint32_t)(1023 - rank);
}
KDT_TB_INLINE int32_t kdt_tb_depth(uint32_t tie) { return 16 - (int32_t)(tie >> KDT_TB_DEPTH_SHIFT); }
KDT_TB_INLINE int32_t kdt_tb_parent(uint32_t tie) {
    return 2047 - (int32_t)((tie >> KDT_TB_PARENT_SHIFT) & 2047u);
}
KDT_TB_INLINE int32_t kdt_tb_rank(uint32_t tie) { return 1023 - (int32_t)(tie & 1023u); }

/* kdt_f32_order_key on raw fp32 bits, for host and device alike (bits of -0 must already be
 * folded; tree scores are never -0). */
KDT_TB_INLINE uint32_t kdt_tb_order_key_bits(uint32_t u) {
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
/* Inverse of kdt_tb_order_key_bits: the fp32 bits of a score key. */
KDT_TB_INLINE uint32_t kdt_tb_key_to_bits(uint32_t key) {
    return (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
}

#endif
