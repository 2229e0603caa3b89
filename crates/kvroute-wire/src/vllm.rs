//! vLLM's (and SGLang's) KV event batches: ZMQ frames `[topic, seq u64 BE, payload]`, payload a
//! MessagePack array `[ts, events, dp_rank]`. Events are maps with a `"type"` key (vLLM >= 0.24,
//! SGLang >= 0.5.20) or positional arrays with the tag first (older vLLM). Decoding is tolerant:
//! unknown keys and extra positional items are ignored, missing optional fields are `None`, a
//! malformed event becomes [`EngineEvent::Malformed`] instead of failing the whole batch.

use crate::WireError;
use crate::msgpack::{self, Value, Writer};

mod events;
mod fast;

pub use events::{BlockRemoved, BlockStored, EngineEvent, ExtraKey, KvEventBatch};

/// Splits a ZMQ message into topic, sequence number and payload. Accepts `[topic, seq,
/// payload]` and the topic-less `[seq, payload]`.
pub fn split_frames<F: AsRef<[u8]>>(frames: &[F]) -> Result<(&[u8], u64, &[u8]), WireError> {
    let (topic, seq, payload) = match frames {
        [topic, seq, payload] => (topic.as_ref(), seq.as_ref(), payload.as_ref()),
        [seq, payload] => (&[][..], seq.as_ref(), payload.as_ref()),
        _ => return Err(WireError::Frames(frames.len())),
    };
    let seq: [u8; 8] = seq.try_into().map_err(|_| WireError::Sequence(seq.len()))?;
    Ok((topic, u64::from_be_bytes(seq), payload))
}

/// Decodes a batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<KvEventBatch, WireError> {
    match fast::decode_batch(payload) {
        Some(batch) => Ok(batch),
        None => decode_batch_general(payload),
    }
}

/// [`decode_batch`] through a full `msgpack::Value` tree: every shape the decoder takes (the
/// fast path decodes the common one and leaves the rest here; the fuzz target compares them).
pub fn decode_batch_general(payload: &[u8]) -> Result<KvEventBatch, WireError> {
    let value = msgpack::decode(payload)?;
    let items = value.as_array().ok_or(WireError::Shape("a batch is an array"))?;
    let ts = match items.first() {
        Some(Value::Float(f)) => *f,
        Some(Value::Int(i)) => *i as f64,
        _ => return Err(WireError::Shape("a batch starts with its timestamp")),
    };
    let events = items
        .get(1)
        .and_then(Value::as_array)
        .ok_or(WireError::Shape("a batch's second item is its events"))?
        .iter()
        .map(decode_event)
        .collect();
    let dp_rank = items.get(2).and_then(Value::as_int).and_then(|r| u32::try_from(r).ok());
    Ok(KvEventBatch { ts, events, dp_rank })
}

fn decode_event(value: &Value) -> EngineEvent {
    let (kind, fields) = match value {
        Value::Map(_) => match value.get("type").and_then(Value::as_str) {
            Some(kind) => (kind, Fields::Map(value)),
            None => return EngineEvent::Malformed { reason: "event map without a type" },
        },
        Value::Ints(_) => return EngineEvent::Malformed { reason: "event array without a tag" },
        Value::Array(items) => match items.first().and_then(Value::as_str) {
            Some(kind) => (kind, Fields::Array(items)),
            None => return EngineEvent::Malformed { reason: "event array without a tag" },
        },
        _ => return EngineEvent::Malformed { reason: "event is neither a map nor an array" },
    };
    let result = match kind {
        "BlockStored" => stored(&fields).map(EngineEvent::BlockStored),
        "BlockRemoved" => removed(&fields).map(EngineEvent::BlockRemoved),
        "AllBlocksCleared" => Ok(EngineEvent::AllBlocksCleared),
        other => Ok(EngineEvent::Unknown { kind: other.to_owned() }),
    };
    result.unwrap_or_else(|reason| EngineEvent::Malformed { reason })
}

/// Named (map) or positional (array, tag at 0) access to an event's fields.
enum Fields<'a> {
    Map(&'a Value),
    Array(&'a [Value]),
}

impl Fields<'_> {
    /// The field `name`, at `position` in the array form; `Nil` and absent are both `None`.
    fn get(&self, name: &str, position: usize) -> Option<&Value> {
        let v = match self {
            Self::Map(m) => m.get(name),
            Self::Array(a) => a.get(position),
        };
        v.filter(|v| !v.is_nil())
    }
}

// Positions in the array form (vLLM <= 0.23): the tag, then the fields in declaration order.
const STORED_POSITIONS: [usize; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 9];
const REMOVED_POSITIONS: [usize; 3] = [1, 2, 3];

