"""What compute-jobs reports say about the boost compensation's constants (hook/src/throttle/boost.rs):
for a maintainer checking them on another GPU, another driver or another day, from the reports
tests/gpu/compute_jobs.sh already writes.

    boost_fit.py [--job gemm] [--limit-watts 700] [--rated-watts W] [--heaviest 1.3]
                 [--max-mhz 1980] [--min-busy 20] <report> [...]

A report gives, for the job's native runs, the SM clock and power busy all the time (its full-load
clock `f_full`), and for each limited point the GPU share (its throughput against the native
runs, times their busy share), NVML's busy share `s` of the GPU, the SM clock `f` and the power
`P`. For each point where NVML saw the GPU busy at least --min-busy percent (NVML's figure is in
whole percent) and the clock at least 2% above the full-load one, it prints:

- speed-up: the work done per busy second against the native runs' (GPU share / `s`), which is
  the factor the point needed; kernel time ~ clock^-BETA gives BETA = ln(speed-up) / ln(f / f_full);
- over: the dynamic power at full load that the model infers, `(P - P_idle) / s / (P_cap - P_idle)`
  (idle: 17% of the rated power), which it turns into a factor as over^(BETA / ALPHA); dynamic
  power ~ clock^ALPHA gives ALPHA = ln(over) / ln(f / f_full);
- the model's factor (over^(BETA / ALPHA)) and the clock's bound ((f / f_floor)^BETA).

The constants (IDLE_SHARE, ALPHA, BETA, HEAVIEST_WORK) are read from boost.rs itself, so the
check follows the library it describes; --heaviest tries another HEAVIEST_WORK.

Then the medians of BETA and ALPHA against boost.rs's, and the floor check: no GPU busy all the
time should run below `f_floor = f_max * ((P_cap - P_idle) / (HEAVIEST_WORK * P_rated))^(1/ALPHA)`,
or the bound cuts the boost of every point held partly down by power (the GEMM at 90 on
2026-12-03: floor 1549 MHz, full load 1478-1494 MHz).
"""
import argparse
import math
import os
import re
import statistics

BOOST_RS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "hook", "src", "throttle", "boost.rs")


def boost_constants(path=BOOST_RS):
    """The model's constants as boost.rs defines them (`pub const NAME: f64 = value;`)."""
    with open(path, encoding="utf-8") as source:
        text = source.read()
    found = dict(re.findall(r"^pub const (\w+): f64 = ([\d.]+);", text, re.M))
    names = ("IDLE_SHARE", "ALPHA", "BETA", "HEAVIEST_WORK")
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"{path}: no f64 constant {', '.join(missing)}")
    return {name: float(found[name]) for name in names}


CONSTANTS = boost_constants()
IDLE_SHARE, ALPHA, BETA = CONSTANTS["IDLE_SHARE"], CONSTANTS["ALPHA"], CONSTANTS["BETA"]
# A point whose clock is within this share of the full-load clock has no boost to fit: the
# exponents would divide by the log of a ratio near 1.
MIN_BOOST = 0.02

NATURAL = re.compile(r"^(\w+) natural share: ([\d.]+)%.*?;(?P<clocks>(?: SM \d+ MHz, \d+ W;?)+)\s*$")
CLOCK = re.compile(r"SM (\d+) MHz, (\d+) W")
POINT = re.compile(
    r"^(\w+) (\d+): .*\| share ([\d.]+) target [\d.]+ .*\| NVML (\d+), SM (\d+) MHz, (\d+) W \| (?:PASS|MISS)"
)


def floor_mhz(max_mhz, limit_watts, rated_watts, heaviest):
    """The clock the heaviest work settles at busy all the time (boost.rs, ClockReading::bound)."""
    headroom = limit_watts - IDLE_SHARE * rated_watts
    if headroom <= 0:
        return None
    return max_mhz * min((heaviest * rated_watts / headroom) ** (-1.0 / ALPHA), 1.0)


