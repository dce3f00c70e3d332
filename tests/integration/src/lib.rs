//! Support for the integration tests: where the built libraries are, compiling the C test
//! programs, and running them with the hook preloaded against the fake driver.
//!
//! The libraries are cdylibs and `vgpu-smi` a binary of another package, which cargo cannot hand
//! to a test as dependencies, so the harness builds them (the first time a test of the process asks
//! for one, with the cargo that runs the tests: nothing when they are up to date); the debug build
//! of the hook has the test-only fault injection compiled in (`hook/build.rs`). A plain
//! `cargo test --workspace` in a fresh clone therefore tests what the sources say; a failed build
//! is a test failure with cargo's own words.
//!
//! For another architecture (`scripts/cross-test.sh` runs the suite for aarch64 under qemu-user),
//! three variables say where things are and how to run them: `CARGO_BUILD_TARGET` (which cargo
//! reads too) puts the built libraries under `target/<triple>/`, `VGPU_TEST_CC` is the C compiler
//! for the test programs, and `VGPU_TEST_RUNNER` is a command prefix for every program a test
//! starts (`qemu-aarch64-static`): a container has no binfmt_misc to run foreign binaries directly.
//! Under a runner every test program also preloads `tests/programs/real_own_stat.c`, which undoes
//! qemu's made-up `/proc/<own pid>/stat` (see there).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock, PoisonError};

#[path = "../../fake-driver/src/truth.rs"]
pub mod truth;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.ancestors().nth(2).map(Path::to_path_buf).unwrap_or(manifest)
}

/// The cargo target folder.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The profile the tests were built in.
fn profile() -> &'static str {
    if cfg!(debug_assertions) { "debug" } else { "release" }
}

/// `<target>/<triple>/` when cargo builds for another target than the host
/// (`CARGO_BUILD_TARGET`), else `<target>/`.
fn with_build_target(target: PathBuf) -> PathBuf {
    match std::env::var_os("CARGO_BUILD_TARGET").filter(|triple| !triple.is_empty()) {
        Some(triple) => target.join(triple),
        None => target,
    }
}

/// The profile folder the tests were built in (`debug` or `release`).
pub fn profile_dir() -> PathBuf {
    with_build_target(target_dir()).join(profile())
}

/// A command that runs `program` (a test program or one of the workspace's binaries) through
/// `VGPU_TEST_RUNNER` when that is set (a prefix split at spaces, such as an emulator).
pub fn command(program: &Path) -> Command {
    let runner = std::env::var("VGPU_TEST_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(first) => {
            let mut command = Command::new(first);
            command.args(words).arg(program);
            command
        }
        None => Command::new(program),
    }
}

fn require(path: PathBuf, how: &str) -> PathBuf {
    assert!(
        path.is_file(),
        "{} is missing: build it first with `{how}` (or run `make test`)",
        path.display()
    );
    path
}

/// Runs `cargo build` for `packages` (and `extra` arguments) in this test process's profile, with
/// the cargo that runs the tests and its environment (an older release's headers, another
/// target), once per process for each distinct call; panics with cargo's output when the build
/// fails.
fn cargo_build(packages: &[&str], extra: &[&str]) {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    let key = format!("{packages:?} {extra:?}");
    if built.contains(&key) {
        return;
    }
    // The cargo that runs the tests (set at run time), else the one that built them.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| option_env!("CARGO").unwrap_or("cargo").into());
    let mut command = Command::new(cargo);
    command.arg("build").current_dir(workspace_root());
    for package in packages {
        command.args(["-p", package]);
    }
    if profile() == "release" {
        command.arg("--release");
    }
    command.args(extra);
    let output = command.output().expect("run cargo build");
    assert!(
        output.status.success(),
        "`{command:?}` failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    built.push(key);
}

/// What the tests run that cargo does not build for them, built together as
/// `scripts/build-test-programs.sh` builds them (the same selection resolves the same features:
/// neither build redoes the other's).
pub const PROGRAM_PACKAGES: [&str; 4] = ["vgpu-hook", "vgpu-fake-driver", "vgpu-fake-icd", "vgpu-monitor"];

/// `file` of the profile folder, once [`PROGRAM_PACKAGES`] are built.
fn built(file: &str) -> PathBuf {
    cargo_build(&PROGRAM_PACKAGES, &[]);
    require(profile_dir().join(file), "scripts/build-test-programs.sh")
}

/// The hook, `libvgpu.so`.
pub fn hook_library() -> PathBuf {
    built("libvgpu.so")
}

/// The fake Vulkan driver, `libvgpu_fake_icd.so`.
pub fn fake_icd_library() -> PathBuf {
    built("libvgpu_fake_icd.so")
}

/// The monitor, `vgpu-smi`.
pub fn vgpu_smi() -> PathBuf {
    built("vgpu-smi")
}

/// A folder holding `libcuda.so.1` and `libnvidia-ml.so.1` (and the unversioned link names), all
/// links to the fake driver, for `LD_LIBRARY_PATH` and for linking test programs.
/// `VGPU_TEST_FAKE_DRIVER` names another build of the fake (one made from an older release's
/// headers: the hook on an older driver, as on a machine whose driver predates the headers).
pub fn fake_driver_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let (fake, dir) = match std::env::var_os("VGPU_TEST_FAKE_DRIVER") {
            Some(path) => {
                let path = require(PathBuf::from(path), "scripts/test-versions.sh");
                (
                    std::fs::canonicalize(&path).unwrap_or(path),
                    profile_dir().join("fake-driver-other"),
                )
            }
            None => (built("libvgpu_fake_driver.so"), profile_dir().join("fake-driver")),
        };
        std::fs::create_dir_all(&dir).expect("create the fake driver folder");
        // Made under a name of this process's and renamed over the old link, so a program of
        // another test binary running at the same time never finds the name missing.
        for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"] {
            let temporary = dir.join(format!("{name}.{}", std::process::id()));
            let _ = std::fs::remove_file(&temporary);
            std::os::unix::fs::symlink(&fake, &temporary).expect("link the fake driver");
            std::fs::rename(&temporary, dir.join(name)).expect("put the fake driver's link in place");
        }
        dir
    })
    .clone()
}

