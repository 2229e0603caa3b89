//! The router's state on disk (`--state-dir`, #80): a router that restarts (a rolling
//! upgrade of kvroute itself) routes its first minute as well as its last.
//!
//! ```text
//!  every 30 s and at shutdown: the index as events + each worker rank's last sequence number
//!      ──▶ {dir}/router-state.json (written whole to a temporary file, then renamed)
//!  at start: read ──▶ the events of the workers configured again at the same URL applied,
//!      their last sequence numbers kept ──▶ each subscription asks its engine's replay for
//!      what followed (an engine that restarted meanwhile sends numbers that go back: its
//!      blocks are cleared, as for any restart)
//! ```
//!
//! A file of another format version or block size is refused and named (the router then
//! starts empty). What it does not carry: the predictor's learned corrections (they are
//! learned again from the first answers) and adapters' residency (read again from the
//! engines within seconds).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::{RouterEvent, WorkerId, WorkerWithDpRank};
use serde::{Deserialize, Serialize};

use crate::state::RouterState;

/// The file in the state directory.
pub const FILE: &str = "router-state.json";
/// Its format's version.
pub const VERSION: u32 = 1;
/// How often a running router writes it.
pub const SAVE_EVERY: Duration = Duration::from_secs(30);
/// Largest file read.
const MAX_BYTES: u64 = 1 << 30;

/// What a router keeps across a restart.
#[derive(Debug, Serialize, Deserialize)]
pub struct Saved {
    pub version: u32,
    pub block_size: u32,
    /// Unix milliseconds when it was written.
    pub taken_at_ms: u64,
    pub workers: Vec<SavedWorker>,
    /// The index, as the events that build it again.
    pub events: Vec<RouterEvent>,
}

/// A worker as it was: where it was, and the last event batch seen of each rank.
#[derive(Debug, Serialize, Deserialize)]
pub struct SavedWorker {
    pub id: WorkerId,
    pub url: Option<String>,
    pub last_seq: Vec<Option<u64>>,
}

#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    #[error("{path}: format version {found}, this kvroute reads {VERSION}: not loaded")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: blocks of {found} tokens, this router's are {ours}: not loaded")]
    BlockSize { path: PathBuf, found: u32, ours: u32 },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a saved router state: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
}

/// What a load brought back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    pub workers: usize,
    pub events: usize,
    /// Workers in the file that are not configured again at the same URL.
    pub skipped: usize,
}

/// The router's state now.
pub fn take(state: &RouterState) -> Saved {
    let view = state.view();
    let workers = view
        .workers()
        .into_iter()
        .filter(|w| w.configured)
        .map(|w| SavedWorker { id: w.id, url: w.url.clone(), last_seq: w.last_seq })
        .collect();
    let taken_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let block_size = state.config.block_size.tokens() as u32;
    Saved { version: VERSION, block_size, taken_at_ms, workers, events: view.index_as_events() }
}

/// Writes the router's state to `dir` (whole: a temporary file renamed over the last one).
pub fn save(state: &RouterState, dir: &Path) -> Result<usize, SavedError> {
    let saved = take(state);
    let path = dir.join(FILE);
    let io = |source| SavedError::Io { path: path.clone(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let json = serde_json::to_vec(&saved)
        .map_err(|source| SavedError::Json { path: path.clone(), source })?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    std::fs::write(&tmp, json).map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(saved.events.len())
}

/// Reads `dir`'s saved state (`None`: there is none) for a router of `block_size` tokens.
pub fn load(dir: &Path, block_size: u32) -> Result<Option<Saved>, SavedError> {
    let path = dir.join(FILE);
    let io = |source| SavedError::Io { path: path.clone(), source };
    let file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_BYTES), &mut bytes)
        .map_err(io)?;
    #[derive(Deserialize)]
    struct Head {
        version: u32,
        block_size: u32,
    }
    let json = |source| SavedError::Json { path: path.clone(), source };
    let head: Head = serde_json::from_slice(&bytes).map_err(json)?;
    if head.version != VERSION {
        return Err(SavedError::Version { path, found: head.version });
    }
    if head.block_size != block_size {
        return Err(SavedError::BlockSize { path, found: head.block_size, ours: block_size });
    }
    Ok(Some(serde_json::from_slice(&bytes).map_err(json)?))
}

