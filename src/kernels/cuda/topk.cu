/* topk.cu - CUDA log-softmax + top-K over the vocabulary (kdt_topk_logsoftmax_cuda) and the
 * size of its workspace (kdt_topk_workspace_bytes). Value policy, order and log-prob formula are
 * those of cpu/topk.c: NaN -> -inf, +inf -> FLT_MAX, descending value then ascending id, i.e. the
 * descending order of key = (order_key(value) << 32) | (0xffffffff - id); -inf logits get -inf.
 * Ids match the CPU exactly; log-probs agree to float rounding of the log-sum-exp.
 *
 * Design: every row is cut into C chunks (C from the shape alone, see make_plan()); one CTA of 256
 * threads reads one chunk exactly once from HBM, in tiles of 256 x 4 x 16 bytes, and computes in
 * the same pass the chunk's log-sum-exp and top-K; with C == 1 it writes the row itself, with
 * C > 1 it writes its top-K keys and log-sum-exp to the workspace and a merge kernel (one CTA per
 * row) combines the C partial log-sum-exps in double, sorts the C*K keys and writes the rows.
 * The kernel is bound by instruction issue more than by HBM, so the per-tile work is kept to
 * about 4.3 instructions per element (bf16: ~210 per thread and tile of 32 elements, 136 of them
 * the log-sum-exp; it was ~380 plus a heavier candidate path):
 *   - staging: tiles stream through two shared-memory stages by cp.async (tile t + 1 in flight
 *     while tile t is processed); a thread copies and reads back only its own slots, so no
 *     barrier guards them, and no registers hold the next tile (the register double buffer cost
 *     16 moves a tile and spills). The last tile may be partial: its missing vectors read -inf;
 *   - tile maximum: bf16x2 NaN-propagating maxima (15 HMNMX2 for 32 values), one f32 max;
 *   - log-sum-exp: per thread an online (max, sum) in the log2 domain, rescaled once per tile
 *     (not per vector), then per element a shift or mask, an FFMA, one ex2.approx and an add;
 *   - top-K: a candidate buffer in shared memory (CAP keys) behind a threshold. A tile whose
 *     maximum is below the threshold value costs one compare; otherwise its candidate mask comes
 *     from bf16x2 compares (HSET2) and each candidate reads its value back from the stage, builds
 *     its key and takes a slot with one atomic;
 *   - threshold (K <= 256): each thread keeps the running maximum of its elements (distinct
 *     elements, so any v with >= K of them >= v is valid); after tiles 0, 1, 3, 7, ... the CTA
 *     binary-searches the largest such v over 16-bit order keys, one __syncthreads_count a step.
 *     Refreshed this way it stays near the K-th largest value seen so far, so a chunk offers
 *     ~100 candidates at K = 32 instead of ~280 (K > 256: the K-th largest of the first tile's
 *     vector maxima, as before);
 *   - one barrier per tile (an OR of "overflow" and "special value"). When the buffer overflows,
 *     the CTA sorts it (bitonic), keeps the best K and raises the threshold to the K-th key; the
 *     candidates that did not fit stay pending and are offered again, so none is lost whatever
 *     the data (ties, ascending rows) - those just take more rounds;
 *   - end of chunk: keys below the final threshold are dropped and, when at most RANK_MAX
 *     remain, each key's rank is counted directly (a couple of barriers instead of a bitonic
 *     network's dozens); otherwise the bitonic compaction.
 * Fast path and special values: the fast path assumes finite values (or -inf). NaN, +inf or
 * |x| > 1e30 as a tile maximum (or a head / tail element) ends the pass; the CTA then redoes its
 * chunk with per-element sanitizing and natural-log expf (rare, about 2x slower). Smaller values
 * beside a normal maximum are exact on the fast path too (their ex2 is 0, as exp is on the CPU).
 */
#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <stdint.h>

#include "common.h"
#include "kdtree/kernels.h"

extern "C" kdt_status kdt_topk_check_args(const kdt_topk_params *p, const char *who);

/* Bench/test-only override of the chunk count (0 = automatic). Not part of the API:
 * bench_topk.c and the GPU test declare it to sweep the split; it can only lower C. */
extern "C" int kdt_topk_bench_chunks;
int kdt_topk_bench_chunks = 0;

namespace {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int UNROLL = 4;           /* 16-byte vectors per thread per tile */
/* CTAs a call aims at: 2 per SM of a 132-SM H200. Measured (H200, bf16, V 163,840, K 32): R 448
 * took 53 us with 1 chunk per row, 56 with 2, 63 with 3; R 56 took 21 us with 4 chunks, 22 with
 * 2, 24 with 6, 35 with 16: past ~2 CTAs per SM more chunks only add merge work. */
constexpr int TARGET_CTAS = 264;
constexpr int MIN_CHUNK = 4096;     /* elements; below this a chunk is mostly fixed cost */
constexpr int MAX_CHUNKS = 64;
constexpr int MERGE_MAX = 4096;     /* C * K keys one merge CTA sorts in shared memory */
constexpr float LOG2E = 1.4426950408889634f;
constexpr int SLOT_STRIDE = THREADS * 16; /* bytes from a thread's staged vector u to u + 1 */

struct Plan {
    int chunks;     /* C */
    int chunk_len;  /* elements per chunk (the last may be shorter), a multiple of 64 */
};

int next_pow2(int x) {
    int p = 1;
    while (p < x) p <<= 1;
    return p;
}

/* The split of every row; depends on the shape only, so the workspace size does too. */
Plan make_plan(int n_rows, int vocab, int k) {
    int c = TARGET_CTAS / n_rows;
    if (c > vocab / MIN_CHUNK) c = vocab / MIN_CHUNK;
    if (c > MERGE_MAX / next_pow2(k)) c = MERGE_MAX / next_pow2(k);
    if (c > MAX_CHUNKS) c = MAX_CHUNKS;
    if (c < 1) c = 1;
    Plan pl;
    pl.chunk_len = (int)((((int64_t)vocab + c - 1) / c + 63) / 64 * 64);
    pl.chunks = (vocab + pl.chunk_len - 1) / pl.chunk_len;
    return pl;
}

Plan apply_override(Plan pl, int vocab) {
    if (kdt_topk_bench_chunks >= 1 && kdt_topk_bench_chunks < pl.chunks) {
        int c = kdt_topk_bench_chunks;
        pl.chunk_len = (int)((((int64_t)vocab + c - 1) / c + 63) / 64 * 64);
        pl.chunks = (vocab + pl.chunk_len - 1) / pl.chunk_len;
    }
    return pl;
}

/* Workspace layout for C > 1 (bytes, each part 16-aligned):
 *   keys  uint64 [R][C][K]   the chunk's best keys, descending
 *   lse   double [R][C]      the chunk's natural log-sum-exp (-inf if empty)
 *   count int32  [R][C]      keys written (min(K, chunk length))
 * A call uses ws_used_bytes(R, C, K). kdt_topk_workspace_bytes() returns a bound instead that
 * does not decrease with R or K (C * K <= MERGE_MAX, C <= MAX_CHUNKS, and C > 1 only while
 * R < TARGET_CTAS), so one buffer sized for the largest shape serves every smaller call. */
size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }
size_t ws_keys_bytes(int r, int c, int k) { return align16((size_t)r * c * k * 8); }
size_t ws_lse_bytes(int r, int c) { return align16((size_t)r * c * 8); }
size_t ws_used_bytes(int r, int c, int k) {
    return ws_keys_bytes(r, c, k) + ws_lse_bytes(r, c) + align16((size_t)r * c * 4);
}

