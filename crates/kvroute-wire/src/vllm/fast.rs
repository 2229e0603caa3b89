//! The common vLLM batch, decoded without building a value tree: the map form of
//! `BlockStored` and `BlockRemoved` events, as vLLM >= 0.24 writes them, straight into typed
//! events (token ids and block hashes read into `Vec<u64>` as they are met, map keys compared
//! in place, no `msgpack::Value` made).
//!
//! It decodes a message only when the result is certainly what [`crate::vllm::decode_batch`]'s
//! general path gives, and otherwise says `None`, and the general path decodes the message:
//! any event of another type or the array form, a key read twice, `extra_keys` or
//! `cache_salt` (rare, and nested), a field of an unexpected kind, a truncated message or one
//! over the value budget. The two agree on every input (`tests` below, and the `vllm` fuzz
//! target compares them).

use super::events::{BlockRemoved, BlockStored, EngineEvent, KvEventBatch};
use crate::msgpack::Reader;

pub(crate) fn decode_batch(payload: &[u8]) -> Option<KvEventBatch> {
    let mut r = Reader::new(payload);
    let items = r.array_len()?;
    if items < 2 {
        return None;
    }
    let ts = match r.float() {
        Some(f) => f,
        None => r.int()? as f64,
    };
    let n = r.array_len()?;
    let mut events = Vec::with_capacity(n);
    for _ in 0..n {
        events.push(event(&mut r)?);
    }
    let mut dp_rank = None;
    for i in 2..items {
        let v = r.any(1)?;
        if i == 2 {
            dp_rank = v.as_int().and_then(|x| u32::try_from(x).ok());
        }
    }
    r.at_end().then_some(KvEventBatch { ts, events, dp_rank })
}

#[derive(Default)]
struct Fields {
    kind: Option<Kind>,
    hashes: Option<Vec<u64>>,
    parent: Option<Option<u64>>,
    tokens: Option<Vec<u64>>,
    block_size: Option<Option<u32>>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
    group_idx: Option<Option<u32>>,
    locality: Option<Option<String>>,
    spec_kind: Option<Option<String>>,
    window: Option<Option<u32>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Stored,
    Removed,
}

fn event(r: &mut Reader<'_>) -> Option<EngineEvent> {
    let n = r.map_len()?;
    let mut f = Fields::default();
    for _ in 0..n {
        let key = r.str_ref()?;
        match key {
            "type" => set(&mut f.kind, kind(r)?)?,
            "block_hashes" => set(&mut f.hashes, ints(r, hash)?)?,
            "parent_block_hash" => set(&mut f.parent, opt(r, |r| hash(r.int()?))?)?,
            "token_ids" => set(&mut f.tokens, ints(r, |i| u64::try_from(i).ok())?)?,
            "block_size" => set(&mut f.block_size, opt(r, |r| u32::try_from(r.int()?).ok())?)?,
            "lora_id" => {
                set(&mut f.lora_id, opt(r, |r| r.int())?.and_then(|i| i64::try_from(i).ok()))?;
            }
            "medium" => set(&mut f.medium, opt(r, |r| r.str_ref().map(str::to_owned))?)?,
            "lora_name" => set(&mut f.lora_name, opt(r, |r| r.str_ref().map(str::to_owned))?)?,
            "group_idx" => {
                set(&mut f.group_idx, opt(r, |r| r.int())?.and_then(|i| u32::try_from(i).ok()))?;
            }
            "locality" => set(&mut f.locality, opt(r, |r| r.str_ref().map(str::to_owned))?)?,
            "kv_cache_spec_kind" => {
                set(&mut f.spec_kind, opt(r, |r| r.str_ref().map(str::to_owned))?)?;
            }
            "kv_cache_spec_sliding_window" => {
                set(&mut f.window, opt(r, |r| r.int())?.and_then(|i| u32::try_from(i).ok()))?;
            }
            "extra_keys" | "cache_salt" => return None,
            _ => {
                r.any(3)?; // a field neither event reads
            }
        }
    }
    Some(match f.kind? {
        Kind::Stored => EngineEvent::BlockStored(BlockStored {
            block_hashes: f.hashes?,
            parent_block_hash: f.parent.flatten(),
            token_ids: f.tokens?,
            block_size: f.block_size.flatten()?,
            lora_id: f.lora_id.flatten(),
            medium: f.medium.flatten(),
            lora_name: f.lora_name.flatten(),
            extra_keys: None,
            cache_salt: None,
            group_idx: f.group_idx.flatten(),
            locality: f.locality.flatten(),
            kv_cache_spec_kind: f.spec_kind.flatten(),
            kv_cache_spec_sliding_window: f.window.flatten(),
        }),
        Kind::Removed => EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: f.hashes?,
            medium: f.medium.flatten(),
            group_idx: f.group_idx.flatten(),
            locality: f.locality.flatten(),
        }),
    })
}

