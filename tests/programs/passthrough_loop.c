// Calls a passthrough entry point (cuDeviceGetCount) and a launch (cuLaunchKernel, routed to the
// throttle handler) N times each, for instruction counting under callgrind.
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
