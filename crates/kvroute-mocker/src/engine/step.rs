//! One scheduler step ([`Engine::step`]), in its phases: the running requests, then the
//! waiting ones admitted as the cache allows (some out to load from a lower tier first), the
//! step's time, then the outputs.

use std::time::Duration;

use kvroute_core::SequenceHash;

use super::events::Events;
use super::events::*;
use super::state::Engine;
use super::types::*;
use crate::disagg::Handoff;
use crate::kv::Stored;
use crate::sequence::{Block, Sequence};

/// What a step has done so far, carried through its phases.
pub(super) struct StepState {
    pub(super) budget: usize,
    pub(super) events: Events,
    /// Per running request (by position), what this step scheduled for it.
    pub(super) work: Vec<Option<Work>>,
    pub(super) preempted_any: bool,
    /// Adapter activations and synchronous tier loads: they hold up the step.
    pub(super) lora_time: Duration,
    /// Running requests before the one being scheduled that were preempted for it (the
    /// `priority` policy may take an earlier one): its position moved back by as many.
    pub(super) shifted: usize,
}

/// What a step scheduled for one request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Work {
    pub(super) tokens: usize,
    /// Prompt tokens computed by this step, and those computed before it.
    pub(super) prompt_tokens: usize,
    pub(super) prompt_before: usize,
    /// Its prompt's KV came from a prefill engine: computing the rest takes no prefill time
    /// (as Dynamo's decode mocker prices it).
    pub(super) remote: bool,
}

/// How scheduling a request went.
pub(super) enum Scheduled {
    Yes,
    /// The request itself was preempted (it was the newest).
    Preempted,
    /// Nothing could be scheduled for it.
    Blocked,
}
impl Engine {
    /// Runs one scheduler step; `None` when there is nothing to do.
    pub fn step(&mut self) -> Option<Step> {
        if self.is_idle() {
            return None;
        }
        // Requests whose loads are done go back to the front of the queue, in order.
        for s in self.loading.take_done(self.clock).into_iter().rev() {
            self.requeue(s);
        }
        let mut st = StepState {
            budget: self.config.max_batched_tokens,
            events: self.events(),
            work: vec![None; self.running.len()],
            preempted_any: false,
            lora_time: Duration::ZERO,
            shifted: 0,
        };
        // 1. Running requests, in order; 2. waiting ones, first come first served.
        self.continue_running(&mut st);
        self.admit_waiting(&mut st);
        // 3. How long the step takes.
        let mut out = Step { duration: self.step_time(&st.work, st.lora_time), ..Step::default() };
        self.clock += out.duration;

        // 4. Outputs: every request with all its known tokens computed samples one.
        self.sample(&mut out);
        if out.duration.is_zero() && out.outputs.is_empty() {
            // Nothing ran: wait for the next load to finish (a little at a time, so that a
            // request arriving meanwhile is not kept waiting long).
            if let Some(done) = self.loading.next_done() {
                out.duration = done.saturating_sub(self.clock).min(crate::loads::MAX_WAIT);
                self.clock += out.duration;
            }
        }
        out.events = st.events.events;
        Some(out)
    }

    /// A step's first phase: the running requests, in order, each as far as the budget goes.
    pub(super) fn continue_running(&mut self, st: &mut StepState) {
        let mut i = 0;
        while i < self.running.len() && st.budget > 0 {
            let s = &self.running[i];
            let n = (s.len() - s.computed).min(st.budget);
            let outcome = self.schedule_in(i, n, st);
            i -= std::mem::take(&mut st.shifted);
            match outcome {
                Scheduled::Yes => i += 1,
                Scheduled::Preempted => {}
                Scheduled::Blocked => break,
            }
        }
    }

