/* topk.cu - CUDA log-softmax + top-K over the vocabulary (kdt_topk_logsoftmax_cuda) and the
 * size of its workspace (kdt_topk_workspace_bytes). Value policy, order and log-prob formula are
 * those of cpu/topk.c: NaN -> -inf, +inf -> FLT_MAX, descending value then ascending id, i.e. the
 * descending order of key = (order_key(value) << 32) | (0xffffffff - id); -inf logits get -inf.
 * Ids match the CPU exactly; log-probs agree to float rounding of the log-sum-exp.
 *
 * Design: every row is cut into C chunks (C from the shape alone, see plan()); one CTA of 256
 * threads reads one chunk exactly once from HBM, in tiles of 256 x 4 x 16 bytes (the next tile's
 * loads are in flight while the current one is processed), and computes in the same pass
 *   - the chunk's log-sum-exp: per thread an online (max, sum) in the log2 domain, one ex2.approx
 *     per element, rescaled once per 16-byte vector;
 *   - the chunk's top-K: a candidate buffer in shared memory (CAP keys) behind a threshold key.
 *     After the first tile the threshold is the K-th largest of a set of per-thread (K <= 256) or
 *     per-vector (K <= 1024) maxima: each of those maxima is a distinct element, so at least K
 *     elements reach it and nothing below it can be in the top-K (found by warp-sorting the
 *     maxima and binary-searching ranks, not by an all-pairs count). A vector whose maximum is
 *     below the threshold costs one compare. When the buffer overflows, the CTA sorts it
 *     (bitonic), keeps the best K and raises the threshold to the K-th key; the elements that
 *     did not fit stay pending in their threads and are offered again, so no candidate is lost
 *     whatever the data (ties, ascending rows) - those just take more rounds.
 * With C == 1 the CTA writes the sorted top-K and log-probs itself; with C > 1 it writes its
 * top-K keys and log-sum-exp to the workspace and a merge kernel (one CTA per row) combines the
 * C partial log-sum-exps in double, sorts the C*K keys and writes the rows.
 * Fast path and special values: the fast path assumes finite values (or -inf). A thread that
 * meets NaN, +inf or |x| > 1e30 flags it (NaN-propagating max per vector); the CTA then stops
 * and redoes its chunk with per-element sanitizing and natural-log expf (rare, about 2x slower).
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
constexpr int TARGET_CTAS = 1056;   /* about 8 CTAs per SM on a 132-SM H200 */
constexpr int MIN_CHUNK = 4096;     /* elements; below this a chunk is mostly fixed cost */
constexpr int MAX_CHUNKS = 64;
constexpr int MERGE_MAX = 4096;     /* C * K keys one merge CTA sorts in shared memory */
constexpr float LOG2E = 1.4426950408889634f;

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
    int c = (TARGET_CTAS + n_rows - 1) / n_rows;
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

/* kdt_f32_order_key (fp.h) on the device. */
__device__ __forceinline__ uint32_t order_key(float f) {
    if (f == 0.0f) f = 0.0f; /* -0 -> +0 */
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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

/* Element types: a 16-byte vector holds N values. */
template <typename T> struct Elem;
/* Word q (0 .. 4 * UNROLL - 1) of a tile held in registers, without dynamic register indexing
 * (which would put the tile in local memory). Used for the rare candidates only. */
__device__ __forceinline__ uint32_t tile_word(const uint4 (&w)[UNROLL], int q) {
    uint32_t r = 0;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        r = q == 4 * u ? w[u].x : r;
        r = q == 4 * u + 1 ? w[u].y : r;
        r = q == 4 * u + 2 ? w[u].z : r;
        r = q == 4 * u + 3 ? w[u].w : r;
    }
    return r;
}

