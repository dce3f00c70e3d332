// Jobs for the compute limiter's start-up tests, each timed from its first launch (no warm-up).
//
//     compute_jobs loop seconds=<s> kernels=<k> us=<d> per_iteration=<n> sync=<m> pause_us=<p> window_ms=<w> [alt_us=<a>]
//     compute_jobs graph seconds=<s> kernels=<k> us=<d> sync=<m> window_ms=<w>
//     compute_jobs devices launches=<n>[,<n1>...] us=<d> sync=<m>
//     compute_jobs streams seconds=<s> threads=<t> us=<d> sync=<m> window_ms=<w>
//     compute_jobs capture seconds=<s> us=<d> per_iteration=<n> [hold_us=<h> other_thread=1]
//
// Kernels are the fake driver's `busy_<d>us_<i>`, i = 0..k-1: k functions of d microseconds each
// (with alt_us, `busy_<d>us_alt_<a>us_<i>`: d and a microseconds by turns, launch by launch),
// each with its own name, so each has its own first launch (with FAKE_CUDA_MODULE_LOAD_US, CUDA's
// lazy loading, the one that loads it).
//
// loop: an iteration launches <n> kernels (cuLaunchKernel on the default stream, cycling through
// the k functions), synchronises (cuCtxSynchronize) after every <m> iterations, then sleeps <p>
// microseconds (host work; 0: none). Runs for <s> seconds from the first launch.
// graph: the k kernels, one launch each, captured once on a created stream into a graph; an
// iteration is one cuGraphLaunch of it, synchronised (cuStreamSynchronize) every <m> replays.
// Both print, for each whole window of <w> ms from the first launch (the time just before the
// first launch call), what completed in it:
//     window index=<i> iterations=<n> launches=<kernels launched, a replay counting k>
// then
//     done iterations=<n> launches=<n> seconds=<from the first launch> max_launch_ns=<longest launch
//          call> slow_launches=<launch calls of 10 ms or more> errors=<n> first_error=<status>
//
// devices: one thread per device (FAKE_CUDA_DEVICES), each on its device's primary context with
// its own module, launching busy_<d>us <n> times on the default stream (device i: the i-th number
// of the list, the last one for the devices beyond it), synchronising every <m>; the threads start
// together (a barrier after set-up). Each prints
//     device index=<i> launches=<n> seconds=<from its first launch to its last synchronisation>
//          max_launch_ns=<n> slow_launches=<n> errors=<n> first_error=<status>
//
// capture: on a created stream, an iteration launches busy_<d>us <n> times, then captures two more
// launches of it on the same stream into a graph (begin, launch, launch, end: a graph captured
// while earlier work is queued, as a framework warming up then capturing does), destroys the graph
// and synchronises; for <s> seconds. With hold_us, the capture stays open that long after its two
// launches (a framework capturing a model's many kernels); with other_thread=1, a second thread
// launches busy_<d>us on a stream of its own all the while, never synchronising until the end (it
// stays in the default capture mode, global, and makes no call a capture forbids: the library's
// calls on that thread must not make one either; run it with a limit, which paces its launches).
// Prints
//     done iterations=<n> errors=<failed captured launches> captures_failed=<failed ends>
//          first_error=<status of the first failure of either> other_launches=<n> other_errors=<n>
//          other_mode_after=<the other thread's capture mode at its end; -1 without it>
//
// streams: <t> threads (at most 16), each with a stream of its own (created non-blocking), launch
// busy_<d>us back to back on it, synchronising their stream every <m> launches, for <s> seconds
// from the first launch (the threads start together). The fake runs the streams' kernels side by
// side, as a GPU runs kernels of several streams. Prints the launches of all threads per window
// (as loop does, iterations being launches) and the done line, launches summed.
//
// A failed set-up call prints "setup-failed <call> <status>" and exits with 1.
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#define MAX_KERNELS 64
#define MAX_WINDOWS 1024
#define MAX_DEVICES 16
/// A launch call this long is a lazy load (or a long wait of the limiter).
#define SLOW_NS 10000000ull

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

