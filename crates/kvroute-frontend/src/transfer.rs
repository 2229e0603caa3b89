//! The body fields an engine obeys for a KV (or encoder-cache) transfer, in one place: the
//! front door refuses them from clients on every OpenAI route, and the Endpoint Picker on
//! every body it sees, whatever its path (`kvroute-epp`). Only kvroute's own pairing
//! (`crate::pair`) writes them, unless a trusted upstream pairs engines itself
//! ([`crate::FrontDoorOptions::trust_transfer_fields`]).
//!
//! Read from the engines' own request models (their wheels; the field lists kept in
//! `tests/fixtures/engine-request-fields/`, checked against this list by `tests/transfer.rs`):
//!
//! - vLLM 0.33: `kv_transfer_params` (the KV connector's instructions: hold for a remote
//!   decode, pull from a remote prefill) and `ec_transfer_params` (the same for the encoder
//!   cache), on chat, completions, responses, the token-in-token-out generate API and the
//!   Anthropic and Cohere routes; and `vllm_xargs`, whose keys become the request's
//!   `extra_args`, the very map the connector reads `kv_transfer_params` from: a key of
//!   `vllm_xargs` named like a transfer field is refused too ([`NESTED_IN`]).
//! - SGLang 0.5.23: `bootstrap_host`, `bootstrap_port`, `bootstrap_room`,
//!   `bootstrap_pair_key`, `decode_tp_size` (disaggregated inference), `disagg_prefill_dp_rank`
//!   (which prefill rank holds the KV), and EPD's `encoder_urls`, `need_wait_for_mm_inputs`,
//!   `num_items_assigned`; and `kv_hints`, "set by a trusted orchestrator after worker
//!   selection and never by an application client", read by its hierarchical cache's storage
//!   backends.
//! - TensorRT-LLM: `disaggregated_params`.

use kvroute_http::ApiError;
use serde_json::Value;

/// The body fields that steer an engine's KV or encoder-cache transfer or name a peer engine.
pub const TRANSFER_FIELDS: &[&str] = &[
    "kv_transfer_params",
    "ec_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
    "disaggregated_params",
    "encoder_urls",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "kv_hints",
];

/// Maps whose keys an engine merges into the request as if they were its own fields
/// (vLLM's `vllm_xargs` becomes `extra_args`, where its connector reads the transfer).
pub const NESTED_IN: &[&str] = &["vllm_xargs"];

/// A transfer field found in a body: at its top level, or as a key of `outer`, one of
/// [`NESTED_IN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub outer: Option<&'static str>,
    pub field: &'static str,
}

impl std::fmt::Display for Found {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.outer {
            Some(outer) => write!(f, "{outer}.{}", self.field),
            None => f.write_str(self.field),
        }
    }
}

/// The first transfer field `body` carries (any value, `null` too), at its top level or as a
/// key of one of [`NESTED_IN`].
pub fn find(body: &Value) -> Option<Found> {
    let fields = body.as_object()?;
    if let Some(field) = TRANSFER_FIELDS.iter().find(|f| fields.contains_key(**f)) {
        return Some(Found { outer: None, field });
    }
    NESTED_IN.iter().find_map(|outer| {
        let inner = fields.get(*outer)?.as_object()?;
        let field = TRANSFER_FIELDS.iter().find(|f| inner.contains_key(**f))?;
        Some(Found { outer: Some(outer), field })
    })
}

/// A 400 naming the first transfer field a client's body carries.
pub fn refuse(body: &Value) -> Result<(), ApiError> {
    match find(body) {
        Some(found) => Err(ApiError::bad_request(format!(
            "{found} is set by kvroute itself when it pairs prefill and decode engines; a \
             client may not send it"
        ))
        .param(found.outer.unwrap_or(found.field))),
        None => Ok(()),
    }
}

/// [`refuse`] for the raw bytes of a body on any route, as an engine behind FastAPI reads
/// them: as JSON when its `content_type` is JSON (`application/json`, `+json`) or absent,
/// else as a form ([`refuse_form`]: vLLM's audio routes read `vllm_xargs` from a form field).
/// Of a JSON body:
/// - one that starts with a byte-order mark or has a NUL among its first four bytes is
///   refused: Python's `json.loads` decodes such bytes as UTF-16 or UTF-32 (or UTF-8 with a
///   BOM), where a check of UTF-8 would see nothing;
/// - one that is no object (`[`, a string, a number) carries no field;
/// - an object is parsed whole and checked; one that does not parse (cut, too deep, a number
///   out of range) is refused, since another parser might read what this one could not.
pub fn refuse_bytes(body: &[u8], content_type: Option<&str>) -> Result<(), ApiError> {
    if !content_type.is_none_or(is_json) {
        return refuse_form(body, content_type.unwrap_or_default());
    }
    let bom = [&b"\xEF\xBB\xBF"[..], b"\xFE\xFF", b"\xFF\xFE"];
    if bom.iter().any(|b| body.starts_with(b)) || body.iter().take(4).any(|b| *b == 0) {
        return Err(ApiError::bad_request("a JSON body must be UTF-8 without a byte-order mark"));
    }
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        return Ok(());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(value) => refuse(&value),
        Err(e) => Err(ApiError::bad_request(format!("the request body is not usable JSON: {e}"))),
    }
}

