//! How the front door speaks to its workers, over real sockets on 127.0.0.1: with
//! `vllm-generate` (the simulated workers' default) a chat goes to vLLM's
//! `/inference/v1/generate` as the token ids the router hashed and comes back in OpenAI's
//! shape, whole or streamed (and with `openai-completions-tokens`, to `/v1/completions` with
//! the token ids as its prompt; with `sglang-generate`, to SGLang's `/generate` as
//! `input_ids`); what that API cannot carry goes as chat and is counted; with `openai-chat`
//! the client's body goes as it came.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_http::HttpClient;
use kvroute_http::openai::stream_chunks;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::Dialect;
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde_json::{Value, json};

async fn fleet(dialect: Dialect) -> (Stack, String) {
    let config = StackConfig {
        simulated: Simulated {
            count: 2,
            engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
            dialect,
            ..Simulated::default()
        },
        front_door: FrontDoorOptions { expose_overlap: true, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    (stack, base)
}

/// Status, the predicted cached tokens (`x-kvroute-overlap-tokens`) and the body (JSON, or
/// the SSE text as a string).
async fn post(base: &str, path: &str, body: &Value) -> (u16, Option<u64>, Value) {
    let client = HttpClient::new();
    let response =
        client.call(hyper::Method::POST, &format!("{base}{path}"), Some(body)).await.unwrap();
    let predicted = response
        .headers()
        .get("x-kvroute-overlap-tokens")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, predicted, body)
}

async fn metric(base: &str, name: &str) -> f64 {
    let client = HttpClient::new();
    let response =
        client.call(hyper::Method::GET, &format!("{base}/metrics"), None::<&Value>).await.unwrap();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    kvroute_http::metrics::sample(&String::from_utf8_lossy(&bytes), name).unwrap_or(0.0)
}

const PROMPT: &str = "Please summarize the following text in three bullet points. The router sends each request to the worker that already holds the longest part of its prompt.";

#[allow(clippy::needless_pass_by_value)]
fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "kvroute-tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_goes_as_token_ids_and_comes_back_as_openais() {
    for dialect in [
        Dialect::VllmGenerate,
        Dialect::OpenaiCompletionsTokens,
        Dialect::SglangGenerate,
        Dialect::VllmGenerateTokens,
    ] {
        as_token_ids(dialect).await;
    }
}

/// With `vllm-generate-tokens` the engine answers in token ids only and the front door
/// detokenizes: the client gets the text the engine itself sends with `vllm-generate`, whole
/// and chunk by chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_in_token_ids_are_detokenized_by_the_front_door_as_the_engine_would() {
    let mut texts = Vec::new();
    for dialect in [Dialect::VllmGenerate, Dialect::VllmGenerateTokens] {
        let (_stack, base) = fleet(dialect).await;
        let long = json!({"max_tokens": 48, "ignore_eos": true});
        let (status, _, whole) = post(&base, "/v1/chat/completions", &chat(long)).await;
        assert_eq!(status, 200, "{whole}");
        let content = whole["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
        let streamed = json!({"max_tokens": 48, "ignore_eos": true, "stream": true});
        let (_, _, text) = post(&base, "/v1/chat/completions", &chat(streamed)).await;
        let (chunks, done) = stream_chunks(text.as_str().unwrap().as_bytes()).unwrap();
        assert!(done, "{text}");
        let pieces: Vec<String> = chunks
            .iter()
            .flat_map(|c| c.choices.iter().filter_map(|ch| ch.new_text().map(str::to_owned)))
            .collect();
        assert_eq!(pieces.concat(), content, "{dialect}: streamed as whole");
        texts.push((content, pieces.len()));
        let sent = metric(&base, "kvroute_frontend_sent_as_tokens_total").await;
        assert_eq!(sent, 2.0, "{dialect}");
    }
    assert!(!texts[0].0.is_empty());
    assert_eq!(texts[0], texts[1], "the same text, in as many chunks");
}

