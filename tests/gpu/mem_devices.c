// Per CUDA device: the total the driver API reports, then 256 MiB allocations until refused;
// holds them for a few seconds (so the region can be read) and frees them.
// Prints: device <ordinal> uuid <uuid> total_MiB <n> free_MiB <n> allocated_MiB <n> status <s>
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int hold_seconds = argc > 1 ? atoi(argv[1]) : 3;
    int count = 0;
    if (cuInit(0) || cuDeviceGetCount(&count)) { printf("init failed\n"); return 1; }
    static CUdeviceptr blocks[16][256];
    int held[16] = {0};
    for (int ordinal = 0; ordinal < count && ordinal < 16; ordinal++) {
        CUdevice device;
        CUcontext context;
        CUuuid uuid;
        size_t total_mem = 0, free_bytes = 0, total_bytes = 0;
        cuDeviceGet(&device, ordinal);
        cuDeviceGetUuid(&uuid, device);
        cuDeviceTotalMem(&total_mem, device);
        cuDevicePrimaryCtxRetain(&context, device);
        cuCtxSetCurrent(context);
        cuMemGetInfo(&free_bytes, &total_bytes);
        CUresult status = CUDA_SUCCESS;
        while (held[ordinal] < 256 && (status = cuMemAlloc(&blocks[ordinal][held[ordinal]], 256u << 20)) == CUDA_SUCCESS)
            held[ordinal]++;
        unsigned char *u = (unsigned char *)uuid.bytes;
        printf("device %d uuid GPU-%02x%02x%02x%02x-... total_MiB %zu memgetinfo_total_MiB %zu free_MiB %zu allocated_MiB %d status %d\n",
               ordinal, u[0], u[1], u[2], u[3], total_mem >> 20, total_bytes >> 20, free_bytes >> 20, held[ordinal] * 256, (int)status);
    }
    printf("holding\n");
    fflush(stdout);
    sleep(hold_seconds);
    return 0;
}
