//! Which LoRA adapters each worker serves and holds, as the router knows it:
//!
//! - **Served**: the adapters a worker lists (its `/v1/models`, cards with a `parent`); a
//!   worker whose list is unknown is taken to serve any. A request for an adapter goes only to
//!   workers that serve it.
//! - **Resident**: the adapters in its GPU slots, least recently used first, from its reports
//!   (vLLM's `vllm:lora_requests_info`: `running_lora_adapters` are in slots, `max_lora` is
//!   how many slots there are) and from the router's own decisions (a request routed there
//!   puts its adapter in a slot), evicting as the engine would.
//! - **In flight**: the adapters of the requests routed there and not yet ended: their slots
//!   cannot be given up.
//!
//! [`AdapterTable::fit`] tells the `kv` cost what running an adapter on a worker takes:
//! nothing, a load, a load that evicts another adapter, or a wait for a slot.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;
use serde::Serialize;

use super::policy::Policy;
pub use super::types::AdapterFit;
use super::types::{Candidate, RequestInfo};
use crate::protocols::WorkerWithDpRank;

/// Adapters remembered as resident on a worker whose slot count is unknown.
const UNKNOWN_SLOTS: usize = 64;
/// Adapters a worker may be listed as serving: its list comes from outside.
pub const MAX_SERVED: usize = 4_096;
/// The most GPU slots a worker's report is taken to have (vLLM's `max_loras` is a handful;
/// a report claiming 2^62 would otherwise keep every adapter name ever reported).
pub const MAX_SLOTS: usize = 256;

/// A worker's adapters, as the router knows them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct WorkerAdapters {
    /// GPU slots (vLLM's `max_lora`), if reported.
    pub max_loras: Option<usize>,
    /// The adapters it lists; `None`: not known, taken as any.
    pub served: Option<BTreeSet<String>>,
    /// In its slots, least recently used first.
    pub resident: Vec<String>,
    /// In-flight requests per adapter.
    pub in_flight: BTreeMap<String, usize>,
}

impl WorkerAdapters {
    fn slots(&self) -> usize {
        self.max_loras.unwrap_or(UNKNOWN_SLOTS).max(1)
    }

    fn serves(&self, adapter: &str) -> bool {
        self.served.as_ref().is_none_or(|s| s.contains(adapter))
    }

    /// Marks `adapter` in a slot, most recently used; the least recently used one not in
    /// flight makes room.
    fn touch(&mut self, adapter: &str) {
        match self.resident.iter().position(|a| a == adapter) {
            Some(at) => {
                let a = self.resident.remove(at);
                self.resident.push(a);
            }
            None => self.resident.push(adapter.to_owned()),
        }
        while self.resident.len() > self.slots() {
            let idle = self.resident.iter().position(|a| !self.in_flight.contains_key(a));
            self.resident.remove(idle.unwrap_or(0));
        }
    }

    fn fit(&self, adapter: &str) -> AdapterFit {
        if self.resident.iter().any(|a| a == adapter) {
            return AdapterFit::Resident;
        }
        let slots = self.slots();
        if self.resident.len() < slots {
            return AdapterFit::Load;
        }
        let busy = self.in_flight.keys().filter(|a| *a != adapter).count();
        match busy >= slots {
            true => AdapterFit::Wait,
            false => AdapterFit::LoadEvicting,
        }
    }
}

/// Every worker's adapters, and the adapter of each request in flight.
#[derive(Clone, Debug, Default)]
pub struct AdapterTable {
    workers: BTreeMap<WorkerWithDpRank, WorkerAdapters>,
    requests: FxHashMap<String, (WorkerWithDpRank, String)>,
}

impl AdapterTable {
    /// Whether `worker` can run `adapter` (the base model runs everywhere).
    pub fn serves(&self, worker: WorkerWithDpRank, adapter: Option<&str>) -> bool {
        let Some(a) = adapter else { return true };
        self.workers.get(&worker).is_none_or(|w| w.serves(a))
    }

    /// What running `adapter` on `worker` takes.
    pub fn fit(&self, worker: WorkerWithDpRank, adapter: Option<&str>) -> AdapterFit {
        let Some(a) = adapter else { return AdapterFit::Resident };
        self.workers.get(&worker).map_or(AdapterFit::Load, |w| w.fit(a))
    }

    /// The adapters `worker` lists (`None`: unknown, any); at most [`MAX_SERVED`] kept.
    pub fn set_served(&mut self, worker: WorkerWithDpRank, served: Option<BTreeSet<String>>) {
        let served = served.map(|s| s.into_iter().take(MAX_SERVED).collect());
        self.workers.entry(worker).or_default().served = served;
    }

    /// A worker's report: its slots and the adapters of its running requests (in slots).
    pub fn report(&mut self, worker: WorkerWithDpRank, max_loras: Option<usize>, running: &[&str]) {
        let w = self.workers.entry(worker).or_default();
        if max_loras.is_some() {
            w.max_loras = max_loras.map(|m| m.min(MAX_SLOTS));
        }
        for a in running.iter().take(UNKNOWN_SLOTS) {
            w.touch(a);
        }
    }

    /// A request for `adapter` was routed to `worker`: its adapter takes a slot there until
    /// [`AdapterTable::freed`].
    pub fn routed(&mut self, id: &str, worker: WorkerWithDpRank, adapter: &str) {
        let w = self.workers.entry(worker).or_default();
        *w.in_flight.entry(adapter.to_owned()).or_default() += 1;
        w.touch(adapter);
        if let Some((before, name)) = self.requests.insert(id.to_owned(), (worker, adapter.into()))
        {
            self.release(before, &name);
        }
    }

