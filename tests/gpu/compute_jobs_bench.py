"""The compute limit on jobs as users run them, second by second (run by tests/gpu/compute_jobs.sh).

    compute_jobs_bench.py <libvgpu.so> <work folder>

compute_bench.py measures a steady state: each of its processes warms up for seconds before its
rate counts. A user's job is held from its first kernel launch, start-up included (module loading,
cuBLAS's initialisation, Triton's first call, a CUDA graph's capture). This benchmark runs the jobs
of compute_jobs.py from their first launch with no warm-up inside the measured process, and
compares each second of a limited run with the same second of the job run without the hook.

For each job in COMPUTE_JOBS and each setting in COMPUTE_LIMITS (a percent, or "unset": the hook
preloaded without CUDA_DEVICE_SM_LIMIT) the job runs COMPUTE_SECONDS seconds:
- once untimed (3 s, discarded), so that the on-disk JIT caches (Triton's ~/.triton, the CUDA
  compute cache) are warm: on a cold cache the first native run would include compilation;
- natively (no hook) before, between the two halves of, and after the limited runs: for each
  second s the mean of the three native runs' second s is the reference for second s, so the
  start-up costs are in the reference as they are in the limited run, and a drift of the job's
  rate over the series is followed; each native run is also scored against the others as a
  limited point is (the job's own spread);
- with the hook at each setting: LD_PRELOAD, CUDA_DEVICE_SM_LIMIT, a fresh region file
  (CUDA_DEVICE_MEMORY_SHARED_CACHE, deleted before the run) and GPU_CORE_UTILIZATION_POLICY from
  COMPUTE_POLICY if set; CUDA_DEVICE_SM_LIMIT*, CUDA_DEVICE_MEMORY*, GPU_CORE_UTILIZATION* and
  LD_PRELOAD are never inherited.

The natural share N of a job is the GPU utilisation NVML reports while the job runs unlimited
(nvidia-smi every 100 ms, averaged over seconds 2..end of the native runs; the first second is
start-up): the fraction of time the GPU spends on the job when nothing holds it back, about 100
for a GPU-bound GEMM, less for host-bound loops. The limit caps that fraction, so for a limited
second s: throughput = rate_s / reference_s (%), GPU share = throughput x N / 100, target =
min(limit, N) (N when unset), error = share - target. A point's mean is its mean rate over the
mean reference. A point passes when every second from the 2nd is within 5 points of its target
and the mean within 2: the first second holds the start-up, where the limiter's first charges are
estimates, so it counts in the mean only. NVML's utilisation during each limited run is printed
too, as a cross-check of the share.

Then, on the GEMM job started together by a start time ~10 s ahead (after both have imported
PyTorch): two processes of one container (one region file, both at 50: their summed GPU share within 2
of 50), and two containers (two region files at 30 and 70: the split a/(a+b) within 3 of
30:70). Then, with two GPUs or more, compute_two_gpus.py (one thread per GPU, GEMM and small-op
loops) with CUDA_DEVICE_SM_LIMIT_0=25 and CUDA_DEVICE_SM_LIMIT_1=75 (each device against its own
target), and with CUDA_DEVICE_SM_LIMIT=25 and GPU_CORE_UTILIZATION_POLICY=FORCE on a fixed amount
of work per thread (~COMPUTE_SECONDS at 25%): the two threads must finish within 10% of each other.

The default matrix takes about 15 minutes, more than one call of the GPU machine: COMPUTE_PART=1
runs smallops, paused, gemm and the multi-process cases, COMPUTE_PART=2 graph, train, triton and
the two-GPU case, COMPUTE_PART=all everything. Without COMPUTE_PART or COMPUTE_JOBS, a plan over
9 minutes is refused with the commands to run instead. The planned time assumes START_UP seconds
per process outside its measured time; the report ends with the time it took.

Environment: COMPUTE_JOBS (default by part: "smallops paused gemm graph train triton streams"),
COMPUTE_LIMITS ("10 25 50 75 90 unset"), COMPUTE_SECONDS (10), COMPUTE_MULTI (0 skips the
multi-process cases; default 1, 0 in part 2), COMPUTE_POLICY, COMPUTE_GPUS (the number of GPUs,
instead of counting `nvidia-smi -L`), COMPUTE_NATURAL ("job=percent ...": natural shares instead of
NVML's; "two-gemm" and "two-smallops" name the two-GPU jobs), COMPUTE_WORKER and
COMPUTE_TWO_GPUS_WORKER (commands run by python3 instead of compute_jobs.py and
compute_two_gpus.py: compute_jobs_fake.py checks this script without a GPU), COMPUTE_CPUS (a CPU
list such as "0-3,8": every worker runs on those CPUs, the hook's threads included, to take the
CPU the scheduler picks out of a host-bound job's spread). The job runs on
CUDA device 0, sampled as nvidia-smi's GPU of that index (or the first entry of
CUDA_VISIBLE_DEVICES).
"""
import contextlib
from datetime import datetime
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time

import limiter_log  # beside this script (sys.path[0])
import limiter_record

