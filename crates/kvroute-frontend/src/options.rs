//! The front door's own settings.

use std::time::Duration;

use kvroute_http::auth::KeyId;

use crate::names::*;

/// The front door's own settings (its model, router, workers and keys are given apart): a
/// new front-door setting is a field here, its flag and its settings key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FrontDoorOptions {
    /// Answers carry [`OVERLAP_HEADER`] (off by default: it tells a client what others sent).
    pub expose_overlap: bool,
    /// A request that asks with [`crate::EXPLAIN_HEADER`] is answered with its decision in
    /// [`crate::DECISION_HEADER`] (off by default: it shows the other workers' caches).
    pub explain_decisions: bool,
    /// How long a worker has to start a streamed answer.
    pub first_byte_timeout: Duration,
    /// Each API key its own cache namespace: requests reuse cached prefixes only of requests
    /// with the same key, so one client cannot learn from `cached_tokens` (or timing) what
    /// another sent. The namespace goes to the engine as vLLM's `cache_salt` (a client's own
    /// salt is kept inside the key's) and into the router's block hashes.
    pub namespace_per_key: bool,
    /// Probe each joining worker's parity ([`crate::parity`]).
    pub parity_probe: bool,
    /// Load a request's adapter on the chosen worker through vLLM's dynamic API when the
    /// worker does not list it ([`crate::models`]); off: only workers that list it are chosen.
    pub load_adapters: bool,
    /// Pass a client's own KV-transfer fields ([`crate::TRANSFER_FIELDS`]) on; off: refused (400).
    pub trust_transfer_fields: bool,
    /// Tell the engines each request's priority in their own field (they schedule by it).
    pub engine_priority: bool,
    /// How long a stream's worker may send nothing once it has begun before it is taken for
    /// broken (ejected, the stream moved on): an engine stopped, or its node gone without a
    /// reset.
    pub inter_token_timeout: Duration,
    /// How many times one stream may move to another worker when its worker breaks it off
    /// after its first bytes ([`crate::migrate`]); 0: never (the stream ends with an error
    /// event). One by default: two engines dying under one request in a row more likely
    /// means the request kills them (a context that runs it out of memory) than bad luck, and
    /// a third would be taken down too.
    pub max_migrations: u32,
    /// How often the status page's history samples the counters
    /// ([`kvroute_http::status::History`]).
    pub status_every: Duration,
}

/// [`crate::FrontendState::session_key`]: `per_key` is whether namespacing per key is on.
pub(crate) fn namespaced_session(
    per_key: bool,
    key: Option<&KeyId>,
    session: Option<String>,
) -> Option<String> {
    let session = session?;
    match (per_key, key) {
        (true, Some(KeyId { id: key, .. })) => {
            let mut h = blake3::Hasher::new();
            h.update(key.as_bytes()).update(b"\0").update(session.as_bytes());
            Some(format!("key-{}", &h.finalize().to_hex()[..32]))
        }
        _ => Some(session),
    }
}

impl Default for FrontDoorOptions {
    fn default() -> Self {
        Self {
            expose_overlap: false,
            explain_decisions: false,
            first_byte_timeout: FIRST_BYTE_TIMEOUT,
            namespace_per_key: false,
            parity_probe: true,
            load_adapters: false,
            trust_transfer_fields: false,
            engine_priority: false,
            max_migrations: 1,
            inter_token_timeout: INTER_TOKEN_TIMEOUT,
            status_every: kvroute_http::status::SAMPLE_EVERY,
        }
    }
}
