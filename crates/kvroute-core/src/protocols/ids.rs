//! The names the fleet's parts share: block hashes, workers and their data-parallel ranks.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<$inner> for $name {
            fn from(v: $inner) -> Self {
                Self(v)
            }
        }
    };
}

id_newtype!(
    /// Hash of one block's content: its tokens and the images it covers (see [`crate::hash`]).
    LocalBlockHash(u64)
);
id_newtype!(
    /// Hash of a block together with everything before it: `S_i = xxh3(S_{i-1} ‖ L_i)`.
    SequenceHash(u64)
);
id_newtype!(
    /// The engine's own name for a block, meaningful only within one worker's events.
    ExternalBlockHash(u64)
);
id_newtype!(
    /// One engine instance (process or pod) in the fleet.
    WorkerId(u64)
);
id_newtype!(
    /// A data-parallel rank inside a worker; each rank has a KV cache of its own.
    DpRank(u32)
);

/// The unit that holds a KV cache: a worker and one of its data-parallel ranks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct WorkerWithDpRank {
    pub worker_id: WorkerId,
    #[serde(default)]
    pub dp_rank: DpRank,
}

impl WorkerWithDpRank {
    pub fn new(worker_id: impl Into<WorkerId>, dp_rank: impl Into<DpRank>) -> Self {
        Self { worker_id: worker_id.into(), dp_rank: dp_rank.into() }
    }
}

impl fmt::Display for WorkerWithDpRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker_id, self.dp_rank)
    }
}
