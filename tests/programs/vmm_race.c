// VMM allocations freed by two threads at once, for the test that the library's charge goes when
// the memory does, whichever call comes last:
//     vmm_race <rounds>
// Sets up cuInit and the primary context. Each round creates 2 MiB on device 0, reserves a range
// and maps it there, then, by turns:
// - one thread calls cuMemRelease while another calls cuMemUnmap;
// - one thread retains the handle from the mapping and releases that reference while another
//   releases the create's, then the range is unmapped;
// - with the handle released, one thread unmaps the range while another maps a second allocation
//   at the same address as soon as the driver lets it, and releases that one's handle; then the
//   range is unmapped again;
// each pair released together by a barrier; then the range is freed. Prints
//     done rounds=<n> errors=<n>
// (errors: calls that failed), then waits for a line or end of file on stdin before exiting, so
// that the test can read the region while the process lives.
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BYTES (2ull * 1024ull * 1024ull)

struct round {
    pthread_barrier_t start;
    CUcontext context;
    CUmemGenericAllocationHandle handle;
    // The second allocation, mapped where the first was (the third way).
    CUmemGenericAllocationHandle second;
    CUdeviceptr va;
    int way;
    CUresult status;
};

static void *other_thread(void *arg) {
    struct round *round = arg;
    CUresult status = cuCtxSetCurrent(round->context);
    pthread_barrier_wait(&round->start);
    if (status != CUDA_SUCCESS) {
        round->status = status;
    } else if (round->way == 1) {
        CUmemGenericAllocationHandle retained = 0;
        status = cuMemRetainAllocationHandle(&retained, (void *)(uintptr_t)round->va);
        round->status = status == CUDA_SUCCESS ? cuMemRelease(retained) : status;
    } else if (round->way == 2) {
        // Until the other thread's unmap lets the address go (bounded: a lost race is an error).
        status = CUDA_ERROR_INVALID_VALUE;
        for (long tries = 0; tries < 100000000L && status != CUDA_SUCCESS; tries++) {
            status = cuMemMap(round->va, BYTES, 0, round->second, 0);
        }
        round->status = status == CUDA_SUCCESS ? cuMemRelease(round->second) : status;
    } else {
        round->status = cuMemUnmap(round->va, BYTES);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: vmm_race <rounds>\n");
        return 2;
    }
    int rounds = atoi(argv[1]);
    CUdevice device = 0;
    CUcontext context = NULL;
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGet(&device, 0);
    if (status == CUDA_SUCCESS) status = cuDevicePrimaryCtxRetain(&context, device);
    if (status == CUDA_SUCCESS) status = cuCtxSetCurrent(context);
    if (status != CUDA_SUCCESS) {
        printf("setup-failed %d\n", (int)status);
        return 1;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    int errors = 0;
    for (int i = 0; i < rounds; i++) {
        struct round round;
        memset(&round, 0, sizeof round);
        round.context = context;
        round.way = i % 3;
        if (cuMemCreate(&round.handle, BYTES, &prop, 0) != CUDA_SUCCESS ||
            cuMemAddressReserve(&round.va, BYTES, 0, 0, 0) != CUDA_SUCCESS ||
            cuMemMap(round.va, BYTES, 0, round.handle, 0) != CUDA_SUCCESS) {
            errors++;
            continue;
        }
        if (round.way == 2 &&
            (cuMemRelease(round.handle) != CUDA_SUCCESS || cuMemCreate(&round.second, BYTES, &prop, 0) != CUDA_SUCCESS)) {
            errors++;
            continue;
        }
        pthread_t thread;
        pthread_barrier_init(&round.start, NULL, 2);
        if (pthread_create(&thread, NULL, other_thread, &round) != 0) {
            printf("setup-failed pthread_create\n");
            return 1;
        }
        pthread_barrier_wait(&round.start);
        if (round.way == 2) {
            if (cuMemUnmap(round.va, BYTES) != CUDA_SUCCESS) errors++;
        } else if (cuMemRelease(round.handle) != CUDA_SUCCESS) {
            errors++;
        }
        pthread_join(thread, NULL);
        pthread_barrier_destroy(&round.start);
        if (round.status != CUDA_SUCCESS) errors++;
        if (round.way != 0 && cuMemUnmap(round.va, BYTES) != CUDA_SUCCESS) errors++;
        if (cuMemAddressFree(round.va, BYTES) != CUDA_SUCCESS) errors++;
    }
    printf("done rounds=%d errors=%d\n", rounds, errors);
    fflush(stdout);
    char line[16];
    if (fgets(line, sizeof line, stdin) == NULL) return 0;
    return 0;
}