struct Args {
    const unsigned char *logits; /* [R][row_stride] of the element type */
    int64_t row_stride;          /* elements */
    int vocab, k, chunks, chunk_len;
    int32_t *top_ids;            /* [R][K] */
    float *top_logp;             /* [R][K] */
    uint64_t *ws_keys;           /* see the layout above; unused when chunks == 1 */
    double *ws_lse;
    int32_t *ws_count;
};

/* ---- small device helpers ------------------------------------------------------------------ */

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float max_nan(float a, float b) {
    float y;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
}

/* Two bf16 maxima at once (one HMNMX2); NaN if either input is NaN. */
__device__ __forceinline__ uint32_t max_nan_bf16x2(uint32_t a, uint32_t b) {
    uint32_t y;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(a), "r"(b));
    return y;
}

/* Per half: 0xffff where a >= b (false for NaN), else 0. */
__device__ __forceinline__ uint32_t ge_mask_bf16x2(uint32_t a, uint32_t b) {
#if __CUDA_ARCH__ >= 900
    uint32_t y;
    asm("set.ge.u32.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(a), "r"(b));
    return y;
#else
    const bool lo = __uint_as_float(a << 16) >= __uint_as_float(b << 16);
    const bool hi = __uint_as_float(a & 0xffff0000u) >= __uint_as_float(b & 0xffff0000u);
    return (lo ? 0x0000ffffu : 0u) | (hi ? 0xffff0000u : 0u);
#endif
}

/* The bf16 bits of the smallest bf16 >= x (x not NaN): for a bf16 value y, y >= x exactly when
 * y >= that bf16. */
__device__ __forceinline__ uint32_t bf16_ceil_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u >> 16) + ((u & 0xffffu) != 0 && !(u >> 31));
}

/* kdt_f32_order_key (fp.h) on the device, in integer operations. */
__device__ __forceinline__ uint32_t order_key(float f) {
    uint32_t u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0; /* -0 -> +0 */
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u); /* negative: ~u, else u | sign */
}