/// Records a field read once; a second read of the same key is the general path's to judge
/// (it takes the first).
fn set<T>(slot: &mut Option<T>, v: T) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(v);
    Some(())
}

fn kind(r: &mut Reader<'_>) -> Option<Kind> {
    match r.str_ref()? {
        "BlockStored" => Some(Kind::Stored),
        "BlockRemoved" => Some(Kind::Removed),
        _ => None,
    }
}

/// A nil (`None`), or what `read` makes of the value; `None` overall when `read` refuses it.
fn opt<'a, T>(
    r: &mut Reader<'a>,
    read: impl FnOnce(&mut Reader<'a>) -> Option<T>,
) -> Option<Option<T>> {
    if r.nil()? {
        return Some(None);
    }
    read(r).map(Some)
}

/// An array of integers, each made a `u64` by `conv` (refusing the message if one cannot be).
fn ints(r: &mut Reader<'_>, conv: impl Fn(i128) -> Option<u64>) -> Option<Vec<u64>> {
    let n = r.array_len()?;
    let mut out = Vec::new();
    r.ints_into(n, &mut out, conv)?;
    Some(out)
}

/// A block hash from an integer: unsigned as is, signed as its bits.
fn hash(i: i128) -> Option<u64> {
    u64::try_from(i).ok().or_else(|| i64::try_from(i).ok().map(|s| s as u64))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::vllm::{
        BlockRemoved, BlockStored, EngineEvent, KvEventBatch, decode_batch, decode_batch_general,
        encode_batch,
    };

    fn same(bytes: &[u8]) -> Result<(), TestCaseError> {
        let fast = format!("{:?}", decode_batch(bytes));
        let general = format!("{:?}", decode_batch_general(bytes));
        prop_assert_eq!(fast, general);
        Ok(())
    }

    fn arb_event() -> impl Strategy<Value = EngineEvent> {
        let text = prop::option::of(prop::sample::select(vec!["GPU", "CPU", "a-lora", ""]));
        let stored = (
            prop::collection::vec(any::<u64>(), 0..5),
            prop::option::of(any::<u64>()),
            prop::collection::vec(0u64..200_000, 0..40),
            1u32..64,
            prop::option::of(any::<i64>()),
            text.clone(),
            text.clone(),
            prop::option::of(any::<u32>()),
        )
            .prop_map(|(h, p, t, bs, lid, medium, lora, g)| {
                EngineEvent::BlockStored(BlockStored {
                    block_hashes: h,
                    parent_block_hash: p,
                    token_ids: t,
                    block_size: bs,
                    lora_id: lid,
                    medium: medium.map(str::to_owned),
                    lora_name: lora.map(str::to_owned),
                    group_idx: g,
                    locality: medium.map(|_| "REMOTE".to_owned()),
                    kv_cache_spec_kind: g.map(|_| "sliding_window".to_owned()),
                    kv_cache_spec_sliding_window: g,
                    ..Default::default()
                })
            });
        let removed =
            (prop::collection::vec(any::<u64>(), 0..5), text, prop::option::of(any::<u32>()))
                .prop_map(|(h, medium, g)| {
                    EngineEvent::BlockRemoved(BlockRemoved {
                        block_hashes: h,
                        medium: medium.map(str::to_owned),
                        group_idx: g,
                        locality: g.map(|_| "LOCAL".to_owned()),
                    })
                });
        prop_oneof![4 => stored, 2 => removed, 1 => Just(EngineEvent::AllBlocksCleared)]
    }

    #[test]
    fn a_truncated_timestamp_is_left_to_the_general_path() {
        // A float64 marker with four of its eight bytes (found by the vllm fuzz target: the
        // fast path once read the rest as an int16 timestamp).
        let bytes = [0x93, 0xcb, 0xd1, 0xd1, 0xd1, 0x90, 0x24];
        assert!(super::decode_batch(&bytes).is_none());
        assert!(crate::vllm::decode_batch(&bytes).is_err());
    }

    #[test]
    fn the_common_batch_takes_the_fast_path() {
        let batch = KvEventBatch {
            ts: 1.5,
            events: vec![EngineEvent::BlockStored(BlockStored {
                block_hashes: vec![1, 2],
                token_ids: (0..32).collect(),
                block_size: 16,
                medium: Some("GPU".into()),
                ..Default::default()
            })],
            dp_rank: Some(0),
        };
        let bytes = encode_batch(&batch);
        assert_eq!(super::decode_batch(&bytes), Some(batch));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn fast_and_general_agree(
            events in prop::collection::vec(arb_event(), 0..6),
            dp in prop::option::of(0u32..4),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let bytes = encode_batch(&KvEventBatch { ts: 0.25, events, dp_rank: dp });
            same(&bytes)?;
            // Truncated anywhere, and one byte changed anywhere.
            same(&bytes[..cut.index(bytes.len() + 1)])?;
            let mut changed = bytes;
            let at = flip.index(changed.len());
            changed[at] = byte;
            same(&changed)?;
        }
    }
}
