//! A placed request held while the gateway passes its response ([`Hold`]), and how it is
//! freed, once ([`release`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kvroute_frontend::pick::Held;

use crate::metrics::Stage;
use crate::picker::Picker;

/// A placed request while the gateway passes its response, freed once: at the response's
/// end, when the stream goes, or at its deadline when the response has not begun by then,
/// even if nobody reads the stream any more (a gateway that stopped reading it would
/// otherwise never let its stream be polled again).
#[derive(Debug, Default)]
pub(crate) struct Hold {
    slot: Arc<Mutex<Option<Held>>>,
    watchdog: Option<tokio::task::AbortHandle>,
}

impl Hold {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Option<Held>> {
        self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `held` and frees it after `within` unless the response begins
    /// ([`Hold::begun`]) or it is freed before.
    pub(crate) fn hold(&mut self, held: Held, within: Duration, picker: &Arc<Picker>, model: &str) {
        *self.lock() = Some(held);
        let (slot, picker, model) = (Arc::clone(&self.slot), Arc::clone(picker), model.to_owned());
        let started = Instant::now();
        let watchdog = tokio::spawn(async move {
            tokio::time::sleep(within).await;
            if release(&slot, &picker, &model, started, Freed::Deadline) {
                tracing::debug!(%model, "the response did not begin in time: placement freed");
            }
        });
        self.watchdog = Some(watchdog.abort_handle());
    }

    /// Frees what it holds, once ([`release`]): true for the caller that freed it.
    pub(crate) fn free(&self, picker: &Picker, model: &str, started: Instant, why: Freed) -> bool {
        release(&self.slot, picker, model, started, why)
    }

    /// The response began: it is the gateway's and the engine's from now on.
    pub(crate) fn begun(&mut self) {
        if let Some(w) = self.watchdog.take() {
            w.abort();
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.begun();
    }
}

/// Why a placement is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Freed {
    /// The response ended (its prefill is then done, if no byte said so before).
    Answered,
    /// The response did not begin by the deadline.
    Deadline,
    /// The stream went first.
    Gone,
}

/// Frees what `slot` holds, once: true for the caller that freed it. A deadline is counted
/// before the placement goes, so whoever sees nothing in flight also sees it counted.
fn release(
    slot: &Mutex<Option<Held>>,
    picker: &Picker,
    model: &str,
    started: Instant,
    why: Freed,
) -> bool {
    let held = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    let Some(mut held) = held else { return false };
    match why {
        Freed::Answered => held.first_bytes(),
        Freed::Deadline => picker.metrics.deadline(Stage::Response),
        Freed::Gone => {}
    }
    drop(held);
    picker.metrics.finished(model, started.elapsed());
    true
}
