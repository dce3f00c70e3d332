"""Summarises the compute limiter's debug lines (LIBCUDA_LOG_LEVEL=4) of one run: per launch key,
how its measurements compare with what its launches were charged, so that a job running over or
under its limit shows which kernels it is charged wrongly for.

    python3 tests/gpu/limiter_log.py <stderr file> [...]

A line per measurement reads "device index D key K measured M ns, charged C ns, correction X ns":
M is the raw event-bracket time, C the key's estimate when the launch was planned (before the
boost factor). The "over 5/4" column counts measurements over 5/4 of their charge, and "excess" is
their time beyond it, as a share of the key's measured time: how far a key's times spread above
its estimate (until 2026-12-01 a settled key's measurement counted for at most 5/4 of its
estimate, so that excess was not charged; see docs/compute-limit.md, "Long measurements"). The
first measurements of a key are charged the 1 ms prior; they are left out of the charged/measured
ratio. Where the lines say whether the stream had work queued when the sample began, what a
queued stream adds is shown too, and so is what the pairs of libraries before 2026-12-06 measured
a bracket on a queued stream to add. The boost factor's changes (by 0.01 or more; charges are the
plan times the factor, so a factor above 1 holds a job under its time share) are summarised too, and so are the per-period lines (about one a second): the share of wall
time the bucket charged, against NVML's utilisation, so that a job held under its limit shows
whether its charges exceed the GPU's busy time or the bucket admitted less than the limit, and the
trim NVML's utilisation sets on the charges (hook/src/throttle/correction.rs).
"""
import re
import sys
from collections import defaultdict

LINE = re.compile(
    r"device index (\d+) key ([0-9a-f]+) measured (\d+) ns, charged (\d+) ns, correction (-?\d+) ns(?:, stream (\w+))?"
)
PAIR = re.compile(r"device index (\d+) pair .* measured (\d+) ns, alone (\d+)\+(\d+) ns; queued bracket overhead now (\d+) ns")
PERIOD = re.compile(
    r"device (\d+) period (\d+) ms: charged ([\d.]+) of it, launches waited ([\d.]+) of it, (\d+) launches, "
    r"NVML utilisation (\d+|unknown)%?, (?:samples (?:([\d.]+)% of \d+|none), )?budget (-?\d+) us(?:, boost ([\d.]+))?"
    r"(?:, trim ([\d.]+))?"
)
BOOST = re.compile(r"device (\d+) boost factor ([\d.]+) \(busy share ([\d.]+)")
# As in hook/src/throttle/estimates.rs: PRIOR_NS.
PRIOR_NS = 1_000_000
# How far above its charge a measurement counts in the "over 5/4" and "excess" columns.
SPREAD = 1.25


def matches(paths, pattern):
    """The matches of `pattern` in the lines of the files, in order."""
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                match = pattern.search(line)
                if match:
                    yield match


def measurements(paths):
    """Every measurement line: (key, measured ns, charged ns, stream state or None: "queued" when
    the stream had work queued as the sample began, "idle" when not; None from libraries before
    2026-12-02)."""
    return [
        (match.group(2), int(match.group(3)), int(match.group(4)), match.group(6)) for match in matches(paths, LINE)
    ]


def per_key(found):
    """Measurements per key, in order: [(measured, charged)]."""
    keys = defaultdict(list)
    for key, measured, charged, _ in found:
        keys[key].append((measured, charged))
    return keys


def queued_line(found):
    """One line on what a queued stream adds: for keys sampled both on a queued and on an idle
    stream, the mean of (queued mean - idle mean), weighted by the key's queued samples. A kernel
    takes the same time either way, so the difference is what the bracket reads more on a queued
    stream than the overhead taken off for it."""
    states = [state for _, _, _, state in found if state]
    if not states:
        return None
    by_key = defaultdict(lambda: {"queued": [], "idle": []})
    for key, measured, charged, state in found:
        if state in ("queued", "idle") and charged != PRIOR_NS:
            by_key[key][state].append(measured)
    weighted = weight = 0
    for samples in by_key.values():
        if samples["queued"] and samples["idle"]:
            difference = sum(samples["queued"]) / len(samples["queued"]) - sum(samples["idle"]) / len(samples["idle"])
            weighted += difference * len(samples["queued"])
            weight += len(samples["queued"])
    both = sum(1 for samples in by_key.values() if samples["queued"] and samples["idle"])
    queued = states.count("queued")
    text = f"stream queued at {queued} of {len(states)} samples"
    if weight:
        text += f"; {both} keys sampled both ways: queued samples measure {weighted / weight / 1000:+.2f} us against idle ones"
    return text


def pair_line(paths):
    """One line on the pairs: how many counted, what each says a bracket adds (the two launches'
    readings alone less the pair's), and the overhead learned, first and last. None without pairs."""
    pairs = [
        (int(m.group(3)) + int(m.group(4)) - int(m.group(2)), int(m.group(5))) for m in matches(paths, PAIR)
    ]
    if not pairs:
        return None
    said = sorted(p for p, _ in pairs)
    return (
        f"pairs: {len(pairs)}; each says a queued bracket adds {said[len(said) // 2] / 1000:.2f} us (median, "
        f"quartiles {said[len(said) // 4] / 1000:.2f}-{said[3 * len(said) // 4] / 1000:.2f}); "
        f"learned {pairs[0][1] / 1000:.2f} us first, {pairs[-1][1] / 1000:.2f} us last"
    )