    /// A step's second phase: waiting requests, first come first served; one whose adapter
    /// would make one more than the slots hold is passed over (as vLLM skips it) and keeps
    /// its place.
    pub(super) fn admit_waiting(&mut self, st: &mut StepState) {
        let mut skipped: Vec<Sequence> = Vec::new();
        while !st.preempted_any && st.budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(front) = self.waiting.front() else { break };
            if !self.slot_for(front) {
                skipped.extend(self.waiting.pop_front());
                continue;
            }
            if !self.admit_front(st) {
                break;
            }
        }
        for s in skipped.into_iter().rev() {
            self.waiting.push_front(s);
        }
    }

    /// Admits the first waiting request if the cache has room for it: into the running
    /// batch, or out to load its blocks from a lower tier first. `false`: stop admitting.
    pub(super) fn admit_front(&mut self, st: &mut StepState) -> bool {
        let Some(front) = self.waiting.front_mut() else { return false };
        let bs = self.config.block_size.tokens();
        let len = front.len();
        let own = front.reserved;
        let hashes = front.full_hashes(&self.hasher).to_vec();
        // The last token is always computed (its logits are needed).
        let full_hits = self.cache.cached_prefix(&hashes).min((len - 1) / bs);
        let (hits, run) = self.window_hit(&hashes, full_hits);
        let active_hits = self.cache.referenced(0, &hashes[..hits]);
        let mut needed = len.div_ceil(bs) - active_hits;
        if let Some(run) = &run {
            // The window group's new blocks, and the run's blocks nobody holds.
            let active = self.cache.referenced(1, &hashes[run.clone()]);
            needed += len.div_ceil(bs) - hits + run.len() - active;
        }
        // Room kept for loading requests is not this one's, unless it is its own.
        let free = self.cache.capacity() - self.cache.in_use();
        if needed > free.saturating_sub(self.reserved - own) {
            return false;
        }
        if let Some(took) = self.start_load(&hashes, hits, (len - 1) / bs) {
            // Out of the queue while its load runs, its room kept; the next in line may go
            // meanwhile.
            let Some(mut s) = self.waiting.pop_front() else { return false };
            s.reserved = needed;
            self.reserved += needed;
            self.loading.start(self.clock, self.config.timing.scale(took), s);
            return true;
        }
        let Some(s) = self.waiting.pop_front() else { return false };
        let hits = self.take_in(s, &hashes, hits, run, st);
        let at = self.running.len() - 1;
        let n = (len - hits * bs).min(st.budget);
        matches!(self.schedule_in(at, n, st), Scheduled::Yes)
    }

    /// Puts an admitted request in the running batch with its cached blocks, those it loads
    /// from lower tiers and those it receives from a prefill engine; returns its hit blocks.
    pub(super) fn take_in(
        &mut self,
        mut s: Sequence,
        hashes: &[SequenceHash],
        hits: usize,
        run: Option<std::ops::Range<usize>>,
        st: &mut StepState,
    ) -> usize {
        let bs = self.config.block_size.tokens();
        let len = s.len();
        // Its load, if it ran beside the steps, is paid.
        let paid = std::mem::take(&mut s.reserved);
        self.reserved -= paid;
        if let Some((name, _)) = &s.lora {
            let in_use: Vec<&str> = self.running.iter().filter_map(Sequence::adapter).collect();
            st.lora_time += self.adapters.activate(name, &in_use);
        }
        self.cache.reference(0, &hashes[..hits]);
        s.blocks = hashes[..hits].iter().map(|&h| Block::Cached(h)).collect();
        if let Some(run) = run {
            self.cache.reference(1, &hashes[run.clone()]);
            s.window = vec![Block::Skipped; run.start];
            s.window.extend(hashes[run].iter().map(|&h| Block::Cached(h)));
        }
        let (loaded, took) =
            self.load_from_tiers(&mut s, hashes, hits, (len - 1) / bs, &mut st.events);
        if paid == 0 {
            st.lora_time += took;
        }
        let hits = hits + loaded;
        let hits = match s.handoff {
            Handoff::Remote => hits + self.receive_remote(&mut s, hashes, hits, &mut st.events),
            _ => hits,
        };
        s.filled = hits;
        s.computed = hits * bs;
        s.cached_tokens.get_or_insert(hits * bs);
        self.running.push(s);
        st.work.push(None);
        hits
    }

    /// [`Engine::schedule`] with the step's state.
    pub(super) fn schedule_in(&mut self, i: usize, n: usize, st: &mut StepState) -> Scheduled {
        let StepState { work, budget, events, preempted_any, shifted, .. } = st;
        self.schedule(i, n, work, budget, events, (preempted_any, shifted))
    }

    /// A step's third phase: its time, from the prefills, the decodes and the adapters it
    /// ran (`lora_time` holds synchronous tier loads too: both hold up the step).
    pub(super) fn step_time(&self, work: &[Option<Work>], lora_time: Duration) -> Duration {
        let timing = self.config.timing;
        let prefilled: Vec<&Work> =
            work.iter().flatten().filter(|w| w.prompt_tokens > 0 && !w.remote).collect();
        let prefill = match prefilled.len() {
            0 => Duration::ZERO,
            count => {
                let isl: usize = prefilled.iter().map(|w| w.prompt_before + w.prompt_tokens).sum();
                let prefix: usize = prefilled.iter().map(|w| w.prompt_before).sum();
                timing.prefill(count * (isl / count - prefix / count))
            }
        };
        let mut decoding = 0;
        let mut decoding_tokens = 0;
        for (s, w) in self.running.iter().zip(work) {
            let ready = s.computed == s.len();
            let first_from_prefill = s.generated == 0 && w.is_some_and(|w| w.prompt_tokens > 0);
            if ready && !first_from_prefill {
                decoding += 1;
                decoding_tokens += s.len();
            }
        }
        let capacity_tokens = self.config.num_blocks * self.config.block_size.tokens();
        let decode = match decoding {
            0 => Duration::ZERO,
            _ => timing.decode(decoding_tokens as f64 / capacity_tokens.max(1) as f64),
        };
        // Each distinct adapter in the batch adds the LoRA kernels' work.
        let mut batch_adapters: Vec<&str> = self
            .running
            .iter()
            .zip(work)
            .filter(|(_, w)| w.is_some())
            .filter_map(|(s, _)| s.adapter())
            .collect();
        batch_adapters.sort_unstable();
        batch_adapters.dedup();
        let lora_step = self.adapters.step_cost() * batch_adapters.len() as u32;
        prefill + decode + timing.scale(lora_time + lora_step)
    }

    /// Schedules `n` tokens of running request `i`: allocates their blocks (preempting the
    /// newest running requests if the cache is full) and caches the blocks they complete.
    pub(super) fn schedule(
        &mut self,
        i: usize,
        n: usize,
        work: &mut Vec<Option<Work>>,
        budget: &mut usize,
        events: &mut Events,
        (preempted_any, shifted): (&mut bool, &mut usize),
    ) -> Scheduled {
        let mut i = i;
        let bs = self.config.block_size.tokens();
        if n == 0 {
            return Scheduled::Blocked;
        }
        if let Some(window) = self.config.sliding_window {
            self.running[i].skip_behind_window(&mut self.cache, window as usize, bs);
        }
        loop {
            let s = &self.running[i];
            let blocks = (s.computed + n).div_ceil(bs);
            let needed = blocks.saturating_sub(s.blocks.len());
            let window_needed = match self.config.sliding_window {
                Some(_) => blocks.saturating_sub(s.window.len()),
                None => 0,
            };
            let mut gone = Vec::new();
            if self.cache.grow(needed + window_needed, &mut gone).is_ok() {
                self.stats.evicted_blocks += gone.len() as u64;
                events.removed(&gone);
                let s = &mut self.running[i];
                s.blocks.extend(std::iter::repeat_n(Block::Private, needed));
                s.window.extend(std::iter::repeat_n(Block::Private, window_needed));
                break;
            }
            // No room: the newest running request (or, by priority, the least urgent) gives
            // its blocks back.
            let victim = self.preemption_victim();
            let mut v = self.running.remove(victim);
            v.release(&mut self.cache);
            self.stats.preemptions += 1;
            *preempted_any = true;
            if let Some(undone) = work.remove(victim) {
                *budget += undone.tokens;
            }
            self.requeue(v);
            if victim == i {
                return Scheduled::Preempted;
            }
            if victim < i {
                i -= 1;
                *shifted += 1;
            }
        }
        let s = &mut self.running[i];
        let prompt_before = s.computed.min(s.prompt_len);
        s.computed += n;
        let prompt_tokens = s.computed.min(s.prompt_len) - prompt_before;
        let remote = s.handoff == Handoff::Remote;
        work[i] = Some(Work { tokens: n, prompt_tokens, prompt_before, remote });
        *budget -= n;
        self.cache_computed_blocks(i, events);
        Scheduled::Yes
    }

    /// Caches the request's private blocks that are now full and computed; new ones are
    /// announced (a block another request cached first stays private, as vLLM keeps both),
    /// and written through to host memory and storage below it.
    pub(super) fn cache_computed_blocks(&mut self, i: usize, events: &mut Events) {
        let bs = self.config.block_size.tokens();
        let s = &mut self.running[i];
        let full = (s.computed / bs).min(s.blocks.len());
        s.full_hashes(&self.hasher);
        let mut run: Vec<usize> = Vec::new();
        // Blocks before `filled` were dealt with by earlier steps.
        let mut window_run: Vec<usize> = Vec::new();
        for b in s.filled..full {
            let hash = s.hashes[b];
            if s.window.get(b) == Some(&Block::Private) && self.cache.fill(1, hash) == Stored::New {
                s.window[b] = Block::Cached(hash);
                window_run.push(b);
            }
            if s.blocks[b] != Block::Private || self.cache.fill(0, hash) == Stored::Duplicate {
                continue;
            }
            s.blocks[b] = Block::Cached(hash);
            run.push(b);
        }
        s.filled = s.filled.max(full);
        // Group by group, as vLLM's coordinator caches them.
        events.stored_runs(bs, s, &run, GPU, 0);
        events.stored_runs(bs, s, &window_run, GPU, 1);
        if self.writes.enabled && !run.is_empty() {
            self.writes.write(run.iter().map(|&b| stored_event(bs, s, &[b], GPU)).collect());
        }
        if !self.host.enabled() || run.is_empty() {
            return;
        }
        let hashes: Vec<SequenceHash> = run.iter().map(|&b| s.hashes[b]).collect();
        let s = &self.running[i];
        store_in(&mut self.host, bs, s, &run, &hashes, CPU, events);
        store_in(&mut self.storage, bs, s, &run, &hashes, STORAGE, events);
    }
}
