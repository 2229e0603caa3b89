//! A real DNS server on loopback: Debian's `dnsmasq` (the dnsmasq-base package, a binary with
//! no service), answering from a hosts file that [`DnsServer::publish`] rewrites, for the
//! membership tests and `kvroute bench --churn`. Authoritative for its names: a name without
//! addresses answers NXDOMAIN, as a headless Service without ready pods does.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why the DNS server did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DnsServerError {
    #[error("dnsmasq is not installed (Debian's dnsmasq-base)")]
    Missing,
    #[error("running dnsmasq: {0}")]
    Run(#[from] std::io::Error),
    #[error("dnsmasq exited ({status}) before it listened on {at}; it said: {said}")]
    Exited { at: SocketAddr, status: std::process::ExitStatus, said: String },
    #[error("dnsmasq did not listen on {at} within {within:?}; it said: {said}")]
    NotReady { at: SocketAddr, within: Duration, said: String },
    #[error("no free port for dnsmasq after {0} tries; the last one said: {1}")]
    NoPort(usize, String),
}

const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How many ports are tried before giving up (each taken one costs one try).
const PORT_TRIES: usize = 32;

/// A running `dnsmasq`; stopped (and its files removed) when dropped.
#[derive(Debug)]
pub struct DnsServer {
    child: Child,
    /// Where it answers (UDP and TCP).
    pub at: SocketAddr,
    dir: PathBuf,
}

impl DnsServer {
    /// The binary, when installed.
    pub fn binary() -> Option<&'static str> {
        ["/usr/sbin/dnsmasq", "/usr/bin/dnsmasq"].into_iter().find(|p| Path::new(p).exists())
    }

    /// Starts one authoritative for `domain` (its names answer from the hosts file only), on
    /// a free loopback port, with `srv` records (`--srv-host` values) and no addresses yet.
    ///
    /// dnsmasq cannot be handed a socket, so it is given a port number
    /// ([`crate::tools::child_port`]: below the ephemeral range, where the suite's other
    /// sockets and connections never are); when it still loses the port (another process
    /// took it in between), its own words say so and another port is tried.
    pub fn start(domain: &str, srv: &[&str]) -> Result<Self, DnsServerError> {
        let binary = Self::binary().ok_or(DnsServerError::Missing)?;
        let tag = format!("{}-{:?}", std::process::id(), Instant::now());
        let dir = std::env::temp_dir().join(format!("kvroute-dns-{}", blake_free_tag(&tag)));
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("hosts"), "")?;
        let mut last = String::new();
        for _ in 0..PORT_TRIES {
            let port = crate::tools::child_port()?;
            match Self::start_on(binary, &dir, port, domain, srv) {
                Ok(child) => return Ok(Self { child, at: loopback(port), dir }),
                Err(DnsServerError::Exited { said, .. }) if said.contains("in use") => last = said,
                Err(err) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    return Err(err);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        Err(DnsServerError::NoPort(PORT_TRIES, last))
    }

    /// One start on `port`: the child once it listens, or what it said when it did not.
    fn start_on(
        binary: &str,
        dir: &Path,
        port: u16,
        domain: &str,
        srv: &[&str],
    ) -> Result<Child, DnsServerError> {
        let log = dir.join("dnsmasq.log");
        let mut cmd = Command::new(binary);
        cmd.args([
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--listen-address=127.0.0.1",
            "--conf-file=/dev/null",
            "--pid-file=",
            "--user=root",
            "--local-ttl=0",
            "--log-facility=-",
        ])
        .arg(format!("--local=/{domain}/"))
        .arg(format!("--port={port}"))
        .arg(format!("--addn-hosts={}", dir.join("hosts").display()));
        for s in srv {
            cmd.arg(format!("--srv-host={s}"));
        }
        // Its log (stderr, with --log-facility=-) goes to a file: read when it fails, and
        // never a pipe it could fill.
        let stderr = std::fs::File::create(&log)?;
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr).spawn()?;
        let at = loopback(port);
        let said = || std::fs::read_to_string(&log).unwrap_or_default().trim().to_owned();
        // Up once it says it started (its sockets are bound before that line) and takes a
        // TCP connection; a SIGHUP before that would end it.
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(DnsServerError::Exited { at, status, said: said() });
            }
            if said().contains("started") && std::net::TcpStream::connect(at).is_ok() {
                return Ok(child);
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(DnsServerError::NotReady { at, within: START_TIMEOUT, said: said() });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Publishes these names and addresses, replacing all before (the file rewritten, then
    /// SIGHUP: dnsmasq reads it again).
    pub fn publish(&self, entries: &[(IpAddr, &str)]) -> std::io::Result<()> {
        let text: String = entries.iter().map(|(ip, name)| format!("{ip} {name}\n")).collect();
        let tmp = self.dir.join("hosts.new");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, self.dir.join("hosts"))?;
        let status = Command::new("kill").args(["-HUP", &self.child.id().to_string()]).status()?;
        if !status.success() {
            return Err(std::io::Error::other("dnsmasq did not take SIGHUP"));
        }
        Ok(())
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A file-name-safe tag.
fn blake_free_tag(tag: &str) -> String {
    tag.chars().filter(char::is_ascii_alphanumeric).collect()
}

impl Drop for DnsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
