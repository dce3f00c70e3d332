// Launches, copies, allocations and the NVML process and utilisation queries, driven by commands
// on stdin, one per line, each answered with one line on stdout, for the monitoring tests
// (vgpu-smi reading the region, suspend/resume, nvidia-smi's view inside the container):
//     init                 -> init <status>                          cuInit(0)
//     ctx <ordinal>        -> ctx <status>                           retain the primary context, make it current
//     alloc <bytes>        -> alloc <status> <pointer>               cuMemAlloc_v2
//     free <pointer>       -> free <status>                          cuMemFree_v2
//     asyncfree <pointer>  -> asyncfree <status>                     cuMemFreeAsync on the legacy stream
//     reset <ordinal>      -> reset <status>                         cuDevicePrimaryCtxReset
//     load                 -> load <status>                          cuModuleLoadData + cuModuleGetFunction("busy_1000us")
//     launch <n>           -> launch <status> <milliseconds>         n launches of the kernel, then cuCtxSynchronize
//     copy <pointer>       -> copy <status> <milliseconds>           cuMemcpyHtoD_v2 of 4 bytes
//     call <name>          -> call <status> <milliseconds>           the entry point <name> (found with dlsym)
//                                                                    with eight null arguments; nosym if absent
//     procs <v> <index>    -> procs <status> <count> <pid>:<bytes>.. nvmlDeviceGetComputeRunningProcesses (v 1, 2, 3),
//                                                                    sized by a first call with a count of 0
//     graphics <index>     -> graphics <status> <count>              nvmlDeviceGetGraphicsRunningProcesses_v3, same way
//     util <index>         -> util <status> <gpu> <memory>           nvmlDeviceGetUtilizationRates
//     putil <index>        -> putil <status> <count> <pid>:<sm>..    nvmlDeviceGetProcessUtilization, sized by a
//                                                                    first call with a null buffer
//     churn <bytes> <ms>   -> churn <pairs> <refused>                cuMemAlloc_v2 + cuMemFree_v2 pairs for ms milliseconds
//     pid                  -> pid <getpid()>
//     exit <code>          -> (calls exit(code))
//     quit                 -> (returns from main)
// The legacy and _v2 process queries are only declared without the automatic upgrade to _v3.
#define NVML_NO_UNVERSIONED_FUNC_DEFS
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "commands.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

// The three versions of the compute query, printed the same way.
static void print_processes(const char *name, nvmlReturn_t status, unsigned count, const unsigned *pids,
                            const unsigned long long *bytes) {
    printf("%s %d %u", name, (int)status, count);
    for (unsigned i = 0; status == NVML_SUCCESS && i < count; i++) printf(" %u:%llu", pids[i], bytes[i]);
    printf("\n");
}

static void compute_processes(int version, unsigned index) {
    enum { MAX = 64 };
    unsigned pids[MAX];
    unsigned long long bytes[MAX];
    nvmlDevice_t device;
    unsigned count = 0;
    nvmlReturn_t status = nvml_device(index, &device);
    if (status != NVML_SUCCESS) {
        print_processes("procs", status, 0, pids, bytes);
        return;
    }
    if (version == 1) {
        nvmlProcessInfo_v1_t infos[MAX];
        status = nvmlDeviceGetComputeRunningProcesses(device, &count, NULL);
        if (status == NVML_ERROR_INSUFFICIENT_SIZE && count <= MAX)
            status = nvmlDeviceGetComputeRunningProcesses(device, &count, infos);
        for (unsigned i = 0; status == NVML_SUCCESS && i < count; i++) pids[i] = infos[i].pid, bytes[i] = infos[i].usedGpuMemory;
    } else {
        nvmlProcessInfo_v2_t infos[MAX];
        nvmlReturn_t (*query)(nvmlDevice_t, unsigned *, nvmlProcessInfo_v2_t *) =
            version == 2 ? nvmlDeviceGetComputeRunningProcesses_v2 : nvmlDeviceGetComputeRunningProcesses_v3;
        status = query(device, &count, NULL);
        if (status == NVML_ERROR_INSUFFICIENT_SIZE && count <= MAX) status = query(device, &count, infos);
        for (unsigned i = 0; status == NVML_SUCCESS && i < count; i++) pids[i] = infos[i].pid, bytes[i] = infos[i].usedGpuMemory;
    }
    print_processes("procs", status, count, pids, bytes);
}

