"""Which driver calls invalidate a stream capture opened in global mode (run by
tests/gpu/capture.sh): each call is made alone, on the capturing thread, inside a fresh capture,
and the capture's status read after it. With a library path, the library's exports are called
(as an application linked against it would), so its own calls on the way are tried too.

    capture_probe.py [library]

Prints one line per call: its result and the capture's status after it (active, or invalidated).
"""
import ctypes
import sys
import threading

MODE_GLOBAL = 0
MODE_RELAXED = 2
RESERVED_MEM_CURRENT = 5
USED_MEM_CURRENT = 7
STATUS = {0: "none", 1: "active", 2: "invalidated"}


def main():
    real = ctypes.CDLL("libcuda.so.1")
    cuda = ctypes.CDLL(sys.argv[1]) if len(sys.argv) > 1 else real
    u64 = ctypes.c_uint64
    handle = ctypes.c_void_p

    def check(status, what):
        if status != 0:
            raise SystemExit(f"capture_probe: {what} failed with {status}")

    check(real.cuInit(0), "cuInit")
    device = ctypes.c_int()
    check(real.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    context = handle()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    stream = handle()
    check(cuda.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
    pool = handle()
    check(cuda.cuDeviceGetMemPool(ctypes.byref(pool), device), "cuDeviceGetMemPool")
    # A pooled allocation made before the capture, to free inside one.
    before = u64()
    check(cuda.cuMemAllocAsync(ctypes.byref(before), ctypes.c_size_t(1 << 20), stream), "cuMemAllocAsync")
    check(cuda.cuStreamSynchronize(stream), "cuStreamSynchronize")
    value = u64()
    pointer = u64()
    free_bytes, total_bytes = ctypes.c_size_t(), ctypes.c_size_t()
    def relaxed(call):
        """call() with this thread in relaxed capture mode, its own mode given back after."""
        mode = ctypes.c_int(MODE_RELAXED)
        cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
        try:
            return call()
        finally:
            cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))

    def on_another_thread(call):
        """call() on a new thread with the context current there."""
        result = []

        def run():
            cuda.cuCtxSetCurrent(context)
            result.append(call())

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return result[0]

    reserved = lambda: cuda.cuMemPoolGetAttribute(pool, RESERVED_MEM_CURRENT, ctypes.byref(value))
    calls = [
        ("cuDeviceGetMemPool", lambda: cuda.cuDeviceGetMemPool(ctypes.byref(pool), device)),
        ("cuMemPoolGetAttribute reserved", lambda: cuda.cuMemPoolGetAttribute(pool, RESERVED_MEM_CURRENT, ctypes.byref(value))),
        ("cuMemPoolGetAttribute used", lambda: cuda.cuMemPoolGetAttribute(pool, USED_MEM_CURRENT, ctypes.byref(value))),
        ("cuMemPoolGetAttribute, relaxed mode", lambda: relaxed(reserved)),
        ("cuMemPoolGetAttribute, other thread", lambda: on_another_thread(reserved)),
        ("... other thread, relaxed mode", lambda: on_another_thread(lambda: relaxed(reserved))),
        ("cuMemGetInfo", lambda: cuda.cuMemGetInfo_v2(ctypes.byref(free_bytes), ctypes.byref(total_bytes))),
        ("cuCtxGetDevice", lambda: cuda.cuCtxGetDevice(ctypes.byref(device))),
        ("cuMemAllocAsync 1 MiB", lambda: cuda.cuMemAllocAsync(ctypes.byref(pointer), ctypes.c_size_t(1 << 20), stream)),
        ("cuMemAllocAsync + cuMemFreeAsync", lambda: cuda.cuMemAllocAsync(ctypes.byref(pointer), ctypes.c_size_t(1 << 20), stream)
            or cuda.cuMemFreeAsync(pointer, stream)),
        ("cuMemFreeAsync of a pooled block", lambda: cuda.cuMemFreeAsync(before, stream)),
    ]
    for name, call in calls:
        check(cuda.cuStreamBeginCapture_v2(stream, MODE_GLOBAL), "cuStreamBeginCapture_v2")
        result = call()
        status = ctypes.c_int(-1)
        real.cuStreamIsCapturing(stream, ctypes.byref(status))
        graph = handle()
        ended = real.cuStreamEndCapture(stream, ctypes.byref(graph))
        if ended == 0 and graph.value:
            real.cuGraphDestroy(graph)
        print(f"{name:36} result {result:4}  capture {STATUS.get(status.value, status.value)}", flush=True)


if __name__ == "__main__":
    main()
