/* test_gemm_tiles.c - the tiled weight layout of the GPU GEMMs on the CPU, no GPU needed: the
 * index maps of src/model/cuda/gemm_tiles.cuh that kdt_gemm_tile64 (k_tile64), v2's tiled
 * cp.async W loader and the bulk loader's swizzled ldmatrix addresses (k64_compute<.., WSWZ>)
 * use. Emulates each on matrices of distinct values and checks:
 *   1. the tiling is a permutation of the matrix (every element lands exactly once);
 *   2. the tiled cp.async loader fills v2's padded [64][72] stage with exactly the row-major
 *      block (what the row-major loader puts there);
 *   3. for every warp, lane and k step, the 8 elements the bulk path's ldmatrix address (in the
 *      verbatim 8 KB block) points at are the 8 the padded path's address points at;
 *   4. the swizzle is conflict-free: the 8 row addresses of each 8x8 matrix fall in 8 distinct
 *      16-byte bank groups of a 128-byte line.
 * Since the mma chain only sees the fragments, 2 and 3 are what keeps the tiled kernels'
 * bits equal to the row-major ones (the GPU test checks that end to end). Also the bulk loader's
 * mbarrier protocol across a CTA's passes (test_bulk_pipeline_protocol) and the grouped GEMM's
 * CTAs-per-SM choice for the launch shapes of a Kimi layer and the tiny model
 * (test_grouped_policy), and that every pool the grouped launches get on any SM size runs their
 * pipeline (test_v2_pools), and which launches take the WIDE instances (test_wide_choice). And the
 * wgmma GEMMs' maps (gemm_wg.cuh, test_wg_maps): the verbatim copy of tiled blocks into the swizzled
 * slab, and the accumulator and fused-SwiGLU maps against v2's. */
#include <stdint.h>
#include <string.h>

#include "model/cuda/gemm_tiles.cuh"
#include "t.h"

enum { WP = 72 }; /* v2's padded stage row (V2_WP in gpu_gemm.cu) */

/* the host twin of k_tile64: chunk (r, q) of src to gt_tiled_chunk(r, q, ld) of dst */
static void tile_host(const uint16_t *src, uint16_t *dst, int64_t rows, int ld) {
    for (int64_t r = 0; r < rows; r++)
        for (int q = 0; q < ld / 8; q++) memcpy(dst + gt_tiled_chunk(r, q, ld), src + r * ld + q * 8, 16);
}

