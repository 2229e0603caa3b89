//! An engine's part in disaggregated prefill and decode, as the engine core sees it: its role,
//! the link it pulls over, and each request's part ([`Handoff`]). The protocols that carry the
//! legs and the side channel a decode engine pulls over are the HTTP app's
//! ([`crate::handoff`]); nothing here speaks HTTP, so the engine core stands without it.

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What an engine does in a disaggregated fleet (`--role`): the router's roles.
pub use kvroute_core::schedule::Role;

/// What a decode engine's pull moves (Dynamo's mocker's `kv_transfer_timing_mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TransferTiming {
    /// The blocks the decode engine lacks, as vLLM's connector pulls them (kvroute's default).
    #[default]
    DestinationMissing,
    /// The whole prompt (Dynamo's mocker's default), for timing parity with it.
    FullPrompt,
}

impl FromStr for TransferTiming {
    type Err = kvroute_core::UnknownChoice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "destination-missing" => Ok(Self::DestinationMissing),
            "full-prompt" => Ok(Self::FullPrompt),
            _ => Err(kvroute_core::UnknownChoice::new(
                "transfer timing",
                s,
                "destination-missing, full-prompt",
            )),
        }
    }
}

/// What a decode engine does when its pull fails (vLLM's `kv_load_failure_policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LoadFailurePolicy {
    /// The request fails with a 500 (vLLM 0.33's default; SGLang's only behaviour).
    #[default]
    Fail,
    /// The decode engine prefills the prompt itself.
    Recompute,
}

impl FromStr for LoadFailurePolicy {
    type Err = kvroute_core::UnknownChoice;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fail" => Ok(Self::Fail),
            "recompute" => Ok(Self::Recompute),
            _ => Err(kvroute_core::UnknownChoice::new(
                "KV load failure policy",
                s,
                "fail, recompute",
            )),
        }
    }
}

/// An engine's part in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DisaggConfig {
    pub role: Role,
    /// The link's bandwidth to a decode engine (GB/s, decimal; Dynamo's
    /// `--kv-transfer-bandwidth`): within the engine's node, when nodes are labelled.
    pub kv_transfer_bandwidth_gbps: f64,
    /// The link's bandwidth between engines of different nodes (`None`: the same as within).
    pub kv_transfer_bandwidth_across_nodes_gbps: Option<f64>,
    /// The engine's node (`--node`, as [`kvroute_core::schedule::pairs::node_id`] hashes a
    /// label; 0: unlabelled): a pull from a prefill engine of another node takes the
    /// across-nodes link.
    pub node: u32,
    pub timing: TransferTiming,
    /// A finished prefill's blocks are freed this long after its end if nobody pulls them
    /// (vLLM's `kv_lease_duration`, 30 s).
    pub hold_timeout: Duration,
    /// A failed pull fails the request or is recomputed (vLLM's protocol only).
    pub load_failure: LoadFailurePolicy,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            role: Role::Both,
            kv_transfer_bandwidth_gbps: 25.0,
            kv_transfer_bandwidth_across_nodes_gbps: None,
            node: 0,
            timing: TransferTiming::DestinationMissing,
            hold_timeout: Duration::from_secs(30),
            load_failure: LoadFailurePolicy::Fail,
        }
    }
}

impl DisaggConfig {
    /// The bandwidth of the link from a prefill engine on `node` (GB/s).
    pub fn link_gbps(&self, node: u32) -> f64 {
        match (node == self.node, self.kv_transfer_bandwidth_across_nodes_gbps) {
            (false, Some(across)) => across,
            _ => self.kv_transfer_bandwidth_gbps,
        }
    }
}

/// A request's part in a disaggregated request, inside the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Handoff {
    #[default]
    None,
    /// A prefill for a decode engine: its blocks are held when it ends.
    Hold,
    /// A decode whose prompt KV came from a prefill engine.
    Remote,
}

/// A key cut for a log line or an error (at most 64 characters shown).
pub(crate) fn shown(key: &str) -> String {
    let mut cut: String = key.chars().take(64).collect();
    if cut.len() < key.len() {
        cut.push_str("...");
    }
    cut
}