template <> struct Elem<uint16_t> { /* bf16 bits */
    static constexpr int N = 8;
    /* Element b (vector b / 8, lane b % 8) of a tile. */
    static __device__ __forceinline__ float from_tile(const uint4 (&w)[UNROLL], int b) {
        const uint32_t q = tile_word(w, b >> 1);
        return __uint_as_float((b & 1) ? (q & 0xffff0000u) : (q << 16));
    }
    static __device__ __forceinline__ void unpack(const uint4 w, float (&v)[8]) {
        const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(u[i] << 16);
            v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
    static __device__ __forceinline__ float scalar(const unsigned char *row, int64_t i) {
        return __uint_as_float((uint32_t)__ldg((const unsigned short *)row + i) << 16);
    }
};
template <> struct Elem<float> {
    static constexpr int N = 4;
    static __device__ __forceinline__ float from_tile(const uint4 (&w)[UNROLL], int b) {
        return __uint_as_float(tile_word(w, b));
    }
    static __device__ __forceinline__ void unpack(const uint4 w, float (&v)[4]) {
        v[0] = __uint_as_float(w.x);
        v[1] = __uint_as_float(w.y);
        v[2] = __uint_as_float(w.z);
        v[3] = __uint_as_float(w.w);
    }
    static __device__ __forceinline__ float scalar(const unsigned char *row, int64_t i) {
        return __ldg((const float *)row + i);
    }
};

/* Per-thread online log-sum-exp. Fast path (SAN = false): M is a max in log2 units (x * log2 e)
 * and S = sum 2^(x log2 e - M). Sanitizing path: M in natural units, S = sum e^(x - M). */
struct Soft {
    float M, S;
    bool special;  /* fast path met NaN, +inf or |x| > 1e30 */
};

/* Folds n values into st; returns their maximum (NaN if one is NaN on the fast path). */
template <bool SAN, int N>
__device__ __forceinline__ float absorb(float (&v)[N], Soft &st) {
    if (SAN) {
#pragma unroll
        for (int i = 0; i < N; i++) v[i] = sanitize(v[i]);
    }
    float mv = v[0];
#pragma unroll
    for (int i = 1; i < N; i++) mv = SAN ? fmaxf(mv, v[i]) : max_nan(mv, v[i]);
    float acc[2] = {0.0f, 0.0f};
    if (SAN) {
        if (mv > st.M) {
            st.S = st.M == -INFINITY ? 0.0f : st.S * expf(st.M - mv);
            st.M = mv;
        }
        if (st.M != -INFINITY) {
#pragma unroll
            for (int i = 0; i < N; i++) acc[i & 1] += expf(v[i] - st.M);
        }
    } else {
        st.special |= !(fabsf(mv) <= 1e30f) && mv != -INFINITY;
        const float m2 = mv * LOG2E;
        if (m2 > st.M) {
            st.S *= ex2(st.M - m2);
            st.M = m2;
        }
        if (st.M != -INFINITY) {
#pragma unroll
            for (int i = 0; i < N; i++) acc[i & 1] += ex2(fmaf(v[i], LOG2E, -st.M));
        }
    }
    st.S += acc[0] + acc[1];
    return mv;
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
    __align__(16) float group_max[THREADS * UNROLL]; /* threshold candidates, first tile */
    float red_m[WARPS], red_s[WARPS];
    uint64_t thr_key;                  /* nothing below this key can be in the top-K */
    float thr_val;                     /* the value part of thr_key, for the cheap pre-filter */
    int count;                         /* keys in buf (may run past CAP on overflow) */
};

/* Sorts the buffer, keeps its best K and raises the threshold to the K-th key. */
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
        if (n >= k) {
            sm.thr_key = sm.buf[k - 1];
            sm.thr_val = key_value(sm.buf[k - 1]);
        }
    }
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

/* The K-th largest of the PER * THREADS values vals (entry u * THREADS + tid holds vals[u])
 * becomes the threshold value if it beats the current one (K <= PER * THREADS). Each warp sorts
 * its 32-entry lists in registers (shuffle bitonic) into group_max; an entry's rank is then its
 * position in its list plus binary-searched counts in the other lists, with ties broken by
 * list index, so the ranks are a permutation and exactly one entry has rank k - 1. About
 * 50 (PER = 1) or 800 (PER = 4) instructions a thread instead of PER^2 * THREADS compares.
 * vals must be NaN-free; on the fast path a NaN only happens when the chunk is redone anyway. */
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

