//! Live heap bytes per (worker, block) pair of the index, measured by a counting allocator
//! (not an estimate), for the bench workload stored as 64-block and as 1-block events.
//! Target: <= 40 bytes per pair whatever the event size. Prints a markdown table.

use std::alloc::System;

use kvroute_core::RadixIndex;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[path = "support/workload.rs"]
mod workload;
use workload::Workload;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[allow(clippy::print_stdout)]
fn main() {
    // `cargo test --benches` runs bench binaries with no `--bench`: keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let shapes: &[(u64, usize)] = if quick {
        &[(8, 20_000)]
    } else {
        &[(8, 100_000), (64, 100_000), (8, 1_000_000), (64, 1_000_000)]
    };
    println!(
        "| workers | pairs | event size | distinct blocks | nodes | live heap bytes | bytes/pair | index's own estimate/pair |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for &(workers, pairs) in shapes {
        let workload = Workload::new(pairs, workers, 7);
        for chunk in [64, 1] {
            let events = workload.stored_events(chunk);
            let region = Region::new(GLOBAL);
            let mut index = RadixIndex::new();
            for e in &events {
                index.apply_event(e).expect("workload events are valid");
            }
            let stats = region.change();
            // stats_alloc adds a growing realloc's extra bytes to `bytes_allocated` itself.
            let live = stats.bytes_allocated as isize - stats.bytes_deallocated as isize;
            let s = index.stats();
            println!(
                "| {workers} | {} | {chunk} | {} | {} | {live} | {:.1} | {:.1} |",
                s.held_blocks,
                s.blocks,
                s.nodes,
                live as f64 / s.held_blocks as f64,
                s.heap_bytes as f64 / s.held_blocks as f64,
            );
            drop(index);
        }
    }
}
