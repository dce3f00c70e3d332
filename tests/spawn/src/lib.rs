//! Starting the tests' child processes, on the host or under an emulator; and turns for the tests
//! that measure waits ([`turn`]).
//!
//! Natively, `Command::spawn` returns after the child's `execve`. Under qemu-user (the aarch64
//! suite, `scripts/cross-test.sh`) it returns at once: qemu runs glibc's `posix_spawn`
//! (`CLONE_VM | CLONE_VFORK`) as a plain fork, and the child runs the emulated code up to its
//! `execve` on its own. A child forked while another thread of the (multithreaded, emulated) test
//! process held one of the emulator's locks can wait on it for good: 2 of 174 runs of the
//! memory tests left such a child, a copy of the test process with two threads in `futex_wait`.
//! Such a child still has the test process's command line (qemu's own words first), which tells
//! it apart from one that passed its exec, even into another program (a wrapper's exec), and
//! hangs there: a failure of its own, which [`hung_state`] describes.

pub mod turn;

use std::io::{self, Read};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a child may take to become its program before it is taken for stuck between fork
/// and exec and started again.
pub const EXEC_LIMIT: Duration = Duration::from_secs(10);

/// How many times a child stuck before its exec is started in all.
const TRIES: u32 = 3;

/// Starts `command` and returns once the child runs its program (or has already ended), starting
/// it again, twice at most, when it stays stuck between fork and exec. An error is `spawn`'s;
/// a child stuck at every try is a panic (a hang of the test machine, not of the test).
pub fn spawn_started(command: &mut Command) -> io::Result<Child> {
    spawn_started_within(command, EXEC_LIMIT)
}

fn spawn_started_within(command: &mut Command, limit: Duration) -> io::Result<Child> {
    let expected = command_line(command);
    for attempt in 1..=TRIES {
        let mut child = command.spawn()?;
        if became_program(&mut child, &expected, limit) {
            return Ok(child);
        }
        let state = hung_state(child.id());
        assert!(
            attempt < TRIES,
            "{:?} never started ({TRIES} tries); the last: {state}",
            command.get_program()
        );
        eprintln!("spawn: a child stuck before exec for {limit:?} is started again: {state}");
        let _ = child.kill();
        let _ = child.wait();
    }
    unreachable!("the last try returns or panics")
}

/// The longest a child run to completion ([`output_started`], [`wait_with_output_within`] as
/// the tests call it) may take: a hang of the child then fails its test, described, instead of
/// holding CI until its own time runs out.
pub const RUN_LIMIT: Duration = Duration::from_secs(300);

/// `Command::output` through [`spawn_started`], bounded by [`RUN_LIMIT`]: stdin from
/// `/dev/null`, stdout and stderr collected.
pub fn output_started(command: &mut Command) -> io::Result<Output> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    wait_with_output_within(spawn_started(command)?, RUN_LIMIT)
}

/// `Child::wait_with_output`, bounded: a child still running after `limit` is described on
/// stderr and killed, and what it wrote is returned with its status (killed by `SIGKILL`). The
/// thread that waits is the one that kills, so the pid cannot have been reused by then. The bound
/// is the child's: a process it started that keeps its pipes open is still waited for.
pub fn wait_with_output_within(mut child: Child, limit: Duration) -> io::Result<Output> {
    let stdout = child.stdout.take().map(read_in_background);
    let stderr = child.stderr.take().map(read_in_background);
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > limit {
            eprintln!(
                "spawn: killing pid {} after {limit:?}: {}",
                child.id(),
                hung_state(child.id())
            );
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    };
    let collected =
        |reader: Option<JoinHandle<Vec<u8>>>| reader.and_then(|reader| reader.join().ok()).unwrap_or_default();
    Ok(Output {
        status,
        stdout: collected(stdout),
        stderr: collected(stderr),
    })
}

/// Reads a child's pipe to its end on a thread of its own (so a child never blocks on a full
/// pipe); joining gives the bytes.
pub fn read_in_background(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        bytes
    })
}

/// The command line `/proc/<pid>/cmdline` shows once `command` runs: the program, then each
/// argument, each ended by a NUL.
fn command_line(command: &Command) -> Vec<u8> {
    let mut line = Vec::new();
    for word in std::iter::once(command.get_program()).chain(command.get_args()) {
        line.extend_from_slice(word.as_encoded_bytes());
        line.push(0);
    }
    line
}

