/* test_gemm_ab_gpu.cu - the GEMMs of src/model/cuda/gpu_gemm.cu, v1 (the first kernels, kept behind
 * KDT_GEMM_V1=1) against v2 (the small-M kernels) and v3 (the persistent weight-streaming kernels
 * of launch bounds <= 64 rows) in ONE process on the same inputs.
 *   1. bitwise: dense GEMM (gather / identity rows, ragged kx, unaligned ldx, batch, split-K),
 *      grouped MoE GEMM (gate/up gather and down), lm_head (logits + fused argmax), many M;
 *      plus "row alone == row inside a batch" for v2 and v3. v3 runs every dense and grouped case
 *      under several schedules (K blocks per stage block, CTAs per SM, balanced or full grid, rows
 *      per pass), each of which must give v1's bits.
 *   2. timing (cudaEvent, L2 flushed by a 512 MB read before every launch, median of reps) of the
 *      Kimi K2.6 decode / verify shapes for v1, v2 and v3, with GB/s of weight bytes; --sweep
 *      adds v3 under each schedule on the decode-sized shapes.
 * The wgmma kernel for many rows (gemm_wg.cuh) runs every dense case too, where the device has it.
 * Built by CMake as gpu_test_gemm_ab (label gpu). Run: gpu_test_gemm_ab [--timing [--sweep] | --prefill]
 * (exit 0 = all bitwise checks passed; --timing adds part 2, a benchmark, not part of the test). */
#include "gpu_gemm.cu"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <vector>
#include <algorithm>

#include "gpu_test_util.h"

extern "C" kdt_status kdt_fail(kdt_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kdt_fail: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return s;
}

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));   \
            exit(2);                                                                             \
        }                                                                                        \
    } while (0)

static int n_fail = 0, n_pass = 0;
static bool g_wg = false; /* the device runs wgg::wg_gemm_kernel (sm_90a code, enough shared memory) */

__device__ uint64_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}
/* bf16 weights: random sign / mantissa, exponent spread over 2^-12 .. 2^3; zero padding columns */
__global__ void k_fill_w(uint16_t *w, int64_t rows, int cols, int ld, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * ld; i += (int64_t)gridDim.x * blockDim.x) {
        const int c = (int)(i % ld);
        if (c >= cols) { w[i] = 0; continue; }
        const uint64_t h = mix(seed * 0x9e3779b97f4a7c15ULL + (uint64_t)i);
        const uint32_t sign = (uint32_t)(h & 1) << 15, man = (uint32_t)(h >> 1) & 0x7f, ex = 115 + (uint32_t)((h >> 8) % 16);
        w[i] = (uint16_t)(sign | (ex << 7) | man);
    }
}
/* fp32 activations: full 24-bit mantissas, exponents 2^-10 .. 2^5, some exact zeros */
__global__ void k_fill_x(float *x, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint64_t h = mix(seed * 0x632be59bd9b4e019ULL + (uint64_t)i);
        if ((h & 63) == 0) { x[i] = 0.0f; continue; }
        const uint32_t sign = (uint32_t)(h >> 6 & 1) << 31, man = (uint32_t)(h >> 7) & 0x7fffff,
                       ex = 117 + (uint32_t)((h >> 32) % 16);
        x[i] = __uint_as_float(sign | (ex << 23) | man);
    }
}
__global__ void k_poison(uint32_t *p, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        p[i] = 0x7fc0dead;
}
__global__ void k_sink(const float4 *p, int64_t n, float *out) {
    float a = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float4 v = p[i];
        a += v.x + v.y + v.z + v.w;
    }
    if (a == 12345.678f) *out = a;
}

static void poison(void *p, size_t bytes) { k_poison<<<1024, 256>>>((uint32_t *)p, (int64_t)(bytes / 4)); }

template <typename T>
static T *dalloc(size_t n) {
    T *p;
    CK(cudaMalloc(&p, n * sizeof(T)));
    return p;
}

static int32_t *dint(const std::vector<int32_t> &v) {
    int32_t *p = dalloc<int32_t>(v.size() ? v.size() : 1);
    if (v.size()) CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return p;
}

static bool same(const void *a, const void *b, size_t bytes, const char *what) {
    std::vector<unsigned char> ha(bytes), hb(bytes);
    CK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
    if (memcmp(ha.data(), hb.data(), bytes) == 0) {
        n_pass++;
        return true;
    }
    size_t i = 0;
    while (ha[i] == hb[i]) i++;
    fprintf(stderr, "  FAIL %s: first difference at byte %zu of %zu\n", what, i, bytes);
    n_fail++;
    return false;
}

/* The runner's stages on this device, as the model picks them (kdt_gpu_gemm_stages): 4 on an H100 /
 * H200, 3 on a 99 KB part (KDT_GPU_SMEM_LIMIT=101376 emulates one), so every pool below is one the
 * device takes. */
static int g_stages = 4;
static int pick_stages() {
    int optin = 0, per_sm = 0;
    CK(kdt_smem_optin(0, &optin));
    CK(kdt_smem_per_sm(0, &per_sm));
    return kdt_gemm_stages_for(per_sm, optin);
}
/* v1's instance for g_stages (v1 is templated on its stages) */
#define V1_LAUNCH(kernel, grid, arg)                                                                  \
    do {                                                                                              \
        if (g_stages == 2) v1::kernel<2><<<grid, THREADS, 2 * v1::STAGE_BYTES>>>(arg);                \
        else if (g_stages == 3) v1::kernel<3><<<grid, THREADS, 3 * v1::STAGE_BYTES>>>(arg);           \
        else v1::kernel<4><<<grid, THREADS, 4 * v1::STAGE_BYTES>>>(arg);                              \
    } while (0)
/* The grouped policy's smallest pool on this device: 5 CTAs per SM on an H100 / H200; fewer, or
 * the runner's, where 5's pool would not run the pipeline (gt_v2_grouped_k) */
static V2Cfg smallest_grouped_pool(int per_sm) {
    const V2Cfg cd = v2_config(g_stages);
    const int k = gt_v2_grouped_k(5, per_sm, cd.pool);
    return k > 2 ? v2_config_pool(pool_per_sm(per_sm, k)) : cd;
}

/* v3 schedules the bitwise checks run under: {on, kb, cps, bal} (0 = automatic) */
static const V3Tune V3_CONFIGS[] = {{1, 0, 0, 1}, {1, 2, 0, 1}, {1, 4, 0, 1}, {1, 1, 1, 1},
                                    {1, 2, 2, 0}, {1, 1, 3, 1}, {1, 4, 4, 0}};
static const int N_V3_CONFIGS = (int)(sizeof V3_CONFIGS / sizeof V3_CONFIGS[0]);
static bool g_v3 = false; /* v3 runs on this device */

static void set_v3(const V3Tune &t) { v3_tune() = t; }

/* v3 launch of a dense GEMM; false when v3 does not take it (row bound > 64) */
static bool launch_gemm3(const kdt_gemm_args &a) {
    v3::DenseP p;
    V3Plan pl;
    if (!g_v3 || !v3_dense(a, p, pl)) return false;
    v3_launch(p, pl, 0);
    CK(cudaGetLastError());
    return true;
}
static bool launch_grouped3(const kdt_grouped_args &a) {
    v3::GroupedP p;
    V3Plan pl;
    if (!g_v3 || !v3_grouped(a, p, pl)) return false;
    v3_launch(p, pl, 0);
    CK(cudaGetLastError());
    return true;
}

static void launch_gemm(const kdt_gemm_args &a, bool v1) {
    const dim3 grid((unsigned)((a.n + BN - 1) / BN), (unsigned)a.splits, (unsigned)(a.batch > 0 ? a.batch : 1));
    if (v1) V1_LAUNCH(gemm_kernel, grid, a);
    else {
        const V2Cfg c = v2_config(g_stages);
        v2_gemm_kernel<W_ROWS><<<grid, THREADS, c.pool>>>(a, c);
    }
    CK(cudaGetLastError());
}
/* the wgmma dense kernel (gemm_wg.cuh), as kdt_gemm_launch takes it for many rows */
static void launch_gemm_wg(const kdt_gemm_args &a) {
    const unsigned mtiles = (unsigned)((a.m_max + wgg::BM - 1) / wgg::BM);
    const dim3 grid((unsigned)((a.n + wgg::BN - 1) / wgg::BN), (unsigned)a.splits,
                    (unsigned)(a.batch > 0 ? a.batch : 1) * mtiles);
    wgg::wg_gemm_kernel<<<grid, wgg::THREADS, (size_t)wgg::SMEM>>>(a);
    CK(cudaGetLastError());
}
/* its A-from-shared-memory form (KDT_GEMM_WG_SS=1): X split into ws's hi / lo planes, then the GEMM
 * (unbatched launches only, as kdt_gemm_launch_ws takes it) */
static void launch_gemm_wg_ss(const kdt_gemm_args &a, uint16_t *ws) {
    const int64_t plane = (int64_t)a.m_max * a.ldw, chunks = (int64_t)a.m_max * (a.ldw / 8);
    wgg::wg_split_kernel<<<(unsigned)((chunks + 255) / 256), 256>>>(a, ws, plane, a.ldw);
    CK(cudaGetLastError());
    const dim3 grid((unsigned)((a.n + wgg::BN - 1) / wgg::BN), (unsigned)a.splits,
                    (unsigned)((a.m_max + wgg::BM - 1) / wgg::BM));
    wgg::wg_gemm_ss_kernel<<<grid, wgg::THREADS, (size_t)wgg::S_SMEM>>>(a, ws, plane, a.ldw);
    CK(cudaGetLastError());
}
static void launch_grouped_wg(const kdt_grouped_args &a) {
    const dim3 grid((unsigned)((a.n_max + wgg::BN - 1) / wgg::BN), (unsigned)(a.grid_items > 0 ? a.grid_items : 1));
    wgg::wg_grouped_kernel<<<grid, wgg::G_THREADS, (size_t)wgg::G_SMEM>>>(a);
    CK(cudaGetLastError());
}
static void launch_grouped(const kdt_grouped_args &a, bool v1) {
    const dim3 grid((unsigned)((a.n_max + BN - 1) / BN), (unsigned)(a.grid_items > 0 ? a.grid_items : 1));
    if (v1) V1_LAUNCH(grouped_kernel, grid, a);
    else {
        const V2Cfg c = v2_config(g_stages);
        v2_grouped_kernel<0, W_ROWS><<<grid, THREADS, c.pool>>>(a, c);
    }
    CK(cudaGetLastError());
}
static void launch_head(const kdt_head_args &a, bool v1) {
    const dim3 grid((unsigned)((a.w.rows + BN - 1) / BN));
    if (v1) V1_LAUNCH(head_kernel, grid, a);
    else {
        const V2Cfg c = v2_config(g_stages);
        v2_head_kernel<<<grid, THREADS, c.pool>>>(a, c);
    }
    CK(cudaGetLastError());
}

