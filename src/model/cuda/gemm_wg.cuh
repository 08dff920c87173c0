/* gemm_wg.cuh - the dense and grouped (MoE) GEMMs for many rows (prefill chunks) on Hopper's
 * warpgroup MMA (sm_90a).
 * Included by gpu_gemm.cu, whose header states the arithmetic every GEMM variant must keep; this
 * one keeps it, so it gives v1 / v2 / v3's bits and the launcher may take it for any launch:
 *   an output (m, n) is the fp32 chain from +0 of, per 64-wide K block of its split ascending and
 *   kk = 0..3, the k16 product of bf16_rn(x) (hi), then of bf16_rn(x - hi) (lo), with W row n.
 * wgmma m64n128k16 adds each k16 product to its accumulator as mma.sync m16n8k16 does (the same
 * k16 steps from the same zeros give the same bits: tests/gpu/test_wgmma_sm90.cu for the attention's
 * m64n32k16; tests/gpu/test_gemm_ab_gpu.cu compares this kernel with v1 bitwise).
 *
 * Why: the v2 kernels are built for a decode's few rows: 64 output columns per CTA, W read once per
 * 64 rows, mma.sync on 4 warps. A prefill chunk of 256-2,048 rows makes the dense projections
 * compute-bound, and there v2 ran at ~55 TFLOP/s on an H200 (session 45's step profile: o_proj's
 * 240 GFLOP in 4.3 ms at 2,048 rows).
 *
 * CTA: 128 rows (two warpgroups of 64) x 128 output columns, 8 warps. K in 64-wide blocks through a
 * cp.async ring of STAGES stages: W [128 rows][64] bf16 as one 128-byte-swizzled slab (wgmma's B,
 * K-major; row-major W is swizzled on the way in, tiled W (kdt_gemm_tile64: Kimi's shared expert)
 * already is that slab and is copied verbatim) and X [128 rows][64] fp32 (row stride XS, as v1's).
 * Each warp splits its 16 rows' X into hi / lo A fragments in registers, then issues 8 wgmma (4
 * k16 steps x hi, lo) on its warpgroup's 64 x 128 accumulator. Grid: (column tiles, K splits, batch x row tiles); a CTA whose rows start
 * past the device's row count returns. Launched without programmatic dependence (it waits for
 * its predecessors by the stream's order and lets its successors start at its end).
 *
 * Only sm_90a device code has wgmma (KDT_HAS_WGMMA); unless switched off, kdt_gemm_init asks the
 * device which code it runs (wg_probe) and the launcher takes this kernel only where it is real.
 * Taken for launches of at least KDT_GEMM_WG_MIN rows (default 128, 64 for the ss forms below;
 * KDT_GEMM_WG=0 turns them off).
 * First run in session 46 (H100): bitwise v1's on every case of gpu_test_gemm_ab, 120-180 TFLOP/s
 * on Kimi's prefill projections (v2: 53-80); a 2,048-token Kimi layer 37.3 -> 19.7 ms. */
#ifndef KDT_GEMM_WG_CUH
#define KDT_GEMM_WG_CUH

