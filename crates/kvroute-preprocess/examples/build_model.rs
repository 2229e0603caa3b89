//! Builds kvroute's small default model directory: a byte-level BPE tokenizer trained on the
//! corpus in `models/corpus/`, with Qwen2-VL-style special tokens (`<|im_start|>`,
//! `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`, `<|endoftext|>`), and a
//! `tokenizer_config.json` with a chat template in the same style. Deterministic: the same
//! corpus gives the same files.
//!
//! With `--text-only`, the same tokenizer without image tokens and a `tokenizer_config.json`
//! without a chat template (the fixture of a text-only model: `models/tiny-text`).
//!
//! `cargo run -p kvroute-preprocess --example build_model -- models/kvroute-tiny models/corpus/*.txt`
//! `cargo run -p kvroute-preprocess --example build_model -- --text-only models/tiny-text models/corpus/*.txt`

#![allow(clippy::print_stdout)]

use std::path::PathBuf;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

const SPECIAL: [&str; 6] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
];

/// The special tokens of the text-only fixture.
const TEXT_SPECIAL: [&str; 1] = ["<|endoftext|>"];

const CHAT_TEMPLATE: &str = r#"{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif -%}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string -%}
{{ message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}
{{ part['text'] }}
{%- elif part['type'] == 'image_url' or part['type'] == 'image' -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}"#;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1).peekable();
    let text_only = args.next_if(|a| a == "--text-only").is_some();
    let out: PathBuf = args.next().ok_or("usage: build_model OUT_DIR CORPUS_FILE...")?.into();
    let corpus: Vec<String> = args.collect();
    if corpus.is_empty() {
        return Err("no corpus files".into());
    }
    let names: &[&str] = if text_only { &TEXT_SPECIAL } else { &SPECIAL };
    let specials: Vec<AddedToken> = names.iter().map(|s| AddedToken::from(*s, true)).collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(2048)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer.train_from_files(&mut trainer, corpus)?;
    tokenizer.add_special_tokens(&specials);
    std::fs::create_dir_all(&out)?;
    tokenizer.save(out.join("tokenizer.json"), true)?;
    let config = if text_only {
        serde_json::json!({"model_name": "tiny-text", "eos_token": "<|endoftext|>", "model_max_length": 4096})
    } else {
        serde_json::json!({
        "model_name": "kvroute-tiny",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "image_token": "<|image_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
        "image_patch_size": 28,
        "image_min_pixels": 3136,
        "image_max_pixels": 1003520,
        })
    };
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config)? + "\n",
    )?;
    println!("wrote {} (vocabulary {})", out.display(), tokenizer.get_vocab_size(true));
    Ok(())
}
