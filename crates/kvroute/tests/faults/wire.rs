//! The wire under attack: every ZMQ port of `kvroute mocker`, `kvroute serve` and (as the
//! publishers it subscribes to) `kvroute router` gets the 73-byte packet that announces a
//! 1 TiB frame, and a 400 MiB message after a valid handshake. Each process keeps serving,
//! counts each refusal, and its peak RSS stays within twice its idle RSS.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{Process, start, word_after};
use crate::common::kvroute;

/// A ZMTP 3.0 greeting with the NULL mechanism, as the issue's reproduction sends it.
fn greeting() -> Vec<u8> {
    let mut g = vec![0xff];
    g.extend([0; 8]);
    g.extend(b"\x7f\x03\x00NULL");
    g.extend([0; 48]);
    g
}

/// The 73 bytes: a greeting, then a command frame that announces 2^40 bytes.
fn packet_73() -> Vec<u8> {
    let mut p = greeting();
    p.push(0x06);
    p.extend((1u64 << 40).to_be_bytes());
    assert_eq!(p.len(), 73);
    p
}

/// A greeting and READY (as `socket_type`), then the frames of `[topic, seq, 400 MiB]`
/// up to the third frame's header.
fn handshake_and_header(socket_type: &str) -> Vec<u8> {
    let mut p = greeting();
    let mut ready = b"\x05READY".to_vec();
    ready.push(11);
    ready.extend(b"Socket-Type");
    ready.extend((socket_type.len() as u32).to_be_bytes());
    ready.extend(socket_type.as_bytes());
    p.push(0x04);
    p.push(ready.len() as u8);
    p.extend(ready);
    p.extend([0x01, 0x00]); // topic "", more
    p.extend([0x01, 0x08]);
    p.extend(7u64.to_be_bytes()); // seq, more
    p.push(0x02);
    p.extend((400u64 << 20).to_be_bytes());
    p
}

/// Sends the 400 MiB message: the header, then the body in 1 MiB writes until the peer
/// drops the connection (it should, at the header) or all of it is sent.
fn send_400mb(mut s: TcpStream, socket_type: &str) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
    if s.write_all(&handshake_and_header(socket_type)).is_err() {
        return;
    }
    let chunk = vec![0u8; 1 << 20];
    for _ in 0..400 {
        if s.write_all(&chunk).is_err() {
            return;
        }
    }
}

