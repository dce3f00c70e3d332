//! The system calls the region needs, each in a small function with its safety argument.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU32;
use std::time::Duration;

use crate::layout::{OpaqueStorage, SEMAPHORE_BYTES};

/// A `MAP_SHARED` read-write mapping of the first `len` bytes of `file`.
pub(crate) fn map_shared(file: &File, len: usize) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh mapping chosen by the kernel (null hint) overlaps nothing of ours; the fd is
    // open for reading and writing for the duration of the call.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(address.cast()).ok_or_else(|| io::Error::other("mmap returned a null mapping"))
}

/// Removes a mapping made by [`map_shared`].
///
/// # Safety
/// `address` and `len` come from one `map_shared` call, and nothing refers to the mapping any more.
pub(crate) unsafe fn unmap(address: NonNull<u8>, len: usize) {
    // SAFETY: guaranteed by the caller. A failure (impossible for a valid mapping) leaks it.
    unsafe { libc::munmap(address.as_ptr().cast(), len) };
}

/// Sets `len` bytes from `address` to zero.
///
/// # Safety
/// The bytes are mapped writable, no Rust reference into them is alive, and no other thread or
/// process accesses them during the call.
pub(crate) unsafe fn zero(address: NonNull<u8>, len: usize) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::write_bytes(address.as_ptr(), 0, len) };
}

/// Allocates the file's blocks up front, so that a full filesystem is an error here instead of a
/// `SIGBUS` when a page of the mapping is first written. Filesystems that cannot preallocate are
/// accepted as they are.
pub(crate) fn preallocate(file: &File, len: usize) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: no memory arguments; the fd is open for writing.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 | libc::EOPNOTSUPP | libc::EINVAL => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

/// `flock(fd, operation)`, retried on EINTR. `Ok(false)`: `LOCK_NB` was given and the lock is
/// held elsewhere.
pub(crate) fn flock(file: &File, operation: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: flock has no memory arguments; the fd is open.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => return Ok(false),
            _ => return Err(error),
        }
    }
}

/// One byte of a file, with what to do to it: take a write lock on it or release it.
pub(crate) struct ByteLock(libc::flock);

impl ByteLock {
    /// A write lock on the byte at `offset`.
    pub(crate) const fn write(offset: u64) -> ByteLock {
        ByteLock(Self::range(libc::F_WRLCK, offset))
    }

    /// The release of a lock on the byte at `offset`.
    pub(crate) const fn release(offset: u64) -> ByteLock {
        ByteLock(Self::range(libc::F_UNLCK, offset))
    }

    const fn range(kind: libc::c_int, offset: u64) -> libc::flock {
        // Region offsets are far below i64::MAX; l_pid must be 0 for OFD locks.
        libc::flock {
            l_type: kind as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: offset as libc::off_t,
            l_len: 1,
            l_pid: 0,
        }
    }
}

/// Takes or releases an open-file-description lock on one byte of the file `fd` refers to,
/// without waiting (`F_OFD_SETLK`). `Ok(false)`: another description holds it. The kernel keeps
/// the lock outside the file and releases it when the description's last descriptor closes, so
/// nothing written into the file can make it crash, block or point anywhere.
pub(crate) fn ofd_lock(fd: RawFd, request: &ByteLock) -> io::Result<bool> {
    loop {
        // The system call itself: glibc's fcntl wrapper costs the fast path 25 instructions more
        // (64-bit targets only, where struct flock is the kernel's).
        // SAFETY: F_OFD_SETLK only reads the flock struct, which outlives the call.
        if unsafe { libc::syscall(libc::SYS_fcntl, fd, libc::F_OFD_SETLK, &request.0) } == 0 {
            return Ok(true);
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN | libc::EACCES) => return Ok(false),
            _ => return Err(error),
        }
    }
}

