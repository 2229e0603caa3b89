//! The front door's handlers through `app(state).oneshot(..)`: every refusal happens before a
//! worker is asked, with an OpenAI-shaped body and the right status.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use kvroute_frontend::FrontendState;
use kvroute_http::testing;
use kvroute_preprocess::Preprocessor;
use kvroute_preprocess::fetch::{FetchConfig, Fetcher};
use kvroute_router::{RouterConfig, RouterState};
use serde_json::{Value, json};

/// A front door over a router that knows no worker.
fn app() -> axum::Router {
    let router = Arc::new(RouterState::new(RouterConfig::default()));
    let fetcher = Fetcher::new(FetchConfig::default()).unwrap();
    kvroute_frontend::app(Arc::new(FrontendState::new(
        Arc::new(Preprocessor::builtin()),
        fetcher,
        router,
    )))
}

async fn raw(app: &axum::Router, path: &str, body: String) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    testing::call_raw(app, req).await
}

#[tokio::test]
async fn bad_requests_are_refused_before_routing() {
    let app = app();
    let image = |url: &str| {
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
            .to_string()
    };
    let huge = format!("data:image/png;base64,{}", "A".repeat(28 << 20));
    let cases = [
        ("/v1/chat/completions", "{not json".to_owned(), 400),
        ("/v1/chat/completions", "[1, 2]".to_owned(), 400),
        ("/v1/chat/completions", json!({"model": "kvroute-tiny"}).to_string(), 400),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            404,
        ),
        ("/v1/chat/completions", image("data:image/png;base64,AAAA"), 400),
        // Private addresses are refused unless allowed; nothing leaves the machine.
        ("/v1/chat/completions", image("http://127.0.0.1:9/none.png"), 400),
        ("/v1/chat/completions", image(&huge), 413),
        ("/v1/completions", json!({"max_tokens": 1}).to_string(), 400),
        ("/v1/completions", json!({"prompt": []}).to_string(), 400),
    ];
    for (path, body, want) in cases {
        let (status, v) = raw(&app, path, body.clone()).await;
        assert_eq!(status.as_u16(), want, "{}: {v}", &body[..body.len().min(120)]);
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        match want {
            // OpenAI's answer to an unknown model names its code.
            404 => assert_eq!(v["error"]["code"], "model_not_found", "{v}"),
            _ => assert_eq!(v["error"]["code"].as_u64(), Some(u64::from(want))),
        }
    }
}

/// What a client sends is the client's error, wherever it sits in the body: nesting past the
/// parser's depth in a field kvroute does not read, numbers no f64 holds, sampling fields
/// out of range. Each is a 400 naming its field, never a 500; a long model name is not echoed
/// whole.
#[tokio::test]
async fn hostile_fields_are_400s_that_name_them() {
    let app = app();
    let chat = |extra: &str| format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
    let deep = format!(",\"x\":{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let cases = [
        (chat(&deep), "x"),
        (chat(",\"temperature\":1e400"), "temperature"),
        (chat(",\"top_p\":-1e400"), "top_p"),
        (chat(",\"n\":0"), "n"),
        (chat(",\"n\":-1"), "n"),
        (chat(",\"n\":1.5"), "n"),
        (chat(",\"n\":2,\"best_of\":1"), "best_of"),
        (chat(",\"top_logprobs\":1000000000"), "top_logprobs"),
        (chat(",\"top_logprobs\":-1"), "top_logprobs"),
    ];
    for (body, param) in cases {
        let (status, v) = raw(&app, "/v1/chat/completions", body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{}: {v}", &body[..body.len().min(80)]);
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    let (status, v) =
        raw(&app, "/v1/completions", json!({"prompt": "hi", "logprobs": 21}).to_string()).await;
    assert_eq!((status, v["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("logprobs")));
    let model = "m".repeat(1 << 20);
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (status, v) = raw(&app, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(v["error"]["message"].as_str().unwrap().len() < 200, "{v}");
    // Within bounds they pass the checks (and meet the router with no worker: 503).
    let (status, _) =
        raw(&app, "/v1/chat/completions", chat(",\"n\":1,\"logprobs\":true,\"top_logprobs\":20"))
            .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn no_worker_is_503_and_unknown_routes_are_openai_errors() {
    let app = app();
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let (status, v) = testing::call(&app, Method::POST, "/v1/chat/completions", Some(&chat)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["type"], "service_unavailable");
    let (status, v) = testing::call(&app, Method::GET, "/v1/chat/completions", None).await;
    assert_eq!((status, v["error"]["code"].as_u64()), (StatusCode::METHOD_NOT_ALLOWED, Some(405)));
    let (status, v) = testing::call(&app, Method::GET, "/v2/nothing", None).await;
    assert_eq!(
        (status, v["error"]["type"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found_error"))
    );
    let (status, v) = testing::call(&app, Method::GET, "/v1/models", None).await;
    assert_eq!((status, v["data"][0]["id"].as_str()), (StatusCode::OK, Some("kvroute-tiny")));
    let (status, v) = testing::call(&app, Method::GET, "/metrics", None).await;
    let text = v.as_str().unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("kvroute_frontend_proxied_total 0"), "{text}");
    assert!(text.contains("kvroute_router_decisions_total 0"), "the embedded router's: {text}");
    assert!(text.trim_end().ends_with("# EOF"));
}
