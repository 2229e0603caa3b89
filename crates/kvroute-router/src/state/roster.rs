//! The fleet's membership as its sources and the front door see it ([`Roster`]): each
//! member's description, where it came from and whether it drains, published to whoever
//! follows the fleet (the front door's tables, the picker), and the tasks that follow each
//! member (its event subscriptions and load reader), stopped when it leaves.
//!
//! One mutex, a leaf: held to change or copy the table, never across another lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use kvroute_core::WorkerId;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::lock::lock;
use crate::config::WorkerSpec;
use crate::plane::EventPlane;

/// One member of the fleet as its sources described it.
#[derive(Clone, Debug)]
pub struct Member {
    pub spec: WorkerSpec,
    /// Where it came from: `config`, `api`, `dns`, `nats`, `kubernetes`, `file`.
    pub source: String,
    /// Leaving: no new decision, its requests finish.
    pub draining: bool,
}

/// Every member, in the order of their ids.
pub type Members = Arc<[Member]>;

#[derive(Debug, Default)]
struct Table {
    members: BTreeMap<WorkerId, Member>,
    tasks: BTreeMap<WorkerId, Vec<AbortHandle>>,
    plane: Option<EventPlane>,
    stopped: bool,
}

/// The membership table (see the module docs).
#[derive(Debug)]
pub struct Roster {
    table: Mutex<Table>,
    published: watch::Sender<Members>,
    /// A front door probes the parity of workers with events: one joining is a candidate only
    /// once its probe was made.
    probed: AtomicBool,
}

impl Default for Roster {
    fn default() -> Self {
        Self {
            table: Mutex::default(),
            published: watch::Sender::new(Arc::from([])),
            probed: AtomicBool::new(false),
        }
    }
}

impl Roster {
    /// A front door probes every worker's parity from now on (set by the front door that
    /// embeds this router).
    pub fn set_probed(&self) {
        self.probed.store(true, Ordering::Relaxed);
    }

    /// Whether a joining worker waits for its parity probe.
    pub fn probed(&self) -> bool {
        self.probed.load(Ordering::Relaxed)
    }

    /// Every member now.
    pub fn members(&self) -> Members {
        self.published.borrow().clone()
    }

    /// Follows the membership: the receiver sees every change, the newest first.
    pub fn subscribe(&self) -> watch::Receiver<Members> {
        self.published.subscribe()
    }

    /// A member's description.
    pub fn get(&self, worker: WorkerId) -> Option<Member> {
        lock(&self.table).members.get(&worker).cloned()
    }

    /// How many members there are (draining ones included).
    pub fn len(&self) -> usize {
        lock(&self.table).members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The members a source brought.
    pub fn of_source(&self, source: &str) -> Vec<Member> {
        lock(&self.table).members.values().filter(|m| m.source == source).cloned().collect()
    }

    pub(super) fn insert(&self, spec: &WorkerSpec, source: &str) {
        let member = Member { spec: spec.clone(), source: source.to_owned(), draining: false };
        self.change(|t| {
            t.members.insert(spec.id, member);
        });
    }

    pub(super) fn set_draining(&self, worker: WorkerId) {
        self.change(|t| {
            if let Some(m) = t.members.get_mut(&worker) {
                m.draining = true;
            }
        });
    }

    /// Takes a member out, stopping its tasks.
    pub(super) fn remove(&self, worker: WorkerId) {
        self.change(|t| {
            t.members.remove(&worker);
            for task in t.tasks.remove(&worker).unwrap_or_default() {
                task.abort();
            }
        });
    }

    /// Records the tasks that follow a member; stops them at once when it is gone already
    /// (or the roster stopped).
    pub fn attach(&self, worker: WorkerId, tasks: Vec<AbortHandle>) {
        let mut t = lock(&self.table);
        if t.stopped || !t.members.contains_key(&worker) {
            tasks.iter().for_each(AbortHandle::abort);
            return;
        }
        t.tasks.entry(worker).or_default().extend(tasks);
    }

    /// The event plane the members' subscriptions run on, started on first use.
    pub(crate) fn plane(&self) -> std::io::Result<EventPlane> {
        let mut t = lock(&self.table);
        if let Some(plane) = &t.plane {
            return Ok(plane.clone());
        }
        let plane = EventPlane::start()?;
        t.plane = Some(plane.clone());
        Ok(plane)
    }

    /// Stops every member's tasks (the router is stopping); nothing attached later runs.
    pub fn stop(&self) {
        let mut t = lock(&self.table);
        t.stopped = true;
        for task in std::mem::take(&mut t.tasks).into_values().flatten() {
            task.abort();
        }
        t.plane = None;
    }

    fn change(&self, f: impl FnOnce(&mut Table)) {
        let mut t = lock(&self.table);
        f(&mut t);
        let members: Members = t.members.values().cloned().collect();
        // Published under the lock, so two changes reach the followers in their order.
        self.published.send_replace(members);
    }
}
