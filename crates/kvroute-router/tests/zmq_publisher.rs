//! A real publisher process — Python with pyzmq + msgspec, writing vLLM-shaped batches in the
//! map and the array form over TCP on 127.0.0.1 — feeds a running router; its HTTP API must
//! then reflect exactly those blocks. A deliberately skipped sequence number must be recovered
//! through the publisher's replay socket.
//!
//! Needs `python3 -m pip install pyzmq msgspec` (.ci/run installs them).

#![allow(clippy::unwrap_used)]

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::hash::mm_hash_from_identifier;
use kvroute_core::{
    BlockHasher, BlockSize, LocalBlockHash, RequestExtraInfo, RequestMmObjectInfo, sequence_hashes,
};
use kvroute_router::{RouterConfig, RouterState, WorkerSpec};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// The repository's `.venv` Python (where scripts/test installs pyzmq and msgspec), so this
/// file runs alone with cargo's own command; else `python3` on PATH.
fn python() -> std::path::PathBuf {
    let venv = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python3");
    if venv.is_file() { venv } else { "python3".into() }
}

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: tokio::io::Lines<BufReader<ChildStdout>>,
}

impl Publisher {
    async fn start() -> (Self, Value) {
        let script = format!("{}/tests/vllm_publisher.py", env!("CARGO_MANIFEST_DIR"));
        let mut child = Command::new(python())
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 must be installed");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(30), stdout.next_line())
            .await
            .unwrap()
            .unwrap();
        let Some(first) = first else {
            panic!(
                "the publisher exited: `python3 -m pip install pyzmq msgspec` is needed for this test"
            )
        };
        (Self { child, stdin, stdout }, serde_json::from_str(&first).unwrap())
    }

    async fn send(&mut self, cmd: Value) {
        self.stdin.write_all(format!("{cmd}\n").as_bytes()).await.unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(10), self.stdout.next_line())
            .await
            .unwrap()
            .unwrap();
        assert!(reply.is_some_and(|r| r.contains("ok")), "publisher did not confirm {cmd}");
    }

    async fn publish(&mut self, seq: u64, form: &str, events: Value, skip: bool) {
        self.send(
            json!({"op": "publish", "seq": seq, "form": form, "events": events, "skip": skip}),
        )
        .await;
    }
}

/// `POST path` on the router's real socket, through the workspace's HTTP client.
async fn post(addr: std::net::SocketAddr, path: &str, body: &Value) -> Value {
    let client = kvroute_http::HttpClient::new();
    client.post_json(&format!("http://{addr}{path}"), body).await.unwrap_or(Value::Null)
}

const BS: usize = 16;

/// Blocks 0-3 text, 4-5 an image (publisher form identifier), 6-7 text, 8-9 text.
fn tokens() -> Vec<u32> {
    let mut t: Vec<u32> = (0..64).map(|i| i + 100).collect();
    t.extend([151_655; 32]);
    t.extend((0..64).map(|i| i + 9000));
    t
}

const IMAGE_ID: &str = "00000000000abcde";

fn local_hashes() -> Vec<LocalBlockHash> {
    let tokens = tokens();
    let image = RequestExtraInfo {
        mm_objects: vec![RequestMmObjectInfo {
            mm_hash: mm_hash_from_identifier(IMAGE_ID),
            offsets: vec![(64, 96)],
        }],
    };
    let bs = BlockSize::new(BS as u32).unwrap();
    BlockHasher::new(bs).local_hashes(&tokens, Some(&image.to_block_level(bs, tokens.len())))
}

/// The engine's names for blocks `range` (vLLM-like: distinct 64-bit values).
fn engine_hashes(range: std::ops::Range<usize>) -> Vec<u64> {
    let seq = sequence_hashes(&local_hashes());
    range.map(|i| seq[i].0 ^ 0x5555_0000_0000_0000).collect()
}

fn stored(range: std::ops::Range<usize>, parent: Option<u64>, image: bool) -> Value {
    let t = tokens();
    let extra = image.then(|| range.clone().map(|_| json!([[IMAGE_ID, 0]])).collect::<Vec<_>>());
    json!({"type": "BlockStored", "block_hashes": engine_hashes(range.clone()), "parent_block_hash": parent,
           "token_ids": &t[range.start * BS..range.end * BS], "block_size": BS, "extra_keys": extra})
}

