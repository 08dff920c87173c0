/* verify_attn_seesaw.cuh - the sm_90a verify_attn kernel v5 ("seesaw"), opt-in with
 * KDT_VA_SEESAW=1 (TMA loads only). Correct (the verify_attn GPU test runs every check on it),
 * but 10-20 % slower than v4 on the H200 (docs/verify_attn_notes.md, v5: the two softmaxes run in
 * series with little tensor work under them), so v4 (verify_attn_sm90_kernel) stays the default.
 * Included by verify_attn.cu only, after the items, walk, mask and epilogue helpers it shares with
 * v4.
 *
 * The idea: in v4 one warpgroup forms every score tile and runs the softmax while the other
 * waits, so the tensor pipe idles through the softmax. Here the two warpgroups take alternate KV
 * tiles, as FlashMLA's dense decode does (its write-up calls the schedule "seesaw"): per pair of
 * tiles (K0 in buffer 0, K1 in buffer 1), with O = [O_L | O_R] split by columns between WG0 and WG1
 * and one running row max m shared through shared memory:
 *   WG0: S0 = Q K0^T (previous step) -> softmax against m: scale0, P0 -> O_L = scale0 O_L + P0 V0L
 *   WG1: S1 = Q K1^T (previous step) -> softmax against WG0's new m: scale1, P1 (to shared memory),
 *        O_R = scale0 scale1 O_R
 *   WG0: O_L = scale1 O_L + P1 V1L, P0' = scale1 P0 to shared memory
 *   WG1: O_R += P0' V0R + P1 V1R
 *   then S0' and S1' of the next pair.
 * Each warpgroup does one score product and two half P V products per pair. It is the same online
 * softmax (every row's terms are rescaled to the final max), so the result equals v4's up to
 * rounding (P0' is rounded after its scale, P0 for O_L before it). The 128 multiplies that rescale
 * a warp's O are skipped when no row of the warp moved its max (exact).
 *
 * Shared memory (224 KB): Q (9 slabs of [64][64] bf16), KV buffers 0 and 1 (9 slabs each), one
 * mbarrier per slab of each buffer, the row max / scales. P0' and P1 go into the rope slab
 * (slab 8) of their own KV buffer: P V reads only slabs 0-7 and the score product of that tile is
 * complete by then. Every slab is refilled by TMA (one thread, 8 KB box, 128B swizzle) once its
 * last reader is done:
 *   buffer 0: slabs 0-3 after WG0's P0 V0L (WG0 issues), slabs 4-8 after WG1's P0' V0R (WG1);
 *   buffer 1: slabs 0-3 and 8 after WG0's P1 V1L (WG0), slabs 4-7 after WG1's P1 V1R (WG1).
 * The block-table entries of the next pair are loaded at the start of a pair and used only at the
 * TMA issue (a use right after the load stalled the issuing warp ~500 cycles in every pair).
 * WG0 waits on buffer 0's barriers (its score product), WG1 on buffer 1's; the other warpgroup's
 * reads of a buffer come after named barriers that follow those waits.
 * Hand-offs: named barriers, all full barriers of the 256 threads (compute-sanitizer's racecheck
 * orders accesses only across full barriers, see v3a in docs/verify_attn_notes.md): SCALE0 (m,
 * scale0), SCALE1 (m, scale1, P1), P0 (P0'). A pair without K1 (odd tile count) runs WG1's softmax
 * on an empty tile (scale1 = 1) and skips the K1 products.
 * ptxas serializes every wgmma of the kernel (C7515 / C7518 / C7520, "Potential Performance Loss")
 * when a score product is in flight across the pair loop's back edge, when registers of a tile
 * are rewritten under a product in flight, or when an RS product is issued in a branch after
 * another product: each of those shapes was tried and is avoided here; check the ptxas output for
 * C75xx after any change.
 * Masking, NaN rules, the tail of a split's last tile (V rows of keys >= ke zeroed by the
 * warpgroup that reads them, after the tile's score product), items, splits and the epilogue are
 * v4's. The running max starts at -1e30 rather than -inf, so no -inf - -inf appears; a row that
 * sees no key ends with l = 0: zero output, lse -inf, as in v4.
 */
