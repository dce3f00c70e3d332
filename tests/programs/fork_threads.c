// Forks a threaded process again and again while its other threads allocate and free through the
// hook, so that the library's locks are often held at the moment of fork.
//     fork_threads <threads> <forks> <timeout ms>
// Sets up cuInit and the primary context of device 0, allocates 8 MiB that it holds to the end,
// starts <threads> threads that cuMemAlloc_v2 / cuMemFree_v2 1 MiB in a loop, then forks <forks>
// times from the main thread. Each child calls cuInit, cuMemGetInfo, allocates and frees 1 MiB,
// allocates 2 MiB that it keeps (its memory is the region's and the driver's to reclaim when it
// exits) and exits with 0, or with the number of the step that failed. The parent waits for each
// child at most <timeout ms>, kills one that did not finish, and prints
//     forks <n> completed <n> hung <n> failed <n> thread_errors <n> thread_ops <n>
// once the threads have stopped (all their memory freed). It then waits for end of file on stdin
// and exits without freeing its 8 MiB.
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024ull * 1024ull)
#define MAX_THREADS 64

static CUcontext ctx;
static atomic_int stop;
static atomic_ulong thread_errors;
static atomic_ulong thread_ops;

static void *churn(void *arg) {
    (void)arg;
    if (cuCtxSetCurrent(ctx) != CUDA_SUCCESS) {
        atomic_fetch_add(&thread_errors, 1);
        return NULL;
    }
    while (!atomic_load(&stop)) {
        CUdeviceptr pointer = 0;
        if (cuMemAlloc_v2(&pointer, MIB) != CUDA_SUCCESS || cuMemFree_v2(pointer) != CUDA_SUCCESS)
            atomic_fetch_add(&thread_errors, 1);
        atomic_fetch_add(&thread_ops, 1);
    }
    return NULL;
}

static void child(void) {
    size_t free_bytes = 0, total_bytes = 0;
    CUdeviceptr pointer = 0;
    if (cuInit(0) != CUDA_SUCCESS) _exit(1);
    if (cuMemGetInfo_v2(&free_bytes, &total_bytes) != CUDA_SUCCESS) _exit(2);
    if (cuMemAlloc_v2(&pointer, MIB) != CUDA_SUCCESS) _exit(3);
    if (cuMemFree_v2(pointer) != CUDA_SUCCESS) _exit(4);
    if (cuMemAlloc_v2(&pointer, 2 * MIB) != CUDA_SUCCESS) _exit(5);
    _exit(0);
}

/// 1: exited with 0; 0: exited otherwise; -1: still running after the timeout (then killed).
static int wait_for(pid_t pid, long timeout_ms) {
    struct timespec pause = {.tv_sec = 0, .tv_nsec = 1000000};
    for (long waited = 0; waited <= timeout_ms; waited++) {
        int status = 0;
        pid_t done = waitpid(pid, &status, WNOHANG);
        if (done == pid) return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 1 : 0;
        if (done < 0) return 0;
        nanosleep(&pause, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: fork_threads <threads> <forks> <timeout ms>\n");
        return 2;
    }
    int threads = atoi(argv[1]);
    int forks = atoi(argv[2]);
    long timeout_ms = atol(argv[3]);
    if (threads < 0 || threads > MAX_THREADS) threads = MAX_THREADS;

    CUdevice device = 0;
    CUdeviceptr held = 0;
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGet(&device, 0);
    if (status == CUDA_SUCCESS) status = cuDevicePrimaryCtxRetain(&ctx, device);
    if (status == CUDA_SUCCESS) status = cuCtxSetCurrent(ctx);
    if (status == CUDA_SUCCESS) status = cuMemAlloc_v2(&held, 8 * MIB);
    if (status != CUDA_SUCCESS) {
        printf("setup %d\n", (int)status);
        return 1;
    }

    pthread_t workers[MAX_THREADS];
    for (int i = 0; i < threads; i++) pthread_create(&workers[i], NULL, churn, NULL);
    // Let the threads get going before the first fork.
    while (atomic_load(&thread_ops) < 100 * (unsigned long)threads) sched_yield();

    int completed = 0, hung = 0, failed = 0;
    fflush(stdout);
    for (int i = 0; i < forks; i++) {
        pid_t pid = fork();
        if (pid == 0) child();
        if (pid < 0) {
            failed++;
            continue;
        }
        switch (wait_for(pid, timeout_ms)) {
        case 1: completed++; break;
        case 0: failed++; break;
        default: hung++; break;
        }
    }

    atomic_store(&stop, 1);
    for (int i = 0; i < threads; i++) pthread_join(workers[i], NULL);
    printf("forks %d completed %d hung %d failed %d thread_errors %lu thread_ops %lu\n", forks, completed, hung,
           failed, atomic_load(&thread_errors), atomic_load(&thread_ops));
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
    return 0;
}
