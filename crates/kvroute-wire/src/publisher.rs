//! A ZMQ publisher of KV event batches exactly as vLLM publishes them, with a ROUTER socket
//! that replays the last batches (feature `publisher`).
//!
//! ```text
//!  send(events) ──channel──▶ task: seq += 1, keep for replay, PUB [topic, seq, batch]
//!                            task: ROUTER ["", from] ──▶ [ "", topic, seq, batch ]... then seq 2^64-1
//! ```

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::transport::{SocketRole, ZmqLimits};
use crate::vllm::encode_batch;
use crate::{EngineEvent, KvEventBatch};

type Kept = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// A running publisher; sending never blocks. Dropping it stops the tasks' input; they end
/// with the runtime that runs them.
#[derive(Debug, Clone)]
pub struct EventPublisher {
    /// Each batch as kept for replay, and as published live when that differs.
    tx: mpsc::UnboundedSender<(Vec<u8>, Option<Vec<u8>>)>,
    /// The PUB endpoint bound (a port 0 resolved).
    pub endpoint: String,
    /// The replay endpoint bound, if any.
    pub replay_endpoint: Option<String>,
}

impl EventPublisher {
    /// Binds the sockets and spawns the tasks on the current tokio runtime, with the default
    /// [`ZmqLimits`].
    pub async fn bind(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
        keep: usize,
    ) -> Result<Self, zeromq::ZmqError> {
        Self::bind_with(endpoint, replay_endpoint, topic, keep, &ZmqLimits::default()).await
    }

    /// [`EventPublisher::bind`], the sockets receiving (subscriptions, replay requests) within
    /// `limits`.
    pub async fn bind_with(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
        keep: usize,
        limits: &ZmqLimits,
    ) -> Result<Self, zeromq::ZmqError> {
        let mut socket = PubSocket::with_options(limits.options(SocketRole::Publisher));
        let bound = socket.bind(endpoint).await?.to_string();
        let kept: Kept = Arc::new(Mutex::new(VecDeque::new()));
        let topic = topic.as_bytes().to_vec();
        let replay_bound = match replay_endpoint {
            None => None,
            Some(r) => {
                let mut router = RouterSocket::with_options(limits.options(SocketRole::Publisher));
                let bound = router.bind(r).await?.to_string();
                tokio::spawn(serve_replay(router, topic.clone(), Arc::clone(&kept)));
                Some(bound)
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(publish(socket, rx, topic, kept, keep));
        Ok(Self { tx, endpoint: bound, replay_endpoint: replay_bound })
    }

    /// Publishes one batch of `events` (rank `dp_rank`); false once the publisher has stopped.
    pub fn send(&self, events: Vec<EngineEvent>, dp_rank: u32) -> bool {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.tx
            .send((encode_batch(&KvEventBatch { ts, events, dp_rank: Some(dp_rank) }), None))
            .is_ok()
    }

    /// Fault injection: publishes the batch live without the events `lost` picks, while the
    /// replay buffer keeps them all under the same sequence number, as a lossy link would
    /// deliver it (no gap to notice). For testing a router's drift detection.
    pub fn send_lossy(
        &self,
        events: Vec<EngineEvent>,
        dp_rank: u32,
        lost: impl Fn(&EngineEvent) -> bool,
    ) -> bool {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let live: Vec<EngineEvent> = events.iter().filter(|e| !lost(e)).cloned().collect();
        let live = encode_batch(&KvEventBatch { ts, events: live, dp_rank: Some(dp_rank) });
        let kept = encode_batch(&KvEventBatch { ts, events, dp_rank: Some(dp_rank) });
        self.tx.send((kept, Some(live))).is_ok()
    }
}

/// Numbers the batches, keeps the last `keep` for replay, publishes them.
async fn publish(
    mut socket: PubSocket,
    mut rx: mpsc::UnboundedReceiver<(Vec<u8>, Option<Vec<u8>>)>,
    topic: Vec<u8>,
    kept: Kept,
    keep: usize,
) {
    let mut seq: u64 = 0;
    while let Some((payload, live)) = rx.recv().await {
        {
            let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
            kept.push_back((seq, payload.clone()));
            while kept.len() > keep {
                kept.pop_front();
            }
        }
        let mut message = ZmqMessage::from(topic.clone());
        message.push_back(seq.to_be_bytes().to_vec().into());
        message.push_back(live.unwrap_or(payload).into());
        // A PUB socket with no subscriber drops the message; that is what replay is for.
        let _ = socket.send(message).await;
        seq += 1;
    }
}

/// Answers `[identity, "", start_seq]` with `[identity, "", topic, seq, payload]` for every kept
/// batch from `start_seq` on, then `[identity, "", topic, 2^64-1, ""]`.
async fn serve_replay(mut socket: RouterSocket, topic: Vec<u8>, kept: Kept) {
    while let Ok(request) = socket.recv().await {
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else { continue };
        let Ok(start): Result<[u8; 8], _> = start.as_ref().try_into() else { continue };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Vec<u8>)> = kept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        let reply = |seq: u64, payload: Vec<u8>| {
            let mut m = ZmqMessage::from(identity.to_vec());
            m.push_back(Vec::new().into());
            m.push_back(topic.clone().into());
            m.push_back(seq.to_be_bytes().to_vec().into());
            m.push_back(payload.into());
            m
        };
        for (seq, payload) in batches {
            if socket.send(reply(seq, payload)).await.is_err() {
                break;
            }
        }
        let _ = socket.send(reply(u64::MAX, Vec::new())).await;
    }
}
