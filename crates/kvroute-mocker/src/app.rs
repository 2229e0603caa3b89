//! The simulated engine's shared state behind its HTTP APIs ([`AppState`]): the engine, its
//! model, its holds and peers for disaggregated serving, and the one way every API hands a
//! prompt to the engine ([`AppState::submit`]). The APIs themselves (`http`, `generate`,
//! `sglang`, `vllm`, `handoff`, ...) build on it; it imports none of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_http::ApiError;
use kvroute_preprocess::fetch::Fetcher;
use kvroute_preprocess::{Image, PreprocessError, Preprocessor};
use tokio::sync::mpsc;

use crate::engine::{EngineRequest, Output, OutputPlan, Usage};
use crate::metrics::Metrics;
use crate::service::{CancelOnDrop, EngineHandle};

/// Largest request body accepted: room for inline images (20 MB each once decoded, a third
/// more as base64).
pub const BODY_LIMIT: usize = 64 << 20;

pub struct AppState {
    pub engine: EngineHandle,
    pub preprocessor: Arc<Preprocessor>,
    pub seed: u64,
    pub fetcher: Fetcher,
    /// The longest prompt plus output accepted (`/v1/models`, `/tokenize`).
    pub max_model_len: u64,
    pub(crate) metrics: Metrics,
    next_id: AtomicU64,
    /// Keys every route but `/health` needs; empty: open.
    pub api_keys: kvroute_http::Credentials,
    /// Images processed before, by their caller's key ([`crate::media`]).
    pub(crate) processed: crate::media::Processed,
    /// The base model and the adapters served (`--lora-modules`, vLLM's dynamic API).
    pub catalog: kvroute_http::models::Catalog,
    /// vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` are served (its
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub runtime_lora_updating: bool,
    /// Prefills held for decode engines, and what the disaggregated legs did.
    pub holds: Arc<crate::holds::Holds>,
    /// This engine's name in `kv_transfer_params` (vLLM's `engine_id`).
    pub engine_id: String,
    /// Where decode engines pull this engine's KV (a prefill engine's side channel).
    pub side_channel: Option<std::net::SocketAddr>,
    /// The fleet's token for the side channel and the store, and a decode engine's prefill
    /// peers.
    pub peers: crate::holds::Peers,
    /// The ids of the requests under way: a caller's id (SGLang's `rid`, vLLM's
    /// `x-request-id`) names one request at a time.
    live_ids: Arc<std::sync::Mutex<rustc_hash::FxHashSet<String>>>,
    /// The trace contexts the engine was called in (as vLLM continues a `traceparent`).
    pub traces: Arc<Traces>,
    /// Requests taken, by the engine `priority` they came with (`/stats`'s `priorities`), so
    /// that a test can see a router lower one.
    pub priorities: Arc<std::sync::Mutex<std::collections::BTreeMap<i64, u64>>>,
    /// The store the fleet shares (`--store-url`), asked what it holds of each prompt.
    pub store: Option<crate::store::StoreLink>,
}

pub use kvroute_http::openai::DEFAULT_MAX_MODEL_LEN;

/// The W3C trace contexts the engine's requests carried: how many, and the last one as it
/// came (`/stats`'s `trace`), so that a test can see a router pass a trace on.
#[derive(Debug, Default)]
pub struct Traces {
    last: std::sync::Mutex<(u64, Option<kvroute_http::trace::TraceContext>)>,
}

impl Traces {
    pub(crate) fn seen(&self, headers: &axum::http::HeaderMap) {
        if let Some(t) = kvroute_http::trace::TraceContext::from_headers(headers) {
            let mut last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *last = (last.0 + 1, Some(t));
        }
    }

    /// `{"requests": n, "traceparent": ..., "tracestate": ...}`.
    pub fn to_json(&self) -> serde_json::Value {
        let last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let t = last.1.as_ref();
        serde_json::json!({
            "requests": last.0,
            "traceparent": t.map(kvroute_http::trace::TraceContext::traceparent),
            "tracestate": t.and_then(|t| t.state.as_ref()).and_then(|s| s.to_str().ok()),
        })
    }
}

