/* verify_attn.cu - CUDA tree-masked MLA verify attention (kdt_verify_attn_cuda) and its workspace
 * size (kdt_verify_attn_workspace_bytes). Semantics: kernels.h and cpu/verify_attn.c.
 *
 * Portable tensor-core path (mma.sync m16n8k16 bf16 -> fp32, ldmatrix, cp.async: sm_80, sm_90a,
 * sm_120). Only d_qk = 576, d_v = 512 (the MLA absorbed form) is supported here.
 *
 * Work decomposition. The rows of a stream are its (node, head) pairs, row g = node * H + head,
 * which is exactly the memory order of q, out and lse. A row tile is 64 consecutive rows: for
 * H = 64 all heads of one node, for H < 64 several nodes, for H = 128 half a node. All rows of a
 * tile read the same latent KV row per key, so each KV tile is fetched once per row tile. An
 * item = (stream, row tile, KV split): it runs an online softmax over the split's key range
 * [kb, ke) in tiles of BN keys and writes either the final bf16 output (one split) or a
 * partial (o normalized, in fp16 with a power-of-two scale per row and 64 columns; lse in fp32)
 * that verify_attn_combine merges in split order.
 *
 * Split schedule (va_split, the one dispatch function): depends only on the stream's own
 * (prefix_len, n_nodes) and H, never on S or other streams, so a stream's output is bitwise the
 * same alone or in any batch. rt = ceil(n*H/64) row tiles, blocks = ceil(keys/64):
 *   splits = 1                                   if rt >= TARGET_ITEMS (132, one H200 wave)
 *   splits = min(TARGET/rt, blocks/MIN_BLOCKS, MAX_SPLITS), at least 1, otherwise
 * then rebalanced to equal chunks of whole 64-key blocks. TARGET/rt fills the GPU for a lone
 * stream; MIN_BLOCKS = 16 (1,024 keys) caps the partial traffic (64 rows x 512 written and read
 * back per item, 64 KB in fp16, 128 KB in fp32 until session 16, against 16 x 72 KB of keys)
 * when a large batch repeats the split for every stream. It was 4: with the faster sm_90a kernel
 * the partials dominated decode (H200, S 64, P 16384, q 1: 700 us with 4, 560 with 8, 455 with
 * 16; S 64 P 4096 q 9 1,231 -> 775; the S = 1 shapes within +-4 %). See
 * docs/verify_attn_notes.md for the trade-off. A NULL workspace (or 0 bytes) runs every stream
 * unsplit: correct, only slower for small batches.
 *
 * Launch: a persistent grid (one CTA per SM) walks the item list: items are numbered stream by
 * stream, and each CTA finds its item's stream with a warp-parallel prefix scan over the streams
 * (n_nodes, prefix_len live on the device, so the host cannot size the schedule). Per item, the
 * CTA holds Q (64 x 576 bf16, swizzled) in shared memory and streams KV tiles (BN keys x 576)
 * through cp.async, STAGES deep. 8 warps:
 *   S = Q K^T: warp (mw, nw) computes a WM x WN block of the 64 x BN scores;
 *   softmax: row maxima meet in shared memory, P (bf16) goes to shared memory, each thread keeps
 *            its own copy of the running max of every row it touches (identical arithmetic);
 *   O += P V: warp w owns output columns [64w, 64w+64) of all 64 rows (128 fp32 registers).
 * Keys past the split end are zero-filled and masked; only tiles reaching past prefix_len (the
 * tree slots) or the split end read the ancestor mask. Configs by shared memory per block:
 *   BN 64, 2 stages  ~226 KB (sm_90: H100/H200);   BN 64, 1 stage ~154 KB (sm_80 A100-class);
 *   BN 16, 1 stage    ~94 KB (sm_120: RTX PRO 6000, 99 KB per block).
 *
 * Bad device-side data never reads or writes out of bounds: a stream with n_nodes outside
 * 1..max_nodes, prefix_len < 0 or prefix_len + n_nodes > max_pages * page_size, a block-table
 * entry outside 0..n_pages-1, or a split stream whose partials do not fit the workspace (prefix
 * beyond the max_prefix it was sized for) gets NaN in out and lse for its rows (rows
 * 0..clamp(n_nodes, 1, max_nodes)-1). Masked tree slots must hold finite values (they are other
 * nodes' KV rows): P = 0 times an infinite V element would still be NaN in the tensor-core sum.
 */
#include <cuda.h> /* CUtensorMap and its enums only: the encoder comes via the runtime */
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>

#include <atomic>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kdtree/kernels.h"
#include "device_limits.h"
#include "pdl.cuh"
#include "verify_attn_mma.cuh"
#include "verify_attn_tiles.cuh"
#include "wgmma_sm90.cuh"

extern "C" kdt_status kdt_verify_attn_check_args(const kdt_verify_attn_params *p, const char *who);

namespace {

constexpr int D_QK = VA_D_QK, D_V = VA_D_V, ROWS = VA_ROWS, THREADS = VA_THREADS;
constexpr int QK_CHUNKS = VA_QK_CHUNKS, SCHED_BLOCK = VA_SCHED_BLOCK;
/* A split item's partial slot: o normalized, in fp16 with a power-of-two scale per (row, 64-column
 * group) (va::part_scales: half the bytes of fp32, written by the main kernel and read back by the
 * combine), lse in fp32. */
constexpr int PART_GROUPS = D_V / 64;
constexpr size_t SLOT_O_HALVES = (size_t)ROWS * D_V;
constexpr size_t SLOT_BYTES = SLOT_O_HALVES * 2 + ROWS * sizeof(float) + (size_t)ROWS * PART_GROUPS * sizeof(float);
constexpr int MAX_KEYS_PER_STREAM = 1 << 30;

struct VaArgs {
    const uint16_t *q;            /* [S][max_nodes][H][576] */
    const uint16_t *kv;           /* [n_pages][page_size][576] */
    const int32_t *block_table;   /* [S][max_pages] */
    const int32_t *prefix_len;    /* [S] */
    const int32_t *n_nodes;       /* [S] */
    const uint64_t *anc_mask;     /* [S][max_nodes][words] */
    uint16_t *out;                /* [S][max_nodes][H][512] */
    float *lse;                   /* [S][max_nodes][H] */
    uint16_t *ws_o;               /* [slots][64][512] fp16, scaled */
    float *ws_lse;                /* [slots][64] */
    float *ws_scale;              /* [slots][64][PART_GROUPS]: what ws_o's fp16 values are multiplied by */
    long long slot_capacity;      /* 0: no workspace, nothing is split */
    int S, H, max_nodes, words, n_pages, page_size, max_pages;
    float scale_log2;             /* softmax_scale * log2(e) */
    int prof;                     /* KDT_VA_PROFILE=1: the sm_90a kernel stamps its phases (below) */
    int prof_item;                /* KDT_VA_PROFILE_ITEM=k: v4 stamps CTA 0's k-th item (default 0, the first) */
    int use_tma;                  /* sm_90a kernel: KV tiles by TMA (the kv_map parameter) */
};

struct VaPlan {
    int valid;       /* stream data in range */
    int n, prefix;   /* n clamped to 1..max_nodes when invalid */
    int rt;          /* row tiles */
    int splits, chunk_keys;
    int items;       /* main-kernel items: rt * splits (valid) or rt (invalid: NaN fill) */
    int slots;       /* workspace partial slots: rt * splits when split, else 0 */
};

__device__ inline VaPlan va_plan(const VaArgs &a, int s) {
    VaPlan pl;
    const int n = __ldg(a.n_nodes + s), prefix = __ldg(a.prefix_len + s);
    pl.valid = n >= 1 && n <= a.max_nodes && prefix >= 0 &&
               (long long)prefix + n <= (long long)a.max_pages * a.page_size;
    pl.n = n < 1 ? 1 : (n > a.max_nodes ? a.max_nodes : n);
    pl.prefix = prefix;
    pl.rt = (pl.n * a.H + ROWS - 1) / ROWS;
    pl.splits = 1;
    pl.chunk_keys = 0;
    if (pl.valid) {
        if (a.slot_capacity > 0) va_split(prefix + n, pl.rt, &pl.splits, &pl.chunk_keys);
        else pl.chunk_keys = ((prefix + n + SCHED_BLOCK - 1) / SCHED_BLOCK) * SCHED_BLOCK;
    }
    pl.items = pl.rt * pl.splits;
    pl.slots = pl.splits > 1 ? pl.items : 0;
    return pl;
}

/* Where a CTA's walk over the item list stands; in shared memory, written by warp 0. */
struct WalkShared {
    int found, s;
    long long item_base, slot_base; /* items / slots of the streams before s */
    VaPlan plan;
};

/* Warp 0: advance (s, item_base, slot_base) to the stream holding item i (items increase along a
 * CTA's walk). COMBINE counts only the row tiles of split streams. Writes the result to *w. */
template <bool COMBINE>
__device__ void walk_to(const VaArgs &a, long long i, int &s, long long &item_base,
                        long long &slot_base, WalkShared *w) {
    const int lane = threadIdx.x & 31;
    while (s < a.S) {
        const int my = s + lane;
        VaPlan pl = {};
        int items = 0, slots = 0;
        if (my < a.S) {
            pl = va_plan(a, my);
            items = COMBINE ? ((pl.valid && pl.splits > 1) ? pl.rt : 0) : pl.items;
            slots = pl.slots;
        }
        int inc_i = items, inc_s = slots; /* inclusive scans over the 32 streams */
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int ti = __shfl_up_sync(0xffffffffu, inc_i, o), ts = __shfl_up_sync(0xffffffffu, inc_s, o);
            if (lane >= o) inc_i += ti, inc_s += ts;
        }
        const int tot_i = __shfl_sync(0xffffffffu, inc_i, 31), tot_s = __shfl_sync(0xffffffffu, inc_s, 31);
        if (item_base + tot_i > i) {
            const unsigned hit = __ballot_sync(0xffffffffu, item_base + inc_i > i);
            const int src = __ffs(hit) - 1;
            item_base += __shfl_sync(0xffffffffu, inc_i - items, src);
            slot_base += __shfl_sync(0xffffffffu, inc_s - slots, src);
            s += src;
            if (lane == src) {
                w->found = 1, w->s = s, w->item_base = item_base, w->slot_base = slot_base;
                w->plan = pl;
            }
            return;
        }
        item_base += tot_i, slot_base += tot_s, s += 32;
    }
    if (lane == 0) w->found = 0;
}

/* Writes NaN to out and lse of rows [0, rows) of the row tile starting at global row `row0`. */
__device__ void fill_nan_rows(const VaArgs &a, long long row0, int rows) {
    uint32_t *o = reinterpret_cast<uint32_t *>(a.out + row0 * D_V);
    for (int idx = threadIdx.x; idx < rows * (D_V / 2); idx += THREADS) o[idx] = 0x7fc07fc0u;
    for (int r = threadIdx.x; r < rows; r += THREADS) a.lse[row0 + r] = __int_as_float(0x7fc00000);
}

/* One item's coordinates (both kernels). */
struct VaItem {
    int s, split_mode, rows_valid, P, kb, ke;
    long long slot, row0; /* workspace slot (split mode); global row of tile row 0 */
    const int32_t *table;
    const uint64_t *mask;
};

/* The coordinates of item i from the walk's result; fills sNode (tile row -> node, -1 past the
 * stream's rows). Returns false, after writing NaN to the rows (once per row tile), when the
 * stream's data is bad or its partials do not fit the workspace: nothing to compute then. */
__device__ __forceinline__ bool va_item(const VaArgs &a, long long i, const WalkShared *w, int *sNode, VaItem *it) {
    const VaPlan pl = w->plan;
    const long long local = i - w->item_base;
    const int split = (int)(local / pl.rt), rtile = (int)(local % pl.rt);
    const int g0 = rtile * ROWS;
    it->s = w->s;
    it->slot = w->slot_base + local;
    it->split_mode = pl.splits > 1;
    it->rows_valid = min(ROWS, pl.n * a.H - g0);
    it->row0 = (long long)w->s * a.max_nodes * a.H + g0;
    if (!pl.valid || (it->split_mode && w->slot_base + pl.slots > a.slot_capacity)) {
        if (split == 0) fill_nan_rows(a, it->row0, it->rows_valid);
        return false;
    }
    it->P = pl.prefix;
    it->kb = split * pl.chunk_keys;
    it->ke = min(pl.prefix + pl.n, it->kb + pl.chunk_keys);
    it->table = a.block_table + (long long)w->s * a.max_pages;
    it->mask = a.anc_mask + (long long)w->s * a.max_nodes * a.words;
    if (threadIdx.x < ROWS) sNode[threadIdx.x] = (int)threadIdx.x < it->rows_valid ? (g0 + (int)threadIdx.x) / a.H : -1;
    return true;
}

