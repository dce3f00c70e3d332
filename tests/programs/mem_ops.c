// Memory calls driven by commands on stdin, one per line, each answered with one line on stdout,
// for the memory tests that interleave calls with reads of the shared region:
//     init                 -> init <status>                       cuInit(0)
//     ctx <ordinal>        -> ctx <status>                        retain the primary context, make it current
//     alloc <bytes>        -> alloc <status> <pointer>            cuMemAlloc_v2
//     allocnull <bytes>    -> allocnull <status>                  cuMemAlloc_v2 with a null out-pointer
//     free <pointer>       -> free <status>                       cuMemFree_v2
//     asyncfree <pointer>  -> asyncfree <status>                  cuMemFreeAsync on the legacy stream
//     reset <ordinal>      -> reset <status>                      cuDevicePrimaryCtxReset
//     info                 -> info <status> <free> <total>        cuMemGetInfo_v2
//     infop <mask>         -> infop <status> <free> <total>       cuMemGetInfo_v2, an output passed only
//                                                                 where the mask has its bit (1 free, 2
//                                                                 total; an output not passed prints 0)
//     info1p <mask>        -> info1p <status> <free> <total>      the same with the legacy 32-bit cuMemGetInfo
//     totalmem <ordinal>   -> totalmem <status> <bytes>           cuDeviceTotalMem_v2
//     mipmap <levels>      -> mipmap <status> <handle>            cuMipmappedArrayCreate, 1024 x 1024 float4
//     mipmapfree <handle>  -> mipmapfree <status>                 cuMipmappedArrayDestroy
//     nvml <index>         -> nvml <status> <total> <used> <free> nvmlDeviceGetMemoryInfo
//     nvml2 <index>        -> nvml2 <status> <total> <used> <free> nvmlDeviceGetMemoryInfo_v2
//     nvml2bad <index>     -> nvml2bad <status>                   _v2 with a wrong struct version
//     umask                -> umask <octal>                       the process's umask
//     signals              -> signals <hex mask>                  signals whose handler is not SIG_DFL
//     forkexit <bytes>     -> forkexit <code> <child pid>         fork; the child allocates <bytes> with
//                                                                 cuMemAlloc_v2, keeps them and calls exit(0)
//                                                                 (3 when the allocation failed); the parent
//                                                                 waits for it (code -1: it did not exit)
//     capture <mode>       -> capture <status>                    cuStreamBeginCapture_v2 on the program's own
//                                                                 stream (made on first use, non-blocking)
//     capalloc <bytes>     -> capalloc <status> <pointer>         cuMemAllocAsync on that stream
//     capfree <pointer>    -> capfree <status>                    cuMemFreeAsync on that stream
//     capquery             -> capquery <status>                   cuStreamQuery of that stream (refused while
//                                                                 it captures, which invalidates the capture)
//     endcapture           -> endcapture <status> <graph>         cuStreamEndCapture of that stream
//     graphdestroy <graph> -> graphdestroy <status>               cuGraphDestroy
//     capgraph <bytes>     -> capgraph <status> <exec>            as PyTorch's cudaMallocAsync backend does: a
//                                                                 global capture that allocates and frees <bytes>,
//                                                                 instantiated, the graph destroyed, the instance
//                                                                 launched (not synchronised)
//     otherasync <bytes>   -> otherasync <status> <status>        another thread, in its default capture mode,
//                                                                 with the context current: cuMemAllocAsync and
//                                                                 cuMemFreeAsync on a stream of its own
//     vmm <bytes>          -> vmm <status> <handle>               cuMemCreate of pinned memory on the current
//                                                                 context's device
//     vmmxla <bytes>       -> vmmxla <status> <handle>            the same with the properties XLA's allocator
//                                                                 asks for: GPUDirect RDMA, POSIX fd and fabric
//                                                                 handles
//     vmmrelease <handle>  -> vmmrelease <status>                 cuMemRelease
//     vmmmap <handle>      -> vmmmap <status> <pointer>           an address range of the handle's size
//                                                                 reserved, the handle mapped there and
//                                                                 read-write access given to the device
//     vmmunmap <pointer>   -> vmmunmap <status>                   cuMemUnmap of that mapping, then
//                                                                 cuMemAddressFree of its range
//     vmmretain <pointer>  -> vmmretain <status> <handle>         cuMemRetainAllocationHandle
//     vmmmapfirst <handle> -> vmmmapfirst <status> <pointer>      as vmmmap, the handle's first granule alone
//     vmmoffset <bytes>    -> vmmoffset 0                         the next vmmmap maps the handle from this
//                                                                 offset to its end (past its end: one
//                                                                 granule there)
//     vmmfree <pointer>    -> vmmfree <status>                    cuMemAddressFree of a vmmmap's range, with
//                                                                 no unmap before it
//     vmmexport <handle>   -> vmmexport <status>                  cuMemExportToShareableHandle, a POSIX fd
//     mode                 -> mode <status> <mode>                this thread's capture interaction mode
//                                                                 (cuThreadExchangeStreamCaptureMode, twice)
//     exit <code>          -> (calls exit(code))
//     quit                 -> (returns from main)
// Numbers are decimal; sizes go through strtoull, so 18446744073709551615 is SIZE_MAX.
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <nvml.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "commands.h"

