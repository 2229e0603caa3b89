//! What configures a stack, from three sources merged setting by setting: a command-line flag
//! wins over its `KVROUTE_*` environment variable (clap reads both), which wins over the
//! `--config` TOML file, which wins over the default. Each setting is declared once, in
//! [`groups`]: flag, variable, file key, help and (through [`Settings::defaults`]) default
//! all come from that declaration. A file uses the settings' names (`block_size = 32`,
//! `policy = "dynamo"`) and `[[workers]]` tables with the `--worker` keys; a key a command does
//! not take is an error, not ignored.
//!
//! Workers add up across the file and the flags; a worker id given in both must have the same
//! keys (it is then one worker), else it is an error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::Args;
use serde::{Deserialize, Serialize};

use kvroute_router::WorkerSpec;

mod convert;
mod gateway;
pub mod groups;

pub use convert::is_loopback;
pub use groups::{
    Blocks, Engine, FrontDoor, Gateway, Listen, Model, Nats, RemoteRouter, Routing, Security,
    SimulatedFleet,
};

pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_READY_TIMEOUT_SECS: f64 = 10.0;
pub const DEFAULT_SIMULATED_WORKERS: usize = 4;
/// The ports the commands listen on by default.
pub const DEFAULT_FRONT_DOOR_PORT: u16 = 8000;
pub const DEFAULT_ROUTER_PORT: u16 = 8001;
pub const DEFAULT_MOCKER_PORT: u16 = 8100;

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

/// Every setting, by group, each optional (absent: the next source, or the default). A
/// command takes the groups it flattens into its flags; its file may hold their keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, Args)]
pub struct Settings {
    #[serde(flatten)]
    #[command(flatten)]
    pub listen: Listen,
    #[serde(flatten)]
    #[command(flatten)]
    pub security: Security,
    #[serde(flatten)]
    #[command(flatten)]
    pub front_door: FrontDoor,
    #[serde(flatten)]
    #[command(flatten)]
    pub blocks: Blocks,
    #[serde(flatten)]
    #[command(flatten)]
    pub simulated: SimulatedFleet,
    #[serde(flatten)]
    #[command(flatten)]
    pub routing: Routing,
    #[serde(flatten)]
    #[command(flatten)]
    pub remote: RemoteRouter,
    #[serde(flatten)]
    #[command(flatten)]
    pub nats: Nats,
    #[serde(flatten)]
    #[command(flatten)]
    pub model: Model,
    #[serde(flatten)]
    #[command(flatten)]
    pub engine: Engine,
    #[serde(flatten)]
    #[command(flatten)]
    pub gateway: Gateway,
}

/// Environment variables holding secrets themselves (flags and files name files instead, so
/// no key shows in `ps` or `--print-config`).
pub const ENV_API_KEYS: &str = "KVROUTE_API_KEYS";
pub const ENV_ADMIN_TOKEN: &str = "KVROUTE_ADMIN_TOKEN";
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

/// The setting keys among `A`'s flags (a command's arguments): what its config file may hold.
pub fn keys_of<A: Args>() -> Vec<String> {
    let all = arg_ids(&Settings::augment_args(clap::Command::new("settings")));
    let mut keys = arg_ids(&A::augment_args(clap::Command::new("command")));
    keys.retain(|k| all.contains(k));
    keys
}

fn arg_ids(command: &clap::Command) -> Vec<String> {
    command.get_arguments().map(|a| a.get_id().to_string()).collect()
}

/// `command`'s setting flags as `--help` shows them and the environment sets them: each takes
/// its variable from its flag (`--block-size`: `KVROUTE_BLOCK_SIZE`) unless it declares one,
/// and its help ends with its default from `defaults` (what `--print-config` shows; switches,
/// which default to off, and tables leave it out).
pub fn decorate(mut command: clap::Command, defaults: &Settings) -> clap::Command {
    let keys = keys_of::<Settings>();
    let shown = defaults.shown_defaults();
    // Every argument in turn, settings or not: clap moves an argument it changes to the end,
    // and the help keeps the order of declaration this way.
    for id in arg_ids(&command) {
        let setting = keys.contains(&id);
        let default = shown.get(&id).cloned();
        command = command.mut_arg(&id, |arg| {
            if !setting {
                return arg;
            }
            let arg = match (arg.get_env(), arg.get_long()) {
                (None, Some(long)) => {
                    let var = format!("KVROUTE_{}", long.to_ascii_uppercase().replace('-', "_"));
                    arg.env(var)
                }
                _ => arg,
            };
            let Some(default) = default else { return arg };
            let with = |text: Option<&clap::builder::StyledStr>| {
                text.map(|t| format!("{t} [default: {default}]"))
            };
            let (help, long_help) = (with(arg.get_help()), with(arg.get_long_help()));
            let arg = match help {
                Some(help) => arg.help(help),
                None => arg,
            };
            match long_help {
                Some(long_help) => arg.long_help(long_help),
                None => arg,
            }
        });
    }
    command
}