/* A CTA's place in the item walk (kept in registers, advanced by warp 0). */
struct WalkState {
    int s = 0;
    long long items = 0, slots = 0;
};

/* Moves the CTA to item i: a barrier (every thread is done with the previous item's shared
 * memory), warp 0 walks, a barrier, then the item's coordinates. 0: the walk is over; -1: the item
 * has nothing to compute (its rows got NaN); 1: compute it. */
__device__ __forceinline__ int va_next_item(const VaArgs &a, long long i, WalkState &ws, WalkShared *sw, int *sNode,
                                            VaItem *it) {
    __syncthreads();
    if ((threadIdx.x >> 5) == 0) walk_to<false>(a, i, ws.s, ws.items, ws.slots, sw);
    __syncthreads();
    if (!sw->found) return 0;
    return va_item(a, i, sw, sNode, it) ? 1 : -1;
}

/* cp.async of the item's Q rows (zeros past the stream's last row) into shared memory at base;
 * addr(r, c) = byte offset of 16-byte chunk c of row r in the kernel's layout. Thread -> (row
 * tid / 4, chunks tid % 4 + 4 i). */
template <class Addr>
__device__ __forceinline__ void va_load_q(const VaArgs &a, const VaItem &it, uint32_t base, Addr addr) {
    const int r = threadIdx.x >> 2;
    const uint16_t *src = r < it.rows_valid ? a.q + (it.row0 + r) * D_QK : a.q;
    const int bytes = r < it.rows_valid ? 16 : 0;
#pragma unroll
    for (int c = threadIdx.x & 3; c < QK_CHUNKS; c += 4) va::cp_async_16(base + addr(r, c), src + c * 8, bytes);
}

/* The cache row of key t (t < ke) and 16 bytes to copy; past ke: a valid pointer and 0 bytes
 * (zero fill). A block-table entry out of range sets bad and reads page 0 instead. */
__device__ __forceinline__ const uint16_t *va_key_src(const VaArgs &a, const int32_t *table, int t, int ke, int &bad,
                                                      int &bytes) {
    bytes = 0;
    if (t >= ke) return a.kv;
    int page = __ldg(table + t / a.page_size);
    if (page < 0 || page >= a.n_pages) bad = 1, page = 0;
    bytes = 16;
    return a.kv + ((long long)page * a.page_size + t % a.page_size) * D_QK;
}

/* Whether tile row `row` sees keys t0 .. t0 + 63 (bit k: key t0 + k): inside the split (key < ke),
 * and for tree slots (key >= P) an ancestor-or-self of the row's node (a padding row, node < 0,
 * sees them all: its output is never written). At most two mask words per row, loaded together:
 * a test per element left one dependent global load per tree key of the tile, one after another.
 * Words past the node's last are never read. */
__device__ __forceinline__ uint64_t va_lt_bits(int n) { /* bits 0 .. n-1, n clamped to 0..64 */
    return n <= 0 ? 0ull : (n >= 64 ? ~0ull : (1ull << n) - 1ull);
}
__device__ __forceinline__ uint64_t va_visible_window(const VaArgs &a, const VaItem &it, const int *sNode, int row,
                                                      int t0) {
    const int n_pre = it.P - t0; /* keys of the tile below P (clamped by va_lt_bits) */
    uint64_t vis = va_lt_bits(n_pre);
    if (n_pre < 64) {
        const int node = sNode[row];
        const int lead = n_pre > 0 ? n_pre : 0; /* the tile's first tree key is bit lead */
        if (node < 0) {
            vis = ~0ull; /* a padding row: its output is never written */
        } else {
            const int j = t0 + lead - it.P; /* its tree slot, >= 0 */
            const int w = j >> 6, sh = j & 63;
            const uint64_t *m = it.mask + (long long)node * a.words;
            const uint64_t lo = w < a.words ? __ldg(m + w) : 0ull;
            const uint64_t hi = sh && w + 1 < a.words ? __ldg(m + w + 1) : 0ull;
            const uint64_t win = (lo >> sh) | (sh ? hi << (64 - sh) : 0ull); /* slots j .. j + 63 */
            vis |= win << lead;
        }
    }
    return vis & va_lt_bits(it.ke - t0);
}

/* 2^x for x <= 0 (scores minus their running max, log2 domain): one MUFU.EX2. Results below
 * 2^-126 flush to 0, where exp2f would spend four more instructions per element on keeping a
 * denormal that a sum of values near 1 cannot see. */
__device__ __forceinline__ float va_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Normalisation of one finished row: 1 / l and the natural-log lse from the running max m (log2
 * domain) and sum l; NaN for a bad item; zero output and lse -inf for a row that saw no key. */
__device__ __forceinline__ void va_row_finish(float m, float l, int any_bad, float *inv, float *lse, bool *zero) {
    const float qnan = __int_as_float(0x7fc00000);
    *zero = false;
    if (any_bad) *inv = qnan, *lse = qnan;
    else if (l > 0.f) *inv = 1.f / l, *lse = (m + log2f(l)) * 0.693147180559945309f;
    else if (l == 0.f) *inv = 0.f, *lse = -INFINITY, *zero = true;
    else *inv = qnan, *lse = qnan;
}

template <int BN, int STAGES>
struct Cfg {
    static constexpr int MW = BN >= 64 ? 2 : 4; /* warps along the rows of S */
    static constexpr int WM = ROWS / MW;        /* S rows per warp */
    static constexpr int NW = 8 / MW;           /* warps along the keys of S */
    static constexpr int WN = BN / NW;          /* S keys per warp */
    static constexpr int MT = WM / 16, NT = WN / 8;
    static constexpr int P_STRIDE = BN + 8;     /* bf16 elements per P row (+16 B: no bank conflicts) */
    static constexpr size_t Q_BYTES = (size_t)ROWS * D_QK * 2;
    static constexpr size_t KV_BYTES = (size_t)BN * D_QK * 2;
    static constexpr size_t P_BYTES = (size_t)ROWS * P_STRIDE * 2;
    static constexpr size_t RED_BYTES = (size_t)NW * ROWS * 4;
    static constexpr size_t NODE_BYTES = (size_t)ROWS * 4;
    static constexpr size_t SMEM = Q_BYTES + STAGES * KV_BYTES + P_BYTES + RED_BYTES + NODE_BYTES +
                                   sizeof(WalkShared);
    static_assert(MW * NW == 8 && WN % 8 == 0 && WM % 16 == 0 && BN % 16 == 0, "tiling");
    static_assert(THREADS % BN == 0 && SCHED_BLOCK % BN == 0, "loader / schedule");
    static_assert(STAGES == 1 || STAGES == 2, "stages");
};

/* Issues the cp.async copies of KV keys [t0, t0 + BN) of a stream into a swizzled tile at dst;
 * keys >= ke are zero-filled (nothing read). A block-table entry out of range sets bad and reads
 * page 0 instead, so nothing outside the cache is touched. */
template <int BN>
__device__ __forceinline__ void load_kv_tile(const VaArgs &a, const int32_t *table, int t0, int ke,
                                             uint32_t dst, int &bad) {
    constexpr int TPR = THREADS / BN;
    const int r = threadIdx.x / TPR, c0 = threadIdx.x % TPR;
    int bytes;
    const uint16_t *src = va_key_src(a, table, t0 + r, ke, bad, bytes);
#pragma unroll
    for (int c = c0; c < QK_CHUNKS; c += TPR) va::cp_async_16(dst + va_swz(r, c), src + c * 8, bytes);
}

/* The same tile from an FP8 cache (KDT_KV_FP8_SCALED): each 16-byte chunk is converted in
 * registers and stored to the swizzled tile, so those loads are synchronous (no shared memory
 * is left for a staging tile): the 1-stage configurations expose a tile's load latency either
 * way, the 2-stage one loses its overlap here. A thread issues all its loads of the tile (the
 * row's 4 scales and 16 code words at BN 64, 4 at BN 16) before the first conversion, so their
 * latencies overlap: one round trip per tile, not one per chunk (the first version chained them:
 * 2.8-3.7x the bf16 cache's time on the H200, session 25). The rope's bf16 chunks go by cp.async
 * like the bf16 tile's. Keys >= ke get zeros; a block-table entry out of range sets bad, reads
 * page 0. */
__device__ __forceinline__ void va_st_shared_16(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
/* bf16(e4m3 x scale) of 8 codes: va_fp8_chunk's values. On sm_89+ by the hardware conversions,
 * which are exact (e4m3 -> f16 -> f32) and round the product to nearest even as va_fp8_chunk
 * does; only a NaN's payload may differ (still NaN). Elsewhere va_fp8_chunk itself. */
__device__ __forceinline__ uint4 va_fp8_chunk_dev(uint2 codes, float scale) {
    uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint32_t out[4];
    const uint32_t w[2] = {codes.x, codes.y};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const unsigned short pair = (unsigned short)(w[k >> 1] >> (16 * (k & 1))); /* codes 2k (low), 2k+1 */
        uint32_t h2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
        const float lo = __half2float(__ushort_as_half((unsigned short)(h2 & 0xffffu)));
        const float hi = __half2float(__ushort_as_half((unsigned short)(h2 >> 16)));
        const __nv_bfloat162 b = __floats2bfloat162_rn(lo * scale, hi * scale); /* .x = lo, the low half */
        memcpy(&out[k], &b, 4);
    }
    v = make_uint4(out[0], out[1], out[2], out[3]);
#else
    uint8_t b[8];
    memcpy(b, &codes, 8);
    uint16_t h[8];
    va_fp8_chunk(b, scale, h);
    memcpy(&v, h, 16);
#endif
    return v;
}
template <int BN>
__device__ __forceinline__ void load_kv_tile_fp8(const VaArgs &a, const int32_t *table, int t0, int ke,
                                                 uint32_t dst, int &bad) {
    constexpr int TPR = THREADS / BN;
    constexpr int NF = 64 / TPR;            /* latent chunks per thread: 16 at BN 64, 4 at BN 16 */
    constexpr int NR = (8 + TPR - 1) / TPR; /* rope chunks: 2 at BN 64; 1 at BN 16 (threads c0 < 8) */
    static_assert(16 % TPR == 0, "a thread's chunk j reads scale group (j * TPR) / 16");
    const int r = threadIdx.x / TPR, c0 = threadIdx.x % TPR, t = t0 + r;
    if (t >= ke) {
#pragma unroll
        for (int c = c0; c < QK_CHUNKS; c += TPR) va_st_shared_16(dst + va_swz(r, c), make_uint4(0u, 0u, 0u, 0u));
        return;
    }
    int page = __ldg(table + t / a.page_size);
    if (page < 0 || page >= a.n_pages) bad = 1, page = 0;
    const unsigned char *row = reinterpret_cast<const unsigned char *>(a.kv) + ((long long)page * a.page_size + t % a.page_size) * VA_FP8_ROW;
#pragma unroll
    for (int j = 0; j < NR; j++) /* the rope's bf16, copied by cp.async (the caller commits the group) */
        if (c0 + j * TPR < 8) va::cp_async_16(dst + va_swz(r, 64 + c0 + j * TPR), row + va_fp8_src(64 + c0 + j * TPR), 16);
    const float4 sc4 = __ldg(reinterpret_cast<const float4 *>(row + VA_FP8_SCALES));
    const float sc[4] = {sc4.x, sc4.y, sc4.z, sc4.w};
    uint2 codes[NF]; /* every load in flight before the first conversion */
#pragma unroll
    for (int j = 0; j < NF; j++) codes[j] = __ldg(reinterpret_cast<const uint2 *>(row + va_fp8_src(c0 + j * TPR)));
#pragma unroll
    for (int j = 0; j < NF; j++) /* va_fp8_scale_idx(c0 + j * TPR) == (j * TPR) / 16: a constant */
        va_st_shared_16(dst + va_swz(r, c0 + j * TPR), va_fp8_chunk_dev(codes[j], sc[(j * TPR) >> 4]));
}
/* The KV tile of the cache's format (FP8: a template parameter of the kernel). */
template <int BN, bool FP8>
__device__ __forceinline__ void load_kv(const VaArgs &a, const int32_t *table, int t0, int ke, uint32_t dst, int &bad) {
    if constexpr (FP8) load_kv_tile_fp8<BN>(a, table, t0, ke, dst, bad);
    else load_kv_tile<BN>(a, table, t0, ke, dst, bad);
}

