//! The one HTTP/1 client of the workspace: the front door proxies with it, a front door asks a
//! remote router with it, the stack and the bench read workers with it. Connections are kept
//! alive and written without Nagle's delay (small SSE and JSON writes otherwise wait up to
//! 40 ms for a delayed ACK). Bodies read whole are capped in size.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::ErrorBody;

/// Largest body [`HttpClient`] reads whole.
pub const MAX_BODY: usize = 16 << 20;

/// How long a kept-alive connection may sit idle before the client stops reusing it: less
/// than the servers' own idle timeouts (ours, [`crate::server::DEFAULT_HEADER_TIMEOUT`], 10 s;
/// uvicorn's, which vLLM and SGLang serve with, 5 s), so a request is never written to a
/// connection the server is closing at that moment (it would be reset: a simulated engine's
/// store lookup was, once in a bench run, with hyper's default of 90 s).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
const _: () = assert!(POOL_IDLE_TIMEOUT.as_secs() < 5);
const _: () =
    assert!(POOL_IDLE_TIMEOUT.as_secs() < crate::server::DEFAULT_HEADER_TIMEOUT.as_secs());

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("invalid request: {0}")]
    Request(#[from] hyper::http::Error),
    /// Nothing was sent: the connection could not be made.
    #[error("cannot connect")]
    Connect(#[source] hyper_util::client::legacy::Error),
    #[error("the request failed")]
    Send(#[source] hyper_util::client::legacy::Error),
    #[error("reading the body")]
    Body(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A non-2xx answer, with the message of its OpenAI-shaped body when it has one.
    #[error("HTTP {status}: {message}")]
    Status {
        status: StatusCode,
        message: String,
        /// The answer's `Retry-After`, seconds, when it had one.
        retry_after: Option<u64>,
    },
    #[error("undecodable JSON")]
    Json(#[from] serde_json::Error),
}

impl ClientError {
    /// Whether nothing reached the server (another server may take the request).
    pub fn is_connect(&self) -> bool {
        matches!(self, Self::Connect(_))
    }
}

/// A kept-alive HTTP/1 client; cheap to clone.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    /// `Authorization` sent with every request.
    bearer: Option<header::HeaderValue>,
    /// `Authorization` sent to one origin (`http://host:port`) only, instead.
    origin_bearers: Arc<Vec<(String, header::HeaderValue)>>,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient").field("bearer", &self.bearer.is_some()).finish()
    }
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new()
    }
}

impl HttpClient {
    pub fn new() -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            inner: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .build(connector),
            bearer: None,
            origin_bearers: Arc::default(),
        }
    }

    /// The same client sending `Authorization: Bearer <token>` to `origin`
    /// (`scheme://host:port`) only, in place of [`HttpClient::with_bearer`]'s: a worker's own
    /// token goes to that worker and nowhere else.
    #[must_use]
    pub fn with_bearer_for(mut self, origin: &str, token: &str) -> Self {
        if let Some(value) = bearer_value(token) {
            let origin = origin.trim_end_matches('/').to_owned();
            Arc::make_mut(&mut self.origin_bearers).push((origin, value));
        }
        self
    }

    /// A new client that sends `token` as a bearer token, when there is one.
    pub fn bearing(token: Option<&str>) -> Self {
        match token {
            Some(t) => Self::new().with_bearer(t),
            None => Self::new(),
        }
    }

    /// The same client sending `Authorization: Bearer <token>` with every request (a token
    /// that is no valid header value is not sent; the server's 401 says so).
    #[must_use]
    pub fn with_bearer(mut self, token: &str) -> Self {
        self.bearer = bearer_value(token);
        self
    }

    /// Sends a request; the answer's body is left to the caller (streams stay streams).
    pub async fn send(
        &self,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ClientError> {
        let origin = |uri: &hyper::Uri| match (uri.scheme_str(), uri.authority()) {
            (Some(s), Some(a)) => Some(format!("{s}://{a}")),
            _ => None,
        };
        let own = origin(request.uri()).and_then(|o| {
            self.origin_bearers.iter().find(|(origin, _)| *origin == o).map(|(_, v)| v.clone())
        });
        if let Some(bearer) = own.or_else(|| self.bearer.clone()) {
            request.headers_mut().entry(header::AUTHORIZATION).or_insert(bearer);
        }
        self.inner.request(request).await.map_err(|e| {
            if e.is_connect() { ClientError::Connect(e) } else { ClientError::Send(e) }
        })
    }

    /// `method url` with a JSON body (or none).
    pub async fn call(
        &self,
        method: Method,
        url: &str,
        body: Option<&(impl Serialize + ?Sized)>,
    ) -> Result<Response<Incoming>, ClientError> {
        let mut request = Request::builder().method(method).uri(url);
        let body = match body {
            Some(b) => {
                request = request.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(b)?)
            }
            None => Bytes::new(),
        };
        self.send(request.body(Full::new(body))?).await
    }

    /// `GET url`: the status and the whole body.
    pub async fn get(&self, url: &str) -> Result<(StatusCode, Bytes), ClientError> {
        let response = self.call(Method::GET, url, None::<&()>).await?;
        let status = response.status();
        Ok((status, read_body(response.into_body(), MAX_BODY).await?))
    }

    /// `GET url` decoded as JSON; a non-2xx answer is an error.
    pub async fn get_json<T: DeserializeOwned>(&self, url: &str) -> Result<T, ClientError> {
        json(self.call(Method::GET, url, None::<&()>).await?).await
    }

    /// `POST url` with a body of `content_type`, the answer decoded as JSON; a non-2xx answer
    /// is an error.
    pub async fn post_bytes<T: DeserializeOwned>(
        &self,
        url: &str,
        content_type: &'static str,
        body: Bytes,
    ) -> Result<T, ClientError> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header(header::CONTENT_TYPE, content_type)
            .body(Full::new(body))?;
        json(self.send(request).await?).await
    }

    /// `POST /find_best_worker` at `base` (the router's origin): in the binary form
    /// ([`crate::router_api::BINARY_HASHES`]) unless the request excludes workers, which only
    /// JSON says.
    pub async fn find_best_worker(
        &self,
        base: &str,
        request: &crate::router_api::FindBestWorker,
    ) -> Result<crate::router_api::BestWorker, ClientError> {
        self.find_best_worker_in(base, request, None).await
    }

    /// [`HttpClient::find_best_worker`] in a trace: the router continues `trace` (its
    /// `traceparent` and `tracestate`).
    pub async fn find_best_worker_in(
        &self,
        base: &str,
        request: &crate::router_api::FindBestWorker,
        trace: Option<&crate::trace::TraceContext>,
    ) -> Result<crate::router_api::BestWorker, ClientError> {
        use crate::router_api::{BINARY_HASHES, FIND_BEST_WORKER};
        let (url, content_type, body) = match request.to_binary() {
            Some((query, body)) => {
                (format!("{base}{FIND_BEST_WORKER}?{query}"), BINARY_HASHES, Bytes::from(body))
            }
            None => (
                format!("{base}{FIND_BEST_WORKER}"),
                "application/json",
                Bytes::from(serde_json::to_vec(request)?),
            ),
        };
        let mut request = Request::builder()
            .method(Method::POST)
            .uri(url)
            .header(header::CONTENT_TYPE, content_type)
            .body(Full::new(body))?;
        if let Some(trace) = trace {
            trace.write(request.headers_mut());
        }
        json(self.send(request).await?).await
    }

    /// `POST url` with a JSON body, the answer decoded as JSON; a non-2xx answer is an error.
    pub async fn post_json<T: DeserializeOwned>(
        &self,
        url: &str,
        body: &(impl Serialize + ?Sized),
    ) -> Result<T, ClientError> {
        json(self.call(Method::POST, url, Some(body)).await?).await
    }
}

/// Reads a whole body of at most `limit` bytes.
pub async fn read_body(body: Incoming, limit: usize) -> Result<Bytes, ClientError> {
    Limited::new(body, limit)
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .map_err(ClientError::Body)
}

/// A 2xx answer's JSON body; otherwise [`ClientError::Status`] with the error's message.
pub async fn json<T: DeserializeOwned>(response: Response<Incoming>) -> Result<T, ClientError> {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(hyper::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.trim().parse().ok());
    let bytes = read_body(response.into_body(), MAX_BODY).await?;
    if !status.is_success() {
        return Err(ClientError::Status { status, message: error_message(&bytes), retry_after });
    }
    Ok(serde_json::from_slice(&bytes)?)
}

/// The message of an OpenAI-shaped error body, or the start of the body.
pub fn error_message(bytes: &[u8]) -> String {
    match serde_json::from_slice::<ErrorBody>(bytes) {
        Ok(body) => body.error.message,
        Err(_) => String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned(),
    }
}

fn bearer_value(token: &str) -> Option<header::HeaderValue> {
    header::HeaderValue::from_str(&format!("Bearer {token}")).ok().map(|mut v| {
        v.set_sensitive(true);
        v
    })
}