#ifndef KDT_VERIFY_ATTN_SEESAW_CUH
#define KDT_VERIFY_ATTN_SEESAW_CUH

constexpr float SS_M_INIT = -1e30f; /* running max before any key (log2 domain) */
enum { SS_BAR_SCALE0 = 3, SS_BAR_SCALE1 = 4, SS_BAR_P0 = 5, SS_BAR_WG0 = 6, SS_BAR_WG1 = 7 };

struct SeesawRows {
    uint64_t kv_full[2][W_SLABS]; /* TMA: the slab of buffer b landed */
    float m[ROWS];                /* running row max (log2 domain) of both warpgroups */
    float scale0[ROWS];           /* WG0's rescale of this pair (old max -> its new max) */
    float scale1[ROWS];           /* WG1's rescale (WG0's max -> the pair's max) */
    float l1[ROWS];               /* WG1's row sums, for the epilogue */
    float inv[ROWS];              /* 1 / l of the finished rows (NaN: bad item) */
    int zero[ROWS];               /* the row saw no key: output 0 */
};
constexpr size_t SS_SMEM = 1024 + 3 * (size_t)W_TILE + sizeof(SeesawRows) + ROWS * 4 + sizeof(WalkShared);
static_assert(SS_SMEM <= 227 * 1024, "seesaw shared memory exceeds the sm_90 opt-in limit");

#if KDT_HAS_WGMMA
/* Row of the [n_pages * page_size][576] cache where tile t (64 keys, inside one page) starts; a
 * block-table entry out of range sets bad and reads page 0 (as va_key_src / w_tma_kv). */
__device__ __forceinline__ int ss_tile_row(const VaArgs &a, const int32_t *table, int t, int &bad) {
    int page = __ldg(table + t / a.page_size);
    if (page < 0 || page >= a.n_pages) bad = 1, page = 0;
    return page * a.page_size + t % a.page_size;
}

/* The same from a block-table entry loaded earlier (pg = table[t / page_size]). */
__device__ __forceinline__ int ss_page_row(const VaArgs &a, int pg, int t, int &bad) {
    if (pg < 0 || pg >= a.n_pages) bad = 1, pg = 0;
    return pg * a.page_size + t % a.page_size;
}

/* Whether any row of this warp has a rescale other than 1 (the max moved): the 128 multiplies of
 * O are skipped otherwise, which is exact. */
__device__ __forceinline__ bool ss_moved(const float s[2]) {
    return __any_sync(0xffffffffu, s[0] != 1.f || s[1] != 1.f);
}

/* TMA of slabs [s0, s1) of the tile at cache row y into the buffer at dst (one thread). */
__device__ __forceinline__ void ss_tma_slabs(const CUtensorMap *map, uint32_t dst, uint32_t bars, int y, int s0, int s1) {
    for (int sl = s0; sl < s1; sl++) {
        wg::mbar_arrive_expect_tx(bars + 8u * (uint32_t)sl, W_SLAB);
        wg::tma_load_2d(dst + (uint32_t)sl * W_SLAB, map, 64 * sl, y, bars + 8u * (uint32_t)sl);
    }
}

/* The score product's k steps over slab sl once it has landed: sc (+)= Q[:, slab] K[:, slab]^T. */
__device__ __forceinline__ void ss_scores_slab(float (&sc)[32], uint32_t q_base, uint32_t kv, uint32_t bars,
                                               uint32_t parity, int sl, bool first) {
    wg::mbar_wait(bars + 8u * (uint32_t)sl, parity);
    wg::fence();
#pragma unroll
    for (int j = 0; j < 4; j++)
        wg::mma_m64n64k16_ss(sc, wg::desc_kmajor(q_base, ROWS, 4 * sl + j), wg::desc_kmajor(kv, 64, 4 * sl + j),
                             first && j == 0 ? 0 : 1);
    wg::commit();
}

