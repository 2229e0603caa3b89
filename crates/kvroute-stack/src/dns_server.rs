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
    #[error("dnsmasq did not listen on {0} within {1:?}")]
    NotReady(SocketAddr, Duration),
}

const START_TIMEOUT: Duration = Duration::from_secs(10);

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
    pub fn start(domain: &str, srv: &[&str]) -> Result<Self, DnsServerError> {
        let binary = Self::binary().ok_or(DnsServerError::Missing)?;
        let tag = format!("{}-{:?}", std::process::id(), Instant::now());
        let dir = std::env::temp_dir().join(format!("kvroute-dns-{}", blake_free_tag(&tag)));
        std::fs::create_dir_all(&dir)?;
        let hosts = dir.join("hosts");
        std::fs::write(&hosts, "")?;
        // A free port: bound, then handed to dnsmasq (it cannot take a socket).
        let port = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
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
        .arg(format!("--addn-hosts={}", hosts.display()));
        for s in srv {
            cmd.arg(format!("--srv-host={s}"));
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
        let at = SocketAddr::from(([127, 0, 0, 1], port));
        let server = Self { child, at, dir };
        // Up once it takes connections (TCP beside UDP); a SIGHUP before that would end it.
        let deadline = Instant::now() + START_TIMEOUT;
        while std::net::TcpStream::connect(at).is_err() {
            if Instant::now() >= deadline {
                return Err(DnsServerError::NotReady(at, START_TIMEOUT));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(server)
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
