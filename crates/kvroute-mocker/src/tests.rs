use std::time::Duration;

use kvroute_core::hash::mm_hash_from_identifier;
use kvroute_core::index::RadixIndex;
use kvroute_core::{
    BlockExtraInfo, BlockHasher, BlockMmObjectInfo, BlockSize, KvCacheEventData, RouterEvent,
    WorkerWithDpRank,
};
use kvroute_wire::vllm::{decode_batch, encode_batch};
use kvroute_wire::{ConvertConfig, Converter, EngineEvent, KvEventBatch};

use crate::*;

fn config(num_blocks: usize) -> EngineConfig {
    EngineConfig { num_blocks, block_size: BlockSize::new(16).unwrap(), ..EngineConfig::default() }
}

/// Answers of words 7 (first), then 8 and 9.
fn plan() -> OutputPlan {
    let words = kvroute_preprocess::Words { first: vec![7], rest: vec![8, 9] };
    OutputPlan::new(&[1], 0, std::sync::Arc::new(words), None, 1000)
}

fn request(id: &str, tokens: Vec<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        id: id.to_owned(),
        tokens,
        block_mm_infos: None,
        max_tokens,
        plan: plan(),
        cache_salt: None,
        lora: None,
        handoff: Handoff::None,
        in_store: Vec::new(),
        priority: 0,
    }
}

