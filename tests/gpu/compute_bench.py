"""The compute limit accuracy benchmark (issue 4), run by tests/gpu/compute.sh.

    compute_bench.py <libvgpu.so> <compute_small binary> <work folder>

For each workload and each limit in 10, 25, 50, 75, 100 it runs the workload with the hook and
CUDA_DEVICE_SM_LIMIT, and five times without the hook (the unlimited run: before, between and
after the limited ones, and between the runs at limit 100; their median counts), and prints one
table:
throughput as % of the unlimited run, the GPU share that is (throughput x the workload's natural
share), the target min(limit, natural share) and the error. The natural share of a workload is
the fraction of wall time the GPU spends on it when nothing limits it: 100% for the GEMM loop
(GPU-bound); the unlimited rate x the GPU time of one iteration for the others, that time
calibrated by the small program with each kernel (graph) alone on an idle GPU, as a host-bound
loop runs them; for the pause job, 20 products at the unlimited GEMM rate. The table also gives
the limiter's own view (launches, mean charge per launch, time waited, read from the region) and
GPU 0's SM clock and power over the measured part: the GPU boosts when it is not saturated, so a
limited GEMM does more work per GPU-second than the unlimited one. Then two processes of one
region at 50, and two regions at 30 and 70, running the GEMM at the same time.

Host-bound loops vary by up to a third between processes on the VM, whatever the CPU pinning (the
small-kernel loop: 207k-305k launches/s, with or without the hook, results/2026-11-30-
h200-compute-pinning.txt). Where the limit binds, a workload's GPU share does not depend on the
unlimited rate (share = rate x GPU time per iteration); at limit 100 the row compares two rates,
so that limit runs three times, the second and third each after an unlimited run, and the
medians count.

Each run warms up for COMPUTE_WARMUP seconds before it is measured: the boost compensation
reads NVML once a second and moves halfway to its target at each reading, so it takes about
3 s to settle.

Environment: COMPUTE_POLICY (GPU_CORE_UTILIZATION_POLICY for the limited runs, e.g. FORCE for
HAMi-core, whose limiter is off until its watcher has read the switch), COMPUTE_SECONDS (measured seconds per point, default 3), COMPUTE_WARMUP (3),
COMPUTE_WORKLOADS (default "gemm small graph pause"), COMPUTE_LIMITS (default "10 25 50 75 100").
"""
import os
from statistics import median
import shutil
import struct
import subprocess
import sys
import time

HOOK, SMALL, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
SECONDS = float(os.environ.get("COMPUTE_SECONDS", "3"))
WARM_UP = float(os.environ.get("COMPUTE_WARMUP", "3"))
WORKLOADS = os.environ.get("COMPUTE_WORKLOADS", "gemm small graph pause").split()
LIMITS = [int(v) for v in os.environ.get("COMPUTE_LIMITS", "10 25 50 75 100").split()]
POLICY = os.environ.get("COMPUTE_POLICY", "")
PAUSE_PRODUCTS = 20
# Runs at limit 100 (the second and third each after an unlimited one): their median counts.
RUNS_AT_FULL = 3
# Launches per iteration of each workload (a product is one kernel; a graph replay one launch).
LAUNCHES_PER_ITERATION = {"gemm": 1, "small": 1, "graph": 1, "pause": PAUSE_PRODUCTS}
# The launching thread is pinned, as memory.sh pins its benchmark: host-bound loops vary less.
PIN = ["taskset", "-c", "2,3"] if shutil.which("taskset") and (os.cpu_count() or 1) >= 4 else []
# The region's compute state of device 0: extension offset + compute offset.
COMPUTE_AT = 2008952 + 50176

CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY", "GPU_CORE_UTILIZATION", "LD_PRELOAD"))
}
CLEAN_ENV["PYTHONUNBUFFERED"] = "1"


