"""What a CUDA graph's own memory costs, as the process sees it and as the device does (run by
tests/gpu/capture.sh): PyTorch captures a graph whose temporaries (1 GiB) are allocated inside the
capture, replays it, then drops it. With PyTorch's cudaMallocAsync backend those temporaries are
graph allocations: the device takes them at the first replay and keeps them while the
executable graph lives.

    capture_memory.py

Prints one line per stage: memory charged as the process sees it (total less free, from
cudaMemGetInfo: the virtual device under the library) and the process's memory by NVML. After the
replay it asks for 6 GiB more, which an 8 GiB limit must refuse when the graph's memory counts.
"""
import os
import subprocess

import torch


def device_used_mib():
    """This process's memory on the GPU by nvidia-smi, in MiB (None if it is not listed)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(used)
    return None


def report(stage):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    print(f"{stage:28} charged {(total - free) >> 20:6} MiB   nvidia-smi {device_used_mib()} MiB", flush=True)


def main():
    x = torch.ones(1 << 20, device="cuda")
    report("start")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (x.repeat(256) * 2).sum()  # warm-up, as PyTorch asks before a capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = (x.repeat(256) * 2).sum()
    report("captured")
    graph.replay()
    report("replayed")
    assert out.item() == 2 * 256 * (1 << 20)
    # 6 GiB more: within an 8 GiB limit only if the graph's 2 GiB are not counted.
    try:
        extra = torch.empty(6 << 30, dtype=torch.uint8, device="cuda")
        report("6 GiB more: allocated")
        del extra
    except torch.cuda.OutOfMemoryError:
        report("6 GiB more: refused")
    del graph
    report("graph deleted")
    torch.cuda.empty_cache()
    report("cache emptied")


if __name__ == "__main__":
    main()
