//! What this process has charged, by the handle the driver gave back, so each free releases
//! exactly what its allocation charged.

use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap};

use vgpu_region::MemoryKind;

/// One charge in the region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Charge {
    pub region_index: usize,
    pub kind: MemoryKind,
    pub bytes: u64,
}

/// A stream as a capture is keyed: its handle and, for a per-thread default stream, the thread
/// (each thread has its own).
pub type CaptureKey = (u64, u64);

/// The graph a stream's capture records into, as it bears on the capture's allocations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaptureInto {
    /// A graph the driver makes for the capture (`cuStreamBeginCapture`) and destroys when the
    /// capture fails.
    DriverGraph(u64),
    /// The application's own graph (`cuStreamBeginCaptureToGraph`), which outlives a failed
    /// capture with its charges.
    ApplicationGraph(u64),
    /// The application's graph captured again node for node (`cuStreamBeginRecaptureToGraph`):
    /// its allocation nodes, whose sizes the driver holds to the original's, are charged already.
    Recapture(u64),
}

/// The kinds of handle a charge is recorded under.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Device pointers (linear, pitched, managed, stream-ordered allocations).
    Pointer,
    /// Device pointers that elastic memory served from unified memory (`super::spill`): a free
    /// looks for them only when the pointer is not a [`Family::Pointer`].
    Spill,
    /// `CUmemGenericAllocationHandle`s that elastic memory made in host memory for a device
    /// (`super::spill`): a release looks for them only when the handle is not a
    /// [`Family::PhysicalHandle`].
    SpillHandle,
    /// The head's handle of a VMM allocation elastic memory split between the device and host
    /// memory (`super::split`), charged whole.
    SplitHandle,
    /// `CUmemGenericAllocationHandle` of `cuMemCreate`.
    PhysicalHandle,
    Array,
    MipmappedArray,
    Context,
    Module,
    Library,
    /// Graph memory nodes, by graph: released with the graph.
    Graph,
    /// A stream-ordered memory pool's reserved memory, by pool.
    Pool,
    /// VMM memory whose handle was released while mapped, by an id of its own
    /// (`super::vmm`): released with its last mapping.
    ReleasedMapped,
    /// What a device keeps for this process's graphs beyond what live graphs' allocation nodes
    /// are charged, by device ordinal.
    GraphPool,
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
        // A product's low bits depend only on the input's low bits, and the table picks buckets
        // by the low bits: without the rotation, allocations 2 MiB apart would share one probe
        // sequence.
        self.0.rotate_left(26)
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

/// What a handle was charged, and the context that owns it (0: none), whose destruction frees it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    charges: Charges,
    owner: u64,
}

/// A device's primary context as this process holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Primary {
    pub references: u32,
    pub charge: Option<Charge>,
    pub context: u64,
}

/// The charges of this process. A plain mutex: nothing here blocks while holding it.
#[derive(Default)]
pub struct Ledger {
    charges: Mutex<HandleMap<Entry>>,
    /// Pointers from stream-ordered pools, with their pool (their charge is the pool's).
    pool_pointers: Mutex<HandleMap<u64>>,
    /// The device ordinal of each pool that holds a charge.
    pool_devices: Mutex<HandleMap<i32>>,
    /// Set once the process has a pool or graph memory: memory the driver gives back at
    /// synchronisations, whose charges follow there.
    has_pools: std::sync::atomic::AtomicBool,
    /// The devices this process has made graph allocations on.
    graph_devices: Mutex<BTreeSet<i32>>,
    /// Bytes of `Family::Graph` charges, by region device index, kept with the charges (read
    /// before every charge on a device with graph memory; the charges map can be large).
    graph_bytes: Mutex<HashMap<usize, u64>>,
    /// Held while a device's graph memory charge is brought up to date.
    graph_sync: Mutex<()>,
    /// The graph each stream's capture records into, by [`CaptureKey`], for the captures whose
    /// allocations were charged and for every capture into the application's graph.
    captures: Mutex<HashMap<CaptureKey, CaptureInto>>,
    /// Primary contexts, by device ordinal.
    primary: Mutex<HashMap<i32, Primary>>,
}

