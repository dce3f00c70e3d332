"""Two GPUs in one process, one thread per GPU, for the compute limit suite (tests/gpu/compute_jobs.sh).

    compute_two_gpus.py gemm|smallops <seconds>
    compute_two_gpus.py gemm|smallops --work <iterations>

Builds the job of compute_jobs.py (the same loop, the same synchronisation) on cuda:0 and on
cuda:1 before the clock starts, then starts one thread per device at the same moment. Each thread
runs its loop from its first launch, with no warm-up, for <seconds>, or with --work until it has
done <iterations> (a fixed amount of work: with the same limit on both devices, both threads
should finish together, since each device's limit must hold back only that device's launches).
Prints one JSON line: {"job", "devices": [{"device", "per_second", "mean", "seconds",
"iterations"}, ...]}, per device what compute_jobs.py prints for one; "seconds" is the time from
the device's first launch to its last synchronisation (with --work, its completion time).

PyTorch releases the interpreter lock inside its operators, so a thread that the limiter holds in
a launch does not stop the other one; the small-op loop's Python work between launches is still
shared by the two threads, in the unlimited run as in the limited one.
"""
import json
import sys
import threading

import torch

from compute_jobs import JOBS, measure, per_second

DEVICES = (0, 1)


def main():
    job = sys.argv[1]
    if job not in ("gemm", "smallops"):
        raise SystemExit(f"compute_two_gpus.py: {job}: only gemm and smallops run on two GPUs")
    seconds, iterations = (None, int(sys.argv[3])) if sys.argv[2] == "--work" else (float(sys.argv[2]), None)
    torch.cuda.init()
    loops = []
    for device in DEVICES:
        with torch.cuda.device(device):
            torch.empty(1, device="cuda")  # the context, without a kernel
            loops.append(JOBS[job]())
            torch.cuda.synchronize()
    start = threading.Barrier(len(DEVICES))
    marks = {}

    def thread(device):
        torch.cuda.set_device(device)
        first, step, sync_every = loops[device]
        start.wait()
        marks[device] = measure(first, step, sync_every, seconds, iterations)

    threads = [threading.Thread(target=thread, args=(device,)) for device in DEVICES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(marks) != len(DEVICES):
        raise SystemExit("compute_two_gpus.py: a device's thread failed (its traceback is above)")
    devices = []
    for device in DEVICES:
        elapsed, done = marks[device][-1]
        whole = seconds if seconds is not None else elapsed
        devices.append(
            {
                "device": device,
                "per_second": per_second(marks[device], whole),
                "mean": done / elapsed,
                "seconds": elapsed,
                "iterations": done,
            }
        )
    print(json.dumps({"job": job, "devices": devices}), flush=True)


if __name__ == "__main__":
    main()
