/* gpu_stubs.c - the GPU forward API of model.h in a build without CUDA: every entry point
 * says so with KDT_ERR_NO_CUDA (and frees / queries are harmless no-ops). */
#include "common.h"
#include "kdtree/model.h"

#define NO_CUDA(name) kdt_fail(KDT_ERR_NO_CUDA, "%s: this kdtree build has no CUDA support (rebuild with nvcc)", name)

kdt_status kdt_model_to_gpu(const kdt_model *m, const kdt_gpu_options *opt, kdt_gpu_model **out) {
    (void)m;
    (void)opt;
    (void)out;
    if (out)
        *out = NULL;
    return NO_CUDA("kdt_model_to_gpu");
}

kdt_status kdt_gpu_model_random(const char *config_json, const kdt_gpu_random_init *init, const kdt_gpu_options *opt,
                                kdt_gpu_model **out) {
    (void)config_json;
    (void)init;
    (void)opt;
    (void)out;
    if (out)
        *out = NULL;
    return NO_CUDA("kdt_gpu_model_random");
}

void kdt_gpu_model_free(kdt_gpu_model *g) { (void)g; }

kdt_status kdt_gpu_model_weight_bytes(const kdt_gpu_model *g, int32_t layer, kdt_gpu_weight_bytes *out) {
    (void)g;
    (void)layer;
    (void)out;
    return NO_CUDA("kdt_gpu_model_weight_bytes");
}

kdt_status kdt_gpu_kv_create(const kdt_gpu_model *g, const kdt_kv_cache_options *opt, kdt_gpu_kv **out) {
    (void)g;
    (void)opt;
    (void)out;
    if (out)
        *out = NULL;
    return NO_CUDA("kdt_gpu_kv_create");
}

void kdt_gpu_kv_free(kdt_gpu_kv *c) { (void)c; }

kdt_status kdt_gpu_kv_reset(kdt_gpu_kv *c) {
    (void)c;
    return NO_CUDA("kdt_gpu_kv_reset");
}

kdt_status kdt_gpu_kv_stream_reserve(kdt_gpu_kv *c, int32_t stream, int32_t n_slots) {
    (void)c;
    (void)stream;
    (void)n_slots;
    return NO_CUDA("kdt_gpu_kv_stream_reserve");
}

kdt_status kdt_gpu_kv_stream_release(kdt_gpu_kv *c, int32_t stream) {
    (void)c;
    (void)stream;
    return NO_CUDA("kdt_gpu_kv_stream_release");
}

int32_t kdt_gpu_kv_stream_length(const kdt_gpu_kv *c, int32_t stream) {
    (void)c;
    (void)stream;
    return -1;
}

kdt_status kdt_gpu_kv_stream_set_length(kdt_gpu_kv *c, int32_t stream, int32_t len) {
    (void)c;
    (void)stream;
    (void)len;
    return NO_CUDA("kdt_gpu_kv_stream_set_length");
}

int32_t kdt_gpu_kv_free_pages(const kdt_gpu_kv *c) {
    (void)c;
    return 0;
}

kdt_status kdt_gpu_kv_layout(kdt_gpu_kv *c, kdt_kv_layout *out) {
    (void)c;
    (void)out;
    return NO_CUDA("kdt_gpu_kv_layout");
}

kdt_status kdt_gpu_kv_read_row(kdt_gpu_kv *c, int32_t layer, int32_t stream, int32_t slot, float *row) {
    (void)c;
    (void)layer;
    (void)stream;
    (void)slot;
    (void)row;
    return NO_CUDA("kdt_gpu_kv_read_row");
}

kdt_status kdt_gpu_runner_create(const kdt_gpu_model *g, const kdt_gpu_runner_options *opt, kdt_gpu_runner **out) {
    (void)g;
    (void)opt;
    (void)out;
    if (out)
        *out = NULL;
    return NO_CUDA("kdt_gpu_runner_create");
}

void kdt_gpu_runner_free(kdt_gpu_runner *r) { (void)r; }

kdt_status kdt_gpu_runner_sync(kdt_gpu_runner *r) {
    (void)r;
    return NO_CUDA("kdt_gpu_runner_sync");
}

kdt_status kdt_gpu_prefill(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, const int32_t *tokens, int32_t n,
                           const kdt_model_outputs *out) {
    (void)r;
    (void)c;
    (void)stream;
    (void)tokens;
    (void)n;
    (void)out;
    return NO_CUDA("kdt_gpu_prefill");
}

kdt_status kdt_gpu_decode(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams, const int32_t *stream_ids,
                          const int32_t *tokens, const kdt_model_outputs *out) {
    (void)r;
    (void)c;
    (void)n_streams;
    (void)stream_ids;
    (void)tokens;
    (void)out;
    return NO_CUDA("kdt_gpu_decode");
}

