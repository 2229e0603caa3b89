//! The router's background tasks, stopped together.

use tokio::task::JoinHandle;

/// Background tasks of a running router; dropping it stops them.
#[derive(Debug, Default)]
pub struct Tasks(pub(crate) Vec<JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}
