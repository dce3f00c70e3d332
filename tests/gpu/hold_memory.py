"""Allocates N MiB with PyTorch, prints 'holding', and sleeps (for the two-process and nvidia-smi
checks). Usage: hold_memory.py MIB SECONDS"""
import sys
import time

import torch

try:
    held = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
    print("holding", flush=True)
except torch.OutOfMemoryError:
    print("oom", flush=True)
time.sleep(float(sys.argv[2]))