template <int BN, int STAGES, bool FP8 = false>
__global__ void __launch_bounds__(THREADS, 1) verify_attn_kernel(const VaArgs a) {
    using C = Cfg<BN, STAGES>;
    constexpr int MW = C::MW, WM = C::WM, NW = C::NW, WN = C::WN, MT = C::MT, NT = C::NT;
    constexpr int P_STRIDE = C::P_STRIDE;
    extern __shared__ __align__(128) unsigned char smem[];
    /* [64][576] bf16 Q | STAGES x [BN][576] bf16 KV | [64][BN+8] bf16 P | [NW][64] f32 | [64] node | walk */
    unsigned char *sKV = smem + C::Q_BYTES;
    uint16_t *sP = reinterpret_cast<uint16_t *>(sKV + STAGES * C::KV_BYTES);
    float *sRed = reinterpret_cast<float *>(reinterpret_cast<unsigned char *>(sP) + C::P_BYTES);
    int *sNode = reinterpret_cast<int *>(reinterpret_cast<unsigned char *>(sRed) + C::RED_BYTES);
    WalkShared *sWalk = reinterpret_cast<WalkShared *>(reinterpret_cast<unsigned char *>(sNode) + C::NODE_BYTES);

    pdl::launch_dependents(); /* the combine's CTAs may take the SMs that run out of items */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int mw = warp % MW, nw = warp / MW;
    const uint32_t q_base = va::smem_addr(smem), kv_base = va::smem_addr(sKV), p_base = va::smem_addr(sP);

    WalkState walk;
    VaItem itm;
    for (long long i = blockIdx.x;; i += gridDim.x) {
        const int next = va_next_item(a, i, walk, sWalk, sNode, &itm);
        if (next <= 0) { if (next == 0) break; continue; }
        const bool split_mode = itm.split_mode;
        const int rows_valid = itm.rows_valid, P = itm.P, kb = itm.kb, ke = itm.ke, n_tiles = (ke - kb + BN - 1) / BN;
        const long long row0 = itm.row0, slot = itm.slot;
        const int32_t *table = itm.table;
        int bad = 0;
        /* Q rows, then KV tile 0: one cp.async group */
        va_load_q(a, itm, q_base, [](int r, int c) { return va_swz(r, c); });
        load_kv<BN, FP8>(a, table, kb, ke, kv_base, bad);
        va::cp_async_commit();

        float o[4][8][4];              /* O: rows mi*16 + lane/4 (+8), cols 64*warp + nj*8 + 2*(lane%4) */
        float mq[MT][2], lq[MT][2];    /* running max / partial sum of this thread's S rows */
        float mp[4][2];                /* running max of this thread's O rows */
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int nj = 0; nj < 8; nj++)
#pragma unroll
                for (int e = 0; e < 4; e++) o[mi][nj][e] = 0.f;
#pragma unroll
        for (int mi = 0; mi < MT; mi++) mq[mi][0] = mq[mi][1] = -INFINITY, lq[mi][0] = lq[mi][1] = 0.f;
#pragma unroll
        for (int mi = 0; mi < 4; mi++) mp[mi][0] = mp[mi][1] = -INFINITY;

        for (int it = 0; it < n_tiles; it++) {
            const int t0 = kb + it * BN;
            va::cp_async_wait_all();
            __syncthreads(); /* A: tile `it` landed; the previous tile's P V is done */
            const uint32_t kv_cur = kv_base + (STAGES == 2 ? (uint32_t)(it & 1) * (uint32_t)C::KV_BYTES : 0u);
            if (STAGES == 2 && it + 1 < n_tiles) {
                load_kv<BN, FP8>(a, table, t0 + BN, ke, kv_base + (uint32_t)((it + 1) & 1) * (uint32_t)C::KV_BYTES, bad);
                va::cp_async_commit();
            }

            /* S = Q K^T for this warp's WM x WN block. */
            float sc[MT][NT][4];
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int ni = 0; ni < NT; ni++)
#pragma unroll
                    for (int e = 0; e < 4; e++) sc[mi][ni][e] = 0.f;
#pragma unroll 6
            for (int kk = 0; kk < D_QK / 16; kk++) {
                uint32_t af[MT][4];
#pragma unroll
                for (int mi = 0; mi < MT; mi++)
                    va::ldsm_x4(af[mi], q_base + va_qk_a_addr(mw * WM + mi * 16, kk, lane));
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    va::ldsm_x4(b, kv_cur + va_qk_b_addr_x4(nw * WN + np * 16, kk, lane));
#pragma unroll
                    for (int mi = 0; mi < MT; mi++) {
                        va::mma_bf16_16816(sc[mi][2 * np], af[mi], b[0], b[1]);
                        va::mma_bf16_16816(sc[mi][2 * np + 1], af[mi], b[2], b[3]);
                    }
                }
                if (NT & 1) {
                    uint32_t b[2];
                    va::ldsm_x2(b, kv_cur + va_qk_b_addr_x2(nw * WN + (NT - 1) * 8, kk, lane));
#pragma unroll
                    for (int mi = 0; mi < MT; mi++) va::mma_bf16_16816(sc[mi][NT - 1], af[mi], b[0], b[1]);
                }
            }

            /* Scale into the log2 domain; mask only tiles that reach the tree slots or the end. */
            const bool need_mask = t0 + BN > P || t0 + BN > ke;
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int ni = 0; ni < NT; ni++)
#pragma unroll
                    for (int e = 0; e < 4; e++) sc[mi][ni][e] *= a.scale_log2;
            if (need_mask) { /* this thread's rows' visibility windows, their mask words loaded together */
                uint64_t vis[MT][2];
#pragma unroll
                for (int mi = 0; mi < MT; mi++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        vis[mi][h] = va_visible_window(a, itm, sNode, mw * WM + mi * 16 + va_frag_row(lane, 2 * h), t0);
#pragma unroll
                for (int mi = 0; mi < MT; mi++)
#pragma unroll
                    for (int ni = 0; ni < NT; ni++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            if (!((vis[mi][e >> 1] >> (nw * WN + ni * 8 + va_frag_col(lane, e))) & 1ull))
                                sc[mi][ni][e] = -INFINITY;
            }

            /* Row maxima of this warp's keys -> sRed[nw][row]. */
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int ni = 0; ni < NT; ni++) mx = fmaxf(mx, fmaxf(sc[mi][ni][2 * h], sc[mi][ni][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    if ((lane & 3) == 0) sRed[nw * ROWS + mw * WM + mi * 16 + va_frag_row(lane, 2 * h)] = mx;
                }
            __syncthreads(); /* B: all row maxima of the tile are in */

            /* New running max of the S rows; P = exp2(S - max) as bf16 into shared memory. */
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int row = mw * WM + mi * 16 + va_frag_row(lane, 2 * h);
                    float tm = sRed[row];
#pragma unroll
                    for (int w = 1; w < NW; w++) tm = fmaxf(tm, sRed[w * ROWS + row]);
                    const float mn = fmaxf(mq[mi][h], tm);
                    const float alpha = mn == -INFINITY ? 1.f : va_ex2(mq[mi][h] - mn);
                    const float mu = mn == -INFINITY ? 0.f : mn;
                    mq[mi][h] = mn;
                    float ls = 0.f;
#pragma unroll
                    for (int ni = 0; ni < NT; ni++) {
                        const float p0 = va_ex2(sc[mi][ni][2 * h] - mu), p1 = va_ex2(sc[mi][ni][2 * h + 1] - mu);
                        const uint32_t pk = va::pack_bf16x2(p0, p1);
                        ls += p0 + p1; /* fp32 weights: lse stays accurate to fp32 rounding */
                        *reinterpret_cast<uint32_t *>(sP + row * P_STRIDE + nw * WN + ni * 8 + va_frag_col(lane, 0)) = pk;
                    }
                    lq[mi][h] = lq[mi][h] * alpha + ls;
                }
            /* The same new max for the O rows (same inputs, same arithmetic). */
            float ap[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int row = mi * 16 + va_frag_row(lane, 2 * h);
                    float tm = sRed[row];
#pragma unroll
                    for (int w = 1; w < NW; w++) tm = fmaxf(tm, sRed[w * ROWS + row]);
                    const float mn = fmaxf(mp[mi][h], tm);
                    ap[mi][h] = mn == -INFINITY ? 1.f : va_ex2(mp[mi][h] - mn);
                    mp[mi][h] = mn;
                }
            __syncthreads(); /* C: P is complete */

            /* O = O * alpha + P V over this warp's 64 columns. */
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nj = 0; nj < 8; nj++)
#pragma unroll
                    for (int e = 0; e < 4; e++) o[mi][nj][e] *= ap[mi][e >> 1];
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) {
                uint32_t pa[4][4];
#pragma unroll
                for (int mi = 0; mi < 4; mi++)
                    va::ldsm_x4(pa[mi], p_base + va_pv_a_addr(mi * 16, kk, lane, P_STRIDE));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t b[4];
                    va::ldsm_x4_trans(b, kv_cur + va_pv_b_addr(kk, warp * 64 + np * 16, lane));
#pragma unroll
                    for (int mi = 0; mi < 4; mi++) {
                        va::mma_bf16_16816(o[mi][2 * np], pa[mi], b[0], b[1]);
                        va::mma_bf16_16816(o[mi][2 * np + 1], pa[mi], b[2], b[3]);
                    }
                }
            }
            if (STAGES == 1 && it + 1 < n_tiles) {
                __syncthreads(); /* the single KV buffer is free again */
                load_kv<BN, FP8>(a, table, t0 + BN, ke, kv_base, bad);
                va::cp_async_commit();
            }
        }

        /* Row sums: quad lanes, then the NW key-warps in a fixed order. */
#pragma unroll
        for (int mi = 0; mi < MT; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float l = lq[mi][h];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                if ((lane & 3) == 0) sRed[nw * ROWS + mw * WM + mi * 16 + va_frag_row(lane, 2 * h)] = l;
            }
        const int any_bad = __syncthreads_or(bad);
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int row = mi * 16 + va_frag_row(lane, 2 * h);
                /* rows >= rows_valid are finished too (the split branch's quad shuffles need every
                 * lane) but not stored */
                float l = sRed[row];
#pragma unroll
                for (int w = 1; w < NW; w++) l += sRed[w * ROWS + row];
                float inv, lse_v;
                bool zero;
                va_row_finish(mp[mi][h], l, any_bad, &inv, &lse_v, &zero);
                const int col = warp * 64 + va_frag_col(lane, 0);
                if (!split_mode) {
                    if (row >= rows_valid) continue;
                    uint16_t *dst = a.out + (row0 + row) * D_V + col;
#pragma unroll
                    for (int nj = 0; nj < 8; nj++) {
                        const float x0 = zero ? 0.f : o[mi][nj][2 * h] * inv;
                        const float x1 = zero ? 0.f : o[mi][nj][2 * h + 1] * inv;
                        *reinterpret_cast<uint32_t *>(dst + nj * 8) = va::pack_bf16x2(x0, x1);
                    }
                    if (warp == 0 && (lane & 3) == 0) a.lse[row0 + row] = lse_v;
                } else {
                    /* the quad holds this row's 64 columns of warp's group: its max sets the scale */
                    float mx = 0.f;
#pragma unroll
                    for (int nj = 0; nj < 8; nj++)
                        mx = fmaxf(mx, zero ? 0.f : fmaxf(fabsf(o[mi][nj][2 * h] * inv), fabsf(o[mi][nj][2 * h + 1] * inv)));
                    float up, down;
                    va::quad_part_scales(mx, &up, &down);
                    if (row >= rows_valid) continue;
                    uint16_t *dst = a.ws_o + slot * (long long)SLOT_O_HALVES + row * D_V + col;
#pragma unroll
                    for (int nj = 0; nj < 8; nj++) {
                        const float x0 = zero ? 0.f : o[mi][nj][2 * h] * inv;
                        const float x1 = zero ? 0.f : o[mi][nj][2 * h + 1] * inv;
                        *reinterpret_cast<uint32_t *>(dst + nj * 8) = va::pack_half2(x0 * up, x1 * up);
                    }
                    if ((lane & 3) == 0) {
                        a.ws_scale[(slot * ROWS + row) * PART_GROUPS + warp] = down;
                        if (warp == 0) a.ws_lse[slot * ROWS + row] = lse_v;
                    }
                }
            }
    }
}

