//! The event plane: one task per worker rank subscribing to its KV events, and one per load
//! stream.
//!
//! ```text
//!  engine PUB ──[topic, seq, batch]──▶ SUB task ──kvroute_wire::Pipeline──▶ Ingest (index)
//!        ▲                                │ seq jumped?
//!  engine ROUTER ◀──["", from_seq]── DEALER (replay): ["", topic, seq, batch]... until seq = 2^64-1
//! ```
//!
//! Each task applies its worker's batches in sequence order, so per-worker ordering holds.
//! A jump in sequence numbers is a gap: the missed batches are asked of the replay endpoint
//! when there is one (else the gap is counted and logged). A sequence number going back is a
//! restarted engine (the live stream never repeats a number), whose cache is empty: its blocks
//! are cleared, and the batches it sent before we reconnected are asked of its replay. Live
//! batches that the replay on first contact already applied are skipped. A lost connection
//! (the socket's monitor says so at once) makes the rank not ready until it is connected and
//! caught up again; it is retried with capped exponential backoff. Undecodable messages are
//! counted and skipped.
//!
//! This is transport only: how a format frames and decodes its messages, and which rank an
//! event lands on, is the wire crate's [`Pipeline`]. Formats without sequence numbers
//! (TensorRT-LLM, kvroute JSON) have no gaps to see and no replay.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kvroute_core::BlockSize;
use kvroute_core::{KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier, WorkerWithDpRank};
use kvroute_wire::transport::{SocketRole, ZmqLimits};
use kvroute_wire::vllm::split_frames;
use kvroute_wire::{ConvertConfig, EventFormat, Framed, Pipeline};
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::config::{RouterConfig, WorkerSpec};
use crate::error::RouterError;
use crate::state::{Ingest, Link, RouterState};

pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long one connection attempt retries a refused address before the attempt fails (and
/// is tried again after the backoff).
const CONNECT_TRY: Duration = Duration::from_secs(1);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// Sequence number that ends a replay.
const END_OF_REPLAY: u64 = u64::MAX;

/// One rank's KV event stream.
#[derive(Clone, Debug)]
pub struct Subscription {
    pub worker: WorkerWithDpRank,
    pub endpoint: String,
    pub replay: Option<String>,
    pub format: EventFormat,
    pub convert: ConvertConfig,
    /// The last sequence number already handled elsewhere (a restarted relay's, read from
    /// the stream): the engine's replay is asked for what follows it.
    pub resume_after: Option<u64>,
}

/// The event subscriptions of every configured worker rank.
pub(crate) fn subscriptions(state: &RouterState) -> Vec<Subscription> {
    state.config.workers.iter().flat_map(|spec| subscriptions_of(spec, &state.config)).collect()
}

/// The event subscriptions of one worker's ranks (none without `events`).
pub(crate) fn subscriptions_of(spec: &WorkerSpec, config: &RouterConfig) -> Vec<Subscription> {
    let block_size = spec.block_size.and_then(|bs| BlockSize::new(bs).ok());
    let convert = ConvertConfig {
        block_size: block_size.unwrap_or(config.block_size),
        image_token_id: spec.image_token_id,
        vocab_size: spec.vocab_size,
    };
    let Some(events) = &spec.events else { return Vec::new() };
    let mut out = Vec::new();
    for rank in 0..spec.dp_size {
        // Validated before: the endpoints are tcp:// with a port.
        let Ok(endpoint) = WorkerSpec::endpoint_for_rank(events, rank) else { continue };
        let replay =
            spec.replay.as_deref().and_then(|r| WorkerSpec::endpoint_for_rank(r, rank).ok());
        out.push(Subscription {
            worker: WorkerWithDpRank::new(spec.id, rank),
            endpoint,
            replay,
            format: spec.format,
            convert,
            resume_after: None,
        });
    }
    out
}

/// Subscribes forever, reconnecting with capped backoff.
pub async fn run(state: Arc<RouterState>, sub: Subscription) {
    let mut backoff = Duration::from_millis(50);
    let Some(ingest) = state.ingest_for(sub.worker) else {
        tracing::error!(worker = %sub.worker, "no such configured rank: not subscribed");
        return;
    };
    let mut stream = Stream {
        ingest,
        pipeline: Pipeline::new(sub.worker, sub.format, sub.convert),
        last: sub.resume_after,
        connected: false,
        replays: ReplayBudget::default(),
    };
    loop {
        if let Err(err) = run_once(&state, &sub, &mut stream).await {
            tracing::debug!(worker = %sub.worker, endpoint = %sub.endpoint, %err, "event stream down");
        }
        if std::mem::take(&mut stream.connected) {
            backoff = Duration::from_millis(50); // it was up: retry soon
        }
        state.link(sub.worker, Link::Disconnected);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// What survives reconnections: the rank's way into the router, the pipeline's counters and
/// the last sequence number.
struct Stream<'a> {
    ingest: Ingest<'a>,
    pipeline: Pipeline,
    last: Option<u64>,
    connected: bool,
    replays: ReplayBudget,
}

/// Most replay requests per subscription per minute: a publisher (or something posing as
/// one) whose sequence numbers jump on every batch must not turn each batch into a request
/// to the engine.
pub(crate) const REPLAYS_PER_MINUTE: u32 = 30;
/// After a replay that timed out, none is asked for this long (a replay socket that never
/// answers would otherwise stall the stream at every gap).
const REPLAY_QUIET: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct ReplayBudget {
    window_start: Option<std::time::Instant>,
    used: u32,
    quiet_until: Option<std::time::Instant>,
}

impl ReplayBudget {
    /// Whether a replay may be asked for now (and counts it).
    fn take(&mut self, now: std::time::Instant) -> bool {
        if self.quiet_until.is_some_and(|q| now < q) {
            return false;
        }
        let fresh =
            self.window_start.is_none_or(|s| now.duration_since(s) >= Duration::from_secs(60));
        if fresh {
            self.window_start = Some(now);
            self.used = 0;
        }
        if self.used >= REPLAYS_PER_MINUTE {
            return false;
        }
        self.used += 1;
        true
    }

    fn timed_out(&mut self, now: std::time::Instant) {
        self.quiet_until = Some(now + REPLAY_QUIET);
    }
}

async fn run_once(
    state: &RouterState,
    sub: &Subscription,
    stream: &mut Stream<'_>,
) -> Result<(), RouterError> {
    let mut options = state.zmq.options(SocketRole::Events);
    options.connect_timeout(CONNECT_TRY);
    let mut socket = SubSocket::with_options(options);
    // The socket would reconnect by itself, silently and up to 30 s apart; it is watched
    // instead, so a lost publisher is seen at once (its rank is not ready until it is back
    // and caught up: nothing is placed on blocks the router cannot see) and retried here.
    let mut monitor = socket.monitor();
    socket.connect(&sub.endpoint).await?;
    socket.subscribe("").await?;
    stream.connected = true;
    state.link(sub.worker, Link::Connected(stream.last));
    tracing::info!(worker = %sub.worker, endpoint = %sub.endpoint, "subscribed to KV events");
    // Whatever was published before the subscription took effect (ZMQ drops it: the slow
    // joiner), or while we were away, comes from the replay endpoint if there is one. Live
    // batches already queued behind it are recognised by their sequence numbers.
    let mut replayed_through = None;
    if sub.replay.is_some() {
        let before = stream.last;
        let from = before.map_or(0, |l| l + 1);
        recover(state, sub, stream, from, END_OF_REPLAY, false).await;
        replayed_through = stream.last.filter(|_| stream.last != before);
    }
    state.link(sub.worker, Link::CaughtUp);
    loop {
        let message = tokio::select! {
            message = socket.recv() => message?,
            event = monitor.next() => match event {
                Some(SocketEvent::Disconnected(_)) | None => return Err(RouterError::PublisherLost),
                Some(_) => continue,
            },
        };
        // The frames are read in place: a batch's bytes are never copied out of the socket's.
        let frames = message.into_vec();
        let Ok(framed) = stream.pipeline.frame(&frames) else {
            state.metrics.garbage.inc();
            continue;
        };
        if let Some(seq) = framed.seq {
            if replayed_already(&mut replayed_through, seq) {
                continue;
            }
            follow_sequence(state, sub, stream, seq).await;
        }
        hand_on(state, sub, stream, framed).await;
    }
}

/// Whether a live batch is one the first-contact replay already applied: batches published
/// after the subscription took effect but before the replay was answered come twice, by the
/// replay and queued on the live socket. Only the live batches up to the first one past the
/// replay are such duplicates (`through` is then cleared); without this, the first of them
/// looked like a restarted engine, which cleared the worker's blocks and counted a restart.
fn replayed_already(through: &mut Option<u64>, seq: u64) -> bool {
    match *through {
        Some(t) if seq <= t => true,
        Some(_) => {
            *through = None;
            false
        }
        None => false,
    }
}

/// Before batch `seq` is applied: a resync asked for, a restarted publisher, or batches
/// missed since the last one.
async fn follow_sequence(
    state: &RouterState,
    sub: &Subscription,
    stream: &mut Stream<'_>,
    seq: u64,
) {
    if state.checks.take_resync(sub.worker) {
        // Drifted: its blocks were cleared; rebuild from what the engine still buffers.
        tracing::info!(worker = %sub.worker, "resynchronising from the engine's replay");
        stream.last = None;
    }
    match stream.last {
        Some(last) if seq == last.wrapping_add(1) => {}
        Some(last) if seq <= last => {
            // The publisher restarted: its cache is new, so is ours for it. Its first batches
            // may have gone out before the subscription reconnected.
            state.metrics.restarts.inc();
            tracing::info!(worker = %sub.worker, last, seq, "publisher restarted; clearing its blocks");
            // A restarted engine has lost its device cache and its host memory (not its disk
            // or a shared store).
            let clear = |tier| {
                let mut e = KvCacheEvent::new(0, KvCacheEventData::Cleared, sub.worker.dp_rank);
                e.storage_tier = tier;
                RouterEvent { worker_id: sub.worker.worker_id, event: e }
            };
            let clears = vec![clear(StorageTier::Device), clear(StorageTier::HostPinned)];
            stream.ingest.batch(None, clears).await;
            stream.last = None;
            if seq > 0 {
                recover(state, sub, stream, 0, seq, false).await;
            }
        }
        last => {
            let from = last.map_or(0, |l| l + 1);
            if seq > from {
                recover(state, sub, stream, from, seq, last.is_some()).await;
            }
        }
    }
}

/// Batches `from..until` went missing (`gap`: between two we saw): replay them if the engine
/// keeps them.
async fn recover(
    state: &RouterState,
    sub: &Subscription,
    stream: &mut Stream<'_>,
    from: u64,
    until: u64,
    gap: bool,
) {
    if gap {
        state.metrics.gaps.inc();
    }
    let Some(endpoint) = &sub.replay else {
        if gap {
            tracing::warn!(worker = %sub.worker, from, until, "missed KV event batches and no replay endpoint");
        }
        return;
    };
    if !stream.replays.take(std::time::Instant::now()) {
        state.metrics.rejected("replay_budget");
        tracing::debug!(worker = %sub.worker, from, until, "gap not replayed: replay budget spent or replay quiet");
        return;
    }
    state.metrics.replays.inc();
    match tokio::time::timeout(REPLAY_TIMEOUT * 2, replay(&state.zmq, endpoint, from, until)).await
    {
        Ok(Ok(Replayed { batches, cut })) => {
            if cut {
                state.metrics.rejected("replay_bytes");
                tracing::warn!(worker = %sub.worker, from, until, got = batches.len(), limit = state.zmq.max_replay_bytes(), "replay answer cut at its byte limit");
            }
            if !batches.is_empty() {
                tracing::info!(worker = %sub.worker, from, until, got = batches.len(), "replayed missed batches");
            }
            for (seq, payload) in batches {
                if stream.last.is_some_and(|l| seq <= l) {
                    continue;
                }
                state.metrics.replayed_batches.inc();
                hand_on(state, sub, stream, Framed { seq: Some(seq), payload: &payload }).await;
            }
        }
        Ok(Err(err)) => tracing::warn!(worker = %sub.worker, error = ?err, "replay failed"),
        Err(_) => {
            stream.replays.timed_out(std::time::Instant::now());
            tracing::warn!(worker = %sub.worker, quiet_secs = REPLAY_QUIET.as_secs(), "replay timed out; no replay for a while");
        }
    }
}

/// Decodes one message through the pipeline and hands its events on. An undecodable batch
/// is not consumed: to us it is missing, and the next one asks for it again.
async fn hand_on(
    state: &RouterState,
    sub: &Subscription,
    stream: &mut Stream<'_>,
    framed: Framed<'_>,
) {
    let decoded = match stream.pipeline.decode(framed) {
        Ok(decoded) => decoded,
        Err(err) => {
            state.metrics.garbage.inc();
            tracing::debug!(worker = %sub.worker, seq = ?framed.seq, %err, "undecodable message");
            return;
        }
    };
    stream.ingest.converted(&decoded.stats);
    if let Some(seq) = framed.seq {
        stream.last = Some(seq);
    }
    stream.ingest.batch(framed.seq, decoded.events).await;
    if let Some(seq) = framed.seq {
        stream.ingest.seen(seq);
    }
}

/// A replay's answer.
#[derive(Debug)]
pub struct Replayed {
    /// `(sequence number, payload)` in the order they came.
    pub batches: Vec<(u64, Vec<u8>)>,
    /// The answer outgrew [`ZmqLimits::max_replay_bytes`] and was cut short.
    pub cut: bool,
}

/// Asks a replay endpoint for batches from `from` on; returns those before `until`. Each
/// message is bounded by `limits`, and so is the whole answer: past
/// [`ZmqLimits::max_replay_bytes`] of batches the answer is cut there (what came is
/// returned, the rest stays a gap).
pub async fn replay(
    limits: &ZmqLimits,
    endpoint: &str,
    from: u64,
    until: u64,
) -> Result<Replayed, RouterError> {
    let mut dealer = DealerSocket::with_options(limits.options(SocketRole::Replay));
    dealer.connect(endpoint).await?;
    let mut request = ZmqMessage::from(Vec::<u8>::new());
    request.push_back(from.to_be_bytes().to_vec().into());
    dealer.send(request).await?;
    let mut out = Vec::new();
    let mut bytes = 0usize;
    loop {
        let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv())
            .await
            .map_err(|_| RouterError::ReplayTimeout)??;
        let frames: Vec<Vec<u8>> = reply.into_vec().into_iter().map(|b| b.to_vec()).collect();
        // ["", topic, seq, payload] (vLLM >= 0.26) or ["", seq, payload].
        let rest = match frames.split_first() {
            Some((empty, rest)) if empty.is_empty() => rest,
            _ => &frames[..],
        };
        let (_, seq, payload) = split_frames(rest).map_err(RouterError::ReplayFrame)?;
        if seq == END_OF_REPLAY {
            return Ok(Replayed { batches: out, cut: false });
        }
        if seq >= from && seq < until {
            bytes = bytes.saturating_add(payload.len());
            if bytes > limits.max_replay_bytes() {
                return Ok(Replayed { batches: out, cut: true });
            }
            out.push((seq, payload.to_vec()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_batches_the_replay_applied_are_skipped_until_the_stream_passes_it() {
        let mut through = Some(5);
        assert!(replayed_already(&mut through, 3), "queued behind the replay");
        assert!(replayed_already(&mut through, 5));
        assert!(!replayed_already(&mut through, 6), "the first new batch");
        assert_eq!(through, None);
        assert!(!replayed_already(&mut through, 0), "later, going back is a restart again");
        let mut none = None;
        assert!(!replayed_already(&mut none, 0), "nothing replayed: nothing skipped");
    }

    #[test]
    fn replays_are_capped_per_minute_and_quiet_after_a_timeout() {
        let mut b = ReplayBudget::default();
        let t = std::time::Instant::now();
        let granted = (0..100).filter(|_| b.take(t)).count();
        assert_eq!(granted, REPLAYS_PER_MINUTE as usize);
        assert!(b.take(t + Duration::from_secs(61)), "a new minute");
        b.timed_out(t + Duration::from_secs(61));
        assert!(!b.take(t + Duration::from_secs(62)));
        assert!(b.take(t + Duration::from_secs(92)));
    }
}