HOOK, WORK = sys.argv[1], sys.argv[2]
# vgpu-smi records the limiter's counters of each hooked run (how long it held launches): beside
# the library (scripts/gpu-prepare.sh puts both in .device/), or VGPU_SMI; without it, not shown.
VGPU_SMI = next(
    (
        path
        for path in (os.environ.get("VGPU_SMI"), os.path.join(os.path.dirname(HOOK), "vgpu-smi"), ".device/vgpu-smi")
        if path and os.path.isfile(path) and os.access(path, os.X_OK)
    ),
    None,
)
HERE = os.path.dirname(os.path.abspath(__file__))

# COMPUTE_PART: (jobs, multi-process cases, two-GPU case).
PARTS = {
    "1": ("smallops paused gemm", True, False),
    "2": ("graph train triton streams", False, True),
    # The two-GPU case alone (tests/gpu/two_gpus.sh, issue 15).
    "two": ("", False, True),
    "all": ("smallops paused gemm graph train triton streams", True, True),
}
PART = os.environ.get("COMPUTE_PART", "")
if PART not in ("", *PARTS):
    raise SystemExit(f"COMPUTE_PART={PART}: expected 1, 2, two or all")
PART_JOBS, PART_MULTI, PART_TWO_GPUS = PARTS[PART or "all"]
# The worker's jobs (compute_jobs.py's JOBS, which imports torch): a misspelt name would otherwise
# spend a native run and an untimed one before failing.
KNOWN_JOBS = PARTS["all"][0].split()


def jobs_from(variable, default):
    """The jobs named by an environment variable (default: `default`), each a known one."""
    jobs = os.environ.get(variable, default).split()
    for job in jobs:
        if job not in KNOWN_JOBS:
            raise SystemExit(f"{variable}: {job}: expected some of {' '.join(KNOWN_JOBS)}")
    return jobs


def settings_from(variable, default):
    """The settings named by an environment variable: percents from 1 to 100, or "unset"."""
    settings = os.environ.get(variable, default).split()
    for setting in settings:
        if setting != "unset" and not (setting.isdigit() and 1 <= int(setting) <= 100):
            raise SystemExit(f"{variable}: {setting}: expected a percent from 1 to 100 or unset")
    return settings


JOBS = jobs_from("COMPUTE_JOBS", PART_JOBS)
SETTINGS = settings_from("COMPUTE_LIMITS", "10 25 50 75 90 unset")
SECONDS = int(os.environ.get("COMPUTE_SECONDS", "10"))
MULTI = os.environ.get("COMPUTE_MULTI", "1" if PART_MULTI else "0") != "0"
POLICY = os.environ.get("COMPUTE_POLICY", "")
NATURAL = {
    job: float(percent)
    for job, percent in (item.split("=", 1) for item in os.environ.get("COMPUTE_NATURAL", "").split())
}
WORKER = [sys.executable, *shlex.split(os.environ.get("COMPUTE_WORKER", os.path.join(HERE, "compute_jobs.py")))]
TWO_GPUS_WORKER = [
    sys.executable,
    *shlex.split(os.environ.get("COMPUTE_TWO_GPUS_WORKER", os.path.join(HERE, "compute_two_gpus.py"))),
]
SMI = shutil.which("nvidia-smi")


