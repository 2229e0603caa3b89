//! A NATS JetStream key-value bucket as a source of members ([`BucketSource`]), and the
//! registration that keeps a worker in it ([`register`]): the form that needs neither
//! Kubernetes nor DNS.
//!
//! Each entry is one worker, signed with the fleet's registration key ([`super::signed`]): its
//! key is `w<id>`, the id made from its URL; an entry a router cannot verify never joins, and
//! is counted once. At the bound ([`MAX_MEMBERS_PER_SOURCE`]) the members held are kept and
//! newcomers wait: a flood of registrations pushes nobody out. A registration is renewed
//! every third of the time to live; one not renewed within it is dropped here (and the
//! bucket's own `max_age` removes it from the server), so a worker whose sidecar died
//! drains. A registration deleted on purpose (the sidecar stopping) drains it at once. Every
//! replica and picker watches the same bucket: they see the same members within the watch's
//! delivery (milliseconds) and, for one that stopped renewing, within the time to live.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, kv};
use futures_util::StreamExt;

use super::signed::{AddressRange, MAX_ENTRY_BYTES, MembersKey, Verifier, sign};
use super::source::{MAX_MEMBERS_PER_SOURCE, Sink, Source};
use super::template::id_for;
use crate::config::WorkerSpec;
use crate::nats::{NatsConfig, NatsStatus};

/// A registration's time to live, unless configured.
pub const MEMBERS_TTL: Duration = Duration::from_secs(10);

/// The bucket a fleet's workers register in.
#[derive(Clone, Debug)]
pub struct BucketConfig {
    pub nats: NatsConfig,
    pub bucket: String,
    pub ttl: Duration,
    /// The fleet's registration key: a sidecar signs with it, a router takes only what it
    /// signed.
    pub key: MembersKey,
    /// When not empty, a registered worker's endpoints must all be addresses in these.
    pub allow: Vec<AddressRange>,
}

impl BucketConfig {
    fn verifier(&self) -> Verifier {
        Verifier {
            key: self.key.clone(),
            bucket: self.bucket.clone(),
            ttl: self.ttl,
            allow: self.allow.clone(),
        }
    }
}

/// Why a registration cannot be made or read.
#[derive(Debug, thiserror::Error)]
pub enum BucketError {
    #[error("NATS: {0}")]
    Nats(String),
    #[error("a registration: {0}")]
    Entry(String),
}

fn nats_error(e: impl std::fmt::Display) -> BucketError {
    BucketError::Nats(e.to_string())
}

/// The bucket, created when it is not there yet (by whichever replica or sidecar comes first).
async fn open(config: &BucketConfig) -> Result<kv::Store, BucketError> {
    let status = Arc::new(NatsStatus::default());
    let client = crate::nats::connect_options(&config.nats, status)
        .connect(config.nats.url.as_str())
        .await
        .map_err(nats_error)?;
    let js = jetstream::new(client);
    if let Ok(store) = js.get_key_value(config.bucket.as_str()).await {
        return Ok(store);
    }
    let bucket = kv::Config {
        bucket: config.bucket.clone(),
        history: 1,
        max_age: config.ttl,
        max_value_size: MAX_ENTRY_BYTES as i32,
        ..Default::default()
    };
    match js.create_key_value(bucket).await {
        Ok(store) => Ok(store),
        // Another made it meanwhile.
        Err(_) => js.get_key_value(config.bucket.as_str()).await.map_err(nats_error),
    }
}

/// A worker as `POST /workers` takes it (JSON), its id made from its URL when absent.
pub fn parse_entry(value: &[u8]) -> Result<WorkerSpec, BucketError> {
    if value.len() > MAX_ENTRY_BYTES {
        return Err(BucketError::Entry(format!(
            "{} bytes (at most {MAX_ENTRY_BYTES})",
            value.len()
        )));
    }
    let mut json: serde_json::Value =
        serde_json::from_slice(value).map_err(|e| BucketError::Entry(e.to_string()))?;
    let object = json.as_object_mut().ok_or_else(|| BucketError::Entry("not an object".into()))?;
    if !object.contains_key("id") {
        let address = ["url", "events"].iter().find_map(|k| object.get(*k)?.as_str());
        let address = address.ok_or_else(|| BucketError::Entry("no id, url or events".into()))?;
        object.insert("id".into(), serde_json::json!(id_for(address).0));
    }
    serde_json::from_value(json).map_err(|e| BucketError::Entry(e.to_string()))
}

/// Follows a bucket (see the module docs).
#[derive(Debug)]
pub struct BucketSource {
    config: BucketConfig,
}

impl BucketSource {
    pub fn new(config: BucketConfig) -> Self {
        Self { config }
    }
}

/// Most refused keys remembered (so that each is counted once); past it, refusals are no
/// longer counted.
const MAX_REFUSED_KEYS: usize = 64 * 1024;

