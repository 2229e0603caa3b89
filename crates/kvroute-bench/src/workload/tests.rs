use kvroute_core::BlockSize;
use kvroute_core::schedule::Rng;
use kvroute_preprocess::Preprocessor;

use std::collections::{HashMap, HashSet};

use super::draw::*;
use super::synthetic::*;
use super::*;

fn bs() -> BlockSize {
    BlockSize::new(16).unwrap()
}

fn tokens(r: &BenchRequest) -> &[u32] {
    match &r.prompt {
        Prompt::Tokens(t) => t,
        Prompt::Text(_) | Prompt::Chat(_) | Prompt::Turn { .. } => panic!("not token ids"),
    }
}

fn at(r: &BenchRequest) -> f64 {
    match r.start {
        Start::At(t) => t,
        Start::After { .. } => panic!("not an open-loop request"),
    }
}

#[test]
fn shared_prefix_sizes_and_sharing() {
    let w = SharedPrefix::default().generate(7, bs(), 0.1);
    assert_eq!(w.requests.len(), 12 * 64);
    let mut by_group: HashMap<usize, Vec<&BenchRequest>> = HashMap::new();
    for r in &w.requests {
        assert_eq!(tokens(r).len(), 2048 + 64);
        assert_eq!(r.prompt_ids.len(), 2112);
        assert_eq!(r.blocks.len(), 2112 / 16);
        assert_eq!(r.max_tokens, 32);
        by_group.entry(r.group).or_default().push(r);
    }
    assert_eq!(by_group.len(), 12);
    for (g, reqs) in &by_group {
        assert_eq!(reqs.len(), 64, "group {g}");
        // The system prompt's 128 blocks are shared; the question's 4 are not.
        let first = reqs[0];
        for r in reqs {
            assert_eq!(r.blocks[..128], first.blocks[..128]);
            assert_eq!(tokens(r)[..2048], tokens(first)[..2048]);
        }
        let tails: HashSet<u64> = reqs.iter().map(|r| r.blocks[128]).collect();
        assert_eq!(tails.len(), 64, "every question differs");
    }
    // Groups do not share their first block.
    let firsts: HashSet<u64> = by_group.values().map(|r| r[0].blocks[0]).collect();
    assert_eq!(firsts.len(), 12);
    // The shared prefixes fill about 70% of the pinned fleet (4 x 550 blocks).
    let prefix_blocks: f64 = 12.0 * 128.0;
    assert!((prefix_blocks / 2200.0 - 0.70).abs() < 0.01);
    // Interleaved groups, not one group after another.
    let first_64: HashSet<usize> = w.requests[..64].iter().map(|r| r.group).collect();
    assert!(first_64.len() > 6, "the first 64 requests span {} groups", first_64.len());
    assert_eq!(w.requests.iter().filter(|r| r.warmup).count(), 77);
    assert!(w.requests[..77].iter().all(|r| r.warmup));
}

#[test]
fn text_prompts_keep_the_sharing_of_token_prompts() {
    let pre = Preprocessor::builtin();
    let small = SharedPrefix { groups: 3, prompts_per_group: 4, ..SharedPrefix::default() };
    let ids = small.generate(7, bs(), 0.1);
    let text = small.generate(7, bs(), 0.1).into_text(&pre, bs()).unwrap();
    assert!(text.params.iter().any(|(k, _)| k == "prompts"));
    for (a, b) in ids.requests.iter().zip(&text.requests) {
        let Prompt::Text(prompt) = &b.prompt else { panic!("not converted") };
        // What the bench expects the engine to see is what the engine's tokenizer makes of
        // the text, block for block.
        let seen = pre.prepare_prompt(prompt).unwrap().tokens;
        assert_eq!(*b.prompt_ids, seen);
        assert_eq!(b.blocks, token_blocks(&seen, bs(), None));
        assert_eq!((a.group, a.start, a.warmup), (b.group, b.start, b.warmup));
    }
    // Every block equal between two token prompts is equal between their texts, and no
    // other: a group's system prompt is shared, groups share nothing. (The built-in model
    // adds no tokens to a plain prompt, so blocks line up by position.)
    assert_eq!(text.requests[0].blocks.len(), ids.requests[0].blocks.len());
    for (a1, b1) in ids.requests.iter().zip(&text.requests) {
        for (a2, b2) in ids.requests.iter().zip(&text.requests) {
            let shared = |x: &[u64], y: &[u64]| x.iter().zip(y).take_while(|(p, q)| p == q).count();
            assert_eq!(shared(&a1.blocks, &a2.blocks), shared(&b1.blocks, &b2.blocks));
        }
    }
}

