/* attn_plan.h - the GPU attention's (gpu_attn.cu) instances and their shared memory, as plain C
 * (and, at the end, the plain prefill attention's, gpu_plain.cu):
 * which (heads per item, warps, P V column tiles per warp) instances exist, how much shared
 * memory each takes with a ring of 2 or 3 KV stages, and which warp count a launch takes on a
 * device with a given per-block limit. gpu_attn.cu sizes and picks with these very functions, and
 * tests/test_attn_plan.c checks them against every device class the engine targets without a
 * GPU: H200 / H100 (227 KB per block), A100 (163 KB), RTX PRO 6000 Blackwell sm_120 and sm_86 /
 * sm_89 (99 KB). The warp count never changes a bit (gpu_attn.cu), so falling back to fewer warps
 * where the preferred count does not fit is pure scheduling.
 */
#ifndef KDT_ATTN_PLAN_H
#define KDT_ATTN_PLAN_H

#include <stddef.h>

#ifdef __CUDACC__
#define KDT_AP_FN __host__ __device__ constexpr inline
#else
#define KDT_AP_FN static inline
#endif

enum {
    KDT_AP_TILE = 32,      /* keys per attention tile (KDT_G_ATT_TILE) */
    KDT_AP_SS = 33,        /* floats per score row (TILE + 1) */
    KDT_AP_PS = 40,        /* bf16 per probability row (TILE + 8) */
    KDT_AP_MAX_STAGES = 3  /* deepest KV ring */
};

/* Whether items of hg heads lay out their scores by rows (gpu_attn.cu, AttCfg::ROWS): each warp
 * holds one m-tile's whole score rows for a share of the chains, so a Q fragment serves all the
 * tile's key tiles (half the shared-memory reads of whole pairs at 64 heads, where the S phase was
 * bound by them: session 32); else warps hold whole (m-tile, 8-key tile) pairs or share them. */
KDT_AP_FN int kdt_ap_rows(int hg) { return hg == 64; }
/* Score planes the softmax adds. By rows: warps / m-tiles (64 heads on 8 warps: 2). By pairs: 1
 * while every warp holds whole pairs, 2 when two warps share a pair's k-step chains, 4 when each
 * warp holds one chain. */
KDT_AP_FN int kdt_ap_planes(int hg, int w) {
    const int mt = hg / 16;
    if (kdt_ap_rows(hg)) return w <= mt ? 1 : w / mt;
    return w <= mt * (KDT_AP_TILE / 8) ? 1 : (w <= 2 * mt * (KDT_AP_TILE / 8) ? 2 : 4);
}

/* Row stride (bf16) of the Q and K tiles: the k16 steps' columns (d_q rounded up to 16) or the
 * warps' P V columns (w x nt x 8), whichever is wider, plus 8 (ldmatrix rows in 8 bank groups). */
KDT_AP_FN int kdt_ap_qs_stride(int w, int nt, int dq) {
    const int d16 = (dq + 15) / 16 * 16, cols = w * nt * 8;
    return (d16 > cols ? d16 : cols) + 8;
}

/* Whether instance (hg, d_q) keeps Q and the KV ring as wgmma's 128-byte-swizzled slabs where the
 * device code has wgmma (sm_90a): 64 heads at d_q 576 (gpu_attn.cu, att_slab). The slabs fit in
 * the row-major regions but must start 1,024-byte aligned, so such instances reserve that much
 * more on every device (the host does not know which code the device runs). */
KDT_AP_FN int kdt_ap_slab(int hg, int dq) { return hg == 64 && dq == 576; }
enum { KDT_AP_SLAB_ALIGN = 1024 };

/* Dynamic shared memory of an instance with `stages` KV tiles in its ring: Q, the KV ring, the
 * score planes, P, the rows' max / sum / rescale factor, and the slabs' alignment slack. */
KDT_AP_FN size_t kdt_ap_smem(int hg, int w, int nt, int dq, int stages) {
    const size_t qs = (size_t)kdt_ap_qs_stride(w, nt, dq);
    return (size_t)hg * qs * 2 + (size_t)stages * KDT_AP_TILE * qs * 2 +
           (size_t)kdt_ap_planes(hg, w) * (size_t)hg * KDT_AP_SS * 4 + (size_t)hg * KDT_AP_PS * 2 +
           3 * (size_t)hg * 4 + (kdt_ap_slab(hg, dq) ? KDT_AP_SLAB_ALIGN : 0);
}

