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

/// A child process killed when the test ends, however it ends.
#[allow(dead_code)] // not every test binary starts a process
pub(crate) struct Killed(pub(crate) std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `command` (its stdout piped) and reads its stdout until the line that begins with
/// `ready`: the first word after that prefix, and the lines before it.
#[allow(dead_code)]
pub(crate) fn spawned(mut command: Command, ready: &str) -> (Killed, String, Vec<String>) {
    use std::io::BufRead as _;
    let mut child = command.stdout(std::process::Stdio::piped()).spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let child = Killed(child);
    let mut before = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix(ready) {
            return (child, rest.split_whitespace().next().unwrap().to_owned(), before);
        }
        before.push(line);
    }
    panic!("{command:?} ended before its line {ready:?}")
}
