//! Which caches (dense worker slots) hold how much of one tree node.

use smallvec::SmallVec;

/// Dense index of a `WorkerWithDpRank` inside one index; reused after `remove_worker`.
pub(crate) type Slot = u32;

/// The holders of a node's edge: each slot with the number of the edge's **leading** blocks it
/// holds (at least 1, at most the edge's length), sorted by slot, inline up to two.
///
/// A holder whose count is the edge's length holds all of it and may go on into children; one
/// with a smaller count holds a prefix, the shape tail eviction leaves. So workers that hold
/// different lengths of one run of blocks share one node instead of splitting it per length.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Holders(SmallVec<[(Slot, u32); 2]>);

impl Holders {
    /// Leading blocks `slot` holds (0 if none).
    pub(crate) fn count(&self, slot: Slot) -> u32 {
        self.0.binary_search_by_key(&slot, |&(s, _)| s).map_or(0, |i| self.0[i].1)
    }

    /// Sets `slot`'s count; 0 removes it.
    pub(crate) fn set(&mut self, slot: Slot, count: u32) {
        match (self.0.binary_search_by_key(&slot, |&(s, _)| s), count) {
            (Ok(i), 0) => {
                self.0.remove(i);
            }
            (Ok(i), c) => self.0[i].1 = c,
            (Err(_), 0) => {}
            (Err(i), c) => self.0.insert(i, (slot, c)),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The largest count (0 without holders): blocks past it are held by nobody.
    pub(crate) fn max_count(&self) -> u32 {
        self.0.iter().map(|&(_, c)| c).max().unwrap_or(0)
    }

    /// Whether every holder of `other` holds all `len` blocks of this node.
    pub(crate) fn covers(&self, other: &Self, len: u32) -> bool {
        other.0.iter().all(|&(s, _)| self.count(s) == len)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (Slot, u32)> + '_ {
        self.0.iter().copied()
    }

    pub(crate) fn as_slice(&self) -> &[(Slot, u32)] {
        &self.0
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        if self.0.spilled() { self.0.capacity() * size_of::<(Slot, u32)>() } else { 0 }
    }

    /// The holders of the first `k` blocks (each count capped at `k`), and of the rest (counts
    /// past `k`, shifted down), for cutting a node after `k` blocks.
    pub(crate) fn split_at(&self, k: u32) -> (Self, Self) {
        let head = self.0.iter().map(|&(s, c)| (s, c.min(k))).collect();
        let tail = self.0.iter().filter(|&&(_, c)| c > k).map(|&(s, c)| (s, c - k)).collect();
        (Self(head), Self(tail))
    }

    /// The holders of a parent's `len` blocks followed by its only child's: every holder of
    /// `child` must hold the whole parent ([`Self::covers`]).
    pub(crate) fn joined(&self, child: &Self, len: u32) -> Self {
        let mut out = self.clone();
        for (s, c) in child.iter() {
            out.set(s, len + c);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_split_and_join() {
        let mut h = Holders::default();
        h.set(5, 8);
        h.set(1, 3);
        h.set(9, 8);
        assert_eq!(h.as_slice(), &[(1, 3), (5, 8), (9, 8)]);
        assert_eq!((h.count(5), h.count(7), h.max_count()), (8, 0, 8));
        let (head, tail) = h.split_at(4);
        assert_eq!(head.as_slice(), &[(1, 3), (5, 4), (9, 4)]);
        assert_eq!(tail.as_slice(), &[(5, 4), (9, 4)]);
        assert!(head.covers(&tail, 4) && !tail.covers(&head, 4));
        assert_eq!(head.joined(&tail, 4), h);
        h.set(5, 0);
        h.set(7, 0);
        assert_eq!(h.as_slice(), &[(1, 3), (9, 8)]);
    }
}
