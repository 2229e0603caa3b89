//! vLLM's token-in, token-out `/inference/v1/generate` on the simulated engine, case by case
//! from vLLM 0.33's `scale_out/token_in_token_out/protocol.py` and `serving.py`: the shapes it
//! answers (whole and streamed, tokens and text), the prefix cache it shares with the chat API
//! (the same token ids are the same blocks), images by their hash, and what it refuses, with
//! vLLM's statuses and error types.

#![allow(clippy::unwrap_used)]

mod common;

use common::{LONG, engine};
use kvroute_http::vllm_generate::{GenerateChunk, PATH};
use serde_json::{Value, json};

#[allow(clippy::needless_pass_by_value)]
fn generate(tokens: &[u32], sampling: Value) -> Value {
    json!({"token_ids": tokens, "sampling_params": sampling})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_in_token_ids_out_sharing_the_chat_apis_cache() {
    let e = engine(1000).await;
    let tokens = e.rendered(LONG).await;
    // The chat request computes the prompt's blocks ...
    let chat = json!({"messages": [{"role": "user", "content": LONG}], "max_tokens": 2});
    let (status, _) = e.post("/v1/chat/completions", &chat).await;
    assert_eq!(status, 200);
    // ... and the same token ids by generate hit all of them: the same prompt, the same blocks.
    let mut body = generate(&tokens, json!({"max_tokens": 3, "ignore_eos": true}));
    body["request_id"] = json!("abc");
    let (status, r) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["request_id"], "generate-tokens-abc");
    assert_eq!(r["output_mode"], "tokens");
    assert_eq!(r["model"], "kvroute-tiny");
    assert!(r["created"].as_u64().is_some(), "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length", "ignore_eos: cut at max_tokens");
    assert_eq!(choice["token_ids"].as_array().unwrap().len(), 3);
    assert!(choice.get("text").is_none(), "tokens mode has no text: {choice}");
    assert!(r["prompt_token_ids"].is_null(), "only with return_token_ids");
    let len = tokens.len() as u64;
    assert_eq!(r["usage"]["prompt_tokens"], len);
    assert_eq!(r["usage"]["completion_tokens"], 3);
    assert_eq!(r["usage"]["total_tokens"], len + 3);
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], (len - 1) / 16 * 16);
    assert_eq!(e.metric("kvroute_mocker_generate_requests_total").await, Some(1.0));
    // Text mode: the text is the tokens' own; with return_token_ids, the prompt's ids too.
    body["output_mode"] = json!("text");
    body["return_token_ids"] = json!(true);
    let (status, t) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["output_mode"], "text");
    let ids: Vec<u32> = serde_json::from_value(t["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(
        ids,
        serde_json::from_value::<Vec<u32>>(choice["token_ids"].clone()).unwrap(),
        "deterministic"
    );
    let text = kvroute_preprocess::Preprocessor::builtin().decode(&ids).unwrap();
    assert_eq!(t["choices"][0]["text"], text);
    assert_eq!(t["prompt_token_ids"], json!(tokens));
    // Unknown fields are ignored, as pydantic ignores them; a client's kv_transfer_params do
    // not come back (vLLM answers with what its KV connector produced: nothing on an
    // aggregated engine, vllm 0.33 token_in_token_out/serving.py), and hold nothing.
    body["something_new"] = json!({"x": 1});
    body["sampling_params"]["seed"] = json!(7);
    body["kv_transfer_params"] = json!({"do_remote_decode": false});
    let (status, u) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{u}");
    assert_eq!(u["kv_transfer_params"], Value::Null, "{u}");
    // Without max_tokens: as many as the context holds (vLLM's server-side default), so the
    // answer runs to the end of the context, which vLLM calls "length" too.
    let (_, d) = e.post(PATH, &generate(&tokens, json!({}))).await;
    assert_eq!(d["choices"][0]["finish_reason"], "length");
    let total = d["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(
        total,
        d["usage"]["prompt_tokens"].as_u64().unwrap()
            + d["usage"]["completion_tokens"].as_u64().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_as_vllm_does() {
    let e = engine(1000).await;
    let tokens = e.rendered("Tell me a joke.").await;
    let mut body = generate(&tokens, json!({"max_tokens": 3, "ignore_eos": true}));
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    body["return_token_ids"] = json!(true);
    let (status, text) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{text}");
    let text = text.as_str().unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<GenerateChunk> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks.len(), 4, "a chunk per token, then the usage: {text}");
    assert!(chunks.iter().all(|c| c.request_id.starts_with("generate-tokens-")));
    assert_eq!(chunks[0].prompt_token_ids.as_deref(), Some(&tokens[..]), "on the first only");
    assert!(chunks[1..].iter().all(|c| c.prompt_token_ids.is_none()));
    for (i, c) in chunks[..3].iter().enumerate() {
        assert_eq!(c.choices[0].token_ids.as_ref().map(Vec::len), Some(1));
        assert_eq!(c.usage.unwrap().completion_tokens, i as u64 + 1, "continuous usage");
        let finish = c.choices[0].finish_reason.as_deref();
        assert_eq!(finish, (i == 2).then_some("length"), "the last token's chunk ends it");
    }
    let last = &chunks[3];
    assert!(last.choices.is_empty());
    let usage = last.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (tokens.len() as u64, 3));
    // Text mode: each chunk's text is its token's.
    body["output_mode"] = json!("text");
    body["stream_options"] = json!({"include_usage": false});
    let (_, text) = e.post(PATH, &body).await;
    let text = text.as_str().unwrap();
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks.len(), 3, "no usage chunk: {text}");
    assert!(
        chunks.iter().all(|c| c["output_mode"] == "text" && c["choices"][0]["text"].is_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_cache_by_their_hash_over_their_placeholders() {
    let e = engine(1000).await;
    let tokens: Vec<u32> = (100..196).collect();
    let with_image = |hash: &str| {
        let mut body = generate(&tokens, json!({"max_tokens": 1}));
        body["features"] = json!({
            "mm_hashes": {"image": [hash]},
            "mm_placeholders": {"image": [{"offset": 16, "length": 32}]},
        });
        body
    };
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let (status, first) = e.post(PATH, &with_image("00000000000000aa")).await;
    assert_eq!((status, cached(&first)), (200, 0), "{first}");
    let (_, same) = e.post(PATH, &with_image("00000000000000aa")).await;
    assert_eq!(cached(&same), 80, "the same image: every full block but the last");
    let (_, other) = e.post(PATH, &with_image("00000000000000bb")).await;
    assert_eq!(cached(&other), 16, "another image: only the block before it");
}

/// `content_parts`, whose media the server resolves itself: one image token per part in the
/// ids, expanded by the image's size as vLLM's processor expands a token prompt's, the image
/// keyed by the part's `uuid` (vLLM's multimodal UUID).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_parts_resolve_their_images_and_key_them_by_uuid() {
    use kvroute_preprocess::images::{png_data_url, seeded_png};
    let e = engine(1000).await;
    let p = kvroute_preprocess::Preprocessor::builtin();
    let ids = p.encode(&format!("{LONG} Look at <|image_pad|> and say what it is.")).unwrap();
    let url = png_data_url(&seeded_png(2, 64));
    let body = |uuid: &str| {
        let mut b = generate(&ids, json!({"max_tokens": 1}));
        b["content_parts"] = json!([{"type": "image_url", "url": url, "uuid": uuid}]);
        b["return_token_ids"] = json!(true);
        b
    };
    let cached = |r: &Value| r["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let (status, first) = e.post(PATH, &body("00000000000000aa")).await;
    assert_eq!((status, cached(&first)), (200, 0), "{first}");
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > ids.len() as u64, "the image token expanded: {prompt}");
    assert_eq!(first["prompt_token_ids"].as_array().unwrap().len() as u64, prompt);
    let (_, same) = e.post(PATH, &body("00000000000000aa")).await;
    assert_eq!(cached(&same), (prompt - 1) / 16 * 16, "{same}");
    let (_, other) = e.post(PATH, &body("00000000000000bb")).await;
    assert!(cached(&other) < cached(&same), "another uuid: only the blocks before the image");
    // A uuid processed before is not processed again (vLLM's processor cache): its media is
    // not even read, so a part that could not be decoded is served all the same.
    let mut known = body("00000000000000aa");
    known["content_parts"][0]["url"] = json!("data:image/png;base64,AAAA");
    let (status, r) = e.post(PATH, &known).await;
    assert_eq!((status, cached(&r)), (200, cached(&same)), "{r}");
    let mut unknown = body("00000000000000cc");
    unknown["content_parts"][0]["url"] = json!("data:image/png;base64,AAAA");
    assert_eq!(e.post(PATH, &unknown).await.0, 400, "an unseen uuid's media is read");
    // Two parts for one image token, and media the engine does not take, are refused.
    let mut two = body("aa");
    two["content_parts"] =
        json!([{"type": "image_url", "url": url}, {"type": "image_url", "url": url}]);
    let mut audio = body("aa");
    audio["content_parts"] = json!([{"type": "audio_url", "url": "data:audio/wav;base64,AA=="}]);
    for bad in [two, audio] {
        let (status, r) = e.post(PATH, &bad).await;
        assert_eq!((status, r["error"]["param"].as_str()), (400, Some("content_parts")), "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_what_vllm_refuses_in_its_shapes() {
    let e = engine(8).await;
    let ok = || generate(&[1, 2, 3], json!({"max_tokens": 1}));
    let with = |key: &str, value: Value| {
        let mut b = ok();
        b[key] = value;
        b
    };
    let sampling = |key: &str, value: Value| {
        let mut b = ok();
        b["sampling_params"][key] = value;
        b
    };
    let features = |f: Value| with("features", f);
    let image = |offset: i64, length: i64| json!({"offset": offset, "length": length});
    let long: Vec<u32> = (0..128).map(|i| 10 + i % 50).collect();
    // (body, status, error type, param)
    let cases: Vec<(Value, u16, &str, Option<&str>)> = vec![
        (json!({"token_ids": [1]}), 400, "Bad Request", None),
        (with("token_ids", json!([])), 400, "Bad Request", Some("token_ids")),
        (with("token_ids", json!([1, -2])), 400, "Bad Request", Some("token_ids")),
        (with("token_ids", json!([1, 99_999_999])), 400, "BadRequestError", Some("token_ids")),
        (with("cache_salt", json!("")), 400, "Bad Request", Some("cache_salt")),
        (with("cache_salt", json!("tenant/a")), 400, "Bad Request", Some("cache_salt")),
        (with("cache_salt", json!("x".repeat(129))), 400, "Bad Request", Some("cache_salt")),
        (with("output_mode", json!("loud")), 400, "Bad Request", None),
        (sampling("max_tokens", json!(0)), 400, "Bad Request", Some("max_tokens")),
        (sampling("temperature", json!(2.5)), 400, "Bad Request", Some("temperature")),
        (sampling("top_p", json!(0.0)), 400, "Bad Request", Some("top_p")),
        (sampling("n", json!(0)), 400, "Bad Request", Some("n")),
        (sampling("n", json!(2)), 400, "BadRequestError", Some("n")),
        (sampling("min_tokens", json!(5)), 400, "Bad Request", Some("min_tokens")),
        (
            {
                let mut b = sampling("detokenize", json!(false));
                b["output_mode"] = json!("text");
                b
            },
            400,
            "Bad Request",
            Some("output_mode"),
        ),
        (
            features(json!({"mm_hashes": {"image": ["a"]}, "mm_placeholders": {}})),
            400,
            "Bad Request",
            Some("features"),
        ),
        (
            features(
                json!({"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [image(0, 9)]}}),
            ),
            400,
            "Bad Request",
            Some("features"),
        ),
        (
            features(
                json!({"mm_hashes": {"image": ["a", "b"]}, "mm_placeholders": {"image": [image(0, 2), image(1, 2)]}}),
            ),
            400,
            "Bad Request",
            Some("features"),
        ),
        (
            features(
                json!({"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [image(0, 0)]}}),
            ),
            400,
            "Bad Request",
            Some("features"),
        ),
        (
            {
                let mut b = features(
                    json!({"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [image(0, 1)]}}),
                );
                b["content_parts"] =
                    json!([{"type": "image_url", "url": "http://127.0.0.1/x.png"}]);
                b
            },
            400,
            "Bad Request",
            Some("features"),
        ),
        (
            {
                let mut b = with("output_mode", json!("derender"));
                b["stream"] = json!(true);
                b
            },
            400,
            "BadRequestError",
            None,
        ),
        (with("priority", json!(1)), 400, "BadRequestError", Some("priority")),
        (with("model", json!("gpt-9")), 404, "NotFoundError", Some("model")),
        // The 8-block cache caps the context at 128 tokens: a prompt of 128 leaves no room.
        (generate(&long, json!({"max_tokens": 1})), 400, "BadRequestError", None),
    ];
    for (body, status, kind, param) in cases {
        let (got, v) = e.post(PATH, &body).await;
        assert_eq!(got, status, "{body}: {v}");
        assert_eq!(v["error"]["type"], kind, "{body}: {v}");
        assert_eq!(v["error"]["code"], status, "{body}: {v}");
        if let Some(param) = param {
            assert_eq!(v["error"]["param"], param, "{body}: {v}");
        }
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    let (status, v) = e.post(PATH, &json!([1, 2])).await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("Bad Request")), "{v}");
    // A long model name is not echoed whole.
    let (status, v) = e.post(PATH, &with("model", json!("m".repeat(10_000)))).await;
    let message = v["error"]["message"].as_str().unwrap();
    assert_eq!(status, 404);
    assert!(message.len() < 200 && message.contains("mmm..."), "{message}");
    // vLLM 0.33 holds its chat and completions APIs to the same salt rule.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "a/b"});
    let (status, v) = e.post("/v1/chat/completions", &chat).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("cache_salt")), "{v}");
    // What it does take: the same checks passed.
    let (status, v) = e.post(PATH, &with("cache_salt", json!("tenant-a"))).await;
    assert_eq!(status, 200, "{v}");
}

/// vLLM's derender endpoints: a tokens answer becomes OpenAI's, with the text the engine's
/// text mode gives for the same tokens, and no engine run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derender_turns_a_tokens_answer_into_openais() {
    use kvroute_http::vllm_generate::{DERENDER_CHAT_PATH, DERENDER_COMPLETION_PATH};
    let e = engine(1000).await;
    let tokens = e.rendered("Tell me a story about routers.").await;
    let sampling = json!({"max_tokens": 5, "ignore_eos": true});
    let (_, answer) = e.post(PATH, &generate(&tokens, sampling.clone())).await;
    let mut text_body = generate(&tokens, sampling);
    text_body["output_mode"] = json!("text");
    let (_, text) = e.post(PATH, &text_body).await;
    let want = text["choices"][0]["text"].as_str().unwrap();
    let before = e.metric("vllm:prefix_cache_queries_total").await;

    let body = json!({"generate_response": answer, "prompt_tokens": tokens.len()});
    let (status, chat) = e.post(DERENDER_CHAT_PATH, &body).await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["id"], answer["request_id"]);
    assert_eq!(chat["model"], "kvroute-tiny");
    assert_eq!(chat["choices"][0]["message"]["content"], want, "{chat}");
    assert_eq!(chat["choices"][0]["finish_reason"], "length");
    assert_eq!(chat["usage"]["prompt_tokens"], tokens.len());
    assert_eq!(chat["usage"]["completion_tokens"], 5);

    let body = json!({"generate_responses": [answer, answer]});
    let (status, c) = e.post(DERENDER_COMPLETION_PATH, &body).await;
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    let indices: Vec<_> =
        c["choices"].as_array().unwrap().iter().map(|c| c["index"].clone()).collect();
    assert_eq!(indices, [json!(0), json!(1)], "numbered across the prompts");
    assert_eq!(c["choices"][1]["text"], want);
    assert_eq!(
        (c["usage"]["prompt_tokens"].as_u64(), c["usage"]["completion_tokens"].as_u64()),
        (Some(0), Some(10))
    );
    assert_eq!(e.metric("vllm:prefix_cache_queries_total").await, before, "no engine run");

    // What vLLM refuses: a text-mode answer, mismatched lists, empty ids, another model.
    let cases = [
        (DERENDER_CHAT_PATH, json!({"generate_response": text}), "Bad Request"),
        (
            DERENDER_COMPLETION_PATH,
            json!({"generate_responses": [answer], "prompt_tokens": [1, 2]}),
            "Bad Request",
        ),
        (
            DERENDER_COMPLETION_PATH,
            json!({"generate_responses": [{"request_id": "x", "choices": [{"index": 0, "token_ids": []}]}]}),
            "BadRequestError",
        ),
        (DERENDER_CHAT_PATH, json!({"generate_response": answer, "stream": true}), "Bad Request"),
    ];
    for (path, body, kind) in cases {
        let (status, r) = e.post(path, &body).await;
        assert_eq!((status, r["error"]["type"].as_str()), (400, Some(kind)), "{path} {body}: {r}");
    }
    let (status, _) =
        e.post(DERENDER_CHAT_PATH, &json!({"generate_response": answer, "model": "other"})).await;
    assert_eq!(status, 404);
}

/// vLLM's streamed derender: one call per chunk of a tokens stream, the client carrying
/// `stream_state` from each answer to the next. Fed the engine's own tokens stream, the
/// deltas are its text mode's text; fed a token at a time of text whose characters span
/// tokens, every character comes out whole, and the carried window stays short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_derender_carries_its_state_between_calls() {
    use kvroute_http::vllm_generate::{DERENDER_CHAT_PATH, DERENDER_COMPLETION_PATH};
    let e = engine(1000).await;
    let tokens = e.rendered("Tell me a story about routers.").await;
    let mut body = generate(&tokens, json!({"max_tokens": 12, "ignore_eos": true}));
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (_, sse) = e.post(PATH, &body).await;
    let chunks: Vec<Value> = sse
        .as_str()
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    body["output_mode"] = json!("text");
    body["stream"] = json!(false);
    let (_, whole) = e.post(PATH, &body).await;
    let want = whole["choices"][0]["text"].as_str().unwrap();

    let mut state = Value::Null;
    let (mut content, mut roles, mut usage) = (String::new(), 0, Value::Null);
    for chunk in &chunks {
        let mut call =
            json!({"stream": true, "generate_chunk": chunk, "prompt_tokens": tokens.len()});
        match state.is_null() {
            true => call["prompt_token_ids"] = json!(tokens),
            false => call["stream_state"] = state.clone(),
        }
        let (status, r) = e.post(DERENDER_CHAT_PATH, &call).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["chunk"]["object"], "chat.completion.chunk");
        assert_eq!(r["chunk"]["id"], chunk["request_id"]);
        if let Some(choice) = r["chunk"]["choices"].get(0) {
            roles += usize::from(choice["delta"]["role"] == "assistant");
            content.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        }
        if !r["chunk"]["usage"].is_null() {
            usage = r["chunk"]["usage"].clone();
        }
        state = r["stream_state"].clone();
        assert!(state["prev_tokens"].as_array().unwrap().len() <= 7, "{state}");
    }
    assert_eq!(content, want, "the engine's own text");
    assert_eq!(roles, 1, "the role on the first delta only");
    assert_eq!(
        (usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()),
        (Some(tokens.len() as u64), Some(12))
    );

    // Characters split across tokens, a token per call, as completions.
    let p = kvroute_preprocess::Preprocessor::builtin();
    let text = "déjà vu: 東京 🦀";
    let ids = p.encode(text).unwrap();
    let mut state = Value::Null;
    let mut out = String::new();
    for id in &ids {
        let chunk = json!({"request_id": "r", "output_mode": "tokens", "choices": [{"index": 0, "token_ids": [id]}]});
        let mut call = json!({"stream": true, "generate_chunk": chunk});
        if !state.is_null() {
            call["stream_state"] = state.clone();
        }
        let (status, r) = e.post(DERENDER_COMPLETION_PATH, &call).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["chunk"]["object"], "text_completion");
        let piece = r["chunk"]["choices"][0]["text"].as_str().unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
        out.push_str(piece);
        state = r["stream_state"].clone();
    }
    assert!(ids.len() > text.chars().filter(|c| *c != ' ').count() / 2);
    assert_eq!(out, text);
    assert_eq!(state["logprob_text_offset"], text.chars().count());

    // What vLLM refuses there: stop strings, two choices, a window past its bound, a text chunk.
    let one = json!({"request_id": "r", "output_mode": "tokens", "choices": [{"index": 0, "token_ids": [ids[0]]}]});
    let two = json!({"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}, {"index": 1, "token_ids": [2]}]});
    let long = json!({"prev_tokens": vec!["a"; 1025]});
    let cases = [
        (
            json!({"stream": true, "generate_chunk": one, "chat_request": {"stop": ["."]}}),
            "BadRequestError",
        ),
        (json!({"stream": true, "generate_chunk": two}), "BadRequestError"),
        (json!({"stream": true, "generate_chunk": one, "stream_state": long}), "Bad Request"),
        (
            json!({"stream": true, "generate_chunk": {"request_id": "r", "output_mode": "text", "choices": []}}),
            "Bad Request",
        ),
    ];
    for (body, kind) in cases {
        let (status, r) = e.post(DERENDER_CHAT_PATH, &body).await;
        assert_eq!((status, r["error"]["type"].as_str()), (400, Some(kind)), "{body}: {r}");
    }
}

/// `sampling_params.logprobs`: by token id in tokens mode (vLLM's `GenerateLogProbs`, the
/// sampled token first among its candidates), in OpenAI's chat shape in text mode; past
/// vLLM's `max_logprobs` (20, so -1 too) a 400 `BadRequestError`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_in_both_modes_within_vllms_bound() {
    let e = engine(1000).await;
    let tokens = e.rendered("Tell me about logprobs.").await;
    let body = generate(&tokens, json!({"max_tokens": 3, "ignore_eos": true, "logprobs": 2}));
    let (status, r) = e.post(PATH, &body).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for (entry, id) in content.iter().zip(choice["token_ids"].as_array().unwrap()) {
        assert_eq!(&entry["token_id"], id);
        assert_eq!(entry["rank"], 1);
        assert_eq!(entry["top_logprobs"][0]["token_id"], *id, "the sampled token first");
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
    }
    let mut text = body.clone();
    text["output_mode"] = json!("text");
    let (_, t) = e.post(PATH, &text).await;
    let entry = &t["choices"][0]["logprobs"]["content"][0];
    assert!(entry["token"].is_string() && entry["bytes"].is_array(), "{entry}");
    assert!(entry.get("token_id").is_none());
    for k in [21, -1] {
        let body = generate(&tokens, json!({"max_tokens": 3, "logprobs": k}));
        let (status, r) = e.post(PATH, &body).await;
        assert_eq!((status, r["error"]["type"].as_str()), (400, Some("BadRequestError")), "{r}");
    }
}

/// #51 finding 9: processed images are cached per `cache_salt`: a tenant naming another
/// tenant's uuid gets its own image processed (its own size), never the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_cache_is_keyed_by_salt_and_uuid() {
    use kvroute_preprocess::images::{png_data_url, seeded_png};
    let e = engine(1000).await;
    let p = kvroute_preprocess::Preprocessor::builtin();
    let ids = p.encode("Look at <|image_pad|> and say what it is.").unwrap();
    let body = |salt: &str, url: &str| {
        let mut b = generate(&ids, json!({"max_tokens": 1}));
        b["content_parts"] = json!([{"type": "image_url", "url": url, "uuid": "shared"}]);
        b["cache_salt"] = json!(salt);
        b
    };
    let prompt = |r: &Value| r["usage"]["prompt_tokens"].as_u64().unwrap();
    let (small, big) = (png_data_url(&seeded_png(2, 32)), png_data_url(&seeded_png(3, 256)));
    let (status, a) = e.post(PATH, &body("tenant-a", &small)).await;
    assert_eq!(status, 200, "{a}");
    let (status, b) = e.post(PATH, &body("tenant-b", &big)).await;
    assert_eq!(status, 200, "{b}");
    assert!(
        prompt(&b) > prompt(&a),
        "B's own image was processed: {} vs {}",
        prompt(&b),
        prompt(&a)
    );
    // A's entry serves A again (media not read), and never B.
    let (status, again) = e.post(PATH, &body("tenant-a", "data:image/png;base64,AAAA")).await;
    assert_eq!((status, prompt(&again)), (200, prompt(&a)), "{again}");
    let (status, _) = e.post(PATH, &body("tenant-c", "data:image/png;base64,AAAA")).await;
    assert_eq!(status, 400, "another salt's request reads its own media");
}

/// vLLM's finish reason for a request, with its rule read from vLLM 0.33's own source
/// (`fixtures/vllm-0.33.0-finish.py`): `check_stop` tests its conditions in order, each setting
/// a status; `_FINISHED_REASON_MAP` maps the status to a `FinishReason`, whose value indexes
/// `FINISH_REASON_STRINGS`.
struct VllmFinish {
    /// `check_stop`'s conditions in order: whether it is the end-of-turn test, and its word.
    rules: Vec<(bool, String)>,
}

impl VllmFinish {
    fn read() -> Self {
        let src = include_str!("fixtures/vllm-0.33.0-finish.py");
        let strings: Vec<String> = src
            .lines()
            .find_map(|l| l.strip_prefix("FINISH_REASON_STRINGS = ("))
            .unwrap()
            .trim_end_matches(')')
            .split(',')
            .map(|s| s.trim().trim_matches('"').to_owned())
            .collect();
        let value_of = |reason: &str| -> usize {
            let line = src.lines().find(|l| l.trim().starts_with(&format!("{reason} = "))).unwrap();
            line.split('=').nth(1).unwrap().trim().parse().unwrap()
        };
        let word_of = |status: &str| -> String {
            let entry = format!("RequestStatus.{status}: FinishReason.");
            let line = src.lines().find(|l| l.trim().starts_with(&entry)).unwrap();
            let reason = line.trim().trim_start_matches(&entry).trim_end_matches(',');
            strings[value_of(reason)].clone()
        };
        let body = src.split("def check_stop").nth(1).unwrap();
        let (mut rules, mut eos) = (Vec::new(), None);
        for line in body.lines() {
            let line = line.trim();
            if line.starts_with("if last_token_id == sampling_params.eos_token_id") {
                eos = Some(true);
            } else if line.contains("request.num_output_tokens >= request.max_tokens") {
                eos = Some(false);
            } else if let Some(status) = line.strip_prefix("request.status = RequestStatus.")
                && let Some(is_eos) = eos.take()
            {
                rules.push((is_eos, word_of(status)));
            }
        }
        assert_eq!(rules.len(), 2, "the end-of-turn and the length tests: {rules:?}");
        Self { rules }
    }

    /// The word vLLM answers with for an answer of `ids` asked for `max_tokens`.
    fn reason(&self, ids: &[u32], eos: u32, max_tokens: usize) -> Option<&str> {
        let last = *ids.last()?;
        self.rules.iter().find_map(|(is_eos, word)| {
            let hit = if *is_eos { last == eos } else { ids.len() >= max_tokens };
            hit.then_some(word.as_str())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_reasons_follow_vllms_rules() {
    let vllm = VllmFinish::read();
    assert_eq!(vllm.rules, [(true, "stop".to_owned()), (false, "length".to_owned())]);
    let e = engine(1000).await;
    let eos = kvroute_preprocess::Preprocessor::builtin().eos_token_id().unwrap();
    for (prompt, max_tokens) in [("Tell me a joke.", 1), (LONG, 5), ("Hi", 17)] {
        let tokens = e.rendered(prompt).await;
        for ignore_eos in [false, true] {
            let sampling = json!({"max_tokens": max_tokens, "ignore_eos": ignore_eos});
            let (status, r) = e.post(PATH, &generate(&tokens, sampling)).await;
            assert_eq!(status, 200, "{r}");
            let ids: Vec<u32> =
                serde_json::from_value(r["choices"][0]["token_ids"].clone()).unwrap();
            assert_eq!(ids.len(), max_tokens, "the simulated model answers to max_tokens");
            let want = vllm.reason(&ids, eos, max_tokens);
            assert_eq!(r["choices"][0]["finish_reason"].as_str(), want, "{prompt}: {ids:?}");
            // The chat API says the same of the same answer.
            let chat = json!({"messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "ignore_eos": ignore_eos});
            let (_, c) = e.post("/v1/chat/completions", &chat).await;
            assert_eq!(c["choices"][0]["finish_reason"].as_str(), want, "{c}");
        }
    }
}
