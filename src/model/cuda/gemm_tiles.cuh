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
#define GT_HDC __host__ __device__ constexpr /* usable in gpu_gemm.cu's static_asserts */
#else
#define GT_HD static inline
#define GT_HDC static inline
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

/* ---- v2's shared-memory pool (gpu_gemm.cu, "v2: the default kernels") ----------------------------
 * A pass of R rows (8, or the pass's rows rounded up to 16, at most 64) needs the hi / lo double
 * buffer (2 x 2 planes x R x 72 bf16) and S stages of W [64][72] bf16 + X [R][64] fp32; the bulk
 * W loader adds one mbarrier per stage up front and copies W unpadded (8 KB). The pipeline keeps
 * block it + 1 in flight while block it is computed, so a pass needs S >= 2 (with S = 1 it would
 * index stage 1, past the pool). */
enum {
    GT_V2_ROWS = 64,            /* rows per pass the kernels are compiled for */
    GT_V2_HALF_ROWS = 8,        /* passes of <= 8 rows take the half path (rows 0-7 of one m-tile) */
    GT_V2_XCP = GT_BK + 8,      /* bf16 per hi / lo row (144 B) */
    GT_V2_W_STAGE = GT_BN * (GT_BK + 8) * 2, /* 9216 B */
    GT_V2_X_ROW = GT_BK * 4,    /* bytes per staged fp32 X row */
    GT_V2_MAX_STAGES = 10,
    GT_V2_BAR_BYTES = 128,      /* the bulk loader's mbarriers */
    GT_V2_W_STAGE_BULK = GT_BN * GT_BK * 2 /* 8192 B */
};
GT_HDC int gt_v2_tile_rows(int m) { return m <= GT_V2_HALF_ROWS ? GT_V2_HALF_ROWS : (m + 15) & ~15; }
/* Whether a launch takes the WIDE kernel instances (gpu_gemm.cu, k64_compute: the full-tile k step
 * unrolled over the m-tiles): its passes can hold more than GT_V2_HALF_ROWS rows. rows: its bound on
 * a pass's rows before the pool's cap (dense: m_max; grouped: max_item_rows, 0 = unknown =
 * GT_V2_ROWS); cap: rows per pass of its pool. Decode launches (<= 8 rows) keep the instances
 * whose code the WIDE path would change (session 30: +7 us per Kimi layer on an H200). */
GT_HD int gt_v2_wide(int rows, int cap) {
    const int r = rows > 0 ? rows : GT_V2_ROWS;
    return (r < cap ? r : cap) > GT_V2_HALF_ROWS;
}
GT_HDC int gt_v2_xc_bytes(int R) { return 2 * 2 * R * GT_V2_XCP * 2; }
GT_HDC int gt_v2_stage_bytes(int R) { return GT_V2_W_STAGE + R * GT_V2_X_ROW; }
GT_HDC int gt_v2_stage_bytes_bulk(int R) { return GT_V2_W_STAGE_BULK + R * GT_V2_X_ROW; }
/* stages a pool holds for R-row passes (negative: not even the hi / lo buffers fit) */
GT_HD int gt_v2_stages(int R, int pool) {
    const int s = (pool - gt_v2_xc_bytes(R)) / gt_v2_stage_bytes(R);
    return s > GT_V2_MAX_STAGES ? GT_V2_MAX_STAGES : s;
}
GT_HD int gt_v2_stages_bulk(int R, int pool) {
    const int s = (pool - GT_V2_BAR_BYTES - gt_v2_xc_bytes(R)) / gt_v2_stage_bytes_bulk(R);
    return s > GT_V2_MAX_STAGES ? GT_V2_MAX_STAGES : s;
}
/* Rows per pass of a pool: the most (multiple of 16, <= 64) that still leave 3 stages, else 2,
 * so the weight stream always has a block in flight while one is computed; 0 when not even 16
 * rows get 2 stages (the pool runs nothing). */