// The stream the capture commands use, made on first use.
static CUstream capture_stream(void) {
    static CUstream stream = NULL;
    if (stream == NULL && cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) stream = NULL;
    return stream;
}

// Sizes of the handles `vmm` made and of the ranges `vmmmap` mapped, for the commands that take
// only a handle or a pointer; the offset the next `vmmmap` maps from.
#define VMM_SLOTS 64
static struct { unsigned long long key; size_t size; } vmm_sizes[VMM_SLOTS];
static size_t vmm_offset;

static void vmm_remember(unsigned long long key, size_t size) {
    for (int i = 0; i < VMM_SLOTS; i++) {
        if (vmm_sizes[i].key == 0 || vmm_sizes[i].key == key) {
            vmm_sizes[i].key = key;
            vmm_sizes[i].size = size;
            return;
        }
    }
}

static size_t vmm_size(unsigned long long key) {
    for (int i = 0; i < VMM_SLOTS; i++) {
        if (vmm_sizes[i].key == key) return vmm_sizes[i].size;
    }
    return 0;
}

// Pinned memory on the current context's device, as `vmm` and `vmmmapfirst` ask for it.
static CUresult pinned_on_current_device(CUmemAllocationProp *prop) {
    CUdevice device = 0;
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    CUresult status = cuCtxGetDevice(&device);
    prop->location.id = device;
    return status;
}

struct other_async {
    CUcontext context;
    size_t bytes;
    CUresult alloc_status;
    CUresult free_status;
};

static void *other_async_thread(void *arg) {
    struct other_async *job = arg;
    CUstream stream = NULL;
    CUdeviceptr p = 0;
    job->alloc_status = cuCtxSetCurrent(job->context);
    if (job->alloc_status == CUDA_SUCCESS) job->alloc_status = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
    if (job->alloc_status == CUDA_SUCCESS) job->alloc_status = cuMemAllocAsync(&p, job->bytes, stream);
    job->free_status = job->alloc_status == CUDA_SUCCESS ? cuMemFreeAsync(p, stream) : CUDA_ERROR_INVALID_VALUE;
    if (stream != NULL) cuStreamDestroy(stream);
    return NULL;
}

