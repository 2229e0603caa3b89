//! The simulated engine over real sockets on 127.0.0.1: its OpenAI API, its KV events on ZMQ
//! (and their replay), its load reports, and what a client that leaves leaves behind.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Method, Request};
use http_body_util::BodyExt;
use kvroute_core::BlockSize;
use kvroute_http::openai::stream_chunks;
use kvroute_http::testing;
use kvroute_mocker::{Endpoints, EngineConfig, MockerConfig, Timing, http};
use kvroute_wire::EngineEvent;
use kvroute_wire::vllm::decode_batch;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tower::ServiceExt;
use zeromq::{Socket, SocketRecv, SubSocket};

/// A simulated engine's app, called in-process (`app(state).oneshot(..)`).
struct Mocker {
    app: axum::Router,
    state: Arc<http::AppState>,
}

async fn start(num_blocks: usize, endpoints: Endpoints) -> Mocker {
    start_with(MockerConfig {
        engine: EngineConfig {
            num_blocks,
            block_size: BlockSize::new(16).unwrap(),
            timing: Timing { speedup: 100.0 },
            ..EngineConfig::default()
        },
        endpoints,
        ..MockerConfig::default()
    })
    .await
}

async fn start_with(config: MockerConfig) -> Mocker {
    let state = kvroute_mocker::start(config).await.unwrap();
    Mocker { app: http::app(Arc::clone(&state)), state }
}

impl Mocker {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, v) = testing::call(&self.app, Method::POST, path, Some(body)).await;
        (status.as_u16(), v)
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let (status, v) = testing::call(&self.app, Method::GET, path, None).await;
        (status.as_u16(), v)
    }

    /// A raw body (not JSON).
    async fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .unwrap();
        let (status, v) = testing::call_raw(&self.app, req).await;
        (status.as_u16(), v)
    }
}

fn chat(text: &str, max_tokens: usize) -> Value {
    json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens})
}