/* (inside gpu_gemm.cu's anonymous namespace, after clamp_m; wgmma_sm90.cuh is included at its top) */
namespace wgg {

constexpr int BM = 128, BN = 128, THREADS = 256, STAGES = 4;
constexpr int XS = BK + 8;                        /* floats per X row: conflict-free float2 fragment loads */
constexpr int W_BYTES = BN * BK * 2;              /* 16 KB: one slab */
constexpr int X_BYTES = BM * XS * 4;              /* 36,864 */
constexpr int STAGE_BYTES = W_BYTES + X_BYTES;    /* 53,248: a multiple of 1024, so every slab stays aligned */
constexpr int SMEM = STAGES * STAGE_BYTES + 1024; /* + the slack that aligns the ring to 1024 bytes */
constexpr int X_PER_THREAD = BM * (BK / 4) / THREADS; /* 8 chunks of 4 floats */
constexpr int W_PER_THREAD = BN * (BK / 8) / THREADS; /* 4 chunks of 8 bf16 */
static_assert(STAGE_BYTES % 1024 == 0 && X_PER_THREAD == 8 && W_PER_THREAD == 4, "wg GEMM layout");
/* the slab map the loaders use (gemm_tiles.cuh, checked on the CPU) is the one the descriptors read */
constexpr bool slab_maps_agree() {
    for (int r = 0; r < BN; r++)
        for (int c = 0; c < 8; c++)
            if ((uint32_t)gt_wg_slab_byte(r, c) != wg::sw128_offset(r, 8 * c)) return false;
    return true;
}
static_assert(slab_maps_agree(), "gt_wg_slab_byte == wg::sw128_offset");

/* m64n128k16 with d (64 f32) always accumulated: A from registers (rs: 4 x bf16x2 fragments) or from
 * shared memory (ss: a descriptor), B from shared memory (K-major descriptor). One operand list. */
#define KDT_WGG_MMA "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "                  \
                    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                  \
                    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"         \
                    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"         \
                    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
#define KDT_WGG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                      "+f"(d[i + 6]), "+f"(d[i + 7])
#define KDT_WGG_D64 KDT_WGG_D8(0), KDT_WGG_D8(8), KDT_WGG_D8(16), KDT_WGG_D8(24), KDT_WGG_D8(32), KDT_WGG_D8(40), \
                    KDT_WGG_D8(48), KDT_WGG_D8(56)
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
#if KDT_HAS_WGMMA
    asm volatile("{\n" KDT_WGG_MMA "{%64,%65,%66,%67}, %68, 1, 1, 1, 0;\n}\n"
                 : KDT_WGG_D64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
#else
    (void)d, (void)a, (void)db;
#endif
}
__device__ __forceinline__ void mma_m64n128k16_ss(float (&d)[64], uint64_t da, uint64_t db) {
#if KDT_HAS_WGMMA
    asm volatile("{\n" KDT_WGG_MMA "%64, %65, 1, 1, 1, 0, 0;\n}\n" : KDT_WGG_D64 : "l"(da), "l"(db));
#else
    (void)d, (void)da, (void)db;
#endif
}
#undef KDT_WGG_D64
#undef KDT_WGG_D8
#undef KDT_WGG_MMA

/* 1 in a device pass that has wgmma: what kdt_gemm_init reads back (wg_ready) */
__global__ void wg_probe(int *out) { *out = KDT_HAS_WGMMA; }

#if KDT_HAS_WGMMA
/* One stage's X chunks: tile rows (tid >> 4) + STEP i (this thread's xrow[i], NULL past the rows),
 * columns kc + 4 (tid & 15) .. (load_x4: zeros past kx and past the rows, which feed only their
 * own outputs, which nobody stores). */
template <int NX, int STEP>
__device__ __forceinline__ void load_x(float *xs, const float *const (&xrow)[NX], const bool (&xal)[NX], int kc,
                                       int kx) {
    const int xch = threadIdx.x & 15, k = kc + xch * 4;
#pragma unroll
    for (int i = 0; i < NX; i++) load_x4(xs + ((threadIdx.x >> 4) + STEP * i) * XS + xch * 4, xrow[i], k, kx, xal[i]);
}

/* The K loop of one output tile: nk blocks through a ring of NST stages of STB bytes (W slab, then
 * X), load(s, kb) filling stage s with block kb. Per block each warp splits its 16 X rows (16 warp
 * of the tile) into hi / lo A fragments, then its warpgroup issues 4 k16 steps x (hi, lo) onto acc,
 * from +0: the chain of gpu_gemm.cu's header. A warpgroup with mma_on false (all its rows past
 * the launch's: a dense tile of <= 64 rows) only loads and keeps its zeros, which nobody stores;
 * the flag is uniform over the warpgroup, as wgmma needs. */
template <int NST, int STB, class Load>
__device__ __forceinline__ void k_loop(unsigned char *ring, int nk, Load load, float (&acc)[64], bool mma_on) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, rb = warp * 16;
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < NST - 1; s++) {
        if (s < nk) load(s, s);
        cp_async_commit();
    }
    for (int kb = 0; kb < nk; kb++) {
        cp_async_wait<NST - 2>();
        wg::fence_proxy_async(); /* this thread's cp.async writes, for wgmma's async proxy */
        __syncthreads();         /* block kb is in; block kb - 1's stage has no reader left */
        const int nxt = kb + NST - 1;
        if (nxt < nk) load(nxt % NST, nxt);
        cp_async_commit();
        if (!mma_on) continue;
        const unsigned char *st = ring + (kb % NST) * STB;
        const float *xs = reinterpret_cast<const float *>(st + W_BYTES);
        uint32_t hi[4][4], lo[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const float *xp = xs + (rb + g) * XS + kk * 16 + 2 * c;
            split_bf16(*reinterpret_cast<const float2 *>(xp), hi[kk][0], lo[kk][0]);
            split_bf16(*reinterpret_cast<const float2 *>(xp + 8 * XS), hi[kk][1], lo[kk][1]);
            split_bf16(*reinterpret_cast<const float2 *>(xp + 8), hi[kk][2], lo[kk][2]);
            split_bf16(*reinterpret_cast<const float2 *>(xp + 8 * XS + 8), hi[kk][3], lo[kk][3]);
        }
        const uint32_t wbase = smem_u32(st);
        wg::fence(); /* the A fragments and the accumulators were written by ordinary instructions */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint64_t db = wg::desc_sw128(wbase + (uint32_t)kk * 32u, 16u, 1024u);
            mma_m64n128k16_rs(acc, hi[kk], db);
            mma_m64n128k16_rs(acc, lo[kk], db);
        }
        wg::commit();
        wg::wait<0>();
    }
    cp_async_wait<0>();
}

