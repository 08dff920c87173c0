/* gpu_attn.cu - the GPU forward's MLA attention in absorbed form over the paged bf16 latent
 * cache: for every row (query token) and head, softmax(scale * [q_lat | q_pe] . [c_kv | k_pe])
 * over the row's visible keys, weighted sum of c_kv -> o_lat [R][H][d_c] (fp32).
 *
 * Batch invariance is the design constraint, so nothing here depends on the batch: a row's
 * visible keys are taken in list order (committed slots 0..n_prefix-1, then its tree ancestors'
 * slots ascending: the same list a decode of that path sees), cut into splits of
 * kdt_attn_split_keys(n_keys) keys and tiles of 32 keys *by list index*, so the tile boundaries,
 * the online-softmax rescaling points and every reduction order are functions of the row alone.
 *
 * attn_partial: one item = (row, split, group of HG heads). Q (HG heads x d_q, bf16) stays in
 * shared memory; 32-key tiles of the cache rows are gathered through the block table with
 * cp.async into a ring of 2 or 3 stages. A CTA walks a contiguous run of items (head-group-major
 * order, so consecutive items are mostly further splits of one row and head group) as one stream
 * of tiles: the loads run stages - 1 tiles ahead across item boundaries, and the next item's Q is
 * fetched (float4 loads, all in flight) as soon as the last tile of an item is done, unless it is
 * the same row and head group, whose Q is already in place. Instances are compiled for d_q 576
 * (DeepSeek-V3 / Kimi) besides the runtime-d_q ones: their k-step loop unrolls whole.
 * Per tile: S = Q K^T on tensor cores, each S element the sum of four k-step chains (chain j
 * covers the j-th quarter of the k16 steps in ascending order; S = (c0 + c1) + (c2 + c3): four
 * short dependent mma chains instead of one long one; the 64-head d_q 576 instance forms the same
 * chains with wgmma on sm_90a, which gives the same bits); an online softmax in fp32 (8 threads
 * per head, 4 keys each, fixed shuffle tree), P as bf16, then O += P V (V = the first d_c
 * columns of the same tile, via ldmatrix.trans). The item writes its unnormalised O, running max
 * (log2 domain) and sum. HG = 16 or 64 heads per item (64: a quarter of the KV re-reads when there are
 * many heads), 8 warps (16 heads: two per score tile, each writing half of its chains to a score
 * plane the softmax adds; 16 for a one-row decode, one chain per warp and four planes; or 4,
 * KDT_GPU_ATT_WARPS); the per-head arithmetic is identical, so these choices never change a bit
 * and are made per launch, as are the stage count and the grid (pure scheduling).
 * attn_combine: per row and head, merges the splits in order. One CTA per (row, chunk of the
 * row's H x d_c outputs) (kdt_g_chunk_cols, so a decode row gets a CTA per half head, not one
 * for all); the chunk's heads' max, sum and split weights are computed once per item and every
 * output element is one fma chain over its splits in order: the same operations, whatever the
 * chunk, and whether a thread walks its outputs one at a time or (items of >= 1,024 outputs) four
 * adjacent ones with one 16-byte load per split.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "attn_plan.h"
#include "gpu_internal.h"
#include "kernels/cuda/device_limits.h"
#include "gpu_mma.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/wgmma_sm90.cuh"

namespace {
using namespace kg;

constexpr int TILE = KDT_G_ATT_TILE;
constexpr int SS = TILE + 1;   /* floats per score row in shared memory */
constexpr int PS = TILE + 8;   /* bf16 per probability row (80 B: conflict-free fragment loads) */
static_assert(KDT_AP_TILE == TILE && KDT_AP_SS == SS && KDT_AP_PS == PS, "attn_plan.h sizes this kernel's tiles");
constexpr int TPR = 8;         /* softmax threads per head row, TILE / TPR keys each */
constexpr int QCH = 4;         /* k-step chains of one S element */
constexpr int MAX_ST = 3;      /* deepest KV ring */

/* Keys per split: 128 (KDT_G_ATT_SPLIT_SHORT) up to KDT_G_ATT_SHORT_KEYS keys; then about 32
 * (KDT_G_ATT_TARGET_SPLITS) splits, a multiple of the tile, while that is at most KDT_G_ATT_SPLIT
 * keys, so a long decode row still gets ~32 CTAs per head group instead of 9..32 serial 512-key
 * splits; then KDT_G_ATT_SPLIT up to 64 splits; then 64 splits. A function of n_keys alone;
 * n_splits <= KDT_G_ATT_MAX_SPLITS. */
__host__ __device__ inline int split_keys(int n_keys) {
    if (n_keys <= KDT_G_ATT_SHORT_KEYS) return KDT_G_ATT_SPLIT_SHORT;
    const int even = ((n_keys + KDT_G_ATT_TARGET_SPLITS - 1) / KDT_G_ATT_TARGET_SPLITS + TILE - 1) / TILE * TILE;
    if (even <= KDT_G_ATT_SPLIT) return even;
    if (n_keys <= 64 * KDT_G_ATT_SPLIT) return KDT_G_ATT_SPLIT;
    const int per = (n_keys + KDT_G_ATT_MAX_SPLITS - 1) / KDT_G_ATT_MAX_SPLITS;
    return (per + TILE - 1) / TILE * TILE;
}
__host__ __device__ inline int n_splits(int n_keys) {
    const int c = split_keys(n_keys);
    return n_keys < 1 ? 1 : (n_keys + c - 1) / c;
}

/* An item's CTA: W warps. S = Q K^T has MT x (TILE / 8) (m-tile, 8-key tile) pairs of QCH
 * k-step chains; with W <= pairs a warp computes PPW whole pairs, with more warps (W = 8 for 16
 * heads) a pair's chains are shared by QCH / CPW warps, each writing its chains' sum to its own
 * score plane, and the softmax adds the planes ((c0 + c1) + (c2 + c3), the single-warp sum).
 * 64 heads (ROWS): a warp takes one m-tile's four pairs for half of the chains, so each k step
 * loads its Q fragment once for all four key tiles (as whole pairs, the four warps of an m-tile,
 * one per key tile, each read all of its Q fragments: ncu put the S phase's ldmatrix and mma at
 * a third of a 65-row verify's attention samples, session 32). P V gives each warp d_c / W
 * columns. Every element's operations are the same for every W and layout, so these are
 * scheduling (per launch), like HG. */
/* Score planes (kdt_ap_planes): 16 heads on 8 warps add two, on 16 warps four, (p0 + p1) +
 * (p2 + p3), the same sum; 64 heads on 8 warps two. Shared memory, strides and the warp count:
 * attn_plan.h. */
template <int HG, int W>
struct AttCfg {
    static constexpr int WARPS = W;
    static constexpr int THREADS = WARPS * 32;
    static constexpr int MT = HG / 16;
    static constexpr int PAIRS = MT * (TILE / 8);
    static constexpr int TPK = THREADS / TILE;              /* loader threads per key */
    static constexpr int PLANES = kdt_ap_planes(HG, W);     /* score planes the softmax adds */
    static constexpr bool ROWS = kdt_ap_rows(HG);           /* a warp owns one m-tile's score rows */
    static constexpr int PPW = ROWS ? TILE / 8 : (PLANES == 1 ? PAIRS / WARPS : 1); /* pairs per warp */
    static constexpr int CPW = QCH / PLANES;                /* chains per warp */
    static_assert(HG == 16 || HG == 64, "heads per item");
    static_assert(PPW * CPW * WARPS == PAIRS * QCH && WARPS % (TILE / 8) == 0, "S tiles per warp");
    static_assert(PLANES == 1 || PLANES == 2 || PLANES == 4, "score planes");
    static_assert(!ROWS || (WARPS == MT * PLANES && PPW % 2 == 0), "ROWS: one m-tile and a chain share per warp");
};

