/* kdtree.h - the public entry point of kdtree: status codes, errors, version.
 *
 * kdtree is a native C + CUDA engine that serves DeepSeek-V3-family models (Kimi K2.x first)
 * with DDTree speculative decoding. Every public function returns a kdt_status; on failure a
 * human-readable message naming the problem is kept per thread and read with kdt_last_error().
 * Library code never calls exit() and never prints on its own.
 *
 * Subsystem headers (each says what it owns at its top):
 *   kdtree/kernels.h    the DDTree kernels (top-K, tree_build, tree_accept, KV commit, verify_attn),
 *                       each with a plain-C CPU twin and a CUDA launcher of the same shape.
 *   kdtree/model.h      the target model: HF checkpoint loading, paged latent KV cache, forward
 *                       (prefill, decode, tree verify) on the CPU and the GPU.
 *   kdtree/engine.h     the decoding engine: DFlash drafter + DDTree / chain / plain rounds over
 *                       many streams (continuous batching).
 *   kdtree/tokenizer.h  tiktoken / HF byte-level BPE tokenizers, streaming detokenizer, chat
 *                       templates.
 */
#ifndef KDTREE_KDTREE_H
#define KDTREE_KDTREE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDT_VERSION_MAJOR 0
#define KDT_VERSION_MINOR 1
#define KDT_VERSION_PATCH 0

typedef enum kdt_status {
    KDT_OK = 0,
    KDT_ERR_INVALID_ARG = 1,   /* null pointer, negative or out-of-range size */
    KDT_ERR_MALFORMED_TREE = 2,/* a tree failed validation (cycle, parent >= index, ...) */
    KDT_ERR_OUT_OF_MEMORY = 3,
    KDT_ERR_IO = 4,            /* a file could not be opened / read / mapped */
    KDT_ERR_FORMAT = 5,        /* malformed file contents: JSON, safetensors, vocab, config */
    KDT_ERR_UNSUPPORTED = 6,   /* valid input this build cannot handle (dtype, arch, shape) */
    KDT_ERR_CUDA = 7,          /* a CUDA runtime call or kernel launch failed */
    KDT_ERR_NO_CUDA = 8,       /* CUDA function called in a build without CUDA */
    KDT_ERR_CAPACITY = 9,      /* KV cache, context or queue exhausted */
    KDT_ERR_INTERNAL = 10,
} kdt_status;

/* Name of a status code, e.g. "KDT_ERR_INVALID_ARG". Never NULL. */
const char *kdt_status_name(kdt_status s);

/* The message of the last failure in this thread ("" if none). Valid until the next kdtree call
 * in this thread. */
const char *kdt_last_error(void);

/* Clears this thread's last error message. */
void kdt_clear_error(void);

/* "0.1.0 (cuda)" or "0.1.0 (cpu)". */
const char *kdt_version_string(void);

/* 1 if this library was built with CUDA kernels, else 0. */
int kdt_has_cuda(void);

/* CPU threads for the CPU forward and drafter (OpenMP): n = 0 restores the default (the
 * OMP_NUM_THREADS environment variable, else every core), 1..1024 sets it for every later call
 * in the process. Results are bitwise the same for every thread count. KDT_ERR_INVALID_ARG
 * outside 0..1024. Without OpenMP in the build everything runs on the calling thread. */
kdt_status kdt_set_cpu_threads(int n);

#ifdef __cplusplus
}
#endif
#endif /* KDTREE_KDTREE_H */