/* A tile's accumulators to y (tile row r at y + r ldy), rows < m_valid, columns < n_valid (the
 * accumulator map: gt_wg_acc_row / gt_wg_acc_col). */
__device__ __forceinline__ void store_tile(const float (&acc)[64], float *y, int64_t ldy, int m_valid, int n_valid,
                                           int warp = threadIdx.x >> 5) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < 64; i++) {
        const int r = gt_wg_acc_row(warp, lane, i), col = gt_wg_acc_col(lane, i);
        if (r < m_valid && col < n_valid) y[(int64_t)r * ldy + col] = acc[i];
    }
}

/* One stage's W: NT threads, NCH 16-byte chunks each, copy the NT NCH / 8 rows of W from w (the
 * tile's first output row; ld columns) for K block kb (counted from the matrix's column 0) into
 * the slab(s) at st: tiled (kdt_gemm_tile64's 64 x 64 blocks already are swizzled slabs: copied
 * verbatim, 8 KB each, blocks past n_valid's rows zero-filled) or row-major (chunk (r, ch) to
 * gt_wg_slab_byte(r, ch), rows past n_valid zero-filled). */
template <int NCH, int NT>
__device__ __forceinline__ void load_w(unsigned char *st, const uint16_t *w, int ld, int kb, int n_valid, bool tiled) {
    const int tid = threadIdx.x;
    if (tiled) {
#pragma unroll
        for (int i = 0; i < NCH; i++) {
            const int d = 16 * (tid + NT * i); /* slab byte: block d >> 13 */
            const bool ok = 64 * (d >> 13) < n_valid;
            cp_async16(st + d, ok ? w + gt_wg_tiled_src(d, kb, ld) : w, ok ? 16 : 0);
        }
    } else {
#pragma unroll
        for (int i = 0; i < NCH; i++) {
            const int q = tid + NT * i, r = q >> 3, ch = q & 7;
            const bool ok = r < n_valid;
            cp_async16(st + gt_wg_slab_byte(r, ch), ok ? w + (int64_t)r * ld + kb * BK + ch * 8 : w, ok ? 16 : 0);
        }
    }
}

/* The fused SwiGLU of a warpgroup's 64 x 128 accumulator (warp wq of it): h = SwiGLU(gate, up) for
 * the item's rows < rows, h columns from n0 / 2 below inter, 64-column blocks below n_valid
 * (maps in gemm_tiles.cuh: a thread holds a gate and its up). */
__device__ __forceinline__ void store_swiglu(const float (&acc)[64], float *h, int64_t ldh, int rows, int n0,
                                             int n_valid, int inter, int wq) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int r = gt_wg_acc_row(wq, lane, 2 * hh);
        if (r >= rows) continue;
        float *hr = h + (int64_t)r * ldh + n0 / 2;
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    const int col = gt_wg_h_col(lane, q, j, e2);
                    if (64 * q < n_valid && n0 / 2 + col < inter)
                        hr[col] = kdt_g_swiglu(acc[gt_wg_gate_elem(q, j, hh, e2)], acc[gt_wg_up_elem(q, j, hh, e2)]);
                }
    }
}
#endif

/* A dense launch's tile of this CTA: grid (column tiles, K splits, batch x row tiles). valid is
 * false where the tile's rows start past the device's row count (the CTA returns). */