/// The order in which requests got their first token.
fn first_tokens(steps: &[Step]) -> Vec<String> {
    steps
        .iter()
        .flat_map(|s| &s.outputs)
        .filter_map(|o| match o {
            Output::FirstToken { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn the_priority_policy_runs_the_lowest_value_first_and_fcfs_runs_arrivals_in_order() {
    for (scheduling, order) in [
        (crate::SchedulingPolicy::Fcfs, ["a", "b", "c", "d"]),
        (crate::SchedulingPolicy::Priority, ["b", "d", "a", "c"]),
    ] {
        // One request at a time, so the queue's order is the order they run.
        let mut engine = Engine::new(EngineConfig { max_num_seqs: 1, scheduling, ..config(200) });
        for (k, (id, priority)) in [("a", 5), ("b", -2), ("c", 5), ("d", 0)].into_iter().enumerate()
        {
            let tokens = (0..20).map(|t| 100 * k as u32 + t).collect();
            let priority = if scheduling == crate::SchedulingPolicy::Fcfs { 0 } else { priority };
            engine.submit(EngineRequest { priority, ..request(id, tokens, 2) }).unwrap();
        }
        assert_eq!(first_tokens(&run(&mut engine)), order, "{scheduling:?}");
    }
}

#[test]
fn under_the_priority_policy_the_least_urgent_running_request_is_preempted() {
    // Room for the two prompts and little more: as they grow, one must give its blocks back.
    let mut engine =
        Engine::new(EngineConfig { scheduling: crate::SchedulingPolicy::Priority, ..config(6) });
    let urgent = (0..32).collect();
    let lax = (1000..1032).collect();
    engine.submit(EngineRequest { priority: 9, ..request("lax", lax, 30) }).unwrap();
    engine.submit(EngineRequest { priority: 1, ..request("urgent", urgent, 30) }).unwrap();
    let steps = run(&mut engine);
    let done = |id: &str| {
        steps.iter().position(|s| {
            s.outputs.iter().any(|o| matches!(o, Output::Token { id: i, index: 29, .. } if i == id))
        })
    };
    // Arrived first, the lax one is preempted for the urgent one, which ends first.
    assert!(engine.stats().preemptions > 0);
    assert!(done("urgent").unwrap() < done("lax").unwrap());
}

/// The tokens `id` generated, in order.
fn generated(steps: &[Step], id: &str) -> Vec<u32> {
    steps
        .iter()
        .flat_map(|s| &s.outputs)
        .filter_map(|o| match o {
            Output::Token { id: t, token, .. } if t == id => Some(*token),
            _ => None,
        })
        .collect()
}

/// The time from the first of `steps` to the end of the one that gave `id` its first token.
fn time_to_first(steps: &[Step], id: &str) -> Duration {
    let first = |s: &Step| {
        s.outputs.iter().any(|o| matches!(o, Output::FirstToken { id: t, .. } if t == id))
    };
    let at = steps.iter().position(first).unwrap_or_else(|| panic!("{id} never started"));
    steps[..=at].iter().map(|s| s.duration).sum()
}

/// Steps until idle (bounded); returns every step.
fn run(engine: &mut Engine) -> Vec<Step> {
    let mut steps = Vec::new();
    for _ in 0..10_000 {
        match engine.step() {
            Some(step) => steps.push(step),
            None => return steps,
        }
    }
    panic!("the engine never went idle");
}

fn usage_of(steps: &[Step], id: &str) -> Usage {
    steps
        .iter()
        .flat_map(|s| &s.outputs)
        .find_map(|o| match o {
            Output::Finished { id: done, usage } if done == id => Some(*usage),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{id} never finished"))
}

/// The steps' events through the real wire (encode, decode, convert) into an index, as
/// worker 3.
fn indexed(steps: &[Step]) -> RadixIndex {
    let mut index = RadixIndex::new();
    let mut converter = Converter::new(ConvertConfig::new(BlockSize::new(16).unwrap()));
    for (seq, step) in steps.iter().enumerate() {
        let bytes =
            encode_batch(&KvEventBatch { ts: 0.0, events: step.events.clone(), dp_rank: Some(0) });
        for event in converter.vllm_batch(&decode_batch(&bytes).unwrap(), seq as u64) {
            index.apply_event(&RouterEvent::new(3u64, event)).unwrap();
        }
    }
    index
}

fn events(steps: &[Step]) -> Vec<EngineEvent> {
    steps.iter().flat_map(|s| s.events.clone()).collect()
}

#[test]
fn a_repeated_prompt_hits_every_full_block_and_a_prefix_exactly_its_prefix() {
    let mut engine = Engine::new(config(1000));
    let prompt: Vec<u32> = (0..100).collect(); // 6 full blocks + 4 tokens
    engine.submit(request("a", prompt.clone(), 4)).unwrap();
    let first = run(&mut engine);
    assert_eq!(
        usage_of(&first, "a"),
        Usage { prompt_tokens: 100, cached_tokens: 0, completion_tokens: 4 }
    );
    engine.submit(request("b", prompt.clone(), 4)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "b").cached_tokens, 96, "all 6 full blocks");
    let mut shared = prompt[..40].to_vec(); // 2 full blocks shared, then different
    shared.extend(500..560);
    engine.submit(request("c", shared, 1)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "c").cached_tokens, 32);
    let stats = engine.stats();
    assert_eq!((stats.requests_finished, stats.prompt_tokens, stats.cached_tokens), (3, 300, 128));
}

#[test]
fn stored_events_chain_and_hash_like_the_router() {
    let mut engine = Engine::new(config(1000));
    let prompt: Vec<u32> = (1000..1064).collect();
    engine.submit(request("a", prompt.clone(), 1)).unwrap();
    let steps = run(&mut engine);
    let index = indexed(&steps);
    let local = BlockHasher::new(BlockSize::new(16).unwrap()).local_hashes(&prompt, None);
    assert_eq!(index.find_matches(&local).score(WorkerWithDpRank::new(3u64, 0u32)), 4);
}

#[test]
fn eviction_under_pressure_emits_removed_blocks() {
    // 10 blocks: a 4-block prompt, then two others that need the space.
    let mut engine = Engine::new(config(10));
    let prompts: Vec<Vec<u32>> = (0..3).map(|k| (k * 1000..k * 1000 + 64).collect()).collect();
    let mut all = Vec::new();
    for (k, p) in prompts.iter().enumerate() {
        engine.submit(request(&format!("r{k}"), p.clone(), 1)).unwrap();
        all.extend(run(&mut engine));
    }
    let events = events(&all);
    let removed: Vec<u64> = events
        .iter()
        .flat_map(|e| match e {
            EngineEvent::BlockRemoved(r) => r.block_hashes.clone(),
            _ => Vec::new(),
        })
        .collect();
    assert!(!removed.is_empty(), "the third prompt must evict");
    // What was removed had been stored, tails go first, and the wire round trip agrees.
    let first_stored: Vec<u64> = match &events[0] {
        EngineEvent::BlockStored(s) => s.block_hashes.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        removed[0],
        *first_stored.last().unwrap(),
        "the tail of the oldest prompt goes first"
    );
    let bytes = encode_batch(&KvEventBatch { ts: 0.0, events, dp_rank: Some(0) });
    let converted = Converter::new(ConvertConfig::new(BlockSize::new(16).unwrap()))
        .vllm_batch(&decode_batch(&bytes).unwrap(), 0);
    let removed_again: Vec<u64> = converted
        .iter()
        .flat_map(|e| match &e.data {
            KvCacheEventData::Removed(r) => r.block_hashes.iter().map(|h| h.0).collect(),
            _ => Vec::new(),
        })
        .collect();
    assert_eq!(removed_again, removed);
    assert_eq!(engine.stats().evicted_blocks, removed.len() as u64);
}

#[test]
fn image_blocks_carry_the_identifier() {
    let mut engine = Engine::new(config(100));
    let mut tokens: Vec<u32> = (0..16).collect();
    tokens.extend([151_655; 32]);
    let image = 0x00ab_cdef_0123_4567u64;
    let info = |s, e| {
        Some(BlockExtraInfo {
            mm_objects: vec![BlockMmObjectInfo { mm_hash: image, offsets: vec![(s, e)] }],
        })
    };
    let infos = vec![None, info(0, 16), info(0, 16)];
    engine
        .submit(EngineRequest {
            id: "img".into(),
            tokens,
            block_mm_infos: Some(infos),
            max_tokens: 1,
            plan: plan(),
            cache_salt: None,
            lora: None,
            handoff: Handoff::None,
            in_store: Vec::new(),
            priority: 0,
        })
        .unwrap();
    let events = events(&run(&mut engine));
    let EngineEvent::BlockStored(stored) = &events[0] else { panic!("{events:?}") };
    let keys = stored.extra_keys.as_ref().unwrap();
    assert!(keys[0].is_none());
    let kvroute_wire::ExtraKey::Mm(id, _) = &keys[1].as_ref().unwrap()[0] else {
        panic!("{keys:?}")
    };
    assert_eq!(mm_hash_from_identifier(id), image);
}

#[test]
fn simulated_ttft_follows_the_timing_model() {
    let mut engine = Engine::new(config(1000));
    engine.submit(request("a", (0..1000).collect(), 3)).unwrap();
    let first = engine.step().unwrap();
    assert!(first.outputs.iter().any(|o| matches!(o, Output::FirstToken { .. })));
    let expected = Timing::default().prefill(1000);
    assert_eq!(first.duration, expected);
    assert!((engine.now().as_secs_f64() * 1e3 - 32.105).abs() < 0.01);
    // Two more tokens, each a decode step.
    let rest = run(&mut engine);
    assert_eq!(rest.len(), 2);
    assert!(
        rest.iter().all(|s| s.duration > Duration::ZERO && s.duration < Duration::from_millis(60))
    );
    // Chunked prefill: a budget of 512 tokens splits the 1,000 into two steps.
    let mut chunked = Engine::new(EngineConfig { max_batched_tokens: 512, ..config(1000) });
    chunked.submit(request("a", (0..1000).collect(), 1)).unwrap();
    let steps = run(&mut chunked);
    assert_eq!(steps[0].duration, Timing::default().prefill(512));
    assert!(steps[1].outputs.iter().any(|o| matches!(o, Output::FirstToken { .. })));
}

#[test]
fn oversized_empty_and_duplicate_requests_are_refused() {
    let mut engine = Engine::new(config(10));
    assert!(matches!(
        engine.submit(request("big", (0..1000).collect(), 1)),
        Err(EngineError::PromptTooLarge { .. })
    ));
    assert_eq!(engine.submit(request("e", vec![], 1)), Err(EngineError::EmptyPrompt));
    engine.submit(request("x", vec![1, 2, 3], 1)).unwrap();
    assert!(matches!(engine.submit(request("x", vec![1], 1)), Err(EngineError::DuplicateId(_))));
}

#[test]
fn cancelling_frees_blocks_and_full_caches_preempt() {
    let mut engine = Engine::new(config(8));
    engine.submit(request("long", (0..64).collect(), 1000)).unwrap();
    engine.step().unwrap();
    assert!(engine.kv_usage() > 0.0);
    assert!(engine.cancel("long"));
    assert!(!engine.cancel("long"));
    assert_eq!(engine.kv_usage(), 0.0, "a client that leaves leaves no blocks behind");
    // Two long generations in 8 blocks: one is preempted and still finishes later.
    engine.submit(request("a", (100..148).collect(), 40)).unwrap();
    engine.submit(request("b", (200..248).collect(), 40)).unwrap();
    let steps = run(&mut engine);
    assert!(engine.stats().preemptions > 0);
    assert_eq!(usage_of(&steps, "a").completion_tokens, 40);
    assert_eq!(usage_of(&steps, "b").completion_tokens, 40);
    for id in ["a", "b"] {
        let indexes: Vec<usize> = steps
            .iter()
            .flat_map(|s| &s.outputs)
            .filter_map(|o| match o {
                Output::Token { id: t, index, .. } if t == id => Some(*index),
                _ => None,
            })
            .collect();
        assert_eq!(
            indexes,
            (0..40).collect::<Vec<_>>(),
            "{id}: a preempted stream resumes, no repeats"
        );
    }
    assert_eq!(engine.kv_usage(), 0.0);
}

#[test]
fn reset_clears_an_idle_cache() {
    let mut engine = Engine::new(config(100));
    engine.submit(request("a", (0..64).collect(), 1)).unwrap();
    run(&mut engine);
    assert_eq!(engine.reset_prefix_cache(), vec![EngineEvent::AllBlocksCleared]);
    engine.submit(request("b", (0..64).collect(), 1)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "b").cached_tokens, 0);
}

#[test]
fn generated_blocks_are_cached_and_a_conversation_sent_back_hits_them() {
    let mut engine = Engine::new(config(100));
    let prompt: Vec<u32> = (0..20).collect();
    engine.submit(request("r1", prompt.clone(), 30)).unwrap();
    let steps = run(&mut engine);
    let answer = generated(&steps, "r1");
    assert_eq!(answer.len(), 30);
    assert_eq!((answer[0], answer[1..].iter().all(|t| [8, 9].contains(t))), (7, true));
    // 20 + 29 computed tokens (the last sampled token's KV never is): 3 full blocks stored,
    // two of them holding generated tokens.
    let stored: Vec<u64> = events(&steps)
        .iter()
        .flat_map(|e| match e {
            EngineEvent::BlockStored(s) => s.token_ids.clone(),
            _ => Vec::new(),
        })
        .collect();
    let mut conversation = prompt.clone();
    conversation.extend(&answer);
    let expect: Vec<u64> = conversation[..48].iter().map(|&t| u64::from(t)).collect();
    assert_eq!(stored, expect);
    // The next turn sends the conversation back, plus a new question.
    conversation.extend(500..520);
    engine.submit(request("r2", conversation, 1)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "r2").cached_tokens, 48);
    // The same answer for the same prompt, whatever the engine.
    let mut other = Engine::new(config(100));
    other.submit(request("again", prompt, 30)).unwrap();
    assert_eq!(generated(&run(&mut other), "again"), answer);
}

#[test]
fn a_fully_cached_prompt_recomputes_its_last_block() {
    let mut engine = Engine::new(config(100));
    let prompt: Vec<u32> = (0..64).collect();
    engine.submit(request("a", prompt.clone(), 1)).unwrap();
    run(&mut engine);
    engine.submit(request("b", prompt, 1)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "b").cached_tokens, 48, "3 of 4 blocks: vLLM's cap");
}

#[test]
fn admission_waits_for_memory_instead_of_preempting() {
    // 10 blocks: a 6-block request runs; a 6-block one waits until it finishes.
    let mut engine = Engine::new(config(10));
    engine.submit(request("a", (0..96).collect(), 3)).unwrap();
    engine.submit(request("b", (1000..1096).collect(), 3)).unwrap();
    let first = engine.step().unwrap();
    assert_eq!((engine.running(), engine.waiting()), (1, 1), "b does not fit next to a");
    assert!(first.outputs.iter().any(|o| matches!(o, Output::FirstToken { id, .. } if id == "a")));
    let rest = run(&mut engine);
    assert_eq!(engine.stats().preemptions, 0);
    assert_eq!(usage_of(&rest, "b").completion_tokens, 3);
}

#[test]
fn the_decode_step_prices_the_decoding_requests_logical_tokens() {
    // Two requests sharing a 512-token prefix decode together: the step reads both contexts
    // (Dynamo's mocker counts logical tokens, shared blocks once per request).
    let mut engine = Engine::new(config(100)); // 1,600 tokens of capacity
    let shared: Vec<u32> = (0..512).collect();
    for id in ["a", "b"] {
        engine.submit(request(id, shared.clone(), 5)).unwrap();
    }
    engine.step().unwrap(); // both prefills, first tokens from the prefill pass
    let decode = engine.step().unwrap();
    let p = 2.0 * 513.0 / 1600.0;
    assert_eq!(decode.duration, Timing::default().decode(p));
}

#[test]
fn preemption_takes_the_newest_running_request() {
    // 8 blocks; three requests of 2 blocks each generating long answers: the newest gives way.
    let mut engine = Engine::new(config(8));
    for (k, id) in ["old", "mid", "new"].iter().enumerate() {
        engine
            .submit(request(id, ((k as u32) * 100..(k as u32) * 100 + 32).collect(), 40))
            .unwrap();
    }
    let mut first_preempted = None;
    for _ in 0..200 {
        let before = engine.stats().preemptions;
        let Some(_) = engine.step() else { break };
        if engine.stats().preemptions > before && first_preempted.is_none() {
            first_preempted = engine.next_waiting().map(str::to_owned);
        }
    }
    assert_eq!(first_preempted.as_deref(), Some("new"));
}

/// `cache_salt` namespaces the cache: the same prompt under another salt shares nothing, the
/// same salt shares everything, and the events carry the salt, so the router's hashes (the
/// salt folded in) match the salted request's and not the plain one's.
#[test]
fn a_cache_salt_namespaces_blocks_and_their_events() {
    let mut engine = Engine::new(config(1000));
    let prompt: Vec<u32> = (2000..2064).collect();
    let salted = |id: &str, salt: &str| EngineRequest {
        cache_salt: Some(salt.to_owned()),
        ..request(id, prompt.clone(), 1)
    };
    engine.submit(salted("a", "key-a")).unwrap();
    let steps = run(&mut engine);
    engine.submit(salted("b", "key-b")).unwrap();
    engine.submit(request("plain", prompt.clone(), 1)).unwrap();
    let later = run(&mut engine);
    engine.submit(salted("a2", "key-a")).unwrap();
    let again = run(&mut engine);
    assert_eq!(usage_of(&later, "b").cached_tokens, 0, "another salt shares nothing");
    assert_eq!(usage_of(&later, "plain").cached_tokens, 0, "nor does no salt");
    assert_eq!(usage_of(&again, "a2").cached_tokens, 48, "the same salt shares its blocks");

    let index = indexed(&steps);
    let hasher = BlockHasher::new(BlockSize::new(16).unwrap());
    let w = WorkerWithDpRank::new(3u64, 0u32);
    let salted_hashes = hasher.with_namespace(Some("key-a")).local_hashes(&prompt, None);
    assert_eq!(index.find_matches(&salted_hashes).score(w), 4);
    assert_eq!(index.find_matches(&hasher.local_hashes(&prompt, None)).score(w), 0);
}

fn with_lora(id: &str, tokens: Vec<u32>, lora: &str) -> EngineRequest {
    EngineRequest { lora: Some(lora.to_owned()), ..request(id, tokens, 1) }
}

fn lora_config(max_loras: usize) -> EngineConfig {
    EngineConfig {
        lora: crate::lora::LoraConfig {
            max_loras,
            max_cpu_loras: max_loras,
            load: Duration::from_millis(100),
            swap: Duration::from_millis(4),
            step_cost: Duration::from_millis(1),
        },
        ..config(1000)
    }
}

/// An adapter salts its blocks (the same prompt under another adapter, or none, shares
/// nothing) and its events name it, as vLLM's do: the router's hashes with the adapter find
/// them, the base model's do not.
#[test]
fn an_adapter_salts_its_blocks_and_its_events_name_it() {
    let mut engine = Engine::new(lora_config(2));
    let prompt: Vec<u32> = (3000..3064).collect();
    engine.submit(with_lora("a", prompt.clone(), "sql")).unwrap();
    let steps = run(&mut engine);
    engine.submit(request("base", prompt.clone(), 1)).unwrap();
    engine.submit(with_lora("other", prompt.clone(), "chat")).unwrap();
    let later = run(&mut engine);
    engine.submit(with_lora("a2", prompt.clone(), "sql")).unwrap();
    let again = run(&mut engine);
    assert_eq!(usage_of(&later, "base").cached_tokens, 0, "the base model shares nothing");
    assert_eq!(usage_of(&later, "other").cached_tokens, 0, "nor does another adapter");
    assert_eq!(usage_of(&again, "a2").cached_tokens, 48, "the same adapter shares its blocks");

    let stored = steps.iter().flat_map(|s| &s.events).find_map(|e| match e {
        EngineEvent::BlockStored(s) => Some(s.clone()),
        _ => None,
    });
    let stored = stored.unwrap();
    assert_eq!((stored.lora_name.as_deref(), stored.lora_id), (Some("sql"), Some(1)));
    let keys = stored.extra_keys.unwrap();
    assert!(
        keys.iter()
            .all(|k| k.as_deref() == Some(&[kvroute_wire::ExtraKey::Text("sql".into())][..]))
    );
    let index = indexed(&steps);
    let w = WorkerWithDpRank::new(3u64, 0u32);
    let hasher = BlockHasher::new(BlockSize::new(16).unwrap());
    assert_eq!(
        index.find_matches(&hasher.with_lora(Some("sql")).local_hashes(&prompt, None)).score(w),
        4
    );
    assert_eq!(index.find_matches(&hasher.local_hashes(&prompt, None)).score(w), 0);
}

/// With every slot used by running requests, a request for one more adapter is passed over
/// and the requests behind it run (vLLM's scheduler skips it); it runs once a slot frees.
/// Loading an adapter holds up its step by the load time; a resident one costs nothing.
#[test]
fn a_full_set_of_slots_passes_over_a_new_adapter_and_loads_cost_time() {
    let mut engine = Engine::new(lora_config(1));
    let long = |id: &str, lora: &str, base: u32| EngineRequest {
        max_tokens: 5,
        ..with_lora(id, (base..base + 32).collect(), lora)
    };
    engine.submit(long("x1", "x", 0)).unwrap();
    let first = engine.step().unwrap();
    // The load (100 ms) is in the first step, beside its prefill.
    assert!(first.duration >= Duration::from_millis(100), "{:?}", first.duration);
    assert_eq!(engine.lora_stats().loads, 1);
    engine.submit(long("y1", "y", 100)).unwrap();
    engine.submit(long("x2", "x", 200)).unwrap();
    let next = engine.step().unwrap();
    // y1 is passed over (x holds the only slot), x2 behind it runs.
    assert!(next.outputs.iter().any(|o| matches!(o, Output::FirstToken { id, .. } if id == "x2")));
    assert_eq!(engine.next_waiting(), Some("y1"));
    assert!(next.duration < Duration::from_millis(100), "x is resident: {:?}", next.duration);
    let (running, waiting) = engine.adapter_requests();
    assert_eq!(running, [("x".to_owned(), 2)]);
    assert_eq!(waiting, [("y".to_owned(), 1)]);
    let rest = run(&mut engine);
    assert_eq!(usage_of(&rest, "y1").prompt_tokens, 32, "y runs once x's requests end");
    assert_eq!(engine.resident_adapters(), ["y"]);
    assert_eq!(engine.lora_stats(), crate::lora::LoraStats { loads: 2, swaps: 0, evictions: 1 });
}

/// An engine of 8 GPU blocks and 32 host blocks.
fn with_host() -> Engine {
    let host = HostConfig { num_blocks: 32, ..HostConfig::default() };
    Engine::new(EngineConfig { host, ..config(8) })
}

#[test]
fn a_prefix_evicted_from_the_gpu_is_loaded_back_from_host_memory() {
    let mut engine = with_host();
    let a: Vec<u32> = (0..80).collect(); // 5 blocks
    engine.submit(request("a1", a.clone(), 1)).unwrap();
    let first = run(&mut engine);
    // Another prompt fills the GPU cache: a's blocks are evicted there, not on the host.
    engine.submit(request("b", (1000..1096).collect(), 1)).unwrap();
    let evicting = run(&mut engine);
    engine.submit(request("a2", a, 1)).unwrap();
    let again = run(&mut engine);
    // All but the last block are served (the last token is computed): the GPU kept the
    // prefix's head (tails are evicted first), host memory gives the rest.
    assert_eq!(usage_of(&again, "a2").cached_tokens, 64);
    let stats = engine.stats();
    let block_bytes = 16 * 131_072;
    assert_eq!((stats.host_loaded_bytes, stats.host_hit_tokens), (2 * block_bytes, 32));
    assert_eq!(stats.host_blocks, 5 + 6, "a's blocks and b's, written through");
    // The load took its time: 2 blocks of 2 MiB at 32 GB/s, beside a 16-token prefill.
    let load = Duration::from_secs_f64(2.0 * 16.0 * 131_072.0 / 32e9);
    assert!(time_to_first(&again, "a2") > load, "{:?}", time_to_first(&again, "a2"));
    // The host blocks were announced with medium CPU, once each.
    let mediums = |steps: &[Step]| -> Vec<(String, usize)> {
        steps
            .iter()
            .flat_map(|s| &s.events)
            .filter_map(|e| match e {
                EngineEvent::BlockStored(s) => {
                    Some((s.medium.clone().unwrap_or_default(), s.block_hashes.len()))
                }
                _ => None,
            })
            .collect()
    };
    assert!(mediums(&first).contains(&("CPU".to_owned(), 5)), "{:?}", mediums(&first));
    assert!(mediums(&evicting).iter().any(|(m, _)| m == "CPU"));
    let stored_again = mediums(&again);
    assert!(stored_again.iter().all(|(m, _)| m == "GPU"), "{stored_again:?}");
}

#[test]
fn without_host_memory_nothing_is_offloaded() {
    let mut engine = Engine::new(config(8));
    engine.submit(request("a", (0..80).collect(), 1)).unwrap();
    let steps = run(&mut engine);
    let cpu = steps
        .iter()
        .flat_map(|s| &s.events)
        .any(|e| matches!(e, EngineEvent::BlockStored(s) if s.medium.as_deref() == Some("CPU")));
    assert!(!cpu);
    let stats = engine.stats();
    let host = (stats.host_hit_tokens, stats.host_loaded_bytes, stats.host_blocks);
    assert_eq!(host, (0, 0, 0));
}

/// A load from host memory runs beside the steps by default: a request decoding meanwhile
/// is not held up, and the loading request waits for its own load. With `--tier-loads sync`
/// the load is part of the step that admits it, which the decoding request waits for too.
#[test]
fn a_load_beside_the_steps_holds_up_only_its_own_request() {
    for loads in [crate::TierLoads::Async, crate::TierLoads::Sync] {
        let (mut engine, a) = loading_engine(loads);
        // c decodes while a2 loads what the GPU no longer holds of it from host memory.
        engine.submit(request("c", (3000..3016).collect(), 40)).unwrap();
        let mut steps: Vec<Step> = (0..3).filter_map(|_| engine.step()).collect();
        engine.submit(request("a2", a.clone(), 1)).unwrap();
        let from = steps.len();
        steps.extend(run(&mut engine));
        let after = &steps[from..];
        assert_eq!(usage_of(after, "a2").cached_tokens, 64, "{loads:?}");
        let blocks = engine.stats().host_hit_tokens as f64 / 16.0;
        assert!(blocks >= 2.0, "{loads:?}: {blocks}");
        let load = Duration::from_secs_f64(blocks * 16.0 * 64.0 * 1048576.0 / 32e9);
        assert!(time_to_first(after, "a2") > load, "{loads:?}");
        // The longest step c ran through while a2 loaded.
        let longest = after.iter().map(|s| s.duration).max().unwrap();
        match loads {
            crate::TierLoads::Async => assert!(longest < load / 2, "{longest:?}"),
            crate::TierLoads::Sync => assert!(longest > load, "{longest:?}"),
        }
        assert!(engine.is_idle() && engine.waiting() == 0);
    }
}

/// An engine with 64 MiB a token (a block loads in 34 ms) whose prompt `a` (5 blocks) is in
/// host memory and no longer on its GPU.
fn loading_engine(loads: crate::TierLoads) -> (Engine, Vec<u32>) {
    let mb = 1048576.0;
    let host =
        HostConfig { num_blocks: 32, kv_bytes_per_token: 64.0 * mb, loads, ..Default::default() };
    let mut engine = Engine::new(EngineConfig { host, ..config(8) });
    let a: Vec<u32> = (0..80).collect();
    engine.submit(request("a1", a.clone(), 1)).unwrap();
    run(&mut engine);
    engine.submit(request("b", (1000..1096).collect(), 1)).unwrap();
    run(&mut engine);
    (engine, a)
}

/// While the engine has only a load to wait for, a request that arrives is scheduled at once,
/// and one whose client leaves mid-load is gone without a trace.
#[test]
fn a_load_keeps_neither_new_requests_nor_cancelled_ones_waiting() {
    let (mut engine, a) = loading_engine(crate::TierLoads::Async);
    engine.submit(request("a2", a.clone(), 1)).unwrap();
    let wait = engine.step().unwrap();
    assert!(wait.outputs.is_empty() && wait.duration <= crate::loads::MAX_WAIT, "{wait:?}");
    assert_eq!((engine.waiting(), engine.running()), (1, 0), "a2 is loading");
    engine.submit(request("c", (3000..3016).collect(), 2)).unwrap();
    let next = engine.step().unwrap();
    let started =
        next.outputs.iter().any(|o| matches!(o, Output::FirstToken { id, .. } if id == "c"));
    assert!(started, "c is not kept behind a2's load: {next:?}");
    // a2's client leaves before its load is done: nothing of it stays.
    assert!(engine.cancel("a2"));
    assert!(!engine.cancel("a2"));
    let rest = run(&mut engine);
    assert!(rest.iter().flat_map(|s| &s.outputs).all(|o| !matches!(o,
        Output::FirstToken { id, .. } | Output::Token { id, .. } | Output::Finished { id, .. } if id == "a2")));
    assert!(engine.is_idle());
    assert_eq!((engine.waiting(), engine.kv_usage()), (0, 0.0));
    // Its id is free again, and the same prompt loads and runs.
    engine.submit(request("a2", a, 1)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "a2").cached_tokens, 64);
}

