//! Why settings could not be read, merged or used.

use std::path::PathBuf;

/// Why settings could not be read or merged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    #[error("reading {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}")]
    Parse { path: PathBuf, source: toml::de::Error },
    #[error("{path}: `{key}`")]
    Value { path: PathBuf, key: String, source: Box<toml::de::Error> },
    #[error("{path}: `{key}` does not apply to `kvroute {command}`")]
    NotFor { path: PathBuf, key: String, command: String },
    #[error("{path}: unknown key `{key}`")]
    Unknown { path: PathBuf, key: String },
    #[error(
        "worker {0} is given twice with different keys (in the file and by --worker or KVROUTE_WORKERS)"
    )]
    WorkerTwice(kvroute_core::WorkerId),
    #[error("the settings cannot be written as TOML")]
    Print(#[source] toml::ser::Error),
    #[error("the merged settings do not read back")]
    Merge(#[source] toml::de::Error),
}

/// A setting's value that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    #[error(
        "refusing to listen on {host} without {missing}: anyone who reaches it could use it. Give them, listen on 127.0.0.1, or pass --insecure when a proxy in front authenticates"
    )]
    Exposed { host: String, missing: String },
    #[error("--tls-cert and --tls-key go together")]
    TlsPair,
    #[error(
        "--discover-dns and --kube-pool need --worker-template (how each address found is a worker)"
    )]
    NoTemplate,
    #[error("--worker-template: {0}")]
    Template(String),
    #[error("--dns-server {0:?}: expected IP:PORT")]
    DnsServer(String),
    #[error("--members-bucket needs --nats-url (the server the bucket is on)")]
    BucketWithoutNats,
    #[error(
        "--members-bucket needs the fleet's registration key (--members-key-file or KVROUTE_MEMBERS_KEY): without it, whoever can write to the bucket could add a worker"
    )]
    BucketWithoutKey,
    #[error("the registration key: {0}")]
    MembersKey(String),
    #[error("--model-priority {0:?}: expected NAME=PRIORITY, PRIORITY an integer from -100 to 100")]
    ModelPriority(String),
    #[error("{0} must be at least 1")]
    AtLeastOne(&'static str),
    #[error("{0:?}: expected NAME=VALUE, VALUE a number")]
    Weight(String),
    #[error("{0} must be a finite number >= 0")]
    Negative(&'static str),
    #[error("{0} must be a number from 0 to 1")]
    Fraction(&'static str),
    #[error("block_size: {0}")]
    BlockSize(#[source] kvroute_core::Error),
    #[error("temperature must be >= 0")]
    Temperature,
    #[error("--nats-events needs --nats-url")]
    NatsEventsWithoutUrl,
    #[error("speedup must be > 0")]
    Speedup,
    #[error("num_blocks, max_num_seqs, max_batched_tokens and max_loras must be > 0")]
    EngineZero,
    #[error("lora_load_ms, lora_swap_ms and lora_step_ms must be finite and >= 0")]
    LoraTime,
    #[error(
        "host_offload_h2d_bandwidth_gbps, host_offload_d2h_bandwidth_gbps, storage_bandwidth_gbps and kv_bytes_per_token must be finite and >= 0"
    )]
    HostTier,
    #[error(
        "num_storage_blocks needs num_host_blocks: storage sits below host memory, as in vLLM's tiering"
    )]
    StorageWithoutHost,
    #[error(
        "give the simulated engines a shared store by --store-url or by --num-store-blocks, not both"
    )]
    StoreTwice,
    #[error(
        "{0} needs the fleet's shared secret in KVROUTE_KV_PEER_TOKEN (16 to 256 visible ASCII \
         characters, the same on every engine and store of the fleet): its side channel and \
         the shared store answer only calls that carry it"
    )]
    NoPeerToken(&'static str),
    #[error("KVROUTE_KV_PEER_TOKEN must be 16 to 256 visible ASCII characters")]
    PeerToken,
    #[error("the simulated engines share a store only without {0}")]
    StoreWith(&'static str),
    #[error(
        "--num-store-blocks sizes a store (--role store, or the one serve and bench start); an engine joins one with --store-url"
    )]
    StoreBlocksForStore,
    #[error("--role store needs --num-store-blocks: the blocks the store keeps")]
    StoreWithoutBlocks,
    #[error("the model's config: {0}")]
    ModelConfig(#[source] kvroute_mocker::window::ModelConfigError),
    #[error(
        "the simulated engine runs a hybrid model (a sliding window in its config.json) only without {0}: its window group is neither offloaded nor handed off"
    )]
    HybridWith(&'static str),
    #[error("reading {}: {source}", path.display())]
    ReadSecret { path: PathBuf, source: std::io::Error },
    #[error("reading the chat template {}: {source}", path.display())]
    ReadChatTemplate { path: PathBuf, source: std::io::Error },
    #[error("{}: no token in it", .0.display())]
    NoToken(PathBuf),
    #[error("{0} must be a number of seconds >= 0")]
    Seconds(String),
    #[error("unknown kv_cost weight `{name}` (known: {known})")]
    KvCostName { name: String, known: String },
    #[error("kv_cost {name} must be >= 0, not {value}")]
    KvCostValue { name: String, value: f64 },
    /// The cost's weights do not round-trip as a table (a bug, not a setting).
    #[error("kv_cost: the weights do not write as a table")]
    KvCostWrite(#[source] toml::ser::Error),
    #[error("unknown pd_cost setting `{name}` (known: {known})")]
    PdCostName { name: String, known: String },
    #[error("kv_cost: the weights do not read back")]
    KvCostRead(#[source] toml::de::Error),
}
