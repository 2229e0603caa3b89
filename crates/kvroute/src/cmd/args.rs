//! What every command that reads settings shares: `--config` and `--print-config`. The
//! settings' own flags are declared once, in [`kvroute_stack::settings::groups`], and
//! flattened into each command.

// Clap's help texts are these doc comments: they write a config file's TOML tables in
// brackets (`[[workers]]`, `[kv_cost]`), which rustdoc would read as links.
#![allow(rustdoc::broken_intra_doc_links)]

use std::path::PathBuf;

use clap::Args;
use kvroute_stack::settings::Settings;

/// `--config` and `--print-config`.
#[derive(Debug, Args)]
#[command(next_help_heading = "Config file")]
pub(crate) struct ConfigArgs {
    /// TOML file of settings: the flags' names in snake_case (block_size = 32) and
    /// [[workers]] tables of the --worker keys. Flags and environment win over it.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Print every setting the command reads, after merging flags, environment and file over
    /// the defaults (as a config file it reads back), and exit.
    #[arg(long)]
    pub(crate) print_config: bool,
}

impl ConfigArgs {
    /// The file's settings under `flags` (flags and environment win).
    pub(crate) fn merge(
        &self,
        flags: Settings,
        allowed: &[String],
        command: &str,
    ) -> anyhow::Result<Settings> {
        let file = match &self.config {
            Some(path) => Settings::from_file(path, allowed, command)?,
            None => Settings::default(),
        };
        Ok(file.overlaid_by(flags)?)
    }

    /// The configuration file followed while the command runs (its `[[workers]]` read again
    /// on change, under the same `flags`); none without `--config`.
    pub(crate) fn reload(
        &self,
        flags: &Settings,
        allowed: &[String],
        command: &'static str,
    ) -> Option<kvroute_stack::reload::Reload> {
        let path = self.config.clone()?;
        let (flags, allowed, file) = (flags.clone(), allowed.to_vec(), path.clone());
        let workers =
            move || -> Result<Vec<kvroute_router::WorkerSpec>, kvroute_stack::StackError> {
                let settings = Settings::from_file(&file, &allowed, command)
                    .and_then(|s| s.overlaid_by(flags.clone()))?;
                Ok(settings.router_config()?.workers)
            };
        Some(kvroute_stack::reload::Reload { path, workers: std::sync::Arc::new(workers) })
    }

    /// With `--print-config`: checks `settings` as the command would (`check`: the
    /// conversions it makes; what it would refuse is refused here too, not printed), prints
    /// them over the defaults (the command's `port`, its `allowed` keys) and says to stop.
    pub(crate) fn printed(
        &self,
        settings: &Settings,
        port: u16,
        allowed: &[String],
        check: impl FnOnce(&Settings) -> Result<(), kvroute_stack::StackError>,
    ) -> anyhow::Result<bool> {
        if self.print_config {
            check(settings)?;
            #[allow(clippy::print_stdout)]
            {
                print!("{}", settings.printed(port, allowed));
            }
        }
        Ok(self.print_config)
    }
}