struct DenseTile {
    int b, m0, n0, split, m_valid, n_valid, k_begin, nk;
    bool valid;
};
__device__ __forceinline__ DenseTile dense_tile(const kdt_gemm_args &a) {
    DenseTile t;
    const int M = clamp_m(a.m_dev, a.m_max), mtiles = (a.m_max + BM - 1) / BM;
    t.b = blockIdx.z / mtiles;
    t.m0 = (blockIdx.z % mtiles) * BM;
    t.n0 = blockIdx.x * BN;
    t.split = blockIdx.y;
    t.valid = t.m0 < M;
    t.m_valid = min(BM, M - t.m0);
    t.n_valid = min(BN, a.n - t.n0);
    t.k_begin = t.split * a.k_chunk;
    t.nk = (min(t.k_begin + a.k_chunk, a.ldw) - t.k_begin) / BK;
    return t;
}
/* the dynamic shared memory from its first 1024-byte boundary (swizzled slabs need it) */
__device__ __forceinline__ unsigned char *ring_base(unsigned char *smem) {
    return smem + ((1024 - (smem_u32(smem) & 1023)) & 1023);
}

__global__ void __launch_bounds__(THREADS, 1) wg_gemm_kernel(const kdt_gemm_args a) {
#if KDT_HAS_WGMMA
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *ring = ring_base(smem_raw);
    const DenseTile t = dense_tile(a);
    if (!t.valid) return;
    const int b = t.b, m0 = t.m0, n0 = t.n0, split = t.split, n_valid = t.n_valid, m_valid = t.m_valid;
    const int k_begin = t.k_begin, nk = t.nk;
    const int tid = threadIdx.x;
    const uint16_t *w = a.w + (int64_t)b * a.w_batch + (int64_t)n0 * a.ldw;
    const float *x = a.x + (int64_t)b * a.x_batch;

    /* this thread's X rows (tid >> 4) + 16 i of the tile, NULL past the row count */
    const float *xrow[X_PER_THREAD];
    bool xal[X_PER_THREAD];
#pragma unroll
    for (int i = 0; i < X_PER_THREAD; i++) {
        const int r = (tid >> 4) + 16 * i;
        const int m = m0 + r;
        xrow[i] = r < m_valid ? x + (int64_t)(a.x_rows ? a.x_rows[m] : m) * a.ldx : nullptr;
        xal[i] = ((uintptr_t)xrow[i] & 15) == 0;
    }
    auto load_stage = [&](int s, int kb) {
        unsigned char *st = ring + s * STAGE_BYTES;
        const int kc = k_begin + kb * BK;
        load_w<W_PER_THREAD, THREADS>(st, w, a.ldw, kc / BK, n_valid, a.tiled);
        load_x<X_PER_THREAD, 16>(reinterpret_cast<float *>(st + W_BYTES), xrow, xal, kc, a.kx);
    };
    float acc[64];
    k_loop<STAGES, STAGE_BYTES>(ring, nk, load_stage, acc, (tid >> 7) * 64 < m_valid);
    store_tile(acc, a.y + (int64_t)split * a.y_split + (int64_t)b * a.y_batch + (int64_t)m0 * a.ldy + n0, a.ldy,
               m_valid, n_valid);
#else
    (void)a; /* never launched: wg_ready() is 0 in a pass without wgmma */
#endif
}


/* ---- the grouped (MoE) form -------------------------------------------------------------------
 * One warpgroup per CTA: an item (one expert's pairs, <= 64 rows: KDT_G_BM) x 128 output columns
 * of that expert, items strided over gridDim.y as v2_grouped_kernel walks them. Gate/up (which 0):
 * X rows gathered through pair_row, K = D, N = 2 i_pad (per 64 rows: 32 gate, then 32 up rows);
 * down (which 1): X = h in pair order, K = I, N = D. W tiled (kdt_gemm_tile64: each 64 x 64 block is
 * already the 128-byte-swizzled slab, 8 KB, copied verbatim) or row-major (swizzled on the way
 * in). The fused SwiGLU (a.h) needs no shared memory here: a thread's accumulator holds column c
 * and c + 32 of each 64-column block, i.e. a gate and its up. 3 stages of 34 KB: 2 CTAs per SM. */
constexpr int G_BM = 64, G_THREADS = 128, G_STAGES = 3;
constexpr int G_X_BYTES = G_BM * XS * 4;                 /* 18,432 */
constexpr int G_STAGE_BYTES = W_BYTES + G_X_BYTES;       /* 34,816: a multiple of 1024 */
constexpr int G_SMEM = G_STAGES * G_STAGE_BYTES + 1024;
constexpr int G_X_PER_THREAD = G_BM * (BK / 4) / G_THREADS; /* 8 */
constexpr int G_W_PER_THREAD = BN * (BK / 8) / G_THREADS;   /* 8 */
static_assert(G_STAGE_BYTES % 1024 == 0 && G_X_PER_THREAD == 8 && G_W_PER_THREAD == 8, "wg grouped layout");
static_assert(G_BM == KDT_G_BM, "one pass per plan item");