/* ---- dense --------------------------------------------------------------------------------------- */
struct DenseCase {
    int n, cols, batch, kx, ldx_extra, gather, M;
};

static void dense_case(const DenseCase &dc, uint64_t seed) {
    const int ld = (int)kdt_g_round_up(dc.cols, 64);
    const int batch = dc.batch;
    const int kx = dc.kx;
    const int64_t ldx = kx + dc.ldx_extra;
    int splits, k_chunk;
    kdt_gemm_plan(dc.n, ld, batch, &splits, &k_chunk);
    const int Mx = dc.M + 3; /* X rows available (gather picks among them) */
    uint16_t *w = dalloc<uint16_t>((size_t)batch * dc.n * ld);
    k_fill_w<<<1024, 256>>>(w, (int64_t)batch * dc.n, dc.cols, ld, seed);
    const int64_t x_batch = (int64_t)Mx * ldx;
    float *x = dalloc<float>((size_t)batch * x_batch + 8);
    k_fill_x<<<1024, 256>>>(x, (int64_t)batch * x_batch + 8, seed + 1);
    std::vector<int32_t> rows(dc.M);
    for (int m = 0; m < dc.M; m++) rows[m] = (m * 7 + 3) % Mx;
    int32_t *d_rows = dint(rows);
    std::vector<int32_t> mv = {dc.M};
    int32_t *d_m = dint(mv);
    const int64_t ldy = dc.n + 5, y_batch = (int64_t)dc.M * ldy, y_split = y_batch * batch;
    const size_t ybytes = (size_t)splits * y_split * 4;
    float *y1 = dalloc<float>(ybytes / 4), *y2 = dalloc<float>(ybytes / 4);
    poison(y1, ybytes);
    poison(y2, ybytes);
    kdt_gemm_args a;
    memset(&a, 0, sizeof a);
    a.x = x + 1 * (dc.ldx_extra & 1); /* odd ldx / offset base: unaligned rows take the element path */
    a.ldx = ldx;
    a.x_batch = x_batch;
    a.kx = kx;
    a.x_rows = dc.gather ? d_rows : nullptr;
    a.w = w;
    a.ldw = ld;
    a.w_batch = (int64_t)dc.n * ld;
    a.n = dc.n;
    a.ldy = ldy;
    a.y_split = y_split;
    a.y_batch = y_batch;
    a.m_dev = d_m;
    a.m_max = dc.M;
    a.batch = batch;
    a.splits = splits;
    a.k_chunk = k_chunk;
    a.y = y1;
    launch_gemm(a, true);
    a.y = y2;
    launch_gemm(a, false);
    CK(cudaDeviceSynchronize());
    char what[200];
    snprintf(what, sizeof what, "dense n=%d cols=%d batch=%d kx=%d ldx=%lld gather=%d M=%d splits=%d", dc.n, dc.cols,
             batch, kx, (long long)ldx, dc.gather, dc.M, splits);
    same(y1, y2, ybytes, what);
    {   /* the launcher's choice for row-major weights (the model's dense layout): pool, rows per
         * pass and instance by v2_config_grid; with KDT_GEMM_WIDE3 on (the default; read per
         * launch) 3 CTAs per SM and 48-row passes for a grid of 2-3 per SM and a bound of 33-48 or
         * 65-96 rows, with it off ("0") 2 per SM and 64-row passes */
        float *yl = dalloc<float>(ybytes / 4);
        char *was = env_save("KDT_GEMM_WIDE3");
        for (int w3 = 0; w3 < 2; w3++) {
            setenv("KDT_GEMM_WIDE3", w3 ? "1" : "0", 1);
            poison(yl, ybytes);
            a.y = yl;
            if (kdt_gemm_launch(&a, g_stages, 0) != KDT_OK) n_fail++;
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            char wl[260];
            snprintf(wl, sizeof wl, "launcher, row-major, KDT_GEMM_WIDE3=%d: %s", w3, what);
            same(y1, yl, ybytes, wl);
        }
        env_restore("KDT_GEMM_WIDE3", was);
        a.y = y2;
        cudaFree(yl);
    }
    /* the wgmma kernel on g (output into buf), then (unbatched) its A-from-shared-memory form after
     * the X split: v1's bits */
    auto check_wg_dense = [&](kdt_gemm_args g, float *buf, const char *label) {
        char ww[300];
        for (int ss = 0; ss < (batch == 1 ? 2 : 1); ss++) {
            uint16_t *ws = ss ? dalloc<uint16_t>((size_t)2 * dc.M * ld) : nullptr;
            poison(buf, ybytes);
            g.y = buf;
            if (ss) launch_gemm_wg_ss(g, ws);
            else launch_gemm_wg(g);
            CK(cudaDeviceSynchronize());
            snprintf(ww, sizeof ww, "%swgmma%s: %s", label, ss ? ", A from shared memory" : "", what);
            same(y1, buf, ybytes, ww);
            if (ws) cudaFree(ws);
        }
    };
    if (dc.n % 64 == 0) {
        /* tiled weights (kdt_gemm_tile64, KDT_GPU_TILED_DENSE): the launcher's choice, then the
         * cp.async and (sm_90+) bulk-copy instances directly: v1's bits */
        uint16_t *wt = dalloc<uint16_t>((size_t)batch * dc.n * ld), *tmp = dalloc<uint16_t>((size_t)128 * ld);
        CK(cudaMemcpy(wt, w, (size_t)batch * dc.n * ld * 2, cudaMemcpyDeviceToDevice));
        if (kdt_gemm_tile64(wt, (int64_t)batch * dc.n, ld, tmp, 128, 0) != KDT_OK) n_fail++;
        kdt_gemm_args t = a;
        t.w = wt;
        t.tiled = 1;
        int major = 0;
        CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
        const dim3 grid((unsigned)((t.n + BN - 1) / BN), (unsigned)t.splits, (unsigned)(t.batch > 0 ? t.batch : 1));
        const V2Cfg c = v2_config(g_stages);
        float *yt = dalloc<float>(ybytes / 4);
        for (int v = 0; v < (major >= 9 ? 3 : 2); v++) {
            static const char *names[3] = {"launcher", "cp.async", "bulk"};
            poison(yt, ybytes);
            t.y = yt;
            if (v == 0) {
                if (kdt_gemm_launch(&t, g_stages, 0) != KDT_OK) n_fail++;
            } else if (v == 1) {
                v2_gemm_kernel<W_TILED><<<grid, THREADS, c.pool>>>(t, c);
            } else {
                v2_gemm_kernel<W_BULK><<<grid, THREADS, c.pool>>>(t, c);
            }
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            char wtn[260];
            snprintf(wtn, sizeof wtn, "tiled weights (%s): %s", names[v], what);
            same(y1, yt, ybytes, wtn);
        }
        if (g_wg) check_wg_dense(t, yt, "tiled weights, "); /* tiled blocks copied verbatim (Kimi's shared expert) */
        cudaFree(yt);
        cudaFree(wt);
        cudaFree(tmp);
    }
    if (g_wg) { /* the wgmma kernel for many rows, at any row count: v1's bits */
        float *yw = dalloc<float>(ybytes / 4);
        check_wg_dense(a, yw, "");
        cudaFree(yw);
    }
    if (g_v3 && dc.M <= v3::ROWS) {
        float *y3 = dalloc<float>(ybytes / 4);
        for (int c = 0; c < N_V3_CONFIGS; c++) {
            set_v3(V3_CONFIGS[c]);
            poison(y3, ybytes);
            a.y = y3;
            if (!launch_gemm3(a)) {
                fprintf(stderr, "  FAIL v3 refused %s\n", what);
                n_fail++;
                continue;
            }
            CK(cudaDeviceSynchronize());
            char w3[260];
            snprintf(w3, sizeof w3, "v3 config %d: %s", c, what);
            same(y1, y3, ybytes, w3);
        }
        set_v3(V3_CONFIGS[0]);
        a.y = y2;
        cudaFree(y3);
    }
    /* v2 and v3: every row alone (M = 1, x at that row) == the row inside the batch */
    if (!dc.gather && dc.M > 1) {
        const int probe[3] = {0, dc.M / 2, dc.M - 1};
        for (int q = 0; q < 3; q++) {
            const int m = probe[q];
            std::vector<int32_t> one = {1};
            int32_t *d_one = dint(one);
            const int64_t yb1 = ldy, ys1 = yb1 * batch;
            float *yo = dalloc<float>((size_t)splits * ys1);
            poison(yo, (size_t)splits * ys1 * 4);
            kdt_gemm_args b = a;
            b.x = a.x + (int64_t)m * ldx;
            b.m_dev = d_one;
            b.m_max = 1;
            b.y = yo;
            b.y_batch = yb1;
            b.y_split = ys1;
            std::vector<float> h1((size_t)splits * ys1), hb((size_t)splits * y_split);
            CK(cudaMemcpy(hb.data(), y2, hb.size() * 4, cudaMemcpyDeviceToHost));
            for (int impl = 2; impl <= 3; impl++) {
                poison(yo, (size_t)splits * ys1 * 4);
                if (impl == 2) launch_gemm(b, false);
                else if (!launch_gemm3(b)) continue;
                CK(cudaDeviceSynchronize());
                CK(cudaMemcpy(h1.data(), yo, h1.size() * 4, cudaMemcpyDeviceToHost));
                bool ok = true;
                for (int s = 0; s < splits && ok; s++)
                    for (int bb = 0; bb < batch && ok; bb++)
                        ok = memcmp(&h1[(size_t)s * ys1 + (size_t)bb * yb1],
                                    &hb[(size_t)s * y_split + (size_t)bb * y_batch + (size_t)m * ldy], (size_t)dc.n * 4) == 0;
                if (ok) n_pass++;
                else {
                    n_fail++;
                    fprintf(stderr, "  FAIL v%d alone-vs-batch row %d of %s\n", impl, m, what);
                }
            }
            cudaFree(yo);
            cudaFree(d_one);
        }
    }
    cudaFree(w);
    cudaFree(x);
    cudaFree(d_rows);
    cudaFree(d_m);
    cudaFree(y1);
    cudaFree(y2);
}

/* ---- grouped ----------------------------------------------------------------------------------- */
/* The gate/up launch over an item list (X rows of xn [.][D] gathered by pair_row, N = ldp =
 * 2 i_pad, output y [pairs][ldp]), and the down launch of the same items (X = h [pairs][ldh],
 * N = D, output z [pairs][D]). */