/// What the bucket holds, as this process last heard it.
#[derive(Debug)]
struct Registrations {
    verifier: Verifier,
    /// Each key's worker and when its registration was last heard.
    entries: BTreeMap<String, (WorkerSpec, Instant)>,
    /// Keys whose value was refused (each counted and logged once).
    refused: std::collections::BTreeSet<String>,
}

impl Registrations {
    fn new(verifier: Verifier) -> Self {
        Self { verifier, entries: BTreeMap::new(), refused: Default::default() }
    }

    /// One entry heard; whether the set changed.
    fn heard(&mut self, entry: &kv::Entry, sink: &Sink) -> bool {
        match entry.operation {
            kv::Operation::Put => match self.verifier.verify(&entry.key, &entry.value) {
                Ok(spec) => {
                    // At the bound, the members held stay and a newcomer waits (counted once).
                    let full = self.entries.len() >= MAX_MEMBERS_PER_SOURCE;
                    if full && !self.entries.contains_key(&entry.key) {
                        self.refuse(&entry.key, sink, &"the members' bound is reached");
                        return false;
                    }
                    self.refused.remove(&entry.key);
                    let old =
                        self.entries.insert(entry.key.clone(), (spec.clone(), Instant::now()));
                    old.is_none_or(|(o, _)| o != spec)
                }
                Err(err) => {
                    // A value that cannot be verified changes nothing: a member written over
                    // stays until its own registration lapses or is deleted.
                    self.refuse(&entry.key, sink, &err);
                    false
                }
            },
            kv::Operation::Delete | kv::Operation::Purge => {
                self.entries.remove(&entry.key).is_some()
            }
        }
    }

    /// A refused registration: counted and logged the first time its key is refused.
    fn refuse(&mut self, key: &str, sink: &Sink, why: &dyn std::fmt::Display) {
        if self.refused.len() < MAX_REFUSED_KEYS && self.refused.insert(key.to_owned()) {
            sink.count_refused(1);
            if self.refused.len() <= MAX_MEMBERS_PER_SOURCE {
                tracing::warn!(source = sink.source(), key, %why, "a registration refused");
            }
        }
    }

    /// Drops registrations not renewed within `ttl`; whether any was.
    fn expire(&mut self, ttl: Duration) -> bool {
        let before = self.entries.len();
        self.entries.retain(|_, (_, heard)| heard.elapsed() < ttl);
        before != self.entries.len()
    }

    fn specs(&self) -> Vec<WorkerSpec> {
        self.entries.values().map(|(spec, _)| spec.clone()).collect()
    }
}

impl Source for BucketSource {
    fn name(&self) -> String {
        "nats".to_owned()
    }

    fn run(self: Box<Self>, sink: Sink) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                if let Err(err) = self.follow(&sink).await {
                    tracing::warn!(bucket = %self.config.bucket, %err, "the members' bucket cannot be watched: the members stay as they are");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        })
    }
}

impl BucketSource {
    /// Watches the bucket until the watch breaks, offering the whole set on each change.
    async fn follow(&self, sink: &Sink) -> Result<(), BucketError> {
        let store = open(&self.config).await?;
        let mut watch = store.watch_with_history(">").await.map_err(nats_error)?;
        let mut held = Registrations::new(self.config.verifier());
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        // The history comes first; its end (or an empty bucket) is when the set is known.
        let mut current = store.status().await.map_err(nats_error)?.values() == 0;
        if current {
            sink.offer(Vec::new());
        }
        loop {
            tokio::select! {
                next = watch.next() => {
                    let Some(entry) = next else { return Ok(()) };
                    let entry = entry.map_err(nats_error)?;
                    let changed = held.heard(&entry, sink);
                    current |= entry.delta == 0 || entry.seen_current;
                    if current && (changed || entry.delta == 0) {
                        sink.offer(held.specs());
                    }
                }
                _ = tick.tick() => {
                    if held.expire(self.config.ttl) && current {
                        sink.offer(held.specs());
                    }
                }
            }
        }
    }
}

/// Keeps `spec` registered (under `w<id>`, the id made from its URL) until `stop` resolves,
/// signed anew with the fleet's key and renewed every third of the time to live; then deletes
/// the registration (the routers drain the worker at once).
pub async fn register(
    config: &BucketConfig,
    spec: &serde_json::Value,
    stop: impl Future<Output = ()>,
) -> Result<(), BucketError> {
    let signed =
        || sign(&config.key, &config.bucket, spec).map_err(|e| BucketError::Entry(e.to_string()));
    let (key, _) = signed()?;
    let store = open(config).await?;
    let mut tick = tokio::time::interval(config.ttl / 3);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let (_, value) = signed()?;
                if let Err(err) = store.put(key.as_str(), value.into()).await {
                    tracing::warn!(%err, key, "registration not renewed; trying again");
                }
            }
            () = &mut stop => break,
        }
    }
    store.delete(key.as_str()).await.map_err(nats_error)?;
    tracing::info!(key, "registration deleted");
    Ok(())
}
