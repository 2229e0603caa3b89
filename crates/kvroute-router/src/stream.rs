//! The event plane on JetStream (docs/replicas.md): a relay writes the engines' events into one
//! stream, a subject per worker rank; every replica consumes it in order; snapshots of the
//! index (as events, with the stream sequence they cover) let a new replica start warm.
//!
//! Relay: batches come from the ordinary ZMQ subscriptions ([`crate::subscriber`]), which
//! keep doing gap detection, engine replay and restart handling; each batch is published with
//! `Nats-Msg-Id: {worker}.{rank}.{engine seq}` (the stream drops a duplicate within its window)
//! and `Kvroute-Seq: {engine seq}`. A restarted relay reads each subject's last `Kvroute-Seq`
//! and asks the engine's replay for what follows, so it resumes without duplicates. While NATS
//! is away a batch is retried until stored; the queue behind it fills, the ZMQ sockets drop
//! and the subscriptions recover the gap from the engines' replay once it drains.
//!
//! Consumer: loads the latest snapshot (if any), then an ordered consumer from the sequence
//! after it; every message's events are applied as an engine's would be. The workers are
//! ready once the consumer has seen what the stream held when it started.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{DeliverPolicy, push};
use async_nats::jetstream::{self, object_store, stream as js_stream};
use async_nats::{Client, HeaderMap};
use futures_util::StreamExt;
use kvroute_core::{WorkerId, WorkerWithDpRank};
use kvroute_wire::replica::{IndexSnapshot, decode_snapshot, encode_snapshot};
use kvroute_wire::{ConvertConfig, EventFormat, Framed, Pipeline};
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

use crate::config::replicas::NatsConfig;
use crate::links::{NatsStatus, Relayed};
use crate::plane::EventPlane;
use crate::state::{Link, RouterState};
use crate::subscriber;

