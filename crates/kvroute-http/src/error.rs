//! One error type for every HTTP answer kvroute gives: OpenAI's shape
//! `{"error":{"message","type","param","code"}}` (as vLLM answers it, `code` the HTTP status),
//! a message written for the client, and the underlying error kept as a source for the log,
//! never for the body. Every 5xx is logged with its source chain when it is turned into a
//! response.

use std::error::Error as StdError;
use std::fmt;

use axum::Json;
use axum::extract::rejection::{BytesRejection, JsonRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

type Source = Box<dyn StdError + Send + Sync + 'static>;

/// An error as an OpenAI-compatible client expects it.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<std::borrow::Cow<'static, str>>,
    /// OpenAI's `type` when not the status's.
    kind: Option<&'static str>,
    code: Code,
    source: Option<Source>,
    /// Seconds after which the client may try again (the `Retry-After` header; 0: none). A
    /// `u32` beside the status keeps the error within 128 bytes.
    retry_after: u32,
}

/// The `code` of an error body: the HTTP status by default (as vLLM answers), a name where
/// OpenAI gives one (`invalid_api_key`), or none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ErrorCode {
    Status(u16),
    Name(String),
}

#[derive(Debug, Clone, Copy)]
enum Code {
    Status,
    Name(&'static str),
    None,
}

/// The body of an error answer, for clients that read one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub param: Option<String>,
    #[serde(default)]
    pub code: Option<ErrorCode>,
}

impl ApiError {
    /// An error whose OpenAI `type` follows from its status; `message` is shown to the client.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            kind: None,
            code: Code::Status,
            source: None,
            retry_after: 0,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, message)
    }

    /// A failure of this server: the client reads only "internal error"; `source` is logged.
    pub fn internal(source: impl Into<Source>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error").with_source(source)
    }

    /// An upstream (worker or router) failed: `message` says which, `source` how (logged).
    pub fn bad_gateway(message: impl Into<String>, source: impl Into<Source>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, message).with_source(source)
    }

    /// Names the request field at fault.
    #[must_use]
    pub fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param.into());
        self
    }

    /// [`ApiError::param`] of a name known only at run time (a client's field).
    #[must_use]
    pub fn param_owned(mut self, param: String) -> Self {
        self.param = Some(param.into());
        self
    }

    /// Sets OpenAI's `type` (otherwise derived from the status).
    #[must_use]
    pub fn kind(mut self, kind: &'static str) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Sets a named `code` (otherwise the status).
    #[must_use]
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Code::Name(code);
        self
    }

    /// A `code` of `null`.
    #[must_use]
    pub fn no_code(mut self) -> Self {
        self.code = Code::None;
        self
    }

    /// Tells the client to try again after `secs` seconds (`Retry-After`, at least 1).
    #[must_use]
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = u32::try_from(secs).unwrap_or(u32::MAX).max(1);
        self
    }

    /// The `Retry-After` this answer carries, seconds.
    pub fn retry_after_secs(&self) -> Option<u64> {
        (self.retry_after > 0).then_some(u64::from(self.retry_after))
    }

    /// A request refused because the fleet is saturated or its tenant is over its share:
    /// 429 with `Retry-After`.
    pub fn too_many(message: impl Into<String>, retry_after: u64) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, message).retry_after(retry_after)
    }

    /// Keeps the error behind this one (logged for a 5xx, never sent).
    #[must_use]
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// OpenAI's `type`: as set, else by status.
    pub fn type_name(&self) -> &'static str {
        if let Some(kind) = self.kind {
            return kind;
        }
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The body a client receives.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.type_name().to_owned(),
                param: self.param.as_deref().map(str::to_owned),
                code: match self.code {
                    Code::Status => Some(ErrorCode::Status(self.status.as_u16())),
                    Code::Name(name) => Some(ErrorCode::Name(name.to_owned())),
                    Code::None => None,
                },
            },
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)?;
        if let Some(source) = &self.source {
            write!(f, ": {}", Chain(source.as_ref()))?;
        }
        Ok(())
    }
}

impl StdError for ApiError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source.as_deref().map(|s| s as &(dyn StdError + 'static))
    }
}

/// An error and its sources, `a: b: c` (for logs).
pub fn chain(e: &(dyn StdError + 'static)) -> String {
    Chain(e).to_string()
}

/// An error and its sources, `a: b: c`.
struct Chain<'a>(&'a (dyn StdError + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            write!(f, ": {e}")?;
            next = e.source();
        }
        Ok(())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let status = match rejection.status() {
            s @ (StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::PAYLOAD_TOO_LARGE) => s,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(status, rejection.body_text())
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        // The listener's body budget (server::BodyBudget) is the server's state, not the
        // client's error: 503, to be retried.
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&rejection);
        while let Some(e) = source {
            if e.is::<crate::server::BodyBudget>() {
                return Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                    .kind("server_error");
            }
            source = e.source();
        }
        let status = match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(status, rejection.body_text())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // A refusal with `Retry-After` is load shed on purpose, not a failure to log.
        if self.status.is_server_error() && self.retry_after == 0 {
            match &self.source {
                Some(source) => tracing::error!(
                    status = self.status.as_u16(),
                    message = %self.message,
                    source = %Chain(source.as_ref()),
                    "request failed"
                ),
                None => tracing::error!(
                    status = self.status.as_u16(),
                    message = %self.message,
                    "request failed"
                ),
            }
        }
        let retry_after = self.retry_after_secs();
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(secs) = retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use http_body_util::BodyExt;

    async fn body(e: ApiError) -> (StatusCode, serde_json::Value) {
        let response = e.into_response();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn internals_stay_out_of_the_body() {
        let io = std::io::Error::other("connection reset by 10.0.0.7:8000");
        let e = ApiError::bad_gateway("the worker failed", io);
        assert!(e.to_string().contains("10.0.0.7"), "kept for the log: {e}");
        assert!(e.source().is_some());
        let (status, v) = body(e).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(v["error"]["message"], "the worker failed");
        assert!(!v.to_string().contains("10.0.0.7"), "{v}");
        let (status, v) = body(ApiError::internal(std::io::Error::other("secret path"))).await;
        assert_eq!(
            (status, v["error"]["message"].as_str()),
            (StatusCode::INTERNAL_SERVER_ERROR, Some("internal error"))
        );
        assert_eq!(v["error"]["type"], "server_error");
    }

    #[tokio::test]
    async fn openai_shape_with_param_and_code() {
        let (status, v) =
            body(ApiError::bad_request("messages must not be empty").param("messages")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let parsed: ErrorBody = serde_json::from_value(v).unwrap();
        assert_eq!(parsed.error.kind, "invalid_request_error");
        assert_eq!(parsed.error.param.as_deref(), Some("messages"));
        assert_eq!(parsed.error.code, Some(ErrorCode::Status(400)));
        let (_, v) = body(ApiError::not_found("no such route")).await;
        assert_eq!(v["error"]["type"], "not_found_error");
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
    }
}
