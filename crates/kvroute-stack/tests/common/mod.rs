//! Helpers shared by the stack's integration tests.

use std::time::{Duration, Instant};

/// Polls `f` every 20 ms until it holds or `within` passes; whether it held.
pub(crate) async fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
