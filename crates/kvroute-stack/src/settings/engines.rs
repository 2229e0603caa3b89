//! What the settings take from the engines themselves when a flag leaves it open.

use super::Settings;
use crate::StackError;

impl Settings {
    /// Without `--block-size`, the size the configured workers' engines report (vLLM's
    /// `cache_config_info` on their metrics URL, each read until it answers or the ready
    /// timeout ends), when they agree; the default when none reports one. Returns the size
    /// taken from the engines.
    pub fn take_engines_block_size(&mut self) -> Result<Option<u32>, StackError> {
        if self.blocks.block_size.is_some() || self.routing.workers.is_empty() {
            return Ok(None);
        }
        let timeout = self.ready_timeout()?;
        let workers = self.routing.workers.clone();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let size = runtime
            .block_on(kvroute_router::load::engines_block_size(&workers, timeout))
            .map_err(StackError::BlockSizes)?;
        match size {
            Some(size) => {
                tracing::info!(block_size = size, "the block size of the engines (their metrics)");
                self.blocks.block_size = Some(size);
            }
            None if workers.iter().any(|w| w.metrics.is_some()) => tracing::warn!(
                timeout_s = timeout.as_secs_f64(),
                "no engine reported its block size: the default is taken (give --block-size)"
            ),
            None => {}
        }
        Ok(size)
    }
}
