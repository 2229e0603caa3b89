//! The parity probe: when a worker joins, the front door sends it prompts nobody sent before
//! and checks that the blocks its engine announces are the blocks the front door hashes for
//! them, token for token (the router's index holds them under the same hashes only if every
//! token id matches) and, for a model that takes images, image key for image key (a block
//! that covers an image is hashed with the image's `mm_hash`). A mismatch is named by what it
//! can tell:
//!
//! | what the router saw | cause |
//! |---|---|
//! | blocks of another size | the engine's block size |
//! | the text probe's blocks, under other hashes | other token ids: chat template or tokenizer differ |
//! | the image probe's blocks, held without their image keys | the engine announces no image keys |
//! | the image probe's blocks, under other hashes | image placeholders or image keys differ |
//! | nothing | no KV events (an engine started without them, or on another endpoint) |
//!
//! A worker that fails is routed approximately, its events ignored, until it passes a later
//! probe (after its engine restarts). `--no-parity-probe` skips it for engines that cannot
//! take a request of their own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::{BlockHasher, LocalBlockHash, WorkerId};
use kvroute_http::ClientError;
use kvroute_http::openai::{ChatMessage, ContentPart, ImageUrl, MessageContent};
use kvroute_http::paths;
use kvroute_preprocess::{Prepared, images};
use kvroute_router::{ConvertStats, Parity};
use serde_json::{Value, json};

use crate::decider::Decider;
use crate::{FrontendState, dialect};

fn fail(decider: &Decider, worker: WorkerId, cause: &Mismatch) -> Parity {
    tracing::error!(%worker, %cause, "parity probe failed: the worker's events cannot be used; routing it approximately");
    // The router keeps the cause as text: it is what `/workers` shows.
    let parity = Parity::Failed(cause.to_string());
    decider.set_parity(worker, parity.clone());
    parity
}

/// How long a probe's blocks have to reach the router.
pub const PROBE_WAIT: Duration = Duration::from_secs(5);

/// Full blocks a probe prompt spans at least.
const PROBE_BLOCKS: usize = 3;

/// Side of the image probe's picture, pixels (16 placeholder tokens at Qwen2-VL's geometry).
const PROBE_IMAGE_SIDE: u32 = 112;

const FILLER: &str = " the quick brown fox jumps over the lazy dog";

/// One probe prompt: its chat body, the prompt as the front door prepared it (a tokens
/// dialect sends that), and the blocks the front door hashes for it.
struct Probe {
    body: Value,
    prepared: Prepared,
    hashes: Vec<LocalBlockHash>,
    /// The image probe's blocks hashed without image keys (what an engine that announces
    /// none is indexed under).
    without_images: Option<Vec<LocalBlockHash>>,
}

/// Why a probe could not be made now; it is tried again after a backoff.
#[derive(Debug, thiserror::Error)]
pub enum Retry {
    #[error("its KV event subscription is not connected and caught up yet")]
    NotSubscribed,
    #[error("the probe prompt could not be prepared with the front door's model")]
    Unprepared,
    #[error("the probe request got no answer in time, or the worker is unreachable")]
    NoAnswer,
    #[error("the worker is gone from the router")]
    Gone,
}

