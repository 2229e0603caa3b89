//! SGLang's native `/generate` on the simulated engine, case by case from sglang 0.5.23's
//! JSON contract (`sglang/api/v1/api_types.py`), `GenerateReqInput` (`srt/managers/
//! io_struct.py`), its checks (`srt/sampling/sampling_params.py`, `tokenizer_manager.py`) and
//! its answers: the shapes it answers (whole, and streamed with the whole text so far in every
//! chunk), the prefix cache it shares with the other APIs, and what it refuses, in SGLang's two
//! error shapes.

#![allow(clippy::unwrap_used)]

mod common;

use axum::http::Method;
use common::{Engine, LONG};
use kvroute_http::sglang_generate::{GenerateResponse, PATH};
use kvroute_http::testing;
use serde_json::json;

async fn engine() -> Engine {
    common::engine(1000).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_ids_in_text_and_ids_out_sharing_the_chat_apis_cache() {
    let e = engine().await;
    let tokens = e.rendered(LONG).await;
    let chat = json!({"messages": [{"role": "user", "content": LONG}], "max_tokens": 2});
    assert_eq!(e.post("/v1/chat/completions", &chat).await.0, 200);
    // The same token ids as input_ids hit the chat request's blocks.
    let body = json!({"input_ids": tokens, "rid": "abc",
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}, "unknown_field": [1]});
    let (status, r) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{r}");
    let answer: GenerateResponse = serde_json::from_value(r.clone()).unwrap();
    let meta = &answer.meta_info;
    assert_eq!(meta.id, "abc");
    assert_eq!((meta.prompt_tokens, meta.completion_tokens), (tokens.len() as u64, 3));
    assert_eq!(meta.cached_tokens, (tokens.len() as u64 - 1) / 16 * 16, "{r}");
    assert_eq!(r["meta_info"]["finish_reason"], json!({"type": "length", "length": 3}));
    assert_eq!(answer.output_ids.len(), 3);
    assert!(!answer.text.unwrap().is_empty());
    // Absent max_new_tokens is SGLang's 128, and the simulated model answers to its length.
    let (_, r) = e.post(PATH, &json!({"input_ids": tokens})).await;
    assert_eq!(r["meta_info"]["finish_reason"], json!({"type": "length", "length": 128}), "{r}");
    assert_eq!(r["output_ids"].as_array().unwrap().len(), 128, "{r}");
    // A text prompt is tokenized as it is (no chat template); input_ids win over text.
    let (status, r) = e
        .post(PATH, &json!({"text": "Hello there", "sampling_params": {"max_new_tokens": 1}}))
        .await;
    assert_eq!((status, r["meta_info"]["completion_tokens"].as_u64()), (200, Some(1)), "{r}");
    let both = json!({"text": "x", "input_ids": tokens, "sampling_params": {"max_new_tokens": 1}});
    let (_, r) = e.post(PATH, &both).await;
    assert_eq!(r["meta_info"]["prompt_tokens"], tokens.len(), "{r}");
    assert_eq!(e.metric("kvroute_mocker_sglang_generate_requests_total").await, Some(4.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_the_whole_answer_so_far_as_sglang_does() {
    let e = engine().await;
    let tokens = e.rendered("Tell me a joke.").await;
    let body = json!({"input_ids": tokens, "stream": true,
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}});
    let (status, text) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{text}");
    let text = text.as_str().unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<GenerateResponse> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks.len(), 3, "a chunk per token: {text}");
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.output_ids.len(), i + 1, "the ids so far");
        assert_eq!(c.meta_info.completion_tokens, i as u64 + 1);
        assert_eq!(c.meta_info.finish_reason.is_some(), i == 2, "only the last ends it");
        if i > 0 {
            let before = chunks[i - 1].text.as_deref().unwrap();
            assert!(c.text.as_deref().unwrap().starts_with(before), "the text so far: {text}");
            assert_eq!(c.output_ids[..i], chunks[i - 1].output_ids[..]);
        }
    }
    let whole =
        json!({"input_ids": tokens, "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}});
    let (_, r) = e.post(PATH, &whole).await;
    assert_eq!(r["text"].as_str(), chunks[2].text.as_deref(), "the same answer whole");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_what_sglang_refuses_in_its_shapes() {
    let e = engine().await;
    let (_, models) = testing::call(&e.app, Method::GET, "/v1/models", None).await;
    let n = models["data"][0]["max_model_len"].as_u64().unwrap();
    let contract = |m: &str| json!({"error": m});
    let invalid = |m: &str| json!({"error": {"message": m}});
    let cases = [
        // The JSON contract: serde's texts, as a string.
        (json!([1, 2]), contract("invalid type: sequence, expected struct GenerateRequest")),
        (
            json!({"input_ids": "1 2"}),
            contract(
                "invalid type: string \"1 2\", expected a value or an array of values for TokenIdsOrList",
            ),
        ),
        (
            json!({"input_ids": [1, -0.5]}),
            contract("invalid type: floating point `-0.5`, expected i64"),
        ),
        (
            json!({"text": "a", "stream": 1}),
            contract("invalid type: integer `1`, expected a boolean"),
        ),
        // The server's checks: a message.
        (
            json!({"stream": true}),
            invalid("Either text, input_ids or input_embeds should be provided."),
        ),
        (
            json!({"text": "a", "sampling_params": {"top_p": 2}}),
            invalid("top_p must be in (0, 1], got 2.0."),
        ),
        (
            json!({"text": "a", "sampling_params": {"min_p": -1}}),
            invalid("min_p must be in [0, 1], got -1.0."),
        ),
        (
            json!({"text": "a", "sampling_params": {"frequency_penalty": 3}}),
            invalid("frequency_penalty must be in [-2, 2], got 3.0."),
        ),
        (
            json!({"text": "a", "lora_path": "sql-lora"}),
            invalid(
                "LoRA adapter 'sql-lora' was requested, but LoRA is not enabled. Please launch the server with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.",
            ),
        ),
        (
            json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": n}}),
            invalid(&format!(
                "Requested token count exceeds the model's maximum context length of {n} tokens. You requested a total of {} tokens: 2 tokens from the input messages and {n} tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                n + 2
            )),
        ),
        (
            json!({"input_ids": vec![1; n as usize]}),
            invalid(&format!(
                "The input ({n} tokens) is longer than the model's context length ({n} tokens)."
            )),
        ),
    ];
    for (body, want) in cases {
        let (status, r) = e.post(PATH, &body).await;
        assert_eq!((status, &r), (400, &want), "{body}");
    }
    // An unknown sampling parameter: serde's list of the known ones.
    let (status, r) =
        e.post(PATH, &json!({"text": "a", "sampling_params": {"max_tokens": 3}})).await;
    assert_eq!(status, 400);
    let m = r["error"].as_str().unwrap();
    assert!(m.starts_with("unknown field `max_tokens`, expected one of `max_new_tokens`"), "{m}");
    // Where the simulated engine departs: a batch, images, out-of-vocabulary ids.
    for body in [
        json!({"input_ids": [[1, 2], [3]]}),
        json!({"text": ["a", "b"]}),
        json!({"text": "a", "image_data": "http://127.0.0.1/x.png"}),
        json!({"input_ids": [1, 99_999_999]}),
    ] {
        let (status, r) = e.post(PATH, &body).await;
        assert_eq!(status, 400, "{body}: {r}");
        assert!(r["error"]["message"].is_string(), "{body}: {r}");
    }
    assert_eq!(e.metric("kvroute_mocker_sglang_generate_requests_total").await, Some(0.0));
}

/// Images as SGLang takes them with `input_ids`: each one's URL in `image_data`, one image
/// token for it in the ids, expanded by the image's size; keyed in the prefix cache by the
/// caller's `mm_hashes` (what a KV router sends so that the engine's blocks are its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_beside_input_ids_expand_and_are_keyed_by_the_callers_hashes() {
    use kvroute_preprocess::images::{png_data_url, seeded_png};
    let e = engine().await;
    let p = kvroute_preprocess::Preprocessor::builtin();
    let ids = p.encode(&format!("{LONG} Look at <|image_pad|> and say what it is.")).unwrap();
    let pad = p.image_token_id().unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == pad).count(), 1);
    let url = png_data_url(&seeded_png(1, 64));
    let body = |hash: &str| {
        json!({"input_ids": ids, "image_data": [url], "mm_hashes": [hash],
            "sampling_params": {"max_new_tokens": 1}})
    };
    let (status, r) = e.post(PATH, &body("00000000000000ab")).await;
    assert_eq!(status, 200, "{r}");
    let prompt = r["meta_info"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > ids.len() as u64, "the image token expanded: {prompt}");
    assert_eq!(r["meta_info"]["cached_tokens"], 0);
    let (_, again) = e.post(PATH, &body("00000000000000ab")).await;
    let full = (prompt - 1) / 16 * 16;
    assert_eq!(again["meta_info"]["cached_tokens"], full, "{again}");
    // The same pixels under another caller's hash: only the blocks before the image.
    let (_, other) = e.post(PATH, &body("00000000000000cd")).await;
    let before = other["meta_info"]["cached_tokens"].as_u64().unwrap();
    assert!(before > 0 && before < full, "{before} of {full}");
    // Mismatches are refused in SGLang's server shape.
    let two = json!({"input_ids": ids, "image_data": [url, url]});
    let hashes = json!({"input_ids": ids, "image_data": [url], "mm_hashes": ["a", "b"]});
    for bad in [two, hashes] {
        let (status, r) = e.post(PATH, &bad).await;
        assert_eq!(status, 400, "{r}");
        assert!(r["error"]["message"].is_string(), "{r}");
    }
}

