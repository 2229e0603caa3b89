//! The scheduler's settings.

use crate::schedule::registry::PolicyKind;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::cost;
use super::pairs::PairConfig;
use super::sessions::SessionConfig;
use super::{flow, predict};

use crate::protocols::BlockSize;

/// How long a placement may go unseen by its engine's load reports before it is freed: a few
/// of the engines' report intervals (a mocker reports within 100 ms, kvroute polls vLLM's
/// Prometheus gauges every second), and well under a non-streamed request's deadline.
pub(super) const DEFAULT_RECONCILE_AFTER: Duration = Duration::from_secs(5);

/// Scheduler settings; `Default` gives kvroute's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    pub policy: PolicyKind,
    pub block_size: BlockSize,
    /// Dynamo's `overlap_score_weight`: weight of prefill blocks against decode blocks.
    pub overlap_weight: f64,
    /// Softmax temperature; 0 picks the lowest cost.
    pub temperature: f64,
    /// A worker reporting more KV usage than this (0..1) is busy.
    pub busy_kv_usage: Option<f64>,
    /// A worker with more queued prefill tokens than this is busy.
    pub busy_prefill_tokens: Option<usize>,
    /// Refuse a request (no worker) when every worker is busy, as Dynamo's frontend does
    /// with its busy thresholds (503); off, the busy ones are chosen from as usual.
    pub refuse_when_busy: bool,
    /// Requests whose end is never reported are freed after this long.
    pub stale_after: Duration,
    /// How long a placement may go unseen by its engine: one routed this long ago, with no
    /// first token, on an engine whose load reports show fewer requests than kvroute holds
    /// there, is freed ([`super::active::ActiveSequences::reconcile`]).
    pub reconcile_after: Duration,
    pub seed: u64,
    pub kv: cost::KvConfig,
    /// Conversation affinity ([`super::sessions`]).
    pub sessions: SessionConfig,
    /// The pair cost of a disaggregated fleet ([`super::pairs`]).
    pub pairs: PairConfig,
    /// The engine model and its online correction ([`predict`]).
    pub predictor: PredictorConfig,
    /// Flow control: admission, queues and shedding ([`flow`]).
    pub flow: flow::FlowConfig,
}

/// The engine model the `kv` cost predicts with, and how its predictions are corrected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PredictorConfig {
    pub engine: predict::EngineModel,
    pub correction: predict::CorrectionConfig,
    /// Each worker's time to first token fitted from what it served ([`super::shape`]).
    pub shape: super::shape::ShapeConfig,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::Kv,
            block_size: BlockSize::default(),
            overlap_weight: 1.0,
            temperature: 0.0,
            busy_kv_usage: Some(0.97),
            busy_prefill_tokens: None,
            refuse_when_busy: false,
            stale_after: Duration::from_secs(600),
            reconcile_after: DEFAULT_RECONCILE_AFTER,
            seed: 0x006b_7672_6f75_7465,
            kv: cost::KvConfig::default(),
            sessions: SessionConfig::default(),
            pairs: PairConfig::default(),
            predictor: PredictorConfig::default(),
            flow: flow::FlowConfig::default(),
        }
    }
}