/* ==== sm_90a path (wgmma): KDT_VERIFY_ATTN=wgmma =============================================
 * Same items, schedule, masking, epilogue and combine as the portable kernel above, so the two are
 * interchangeable (not bitwise: the row maxima and sums are formed in another order). 64 rows x 64
 * keys per tile, two warpgroups with different jobs (the split FlashMLA uses), so no product is
 * computed twice and one warpgroup's softmax overlaps the other's tensor work:
 *   WG0 (threads 0-127): S = Q K^T (36 x m64n64k16, Q and K slabs from shared memory), the mask,
 *     the online softmax (it alone keeps the row maxima and sums), P rounded to bf16 into the
 *     tile's rope slab (slab 8: V is slabs 0-7, so it is free once S is formed) and the row
 *     rescale factors into shared memory, then O[:, 0:256] += P V (4 x m64n256k16, P from its
 *     registers).
 *   WG1 (threads 128-255): the KV loads (two tile buffers: TMA from one thread, completing on an
 *     mbarrier per buffer, where pages are whole 64-key tiles; cp.async otherwise or with
 *     KDT_VA_TMA=0), then per tile O[:, 256:512] = alpha O + P V with P read from the slab
 *     (m64n256k16, both operands shared).
 * Hand-offs are two named barriers, both full barriers of the two warpgroups (each side waits
 * there anyway, and compute-sanitizer's racecheck orders accesses only across full barriers):
 * PREADY (P and alpha of tile it written by WG0) and KV (tile it + 1 landed; WG0 reaches it after
 * its product on tile it, WG1 with its product still running, which then overlaps WG0's next
 * scores; WG1 waits for it after KV, so buffer it % 2 is free of both when WG1 refills it with
 * tile it + 2). P and alpha live in the tile's own buffer / parity slot.
 * Without sm_90a code (another arch's PTX JIT-compiled for a Hopper) the body is a trap; the
 * launcher never starts it then (sm90_ready checks the PTX arch). Prediction and outcome of each
 * version: docs/verify_attn_notes.md. */
constexpr int W_SLABS = D_QK / 64;                                    /* 9 */
constexpr uint32_t W_SLAB = 64 * 128;                                 /* [64 rows][128 B] */
constexpr uint32_t W_TILE = W_SLABS * W_SLAB;                          /* 73,728 B: Q or one KV tile */
enum { BAR_KV = 1, BAR_PREADY = 2 };
struct WRows {
    uint64_t kv_full[2];  /* TMA: mbarrier of each KV buffer (the tile landed) */
    float alpha[2][ROWS]; /* per tile parity: the rescale WG1 applies to its O half */
    float inv[ROWS];      /* 1 / l of the finished rows (NaN: bad item) */
    int zero[ROWS];       /* the row saw no key: output 0 */
};
constexpr size_t W_SMEM = 1024 + 3 * (size_t)W_TILE + ROWS * 4 + sizeof(WRows) + sizeof(WalkShared);

/* KDT_VA_PROFILE=1 (diagnostics, kdt_verify_attn_cuda_profile): the first thread of each
 * warpgroup of CTA 0 stamps clock64() at the phase boundaries of the first VA_PROF_TILES tiles of
 * its first item. WG0: tile start, KV landed, scores done, P written, PREADY passed, P V done;
 * WG1: tile start, PREADY passed, P V issued, next tile landed, KV passed, P V done + loads issued. */
constexpr int VA_PROF_TILES = 32, VA_PROF_PHASES = 6;
__device__ long long g_va_prof[2][VA_PROF_TILES][VA_PROF_PHASES];
__device__ int g_va_prof_tiles;
/* Item-level stamps of the same two threads (v4 only), cycles: kernel entry, item known, its
 * first data in (WG0: its own part of Q landed; WG1: Q and KV tile 0 landed), tiles done, both
 * warpgroups done, rows finished, outputs staged and sent. */
constexpr int VA_PROF_ITEM = 7;
__device__ long long g_va_prof_item[2][VA_PROF_ITEM];
int g_va_prof_kind; /* host: 0 = v4 stamps (per tile), 1 = seesaw stamps (per pair of tiles) */
int g_va_prof_nth;  /* host: the item v4 stamped (KDT_VA_PROFILE_ITEM) */

#if KDT_HAS_WGMMA
constexpr int WG_THREADS = 128;
/* Byte offset of 16-byte chunk c (0..71) of row r in 9 slabs of [64][64] bf16. */
__device__ __forceinline__ uint32_t w_slab_offset(int r, int c) {
    return (uint32_t)(c >> 3) * W_SLAB + wg::sw128_offset(r, (c & 7) * 8);
}

/* WG1's cp.async of KV keys [t0, t0 + 64) into 9 swizzled slabs at dst; keys >= ke are
 * zero-filled. 64 keys x 72 chunks over 128 threads: thread -> (key = t / 2, chunks t % 2 + 2 i). */
__device__ __forceinline__ void w_load_kv(const VaArgs &a, const int32_t *table, int t0, int ke, uint32_t dst,
                                          int &bad) {
    const int t = threadIdx.x - WG_THREADS, r = t >> 1;
    int bytes;
    const uint16_t *src = va_key_src(a, table, t0 + r, ke, bad, bytes);
#pragma unroll
    for (int c = t & 1; c < QK_CHUNKS; c += 2) va::cp_async_16(dst + w_slab_offset(r, c), src + c * 8, bytes);
}

/* The same tile by TMA, issued by one thread: 9 boxes of 64 keys x 64 columns, landing swizzled
 * like the cp.async path; bar completes when all 73,728 bytes are in. A tile never crosses a page
 * (page_size % 64 == 0 and splits are whole 64-key blocks: the launcher checks), so its keys are
 * rows page * page_size + t0 % page_size + 0..63 of the [n_pages * page_size][576] cache. Keys
 * past ke come from the page as they are; w_zero_tail clears their V. */
__device__ __forceinline__ void w_tma_kv(const VaArgs &a, const CUtensorMap *map, const int32_t *table, int t0,
                                         uint32_t dst, uint32_t bar, int &bad) {
    int page = __ldg(table + t0 / a.page_size);
    if (page < 0 || page >= a.n_pages) bad = 1, page = 0;
    const int y = page * a.page_size + t0 % a.page_size;
    wg::mbar_arrive_expect_tx(bar, W_TILE);
#pragma unroll
    for (int sl = 0; sl < W_SLABS; sl++) wg::tma_load_2d(dst + (uint32_t)sl * W_SLAB, map, 64 * sl, y, bar);
}

/* WG1 after a TMA tile landed: zero the V part (slabs 0-7) of keys [first, 64), which are masked
 * but would still meet P = 0 in P V (0 x NaN = NaN); slab 8 becomes P anyway. */
__device__ __forceinline__ void w_zero_tail(unsigned char *tile, int first) {
    const int t = threadIdx.x - WG_THREADS;
    for (int i = first * 64 + t; i < 64 * 64; i += WG_THREADS) { /* (key, 16-byte chunk of V) */
        const int r = i >> 6, c = i & 63;
        *reinterpret_cast<uint4 *>(tile + w_slab_offset(r, c)) = make_uint4(0, 0, 0, 0);
    }
}

/* One warpgroup's half of O += P V over a 64-key tile at kv: V = slabs 4 half .. 4 half + 3 (read
 * transposed), P as the A fragments of its 4 key steps in registers (pa), or bf16 [64][64] in the
 * tile's rope slab (both operands in shared memory). Issues the 4 products only: the caller
 * fences and commits (where that goes decides what overlaps, see the kernels). */
__device__ __forceinline__ void w_pv_regs(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t kv, int half) {
    const uint64_t v0 = wg::desc_v(kv, 64, 4 * half, 0, 64u * 128u, 1024u);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) wg::mma_m64n256k16_rs_tb(o, pa[kk], wg::desc_step(v0, wg::vstep_offset(kk)), 1);
}
__device__ __forceinline__ void w_pv_slab(float (&o)[128], uint32_t kv, int half) {
    const uint64_t p0 = wg::desc_kmajor(kv + 8 * W_SLAB, 64, 0), v0 = wg::desc_v(kv, 64, 4 * half, 0, 64u * 128u, 1024u);
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        wg::mma_m64n256k16_ss_tb(o, wg::desc_step(p0, wg::kstep_offset(64, kk)), wg::desc_step(v0, wg::vstep_offset(kk)),
                                 1);
}

/* The sm_90a kernels' epilogue (v4 and v5), in two steps around a CTA barrier.
 * w_finish_rows (one warpgroup, tq == 0 threads write): 1 / l, the zero flag and lse of this
 * thread's rows r0, r0 + 8 from their max m (log2 domain) and total sum l. */
__device__ __forceinline__ void w_finish_rows(const VaArgs &a, const VaItem &it, const float m[2], const float l[2],
                                              int any_bad, int r0, int tq, float *inv_out, int *zero_out) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = r0 + 8 * h;
        float inv, lse_v;
        bool zero;
        va_row_finish(m[h], l[h], any_bad, &inv, &lse_v, &zero);
        if (tq == 0) {
            inv_out[row] = inv, zero_out[row] = zero;
            if (row < it.rows_valid) {
                if (!it.split_mode) a.lse[it.row0 + row] = lse_v;
                else a.ws_lse[it.slot * ROWS + row] = lse_v;
            }
        }
    }
}

/* -inf into this thread's 2 rows x 16 keys of a 64-key score tile (m64n64 accumulator layout:
 * element 4 j + e is row r0 + 8 (e >> 1), key t0 + 8 j + 2 tq + (e & 1)) where va_visible_window
 * hides them; v4 and v5 call it only on tiles reaching the tree slots or the split end. */
__device__ __forceinline__ void w_mask_tile(float (&sc)[32], const VaArgs &a, const VaItem &it, const int *sNode,
                                            int r0, int tq, int t0) {
    const uint64_t vis0 = va_visible_window(a, it, sNode, r0, t0);
    const uint64_t vis1 = va_visible_window(a, it, sNode, r0 + 8, t0);
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            if (!((((e >> 1) ? vis1 : vis0) >> (8 * j + 2 * tq + (e & 1))) & 1ull)) sc[4 * j + e] = -INFINITY;
}

/* The normalized pair of this thread's O half at row r0 + 8 h, columns 8 j + 2 tq (+1) of the half. */
__device__ __forceinline__ float2 w_out_pair(const float (&o)[128], int j, int h, float inv, bool zero) {
    return make_float2(zero ? 0.f : o[4 * j + 2 * h] * inv, zero ? 0.f : o[4 * j + 2 * h + 1] * inv);
}

/* The scale of a split partial's (row r0 + 8 h, this warpgroup's 256 columns): the quad's max |x|
 * (every lane must call it); the same value goes to the half's 4 groups of 64 columns. */
__device__ __forceinline__ void w_half_scales(const float (&o)[128], int h, float inv, bool zero, float *up, float *down) {
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const float2 x = w_out_pair(o, j, h, inv, zero);
        mx = fmaxf(mx, fmaxf(fabsf(x.x), fabsf(x.y)));
    }
    va::quad_part_scales(mx, up, down);
}
__device__ __forceinline__ void w_store_scales(const VaArgs &a, const VaItem &it, int row, int wgi, float down) {
    *reinterpret_cast<float4 *>(a.ws_scale + (it.slot * ROWS + row) * PART_GROUPS + 4 * wgi) = make_float4(down, down, down, down);
}
/* w_store_half (every thread, after the barrier; v5): this warpgroup's 256 output columns of rows r0,
 * r0 + 8, normalized: bf16 out, or the fp16 partial (and its scales) of a split item. */
