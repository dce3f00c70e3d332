//! Helpers shared by the region's integration tests: scratch directories, a small random number
//! generator, worker processes (this test binary re-run with a role), and fake slot holders.

#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use vgpu_region::{FILE_LOCK_OFFSET, InitParams, Region, SLOT_LIVE};

/// Environment variable naming the role of a worker process.
pub const ROLE_VAR: &str = "VGPU_REGION_TEST_ROLE";
/// Environment variable naming the region file of a worker process.
pub const PATH_VAR: &str = "VGPU_REGION_TEST_PATH";

/// A fresh, empty directory under the system temp dir, removed on drop.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(label: &str) -> Self {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos();
        let path = std::env::temp_dir().join(format!(
            "vgpu-region-{label}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn region_path(&self) -> PathBuf {
        self.0.join("region.cache")
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// xorshift64*: deterministic per seed, good enough to pick sizes and moments.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn from_time_and_pid() -> Self {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
        Self::new(nanos ^ (u64::from(std::process::id()) << 32))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// True once in `n` times on average.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.next().is_multiple_of(n)
    }

    /// Uniform in `low..=high`.
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

/// Init parameters with one device.
pub fn one_device() -> InitParams {
    InitParams {
        device_uuids: vec!["GPU-00000000-1111-2222-3333-444444444444".into()],
        ..InitParams::default()
    }
}

pub fn own_pid() -> i32 {
    std::process::id() as i32
}

/// A worker: this test binary re-run with only the ignored `worker` test, with a role.
pub struct Worker {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub stdout: BufReader<ChildStdout>,
}

/// The words that run this test binary again as a worker (only the ignored `worker` test):
/// `VGPU_TEST_RUNNER` first when it is set (an emulator for another architecture,
/// `scripts/cross-test.sh`), then the binary and the test harness's arguments.
pub fn worker_words() -> Vec<std::ffi::OsString> {
    let runner = std::env::var("VGPU_TEST_RUNNER").unwrap_or_default();
    let harness = [
        "worker",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ];
    runner
        .split_whitespace()
        .map(std::ffi::OsString::from)
        .chain(std::iter::once(std::env::current_exe().unwrap().into_os_string()))
        .chain(harness.into_iter().map(std::ffi::OsString::from))
        .collect()
}

impl Worker {
    pub fn spawn(role: &str, region: &Path, extra_env: &[(&str, String)]) -> Self {
        let words = worker_words();
        let mut command = Command::new(&words[0]);
        command
            .args(&words[1..])
            .env(ROLE_VAR, role)
            .env(PATH_VAR, region)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (name, value) in extra_env {
            command.env(name, value);
        }
        let mut child = vgpu_test_spawn::spawn_started(&mut command).expect("start the worker");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self { child, stdin, stdout }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The payload of the next line starting with `prefix` (libtest's own lines are skipped);
    /// `None` at end of output.
    pub fn line_with(&mut self, prefix: &str) -> Option<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.stdout.read_line(&mut line).unwrap_or(0) == 0 {
                return None;
            }
            if let Some(rest) = line.trim_end().strip_prefix(prefix) {
                return Some(rest.trim().to_owned());
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    /// Closes stdin (the worker's signal to exit) and waits; returns whether it exited with 0.
    pub fn finish(mut self) -> bool {
        drop(self.stdin.take());
        self.child.wait().unwrap().success()
    }

    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Parses `key=value` pairs of a report line.
pub fn report_value(report: &str, key: &str) -> u64 {
    report
        .split_whitespace()
        .find_map(|pair| pair.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key} in report {report:?}"))
        .parse()
        .unwrap()
}

/// Writes a live holder into slot `index`, as another process's attach would: for tests that
/// need slots held by processes other than the test itself.
pub fn fake_holder(region: &Region, index: usize, pid: i32, start_time: u64) {
    let slot = &region.hami().procs[index];
    let extension = &region.extension().slots[index];
    extension.start_time.store(start_time, Ordering::Relaxed);
    extension.generation.store(1_000_000 + index as u64, Ordering::Relaxed);
    slot.pid.store(pid, Ordering::Relaxed);
    slot.status.store(SLOT_LIVE, Ordering::Release);
    let proc_num = &region.hami().proc_num;
    if proc_num.load(Ordering::Relaxed) <= index as i32 {
        proc_num.store(index as i32 + 1, Ordering::Relaxed);
    }
}

/// Takes the region's lock behind the API's back, as another process's library does: a write
/// lock on the byte at `FILE_LOCK_OFFSET` through a description of its own, and the holder word
/// set. Held until the returned file closes (or its process dies).
pub fn hold_region_lock(region: &Region) -> File {
    let file = OpenOptions::new().read(true).write(true).open(region.path()).unwrap();
    // SAFETY: all zeroes is a valid flock.
    let mut range: libc::flock = unsafe { std::mem::zeroed() };
    range.l_type = libc::F_WRLCK as libc::c_short;
    range.l_whence = libc::SEEK_SET as libc::c_short;
    range.l_start = FILE_LOCK_OFFSET as libc::off_t;
    range.l_len = 1;
    // SAFETY: F_OFD_SETLKW with a valid flock on an open fd.
    assert_eq!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLKW, &range) }, 0);
    region.extension().lock.holder.store(0x5eed, Ordering::Release);
    file
}
