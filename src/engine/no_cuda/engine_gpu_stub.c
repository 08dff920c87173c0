/* engine_gpu_stub.c - the engine's GPU side in a build without CUDA: never available. */
#include "engine/engine_gpu.h"

int kdt_engine_gpu_available(void) { return 0; }

kdt_status kdt_engine_gpu_create(kdt_engine *e, int verbose) {
    (void)e;
    (void)verbose;
    return kdt_fail(KDT_ERR_NO_CUDA, "device cuda: this kdtree build has no CUDA support");
}

void kdt_engine_gpu_free(kdt_engine *e) { (void)e; }

const char *kdt_engine_gpu_fault(kdt_engine *e) {
    (void)e;
    return NULL;
}

kdt_status kdt_engine_gpu_prefill_pass(kdt_engine *e, int32_t n, const int32_t *slots, const int32_t *from,
                                       const int32_t *n_rows, int32_t *first_token) {
    (void)e;
    (void)n;
    (void)slots;
    (void)from;
    (void)n_rows;
    (void)first_token;
    return kdt_fail(KDT_ERR_NO_CUDA, "engine: no CUDA in this build");
}

kdt_status kdt_engine_gpu_round(kdt_engine *e, const int32_t *slots, int32_t n_slots,
                                kdt_stream_event *events, int32_t *n_ev) {
    (void)e;
    (void)slots;
    (void)n_slots;
    (void)events;
    (void)n_ev;
    return kdt_fail(KDT_ERR_NO_CUDA, "engine: no CUDA in this build");
}

void kdt_engine_gpu_release(kdt_engine *e, int32_t slot) {
    (void)e;
    (void)slot;
}

int32_t kdt_engine_gpu_free_pages(const kdt_engine *e) {
    (void)e;
    return 0;
}

const char *kdt_engine_gpu_device_name(const kdt_engine *e) {
    (void)e;
    return "cpu";
}
