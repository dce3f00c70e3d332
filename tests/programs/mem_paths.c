// One allocate -> report -> free -> report cycle for a memory-accounted entry point, named by the
// first argument. After every call of interest it prints
//     step <entry> <status> <cuMemGetInfo status> <free> <total>
// and waits for a line on stdin (at end of file it goes on at once), so the test can read the
// shared region and the fake driver's ground truth while the memory is held. Every entry point is
// looked up by name with dlsym, so the exact variant named is the one called (cuda.h's macros would
// otherwise turn cuMemAlloc into cuMemAlloc_v2 and so on). The sizes are the test's expectations:
// change both together.
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MIB (1024ull * 1024ull)
#define ALLOC_BYTES (100 * MIB + 3)
#define MANAGED_BYTES (32 * MIB + 1)
#define POOL_BYTES (6 * MIB)
#define FROM_POOL_BYTES (4 * MIB)
#define CAPTURED_BYTES (5 * MIB)
#define VMM_BYTES (6 * MIB)
#define GRAPH_BYTES (8 * MIB)

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*pitch_fn)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
typedef CUresult (*managed_fn)(CUdeviceptr *, size_t, unsigned int);
typedef CUresult (*async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*pool_async_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);
typedef CUresult (*end_capture_fn)(CUstream, CUgraph *);
typedef CUresult (*capture_to_graph_fn)(CUstream, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t,
                                        CUstreamCaptureMode);
typedef CUresult (*array_fn)(CUarray *, const CUDA_ARRAY_DESCRIPTOR *);
typedef CUresult (*array3d_fn)(CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *);
typedef CUresult (*ctx_create_fn)(CUcontext *, unsigned int, CUdevice);
typedef CUresult (*ctx_create_v3_fn)(CUcontext *, CUexecAffinityParam *, int, unsigned int, CUdevice);
typedef CUresult (*ctx_create_v4_fn)(CUcontext *, CUctxCreateParams *, unsigned int, CUdevice);
typedef CUresult (*ctx_destroy_fn)(CUcontext);
typedef CUresult (*primary_release_fn)(CUdevice);
typedef CUresult (*module_load_fn)(CUmodule *, const void *);
typedef CUresult (*module_load_ex_fn)(CUmodule *, const void *, unsigned int, CUjit_option *, void **);
typedef CUresult (*library_load_fn)(CUlibrary *, const void *, CUjit_option *, void **, unsigned int,
                                    CUlibraryOption *, void **, unsigned int);
typedef CUresult (*graph_add_node_fn)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraphNodeParams *);
typedef CUresult (*graph_add_node_v2_fn)(CUgraphNode *, CUgraph, const CUgraphNode *, const CUgraphEdgeData *,
                                         size_t, CUgraphNodeParams *);
typedef CUresult (*instantiate_log_fn)(CUgraphExec *, CUgraph, CUgraphNode *, char *, size_t);
typedef CUresult (*instantiate_flags_fn)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*instantiate_params_fn)(CUgraphExec *, CUgraph, CUDA_GRAPH_INSTANTIATE_PARAMS *);

// The legacy 32-bit forms (declared by cuda.h only for the driver's own build).
typedef struct {
    unsigned int Width, Height;
    CUarray_format Format;
    unsigned int NumChannels;
} legacy_array_descriptor;
typedef struct {
    unsigned int Width, Height, Depth;
    CUarray_format Format;
    unsigned int NumChannels, Flags;
} legacy_array3d_descriptor;
typedef CUresult (*legacy_alloc_fn)(unsigned int *, unsigned int);
typedef CUresult (*legacy_pitch_fn)(unsigned int *, unsigned int *, unsigned int, unsigned int, unsigned int);
typedef CUresult (*legacy_free_fn)(unsigned int);
typedef CUresult (*legacy_array_fn)(CUarray *, const legacy_array_descriptor *);
typedef CUresult (*legacy_array3d_fn)(CUarray *, const legacy_array3d_descriptor *);

static void *sym(const char *name) {
    void *fn = dlsym(RTLD_DEFAULT, name);
    if (!fn) {
        printf("nosym %s\n", name);
        fflush(stdout);
        exit(3);
    }
    return fn;
}

#define CALL(type, name, ...) (((type)sym(name))(__VA_ARGS__))