impl AppState {
    /// `max_model_len`: the model's context length (default: the model directory's, else
    /// [`DEFAULT_MAX_MODEL_LEN`]), at most what the KV cache holds.
    pub fn new(
        engine: EngineHandle,
        preprocessor: Arc<Preprocessor>,
        seed: u64,
        fetcher: Fetcher,
        max_model_len: Option<u64>,
    ) -> Self {
        let c = engine.config;
        let metrics = Metrics::new(
            preprocessor.model_name(),
            engine.dp_rank,
            c.block_size.get(),
            c.num_blocks,
        );
        let capacity = (c.num_blocks * c.block_size.tokens()) as u64;
        let max_model_len = max_model_len
            .or(preprocessor.max_model_len())
            .unwrap_or(DEFAULT_MAX_MODEL_LEN)
            .min(capacity);
        let catalog =
            kvroute_http::models::Catalog::new(preprocessor.model_name(), Some(max_model_len));
        Self {
            catalog,
            runtime_lora_updating: false,
            engine,
            preprocessor,
            seed,
            fetcher,
            max_model_len,
            metrics,
            next_id: AtomicU64::new(0),
            api_keys: kvroute_http::Credentials::default(),
            processed: crate::media::Processed::default(),
            holds: Arc::default(),
            engine_id: format!("kvroute-mocker-{:016x}", rand_id()),
            side_channel: None,
            peers: crate::holds::Peers::default(),
            live_ids: Arc::default(),
            traces: Arc::default(),
            priorities: Arc::default(),
            store: None,
        }
    }

