// Many threads of one process allocating and freeing at once, for the thread-storm test.
//     thread_storm <threads> <duration ms> <bytes>
// Sets up cuInit and the primary context, starts the threads, and releases them together; each
// makes the context current, then allocates `bytes` and frees it again until the duration has
// passed, timing every call with CLOCK_MONOTONIC. Then prints
//     done threads=<n> allocs=<n> refused=<n> errors=<n> longest_us=<n>
// (refused: CUDA_ERROR_OUT_OF_MEMORY; errors: any other failure; longest_us: the longest single
// call of any thread), or "failed <what> <status>" when setting up fails.
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static CUcontext context;
static unsigned long long duration_ns;
static size_t bytes;
static pthread_barrier_t start;
static pthread_mutex_t totals_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long allocs, refused, errors, longest_ns;

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

static void *storm(void *unused) {
    (void)unused;
    unsigned long long mine = 0, mine_refused = 0, mine_errors = 0, mine_longest = 0;
    if (cuCtxSetCurrent(context) != CUDA_SUCCESS) mine_errors++;
    pthread_barrier_wait(&start);
    unsigned long long end = now_ns() + duration_ns;
    while (now_ns() < end) {
        CUdeviceptr pointer = 0;
        unsigned long long before = now_ns();
        CUresult status = cuMemAlloc(&pointer, bytes);
        unsigned long long took = now_ns() - before;
        if (took > mine_longest) mine_longest = took;
        if (status == CUDA_ERROR_OUT_OF_MEMORY) {
            mine_refused++;
            continue;
        }
        if (status != CUDA_SUCCESS) {
            mine_errors++;
            continue;
        }
        mine++;
        before = now_ns();
        if (cuMemFree(pointer) != CUDA_SUCCESS) mine_errors++;
        took = now_ns() - before;
        if (took > mine_longest) mine_longest = took;
    }
    pthread_mutex_lock(&totals_lock);
    allocs += mine;
    refused += mine_refused;
    errors += mine_errors;
    if (mine_longest > longest_ns) longest_ns = mine_longest;
    pthread_mutex_unlock(&totals_lock);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: thread_storm <threads> <duration ms> <bytes>\n");
        return 2;
    }
    int threads = atoi(argv[1]);
    duration_ns = strtoull(argv[2], NULL, 10) * 1000000ull;
    bytes = (size_t)strtoull(argv[3], NULL, 10);
    if (threads < 1) {
        fprintf(stderr, "thread_storm: threads must be at least 1\n");
        return 2;
    }
    CUresult status = cuInit(0);
    if (status != CUDA_SUCCESS) {
        printf("failed cuInit %d\n", (int)status);
        return 1;
    }
    status = cuDevicePrimaryCtxRetain(&context, 0);
    if (status != CUDA_SUCCESS) {
        printf("failed cuDevicePrimaryCtxRetain %d\n", (int)status);
        return 1;
    }
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setstacksize(&attributes, 256 * 1024);
    for (int i = 0; i < threads; i++) {
        if (pthread_create(&ids[i], &attributes, storm, NULL) != 0) {
            printf("failed pthread_create %d\n", i);
            return 1;
        }
    }
    for (int i = 0; i < threads; i++) pthread_join(ids[i], NULL);
    printf("done threads=%d allocs=%llu refused=%llu errors=%llu longest_us=%llu\n", threads, allocs, refused,
           errors, longest_ns / 1000);
    return 0;
}