static void check_shape(int rows, int ld) {
    const size_t n = (size_t)rows * ld;
    uint16_t *w = xmalloc(n * 2), *t = xmalloc(n * 2);
    unsigned char *seen = xmalloc(n);
    for (size_t i = 0; i < n; i++) w[i] = (uint16_t)(i * 40503u + 7u); /* distinct mod 2^16 for n <= 65536 */
    memset(t, 0xff, n * 2);
    tile_host(w, t, rows, ld);
    /* 1. permutation */
    memset(seen, 0, n);
    int bad_perm = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int q = 0; q < ld / 8; q++) {
            const int64_t o = gt_tiled_chunk(r, q, ld);
            if (o < 0 || o + 8 > (int64_t)n || o % 8) {
                bad_perm++;
                continue;
            }
            for (int e = 0; e < 8; e++) bad_perm += seen[o + e]++ != 0;
        }
    CHECK_EQ_INT(bad_perm, 0);
    int bad_load = 0, bad_frag = 0, bad_bank = 0;
    uint16_t stage[64 * WP];
    for (int tile = 0; tile < rows / 64; tile++)
        for (int kb = 0; kb < ld / 64; kb++) {
            const uint16_t *blk = t + ((int64_t)tile * (ld / 64) + kb) * 64 * 64;
            /* 2. the tiled cp.async loader: 128 threads x 4 copies of 16 bytes */
            memset(stage, 0, sizeof stage);
            for (int tid = 0; tid < 128; tid++)
                for (int i = 0; i < 4; i++) {
                    const int r = gt_load_row(tid, i), c = gt_load_chunk(tid);
                    /* the kernel's source: block + gt_block_chunk(r0, c) + i * (16 rows) */
                    const int src = gt_block_chunk(gt_load_row(tid, 0), c) + (gt_load_row(tid, i) - gt_load_row(tid, 0)) * 64;
                    memcpy(stage + r * WP + c * 8, blk + src, 16);
                }
            for (int r = 0; r < 64; r++)
                for (int k = 0; k < 64; k++)
                    bad_load += stage[r * WP + k] != w[((int64_t)tile * 64 + r) * ld + kb * 64 + k];
            /* 3. and 4. fragments: bulk (verbatim block, swizzled) vs padded */
            for (int warp = 0; warp < 4; warp++)
                for (int kk = 0; kk < 4; kk++) {
                    int groups[4] = {0, 0, 0, 0}; /* per 8x8 matrix: bank groups hit (bit mask) */
                    for (int lane = 0; lane < 32; lane++) {
                        const int row = gt_w_frag_row(warp, lane), ch = gt_w_frag_chunk(lane, kk);
                        const int swz = gt_block_chunk(row, ch), pad = row * WP + ch * 8;
                        bad_frag += memcmp(blk + swz, stage + pad, 16) != 0;
                        groups[lane >> 3] |= 1 << ((swz % 64) / 8); /* 16-byte unit inside the 128-byte row */
                    }
                    for (int m = 0; m < 4; m++) bad_bank += groups[m] != 0xff;
                }
        }
    CHECK_EQ_INT(bad_load, 0);
    CHECK_EQ_INT(bad_frag, 0);
    CHECK_EQ_INT(bad_bank, 0);
    free(w);
    free(t);
    free(seen);
}

static void test_tiled_layout(void) {
    check_shape(64, 64);
    check_shape(128, 192);  /* several tiles and K blocks */
    check_shape(256, 256);
}

/* The split-K and batched views: block (k_begin / 64 + kb) of tile n0 / 64 starts where the
 * kernels look (W pointer at row n0 of matrix b: b * rows * ld + n0 * ld in both layouts). */
static void test_tile_starts(void) {
    const int rows = 192, ld = 320;
    for (int n0 = 0; n0 < rows; n0 += 64)
        for (int kb = 0; kb < ld / 64; kb++)
            CHECK_EQ_INT(gt_tiled_chunk(n0, kb * 8, ld), (int64_t)n0 * ld + (int64_t)kb * 64 * 64);
    /* a batch of matrices tiled as one [batch * rows][ld] matrix = each tiled on its own */
    for (int b = 0; b < 3; b++)
        for (int r = 0; r < rows; r += 17)
            for (int q = 0; q < ld / 8; q += 3)
                CHECK_EQ_INT(gt_tiled_chunk((int64_t)b * rows + r, q, ld), (int64_t)b * rows * ld + gt_tiled_chunk(r, q, ld));
}

/* The bulk loader's mbarrier protocol (v2_pass<W_BULK>), replayed on the CPU over many passes
 * of one CTA with different stage counts S and K-block counts nk (a CTA's passes differ in rows,
 * so in S): per stage s, thread 0 issues copy j into stage j % S (the prologue for j < S - 1,
 * else in iteration j - S + 1 after its barrier) and every thread waits at iteration it on stage
 * it % S with the parity bit wpar carries across passes. An mbarrier's phase count ph completes
 * once per copy (modelled as completing at once: the earliest, the worst case for the parity);
 * try_wait.parity(P) passes when ph's parity differs from P. Checks: every wait passes (no
 * deadlock), it consumes exactly the copy it is for (ph == waits + 1 at the wait: never two
 * completions ahead), and no copy is issued into a stage whose previous copy is unconsumed. */
