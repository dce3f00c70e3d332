"""How long the compute limiter held a run's launches, second by second: `vgpu-smi --watch
--record` samples the region's limiter counters (docs/monitoring.md, `limiter.held_ns`) while the
run goes on, and the held time gained over each second of the run is read back from the record.
A job slower than its limit suggests that the limiter did not hold was slowed by something else
(the host, another process).

As a module: Recorder(region, smi) ... stop(), then held_per_second(...). As a script (the
suite's CI test reads a real record with it):

    limiter_record.py <record.jsonl> <first launch, Unix seconds> <seconds> [device index]

prints the held % of each second and their mean, one line.
"""
import json
import subprocess
import sys
import time

# Samples per second of the recorder: enough to split a run into its seconds.
PERIOD_S = 0.1


class Recorder:
    """`vgpu-smi --watch --record` of one region file while runs go on (the file may not exist
    yet: those samples carry an error and are skipped)."""

    def __init__(self, region, smi, record):
        self.record = record
        self.proc = subprocess.Popen(
            [smi, "--region", region, "--watch", str(PERIOD_S), "--record", record],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # The run's first second must come after the first sample (at most 5 s: then the seconds
        # before the first sample read "?").
        deadline = time.time() + 5
        while time.time() < deadline and self.proc.poll() is None and not self._has_a_sample():
            time.sleep(0.02)

    def _has_a_sample(self):
        try:
            with open(self.record) as f:
                return "\n" in f.read(1 << 16)
        except OSError:
            return False

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def samples(record, device=0):
    """(Unix seconds, held ns) of each sample where the region had limiter counters for `device`;
    samples from before the region file was made (an error: missing, or not initialised yet)
    count as 0, so that the run's first second is covered."""
    found = []
    try:
        f = open(record)
    except OSError:
        return found
    with f:
        for line in f:
            try:
                report = json.loads(line)
                regions = report["regions"]
                at = report["time_unix_ms"] / 1000.0
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short when the recorder was stopped
            for region in regions:
                if region.get("error") and not found:
                    found.append((at, 0))
                for entry in region.get("devices") or []:
                    limiter = entry.get("limiter")
                    if entry.get("index") == device and limiter:
                        found.append((at, limiter["held_ns"]))
    return found


def value_at(points, at):
    """The counter at time `at`, interpolated between samples; None outside them."""
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= at <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (at - t0) / (t1 - t0)
    return None


def held_per_second(record, first_launch, seconds, device=0):
    """Per second of the run from its first launch: % of it the limiter held launches (summed
    over threads, so a process of several threads can pass 100); None where unsampled."""
    points = samples(record, device)
    shares = []
    for second in range(int(seconds)):
        start = value_at(points, first_launch + second)
        end = value_at(points, first_launch + second + 1)
        shares.append(None if start is None or end is None else max(end - start, 0) / 1e7)
    return shares


def held_text(shares):
    """The shares as one line, or "" when none was sampled."""
    known = [share for share in shares if share is not None]
    if not known:
        return ""
    per_second = " ".join("?" if share is None else f"{share:.0f}" for share in shares)
    return f"held by the limiter, % of each second: {per_second} | mean {sum(known) / len(known):.1f}"


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__.split("\n\n")[2])
    device = int(sys.argv[4]) if len(sys.argv) == 5 else 0
    print(held_text(held_per_second(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), device)) or "no samples")
