//! In-process group: ranks are threads sharing one rendezvous object.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Group, DEFAULT_GROUP_TIMEOUT_MS};
use crate::error::{Error, Phase, Result};

type Matrix = Vec<Vec<Option<Vec<u8>>>>;

struct State {
    /// Completed rounds so far; a waiter knows its round finished when this moves past its own.
    generation: u64,
    /// Messages of the round in progress: `pending[src][dst]`.
    pending: Matrix,
    arrived: Vec<bool>,
    /// Result of the last completed round; each rank takes its column.
    finished: Option<Arc<Mutex<Matrix>>>,
    /// Set when a rank gave up (timeout): the group cannot be trusted any more.
    broken: Option<Broken>,
}

struct Broken {
    reason: String,
    /// The rank the first rank to give up was waiting for: every rank waiting in that round reports it.
    missing: usize,
}

struct Shared {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
    timeout: Duration,
}

/// One rank's handle on an in-process group. Create all ranks at once with [`ThreadGroup::new`] and move
/// each into its thread, or use [`run_ranks`].
#[derive(Clone)]
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadGroup {
    /// Handles for `size` ranks with the default deadline.
    pub fn new(size: usize) -> Vec<ThreadGroup> {
        Self::with_timeout(size, Duration::from_millis(DEFAULT_GROUP_TIMEOUT_MS))
    }

    /// Handles for `size` ranks; a collective waits at most `timeout` for the others.
    pub fn with_timeout(size: usize, timeout: Duration) -> Vec<ThreadGroup> {
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(State {
                generation: 0,
                pending: vec![vec![None; size]; size],
                arrived: vec![false; size],
                finished: None,
                broken: None,
            }),
            cv: Condvar::new(),
            timeout,
        });
        (0..size).map(|rank| ThreadGroup { rank, shared: shared.clone() }).collect()
    }

    /// One exchange round: deposit `row` (messages to each rank), wait at most `timeout` for everyone,
    /// take column `rank`.
    fn exchange(&self, row: Vec<Option<Vec<u8>>>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let sh = &*self.shared;
        let me = self.rank;
        fn lock_err<T>(me: usize) -> impl Fn(T) -> Error {
            move |_| Error::Group { rank: me, reason: "group state poisoned by a panicking rank".into() }
        }
        let mut st = sh.state.lock().map_err(lock_err(me))?;
        if let Some(b) = &st.broken {
            return Err(Error::Group { rank: me, reason: format!("group is broken: {}", b.reason) });
        }
        let generation = st.generation;
        st.pending[me] = row;
        st.arrived[me] = true;
        let finished = if st.arrived.iter().all(|&a| a) {
            let m = std::mem::replace(&mut st.pending, vec![vec![None; sh.size]; sh.size]);
            st.arrived.iter_mut().for_each(|a| *a = false);
            let done = Arc::new(Mutex::new(m));
            st.finished = Some(done.clone());
            st.generation += 1;
            sh.cv.notify_all();
            done
        } else {
            let start = Instant::now();
            loop {
                let left = timeout.saturating_sub(start.elapsed());
                let (guard, _) = sh.cv.wait_timeout(st, left).map_err(lock_err(me))?;
                st = guard;
                if st.generation != generation {
                    break st.finished.clone().expect("a finished round leaves its result");
                }
                if let Some(b) = &st.broken {
                    // A rank of this round gave up on a missing one: so does this rank, naming the same one.
                    return Err(Error::Timeout {
                        rank: me,
                        peer: b.missing,
                        phase: Phase::Group,
                        waited_ms: start.elapsed().as_millis() as u64,
                    });
                }
                if start.elapsed() >= timeout {
                    let peer = st.arrived.iter().position(|a| !a).unwrap_or(me);
                    st.broken = Some(Broken { reason: format!("rank {me} timed out waiting for rank {peer}"), missing: peer });
                    sh.cv.notify_all();
                    return Err(Error::Timeout { rank: me, peer, phase: Phase::Group, waited_ms: start.elapsed().as_millis() as u64 });
                }
            }
        };
        drop(st);
        let mut m = finished.lock().map_err(lock_err(me))?;
        Ok((0..sh.size).map(|src| m[src][me].take().unwrap_or_default()).collect())
    }
}

impl Group for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.all_gather_within(bytes, self.shared.timeout)
    }
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        self.all_to_all_within(send, self.shared.timeout)
    }
    fn all_gather_within(&self, bytes: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        self.exchange(vec![Some(bytes.to_vec()); self.shared.size], timeout)
    }
    fn all_to_all_within(&self, send: Vec<Vec<u8>>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        if send.len() != self.shared.size {
            return Err(Error::invalid("send", self.rank, format!("{} messages for {} ranks", send.len(), self.shared.size)));
        }
        self.exchange(send.into_iter().map(Some).collect(), timeout)
    }
}

/// Runs `f` on `size` threads, one per rank of a fresh [`ThreadGroup`], and returns each rank's result in
/// rank order. A panic on one rank becomes an error for that rank (the others time out or finish).
pub fn run_ranks<T, F>(size: usize, f: F) -> Vec<Result<T>>
where
    T: Send,
    F: Fn(ThreadGroup) -> Result<T> + Sync,
{
    run_ranks_with_timeout(size, Duration::from_millis(DEFAULT_GROUP_TIMEOUT_MS), f)
}

/// [`run_ranks`] with a group whose collectives wait at most `timeout` for the other ranks.
pub fn run_ranks_with_timeout<T, F>(size: usize, timeout: Duration, f: F) -> Vec<Result<T>>
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_gather_and_all_to_all_deliver_by_rank() {
        let out = run_ranks(4, |g| {
            let gathered = g.all_gather(&[g.rank() as u8; 3])?;
            let sent: Vec<Vec<u8>> = (0..4).map(|dst| vec![(10 * g.rank() + dst) as u8]).collect();
            let recv = g.all_to_all(sent)?;
            g.barrier()?;
            Ok((gathered, recv))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (gathered, recv) = r.unwrap();
            assert_eq!(gathered, (0..4u8).map(|s| vec![s; 3]).collect::<Vec<_>>());
            assert_eq!(recv, (0..4).map(|src| vec![(10 * src + rank) as u8]).collect::<Vec<_>>());
        }
    }

    #[test]
    fn many_rounds_back_to_back_stay_in_order() {
        let out = run_ranks(3, |g| {
            let mut sums = Vec::new();
            for round in 0..200u32 {
                let all = g.all_gather(&(round * 7 + g.rank() as u32).to_le_bytes())?;
                sums.push(all.iter().map(|b| u32::from_le_bytes(b[..4].try_into().unwrap())).sum::<u32>());
            }
            Ok(sums)
        });
        for r in out {
            let sums = r.unwrap();
            for (round, s) in sums.iter().enumerate() {
                assert_eq!(*s, 3 * 7 * round as u32 + 3);
            }
        }
    }

    #[test]
    fn a_missing_rank_is_a_timeout_naming_it() {
        let groups = ThreadGroup::with_timeout(3, Duration::from_millis(200));
        let out: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = groups.into_iter().map(|g| s.spawn(move || if g.rank() == 2 { Ok(()) } else { g.barrier() })).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in &out[..2] {
            assert!(matches!(r, Err(Error::Timeout { peer: 2, .. })), "every waiting rank names rank 2: {r:?}");
        }
        assert!(out[2].is_ok());
    }
}