static void test_bulk_pipeline_protocol(void) {
    enum { MAXS = 10 };
    int ph[MAXS] = {0}, waits[MAXS] = {0}, holds[MAXS], bad_wait = 0, bad_issue = 0, bad_block = 0;
    uint32_t wpar = 0, seed = 12345;
    for (int pass = 0; pass < 2000; pass++) {
        seed = seed * 1103515245u + 12345u;
        const int S = 2 + (int)((seed >> 16) % (MAXS - 1)); /* 2..10 */
        seed = seed * 1103515245u + 12345u;
        const int nk = (int)((seed >> 16) % 41);           /* 0..40 */
        for (int s = 0; s < MAXS; s++) holds[s] = -1;
#define ISSUE(j, st)                                                          \
    do {                                                                      \
        if (ph[(st)] != waits[(st)]) bad_issue++; /* previous copy unconsumed */ \
        ph[(st)]++;                                                           \
        holds[(st)] = (j);                                                    \
    } while (0)
        for (int g = 0; g < S - 1; g++)
            if (g < nk) ISSUE(g, g);
        int cs = 0, ls = S - 1;
        for (int it = 0; it < nk; it++) {
            const uint32_t P = (wpar >> cs) & 1u;
            if (((uint32_t)ph[cs] & 1u) == P) bad_wait++;   /* try_wait would spin forever */
            if (ph[cs] != waits[cs] + 1) bad_wait++;         /* not exactly the next copy */
            if (holds[cs] != it) bad_block++;                /* the stage holds another block */
            waits[cs]++;
            wpar ^= 1u << cs;
            const int j = it + S - 1;
            if (j < nk) ISSUE(j, ls);
            cs = cs + 1 == S ? 0 : cs + 1;
            ls = ls + 1 == S ? 0 : ls + 1;
        }
#undef ISSUE
        for (int s = 0; s < MAXS; s++) bad_wait += ph[s] != waits[s]; /* the pass drained */
    }
    CHECK_EQ_INT(bad_wait, 0);
    CHECK_EQ_INT(bad_issue, 0);
    CHECK_EQ_INT(bad_block, 0);
}

/* The grouped GEMM's CTAs per SM for the launch shapes of a Kimi K2.6 layer (E 384, top-8, one
 * shared expert, D 7168, moe_intermediate 2048: 64 gate/up and 112 down column tiles) and of the
 * bundled tiny model, on a 132-SM device: the shapes the session-8 measurements chose for. */
static void test_grouped_policy(void) {
    const int SM = 132;
    /* decode S 1: 9 items; gate/up 576 CTAs -> 5 per SM (one wave), down 1,008 -> 4 (0.95 vs 0.76) */
    CHECK_EQ_INT(gt_grouped_per_sm(1, 9, 9, 9 * 64, SM), 5);
    CHECK_EQ_INT(gt_grouped_per_sm(1, 9, 9, 9 * 112, SM), 4);
    /* decode S 8 (65 items, 4,160 / 7,280 CTAs): 5 per SM */
    CHECK_EQ_INT(gt_grouped_per_sm(8, 65, 72, 65 * 64, SM), 5);
    CHECK_EQ_INT(gt_grouped_per_sm(8, 65, 72, 65 * 112, SM), 5);
    /* tree verify N 9 / 65 (S 1): 4 per SM, 16-row passes (the shared expert has all N rows) */
    CHECK_EQ_INT(gt_grouped_per_sm(9, 73, 81, 73 * 64, SM), 4);
    CHECK_EQ_INT(gt_grouped_per_sm(64, 385, 585, 385 * 64, SM), 4);
    /* a 4,096-token prefill chunk: items of ~38 rows -> the runner's pool (64-row passes) */
    CHECK_EQ_INT(gt_grouped_per_sm(64, 961, 36864, 961 * 64, SM), 2);
    /* the tiny model's decode (2 of 16 experts + shared, 4 column tiles): resident at 2 per SM */
    CHECK_EQ_INT(gt_grouped_per_sm(1, 3, 3, 3 * 4, SM), 2);
    CHECK_EQ_INT(gt_grouped_per_sm(1, 4, 4, 264, SM), 2);
    /* 265..528 CTAs are one wave at 4 and at 5 per SM; 4 is the fuller one (the probe: E 5, 320
     * CTAs, 87.9 vs 101.6 us; E 8, 512 CTAs, 127.1 vs 130.2); past 528, 4 needs a second wave */
    CHECK_EQ_INT(gt_grouped_per_sm(1, 5, 5, 265, SM), 4);
    CHECK_EQ_INT(gt_grouped_per_sm(1, 8, 8, 512, SM), 4);
    CHECK_EQ_INT(gt_grouped_per_sm(1, 9, 9, 529, SM), 5);
    /* the SM count unknown: no wave arithmetic */
    CHECK_EQ_INT(gt_grouped_per_sm(1, 9, 9, 9 * 112, 0), 5);
    CHECK_EQ_INT(gt_grouped_per_sm(16, 9, 9, 9 * 112, 0), 4);
    CHECK_NEAR(gt_wave_efficiency(1008, 528), 1008.0 / 1056.0, 1e-12);
    CHECK_NEAR(gt_wave_efficiency(660, 660), 1.0, 1e-12);
    CHECK_NEAR(gt_wave_efficiency(5, 0), 0.0, 0.0);
}

