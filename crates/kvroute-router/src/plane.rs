//! The event plane: the runtime the engines' event subscriptions run on ([`EventPlane`]).

use std::sync::Arc;

use tokio::runtime::{Handle, Runtime};
use tokio::task::JoinHandle;

/// Where the engines' event subscriptions run: a runtime of their own (`kvroute-events`
/// threads, half the cores, at least one, at nice [`EVENT_NICE`]), so a fleet's events
/// cannot crowd the API's requests, the decisions above all, out of the main runtime's
/// queues. The two share the cores through the kernel's scheduler instead: 1,000 busy
/// subscriber tasks are one runnable thread to it, not a thousand tasks ahead of a decision,
/// and a lower-priority one, so a decision that wakes is not left waiting behind it.
#[derive(Clone, Debug)]
pub(crate) struct EventPlane {
    handle: Handle,
    _owner: Arc<PlaneRuntime>,
}

#[derive(Debug)]
struct PlaneRuntime(Option<Runtime>);

impl Drop for PlaneRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            // Never blocks: it may be dropped from an async task.
            runtime.shutdown_background();
        }
    }
}

/// The event plane's threads' nice value: when the cores are full, a decision's thread gets
/// about ten times their share (the kernel's weights for nice 0 and 10 are 1024 and 110).
pub(crate) const EVENT_NICE: i32 = 10;

impl EventPlane {
    pub(crate) fn start() -> std::io::Result<Self> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads((cores / 2).max(1))
            .thread_name("kvroute-events")
            .on_thread_start(|| {
                if !kvroute_alloc::lower_this_thread(EVENT_NICE) {
                    tracing::debug!("the event plane's thread keeps its priority");
                }
            })
            .enable_all()
            .build()?;
        Ok(Self { handle: runtime.handle().clone(), _owner: Arc::new(PlaneRuntime(Some(runtime))) })
    }

    pub(crate) fn spawn<F>(&self, task: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(task)
    }
}
