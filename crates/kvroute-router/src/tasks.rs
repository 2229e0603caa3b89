//! The router's background tasks, stopped together, and the event plane's own runtime.

use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::state::RouterState;

/// Background tasks of a running router, its members' among them; dropping it stops them
/// (and the event plane's threads, once nothing else holds them).
#[derive(Debug, Default)]
pub struct Tasks {
    tasks: Vec<JoinHandle<()>>,
    state: Option<Arc<RouterState>>,
}

impl Tasks {
    pub(crate) fn new(tasks: Vec<JoinHandle<()>>, state: Arc<RouterState>) -> Self {
        Self { tasks, state: Some(state) }
    }

    /// Stops `task` with the others (a source of members, say).
    pub fn push(&mut self, task: JoinHandle<()>) {
        self.tasks.push(task);
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        if let Some(state) = &self.state {
            // The router stops: its state is kept for the next start ([`crate::saved`]).
            if let Some(dir) = &state.config.state_dir {
                match crate::saved::save(state, dir) {
                    Ok(events) => {
                        tracing::info!(dir = %dir.display(), events, "router state saved");
                    }
                    Err(err) => tracing::warn!(%err, "router state not saved"),
                }
            }
            state.roster.stop();
        }
    }
}

/// Tasks stopped when this is dropped.
#[derive(Debug, Default)]
pub(crate) struct AbortAll(pub Vec<JoinHandle<()>>);

impl Drop for AbortAll {
    fn drop(&mut self) {
        self.0.iter().for_each(JoinHandle::abort);
    }
}
