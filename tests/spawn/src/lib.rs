//! Starting the tests' child processes, on the host or under an emulator.
//!
//! Natively, `Command::spawn` returns after the child's `execve`. Under qemu-user (the aarch64
//! suite, `scripts/cross-test.sh`) it returns at once: qemu runs glibc's `posix_spawn`
//! (`CLONE_VM | CLONE_VFORK`) as a plain fork, and the child runs the emulated code up to its
//! `execve` on its own. A child forked while another thread of the (multithreaded, emulated) test
//! process held one of the emulator's locks can wait on it for good: about one run in 35 of the
//! memory tests left such a child, a copy of the test process with two threads in `futex_wait`.
//! Such a child still has the test process's command line, which tells it apart from one that
//! reached its program and hangs there (a failure of its own, which [`hung_state`] describes).

use std::io;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
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

/// `Command::output` through [`spawn_started`]: stdin from `/dev/null`, stdout and stderr
/// collected.
pub fn output_started(command: &mut Command) -> io::Result<Output> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    spawn_started(command)?.wait_with_output()
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

/// Whether the child reached its program within `limit`. An ended child (reaped here: a
/// later wait returns the same status) or one whose command line cannot be read has passed its
/// exec or never will, and counts as started.
fn became_program(child: &mut Child, expected: &[u8], limit: Duration) -> bool {
    let cmdline = format!("/proc/{}/cmdline", child.id());
    let start = Instant::now();
    loop {
        let running_it = std::fs::read(&cmdline).map_or(true, |line| line == expected);
        if running_it || !matches!(child.try_wait(), Ok(None)) {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
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

    #[test]
    fn a_started_child_runs_its_program() {
        let mut command = Command::new("sleep");
        command.arg("5");
        let mut child = spawn_started(&mut command).expect("start sleep");
        let line = std::fs::read(format!("/proc/{}/cmdline", child.id())).expect("read its command line");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(line, b"sleep\x005\x00");
    }

    #[test]
    fn a_child_that_never_shows_its_command_line_is_started_three_times_then_reported() {
        use std::os::unix::process::CommandExt;
        // Its argv[0] is not its program's name, as a child still in the test process's copy.
        let marks = std::env::temp_dir().join(format!("vgpu-test-spawn-{}", std::process::id()));
        let _ = std::fs::remove_file(&marks);
        let mut command = Command::new("sh");
        command
            .arg0("not-sh")
            .args(["-c", "echo x >> \"$0\"; sleep 5"])
            .arg(&marks);
        let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            spawn_started_within(&mut command, Duration::from_secs(1))
        }));
        let message = started
            .err()
            .and_then(|panic| panic.downcast::<String>().ok())
            .expect("a panic with a message");
        let runs = std::fs::read_to_string(&marks).unwrap_or_default().lines().count();
        let _ = std::fs::remove_file(&marks);
        assert!(
            message.contains("never started (3 tries); the last: command line \"not-sh -c"),
            "{message}"
        );
        assert_eq!(runs, 3, "each try runs the command once");
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
        let mut state = hung_state(child.id());
        // Just started, it may not have reached its sleep yet.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !state.contains("hrtimer") && !state.contains("nanosleep") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            state = hung_state(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(state.starts_with("command line \"sleep 5\"; thread "), "{state}");
        assert!(state.contains("\"sleep\" state S"), "{state}");
    }
}
