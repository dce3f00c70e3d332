//! The bytes of the region file.
//!
//! Offset 0 holds HAMi-core's `shared_region_t`, version 1.2, byte for byte as the x86_64 C compiler
//! lays it out (`src/multiprocess/multiprocess_memory_limit.h` upstream), because HAMi's monitor maps
//! the file with that struct. vgpu's [`Extension`] follows it at [`EXTENSION_OFFSET`]; the monitor
//! never reads past HAMi's struct, and it accepts any file at least that large whose major version is
//! 1. `docs/region-layout.md` describes every field and who writes it.
//!
//! Every field that processes share is an atomic of the C field's size, so one process can read a
//! field while another writes it without undefined behaviour. HAMi-core's semaphores are opaque
//! storage that only the semaphore functions touch (and vgpu only initialises). Nothing in the file
//! is a pointer or state the kernel or libc interprets: the region's lock is a kernel-held file lock
//! ([`FILE_LOCK_OFFSET`]), and [`LockWords`] only carries hints about it.

use std::cell::UnsafeCell;
use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU8, AtomicU32, AtomicU64};

/// Devices the region has room for (HAMi-core's `CUDA_DEVICE_MAX_COUNT`).
pub const MAX_DEVICES: usize = 16;
/// Process slots (HAMi-core's `SHARED_REGION_MAX_PROCESS_NUM`).
pub const MAX_SLOTS: usize = 1024;
/// Bytes of one device UUID string, NUL included (`NVML_DEVICE_UUID_V2_BUFFER_SIZE`).
pub const UUID_BYTES: usize = 96;

/// HAMi-core's `initialized_flag` once a region is fully initialised.
pub const HAMI_INITIALIZED_FLAG: i32 = 19_920_718;
/// HAMi-core's layout version this crate writes and accepts.
pub const HAMI_MAJOR_VERSION: u32 = 1;
/// See [`HAMI_MAJOR_VERSION`].
pub const HAMI_MINOR_VERSION: u32 = 2;
/// `sizeof(shared_region_t)` on x86_64; HAMi's monitor checks it.
pub const HAMI_REGION_SIZE: usize = 2_008_952;

/// `status` of a free process slot. HAMi's monitor skips slots with this status.
pub const SLOT_FREE: i32 = 0;
/// `status` of a slot that belongs to a live (or not yet reaped) process.
pub const SLOT_LIVE: i32 = 1;
/// [`SlotExtension::flags`] bit: the process's device memory is checkpointed off the device.
pub const SLOT_RELEASED: u32 = 1;
/// [`SlotExtension::flags`] bit: the process asked for its own release after `CUDA_IDLE_RELEASE`
/// without a launch; it asks for the restore when it needs the GPU.
pub const SLOT_IDLE_RELEASE: u32 = 2;
/// [`SlotExtension::flags`] bit: the process asked for its own release while HAMi's monitor blocked
/// the container by priority (`CUDA_PRIORITY_RELEASE`); it asks for the restore once unblocked.
pub const SLOT_PRIORITY_RELEASE: u32 = 4;

/// HAMi-core's `recent_kernel` of an active container: written at creation and at each limited
/// launch; HAMi's monitor counts it down to tell active containers from idle ones.
pub const RECENT_KERNEL_ACTIVE: i32 = 2;
/// [`ComputeDevice::flags`] bit: a burst is open.
pub const DEVICE_BURST_OPEN: u32 = 1;

