//! Process groups: who the ranks are and how they exchange small messages during setup and host-side
//! collectives.
//!
//! - [`ThreadGroup`]: every rank is a thread of this process (the bench CLI, Rust tests, a Rust engine
//!   driving all GPUs from one process).
//! - [`TcpGroup`]: one process per rank, rendezvous over TCP from torchrun's environment variables.
//!
//! Every blocking call has a deadline; a missing rank turns into [`Error::Timeout`] naming it.

mod tcp;
mod thread;

pub use tcp::{TcpConfig, TcpGroup};
pub use thread::{run_ranks, run_ranks_with_timeout, ThreadGroup};

use std::time::Duration;

use crate::error::{Error, Result};

/// Default deadline for group collectives.
pub const DEFAULT_GROUP_TIMEOUT_MS: u64 = 60_000;

/// A set of ranks that can exchange bytes.
pub trait Group: Send + Sync {
    /// This rank, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Index of this rank among the ranks of its host (the GPU it should use by default).
    fn local_rank(&self) -> usize {
        self.rank()
    }
    /// An identifier shared by ranks that live in the same process (same address space). Ranks with equal
    /// keys can exchange raw pointers; others need IPC handles.
    fn process_key(&self) -> u64 {
        process_key()
    }
    /// Every rank contributes `bytes`; every rank receives all contributions, indexed by rank.
    fn all_gather(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Rank `r` receives `send[r]` from every rank; the result is indexed by source rank.
    /// `send.len()` must equal `size()`.
    fn all_to_all(&self, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        // Generic fallback over all_gather: correct for any group, wasteful in bytes.
        let n = self.size();
        if send.len() != n {
            return Err(Error::invalid("send", self.rank(), format!("{} messages for {n} ranks", send.len())));
        }
        let mut packed = Vec::new();
        for m in &send {
            packed.extend_from_slice(&(m.len() as u64).to_le_bytes());
            packed.extend_from_slice(m);
        }
        let all = self.all_gather(&packed)?;
        let me = self.rank();
        all.iter()
            .enumerate()
            .map(|(src, p)| {
                unpack_nth(p, me).ok_or_else(|| Error::Group { rank: me, reason: format!("malformed all_to_all message from rank {src}") })
            })
            .collect()
    }
    /// Returns once every rank has entered.
    fn barrier(&self) -> Result<()> {
        self.all_gather(&[]).map(|_| ())
    }
    /// [`Group::all_gather`] that waits at most `timeout` for the other ranks: a rank that does not arrive
    /// in time is [`Error::Timeout`] naming it. The host backend exchanges through this with the buffer's
    /// `timeout_ms`. The default ignores `timeout` and keeps the group's own deadline; the groups of this
    /// crate and of the Python package honour it.
    fn all_gather_within(&self, bytes: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let _ = timeout;
        self.all_gather(bytes)
    }
    /// [`Group::all_to_all`] that waits at most `timeout` for the other ranks (see
    /// [`Group::all_gather_within`]).
    fn all_to_all_within(&self, send: Vec<Vec<u8>>, timeout: Duration) -> Result<Vec<Vec<u8>>> {
        let _ = timeout;
        self.all_to_all(send)
    }
}

fn unpack_nth(p: &[u8], n: usize) -> Option<Vec<u8>> {
    let mut off = 0usize;
    for i in 0.. {
        let len = u64::from_le_bytes(p.get(off..off + 8)?.try_into().ok()?) as usize;
        off += 8;
        let body = p.get(off..off + len)?;
        if i == n {
            return Some(body.to_vec());
        }
        off += len;
    }
    None
}

/// Key of the current process: host name hash mixed with the pid.
pub fn process_key() -> u64 {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut h: u64 = 0xcbf29ce484222325;
    for b in host.trim().bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h ^ (std::process::id() as u64).wrapping_mul(0x9E3779B97F4A7C15)
}

/// Checks that every rank holds the same values for `items` (name, value). Returns the first disagreement
/// as [`Error::RankMismatch`] naming the peer.
pub fn check_agreement(group: &dyn Group, items: &[(&'static str, u64)]) -> Result<()> {
    check_agreement_with(group.rank(), items, |mine| group.all_gather(mine))
}

/// [`check_agreement`] over `gather` (an all-gather of this rank's bytes, e.g. one with a deadline).
pub(crate) fn check_agreement_with(
    me: usize,
    items: &[(&'static str, u64)],
    gather: impl FnOnce(&[u8]) -> Result<Vec<Vec<u8>>>,
) -> Result<()> {
    let mine: Vec<u8> = items.iter().flat_map(|(_, v)| v.to_le_bytes()).collect();
    let all = gather(&mine)?;
    for (peer, theirs) in all.iter().enumerate() {
        if theirs.len() != mine.len() {
            return Err(Error::Group {
                rank: me,
                reason: format!("rank {peer} sent {} bytes of call signature, expected {}", theirs.len(), mine.len()),
            });
        }
        for (i, (name, ours)) in items.iter().enumerate() {
            let t = u64::from_le_bytes(theirs[8 * i..8 * i + 8].try_into().expect("8-byte chunk"));
            if t != *ours {
                return Err(Error::RankMismatch { what: name, rank: me, peer, ours: ours.to_string(), theirs: t.to_string() });
            }
        }
    }
    Ok(())
}