/// Whether a description other than `fd`'s holds a lock on the byte at `offset` (`F_OFD_GETLK`:
/// would a write lock of ours conflict?).
pub(crate) fn ofd_lock_held_elsewhere(fd: RawFd, offset: u64) -> io::Result<bool> {
    // SAFETY: flock is a plain C struct for which all zeroes is a valid value.
    let mut range: libc::flock = unsafe { std::mem::zeroed() };
    range.l_type = libc::F_WRLCK as libc::c_short;
    range.l_whence = libc::SEEK_SET as libc::c_short;
    range.l_start = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    range.l_len = 1;
    // SAFETY: F_OFD_GETLK reads and writes the flock struct, which outlives the call.
    if unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut range) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(range.l_type != libc::F_UNLCK as libc::c_short)
}

/// Sleeps while `word` holds `expected`, at most `timeout`, until a [`futex_wake`] on it: from
/// any process mapping the same file for a word of the region, from this process for a word of
/// its own memory (the thread gate's waiters). Returns early on any change, signal or error:
/// callers loop.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let timeout = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: FUTEX_WAIT (shared: keyed by the mapped file page, or by this process's page) only
    // reads the aligned word, which the reference keeps alive for the duration of the call; the
    // timeout outlives the call. The kernel compares the word and sleeps; no value makes it do
    // anything else.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &timeout,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
}

/// Wakes up to `count` sleepers in [`futex_wait`] on `word` (the longest sleeping first); returns
/// how many it woke.
pub(crate) fn futex_wake(word: &AtomicU32, count: i32) -> usize {
    // SAFETY: FUTEX_WAKE only uses the word's address as a key; nothing is read or written.
    let woken = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            count,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    usize::try_from(woken).unwrap_or(0)
}

/// `close(fd)`, for descriptors this crate opened and owns.
///
/// # Safety
/// `fd` is open, owned by the caller, and nothing uses it afterwards.
pub(crate) unsafe fn close(fd: RawFd) {
    // SAFETY: guaranteed by the caller; close is async-signal-safe (used after fork).
    unsafe { libc::close(fd) };
}

/// Registers `child` to run in the child of every `fork`, before `fork` returns there.
pub(crate) fn at_fork_in_child(child: extern "C" fn()) {
    // SAFETY: registers a plain function; it only runs async-signal-safe code (see its callers).
    unsafe { libc::pthread_atfork(None, None, Some(child)) };
}

/// Initialises one of HAMi-core's semaphores, process-shared and free, as HAMi-core's creator does.
/// Only the creator calls this, while it holds the file exclusively.
pub(crate) fn init_semaphore(storage: &OpaqueStorage<SEMAPHORE_BYTES>) {
    // SAFETY: the storage is large and aligned enough for a sem_t (asserted in layout.rs) and nobody
    // else uses it during initialisation.
    unsafe { libc::sem_init(storage.as_mut_ptr(), 1, 1) };
}

/// The process's effective uid: the owner of the files it creates.
pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid has no arguments and always succeeds.
    unsafe { libc::geteuid() }
}

/// Clears `O_NONBLOCK`, with which a file is opened so that a FIFO swapped in at the last moment
/// cannot block the open.
pub(crate) fn clear_nonblocking(file: &File) -> io::Result<()> {
    // SAFETY: F_GETFL has no memory arguments; the fd is open.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    if flags == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: F_SETFL takes an int; the fd is open.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// False only when `kill(pid, 0)` says no such process exists (`ESRCH`); `EPERM` means it exists.
pub(crate) fn process_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission; nothing is delivered.
    let result = unsafe { libc::kill(pid, 0) };
    !(result == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH))
}

/// `CLOCK_MONOTONIC` in nanoseconds: the same clock in every process of the machine.
pub fn monotonic_ns() -> u64 {
    let now = clock(libc::CLOCK_MONOTONIC);
    u64::try_from(now.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

fn clock(id: libc::clockid_t) -> libc::timespec {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec to write; the clocks asked for always exist on Linux.
    unsafe { libc::clock_gettime(id, &mut now) };
    now
}

/// Gives the open file `file` the name `destination` (a hard link), through `/proc/self/fd`: the
/// file is linked, whatever its own name now names. Fails for a file with no name left.
pub(crate) fn link_open_file(file: &File, destination: &std::path::Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let source = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let destination = std::ffi::CString::new(destination.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: two NUL-terminated paths that live across the call.
    let linked = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            source.as_ptr(),
            libc::AT_FDCWD,
            destination.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if linked == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
