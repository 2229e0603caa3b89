//! kvroute's OpenAI-compatible front door, as stages, each in its own module:
//!
//! ```text
//!  client ─▶ auth + limits (kvroute_http: listener bounds, `auth::require`)
//!         ─▶ parse + check (handlers::parse: typed fields, sizes as the engine checks them)
//!         ─▶ preprocess (kvroute_preprocess: images fetched/decoded, chat template, tokens)
//!         ─▶ Outbound (hop.rs: block hashes with images and namespace, the body to send)
//!         ─▶ place (decider.rs: embedded router or a remote one → Placement, in flight from now)
//!         ─▶ dispatch (dispatch.rs over attempts.rs: one hop, retries and ejection, the answer streamed back
//!            with its cached tokens read on the way, usage.rs; end or client gone = freed)
//!  the health tick (probes.rs): /health of every worker, parity probes of joining ones
//! ```
//!
//! The request body is passed on as the client sent it (fields kvroute does not read
//! included), but for image parts, which are inlined. A worker that refuses the connection, or
//! sends nothing back within the first-byte timeout, is skipped for another and ejected for a
//! while ([`health`]); one that breaks a stream mid-answer ends it with an SSE error event in
//! OpenAI's shape. A refused connection means the engine process is gone, and its cache with
//! it: the embedded router forgets its blocks. The journey, file by file, is in
//! `docs/architecture.md`.

mod adapters;
mod app;
mod attempts;
mod decider;
mod dialect;
mod dispatch;
mod fleet_seam;
mod handlers;
pub mod health;
mod hop;
mod metrics;
mod migrate;
mod models;
mod names;
pub mod native;
mod observer;
mod options;
mod outbound;
mod pair;
pub mod parity;
mod parity_probes;
pub mod pick;
mod probes;
mod roster;
mod state;
pub mod transfer;
mod translate;
mod usage;
pub use app::{app, serve};
pub use decider::{Decider, Placement, RemoteRouter};
pub use names::*;
pub use options::FrontDoorOptions;
pub use state::FrontendState;
pub use transfer::TRANSFER_FIELDS;
