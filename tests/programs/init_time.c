// Prints how long cuInit took, in microseconds (for the start-up benchmarks):
//     init_time [hold seconds]
// prints "<status> <microseconds>"; with a hold, the process then sleeps that long before it
// exits (keeping its slot in the region, for a benchmark with many live processes).
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    CUresult status = cuInit(0);
    clock_gettime(CLOCK_MONOTONIC, &end);
    double micros = (end.tv_sec - start.tv_sec) * 1e6 + (end.tv_nsec - start.tv_nsec) / 1e3;
    printf("%d %.1f\n", (int)status, micros);
    fflush(stdout);
    if (argc > 1) sleep((unsigned)atoi(argv[1]));
    return status == CUDA_SUCCESS ? 0 : 1;
}
