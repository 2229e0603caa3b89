//! The programs the tests, `kvroute bench` and the examples start beside kvroute (nats-server,
//! dnsmasq, an OTLP receiver, Prometheus, Python): where each is found, and a port to hand one
//! that cannot be given a bound socket.
//!
//! A program is found by its own variable, then on `PATH`, then in the repository's `.venv`
//! (where `scripts/test` installs the Python packages that carry binaries), so a single test
//! file runs with the command cargo prints for it, outside the test script too.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};

/// `name`'s path: `$var` when set, else the first `name` on `PATH`, else the nearest
/// `.venv/bin/name` above the current directory or the crate being tested; else `name`
/// itself (spawning it then says what is missing).
pub fn find(name: &str, var: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        return PathBuf::from(path);
    }
    on_path(name).or_else(|| in_venv(&format!("bin/{name}"))).unwrap_or_else(|| name.into())
}

/// The first `name` on `PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// `relative` inside the nearest `.venv` above the current directory or `CARGO_MANIFEST_DIR`
/// (cargo sets it for a test), when it exists.
pub fn in_venv(relative: &str) -> Option<PathBuf> {
    let starts =
        [std::env::current_dir().ok(), std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from)];
    starts.into_iter().flatten().find_map(|start| {
        start.ancestors().map(|dir| dir.join(".venv").join(relative)).find(|p| p.exists())
    })
}

/// The nearest `.venv` (see [`in_venv`]).
pub fn venv() -> Option<PathBuf> {
    in_venv("bin").and_then(|bin| bin.parent().map(Path::to_path_buf))
}

/// How many ports [`child_port`] tries.
const TRIES: usize = 64;

/// A loopback port for a child process that takes a port number, not a socket: below the
/// kernel's ephemeral range, so that no socket bound to port 0 and no outgoing connection
/// (which take theirs from that range) can hold it when the child binds; chosen at random
/// and free for both UDP and TCP when chosen. Another process can still take it in between,
/// so a caller whose child says "in use" asks again.
pub fn child_port() -> std::io::Result<u16> {
    for _ in 0..TRIES {
        if let Some(port) = candidate() {
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "no free port below the ephemeral range",
    ))
}

fn candidate() -> Option<u16> {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = 10_000u16.min(ephemeral / 2).max(1024);
    let span = ephemeral.saturating_sub(low).max(1);
    let mut bytes = [0u8; 2];
    getrandom::fill(&mut bytes).ok()?;
    let port = low + u16::from_le_bytes(bytes) % span;
    let at = SocketAddr::from(([127, 0, 0, 1], port));
    let free = UdpSocket::bind(at).is_ok() && TcpListener::bind(at).is_ok();
    free.then_some(port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_port_is_below_the_ephemeral_range_and_free() {
        let port = child_port().unwrap();
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range");
        if let Some(low) = range.ok().and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        {
            assert!(port < low, "{port} is in the ephemeral range from {low}");
        }
        assert!(TcpListener::bind(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn a_variable_names_the_program_first() {
        let var = "KVROUTE_TEST_TOOLS_FIND_ONLY_HERE";
        assert_eq!(
            find("no-such-program-anywhere", var),
            PathBuf::from("no-such-program-anywhere")
        );
    }
}