__device__ __forceinline__ void w_store_half(const VaArgs &a, const VaItem &it, const float (&o)[128],
                                             const float *inv_in, const int *zero_in, int r0, int wgi, int tq) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = r0 + 8 * h;
        const float inv = inv_in[row];
        const bool zero = zero_in[row] != 0;
        const int col0 = 256 * wgi + 2 * tq;
        if (!it.split_mode) {
            if (row >= it.rows_valid) continue;
            uint16_t *dst = a.out + (it.row0 + row) * D_V + col0;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const float2 x = w_out_pair(o, j, h, inv, zero);
                *reinterpret_cast<uint32_t *>(dst + 8 * j) = va::pack_bf16x2(x.x, x.y);
            }
        } else {
            float up, down;
            w_half_scales(o, h, inv, zero, &up, &down);
            if (row >= it.rows_valid) continue;
            uint16_t *dst = a.ws_o + it.slot * (long long)SLOT_O_HALVES + row * D_V + col0;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const float2 x = w_out_pair(o, j, h, inv, zero);
                *reinterpret_cast<uint32_t *>(dst + 8 * j) = va::pack_half2(x.x * up, x.y * up);
            }
            if (tq == 0) w_store_scales(a, it, row, wgi, down);
        }
    }
}
/* v4's epilogue: w_store_half's values (its loop over the two rows, kept apart so that v5's code
 * stays as measured) staged row-major in shared memory at `stage` (the Q and KV buffers, free
 * once both warpgroups are past their last product): rows of 1,024 B (bf16 out, or a split item's
 * fp16 partial, whose scales go straight to global memory), each padded by 16 B so a warp's 4-byte
 * stores hit distinct banks; then one thread per valid row sends it to global memory with one bulk
 * copy (w_send_rows). Each warp store instruction of w_store_half wrote 8 rows x 16 B: ~8,400
 * cycles for a 64-row bf16 tile, against ~3,600 for a whole 64-key tile (H200, session 13,
 * KDT_VA_PROFILE). */
constexpr uint32_t W_STAGE_ROW = D_V * 2 + 16; /* row stride, bytes: bf16 out or fp16 partial */
static_assert(ROWS * W_STAGE_ROW <= 3 * W_TILE, "the staged tile fits the Q and KV buffers");
__device__ __forceinline__ void w_stage_half(const VaArgs &a, const VaItem &it, const float (&o)[128], const float *inv_in,
                                             const int *zero_in, int r0, int wgi, int tq, unsigned char *stage) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = r0 + 8 * h;
        const float inv = inv_in[row];
        const bool zero = zero_in[row] != 0;
        const int col0 = 256 * wgi + 2 * tq;
        uint32_t *dst = reinterpret_cast<uint32_t *>(stage + row * W_STAGE_ROW) + col0 / 2;
        if (!it.split_mode) {
            if (row >= it.rows_valid) continue;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const float2 x = w_out_pair(o, j, h, inv, zero);
                dst[4 * j] = va::pack_bf16x2(x.x, x.y);
            }
        } else {
            float up, down;
            w_half_scales(o, h, inv, zero, &up, &down);
            if (row >= it.rows_valid) continue;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const float2 x = w_out_pair(o, j, h, inv, zero);
                dst[4 * j] = va::pack_half2(x.x * up, x.y * up);
            }
            if (tq == 0) w_store_scales(a, it, row, wgi, down);
        }
    }
}
/* After w_stage_half, a fence_proxy_async and a barrier: threads 0 .. rows_valid - 1 each copy
 * their row out (one bulk group per thread; bulk_wait_read before the buffers are reused). */
__device__ __forceinline__ void w_send_rows(const VaArgs &a, const VaItem &it, uint32_t stage) {
    const int r = threadIdx.x;
    if (r >= it.rows_valid) return;
    uint16_t *dst = it.split_mode ? a.ws_o + it.slot * (long long)SLOT_O_HALVES + (long long)r * D_V
                                  : a.out + (it.row0 + r) * D_V;
    wg::bulk_store(dst, stage + (uint32_t)r * W_STAGE_ROW, D_V * 2);
    wg::bulk_commit();
}
#endif

/* PROF: the KDT_VA_PROFILE build of the kernel (phase stamps); the default one has none.
 * FUSED (KDT_VA_FUSED=1, opt-in: no measurable gain on the H200, docs/verify_attn_notes.md session 8;
 * softmax scale > 0 only): FlashMLA's softmax shape.
 * The row max is taken on the raw scores and scaled once (for a positive scale that is exactly
 * the max of the scaled scores, rounding being monotonic), the scale folds into one FFMA per
 * element before the exponent (one rounding fewer: P may differ from v4's in the last bit), and
 * WG0 rescales its O half right after the max, in the softmax's basic block, where the 128
 * independent multiplies can fill the exponent chain's latency, instead of after PREADY on the
 * path to its P V; and it issues that P V as soon as P is in registers, before P's stores to
 * shared memory and the PREADY barrier (it needs nothing from WG1). */
template <bool PROF, bool FUSED = false>
__global__ void __launch_bounds__(THREADS, 1) verify_attn_sm90_kernel(const VaArgs a, const __grid_constant__ CUtensorMap kv_map) {
#if KDT_HAS_WGMMA
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t raw = va::smem_addr(smem_raw), pad = (1024u - (raw & 1023u)) & 1023u;
    unsigned char *smem = smem_raw + pad;
    int *sNode = reinterpret_cast<int *>(smem + 3 * W_TILE);
    WRows *sRows = reinterpret_cast<WRows *>(smem + 3 * W_TILE + ROWS * 4);
    WalkShared *sWalk = reinterpret_cast<WalkShared *>(smem + 3 * W_TILE + ROWS * 4 + sizeof(WRows));
    const uint32_t q_base = raw + pad, kv_base = q_base + W_TILE;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wgi = warp >> 2, wq = warp & 3, g = lane >> 2, tq = lane & 3;
    const int r0 = 16 * wq + g; /* this thread's accumulator rows: r0, r0 + 8 */
    /* one item only: the first, or with KDT_VA_PROFILE_ITEM=k CTA 0's k-th, whose "entry" stamp is
     * then its loop top (the previous item just stored), so the item-to-item gap shows */
    bool stamp = PROF && blockIdx.x == 0 && (tid & (WG_THREADS - 1)) == 0 && a.prof_item == 0;
    pdl::launch_dependents(); /* the combine's CTAs may take the SMs that run out of items */
    const uint32_t bar0 = va::smem_addr(&sRows->kv_full[0]);
    const bool tma = a.use_tma != 0, issuer = tid == WG_THREADS; /* WG1's first thread issues TMA */
    uint32_t kv_par = 0; /* bit b: parity of the next wait on buffer b's barrier (every thread) */
    if (PROF && stamp) g_va_prof_item[wgi][0] = clock64();
    if (tma) {
        if (tid == 0) wg::mbar_init(bar0, 1), wg::mbar_init(bar0 + 8, 1);
        wg::fence_proxy_async();
        __syncthreads();
    }
#define W_STAMP(ph) \
    if (PROF && stamp && it < VA_PROF_TILES) g_va_prof[wgi][it][ph] = clock64()
#define W_ISTAMP(k) \
    if (PROF && stamp) g_va_prof_item[wgi][k] = clock64()

    WalkState walk;
    VaItem itm;
    for (long long i = blockIdx.x;; i += gridDim.x) {
        if (PROF) {
            const long long nth = (i - blockIdx.x) / gridDim.x;
            stamp = blockIdx.x == 0 && (tid & (WG_THREADS - 1)) == 0 && nth == a.prof_item;
            if (stamp && nth > 0) g_va_prof_item[wgi][0] = clock64();
        }
        wg::bulk_wait_read(); /* the last item's rows have left the Q and KV buffers */
        const int next = va_next_item(a, i, walk, sWalk, sNode, &itm);
        if (next <= 0) { if (next == 0) break; continue; }
        const int P = itm.P, kb = itm.kb, ke = itm.ke, n_tiles = (ke - kb + 63) / 64;
        if (stamp && tid == 0) g_va_prof_tiles = n_tiles < VA_PROF_TILES ? n_tiles : VA_PROF_TILES;
        W_ISTAMP(1);
        const int32_t *table = itm.table;
        int bad = 0;
        /* Q rows (all threads: one group), then WG1 starts both tile buffers (one group each) */
        va_load_q(a, itm, q_base, [](int r, int c) { return w_slab_offset(r, c); });
        va::cp_async_commit();
        if (wgi == 1) {
            for (int it = 0; it < 2; it++) {
                if (tma) {
                    if (it < n_tiles && issuer)
                        w_tma_kv(a, &kv_map, table, kb + 64 * it, kv_base + (uint32_t)it * W_TILE, bar0 + 8 * it, bad);
                } else {
                    if (it < n_tiles) w_load_kv(a, table, kb + 64 * it, ke, kv_base + (uint32_t)it * W_TILE, bad);
                    va::cp_async_commit();
                }
            }
            if (n_tiles > 0) {
                if (tma) {
                    va::cp_async_wait_all(); /* Q */
                    wg::mbar_wait(bar0, kv_par & 1u);
                    kv_par ^= 1u;
                    if (ke - kb < 64) w_zero_tail(smem + (kv_base - q_base), ke - kb);
                } else {
                    va::cp_async_wait<1>(); /* Q and tile 0 landed (tile 1 may be in flight) */
                }
                wg::fence_proxy_async();
                wg::bar_sync(BAR_KV, THREADS);
            }
        } else {
            va::cp_async_wait_all(); /* this thread's Q part; KV[0] publishes it with WG1's */
            wg::fence_proxy_async();
        }

        W_ISTAMP(2);
        float o[128]; /* O rows r0 (+8), columns 256 wgi + 8 j + 2 tq (+1) */
#pragma unroll
        for (int e = 0; e < 128; e++) o[e] = 0.f;

        float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* WG0's running row max and sum */
        if (wgi == 0) {
            for (int it = 0; it < n_tiles; it++) {
                const int t0 = kb + it * 64, b = it & 1;
                const uint32_t kv_cur = kv_base + (uint32_t)b * W_TILE;
                W_STAMP(0);
                wg::bar_sync(BAR_KV, THREADS);
                if (tma) { /* complete already (WG1 saw it); this thread's view of the TMA bytes */
                    wg::mbar_wait(bar0 + 8 * b, (kv_par >> b) & 1u);
                    kv_par ^= 1u << b;
                }
                W_STAMP(1);

                float sc[32];
#pragma unroll
                for (int e = 0; e < 32; e++) sc[e] = 0.f;
                wg::fence();
                /* the k steps' descriptors: the bases' start addresses moved (desc_step) */
                const uint64_t qd0 = wg::desc_kmajor(q_base, ROWS, 0), kd0 = wg::desc_kmajor(kv_cur, 64, 0);
#pragma unroll
                for (int kk = 0; kk < D_QK / 16; kk++)
                    wg::mma_m64n64k16_ss(sc, wg::desc_step(qd0, wg::kstep_offset(ROWS, kk)),
                                         wg::desc_step(kd0, wg::kstep_offset(64, kk)), kk > 0);
                wg::commit();
                wg::wait<0>();
                W_STAMP(2);

                /* scale into the log2 domain; the ancestor mask only where a tile reaches the tree
                 * slots or the split end, as a separate loop: a per-element test of need_mask
                 * compiled to 32 branches around the mask code in every tile */
                const bool need_mask = t0 + 64 > P || t0 + 64 > ke;
                if (!FUSED) {
#pragma unroll
                    for (int e = 0; e < 32; e++) sc[e] *= a.scale_log2;
                }
                if (need_mask) w_mask_tile(sc, a, itm, sNode, r0, tq, t0);
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int e = 0; e < 32; e++) mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], sc[e]);
                float alpha[2], mu[2];
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
                    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
                    if (FUSED) mx[h] *= a.scale_log2; /* -inf stays -inf (scale > 0) */
                    const float mn = fmaxf(m[h], mx[h]);
                    alpha[h] = mn == -INFINITY ? 1.f : va_ex2(m[h] - mn);
                    mu[h] = mn == -INFINITY ? 0.f : mn;
                    m[h] = mn;
                }
                if (FUSED) { /* this tile's P V waited last iteration: o is ours to rescale */
#pragma unroll
                    for (int e = 0; e < 128; e++) o[e] *= alpha[(e >> 1) & 1];
                }
                float ls[2] = {0.f, 0.f};