/* lanes 0-15 address the rows of the two matrices (the others' addresses are ignored) */
__device__ __forceinline__ void ldsm_x2(uint32_t r[2], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_u32(p)));
}

/* Bit index of the j-th set bit (0-based) of the mask words, -1 if there are fewer. */
__device__ __forceinline__ int nth_set_bit(const uint64_t *m, int words, int j) {
    for (int w = 0; w < words; w++) {
        uint64_t v = m[w];
        const int c = __popcll(v);
        if (j < c) {
            for (int q = 0; q < j; q++) v &= v - 1;
            return w * 64 + __ffsll((long long)v) - 1;
        }
        j -= c;
    }
    return -1;
}

/* One item: (row r, its split gs - split_off, head group hg) and the row fields the loads need.
 * A row without keys still gets one (fully masked) tile: its outputs are then O = 0, m = -inf,
 * l = 0, as with no tile at all. */
struct Item {
    int gs, hg, r;
    int k_begin, k_end, n_tiles;
    int stream, n_prefix, mask_off, mask_words;
};

/* The fields of item (hg, gs) of row r. */
__device__ __forceinline__ void item_fill(const kdt_attn_args &a, int hg, int gs, int r, Item &it) {
    it.hg = hg;
    it.gs = gs;
    it.r = r;
    const kdt_grow *row = a.rows + r;
    const int n_keys = row->n_keys, chunk = split_keys(n_keys), split_off = row->split_off;
    it.k_begin = (gs - split_off) * chunk;
    it.k_end = min(it.k_begin + chunk, n_keys);
    it.n_tiles = max(1, (it.k_end - it.k_begin + TILE - 1) / TILE);
    it.stream = row->stream;
    it.n_prefix = row->n_prefix;
    it.mask_off = row->mask_off;
    it.mask_words = row->mask_words;
}

/* Fills `it` for item index `item` (head-group major: item = hg x total_splits + gs, so a run of
 * consecutive items is one head group's consecutive splits, mostly of one row: they share Q);
 * false at or past `end`, the CTA's last item + 1. A binary search over the rows: for a CTA's
 * first item only (item_next walks on from there). */
__device__ __forceinline__ bool item_at(const kdt_attn_args &a, int item, int end, int total_splits, int n_rows,
                                        Item &it) {
    if (item >= end) return false;
    const int hg = item / total_splits, gs = item - hg * total_splits;
    int lo = 0, hi = n_rows - 1; /* the row holding split gs: last row with split_off <= gs */
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (a.rows[mid].split_off <= gs) lo = mid;
        else hi = mid - 1;
    }
    item_fill(a, hg, gs, lo, it);
    return true;
}
/* `it` (item `item` - 1) -> item `item`: the next split of the same row, else the next row's first
 * (rows' splits are consecutive, each row has at least one), else the next head group's row 0. The
 * item item_at would find, without its dependent chain of row loads (one per halving: ncu put
 * ~5 % of a 65-row verify's attention stalls on it, session 32); false at or past `end`. */
__device__ __forceinline__ bool item_next(const kdt_attn_args &a, int item, int end, int total_splits, Item &it) {
    if (item >= end) return false;
    int hg = it.hg, gs = it.gs + 1, r = it.r;
    if (gs == total_splits) {
        hg++, gs = 0, r = 0;
    } else { /* row r's splits end at its split_off + n_splits (read again: a register kept per
              * item made the 16-head instances spill) */
        const kdt_grow *row = a.rows + r;
        if (gs >= row->split_off + n_splits(row->n_keys)) r++;
    }
    item_fill(a, hg, gs, r, it);
    return true;
}

/* Where list key k of the item lives: `page` is the raw block-table entry, left in flight (it is
 * used one tile later), `off` the slot within the page; valid = 0 for keys past k_end or with a
 * broken slot (zero-filled, so P = 0 never meets garbage). */
struct KeySrc {
    int page, off, valid;
};
__device__ __forceinline__ KeySrc key_src(const kdt_attn_args &a, const Item &it, int k) {
    KeySrc s = {0, 0, 0};
    if (k < it.k_end) {
        int slot = k;
        bool ok = true;
        if (k >= it.n_prefix) {
            const int bit = it.mask_off >= 0 ? nth_set_bit(a.masks + it.mask_off, it.mask_words, k - it.n_prefix) : -1;
            slot = it.n_prefix + bit;
            ok = bit >= 0;
        }
        if (ok) {
            /* the cache's page size is KDT_KV_PAGE_SIZE: a shift and a mask, not two integer
             * divisions (~25 instructions each) on every tile's critical path */
            const unsigned u = (unsigned)slot, ps = (unsigned)a.page_size;
            const unsigned pg = ps == KDT_KV_PAGE_SIZE ? u / KDT_KV_PAGE_SIZE : u / ps;
            s.page = a.block_table[(int64_t)it.stream * a.max_pages + pg];
            s.off = (int)(u - pg * ps);
            s.valid = 1;
        }
    }
    return s;
}

/* d_q: the instance's compile-time DQ, or the launch's (DQ = 0) */
template <int DQ>
__device__ __forceinline__ int dq_of(const kdt_attn_args &a) { return DQ ? DQ : a.dq; }

/* Whether this instance, in this device pass, keeps Q and the KV ring as the 128-byte-swizzled
 * slabs of wgmma_sm90.cuh and forms S = Q K^T with wgmma (attn_plan.h kdt_ap_slab: 64 heads at
 * d_q 576, and sm_90a code). Its S chains are the same k16 steps in the same order as the
 * mma.sync chains of every other instance, from the same zeros: tests/gpu/test_wgmma_sm90.cu
 * checks that the two instructions give the same bits, so the 16-head decode items and the
 * 64-head verify items still agree bitwise. */
template <int HG, int DQ>
__device__ __forceinline__ constexpr bool att_slab() { return KDT_HAS_WGMMA && kdt_ap_slab(HG, DQ); }

/* Element offset of (row r, column c) in a Q or KV tile of `rows` rows: row-major with stride qs,
 * or as slabs (slab c / 64 holds [rows][64], rows of 128 bytes, 16-byte chunks XOR-swizzled by
 * row % 8). c is a multiple of 4 (an 8-byte store) or 8 (a 16-byte copy / ldmatrix row). */
template <bool SLAB>
__device__ __forceinline__ int tile_at(int r, int c, int rows, int qs) {
    if constexpr (SLAB) return (c >> 6) * rows * 64 + (int)(wg::sw128_offset(r, c & 63) >> 1);
    else return r * qs + c;
}

/* Issues this thread's 16-byte copies of its key into a tile. */
template <int HG, int W, int DQ>
__device__ __forceinline__ void issue_key(const kdt_attn_args &a, uint16_t *tile, int qs, KeySrc s) {
    constexpr int TPK = AttCfg<HG, W>::TPK;
    constexpr bool SLAB = att_slab<HG, DQ>();
    const int key = threadIdx.x / TPK, sub = threadIdx.x % TPK;
    const uint16_t *src = a.kv;
    if (s.valid) {
        const int page = s.page < 0 || s.page >= a.n_pages ? 0 : s.page; /* never out of bounds; host validated */
        src = a.kv + ((int64_t)page * a.page_size + s.off) * a.row_stride;
    }
    const int chunks = dq_of<DQ>(a) / 8;
#pragma unroll
    for (int ch = sub; ch < chunks; ch += TPK)
        cp_async16(tile + tile_at<SLAB>(key, ch * 8, TILE, qs), s.valid ? src + ch * 8 : a.kv, s.valid ? 16 : 0);
}