/// A body that is not JSON (a form, a file): refused when it names a transfer field or
/// `vllm_xargs` anywhere, case aside, in its bytes (and, for a URL-encoded form, in its
/// decoded bytes), or when a multipart part's headers are encoded (`name*=`, a
/// `Content-Transfer-Encoding`), which would hide a name from the scan. A scan rather than a
/// form parser: a form field's name is in the bytes whatever parser reads it, and an audio
/// file holding one of these names by chance is a price worth paying.
pub fn refuse_form(body: &[u8], content_type: &str) -> Result<(), ApiError> {
    let decoded;
    let mut scanned: &[u8] = body;
    let lower = content_type.to_ascii_lowercase();
    if lower.starts_with("application/x-www-form-urlencoded") {
        decoded = percent_decoded(body);
        scanned = &decoded;
    }
    if let Some(found) = names().find(scanned) {
        let name = names_list()[found.pattern().as_usize()];
        return Err(ApiError::bad_request(format!(
            "the body names {name}, which kvroute sets itself when it pairs prefill and decode \
             engines; a client may not send it"
        )));
    }
    let encoded = [&b"content-transfer-encoding"[..], b"*="];
    let headers = part_headers(body, content_type);
    if lower.starts_with("multipart/")
        && headers.iter().any(|h| encoded.iter().any(|e| contains_ignoring_case(h, e)))
    {
        return Err(ApiError::bad_request(
            "multipart parts with encoded headers or content are not taken",
        ));
    }
    Ok(())
}

/// Most parts a multipart body is read for (Starlette refuses more than 1,000 fields and
/// files: such a body reaches no engine); past them the whole body is scanned.
const MAX_PARTS: usize = 1_000;

/// The most bytes of a part taken for its headers.
const MAX_PART_HEADERS: usize = 16 << 10;

/// The header blocks of a multipart body's parts (each from its boundary line to the blank
/// line after it, at most [`MAX_PART_HEADERS`]); the whole body when its boundary cannot be
/// read or it has more than [`MAX_PARTS`] parts, so that nothing goes unscanned. A part's
/// content (an audio file) is not a header: bytes like `*=` in it mean nothing. The bounds
/// keep the scan linear in the body, whatever its bytes.
fn part_headers<'b>(body: &'b [u8], content_type: &str) -> Vec<&'b [u8]> {
    let boundary = content_type.split(';').find_map(|p| {
        let (name, value) = p.split_once('=')?;
        name.trim().eq_ignore_ascii_case("boundary").then(|| value.trim().trim_matches('"'))
    });
    let Some(boundary) = boundary.filter(|b| !b.is_empty()) else { return vec![body] };
    let delimiter = format!("--{boundary}").into_bytes();
    let mut blocks = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.windows(delimiter.len()).position(|w| w == delimiter.as_slice()) {
        if blocks.len() == MAX_PARTS {
            return vec![body];
        }
        rest = &rest[at + delimiter.len()..];
        let head = &rest[..rest.len().min(MAX_PART_HEADERS)];
        // The block ends at the first empty line ("\r\n\r\n", or "\n\n").
        let end = head
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map(|e| e + 4)
            .or_else(|| head.windows(2).position(|w| w == b"\n\n").map(|e| e + 2))
            .unwrap_or(head.len());
        blocks.push(&head[..end]);
    }
    blocks
}

/// The transfer fields and [`NESTED_IN`], in one list.
fn names_list() -> &'static [&'static str] {
    static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| TRANSFER_FIELDS.iter().chain(NESTED_IN).copied().collect())
}

/// One automaton for every name of [`names_list`], case aside: a body is scanned once, not
/// once a name.
fn names() -> &'static aho_corasick::AhoCorasick {
    static NAMES: std::sync::OnceLock<aho_corasick::AhoCorasick> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        aho_corasick::AhoCorasick::builder()
            .ascii_case_insensitive(true)
            .build(names_list())
            .unwrap_or_else(|e| unreachable!("a dozen short names: {e}"))
    })
}

fn contains_ignoring_case(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w.eq_ignore_ascii_case(needle))
}

