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

mod convert;
mod defaults;
mod engines;
mod gateway;
pub mod groups;
mod invalid;
mod sources;
mod weights;

pub use convert::is_loopback;
pub use defaults::*;
pub use groups::{
    Blocks, Engine, FrontDoor, Gateway, Listen, Membership, Model, Nats, RemoteRouter, Routing,
    Security, SimulatedFleet, Tracing,
};
pub use invalid::{Invalid, SettingsError};
pub use sources::{Settings, decorate, keys_of};
pub use weights::kv_weight;

#[cfg(test)]
mod tests;
