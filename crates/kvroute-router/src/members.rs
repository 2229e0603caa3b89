//! Membership while the router runs: workers join, drain and leave through one path
//! ([`join`], [`drain`], [`remove`]), which every source of members uses: the configuration,
//! the router API, DNS, a NATS key-value bucket, Kubernetes, a gateway pool's listed addresses
//! (docs/membership.md).
//!
//! ```text
//!  source (a Source: DNS, NATS, a file...) ──offer(whole set)──▶ Sink ──┐
//!  router API (POST/DELETE /admin/workers) ─────────────────────────────┼─▶ join / drain / remove
//!                                                                       ▼
//!   RouterState::change_member (every owner, in the lock order) + the member's tasks
//!   (event subscriptions on the event plane, load reader), kept in the Roster
//! ```
//!
//! A joining worker is a candidate once ready (its events connected and caught up, its first
//! load report, its parity probe when a front door probes), and the predictor prices it at
//! the fleet's mean until it learns it. A draining worker gets no new decision; once its
//! in-flight requests end (or `drain_timeout` passes) it is removed: its tasks stop, its blocks
//! leave the index, its in-flight accounting, corrections, adapters, sessions and metric label
//! sets go. A source offers its whole set each time; what it no longer lists drains. A member
//! belongs to the source that brought it: another source never drains it.

pub mod api;
mod bucket;
mod change;
mod dns;
mod listed;
pub mod signed;
mod source;
mod template;

pub use bucket::{BucketConfig, BucketError, BucketSource, MEMBERS_TTL, parse_entry, register};
pub(crate) use change::start_tasks;
pub use change::{DRAIN_TIMEOUT, JoinError, drain, join, remove};
pub use dns::{DNS_EVERY, DnsConfig, DnsError, DnsSource};
pub use listed::{ListedSource, Listing, listed};
pub use signed::{AddressRange, MAX_ENTRY_BYTES, MembersKey, RegistrationError, Verifier};
pub use source::{MAX_MEMBERS_PER_SOURCE, Offered, Sink, Source, spawn_source};
pub use template::{Template, TemplateError, id_for};