/* Item `it` of a grouped launch against the bn output columns from n0: its expert, first pair p0,
 * rows (<= G_BM), W (tiled too: block row n0 / 64) and its ld, the columns that exist and the K
 * blocks. valid is false where the item has no rows or its expert no columns from n0 (the same
 * for every thread of the CTA, which then skips the item). */
struct GroupItem {
    kdt_gpu_expert ex;
    const uint16_t *w;
    int p0, rows, ldw, n_valid, nk;
    bool valid;
};
__device__ __forceinline__ GroupItem group_item(const kdt_grouped_args &a, int it, int n0, int bn) {
    GroupItem g;
    g.ex = a.experts[a.items[3 * it]];
    g.p0 = a.items[3 * it + 1];
    g.rows = min(a.items[3 * it + 2], G_BM);
    const int N = a.which == 0 ? 2 * g.ex.i_pad : a.kd;
    g.valid = n0 < N && g.rows > 0;
    g.ldw = a.which == 0 ? g.ex.ld_d : g.ex.ld_i;
    g.w = (a.which == 0 ? g.ex.gu : g.ex.down) + (int64_t)n0 * g.ldw;
    g.n_valid = min(bn, N - n0);
    g.nk = g.ldw / BK;
    return g;
}

__global__ void __launch_bounds__(G_THREADS, 2) wg_grouped_kernel(const kdt_grouped_args a) {
#if KDT_HAS_WGMMA
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *ring = ring_base(smem_raw);
    const int n0 = blockIdx.x * BN;
    const int n_items = *a.n_items;
    const int tid = threadIdx.x;
    for (int it = blockIdx.y; it < n_items; it += gridDim.y) {
        const GroupItem g = group_item(a, it, n0, BN);
        if (!g.valid) continue;
        const int p0 = g.p0, rows = g.rows, kx = a.which == 0 ? a.kd : g.ex.inter;
        const float *xrow[G_X_PER_THREAD];
        bool xal[G_X_PER_THREAD];
#pragma unroll
        for (int i = 0; i < G_X_PER_THREAD; i++) {
            const int r = (tid >> 4) + 8 * i;
            xrow[i] = r < rows ? a.x + (int64_t)(a.which == 0 ? a.pair_row[p0 + r] : p0 + r) * a.ldx : nullptr;
            xal[i] = ((uintptr_t)xrow[i] & 15) == 0;
        }
        auto load_stage = [&](int s, int kb) {
            unsigned char *st = ring + s * G_STAGE_BYTES;
            load_w<G_W_PER_THREAD, G_THREADS>(st, g.w, g.ldw, kb, g.n_valid, a.tiled);
            load_x<G_X_PER_THREAD, 8>(reinterpret_cast<float *>(st + W_BYTES), xrow, xal, kb * BK, kx);
        };
        float acc[64];
        k_loop<G_STAGES, G_STAGE_BYTES>(ring, g.nk, load_stage, acc, true);
        __syncthreads(); /* every warp is past the last stage before the next item's loads */
        if (a.h) store_swiglu(acc, a.h + (int64_t)p0 * a.ldh, a.ldh, rows, n0, g.n_valid, g.ex.inter, tid >> 5);
        else store_tile(acc, a.y + (int64_t)p0 * a.ldy + n0, a.ldy, rows, g.n_valid);
    }
#else
    (void)a; /* never launched: wg_ready() is 0 in a pass without wgmma */
#endif
}

/* ---- the A-from-shared-memory forms (the default where a workspace is given; KDT_GEMM_WG_SS=0: not)
 * Why: the register-A kernels above wait for each block's wgmma before the next barrier, because
 * their A fragments are registers that ordinary instructions (the hi / lo split) write: ptxas
 * serializes any wgmma pipeline across such writes (C7513). Here X is split once per launch into
 * two bf16 planes in global memory (hi, lo: [rows][ld], zeros past kx; wg_split_kernel,
 * wg_split_pairs_kernel), which the K loop loads like W, as 128-byte-swizzled slabs, and wgmma
 * reads A from shared memory: no register operands, so one block's wgmma stay in flight across the
 * barrier (wait<1>) and a warpgroup's issue overlaps its previous products. The products and
 * their order are the register kernels' (the same bf16 hi / lo values, the same k16 steps, hi
 * then lo), so are the bits. Every warpgroup issues its products even where its rows or columns
 * are all empty (zeros, never stored): a skip would put the wgmma in a divergent path, and ptxas
 * then serializes the pipeline (C7518). First run in session 47 (H100): bitwise v1's (574 / 574
 * of gpu_test_gemm_ab), memcheck clean; Kimi's dense projections with the split pass included
 * 1.04-1.17x the register kernel at 65..2,048 rows (o_proj at 2,048 rows 1,407 -> 1,249 us), so
 * they became the default where the runner gives a workspace, from 64 rows. */
