//! A simulated engine called in-process, as the API tests call it: its app, a request, the
//! token ids it renders a chat to, a sample of its metrics.

use std::sync::Arc;

use axum::http::Method;
use kvroute_core::BlockSize;
use kvroute_http::testing;
use kvroute_mocker::{EngineConfig, MockerConfig, Timing, http};
use serde_json::{Value, json};

pub(crate) struct Engine {
    pub(crate) app: axum::Router,
}

/// An engine of `num_blocks` 16-token blocks, 100 times faster than real time.
pub(crate) async fn engine(num_blocks: usize) -> Engine {
    let config = MockerConfig {
        engine: EngineConfig {
            num_blocks,
            block_size: BlockSize::new(16).unwrap(),
            timing: Timing { speedup: 100.0 },
            ..EngineConfig::default()
        },
        ..MockerConfig::default()
    };
    let state = kvroute_mocker::start(config).await.unwrap();
    Engine { app: http::app(Arc::clone(&state)) }
}

impl Engine {
    pub(crate) async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, v) = testing::call(&self.app, Method::POST, path, Some(body)).await;
        (status.as_u16(), v)
    }

    /// The token ids of a chat prompt, as the engine renders it.
    pub(crate) async fn rendered(&self, text: &str) -> Vec<u32> {
        let chat = json!({"messages": [{"role": "user", "content": text}]});
        let (status, r) = self.post("/v1/chat/completions/render", &chat).await;
        assert_eq!(status, 200, "{r}");
        serde_json::from_value(r["token_ids"].clone()).unwrap()
    }

    pub(crate) async fn metric(&self, name: &str) -> Option<f64> {
        let (_, m) = testing::call(&self.app, Method::GET, "/metrics", None).await;
        kvroute_http::metrics::sample(m.as_str().unwrap(), name)
    }
}

/// A prompt long enough to fill several blocks.
pub(crate) const LONG: &str = "Please summarize the following text in three bullet points. The router sends each request to the worker that already holds the longest part of its prompt, unless that worker is too busy. A block is a fixed number of tokens.";
