// What the limiter's event bracket reads for a launch queued behind others (a busy stream) and for
// one on a drained stream, against the launch's time when kernels run back to back unbracketed.
// Run without the hook:
//     bracket_probe
// For kernels of y = a*x + y on 64K to 64M floats, the stream is kept full (the host runs ahead;
// one sync per 2048 launches) and:
//   bare      2048 launches timed by one event pair: the time per launch with nothing between them
//             (the kernel's time when the host is faster than the GPU; "host" says how long the
//             host took per launch: where it is not well below bare, the stream was not full)
//   held      the same, every 16th launch bracketed as the sensor does it (a wait on a host word,
//             start event, launch, end event, the word written): the per-launch time of the whole
//             run, and the median of the brackets' readings
//   shallow   groups of 10 launches synchronised after each (as the Triton and GEMM jobs of
//             compute_jobs.py run), the 6th of each group bracketed the same way: a few kernels
//             queued ahead of it
//   drained   a launch bracketed the same way after the stream ran empty (200 us of host pause)
// and prints, per size, bare, held and host per launch, the bracket medians, what a bracket reads
// over the bare time on a full stream, a shallow queue and a drained stream (the sensor's
// overheads), and what bracketing costs the run per bracket.
// Then, for two sizes, what a bracket reads over the bare time by how many launches were submitted
// ahead of it on a drained stream (depth) and whether launches follow it (after: 0 or 4), each the
// median of 60 rounds: how deep a queue must be for the full stream's overhead.
// Last, on a full stream as above, what a bracket reads over the bare time by how many launches
// apart the brackets are (stride), with the sensor's hold and with events alone: whether it is
// the queue or the brackets' own density that a full stream's reading depends on.
// And what a bracket reads by where it sits in a full stream of 2048 launches (position; near the
// end the host has long finished submitting when the GPU reaches it), and after 512 queued
// launches followed by 0 or 512 more, each round with its own events: whether it is the
// host's submissions while the bracket runs that it depends on.
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <thread>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include "cuda_check.cuh"

#define LAUNCHES 2048
#define STRIDE 16
#define ROUNDS 5