def read_report(path, job):
    """The job's full-load clocks and power, and its limited points, from one report."""
    full_load, points = [], []
    with open(path, encoding="utf-8") as report:
        for line in report:
            natural = NATURAL.match(line)
            if natural and natural.group(1) == job:
                full_load = [(float(mhz), float(watts)) for mhz, watts in CLOCK.findall(natural.group("clocks"))]
                continue
            point = POINT.match(line)
            if point and point.group(1) == job:
                limit, share, busy, mhz, watts = point.groups()[1:]
                points.append((int(limit), float(share), int(busy), float(mhz), float(watts)))
    return full_load, points


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--job", default="gemm")
    parser.add_argument("--limit-watts", type=float, default=700.0, help="the enforced power limit (H200: 700)")
    parser.add_argument("--rated-watts", type=float, help="the board's default power limit (default: the enforced one)")
    parser.add_argument(
        "--heaviest", type=float, default=CONSTANTS["HEAVIEST_WORK"], help="HEAVIEST_WORK (default: boost.rs's)"
    )
    parser.add_argument("--max-mhz", type=float, default=1980.0, help="the highest SM clock (H200: 1980)")
    parser.add_argument("--min-busy", type=int, default=20, help="NVML's busy percent below which a point is left out")
    args = parser.parse_args()
    rated = args.rated_watts or args.limit_watts
    idle = IDLE_SHARE * rated
    headroom = args.limit_watts - idle
    floor = floor_mhz(args.max_mhz, args.limit_watts, rated, args.heaviest)
    if floor is None:
        raise SystemExit(f"a power limit of {args.limit_watts:.0f} W leaves nothing above the idle power ({idle:.0f} W)")
    betas, alphas, lowest_full_load = [], [], None
    for path in args.reports:
        full_load, points = read_report(path, args.job)
        if not full_load:
            print(f"{path}: no clock and power for {args.job}'s native runs")
            continue
        f_full = statistics.mean(mhz for mhz, _ in full_load)
        lowest = min(mhz for mhz, _ in full_load)
        lowest_full_load = lowest if lowest_full_load is None else min(lowest_full_load, lowest)
        print(f"{path}: {args.job} busy all the time at {f_full:.0f} MHz ({' '.join(f'{m:.0f}' for m, _ in full_load)})")
        print("  limit  busy%    MHz      W  speed-up  BETA   over  ALPHA  model  bound")
        for limit, share, busy, mhz, watts in points:
            s = busy / 100.0
            reason = (
                f"busy under {args.min_busy}%"
                if busy < args.min_busy
                else f"no boost: the clock within {MIN_BOOST:.0%} of full load's"
                if mhz < f_full * (1.0 + MIN_BOOST)
                else "power at or under idle"
                if watts <= idle
                else None
            )
            if reason:
                print(f"  {limit:5}  {busy:5}  {mhz:5.0f}  {watts:5.0f}  left out ({reason})")
                continue
            speed_up = share / busy
            clock_ratio = math.log(mhz / f_full)
            beta = math.log(speed_up) / clock_ratio if speed_up > 0 else float("nan")
            over = (watts - idle) / s / headroom
            alpha = math.log(over) / clock_ratio if over > 0 else float("nan")
            model = max(over, 1.0) ** (BETA / ALPHA)
            bound = max((mhz / floor) ** BETA, 1.0)
            for value, kept in ((beta, betas), (alpha, alphas)):
                if math.isfinite(value):
                    kept.append(value)
            print(
                f"  {limit:5}  {busy:5}  {mhz:5.0f}  {watts:5.0f}  {speed_up:8.3f}  {beta:4.2f}  "
                f"{over:5.3f}  {alpha:5.2f}  {model:5.3f}  {bound:5.3f}"
            )
    if betas:
        print(f"BETA: median {statistics.median(betas):.2f} over {len(betas)} points (boost.rs: {BETA})")
    if alphas:
        print(f"ALPHA: median {statistics.median(alphas):.2f} over {len(alphas)} points (boost.rs: {ALPHA})")
    if lowest_full_load is not None:
        verdict = "at or above it" if lowest_full_load >= floor else "BELOW it: the bound cuts the boost"
        print(
            f"floor: {floor:.0f} MHz with HEAVIEST_WORK {args.heaviest}; the lowest full-load clock"
            f" {lowest_full_load:.0f} MHz is {verdict}"
        )
        if lowest_full_load < floor:
            needed = (args.max_mhz / lowest_full_load) ** ALPHA * headroom / rated
            print(f"  HEAVIEST_WORK of at least {needed:.2f} puts the floor at {lowest_full_load:.0f} MHz")


if __name__ == "__main__":
    main()
