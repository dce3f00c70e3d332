// Prints how long cuInit took, in microseconds (for the start-up benchmarks).
#include <cuda.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    CUresult status = cuInit(0);
    clock_gettime(CLOCK_MONOTONIC, &end);
    double micros = (end.tv_sec - start.tv_sec) * 1e6 + (end.tv_nsec - start.tv_nsec) / 1e3;
    printf("%d %.1f\n", (int)status, micros);
    return status == CUDA_SUCCESS ? 0 : 1;
}