/// The extension's magic: the ASCII bytes `VGPUEXT1` as they lie in the file.
pub const EXTENSION_MAGIC: u64 = u64::from_le_bytes(*b"VGPUEXT1");
/// Layout version of [`Extension`]; a change of meaning of any existing byte increments it.
/// Version 2: the lock is a file lock and [`Extension::lock`] holds [`LockWords`] (version 1 had a
/// pthread mutex there, which version-2 processes would not exclude).
pub const EXTENSION_VERSION: u32 = 2;
/// Bytes of the extension: a 64 KiB part (header, slots, compute, reserved) and the host-backed
/// table after it.
pub const EXTENSION_SIZE: usize = HOST_BACKED_OFFSET + MAX_SLOTS * MAX_DEVICES * 8;
/// Where the extension starts: right after HAMi-core's struct.
pub const EXTENSION_OFFSET: usize = HAMI_REGION_SIZE;
/// Size of a valid region file.
pub const REGION_FILE_SIZE: usize = HAMI_REGION_SIZE + EXTENSION_SIZE;

/// Bytes of a glibc `sem_t` on 64-bit Linux.
pub const SEMAPHORE_BYTES: usize = 32;

/// Memory owned by C functions (`sem_init`) that synchronise it themselves. Rust code never reads
/// or writes the bytes; it only hands out a pointer.
#[repr(C, align(8))]
pub struct OpaqueStorage<const N: usize>(UnsafeCell<[u8; N]>);

// SAFETY: the bytes are only accessed through semaphore functions, which are designed for
// concurrent use from many threads and processes.
unsafe impl<const N: usize> Sync for OpaqueStorage<N> {}

impl<const N: usize> OpaqueStorage<N> {
    /// The storage as the C type a libc function expects.
    pub(crate) fn as_mut_ptr<T>(&self) -> *mut T {
        self.0.get().cast()
    }
}

/// HAMi-core's `device_memory_t`: what one process holds on one device, by kind.
#[repr(C)]
pub struct DeviceMemory {
    /// Bytes of CUDA contexts.
    pub context_size: AtomicU64,
    /// Bytes of loaded modules.
    pub module_size: AtomicU64,
    /// Bytes of data allocations (HAMi's monitor calls it the buffer size).
    pub data_size: AtomicU64,
    /// Unused by HAMi-core and by vgpu; always 0.
    pub offset: AtomicU64,
    /// `context_size + module_size + data_size`.
    pub total: AtomicU64,
    /// Unused; always 0.
    pub unused: [AtomicU64; 3],
}

/// HAMi-core's `device_util_t`: one process's utilisation of one device, in percent.
#[repr(C)]
pub struct DeviceUtil {
    /// Decoder utilisation.
    pub dec_util: AtomicU64,
    /// Encoder utilisation.
    pub enc_util: AtomicU64,
    /// SM utilisation, read by HAMi's monitor.
    pub sm_util: AtomicU64,
    /// Unused; always 0.
    pub unused: [AtomicU64; 3],
}

/// HAMi-core's `shrreg_proc_slot_t`: one process attached to the region.
#[repr(C)]
pub struct ProcSlot {
    /// Process id in the pid namespace of the processes sharing the region.
    pub pid: AtomicI32,
    /// Process id on the host, written by HAMi's monitor when it can find it; 0 otherwise.
    pub hostpid: AtomicI32,
    /// Memory held, per region device index.
    pub used: [DeviceMemory; MAX_DEVICES],
    /// Memory the device reports for this process (NVML), per device; not maintained by this crate.
    pub monitorused: [AtomicU64; MAX_DEVICES],
    /// Utilisation per device; not maintained by this crate.
    pub device_util: [DeviceUtil; MAX_DEVICES],
    /// [`SLOT_FREE`] or [`SLOT_LIVE`].
    pub status: AtomicI32,
    /// The C compiler's padding before the 8-byte `seqlock`.
    pub status_padding: AtomicU32,
    /// Odd while a writer updates `used`, even otherwise (HAMi-core's name and protocol).
    pub seqlock: AtomicU64,
    /// Unused; always 0.
    pub unused: [AtomicU64; 2],
}