/// `return_logprob` with `top_logprobs_num`: `[logprob, token_id, text]` per output token in
/// `meta_info` (the text only with `return_text_in_logprobs`), all of them so far in every
/// chunk of the default stream; values simulated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_in_meta_info_as_sglang_writes_them() {
    let e = engine().await;
    let tokens = e.rendered("Tell me about logprobs.").await;
    let body = json!({"input_ids": tokens, "return_logprob": true, "top_logprobs_num": 2,
        "return_text_in_logprobs": true, "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}});
    let (status, r) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{r}");
    let meta = &r["meta_info"];
    let entries = meta["output_token_logprobs"].as_array().unwrap();
    assert_eq!(entries.len(), 3);
    for (entry, id) in entries.iter().zip(r["output_ids"].as_array().unwrap()) {
        assert_eq!(&entry[1], id, "{entry}");
        assert!(entry[0].is_f64() && entry[2].is_string(), "{entry}");
    }
    assert_eq!(meta["output_token_logprobs_length"], 3);
    assert_eq!(meta["output_top_logprobs"][0].as_array().unwrap().len(), 2);
    assert_eq!(meta["input_token_logprobs"], json!([]));
    // Streamed: every chunk carries all of them so far.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, text) = e.post(PATH, &streamed).await;
    let lens: Vec<usize> = text
        .as_str()
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<serde_json::Value>(d).unwrap())
        .map(|c| c["meta_info"]["output_token_logprobs"].as_array().unwrap().len())
        .collect();
    assert_eq!(lens, [1, 2, 3]);
    let without_text = json!({"input_ids": tokens, "return_logprob": true, "sampling_params": {"max_new_tokens": 1}});
    let (_, r) = e.post(PATH, &without_text).await;
    assert!(r["meta_info"]["output_token_logprobs"][0][2].is_null(), "{r}");
    assert!(r["meta_info"].get("output_top_logprobs").is_none(), "{r}");
}
