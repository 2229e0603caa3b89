//! What a stack is made of: its simulated workers, who may call what, and the whole of it.

use kvroute_frontend::FrontDoorOptions;
use kvroute_http::Credentials;
use kvroute_mocker::EngineConfig;
use kvroute_preprocess::fetch::FetchConfig;
use kvroute_router::{Dialect, RouterConfig};
use std::path::PathBuf;

/// Who may call what: the front door's API keys, the admin token of the router's API and of
/// `/metrics`, and the token to send a remote router. Empty sets leave routes open.
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub api_keys: Credentials,
    pub admin: Credentials,
    pub router_token: Option<String>,
}

/// The simulated workers of a stack.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulated {
    /// Aggregated workers.
    pub count: usize,
    /// Prefill and decode workers (`--prefill-workers`, `--decode-workers`), after those.
    pub prefill: usize,
    pub decode: usize,
    /// Nodes the prefill and decode workers are spread over, each pool in turn (`node-0`,
    /// `node-1`, ...; 0 or 1: unlabelled, one node).
    pub nodes: usize,
    /// Each one's engine (its block size is the router's).
    pub engine: EngineConfig,
    /// Whether they publish KV events (otherwise they are routed approximately).
    pub events: bool,
    /// Seeds the generated text, the same on every worker (so every routing policy sees the
    /// same conversations).
    pub seed: u64,
    /// The longest prompt plus output (`None`: the model's, at most the KV capacity).
    pub max_model_len: Option<u64>,
    /// How the front door speaks to them (they serve every dialect).
    pub dialect: Dialect,
    /// A chat template of their own (Jinja text) instead of the model's.
    pub chat_template: Option<String>,
    /// The LoRA adapters each serves from the start (name, path).
    pub lora_modules: Vec<(String, Option<String>)>,
    /// Each serves vLLM's dynamic adapter API.
    pub lora_updating: bool,
    /// The store they share (docs/mocker.md, "Shared store").
    pub store: Option<SharedStore>,
    /// The token an outside store (`SharedStore::At`) requires; otherwise the engines get
    /// a fresh one of their own.
    pub kv_peer_token: Option<String>,
    /// Their HTTP routes answer without a token, for a gateway that calls them itself
    /// (`--ext-proc-port`: the gateway holds no worker's token). Otherwise they answer only
    /// the front door, each with a token of its own.
    pub tokenless: bool,
}

/// Where simulated engines find the store they share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SharedStore {
    /// A store already running (`kvroute mocker --role store`).
    At(String),
    /// One of this many blocks, started with the stack on a loopback port.
    Start(usize),
}

impl Default for Simulated {
    fn default() -> Self {
        Self {
            count: 0,
            prefill: 0,
            decode: 0,
            nodes: 1,
            engine: EngineConfig::default(),
            events: true,
            seed: 0,
            max_model_len: None,
            dialect: Dialect::VllmGenerate,
            chat_template: None,
            lora_modules: Vec::new(),
            lora_updating: false,
            store: None,
            kv_peer_token: None,
            tokenless: false,
        }
    }
}

/// Where the fleet's members come from while the stack runs, besides its configured and
/// simulated workers (docs/membership.md).
#[derive(Clone, Debug)]
pub struct Discovery {
    pub dns: Option<kvroute_router::members::DnsConfig>,
    pub bucket: Option<kvroute_router::members::BucketConfig>,
    /// The configuration file, read again when it changes.
    pub reload: Option<crate::reload::Reload>,
    /// An `InferencePool`'s ready pods, watched through the Kubernetes API.
    pub kube: Option<kvroute_kube::KubeConfig>,
    /// How long a draining worker's requests may run before it is removed all the same.
    pub drain_timeout: std::time::Duration,
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            dns: None,
            bucket: None,
            reload: None,
            kube: None,
            drain_timeout: kvroute_router::members::DRAIN_TIMEOUT,
        }
    }
}

/// What to start.
#[derive(Clone, Debug)]
pub struct StackConfig {
    pub simulated: Simulated,
    /// The router's settings; its `workers` are the external ones (simulated ones are added,
    /// numbered after the highest external id).
    pub router: RouterConfig,
    /// Ask the `kvroute router` at this URL instead of embedding one.
    pub router_url: Option<String>,
    /// Build a front door.
    pub frontend: bool,
    /// The model of the front door and the simulated workers (`None`: the built-in one).
    pub model_path: Option<PathBuf>,
    /// Image fetching of the front door and the simulated workers.
    pub fetch: FetchConfig,
    pub access: Access,
    /// The front door's own settings (the bench asks for `expose_overlap`).
    pub front_door: FrontDoorOptions,
    /// LoRA adapters the front door serves besides those the workers list (the simulated
    /// workers' own are added).
    pub adapters: Vec<String>,
    /// Each model's priority for requests that name none.
    pub model_priorities: std::collections::BTreeMap<String, i32>,
    /// Sources of members while it runs (the embedded router's).
    pub discovery: Discovery,
}

impl Default for StackConfig {
    fn default() -> Self {
        Self {
            simulated: Simulated::default(),
            router: RouterConfig::default(),
            router_url: None,
            frontend: true,
            model_path: None,
            fetch: FetchConfig::default(),
            access: Access::default(),
            front_door: FrontDoorOptions::default(),
            adapters: Vec::new(),
            model_priorities: std::collections::BTreeMap::new(),
            discovery: Discovery::default(),
        }
    }
}
