// How much device memory a CUDA context takes: NVML's used memory before and after creating the
// primary context (and after loading a module), so the memory accounting can charge contexts.
#include <cuda.h>
#include <nvml.h>
#include <stdio.h>

static unsigned long long used_bytes(nvmlDevice_t device) {
    nvmlMemory_t memory;
    return nvmlDeviceGetMemoryInfo(device, &memory) == NVML_SUCCESS ? memory.used : 0;
}

int main(void) {
    nvmlDevice_t nvml_device;
    CUdevice device;
    CUcontext context;
    if (nvmlInit_v2() || nvmlDeviceGetHandleByIndex_v2(0, &nvml_device)) { printf("nvml failed\n"); return 1; }
    unsigned long long before = used_bytes(nvml_device);
    if (cuInit(0) || cuDeviceGet(&device, 0)) { printf("cuInit failed\n"); return 1; }
    unsigned long long after_init = used_bytes(nvml_device);
    if (cuDevicePrimaryCtxRetain(&context, device) || cuCtxSetCurrent(context)) { printf("ctx failed\n"); return 1; }
    CUdeviceptr p;
    cuMemAlloc(&p, 1 << 20);  // some drivers defer part of the context until first use
    unsigned long long after_ctx = used_bytes(nvml_device);
    size_t free_bytes = 0, total_bytes = 0;
    cuMemGetInfo(&free_bytes, &total_bytes);
    printf("nvml_used_before_MiB %llu\n", before >> 20);
    printf("nvml_used_after_cuInit_MiB %llu\n", after_init >> 20);
    printf("nvml_used_after_primary_ctx_and_1MiB_MiB %llu\n", after_ctx >> 20);
    printf("context_cost_MiB %lld\n", ((long long)after_ctx - (long long)before - (1 << 20)) >> 20);
    printf("cuMemGetInfo_total_MiB %zu used_MiB %zu\n", total_bytes >> 20, (total_bytes - free_bytes) >> 20);
    return 0;
}
