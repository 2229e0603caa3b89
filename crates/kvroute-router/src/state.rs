//! The router's shared state: the KV index, the scheduler, approximate mode, worker status
//! (with readiness) and metrics.
//!
//! A worker rank is **ready** when its event stream is connected and its replay has caught up
//! (workers without `events` need none), and, for a worker with `metrics`, a first load report
//! has arrived. A rank that is not ready is routed to only when no ready one is left, so the
//! first requests after start-up, or after an engine went away, do not land on a cache the
//! router cannot see.
//!
//! **Owners below verbs.** The state is split by owner, each a type with its own lock and
//! methods that touch only its own state: [`Fleet`], the worker registry and health
//! (`fleet.rs`); [`Scheduling`], the scheduler, in-flight accounting and approximate mode
//! (`scheduling.rs`); [`SelfChecks`], predictions against answers (`self_checks.rs`); [`Flow`],
//! flow control's queues (`flow.rs`); [`Roster`], the membership as its sources and the front
//! door see it, with each member's tasks (`roster.rs`); and the KV index, whose shards lock themselves.
//! [`RouterState`] (`composite.rs`) holds them. Its methods, the verbs, are the only code that
//! crosses owners, each written once:
//! - **decide** (`decide.rs`): a [`PlaceRequest`] becomes a [`Decision`] (one worker or a
//!   prefill and decode pair) or a [`Refusal`], through flow control when it is on; then its
//!   first token, its end, load reports, and the release of waiting requests;
//! - **ingest** (`ingest.rs`): KV events into the index (a subscription's [`Ingest`] handle,
//!   posted events, approximate mode's expiry);
//! - **observe** (`observe.rs`): health, statuses, metrics at scrape time, answers against
//!   predictions;
//! - **membership** (`workers.rs`): workers joining, draining and leaving
//!   ([`MemberChange`]), parity probes, engines gone, event links.
//!
//! No owner names another's lock or the composite, and the owners' files name no verb's:
//! the arrows run from the verbs down to the owners. Replica sync lives in [`crate::nats`]
//! and [`crate::stream`], which reach the core through [`NatsLinks`](crate::links::NatsLinks).
//!
//! **Lock order.** No owner takes another's lock. Two are held at once only in this order:
//! `scheduling.approx` → the fleet's registry (a worker leaving or entering approximate mode,
//! so no assumed block is applied across the change); `scheduling.approx` → an index shard
//! (assumed blocks applied); `scheduling.scheduler` → an index shard (the scheduler reads the
//! index while it routes); the index's hybrid `groups` → a shard (a hybrid event); `flow`'s
//! queues → `scheduling`'s locks (a request placed as it leaves the queue, [`queues`]). The index's
//! shard locks are leaves. Everything else is an atomic.

mod composite;
mod decide;
mod decision_log;
mod fleet;
mod ingest;
mod lock;
mod observe;
mod queues;
mod request;
mod roster;
mod scheduling;
mod self_checks;
mod status;
mod view;
mod workers;

pub use composite::RouterState;
pub use decision_log::{DecisionLog, decision_of};
pub use fleet::{Fleet, Link, RankRefused};
pub use ingest::Ingest;
pub(crate) use queues::Reported;
pub use queues::{Flow, Refusal};
pub use request::{Decision, PlaceRequest};
pub use roster::{Member, Members, Roster};
pub(crate) use scheduling::PeerRouted;
pub use scheduling::Scheduling;
pub use self_checks::SelfChecks;
pub use status::{CacheMode, Parity, WorkerStatus};
pub use view::View;
pub use workers::MemberChange;