/* Zeroes the V columns of slabs [s0, s1) for keys [first, 64) of a tile (a split's last tile:
 * those keys are masked, but P = 0 times stale data that is NaN would still be NaN), then makes
 * the stores visible to this warpgroup's products (bar_id: a 128-thread barrier of the group). */
__device__ __forceinline__ void ss_zero_tail(unsigned char *tile, int first, int s0, int s1, int bar_id) {
    const int t = threadIdx.x & (WG_THREADS - 1), per = (s1 - s0) * 8; /* 16-byte chunks per key */
    for (int i = first * per + t; i < 64 * per; i += WG_THREADS) {
        const int r = i / per, c = i % per;
        *reinterpret_cast<uint4 *>(tile + (uint32_t)(s0 + c / 8) * W_SLAB + wg::sw128_offset(r, (c % 8) * 8)) =
            make_uint4(0, 0, 0, 0);
    }
    wg::fence_proxy_async();
    wg::bar_sync(bar_id, WG_THREADS);
}

/* The log2-domain scores of one tile (this thread's 2 rows x 16 keys), -inf where hidden.
 * FUSED (KDT_VA_FUSED=1, positive scale): the raw scores, masked; the scale goes into the max
 * (ss_row_max's result times scale_log2) and into the exponent's FFMA (ss_exp). */
template <bool FUSED>
__device__ __forceinline__ void ss_scale_mask(float (&sc)[32], const VaArgs &a, const VaItem &it, const int *sNode,
                                              int r0, int tq, int t0) {
    if (!FUSED) {
#pragma unroll
        for (int e = 0; e < 32; e++) sc[e] *= a.scale_log2;
    }
    if (t0 + 64 > it.P || t0 + 64 > it.ke) w_mask_tile(sc, a, it, sNode, r0, tq, t0);
}

/* Row maxima of this thread's two rows over the quad (the 4 lanes holding a row): per row four
 * chains of 4, then 2 levels, not one chain of 16; a single warp per scheduler runs the softmax,
 * so dependent latency is what it costs. */
__device__ __forceinline__ void ss_row_max(const float (&sc)[32], float mx[2]) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float m4[4];
#pragma unroll
        for (int q = 0; q < 4; q++) /* row h's elements 4 j + 2 h (+1), j = 2 q, 2 q + 1 */
            m4[q] = fmaxf(fmaxf(sc[8 * q + 2 * h], sc[8 * q + 2 * h + 1]), fmaxf(sc[8 * q + 4 + 2 * h], sc[8 * q + 5 + 2 * h]));
        mx[h] = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
}

/* sc <- 2^(sc - mu) per row (fp32 weights: lse stays accurate to fp32 rounding), their row
 * sums into ls, in the same shape as ss_row_max. */
template <bool FUSED>
__device__ __forceinline__ void ss_exp(float (&sc)[32], const float mu[2], float ls[2], float scale_log2) {
#pragma unroll
    for (int e = 0; e < 32; e++)
        sc[e] = FUSED ? va_ex2(fmaf(sc[e], scale_log2, -mu[(e >> 1) & 1])) : va_ex2(sc[e] - mu[(e >> 1) & 1]);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float s4[4];
#pragma unroll
        for (int q = 0; q < 4; q++)
            s4[q] = (sc[8 * q + 2 * h] + sc[8 * q + 2 * h + 1]) + (sc[8 * q + 4 + 2 * h] + sc[8 * q + 5 + 2 * h]);
        ls[h] = (s4[0] + s4[1]) + (s4[2] + s4[3]);
    }
}

/* bf16 P (the A fragments of its 4 key steps) into the rope slab of a KV buffer. */
__device__ __forceinline__ void ss_store_p(unsigned char *p_slab, const uint32_t (&pa)[4][4], int r0, int tq) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0, 16 * kk + 2 * tq)) = pa[kk][0];
        *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0 + 8, 16 * kk + 2 * tq)) = pa[kk][1];
        *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0, 16 * kk + 8 + 2 * tq)) = pa[kk][2];
        *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0 + 8, 16 * kk + 8 + 2 * tq)) = pa[kk][3];
    }
}

