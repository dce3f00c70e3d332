"""Jobs as users run them, for the compute limit suite (tests/gpu/compute_jobs.sh).

    compute_jobs.py <job> <seconds> [start_at unix s]

Runs <job> on the current CUDA device from its first kernel launch for <seconds>, with no
warm-up, and prints one JSON line: the job, the iterations completed in each second from the
first launch ("per_second"), and the mean rate. Set-up that launches nothing (imports, context
creation, allocations) comes before the clock starts; everything that launches a kernel (filling
the inputs, cuBLAS and Triton's first calls, module loading) is inside the measured time. The
optional start_at makes several processes start their clocks together. Also in the JSON line,
per second, for the thread that runs the job: the CPU it was on as the second began
("cpu_per_second") and how often the kernel preempted it in that second
("preempted_per_second"), from /proc (null for a second that began during a longer gap between
synchronisations, or where /proc cannot be read): a host-bound loop's rate
follows where and how undisturbed its thread runs.

Jobs (each synchronises at least every few milliseconds of GPU work, as real loops do when they
read a loss or a flag, so that completed iterations are counted when they complete):
  smallops  8 in-place multiplies of a 64K-element float tensor per iteration, sync every 10
  paused    the same 8 multiplies, then sync and sleep 0.5 ms, every iteration
  gemm      bf16 4096^3 matrix products, sync every 10
  graph     a CUDA graph of 8 small kernels (the smallops iteration, captured), replayed; sync every 10
  train     a GPT-2-style step: 8 layers of width 1024, bf16 autocast, AdamW, batch 8, sequence 1024
  triton    a Triton kernel (fused multiply-add over 16M floats), sync every 10
  streams   4 Python threads, each with a stream of its own, each launching 8 bf16 2048^3 matrix
            products on it per iteration (the GPU runs the streams' kernels side by side); sync
            every 10
"""
import json
import os
import sys
import time

import torch


def smallops():
    x = torch.empty(65536, device="cuda")

    def first():
        x.fill_(1.0)

    def step():
        for _ in range(8):
            x.mul_(1.0000001)

    return first, step, 10


def paused():
    first, ops, _ = smallops()

    def step():
        ops()
        torch.cuda.synchronize()
        time.sleep(0.0005)

    return first, step, 1


def gemm():
    a = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    c = torch.empty_like(a)

    def first():
        a.normal_()
        b.normal_()

    def step():
        torch.mm(a, b, out=c)

    return first, step, 10