/// The GPU room a loading request needs is kept for it: a request that would take it waits
/// until the loading one is admitted.
#[test]
fn a_loading_request_keeps_its_room() {
    let (mut engine, a) = loading_engine(crate::TierLoads::Async);
    engine.submit(request("a2", a, 1)).unwrap(); // 5 blocks of the 8
    engine.step().unwrap();
    engine.submit(request("big", (5000..5064).collect(), 1)).unwrap(); // 4 blocks
    let steps = run(&mut engine);
    let first = |id: &str| {
        steps.iter().position(|s| {
            s.outputs.iter().any(|o| matches!(o, Output::FirstToken { id: t, .. } if t == id))
        })
    };
    let (a2, big) = (first("a2").unwrap(), first("big").unwrap());
    assert!(big > a2, "big waited for a2's room: a2 at step {a2}, big at {big}");
    assert_eq!(usage_of(&steps, "a2").cached_tokens, 64);
    assert!(engine.is_idle());
    assert_eq!(engine.kv_usage(), 0.0);
}

/// Storage below host memory (vLLM's tiering): every host block is cascaded to storage; a
/// prefix evicted from the GPU and from host memory is promoted back from storage, through
/// host memory, at the storage bandwidth plus the host copy.
#[test]
fn a_prefix_evicted_from_host_memory_is_promoted_back_from_storage() {
    let host = HostConfig { num_blocks: 6, storage_blocks: 64, ..HostConfig::default() };
    let mut engine = Engine::new(EngineConfig { host, ..config(8) });
    let a: Vec<u32> = (0..80).collect(); // 5 blocks
    engine.submit(request("a1", a.clone(), 1)).unwrap();
    let first = run(&mut engine);
    // Two other prompts push a's blocks out of the GPU cache and out of host memory.
    engine.submit(request("b", (1000..1096).collect(), 1)).unwrap();
    let evicting = run(&mut engine);
    engine.submit(request("c", (2000..2096).collect(), 1)).unwrap();
    let evicting = [evicting, run(&mut engine)].concat();
    let before = engine.stats();
    assert!(before.host_evicted_blocks > 0 && before.storage_evicted_blocks == 0, "{before:?}");
    engine.submit(request("a2", a, 1)).unwrap();
    let again = run(&mut engine);
    let stats = engine.stats();
    let served = usage_of(&again, "a2").cached_tokens;
    let from_gpu = served - (stats.host_hit_tokens + stats.storage_hit_tokens) as usize;
    assert_eq!(served, 64, "every block but the last, from one tier or another");
    assert!(stats.storage_hit_tokens > 0, "{stats:?}");
    assert_eq!(from_gpu % 16, 0);
    // Each promoted block took its storage read (10 GB/s) and its host copy (32 GB/s).
    let promoted = stats.storage_hit_tokens as f64 / 16.0;
    let load = Duration::from_secs_f64(promoted * 16.0 * 131_072.0 * (1.0 / 10e9 + 1.0 / 32e9));
    let took = time_to_first(&again, "a2");
    assert!(took > load, "{took:?} <= {load:?}");
    // Storage was announced as vLLM's secondary tier is, and its evictions from host memory
    // left it in storage: a's blocks were stored there once, with medium STORAGE.
    let stored = |steps: &[Step], medium: &str| -> usize {
        let events = steps.iter().flat_map(|s| &s.events);
        events
            .filter_map(|e| match e {
                EngineEvent::BlockStored(s) if s.medium.as_deref() == Some(medium) => {
                    Some(s.block_hashes.len())
                }
                _ => None,
            })
            .sum()
    };
    assert_eq!(stored(&first, "STORAGE"), 5);
    assert_eq!(stored(&evicting, "STORAGE"), 12, "b's and c's 6 blocks each");
    assert_eq!(stored(&again, "STORAGE"), 0, "nothing new: a's blocks were there");
    assert!(stored(&again, "CPU") > 0, "promoted through host memory, stored there again");
    assert_eq!(stats.storage_blocks, 5 + 12);
}