static void step(const char *entry, CUresult status) {
    size_t free_bytes = 0, total = 0;
    CUresult info = cuMemGetInfo(&free_bytes, &total);
    printf("step %s %d %d %zu %zu\n", entry, (int)status, (int)info, free_bytes, total);
    fflush(stdout);
    char line[64];
    if (fgets(line, sizeof line, stdin) == NULL) clearerr(stdin);
}

static CUresult first_error(CUresult a, CUresult b) { return a != CUDA_SUCCESS ? a : b; }

static CUdevice dev;

// cuInit and the primary context of device 0, current, as the runtime does it.
static int prelude(void) {
    CUcontext primary = NULL;
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGet(&dev, 0);
    if (status == CUDA_SUCCESS) status = cuDevicePrimaryCtxRetain(&primary, dev);
    if (status == CUDA_SUCCESS) status = cuCtxSetCurrent(primary);
    step("ready", status);
    return status == CUDA_SUCCESS;
}

static void linear(const char *name) {
    CUdeviceptr p = 0;
    size_t pitch = 0;
    if (strcmp(name, "cuMemAlloc_v2") == 0) {
        step(name, CALL(alloc_fn, name, &p, ALLOC_BYTES));
    } else if (strcmp(name, "cuMemAllocPitch_v2") == 0) {
        step(name, CALL(pitch_fn, name, &p, &pitch, 1000, 7, 4));
    } else {
        step(name, CALL(managed_fn, name, &p, MANAGED_BYTES, CU_MEM_ATTACH_GLOBAL));
    }
    step("cuMemFree_v2", CALL(free_fn, "cuMemFree_v2", p));
    step("cuMemFree_v2", CALL(free_fn, "cuMemFree_v2", p));
}

static void stream_ordered(const char *name) {
    int ptsz = strstr(name, "_ptsz") != NULL;
    const char *free_name = ptsz ? "cuMemFreeAsync_ptsz" : "cuMemFreeAsync";
    CUstream stream = NULL;
    CUdeviceptr p = 0;
    if (cuStreamCreate(&stream, 0) != CUDA_SUCCESS) {
        step("cuStreamCreate", 999);
        return;
    }
    if (strncmp(name, "cuMemAllocAsync", 15) == 0) {
        step(name, CALL(async_fn, name, &p, POOL_BYTES, stream));
        step(free_name, CALL(free_async_fn, free_name, p, stream));
        step("cuStreamSynchronize", cuStreamSynchronize(stream));
        return;
    }
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUmemoryPool pool = NULL;
    CUresult status = cuMemPoolCreate(&pool, &props);
    if (status != CUDA_SUCCESS) {
        step("cuMemPoolCreate", status);
        return;
    }
    step(name, CALL(pool_async_fn, name, &p, FROM_POOL_BYTES, pool, stream));
    step(free_name, CALL(free_async_fn, free_name, p, stream));
    step("cuMemPoolTrimTo", cuMemPoolTrimTo(pool, 0));
    step(name, CALL(pool_async_fn, name, &p, FROM_POOL_BYTES, pool, stream));
    step(free_name, CALL(free_async_fn, free_name, p, stream));
    step("cuMemPoolDestroy", cuMemPoolDestroy(pool));
}

