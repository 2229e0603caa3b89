//! A JSON body extractor that takes axum's `Json` answers without its per-value cost.
//!
//! axum's `Json` deserializes through `serde_path_to_error`, which tracks the path of every
//! value it reads so that an error can name where it went wrong. A `find_best_worker` body is
//! 512 block hashes, so that tracking was a good part of the router's time per request at a
//! thousand workers (docs/bench/scale.md). [`FastJson`] parses with `serde_json` alone and,
//! only when that fails (or the content type is anything but plain `application/json`), asks
//! axum's `Json` for the rejection: the same bodies are accepted, and every refusal is
//! axum's, word for word.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use serde::de::DeserializeOwned;

/// A request body parsed as JSON; see the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub struct FastJson<T>(pub T);

impl<T, S> FromRequest<S> for FastJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = JsonRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        if !plain_json(req.headers()) {
            return Json::<T>::from_request(req, state).await.map(|Json(v)| Self(v));
        }
        let bytes = Bytes::from_request(req, state).await?;
        match serde_json::from_slice(&bytes) {
            Ok(v) => Ok(Self(v)),
            Err(_) => Json::<T>::from_bytes(&bytes).map(|Json(v)| Self(v)),
        }
    }
}

/// `application/json`, with parameters or none (any other type is left to axum to judge).
fn plain_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(Ok(value)) = headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

    #[test]
    fn only_plain_json_takes_the_fast_path() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, v.parse().unwrap());
            plain_json(&h)
        };
        assert!(with("application/json") && with("application/json; charset=utf-8"));
        assert!(with("Application/JSON"));
        assert!(!with("application/vnd.api+json") && !with("text/json") && !with("text/plain"));
        assert!(!plain_json(&HeaderMap::new()));
    }
}