#pragma unroll
                for (int e = 0; e < 32; e++) {
                    const float pv = FUSED ? va_ex2(fmaf(sc[e], a.scale_log2, -mu[(e >> 1) & 1])) : va_ex2(sc[e] - mu[(e >> 1) & 1]);
                    sc[e] = pv;
                    ls[(e >> 1) & 1] += pv; /* fp32 weights: lse stays accurate to fp32 rounding */
                }
                l[0] = l[0] * alpha[0] + ls[0];
                l[1] = l[1] * alpha[1] + ls[1];
                /* P (bf16) into the rope slab for WG1, alpha beside it; then WG0's own half */
                uint32_t pa[4][4];
#pragma unroll
                for (int kk = 0; kk < 4; kk++) wg::s_to_a_frag(sc, kk, pa[kk]);
                if (FUSED) {
                    /* WG0's P V needs nothing from WG1 (O is rescaled, P is in registers, V landed
                     * at KV): issue it before P goes out and before PREADY; the stores below only
                     * read pa, which the product reads too */
                    wg::fence();
                    w_pv_regs(o, pa, kv_cur, 0);
                    wg::commit();
                }
                unsigned char *p_slab = smem + (kv_cur - q_base) + 8 * W_SLAB;
#pragma unroll
                for (int kk = 0; kk < 4; kk++) {
                    /* pa[kk] = rows r0, r0 + 8 x keys 16 kk + 2 tq (+1), and + 8 */
                    *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0, 16 * kk + 2 * tq)) = pa[kk][0];
                    *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0 + 8, 16 * kk + 2 * tq)) = pa[kk][1];
                    *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0, 16 * kk + 8 + 2 * tq)) = pa[kk][2];
                    *reinterpret_cast<uint32_t *>(p_slab + wg::sw128_offset(r0 + 8, 16 * kk + 8 + 2 * tq)) = pa[kk][3];
                }
                if (tq == 0) sRows->alpha[b][r0] = alpha[0], sRows->alpha[b][r0 + 8] = alpha[1];
                wg::fence_proxy_async();
                W_STAMP(3);
                wg::bar_sync(BAR_PREADY, THREADS);
                W_STAMP(4);
                if (!FUSED) {
#pragma unroll
                    for (int e = 0; e < 128; e++) o[e] *= alpha[(e >> 1) & 1];
                    wg::fence();
                    w_pv_regs(o, pa, kv_cur, 0);
                    wg::commit();
                }
                wg::wait<0>();
                W_STAMP(5);
            }
        } else {
            for (int it = 0; it < n_tiles; it++) {
                const int b = it & 1;
                const uint32_t kv_cur = kv_base + (uint32_t)b * W_TILE;
                W_STAMP(0);
                wg::bar_sync(BAR_PREADY, THREADS);
                W_STAMP(1);
                const float al0 = sRows->alpha[b][r0], al1 = sRows->alpha[b][r0 + 8];
#pragma unroll
                for (int e = 0; e < 128; e++) o[e] *= (e & 2) ? al1 : al0;
                wg::fence();
                w_pv_slab(o, kv_cur, 1); /* P from the rope slab */
                wg::commit();
                /* no wait here: this product runs on while WG0, past KV, forms the next scores */
                W_STAMP(2);
                if (it + 1 < n_tiles) {
                    /* tile it + 1 (issued a tile ago) landed: hand it over; WG0 meets us here only
                     * after its own product on tile it, so once ours is done too, buffer b is free
                     * for tile it + 2 */
                    if (tma) {
                        const int nb = b ^ 1, t1 = kb + 64 * (it + 1);
                        wg::mbar_wait(bar0 + 8 * nb, (kv_par >> nb) & 1u);
                        kv_par ^= 1u << nb;
                        if (ke - t1 < 64) w_zero_tail(smem + (kv_base - q_base) + (size_t)nb * W_TILE, ke - t1);
                    } else {
                        va::cp_async_wait<0>();
                    }
                    wg::fence_proxy_async();
                    W_STAMP(3);
                    wg::bar_sync(BAR_KV, THREADS);
                    W_STAMP(4);
                    wg::wait<0>();
                    if (tma) {
                        if (it + 2 < n_tiles && issuer)
                            w_tma_kv(a, &kv_map, table, kb + 64 * (it + 2), kv_cur, bar0 + 8 * b, bad);
                    } else {
                        if (it + 2 < n_tiles) w_load_kv(a, table, kb + 64 * (it + 2), ke, kv_cur, bad);
                        va::cp_async_commit();
                    }
                    W_STAMP(5);
                } else {
                    wg::wait<0>();
                }
            }
            va::cp_async_wait_all();
        }

        /* the finished rows' normalisation (WG0 holds m and l), then each warpgroup's half */
        W_ISTAMP(3);
        const int any_bad = __syncthreads_or(bad);
        W_ISTAMP(4);
        if (wgi == 0) {
            float lt[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                lt[h] = l[h];
                lt[h] += __shfl_xor_sync(0xffffffffu, lt[h], 1);
                lt[h] += __shfl_xor_sync(0xffffffffu, lt[h], 2);
            }
            w_finish_rows(a, itm, m, lt, any_bad, r0, tq, sRows->inv, sRows->zero);
        }
        __syncthreads(); /* sRows->inv / zero written */
        W_ISTAMP(5);
        w_stage_half(a, itm, o, sRows->inv, sRows->zero, r0, wgi, tq, smem);
        wg::fence_proxy_async();
        __syncthreads();
        w_send_rows(a, itm, q_base);
        W_ISTAMP(6);
    }
    wg::bulk_wait(); /* no copy outlives the CTA's shared memory */
#undef W_ISTAMP
#undef W_STAMP
#else
    (void)a, (void)kv_map;
    __trap(); /* no wgmma in this build: the launcher never starts it (sm90_ready checks the PTX arch) */
#endif
}

#include "verify_attn_seesaw.cuh" /* v5 (KDT_VA_SEESAW=1): correct, slower than v4 on the H200 */

/* Merges the partials of split streams: per row, lse = log sum_k exp(lse_k) and
 * out = sum_k exp(lse_k - lse) o_k, summed in split order (bitwise reproducible). One warp per
 * row (combine_row). A CTA walks over (stream, row tile, part) items of split streams, the row
 * tile cut into `parts` (1, 2, 4 or 8) so that a few split row tiles still spread over the whole
 * grid: a lone stream's 33 row tiles (S 1, q 33) run as 264 items of one row per warp instead of 33
 * CTAs with eight rows per warp in a row (the merge is a chain of dependent loads: ~20 us there
 * under ncu), while a large batch keeps whole row tiles (one walk per row tile: with parts = 8 for
 * every launch S 64, P 4096, q 33 took 6 % longer). The K partial rows of a row are loaded four at
 * a time before they are summed, in the same order. */
