//! The decision log (docs/tracing.md): a sampled share of routing decisions appended to a file
//! as JSON lines, each with the request's id, its blocks, the candidates with their cost terms
//! and the choice. The lines are written by a thread of their own from a bounded queue (a
//! decision never waits on the disk: past the queue, a line is dropped and counted); the last
//! [`KEPT`] logged stay in memory, so `/decisions/{id}` can show a request's decision. Which
//! decisions are logged is a keyed hash of the request's id (the key drawn at start), so no
//! caller picks ids that are always logged; the file is rotated past its size, a bounded
//! number of files kept.

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use kvroute_core::WorkerWithDpRank;
use kvroute_core::schedule::DecisionRecord;
use serde_json::{Value, json};

/// Lines waiting for the writer; past it a line is dropped.
const QUEUED: usize = 4096;
/// Logged decisions kept in memory for `/decisions/{id}`.
const KEPT: usize = 1024;

use crate::config::DecisionLogConfig;

#[derive(Debug)]
pub struct DecisionLog {
    lines: SyncSender<Arc<str>>,
    /// Ids whose keyed hash is at most this are logged.
    threshold: u64,
    /// The sampling hash's key, drawn at start.
    key: [u8; 32],
    kept: Mutex<VecDeque<(String, Arc<str>)>>,
    dropped: AtomicU64,
}

impl DecisionLog {
    /// Opens `config.path` for appending (creating it) and starts its writer.
    pub fn open(config: &DecisionLogConfig) -> std::io::Result<Self> {
        let mut file = Rotating::open(config)?;
        let (lines, queue) = std::sync::mpsc::sync_channel::<Arc<str>>(QUEUED);
        std::thread::Builder::new().name("kvroute-decision-log".to_owned()).spawn(move || {
            // One flush per burst: every line queued is written before the next flush.
            while let Ok(line) = queue.recv() {
                let mut written = file.write(&line);
                while let Ok(line) = queue.try_recv() {
                    written = written.and_then(|()| file.write(&line));
                }
                if let Err(e) = written.and_then(|()| file.flush()) {
                    tracing::warn!(error = %e, "the decision log cannot be written");
                }
            }
        })?;
        let threshold = (config.ratio.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Self {
            lines,
            threshold,
            key,
            kept: Mutex::new(VecDeque::new()),
            dropped: AtomicU64::new(0),
        })
    }

    /// Whether request `id`'s decision is logged.
    pub fn sampled(&self, id: &str) -> bool {
        if self.threshold == 0 {
            return false;
        }
        let hash = blake3::keyed_hash(&self.key, id.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash.as_bytes()[..8]);
        self.threshold == u64::MAX || u64::from_le_bytes(first) <= self.threshold
    }