fn send_73(mut s: TcpStream) {
    let _ = s.write_all(&packet_73());
    // Held open a moment, as the reproduction does, then dropped.
    let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
    let _ = s.read(&mut [0u8; 256]);
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// Attacks a listening ZMQ port both ways; `peer` is the socket type a legitimate client
/// of it has.
fn attack(endpoint: &str, peer: &str) {
    let addr = ("127.0.0.1", port_of(endpoint));
    send_73(TcpStream::connect(addr).unwrap());
    send_400mb(TcpStream::connect(addr).unwrap(), peer);
}

/// A plain HTTP/1.1 GET on loopback: status and body.
fn get(base: &str, path: &str) -> (u16, String) {
    let host = base.trim_start_matches("http://");
    get_on(TcpStream::connect(host).unwrap(), base, path)
}

fn post(base: &str, path: &str, body: &str) -> (u16, String) {
    post_with(base, path, body, "")
}

/// A POST with `Authorization: Bearer <key>` unless `key` is empty.
fn post_with(base: &str, path: &str, body: &str, key: &str) -> (u16, String) {
    let host = base.trim_start_matches("http://");
    let mut s = TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let auth =
        if key.is_empty() { String::new() } else { format!("Authorization: Bearer {key}\r\n") };
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// A two-token chat at `base` answers 200.
fn assert_chat_answers(base: &str) {
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let (status, body) = post(base, "/v1/chat/completions", chat);
    assert_eq!(status, 200, "{body}");
}

/// The sum of a Prometheus counter's samples whose line contains `filter`.
fn counter(metrics: &str, name: &str, filter: &str) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l.contains(filter))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

struct Memory {
    pid: u32,
    idle: u64,
}

fn status_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

impl Memory {
    /// The idle RSS now, and the peak reset to it (`/proc/PID/clear_refs`).
    fn idle(p: &Process) -> Self {
        let pid = p.child.id();
        let idle = status_kib(pid, "VmRSS:");
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
        Self { pid, idle }
    }

    /// The peak since [`Memory::idle`] is within twice the idle RSS.
    fn assert_within_twice_idle(&self, what: &str) {
        let peak = status_kib(self.pid, "VmHWM:");
        eprintln!("{what}: idle RSS {} KiB, peak after the attacks {peak} KiB", self.idle);
        assert!(
            peak <= 2 * self.idle,
            "{what}: peak RSS {peak} KiB above twice idle {}",
            self.idle
        );
    }
}

fn alive(p: &mut Process, what: &str) {
    assert!(p.child.try_wait().unwrap().is_none(), "{what} died");
}

/// Waits (bounded) until `check` holds.
fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_mocker_refuses_oversized_zmq_messages_on_every_port_and_keeps_serving() {
    let mut p = start(kvroute().args(["mocker", "--port", "0"])).expect("the mocker starts");
    let url = word_after(&p.line, "listening on ").to_owned();
    let ports = [("events ", "SUB"), ("replay ", "DEALER"), ("load ", "SUB")];
    let memory = Memory::idle(&p);
    for (key, peer) in ports {
        attack(word_after(&p.line, key), peer);
    }
    alive(&mut p, "the mocker");
    eventually("every attack counted", || {
        counter(&get(&url, "/metrics").1, "kvroute_mocker_zmq_refused_messages_total", "") >= 6
    });
    assert_chat_answers(&url);
    memory.assert_within_twice_idle("kvroute mocker");
}

#[test]
fn serve_refuses_oversized_zmq_messages_to_its_workers_and_keeps_serving() {
    let mut p = start(kvroute().args(["serve", "--port", "0", "--simulated-workers", "2"]))
        .expect("serve starts");
    let base = word_after(&p.line, "ready on ").to_owned();
    let (status, workers) = get(&base, "/workers");
    assert_eq!(status, 200, "{workers}");
    let workers: Value = serde_json::from_str(&workers).unwrap();
    let workers = workers.as_array().or(workers["workers"].as_array()).unwrap().clone();
    assert_eq!(workers.len(), 2);
    // Their HTTP routes answer only the front door (an unguessable token), /health aside.
    for w in &workers {
        let url = w["url"].as_str().unwrap();
        for path in ["/stats", "/metrics", "/v1/models"] {
            assert_eq!(get(url, path).0, 401, "{url}{path} without the token");
        }
        for path in ["/v1/chat/completions", "/detokenize", "/tokenize", "/v1/completions"] {
            assert_eq!(post(url, path, "{}").0, 401, "{url}{path} without the token");
        }
        assert_eq!(get(url, "/health").0, 200);
    }
    let memory = Memory::idle(&p);
    let mut attacks = 0;
    for w in &workers {
        for (key, peer) in [("events", "SUB"), ("replay", "DEALER"), ("metrics", "SUB")] {
            attack(w[key].as_str().unwrap(), peer);
            attacks += 2;
        }
    }
    alive(&mut p, "kvroute serve");
    eventually("every attack counted", || {
        let metrics = get(&base, "/metrics").1;
        counter(&metrics, "kvroute_zmq_refused_messages_total", "socket=\"publisher\"") >= attacks
    });
    assert_chat_answers(&base);
    memory.assert_within_twice_idle("kvroute serve");
}

/// A publisher that answers every connection with `attack`, for a bounded number of them.
fn hostile_publisher(attack: fn(TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming().take(50).flatten() {
            std::thread::spawn(move || attack(stream));
        }
    });
    endpoint
}

