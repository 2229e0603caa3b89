//! A shard's lock: readers go first, and a waiter spins for a few microseconds, then sleeps.
//!
//! Two ways a lookup used to wait behind the event plane, and what this lock does about each:
//! - **A writer that keeps coming back.** An event is applied in pieces of a few blocks, one
//!   hold each, back to back; a spinning reader lost the race for the lock between pieces and
//!   waited out the whole event (and the next). Here a reader that finds the lock taken says
//!   so (`readers_waiting`), and a writer does not take the lock while one waits: a lookup
//!   waits for at most the one piece being applied, well under a microsecond.
//! - **A holder the kernel preempted.** When the event plane shares a core with the lookups,
//!   the kernel can stop the writer in the middle of a piece; a waiter that spins (or yields,
//!   which the scheduler may ignore in favour of the spinner) keeps the holder off its core
//!   for a whole time slice, milliseconds. Here a waiter spins for [`SPIN_FOR`] (a running
//!   holder is done by then) and then sleeps on a condition variable, which gives the core to
//!   the holder; the holder's release wakes it.
//!
//! The fast paths are one atomic each, as in the spinning lock underneath ([`spin::RwLock`]);
//! the release checks one counter and touches the condition variable only when someone sleeps.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

type Inner<T> = spin::rwlock::RwLock<T, spin::relax::Spin>;

/// How long a waiter spins before it sleeps: several times the longest hold of a running
/// holder (a piece of an event, a lookup on a hot prefix), far below a time slice.
const SPIN_FOR: Duration = Duration::from_micros(20);

/// A sleeper wakes at least this often to look again (a safety net: releases wake sleepers).
const NAP: Duration = Duration::from_millis(1);

#[derive(Debug)]
pub(super) struct ShardLock<T> {
    inner: Inner<T>,
    /// Readers that found the lock taken and are waiting for it; writers let them in first.
    readers_waiting: AtomicU32,
    /// Waiters asleep on `wake`.
    sleepers: AtomicU32,
    room: Mutex<()>,
    wake: Condvar,
}

impl<T> ShardLock<T> {
    pub(super) fn new(value: T) -> Self {
        Self {
            inner: Inner::new(value),
            readers_waiting: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
            room: Mutex::new(()),
            wake: Condvar::new(),
        }
    }

    pub(super) fn read(&self) -> ReadGuard<'_, T> {
        if let Some(guard) = self.inner.try_read() {
            return ReadGuard { guard: Some(guard), lock: self };
        }
        self.readers_waiting.fetch_add(1, Ordering::SeqCst);
        let guard = self.wait(|| self.inner.try_read());
        self.readers_waiting.fetch_sub(1, Ordering::SeqCst);
        ReadGuard { guard: Some(guard), lock: self }
    }

    pub(super) fn write(&self) -> WriteGuard<'_, T> {
        let take = || match self.readers_waiting.load(Ordering::SeqCst) {
            0 => self.inner.try_write(),
            _ => None,
        };
        let guard = match take() {
            Some(guard) => guard,
            None => self.wait(take),
        };
        WriteGuard { guard: Some(guard), lock: self }
    }

    /// Tries `take` until it succeeds: spinning for [`SPIN_FOR`], then asleep between tries.
    #[cold]
    fn wait<G>(&self, take: impl Fn() -> Option<G>) -> G {
        let start = Instant::now();
        let mut tries = 0u32;
        loop {
            if let Some(guard) = take() {
                return guard;
            }
            tries = tries.wrapping_add(1);
            if !tries.is_multiple_of(32) || start.elapsed() < SPIN_FOR {
                std::hint::spin_loop();
                continue;
            }
            let room = self.room.lock().unwrap_or_else(|e| e.into_inner());
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            // Either this try sees the release, or the releaser sees the sleeper (and, taking
            // `room`, waits until this thread sleeps before it wakes it).
            if let Some(guard) = take() {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                return guard;
            }
            let room = self.wake.wait_timeout(room, NAP).map(|(r, _)| r);
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(room);
        }
    }

    /// After a release: wakes the sleepers, if any.
    fn released(&self) {
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _room = self.room.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }
}

pub(super) struct ReadGuard<'a, T> {
    guard: Option<spin::rwlock::RwLockReadGuard<'a, T>>,
    lock: &'a ShardLock<T>,
}

impl<T> Deref for ReadGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_deref().expect("held until dropped")
    }
}

impl<T> Drop for ReadGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.lock.released();
    }
}

pub(super) struct WriteGuard<'a, T> {
    guard: Option<spin::rwlock::RwLockWriteGuard<'a, T, spin::relax::Spin>>,
    lock: &'a ShardLock<T>,
}

impl<T> Deref for WriteGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_deref().expect("held until dropped")
    }
}

impl<T> DerefMut for WriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_deref_mut().expect("held until dropped")
    }
}

impl<T> Drop for WriteGuard<'_, T> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.lock.released();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    use super::*;

    #[test]
    fn writers_exclude_everyone_and_nothing_is_lost() {
        let lock = Arc::new(ShardLock::new((0u64, 0u64)));
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (lock, stop) = (lock.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let g = lock.read();
                        // A writer changes both halves under one hold: never seen torn.
                        assert_eq!(g.0, g.1);
                        seen += 1;
                    }
                    seen
                })
            })
            .collect();
        let writers: Vec<_> = (0..3)
            .map(|_| {
                let lock = lock.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut g = lock.write();
                        g.0 += 1;
                        std::hint::black_box(&mut *g);
                        g.1 += 1;
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().expect("writer");
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().expect("reader") > 0);
        }
        assert_eq!(*lock.read(), (60_000, 60_000));
        assert_eq!(lock.sleepers.load(Ordering::SeqCst), 0);
        assert_eq!(lock.readers_waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_waiter_that_sleeps_is_woken_by_the_release() {
        let lock = Arc::new(ShardLock::new(0u32));
        let held = lock.write();
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.read())
        };
        // Hold well past the spin budget, until the reader has gone to sleep.
        while lock.sleepers.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        drop(held);
        assert_eq!(waiter.join().expect("reader"), 0);
    }

    #[test]
    fn a_writer_holds_back_while_a_reader_waits() {
        let lock = Arc::new(ShardLock::new(0u32));
        lock.readers_waiting.fetch_add(1, Ordering::SeqCst);
        let writer = {
            let lock = lock.clone();
            std::thread::spawn(move || *lock.write() += 1)
        };
        // The lock is free, yet the writer goes to sleep rather than take it.
        while lock.sleepers.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        assert_eq!(*lock.inner.try_read().expect("free"), 0);
        lock.readers_waiting.fetch_sub(1, Ordering::SeqCst);
        writer.join().expect("writer");
        assert_eq!(*lock.read(), 1);
    }
}