__device__ __forceinline__ float key_value(uint64_t key) {
    uint32_t k = (uint32_t)(key >> 32);
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ int32_t key_id(uint64_t key) {
    return (int32_t)(0xffffffffu - (uint32_t)key);
}

__device__ __forceinline__ uint64_t make_key(float v, int32_t id) {
    return ((uint64_t)order_key(v) << 32) | (uint32_t)(0xffffffffu - (uint32_t)id);
}

__device__ __forceinline__ float sanitize(float v) {
    if (v != v) return -INFINITY;
    if (v == INFINITY) return FLT_MAX;
    return v;
}

/* Shared-memory loads of one element (the rare candidates read theirs from the tile's stage) and
 * a shared atomic add. */
__device__ __forceinline__ uint32_t lds_u16(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ int atomic_add_shared(int *p, int v) {
    int old;
    asm volatile("atom.shared.add.u32 %0, [%1], %2;"
                 : "=r"(old) : "r"((uint32_t)__cvta_generic_to_shared(p)), "r"(v) : "memory");
    return old;
}

/* Element types. A thread's tile is UNROLL 16-byte vectors of N values each (vector u at vector
 * index t * TILE + u * THREADS + tid, staged at byte u * SLOT_STRIDE of the thread's slots); its
 * candidates are a 32-bit mask whose bit layout is the type's own (bit(), load(), offset() agree
 * on it). The fast path (SAN = false) works on the raw words; the sanitizing path unpacks to
 * floats. */
template <typename T> struct Elem;

template <> struct Elem<uint16_t> { /* bf16 bits */
    static constexpr int N = 8;
    static constexpr uint32_t NEG_INF_WORD = 0xff80ff80u; /* two bf16 -inf */
    /* Bit of element i of vector u: low halves at bits 0..15 (word q = 4 u + i / 2), high halves
     * at bits 16..31. */
    static __device__ __forceinline__ int bit(int u, int i) {
        return ((i & 1) << 4) | (4 * u + (i >> 1));
    }
    static __device__ __forceinline__ uint32_t vec_bits(int u) { return 0x000f000fu << (4 * u); }
    /* The element at offset off (offset()) of the tile, from its stage (slot0: the thread's slot
     * 0 there): the stage mirrors global memory, off elements are 2 off bytes. */
    static __device__ __forceinline__ float load(uint32_t slot0, int off) {
        return __uint_as_float(lds_u16(slot0 + 2 * off) << 16);
    }
    /* Element offset of bit b from the thread's first element of the tile: vector (b >> 2) & 3,
     * word b & 3, half b >> 4. */
    static __device__ __forceinline__ int offset(int b) {
        return ((b & 12) >> 2) * THREADS * N + ((b & 3) << 1) + (b >> 4);
    }
    static __device__ __forceinline__ void unpack(const uint4 w, float (&v)[8]) {
        const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(u[i] << 16);
            v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ float scalar(const unsigned char *row, int i) {
        return __uint_as_float((uint32_t)__ldg((const unsigned short *)row + i) << 16);
    }
    /* Maximum of the tile, NaN if one is NaN: 15 bf16x2 maxima, then one f32 maximum. */
    static __device__ __forceinline__ float tile_max(const uint4 (&w)[UNROLL]) {
        uint32_t m[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            m[u] = max_nan_bf16x2(max_nan_bf16x2(w[u].x, w[u].y), max_nan_bf16x2(w[u].z, w[u].w));
        const uint32_t r = max_nan_bf16x2(max_nan_bf16x2(m[0], m[1]), max_nan_bf16x2(m[2], m[3]));
        return max_nan(__uint_as_float(r << 16), __uint_as_float(r & 0xffff0000u));
    }
    /* s0 + s1 = sum over the tile of 2^(x log2 e - m): per element a shift or mask, an FFMA, an
     * ex2 and an add. */
    static __device__ __forceinline__ void sum_ex2(const uint4 (&w)[UNROLL], float m, float &s0,
                                                   float &s1) {
        float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const uint32_t q[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const float lo = ex2(fmaf(__uint_as_float(q[c] << 16), LOG2E, -m));
                const float hi = ex2(fmaf(__uint_as_float(q[c] & 0xffff0000u), LOG2E, -m));
                if (u == 0 && c == 0) {
                    a0 = lo;
                    a1 = hi;
                } else {
                    a0 += lo;
                    a1 += hi;
                }
            }
        }
        s0 = a0;
        s1 = a1;
    }
    /* Candidate mask: elements >= thr (thr not NaN), two per bf16x2 compare. */
    static __device__ __forceinline__ uint32_t cand_mask(const uint4 (&w)[UNROLL], float thr) {
        const uint32_t t2 = bf16_ceil_bits(thr) * 0x10001u;
        uint32_t m = 0;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const uint32_t q[4] = {w[u].x, w[u].y, w[u].z, w[u].w};
#pragma unroll
            for (int c = 0; c < 4; c++)
                m |= ge_mask_bf16x2(q[c], t2) & (0x00010001u << (4 * u + c));
        }
        return m;
    }
};

template <> struct Elem<float> {
    static constexpr int N = 4;
    static constexpr uint32_t NEG_INF_WORD = 0xff800000u;
    /* Bit of element i of vector u: 4 u + i (= its word). Bits 16..31 are unused. */
    static __device__ __forceinline__ int bit(int u, int i) { return 4 * u + i; }
    static __device__ __forceinline__ uint32_t vec_bits(int u) { return 0xfu << (4 * u); }
    static __device__ __forceinline__ float load(uint32_t slot0, int off) {
        return __uint_as_float(lds_u32(slot0 + 4 * off));
    }
    static __device__ __forceinline__ int offset(int b) { return (b >> 2) * THREADS * N + (b & 3); }
    static __device__ __forceinline__ void unpack(const uint4 w, float (&v)[4]) {
        v[0] = __uint_as_float(w.x);
        v[1] = __uint_as_float(w.y);
        v[2] = __uint_as_float(w.z);
        v[3] = __uint_as_float(w.w);
    }
    static __device__ __forceinline__ float scalar(const unsigned char *row, int i) {
        return __ldg((const float *)row + i);
    }
    static __device__ __forceinline__ float tile_max(const uint4 (&w)[UNROLL]) {
        float m[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            m[u] = max_nan(max_nan(__uint_as_float(w[u].x), __uint_as_float(w[u].y)),
                           max_nan(__uint_as_float(w[u].z), __uint_as_float(w[u].w)));
        return max_nan(max_nan(m[0], m[1]), max_nan(m[2], m[3]));
    }
    static __device__ __forceinline__ void sum_ex2(const uint4 (&w)[UNROLL], float m, float &s0,
                                                   float &s1) {
        float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const float e0 = ex2(fmaf(__uint_as_float(w[u].x), LOG2E, -m));
            const float e1 = ex2(fmaf(__uint_as_float(w[u].y), LOG2E, -m));
            const float e2 = ex2(fmaf(__uint_as_float(w[u].z), LOG2E, -m));
            const float e3 = ex2(fmaf(__uint_as_float(w[u].w), LOG2E, -m));
            if (u == 0) {
                a0 = e0 + e2;
                a1 = e1 + e3;
            } else {
                a0 += e0;
                a1 += e1;
                a0 += e2;
                a1 += e3;
            }
        }
        s0 = a0;
        s1 = a1;
    }
    static __device__ __forceinline__ uint32_t cand_mask(const uint4 (&w)[UNROLL], float thr) {
        uint32_t m = 0;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            m |= (uint32_t)(__uint_as_float(w[u].x) >= thr) << (4 * u);
            m |= (uint32_t)(__uint_as_float(w[u].y) >= thr) << (4 * u + 1);
            m |= (uint32_t)(__uint_as_float(w[u].z) >= thr) << (4 * u + 2);
            m |= (uint32_t)(__uint_as_float(w[u].w) >= thr) << (4 * u + 3);
        }
        return m;
    }
};

/* Per-thread online log-sum-exp. Fast path (SAN = false): M is a max in log2 units (x * log2 e),
 * never below -FLT_MAX so that no inf - inf arises, and S = sum 2^(x log2 e - M); S == 0 means
 * no finite value yet. Sanitizing path: M in natural units (-inf while empty),
 * S = sum e^(x - M). */
struct Soft {
    float M, S;
    bool special;  /* fast path: a scalar (head / tail) element was NaN, +inf or |x| > 1e30 */
};

/* Fast path: flags a tile (or scalar) maximum that the fast path cannot take. A maximum within
 * +-1e30 (or -inf) keeps M finite and every x log2 e - M free of NaN; smaller values in the same
 * tile just give ex2(-huge) = 0, as exp does on the CPU. */
__device__ __forceinline__ bool is_special(float mx) {
    return !(fabsf(mx) <= 1e30f) && mx != -INFINITY;
}

/* Folds one value into st; returns it (sanitized on the SAN path). */
template <bool SAN>
__device__ __forceinline__ float absorb_one(float x, Soft &st) {
    if (SAN) {
        x = sanitize(x);
        if (x > st.M) {
            st.S = st.M == -INFINITY ? 0.0f : st.S * expf(st.M - x);
            st.M = x;
        }
        if (st.M != -INFINITY) st.S += expf(x - st.M);
    } else {
        st.special |= is_special(x);
        const float m2 = fmaxf(st.M, x * LOG2E);
        st.S = st.S * ex2(st.M - m2) + ex2(fmaf(x, LOG2E, -m2));
        st.M = m2;
    }
    return x;
}

/* Maximum of a tile (sanitized on the SAN path, NaN if one is NaN on the fast path). */
template <typename T, bool SAN>
__device__ __forceinline__ float tile_max(const uint4 (&w)[UNROLL]) {
    if (!SAN) return Elem<T>::tile_max(w);
    float mx = -INFINITY;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        float v[Elem<T>::N];
        Elem<T>::unpack(w[u], v);
#pragma unroll
        for (int i = 0; i < Elem<T>::N; i++) mx = fmaxf(mx, sanitize(v[i]));
    }
    return mx;
}