#[test]
fn a_router_survives_publishers_that_announce_oversized_messages() {
    // Worker 1's events and load reports come from hostile publishers; worker 2 is a real
    // engine whose replay endpoint is hostile.
    let engine = start(kvroute().args(["mocker", "--port", "0"])).expect("the mocker starts");
    let events_73 = hostile_publisher(send_73);
    let load_400 = hostile_publisher(|s| send_400mb(s, "PUB"));
    let replay_400 = hostile_publisher(|s| send_400mb(s, "ROUTER"));
    let w1 = format!("id=1,events={events_73},metrics={load_400}");
    let w2 = format!(
        "id=2,url={},events={},replay={replay_400}",
        word_after(&engine.line, "listening on "),
        word_after(&engine.line, "events ")
    );
    let mut p = start(kvroute().args(["router", "--port", "0", "--worker", &w1, "--worker", &w2]))
        .expect("the router starts");
    let base = word_after(&p.line, "listening on ").to_owned();
    let memory = Memory::idle(&p);
    eventually("each hostile socket refused and counted", || {
        let metrics = get(&base, "/metrics").1;
        ["events", "load", "replay"].iter().all(|socket| {
            counter(&metrics, "kvroute_zmq_refused_messages_total", &format!("socket=\"{socket}\""))
                >= 1
        })
    });
    alive(&mut p, "kvroute router");
    assert_eq!(get(&base, "/health").0, 200);
    let (status, body) =
        post(&base, "/find_best_worker", r#"{"local_hashes":[1,2,3],"num_tokens":48}"#);
    assert_eq!(status, 200, "{body}");
    memory.assert_within_twice_idle("kvroute router");
}

/// `kvroute mocker --api-key` guards every route but `/health`, as vLLM's `--api-key` does.
#[test]
fn a_mocker_with_an_api_key_answers_only_with_it() {
    let p = start(kvroute().args(["mocker", "--port", "0", "--api-key", "sk-mocker-0123456789"]))
        .expect("the mocker starts");
    let url = word_after(&p.line, "listening on ").to_owned();
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    assert_eq!(post(&url, "/v1/chat/completions", chat).0, 401);
    assert_eq!(post(&url, "/detokenize", r#"{"tokens":[1,2]}"#).0, 401);
    assert_eq!(get(&url, "/stats").0, 401);
    assert_eq!(get(&url, "/health").0, 200);
    let (status, body) = post_with(&url, "/v1/chat/completions", chat, "sk-mocker-0123456789");
    assert_eq!(status, 200, "{body}");
}

/// One client holding 4,200 half-sent requests (more than the listener's 4,096 connections)
/// does not shut another client out: past its share its connections are closed as they come,
/// and `/health` from another loopback address answers while they are held (it once waited
/// ~8 s in every 10). The bound here is loose (2 s, a shared machine); `scripts/hostile`
/// measures the figure (< 100 ms) on a release build.
#[test]
fn one_client_holding_half_sent_requests_leaves_room_for_others() {
    let p = start(kvroute().args(["serve", "--port", "0", "--simulated-workers", "1"]))
        .expect("serve starts");
    let base = word_after(&p.line, "ready on ").to_owned();
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    let mut held = Vec::new();
    for _ in 0..4200 {
        let Ok(mut s) = TcpStream::connect(addr) else { continue };
        if s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").is_ok() {
            held.push(s);
        }
    }
    assert!(held.len() > 4096, "the client could not open its connections: {}", held.len());
    for _ in 0..5 {
        let start = Instant::now();
        let socket = connect_from("127.0.0.2", addr);
        let (status, _) = get_on(socket, &base, "/health");
        assert_eq!(status, 200);
        assert!(start.elapsed() < Duration::from_secs(2), "/health took {:?}", start.elapsed());
    }
    drop(held);
}

/// A connection from another loopback address (another client to the server).
fn connect_from(source: &str, addr: std::net::SocketAddr) -> TcpStream {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let stream = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        socket.connect(addr).await.unwrap().into_std().unwrap()
    });
    stream.set_nonblocking(false).unwrap();
    stream
}

fn get_on(mut s: TcpStream, base: &str, path: &str) -> (u16, String) {
    let host = base.trim_start_matches("http://");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}
