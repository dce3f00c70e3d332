//! The container's limits, live. Every process of a region enforces the region's `limit[d]` (bytes)
//! and `sm_limit[d]` (percent), HAMi-core's fields, read where they are used: a change written
//! there (by `vgpu-smi set`, or by HAMi's monitor) takes effect at once for memory, and within the
//! tick's period for a process that was not limiting compute (`throttle::activity`). Lowering the
//! memory limit below what is in use refuses new allocations and frees nothing.
//!
//! The environment variables give the limits a region is created with, and re-created with once no
//! process uses it (`Region::open`); a process that joins a region in use follows the region's, and
//! says once (a warning) where its own variables differ, as HAMi-core does.
//!
//! The region is not trusted (`docs/threat-model.md`), so what is read is checked:
//! - `limit[d]`: bytes, 0 = none. Every value is a size, as for `CUDA_DEVICE_MEMORY_LIMIT`.
//! - `sm_limit[d]`: 0 and 100 = none, 1..99 = percent. Any other value is ignored: the process
//!   keeps the limit it had (at start, its variables'), and says so once per value.
//!
//! Every change a process sees is logged as a warning with the old and new values, so a limit is
//! never lifted (or lowered) silently.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use vgpu_region::{MAX_DEVICES, Region};

/// The last `limit[d]` this process saw, per region device index.
static SEEN_MEMORY: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// The last `sm_limit[d]` this process saw, valid or not.
static SEEN_SM: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
/// The compute limit in force: 0 none, 1..99 percent.
static SM_IN_FORCE: [AtomicU8; MAX_DEVICES] = [const { AtomicU8::new(0) }; MAX_DEVICES];

/// A compute limit read from the region: `Some(None)` none, `Some(Some(p))` p percent, `None` a
/// value no writer may write (the process keeps the limit it had).
pub fn valid_sm_limit(raw: u64) -> Option<Option<u8>> {
    match raw {
        0 | 100 => Some(None),
        1..=99 => Some(Some(raw as u8)),
        _ => None,
    }
}

/// At attach, for each of the process's devices: what the region holds is what the process will
/// enforce; where its own variables (`memory`, `sm` for CUDA ordinal `ordinal`) say otherwise,
/// one warning says so.
pub fn seed(region: &Region, index: usize, ordinal: usize, memory: Option<u64>, sm: Option<u8>) {
    let hami = region.hami();
    let (Some(limit), Some(sm_limit), Some(seen_memory), Some(seen_sm), Some(in_force)) = (
        hami.limit.get(index),
        hami.sm_limit.get(index),
        SEEN_MEMORY.get(index),
        SEEN_SM.get(index),
        SM_IN_FORCE.get(index),
    ) else {
        return;
    };
    let region_memory = limit.load(Ordering::Relaxed);
    seen_memory.store(region_memory, Ordering::Relaxed);
    if region_memory != memory.unwrap_or(0) {
        tracing::warn!(
            "device {ordinal}: the shared region {} holds a memory limit of {} where this process's variables give {}; \
             the region's applies (it is the container's, set when the region was created or changed since: \
             vgpu-smi set)",
            region.path().display(),
            bytes_text(region_memory),
            bytes_text(memory.unwrap_or(0)),
        );
    }
    let region_sm = sm_limit.load(Ordering::Relaxed);
    seen_sm.store(region_sm, Ordering::Relaxed);
    let enforced = match valid_sm_limit(region_sm) {
        Some(percent) => {
            if percent != sm {
                tracing::warn!(
                    "device {ordinal}: the shared region {} holds a compute limit of {} where this process's variables \
                     give {}; the region's applies",
                    region.path().display(),
                    percent_text(percent),
                    percent_text(sm),
                );
            }
            percent
        }
        None => {
            tracing::warn!(
                "device {ordinal}: the shared region {} holds sm_limit {region_sm}, which is not a percentage (0 to \
                 100): ignored, this process's variables apply ({})",
                region.path().display(),
                percent_text(sm),
            );
            sm
        }
    };
    in_force.store(enforced.unwrap_or(0), Ordering::Relaxed);
}

/// The memory limit of region device `index` now (`None`: no limit).
#[inline]
pub fn memory(region: &Region, index: usize) -> Option<u64> {
    let raw = region.hami().limit.get(index)?.load(Ordering::Relaxed);
    if SEEN_MEMORY.get(index)?.load(Ordering::Relaxed) != raw {
        memory_changed(region, index, raw);
    }
    (raw != 0).then_some(raw)
}

#[cold]
#[inline(never)]
fn memory_changed(region: &Region, index: usize, raw: u64) {
    let Some(seen) = SEEN_MEMORY.get(index) else {
        return;
    };
    let old = seen.swap(raw, Ordering::Relaxed);
    if old != raw {
        tracing::warn!(
            "region device {index}: the memory limit in the shared region {} changed from {} to {}; in force now",
            region.path().display(),
            bytes_text(old),
            bytes_text(raw)
        );
    }
}

/// The compute limit of region device `index` now, in percent (`None`: no limit).
#[inline]
pub fn sm(region: &Region, index: usize) -> Option<u8> {
    let raw = region.hami().sm_limit.get(index)?.load(Ordering::Relaxed);
    if SEEN_SM.get(index)?.load(Ordering::Relaxed) != raw {
        sm_changed(region, index, raw);
    }
    let percent = SM_IN_FORCE.get(index)?.load(Ordering::Relaxed);
    (percent != 0).then_some(percent)
}

#[cold]
#[inline(never)]
fn sm_changed(region: &Region, index: usize, raw: u64) {
    let (Some(seen), Some(in_force)) = (SEEN_SM.get(index), SM_IN_FORCE.get(index)) else {
        return;
    };
    if seen.swap(raw, Ordering::Relaxed) == raw {
        return;
    }
    let path = region.path().display();
    match valid_sm_limit(raw) {
        Some(percent) => {
            let old = in_force.swap(percent.unwrap_or(0), Ordering::Relaxed);
            let old = (old != 0).then_some(old);
            if old != percent {
                tracing::warn!(
                    "region device {index}: the compute limit in the shared region {path} changed from {} to {}; in \
                     force now",
                    percent_text(old),
                    percent_text(percent)
                );
            }
        }
        None => {
            let kept = in_force.load(Ordering::Relaxed);
            tracing::warn!(
                "region device {index}: the shared region {path} holds sm_limit {raw}, which is not a percentage (0 to \
                 100): ignored, the compute limit stays {}",
                percent_text((kept != 0).then_some(kept))
            );
        }
    }
}

fn bytes_text(bytes: u64) -> String {
    if bytes == 0 {
        "none".to_owned()
    } else {
        format!("{bytes} bytes ({} MiB)", bytes >> 20)
    }
}

fn percent_text(percent: Option<u8>) -> String {
    percent.map_or_else(|| "none".to_owned(), |percent| format!("{percent}%"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_limits_from_the_region_are_checked() {
        assert_eq!(valid_sm_limit(0), Some(None));
        assert_eq!(valid_sm_limit(100), Some(None));
        assert_eq!(valid_sm_limit(1), Some(Some(1)));
        assert_eq!(valid_sm_limit(99), Some(Some(99)));
        for garbage in [101, 255, 256, 1 << 32, u64::MAX] {
            assert_eq!(valid_sm_limit(garbage), None, "{garbage}");
        }
    }
}