#[test]
fn arrivals_are_poisson_at_the_rate() {
    let w = SharedPrefix::default().generate(3, bs(), 0.0);
    let times: Vec<f64> = w.requests.iter().map(at).collect();
    assert_eq!(times[0], 0.0);
    assert!(times.windows(2).all(|p| p[0] <= p[1]), "ordered");
    // 767 gaps with mean 1/24 s: the sample mean is within 10%.
    let mean_gap = times[times.len() - 1] / (times.len() - 1) as f64;
    assert!((mean_gap * 24.0 - 1.0).abs() < 0.1, "mean gap {mean_gap}");
    // Exponential gaps: about e^-1 of them exceed the mean.
    let gaps: Vec<f64> = times.windows(2).map(|p| p[1] - p[0]).collect();
    let above = gaps.iter().filter(|&&g| g > 1.0 / 24.0).count() as f64 / gaps.len() as f64;
    assert!((above - (-1.0f64).exp()).abs() < 0.05, "{above}");
}

#[test]
fn generators_are_deterministic_per_seed() {
    let a = SharedPrefix::default().generate(1, bs(), 0.1);
    let b = SharedPrefix::default().generate(1, bs(), 0.1);
    let c = SharedPrefix::default().generate(2, bs(), 0.1);
    let key = |w: &Workload| -> Vec<(Vec<u64>, String)> {
        w.requests.iter().map(|r| (r.blocks.clone(), format!("{:?}", r.start))).collect()
    };
    assert_eq!(key(&a), key(&b));
    assert_ne!(key(&a), key(&c));
    let m = MultiTurn::default();
    let pre = Preprocessor::builtin();
    let turns = |w: &Workload| -> Vec<String> {
        w.requests.iter().map(|r| format!("{:?} {:?}", r.prompt, r.start)).collect()
    };
    assert_eq!(
        turns(&m.generate(5, 0.1, &pre).unwrap()),
        turns(&m.generate(5, 0.1, &pre).unwrap())
    );
    let r = RandomPrompts::default();
    assert_eq!(key(&r.generate(5, bs(), 0.1)), key(&r.generate(5, bs(), 0.1)));
}

#[test]
fn multi_turn_users_write_exact_turns_of_words() {
    let pre = Preprocessor::builtin();
    let m = MultiTurn::default();
    let w = m.generate(9, 0.1, &pre).unwrap();
    assert_eq!(w.requests.len(), 24 * 28);
    let mut contexts = HashSet::new();
    for u in 0..24 {
        let rounds = &w.requests[u * 28..(u + 1) * 28];
        assert!(matches!(rounds[0].start, Start::At(_)));
        for (r, req) in rounds.iter().enumerate() {
            assert_eq!(req.group, u);
            assert_eq!(req.warmup, r < 3, "the first 10% of rounds are warm-up");
            let Prompt::Turn { context, text } = &req.prompt else { panic!("not a turn") };
            assert_eq!(pre.encode(text).unwrap().len(), 32, "user {u} round {r}: {text}");
            match (r, context) {
                (0, Some(c)) => {
                    assert_eq!(pre.encode(c).unwrap().len(), 256);
                    contexts.insert(c.to_string());
                }
                (0, None) => panic!("the first turn opens the conversation"),
                (_, Some(_)) => panic!("only the first turn carries the context"),
                (_, None) => match req.start {
                    Start::After { prev: p, think } => {
                        assert_eq!(p, u * 28 + r - 1);
                        assert!(think >= 0.0);
                    }
                    Start::At(_) => panic!("round {r} is not after the previous one"),
                },
            }
        }
    }
    assert_eq!(contexts.len(), 24, "users share nothing");
}

#[test]
fn an_answer_extends_the_prompts_blocks() {
    let prompt: Vec<u32> = (0..40).collect();
    let blocks = token_blocks(&prompt, bs(), None);
    assert_eq!(blocks.len(), 2);
    let answer: Vec<u32> = (100..130).collect();
    let extended = extended_blocks(&blocks, &prompt, &answer, bs(), None);
    let mut all = prompt;
    all.extend(&answer);
    assert_eq!(extended, token_blocks(&all, bs(), None), "the same chain as one prompt of both");
    assert_eq!(extended.len(), 4);
}

#[test]
fn random_prompts_share_nothing() {
    let w = RandomPrompts::default().generate(4, bs(), 0.1);
    assert_eq!(w.requests.len(), 160);
    let firsts: HashSet<u64> = w.requests.iter().map(|r| r.blocks[0]).collect();
    assert_eq!(firsts.len(), 160);
    assert!(w.requests.iter().all(|r| r.prompt_ids.len() == 1024 && r.blocks.len() == 64));
    assert!(w.requests.iter().flat_map(tokens).all(|&t| (TOKEN_LO..TOKEN_HI).contains(&t)));
}

