//! The one request to place and the one decision, as every caller gives and takes them: the
//! front door (embedded router), the gateway's picker, the router's HTTP API and the tests.
//! Each converts to these once, at its edge; the scheduler's borrowed [`RouteRequest`] is
//! made from a [`PlaceRequest`] where it is routed.

use std::sync::Arc;

use kvroute_core::schedule::flow::RequestClass;
use kvroute_core::schedule::{PairDecision, RouteRequest};
use kvroute_core::{LocalBlockHash, SequenceHash, WorkerWithDpRank};

/// A request to place. Owned, since it may wait in flow control's queue; its block hashes
/// are shared, so waiting or being placed again (another worker, after one failed it) copies
/// none of them.
#[derive(Clone, Debug, Default)]
pub struct PlaceRequest {
    /// Tracked in flight under this id until it is finished; `None`: a question only, nothing
    /// tracked (and not through flow control).
    pub id: Option<String>,
    pub local_hashes: Arc<[LocalBlockHash]>,
    pub num_tokens: usize,
    /// Tokens its answer may run to (`max_tokens`; 0 when unknown).
    pub output_tokens: usize,
    /// Its LoRA adapter, if any (its hashes are salted with it already).
    pub adapter: Option<String>,
    /// Its session (`prompt_cache_key` or `x-session-id`), if any.
    pub session: Option<String>,
    /// Caches not to choose.
    pub exclude: Vec<WorkerWithDpRank>,
    pub overlap_weight: Option<f64>,
    pub temperature: Option<f64>,
    /// Its class for flow control (when it is on); `None`: placed at once, as a request
    /// placed again after a worker failed it (admitted already).
    pub class: Option<RequestClass>,
    /// The caller's trace context: the replicas hear of the decision in it.
    pub trace: Option<kvroute_http::trace::TraceContext>,
}

impl PlaceRequest {
    /// The scheduler's view of it, with its chained hashes (empty when untracked).
    pub(crate) fn route<'a>(&'a self, sequence: &'a [SequenceHash]) -> RouteRequest<'a> {
        RouteRequest {
            id: self.id.as_deref(),
            isl_tokens: self.num_tokens,
            local_hashes: &self.local_hashes,
            sequence_hashes: sequence,
            overlap_weight: self.overlap_weight,
            temperature: self.temperature,
            exclude: &self.exclude,
            adapter: self.adapter.as_deref(),
            session: self.session.as_deref(),
            output_tokens: self.output_tokens,
        }
    }

    /// Bytes it holds while it waits.
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.id.as_ref().map_or(0, String::len)
            + self.local_hashes.len() * std::mem::size_of::<LocalBlockHash>()
            + self.exclude.len() * std::mem::size_of::<WorkerWithDpRank>()
            + self.adapter.as_ref().map_or(0, String::len)
            + self.session.as_ref().map_or(0, String::len)
    }
}

/// Where a request goes: its worker (`decode`), and in a disaggregated fleet the prefill leg
/// before it (`None`: prefilled where it decodes).
pub type Decision = PairDecision;
