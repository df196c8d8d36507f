//! Ranks as threads of this process (one GPU each on CUDA), with a group deadline of our choosing.

use std::time::Duration;

use moelink::{Error, Result, ThreadGroup};

/// Runs `f` on `size` threads, one per rank of a fresh [`ThreadGroup`] whose collectives wait at most
/// `timeout`, and returns each rank's result in rank order. A panicking rank becomes an error (the others
/// then time out instead of hanging).
pub fn run_threads<T, F>(size: usize, timeout: Duration, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(ThreadGroup) -> Result<T> + Sync,
{
    let groups = ThreadGroup::with_timeout(size, timeout);
    std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(|| f(g))).collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| h.join().unwrap_or_else(|_| Err(Error::Group { rank, reason: "rank thread panicked".into() })))
            .collect()
    })
}

/// The most telling error among ranks: a rank's own failure rather than the timeouts it caused elsewhere.
pub fn first_cause(errors: &[&Error]) -> Option<String> {
    let secondary = |e: &Error| matches!(e, Error::Timeout { .. } | Error::Group { .. } | Error::Poisoned { .. });
    errors.iter().find(|e| !secondary(e)).or_else(|| errors.first()).map(|e| e.to_string())
}
