"""PyTorch workloads for the compute limit benchmark (tests/gpu/compute.sh).

    compute_torch.py gemm|pause <start_at unix s, 0 = now> <warm-up s> <measured s>

gemm: bf16 4096x4096x4096 matrix products, one after another. pause: a job with host-side pauses:
20 of those products, wait for them, then 6 ms of host time (sleep), again and again. Both run
unmeasured until start_at + warm-up, then count iterations (products, or pause cycles) over the
measured time, synchronise, and print `rate <iterations per second>`.
"""
import sys
import time

import torch

PAUSE_PRODUCTS = 20
PAUSE_SECONDS = 0.006


def main():
    workload = sys.argv[1]
    start_at, warm_up, measured = (float(v) for v in sys.argv[2:5])
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def gemm():
        for _ in range(10):
            torch.mm(a, b, out=c)
        return 10

    def pause():
        for _ in range(PAUSE_PRODUCTS):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        time.sleep(PAUSE_SECONDS)
        return 1

    step = {"gemm": gemm, "pause": pause}[workload]
    if start_at <= 0:
        start_at = time.time()
    while time.time() < start_at + warm_up:
        step()
    torch.cuda.synchronize()
    t0 = time.time()
    iterations = 0
    while time.time() - t0 < measured:
        iterations += step()
    torch.cuda.synchronize()
    print(f"rate {iterations / (time.time() - t0):.2f}", flush=True)


if __name__ == "__main__":
    main()