/* 8-column P V tiles per warp for d_c value columns (even, at least 2). */
KDT_AP_FN int kdt_ap_pick_nt(int w, int dc) {
    int nt = (dc + w * 8 - 1) / (w * 8);
    nt += nt & 1;
    return nt < 2 ? 2 : nt;
}

/* The warp counts with instances: 16 heads 4, 8 or 16 warps, 64 heads 8 (16 would spill at the
 * 128 registers of 512 threads); NT up to 64 / W, so d_c <= 512. */
KDT_AP_FN int kdt_ap_has_w(int hg, int w) { return hg == 16 ? (w == 4 || w == 8 || w == 16) : (hg == 64 && w == 8); }
KDT_AP_FN int kdt_ap_max_nt(int w) { return w == 4 ? 16 : (w == 8 ? 8 : 4); }

/* Whether instance (hg, w) exists for d_c and its 2-stage ring fits `optin` bytes per block. */
KDT_AP_FN int kdt_ap_w_fits(int hg, int w, int dc, int dq, size_t optin) {
    return kdt_ap_has_w(hg, w) && kdt_ap_pick_nt(w, dc) <= kdt_ap_max_nt(w) &&
           kdt_ap_smem(hg, w, kdt_ap_pick_nt(w, dc), dq, 2) <= optin;
}

/* The warp count of a launch of `grid` items on `n_sm` SMs: `forced` (KDT_GPU_ATT_WARPS) where it
 * exists and fits; else, for 16 heads, 16 where the launch has at most one CTA per SM and d_c
 * gives each warp >= 32 P V columns (a one-row decode: shorter dependent chains per warp), then 8,
 * then 4: the first that fits. 0 if none fits (the model load refuses such a device first). */
KDT_AP_FN int kdt_ap_pick_warps(int hg, long long grid, int n_sm, int dc, int dq, size_t optin, int forced) {
    if (kdt_ap_w_fits(hg, forced, dc, dq, optin)) return forced;
    if (hg == 16 && grid <= n_sm && dc >= 16 * 32 && kdt_ap_w_fits(hg, 16, dc, dq, optin)) return 16;
    if (kdt_ap_w_fits(hg, 8, dc, dq, optin)) return 8;
    if (kdt_ap_w_fits(hg, 4, dc, dq, optin)) return 4;
    return 0;
}

/* The least shared memory per block with which 16- or 64-head items of (d_c, d_q) run at all: the
 * smallest 2-stage ring among their warp counts (a launch falls back to it); 0 if no instance. */
KDT_AP_FN size_t kdt_ap_min_smem(int hg, int dc, int dq) {
    size_t least = 0;
    if ((hg != 16 && hg != 64) || dq % 8 || dc < 1 || dc > dq) return 0;
    for (int w = 4; w <= 16; w *= 2) {
        if (!kdt_ap_w_fits(hg, w, dc, dq, (size_t)-1)) continue;
        const size_t b = kdt_ap_smem(hg, w, kdt_ap_pick_nt(w, dc), dq, 2);
        if (least == 0 || b < least) least = b;
    }
    return least;
}

/* ---- the plain prefill attention (gpu_plain.cu, plain_attn) ----------------------------------
 * A CTA holds 64 query rows of one head and walks 64-key tiles; its shared memory is Q, then per
 * K / V stage the K and V tiles as bf16 hi and lo planes, each row padded by 8 bf16. Q's
 * fragments live in registers, so d_n + d_r (padded to 16) is at most 256, and with one stage
 * Q's rows are reused by the K tile (64 rows within its 2 x 64). */
