//! Request body bytes the picker holds, bounded in all and per client, as the front door's
//! listener bounds them (`kvroute_http::server`): a stream's body is counted chunk by chunk as
//! it comes and given back when the stream lets it go (placed, refused, or dropped).
//!
//! A client is who the gateway says sent the request: the API key's tenant when keys are on,
//! else the last address of `x-forwarded-for` (the one the gateway itself appended), else the
//! gateway's own address.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The bytes held, in all and by client.
#[derive(Debug)]
pub struct Budget {
    held: Mutex<Held>,
    max_total: usize,
    max_per_client: usize,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    per_client: HashMap<Arc<str>, usize>,
}

impl Budget {
    pub fn new(max_total: usize, max_per_client: usize) -> Arc<Self> {
        Arc::new(Self { held: Mutex::default(), max_total, max_per_client })
    }

    /// An empty share for `client`.
    pub fn share(self: &Arc<Self>, client: Arc<str>) -> Share {
        Share { budget: Arc::clone(self), client, bytes: 0 }
    }

    /// Bytes held in all now.
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(PoisonError::into_inner).total
    }
}

/// What one stream holds of the budget; given back when dropped.
#[derive(Debug)]
pub struct Share {
    budget: Arc<Budget>,
    client: Arc<str>,
    bytes: usize,
}

impl Share {
    /// Takes `n` more bytes, if the client's share and the total allow them.
    pub fn take(&mut self, n: usize) -> bool {
        let b = &self.budget;
        let mut held = b.held.lock().unwrap_or_else(PoisonError::into_inner);
        let client = held.per_client.get(&self.client).copied().unwrap_or(0);
        if held.total + n > b.max_total || client + n > b.max_per_client {
            return false;
        }
        held.total += n;
        *held.per_client.entry(Arc::clone(&self.client)).or_default() += n;
        self.bytes += n;
        true
    }

    /// Gives everything back.
    pub fn give_back(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let mut held = self.budget.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.total = held.total.saturating_sub(self.bytes);
        if let Some(c) = held.per_client.get_mut(&self.client) {
            *c = c.saturating_sub(self.bytes);
            if *c == 0 {
                held.per_client.remove(&self.client);
            }
        }
        drop(held);
        kvroute_http::server::note_released_body_bytes(self.bytes);
        self.bytes = 0;
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_share_and_all_at_most_the_total() {
        let budget = Budget::new(100, 60);
        let mut a = budget.share("a".into());
        let mut a2 = budget.share("a".into());
        let mut b = budget.share("b".into());
        assert!(a.take(40));
        assert!(!a2.take(21), "a's share is 60");
        assert!(a2.take(20));
        assert!(b.take(40));
        assert!(!b.take(1), "the total is 100");
        drop(a);
        assert_eq!(budget.held(), 60);
        assert!(b.take(20));
        b.give_back();
        drop(a2);
        assert_eq!(budget.held(), 0);
        assert!(budget.held.lock().unwrap().per_client.is_empty(), "no entry left behind");
    }
}
