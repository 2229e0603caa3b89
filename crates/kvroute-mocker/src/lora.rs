//! LoRA adapters in the simulated engine, as vLLM 0.33 runs them:
//!
//! - **Slots.** A step's running requests use at most `max_loras` distinct adapters
//!   (vLLM's `--max-loras`; its scheduler skips a waiting request whose adapter would make one
//!   more, `v1/core/sched/scheduler.py`, and admits the requests behind it).
//! - **Residency.** Adapters in the GPU slots are kept least recently used first; one more
//!   evicts the least recently used adapter no running request uses. An adapter not in a slot
//!   is copied in from host memory (`swap`), or first read from storage (`load`) when it is
//!   not among the `max_cpu_loras` most recently used either (vLLM's
//!   `LRUCacheWorkerLoRAManager` and its CPU cache). The copy holds up the step that needs it.
//! - **Step cost.** Each distinct adapter in a step's batch adds `step_cost` (the LoRA
//!   kernels' extra work over the base model's).
//!
//! Where the default times come from is in `docs/mocker.md` ("Adapters").

use std::collections::BTreeMap;
use std::time::Duration;

/// The engine's adapter settings; `max_loras` 0 serves no adapters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraConfig {
    /// Distinct adapters a batch may use (vLLM's `--max-loras`): the GPU slots.
    pub max_loras: usize,
    /// Adapters kept in host memory (vLLM's `--max-cpu-loras`; at least `max_loras`).
    pub max_cpu_loras: usize,
    /// Reading an adapter from storage into a slot, in the timing model's time.
    pub load: Duration,
    /// Copying an adapter from host memory into a slot.
    pub swap: Duration,
    /// Step time each distinct adapter in the batch adds.
    pub step_cost: Duration,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            max_loras: 4,
            max_cpu_loras: 4,
            load: Duration::from_millis(100),
            swap: Duration::from_millis(4),
            step_cost: Duration::from_micros(500),
        }
    }
}

/// What the engine has done with adapters (ground truth for benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoraStats {
    /// Adapters read from storage into a slot.
    pub loads: u64,
    /// Adapters copied from host memory into a slot.
    pub swaps: u64,
    /// Adapters evicted from a slot to make room.
    pub evictions: u64,
}

/// The adapters in the GPU slots and in host memory, least recently used first.
#[derive(Debug, Default)]
pub(crate) struct Adapters {
    config: LoraConfig,
    gpu: Vec<String>,
    cpu: Vec<String>,
    /// Each adapter's integer id, as vLLM numbers them (`lora_id` in its events), from 1.
    ids: BTreeMap<String, u32>,
    pub(crate) stats: LoraStats,
}

impl Adapters {
    pub(crate) fn new(config: LoraConfig) -> Self {
        Self { config, ..Self::default() }
    }

    pub(crate) fn max_loras(&self) -> usize {
        self.config.max_loras
    }

    pub(crate) fn step_cost(&self) -> Duration {
        self.config.step_cost
    }

    /// The adapters in the GPU slots, least recently used first.
    pub(crate) fn resident(&self) -> &[String] {
        &self.gpu
    }

    /// `name`'s id (vLLM's `lora_int_id`: one per name, from 1).
    pub(crate) fn id(&mut self, name: &str) -> u32 {
        let next = self.ids.len() as u32 + 1;
        *self.ids.entry(name.to_owned()).or_insert(next)
    }

    /// Puts `name` in a slot for this step (most recently used); the time the copy takes
    /// (zero when it was there). `in_use`: adapters of running requests, never evicted.
    pub(crate) fn activate(&mut self, name: &str, in_use: &[&str]) -> Duration {
        if let Some(at) = self.gpu.iter().position(|a| a == name) {
            let a = self.gpu.remove(at);
            self.gpu.push(a);
            return Duration::ZERO;
        }
        if self.gpu.len() >= self.config.max_loras.max(1) {
            match self.gpu.iter().position(|a| !in_use.contains(&a.as_str())) {
                Some(at) => {
                    self.gpu.remove(at);
                    self.stats.evictions += 1;
                }
                // Every slot is used by a running request: the scheduler does not get here.
                None => return Duration::ZERO,
            }
        }
        self.gpu.push(name.to_owned());
        let in_host = match self.cpu.iter().position(|a| a == name) {
            Some(at) => {
                self.cpu.remove(at);
                true
            }
            None => false,
        };
        self.cpu.push(name.to_owned());
        let cpu_cap = self.config.max_cpu_loras.max(self.config.max_loras).max(1);
        if self.cpu.len() > cpu_cap {
            self.cpu.remove(0);
        }
        if in_host {
            self.stats.swaps += 1;
            self.config.swap
        } else {
            self.stats.loads += 1;
            self.config.load
        }
    }

    /// Forgets an adapter (vLLM's `/v1/unload_lora_adapter`): out of its slot and host memory.
    pub(crate) fn remove(&mut self, name: &str) {
        self.gpu.retain(|a| a != name);
        self.cpu.retain(|a| a != name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> LoraConfig {
        LoraConfig {
            max_loras: 2,
            max_cpu_loras: 3,
            load: Duration::from_millis(100),
            swap: Duration::from_millis(4),
            step_cost: Duration::ZERO,
        }
    }

    #[test]
    fn loads_swaps_and_evicts_the_least_recently_used() {
        let mut a = Adapters::new(config());
        assert_eq!(a.activate("x", &[]), Duration::from_millis(100));
        assert_eq!(a.activate("y", &[]), Duration::from_millis(100));
        assert_eq!(a.activate("x", &[]), Duration::ZERO);
        // Full: y is the least recently used.
        assert_eq!(a.activate("z", &[]), Duration::from_millis(100));
        assert_eq!(a.resident(), ["x", "z"]);
        // y is still in host memory: a copy, not a load.
        assert_eq!(a.activate("y", &["z"]), Duration::from_millis(4));
        assert_eq!(a.resident(), ["z", "y"]);
        assert_eq!(a.stats, LoraStats { loads: 3, swaps: 1, evictions: 2 });
        // Host memory holds three: w pushes the least recently used (x) out of it.
        a.activate("w", &["y"]);
        assert_eq!(a.activate("x", &[]), Duration::from_millis(100));
    }

    #[test]
    fn ids_are_stable_per_name() {
        let mut a = Adapters::new(config());
        assert_eq!((a.id("x"), a.id("y"), a.id("x")), (1, 2, 1));
    }
}
