//! The verbs of the fleet's membership and trust: a worker joining, draining and leaving, a
//! parity probe's outcome, an engine gone, an event subscription's change. Each crosses the
//! fleet's registry and the index or the scheduler, in the lock order of the module docs.

use kvroute_core::{WorkerId, WorkerWithDpRank};

use super::composite::RouterState;
use super::fleet::Link;
use super::status::{Parity, WorkerStatus};
use crate::config::WorkerSpec;

/// A change to the fleet's membership, as every source of it asks ([`crate::members`]).
#[derive(Clone, Copy, Debug)]
pub enum MemberChange<'a> {
    /// A worker joins: known to every owner, a candidate once ready (its events connected and
    /// caught up, its first load report in, and, with `gate_on_parity`, its parity probe
    /// made). `source` names where it came from (`/workers` shows it).
    Join { spec: &'a WorkerSpec, source: &'a str, gate_on_parity: bool },
    /// No new decision for it; what it runs finishes.
    Drain(WorkerId),
    /// Gone from every owner: the registry, the scheduler (in flight, corrections, adapters,
    /// sessions), approximate mode, the index, the self-checks and the metrics' label sets.
    Remove(WorkerId),
}

impl RouterState {
    /// Records a worker's parity probe. A failure (with its cause) makes its events untrusted:
    /// its blocks are cleared, its events ignored (counted as rejected `parity`) and it is
    /// routed approximately; `Ok` (or `Unchecked`, before a new probe) trusts them again. A
    /// probe put off (`Retrying`) does not undo a failure: the worker stays failed until a
    /// probe is made.
    pub fn set_parity(&self, worker: WorkerId, parity: Parity) {
        let mut approx = self.scheduling.approx();
        let change = self.fleet.set_parity(worker, parity);
        if change.leave_approximate {
            approx.remove_worker(worker);
        }
        if change.clear {
            self.index.clear_all_blocks(worker);
        }
        drop(approx);
        if !change.ready.is_empty() {
            let mut scheduler = self.scheduling.scheduler();
            for (rank, ready) in change.ready {
                scheduler.set_ready(rank, ready);
            }
            drop(scheduler);
            self.fleet.signal();
        }
    }

    /// Applies one change to the fleet's membership; whether anything changed (`false`: a
    /// join of a known id, or a drain or removal of an unknown one).
    pub fn change_member(&self, change: MemberChange<'_>) -> bool {
        match change {
            MemberChange::Join { spec, source, gate_on_parity } => {
                let mut status = WorkerStatus::new(spec, true);
                status.source = source.to_owned();
                status.gate_on_parity = gate_on_parity;
                if let Some(stream) = stream_source(&self.config, spec.id) {
                    status.follow_stream(stream);
                }
                for rank in 0..status.ready.len() {
                    status.ready[rank] = status.rank_ready(rank);
                }
                let ready = status.ready.clone();
                if !self.fleet.join(status) {
                    return false;
                }
                for rank in 0..spec.dp_size {
                    self.index.register_worker(WorkerWithDpRank::new(spec.id, rank));
                }
                self.scheduling.add_worker(spec, &ready);
                self.roster.insert(spec, source);
                self.fleet.signal();
                tracing::info!(worker = %spec.id, url = ?spec.url, source, "a worker joins");
                true
            }
            MemberChange::Drain(worker) => {
                let Some(ranks) = self.fleet.drain(worker) else { return false };
                let mut scheduler = self.scheduling.scheduler();
                for rank in 0..ranks {
                    scheduler.set_draining(WorkerWithDpRank::new(worker, rank));
                }
                drop(scheduler);
                self.roster.set_draining(worker);
                tracing::info!(%worker, "a worker drains: no new decisions");
                true
            }
            MemberChange::Remove(worker) => {
                // Its tasks first: nothing of it is applied once it is gone.
                self.roster.remove(worker);
                let Some(status) = self.fleet.remove(worker) else { return false };
                let mut approx = self.scheduling.approx();
                approx.remove_worker(worker);
                self.index.remove_worker(worker);
                drop(approx);
                let mut scheduler = self.scheduling.scheduler();
                for rank in 0..status.dp_size {
                    scheduler.remove_worker(WorkerWithDpRank::new(worker, rank));
                }
                drop(scheduler);
                self.checks.forget(worker);
                self.metrics.forget_worker(worker, status.dp_size);
                self.fleet.signal();
                tracing::info!(%worker, "a worker left the fleet");
                true
            }
        }
    }

    /// The adapters `rank` serves, as its engine lists them (`None`: any, unknown or loaded on
    /// demand).
    pub fn set_served_adapters(
        &self,
        rank: kvroute_core::WorkerWithDpRank,
        served: Option<std::collections::BTreeSet<String>>,
    ) {
        self.scheduling.set_served_adapters(rank, served);
    }

    /// From now on a joining worker waits for its parity probe (a front door that probes).
    pub fn probe_joiners(&self) {
        self.roster.set_probed();
    }

    /// Forgets every block of `worker` (all ranks): its engine is gone, its cache with it.
    pub fn forget_blocks(&self, worker: WorkerId) {
        let ranks = self.fleet.ranks(worker).unwrap_or(0);
        let held: usize =
            (0..ranks).map(|r| self.index.tree_size(WorkerWithDpRank::new(worker, r))).sum();
        if held == 0 {
            return;
        }
        self.index.clear_all_blocks(worker);
        tracing::info!(%worker, blocks = held, "its engine is unreachable: its blocks are forgotten");
    }

    /// Records a change to a rank's event subscription; the scheduler hears when its
    /// readiness changed.
    pub fn link(&self, worker: WorkerWithDpRank, link: Link) {
        if let Some(ready) = self.fleet.link(worker, link) {
            self.scheduling.scheduler().set_ready(worker, ready);
        }
        self.fleet.signal();
    }
}

/// Where a worker's events come from when they come from the JetStream stream.
fn stream_source(config: &crate::config::RouterConfig, worker: WorkerId) -> Option<String> {
    let nats = config.nats.as_ref().filter(|n| n.events.from_stream())?;
    Some(format!("jetstream:{}.events.{}.*", nats.prefix, worker))
}
