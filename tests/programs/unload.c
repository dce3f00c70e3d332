// Loads libvgpu.so with dlopen (its path is the first argument), initialises CUDA through it,
// retains device 0's primary context and allocates <bytes> (the second argument) without freeing
// them; with a third argument "launch", also launches the fake's busy_10us kernel through it (which
// starts the library's background thread). Then prints "loaded <status>" and waits for a line on
// stdin; then unloads the library with dlclose, prints "unloaded <1 if it is still loaded, else
// 0>", sleeps 1.2 s (a background thread of an unmapped library would crash the process by then),
// prints "alive" and waits for end of file.
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef CUresult (*init_fn)(unsigned);
typedef CUresult (*retain_fn)(CUcontext *, CUdevice);
typedef CUresult (*set_current_fn)(CUcontext);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*load_fn)(CUmodule *, const void *);
typedef CUresult (*function_fn)(CUfunction *, CUmodule, const char *);
typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
typedef CUresult (*sync_fn)(void);

int main(int argc, char **argv) {
    if (argc != 3 && argc != 4) return 2;
    void *library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        printf("loaded -1 %s\n", dlerror());
        return 1;
    }
    init_fn init = (init_fn)dlsym(library, "cuInit");
    retain_fn retain = (retain_fn)dlsym(library, "cuDevicePrimaryCtxRetain");
    set_current_fn set_current = (set_current_fn)dlsym(library, "cuCtxSetCurrent");
    alloc_fn alloc = (alloc_fn)dlsym(library, "cuMemAlloc_v2");
    CUresult status = init && retain && set_current && alloc ? init(0) : CUDA_ERROR_NOT_FOUND;
    CUcontext ctx = NULL;
    CUdeviceptr pointer = 0;
    if (status == CUDA_SUCCESS) status = retain(&ctx, 0);
    if (status == CUDA_SUCCESS) status = set_current(ctx);
    if (status == CUDA_SUCCESS) status = alloc(&pointer, (size_t)strtoull(argv[2], NULL, 10));
    if (status == CUDA_SUCCESS && argc == 4 && strcmp(argv[3], "launch") == 0) {
        load_fn load = (load_fn)dlsym(library, "cuModuleLoadData");
        function_fn function = (function_fn)dlsym(library, "cuModuleGetFunction");
        launch_fn launch = (launch_fn)dlsym(library, "cuLaunchKernel");
        sync_fn sync = (sync_fn)dlsym(library, "cuCtxSynchronize");
        CUmodule module = NULL;
        CUfunction kernel = NULL;
        status = load && function && launch && sync ? load(&module, "fake module") : CUDA_ERROR_NOT_FOUND;
        if (status == CUDA_SUCCESS) status = function(&kernel, module, "busy_10us");
        for (int i = 0; i < 3 && status == CUDA_SUCCESS; i++) status = launch(kernel, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (status == CUDA_SUCCESS) status = sync();
    }
    printf("loaded %d\n", (int)status);
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 1;
    dlclose(library);
    printf("unloaded %d\n", dlopen(argv[1], RTLD_NOW | RTLD_NOLOAD) != NULL);
    fflush(stdout);
    usleep(1200000);
    printf("alive\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