/* The pools a grouped launch gets (gt_v2_grouped_k) on every SM size from 49 KB to 228 KB, for each
 * runner pool (gpu_gemm.cu's POOL_BYTES) and each k the policy asks for: a pool smaller than the
 * runner's, holding the 64 x 65 fp32 tile, >= 3 stages of 8-row passes and >= 2 stages of every
 * pass up to its cap with either W loader (v2_pass indexes stage 1: one stage ran past the pool,
 * compute-sanitizer on the H200 at KDT_GPU_SMEM_LIMIT=101376, session 25). Then the parts by name. */
static void test_v2_pools(void) {
    static const int runner_pools[3] = {55296, 82944, 115712};
    int bad = 0, smaller = 0;
    for (int per_sm = 49152 + 1024; per_sm <= 233472; per_sm += 512)
        for (int rp = 0; rp < 3; rp++) {
            if (runner_pools[rp] + 1024 > per_sm) continue; /* the runner's pool must fit one CTA */
            for (int k = 3; k <= 5; k++) {
                const int used = gt_v2_grouped_k(k, per_sm, runner_pools[rp]);
                if (used == 2) continue;
                smaller++;
                const int pool = gt_pool_per_sm(per_sm, used), cap = gt_v2_cap(pool);
                bad += used > k || used < 3 || pool >= runner_pools[rp] || pool < 64 * 65 * 4 || used * (pool + 1024) > per_sm;
                bad += cap < 16 || gt_v2_stages(8, pool) < 3 || gt_v2_stages_bulk(8, pool) < 3;
                for (int m = 1; m <= cap; m++)
                    bad += gt_v2_stages(gt_v2_tile_rows(m), pool) < 2 || gt_v2_stages_bulk(gt_v2_tile_rows(m), pool) < 2;
            }
        }
    CHECK_EQ_INT(bad, 0);
    CHECK(smaller > 0);
    /* rows per pass: the three runner pools, the H200's 5-per-SM pool, one that runs nothing */
    CHECK_EQ_INT(gt_v2_cap(115712), 64);
    CHECK_EQ_INT(gt_v2_cap(82944), 32);
    CHECK_EQ_INT(gt_v2_cap(55296), 16);
    CHECK_EQ_INT(gt_v2_cap(45568), 16);
    CHECK_EQ_INT(gt_v2_cap(20000), 0);
    CHECK_EQ_INT(gt_v2_stages(8, 19456), 1); /* the 100 KB SM's 5-per-SM pool: one stage */
    /* H100 / H200 (228 KB per SM, runner pool 115,712): 5 and 4 as asked, 45,568 / 57,344 B */
    CHECK_EQ_INT(gt_v2_grouped_k(5, 233472, 115712), 5);
    CHECK_EQ_INT(gt_pool_per_sm(233472, 5), 45568);
    CHECK_EQ_INT(gt_v2_grouped_k(4, 233472, 115712), 4);
    CHECK_EQ_INT(gt_pool_per_sm(233472, 4), 57344);
    /* A100 (164 KB, runner pool 82,944): 5's pool holds 2 stages of 8 rows -> 4 */
    CHECK_EQ_INT(gt_v2_grouped_k(5, 167936, 82944), 4);
    /* RTX PRO 6000 Blackwell, sm_86 / 89 (100 KB, runner pool 82,944): the runner's pool */
    CHECK_EQ_INT(gt_v2_grouped_k(5, 102400, 82944), 2);
    CHECK_EQ_INT(gt_v2_grouped_k(4, 102400, 82944), 2);
    CHECK_EQ_INT(gt_v2_grouped_k(3, 102400, 82944), 2);
}

