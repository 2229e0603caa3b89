//! The routing policies by name: what `--policy` takes.

use crate::schedule::policy::Policy;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::cost::KvConfig;
use super::least_loaded::LeastLoaded;
use super::predict::EngineModel;
use super::random::RandomPolicy;
use super::round_robin::RoundRobin;
use super::{adapters, dynamo, kv, kv_tokens};

/// A policy by name, as on the command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyKind {
    #[default]
    Kv,
    /// The cost before predicted milliseconds, in tokens of prefill work (a baseline).
    KvTokens,
    Dynamo,
    RoundRobin,
    Random,
    LeastLoaded,
    /// `kv`, and a session's later requests always on its worker (a baseline).
    Sticky,
    /// `kv` blind to adapter residency (a baseline).
    KvAdapterBlind,
    /// Adapter residency alone, scored as llm-d's LoRA affinity scores it (a baseline).
    LoraAffinity,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 9] = [
        Self::Kv,
        Self::KvTokens,
        Self::Dynamo,
        Self::RoundRobin,
        Self::Random,
        Self::LeastLoaded,
        Self::Sticky,
        Self::KvAdapterBlind,
        Self::LoraAffinity,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::KvTokens => "kv-tokens",
            Self::Dynamo => "dynamo",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
            Self::LeastLoaded => "least-loaded",
            Self::Sticky => "sticky",
            Self::KvAdapterBlind => "kv-adapter-blind",
            Self::LoraAffinity => "lora-affinity",
        }
    }

    pub fn build(self, kv: KvConfig, engine: EngineModel) -> Box<dyn Policy> {
        match self {
            Self::Kv => Box::new(kv::KvPolicy::new(kv, engine)),
            Self::KvTokens => Box::new(kv_tokens::KvTokensPolicy::new(kv)),
            Self::Sticky => Box::new(kv_tokens::KvTokensPolicy::new(kv).named("sticky")),
            Self::KvAdapterBlind => Box::new(kv_tokens::KvTokensPolicy::new(kv).adapter_blind()),
            Self::LoraAffinity => Box::new(adapters::LoraAffinity),
            Self::Dynamo => Box::new(dynamo::DynamoPolicy),
            Self::RoundRobin => Box::new(RoundRobin::default()),
            Self::Random => Box::new(RandomPolicy),
            Self::LeastLoaded => Box::new(LeastLoaded),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| crate::Error::UnknownPolicy(s.to_owned()))
    }
}
