//! The set of caches (dense worker slots) that hold every block of one tree node.

use smallvec::SmallVec;

/// Dense index of a `WorkerWithDpRank` inside one index; reused after `remove_worker`.
pub(crate) type Slot = u32;

/// A sorted set of worker slots, inline up to four (most prefixes live on few workers).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct WorkerSet(SmallVec<[Slot; 4]>);

impl WorkerSet {
    pub(crate) fn one(slot: Slot) -> Self {
        let mut v = SmallVec::new();
        v.push(slot);
        Self(v)
    }

    pub(crate) fn contains(&self, slot: Slot) -> bool {
        self.0.binary_search(&slot).is_ok()
    }

    pub(crate) fn insert(&mut self, slot: Slot) {
        if let Err(at) = self.0.binary_search(&slot) {
            self.0.insert(at, slot);
        }
    }

    pub(crate) fn remove(&mut self, slot: Slot) {
        if let Ok(at) = self.0.binary_search(&slot) {
            self.0.remove(at);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn is_only(&self, slot: Slot) -> bool {
        self.0.len() == 1 && self.0[0] == slot
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        self.0.iter().copied()
    }

    pub(crate) fn as_slice(&self) -> &[Slot] {
        &self.0
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        if self.0.spilled() { self.0.capacity() * size_of::<Slot>() } else { 0 }
    }
}

/// Keeps in `active` only the slots also in `set` (both sorted); each slot dropped is passed to
/// `dropped`. The walk of `find_matches` runs this once per node, so it must not allocate.
pub(crate) fn retain_common(
    active: &mut SmallVec<[Slot; 16]>,
    set: &[Slot],
    mut dropped: impl FnMut(Slot),
) {
    if active.as_slice() == set {
        return; // the common case on a shared path: nothing changes
    }
    let mut j = 0;
    active.retain(|slot| {
        while j < set.len() && set[j] < *slot {
            j += 1;
        }
        let keep = j < set.len() && set[j] == *slot;
        if !keep {
            dropped(*slot);
        }
        keep
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_set_operations() {
        let mut s = WorkerSet::one(5);
        s.insert(1);
        s.insert(9);
        s.insert(5);
        assert_eq!(s.as_slice(), &[1, 5, 9]);
        s.remove(5);
        s.remove(7);
        assert_eq!(s.as_slice(), &[1, 9]);
        assert!(s.contains(9) && !s.contains(5) && !s.is_only(9));
    }

    #[test]
    fn retain_common_reports_dropped() {
        let mut active: SmallVec<[Slot; 16]> = SmallVec::from_slice(&[1, 3, 5, 7]);
        let mut dropped = Vec::new();
        retain_common(&mut active, &[0, 3, 4, 7, 8], |s| dropped.push(s));
        assert_eq!(active.as_slice(), &[3, 7]);
        assert_eq!(dropped, vec![1, 5]);
    }
}
