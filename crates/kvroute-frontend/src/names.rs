//! The front door's headers, metric names and time limits.

use std::time::Duration;

/// Longest wait between two tries of a parity probe that could not be made.
pub const PROBE_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Largest request body accepted: room for inline images (20 MB each once decoded, a third
/// more as base64).
pub const BODY_LIMIT: usize = 64 << 20;

/// Header naming the worker a response came from.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// The header that names a request's priority for flow control (higher first; below 0 it
/// is sheddable).
pub const PRIORITY_HEADER: &str = "x-kvroute-priority";
/// The header that names a request's tenant, when no API key does.
pub const TENANT_HEADER: &str = "x-kvroute-tenant";
/// The header that names a request's time-to-first-token objective, ms.
pub const SLO_HEADER: &str = "x-kvroute-ttft-slo-ms";

/// Header naming the worker that prefilled a response's prompt, when another one decoded it
/// (its cached tokens then count the KV pulled from there).
pub const PREFILL_WORKER_HEADER: &str = "x-kvroute-prefill-worker";

/// Header with the prompt tokens the router expected the chosen worker to serve from its cache
/// (its leading blocks held by the worker's KV events, in tokens, less the last block of a
/// fully cached prompt, which engines recompute): compare with the response's
/// `usage.prompt_tokens_details.cached_tokens` to see how exact the router's view is. Sent
/// only when asked for ([`crate::FrontDoorOptions::expose_overlap`]): it tells a client how much of its
/// prompt someone sent before, so clients could probe each other's prompts with it.
pub const OVERLAP_HEADER: &str = "x-kvroute-overlap-tokens";

/// A request header asking for the request's routing decision (`true` or `1`), answered in
/// [`DECISION_HEADER`] when the front door explains decisions
/// ([`crate::FrontDoorOptions::explain_decisions`]).
pub const EXPLAIN_HEADER: &str = "x-kvroute-explain";
/// The admin token beside an OpenAI request (whose `Authorization` holds the client's API
/// key): what [`EXPLAIN_HEADER`] needs.
pub const ADMIN_TOKEN_HEADER: &str = "x-kvroute-admin-token";

/// The request's decision as compact JSON: the candidates considered, and the chosen one
/// first, then the cheapest others, each with its cached blocks, running requests, cost and
/// (for `kv`) the cost's terms in ms.
pub const DECISION_HEADER: &str = "x-kvroute-decision";

/// Beside [`OVERLAP_HEADER`]: of those tokens, the ones expected from host memory, disk and
/// the shared store, comma-separated (`0,0,0` when all come from the GPU).
pub const OVERLAP_TIER_HEADER: &str = "x-kvroute-overlap-tier-tokens";

pub const PROXIED: &str = "kvroute_frontend_proxied";
pub const RETRIES: &str = "kvroute_frontend_retries";
pub const IN_FLIGHT: &str = "kvroute_frontend_in_flight";
pub const EJECTIONS: &str = "kvroute_frontend_worker_ejections";
pub const EJECTED: &str = "kvroute_frontend_workers_ejected";
pub const BROKEN_STREAMS: &str = "kvroute_frontend_broken_streams";
pub const AS_TOKENS: &str = "kvroute_frontend_sent_as_tokens";
pub const DIALECT_FALLBACKS: &str = "kvroute_frontend_dialect_fallbacks";

/// How long a worker has to send a streamed answer's first bytes (its headers), and a whole
/// answer that is not streamed.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a begun stream may go without a token before its worker is taken for broken:
/// far past an engine's step (well under a second at full batch) or a preempted request's
/// wait for memory, short enough that a stopped engine's clients hear from another worker.
pub const INTER_TOKEN_TIMEOUT: Duration = Duration::from_secs(30);
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(600);

pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often each worker's `/health` is checked.
pub const HEALTH_INTERVAL: Duration = Duration::from_secs(1);