constexpr int CB_WARPS = THREADS / 32;
constexpr int CB_MAX_PARTS = ROWS / CB_WARPS;
static_assert(ROWS % CB_WARPS == 0, "a combine part of one row per warp");
__device__ __forceinline__ void combine_row(const VaArgs &a, const VaPlan &pl, long long slot_base, int rtile,
                                            long long row0, int r, int lane) {
    const int K = pl.splits;
    const float la = lane < K ? a.ws_lse[(slot_base + (long long)lane * pl.rt + rtile) * ROWS + r] : -INFINITY;
    const float lb = lane + 32 < K ? a.ws_lse[(slot_base + (long long)(lane + 32) * pl.rt + rtile) * ROWS + r] : -INFINITY;
    const bool any_nan = __any_sync(0xffffffffu, isnan(la) || isnan(lb));
    float mx = fmaxf(la, lb);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    uint4 *dst = reinterpret_cast<uint4 *>(a.out + (row0 + r) * D_V); /* lane's 8 columns 8 (lane + 32 j) */
    if (any_nan || mx == -INFINITY) {
        const uint32_t fill = any_nan ? 0x7fc07fc0u : 0u;
#pragma unroll
        for (int j = 0; j < 2; j++) dst[lane + 32 * j] = make_uint4(fill, fill, fill, fill);
        if (lane == 0) a.lse[row0 + r] = any_nan ? __int_as_float(0x7fc00000) : -INFINITY;
        return;
    }
    const float wa = lane < K ? expf(la - mx) : 0.f, wb = lane + 32 < K ? expf(lb - mx) : 0.f;
    float sum = wa + wb;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float inv = 1.f / sum;
    float acc[2][8];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[j][e] = 0.f;
    /* split k's slot is slot_base + k rt + rtile; 8 fp16 values (16 B) per lane and j, group
     * (lane + 32 j) / 8 of 64 columns */
    const long long slot0 = slot_base + rtile;
    const uint4 *src0 = reinterpret_cast<const uint4 *>(a.ws_o + slot0 * (long long)SLOT_O_HALVES + (long long)r * D_V);
    const float *sc0 = a.ws_scale + (slot0 * ROWS + r) * PART_GROUPS;
    const long long k_stride = (long long)pl.rt * (long long)(SLOT_O_HALVES / 8);  /* uint4s per split */
    const long long sc_stride = (long long)pl.rt * ROWS * PART_GROUPS;              /* scales per split */
    for (int k0 = 0; k0 < K; k0 += 4) {
        uint4 v[4][2];
        float down[4][2], wk[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int k = k0 + u; /* warp-uniform */
            wk[u] = __shfl_sync(0xffffffffu, k < 32 ? wa : wb, k & 31) * inv;
            if (k < K) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    v[u][j] = src0[k * k_stride + lane + 32 * j];
                    down[u][j] = sc0[k * sc_stride + ((lane + 32 * j) >> 3)];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (k0 + u < K) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const uint32_t w4[4] = {v[u][j].x, v[u][j].y, v[u][j].z, v[u][j].w};
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float2 x = __half22float2(*reinterpret_cast<const __half2 *>(&w4[e]));
                        acc[j][2 * e] += wk[u] * (x.x * down[u][j]);
                        acc[j][2 * e + 1] += wk[u] * (x.y * down[u][j]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 2; j++)
        dst[lane + 32 * j] = make_uint4(va::pack_bf16x2(acc[j][0], acc[j][1]), va::pack_bf16x2(acc[j][2], acc[j][3]),
                                        va::pack_bf16x2(acc[j][4], acc[j][5]), va::pack_bf16x2(acc[j][6], acc[j][7]));
    if (lane == 0) a.lse[row0 + r] = mx + logf(sum);
}
__global__ void __launch_bounds__(THREADS) verify_attn_combine(const VaArgs a) {
    __shared__ WalkShared sWalk;
    __shared__ long long sTiles;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (warp == 0) { /* the number of split row tiles: one walk past the end */
        int s0 = 0;
        long long tiles = 0, slots = 0;
        walk_to<true>(a, LLONG_MAX, s0, tiles, slots, &sWalk);
        if (lane == 0) sTiles = tiles;
    }
    /* launched with PDL: the walk above reads only the call's inputs (final before the main
     * kernel started); the partials and out need the whole main grid done */
    pdl::wait();
    __syncthreads();
    int parts = 1;
    while (parts < CB_MAX_PARTS && sTiles * parts < (long long)gridDim.x) parts *= 2;
    const int rows_per_part = ROWS / parts;
    int walk_s = 0;
    long long walk_items = 0, walk_slots = 0;
    for (long long i = blockIdx.x;; i += gridDim.x) {
        const long long tile_item = i / parts;
        const int part = (int)(i % parts);
        __syncthreads();
        if (warp == 0) walk_to<true>(a, tile_item, walk_s, walk_items, walk_slots, &sWalk);
        __syncthreads();
        if (!sWalk.found) break;
        const VaPlan pl = sWalk.plan;
        const long long slot_base = sWalk.slot_base;
        if (slot_base + pl.slots > a.slot_capacity) continue; /* the main kernel wrote NaN */
        const int rtile = (int)(tile_item - sWalk.item_base);
        const int g0 = rtile * ROWS, rows_valid = min(ROWS, pl.n * a.H - g0);
        const long long row0 = (long long)sWalk.s * a.max_nodes * a.H + g0;
        const int r_end = min((part + 1) * rows_per_part, rows_valid);
        for (int r = part * rows_per_part + warp; r < r_end; r += CB_WARPS) combine_row(a, pl, slot_base, rtile, row0, r, lane);
    }
}

/* Kernel configurations, by shared memory per block (largest first). */
enum { CFG_BN64_2STAGE = 0, CFG_BN64_1STAGE = 1, CFG_BN16_1STAGE = 2, CFG_NONE = 3 };
constexpr int MAX_DEVICES = 64;
std::atomic<int> g_dev_cfg[MAX_DEVICES]; /* 0 = not probed yet, else cfg + 1 */
std::atomic<int> g_dev_sms[MAX_DEVICES];

/* Lets `kernel` take `bytes` of dynamic shared memory. */
template <class K>
cudaError_t allow_smem(K kernel, size_t bytes) {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
}
template <int BN, int STAGES>
cudaError_t raise_smem_limit() {
    const cudaError_t e = allow_smem(verify_attn_kernel<BN, STAGES, false>, Cfg<BN, STAGES>::SMEM);
    return e != cudaSuccess ? e : allow_smem(verify_attn_kernel<BN, STAGES, true>, Cfg<BN, STAGES>::SMEM);
}

/* KDT_VA_PORTABLE_CFG=bn64x2|bn64x1|bn16 runs the portable kernel in that configuration instead of
 * the device's largest, if it fits: the A100's (bn64x1) and the 99 KB parts' (bn16: RTX PRO 6000
 * Blackwell, sm_86/89) configurations are tested on the H200 that way (gpu_test_verify_attn_gpu).
 * Read per launch; the configurations give the same results up to rounding (BN changes the tile
 * boundaries of the online softmax), each checked against the CPU twin. */
kdt_status forced_config(int best, int *cfg) {
    const char *env = getenv("KDT_VA_PORTABLE_CFG");
    if (!env || !*env) return KDT_OK;
    static const char *names[3] = {"bn64x2", "bn64x1", "bn16"};
    int c = -1;
    for (int i = 0; i < 3; i++)
        if (!strcmp(env, names[i])) c = i;
    KDT_CHECK_ARG(c >= 0, "kdt_verify_attn_cuda: KDT_VA_PORTABLE_CFG = '%s', expected bn64x2, bn64x1 or bn16", env);
    if (c < best)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "kdt_verify_attn_cuda: KDT_VA_PORTABLE_CFG=%s needs more shared memory "
                        "per block than this device allows (its largest configuration is %s)", env, names[best]);
    const cudaError_t e = c == CFG_BN64_2STAGE ? raise_smem_limit<64, 2>()
                          : c == CFG_BN64_1STAGE ? raise_smem_limit<64, 1>() : raise_smem_limit<16, 1>();
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_verify_attn_cuda: cudaFuncSetAttribute (%s): %s", env, cudaGetErrorString(e));
    *cfg = c;
    return KDT_OK;
}

/* Picks (once per device) the configuration that fits the device's shared memory per block. */
kdt_status device_config(int *cfg, int *sms) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_verify_attn_cuda: cudaGetDevice: %s", cudaGetErrorString(e));
    if (dev >= 0 && dev < MAX_DEVICES && g_dev_cfg[dev].load(std::memory_order_acquire) != 0) {
        *cfg = g_dev_cfg[dev].load(std::memory_order_acquire) - 1;
        *sms = g_dev_sms[dev].load(std::memory_order_relaxed);
        return KDT_OK;
    }
    int optin = 0, n_sm = 0;
    if ((e = kdt_smem_optin(dev, &optin)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_verify_attn_cuda: device attributes: %s", cudaGetErrorString(e));
    int c = CFG_NONE;
    if ((size_t)optin >= Cfg<64, 2>::SMEM) c = CFG_BN64_2STAGE, e = raise_smem_limit<64, 2>();
    else if ((size_t)optin >= Cfg<64, 1>::SMEM) c = CFG_BN64_1STAGE, e = raise_smem_limit<64, 1>();
    else if ((size_t)optin >= Cfg<16, 1>::SMEM) c = CFG_BN16_1STAGE, e = raise_smem_limit<16, 1>();
    if (c == CFG_NONE)
        return kdt_fail(KDT_ERR_UNSUPPORTED,
                        "kdt_verify_attn_cuda: device %d allows %d bytes of shared memory per block, "
                        "the smallest configuration needs %zu", dev, optin, Cfg<16, 1>::SMEM);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_verify_attn_cuda: cudaFuncSetAttribute: %s", cudaGetErrorString(e));
    *cfg = c;
    *sms = n_sm > 0 ? n_sm : 1;
    if (dev >= 0 && dev < MAX_DEVICES) {
        g_dev_sms[dev].store(*sms, std::memory_order_relaxed);
        g_dev_cfg[dev].store(c + 1, std::memory_order_release);
    }
    return KDT_OK;
}

/* The sm_90a kernel on this device (once per device): 1 if it has wgmma code (built from
 * compute_90a PTX), the device is a Hopper and its shared memory fits; 0 if not; < 0 on error. */
std::atomic<int> g_dev_sm90[MAX_DEVICES]; /* 0 = not probed yet, 1 = no, 2 = yes */

int sm90_ready(const char **why) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return -1;
    const int cached = dev >= 0 && dev < MAX_DEVICES ? g_dev_sm90[dev].load(std::memory_order_acquire) : 0;
    if (cached) {
        *why = cached == 2 ? NULL : "the device is not an sm_90 GPU, the binary lacks sm_90a code, or shared memory is short";
        return cached == 2;
    }
    int major = 0, optin = 0;
    cudaFuncAttributes fa;
    int ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
             kdt_smem_optin(dev, &optin) == cudaSuccess &&
             cudaFuncGetAttributes(&fa, verify_attn_sm90_kernel<false>) == cudaSuccess;
    ok = ok && major == 9 && fa.ptxVersion >= 90 && (size_t)optin >= W_SMEM && (size_t)optin >= SS_SMEM &&
         allow_smem(verify_attn_sm90_kernel<false>, W_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_sm90_kernel<true>, W_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_sm90_kernel<false, true>, W_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_sm90_kernel<true, true>, W_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_seesaw_kernel<false>, SS_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_seesaw_kernel<true>, SS_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_seesaw_kernel<false, true>, SS_SMEM) == cudaSuccess &&
         allow_smem(verify_attn_seesaw_kernel<true, true>, SS_SMEM) == cudaSuccess;
    (void)cudaGetLastError();
    if (dev >= 0 && dev < MAX_DEVICES) g_dev_sm90[dev].store(ok ? 2 : 1, std::memory_order_release);
    *why = ok ? NULL : "the device is not an sm_90 GPU, the binary lacks sm_90a code, or shared memory is short";
    return ok;
}

/* The one dispatch place: the sm_90a kernel where it can run, unless KDT_VERIFY_ATTN=mma or the
 * cache is FP8 (the portable kernel reads it);
 * KDT_VERIFY_ATTN=wgmma where it cannot is an error rather than a silent fallback. */
kdt_status choose_path(const char *who, int fp8, int *use_wgmma) {
    const char *path = getenv("KDT_VERIFY_ATTN");
    const int want_wgmma = path && !strcmp(path, "wgmma"), want_mma = path && !strcmp(path, "mma");
    KDT_CHECK_ARG(!path || !*path || want_wgmma || want_mma,
                  "%s: KDT_VERIFY_ATTN = '%s', expected 'mma' or 'wgmma'", who, path);
    *use_wgmma = 0;
    if (fp8 && want_wgmma) /* only the portable kernel reads FP8 caches */
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: KDT_VERIFY_ATTN=wgmma: the sm_90a kernel reads bf16 caches only "
                        "(kv_format = %d)", who, KDT_KV_FP8_SCALED);
    if (want_mma || fp8) return KDT_OK;
    const char *why = NULL;
    const int ready = sm90_ready(&why);
    if (ready < 0) return kdt_fail(KDT_ERR_CUDA, "%s: cudaGetDevice failed", who);
    if (!ready && want_wgmma) return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: KDT_VERIFY_ATTN=wgmma: %s", who, why);
    *use_wgmma = ready;
    return KDT_OK;
}

/* The TMA map of one layer's KV cache, [n_pages * page_size rows][576] bf16 in boxes of 64 x 64
 * with the 128B swizzle, for the sm_90a kernel. 0 (the kernel then loads by cp.async) if pages
 * are not whole 64-key tiles, KDT_VA_TMA=0, or the driver has no encoder (it comes through the
 * runtime's entry-point query, so nothing links libcuda). */
int make_kv_map(const kdt_verify_attn_params *p, CUtensorMap *map) {
    static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> encode{nullptr};
    static std::atomic<int> probed{0};
    const char *env = getenv("KDT_VA_TMA");
    if ((env && !strcmp(env, "0")) || p->page_size % 64 != 0 || (int64_t)p->n_pages * p->page_size > INT32_MAX)
        return 0;
    if (!probed.load(std::memory_order_acquire)) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            encode.store((PFN_cuTensorMapEncodeTiled_v12000)fn, std::memory_order_release);
        (void)cudaGetLastError();
        probed.store(1, std::memory_order_release);
    }
    PFN_cuTensorMapEncodeTiled_v12000 f = encode.load(std::memory_order_acquire);
    if (!f) return 0;
    const cuuint64_t dims[2] = {(cuuint64_t)D_QK, (cuuint64_t)p->n_pages * (cuuint64_t)p->page_size};
    const cuuint64_t strides[1] = {(cuuint64_t)D_QK * 2};
    const cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    return f(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)p->kv_cache, dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace

extern "C" kdt_status kdt_verify_attn_cuda_profile(char *out, size_t cap) {
    long long st[2][VA_PROF_TILES][VA_PROF_PHASES];
    int tiles = 0;
    cudaError_t e = cudaMemcpyFromSymbol(st, g_va_prof, sizeof st);
    if (e == cudaSuccess) e = cudaMemcpyFromSymbol(&tiles, g_va_prof_tiles, sizeof tiles);
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "kdt_verify_attn_cuda_profile: %s", cudaGetErrorString(e));
    KDT_CHECK_ARG(out && cap > 0, "kdt_verify_attn_cuda_profile: no output buffer");
    /* mean cycles between consecutive stamps over the middle tiles (the first and last differ) */
    static const char *names_v4[2][VA_PROF_PHASES] = {
        {"wait KV", "scores", "softmax + P out", "wait PREADY", "P V", "to next tile"},
        {"wait PREADY", "P V issue", "wait next tile", "wait KV", "P V rest + issue loads", "to next tile"}};
    static const char *names_v5[2][VA_PROF_PHASES] = {
        {"softmax0", "wait SCALE0 + P0 V0L issue", "wait SCALE1 + P0' out + P1 V1L issue", "wait P0", "next S0",
         "to next pair"},
        {"wait SCALE0", "softmax1 + P1 out", "wait SCALE1", "wait P0 + P V issue + waits", "next S1",
         "to next pair"}};
    const char *(*names)[VA_PROF_PHASES] = g_va_prof_kind ? names_v5 : names_v4;
    size_t n = (size_t)snprintf(out, cap, "verify_attn sm_90a %s phases (CTA 0, item %d, %s 1..%d), mean cycles:",
                                g_va_prof_kind ? "v5 (seesaw)" : "v4", g_va_prof_kind ? 0 : g_va_prof_nth,
                                g_va_prof_kind ? "pairs of tiles" : "tiles", tiles - 2);
    for (int w = 0; w < 2; w++) {
        n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, "\n  WG%d:", w);
        for (int ph = 0; ph < VA_PROF_PHASES; ph++) {
            double sum = 0;
            int cnt = 0;
            for (int t = 1; t + 1 < tiles; t++) {
                const long long end = ph + 1 < VA_PROF_PHASES ? st[w][t][ph + 1] : st[w][t + 1][0];
                if (end > 0 && st[w][t][ph] > 0) sum += (double)(end - st[w][t][ph]), cnt++;
            }
            n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, " %s %.0f;", names[w][ph],
                                  cnt ? sum / cnt : 0.0);
        }
    }
    if (!g_va_prof_kind) { /* v4: the item around its tiles, and its first and last tile */
        long long it_st[2][VA_PROF_ITEM];
        if (cudaMemcpyFromSymbol(it_st, g_va_prof_item, sizeof it_st) != cudaSuccess) return KDT_OK;
        static const char *inames[VA_PROF_ITEM] = {"entry", "item known", "first data in", "tiles done",
                                                   "both WGs done", "rows finished", "stored"};
        for (int w = 0; w < 2; w++) {
            n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, "\n  WG%d item, cycles from %s:", w,
                                  g_va_prof_nth ? "its loop top" : "entry");
            for (int k = 1; k < VA_PROF_ITEM; k++)
                n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, " %s %lld;", inames[k],
                                      it_st[w][k] - it_st[w][0]);
            for (int t = 0; t < tiles; t += tiles > 1 ? tiles - 1 : 1) {
                n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, "\n  WG%d tile %d:", w, t);
                for (int ph = 0; ph < VA_PROF_PHASES; ph++) {
                    const long long end = ph + 1 < VA_PROF_PHASES ? st[w][t][ph + 1] : (t + 1 < tiles ? st[w][t + 1][0] : 0);
                    n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, " %s %lld;", names[w][ph],
                                          end > 0 && st[w][t][ph] > 0 ? end - st[w][t][ph] : -1);
                }
                n += (size_t)snprintf(out + (n < cap ? n : cap), n < cap ? cap - n : 0, " (start +%lld)",
                                      st[w][t][0] - it_st[w][0]);
            }
        }
    }
    return KDT_OK;
}

