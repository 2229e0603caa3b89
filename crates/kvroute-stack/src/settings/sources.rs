//! [`Settings`]: every setting by group, as a file, the environment and the flags give it, and
//! the flags as `--help` shows them.

use std::collections::BTreeMap;
use std::path::Path;

use clap::Args;
use serde::{Deserialize, Serialize};

use kvroute_core::BlockSize;
use kvroute_http::ServeOptions;
use kvroute_preprocess::fetch::FetchConfig;
use kvroute_router::WorkerSpec;

use super::defaults::{
    DEFAULT_DECISION_LOG_RATIO, DEFAULT_HOST, DEFAULT_SIMULATED_WORKERS, DEFAULT_TRACE_RATIO,
};
use super::groups::{
    Blocks, Engine, FrontDoor, Gateway, Listen, Membership, Model, Nats, RemoteRouter, Routing,
    Security, SimulatedFleet, Tracing,
};
use super::invalid::SettingsError;
use crate::Simulated;

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
    #[serde(flatten)]
    #[command(flatten)]
    pub membership: Membership,
    #[serde(flatten)]
    #[command(flatten)]
    pub tracing: Tracing,
}

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

impl Settings {
    /// Every setting at its default, taken from the libraries' own `Default`s: what applies
    /// where no flag, variable or file sets one (`port`: the command's). Settings without a
    /// default (no NATS server, no files, the model's own context length) stay absent.
    pub fn defaults(port: u16) -> Settings {
        let listener = ServeOptions::default();
        Settings {
            listen: Listen {
                host: Some(DEFAULT_HOST.to_owned()),
                port: Some(port),
                max_connections_per_client: Some(listener.max_connections_per_client),
                max_body_bytes_in_flight: Some(listener.max_body_bytes_in_flight),
                max_body_bytes_per_client: Some(listener.max_body_bytes_per_client),
            },
            security: Security { insecure: Some(false), ..Security::default() },
            front_door: FrontDoor::defaults(),
            blocks: Blocks { block_size: Some(BlockSize::default().get()) },
            simulated: SimulatedFleet {
                simulated_workers: Some(DEFAULT_SIMULATED_WORKERS),
                simulated_dialect: Some(Simulated::default().dialect),
                prefill_workers: Some(0),
                decode_workers: Some(0),
                simulated_nodes: Some(1),
            },
            routing: Routing::defaults(),
            nats: Nats {
                nats_prefix: Some(kvroute_router::nats::DEFAULT_PREFIX.to_owned()),
                nats_sync: Some(true),
                nats_events: Some("zmq".to_owned()),
                nats_stream_max_bytes: Some(kvroute_router::nats::DEFAULT_STREAM_MAX_BYTES),
                nats_stream_max_age: Some(
                    kvroute_router::nats::DEFAULT_STREAM_MAX_AGE.as_secs_f64(),
                ),
                ..Nats::default()
            },
            model: Model {
                model_path: None,
                allow_private_image_urls: Some(FetchConfig::default().allow_private),
            },
            engine: Engine::defaults(),
            membership: Membership::defaults(),
            tracing: Tracing {
                trace_ratio: Some(DEFAULT_TRACE_RATIO),
                decision_log_ratio: Some(DEFAULT_DECISION_LOG_RATIO),
                decision_log_max_bytes: Some(
                    kvroute_router::config::DEFAULT_DECISION_LOG_MAX_BYTES,
                ),
                decision_log_files: Some(kvroute_router::config::DEFAULT_DECISION_LOG_FILES),
                ..Tracing::default()
            },
            gateway: Gateway {
                epp_fallbacks: Some(kvroute_epp::EppOptions::default().fallbacks),
                epp_endpoint_scores: Some(false),
                ext_proc_self_signed: Some(false),
                ..Gateway::default()
            },
            ..Settings::default()
        }
    }
}
