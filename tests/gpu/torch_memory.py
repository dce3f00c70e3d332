"""PyTorch under a memory limit: what mem_get_info says, how much can be allocated in 256 MiB
tensors before PyTorch's own OOM error, and whether a small tensor still works afterwards.
Usage: torch_memory.py [hold SECONDS]  (PYTORCH_CUDA_ALLOC_CONF selects the allocator)"""
import json
import os
import sys
import time

import torch

result = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")}
free, total = torch.cuda.mem_get_info()
result["mem_get_info_MiB"] = [free >> 20, total >> 20]
chunks = []
try:
    while len(chunks) < 1024:
        chunks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    result["oom"] = "none (1024 chunks)"
except torch.OutOfMemoryError as error:
    result["oom"] = type(error).__name__
result["allocated_MiB"] = 256 * len(chunks)
result["reserved_MiB"] = torch.cuda.memory_reserved() >> 20
free, total = torch.cuda.mem_get_info()
result["mem_get_info_at_oom_MiB"] = [free >> 20, total >> 20]
small = torch.ones(1 << 20, device="cuda")
result["small_tensor_after_oom"] = float(small.sum())
print(json.dumps(result), flush=True)
if len(sys.argv) > 2 and sys.argv[1] == "hold":
    time.sleep(float(sys.argv[2]))