static kdt_grouped_args gate_up_args(const float *xn, int D, const int32_t *pair_row, const kdt_gpu_expert *experts,
                                     const int32_t *items, const int32_t *counts, float *y, int ldp, int grid_items,
                                     int hint) {
    kdt_grouped_args a;
    memset(&a, 0, sizeof a);
    a.which = 0;
    a.x = xn;
    a.ldx = D;
    a.pair_row = pair_row;
    a.experts = experts;
    a.items = items;
    a.n_items = counts;
    a.y = y;
    a.ldy = ldp;
    a.n_max = ldp;
    a.kd = D;
    a.grid_items = grid_items;
    a.n_items_hint = hint;
    return a;
}
static kdt_grouped_args down_args(const kdt_grouped_args &gu, const float *h, int64_t ldh, float *z) {
    kdt_grouped_args b = gu;
    b.which = 1;
    b.x = h;
    b.ldx = ldh;
    b.y = z;
    b.ldy = gu.kd;
    b.n_max = gu.kd;
    return b;
}

static void grouped_case(int D, int I, int E, const std::vector<int> &rows_per_expert, int xrows, uint64_t seed,
                         int grid_items, bool h_aligned = false) {
    const int i_pad = (int)kdt_g_round_up(I, 32), ld_d = (int)kdt_g_round_up(D, 64), ld_i = (int)kdt_g_round_up(I, 64);
    std::vector<kdt_gpu_expert> ex(E);
    std::vector<uint16_t *> bufs;
    for (int e = 0; e < E; e++) {
        uint16_t *gu = dalloc<uint16_t>((size_t)2 * i_pad * ld_d), *dn = dalloc<uint16_t>((size_t)D * ld_i);
        k_fill_w<<<1024, 256>>>(gu, 2 * i_pad, D, ld_d, seed + 10 * e);
        k_fill_w<<<1024, 256>>>(dn, D, I, ld_i, seed + 10 * e + 5);
        ex[e].gu = gu;
        ex[e].down = dn;
        ex[e].inter = I;
        ex[e].i_pad = i_pad;
        ex[e].ld_d = ld_d;
        ex[e].ld_i = ld_i;
        bufs.push_back(gu);
        bufs.push_back(dn);
    }
    kdt_gpu_expert *d_ex = dalloc<kdt_gpu_expert>(E);
    CK(cudaMemcpy(d_ex, ex.data(), E * sizeof(kdt_gpu_expert), cudaMemcpyHostToDevice));
    std::vector<int32_t> items, pair_row;
    int pairs = 0;
    for (int e = 0; e < E; e++) {
        const int c = rows_per_expert[e];
        for (int i = 0; i * 64 < c; i++) {
            items.push_back(e);
            items.push_back(pairs + i * 64);
            items.push_back(std::min(64, c - i * 64));
        }
        for (int r = 0; r < c; r++) pair_row.push_back((r * 5 + e) % xrows);
        pairs += c;
    }
    const int n_items = (int)items.size() / 3;
    std::vector<int32_t> cnt = {n_items, pairs};
    int32_t *d_items = dint(items), *d_pr = dint(pair_row), *d_cnt = dint(cnt);
    /* h rows: odd ld -> element path for unaligned rows (or aligned rows, ld a multiple of 4) */
    const int ldh = (int)kdt_g_round_up(I, 4) + (h_aligned ? 0 : 3);
    float *xn = dalloc<float>((size_t)xrows * D), *h = dalloc<float>((size_t)std::max(pairs, 1) * ldh + 8);
    k_fill_x<<<1024, 256>>>(xn, (int64_t)xrows * D, seed + 100);
    k_fill_x<<<1024, 256>>>(h, (int64_t)std::max(pairs, 1) * ldh + 8, seed + 101);
    const int ldp = 2 * i_pad;
    const size_t b0 = (size_t)std::max(pairs, 1) * ldp * 4, b1 = (size_t)std::max(pairs, 1) * D * 4;
    float *y1 = dalloc<float>(b0 / 4), *y2 = dalloc<float>(b0 / 4), *z1 = dalloc<float>(b1 / 4), *z2 = dalloc<float>(b1 / 4);
    poison(y1, b0);
    poison(y2, b0);
    poison(z1, b1);
    poison(z2, b1);
    kdt_grouped_args a = gate_up_args(xn, D, d_pr, d_ex, d_items, d_cnt, y1, ldp, grid_items, 0);
    launch_grouped(a, true);
    a.y = y2;
    launch_grouped(a, false);
    kdt_grouped_args b = down_args(a, h_aligned ? h : h + 1, ldh, z1);
    launch_grouped(b, true);
    b.y = z2;
    launch_grouped(b, false);
    CK(cudaDeviceSynchronize());
    char what[200];
    snprintf(what, sizeof what, "grouped gate/up D=%d I=%d E=%d items=%d pairs=%d grid_items=%d", D, I, E, n_items, pairs,
             grid_items);
    same(y1, y2, b0, what);
    snprintf(what, sizeof what, "grouped down D=%d I=%d E=%d items=%d pairs=%d grid_items=%d", D, I, E, n_items, pairs,
             grid_items);
    same(z1, z2, b1, what);
    /* y2 / z2, from the form named, against v1's y1 / z1 (gate/up, down): bitwise */
    auto same_gu_down = [&](const char *form) {
        char w[300];
        snprintf(w, sizeof w, "%s: grouped gate/up D=%d I=%d E=%d items=%d", form, D, I, E, n_items);
        same(y1, y2, b0, w);
        snprintf(w, sizeof w, "%s: grouped down D=%d I=%d E=%d items=%d", form, D, I, E, n_items);
        same(z1, z2, b1, w);
    };
    {   /* the wave-shaping instance (5 CTAs per SM on an H200: 3-stage pool, 16-row passes): v1's bits */
        int per_sm = 0;
        CK(kdt_smem_per_sm(0, &per_sm));
        const V2Cfg c5 = smallest_grouped_pool(per_sm);
        const dim3 grid((unsigned)((a.n_max + BN - 1) / BN), (unsigned)(a.grid_items > 0 ? a.grid_items : 1));
        poison(y2, b0);
        poison(z2, b1);
        a.y = y2;
        v2_grouped_kernel<5, W_ROWS><<<grid, THREADS, c5.pool>>>(a, c5);
        b.y = z2;
        const dim3 gridb((unsigned)((b.n_max + BN - 1) / BN), grid.y);
        v2_grouped_kernel<5, W_ROWS><<<gridb, THREADS, c5.pool>>>(b, c5);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        same_gu_down("5 CTAs per SM instance");
    }
    /* its A-from-shared-memory form (KDT_GEMM_WG_SS=1): xn and h split into planes first (h's rows
     * zero past their expert's inter, by pair_expert), as kdt_grouped_launch_ws does; with h set on
     * ga, the fused SwiGLU's output goes to h_out instead of y */
    std::vector<int32_t> pair_expert;
    for (int e = 0; e < E; e++)
        for (int r = 0; r < rows_per_expert[e]; r++) pair_expert.push_back(e);
    if (pair_expert.empty()) pair_expert.push_back(0);
    int32_t *d_pe = dint(pair_expert);
    std::vector<int32_t> xr_count = {xrows};
    int32_t *d_xm = dint(xr_count);
    uint16_t *ws_x = dalloc<uint16_t>((size_t)2 * xrows * ld_d), *ws_h = dalloc<uint16_t>((size_t)2 * std::max(pairs, 1) * ld_i);
    auto launch_grouped_ss = [&](const kdt_grouped_args &g) {
        const int rows = g.which == 0 ? xrows : std::max(pairs, 1), ld = g.which == 0 ? ld_d : ld_i;
        uint16_t *ws = g.which == 0 ? ws_x : ws_h;
        const int64_t plane = (int64_t)rows * ld;
        const unsigned sg = (unsigned)(((int64_t)rows * (ld / 8) + 255) / 256);
        if (g.which == 0) {
            kdt_gemm_args x;
            memset(&x, 0, sizeof x);
            x.x = g.x;
            x.ldx = g.ldx;
            x.kx = g.kd;
            x.m_dev = d_xm;
            x.m_max = xrows;
            wgg::wg_split_kernel<<<sg, 256>>>(x, ws, plane, ld);
        } else {
            wgg::wg_split_pairs_kernel<<<sg, 256>>>(g, d_pe, rows, ws, plane, ld);
        }
        CK(cudaGetLastError());
        const dim3 grid((unsigned)((g.n_max + wgg::GS_BN - 1) / wgg::GS_BN), (unsigned)(g.grid_items > 0 ? g.grid_items : 1));
        wgg::wg_grouped_ss_kernel<<<grid, wgg::THREADS, (size_t)wgg::GS_SMEM>>>(g, ws, plane, ld);
        CK(cudaGetLastError());
    };
    /* the wgmma grouped kernel (ss: its A-from-shared-memory form) on gate/up `ga` and down `gb`
     * (their y: y2, z2): v1's bits */
    auto check_wg = [&](kdt_grouped_args ga, kdt_grouped_args gb, const char *experts, bool ss) {
        poison(y2, b0);
        poison(z2, b1);
        ga.y = y2;
        gb.y = z2;
        if (ss) {
            launch_grouped_ss(ga);
            launch_grouped_ss(gb);
        } else {
            launch_grouped_wg(ga);
            launch_grouped_wg(gb);
        }
        CK(cudaDeviceSynchronize());
        snprintf(what, sizeof what, "%s, %s experts", ss ? "wgmma ss" : "wgmma", experts);
        same_gu_down(what);
    };
    for (int ss = 0; g_wg && ss < 2; ss++) check_wg(a, b, "row-major", ss);
    if ((2 * i_pad) % 64 == 0 && D % 64 == 0) {
        /* the tiled expert layout (kdt_gemm_tile64, KDT_GPU_TILED_EXPERTS): tiled copies of the
         * weights through kdt_grouped_launch (v2 whatever KDT_GEMM_V1 / V3 say): v1's bits */
        std::vector<kdt_gpu_expert> ext = ex;
        std::vector<uint16_t *> tbufs;
        const int64_t tmp_rows = 128; /* several tiling rounds per matrix */
        uint16_t *tmp = dalloc<uint16_t>((size_t)tmp_rows * std::max(ld_d, ld_i));
        auto tiled_copy = [&](const uint16_t *src, int rows, int ld) {
            uint16_t *t = dalloc<uint16_t>((size_t)rows * ld);
            CK(cudaMemcpy(t, src, (size_t)rows * ld * 2, cudaMemcpyDeviceToDevice));
            if (kdt_gemm_tile64(t, rows, ld, tmp, tmp_rows, 0) != KDT_OK) {
                fprintf(stderr, "  FAIL kdt_gemm_tile64 rows %d ld %d\n", rows, ld);
                n_fail++;
            }
            tbufs.push_back(t);
            return (const uint16_t *)t;
        };
        for (int e = 0; e < E; e++) {
            ext[e].gu = tiled_copy(ex[e].gu, 2 * i_pad, ld_d);
            ext[e].down = tiled_copy(ex[e].down, D, ld_i);
        }
        kdt_gpu_expert *d_ext = dalloc<kdt_gpu_expert>(E);
        CK(cudaMemcpy(d_ext, ext.data(), E * sizeof(kdt_gpu_expert), cudaMemcpyHostToDevice));
        kdt_grouped_args at = a, bt = b;
        at.experts = bt.experts = d_ext;
        at.tiled = bt.tiled = 1;
        at.y = y2;
        bt.y = z2;
        /* the launcher's choice, then every tiled instance directly: cp.async or bulk loader
         * (sm_90+), default pool or the 5-per-SM one */
        int per_sm = 0, major = 0;
        CK(kdt_smem_per_sm(0, &per_sm));
        CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
        const V2Cfg cd = v2_config(g_stages), c5 = smallest_grouped_pool(per_sm);
        const dim3 ga((unsigned)((at.n_max + BN - 1) / BN), (unsigned)(at.grid_items > 0 ? at.grid_items : 1));
        const dim3 gb((unsigned)((bt.n_max + BN - 1) / BN), ga.y);
        for (int v = 0; v < 5; v++) {
            if (v >= 3 && major < 9) break;
            static const char *names[5] = {"launcher", "cp.async", "cp.async 5/SM", "bulk", "bulk 5/SM"};
            poison(y2, b0);
            poison(z2, b1);
            switch (v) {
            case 0:
                if (kdt_grouped_launch(&at, g_stages, 0) != KDT_OK || kdt_grouped_launch(&bt, g_stages, 0) != KDT_OK) n_fail++;
                break;
            case 1:
                v2_grouped_kernel<0, W_TILED><<<ga, THREADS, cd.pool>>>(at, cd);
                v2_grouped_kernel<0, W_TILED><<<gb, THREADS, cd.pool>>>(bt, cd);
                break;
            case 2:
                v2_grouped_kernel<5, W_TILED><<<ga, THREADS, c5.pool>>>(at, c5);
                v2_grouped_kernel<5, W_TILED><<<gb, THREADS, c5.pool>>>(bt, c5);
                break;
            case 3:
                v2_grouped_kernel<0, W_BULK><<<ga, THREADS, cd.pool>>>(at, cd);
                v2_grouped_kernel<0, W_BULK><<<gb, THREADS, cd.pool>>>(bt, cd);
                break;
            default:
                v2_grouped_kernel<5, W_BULK><<<ga, THREADS, c5.pool>>>(at, c5);
                v2_grouped_kernel<5, W_BULK><<<gb, THREADS, c5.pool>>>(bt, c5);
                break;
            }
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            snprintf(what, sizeof what, "tiled weights (%s)", names[v]);
            same_gu_down(what);
        }
        if (g_wg) { /* the wgmma grouped kernel on tiled experts, then its fused SwiGLU against v2's */
            for (int ss = 0; ss < 2; ss++) check_wg(at, bt, "tiled", ss);
            const size_t hb = (size_t)std::max(pairs, 1) * ldh * 4 + 32;
            float *h1 = dalloc<float>(hb / 4), *h2 = dalloc<float>(hb / 4);
            poison(h1, hb);
            kdt_grouped_args af = at;
            af.h = h1;
            af.ldh = ldh;
            v2_grouped_kernel<0, W_TILED><<<ga, THREADS, cd.pool>>>(af, cd);
            af.h = h2;
            for (int ss = 0; ss < 2; ss++) {
                poison(h2, hb);
                if (ss) launch_grouped_ss(af);
                else launch_grouped_wg(af);
                CK(cudaDeviceSynchronize());
                snprintf(what, sizeof what, "grouped gate/up + SwiGLU, tiled weights, wgmma%s vs v2, D=%d I=%d E=%d items=%d",
                         ss ? " ss" : "", D, I, E, n_items);
                same(h1, h2, hb, what);
            }
            cudaFree(h1);
            cudaFree(h2);
            /* the runner's launch (kdt_grouped_launch_ws): split, ss and v2 kernels, of which the
             * plan's rows per item let one run (KDT_GEMM_SS_ITEM_ROWS 1: ss; 100000: v2) */
            char *was_rows = env_save("KDT_GEMM_SS_ITEM_ROWS"), *was_pairs = env_save("KDT_GEMM_WG_PAIRS");
            setenv("KDT_GEMM_WG_PAIRS", "1", 1);
            for (int pick = 0; pick < 2; pick++) {
                setenv("KDT_GEMM_SS_ITEM_ROWS", pick ? "100000" : "1", 1);
                kdt_grouped_args ad = at, bd = bt;
                ad.max_item_rows = bd.max_item_rows = 64;
                ad.n_pairs_hint = bd.n_pairs_hint = std::max(pairs, 1);
                poison(y2, b0);
                poison(z2, b1);
                if (kdt_grouped_launch_ws(&ad, g_stages, 0, ws_x, (int64_t)2 * xrows * ld_d, d_xm, xrows, d_pe, ld_d) !=
                        KDT_OK ||
                    kdt_grouped_launch_ws(&bd, g_stages, 0, ws_h, (int64_t)2 * std::max(pairs, 1) * ld_i, d_xm, xrows,
                                          d_pe, ld_i) != KDT_OK)
                    n_fail++;
                CK(cudaGetLastError());
                CK(cudaDeviceSynchronize());
                snprintf(what, sizeof what, "tiled weights, the runner's two-kernel launch (%s runs)", pick ? "v2" : "ss");
                same_gu_down(what);
            }
            env_restore("KDT_GEMM_SS_ITEM_ROWS", was_rows);
            env_restore("KDT_GEMM_WG_PAIRS", was_pairs);
        }
        for (auto q : tbufs) cudaFree(q);
        cudaFree(tmp);
        cudaFree(d_ext);
    }
    if (g_v3) {
        int most = 0; /* the largest item: the launch's row bound */
        for (int i = 0; i < n_items; i++) most = std::max(most, items[3 * i + 2]);
        /* rows per pass from the real bound, and from 8 (items of more rows take several passes) */
        const int bounds[2] = {most, 8};
        for (int bi = 0; bi < 2; bi++)
            for (int c = 0; c < N_V3_CONFIGS; c++) {
                set_v3(V3_CONFIGS[c]);
                kdt_grouped_args a3 = a, b3 = b;
                a3.max_item_rows = b3.max_item_rows = bounds[bi];
                poison(y2, b0);
                poison(z2, b1);
                a3.y = y2;
                b3.y = z2;
                if (!launch_grouped3(a3) || !launch_grouped3(b3)) {
                    fprintf(stderr, "  FAIL v3 refused grouped D=%d I=%d\n", D, I);
                    n_fail++;
                    continue;
                }
                CK(cudaDeviceSynchronize());
                char w3[80];
                snprintf(w3, sizeof w3, "v3 config %d, row bound %d", c, bounds[bi]);
                same_gu_down(w3);
            }
        set_v3(V3_CONFIGS[0]);
    }
    for (auto p : bufs) cudaFree(p);
    cudaFree(d_pe);
    cudaFree(d_xm);
    cudaFree(ws_x);
    cudaFree(ws_h);
    cudaFree(d_ex);
    cudaFree(d_items);
    cudaFree(d_pr);
    cudaFree(d_cnt);
    cudaFree(xn);
    cudaFree(h);
    cudaFree(y1);
    cudaFree(y2);
    cudaFree(z1);
    cudaFree(z2);
}

