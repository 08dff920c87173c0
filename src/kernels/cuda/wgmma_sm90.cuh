/* wgmma_sm90.cuh - the Hopper (sm_90a) warpgroup MMA pieces the verify_attn sm_90a path and the
 * GPU model's 64-head attention scores (src/model/cuda/gpu_attn.cu, m64n32k16) are built from:
 * shared-memory matrix descriptors for the 128-byte-swizzled layout, the wgmma shapes MLA
 * attention needs, and the fences around them. Everything here compiles to nothing
 * unless the device pass targets sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); callers check KDT_HAS_WGMMA.
 *
 * Layout ("slab"): a matrix with K = 64 * n bf16 columns is stored as n slabs of [R rows][64]
 * (128 bytes per row, R * 128 bytes per slab, each slab 1024-byte aligned). Inside a slab the
 * 16-byte chunk c of row r sits at chunk c ^ (r % 8): the 128B swizzle the hardware undoes. MLA's
 * latent KV row (576 = 9 x 64) is 9 slabs; its first 8 slabs are V (512 columns).
 *
 * The two products of one 64-row tile and a tile of N keys:
 *   S = Q K^T  m64nNk16, A = Q slabs (K-major), B = KV slabs (K-major: each key row holds its k);
 *              per k step of 16 the descriptors' start moves by 32 bytes inside the slab rows,
 *              and by one slab every 4 steps. SBO = 1024 (8 rows of 128 bytes), LBO unused.
 *   O = P V    m64n256k16, A = P in registers (the S accumulator of the same tile, rounded to
 *              bf16: its layout is exactly the A fragment, see s_to_a_frag), B = the V slabs read
 *              N-major (transposed: trans-b = 1). N = 256 columns = 4 slabs: LBO = the slab
 *              stride (R * 128 bytes), SBO = 1024 (8 key rows); a k step of 16 keys moves the
 *              start by 16 rows = 2048 bytes.
 * Accumulator layout of m64nN f32 (per thread of the 128): warp w holds rows 16w + lane/4 and
 * 16w + lane/4 + 8; d[4j + 0..1] are row lane/4, columns 8j + 2 (lane % 4) + {0, 1}; d[4j + 2..3]
 * the same columns of row lane/4 + 8.
 *
 * tests/gpu/test_wgmma_sm90.cu checks both products against the CPU (and reports if the MN-major
 * LBO / SBO roles are the other way round), and m64n32k16 chains against mma.sync's, bitwise.
 */
#ifndef KDT_WGMMA_SM90_CUH
#define KDT_WGMMA_SM90_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDT_HAS_WGMMA 1
#else
#define KDT_HAS_WGMMA 0
#endif

