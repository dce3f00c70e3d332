// What a small kernel costs the GPU in a host-paced loop, by several ways of timing it with events
// (the experiment behind the limiter's sensor, docs/compute-limit.md). Run without the hook:
//     sensor_probe [extra host us per launch]
// The loop runs bursts of 64 launches of y = a*x + y on 64K floats (as a limited loop does: a
// burst, then a pause while the budget refills), each launch separated by the given host time
// (emulating the limiter's own cost). In each burst, launches 16 and 48 are timed:
//   held    the stream waits on a host word, then start event, launch, end event, release (the
//           limiter's sensor until now: the kernel alone, after the host submitted it)
//   open    start event, launch, end event, no hold; valid when the start event had not completed
//           when the end event was recorded (the GPU reached the launch after it was queued)
//   chain   the end event of the launch before and the end event of this one; valid when the one
//           before was still pending when this launch was submitted (no idle gap in between)
//   span    the end event of the launch before and this one's end event, whatever happened between
// and prints, per method, the median ns and the share of valid samples, with the loop's host
// period per launch (burst wall time / 64) and the unbroken rate of the same loop with no events.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <thread>
#include <vector>
#include "cuda_check.cuh"

#define N (1 << 16)
#define BURST 64
#define BURSTS 400

static double now_ns() {
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void spin_ns(double ns) {
    double until = now_ns() + ns;
    while (now_ns() < until) {
    }
}

static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv) {
    double extra_ns = argc > 1 ? atof(argv[1]) * 1e3 : 0;
    float *x, *y;
    cudaStream_t stream;
    CHECK(cudaMalloc(&x, N * sizeof(float)));
    CHECK(cudaMalloc(&y, N * sizeof(float)));
    CHECK(cudaMemset(x, 0, N * sizeof(float)));
    CHECK(cudaMemset(y, 0, N * sizeof(float)));
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    volatile unsigned *word;
    CHECK(cudaHostAlloc((void **)&word, 64, cudaHostAllocMapped | cudaHostAllocPortable));
    *word = 0;
    CUdeviceptr word_device;
    CHECK(cudaHostGetDevicePointer((void **)&word_device, (void *)word, 0));
    unsigned sequence = 0;
    dim3 grid(N / 256), block(256);
    cudaEvent_t events[4];
    for (auto &e : events) CHECK(cudaEventCreate(&e));

    for (int i = 0; i < 2000; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
    CHECK(cudaStreamSynchronize(stream));

    // The unbroken loop's rate, with the same host time between launches.
    int unbroken = 200000;
    double t0 = now_ns();
    for (int i = 0; i < unbroken; i++) {
        axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
        if (extra_ns > 0) spin_ns(extra_ns);
    }
    CHECK(cudaStreamSynchronize(stream));
    double unbroken_ns = (now_ns() - t0) / unbroken;

    const char *names[] = {"held", "open", "chain", "span"};
    std::vector<double> samples[4];
    int valid[4] = {0}, taken[4] = {0};
    std::vector<double> periods;
    for (int b = 0; b < BURSTS; b++) {
        int method = b % 4;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        double start = now_ns();
        for (int i = 0; i < BURST; i++) {
            bool sampled = (i == 16 || i == 48);
            bool before_sample = (i == 15 || i == 47);
            if (sampled && method == 0) {
                sequence++;
                if (cuStreamWaitValue32_v2((CUstream)stream, word_device, sequence, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
                    fprintf(stderr, "stream wait failed\n");
                    return 1;
                }
            }
            if (sampled && (method == 0 || method == 1)) CHECK(cudaEventRecord(events[0], stream));
            bool previous_pending = false;
            if (sampled && (method == 2 || method == 3)) previous_pending = cudaEventQuery(events[2]) == cudaErrorNotReady;
            axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, N);
            if (before_sample && (method == 2 || method == 3)) CHECK(cudaEventRecord(events[2], stream));
            if (sampled) {
                CHECK(cudaEventRecord(events[1], stream));
                bool ok = true;
                if (method == 0) *word = sequence;
                if (method == 1) ok = cudaEventQuery(events[0]) == cudaErrorNotReady;
                if (method == 2) ok = previous_pending;
                CHECK(cudaEventSynchronize(events[1]));
                float ms = 0;
                CHECK(cudaEventElapsedTime(&ms, events[method <= 1 ? 0 : 2], events[1]));
                taken[method]++;
                if (ok) {
                    valid[method]++;
                    samples[method].push_back(ms * 1e6);
                }
            }
            if (extra_ns > 0) spin_ns(extra_ns);
        }
        CHECK(cudaStreamSynchronize(stream));
        periods.push_back((now_ns() - start) / BURST);
    }
    printf("extra host time per launch %.2f us; unbroken loop %.2f us per launch; burst period %.2f us per launch (median, incl. 2 syncs)\n",
           extra_ns / 1e3, unbroken_ns / 1e3, median(periods) / 1e3);
    for (int m = 0; m < 4; m++) {
        printf("  %-6s median %.2f us, p10 %.2f, p90 %.2f, valid %d of %d\n", names[m], median(samples[m]) / 1e3,
               samples[m].empty() ? 0 : ([&] { auto v = samples[m]; std::sort(v.begin(), v.end()); return v[v.size() / 10]; }()) / 1e3,
               samples[m].empty() ? 0 : ([&] { auto v = samples[m]; std::sort(v.begin(), v.end()); return v[v.size() * 9 / 10]; }()) / 1e3,
               valid[m], taken[m]);
    }
    return 0;
}
