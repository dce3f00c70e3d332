//! What this process has charged, by the handle the driver gave back, so each free releases
//! exactly what its allocation charged.

use std::collections::HashMap;
use std::sync::Mutex;

use vgpu_region::MemoryKind;

/// One charge in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charge {
    pub region_index: usize,
    pub kind: MemoryKind,
    pub bytes: u64,
}

/// The kinds of handle a charge is recorded under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Device pointers (linear, pitched, managed, stream-ordered allocations).
    Pointer,
    /// `CUmemGenericAllocationHandle` of `cuMemCreate`.
    PhysicalHandle,
    Array,
    MipmappedArray,
    Context,
    Module,
    Library,
    /// Graph memory nodes, by graph: released with the graph.
    Graph,
}

/// The charges of this process. A plain mutex: allocations are not a hot path at this scale, and
/// nothing here blocks while holding it.
#[derive(Default)]
pub struct Ledger {
    charges: Mutex<HashMap<(Family, u64), Vec<Charge>>>,
    /// Primary contexts: retain count and charge, by device ordinal.
    primary: Mutex<HashMap<i32, (u32, Option<Charge>)>>,
}

impl Ledger {
    fn charges(&self) -> std::sync::MutexGuard<'_, HashMap<(Family, u64), Vec<Charge>>> {
        self.charges.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn insert(&self, family: Family, key: u64, charge: Charge) {
        self.charges().entry((family, key)).or_default().push(charge);
    }

    /// Removes and returns everything charged under the key.
    pub fn take(&self, family: Family, key: u64) -> Vec<Charge> {
        self.charges().remove(&(family, key)).unwrap_or_default()
    }

    /// Puts charges back (their free failed).
    pub fn restore(&self, family: Family, key: u64, charges: Vec<Charge>) {
        if !charges.is_empty() {
            self.charges().entry((family, key)).or_default().extend(charges);
        }
    }

    /// Forgets everything (a forked child starts with no allocations of its own).
    pub fn clear(&self) {
        self.charges().clear();
        self.primary
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clear();
    }

    /// Runs `update` on the primary context record of a device.
    pub fn with_primary<R>(&self, ordinal: i32, update: impl FnOnce(&mut (u32, Option<Charge>)) -> R) -> R {
        let mut primary = self.primary.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        update(primary.entry(ordinal).or_insert((0, None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_returns_what_was_inserted_once() {
        let ledger = Ledger::default();
        let charge = Charge {
            region_index: 0,
            kind: MemoryKind::Data,
            bytes: 10,
        };
        ledger.insert(Family::Pointer, 0x1000, charge);
        assert_eq!(ledger.take(Family::PhysicalHandle, 0x1000), vec![]);
        assert_eq!(ledger.take(Family::Pointer, 0x1000), vec![charge]);
        assert_eq!(ledger.take(Family::Pointer, 0x1000), vec![]);
        ledger.restore(Family::Pointer, 0x1000, vec![charge]);
        ledger.clear();
        assert_eq!(ledger.take(Family::Pointer, 0x1000), vec![]);
    }
}