const LONG: &str = "Please summarize the following text in three bullet points. The router sends each request to the worker that already holds the longest part of its prompt, unless that worker is too busy. A block is a fixed number of tokens.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompts_report_their_cached_tokens() {
    let m = start(1000, Endpoints::default()).await;
    let (status, first) = m.post("/v1/chat/completions", &chat(LONG, 5)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["usage"]["completion_tokens"], 5);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // Five words of the vocabulary: the text tokenizes back to the words, and the answer is cut
    // at its length (the simulated model never ends its turn early).
    let words = first["choices"][0]["message"]["content"].as_str().unwrap();
    let tokens = kvroute_preprocess::Preprocessor::builtin().encode(words).unwrap();
    assert_eq!((words.split(' ').count(), tokens.len()), (5, 5), "words: {words}");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let (_, second) = m.post("/v1/chat/completions", &chat(LONG, 5)).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        (prompt_tokens - 1) / 16 * 16
    );
    assert_eq!(
        second["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"],
        "deterministic"
    );
    // Token ids directly, on /v1/completions.
    let (status, c) = m
        .post("/v1/completions", &json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 2}))
        .await;
    assert_eq!((status, c["object"].as_str()), (200, Some("text_completion")), "{c}");
    let (_, stats) = m.get("/stats").await;
    assert_eq!(stats["requests_finished"], 3);
    let (status, models) = m.get("/v1/models").await;
    assert_eq!((status, models["data"][0]["id"].as_str()), (200, Some("kvroute-tiny")));
    let (_, metrics) = m.get("/metrics").await;
    let metrics = metrics.as_str().unwrap();
    let cached = (prompt_tokens / 16 * 16) as f64;
    let sample = |name: &str| kvroute_http::metrics::sample(metrics, name);
    assert_eq!(sample("kvroute_mocker_cached_prompt_tokens_total"), Some(cached), "{metrics}");
    // vLLM's names, as a router reading an engine's /metrics expects them.
    let labels = "{model_name=\"kvroute-tiny\",engine=\"0\"}";
    assert_eq!(sample(&format!("vllm:prefix_cache_hits_total{labels}")), Some(cached), "{metrics}");
    assert_eq!(sample(&format!("vllm:num_requests_running{labels}")), Some(0.0));
    assert!(metrics.contains("vllm:cache_config_info{model_name=\"kvroute-tiny\",engine=\"0\",block_size=\"16\",num_gpu_blocks=\"1000\"} 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_sent_back_hits_the_answer_too() {
    // What every chat client does: the next round carries the assistant's text. Its tokens are
    // the ones the engine generated, so the cached prefix covers the previous prompt and the
    // answer's full blocks (all computed tokens but the last sampled one).
    let m = start(1000, Endpoints::default()).await;
    let mut messages = vec![json!({"role": "user", "content": LONG})];
    for round in 0..3 {
        let body = json!({"messages": messages, "max_tokens": 40, "ignore_eos": true});
        let (status, r) = m.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{r}");
        let (prompt, answer) = (
            r["usage"]["prompt_tokens"].as_u64().unwrap(),
            r["usage"]["completion_tokens"].as_u64().unwrap(),
        );
        assert_eq!(answer, 40);
        let text = r["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        messages.push(json!({"role": "assistant", "content": text}));
        messages.push(json!({"role": "user", "content": format!("And round {round}?")}));
        let (_, next) =
            m.post("/v1/chat/completions", &json!({"messages": messages, "max_tokens": 1})).await;
        let cached = next["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
        assert_eq!(cached, (prompt + answer - 1) / 16 * 16, "round {round}: {}", next["usage"]);
        assert!(cached > prompt, "the answer's blocks hit too");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_as_openai_does() {
    let m = start(1000, Endpoints::default()).await;
    let mut body = chat("Tell me a joke.", 3);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, text) = m.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200);
    let (chunks, done) = stream_chunks(text.as_str().unwrap().as_bytes()).unwrap();
    assert!(done, "[DONE] at the end");
    assert_eq!(chunks[0].choices[0].delta.as_ref().unwrap().role.as_deref(), Some("assistant"));
    assert!(chunks.iter().all(|c| c.object == "chat.completion.chunk"));
    let content: String =
        chunks.iter().flat_map(|c| c.choices.iter().filter_map(|ch| ch.new_text())).collect();
    assert_eq!(content.split(' ').count(), 3, "three words, cut at the length");
    assert_eq!(chunks[chunks.len() - 2].choices[0].finish_reason.as_deref(), Some("length"));
    assert_eq!(chunks.last().unwrap().usage.unwrap().completion_tokens, 3);
    // With ignore_eos, the same.
    body["ignore_eos"] = json!(true);
    let (_, text) = m.post("/v1/chat/completions", &body).await;
    let (chunks, _) = stream_chunks(text.as_str().unwrap().as_bytes()).unwrap();
    assert_eq!(chunks.iter().filter(|c| c.has_text()).count(), 3);
    assert_eq!(chunks[chunks.len() - 2].choices[0].finish_reason.as_deref(), Some("length"));
}

fn png(shade: u8) -> Vec<u8> {
    let img =
        image::ImageBuffer::from_fn(84, 84, |x, y| image::Rgba([shade, x as u8, y as u8, 255]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_by_data_url_and_loopback_http_cache_per_image() {
    use base64::Engine as _;
    // A loopback image server, fetched only because the engine is told private URLs are fine.
    let images = axum::Router::new()
        .route("/a.png", axum::routing::get(|| async { png(1) }))
        .route("/b.png", axum::routing::get(|| async { png(2) }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let image_host = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, images).into_future());
    let engine = EngineConfig {
        block_size: BlockSize::new(16).unwrap(),
        timing: Timing { speedup: 100.0 },
        ..EngineConfig::default()
    };
    let fetch = kvroute_mocker::FetchConfig { allow_private: true, ..Default::default() };
    let m = start_with(MockerConfig { engine, fetch, ..MockerConfig::default() }).await;

    let ask = |url: String| {
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": LONG},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in this picture?"}]}], "max_tokens": 1})
    };
    let data_a = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png(1))
    );
    let (status, first) = m.post("/v1/chat/completions", &ask(data_a)).await;
    assert_eq!(status, 200, "{first}");
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // The same picture over http: same identifier, so every full block is cached.
    let (_, again) =
        m.post("/v1/chat/completions", &ask(format!("http://{image_host}/a.png"))).await;
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        prompt / 16 * 16
    );
    // Another picture: only the blocks before the image are cached.
    let (_, other) =
        m.post("/v1/chat/completions", &ask(format!("http://{image_host}/b.png"))).await;
    let cached = other["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < prompt / 16 * 16, "{cached} of {prompt}");
    let (status, missing) =
        m.post("/v1/chat/completions", &ask(format!("http://{image_host}/c.png"))).await;
    assert_eq!(status, 400, "{missing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let m = start(8, Endpoints::default()).await;
    let png = "data:image/png;base64,not-base64!";
    let cases = [
        ("{not json".to_owned(), 400),
        (json!({"messages": []}).to_string(), 400),
        (json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).to_string(), 404),
        // Longer than the context (capped at the 8-block cache): vLLM's 400.
        (chat(&"word ".repeat(400), 1).to_string(), 400),
        (chat("hi", 0).to_string(), 400),
        (chat("hi", 1_000_000_000_000_000).to_string(), 400),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}).to_string(), 400),
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}]}).to_string(), 400),
        // It returns one choice: more is refused, not answered with one.
        (json!({"messages": [{"role": "user", "content": "hi"}], "n": 1000}).to_string(), 400),
        (json!({"messages": [{"role": "user", "content": "hi"}], "best_of": 3}).to_string(), 400),
    ];
    for (body, want) in cases {
        let (status, v) = m.post_raw("/v1/chat/completions", &body).await;
        assert_eq!(status, want, "{body}: {v}");
        assert!(v["error"]["message"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    }
    let (status, v) = m.get("/v1/chat/completions").await;
    assert_eq!((status, v["error"]["type"].as_str()), (405, Some("invalid_request_error")), "{v}");
    let (status, v) = m.get("/nope").await;
    assert_eq!((status, v["error"]["type"].as_str()), (404, Some("not_found_error")), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_frees_its_request() {
    let m = start(1000, Endpoints::default()).await;
    let mut body = chat(LONG, 10_000);
    body["stream"] = json!(true);
    body["ignore_eos"] = json!(true);
    let request = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = m.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.into_body();
    let first = stream.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()), "a first chunk");
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.state.engine.snapshot().num_running_reqs == 0 {
        assert!(Instant::now() < deadline, "the request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.state.engine.snapshot().num_running_reqs > 0 {
        assert!(Instant::now() < deadline, "the request kept running after its client left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let after = m.state.engine.snapshot();
    assert_eq!(
        (after.kv_cache_usage, after.stats.requests_finished),
        (0.0, 0),
        "cancelled, not finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_and_load_reports_are_published() {
    let endpoints = Endpoints {
        events: Some("tcp://127.0.0.1:0".into()),
        replay: Some("tcp://127.0.0.1:0".into()),
        metrics: Some("tcp://127.0.0.1:0".into()),
    };
    let m = start(1000, endpoints).await;
    let bound = m.state.engine.bound.clone();
    let mut load = SubSocket::new();
    load.connect(bound.metrics.as_deref().unwrap()).await.unwrap();
    load.subscribe("").await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(5), load.recv()).await.unwrap().unwrap();
    let report: Value = serde_json::from_slice(&report.into_vec().pop().unwrap()).unwrap();
    assert_eq!(report["kv_total_blocks"], 1000);

    let (status, _) = m.post("/v1/chat/completions", &chat(LONG, 1)).await;
    assert_eq!(status, 200);
    // What was published (before any subscriber) comes back through replay: once the
    // publisher's task has kept it, which may be a moment after the answer (at most 5 s).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let batches = loop {
        let batches = kvroute_router::subscriber::replay(
            &Default::default(),
            bound.replay.as_deref().unwrap(),
            0,
            u64::MAX,
        )
        .await
        .unwrap()
        .batches;
        if !batches.is_empty() || tokio::time::Instant::now() > deadline {
            break batches;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!batches.is_empty());
    let stored: usize = batches
        .iter()
        .flat_map(|(_, payload)| decode_batch(payload).unwrap().events)
        .map(|e| match e {
            EngineEvent::BlockStored(s) => s.block_hashes.len(),
            _ => 0,
        })
        .sum();
    let prompt_blocks = m.state.engine.snapshot().stats.prompt_tokens as usize / 16;
    assert_eq!(stored, prompt_blocks, "every full prompt block announced once");
}

/// The largest request the context allows, on a cache it fills alone, beside ordinary ones:
/// everyone finishes. (An unbounded `max_tokens` once left a small engine with a preempted
/// giant, nothing running and the others waiting for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_as_large_as_the_cache_does_not_starve_the_others() {
    let m = Arc::new(start(16, Endpoints::default()).await);
    let max_model_len = m.state.max_model_len;
    assert_eq!(max_model_len, 16 * 16, "the context is capped at the cache");
    let (_, rendered) = m
        .post(
            "/v1/chat/completions/render",
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    let prompt = rendered["token_ids"].as_array().map_or(0, Vec::len) as u64;
    assert!(prompt > 0, "{rendered}");
    let mut giant = chat("hi", (max_model_len - prompt) as usize);
    giant["ignore_eos"] = json!(true);
    let too_big = chat("hi", (max_model_len - prompt + 1) as usize);
    assert_eq!(m.post("/v1/chat/completions", &too_big).await.0, 400);
    let mut tasks = vec![{
        let m = Arc::clone(&m);
        tokio::spawn(async move { m.post("/v1/chat/completions", &giant).await })
    }];
    for k in 0..3 {
        let m = Arc::clone(&m);
        let mut small = chat(&format!("question {k}"), 8);
        small["ignore_eos"] = json!(true);
        tasks.push(tokio::spawn(async move { m.post("/v1/chat/completions", &small).await }));
    }
    for task in tasks {
        let (status, v) =
            tokio::time::timeout(Duration::from_secs(60), task).await.unwrap().unwrap();
        assert_eq!(status, 200, "{v}");
    }
}

/// Adapters as vLLM serves them: listed under their base model, answered under their own
/// name, another name a 404 `model_not_found`; loaded and unloaded through the dynamic API
/// with vLLM's answers; `vllm:lora_requests_info` names what runs.
#[tokio::test]
async fn adapters_are_listed_served_loaded_and_unloaded_as_vllm_does() {
    let m = start_with(MockerConfig {
        engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
        endpoints: Endpoints::default(),
        lora_modules: vec![("sql".into(), Some("/loras/sql".into()))],
        runtime_lora_updating: true,
        ..MockerConfig::default()
    })
    .await;
    let (_, models) = m.get("/v1/models").await;
    assert_eq!(models["data"][1]["id"], "sql", "{models}");
    assert_eq!(models["data"][1]["parent"], "kvroute-tiny", "{models}");
    assert_eq!(models["data"][1]["root"], "/loras/sql", "{models}");

    let chat = |model: &str| json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let (status, answer) = m.post("/v1/chat/completions", &chat("sql")).await;
    assert_eq!((status, answer["model"].as_str()), (200, Some("sql")), "{answer}");
    let (status, err) = m.post("/v1/chat/completions", &chat("chat")).await;
    assert_eq!((status, err["error"]["code"].as_str()), (404, Some("model_not_found")), "{err}");

    let load = json!({"lora_name": "chat", "lora_path": "/loras/chat"});
    let (status, said) = m.post("/v1/load_lora_adapter", &load).await;
    assert_eq!(status, 200, "{said}");
    assert_eq!(said, "Success: LoRA adapter 'chat' added successfully.");
    let (status, err) = m.post("/v1/load_lora_adapter", &load).await;
    assert_eq!((status, err["error"]["type"].as_str()), (400, Some("InvalidUserInput")), "{err}");
    let (status, _) = m.post("/v1/load_lora_adapter", &json!({"lora_name": "x"})).await;
    assert_eq!(status, 400, "a load needs a path");
    assert_eq!(m.post("/v1/chat/completions", &chat("chat")).await.0, 200);

    let (_, metrics) = m.get("/metrics").await;
    let metrics = metrics.as_str().unwrap();
    assert!(metrics.contains("vllm:lora_requests_info{max_lora=\"4\","), "{metrics}");
    let (_, stats) = m.get("/stats").await;
    assert_eq!(stats["lora"]["stats"]["loads"], 2, "{stats}");

    let (status, said) = m.post("/v1/unload_lora_adapter", &json!({"lora_name": "chat"})).await;
    assert_eq!(
        (status, said.as_str()),
        (200, Some("Success: LoRA adapter 'chat' removed successfully."))
    );
    let (status, err) = m.post("/v1/unload_lora_adapter", &json!({"lora_name": "chat"})).await;
    assert_eq!((status, err["error"]["type"].as_str()), (404, Some("NotFoundError")), "{err}");
    assert_eq!(m.post("/v1/chat/completions", &chat("chat")).await.0, 404);
}
