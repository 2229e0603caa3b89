//! `KvEventPublisher`: an engine wrapper's KV events, published exactly as vLLM publishes them
//! (ZMQ PUB, frames `[topic, seq u64 BE, msgpack batch]`, events in vLLM's map form), with a
//! ROUTER replay socket serving the last batches, so a kvroute (or Dynamo) router follows the
//! engine's cache and recovers what it misses.
//!
//! ```text
//!  Python thread ──encode──▶ channel ──▶ tokio task: seq += 1, keep for replay, PUB.send
//!                                         tokio task: ROUTER.recv ["", from] ──▶ kept batches, END
//! ```

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use kvroute_wire::vllm::encode_batch;
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent, KvEventBatch, publisher_mm_key};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

type Kept = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// Publishes an engine's KV cache events in vLLM's wire format.
#[pyclass(module = "kvroute")]
pub(crate) struct KvEventPublisher {
    block_size: u32,
    tx: Option<mpsc::UnboundedSender<Vec<u8>>>,
    runtime: Option<tokio::runtime::Runtime>,
    /// The PUB endpoint actually bound (port 0 resolved).
    #[pyo3(get)]
    endpoint: String,
    /// The replay (ROUTER) endpoint actually bound, if any.
    #[pyo3(get)]
    replay_endpoint: Option<String>,
}