/// HAMi-core's `shared_region_t`, version 1.2.
#[repr(C)]
pub struct SharedRegion {
    /// [`HAMI_INITIALIZED_FLAG`] once initialised; written last by the creator.
    pub initialized_flag: AtomicI32,
    /// [`HAMI_MAJOR_VERSION`].
    pub major_version: AtomicU32,
    /// [`HAMI_MINOR_VERSION`].
    pub minor_version: AtomicU32,
    /// HAMi-core's "SM limits initialised" flag; 0.
    pub sm_init_flag: AtomicI32,
    /// HAMi-core: pid holding `sem`, 0 when free. vgpu never takes `sem`, so it stays 0.
    pub owner_pid: AtomicU64,
    /// HAMi-core's slot semaphore; initialised unlocked, never used by vgpu.
    pub sem: OpaqueStorage<SEMAPHORE_BYTES>,
    /// Number of entries of `uuids` in use.
    pub device_num: AtomicU64,
    /// NUL-terminated device UUIDs (`GPU-...`), by region device index.
    pub uuids: [[AtomicU8; UUID_BYTES]; MAX_DEVICES],
    /// Memory limit in bytes per region device index, 0 = none (HAMi's monitor may rewrite it).
    pub limit: [AtomicU64; MAX_DEVICES],
    /// Compute limit in percent per region device index, 0 = none.
    pub sm_limit: [AtomicU64; MAX_DEVICES],
    /// The process slots.
    pub procs: [ProcSlot; MAX_SLOTS],
    /// One more than the highest slot index in use; HAMi's monitor reads slots `0..proc_num`.
    pub proc_num: AtomicI32,
    /// Written by HAMi's monitor: 1 while the GPU is really shared (the compute limiter applies).
    pub utilization_switch: AtomicI32,
    /// Written by HAMi's monitor (priority scheduling); HAMi-core's creator sets 2.
    pub recent_kernel: AtomicI32,
    /// `CUDA_TASK_PRIORITY` of the creator.
    pub priority: AtomicI32,
    /// Seconds since the epoch of the last kernel launch (HAMi-core's field).
    pub last_kernel_time: AtomicI64,
    /// HAMi-core's `sem_postinit`, inside the former `unused[4]`; initialised, never used by vgpu.
    pub sem_postinit: OpaqueStorage<SEMAPHORE_BYTES>,
}

/// What processes tell each other about the region's lock, in the 64 bytes where extension
/// version 1 kept a pthread mutex. The lock itself is a kernel-held file lock on the byte at
/// [`FILE_LOCK_OFFSET`]; these words are hints that only speed it up or make it fair, and every
/// value a writer can put in them is harmless: at worst a lock waits a bounded time (see
/// `region/src/lock.rs`).
#[repr(C)]
pub struct LockWords {
    /// Nonzero (the holder's random token) from the moment a process has the lock until just
    /// before it releases it. Found nonzero by the next holder: the previous one died inside
    /// (its update may be half done), so the totals are recomputed.
    pub holder: AtomicU64,
    /// The token of the process holding the favour (the file lock on [`FAVOUR_LOCK_OFFSET`]):
    /// it has waited, and goes next. 0 = none; checked against the file lock before anyone
    /// holds back for it.
    pub favoured: AtomicU64,
    /// Futex word waiters sleep on; a release bumps it and wakes one sleeper when `sleepers`
    /// says someone sleeps there (and no waiter is favoured).
    pub wake: AtomicU32,
    /// How many processes sleep (or are about to) on `wake`.
    pub sleepers: AtomicU32,
    /// Futex word the favoured waiter sleeps on; a release bumps it and wakes that waiter while
    /// `favoured` is set.
    pub favoured_wake: AtomicU32,
    /// Bumped at every acquisition (wrapping): a waiter that sees it move knows the lock is
    /// changing hands, not stuck, and waits on (up to `MAX_LOCK_WAIT`). Was reserved (0).
    pub acquisitions: AtomicU32,
    /// Reserved; 0.
    pub reserved: [AtomicU64; 4],
}

