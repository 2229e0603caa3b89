//! Python bindings (module `kvroute._kvroute`, re-exported as `kvroute`): hashing, the radix
//! index and a vLLM-format KV event publisher. Heavy work runs with the GIL released.

// pyo3 hands arguments over as owned values (Vec, String): taking them by value is the API.
#![allow(clippy::needless_pass_by_value)]

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

use kvroute_core::index::RadixIndex;
use kvroute_core::{KvCacheEvent, LocalBlockHash, RouterEvent, WorkerId, WorkerWithDpRank};

mod mm;
mod publisher;

use mm::mm_infos;

/// Block hashes of `tokens`, one per full block of `kv_block_size` tokens, bit-compatible with
/// Dynamo's `compute_block_hash_for_seq`.
#[pyfunction]
#[pyo3(signature = (tokens, kv_block_size, block_mm_infos=None, lora_name=None))]
fn compute_block_hash_for_seq(
    py: Python<'_>,
    tokens: Vec<u32>,
    kv_block_size: u32,
    block_mm_infos: Option<&Bound<'_, PyAny>>,
    lora_name: Option<String>,
) -> PyResult<Vec<u64>> {
    let infos = mm_infos(block_mm_infos)?;
    let hashes = py
        .detach(|| {
            kvroute_core::compute_block_hash_for_seq(
                &tokens,
                kv_block_size,
                infos.as_deref(),
                lora_name.as_deref(),
            )
        })
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(hashes.into_iter().map(|h| h.0).collect())
}

/// How many leading blocks of a query each (worker_id, dp_rank) holds.
#[pyclass(module = "kvroute", frozen)]
struct OverlapScores {
    #[pyo3(get)]
    scores: Py<PyDict>,
    #[pyo3(get)]
    tree_sizes: Py<PyDict>,
}

#[pymethods]
impl OverlapScores {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "OverlapScores(scores={}, tree_sizes={})",
            self.scores.bind(py).repr()?,
            self.tree_sizes.bind(py).repr()?
        ))
    }
}

/// Which worker holds which KV block: kvroute's radix index.
#[pyclass(module = "kvroute")]
struct RadixTree {
    inner: RadixIndex,
}

fn event_json(event: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(bytes) = event.cast::<PyBytes>() {
        return Ok(bytes.as_bytes().to_vec());
    }
    if let Ok(s) = event.cast::<PyString>() {
        return Ok(s.extract::<String>()?.into_bytes());
    }
    if event.cast::<PyDict>().is_ok() {
        let json = event.py().import("json")?.call_method1("dumps", (event,))?;
        return Ok(json.extract::<String>()?.into_bytes());
    }
    Err(PyTypeError::new_err(
        "event must be JSON (bytes or str) or a dict in Dynamo's KvCacheEvent shape",
    ))
}

#[pymethods]
impl RadixTree {
    #[new]
    fn new() -> Self {
        Self { inner: RadixIndex::new() }
    }

    /// Applies one KV cache event of `worker_id`: JSON bytes/str or a dict shaped like
    /// `{"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": [...]}}, "dp_rank": 0}`.
    /// Malformed events raise ValueError; a Stored whose parent the worker does not hold is
    /// ignored (and counted), as engines' events can race.
    fn apply_event(
        &mut self,
        py: Python<'_>,
        worker_id: u64,
        event: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let bytes = event_json(event)?;
        let event: KvCacheEvent = serde_json::from_slice(&bytes)
            .map_err(|e| PyValueError::new_err(format!("not a KV cache event: {e}")))?;
        let event = RouterEvent { worker_id: WorkerId(worker_id), event };
        let inner = &mut self.inner;
        let _ = py.detach(|| inner.apply_event(&event));
        Ok(())
    }

    /// Leading blocks of `local_hashes` each (worker_id, dp_rank) holds.
    #[pyo3(signature = (local_hashes, early_exit=false))]
    fn find_matches(
        &self,
        py: Python<'_>,
        local_hashes: Vec<u64>,
        early_exit: bool,
    ) -> PyResult<OverlapScores> {
        let query: Vec<LocalBlockHash> = local_hashes.into_iter().map(LocalBlockHash).collect();
        let inner = &self.inner;
        let found = py.detach(|| inner.find_matches_with(&query, early_exit));
        let scores = PyDict::new(py);
        for (w, s) in &found.scores {
            scores.set_item((w.worker_id.0, w.dp_rank.0), s)?;
        }
        let tree_sizes = PyDict::new(py);
        for (w, s) in &found.tree_sizes {
            tree_sizes.set_item((w.worker_id.0, w.dp_rank.0), s)?;
        }
        Ok(OverlapScores { scores: scores.unbind(), tree_sizes: tree_sizes.unbind() })
    }

    /// Forgets every block of every dp rank of `worker_id`, and the worker.
    fn remove_worker(&mut self, worker_id: u64) {
        self.inner.remove_worker(WorkerId(worker_id));
    }

    /// Drops every block of `worker_id` (all dp ranks), keeping it known.
    fn clear_all_blocks(&mut self, worker_id: u64) {
        self.inner.clear_all_blocks(WorkerId(worker_id));
    }

    /// The index as `RouterEvent` JSON strings that, applied in order to an empty tree,
    /// rebuild it.
    fn dump_tree_as_events(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let inner = &self.inner;
        py.detach(|| inner.dump_as_events())
            .iter()
            .map(|e| serde_json::to_string(e).map_err(|e| PyRuntimeError::new_err(e.to_string())))
            .collect()
    }

    /// Blocks the worker's dp rank holds.
    #[pyo3(signature = (worker_id, dp_rank=0))]
    fn tree_size(&self, worker_id: u64, dp_rank: u32) -> usize {
        self.inner.tree_size(WorkerWithDpRank::new(worker_id, dp_rank))
    }

    /// Distinct blocks in the tree.
    fn __len__(&self) -> usize {
        self.inner.stats().blocks
    }
}

#[pymodule]
fn _kvroute(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(compute_block_hash_for_seq, m)?)?;
    // Dynamo's older name for the same function.
    m.add("compute_block_hash_for_seq_py", m.getattr("compute_block_hash_for_seq")?)?;
    m.add_class::<RadixTree>()?;
    m.add_class::<OverlapScores>()?;
    m.add_class::<publisher::KvEventPublisher>()?;
    Ok(())
}
