//! Reading a region without locking it: for monitors (`vgpu-smi`), for diagnostics, and for the
//! validity checks at open.
//!
//! Slots are read under their seqlock: a reader retries while a writer is mid-update (odd, or
//! changed during the read), but a bounded number of times only, because a writer killed mid-update
//! leaves the seqlock odd for good; such a slot is reported with `consistent: false`.

use std::sync::atomic::Ordering;

use crate::error::LayoutError;
use crate::layout::{
    EXTENSION_MAGIC, EXTENSION_OFFSET, EXTENSION_SIZE, EXTENSION_VERSION, HAMI_INITIALIZED_FLAG, HAMI_MAJOR_VERSION,
    HAMI_MINOR_VERSION, HAMI_REGION_SIZE, MAX_DEVICES, MAX_SLOTS, ProcSlot, REGION_FILE_SIZE, RegionFile, SLOT_FREE,
    SLOT_LIVE, UUID_BYTES,
};

pub use crate::image::SEQLOCK_READ_ATTEMPTS;

/// One process's memory on one device, by kind (HAMi-core's `device_memory_t` without the unused
/// fields).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// `context_size`.
    pub context: u64,
    /// `module_size`.
    pub module: u64,
    /// `data_size`.
    pub data: u64,
    /// `total`.
    pub total: u64,
}

/// A process slot with a non-zero status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessSnapshot {
    /// Slot index.
    pub slot: usize,
    /// `pid`.
    pub pid: i32,
    /// `hostpid`.
    pub hostpid: i32,
    /// `status` ([`SLOT_LIVE`] for vgpu's processes).
    pub status: i32,
    /// False when the seqlock never settled: the memory figures may be torn.
    pub consistent: bool,
    /// `used`, per region device index.
    pub memory: [MemoryUsage; MAX_DEVICES],
    /// `monitorused`, per region device index.
    pub monitor_used: [u64; MAX_DEVICES],
    /// `device_util[d].sm_util`, per region device index.
    pub sm_util: [u64; MAX_DEVICES],
    /// The extension's recorded start time, when the image has a valid extension.
    pub start_time: Option<u64>,
    /// The extension's attach generation, when the image has a valid extension.
    pub generation: Option<u64>,
    /// Per region device index, the bytes of `memory[d].data` that host memory backs
    /// (`CUDA_OVERSUBSCRIBE`), at most `data`; 0 without a valid extension.
    pub host_backed: [u64; MAX_DEVICES],
}

/// The extension's header, when the image has a valid one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExtensionSnapshot {
    /// [`EXTENSION_VERSION`].
    pub version: u32,
    /// Pid of the process that initialised the file.
    pub creator_pid: i32,
    /// Seconds since the epoch when the file was initialised.
    pub created_unix_secs: u64,
    /// Running total per region device index.
    pub device_used: [u64; MAX_DEVICES],
    /// The compute limiter's counters per region device index.
    pub compute: [ComputeCounters; MAX_DEVICES],
}

/// The compute limiter's counters for one device, summed over the region's processes: held time
/// and launches only grow; charged time mostly grows (a correction down lowers it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ComputeCounters {
    /// GPU time (ns) charged to the device's launches.
    pub charged_ns: u64,
    /// Wall time (ns) launches spent held by the limiter.
    pub held_ns: u64,
    /// Launches that went through the limiter.
    pub launches: u64,
}

/// A decoded region: everything HAMi's monitor reads, plus vgpu's extension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// `major_version`.
    pub major_version: u32,
    /// `minor_version`.
    pub minor_version: u32,
    /// `owner_pid`.
    pub owner_pid: u64,
    /// `uuids[0..device_num]`, up to the first NUL, invalid UTF-8 replaced.
    pub uuids: Vec<String>,
    /// `limit` in bytes, per region device index (0 = none).
    pub limits: [u64; MAX_DEVICES],
    /// `sm_limit` in percent, per region device index (0 = none).
    pub sm_limits: [u64; MAX_DEVICES],
    /// `proc_num`.
    pub proc_num: usize,
    /// `utilization_switch`.
    pub utilization_switch: i32,
    /// `recent_kernel`.
    pub recent_kernel: i32,
    /// `priority`.
    pub priority: i32,
    /// `last_kernel_time`.
    pub last_kernel_time: i64,
    /// Slots `0..proc_num` whose status is not [`SLOT_FREE`], in slot order.
    pub processes: Vec<ProcessSnapshot>,
    /// vgpu's extension; `None` for a HAMi-core file or an image without a valid one.
    pub extension: Option<ExtensionSnapshot>,
}

