//! Reading a `text/event-stream` (OpenAI's streamed answers): [`SseReader`] splits bytes, cut
//! anywhere, into the events' `data:` payloads; comments and keep-alives are skipped and
//! `data: [DONE]` ends the stream.

/// What one server-sent event carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SseEvent {
    /// The event's data lines, joined with `\n`.
    Data(String),
    /// `data: [DONE]`.
    Done,
}

/// Splits a stream into events, across arbitrary chunking.
#[derive(Debug, Default)]
pub struct SseReader {
    buffer: Vec<u8>,
}

impl SseReader {
    /// Feeds bytes; returns the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buffer.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buffer) {
            let event: Vec<u8> = self.buffer.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(&event[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if data.is_empty() {
                continue; // a comment or keep-alive
            }
            let payload = data.join("\n");
            out.push(if payload.trim() == "[DONE]" {
                SseEvent::Done
            } else {
                SseEvent::Data(payload)
            });
        }
        out
    }

    /// Bytes of an event not yet complete.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }
}

/// Where the first event ends (a blank line) and the separator's length.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_any_chunking() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        for cut in 1..stream.len() {
            let mut reader = SseReader::default();
            let mut events = reader.push(&stream[..cut]);
            events.extend(reader.push(&stream[cut..]));
            assert_eq!(
                events,
                [
                    SseEvent::Data("{\"a\":1}".into()),
                    SseEvent::Data("{\"b\":2}".into()),
                    SseEvent::Done
                ],
                "cut at {cut}"
            );
            assert_eq!(reader.pending(), 0);
        }
    }

    #[test]
    fn multi_line_data_joins() {
        let mut reader = SseReader::default();
        assert_eq!(reader.push(b"data: a\ndata: b\n\n"), [SseEvent::Data("a\nb".into())]);
    }
}