__device__ __forceinline__ void ss_scale_o(float (&o)[128], float s0, float s1) {
#pragma unroll
    for (int e = 0; e < 128; e++) o[e] *= (e & 2) ? s1 : s0;
}
#endif

/* PROF: the KDT_VA_PROFILE build (phase stamps per pair of tiles); the default one has none.
 * FUSED (KDT_VA_FUSED=1 with KDT_VA_SEESAW=1, positive scale): FlashMLA's softmax shape, as in
 * v4's FUSED instance: max on the raw scores, the scale in one FFMA per exponent, and each
 * warpgroup's O rescale (by its softmax's factor) unconditional, right after the max, in the
 * softmax's straight-line block, instead of behind a warp vote after the exponents. */
template <bool PROF, bool FUSED = false>
__global__ void __launch_bounds__(THREADS, 1) verify_attn_seesaw_kernel(const VaArgs a, const __grid_constant__ CUtensorMap kv_map) {
#if KDT_HAS_WGMMA
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = va::smem_addr(smem_raw), pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char *smem = smem_raw + pad;
    SeesawRows *sR = reinterpret_cast<SeesawRows *>(smem + 3 * W_TILE);
    int *sNode = reinterpret_cast<int *>(smem + 3 * W_TILE + sizeof(SeesawRows));
    WalkShared *sWalk = reinterpret_cast<WalkShared *>(smem + 3 * W_TILE + sizeof(SeesawRows) + ROWS * 4);
    const uint32_t q_base = raw + pad, kv0 = q_base + W_TILE, kv1 = q_base + 2 * W_TILE;
    unsigned char *kv0_p = smem + W_TILE, *kv1_p = smem + 2 * W_TILE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wgi = warp >> 2, wq = warp & 3, g = lane >> 2, tq = lane & 3;
    const int r0 = 16 * wq + g; /* this thread's rows: r0, r0 + 8 */
    const bool issuer = (tid & (WG_THREADS - 1)) == 0; /* each warpgroup's TMA thread */
    const uint32_t bars0 = va::smem_addr(&sR->kv_full[0][0]), bars1 = va::smem_addr(&sR->kv_full[1][0]);
    /* the stamps of CTA 0's first item. (This build's ptxas serializes its wgmma (C7520), so its
     * phases are an upper bound; the default build is not affected.) */
    bool stamp = PROF && blockIdx.x == 0 && issuer;
    uint32_t parity = 0; /* WG0: of buffer 0's next completion; WG1: of buffer 1's */
    if (tid == 0) {
        for (int i = 0; i < 2 * W_SLABS; i++) wg::mbar_init(bars0 + 8u * (uint32_t)i, 1);
    }
    wg::fence_proxy_async();
    __syncthreads();
#define SS_STAMP(ph) \
    if (PROF && stamp && p < VA_PROF_TILES) g_va_prof[wgi][p][ph] = clock64()

    WalkState walk;
    VaItem itm;
    for (long long i = blockIdx.x;; i += gridDim.x, stamp = false) {
        const int next = va_next_item(a, i, walk, sWalk, sNode, &itm);
        if (next <= 0) { if (next == 0) break; continue; }
        const int kb = itm.kb, ke = itm.ke, n_tiles = (ke - kb + 63) / 64;
        const int n_pairs = (n_tiles + 1) / 2;
        if (stamp && tid == 0) g_va_prof_tiles = n_pairs < VA_PROF_TILES ? n_pairs : VA_PROF_TILES;
        const int32_t *table = itm.table;
        int bad = 0;
        /* Q by cp.async (zeros past the stream's rows); the first two tiles by TMA */
        va_load_q(a, itm, q_base, [](int r, int c) { return w_slab_offset(r, c); });
        va::cp_async_commit();
        if (issuer && wgi == 0 && n_tiles > 0) ss_tma_slabs(&kv_map, kv0, bars0, ss_tile_row(a, table, kb, bad), 0, W_SLABS);
        if (issuer && wgi == 1 && n_tiles > 1)
            ss_tma_slabs(&kv_map, kv1, bars1, ss_tile_row(a, table, kb + 64, bad), 0, W_SLABS);
        if (tid < ROWS) sR->m[tid] = SS_M_INIT;
        va::cp_async_wait_all();
        wg::fence_proxy_async();
        __syncthreads(); /* Q and the row max are in */

        float o[128]; /* O rows r0 (+8), columns 256 wgi + 8 j + 2 tq (+1) */
#pragma unroll
        for (int e = 0; e < 128; e++) o[e] = 0.f;
        float l[2] = {0.f, 0.f}; /* this warpgroup's row sums (relative to the current max) */
        float sc[32];            /* this warpgroup's score tile, then its P in fp32 */
        /* the first score tile of each warpgroup. Each warpgroup waits for its score products
         * before the next pair: with one still in flight across the loop's back edge, ptxas
         * serializes every wgmma of the kernel (C7518), as FlashMLA's sources also note */
        if ((wgi == 0 && n_tiles > 0) || (wgi == 1 && n_tiles > 1)) {
            const uint32_t kv = wgi ? kv1 : kv0, bars = wgi ? bars1 : bars0;
#pragma unroll 1
            for (int sl = 0; sl < W_SLABS; sl++) ss_scores_slab(sc, q_base, kv, bars, parity, sl, sl == 0);
            parity ^= 1u;
        }
        wg::wait<0>();

#pragma unroll 1
        for (int p = 0; p < n_pairs; p++) {
            const int t0 = kb + 128 * p, t1 = t0 + 64;
            const bool has1 = t1 < ke, next0 = t0 + 128 < ke, next1 = t1 + 128 < ke;
            /* block-table entries of the next pair's tiles, loaded now and used only where their
             * TMA is issued (mid-pair), so the load latency stays off the warp's path */
            int pg0 = 0, pg1 = 0;
            if (issuer) {
                if (next0) pg0 = __ldg(table + (t0 + 128) / a.page_size);
                if (next1) pg1 = __ldg(table + (t1 + 128) / a.page_size);
            }
            SS_STAMP(0);
            if (wgi == 0) {
                /* softmax of S0 against the running max */
                ss_scale_mask<FUSED>(sc, a, itm, sNode, r0, tq, t0);
                float mx[2], ls[2], mn[2], c0[2];
                ss_row_max(sc, mx);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (FUSED) mx[h] *= a.scale_log2;
                    const float old = sR->m[r0 + 8 * h];
                    mn[h] = fmaxf(old, mx[h]);
                    c0[h] = va_ex2(old - mn[h]);
                }
                if (FUSED) ss_scale_o(o, c0[0], c0[1]);
                __syncwarp(); /* the quad's reads of m before its update */
                if (tq == 0)
#pragma unroll
                    for (int h = 0; h < 2; h++) sR->m[r0 + 8 * h] = mn[h], sR->scale0[r0 + 8 * h] = c0[h];
                ss_exp<FUSED>(sc, mn, ls, a.scale_log2);
                l[0] = l[0] * c0[0] + ls[0], l[1] = l[1] * c0[1] + ls[1];
                if (!FUSED && ss_moved(c0)) ss_scale_o(o, c0[0], c0[1]);
                uint32_t pa[4][4];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) wg::s_to_a_frag(sc, kk, pa[kk]);
                if (ke - t0 < 64) ss_zero_tail(kv0_p, ke - t0, 0, 4, SS_BAR_WG0);
                SS_STAMP(1);
                wg::bar_sync(SS_BAR_SCALE0, THREADS);
                /* O_L += P0 V0L */
                wg::fence();
                w_pv_regs(o, pa, kv0, 0);
                wg::commit();
                SS_STAMP(2);
                wg::bar_sync(SS_BAR_SCALE1, THREADS); /* WG1's softmax: scale1, the pair's max, P1 out */
                wg::wait<0>(); /* P0 V0L is in: buffer 0's slabs 0-3 are free */
                if (issuer && next0) ss_tma_slabs(&kv_map, kv0, bars0, ss_page_row(a, pg0, t0 + 128, bad), 0, 4);
                float s1[2];
#pragma unroll
                for (int h = 0; h < 2; h++) s1[h] = sR->scale1[r0 + 8 * h];
                /* O_L, l and P0 to the pair's max (scale1 is 1 without K1: WG1's max did not
                 * move); P0' (bf16) into buffer 0's rope slab for WG1's P0' V0R. Before P1 V1L
                 * is issued: rewriting pa under a product in flight made ptxas serialize (C7520) */
                l[0] *= s1[0], l[1] *= s1[1];
                if (ss_moved(s1)) {
                    ss_scale_o(o, s1[0], s1[1]);
#pragma unroll
                    for (int e = 0; e < 32; e++) sc[e] *= s1[(e >> 1) & 1];
                }
#pragma unroll
                for (int kk = 0; kk < 4; kk++) wg::s_to_a_frag(sc, kk, pa[kk]);
                ss_store_p(kv0_p + 8 * W_SLAB, pa, r0, tq);
                wg::fence_proxy_async();
                if (has1) {
                    /* O_L += P1 V1L, P1 from buffer 1's rope slab: first in the tensor pipe after
                     * SCALE1, so buffer 1's slabs 0-3 and 8 are refilled early */
                    if (ke - t1 < 64) ss_zero_tail(kv1_p, ke - t1, 0, 4, SS_BAR_WG0);
                    wg::fence();
                    w_pv_slab(o, kv1, 0);
                    wg::commit();
                }
                SS_STAMP(3);
                wg::bar_sync(SS_BAR_P0, THREADS);
                SS_STAMP(4);
                wg::wait<0>(); /* P1 V1L is in: buffer 1's slabs 0-3 and 8 are free */
                if (next0) {
                    if (issuer && next1) {
                        const int y1 = ss_page_row(a, pg1, t1 + 128, bad);
                        ss_tma_slabs(&kv_map, kv1, bars1, y1, 0, 4);
                        ss_tma_slabs(&kv_map, kv1, bars1, y1, 8, 9);
                    }
                    /* S0' of the next pair: slabs 0-3 issued after P0 V0L, 4-8 by WG1 after P0' V0R */
#pragma unroll 1
                    for (int sl = 0; sl < W_SLABS; sl++) ss_scores_slab(sc, q_base, kv0, bars0, parity, sl, sl == 0);
                    parity ^= 1u;
                }
                wg::wait<0>();
                SS_STAMP(5);
            } else {
                wg::bar_sync(SS_BAR_SCALE0, THREADS); /* WG0's max and scale0 */
                SS_STAMP(1);
                /* softmax of S1 against WG0's max (an empty tile without K1); P1 into buffer 1's
                 * rope slab for WG0 */
                float mx[2] = {-INFINITY, -INFINITY}, ls[2] = {0.f, 0.f}, mn[2], s1[2], c[2];
                if (has1) {
                    ss_scale_mask<FUSED>(sc, a, itm, sNode, r0, tq, t1);
                    ss_row_max(sc, mx);
                }
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (FUSED) mx[h] *= a.scale_log2; /* -inf stays -inf (scale > 0) */
                    const float old = sR->m[r0 + 8 * h];
                    mn[h] = fmaxf(old, mx[h]);
                    s1[h] = va_ex2(old - mn[h]);
                    c[h] = s1[h] * sR->scale0[r0 + 8 * h];
                }
                if (FUSED) ss_scale_o(o, c[0], c[1]);
                __syncwarp();
                if (tq == 0)
#pragma unroll
                    for (int h = 0; h < 2; h++) sR->m[r0 + 8 * h] = mn[h], sR->scale1[r0 + 8 * h] = s1[h];
                uint32_t pa[4][4];
                if (has1) {
                    ss_exp<FUSED>(sc, mn, ls, a.scale_log2);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) wg::s_to_a_frag(sc, kk, pa[kk]);
                    ss_store_p(kv1_p + 8 * W_SLAB, pa, r0, tq);
                    wg::fence_proxy_async();
                    if (ke - t1 < 64) ss_zero_tail(kv1_p, ke - t1, 4, 8, SS_BAR_WG1);
                }
                l[0] = l[0] * c[0] + ls[0], l[1] = l[1] * c[1] + ls[1];
                if (!FUSED && ss_moved(c)) ss_scale_o(o, c[0], c[1]);
                SS_STAMP(2);
                wg::bar_sync(SS_BAR_SCALE1, THREADS);
                if (ke - t0 < 64) ss_zero_tail(kv0_p, ke - t0, 4, 8, SS_BAR_WG1);
                SS_STAMP(3);
                wg::bar_sync(SS_BAR_P0, THREADS); /* P0' written */
                /* O_R += P0' V0R, then O_R += P1 V1R: P0' V0R first, so buffer 0's slabs 4-8 are
                 * refilled a product earlier (S0' needs them before S1' needs buffer 1's 4-7) */
                if (has1) {
                    wg::fence();
                    w_pv_slab(o, kv0, 1);
                    wg::commit();
                    w_pv_regs(o, pa, kv1, 1);
                    wg::commit();
                } else {
                    wg::fence();
                    w_pv_slab(o, kv0, 1);
                    wg::commit();
                }
                /* with K1 the P1 V1R group is behind it, so this waits for P0' V0R; without K1
                 * there is no next pair and nothing is issued here */
                wg::wait<1>();
                if (issuer && next0) ss_tma_slabs(&kv_map, kv0, bars0, ss_page_row(a, pg0, t0 + 128, bad), 4, W_SLABS);
                wg::wait<0>(); /* P1 V1R is in: buffer 1's slabs 4-7 are free */
                if (issuer && next1) ss_tma_slabs(&kv_map, kv1, bars1, ss_page_row(a, pg1, t1 + 128, bad), 4, 8);
                SS_STAMP(4);
                if (next1) {
                    /* S1' of the next pair: slabs 0-3 and 8 (issued by WG0 after P1 V1L), then 4-7 */
#pragma unroll 1
                    for (int sl = 0; sl < 4; sl++) ss_scores_slab(sc, q_base, kv1, bars1, parity, sl, sl == 0);
                    ss_scores_slab(sc, q_base, kv1, bars1, parity, 8, false);
#pragma unroll 1
                    for (int sl = 4; sl < 8; sl++) ss_scores_slab(sc, q_base, kv1, bars1, parity, sl, false);
                    parity ^= 1u;
                }
                wg::wait<0>(); /* S1' is in (outside the branch: see above) */
                SS_STAMP(5);
            }
        }

        /* the finished rows: l of both warpgroups, 1 / l and lse by WG0, then each half of O */
#pragma unroll
        for (int h = 0; h < 2; h++) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
        if (wgi == 1 && tq == 0) sR->l1[r0] = l[0], sR->l1[r0 + 8] = l[1];
        const int any_bad = __syncthreads_or(bad);
        if (wgi == 0) {
            const float m[2] = {sR->m[r0], sR->m[r0 + 8]}, lt[2] = {l[0] + sR->l1[r0], l[1] + sR->l1[r0 + 8]};
            w_finish_rows(a, itm, m, lt, any_bad, r0, tq, sR->inv, sR->zero);
        }
        __syncthreads(); /* inv / zero written */
        w_store_half(a, itm, o, sR->inv, sR->zero, r0, wgi, tq);
    }
#undef SS_STAMP
#else
    (void)a, (void)kv_map;
    __trap(); /* no wgmma in this build: the launcher never starts it (sm90_ready checks the PTX arch) */
#endif
}

#endif