fn stored(f: &Fields<'_>) -> Result<BlockStored, &'static str> {
    let [hashes, parent, tokens, size, lora_id, medium, lora_name, extra, group] = STORED_POSITIONS;
    Ok(BlockStored {
        block_hashes: hash_list(f.get("block_hashes", hashes)).ok_or("block_hashes")?,
        parent_block_hash: match f.get("parent_block_hash", parent) {
            None => None,
            Some(v) => Some(block_hash(v).ok_or("parent_block_hash")?),
        },
        token_ids: f
            .get("token_ids", tokens)
            .and_then(Value::as_ints)
            .ok_or("token_ids")?
            .into_iter()
            .map(|i| u64::try_from(i).ok())
            .collect::<Option<_>>()
            .ok_or("token_ids")?,
        block_size: f
            .get("block_size", size)
            .and_then(Value::as_int)
            .and_then(|i| u32::try_from(i).ok())
            .ok_or("block_size")?,
        lora_id: f
            .get("lora_id", lora_id)
            .and_then(Value::as_int)
            .and_then(|i| i64::try_from(i).ok()),
        medium: f.get("medium", medium).and_then(Value::as_str).map(str::to_owned),
        lora_name: f.get("lora_name", lora_name).and_then(Value::as_str).map(str::to_owned),
        extra_keys: f.get("extra_keys", extra).and_then(Value::as_array).map(|blocks| {
            blocks
                .iter()
                .map(|b| b.as_array().map(|keys| keys.iter().map(extra_key).collect()))
                .collect()
        }),
        // Not positional in any array-form version.
        cache_salt: match f {
            Fields::Map(m) => m.get("cache_salt").and_then(Value::as_str).map(str::to_owned),
            Fields::Array(_) => None,
        },
        group_idx: f
            .get("group_idx", group)
            .and_then(Value::as_int)
            .and_then(|i| u32::try_from(i).ok()),
        locality: named(f, "locality").and_then(Value::as_str).map(str::to_owned),
        kv_cache_spec_kind: named(f, "kv_cache_spec_kind")
            .and_then(Value::as_str)
            .map(str::to_owned),
        kv_cache_spec_sliding_window: named(f, "kv_cache_spec_sliding_window")
            .and_then(Value::as_int)
            .and_then(|i| u32::try_from(i).ok()),
    })
}

/// A field that is not positional in any array-form version.
fn named<'a>(f: &Fields<'a>, name: &str) -> Option<&'a Value> {
    match f {
        Fields::Map(m) => m.get(name).filter(|v| !v.is_nil()),
        Fields::Array(_) => None,
    }
}

