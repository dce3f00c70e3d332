"""Native and hooked runs of one job, alternated, to tell the job's own run-to-run spread from the
limiter's error (run by tests/gpu/native_vs_hook.sh).

    native_vs_hook.py <libvgpu.so> <work folder>

compute_jobs_bench.py compares every limited run with two native runs, one before all the
limited runs of a job and one after. A job whose rate differs from process to process (a
host-bound Python loop) then shows an error that no limiter made. Here each round runs the job
natively, then at each setting of AB_SETTINGS (default "unset 50"), for AB_ROUNDS rounds (default
3), each run COMPUTE_SECONDS long from its first launch, for each job of AB_JOBS (default
"smallops train"). Printed per run: its mean rate, NVML's utilisation, SM clock and power, and
the CPU the job's thread began each second on and how often it was preempted in it (to tell what
moves a host-bound loop's rate); per setting: its mean rate over the native runs' mean rate, and
the range of that ratio over the rounds (each round's run against that round's native run); per
run, its error and worst second from the 2nd as
compute_jobs_bench.py scores a point (share against min(setting, natural share)), with the mean of
the other rounds' native runs as reference: on the native runs themselves that is the job's own
spread in the matrix's terms.
"""
import os
import sys

HOOK, WORK = sys.argv[1], sys.argv[2]
# compute_jobs_bench reads its arguments and its settings when imported.
os.environ.setdefault("COMPUTE_LIMITS", "unset")
import compute_jobs_bench as bench  # noqa: E402  (beside this script, sys.path[0])

JOBS = bench.jobs_from("AB_JOBS", "smallops train")
SETTINGS = bench.settings_from("AB_SETTINGS", "unset 50")
ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))


def label(setting):
    return "native" if setting is None else setting


def main():
    print(f"jobs {' '.join(JOBS)}; per round: native, {', '.join(SETTINGS)}; {ROUNDS} rounds; {bench.SECONDS} s per run")
    for job in JOBS:
        print(f"\n## {job}", flush=True)
        means = {label(s): [] for s in [None, *SETTINGS]}  # per setting, each round's mean (None: failed)
        runs = {label(s): [] for s in [None, *SETTINGS]}  # per setting, the runs that ran
        for round_ in range(1, ROUNDS + 1):
            for setting in [None, *SETTINGS]:
                run = bench.run_job(job, setting, name=f"{label(setting)}-{round_}")
                if not run.ok:
                    bench.failed(f"{job} {label(setting)} round {round_}", run)
                    means[label(setting)].append(None)
                    continue
                nvml = run.utilisation()
                nvml_text = f", NVML {nvml:.1f}%" if nvml is not None else ""
                if run.clock_power():
                    nvml_text += f", {run.clock_power()}"
                series = " ".join(f"{rate:.0f}" for rate in run.result["per_second"])
                print(
                    f"round {round_} {label(setting)}: mean {run.result['mean']:.1f} it/s{nvml_text} | {series}",
                    flush=True,
                )
                if bench.thread_text(run):
                    print(f"    {bench.thread_text(run)}", flush=True)
                means[label(setting)].append(run.result["mean"])
                runs[label(setting)].append(run)
        natives = [m for m in means["native"] if m is not None]
        if not natives:
            print(f"{job}: no native run")
            continue
        native_mean = sum(natives) / len(natives)
        spread = (max(natives) - min(natives)) / native_mean * 100
        print(f"{job} native: mean {native_mean:.1f} it/s over {len(natives)} runs, range {spread:.1f}% of the mean")
        for setting in SETTINGS:
            rates = [m for m in means[setting] if m is not None]
            if not rates:
                continue
            ratio = sum(rates) / len(rates) / native_mean * 100
            paired = [
                own / native * 100
                for own, native in zip(means[setting], means["native"])
                if own is not None and native is not None
            ]
            paired_text = f", per round {min(paired):.1f}-{max(paired):.1f}%" if paired else ""
            print(f"{job} {setting}: {ratio:.1f}% of native{paired_text}", flush=True)
        scores(job, runs)


def scores(job, runs):
    """Each run scored as the matrix scores a point, against the mean of the native runs (the
    others, for a native run)."""
    natives = runs["native"]
    natural, source = bench.natural_of(job, [run.utilisation() for run in natives])
    print(f"{job} natural share {natural:.1f}% ({source}); each run against the native runs' per-second mean:")
    for setting, of_setting in runs.items():
        target = natural if setting in ("native", "unset") else min(float(setting), natural)
        texts = []
        for run in of_setting:
            c = bench.against_natives(run, natives, natural, target)
            if c is not None:
                texts.append(f"{c.error:+.1f}/{c.worst:+.1f}")
        if texts:
            print(f"  {setting}: err/worst second per round {' '.join(texts)}", flush=True)


if __name__ == "__main__":
    main()