static void pause_us(long us) {
    if (us <= 0) return;
    struct timespec t = {us / 1000000, (us % 1000000) * 1000};
    while (clock_nanosleep(CLOCK_MONOTONIC, 0, &t, &t) != 0) {
    }
}

#define CHECK(call)                                                    \
    do {                                                               \
        CUresult status_ = (call);                                     \
        if (status_ != CUDA_SUCCESS) {                                 \
            printf("setup-failed %s %d\n", #call, (int)status_);       \
            fflush(stdout);                                            \
            exit(1);                                                   \
        }                                                              \
    } while (0)

/// The text after `key=` among the arguments, or NULL.
static const char *arg_text(int argc, char **argv, const char *key) {
    size_t len = strlen(key);
    for (int i = 2; i < argc; i++)
        if (strncmp(argv[i], key, len) == 0 && argv[i][len] == '=') return argv[i] + len + 1;
    return NULL;
}

/// The value of `key=` among the arguments, or `fallback`.
static double arg(int argc, char **argv, const char *key, double fallback) {
    const char *text = arg_text(argc, argv, key);
    return text ? atof(text) : fallback;
}

/// The `index`-th number of the comma list after `key=` (the last one beyond the list's end).
static int arg_list(int argc, char **argv, const char *key, int index, int fallback) {
    const char *text = arg_text(argc, argv, key);
    int value = fallback;
    for (int i = 0; text && i <= index; i++) {
        value = atoi(text);
        text = strchr(text, ',');
        if (text) text++;
    }
    return value;
}

struct Tally {
    unsigned long long launches, errors, longest, slow;
    int first_error;
};

static void count(struct Tally *tally, CUresult status, unsigned long long took) {
    tally->launches++;
    if (took > tally->longest) tally->longest = took;
    if (took >= SLOW_NS) tally->slow++;
    if (status != CUDA_SUCCESS && tally->errors++ == 0) tally->first_error = (int)status;
}

/// Makes device `index`'s primary context current on this thread and loads the fake's module.
static CUmodule open_device(int index) {
    CUdevice device;
    CUcontext context;
    CUmodule module;
    CHECK(cuDeviceGet(&device, index));
    CHECK(cuDevicePrimaryCtxRetain(&context, device));
    CHECK(cuCtxSetCurrent(context));
    CHECK(cuModuleLoadData(&module, "fake"));
    return module;
}

/// loop and graph: iterations until <seconds> from the first launch, counted by window.
static int windows_job(int argc, char **argv, int graph_mode) {
    double seconds = arg(argc, argv, "seconds", 3);
    int kernels = (int)arg(argc, argv, "kernels", 8);
    int us = (int)arg(argc, argv, "us", 20);
    int alt_us = (int)arg(argc, argv, "alt_us", 0);
    int per_iteration = (int)arg(argc, argv, "per_iteration", 1);
    int sync = (int)arg(argc, argv, "sync", 1);
    long pause = (long)arg(argc, argv, "pause_us", 0);
    double window_ms = arg(argc, argv, "window_ms", 250);
    if (kernels < 1 || kernels > MAX_KERNELS || us < 1 || per_iteration < 1 || sync < 1 || window_ms <= 0) {
        fprintf(stderr, "compute_jobs: bad arguments\n");
        return 2;
    }
    int windows = (int)(seconds * 1000.0 / window_ms + 1e-9);
    if (windows > MAX_WINDOWS) windows = MAX_WINDOWS;

    CUfunction functions[MAX_KERNELS];
    CUstream stream = NULL;
    CUgraphExec exec = NULL;
    CHECK(cuInit(0));
    CUmodule module = open_device(0);
    for (int i = 0; i < kernels; i++) {
        char name[64];
        if (alt_us > 0)
            snprintf(name, sizeof name, "busy_%dus_alt_%dus_%d", us, alt_us, i);
        else
            snprintf(name, sizeof name, "busy_%dus_%d", us, i);
        CHECK(cuModuleGetFunction(&functions[i], module, name));
    }
    if (graph_mode) {
        // The capture is the kernels' first launch (their lazy load, not run); the graph's first
        // replay uploads it.
        CUgraph graph;
        CHECK(cuStreamCreate(&stream, 0));
        CHECK(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < kernels; i++)
            CHECK(cuLaunchKernel(functions[i], 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL));
        CHECK(cuStreamEndCapture(stream, &graph));
        CHECK(cuGraphInstantiateWithFlags(&exec, graph, 0));
        per_iteration = 1;
    }

    static unsigned long long window_iterations[MAX_WINDOWS], window_launches[MAX_WINDOWS];
    struct Tally tally = {0, 0, 0, 0, 0};
    unsigned long long iterations = 0, next = 0;
    unsigned long long start = now_ns(), deadline = start + (unsigned long long)(seconds * 1e9);
    unsigned long long window_ns = (unsigned long long)(window_ms * 1e6);
    for (unsigned long long now = start; now < deadline; now = now_ns()) {
        unsigned long long launched = 0;
        for (int i = 0; i < per_iteration; i++) {
            unsigned long long t0 = now_ns();
            CUresult status = graph_mode ? cuGraphLaunch(exec, stream)
                                         : cuLaunchKernel(functions[next++ % (unsigned long long)kernels], 1, 1, 1,
                                                          1, 1, 1, 0, NULL, NULL, NULL);
            count(&tally, status, now_ns() - t0);
            launched += graph_mode ? (unsigned long long)kernels : 1;
        }
        iterations++;
        if (iterations % (unsigned long long)sync == 0) {
            if (graph_mode) CHECK(cuStreamSynchronize(stream));
            else CHECK(cuCtxSynchronize());
        }
        unsigned long long window = (now_ns() - start) / window_ns;
        if (window < (unsigned long long)windows) {
            window_iterations[window]++;
            window_launches[window] += launched;
        }
        pause_us(pause);
    }
    if (graph_mode) CHECK(cuStreamSynchronize(stream));
    else CHECK(cuCtxSynchronize());
    double elapsed = (double)(now_ns() - start) / 1e9;
    for (int i = 0; i < windows; i++)
        printf("window index=%d iterations=%llu launches=%llu\n", i, window_iterations[i], window_launches[i]);
    printf("done iterations=%llu launches=%llu seconds=%.6f max_launch_ns=%llu slow_launches=%llu errors=%llu "
           "first_error=%d\n",
           iterations, graph_mode ? iterations * (unsigned long long)kernels : tally.launches, elapsed,
           tally.longest, tally.slow, tally.errors, tally.first_error);
    return 0;
}

struct DeviceJob {
    int index, launches, us, sync;
    pthread_barrier_t *barrier;
    struct Tally tally;
    double seconds;
};

static void *device_thread(void *argument) {
    struct DeviceJob *job = argument;
    CUfunction function;
    char name[64];
    snprintf(name, sizeof name, "busy_%dus", job->us);
    CHECK(cuModuleGetFunction(&function, open_device(job->index), name));
    pthread_barrier_wait(job->barrier);
    unsigned long long start = now_ns();
    for (int i = 1; i <= job->launches; i++) {
        unsigned long long t0 = now_ns();
        CUresult status = cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        count(&job->tally, status, now_ns() - t0);
        if (i % job->sync == 0 || i == job->launches) CHECK(cuCtxSynchronize());
    }
    job->seconds = (double)(now_ns() - start) / 1e9;
    return NULL;
}

static int devices_job(int argc, char **argv) {
    int us = (int)arg(argc, argv, "us", 1000);
    int sync = (int)arg(argc, argv, "sync", 4);
    int devices = 0;
    CHECK(cuInit(0));
    CHECK(cuDeviceGetCount(&devices));
    if (devices > MAX_DEVICES) devices = MAX_DEVICES;
    for (int i = 0; i < devices; i++) {
        if (arg_list(argc, argv, "launches", i, 500) < 1 || us < 1 || sync < 1) {
            fprintf(stderr, "compute_jobs: bad arguments\n");
            return 2;
        }
    }
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, (unsigned)devices);
    static struct DeviceJob jobs[MAX_DEVICES];
    pthread_t threads[MAX_DEVICES];
    for (int i = 0; i < devices; i++) {
        int launches = arg_list(argc, argv, "launches", i, 500);
        jobs[i] = (struct DeviceJob){i, launches, us, sync, &barrier, {0, 0, 0, 0, 0}, 0};
        pthread_create(&threads[i], NULL, device_thread, &jobs[i]);
    }
    for (int i = 0; i < devices; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < devices; i++)
        printf("device index=%d launches=%llu seconds=%.6f max_launch_ns=%llu slow_launches=%llu errors=%llu "
               "first_error=%d\n",
               i, jobs[i].tally.launches, jobs[i].seconds, jobs[i].tally.longest, jobs[i].tally.slow,
               jobs[i].tally.errors, jobs[i].tally.first_error);
    return 0;
}

