//! One function per decoder of untrusted bytes, each taking the bytes the whole way a server
//! would: decoded, converted and applied to a router's index, or prepared as a request. The
//! cargo-fuzz targets in `fuzz/` call them; `tests/corpus.rs` replays `fuzz/corpus` and
//! `fuzz/regressions` through them in the ordinary test suite. Each must return, never panic,
//! whatever the bytes.
//!
//! | target | bytes | path |
//! |---|---|---|
//! | `vllm` | a vLLM / SGLang msgpack batch | the subscription's pipeline, apply |
//! | `trtllm_json`, `trtllm_msgpack` | TensorRT-LLM event dicts | the subscription's pipeline, apply |
//! | `router_events` | kvroute `RouterEvent` JSON (`POST /events`) | decode, apply as posted |
//! | `router_api` | a `find_best_worker` body | decode, place; with a class, admit through flow control and abandon |
//! | `replica_sync` | a replica's decisions (NATS) | decode, apply to in-flight accounting |
//! | `index_snapshot` | an index snapshot (JetStream object store) | decode, apply |
//! | `openai_chat`, `openai_completion` | OpenAI request bodies | decode, size checks, template, tokens |
//! | `vllm_generate` | a vLLM `/inference/v1/generate` body | decode, vLLM's checks, image blocks |
//! | `sglang_generate` | an SGLang `/generate` body, or its answer | decode, SGLang's checks; the answer's decode |
//! | `image` | an encoded image | header checks, decode, identifier |
//! | `zmtp` | what a ZMQ peer sends, from its greeting on | ZMTP decoder: greeting, handshake, frames |
//! | `handoff` | a request's transfer fields, a side channel call, a prefill's answer | each role's leg, key bounds, hold claims |
//! | `store` | shared-store calls and answers, one per line | decode, apply to a store (bounds checked), an engine's writes |
//! | `ext_proc` | a gateway's ext_proc messages on one stream (length-delimited protobuf) | decode, the picker's exchange: headers, body, pick, response |
//! | `members` | members' bucket entries and `POST /workers` bodies, and worker templates, one per line | decode, template fill, join and remove on a router |

use std::sync::{Arc, OnceLock};

use kvroute_core::{BlockSize, LocalBlockHash, WorkerId, WorkerWithDpRank};
use kvroute_http::openai::{ChatCompletionRequest, CompletionRequest};
use kvroute_http::router_api::{BinaryQuery, FindBestWorker};
use kvroute_preprocess::{ImageConfig, Preprocessor, images};
use kvroute_router::{PlaceRequest, RouterConfig, RouterState, WorkerSpec};
use kvroute_wire::{ConvertConfig, EventFormat, Framed, Pipeline};

/// What a target does with its input.
pub type Target = fn(&[u8]);

/// Every target, by the name of its corpus directory.
pub const TARGETS: &[(&str, Target)] = &[
    ("vllm", vllm),
    ("trtllm_json", trtllm_json),
    ("trtllm_msgpack", trtllm_msgpack),
    ("router_events", router_events),
    ("router_api", router_api),
    ("router_api_binary", router_api_binary),
    ("replica_sync", replica_sync),
    ("index_snapshot", index_snapshot),
    ("openai_chat", openai_chat),
    ("openai_completion", openai_completion),
    ("vllm_generate", vllm_generate),
    ("vllm_derender", vllm_derender),
    ("sglang_generate", sglang_generate),
    ("image", image),
    ("zmtp", zmtp),
    ("worker_reports", worker_reports),
    ("tokenize", tokenize),
    ("handoff", handoff),
    ("store", store),
    ("ext_proc", ext_proc),
    ("members", members),
    ("trace_context", trace_context),
];

