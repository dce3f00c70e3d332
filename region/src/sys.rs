//! The system calls the region needs, each in a small function with its safety argument.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::time::Duration;

use crate::layout::{MUTEX_STORAGE_BYTES, OpaqueStorage, SEMAPHORE_BYTES};

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

/// Initialises a process-shared robust mutex in `storage`. Returns the pthread error number.
///
/// Only the creator calls this, while it holds the file exclusively: nobody else can be using the
/// mutex.
pub(crate) fn init_robust_mutex(storage: &OpaqueStorage<MUTEX_STORAGE_BYTES>) -> Result<(), i32> {
    let mutex: *mut libc::pthread_mutex_t = storage.as_mut_ptr();
    let mut attributes = std::mem::MaybeUninit::<libc::pthread_mutexattr_t>::uninit();
    // SAFETY: the attribute object is initialised by pthread_mutexattr_init before any other use
    // and destroyed once; the storage is large and aligned enough for a pthread_mutex_t (asserted
    // in layout.rs) and nobody else uses it during initialisation (see above).
    unsafe {
        let result = libc::pthread_mutexattr_init(attributes.as_mut_ptr());
        if result != 0 {
            return Err(result);
        }
        let mut result = libc::pthread_mutexattr_setpshared(attributes.as_mut_ptr(), libc::PTHREAD_PROCESS_SHARED);
        if result == 0 {
            result = libc::pthread_mutexattr_setrobust(attributes.as_mut_ptr(), libc::PTHREAD_MUTEX_ROBUST);
        }
        if result == 0 {
            // Priority inheritance makes the kernel hand the lock to the longest waiter on unlock
            // (equal priorities queue in order), so a process hammering the lock cannot starve
            // another one past the lock timeout.
            result = libc::pthread_mutexattr_setprotocol(attributes.as_mut_ptr(), libc::PTHREAD_PRIO_INHERIT);
        }
        if result == 0 {
            result = libc::pthread_mutex_init(mutex, attributes.as_ptr());
        }
        libc::pthread_mutexattr_destroy(attributes.as_mut_ptr());
        if result == 0 { Ok(()) } else { Err(result) }
    }
}

/// `pthread_mutex_timedlock` with a deadline `timeout` from now. Returns its result: 0,
/// `EOWNERDEAD` (locked; the previous owner died), `ETIMEDOUT`, `ENOTRECOVERABLE`, ...
pub(crate) fn timed_lock(storage: &OpaqueStorage<MUTEX_STORAGE_BYTES>, timeout: Duration) -> i32 {
    let deadline = realtime_after(timeout);
    // SAFETY: the storage holds a mutex initialised by init_robust_mutex (the region's magic and
    // version were checked before any lock); the deadline outlives the call.
    unsafe { libc::pthread_mutex_timedlock(storage.as_mut_ptr(), &deadline) }
}

/// `pthread_mutex_trylock`: 0, `EBUSY`, `EOWNERDEAD`, ... Spares the uncontended path the clock
/// read of a timed lock.
pub(crate) fn try_lock(storage: &OpaqueStorage<MUTEX_STORAGE_BYTES>) -> i32 {
    // SAFETY: as for timed_lock.
    unsafe { libc::pthread_mutex_trylock(storage.as_mut_ptr()) }
}

/// `pthread_mutex_consistent`, after a lock returned `EOWNERDEAD`.
pub(crate) fn make_consistent(storage: &OpaqueStorage<MUTEX_STORAGE_BYTES>) {
    // SAFETY: called by the owner of the mutex, right after it acquired it with EOWNERDEAD.
    unsafe { libc::pthread_mutex_consistent(storage.as_mut_ptr()) };
}

/// `pthread_mutex_unlock`.
pub(crate) fn unlock(storage: &OpaqueStorage<MUTEX_STORAGE_BYTES>) {
    // SAFETY: called only by the lock guard, whose thread owns the mutex.
    unsafe { libc::pthread_mutex_unlock(storage.as_mut_ptr()) };
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

fn realtime_after(timeout: Duration) -> libc::timespec {
    let now = clock(libc::CLOCK_REALTIME);
    let mut nanos = now.tv_nsec + libc::c_long::from(timeout.subsec_nanos());
    let mut secs = now
        .tv_sec
        .saturating_add(libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX));
    if nanos >= 1_000_000_000 {
        nanos -= 1_000_000_000;
        secs = secs.saturating_add(1);
    }
    libc::timespec {
        tv_sec: secs,
        tv_nsec: nanos,
    }
}

fn clock(id: libc::clockid_t) -> libc::timespec {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec to write; both clocks always exist on Linux.
    unsafe { libc::clock_gettime(id, &mut now) };
    now
}
