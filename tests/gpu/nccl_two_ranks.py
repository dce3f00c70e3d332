"""Issue 15: a PyTorch NCCL all-reduce between two ranks, one GPU each, run under the preload.

    nccl_two_ranks.py <limit GiB> <hold seconds>

Each rank (rank r on cuda:r) all-reduces a 64 MiB tensor of (r + 1) and checks every element is
1 + 2 = 3; then allocates 256 MiB blocks until PyTorch raises torch.OutOfMemoryError, and records
how much it got (the limit, less the context and NCCL's buffers); then both ranks hold their
memory for <hold seconds> (the caller reads the region meanwhile) and free it. Prints one JSON line
per rank: {"rank", "device", "pid", "allreduce_ok", "allocated_GiB", "oom": true|false,
"oom_type"}; exits non-zero when a rank fails.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BLOCK = 256 << 20


def rank_main(rank, world, limit_gib, hold_seconds, results):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    value = torch.full((16 << 20,), float(rank + 1), device=f"cuda:{rank}")
    dist.all_reduce(value)
    torch.cuda.synchronize()
    allreduce_ok = bool(torch.all(value == 3.0).item())
    del value
    blocks, oom, oom_type = [], False, None
    # Never more than the limit plus 2 GiB: a limit that does not hold stops here, not at 141 GiB.
    for _ in range(int((limit_gib + 2) * (1 << 30) // BLOCK)):
        try:
            blocks.append(torch.empty(BLOCK, dtype=torch.uint8, device=f"cuda:{rank}"))
        except torch.OutOfMemoryError as error:
            oom, oom_type = True, type(error).__name__
            break
    allocated = len(blocks) * BLOCK / (1 << 30)
    dist.barrier()
    print(f"rank {rank} holding {allocated:.2f} GiB", flush=True)
    time.sleep(hold_seconds)
    dist.barrier()
    del blocks
    torch.cuda.empty_cache()
    dist.destroy_process_group()
    results[rank] = {
        "rank": rank,
        "device": rank,
        "pid": os.getpid(),
        "allreduce_ok": allreduce_ok,
        "allocated_GiB": round(allocated, 2),
        "oom": oom,
        "oom_type": oom_type,
    }


def main():
    limit_gib = float(sys.argv[1])
    hold_seconds = float(sys.argv[2])
    world = 2
    if torch.cuda.device_count() < world:
        print(json.dumps({"skipped": f"{torch.cuda.device_count()} GPU(s), two needed"}))
        return 0
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(world, limit_gib, hold_seconds, results), nprocs=world, join=True)
    failed = False
    for rank in range(world):
        result = results.get(rank)
        print(json.dumps(result))
        failed |= result is None or not result["allreduce_ok"] or not result["oom"]
        failed |= result is not None and result["allocated_GiB"] > limit_gib
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
