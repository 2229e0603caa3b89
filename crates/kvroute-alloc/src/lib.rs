//! What kvroute asks of the C allocator, kept apart because it is the only `unsafe` in the
//! workspace.
//!
//! glibc's `malloc` keeps the pages a burst of large allocations freed: in each thread's
//! arena, and anywhere below a heap's top, where its automatic trimming never looks. A server
//! that took 24 held 60 MiB request bodies stayed 58 MiB above its idle RSS for good after
//! they were dropped (issue #30); `malloc_trim(0)` gave all of it back (RSS 109 to 38 MiB).
//! [`give_back_free_memory`] is that call, and a no-op with any other allocator.

/// Returns the allocator's free pages to the OS (glibc's `malloc_trim(0)`). It walks every
/// arena, holding each one's lock for the walk, so call it off the async runtime and only
/// after a large release, not per request.
pub fn give_back_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes a padding size and touches only the allocator's own state,
    // under its own locks; it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    /// This process's resident set, in bytes.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn rss() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap_or_default();
        let kib = line.split_whitespace().nth(1).and_then(|k| k.parse::<usize>().ok());
        kib.unwrap_or(0) << 10
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn pages_freed_below_the_heap_top_go_back_to_the_os() {
        // 64 MiB in 64 KiB blocks (below glibc's mmap threshold, so on the heap), then all
        // freed but the last, which pins the heap's top: glibc keeps the rest.
        let mut blocks: Vec<Vec<u8>> = (0..1024).map(|i| vec![i as u8 | 1; 64 << 10]).collect();
        let last = blocks.pop();
        drop(blocks);
        let before = rss();
        super::give_back_free_memory();
        let after = rss();
        assert!(before - after.min(before) > 32 << 20, "RSS {before} -> {after}");
        assert!(last.is_some_and(|b| b.iter().all(|&x| x == 255 | 1)));
    }

    #[test]
    fn it_can_be_called_anywhere() {
        super::give_back_free_memory();
        super::give_back_free_memory();
    }
}
