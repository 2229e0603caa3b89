//! What kvroute asks of the C allocator, kept apart because it is the only `unsafe` in the
//! workspace.
//!
//! glibc's `malloc` keeps the pages a burst of large allocations freed: in each thread's
//! arena, and anywhere below a heap's top, where its automatic trimming never looks. A server
//! that took 24 held 60 MiB request bodies stayed 58 MiB above its idle RSS for good after
//! they were dropped (issue #30); `malloc_trim(0)` gave all of it back (RSS 109 to 38 MiB).
//! [`give_back_free_memory`] is that call, and a no-op with any other allocator.
//!
//! The crate also holds the one other call into the C library that needs `unsafe`:
//! [`lower_this_thread`], which gives background threads (the router's event plane) a lower
//! scheduling priority than the threads that answer requests.

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

/// Sets the calling thread's nice value to `nice` (0 to 19; above the default 0 is a lower
/// scheduling priority), with Linux `setpriority` on the thread: on Linux a nice value is
/// each thread's own. Returns whether it took effect (it does not when that would raise the
/// priority without privileges); a no-op elsewhere. Lowering is for good without privileges,
/// so this is for threads that stay background for their whole life.
pub fn lower_this_thread(nice: i32) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `gettid` and `setpriority` take plain integers and touch no memory of ours;
        // `who` is this thread's own id, so no other thread or process is changed.
        unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice.clamp(0, 19)) == 0
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = nice;
        false
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

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_thread_lowers_itself_and_no_other() {
        let nice_of = |task: String| {
            let stat = std::fs::read_to_string(task).unwrap_or_default();
            // Field 19 of /proc/.../stat, counted after the command name's closing paren.
            let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
            rest.split_whitespace().nth(16).and_then(|n| n.parse::<i32>().ok())
        };
        let before = nice_of("/proc/thread-self/stat".into());
        if before != Some(0) {
            return; // started niced: lowering to 5 may be a raise
        }
        let lowered = std::thread::spawn(move || {
            assert!(super::lower_this_thread(5));
            nice_of("/proc/thread-self/stat".into())
        })
        .join()
        .unwrap_or_default();
        assert_eq!(lowered, Some(5), "the thread itself");
        assert_eq!(nice_of("/proc/thread-self/stat".into()), before, "not the caller's");
    }
}
