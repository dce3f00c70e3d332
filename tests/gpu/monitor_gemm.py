"""A bf16 GEMM loop for the monitoring checks: prints PyTorch's reserved memory once warmed up,
then runs for SECONDS. Usage: monitor_gemm.py SECONDS"""
import sys
import time

import torch

a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(10):
    b = a @ a
torch.cuda.synchronize()
print(f"reserved_MiB {torch.cuda.memory_reserved() >> 20}", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(10):
        b = a @ a
    torch.cuda.synchronize()
