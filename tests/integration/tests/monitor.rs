//! Monitoring against the fake driver: `vgpu-smi`'s table and JSON for regions that fake-driver
//! processes populate (snapshots), its Prometheus endpoint scraped over HTTP, suspend and resume,
//! NVML's process and utilisation queries inside the container, and lock-free reading while
//! eight processes allocate and free.
//!
//! The binaries are built first (`cargo build --workspace`, as `make test` does). Every test uses
//! its own folder for the region and the fake's ground truth.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::mem::size_of;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use vgpu_integration::{Run, ScratchDir, Session, command, compiled_program, one_at_a_time, vgpu_smi};
use vgpu_region::{InitParams, Region};
use vgpu_test_spawn::{output_started, spawn_started};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// What each context takes on the fake (`FAKE_CUDA_CONTEXT_BYTES`).
const CONTEXT: u64 = 48 * MIB;
const CUDA_SUCCESS: &str = "0";
const NVML_SUCCESS: &str = "0";
/// A fixed report time, so JSON output is reproducible.
const REPORT_TIME_MS: &str = "1767225600000";

fn program() -> PathBuf {
    compiled_program("monitor_launch")
}

/// A fresh folder for one test's region and truth files, removed afterwards unless the test
/// failed.
struct TestDir(ScratchDir);

impl TestDir {
    fn new(name: &str) -> TestDir {
        let dir = TestDir(ScratchDir::new(&format!("monitor-{name}")));
        std::fs::create_dir_all(dir.0.join("regions")).expect("create the test folder");
        dir
    }

    /// The region file of container `name`.
    fn region(&self, name: &str) -> PathBuf {
        self.0.join("regions").join(format!("{name}.cache"))
    }

    fn regions(&self) -> PathBuf {
        self.0.join("regions")
    }
}

/// Starts the test program with the hook against the fake driver, on region `region`, with these
/// extra variables.
fn start(dir: &TestDir, region: &Path, variables: &[(&str, &str)]) -> Session {
    let mut run = Run::new(&program())
        .hooked()
        .env("CUDA_DEVICE_MEMORY_SHARED_CACHE", region)
        .env("FAKE_CUDA_TRUTH", dir.0.truth_path())
        .env("FAKE_CUDA_CONTEXT_BYTES", CONTEXT.to_string());
    for (key, value) in variables {
        run = run.env(key, value);
    }
    run.spawn(Duration::from_secs(120))
}

/// Sends a command and returns the answer's fields after the command name.
fn ask(session: &mut Session, line: &str) -> Vec<String> {
    let answer = session.ask(line);
    let mut fields = answer.split_whitespace().map(str::to_string);
    let name = fields.next().unwrap_or_default();
    assert_eq!(
        Some(name.as_str()),
        line.split_whitespace().next(),
        "answer to {line:?}: {answer}"
    );
    fields.collect()
}

/// Runs a command that must succeed (status field 0) and returns its other fields.
fn ok(session: &mut Session, line: &str) -> Vec<String> {
    let fields = ask(session, line);
    assert_eq!(
        fields.first().map(String::as_str),
        Some(CUDA_SUCCESS),
        "{line}: {fields:?}"
    );
    fields[1..].to_vec()
}

/// A process of a container: initialised, with a context on each of `ordinals` and `data` bytes
/// allocated on each.
fn container_process(dir: &TestDir, region: &Path, variables: &[(&str, &str)], ordinals: &[u32], data: u64) -> Session {
    let mut session = start(dir, region, variables);
    ok(&mut session, "init");
    for ordinal in ordinals {
        ok(&mut session, &format!("ctx {ordinal}"));
        if data > 0 {
            ok(&mut session, &format!("alloc {data}"));
        }
    }
    session
}

fn pid_of(session: &Session) -> u32 {
    session.pid()
}

/// Writes a process's measured SM utilisation into its slot, as the compute limiter would.
fn set_sm_util(region: &Path, pid: u32, device: usize, percent: u64) {
    let joined = Region::open(region, &InitParams::default()).expect("join the region");
    let slot = joined
        .hami()
        .procs
        .iter()
        .find(|slot| slot.pid.load(Ordering::Relaxed) == pid as i32 && slot.status.load(Ordering::Relaxed) == 1)
        .expect("the process has a slot");
    slot.device_util[device].sm_util.store(percent, Ordering::Relaxed);
}