def command(workload, start_at=0.0, pin=True):
    timing = [str(start_at), str(WARM_UP), str(SECONDS)]
    prefix = PIN if pin else []
    if workload in ("gemm", "pause"):
        return prefix + [sys.executable, "tests/gpu/compute_torch.py", workload] + timing
    return prefix + [SMALL, workload] + timing


def environment(limit, region):
    env = dict(CLEAN_ENV)
    if limit is not None:
        if POLICY:
            env["GPU_CORE_UTILIZATION_POLICY"] = POLICY
        env.update(
            LD_PRELOAD=HOOK,
            CUDA_DEVICE_SM_LIMIT=str(limit),
            CUDA_DEVICE_MEMORY_SHARED_CACHE=os.path.join(WORK, region + ".cache"),
        )
        try:
            os.remove(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"])
        except FileNotFoundError:
            pass
    return env


def rate_of(output, what):
    for line in output.splitlines():
        if line.startswith("rate "):
            return float(line.split()[1])
    raise SystemExit(f"{what}: no rate in its output:\n{output}")


class Clocks:
    """Samples GPU 0's SM clock and power while a run goes on (the GPU boosts when it is not
    saturated, so a limited run can do more work per GPU-second than the unlimited one)."""

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-i", "0", "-lms", "200"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *_):
        out = ""
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate()
        samples = []
        for line in out.splitlines():
            try:
                clock, power = (float(v) for v in line.split(","))
                samples.append((clock, power))
            except ValueError:
                pass
        # The measured part is the end of the run: the last SECONDS at 5 samples a second.
        tail = samples[-int(SECONDS * 5):] or [(0.0, 0.0)]
        self.sm_mhz = sum(c for c, _ in tail) / len(tail)
        self.watts = sum(p for _, p in tail) / len(tail)


def run(workload, limit=None, region="r"):
    """One run; returns (iterations/s, the limiter's stats from the region or None, clocks)."""
    what = f"{workload} at {limit if limit is not None else 'native'}"
    with Clocks() as clocks:
        result = subprocess.run(command(workload), env=environment(limit, region), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return rate_of(result.stdout, what), (stats(region) if limit is not None else None), clocks


def stats(region):
    """launches, mean charge per launch (us) and total wait (s) from the region's bucket."""
    try:
        with open(os.path.join(WORK, region + ".cache"), "rb") as f:
            f.seek(COMPUTE_AT)
            budget, refilled, busy, wait, launches = struct.unpack("<qQQQQ", f.read(40))
    except (OSError, struct.error):
        return None  # not our region (HAMi-core's has no extension)
    return launches, (busy / launches / 1e3 if launches else 0.0), wait / 1e9


def together(runs):
    """Starts several (workload, limit, region) runs at once, aligned on one start time."""
    start_at = time.time() + 12  # PyTorch takes a few seconds to import and initialise
    procs = [
        subprocess.Popen(command(w, start_at, pin=False), env=environment(l, r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for w, l, r in runs
    ]
    rates = []
    for proc, (w, l, _) in zip(procs, runs):
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"{w} at {l} failed:\n{stdout}\n{stderr}")
        rates.append(rate_of(stdout, f"{w} at {l}"))
    return rates


def calibrate():
    out = subprocess.run([SMALL, "calibrate"], env=CLEAN_ENV, capture_output=True, text=True, check=True).stdout.split()
    return float(out[1]), float(out[3]), float(out[5]), float(out[7])


def main():
    small_ns, graph_ns, small_alone_ns, graph_alone_ns = calibrate()
    print(
        f"calibration: small kernel {small_ns / 1e3:.2f} us when launches overlap, {small_alone_ns / 1e3:.2f} us alone;"
        f" graph of 32 {graph_ns / 1e3:.1f} us overlapping, {graph_alone_ns / 1e3:.1f} us alone"
    )
    native = {}
    rows = []
    for workload in WORKLOADS:
        print(f"{workload}:", flush=True)
        unlimited = [run(workload)]
        native_clock = unlimited[0][2].sm_mhz
        results = []
        for position, limit in enumerate(LIMITS):
            tries = [run(workload, limit, f"{workload}-{limit}")]
            for _ in range(RUNS_AT_FULL - 1 if limit >= 100 else 0):
                unlimited.append(run(workload))
                tries.append(run(workload, limit, f"{workload}-{limit}"))
            tries.sort(key=lambda one: one[0])
            results.append((limit,) + tries[len(tries) // 2])
            print(f"  limit {limit}: {' / '.join(f'{one[0]:.1f}' for one in tries)} it/s", flush=True)
            if position == len(LIMITS) // 2 - 1:
                unlimited.append(run(workload))
        unlimited.append(run(workload))
        rates = [rate for rate, _, _ in unlimited]
        base = median(rates)
        native[workload] = base
        if workload == "gemm":
            natural = 100.0
        elif workload == "small":
            # A host-bound loop: the GPU drains between launches, so each kernel runs alone.
            natural = min(100.0, base * small_alone_ns / 1e7)
            print(f"  (with the overlapping time, the natural share would be {min(100.0, base * small_ns / 1e7):.1f}%)")
        elif workload == "graph":
            natural = min(100.0, base * graph_alone_ns / 1e7)
            print(f"  (with the overlapping time, the natural share would be {min(100.0, base * graph_ns / 1e7):.1f}%)")
        else:
            gemm_rate = native.get("gemm") or run("gemm")[0]
            natural = min(100.0, base * PAUSE_PRODUCTS / gemm_rate * 100.0)
        print(
            f"  unlimited {' / '.join(f'{rate:.1f}' for rate in rates)} it/s, median {base:.1f} (SM {native_clock:.0f} MHz),"
            f" natural share {natural:.1f}%",
            flush=True,
        )
        for limit, rate, limiter, clocks in results:
            throughput = rate / base * 100.0
            share = throughput * natural / 100.0
            target = min(float(limit), natural)
            # What the limiter itself counted: GPU time per iteration at its mean charge.
            counted = rate * LAUNCHES_PER_ITERATION[workload] * limiter[1] / 1e4 if limiter else None
            rows.append((workload, limit, rate, throughput, share, target, share - target, limiter, clocks, counted))

    print()
    print(
        "| workload | limit | it/s | throughput % of unlimited | GPU share % | target % | error"
        " | limiter: launches, mean charge us, waited s | GPU time counted by the limiter % | SM MHz, W |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for workload, limit, rate, throughput, share, target, error, limiter, clocks, counted in rows:
        lim = f"{limiter[0]}, {limiter[1]:.1f}, {limiter[2]:.1f}" if limiter else "-"
        counted_text = f"{counted:.1f}" if counted is not None and limiter[0] else "-"
        print(
            f"| {workload} | {limit} | {rate:.1f} | {throughput:.1f} | {share:.1f} | {target:.1f} | {error:+.1f}"
            f" | {lim} | {counted_text} | {clocks.sm_mhz:.0f}, {clocks.watts:.0f} |"
        )
    errors = [abs(row[6]) for row in rows]
    if errors:
        print(f"\nmean absolute error {sum(errors) / len(errors):.2f} points, max {max(errors):.2f} points, over {len(errors)} pairs")

    if "gemm" in native:
        base = native["gemm"]
        a, b = together([("gemm", 50, "two"), ("gemm", 50, "two")])
        print(f"\ntwo processes, one region, limit 50, GEMM: {a / base * 100:.1f}% + {b / base * 100:.1f}% = {(a + b) / base * 100:.1f}% of the unlimited rate")
        a, b = together([("gemm", 30, "split-30"), ("gemm", 70, "split-70")])
        total = a + b
        print(
            f"two regions at 30 and 70, GEMM at the same time: {a / base * 100:.1f}% and {b / base * 100:.1f}% of the unlimited rate"
            f" (split {a / total * 100:.1f}:{b / total * 100:.1f})"
        )


if __name__ == "__main__":
    main()