async fn as_token_ids(dialect: Dialect) {
    let (stack, base) = fleet(dialect).await;
    let router = stack.router.as_ref().unwrap();
    // The parity probes' blocks are in before the first request (each probe passes on them).
    let probed = || router.view().workers().iter().all(|w| w.parity == kvroute_router::Parity::Ok);
    assert!(common::eventually(Duration::from_secs(10), probed).await, "the probes passed");
    let held =
        || router.view().workers().iter().map(|w| w.tree_size.iter().sum::<usize>()).sum::<usize>();
    let before = held();
    let (status, _, first) = post(&base, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "chat.completion");
    assert!(first["id"].as_str().unwrap().starts_with("chatcmpl-"), "{first}");
    assert_eq!(first["model"], "kvroute-tiny");
    let choice = &first["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(!choice["message"]["content"].as_str().unwrap().is_empty(), "{first}");
    assert!(choice["finish_reason"].is_string());
    assert_eq!(first["usage"]["completion_tokens"], 4);
    // The repeat: the engine serves from its cache exactly what the router predicted, since
    // it ran the very token ids the router hashed (once the first answer's KV events, which
    // race with the answer itself, have reached the router).
    let full_blocks = first["usage"]["prompt_tokens"].as_u64().unwrap() as usize / 16;
    let stored =
        common::eventually(Duration::from_secs(10), || held() >= before + full_blocks).await;
    assert!(stored, "the first answer's blocks never reached the router");
    let (_, predicted, second) = post(&base, "/v1/chat/completions", &chat(json!({}))).await;
    let served = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(served > 0);
    assert_eq!(predicted, Some(served), "predicted is served");
    assert_eq!(second["choices"][0]["message"], choice["message"], "the same answer");
    // Streamed, with usage asked for: OpenAI's chunks, the role first, the end last.
    let stream = json!({"stream": true, "stream_options": {"include_usage": true}});
    let (status, _, text) = post(&base, "/v1/chat/completions", &chat(stream)).await;
    assert_eq!(status, 200, "{text}");
    let (chunks, done) = stream_chunks(text.as_str().unwrap().as_bytes()).unwrap();
    assert!(done, "{text}");
    assert!(chunks.iter().all(|c| c.object == "chat.completion.chunk"));
    assert_eq!(chunks[0].choices[0].delta.as_ref().unwrap().role.as_deref(), Some("assistant"));
    let content: String =
        chunks.iter().flat_map(|c| c.choices.iter().filter_map(|ch| ch.new_text())).collect();
    assert_eq!(content, choice["message"]["content"].as_str().unwrap(), "the same text");
    let ends = chunks.iter().filter(|c| c.choices.iter().any(|ch| ch.finish_reason.is_some()));
    assert_eq!(ends.count(), 1, "{text}");
    assert_eq!(chunks.last().unwrap().usage.unwrap().completion_tokens, 4);
    // Streamed without usage: the usage the front door asked for is not passed on.
    let (_, _, text) = post(&base, "/v1/chat/completions", &chat(json!({"stream": true}))).await;
    assert!(!text.as_str().unwrap().contains("usage"), "{text}");
    // Completions, by text and by token ids.
    let body = json!({"prompt": "Hello there, friend", "max_tokens": 2});
    let (status, _, c) = post(&base, "/v1/completions", &body).await;
    assert_eq!((status, c["object"].as_str()), (200, Some("text_completion")), "{c}");
    assert!(c["choices"][0]["text"].is_string(), "{c}");
    let body = json!({"prompt": (1..40).collect::<Vec<u32>>(), "max_tokens": 2, "stream": true});
    let (status, _, text) = post(&base, "/v1/completions", &body).await;
    assert_eq!(status, 200);
    let (chunks, _) = stream_chunks(text.as_str().unwrap().as_bytes()).unwrap();
    assert!(chunks.iter().all(|c| c.object == "text_completion"), "{text}");
    assert_eq!(metric(&base, "kvroute_frontend_sent_as_tokens_total").await, 6.0);
    assert_eq!(metric(&base, "kvroute_frontend_dialect_fallbacks_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_generate_api_cannot_carry_goes_as_chat() {
    let (_stack, base) = fleet(Dialect::VllmGenerate).await;
    for extra in [
        json!({"top_logprobs": 2}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"n": 2}),
    ] {
        let (status, _, answer) = post(&base, "/v1/chat/completions", &chat(extra.clone())).await;
        // Answered as the engine's chat API answers it (n = 2: its own refusal).
        assert!(status == 200 || status == 400, "{extra}: {answer}");
    }
    assert_eq!(metric(&base, "kvroute_frontend_dialect_fallbacks_total").await, 3.0);
    assert_eq!(metric(&base, "kvroute_frontend_sent_as_tokens_total").await, 0.0);
    // Sampling fields it does carry stay on the tokens path.
    let extra = json!({"temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["zz"]});
    let (status, _, answer) = post(&base, "/v1/chat/completions", &chat(extra)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(metric(&base, "kvroute_frontend_sent_as_tokens_total").await, 1.0);
}

/// Chat's logprobs go on vLLM's generate API as `sampling_params.logprobs` and come back in
/// OpenAI's chat shape: from the engine's text mode as they are, from its tokens mode by
/// token id, made text by the front door; on SGLang's `/generate` as `return_logprob` with
/// `top_logprobs_num`, read back from `meta_info`. Every way gives the logprobs the engine's
/// own chat API gives, whole and streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_the_engines_whichever_way_the_request_goes() {
    let asked = json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 6, "ignore_eos": true});
    let mut seen = Vec::new();
    for dialect in [
        Dialect::OpenaiChat,
        Dialect::VllmGenerate,
        Dialect::VllmGenerateTokens,
        Dialect::SglangGenerate,
    ] {
        let (_stack, base) = fleet(dialect).await;
        let (status, _, whole) = post(&base, "/v1/chat/completions", &chat(asked.clone())).await;
        assert_eq!(status, 200, "{whole}");
        let logprobs = whole["choices"][0]["logprobs"].clone();
        let content = logprobs["content"].as_array().unwrap();
        assert_eq!(content.len(), 6, "{dialect}: one per token: {logprobs}");
        assert!(content.iter().all(|e| e["top_logprobs"].as_array().unwrap().len() == 2));
        assert!(content.iter().all(|e| e["token"].is_string() && e["bytes"].is_array()));
        let mut streamed = asked.clone();
        streamed["stream"] = json!(true);
        let (_, _, text) = post(&base, "/v1/chat/completions", &chat(streamed)).await;
        let (chunks, _) = stream_chunks(text.as_str().unwrap().as_bytes()).unwrap();
        let per_chunk: Vec<Value> = chunks
            .iter()
            .flat_map(|c| c.choices.iter().filter_map(|ch| ch.logprobs.clone()))
            .filter(|l| !l.is_null())
            .flat_map(|l| l["content"].as_array().cloned().unwrap_or_default())
            .collect();
        assert_eq!(per_chunk, *content, "{dialect}: streamed as whole");
        let as_tokens = metric(&base, "kvroute_frontend_sent_as_tokens_total").await;
        let expected = match dialect {
            Dialect::OpenaiChat => 0.0,
            _ => 2.0,
        };
        assert_eq!(as_tokens, expected, "{dialect}");
        seen.push(logprobs);
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
}

/// SGLang refuses in shapes of its own (`{"error": "..."}`, `{"error": {"message"}}`): the
/// client gets OpenAI's, with SGLang's status and message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_refusals_reach_the_client_in_openais_shape() {
    let (_stack, base) = fleet(Dialect::SglangGenerate).await;
    let (status, _, answer) = post(&base, "/v1/chat/completions", &chat(json!({"top_p": 0}))).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["message"], "top_p must be in (0, 1], got 0.0.", "{answer}");
    assert_eq!(answer["error"]["type"], "invalid_request_error", "{answer}");
    assert_eq!(metric(&base, "kvroute_frontend_sent_as_tokens_total").await, 1.0);
    // What SGLang's sampling parameters have no field for goes as chat.
    let (status, _, _) =
        post(&base, "/v1/chat/completions", &chat(json!({"length_penalty": 1.0}))).await;
    assert_eq!(status, 200);
    assert_eq!(metric(&base, "kvroute_frontend_dialect_fallbacks_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat_workers_get_the_clients_body() {
    let (_stack, base) = fleet(Dialect::OpenaiChat).await;
    let (status, _, answer) = post(&base, "/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!((status, answer["object"].as_str()), (200, Some("chat.completion")), "{answer}");
    assert_eq!(metric(&base, "kvroute_frontend_sent_as_tokens_total").await, 0.0);
    assert_eq!(metric(&base, "kvroute_frontend_dialect_fallbacks_total").await, 0.0);
}

/// Each worker's prediction record (`/workers`): (answered, exact, over, under).
async fn predictions(base: &str) -> (u64, u64, u64, u64) {
    let client = HttpClient::new();
    let workers: Value = client.get_json(&format!("{base}/workers")).await.unwrap();
    let mut sum = (0, 0, 0, 0);
    for w in workers["workers"].as_array().unwrap() {
        let n = |k: &str| w["checks"][k].as_u64().unwrap_or(0);
        sum = (sum.0 + n("answered"), sum.1 + n("exact"), sum.2 + n("over"), sum.3 + n("under"));
    }
    sum
}

/// An engine that renders chats with a template of its own (a blank line after each
/// message): sent the client's body it caches prompts the router never hashed, so the
/// predictions of a conversation miss; sent the router's token ids, every one is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_its_own_template_is_exact_only_with_token_ids() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/templates");
    let template = std::fs::read_to_string(dir.join("blank-line.jinja")).unwrap();
    for dialect in [
        Dialect::OpenaiChat,
        Dialect::VllmGenerate,
        Dialect::OpenaiCompletionsTokens,
        Dialect::SglangGenerate,
        Dialect::VllmGenerateTokens,
    ] {
        let config = StackConfig {
            simulated: Simulated {
                count: 1,
                engine: EngineConfig {
                    timing: Timing { speedup: 100.0 },
                    ..EngineConfig::default()
                },
                dialect,
                chat_template: Some(template.clone()),
                ..Simulated::default()
            },
            ..StackConfig::default()
        };
        let stack = Stack::start(config).await.unwrap();
        assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
        let base = stack.serve_frontend_on_loopback().await.unwrap();
        // A conversation: each turn sends back the server's answer and a new question.
        let router = stack.router.as_ref().unwrap();
        let tree = || router.view().workers()[0].tree_size.iter().sum::<usize>();
        let before = tree();
        let mut messages = vec![json!({"role": "user", "content": PROMPT})];
        for turn in 0..4 {
            let body = json!({"messages": messages, "max_tokens": 6, "ignore_eos": true});
            let (status, _, answer) = post(&base, "/v1/chat/completions", &body).await;
            assert_eq!(status, 200, "{answer}");
            let events = matches!(
                dialect,
                Dialect::VllmGenerate | Dialect::VllmGenerateTokens | Dialect::SglangGenerate
            );
            if events {
                // A worker routed by its events (its parity probe passes): the next turn is
                // placed once the router holds what this one left cached (its prompt and
                // answer, but the last token, in full blocks), so that a prediction compares
                // the router's hashes, not the speed of the events.
                let usage = &answer["usage"];
                let held = (usage["prompt_tokens"].as_u64().unwrap()
                    + usage["completion_tokens"].as_u64().unwrap()
                    - 1) as usize
                    / 16;
                let seen = common::eventually(Duration::from_secs(10), || tree() >= before + held);
                assert!(seen.await, "{dialect}: the turn's blocks never reached the router");
            }
            messages.push(answer["choices"][0]["message"].clone());
            let next = format!("And what follows from that, in turn {turn}, for the router?");
            messages.push(json!({"role": "user", "content": next}));
        }
        let (answered, exact, _, under) = predictions(&base).await;
        assert_eq!(answered, 4, "{dialect}");
        // The parity probe goes as requests go: as token ids it passes; as chat it finds the
        // template differs, and the worker is routed approximately. The model takes images,
        // which a completion cannot carry: that dialect's image probe goes as chat and fails.
        let parity = stack.router.as_ref().unwrap().view().workers()[0].parity.clone();
        let failed =
            |what: &str| matches!(&parity, kvroute_router::Parity::Failed(c) if c.contains(what));
        match dialect {
            Dialect::VllmGenerate | Dialect::VllmGenerateTokens | Dialect::SglangGenerate => {
                assert_eq!(parity, kvroute_router::Parity::Ok);
            }
            // A completion carries no images: that probe goes as chat.
            Dialect::OpenaiCompletionsTokens => assert!(failed("image"), "{parity:?}"),
            Dialect::OpenaiChat => assert!(failed("token ids"), "{parity:?}"),
        }
        match dialect.sends_tokens() {
            true => assert_eq!(exact, 4, "{dialect}: token ids, every prediction exact"),
            false => assert!(
                exact < 4 && under > 0,
                "chat: the engine's own blocks go unseen ({exact} exact, {under} under)"
            ),
        }
    }
}
