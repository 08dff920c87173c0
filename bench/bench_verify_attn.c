/* bench_verify_attn.c - verify_attn timing: us per call, TFLOP/s and % of the measured floor for
 * tree verification (S {1, 8, 64} x P {256, 1024, 4096, 16384} x q_len {9, 33, 65}, H = 64) and
 * plain decode (q_len 1, GB/s), next to FlashMLA's published H200 numbers.
 *
 * Method (as the FlashMLA anchor was measured): one call captured in a CUDA graph, L2 flushed
 * before every replay, median of the samples. Random trees (parent uniform among earlier nodes),
 * random page permutation, q / kv random normal (never zeros). Floors: FLOPs
 * 2*S*q*H*(P+q)*(576+512) over 687 TFLOP/s (sustained bf16 GEMM measured on this H200 kind,
 * h200-anchors.md) and bytes (KV once, q, out, lse) over the copy bandwidth bench_kernels measured.
 * KDT_BENCH_VA_FP8=1 times the FP8 latent cache instead (656-byte rows of random finite e4m3 codes,
 * power-of-two scales, bf16 rope; the portable kernel's loader);
 * the bytes floor then counts 656 bytes per key.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kdtree/kernels.h"

#define VA_H 64
#define VA_DQK 576
#define VA_DV 512
#define VA_PAGE 64
#define VA_GEMM_TFLOPS 687.0

/* FlashMLA dense decode, sm90 bf16, h_q 64, paged (block 64), one H200: Table 1 of
 * /work/shared/research/h200-anchors.md (measured 2026-11-29; graph replay, L2 flushed, median).
 * tree_us: s_q = q_len with causal=True (the tree stand-in: same prefix work, causal tail);
 * decode_us: s_q = 1 over the same T = P + q_len keys. */
static const struct {
    int S, P, q;
    double tree_us, decode_us;
} flashmla[] = {
    {1, 256, 9, 16.6, 15.0},       {1, 256, 33, 22.3, 15.0},      {1, 256, 65, 22.1, 15.6},
    {1, 1024, 9, 20.6, 18.3},      {1, 1024, 33, 29.1, 18.0},     {1, 1024, 65, 37.5, 18.6},
    {1, 4096, 9, 32.2, 30.3},      {1, 4096, 33, 48.3, 30.4},     {1, 4096, 65, 72.4, 30.7},
    {1, 16384, 9, 53.5, 51.9},     {1, 16384, 33, 120.0, 52.1},   {1, 16384, 65, 223.2, 52.5},
    {8, 256, 9, 22.5, 17.8},       {8, 256, 33, 40.1, 17.3},      {8, 256, 65, 76.9, 17.8},
    {8, 1024, 9, 40.1, 21.1},      {8, 1024, 33, 75.1, 21.2},     {8, 1024, 65, 146.2, 21.3},
    {8, 4096, 9, 80.2, 31.9},      {8, 4096, 33, 229.7, 32.3},    {8, 4096, 65, 450.6, 33.7},
    {8, 16384, 9, 264.6, 62.1},    {8, 16384, 33, 908.9, 62.3},   {8, 16384, 65, 1744.2, 62.3},
    {64, 256, 9, 86.9, 24.9},      {64, 256, 33, 259.8, 23.2},    {64, 256, 65, 500.9, 24.3},
    {64, 1024, 9, 174.9, 44.9},    {64, 1024, 33, 556.2, 45.3},   {64, 1024, 65, 1169.6, 48.4},
    {64, 4096, 9, 536.1, 102.1},   {64, 4096, 33, 1905.8, 103.5}, {64, 4096, 65, 3800.4, 104.3},
    {64, 16384, 9, 2045.9, 337.5}, {64, 16384, 33, 7281.7, 343.8}, {64, 16384, 65, 14635.2, 336.1},
};

/* FlashMLA time for a shape: the tree column, or for q_len 1 the s_q = 1 column of the q_len 9
 * row (T = P + 9, the closest to P + 1). 0 if not in the table. */
static double flashmla_us(int S, int P, int q) {
    for (size_t i = 0; i < sizeof flashmla / sizeof flashmla[0]; i++)
        if (flashmla[i].S == S && flashmla[i].P == P && flashmla[i].q == (q == 1 ? 9 : q))
            return q == 1 ? flashmla[i].decode_us : flashmla[i].tree_us;
    return 0;
}

