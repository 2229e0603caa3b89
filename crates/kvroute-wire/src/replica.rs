//! What router replicas tell each other over NATS (docs/replicas.md), as JSON:
//!
//! - [`SyncBatch`]: one replica's routing decisions and their lifecycle (routed, prefill done,
//!   freed), batched, on the fleet's decisions subject. Peers apply them to their in-flight
//!   accounting so N replicas price load as one router would.
//! - [`IndexSnapshot`]: the index as events with the event-stream sequence it covers, kept in
//!   JetStream for a new replica to start warm.
//!
//! The relayed engine events themselves travel as kvroute `RouterEvent` JSON
//! ([`decode_router_events`](crate::decode_router_events)). Every decoder bounds what it accepts
//! (bytes, messages, block hashes) before anything is allocated for it beyond the parse.

use kvroute_core::RouterEvent;
use serde::{Deserialize, Serialize};

use crate::WireError;

/// Largest decisions message accepted (NATS's default payload limit is 1 MiB).
pub const MAX_SYNC_BYTES: usize = 1 << 20;
/// Most messages in one batch.
pub const MAX_SYNC_MESSAGES: usize = 1024;
/// Most block hashes one routed request may carry (a 1M-token prompt in 16-token blocks).
pub const MAX_SYNC_BLOCKS: usize = 1 << 16;
/// Longest replica name and request id.
pub const MAX_SYNC_ID_BYTES: usize = 256;

/// A batch of one replica's decisions, in the order it made them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncBatch {
    /// The sending replica (unique per process).
    pub replica: String,
    #[serde(default)]
    pub messages: Vec<SyncMessage>,
}

/// One step of a routed request's life, or a sign of life.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SyncMessage {
    /// A request was routed to `worker_id`/`dp_rank`: `prefill_tokens` of its `isl_tokens`
    /// prompt tokens to compute, its blocks' content hashes in order.
    Routed {
        id: String,
        worker_id: u64,
        #[serde(default)]
        dp_rank: u32,
        isl_tokens: usize,
        prefill_tokens: usize,
        local_hashes: Vec<u64>,
        /// Tokens its answer may run to (its `max_tokens`; 0 when unknown, as from a replica
        /// older than the field): the peers hold its answer's blocks on its worker too.
        #[serde(default)]
        output_tokens: usize,
        /// The trace the decision was made in (its W3C `traceparent`, at most
        /// [`MAX_SYNC_ID_BYTES`]): a peer that exports spans records hearing of it there.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        traceparent: Option<String>,
    },
    /// Its first token arrived: its prefill no longer queues.
    PrefillDone { id: String },
    /// It ended (completed, failed, abandoned).
    Freed { id: String },
    /// Nothing routed for a while; the replica is alive.
    Heartbeat,
    /// The requests flow control holds waiting at the replica, per priority (highest first;
    /// empty when none wait): peers admit no request of a lower priority while these wait.
    /// Sent in a batch of its own, which a replica older than the message refuses whole.
    Queues { bands: Vec<(i32, u32)> },
}

/// Most priorities a queue report names (kvroute's priorities run from -100 to 100).
pub const MAX_SYNC_BANDS: usize = 201;

impl SyncMessage {
    fn check(&self) -> Result<(), WireError> {
        let id = match self {
            Self::Routed { id, local_hashes, isl_tokens, prefill_tokens, traceparent, .. } => {
                if local_hashes.len() > MAX_SYNC_BLOCKS {
                    return Err(WireError::Shape("too many block hashes"));
                }
                if traceparent.as_ref().is_some_and(|t| t.len() > MAX_SYNC_ID_BYTES) {
                    return Err(WireError::Shape("traceparent too long"));
                }
                if prefill_tokens > isl_tokens {
                    return Err(WireError::Shape("prefill tokens above the prompt's"));
                }
                id
            }
            Self::PrefillDone { id } | Self::Freed { id } => id,
            Self::Heartbeat => return Ok(()),
            Self::Queues { bands } => {
                return match bands.len() > MAX_SYNC_BANDS {
                    true => Err(WireError::Shape("too many priorities in a queue report")),
                    false => Ok(()),
                };
            }
        };
        match id.len() {
            0 => Err(WireError::Shape("empty request id")),
            n if n > MAX_SYNC_ID_BYTES => Err(WireError::Shape("request id too long")),
            _ => Ok(()),
        }
    }
}