/* One pass over the chunk. Returns true (uniformly) if the fast path (SAN = false) met special
 * values, in which case the results are garbage and the caller redoes the chunk with SAN. On
 * return sm.buf holds the chunk's best keys sorted (sm.count of them) and *lse its log-sum-exp. */
template <typename T, int CAP, bool SAN>
__device__ bool chunk_pass(const Args &a, ChunkSmem<CAP> &sm, const unsigned char *row,
                           int64_t lo, int64_t hi, double *lse) {
    constexpr int N = Elem<T>::N;
    constexpr int ES = (int)sizeof(T);
    const int tid = threadIdx.x, k = a.k;
    if (tid == 0) {
        sm.count = 0;
        sm.thr_key = 0;
        sm.thr_val = -INFINITY;
    }
    __syncthreads();
    Soft st = {-INFINITY, 0.0f, false};

    /* Split [lo, hi) into a scalar head, 16-byte vectors, a scalar tail. */
    const uintptr_t addr = (uintptr_t)(row + lo * ES);
    int64_t head = (int64_t)(((16 - (addr & 15)) & 15) / ES);
    if (head > hi - lo) head = hi - lo;
    const int64_t body = lo + head;
    const int n_vec = (int)((hi - body) / N); /* < 2^20: chunks are at most a row */
    const int64_t body_end = body + (int64_t)n_vec * N;
    const int n_scalar = (int)(head + (hi - body_end));
    if (tid < n_scalar) { /* at most 2 * (N - 1) elements; the buffer has room for all */
        const int64_t e = tid < head ? lo + tid : body_end + (tid - head);
        float v[1] = {Elem<T>::scalar(row, e)};
        absorb<SAN, 1>(v, st);
        const int slot = atomicAdd(&sm.count, 1);
        sm.buf[slot] = make_key(v[0], (int32_t)e);
    }

    const uint4 *vec = (const uint4 *)(row + body * ES);
    constexpr int TILE = THREADS * UNROLL;
    const int n_tiles = (n_vec + TILE - 1) / TILE;
    uint4 w[UNROLL], w_next[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const int j = u * THREADS + tid;
        if (j < n_vec) w_next[u] = __ldcs(vec + j);
    }
    for (int t = 0; t < n_tiles; t++) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) w[u] = w_next[u];
        if (t + 1 < n_tiles) { /* prefetch the next tile */
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int j = (t + 1) * TILE + u * THREADS + tid;
                if (j < n_vec) w_next[u] = __ldcs(vec + j);
            }
        }
        float vmax[UNROLL]; /* per-vector max, -inf for a vector past the end */
        uint32_t valid = 0;  /* bit u: vector u of this tile exists */
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int j = t * TILE + u * THREADS + tid;
            vmax[u] = -INFINITY;
            if (j < n_vec) {
                valid |= 1u << u;
                float v[N];
                Elem<T>::unpack(w[u], v);
                vmax[u] = absorb<SAN, N>(v, st);
            }
        }
        if (t == 0 && k <= THREADS * UNROLL) {
            if (k <= THREADS) {
                float m[1] = {vmax[0]};
#pragma unroll
                for (int u = 1; u < UNROLL; u++) m[0] = fmaxf(m[0], vmax[u]);
                threshold_from_maxima<CAP, 1>(sm, m, k);
            } else {
                threshold_from_maxima<CAP, UNROLL>(sm, vmax, k);
            }
        }
        /* Candidates of this tile: bit u * N + i for element i of vector u, set when the value
         * reaches the threshold value; the exact key test happens when it is offered. */
        uint64_t thr_key = sm.thr_key;
        float thr_val = sm.thr_val;
        uint32_t pending = 0;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (((valid >> u) & 1u) && !(vmax[u] < thr_val)) {
                float v[N];
                Elem<T>::unpack(w[u], v);
#pragma unroll
                for (int i = 0; i < N; i++) {
                    const float x = SAN ? sanitize(v[i]) : v[i];
                    if (!(x < thr_val)) pending |= 1u << (u * N + i);
                }
            }
        }
        /* Offer them; a candidate that finds the buffer full stays pending for the next round,
         * after the CTA has compacted the buffer. The values come from the tile still held in
         * registers (a select chain, no local memory), so no global re-read sits in this loop:
         * a re-read was a dependent L2/HBM round trip per candidate that every tile waited on. */
        for (;;) {
            bool overflow = false;
            uint32_t todo = pending;
            while (todo) {
                const int b = __ffs(todo) - 1;
                todo &= todo - 1;
                const int j = t * TILE + (b / N) * THREADS + tid;
                const int64_t e = body + (int64_t)j * N + (b % N);
                float x = Elem<T>::from_tile(w, b);
                if (SAN) x = sanitize(x);
                const uint64_t key = make_key(x, (int32_t)e);
                if (key >= thr_key) {
                    const int slot = atomicAdd(&sm.count, 1);
                    if (slot >= CAP) {
                        overflow = true;
                        break;
                    }
                    sm.buf[slot] = key;
                }
                pending &= ~(1u << b);
            }
            if (!__syncthreads_or(overflow)) break;
            compact(sm, k);
            thr_key = sm.thr_key;
            thr_val = sm.thr_val;
        }
        if (!SAN && __syncthreads_or(st.special)) return true;
    }
    if (!SAN && __syncthreads_or(st.special)) return true; /* the scalars, when no tile ran */

    /* Log-sum-exp of the chunk: warp shuffles, then warp 0 over the warps. */
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
    compact(sm, k); /* final sort; its barriers also publish red_m / red_s */
    if (tid == 0) {
        float M = sm.red_m[0], S = sm.red_s[0];
        for (int i = 1; i < WARPS; i++) soft_combine<SAN>(M, S, sm.red_m[i], sm.red_s[i]);
        if (M == -INFINITY) *lse = -INFINITY;
        else if (SAN) *lse = (double)M + log((double)S);
        else *lse = ((double)M + log2((double)S)) * 0.6931471805599453;
    }
    return false;
}

