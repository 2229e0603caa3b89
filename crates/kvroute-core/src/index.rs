//! Which cache holds which block: a compressed radix tree fed by KV events.
//!
//! ```text
//!                 root
//!                /    \                  a node is a run ("edge") of blocks with its holders:
//!   [L0 .. L511]       [M0 M1]           each cache with how many of the edge's LEADING blocks
//!   {w1:512, w2:300,    {w1:2}           it holds (tail eviction leaves prefixes). Nodes split
//!    w3:512, w4:17}       \              only where paths diverge, or around a block evicted
//!      /        \        [M2 .. M63]     from the middle of what a cache holds
//!  [N0 N1]    [P0]      {w1:62}
//!  {w1:2}     {w3:1}
//! ```
//!
//! - Children are found by `(parent node, first LocalBlockHash of the child)` in one hash map,
//!   so a node needs no child container and splits/merges never re-key children.
//! - Each worker keeps a map from its engine's block hash ([`crate::ExternalBlockHash`]) to a stable
//!   block id; block ids find their node through a slot table (`node`, `pos`), where
//!   `pos - node.base` is the block's offset in the edge. Splitting moves the *head* of an edge
//!   into a new node, so only the head's slots change, and the tail keeps its children.
//! - `find_matches` walks from the root comparing whole edges against the query; at each node
//!   the holders of the whole edge go on and the others score what they hold of what matched,
//!   so a document a thousand caches hold to different depths costs one pass over one node's
//!   holders. A worker's score is the number of **leading** blocks it holds (Dynamo's
//!   `find_matches` instead counts blocks on the path regardless of holes).
//! - Removing a worker's block shortens its count, or cuts the node around a hole; nodes
//!   nobody holds and without children are freed (Dynamo leaks them), a childless node's tail
//!   that nobody holds is cut off, and a lone child whose holders hold all of its parent merges
//!   into it.
//!
//! Forms: [`RadixIndex`] (single-threaded, `&mut` to write), [`ShardedIndex`] (readers in
//! parallel with per-shard writers) and [`ApproxIndex`] (for engines that publish no events:
//! routed requests recorded with a TTL).

mod approx;
mod ext_map;
mod groups;
mod holders;
mod radix;
mod shard_lock;
mod sharded;
mod tiers;

mod scores;

pub use approx::{ApproxConfig, ApproxIndex, ApproxTracker};
pub use groups::{HybridGroups, MAX_GROUPS};
pub use radix::RadixIndex;
pub use scores::{IndexConfig, IndexStats, OverlapScores};
pub use sharded::{BLOCKS_PER_LOCK, ShardedIndex};
pub use tiers::{LowerTiers, REMEMBERED, TierRun, TierScores};
