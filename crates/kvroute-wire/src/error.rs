//! The one error of every decoder in this crate.

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("bad MessagePack: {0}")]
    Msgpack(&'static str),
    #[error("unexpected structure: {0}")]
    Shape(&'static str),
    #[error("a KV event message has 2 or 3 frames, not {0}")]
    Frames(usize),
    #[error("the sequence frame has 8 bytes, not {0}")]
    Sequence(usize),
    #[error("bad JSON: {0}")]
    Json(#[from] serde_json::Error),
}