template <typename T, int CAP>
__global__ void __launch_bounds__(THREADS, 4) topk_chunk_kernel(const Args a) {
    __shared__ ChunkSmem<CAP> sm;
    __shared__ double lse_s;
    const int64_t row_idx = blockIdx.x / a.chunks;
    const int chunk = (int)(blockIdx.x % a.chunks);
    const unsigned char *row = a.logits + row_idx * a.row_stride * (int64_t)sizeof(T);
    const int64_t lo = (int64_t)chunk * a.chunk_len;
    const int64_t hi = min((int64_t)a.vocab, lo + a.chunk_len);
    if (chunk_pass<T, CAP, false>(a, sm, row, lo, hi, &lse_s)) {
        __syncthreads();
        chunk_pass<T, CAP, true>(a, sm, row, lo, hi, &lse_s);
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

/* One CTA per row: combine the chunks' log-sum-exps and sort their keys. */
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
    int np = 1;
    while (np < total) np <<= 1;
    for (int c = 0; c < C; c++) {
        const int n = offset[c + 1] - offset[c];
        const uint64_t *src = a.ws_keys + (row_idx * C + c) * a.k;
        for (int j = threadIdx.x; j < n; j += THREADS) keys[offset[c] + j] = src[j];
    }
    for (int i = total + threadIdx.x; i < np; i += THREADS) keys[i] = 0;
    __syncthreads();
    bitonic_sort_desc(keys, np);
    const float lse = lse_s;
    for (int j = threadIdx.x; j < a.k; j += THREADS) {
        const uint64_t key = keys[j];
        const float v = key_value(key);
        a.top_ids[row_idx * a.k + j] = key_id(key);
        a.top_logp[row_idx * a.k + j] = v == -INFINITY ? -INFINITY : v - lse;
    }
}

template <typename T>
cudaError_t launch_chunks(const Args &a, int n_rows, cudaStream_t stream) {
    const unsigned grid = (unsigned)((int64_t)n_rows * a.chunks);
    /* The buffer must hold K keys plus room to make progress; twice K at least. */
    if (a.k <= 512) topk_chunk_kernel<T, 2048><<<grid, THREADS, 0, stream>>>(a);
    else topk_chunk_kernel<T, 4096><<<grid, THREADS, 0, stream>>>(a);
    return cudaGetLastError();
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