struct OtherThread {
    CUcontext context;
    CUfunction function;
    atomic_int stop;
    unsigned long long launches, errors;
    int mode_after;
};

/// capture's other thread: launches on its own stream until told to stop.
static void *other_thread(void *argument) {
    struct OtherThread *other = argument;
    CUstream stream;
    CHECK(cuCtxSetCurrent(other->context));
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    while (!atomic_load(&other->stop)) {
        if (cuLaunchKernel(other->function, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL) != CUDA_SUCCESS) other->errors++;
        other->launches++;
    }
    CHECK(cuStreamSynchronize(stream));
    CHECK(cuStreamDestroy(stream));
    // The thread's capture mode after all its launches: still the default, global.
    CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
    CHECK(cuThreadExchangeStreamCaptureMode(&mode));
    other->mode_after = (int)mode;
    return NULL;
}

/// capture: queued launches, then a capture on the same stream, over and over.
static int capture_job(int argc, char **argv) {
    double seconds = arg(argc, argv, "seconds", 2);
    int us = (int)arg(argc, argv, "us", 20), per_iteration = (int)arg(argc, argv, "per_iteration", 2);
    CUfunction function;
    CUstream stream;
    char name[64];
    snprintf(name, sizeof name, "busy_%dus", us);
    CHECK(cuInit(0));
    CHECK(cuModuleGetFunction(&function, open_device(0), name));
    CHECK(cuStreamCreate(&stream, 0));
    long hold = (long)arg(argc, argv, "hold_us", 0);
    struct OtherThread other = {NULL, function, 0, 0, 0, -1};
    pthread_t other_id;
    int with_other = arg(argc, argv, "other_thread", 0) != 0;
    if (with_other) {
        CHECK(cuCtxGetCurrent(&other.context));
        if (pthread_create(&other_id, NULL, other_thread, &other) != 0) {
            fprintf(stderr, "setup-failed pthread_create\n");
            return 1;
        }
    }
    unsigned long long iterations = 0, errors = 0, failed = 0;
    int first_error = 0;
    unsigned long long deadline = now_ns() + (unsigned long long)(seconds * 1e9);
    while (now_ns() < deadline) {
        for (int i = 0; i < per_iteration; i++)
            CHECK(cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL));
        CUgraph graph = NULL;
        CHECK(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
        for (int i = 0; i < 2; i++) {
            CUresult status = cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
            if (status != CUDA_SUCCESS && errors++ + failed == 0) first_error = (int)status;
        }
        pause_us(hold);
        CUresult end = cuStreamEndCapture(stream, &graph);
        if (end != CUDA_SUCCESS && failed++ + errors == 0) first_error = (int)end;
        if (graph) CHECK(cuGraphDestroy(graph));
        CHECK(cuStreamSynchronize(stream));
        iterations++;
    }
    if (with_other) {
        atomic_store(&other.stop, 1);
        pthread_join(other_id, NULL);
    }
    printf("done iterations=%llu errors=%llu captures_failed=%llu first_error=%d other_launches=%llu "
           "other_errors=%llu other_mode_after=%d\n",
           iterations, errors, failed, first_error, other.launches, other.errors, other.mode_after);
    return 0;
}

