//! The engine's cached tokens, read from its answer as it passes (compared with the router's
//! prediction when the request ends), and the error event that ends a broken stream.

use axum::body::Bytes;
use kvroute_core::WorkerId;
use kvroute_http::ApiError;
use serde_json::Value;

/// Finds the engine's cached tokens in an answer as it passes: in an event stream, the usage
/// chunk (dropped when only the front door asked for it; events are passed on whole, as they
/// complete); in a whole JSON answer, its `usage` (the first [`USAGE_SCAN_LIMIT`] bytes).
#[derive(Debug)]
pub(crate) struct Usage {
    pub(crate) sse: bool,
    strip: bool,
    reader: kvroute_http::SseReader,
    whole: Vec<u8>,
    /// Nesting depth of a whole JSON answer so far (`None`: no longer scanned), and the
    /// string state of the scan.
    depth: Option<u32>,
    in_string: bool,
    escaped: bool,
    /// The answer's prompt and completion tokens once its usage passed (taken by the reader).
    pub(crate) counts: Option<(u64, u64)>,
}

impl Default for Usage {
    fn default() -> Self {
        Self {
            sse: false,
            strip: false,
            reader: kvroute_http::SseReader::default(),
            whole: Vec::new(),
            depth: Some(0),
            in_string: false,
            escaped: false,
            counts: None,
        }
    }
}

/// Whole answers longer than this are not scanned for their usage.
const USAGE_SCAN_LIMIT: usize = 1 << 20;

/// An answer's `usage.prompt_tokens_details.cached_tokens` (vLLM reports it only when started
/// with `--enable-prompt-tokens-details`; without it nothing is compared).
fn cached_tokens(v: &Value) -> Option<u64> {
    v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64)
}

/// What the reader needs of an answer or an event, and nothing more: the rest of it is
/// skipped as it is parsed, never built into a [`Value`] (a token's event is ~200 bytes read
/// once per token).
#[derive(Debug, Default, serde::Deserialize)]
struct Peek {
    #[serde(default)]
    usage: Option<PeekUsage>,
    #[serde(default)]
    choices: Option<Vec<serde::de::IgnoredAny>>,
}

#[derive(Debug, serde::Deserialize)]
struct PeekUsage {
    #[serde(default)]
    prompt_tokens_details: Option<PeekDetails>,
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Debug, serde::Deserialize)]
struct PeekDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// An answer's or event's cached tokens, whether it is a usage-only chunk (its choices
/// empty) and its prompt and completion tokens; `None` when it is not JSON. Read through
/// [`Peek`], or, when a field is not of the type the peek expects, through a [`Value`], as
/// before.
fn peek(json: &[u8]) -> Option<Peeked> {
    if let Ok(p) = serde_json::from_slice::<Peek>(json) {
        let usage_only = p.choices.is_some_and(|c| c.is_empty());
        let Some(usage) = p.usage else { return Some((None, usage_only, None)) };
        let counts = usage.prompt_tokens.zip(usage.completion_tokens);
        let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
        return Some((cached, usage_only, counts));
    }
    let v = serde_json::from_slice::<Value>(json).ok()?;
    let usage_only = v.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty);
    let count = |name: &str| v.get("usage")?.get(name)?.as_u64();
    let counts = count("prompt_tokens").zip(count("completion_tokens"));
    Some((cached_tokens(&v), usage_only, counts))
}

/// What [`peek`] reads: the cached tokens, whether the chunk is usage only, and the prompt
/// and completion tokens.
type Peeked = (Option<u64>, bool, Option<(u64, u64)>);

impl Usage {
    /// A reader of an event stream (`sse`) or a whole JSON answer; `strip`: drop the usage
    /// chunk of a stream, which only the front door asked for.
    pub(crate) fn new(sse: bool, strip: bool) -> Self {
        Self { sse, strip, ..Self::default() }
    }

    /// Feeds one byte of a whole JSON answer; true when it closes the top-level value.
    fn scan(&mut self, b: u8) -> bool {
        let Some(depth) = self.depth.as_mut() else { return false };
        if self.in_string {
            match (self.escaped, b) {
                (true, _) => self.escaped = false,
                (false, b'\\') => self.escaped = true,
                (false, b'"') => self.in_string = false,
                _ => {}
            }
            return false;
        }
        match b {
            b'"' => self.in_string = true,
            b'{' | b'[' => *depth += 1,
            b'}' | b']' => {
                *depth = depth.saturating_sub(1);
                return *depth == 0;
            }
            _ => {}
        }
        false
    }

