//! The event pipeline: one worker rank's engine messages, as its socket receives them, to core
//! events and what conversion did with them.
//!
//! ```text
//!  frames ──Pipeline::frame──▶ Framed { seq, payload } ──Pipeline::decode──▶ Decoded { events, stats }
//!              (the format's framing)        (the format's decoder + Converter, then the rank)
//! ```
//!
//! Each [`EventFormat`] has one [`FormatDecoder`] ([`EventFormat::decoder`] matches every format,
//! with no fallback), so a new format is a new variant, a new decoder and nothing else. The
//! data-parallel rank an event lands on is decided here alone ([`Pipeline::decode`]): the rank
//! the engine named, else the subscription's. The subscriber (ZMQ, replay, gaps), the fuzz
//! targets and the tests all go through [`Pipeline`], so what they decode is what the router
//! applies.

use std::fmt;
use std::str::FromStr;

use kvroute_core::{DpRank, KvCacheEvent, RouterEvent, WorkerId, WorkerWithDpRank};
use serde::{Deserialize, Serialize};

use crate::convert::{ConvertConfig, ConvertStats, Converter};
use crate::{WireError, decode_router_events, trtllm, vllm};

/// How a worker publishes its KV events (in flags and files alike: `vllm`, `sglang`,
/// `trtllm-json`, `trtllm-msgpack`, `kvroute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum EventFormat {
    /// vLLM: ZMQ `[topic, seq, msgpack batch]`.
    #[default]
    Vllm,
    /// SGLang: the same wire as vLLM's (its publisher follows vLLM's), kept by name so a
    /// configuration prints back as written.
    Sglang,
    /// TensorRT-LLM event dicts as JSON, one ZMQ frame (or `[topic, payload]`).
    TrtllmJson,
    /// TensorRT-LLM event dicts as MessagePack.
    TrtllmMsgpack,
    /// kvroute's own `RouterEvent` JSON.
    Kvroute,
}

/// A format name that is none of [`EventFormat`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown event format {0:?} (vllm, sglang, trtllm-json, trtllm-msgpack, kvroute)")]
pub struct UnknownFormat(pub String);

impl EventFormat {
    pub fn name(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::TrtllmJson => "trtllm-json",
            Self::TrtllmMsgpack => "trtllm-msgpack",
            Self::Kvroute => "kvroute",
        }
    }

    /// The format's decoder: every format named, none falling back to another's.
    pub fn decoder(self) -> &'static dyn FormatDecoder {
        match self {
            Self::Vllm => &Vllm,
            Self::Sglang => &Sglang,
            Self::TrtllmJson => &Trtllm { msgpack: false },
            Self::TrtllmMsgpack => &Trtllm { msgpack: true },
            Self::Kvroute => &KvrouteJson,
        }
    }
}

impl fmt::Display for EventFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl TryFrom<String> for EventFormat {
    type Error = UnknownFormat;
    fn try_from(s: String) -> Result<Self, UnknownFormat> {
        s.parse()
    }
}

impl From<EventFormat> for String {
    fn from(f: EventFormat) -> String {
        f.name().to_owned()
    }
}

impl FromStr for EventFormat {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, UnknownFormat> {
        match s {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            "trtllm-json" => Ok(Self::TrtllmJson),
            "trtllm-msgpack" => Ok(Self::TrtllmMsgpack),
            "kvroute" => Ok(Self::Kvroute),
            other => Err(UnknownFormat(other.to_owned())),
        }
    }
}

/// One message, framed: its payload and, for formats that number their batches, the
/// sequence number (gaps and restarts are seen by it, and missed batches replayed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Framed<'a> {
    pub seq: Option<u64>,
    pub payload: &'a [u8],
}

/// A converted event and whom the engine said it belongs to (`None`: the subscription's
/// worker, or rank).
#[derive(Clone, Debug, PartialEq)]
pub struct Tagged {
    pub worker: Option<WorkerId>,
    pub rank: Option<DpRank>,
    pub event: KvCacheEvent,
}

