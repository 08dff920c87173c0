/* verify_attn_tiles.cuh - the index maps and the split schedule of the portable verify_attn
 * kernel (cuda/verify_attn.cu), in plain C so the CPU test can include them too: it emulates the
 * kernel's ldmatrix / mma.sync data flow with these very functions (tests/test_verify_attn.c),
 * which checks swizzle, fragment addressing and the schedule without a GPU.
 *
 * Shared-memory tiles: a [rows][576] bf16 tile (Q, or BN keys of KV) is 72 chunks of 16 bytes
 * per row; chunk c of row r sits at va_swz(r, c), XOR-swizzled inside each group of 8 chunks so
 * that 8 rows read at one logical column land in 8 different bank groups. P is [64][BN + 8] bf16
 * (16 bytes of padding per row for the same purpose).
 *
 * mma.sync m16n8k16 fragments (PTX ISA): with g = lane / 4, t = lane % 4,
 *   A 16x16 row-major: a0 = A[g][2t..], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
 *   B 16x8 (k x n):    b0 = B[2t..2t+1][g], b1 = B[2t+8..][g]
 *   C 16x8 fp32:       c0,c1 = C[g][2t, 2t+1], c2,c3 = C[g+8][2t, 2t+1]
 * ldmatrix .x4: lane l gives the address of row l % 8 of matrix l / 8; without .trans lane l
 * receives row l / 4, elements 2(l % 4), +1 of each matrix; with .trans it receives column l / 4,
 * rows 2(l % 4), +1.
 */
#ifndef KDT_VERIFY_ATTN_TILES_CUH
#define KDT_VERIFY_ATTN_TILES_CUH

#include <stdint.h>

#include "fp.h"

#ifdef __CUDACC__
#define VA_HD __host__ __device__ __forceinline__
#else
#define VA_HD static inline
#endif

enum {
    VA_D_QK = 576,           /* latent 512 + rope 64 */
    VA_D_V = 512,
    VA_ROWS = 64,            /* (node, head) rows per item */
    VA_THREADS = 256,        /* 8 warps */
    VA_QK_CHUNKS = 72,       /* 16-byte chunks per 576-wide bf16 row */
    VA_SCHED_BLOCK = 64,     /* keys per schedule block: splits are whole blocks */
    VA_TARGET_ITEMS = 132,   /* items a lone stream aims for (the H200's 132 SMs) */
    VA_MIN_BLOCKS = 16,      /* schedule blocks per split, at least (1,024 keys): see verify_attn.cu */
    VA_MAX_SPLITS = 64
};

/* The split schedule of one stream: keys = prefix_len + n_nodes, rt = row tiles. Depends on
 * nothing else, so a stream's output does not depend on the batch around it.
 * va_split_target: 1 if rt >= TARGET, else min(TARGET / rt, blocks / MIN_BLOCKS, MAX_SPLITS), at
 * least 1; non-decreasing in keys, and an upper bound of the final split count (workspace size).
 * va_split: that target rebalanced into equal chunks of whole 64-key blocks (the last chunk may
 * be shorter; no chunk is empty). */
VA_HD int va_split_target(int keys, int rt) {
    const int blocks = (keys + VA_SCHED_BLOCK - 1) / VA_SCHED_BLOCK;
    if (rt >= VA_TARGET_ITEMS) return 1;
    int s = VA_TARGET_ITEMS / rt, by_len = blocks / VA_MIN_BLOCKS;
    if (by_len < 1) by_len = 1;
    if (s > by_len) s = by_len;
    if (s > VA_MAX_SPLITS) s = VA_MAX_SPLITS;
    return s;
}
VA_HD void va_split(int keys, int rt, int *splits, int *chunk_keys) {
    const int blocks = (keys + VA_SCHED_BLOCK - 1) / VA_SCHED_BLOCK;
    const int s = va_split_target(keys, rt);
    const int chunk_blocks = (blocks + s - 1) / s;
    *splits = (blocks + chunk_blocks - 1) / chunk_blocks;
    *chunk_keys = chunk_blocks * VA_SCHED_BLOCK;
}
/* 1 if some stream of a launch can be split: a valid stream has at most max_keys keys (the block
 * table's reach) and at least one row tile of ceil(H / 64) rows; va_split_target is non-decreasing
 * in keys and non-increasing in row tiles, so that corner bounds every stream. With 0 the launcher
 * runs no merge pass at all (every stream is one split, whatever the workspace). */
