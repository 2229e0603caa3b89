//! `kvroute bench --churn` (docs/bench/membership.md): the fleet changes while the default
//! shared-prefix schedule runs at 12 requests/s, through one source of members (the admin API,
//! DNS, a NATS bucket), through the front door or a gateway's picker: a scale-out from 2 to
//! 4 workers and a scale-in to 3, or a rolling restart of 4 (each replaced by one at a new
//! address). It reports failed requests, how soon a newcomer gets decisions once ready, what
//! a draining worker was still given, whether a removed worker left nothing behind, and the
//! hit rate through it (a plot).

mod fake_api;
mod figures;
mod fleet;
mod plan;
mod play;

pub use figures::{ChangeFigures, ChurnRun, JoinFigures, LeaveFigures};
pub use plan::{Change, ChurnPlan, ChurnSource, ChurnVia, Plan};
pub use play::bench;
