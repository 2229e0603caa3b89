//! The HTTP paths kvroute serves and calls, named once: the OpenAI routes, the engines' and
//! services' health and metrics. The router API's own are in [`crate::router_api`], the
//! engines' generate APIs in [`crate::vllm_generate`] and [`crate::sglang_generate`].

pub const CHAT_COMPLETIONS: &str = "/v1/chat/completions";
pub const COMPLETIONS: &str = "/v1/completions";
pub const MODELS: &str = "/v1/models";
pub const HEALTH: &str = "/health";
pub const METRICS: &str = "/metrics";
