/* gpu_test_util.h - what every GPU test shares: CUDA_OK aborts the test with the failing call
 * and CUDA's message (a GPU test cannot go on after a CUDA error). */
#ifndef KDT_GPU_TEST_UTIL_H
#define KDT_GPU_TEST_UTIL_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#endif