/* Q of an item -> Qs (bf16): float4 loads, QB of them in flight per thread (a batch: q_fetch
 * issues, q_store converts and stores); heads past H read as 0. Columns [d_q, qs) are zeroed once
 * per CTA and never written here. Float4 i of the item is head i / dq4, column 4 (i % dq4). With
 * 64 heads per item (36 float4 per thread of 8 warps) a thread's i step by THREADS, so (head,
 * column) step by (THREADS / dq4, THREADS % dq4) with a carry (RowCol): two integer divisions per
 * batch instead of two per float4 (H200, session 12: decode S 64 and verify N 17-65 -1.3..-1.8 %).
 * 16-head items keep the divisions: the walk's registers made their 8- and 16-warp instances
 * spill (decode S 8 +10..17 us). */
constexpr int QB = 12;
struct RowCol { /* element i of a [rows][n] array as (r, c), stepped by `step` elements at a time */
    int r, c, dr, dc, n;
    __device__ RowCol(int i, int n_, int step) : n(n_) {
        r = i / n;
        c = i - r * n;
        dr = step / n;
        dc = step - dr * n;
    }
    __device__ void next() {
        r += dr;
        c += dc;
        if (c >= n) c -= n, r++;
    }
};
template <int HG>
__host__ __device__ constexpr bool q_walk() { return HG == 64; }
template <int HG, int W, int DQ>
__device__ __forceinline__ void q_fetch(const kdt_attn_args &a, const Item &it, int i0, float4 (&v)[QB]) {
    constexpr int THREADS = AttCfg<HG, W>::THREADS;
    const int dq = dq_of<DQ>(a), dq4 = dq / 4, n4 = HG * dq4, h0 = it.hg * HG;
    const float4 *src = reinterpret_cast<const float4 *>(a.q_abs + ((int64_t)it.r * a.H + h0) * dq);
    RowCol q(i0, dq4, THREADS); /* used with q_walk only */
#pragma unroll
    for (int j = 0; j < QB; j++, q.next()) {
        const int i = i0 + j * THREADS;
        const bool ok = i < n4 && h0 + (q_walk<HG>() ? q.r : i / dq4) < a.H;
        const float4 t = src[ok ? i : 0]; /* always an address inside the row */
        v[j] = ok ? t : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}
template <int HG, int W, int DQ>
__device__ __forceinline__ void q_store(const kdt_attn_args &a, int i0, const float4 (&v)[QB], uint16_t *Qs, int qs) {
    constexpr int THREADS = AttCfg<HG, W>::THREADS;
    const int dq4 = dq_of<DQ>(a) / 4, n4 = HG * dq4;
    RowCol q(i0, dq4, THREADS); /* used with q_walk only */
#pragma unroll
    for (int j = 0; j < QB; j++, q.next()) {
        const int i = i0 + j * THREADS;
        if (i < n4) {
            const int h = q_walk<HG>() ? q.r : i / dq4, c4 = q_walk<HG>() ? q.c : i - h * dq4;
            uint2 p;
            p.x = pack_bf16(v[j].x, v[j].y);
            p.y = pack_bf16(v[j].z, v[j].w);
            *reinterpret_cast<uint2 *>(Qs + tile_at<att_slab<HG, DQ>()>(h, 4 * c4, HG, qs)) = p;
        }
    }
}
/* the batches of an item from i0 on (i0 = threadIdx.x: all of them) */
template <int HG, int W, int DQ>
__device__ __forceinline__ void load_q(const kdt_attn_args &a, const Item &it, int i0, uint16_t *Qs, int qs) {
    constexpr int THREADS = AttCfg<HG, W>::THREADS;
    for (; i0 < HG * (dq_of<DQ>(a) / 4); i0 += QB * THREADS) {
        float4 v[QB];
        q_fetch<HG, W, DQ>(a, it, i0, v);
        q_store<HG, W, DQ>(a, i0, v, Qs, qs);
    }
}

/* The SLAB S phase's wgmma chains for a warpgroup: chains 0 and 1, or 2 and 3 (`upper`), 9 k16
 * steps each in ascending order, accumulating into d0 / d1. Q is [QR][576] and the key tile
 * [KR][576] as slabs whose base descriptors are qd / kd; a k step's descriptor is the base plus its
 * start offset in 16-byte units (no carry: shared addresses stay below 2^18), one of two
 * compile-time constants picked by `upper` without a branch: rebuilding both descriptors per step
 * was ~4 integer ops and 4 R2UR per wgmma (ncu), and a branch per warpgroup around the products
 * made ptxas serialize the wgmma (C7520). DQ: the slabs' d_q (9 x 64). */
template <int QR, int KR, int DQ>
__device__ __forceinline__ void s_chains(float (&d0)[16], float (&d1)[16], uint64_t qd, uint64_t kd, bool upper) {
    constexpr int KCH = DQ / 16 / QCH;
    auto off = [](int rows, int k) { return wg::kstep_offset(rows, k) >> 4; }; /* in 16-byte units */
    /* the steps move the start address only: 32-bit adds on the low words (wgmma_sm90.cuh) */
    const uint32_t ql = (uint32_t)qd, qh = (uint32_t)(qd >> 32), kl = (uint32_t)kd, kh = (uint32_t)(kd >> 32);
#pragma unroll
    for (int i = 0; i < KCH; i++) {
        const int k0 = i, k1 = KCH + i; /* chains 0, 1; upper: + 2 KCH */
        const uint32_t q0 = upper ? off(QR, k0 + 2 * KCH) : off(QR, k0);
        const uint32_t q1 = upper ? off(QR, k1 + 2 * KCH) : off(QR, k1);
        const uint32_t b0 = upper ? off(KR, k0 + 2 * KCH) : off(KR, k0);
        const uint32_t b1 = upper ? off(KR, k1 + 2 * KCH) : off(KR, k1);
        wg::mma_m64n32k16_ss(d0, ql + q0, qh, kl + b0, kh);
        wg::mma_m64n32k16_ss(d1, ql + q1, qh, kl + b1, kh);
    }
}

/* 16 heads with 8 warps: two CTAs per SM where a pass has many items (<= 128 registers); 16
 * warps (512 threads) fill an SM alone */
template <int HG, int W>
constexpr int att_min_blocks() { return HG == 16 && W == 8 ? 2 : 1; }

template <int HG, int W, int NT, int DQ>
__global__ void __launch_bounds__(AttCfg<HG, W>::THREADS, (att_min_blocks<HG, W>()))
    attn_partial(const kdt_attn_args a, int stages) {
    using C = AttCfg<HG, W>;
    constexpr int MT = C::MT, WARPS = C::WARPS, THREADS = C::THREADS, PPW = C::PPW, TPK = C::TPK;
    constexpr int CPW = C::CPW, PLANES = C::PLANES;
    constexpr bool SLAB = att_slab<HG, DQ>();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* slabs start 1,024-byte aligned (the host reserves KDT_AP_SLAB_ALIGN more for them) */
    unsigned char *smem = smem_raw + (SLAB ? (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u : 0u);
    pdl::wait(); /* programmatic dependence (kdt_g_pdl_rows): the previous kernel is done */
    const int dq = dq_of<DQ>(a);
    const int qs = kdt_ap_qs_stride(W, NT, dq), dq16 = (dq + 15) / 16, kch = (dq16 + QCH - 1) / QCH;
    /* Q and the ring: row-major [HG][qs] and [stages][TILE][qs]; as slabs (SLAB) Q's 9 x 8 KB and
     * 9 x 4 KB per stage at 36 KB steps, inside those regions (the later arrays stay put) */
    uint16_t *Qs = reinterpret_cast<uint16_t *>(smem);                       /* [HG][qs] */
    uint16_t *Ks = Qs + (size_t)HG * qs;                                      /* [stages][TILE][qs] */
    float *Ss = reinterpret_cast<float *>(Ks + (size_t)stages * TILE * qs);   /* [PLANES][HG][SS] raw */
    uint16_t *Ps = reinterpret_cast<uint16_t *>(Ss + PLANES * HG * SS);       /* [HG][PS] */
    float *row_m = reinterpret_cast<float *>(Ps + HG * PS), *row_l = row_m + HG, *row_alpha = row_l + HG;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int my_key = tid / TPK;
    const int n_hg = (a.H + HG - 1) / HG;
    const int n_rows = a.hdr->n_rows, total_splits = a.hdr->total_splits;
    /* this CTA's items: a contiguous run [first, end) of the head-group-major order, so that
     * consecutive items mostly share their row and head group and Q is loaded once per run (a
     * 65-node verify: ~1.5 Q loads per CTA instead of ~13); scheduling only */
    const long long total = (long long)total_splits * n_hg; /* < 2^31: the runner bounds rows x splits */
    const int first = (int)(total * blockIdx.x / gridDim.x), end = (int)(total * (blockIdx.x + 1) / gridDim.x);

    /* pad columns [d_q, qs) of Q and of every K stage are never written by the loads: zero them
     * (slabs have none: 576 = 9 x 64) */
    if constexpr (!SLAB) {
        const int pad = qs - dq, n_pad_rows = HG + stages * TILE; /* Ks rows follow the Q rows */
        for (RowCol q(tid, pad, THREADS); q.r < n_pad_rows; q.next()) Qs[q.r * qs + dq + q.c] = 0;
    }

    const int k_stride = SLAB ? TILE * DQ : TILE * qs; /* elements per ring stage (slabs: 36 KB) */
    /* producer: the next tile to load (p_tile of item pi) and its key's location, looked up one
     * tile before the copies are issued */
    Item pi;
    int p_item = first;
    bool p_live = item_at(a, p_item, end, total_splits, n_rows, pi);
    int p_tile = 0, p_stage = 0; /* p_stage: the ring slot of the next tile (a counter, not a % by
                                  * the run-time stage count: ~20 instructions per tile) */
    KeySrc la = {0, 0, 0};
    if (p_live) la = key_src(a, pi, pi.k_begin + my_key);
    Item ci = pi; /* consumer: the tile being computed */
    bool c_live = p_live;

    /* issues one tile (or nothing once the items are exhausted) and commits one group */
#define KDT_ATT_PRODUCE()                                                                        \
    do {                                                                                         \
        if (p_live) {                                                                            \
            issue_key<HG, W, DQ>(a, Ks + (size_t)p_stage * k_stride, qs, la);                      \
            p_stage = p_stage + 1 == stages ? 0 : p_stage + 1;                                   \
            if (++p_tile == pi.n_tiles) {                                                        \
                p_live = item_next(a, ++p_item, end, total_splits, pi);                          \
                p_tile = 0;                                                                      \
            }                                                                                    \
            if (p_live) la = key_src(a, pi, pi.k_begin + p_tile * TILE + my_key);                \
        }                                                                                        \
        cp_async_commit();                                                                       \
    } while (0)

    /* the first batch of Q goes out before the first copies wait for their block-table entries */
    float4 qv[QB];
    if (c_live) q_fetch<HG, W, DQ>(a, ci, tid, qv);
    for (int s = 0; s < stages - 1; s++) KDT_ATT_PRODUCE();
    if (c_live) {
        q_store<HG, W, DQ>(a, tid, qv, Qs, qs);
        load_q<HG, W, DQ>(a, ci, tid + QB * THREADS, Qs, qs);
    }
    int c_item = first;

    /* SLAB: this lane's V row-address part for the P V ldmatrix.trans (bytes in a stage: slab
     * `warp`, key row kk 16 + lane % 8 + 8 (lane / 8 % 2)) and its chunk XOR ((lane / 16) ^ row % 8,
     * as bytes); unused otherwise */
    const int v_row = warp * TILE * 128 + ((lane & 7) + ((lane >> 3) & 1) * 8) * 128;
    const int v_xor = (((lane >> 4) ^ (lane & 7)) << 4);
    float acc[MT][NT][4] = {};
    int c_tile = 0, c_stage = 0; /* the ring slot of the tile being computed */
    while (c_live) {
        const int kb = ci.k_begin + c_tile * TILE;
        const uint16_t *Kc = Ks + (size_t)c_stage * k_stride;
        if (stages == 3) cp_async_wait<1>();
        else cp_async_wait<0>();
        if constexpr (SLAB) wg::fence_proxy_async(); /* the copies and Q's stores, seen by wgmma */
        __syncthreads(); /* this tile (and Q) landed; everyone is past the previous one */
        KDT_ATT_PRODUCE(); /* into the stage the previous tile used */
        if (c_tile == 0) {
            for (int i = tid; i < HG; i += THREADS) row_m[i] = -INFINITY, row_l[i] = 0.0f;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < NT; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.0f;
        }

        /* S = Q K^T: this warp's PPW (m-tile, 8-key tile) pairs, chains [c0, c0 + CPW) of each. ROWS
         * (64 heads): the pairs are one m-tile's whole score rows, so a k step loads its Q fragment
         * once for all of them and the keys 16 at a time; else pairs pw, pw + WARPS, .. of the
         * m-tile-major order, one key tile per warp. SLAB: warpgroup 0 forms chains 0-1 and
         * warpgroup 1 chains 2-3 of all 64 rows with wgmma (a warp's accumulators are then m-tile
         * warp % 4's rows, laid out as mma.sync's), the same planes as ROWS */
        {
            constexpr bool ROWS = C::ROWS;
            const int pw = SLAB ? warp % 4 * (TILE / 8)
                                : (ROWS ? warp / PLANES * (TILE / 8) : (WARPS <= C::PAIRS ? warp : warp % C::PAIRS));
            const int c0 = SLAB ? warp / 4 * CPW
                                : (ROWS ? warp % PLANES * CPW : (WARPS <= C::PAIRS ? 0 : warp / C::PAIRS * CPW));
            const int pstep = ROWS ? 1 : WARPS; /* pair p is pw + p * pstep, as (m-tile, key tile) */
            float c[PPW][CPW][4];
#pragma unroll
            for (int p = 0; p < PPW; p++)
#pragma unroll
                for (int j = 0; j < CPW; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) c[p][j][e] = 0.0f;
            if constexpr (SLAB) {
                static_assert(CPW == 2 && PPW == TILE / 8 && WARPS == 8 && ROWS, "SLAB: two chains per warpgroup");
                float d0[16], d1[16];
#pragma unroll
                for (int e = 0; e < 16; e++) d0[e] = 0.0f, d1[e] = 0.0f;
                /* descriptors: the slabs' bases once per tile, each k step's an immediate above them */
                const uint64_t qd = wg::desc_sw128(smem_u32(Qs), 16u, 1024u);
                const uint64_t kd = wg::desc_sw128(smem_u32(Kc), 16u, 1024u);
                wg::fence_operands16(d0);
                wg::fence_operands16(d1);
                wg::fence();
                s_chains<HG, TILE, DQ>(d0, d1, qd, kd, warp >= 4); /* warpgroup 1: chains 2, 3 (c0 = 2) */
                wg::commit();
                wg::wait<0>();
                wg::fence_operands16(d0);
                wg::fence_operands16(d1);
#pragma unroll
                for (int p = 0; p < PPW; p++)
#pragma unroll
                    for (int e = 0; e < 4; e++) c[p][0][e] = d0[4 * p + e], c[p][1 % CPW][e] = d1[4 * p + e];
            } else
/* with d_q known (DQ) the k steps unroll whole (the same mma sequence, so the same bits) */
#pragma unroll(DQ ? ((DQ + 15) / 16 + QCH - 1) / QCH : 3)
            for (int i = 0; i < kch; i++) {
#pragma unroll
                for (int j = 0; j < CPW; j++) {
                    const int kk = (c0 + j) * kch + i;
                    /* c0 + j < QCH always, so with d_q / 16 a multiple of QCH (576: 36 = 4 x 9)
                     * every kk is in range: no per-step test, one straight block of loads and
                     * mma whose addresses are a base and immediates */
                    constexpr bool FULL = DQ != 0 && ((DQ + 15) / 16) % QCH == 0;
                    if (!(FULL || kk < dq16)) continue;
                    if constexpr (ROWS) {
                        uint32_t af[4];
                        ldsm_x4(af, Qs + (pw / (TILE / 8) * 16 + (lane & 15)) * qs + kk * 16 + (lane >> 4) * 8);
#pragma unroll
                        for (int p = 0; p < PPW; p += 2) { /* keys 8p..8p+15: (keys 0-7 | 8-15) x (k 0-7 | 8-15) */
                            uint32_t bf[4];
                            ldsm_x4(bf, Kc + (p * 8 + (lane >> 4) * 8 + (lane & 7)) * qs + kk * 16 + ((lane >> 3) & 1) * 8);
                            mma16816(c[p][j], af, bf[0], bf[1]);
                            mma16816(c[p + 1][j], af, bf[2], bf[3]);
                        }
                    } else {
                        uint32_t bf[2]; /* WARPS is a multiple of TILE / 8: one key tile per warp */
                        ldsm_x2(bf, Kc + ((warp % (TILE / 8)) * 8 + (lane & 7)) * qs + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                        for (int p = 0; p < PPW; p++) {
                            const int mt = (pw + p * WARPS) / (TILE / 8);
                            uint32_t af[4];
                            ldsm_x4(af, Qs + (mt * 16 + (lane & 15)) * qs + kk * 16 + (lane >> 4) * 8);
                            mma16816(c[p][j], af, bf[0], bf[1]);
                        }
                    }
                }
            }
            static_assert(QCH == 4 && (CPW == 4 || CPW == 2 || CPW == 1), "the chain sums below");
            float *plane = Ss + (c0 / CPW) * HG * SS;
#pragma unroll
            for (int p = 0; p < PPW; p++) {
                const int id = pw + p * pstep, mt = id / (TILE / 8), nt = id % (TILE / 8);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = nt * 8 + 2 * t + (e & 1), hr = mt * 16 + g + (e >> 1) * 8;
                    /* (c0 + c1) + (c2 + c3): whole here, one bracket per plane or one chain */
                    float s = c[p][0][e];
                    if (CPW >= 2) s = s + c[p][1 % CPW][e];
                    if (CPW == 4) s = s + (c[p][2 % CPW][e] + c[p][3 % CPW][e]);
                    plane[hr * SS + key] = s;
                }
            }
        }
        __syncthreads();

        /* online softmax: 8 threads per head row, 4 keys each, fixed reduction tree */
#pragma unroll
        for (int rr = tid; rr < HG * TPR; rr += THREADS) {
            const int hr = rr / TPR, part = rr % TPR;
            float v[TILE / TPR];
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < TILE / TPR; i++) {
                const int key = part * (TILE / TPR) + i;
                float sv = Ss[hr * SS + key];
                if (PLANES == 2) sv = sv + Ss[HG * SS + hr * SS + key];
                if (PLANES == 4)
                    sv = (sv + Ss[HG * SS + hr * SS + key]) +
                         (Ss[2 * HG * SS + hr * SS + key] + Ss[3 * HG * SS + hr * SS + key]);
                v[i] = kb + key < ci.k_end ? sv * a.scale_log2 : -INFINITY;
                mx = fmaxf(mx, v[i]);
            }
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_old = row_m[hr];
            const float m_new = fmaxf(m_old, mx);
            const float m_ref = m_new == -INFINITY ? 0.0f : m_new;
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < TILE / TPR; i++) {
                const float p = exp2f(v[i] - m_ref);
                sum += p;
                Ps[hr * PS + part * (TILE / TPR) + i] = f32_to_bf16(p);
            }
#pragma unroll
            for (int o = TPR / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            __syncwarp();
            if (part == 0) {
                const float alpha = exp2f(m_old - m_ref);
                row_alpha[hr] = alpha;
                row_l[hr] = row_l[hr] * alpha + sum;
                row_m[hr] = m_new;
            }
        }
        __syncthreads();

        /* O = alpha O + P V over this warp's columns [cb, cb + 8 NT) */
        const int cb = warp * NT * 8;
        static_assert(!SLAB || NT * 8 == 64, "SLAB: a warp's P V columns are one slab");
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const float a0 = row_alpha[mt * 16 + g], a1 = row_alpha[mt * 16 + g + 8];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                acc[mt][j][0] *= a0;
                acc[mt][j][1] *= a0;
                acc[mt][j][2] *= a1;
                acc[mt][j][3] *= a1;
            }
        }
#pragma unroll
        for (int kk = 0; kk < TILE / 16; kk++) {
            uint32_t pf[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                ldsm_x4(pf[mt], Ps + (mt * 16 + (lane & 15)) * PS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int jj = 0; jj < NT / 2; jj++) {
                uint32_t bv[4];
                if constexpr (SLAB) /* slab `warp` (cb = 64 warp); the chunk 2 jj + lane / 16 ^ row % 8 */
                    ldsm_x4_trans(bv, reinterpret_cast<const unsigned char *>(Kc) + v_row + kk * 16 * 128 +
                                          ((jj * 32) ^ v_xor));
                else
                    ldsm_x4_trans(bv, Kc + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * qs + cb + jj * 16 +
                                          (lane >> 4) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma16816(acc[mt][2 * jj], pf[mt], bv[0], bv[1]);
                    mma16816(acc[mt][2 * jj + 1], pf[mt], bv[2], bv[3]);
                }
            }
        }
        c_stage = c_stage + 1 == stages ? 0 : c_stage + 1;
        if (++c_tile < ci.n_tiles) continue;

        /* the item is done: its partial results (row_m / row_l are final since the last sync).
         * A thread's two columns go out as one 8-byte store where d_c is even (4 lanes then fill
         * a 32-byte sector; two 4-byte stores used half of each sector they touched and kept the
         * store queue full: ~7 % of the decode kernel's stall samples, H200 ncu, session 13) */
        /* 64 heads: it made the runtime-d_q NT 8 instance spill (session 13); the d_q 576 one does not */
        const bool pair_store = (HG == 16 || DQ != 0) && (a.dc & 1) == 0;
        if (pair_store && (ci.hg + 1) * HG <= a.H && cb + NT * 8 <= a.dc) {
            /* every head of the group and every column of the warp exists (Kimi: always): the same
             * stores without a test and a branch around each (ncu, corr N 65: ~130 branches and 64
             * divergence scopes per warp and item, a fifth of the 64-head kernel's per-item code) */
            float *dst = a.att_o + ((int64_t)ci.gs * a.H + ci.hg * HG) * a.dc + cb + 2 * t;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int h2 = 0; h2 < 2; h2++) {
                    float *row = dst + (int64_t)(mt * 16 + g + 8 * h2) * a.dc;
#pragma unroll
                    for (int j = 0; j < NT; j++)
                        *reinterpret_cast<float2 *>(row + j * 8) =
                            make_float2(acc[mt][j][2 * h2], acc[mt][j][2 * h2 + 1]);
                }
        } else
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int h2 = 0; h2 < 2; h2++) {
                    const int head = ci.hg * HG + mt * 16 + g + 8 * h2, col = cb + j * 8 + 2 * t;
                    if (head < a.H) {
                        float *dst = a.att_o + ((int64_t)ci.gs * a.H + head) * a.dc;
                        if (pair_store && col + 1 < a.dc) {
                            *reinterpret_cast<float2 *>(dst + col) = make_float2(acc[mt][j][2 * h2], acc[mt][j][2 * h2 + 1]);
                        } else {
                            if (col < a.dc) dst[col] = acc[mt][j][2 * h2];
                            if (col + 1 < a.dc) dst[col + 1] = acc[mt][j][2 * h2 + 1];
                        }
                    }
                }
        for (int i = tid; i < HG; i += THREADS) {
            const int head = ci.hg * HG + i;
            if (head < a.H) {
                a.att_m[(int64_t)ci.gs * a.H + head] = row_m[i];
                a.att_l[(int64_t)ci.gs * a.H + head] = row_l[i];
            }
        }
        /* the next item: every read of Qs for this one was before the S sync above */
        const int prev_r = ci.r, prev_hg = ci.hg;
        c_live = item_next(a, ++c_item, end, total_splits, ci);
        c_tile = 0;
        /* Q stays when the next item is the same row and head group (a further split) */
        if (c_live && (ci.r != prev_r || ci.hg != prev_hg)) load_q<HG, W, DQ>(a, ci, tid, Qs, qs);
    }
