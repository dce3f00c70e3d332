#!/usr/bin/env bash
# aarch64 (GH200, GB200) on an x86_64 machine: cross-builds the hook, the fake driver, vgpu-smi and
# the integration tests, then runs the fake-driver integration suite under qemu-user.
#
# Needs the Rust target and Debian's cross tools (CI installs them as root, see .ci/run):
#   rustup target add aarch64-unknown-linux-gnu
#   apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static
# qemu-user-static, not qemu-user: the dynamically linked emulator would itself be subject to the
# host's LD_PRELOAD, which the tests set for the emulated program (an aarch64 library).
# qemu-user runs a spawn of the (multithreaded) test process as a plain fork, and a child can hang
# for good before its exec, on an emulator lock another thread held at the fork (2 of 174 runs
# of the memory tests): the tests start their children through tests/spawn, which starts such a
# child again, and the harness's watchdog prints where a program that did start hangs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -m)" != x86_64 ]; then
  echo "cross-test: the host is $(uname -m); run the suite natively (make test)" >&2
  exit 1
fi
triple=aarch64-unknown-linux-gnu
scripts/fetch-headers.sh
# The Vulkan layer's tests run the aarch64 Vulkan loader (Debian's, unpacked like the host's).
python3 scripts/fetch-wheels.py vulkan aarch64
export VGPU_VULKAN_DIR=$PWD/.cuda-headers/vulkan-aarch64

# Cargo and the test harness (tests/integration/src/lib.rs) both read these.
export CARGO_BUILD_TARGET=$triple
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=qemu-aarch64-static
export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
export VGPU_TEST_RUNNER=qemu-aarch64-static
export VGPU_TEST_CC=aarch64-linux-gnu-gcc

scripts/build-test-programs.sh

# The start of the tests' children, where qemu's forks show (tests/spawn).
cargo test -p vgpu-test-spawn

# What the architecture can change, and only that (the rest is the same Rust on either, and runs
# natively in `make test`): the exports and cuGetProcAddress of an aarch64 library (foundation),
# the driver structs its handlers read as bindgen lays them out for aarch64 (memory), HAMi's own C
# reader built for aarch64 against the region (hami_reader; it also sees a slot freed at exit), and
# the aarch64 Vulkan loader (vulkan). Not run here: monitor.rs, hami.rs and region_attacks.rs
# (vgpu-smi, HAMi's protocol and hostile writers: logic with no architecture-dependent part).
# Left out under emulation as well, each for its reason (all pass natively in `make test`):
# - compute.rs, compute_jobs.rs, board_profile.rs (whole files): they hold GPU-time shares against
#   wall-clock time, and qemu slows the host side of each launch unevenly (tens of times), so they
#   would measure the emulator, not the limiter.
# - racing_processes_never_exceed_the_limit_together, kill_storm_never_blocks_survivors_and_leaves_
#   no_charge: each requires a minimum of traffic in a fixed time (allocations, kills), which
#   emulated processes (each start alone takes a good part of a second) do not reach; and qemu runs aarch64 atomics with the host's stronger x86 ordering, so a race here could
#   not show an aarch64 ordering bug anyway (that needs `make test` on an aarch64 machine).
# - context_charges_are_exact_while_other_processes_churn: a context is measured in a quiet moment
#   of at most 50 ms between the other processes' calls, which emulated calls are too slow to leave.
# - contexts_created_together_never_pass_the_limit: the others wait at most 2 s for the first
#   context's measurement, which an emulated start-up can outlast (they then go unreserved).
# - a_flood_of_failing_calls_gives_few_lines_and_counts_the_rest: it calls for 11 s to see one line
#   after the 10 s rate-limit interval, a 1 s margin that an emulated start-up (the library's first
#   call) can use up on a loaded machine (seen once in CI's clone: 5 lines instead of 6).
cargo test -p vgpu-integration --test foundation --test memory --test hami_reader --test vulkan \
  --no-fail-fast -- \
  --skip racing_processes_never_exceed_the_limit_together \
  --skip kill_storm_never_blocks_survivors_and_leaves_no_charge \
  --skip context_charges_are_exact_while_other_processes_churn \
  --skip a_flood_of_failing_calls_gives_few_lines_and_counts_the_rest \
  --skip contexts_created_together_never_pass_the_limit

# The region crate's own tests, whose workers are this test binary run again (through the runner,
# tests/common): every process under qemu also preloads real_own_stat (see above), so a slot's
# owner is seen alive.
own_stat=target/$triple/real_own_stat.so
aarch64-linux-gnu-gcc -shared -fPIC -O1 -Wall -Werror -o "$own_stat" tests/programs/real_own_stat.c -ldl
export VGPU_TEST_RUNNER="qemu-aarch64-static -E LD_PRELOAD=$PWD/$own_stat"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER=$VGPU_TEST_RUNNER
# Left out under emulation (both pass natively in `make test`), as above: a traffic floor in a fixed
# time (a_kill_storm_never_blocks_survivors_and_leaves_exact_totals: 200 kills of charging workers
# in 30 s, 25 reached) and a wall-clock bound on one read (a_slot_left_odd_by_a_dead_writer_...:
# a snapshot within 100 ms, which qemu's first pass through the code exceeds).
cargo test -p vgpu-region --no-fail-fast -- \
  --skip a_kill_storm_never_blocks_survivors_and_leaves_exact_totals \
  --skip a_slot_left_odd_by_a_dead_writer_is_reported_inconsistent_without_spinning
