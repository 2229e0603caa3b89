//! What the binary's integration tests share.

use std::process::Command;

/// The `kvroute` binary, with nothing of the developer's `KVROUTE_*` environment leaking into
/// the settings under test.
pub(crate) fn kvroute() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    for (key, _) in std::env::vars() {
        if key.starts_with("KVROUTE_") {
            cmd.env_remove(key);
        }
    }
    cmd
}
