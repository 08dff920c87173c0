/* kernel_ops.c - the kernel tables the round calls through (engine_internal.h). The CPU table
 * wraps the plain-C twins; the CUDA table points at the launchers, which take the same parameter
 * structs with device pointers, so a GPU round swaps tables and buffers, not code. */
#include "engine_internal.h"

static kdt_status topk_cpu(const kdt_topk_params *p, void *stream) {
    (void)stream;
    return kdt_topk_logsoftmax_cpu(p);
}
static kdt_status build_cpu(const kdt_tree_build_params *p, kdt_tree *out, void *stream) {
    (void)stream;
    return kdt_tree_build_cpu(p, out);
}
static kdt_status accept_cpu(const kdt_tree_accept_params *p, void *stream) {
    (void)stream;
    return kdt_tree_accept_cpu(p);
}
static kdt_status commit_cpu(const kdt_kv_commit_params *p, void *stream) {
    (void)stream;
    return kdt_kv_commit_cpu(p);
}

const kdt_engine_kernels kdt_engine_kernels_cpu = {"cpu", topk_cpu, build_cpu, accept_cpu, commit_cpu};

const kdt_engine_kernels kdt_engine_kernels_cuda = {"cuda", kdt_topk_logsoftmax_cuda,
                                                    kdt_tree_build_cuda, kdt_tree_accept_cuda,
                                                    kdt_kv_commit_cuda};