GT_HD int gt_v2_cap(int pool) {
    for (int want = 3; want >= 2; want--)
        for (int r = GT_V2_ROWS; r >= 16; r -= 16)
            if (gt_v2_stages(r, pool) >= want) return r;
    return 0;
}
/* The pool of k CTAs per SM: an equal share of the SM's shared memory, less the 1 KB the runtime
 * reserves per CTA, in 128-byte units. */
GT_HD int gt_pool_per_sm(int smem_per_sm, int k) { return (smem_per_sm / k - 1024) / 128 * 128; }
/* CTAs per SM a grouped launch that asks for k (gt_grouped_per_sm) gets on an SM of smem_per_sm
 * bytes: k, or fewer where k's pool would not keep 3 stages of 8-row passes (what made the
 * smaller pools pay: gpu_gemm.cu, v2_config_grouped) and 2 of its widest pass, with either W
 * loader, or not hold the argmax / SwiGLU tile (64 x 65 fp32); 2 (the runner's pool of
 * runner_pool bytes) when no k >= 3 does or k's pool would not be smaller. A 100 KB SM (sm_120,
 * sm_86 / 89) gets 2: its 3-per-SM pool holds 2 stages of 8 rows, 1 of 16. */
GT_HD int gt_v2_grouped_k(int k, int smem_per_sm, int runner_pool) {
    for (; k >= 3; k--) {
        const int pool = gt_pool_per_sm(smem_per_sm, k), cap = gt_v2_cap(pool);
        if (pool >= runner_pool) return 2;
        if (GT_V2_ROWS * (GT_BN + 1) * 4 > pool || cap < 16) continue;
        if (gt_v2_stages(8, pool) >= 3 && gt_v2_stages_bulk(8, pool) >= 3 && gt_v2_stages_bulk(cap, pool) >= 2)
            return k;
    }
    return 2;
}

/* ---- the wgmma GEMMs (gemm_wg.cuh) -------------------------------------------------------------
 * W in shared memory as one 128-byte-swizzled slab of 128 rows x 64 K: row r's 16-byte chunk c at
 * byte r * 128 + ((c ^ (r & 7)) << 4) (the layout wgmma's descriptors read, wgmma_sm90.cuh). For
 * rows < 64 this is a tiled 64 x 64 block (gt_block_chunk) byte for byte, so a tiled expert's two
 * blocks of a tile are copied verbatim, one after the other. */
GT_HDC int gt_wg_slab_byte(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }
/* The tiled copy: the source element (from W's block row n0 / 64, K block kb, ld columns) of the
 * 16 bytes that land at slab byte d. */
GT_HD int64_t gt_wg_tiled_src(int d, int kb, int ld) {
    const int blk = d >> 13, within = (d & 8191) >> 4;
    return (int64_t)blk * 64 * ld + (int64_t)kb * (GT_BN * GT_BK) + within * 8;
}
/* m64nN fp32 accumulator: element i of lane `lane` of warp `warp` (of its warpgroup) */
GT_HD int gt_wg_acc_row(int warp, int lane, int i) { return 16 * warp + (lane >> 2) + 8 * ((i >> 1) & 1); }
GT_HD int gt_wg_acc_col(int lane, int i) { return 8 * (i >> 2) + 2 * (lane & 3) + (i & 1); }
/* The fused SwiGLU of a 128-column gate/up tile (per 64 columns: 32 gate, then 32 up): output
 * (64-column block q, j < 4, e < 2) of a lane is h column gt_wg_h_col (from the tile's n0 / 2),
 * from its accumulator elements gt_wg_gate_elem and gt_wg_up_elem of row half hh. */
GT_HD int gt_wg_h_col(int lane, int q, int j, int e) { return 32 * q + 8 * j + 2 * (lane & 3) + e; }
GT_HD int gt_wg_gate_elem(int q, int j, int hh, int e) { return 4 * (8 * q + j) + 2 * hh + e; }
GT_HD int gt_wg_up_elem(int q, int j, int hh, int e) { return 4 * (8 * q + j + 4) + 2 * hh + e; }

#endif
