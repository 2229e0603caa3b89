//! The label sets of the router's metrics.

use kvroute_core::WorkerWithDpRank;
use kvroute_http::metrics::EncodeLabelSet;

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct EventLabels {
    pub kind: &'static str,
    /// `ok`, or `error` when the index refused the event.
    pub status: &'static str,
}

/// What session affinity did with a request, a label of `SESSION_REQUESTS`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct AffinityLabels {
    pub affinity: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SocketLabels {
    pub socket: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct WorkerLabels {
    pub worker_id: u64,
    pub dp_rank: u32,
}

impl From<WorkerWithDpRank> for WorkerLabels {
    fn from(w: WorkerWithDpRank) -> Self {
        Self { worker_id: w.worker_id.0, dp_rank: w.dp_rank.0 }
    }
}

/// Where a worker's blocks come from, a label of `WORKER_BLOCKS`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct BlocksLabels {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub mode: &'static str,
}

/// A worker rank and a tier below its device, a label of `WORKER_TIER_BLOCKS`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TierLabels {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub tier: &'static str,
}

/// What conversion did with an engine's blocks, a label of `CONVERTED`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ConvertLabels {
    pub worker_id: u64,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct WorkerIdLabels {
    pub worker_id: u64,
}

/// A prediction's outcome, a label of `PREDICTIONS`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PredictionLabels {
    pub worker_id: u64,
    /// `exact`, `over` (predicted more than served) or `under`.
    pub outcome: &'static str,
}

/// An answer predicted to load from a lower tier, a label of `TIER_PREDICTIONS`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TierPredictionLabels {
    pub worker_id: u64,
    /// `host`, `disk` or `external` (the shared store).
    pub tier: &'static str,
    pub outcome: &'static str,
}

/// Tokens predicted from a lower tier, a label of `TIER_TOKENS`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TierTokenLabels {
    pub worker_id: u64,
    pub tier: &'static str,
}

/// Every value of a prediction's `outcome` label.
pub const PREDICTION_OUTCOMES: [&str; 3] = ["exact", "over", "under"];

/// A membership change, a label of `MEMBERSHIP`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct MemberLabels {
    /// The source that asked it (`config`, `api`, `dns`, `nats`, ...).
    pub source: String,
    /// `joined`, `drained`, `removed` or `refused`.
    pub change: &'static str,
}