kdt_status kdt_gpu_verify(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *tree, const int32_t *stream_ids,
                          const kdt_model_outputs *out) {
    (void)r;
    (void)c;
    (void)tree;
    (void)stream_ids;
    (void)out;
    return NO_CUDA("kdt_gpu_verify");
}

kdt_status kdt_gpu_kv_commit(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams, const int32_t *stream_ids,
                             const int32_t *accepted, const int32_t *tau) {
    (void)r;
    (void)c;
    (void)n_streams;
    (void)stream_ids;
    (void)accepted;
    (void)tau;
    return NO_CUDA("kdt_gpu_kv_commit");
}

kdt_status kdt_gpu_kv_fill_random(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, int32_t n_slots, uint64_t seed) {
    (void)r;
    (void)c;
    (void)stream;
    (void)n_slots;
    (void)seed;
    return NO_CUDA("kdt_gpu_kv_fill_random");
}

kdt_status kdt_gpu_stage_prefill(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t stream, const int32_t *tokens, int32_t n,
                                 int32_t last_only) {
    (void)r;
    (void)c;
    (void)stream;
    (void)tokens;
    (void)n;
    (void)last_only;
    return NO_CUDA("kdt_gpu_stage_prefill");
}

kdt_status kdt_gpu_stage_prefill_many(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_segments,
                                      const kdt_prefill_segment *segs, int32_t last_only) {
    (void)r;
    (void)c;
    (void)n_segments;
    (void)segs;
    (void)last_only;
    return NO_CUDA("kdt_gpu_stage_prefill_many");
}

kdt_status kdt_gpu_stage_decode(kdt_gpu_runner *r, kdt_gpu_kv *c, int32_t n_streams, const int32_t *stream_ids,
                                const int32_t *tokens) {
    (void)r;
    (void)c;
    (void)n_streams;
    (void)stream_ids;
    (void)tokens;
    return NO_CUDA("kdt_gpu_stage_decode");
}

kdt_status kdt_gpu_stage_verify(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *tree, const int32_t *stream_ids) {
    (void)r;
    (void)c;
    (void)tree;
    (void)stream_ids;
    return NO_CUDA("kdt_gpu_stage_verify");
}

kdt_status kdt_gpu_stage_verify_device(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_tree *d_tree,
                                       const int32_t *stream_ids, const int32_t *node_bound,
                                       const int32_t *depth_bound) {
    (void)r;
    (void)c;
    (void)d_tree;
    (void)stream_ids;
    (void)node_bound;
    (void)depth_bound;
    return NO_CUDA("kdt_gpu_stage_verify_device");
}

kdt_status kdt_gpu_run(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_gpu_run_config *rc) {
    (void)r;
    (void)c;
    (void)rc;
    return NO_CUDA("kdt_gpu_run");
}

kdt_status kdt_gpu_runner_outputs(kdt_gpu_runner *r, kdt_gpu_outputs *out) {
    (void)r;
    (void)out;
    return NO_CUDA("kdt_gpu_runner_outputs");
}

kdt_status kdt_gpu_graph_capture(kdt_gpu_runner *r, kdt_gpu_kv *c, const kdt_gpu_run_config *rc, kdt_gpu_graph **out) {
    (void)r;
    (void)c;
    (void)rc;
    (void)out;
    if (out)
        *out = NULL;
    return NO_CUDA("kdt_gpu_graph_capture");
}

kdt_status kdt_gpu_graph_launch(kdt_gpu_graph *g) {
    (void)g;
    return NO_CUDA("kdt_gpu_graph_launch");
}

void kdt_gpu_graph_free(kdt_gpu_graph *g) { (void)g; }

kdt_status kdt_gpu_runner_expert_counts(kdt_gpu_runner *r, int32_t layer, int32_t *counts) {
    (void)r;
    (void)layer;
    (void)counts;
    return NO_CUDA("kdt_gpu_runner_expert_counts");
}

kdt_status kdt_gpu_runner_flush_l2(kdt_gpu_runner *r) {
    (void)r;
    return NO_CUDA("kdt_gpu_runner_flush_l2");
}

const kdt_model_config *kdt_gpu_model_get_config(const kdt_gpu_model *g) {
    (void)g;
    return NULL;
}

void *kdt_gpu_runner_stream(kdt_gpu_runner *r) {
    (void)r;
    return NULL;
}

void kdt_gpu_row_padding(int32_t *first, int32_t *step) {
    if (first) *first = 1;
    if (step) *step = 1;
}

kdt_status kdt_gpu_runner_set_step_limit(kdt_gpu_runner *r, int32_t n_steps) {
    (void)r;
    (void)n_steps;
    return NO_CUDA("kdt_gpu_runner_set_step_limit");
}

int32_t kdt_gpu_runner_steps(const kdt_gpu_runner *r, const char **names, int32_t cap) {
    (void)r;
    (void)names;
    (void)cap;
    return 0;
}