/// vgpu's per-slot state, parallel to [`SharedRegion::procs`].
#[repr(C)]
pub struct SlotExtension {
    /// Start time of the slot's process (field 22 of `/proc/<pid>/stat`, clock ticks since boot),
    /// to tell a reused pid from the original process; 0 when it could not be read.
    pub start_time: AtomicU64,
    /// Attach counter value when the slot was claimed; a [`crate::Slot`] is only valid while it
    /// matches.
    pub generation: AtomicU64,
    /// Reserved for suspending a process's launches; 0.
    pub suspend: AtomicU32,
    /// Bit 0 ([`SLOT_RELEASED`]): `vgpu-smi suspend --release` checkpointed the process, its
    /// device memory is in host memory and off the device (its charges stay); bits 1 and 2
    /// ([`SLOT_IDLE_RELEASE`], [`SLOT_PRIORITY_RELEASE`]): why the process asked for it itself;
    /// other bits reserved, 0.
    pub flags: AtomicU32,
    /// Per region device index: this process's data allocations and frees under way (at most
    /// 255 counted). In the slot, so that the marks of a process that dies in the middle of a
    /// call go with it: a context measurement ignores the marks of dead processes' slots, and
    /// reaping or claiming a slot clears them.
    pub memory_in_flight: [AtomicU8; MAX_DEVICES],
    /// Reserved; 0.
    pub reserved: [AtomicU64; 1],
}

/// The compute limiter's state for one device, shared by every process of the region: a token
/// bucket of GPU time. Written only with atomic read-modify-write operations, never under the
/// lock, so a launch never waits for the region's mutex.
#[repr(C)]
pub struct ComputeDevice {
    /// GPU time (ns) the device's launches may still take; negative while in debt. Refilled at the
    /// limit's share of wall time, up to a bounded burst.
    pub budget_ns: AtomicI64,
    /// `CLOCK_MONOTONIC` ns up to which the bucket has been refilled; 0 = never used (the first
    /// user fills the bucket).
    pub refilled_ns: AtomicU64,
    /// Charged time: GPU time (ns) charged to the device by every process, estimates at launch
    /// plus the corrections measurements brought; mostly grows, and a correction down lowers it.
    /// (Formerly `busy_ns`; the bytes are the same.)
    pub charged_ns: AtomicU64,
    /// Held time: wall time (ns) launches spent waiting for budget or for `recent_kernel`, summed
    /// over processes and threads; only grows. (Formerly `wait_ns`.)
    pub held_ns: AtomicU64,
    /// Launches that went through the limiter.
    pub launches: AtomicU64,
    /// Limit in percent of the process that refilled the bucket last.
    pub limit_percent: AtomicU32,
    /// [`DEVICE_BURST_OPEN`]: a burst is open (the bucket admits launches down to a bounded debt,
    /// so that the container's streams run together as they do unlimited); other bits reserved, 0.
    pub flags: AtomicU32,
    /// Reserved; 0.
    pub reserved: [AtomicU64; 2],
}

/// The byte of the file every process locks with an open-file-description lock (`F_OFD_SETLK`,
/// write lock, length 1) while it changes slots, totals or devices: the first byte of
/// [`Extension::lock`]. The kernel releases it when the holder's description closes (its death).
pub const FILE_LOCK_OFFSET: u64 = (EXTENSION_OFFSET + offset_of!(Extension, lock)) as u64;

/// The byte whose file lock is the *favour*: the process holding it, one that has waited for the
/// lock, goes next (see `region/src/lock.rs`).
pub const FAVOUR_LOCK_OFFSET: u64 = FILE_LOCK_OFFSET + 1;

/// Slot extensions start here, relative to the extension.
pub const SLOT_EXTENSIONS_OFFSET: usize = 1024;
/// The compute limiter's per-device state starts here, relative to the extension.
pub const COMPUTE_OFFSET: usize = SLOT_EXTENSIONS_OFFSET + MAX_SLOTS * 48;
/// The host-backed table ([`Extension::host_backed`]) starts here, relative to the extension.
pub const HOST_BACKED_OFFSET: usize = 65_536;
const RESERVED_TAIL_WORDS: usize = (HOST_BACKED_OFFSET - COMPUTE_OFFSET - MAX_DEVICES * 64) / 8;