    /// The request ended (or was never one with an adapter).
    pub fn freed(&mut self, id: &str) {
        if let Some((worker, adapter)) = self.requests.remove(id) {
            self.release(worker, &adapter);
        }
    }

    fn release(&mut self, worker: WorkerWithDpRank, adapter: &str) {
        if let Some(w) = self.workers.get_mut(&worker)
            && let Some(n) = w.in_flight.get_mut(adapter)
        {
            *n -= 1;
            if *n == 0 {
                w.in_flight.remove(adapter);
            }
        }
    }

    /// Keeps only the requests `keep` says are still in flight (the others' end never came).
    pub fn retain_requests(&mut self, mut keep: impl FnMut(&str) -> bool) {
        let gone: Vec<String> = self.requests.keys().filter(|id| !keep(id)).cloned().collect();
        for id in gone {
            self.freed(&id);
        }
    }

    pub fn remove_worker(&mut self, worker: WorkerWithDpRank) {
        self.workers.remove(&worker);
        self.requests.retain(|_, (w, _)| *w != worker);
    }

    /// Each worker's adapters, for `/workers`.
    pub fn workers(&self) -> &BTreeMap<WorkerWithDpRank, WorkerAdapters> {
        &self.workers
    }

    /// How many workers hold `adapter` in a slot.
    pub fn holders(&self, adapter: &str) -> usize {
        self.workers.values().filter(|w| w.resident.iter().any(|a| a == adapter)).count()
    }
}

/// A baseline: adapter residency alone, as llm-d's LoRA affinity scorer ranks pods (1.0 with
/// the adapter in a slot, 0.8 with a slot free for it, 0.6 when loading it evicts another,
/// 0.0 when it must wait for a slot), ties to the worker with the fewest requests in flight.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoraAffinity;

impl LoraAffinity {
    pub fn score(fit: AdapterFit) -> f64 {
        match fit {
            AdapterFit::Resident => 1.0,
            AdapterFit::Load => 0.8,
            AdapterFit::LoadEvicting => 0.6,
            AdapterFit::Wait => 0.0,
        }
    }
}

impl Policy for LoraAffinity {
    fn name(&self) -> &'static str {
        "lora-affinity"
    }

    fn cost_unit(&self) -> Option<&'static str> {
        Some("score")
    }

    fn costs(&self, _request: &RequestInfo, candidates: &[Candidate]) -> Option<Vec<f64>> {
        let costs = candidates
            .iter()
            .map(|c| (1.0 - Self::score(c.adapter)) + 1e-6 * c.active.requests as f64)
            .collect();
        Some(costs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0u32)
    }

    #[test]
    fn fits_follow_the_slots() {
        let mut t = AdapterTable::default();
        assert_eq!(t.fit(w(1), None), AdapterFit::Resident);
        assert_eq!(t.fit(w(1), Some("a")), AdapterFit::Load, "unknown worker");
        t.report(w(1), Some(2), &["a"]);
        assert_eq!(t.fit(w(1), Some("a")), AdapterFit::Resident);
        assert_eq!(t.fit(w(1), Some("b")), AdapterFit::Load);
        t.routed("r1", w(1), "b");
        assert_eq!(t.fit(w(1), Some("c")), AdapterFit::LoadEvicting, "a is idle: evicted");
        t.routed("r2", w(1), "a");
        assert_eq!(t.fit(w(1), Some("c")), AdapterFit::Wait, "both slots run requests");
        t.freed("r2");
        t.freed("r2");
        assert_eq!(t.fit(w(1), Some("c")), AdapterFit::LoadEvicting);
        t.routed("r3", w(1), "c");
        assert_eq!(t.workers()[&w(1)].resident, ["b", "c"], "a (idle, oldest) made room");
        assert_eq!(t.holders("c"), 1);
    }

    /// #51 finding 11: a report claiming 2^62 slots, then ever new names, keeps at most
    /// [`MAX_SLOTS`] adapters resident.
    #[test]
    fn reports_keep_a_bounded_list() {
        let mut t = AdapterTable::default();
        for i in 0..2_000 {
            let names: Vec<String> = (0..64).map(|j| format!("n{i}-{j}")).collect();
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            t.report(w(1), Some(1 << 62), &names);
        }
        let worker = &t.workers()[&w(1)];
        assert_eq!(worker.max_loras, Some(MAX_SLOTS));
        assert_eq!(worker.resident.len(), MAX_SLOTS);
    }

    #[test]
    fn served_lists_filter_workers() {
        let mut t = AdapterTable::default();
        assert!(t.serves(w(1), Some("a")), "unknown: any");
        t.set_served(w(1), Some(["a".to_owned()].into()));
        assert!(t.serves(w(1), Some("a")));
        assert!(!t.serves(w(1), Some("b")));
        assert!(t.serves(w(1), None));
        t.remove_worker(w(1));
        assert!(t.serves(w(1), Some("b")));
    }

    #[test]
    fn a_request_routed_twice_is_counted_once() {
        let mut t = AdapterTable::default();
        t.routed("r", w(1), "a");
        t.routed("r", w(2), "a");
        assert!(t.workers()[&w(1)].in_flight.is_empty());
        assert_eq!(t.workers()[&w(2)].in_flight["a"], 1);
        t.freed("r");
        assert!(t.workers()[&w(2)].in_flight.is_empty());
    }
}