/* Device buffers sized for the largest shape, shared by all shapes. */
typedef struct va_bench {
    int max_S, max_q, max_P, pool_pages;
    int no_split; /* KDT_BENCH_VA_NOSPLIT=1: no workspace, so no stream is split (what the splits
                   * and their merge cost, by difference) */
    int fp8;      /* KDT_BENCH_VA_FP8=1: the FP8 cache d_kv8 instead of d_kv */
    uint16_t *d_q, *d_kv, *d_out;
    unsigned char *d_kv8;
    float *d_lse;
    int32_t *d_table, *d_prefix, *d_n;
    uint64_t *d_mask;
    void *d_ws;
    size_t ws_bytes;
    kdt_verify_attn_params p;
} va_bench;

static int call_once(void *ctx, cudaStream_t stream) {
    va_bench *b = (va_bench *)ctx;
    if (kdt_verify_attn_cuda(&b->p, stream) != KDT_OK) {
        fprintf(stderr, "verify_attn: %s\n", kdt_last_error());
        return 1;
    }
    return 0;
}

static uint64_t mix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Fills n bf16 on the device with random normals: a 16 MB random block, tiled. */
static int fill_device(uint16_t *dst, size_t n, const uint16_t *d_block, size_t block) {
    for (size_t off = 0; off < n; off += block) {
        const size_t len = n - off < block ? n - off : block;
        BENCH_CUDA(cudaMemcpy(dst + off, d_block, 2 * len, cudaMemcpyDeviceToDevice));
    }
    return 0;
}

static int bench_alloc(va_bench *b, int max_S, int max_q, int max_P) {
    const int fp8 = b->fp8; /* the one field the caller sets first */
    memset(b, 0, sizeof *b);
    b->fp8 = fp8;
    b->max_S = max_S, b->max_q = max_q, b->max_P = max_P;
    const int pages_per_stream = (max_P + max_q + VA_PAGE - 1) / VA_PAGE;
    b->pool_pages = max_S * pages_per_stream;
    const size_t nq = (size_t)max_S * max_q * VA_H * VA_DQK, nkv = (size_t)b->pool_pages * VA_PAGE * VA_DQK;
    BENCH_CUDA(cudaMalloc((void **)&b->d_q, 2 * nq));
    BENCH_CUDA(cudaMalloc((void **)&b->d_kv, 2 * nkv));
    BENCH_CUDA(cudaMalloc((void **)&b->d_out, 2 * (size_t)max_S * max_q * VA_H * VA_DV));
    BENCH_CUDA(cudaMalloc((void **)&b->d_lse, 4 * (size_t)max_S * max_q * VA_H));
    BENCH_CUDA(cudaMalloc((void **)&b->d_table, 4 * (size_t)max_S * pages_per_stream));
    BENCH_CUDA(cudaMalloc((void **)&b->d_prefix, 4 * (size_t)max_S));
    BENCH_CUDA(cudaMalloc((void **)&b->d_n, 4 * (size_t)max_S));
    BENCH_CUDA(cudaMalloc((void **)&b->d_mask, 8 * (size_t)max_S * max_q * KDT_MASK_WORDS(max_q)));
    b->ws_bytes = kdt_verify_attn_workspace_bytes(max_S, VA_H, max_q, max_P);
    if (b->ws_bytes) BENCH_CUDA(cudaMalloc(&b->d_ws, b->ws_bytes));
    const size_t block = (size_t)8 << 20; /* 8 Mi bf16 = 16 MB of distinct random values */
    uint16_t *h = (uint16_t *)malloc(2 * block), *d_block = NULL;
    if (!h) return 1;
    bench_fill_normal_bf16(h, block, 12345, 1.0f);
    BENCH_CUDA(cudaMalloc((void **)&d_block, 2 * block));
    BENCH_CUDA(cudaMemcpy(d_block, h, 2 * block, cudaMemcpyHostToDevice));
    free(h);
    if (fill_device(b->d_q, nq, d_block, block) || fill_device(b->d_kv, nkv, d_block + 7, block - 7)) return 1;
    BENCH_CUDA(cudaFree(d_block));
    if (b->fp8) { /* 24,576 distinct rows (16 MB), tiled over the pool */
        const size_t rb = kdt_kv_row_bytes(KDT_KV_FP8_SCALED, VA_DQK, VA_DV), rows = (size_t)b->pool_pages * VA_PAGE;
        const size_t brows = 24576;
        unsigned char *hb = (unsigned char *)malloc(brows * rb), *d_b8 = NULL;
        uint16_t *rope = (uint16_t *)malloc(2 * (size_t)(VA_DQK - VA_DV));
        if (!hb || !rope) return 1;
        uint64_t seed = 777;
        for (size_t r = 0; r < brows; r++) {
            unsigned char *row = hb + r * rb;
            for (int j = 0; j < VA_DV; j++) {
                uint8_t c;
                do c = (uint8_t)mix64(&seed);
                while ((c & 0x7f) == 0x7f); /* finite codes only */
                row[j] = c;
            }
            const float sc = 1.0f / 128.0f; /* values up to 3.5, RMS ~0.8 */
            for (int g = 0; g < VA_DV / KDT_KV_FP8_GROUP; g++) memcpy(row + VA_DV + 4 * g, &sc, 4);
            bench_fill_normal_bf16(rope, VA_DQK - VA_DV, 99 + r, 1.0f);
            memcpy(row + VA_DV + 4 * (VA_DV / KDT_KV_FP8_GROUP), rope, 2 * (size_t)(VA_DQK - VA_DV));
        }
        BENCH_CUDA(cudaMalloc((void **)&b->d_kv8, rows * rb));
        BENCH_CUDA(cudaMalloc((void **)&d_b8, brows * rb));
        BENCH_CUDA(cudaMemcpy(d_b8, hb, brows * rb, cudaMemcpyHostToDevice));
        for (size_t r = 0; r < rows; r += brows) {
            const size_t n = rows - r < brows ? rows - r : brows;
            BENCH_CUDA(cudaMemcpy(b->d_kv8 + r * rb, d_b8, n * rb, cudaMemcpyDeviceToDevice));
        }
        BENCH_CUDA(cudaFree(d_b8));
        free(hb), free(rope);
    }
    return 0;
}