fn hybrid(num_blocks: usize, window: u32) -> Engine {
    Engine::new(EngineConfig { sliding_window: Some(window), ..config(num_blocks) })
}

/// A `BlockStored` event's group, its kind, its window and how many blocks it stores.
type GroupStored = (Option<u32>, Option<String>, Option<u32>, usize);

/// The `BlockStored` events' groups.
fn groups_stored(steps: &[Step]) -> Vec<GroupStored> {
    events(steps)
        .into_iter()
        .filter_map(|e| match e {
            EngineEvent::BlockStored(b) => Some((
                b.group_idx,
                b.kv_cache_spec_kind,
                b.kv_cache_spec_sliding_window,
                b.block_hashes.len(),
            )),
            _ => None,
        })
        .collect()
}

#[test]
fn a_hybrid_engine_caches_both_groups_and_names_them() {
    // Window 32 over 16-token blocks: a hit must end on 2 window blocks.
    let mut engine = hybrid(100, 32);
    let prompt: Vec<u32> = (0..128).collect();
    engine.submit(request("a", prompt.clone(), 1)).unwrap();
    let steps = run(&mut engine);
    let full = Some("full_attention".to_owned());
    let window = Some("sliding_window".to_owned());
    assert_eq!(
        groups_stored(&steps),
        vec![(Some(0), full, None, 8), (Some(1), window, Some(32), 8)]
    );
    // Nothing evicted yet: the same prompt hits its 7 blocks before the last token's.
    engine.submit(request("b", prompt, 1)).unwrap();
    assert_eq!(usage_of(&run(&mut engine), "b").cached_tokens, 112);
}