fn run_smi(arguments: &[&str]) -> Output {
    let output = output_started(
        command(&vgpu_smi())
            .args(arguments)
            .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE"),
    )
    .expect("run vgpu-smi");
    assert!(
        output.status.code().is_some(),
        "vgpu-smi crashed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Replaces what changes from run to run: the test folder, pids (kept at their column width in
/// the table), and creation and last-kernel times in JSON.
struct Redactions {
    dir: String,
    pids: Vec<(u32, String)>,
}

impl Redactions {
    fn new(dir: &TestDir, sessions: &[&Session]) -> Redactions {
        Redactions {
            dir: dir.0.path().display().to_string(),
            pids: sessions
                .iter()
                .enumerate()
                .map(|(index, session)| (pid_of(session), format!("<pid{}>", index + 1)))
                .collect(),
        }
    }

    fn with_pid(mut self, pid: u32, name: &str) -> Redactions {
        self.pids.push((pid, name.to_string()));
        self
    }

    fn table(&self, text: &str) -> String {
        let mut lines = Vec::new();
        for line in text.replace(&self.dir, "<dir>").lines() {
            let mut line = line.to_string();
            for (pid, name) in &self.pids {
                let shown = format!("{pid:>7}");
                if line.starts_with(&shown) {
                    line = format!("{name:>7}{}", &line[7..]);
                }
            }
            lines.push(line);
        }
        lines.join("\n") + "\n"
    }

    fn json(&self, text: &str) -> String {
        let mut value: serde_json::Value = serde_json::from_str(text).expect("vgpu-smi --json is JSON");
        self.redact_value(&mut value);
        serde_json::to_string_pretty(&value).expect("JSON") + "\n"
    }

    fn redact_value(&self, value: &mut serde_json::Value) {
        match value {
            serde_json::Value::Object(fields) => {
                for (key, field) in fields.iter_mut() {
                    match (key.as_str(), &*field) {
                        ("pid", serde_json::Value::Number(number)) => {
                            let pid = number.as_u64().unwrap_or(0) as u32;
                            if let Some((_, name)) = self.pids.iter().find(|(known, _)| *known == pid) {
                                *field = serde_json::Value::String(name.clone());
                            }
                        }
                        ("created_unix_secs", serde_json::Value::Number(_)) => {
                            *field = serde_json::Value::String("<created>".into());
                        }
                        ("last_kernel_time_unix_secs", serde_json::Value::Number(_)) => {
                            *field = serde_json::Value::String("<last kernel>".into());
                        }
                        ("path" | "error", serde_json::Value::String(text)) => {
                            *field = serde_json::Value::String(text.replace(&self.dir, "<dir>"));
                        }
                        _ => self.redact_value(field),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(|item| self.redact_value(item)),
            _ => {}
        }
    }
}

fn every_line_fits_80_columns(text: &str, dir: &TestDir) {
    for line in text.replace(&dir.0.path().display().to_string(), "<dir>").lines() {
        let width = line.chars().count();
        assert!(width <= 80 || line.starts_with("Region "), "{width} columns: {line:?}");
    }
}

#[test]
fn one_device_limited_table_and_json() {
    let dir = TestDir::new("one-device");
    let region = dir.region("container");
    let limits = [("CUDA_DEVICE_MEMORY_LIMIT", "4g"), ("CUDA_DEVICE_SM_LIMIT", "50")];
    let first = container_process(&dir, &region, &limits, &[0], 256 * MIB);
    let mut second = container_process(&dir, &region, &limits, &[0], GIB);
    ok(&mut second, &format!("alloc {}", 3 * MIB));
    set_sm_util(&region, pid_of(&first), 0, 12);
    set_sm_util(&region, pid_of(&second), 0, 30);

    let redactions = Redactions::new(&dir, &[&first, &second]);
    let region_argument = region.display().to_string();
    let table = run_smi(&["--region", &region_argument]);
    assert!(table.status.success(), "{}", String::from_utf8_lossy(&table.stderr));
    every_line_fits_80_columns(&stdout(&table), &dir);
    insta::assert_snapshot!("one_device_table", redactions.table(&stdout(&table)));

    let json = run_smi(&["--region", &region_argument, "--json", "--now", REPORT_TIME_MS]);
    assert!(json.status.success());
    insta::assert_snapshot!("one_device_json", redactions.json(&stdout(&json)));

    // The default region comes from the library's variable.
    let by_variable =
        output_started(command(&vgpu_smi()).env("CUDA_DEVICE_MEMORY_SHARED_CACHE", &region)).expect("run vgpu-smi");
    assert_eq!(stdout(&by_variable), stdout(&table));
}

#[test]
fn several_devices_unlimited_and_a_dead_process() {
    let dir = TestDir::new("several-devices");
    let region = dir.region("container");
    let variables = [
        ("FAKE_CUDA_DEVICES", "3"),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "1g"),
        ("CUDA_DEVICE_SM_LIMIT_0", "25"),
    ];
    let first = container_process(&dir, &region, &variables, &[0], 100 * MIB);
    let second = container_process(&dir, &region, &variables, &[1, 2], 512 * MIB);
    let doomed = container_process(&dir, &region, &variables, &[0], 200 * MIB);
    let doomed_pid = pid_of(&doomed);
    doomed.kill();
    set_sm_util(&region, pid_of(&second), 2, 7);

    let redactions = Redactions::new(&dir, &[&first, &second]).with_pid(doomed_pid, "<dead>");
    let region_argument = region.display().to_string();
    let table = run_smi(&["--region", &region_argument]);
    assert!(table.status.success());
    every_line_fits_80_columns(&stdout(&table), &dir);
    insta::assert_snapshot!("several_devices_table", redactions.table(&stdout(&table)));
    let json = run_smi(&["--region", &region_argument, "--json", "--now", REPORT_TIME_MS]);
    insta::assert_snapshot!("several_devices_json", redactions.json(&stdout(&json)));
}

#[test]
fn a_directory_of_regions_with_corrupt_ones() {
    let dir = TestDir::new("directory");
    // HAMi's monitor layout: one directory per container, each with one region.
    let container = dir.regions().join("pod-a_main");
    std::fs::create_dir_all(&container).expect("create the container folder");
    let good = container.join("vgpu.cache");
    let process = container_process(&dir, &good, &[("CUDA_DEVICE_MEMORY_LIMIT", "2g")], &[0], 64 * MIB);
    // A region file cut short, one whose magic is wrong, one of another HAMi-core version, and
    // one that is not initialised yet.
    let image = std::fs::read(&good).expect("read the region");
    std::fs::write(dir.region("truncated"), &image[..1 << 20]).expect("write");
    let mut bad_magic = image.clone();
    bad_magic[..4].copy_from_slice(&7i32.to_le_bytes());
    std::fs::write(dir.region("bad-magic"), &bad_magic).expect("write");
    let mut other_version = image.clone();
    other_version[4..8].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(dir.region("other-version"), &other_version).expect("write");
    std::fs::write(dir.region("being-created"), vec![0u8; image.len()]).expect("write");
    // A file beside them that is no region at all is not listed.
    std::fs::write(dir.regions().join("notes.txt"), "hello").expect("write");

    let redactions = Redactions::new(&dir, &[&process]);
    let directory = dir.regions().display().to_string();
    let table = run_smi(&["--region", &directory]);
    assert_eq!(
        table.status.code(),
        Some(1),
        "unreadable regions make the exit status 1"
    );
    insta::assert_snapshot!("directory_table", redactions.table(&stdout(&table)));
    let json = run_smi(&["--region", &directory, "--json", "--now", REPORT_TIME_MS]);
    insta::assert_snapshot!("directory_json", redactions.json(&stdout(&json)));
    // A missing path is one line too, never a crash.
    let missing = run_smi(&["--region", "/nonexistent/vgpu-region"]);
    assert_eq!(missing.status.code(), Some(1));
    assert_eq!(
        stdout(&missing),
        "Region /nonexistent/vgpu-region: unreadable: No such file or directory (os error 2)\n"
    );
}

/// Runs vgpu-smi with a deadline: a call still running after it is killed, and the test fails
/// (a FIFO opened for reading waits for a writer forever). Its output is read as it comes (a full
/// pipe would stop it).
fn run_smi_within(arguments: &[&str], deadline: Duration) -> Output {
    let child = spawn_started(
        command(&vgpu_smi())
            .args(arguments)
            .env_remove("CUDA_DEVICE_MEMORY_SHARED_CACHE")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped()),
    )
    .expect("run vgpu-smi");
    let pid = child.id() as libc::pid_t;
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(deadline) {
        Ok(output) => output.expect("vgpu-smi's output"),
        Err(_) => {
            // SAFETY: the pid of our own child, not yet reaped (its waiter is still waiting).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("vgpu-smi {arguments:?} was still running after {deadline:?}");
        }
    }
}

/// A container can write its region's folder: a FIFO where its region was expected must not hang
/// the operator's monitor (`show`, `serve`), and a symbolic or hard link must not make `suspend`
/// write into the file it points at.
#[test]
fn a_fifo_or_a_link_in_place_of_a_region_is_refused_at_once() {
    let dir = TestDir::new("hostile-file-types");
    let fifo = dir.region("fifo");
    let fifo_path = std::ffi::CString::new(fifo.display().to_string()).expect("a path without NUL");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo_path.as_ptr(), 0o600) }, 0, "mkfifo");
    let fifo_argument = fifo.display().to_string();
    let shown = run_smi_within(&["--region", &fifo_argument], Duration::from_secs(10));
    assert_eq!(shown.status.code(), Some(1));
    assert_eq!(
        stdout(&shown),
        format!("Region {fifo_argument}: unreadable: it is a pipe or socket, not a region file\n")
    );

    let region = dir.region("container");
    let process = container_process(&dir, &region, &[], &[0], MIB);
    // `suspend` on `path` fails, saying `why`.
    let suspend_refused = |path: &Path, why: &str| {
        let argument = path.display().to_string();
        let refused = run_smi_within(&["suspend", "--region", &argument], Duration::from_secs(10));
        assert_eq!(refused.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains(why), "{stderr}");
    };
    let link = dir.region("link");
    std::os::unix::fs::symlink(&region, &link).expect("symlink");
    suspend_refused(&link, "it is a symbolic link, which is never written through");
    let region_argument = region.display().to_string();
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&run_smi(&["--region", &region_argument, "--json"]))).expect("JSON");
    let processes = json["regions"][0]["processes"].as_array().expect("processes");
    assert_eq!(processes.len(), 1, "the container's process is in its region");
    assert_eq!(
        processes[0]["suspended"],
        serde_json::Value::Bool(false),
        "suspend wrote through the link"
    );
    // A hard link is refused too: another of its names may be someone else's file.
    let hard = dir.region("hard");
    std::fs::hard_link(&region, &hard).expect("hard link");
    suspend_refused(&hard, "more than one hard link");
    drop(process);
}

struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A container can truncate its region file while the operator's `vgpu-smi` reads it: touching
/// the mapping past the new end raised `SIGBUS` and killed the monitor (within about 30 samples
/// at 20 a second, with the file cut and restored in a loop). It must survive, report such a read
/// as cut short, and go on.
#[test]
fn a_region_truncated_while_it_is_read_does_not_kill_the_monitor() {
    let dir = TestDir::new("truncated-under-reader");
    let region = dir.region("container");
    let process = container_process(&dir, &region, &[], &[0], MIB);
    let image = std::fs::read(&region).expect("read the region");
    drop(process);
    let stop = AtomicBool::new(false);
    let output = std::thread::scope(|scope| {
        scope.spawn(|| {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new().write(true).open(&region).expect("open");
            while !stop.load(Ordering::Relaxed) {
                // Cut it to one page, then write the rest back in place (same inode); a pause
                // between rounds leaves the machine to the tests running beside this one.
                file.set_len(4096).expect("truncate");
                file.write_all_at(&image[4096..], 4096).expect("restore");
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        // Stops the writer however this closure ends (a panic too: the scope joins it first).
        let _stop = StopOnDrop(&stop);
        let region_argument = region.display().to_string();
        run_smi_within(
            &["--region", &region_argument, "--watch", "0.05", "--count", "200"],
            Duration::from_secs(120),
        )
    });
    let text = stdout(&output);
    let cut_short = text.matches("it was cut short while it was read").count();
    eprintln!("200 samples of a region cut and restored in a loop: {cut_short} read while it was cut short");
    assert!(
        matches!(output.status.code(), Some(0 | 1)),
        "vgpu-smi died: {:?} after {} samples\n{}",
        output.status,
        text.matches("sample ").count(),
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(text.matches("sample ").count(), 200, "every sample was shown");
}

/// One HTTP GET on 127.0.0.1 that must be answered within `limit`: the status line and the body,
/// or why there was none.
fn get_within(address: &str, path: &str, limit: Duration) -> Result<(String, String), String> {
    let mut stream =
        TcpStream::connect_timeout(&address.parse().expect("an address"), limit).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(limit)).map_err(|e| e.to_string())?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut response = String::new();
    stream.read_to_string(&mut response).map_err(|e| e.to_string())?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    Ok((head.lines().next().unwrap_or_default().to_string(), body.to_string()))
}

/// One HTTP GET on 127.0.0.1, returning the status line and the body.
fn http_get(address: &str, path: &str) -> (String, String) {
    get_within(address, path, Duration::from_secs(10)).expect("a GET to vgpu-smi serve")
}

/// A scrape of /metrics that must answer within `limit`: its status line, or why it did not.
fn scrape_within(address: &str, limit: Duration) -> Result<String, String> {
    get_within(address, "/metrics", limit).map(|(status, _)| status)
}

/// Starts `vgpu-smi serve` on a free port and returns it with its address.
fn serve(arguments: &[&str]) -> (Session, String) {
    let mut all = vec!["serve", "--listen", "127.0.0.1:0"];
    all.extend_from_slice(arguments);
    listening(Run::new(&vgpu_smi()).args(all).spawn(Duration::from_secs(60)))
}

/// A started `vgpu-smi serve` with the address its first line gives.
fn listening(mut server: Session) -> (Session, String) {
    let Some(line) = server.read_line() else {
        let output = server.finish();
        panic!(
            "vgpu-smi serve did not start: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let address = line
        .rsplit(' ')
        .next()
        .and_then(|url| url.strip_prefix("http://"))
        .and_then(|url| url.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (server, address)
}

/// Bytes a writer put into the region (an escape sequence in a UUID, a share of 2^64-1 percent)
/// and a file name with control characters reach the terminal escaped, as JSON escapes them, and
/// out-of-range shares are shown as invalid.
#[test]
fn the_table_escapes_control_characters_and_shows_impossible_shares_as_invalid() {
    let dir = TestDir::new("hostile-text");
    let region = dir.region("box\u{1b}[2J\nforged");
    let _process = container_process(&dir, &region, &[("CUDA_DEVICE_SM_LIMIT", "50")], &[0], MIB);
    let joined = Region::open(&region, &InitParams::default()).expect("join the region");
    for (byte, value) in joined.hami().uuids[0].iter().zip(b"GPU-\x1b[2J\x1b]0;owned\x07") {
        byte.store(*value, Ordering::Relaxed);
    }
    for slot in joined.hami().procs.iter().take(1) {
        slot.device_util[0].sm_util.store(u64::MAX, Ordering::Relaxed);
    }
    joined.hami().sm_limit[0].store(u64::MAX, Ordering::Relaxed);
    let region_argument = region.display().to_string();
    let output = run_smi(&["--region", &region_argument]);
    let text = stdout(&output);
    assert!(!text.contains('\u{1b}') && !text.contains('\u{7}'), "{text:?}");
    assert!(!text.contains("18446744073709551615"), "{text}");
    assert!(
        text.contains("box\\u001b[2J\\nforged"),
        "the file name, escaped: {text}"
    );
    assert!(text.contains("invalid"), "{text}");
    for line in text.lines() {
        assert!(!line.starts_with("forged"), "a forged line: {text}");
    }
}

/// `vgpu-smi serve` run by `sh` with at most `descriptors` open files (`ulimit -n`). Under an
/// emulator (`VGPU_TEST_RUNNER`, which would have to run the host's `sh`) it runs with the test's
/// own limit: the connection bounds still apply, the descriptors run out later.
fn serve_with_descriptors(descriptors: u32, arguments: &[&str]) -> (Session, String) {
    if std::env::var_os("VGPU_TEST_RUNNER").is_some() {
        return serve(arguments);
    }
    let smi = vgpu_smi();
    let script = format!("ulimit -n {descriptors} && exec \"$0\" \"$@\"");
    let mut all = vec![
        "-c",
        script.as_str(),
        smi.to_str().expect("a UTF-8 path"),
        "serve",
        "--listen",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(arguments);
    listening(Run::new(Path::new("sh")).args(all).spawn(Duration::from_secs(120)))
}

/// A field of `/proc/PID/status` (`Threads`, `VmHWM` in kB), or 0 when the process is gone.
fn proc_status(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Clients that hold hundreds of idle connections, past the file descriptors `serve` may open:
/// it stays up (it used to exit with status 0 and no message when accepting failed), starts no
/// thread per connection, and answers a scrape once the idle connections' time is up.
#[test]
fn serve_outlives_idle_connections_past_its_descriptors() {
    let dir = TestDir::new("serve-descriptors");
    let region = dir.region("container");
    let _process = container_process(&dir, &region, &[], &[0], MIB);
    let region_argument = region.display().to_string();
    let (mut server, address) = serve_with_descriptors(128, &["--region", &region_argument]);
    let idle: Vec<TcpStream> = (0..400).filter_map(|_| TcpStream::connect(&address).ok()).collect();
    std::thread::sleep(Duration::from_millis(500));
    let threads = proc_status(server.pid(), "Threads");
    assert!(
        server.is_running(),
        "vgpu-smi serve exited under {} idle connections",
        idle.len()
    );
    assert!(
        (1..=4).contains(&threads),
        "{threads} threads for {} connections",
        idle.len()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let answer = loop {
        match scrape_within(&address, Duration::from_secs(2)) {
            Ok(status) if status.contains("200") => break Ok(status),
            other if Instant::now() > deadline => break other,
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    drop(idle);
    assert!(
        answer.is_ok(),
        "no scrape answered within 20 s of the idle connections: {answer:?}"
    );
    assert!(server.is_running(), "vgpu-smi serve exited");
}

/// One client that pipelines thousands of requests and never reads its answers: every other
/// scrape is still answered at once (it used to wait while that client was connected).
#[test]
fn a_client_that_never_reads_stalls_no_other_scrape() {
    let dir = TestDir::new("serve-pipelined");
    let region = dir.region("container");
    let _process = container_process(&dir, &region, &[], &[0], MIB);
    let region_argument = region.display().to_string();
    let (server, address) = serve(&["--region", &region_argument]);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flooder = {
        let (address, stop) = (address.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut stream = TcpStream::connect(&address).expect("connect");
            stream
                .set_write_timeout(Some(Duration::from_millis(200)))
                .expect("timeout");
            let request = format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\n\r\n").repeat(1000);
            let mut sent = 0;
            while sent < 20 && !stop.load(Ordering::Relaxed) {
                match stream.write_all(request.as_bytes()) {
                    Ok(()) => sent += 1,
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
            stream // held open, never read, until the test ends
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    let mut answers = Vec::new();
    for _ in 0..5 {
        let started = Instant::now();
        let answer = scrape_within(&address, Duration::from_secs(3));
        answers.push((answer, started.elapsed()));
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    let held = flooder.join().expect("the flooding client");
    drop(held);
    drop(server);
    for (answer, took) in &answers {
        assert!(
            matches!(answer, Ok(status) if status.contains("200")) && *took < Duration::from_secs(2),
            "a scrape beside a client that never reads: {answers:?}"
        );
    }
}

/// A request line that never ends is refused after a bounded read, not buffered whole.
#[test]
fn a_request_line_without_an_end_is_not_buffered() {
    let dir = TestDir::new("serve-long-line");
    let region = dir.region("container");
    let _process = container_process(&dir, &region, &[], &[0], MIB);
    let region_argument = region.display().to_string();
    let (mut server, address) = serve(&["--region", &region_argument]);
    let before = proc_status(server.pid(), "VmHWM");
    let mut stream = TcpStream::connect(&address).expect("connect");
    stream.set_write_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let chunk = vec![b'A'; MIB as usize];
    let mut sent = 0u64;
    for _ in 0..256 {
        if stream.write_all(&chunk).is_err() {
            break;
        }
        sent += MIB;
    }
    let peak = proc_status(server.pid(), "VmHWM");
    assert!(server.is_running(), "vgpu-smi serve exited");
    assert!(sent < 256 * MIB, "serve read all of a 256 MiB request line");
    assert!(
        peak < before + 16 * 1024,
        "serve's peak resident memory went from {before} kB to {peak} kB on a {} MiB request line",
        sent / MIB
    );
    let answer = scrape_within(&address, Duration::from_secs(3));
    assert!(matches!(&answer, Ok(status) if status.contains("200")), "{answer:?}");
}

fn sample_value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    scrape
        .samples
        .iter()
        .find(|sample| sample.metric == name && labels.iter().all(|(key, value)| sample.labels.get(key) == Some(value)))
        .map(|sample| match sample.value {
            prometheus_parse::Value::Gauge(value) | prometheus_parse::Value::Untyped(value) => value,
            prometheus_parse::Value::Counter(value) => value,
            _ => f64::NAN,
        })
}

/// What HAMi's monitor reads and writes (`utilization_switch`, `recent_kernel`, `priority`,
/// `last_kernel_time`) is in `vgpu-smi --json` and in the Prometheus metrics, as the region holds
/// it: an operator can see why a container is held.
#[test]
fn json_and_metrics_show_what_hami_reads() {
    let dir = TestDir::new("hami-fields");
    let region = dir.region("container");
    let _process = container_process(
        &dir,
        &region,
        &[("CUDA_DEVICE_SM_LIMIT", "50"), ("CUDA_TASK_PRIORITY", "0")],
        &[0],
        MIB,
    );
    let joined = Region::open(&region, &InitParams::default()).expect("join the region");
    // As HAMi's monitor writes them: the limit lifted, the launches held by priority.
    joined.hami().utilization_switch.store(0, Ordering::Relaxed);
    joined.hami().recent_kernel.store(-1, Ordering::Relaxed);
    joined.hami().last_kernel_time.store(1_765_000_000, Ordering::Relaxed);
    let priority = joined.hami().priority.load(Ordering::Relaxed);

    let region_argument = region.display().to_string();
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&run_smi(&["--region", &region_argument, "--json"]))).expect("JSON");
    let hami = &json["regions"][0]["hami"];
    assert_eq!(hami["utilization_switch"], 0, "{json}");
    assert_eq!(hami["recent_kernel"], -1, "{json}");
    assert_eq!(hami["priority"], priority, "{json}");
    assert_eq!(hami["last_kernel_time_unix_secs"], 1_765_000_000i64, "{json}");

    let (server, address) = serve(&["--region", &region_argument]);
    let (status, body) = http_get(&address, "/metrics");
    drop(server);
    assert!(status.contains("200"), "{status}");
    let scrape =
        prometheus_parse::Scrape::parse(body.lines().map(|line| Ok(line.to_string()))).expect("parse the exposition");
    let labels = [("region", region_argument.as_str())];
    for (name, value) in [
        ("vgpu_region_utilization_switch", 0.0),
        ("vgpu_region_recent_kernel", -1.0),
        ("vgpu_region_priority", f64::from(priority)),
        ("vgpu_region_last_kernel_time_seconds", 1_765_000_000.0),
    ] {
        assert_eq!(sample_value(&scrape, name, &labels), Some(value), "{name}: {body}");
    }
}

#[test]
fn prometheus_metrics_over_http_match_the_region() {
    let dir = TestDir::new("prometheus");
    let container_a = dir.region("a");
    let container_b = dir.region("b");
    let first = container_process(
        &dir,
        &container_a,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "3g"), ("CUDA_DEVICE_SM_LIMIT", "40")],
        &[0],
        300 * MIB,
    );
    let second = container_process(
        &dir,
        &container_a,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "3g")],
        &[0],
        20 * MIB,
    );
    let other = container_process(&dir, &container_b, &[], &[0], 5 * MIB);
    set_sm_util(&container_a, pid_of(&first), 0, 21);
    std::fs::write(dir.region("broken"), b"not a region").expect("write");

    let directory = dir.regions().display().to_string();
    let (server, address) = serve(&["--region", &directory]);
    let (status, body) = http_get(&address, "/metrics");
    assert!(status.contains("200"), "{status}");
    let scrape =
        prometheus_parse::Scrape::parse(body.lines().map(|line| Ok(line.to_string()))).expect("parse the exposition");

    // The values against the region, read independently.
    let bytes = std::fs::read(&container_a).expect("read the region");
    let snapshot = vgpu_region::read_snapshot(&bytes).expect("decode the region");
    let a = container_a.display().to_string();
    let uuid = "GPU-00000000-0000-0000-0000-000000000000";
    let device = [("region", a.as_str()), ("device_index", "0"), ("device_uuid", uuid)];
    assert_eq!(sample_value(&scrape, "vgpu_region_up", &[("region", &a)]), Some(1.0));
    assert_eq!(
        sample_value(&scrape, "vgpu_region_processes", &[("region", &a)]),
        Some(2.0)
    );
    assert_eq!(
        sample_value(&scrape, "vgpu_device_memory_limit_bytes", &device),
        Some((3 * GIB) as f64)
    );
    assert_eq!(
        sample_value(&scrape, "vgpu_device_memory_used_bytes", &device),
        Some(snapshot.device_used(0) as f64)
    );
    assert_eq!(snapshot.device_used(0), 2 * CONTEXT + 320 * MIB);
    for (kind, expected) in [("context", 2 * CONTEXT), ("module", 0), ("data", 320 * MIB)] {
        let labels = [device[0], device[1], device[2], ("kind", kind)];
        assert_eq!(
            sample_value(&scrape, "vgpu_device_memory_kind_bytes", &labels),
            Some(expected as f64),
            "{kind}"
        );
    }
    assert_eq!(
        sample_value(&scrape, "vgpu_device_sm_limit_percent", &device),
        Some(40.0)
    );
    assert_eq!(
        sample_value(&scrape, "vgpu_device_sm_utilization_percent", &device),
        Some(21.0)
    );
    assert_eq!(sample_value(&scrape, "vgpu_device_processes", &device), Some(2.0));
    let first_pid = pid_of(&first).to_string();
    let process = [
        ("region", a.as_str()),
        ("pid", first_pid.as_str()),
        ("device_index", "0"),
    ];
    for (kind, expected) in [("context", CONTEXT), ("data", 300 * MIB)] {
        let labels = [process[0], process[1], process[2], ("kind", kind)];
        assert_eq!(
            sample_value(&scrape, "vgpu_process_memory_bytes", &labels),
            Some(expected as f64)
        );
    }
    assert_eq!(
        sample_value(&scrape, "vgpu_process_sm_utilization_percent", &process),
        Some(21.0)
    );
    assert_eq!(
        sample_value(&scrape, "vgpu_process_suspended", &[("pid", &first_pid)]),
        Some(0.0)
    );
    assert_eq!(
        sample_value(&scrape, "vgpu_process_alive", &[("pid", &first_pid)]),
        Some(1.0)
    );
    // The other container, unlimited.
    let b = container_b.display().to_string();
    let device_b = [("region", b.as_str()), ("device_index", "0")];
    assert_eq!(
        sample_value(&scrape, "vgpu_device_memory_limit_bytes", &device_b),
        Some(0.0)
    );
    assert_eq!(
        sample_value(&scrape, "vgpu_device_memory_used_bytes", &device_b),
        Some((CONTEXT + 5 * MIB) as f64)
    );
    // The broken file is down, not missing.
    let broken = dir.region("broken").display().to_string();
    assert_eq!(
        sample_value(&scrape, "vgpu_region_up", &[("region", &broken)]),
        Some(0.0)
    );

    // Each scrape reads anew.
    drop(second);
    let mut refreshed = None;
    for _ in 0..50 {
        let joined = Region::open(&container_a, &InitParams::default()).expect("join");
        joined.reap_dead().expect("reap");
        let (_, body) = http_get(&address, "/metrics");
        let scrape = prometheus_parse::Scrape::parse(body.lines().map(|line| Ok(line.to_string()))).expect("parse");
        refreshed = sample_value(&scrape, "vgpu_region_processes", &[("region", &a)]);
        if refreshed == Some(1.0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(refreshed, Some(1.0), "the scrape after a process ended");
    let (status, _) = http_get(&address, "/nothing");
    assert!(status.contains("404"), "{status}");
    drop((server, other, first));
}

#[test]
fn nvml_lists_the_containers_processes_and_its_utilisation() {
    let dir = TestDir::new("nvml");
    let region = dir.region("container");
    let variables = [("FAKE_CUDA_DEVICES", "2"), ("CUDA_DEVICE_MEMORY_LIMIT", "8g")];
    let mut first = container_process(&dir, &region, &variables, &[0], 256 * MIB);
    let second = container_process(&dir, &region, &variables, &[0], 64 * MIB);
    let (first_pid, second_pid) = (pid_of(&first), pid_of(&second));
    let expected = format!(
        "{first_pid}:{} {second_pid}:{}",
        CONTEXT + 256 * MIB,
        CONTEXT + 64 * MIB
    );
    for version in 1..=3 {
        let fields = ask(&mut first, &format!("procs {version} 0"));
        assert_eq!(fields[0], NVML_SUCCESS, "v{version}: {fields:?}");
        assert_eq!(fields[1], "2", "v{version}: {fields:?}");
        assert_eq!(fields[2..].join(" "), expected, "v{version}");
    }
    assert_eq!(ask(&mut first, "graphics 0"), [NVML_SUCCESS, "0"]);
    // No kernel ran: the fake's NVML says 0%, so the library's measurement is reported.
    set_sm_util(&region, first_pid, 0, 33);
    set_sm_util(&region, second_pid, 0, 20);
    assert_eq!(ask(&mut first, "util 0"), [NVML_SUCCESS, "53", "0"]);
    let samples = ask(&mut first, "putil 0");
    assert_eq!(samples[..2], [NVML_SUCCESS, "2"], "{samples:?}");
    assert_eq!(samples[2..], [format!("{first_pid}:33"), format!("{second_pid}:20")]);

    // A process that never initialises CUDA (nvidia-smi) sees the same through the region file.
    let mut observer = start(&dir, &region, &variables);
    let fields = ask(&mut observer, "procs 3 0");
    assert_eq!(fields[..2], [NVML_SUCCESS, "2"], "{fields:?}");
    assert_eq!(fields[2..].join(" "), expected);
    assert_eq!(ask(&mut observer, "util 0"), [NVML_SUCCESS, "53", "0"]);

    // The second GPU has none of the region's processes: NVML's own answers (the fake lists
    // processes holding memory and has no per-process samples).
    let fields = ask(&mut first, "procs 3 1");
    assert_eq!(fields[..2], [NVML_SUCCESS, "0"], "{fields:?}");
    assert_eq!(ask(&mut first, "putil 1")[0], "6", "NVML_ERROR_NOT_FOUND");
    assert_eq!(ask(&mut first, "util 1"), [NVML_SUCCESS, "0", "0"]);
    drop(second);
}

#[test]
fn launches_and_copies_wait_while_suspended() {
    let dir = TestDir::new("suspend");
    let region = dir.region("container");
    let mut process = container_process(&dir, &region, &[], &[0], 0);
    let mut bystander = container_process(&dir, &region, &[], &[0], 0);
    let pointer = ok(&mut process, "alloc 4096")[0].clone();
    ok(&mut process, "load");
    ok(&mut bystander, "load");
    let region_argument = region.display().to_string();
    let launch_ms = |session: &mut Session| -> f64 { ok(session, "launch 5")[0].parse().expect("milliseconds") };
    let unsuspended = launch_ms(&mut process);
    assert!(unsuspended < 200.0, "5 launches of 1 ms took {unsuspended} ms");

    let pid = pid_of(&process).to_string();
    let suspended = run_smi(&["suspend", "--pid", &pid, "--region", &region_argument]);
    assert!(
        suspended.status.success(),
        "{}",
        String::from_utf8_lossy(&suspended.stderr)
    );
    assert!(stdout(&suspended).starts_with(&format!("suspended pid {pid} ")));
    let table = stdout(&run_smi(&["--region", &region_argument]));
    assert!(table.contains("suspended"), "{table}");

    // The suspended process's launch and copy wait; the other process is not held.
    process.send("launch 5");
    std::thread::sleep(Duration::from_millis(200));
    assert!(launch_ms(&mut bystander) < 200.0, "the bystander was held");
    let resumed_at = Instant::now();
    let resumed = run_smi(&["resume", "--region", &region_argument]);
    assert!(resumed.status.success());
    let answer = process.read_line().expect("the launch returns after resume");
    let waited: f64 = answer
        .split_whitespace()
        .nth(2)
        .and_then(|ms| ms.parse().ok())
        .expect("launch time");
    assert!(waited >= 200.0, "the launch did not wait while suspended: {answer}");
    assert!(resumed_at.elapsed() < Duration::from_secs(2));

    run_smi(&["suspend", "--region", &region_argument]);
    process.send(&format!("copy {pointer}"));
    std::thread::sleep(Duration::from_millis(200));
    run_smi(&["resume", "--pid", &pid, "--region", &region_argument]);
    let answer = process.read_line().expect("the copy returns after resume");
    let waited: f64 = answer
        .split_whitespace()
        .nth(2)
        .and_then(|ms| ms.parse().ok())
        .expect("copy time");
    assert!(waited >= 150.0, "the copy did not wait while suspended: {answer}");
    run_smi(&["resume", "--region", &region_argument]);
}

/// Every suspendable entry point waits while the process is suspended: the generator's prologue,
/// with no handler. Among them the copies and host functions CUDA 13.5 added.
#[test]
fn every_suspendable_entry_point_waits_while_suspended() {
    let root = vgpu_integration::workspace_root();
    let table = vgpu_codegen::table::Table::load(&root.join("cuda-api.toml")).expect("read cuda-api.toml");
    let version = vgpu_integration::cuda_version();
    let suspendable: Vec<&str> = table
        .entries
        .iter()
        .filter(|entry| entry.suspendable && entry.class == vgpu_codegen::table::Class::Passthrough)
        .filter(|entry| entry.applies_to(version))
        .flat_map(|entry| entry.functions.iter().map(String::as_str))
        .collect();
    let mut checked: Vec<&str> = vec!["cuLaunchHostFunc", "cuLaunchHostFunc_ptsz", "cuMemcpyBatchAsync_ptsz"];
    if version >= 13050 {
        checked.extend([
            "cuMemcpyWithAttributesAsync",
            "cuMemcpyWithAttributesAsync_ptsz",
            "cuMemcpy3DWithAttributesAsync",
            "cuMemcpy3DWithAttributesAsync_ptsz",
            "cuFabricCpyBatchAsync",
            "cuFabricCpyBatchAsync_ptsz",
            "cuLaunchHostFunc_v2",
            "cuLaunchHostFunc_v2_ptsz",
        ]);
    }
    for name in &checked {
        assert!(suspendable.contains(name), "{name} is not suspendable in cuda-api.toml");
    }
    let dir = TestDir::new("suspend-new");
    let region = dir.region("container");
    let region_argument = region.display().to_string();
    let mut process = container_process(&dir, &region, &[], &[0], 0);
    let pid = pid_of(&process).to_string();
    let call = |session: &mut Session, name: &str| -> (String, f64) {
        let answer = ask(session, &format!("call {name}"));
        (answer[0].clone(), answer[1].parse().expect("milliseconds"))
    };
    for name in checked {
        // Not suspended: straight to the driver, which refuses the null arguments.
        let (status, ms) = call(&mut process, name);
        assert!(status != "nosym" && status != "0", "{name}: {status}");
        assert!(ms < 100.0, "{name} took {ms} ms while not suspended");
        run_smi(&["suspend", "--pid", &pid, "--region", &region_argument]);
        process.send(&format!("call {name}"));
        std::thread::sleep(Duration::from_millis(200));
        run_smi(&["resume", "--pid", &pid, "--region", &region_argument]);
        let answer = process.read_line().expect("the call returns after resume");
        let fields: Vec<&str> = answer.split_whitespace().collect();
        assert_eq!(
            fields.get(1),
            Some(&status.as_str()),
            "{name}: the driver's answer after resume: {answer}"
        );
        let waited: f64 = fields.get(2).and_then(|ms| ms.parse().ok()).expect("call time");
        assert!(waited >= 150.0, "{name} did not wait while suspended: {answer}");
    }
}

#[test]
fn suspend_and_resume_set_the_flag_that_the_monitor_shows() {
    let dir = TestDir::new("suspend-flag");
    let region = dir.region("container");
    let first = container_process(&dir, &region, &[], &[0], MIB);
    let second = container_process(&dir, &region, &[], &[0], MIB);
    let region_argument = region.display().to_string();
    let suspended_pids = || -> Vec<i64> {
        let json: serde_json::Value =
            serde_json::from_str(&stdout(&run_smi(&["--region", &region_argument, "--json"]))).expect("JSON");
        json["regions"][0]["processes"]
            .as_array()
            .expect("processes")
            .iter()
            .filter(|process| process["suspended"] == serde_json::Value::Bool(true))
            .filter_map(|process| process["pid"].as_i64())
            .collect()
    };
    let first_pid = pid_of(&first).to_string();
    let output = run_smi(&["suspend", "--pid", &first_pid, "--region", &region_argument]);
    assert!(output.status.success());
    assert_eq!(suspended_pids(), [i64::from(pid_of(&first) as i32)]);
    let output = run_smi(&["suspend", "--region", &region_argument]);
    assert_eq!(stdout(&output).lines().count(), 2, "{}", stdout(&output));
    assert_eq!(suspended_pids().len(), 2);
    run_smi(&["resume", "--pid", &first_pid, "--region", &region_argument]);
    assert_eq!(suspended_pids(), [i64::from(pid_of(&second) as i32)]);
    run_smi(&["resume", "--region", &region_argument]);
    assert!(suspended_pids().is_empty());
    // An unknown pid and a file that is no region are errors, not crashes.
    let unknown = run_smi(&["suspend", "--pid", "999999999", "--region", &region_argument]);
    assert_eq!(unknown.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no live process with pid 999999999"));
    std::fs::write(dir.region("broken"), vec![1u8; 64]).expect("write");
    let broken = dir.region("broken").display().to_string();
    let refused = run_smi(&["suspend", "--region", &broken]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("too short"));
}

#[test]
fn watch_records_and_plots() {
    let dir = TestDir::new("watch");
    let region = dir.region("container");
    let mut process = container_process(&dir, &region, &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")], &[0], 10 * MIB);
    let record = dir.0.join("record.jsonl");
    let region_argument = region.display().to_string();
    let record_argument = record.display().to_string();
    let samples = 20;
    let mut watcher = Run::new(&vgpu_smi())
        .args([
            "--region",
            &region_argument,
            "--watch",
            "0.1",
            "--count",
            &samples.to_string(),
            "--record",
            &record_argument,
        ])
        .spawn(Duration::from_secs(60));
    // Allocate once the first sample is recorded, so the record sees the usage grow.
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::read_to_string(&record).map_or(true, |text| text.lines().count() == 0) {
        assert!(Instant::now() < deadline, "vgpu-smi --watch recorded nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    for _ in 0..4 {
        ok(&mut process, &format!("alloc {}", 50 * MIB));
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = watcher.finish();
    assert!(output.status.success());
    let screen = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        screen.matches("\x1b[H\x1b[2J").count(),
        samples,
        "each sample redraws the screen"
    );
    let lines = std::fs::read_to_string(&record).expect("read the record");
    assert_eq!(lines.lines().count(), samples);
    let used: Vec<u64> = lines
        .lines()
        .map(|line| {
            let report: vgpu_monitor::Report = serde_json::from_str(line).expect("a report per line");
            report.regions[0].devices[0].memory_used_bytes
        })
        .collect();
    assert!(used.windows(2).all(|pair| pair[0] <= pair[1]), "{used:?}");
    assert!(used.last() > used.first(), "{used:?}");
    for output_name in ["plot.png", "plot.svg"] {
        let output_path = dir.0.join(output_name);
        let plotted = run_smi(&[
            "plot",
            "--input",
            &record_argument,
            "--output",
            &output_path.display().to_string(),
        ]);
        assert!(plotted.status.success(), "{}", String::from_utf8_lossy(&plotted.stderr));
        let bytes = std::fs::read(&output_path).expect("the plot was written");
        assert!(bytes.len() > 1000, "{output_name}: {} bytes", bytes.len());
    }
    let png = std::fs::read(dir.0.join("plot.png")).expect("png");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let svg = std::fs::read_to_string(dir.0.join("plot.svg")).expect("svg");
    assert!(svg.contains("<svg") && svg.contains("memory"));
}

/// A reader of the region that loops as fast as it can until told to stop; returns how many
/// snapshots it took and checks each one.
fn tight_reader(region: PathBuf, limit: u64, stop: &AtomicBool, pause: Option<Duration>) -> usize {
    let mut reads = 0;
    while !stop.load(Ordering::Relaxed) {
        let read = vgpu_monitor::read_region(&region);
        let state = read.result.expect("the region reads while it is written");
        let snapshot = &state.snapshot;
        let used = snapshot.device_used(0);
        assert!(used <= limit, "a reader saw {used} bytes used over the limit {limit}");
        for process in snapshot.processes.iter().filter(|process| process.consistent) {
            let usage = process.memory[0];
            assert_eq!(
                usage.context + usage.module + usage.data,
                usage.total,
                "slot {}: a consistent slot's kinds add up to its total",
                process.slot
            );
            assert!(
                usage.total <= limit,
                "slot {} holds {} over the limit",
                process.slot,
                usage.total
            );
        }
        reads += 1;
        if let Some(pause) = pause {
            std::thread::sleep(pause);
        }
    }
    reads
}

const CHURN_PROCESSES: usize = 8;
const CHURN_LIMIT: u64 = CHURN_PROCESSES as u64 * CONTEXT + 6 * 64 * MIB;

/// Starts 8 processes of one container, ready to churn.
fn churners(dir: &TestDir, region: &Path) -> Vec<Session> {
    let limit = CHURN_LIMIT.to_string();
    (0..CHURN_PROCESSES)
        .map(|_| container_process(dir, region, &[("CUDA_DEVICE_MEMORY_LIMIT", &limit)], &[0], 0))
        .collect()
}

/// Runs one churn round of `milliseconds` in every process at once; returns the allocate+free
/// pairs done and refused.
fn churn(sessions: &mut [Session], milliseconds: u64) -> (u64, u64) {
    for session in sessions.iter_mut() {
        session.send(&format!("churn {} {milliseconds}", 64 * MIB));
    }
    sessions.iter_mut().fold((0, 0), |(pairs, refused), session| {
        let answer = session.read_line().expect("churn answer");
        let fields: Vec<u64> = answer
            .split_whitespace()
            .skip(1)
            .filter_map(|field| field.parse().ok())
            .collect();
        (
            pairs + fields.first().copied().unwrap_or(0),
            refused + fields.get(1).copied().unwrap_or(0),
        )
    })
}

#[test]
fn readers_see_consistent_snapshots_while_eight_processes_allocate_and_free() {
    let _alone = one_at_a_time();
    let dir = TestDir::new("tight-read");
    let region = dir.region("container");
    let mut sessions = churners(&dir, &region);
    // The churners are CPU-bound loops: at nice 10 they leave the reader the time it needs, so
    // that what is measured is whether they block it, not how much CPU time they take (on 2
    // cores, 8 processes that never wait leave a reader at nice 0 a ninth of them).
    for session in &sessions {
        // SAFETY: setpriority on our own child; no memory arguments.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, session.pid(), 10) };
    }
    let stop = AtomicBool::new(false);
    let (reads, (pairs, refused)) = std::thread::scope(|scope| {
        let reader = scope.spawn(|| tight_reader(region.clone(), CHURN_LIMIT, &stop, None));
        let work = churn(&mut sessions, 1500);
        stop.store(true, Ordering::Relaxed);
        (reader.join().expect("the reader did not fail"), work)
    });
    assert!(reads > 100, "only {reads} reads");
    // A floor on the traffic, not a speed: 8 processes share CI's 2 cores with the reader.
    assert!(pairs > 200, "only {pairs} allocate+free pairs");
    // 8 processes want 64 MiB each and the limit leaves room for 6: some are refused.
    assert!(refused > 0, "the limit was never reached");
    eprintln!("{reads} consistent reads during {pairs} allocate+free pairs ({refused} refused)");
}

/// Pins the calling thread (and the processes it starts afterwards) to one CPU.
fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity(0, ...) only touch
    // it and the calling thread's affinity.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// One benchmark configuration: `rounds` rounds of 2 s of churn without a reader, with a reader
/// every 10 ms and with a reader in a tight loop; prints each round and the medians.
fn benchmark_configuration(label: &str, dir: &TestDir, region: &Path, reader_cpu: Option<usize>) {
    let mut sessions = churners(dir, region);
    let rounds = 5;
    let milliseconds = 2000;
    churn(&mut sessions, 300); // warm-up
    let modes = ["no reader", "reader every 10 ms", "reader in a tight loop"];
    let mut results: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for _ in 0..rounds {
        for mode in modes {
            let stop = AtomicBool::new(false);
            let pause = (mode == "reader every 10 ms").then_some(Duration::from_millis(10));
            let (pairs, reads) = std::thread::scope(|scope| {
                let reader = (mode != "no reader").then(|| {
                    scope.spawn(|| {
                        if let Some(cpu) = reader_cpu {
                            pin_to_cpu(cpu);
                        }
                        tight_reader(region.to_path_buf(), CHURN_LIMIT, &stop, pause)
                    })
                });
                let (pairs, _) = churn(&mut sessions, milliseconds);
                stop.store(true, Ordering::Relaxed);
                (pairs, reader.map_or(0, |reader| reader.join().expect("reader")))
            });
            let rate = pairs as f64 / (milliseconds as f64 / 1000.0);
            eprintln!("{label}: {mode:>22}: {rate:>8.0} allocate+free pairs/s, {reads} reads");
            results.entry(mode).or_default().push(rate);
        }
    }
    let median = |values: &[f64]| {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        sorted[sorted.len() / 2]
    };
    let baseline = median(&results["no reader"]);
    for mode in modes {
        let rate = median(&results[mode]);
        eprintln!(
            "{label}: median {mode:>22}: {rate:>8.0} pairs/s ({:+.1}% against no reader)",
            (rate / baseline - 1.0) * 100.0
        );
    }
}

/// The benchmark of issue 5: how much a monitor reading the region slows 8 writers (processes
/// allocating and freeing in a loop) down. Twice: with every process free to run anywhere (the
/// tight-loop reader then also takes CPU time from the writers), and with the writers pinned to
/// CPU 0 and the reader to CPU 1 (only the reader's effect on the writers' memory is left). Not a
/// timed test: `cargo test -p vgpu-integration --test monitor -- --ignored --nocapture
/// writer_slowdown` prints the figures.
#[test]
#[ignore = "benchmark; prints the writers' slowdown"]
fn writer_slowdown_benchmark() {
    let _alone = one_at_a_time();
    let cpus = std::thread::available_parallelism().map_or(1, |count| count.get());
    eprintln!("machine: {cpus} CPUs");
    let dir = TestDir::new("benchmark");
    benchmark_configuration("shared CPUs", &dir, &dir.region("shared"), None);
    if cpus >= 2 {
        // The churners are started by this thread after it is pinned, so they inherit CPU 0.
        std::thread::scope(|scope| {
            scope.spawn(|| {
                pin_to_cpu(0);
                benchmark_configuration(
                    "writers on CPU 0, reader on CPU 1",
                    &dir,
                    &dir.region("pinned"),
                    Some(1),
                );
            });
        });
    }
}

/// The compute limiter's counters reach `vgpu-smi`: a process held to 10% launches sixty 1 ms
/// kernels. Its JSON shows every launch, about their GPU time charged, and the time the launches
/// were held (sixty milliseconds of GPU at 10% take about 600 ms less the bucket's burst: 290-300
/// ms held here; the bound leaves room for a loaded machine).
#[test]
fn the_limiter_counters_show_how_long_launches_were_held() {
    let dir = TestDir::new("limiter-counters");
    let region = dir.region("container");
    let mut process = container_process(&dir, &region, &[("CUDA_DEVICE_SM_LIMIT", "10")], &[0], 0);
    ok(&mut process, "load");
    let took_ms: f64 = ok(&mut process, "launch 60")[0].parse().expect("milliseconds");
    process.send("quit");
    let exited = process.finish();
    assert!(exited.status.success(), "{}", String::from_utf8_lossy(&exited.stderr));

    let region_argument = region.display().to_string();
    let json: serde_json::Value =
        serde_json::from_str(&stdout(&run_smi(&["--region", &region_argument, "--json"]))).expect("JSON");
    let limiter = &json["regions"][0]["devices"][0]["limiter"];
    let field = |name: &str| {
        limiter[name]
            .as_u64()
            .unwrap_or_else(|| panic!("limiter.{name} in {limiter}"))
    };
    assert_eq!(field("launches"), 60, "{limiter}");
    let charged_ms = field("charged_ns") as f64 / 1e6;
    assert!(
        (40.0..=90.0).contains(&charged_ms),
        "charged {charged_ms} ms for 60 ms of kernels"
    );
    let held_ms = field("held_ns") as f64 / 1e6;
    assert!(
        held_ms > 100.0 && held_ms <= took_ms,
        "held {held_ms} ms of the {took_ms} ms the launches took"
    );
}