VA_HD int va_launch_can_split(long long max_keys, int n_heads) {
    const int rt_min = (n_heads + VA_ROWS - 1) / VA_ROWS;
    const int keys = max_keys > (1 << 30) ? (1 << 30) : (int)max_keys;
    return keys > 0 && va_split_target(keys, rt_min) > 1;
}

/* The FP8 latent cache (KDT_KV_FP8_SCALED at d_v 512: 656-byte rows of 512 e4m3 latents, 4 fp32
 * scales, one per 128 latents, then 64 bf16 rope values). The portable kernel turns each key row
 * into the same bf16 tile row the bf16 cache gives: chunk c < 64 (latents 8c .. 8c + 7) is
 * bf16(e4m3 x scale[c / 16]) from the 8 code bytes at va_fp8_src(c); chunk c >= 64 is the rope's
 * 16 bytes at va_fp8_src(c), copied. Exact wherever e4m3 x scale fits bf16 (a power-of-two scale
 * in bf16's range); otherwise rounded to nearest even, the dequantization FlashMLA's FP8 path
 * also does before its bf16 products. */
enum { VA_FP8_ROW = 656, VA_FP8_SCALES = 512, VA_FP8_ROPE = 528 };
VA_HD int va_fp8_src(int c) { return c < 64 ? 8 * c : VA_FP8_ROPE + 16 * (c - 64); }
VA_HD int va_fp8_scale_idx(int c) { return c >> 4; }
VA_HD void va_fp8_chunk(const uint8_t codes[8], float scale, uint16_t out[8]) {
    for (int i = 0; i < 8; i++) out[i] = kdt_f32_to_bf16(kdt_e4m3_to_f32(codes[i]) * scale);
}

/* Byte offset of chunk c (0..71) of row r in a swizzled [rows][576] bf16 tile. */
VA_HD uint32_t va_swz(int r, int c) {
    return (uint32_t)(r * (VA_QK_CHUNKS * 16) + (((c & ~7) | ((c ^ r) & 7)) << 4));
}

/* Row / column inside a 16x8 accumulator of element e (0..3) held by `lane`. */
VA_HD int va_frag_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
VA_HD int va_frag_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }

/* S = Q K^T. A fragment (Q rows row0..row0+15, k-step kk): ldmatrix.x4 address of `lane`. */
VA_HD uint32_t va_qk_a_addr(int row0, int kk, int lane) {
    return va_swz(row0 + (lane & 15), kk * 2 + (lane >> 4));
}
/* B fragments of keys tok0..tok0+15 (two n8 tiles): ldmatrix.x4 gives b0, b1 of keys tok0..+7,
 * then b0, b1 of keys tok0+8..+15. */
VA_HD uint32_t va_qk_b_addr_x4(int tok0, int kk, int lane) {
    return va_swz(tok0 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1));
}
/* B fragment of keys tok0..tok0+7 (one n8 tile): ldmatrix.x2 (lanes 0..15 matter). */
VA_HD uint32_t va_qk_b_addr_x2(int tok0, int kk, int lane) {
    return va_swz(tok0 + (lane & 7), kk * 2 + ((lane >> 3) & 1));
}

/* O += P V. A fragment (P rows row0..+15, keys kk*16..+15) in the [64][p_stride] P tile. */
VA_HD uint32_t va_pv_a_addr(int row0, int kk, int lane, int p_stride) {
    return (uint32_t)(((row0 + (lane & 15)) * p_stride + kk * 16 + ((lane >> 4) << 3)) * 2);
}
/* B fragments (V keys kk*16..+15, value columns col0..col0+15; col0 % 16 == 0) by
 * ldmatrix.x4.trans: b0, b1 of columns col0..+7, then b0, b1 of columns col0+8..+15. */
VA_HD uint32_t va_pv_b_addr(int kk, int col0, int lane) {
    return va_swz(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), (col0 >> 3) + (lane >> 4));
}

#endif