#[test]
fn window_blocks_behind_the_window_are_evicted_first_and_cut_the_hit() {
    // 24 blocks: a 10-block prompt takes 20 while computed, then gives back the 8 window
    // blocks behind its window (32 tokens: 2 blocks kept, plus the one being computed).
    let mut engine = hybrid(24, 32);
    let prompt: Vec<u32> = (0..160).collect();
    engine.submit(request("a", prompt.clone(), 40)).unwrap();
    let steps = run(&mut engine);
    // 13 blocks a group by the end: a fits only by giving window blocks back as it goes.
    assert_eq!(engine.stats().preemptions, 0);
    assert!(engine.stats().evicted_blocks > 0, "a evicted its own window blocks");
    // An unrelated prompt of 6 blocks needs 12: the 4 free and 8 evicted, window blocks
    // behind a's window first (they were given back while a decoded).
    engine.submit(request("x", (5000..5096).collect(), 1)).unwrap();
    let evicting = run(&mut engine);
    let removed: Vec<(Option<u32>, usize)> = events(&evicting)
        .into_iter()
        .filter_map(|e| match e {
            EngineEvent::BlockRemoved(r) => Some((r.group_idx, r.block_hashes.len())),
            _ => None,
        })
        .collect();
    assert_eq!(removed.first().map(|r| r.0), Some(Some(1)), "{removed:?}");
    // a again: the full group still holds its prefix, but the window group only a run
    // somewhere before it; the hit ends there, as the router predicts from the events.
    let mut all = steps;
    all.extend(evicting);
    let index = indexed_groups(&all);
    let local = BlockHasher::new(BlockSize::new(16).unwrap()).local_hashes(&prompt, None);
    let predicted = index.find_matches_within(&local, (prompt.len() - 1) / 16, 16);
    engine.submit(request("a2", prompt, 1)).unwrap();
    let served = usage_of(&run(&mut engine), "a2").cached_tokens;
    let full_prefix = index.find_matches(&local).score(WorkerWithDpRank::new(3u64, 0u32));
    assert!(served < full_prefix as usize * 16, "the window cut it: {served} of {full_prefix}");
    assert_eq!(predicted.score(WorkerWithDpRank::new(3u64, 0u32)) as usize * 16, served);
}

