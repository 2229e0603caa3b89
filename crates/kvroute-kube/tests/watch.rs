//! The `InferencePool` source against kube-rs's own test client (`tower_test::mock::pair`
//! behind `kube::Client::new`), answered with responses shaped as the API server returns them
//! (`tests/fixtures`): the pool, a list of its pods, a watch with a bookmark, a pod deleted and
//! a 410 Gone, and the list that follows it.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response};
use kube::client::Body;
use kvroute_core::schedule::Role;
use kvroute_kube::{KubeConfig, KubeSource};
use kvroute_router::members::{Sink, Source, id_for};
use kvroute_router::{RouterConfig, RouterState};

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn answer(name: &str) -> Response<Body> {
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(fixture(name)))
        .unwrap()
}

async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !f() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// The members' URLs and roles, sorted.
fn members(router: &RouterState) -> Vec<(String, Role)> {
    let mut m: Vec<(String, Role)> = router
        .view()
        .members()
        .iter()
        .filter(|m| !m.draining)
        .map(|m| (m.spec.url.clone().unwrap_or_default(), m.spec.role))
        .collect();
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m
}

/// The API's side of kube's test client.
type Api = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// A Kubernetes source over kube's test client, watching pool `kvroute-pool` of namespace
/// `serving` into a router of its own: the API's side, the router, the source's task.
fn watching(own_pod: Option<&str>) -> (Api, Arc<RouterState>, tokio::task::JoinHandle<()>) {
    let (service, api) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "serving");
    let router = Arc::new(RouterState::new(RouterConfig::default()));
    let config = KubeConfig {
        pool: "kvroute-pool".into(),
        namespace: "serving".into(),
        template: "url=http://{host}:{port}".parse().unwrap(),
        own_pod: own_pod.map(str::to_owned),
    };
    let sink = Sink::new(Arc::clone(&router), "kubernetes", Duration::from_secs(5));
    let source = tokio::spawn(Box::new(KubeSource::new(client, config)).run(sink));
    (api, router, source)
}

#[tokio::test]
async fn the_pools_ready_pods_are_followed_through_a_watch_and_a_410() {
    let (mut api, router, source) = watching(Some("kvroute-picker-7c9d6f-x2x9k"));

    // The pool: its selector and target port.
    let (request, reply) = api.next_request().await.unwrap();
    assert_eq!(
        request.uri().path(),
        "/apis/inference.networking.k8s.io/v1/namespaces/serving/inferencepools/kvroute-pool"
    );
    reply.send_response(answer("pool.json"));

    // The pods it selects: listed first.
    let (request, reply) = api.next_request().await.unwrap();
    assert_eq!(request.uri().path(), "/api/v1/namespaces/serving/pods");
    let query = request.uri().query().unwrap_or_default().to_owned();
    assert!(query.contains("labelSelector=kvroute.io%2Fpool%3Dkvroute-pool"), "{query}");
    assert!(!query.contains("watch=true"), "{query}");
    reply.send_response(answer("pods-list.json"));
    let first = [
        ("http://10.1.0.10:8000".to_owned(), Role::Both),
        ("http://10.1.0.11:8000".to_owned(), Role::Decode),
    ];
    assert!(
        eventually(Duration::from_secs(5), || members(&router) == first).await,
        "{:?}",
        members(&router)
    );
    assert_eq!(router.view().member(id_for("http://10.1.0.10:8000")).unwrap().source, "kubernetes");

    // Then watched from the list's version: vllm-2 ready (a prefill pod), a bookmark, vllm-0
    // terminating then deleted, and a 410 Gone.
    let (request, reply) = api.next_request().await.unwrap();
    let query = request.uri().query().unwrap_or_default().to_owned();
    assert!(query.contains("watch=true") && query.contains("resourceVersion=1000"), "{query}");
    assert!(query.contains("allowWatchBookmarks=true"), "{query}");
    reply.send_response(answer("pods-watch.jsonl"));
    let watched = [
        ("http://10.1.0.11:8000".to_owned(), Role::Decode),
        ("http://10.1.0.12:8000".to_owned(), Role::Prefill),
    ];
    assert!(
        eventually(Duration::from_secs(5), || members(&router) == watched).await,
        "{:?}",
        members(&router)
    );
    let gone = id_for("http://10.1.0.10:8000");
    assert!(
        eventually(Duration::from_secs(5), || !router.view().knows_worker(gone)).await,
        "the deleted pod's worker drained and left"
    );

    // The 410: a new list, which no longer has vllm-2 (deleted while the watch was away).
    let (request, reply) = api.next_request().await.unwrap();
    let query = request.uri().query().unwrap_or_default().to_owned();
    assert!(!query.contains("watch=true"), "a list after the 410: {query}");
    reply.send_response(answer("pods-relist.json"));
    let relisted = [("http://10.1.0.11:8000".to_owned(), Role::Decode)];
    assert!(
        eventually(Duration::from_secs(5), || members(&router) == relisted).await,
        "{:?}",
        members(&router)
    );
    // The picker's own pod, which the selector matches, never joined.
    assert!(!router.view().knows_worker(id_for("http://10.1.0.99:8000")));
    source.abort();
}

#[tokio::test]
async fn a_pool_without_a_selector_joins_nothing() {
    let (mut api, router, source) = watching(None);
    let mut pool: serde_json::Value = serde_json::from_slice(&fixture("pool.json")).unwrap();
    pool["spec"].as_object_mut().unwrap().remove("selector");
    let (_, reply) = api.next_request().await.unwrap();
    reply.send_response(
        Response::builder().body(Body::from(serde_json::to_vec(&pool).unwrap())).unwrap(),
    );
    // It asks for the pool again later (2 s), never for pods.
    let next =
        tokio::time::timeout(Duration::from_secs(5), api.next_request()).await.unwrap().unwrap();
    assert!(next.0.uri().path().ends_with("/inferencepools/kvroute-pool"), "{}", next.0.uri());
    assert!(router.view().workers().is_empty());
    source.abort();
}
