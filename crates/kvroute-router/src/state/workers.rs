//! The verbs of the fleet's membership and trust: a parity probe's outcome, an engine gone,
//! an event subscription's change. Each crosses the fleet's registry and the index or the
//! scheduler, in the lock order of the module docs.

use kvroute_core::{WorkerId, WorkerWithDpRank};

use super::composite::RouterState;
use super::fleet::{Link, Parity};

impl RouterState {
    /// Records a worker's parity probe. A failure (with its cause) makes its events untrusted:
    /// its blocks are cleared, its events ignored (counted as rejected `parity`) and it is
    /// routed approximately; `Ok` (or `Unchecked`, before a new probe) trusts them again. A
    /// probe put off (`Retrying`) does not undo a failure: the worker stays failed until a
    /// probe is made.
    pub fn set_parity(&self, worker: WorkerId, parity: Parity) {
        let mut approx = self.placing.approx();
        let change = self.fleet.set_parity(worker, parity);
        if change.leave_approximate {
            approx.remove_worker(worker);
        }
        if change.clear {
            self.index.clear_all_blocks(worker);
        }
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
            self.placing.scheduler().set_ready(worker, ready);
        }
        self.fleet.signal();
    }
}