/// The first line a `traceparent`, the rest `tracestate` values (one header each): read as a
/// request's trace context, and passed on as a child when valid, within its bounds.
pub fn trace_context(data: &[u8]) {
    use axum::http::{HeaderMap, HeaderValue};
    use kvroute_http::trace::{MAX_TRACESTATE_BYTES, TRACEPARENT, TRACESTATE, TraceContext};
    let mut lines = data.split(|&b| b == b'\n');
    let mut headers = HeaderMap::new();
    if let Some(Ok(v)) = lines.next().map(HeaderValue::from_bytes) {
        headers.insert(TRACEPARENT, v);
    }
    for line in lines {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append(TRACESTATE, v);
        }
    }
    if let Some(t) = TraceContext::from_headers(&headers) {
        assert!(t.state.as_ref().is_none_or(|s| s.len() <= MAX_TRACESTATE_BYTES));
        let mut out = HeaderMap::new();
        t.child(kvroute_http::trace::new_span_id()).write(&mut out);
        assert_eq!(out[TRACEPARENT].len(), 55);
    }
}

/// Each line the body `POST /workers` takes, a signed members' bucket registration (checked
/// under the fuzz fleet's key, `KEY`, with allowed ranges) and a worker template: decoded; a
/// worker joins a router (no events or load reports: nothing is started) and leaves; a
/// template is filled with an address.
pub fn members(data: &[u8]) {
    use kvroute_router::members::signed::worker_of;
    use kvroute_router::members::{MembersKey, Template, Verifier, parse_entry};
    static ROUTER: OnceLock<Arc<RouterState>> = OnceLock::new();
    static VERIFIER: OnceLock<Option<Verifier>> = OnceLock::new();
    let router = ROUTER.get_or_init(|| Arc::new(router()));
    let verifier = VERIFIER.get_or_init(|| {
        Some(Verifier {
            key: MembersKey::from_secret(MEMBERS_FUZZ_KEY).ok()?,
            bucket: "fuzz".into(),
            ttl: std::time::Duration::from_secs(u64::MAX / 4_000),
            allow: vec!["127.0.0.0/8".parse().ok()?, "fd00::/8".parse().ok()?],
        })
    });
    for line in data.split(|&b| b == b'\n') {
        // A registration: `KEY<TAB>VALUE`, or the whole line under one key.
        let (key, value) = match line.iter().position(|&b| b == b'\t') {
            Some(tab) => (String::from_utf8_lossy(&line[..tab]).into_owned(), &line[tab + 1..]),
            None => ("w1".to_owned(), line),
        };
        if let Some(verifier) = verifier {
            let _ = verifier.verify(&key, value);
        }
        let _ = worker_of(value);
        if let Ok(mut spec) = parse_entry(line) {
            (spec.events, spec.replay, spec.metrics) = (None, None, None);
            if kvroute_router::members::join(router, &spec, "fuzz").is_ok() {
                kvroute_router::members::remove(router, spec.id);
            }
        }
        let Ok(text) = std::str::from_utf8(line) else { continue };
        if let Ok(template) = text.parse::<Template>() {
            let _ = template.fill(std::net::IpAddr::from([127, 0, 0, 1]), Some(8000));
            let _ = template.fill("::1".parse().unwrap_or(std::net::IpAddr::from([0; 16])), None);
        }
    }
}

/// The fuzz fleet's registration key (the corpus' signed registrations are signed with it).
pub const MEMBERS_FUZZ_KEY: &[u8] = b"the fuzz fleet's registration key";

/// A simulated engine's hand-off decoders ([`kvroute_mocker::handoff::fuzz`]).
pub fn handoff(data: &[u8]) {
    kvroute_mocker::handoff::fuzz(data);
}

/// The shared store's messages ([`kvroute_mocker::store::fuzz`]).
pub fn store(data: &[u8]) {
    kvroute_mocker::store::fuzz(data);
}

/// A router over two configured workers, with small bounds.
fn router() -> RouterState {
    let config = RouterConfig {
        workers: vec![WorkerSpec::new(1), WorkerSpec::new(2)],
        shards: 2,
        max_dp_size: 8,
        ..RouterConfig::default()
    };
    RouterState::new(config)
}

