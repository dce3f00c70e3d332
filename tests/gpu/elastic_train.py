"""A bf16 training loop (a stack of 4096x4096 linear layers, AdamW) sized to about GIB GiB of
weights, gradients and optimizer state, for the elastic-memory measurement (tests/gpu/elastic.sh).
Prints one line per step with its time, then 'done'; 'oom' and status 3 on PyTorch's
out-of-memory error. Usage: elastic_train.py GIB STEPS"""
import sys
import time

import torch

gib, steps = float(sys.argv[1]), int(sys.argv[2])
width = 4096
# Weight, gradient and AdamW's two states, bf16: 4 x 32 MiB per layer.
layers = max(1, int(gib * 1024 / 128))
torch.manual_seed(0)
try:
    start = time.time()
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    batch = torch.randn(1024, width, device="cuda", dtype=torch.bfloat16)
    for step in range(steps):
        began = time.time()
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        print(f"step {step} {time.time() - began:.4f} s loss {loss.item():.6f}", flush=True)
    free, total = torch.cuda.mem_get_info()
    print(f"done layers {layers} seconds {time.time() - start:.2f} virtual_free_mib {free >> 20} "
          f"virtual_total_mib {total >> 20} reserved_mib {torch.cuda.memory_reserved() >> 20}", flush=True)
except torch.OutOfMemoryError as error:
    print("oom", str(error).splitlines()[0][:160], flush=True)
    sys.exit(3)
