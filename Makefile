# Common tasks. `make demo` builds and runs the demo, `make test` runs every check CI runs.
CARGO ?= cargo
# Each step of `make test` says how long it took (scripts/timed.sh).
TIMED := scripts/timed.sh

.PHONY: headers build programs release demo test versions lint cross-test dist bench-callgrind fuzz clean

headers:
	scripts/fetch-headers.sh

build: headers
	$(TIMED) build $(CARGO) build --workspace

# What the integration tests run, built as their harness builds it (scripts/build-test-programs.sh).
programs: headers
	$(TIMED) programs env CARGO=$(CARGO) scripts/build-test-programs.sh

release: headers
	$(CARGO) build --release -p vgpu-hook -p vgpu-monitor
	cp vulkan-layer/hami.json target/release/hami.json

demo: headers
	scripts/demo.sh

lint: headers
	$(TIMED) fmt $(CARGO) fmt --all -- --check
	$(TIMED) clippy $(CARGO) clippy --workspace --all-targets -- -D warnings

# Every older release of cuda-versions.txt first (its hook and fake driver, the header-dependent
# tests), then the default build and every test (scripts/run-tests.py: `cargo test --workspace`,
# its test binaries two at a time, with the time each took), then the default library on an older
# fake driver.
test: versions programs lint
	$(TIMED) tests env CARGO=$(CARGO) python3 scripts/run-tests.py --workspace
	$(TIMED) versions-cross scripts/test-versions.sh cross
	# fuzzing needs nightly: `make fuzz` (see fuzz/README.md)

versions: headers
	$(TIMED) versions-older scripts/test-versions.sh older

# aarch64 under qemu-user (needs cross tools: see scripts/cross-test.sh); CI runs it after `test`.
cross-test: headers
	scripts/cross-test.sh

# One release archive per architecture in dist/ (see scripts/dist.sh).
dist: headers
	scripts/dist.sh

bench-callgrind: build
	scripts/bench-callgrind.sh

clean:
	$(CARGO) clean

fuzz:
	cargo +nightly fuzz run config_parser -- -max_total_time=60
	cargo +nightly fuzz run region_reader -- -max_total_time=60