/// The pipeline a router's subscription runs for worker 1's rank 0 in `format`.
fn pipeline(format: EventFormat) -> Pipeline {
    let block_size = BlockSize::new(4).unwrap_or_default();
    let convert =
        ConvertConfig { block_size, image_token_id: Some(151_655), vocab_size: Some(151_936) };
    Pipeline::new(WorkerWithDpRank::new(WorkerId(1), 0), format, convert)
}

/// One message's payload through the format's pipeline, as the subscription decodes it, and
/// into a router's index.
fn events(format: EventFormat, data: &[u8]) {
    let Ok(decoded) = pipeline(format).decode(Framed { seq: Some(0), payload: data }) else {
        return;
    };
    let state = router();
    let Some(ingest) = state.ingest_for(WorkerWithDpRank::new(WorkerId(1), 0)) else { return };
    ingest.converted(&decoded.stats);
    ingest.apply(&decoded.events);
    let _ = state.view().workers();
}

pub fn vllm(data: &[u8]) {
    // The fast decoder and the general one agree on every input (or the fast one stood aside).
    let fast = kvroute_wire::vllm::decode_batch(data);
    let general = kvroute_wire::vllm::decode_batch_general(data);
    assert_eq!(format!("{fast:?}"), format!("{general:?}"), "the two vLLM decoders disagree");
    events(EventFormat::Vllm, data);
}

pub fn trtllm_json(data: &[u8]) {
    events(EventFormat::TrtllmJson, data);
}

pub fn trtllm_msgpack(data: &[u8]) {
    events(EventFormat::TrtllmMsgpack, data);
}

pub fn router_events(data: &[u8]) {
    let Ok(events) = kvroute_wire::decode_router_events(data) else { return };
    let state = router();
    state.apply_posted(&events);
    let _ = state.view().workers();
    // Look the stored blocks up again: the device tree, the lower tiers and hybrid groups.
    let query: Vec<kvroute_core::LocalBlockHash> = events
        .iter()
        .filter_map(|e| match &e.event.data {
            kvroute_core::KvCacheEventData::Stored(s) => {
                Some(s.blocks.iter().map(|b| b.tokens_hash))
            }
            _ => None,
        })
        .flatten()
        .take(64)
        .collect();
    let _ = state.view().find_matches_within(&query, query.len(), 16);
    let _ = state.view().find_matches_within(&query, query.len() / 2, 1);
}

pub fn replica_sync(data: &[u8]) {
    let Ok(batch) = kvroute_wire::replica::decode_sync(data) else { return };
    let state = router();
    let mut peers = kvroute_router::nats::Peers::default();
    peers.apply_sync(&state, batch);
    let _ = state.view().in_flight();
}

pub fn index_snapshot(data: &[u8]) {
    let Ok(snapshot) = kvroute_wire::replica::decode_snapshot(data) else { return };
    let state = router();
    state.apply(&snapshot.events);
    let _ = state.view().index_as_events();
}

pub fn router_api(data: &[u8]) {
    let Ok(req) = serde_json::from_slice::<FindBestWorker>(data) else { return };
    place(&req);
}

