//! Choosing a worker for a request.
//!
//! ```text
//!  request (isl tokens, block hashes) ──┐
//!  OverlapScores from the KV index ─────┼─▶ Scheduler::route ─▶ one Candidate per cache ─▶ Policy
//!  in-flight requests (ActiveSequences) ┤      (busy caches dropped unless all are busy)    │
//!  load metrics from workers ───────────┘                                                   ▼
//!                                                      RouteDecision { worker, overlap, .. }
//! ```
//!
//! Policies (one file each, behind [`Policy`]):
//! - `kv` (default, [`kv`]): lowest predicted time to first token in milliseconds of the
//!   engine model ([`predict`]), plus what the choice costs the requests running there and the
//!   hits it evicts;
//! - `kv-tokens` ([`kv`]): the earlier cost, in tokens of prefill work with weights, with a
//!   price on duplicating a prefix away from the worker that holds it;
//! - `dynamo` ([`dynamo`]): Dynamo's cost, `weight * prefill_blocks + decode_blocks`, exactly;
//! - `round-robin`, `random`, `least-loaded` (power of two choices on in-flight tokens):
//!   baselines for benchmarks.
//!
//! In-flight accounting starts when a request is routed ([`Scheduler::route`] with an id),
//! prefill ends at its first token ([`Scheduler::mark_prefill_done`], which also corrects the
//! predictions for its worker and measures their error) and everything is released at its end
//! ([`Scheduler::free`]); requests whose end never comes are reclaimed after a timeout.

mod active;
pub mod adapters;
mod config;
pub mod cost;
pub mod dynamo;
pub mod flow;
pub mod kv;
pub mod kv_tokens;
mod least_loaded;
pub mod pairs;
mod policy;
pub mod predict;
mod random;
mod registry;
pub mod reuse;
mod round_robin;
mod route_pair;
mod scheduler;
pub mod sessions;
pub mod shape;
#[cfg(test)]
mod tests;
mod types;

pub use active::{ActiveLoad, ActiveSequences, FirstToken, Predicted, RequestBlocks};
pub use adapters::{AdapterFit, AdapterTable};
pub use config::{PredictorConfig, SchedulerConfig};
pub use least_loaded::LeastLoaded;
pub use pairs::{PairConfig, PairDecision, Role};
pub use policy::{Policy, pick_by_cost, pick_near};
pub use random::RandomPolicy;
pub use registry::PolicyKind;
pub use round_robin::RoundRobin;
pub use scheduler::Scheduler;
pub use sessions::{SessionConfig, Sessions};
pub use types::{
    AffinityCounts, Candidate, CostTerms, DecisionRecord, RECENT_DECISIONS, RECORDED_CANDIDATES,
    RequestInfo, Rng, RouteDecision, RouteRequest, ScoredCandidate, TreeSizes, UnknownTreeSizes,
    WorkerLoad, reusable_by_tier, reusable_tokens,
};
