//! Engine events -> kvroute-core events: the one place engine quirks are normalised.
//!
//! - `tokens_hash` is recomputed from the block's token ids and the images it covers (plus the
//!   LoRA name and cache salt), exactly as the front door hashes a request, so the router can
//!   match requests against engine blocks; the engine's own block hash is kept only as the
//!   worker-local name of the block.
//! - Image placeholders become the model's image pad token (`image_token_id`, what the front
//!   door writes at image positions): SGLang's pad values (above u32 or at/above the
//!   vocabulary size; a run of one value is one image, the value its `mm_hash`) and
//!   TensorRT-LLM's `vocab_size + 1`. vLLM writes the real pad id and names the image in
//!   `extra_keys`; TensorRT-LLM names it in `mm_keys`.
//! - Each event names its tier ([`kvroute_core::StorageTier`]): vLLM's and SGLang's `medium` (`GPU`, `CPU`,
//!   `STORAGE`, with `locality` `REMOTE` for a store outside the engine), TensorRT-LLM's
//!   `cache_level` (0 the device, 1 host memory, 2 and up disk; a move between levels,
//!   `updated`, becomes a removal and a store, `convert/trtllm_stream.rs`), and its cache group
//!   (`group_idx`, with what the group keeps: `kv_cache_spec_kind`, a sliding window's length).
//!   A medium nobody defines is counted and skipped, as are a group of a kind the router does
//!   not model, a lower tier of a group beyond the first, blocks of another block size, and
//!   malformed or unknown events.

mod converter;
mod residency;
mod trtllm_stream;

pub use converter::{ConvertConfig, ConvertStats, Converter};
pub use residency::MAX_REMEMBERED;