def cpus_from(variable):
    """The CPUs named by an environment variable ("0-3,8"), or None when it is unset or empty."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return None
    cpus = set()
    for item in text.split(","):
        first, _, last = item.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise SystemExit(f"{variable}={text}: expected a CPU list such as 0-3,8")
        cpus.update(range(int(first), int(last or first) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise SystemExit(f"{variable}={text}: not a set of CPUs this process may use ({sorted(allowed)})")
    return cpus


CPUS = cpus_from("COMPUTE_CPUS")
VISIBLE = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]

# Seconds a process takes outside its measured time (Python, importing PyTorch, the CUDA context,
# exit), for the plan only.
START_UP = 5.0
WARM_SECONDS = 3
# The multi-process runs start their clocks this far ahead, after both have imported PyTorch.
START_DELAY = 10.0
# One call of the GPU machine may run 10 minutes.
BUDGET_S = 540
SECOND_TOLERANCE = 5.0
MEAN_TOLERANCE = 2.0
SPLIT_TOLERANCE = 3.0
COMPLETION_TOLERANCE = 10.0  # percent
TWO_GPU_LIMITS = (25, 75)
TWO_GPU_FORCED = 25

CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_MEMORY", "GPU_CORE_UTILIZATION", "LD_PRELOAD"))
}
CLEAN_ENV["PYTHONUNBUFFERED"] = "1"

# With LIBCUDA_LOG_LEVEL=4 every limited point is followed by limiter_log.py's summary of its
# measurements (which keys are charged less or more than they measure).
DEBUG_LOG = os.environ.get("LIBCUDA_LOG_LEVEL") == "4"

MISSES = []  # what missed its target, for the summary
OWN_SPREAD = {}  # per job, each native run scored against the others (a Comparison each)
FAILURES = []  # runs that crashed or gave no result
OVERHEADS = []  # each single run's wall time outside its measured time


def hooked(region, **variables):
    """The environment of a run with the hook: a fresh region file in WORK, COMPUTE_POLICY, and
    the given variables (limits, a policy for this run)."""
    path = os.path.join(WORK, region + ".cache")
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    env = dict(CLEAN_ENV, LD_PRELOAD=HOOK, CUDA_DEVICE_MEMORY_SHARED_CACHE=path)
    if POLICY:
        env["GPU_CORE_UTILIZATION_POLICY"] = POLICY
    env.update(variables)
    return env


def setting_env(job, setting):
    """A setting of the matrix: None (native), "unset" or a percent."""
    if setting is None:
        return CLEAN_ENV
    region = f"{job}-{setting}"
    return hooked(region) if setting == "unset" else hooked(region, CUDA_DEVICE_SM_LIMIT=setting)


def gpu_of(ordinal):
    """nvidia-smi's id (index or UUID) of CUDA device `ordinal`: identical GPUs enumerate in bus
    order in both."""
    return VISIBLE[ordinal] if ordinal < len(VISIBLE) else str(ordinal)


def gpu_count():
    if "COMPUTE_GPUS" in os.environ:
        return int(os.environ["COMPUTE_GPUS"])
    if not SMI:
        return 1
    listing = subprocess.run([SMI, "-L"], capture_output=True, text=True).stdout
    count = sum(line.startswith("GPU ") for line in listing.splitlines())
    return min(count, len(VISIBLE)) if VISIBLE else count


class Sampler:
    """NVML's GPU utilisation, SM clock (MHz) and power (W) of every GPU every 100 ms while runs go
    on (nvidia-smi, into a file: a pipe could fill up), each sample timestamped by nvidia-smi."""

    FIELDS = ("utilization.gpu", "clocks.sm", "power.draw")

    def __init__(self):
        self.samples = {}
        self.path = os.path.join(WORK, "utilisation.csv")
        self.proc = None
        if SMI:
            query = "--query-gpu=timestamp,index,uuid," + ",".join(self.FIELDS)
            with open(self.path, "w") as out:
                self.proc = subprocess.Popen(
                    [SMI, query, "--format=csv,noheader,nounits", "-lms", "100"], stdout=out, stderr=subprocess.DEVNULL
                )

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait()
        with open(self.path) as f:
            for line in f:
                fields = [field.strip() for field in line.split(",")]
                if len(fields) != 3 + len(self.FIELDS):
                    continue
                try:
                    at = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    values = [float(field) for field in fields[3:]]
                except ValueError:
                    continue
                for key in fields[1:3]:
                    self.samples.setdefault(key, []).append((at, values))

    def mean(self, gpu, start, end, field="utilization.gpu"):
        """Mean of one field of `gpu` between two Unix times; None without samples."""
        column = self.FIELDS.index(field)
        values = [value[column] for at, value in self.samples.get(gpu, []) if start <= at <= end]
        return sum(values) / len(values) if values else None


class Run:
    """One worker process: its JSON result, when its first launch was, its stderr."""

    def __init__(self, name, argv, env):
        self.name = name
        self.started = time.time()
        self.stderr_path = os.path.join(WORK, name + ".err")
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        if CPUS is not None:
            # Before the interpreter has started a thread: the threads it starts inherit the set.
            with contextlib.suppress(ProcessLookupError):  # it has exited already: finish() says why
                os.sched_setaffinity(self.proc.pid, CPUS)
        self.lines = []  # (arrival time, line)
        self.reader = threading.Thread(target=self._read)
        self.reader.start()
        self.result = None
        self.failure = None
        self.sampler = None
        self.record = None  # the region's limiter counters while it ran (limiter_record.py)
        self._held = None  # held_shares(), read from the record once

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))

    def finish(self, timeout):
        """Waits for the process; sets result (and end: when its JSON line came, at the end of
        its measured time) or failure (the exit status and the tail of stderr and stdout)."""
        why = None
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            why = f"killed after {timeout:.0f} s"
        self.reader.join()
        self.wall = time.time() - self.started
        for arrived, line in reversed(self.lines):
            with contextlib.suppress(ValueError):
                result = json.loads(line)
                if isinstance(result, dict):
                    self.result, self.end = result, arrived
                    break
        if why is None and self.proc.returncode != 0:
            why = f"exit status {self.proc.returncode}"
        if why is None and self.result is None:
            why = "no JSON line in its output"
        if why is not None:
            self.result = None
            with open(self.stderr_path, errors="replace") as f:
                tail = f.read().splitlines()[-12:] + [line.rstrip() for _, line in self.lines[-3:]]
            self.failure = why + "".join(f"\n      {line}" for line in tail)
            FAILURES.append(self.name)
        return self

    @property
    def ok(self):
        return self.result is not None

    def utilisation(self, ordinal=0, seconds=None):
        """NVML's mean utilisation of CUDA device `ordinal` over seconds 2..end of the measured
        time (which ended when the JSON line came), or None."""
        if not self.ok or self.sampler is None:
            return None
        measured = seconds if seconds is not None else self.result["seconds"]
        first_launch = self.end - measured
        return self.sampler.mean(gpu_of(ordinal), first_launch + 1.0, first_launch + measured)

    def clock_power(self):
        """NVML's mean SM clock (MHz) and power (W) of CUDA device 0 over seconds 2..end of the
        measured time, as text (the boost factor follows them), or "" without samples."""
        if not self.ok or self.sampler is None:
            return ""
        window = (self.end - self.result["seconds"] + 1.0, self.end)
        clock = self.sampler.mean(gpu_of(0), *window, field="clocks.sm")
        power = self.sampler.mean(gpu_of(0), *window, field="power.draw")
        return "" if clock is None or power is None else f"SM {clock:.0f} MHz, {power:.0f} W"

    def held_shares(self):
        """The limiter's held % of each second of the measured time; [] without a record."""
        if not self.ok or self.record is None:
            return []
        if self._held is None:
            first_launch = self.end - self.result["seconds"]
            self._held = limiter_record.held_per_second(self.record, first_launch, self.result["seconds"])
        return self._held

    def held_mean(self):
        """The mean of the known held shares, or None."""
        known = [share for share in self.held_shares() if share is not None]
        return sum(known) / len(known) if known else None

    def held_text(self):
        """How long the limiter held launches in each second of the measured time (the region's,
        so every process of it), as one line; "" without a record."""
        return limiter_record.held_text(self.held_shares())


