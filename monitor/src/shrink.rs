//! Mapped region files that shrink under the reader.
//!
//! A container can truncate its region file while `vgpu-smi` reads it. Touching a page of the
//! mapping past the file's new end raises `SIGBUS`, which would kill the operator's monitor, and
//! `serve`, the exporter of every container. While a mapping is watched here, a `SIGBUS` inside it
//! is answered by putting a zero page where the file's page was and marking the mapping: the copy
//! completes (it reads zeros there, or its stores land in that page) and its reader reports the
//! file as shrunk. A `SIGBUS` anywhere else gets the action that was installed before this one.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Mappings watched at once; beyond, a mapping is not watched (a fault in it kills as before).
const WATCHED: usize = 16;

struct Watched {
    start: AtomicUsize,
    /// 0: free; [`CLAIMED`]: being set up; otherwise the end of the range.
    end: AtomicUsize,
    shrank: AtomicBool,
}

const CLAIMED: usize = 1;

static TABLE: [Watched; WATCHED] = [const {
    Watched {
        start: AtomicUsize::new(0),
        end: AtomicUsize::new(0),
        shrank: AtomicBool::new(false),
    }
}; WATCHED];
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(4096);
static INSTALL: Once = Once::new();
/// The `SIGBUS` action before ours, put back for a fault outside every watched mapping (read in
/// the handler: `OnceLock::get` is one atomic load).
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A watched mapping; unwatched on drop.
pub(crate) struct Watch {
    slot: Option<usize>,
}

impl Watch {
    /// Whether a page of the mapping was past the file's end when it was touched.
    pub(crate) fn shrank(&self) -> bool {
        self.slot
            .and_then(|slot| TABLE.get(slot))
            .is_some_and(|watched| watched.shrank.load(Ordering::Acquire))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(watched) = self.slot.and_then(|slot| TABLE.get(slot)) {
            watched.end.store(0, Ordering::Release);
        }
    }
}

/// Watches `[start, start + len)`, a mapping of a file, until the returned guard is dropped (drop
/// it before unmapping).
pub(crate) fn watch(start: usize, len: usize) -> Watch {
    INSTALL.call_once(install);
    for (slot, watched) in TABLE.iter().enumerate() {
        if watched
            .end
            .compare_exchange(0, CLAIMED, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            watched.shrank.store(false, Ordering::Relaxed);
            watched.start.store(start, Ordering::Release);
            watched.end.store(start.saturating_add(len), Ordering::Release);
            return Watch { slot: Some(slot) };
        }
    }
    Watch { slot: None }
}

fn install() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if let Ok(page) = usize::try_from(page)
        && page.is_power_of_two()
    {
        PAGE_SIZE.store(page, Ordering::Relaxed);
    }
    if let Some(previous) = set_handler() {
        let _ = PREVIOUS.set(previous);
    }
}

/// Installs [`on_sigbus`]; returns the action it replaced.
fn set_handler() -> Option<libc::sigaction> {
    // SAFETY: a zeroed sigaction is a valid value to fill in; sigemptyset gets a valid pointer.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_sigbus;
    action.sa_sigaction = handler as usize;
    // SA_ONSTACK: on the alternate stack where one is set up (the Rust runtime sets one for its
    // stack-overflow report), as the handler this one replaces ran.
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: as above.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: as above.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers to a filled-in action and to space for the old one.
    (unsafe { libc::sigaction(libc::SIGBUS, &action, &mut previous) } == 0).then_some(previous)
}

