// Reaches the driver the three ways real applications do and reports, for each, the status of a
// call and which library the function pointer it used belongs to (dladdr), one line each:
//   <way> <status> <library file name> <symbol name>
// Usage: reach linked|dlsym|procaddress|all
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef CUresult (*count_fn)(int *);
typedef CUresult (*proc_v2_fn)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);

static void report(const char *way, CUresult status, void *fn) {
    Dl_info info;
    memset(&info, 0, sizeof info);
    const char *file = "?", *symbol = "?";
    if (fn && dladdr(fn, &info)) {
        file = info.dli_fname ? strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname : "?";
        symbol = info.dli_sname ? info.dli_sname : "?";
    }
    printf("%s %d %s %s\n", way, (int)status, file, symbol);
}

static void linked(void) {
    int count = -1;
    CUresult status = cuInit(0);
    if (status == CUDA_SUCCESS) status = cuDeviceGetCount(&count);
    report("linked", status, (void *)cuDeviceGetCount);
}

static void via_dlsym(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { printf("dlsym 1 dlopen-failed ?\n"); return; }
    count_fn count_devices = (count_fn)dlsym(lib, "cuDeviceGetCount");
    int count = -1;
    CUresult status = count_devices ? count_devices(&count) : CUDA_ERROR_NOT_FOUND;
    report("dlsym", status, (void *)count_devices);
}

static void via_proc_address(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { printf("procaddress 1 dlopen-failed ?\n"); return; }
    proc_v2_fn get = (proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    void *fn = NULL;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult status = get ? get("cuDeviceGetCount", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &found) : CUDA_ERROR_NOT_FOUND;
    int count = -1;
    if (status == CUDA_SUCCESS && fn) status = ((count_fn)fn)(&count);
    report("procaddress", status, fn);
}

int main(int argc, char **argv) {
    const char *way = argc > 1 ? argv[1] : "all";
    int all = strcmp(way, "all") == 0;
    if (all || strcmp(way, "linked") == 0) linked();
    if (all || strcmp(way, "dlsym") == 0) via_dlsym();
    if (all || strcmp(way, "procaddress") == 0) via_proc_address();
    return 0;
}
