//! A step's KV events as the engine publishes them: runs of stored and removed blocks per
//! medium and cache group, in order ([`Events`]).

use kvroute_core::SequenceHash;
use kvroute_wire::{BlockRemoved, BlockStored, EngineEvent, ExtraKey, publisher_extra_keys};

use crate::host::Tier;
use crate::sequence::Sequence;

use crate::kv::Slot;

/// Collects a step's events in order, runs of one kind merged. A hybrid model's events
/// name their cache group and its kind, as vLLM's do; a full-attention model's name none
/// (as they always have here).
#[derive(Debug, Default)]
pub(super) struct Events {
    pub(super) events: Vec<EngineEvent>,
    /// The sliding window of a hybrid model.
    pub(super) window: Option<u32>,
}

impl Events {
    pub(super) fn new(window: Option<u32>) -> Self {
        Self { events: Vec::new(), window }
    }

    /// Evicted GPU blocks, in the order they went.
    pub(super) fn removed(&mut self, gone: &[Slot]) {
        for s in gone {
            self.removed_from(&[s.hash], GPU, s.group);
        }
    }

    pub(super) fn removed_from(&mut self, gone: &[SequenceHash], medium: &str, group: u32) {
        if gone.is_empty() {
            return;
        }
        let group_idx = self.window.map(|_| group);
        if let Some(EngineEvent::BlockRemoved(r)) = self.events.last_mut()
            && r.medium.as_deref() == Some(medium)
            && r.group_idx == group_idx
        {
            r.block_hashes.extend(gone.iter().map(|s| s.0));
            return;
        }
        self.events.push(EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: gone.iter().map(|s| s.0).collect(),
            medium: Some(medium.to_owned()),
            group_idx,
            locality: None,
        }));
    }

    /// `BlockStored` for blocks `blocks` (increasing) of `s` in `group`, one event per
    /// consecutive run.
    pub(super) fn stored_runs(
        &mut self,
        bs: usize,
        s: &Sequence,
        blocks: &[usize],
        medium: &str,
        group: u32,
    ) {
        let mut start = 0;
        for i in 1..=blocks.len() {
            if i == blocks.len() || blocks[i] != blocks[i - 1] + 1 {
                if start < i {
                    let mut event = stored_event(bs, s, &blocks[start..i], medium);
                    if let Some(window) = self.window {
                        crate::window::name_group(&mut event, group, window);
                    }
                    self.events.push(EngineEvent::BlockStored(event));
                }
                start = i;
            }
        }
    }
}

/// The `medium` of the GPU cache's events, host memory's and storage's, as vLLM names them.
pub(super) const GPU: &str = "GPU";
pub(super) const CPU: &str = "CPU";
pub(super) const STORAGE: &str = "STORAGE";

/// Stores the request `s`'s blocks at positions `blocks` (their hashes `hashes`) in `tier`,
/// announcing those it did not hold and what it evicted for them under `medium`.
pub(super) fn store_in(
    tier: &mut Tier,
    bs: usize,
    s: &Sequence,
    blocks: &[usize],
    hashes: &[SequenceHash],
    medium: &str,
    events: &mut Events,
) {
    if !tier.enabled() || blocks.is_empty() {
        return;
    }
    let (mut new, mut gone) = (Vec::new(), Vec::new());
    tier.store(hashes, &mut new, &mut gone);
    events.removed_from(&gone, medium, 0);
    let new: Vec<usize> = new.into_iter().map(|i| blocks[i]).collect();
    events.stored_runs(bs, s, &new, medium, 0);
}

/// `BlockStored` for consecutive blocks of a request, as vLLM writes it (images as
/// publisher-form `extra_keys`).
pub(super) fn stored_event(bs: usize, s: &Sequence, blocks: &[usize], medium: &str) -> BlockStored {
    let first = blocks[0];
    let extra_keys: Option<Vec<Option<Vec<ExtraKey>>>> = s.mm.as_ref().map(|infos| {
        blocks
            .iter()
            .map(|&b| infos.get(b).and_then(Option::as_ref).map(publisher_extra_keys))
            .collect()
    });
    let extra_keys = extra_keys.filter(|k| k.iter().any(Option::is_some));
    // vLLM keys an adapter's blocks by its name too: each block's extra keys carry it.
    let extra_keys = match &s.lora {
        None => extra_keys,
        Some((name, _)) => Some(
            blocks
                .iter()
                .enumerate()
                .map(|(i, _)| {
                    let mut keys = extra_keys
                        .as_ref()
                        .and_then(|k| k.get(i).cloned().flatten())
                        .unwrap_or_default();
                    keys.push(ExtraKey::Text(name.clone()));
                    Some(keys)
                })
                .collect(),
        ),
    };
    BlockStored {
        block_hashes: blocks.iter().map(|&b| s.hashes[b].0).collect(),
        parent_block_hash: first.checked_sub(1).map(|p| s.hashes[p].0),
        token_ids: blocks
            .iter()
            .flat_map(|&b| s.tokens[b * bs..(b + 1) * bs].iter().map(|&t| u64::from(t)))
            .collect(),
        block_size: bs as u32,
        lora_id: s.lora.as_ref().map(|(_, id)| i64::from(*id)),
        medium: Some(medium.to_owned()),
        lora_name: s.lora.as_ref().map(|(name, _)| name.clone()),
        extra_keys,
        cache_salt: s.namespace.clone(),
        group_idx: None,
        locality: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
    }
}