/// `find_best_worker`'s binary form: the bytes up to the first newline are the query string
/// (decoded as the router's `Query` extractor decodes it), the rest is the body of hashes.
pub fn router_api_binary(data: &[u8]) {
    let (query, body) = match data.iter().position(|&b| b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(query) = serde_urlencoded::from_bytes::<BinaryQuery>(query) else { return };
    let Ok(req) = FindBestWorker::from_binary(query, body) else { return };
    place(&req);
}

fn place(req: &FindBestWorker) {
    let Ok(num_tokens) = usize::try_from(req.num_tokens) else { return };
    if num_tokens == 0 {
        return;
    }
    let state = router();
    #[allow(clippy::needless_update)] // a new field of the request defaults here
    let placement = PlaceRequest {
        id: req.request_id.clone(),
        local_hashes: req.local_hashes.iter().copied().map(LocalBlockHash).collect(),
        num_tokens,
        output_tokens: req.max_tokens.map_or(0, |m| usize::try_from(m).unwrap_or(usize::MAX)),
        adapter: req.lora_name.clone(),
        session: req.session_id.clone(),
        exclude: req.exclude.clone(),
        overlap_weight: req.overlap_score_weight.filter(|w| w.is_finite()),
        temperature: req.temperature.filter(|t| t.is_finite() && *t >= 0.0),
        ..PlaceRequest::default()
    };
    let _ = state.decide_now(&placement);
    if req.classed() {
        admit(req, &placement);
    }
}

/// A request that names its class goes through flow control (on here, and saturated, so some
/// wait): its first poll admits, queues or refuses it; dropped, it leaves the queue.
fn admit(req: &FindBestWorker, p: &PlaceRequest) {
    use std::future::Future as _;
    let params = ["priority", "tenant", "ttft_slo_ms"];
    let Ok(class) = kvroute_http::router_api::request_class(
        req.priority,
        req.tenant.as_deref(),
        req.ttft_slo_ms,
        params,
    ) else {
        return;
    };
    let mut config = RouterConfig { workers: vec![WorkerSpec::new(1)], ..RouterConfig::default() };
    config.scheduler.flow.enabled = true;
    config.scheduler.flow.max_engine_wait_ms = 0.0;
    let state = RouterState::new(config);
    for k in 0..3 {
        let ask =
            PlaceRequest { id: Some(format!("fuzz-{k}")), class: Some(class.clone()), ..p.clone() };
        let mut admitted = std::pin::pin!(state.decide(&ask));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let _ = admitted.as_mut().poll(&mut cx);
    }
    assert_eq!(state.view().waiting(), (0, 0), "an abandoned wait leaves the queue");
}

fn preprocessor() -> &'static Arc<Preprocessor> {
    static MODEL: OnceLock<Arc<Preprocessor>> = OnceLock::new();
    MODEL.get_or_init(|| Arc::new(Preprocessor::builtin()))
}

/// The context length the request targets use (small, so the size checks are exercised).
const MAX_MODEL_LEN: u64 = 4096;

pub fn openai_chat(data: &[u8]) {
    let Ok(req) = serde_json::from_slice::<ChatCompletionRequest>(data) else { return };
    let p = preprocessor();
    let texts = req.messages.iter().map(|m| m.role.as_str());
    if p.check_size(req.messages.len(), texts, MAX_MODEL_LEN).is_err() {
        return;
    }
    // Images are the `image` target's; here they are left out as a text-only request.
    let messages: Vec<_> = req
        .messages
        .into_iter()
        .filter(|m| kvroute_preprocess::image_urls(std::slice::from_ref(m)).is_empty())
        .collect();
    let _ = p.prepare_chat(&messages, true, Vec::new());
}

/// Any text through the front door's tokenizer (`kvroute_preprocess::fast_bpe`'s path) and
/// through the tokenizer library's own: the ids must be the same, so a difference panics here
/// for the fuzzer to report (a differential target, unlike the others).
pub fn tokenize(data: &[u8]) {
    static LIBRARY: OnceLock<Preprocessor> = OnceLock::new();
    let Ok(text) = std::str::from_utf8(data) else { return };
    let library =
        LIBRARY.get_or_init(|| Preprocessor::builtin().without_prefix_cache().without_fast_path());
    let (fast, slow) = (preprocessor().encode(text).ok(), library.encode(text).ok());
    assert_eq!(fast, slow, "the fast path's ids differ from the library's for {text:?}");
}