async fn overlap_becomes(addr: std::net::SocketAddr, want: u64) {
    let query = json!({"local_hashes": local_hashes().iter().map(|l| l.0).collect::<Vec<_>>(), "num_tokens": tokens().len()});
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = Value::Null;
    while Instant::now() < deadline {
        last = post(addr, "/find_best_worker", &query).await;
        if last["overlap_blocks"].as_u64() == Some(want) {
            assert_eq!(last["worker_id"].as_u64(), Some(1));
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("overlap never became {want}: last answer {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_publisher_feeds_the_router_and_gaps_are_replayed() {
    let (mut publisher, endpoints) = Publisher::start().await;
    let mut spec = WorkerSpec::new(1);
    spec.events = Some(endpoints["events"].as_str().unwrap().to_owned());
    spec.replay = Some(endpoints["replay"].as_str().unwrap().to_owned());
    let state =
        Arc::new(RouterState::new(RouterConfig { workers: vec![spec], ..RouterConfig::default() }));
    let _tasks = kvroute_router::spawn_background(&state).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(kvroute_router::serve(listener, Arc::clone(&state), std::future::pending()));

    let h = |i: usize| engine_hashes(i..i + 1)[0];
    // Map form, then the array form with an image block (multimodal extra keys). If the
    // subscription is not up yet, the first batch is recovered by replay on first contact.
    publisher.publish(0, "map", json!([stored(0..4, None, false)]), false).await;
    publisher.publish(1, "array", json!([stored(4..6, Some(h(3)), true)]), false).await;
    overlap_becomes(addr, 6).await;

    // Sequence 2 is never sent: the router sees 3 after 1 and must replay 2.
    publisher.publish(2, "map", json!([stored(6..8, Some(h(5)), false)]), true).await;
    publisher.publish(3, "array", json!([stored(8..10, Some(h(7)), false)]), false).await;
    overlap_becomes(addr, 10).await;
    let metrics = state.view().render_metrics();
    assert!(metrics.contains("kvroute_router_event_gaps_total 1"), "{metrics}");
    assert!(metrics.contains("kvroute_router_replayed_batches_total"), "{metrics}");

    // Removals, in both forms, then a clear.
    publisher
        .publish(4, "array", json!([{"type": "BlockRemoved", "block_hashes": [h(9), h(8)]}]), false)
        .await;
    overlap_becomes(addr, 8).await;
    publisher
        .publish(5, "map", json!([{"type": "BlockRemoved", "block_hashes": [h(5)]}]), false)
        .await;
    overlap_becomes(addr, 5).await;
    publisher.publish(6, "map", json!([{"type": "AllBlocksCleared"}]), false).await;
    overlap_becomes(addr, 0).await;
    assert_eq!(
        state.view().index_stats().blocks,
        0,
        "removed and cleared blocks leave nothing behind"
    );

    // Garbage is counted and skipped; the stream goes on.
    for frames in [
        json!(["6b762d6576656e7473", "0000000000000007", "c1c1c1"]),
        json!(["00"]),
        json!(["", "01", "93"]),
    ] {
        publisher.send(json!({"op": "raw", "frames": frames})).await;
    }
    publisher.publish(7, "map", json!([stored(0..4, None, false)]), false).await;
    overlap_becomes(addr, 4).await;
    assert!(!state.view().render_metrics().contains("kvroute_router_undecodable_messages_total 0"));

    // The engine restarts: its sequence starts again at 0 and its old blocks are gone.
    publisher.publish(0, "map", json!([stored(0..2, None, false)]), false).await;
    overlap_becomes(addr, 2).await;
    assert!(state.view().render_metrics().contains("kvroute_router_publisher_restarts_total 1"));

    publisher.send_quit().await;
    let _ = publisher.child.wait().await;
}

impl Publisher {
    async fn send_quit(&mut self) {
        let _ = self.stdin.write_all(b"{\"op\": \"quit\"}\n").await;
    }
}