/* ---- head -------------------------------------------------------------------------------------- */
/* lm_head arguments: weight [V][D] bf16 (row stride ld), x rows [.][D], M of m_max staged rows;
 * outputs (logits, am_val, am_idx) are the caller's. */
static kdt_head_args head_args(uint16_t *w, int V, int D, int ld, const float *x, const int32_t *d_m, int M,
                               const kdt_grow *rows, const int32_t *head, int am_ld) {
    kdt_head_args a;
    memset(&a, 0, sizeof a);
    a.x = x;
    a.kx = D;
    a.w.w = w;
    a.w.rows = V;
    a.w.cols = D;
    a.w.ld = ld;
    a.w.batch = 1;
    a.m_dev = d_m;
    a.m_max = M;
    a.rows = rows;
    a.head_rows = head;
    a.am_ld = am_ld;
    return a;
}

static void head_case(int V, int D, int M, uint64_t seed) {
    const int ld = (int)kdt_g_round_up(D, 64);
    uint16_t *w = dalloc<uint16_t>((size_t)V * ld);
    k_fill_w<<<1024, 256>>>(w, V, D, ld, seed);
    float *x = dalloc<float>((size_t)M * D);
    k_fill_x<<<1024, 256>>>(x, (int64_t)M * D, seed + 1);
    std::vector<kdt_grow> rows(M);
    memset(rows.data(), 0, rows.size() * sizeof(kdt_grow));
    std::vector<int32_t> head(M);
    for (int m = 0; m < M; m++) {
        head[m] = M - 1 - m;         /* head row m is staged row M-1-m, whose output row is m */
        rows[M - 1 - m].out_index = m;
    }
    kdt_grow *d_rows = dalloc<kdt_grow>(M);
    CK(cudaMemcpy(d_rows, rows.data(), M * sizeof(kdt_grow), cudaMemcpyHostToDevice));
    int32_t *d_head = dint(head);
    std::vector<int32_t> mv = {M};
    int32_t *d_m = dint(mv);
    const int tiles = (V + 63) / 64;
    float *l1 = dalloc<float>((size_t)M * V), *l2 = dalloc<float>((size_t)M * V);
    float *v1 = dalloc<float>((size_t)tiles * M), *v2 = dalloc<float>((size_t)tiles * M);
    int32_t *i1 = dalloc<int32_t>((size_t)tiles * M), *i2 = dalloc<int32_t>((size_t)tiles * M);
    poison(l1, (size_t)M * V * 4);
    poison(l2, (size_t)M * V * 4);
    poison(v1, (size_t)tiles * M * 4);
    poison(v2, (size_t)tiles * M * 4);
    poison(i1, (size_t)tiles * M * 4);
    poison(i2, (size_t)tiles * M * 4);
    kdt_head_args a = head_args(w, V, D, ld, x, d_m, M, d_rows, d_head, M);
    a.logits = l1;
    a.am_val = v1;
    a.am_idx = i1;
    launch_head(a, true);
    a.logits = l2;
    a.am_val = v2;
    a.am_idx = i2;
    launch_head(a, false);
    CK(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "head logits V=%d D=%d M=%d", V, D, M);
    same(l1, l2, (size_t)M * V * 4, what);
    snprintf(what, sizeof what, "head am_val V=%d D=%d M=%d", V, D, M);
    same(v1, v2, (size_t)tiles * M * 4, what);
    snprintf(what, sizeof what, "head am_idx V=%d D=%d M=%d", V, D, M);
    same(i1, i2, (size_t)tiles * M * 4, what);
    cudaFree(w); cudaFree(x); cudaFree(d_rows); cudaFree(d_head); cudaFree(d_m);
    cudaFree(l1); cudaFree(l2); cudaFree(v1); cudaFree(v2); cudaFree(i1); cudaFree(i2);
}

