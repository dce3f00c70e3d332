"""A deterministic bf16 training loop holding about GIB GiB (tests/gpu/release.sh): prints
'step <n> loss <value as hex>' every step and sleeps PAUSE seconds between steps, so a release and
restore can happen between any two; with IDLE_AT and IDLE_SECONDS, it sleeps that long after step
IDLE_AT too (an idle release happens then) and prints 'idle <seconds>' before it and each later
step's seconds ('took <s>'). Usage: release_train.py GIB STEPS PAUSE [IDLE_AT IDLE_SECONDS]"""
import sys
import time

import torch

gib, steps, pause = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
idle_at, idle_seconds = (int(sys.argv[4]), float(sys.argv[5])) if len(sys.argv) > 5 else (-1, 0.0)
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
width = 4096
layers = max(1, int(gib * 1024 / 128))
model = torch.nn.Sequential(
    *[torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
)
for layer in model:
    torch.nn.init.normal_(layer.weight, std=width**-0.5)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
batch = torch.randn(512, width, device="cuda", dtype=torch.bfloat16)
print(f"ready layers {layers} reserved_mib {torch.cuda.memory_reserved() >> 20}", flush=True)
for step in range(steps):
    start = time.time()
    loss = model(batch).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    value = loss.item()
    took = f" took {time.time() - start:.3f}" if idle_at >= 0 else ""
    print(f"step {step} loss {value.hex()}{took}", flush=True)
    time.sleep(pause)
    if step == idle_at:
        print(f"idle {idle_seconds}", flush=True)
        time.sleep(idle_seconds)
print("done", flush=True)
