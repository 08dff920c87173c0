/* engine_gpu.h - the engine's GPU side (cuda/engine_gpu.c; no_cuda/engine_gpu_stub.c says
 * KDT_ERR_NO_CUDA): the target, its paged KV cache, the forward runner and the DFlash drafter on
 * one GPU, and the decoding round run there. Per round only the per-stream parameters go up
 * (one small copy) and the accepted tokens with tau come back (one small copy, one sync); the
 * drafter, top-K, tree build, verify, accept, KV commit and drafter-context update all stay on
 * the device, replayed as a CUDA graph once a round shape has been seen. `auto` stays in the
 * graph: a drafted round builds its trees at the caps, verifies their prefixes at the chosen
 * budgets, and the caps trees' scores come down with the results and choose the next round's
 * budgets (one round of lag, no mid-round sync). Exceptions, run
 * eagerly with one more host round trip: T > 0 streams (their per-node draws use the host sampler
 * on the logits) and the test-only drafter hook (its logits go up). Internal to the engine.
 */
#ifndef KDT_ENGINE_GPU_H
#define KDT_ENGINE_GPU_H

#include "engine_internal.h"

typedef struct eng_gpu eng_gpu;

/* 1 if this build has CUDA and a device is present. */
int kdt_engine_gpu_available(void);
/* Uploads e->model (and e->drafter when present) and creates the GPU KV cache and buffers;
 * sets e->gpu. The CPU model stays loaded (mmap'ed) as the source of truth. */
kdt_status kdt_engine_gpu_create(kdt_engine *e, int verbose);
void kdt_engine_gpu_free(kdt_engine *e);

/* One prefill pass over n streams' chunks (kdt_gpu_stage_prefill_many): slot k's prompt rows
 * [from[k], from[k] + n_rows[k]), from[k] its prefix_len and a multiple of the pass size
 * e->prefill_quantum, the rows together at most that size. Advances each prefix_len; first_token[k]
 * is the stream's first token where its rows end the prompt, else -1. Each row gets the bits of a
 * pass of its stream's chunk alone. */
kdt_status kdt_engine_gpu_prefill_pass(kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from,
                                       const int32_t *n_rows, int32_t *first_token);
kdt_status kdt_engine_gpu_round(kdt_engine *e, const int32_t *slots, int32_t n_slots,
                                kdt_stream_event *events, int32_t *n_ev);
/* Frees slot's KV pages on the GPU. */
void kdt_engine_gpu_release(kdt_engine *e, int32_t slot);
int32_t kdt_engine_gpu_free_pages(const kdt_engine *e);
/* "cuda (<device name>)" */
const char *kdt_engine_gpu_device_name(const kdt_engine *e);
/* After a failed GPU call: NULL if the CUDA context still works (a refused launch, a host-side
 * error), else the device's sticky error (an illegal address, a kernel trap, a lost device: every
 * later CUDA call fails the same way, so the engine can never run again in this process). */
const char *kdt_engine_gpu_fault(kdt_engine *e);

#endif