/// vgpu's extension, after HAMi-core's struct in the same file.
#[repr(C)]
pub struct Extension {
    /// [`EXTENSION_MAGIC`].
    pub magic: AtomicU64,
    /// [`EXTENSION_VERSION`].
    pub version: AtomicU32,
    /// [`EXTENSION_SIZE`], so a reader can tell the geometry without knowing the version.
    pub extension_size: AtomicU32,
    /// [`HAMI_REGION_SIZE`]: where this extension starts in the file.
    pub hami_region_size: AtomicU64,
    /// Pid of the process that initialised the file.
    pub creator_pid: AtomicI32,
    /// Reserved; 0.
    pub header_reserved: AtomicU32,
    /// Hints about the region's lock (a file lock on [`FILE_LOCK_OFFSET`], which serialises
    /// every change of slots, totals and devices).
    pub lock: LockWords,
    /// Running total of `used[d].total` over live slots, per region device index.
    pub device_used: [AtomicU64; MAX_DEVICES],
    /// `CLOCK_MONOTONIC` nanoseconds of the last reap of dead slots.
    pub last_reap_ns: AtomicU64,
    /// Next attach generation; starts at 1.
    pub next_generation: AtomicU64,
    /// Seconds since the epoch when the file was initialised.
    pub created_unix_secs: AtomicU64,
    /// Per region device index: data allocations and frees begun, by every process (wrapping).
    /// A context measurement reads NVML only while no slot has a call under way
    /// ([`SlotExtension::memory_in_flight`]) and this count does not move.
    pub memory_calls_begun: [AtomicU64; MAX_DEVICES],
    /// Pid of a process reading a consistent (NVML, region) pair; new data calls wait for it a
    /// little (bounded), so that one comes soon.
    pub memory_quiesce: AtomicU64,
    /// Per region device index: bytes the last context measured on the device took (0: none
    /// measured yet). A context creation reserves this much against the limit before the
    /// driver is called, and is corrected to what it measured after.
    pub context_bytes: [AtomicU64; MAX_DEVICES],
    /// Pid of the process measuring the region's first context on a device whose
    /// `context_bytes` is 0; other creations wait for its figure (bounded) rather than pass the
    /// limit unreserved together.
    pub context_measurer: AtomicU64,
    /// Reserved for later header fields; 0.
    pub reserved_header: [AtomicU64; 63],
    /// Per-slot state, parallel to `procs`.
    pub slots: [SlotExtension; MAX_SLOTS],
    /// The compute limiter's token bucket per region device index.
    pub compute: [ComputeDevice; MAX_DEVICES],
    /// Reserved for later fields; 0.
    pub reserved: [AtomicU64; RESERVED_TAIL_WORDS],
    /// Per slot, parallel to `procs`, and per region device index: bytes of the slot's charged
    /// data that host memory backs because the device could not (`CUDA_OVERSUBSCRIBE`). Part of
    /// `used[d].data_size`, not in addition to it; written by the slot's owner only, and cleared
    /// when the slot is claimed or reaped.
    pub host_backed: [[AtomicU64; MAX_DEVICES]; MAX_SLOTS],
}

/// The whole file.
#[repr(C)]
pub struct RegionFile {
    /// HAMi-core's struct, at offset 0.
    pub hami: SharedRegion,
    /// vgpu's extension, at [`EXTENSION_OFFSET`].
    pub ext: Extension,
}