impl Snapshot {
    /// Bytes used on a region device: the extension's running total, or else the sum over live
    /// slots (as HAMi's monitor computes it).
    pub fn device_used(&self, device: usize) -> u64 {
        match &self.extension {
            Some(extension) => extension.device_used.get(device).copied().unwrap_or(0),
            None => self.slots_sum(device),
        }
    }

    /// Sum of `total` over live slots for a device, saturating.
    pub fn slots_sum(&self, device: usize) -> u64 {
        self.processes
            .iter()
            .filter(|process| process.status == SLOT_LIVE)
            .filter_map(|process| process.memory.get(device))
            .fold(0u64, |sum, usage| sum.saturating_add(usage.total))
    }
}

/// Decodes a region image (the bytes of a region file, or of HAMi-core's struct alone). Pure: no
/// I/O, no locks, bounded work, never panics on any input.
///
/// A slot whose seqlock is odd in the image is reported with `consistent: false`. Bytes past the
/// extension are ignored; an image too short for the extension, or with an invalid one, decodes
/// with `extension: None`.
pub fn read_snapshot(bytes: &[u8]) -> Result<Snapshot, LayoutError> {
    if bytes.len() < HAMI_REGION_SIZE {
        return Err(LayoutError::TooShort {
            len: bytes.len() as u64,
            needed: HAMI_REGION_SIZE as u64,
        });
    }
    let image = ImageCopy::new(bytes);
    let file = image.file();
    check_hami_header(file)?;
    let extension_valid = bytes.len() >= REGION_FILE_SIZE && check_extension_header(file).is_ok();
    Ok(decode(file, extension_valid))
}

/// Decodes a consistent copy of this process's own, validated region
/// ([`crate::image::consistent_copy`]): the extension is taken as valid, as it was at open.
pub(crate) fn decode_image(bytes: &[u8]) -> Snapshot {
    decode(ImageCopy::new(bytes).file(), true)
}

/// A zeroed, properly aligned [`RegionFile`] holding a copy of an image's bytes.
struct ImageCopy {
    file: Box<RegionFile>,
}

impl ImageCopy {
    fn new(bytes: &[u8]) -> Self {
        let mut file = zeroed_region_file();
        let len = bytes.len().min(REGION_FILE_SIZE);
        let destination: *mut u8 = std::ptr::from_mut::<RegionFile>(&mut file).cast();
        // SAFETY: `destination` points to a RegionFile of REGION_FILE_SIZE bytes that we own
        // exclusively, `len` is at most that and at most the source's length, the two do not
        // overlap, and every byte pattern is valid for its fields (integers and opaque bytes).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), destination, len) };
        Self { file }
    }

    fn file(&self) -> &RegionFile {
        &self.file
    }
}

/// A heap-allocated, all-zero [`RegionFile`] (2 MB: too large for the stack).
pub(crate) fn zeroed_region_file() -> Box<RegionFile> {
    let layout = std::alloc::Layout::new::<RegionFile>();
    // SAFETY: the layout has a non-zero size; all-zero bytes are a valid RegionFile (integers and
    // opaque byte storage only); the pointer comes from the global allocator with RegionFile's
    // layout, as Box::from_raw requires. Allocation failure aborts, as Box::new would.
    unsafe {
        let pointer = std::alloc::alloc_zeroed(layout).cast::<RegionFile>();
        if pointer.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Box::from_raw(pointer)
    }
}