constexpr int SS_STAGES = 4;
constexpr int A_BYTES = BM * BK * 2;                     /* one plane of 128 rows x 64 bf16: 16 KB */
constexpr int S_STAGE_BYTES = W_BYTES + 2 * A_BYTES;     /* dense: W slab + A hi + A lo, 49,152 */
constexpr int S_SMEM = SS_STAGES * S_STAGE_BYTES + 1024; /* 197,632 */
constexpr int S_A_PER_THREAD = 2 * BM * (BK / 8) / THREADS; /* 8 chunks of 8 bf16 */
constexpr int GS_BN = 256;                                  /* grouped: two warpgroups x 128 columns */
constexpr int GS_W_BYTES = GS_BN * BK * 2;                  /* 32 KB: two 128-row slabs */
constexpr int GS_A_BYTES = G_BM * BK * 2;                   /* 8 KB: one plane of 64 rows */
constexpr int GS_STAGE_BYTES = GS_W_BYTES + 2 * GS_A_BYTES; /* 49,152 */
constexpr int GS_SMEM = SS_STAGES * GS_STAGE_BYTES + 1024;
constexpr int GS_W_PER_THREAD = GS_BN * (BK / 8) / THREADS;    /* 8 */
constexpr int GS_A_PER_THREAD = 2 * G_BM * (BK / 8) / THREADS; /* 4 */
static_assert(S_STAGE_BYTES % 1024 == 0 && GS_STAGE_BYTES % 1024 == 0 && S_A_PER_THREAD == 8 &&
                  GS_W_PER_THREAD == 8 && GS_A_PER_THREAD == 4, "wg ss layouts");

/* Columns k0..k0+7 of X row xr (zeros from kx on) as bf16 hi and lo (split_bf16, as every GEMM
 * variant splits) into the planes at hi and lo */
__device__ __forceinline__ void split8(const float *xr, int k0, int kx, uint16_t *hi, uint16_t *lo) {
    uint32_t h[4], l[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int k = k0 + 2 * j;
        split_bf16(make_float2(k < kx ? xr[k] : 0.0f, k + 1 < kx ? xr[k + 1] : 0.0f), h[j], l[j]);
    }
    *reinterpret_cast<uint4 *>(hi) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4 *>(lo) = make_uint4(l[0], l[1], l[2], l[3]);
}

/* A grouped launch of two kernels (kdt_grouped_args::ss_min_rows > 0): whether the plan (device
 * counts: items, pairs) takes the ss kernel, whose CTAs pay for 64-row items, or v2. */
__device__ __forceinline__ bool ss_takes(const int32_t *counts, int min_rows) {
    return counts[1] >= min_rows * counts[0];
}

/* X (a's rows: gathered through x_rows, rows < *m_dev) into hl's planes [m_max][ld], plane
 * elements apart; one thread per 8 columns of a row. Rows past the device's count are not written
 * (no GEMM loads them). Not for batched launches. gate (a grouped two-kernel launch's counts, or
 * NULL): nothing to do when its plan takes v2. */
__global__ void wg_split_kernel(const kdt_gemm_args a, uint16_t *hl, int64_t plane, int ld,
                                const int32_t *gate = nullptr, int gate_rows = 0) {
    if (gate && !ss_takes(gate, gate_rows)) return;
    const int M = clamp_m(a.m_dev, a.m_max), cpr = ld / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)M * cpr) return;
    const int m = (int)(i / cpr), k0 = (int)(i % cpr) * 8;
    const int64_t o = (int64_t)m * ld + k0;
    split8(a.x + (int64_t)(a.x_rows ? a.x_rows[m] : m) * a.ldx, k0, a.kx, hl + o, hl + plane + o);
}

/* h's pair rows (< the device's pair count, a.n_items[1]) into hl's planes [max pairs][ld], row p
 * zero past experts[pair_expert[p]].inter (the register kernel's load_x4 zeroes per item) */
