//! The ext_proc messages as the exchange reads them (body modes, kinds, header values) and the
//! answers it sends, built from their parts: a routed request's header mutation, headers, body
//! and trailers responses, and a body streamed back in chunks.

use envoy_types::pb::envoy::config::core::v3::HeaderMap as EnvoyHeaders;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation, processing_request,
    processing_response,
};
use tonic::Status;

use crate::metadata;

/// The largest body chunk sent back to the gateway (some gateways refuse chunks past 64 KiB).
pub const CHUNK_BYTES: usize = 62_000;

/// Headers set, and the route cleared (the gateway routes again by the destination).
pub(crate) fn routed(mutation: HeaderMutation) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(mutation),
        clear_route_cache: true,
        ..CommonResponse::default()
    }
}

pub(crate) fn headers_response(common: CommonResponse, request: bool) -> ProcessingResponse {
    let r = HeadersResponse { response: Some(common) };
    let response = match request {
        true => processing_response::Response::RequestHeaders(r),
        false => processing_response::Response::ResponseHeaders(r),
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

pub(crate) fn body_response(common: CommonResponse, request: bool) -> ProcessingResponse {
    let r = BodyResponse { response: Some(common) };
    let response = match request {
        true => processing_response::Response::RequestBody(r),
        false => processing_response::Response::ResponseBody(r),
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

pub(crate) fn trailers(request: bool) -> ProcessingResponse {
    let r = TrailersResponse::default();
    let response = match request {
        true => processing_response::Response::RequestTrailers(r),
        false => processing_response::Response::ResponseTrailers(r),
    };
    ProcessingResponse { response: Some(response), ..ProcessingResponse::default() }
}

/// A request body sent back in full duplex: chunks of at most [`CHUNK_BYTES`], the last one
/// ending the stream (one empty chunk for an empty body).
pub(crate) fn streamed_body(body: &[u8], end: bool) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = match body.is_empty() {
        true => vec![&[][..]],
        false => body.chunks(CHUNK_BYTES).collect(),
    };
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| {
            let streamed = StreamedBodyResponse {
                body: chunk.to_vec(),
                end_of_stream: end && i + 1 == n,
                ..StreamedBodyResponse::default()
            };
            let mutation = body_mutation::Mutation::StreamedResponse(streamed);
            let common = CommonResponse {
                body_mutation: Some(BodyMutation { mutation: Some(mutation) }),
                ..CommonResponse::default()
            };
            body_response(common, true)
        })
        .collect()
}

/// A body mode the gateway names; one no version of the protocol has is an error.
pub(crate) fn mode(m: i32) -> Result<BodySendMode, Status> {
    BodySendMode::try_from(m)
        .map_err(|_| Status::invalid_argument(format!("unknown body send mode {m}")))
}

pub(crate) fn kind(r: &processing_request::Request) -> &'static str {
    use processing_request::Request as R;
    match r {
        R::RequestHeaders(_) => "request headers",
        R::RequestBody(_) => "a request body",
        R::RequestTrailers(_) => "request trailers",
        R::ResponseHeaders(_) => "response headers",
        R::ResponseBody(_) => "a response body",
        R::ResponseTrailers(_) => "response trailers",
    }
}

/// A header's value, as text, from Envoy's headers.
pub(crate) fn header(headers: Option<&EnvoyHeaders>, name: &str) -> Option<String> {
    let h = headers?.headers.iter().find(|h| h.key.eq_ignore_ascii_case(name))?;
    Some(String::from_utf8_lossy(metadata::header_value(h)).into_owned())
}
