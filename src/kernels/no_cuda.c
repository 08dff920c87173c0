/* no_cuda.c - the CUDA launchers of kernels.h in a build without CUDA: each one says so. */
#include "common.h"
#include "kdtree/kernels.h"

#define KDT_NO_CUDA(name) \
    kdt_fail(KDT_ERR_NO_CUDA, "%s: this kdtree build has no CUDA support (rebuild with nvcc)", name)

size_t kdt_topk_workspace_bytes(int32_t n_rows, int32_t vocab, int32_t k) {
    (void)n_rows; (void)vocab; (void)k;
    return 0;
}
size_t kdt_verify_attn_workspace_bytes(int32_t n_streams, int32_t n_heads, int32_t max_nodes,
                                       int32_t max_prefix) {
    (void)n_streams; (void)n_heads; (void)max_nodes; (void)max_prefix;
    return 0;
}
kdt_status kdt_topk_logsoftmax_cuda(const kdt_topk_params *p, void *stream) {
    (void)p; (void)stream;
    return KDT_NO_CUDA("kdt_topk_logsoftmax_cuda");
}
kdt_status kdt_tree_build_cuda(const kdt_tree_build_params *p, kdt_tree *out, void *stream) {
    (void)p; (void)out; (void)stream;
    return KDT_NO_CUDA("kdt_tree_build_cuda");
}
kdt_status kdt_tree_accept_cuda(const kdt_tree_accept_params *p, void *stream) {
    (void)p; (void)stream;
    return KDT_NO_CUDA("kdt_tree_accept_cuda");
}
kdt_status kdt_kv_commit_cuda(const kdt_kv_commit_params *p, void *stream) {
    (void)p; (void)stream;
    return KDT_NO_CUDA("kdt_kv_commit_cuda");
}
kdt_status kdt_verify_attn_cuda(const kdt_verify_attn_params *p, void *stream) {
    (void)p; (void)stream;
    return KDT_NO_CUDA("kdt_verify_attn_cuda");
}

const char *kdt_verify_attn_cuda_path(void) { return "error: built without CUDA"; }
kdt_status kdt_verify_attn_cuda_profile(char *out, size_t cap) {
    (void)out, (void)cap;
    return KDT_NO_CUDA("kdt_verify_attn_cuda_profile");
}