    /// Logs a decision: its record (the chosen candidate and the cheapest others, with their
    /// terms) when the scheduler kept one, else where it went; `blocks`: the request's hashes.
    pub fn log(
        &self,
        id: &str,
        blocks: usize,
        record: Option<&DecisionRecord>,
        (decode, prefill): (WorkerWithDpRank, Option<WorkerWithDpRank>),
    ) {
        let line = line(id, blocks, record, (decode, prefill));
        let line: Arc<str> = Arc::from(line.to_string());
        {
            let mut kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back((id.to_owned(), Arc::clone(&line)));
        }
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.lines.try_send(line)
        {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Request `id`'s logged decision, while it is among the last [`KEPT`].
    pub fn find(&self, id: &str) -> Option<Value> {
        let kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (_, line) = kept.iter().rev().find(|(logged, _)| logged == id)?;
        serde_json::from_str(line).ok()
    }

    /// Lines dropped since the start (the writer fell behind).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// Request `id`'s decision as `/decisions/{id}` shows it: its logged line (the log keeps the
/// last [`KEPT`] in memory), else its record among the scheduler's recent decisions; none
/// when neither holds it.
pub fn decision_of(
    log: Option<&DecisionLog>,
    scheduling: &super::Scheduling,
    id: &str,
) -> Option<Value> {
    if let Some(line) = log.and_then(|l| l.find(id)) {
        return Some(line);
    }
    scheduling.decision_of(id).map(|r| json!(r))
}

/// Opens `path` to append to, creating it.
fn open(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new().create(true).append(true).open(path)
}

/// The log's file, rotated past its size ([`DecisionLogConfig::max_bytes`]).
struct Rotating {
    path: std::path::PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    written: u64,
    max_bytes: u64,
    files: usize,
}

impl Rotating {
    fn open(config: &DecisionLogConfig) -> std::io::Result<Self> {
        let file = open(&config.path)?;
        let written = file.metadata()?.len();
        Ok(Self {
            path: config.path.clone(),
            out: std::io::BufWriter::new(file),
            written,
            max_bytes: config.max_bytes.max(1),
            files: config.files.max(1),
        })
    }

    fn write(&mut self, line: &str) -> std::io::Result<()> {
        if self.written > 0 && self.written + line.len() as u64 + 1 > self.max_bytes {
            self.rotate()?;
        }
        writeln!(self.out, "{line}")?;
        self.written += line.len() as u64 + 1;
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }

    /// `path.{files-2}` becomes `path.{files-1}` (the oldest kept goes), ..., `path` becomes
    /// `path.1`; a new `path` is begun. With one file, `path` is begun again.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        let numbered = |k: usize| {
            let mut name = self.path.clone().into_os_string();
            name.push(format!(".{k}"));
            std::path::PathBuf::from(name)
        };
        for k in (1..self.files).rev() {
            let from = if k == 1 { self.path.clone() } else { numbered(k - 1) };
            if from.exists() {
                std::fs::rename(&from, numbered(k))?;
            }
        }
        let file =
            std::fs::OpenOptions::new().create(true).write(true).truncate(true).open(&self.path)?;
        self.out = std::io::BufWriter::new(file);
        self.written = 0;
        Ok(())
    }
}

/// One decision as its log line.
fn line(
    id: &str,
    blocks: usize,
    record: Option<&DecisionRecord>,
    (decode, prefill): (WorkerWithDpRank, Option<WorkerWithDpRank>),
) -> Value {
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut line = json!({"request": id, "at_ms": at_ms, "blocks": blocks, "chosen": decode});
    if let Some(prefill) = prefill {
        line["prefill"] = json!(prefill);
    }
    if let Some(r) = record {
        line["at_ms"] = json!(r.at_ms);
        line["isl_tokens"] = json!(r.isl_tokens);
        line["considered"] = json!(r.considered);
        line["cost_unit"] = json!(r.cost_unit);
        line["candidates"] = json!(r.candidates);
    }
    line
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn config(path: std::path::PathBuf, ratio: f64) -> DecisionLogConfig {
        DecisionLogConfig {
            path,
            ratio,
            max_bytes: crate::config::DEFAULT_DECISION_LOG_MAX_BYTES,
            files: crate::config::DEFAULT_DECISION_LOG_FILES,
        }
    }

    /// Ids a caller could choose are not always logged: two logs (two starts) sample
    /// different ids at the same ratio.
    #[test]
    fn the_ids_logged_are_not_the_callers_to_choose() {
        let dir = std::env::temp_dir().join(format!("kvroute-dlog3-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = DecisionLog::open(&config(dir.join("a.jsonl"), 0.1)).unwrap();
        let b = DecisionLog::open(&config(dir.join("b.jsonl"), 0.1)).unwrap();
        let chosen: Vec<String> =
            (0..10_000).map(|i| format!("kvr-{i}")).filter(|id| a.sampled(id)).collect();
        let again = chosen.iter().filter(|id| b.sampled(id)).count();
        assert!(again < chosen.len() / 2, "{again} of {}", chosen.len());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Past its size the file is rotated: at most `files` files, each within the size.
    #[test]
    fn the_file_is_rotated_and_the_files_kept_are_bounded() {
        let dir = std::env::temp_dir().join(format!("kvroute-dlog4-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let config = DecisionLogConfig { max_bytes: 1000, files: 3, ..config(path, 1.0) };
        let mut file = Rotating::open(&config).unwrap();
        let line = "x".repeat(99);
        for _ in 0..100 {
            file.write(&line).unwrap();
        }
        file.flush().unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["d.jsonl", "d.jsonl.1", "d.jsonl.2"]);
        for name in &names {
            let len = std::fs::metadata(dir.join(name)).unwrap().len();
            assert!(len <= 1000 && len > 0, "{name}: {len}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The ratio is the share logged, by the ids' hashes: none at 0, all at 1, near it between.
    #[test]
    fn the_share_logged_follows_the_ratio() {
        let dir = std::env::temp_dir().join(format!("kvroute-dlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let share = |ratio: f64| {
            let log = DecisionLog::open(&config(dir.join("d.jsonl"), ratio)).unwrap();
            (0..10_000).filter(|i| log.sampled(&format!("kvr-{i}"))).count()
        };
        assert_eq!(share(0.0), 0);
        assert_eq!(share(1.0), 10_000);
        let tenth = share(0.1);
        assert!((800..1200).contains(&tenth), "{tenth}");
    }

    /// A logged decision is appended as one JSON line and found by its id.
    #[test]
    fn a_logged_decision_is_a_line_and_found_by_its_id() {
        let dir = std::env::temp_dir().join(format!("kvroute-dlog2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let _ = std::fs::remove_file(&path);
        let log = DecisionLog::open(&config(path.clone(), 1.0)).unwrap();
        let w = WorkerWithDpRank::new(3u64, 0u32);
        log.log("kvr-7", 12, None, (w, None));
        assert_eq!(log.find("kvr-7").unwrap()["blocks"], 12);
        assert!(log.find("kvr-8").is_none());
        drop(log); // the writer drains its queue and ends
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if let Some(first) = text.lines().next() {
                let v: Value = serde_json::from_str(first).unwrap();
                assert_eq!(
                    (v["request"].as_str(), v["chosen"]["worker_id"].as_u64()),
                    (Some("kvr-7"), Some(3))
                );
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the line was not written");
            std::thread::yield_now();
        }
    }
}