/* Which launches take the WIDE instances: any whose passes can hold more than 8 rows, never a
 * decode launch (<= 8 rows), whatever its pool. */
static void test_wide_choice(void) {
    const int dense_cap = gt_v2_cap(gt_pool_per_sm(233472, 2)); /* the runner's pool on an H100 / H200 */
    CHECK_EQ_INT(dense_cap, 64);
    CHECK_EQ_INT(gt_v2_wide(1, dense_cap), 0);  /* decode S 1 */
    CHECK_EQ_INT(gt_v2_wide(8, dense_cap), 0);  /* decode S 8 */
    CHECK_EQ_INT(gt_v2_wide(9, dense_cap), 1);  /* tree verify N 9 */
    CHECK_EQ_INT(gt_v2_wide(65, dense_cap), 1); /* N 65: a 64-row pass */
    CHECK_EQ_INT(gt_v2_wide(1, 16), 0);         /* grouped decode items at 5 per SM */
    CHECK_EQ_INT(gt_v2_wide(8, 32), 0);
    CHECK_EQ_INT(gt_v2_wide(9, 16), 1);         /* a verify item of 9 rows */
    CHECK_EQ_INT(gt_v2_wide(0, 16), 1);         /* rows unknown: up to 64 */
    CHECK_EQ_INT(gt_v2_wide(0, 8), 0);          /* a pool of 8-row passes never needs it */
    CHECK_EQ_INT(gt_v2_tile_rows(GT_V2_HALF_ROWS), GT_V2_HALF_ROWS);
    CHECK_EQ_INT(gt_v2_tile_rows(GT_V2_HALF_ROWS + 1), 16);
}

/* gemm_wg.cuh's maps, which no GPU has run yet (session 45):
 *  - the tiled loader copies 16-byte chunks verbatim: the chunk that lands at slab byte
 *    gt_wg_slab_byte(r, c) must be row n0 + r's chunk kb * 8 + c of the tiled matrix, for both
 *    64-row blocks of a 128-row tile and any K block (and rows < 64 match a tiled block's own map);
 *  - the accumulator map covers the 64 x 128 tile once;
 *  - the fused SwiGLU pairs, for each output, the gate and the up of one row, 32 columns apart in
 *    one 64-column block, and writes h column n0' / 2 + (gate column in the block) as v2's
 *    store_swiglu does for the block at n0' = n0 + 64 q; every h column of a row once. */
/* cells of seen[0..n) not hit exactly once */
static int not_once(const unsigned char *seen, int n) {
    int bad = 0;
    for (int i = 0; i < n; i++) bad += seen[i] != 1;
    return bad;
}