static double now_ns() {
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// The sensor's bracket: the stream waits on the host word, then the start event; after the launch,
// the end event, then the word is written (the hold released).
struct Bracket {
    cudaStream_t stream;
    volatile unsigned *word;
    CUdeviceptr word_device;
    unsigned sequence;

    void begin(cudaEvent_t start) {
        sequence++;
        if (cuStreamWaitValue32_v2((CUstream)stream, word_device, sequence, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
            fprintf(stderr, "stream wait failed\n");
            exit(1);
        }
        CHECK(cudaEventRecord(start, stream));
    }

    void end(cudaEvent_t stop) {
        CHECK(cudaEventRecord(stop, stream));
        *word = sequence;
    }
};

static double elapsed_ns(cudaEvent_t start, cudaEvent_t stop) {
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e6;
}

int main() {
    const int sizes[] = {1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26};
    float *x, *y;
    CHECK(cudaMalloc(&x, (size_t(1) << 26) * sizeof(float)));
    CHECK(cudaMalloc(&y, (size_t(1) << 26) * sizeof(float)));
    CHECK(cudaMemset(x, 0, (size_t(1) << 26) * sizeof(float)));
    CHECK(cudaMemset(y, 0, (size_t(1) << 26) * sizeof(float)));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    Bracket bracket{stream, nullptr, 0, 0};
    CHECK(cudaHostAlloc((void **)&bracket.word, 64, cudaHostAllocMapped | cudaHostAllocPortable));
    *bracket.word = 0;
    CHECK(cudaHostGetDevicePointer((void **)&bracket.word_device, (void *)bracket.word, 0));
    cudaEvent_t outer[2];
    for (auto &e : outer) CHECK(cudaEventCreate(&e));
    std::vector<cudaEvent_t> events(2 * (LAUNCHES / STRIDE));
    for (auto &e : events) CHECK(cudaEventCreate(&e));

    printf("%-9s %9s %9s %9s %11s %11s %11s %12s %12s %12s %12s\n", "floats", "bare us", "held us", "host us", "full us",
           "shallow us", "drained us", "full-bare", "shallow-bare", "drained-bare", "cost/bracket");
    for (int n : sizes) {
        dim3 grid((n + 255) / 256), block(256);
        for (int i = 0; i < 256; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
        CHECK(cudaStreamSynchronize(stream));
        std::vector<double> bare, held, readings, drained, host;
        for (int r = 0; r < ROUNDS; r++) {
            for (int mode = 0; mode < 2; mode++) {
                CHECK(cudaEventRecord(outer[0], stream));
                int taken = 0;
                double host_start = now_ns();
                for (int i = 0; i < LAUNCHES; i++) {
                    bool sampled = mode == 1 && i % STRIDE == STRIDE / 2;
                    if (sampled) bracket.begin(events[2 * taken]);
                    axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                    if (sampled) bracket.end(events[2 * taken++ + 1]);
                }
                CHECK(cudaEventRecord(outer[1], stream));
                host.push_back((now_ns() - host_start) / LAUNCHES);
                CHECK(cudaStreamSynchronize(stream));
                (mode == 0 ? bare : held).push_back(elapsed_ns(outer[0], outer[1]) / LAUNCHES);
                for (int t = 0; t < taken; t++) readings.push_back(elapsed_ns(events[2 * t], events[2 * t + 1]));
            }
        }
        // Groups of 10 synchronised launches, the 6th bracketed.
        std::vector<double> shallow;
        for (int g = 0; g < 200; g++) {
            for (int i = 0; i < 10; i++) {
                if (i == 5) bracket.begin(events[0]);
                axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                if (i == 5) bracket.end(events[1]);
            }
            CHECK(cudaStreamSynchronize(stream));
            shallow.push_back(elapsed_ns(events[0], events[1]));
        }
        // Launches on a drained stream: a host pause, then one bracketed launch.
        for (int i = 0; i < 64; i++) {
            std::this_thread::sleep_for(std::chrono::microseconds(200));
            bracket.begin(events[0]);
            axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
            bracket.end(events[1]);
            CHECK(cudaStreamSynchronize(stream));
            drained.push_back(elapsed_ns(events[0], events[1]));
        }
        double b = median(bare), h = median(held), k = median(readings), d = median(drained), c = median(host);
        double q = median(shallow);
        printf("%-9d %9.2f %9.2f %9.2f %11.2f %11.2f %11.2f %12.2f %12.2f %12.2f %12.2f\n", n, b / 1e3, h / 1e3, c / 1e3,
               k / 1e3, q / 1e3, d / 1e3, (k - b) / 1e3, (q - b) / 1e3, (d - b) / 1e3, (h - b) * STRIDE / 1e3);
    }
    printf("\n%-9s %6s %12s %12s\n", "floats", "depth", "after 0 -bare", "after 4 -bare");
    const int depth_sizes[] = {1 << 22, 1 << 24};
    const int depths[] = {0, 1, 2, 3, 5, 8, 16, 32, 128, 512};
    for (int n : depth_sizes) {
        dim3 grid((n + 255) / 256), block(256);
        CHECK(cudaEventRecord(outer[0], stream));
        for (int i = 0; i < LAUNCHES; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
        CHECK(cudaEventRecord(outer[1], stream));
        CHECK(cudaStreamSynchronize(stream));
        double b = elapsed_ns(outer[0], outer[1]) / LAUNCHES;
        for (int depth : depths) {
            double over[2];
            for (int after = 0; after < 2; after++) {
                std::vector<double> readings;
                for (int r = 0; r < 60; r++) {
                    for (int i = 0; i < depth; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                    bracket.begin(events[0]);
                    axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                    bracket.end(events[1]);
                    for (int i = 0; i < 4 * after; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                    CHECK(cudaStreamSynchronize(stream));
                    readings.push_back(elapsed_ns(events[0], events[1]));
                }
                over[after] = (median(readings) - b) / 1e3;
            }
            printf("%-9d %6d %12.2f %12.2f\n", n, depth, over[0], over[1]);
        }
    }
    printf("\n%-9s %6s %12s %12s\n", "floats", "stride", "held -bare", "events -bare");
    const int strides[] = {4, 16, 64, 256, 1024};
    for (int n : depth_sizes) {
        dim3 grid((n + 255) / 256), block(256);
        CHECK(cudaEventRecord(outer[0], stream));
        for (int i = 0; i < LAUNCHES; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
        CHECK(cudaEventRecord(outer[1], stream));
        CHECK(cudaStreamSynchronize(stream));
        double b = elapsed_ns(outer[0], outer[1]) / LAUNCHES;
        for (int stride : strides) {
            double over[2];
            for (int with_hold = 1; with_hold >= 0; with_hold--) {
                std::vector<double> readings;
                for (int r = 0; r < 2; r++) {
                    int taken = 0;
                    for (int i = 0; i < LAUNCHES && taken < (int)events.size() / 2; i++) {
                        bool sampled = i % stride == stride / 2;
                        if (sampled && with_hold) bracket.begin(events[2 * taken]);
                        if (sampled && !with_hold) CHECK(cudaEventRecord(events[2 * taken], stream));
                        axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                        if (sampled && with_hold) bracket.end(events[2 * taken++ + 1]);
                        if (sampled && !with_hold) CHECK(cudaEventRecord(events[2 * taken++ + 1], stream));
                    }
                    CHECK(cudaStreamSynchronize(stream));
                    for (int t = 0; t < taken; t++) readings.push_back(elapsed_ns(events[2 * t], events[2 * t + 1]));
                }
                over[1 - with_hold] = (median(readings) - b) / 1e3;
            }
            printf("%-9d %6d %12.2f %12.2f\n", n, stride, over[0], over[1]);
        }
    }
    printf("\n%-9s %9s %12s\n", "floats", "position", "held -bare");
    const int positions[] = {8, 256, 512, 1024, 1536, 1900, 2000, 2040};
    for (int n : depth_sizes) {
        dim3 grid((n + 255) / 256), block(256);
        CHECK(cudaEventRecord(outer[0], stream));
        for (int i = 0; i < LAUNCHES; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
        CHECK(cudaEventRecord(outer[1], stream));
        CHECK(cudaStreamSynchronize(stream));
        double b = elapsed_ns(outer[0], outer[1]) / LAUNCHES;
        std::vector<std::vector<double>> readings(8);
        for (int r = 0; r < 12; r++) {
            int taken = 0;
            for (int i = 0; i < LAUNCHES; i++) {
                bool sampled = taken < 8 && i == positions[taken];
                if (sampled) bracket.begin(events[2 * (8 * r + taken)]);
                axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                if (sampled) bracket.end(events[2 * (8 * r + taken++) + 1]);
            }
            CHECK(cudaStreamSynchronize(stream));
            for (int t = 0; t < 8; t++)
                readings[t].push_back(elapsed_ns(events[2 * (8 * r + t)], events[2 * (8 * r + t) + 1]));
        }
        for (int t = 0; t < 8; t++) printf("%-9d %9d %12.2f\n", n, positions[t], (median(readings[t]) - b) / 1e3);
        for (int after : {0, 512}) {
            std::vector<double> fresh;
            for (int r = 0; r < 60 && 2 * r + 1 < (int)events.size(); r++) {
                for (int i = 0; i < 512; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                bracket.begin(events[2 * r]);
                axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                bracket.end(events[2 * r + 1]);
                for (int i = 0; i < after; i++) axpy<<<grid, block, 0, stream>>>(1.0001f, x, y, n);
                CHECK(cudaStreamSynchronize(stream));
                fresh.push_back(elapsed_ns(events[2 * r], events[2 * r + 1]));
            }
            printf("%-9d depth 512, after %3d, fresh events: %6.2f\n", n, after, (median(fresh) - b) / 1e3);
        }
    }
    return 0;
}
