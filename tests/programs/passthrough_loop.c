// Calls one entry point N times for instruction counting under callgrind: count (cuDeviceGetCount,
// passthrough), launch (cuLaunchKernel, throttle handler), alloc (cuMemAlloc + cuMemFree of 1 MiB,
// charged), pooled (cuMemAllocAsync + cuMemFreeAsync of 1 MiB on the null stream, the device's
// pool), meminfo (cuMemGetInfo, virtual view).
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    long calls = argc > 1 ? atol(argv[1]) : 1000;
    const char *what = argc > 2 ? argv[2] : "count";
    int count = 0;
    if (cuInit(0) != CUDA_SUCCESS) return 1;
    if (what[0] == 'c') {
        for (long i = 0; i < calls; i++) cuDeviceGetCount(&count);
    } else if (what[0] == 'a' || what[0] == 'm' || what[0] == 'p') {
        CUdevice device;
        CUcontext context;
        cuDeviceGet(&device, 0);
        cuDevicePrimaryCtxRetain(&context, device);
        cuCtxSetCurrent(context);
        CUdeviceptr pointer;
        size_t free_bytes, total_bytes;
        if (what[0] == 'a')
            for (long i = 0; i < calls; i++) { cuMemAlloc(&pointer, 1 << 20); cuMemFree(pointer); }
        else if (what[0] == 'p')
            for (long i = 0; i < calls; i++) { cuMemAllocAsync(&pointer, 1 << 20, 0); cuMemFreeAsync(pointer, 0); }
        else
            for (long i = 0; i < calls; i++) cuMemGetInfo(&free_bytes, &total_bytes);
    } else {
        CUdevice device;
        CUcontext context;
        CUmodule module;
        CUfunction kernel;
        cuDeviceGet(&device, 0);
        cuDevicePrimaryCtxRetain(&context, device);
        cuCtxSetCurrent(context);
        cuModuleLoadData(&module, "fake");
        cuModuleGetFunction(&kernel, module, "busy_0us");
        for (long i = 0; i < calls; i++) cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, 0, NULL, NULL);
    }
    printf("%d\n", count);
    return 0;
}