#[test]
fn zipf_prefers_low_ranks() {
    let table = zipf_table(24, 1.1);
    let mut rng = Rng::new(11);
    let mut counts = [0usize; 24];
    for _ in 0..20_000 {
        counts[zipf_draw(&mut rng, &table)] += 1;
    }
    assert!(counts.iter().all(|&c| c > 0), "every rank is drawn: {counts:?}");
    // P(rank 0) / P(rank 1) = 2^1.1.
    let ratio = counts[0] as f64 / counts[1] as f64;
    assert!((ratio - 2f64.powf(1.1)).abs() < 0.25, "{ratio}");
    assert!(counts[0] > counts[23] * 10);
}

#[test]
fn generated_images_differ_in_pixels_only() {
    let a = image::load_from_memory(&generated_png(0, 64).unwrap()).unwrap().to_rgb8();
    let b = image::load_from_memory(&generated_png(1, 64).unwrap()).unwrap().to_rgb8();
    assert_eq!(a.dimensions(), b.dimensions());
    assert_ne!(a.as_raw(), b.as_raw());
    assert_eq!(generated_png(5, 64).unwrap(), generated_png(5, 64).unwrap());
}

#[test]
fn multimodal_images_change_the_blocks_they_cover() {
    let pre = Preprocessor::builtin();
    let m = Multimodal { requests: 120, ..Multimodal::default() };
    let w = m.generate(6, bs(), 0.1, &pre).unwrap();
    assert_eq!(w.requests.len(), 120);
    let again = m.generate(6, bs(), 0.1, &pre).unwrap();
    assert!(w.requests.iter().zip(&again.requests).all(|(a, b)| a.blocks == b.blocks));
    // Requests with the same text and images have identical blocks; the same text with other
    // images diverges at the first image's block; both cases occur.
    let (mut repeats, mut same_text_other_image) = (0, 0);
    for (i, a) in w.requests.iter().enumerate() {
        for b in &w.requests[..i] {
            let (Prompt::Chat(ma), Prompt::Chat(mb)) = (&a.prompt, &b.prompt) else { panic!() };
            let same_text = ma[0] == mb[0]
                && ma[1]["content"].as_array().unwrap().last()
                    == mb[1]["content"].as_array().unwrap().last();
            if a.group == b.group {
                assert_eq!(a.blocks, b.blocks);
                repeats += 1;
            } else if same_text {
                let common = a.blocks.iter().zip(&b.blocks).take_while(|(x, y)| x == y).count();
                assert!(common < a.blocks.len().min(b.blocks.len()), "another image, other blocks");
                same_text_other_image += 1;
            }
        }
    }
    assert!(repeats > 0 && same_text_other_image > 0, "{repeats} {same_text_other_image}");
}

