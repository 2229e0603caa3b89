//! Conversation affinity: the worker each session (a request's `prompt_cache_key` or
//! `x-session-id`) last went to, for `ttl` after its last request. The map holds at most
//! `capacity` sessions; past it the least recently seen goes first (its next request is
//! placed afresh, as a new session's).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::protocols::WorkerWithDpRank;

/// Session affinity settings; `Default` gives kvroute's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// How long a session stays on its worker after its last request.
    pub ttl: Duration,
    /// Another worker takes the session only when its cost is lower by this much (seconds of
    /// predicted time to first token).
    pub margin_s: f64,
    /// Sessions remembered at most.
    pub capacity: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self { ttl: Duration::from_secs(300), margin_s: 0.05, capacity: 100_000 }
    }
}

#[derive(Debug, Default)]
pub struct Sessions {
    config: SessionConfig,
    /// Session → its worker and when it was last seen (the key of `by_age`).
    map: HashMap<String, (WorkerWithDpRank, Instant, u64)>,
    /// Last seen order: (sequence number) → session.
    by_age: BTreeMap<u64, String>,
    next: u64,
}

impl Sessions {
    pub fn new(config: SessionConfig) -> Self {
        Self { config, ..Self::default() }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// The session's worker, if it was seen within the TTL.
    pub fn worker(&self, session: &str, now: Instant) -> Option<WorkerWithDpRank> {
        let &(worker, seen, _) = self.map.get(session)?;
        (now.saturating_duration_since(seen) <= self.config.ttl).then_some(worker)
    }

    /// The session's request went to `worker`.
    pub fn record(&mut self, session: &str, worker: WorkerWithDpRank, now: Instant) {
        if self.config.capacity == 0 {
            return;
        }
        let seq = self.next;
        self.next += 1;
        if let Some((_, _, old)) = self.map.insert(session.to_owned(), (worker, now, seq)) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(seq, session.to_owned());
        while self.map.len() > self.config.capacity {
            let Some((_, oldest)) = self.by_age.pop_first() else { break };
            self.map.remove(&oldest);
        }
    }

    /// Forgets every session of a worker that left.
    pub fn remove_worker(&mut self, worker: WorkerWithDpRank) {
        let gone: Vec<(String, u64)> = self
            .map
            .iter()
            .filter(|(_, (w, _, _))| *w == worker)
            .map(|(k, (_, _, seq))| (k.clone(), *seq))
            .collect();
        for (session, seq) in gone {
            self.map.remove(&session);
            self.by_age.remove(&seq);
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: u64) -> WorkerWithDpRank {
        WorkerWithDpRank::new(id, 0u32)
    }

    #[test]
    fn remembers_within_the_ttl_and_the_capacity() {
        let config = SessionConfig { ttl: Duration::from_secs(10), margin_s: 0.0, capacity: 2 };
        let mut s = Sessions::new(config);
        let t0 = Instant::now();
        s.record("a", w(1), t0);
        s.record("b", w(2), t0);
        assert_eq!(s.worker("a", t0 + Duration::from_secs(10)), Some(w(1)));
        assert_eq!(s.worker("a", t0 + Duration::from_secs(11)), None, "past the TTL");
        s.record("a", w(3), t0);
        s.record("c", w(1), t0);
        assert_eq!(s.len(), 2);
        assert_eq!(s.worker("b", t0), None, "the least recently seen went first");
        assert_eq!(s.worker("a", t0), Some(w(3)));
        s.remove_worker(w(3));
        assert_eq!(s.worker("a", t0), None);
        assert_eq!(s.len(), 1);
    }
}
