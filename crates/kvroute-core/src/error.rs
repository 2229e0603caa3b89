//! The core's errors: an index refusing an event, a word naming no known choice.

use crate::{ExternalBlockHash, WorkerWithDpRank};

/// A setting's word that names none of its choices (`--role`, `--tier-loads`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {given:?} ({choices})")]
pub struct UnknownChoice {
    /// What the word was to name.
    pub what: &'static str,
    pub given: String,
    /// The words it takes, for the message.
    pub choices: &'static str,
}

impl UnknownChoice {
    pub fn new(what: &'static str, given: &str, choices: &'static str) -> Self {
        Self { what, given: given.to_owned(), choices }
    }
}

/// Everything kvroute-core can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("kv_block_size must be greater than 0")]
    ZeroBlockSize,
    /// A Stored event named a parent block the worker does not hold; nothing was applied.
    #[error("worker {worker} does not hold parent block {parent}")]
    UnknownParent { worker: WorkerWithDpRank, parent: ExternalBlockHash },
    /// A Removed event named blocks the worker does not hold; the others were removed.
    #[error("worker {worker} does not hold {count} of the removed blocks")]
    UnknownBlocks { worker: WorkerWithDpRank, count: usize },
    #[error(
        "unknown routing policy {0:?} (expected kv, kv-tokens, dynamo, round-robin, random, \
         least-loaded, sticky, kv-adapter-blind or lora-affinity)"
    )]
    UnknownPolicy(String),
}