namespace wg {

/* Byte offset of element (r, c) (c < 64) inside a 128B-swizzled slab. */
__host__ __device__ constexpr uint32_t sw128_offset(int r, int c) {
    return (uint32_t)r * 128u + ((((uint32_t)c >> 3) ^ ((uint32_t)r & 7u)) << 4) + ((uint32_t)c & 7u) * 2u;
}

/* Shared-memory matrix descriptor, 128B swizzle (layout type 1 in bits 62-63). */
__device__ __forceinline__ uint64_t desc_sw128(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    uint64_t d = 0;
    d |= (uint64_t)((smem_addr & 0x3FFFFu) >> 4);
    d |= (uint64_t)((lbo_bytes >> 4) & 0x3FFFu) << 16;
    d |= (uint64_t)((sbo_bytes >> 4) & 0x3FFFu) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

/* Descriptor d with its start address moved by `bytes` (a multiple of 16), as a 32-bit add on the
 * low word: for shared addresses below 2^18 the 14-bit start field never carries, so this is
 * desc_sw128 of the moved address, without the per-step mask, shift and 64-bit arithmetic. */
__device__ __forceinline__ uint64_t desc_step(uint64_t d, uint32_t bytes) {
    return ((uint64_t)(uint32_t)(d >> 32) << 32) | (uint32_t)((uint32_t)d + (bytes >> 4));
}

/* Byte offset of k step `kk` (16 columns) inside a K-major slab matrix of `rows` rows: slab kk / 4,
 * 32 bytes per step inside its 128-byte rows. */
__host__ __device__ constexpr uint32_t kstep_offset(int rows, int kk) {
    return (uint32_t)(kk >> 2) * (uint32_t)rows * 128u + (uint32_t)(kk & 3) * 32u;
}
/* Descriptors of k step `kk` (16 columns) of a K-major slab matrix with `rows` rows at base. */
__device__ __forceinline__ uint64_t desc_kmajor(uint32_t base, int rows, int kk) {
    return desc_sw128(base + kstep_offset(rows, kk), 16u, 1024u);
}
/* Byte offset of key step `kk` (16 keys of 128-byte slab rows) inside the N-major V operand. */
__host__ __device__ constexpr uint32_t vstep_offset(int kk) { return (uint32_t)kk * 16u * 128u; }
/* Descriptor of key step `kk` (16 keys) of the N-major V operand: columns [64 slab0, +256) of a
 * slab matrix with `keys` rows at base. */
__device__ __forceinline__ uint64_t desc_v(uint32_t base, int keys, int slab0, int kk, uint32_t lbo, uint32_t sbo) {
    return desc_sw128(base + (uint32_t)slab0 * (uint32_t)keys * 128u + vstep_offset(kk), lbo, sbo);
}

__device__ __forceinline__ void fence() {
#if KDT_HAS_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void commit() {
#if KDT_HAS_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wait() {
#if KDT_HAS_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
/* Generic-proxy shared-memory writes (st.shared, cp.async) become visible to wgmma's async proxy
 * only after this fence (then a barrier). */
__device__ __forceinline__ void fence_proxy_async() {
#if KDT_HAS_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* d (32 f32) (+)= A(desc) B(desc)^T, m64n64k16, both K-major. accumulate = 0 overwrites d. */
__device__ __forceinline__ void mma_m64n64k16_ss(float d[32], uint64_t da, uint64_t db, int accumulate) {
#if KDT_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
#else
    (void)d, (void)da, (void)db, (void)accumulate;
#endif
}

/* Pins 16 accumulator registers at this point of the instruction stream (an empty asm that reads
 * and writes them): before wg::fence it keeps their initial values from being moved past the
 * fence (ptxas would then insert warpgroup waits between the chains' first products). */
__device__ __forceinline__ void fence_operands16(float d[16]) {
    asm volatile(""
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 :
                 : "memory");
}

/* d (16 f32) += A(desc) B(desc)^T, m64n32k16, both K-major, always accumulating (d = 0 first gives
 * a chain the same first step as mma.sync's c = 0: the GPU model's attention S phase relies on
 * the two giving the same bits, which tests/gpu/test_wgmma_sm90.cu checks). Each descriptor goes
 * in as its two 32-bit words: a caller stepping the start address (the low word's bits 0-13,
 * which never carry into the rest for shared addresses below 2^18) then adds in 32 bits and keeps
 * the constant high word where it is, instead of a 64-bit add and two register-to-uniform moves
 * per descriptor (ncu: the 64-head attention's S phase spent ~10 integer instructions per wgmma
 * on them). */
__device__ __forceinline__ void mma_m64n32k16_ss(float d[16], uint32_t a_lo, uint32_t a_hi, uint32_t b_lo,
                                                 uint32_t b_hi) {
#if KDT_HAS_WGMMA
    asm volatile(
        "{\n.reg .b64 da, db;\nmov.b64 da, {%16, %17};\nmov.b64 db, {%18, %19};\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, da, db, 1, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a_lo), "r"(a_hi), "r"(b_lo), "r"(b_hi));
#else
    (void)d, (void)a_lo, (void)a_hi, (void)b_lo, (void)b_hi;
#endif
}
/* The same product from whole 64-bit descriptors. */
__device__ __forceinline__ void mma_m64n32k16_ss(float d[16], uint64_t da, uint64_t db) {
    mma_m64n32k16_ss(d, (uint32_t)da, (uint32_t)(da >> 32), (uint32_t)db, (uint32_t)(db >> 32));
}

#define KDT_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                     "+f"(d[i + 6]), "+f"(d[i + 7])
/* The 128 f32 accumulator registers of an m64n256 product: operands %0..%127 and their bindings. */
#define KDT_WG_ACC128 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
    "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
    "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
    "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
    "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
#define KDT_WG_ACC128_OPS                                                                                          \
    KDT_WG_D8(0), KDT_WG_D8(8), KDT_WG_D8(16), KDT_WG_D8(24), KDT_WG_D8(32), KDT_WG_D8(40), KDT_WG_D8(48),           \
        KDT_WG_D8(56), KDT_WG_D8(64), KDT_WG_D8(72), KDT_WG_D8(80), KDT_WG_D8(88), KDT_WG_D8(96), KDT_WG_D8(104), \
        KDT_WG_D8(112), KDT_WG_D8(120)

/* d (128 f32) (+)= A(registers, 4 x bf16x2) B(desc), m64n256k16, B N-major (trans-b = 1). */
__device__ __forceinline__ void mma_m64n256k16_rs_tb(float d[128], const uint32_t a[4], uint64_t db, int accumulate) {
#if KDT_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        KDT_WG_ACC128
        "{%128,%129,%130,%131}, %132, p, 1, 1, 1;\n}\n"
        : KDT_WG_ACC128_OPS
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
#else
    (void)d, (void)a, (void)db, (void)accumulate;
#endif
}
/* The same product with A from shared memory too (K-major, e.g. P written to a swizzled slab by
 * another warpgroup): trans-a = 0, trans-b = 1. */
__device__ __forceinline__ void mma_m64n256k16_ss_tb(float d[128], uint64_t da, uint64_t db, int accumulate) {
#if KDT_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        KDT_WG_ACC128
        "%128, %129, p, 1, 1, 0, 1;\n}\n"
        : KDT_WG_ACC128_OPS
        : "l"(da), "l"(db), "r"(accumulate));
#else
    (void)d, (void)da, (void)db, (void)accumulate;
#endif
}
#undef KDT_WG_ACC128_OPS
#undef KDT_WG_ACC128
#undef KDT_WG_D8

/* A named barrier (ids 1..15; 0 is __syncthreads) of `n` threads, e.g. two warpgroups of one CTA:
 * shared-memory writes before it are seen after it (plus fence_proxy_async first when wgmma reads
 * them). Only full barriers: compute-sanitizer's racecheck does not order accesses across a
 * bar.arrive (verify_attn v3a). */
__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* ---- TMA (cp.async.bulk.tensor) and the mbarriers it completes -------------------------------
 * One thread issues a tile's copies; the copies land in the 128B-swizzled slab layout above when
 * the tensor map says CU_TENSOR_MAP_SWIZZLE_128B (the same XOR of chunk and row % 8 inside each
 * 1024-byte block) and the destination is 1024-byte aligned. Waiters pass the parity of the phase
 * they wait for (0 for a barrier's first completion, then alternating). */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if KDT_HAS_WGMMA
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
/* The calling thread's arrival, announcing `bytes` of copies that will complete the phase. */
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if KDT_HAS_WGMMA
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if KDT_HAS_WGMMA
    /* the label is local to the braces, so every inlined copy may use it */
    asm volatile("{\n.reg .pred p;\nKDT_MBAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra KDT_MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#endif
}
/* Box (x = column, y = row) of a 2-D tensor map into shared memory at dst; completes on bar. */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void *tmap, int x, int y, uint32_t bar) {
#if KDT_HAS_WGMMA
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(tmap), "r"(x), "r"(y), "r"(bar) : "memory");
#endif
}

/* ---- bulk copies shared -> global (cp.async.bulk, no tensor map), one group per thread -------
 * The source must have been written before a fence_proxy_async and a barrier; both addresses
 * 16-byte aligned, bytes a multiple of 16. */
__device__ __forceinline__ void bulk_store(void *gdst, uint32_t ssrc, uint32_t bytes) {
#if KDT_HAS_WGMMA
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(__cvta_generic_to_global(gdst)),
                 "r"(ssrc), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if KDT_HAS_WGMMA
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
/* this thread's bulk copies have read their shared-memory source (it may be overwritten) */
__device__ __forceinline__ void bulk_wait_read() {
#if KDT_HAS_WGMMA
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}
/* this thread's bulk copies are complete */
__device__ __forceinline__ void bulk_wait() {
#if KDT_HAS_WGMMA
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* lo -> lower address */
    return *reinterpret_cast<uint32_t *>(&v);
}

/* The A fragment of key step kk (keys 16 kk .. 16 kk + 15) from an m64nN f32 accumulator p[]:
 * the accumulator's n8 blocks 2 kk and 2 kk + 1 are the fragment's two column halves. */
template <int NREG>
__device__ __forceinline__ void s_to_a_frag(const float (&p)[NREG], int kk, uint32_t a[4]) {
    const int j0 = 8 * kk, j1 = 8 * kk + 4;
    a[0] = pack_bf16x2(p[j0 + 0], p[j0 + 1]);
    a[1] = pack_bf16x2(p[j0 + 2], p[j0 + 3]);
    a[2] = pack_bf16x2(p[j1 + 0], p[j1 + 1]);
    a[3] = pack_bf16x2(p[j1 + 2], p[j1 + 3]);
}

} // namespace wg

#endif
