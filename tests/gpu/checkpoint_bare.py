"""The driver's checkpoint API called directly on another process (the baseline of
tests/gpu/release.sh): lock, checkpoint, then, on 'restore', restore and unlock, printing the
seconds of each. Usage: checkpoint_bare.py PID release|restore"""
import ctypes
import sys
import time

pid, what = int(sys.argv[1]), sys.argv[2]
cuda = ctypes.CDLL("libcuda.so.1")
steps = ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint"] if what == "release" else [
    "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]
for name in steps:
    start = time.time()
    status = getattr(cuda, name)(pid, None)
    print(f"{name} status {status} seconds {time.time() - start:.3f}", flush=True)
    if status != 0:
        sys.exit(1)