// HAMi-core's ABI, x86_64 (reference/hami-core-facts.md). A change here breaks HAMi's monitor.
const _: () = assert!(size_of::<DeviceMemory>() == 64);
const _: () = assert!(size_of::<DeviceUtil>() == 48);
const _: () = assert!(size_of::<ProcSlot>() == 1960);
const _: () = assert!(offset_of!(ProcSlot, hostpid) == 4);
const _: () = assert!(offset_of!(ProcSlot, used) == 8);
const _: () = assert!(offset_of!(ProcSlot, monitorused) == 1032);
const _: () = assert!(offset_of!(ProcSlot, device_util) == 1160);
const _: () = assert!(offset_of!(ProcSlot, status) == 1928);
const _: () = assert!(offset_of!(ProcSlot, seqlock) == 1936);
const _: () = assert!(offset_of!(SharedRegion, major_version) == 4);
const _: () = assert!(offset_of!(SharedRegion, minor_version) == 8);
const _: () = assert!(offset_of!(SharedRegion, sm_init_flag) == 12);
const _: () = assert!(offset_of!(SharedRegion, owner_pid) == 16);
const _: () = assert!(offset_of!(SharedRegion, sem) == 24);
const _: () = assert!(offset_of!(SharedRegion, device_num) == 56);
const _: () = assert!(offset_of!(SharedRegion, uuids) == 64);
const _: () = assert!(offset_of!(SharedRegion, limit) == 1600);
const _: () = assert!(offset_of!(SharedRegion, sm_limit) == 1728);
const _: () = assert!(offset_of!(SharedRegion, procs) == 1856);
const _: () = assert!(offset_of!(SharedRegion, proc_num) == 2_008_896);
const _: () = assert!(offset_of!(SharedRegion, utilization_switch) == 2_008_900);
const _: () = assert!(offset_of!(SharedRegion, recent_kernel) == 2_008_904);
const _: () = assert!(offset_of!(SharedRegion, priority) == 2_008_908);
const _: () = assert!(offset_of!(SharedRegion, last_kernel_time) == 2_008_912);
const _: () = assert!(offset_of!(SharedRegion, sem_postinit) == 2_008_920);
const _: () = assert!(size_of::<SharedRegion>() == HAMI_REGION_SIZE);
const _: () = assert!(align_of::<SharedRegion>() == 8);

// vgpu's extension.
const _: () = assert!(size_of::<SlotExtension>() == 48);
const _: () = assert!(size_of::<LockWords>() == 64);
const _: () = assert!(offset_of!(Extension, lock) == 32);
const _: () = assert!(offset_of!(Extension, device_used) == 96);
const _: () = assert!(offset_of!(Extension, slots) == SLOT_EXTENSIONS_OFFSET);
const _: () = assert!(size_of::<ComputeDevice>() == 64);
const _: () = assert!(offset_of!(Extension, compute) == COMPUTE_OFFSET);
const _: () = assert!(offset_of!(Extension, host_backed) == HOST_BACKED_OFFSET);
const _: () = assert!(size_of::<Extension>() == EXTENSION_SIZE);
const _: () = assert!(offset_of!(RegionFile, ext) == EXTENSION_OFFSET);
const _: () = assert!(size_of::<RegionFile>() == REGION_FILE_SIZE);

// The C objects must fit the storage reserved for them.
const _: () = assert!(size_of::<libc::sem_t>() == SEMAPHORE_BYTES);
const _: () = assert!(align_of::<libc::sem_t>() <= 8);

