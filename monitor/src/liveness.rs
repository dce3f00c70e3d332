//! Whether a slot's process is alive, wherever `vgpu-smi` runs. A slot records its process's pid in
//! the container's pid namespace and its start time (clock ticks since boot, the same in every
//! namespace). In the container, the pid is the process's own. On the host (a shell on the node,
//! `kubectl debug node/...`), the same process has another pid: it is the visible process started
//! at that tick whose innermost pid (the last of the `NSpid:` line of `/proc/<pid>/status`) is the
//! slot's. The device totals count only the processes found alive, so both views must find them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use vgpu_region::process::parse_proc_stat;

/// How long a scan of the visible processes is reused (a report judges every slot of every region
/// at once; `serve` makes one a scrape).
const SCAN_LIFETIME: Duration = Duration::from_secs(1);

/// Whether the process a slot records is alive, from `/proc` (see the module's note). Without a
/// start time (a HAMi-core file) only the pid itself is looked at.
pub fn process_is_alive(pid: i32, recorded_start_time: Option<u64>) -> bool {
    static SCAN: Mutex<Option<(Instant, Scan)>> = Mutex::new(None);
    let proc = Path::new("/proc");
    let cached = |start_time: u64| {
        let mut scan = SCAN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if scan.as_ref().is_none_or(|(at, _)| at.elapsed() >= SCAN_LIFETIME) {
            *scan = Some((Instant::now(), Scan::new(proc)));
        }
        scan.as_ref().is_some_and(|(_, scan)| scan.has(proc, pid, start_time))
    };
    is_alive_in(proc, pid, recorded_start_time, cached)
}

/// [`process_is_alive`] against a `/proc` at `proc`; `nested(start_time)` answers for a process of
/// another namespace.
fn is_alive_in(proc: &Path, pid: i32, recorded_start_time: Option<u64>, nested: impl FnOnce(u64) -> bool) -> bool {
    if pid <= 0 {
        return false;
    }
    let start_time = recorded_start_time.filter(|&ticks| ticks != 0);
    match read_stat(proc, pid) {
        Some((state, ticks)) if start_time.is_none_or(|recorded| recorded == ticks) => return !exited(state),
        Some(_) => {}
        // Without /proc, only kill(2) can tell (as the region's reaper does).
        None if !proc.join("self").exists() => return kill_finds(pid),
        None => {}
    }
    start_time.is_some_and(nested)
}

/// The pid, in `vgpu-smi`'s own pid namespace, of the live process a slot records: the slot's pid
/// when the process with that pid here started at the recorded tick, else the visible process
/// started then whose innermost pid is the slot's (the view from the host). `None` without a
/// recorded start time (nothing to tell a reused or forged pid by) or when no such process lives:
/// a pid written into the region is never acted on unless its start time matches.
pub fn visible_pid(pid: i32, recorded_start_time: Option<u64>) -> Option<i32> {
    visible_pid_in(Path::new("/proc"), pid, recorded_start_time)
}

fn visible_pid_in(proc: &Path, pid: i32, recorded_start_time: Option<u64>) -> Option<i32> {
    let start_time = recorded_start_time.filter(|&ticks| ticks != 0)?;
    if pid <= 0 {
        return None;
    }
    match read_stat(proc, pid) {
        Some((state, ticks)) if ticks == start_time => return (!exited(state)).then_some(pid),
        _ => {}
    }
    let scan = Scan::new(proc);
    scan.by_start_time
        .get(&start_time)
        .into_iter()
        .flatten()
        .copied()
        .find(|&visible| innermost_pid(proc, visible) == Some(pid))
}

/// The processes visible in a `/proc`, by start time, zombies left out.
struct Scan {
    by_start_time: HashMap<u64, Vec<i32>>,
}

impl Scan {
    fn new(proc: &Path) -> Scan {
        let mut by_start_time: HashMap<u64, Vec<i32>> = HashMap::new();
        let entries = std::fs::read_dir(proc).into_iter().flatten().flatten();
        for pid in entries.filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok()) {
            if let Some((state, ticks)) = read_stat(proc, pid)
                && !exited(state)
            {
                by_start_time.entry(ticks).or_default().push(pid);
            }
        }
        Scan { by_start_time }
    }

    /// Whether a process started at `start_time` has `pid` as its innermost pid.
    fn has(&self, proc: &Path, pid: i32, start_time: u64) -> bool {
        self.by_start_time
            .get(&start_time)
            .into_iter()
            .flatten()
            .any(|&visible| innermost_pid(proc, visible) == Some(pid))
    }
}