int main(void) {
    char line[256];
    CUmodule module = NULL;
    CUfunction kernel = NULL;
    while (fgets(line, sizeof line, stdin)) {
        char command[32] = "";
        char arg[64] = "0";
        char arg2[64] = "0";
        if (sscanf(line, "%31s %63s %63s", command, arg, arg2) < 1) continue;
        unsigned long long number = strtoull(arg, NULL, 10);
        if (common_command(command, number)) {
            // answered
        } else if (strcmp(command, "load") == 0) {
            static const char image[] = "fake module";
            CUresult status = cuModuleLoadData(&module, image);
            if (status == CUDA_SUCCESS) status = cuModuleGetFunction(&kernel, module, "busy_1000us");
            printf("load %d\n", (int)status);
        } else if (strcmp(command, "launch") == 0) {
            double start = now_ms();
            CUresult status = CUDA_SUCCESS;
            for (unsigned long long i = 0; i < number && status == CUDA_SUCCESS; i++)
                status = cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            if (status == CUDA_SUCCESS) status = cuCtxSynchronize();
            printf("launch %d %.1f\n", (int)status, now_ms() - start);
        } else if (strcmp(command, "copy") == 0) {
            unsigned value = 42;
            double start = now_ms();
            CUresult status = cuMemcpyHtoD_v2((CUdeviceptr)number, &value, sizeof value);
            printf("copy %d %.1f\n", (int)status, now_ms() - start);
        } else if (strcmp(command, "call") == 0) {
            // Null arguments: the driver refuses them, but a suspended process waits first.
            typedef CUresult (*any_fn)(void *, void *, void *, void *, void *, void *, void *, void *);
            any_fn fn = (any_fn)dlsym(RTLD_DEFAULT, arg);
            if (!fn) {
                printf("call nosym 0\n");
            } else {
                double start = now_ms();
                CUresult status = fn(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
                printf("call %d %.1f\n", (int)status, now_ms() - start);
            }
        } else if (strcmp(command, "procs") == 0) {
            compute_processes((int)number, (unsigned)strtoul(arg2, NULL, 10));
        } else if (strcmp(command, "graphics") == 0) {
            nvmlDevice_t device;
            nvmlProcessInfo_v2_t infos[64];
            unsigned count = 0;
            nvmlReturn_t status = nvml_device((unsigned)number, &device);
            if (status == NVML_SUCCESS) status = nvmlDeviceGetGraphicsRunningProcesses_v3(device, &count, NULL);
            if (status == NVML_ERROR_INSUFFICIENT_SIZE && count <= 64)
                status = nvmlDeviceGetGraphicsRunningProcesses_v3(device, &count, infos);
            printf("graphics %d %u\n", (int)status, count);
        } else if (strcmp(command, "util") == 0) {
            nvmlDevice_t device;
            nvmlUtilization_t rates = {0, 0};
            nvmlReturn_t status = nvml_device((unsigned)number, &device);
            if (status == NVML_SUCCESS) status = nvmlDeviceGetUtilizationRates(device, &rates);
            printf("util %d %u %u\n", (int)status, rates.gpu, rates.memory);
        } else if (strcmp(command, "putil") == 0) {
            nvmlDevice_t device;
            nvmlProcessUtilizationSample_t samples[64];
            unsigned count = 0;
            nvmlReturn_t status = nvml_device((unsigned)number, &device);
            if (status == NVML_SUCCESS) status = nvmlDeviceGetProcessUtilization(device, NULL, &count, 0);
            if (status == NVML_ERROR_INSUFFICIENT_SIZE && count <= 64)
                status = nvmlDeviceGetProcessUtilization(device, samples, &count, 0);
            printf("putil %d %u", (int)status, count);
            for (unsigned i = 0; status == NVML_SUCCESS && i < count; i++) printf(" %u:%u", samples[i].pid, samples[i].smUtil);
            printf("\n");
        } else if (strcmp(command, "churn") == 0) {
            double end = now_ms() + strtod(arg2, NULL);
            unsigned long long pairs = 0, refused = 0;
            while (now_ms() < end) {
                for (int i = 0; i < 64; i++) {
                    CUdeviceptr p = 0;
                    if (cuMemAlloc_v2(&p, (size_t)number) == CUDA_SUCCESS) {
                        cuMemFree_v2(p);
                        pairs++;
                    } else {
                        refused++;
                    }
                }
            }
            printf("churn %llu %llu\n", pairs, refused);
        } else if (strcmp(command, "pid") == 0) {
            printf("pid %d\n", (int)getpid());
        } else if (strcmp(command, "quit") == 0) {
            break;
        } else {
            printf("unknown %s\n", command);
        }
        fflush(stdout);
    }
    return 0;
}
