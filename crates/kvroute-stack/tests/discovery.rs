//! Members found by DNS, from a real DNS server on loopback (Debian's `dnsmasq`, serving a
//! hosts file the test rewrites: `kvroute_bench::fixtures::dns_server`), in front of simulated engines
//! each on an address of its own in 127.0.0.0/8; and by a NATS key-value bucket on a real
//! `nats-server` (docs/membership.md).

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use kvroute_bench::fixtures::dns_server::{DnsServer, DnsServerError};
use kvroute_http::HttpClient;
use kvroute_mocker::{EngineConfig, Timing};
use kvroute_router::members::{
    DnsConfig, DnsSource, MAX_MEMBERS_PER_SOURCE, Template, spawn_source,
};
use kvroute_router::{RouterConfig, RouterState};
use kvroute_stack::addressed::Ports;
use kvroute_stack::{Simulated, Stack, StackConfig};
use serde_json::json;

use common::eventually;

mod tempdir {
    /// A directory of the test's own under the system's temporary one, removed when dropped.
    pub(super) struct Dir(pub(super) std::path::PathBuf);

    impl Dir {
        pub(super) fn new(tag: &str) -> Self {
            let path = std::env::temp_dir().join(format!("kvroute-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A `dnsmasq` authoritative for `kvroute.test`; `None` (the test says why and passes) when it
/// is not installed: `scripts/test` installs it (Debian's dnsmasq-base).
fn dns_server() -> Option<DnsServer> {
    match DnsServer::start("kvroute.test", &[]) {
        Ok(dns) => Some(dns),
        Err(DnsServerError::Missing) => {
            eprintln!("dnsmasq is not installed (Debian's dnsmasq-base): the DNS test is skipped");
            None
        }
        Err(err) => panic!("{err}"),
    }
}

/// A simulated engine on `ip`, on `ports` (the first one's ports chosen free, then shared).
async fn engine_at(ip: IpAddr, ports: Option<Ports>) -> (kvroute_mocker::Spawned, Ports) {
    let engine = EngineConfig { timing: Timing { speedup: 100.0 }, ..EngineConfig::default() };
    let (spawned, _, ports) = kvroute_stack::addressed::engine_at(ip, ports, engine).await.unwrap();
    (spawned, ports)
}

fn template(p: Ports) -> Template {
    p.template().unwrap()
}

/// A stack over no configured worker, its front door served, its members `dns` answers for
/// `name` (resolved every `every`).
async fn dns_fleet(
    dns: &DnsServer,
    name: &str,
    every: Duration,
    ports: Ports,
) -> (Stack, String, Arc<RouterState>, tokio::task::JoinHandle<()>) {
    let config = StackConfig {
        simulated: Simulated { count: 0, ..Simulated::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    let base = stack.serve_frontend_on_loopback().await.unwrap();
    let router = Arc::clone(stack.router.as_ref().unwrap());
    let config =
        DnsConfig { name: name.into(), server: Some(dns.at), every, template: template(ports) };
    let source = DnsSource::new(config).unwrap();
    let task = spawn_source(&router, Box::new(source), Duration::from_secs(5));
    (stack, base, router, task)
}

fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 9, last])
}

fn members(router: &RouterState) -> Vec<String> {
    let mut urls: Vec<String> = router
        .view()
        .workers()
        .iter()
        .filter(|w| !w.draining)
        .filter_map(|w| w.url.clone())
        .collect();
    urls.sort();
    urls
}

fn ready_count(router: &RouterState) -> usize {
    router.view().workers().iter().filter(|w| !w.draining && w.ready.iter().all(|r| *r)).count()
}

async fn chat(base: &str, k: usize) -> u16 {
    let body = json!({"messages": [{"role": "user", "content": format!("{k} question of its own")}], "max_tokens": 2});
    let response = HttpClient::new()
        .call(hyper::Method::POST, &format!("{base}/v1/chat/completions"), Some(&body))
        .await
        .unwrap();
    let status = response.status().as_u16();
    let _ = response.into_body().collect().await;
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_join_and_leave_as_the_name_resolves() {
    let Some(dns) = dns_server() else { return };
    let (first, ports) = engine_at(ip(1), None).await;
    let (_second, _) = engine_at(ip(2), Some(ports)).await;
    let (_third, _) = engine_at(ip(3), Some(ports)).await;
    let name = "engines.kvroute.test";
    dns.publish(&[(ip(1), name), (ip(2), name)]).unwrap();

    let (_stack, base, router, _source) =
        dns_fleet(&dns, name, Duration::from_millis(200), ports).await;

    assert!(
        eventually(Duration::from_secs(10), || ready_count(&router) == 2).await,
        "{:?}",
        router.view().workers()
    );
    assert_eq!(
        members(&router),
        [format!("http://{}:{}", ip(1), ports.http), format!("http://{}:{}", ip(2), ports.http)]
    );
    assert!(router.view().workers().iter().all(|w| w.source == "dns"));
    for k in 0..5 {
        assert_eq!(chat(&base, k).await, 200);
    }
    // Scale out, then in: the name answers a third address, then loses the first.
    dns.publish(&[(ip(1), name), (ip(2), name), (ip(3), name)]).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || ready_count(&router) == 3).await,
        "{:?}",
        router.view().workers()
    );
    dns.publish(&[(ip(2), name), (ip(3), name)]).unwrap();
    let gone = kvroute_router::members::id_for(&first.url);
    assert!(
        eventually(Duration::from_secs(10), || !router.view().knows_worker(gone)).await,
        "the first drained and left"
    );
    for k in 5..10 {
        assert_eq!(chat(&base, k).await, 200);
    }
    assert_eq!(ready_count(&router), 2);
    // No records at all: an empty fleet, every member drains.
    dns.publish(&[]).unwrap();
    assert!(eventually(Duration::from_secs(10), || router.view().workers().is_empty()).await);
}

/// As many as one DNS answer over TCP holds (64 KiB); the sink's own bound is tested with
/// ten thousand in `kvroute_router::members`.
const ADDRESSES: u32 = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_of_many_addresses_is_cut_to_the_bound() {
    let Some(dns) = dns_server() else { return };
    let name = "many.kvroute.test";
    // Addresses in 127.0.0.0/8 only: nothing leaves the machine, whatever is tried.
    let entries: Vec<(IpAddr, &str)> = (0..ADDRESSES)
        .map(|k| (IpAddr::from([127, 2, (k / 250) as u8, (k % 250) as u8 + 1]), name))
        .collect();
    dns.publish(&entries).unwrap();
    let router = Arc::new(RouterState::new(RouterConfig::default()));
    // Workers without events or load reports: nothing is subscribed to.
    let dns_config = DnsConfig {
        name: name.into(),
        server: Some(dns.at),
        every: Duration::from_millis(500),
        template: "url=http://{host}:9".parse().unwrap(),
    };
    let source = DnsSource::new(dns_config).unwrap();
    // Once dnsmasq has read the file (and over TCP: the answer does not fit a datagram).
    let mut found = 0;
    for _ in 0..20 {
        found = source.lookup().await.map_or(0, |f| f.len());
        if found > MAX_MEMBERS_PER_SOURCE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(found > MAX_MEMBERS_PER_SOURCE, "a large answer: {found}");
    let _source = spawn_source(&router, Box::new(source), Duration::from_secs(30));
    assert!(
        eventually(Duration::from_secs(20), || router.view().workers().len()
            == MAX_MEMBERS_PER_SOURCE)
        .await,
        "{}",
        router.view().workers().len()
    );
    let metrics = router.view().render_metrics();
    assert!(
        metrics
            .contains("kvroute_router_membership_changes_total{source=\"dns\",change=\"refused\"}"),
        "the cut is counted"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(router.view().workers().len(), MAX_MEMBERS_PER_SOURCE, "the same cut each round");
}

/// A bucket on `server` under a registration key of the test's own.
fn bucket_config(
    server: &kvroute_bench::fixtures::nats_server::NatsServer,
    ttl: Duration,
) -> kvroute_router::members::BucketConfig {
    kvroute_router::members::BucketConfig {
        nats: kvroute_router::nats::NatsConfig::new(server.url()),
        bucket: "kvroute_members".into(),
        ttl,
        key: kvroute_router::members::MembersKey::from_secret(b"the test fleet's own key").unwrap(),
        allow: Vec::new(),
    }
}

/// Two routers (a replica and a picker's embedded one alike) watch one bucket on a real
/// `nats-server`: a worker a sidecar registers joins both within the bound, one deleted leaves
/// both, one whose renewals stop expires, and a garbage entry is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_agree_on_the_members_a_nats_bucket_holds() {
    use kvroute_bench::fixtures::nats_server::NatsServer;
    use kvroute_router::members::signed::sign;
    use kvroute_router::members::{BucketSource, register};
    let dir = tempdir::Dir::new("bucket");
    let server = NatsServer::start(&dir.0.join("store"), 0).await.unwrap();
    let ttl = Duration::from_secs(2);
    let bucket = bucket_config(&server, ttl);
    // Two router replicas, and two pickers (each a stack's embedded router), on one bucket.
    let mut routers: Vec<Arc<RouterState>> =
        (0..2).map(|_| Arc::new(RouterState::new(RouterConfig::default()))).collect();
    let _sources: Vec<_> = routers
        .iter()
        .map(|r| {
            spawn_source(r, Box::new(BucketSource::new(bucket.clone())), Duration::from_secs(5))
        })
        .collect();
    let mut pickers = Vec::new();
    for _ in 0..2 {
        let discovery = kvroute_stack::Discovery {
            bucket: Some(bucket.clone()),
            ..kvroute_stack::Discovery::default()
        };
        let config = StackConfig {
            simulated: Simulated { count: 0, ..Simulated::default() },
            discovery,
            ..StackConfig::default()
        };
        let stack = Stack::start(config).await.unwrap();
        routers.push(Arc::clone(stack.router.as_ref().unwrap()));
        let picker = stack.picker(kvroute_epp::EppOptions::default(), None).unwrap();
        pickers.push((stack, picker));
    }
    // Workers without events: nothing to subscribe to, so membership alone is measured.
    let spec = json!({"url": "http://127.0.9.20:9"});
    let id = kvroute_router::members::id_for("http://127.0.9.20:9");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sidecar = {
        let bucket = bucket.clone();
        tokio::spawn(async move {
            register(&bucket, &spec, async {
                let _ = stopped.await;
            })
            .await
        })
    };
    let on_all = |routers: &[Arc<RouterState>]| routers.iter().all(|r| r.view().knows_worker(id));
    // When each of the four saw it, from the registration's start (the first is the bucket's
    // own delivery; the spread between first and last is how long the four disagreed).
    let asked = std::time::Instant::now();
    let mut seen: Vec<Option<Duration>> = vec![None; routers.len()];
    while seen.iter().any(Option::is_none) {
        assert!(asked.elapsed() < Duration::from_secs(10), "{seen:?}");
        for (k, r) in routers.iter().enumerate() {
            if seen[k].is_none() && r.view().knows_worker(id) {
                seen[k] = Some(asked.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seen: Vec<Duration> = seen.into_iter().flatten().collect();
    let spread = *seen.iter().max().unwrap() - *seen.iter().min().unwrap();
    eprintln!(
        "a registration reached two replicas and two pickers at {seen:?}: they disagreed for {spread:?}"
    );
    assert!(spread < Duration::from_secs(1), "within the bound: {spread:?}");
    assert!(on_all(&routers));
    for (_, picker) in &pickers {
        let endpoint = || picker.endpoints().endpoint(id).is_some();
        assert!(
            eventually(Duration::from_secs(5), endpoint).await,
            "an endpoint of each picker's pool"
        );
    }

    // Garbage beside it: refused, nothing else changes.
    let client = async_nats::connect(server.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let kv = js.get_key_value("kvroute_members").await.unwrap();
    kv.put("junk", bytes::Bytes::from_static(b"\x00\xffnot json")).await.unwrap();
    kv.put("noaddr", bytes::Bytes::from_static(b"{\"dialect\":\"openai-chat\"}")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(routers.iter().all(|r| r.view().workers().len() == 1), "garbage joins nothing");

    // The sidecar stops: its registration is deleted, both routers drain the worker.
    let stopped_at = std::time::Instant::now();
    stop.send(()).unwrap();
    sidecar.await.unwrap().unwrap();
    let gone = |routers: &[Arc<RouterState>]| routers.iter().all(|r| !r.view().knows_worker(id));
    assert!(eventually(Duration::from_secs(10), || gone(&routers)).await);
    eprintln!("a sidecar stopping: the worker left all four within {:?}", stopped_at.elapsed());

    // A registration never renewed expires after its time to live.
    let (key, value) =
        sign(&bucket.key, &bucket.bucket, &json!({"url": "http://127.0.9.21:9"})).unwrap();
    kv.put(key, value.into()).await.unwrap();
    let id2 = kvroute_router::members::id_for("http://127.0.9.21:9");
    assert!(
        eventually(Duration::from_secs(5), || routers.iter().all(|r| r.view().knows_worker(id2)))
            .await
    );
    assert!(
        eventually(ttl * 4, || routers.iter().all(|r| !r.view().knows_worker(id2))).await,
        "expired"
    );
    let metrics = routers[0].view().render_metrics();
    assert!(
        metrics.contains(
            "kvroute_router_membership_changes_total{source=\"nats\",change=\"joined\"} 2"
        ),
        "{metrics}"
    );
}

/// A pod flapping (its address published, withdrawn, published every 100 ms) while requests
/// run: no request fails, the steady workers stay, and the flapping one is bounded to a join
/// and a drain at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_pod_fails_no_request() {
    let Some(dns) = dns_server() else { return };
    let (_first, ports) = engine_at(ip(11), None).await;
    let (_second, _) = engine_at(ip(12), Some(ports)).await;
    let (_flapping, _) = engine_at(ip(13), Some(ports)).await;
    let name = "flap.kvroute.test";
    let steady = [(ip(11), name), (ip(12), name)];
    dns.publish(&steady).unwrap();
    let (_stack, base, router, _source) =
        dns_fleet(&dns, name, Duration::from_millis(100), ports).await;
    assert!(eventually(Duration::from_secs(10), || ready_count(&router) == 2).await);
    let flapper = tokio::spawn(async move {
        let all = [steady[0], steady[1], (ip(13), name)];
        for k in 0..30 {
            dns.publish(if k % 2 == 0 { &all } else { &steady }).unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        dns
    });
    let mut k = 0;
    while !flapper.is_finished() {
        assert_eq!(chat(&base, k).await, 200, "request {k}");
        k += 1;
    }
    let _dns = flapper.await.unwrap();
    assert!(k > 10, "requests ran throughout: {k}");
    let steady_ids = [11, 12]
        .map(|l| kvroute_router::members::id_for(&format!("http://{}:{}", ip(l), ports.http)));
    assert!(steady_ids.iter().all(|&w| router.view().knows_worker(w)), "the steady workers stay");
    assert!(router.view().workers().len() <= 3);
}

/// The configuration file read again when it changes: a worker added to `[[workers]]` joins,
/// one removed drains and leaves, and the simulated workers (not in the file) stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_configuration_files_workers_are_followed_when_it_changes() {
    let dir = tempdir::Dir::new("reload");
    let path = dir.0.join("kvroute.toml");
    let (a, _) = engine_at(ip(21), None).await;
    let (b, _) = engine_at(ip(22), None).await;
    let table = |id: u64, e: &kvroute_mocker::Spawned| {
        format!(
            "[[workers]]\nid = {id}\nurl = \"{}\"\nevents = \"{}\"\n\n",
            e.url,
            e.events.as_deref().unwrap()
        )
    };
    std::fs::write(&path, table(50, &a)).unwrap();
    let read = {
        let path = path.clone();
        move || -> Result<Vec<kvroute_router::WorkerSpec>, kvroute_stack::StackError> {
            #[derive(serde::Deserialize)]
            struct File {
                workers: Vec<kvroute_router::WorkerSpec>,
            }
            let text = std::fs::read_to_string(&path)?;
            let file = toml::from_str::<File>(&text).map_err(std::io::Error::other)?;
            Ok(file.workers)
        }
    };
    let config = StackConfig {
        simulated: Simulated { count: 1, ..Simulated::default() },
        router: RouterConfig { workers: read().unwrap(), ..RouterConfig::default() },
        discovery: kvroute_stack::Discovery {
            reload: Some(kvroute_stack::reload::Reload {
                path: path.clone(),
                workers: Arc::new(read),
            }),
            ..kvroute_stack::Discovery::default()
        },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    let router = Arc::clone(stack.router.as_ref().unwrap());
    let simulated = stack.workers.iter().map(|w| w.id.0).find(|&id| id != 50).unwrap();
    let knows = |id: u64| router.view().knows_worker(kvroute_core::WorkerId(id));
    assert!(knows(50) && knows(simulated));
    // The waits are generous: a CI run of the whole suite on 2 cores once took over 10 s.
    std::fs::write(&path, table(50, &a) + &table(70, &b)).unwrap();
    assert!(eventually(Duration::from_secs(30), || knows(70)).await, "an added worker joins");
    std::fs::write(&path, table(70, &b)).unwrap();
    assert!(eventually(Duration::from_secs(30), || !knows(50)).await, "a removed worker leaves");
    assert!(knows(70) && knows(simulated), "the others stay");
    // A file that no longer parses changes nothing.
    std::fs::write(&path, "[[workers]]\nid = \"x\"\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(knows(70) && knows(simulated));
}

/// The picker's endpoints file keeps narrowing the pool, and with a worker template what it
/// lists that is no worker joins (source `file`), and leaves with its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_endpoints_file_adds_workers_through_the_template() {
    let dir = tempdir::Dir::new("pool");
    let path = dir.0.join("endpoints");
    let (outside, ports) = engine_at(ip(31), None).await;
    let config = StackConfig {
        simulated: Simulated { count: 1, tokenless: true, ..Simulated::default() },
        ..StackConfig::default()
    };
    let stack = Stack::start(config).await.unwrap();
    assert!(stack.ready(Duration::from_secs(10)).await.is_empty());
    let router = Arc::clone(stack.router.as_ref().unwrap());
    let picker = stack.picker(kvroute_epp::EppOptions::default(), None).unwrap();
    assert!(picker.add_listed(template(ports), Duration::from_secs(5)));
    let simulated = kvroute_epp::host_port(stack.workers[0].url.as_deref().unwrap()).unwrap();
    let listed = format!("{}:{}", ip(31), ports.http);
    std::fs::write(&path, format!("{simulated}\n{listed}\n")).unwrap();
    let _watch = picker.watch(path.clone(), Duration::from_millis(100));
    let id = kvroute_router::members::id_for(&outside.url);
    assert!(
        eventually(Duration::from_secs(10), || is_ready(&router, id)).await,
        "{:?}",
        router.view().workers()
    );
    assert_eq!(router.view().member(id).unwrap().source, "file");
    assert!(
        eventually(Duration::from_secs(5), || picker.endpoints().endpoint(id).is_some()).await,
        "an endpoint of the pool"
    );
    // Its line goes: it drains and leaves; the simulated worker stays.
    std::fs::write(&path, format!("{simulated}\n")).unwrap();
    assert!(eventually(Duration::from_secs(10), || !router.view().knows_worker(id)).await);
    assert!(router.view().knows_worker(stack.workers[0].id));
}

fn is_ready(router: &RouterState, id: kvroute_core::WorkerId) -> bool {
    router.view().workers().iter().any(|w| w.id == id && w.ready.iter().all(|r| *r))
}

/// The members' bucket under attack (#77), on a real `nats-server`: with write access to the
/// bucket and without the fleet's key, unsigned, forged and moved registrations never join;
/// an old registration written again is stale; a value's own `id` is ignored; 2,000 signed
/// newcomers at the bound push none of the real workers out; each refused key is counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_writer_to_the_bucket_cannot_take_the_fleet() {
    use kvroute_bench::fixtures::nats_server::NatsServer;
    use kvroute_router::members::signed::{sign, sign_at};
    use kvroute_router::members::{BucketSource, MembersKey, id_for, register};
    let dir = tempdir::Dir::new("hostile-bucket");
    let server = NatsServer::start(&dir.0.join("store"), 0).await.unwrap();
    let bucket = bucket_config(&server, Duration::from_secs(10));
    let router = Arc::new(RouterState::new(RouterConfig::default()));
    let _source =
        spawn_source(&router, Box::new(BucketSource::new(bucket.clone())), Duration::from_secs(5));
    // Two real workers, each kept by its sidecar.
    let real: Vec<String> = (30..32).map(|k| format!("http://127.0.9.{k}:9")).collect();
    let mut sidecars = Vec::new();
    for url in &real {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (bucket, spec) = (bucket.clone(), json!({ "url": url }));
        tokio::spawn(async move {
            register(&bucket, &spec, async {
                let _ = stopped.await;
            })
            .await
        });
        sidecars.push(stop);
    }
    let real_ids: Vec<_> = real.iter().map(|u| id_for(u)).collect();
    let has_real = |r: &RouterState| real_ids.iter().all(|id| r.view().knows_worker(*id));
    assert!(eventually(Duration::from_secs(10), || has_real(&router)).await);

    let client = async_nats::connect(server.url()).await.unwrap();
    let kv = async_nats::jetstream::new(client).get_key_value("kvroute_members").await.unwrap();
    let mine = "http://127.0.9.66:9";
    let mine_id = id_for(mine);
    // Unsigned, the way a worker used to be written (and with a real worker's id).
    let plain = json!({"id": real_ids[0].0, "url": mine}).to_string();
    kv.put(format!("w{mine_id}"), plain.clone().into()).await.unwrap();
    kv.put(format!("w{}", real_ids[0]), plain.into()).await.unwrap();
    // Signed with a key that is not the fleet's.
    let other = MembersKey::from_secret(b"a key the attacker made up").unwrap();
    let (key, forged) = sign(&other, &bucket.bucket, &json!({"url": mine})).unwrap();
    kv.put(key, forged.into()).await.unwrap();
    // A real registration moved under another key: the first real worker's, holding mine.
    let (_, value) = sign(&bucket.key, &bucket.bucket, &json!({"url": mine})).unwrap();
    kv.put(format!("w{}", real_ids[1]), value.into()).await.unwrap();
    // A registration of mine made (signed) a minute ago, written again now: stale.
    let minute_ago =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
            as u64
            - 60_000;
    let (key, old) =
        sign_at(&bucket.key, &bucket.bucket, &json!({"url": mine}), minute_ago).unwrap();
    kv.put(key, old.into()).await.unwrap();
    // A fresh, signed registration whose value names a real worker's id: the id is ignored.
    let named = json!({"id": real_ids[0].0, "url": "http://127.0.9.67:9"});
    let (key, value) = sign(&bucket.key, &bucket.bucket, &named).unwrap();
    kv.put(key, value.into()).await.unwrap();
    let named_id = id_for("http://127.0.9.67:9");
    assert!(eventually(Duration::from_secs(10), || router.view().knows_worker(named_id)).await);
    assert!(
        !router.view().knows_worker(mine_id),
        "no unsigned, forged, moved or stale entry joined"
    );
    let urls: Vec<Option<String>> = router.view().workers().iter().map(|w| w.url.clone()).collect();
    assert!(has_real(&router), "the real workers stay: {urls:?}");
    for id in &real_ids {
        let w = router.view().workers().into_iter().find(|w| w.id == *id).unwrap();
        assert!(real.contains(w.url.as_ref().unwrap()), "{id} still points at its engine: {w:?}");
    }

    // A flood: 2,000 registrations signed with the fleet's key (a leaked key, at worst).
    for k in 0..2000u32 {
        let url = format!("http://127.1.{}.{}:9", k / 250, k % 250 + 1);
        let (key, value) = sign(&bucket.key, &bucket.bucket, &json!({ "url": url })).unwrap();
        kv.put(key, value.into()).await.unwrap();
    }
    let bound = kvroute_router::members::MAX_MEMBERS_PER_SOURCE;
    assert!(eventually(Duration::from_secs(20), || router.view().workers().len() == bound).await);
    assert!(has_real(&router), "2,000 newcomers at the bound push no real worker out");
    let refused = |r: &RouterState| {
        let text = r.view().render_metrics();
        let line = text
            .lines()
            .find(|l| {
                l.starts_with(
                    "kvroute_router_membership_changes_total{source=\"nats\",change=\"refused\"}",
                )
            })
            .map(str::to_owned);
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0)
    };
    // Refused before the flood, counted by key: mine's (unsigned, forged, stale: one key) and
    // the two real workers' keys written over (unsigned, moved); then, of the 2,003 signed
    // registrations, what did not fit the bound.
    let expected = (3 + 2003 - bound) as f64;
    assert!(
        eventually(Duration::from_secs(10), || refused(&router) == expected).await,
        "{}",
        refused(&router)
    );
    // The same keys written again: not counted again.
    for k in 0..50u32 {
        let url = format!("http://127.1.{}.{}:9", k / 250, k % 250 + 1);
        let (key, value) = sign(&bucket.key, &bucket.bucket, &json!({ "url": url })).unwrap();
        kv.put(key, value.into()).await.unwrap();
    }
    kv.put(format!("w{mine_id}"), json!({"url": mine}).to_string().into()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(refused(&router), expected, "each refused key is counted once");
    drop(sidecars);
}