/// Probes `worker` and records the outcome in the router (embedded or remote: through the
/// [`Decider`]); `Ok(None)` when there is nothing to probe (no URL), `Err` when it cannot be
/// probed now (the caller tries again after a backoff, and records why).
pub async fn probe(state: &Arc<FrontendState>, worker: WorkerId) -> Result<Option<Parity>, Retry> {
    let Some(base) = state.workers().url(worker).map(str::to_owned) else {
        return Ok(None);
    };
    let decider = &state.decider;
    let status = decider.worker(worker).await.map_err(|_| Retry::NoAnswer)?.ok_or(Retry::Gone)?;
    // Nothing to compare for a worker without events; wait for its subscription otherwise.
    if status.events.is_none() {
        return Ok(Some(Parity::Unchecked));
    }
    if !status.connected.iter().all(|c| *c) || !status.caught_up.iter().all(|c| *c) {
        return Err(Retry::NotSubscribed);
    }
    // Trust its events while it is probed (a failed worker gets another chance).
    decider.set_parity(worker, Parity::Unchecked);
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut probes = vec![text_probe(state, worker, nonce).ok_or(Retry::Unprepared)?];
    if state.preprocessor.image_token_id().is_some() {
        probes.push(image_probe(state, worker, nonce).ok_or(Retry::Unprepared)?);
    }
    // Each probe goes as a request would: in the worker's dialect when it carries it.
    let dialect = state.workers().dialect(worker);
    for p in &probes {
        let tokens =
            dialect::tokens_body(dialect, &p.body, &p.prepared, &Default::default(), false);
        let (path, body) = match tokens.and_then(|b| serde_json::from_slice(&b).ok()) {
            Some(tokens) => (dialect::path(dialect), tokens),
            None => (paths::CHAT_COMPLETIONS, p.body.clone()),
        };
        let url = format!("{base}{path}");
        match run(state, worker, &url, body, p).await {
            Some(Ok(())) => {}
            // A text-only model refuses pictures: its text passed, and it takes none.
            Some(Err(Mismatch::Refused { status, message })) if p.without_images.is_some() => {
                tracing::info!(%worker, %status, %message, "the engine takes no pictures: its text probe passed, its picture probe was refused");
            }
            Some(Err(cause)) => return Ok(Some(fail(decider, worker, &cause))),
            None => return Err(Retry::NoAnswer),
        }
    }
    tracing::info!(%worker, probes = probes.len(), "parity probe passed");
    decider.set_parity(worker, Parity::Ok);
    Ok(Some(Parity::Ok))
}

/// The probe's kind and nonce lead a system message, so each probe's first block is its own:
/// it must not warm a prefix (a template's default system prompt, or the other probe's
/// opening) that real requests or the next probe share.
fn system(nonce: u128, worker: WorkerId, what: &str) -> String {
    format!("{what} {nonce:x} kvroute parity probe of worker {worker}")
}

fn text_probe(state: &FrontendState, worker: WorkerId, nonce: u128) -> Option<Probe> {
    let bs = state.block_size.tokens();
    let system = system(nonce, worker, "text");
    let mut text = "Parity probe:".to_owned();
    let mut prepared = None;
    for _ in 0..64 {
        let messages = [ChatMessage::text("system", &system), ChatMessage::text("user", &text)];
        let p = state.preprocessor.prepare_chat(&messages, true, Vec::new()).ok()?;
        let done = p.tokens.len() >= bs * PROBE_BLOCKS;
        prepared = Some(p);
        if done {
            break;
        }
        text.push_str(FILLER);
    }
    let prepared = prepared?;
    // No model name: the engine's own (the front door's may be named otherwise).
    let body = json!({"messages": [{"role": "system", "content": system},
        {"role": "user", "content": text}], "max_tokens": 1});
    let hashes = BlockHasher::new(state.block_size).local_hashes(&prepared.tokens, None);
    Some(Probe { body, prepared, hashes, without_images: None })
}

/// A picture unique to this probe between two runs of text, the text after it spanning
/// full blocks, so the blocks that cover the picture are full and checked.
fn image_probe(state: &FrontendState, worker: WorkerId, nonce: u128) -> Option<Probe> {
    let bs = state.block_size;
    let config = state.preprocessor.image_config();
    let png = images::seeded_png(nonce as u64 ^ worker.0, PROBE_IMAGE_SIDE);
    let picture = images::decode(&png, config).ok()?;
    let system = system(nonce, worker, "image");
    // As the front door sends every image: its identifier as vLLM's multimodal `uuid`, so
    // the engine keys the picture as the router does.
    let uuid = Some(picture.identifier.clone());
    let image = ContentPart::ImageUrl {
        image_url: ImageUrl { url: images::png_data_url(&png), detail: None, uuid },
    };
    let mut after = "What does the picture show?".to_owned();
    let (mut messages, mut prepared) = (Vec::new(), None);
    for _ in 0..64 {
        let parts = vec![
            ContentPart::Text { text: "Parity probe picture:".to_owned() },
            image.clone(),
            ContentPart::Text { text: after.clone() },
        ];
        messages = vec![
            ChatMessage::text("system", &system),
            ChatMessage { role: "user".to_owned(), content: Some(MessageContent::Parts(parts)) },
        ];
        let p = state.preprocessor.prepare_chat(&messages, true, vec![picture.clone()]).ok()?;
        let image_end = p.mm.mm_objects.iter().flat_map(|o| &o.offsets).map(|r| r.1).max()?;
        let done = p.tokens.len() >= image_end + bs.tokens() * 2;
        prepared = Some(p);
        if done {
            break;
        }
        after.push_str(FILLER);
    }
    let prepared = prepared?;
    let infos = prepared.mm.to_block_level(bs, prepared.tokens.len());
    let hasher = BlockHasher::new(bs);
    let body = json!({"messages": messages, "max_tokens": 1});
    Some(Probe {
        body,
        hashes: hasher.local_hashes(&prepared.tokens, Some(&infos)),
        without_images: Some(hasher.local_hashes(&prepared.tokens, None)),
        prepared,
    })
}

