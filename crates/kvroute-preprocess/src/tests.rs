use base64::Engine as _;
use image::{ImageBuffer, ImageFormat, Rgba};
use kvroute_core::{BlockHasher, BlockSize};

use super::*;
use std::path::Path;

fn model() -> Preprocessor {
    Preprocessor::builtin()
}

fn png(width: u32, height: u32, shade: u8) -> Vec<u8> {
    let img = ImageBuffer::from_fn(width, height, |x, y| {
        Rgba([shade, (x % 256) as u8, (y % 256) as u8, 255])
    });
    let mut bytes = std::io::Cursor::new(Vec::new());
    img.write_to(&mut bytes, ImageFormat::Png).unwrap();
    bytes.into_inner()
}

fn user(content: MessageContent) -> ChatMessage {
    ChatMessage { role: "user".into(), content: Some(content) }
}

fn image_part(url: String) -> ContentPart {
    ContentPart::ImageUrl { image_url: ImageUrl { url, detail: None, uuid: None } }
}

#[test]
fn text_chat_renders_tokenizes_and_round_trips() {
    let m = model();
    let messages = vec![user(MessageContent::Text("Hello! What is a KV cache?".into()))];
    let text = m.render(&messages, true).unwrap();
    assert!(
        text.starts_with("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"),
        "{text}"
    );
    assert!(text.contains("<|im_start|>user\nHello! What is a KV cache?<|im_end|>\n"), "{text}");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
    let prepared = m.prepare_chat(&messages, true, Vec::new()).unwrap();
    assert!(prepared.mm.mm_objects.is_empty());
    assert!(m.decode(&prepared.tokens).unwrap().contains("Hello! What is a KV cache?"));
    let ids = m.encode("<|im_start|>").unwrap();
    assert_eq!(ids.len(), 1, "special tokens are single tokens");
    assert_eq!(m.model_name(), "kvroute-tiny");
    assert_eq!(m.encode("same text").unwrap(), m.encode("same text").unwrap());
}

#[test]
fn images_expand_into_placeholders_with_offsets() {
    let m = model();
    let config = *m.image_config();
    let a = images::decode(&png(84, 56, 1), &config).unwrap();
    let b = images::decode(&png(56, 56, 2), &config).unwrap();
    assert_eq!((a.tokens, b.tokens), (6, 4));
    assert_ne!(a.identifier, b.identifier);
    assert_eq!(a.identifier.len(), 64);
    let url = format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(png(84, 56, 1))
    );
    let same = images::decode(&images::data_url_bytes(&url, &config).unwrap(), &config).unwrap();
    assert_eq!(same, a, "the same picture has the same identifier however it is sent");

    let messages = vec![user(MessageContent::Parts(vec![
        ContentPart::Text { text: "Compare ".into() },
        image_part(url.clone()),
        ContentPart::Text { text: " with ".into() },
        image_part("https://example.invalid/b.png".into()),
    ]))];
    assert_eq!(image_urls(&messages), vec![url.as_str(), "https://example.invalid/b.png"]);
    let plain = m.prepare_chat(&messages, true, vec![a.clone(), b.clone()]).unwrap();
    let pad = m.image_token_id().unwrap();
    assert_eq!(plain.mm.mm_objects.len(), 2);
    for (object, image) in plain.mm.mm_objects.iter().zip([&a, &b]) {
        let (s, e) = object.offsets[0];
        assert_eq!(e - s, image.tokens);
        assert!(plain.tokens[s..e].iter().all(|&t| t == pad));
        assert_eq!(object.mm_hash, image.mm_hash);
    }
    assert_eq!(plain.tokens.iter().filter(|&&t| t == pad).count(), 10);
    assert!(matches!(
        m.prepare_chat(&messages, true, vec![a]),
        Err(PreprocessError::ImageCount { parts: 2, given: 1 })
    ));

    // Same text, another picture: block hashes differ exactly from the first image block on.
    let c = images::decode(&png(84, 56, 3), &config).unwrap();
    let other = m.prepare_chat(&messages, true, vec![c, b]).unwrap();
    assert_eq!(other.tokens, plain.tokens, "placeholders are the same tokens");
    let bs = BlockSize::new(4).unwrap();
    let hash = |p: &Prepared| {
        BlockHasher::new(bs).local_hashes(&p.tokens, Some(&p.mm.to_block_level(bs, p.tokens.len())))
    };
    let (h1, h2) = (hash(&plain), hash(&other));
    let first_image_block = plain.mm.mm_objects[0].offsets[0].0 / 4;
    assert_eq!(h1[..first_image_block], h2[..first_image_block]);
    assert_ne!(h1[first_image_block], h2[first_image_block]);
}