def execute(runs, timeout):
    """Starts the runs [(name, argv, env)] at once under one sampler and waits for them all; the
    region of each hooked run is recorded meanwhile (one recorder per region file)."""
    sampler = Sampler()
    recorders = {}
    for name, _, env in runs:
        region = env.get("CUDA_DEVICE_MEMORY_SHARED_CACHE")
        if VGPU_SMI and "LD_PRELOAD" in env and region and region not in recorders:
            record = os.path.join(WORK, name + ".record.jsonl")
            recorders[region] = limiter_record.Recorder(region, VGPU_SMI, record)
    started = [Run(name, argv, env) for name, argv, env in runs]
    for run in started:
        run.finish(timeout)
    sampler.stop()
    for recorder in recorders.values():
        recorder.stop()
    for run, (_, _, env) in zip(started, runs):
        run.sampler = sampler
        recorder = recorders.get(env.get("CUDA_DEVICE_MEMORY_SHARED_CACHE"))
        run.record = recorder.record if recorder else None
    return started


def run_job(job, setting=None, name=None, seconds=SECONDS):
    """One run of a job alone: native (setting None), "unset" or a percent; its stderr goes to
    WORK/<job>-<name or setting>.err."""
    name = f"{job}-{name or setting}"
    (run,) = execute([(name, WORKER + [job, str(seconds)], setting_env(job, setting))], seconds + 120)
    if run.ok:
        OVERHEADS.append(run.wall - run.result["seconds"])
    return run


def run_together(runs):
    """Runs of the GEMM job [(name, env)] whose clocks start together START_DELAY from now."""
    start_at = f"{time.time() + START_DELAY:.3f}"
    return execute([(name, WORKER + ["gemm", str(SECONDS), start_at], env) for name, env in runs], START_DELAY + SECONDS + 120)


def run_two(variant, env, name, work=None):
    """One run of compute_two_gpus.py: for SECONDS, or `work` iterations per thread."""
    how = ["--work", str(work)] if work else [str(SECONDS)]
    (run,) = execute([(f"two-{variant}-{name}", TWO_GPUS_WORKER + [variant, *how], env)], 4 * SECONDS + 120)
    if run.ok and not work:
        OVERHEADS.append(run.wall - max(device["seconds"] for device in run.result["devices"]))
    return run


def reference_of(series):
    """Per second, the mean of the native runs' series (those that ran)."""
    if not series:
        return None
    length = min(len(one) for one in series)
    return [sum(one[s] for one in series) / len(series) for s in range(length)]


def natural_of(key, readings):
    """The natural share (percent) and where it comes from."""
    if key in NATURAL:
        return NATURAL[key], "COMPUTE_NATURAL"
    readings = [reading for reading in readings if reading is not None]
    if not readings:
        return 100.0, "ASSUMED: no NVML samples and no COMPUTE_NATURAL"
    natural = sum(readings) / len(readings)
    measured = "NVML, seconds 2.. of " + " and ".join(f"{r:.1f}" for r in readings)
    if natural < 1.0:
        # A share of 0 would make every target 0 and every point pass.
        return 100.0, f"ASSUMED: {measured}, not a share NVML would read for a running job"
    return natural, measured