/// Checks the HAMi-core part's magic, version and counts.
pub(crate) fn check_hami_header(file: &RegionFile) -> Result<(), LayoutError> {
    let hami = &file.hami;
    let flag = hami.initialized_flag.load(Ordering::Acquire);
    if flag != HAMI_INITIALIZED_FLAG {
        return Err(LayoutError::NotInitialised { flag });
    }
    let (major, minor) = (
        hami.major_version.load(Ordering::Relaxed),
        hami.minor_version.load(Ordering::Relaxed),
    );
    if (major, minor) != (HAMI_MAJOR_VERSION, HAMI_MINOR_VERSION) {
        return Err(LayoutError::WrongVersion { major, minor });
    }
    let device_num = hami.device_num.load(Ordering::Relaxed);
    if device_num > MAX_DEVICES as u64 {
        return Err(LayoutError::TooManyDevices { device_num });
    }
    let proc_num = hami.proc_num.load(Ordering::Relaxed);
    if !(0..=MAX_SLOTS as i32).contains(&proc_num) {
        return Err(LayoutError::BadProcNum { proc_num });
    }
    Ok(())
}

/// Checks the extension's magic, version and geometry.
pub(crate) fn check_extension_header(file: &RegionFile) -> Result<(), LayoutError> {
    let ext = &file.ext;
    let magic = ext.magic.load(Ordering::Relaxed);
    if magic != EXTENSION_MAGIC {
        return Err(LayoutError::BadExtensionMagic { magic });
    }
    let version = ext.version.load(Ordering::Relaxed);
    if version != EXTENSION_VERSION {
        return Err(LayoutError::WrongExtensionVersion { version });
    }
    let extension_size = ext.extension_size.load(Ordering::Relaxed);
    let hami_region_size = ext.hami_region_size.load(Ordering::Relaxed);
    if extension_size as usize != EXTENSION_SIZE || hami_region_size != EXTENSION_OFFSET as u64 {
        return Err(LayoutError::WrongExtensionGeometry {
            extension_size,
            hami_region_size,
        });
    }
    Ok(())
}

/// Checks that slot totals and running totals agree and that no live slot hides beyond
/// `proc_num`. Meaningful only while nobody writes (under the region's lock, or with the file held
/// exclusively).
pub(crate) fn check_totals(file: &RegionFile) -> Result<(), LayoutError> {
    let proc_num = file.hami.proc_num.load(Ordering::Relaxed);
    let mut sums = [Some(0u64); MAX_DEVICES];
    for (index, slot) in file.hami.procs.iter().enumerate() {
        if slot.status.load(Ordering::Relaxed) != SLOT_LIVE {
            continue;
        }
        if index as i64 >= i64::from(proc_num) {
            return Err(LayoutError::LiveSlotBeyondProcNum { slot: index, proc_num });
        }
        for (device, (usage, sum)) in slot.used.iter().zip(sums.iter_mut()).enumerate() {
            let parts = usage
                .context_size
                .load(Ordering::Relaxed)
                .checked_add(usage.module_size.load(Ordering::Relaxed))
                .and_then(|partial| partial.checked_add(usage.data_size.load(Ordering::Relaxed)));
            let total = usage.total.load(Ordering::Relaxed);
            if parts != Some(total) {
                return Err(LayoutError::SlotTotalMismatch { slot: index, device });
            }
            *sum = sum.and_then(|sum| sum.checked_add(total));
        }
    }
    for (device, (sum, recorded)) in sums.iter().zip(file.ext.device_used.iter()).enumerate() {
        let recorded = recorded.load(Ordering::Relaxed);
        if *sum != Some(recorded) {
            return Err(LayoutError::TotalMismatch {
                device,
                recorded,
                slots_sum: *sum,
            });
        }
    }
    Ok(())
}