static void bench_free(va_bench *b) {
    cudaFree(b->d_q), cudaFree(b->d_kv), cudaFree(b->d_out), cudaFree(b->d_lse);
    if (b->d_kv8) cudaFree(b->d_kv8);
    cudaFree(b->d_table), cudaFree(b->d_prefix), cudaFree(b->d_n), cudaFree(b->d_mask);
    if (b->d_ws) cudaFree(b->d_ws);
}

/* Sets up S streams of P committed tokens and q tree nodes: random trees, scattered pages. */
static int bench_shape(va_bench *b, int S, int P, int q, uint64_t seed) {
    const int words = KDT_MASK_WORDS(q), pages = (P + q + VA_PAGE - 1) / VA_PAGE;
    int32_t *table = (int32_t *)malloc(4 * (size_t)S * pages), *prefix = (int32_t *)malloc(4 * (size_t)S);
    int32_t *n = (int32_t *)malloc(4 * (size_t)S), *perm = (int32_t *)malloc(4 * (size_t)b->pool_pages);
    uint64_t *mask = (uint64_t *)calloc((size_t)S * q * words, 8);
    int32_t *parent = (int32_t *)malloc(4 * (size_t)q);
    if (!table || !prefix || !n || !perm || !mask || !parent) return 1;
    for (int i = 0; i < b->pool_pages; i++) perm[i] = i;
    for (int i = b->pool_pages - 1; i > 0; i--) {
        const int j = (int)(mix64(&seed) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int s = 0; s < S; s++) {
        prefix[s] = P, n[s] = q;
        for (int k = 0; k < pages; k++) table[s * pages + k] = perm[s * pages + k];
        for (int i = 0; i < q; i++) {
            parent[i] = i == 0 ? -1 : (int)(mix64(&seed) % (uint64_t)i);
            for (int a = i; a >= 0; a = parent[a]) mask[((size_t)s * q + i) * words + (a >> 6)] |= 1ull << (a & 63);
        }
    }
    BENCH_CUDA(cudaMemcpy(b->d_table, table, 4 * (size_t)S * pages, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(b->d_prefix, prefix, 4 * (size_t)S, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(b->d_n, n, 4 * (size_t)S, cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaMemcpy(b->d_mask, mask, 8 * (size_t)S * q * words, cudaMemcpyHostToDevice));
    free(table), free(prefix), free(n), free(perm), free(mask), free(parent);
    kdt_verify_attn_params *p = &b->p;
    memset(p, 0, sizeof *p);
    p->n_streams = S, p->n_heads = VA_H, p->max_nodes = q, p->d_qk = VA_DQK, p->d_v = VA_DV;
    p->softmax_scale = 0.144680f;
    p->q = b->d_q, p->kv_cache = b->d_kv, p->n_pages = b->pool_pages, p->page_size = VA_PAGE;
    p->block_table = b->d_table, p->max_pages = pages, p->prefix_len = b->d_prefix, p->n_nodes = b->d_n;
    p->anc_mask = b->d_mask, p->out = b->d_out, p->lse = b->d_lse;
    p->workspace = b->no_split ? NULL : b->d_ws, p->workspace_bytes = b->no_split ? 0 : b->ws_bytes;
    if (b->fp8) p->kv_cache = b->d_kv8, p->kv_format = KDT_KV_FP8_SCALED;
    return 0;
}

/* Times one shape and prints its row. */
static int bench_row(va_bench *b, const bench_opts *o, cudaStream_t stream, int S, int P, int q) {
    if (bench_shape(b, S, P, q, (uint64_t)S * 1000003u + (uint64_t)P * 31u + (uint64_t)q)) return 1;
    const double flops = 2.0 * S * q * VA_H * (double)(P + q) * (VA_DQK + VA_DV);
    const double key_bytes = (double)kdt_kv_row_bytes(b->fp8 ? KDT_KV_FP8_SCALED : KDT_KV_BF16, VA_DQK, VA_DV);
    const double bytes = (double)S * (P + q) * key_bytes + (double)S * q * VA_H * (VA_DQK * 2 + VA_DV * 2 + 4);
    const double floor_us = fmax(flops / (VA_GEMM_TFLOPS * 1e12), bytes / (g_bench_device.copy_gbps * 1e9)) * 1e6;
    /* about 0.15 s of samples, at least 5 */
    const double guess_us = fmax(10.0, flops / 250e12 * 1e6);
    int samples = (int)(0.15e6 / guess_us);
    samples = samples < 5 ? 5 : samples > (o->quick ? 20 : 100) ? (o->quick ? 20 : 100) : samples;
    bench_timing t;
    if (bench_time(call_once, b, stream, 2, samples, 1, 1, &t)) return 1;
    /* a NaN in the result would mean the kernel failed: check one stream's lse */
    float lse[64];
    BENCH_CUDA(cudaMemcpy(lse, b->d_lse, sizeof lse, cudaMemcpyDeviceToHost));
    int nan_seen = 0;
    for (int i = 0; i < 64; i++) nan_seen |= !isfinite(lse[i]);
    const double fm = flashmla_us(S, P, q);
    char fm_text[32] = "-", ratio[32] = "-";
    if (fm > 0) snprintf(fm_text, sizeof fm_text, "%.1f", fm), snprintf(ratio, sizeof ratio, "%.2fx", t.median_us / fm);
    const double tflops = flops / (t.median_us * 1e-6) / 1e12, gbps = bytes / (t.median_us * 1e-6) / 1e9;
    printf("%3d %6d %4d %10.1f %8.1f %8.0f %9.1f %6.0f%% %10s %7s%s\n", S, P, q, t.median_us, tflops, gbps, floor_us,
           100.0 * floor_us / t.median_us, fm_text, ratio, nan_seen ? "  NaN IN OUTPUT!" : "");
    if (o->md)
        fprintf(o->md, "| %d | %d | %d | %.1f | %.1f | %.0f | %.1f | %.0f%% | %s | %s |\n", S, P, q, t.median_us,
                tflops, gbps, floor_us, 100.0 * floor_us / t.median_us, fm_text, ratio);
    return nan_seen;
}

int bench_verify_attn(const bench_opts *o) {
    static const int Ss[] = {1, 8, 64}, Ps[] = {256, 1024, 4096, 16384}, qs[] = {9, 33, 65};
    static const int quick[][3] = {{1, 256, 9}, {1, 4096, 33}, {8, 1024, 65}, {64, 4096, 33}, {64, 16384, 1}};
    va_bench b;
    const char *f8 = getenv("KDT_BENCH_VA_FP8");
    const int fp8 = f8 && f8[0] == '1';
    memset(&b, 0, sizeof b);
    b.fp8 = fp8; /* bench_alloc reads it */
    if (bench_alloc(&b, 64, 65, 16384)) return 1;
    const char *ns = getenv("KDT_BENCH_VA_NOSPLIT");
    b.no_split = ns && ns[0] == '1';
    cudaStream_t stream;
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const char *cfg = getenv("KDT_VA_PORTABLE_CFG"), *lim = getenv("KDT_GPU_SMEM_LIMIT");
    printf("path: %s (KDT_VERIFY_ATTN=mma|wgmma picks one)%s%s%s%s%s%s\n",
           b.fp8 ? "portable (mma.sync): the FP8 cache" : kdt_verify_attn_cuda_path(),
           b.no_split ? "; no workspace: no stream is split (KDT_BENCH_VA_NOSPLIT=1)" : "",
           b.fp8 ? "; KDT_BENCH_VA_FP8=1: 656-byte e4m3 rows" : "",
           cfg && *cfg ? "; portable configuration KDT_VA_PORTABLE_CFG=" : "", cfg && *cfg ? cfg : "",
           lim && *lim ? "; shared memory capped, KDT_GPU_SMEM_LIMIT=" : "", lim && *lim ? lim : "");
    printf("H = 64, d_qk 576, d_v 512, page 64; graph replay of one call, L2 flushed before each; "
           "floor = max(FLOPs / %.0f TFLOP/s, bytes / %.0f GB/s)\n", VA_GEMM_TFLOPS, g_bench_device.copy_gbps);
    printf("%3s %6s %4s %10s %8s %8s %9s %7s %10s %7s\n", "S", "P", "q", "us", "TFLOP/s", "GB/s", "floor_us",
           "%floor", "FlashMLA", "ratio");
    if (o->md)
        fprintf(o->md, "| S | P | q_len | us | TFLOP/s | GB/s | floor us | %% of floor | FlashMLA us | ratio |\n"
                       "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    int rc = 0;
    /* KDT_BENCH_VA_SHAPE=S,P,q: that shape alone (for a profiler run or scripts/va_ab.sh); one
     * outside the buffers bench_alloc sized is refused, not replaced by the table */
    const char *one = getenv("KDT_BENCH_VA_SHAPE");
    int oS, oP, oq;
    if (one && *one &&
        !(sscanf(one, "%d,%d,%d", &oS, &oP, &oq) == 3 && oS >= 1 && oS <= b.max_S && oP >= 0 && oP <= b.max_P &&
          oq >= 1 && oq <= b.max_q)) {
        fprintf(stderr, "bench_kernels: KDT_BENCH_VA_SHAPE=%s: expected S,P,q with S 1..%d, P 0..%d, q 1..%d\n", one,
                b.max_S, b.max_P, b.max_q);
        rc = 2;
    } else if (one && *one) {
        rc = bench_row(&b, o, stream, oS, oP, oq);
        const char *prof = getenv("KDT_VA_PROFILE");
        if (prof && prof[0] == '1') { /* the phase stamps of the last call (sm_90a kernel only) */
            char text[2048]; /* the per-tile means, then the item and its first and last tile */
            if (kdt_verify_attn_cuda_profile(text, sizeof text) == KDT_OK) printf("%s\n", text);
            else printf("profile: %s\n", kdt_last_error());
        }
    } else if (o->quick) {
        for (size_t i = 0; i < sizeof quick / sizeof quick[0]; i++)
            rc |= bench_row(&b, o, stream, quick[i][0], quick[i][1], quick[i][2]);
    } else {
        for (int si = 0; si < 3; si++)
            for (int pi = 0; pi < 4; pi++)
                for (int qi = 0; qi < 3; qi++) rc |= bench_row(&b, o, stream, Ss[si], Ps[pi], qs[qi]);
        printf("decode (q_len 1; FlashMLA column: its s_q = 1 time over P + 9 keys)\n");
        if (o->md)
            fprintf(o->md, "\ndecode, q_len 1 (FlashMLA: s_q = 1 over P + 9 keys):\n\n"
                           "| S | P | q_len | us | TFLOP/s | GB/s | floor us | %% of floor | FlashMLA us | ratio |\n"
                           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for (int si = 0; si < 3; si++)
            for (int pi = 0; pi < 4; pi++) rc |= bench_row(&b, o, stream, Ss[si], Ps[pi], 1);
    }
    cudaStreamDestroy(stream);
    bench_free(&b);
    return rc;
}