pub fn openai_completion(data: &[u8]) {
    let Ok(req) = serde_json::from_slice::<CompletionRequest>(data) else { return };
    let _ = preprocessor().prepare_completion_request(&req, MAX_MODEL_LEN);
}

/// A body of vLLM's token-in API as the simulated engine takes it: decoded, checked, and (when
/// it passes) its images cut into the blocks of its prompt.
pub fn vllm_generate(data: &[u8]) {
    use kvroute_http::vllm_generate::GenerateRequest;
    let Ok(req) = serde_json::from_slice::<GenerateRequest>(data) else { return };
    if req.check().is_err() {
        return;
    }
    if let Some(features) = &req.features {
        let block_size = BlockSize::new(4).unwrap_or_default();
        let _ = features.extra_info().to_block_level(block_size, req.token_ids.len());
    }
}

/// A streamed derender call (`/v1/chat/completions/derender` with `stream: true`): its
/// carried state checked, then its chunk's ids decoded through the client's own window, as
/// the simulated engine does; and the same bytes as a tokens chunk the front door decodes.
pub fn vllm_derender(data: &[u8]) {
    use kvroute_http::vllm_generate::{DerenderStreamRequest, GenerateChunk};
    use kvroute_preprocess::DecodeWindow;
    let p = preprocessor();
    if let Ok(req) = serde_json::from_slice::<DerenderStreamRequest>(data) {
        let state = req.stream_state.unwrap_or_default();
        if state.check().is_ok() {
            let mut window = DecodeWindow {
                prev_tokens: state.prev_tokens,
                prefix_offset: state.prefix_offset,
                read_offset: state.read_offset,
            };
            for c in &req.generate_chunk.choices {
                let _ = p.decode_next(&mut window, c.token_ids.as_deref().unwrap_or_default());
            }
        }
    }
    if let Ok(chunk) = serde_json::from_slice::<GenerateChunk>(data) {
        let mut window = p.decode_window(chunk.prompt_token_ids.as_deref().unwrap_or_default());
        for c in &chunk.choices {
            let _ = p.decode_next(&mut window, c.token_ids.as_deref().unwrap_or_default());
        }
    }
}

/// A body of SGLang's `/generate` as the simulated engine takes it (decoded against the
/// contract, then SGLang's checks), and the same bytes as an answer or chunk the front door
/// reads back from an SGLang worker.
pub fn sglang_generate(data: &[u8]) {
    use kvroute_http::sglang_generate::{GenerateResponse, decode};
    if let Ok(req) = decode(data) {
        let _ = req.check();
        let _ = (req.params(), req.is_batch());
    }
    let _ = serde_json::from_slice::<GenerateResponse>(data);
}

pub fn image(data: &[u8]) {
    // Bounds small enough that each input decodes in milliseconds.
    let config = ImageConfig {
        max_image_pixels: 1 << 20,
        max_request_pixels: 1 << 20,
        ..ImageConfig::default()
    };
    let _ = images::decode(data, &config);
}

/// The message budget of the `zmtp` target (a publisher's, the smallest kvroute sets).
const ZMTP_BUDGET: usize = kvroute_wire::transport::CONTROL_MAX_MESSAGE_BYTES;

