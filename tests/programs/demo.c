// The demo: what a CUDA application sees through libvgpu.so. Prints the device, the memory the
// driver reports, allocates 256 MiB blocks until the driver refuses, and launches a kernel.
#define _GNU_SOURCE
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                                       \
    do {                                                                                  \
        CUresult status_ = (call);                                                        \
        if (status_ != CUDA_SUCCESS) {                                                    \
            const char *text_ = NULL;                                                     \
            cuGetErrorName(status_, &text_);                                              \
            printf("%s failed: %s (%d)\n", #call, text_ ? text_ : "?", (int)status_);      \
            return 1;                                                                     \
        }                                                                                 \
    } while (0)

// An empty kernel in PTX, so the demo needs no compiler; the fake driver accepts any image.
static const char *ptx = ".version 7.0\n.target sm_52\n.address_size 64\n"
                         ".visible .entry busy_200us()\n{\n ret;\n}\n";

int main(void) {
    CUdevice device;
    CUcontext context;
    char name[128] = {0};
    size_t free_bytes = 0, total_bytes = 0, device_total = 0;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&device, 0));
    CHECK(cuDeviceGetName(name, sizeof name, device));
    CHECK(cuDeviceTotalMem(&device_total, device));
    CHECK(cuDevicePrimaryCtxRetain(&context, device));
    CHECK(cuCtxSetCurrent(context));
    CHECK(cuMemGetInfo(&free_bytes, &total_bytes));
    printf("device 0: %s\n", name);
    printf("cuDeviceTotalMem: %zu MiB\n", device_total >> 20);
    printf("cuMemGetInfo: free %zu MiB, total %zu MiB\n", free_bytes >> 20, total_bytes >> 20);

    enum { BLOCK = 256u << 20, MAX_BLOCKS = 64 };
    CUdeviceptr blocks[MAX_BLOCKS];
    int count = 0;
    CUresult status = CUDA_SUCCESS;
    while (count < MAX_BLOCKS && (status = cuMemAlloc(&blocks[count], BLOCK)) == CUDA_SUCCESS) count++;
    const char *why = NULL;
    cuGetErrorName(status, &why);
    printf("allocated %d blocks of 256 MiB (%d MiB) before %s\n", count, count * 256,
           status == CUDA_SUCCESS ? "the demo's own cap of 64 blocks" : (why ? why : "?"));
    for (int i = 0; i < count; i++) CHECK(cuMemFree(blocks[i]));

    CUmodule module;
    CUfunction kernel;
    CUevent start, stop;
    float milliseconds = 0;
    CHECK(cuModuleLoadData(&module, ptx));
    CHECK(cuModuleGetFunction(&kernel, module, "busy_200us"));
    CHECK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    CHECK(cuEventCreate(&stop, CU_EVENT_DEFAULT));
    CHECK(cuEventRecord(start, 0));
    for (int i = 0; i < 1000; i++) CHECK(cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, 0, NULL, NULL));
    CHECK(cuEventRecord(stop, 0));
    CHECK(cuEventSynchronize(stop));
    CHECK(cuEventElapsedTime(&milliseconds, start, stop));
    printf("1000 kernel launches: %.2f ms from the first to the last on the GPU\n", milliseconds);
    CHECK(cuModuleUnload(module));
    CHECK(cuDevicePrimaryCtxRelease(device));
    return 0;
}
