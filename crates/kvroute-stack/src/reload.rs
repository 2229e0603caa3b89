//! The configuration file as a source of members ([`ReloadSource`]): its `[[workers]]` read
//! again whenever the file changes (checked every second), merged with the flags as at start,
//! and offered with the stack's simulated workers (which the file does not list) as the
//! `config` source's set: a worker added to the file joins, one removed drains.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kvroute_router::WorkerSpec;
use kvroute_router::members::{Sink, Source};

/// How often the file's modification time is looked at.
const EVERY: Duration = Duration::from_secs(1);

/// The workers the configuration names now (flags, environment and the file, merged).
pub type ReadWorkers = Arc<dyn Fn() -> Result<Vec<WorkerSpec>, crate::StackError> + Send + Sync>;

/// The file to follow and how to read it.
#[derive(Clone)]
pub struct Reload {
    pub path: PathBuf,
    pub workers: ReadWorkers,
}

impl std::fmt::Debug for Reload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reload").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Follows the configuration file (see the module docs).
#[derive(Debug)]
pub struct ReloadSource {
    reload: Reload,
    /// Workers the file does not list but the configuration's source holds (the stack's
    /// simulated ones).
    also: Vec<WorkerSpec>,
    /// The file as the stack started with it: taken here, not when the task first runs, so
    /// a change made right after the start is not taken for the starting point.
    seen: Option<(SystemTime, u64)>,
}

impl ReloadSource {
    pub fn new(reload: Reload, also: Vec<WorkerSpec>) -> Self {
        let mut source = Self { reload, also, seen: None };
        source.seen = source.stamp();
        source
    }

    fn stamp(&self) -> Option<(SystemTime, u64)> {
        let meta = std::fs::metadata(&self.reload.path).ok()?;
        Some((meta.modified().ok()?, meta.len()))
    }
}

impl Source for ReloadSource {
    fn name(&self) -> String {
        "config".to_owned()
    }

    fn run(self: Box<Self>, sink: Sink) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut seen = self.seen;
            loop {
                tokio::time::sleep(EVERY).await;
                let now = self.stamp();
                if now == seen {
                    continue;
                }
                seen = now;
                match (self.reload.workers)() {
                    Ok(mut workers) => {
                        workers.extend(self.also.iter().cloned());
                        let offered = sink.offer(workers);
                        tracing::info!(path = %self.reload.path.display(), joined = offered.joined.len(), drained = offered.drained.len(), "the configuration's workers read again");
                    }
                    Err(err) => {
                        tracing::warn!(path = %self.reload.path.display(), %err, "the configuration cannot be read again: the workers stay as they are");
                    }
                }
            }
        })
    }
}