/// `%XX` and `+` decoded, as a URL-encoded form's parser decodes them.
fn percent_decoded(body: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'%' if i + 2 < body.len() => match (hex(body[i + 1]), hex(body[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// Whether a content type is JSON as FastAPI tells it (`json` or `+json` as its subtype).
fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    let subtype = essence.rsplit('/').next().unwrap_or_default().to_ascii_lowercase();
    subtype == "json" || subtype.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn top_level_and_nested_fields_are_found_whatever_their_value() {
        assert_eq!(
            find(&json!({"kv_transfer_params": null})).map(|f| f.to_string()).as_deref(),
            Some("kv_transfer_params")
        );
        assert_eq!(
            find(&json!({"vllm_xargs": {"kv_transfer_params": {"do_remote_decode": true}}}))
                .map(|f| f.to_string())
                .as_deref(),
            Some("vllm_xargs.kv_transfer_params")
        );
        assert_eq!(
            find(&json!({"vllm_xargs": {"ec_transfer_params": 1}}))
                .map(|f| f.to_string())
                .as_deref(),
            Some("vllm_xargs.ec_transfer_params")
        );
        assert_eq!(find(&json!({"vllm_xargs": {"top_k": 3}, "prompt": "x"})), None);
        assert_eq!(find(&json!(["kv_transfer_params"])), None);
        // Escaped keys are decoded before the check, as an engine decodes them.
        let escaped = br#"{"kv_transfer\u005fparams": {}}"#;
        assert!(refuse_bytes(escaped, None).is_err());
        // A duplicate key is found whichever value an engine keeps.
        let dup = br#"{"prompt":"a","kv_transfer_params":{},"kv_transfer_params":null}"#;
        assert!(refuse_bytes(dup, Some("application/json")).is_err());
    }

    #[test]
    fn raw_bodies_are_checked_as_an_engine_parses_them() {
        let json = Some("application/json; charset=utf-8");
        assert!(refuse_bytes(b"", json).is_ok());
        assert!(refuse_bytes(b"[1,2]", json).is_ok());
        assert!(refuse_bytes(b"\"kv_transfer_params\"", json).is_ok());
        let e = refuse_bytes(br#" {"bootstrap_host": "10.0.0.1"}"#, None).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(e.message().starts_with("bootstrap_host is set by kvroute"));
        assert!(refuse_bytes(br#"{"prompt": "x"}"#, Some("application/vnd.x+json")).is_ok());
        // What another parser could read where this one cannot: refused.
        assert!(refuse_bytes(b"{\"prompt\": ", json).is_err(), "cut");
        let deep =
            format!("{{\"kv_transfer_params\":{{}},\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(refuse_bytes(deep.as_bytes(), json).is_err(), "past the depth limit");
        let utf16: Vec<u8> =
            "{\"kv_transfer_params\":{}}".encode_utf16().flat_map(u16::to_be_bytes).collect();
        assert!(refuse_bytes(&utf16, json).is_err(), "UTF-16 (json.loads decodes it)");
        assert!(refuse_bytes(b"\xEF\xBB\xBF{}", None).is_err(), "a byte-order mark");
        // A form: vLLM's audio routes read vllm_xargs from one.
        let multipart = Some("multipart/form-data; boundary=x");
        let part = |name: &str, value: &str| {
            format!(
                "--x\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n--x--\r\n"
            )
        };
        let xargs = part("vllm_xargs", r#"{"kv_transfer\u005fparams": {}}"#);
        assert!(refuse_bytes(xargs.as_bytes(), multipart).is_err());
        assert!(refuse_bytes(part("VLLM_XARGS", "{}").as_bytes(), multipart).is_err());
        let hidden = "--x\r\nContent-Disposition: form-data; name*=utf-8''vllm%5Fxargs\r\n\r\n{}";
        assert!(refuse_bytes(hidden.as_bytes(), multipart).is_err());
        let encoded = "--x\r\nContent-Disposition: form-data; name=\"a\"\r\nContent-Transfer-Encoding: base64\r\n\r\ndmxsbV94YXJncw==\r\n--x--\r\n";
        assert!(refuse_bytes(encoded.as_bytes(), multipart).is_err());
        // A file's content is no header: `*=` in it means nothing.
        let file = part("file", "RIFF\x01*=\x02 content-transfer-encoding");
        assert!(refuse_bytes(file.as_bytes(), multipart).is_ok());
        // Without a boundary to find the parts by, the whole body is scanned; so is one of
        // more parts than any engine takes.
        assert!(refuse_bytes(file.as_bytes(), Some("multipart/form-data")).is_err());
        let many = format!("{}{file}", "--x\r\n\r\n".repeat(MAX_PARTS));
        assert!(refuse_bytes(many.as_bytes(), multipart).is_err());
        assert!(refuse_bytes(part("language", "en").as_bytes(), multipart).is_ok());
        let urlencoded = Some("application/x-www-form-urlencoded");
        assert!(refuse_bytes(b"vllm%5Fxargs=%7B%7D", urlencoded).is_err());
        assert!(refuse_bytes(b"language=en&x=%ZZ%", urlencoded).is_ok());
        assert_eq!(percent_decoded(b"a+b%41%4"), b"a bA%4");
    }
}