#undef KDT_ATT_PRODUCE
    pdl::launch_dependents(); /* the combine may be placed once every CTA is done with its items */
    cp_async_wait<0>(); /* no copy may outlive the CTA */
}

constexpr int CT = 256;                      /* attn_combine threads */
constexpr int CH = 16;                       /* most heads one combine item spans */
constexpr int CS = KDT_G_ATT_MAX_SPLITS;     /* n_splits never exceeds it */
constexpr int CPF = 32;                      /* splits of a thread's first output loaded early */
constexpr int CW = 12;                       /* splits in flight per thread on the 16-byte walk */
static_assert(CPF % 16 == 0, "the later loads go 16 splits at a time");

/* o_lat[r][h] = sum_j O_j 2^(m_j - M) / sum_j l_j 2^(m_j - M), splits j in order, M = max_j m_j.
 * Item = (row, outputs [lo, hi) of the row's H x d_c, spanning heads h_lo..). Per head: M by
 * fmaxf in split order, L by an fma chain in split order, w_j = exp2f(m_j - M); per element:
 * o = fma(O_j, w_j, o) in split order, then o / L: what `o += O_j * exp2f(m_j - M)` and
 * `L += l_j * exp2f(m_j - M)` compile to, so the chunking never changes a bit. */
__global__ void __launch_bounds__(CT) attn_combine(const kdt_attn_args a, int cols) {
    pdl::wait();
    pdl::launch_dependents(); /* W_UV may stream its weights meanwhile (KDT_GPU_PDL) */
    __shared__ float sw[CH][CS + 1], sl[CH][CS + 1]; /* m_j, then w_j; l_j (+1: a thread per head) */
    __shared__ float sM[CH], sL[CH];
    const int n_rows = a.hdr->n_rows, width = a.H * a.dc, per_row = (width + cols - 1) / cols;
    const int64_t stride = (int64_t)a.H * a.dc; /* one split's outputs */
    for (long long it = blockIdx.x; it < (long long)n_rows * per_row; it += gridDim.x) {
        const int r = (int)(it / per_row), lo = (int)(it % per_row) * cols, hi = min(lo + cols, width);
        const int h_lo = lo / a.dc, nh = (hi - 1) / a.dc - h_lo + 1; /* <= CH (launcher) */
        const kdt_grow row = a.rows[r];
        const int ns = min(n_splits(row.n_keys), CS), base = row.split_off;
        /* wide items (4 outputs per thread at least) take the 16-byte walk below */
        const bool wide = ((a.dc | lo | hi) & 3) == 0 && hi - lo >= 4 * CT;
        /* else this thread's first output's split values go out now, before the weights are known */
        const int i0 = lo + threadIdx.x;
        float pre[CPF];
#pragma unroll
        for (int u = 0; u < CPF; u++)
            pre[u] = !wide && i0 < hi && u < ns ? a.att_o[(int64_t)(base + u) * stride + i0] : 0.0f;
        __syncthreads(); /* the previous item is done with the weights */
        for (int i = threadIdx.x; i < nh * ns; i += CT) {
            const int j = i / nh, h = i % nh;
            const int64_t sj = (int64_t)(base + j) * a.H + h_lo + h;
            sw[h][j] = a.att_m[sj];
            sl[h][j] = a.att_l[sj];
        }
        __syncthreads();
        if (threadIdx.x < nh) {
            const int h = threadIdx.x;
            float M = -INFINITY;
            for (int j = 0; j < ns; j++) M = fmaxf(M, sw[h][j]);
            float L = 0.0f;
            for (int j = 0; j < ns; j++) L = __fmaf_rn(sl[h][j], exp2f(sw[h][j] - M), L);
            sM[h] = M;
            sL[h] = L;
        }
        __syncthreads(); /* every m_j is read: overwrite them with the weights */
        for (int i = threadIdx.x; i < nh * ns; i += CT) {
            const int j = i / nh, h = i % nh;
            sw[h][j] = exp2f(sw[h][j] - sM[h]);
        }
        __syncthreads();
        if (wide) {
            /* wide items (a tree verify's rows): 4 adjacent outputs of one head per thread, one
             * 16-byte load per split, CW splits in flight (the scalar walk below read the partials
             * at ~2 TB/s, ncu corr N 65 on an H100: 118 us, 86 us this way). Each element's fma
             * chain and division are the scalar walk's, so the bits are too. */
            for (int i = lo + 4 * (int)threadIdx.x; i < hi; i += 4 * CT) {
                const int h = i / a.dc - h_lo;
                const float4 *src = reinterpret_cast<const float4 *>(a.att_o + (int64_t)base * stride + i);
                const int64_t st4 = stride / 4;
                float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int j0 = 0; j0 < ns; j0 += CW) {
                    float4 t[CW];
#pragma unroll
                    for (int u = 0; u < CW; u++)
                        t[u] = j0 + u < ns ? src[(j0 + u) * st4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                    for (int u = 0; u < CW; u++)
                        if (j0 + u < ns) {
                            const float w = sw[h][j0 + u];
                            o.x = __fmaf_rn(t[u].x, w, o.x);
                            o.y = __fmaf_rn(t[u].y, w, o.y);
                            o.z = __fmaf_rn(t[u].z, w, o.z);
                            o.w = __fmaf_rn(t[u].w, w, o.w);
                        }
                }
                const float L = sL[h];
                *reinterpret_cast<float4 *>(a.o_lat + (int64_t)r * width + i) =
                    make_float4(o.x / L, o.y / L, o.z / L, o.w / L);
            }
            continue;
        }
        for (int i = i0; i < hi; i += CT) {
            const int h = i / a.dc - h_lo;
            const float *src = a.att_o + (int64_t)base * stride + i;
            float o = 0.0f;
            int j_first = 0;
            if (i == i0) {
#pragma unroll
                for (int u = 0; u < CPF; u++)
                    if (u < ns) o = __fmaf_rn(pre[u], sw[h][u], o);
                j_first = CPF;
            }
            for (int j0 = j_first; j0 < ns; j0 += 16) { /* loads 16 splits at a time, fmas in order */
                float t[16];
#pragma unroll
                for (int u = 0; u < 16; u++) t[u] = j0 + u < ns ? src[(j0 + u) * stride] : 0.0f;
#pragma unroll
                for (int u = 0; u < 16; u++)
                    if (j0 + u < ns) o = __fmaf_rn(t[u], sw[h][j0 + u], o);
            }
            a.o_lat[(int64_t)r * width + i] = o / sL[h];
        }
    }
}

