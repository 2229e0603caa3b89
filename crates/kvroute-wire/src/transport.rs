//! What every ZMQ socket kvroute opens is allowed to receive (feature `zmq`).
//!
//! ZMTP frames announce their length up front; a decoder that reserves what is announced
//! can be made to allocate a terabyte by a 73-byte packet. kvroute's copy of the `zeromq`
//! crate (`vendor/zeromq`, see its `PATCH.md`) checks every frame header against a budget
//! for the whole message before it reserves anything, and disconnects a peer that announces
//! more; [`ZmqLimits`] sets that budget per socket and counts what it refuses.
//!
//! | socket | receives | budget |
//! |---|---|---|
//! | router SUB (KV events, load reports) | `[topic, seq, batch]`, JSON reports | `max_message_bytes` |
//! | router DEALER (replay) | replayed batches | `max_message_bytes` per message, [`ZmqLimits::max_replay_bytes`] per answer |
//! | engine PUB (events, load), ROUTER (replay) | subscriptions, replay requests | [`CONTROL_MAX_MESSAGE_BYTES`] |

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use zeromq::SocketOptions;

/// Default of [`ZmqLimits::max_message_bytes`]: a batch of one engine step's events. vLLM
/// publishes one batch per step; a step stores at most its token budget in blocks
/// (`max_num_batched_tokens`, 8,192 by default, rarely above 64k), each block ~5 bytes a
/// token and ~40 of hashes and keys: under 1 MiB. 16 MiB leaves a wide margin (a step of
/// over three million tokens) and bounds what one peer can make the router hold.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// What a socket that only hears subscriptions and replay requests accepts: a subscription
/// is a topic prefix, a replay request 8 bytes.
pub const CONTROL_MAX_MESSAGE_BYTES: usize = 64 << 10;

/// How many messages' worth one replay answer may bring, all its batches together.
pub const REPLAY_MESSAGES: usize = 4;

/// A socket's part, for its budget and for counting its refusals.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SocketRole {
    /// A router's subscription to an engine's KV events.
    Events,
    /// A router's request to an engine's replay endpoint.
    Replay,
    /// A router's subscription to an engine's load reports.
    Load,
    /// An engine's PUB (events or load reports) and ROUTER (replay): subscriptions and
    /// requests in.
    Publisher,
}

/// Refusals of every socket of this process, by role (see [`refused`]).
static REFUSED: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

/// Messages refused for their size by this process's sockets in `role`, since it started:
/// what a process's metrics report, whichever part of it opened the socket.
pub fn refused(role: SocketRole) -> u64 {
    REFUSED[role as usize].load(Ordering::Relaxed)
}

impl SocketRole {
    pub const ALL: [SocketRole; 4] = [Self::Events, Self::Replay, Self::Load, Self::Publisher];

    pub fn label(self) -> &'static str {
        match self {
            Self::Events => "events",
            Self::Replay => "replay",
            Self::Load => "load",
            Self::Publisher => "publisher",
        }
    }
}

type Hook = Arc<dyn Fn(SocketRole) + Send + Sync>;

/// The receive budget of every ZMQ socket of a process, and what counts its refusals.
#[derive(Clone)]
pub struct ZmqLimits {
    max_message_bytes: usize,
    on_refused: Option<Hook>,
}

impl fmt::Debug for ZmqLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZmqLimits").field("max_message_bytes", &self.max_message_bytes).finish()
    }
}

impl Default for ZmqLimits {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_MESSAGE_BYTES)
    }
}

impl ZmqLimits {
    /// `max_message_bytes` below [`CONTROL_MAX_MESSAGE_BYTES`] is raised to it (a smaller
    /// budget could refuse the engines' own handshakes).
    pub fn new(max_message_bytes: usize) -> Self {
        Self {
            max_message_bytes: max_message_bytes.max(CONTROL_MAX_MESSAGE_BYTES),
            on_refused: None,
        }
    }

    /// Also calls `hook` with the socket's role for every message refused (the process-wide
    /// [`refused`] counts them all the same).
    #[must_use]
    pub fn counting(mut self, hook: impl Fn(SocketRole) + Send + Sync + 'static) -> Self {
        self.on_refused = Some(Arc::new(hook));
        self
    }

    /// The largest message a data socket (events, replay, load) accepts.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// The most bytes one replay answer may bring, all its batches together.
    pub fn max_replay_bytes(&self) -> usize {
        self.max_message_bytes.saturating_mul(REPLAY_MESSAGES)
    }

    /// The budget of a socket in `role`.
    pub fn budget(&self, role: SocketRole) -> usize {
        match role {
            SocketRole::Publisher => CONTROL_MAX_MESSAGE_BYTES,
            _ => self.max_message_bytes,
        }
    }

    /// Options for a socket in `role`: its budget, and the counts of its refusals.
    pub fn options(&self, role: SocketRole) -> SocketOptions {
        let mut options = SocketOptions::default();
        options.max_message_size(self.budget(role));
        let hook = self.on_refused.clone();
        options.on_refused(Arc::new(move |_announced| {
            REFUSED[role as usize].fetch_add(1, Ordering::Relaxed);
            if let Some(hook) = &hook {
                hook(role);
            }
        }));
        options
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publishers_hear_only_small_messages_and_data_sockets_the_setting() {
        let limits = ZmqLimits::new(1 << 20);
        assert_eq!(limits.budget(SocketRole::Events), 1 << 20);
        assert_eq!(limits.budget(SocketRole::Publisher), CONTROL_MAX_MESSAGE_BYTES);
        assert_eq!(limits.max_replay_bytes(), 4 << 20);
        assert_eq!(ZmqLimits::new(10).max_message_bytes(), CONTROL_MAX_MESSAGE_BYTES);
    }
}
