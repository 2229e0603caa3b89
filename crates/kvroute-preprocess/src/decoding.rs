//! The image decoders' queue: as many decodes at once as the machine has cores, and a fair
//! order among the requests waiting for one.
//!
//! Decoding is CPU work of about one unit per pixel, known from the image's header before it
//! starts. Each request is a flow; its images wait with a tag (start-time fair queuing,
//! Goyal, Vin and Cheng, SIGCOMM 1996): `tag = max(flow's last tag, virtual time) + pixels`,
//! and a free slot goes to the smallest tag, the virtual time becoming it. A request with one
//! small image is served after at most the decodes already running, however many heavy
//! images other requests queued before it; a heavy request still progresses, its tags
//! growing by its own cost alone.
//!
//! ```text
//!  load_images ─acquire(flow, pixels)─▶ [waiting: (tag, seq) heap] ─free slot─▶ spawn_blocking
//!                                             ▲                                      │
//!                                             └────────── Slot dropped ◀─────────────┘
//! ```

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// The queue; one per process ([`queue`]).
#[derive(Debug)]
pub(crate) struct DecodeQueue {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    free: usize,
    virtual_time: u64,
    seq: u64,
    waiting: BinaryHeap<Reverse<Waiter>>,
}

#[derive(Debug)]
struct Waiter {
    tag: u64,
    seq: u64,
    grant: oneshot::Sender<()>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        (self.tag, self.seq) == (other.tag, other.seq)
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.tag, self.seq).cmp(&(other.tag, other.seq))
    }
}

/// One request's turn among those decoding images (fair by pixels).
#[derive(Debug, Default)]
pub(crate) struct DecodeTurn {
    last_tag: u64,
}

/// A decode slot, given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot<'a> {
    queue: &'a DecodeQueue,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.queue.release();
    }
}

/// The process's queue, with a slot per core.
pub(crate) fn queue() -> &'static DecodeQueue {
    static QUEUE: std::sync::OnceLock<DecodeQueue> = std::sync::OnceLock::new();
    QUEUE.get_or_init(|| {
        DecodeQueue::new(std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
    })
}

impl DecodeQueue {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                free: slots.max(1),
                virtual_time: 0,
                seq: 0,
                waiting: BinaryHeap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for a decode of `cost` (pixels) in `flow`.
    pub(crate) async fn acquire(&self, flow: &mut DecodeTurn, cost: u64) -> Slot<'_> {
        let (tx, rx) = oneshot::channel();
        {
            let mut inner = self.lock();
            let tag = flow.last_tag.max(inner.virtual_time).saturating_add(cost.max(1));
            flow.last_tag = tag;
            inner.seq += 1;
            let seq = inner.seq;
            inner.waiting.push(Reverse(Waiter { tag, seq, grant: tx }));
            dispatch(&mut inner);
        }
        let mut pending = Pending { queue: self, rx: Some(rx) };
        let granted = match pending.rx.as_mut() {
            Some(rx) => rx.await.is_ok(),
            None => false,
        };
        pending.rx = None;
        debug_assert!(granted, "a waiter's sender is dropped only when granted");
        Slot { queue: self }
    }

    fn release(&self) {
        let mut inner = self.lock();
        inner.free += 1;
        dispatch(&mut inner);
    }

    #[cfg(test)]
    fn free(&self) -> usize {
        self.lock().free
    }
}

/// Gives free slots to the smallest tags whose requests still wait.
fn dispatch(inner: &mut Inner) {
    while inner.free > 0 {
        let Some(Reverse(w)) = inner.waiting.pop() else { return };
        inner.virtual_time = inner.virtual_time.max(w.tag);
        if w.grant.send(()).is_ok() {
            inner.free -= 1;
        }
    }
}

/// A wait that may be abandoned (its request gone): a slot granted but not yet taken up is
/// given back.
struct Pending<'a> {
    queue: &'a DecodeQueue,
    rx: Option<oneshot::Receiver<()>>,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(mut rx) = self.rx.take()
            && rx.try_recv().is_ok()
        {
            self.queue.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// With one slot busy, a request with one small image queued after three requests of
    /// heavy ones is served first; the heavy ones in their order after it.
    #[tokio::test]
    async fn a_small_image_waits_for_no_heavy_one_queued_before_it() {
        let q: &'static DecodeQueue = Box::leak(Box::new(DecodeQueue::new(1)));
        let busy = q.acquire(&mut DecodeTurn::default(), 1).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, cost) in [
            ("heavy-1", 6_250_000),
            ("heavy-2", 6_250_000),
            ("heavy-3", 6_250_000),
            ("small", 4_096),
        ] {
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                let _slot = q.acquire(&mut DecodeTurn::default(), cost).await;
                order.lock().unwrap_or_else(PoisonError::into_inner).push(name);
            }));
            tokio::task::yield_now().await;
        }
        // Every waiter is queued before the slot frees.
        while q.lock().waiting.len() < 4 {
            tokio::task::yield_now().await;
        }
        drop(busy);
        for t in tasks {
            t.await.unwrap_or_default();
        }
        let order = order.lock().unwrap_or_else(PoisonError::into_inner).clone();
        assert_eq!(order, ["small", "heavy-1", "heavy-2", "heavy-3"]);
        assert_eq!(q.free(), 1);
    }

    /// One request's images do not keep a second request's out: tags grow with each flow's
    /// own cost, so a's later images come after b's first.
    #[tokio::test]
    async fn flows_interleave_by_cost() {
        let q: &'static DecodeQueue = Box::leak(Box::new(DecodeQueue::new(1)));
        let busy = q.acquire(&mut DecodeTurn::default(), 1).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // a's first, second and third image (its flow's last tag 0, 100, 200), then b's first.
        for (name, last_tag) in [("a1", 0), ("a2", 100), ("a3", 200), ("b1", 0)] {
            let order = Arc::clone(&order);
            tasks.push(tokio::spawn(async move {
                let _slot = q.acquire(&mut DecodeTurn { last_tag }, 100).await;
                order.lock().unwrap_or_else(PoisonError::into_inner).push(name);
            }));
            while q.lock().waiting.len() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        drop(busy);
        for t in tasks {
            t.await.unwrap_or_default();
        }
        let order = order.lock().unwrap_or_else(PoisonError::into_inner).clone();
        assert_eq!(order, ["a1", "b1", "a2", "a3"]);
    }

    /// A request that goes away while it waits, or after its slot was granted but before it
    /// took it, loses no slot.
    #[tokio::test]
    async fn an_abandoned_wait_gives_its_slot_back() {
        let q: &'static DecodeQueue = Box::leak(Box::new(DecodeQueue::new(1)));
        let busy = q.acquire(&mut DecodeTurn::default(), 1).await;
        let waiting = tokio::spawn(async move {
            let _slot = q.acquire(&mut DecodeTurn::default(), 10).await;
        });
        while q.lock().waiting.is_empty() {
            tokio::task::yield_now().await;
        }
        waiting.abort();
        let _ = waiting.await;
        drop(busy);
        assert_eq!(q.free(), 1);
        let _again = q.acquire(&mut DecodeTurn::default(), 1).await;
        assert_eq!(q.free(), 0);
    }
}