/// A trace's ids become token blocks: equal leading ids, equal tokens (and block hashes), a
/// partial last block is its id's first tokens, lengths and times scale as asked.
#[test]
fn a_trace_replays_with_equal_ids_as_equal_tokens() {
    let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.jsonl");
    let lines = [
        r#"{"timestamp": 1000, "input_length": 1300, "output_length": 100, "hash_ids": [1, 2, 3]}"#,
        "",
        r#"{"timestamp": 3000, "input_length": 1100, "output_length": 8, "hash_ids": [1, 2, 4]}"#,
        r#"{"timestamp": 5000, "input_length": 600, "output_length": 500, "hash_ids": [1, 3]}"#,
        r#"{"timestamp": 9000, "input_length": 512, "output_length": 1, "hash_ids": [9]}"#,
    ];
    std::fs::write(&path, lines.join("\n")).unwrap();
    let trace = TraceReplay {
        path: path.clone(),
        requests: 3,
        block_tokens: 64,
        time_scale: 0.5,
        rate: None,
    };
    let w = trace.generate(7, bs(), 0.0).unwrap();
    assert_eq!(w.requests.len(), 3, "the first 3 requests (blank lines skipped)");
    let t: Vec<&[u32]> = w.requests.iter().map(tokens).collect();
    // 1300 = 2 x 512 + 276: two 64-token blocks and ceil(276 / 8) = 35 tokens.
    assert_eq!(t.iter().map(|t| t.len()).collect::<Vec<_>>(), vec![163, 128 + 10, 64 + 11]);
    assert_eq!(t[0][..128], t[1][..128], "ids 1, 2 shared");
    assert_ne!(t[0][128..136], t[1][128..136], "ids 3 and 4 differ");
    assert_eq!(t[2][..64], t[0][..64], "id 1 again");
    assert_eq!(t[2][64..], t[0][128..139], "id 3's partial block is its first tokens");
    assert_eq!(w.requests[0].blocks[..8], w.requests[1].blocks[..8]);
    assert_eq!(w.requests.iter().map(at).collect::<Vec<_>>(), vec![0.0, 1.0, 2.0]);
    assert_eq!(w.requests.iter().map(|r| r.max_tokens).collect::<Vec<_>>(), vec![13, 1, 63]);
    // The same seed, the same prompts; a rate instead of a scale: 3 requests over 4 s at 3/s.
    assert_eq!(tokens(&trace.generate(7, bs(), 0.0).unwrap().requests[0]), t[0]);
    let fast = TraceReplay { rate: Some(3.0), ..trace.clone() }.generate(7, bs(), 0.0).unwrap();
    assert!((at(&fast.requests[2]) - 1.0).abs() < 1e-9, "{}", at(&fast.requests[2]));
    // Broken traces are errors that say where.
    std::fs::write(&path, "{\"timestamp\": 1}\n").unwrap();
    let e = trace.generate(7, bs(), 0.0).unwrap_err();
    assert!(format!("{e:#}").contains("line 1"), "{e:#}");
    let missing = TraceReplay { path: dir.join("none.jsonl"), ..trace };
    assert!(format!("{:#}", missing.generate(7, bs(), 0.0).unwrap_err()).contains("--trace PATH"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// multi-lora: adapters by Zipf popularity (the first the most asked for), each request's
/// blocks salted with its adapter, one system prompt per adapter; sessions tag every request
/// of a user with one key and change nothing else of multi-turn's schedule.
#[test]
fn multi_lora_requests_name_their_adapter_and_sessions_tag_users() {
    let w = MultiLora { requests: 400, ..MultiLora::default() }.generate(7, bs(), 0.0).unwrap();
    assert_eq!(w.adapters.len(), 32);
    let count = |k: usize| w.requests.iter().filter(|r| r.group == k).count();
    assert!(
        count(0) > count(1) && count(1) > count(8),
        "Zipf: {} {} {}",
        count(0),
        count(1),
        count(8)
    );
    let r = &w.requests[0];
    let name = adapter_name(r.group);
    assert_eq!(r.adapter.as_deref(), Some(name.as_str()));
    assert_eq!(r.blocks, token_blocks(&r.prompt_ids, bs(), Some(&name)));
    assert_ne!(r.blocks, token_blocks(&r.prompt_ids, bs(), None), "salted");
    let same: Vec<_> = w.requests.iter().filter(|o| o.group == r.group).collect();
    assert!(same.iter().all(|o| o.blocks[..60] == r.blocks[..60]), "one system prompt per adapter");

    let pre = kvroute_preprocess::Preprocessor::builtin();
    let turns = MultiTurn { users: 3, rounds: 2, ..MultiTurn::default() };
    let tagged = sessions(&turns, 7, 0.0, &pre).unwrap();
    let plain = turns.generate(7, 0.0, &pre).unwrap();
    assert_eq!(tagged.requests.len(), plain.requests.len());
    for (t, p) in tagged.requests.iter().zip(&plain.requests) {
        assert_eq!(t.session.as_deref(), Some(format!("user-{}", t.group).as_str()));
        assert_eq!((t.start, t.group, p.session.is_none()), (p.start, p.group, true));
    }
}

/// long-prompt: every prompt is as long as asked and opens with one of the documents, which
/// requests share; the rest is its own.
#[test]
fn long_prompts_share_documents_and_nothing_else() {
    let bs = BlockSize::new(16).unwrap();
    let w =
        LongPrompts { requests: 40, documents: 3, ..LongPrompts::default() }.generate(7, bs, 0.0);
    assert_eq!(w.requests.len(), 40);
    let doc_blocks = 1024 / 16;
    let mut docs = std::collections::HashMap::new();
    for r in &w.requests {
        assert_eq!(r.prompt_ids.len(), 4096);
        assert_eq!(r.max_tokens, 256);
        let first = &r.blocks[..doc_blocks];
        let seen = docs.entry(r.group).or_insert_with(|| first.to_vec());
        assert_eq!(seen.as_slice(), first, "one document, one prefix");
    }
    assert!(docs.len() > 1 && docs.len() <= 3, "{} documents used", docs.len());
    // Past the document, no two prompts share a block.
    let mut tails = std::collections::HashSet::new();
    for r in &w.requests {
        assert!(tails.insert(r.blocks[doc_blocks]), "a shared block past the document");
    }
}
