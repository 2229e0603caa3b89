//! What the front door spends tokenizing a prompt: the built-in model's tokenizer on the
//! bench's shared-prefix prompt size (2,112 tokens of text), cold (a beginning never seen)
//! and sharing a 2,048-token beginning tokenized before (the prefix cache,
//! `kvroute_preprocess::prefix_cache`), beside the tokenizer without the cache and the
//! tokenizer library's own path (`encode_library`, without `fast_bpe`); and the whole chat
//! preparation (template, tokenizer), also for the front door's overhead bench's ~100-token
//! request.
//!
//! `cargo bench -p kvroute-preprocess --bench tokenize`

#![allow(clippy::unwrap_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_http::openai::ChatMessage;
use kvroute_preprocess::Preprocessor;

fn tokenize(c: &mut Criterion) {
    let p = Preprocessor::builtin();
    // Text of the vocabulary's words, as the bench's text prompts are: a 2,048-token
    // beginning and 64-token questions.
    let words = p.words();
    let text_of = |n: usize, salt: usize| {
        let ids: Vec<u32> =
            (0..n).map(|i| words.rest[(i * 7 + salt * 13) % words.rest.len()]).collect();
        p.decode(&ids).unwrap()
    };
    let system = text_of(2_048, 0);
    let questions: Vec<String> = (1..=64).map(|k| text_of(64, k)).collect();
    let tokens = p.encode(&format!("{system}{}", questions[0])).unwrap().len();
    let mut group = c.benchmark_group(format!("tokenize/{tokens}_tokens"));
    let plain = Preprocessor::builtin().without_prefix_cache();
    let mut u = 0usize;
    group.bench_function("encode_without_cache", |b| {
        b.iter(|| {
            u += 1;
            let text = format!("{u} {system}{}", questions[u % 64]);
            plain.encode(std::hint::black_box(&text)).unwrap()
        });
    });
    let library = Preprocessor::builtin().without_prefix_cache().without_fast_path();
    group.bench_function("encode_library", |b| {
        b.iter(|| {
            u += 1;
            let text = format!("{u} {system}{}", questions[u % 64]);
            library.encode(std::hint::black_box(&text)).unwrap()
        });
    });
    let mut n = 0usize;
    group.bench_function("encode_cold", |b| {
        b.iter(|| {
            n += 1;
            // A beginning never seen: nothing cached applies.
            let text = format!("{n} {system}{}", questions[n % 64]);
            p.encode(std::hint::black_box(&text)).unwrap()
        });
    });
    let mut k = 0usize;
    group.bench_function("encode_shared_prefix", |b| {
        b.iter(|| {
            k += 1;
            let text = format!("{system}{}", questions[k % 64]);
            p.encode(std::hint::black_box(&text)).unwrap()
        });
    });
    let mut m = 0usize;
    group.bench_function("prepare_chat_cold", |b| {
        b.iter(|| {
            m += 1;
            let messages =
                [ChatMessage::text("user", &format!("{m} {system}{}", questions[m % 64]))];
            p.prepare_chat(std::hint::black_box(&messages), true, Vec::new()).unwrap()
        });
    });
    group.finish();

    // The front door's overhead bench's request (`kvroute-stack` `benches/overhead.rs`):
    // ~100 tokens once templated, a question number varying.
    let text = "The router sends each request to the worker that already holds the longest part of its prompt, unless that worker is too busy. A block is a fixed number of tokens, and every full block is hashed with the blocks before it.";
    let mut small = c.benchmark_group("tokenize/chat_100_tokens");
    let mut q = 0usize;
    small.bench_function("render", |b| {
        b.iter(|| {
            q += 1;
            let messages = [ChatMessage::text("user", &format!("{text} Question {}.", q % 16))];
            p.render(std::hint::black_box(&messages), true).unwrap()
        });
    });
    let rendered =
        p.render(&[ChatMessage::text("user", &format!("{text} Question 3."))], true).unwrap();
    small.bench_function("encode", |b| b.iter(|| p.encode(std::hint::black_box(&rendered))));
    small.bench_function("encode_library", |b| {
        b.iter(|| library.encode(std::hint::black_box(&rendered)));
    });
    small.bench_function("prepare_chat", |b| {
        b.iter(|| {
            q += 1;
            let messages = [ChatMessage::text("user", &format!("{text} Question {}.", q % 16))];
            p.prepare_chat(std::hint::black_box(&messages), true, Vec::new()).unwrap()
        });
    });
    small.finish();
}

criterion_group!(benches, tokenize);
criterion_main!(benches);