/* Folds a tile whose maximum is mx (from tile_max) into st, rescaling once per tile. Vectors
 * past the end hold -inf, which adds nothing. */
template <typename T, bool SAN>
__device__ __forceinline__ void absorb_tile(const uint4 (&w)[UNROLL], float mx, Soft &st) {
    constexpr int N = Elem<T>::N;
    if (!SAN) {
        const float m2 = fmaxf(st.M, mx * LOG2E); /* fmaxf drops a NaN: the chunk is redone */
        const float scale = ex2(st.M - m2);
        float s0, s1;
        Elem<T>::sum_ex2(w, m2, s0, s1);
        st.S = fmaf(st.S, scale, s0 + s1);
        st.M = m2;
        return;
    }
    if (mx > st.M) {
        st.S = st.M == -INFINITY ? 0.0f : st.S * expf(st.M - mx);
        st.M = mx;
    }
    if (st.M != -INFINITY) {
        float acc[2] = {0.0f, 0.0f};
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            float v[N];
            Elem<T>::unpack(w[u], v);
#pragma unroll
            for (int i = 0; i < N; i++) acc[i & 1] += expf(sanitize(v[i]) - st.M);
        }
        st.S += acc[0] + acc[1];
    }
}

/* Maximum of a vector (sanitized on the SAN path, NaN if one is NaN on the fast path). Unpacked
 * on purpose (K > THREADS, first tile only): sharing tile_max()'s bf16x2 partial maxima would
 * keep them live through the whole tile. */
template <typename T, bool SAN>
__device__ __forceinline__ float vec_max(const uint4 w) {
    float v[Elem<T>::N];
    Elem<T>::unpack(w, v);
    float mx = SAN ? sanitize(v[0]) : v[0];
#pragma unroll
    for (int i = 1; i < Elem<T>::N; i++) mx = SAN ? fmaxf(mx, sanitize(v[i])) : max_nan(mx, v[i]);
    return mx;
}

/* Candidate mask of a tile: the elements whose (sanitized) value reaches thr. */
template <typename T, bool SAN>
__device__ __forceinline__ uint32_t cand_mask(const uint4 (&w)[UNROLL], float thr) {
    if (!SAN) return Elem<T>::cand_mask(w, thr);
    uint32_t m = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        float v[Elem<T>::N];
        Elem<T>::unpack(w[u], v);
#pragma unroll
        for (int i = 0; i < Elem<T>::N; i++)
            if (!(sanitize(v[i]) < thr)) m |= 1u << Elem<T>::bit(u, i);
    }
    return m;
}

/* (M, S) <- (M, S) (+) (M2, S2), in the domain of SAN. */
template <bool SAN>
__device__ __forceinline__ void soft_combine(float &M, float &S, float M2, float S2) {
    const float Mn = fmaxf(M, M2);
    if (Mn == -INFINITY) {
        M = Mn;
        S = 0.0f;
        return;
    }
    const float f1 = SAN ? expf(M - Mn) : ex2(M - Mn);
    const float f2 = SAN ? expf(M2 - Mn) : ex2(M2 - Mn);
    S = S * f1 + S2 * f2;
    M = Mn;
}

/* Sorts a[0..n) (n a power of two) descending; every thread of the CTA calls it; a[] must be
 * visible to all threads on entry (caller syncs) and is on exit. */
__device__ void bitonic_sort_desc(uint64_t *a, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
                const int lo = 2 * i - (i & (j - 1)), hi = lo + j;
                const bool desc = (lo & k) == 0;
                const uint64_t x = a[lo], y = a[hi];
                if ((x < y) == desc) {
                    a[lo] = y;
                    a[hi] = x;
                }
            }
            __syncthreads();
        }
    }
}

/* Shared state of one chunk CTA. */
template <int CAP>
struct ChunkSmem {
    uint64_t buf[CAP];                 /* candidate keys */
    __align__(16) float group_max[THREADS * UNROLL]; /* threshold candidates, K > THREADS */
    float red_m[WARPS], red_s[WARPS];
    uint64_t thr_key;                  /* nothing below this key can be in the top-K */
    float thr_val;                     /* the value part of thr_key, for the cheap pre-filter */
    int count;                         /* keys in buf (may run past CAP on overflow) */
    int count2;                        /* keys kept by finish_chunk() */
    uint32_t kmax, kmin[2];            /* extremes of the running maxima (raise_threshold) */
};

/* Sorts the buffer, keeps its best K and raises the threshold to the K-th key if that is higher
 * (a threshold raised from the running maxima may already be above it). */
template <int CAP>
__device__ void compact(ChunkSmem<CAP> &sm, int k) {
    const int n = min(sm.count, CAP);
    int np = 1;
    while (np < n) np <<= 1;
    for (int i = n + threadIdx.x; i < np; i += THREADS) sm.buf[i] = 0; /* 0 < every real key */
    __syncthreads();
    bitonic_sort_desc(sm.buf, np);
    if (threadIdx.x == 0) {
        sm.count = min(n, k);
        if (n >= k && sm.buf[k - 1] > sm.thr_key) {
            sm.thr_key = sm.buf[k - 1];
            sm.thr_val = key_value(sm.buf[k - 1]);
        }
    }
    __syncthreads();
}

/* Final selection: buf[0 .. count) <- the best min(count, K) keys, sorted descending. Every key
 * of the chunk's top-K is >= thr_key (the current threshold) and in the buffer. When the buffer
 * holds at most THREADS keys, those below thr_key are dropped (the buffer keeps keys offered
 * under earlier, lower thresholds) and, if at most RANK_MAX remain, each key's rank is counted
 * directly (three barriers instead of a bitonic network's dozens); else bitonic compaction. */