fn removed(f: &Fields<'_>) -> Result<BlockRemoved, &'static str> {
    let [hashes, medium, group] = REMOVED_POSITIONS;
    Ok(BlockRemoved {
        block_hashes: hash_list(f.get("block_hashes", hashes)).ok_or("block_hashes")?,
        medium: f.get("medium", medium).and_then(Value::as_str).map(str::to_owned),
        group_idx: f
            .get("group_idx", group)
            .and_then(Value::as_int)
            .and_then(|i| u32::try_from(i).ok()),
        locality: named(f, "locality").and_then(Value::as_str).map(str::to_owned),
    })
}

fn hash_list(v: Option<&Value>) -> Option<Vec<u64>> {
    match v? {
        Value::Ints(ints) => ints.iter().map(|&i| block_hash(&Value::Int(i))).collect(),
        other => other.as_array()?.iter().map(block_hash).collect(),
    }
}

/// A block hash as u64: unsigned as is, signed as its bits, bytes as their last 8, big-endian.
fn block_hash(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => {
            u64::try_from(*i).ok().or_else(|| i64::try_from(*i).ok().map(|s| s as u64))
        }
        Value::Bin(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Some(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => None,
    }
}

fn extra_key(v: &Value) -> ExtraKey {
    match v {
        Value::Str(s) => ExtraKey::Text(s.clone()),
        Value::Array(pair) => match pair.as_slice() {
            [Value::Str(id), offset, ..] => ExtraKey::Mm(
                id.clone(),
                offset.as_int().and_then(|o| i64::try_from(o).ok()).unwrap_or(0),
            ),
            _ => ExtraKey::Other(()),
        },
        _ => ExtraKey::Other(()),
    }
}

/// Encodes a batch in vLLM's map form (as vLLM >= 0.24 writes it: `lora_id`, `lora_name` and
/// `parent_block_hash` always present, nil when unset; `extra_keys`, `cache_salt` and
/// `group_idx` only when set).
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut w = Writer::default();
    w.array(3);
    w.f64(batch.ts);
    let events: Vec<&EngineEvent> = batch
        .events
        .iter()
        .filter(|e| !matches!(e, EngineEvent::Unknown { .. } | EngineEvent::Malformed { .. }))
        .collect();
    w.array(events.len());
    for event in events {
        match event {
            EngineEvent::BlockStored(s) => encode_stored(&mut w, s),
            EngineEvent::BlockRemoved(r) => {
                let optional = [r.group_idx.is_some(), r.locality.is_some()];
                w.map(
                    2 + usize::from(r.medium.is_some()) + optional.iter().filter(|&&x| x).count(),
                );
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                hashes(&mut w, &r.block_hashes);
                if let Some(medium) = &r.medium {
                    w.str("medium");
                    w.str(medium);
                }
                if let Some(g) = r.group_idx {
                    w.str("group_idx");
                    w.uint(u64::from(g));
                }
                if let Some(locality) = &r.locality {
                    w.str("locality");
                    w.str(locality);
                }
            }
            _ => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    match batch.dp_rank {
        Some(r) => w.uint(u64::from(r)),
        None => w.nil(),
    }
    w.buf
}

fn encode_stored(w: &mut Writer, s: &BlockStored) {
    let optional = [
        s.extra_keys.is_some(),
        s.cache_salt.is_some(),
        s.group_idx.is_some(),
        s.medium.is_some(),
        s.locality.is_some(),
        s.kv_cache_spec_kind.is_some(),
        s.kv_cache_spec_sliding_window.is_some(),
    ];
    // As vLLM's msgspec encoder writes it: a 16-bit map header whatever the count.
    w.map16(7 + optional.iter().filter(|&&x| x).count() as u16);
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    hashes(w, &s.block_hashes);
    w.str("parent_block_hash");
    match s.parent_block_hash {
        Some(p) => w.uint(p),
        None => w.nil(),
    }
    w.str("token_ids");
    w.array(s.token_ids.len());
    for &t in &s.token_ids {
        w.uint(t);
    }
    w.str("block_size");
    w.uint(u64::from(s.block_size));
    w.str("lora_id");
    match s.lora_id {
        Some(id) => w.int(id),
        None => w.nil(),
    }
    if let Some(medium) = &s.medium {
        w.str("medium");
        w.str(medium);
    }
    w.str("lora_name");
    match &s.lora_name {
        Some(name) => w.str(name),
        None => w.nil(),
    }
    if let Some(blocks) = &s.extra_keys {
        w.str("extra_keys");
        w.array(blocks.len());
        for block in blocks {
            let Some(keys) = block else {
                w.nil();
                continue;
            };
            let keys: Vec<&ExtraKey> =
                keys.iter().filter(|k| !matches!(k, ExtraKey::Other(()))).collect();
            w.array(keys.len());
            for key in keys {
                match key {
                    ExtraKey::Mm(id, offset) => {
                        w.array(2);
                        w.str(id);
                        w.int(*offset);
                    }
                    ExtraKey::Text(t) => w.str(t),
                    ExtraKey::Other(()) => {}
                }
            }
        }
    }
    if let Some(salt) = &s.cache_salt {
        w.str("cache_salt");
        w.str(salt);
    }
    if let Some(g) = s.group_idx {
        w.str("group_idx");
        w.uint(u64::from(g));
    }
    if let Some(locality) = &s.locality {
        w.str("locality");
        w.str(locality);
    }
    if let Some(kind) = &s.kv_cache_spec_kind {
        w.str("kv_cache_spec_kind");
        w.str(kind);
    }
    if let Some(window) = s.kv_cache_spec_sliding_window {
        w.str("kv_cache_spec_sliding_window");
        w.uint(u64::from(window));
    }
}

fn hashes(w: &mut Writer, hashes: &[u64]) {
    w.array(hashes.len());
    for &h in hashes {
        w.uint(h);
    }
}

/// The `extra_keys` entry a publisher writes for an image of `mm_hash` starting at
/// `offset_in_block` (maps back to the same `mm_hash` through the identifier rule).
pub fn publisher_mm_key(mm_hash: u64, offset_in_block: i64) -> ExtraKey {
    ExtraKey::Mm(format!("{mm_hash:016x}"), offset_in_block)
}

/// A block's images as `extra_keys`, in the publisher form.
pub fn publisher_extra_keys(info: &kvroute_core::BlockExtraInfo) -> Vec<ExtraKey> {
    info.mm_objects
        .iter()
        .map(|o| publisher_mm_key(o.mm_hash, o.offsets.first().map_or(0, |r| r.0 as i64)))
        .collect()
}
