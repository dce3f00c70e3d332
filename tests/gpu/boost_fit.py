"""What compute-jobs reports say about a board's boost compensation constants (its profile in
hook/src/throttle/boards.toml, the model in boost.rs): for a maintainer checking them on another GPU,
another driver or another day, or fitting them for a board that has none, from the reports
tests/gpu/compute_jobs.sh already writes.

    boost_fit.py [--board NAME] [--job gemm] [--limit-watts 700] [--rated-watts W] [--heaviest 1.3]
                 [--max-mhz 1980] [--min-busy 20] <report> [...]

A report gives, for the job's native runs, the SM clock and power busy all the time (its full-load
clock `f_full`), and for each limited point the GPU share (its throughput against the native
runs, times their busy share), NVML's busy share `s` of the GPU, the SM clock `f` and the power
`P`. For each point where NVML saw the GPU busy at least --min-busy percent (NVML's figure is in
whole percent) and the clock at least 2% above the full-load one, it prints:

- speed-up: the work done per busy second against the native runs' (GPU share / `s`), which is
  the factor the point needed; kernel time ~ clock^-beta gives beta = ln(speed-up) / ln(f / f_full);
- over: the dynamic power at full load that the model infers, `(P - P_idle) / s / (P_cap - P_idle)`
  (idle: idle_share of the rated power), which it turns into a factor as over^(beta / alpha);
  dynamic power ~ clock^alpha gives alpha = ln(over) / ln(f / f_full);
- the model's factor (over^(beta / alpha)) and the clock's bound ((f / f_floor)^beta).

The constants (idle_share, alpha, beta, heaviest_work) are the profile in boards.toml of the board
the first report names in its first line (nvidia-smi's name, which is NVML's), or of --board, so
the check follows the library it describes; --heaviest tries another heaviest_work. For a board
without a profile, pass --board with a profiled board's name to start from its constants: the
medians then say what this board's are.

Then the medians of beta and alpha against the profile's, and the floor check: no GPU busy all the
time should run below `f_floor = f_max * ((P_cap - P_idle) / (heaviest_work * P_rated))^(1/alpha)`,
or the bound cuts the boost of every point held partly down by power (the GEMM at 90 on
2026-12-03: floor 1549 MHz, full load 1478-1494 MHz).
"""
import argparse
import math
import os
import re
import statistics

BOARDS_TOML = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "hook", "src", "throttle", "boards.toml"
)
FIELDS = ("idle_share", "alpha", "beta", "heaviest_work")


def board_profiles(path=BOARDS_TOML):
    """Each board's model constants by NVML name, as boards.toml gives them."""
    try:
        import tomllib
    except ImportError:
        raise SystemExit("boost_fit.py reads boards.toml with tomllib: it needs Python 3.11 or newer")
    with open(path, "rb") as source:
        boards = tomllib.load(source).get("board", [])
    return {name: {field: float(board[field]) for field in FIELDS} for board in boards for name in board["names"]}


def report_gpu(path):
    """The GPU a report ran on, as its first line names it (nvidia-smi's name, NVML's)."""
    with open(path, encoding="utf-8") as report:
        first = report.readline()
    named = re.search(r" UTC, (.+), [\d.]+\s*$", first)
    return named.group(1).strip() if named else None


# A point whose clock is within this share of the full-load clock has no boost to fit: the
# exponents would divide by the log of a ratio near 1.
MIN_BOOST = 0.02

NATURAL = re.compile(r"^(\w+) natural share: ([\d.]+)%.*?;(?P<clocks>(?: SM \d+ MHz, \d+ W;?)+)\s*$")
CLOCK = re.compile(r"SM (\d+) MHz, (\d+) W")
POINT = re.compile(
    r"^(\w+) (\d+): .*\| share ([\d.]+) target [\d.]+ .*\| NVML (\d+), SM (\d+) MHz, (\d+) W \| (?:PASS|MISS)"
)


def floor_mhz(profile, max_mhz, limit_watts, rated_watts, heaviest):
    """The clock the heaviest work settles at busy all the time (boost.rs, ClockReading::bound)."""
    headroom = limit_watts - profile["idle_share"] * rated_watts
    if headroom <= 0:
        return None
    return max_mhz * min((heaviest * rated_watts / headroom) ** (-1.0 / profile["alpha"]), 1.0)


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
    parser.add_argument("--board", help="the profile's board, by NVML's name (default: the first report's GPU)")
    parser.add_argument("--job", default="gemm")
    parser.add_argument("--limit-watts", type=float, default=700.0, help="the enforced power limit (H200: 700)")
    parser.add_argument("--rated-watts", type=float, help="the board's default power limit (default: the enforced one)")
    parser.add_argument("--heaviest", type=float, help="heaviest_work (default: the profile's)")
    parser.add_argument("--max-mhz", type=float, default=1980.0, help="the highest SM clock (H200: 1980)")
    parser.add_argument("--min-busy", type=int, default=20, help="NVML's busy percent below which a point is left out")
    args = parser.parse_args()
    profiles = board_profiles()
    board = args.board or report_gpu(args.reports[0])
    if board not in profiles:
        raise SystemExit(
            f"no profile for the board {board!r} in boards.toml (boards: {', '.join(sorted(profiles))});"
            " pass --board with one of them to check these reports against its constants"
        )
    profile = profiles[board]
    idle_share, alpha, beta = profile["idle_share"], profile["alpha"], profile["beta"]
    heaviest = profile["heaviest_work"] if args.heaviest is None else args.heaviest
    print(f"profile: {board} ({', '.join(f'{field} {profile[field]}' for field in FIELDS)})")
    rated = args.rated_watts or args.limit_watts
    idle = idle_share * rated
    headroom = args.limit_watts - idle
    floor = floor_mhz(profile, args.max_mhz, args.limit_watts, rated, heaviest)
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
        print("  limit  busy%    MHz      W  speed-up  beta   over  alpha  model  bound")
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
            point_beta = math.log(speed_up) / clock_ratio if speed_up > 0 else float("nan")
            over = (watts - idle) / s / headroom
            point_alpha = math.log(over) / clock_ratio if over > 0 else float("nan")
            model = max(over, 1.0) ** (beta / alpha)
            bound = max((mhz / floor) ** beta, 1.0)
            for value, kept in ((point_beta, betas), (point_alpha, alphas)):
                if math.isfinite(value):
                    kept.append(value)
            print(
                f"  {limit:5}  {busy:5}  {mhz:5.0f}  {watts:5.0f}  {speed_up:8.3f}  {point_beta:4.2f}  "
                f"{over:5.3f}  {point_alpha:5.2f}  {model:5.3f}  {bound:5.3f}"
            )
    if betas:
        print(f"beta: median {statistics.median(betas):.2f} over {len(betas)} points (the profile's: {beta})")
    if alphas:
        print(f"alpha: median {statistics.median(alphas):.2f} over {len(alphas)} points (the profile's: {alpha})")
    if lowest_full_load is not None:
        verdict = "at or above it" if lowest_full_load >= floor else "BELOW it: the bound cuts the boost"
        print(
            f"floor: {floor:.0f} MHz with heaviest_work {heaviest}; the lowest full-load clock"
            f" {lowest_full_load:.0f} MHz is {verdict}"
        )
        if lowest_full_load < floor:
            needed = (args.max_mhz / lowest_full_load) ** alpha * headroom / rated
            print(f"  heaviest_work of at least {needed:.2f} puts the floor at {lowest_full_load:.0f} MHz")


if __name__ == "__main__":
    main()