enum {
    KDT_AP_PLAIN_ROWS = 64,    /* query rows per CTA (the up-projection: keys per CTA) */
    KDT_AP_PLAIN_KEYS = 64,    /* keys per tile (the up-projection: output columns per CTA) */
    KDT_AP_PLAIN_PAD = 8,      /* bf16 per shared-memory row beyond its data */
    KDT_AP_PLAIN_MAX_DQK = 256 /* d_n + d_r, padded to 16, at most */
};
/* d_v padded to the power of two the instances exist for (16..256); 0 when wider */
KDT_AP_FN int kdt_ap_plain_dv_pad(int dv) {
    for (int p = 16; p <= 256; p *= 2)
        if (dv <= p) return p;
    return 0;
}
/* plain_attn's dynamic shared memory with 1 or 2 K / V stages; 0 for a shape it has no instance for */
KDT_AP_FN size_t kdt_ap_plain_smem(int dqk_p, int dv_p, int stages) {
    if (dqk_p < 16 || dqk_p > KDT_AP_PLAIN_MAX_DQK || dqk_p % 16 || dv_p < 1 || kdt_ap_plain_dv_pad(dv_p) != dv_p ||
        stages < 1 || stages > 2)
        return 0;
    const size_t q_rows = stages == 2 ? KDT_AP_PLAIN_ROWS : 0; /* one stage: Q within K's tile */
    return (q_rows + 2 * (size_t)stages * KDT_AP_PLAIN_KEYS) * (size_t)(dqk_p + KDT_AP_PLAIN_PAD) * 2 +
           (size_t)(2 * stages * KDT_AP_PLAIN_KEYS) * (size_t)(dv_p + KDT_AP_PLAIN_PAD) * 2;
}
/* plain_attn_wg's (sm_90a wgmma, 2 stages): Q's padded rows, up to 1,023 bytes to align the ring,
 * then per stage K hi / lo and V hi / lo as 8 KB slabs of 64 keys x 64 bf16 (K: ceil(dqk_p / 64)
 * per plane, V: dv_p / 64); 0 unless dv_p is 64 or 128 (its instances) */
KDT_AP_FN size_t kdt_ap_plain_wg_smem(int dqk_p, int dv_p) {
    if (dqk_p < 16 || dqk_p > KDT_AP_PLAIN_MAX_DQK || dqk_p % 16 || (dv_p != 64 && dv_p != 128)) return 0;
    const size_t slab = (size_t)KDT_AP_PLAIN_KEYS * 128;
    return (size_t)KDT_AP_PLAIN_ROWS * (size_t)(dqk_p + KDT_AP_PLAIN_PAD) * 2 + 1023 +
           2 * (2 * (size_t)((dqk_p + 63) / 64) + 2 * (size_t)(dv_p / 64)) * slab;
}

/* ---- the absorbed attention's split partials and their windows (gpu_forward.c) --------------
 * A row has up to row_splits splits (its key count decides them), each with a slot of partials.
 * The runner holds cap slots: what a device-staged pass needs in one launch (tree_rows rows), else
 * every row's worst case up to the budget. A host-staged pass whose splits exceed cap runs its
 * attention in windows: consecutive rows, each window as many as fit (greedy), split offsets
 * from 0 in each. Host code (loops and writes), so plain static inline, not KDT_AP_FN. */
static inline long long kdt_ap_partial_slots(long long rows, int row_splits, long long tree_rows,
                                             long long budget_slots) {
    const long long all = rows * row_splits, one = tree_rows * row_splits;
    const long long cap = all < budget_slots ? all : budget_slots;
    return cap > one ? cap : one;
}
/* The most windows a pass of `rows` rows can need with cap >= row_splits slots: a window closes
 * only when the next row does not fit, so it holds more than cap - row_splits splits. */
static inline long long kdt_ap_max_windows(long long rows, int row_splits, long long cap) {
    const long long all = rows * row_splits;
    if (cap >= all) return 1;
    const long long w = 1 + all / (cap - row_splits + 1);
    return w < rows ? w : rows;
}
/* Cuts n rows whose split counts are ns[0..n) into windows of at most cap splits. On success
 * returns the window count w and, where the arrays are given, rewrites ns[i] into row i's split
 * offset within its window, win_row[0..w] (window k is rows win_row[k] .. win_row[k + 1] - 1) and
 * win_splits[0..w) (its splits). -1: a row has more than cap splits (or fewer than 1); -2: more
 * than max_windows windows. A refusal writes nothing. n = 0: one empty window. */
static inline int kdt_ap_cut_windows(int *ns, int n, long long cap, int max_windows, int *win_row, int *win_splits) {
    long long used = 0;
    int w = 0;
    for (int i = 0; i < n; i++) {
        if (ns[i] < 1 || ns[i] > cap) return -1;
        if (used + ns[i] > cap) {
            w++;
            used = 0;
        }
        used += ns[i];
    }
    if (w + 1 > max_windows) return -2;
    if (!win_row) return w + 1;
    used = 0;
    w = 0;
    win_row[0] = 0;
    for (int i = 0; i < n; i++) {
        const int k = ns[i];
        if (used + k > cap) { /* row i opens the next window */
            if (win_splits) win_splits[w] = (int)used;
            win_row[++w] = i;
            used = 0;
        }
        ns[i] = (int)used;
        used += k;
    }
    if (win_splits) win_splits[w] = (int)used;
    win_row[++w] = n;
    return w;
}

#endif