/// [`indexed`] into the router's sharded index, which scores hybrid models' groups.
fn indexed_groups(steps: &[Step]) -> kvroute_core::index::ShardedIndex {
    let index = kvroute_core::index::ShardedIndex::new(1, Default::default());
    let mut converter = Converter::new(ConvertConfig::new(BlockSize::new(16).unwrap()));
    for (seq, step) in steps.iter().enumerate() {
        let bytes =
            encode_batch(&KvEventBatch { ts: 0.0, events: step.events.clone(), dp_rank: Some(0) });
        for event in converter.vllm_batch(&decode_batch(&bytes).unwrap(), seq as u64) {
            index.apply_event(&RouterEvent::new(3u64, event)).unwrap();
        }
    }
    index
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// Conversations on a small hybrid engine, one request at a time: what the router
    /// predicts from the engine's events (wire bytes included) is what the engine serves.
    #[test]
    fn a_hybrid_engine_serves_what_its_events_predict(
        turns in proptest::collection::vec((0u32..4, 1usize..60, 1usize..24), 1..40),
        window in 17u32..80,
        blocks in 30usize..70,
    ) {
        let mut engine = hybrid(blocks, window);
        let index = kvroute_core::index::ShardedIndex::new(1, Default::default());
        let mut converter = Converter::new(ConvertConfig::new(BlockSize::new(16).unwrap()));
        let hasher = BlockHasher::new(BlockSize::new(16).unwrap());
        let mut conversations: Vec<Vec<u32>> = (0..4).map(|c| vec![9000 + c; 20]).collect();
        let mut seq = 0u64;
        for (n, (c, user, answer)) in turns.into_iter().enumerate() {
            let prompt = &mut conversations[c as usize];
            prompt.extend((0..user as u32).map(|t| 100 + t * 7 + n as u32));
            if prompt.len().div_ceil(16) * 2 + 2 > blocks {
                prompt.truncate(20);
            }
            let local = hasher.local_hashes(prompt, None);
            let predicted = index
                .find_matches_within(&local, (prompt.len() - 1) / 16, 16)
                .score(WorkerWithDpRank::new(3u64, 0u32)) as usize;
            let id = format!("r{n}");
            engine.submit(request(&id, prompt.clone(), answer)).unwrap();
            let steps = run(&mut engine);
            let served = usage_of(&steps, &id).cached_tokens;
            proptest::prop_assert_eq!(predicted * 16, served, "turn {} of conversation {}", n, c);
            prompt.extend(generated(&steps, &id));
            for step in &steps {
                let batch = KvEventBatch { ts: 0.0, events: step.events.clone(), dp_rank: Some(0) };
                let bytes = encode_batch(&batch);
                for event in converter.vllm_batch(&decode_batch(&bytes).unwrap(), seq) {
                    index.apply_event(&RouterEvent::new(3u64, event)).unwrap();
                }
                seq += 1;
            }
        }
    }
}

