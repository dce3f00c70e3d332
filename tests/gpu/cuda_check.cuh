// Shared by the CUDA programs of tests/gpu/: the error check and the small kernel.
#pragma once
#include <cstdio>
#include <cstdlib>

// Any failed CUDA runtime call ends the program with its message (exit status 1).
#define CHECK(call)                                                         \
    do {                                                                    \
        cudaError_t e_ = (call);                                            \
        if (e_ != cudaSuccess) {                                            \
            fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));     \
            exit(1);                                                        \
        }                                                                   \
    } while (0)

// y = a*x + y on n floats: the small elementwise kernel of the benchmarks.
__global__ void axpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