/* The device's SM count, per-block opt-in and per-SM shared memory. */
struct DevLimits {
    int n_sm, optin, per_sm;
};
cudaError_t dev_limits(DevLimits *d) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&d->n_sm, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) e = kdt_smem_optin(dev, &d->optin);
    if (e == cudaSuccess) e = kdt_smem_per_sm(dev, &d->per_sm);
    return e;
}

/* The deepest KV ring that fits the device (2 fits wherever kdt_ap_pick_warps chose the count). */
int max_stages(int hg, int w, int nt, int dq, const DevLimits &d) {
    return kdt_ap_smem(hg, w, nt, dq, MAX_ST) <= (size_t)d.optin ? MAX_ST : 2;
}

/* d_q of the instances compiled for one d_q: DeepSeek-V3 / Kimi's 512 + 64, with d_c 512 */
constexpr int DQ_MLA = 576;
/* KDT_GPU_ATT_GENERIC=1 (read per launch): the runtime-d_q instances only (the same bits) */
bool att_generic() { return kdt_g_env_is("KDT_GPU_ATT_GENERIC", '1'); }

/* One switch over the instances: f.operator()<HG, W, NT, DQ>() for (hg, w, nt), with DQ = d_q
 * where an instance is compiled for it (d_q 576 with d_c 512: nt = 64 / w) unless `generic`,
 * else DQ = 0 (d_q read at run time); false if none. */
