//! The parity probe: when a worker joins, the front door sends it one prompt nobody sent
//! before and checks that the blocks its engine announces are the blocks the front door
//! hashes for that prompt, token for token (the router's index holds them under the same
//! hashes only if every token id matches). A mismatch is named by what it can tell:
//!
//! | what the router saw | cause |
//! |---|---|
//! | blocks of another size | the engine's block size |
//! | blocks, under other hashes | other token ids: chat template or tokenizer differ |
//! | nothing | no KV events (an engine started without them, or on another endpoint) |
//!
//! A worker that fails is routed approximately, its events ignored, until it passes a later
//! probe (after its engine restarts). `--no-parity-probe` skips it for engines that cannot
//! take a request of their own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{BlockHasher, WorkerId, WorkerWithDpRank};
use kvroute_http::openai::ChatMessage;
use kvroute_router::{Parity, RouterState};
use serde_json::json;

use crate::FrontendState;
use kvroute_http::ClientError;

fn fail(router: &RouterState, worker: WorkerId, cause: String) -> Parity {
    tracing::error!(%worker, %cause, "parity probe failed: the worker's events cannot be used; routing it approximately");
    let parity = Parity::Failed(cause);
    router.set_parity(worker, parity.clone());
    parity
}

/// How long the probe's blocks have to reach the router.
pub const PROBE_WAIT: Duration = Duration::from_secs(5);

/// Full blocks the probe prompt spans at least.
const PROBE_BLOCKS: usize = 3;

/// Probes `worker` and records the outcome in the embedded router; the outcome, or `None`
/// when there is nothing to probe (no embedded router, no URL) or the request itself failed
/// (the health checks deal with that; the probe is tried again).
pub async fn probe(state: &Arc<FrontendState>, worker: WorkerId) -> Option<Parity> {
    let router = state.placer.router()?;
    let base = state.urls.get(&worker)?;
    let status = router.workers().into_iter().find(|w| w.id == worker)?;
    // Nothing to compare for a worker without events; wait for its subscription otherwise.
    if status.events.is_none() {
        return Some(Parity::Unchecked);
    }
    if !status.connected.iter().all(|c| *c) || !status.caught_up.iter().all(|c| *c) {
        return None;
    }
    // Trust its events while it is probed (a failed worker gets another chance).
    router.set_parity(worker, Parity::Unchecked);
    let before = router.workers().into_iter().find(|w| w.id == worker)?.conversion;
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let bs = state.block_size.tokens();
    // The nonce leads a system message, so the probe's first block is its own: it must not
    // warm a prefix (a template's default system prompt) that real requests share.
    let system = format!("{nonce:x} kvroute parity probe of worker {worker}");
    let mut text = "Parity probe:".to_owned();
    let mut tokens = Vec::new();
    for _ in 0..64 {
        let messages = [ChatMessage::text("system", &system), ChatMessage::text("user", &text)];
        tokens = state.preprocessor.prepare_chat(&messages, true, Vec::new()).ok()?.tokens;
        if tokens.len() >= bs * PROBE_BLOCKS {
            break;
        }
        text.push_str(" the quick brown fox jumps over the lazy dog");
    }
    let hashes = BlockHasher::new(state.block_size).local_hashes(&tokens, None);
    // No model name: the engine's own (the front door's may be named otherwise).
    let body = json!({"messages": [{"role": "system", "content": system},
        {"role": "user", "content": text}], "max_tokens": 1});
    let url = format!("{base}/v1/chat/completions");
    let answer = state.client.post_json::<serde_json::Value>(&url, &body);
    match tokio::time::timeout(PROBE_WAIT, answer).await {
        Ok(Ok(_)) => {}
        Ok(Err(ClientError::Status { status, message })) if status.is_client_error() => {
            let cause = format!("the engine refused the probe prompt ({status}: {message})");
            return Some(fail(router, worker, cause));
        }
        // Unreachable or slow: the health checks deal with it; probed again later.
        _ => return None,
    }
    let deadline = Instant::now() + PROBE_WAIT;
    let held = |router: &RouterState| {
        let scores = router.index.find_matches(&hashes);
        (0..status.dp_size)
            .map(|r| scores.score(WorkerWithDpRank::new(worker, r)) as usize)
            .max()
            .unwrap_or(0)
    };
    while held(router) < hashes.len() {
        if Instant::now() > deadline {
            let after = router.workers().into_iter().find(|w| w.id == worker)?.conversion;
            let cause = if after.wrong_block_size > before.wrong_block_size {
                format!(
                    "block size: the engine's KV events carry blocks of {} tokens, the router's are {bs}",
                    after.seen_block_size.map_or("another number of".to_owned(), |s| s.to_string())
                )
            } else if after.blocks_stored > before.blocks_stored {
                "token ids: the engine's blocks for the probe prompt carry other token ids than the front door's (the chat template or the tokenizer differ; give both the same model directory)".to_owned()
            } else {
                "no KV events: none arrived for the probe prompt (the engine publishes none, or on another endpoint than the worker's `events`)".to_owned()
            };
            return Some(fail(router, worker, cause));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::info!(%worker, blocks = hashes.len(), "parity probe passed");
    router.set_parity(worker, Parity::Ok);
    Some(Parity::Ok)
}