constexpr int RANK_MAX = 160; /* counting costs ~m * m / 32 warp steps; beyond, bitonic is less */

template <int CAP>
__device__ void finish_chunk(ChunkSmem<CAP> &sm, int k, uint64_t thr_key) {
    static_assert(CAP >= 2 * THREADS, "the kept keys go to buf[THREADS ..)");
    __syncthreads(); /* buffer complete */
    const int n = min(sm.count, CAP);
    if (n > THREADS || k > THREADS) {
        compact(sm, k);
        return;
    }
    const int tid = threadIdx.x;
    const uint64_t key = tid < n ? sm.buf[tid] : 0;
    const bool keep = tid < n && key >= thr_key;
    if (keep) sm.buf[THREADS + atomicAdd(&sm.count2, 1)] = key; /* past buf[0 .. n) */
    __syncthreads();
    const int m = sm.count2;
    if (m > RANK_MAX) {
        compact(sm, k); /* buf[0 .. n) is untouched */
        return;
    }
    /* keys are distinct (ids are), so the ranks are a permutation of 0 .. m - 1 */
    int rank = 0;
    if (keep) {
        const uint64_t *kept = sm.buf + THREADS;
        for (int j = 0; j < m; j++) rank += kept[j] > key;
    }
    if (keep && rank < k) sm.buf[rank] = key; /* buf[0 .. k) and buf[THREADS ..) are disjoint */
    if (tid == 0) sm.count = min(m, k);
    __syncthreads();
}

/* Entries of a descending list of 32 floats that are >= x (GE) or > x (!GE): 0..32. */
template <bool GE>
__device__ __forceinline__ int count_above(const float *list, float x) {
    int lo = 0;
#pragma unroll
    for (int s = 32; s > 0; s >>= 1) {
        if (lo + s <= 32) {
            const float y = list[lo + s - 1];
            if (GE ? y >= x : y > x) lo += s;
        }
    }
    return lo;
}

/* K > THREADS, first tile only: the K-th largest of the PER * THREADS values vals (entry
 * u * THREADS + tid holds vals[u]) becomes the threshold value if it beats the current one
 * (K <= PER * THREADS). Each warp sorts its 32-entry lists in registers (shuffle bitonic) into
 * group_max; an entry's rank is then its position in its list plus binary-searched counts in the
 * other lists, with ties broken by list index, so the ranks are a permutation and exactly one
 * entry has rank k - 1. vals must be NaN-free; on the fast path a NaN only happens when the
 * chunk is redone anyway. */
template <int CAP, int PER>
__device__ void threshold_from_maxima(ChunkSmem<CAP> &sm, const float (&vals)[PER], int k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int LISTS = PER * WARPS;
    const float thr0 = sm.thr_val; /* published by an earlier barrier; written below */
    float x[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
        float y = vals[u];
#pragma unroll
        for (int kk = 2; kk <= 32; kk <<= 1) {
#pragma unroll
            for (int j = kk >> 1; j > 0; j >>= 1) {
                const float o = __shfl_xor_sync(0xffffffffu, y, j);
                const bool take_max = ((lane & j) == 0) == ((lane & kk) == 0);
                y = take_max ? fmaxf(y, o) : fminf(y, o);
            }
        }
        x[u] = y;
        sm.group_max[(u * WARPS + warp) * 32 + lane] = y; /* list u * WARPS + warp, descending */
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int list = u * WARPS + warp;
        if (lane >= k || !(x[u] > thr0)) continue; /* rank >= lane, or no gain */
        int rank = lane;
        for (int l = 0; l < LISTS; l++) {
            if (l == list) continue;
            rank += l < list ? count_above<true>(sm.group_max + l * 32, x[u])
                             : count_above<false>(sm.group_max + l * 32, x[u]);
            if (rank >= k) break;
        }
        if (rank == k - 1) { /* exactly one writer */
            sm.thr_val = x[u];
            sm.thr_key = (uint64_t)order_key(x[u]) << 32; /* value x, any id */
        }
    }
    __syncthreads();
}

/* K <= THREADS: raises the threshold (thr_val / thr_key, the same in every thread) from the
 * running maxima, one per thread: distinct elements, so any v with at least K of them >= v is a
 * valid threshold. Binary search for the largest such v over 16-bit keys (order_key >> 16), one
 * __syncthreads_count per step, between the current threshold or the least running maximum
 * (all THREADS >= it) and the greatest; a key stands for the least value with those top bits, so
 * every maximum counted is >= it (for bf16 maxima it is that bf16 value, or just below it for a
 * negative one). About 6 to 9 steps on normal data. r: the number of earlier calls. */
template <int CAP>
__device__ void raise_threshold(ChunkSmem<CAP> &sm, float rmax, int k, int r, float &thr_val,
                                uint64_t &thr_key) {
    constexpr uint32_t NEG_INF_KEY = 0x007fu; /* order_key(-inf) >> 16; below it: only NaN */
    const uint32_t key = order_key(rmax) >> 16;
    const uint32_t wmax = __reduce_max_sync(0xffffffffu, key);
    const uint32_t wmin = __reduce_min_sync(0xffffffffu, key);
    if ((threadIdx.x & 31) == 0) {
        atomicMax(&sm.kmax, wmax); /* running maxima only grow: never reset */
        atomicMin(&sm.kmin[r & 1], wmin);
    }
    if (threadIdx.x == 0) sm.kmin[(r + 1) & 1] = 0xffffffffu; /* last read a tile barrier ago */
    __syncthreads();
    const uint32_t floor = max((uint32_t)(thr_key >> 48), NEG_INF_KEY);
    uint32_t lo = max(floor, sm.kmin[r & 1]), hi = sm.kmax;
    while (lo < hi) { /* count(>= lo) >= K or lo == floor; count(>= hi + 1) < K */
        const uint32_t mid = lo + ((hi - lo + 1) >> 1);
        if (__syncthreads_count(key >= mid) >= k) lo = mid;
        else hi = mid - 1;
    }
    if (lo > floor) { /* strictly above the old threshold's value, so its key is higher too */
        thr_key = (uint64_t)(lo << 16) << 32;
        thr_val = key_value(thr_key);
        if (threadIdx.x == 0) { /* for compact(); nobody reads these before its barriers */
            sm.thr_key = thr_key;
            sm.thr_val = thr_val;
        }
    }
}