int main(void) {
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        char command[32] = "";
        char arg[128] = "0";
        if (sscanf(line, "%31s %127s", command, arg) < 1) continue;
        unsigned long long number = strtoull(arg, NULL, 10);
        if (common_command(command, number)) {
            // answered
        } else if (strcmp(command, "vmm") == 0 || strcmp(command, "vmmxla") == 0) {
            CUmemGenericAllocationHandle handle = 0;
            CUmemAllocationProp prop;
            CUresult status = pinned_on_current_device(&prop);
            if (strcmp(command, "vmmxla") == 0) {
                prop.allocFlags.gpuDirectRDMACapable = 1;
                prop.requestedHandleTypes =
                    (CUmemAllocationHandleType)(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
            }
            if (status == CUDA_SUCCESS) status = cuMemCreate(&handle, (size_t)number, &prop, 0);
            if (status == CUDA_SUCCESS) vmm_remember((unsigned long long)handle, (size_t)number);
            printf("%s %d %llu\n", command, (int)status, (unsigned long long)handle);
        } else if (strcmp(command, "vmmoffset") == 0) {
            vmm_offset = (size_t)number;
            printf("vmmoffset 0\n");
        } else if (strcmp(command, "vmmfree") == 0) {
            printf("vmmfree %d\n", (int)cuMemAddressFree((CUdeviceptr)number, vmm_size(number)));
        } else if (strcmp(command, "vmmmap") == 0) {
            size_t whole = vmm_size(number);
            size_t offset = vmm_offset;
            size_t size = offset < whole ? whole - offset : 2u << 20;
            CUdevice device = 0;
            CUdeviceptr p = 0;
            vmm_offset = 0;
            CUresult status = cuCtxGetDevice(&device);
            if (status == CUDA_SUCCESS) status = cuMemAddressReserve(&p, size, 0, 0, 0);
            if (status == CUDA_SUCCESS) status = cuMemMap(p, size, offset, (CUmemGenericAllocationHandle)number, 0);
            if (status == CUDA_SUCCESS) {
                CUmemAccessDesc access;
                memset(&access, 0, sizeof access);
                access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
                access.location.id = device;
                access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                status = cuMemSetAccess(p, size, &access, 1);
            }
            if (status == CUDA_SUCCESS) vmm_remember((unsigned long long)p, size);
            printf("vmmmap %d %llu\n", (int)status, (unsigned long long)p);
        } else if (strcmp(command, "vmmmapfirst") == 0) {
            CUdeviceptr p = 0;
            size_t granule = 0;
            CUmemAllocationProp prop;
            CUresult status = pinned_on_current_device(&prop);
            if (status == CUDA_SUCCESS)
                status = cuMemGetAllocationGranularity(&granule, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
            if (status == CUDA_SUCCESS) status = cuMemAddressReserve(&p, granule, 0, 0, 0);
            if (status == CUDA_SUCCESS) status = cuMemMap(p, granule, 0, (CUmemGenericAllocationHandle)number, 0);
            if (status == CUDA_SUCCESS) vmm_remember((unsigned long long)p, granule);
            printf("vmmmapfirst %d %llu\n", (int)status, (unsigned long long)p);
        } else if (strcmp(command, "vmmexport") == 0) {
            int fd = -1;
            CUresult status = cuMemExportToShareableHandle(&fd, (CUmemGenericAllocationHandle)number,
                                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            if (status == CUDA_SUCCESS) close(fd);
            printf("vmmexport %d\n", (int)status);
        } else if (strcmp(command, "vmmunmap") == 0) {
            size_t size = vmm_size(number);
            CUresult status = cuMemUnmap((CUdeviceptr)number, size);
            if (status == CUDA_SUCCESS) status = cuMemAddressFree((CUdeviceptr)number, size);
            printf("vmmunmap %d\n", (int)status);
        } else if (strcmp(command, "vmmretain") == 0) {
            CUmemGenericAllocationHandle handle = 0;
            CUresult status = cuMemRetainAllocationHandle(&handle, (void *)(uintptr_t)number);
            printf("vmmretain %d %llu\n", (int)status, (unsigned long long)handle);
        } else if (strcmp(command, "vmmrelease") == 0) {
            printf("vmmrelease %d\n", (int)cuMemRelease((CUmemGenericAllocationHandle)number));
        } else if (strcmp(command, "asyncalloc") == 0) {
            CUdeviceptr p = 0;
            CUresult status = cuMemAllocAsync(&p, (size_t)number, 0);
            printf("asyncalloc %d %llu\n", (int)status, (unsigned long long)p);
        } else if (strcmp(command, "capture") == 0) {
            printf("capture %d\n", (int)cuStreamBeginCapture_v2(capture_stream(), (CUstreamCaptureMode)number));
        } else if (strcmp(command, "capalloc") == 0) {
            CUdeviceptr p = 0;
            CUresult status = cuMemAllocAsync(&p, (size_t)number, capture_stream());
            printf("capalloc %d %llu\n", (int)status, (unsigned long long)p);
        } else if (strcmp(command, "capfree") == 0) {
            printf("capfree %d\n", (int)cuMemFreeAsync((CUdeviceptr)number, capture_stream()));
        } else if (strcmp(command, "capquery") == 0) {
            printf("capquery %d\n", (int)cuStreamQuery(capture_stream()));
        } else if (strcmp(command, "endcapture") == 0) {
            CUgraph graph = NULL;
            CUresult status = cuStreamEndCapture(capture_stream(), &graph);
            printf("endcapture %d %llu\n", (int)status, (unsigned long long)(uintptr_t)graph);
        } else if (strcmp(command, "graphdestroy") == 0) {
            printf("graphdestroy %d\n", (int)cuGraphDestroy((CUgraph)(uintptr_t)number));
        } else if (strcmp(command, "capgraph") == 0) {
            CUstream stream = capture_stream();
            CUdeviceptr p = 0;
            CUgraph graph = NULL;
            CUgraphExec exec = NULL;
            CUresult status = cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
            if (status == CUDA_SUCCESS) status = cuMemAllocAsync(&p, (size_t)number, stream);
            if (status == CUDA_SUCCESS) status = cuMemFreeAsync(p, stream);
            CUresult ended = cuStreamEndCapture(stream, &graph);
            if (status == CUDA_SUCCESS) status = ended;
            if (status == CUDA_SUCCESS) status = cuGraphInstantiateWithFlags(&exec, graph, 0);
            if (graph != NULL) cuGraphDestroy(graph);
            if (status == CUDA_SUCCESS) status = cuGraphLaunch(exec, stream);
            printf("capgraph %d %llu\n", (int)status, (unsigned long long)(uintptr_t)exec);
        } else if (strcmp(command, "mode") == 0) {
            CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
            CUresult status = cuThreadExchangeStreamCaptureMode(&mode);
            CUstreamCaptureMode back = mode;
            if (status == CUDA_SUCCESS) status = cuThreadExchangeStreamCaptureMode(&back);
            printf("mode %d %d\n", (int)status, (int)mode);
        } else if (strcmp(command, "otherasync") == 0) {
            struct other_async job = {NULL, (size_t)number, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE};
            pthread_t thread;
            if (cuCtxGetCurrent(&job.context) == CUDA_SUCCESS &&
                pthread_create(&thread, NULL, other_async_thread, &job) == 0) {
                pthread_join(thread, NULL);
            }
            printf("otherasync %d %d\n", (int)job.alloc_status, (int)job.free_status);
        } else if (strcmp(command, "sync") == 0) {
            printf("sync %d\n", (int)cuCtxSynchronize());
        } else if (strcmp(command, "allocnull") == 0) {
            printf("allocnull %d\n", (int)cuMemAlloc_v2(NULL, (size_t)number));
        } else if (strcmp(command, "info") == 0) {
            size_t free_bytes = 0, total = 0;
            CUresult status = cuMemGetInfo_v2(&free_bytes, &total);
            printf("info %d %zu %zu\n", (int)status, free_bytes, total);
        } else if (strcmp(command, "infop") == 0) {
            size_t free_bytes = 0, total = 0;
            CUresult status = cuMemGetInfo_v2(number & 1 ? &free_bytes : NULL, number & 2 ? &total : NULL);
            printf("infop %d %zu %zu\n", (int)status, free_bytes, total);
        } else if (strcmp(command, "info1p") == 0) {
            // cuda.h turns cuMemGetInfo into the _v2 name, so the legacy symbol is looked up.
            typedef CUresult (*legacy_info_fn)(unsigned int *, unsigned int *);
            legacy_info_fn legacy = (legacy_info_fn)dlsym(RTLD_DEFAULT, "cuMemGetInfo");
            unsigned int free_bytes = 0, total = 0;
            CUresult status = legacy ? legacy(number & 1 ? &free_bytes : NULL, number & 2 ? &total : NULL)
                                     : CUDA_ERROR_NOT_FOUND;
            printf("info1p %d %u %u\n", (int)status, free_bytes, total);
        } else if (strcmp(command, "mipmap") == 0) {
            CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 1024, .Height = 1024, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
            CUmipmappedArray array = NULL;
            CUresult status = cuMipmappedArrayCreate(&array, &d, (unsigned int)number);
            printf("mipmap %d %llu\n", (int)status, (unsigned long long)(size_t)array);
        } else if (strcmp(command, "mipmapfree") == 0) {
            printf("mipmapfree %d\n", (int)cuMipmappedArrayDestroy((CUmipmappedArray)(size_t)number));
        } else if (strcmp(command, "totalmem") == 0) {
            CUdevice device = 0;
            size_t bytes = 0;
            CUresult status = cuDeviceGet(&device, (int)number);
            if (status == CUDA_SUCCESS) status = cuDeviceTotalMem_v2(&bytes, device);
            printf("totalmem %d %zu\n", (int)status, bytes);
        } else if (strcmp(command, "nvml") == 0) {
            nvmlDevice_t device;
            nvmlMemory_t memory;
            memset(&memory, 0, sizeof memory);
            nvmlReturn_t status = nvml_device((unsigned)number, &device);
            if (status == NVML_SUCCESS) status = nvmlDeviceGetMemoryInfo(device, &memory);
            printf("nvml %d %llu %llu %llu\n", (int)status, memory.total, memory.used, memory.free);
        } else if (strcmp(command, "nvml2") == 0 || strcmp(command, "nvml2bad") == 0) {
            nvmlDevice_t device;
            nvmlMemory_v2_t memory;
            memset(&memory, 0, sizeof memory);
            memory.version = strcmp(command, "nvml2") == 0 ? nvmlMemory_v2 : nvmlMemory_v2 + 1;
            nvmlReturn_t status = nvml_device((unsigned)number, &device);
            if (status == NVML_SUCCESS) status = nvmlDeviceGetMemoryInfo_v2(device, &memory);
            if (strcmp(command, "nvml2") == 0) {
                printf("nvml2 %d %llu %llu %llu\n", (int)status, memory.total, memory.used, memory.free);
            } else {
                printf("nvml2bad %d\n", (int)status);
            }
        } else if (strcmp(command, "umask") == 0) {
            mode_t mask = umask(0);
            umask(mask);
            printf("umask %03o\n", (unsigned)mask);
        } else if (strcmp(command, "signals") == 0) {
            unsigned long long handled = 0;
            for (int sig = 1; sig < 64 && sig < NSIG; sig++) {
                struct sigaction action;
                if (sigaction(sig, NULL, &action) == 0 && action.sa_handler != SIG_DFL) handled |= 1ull << sig;
            }
            printf("signals %llx\n", handled);
        } else if (strcmp(command, "forkexit") == 0) {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) {
                CUdeviceptr p = 0;
                exit(cuMemAlloc_v2(&p, (size_t)number) == CUDA_SUCCESS ? 0 : 3);
            }
            int wait_status = 0;
            int code = child > 0 && waitpid(child, &wait_status, 0) == child && WIFEXITED(wait_status)
                           ? WEXITSTATUS(wait_status)
                           : -1;
            printf("forkexit %d %d\n", code, (int)child);
        } else if (strcmp(command, "quit") == 0) {
            break;
        } else {
            printf("unknown %s\n", command);
        }
        fflush(stdout);
    }
    return 0;
}