/// The size of a field, from a projection closure (`offset_of!` has no size counterpart).
fn field_size<S, F>(_project: fn(&S) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! fields {
    ($ty:ty => $($field:ident),+ $(,)?) => {
        vec![$((stringify!($field), offset_of!($ty, $field), field_size(|s: &$ty| &s.$field))),+]
    };
}

/// One struct of the listing: its name, where it lies, and its fields as (name, offset, size).
struct StructListing {
    name: &'static str,
    placement: &'static str,
    size: usize,
    fields: Vec<(&'static str, usize, usize)>,
}

/// Every field of every struct of the file with its offset and size, one per line; gaps and
/// overlaps are spelled out. The layout snapshot test records this text, so any change to the
/// file format shows up as a reviewed diff.
pub fn layout_listing() -> String {
    let structs = [
        StructListing {
            name: "SharedRegion",
            placement: "HAMi-core shared_region_t v1.2, file offset 0",
            size: size_of::<SharedRegion>(),
            fields: fields!(SharedRegion => initialized_flag, major_version, minor_version, sm_init_flag, owner_pid,
                sem, device_num, uuids, limit, sm_limit, procs, proc_num, utilization_switch, recent_kernel,
                priority, last_kernel_time, sem_postinit),
        },
        StructListing {
            name: "ProcSlot",
            placement: "HAMi-core shrreg_proc_slot_t, SharedRegion.procs[i] at 1856 + 1960 * i",
            size: size_of::<ProcSlot>(),
            fields: fields!(ProcSlot => pid, hostpid, used, monitorused, device_util, status, status_padding,
                seqlock, unused),
        },
        StructListing {
            name: "DeviceMemory",
            placement: "HAMi-core device_memory_t, ProcSlot.used[d] at 8 + 64 * d",
            size: size_of::<DeviceMemory>(),
            fields: fields!(DeviceMemory => context_size, module_size, data_size, offset, total, unused),
        },
        StructListing {
            name: "DeviceUtil",
            placement: "HAMi-core device_util_t, ProcSlot.device_util[d] at 1160 + 48 * d",
            size: size_of::<DeviceUtil>(),
            fields: fields!(DeviceUtil => dec_util, enc_util, sm_util, unused),
        },
        StructListing {
            name: "Extension",
            placement: "vgpu extension, file offset 2008952",
            size: size_of::<Extension>(),
            fields: fields!(Extension => magic, version, extension_size, hami_region_size, creator_pid,
                header_reserved, lock, device_used, last_reap_ns, next_generation, created_unix_secs,
                memory_calls_begun, memory_quiesce, context_bytes, context_measurer, reserved_header, slots, compute, reserved,
                host_backed),
        },
        StructListing {
            name: "LockWords",
            placement: "vgpu lock hints, Extension.lock at 32",
            size: size_of::<LockWords>(),
            fields: fields!(LockWords => holder, favoured, wake, sleepers, favoured_wake, acquisitions, reserved),
        },
        StructListing {
            name: "SlotExtension",
            placement: "vgpu per-slot state, Extension.slots[i] at 1024 + 48 * i",
            size: size_of::<SlotExtension>(),
            fields: fields!(SlotExtension => start_time, generation, suspend, flags, memory_in_flight, reserved),
        },
        StructListing {
            name: "ComputeDevice",
            placement: "vgpu compute limiter per device, Extension.compute[d] at 50176 + 64 * d",
            size: size_of::<ComputeDevice>(),
            fields: fields!(ComputeDevice => budget_ns, refilled_ns, charged_ns, held_ns, launches, limit_percent,
                flags, reserved),
        },
    ];
    let mut text =
        format!("region file: {REGION_FILE_SIZE} bytes (HAMi-core {HAMI_REGION_SIZE} + vgpu {EXTENSION_SIZE})\n");
    for listing in &structs {
        let _ = writeln!(
            text,
            "\n{} ({}), {} bytes",
            listing.name, listing.placement, listing.size
        );
        let _ = writeln!(text, "{:>8} {:>8}  field", "offset", "size");
        let mut next = 0;
        for &(field, offset, size) in &listing.fields {
            if offset != next {
                let _ = writeln!(text, "{next:>8} {:>8}  (gap or overlap!)", offset.wrapping_sub(next));
            }
            let _ = writeln!(text, "{offset:>8} {size:>8}  {field}");
            next = offset + size;
        }
        if next != listing.size {
            let _ = writeln!(
                text,
                "{next:>8} {:>8}  (trailing padding!)",
                listing.size.wrapping_sub(next)
            );
        }
    }
    text
}