/* Tile staging through shared memory by cp.async (sm_80+). A thread's slot u of a stage is at
 * shared address slot0 + u * SLOT_STRIDE; vector u of its tile at src + u * THREADS, i.e. the same
 * byte stride. */
static_assert(UNROLL == 4 && SLOT_STRIDE == 4096, "the asm below spells out 4 slots 4096 apart");

/* Copies a full tile and commits the group. */
__device__ __forceinline__ void cp_async_tile(uint32_t slot0, const uint4 *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n\t"
                 "cp.async.cg.shared.global [%0+4096], [%1+4096], 16;\n\t"
                 "cp.async.cg.shared.global [%0+8192], [%1+8192], 16;\n\t"
                 "cp.async.cg.shared.global [%0+12288], [%1+12288], 16;\n\t"
                 "cp.async.commit_group;" ::"r"(slot0), "l"(src) : "memory");
}

/* Copies the vectors of a partial tile below n_vec (j: vector index of slot 0), stores -inf words
 * into the other slots, and commits the group. */
__device__ __forceinline__ void cp_async_tile_partial(uint32_t slot0, const uint4 *src, int j,
                                                      int n_vec, uint32_t neg_inf_word) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const uint32_t d = slot0 + u * SLOT_STRIDE;
        if (j + u * THREADS < n_vec)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                         ::"r"(d), "l"(src + u * THREADS) : "memory");
        else
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(d), "r"(neg_inf_word)
                         : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

/* Reads the thread's slots of a stage back (after the wait that covers them). */
__device__ __forceinline__ void lds_tile(uint4 (&w)[UNROLL], uint32_t slot0) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++)
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[u].x), "=r"(w[u].y), "=r"(w[u].z), "=r"(w[u].w)
                     : "r"(slot0 + u * SLOT_STRIDE)
                     : "memory");
}

/* Offers the candidates of the pending mask (bits as in Elem<T>; the values come from the tile's
 * stage at slot0, intact until the next tile's copies; e0: the thread's first element of the
 * tile) whose key reaches thr_key. Returns the candidates still pending: nonzero when one found
 * the buffer full (they are offered again after the CTA has compacted it). */
template <typename T, int CAP, bool SAN>
__device__ __forceinline__ uint32_t offer(ChunkSmem<CAP> &sm, uint32_t slot0, int e0,
                                          uint64_t thr_key, uint32_t pending) {
    while (pending) {
        const int b = __ffs(pending) - 1;
        const int off = Elem<T>::offset(b);
        float x = Elem<T>::load(slot0, off);
        if (SAN) x = sanitize(x);
        const uint64_t key = make_key(x, e0 + off);
        if (key >= thr_key) {
            /* (pending >> b) & 1 is 1; a constant would make the compiler aggregate the atomic
             * over the warp, a dozen instructions for the usual one or two active lanes */
            const int slot = atomic_add_shared(&sm.count, (pending >> b) & 1);
            if (slot >= CAP) return pending;
            sm.buf[slot] = key;
        }
        pending &= pending - 1;
    }
    return 0;
}

/* One pass over the chunk [lo, hi) of the row. Returns true (uniformly) if the fast path
 * (SAN = false) met special values, in which case the results are garbage and the caller redoes
 * the chunk with SAN. On return sm.buf holds the chunk's best keys sorted (sm.count of them) and
 * *lse its log-sum-exp. */
