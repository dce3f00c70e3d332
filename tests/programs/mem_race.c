// Random cuMemAlloc_v2 / cuMemFree_v2 traffic on device 0, for the race and kill-storm tests.
//     mem_race <seed> <duration ms> [barrier] [hold] [launch]
// Sets up cuInit and the primary context, prints "ready <init ns>", then (with `barrier`) waits
// for a line on stdin. Then allocates (1..32 MiB plus a few odd bytes, at most 8 held) and frees
// at random for the duration, or, with a duration of 0, until stdin becomes readable (a line or
// end of file); with `launch`, each allocation or free is followed by a launch of a 20 us fake
// kernel, and every 8th by a cuCtxSynchronize. Each call is timed with CLOCK_MONOTONIC. At the
// end it prints
//     done allocs=<n> refused=<n> frees=<n> errors=<n> max_wait_ns=<n> held=<bytes> ops=<n> launches=<n>
// (refused: CUDA_ERROR_OUT_OF_MEMORY; errors: any other failure; max_wait_ns: the longest call of
// any kind) and, with `hold`, waits for end of file on stdin before exiting. It never frees what
// it holds at exit: the memory of a process that ends is the region's and the driver's to reclaim.
#define _GNU_SOURCE
#include <cuda.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MIB (1024ull * 1024ull)
#define MAX_HELD 8

static unsigned long long rng;

static unsigned long long next_random(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

static int stdin_readable(void) {
    struct pollfd fd = {.fd = 0, .events = POLLIN};
    return poll(&fd, 1, 0) > 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: mem_race <seed> <duration ms> [barrier] [hold] [launch]\n");
        return 2;
    }
    rng = strtoull(argv[1], NULL, 10) * 0x9e3779b97f4a7c15ull + 1;
    unsigned long long duration_ns = strtoull(argv[2], NULL, 10) * 1000000ull;
    int barrier = 0, hold = 0, launch = 0;
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "barrier") == 0) barrier = 1;
        if (strcmp(argv[i], "hold") == 0) hold = 1;
        if (strcmp(argv[i], "launch") == 0) launch = 1;
    }
    char line[64];

    unsigned long long start = now_ns();
    CUdevice device = 0;
    CUcontext ctx = NULL;
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGet(&device, 0);
    if (status == CUDA_SUCCESS) status = cuDevicePrimaryCtxRetain(&ctx, device);
    if (status == CUDA_SUCCESS) status = cuCtxSetCurrent(ctx);
    CUmodule module = NULL;
    CUfunction kernel = NULL;
    if (launch && status == CUDA_SUCCESS) status = cuModuleLoadData(&module, "fake");
    if (launch && status == CUDA_SUCCESS) status = cuModuleGetFunction(&kernel, module, "busy_20us");
    if (status != CUDA_SUCCESS) {
        printf("setup-failed %d\n", (int)status);
        return 1;
    }
    printf("ready %llu\n", now_ns() - start);
    fflush(stdout);
    if (barrier && fgets(line, sizeof line, stdin) == NULL) return 1;

    CUdeviceptr held[MAX_HELD];
    size_t sizes[MAX_HELD];
    int count = 0;
    unsigned long long allocs = 0, refused = 0, frees = 0, errors = 0, max_wait = 0, ops = 0, launches = 0;
    unsigned long long begin = now_ns();
    for (;;) {
        if (duration_ns > 0 ? now_ns() - begin >= duration_ns : stdin_readable()) break;
        int allocate = count == 0 || (count < MAX_HELD && next_random() % 2 == 0);
        unsigned long long t0, wait;
        if (allocate) {
            size_t size = (size_t)((1 + next_random() % 32) * MIB + next_random() % 4096);
            CUdeviceptr p = 0;
            t0 = now_ns();
            status = cuMemAlloc_v2(&p, size);
            wait = now_ns() - t0;
            if (status == CUDA_SUCCESS) {
                held[count] = p;
                sizes[count] = size;
                count++;
                allocs++;
            } else if (status == CUDA_ERROR_OUT_OF_MEMORY) {
                refused++;
            } else {
                errors++;
            }
        } else {
            int index = (int)(next_random() % (unsigned long long)count);
            t0 = now_ns();
            status = cuMemFree_v2(held[index]);
            wait = now_ns() - t0;
            if (status == CUDA_SUCCESS) {
                frees++;
            } else {
                errors++;
            }
            count--;
            held[index] = held[count];
            sizes[index] = sizes[count];
        }
        if (wait > max_wait) max_wait = wait;
        ops++;
        if (launch) {
            t0 = now_ns();
            status = cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            if (status == CUDA_SUCCESS && ++launches % 8 == 0) status = cuCtxSynchronize();
            wait = now_ns() - t0;
            if (status != CUDA_SUCCESS) errors++;
            if (wait > max_wait) max_wait = wait;
        }
    }
    unsigned long long bytes = 0;
    for (int i = 0; i < count; i++) bytes += sizes[i];
    printf("done allocs=%llu refused=%llu frees=%llu errors=%llu max_wait_ns=%llu held=%llu ops=%llu launches=%llu\n",
           allocs, refused, frees, errors, max_wait, bytes, ops, launches);
    fflush(stdout);
    if (hold) {
        while (fgets(line, sizeof line, stdin) != NULL) {
        }
    }
    return 0;
}