/// How a format's messages carry their payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// `[topic, seq, payload]`: numbered batches (vLLM's publisher).
    Sequenced,
    /// The last frame is the payload (`[payload]` or `[topic, payload]`), unnumbered.
    LastFrame,
}

impl Framing {
    /// The payload (and sequence number) of one message's frames, read in place.
    pub fn frame<F: AsRef<[u8]>>(self, frames: &[F]) -> Result<Framed<'_>, WireError> {
        match self {
            Self::Sequenced => {
                let (_topic, seq, payload) = vllm::split_frames(frames)?;
                Ok(Framed { seq: Some(seq), payload })
            }
            Self::LastFrame => {
                let payload = frames.last().ok_or(WireError::Frames(0))?.as_ref();
                Ok(Framed { seq: None, payload })
            }
        }
    }
}

/// One engine format: how its messages are framed and how a payload becomes core events.
pub trait FormatDecoder: Sync {
    /// How its messages are framed.
    fn framing(&self) -> Framing;

    /// One payload's events, converted by `converter` (which counts what it kept and skipped).
    fn decode(
        &self,
        framed: Framed<'_>,
        converter: &mut Converter,
    ) -> Result<Vec<Tagged>, WireError>;
}

/// A vLLM batch: its rank, when it names one, is every event's.
fn vllm_batch(framed: Framed<'_>, converter: &mut Converter) -> Result<Vec<Tagged>, WireError> {
    let batch = vllm::decode_batch(framed.payload)?;
    let rank = batch.dp_rank.map(DpRank);
    let events = converter.vllm_batch(&batch, framed.seq.unwrap_or(0));
    Ok(events.into_iter().map(|event| Tagged { worker: None, rank, event }).collect())
}

/// TensorRT-LLM events: `attention_dp_rank` 0 is what it writes without attention data
/// parallelism, so only a rank above 0 names one.
fn trtllm_events(events: &[trtllm::TrtEvent], converter: &mut Converter) -> Vec<Tagged> {
    let mut out = Vec::with_capacity(events.len());
    let mut converted = Vec::with_capacity(2);
    for e in events {
        let rank = e.attention_dp_rank.filter(|&r| r != 0).map(DpRank);
        converter.trtllm_event(e, &mut converted);
        out.extend(converted.drain(..).map(|event| Tagged { worker: None, rank, event }));
    }
    out
}

/// vLLM's publisher (`[topic, seq, batch]`).
#[derive(Debug)]
pub struct Vllm;

impl FormatDecoder for Vllm {
    fn framing(&self) -> Framing {
        Framing::Sequenced
    }

    fn decode(&self, f: Framed<'_>, c: &mut Converter) -> Result<Vec<Tagged>, WireError> {
        vllm_batch(f, c)
    }
}

/// SGLang's publisher: vLLM's wire (SGLang's `kv_events` follows vLLM's layout field by
/// field), a format of its own so that where the two part, only this changes.
#[derive(Debug)]
pub struct Sglang;

impl FormatDecoder for Sglang {
    fn framing(&self) -> Framing {
        Framing::Sequenced
    }

    fn decode(&self, f: Framed<'_>, c: &mut Converter) -> Result<Vec<Tagged>, WireError> {
        vllm_batch(f, c)
    }
}

/// TensorRT-LLM's event dicts, as JSON or as MessagePack (its publisher writes either).
#[derive(Debug)]
pub struct Trtllm {
    pub msgpack: bool,
}

impl FormatDecoder for Trtllm {
    fn framing(&self) -> Framing {
        Framing::LastFrame
    }

    fn decode(&self, f: Framed<'_>, c: &mut Converter) -> Result<Vec<Tagged>, WireError> {
        let events = match self.msgpack {
            true => trtllm::decode_msgpack(f.payload)?,
            false => trtllm::decode_json(f.payload)?,
        };
        Ok(trtllm_events(&events, c))
    }
}