template <typename T, int CAP, bool SAN>
__device__ bool chunk_pass(const Args &a, ChunkSmem<CAP> &sm, uint4 *stage,
                           const unsigned char *row, int lo, int hi, double *lse) {
    constexpr int N = Elem<T>::N;
    constexpr int ES = (int)sizeof(T);
    constexpr int TILE = THREADS * UNROLL; /* vectors */
    const int tid = threadIdx.x, k = a.k;
    if (tid == 0) {
        sm.count = 0;
        sm.count2 = 0;
        sm.thr_key = 0;
        sm.thr_val = -INFINITY;
        sm.kmax = 0;
        sm.kmin[0] = sm.kmin[1] = 0xffffffffu;
    }
    __syncthreads();
    Soft st = {SAN ? -INFINITY : -FLT_MAX, 0.0f, false};
    float thr_val = -INFINITY; /* the CTA's threshold, kept in every thread */
    uint64_t thr_key = 0;

    /* Split [lo, hi) into a scalar head, 16-byte vectors, a scalar tail. */
    const uintptr_t addr = (uintptr_t)(row + (size_t)lo * ES);
    int head = (int)(((16 - (addr & 15)) & 15) / ES);
    if (head > hi - lo) head = hi - lo;
    const int body = lo + head;
    const int n_vec = (hi - body) / N;
    const int body_end = body + n_vec * N;
    const int n_scalar = head + (hi - body_end);
    if (tid < n_scalar) { /* at most 2 * (N - 1) elements; the buffer has room for all */
        const int e = tid < head ? lo + tid : body_end + (tid - head);
        const float x = absorb_one<SAN>(Elem<T>::scalar(row, e), st);
        const int slot = atomicAdd(&sm.count, 1);
        sm.buf[slot] = make_key(x, e);
    }
    if (!SAN && n_scalar > 0 && __syncthreads_or(st.special)) return true;

    /* Tiles stream through two shared-memory stages by cp.async: tile t + 1 is in flight while
     * tile t is processed, without holding it in registers. A thread copies and reads back only
     * its own slots, so no barrier guards the stages. The last tile may be partial. */
    const uint4 *vp = (const uint4 *)(row + (size_t)body * ES) + tid;
    const uint32_t slot0 = (uint32_t)__cvta_generic_to_shared(stage + tid); /* stage 0, slot 0 */
    constexpr uint32_t STAGE = UNROLL * SLOT_STRIDE;
    const int n_full = n_vec / TILE, n_tiles = (n_vec + TILE - 1) / TILE;
    if (n_full > 0) cp_async_tile(slot0, vp);
    else if (n_tiles > 0) cp_async_tile_partial(slot0, vp, tid, n_vec, Elem<T>::NEG_INF_WORD);
    float rmax = -INFINITY; /* running maximum of this thread's elements */
    for (int t = 0; t < n_tiles; t++) {
        const uint32_t cur = slot0 + (t & 1) * STAGE, next = slot0 + (~t & 1) * STAGE;
        if (t + 1 < n_full) cp_async_tile(next, vp + (t + 1) * TILE);
        else if (t + 1 < n_tiles)
            cp_async_tile_partial(next, vp + (t + 1) * TILE, (t + 1) * TILE + tid, n_vec,
                                  Elem<T>::NEG_INF_WORD);
        else cp_async_commit(); /* an empty group keeps the count below right */
        cp_async_wait<1>();     /* all but the newest group done: tile t has landed */
        uint4 w[UNROLL];
        lds_tile(w, cur);
        /* Per tile: its maximum, the threshold, the candidates, then the log-sum-exp (last, so
         * that the tile's registers die as it goes instead of living through the rest). */
        const float tmax = tile_max<T, SAN>(w);
        const bool special = !SAN && is_special(tmax); /* the pass ends at the first one */
        rmax = fmaxf(rmax, tmax);
        /* Threshold: for K <= THREADS raised from the running maxima after tiles 0, 1, 3, 7, ...
         * (later raises gain less), otherwise from the vector maxima of the first tile. */
        if (k <= THREADS) {
            if ((t & (t + 1)) == 0) /* t = 2^r - 1 */
                raise_threshold<CAP>(sm, rmax, k, __ffs(t + 1) - 1, thr_val, thr_key);
        } else if (t == 0) {
            float vm[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) vm[u] = vec_max<T, SAN>(w[u]);
            threshold_from_maxima<CAP, UNROLL>(sm, vm, k);
            thr_key = sm.thr_key;
            thr_val = sm.thr_val;
        }
        /* Candidates: one compare per tile; a tile whose maximum reaches the threshold gets its
         * mask (vectors past the end excluded: they hold -inf, which a -inf threshold admits). */
        const int e0 = body + (t * TILE + tid) * N; /* the thread's first element of the tile */
        uint32_t pending = 0;
        if (!(tmax < thr_val)) {
            pending = cand_mask<T, SAN>(w, thr_val);
            if (t >= n_full) {
#pragma unroll
                for (int u = 0; u < UNROLL; u++)
                    if (t * TILE + u * THREADS + tid >= n_vec) pending &= ~Elem<T>::vec_bits(u);
            }
            pending = offer<T, CAP, SAN>(sm, cur, e0, thr_key, pending);
        }
        /* One barrier per tile; when the buffer overflowed, the CTA compacts it (raising the
         * threshold) and the candidates still pending are offered again. */
        while (__syncthreads_or(pending != 0 || special)) {
            if (!SAN && __syncthreads_or(special)) {
                cp_async_wait<0>(); /* no copy may land in the stages during the redo */
                return true;
            }
            compact(sm, k);
            thr_key = sm.thr_key;
            thr_val = sm.thr_val;
            pending = offer<T, CAP, SAN>(sm, cur, e0, thr_key, pending);
        }
        absorb_tile<T, SAN>(w, tmax, st);
    }

    /* Log-sum-exp of the chunk: warp shuffles, then thread 0 over the warps. */
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, st.M, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, st.S, off);
        soft_combine<SAN>(st.M, st.S, m2, s2);
    }
    if ((tid & 31) == 0) {
        sm.red_m[tid >> 5] = st.M;
        sm.red_s[tid >> 5] = st.S;
    }
    finish_chunk(sm, k, thr_key); /* its barriers also publish red_m / red_s */
    if (tid == 0) {
        float M = sm.red_m[0], S = sm.red_s[0];
        for (int i = 1; i < WARPS; i++) soft_combine<SAN>(M, S, sm.red_m[i], sm.red_s[i]);
        if (M == -INFINITY || S == 0.0f) *lse = -INFINITY; /* nothing finite */
        else if (SAN) *lse = (double)M + log((double)S);
        else *lse = ((double)M + log2((double)S)) * 0.6931471805599453;
    }
    return false;
}

template <typename T, int CAP>
__global__ void __launch_bounds__(THREADS, 4) topk_chunk_kernel(const Args a) {
    __shared__ ChunkSmem<CAP> sm;
    __shared__ double lse_s;
    extern __shared__ uint4 stage[]; /* [2][UNROLL][THREADS], STAGE_BYTES */
    const int64_t row_idx = blockIdx.x / a.chunks;
    const int chunk = (int)(blockIdx.x % a.chunks);
    const unsigned char *row = a.logits + row_idx * a.row_stride * (int64_t)sizeof(T);
    const int lo = chunk * a.chunk_len;
    const int hi = min(a.vocab, lo + a.chunk_len);
    if (chunk_pass<T, CAP, false>(a, sm, stage, row, lo, hi, &lse_s)) {
        __syncthreads();
        chunk_pass<T, CAP, true>(a, sm, stage, row, lo, hi, &lse_s);
    }
    __syncthreads();
    const int n = sm.count; /* min(K, chunk length) */
    if (a.chunks == 1) {
        const float lse = (float)lse_s;
        for (int j = threadIdx.x; j < a.k; j += THREADS) {
            const uint64_t key = sm.buf[j];
            const float v = key_value(key);
            a.top_ids[row_idx * a.k + j] = key_id(key);
            a.top_logp[row_idx * a.k + j] = v == -INFINITY ? -INFINITY : v - lse;
        }
    } else {
        const int64_t slot = row_idx * a.chunks + chunk;
        for (int j = threadIdx.x; j < n; j += THREADS) a.ws_keys[slot * a.k + j] = sm.buf[j];
        if (threadIdx.x == 0) {
            a.ws_lse[slot] = lse_s;
            a.ws_count[slot] = n;
        }
    }
}

/* One CTA per row: combine the chunks' log-sum-exps and select the best K of their keys: by
 * counting each key's rank when they are at most THREADS (C * K, e.g. 96 at K = 32), else by a
 * bitonic sort. */