/// The shared store (`crate::store`): what one engine computes, another loads at the store's
/// bandwidth; each announces its writes with locality `REMOTE` once the store has answered,
/// and the evictions of its blocks in the order the store made them.
#[test]
fn a_prefix_one_engine_computed_is_loaded_by_another_through_the_store() {
    use crate::store::{Acked, Store};
    let mut store = Store::new(6);
    let ack = |engine: &mut Engine, owner: &str, store: &mut Store| -> Vec<EngineEvent> {
        let mut events = Vec::new();
        for put in engine.take_store_puts() {
            let answer = store.put(owner, &put.blocks).unwrap();
            events.extend(engine.store_acked(Acked { put: Some(put.id), answer: Some(answer) }));
        }
        events
    };
    let (mut a, mut b) = (Engine::new(config(64)), Engine::new(config(64)));
    a.attach_store();
    b.attach_store();
    let prompt: Vec<u32> = (0..80).collect(); // 5 blocks
    a.submit(request("a", prompt.clone(), 1)).unwrap();
    run(&mut a);
    let events = ack(&mut a, "a", &mut store);
    let [EngineEvent::BlockStored(s)] = &events[..] else { panic!("{events:?}") };
    assert_eq!((s.block_hashes.len(), s.parent_block_hash), (5, None));
    assert_eq!((s.medium.as_deref(), s.locality.as_deref()), (Some("CPU"), Some("REMOTE")));
    assert_eq!(s.token_ids.len(), 80, "one event for the run, tokens and all");

    // B asks the store before queueing the prompt, and loads 4 blocks instead of computing
    // them (the last token's block is computed).
    let mut req = request("b", prompt, 1);
    let hashes: Vec<u64> =
        req.prompt_hashes(BlockSize::new(16).unwrap()).iter().map(|h| h.0).collect();
    assert_eq!(hashes, s.block_hashes, "both engines hash as the store keys");
    req.in_store = store.lookup(&hashes).unwrap();
    b.submit(req).unwrap();
    let steps = run(&mut b);
    assert_eq!(usage_of(&steps, "b").cached_tokens, 64);
    let stats = b.stats();
    assert_eq!((stats.store_hit_tokens, stats.store_loaded_bytes), (64, 4 * 16 * 131_072));
    let load = Duration::from_secs_f64(4.0 * 16.0 * 131_072.0 / 12.5e9);
    assert!(time_to_first(&steps, "b") > load, "{:?}", time_to_first(&steps, "b"));
    // B computed the fifth block itself: it writes it too, and announces only what it wrote.
    let events = ack(&mut b, "b", &mut store);
    let [EngineEvent::BlockStored(s)] = &events[..] else { panic!("{events:?}") };
    assert_eq!((s.block_hashes.clone(), s.parent_block_hash), (vec![hashes[4]], Some(hashes[3])));

    // A's next prompt (6 blocks) fills the store: the least recent blocks make room, B's
    // write of the tail having made it the most recent, and A announces their removal after
    // its new blocks.
    a.submit(request("c", (1000..1096).collect(), 1)).unwrap();
    run(&mut a);
    let events = ack(&mut a, "a", &mut store);
    let [EngineEvent::BlockStored(s), EngineEvent::BlockRemoved(r)] = &events[..] else {
        panic!("{events:?}")
    };
    assert_eq!(s.block_hashes.len(), 6);
    let order = [hashes[3], hashes[2], hashes[1], hashes[0], hashes[4]];
    assert_eq!(r.block_hashes, order, "least recently used first");
    assert_eq!(r.locality.as_deref(), Some("REMOTE"));
    // B wrote that block too: it hears of it at its next call.
    let answer = store.put("b", &[]).unwrap();
    let events = b.store_acked(Acked { put: None, answer: Some(answer) });
    let [EngineEvent::BlockRemoved(r)] = &events[..] else { panic!("{events:?}") };
    assert_eq!(r.block_hashes, [hashes[4]]);
    // A put the store did not answer is not announced.
    a.submit(request("d", (2000..2048).collect(), 1)).unwrap();
    run(&mut a);
    let put = a.take_store_puts().pop().unwrap();
    assert!(a.store_acked(Acked { put: Some(put.id), answer: None }).is_empty());
}
