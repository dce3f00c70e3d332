/* Test-only preload for programs run under qemu-user (scripts/cross-test.sh), never under a real
 * kernel. qemu answers a process's reads of its own /proc/<pid>/stat (and /proc/self/stat) with a
 * record it makes up, whose start time (field 22) differs from the kernel's by a few ticks; other
 * processes read the kernel's. The region and the fake driver identify a process by pid and start
 * time, so each process would take the others for dead ones whose pid was reused, and reap them.
 * This sends those opens to the kernel's file by another spelling of the same path
 * ("/proc//<pid>/stat"), which qemu does not take for the process's own. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef int (*open_function)(const char *, int, ...);

/* The kernel's spelling of `path` when it names this process's stat file, else `path`. */
static const char *kernel_path(const char *path, char *buffer, size_t size) {
    char own[48];
    snprintf(own, sizeof own, "/proc/%d/stat", (int)getpid());
    if (path != NULL && (strcmp(path, own) == 0 || strcmp(path, "/proc/self/stat") == 0)) {
        snprintf(buffer, size, "/proc//%d/stat", (int)getpid());
        return buffer;
    }
    return path;
}

static int forward(const char *name, const char *path, int flags, mode_t mode) {
    open_function next = (open_function)dlsym(RTLD_NEXT, name);
    char buffer[48];
    return next(kernel_path(path, buffer, sizeof buffer), flags, mode);
}

static mode_t mode_argument(int flags, va_list arguments) {
    return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(arguments, mode_t) : 0;
}

int open(const char *path, int flags, ...) {
    va_list arguments;
    va_start(arguments, flags);
    mode_t mode = mode_argument(flags, arguments);
    va_end(arguments);
    return forward("open", path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    va_list arguments;
    va_start(arguments, flags);
    mode_t mode = mode_argument(flags, arguments);
    va_end(arguments);
    return forward("open64", path, flags, mode);
}