class Comparison:
    """A limited series against its reference: throughput % per second, GPU share, error against
    the target; the mean (mean rate over mean reference); the worst second from the 2nd."""

    def __init__(self, rates, reference, natural, target):
        length = min(len(rates), len(reference))
        rates, reference = rates[:length], reference[:length]
        self.throughput = [rate / ref * 100 if ref > 0 else None for rate, ref in zip(rates, reference)]
        self.target = target
        self.mean = sum(rates) / sum(reference) * 100 if sum(reference) > 0 else math.nan
        self.share = self.mean * natural / 100
        self.error = self.share - target
        later = [
            (t * natural / 100 - target, second)
            for second, t in enumerate(self.throughput, 1)
            if second >= 2 and t is not None
        ]
        self.worst, self.worst_second = max(later, key=lambda one: abs(one[0])) if later else (math.nan, None)
        self.seconds_ok = all(abs(error) <= SECOND_TOLERANCE for error, _ in later) and bool(later)
        self.mean_ok = abs(self.error) <= MEAN_TOLERANCE
        self.passed = self.seconds_ok and self.mean_ok

    def series(self):
        return " ".join("-" if t is None else f"{t:.0f}" for t in self.throughput)

    def text(self):
        worst = f"{self.worst:+.1f} (s{self.worst_second})" if self.worst_second else "-"
        return (
            f"{self.series()} | mean {self.mean:.1f} | share {self.share:.1f} target {self.target:.1f}"
            f" err {self.error:+.1f} | worst second from the 2nd: {worst}"
        )

    def why(self):
        """What missed, in words."""
        parts = []
        if not self.mean_ok:
            parts.append(f"mean {self.error:+.1f}")
        if not self.seconds_ok:
            parts.append(f"second {self.worst_second} {self.worst:+.1f}")
        return ", ".join(parts)


def against_natives(run, natives, natural, target):
    """`run` scored as a point, against the per-second mean of the native runs other than itself;
    None when no other native run is there."""
    reference = reference_of([other.result["per_second"] for other in natives if other is not run])
    return None if reference is None else Comparison(run.result["per_second"], reference, natural, target)


def verdict(ok):
    return "PASS" if ok else "MISS"


def series_text(values):
    return " ".join(f"{value:.0f}" for value in values)


def thread_text(run):
    """The CPU the job's thread began each second on, its preemptions in it and the % of it on a
    CPU (compute_jobs.py records them), as one line, or "" where the worker did not."""
    cpus = run.result.get("cpu_per_second") if run.ok else None
    if not cpus:
        return ""
    preempted = run.result.get("preempted_per_second") or []
    on_cpu = run.result.get("on_cpu_per_second") or []
    return (
        f"its thread's CPU per second: {known_text(cpus)} | preempted: {known_text(preempted)}"
        f" | % on a CPU: {known_text(on_cpu)}"
    )


def known_text(values):
    """Numbers as text, "?" for an unknown one."""
    return " ".join("?" if value is None else str(value) for value in values)


def failed(what, run):
    print(f"{what}: FAILED ({run.failure})", flush=True)


def measure_job(job):
    """The job's untimed run, native runs around its limited ones, one line per setting; returns
    the table rows, the natural share and the reference (None without a native run)."""
    print(f"\n## {job}", flush=True)
    warm = run_job(job, name="untimed", seconds=WARM_SECONDS)
    if not warm.ok:
        failed(f"{job} untimed first run", warm)
    natives = [run_job(job, name="native-1")]
    if not warm.ok and not natives[0].ok:
        failed(f"{job} native", natives[0])
        print(f"{job}: fails without the hook, its limited runs are skipped", flush=True)
        return [(job, setting, None, None, "native failed", None) for setting in SETTINGS], None, None
    # A native run between the two halves of the settings too: the reference then follows a drift
    # of the job's rate over the series (the GPU warming, say) instead of only its two ends.
    half = (len(SETTINGS) + 1) // 2
    limited = {setting: run_job(job, setting) for setting in SETTINGS[:half]}
    natives.append(run_job(job, name="native-2"))
    limited.update({setting: run_job(job, setting) for setting in SETTINGS[half:]})
    natives.append(run_job(job, name="native-3"))

    for position, run in enumerate(natives, 1):
        if not run.ok:
            failed(f"{job} native run {position}", run)
    ran = [run for run in natives if run.ok]
    reference = reference_of([run.result["per_second"] for run in ran])
    if reference is None:
        print(f"{job}: no native run, no reference", flush=True)
        return [(job, setting, None, None, "native failed", None) for setting in SETTINGS], None, None
    natural, source = natural_of(job, [run.utilisation() for run in ran])
    run_means = [run.result["mean"] for run in ran]
    means = ", ".join(f"{mean:.1f}" for mean in run_means)
    spread = ""
    if len(ran) >= 2:
        spread = f", {(max(run_means) - min(run_means)) / max(max(run_means), 1e-9) * 100:.1f}% apart at most"
    print(f"{job} native: {series_text(reference)} it/s per second (mean of {len(ran)} runs; run means {means} it/s{spread})")
    for position, run in enumerate(natives, 1):
        if thread_text(run):
            print(f"    native run {position}: {series_text(run.result['per_second'])} it/s; {thread_text(run)}")
    gpu = "; ".join(text for text in (run.clock_power() for run in ran) if text)
    print(f"{job} natural share: {natural:.1f}% ({source}){f'; {gpu}' if gpu else ''}", flush=True)
    if len(ran) >= 2:
        # The job's own spread, in the limited points' terms: each native run against the others.
        own = [against_natives(run, ran, natural, natural) for run in ran]
        OWN_SPREAD[job] = own
        print(
            f"{job} native against native (no hook, the job's own spread; each run against the others): "
            + "; ".join(f"err {c.error:+.1f}, worst second from the 2nd {c.worst:+.1f}" for c in own),
            flush=True,
        )

    rows = []
    for setting in SETTINGS:
        run = limited[setting]
        if not run.ok:
            failed(f"{job} {setting}", run)
            rows.append((job, setting, natural, None, "failed", None, None))
            continue
        target = natural if setting == "unset" else min(float(setting), natural)
        comparison = Comparison(run.result["per_second"], reference, natural, target)
        nvml = run.utilisation()
        nvml_text = f" | NVML {nvml:.0f}" if nvml is not None else ""
        clock_power = run.clock_power()
        if clock_power:
            nvml_text += f", {clock_power}"
        print(f"{job} {setting}: {comparison.text()}{nvml_text} | {verdict(comparison.passed)}", flush=True)
        if thread_text(run):
            print(f"    {thread_text(run)}")
        if run.held_text():
            print(f"    {run.held_text()}")
        if DEBUG_LOG:
            for line in limiter_log.summary([run.stderr_path]):
                print(f"    {line}")
        if not comparison.passed:
            held = run.held_mean()
            held_note = f"; held by the limiter {held:.1f}% of the time" if held is not None else ""
            MISSES.append(f"{job} {setting} ({comparison.why()}{held_note})")
        rows.append((job, setting, natural, comparison, None, nvml, run.held_mean()))
    return rows, natural, reference


