//! The VMM mappings the library follows, by start address. Each names what it maps (an
//! allocation's id in [`super::vmm`], a split allocation's head in [`super::split`]) and has a
//! serial number of its own: an unmap forgets only the mappings it saw before calling the driver,
//! never one another thread made at the same address once the driver had unmapped it.

use std::collections::BTreeMap;

/// One mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Mapping {
    pub bytes: u64,
    /// What it maps.
    pub of: u64,
    serial: u64,
}

#[derive(Default)]
pub(super) struct Mappings {
    by_start: BTreeMap<u64, Mapping>,
    next_serial: u64,
}

impl Mappings {
    /// A mapping of `of` at `start..start + bytes` (the driver made it).
    pub fn insert(&mut self, start: u64, bytes: u64, of: u64) {
        let serial = self.next_serial;
        self.next_serial += 1;
        self.by_start.insert(start, Mapping { bytes, of, serial });
    }

    /// What is mapped at `address`.
    pub fn at(&self, address: u64) -> Option<u64> {
        self.by_start
            .range(..=address)
            .next_back()
            .filter(|(start, mapping)| address - **start < mapping.bytes)
            .map(|(_, mapping)| mapping.of)
    }

    /// The mappings that start in `start..end`, before an unmap of that range.
    pub fn within(&self, start: u64, end: u64) -> Vec<(u64, Mapping)> {
        self.by_start
            .range(start..end)
            .map(|(&start, &mapping)| (start, mapping))
            .collect()
    }

    /// Forgets a mapping [`Mappings::within`] answered, once the driver unmapped it (unless
    /// another mapping took its address since).
    pub fn forget(&mut self, start: u64, mapping: &Mapping) {
        if self.by_start.get(&start) == Some(mapping) {
            self.by_start.remove(&start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Mappings;

    #[test]
    fn an_unmap_forgets_what_it_saw_not_a_mapping_made_at_its_address_since() {
        let mut mappings = Mappings::default();
        mappings.insert(0x1000, 0x100, 7);
        mappings.insert(0x2000, 0x100, 8);
        assert_eq!(mappings.at(0x10ff), Some(7));
        assert_eq!(mappings.at(0x1100), None);
        let seen = mappings.within(0x1000, 0x1100);
        assert_eq!(seen.len(), 1);
        // Another thread maps allocation 9 at the address once the driver has unmapped it.
        mappings.insert(0x1000, 0x100, 9);
        for (start, mapping) in &seen {
            mappings.forget(*start, mapping);
        }
        assert_eq!(mappings.at(0x1000), Some(9), "the later mapping stays");
        let seen = mappings.within(0x1000, 0x1100);
        for (start, mapping) in &seen {
            mappings.forget(*start, mapping);
        }
        assert_eq!(mappings.at(0x1000), None);
        assert_eq!(mappings.at(0x2000), Some(8));
    }
}
