//! What preparing a request can fail with: a model, an image, a prompt too long.

use kvroute_http::ApiError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PreprocessError {
    #[error("model directory {path}: {message}")]
    Model { path: String, message: String },
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
    #[error("tokenizer")]
    Tokenizer(#[source] tokenizers::Error),
    #[error("image: {0}")]
    Image(#[from] ImageError),
    /// The image's bytes are no image this server reads.
    #[error("image: {what}: {source}")]
    ImageDecode { what: &'static str, source: image::ImageError },
    #[error("image larger than {limit} bytes")]
    ImageTooLarge { limit: usize },
    #[error(
        "image of {width} x {height} pixels: above the {limit} pixels left for this request's images; resize it"
    )]
    ImagePixels { width: u32, height: u32, limit: u64 },
    #[error("{count} images in one request; at most {limit}")]
    TooManyImages { count: usize, limit: usize },
    #[error("the request names {parts} images but {given} were given")]
    ImageCount { parts: usize, given: usize },
    #[error("model {model:?} takes text only; remove the image parts{why}")]
    TextOnly { model: String, why: String },
    /// Refused by size before tokenizing.
    #[error(transparent)]
    TooLong(#[from] TooLong),
}

/// What is wrong with an image reference or its bytes, before it is decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    #[error("not a data: URL")]
    NotDataUrl,
    #[error("a data: URL needs a ',' before its data")]
    NoComma,
    #[error("only base64 data: URLs are supported")]
    NotBase64,
    #[error("bad base64 in data: URL")]
    BadBase64(#[source] base64::DecodeError),
    #[error("decoding stopped: {0}")]
    DecodeStopped(String),
    #[cfg(feature = "fetch")]
    #[error("{0}")]
    Fetch(#[from] FetchError),
}

/// A request that cannot fit the model's context, told before it is tokenized.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TooLong {
    #[error(
        "{messages} messages cannot fit in this model's maximum context length of {max_model_len} tokens"
    )]
    Messages { messages: usize, max_model_len: u64 },
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, your request has {bytes} bytes of text, more than {max_model_len} tokens. Please reduce the length of the input messages."
    )]
    Text { bytes: usize, max_model_len: u64 },
}

impl From<PreprocessError> for ApiError {
    /// What a client did wrong is a 4xx with its message; a broken model directory or
    /// tokenizer is this server's fault (a 500 whose details are logged, not sent).
    fn from(e: PreprocessError) -> Self {
        match e {
            PreprocessError::ImageTooLarge { .. } => ApiError::too_large(e.to_string()),
            PreprocessError::ImagePixels { .. } | PreprocessError::TooManyImages { .. } => {
                ApiError::bad_request(e.to_string())
            }
            PreprocessError::Model { .. } | PreprocessError::Tokenizer(_) => ApiError::internal(e),
            PreprocessError::Template(_)
            | PreprocessError::Image(_)
            | PreprocessError::ImageDecode { .. }
            | PreprocessError::ImageCount { .. }
            | PreprocessError::TextOnly { .. }
            | PreprocessError::TooLong(_) => ApiError::bad_request(e.to_string()),
        }
    }
}

#[cfg(feature = "fetch")]
/// Why an image could not be fetched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    #[error("an extra root certificate is unusable: {source}")]
    RootCertificate { source: rustls::Error },
    #[error("TLS setup: {source}")]
    TlsSetup { source: rustls::Error },
    #[error("fetching {url}: no answer within {after:?}")]
    Timeout { url: String, after: std::time::Duration },
    #[error("bad image URL {url:?}: {source}")]
    BadUrl { url: String, source: hyper::http::uri::InvalidUri },
    #[error("unsupported image URL {0:?}: use http(s):// or data:")]
    Scheme(String),
    #[error("image URL {0:?} has no host")]
    NoHost(String),
    #[error("resolving {host}: {source}")]
    Resolve { host: String, source: std::io::Error },
    #[error("image host {0} resolves only to private or local addresses, which are not fetched")]
    Private(String),
    #[error("connecting to {host}: {source}")]
    Connect { host: String, source: std::io::Error },
    #[error("TLS name {name:?}: {source}")]
    TlsName { name: String, source: rustls::pki_types::InvalidDnsNameError },
    #[error("TLS with {host}: {source}")]
    Tls { host: String, source: std::io::Error },
    #[error("talking to {authority}: {source}")]
    Handshake { authority: String, source: hyper::Error },
    #[error("building the request for {url}: {source}")]
    Request { url: String, source: hyper::http::Error },
    #[error("fetching {url}: {source}")]
    Send { url: String, source: hyper::Error },
    #[error("fetching {url}: HTTP {status} (redirects are not followed)")]
    Status { url: String, status: hyper::StatusCode },
    #[error("reading {url}: {source}")]
    Read { url: String, source: Box<dyn std::error::Error + Send + Sync> },
}

#[cfg(feature = "fetch")]
impl From<FetchError> for PreprocessError {
    fn from(e: FetchError) -> Self {
        PreprocessError::Image(e.into())
    }
}