static void test_wg_maps(void) {
    /* The tiled copy, for the 128-row W stages (dense and grouped register kernels) and the grouped
     * ss kernel's 256-row one (gemm_wg.cuh): tiled blocks copied verbatim land where
     * gt_wg_slab_byte puts their rows' chunks; a 64-row block is gt_block_chunk's layout; rows
     * 128.. are a second slab 16 KB in (warpgroup 1's, read by a descriptor at its start); a
     * stage is a permutation of its bytes. */
    const int ld = 320, rows = 512;
    static unsigned char wseen[2048];
    for (int tile = 128; tile <= 256; tile *= 2) {
        int bad = 0;
        memset(wseen, 0, sizeof wseen);
        for (int n0 = 0; n0 + tile <= rows; n0 += tile)
            for (int kb = 0; kb < ld / 64; kb++)
                for (int r = 0; r < tile; r++)
                    for (int c = 0; c < 8; c++) {
                        const int d = gt_wg_slab_byte(r, c);
                        const int64_t want = gt_tiled_chunk(n0 + r, kb * 8 + c, ld) - (int64_t)n0 * ld;
                        bad += gt_wg_tiled_src(d, kb, ld) != want;
                        if (r < 64) bad += d != 2 * gt_block_chunk(r, c);
                        if (r >= 128) bad += d != 16384 + gt_wg_slab_byte(r - 128, c);
                        if (n0 == 0 && kb == 0) {
                            if (d % 16 || d < 0 || d >= 128 * tile) bad++;
                            else wseen[d / 16]++;
                        }
                    }
        bad += not_once(wseen, 8 * tile);
        CHECK_EQ_INT(bad, 0);
    }
    int bad = 0;
    static unsigned char seen[64][128];
    memset(seen, 0, sizeof seen);
    for (int warp = 0; warp < 4; warp++)
        for (int lane = 0; lane < 32; lane++)
            for (int i = 0; i < 64; i++) {
                const int r = gt_wg_acc_row(warp, lane, i), col = gt_wg_acc_col(lane, i);
                if (r >= 0 && r < 64 && col >= 0 && col < 128) seen[r][col]++;
                else bad++;
            }
    bad += not_once(&seen[0][0], 64 * 128);
    CHECK_EQ_INT(bad, 0); /* the accumulator map */
    bad = 0;
    static unsigned char hseen[64][64];
    memset(hseen, 0, sizeof hseen);
    for (int warp = 0; warp < 4; warp++)
        for (int lane = 0; lane < 32; lane++)
            for (int q = 0; q < 2; q++)
                for (int j = 0; j < 4; j++)
                    for (int hh = 0; hh < 2; hh++)
                        for (int e = 0; e < 2; e++) {
                            const int ge = gt_wg_gate_elem(q, j, hh, e), ue = gt_wg_up_elem(q, j, hh, e);
                            const int row = gt_wg_acc_row(warp, lane, ge), gcol = gt_wg_acc_col(lane, ge);
                            bad += row != gt_wg_acc_row(warp, lane, ue) || row != gt_wg_acc_row(warp, lane, 2 * hh);
                            bad += gcol / 64 != q || gcol % 64 >= 32 || gt_wg_acc_col(lane, ue) != gcol + 32;
                            const int hcol = gt_wg_h_col(lane, q, j, e);
                            bad += hcol != 32 * q + gcol % 64;
                            if (hcol >= 0 && hcol < 64) hseen[row][hcol]++;
                            else bad++;
                        }
    bad += not_once(&hseen[0][0], 64 * 64);
    CHECK_EQ_INT(bad, 0);
}

int main(void) {
    T_RUN(test_tiled_layout);
    T_RUN(test_tile_starts);
    T_RUN(test_bulk_pipeline_protocol);
    T_RUN(test_grouped_policy);
    T_RUN(test_v2_pools);
    T_RUN(test_wide_choice);
    T_RUN(test_wg_maps);
    return t_summary();
}