/// Whether the child passed its exec within `limit`: it runs the command, or its command line is
/// set and no longer ends with this process's. An ended child (reaped here: a later wait returns
/// the same status) has passed its exec or never will, and counts as started; so does any child
/// where `/proc` cannot be read.
fn became_program(child: &mut Child, expected: &[u8], limit: Duration) -> bool {
    let own = own_command_line();
    let cmdline = format!("/proc/{}/cmdline", child.id());
    let start = Instant::now();
    loop {
        // Empty while an exec sets the new program up (a `vfork` parent is let go before the
        // arguments are in place): not known yet.
        // Unreadable while the child lives (seen under qemu-user): not known yet either, unless
        // this machine has no readable /proc at all.
        let passed_exec = match read_command_line(&cmdline) {
            Ok(line) => line == expected || (!line.is_empty() && !line.ends_with(own)),
            Err(_) => std::fs::metadata("/proc/self/cmdline").is_err(),
        };
        if passed_exec || !matches!(child.try_wait(), Ok(None)) {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A command line read in one `read` call, which sees one address space. `std::fs::read` first
/// reads 32 bytes, then the rest: a child whose exec lands between the two gives the start of
/// the old line (qemu's, not ending with this process's) and nothing of the new one (empty until
/// the exec sets it up), which looks like another program.
fn read_command_line(path: &str) -> io::Result<Vec<u8>> {
    // Far longer than any command line the tests start; the kernel returns it in one call.
    let mut line = vec![0; 1 << 17];
    let length = std::fs::File::open(path)?.read(&mut line)?;
    line.truncate(length);
    Ok(line)
}

/// This process's command line as it reads it. Under qemu-user that is the emulated program's
/// words, which end the emulator's real command line (and a copy's).
fn own_command_line() -> &'static [u8] {
    static OWN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    // Unreadable, it would match every child: a copy is then told only by the command itself.
    OWN.get_or_init(|| {
        std::fs::read("/proc/self/cmdline")
            .ok()
            .filter(|line| !line.is_empty())
            .unwrap_or_else(|| vec![0xff])
    })
}

/// A hung child's command line and, for each of its threads, its name, state, kernel wait
/// channel and current system call, from `/proc` (what cannot be read is left empty).
pub fn hung_state(pid: u32) -> String {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let read = |path: PathBuf| std::fs::read_to_string(path).unwrap_or_default().trim().to_string();
    let cmdline = std::fs::read(proc_dir.join("cmdline")).unwrap_or_default();
    let mut text = format!(
        "command line {:?}",
        String::from_utf8_lossy(&cmdline).replace('\0', " ").trim()
    );
    let mut tasks: Vec<PathBuf> = std::fs::read_dir(proc_dir.join("task"))
        .map(|entries| entries.flatten().map(|entry| entry.path()).collect())
        .unwrap_or_default();
    tasks.sort();
    for task in tasks {
        let stat = read(task.join("stat"));
        // The state is the first field after the command name, which ends with the last ")".
        let state = stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.get(..1))
            .unwrap_or("?")
            .to_string();
        let syscall = read(task.join("syscall"));
        text += &format!(
            "; thread {} {:?} state {state} waits in {:?} syscall {:?}",
            task.file_name()
                .map(|name| name.to_string_lossy().into_owned())
                .unwrap_or_default(),
            read(task.join("comm")),
            read(task.join("wchan")),
            syscall.split_whitespace().next().unwrap_or("?"),
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    /// The command line of a child once its exec has set it up: the parent of a `vfork` is let go
    /// when the child's old memory is released, before the new one holds its arguments, and
    /// `/proc/<pid>/cmdline` reads empty until then.
    fn settled_command_line(pid: u32) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let line = std::fs::read(format!("/proc/{pid}/cmdline")).expect("read its command line");
            if !line.is_empty() || Instant::now() > deadline {
                return line;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_started_child_runs_its_program() {
        let mut command = Command::new("sleep");
        command.arg("5");
        let mut child = spawn_started(&mut command).expect("start sleep");
        let line = settled_command_line(child.id());
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(line, b"sleep\x005\x00");
    }

    /// One run of the copy scenario: the marks the command wrote and what `spawn_started_within`
    /// said, or `None` when a try's child ended before its time (under qemu-user a forked copy
    /// of the emulator can die before its exec, and an ended child rightly counts as started).
    fn start_a_copy() -> Option<(String, usize)> {
        use std::os::unix::process::CommandExt;
        // A shell whose command line ends with this process's and is not the command's (its
        // argv[0] is not "sh"), as a copy between fork and exec.
        let marks = std::env::temp_dir().join(format!("vgpu-test-spawn-{}", std::process::id()));
        let _ = std::fs::remove_file(&marks);
        let mut command = Command::new("sh");
        command
            .arg0("a-copy")
            .args(["-c", "echo x >> \"$MARKS\"; sleep 5; :"])
            .env("MARKS", &marks);
        for word in own_command_line()
            .split(|byte| *byte == 0)
            .filter(|word| !word.is_empty())
        {
            command.arg(std::ffi::OsStr::from_bytes(word));
        }
        // 3 s a try: on a loaded 2-core machine a shell can take over a second to write its mark.
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            spawn_started_within(&mut command, Duration::from_secs(3))
        }));
        let runs = || std::fs::read_to_string(&marks).unwrap_or_default().lines().count();
        let outcome = match started {
            Err(panic) => {
                let message = panic.downcast::<String>().map(|message| *message).unwrap_or_default();
                Some((message, runs()))
            }
            // Said as they are, so that a failure says which way it went.
            Ok(Ok(mut child)) => {
                let line = read_command_line(&format!("/proc/{}/cmdline", child.id())).unwrap_or_default();
                let ended = child.try_wait();
                let _ = child.kill();
                let _ = child.wait();
                match ended {
                    Ok(Some(status)) => {
                        eprintln!("a try's child ended early ({status}, {} marks): run again", runs());
                        None
                    }
                    _ => panic!(
                        "counted as started: command line {:?}, this process's {:?}",
                        String::from_utf8_lossy(&line),
                        String::from_utf8_lossy(own_command_line())
                    ),
                }
            }
            Ok(Err(error)) => panic!("spawn failed: {error}"),
        };
        let _ = std::fs::remove_file(&marks);
        outcome
    }

    #[test]
    fn a_child_that_stays_a_copy_of_this_process_is_started_three_times_then_reported() {
        let (message, runs) = (0..3)
            .find_map(|_| start_a_copy())
            .expect("a try's child ended early in each of 3 runs");
        assert!(
            message.contains("never started (3 tries); the last: command line \"a-copy -c"),
            "{message}"
        );
        assert_eq!(runs, 3, "each try runs the command once");
    }

    #[test]
    fn a_child_that_execs_another_program_at_once_counts_as_started() {
        let start = Instant::now();
        let mut child = spawn_started(Command::new("sh").args(["-c", "exec sleep 5"])).expect("start sh");
        let elapsed = start.elapsed();
        let _ = child.kill();
        let _ = child.wait();
        assert!(elapsed < Duration::from_secs(5), "took {elapsed:?}");
    }

    #[test]
    fn a_child_that_outlives_its_limit_is_killed_and_what_it_wrote_returned() {
        use std::os::unix::process::ExitStatusExt;
        let child = spawn_started(
            Command::new("sh")
                .args(["-c", "echo before; exec sleep 30"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .expect("start sh");
        let start = Instant::now();
        let output = wait_with_output_within(child, Duration::from_millis(500)).expect("wait for it");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "waited {:?}",
            start.elapsed()
        );
        assert_eq!(
            (output.status.signal(), output.stdout.as_slice()),
            (Some(9), &b"before\n"[..])
        );
    }

    #[test]
    fn a_child_that_ended_at_once_counts_as_started() {
        let output = output_started(Command::new("sh").args(["-c", "echo out; exit 3"])).expect("run sh");
        assert_eq!(
            (output.status.code(), output.stdout.as_slice()),
            (Some(3), &b"out\n"[..])
        );
    }

    #[test]
    fn a_hung_childs_state_names_its_command_and_where_it_waits() {
        let mut child = spawn_started(Command::new("sleep").arg("5")).expect("start sleep");
        settled_command_line(child.id());
        let mut state = hung_state(child.id());
        // Just started, it may not have reached its sleep yet; on a busy machine it may be read
        // between its wake-up and its next sleep.
        let asleep = |state: &str| state.contains("nanosleep") && state.contains("\"sleep\" state S");
        let deadline = Instant::now() + Duration::from_secs(5);
        while !asleep(&state) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            state = hung_state(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(state.starts_with("command line \"sleep 5\"; thread "), "{state}");
        assert!(state.contains("\"sleep\" state S"), "{state}");
    }
}
