//! The single-threaded compressed radix index (see the [module docs](super) for the picture).
//!
//! Invariants, checked by the property tests against a naive model:
//! 1. a node's `holders` say, per worker, how many **leading** blocks of its edge the worker
//!    holds: block `i` of the edge is held by exactly the holders whose count exceeds `i`;
//! 2. a worker holds a block iff at least one of the worker's engine hashes is mapped to it
//!    (more than one: counted in `aliases`);
//! 3. a non-root node has a non-empty edge; a node without children has its last block held
//!    (a tail nobody holds is cut off), a node with children may be held by nobody;
//! 4. `children[(p, edge[0] of c)] == c` for every child `c` of `p`, `num_children` counts
//!    them and `child_xor` is the xor of their ids (so a lone child is known without a scan).
//!
//! Nodes split only where paths diverge, or where a worker's blocks stop being a prefix of an
//! edge (a hole evicted in its middle); workers that hold different lengths of one run share
//! its node. So a document a thousand engines hold to a thousand depths is one node, and a
//! lookup scores them in one pass over its holders.
//!
//! The index is split by what it does: `tree.rs` holds the nodes, the workers' slots and the
//! memory; `apply.rs` applies events (stores, removals, splits and merges); `find.rs` scores a
//! prompt; `evict.rs` keeps the index within its budget; `dump.rs` writes it out as events.

mod apply;
mod dump;
mod evict;
mod find;
#[cfg(test)]
mod tests;
mod tree;

pub use tree::RadixIndex;