bool att_fixed_dq(int dq, int w, int nt) { return dq == DQ_MLA && nt * w == 64; }
template <class Fn>
bool att_dispatch(int hg, int w, int nt, int dq, bool generic, Fn &&f) {
    if (!generic && att_fixed_dq(dq, w, nt)) {
        if (hg == 16 && w == 4) f.template operator()<16, 4, 16, DQ_MLA>();
        else if (hg == 16 && w == 8) f.template operator()<16, 8, 8, DQ_MLA>();
        else if (hg == 16 && w == 16) f.template operator()<16, 16, 4, DQ_MLA>();
        else if (hg == 64 && w == 8) f.template operator()<64, 8, 8, DQ_MLA>();
        else return false;
        return true;
    }
#define F(HG, W, NT) f.template operator()<HG, W, NT, 0>()
    if (hg == 16 && w == 4) {
        switch (nt) {
        case 2: F(16, 4, 2); return true;
        case 4: F(16, 4, 4); return true;
        case 6: F(16, 4, 6); return true;
        case 8: F(16, 4, 8); return true;
        case 10: F(16, 4, 10); return true;
        case 12: F(16, 4, 12); return true;
        case 14: F(16, 4, 14); return true;
        case 16: F(16, 4, 16); return true;
        }
    } else if (hg == 16 && w == 16) {
        switch (nt) {
        case 2: F(16, 16, 2); return true;
        case 4: F(16, 16, 4); return true;
        }
    } else if (w == 8) {
        switch (nt) {
        case 2: if (hg == 16) F(16, 8, 2); else F(64, 8, 2); return true;
        case 4: if (hg == 16) F(16, 8, 4); else F(64, 8, 4); return true;
        case 6: if (hg == 16) F(16, 8, 6); else F(64, 8, 6); return true;
        case 8: if (hg == 16) F(16, 8, 8); else F(64, 8, 8); return true;
        }
    }
#undef F
    return false;
}