/// The include folder with cuda.h and nvml.h: the one the libraries were built from
/// (`CUDA_INCLUDE_DIR`, `$CUDA_HOME/include`, or the fetched default version).
pub fn include_dir() -> PathBuf {
    vgpu_codegen::headers::locate(&workspace_root()).unwrap_or_else(|e| panic!("{e}"))
}

/// `CUDA_VERSION` of the headers of this build (`13050` for 13.5).
pub fn cuda_version() -> u32 {
    static VERSION: OnceLock<u32> = OnceLock::new();
    *VERSION.get_or_init(|| {
        let cuda_h = include_dir().join("cuda.h");
        let text = std::fs::read_to_string(&cuda_h).unwrap_or_else(|e| panic!("{}: {e}", cuda_h.display()));
        text.lines()
            .find_map(|line| line.trim().strip_prefix("#define CUDA_VERSION "))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or_else(|| panic!("{} defines no CUDA_VERSION", cuda_h.display()))
    })
}

/// Compiles `tests/programs/<name>.c` (once per test process) and returns the executable, or the
/// shared object when `shared` is set.
pub fn c_program(name: &str, shared: bool) -> PathBuf {
    compile(name, shared, &[])
}

/// The executable `tests/programs/<name>.c`, compiled at most once per test binary (its tests run
/// on parallel threads, and `c_program` compiles each call into a name of its own).
pub fn compiled_program(name: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<std::collections::BTreeMap<String, PathBuf>> =
        std::sync::Mutex::new(std::collections::BTreeMap::new());
    let mut built = BUILT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    built
        .entry(name.to_string())
        .or_insert_with(|| c_program(name, false))
        .clone()
}

/// Compiles the executable `tests/programs/<name>.c` linked with these libraries too (`-lvulkan`).
pub fn c_program_linked(name: &str, libraries: &[&str]) -> PathBuf {
    compile(name, false, libraries)
}