fn read_stat(proc: &Path, pid: i32) -> Option<(u8, u64)> {
    let stat = parse_proc_stat(&std::fs::read(proc_path(proc, pid, "stat")).ok()?)?;
    Some((stat.state, stat.start_time))
}

/// The last pid of the `NSpid:` line: the process's pid in its own (innermost) namespace.
fn innermost_pid(proc: &Path, pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(proc_path(proc, pid, "status")).ok()?;
    let line = status.lines().find_map(|line| line.strip_prefix("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

fn proc_path(proc: &Path, pid: i32, file: &str) -> PathBuf {
    proc.join(pid.to_string()).join(file)
}

fn exited(state: u8) -> bool {
    matches!(state, b'Z' | b'X' | b'x')
}

fn kill_finds(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let result = unsafe { libc::kill(pid, 0) };
    result == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc`: `self`, and processes with (pid, state, start time, NSpid line).
    fn fake_proc(processes: &[(i32, char, u64, &str)]) -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "vgpu-liveness-{}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("self")).unwrap();
        for &(pid, state, start, nspid) in processes {
            let dir = root.join(pid.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            let stat = format!("{pid} (python3) {state} 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 100 10\n");
            std::fs::write(dir.join("stat"), stat).unwrap();
            std::fs::write(dir.join("status"), format!("Name:\tpython3\nNSpid:\t{nspid}\n")).unwrap();
        }
        root
    }

    fn alive(proc: &Path, pid: i32, start: Option<u64>) -> bool {
        is_alive_in(proc, pid, start, |ticks| Scan::new(proc).has(proc, pid, ticks))
    }

    #[test]
    fn a_process_is_found_in_its_own_namespace_and_from_the_host() {
        // Seen from the host: the container's pid 7 is host pid 4242, its pid 9 is 4243; host pid
        // 7 is an unrelated process.
        let host = fake_proc(&[
            (4242, 'S', 1000, "4242\t7"),
            (4243, 'Z', 2000, "4243\t9"),
            (7, 'S', 50, "7"),
        ]);
        assert!(alive(&host, 7, Some(1000)), "the container's pid 7, from the host");
        assert!(!alive(&host, 9, Some(2000)), "a zombie is dead");
        assert!(!alive(&host, 7, Some(1001)), "no process started then");
        assert!(!alive(&host, 8, Some(1000)), "started then, but with another pid");
        assert!(alive(&host, 7, Some(50)), "the host's own pid 7");
        assert!(alive(&host, 7, None), "without a start time, the pid alone");
        assert!(!alive(&host, 11, None));
        assert!(!alive(&host, 0, Some(1000)));
        assert!(!alive(&host, -4242, Some(1000)));
        // Seen from inside the container: its own pids.
        let container = fake_proc(&[(7, 'S', 1000, "7"), (9, 'Z', 2000, "9")]);
        assert!(alive(&container, 7, Some(1000)));
        assert!(!alive(&container, 9, Some(2000)));
        assert!(!alive(&container, 7, Some(999)), "pid 7 reused by a later process");
        for root in [host, container] {
            let _ = std::fs::remove_dir_all(root);
        }
    }

    #[test]
    fn the_visible_pid_of_a_slot_needs_its_start_time() {
        let host = fake_proc(&[
            (4242, 'S', 1000, "4242\t7"),
            (4243, 'Z', 2000, "4243\t9"),
            (7, 'S', 50, "7"),
        ]);
        assert_eq!(
            visible_pid_in(&host, 7, Some(1000)),
            Some(4242),
            "the container's 7, from the host"
        );
        assert_eq!(visible_pid_in(&host, 7, Some(50)), Some(7), "the host's own 7");
        assert_eq!(visible_pid_in(&host, 9, Some(2000)), None, "a zombie");
        assert_eq!(visible_pid_in(&host, 7, None), None, "no start time: not acted on");
        assert_eq!(
            visible_pid_in(&host, 7, Some(1001)),
            None,
            "a forged or stale start time"
        );
        assert_eq!(visible_pid_in(&host, -1, Some(1000)), None);
        let _ = std::fs::remove_dir_all(host);
    }

    #[test]
    fn this_process_is_alive_through_the_real_proc() {
        let pid = std::process::id() as i32;
        let start = vgpu_region::process_start_time(pid);
        assert!(process_is_alive(pid, start));
        assert!(!process_is_alive(pid, start.map(|ticks| ticks + 1)));
    }
}