// An allocation recorded into a global capture (charged to its graph until the graph is
// destroyed, then as what the device holds for graphs once the instance has run, until a trim),
// then one into a capture that a query of the capturing stream invalidates (the driver destroys
// its graph at the named end of capture).
static void captured(const char *name) {
    CUstream stream = NULL;
    CUdeviceptr p = 0;
    CUgraph graph = NULL;
    if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        step("cuStreamCreate", 999);
        return;
    }
    step("cuStreamBeginCapture_v2", cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
    step("cuMemAllocAsync", cuMemAllocAsync(&p, CAPTURED_BYTES, stream));
    step("cuMemFreeAsync", cuMemFreeAsync(p, stream));
    step(name, CALL(end_capture_fn, name, stream, &graph));
    // As PyTorch does: the graph destroyed once instantiated, the instance launched.
    CUgraphExec exec = NULL;
    step("cuGraphInstantiateWithFlags", cuGraphInstantiateWithFlags(&exec, graph, 0));
    step("cuGraphDestroy", cuGraphDestroy(graph));
    step("cuGraphLaunch", cuGraphLaunch(exec, stream));
    step("cuStreamSynchronize", cuStreamSynchronize(stream));
    step("cuGraphExecDestroy", cuGraphExecDestroy(exec));
    step("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim(dev));
    step("cuStreamBeginCapture_v2", cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
    step("cuMemAllocAsync", cuMemAllocAsync(&p, CAPTURED_BYTES, stream));
    step("cuStreamQuery", cuStreamQuery(stream));
    step(name, CALL(end_capture_fn, name, stream, &graph));
}

// A capture into the application's graph, invalidated by a query of its stream: the graph
// stays, with its allocation's charge, until it is destroyed.
static void captured_to_graph(const char *name) {
    CUstream stream = NULL;
    CUgraph graph = NULL;
    CUdeviceptr p = 0;
    if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS || cuGraphCreate(&graph, 0) != CUDA_SUCCESS) {
        step("cuGraphCreate", 999);
        return;
    }
    step(name, CALL(capture_to_graph_fn, name, stream, graph, NULL, NULL, 0, CU_STREAM_CAPTURE_MODE_GLOBAL));
    step("cuMemAllocAsync", cuMemAllocAsync(&p, CAPTURED_BYTES, stream));
    step("cuStreamQuery", cuStreamQuery(stream));
    CUgraph ended = NULL;
    step("cuStreamEndCapture", cuStreamEndCapture(stream, &ended));
    step("cuGraphDestroy", cuGraphDestroy(graph));
}

#if CUDA_VERSION >= 13050
typedef CUresult (*recapture_fn)(CUstream, CUstreamCaptureMode, CUgraph, CUgraphRecaptureCallback, void *);

// A captured graph recaptured node for node (its allocation is the original node's again, not a
// second one), then recaptured with an allocation of another size, which fails the recapture and
// leaves the graph, with its charge, until it is destroyed.
static void recaptured(const char *name) {
    CUstream stream = NULL;
    CUgraph graph = NULL;
    CUgraph ended = NULL;
    CUdeviceptr p = 0;
    if (cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
        step("cuStreamCreate", 999);
        return;
    }
    step("cuStreamBeginCapture_v2", cuStreamBeginCapture_v2(stream, CU_STREAM_CAPTURE_MODE_GLOBAL));
    step("cuMemAllocAsync", cuMemAllocAsync(&p, CAPTURED_BYTES, stream));
    step("cuMemFreeAsync", cuMemFreeAsync(p, stream));
    step("cuStreamEndCapture", cuStreamEndCapture(stream, &graph));
    step(name, CALL(recapture_fn, name, stream, CU_STREAM_CAPTURE_MODE_GLOBAL, graph, NULL, NULL));
    step("cuMemAllocAsync", cuMemAllocAsync(&p, CAPTURED_BYTES, stream));
    step("cuMemFreeAsync", cuMemFreeAsync(p, stream));
    step("cuStreamEndCapture", cuStreamEndCapture(stream, &ended));
    step(name, CALL(recapture_fn, name, stream, CU_STREAM_CAPTURE_MODE_GLOBAL, graph, NULL, NULL));
    step("cuMemAllocAsync", cuMemAllocAsync(&p, 2 * CAPTURED_BYTES, stream));
    step("cuStreamEndCapture", cuStreamEndCapture(stream, &ended));
    step("cuGraphDestroy", cuGraphDestroy(graph));
}
#endif

// A stream-ordered block freed, then given back to the device by the named synchronisation.
static void synchronizing(const char *name) {
    CUstream stream = NULL;
    CUevent event = NULL;
    CUcontext context = NULL;
    CUdeviceptr p = 0;
    if (cuStreamCreate(&stream, 0) != CUDA_SUCCESS || cuEventCreate(&event, 0) != CUDA_SUCCESS ||
        cuCtxGetCurrent(&context) != CUDA_SUCCESS) {
        step("setup", 999);
        return;
    }
    step("cuMemAllocAsync", CALL(async_fn, "cuMemAllocAsync", &p, POOL_BYTES, stream));
    step("cuMemFreeAsync", CALL(free_async_fn, "cuMemFreeAsync", p, stream));
    cuEventRecord(event, stream);
    if (strncmp(name, "cuStreamSynchronize", 19) == 0) {
        step(name, CALL(CUresult (*)(CUstream), name, stream));
    } else if (strcmp(name, "cuCtxSynchronize") == 0) {
        step(name, CALL(CUresult (*)(void), name));
    } else if (strcmp(name, "cuCtxSynchronize_v2") == 0) {
        step(name, CALL(CUresult (*)(CUcontext), name, context));
    } else {
        step(name, CALL(CUresult (*)(CUevent), name, event));
    }
}

static void vmm(void) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    CUmemGenericAllocationHandle handle = 0;
    step("cuMemCreate", cuMemCreate(&handle, VMM_BYTES, &prop, 0));
    step("cuMemRelease", cuMemRelease(handle));
#if CUDA_VERSION >= 13050
    // A locality domain (CUDA 13.5) is part of its device's memory: charged to the device.
    memset(&prop.location, 0, sizeof prop.location);
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN;
    prop.location.localized.deviceId = 0;
    prop.location.localized.localityDomainId = 0;
    step("cuMemCreate", cuMemCreate(&handle, VMM_BYTES, &prop, 0));
    step("cuMemRelease", cuMemRelease(handle));
    prop.location.id = 0;
#endif
    // Mapped memory lives until its handle's last reference (the create's and a retain's) and its
    // last mapping are gone, whichever goes last: the unmap, or freeing the address range.
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle retained = 0;
    if (cuMemAddressReserve(&va, VMM_BYTES, 0, 0, 0) != CUDA_SUCCESS) va = 0;
    step("cuMemCreate", cuMemCreate(&handle, VMM_BYTES, &prop, 0));
    step("cuMemMap", cuMemMap(va, VMM_BYTES, 0, handle, 0));
    step("cuMemRetainAllocationHandle", cuMemRetainAllocationHandle(&retained, (void *)(uintptr_t)va));
    step("cuMemRelease", cuMemRelease(retained));
    step("cuMemRelease", cuMemRelease(handle));
    step("cuMemUnmap", cuMemUnmap(va, VMM_BYTES));
    step("cuMemCreate", cuMemCreate(&handle, VMM_BYTES, &prop, 0));
    step("cuMemMap", cuMemMap(va, VMM_BYTES, 0, handle, 0));
    step("cuMemRelease", cuMemRelease(handle));
    step("cuMemAddressFree", cuMemAddressFree(va, VMM_BYTES));
    // Host memory is not device memory: nothing charged.
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
    step("cuMemCreate", cuMemCreate(&handle, VMM_BYTES, &prop, 0));
    step("cuMemRelease", cuMemRelease(handle));
    // A handle nobody created: the driver's answer.
    step("cuMemRelease", cuMemRelease((CUmemGenericAllocationHandle)0xdead0000ull));
}