/// Brings `saved` back into a router that has not started its subscriptions yet: the events of
/// the workers configured again at the same URL, and where their event streams were.
pub fn restore(state: &RouterState, saved: Saved) -> Restored {
    let mut restored = Restored::default();
    let mut kept = std::collections::BTreeSet::new();
    for w in saved.workers {
        let same = state.config.workers.iter().any(|c| c.id == w.id && c.url == w.url);
        if !same {
            restored.skipped += 1;
            continue;
        }
        for (rank, seq) in w.last_seq.iter().enumerate() {
            if let Some(seq) = seq {
                state.fleet.resume_at(WorkerWithDpRank::new(w.id, rank as u32), *seq);
            }
        }
        kept.insert(w.id);
        restored.workers += 1;
    }
    let events: Vec<RouterEvent> =
        saved.events.into_iter().filter(|e| kept.contains(&e.worker_id)).collect();
    restored.events = state.apply(&events);
    restored
}

/// Loads `dir`'s state into `state` (logged; a refused file is named and the router starts
/// empty), then writes it every [`SAVE_EVERY`] until the router is dropped.
pub fn follow(state: &Arc<RouterState>, dir: PathBuf) -> tokio::task::JoinHandle<()> {
    let block_size = state.config.block_size.tokens() as u32;
    match load(&dir, block_size) {
        Ok(Some(saved)) => {
            let age_s = saved_age_s(saved.taken_at_ms);
            let r = restore(state, saved);
            tracing::info!(dir = %dir.display(), workers = r.workers, events = r.events, skipped = r.skipped, age_s, "router state loaded");
        }
        Ok(None) => tracing::info!(dir = %dir.display(), "no saved router state: starting empty"),
        Err(err) => tracing::error!(%err, "saved router state refused: starting empty"),
    }
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SAVE_EVERY).await;
            let Some(state) = weak.upgrade() else { return };
            if let Err(err) = save(&state, &dir) {
                tracing::warn!(%err, "router state not saved");
            }
        }
    })
}

fn saved_age_s(taken_at_ms: u64) -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    now.saturating_sub(taken_at_ms) as f64 / 1e3
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvroute_core::{
        ExternalBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
        KvCacheStoredBlockData, LocalBlockHash,
    };

    use super::*;
    use crate::config::{RouterConfig, WorkerSpec};

    fn router(url: &str) -> RouterState {
        let mut spec = WorkerSpec::new(7);
        spec.url = Some(url.to_owned());
        RouterState::new(RouterConfig { workers: vec![spec], ..RouterConfig::default() })
    }

    fn chain(n: u64) -> RouterEvent {
        let blocks = (1..=n)
            .map(|h| KvCacheStoredBlockData {
                block_hash: ExternalBlockHash(h),
                tokens_hash: LocalBlockHash(h * 10),
                mm_extra_info: None,
            })
            .collect();
        let data = KvCacheEventData::Stored(KvCacheStoreData { parent_hash: None, blocks });
        RouterEvent::new(WorkerId(7), KvCacheEvent::new(0, data, 0))
    }

    /// Saved and loaded again: the same index, and the event stream resumes after the last
    /// batch seen; a worker configured at another URL is not given the old one's blocks; a
    /// file of another block size or version is refused and named.
    #[test]
    fn a_saved_router_comes_back_with_its_index_and_streams() {
        let dir = std::env::temp_dir().join(format!("kvroute-saved-{}", std::process::id()));
        let rank = WorkerWithDpRank::new(7u64, 0u32);
        let before = router("http://10.0.0.1:8000");
        assert_eq!(before.apply(&[chain(5)]), 1);
        before.fleet.resume_at(rank, 41);
        assert!(save(&before, &dir).unwrap() > 0);

        let after = router("http://10.0.0.1:8000");
        let saved = load(&dir, 16).unwrap().unwrap();
        let r = restore(&after, saved);
        assert_eq!((r.workers, r.skipped), (1, 0));
        assert_eq!(after.view().tree_size(rank), 5);
        assert_eq!(after.fleet.last_seq(rank), Some(41));

        let moved = router("http://10.0.0.2:8000");
        let r = restore(&moved, load(&dir, 16).unwrap().unwrap());
        assert_eq!((r.workers, r.events, r.skipped), (0, 0, 1));
        assert_eq!((moved.view().tree_size(rank), moved.fleet.last_seq(rank)), (0, None));

        let err = load(&dir, 32).unwrap_err().to_string();
        assert!(err.contains("blocks of 16 tokens, this router's are 32"), "{err}");
        let path = dir.join(FILE);
        let text =
            std::fs::read_to_string(&path).unwrap().replace("\"version\":1", "\"version\":9");
        std::fs::write(&path, text).unwrap();
        let err = load(&dir, 16).unwrap_err().to_string();
        assert!(err.contains("format version 9"), "{err}");
        std::fs::write(&path, b"{not json").unwrap();
        assert!(matches!(load(&dir, 16), Err(SavedError::Json { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(load(&dir, 16).unwrap().is_none(), "no file: nothing to load");
    }
}