extern "C" const char *kdt_verify_attn_cuda_path(void) {
    int use_wgmma = 0;
    if (choose_path("kdt_verify_attn_cuda_path", 0, &use_wgmma) != KDT_OK) return "error: see kdt_last_error()";
    return use_wgmma ? "sm_90a (wgmma)" : "portable (mma.sync)";
}

extern "C" size_t kdt_verify_attn_workspace_bytes(int32_t n_streams, int32_t n_heads, int32_t max_nodes,
                                                  int32_t max_prefix) {
    if (n_streams < 1 || n_streams > KDT_MAX_STREAMS || n_heads < 1 || n_heads > 128 || max_nodes < 1 ||
        max_nodes > KDT_MAX_NODES || max_prefix < 0 || max_prefix > MAX_KEYS_PER_STREAM - KDT_MAX_NODES)
        return 0;
    /* va_split_target is non-decreasing in keys and bounds the split count, so
     * rt * target(max_prefix + n) over n bounds every stream's partial slots. */
    long long max_slots = 0;
    for (int n = 1; n <= max_nodes; n++) {
        const int rt = (n * n_heads + ROWS - 1) / ROWS;
        const int s = va_split_target(max_prefix + n, rt);
        if (s > 1 && (long long)rt * s > max_slots) max_slots = (long long)rt * s;
    }
    return (size_t)n_streams * (size_t)max_slots * SLOT_BYTES;
}

extern "C" kdt_status kdt_verify_attn_cuda(const kdt_verify_attn_params *p, void *stream) {
    const char *who = "kdt_verify_attn_cuda";
    kdt_status st = kdt_verify_attn_check_args(p, who);
    if (st != KDT_OK) return st;
    /* The FP8 cache runs the portable kernel's loader (load_kv_tile_fp8) on every device: it
     * matches the bf16 cache bitwise on equal values (H200 sessions 25 and 27, H100 session 26)
     * and takes 1.02-1.24x its time there (bench/RESULTS.md); on a Hopper that is the portable
     * kernel's time, 2.5-2.9x the sm_90a kernel's, which reads bf16 caches only. Any other format was
     * refused by kdt_verify_attn_check_args. */
    const int fp8 = p->kv_format == KDT_KV_FP8_SCALED;
    if (p->d_qk != D_QK || p->d_v != D_V)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: d_qk = %d, d_v = %d: the CUDA path supports only d_qk = %d, d_v = %d",
                        who, p->d_qk, p->d_v, D_QK, D_V);
    if ((int64_t)p->max_pages * p->page_size > MAX_KEYS_PER_STREAM)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: max_pages * page_size = %lld, the CUDA path supports at most %d keys per stream",
                        who, (long long)p->max_pages * p->page_size, MAX_KEYS_PER_STREAM);
    KDT_CHECK_ARG((uintptr_t)p->q % 16 == 0, "%s: q must be 16-byte aligned", who);
    KDT_CHECK_ARG((uintptr_t)p->kv_cache % 16 == 0, "%s: kv_cache must be 16-byte aligned", who);
    KDT_CHECK_ARG((uintptr_t)p->out % 16 == 0, "%s: out must be 16-byte aligned", who);
    KDT_CHECK_ARG((uintptr_t)p->lse % 4 == 0, "%s: lse must be 4-byte aligned", who);
    KDT_CHECK_ARG((uintptr_t)p->block_table % 4 == 0 && (uintptr_t)p->prefix_len % 4 == 0 &&
                      (uintptr_t)p->n_nodes % 4 == 0 && (uintptr_t)p->anc_mask % 8 == 0,
                  "%s: block_table / prefix_len / n_nodes / anc_mask are not aligned to their element", who);
    KDT_CHECK_ARG(p->workspace != NULL || p->workspace_bytes == 0,
                  "%s: workspace is NULL but workspace_bytes = %zu", who, p->workspace_bytes);
    KDT_CHECK_ARG((uintptr_t)p->workspace % 16 == 0, "%s: workspace must be 16-byte aligned", who);

    int cfg = 0, sms = 1;
    st = device_config(&cfg, &sms);
    if (st == KDT_OK) st = forced_config(cfg, &cfg);
    if (st != KDT_OK) return st;

    VaArgs a;
    a.q = p->q, a.kv = static_cast<const uint16_t *>(p->kv_cache), a.block_table = p->block_table;
    a.prefix_len = p->prefix_len, a.n_nodes = p->n_nodes, a.anc_mask = p->anc_mask;
    a.out = p->out, a.lse = p->lse;
    a.slot_capacity = p->workspace ? (long long)(p->workspace_bytes / SLOT_BYTES) : 0;
    /* no stream of this launch can be split (short block tables): the same items without the
     * workspace, and no merge pass (it merged nothing and cost 3 us at S 1, P 256, q 9 and 5 us
     * at S 64, P 256, q 9; H200, session 23) */
    if (!va_launch_can_split((long long)p->max_pages * p->page_size, p->n_heads)) a.slot_capacity = 0;
    a.ws_o = (uint16_t *)p->workspace;
    a.ws_lse = a.slot_capacity > 0 ? (float *)((char *)p->workspace + a.slot_capacity * SLOT_O_HALVES * 2) : NULL;
    a.ws_scale = a.ws_lse ? a.ws_lse + a.slot_capacity * ROWS : NULL;
    a.S = p->n_streams, a.H = p->n_heads, a.max_nodes = p->max_nodes, a.words = KDT_MASK_WORDS(p->max_nodes);
    a.n_pages = p->n_pages, a.page_size = p->page_size, a.max_pages = p->max_pages;
    a.scale_log2 = (float)((double)p->softmax_scale * 1.4426950408889634);
    const char *prof = getenv("KDT_VA_PROFILE");
    a.prof = prof && prof[0] == '1';
    const char *prof_item = getenv("KDT_VA_PROFILE_ITEM");
    a.prof_item = prof_item ? atoi(prof_item) : 0;
    if (a.prof_item < 0) a.prof_item = 0;
    if (a.prof) g_va_prof_nth = a.prof_item;
    a.use_tma = 0;

    /* at most one CTA per item: S * (most row tiles) * (most splits) bounds the item count (NaN
     * fills included), so CTAs that would only walk the list and leave are never started. A CTA's
     * items do not depend on which CTA runs them, so this is scheduling only (the same bits). */
    const long long rt_max = ((long long)p->max_nodes * p->n_heads + ROWS - 1) / ROWS;
    const long long item_bound = (long long)p->n_streams * rt_max * (a.slot_capacity > 0 ? VA_MAX_SPLITS : 1);
    const int grid = item_bound < sms ? (int)item_bound : sms;

    cudaStream_t cs = (cudaStream_t)stream;
    int use_wgmma = 0;
    st = choose_path(who, fp8, &use_wgmma);
    if (st != KDT_OK) return st;
    if (use_wgmma) {
        CUtensorMap kv_map;
        memset(&kv_map, 0, sizeof kv_map);
        a.use_tma = make_kv_map(p, &kv_map);
        /* v4 by default; KDT_VA_SEESAW=1 runs v5 (seesaw, TMA loads only), which is correct but
         * slower than v4 on the H200 (docs/verify_attn_notes.md, v5) */
        const char *seesaw = getenv("KDT_VA_SEESAW");
        const int use_seesaw = a.use_tma && seesaw && !strcmp(seesaw, "1");
        g_va_prof_kind = use_seesaw;
        /* KDT_VA_FUSED=1: v4 (or, with KDT_VA_SEESAW=1, v5) with FlashMLA's softmax shape (opt-in,
         * measured no faster; its FFMA form needs a positive scale) */
        const char *fused_env = getenv("KDT_VA_FUSED");
        const int fused = fused_env && !strcmp(fused_env, "1") && a.scale_log2 > 0.f;
        if (use_seesaw && fused) {
            if (a.prof) verify_attn_seesaw_kernel<true, true><<<grid, THREADS, SS_SMEM, cs>>>(a, kv_map);
            else verify_attn_seesaw_kernel<false, true><<<grid, THREADS, SS_SMEM, cs>>>(a, kv_map);
        } else if (use_seesaw) {
            if (a.prof) verify_attn_seesaw_kernel<true><<<grid, THREADS, SS_SMEM, cs>>>(a, kv_map);
            else verify_attn_seesaw_kernel<false><<<grid, THREADS, SS_SMEM, cs>>>(a, kv_map);
        } else if (fused) {
            if (a.prof) verify_attn_sm90_kernel<true, true><<<grid, THREADS, W_SMEM, cs>>>(a, kv_map);
            else verify_attn_sm90_kernel<false, true><<<grid, THREADS, W_SMEM, cs>>>(a, kv_map);
        } else if (a.prof) {
            verify_attn_sm90_kernel<true><<<grid, THREADS, W_SMEM, cs>>>(a, kv_map);
        } else {
            verify_attn_sm90_kernel<false><<<grid, THREADS, W_SMEM, cs>>>(a, kv_map);
        }
    } else {
        switch (cfg * 2 + fp8) {
        case 2 * CFG_BN64_2STAGE: verify_attn_kernel<64, 2, false><<<grid, THREADS, Cfg<64, 2>::SMEM, cs>>>(a); break;
        case 2 * CFG_BN64_2STAGE + 1: verify_attn_kernel<64, 2, true><<<grid, THREADS, Cfg<64, 2>::SMEM, cs>>>(a); break;
        case 2 * CFG_BN64_1STAGE: verify_attn_kernel<64, 1, false><<<grid, THREADS, Cfg<64, 1>::SMEM, cs>>>(a); break;
        case 2 * CFG_BN64_1STAGE + 1: verify_attn_kernel<64, 1, true><<<grid, THREADS, Cfg<64, 1>::SMEM, cs>>>(a); break;
        case 2 * CFG_BN16_1STAGE + 1: verify_attn_kernel<16, 1, true><<<grid, THREADS, Cfg<16, 1>::SMEM, cs>>>(a); break;
        default: verify_attn_kernel<16, 1, false><<<grid, THREADS, Cfg<16, 1>::SMEM, cs>>>(a); break;
        }
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", who, cudaGetErrorString(e));
    if (a.slot_capacity > 0) {
        /* programmatic dependent launch (sm_90+; KDT_VA_PDL=0 turns it off): the combine's launch
         * and its walk overlap the main kernel, whose finished CTAs' SMs it takes first */
        static const bool use_pdl = pdl::usable(verify_attn_combine, "KDT_VA_PDL");
        pdl::launch(verify_attn_combine, dim3(2 * sms), dim3(THREADS), 0, cs, use_pdl, a);
        e = cudaGetLastError();
        if (e != cudaSuccess) return kdt_fail(KDT_ERR_CUDA, "%s: combine launch failed: %s", who, cudaGetErrorString(e));
    }
    return KDT_OK;
}