/* ---- timing ------------------------------------------------------------------------------------ */
static float *g_flush, *g_sink;
static const int64_t FLUSH_FLOATS = (int64_t)128 << 20; /* 512 MB */

template <typename F>
static double time_us(F launch, int reps) {
    std::vector<float> t;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int r = 0; r < reps + 1; r++) {
        k_sink<<<1024, 512>>>((const float4 *)g_flush, FLUSH_FLOATS / 4, g_sink);
        CK(cudaEventRecord(e0));
        launch();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r) t.push_back(ms * 1000.0f);
    }
    std::sort(t.begin(), t.end());
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return t[t.size() / 2];
}

static bool g_sweep = false;
static const V3Tune SWEEP[] = {{1, 1, 2, 1}, {1, 2, 2, 1}, {1, 4, 2, 1}, {1, 1, 2, 0}, {1, 1, 1, 1},
                               {1, 2, 1, 1}, {1, 1, 3, 1}, {1, 1, 0, 1}};

/* v3 under each sweep schedule: one line of us per schedule */
template <typename F>
static void sweep_line(const char *name, int M, double bytes, F launch) {
    printf("    sweep %-18s M=%-3d", name, M);
    for (const V3Tune &t : SWEEP) {
        set_v3(t);
        const double us = time_us(launch, 9);
        printf(" | kb%d c%d%s %7.1f %4.0f", t.kb, t.cps, t.bal ? "b" : " ", us, bytes / us / 1e3);
    }
    printf("\n");
    set_v3(V3_CONFIGS[0]);
}

/* A verify-sized grouped pass: E distinct experts with r rows each (random routing of N tree nodes
 * touches ~N * 8 experts with 1-3 rows): steady-state weight streaming. */
static void many_experts_timing(int D, int I) {
    const int E = 64;
    std::vector<kdt_gpu_expert> ex(E);
    uint16_t *gu_all = dalloc<uint16_t>((size_t)E * 2 * I * D), *dn_all = dalloc<uint16_t>((size_t)E * D * I);
    k_fill_w<<<1024, 256>>>(gu_all, (int64_t)E * 2 * I, D, D, 123);
    k_fill_w<<<1024, 256>>>(dn_all, (int64_t)E * D, I, I, 124);
    for (int e = 0; e < E; e++)
        ex[e] = kdt_gpu_expert{gu_all + (size_t)e * 2 * I * D, dn_all + (size_t)e * D * I, I, I, D, I};
    kdt_gpu_expert *d_ex = dalloc<kdt_gpu_expert>(E);
    CK(cudaMemcpy(d_ex, ex.data(), E * sizeof(kdt_gpu_expert), cudaMemcpyHostToDevice));
    const double gu_bytes = (double)E * 2 * I * D * 2, dn_bytes = (double)E * D * I * 2;
    for (int R : {1, 2}) {
        std::vector<int32_t> items, pair_row;
        for (int e = 0; e < E; e++) {
            items.push_back(e);
            items.push_back(e * R);
            items.push_back(R);
            for (int r = 0; r < R; r++) pair_row.push_back((e + r) % 9);
        }
        std::vector<int32_t> cnt = {E, E * R};
        int32_t *d_items = dint(items), *d_pr = dint(pair_row), *d_cnt = dint(cnt);
        float *xn = dalloc<float>((size_t)9 * D), *h = dalloc<float>((size_t)E * R * I);
        float *y = dalloc<float>((size_t)E * R * 2 * I), *z = dalloc<float>((size_t)E * R * D);
        k_fill_x<<<1024, 256>>>(xn, (int64_t)9 * D, 19);
        k_fill_x<<<1024, 256>>>(h, (int64_t)E * R * I, 20);
        kdt_grouped_args a = gate_up_args(xn, D, d_pr, d_ex, d_items, d_cnt, y, 2 * I, E + 1, E);
        a.max_item_rows = 9;
        const kdt_grouped_args b = down_args(a, h, I, z);
        const double t2 = time_us([&] { launch_grouped(a, false); }, 5), t3 = time_us([&] { launch_grouped3(a); }, 5);
        printf("  grouped gate/up %d experts x %d rows          v2 %8.1f us %5.0f GB/s  v3 %8.1f us %5.0f GB/s\n", E, R,
               t2, gu_bytes / t2 / 1e3, t3, gu_bytes / t3 / 1e3);
        const double t4 = time_us([&] { launch_grouped(b, false); }, 5), t5 = time_us([&] { launch_grouped3(b); }, 5);
        printf("  grouped down    %d experts x %d rows          v2 %8.1f us %5.0f GB/s  v3 %8.1f us %5.0f GB/s\n", E, R,
               t4, dn_bytes / t4 / 1e3, t5, dn_bytes / t5 / 1e3);
        if (g_sweep) {
            char nm[64];
            snprintf(nm, sizeof nm, "gate/up %d x %d", E, R);
            sweep_line(nm, R, gu_bytes, [&] { launch_grouped3(a); });
            snprintf(nm, sizeof nm, "down %d x %d", E, R);
            sweep_line(nm, R, dn_bytes, [&] { launch_grouped3(b); });
        }
        cudaFree(d_items); cudaFree(d_pr); cudaFree(d_cnt); cudaFree(xn); cudaFree(h); cudaFree(y); cudaFree(z);
    }
    cudaFree(gu_all);
    cudaFree(dn_all);
    cudaFree(d_ex);
}

/* Access-pattern probe (--wave): CTA b streams the 64 x ld bf16 region of W rows 64 b.. through a
 * cp.async ring of `stages` 8 KB stages (v2's depth for <= 8 rows), no tensor work. PAT 0 is the
 * GEMM's order (stage kb = 64 rows x 128 B at column 64 kb: 64 segments 2 ld bytes apart); PAT 1
 * reads the same region as contiguous 8 KB blocks (what a [N/64][ld/64][64][64] tiled weight
 * layout would give the GEMM). Same bytes, grid and ring: the difference is DRAM locality. */
template <int PAT>
__global__ void __launch_bounds__(128) k_stream(const uint16_t *w, int ld, int stages, float *sink) {
    extern __shared__ __align__(128) unsigned char sm[];
    const int tid = threadIdx.x, nkb = ld / 64;
    if (PAT == 2) { /* one 8 KB bulk copy (TMA engine) per stage, an mbarrier per stage */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        /* the barriers after the stages, inside the dynamic buffer: static shared memory would
         * push two padded CTAs past the SM's 228 KB */
        const uint16_t *base2 = w + (int64_t)blockIdx.x * 64 * ld;
        const uint32_t sm0 = smem_u32(sm), bar0 = sm0 + (uint32_t)stages * 8192;
        if (tid == 0) {
            for (int i = 0; i < stages; i++)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar0 + 8 * i));
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        auto issue = [&](int kb, int st) {
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 8192;\n" ::"r"(bar0 + 8 * st) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 8192, [%2];\n" ::"r"(
                             sm0 + st * 8192),
                         "l"(base2 + (int64_t)kb * 4096), "r"(bar0 + 8 * st)
                         : "memory");
        };
        if (tid == 0)
            for (int g = 0; g < stages - 1 && g < nkb; g++) issue(g, g);
        uint32_t acc = 0;
        for (int kb = 0; kb < nkb; kb++) {
            const int st = kb % stages;
            const uint32_t par = (uint32_t)(kb / stages) & 1u;
            uint32_t ok = 0;
            while (!ok)
                asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                             " selp.u32 %0, 1, 0, p;\n}\n"
                             : "=r"(ok)
                             : "r"(bar0 + 8 * st), "r"(par)
                             : "memory");
            __syncthreads(); /* stage (kb - 1) % stages is consumed by every thread */
            const int j = kb + stages - 1;
            if (tid == 0 && j < nkb) issue(j, j % stages);
            acc += reinterpret_cast<const uint32_t *>(sm + st * 8192)[tid];
        }
        if (acc == 0x12345678u) *sink = (float)acc;
#endif
        return;
    }
    const uint64_t pol = evict_first_policy();
    const uint16_t *base = w + (int64_t)blockIdx.x * 64 * ld;
    auto load = [&](int kb, int st) {
        uint16_t *dst = reinterpret_cast<uint16_t *>(sm + st * 8192);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int q = tid + 128 * i;
            const uint16_t *src = PAT == 0 ? base + (int64_t)(q >> 3) * ld + kb * 64 + (q & 7) * 8
                                           : base + (int64_t)kb * 4096 + q * 8;
            cp_async16_pol(dst + q * 8, src, 16, pol);
        }
    };
    for (int g = 0; g < stages - 1; g++) {
        if (g < nkb) load(g, g);
        cp_async_commit();
    }
    uint32_t acc = 0;
    for (int kb = 0; kb < nkb; kb++) {
        cp_async_wait_n(stages - 2);
        __syncthreads();
        const int j = kb + stages - 1;
        if (j < nkb) load(j, j % stages);
        cp_async_commit();
        acc += reinterpret_cast<const uint32_t *>(sm + (kb % stages) * 8192)[tid];
    }
    cp_async_wait<0>();
    if (acc == 0x12345678u) *sink = (float)acc;
}

static int prop_major() {
    int v = 0;
    CK(cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, 0));
    return v;
}