def gemm_reference():
    """The GEMM job's natural share and reference when the matrix did not run it: an untimed run
    and two native runs."""
    print("\n## gemm (reference for the multi-process cases)", flush=True)
    run_job("gemm", name="untimed", seconds=WARM_SECONDS)
    natives = [run for run in (run_job("gemm", name="native-1"), run_job("gemm", name="native-2")) if run.ok]
    reference = reference_of([run.result["per_second"] for run in natives])
    if reference is None:
        print("gemm: no native run, the multi-process cases are skipped")
        return None, None
    natural, source = natural_of("gemm", [run.utilisation() for run in natives])
    print(f"gemm native: {series_text(reference)} it/s per second; natural share {natural:.1f}% ({source})", flush=True)
    return natural, reference


def alignment(runs):
    """How far apart the runs' first launches were, and the GPU's mean SM clock and power over
    seconds 2.. of the first run (the boost factor follows them)."""
    starts = [run.end - run.result["seconds"] for run in runs]
    clock_power = runs[0].clock_power()
    gpu = f"; {clock_power}" if clock_power else ""
    return f"first launches {max(starts) - min(starts):.2f} s apart{gpu}"


def multi(natural, reference):
    """Two processes of one region at 50; two regions at 30 and 70; GEMM, started together."""
    print("\n## two processes of one container (one region file), both at limit 50, GEMM", flush=True)
    env = hooked("one-region", CUDA_DEVICE_SM_LIMIT="50")
    runs = run_together([("one-region-a", env), ("one-region-b", env)])
    for name, run in zip("ab", runs):
        if not run.ok:
            failed(f"process {name}", run)
    if all(run.ok for run in runs):
        for name, run in zip("ab", runs):
            alone = Comparison(run.result["per_second"], reference, natural, 25.0)  # half of the region's 50
            print(f"process {name}: {alone.series()} | mean {alone.mean:.1f}")
        total = [a + b for a, b in zip(runs[0].result["per_second"], runs[1].result["per_second"])]
        both = Comparison(total, reference, natural, min(50.0, natural))
        print(
            f"sum: {both.text()} | {verdict(both.mean_ok)} (mean within {MEAN_TOLERANCE:.0f})"
            f" | {alignment(runs)}",
            flush=True,
        )
        if runs[0].held_text():
            print(f"    both processes {runs[0].held_text()}")
        if not both.mean_ok:
            MISSES.append(f"two processes of one region at 50 (sum: mean {both.error:+.1f})")

    print("\n## two containers (two region files) at 30 and 70, GEMM", flush=True)
    runs = run_together(
        [("split-30", hooked("split-30", CUDA_DEVICE_SM_LIMIT="30")), ("split-70", hooked("split-70", CUDA_DEVICE_SM_LIMIT="70"))]
    )
    for limit, run in zip((30, 70), runs):
        if not run.ok:
            failed(f"container at {limit}", run)
    if all(run.ok for run in runs):
        shares = []
        for limit, run in zip((30, 70), runs):
            one = Comparison(run.result["per_second"], reference, natural, min(float(limit), natural))
            shares.append(one)
            print(f"container at {limit}: {one.text()}")
            if run.held_text():
                print(f"    {run.held_text()}")
        split = [
            a / (a + b) * 100 if a is not None and b is not None and a + b > 0 else None
            for a, b in zip(shares[0].throughput, shares[1].throughput)
        ]
        mean_split = shares[0].mean / (shares[0].mean + shares[1].mean) * 100
        ok = abs(mean_split - 30) <= SPLIT_TOLERANCE
        seconds = " ".join("-" if s is None else f"{s:.0f}" for s in split)
        print(
            f"split (share of the one at 30): {seconds} | mean {mean_split:.1f}:{100 - mean_split:.1f}"
            f" (target 30:70 within {SPLIT_TOLERANCE:.0f}) | {verdict(ok)} | {alignment(runs)}",
            flush=True,
        )
        if not ok:
            MISSES.append(f"two containers at 30 and 70 (split {mean_split:.1f}:{100 - mean_split:.1f})")


