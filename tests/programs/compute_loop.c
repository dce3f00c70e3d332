// Launches simulated kernels in a loop, for the compute limiter's tests.
//     compute_loop <path> <kernel> <seconds> [depth <n>] [sleep_us <n>] [stream] [fork]
// path: kernel (cuLaunchKernel), ptsz (cuLaunchKernel_ptsz on the per-thread stream), ex
// (cuLaunchKernelEx), coop (cuLaunchCooperativeKernel), graph (four launches of the kernel captured
// on a stream into a graph, replayed with cuGraphLaunch), legacy (cuLaunchGrid). kernel: a fake
// kernel name such as busy_2000us. The loop runs for <seconds>; after every <depth> launches (default
// 4) it synchronises, as a real application does, so work never queues up without bound; with
// sleep_us it sleeps that long after each launch (and synchronises after each), a low-demand job.
// With `stream` the launches go to a created stream, otherwise to the default stream. With `fork`
// the program forks halfway through; the child (no CUDA: a forked child cannot use the parent's
// contexts) sleeps 20 ms and exits with status 7 through exit() (its atexit handlers and the
// library's destructors run, as in a child that a Python or C++ program forks), and the parent goes
// on launching.
//
// Prints "ready" once set up, then at the end
//     done launches=<n> seconds=<s> launch_ns=<total ns inside launch calls> max_launch_ns=<n>
//          slow_launches=<launch calls over 1 ms> errors=<n> first_error=<status> child=<exit status or -1>
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

#define CHECK(call)                                                    \
    do {                                                               \
        CUresult status_ = (call);                                     \
        if (status_ != CUDA_SUCCESS) {                                 \
            printf("setup-failed %s %d\n", #call, (int)status_);       \
            return 1;                                                  \
        }                                                              \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: compute_loop <path> <kernel> <seconds> [depth <n>] [sleep_us <n>] [stream]\n");
        return 2;
    }
    const char *path = argv[1];
    const char *kernel_name = argv[2];
    double seconds = atof(argv[3]);
    int depth = 4, use_stream = 0, do_fork = 0;
    long sleep_us = 0;
    for (int i = 4; i < argc; i++) {
        if (strcmp(argv[i], "depth") == 0 && i + 1 < argc) depth = atoi(argv[++i]);
        else if (strcmp(argv[i], "sleep_us") == 0 && i + 1 < argc) sleep_us = atol(argv[++i]);
        else if (strcmp(argv[i], "stream") == 0) use_stream = 1;
        else if (strcmp(argv[i], "fork") == 0) do_fork = 1;
    }
    if (depth < 1) depth = 1;
    // The _ptsz entry points are only declared when the whole program is built for per-thread
    // streams; look them up by name (dlsym reaches the hook like any other caller).
    typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, CUstream, void **, void **);
    typedef CUresult (*sync_fn)(CUstream);
    launch_fn launch_ptsz = (launch_fn)dlsym(RTLD_DEFAULT, "cuLaunchKernel_ptsz");
    sync_fn sync_ptsz = (sync_fn)dlsym(RTLD_DEFAULT, "cuStreamSynchronize_ptsz");
    if (!launch_ptsz || !sync_ptsz) {
        printf("setup-failed dlsym\n");
        return 1;
    }

    CUdevice device;
    CUcontext context;
    CUmodule module;
    CUfunction kernel;
    CUstream stream = NULL;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&device, 0));
    CHECK(cuDevicePrimaryCtxRetain(&context, device));
    CHECK(cuCtxSetCurrent(context));
    CHECK(cuModuleLoadData(&module, "fake"));
    CHECK(cuModuleGetFunction(&kernel, module, kernel_name));
    int graph_path = strcmp(path, "graph") == 0;
    if (use_stream || graph_path) CHECK(cuStreamCreate(&stream, 0));

    CUgraphExec exec = NULL;
    if (graph_path) {
        // Launches into a capturing stream are recorded, not run: the limiter lets them through.
        CUgraph graph;
        CHECK(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < 4; i++) CHECK(cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL));
        CHECK(cuStreamEndCapture(stream, &graph));
        CHECK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    }
    printf("ready\n");
    fflush(stdout);

    CUlaunchConfig config;
    memset(&config, 0, sizeof config);
    config.gridDimX = config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = config.blockDimY = config.blockDimZ = 1;
    config.hStream = stream;

    unsigned long long launches = 0, errors = 0, slow = 0, inside = 0, longest = 0;
    int first_error = 0;
    unsigned long long start = now_ns(), deadline = start + (unsigned long long)(seconds * 1e9);
    pid_t child = -1;
    while (now_ns() < deadline) {
        if (do_fork && child < 0 && now_ns() - start > (deadline - start) / 2) {
            fflush(stdout);
            child = fork();
            if (child == 0) {
                usleep(20000);
                exit(7);
            }
        }
        unsigned long long t0 = now_ns();
        CUresult status;
        if (strcmp(path, "kernel") == 0)
            status = cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        else if (strcmp(path, "ptsz") == 0)
            status = launch_ptsz(kernel, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        else if (strcmp(path, "ex") == 0)
            status = cuLaunchKernelEx(&config, kernel, NULL, NULL);
        else if (strcmp(path, "coop") == 0)
            status = cuLaunchCooperativeKernel(kernel, 1, 1, 1, 1, 1, 1, 0, stream, NULL);
        else if (graph_path)
            status = cuGraphLaunch(exec, stream);
        else if (strcmp(path, "legacy") == 0) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
            status = cuLaunchGrid(kernel, 1, 1);
#pragma GCC diagnostic pop
        }
        else {
            fprintf(stderr, "unknown path %s\n", path);
            return 2;
        }
        unsigned long long took = now_ns() - t0;
        inside += took;
        if (took > longest) longest = took;
        if (took > 1000000) slow++;
        if (status != CUDA_SUCCESS) {
            if (errors++ == 0) first_error = (int)status;
        }
        launches++;
        if (sleep_us > 0 || launches % (unsigned long long)depth == 0) {
            if (strcmp(path, "ptsz") == 0) sync_ptsz(NULL);
            else if (stream) cuStreamSynchronize(stream);
            else cuCtxSynchronize();
        }
        if (sleep_us > 0) usleep((useconds_t)sleep_us);
    }
    double elapsed = (double)(now_ns() - start) / 1e9;
    int child_status = -1;
    if (child > 0) {
        int wstatus = 0;
        if (waitpid(child, &wstatus, 0) == child && WIFEXITED(wstatus)) child_status = WEXITSTATUS(wstatus);
    }
    printf("done launches=%llu seconds=%.3f launch_ns=%llu max_launch_ns=%llu slow_launches=%llu errors=%llu "
           "first_error=%d child=%d\n",
           launches, elapsed, inside, longest, slow, errors, first_error, child_status);
    return 0;
}