static void stream_probe() {
    const int D = 7168;
    printf("access-pattern probe: cp.async ring of 9 x 8 KB stages per CTA, 64 rows x 7168 bf16 per CTA, L2 flushed\n");
    for (int ctas : {576, 4096}) {
        const size_t n = (size_t)ctas * 64 * D;
        uint16_t *w = dalloc<uint16_t>(n);
        k_fill_w<<<1024, 256>>>(w, (int64_t)ctas * 64, D, D, 226);
        const double bytes = (double)n * 2;
        for (int k : {2, 4}) {
            const int stages = k == 2 ? 9 : 4;
            const int smem = stages * 8192;
            /* occupancy capped at k CTAs per SM by padding the shared memory request */
            int per_sm = 0;
            CK(kdt_smem_per_sm(0, &per_sm));
            const int pad = pool_per_sm(per_sm, k);
            const int req = pad > smem ? pad : smem;
            CK(cudaFuncSetAttribute(k_stream<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, req));
            CK(cudaFuncSetAttribute(k_stream<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, req));
            const double t0 = time_us([&] { k_stream<0><<<ctas, 128, req>>>(w, D, stages, g_sink); CK(cudaGetLastError()); }, 9);
            const double t1 = time_us([&] { k_stream<1><<<ctas, 128, req>>>(w, D, stages, g_sink); CK(cudaGetLastError()); }, 9);
            double t2 = 0;
            if (prop_major() >= 9) {
                CK(cudaFuncSetAttribute(k_stream<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, req));
                t2 = time_us([&] { k_stream<2><<<ctas, 128, req>>>(w, D, stages, g_sink); CK(cudaGetLastError()); }, 9);
            }
            printf("  %4d CTAs, %d per SM, %d stages: GEMM order %7.1f us %5.0f GB/s | contiguous 8 KB blocks %7.1f us %5.0f GB/s"
                   " | one bulk copy per block %7.1f us %5.0f GB/s\n",
                   ctas, k, stages, t0, bytes / t0 / 1e3, t1, bytes / t1 / 1e3, t2, t2 > 0 ? bytes / t2 / 1e3 : 0.0);
        }
        cudaFree(w);
    }
}

/* Wave experiment (--wave): a decode's grouped GEMMs, E experts x 1 row, v2 with the pool shrunk to
 * put k CTAs on an SM (scheduling only: the bits are v2's). Shows whether a decode's 576 gate/up
 * CTAs lose to the tail wave (per-CTA rate capped) or not. */
static void wave_timing() {
    const int D = 7168, I = 2048, EMAX = 64;
    int n_sm = 0, per_sm = 0, major = 0;
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    CK(kdt_smem_per_sm(0, &per_sm));
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
    uint16_t *gu_all = dalloc<uint16_t>((size_t)EMAX * 2 * I * D), *dn_all = dalloc<uint16_t>((size_t)EMAX * D * I);
    k_fill_w<<<1024, 256>>>(gu_all, (int64_t)EMAX * 2 * I, D, D, 223);
    k_fill_w<<<1024, 256>>>(dn_all, (int64_t)EMAX * D, I, I, 224);
    std::vector<kdt_gpu_expert> ex(EMAX);
    for (int e = 0; e < EMAX; e++)
        ex[e] = kdt_gpu_expert{gu_all + (size_t)e * 2 * I * D, dn_all + (size_t)e * D * I, I, I, D, I};
    kdt_gpu_expert *d_ex = dalloc<kdt_gpu_expert>(EMAX);
    CK(cudaMemcpy(d_ex, ex.data(), EMAX * sizeof(kdt_gpu_expert), cudaMemcpyHostToDevice));
    float *xn = dalloc<float>((size_t)D), *h = dalloc<float>((size_t)EMAX * I);
    float *y = dalloc<float>((size_t)EMAX * 2 * I), *z = dalloc<float>((size_t)EMAX * D);
    k_fill_x<<<1024, 256>>>(xn, (int64_t)D, 29);
    k_fill_x<<<1024, 256>>>(h, (int64_t)EMAX * I, 30);
    /* one launch of instance (k > 4 ? 5 : 0 registers bound, loader wl) with the pool of k per SM */
    auto launch = [&](const kdt_grouped_args &a, const dim3 &grid, int k, int wl, const V2Cfg &c) {
        if (k > 4) {
            if (wl == W_ROWS) v2_grouped_kernel<5, W_ROWS><<<grid, THREADS, c.pool>>>(a, c);
            else if (wl == W_TILED) v2_grouped_kernel<5, W_TILED><<<grid, THREADS, c.pool>>>(a, c);
            else v2_grouped_kernel<5, W_BULK><<<grid, THREADS, c.pool>>>(a, c);
        } else {
            if (wl == W_ROWS) v2_grouped_kernel<0, W_ROWS><<<grid, THREADS, c.pool>>>(a, c);
            else if (wl == W_TILED) v2_grouped_kernel<0, W_TILED><<<grid, THREADS, c.pool>>>(a, c);
            else v2_grouped_kernel<0, W_BULK><<<grid, THREADS, c.pool>>>(a, c);
        }
        CK(cudaGetLastError());
    };
    /* E experts x 1 row, gate/up (which 0) or down (1), loader wl, CTAs per SM ks */
    auto line = [&](int which, int E, int wl, std::initializer_list<int> ks) {
        std::vector<int32_t> items, pr, cnt = {E, E};
        for (int e = 0; e < E; e++) {
            items.push_back(e); items.push_back(e); items.push_back(1);
            pr.push_back(0);
        }
        int32_t *d_items = dint(items), *d_pr = dint(pr), *d_cnt = dint(cnt);
        const kdt_grouped_args gu = gate_up_args(xn, D, d_pr, d_ex, d_items, d_cnt, y, 2 * I, E + 1, E);
        kdt_grouped_args a = which ? down_args(gu, h, I, z) : gu;
        a.max_item_rows = 1;
        a.tiled = wl != W_ROWS;
        const double bytes = (double)E * 2 * I * D * (which ? 1 : 2);
        const dim3 grid((unsigned)((a.n_max + BN - 1) / BN), (unsigned)a.grid_items);
        static const char *wn[3] = {"rows ", "tiled", "bulk "};
        printf("  %-7s %s E=%-2d (%4d CTAs)", which ? "down" : "gate/up", wn[wl], E, E * (int)grid.x);
        for (int k : ks) {
            const int pool = pool_per_sm(per_sm, k);
            const V2Cfg c = v2_config_pool(pool);
            if (c.cap == 0 || v2_stages(8, pool) < 2 || v2_stages_bulk(8, pool) < 2) { /* a 99 KB part's small pools */
                printf(" | k%d: a %d B pool runs no pass", k, pool);
                continue;
            }
            int occ = 0;
            if (k > 4 && wl == W_ROWS) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_grouped_kernel<5, W_ROWS>, THREADS, c.pool));
            else if (k > 4 && wl == W_TILED) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_grouped_kernel<5, W_TILED>, THREADS, c.pool));
            else if (k > 4) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_grouped_kernel<5, W_BULK>, THREADS, c.pool));
            else if (wl == W_ROWS) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_grouped_kernel<0, W_ROWS>, THREADS, c.pool));
            else if (wl == W_TILED) CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_grouped_kernel<0, W_TILED>, THREADS, c.pool));
            else CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_grouped_kernel<0, W_BULK>, THREADS, c.pool));
            const double us = time_us([&] { launch(a, grid, k, wl, c); }, 9);
            printf(" | k%d(occ %d) s%d %7.1f %5.0f", k, occ, wl == W_BULK ? v2_stages_bulk(8, pool) : v2_stages(8, pool), us,
                   bytes / us / 1e3);
        }
        printf("\n");
        cudaFree(d_items); cudaFree(d_pr); cudaFree(d_cnt);
    };
    printf("\nwave experiment: grouped v2, E experts x 1 row, k CTAs per SM (pool), median us / GB/s\n");
    for (int which = 0; which < 2; which++)
        for (int E : {1, 2, 4, 5, 8, 9, 64}) line(which, E, W_ROWS, {2, 3, 4, 5});
    /* the same weights in kdt_gemm_tile64's layout: cp.async and bulk-copy loaders */
    uint16_t *tmp = dalloc<uint16_t>((size_t)4096 * D);
    if (kdt_gemm_tile64(gu_all, (int64_t)EMAX * 2 * I, D, tmp, 4096, 0) != KDT_OK ||
        kdt_gemm_tile64(dn_all, (int64_t)EMAX * D, I, tmp, 4096, 0) != KDT_OK)
        printf("  kdt_gemm_tile64 failed\n");
    CK(cudaDeviceSynchronize());
    cudaFree(tmp);
    for (int which = 0; which < 2; which++)
        for (int E : {1, 9, 64})
            for (int wl = W_TILED; wl <= (major >= 9 ? W_BULK : W_TILED); wl++) line(which, E, wl, {2, 5});
    cudaFree(gu_all); cudaFree(dn_all); cudaFree(d_ex); cudaFree(xn); cudaFree(h); cudaFree(y); cudaFree(z);
    /* The same 528 MB as a decode's gate/up (9 x 4096 rows x 7168) as one dense GEMM, 1 row, with
     * 1..4 K splits (576..2,304 CTAs of 64 columns): does cutting the weight stream into more,
     * shorter CTAs beat the tail wave? (What a split grouped chain would buy.) */
    printf("wave experiment: dense v2, N 36864 x K 7168 (528 MB), 1 row, K splits x k CTAs per SM\n");
    const int N = 9 * 2 * I;
    uint16_t *w = dalloc<uint16_t>((size_t)N * D);
    k_fill_w<<<1024, 256>>>(w, N, D, D, 225);
    float *x1 = dalloc<float>((size_t)D), *yp = dalloc<float>((size_t)4 * N);
    k_fill_x<<<1024, 256>>>(x1, (int64_t)D, 31);
    std::vector<int32_t> mv = {1};
    int32_t *d_m = dint(mv);
    for (int splits : {1, 2, 3, 4}) {
        const int kblocks = D / BK, chunk = (kblocks + splits - 1) / splits;
        kdt_gemm_args g;
        memset(&g, 0, sizeof g);
        g.x = x1; g.ldx = D; g.kx = D;
        g.w = w; g.ldw = D; g.n = N;
        g.y = yp; g.ldy = N; g.y_split = N;
        g.m_dev = d_m; g.m_max = 1; g.batch = 1;
        g.splits = (kblocks + chunk - 1) / chunk;
        g.k_chunk = chunk * BK;
        const dim3 grid((unsigned)(N / BN), (unsigned)g.splits, 1);
        printf("  splits %d (%4d CTAs)", g.splits, (int)(grid.x * grid.y));
        for (int k = 2; k <= 4; k++) {
            const int pool = pool_per_sm(per_sm, k);
            const V2Cfg c = v2_config_pool(pool);
            if (c.cap == 0 || v2_stages(8, pool) < 2 || v2_stages_bulk(8, pool) < 2) { /* a 99 KB part's small pools */
                printf(" | k%d: a %d B pool runs no pass", k, pool);
                continue;
            }
            int occ = 0;
            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v2_gemm_kernel<W_ROWS>, THREADS, c.pool));
            const double us = time_us([&] { v2_gemm_kernel<W_ROWS><<<grid, THREADS, c.pool>>>(g, c); CK(cudaGetLastError()); }, 9);
            printf(" | k%d(occ %d) s%d %7.1f %5.0f", k, occ, v2_stages(8, pool), us, (double)N * D * 2 / us / 1e3);
        }
        printf("\n");
    }
    cudaFree(w); cudaFree(x1); cudaFree(yp); cudaFree(d_m);
}