/// kvroute's `RouterEvent` JSON: already core events, each naming its worker and rank.
#[derive(Debug)]
pub struct KvrouteJson;

impl FormatDecoder for KvrouteJson {
    fn framing(&self) -> Framing {
        Framing::LastFrame
    }

    fn decode(&self, f: Framed<'_>, _: &mut Converter) -> Result<Vec<Tagged>, WireError> {
        let events = decode_router_events(f.payload)?;
        Ok(events
            .into_iter()
            .map(|e| Tagged {
                worker: Some(e.worker_id),
                rank: Some(e.event.dp_rank),
                event: e.event,
            })
            .collect())
    }
}

/// One message's events, placed on their worker and rank, and what conversion did with its
/// blocks (this message's counts alone).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decoded {
    pub events: Vec<RouterEvent>,
    pub stats: ConvertStats,
}

/// One worker rank's event stream: its format's decoder and its converter, which lives as long
/// as the stream (TensorRT-LLM's moves between tiers name a block the stream stored earlier).
/// What was converted is counted per message, in [`Decoded::stats`]; the router adds them up
/// per worker.
#[derive(Clone, Debug)]
pub struct Pipeline {
    worker: WorkerWithDpRank,
    format: EventFormat,
    converter: Converter,
}

impl Pipeline {
    pub fn new(worker: WorkerWithDpRank, format: EventFormat, convert: ConvertConfig) -> Self {
        Self { worker, format, converter: Converter::new(convert) }
    }