/// The Vulkan loader and its headers `scripts/fetch-headers.sh` unpacked (`include/`,
/// `lib/libvulkan.so.1`), or those of `VGPU_VULKAN_DIR`.
pub fn vulkan_dir() -> PathBuf {
    std::env::var_os("VGPU_VULKAN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".cuda-headers").join("vulkan"))
}

/// The compiler arguments of a program that uses the Vulkan loader: the fetched headers, and the
/// fetched loader, found at run time through the program's run path (not the system's).
pub fn vulkan_link_args() -> Vec<String> {
    let dir = vulkan_dir();
    assert!(
        dir.join("lib").join("libvulkan.so.1").is_file(),
        "no Vulkan loader in {}: run scripts/fetch-headers.sh (make headers)",
        dir.display()
    );
    vec![
        format!("-I{}", dir.join("include").display()),
        format!("-L{}", dir.join("lib").display()),
        format!("-Wl,-rpath,{}", dir.join("lib").display()),
        "-lvulkan".to_string(),
    ]
}

fn compile(name: &str, shared: bool, libraries: &[&str]) -> PathBuf {
    let source = workspace_root()
        .join("tests")
        .join("programs")
        .join(format!("{name}.c"));
    let out_dir = profile_dir().join("c-programs");
    std::fs::create_dir_all(&out_dir).expect("create the C programs folder");
    let output = out_dir.join(if shared {
        format!("lib{name}.so")
    } else {
        name.to_string()
    });
    // Each compilation writes a temporary name of its own and renames, so parallel tests never
    // run a half-written file: two tests of one binary compiling the same program at once must
    // not share the name either (one would rename the other's file while its linker still writes
    // it, and running it then fails with "text file busy").
    static COMPILATIONS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let temporary = out_dir.join(format!(
        ".{name}.{}.{}",
        std::process::id(),
        COMPILATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let compiler = std::env::var("VGPU_TEST_CC")
        .or_else(|_| std::env::var("CC"))
        .unwrap_or_else(|_| "cc".into());
    let mut command = Command::new(compiler);
    command
        .arg("-O1")
        .arg("-Wall")
        .arg("-Werror")
        .arg("-o")
        .arg(&temporary)
        .arg(&source);
    command.arg(format!("-I{}", include_dir().display()));
    if shared {
        command.args(["-shared", "-fPIC"]);
    } else {
        command
            .arg(format!("-L{}", fake_driver_dir().display()))
            .args(["-pthread", "-lcuda", "-lnvidia-ml", "-ldl"])
            .args(libraries);
    }
    let result = vgpu_test_spawn::output_started(&mut command).expect("run the C compiler");
    assert!(
        result.status.success(),
        "compiling {}: {}",
        source.display(),
        String::from_utf8_lossy(&result.stderr)
    );
    std::fs::rename(&temporary, &output).expect("move the compiled program in place");
    output
}

/// The preloads every test program gets besides those a test names: under an emulator
/// (`VGPU_TEST_RUNNER`), the one that shows each process the kernel's record of itself.
fn runner_preloads() -> Vec<PathBuf> {
    static PRELOADS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    PRELOADS
        .get_or_init(|| {
            let runner = std::env::var("VGPU_TEST_RUNNER").unwrap_or_default();
            if runner.trim().is_empty() {
                Vec::new()
            } else {
                vec![c_program("real_own_stat", true)]
            }
        })
        .clone()
}

/// The region a run uses unless its test names one: a file of that run's own, removed when the
/// run ends. Neither a region left in `/tmp/cudevshr.cache` by another build or version (which the
/// hook rebuilds, with a warning) nor a concurrent test's limits (which a joining process reports
/// with a warning) can change what a test sees.
struct OwnRegion(PathBuf);

impl OwnRegion {
    fn new() -> OwnRegion {
        static DIR: OnceLock<PathBuf> = OnceLock::new();
        static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let dir = DIR.get_or_init(|| {
            let dir = std::env::temp_dir().join(format!("vgpu-tests-{}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("create the test region folder");
            dir
        });
        let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        OwnRegion(dir.join(format!("region-{run}.cache")))
    }
}

impl Drop for OwnRegion {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const REGION_VAR: &str = "CUDA_DEVICE_MEMORY_SHARED_CACHE";

/// A program run: the preloads, extra environment, and input.
pub struct Run {
    command: Command,
    stdin: Option<Vec<u8>>,
    /// The run's own region file, unless the test named one.
    own_region: Option<OwnRegion>,
}

impl Run {
    /// Runs `program` against the fake driver, without the hook, with nothing inherited from the
    /// test's environment that could change the devices, the limits or the log.
    pub fn new(program: &Path) -> Run {
        let mut command = command(program);
        command.env("LD_LIBRARY_PATH", fake_driver_dir());
        for variable in [
            "LD_PRELOAD",
            "CUDA_DEVICE_MEMORY_LIMIT",
            "CUDA_DEVICE_SM_LIMIT",
            "CUDA_VISIBLE_DEVICES",
            "GPU_CORE_UTILIZATION_POLICY",
            "VGPU_COMPUTE_PROFILE",
            "LIBCUDA_LOG_LEVEL",
        ] {
            command.env_remove(variable);
        }
        for n in 0..16 {
            for variable in ["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT", "FAKE_CUDA_MEMORY"] {
                command.env_remove(format!("{variable}_{n}"));
            }
        }
        let own_region = OwnRegion::new();
        command.env(REGION_VAR, &own_region.0);
        Run {
            command,
            stdin: None,
            own_region: Some(own_region),
        }
        .preload(&[])
    }

    /// Preloads these libraries, in this order (then those of [`runner_preloads`], if any).
    pub fn preload(mut self, libraries: &[&Path]) -> Run {
        let extra = runner_preloads();
        let list: Vec<String> = libraries
            .iter()
            .copied()
            .chain(extra.iter().map(PathBuf::as_path))
            .map(|library| library.display().to_string())
            .collect();
        if list.is_empty() {
            self.command.env_remove("LD_PRELOAD");
        } else {
            self.command.env("LD_PRELOAD", list.join(":"));
        }
        self
    }

    /// Preloads the hook alone.
    pub fn hooked(self) -> Run {
        let hook = hook_library();
        self.preload(&[&hook])
    }

    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> Run {
        if key == REGION_VAR {
            self.own_region = None;
        }
        self.command.env(key, value);
        self
    }

    pub fn args<I: IntoIterator<Item = S>, S: AsRef<std::ffi::OsStr>>(mut self, args: I) -> Run {
        self.command.args(args);
        self
    }

    /// Removes a variable from the program's environment.
    pub fn env_remove(mut self, key: &str) -> Run {
        if key == REGION_VAR {
            self.own_region = None;
        }
        self.command.env_remove(key);
        self
    }

    pub fn stdin(mut self, input: impl Into<Vec<u8>>) -> Run {
        self.stdin = Some(input.into());
        self
    }

    /// Runs to completion (killed, and described, after `vgpu_test_spawn::RUN_LIMIT`) and returns
    /// stdout, stderr and the status.
    pub fn output(mut self) -> Output {
        use std::io::Write;
        use std::process::Stdio;
        self.command.stdout(Stdio::piped()).stderr(Stdio::piped());
        self.command.stdin(if self.stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = vgpu_test_spawn::spawn_started(&mut self.command).expect("start the test program");
        if let Some(input) = self.stdin.take() {
            let mut pipe = child.stdin.take().expect("stdin pipe");
            std::thread::spawn(move || {
                let _ = pipe.write_all(&input);
            });
        }
        vgpu_test_spawn::wait_with_output_within(child, vgpu_test_spawn::RUN_LIMIT).expect("wait for the test program")
    }

    /// Runs, requires success, and returns stdout as lines.
    pub fn lines(self) -> Vec<String> {
        let output = self.output();
        assert!(
            output.status.success(),
            "program failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

/// A program started with [`Run::spawn`] and talked to line by line: stdin and stdout are pipes,
/// stderr is collected in the background. A watchdog kills it with SIGKILL if it is still running
/// after the time given to `spawn`, so a hung program fails its test instead of hanging it.
pub struct Session {
    /// The run's own region file (removed when the session is dropped).
    _own_region: Option<OwnRegion>,
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    stderr: Option<std::thread::JoinHandle<Vec<u8>>>,
    watchdog: Option<std::sync::mpsc::Sender<()>>,
    finished: bool,
}

impl Run {
    /// Starts a program that prints `ready` once it is set up ([`Run::spawn`]), and waits for
    /// that line; anything else fails the test with what the program printed.
    pub fn spawn_ready(self, limit: std::time::Duration) -> Session {
        let mut session = self.spawn(limit);
        match session.read_line() {
            Some(line) if line == "ready" => session,
            other => {
                let output = session.finish();
                panic!(
                    "the program did not start ({other:?}): {}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    }

    /// Starts the program with stdin and stdout piped; it is killed after `limit`.
    pub fn spawn(mut self, limit: std::time::Duration) -> Session {
        use std::process::Stdio;
        self.command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = vgpu_test_spawn::spawn_started(&mut self.command).expect("start the test program");
        let stdin = child.stdin.take();
        let stdout = std::io::BufReader::new(child.stdout.take().expect("stdout pipe"));
        let stderr = vgpu_test_spawn::read_in_background(child.stderr.take().expect("stderr pipe"));
        let (sender, receiver) = std::sync::mpsc::channel::<()>();
        let pid = child.id() as libc::pid_t;
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = receiver.recv_timeout(limit) {
                // Printed into the test's captured output: where each thread of the hung program
                // waits, and whether it had even become the program (its command line).
                eprintln!(
                    "watchdog: killing pid {pid} after {limit:?}: {}",
                    vgpu_test_spawn::hung_state(pid as u32)
                );
                // SAFETY: plain kill(2) of our own child, which has not been waited for yet (the
                // sender is dropped before every wait).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        });
        Session {
            _own_region: self.own_region.take(),
            child,
            stdin,
            stdout,
            stderr: Some(stderr),
            watchdog: Some(sender),
            finished: false,
        }
    }
}

impl Session {
    /// The program's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the program is still running (not exited, not yet reaped).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The next line of stdout without its newline, or `None` at end of file.
    pub fn read_line(&mut self) -> Option<String> {
        use std::io::BufRead;
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(line.trim_end_matches('\n').to_string()),
        }
    }

    /// Writes one line to the program's stdin (ignored once the program has gone).
    pub fn send(&mut self, line: &str) {
        use std::io::Write;
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = stdin.write_all(format!("{line}\n").as_bytes());
            let _ = stdin.flush();
        }
    }

    /// Sends a line and returns the answer line; panics, with the program's stderr, if the
    /// program ends first.
    pub fn ask(&mut self, line: &str) -> String {
        self.send(line);
        match self.read_line() {
            Some(answer) => answer,
            None => {
                let output = self.finish();
                panic!(
                    "the program ended before answering {line:?} ({}): stderr: {}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    }

    /// Closes the program's stdin.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Kills the program with SIGKILL and reaps it.
    pub fn kill(mut self) -> Output {
        let _ = self.child.kill();
        self.finish()
    }

    /// Closes stdin, waits for the program to end and returns the rest of stdout, stderr and
    /// the status.
    pub fn finish(&mut self) -> Output {
        use std::io::Read;
        self.stdin = None;
        let mut stdout = Vec::new();
        let _ = self.stdout.read_to_end(&mut stdout);
        self.watchdog = None;
        let status = self.child.wait().expect("wait for the test program");
        self.finished = true;
        let stderr = self
            .stderr
            .take()
            .map(|thread| thread.join().unwrap_or_default())
            .unwrap_or_default();
        Output { status, stdout, stderr }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if !self.finished {
            self.watchdog = None;
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A fresh folder for one test's files (regions, truth files), removed afterwards unless the test
/// failed, so a failure leaves its files for inspection.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(label: &str) -> ScratchDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "vgpu-{label}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create the test folder");
        ScratchDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.0.join(name)
    }

    /// The region file of the test's runs (`CUDA_DEVICE_MEMORY_SHARED_CACHE`).
    pub fn region(&self) -> PathBuf {
        self.join("region")
    }

    /// The fake driver's ground truth of the test's runs (`FAKE_CUDA_TRUTH`).
    pub fn truth_path(&self) -> PathBuf {
        self.join("truth")
    }

    /// The ground truth, once a run has created it.
    pub fn truth(&self) -> truth::Truth {
        truth::Truth::open(&self.truth_path()).expect("open the ground truth")
    }
}

pub use vgpu_test_spawn::turn::{Turn, one_at_a_time};

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The numeric field `index` of a stdin-driven program's answer line (`alloc 0 140737488355328`:
/// field 1 is the status, field 2 the pointer).
pub fn answer_number(answer: &str, index: usize) -> u64 {
    answer
        .split_whitespace()
        .nth(index)
        .and_then(|field| field.parse().ok())
        .unwrap_or_else(|| panic!("no number at field {index} of {answer:?}"))
}

/// The status (field 1) of a stdin-driven program's answer line.
pub fn answer_status(answer: &str) -> i32 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"))
}

/// The numeric `key=value` fields of a test program's output line, after its first word
/// (`done launches=12 seconds=3.0`).
#[derive(Debug)]
pub struct Fields(pub BTreeMap<String, f64>);

impl Fields {
    pub fn parse(line: &str) -> Fields {
        Fields(
            line.split_whitespace()
                .skip(1)
                .filter_map(|field| field.split_once('='))
                .filter_map(|(key, value)| Some((key.to_string(), value.parse::<f64>().ok()?)))
                .collect(),
        )
    }

    /// The field's value; panics (failing the test) when the program did not print it.
    pub fn get(&self, key: &str) -> f64 {
        *self.0.get(key).unwrap_or_else(|| panic!("no {key} in {:?}", self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_build_script_builds_the_packages_the_harness_builds() {
        let script = std::fs::read_to_string(workspace_root().join("scripts/build-test-programs.sh"))
            .expect("read scripts/build-test-programs.sh");
        let command = script
            .lines()
            .find(|line| line.starts_with("exec "))
            .expect("the script's exec line");
        let words: Vec<&str> = command.split_whitespace().collect();
        let packages: Vec<&str> = words
            .windows(2)
            .filter(|pair| pair[0] == "-p")
            .map(|pair| pair[1])
            .collect();
        assert_eq!(packages, PROGRAM_PACKAGES, "{command}");
    }
}
