// Small driver/NVML calls chosen by argument, each printing "<call> <status>", for the tests of
// missing symbols, injected panics, configuration errors, logging and fork. `initloop=N` calls
// cuInit N times and `initfor=MS` for MS milliseconds, each printing "<call> <last status> <calls>".
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <nvml.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef CUresult (*nvsci_fn)(void *, CUdevice, int);
typedef nvmlReturn_t (*nvlink_fn)(nvmlDevice_t, unsigned int, nvmlPciInfo_t *);

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *what = argv[i];
        if (strcmp(what, "init") == 0) {
            printf("init %d\n", (int)cuInit(0));
        } else if (strncmp(what, "initloop=", 9) == 0) {
            long calls = strtol(what + 9, NULL, 10), done = 0;
            CUresult status = CUDA_SUCCESS;
            for (; done < calls; done++) status = cuInit(0);
            printf("initloop %d %ld\n", (int)status, done);
        } else if (strncmp(what, "initfor=", 8) == 0) {
            double end = now_ms() + strtod(what + 8, NULL);
            long done = 0;
            CUresult status = CUDA_SUCCESS;
            for (; now_ms() < end; done++) status = cuInit(0);
            printf("initfor %d %ld\n", (int)status, done);
        } else if (strcmp(what, "count") == 0) {
            int count = -1;
            CUresult status = cuDeviceGetCount(&count);
            printf("count %d %d\n", (int)status, count);
        } else if (strcmp(what, "totalmem") == 0) {
            size_t bytes = 0;
            CUresult status = cuDeviceTotalMem(&bytes, 0);
            printf("totalmem %d %zu\n", (int)status, bytes);
        } else if (strcmp(what, "version") == 0) {
            int version = -1;
            CUresult status = cuDriverGetVersion(&version);
            printf("version %d %d\n", (int)status, version);
        } else if (strcmp(what, "missing-cuda") == 0) {
            void *lib = dlopen("libcuda.so.1", RTLD_NOW);
            nvsci_fn fn = (nvsci_fn)dlsym(lib, "cuDeviceGetNvSciSyncAttributes");
            printf("missing-cuda %d\n", fn ? (int)fn(NULL, 0, 0) : -1);
        } else if (strncmp(what, "call=", 5) == 0) {
            // Any entry point by name (found with dlsym), called with null arguments: for
            // functions the driver lacks, whose wrappers answer before reading them.
            typedef int (*any_fn)(void *, void *, void *, void *, void *, void *, void *, void *);
            any_fn fn = (any_fn)dlsym(RTLD_DEFAULT, what + 5);
            printf("call %s %d\n", what + 5, fn ? fn(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL) : -1);
        } else if (strcmp(what, "newer") == 0) {
            // A function of a driver newer than the hook's headers (the fake's stand-in), found
            // with dlsym: the driver's own, unhooked.
            void *lib = dlopen("libcuda.so.1", RTLD_NOW);
            CUresult (*fn)(void) = (CUresult (*)(void))dlsym(lib, "cuFakeNewerDriverFunction");
            Dl_info info;
            const char *file = "-";
            if (fn && dladdr((void *)fn, &info) && info.dli_fname)
                file = strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname;
            printf("newer %d %s\n", fn ? (int)fn() : -1, file);
        } else if (strcmp(what, "private-nvml") == 0) {
            // NVML's private export table, found with dlsym as nvidia-smi finds it: the library's own.
            void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
            nvmlReturn_t (*fn)(const void **, const void *) =
                (nvmlReturn_t (*)(const void **, const void *))dlsym(lib, "nvmlInternalGetExportTable");
            const void *table = NULL;
            unsigned char id[16] = {0};
            printf("private-nvml %d\n", fn ? (int)fn(&table, id) : -1);
        } else if (strcmp(what, "missing-nvml") == 0) {
            void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
            nvlink_fn fn = (nvlink_fn)dlsym(lib, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
            nvmlPciInfo_t info;
            printf("missing-nvml %d\n", fn ? (int)fn(NULL, 0, &info) : -1);
        } else if (strcmp(what, "nvml") == 0) {
            nvmlReturn_t status = nvmlInit_v2();
            unsigned int count = 0;
            if (status == NVML_SUCCESS) status = nvmlDeviceGetCount_v2(&count);
            printf("nvml %d %u\n", (int)status, count);
        } else if (strcmp(what, "exporttable") == 0) {
            const void *table = NULL;
            CUuuid id;
            memset(&id, 0, sizeof id);
            CUresult status = cuGetExportTable(&table, &id);
            Dl_info info;
            const char *file = "-";
            if (table && dladdr(table, &info) && info.dli_fname)
                file = strrchr(info.dli_fname, '/') ? strrchr(info.dli_fname, '/') + 1 : info.dli_fname;
            printf("exporttable %d %s\n", (int)status, file);
        } else if (strcmp(what, "fork") == 0) {
            fflush(stdout);
            pid_t child = fork();
            if (child == 0) {
                int count = -1;
                CUresult status = cuInit(0);
                if (status == CUDA_SUCCESS) status = cuDeviceGetCount(&count);
                printf("child %d %d %d\n", (int)getpid(), (int)status, count);
                fflush(stdout);
                _exit(0);
            }
            int wstatus = 0;
            waitpid(child, &wstatus, 0);
            printf("fork %d\n", WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1);
        } else {
            printf("unknown %s\n", what);
            return 2;
        }
        fflush(stdout);
    }
    return 0;
}