struct StreamJob {
    CUcontext context;
    CUfunction function;
    int sync;
    unsigned long long duration_ns, window_ns;
    int windows;
    pthread_barrier_t *barrier;
    struct Tally tally;
};

static _Atomic unsigned long long stream_window_launches[MAX_WINDOWS];
static _Atomic unsigned long long streams_start;

static void *stream_thread(void *argument) {
    struct StreamJob *job = argument;
    CUstream stream;
    CHECK(cuCtxSetCurrent(job->context));
    CHECK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
    pthread_barrier_wait(job->barrier);
    unsigned long long expected = 0, first = now_ns();
    atomic_compare_exchange_strong(&streams_start, &expected, first);
    unsigned long long start = atomic_load(&streams_start);
    unsigned long long deadline = start + job->duration_ns;
    for (unsigned long long launches = 1, now = first; now < deadline; launches++, now = now_ns()) {
        unsigned long long t0 = now_ns();
        CUresult status = cuLaunchKernel(job->function, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        count(&job->tally, status, now_ns() - t0);
        if (launches % (unsigned long long)job->sync == 0) CHECK(cuStreamSynchronize(stream));
        unsigned long long window = (now_ns() - start) / job->window_ns;
        if (window < (unsigned long long)job->windows) atomic_fetch_add(&stream_window_launches[window], 1);
    }
    CHECK(cuStreamSynchronize(stream));
    CHECK(cuStreamDestroy(stream));
    return NULL;
}

static int streams_job(int argc, char **argv) {
    double seconds = arg(argc, argv, "seconds", 3);
    int threads = (int)arg(argc, argv, "threads", 4);
    int us = (int)arg(argc, argv, "us", 200);
    int sync = (int)arg(argc, argv, "sync", 8);
    double window_ms = arg(argc, argv, "window_ms", 250);
    if (threads < 1 || threads > 16 || us < 1 || sync < 1 || window_ms <= 0) {
        fprintf(stderr, "compute_jobs: bad arguments\n");
        return 2;
    }
    int windows = (int)(seconds * 1000.0 / window_ms + 1e-9);
    if (windows > MAX_WINDOWS) windows = MAX_WINDOWS;
    CHECK(cuInit(0));
    CUmodule module = open_device(0);
    CUcontext context;
    CHECK(cuCtxGetCurrent(&context));
    CUfunction function;
    char name[64];
    snprintf(name, sizeof name, "busy_%dus", us);
    CHECK(cuModuleGetFunction(&function, module, name));
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, (unsigned)threads);
    static struct StreamJob jobs[16];
    pthread_t handles[16];
    for (int i = 0; i < threads; i++) {
        jobs[i] = (struct StreamJob){context, function, sync, (unsigned long long)(seconds * 1e9),
                                     (unsigned long long)(window_ms * 1e6), windows, &barrier, {0, 0, 0, 0, 0}};
        pthread_create(&handles[i], NULL, stream_thread, &jobs[i]);
    }
    struct Tally total = {0, 0, 0, 0, 0};
    for (int i = 0; i < threads; i++) {
        pthread_join(handles[i], NULL);
        total.launches += jobs[i].tally.launches;
        total.errors += jobs[i].tally.errors;
        total.slow += jobs[i].tally.slow;
        if (jobs[i].tally.longest > total.longest) total.longest = jobs[i].tally.longest;
        if (!total.first_error) total.first_error = jobs[i].tally.first_error;
    }
    double elapsed = (double)(now_ns() - atomic_load(&streams_start)) / 1e9;
    for (int i = 0; i < windows; i++)
        printf("window index=%d iterations=%llu launches=%llu\n", i, atomic_load(&stream_window_launches[i]),
               atomic_load(&stream_window_launches[i]));
    printf("done iterations=%llu launches=%llu seconds=%.6f max_launch_ns=%llu slow_launches=%llu errors=%llu "
           "first_error=%d\n",
           total.launches, total.launches, elapsed, total.longest, total.slow, total.errors, total.first_error);
    return 0;
}

int main(int argc, char **argv) {
    // Host pauses as exact as the kernel allows (the default slack adds 50 us to each).
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    if (argc >= 2 && strcmp(argv[1], "loop") == 0) return windows_job(argc, argv, 0);
    if (argc >= 2 && strcmp(argv[1], "graph") == 0) return windows_job(argc, argv, 1);
    if (argc >= 2 && strcmp(argv[1], "devices") == 0) return devices_job(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "capture") == 0) return capture_job(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "streams") == 0) return streams_job(argc, argv);
    fprintf(stderr, "usage: compute_jobs loop|graph|devices|capture|streams key=value...\n");
    return 2;
}