impl Settings {
    /// Reads a TOML file, refusing keys that `command` (named in errors) does not use.
    pub fn from_file(
        path: &Path,
        allowed: &[String],
        command: &str,
    ) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| SettingsError::Read { path: path.to_owned(), source })?;
        Self::from_toml(&text, path, allowed, command)
    }

    /// [`Settings::from_file`] of text read from `path`.
    pub fn from_toml(
        text: &str,
        path: &Path,
        allowed: &[String],
        command: &str,
    ) -> Result<Self, SettingsError> {
        let parse = |source| SettingsError::Parse { path: path.to_owned(), source };
        let table: toml::Table = toml::from_str(text).map_err(parse)?;
        if let Some(key) = table.keys().find(|k| !allowed.contains(k)) {
            let (path, key) = (path.to_owned(), key.clone());
            return Err(match keys_of::<Settings>().contains(&key) {
                true => SettingsError::NotFor { path, key, command: command.to_owned() },
                false => SettingsError::Unknown { path, key },
            });
        }
        // Each key alone first, so an error names the key it is about (the groups are
        // flattened, which loses the key from serde's own message).
        for (key, value) in &table {
            let alone = toml::Table::from_iter([(key.clone(), value.clone())]);
            if let Err(source) = Settings::deserialize(alone) {
                let (path, key, source) = (path.to_owned(), key.clone(), Box::new(source));
                return Err(SettingsError::Value { path, key, source });
            }
        }
        Settings::deserialize(table).map_err(parse)
    }

    /// `self` under `high`: each setting `high` has wins; workers add up (the same id twice
    /// must have the same keys), and so do the `kv` cost's weights (`high`'s win).
    pub fn overlaid_by(self, high: Settings) -> Result<Settings, SettingsError> {
        let low = self;
        let mut by_id: BTreeMap<u64, WorkerSpec> = BTreeMap::new();
        let mut order = Vec::new();
        for w in low.routing.workers.iter().chain(&high.routing.workers) {
            match by_id.get(&w.id.0) {
                Some(seen) if seen == w => {}
                Some(_) => return Err(SettingsError::WorkerTwice(w.id)),
                None => {
                    by_id.insert(w.id.0, w.clone());
                    order.push(w.id.0);
                }
            }
        }
        let workers = order.iter().filter_map(|id| by_id.remove(id)).collect();
        // Every other setting: `high`'s where it has one. Read off the settings' own
        // serialized form (an absent setting is an absent key), so no list of them is kept.
        let table = |s: &Settings| toml::Table::try_from(s).map_err(SettingsError::Print);
        let mut merged = table(&low)?;
        merged.extend(table(&high)?);
        let mut out = Settings::deserialize(merged).map_err(SettingsError::Merge)?;
        let weights: BTreeMap<String, f64> =
            low.routing.kv_cost.into_iter().chain(high.routing.kv_cost).collect();
        let pair: BTreeMap<String, f64> =
            low.routing.pd_cost.into_iter().chain(high.routing.pd_cost).collect();
        out.routing.workers = workers;
        out.routing.kv_cost = weights.into_iter().collect();
        out.routing.pd_cost = pair.into_iter().collect();
        Ok(out)
    }

    /// The settings `--print-config` shows: these over every default, as a config file of
    /// `allowed`'s keys (what the command reads back).
    pub fn printed(&self, port: u16, allowed: &[String]) -> String {
        let full = match Self::defaults(port).overlaid_by(self.clone()) {
            Ok(full) => full,
            Err(e) => return format!("# cannot print the settings: {e}\n"),
        };
        match toml::Table::try_from(&full) {
            Ok(mut table) => {
                table.retain(|k, _| allowed.iter().any(|a| a == k));
                toml::to_string(&table)
                    .unwrap_or_else(|e| format!("# cannot print the settings: {e}\n"))
            }
            Err(e) => format!("# cannot print the settings: {e}\n"),
        }
    }

    /// The settings as TOML (what `--print-config` shows).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the settings: {e}\n"))
    }
}

/// `NAME=VALUE` of `--kv-cost` and `--pd-cost` (the name is checked against the cost's settings
/// later).
pub fn kv_weight(arg: &str) -> Result<(String, f64), Invalid> {
    let bad = || Invalid::Weight(arg.to_owned());
    let (name, value) = arg.split_once('=').ok_or_else(bad)?;
    let value = value.trim().parse().map_err(|_| bad())?;
    Ok((name.trim().to_owned(), value))
}

/// The `kv` cost's weights in a file: a `[kv_cost]` table of `name = value` (the last of a
/// name given twice wins).
mod weights {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(
        weights: &[(String, f64)],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let table: BTreeMap<&str, f64> = weights.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        table.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<(String, f64)>, D::Error> {
        Ok(BTreeMap::<String, f64>::deserialize(d)?.into_iter().collect())
    }
}

#[cfg(test)]
mod tests;
