//! `kvroute mocker`: one simulated engine (docs/mocker.md).

use std::process::ExitCode;

use clap::Args;
use kvroute_mocker::{Endpoints, MockerConfig};
use kvroute_stack::settings::{
    Blocks, DEFAULT_MOCKER_PORT, Engine, Invalid, Listen, Model, Settings,
};

#[derive(Debug, Args)]
pub(crate) struct MockerArgs {
    #[command(flatten)]
    listen: Listen,
    #[command(flatten)]
    blocks: Blocks,
    #[command(flatten)]
    engine: Engine,
    #[command(flatten)]
    model: Model,
    /// ZMQ PUB endpoint of the KV events (vLLM format; port 0: any). They carry the token ids
    /// of every prompt: keep them on loopback or a private network.
    #[arg(long, env = "KVROUTE_EVENTS", default_value = "tcp://127.0.0.1:0")]
    events: String,
    /// ZMQ ROUTER endpoint replaying the last KV event batches.
    #[arg(long, env = "KVROUTE_REPLAY", default_value = "tcp://127.0.0.1:0")]
    replay: String,
    /// ZMQ PUB endpoint of the load reports (JSON).
    #[arg(
        long = "load-metrics",
        env = "KVROUTE_LOAD_METRICS",
        default_value = "tcp://127.0.0.1:0"
    )]
    load_metrics: String,
    /// Publish no KV events (an engine started without them: routers see it approximately).
    #[arg(long, env = "KVROUTE_NO_EVENTS")]
    no_events: bool,
    /// Key every HTTP route but /health then needs (`Authorization: Bearer <key>`), as
    /// vLLM's --api-key; repeat for several. Without one, anyone who reaches the port may
    /// call it (and /detokenize turns the token ids of its KV events back into text).
    #[arg(long = "api-key", env = "KVROUTE_MOCKER_API_KEY", value_delimiter = ',')]
    api_keys: Vec<String>,
    /// What the engine does in a disaggregated fleet: `prefill` (prefills for decode engines
    /// and holds the blocks until pulled: vLLM's kv_producer, SGLang's prefill mode),
    /// `decode` (pulls a prefill engine's KV, then decodes) or `both` (docs/mocker.md,
    /// "Prefill and decode"). `store`: no engine, but the KV store a fleet shares, of
    /// --num-store-blocks blocks, for engines started with --store-url (docs/mocker.md,
    /// "Shared store").
    #[arg(long, default_value = "both")]
    role: MockerRole,
    /// Port of a prefill engine's side channel, where decode engines pull its KV (vLLM's
    /// VLLM_NIXL_SIDE_CHANNEL_PORT; SGLang's bootstrap port, which routers name to both
    /// legs); 0: any free one. On the listen host.
    #[arg(long, visible_alias = "disaggregation-bootstrap-port", default_value_t = 0)]
    side_channel_port: u16,
    /// The side channels (HOST:PORT, an IP address or localhost) a decode engine may pull a
    /// prefill engine's KV from: each prefill engine's --side-channel-port on its host. A
    /// decode leg that names any other address is refused before anything is sent, so a
    /// request cannot make the engine call an address of its choosing. Roles prefill,
    /// decode and store, and --store-url, also need the fleet's shared secret in
    /// KVROUTE_KV_PEER_TOKEN (docs/security.md).
    #[arg(long, env = "KVROUTE_PREFILL_PEERS", value_delimiter = ',', value_parser = peer_addr)]
    prefill_peers: Vec<std::net::SocketAddr>,
}

/// A prefill peer's side channel: `IP:PORT`, `[IPv6]:PORT` or `localhost:PORT`.
fn peer_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    let local = s.strip_prefix("localhost:").map(|port| format!("127.0.0.1:{port}"));
    local
        .as_deref()
        .unwrap_or(s)
        .parse()
        .map_err(|_| format!("{s:?} is not IP:PORT (or localhost:PORT)"))
}

/// The fleet's token, required for `what`.
fn required_token(what: &'static str) -> anyhow::Result<String> {
    let token =
        kvroute_stack::settings::kv_peer_token().map_err(kvroute_stack::StackError::from)?;
    Ok(token.ok_or(kvroute_stack::StackError::from(Invalid::NoPeerToken(what)))?)
}

/// What `kvroute mocker` runs: an engine in one of its roles, or the shared store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MockerRole {
    Engine(kvroute_mocker::Role),
    Store,
}

impl std::str::FromStr for MockerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "store" => Ok(Self::Store),
            _ => s
                .parse()
                .map(Self::Engine)
                .map_err(|_| format!("unknown role {s:?} (prefill, decode, both or store)")),
        }
    }
}