#[test]
fn a_missing_model_dir_is_a_clear_error() {
    let err = Preprocessor::load(Path::new("/nonexistent/model")).unwrap_err().to_string();
    assert!(err.contains("/nonexistent/model") && err.contains("tokenizer.json"), "{err}");
}

fn text_only() -> Preprocessor {
    Preprocessor::load(&Preprocessor::repository_model_dir().join("../tiny-text")).unwrap()
}

#[test]
fn the_builtin_model_is_the_repository_one() {
    let from_dir = Preprocessor::load(&Preprocessor::repository_model_dir()).unwrap();
    let builtin = Preprocessor::builtin();
    assert_eq!(builtin.model_name(), BUILTIN_MODEL);
    let messages = vec![user(MessageContent::Text("Same tokens either way?".into()))];
    assert_eq!(
        builtin.prepare_chat(&messages, true, Vec::new()).unwrap(),
        from_dir.prepare_chat(&messages, true, Vec::new()).unwrap()
    );
    assert_eq!(builtin.image_token_id(), from_dir.image_token_id());
    assert!(builtin.image_token_id().is_some());
    assert_eq!(Preprocessor::load_or_builtin(None).unwrap().model_name(), BUILTIN_MODEL);
}

/// The repository's models take the fast tokenizing path: a change to the tokenizers or to
/// the path's eligibility that sent them back to the library would still give the same ids,
/// only ~15x slower, and nothing else would notice.
#[test]
fn the_repository_models_tokenize_on_the_fast_path() {
    assert!(Preprocessor::builtin().fast.is_some());
    let models = Preprocessor::repository_model_dir().join("..");
    for dir in ["kvroute-tiny", "kvroute-tiny-swa"] {
        assert!(Preprocessor::load(&models.join(dir)).unwrap().fast.is_some(), "{dir}");
    }
    assert!(Preprocessor::builtin().without_fast_path().fast.is_none());
}

#[test]
fn a_text_only_model_uses_the_plain_template_and_refuses_images() {
    let m = text_only();
    assert_eq!(m.model_name(), "tiny-text");
    assert_eq!(m.image_token_id(), None);
    assert_eq!(m.max_model_len(), Some(4096));
    let messages = vec![
        ChatMessage::text("system", "Be brief."),
        user(MessageContent::Parts(vec![ContentPart::Text { text: "Hello there".into() }])),
    ];
    let text = m.render(&messages, true).unwrap();
    assert_eq!(text, "system:\nBe brief.\nuser:\nHello there\nassistant:\n");
    let prepared = m.prepare_chat(&messages, true, Vec::new()).unwrap();
    assert_eq!(m.decode(&prepared.tokens).unwrap(), text);
    let with_image =
        vec![user(MessageContent::Parts(vec![image_part("data:image/png;base64,AAAA".into())]))];
    let err = m.prepare_chat(&with_image, true, Vec::new()).unwrap_err();
    assert!(matches!(err, PreprocessError::TextOnly { .. }), "{err}");
    let api: kvroute_http::ApiError = err.into();
    assert_eq!(api.status().as_u16(), 400);
    assert!(api.message().contains("takes text only"), "{}", api.message());
}