__global__ void __launch_bounds__(THREADS) topk_merge_kernel(const Args a) {
    __shared__ uint64_t keys[MERGE_MAX];
    __shared__ int offset[MAX_CHUNKS + 1];
    __shared__ float lse_s;
    const int64_t row_idx = blockIdx.x;
    const int C = a.chunks;
    if (threadIdx.x == 0) {
        int total = 0;
        double mx = -INFINITY;
        for (int c = 0; c < C; c++) {
            offset[c] = total;
            total += a.ws_count[row_idx * C + c];
            mx = fmax(mx, a.ws_lse[row_idx * C + c]);
        }
        offset[C] = total;
        double lse = -INFINITY;
        if (mx != -INFINITY) {
            double sum = 0;
            for (int c = 0; c < C; c++) {
                const double l = a.ws_lse[row_idx * C + c];
                if (l != -INFINITY) sum += exp(l - mx);
            }
            lse = mx + log(sum);
        }
        lse_s = (float)lse;
    }
    __syncthreads();
    const int total = offset[C];
    for (int c = 0; c < C; c++) {
        const int n = offset[c + 1] - offset[c];
        const uint64_t *src = a.ws_keys + (row_idx * C + c) * a.k;
        for (int j = threadIdx.x; j < n; j += THREADS) keys[offset[c] + j] = src[j];
    }
    __syncthreads();
    const float lse = lse_s;
    if (total <= THREADS) { /* keys are distinct (ids are), so ranks are too */
        if (threadIdx.x < total) {
            const uint64_t key = keys[threadIdx.x];
            int rank = 0;
            for (int j = 0; j < total; j++) rank += keys[j] > key;
            if (rank < a.k) {
                const float v = key_value(key);
                a.top_ids[row_idx * a.k + rank] = key_id(key);
                a.top_logp[row_idx * a.k + rank] = v == -INFINITY ? -INFINITY : v - lse;
            }
        }
        return;
    }
    int np = 1;
    while (np < total) np <<= 1;
    for (int i = total + threadIdx.x; i < np; i += THREADS) keys[i] = 0;
    __syncthreads();
    bitonic_sort_desc(keys, np);
    for (int j = threadIdx.x; j < a.k; j += THREADS) {
        const uint64_t key = keys[j];
        const float v = key_value(key);
        a.top_ids[row_idx * a.k + j] = key_id(key);
        a.top_logp[row_idx * a.k + j] = v == -INFINITY ? -INFINITY : v - lse;
    }
}

/* Dynamic shared memory of the chunk kernel: two tile stages. With the static part it passes
 * 48 KB, so the limit is raised (every call: cheap, and right for whichever device is current). */
constexpr int STAGE_BYTES = 2 * UNROLL * THREADS * (int)sizeof(uint4);

template <typename T, int CAP>
cudaError_t launch_chunk_kernel(const Args &a, unsigned grid, cudaStream_t stream) {
    cudaError_t e = cudaFuncSetAttribute(topk_chunk_kernel<T, CAP>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, STAGE_BYTES);
    if (e != cudaSuccess) return e;
    topk_chunk_kernel<T, CAP><<<grid, THREADS, STAGE_BYTES, stream>>>(a);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_chunks(const Args &a, int n_rows, cudaStream_t stream) {
    const unsigned grid = (unsigned)((int64_t)n_rows * a.chunks);
    /* The buffer must hold K keys plus room to make progress; twice K at least. */
    if (a.k <= 512) return launch_chunk_kernel<T, 2048>(a, grid, stream);
    return launch_chunk_kernel<T, 4096>(a, grid, stream);
}

} // namespace

extern "C" size_t kdt_topk_workspace_bytes(int32_t n_rows, int32_t vocab, int32_t k) {
    if (n_rows < 1 || vocab < 1 || vocab > KDT_MAX_VOCAB || k < 1 || k > KDT_MAX_TOPK || k > vocab)
        return 0;
    if (vocab < 2 * MIN_CHUNK) return 0; /* never split */
    const size_t rows = n_rows < TARGET_CTAS ? (size_t)n_rows : (size_t)TARGET_CTAS;
    return rows * ((size_t)MERGE_MAX * 8 + (size_t)MAX_CHUNKS * 12) + 64;
}

extern "C" kdt_status kdt_topk_logsoftmax_cuda(const kdt_topk_params *p, void *stream) {
    static const char *who = "kdt_topk_logsoftmax_cuda";
    kdt_status st = kdt_topk_check_args(p, who);
    if (st != KDT_OK) return st;
    const Plan pl = apply_override(make_plan(p->n_rows, p->vocab, p->k), p->vocab);
    /* Only what this call uses is required (kdt_topk_workspace_bytes() is an upper bound). */
    const size_t need = pl.chunks > 1 ? ws_used_bytes(p->n_rows, pl.chunks, p->k) : 0;
    KDT_CHECK_ARG(p->workspace_bytes >= need,
                  "%s: workspace_bytes = %zu, this call needs %zu (size it with "
                  "kdt_topk_workspace_bytes(%d, %d, %d) = %zu)", who, p->workspace_bytes, need,
                  p->n_rows, p->vocab, p->k, kdt_topk_workspace_bytes(p->n_rows, p->vocab, p->k));
    KDT_CHECK_ARG(need == 0 || p->workspace != NULL, "%s: workspace is NULL (%zu bytes needed)",
                  who, need);
    KDT_CHECK_ARG(need == 0 || (uintptr_t)p->workspace % 16 == 0,
                  "%s: workspace is not 16-byte aligned", who);
    Args a;
    a.logits = (const unsigned char *)p->logits;
    a.row_stride = p->row_stride;
    a.vocab = p->vocab;
    a.k = p->k;
    a.chunks = pl.chunks;
    a.chunk_len = pl.chunk_len;
    a.top_ids = p->top_ids;
    a.top_logp = p->top_logp;
    a.ws_keys = NULL;
    a.ws_lse = NULL;
    a.ws_count = NULL;
    if (pl.chunks > 1) {
        unsigned char *ws = (unsigned char *)p->workspace;
        a.ws_keys = (uint64_t *)ws;
        a.ws_lse = (double *)(ws + ws_keys_bytes(p->n_rows, pl.chunks, p->k));
        a.ws_count = (int32_t *)(ws + ws_keys_bytes(p->n_rows, pl.chunks, p->k) +
                                 ws_lse_bytes(p->n_rows, pl.chunks));
    }
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e = p->dtype == KDT_BF16 ? launch_chunks<uint16_t>(a, p->n_rows, s)
                                         : launch_chunks<float>(a, p->n_rows, s);
    if (e == cudaSuccess && pl.chunks > 1) {
        topk_merge_kernel<<<(unsigned)p->n_rows, THREADS, 0, s>>>(a);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess)
        return kdt_fail(KDT_ERR_CUDA, "%s: launch failed: %s", who, cudaGetErrorString(e));
    return KDT_OK;
}
