//! The defaults every command starts from, and the environment variables that hold secrets.

use kvroute_core::schedule::cost::KvConfig;
use kvroute_core::schedule::{PairConfig, SchedulerConfig};
use kvroute_frontend::FrontDoorOptions;
use kvroute_mocker::EngineConfig;
use kvroute_router::RouterConfig;

use super::groups::{Engine, FrontDoor, Routing};
use super::invalid::Invalid;
use crate::Simulated;

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

impl FrontDoor {
    /// The front door's defaults: `FrontDoorOptions`'.
    pub(super) fn defaults() -> Self {
        let front_door = FrontDoorOptions::default();
        FrontDoor {
            api_keys_file: None,
            expose_overlap: Some(front_door.expose_overlap),
            explain_decisions: Some(front_door.explain_decisions),
            first_byte_timeout: Some(front_door.first_byte_timeout.as_secs_f64()),
            max_migrations: Some(front_door.max_migrations),
            inter_token_timeout: Some(front_door.inter_token_timeout.as_secs_f64()),
            cache_namespace_per_key: Some(front_door.namespace_per_key),
            parity_probe: Some(front_door.parity_probe),
            adapters: Vec::new(),
            model_priorities: Vec::new(),
            load_adapters: Some(front_door.load_adapters),
            trust_transfer_fields: Some(front_door.trust_transfer_fields),
            engine_priority: Some(front_door.engine_priority),
            status_sample_ms: Some(front_door.status_every.as_millis() as u64),
        }
    }
}

impl Engine {
    /// The simulated engine's defaults.
    pub(super) fn defaults() -> Self {
        let engine = EngineConfig::default();
        Engine {
            num_blocks: Some(engine.num_blocks),
            max_num_seqs: Some(engine.max_num_seqs),
            max_batched_tokens: Some(engine.max_batched_tokens),
            speedup: Some(engine.timing.speedup),
            seed: Some(Simulated::default().seed),
            max_model_len: None,
            chat_template: None,
            lora_modules: Vec::new(),
            max_loras: Some(engine.lora.max_loras),
            max_cpu_loras: Some(engine.lora.max_cpu_loras),
            lora_load_ms: Some(engine.lora.load.as_secs_f64() * 1e3),
            lora_swap_ms: Some(engine.lora.swap.as_secs_f64() * 1e3),
            lora_step_ms: Some(engine.lora.step_cost.as_secs_f64() * 1e3),
            lora_updating: Some(false),
            num_host_blocks: Some(engine.host.num_blocks),
            host_offload_h2d_bandwidth_gbps: Some(engine.host.h2d_gbps),
            host_offload_d2h_bandwidth_gbps: Some(engine.host.d2h_gbps),
            num_storage_blocks: Some(engine.host.storage_blocks),
            storage_bandwidth_gbps: Some(engine.host.storage_gbps),
            store_url: None,
            num_store_blocks: Some(0),
            store_bandwidth_gbps: Some(engine.host.store_gbps),
            tier_loads: Some(engine.host.loads),
            scheduling_policy: Some(engine.scheduling),
            kv_bytes_per_token: Some(engine.host.kv_bytes_per_token),
            kv_transfer_bandwidth: Some(engine.disagg.kv_transfer_bandwidth_gbps),
            kv_transfer_bandwidth_across_nodes: None,
            node: None,
            kv_transfer_timing: Some(engine.disagg.timing),
            kv_hold_timeout: Some(engine.disagg.hold_timeout.as_secs_f64()),
            kv_load_failure_policy: Some(engine.disagg.load_failure),
        }
    }
}

impl Routing {
    /// The routing group's defaults: the scheduler's, the router's and flow control's.
    pub(super) fn defaults() -> Self {
        let router = RouterConfig::default();
        let scheduler = SchedulerConfig::default();
        let kv_cost = toml::Table::try_from(KvConfig::default())
            .map(|t| t.into_iter().filter_map(|(k, v)| Some((k, v.as_float()?))).collect())
            .unwrap_or_default();
        Routing {
            workers: Vec::new(),
            policy: Some(scheduler.policy),
            temperature: Some(scheduler.temperature),
            overlap_weight: Some(scheduler.overlap_weight),
            kv_cost,
            pd_cost: toml::Table::try_from(PairConfig::default())
                .map(|t| t.into_iter().filter_map(|(k, v)| Some((k, v.as_float()?))).collect())
                .unwrap_or_default(),
            shards: Some(router.shards),
            state_dir: None,
            max_index_blocks: router.index.max_held_blocks,
            max_dp_size: Some(router.max_dp_size),
            approx_ttl: Some(router.approx.ttl.as_secs_f64()),
            ready_timeout: Some(DEFAULT_READY_TIMEOUT_SECS),
            zmq_max_message_bytes: Some(router.zmq_max_message_bytes),
            session_ttl: Some(scheduler.sessions.ttl.as_secs_f64()),
            session_margin: Some(scheduler.sessions.margin_s),
            max_sessions: Some(scheduler.sessions.capacity),
            flow_control: Some(scheduler.flow.enabled),
            learn_shape: Some(scheduler.predictor.shape.enabled),
            max_engine_wait_ms: Some(scheduler.flow.max_engine_wait_ms),
            max_queued: Some(scheduler.flow.max_queued),
            max_queued_per_tenant: Some(scheduler.flow.max_queued_per_tenant),
            max_queued_bytes: Some(scheduler.flow.max_queued_bytes),
            max_queue_wait_ms: Some(scheduler.flow.max_wait_ms),
            queue_sheddable: Some(!scheduler.flow.shed_at_once),
            over_share: Some(scheduler.flow.over_share),
            over_share_wait: Some(scheduler.flow.over_share_wait),
        }
    }
}
