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

/// What one handle was charged: almost always one charge, so no allocation for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Charges {
    One(Charge),
    Many(Vec<Charge>),
}

impl Charges {
    fn push(&mut self, charge: Charge) {
        match self {
            // The same device and kind again (a pitch correction, another graph node): one sum.
            Charges::One(existing) if existing.region_index == charge.region_index && existing.kind == charge.kind => {
                existing.bytes = existing.bytes.saturating_add(charge.bytes);
            }
            Charges::One(existing) => *self = Charges::Many(vec![*existing, charge]),
            Charges::Many(list) => list.push(charge),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Charge> {
        match self {
            Charges::One(charge) => std::slice::from_ref(charge).iter(),
            Charges::Many(list) => list.iter(),
        }
    }
}

/// A hasher for driver handles (addresses and handle values, not attacker-chosen strings): one
/// multiply per word instead of SipHash, on the allocation path.
#[derive(Default)]
pub struct HandleHasher(u64);

impl std::hash::Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.write_u64(u64::from(*byte));
        }
    }
    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }
    fn write_isize(&mut self, word: isize) {
        self.write_u64(word as u64);
    }
}

type HandleMap<V> = HashMap<(Family, u64), V, std::hash::BuildHasherDefault<HandleHasher>>;

/// The charges of this process. A plain mutex: nothing here blocks while holding it.
#[derive(Default)]
pub struct Ledger {
    charges: Mutex<HandleMap<Charges>>,
    /// Primary contexts: retain count and charge, by device ordinal.
    primary: Mutex<HashMap<i32, (u32, Option<Charge>)>>,
}

impl Ledger {
    fn charges(&self) -> std::sync::MutexGuard<'_, HandleMap<Charges>> {
        self.charges.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn insert(&self, family: Family, key: u64, charge: Charge) {
        let mut charges = self.charges();
        match charges.get_mut(&(family, key)) {
            Some(existing) => existing.push(charge),
            None => {
                charges.insert((family, key), Charges::One(charge));
            }
        }
    }

    /// Removes and returns the key's charges, if any.
    pub fn take_charges(&self, family: Family, key: u64) -> Option<Charges> {
        self.charges().remove(&(family, key))
    }

    /// Puts taken charges back (their free failed).
    pub fn put_back(&self, family: Family, key: u64, charges: Charges) {
        charges.iter().for_each(|charge| self.insert(family, key, *charge));
    }

    /// Puts charges back (their free failed).
    pub fn restore(&self, family: Family, key: u64, charges: Vec<Charge>) {
        for charge in charges {
            self.insert(family, key, charge);
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
        assert_eq!(ledger.take_charges(Family::PhysicalHandle, 0x1000), None);
        assert_eq!(ledger.take_charges(Family::Pointer, 0x1000), Some(Charges::One(charge)));
        assert_eq!(ledger.take_charges(Family::Pointer, 0x1000), None);
        ledger.restore(Family::Pointer, 0x1000, vec![charge]);
        ledger.insert(Family::Pointer, 0x1000, charge);
        ledger.insert(
            Family::Pointer,
            0x1000,
            Charge {
                region_index: 1,
                ..charge
            },
        );
        let merged = Charge { bytes: 20, ..charge };
        let other_device = Charge {
            region_index: 1,
            ..charge
        };
        assert_eq!(
            ledger.take_charges(Family::Pointer, 0x1000),
            Some(Charges::Many(vec![merged, other_device]))
        );
        ledger.insert(Family::Graph, 7, charge);
        ledger.clear();
        assert_eq!(ledger.take_charges(Family::Graph, 7), None);
    }
}
