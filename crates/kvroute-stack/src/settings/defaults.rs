//! The defaults every command starts from, and the environment variables that hold secrets.

use super::invalid::Invalid;

pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_READY_TIMEOUT_SECS: f64 = 10.0;
pub const DEFAULT_SIMULATED_WORKERS: usize = 4;
/// The ports the commands listen on by default.
pub const DEFAULT_FRONT_DOOR_PORT: u16 = 8000;
pub const DEFAULT_ROUTER_PORT: u16 = 8001;
pub const DEFAULT_MOCKER_PORT: u16 = 8100;

/// Environment variables holding secrets themselves (flags and files name files instead, so
/// no key shows in `ps` or `--print-config`).
pub const ENV_API_KEYS: &str = "KVROUTE_API_KEYS";
pub const ENV_ADMIN_TOKEN: &str = "KVROUTE_ADMIN_TOKEN";
/// The fleet's registration key, when not in `--members-key-file`.
pub const ENV_MEMBERS_KEY: &str = "KVROUTE_MEMBERS_KEY";
pub const ENV_TENANT_SALT: &str = "KVROUTE_TENANT_SALT";
pub const ENV_EXT_PROC_TOKEN: &str = "KVROUTE_EXT_PROC_TOKEN";
pub const ENV_ROUTER_TOKEN: &str = "KVROUTE_ROUTER_TOKEN";
pub const ENV_NATS_TOKEN: &str = "KVROUTE_NATS_TOKEN";
pub const ENV_NATS_PASSWORD: &str = "KVROUTE_NATS_PASSWORD";
/// The secret a fleet's simulated engines share: a prefill engine's side channel and the
/// shared store answer only calls that carry it (docs/security.md).
pub const ENV_KV_PEER_TOKEN: &str = "KVROUTE_KV_PEER_TOKEN";

/// The fleet's token from [`ENV_KV_PEER_TOKEN`] (`None` when unset or empty); one that is not
/// 16 to 256 visible ASCII characters is refused.
pub fn kv_peer_token() -> Result<Option<String>, Invalid> {
    let Some(token) = std::env::var(ENV_KV_PEER_TOKEN).ok().filter(|t| !t.trim().is_empty()) else {
        return Ok(None);
    };
    let token = token.trim().to_owned();
    let ok = (16..=256).contains(&token.len()) && token.bytes().all(|b| b.is_ascii_graphic());
    ok.then_some(Some(token)).ok_or(Invalid::PeerToken)
}
/// Share of new traces sampled when spans are exported (`--trace-ratio`).
pub const DEFAULT_TRACE_RATIO: f64 = 0.1;
/// Share of decisions the decision log keeps (`--decision-log-ratio`).
pub const DEFAULT_DECISION_LOG_RATIO: f64 = 0.01;