static void timing() {
    g_flush = dalloc<float>(FLUSH_FLOATS);
    g_sink = dalloc<float>(1);
    CK(cudaMemset(g_flush, 0, FLUSH_FLOATS * 4));
    const int D = 7168, I = 2048, E = 9;
    const int Ms[] = {1, 8, 9, 16, 17, 32, 33, 64, 65};
    printf("\ntiming (median us, L2 flushed; GB/s = weight bytes / time)\n");
    /* dense shapes of one Kimi K2.6 layer */
    struct Shape { const char *name; int n, cols, batch; } shapes[] = {
        {"w_a (q_a+kv_a)", 1536 + 512 + 64, 7168, 1}, {"q_b", 64 * 192, 1536, 1}, {"o_proj", 7168, 8192, 1},
        {"uk_t (batch 64)", 512, 128, 64}, {"uv (batch 64)", 128, 512, 64}, {"router", 384, 7168, 1}};
    const int Mmax = 65;
    float *x = dalloc<float>((size_t)Mmax * 8192 * 64);
    k_fill_x<<<1024, 256>>>(x, (int64_t)Mmax * 8192 * 64, 7);
    for (auto &sh : shapes) {
        const int ld = (int)kdt_g_round_up(sh.cols, 64);
        uint16_t *w = dalloc<uint16_t>((size_t)sh.batch * sh.n * ld);
        k_fill_w<<<1024, 256>>>(w, (int64_t)sh.batch * sh.n, sh.cols, ld, 3);
        int splits, k_chunk;
        kdt_gemm_plan(sh.n, ld, sh.batch, &splits, &k_chunk);
        float *y = dalloc<float>((size_t)splits * Mmax * sh.n * sh.batch);
        const double bytes = (double)sh.batch * sh.n * ld * 2;
        for (int M : Ms) {
            std::vector<int32_t> mv = {M};
            int32_t *d_m = dint(mv);
            kdt_gemm_args a;
            memset(&a, 0, sizeof a);
            a.x = x;
            a.ldx = sh.batch > 1 ? (int64_t)sh.batch * sh.cols : sh.cols;
            a.x_batch = sh.batch > 1 ? sh.cols : 0;
            a.kx = sh.cols;
            a.w = w;
            a.ldw = ld;
            a.w_batch = (int64_t)sh.n * ld;
            a.n = sh.n;
            a.y = y;
            a.ldy = sh.batch > 1 ? (int64_t)sh.batch * sh.n : sh.n;
            a.y_batch = sh.batch > 1 ? sh.n : 0;
            a.y_split = (int64_t)M * sh.n * sh.batch;
            a.m_dev = d_m;
            a.m_max = M;
            a.batch = sh.batch;
            a.splits = splits;
            a.k_chunk = k_chunk;
            const double t1 = time_us([&] { launch_gemm(a, true); }, 9);
            const double t2 = time_us([&] { launch_gemm(a, false); }, 9);
            const double t3 = g_v3 && M <= v3::ROWS ? time_us([&] { launch_gemm3(a); }, 9) : 0.0;
            printf("  %-16s grid (%d,%d,%d) M=%-3d  v1 %8.1f us %5.0f GB/s  v2 %8.1f us %5.0f GB/s  v3 %8.1f us %5.0f GB/s\n",
                   sh.name, (sh.n + 63) / 64, splits, sh.batch, M, t1, bytes / t1 / 1e3, t2, bytes / t2 / 1e3, t3,
                   t3 > 0 ? bytes / t3 / 1e3 : 0.0);
            if (g_sweep && M <= v3::ROWS && (M == 1 || M == 16 || M == 64)) sweep_line(sh.name, M, bytes, [&] { launch_gemm3(a); });
            cudaFree(d_m);
        }
        cudaFree(w);
        cudaFree(y);
    }
    cudaFree(x);
    /* grouped: 9 experts (8 routed + shared), rows per expert r (decode: 1; verify corr: ~N) */
    const int i_pad = I, ld_d = D, ld_i = I;
    std::vector<kdt_gpu_expert> ex(E);
    std::vector<uint16_t *> bufs;
    for (int e = 0; e < E; e++) {
        uint16_t *gu = dalloc<uint16_t>((size_t)2 * i_pad * ld_d), *dn = dalloc<uint16_t>((size_t)D * ld_i);
        k_fill_w<<<1024, 256>>>(gu, 2 * i_pad, D, ld_d, 50 + e);
        k_fill_w<<<1024, 256>>>(dn, D, I, ld_i, 80 + e);
        ex[e] = kdt_gpu_expert{gu, dn, I, i_pad, ld_d, ld_i};
        bufs.push_back(gu);
        bufs.push_back(dn);
    }
    kdt_gpu_expert *d_ex = dalloc<kdt_gpu_expert>(E);
    CK(cudaMemcpy(d_ex, ex.data(), E * sizeof(kdt_gpu_expert), cudaMemcpyHostToDevice));
    const double gu_bytes = (double)E * 2 * i_pad * ld_d * 2, dn_bytes = (double)E * D * ld_i * 2;
    const int Rs[] = {1, 2, 8, 16, 32, 58, 65};
    for (int R : Rs) {
        std::vector<int32_t> items, pair_row;
        int pairs = 0;
        for (int e = 0; e < E; e++) {
            for (int i = 0; i * 64 < R; i++) {
                items.push_back(e);
                items.push_back(pairs + i * 64);
                items.push_back(std::min(64, R - i * 64));
            }
            for (int r = 0; r < R; r++) pair_row.push_back(r);
            pairs += R;
        }
        const int n_items = (int)items.size() / 3;
        std::vector<int32_t> cnt = {n_items, pairs};
        int32_t *d_items = dint(items), *d_pr = dint(pair_row), *d_cnt = dint(cnt);
        float *xn = dalloc<float>((size_t)R * D), *h = dalloc<float>((size_t)pairs * I);
        float *y = dalloc<float>((size_t)pairs * 2 * i_pad), *z = dalloc<float>((size_t)pairs * D);
        k_fill_x<<<1024, 256>>>(xn, (int64_t)R * D, 9);
        k_fill_x<<<1024, 256>>>(h, (int64_t)pairs * I, 10);
        kdt_grouped_args a = gate_up_args(xn, D, d_pr, d_ex, d_items, d_cnt, y, 2 * i_pad, n_items + 1, n_items);
        kdt_grouped_args b = down_args(a, h, I, z);
        a.max_item_rows = b.max_item_rows = std::min(R, 64);
        const double t1 = time_us([&] { launch_grouped(a, true); }, 9), t2 = time_us([&] { launch_grouped(a, false); }, 9);
        const double t5 = g_v3 ? time_us([&] { launch_grouped3(a); }, 9) : 0.0;
        printf("  grouped gate/up  9 experts x %2d rows (%2d items)  v1 %8.1f us %5.0f GB/s  v2 %8.1f us %5.0f GB/s  v3 %8.1f us %5.0f GB/s\n",
               R, n_items, t1, gu_bytes / t1 / 1e3, t2, gu_bytes / t2 / 1e3, t5, t5 > 0 ? gu_bytes / t5 / 1e3 : 0.0);
        const double t3 = time_us([&] { launch_grouped(b, true); }, 9), t4 = time_us([&] { launch_grouped(b, false); }, 9);
        const double t6 = g_v3 ? time_us([&] { launch_grouped3(b); }, 9) : 0.0;
        printf("  grouped down     9 experts x %2d rows (%2d items)  v1 %8.1f us %5.0f GB/s  v2 %8.1f us %5.0f GB/s  v3 %8.1f us %5.0f GB/s\n",
               R, n_items, t3, dn_bytes / t3 / 1e3, t4, dn_bytes / t4 / 1e3, t6, t6 > 0 ? dn_bytes / t6 / 1e3 : 0.0);
        if (g_sweep && (R == 1 || R == 16)) {
            char nm[64];
            snprintf(nm, sizeof nm, "gate/up 9 x %d", R);
            sweep_line(nm, R, gu_bytes, [&] { launch_grouped3(a); });
            snprintf(nm, sizeof nm, "down 9 x %d", R);
            sweep_line(nm, R, dn_bytes, [&] { launch_grouped3(b); });
        }
        cudaFree(d_items); cudaFree(d_pr); cudaFree(d_cnt); cudaFree(xn); cudaFree(h); cudaFree(y); cudaFree(z);
    }
    for (auto p : bufs) cudaFree(p);
    cudaFree(d_ex);
    if (g_v3) many_experts_timing(D, I);
    /* lm_head 163840 x 7168 */
    {
        const int V = 163840;
        uint16_t *w = dalloc<uint16_t>((size_t)V * D);
        k_fill_w<<<1024, 256>>>(w, V, D, D, 99);
        const int Mh = 65, tiles = V / 64;
        float *xh = dalloc<float>((size_t)Mh * D), *av = dalloc<float>((size_t)tiles * Mh);
        int32_t *ai = dalloc<int32_t>((size_t)tiles * Mh);
        k_fill_x<<<1024, 256>>>(xh, (int64_t)Mh * D, 11);
        std::vector<kdt_grow> rows(Mh);
        memset(rows.data(), 0, rows.size() * sizeof(kdt_grow));
        std::vector<int32_t> head(Mh);
        for (int m = 0; m < Mh; m++) head[m] = m;
        kdt_grow *d_rows = dalloc<kdt_grow>(Mh);
        CK(cudaMemcpy(d_rows, rows.data(), Mh * sizeof(kdt_grow), cudaMemcpyHostToDevice));
        int32_t *d_head = dint(head);
        for (int M : {1, 9, 65}) {
            std::vector<int32_t> mv = {M};
            int32_t *d_m = dint(mv);
            kdt_head_args a = head_args(w, V, D, D, xh, d_m, M, d_rows, d_head, Mh);
            a.am_val = av;
            a.am_idx = ai;
            const double bytes = (double)V * D * 2;
            const double t1 = time_us([&] { launch_head(a, true); }, 5), t2 = time_us([&] { launch_head(a, false); }, 5);
            printf("  lm_head argmax   M=%-3d  v1 %8.1f us %7.0f GB/s   v2 %8.1f us %7.0f GB/s   x%.2f\n", M, t1,
                   bytes / t1 / 1e3, t2, bytes / t2 / 1e3, t1 / t2);
            cudaFree(d_m);
        }
        cudaFree(w); cudaFree(xh); cudaFree(av); cudaFree(ai); cudaFree(d_rows); cudaFree(d_head);
    }
    cudaFree(g_flush);
    cudaFree(g_sink);
}