    /// The payload and sequence number of one message as the socket received it (its
    /// frames read in place: `Vec<u8>`s, or the socket's own `Bytes`).
    pub fn frame<'a, F: AsRef<[u8]>>(&self, frames: &'a [F]) -> Result<Framed<'a>, WireError> {
        self.format.decoder().framing().frame(frames)
    }

    /// One payload's events, each on the worker and rank the engine named, else the
    /// subscription's: the one place a rank is given to an event. A payload that does not
    /// decode yields nothing and counts nothing.
    pub fn decode(&mut self, framed: Framed<'_>) -> Result<Decoded, WireError> {
        self.converter.take_stats();
        let tagged = self.format.decoder().decode(framed, &mut self.converter)?;
        let events = tagged
            .into_iter()
            .map(|Tagged { worker, rank, mut event }| {
                event.dp_rank = rank.unwrap_or(self.worker.dp_rank);
                RouterEvent { worker_id: worker.unwrap_or(self.worker.worker_id), event }
            })
            .collect();
        Ok(Decoded { events, stats: self.converter.take_stats() })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use kvroute_core::{BlockSize, KvCacheEventData};

    use super::*;
    use crate::vllm::{BlockStored, EngineEvent, KvEventBatch, encode_batch};

    fn batch(dp_rank: Option<u32>) -> Vec<u8> {
        let stored = BlockStored {
            block_hashes: vec![11],
            parent_block_hash: None,
            token_ids: (0..4).collect(),
            block_size: 4,
            lora_name: None,
            medium: None,
            extra_keys: None,
            cache_salt: None,
            group_idx: None,
            lora_id: None,
            locality: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        };
        let events = vec![EngineEvent::BlockStored(stored), EngineEvent::AllBlocksCleared];
        encode_batch(&KvEventBatch { ts: 0.0, events, dp_rank })
    }

    fn pipeline(format: EventFormat) -> Pipeline {
        let worker = WorkerWithDpRank::new(WorkerId(7), 3);
        Pipeline::new(worker, format, ConvertConfig::new(BlockSize::new(4).unwrap()))
    }

    #[test]
    fn every_format_prints_back_as_it_is_named() {
        for f in [
            EventFormat::Vllm,
            EventFormat::Sglang,
            EventFormat::TrtllmJson,
            EventFormat::TrtllmMsgpack,
            EventFormat::Kvroute,
        ] {
            assert_eq!(f.name().parse::<EventFormat>().unwrap(), f);
        }
        assert!("zmq".parse::<EventFormat>().is_err());
    }

    /// The rank a batch names wins; a batch naming none lands on the subscription's rank.
    #[test]
    fn a_vllm_batch_lands_on_its_named_rank_else_the_subscriptions() {
        for (named, want) in [(Some(1), 1), (None, 3)] {
            let mut p = pipeline(EventFormat::Vllm);
            let frames = vec![b"kv".to_vec(), 5u64.to_be_bytes().to_vec(), batch(named)];
            let framed = p.frame(&frames).unwrap();
            assert_eq!(framed.seq, Some(5));
            let decoded = p.decode(framed).unwrap();
            assert_eq!(decoded.events.len(), 2);
            for e in &decoded.events {
                assert_eq!(
                    (e.worker_id, e.event.dp_rank, e.event.event_id),
                    (WorkerId(7), DpRank(want), 5)
                );
            }
            assert!(matches!(decoded.events[1].event.data, KvCacheEventData::Cleared));
            assert_eq!((decoded.stats.blocks_stored, decoded.stats.clears), (1, 1));
        }
    }

    /// Stats are per message (what the router adds up per worker, as here).
    #[test]
    fn the_totals_add_up_each_messages_counts() {
        let mut p = pipeline(EventFormat::Sglang);
        let mut totals = ConvertStats::default();
        for seq in 0..3u64 {
            let frames = vec![seq.to_be_bytes().to_vec(), batch(None)];
            let d = p.decode(p.frame(&frames).unwrap()).unwrap();
            assert_eq!(d.stats.blocks_stored, 1);
            totals += d.stats;
        }
        assert_eq!((totals.blocks_stored, totals.clears), (3, 3));
        assert!(p.decode(Framed { seq: Some(9), payload: b"\xc1" }).is_err());
        assert_eq!(totals.blocks_stored, 3, "an undecodable payload counts nothing");
    }

    #[test]
    fn unsequenced_formats_take_the_last_frame() {
        let p = pipeline(EventFormat::TrtllmJson);
        let frames = vec![b"topic".to_vec(), b"[]".to_vec()];
        assert_eq!(p.frame(&frames).unwrap(), Framed { seq: None, payload: b"[]" });
        assert!(p.frame::<Vec<u8>>(&[]).is_err());
        let v = pipeline(EventFormat::Vllm);
        assert!(v.frame(&[b"x".to_vec()]).is_err(), "vLLM needs its sequence frame");
    }

    /// kvroute JSON names its own worker and rank; TensorRT-LLM's rank 0 names none.
    #[test]
    fn kvroute_json_keeps_its_worker_and_trtllm_rank_zero_is_unnamed() {
        let json = br#"{"worker_id":9,"event":{"event_id":1,"data":"cleared","dp_rank":2}}"#;
        let mut p = pipeline(EventFormat::Kvroute);
        let d = p.decode(Framed { seq: None, payload: json }).unwrap();
        assert_eq!((d.events[0].worker_id, d.events[0].event.dp_rank), (WorkerId(9), DpRank(2)));

        let trt = |rank: u32| {
            format!(
                r#"[{{"event_id":1,"data":{{"type":"removed","block_hashes":[5]}},"attention_dp_rank":{rank}}}]"#
            )
        };
        for (named, want) in [(0, 3), (2, 2)] {
            let mut p = pipeline(EventFormat::TrtllmJson);
            let text = trt(named);
            let d = p.decode(Framed { seq: None, payload: text.as_bytes() }).unwrap();
            assert_eq!(d.events[0].event.dp_rank, DpRank(want), "{text}");
            assert_eq!(d.stats.blocks_removed, 1);
        }
    }
}