/// The `SIGBUS` handler: only atomics, `mmap`, `sigaction` and `raise` (system calls that take no
/// lock).
extern "C" fn on_sigbus(_signal: c_int, info: *mut libc::siginfo_t, _context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let code = unsafe { (*info).si_code };
    if code <= 0 {
        // Sent by a process (kill, sigqueue): no faulting address. The previous action takes it,
        // once this handler returns and the signal is unblocked.
        restore_previous();
        // SAFETY: raise has no preconditions and is async-signal-safe.
        unsafe { libc::raise(libc::SIGBUS) };
        return;
    }
    // SAFETY: as above; for a fault, si_addr is the faulting address.
    let address = unsafe { (*info).si_addr() } as usize;
    let page = PAGE_SIZE.load(Ordering::Relaxed);
    for watched in &TABLE {
        let end = watched.end.load(Ordering::Acquire);
        let start = watched.start.load(Ordering::Acquire);
        // The entry must not have been given up and taken again between the two loads.
        let unchanged = watched.end.load(Ordering::Acquire) == end;
        if unchanged && end > CLAIMED && start <= address && address < end && zero_page(address & !(page - 1), page) {
            watched.shrank.store(true, Ordering::Release);
            return;
        }
    }
    // Not ours: the previous action (the default one kills) runs when the access faults again.
    restore_previous();
}

/// Maps a zero page at `base` over the file's page, so that the faulting access succeeds.
fn zero_page(base: usize, page: usize) -> bool {
    // SAFETY: `base` is a page of a mapping that this process made and still holds (watched
    // mappings are unwatched before they are unmapped); MAP_FIXED replaces that page only.
    let mapped = unsafe {
        libc::mmap(
            base as *mut c_void,
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    mapped != libc::MAP_FAILED
}

fn restore_previous() {
    let action = PREVIOUS.get().copied().unwrap_or_else(|| {
        // SAFETY: a zeroed sigaction with SIG_DFL (0) is the default action.
        unsafe { std::mem::zeroed() }
    });
    // SAFETY: a valid action; the old one is not wanted.
    unsafe { libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// The page size (4 KiB on x86_64, often 64 KiB on aarch64): the files are sized in pages.
    fn page() -> usize {
        // SAFETY: sysconf has no preconditions.
        usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).expect("a page size")
    }

    /// An unlinked file of four pages of `fill` bytes, mapped shared.
    fn mapped(name: &str, writable: bool, fill: u8) -> (std::fs::File, *mut u8, usize) {
        let len = 4 * page();
        let path = std::env::temp_dir().join(format!("vgpu-shrink-{name}-{}", std::process::id()));
        std::fs::write(&path, vec![fill; len]).expect("write");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open");
        std::fs::remove_file(&path).expect("unlink");
        let protection = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh shared mapping of an open file.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                protection,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(address, libc::MAP_FAILED);
        (file, address.cast(), len)
    }

    /// As [`mapped`], of zeros, then cut to one page under the mapping.
    fn shrunk_mapping(name: &str, writable: bool) -> (std::fs::File, *mut u8, usize) {
        let (file, address, len) = mapped(name, writable, 0);
        file.set_len(page() as u64).expect("truncate");
        (file, address, len)
    }

    #[test]
    fn a_read_past_the_new_end_reads_zeros_and_is_reported() {
        let (_file, address, len) = shrunk_mapping("read", false);
        let watch = watch(address as usize, len);
        // SAFETY: within the mapping; the page past the file's end is what is being tested.
        let value = unsafe { std::ptr::read_volatile(address.add(len - 8).cast::<u64>()) };
        assert_eq!(value, 0);
        assert!(watch.shrank());
        drop(watch);
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(address.cast(), len) };
    }

    #[test]
    fn a_store_past_the_new_end_lands_in_a_zero_page_and_is_reported() {
        let (_file, address, len) = shrunk_mapping("write", true);
        let watch = watch(address as usize, len);
        // SAFETY: within the mapping, writable.
        unsafe { std::ptr::write_volatile(address.add(2 * page()).cast::<u64>(), 7) };
        assert!(watch.shrank());
        // The first page is the file's and untouched.
        // SAFETY: within the mapping and the file.
        assert_eq!(unsafe { std::ptr::read_volatile(address.cast::<u64>()) }, 0);
        drop(watch);
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(address.cast(), len) };
    }

    #[test]
    fn an_unshrunk_mapping_is_not_reported() {
        let (_file, address, len) = mapped("whole", false, 1);
        let watch = watch(address as usize, len);
        // SAFETY: within the mapping and the file.
        let value = unsafe { std::ptr::read_volatile(address.add(len - 1)) };
        assert_eq!(value, 1);
        assert!(!watch.shrank());
        drop(watch);
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(address.cast(), len) };
    }
}