/// Sends one probe and waits for its blocks in the index; `Err` names what differs, `None`
/// when the worker or the router did not answer.
async fn run(
    state: &FrontendState,
    worker: WorkerId,
    url: &str,
    body: Value,
    probe: &Probe,
) -> Option<Result<(), Mismatch>> {
    let decider = &state.decider;
    let conversion = async || Some(decider.worker(worker).await.ok()??.conversion);
    let before = conversion().await?;
    let client = state.workers().client.clone();
    let answer = client.post_json::<Value>(url, &body);
    match tokio::time::timeout(PROBE_WAIT, answer).await {
        Ok(Ok(_)) => {}
        Ok(Err(ClientError::Status { status, message, .. })) if status.is_client_error() => {
            return Some(Err(Mismatch::Refused { status, message }));
        }
        // Unreachable or slow: the health checks deal with it; probed again later.
        _ => return None,
    }
    let held = async |hashes: &[LocalBlockHash]| decider.held(worker, hashes).await.ok();
    let deadline = Instant::now() + PROBE_WAIT;
    while held(&probe.hashes).await? < probe.hashes.len() {
        if Instant::now() > deadline {
            let held_plain = match &probe.without_images {
                Some(plain) => Some(held(plain).await?),
                None => None,
            };
            let held_all = held(&probe.hashes).await?;
            let after = conversion().await?;
            return Some(Err(cause(state, before, after, probe, held_plain, held_all)));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(Ok(()))
}

/// What differs between a worker's blocks and the front door's (the table in the module docs).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    #[error("the engine refused the probe prompt ({status}: {message})")]
    Refused { status: axum::http::StatusCode, message: String },
    #[error("block size: the engine's KV events carry blocks of {} tokens, the router's are {router}", engine.map_or("another number of".to_owned(), |s| s.to_string()))]
    BlockSize { engine: Option<u32>, router: usize },
    #[error(
        "image keys: the engine's blocks that cover the probe's picture carry no image key (its KV events leave out `extra_keys`/`mm_keys`), so two pictures behind the same placeholders look alike to the router"
    )]
    NoImageKeys,
    #[error(
        "image placeholders or keys: the engine's blocks for the image probe carry other token ids or image keys than the front door's (the image's placeholder count or its hashing differ; give both the same model directory)"
    )]
    ImageTokens,
    #[error(
        "token ids: the engine's blocks for the probe prompt carry other token ids than the front door's (the chat template or the tokenizer differ; give both the same model directory)"
    )]
    TokenIds,
    #[error(
        "no KV events: none arrived for the probe prompt (the engine publishes none, or on another endpoint than the worker's `events`)"
    )]
    NoEvents,
}

/// Why a probe's blocks did not arrive as hashed, as far as the router can tell.
/// `held_plain` and `held_all`: the blocks the worker holds of the probe hashed without its
/// images, and with them.
fn cause(
    state: &FrontendState,
    before: ConvertStats,
    after: ConvertStats,
    probe: &Probe,
    held_plain: Option<usize>,
    held_all: usize,
) -> Mismatch {
    if after.wrong_block_size > before.wrong_block_size {
        let router = state.block_size.tokens();
        return Mismatch::BlockSize { engine: after.seen_block_size, router };
    }
    if held_plain.is_some_and(|plain| plain > held_all) {
        return Mismatch::NoImageKeys;
    }
    if after.blocks_stored > before.blocks_stored {
        return match probe.without_images {
            Some(_) => Mismatch::ImageTokens,
            None => Mismatch::TokenIds,
        };
    }
    Mismatch::NoEvents
}