__global__ void wg_split_pairs_kernel(const kdt_grouped_args a, const int32_t *pair_expert, int max_pairs,
                                      uint16_t *hl, int64_t plane, int ld) {
    if (a.ss_min_rows > 0 && !ss_takes(a.n_items, a.ss_min_rows)) return;
    const int P = min(a.n_items[1], max_pairs), cpr = ld / 8;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)P * cpr) return;
    const int p = (int)(i / cpr), k0 = (int)(i % cpr) * 8;
    const int64_t o = (int64_t)p * ld + k0;
    split8(a.x + (int64_t)p * a.ldx, k0, a.experts[pair_expert[p]].inter, hl + o, hl + plane + o);
}

#if KDT_HAS_WGMMA
/* The pipelined K loop: nk blocks through SS_STAGES stages of STB bytes, 2 loaded ahead, load(s, kb)
 * filling stage s. A warpgroup's B slab sits w_off bytes into a stage, its A hi plane a_off bytes
 * in and the lo plane a_bytes after it. Before the barrier of block kb each warpgroup waits for
 * its products of block kb - 2 (wait<1>), whose stage the load after the barrier overwrites. */
template <int STB, class Load>
__device__ __forceinline__ void ss_k_loop(unsigned char *ring, int nk, Load load, float (&acc)[64], uint32_t w_off,
                                          uint32_t a_off, uint32_t a_bytes) {
    constexpr int AHEAD = SS_STAGES - 2;
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < AHEAD; s++) {
        if (s < nk) load(s, s);
        cp_async_commit();
    }
    for (int kb = 0; kb < nk; kb++) {
        cp_async_wait<AHEAD - 1>();
        wg::fence_proxy_async(); /* this thread's cp.async writes, for wgmma's async proxy */
        wg::wait<1>();           /* block kb - 2's products are done: its stage is free */
        __syncthreads();         /* block kb is in; no warpgroup reads block kb - 2's stage */
        const int nxt = kb + AHEAD;
        if (nxt < nk) load(nxt % SS_STAGES, nxt);
        cp_async_commit();
        const uint32_t st = smem_u32(ring + (kb % SS_STAGES) * STB);
        const uint32_t wb = st + w_off, ahi = st + a_off, alo = ahi + a_bytes;
        wg::fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint64_t db = wg::desc_sw128(wb + (uint32_t)kk * 32u, 16u, 1024u);
            mma_m64n128k16_ss(acc, wg::desc_sw128(ahi + (uint32_t)kk * 32u, 16u, 1024u), db);
            mma_m64n128k16_ss(acc, wg::desc_sw128(alo + (uint32_t)kk * 32u, 16u, 1024u), db);
        }
        wg::commit();
    }
    wg::wait<0>();
#pragma unroll
    for (int i = 0; i < 64; i += 16) wg::fence_operands16(acc + i); /* read after the last wait */
    cp_async_wait<0>();
}
#endif

/* One stage's A chunks: chunk i of this thread (q = tid + THREADS i) is plane q / (8 ROWS) (hi, lo;
 * a_bytes apart from sa), tile row (q >> 3) % ROWS, 16-byte chunk q & 7, read from src[i] + k
 * (NULL: zeros, from the valid address zero) into the 128-byte-swizzled slab row. */
template <int NA, int ROWS>
__device__ __forceinline__ void load_a(unsigned char *sa, int a_bytes, const uint16_t *const (&src)[NA], int64_t k,
                                       const uint16_t *zero) {
#pragma unroll
    for (int i = 0; i < NA; i++) {
        const int q = threadIdx.x + THREADS * i, r = (q >> 3) & (ROWS - 1), ch = q & 7;
        cp_async16(sa + (q / (8 * ROWS)) * a_bytes + gt_wg_slab_byte(r, ch), src[i] ? src[i] + k + ch * 8 : zero,
                   src[i] ? 16 : 0);
    }
}

