//! A hybrid model's sliding-window cache group, as vLLM 0.33's hybrid allocator keeps it
//! (`v1/core/single_type_kv_cache_manager.py`, `SlidingWindowManager`; the coordinator in
//! `kv_cache_coordinator.py`):
//!
//! - **one pool, two groups**: every computed block is cached in the full-attention group
//!   (0) and in the window group (1), each copy its own block, evicted on its own;
//! - **behind the window**: once a request has computed `c` tokens, its window blocks wholly
//!   before token `c - window + 1` are given back (`remove_skipped_blocks`); they stay cached
//!   until evicted, and being given back early they are evicted early;
//! - **a hit** is the full-attention prefix cut where the window group can serve it: scanning
//!   from its last block down, the first run of `ceil((window - 1) / bs)` blocks the window
//!   group holds ends the hit; with none, the run from block 0 is the hit
//!   (`find_longest_cache_hit`);
//! - **events** name the group (`group_idx`) and, on `BlockStored`, its kind
//!   (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`), as `KVCacheManager.take_events`
//!   annotates them.
//!
//! The model's window comes from its `config.json` ([`from_model_dir`]).

use std::path::Path;

use kvroute_wire::BlockStored;

/// Window blocks a hit must end on (vLLM's `_contiguous_blocks_for_hit`, without EAGLE).
pub fn blocks_needed(window: u32, block_size: usize) -> usize {
    (window as usize).saturating_sub(1).div_ceil(block_size.max(1)).max(1)
}

/// The hit within the first `candidate` blocks (the full-attention prefix) that the window
/// group serves: `holds(i)` tells whether it holds block `i`.
pub fn hit(candidate: usize, needed: usize, holds: impl Fn(usize) -> bool) -> usize {
    let mut contiguous = 0;
    for i in (0..candidate).rev() {
        if !holds(i) {
            contiguous = 0;
            continue;
        }
        contiguous += 1;
        if contiguous >= needed {
            // Trim what follows the run: [NULL, NULL, 8, 3, NULL, 9] -> [NULL, NULL, 8, 3].
            return i + contiguous;
        }
    }
    // No run long enough: the blocks held from block 0 are the hit.
    contiguous
}

/// Names a hybrid model's block event's group and what the group keeps.
pub(crate) fn name_group(event: &mut BlockStored, group: u32, window: u32) {
    event.group_idx = Some(group);
    let (kind, window) = match group {
        0 => ("full_attention", None),
        _ => ("sliding_window", Some(window)),
    };
    event.kv_cache_spec_kind = Some(kind.to_owned());
    event.kv_cache_spec_sliding_window = window;
}

/// A model directory's `config.json` that cannot be read as a hybrid model.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

/// The sliding window of a hybrid model (full-attention layers beside sliding-window ones)
/// declared by `dir/config.json`, as Gemma-style configs declare it: `sliding_window` with
/// `layer_types` naming both `full_attention` and `sliding_attention` layers, or with
/// `sliding_window_pattern` (every n-th layer full). `None` without a config, without a
/// window, with `use_sliding_window: false` (Qwen2-style), or when every layer slides
/// (Mistral-style: one window group, which the simulated engine does not model; it then
/// simulates full attention and says so).
pub fn from_model_dir(dir: &Path) -> Result<Option<u32>, ModelConfigError> {
    let path = dir.join("config.json");
    let shown = path.display().to_string();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ModelConfigError::Read { path: shown, source }),
    };
    let invalid =
        |reason: &str| ModelConfigError::Invalid { path: shown.clone(), reason: reason.to_owned() };
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| invalid(&format!("not JSON: {e}")))?;
    // Multimodal configs keep the language model's under `text_config`.
    let config = config.get("text_config").filter(|c| c.is_object()).unwrap_or(&config);
    let window = match config.get("sliding_window") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(w) => w.as_u64().filter(|&w| (2..=u64::from(u32::MAX)).contains(&w)),
    };
    let window = window.ok_or_else(|| invalid("sliding_window must be a whole number >= 2"))?;
    if config.get("use_sliding_window").and_then(serde_json::Value::as_bool) == Some(false) {
        return Ok(None);
    }
    let hybrid = match config.get("layer_types").and_then(serde_json::Value::as_array) {
        Some(types) => {
            let has = |kind: &str| types.iter().any(|t| t.as_str() == Some(kind));
            if !has("sliding_attention") {
                return Ok(None);
            }
            has("full_attention")
        }
        None => config
            .get("sliding_window_pattern")
            .and_then(serde_json::Value::as_u64)
            .is_some_and(|n| n >= 2),
    };
    if !hybrid {
        tracing::warn!(
            config = %shown,
            "every layer of this model slides its window: the simulated engine models full attention"
        );
        return Ok(None);
    }
    Ok(Some(window as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hit_ends_on_the_last_run_long_enough() {
        // vLLM's docstring: [NULL, NULL, 8, 3, NULL, 9] -> [NULL, NULL, 8, 3] for 2 blocks.
        let held = [false, false, true, true, false, true];
        assert_eq!(hit(6, 2, |i| held[i]), 4);
        // No run of 3: the run from block 0 (none here).
        assert_eq!(hit(6, 3, |i| held[i]), 0);
        let from_start = [true, true, false, true];
        assert_eq!(hit(4, 3, |i| from_start[i]), 2);
        // The candidate bounds the scan.
        assert_eq!(hit(3, 2, |i| held[i]), 0);
        assert_eq!(hit(4, 2, |i| held[i]), 4);
        assert_eq!(blocks_needed(8, 4), 2);
        assert_eq!(blocks_needed(64, 16), 4);
        assert_eq!(blocks_needed(65, 16), 4);
        assert_eq!(blocks_needed(66, 16), 5);
    }

    #[test]
    fn a_config_declares_a_hybrid_window() {
        let dir = std::env::temp_dir().join(format!("kvroute-window-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let with = |json: &str| {
            std::fs::write(dir.join("config.json"), json).unwrap();
            from_model_dir(&dir)
        };
        let layers =
            r#"{"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}"#;
        assert_eq!(with(layers).unwrap(), Some(64));
        let pattern = r#"{"text_config": {"sliding_window": 512, "sliding_window_pattern": 6}}"#;
        assert_eq!(with(pattern).unwrap(), Some(512));
        assert_eq!(with(r#"{"sliding_window": 4096}"#).unwrap(), None, "every layer slides");
        let off =
            r#"{"sliding_window": 4096, "use_sliding_window": false, "sliding_window_pattern": 2}"#;
        assert_eq!(with(off).unwrap(), None);
        assert_eq!(with(r#"{"sliding_window": null}"#).unwrap(), None);
        assert!(with(r#"{"sliding_window": -1}"#).is_err());
        assert!(with("not json").is_err());
        std::fs::remove_file(dir.join("config.json")).unwrap();
        assert_eq!(from_model_dir(&dir).unwrap(), None, "no config");
        std::fs::remove_dir(&dir).ok();
    }
}
