#!/usr/bin/env bash
# Whether cuEventElapsedTime gives a negative time for events in reverse order (the overlap probes
# place events of other streams on a sample's timeline), and the card's name, power limit and top clock.
set -u
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader
python3 - <<'PY'
import torch
a=torch.cuda.Event(enable_timing=True); b=torch.cuda.Event(enable_timing=True)
s1=torch.cuda.Stream(); 
x=torch.empty(4096,4096,device="cuda",dtype=torch.bfloat16)
with torch.cuda.stream(s1):
    b.record()
    torch.mm(x,x); torch.mm(x,x)
    a.record()
torch.cuda.synchronize()
print("elapsed end->start (expect negative):", b.elapsed_time(a), a.elapsed_time(b))
PY