/// Decodes an image whose HAMi header passed [`check_hami_header`] (counts are clamped anyway, so
/// a scribbled count cannot make this index out of bounds). A slot's seqlock odd in the image is
/// a torn slot: the copy ([`crate::image::consistent_copy`]) left it so.
fn decode(file: &RegionFile, extension_valid: bool) -> Snapshot {
    let hami = &file.hami;
    let device_num = usize::try_from(hami.device_num.load(Ordering::Acquire))
        .unwrap_or(0)
        .min(MAX_DEVICES);
    let proc_num = usize::try_from(hami.proc_num.load(Ordering::Acquire))
        .unwrap_or(0)
        .min(MAX_SLOTS);
    let uuids = hami.uuids.iter().take(device_num).map(read_uuid).collect();
    let mut processes = Vec::new();
    for (index, slot) in hami.procs.iter().enumerate().take(proc_num) {
        let status = slot.status.load(Ordering::Acquire);
        if status == SLOT_FREE {
            continue;
        }
        let (memory, consistent) = read_slot_memory(slot);
        let slot_extension = extension_valid.then(|| file.ext.slots.get(index)).flatten();
        processes.push(ProcessSnapshot {
            slot: index,
            pid: slot.pid.load(Ordering::Relaxed),
            hostpid: slot.hostpid.load(Ordering::Relaxed),
            status,
            consistent,
            memory,
            monitor_used: std::array::from_fn(|device| slot.monitorused[device].load(Ordering::Relaxed)),
            sm_util: std::array::from_fn(|device| slot.device_util[device].sm_util.load(Ordering::Relaxed)),
            start_time: slot_extension.map(|ext| ext.start_time.load(Ordering::Relaxed)),
            generation: slot_extension.map(|ext| ext.generation.load(Ordering::Relaxed)),
            host_backed: std::array::from_fn(|device| {
                let recorded = extension_valid
                    .then(|| {
                        file.ext
                            .host_backed
                            .get(index)
                            .map(|row| row[device].load(Ordering::Relaxed))
                    })
                    .flatten()
                    .unwrap_or(0);
                // A figure above the data it is part of is a scribble: never shown larger.
                recorded.min(memory[device].data)
            }),
        });
    }
    let extension = extension_valid.then(|| ExtensionSnapshot {
        version: file.ext.version.load(Ordering::Relaxed),
        creator_pid: file.ext.creator_pid.load(Ordering::Relaxed),
        created_unix_secs: file.ext.created_unix_secs.load(Ordering::Relaxed),
        device_used: std::array::from_fn(|device| file.ext.device_used[device].load(Ordering::Acquire)),
        compute: std::array::from_fn(|device| {
            let compute = &file.ext.compute[device];
            ComputeCounters {
                charged_ns: compute.charged_ns.load(Ordering::Relaxed),
                held_ns: compute.held_ns.load(Ordering::Relaxed),
                launches: compute.launches.load(Ordering::Relaxed),
            }
        }),
    });
    Snapshot {
        major_version: hami.major_version.load(Ordering::Relaxed),
        minor_version: hami.minor_version.load(Ordering::Relaxed),
        owner_pid: hami.owner_pid.load(Ordering::Relaxed),
        uuids,
        limits: std::array::from_fn(|device| hami.limit[device].load(Ordering::Relaxed)),
        sm_limits: std::array::from_fn(|device| hami.sm_limit[device].load(Ordering::Relaxed)),
        proc_num,
        utilization_switch: hami.utilization_switch.load(Ordering::Relaxed),
        recent_kernel: hami.recent_kernel.load(Ordering::Relaxed),
        priority: hami.priority.load(Ordering::Relaxed),
        last_kernel_time: hami.last_kernel_time.load(Ordering::Relaxed),
        processes,
        extension,
    }
}

/// The UUID string of one `uuids` entry: up to the first NUL.
pub(crate) fn read_uuid(bytes: &[std::sync::atomic::AtomicU8; UUID_BYTES]) -> String {
    let raw: Vec<u8> = bytes
        .iter()
        .map(|byte| byte.load(Ordering::Relaxed))
        .take_while(|&byte| byte != 0)
        .collect();
    String::from_utf8_lossy(&raw).into_owned()
}

/// A slot's memory figures in an image, and whether its seqlock says they are consistent.
fn read_slot_memory(slot: &ProcSlot) -> ([MemoryUsage; MAX_DEVICES], bool) {
    let memory = std::array::from_fn(|device| {
        let shared = &slot.used[device];
        MemoryUsage {
            context: shared.context_size.load(Ordering::Relaxed),
            module: shared.module_size.load(Ordering::Relaxed),
            data: shared.data_size.load(Ordering::Relaxed),
            total: shared.total.load(Ordering::Relaxed),
        }
    });
    (memory, slot.seqlock.load(Ordering::Relaxed).is_multiple_of(2))
}