/// Batches waiting for the relay's publisher.
pub(crate) const RELAY_QUEUE: usize = 1024;
/// How long a stream message is remembered to drop its duplicate.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
const SEQ_HEADER: &str = "Kvroute-Seq";
const SNAPSHOT_OBJECT: &str = "index";
/// Snapshots are written at most this often, whatever `snapshot_every` says.
const MIN_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(1);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn ensure_stream(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<js_stream::Stream, BoxError> {
    Ok(js
        .get_or_create_stream(js_stream::Config {
            name: config.stream_name(),
            subjects: vec![config.events_filter()],
            max_bytes: config.stream_max_bytes,
            max_age: config.stream_max_age,
            duplicate_window: DUPLICATE_WINDOW,
            storage: js_stream::StorageType::File,
            ..Default::default()
        })
        .await?)
}

/// The relay: learns where each rank's subject ends, starts the ZMQ subscriptions from there,
/// and publishes what they hand over, in order.
pub(crate) async fn relay(
    state: Arc<RouterState>,
    client: Client,
    config: NatsConfig,
    mut rx: mpsc::Receiver<Relayed>,
    plane: Option<EventPlane>,
) {
    let js = jetstream::new(client);
    let stream = loop {
        match ensure_stream(&js, &config).await {
            Ok(s) => break s,
            Err(err) => {
                tracing::warn!(%err, "relay: the event stream is not reachable yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    let mut subscriptions = Vec::new();
    for mut sub in subscriber::subscriptions(&state) {
        let last = last_relayed(&stream, &config.events_subject(sub.worker)).await;
        if let Some(seq) = last {
            tracing::info!(worker = %sub.worker, seq, "relay resumes after the stream's last batch");
        }
        sub.resume_after = last;
        let run = subscriber::run(Arc::clone(&state), sub);
        subscriptions.push(match &plane {
            Some(plane) => plane.spawn(run),
            None => tokio::spawn(run),
        });
    }
    let (_subscriptions, _plane) = (crate::tasks::AbortAll(subscriptions), plane);
    while let Some(batch) = rx.recv().await {
        publish_until_stored(&state, &js, &config, &batch).await;
    }
}

/// The engine sequence of a subject's last message (`None`: nothing relayed yet).
async fn last_relayed(stream: &js_stream::Stream, subject: &str) -> Option<u64> {
    loop {
        match stream.get_last_raw_message_by_subject(subject).await {
            Ok(message) => {
                return message.headers.get(SEQ_HEADER).and_then(|v| v.as_str().parse().ok());
            }
            Err(err)
                if matches!(err.kind(), js_stream::LastRawMessageErrorKind::NoMessageFound) =>
            {
                return None;
            }
            Err(err) => {
                tracing::warn!(%err, subject, "relay: cannot read the subject's last message yet");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

async fn publish_until_stored(
    state: &RouterState,
    js: &jetstream::Context,
    config: &NatsConfig,
    batch: &Relayed,
) {
    let subject = config.events_subject(batch.worker);
    let payload: bytes::Bytes = serde_json::to_vec(&batch.events).unwrap_or_default().into();
    let mut headers = HeaderMap::new();
    if let Some(seq) = batch.seq {
        let id = format!("{}.{}.{seq}", batch.worker.worker_id.0, batch.worker.dp_rank.0);
        headers.insert("Nats-Msg-Id", id.as_str());
        headers.insert(SEQ_HEADER, seq.to_string().as_str());
    }
    let mut backoff = Duration::from_millis(50);
    loop {
        let sent = js.publish_with_headers(subject.clone(), headers.clone(), payload.clone()).await;
        let acked = match sent {
            Ok(ack) => ack.await.map_err(BoxError::from),
            Err(err) => Err(err.into()),
        };
        match acked {
            Ok(ack) if ack.duplicate => return state.metrics.stream_message("duplicate"),
            Ok(_) => return state.metrics.stream_message("relayed"),
            Err(err) => {
                state.metrics.stream_message("retried");
                tracing::debug!(%err, %subject, "relay: batch not stored yet; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Follows the stream forever: snapshot first, then every message in order.
pub(crate) async fn consume(
    state: Arc<RouterState>,
    client: Client,
    config: NatsConfig,
    status: Arc<NatsStatus>,
) {
    let js = jetstream::new(client.clone());
    let mut cursor = Cursor { next: 1, loaded: false, since_snapshot: 0, last_snapshot: None };
    let writer = SnapshotWriter::default();
    loop {
        if let Err(err) =
            consume_once(&state, &client, &js, &config, &status, &mut cursor, &writer).await
        {
            tracing::debug!(%err, next = cursor.next, "event stream consumer stopped; resuming");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

struct Cursor {
    /// The stream sequence to apply next.
    next: u64,
    loaded: bool,
    since_snapshot: u64,
    last_snapshot: Option<Instant>,
}

async fn consume_once(
    state: &Arc<RouterState>,
    client: &Client,
    js: &jetstream::Context,
    config: &NatsConfig,
    status: &NatsStatus,
    cursor: &mut Cursor,
    writer: &SnapshotWriter,
) -> Result<(), BoxError> {
    let mut stream = ensure_stream(js, config).await?;
    if !cursor.loaded {
        load_index(state, js, config, cursor).await?;
    }
    let info = stream.info().await?.state.clone();
    if info.messages > 0 && info.first_sequence > cursor.next {
        state.metrics.stream_message("lost");
        tracing::warn!(
            wanted = cursor.next,
            first = info.first_sequence,
            "the stream no longer holds what follows our index (retention shorter than the snapshot interval?)"
        );
        cursor.next = info.first_sequence;
    }
    let start_at = cursor.next;
    let catch_up_to = info.last_sequence;
    if catch_up_to < start_at {
        mark_caught_up(state, status);
    }
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            filter_subject: config.events_filter(),
            deliver_policy: match start_at {
                0 | 1 => DeliverPolicy::All,
                n => DeliverPolicy::ByStartSequence { start_sequence: n },
            },
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut pipeline = relayed_events();
    while let Some(message) = messages.next().await {
        let message = message?;
        let (seq, pending) = match message.info() {
            Ok(info) => (info.stream_sequence, info.pending),
            Err(_) => continue,
        };
        if seq < cursor.next {
            continue;
        }
        apply_message(state, &mut pipeline, seq, &message.payload);
        cursor.next = seq + 1;
        cursor.since_snapshot += 1;
        status.applied_seq.store(seq, Ordering::Relaxed);
        if seq >= catch_up_to || pending == 0 {
            mark_caught_up(state, status);
        }
        let due = config.snapshot_every > 0
            && cursor.since_snapshot >= config.snapshot_every
            && cursor.last_snapshot.is_none_or(|t| t.elapsed() >= MIN_SNAPSHOT_INTERVAL);
        if due && writer.idle() {
            cursor.since_snapshot = 0;
            cursor.last_snapshot = Some(Instant::now());
            writer.write(Arc::clone(state), js.clone(), config.clone(), seq);
        }
    }
    Ok(())
}

/// The index as the last snapshot left it, once per consumer (a fresh replica's first
/// minutes are a snapshot load, not a replay of the whole stream).
async fn load_index(
    state: &RouterState,
    js: &jetstream::Context,
    config: &NatsConfig,
    cursor: &mut Cursor,
) -> Result<(), BoxError> {
    let started = Instant::now();
    if let Some(snapshot) = load_snapshot(js, config).await? {
        let n = snapshot.events.len();
        state.apply(&snapshot.events);
        cursor.next = snapshot.stream_seq + 1;
        state.metrics.snapshot("loaded");
        tracing::info!(
            stream_seq = snapshot.stream_seq,
            events = n,
            took_ms = started.elapsed().as_millis() as u64,
            "index loaded from the snapshot"
        );
    }
    cursor.loaded = true;
    Ok(())
}

/// The stream carries kvroute `RouterEvent` JSON (what the relay publishes), decoded by the
/// same pipeline as a `kvroute`-format engine. Each event names its worker and rank, so the
/// pipeline's own worker is never used.
fn relayed_events() -> Pipeline {
    let any = WorkerWithDpRank::new(WorkerId(0), 0);
    Pipeline::new(any, EventFormat::Kvroute, ConvertConfig::new(Default::default()))
}

/// One stream message into the index.
fn apply_message(state: &RouterState, pipeline: &mut Pipeline, seq: u64, payload: &[u8]) {
    match pipeline.decode(Framed { seq: Some(seq), payload }) {
        Ok(decoded) => {
            state.apply(&decoded.events);
            state.metrics.stream_message("applied");
        }
        Err(err) => {
            state.metrics.garbage.inc();
            tracing::debug!(%err, seq, "undecodable stream message");
        }
    }
}

fn mark_caught_up(state: &RouterState, status: &NatsStatus) {
    if !status.caught_up.swap(true, Ordering::Relaxed) {
        tracing::info!(
            seq = status.applied_seq.load(Ordering::Relaxed),
            "caught up with the event stream"
        );
        // Every worker that follows the stream is connected and caught up.
        for rank in state.fleet.configured_ranks() {
            state.link(rank, Link::Connected(None));
            state.link(rank, Link::CaughtUp);
        }
    }
}

async fn snapshot_store(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<object_store::ObjectStore, BoxError> {
    let bucket = config.snapshot_bucket();
    match js.get_object_store(&bucket).await {
        Ok(store) => Ok(store),
        Err(_) => Ok(js
            .create_object_store(object_store::Config { bucket, ..Default::default() })
            .await?),
    }
}

async fn load_snapshot(
    js: &jetstream::Context,
    config: &NatsConfig,
) -> Result<Option<IndexSnapshot>, BoxError> {
    let store = snapshot_store(js, config).await?;
    let mut object = match store.get(SNAPSHOT_OBJECT).await {
        Ok(object) => object,
        Err(err) if matches!(err.kind(), object_store::GetErrorKind::NotFound) => return Ok(None),
        Err(err) => return Err(err.into()),
    };
    let mut bytes = Vec::new();
    object.read_to_end(&mut bytes).await?;
    match decode_snapshot(&bytes) {
        Ok(snapshot) => Ok(Some(snapshot)),
        Err(err) => {
            // Not fatal: the stream from its start (within retention) rebuilds the index.
            tracing::warn!(%err, "the stored snapshot is unreadable; reading the stream from its start");
            Ok(None)
        }
    }
}

/// Writes one snapshot at a time, off the consumer's path.
#[derive(Default)]
struct SnapshotWriter {
    busy: Arc<std::sync::atomic::AtomicBool>,
}

impl SnapshotWriter {
    fn idle(&self) -> bool {
        !self.busy.load(Ordering::Relaxed)
    }

    fn write(&self, state: Arc<RouterState>, js: jetstream::Context, config: NatsConfig, seq: u64) {
        // The dump is taken now, on the consumer's task, so it covers exactly `seq`.
        let snapshot = IndexSnapshot {
            stream_seq: seq,
            taken_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            events: state.index.dump_as_events(),
        };
        self.busy.store(true, Ordering::Relaxed);
        let busy = Arc::clone(&self.busy);
        tokio::spawn(async move {
            let bytes = encode_snapshot(&snapshot);
            let stored = async {
                let store = snapshot_store(&js, &config).await?;
                store.put(SNAPSHOT_OBJECT, &mut bytes.as_slice()).await?;
                Ok::<_, BoxError>(())
            };
            match stored.await {
                Ok(()) => {
                    state.metrics.snapshot("written");
                    tracing::debug!(stream_seq = seq, bytes = bytes.len(), "snapshot written");
                }
                Err(err) => {
                    state.metrics.snapshot("failed");
                    tracing::warn!(%err, "snapshot not written");
                }
            }
            busy.store(false, Ordering::Relaxed);
        });
    }
}