fn hash_bits(h: i128, what: &str) -> PyResult<u64> {
    u64::try_from(h)
        .or_else(|_| i64::try_from(h).map(|s| s as u64))
        .map_err(|_| PyValueError::new_err(format!("{what} {h} does not fit 64 bits")))
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[pymethods]
impl KvEventPublisher {
    /// Binds a PUB socket at `endpoint` (e.g. "tcp://127.0.0.1:5557"; port 0 picks one) and,
    /// with `replay_endpoint`, a ROUTER socket that replays the last `replay_buffer` batches.
    #[new]
    #[pyo3(signature = (endpoint, kv_block_size, topic="", replay_endpoint=None, replay_buffer=10_000))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        kv_block_size: u32,
        topic: &str,
        replay_endpoint: Option<&str>,
        replay_buffer: usize,
    ) -> PyResult<Self> {
        if kv_block_size == 0 {
            return Err(PyValueError::new_err("kv_block_size must be greater than 0"));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvroute-publisher")
            .enable_all()
            .build()
            .map_err(|e| {
                PyRuntimeError::new_err(format!("starting the publisher's runtime: {e}"))
            })?;
        let bind = |socket_endpoint: String| {
            runtime.block_on(async move {
                let mut socket = PubSocket::new();
                let bound = socket.bind(&socket_endpoint).await?;
                Ok::<_, zeromq::ZmqError>((socket, bound.to_string()))
            })
        };
        let (socket, bound) = py
            .detach(|| bind(endpoint.to_owned()))
            .map_err(|e| PyRuntimeError::new_err(format!("binding {endpoint}: {e}")))?;
        let kept: Kept = Arc::new(Mutex::new(VecDeque::new()));
        let topic = topic.as_bytes().to_vec();
        let replay_bound = match replay_endpoint {
            None => None,
            Some(r) => {
                let r = r.to_owned();
                let (router, bound) = py
                    .detach(|| {
                        runtime.block_on(async {
                            let mut socket = RouterSocket::new();
                            let bound = socket.bind(&r).await?;
                            Ok::<_, zeromq::ZmqError>((socket, bound.to_string()))
                        })
                    })
                    .map_err(|e| PyRuntimeError::new_err(format!("binding {r}: {e}")))?;
                runtime.spawn(serve_replay(router, topic.clone(), Arc::clone(&kept)));
                Some(bound)
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        runtime.spawn(publish(socket, rx, topic, kept, replay_buffer));
        Ok(Self {
            block_size: kv_block_size,
            tx: Some(tx),
            runtime: Some(runtime),
            endpoint: bound,
            replay_endpoint: replay_bound,
        })
    }

    /// Publishes the blocks an engine has just filled: `token_ids` of all of them, in order,
    /// `num_block_tokens` tokens each (all must equal kv_block_size), named `block_hashes`, the
    /// first one the child of `parent_hash`. `block_mm_infos` (one entry per block) names the
    /// images a block covers; `event_id` is accepted for Dynamo compatibility (batches are
    /// numbered by the publisher).
    #[pyo3(signature = (event_id, token_ids, num_block_tokens, block_hashes, lora_id=None, parent_hash=None, block_mm_infos=None, lora_name=None))]
    #[allow(clippy::too_many_arguments)] // Dynamo's Python signature, kept for drop-in use
    fn publish_stored(
        &self,
        event_id: u64,
        token_ids: Vec<u64>,
        num_block_tokens: Vec<u64>,
        block_hashes: Vec<i128>,
        lora_id: Option<i64>,
        parent_hash: Option<i128>,
        block_mm_infos: Option<&Bound<'_, PyAny>>,
        lora_name: Option<String>,
    ) -> PyResult<()> {
        let _ = event_id;
        let n = block_hashes.len();
        if num_block_tokens.len() != n {
            return Err(PyValueError::new_err(format!(
                "{} block hashes but {} num_block_tokens entries",
                n,
                num_block_tokens.len()
            )));
        }
        if let Some(bad) = num_block_tokens.iter().find(|&&t| t != u64::from(self.block_size)) {
            return Err(PyValueError::new_err(format!(
                "a published block has {bad} tokens; only full blocks of kv_block_size={} are published",
                self.block_size
            )));
        }
        if token_ids.len() != n * self.block_size as usize {
            return Err(PyValueError::new_err(format!(
                "{} token ids for {n} blocks of {}",
                token_ids.len(),
                self.block_size
            )));
        }
        let infos = crate::mm_infos(block_mm_infos)?;
        if infos.as_ref().is_some_and(|i| i.len() > n) {
            return Err(PyValueError::new_err(
                "block_mm_infos has more entries than there are blocks",
            ));
        }
        let extra_keys = infos.map(|infos| {
            (0..n)
                .map(|i| {
                    infos.get(i).cloned().flatten().map(|info| {
                        info.mm_objects
                            .iter()
                            .map(|o| {
                                publisher_mm_key(
                                    o.mm_hash,
                                    o.offsets.first().map_or(0, |r| r.0 as i64),
                                )
                            })
                            .collect()
                    })
                })
                .collect()
        });
        let stored = BlockStored {
            block_hashes: block_hashes
                .iter()
                .map(|&h| hash_bits(h, "block hash"))
                .collect::<PyResult<_>>()?,
            parent_block_hash: parent_hash.map(|p| hash_bits(p, "parent_hash")).transpose()?,
            token_ids,
            block_size: self.block_size,
            lora_id,
            medium: Some("GPU".to_owned()),
            lora_name,
            extra_keys,
            cache_salt: None,
            group_idx: None,
        };
        self.send(EngineEvent::BlockStored(stored))
    }

    /// Publishes that the engine evicted these blocks.
    fn publish_removed(&self, event_id: u64, block_hashes: Vec<i128>) -> PyResult<()> {
        let _ = event_id;
        let removed = BlockRemoved {
            block_hashes: block_hashes
                .iter()
                .map(|&h| hash_bits(h, "block hash"))
                .collect::<PyResult<_>>()?,
            medium: Some("GPU".to_owned()),
            group_idx: None,
        };
        self.send(EngineEvent::BlockRemoved(removed))
    }

    /// Publishes that the engine dropped its whole cache.
    fn publish_cleared(&self) -> PyResult<()> {
        self.send(EngineEvent::AllBlocksCleared)
    }

    /// Stops publishing and closes the sockets (also on garbage collection).
    fn close(&mut self, py: Python<'_>) {
        self.tx = None;
        if let Some(runtime) = self.runtime.take() {
            py.detach(|| runtime.shutdown_timeout(std::time::Duration::from_secs(1)));
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &mut self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) {
        self.close(py);
    }
}

impl KvEventPublisher {
    fn send(&self, event: EngineEvent) -> PyResult<()> {
        let tx =
            self.tx.as_ref().ok_or_else(|| PyRuntimeError::new_err("the publisher is closed"))?;
        let payload =
            encode_batch(&KvEventBatch { ts: now(), events: vec![event], dp_rank: Some(0) });
        tx.send(payload).map_err(|_| PyRuntimeError::new_err("the publisher is closed"))
    }
}

/// Numbers the batches, keeps the last `keep` for replay, publishes them.
async fn publish(
    mut socket: PubSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<u8>>,
    topic: Vec<u8>,
    kept: Kept,
    keep: usize,
) {
    let mut seq: u64 = 0;
    while let Some(payload) = rx.recv().await {
        {
            let mut kept = kept.lock().unwrap_or_else(PoisonError::into_inner);
            kept.push_back((seq, payload.clone()));
            while kept.len() > keep {
                kept.pop_front();
            }
        }
        let mut message = ZmqMessage::from(topic.clone());
        message.push_back(seq.to_be_bytes().to_vec().into());
        message.push_back(payload.into());
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
