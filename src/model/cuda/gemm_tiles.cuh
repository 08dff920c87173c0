/* gemm_tiles.cuh - the index maps of the GEMMs' tiled weight layout (kdt_gemm_tile64,
 * KDT_GPU_TILED_EXPERTS / KDT_GPU_TILED_DENSE) and of the W fragments the v2 kernels read, and
 * the grouped GEMM's CTAs-per-SM policy, in plain C so that tests/test_gemm_tiles.c can check on
 * the CPU, without a GPU, that the tiling, the tiled cp.async loader and the bulk loader's
 * swizzled ldmatrix addresses hand every lane the very elements the row-major path does, and
 * which pool each launch shape gets (gpu_gemm.cu uses these functions, not copies).
 *
 * Tiled layout of a bf16 matrix [rows][ld] (rows, ld multiples of 64): [rows/64][ld/64][64][64];
 * inside a 64 x 64 block, the 16-byte chunk c (elements 8c..8c+7) of block row t sits at chunk
 * c ^ (t & 7), so the block copied verbatim into shared memory is conflict-free for ldmatrix
 * (the 8 rows of one 8x8 matrix land in 8 different 16-byte bank groups).
 *
 * W fragments (k64_compute): warp w owns stage rows 16 w .. 16 w + 15; for k step kk, lane l
 * gives ldmatrix.x4 the address of row gt_w_frag_row(w, l), chunk gt_w_frag_chunk(l, kk). */
#ifndef KDT_GEMM_TILES_CUH
#define KDT_GEMM_TILES_CUH

#include <stdint.h>

#ifdef __CUDACC__
#define GT_HD __host__ __device__ __forceinline__
#else
#define GT_HD static inline
#endif

enum {
    GT_BN = 64, /* rows per tile (the CTA's output columns) */
    GT_BK = 64  /* K per block (one pipeline stage) */
};

/* Inside one 64 x 64 block: element offset of row t's chunk c. */
GT_HD int gt_block_chunk(int t, int c) { return t * GT_BK + ((c ^ (t & 7)) << 3); }

/* Element offset, in the tiled form of a matrix with ld columns, of row n's chunk q (= k / 8). */
GT_HD int64_t gt_tiled_chunk(int64_t n, int q, int ld) {
    const int64_t tile = n / GT_BN;
    const int t = (int)(n % GT_BN), kb = q >> 3;
    return (tile * (ld / GT_BK) + kb) * (GT_BN * GT_BK) + gt_block_chunk(t, q & 7);
}

/* The stage row and chunk whose address lane `lane` of warp `warp` gives ldmatrix.x4 for k step kk
 * (matrices: n 0-7 / k 0-7, n 0-7 / k 8-15, n 8-15 / k 0-7, n 8-15 / k 8-15 of the warp's 16). */
GT_HD int gt_w_frag_row(int warp, int lane) { return warp * 16 + ((lane >> 4) << 3) + (lane & 7); }
GT_HD int gt_w_frag_chunk(int lane, int kk) { return 2 * kk + ((lane >> 3) & 1); }

/* The cp.async W loader: thread tid's copy i of a stage is row (tid >> 3) + 16 i, chunk tid & 7. */
GT_HD int gt_load_row(int tid, int i) { return (tid >> 3) + 16 * i; }
GT_HD int gt_load_chunk(int tid) { return tid & 7; }

/* ctas / (slots x whole waves): 1 when the last wave is full */
GT_HD double gt_wave_efficiency(int64_t ctas, int64_t slots) {
    const int64_t waves = slots > 0 ? (ctas + slots - 1) / slots : 0;
    return waves > 0 ? (double)ctas / (double)(slots * waves) : 0.0;
}

/* CTAs per SM of a grouped launch (v2_config_grouped in gpu_gemm.cu states the measurements):
 * rows = the most rows an item can have, items = the expected items, pairs = the pairs bound,
 * ctas = items x column tiles, n_sm = the device's SMs (0: unknown). 2 is the runner's pool. */
GT_HD int gt_grouped_per_sm(int rows, int64_t items, int64_t pairs, int64_t ctas, int n_sm) {
    if (n_sm > 0 && ctas <= 2 * (int64_t)n_sm) return 2; /* resident at 2 per SM: the deep pool */
    if (rows <= 8) /* decode-sized: 5, or 4 when that fills the last wave clearly better */
        return n_sm > 0 && gt_wave_efficiency(ctas, 4 * (int64_t)n_sm) >
                               gt_wave_efficiency(ctas, 5 * (int64_t)n_sm) + 0.1 ? 4 : 5;
    return pairs > 16 * items ? 2 : 4; /* <= 16 rows per item on average: 16-row passes */
}

#endif
