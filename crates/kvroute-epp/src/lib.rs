//! kvroute as an Endpoint Picker (EPP) behind a Kubernetes inference gateway: Envoy's
//! external processing protocol (`envoy.service.ext_proc.v3.ExternalProcessor`, a
//! bidirectional gRPC stream per HTTP request) served over the front door's stages, as the
//! Gateway API Inference Extension's Endpoint Picker protocol asks
//! (`docs/kubernetes.md`).
//!
//! ```text
//!  gateway ─▶ request headers (subset hint in filter metadata)  ┐
//!          ─▶ request body, buffered or streamed in chunks       ├ exchange.rs: one stream
//!  picker  ─▶ FrontendState::pick (parse, tokenize, hash, admit, │   per request
//!             place; in flight from now)                         │
//!          ◀─ destination header + envoy.lb metadata, the body   │
//!  gateway ─▶ response headers (the endpoint that served)        │
//!          ─▶ response body: prefill done, cached tokens read,   │
//!             the front door's usage chunk dropped               ┘
//!  stream ends or breaks: the request is freed
//! ```
//!
//! - [`metadata`]: the protocol's keys, read and built from Envoy's protobuf types;
//! - [`exchange`]: one request's stream, as a state machine over messages (no I/O: the fuzz
//!   target drives it);
//! - [`picker`]: the front door's stages and the pool's endpoints;
//! - [`service`]: the gRPC service and server, with health; [`tls`]: its listener over TLS;
//! - [`budget`]: the request body bytes the streams hold, in all and per client;
//!
//! The gateway that plays Envoy's side for the tests and the bench is its own crate,
//! `kvroute-test-gateway`, outside the product.

pub mod budget;
pub mod endpoints;
pub mod exchange;
mod frames;
mod hold;
pub mod metadata;
pub mod metrics;
pub mod picker;
pub mod service;
pub mod tls;

pub use endpoints::{Endpoints, host_port, parse_endpoints};
pub use picker::{EppOptions, Picker};
pub use service::{
    DEFAULT_ADDR, EXT_PROC_SERVICE, HANDSHAKE_TIMEOUT, READY_SERVICES, Service, max_message_bytes,
    serve, serve_tls,
};