    /// The bytes to pass on, and the cached tokens if this chunk completed the usage.
    pub(crate) fn pass(&mut self, bytes: Bytes) -> (Bytes, Option<u64>) {
        if !self.sse {
            if self.whole.len() + bytes.len() > USAGE_SCAN_LIMIT {
                self.whole = Vec::new();
                self.depth = None; // too long to scan: not compared
                return (bytes, None);
            }
            self.whole.extend_from_slice(&bytes);
            // Parsed once, when the top-level object closes (a running count of brackets
            // outside strings), not at every chunk.
            let complete = self.depth.is_some_and(|_| bytes.iter().any(|&b| self.scan(b)));
            let peeked = complete.then(|| peek(&self.whole)).flatten();
            let Some((served, _, counts)) = peeked else { return (bytes, None) };
            self.counts = counts;
            return (bytes, served);
        }
        let mut out = Vec::with_capacity(bytes.len());
        let mut served = None;
        for event in self.reader.push(&bytes) {
            match event {
                kvroute_http::SseEvent::Done => out.extend_from_slice(b"data: [DONE]\n\n"),
                kvroute_http::SseEvent::Data(data) => {
                    let (found, usage_only, counts) =
                        peek(data.as_bytes()).unwrap_or((None, false, None));
                    if found.is_some() {
                        served = found;
                    }
                    if counts.is_some() {
                        self.counts = counts;
                    }
                    if self.strip && found.is_some() {
                        if usage_only {
                            continue;
                        }
                        // The usage rides on a chunk with choices (once per answer): that
                        // chunk alone is rebuilt without it.
                        if let Ok(mut v) = serde_json::from_str::<Value>(&data) {
                            if let Some(o) = v.as_object_mut() {
                                o.remove("usage");
                            }
                            out.extend_from_slice(format!("data: {v}\n\n").as_bytes());
                            continue;
                        }
                    }
                    out.extend_from_slice(b"data: ");
                    out.extend_from_slice(data.as_bytes());
                    out.extend_from_slice(b"\n\n");
                }
            }
        }
        (Bytes::from(out), served)
    }
}

/// An error event ending a broken stream (the shape vLLM sends mid-stream), then `[DONE]`.
pub(crate) fn stream_error_event(worker: WorkerId) -> String {
    let error = ApiError::new(
        axum::http::StatusCode::BAD_GATEWAY,
        format!("worker {worker} failed mid-answer; the answer is incomplete"),
    );
    let body = serde_json::to_string(&error.body()).unwrap_or_default();
    format!("data: {body}\n\ndata: [DONE]\n\n")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A whole answer is scanned once it closes, whatever its chunking (brackets inside
    /// strings do not count).
    #[test]
    fn the_usage_of_a_whole_answer_is_found_at_its_end() {
        let answer = br#"{"choices":[{"message":{"content":"a } tricky \" { text ]"}}],"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        for cut in 1..answer.len() {
            let mut u = Usage::default();
            let (_, first) = u.pass(Bytes::copy_from_slice(&answer[..cut]));
            let (_, second) = u.pass(Bytes::copy_from_slice(&answer[cut..]));
            assert_eq!((first, second), (None, Some(32)), "cut at {cut}");
        }
        let mut u = Usage::default();
        let (_, none) = u.pass(Bytes::from_static(br#"{"usage":{"prompt_tokens":4}}"#));
        assert_eq!(none, None, "no details: nothing to compare");
    }

    /// A stream the front door asked for usage: the usage chunk is read and dropped; a
    /// stream whose client asked keeps it.
    #[test]
    fn a_usage_chunk_only_the_front_door_asked_for_is_dropped() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n";
        for strip in [true, false] {
            let mut u = Usage { sse: true, strip, ..Usage::default() };
            let (a, s1) = u.pass(Bytes::copy_from_slice(&stream.as_bytes()[..30]));
            let (b, s2) = u.pass(Bytes::copy_from_slice(&stream.as_bytes()[30..]));
            let out = String::from_utf8([a, b].concat()).unwrap();
            assert_eq!((s1, s2), (None, Some(16)));
            assert_eq!(out.contains("usage"), !strip, "{out}");
            assert!(out.contains("\"hi\"") && out.ends_with("data: [DONE]\n\n"), "{out}");
        }
    }

    /// The typed peek reads what a `Value` would: over the shapes engines send and odd ones.
    #[test]
    fn the_peek_reads_what_a_value_would() {
        let by_value = |json: &str| {
            let v = serde_json::from_str::<Value>(json).ok()?;
            let empty = v.get("choices").and_then(Value::as_array).is_some_and(Vec::is_empty);
            Some((cached_tokens(&v), empty))
        };
        let cases = [
            r#"{"choices":[{"delta":{"content":"x"}}],"usage":null}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":16}}}"#,
            r#"{"choices":[{"index":0}],"usage":{"prompt_tokens_details":{"cached_tokens":0}}}"#,
            r#"{"usage":{"prompt_tokens_details":null}}"#,
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":"16"}},"choices":[]}"#,
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":16.5}}}"#,
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":-1}}}"#,
            r#"{"usage":"none","choices":{}}"#,
            r#"{"choices":null}"#,
            r#"[{"usage":{"prompt_tokens_details":{"cached_tokens":16}}}]"#,
            r#"{"usage":{"prompt_tokens_details":{"cached_tokens":16}},"usage":{}}"#,
            r#"not json"#,
            r#"{}"#,
        ];
        for json in cases {
            let peeked = peek(json.as_bytes()).map(|(cached, usage_only, _)| (cached, usage_only));
            assert_eq!(peeked, by_value(json), "{json}");
        }
    }
}