/* Dense: 128 x 128 tiles as wg_gemm_kernel's; stage = W slab + A hi + A lo (128 rows each). */
__global__ void __launch_bounds__(THREADS, 1) wg_gemm_ss_kernel(const kdt_gemm_args a, const uint16_t *hl,
                                                                 int64_t plane, int ld) {
#if KDT_HAS_WGMMA
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *ring = ring_base(smem_raw);
    const DenseTile t = dense_tile(a); /* one batch: b is 0 */
    if (!t.valid) return;
    const int m0 = t.m0, n0 = t.n0, n_valid = t.n_valid, m_valid = t.m_valid, k_begin = t.k_begin;
    const int tid = threadIdx.x;
    const uint16_t *w = a.w + (int64_t)n0 * a.ldw;
    const uint16_t *arow[S_A_PER_THREAD]; /* this thread's A chunks: plane q >> 10, row (q >> 3) & 127 */
#pragma unroll
    for (int i = 0; i < S_A_PER_THREAD; i++) {
        const int q = tid + THREADS * i, r = (q >> 3) & (BM - 1);
        arow[i] = r < m_valid ? hl + (q >> 10) * plane + (int64_t)(m0 + r) * ld : nullptr;
    }
    auto load_stage = [&](int s, int kb) {
        unsigned char *st = ring + s * S_STAGE_BYTES;
        const int kc = k_begin + kb * BK;
        load_w<W_PER_THREAD, THREADS>(st, w, a.ldw, kc / BK, n_valid, a.tiled);
        load_a<S_A_PER_THREAD, BM>(st + W_BYTES, A_BYTES, arow, kc, hl);
    };
    float acc[64];
    ss_k_loop<S_STAGE_BYTES>(ring, t.nk, load_stage, acc, 0u, (uint32_t)(W_BYTES + (tid >> 7) * 8192), A_BYTES);
    store_tile(acc, a.y + (int64_t)t.split * a.y_split + (int64_t)m0 * a.ldy + n0, a.ldy, m_valid, n_valid);
#else
    (void)a, (void)hl, (void)plane, (void)ld; /* never launched: wg_ready() is 0 in a pass without wgmma */
#endif
}

/* Grouped: two warpgroups on one item (<= 64 rows) x 256 columns, each 128 of them (its slab 16 KB
 * into the stage), both reading the item's A planes (gate/up: xn's rows through pair_row; down:
 * h's pair rows); 1 CTA per SM; the fused SwiGLU per warpgroup. */
__global__ void __launch_bounds__(THREADS, 1) wg_grouped_ss_kernel(const kdt_grouped_args a, const uint16_t *hl,
                                                                    int64_t plane, int ld) {
#if KDT_HAS_WGMMA
    if (a.ss_min_rows > 0 && !ss_takes(a.n_items, a.ss_min_rows)) return; /* v2 runs this plan */
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char *ring = ring_base(smem_raw);
    const int n0 = blockIdx.x * GS_BN;
    const int n_items = *a.n_items;
    const int tid = threadIdx.x, wgi = tid >> 7;
    for (int it = blockIdx.y; it < n_items; it += gridDim.y) {
        const GroupItem g = group_item(a, it, n0, GS_BN);
        if (!g.valid) continue;
        const int p0 = g.p0, rows = g.rows;
        const uint16_t *arow[GS_A_PER_THREAD]; /* this thread's A chunks: plane q >> 9, row (q >> 3) & 63 */
#pragma unroll
        for (int i = 0; i < GS_A_PER_THREAD; i++) {
            const int q = tid + THREADS * i, r = (q >> 3) & (G_BM - 1);
            arow[i] = r < rows ? hl + (int64_t)(q >> 9) * plane +
                                     (int64_t)(a.which == 0 ? a.pair_row[p0 + r] : p0 + r) * ld
                               : nullptr;
        }
        auto load_stage = [&](int s, int kb) {
            unsigned char *st = ring + s * GS_STAGE_BYTES;
            load_w<GS_W_PER_THREAD, THREADS>(st, g.w, g.ldw, kb, g.n_valid, a.tiled);
            load_a<GS_A_PER_THREAD, G_BM>(st + GS_W_BYTES, GS_A_BYTES, arow, (int64_t)kb * BK, hl);
        };
        float acc[64];
        ss_k_loop<GS_STAGE_BYTES>(ring, g.nk, load_stage, acc, (uint32_t)wgi * 16384u, GS_W_BYTES, GS_A_BYTES);
        __syncthreads(); /* every warpgroup's products are done before the next item's loads */
        const int n0w = n0 + 128 * wgi, nvw = g.n_valid - 128 * wgi;
        if (nvw <= 0) continue;
        if (a.h) store_swiglu(acc, a.h + (int64_t)p0 * a.ldh, a.ldh, rows, n0w, nvw, g.ex.inter, (tid >> 5) & 3);
        else store_tile(acc, a.y + (int64_t)p0 * a.ldy + n0w, a.ldy, rows, nvw, (tid >> 5) & 3);
    }
#else
    (void)a, (void)hl, (void)plane, (void)ld; /* never launched: wg_ready() is 0 in a pass without wgmma */
#endif
}

} // namespace wgg

#endif
