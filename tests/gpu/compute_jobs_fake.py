"""A stand-in for compute_jobs.py and compute_two_gpus.py that needs no GPU: it checks
compute_jobs_bench.py's own logic (plan, references, comparisons, multi-process and two-GPU
cases, failures, the summary) on any machine. Not a measurement. See tests/gpu/README.md:

    compute_jobs_fake.py <job> <seconds> [start_at]                  (as compute_jobs.py)
    compute_jobs_fake.py two-gpus gemm|smallops <seconds>|--work <n>  (as compute_two_gpus.py)

It prints at once what the real worker prints at the end of its run (its thread's CPUs and
preemptions per second made up too). A job has a made-up unlimited rate and natural share; with
LD_PRELOAD and CUDA_DEVICE_SM_LIMIT(_<device>) set it runs at min(limit, natural) / natural of
that rate, as a perfect limiter would hold it, except: the
first second runs at 60% (start-up) and a limited one 1.5 times faster (a burst), every second
has 1.5% of noise, processes of one region file share its limit (each appends its pid to the
file and counts the pids at its start time), and the paused job overshoots its target by 3
points, so that a run shows misses. COMPUTE_FAKE_CRASH="job:setting ..." (setting: native, unset
or the limit) makes those runs fail.
"""
import json
import os
import random
import sys
import time

RATES = {"smallops": 20000.0, "paused": 1500.0, "gemm": 4800.0, "graph": 30000.0, "train": 45.0, "triton": 19000.0, "streams": 3000.0}
NATURAL = {"smallops": 40.0, "paused": 20.0, "gemm": 100.0, "graph": 90.0, "train": 95.0, "triton": 100.0, "streams": 100.0}
OVERSHOOT = {"paused": 3.0}
# Two threads of one process share the interpreter: the small-op loop runs slower in each.
TWO_THREADS = {"gemm": 1.0, "smallops": 0.6}


def limit_of(device):
    if not os.environ.get("LD_PRELOAD"):
        return None
    value = os.environ.get(f"CUDA_DEVICE_SM_LIMIT_{device}") or os.environ.get("CUDA_DEVICE_SM_LIMIT") or "0"
    return int(value) if int(value) not in (0, 100) else None


def crash_if_asked(job):
    limit = limit_of(0)
    setting = "native" if not os.environ.get("LD_PRELOAD") else "unset" if limit is None else str(limit)
    if f"{job}:{setting}" in os.environ.get("COMPUTE_FAKE_CRASH", "").split():
        print(f"Traceback (most recent call last):\nRuntimeError: fake crash of {job} at {setting}", file=sys.stderr)
        sys.exit(1)


def sharers(start_at):
    """Processes of this region file at the start time (1 without the hook)."""
    region = os.environ.get("CUDA_DEVICE_MEMORY_SHARED_CACHE")
    if not os.environ.get("LD_PRELOAD") or not region:
        return 1
    with open(region, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(max(0.0, start_at - time.time()) + 0.2)
    with open(region) as f:
        return len(f.read().split())


def fraction(job, limit, sharing=1):
    """The rate a perfect limiter allows, as a fraction of the unlimited rate."""
    if limit is None:
        return 1.0
    return min(1.0, (min(limit / sharing, NATURAL[job]) + OVERSHOOT.get(job, 0.0)) / NATURAL[job])


def series(rate, held, seconds):
    return [
        round(rate * (0.6 * min(1.0, held * (1.5 if held < 1.0 else 1.0)) if s == 0 else held) * random.gauss(1, 0.015), 2)
        for s in range(int(seconds))
    ]


def two_gpus(job, how, amount):
    devices = []
    for device in (0, 1):
        rate = RATES[job] * TWO_THREADS[job] * fraction(job, limit_of(device))
        seconds = amount / rate * random.gauss(1, 0.01) if how == "--work" else amount
        per_second = series(RATES[job] * TWO_THREADS[job], fraction(job, limit_of(device)), seconds)
        done = amount if how == "--work" else sum(per_second)
        devices.append(
            {"device": device, "per_second": per_second, "mean": done / seconds, "seconds": seconds, "iterations": done}
        )
    print(json.dumps({"job": job, "devices": devices}))


def main():
    if sys.argv[1] == "two-gpus":
        crash_if_asked("two-" + sys.argv[2])
        how = sys.argv[3]
        two_gpus(sys.argv[2], how, float(sys.argv[4] if how == "--work" else how))
        return
    job, seconds = sys.argv[1], float(sys.argv[2])
    crash_if_asked(job)
    start_at = float(sys.argv[3]) if len(sys.argv) > 3 else time.time()
    held = fraction(job, limit_of(0), sharers(start_at))
    time.sleep(max(0.0, start_at - time.time()))
    per_second = series(RATES[job], held, seconds)
    # As compute_jobs.py records them: the first second's preemptions unknown, as after a long
    # first call.
    cpus = [s % 2 for s in range(int(seconds))]
    preempted = [None] + [s + 1 for s in range(int(seconds) - 1)]
    on_cpu = [None] + [100 - s for s in range(int(seconds) - 1)]
    print(json.dumps({
        "job": job, "per_second": per_second, "mean": sum(per_second) / seconds, "seconds": seconds + 0.003,
        "cpu_per_second": cpus, "preempted_per_second": preempted, "on_cpu_per_second": on_cpu,
    }))


if __name__ == "__main__":
    main()