/// Bytes as a ZMQ socket receives them from a peer, from the greeting on, through the
/// transport's bounded decoder. The first byte sets the read size (1-255), so frames arrive
/// split as TCP may split them; the rest is the stream. A decode error ends it (the socket
/// drops the peer). Every message decoded fits the budget, and the buffer never grows past
/// a small multiple of the budget and the input, whatever lengths the frames announce.
/// What a worker tells the router and the front door about itself: a JSON load report (its
/// adapters' names included), a Prometheus exposition (vLLM's gauges and
/// `vllm:lora_requests_info`), and a `/v1/models` list; the adapters taken go to a router's
/// adapter table as its load reader and model reading hand them on.
pub fn worker_reports(data: &[u8]) {
    let state = router();
    let w = kvroute_core::WorkerWithDpRank::new(1u64, 0u32);
    if let Some((_, load, adapters)) = kvroute_router::load::decode_report(data) {
        if let Some(a) = adapters {
            a.report(&state, w);
        }
        state.update_load(w, load);
    }
    let text = String::from_utf8_lossy(data);
    // Scraped gauges go where a poll takes them (a block size not the router's refuses it).
    if let Some(load) = kvroute_router::load::parse_prometheus(&text).into_values().next() {
        state.update_load(w, load);
    }
    if let Some(a) = kvroute_router::load::parse_lora_info(&text) {
        a.report(&state, w);
    }
    if let Ok(list) = serde_json::from_slice::<kvroute_http::openai::ModelList>(data) {
        let listed: std::collections::BTreeSet<String> =
            list.adapters_of("kvroute-tiny").into_iter().collect();
        state.set_served_adapters(w, Some(listed));
    }
}

pub fn zmtp(data: &[u8]) {
    zmtp_messages(data);
}

/// [`zmtp`], returning how many messages were decoded and whether the stream was refused.
pub fn zmtp_messages(data: &[u8]) -> (usize, bool) {
    use asynchronous_codec::Decoder;
    use zeromq::__bench::{Message, ZmqCodec};

    let Some((&read, stream)) = data.split_first() else { return (0, false) };
    let mut messages = 0;
    let mut codec = ZmqCodec::with_max_message_size(ZMTP_BUDGET);
    let mut buffer = bytes::BytesMut::new();
    for piece in stream.chunks(usize::from(read).max(1)) {
        buffer.extend_from_slice(piece);
        loop {
            match codec.decode(&mut buffer) {
                Ok(Some(Message::Message(m))) => {
                    let size: usize = m.iter().map(|f| f.len() + zeromq::FRAME_OVERHEAD).sum();
                    assert!(size <= ZMTP_BUDGET, "a message of {size} bytes passed the budget");
                    messages += 1;
                }
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return (messages, true),
            }
        }
        assert!(
            buffer.capacity() <= 4 * (ZMTP_BUDGET + stream.len()),
            "the decoder reserved {} bytes",
            buffer.capacity()
        );
    }
    (messages, false)
}

/// A gateway's ext_proc stream: `ProcessingRequest`s, each length-delimited as protobuf
/// frames them, through one exchange of a picker over a front door with two workers (their
/// ports closed: nothing is sent, the pick is made and freed). A message with no request
/// and `observability_mode` set stands for the stream's deadline passing
/// (`Exchange::expired`), so the fuzzer reaches every deadline from every phase. At the end
/// nothing is in flight and no body byte is held of the budget. Inputs naming a URL with a
/// scheme (`://`) are skipped: an image URL would be fetched, and fuzzing stays off the
/// network.
pub fn ext_proc(data: &[u8]) {
    let _ = ext_proc_answers(data);
}

/// [`ext_proc`], returning how many messages the picker answered with and whether it
/// refused one (an immediate response, or a gRPC error).
pub fn ext_proc_answers(data: &[u8]) -> (usize, bool) {
    use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, processing_response};
    use prost::Message as _;
    if data.windows(3).any(|w| w == b"://") {
        return (0, true);
    }
    // One stream at a time (tests run in threads): the in-flight count is this one's.
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let (runtime, picker) = ext_proc_picker();
    let answered = runtime.block_on(async {
        let _ = ProcessingRequest::decode(data);
        let peer = Some(std::net::IpAddr::from([127, 0, 0, 1]));
        let mut exchange = kvroute_epp::exchange::Exchange::new(Arc::clone(picker), peer);
        let (mut answers, mut rest) = (0, data);
        while !rest.is_empty() {
            let Ok(m) = ProcessingRequest::decode_length_delimited(&mut rest) else {
                return (answers, true);
            };
            let out = match (&m.request, m.observability_mode) {
                (None, true) => exchange.expired(),
                _ => exchange.on(m).await,
            };
            let Ok(out) = out else { return (answers, true) };
            answers += out.len();
            let immediate =
                |r: &envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse| {
                    matches!(r.response, Some(processing_response::Response::ImmediateResponse(_)))
                };
            if out.iter().any(immediate) {
                return (answers, true);
            }
            if exchange.done() {
                break;
            }
        }
        (answers, false)
    });
    assert_eq!(picker.front.in_flight(), 0, "a dropped exchange leaves nothing in flight");
    assert_eq!(picker.budget.held(), 0, "a dropped exchange holds no body byte");
    answered
}