/// Decodes a decisions message, refusing oversized or malformed ones as a whole.
pub fn decode_sync(bytes: &[u8]) -> Result<SyncBatch, WireError> {
    if bytes.len() > MAX_SYNC_BYTES {
        return Err(WireError::Shape("decisions message too large"));
    }
    let batch: SyncBatch = serde_json::from_slice(bytes)?;
    if batch.replica.is_empty() || batch.replica.len() > MAX_SYNC_ID_BYTES {
        return Err(WireError::Shape("replica name empty or too long"));
    }
    if batch.messages.len() > MAX_SYNC_MESSAGES {
        return Err(WireError::Shape("too many messages in one batch"));
    }
    batch.messages.iter().try_for_each(SyncMessage::check)?;
    Ok(batch)
}

pub fn encode_sync(batch: &SyncBatch) -> Vec<u8> {
    serde_json::to_vec(batch).unwrap_or_default()
}

/// The index as events, covering the event stream up to `stream_seq` (inclusive).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexSnapshot {
    pub stream_seq: u64,
    /// Unix milliseconds when it was taken.
    #[serde(default)]
    pub taken_at_ms: u64,
    pub events: Vec<RouterEvent>,
}

/// Largest snapshot read (the index's default budget, 16M pairs, dumps to far less: a dump
/// stores each tree edge once).
pub const MAX_SNAPSHOT_BYTES: usize = 1 << 30;

pub fn decode_snapshot(bytes: &[u8]) -> Result<IndexSnapshot, WireError> {
    if bytes.len() > MAX_SNAPSHOT_BYTES {
        return Err(WireError::Shape("snapshot too large"));
    }
    Ok(serde_json::from_slice(bytes)?)
}

pub fn encode_snapshot(snapshot: &IndexSnapshot) -> Vec<u8> {
    serde_json::to_vec(snapshot).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_round_trip_and_bad_ones_are_refused() {
        let batch = SyncBatch {
            replica: "r1".into(),
            messages: vec![
                SyncMessage::Routed {
                    id: "a".into(),
                    worker_id: 3,
                    dp_rank: 1,
                    isl_tokens: 40,
                    prefill_tokens: 8,
                    local_hashes: vec![1, 2],
                    output_tokens: 64,
                    traceparent: Some(
                        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
                    ),
                },
                SyncMessage::PrefillDone { id: "a".into() },
                SyncMessage::Freed { id: "a".into() },
                SyncMessage::Heartbeat,
                SyncMessage::Queues { bands: vec![(10, 3), (-1, 1)] },
            ],
        };
        let bytes = encode_sync(&batch);
        assert_eq!(decode_sync(&bytes).unwrap(), batch);
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.contains(r#""kind":"prefill_done""#), "{text}");
        for bad in [
            r#"{"replica":"","messages":[]}"#,
            r#"{"replica":"r","messages":[{"kind":"freed","id":""}]}"#,
            r#"{"replica":"r","messages":[{"kind":"routed","id":"a","worker_id":1,"isl_tokens":1,"prefill_tokens":2,"local_hashes":[]}]}"#,
            r#"{"replica":"r","messages":[{"kind":"exploded"}]}"#,
            "[]",
        ] {
            assert!(decode_sync(bad.as_bytes()).is_err(), "{bad}");
        }
        let bands: Vec<(i32, u32)> = (0..=MAX_SYNC_BANDS as i32).map(|p| (p, 1)).collect();
        let many = SyncBatch { replica: "r".into(), messages: vec![SyncMessage::Queues { bands }] };
        assert!(decode_sync(&encode_sync(&many)).is_err(), "too many priorities");
        let long = format!(r#"{{"replica":"{}"}}"#, "x".repeat(MAX_SYNC_ID_BYTES + 1));
        assert!(decode_sync(long.as_bytes()).is_err());
    }

    #[test]
    fn snapshots_round_trip() {
        let s = IndexSnapshot { stream_seq: 9, taken_at_ms: 1, events: Vec::new() };
        assert_eq!(decode_snapshot(&encode_snapshot(&s)).unwrap(), s);
        assert!(decode_snapshot(b"{\"stream_seq\":-1,\"events\":[]}").is_err());
    }
}
