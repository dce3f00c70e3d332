// Small-kernel workloads for the compute limit benchmark (tests/gpu/compute.sh).
//     compute_small small|graph <start_at unix s, 0 = now> <warm-up s> <measured s>
//     compute_small calibrate
// small: y = a*x + y on 64K floats, one launch after another on a stream. graph: the same 32
// launches captured into a CUDA graph, replayed. Both run (unmeasured) until start_at + warm-up,
// then count iterations (launches or replays) for the measured time, synchronise, and print
//     rate <iterations per second>
// calibrate: the GPU time of one small launch and of one graph replay, twice: when the GPU never
// waits for the host (work queued behind a spinning kernel: launches overlap), and alone (each on
// an idle GPU, timed with events while the stream is held until the launch is submitted, the
// median of many): a host-bound loop's kernels run alone. Printed as
//     small_ns <ns> graph_ns <ns> small_alone_ns <ns> graph_alone_ns <ns>
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <vector>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include "cuda_check.cuh"

#define N (1 << 16)
#define GRAPH_KERNELS 32

__global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

static double now_s(void) {
    struct timeval t;
    gettimeofday(&t, NULL);
    return t.tv_sec + t.tv_usec * 1e-6;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: compute_small small|graph <start_at> <warm-up s> <measured s> | calibrate\n");
        return 2;
    }
    const char *mode = argv[1];
    float *x, *y;
    cudaStream_t stream;
    CHECK(cudaMalloc(&x, N * sizeof(float)));
    CHECK(cudaMalloc(&y, N * sizeof(float)));
    CHECK(cudaMemset(x, 0, N * sizeof(float)));
    CHECK(cudaMemset(y, 0, N * sizeof(float)));
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    dim3 grid(N / 256), block(256);

    cudaGraphExec_t exec;
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < GRAPH_KERNELS; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));

    if (strcmp(mode, "calibrate") == 0) {
        cudaEvent_t e0, e1;
        CHECK(cudaEventCreate(&e0));
        CHECK(cudaEventCreate(&e1));
        float ms;
        const int launches = 4000, replays = 200;
        spin<<<1, 1, 0, stream>>>(200000000LL);  // ~100 ms at 2 GHz: the host queues meanwhile
        CHECK(cudaEventRecord(e0, stream));
        for (int i = 0; i < launches; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
        CHECK(cudaEventRecord(e1, stream));
        CHECK(cudaEventSynchronize(e1));
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        double small_ns = ms * 1e6 / launches;
        spin<<<1, 1, 0, stream>>>(200000000LL);
        CHECK(cudaEventRecord(e0, stream));
        for (int i = 0; i < replays; i++) CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaEventRecord(e1, stream));
        CHECK(cudaEventSynchronize(e1));
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        double graph_ns = ms * 1e6 / replays;
        // Alone: hold the stream on a mapped host word until the launch is in, then time it.
        unsigned *word;
        CHECK(cudaHostAlloc((void **)&word, 64, cudaHostAllocMapped | cudaHostAllocPortable));
        *(volatile unsigned *)word = 0;
        CUdeviceptr device_word;
        if (cuMemHostGetDevicePointer(&device_word, word, 0) != CUDA_SUCCESS) return 1;
        double alone[2];
        for (int what = 0; what < 2; what++) {
            std::vector<float> samples;
            for (unsigned i = 1; i <= 400; i++) {
                unsigned sequence = what * 1000 + i;
                if (cuStreamWaitValue32((CUstream)stream, device_word, sequence, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
                    return 1;
                CHECK(cudaEventRecord(e0, stream));
                if (what == 0) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
                else CHECK(cudaGraphLaunch(exec, stream));
                CHECK(cudaEventRecord(e1, stream));
                __atomic_store_n(word, sequence, __ATOMIC_RELEASE);
                CHECK(cudaEventSynchronize(e1));
                CHECK(cudaEventElapsedTime(&ms, e0, e1));
                samples.push_back(ms);
            }
            std::sort(samples.begin(), samples.end());
            alone[what] = samples[samples.size() / 2] * 1e6;
        }
        printf("small_ns %.1f graph_ns %.1f small_alone_ns %.1f graph_alone_ns %.1f\n", small_ns, graph_ns, alone[0],
               alone[1]);
        return 0;
    }
    if (argc < 5) return 2;
    int use_graph = strcmp(mode, "graph") == 0;
    double start_at = atof(argv[2]), warm_up = atof(argv[3]), measured = atof(argv[4]);
    if (start_at <= 0) start_at = now_s();
    double warm_end = start_at + warm_up;
    // Warm-up (and waiting for the other processes of a joint run).
    while (now_s() < warm_end) {
        for (int i = 0; i < 16; i++) {
            if (use_graph) CHECK(cudaGraphLaunch(exec, stream));
            else axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
        }
    }
    CHECK(cudaStreamSynchronize(stream));
    double t0 = now_s();
    long long iterations = 0;
    while (now_s() - t0 < measured) {
        for (int i = 0; i < 16; i++) {
            if (use_graph) CHECK(cudaGraphLaunch(exec, stream));
            else axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
        }
        iterations += 16;
    }
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaGetLastError());
    printf("rate %.1f\n", iterations / (now_s() - t0));
    return 0;
}