pub(crate) fn run(args: &MockerArgs) -> anyhow::Result<ExitCode> {
    let role = match args.role {
        MockerRole::Store => return run_store(args),
        MockerRole::Engine(role) => role,
    };
    let settings = Settings {
        listen: args.listen.clone(),
        blocks: args.blocks.clone(),
        engine: args.engine.clone(),
        model: args.model.clone(),
        ..Settings::default()
    };
    let (events, replay) = match args.no_events {
        true => (None, None),
        false => (Some(args.events.clone()), Some(args.replay.clone())),
    };
    let mut engine = settings.engine_config()?;
    engine.disagg.role = role;
    let invalid = |why| Err(kvroute_stack::StackError::from(why).into());
    if engine.sliding_window.is_some() && role != kvroute_mocker::Role::Both {
        return invalid(Invalid::HybridWith("a prefill or decode role"));
    }
    let store_url = settings.engine.store_url.clone();
    if settings.engine.num_store_blocks.unwrap_or(0) > 0 {
        return invalid(Invalid::StoreBlocksForStore);
    }
    if store_url.is_some() && role != kvroute_mocker::Role::Both {
        return invalid(Invalid::StoreWith("a prefill or decode role"));
    }
    settings.shared_store(store_url.is_some())?;
    let token = match (role, &store_url) {
        (kvroute_mocker::Role::Prefill, _) => Some(required_token("--role prefill")?),
        (kvroute_mocker::Role::Decode, _) => Some(required_token("--role decode")?),
        (_, Some(_)) => Some(required_token("--store-url")?),
        _ => None,
    };
    if role == kvroute_mocker::Role::Decode && args.prefill_peers.is_empty() {
        tracing::warn!(
            "a decode engine without --prefill-peers refuses every decode leg: name the prefill \
             engines' side channels"
        );
    }
    let peers = kvroute_mocker::Peers { token, prefill: args.prefill_peers.clone() };
    let config = MockerConfig {
        engine,
        endpoints: Endpoints { events, replay, metrics: Some(args.load_metrics.clone()) },
        model_path: settings.model.model_path.clone(),
        chat_template: settings.chat_template()?,
        seed: settings.seed(),
        max_model_len: settings.engine.max_model_len,
        dp_rank: 0,
        fetch: settings.fetch_config(),
        api_keys: kvroute_http::Credentials::new(&args.api_keys, "--api-key")?,
        lora_modules: settings.lora_modules(),
        runtime_lora_updating: settings.engine.lora_updating.unwrap_or(false),
        side_channel: Some(format!(
            "{}:{}",
            settings.listen.host.as_deref().unwrap_or("127.0.0.1"),
            args.side_channel_port
        )),
        store_url,
        peers,
    };
    let options = settings.serve_options()?;
    super::runtime()?.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_MOCKER_PORT)).await?;
        let state = kvroute_mocker::start(config).await?;
        let local = listener.local_addr()?;
        let b = &state.engine.bound;
        super::announce(&[
            format!(
                "kvroute mocker listening on http://{local} (model {}); events {} replay {} load {}",
                state.preprocessor.model_name(),
                b.events.as_deref().unwrap_or("-"),
                b.replay.as_deref().unwrap_or("-"),
                b.metrics.as_deref().unwrap_or("-"),
            ),
            match state.side_channel {
                Some(a) => format!("role {role}; side channel (bootstrap) {a}"),
                None => format!("role {role}"),
            },
            format!(
                "try: curl -s http://{local}/v1/chat/completions -H 'content-type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello\"}}]}}'"
            ),
        ]);
        let app = kvroute_mocker::http::app(state);
        super::serve_until_signal(listener, app, options).await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// `kvroute mocker --role store`: the KV store a fleet shares, until a signal.
fn run_store(args: &MockerArgs) -> anyhow::Result<ExitCode> {
    let settings = Settings { listen: args.listen.clone(), ..Settings::default() };
    let blocks = args.engine.num_store_blocks.unwrap_or(0);
    if blocks == 0 {
        return Err(kvroute_stack::StackError::from(Invalid::StoreWithoutBlocks).into());
    }
    let token = required_token("--role store")?;
    let options = settings.serve_options()?;
    super::runtime()?.block_on(async move {
        let listener = super::bind(&settings.address(DEFAULT_MOCKER_PORT)).await?;
        let local = listener.local_addr()?;
        super::announce(&[
            format!("kvroute mocker (shared store of {blocks} blocks) listening on http://{local}"),
            format!("start engines with --store-url http://{local}; its counts: curl -s http://{local}/stats"),
        ]);
        let store = std::sync::Arc::new(std::sync::Mutex::new(kvroute_mocker::store::Store::new(blocks)));
        let writers = kvroute_http::Credentials::new([&token], "KVROUTE_KV_PEER_TOKEN")?;
        let app = kvroute_mocker::store::app(store, writers);
        super::serve_until_signal(listener, app, options).await?;
        Ok(ExitCode::SUCCESS)
    })
}