fn ext_proc_picker() -> &'static (tokio::runtime::Runtime, Arc<kvroute_epp::Picker>) {
    static PICKER: OnceLock<(tokio::runtime::Runtime, Arc<kvroute_epp::Picker>)> = OnceLock::new();
    PICKER.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("a runtime: {e}"));
        let picker = runtime.block_on(async {
            let workers = (1..=2u64)
                .map(|k| {
                    let mut w = WorkerSpec::new(k);
                    w.url = Some(format!("http://127.0.0.1:{k}"));
                    w
                })
                .collect();
            let router =
                Arc::new(RouterState::new(RouterConfig { workers, ..RouterConfig::default() }));
            let fetcher = kvroute_preprocess::fetch::Fetcher::new(
                kvroute_preprocess::fetch::FetchConfig::default(),
            )
            .unwrap_or_else(|e| panic!("a fetcher: {e}"));
            let front = Arc::new(kvroute_frontend::FrontendState::new(
                Arc::clone(preprocessor()),
                fetcher,
                router,
            ));
            Arc::new(kvroute_epp::Picker::new(front, kvroute_epp::EppOptions::default()))
        });
        (runtime, picker)
    })
}

/// The `ext_proc` target's seeds, built from the protobuf types (`fuzz/corpus/ext_proc`;
/// `tests/corpus.rs` checks the files are these): a chat in full duplex with its streamed
/// answer, a completion buffered with trailers, a `GET` with a subset hint, a body before
/// any headers.
pub fn ext_proc_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest, ProtocolConfiguration,
        processing_request::Request,
    };
    use envoy_types::pb::google::protobuf::Struct;
    use prost::Message as _;
    let headers = |pairs: &[(&str, &str)], end: bool| {
        let headers = pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect();
        HttpHeaders {
            headers: Some(HeaderMap { headers }),
            end_of_stream: end,
            ..HttpHeaders::default()
        }
    };
    let body = |b: &[u8], end: bool| HttpBody {
        body: b.to_vec(),
        end_of_stream: end,
        ..HttpBody::default()
    };
    let lb =
        |namespace: &str, key: &str, value: envoy_types::pb::google::protobuf::Value| Metadata {
            filter_metadata: [(
                namespace.to_owned(),
                Struct { fields: [(key.to_owned(), value)].into() },
            )]
            .into(),
            ..Metadata::default()
        };
    let message = |request: Request, metadata: Option<Metadata>, modes: Option<(i32, i32)>| {
        ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            protocol_config: modes.map(|(q, r)| ProtocolConfiguration {
                request_body_mode: q,
                response_body_mode: r,
                ..ProtocolConfiguration::default()
            }),
            ..ProcessingRequest::default()
        }
    };
    let frame = |messages: Vec<ProcessingRequest>| {
        messages.iter().flat_map(|m| m.encode_length_delimited_to_vec()).collect::<Vec<u8>>()
    };
    let post = |path: &str| {
        headers(
            &[(":method", "POST"), (":path", path), ("content-type", "application/json")],
            false,
        )
    };
    let served = lb(
        "envoy.lb",
        kvroute_epp::metadata::SERVED_KEY,
        kvroute_epp::metadata::string("127.0.0.1:1"),
    );
    let answer = headers(&[(":status", "200"), ("content-type", "text/event-stream")], false);
    let answer_plain = headers(&[(":status", "200"), ("content-type", "application/json")], false);
    // The stream's deadline passing (see `ext_proc`).
    let expire = || ProcessingRequest { observability_mode: true, ..ProcessingRequest::default() };
    let generate = br#"{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"sampling_params":{"max_tokens":2}}"#;
    let generate_with = br#"{"token_ids":[1,2,3],"sampling_params":{"max_tokens":2},"vllm_xargs":{"kv_transfer_params":{"do_remote_decode":true}}}"#;
    let chat = br#"{"messages":[{"role":"user","content":"Hello there, how are you?"}],"max_tokens":4,"stream":true}"#;
    let (full, buffered) = (4, 2);
    vec![
        (
            "chat-full-duplex",
            frame(vec![
                message(
                    Request::RequestHeaders(post("/v1/chat/completions")),
                    None,
                    Some((full, full)),
                ),
                message(Request::RequestBody(body(&chat[..30], false)), None, None),
                message(Request::RequestBody(body(&chat[30..], true)), None, None),
                message(Request::ResponseHeaders(answer.clone()), Some(served), None),
                message(
                    Request::ResponseBody(body(b"data: {\"choices\":[]}\n\n", false)),
                    None,
                    None,
                ),
                message(Request::ResponseBody(body(b"data: [DONE]\n\n", true)), None, None),
            ]),
        ),
        (
            "completion-buffered",
            frame(vec![
                message(
                    Request::RequestHeaders(post("/v1/completions")),
                    None,
                    Some((buffered, buffered)),
                ),
                message(
                    Request::RequestBody(body(
                        br#"{"prompt":"Once upon a time","max_tokens":3}"#,
                        true,
                    )),
                    None,
                    None,
                ),
                message(Request::ResponseHeaders(answer), None, None),
                message(
                    Request::ResponseBody(body(b"{\"usage\":{\"prompt_tokens\":5}}", false)),
                    None,
                    None,
                ),
                message(Request::ResponseTrailers(HttpTrailers::default()), None, None),
            ]),
        ),
        (
            "get-with-subset",
            frame(vec![message(
                Request::RequestHeaders(headers(
                    &[(":method", "GET"), (":path", "/v1/models")],
                    true,
                )),
                Some(lb(
                    kvroute_epp::metadata::SUBSET_NAMESPACE,
                    kvroute_epp::metadata::SUBSET_KEY,
                    kvroute_epp::metadata::list(["127.0.0.1:2"]),
                )),
                None,
            )]),
        ),
        ("body-first", frame(vec![message(Request::RequestBody(body(b"{}", true)), None, None)])),
        (
            "generate-with-transfer",
            frame(vec![
                message(Request::RequestHeaders(post("/inference/v1/generate")), None, None),
                message(Request::RequestBody(body(generate_with, true)), None, None),
            ]),
        ),
        (
            "generate-placed",
            frame(vec![
                message(Request::RequestHeaders(post("/inference/v1/generate")), None, None),
                message(Request::RequestBody(body(generate, true)), None, None),
                message(Request::ResponseHeaders(answer_plain.clone()), None, None),
                message(Request::ResponseBody(body(b"{}", true)), None, None),
            ]),
        ),
        (
            "deadline-mid-body",
            frame(vec![
                message(Request::RequestHeaders(post("/v1/chat/completions")), None, None),
                message(Request::RequestBody(body(&chat[..30], false)), None, None),
                expire(),
            ]),
        ),
        (
            "deadline-after-pick",
            frame(vec![
                message(Request::RequestHeaders(post("/v1/chat/completions")), None, None),
                message(Request::RequestBody(body(chat, true)), None, None),
                expire(),
                message(Request::ResponseHeaders(answer_plain), None, None),
            ]),
        ),
    ]
}