def two_gpus(count):
    """One process, one thread per GPU: per-device limits 25 and 75; then a global 25 with FORCE
    on a fixed amount of work per thread, whose completion times must agree."""
    if count < 2:
        print(f"\ntwo GPUs: skipped ({count} GPU)", flush=True)
        return
    print(f"\n## two GPUs in one process, one thread per GPU ({count} GPUs; cuda:0 and cuda:1)", flush=True)
    for variant in ("gemm", "smallops"):
        natives = [run_two(variant, CLEAN_ENV, "native-1")]
        limits = {f"CUDA_DEVICE_SM_LIMIT_{device}": str(limit) for device, limit in enumerate(TWO_GPU_LIMITS)}
        limited = run_two(variant, hooked(f"two-{variant}", **limits), "limited")
        natives.append(run_two(variant, CLEAN_ENV, "native-2"))
        for position, run in enumerate(natives, 1):
            if not run.ok:
                failed(f"two GPUs {variant} native run {position}", run)
        ran = [run for run in natives if run.ok]
        if not ran:
            print(f"two GPUs {variant}: no native run, no reference", flush=True)
            continue
        naturals, references, rates = [], [], []
        for device in (0, 1):
            reference = reference_of([run.result["devices"][device]["per_second"] for run in ran])
            readings = [run.utilisation(device, run.result["devices"][device]["seconds"]) for run in ran]
            natural, source = natural_of(f"two-{variant}", readings)
            naturals.append(natural)
            references.append(reference)
            rates.append(sum(run.result["devices"][device]["mean"] for run in ran) / len(ran))
            print(
                f"two GPUs {variant} cuda:{device} native: {series_text(reference)} it/s per second;"
                f" natural share {natural:.1f}% ({source})"
            )
        if not limited.ok:
            failed(f"two GPUs {variant} at {TWO_GPU_LIMITS[0]}/{TWO_GPU_LIMITS[1]}", limited)
        else:
            for device, limit in enumerate(TWO_GPU_LIMITS):
                result = limited.result["devices"][device]
                one = Comparison(result["per_second"], references[device], naturals[device], min(float(limit), naturals[device]))
                nvml = limited.utilisation(device, result["seconds"])
                nvml_text = f" | NVML {nvml:.0f}" if nvml is not None else ""
                print(f"two GPUs {variant} cuda:{device} at {limit}: {one.text()}{nvml_text} | {verdict(one.passed)}", flush=True)
                if not one.passed:
                    MISSES.append(f"two GPUs {variant} cuda:{device} at {limit} ({one.why()})")

        natural = sum(naturals) / 2
        fraction = min(TWO_GPU_FORCED, natural) / natural
        sync_every = 10  # both loops count iterations in tens
        work = math.ceil(sum(rates) / 2 * fraction * SECONDS / sync_every) * sync_every
        forced = run_two(
            variant,
            hooked(f"two-{variant}-forced", CUDA_DEVICE_SM_LIMIT=str(TWO_GPU_FORCED), GPU_CORE_UTILIZATION_POLICY="FORCE"),
            "forced",
            work=work,
        )
        what = f"two GPUs {variant}, CUDA_DEVICE_SM_LIMIT={TWO_GPU_FORCED} FORCE, {work} iterations per thread"
        if not forced.ok:
            failed(what, forced)
            continue
        times = [device["seconds"] for device in forced.result["devices"]]
        apart = abs(times[0] - times[1]) / max(times) * 100
        ok = apart <= COMPLETION_TOLERANCE
        print(
            f"{what}: cuda:0 done in {times[0]:.2f} s, cuda:1 in {times[1]:.2f} s (~{SECONDS} s expected):"
            f" {apart:.1f}% apart (within {COMPLETION_TOLERANCE:.0f}%) | {verdict(ok)}",
            flush=True,
        )
        if not ok:
            MISSES.append(f"{what} (completion times {apart:.1f}% apart)")


def planned_s(jobs, multi_cases, two):
    """Wall time of a plan, START_UP per process outside its measured time."""
    run = SECONDS + START_UP
    total = len(jobs) * (WARM_SECONDS + START_UP + (3 + len(SETTINGS)) * run)
    if multi_cases:
        if "gemm" not in jobs:
            total += WARM_SECONDS + START_UP + 2 * run
        total += 2 * (START_DELAY + SECONDS + 1)
    if two:
        total += 8 * run  # per loop: two native runs, the per-device limits, the fixed work
    return total