static void arrays(const char *name) {
    CUarray array = NULL;
    if (strcmp(name, "cuArrayCreate_v2") == 0) {
        CUDA_ARRAY_DESCRIPTOR d = {.Width = 1000, .Height = 300, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
        step(name, CALL(array_fn, name, &array, &d));
    } else {
        CUDA_ARRAY3D_DESCRIPTOR d = {
            .Width = 200, .Height = 200, .Depth = 100, .Format = CU_AD_FORMAT_UNSIGNED_INT16, .NumChannels = 2};
        step(name, CALL(array3d_fn, name, &array, &d));
    }
    step("cuArrayDestroy", cuArrayDestroy(array));
    step("cuArrayDestroy", cuArrayDestroy(array));
}

static void mipmapped(void) {
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 1024, .Height = 1024, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CUmipmappedArray array = NULL;
    step("cuMipmappedArrayCreate", cuMipmappedArrayCreate(&array, &d, 3));
    step("cuMipmappedArrayDestroy", cuMipmappedArrayDestroy(array));
    step("cuMipmappedArrayDestroy", cuMipmappedArrayDestroy(array));
}

static void alloc_node_props(CUmemPoolProps *props) {
    memset(props, 0, sizeof *props);
    props->allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props->location.id = 0;
}

static void graph(const char *name) {
    CUstream stream = NULL;
    CUgraph g = NULL;
    CUgraphNode node = NULL;
    if (cuStreamCreate(&stream, 0) != CUDA_SUCCESS || cuGraphCreate(&g, 0) != CUDA_SUCCESS) {
        step("cuGraphCreate", 999);
        return;
    }
    if (strcmp(name, "cuGraphAddMemAllocNode") == 0) {
        CUDA_MEM_ALLOC_NODE_PARAMS params;
        memset(&params, 0, sizeof params);
        alloc_node_props(&params.poolProps);
        params.bytesize = GRAPH_BYTES;
        step(name, cuGraphAddMemAllocNode(&node, g, NULL, 0, &params));
        CUgraphExec exec[5] = {NULL, NULL, NULL, NULL, NULL};
        CUDA_GRAPH_INSTANTIATE_PARAMS ip;
        memset(&ip, 0, sizeof ip);
        step("cuGraphInstantiate", CALL(instantiate_log_fn, "cuGraphInstantiate", &exec[0], g, NULL, NULL, 0));
        step("cuGraphInstantiate_v2", CALL(instantiate_log_fn, "cuGraphInstantiate_v2", &exec[1], g, NULL, NULL, 0));
        step("cuGraphInstantiateWithFlags",
             CALL(instantiate_flags_fn, "cuGraphInstantiateWithFlags", &exec[2], g, 0));
        step("cuGraphInstantiateWithParams",
             CALL(instantiate_params_fn, "cuGraphInstantiateWithParams", &exec[3], g, &ip));
        step("cuGraphInstantiateWithParams_ptsz",
             CALL(instantiate_params_fn, "cuGraphInstantiateWithParams_ptsz", &exec[4], g, &ip));
        step("cuGraphLaunch", cuGraphLaunch(exec[2], stream));
        cuStreamSynchronize(stream);
        step("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim(dev));
        step("cuGraphLaunch", cuGraphLaunch(exec[2], stream));
        cuStreamSynchronize(stream);
        CUresult status = CUDA_SUCCESS;
        for (int i = 0; i < 5; i++) status = first_error(status, cuGraphExecDestroy(exec[i]));
        step("cuGraphExecDestroy", status);
    } else {
        CUgraphNodeParams params;
        memset(&params, 0, sizeof params);
        params.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
        alloc_node_props(&params.alloc.poolProps);
        params.alloc.bytesize = GRAPH_BYTES;
        if (strcmp(name, "cuGraphAddNode") == 0) {
            step(name, CALL(graph_add_node_fn, name, &node, g, NULL, 0, &params));
        } else {
            step(name, CALL(graph_add_node_v2_fn, name, &node, g, NULL, NULL, 0, &params));
        }
        CUgraphExec exec = NULL;
        step("cuGraphInstantiateWithFlags", CALL(instantiate_flags_fn, "cuGraphInstantiateWithFlags", &exec, g, 0));
        step("cuGraphLaunch", cuGraphLaunch(exec, stream));
        cuStreamSynchronize(stream);
        step("cuGraphExecDestroy", cuGraphExecDestroy(exec));
    }
    step("cuGraphDestroy", cuGraphDestroy(g));
    step("cuDeviceGraphMemTrim", cuDeviceGraphMemTrim(dev));
}

static CUresult create_context(const char *name, CUcontext *ctx) {
    if (strcmp(name, "cuCtxCreate_v3") == 0) return CALL(ctx_create_v3_fn, name, ctx, NULL, 0, 0, dev);
    if (strcmp(name, "cuCtxCreate_v4") == 0) return CALL(ctx_create_v4_fn, name, ctx, NULL, 0, dev);
    return CALL(ctx_create_fn, name, ctx, 0, dev);
}

static void contexts(const char *name) {
    const char *destroy = strcmp(name, "cuCtxCreate") == 0 ? "cuCtxDestroy" : "cuCtxDestroy_v2";
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGet(&dev, 0);
    step("cuInit", status);
    CUcontext a = NULL, b = NULL;
    step(name, create_context(name, &a));
    step(name, create_context(name, &b));
    step(destroy, CALL(ctx_destroy_fn, destroy, b));
    step(destroy, CALL(ctx_destroy_fn, destroy, a));
}

static CUresult retain_current(void) {
    CUcontext ctx = NULL;
    CUresult status = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (status == CUDA_SUCCESS) cuCtxSetCurrent(ctx);
    return status;
}

static void primary(void) {
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGet(&dev, 0);
    step("cuInit", status);
    step("cuDevicePrimaryCtxRetain", retain_current());
    step("cuDevicePrimaryCtxRetain", retain_current());
    step("cuDevicePrimaryCtxRelease", CALL(primary_release_fn, "cuDevicePrimaryCtxRelease", dev));
    step("cuDevicePrimaryCtxRelease_v2", CALL(primary_release_fn, "cuDevicePrimaryCtxRelease_v2", dev));
    step("cuDevicePrimaryCtxRetain", retain_current());
    step("cuDevicePrimaryCtxReset", CALL(primary_release_fn, "cuDevicePrimaryCtxReset", dev));
    step("cuDevicePrimaryCtxRetain", retain_current());
    step("cuDevicePrimaryCtxReset_v2", CALL(primary_release_fn, "cuDevicePrimaryCtxReset_v2", dev));
}

static void modules(const char *name) {
    static const char image[] = "vgpu fake module image: busy_1us";
    if (strncmp(name, "cuLibrary", 9) == 0) {
        CUlibrary library = NULL;
        step(name, CALL(library_load_fn, name, &library, image, NULL, NULL, 0, NULL, NULL, 0));
        step("cuLibraryUnload", cuLibraryUnload(library));
        return;
    }
    CUmodule module = NULL;
    if (strcmp(name, "cuModuleLoadDataEx") == 0) {
        step(name, CALL(module_load_ex_fn, name, &module, image, 0, NULL, NULL));
    } else {
        step(name, CALL(module_load_fn, name, &module, image));
    }
    step("cuModuleUnload", cuModuleUnload(module));
}

static void legacy(const char *name) {
    unsigned int p = 0, pitch = 0;
    CUarray array = NULL;
    if (strcmp(name, "cuMemAlloc") == 0) {
        step(name, CALL(legacy_alloc_fn, name, &p, 1 << 20));
    } else if (strcmp(name, "cuMemAllocPitch") == 0) {
        step(name, CALL(legacy_pitch_fn, name, &p, &pitch, 1000, 7, 4));
    } else if (strcmp(name, "cuMemFree") == 0) {
        step(name, CALL(legacy_free_fn, name, 0x10000u));
    } else if (strcmp(name, "cuArrayCreate") == 0) {
        legacy_array_descriptor d = {1000, 300, CU_AD_FORMAT_FLOAT, 4};
        step(name, CALL(legacy_array_fn, name, &array, &d));
    } else {
        legacy_array3d_descriptor d = {200, 200, 100, CU_AD_FORMAT_UNSIGNED_INT16, 2, 0};
        step(name, CALL(legacy_array3d_fn, name, &array, &d));
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: mem_paths <entry point>\n");
        return 2;
    }
    const char *name = argv[1];
    if (strncmp(name, "cuCtxCreate", 11) == 0) {
        contexts(name);
    } else if (strcmp(name, "cuDevicePrimaryCtxRetain") == 0) {
        primary();
    } else if (!prelude()) {
        return 1;
    } else if (strcmp(name, "cuMemAlloc_v2") == 0 || strcmp(name, "cuMemAllocPitch_v2") == 0 ||
               strcmp(name, "cuMemAllocManaged") == 0) {
        linear(name);
    } else if (strncmp(name, "cuMemAllocAsync", 15) == 0 || strncmp(name, "cuMemAllocFromPoolAsync", 23) == 0) {
        stream_ordered(name);
    } else if (strstr(name, "Synchronize") != NULL) {
        synchronizing(name);
    } else if (strcmp(name, "cuMemCreate") == 0) {
        vmm();
    } else if (strcmp(name, "cuArrayCreate_v2") == 0 || strcmp(name, "cuArray3DCreate_v2") == 0) {
        arrays(name);
    } else if (strcmp(name, "cuMipmappedArrayCreate") == 0) {
        mipmapped();
    } else if (strncmp(name, "cuStreamBeginCaptureToGraph", 27) == 0) {
        captured_to_graph(name);
#if CUDA_VERSION >= 13050
    } else if (strncmp(name, "cuStreamBeginRecaptureToGraph", 29) == 0) {
        recaptured(name);
#endif
    } else if (strncmp(name, "cuStreamEndCapture", 18) == 0) {
        captured(name);
    } else if (strncmp(name, "cuGraphAdd", 10) == 0) {
        graph(name);
    } else if (strncmp(name, "cuModuleLoad", 12) == 0 || strncmp(name, "cuLibraryLoad", 13) == 0) {
        modules(name);
    } else if (strcmp(name, "cuMemAlloc") == 0 || strcmp(name, "cuMemAllocPitch") == 0 ||
               strcmp(name, "cuMemFree") == 0 || strcmp(name, "cuArrayCreate") == 0 ||
               strcmp(name, "cuArray3DCreate") == 0) {
        legacy(name);
    } else {
        printf("unknown %s\n", name);
        return 2;
    }
    printf("end\n");
    return 0;
}
