"""The GPU time a job's kernels really take, from CUPTI (PyTorch's profiler), to check what the
compute limiter charges against: runs a job of compute_jobs.py for `warm` seconds from its first
launch, then profiles `steps` steps and prints one JSON line:

- steps, seconds: the profiled window (from its first step's start to its last synchronisation);
- kernels_per_step, kernel_us_per_step: kernels and their summed durations per step;
- copies_per_step, copy_us_per_step: memcpy and memset activities, likewise;
- busy_share: the union of the kernels' intervals over the window's wall time (what a perfect
  NVML would read).

    python3 tests/gpu/kernel_truth.py train 4 40

Run it with and without the hook (and a limit) to tell whether a job held under its limit is
charged more than its kernels take, or admitted less than its limit.
"""
import json
import os
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import compute_jobs  # beside this script (sys.path[0])


def intervals_union(intervals):
    """Total length covered by [(start, end)] intervals."""
    total = 0.0
    reach = None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def main():
    job, warm, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    torch.cuda.init()
    torch.empty(1, device="cuda")
    first, step, sync_every = compute_jobs.JOBS[job]()
    torch.cuda.synchronize()
    compute_jobs.measure(first, step, sync_every, warm)
    steps -= steps % sync_every
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for done in range(1, steps + 1):
            step()
            if done % sync_every == 0:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset") and "dur" in e]
    print(
        json.dumps(
            {
                "job": job,
                "steps": steps,
                "seconds": round(seconds, 4),
                "kernels_per_step": round(len(kernels) / steps, 2),
                "kernel_us_per_step": round(sum(e["dur"] for e in kernels) / steps, 2),
                "copies_per_step": round(len(copies) / steps, 2),
                "copy_us_per_step": round(sum(e["dur"] for e in copies) / steps, 2),
                "busy_share": round(
                    intervals_union([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / (seconds * 1e6), 4
                ),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
