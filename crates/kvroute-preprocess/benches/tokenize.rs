//! What the front door spends tokenizing a prompt: the built-in model's tokenizer on the
//! bench's shared-prefix prompt size (2,112 tokens of text), and the whole chat preparation
//! (template, tokenizer) of the same text.
//!
//! `cargo bench -p kvroute-preprocess --bench tokenize`

#![allow(clippy::unwrap_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_http::openai::ChatMessage;
use kvroute_preprocess::Preprocessor;

fn tokenize(c: &mut Criterion) {
    let p = Preprocessor::builtin();
    // Text of 2,112 tokens of the vocabulary's words, as the bench's text prompts are.
    let words = p.words();
    let ids: Vec<u32> = (0..2_112).map(|i| words.rest[i * 7 % words.rest.len()]).collect();
    let text = p.decode(&ids).unwrap();
    let tokens = p.encode(&text).unwrap().len();
    let mut group = c.benchmark_group(format!("tokenize/{tokens}_tokens"));
    group.bench_function("encode", |b| b.iter(|| p.encode(std::hint::black_box(&text)).unwrap()));
    let messages = [ChatMessage::text("user", &text)];
    group.bench_function("prepare_chat", |b| {
        b.iter(|| p.prepare_chat(std::hint::black_box(&messages), true, Vec::new()).unwrap());
    });
    group.finish();
}

criterion_group!(benches, tokenize);
criterion_main!(benches);