impl Ledger {
    fn charges(&self) -> parking_lot::MutexGuard<'_, HandleMap<Entry>> {
        self.charges.lock()
    }

    /// Everything this process has charged, by region device index and kind: the handles' charges
    /// and the primary contexts'. It can lag behind the region (an allocation is charged there
    /// before the driver is called and recorded here after; a free leaves here first), never run
    /// ahead of it.
    pub fn held(&self) -> vgpu_region::ChargeTable {
        let mut held = [[0u64; 3]; vgpu_region::MAX_DEVICES];
        let mut add = |charge: &Charge| {
            if let Some(device) = held.get_mut(charge.region_index) {
                let bytes = &mut device[charge.kind.index()];
                *bytes = bytes.saturating_add(charge.bytes);
            }
        };
        self.charges()
            .values()
            .for_each(|entry| entry.charges.iter().for_each(&mut add));
        self.primary
            .lock()
            .values()
            .filter_map(|primary| primary.charge.as_ref())
            .for_each(&mut add);
        held
    }

    /// Records a charge under a handle owned by `owner` (a context, or 0).
    pub fn insert_owned(&self, family: Family, key: u64, charge: Charge, owner: u64) {
        let mut charges = self.charges();
        if family == Family::Graph {
            *self.graph_bytes.lock().entry(charge.region_index).or_default() += charge.bytes;
        }
        match charges.get_mut(&(family, key)) {
            Some(existing) => existing.charges.push(charge),
            None => {
                charges.insert(
                    (family, key),
                    Entry {
                        charges: Charges::One(charge),
                        owner,
                    },
                );
            }
        }
    }

    pub fn insert(&self, family: Family, key: u64, charge: Charge) {
        self.insert_owned(family, key, charge, 0);
    }

    /// Removes every charge of handles the context owned (the driver freed them with it).
    pub fn take_owned_by(&self, owner: u64) -> Vec<Charge> {
        if owner == 0 {
            return Vec::new();
        }
        let mut taken = Vec::new();
        self.charges().retain(|_, entry| {
            if entry.owner == owner {
                taken.extend(entry.charges.iter().copied());
                false
            } else {
                true
            }
        });
        taken
    }

    fn pool_pointers(&self) -> parking_lot::MutexGuard<'_, HandleMap<u64>> {
        self.pool_pointers.lock()
    }

    /// Remembers which pool a stream-ordered allocation came from, and the pool's device.
    pub fn set_pool_of(&self, pointer: u64, pool: u64, ordinal: i32) {
        self.pool_pointers().insert((Family::Pointer, pointer), pool);
        self.pool_devices().insert((Family::Pool, pool), ordinal);
        self.has_pools.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn pool_devices(&self) -> parking_lot::MutexGuard<'_, HandleMap<i32>> {
        self.pool_devices.lock()
    }

    /// The device of a pool this process has allocated from.
    pub fn pool_device(&self, pool: u64) -> Option<i32> {
        self.pool_devices().get(&(Family::Pool, pool)).copied()
    }

    /// Whether this process has allocated from any pool (one load on the synchronisation path).
    pub fn has_pools(&self) -> bool {
        self.has_pools.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every pool this process has allocated from, with its device.
    pub fn pools(&self) -> Vec<(u64, i32)> {
        self.pool_devices()
            .iter()
            .map(|((_, pool), ordinal)| (*pool, *ordinal))
            .collect()
    }

    /// Notes that a graph with memory was made on a device: its graph memory is followed from
    /// now on.
    pub fn note_graph_memory(&self, ordinal: i32) {
        self.graph_devices.lock().insert(ordinal);
        self.has_pools.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The devices this process has made graph allocations on.
    pub fn graph_devices(&self) -> Vec<i32> {
        self.graph_devices.lock().iter().copied().collect()
    }

    /// Whether this process has made graph allocations on a device.
    pub fn has_graph_memory(&self, ordinal: i32) -> bool {
        self.graph_devices.lock().contains(&ordinal)
    }

    /// Forgets a destroyed pool.
    pub fn forget_pool(&self, pool: u64) {
        self.pool_devices().remove(&(Family::Pool, pool));
        self.pool_pointers().retain(|_, owner| *owner != pool);
    }

    /// The pool a pointer came from, forgotten.
    pub fn take_pool_of(&self, pointer: u64) -> Option<u64> {
        self.pool_pointers().remove(&(Family::Pointer, pointer))
    }

    /// Whether the key has charges.
    pub fn contains(&self, family: Family, key: u64) -> bool {
        self.charges().contains_key(&(family, key))
    }

    /// The device (region index) of the key's first charge, if it has any.
    pub fn first_region_index(&self, family: Family, key: u64) -> Option<usize> {
        self.charges()
            .get(&(family, key))
            .and_then(|entry| entry.charges.iter().next().map(|charge| charge.region_index))
    }

    /// Removes and returns the key's charges, if any.
    pub fn take_charges(&self, family: Family, key: u64) -> Option<(Charges, u64)> {
        let mut charges = self.charges();
        let entry = charges.remove(&(family, key))?;
        if family == Family::Graph {
            let mut graph_bytes = self.graph_bytes.lock();
            for charge in entry.charges.iter() {
                if let Some(bytes) = graph_bytes.get_mut(&charge.region_index) {
                    *bytes = bytes.saturating_sub(charge.bytes);
                }
            }
        }
        Some((entry.charges, entry.owner))
    }

    /// The bytes live graphs' allocation nodes are charged on a region device.
    pub fn graph_bytes(&self, region_index: usize) -> u64 {
        self.graph_bytes.lock().get(&region_index).copied().unwrap_or(0)
    }

    /// Serialises bringing graph memory charges up to date.
    pub fn graph_sync(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.graph_sync.lock()
    }

    /// Remembers the graph a stream's capture records into (the first time only).
    pub fn remember_capture(&self, key: CaptureKey, into: CaptureInto) {
        self.captures.lock().entry(key).or_insert(into);
    }

    /// Remembers the graph a capture that begins now records into, in place of any earlier one.
    pub fn begin_capture(&self, key: CaptureKey, into: CaptureInto) {
        self.captures.lock().insert(key, into);
    }

    /// The graph a stream's capture records into, if remembered.
    pub fn capture(&self, key: CaptureKey) -> Option<CaptureInto> {
        self.captures.lock().get(&key).copied()
    }

    /// The graph a stream's capture recorded into, forgotten.
    pub fn take_capture(&self, key: CaptureKey) -> Option<CaptureInto> {
        self.captures.lock().remove(&key)
    }

    /// Puts taken charges back (their free failed).
    pub fn put_back(&self, family: Family, key: u64, charges: Charges, owner: u64) {
        charges
            .iter()
            .for_each(|charge| self.insert_owned(family, key, *charge, owner));
    }

    /// Records several charges under one handle.
    pub fn insert_all(&self, family: Family, key: u64, charges: Vec<Charge>, owner: u64) {
        for charge in charges {
            self.insert_owned(family, key, charge, owner);
        }
    }

    /// Runs `update` on the primary context record of a device.
    pub fn with_primary<R>(&self, ordinal: i32, update: impl FnOnce(&mut Primary) -> R) -> R {
        let mut primary = self.primary.lock();
        update(primary.entry(ordinal).or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_addresses_spread_over_the_low_bits() {
        use std::hash::Hasher;
        // 4096 allocations 2 MiB apart, as the driver places large ones: the low 12 bits of their
        // hashes pick buckets in a table of 4096.
        let buckets: std::collections::HashSet<u64> = (0..4096u64)
            .map(|i| {
                let mut hasher = HandleHasher::default();
                hasher.write_u64(0x7f00_0000_0000 + (i << 21));
                hasher.finish() & 0xfff
            })
            .collect();
        assert!(buckets.len() > 2000, "{} distinct buckets of 4096", buckets.len());
    }

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
        assert_eq!(
            ledger.take_charges(Family::Pointer, 0x1000),
            Some((Charges::One(charge), 0))
        );
        assert_eq!(ledger.take_charges(Family::Pointer, 0x1000), None);
        ledger.insert_all(Family::Pointer, 0x1000, vec![charge], 0);
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
            Some((Charges::Many(vec![merged, other_device]), 0))
        );
        ledger.insert_owned(Family::Pointer, 0x2000, charge, 77);
        ledger.insert_owned(Family::Array, 0x3000, charge, 77);
        ledger.insert_owned(Family::Pointer, 0x4000, charge, 78);
        assert_eq!(ledger.take_owned_by(77), vec![charge, charge]);
        assert_eq!(ledger.take_owned_by(0), vec![]);
        assert!(ledger.take_charges(Family::Pointer, 0x4000).is_some());
    }
}