/* --prefill: Kimi K2.6's dense projections at prefill chunk sizes, v2 (the launcher without
 * KDT_GEMM_WG=0, as main sets it) against the wgmma kernel; TFLOP/s counts 2 M N K (one product per weight, though
 * both kernels issue two: hi and lo). */
static void prefill_timing() {
    g_flush = dalloc<float>(FLUSH_FLOATS);
    g_sink = dalloc<float>(1);
    CK(cudaMemset(g_flush, 0, FLUSH_FLOATS * 4));
    struct Shape { const char *name; int n, k; };
    static const Shape shapes[] = {{"q_a_kv_a", 2112, 7168}, {"q_b", 12288, 1536}, {"o_proj", 7168, 8192},
                                   {"shared gate/up", 4096, 7168}, {"shared down", 7168, 2048}};
    printf("\nprefill dense GEMMs (median us of 5, L2 flushed; TFLOP/s = 2 M N K / time)\n");
    for (int M : {65, 128, 512, 2048}) { /* 65: a one-stream verify of 65 nodes (KDT_GEMM_WG_MIN's A/B) */
        for (const Shape &sh : shapes) {
            int splits, k_chunk;
            kdt_gemm_plan(sh.n, sh.k, 1, &splits, &k_chunk);
            uint16_t *w = dalloc<uint16_t>((size_t)sh.n * sh.k);
            k_fill_w<<<1024, 256>>>(w, sh.n, sh.k, sh.k, 7);
            float *x = dalloc<float>((size_t)M * sh.k);
            k_fill_x<<<1024, 256>>>(x, (int64_t)M * sh.k, 8);
            float *y = dalloc<float>((size_t)splits * M * sh.n), *yw = dalloc<float>((size_t)splits * M * sh.n);
            std::vector<int32_t> mv = {M};
            int32_t *d_m = dint(mv);
            kdt_gemm_args a;
            memset(&a, 0, sizeof a);
            a.x = x; a.ldx = sh.k; a.kx = sh.k; a.w = w; a.ldw = sh.k; a.n = sh.n;
            a.y = y; a.ldy = sh.n; a.y_split = (int64_t)M * sh.n;
            a.m_dev = d_m; a.m_max = M; a.batch = 1; a.splits = splits; a.k_chunk = k_chunk;
            const double t2 = time_us([&] { if (kdt_gemm_launch(&a, g_stages, 0) != KDT_OK) n_fail++; }, 5);
            double tw = 0, ts = 0;
            if (g_wg) {
                kdt_gemm_args b = a;
                b.y = yw;
                tw = time_us([&] { launch_gemm_wg(b); }, 5);
                CK(cudaDeviceSynchronize());
                char what[120];
                snprintf(what, sizeof what, "prefill timing shape %s M=%d: wgmma vs v2", sh.name, M);
                same(y, yw, (size_t)splits * M * sh.n * 4, what);
                uint16_t *ws = dalloc<uint16_t>((size_t)2 * M * sh.k);
                poison(yw, (size_t)splits * M * sh.n * 4);
                ts = time_us([&] { launch_gemm_wg_ss(b, ws); }, 5); /* the split pass included */
                CK(cudaDeviceSynchronize());
                snprintf(what, sizeof what, "prefill timing shape %s M=%d: wgmma ss vs v2", sh.name, M);
                same(y, yw, (size_t)splits * M * sh.n * 4, what);
                cudaFree(ws);
            }
            const double fl = 2.0 * M * sh.n * sh.k;
            printf("  %-15s M=%-5d N=%-6d K=%-5d splits %-2d  v2 %8.1f us %6.1f TF/s", sh.name, M, sh.n, sh.k, splits, t2,
                   fl / t2 / 1e6);
            if (g_wg)
                printf("   wgmma %8.1f us %6.1f TF/s x%.2f   ss (split + GEMM) %8.1f us %6.1f TF/s x%.2f", tw,
                       fl / tw / 1e6, t2 / tw, ts, fl / ts / 1e6, t2 / ts);
            printf("\n");
            cudaFree(w); cudaFree(x); cudaFree(y); cudaFree(yw); cudaFree(d_m);
        }
    }
    cudaFree(g_flush);
    cudaFree(g_sink);
}

int main(int argc, char **argv) {
    /* the launcher's own choice stays v2 (or v3) for every row count, so those kernels keep their
     * checks at 128+ rows; this test launches the wgmma kernels itself (launch_gemm_wg, launch_grouped_wg) */
    setenv("KDT_GEMM_WG", "0", 1);
    const bool do_timing = argc > 1 && strcmp(argv[1], "--timing") == 0;
    g_sweep = do_timing && argc > 2 && strcmp(argv[2], "--sweep") == 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_stages = pick_stages();
    int per_sm = 0;
    CK(kdt_smem_per_sm(0, &per_sm));
    printf("device: %s, %d SMs; v2 pool %d B (%d stages), rows per pass %d; smallest grouped pool %d B\n", prop.name,
           prop.multiProcessorCount, v2_config(g_stages).pool, g_stages, v2_config(g_stages).cap,
           smallest_grouped_pool(per_sm).pool);
    if (kdt_gemm_init(g_stages) != KDT_OK) return 2;
    {
        int optin = 0;
        CK(kdt_smem_optin(0, &optin));
        wg_setup(0, optin); /* whatever KDT_GEMM_WG says: this test runs the kernel directly */
        g_wg = g_wg_ready[0] == 1;
    }
    printf("wgmma GEMM (gemm_wg.cuh): %s\n", g_wg ? "runs" : "unavailable here: skipped");
    g_v3 = v3_dev() != nullptr;
    v3_tune() = V3_CONFIGS[0];
    printf("v3 (persistent weight streaming): %s\n", g_v3 ? "runs" : "unavailable: skipped");
    uint64_t seed = 1;
    /* KDT_TEST_QUICK=1 (compute-sanitizer runs): the pass boundaries only, one grouped and head case */
    const char *q = getenv("KDT_TEST_QUICK");
    const bool quick = q && q[0] == '1';
    /* dense: many M (pass boundaries 8 / 16 / 64), ragged kx, unaligned ldx, gather, batch, splits */
    const int Ms_all[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 100, 129, 200};
    const int Ms_quick[] = {1, 8, 9, 17, 65};
    std::vector<int> Ms(quick ? Ms_quick : Ms_all, quick ? Ms_quick + 5 : Ms_all + 22);
    for (int M : Ms) {
        dense_case({200, 7168, 1, 7168, 0, 0, M}, seed++);         /* split-K, n not a multiple of 64 */
        dense_case({130, 300, 1, 300, 1, 1, M}, seed++);           /* ragged K, unaligned rows, gather */
        dense_case({96, 128, 3, 128, 0, 0, M}, seed++);            /* batch */
        dense_case({64, 640, 1, 600, 4, 0, M}, seed++);            /* kx < cols-ish, aligned */
        if (M <= 64) {
            dense_case({384, 7168, 1, 7168, 0, 1, M}, seed++);     /* router-like: 28 splits of 4 blocks */
            dense_case({192, 8192, 1, 8192, 0, 0, M}, seed++);     /* o_proj-like: 3 splits of 43 blocks */
        }
    }
    /* o_proj's shape at Kimi's dimensions: 112 x 3 = 336 CTAs, which a Hopper (132 SMs) runs at 3
     * per SM with passes of up to 48 rows for bounds of 33-48 and 65-96 rows (v2_config_grid);
     * quick (sanitizer runs): 65 only */
    for (int M : {33, 64, 65})
        if (!quick || M == 65) dense_case({7168, 8192, 1, 8192, 0, 0, M}, seed++);
    /* prefill-sized launches (the wgmma kernel's: 128-row tiles, a partial last tile) */
    for (int M : {128, 130, 256, 300, 520}) {
        if (quick && M != 130) continue;
        dense_case({200, 7168, 1, 7168, 0, 0, M}, seed++);
        dense_case({130, 300, 1, 300, 1, 1, M}, seed++);
        dense_case({96, 128, 3, 128, 0, 0, M}, seed++);
        dense_case({64, 640, 1, 600, 4, 0, M}, seed++);
    }
    if (!quick) dense_case({7168, 8192, 1, 8192, 0, 0, 256}, seed++); /* o_proj, 3 splits */
    /* grouped: items of 1..64 rows, experts with 0 rows, > 64 rows (several items), ragged I */
    grouped_case(448, 200, 5, {1, 0, 3, 64, 65}, 70, seed++, 16);
    if (!quick) {
        grouped_case(448, 200, 5, {9, 17, 33, 130, 8}, 140, seed++, 3);
        grouped_case(7168 / 8, 2048 / 8, 9, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 1, seed++, 10);
        grouped_case(7168 / 8, 2048 / 8, 9, {58, 60, 65, 61, 57, 59, 62, 64, 65}, 65, seed++, 64);
        /* aligned, exact K (X by cp.async only), items of 1..3 rows as in a verify, some experts idle */
        grouped_case(1024, 512, 12, {1, 2, 0, 3, 1, 1, 0, 2, 1, 3, 1, 1}, 9, seed++, 10, true);
        grouped_case(7168 / 4, 2048 / 4, 9, {1, 1, 1, 1, 1, 1, 1, 1, 1}, 1, seed++, 10, true);
    }
    /* head: ties are rare with random data; argmax / logits / tile order */
    for (int M : {1, 5, 8, 9, 16, 33, 64, 65, 70})
        if (!quick || M == 9 || M == 65) head_case(1000, 448, M, seed++);
    if (!quick) head_case(4160, 7168, 3, seed++);
    printf("bitwise v1 == v2%s: %d passed, %d failed\n", g_v3 ? " == v3" : "", n_pass, n_fail);
    if (do_timing) timing();
    if (argc > 1 && strcmp(argv[1], "--prefill") == 0) prefill_timing();
    if (argc > 1 && strcmp(argv[1], "--wave") == 0) {
        g_flush = dalloc<float>(FLUSH_FLOATS);
        g_sink = dalloc<float>(1);
        CK(cudaMemset(g_flush, 0, FLUSH_FLOATS * 4));
        wave_timing();
        stream_probe();
    }
    return n_fail ? 1 : 0;
}
