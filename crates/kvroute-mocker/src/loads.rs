//! Tier loads that run beside the steps (`--tier-loads async`, the default), as vLLM's
//! offloading connector loads (`WAITING_FOR_REMOTE_KVS`) and Dynamo's mocker times them:
//!
//! - A request whose prompt continues below the GPU (host memory, storage, the shared store)
//!   leaves the queue when its turn comes, and its load starts: it takes the load's bytes at
//!   the tier's bandwidth, after the loads started before it (one inbound lane, first come
//!   first loaded, as Dynamo's mocker queues its host-to-device copies on a FIFO lane).
//! - Meanwhile the engine steps without it: other requests run and are admitted.
//! - The GPU blocks it needs are kept free for it from the start of its load: other requests
//!   are admitted only into the room left (running requests still grow into it, as the
//!   engine's preemption would give it back).
//! - When its load is done, it goes back to the front of the queue, and is admitted at the
//!   next step with the loaded blocks as cached tokens, at no further time.
//!
//! `--tier-loads sync` instead adds a load to the step that admits the request, holding up
//! the whole batch (as connectors that load inside the forward pass do, LMCache's default).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::sequence::Sequence;

/// How a load from below the GPU is timed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TierLoads {
    /// Beside the steps: the request waits for its own load (vLLM's offloading connector,
    /// Dynamo's mocker).
    #[default]
    Async,
    /// Inside the admitting step, which every request in the batch waits for.
    Sync,
}

impl std::str::FromStr for TierLoads {
    type Err = kvroute_core::UnknownChoice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "async" => Ok(Self::Async),
            "sync" => Ok(Self::Sync),
            _ => Err(kvroute_core::UnknownChoice::new("tier load timing", s, "async, sync")),
        }
    }
}

/// The longest an engine with nothing but loads to wait for sleeps at once, so that a
/// request arriving meanwhile waits at most this long to be scheduled.
pub(crate) const MAX_WAIT: Duration = Duration::from_millis(1);

/// Requests whose loads are under way, and when the inbound lane is next free.
#[derive(Debug, Default)]
pub(crate) struct Loading {
    /// (when its load is done, the request), in the order the loads started, which the FIFO
    /// lane makes the order they finish.
    loads: Vec<(Duration, Sequence)>,
    lane_free: Duration,
}

impl Loading {
    /// Starts the load of `s`, taking `took` on the lane from `now` or when the lane is free.
    pub(crate) fn start(&mut self, now: Duration, took: Duration, s: Sequence) {
        let done = self.lane_free.max(now) + took;
        self.lane_free = done;
        self.loads.push((done, s));
    }

    /// The requests whose loads are done by `now`, in the order they finished.
    pub(crate) fn take_done(&mut self, now: Duration) -> Vec<Sequence> {
        let done = self.loads.partition_point(|(at, _)| *at <= now);
        self.loads.drain(..done).map(|(_, s)| s).collect()
    }

    /// When the next load is done.
    pub(crate) fn next_done(&self) -> Option<Duration> {
        self.loads.first().map(|(at, _)| *at)
    }

    pub(crate) fn len(&self) -> usize {
        self.loads.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.loads.is_empty()
    }

    pub(crate) fn contains(&self, id: &str) -> bool {
        self.loads.iter().any(|(_, s)| s.id == id)
    }

    /// Takes out a request whose client left (its load's time on the lane stays spent).
    pub(crate) fn cancel(&mut self, id: &str) -> Option<Sequence> {
        let at = self.loads.iter().position(|(_, s)| s.id == id)?;
        Some(self.loads.remove(at).1)
    }
}