    /// What the engine generates for a prompt: the same on every engine with the same seed.
    pub fn plan(&self, tokens: &[u32], ignore_eos: bool) -> OutputPlan {
        OutputPlan::new(
            tokens,
            self.seed,
            Arc::clone(self.preprocessor.words()),
            if ignore_eos { None } else { self.preprocessor.eos_token_id() },
            u32::try_from(self.preprocessor.vocab_size()).unwrap_or(u32::MAX),
        )
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("engine", &self.engine)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

/// A prompt for the engine, from any of its APIs.
pub(crate) struct Submission {
    pub id: String,
    pub tokens: Vec<u32>,
    /// Where each image's placeholder tokens are (request-level).
    pub mm: Option<kvroute_core::RequestExtraInfo>,
    pub max_tokens: u64,
    pub ignore_eos: bool,
    pub cache_salt: Option<String>,
    /// The adapter it runs with (resolved from its `model`).
    pub lora: Option<String>,
    /// Its part in a disaggregated request.
    pub handoff: crate::disagg::Handoff,
    /// A prefill leg's claim on its key: its blocks are held under it when it ends.
    pub(crate) hold: Option<crate::holds::Reservation>,
    /// Per leading prompt block, whether the shared store holds it (filled by `arrange`).
    pub in_store: Vec<bool>,
    /// vLLM's `priority` (lower first; refused other than 0 on an `fcfs` engine).
    pub priority: i64,
}

/// What the engine sends back for one submission, and the guard that cancels it when dropped.
pub(crate) struct Submitted {
    pub outputs: mpsc::UnboundedReceiver<Output>,
    pub guard: CancelOnDrop,
    /// The end-of-turn token, if the answer ends with it.
    pub end: Option<u32>,
}

impl Submitted {
    /// The whole answer, once the engine has finished it: its token ids and usage (`None`
    /// when the engine stopped first). Until then dropping it cancels the request.
    pub(crate) async fn finished(mut self) -> Option<(Vec<u32>, Usage)> {
        let mut tokens = Vec::new();
        while let Some(output) = self.outputs.recv().await {
            match output {
                Output::Token { token, .. } => tokens.push(token),
                Output::FirstToken { .. } => {}
                Output::Finished { usage, .. } => {
                    self.guard.disarm();
                    return Some((tokens, usage));
                }
            }
        }
        None
    }
}

impl AppState {
    /// The images at `urls`, the i-th keyed by `keys[i]` when it has one (under `salt`, the
    /// request's `cache_salt`): from the cache when that key was processed before, else loaded
    /// (all the rest in one go, as a request's images are) and, keyed, remembered.
    pub(crate) async fn images(
        &self,
        urls: &[&str],
        keys: &[Option<&str>],
        salt: Option<&str>,
    ) -> Result<Vec<Image>, PreprocessError> {
        let mut found: Vec<Option<Image>> = keys
            .iter()
            .map(|k| k.and_then(|k| self.processed.get(&crate::media::salted(salt, k))))
            .collect();
        let missing: Vec<usize> = (0..urls.len()).filter(|&i| found[i].is_none()).collect();
        let to_load: Vec<&str> = missing.iter().map(|&i| urls[i]).collect();
        let loaded = self.preprocessor.load_image_urls(&to_load, &self.fetcher).await?;
        for (&i, l) in missing.iter().zip(loaded) {
            let mut image = l.image;
            if let Some(key) = keys.get(i).copied().flatten() {
                image.mm_hash = kvroute_core::hash::mm_hash_from_identifier(key);
                self.processed.put(&crate::media::salted(salt, key), &image);
            }
            found[i] = Some(image);
        }
        Ok(found.into_iter().flatten().collect())
    }

    /// A fresh request number.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Hands a prompt to the engine; one that could never fit its cache is refused (413).
    pub(crate) fn submit(&self, mut s: Submission) -> Result<Submitted, ApiError> {
        let config = self.engine.config;
        let bs = config.block_size;
        if s.tokens.is_empty() {
            return Err(ApiError::bad_request("the prompt is empty"));
        }
        if s.priority != 0 && config.scheduling == crate::engine::SchedulingPolicy::Fcfs {
            // vLLM's words for it.
            return Err(ApiError::bad_request(format!(
                "Got priority {} but Priority scheduling is not enabled.",
                s.priority
            ))
            .kind("BadRequestError")
            .param("priority"));
        }
        *self
            .priorities
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(s.priority)
            .or_default() += 1;
        let needed = s.tokens.len().div_ceil(bs.tokens()) + 1;
        if needed > config.num_blocks {
            return Err(ApiError::too_large(format!(
                "the prompt needs {needed} KV blocks; this engine has {}",
                config.num_blocks
            )));
        }
        let lease = IdLease::claim(&self.live_ids, &s.id)?;
        let hold = s.hold.take();
        let plan = self.plan(&s.tokens, s.ignore_eos);
        let request = EngineRequest {
            block_mm_infos: self.block_infos(&s),
            id: s.id,
            tokens: s.tokens,
            max_tokens: usize::try_from(s.max_tokens).unwrap_or(usize::MAX).max(1),
            plan,
            cache_salt: s.cache_salt,
            lora: s.lora,
            handoff: s.handoff,
            in_store: s.in_store,
            priority: s.priority,
        };
        let end = request.plan.end;
        let (outputs, mut guard) = self.engine.submit(request);
        guard.lease = Some(Box::new(lease));
        let outputs = match hold {
            Some(claim) => self.holds.relay(self.engine.clone(), claim, outputs),
            None => outputs,
        };
        Ok(Submitted { outputs, guard, end })
    }

    /// Per block, the images a submission's prompt covers.
    fn block_infos(&self, s: &Submission) -> Option<Vec<Option<kvroute_core::BlockExtraInfo>>> {
        let bs = self.engine.config.block_size;
        s.mm.as_ref()
            .filter(|mm| !mm.mm_objects.is_empty())
            .map(|mm| mm.to_block_level(bs, s.tokens.len()))
    }

    /// The engine's request for a submission (a copy, to ask the engine about it).
    pub(crate) fn engine_request(&self, s: &Submission) -> EngineRequest {
        EngineRequest {
            id: s.id.clone(),
            tokens: s.tokens.clone(),
            block_mm_infos: self.block_infos(s),
            max_tokens: usize::try_from(s.max_tokens).unwrap_or(usize::MAX).max(1),
            plan: self.plan(&s.tokens, s.ignore_eos),
            cache_salt: s.cache_salt.clone(),
            lora: s.lora.clone(),
            handoff: s.handoff,
            in_store: s.in_store.clone(),
            priority: s.priority,
        }
    }
}

/// A request's claim on its id while it is under way (released with its cancel guard).
struct IdLease {
    ids: Arc<std::sync::Mutex<rustc_hash::FxHashSet<String>>>,
    id: String,
}

impl IdLease {
    /// Claims `id`; a 409 when a request under way has it (the other request is untouched).
    fn claim(
        ids: &Arc<std::sync::Mutex<rustc_hash::FxHashSet<String>>>,
        id: &str,
    ) -> Result<Self, ApiError> {
        let mut live = ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !live.insert(id.to_owned()) {
            let shown = crate::disagg::shown(id);
            return Err(ApiError::new(
                axum::http::StatusCode::CONFLICT,
                format!("a request with id {shown:?} is already running on this engine"),
            )
            .kind("BadRequestError")
            .no_code());
        }
        Ok(Self { ids: Arc::clone(ids), id: id.to_owned() })
    }
}

impl Drop for IdLease {
    fn drop(&mut self) {
        let mut live = self.ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        live.remove(&self.id);
    }
}

/// A number no other engine of this host is likely to draw (names the engine).
fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Seconds since the epoch.
pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
