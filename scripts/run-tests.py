#!/usr/bin/env python3
"""Runs the workspace's tests as `cargo test --workspace` would, in less wall time.

`cargo test` runs its test binaries one after another, and most of them spend their time waiting
for the programs they start (the integration tests' CPU use is about a third of the machine's), so
here the binaries run two at a time, each through a `cargo test` of its own (cargo holds its lock
only while it checks the build, and runs the binary as it always does). The compute limiter's
binaries (`FIRST_TOGETHER`), which hold GPU-time shares against the wall clock, run first, together
and with nothing else; their tests mostly wait for the programs they start, so `compute`'s run
several at once (`TEST_THREADS`). Then the binaries that start a storm of processes (`ALONE`) run
by themselves, one test at a time: a thousand processes starting at once on two CPUs leave a lock
holder off the CPU for over a second when anything else runs beside them. Within a binary the tests that measure waits or shares take turns
(`one_at_a_time` in tests/spawn, for the integration and region tests), across binaries too (a
file lock).

    scripts/run-tests.py [cargo test arguments...]   (default: --workspace)

Each binary's output goes to target/test-logs/<binary>.log, and is printed when it fails; the run
ends with one line per binary (status, seconds) and fails when any failed. Arguments after `--` are
passed to every test binary, as with `cargo test`.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The integration tests that hold shares of GPU time against the wall clock: first, together, with
# nothing else beside them.
FIRST_TOGETHER = {"compute", "compute_jobs", "board_profile"}
# After those, one at a time with nothing beside them, each with one test thread.
ALONE = ["processes"]
# Test threads of binaries whose tests mostly wait (cargo's default is one per CPU).
TEST_THREADS = {"compute": 6, **{name: 1 for name in ALONE}}
AT_ONCE = 2
# The longest of the others start first, so that the two lanes end close together.
FIRST = ["unit tests", "hami", "gpu_suite", "monitor", "memory", "region_attacks", "foundation"]


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def build(cargo: str, arguments: list[str]) -> list[dict]:
    """Builds the test binaries; returns the runs: one per test target name, and one for every
    library's and binary's unit tests. Each run is a `cargo test` with the same package selection
    as the build (`arguments`), so that cargo resolves the same features and finds it all built."""
    command = [cargo, "test", "--no-run", "--message-format=json-render-diagnostics", *arguments]
    process = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if process.returncode != 0:
        sys.exit(f"run-tests: `{' '.join(command)}` failed ({process.returncode})")
    names = []
    for line in process.stdout.splitlines():
        message = json.loads(line)
        if message.get("reason") != "compiler-artifact" or not message.get("executable"):
            continue
        if not message.get("profile", {}).get("test"):
            continue
        target = message["target"]
        if "test" in target["kind"] and target["name"] not in names:
            names.append(target["name"])
    runs = [{"name": name, "selection": [*arguments, "--test", name]} for name in names]
    runs.append({"name": "unit tests", "selection": [*arguments, "--lib", "--bins"]})
    return runs


def run(binary: dict, test_arguments: list[str], cargo: str, logs: Path) -> tuple[bool, float, Path]:
    """Runs one test binary through `cargo test` (which finds it built, and runs it with the
    environment and folder it gives tests); returns (passed, seconds, log)."""
    log = logs / (binary["name"].replace(" ", "_").replace("(", "").replace(")", "") + ".log")
    threads = TEST_THREADS.get(binary["name"])
    extra = ["--test-threads", str(threads)] if threads and "--test-threads" not in test_arguments else []
    command = [cargo, "test", *binary["selection"], "--", *extra, *test_arguments]
    start = time.monotonic()
    with open(log, "w") as output:
        status = subprocess.call(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    return status == 0, time.monotonic() - start, log


def main() -> int:
    arguments = sys.argv[1:]
    test_arguments: list[str] = []
    if "--" in arguments:
        split = arguments.index("--")
        arguments, test_arguments = arguments[:split], arguments[split + 1 :]
    if not arguments:
        arguments = ["--workspace"]
    cargo = os.environ.get("CARGO", "cargo")
    binaries = build(cargo, arguments)
    logs = target_dir() / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)

    results: list[tuple[str, bool, float, Path]] = []
    lock = threading.Lock()

    def record(binary: dict) -> None:
        passed, seconds, log = run(binary, test_arguments, cargo, logs)
        with lock:
            results.append((binary["name"], passed, seconds, log))
            print(f"run-tests: {binary['name']}: {'ok' if passed else 'FAILED'} in {seconds:.1f} s", flush=True)
            if not passed:
                print(log.read_text(errors="replace"), flush=True)

    together = [threading.Thread(target=record, args=(b,)) for b in binaries if b["name"] in FIRST_TOGETHER]
    for thread in together:
        thread.start()
    for thread in together:
        thread.join()
    for binary in binaries:
        if binary["name"] in ALONE:
            record(binary)
    rank = {name: index for index, name in enumerate(FIRST)}
    queue = sorted(
        (b for b in binaries if b["name"] not in FIRST_TOGETHER and b["name"] not in ALONE),
        key=lambda binary: rank.get(binary["name"], len(FIRST)),
    )
    queue_lock = threading.Lock()

    def worker() -> None:
        while True:
            with queue_lock:
                if not queue:
                    return
                binary = queue.pop(0)
            record(binary)

    threads = [threading.Thread(target=worker) for _ in range(AT_ONCE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    doc = subprocess.call([cargo, "test", "--doc", *arguments], cwd=ROOT)
    failed = [name for name, passed, _, _ in results if not passed]
    if doc != 0:
        failed.append("doctests")
    print(f"run-tests: {len(results)} test binaries and the doctests, {len(failed)} failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
