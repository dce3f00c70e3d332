// Shared by the stdin-driven test programs (mem_ops.c, monitor_launch.c): the NVML handle and
// the commands both answer, each with one line on stdout.
#pragma once
#include <cuda.h>
#include <nvml.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// NVML initialised on first use, then the handle of the device at this index.
static inline nvmlReturn_t nvml_device(unsigned index, nvmlDevice_t *device) {
    static int initialised = 0;
    if (!initialised) {
        nvmlReturn_t status = nvmlInit_v2();
        if (status != NVML_SUCCESS) return status;
        initialised = 1;
    }
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

// init, ctx <ordinal>, alloc <bytes>, free <pointer>, asyncfree <pointer> (on the legacy stream)
// and reset <ordinal> (the primary context): answered, and 1 returned; exit <code>:
// calls exit() (atexit handlers and destructors run; "quit" returns from main instead); 0 for any
// other command.
static inline int common_command(const char *command, unsigned long long number) {
    if (strcmp(command, "init") == 0) {
        printf("init %d\n", (int)cuInit(0));
    } else if (strcmp(command, "ctx") == 0) {
        CUdevice device = 0;
        CUcontext ctx = NULL;
        CUresult status = cuDeviceGet(&device, (int)number);
        if (status == CUDA_SUCCESS) status = cuDevicePrimaryCtxRetain(&ctx, device);
        if (status == CUDA_SUCCESS) status = cuCtxSetCurrent(ctx);
        printf("ctx %d\n", (int)status);
    } else if (strcmp(command, "alloc") == 0) {
        CUdeviceptr p = 0;
        CUresult status = cuMemAlloc_v2(&p, (size_t)number);
        printf("alloc %d %llu\n", (int)status, (unsigned long long)p);
    } else if (strcmp(command, "free") == 0) {
        printf("free %d\n", (int)cuMemFree_v2((CUdeviceptr)number));
    } else if (strcmp(command, "asyncfree") == 0) {
        printf("asyncfree %d\n", (int)cuMemFreeAsync((CUdeviceptr)number, 0));
    } else if (strcmp(command, "reset") == 0) {
        printf("reset %d\n", (int)cuDevicePrimaryCtxReset((CUdevice)number));
    } else if (strcmp(command, "exit") == 0) {
        fflush(stdout);
        exit((int)number);
    } else {
        return 0;
    }
    return 1;
}