def summary(rows):
    print("\n## summary\n")
    print(
        "| job | limit | natural share % | mean throughput % | GPU share % | target % | mean error"
        " | worst error from the 2nd second | NVML % | held by the limiter % | result |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for job, setting, natural, c, failure, nvml, held in rows:
        natural_text = f"{natural:.1f}" if natural is not None else "-"
        if c is None:
            print(f"| {job} | {setting} | {natural_text} | - | - | - | - | - | - | - | {failure} |")
            continue
        worst = f"{c.worst:+.1f} (s{c.worst_second})" if c.worst_second else "-"
        nvml_text = f"{nvml:.0f}" if nvml is not None else "-"
        held_text = f"{held:.1f}" if held is not None else "-"
        print(
            f"| {job} | {setting} | {natural_text} | {c.mean:.1f} | {c.share:.1f} | {c.target:.1f} | {c.error:+.1f}"
            f" | {worst} | {nvml_text} | {held_text} | {verdict(c.passed)} |"
        )
    if OWN_SPREAD:
        print(
            "\neach job's native runs against each other (its own spread; error of the mean / worst second): "
            + "; ".join(
                f"{job} "
                + " and ".join(f"{c.error:+.1f}/{c.worst:+.1f}" for c in own)
                + ("" if all(c.passed for c in own) else " (MISS)")
                for job, own in OWN_SPREAD.items()
            )
        )
    measured = [(job, setting, c) for job, setting, _, c, _, _, _ in rows if c is not None]
    if measured:
        mae = sum(abs(c.error) for _, _, c in measured) / len(measured)
        print(f"\nmean absolute error of the means: {mae:.2f} points over {len(measured)} points")
        job, setting, c = max(
            ((job, setting, c) for job, setting, c in measured if c.worst_second),
            key=lambda one: abs(one[2].worst),
            default=(None, None, None),
        )
        if c is not None:
            print(
                f"largest per-second error from the 2nd second: {c.worst:+.1f} points"
                f" ({job} {setting}, second {c.worst_second})"
            )
        misses = sum(not c.passed for _, _, c in measured)
        print(
            f"points that miss (a second from the 2nd over {SECOND_TOLERANCE:.0f} points, or the mean over"
            f" {MEAN_TOLERANCE:.0f}): {misses} of {len(measured)}"
        )
    unmeasured = len(rows) - len(measured)
    if unmeasured:
        print(f"points not measured (a run failed): {unmeasured}")


def main():
    count = gpu_count()
    two = PART_TWO_GPUS and count >= 2
    plan = planned_s(JOBS, MULTI, two)
    gpus = f"{count} GPU" + ("s" if count != 1 else "")
    print(
        f"plan: jobs {' '.join(JOBS) or '-'}; settings {' '.join(SETTINGS)}; {SECONDS} s per point;"
        f" multi-process cases {'yes' if MULTI else 'no'}; two GPUs {'yes' if two else 'no'} ({gpus});"
        f" about {plan / 60:.1f} min ({START_UP:.0f} s of start-up assumed per process)",
        flush=True,
    )
    if plan > BUDGET_S:
        parts = ", ".join(
            f"COMPUTE_PART={p} about {planned_s(jobs.split(), multi_cases, two_cases and count >= 2) / 60:.1f} min"
            for p, (jobs, multi_cases, two_cases) in PARTS.items()
            if p in ("1", "2")
        )
        if not PART and "COMPUTE_JOBS" not in os.environ:
            print(
                f"the default matrix does not fit one 9-minute call: run it in two calls ({parts}),"
                " or COMPUTE_PART=all for everything in one",
                flush=True,
            )
            sys.exit(2)
        print(f"note: over 9 minutes ({parts})", flush=True)
    if not SMI:
        print("nvidia-smi not found: natural shares from COMPUTE_NATURAL (100 where missing)", flush=True)
    began = time.time()

    rows = []
    references = {}  # job: (natural share, reference)
    for job in JOBS:
        job_rows, natural, reference = measure_job(job)
        rows += job_rows
        references[job] = (natural, reference)
    if MULTI:
        natural, reference = references["gemm"] if "gemm" in references else gemm_reference()
        if reference is not None:
            multi(natural, reference)
        else:
            print("\nmulti-process cases: skipped (no native GEMM run)", flush=True)
    if PART_TWO_GPUS:
        two_gpus(count)
    else:
        print("\ntwo GPUs: in COMPUTE_PART=2", flush=True)

    summary(rows)
    if FAILURES:
        print(f"failed runs: {', '.join(FAILURES)}")
    if MISSES:
        print("missed targets: " + "; ".join(MISSES))
    else:
        print("missed targets: none" + (" of those measured (some runs failed)" if FAILURES else ", every target is met"))
    overhead = sum(OVERHEADS) / len(OVERHEADS) if OVERHEADS else 0.0
    overhead_text = f"; start-up and exit outside the measured time: {overhead:.1f} s per process" if overhead > 0 else ""
    print(f"took {(time.time() - began) / 60:.1f} min (planned {plan / 60:.1f}){overhead_text}", flush=True)


if __name__ == "__main__":
    main()