struct SetAttr {
    size_t smem;
    cudaError_t e;
    template <int HG, int W, int NT, int DQ>
    void operator()() {
        e = cudaFuncSetAttribute(attn_partial<HG, W, NT, DQ>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    }
};
struct LaunchPartial {
    const kdt_attn_args *a;
    unsigned grid;
    size_t smem;
    int stages;
    cudaStream_t s;
    template <int HG, int W, int NT, int DQ>
    void operator()() {
        pdl::launch(attn_partial<HG, W, NT, DQ>, dim3(grid), dim3(AttCfg<HG, W>::THREADS), smem, s, kdt_g_pdl_rows(), *a,
                    stages);
    }
};

/* Warps per item of a launch (scheduling only; every count gives the same bits): for 16 heads 8,
 * two warps per score tile (H200, Kimi layer, session 9: decode S 1 attention 34.0 -> 30.1 us,
 * S 8 137.8 -> 123.3, verify N 9 143.1 -> 128.8), or 16, one k-step chain per warp, where the
 * launch has at most one CTA per SM anyway (a one-row decode) and d_c gives each of the 16 warps
 * >= 32 P V columns (Kimi's 512): an item's tile is then a shorter dependent chain per warp
 * (session 11: the decode's attention step 28.2 -> 25.9 us, the layer -3 us). KDT_GPU_ATT_WARPS=
 * 4 / 8 / 16 (read per launch) forces a count. A count whose 2-stage ring does not fit the device
 * gives way to the next (kdt_ap_pick_warps): on 99 KB parts (sm_120, sm_86 / 89) a 16-warp item
 * of d_c 512 needs 103,360 bytes, so a Kimi decode runs 8 warps there. 0: none fits. */
int att_warps(int hg, int64_t grid, int dc, int dq, const DevLimits &d) {
    const char *e = getenv("KDT_GPU_ATT_WARPS");
    return kdt_ap_pick_warps(hg, grid, d.n_sm, dc, dq, (size_t)d.optin, e ? atoi(e) : 0);
}

/* Verify rows from a tree that lives on the device (kdt_gpu_stage_verify_device): one CTA numbers
 * the nodes of every stream compactly (stream-major), fills each row exactly as the host staging
 * does, and scans the attention split counts for split_off. The host already wrote n_updates. */
constexpr int STAGE_THREADS = 1024;
__global__ void __launch_bounds__(STAGE_THREADS) k_stage_tree(kdt_gstage_hdr *hdr, kdt_grow *rows, int32_t *head,
                                                              uint64_t *masks, const int32_t *streams, int S, int N,
                                                              int W, const int32_t *n_nodes, const int32_t *token,
                                                              const int32_t *position, const uint64_t *anc_mask) {
    __shared__ int row_off[65];
    __shared__ int scan[STAGE_THREADS];
    __shared__ int carry;
    const int t = threadIdx.x;
    if (t == 0) {
        int acc = 0;
        for (int s = 0; s < S; s++) {
            row_off[s] = acc;
            const int n = n_nodes[s], bound = streams[3 * s + 2];
            acc += n < 1 ? 1 : (n > bound ? bound : n); /* never past the slots the host reserved */
        }
        row_off[S] = acc;
        carry = 0;
    }
    __syncthreads();
    const int R = row_off[S];
    for (int base = 0; base < R; base += STAGE_THREADS) {
        const int k = base + t;
        int ns = 0, s = 0;
        if (k < R) {
            while (s + 1 < S && row_off[s + 1] <= k) s++;
            const int i = k - row_off[s];
            const int64_t idx = (int64_t)s * N + i;
            const int P = streams[3 * s + 1];
            int bits = 0;
            for (int q = 0; q < W; q++) {
                const uint64_t m = anc_mask[idx * W + q];
                masks[(int64_t)k * W + q] = m;
                bits += __popcll(m);
            }
            kdt_grow w;
            w.stream = streams[3 * s];
            w.token = token[idx];
            w.pos = position[idx];
            w.slot = P + i;
            w.n_prefix = P;
            w.n_keys = P + bits;
            w.mask_off = k * W;
            w.mask_words = W;
            w.split_off = 0;
            w.out_index = w.tap_index = (int32_t)idx;
            w.pad = 0;
            rows[k] = w;
            head[k] = k;
            ns = n_splits(w.n_keys);
        }
        scan[t] = ns;
        __syncthreads();
        for (int off = 1; off < STAGE_THREADS; off <<= 1) { /* inclusive Hillis-Steele scan */
            const int v = t >= off ? scan[t - off] : 0;
            __syncthreads();
            scan[t] += v;
            __syncthreads();
        }
        if (k < R) rows[k].split_off = carry + scan[t] - ns;
        __syncthreads();
        if (t == STAGE_THREADS - 1) carry += scan[t];
        __syncthreads();
    }
    if (t == 0) {
        hdr->n_rows = R;
        hdr->n_head = R;
        hdr->total_splits = carry;
    }
}
} // namespace

