//! The workloads `kvroute bench` knows, by name.

use serde::Serialize;

/// The workloads `kvroute bench` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    SharedPrefix,
    MultiTurn,
    Multimodal,
    Random,
    /// A recorded trace replayed ([`super::trace::TraceReplay`]).
    Trace,
    /// Requests for many LoRA adapters of Zipf popularity ([`super::lora::MultiLora`]).
    MultiLora,
    /// `multi-turn` with each user's requests tagged as a session (`prompt_cache_key`).
    Sessions,
    /// Long prompts (a shared document, then a long unique part) and long answers: where
    /// prefills stall decodes, so where disaggregation should matter ([`super::synthetic::LongPrompts`]).
    LongPrompt,
    /// Classes and tenants past the fleet's capacity (`--overload`, [`crate::overload`]); not
    /// one of `--workloads`.
    Overload,
}

impl WorkloadKind {
    pub const ALL: [Self; 8] = [
        Self::SharedPrefix,
        Self::MultiTurn,
        Self::Multimodal,
        Self::Random,
        Self::Trace,
        Self::MultiLora,
        Self::Sessions,
        Self::LongPrompt,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::SharedPrefix => "shared-prefix",
            Self::MultiTurn => "multi-turn",
            Self::Multimodal => "multimodal",
            Self::Random => "random",
            Self::Trace => "trace",
            Self::MultiLora => "multi-lora",
            Self::Sessions => "sessions",
            Self::LongPrompt => "long-prompt",
            Self::Overload => "overload",
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WorkloadKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            format!(
                "unknown workload {s:?} (shared-prefix, multi-turn, multimodal, random, trace, multi-lora, sessions, long-prompt)"
            )
        })
    }
}
