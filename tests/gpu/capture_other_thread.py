"""A CUDA graph captured in PyTorch's default mode (global) on one thread while another thread
launches small kernels on a stream of its own, for a few seconds (run by tests/gpu/capture.sh).

    capture_other_thread.py <seconds>

In global mode the driver refuses potentially unsafe calls (a stream or event query, a pinned
allocation) from every thread in global mode while the capture is open, and invalidates the
capture. Under a compute limit the library samples the other thread's launches; its calls there
must not break the capture. Every 100 captured ops one allocates (a temporary), so the allocator's
calls (and the library's memory accounting) run inside the capture too. Prints one JSON line: captures tried and failed, the first failure,
the other thread's launches and errors.
"""
import json
import sys
import threading
import time

import torch


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    # Both threads hold the interpreter by turns: switch often, so the other thread launches while
    # a capture is open.
    sys.setswitchinterval(0.0002)
    x = torch.ones(65536, device="cuda")
    y = torch.ones(65536, device="cuda")
    torch.cuda.synchronize()
    stop = threading.Event()
    other = {"launches": 0, "errors": 0, "first": None}

    def launch():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                try:
                    for _ in range(8):
                        x.mul_(1.0000001)
                    other["launches"] += 8
                except RuntimeError as error:
                    other["errors"] += 1
                    other["first"] = other["first"] or str(error).splitlines()[0]

    thread = threading.Thread(target=launch)
    thread.start()
    tried = failed = 0
    first = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        graph = torch.cuda.CUDAGraph()
        tried += 1
        try:
            with torch.cuda.graph(graph):
                for i in range(400):
                    y.mul_(1.0000001)
                    if i % 100 == 0:
                        # An allocation inside the capture: the allocator's own calls, and the
                        # library's memory accounting, run while the capture is open.
                        y.add_(y * 1e-7)
            graph.replay()
        except RuntimeError as error:
            failed += 1
            first = first or str(error).splitlines()[0]
        del graph
    stop.set()
    thread.join()
    torch.cuda.synchronize()
    print(json.dumps({
        "captures": tried, "captures_failed": failed, "first_failure": first,
        "other_launches": other["launches"], "other_errors": other["errors"], "other_first": other["first"],
    }), flush=True)


if __name__ == "__main__":
    main()