extern "C" int32_t kdt_attn_split_keys(int32_t n_keys) { return split_keys(n_keys); }
extern "C" int32_t kdt_attn_n_splits(int32_t n_keys) { return n_splits(n_keys); }

/* 0 when (heads_per_item, d_c, d_q) has no kernel instance; else the least shared memory per
 * block it runs with (the smallest 2-stage ring of its warp counts: launches fall back to it). It
 * took the largest until session 24, which refused Kimi's d_c 512 on 99 KB devices (sm_120). */
extern "C" size_t kdt_attn_smem_bytes(int32_t heads_per_item, int32_t dc, int32_t dq) {
    return kdt_ap_min_smem(heads_per_item, dc, dq);
}

/* Raises the shared-memory limit of the instances this model uses (before any capture) to the
 * deepest ring the device fits, for every warp count of the head group that fits it at all. */
extern "C" kdt_status kdt_attn_init(int32_t heads_per_item, int32_t dc, int32_t dq) {
    DevLimits d;
    cudaError_t e = dev_limits(&d);
    for (int w = 4; w <= 16 && e == cudaSuccess; w *= 2) {
        if (!kdt_ap_w_fits(heads_per_item, w, dc, dq, (size_t)d.optin)) continue;
        const int nt = kdt_ap_pick_nt(w, dc);
        SetAttr f = {kdt_ap_smem(heads_per_item, w, nt, dq, max_stages(heads_per_item, w, nt, dq, d)), cudaSuccess};
        /* the runtime-d_q instance too where a d_q 576 one exists: KDT_GPU_ATT_GENERIC may pick
         * it at any launch */
        for (int generic = att_fixed_dq(dq, w, nt) ? 0 : 1; generic < 2 && e == cudaSuccess; generic++) {
            f.e = cudaSuccess;
            e = att_dispatch(heads_per_item, w, nt, dq, generic != 0, f) ? f.e : cudaErrorInvalidValue;
        }
    }
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "GPU attention (%d heads per item, d_c %d, d_q %d): %s", heads_per_item, dc,
                        dq, cudaGetErrorString(e));
    return KDT_OK;
}

/* Scheduling only (the stage count, warps and the grid never change a bit): a pass of one row has
 * at most a few items per SM, so each SM gets one CTA with the deepest ring (two tiles in flight);
 * a pass of more rows with 16 heads per item gets two CTAs of a 2-stage ring per SM where they
 * fit, so one CTA's barriers and item changes hide behind the other's work. With one CTA per
 * SM the grid is cut to one per SM: a CTA streams its items without gaps, extra CTAs would only
 * queue behind it. */
extern "C" kdt_status kdt_attn_launch(const kdt_attn_args *a, cudaStream_t s) {
    const int hg = a->heads_per_item;
    DevLimits d;
    cudaError_t e = dev_limits(&d);
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "GPU attention: device: %s", cudaGetErrorString(e));
    const int w = att_warps(hg, a->grid, a->dc, a->dq, d);
    if (w == 0)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "GPU attention: no %d-head instance for d_c %d, d_q %d fits %d bytes of "
                        "shared memory per block", hg, a->dc, a->dq, d.optin);
    const int nt = kdt_ap_pick_nt(w, a->dc);
    int stages = max_stages(hg, w, nt, a->dq, d);
    const size_t smem2 = kdt_ap_smem(hg, w, nt, a->dq, 2);
    const int two_per_sm = 2 * (smem2 + 1024) <= (size_t)d.per_sm;
    if (hg == 16 && a->max_rows > 1 && two_per_sm) stages = 2;
    const size_t smem = kdt_ap_smem(hg, w, nt, a->dq, stages);
    int64_t grid = a->grid > 0 ? a->grid : 1;
    int64_t per_sm = (int64_t)d.per_sm / (int64_t)(smem + 1024);
    if (per_sm < 1) per_sm = 1;
    if (grid > per_sm * d.n_sm) grid = per_sm * d.n_sm;
    LaunchPartial f = {a, (unsigned)grid, smem, stages, s};
    if (!att_dispatch(hg, w, nt, a->dq, att_generic(), f))
        return kdt_fail(KDT_ERR_INTERNAL, "GPU attention: no instance for %d heads, %d warps, d_c %d", hg, w, a->dc);
    e = cudaGetLastError();
    if (e == cudaSuccess) {
        /* rows x chunks of the H d_c outputs; a chunk of whole heads spans at most CH of them, a
         * shorter one at most two */
        int cols = kdt_g_chunk_cols(a->max_rows, a->H * a->dc, CT);
        if (cols >= a->dc) cols = (cols / a->dc < CH ? cols / a->dc : CH) * a->dc;
        const int64_t items = (int64_t)(a->max_rows > 1 ? a->max_rows : 1) * ((a->H * a->dc + cols - 1) / cols);
        pdl::launch(attn_combine, dim3((unsigned)(items < 4096 ? items : 4096)), dim3(CT), 0, s, kdt_g_pdl_rows(), *a, cols);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "GPU attention: launch failed: %s", cudaGetErrorString(e));
    return KDT_OK;
}

extern "C" kdt_status kdt_op_stage_tree(kdt_gstage_hdr *hdr, kdt_grow *rows, int32_t *head, uint64_t *masks,
                                        const int32_t *streams, int32_t S, int32_t N, int32_t W,
                                        const int32_t *n_nodes, const int32_t *token, const int32_t *position,
                                        const uint64_t *anc_mask, cudaStream_t s) {
    if (S < 1 || S > 64) return kdt_fail(KDT_ERR_INVALID_ARG, "GPU tree staging: %d streams (1..64)", S);
    k_stage_tree<<<1, STAGE_THREADS, 0, s>>>(hdr, rows, head, masks, streams, S, N, W, n_nodes, token, position,
                                             anc_mask);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? KDT_OK : kdt_fail(KDT_ERR_CUDA, "GPU tree staging: %s", cudaGetErrorString(e));
}