def graph():
    x = torch.empty(65536, device="cuda")
    replay = {}

    def first():
        # Capture is part of the job: a user's first iteration builds the graph.
        x.fill_(1.0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm the kernels up outside the capture, as PyTorch asks
                for _ in range(8):
                    x.mul_(1.0000001)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(8):
                x.mul_(1.0000001)
        replay["graph"] = g

    def step():
        replay["graph"].replay()

    return first, step, 10


def train():
    width, layers, heads, batch, sequence, vocabulary = 1024, 8, 16, 8, 1024, 32768
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocabulary, width)
            self.position = torch.nn.Embedding(sequence, width)
            layer = torch.nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, vocabulary, bias=False)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
            h = self.blocks(self.embed(tokens) + self.position(positions), mask=mask, is_causal=True)
            return self.head(self.norm(h))

    with torch.device("meta"):
        model = Model()
    model = model.to_empty(device="cuda")
    state = {}

    def first():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        state["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        state["tokens"] = torch.randint(0, vocabulary, (batch, sequence + 1), device="cuda")

    def step():
        tokens = state["tokens"]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad(set_to_none=True)
        loss.item()

    return first, step, 1


def triton_job():
    import triton
    import triton.language as tl

    @triton.jit
    def fma(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside)
        y = tl.load(y_ptr + offsets, mask=inside)
        tl.store(y_ptr + offsets, x * 0.999 + y, mask=inside)

    n = 16 * 1024 * 1024
    x = torch.empty(n, device="cuda")
    y = torch.empty(n, device="cuda")

    def first():
        x.fill_(1.0)
        y.fill_(0.0)

    def step():
        fma[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)

    return first, step, 10


def streams():
    import threading

    count = 4
    pairs = [
        (torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16), torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16))
        for _ in range(count)
    ]
    outputs = [torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    side = [torch.cuda.Stream() for _ in range(count)]
    go = threading.Barrier(count + 1)
    launched = threading.Barrier(count + 1)

    def worker(index):
        a, b = pairs[index]
        with torch.cuda.stream(side[index]):
            while True:
                go.wait()
                for _ in range(8):
                    torch.mm(a, b, out=outputs[index])
                launched.wait()

    for index in range(count):
        threading.Thread(target=worker, args=(index,), daemon=True).start()

    def first():
        for a, b in pairs:
            a.normal_()
            b.normal_()

    def step():
        go.wait()
        launched.wait()

    return first, step, 10


JOBS = {
    "streams": streams,
    "smallops": smallops,
    "paused": paused,
    "gemm": gemm,
    "graph": graph,
    "train": train,
    "triton": triton_job,
}


def thread_state():
    """The calling thread's CPU, its count of involuntary context switches and its CPU time in
    seconds (user and system), with the wall-clock time they were read at; or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            # Fields after the command's closing parenthesis: utime and stime are fields 14 and
            # 15 of the line, the CPU field 39.
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = int(fields[36])
        on_cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open("/proc/thread-self/status") as f:
            preempted = next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt_switches"))
        return cpu, preempted, on_cpu, time.perf_counter()
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def measure(first, step, sync_every, seconds, iterations=None, states=None):
    """Runs first(), then step() with a synchronisation every sync_every steps, until `seconds`
    have passed since the first launch (or, given `iterations`, until that many are done).
    Returns the marks: (time from the first launch, iterations completed by then) at every
    synchronisation, starting with (0, 0). Given a list `states`, appends thread_state() at the
    start and at the first synchronisation after each whole second."""
    t0 = time.perf_counter()
    if states is not None:
        states.append(thread_state())
    first()
    marks = [(0.0, 0)]
    done = 0
    while True:
        for _ in range(sync_every):
            step()
        torch.cuda.synchronize()
        done += sync_every
        elapsed = time.perf_counter() - t0
        if states is not None and int(elapsed) >= len(states):
            # Seconds that began during a longer gap between synchronisations are unknown.
            while int(elapsed) > len(states):
                states.append(None)
            states.append(thread_state())
        marks.append((elapsed, done))
        if (done >= iterations) if iterations is not None else (elapsed >= seconds):
            return marks


def per_second_states(states, seconds):
    """The CPU each second began on, the preemptions in it (the next state's count less its own)
    and the % of it the thread was on a CPU; None for a second whose state, or the next one's, is
    unknown. (CPU time is counted in clock ticks, so the % is good to a few points.)"""
    states = states[: int(seconds) + 1]
    cpus = [None if state is None else state[0] for state in states[: int(seconds)]]
    pairs = list(zip(states, states[1:]))
    preempted = [None if a is None or b is None else b[1] - a[1] for a, b in pairs]
    busy = [
        None if a is None or b is None else round(100 * (b[2] - a[2]) / max(b[3] - a[3], 1e-9))
        for a, b in pairs
    ]
    return cpus, preempted, busy


def per_second(marks, seconds):
    """Iterations completed in each whole second up to `seconds`, interpolated between marks."""
    counts = []
    previous = 0.0
    for second in range(1, int(seconds) + 1):
        for (t_a, n_a), (t_b, n_b) in zip(marks, marks[1:]):
            if t_a <= second <= t_b:
                count = n_a + (n_b - n_a) * (second - t_a) / max(t_b - t_a, 1e-9)
                break
        else:
            count = float(marks[-1][1])
        counts.append(round(count - previous, 2))
        previous = count
    return counts


def main():
    job, seconds = sys.argv[1], float(sys.argv[2])
    start_at = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context, without a kernel
    first, step, sync_every = JOBS[job]()
    torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.001)
    states = []
    marks = measure(first, step, sync_every, seconds, states=states)
    elapsed, done = marks[-1]
    cpus, preempted, busy = per_second_states(states, seconds)
    print(
        json.dumps({
            "job": job, "per_second": per_second(marks, seconds), "mean": done / elapsed, "seconds": elapsed,
            "cpu_per_second": cpus, "preempted_per_second": preempted,
            "on_cpu_per_second": busy,
        }),
        flush=True,
    )


if __name__ == "__main__":
    main()