def boosts(paths):
    """The boost factor's changes, in order: [(device, factor, busy share or None)]. Libraries since
    2026-12-06 give the factor on every period line (the correction: boost and trim); older ones a
    line of its own at each change, with the busy share."""
    changes = [(int(match.group(1)), float(match.group(2)), float(match.group(3))) for match in matches(paths, BOOST)]
    last = {}
    for match in matches(paths, PERIOD):
        if match.group(9) is None:
            continue
        device, factor = int(match.group(1)), float(match.group(9))
        if abs(factor - last.get(device, 1.0)) >= 0.01:
            changes.append((device, factor, None))
        last[device] = factor
    return changes


def boost_line(changes):
    """One line on the boost factor: 1 throughout, or its changes' range and its last value."""
    if not changes:
        return "boost factor: no change logged (1.000 throughout)"
    factors = [factor for _, factor, _ in changes]
    shares = [share for _, _, share in changes if share is not None]
    known = f" (busy share {min(shares):.3f}-{max(shares):.3f})" if shares else ""
    return f"boost factor: {len(changes)} changes, {min(factors):.3f}-{max(factors):.3f}, last {factors[-1]:.3f}{known}"


def period_lines(paths):
    """Lines on the per-period records of each device: the charged share, NVML's utilisation (the
    mean of its samples over the period where the line has them) and the trim, period by period
    (periods of at least half a second), and their means from the 2nd on."""
    devices = defaultdict(list)
    for match in matches(paths, PERIOD):
        if int(match.group(2)) >= 500:
            rate = None if match.group(6) == "unknown" else float(match.group(6))
            nvml = float(match.group(7)) if match.group(7) else rate
            trim = float(match.group(10)) if match.group(10) else None
            devices[int(match.group(1))].append((float(match.group(3)), float(match.group(4)), nvml, trim))
    lines = []
    for device, periods in sorted(devices.items()):
        later = periods[1:] or periods
        charged = " ".join(f"{c * 100:.0f}" for c, _, _, _ in periods)
        nvml = " ".join("?" if n is None else f"{n:.0f}" for _, _, n, _ in periods)
        known = [n for _, _, n, _ in later if n is not None]
        nvml_mean = f"{sum(known) / len(known):.1f}" if known else "unknown"
        lines.append(
            f"device {device} charged % per period: {charged} | mean from the 2nd "
            f"{sum(c for c, _, _, _ in later) / len(later) * 100:.1f}, waited {sum(w for _, w, _, _ in later) / len(later) * 100:.1f}"
        )
        lines.append(f"device {device} NVML % per period:    {nvml} | mean from the 2nd {nvml_mean}")
        trims = [t for _, _, _, t in periods if t is not None]
        if trims:
            lines.append(f"device {device} trim per period: {' '.join(f'{t:.3f}' for t in trims)}")
    return lines


def summary(paths, top=12):
    """Text lines on the logs at `paths`: the whole run, the boost factor, what a queued stream
    adds (where the lines say), then the keys with the most measured time."""
    found = measurements(paths)
    rows = []
    total_measured = total_charged = total_cut = 0
    for key, samples in per_key(found).items():
        steady = [(m, c) for m, c in samples if c != PRIOR_NS]
        measured = sum(m for m, _ in steady)
        charged = sum(c for _, c in steady)
        over = [(m, c) for m, c in steady if m > c * SPREAD]
        cut = sum(m - c * SPREAD for m, c in over)
        total_measured += measured
        total_charged += charged
        total_cut += cut
        rows.append((measured, key, len(samples), len(steady), charged, len(over), cut))
    lines = []
    if not rows:
        return ["no limiter measurements (was LIBCUDA_LOG_LEVEL=4 set, and the job limited?)"]
    ratio = total_charged / total_measured if total_measured else float("nan")
    lines.append(
        f"{len(rows)} keys, {sum(r[2] for r in rows)} measurements; charged/measured {ratio:.3f} "
        f"(after the prior); time over 5/4 of the charge {total_cut / max(total_measured, 1) * 100:.1f}% of the measured"
    )
    lines.append(boost_line(boosts(paths)))
    lines.extend(period_lines(paths))
    for extra in (queued_line(found), pair_line(paths)):
        if extra:
            lines.append(extra)
    lines.append(f"{'key':>16} {'samples':>7} {'mean us':>9} {'charged/meas':>12} {'over 5/4':>8} {'excess %':>8}")
    for measured, key, count, steady, charged, over, cut in sorted(rows, reverse=True)[:top]:
        mean = measured / steady / 1000 if steady else 0.0
        ratio = charged / measured if measured else float("nan")
        lines.append(
            f"{key:>16} {count:>7} {mean:>9.1f} {ratio:>12.3f} {over:>8} {cut / max(measured, 1) * 100:>8.1f}"
        )
    return lines


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: limiter_log.py <stderr file> [...]")
    for line in summary(sys.argv[1:]):
        print(line)


if __name__ == "__main__":
    main()