#[test]
fn hugging_face_config_forms_are_read() {
    let dir = std::env::temp_dir().join(format!("kvroute-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = Preprocessor::repository_model_dir();
    std::fs::copy(tiny.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let config = serde_json::json!({
        "eos_token": {"content": "<|im_end|>", "lstrip": false},
        "model_max_length": 1e30,
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0]['content'] }}"}],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let m = Preprocessor::load(&dir).unwrap();
    assert_eq!(m.eos_token_id(), Preprocessor::builtin().eos_token_id());
    assert_eq!(m.max_model_len(), None, "1e30 means no limit");
    assert_eq!(m.render(&[ChatMessage::text("user", "only this")], true).unwrap(), "only this");
    std::fs::write(dir.join("chat_template.jinja"), "file: {{ messages[0]['content'] }}").unwrap();
    let m = Preprocessor::load(&dir).unwrap();
    assert_eq!(m.render(&[ChatMessage::text("user", "x")], true).unwrap(), "file: x");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"image_token": "<|nope|>"}"#).unwrap();
    let err = Preprocessor::load(&dir).unwrap_err().to_string();
    assert!(err.contains("no image token") && err.contains("kvroute-hf"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// An answer made of the vocabulary's words tokenizes back to its token ids, alone and as
    /// the assistant's turn of a conversation sent back (after the generation prompt).
    #[test]
    fn answers_of_words_survive_a_round_trip(key in proptest::prelude::any::<u64>(), len in 1usize..48) {
        for model in [Preprocessor::builtin(), text_only()] {
            let words = model.words();
            proptest::prop_assert!(!words.first.is_empty() && words.rest.len() > 50, "{}", model.model_name());
            let answer: Vec<u32> = (0..len).map(|i| words.pick(key, i).unwrap()).collect();
            let text = model.decode(&answer).unwrap();
            proptest::prop_assert_eq!(model.encode(&text).unwrap(), answer.clone(), "{:?}", text);
            let question = vec![user(MessageContent::Text("What is a KV cache?".into()))];
            let asked = model.prepare_chat(&question, true, Vec::new()).unwrap().tokens;
            let mut conversation = question.clone();
            conversation.push(ChatMessage::text("assistant", &text));
            conversation.push(user(MessageContent::Text("And then?".into())));
            let next = model.prepare_chat(&conversation, true, Vec::new()).unwrap().tokens;
            let mut expected = asked.clone();
            expected.extend(&answer);
            proptest::prop_assert_eq!(&next[..expected.len()], &expected[..], "{}", model.model_name());
        }
    }
}

/// A vocabulary with `<|image_pad|>` whose chat template prints content parts as text (the
/// peers' `tinymodel-mm`: tinymodel with three added vision tokens, its template unchanged)
/// takes no images, and says why; the built-in model, whose template places the pads, does.
#[test]
fn image_tokens_without_a_template_that_places_them_make_a_text_only_model() {
    let dir = std::env::temp_dir().join(format!("kvroute-mm-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = Preprocessor::repository_model_dir().join("../tiny-text/tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source).unwrap()).unwrap();
    let n = tokenizer["model"]["vocab"].as_object().unwrap().len();
    for (i, token) in ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"].iter().enumerate() {
        tokenizer["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
            "id": n + i, "content": token, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    }
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let m = Preprocessor::load(&dir).unwrap();
    assert_eq!(m.image_token_id(), None);
    let why = m.text_only_reason().unwrap();
    assert!(why.contains("<|image_pad|>") && why.contains("no image placeholder"), "{why}");
    let with_image =
        vec![user(MessageContent::Parts(vec![image_part("data:image/png;base64,AAAA".into())]))];
    let err = m.check_images(&with_image).unwrap_err();
    assert!(err.to_string().contains("no image placeholder"), "{err}");
    let builtin = Preprocessor::builtin();
    assert!(builtin.image_token_id().is_some());
    assert_eq!(builtin.text_only_reason(), None);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A large prompt is tokenized off the runtime's worker wherever it is asked for: on a
/// multi-threaded runtime's worker, in its `block_on`, on a current-thread runtime, and with
/// no runtime at all; the tokens are the same everywhere.
#[test]
fn large_prompts_tokenize_the_same_on_and_off_a_runtime() {
    let p = std::sync::Arc::new(model());
    let text = "the router sends each request to the worker that holds its prefix ".repeat(100);
    assert!(text.len() >= crate::OFF_RUNTIME_BYTES);
    let plain = p.encode(&text).unwrap();
    let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(2).build().unwrap();
    let (p2, t2) = (std::sync::Arc::clone(&p), text.clone());
    let on_worker = multi.block_on(multi.spawn(async move { p2.encode(&t2).unwrap() })).unwrap();
    let in_block_on = multi.block_on(async { p.encode(&text).unwrap() });
    let single = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let on_current = single.block_on(async { p.encode(&text).unwrap() });
    assert_eq!((&on_worker, &in_block_on, &on_current), (&plain, &plain, &plain));
}
