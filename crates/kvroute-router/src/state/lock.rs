//! The one way the state's owners take a mutex: a panic under a lock leaves the data as it
//! was written so far, and routing goes on with it (the state is counters and caches the
//! engines' events correct, never a ledger).

use std::sync::{Mutex, MutexGuard, PoisonError};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
