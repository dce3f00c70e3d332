//! Is the process of a slot still alive?
//!
//! A slot names its process by pid, in the pid namespace of the processes sharing the region (the
//! container's). A process is dead when `kill(pid, 0)` fails with `ESRCH`, when it is a zombie (it
//! has exited and holds no GPU memory any more; its parent just has not waited for it yet), or when
//! the pid now belongs to a different process (its start time in `/proc/<pid>/stat` differs from the
//! one recorded at attach).
//!
//! Caveat: pids only mean something inside one pid namespace. Processes that share a region from
//! different pid namespaces (two containers given the same file, or a host process and a container
//! process) see each other's pids as absent or as someone else, and would reap each other's slots.
//! Locking the region's priority-inheritance mutex also needs the owner's thread id to be visible
//! in the locker's namespace: a process outside it gets a lock timeout whenever it has to wait.
//! One region file per container, as HAMi arranges it, avoids this. `hostpid` (written by HAMi's
//! monitor) is not used for liveness.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::sys;

/// Reads of `/proc/<pid>/stat` by this process: what a reap costs, for the tests that bound it.
static STAT_READS: AtomicU64 = AtomicU64::new(0);

/// How many times this process has read a `/proc/<pid>/stat` so far.
pub fn stat_reads() -> u64 {
    STAT_READS.load(Ordering::Relaxed)
}

/// What `/proc/<pid>/stat` says about a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    /// The state letter (`R`, `S`, `Z`, ...).
    pub state: u8,
    /// Start time in clock ticks since boot (field 22).
    pub start_time: u64,
}

/// Parses the contents of `/proc/<pid>/stat`. The command name (field 2) is in parentheses and may
/// itself hold spaces and parentheses, so fields are counted from the last `)`.
pub fn parse_proc_stat(contents: &[u8]) -> Option<ProcStat> {
    let after_name = contents.iter().rposition(|&byte| byte == b')')?;
    let rest = std::str::from_utf8(contents.get(after_name + 1..)?).ok()?;
    let mut fields = rest.split_ascii_whitespace();
    // Field 3 is the state; field 22 the start time, 19 fields later.
    let state = *fields.next()?.as_bytes().first()?;
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// Reads `/proc/<pid>/stat`; `None` when the process is gone or `/proc` is not mounted.
pub fn read_proc_stat(pid: i32) -> Option<ProcStat> {
    if pid <= 0 {
        return None;
    }
    STAT_READS.fetch_add(1, Ordering::Relaxed);
    parse_proc_stat(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
}

/// The start time of a process (clock ticks since boot), as recorded in its slot at attach;
/// `None` when `/proc` cannot tell.
pub fn process_start_time(pid: i32) -> Option<u64> {
    read_proc_stat(pid).map(|stat| stat.start_time)
}

/// Whether a process with this pid exists (`kill(pid, 0)`), in the caller's pid namespace: a
/// system call, where [`is_alive`] reads `/proc`. A zombie or a reused pid exists.
pub fn exists(pid: i32) -> bool {
    pid > 0 && sys::process_exists(pid)
}

/// Whether the process a slot records (pid, start time or 0 when unknown) is still alive, judged
/// in the caller's pid namespace.
pub fn is_alive(pid: i32, recorded_start_time: u64) -> bool {
    if pid <= 0 || !sys::process_exists(pid) {
        return false;
    }
    match read_proc_stat(pid) {
        Some(stat) => {
            let exited = matches!(stat.state, b'Z' | b'X' | b'x');
            let reused = recorded_start_time != 0 && stat.start_time != recorded_start_time;
            !exited && !reused
        }
        // It existed a moment ago: either /proc is missing or it just exited (the next reap sees it).
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_stat_line_with_a_hostile_command_name() {
        let line = b"4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100 \
                     18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0\n";
        assert_eq!(
            parse_proc_stat(line),
            Some(ProcStat {
                state: b'S',
                start_time: 987_654
            })
        );
    }

    #[test]
    fn rejects_truncated_and_garbage_stat_lines() {
        assert_eq!(parse_proc_stat(b""), None);
        assert_eq!(parse_proc_stat(b"12 (x) S 1 2 3"), None);
        assert_eq!(parse_proc_stat(b"12 (x"), None);
        assert_eq!(
            parse_proc_stat(b"1 (x) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 notanumber"),
            None
        );
    }

    #[test]
    fn this_process_is_alive_and_its_start_time_is_readable() {
        let pid = std::process::id() as i32;
        let start = process_start_time(pid).unwrap();
        assert!(is_alive(pid, start));
        assert!(is_alive(pid, 0));
        assert!(
            !is_alive(pid, start + 1),
            "a different start time means the pid was reused"
        );
        assert!(!is_alive(0, 0));
        assert!(!is_alive(-5, 0));
    }
}
