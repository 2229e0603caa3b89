//! `KvEventPublisher`: an engine wrapper's KV events, published exactly as vLLM publishes them
//! (ZMQ PUB, frames `[topic, seq u64 BE, msgpack batch]`, events in vLLM's map form), with a
//! ROUTER replay socket serving the last batches, so a kvroute (or Dynamo) router follows the
//! engine's cache and recovers what it misses.
//! The sockets are kvroute-wire's `EventPublisher`, run on a small tokio runtime of the
//! publisher's own, so Python threads never wait on them.

use kvroute_wire::publisher::EventPublisher;
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent, publisher_extra_keys};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// Publishes an engine's KV cache events in vLLM's wire format.
#[pyclass(module = "kvroute")]
pub(crate) struct KvEventPublisher {
    block_size: u32,
    publisher: Option<EventPublisher>,
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
        let publisher = py
            .detach(|| {
                runtime.block_on(EventPublisher::bind(
                    endpoint,
                    replay_endpoint,
                    topic,
                    replay_buffer,
                ))
            })
            .map_err(|e| PyRuntimeError::new_err(format!("binding {endpoint}: {e}")))?;
        Ok(Self {
            block_size: kv_block_size,
            endpoint: publisher.endpoint.clone(),
            replay_endpoint: publisher.replay_endpoint.clone(),
            publisher: Some(publisher),
            runtime: Some(runtime),
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
        let infos = crate::mm::mm_infos(block_mm_infos)?;
        if infos.as_ref().is_some_and(|i| i.len() > n) {
            return Err(PyValueError::new_err(
                "block_mm_infos has more entries than there are blocks",
            ));
        }
        let extra_keys = infos.map(|infos| {
            (0..n)
                .map(|i| infos.get(i).and_then(Option::as_ref).map(publisher_extra_keys))
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
            locality: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
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
            locality: None,
        };
        self.send(EngineEvent::BlockRemoved(removed))
    }

    /// Publishes that the engine dropped its whole cache.
    fn publish_cleared(&self) -> PyResult<()> {
        self.send(EngineEvent::AllBlocksCleared)
    }

    /// Stops publishing and closes the sockets (also on garbage collection).
    fn close(&mut self, py: Python<'_>) {
        self.publisher = None;
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
        let publisher = self
            .publisher
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the publisher is closed"))?;
        match publisher.send(vec![event], 0) {
            true => Ok(()),
            false => Err(PyRuntimeError::new_err("the publisher is closed")),
        }
    }
}
