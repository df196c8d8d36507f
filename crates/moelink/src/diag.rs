//! GPU diagnostics used by `moelink selftest` and `moelink bench nvlink`: symmetric memory across ranks,
//! the cross-GPU barrier, deadlines, NVLink copy bandwidth and JIT timings. (Placeholder signatures; being
//! implemented with the CUDA layer.)

use crate::error::{Error, Result};
use crate::group::Group;

/// How the copy primitive moves bytes into peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// 16-byte SM stores (`st.global.v4`) into peer memory.
    SmStores,
    /// TMA bulk copies (`cp.async.bulk`) shared → peer global.
    Tma,
}

/// Traffic pattern of a copy measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPattern {
    /// Rank 0 writes into rank 1.
    Pair,
    /// Every rank writes an equal share into every other rank.
    AllToAll,
}

/// One bandwidth measurement.
#[derive(Clone, Debug)]
pub struct CopyBandwidth {
    pub pattern: CopyPattern,
    pub method: CopyMethod,
    pub num_sms: usize,
    /// Bytes each receiving GPU received per repetition.
    pub bytes_per_gpu: usize,
    /// Median over repetitions of the slowest rank's kernel time.
    pub time_us: f64,
    /// Per-GPU ingress, 1e9 B/s.
    pub gbps: f64,
    /// Every received word matched the pattern.
    pub verified: bool,
}

/// Collective: measures the copy primitive writing into peers for each SM count in `sms`.
pub fn nvlink_bandwidth(
    _group: &dyn Group,
    _device: usize,
    _sms: &[usize],
    _methods: &[CopyMethod],
    _patterns: &[CopyPattern],
) -> Result<Vec<CopyBandwidth>> {
    Err(Error::Unavailable("GPU diagnostics are not built yet".into()))
}

/// Collective: median round-trip time of the cross-GPU barrier kernel, in microseconds (slowest rank).
pub fn barrier_latency_us(_group: &dyn Group, _device: usize, _iters: usize) -> Result<f64> {
    Err(Error::Unavailable("GPU diagnostics are not built yet".into()))
}

/// Collective: every rank writes a rank-specific pattern into every peer's symmetric buffer; each rank
/// checks what it received. Returns the number of mismatching words seen by this rank (0 = pass).
pub fn symmetric_memory_check(_group: &dyn Group, _device: usize, _bytes_per_peer: usize) -> Result<u64> {
    Err(Error::Unavailable("GPU diagnostics are not built yet".into()))
}

/// What happened to one rank in the deadline test.
#[derive(Clone, Debug)]
pub struct DeadlineOutcome {
    pub rank: usize,
    /// The error the rank got (None for the rank that skipped the barrier).
    pub error: Option<String>,
    /// Peer named by the timeout error.
    pub peer: Option<usize>,
    /// Wall time from launch to the error, ms.
    pub elapsed_ms: f64,
    /// A later operation on the same buffer was refused (poisoned).
    pub refused_afterwards: bool,
}

/// Collective: `skip_rank` does not enter the barrier; every other rank must get a timeout naming a peer
/// within `timeout_ms` (plus slack) and stay alive.
pub fn deadline_check(_group: &dyn Group, _device: usize, _skip_rank: usize, _timeout_ms: u64) -> Result<DeadlineOutcome> {
    Err(Error::Unavailable("GPU diagnostics are not built yet".into()))
}

/// JIT time of one kernel variant.
#[derive(Clone, Debug)]
pub struct JitTiming {
    pub kernel: String,
    /// Compile with an empty cache (seconds).
    pub cold_s: f64,
    /// Load from the disk cache (seconds).
    pub cached_s: f64,
    pub cubin_bytes: usize,
}

/// Compiles every kernel variant the tests and the bench use, cold and from cache, for `device`.
pub fn jit_timings(_device: usize) -> Result<Vec<JitTiming>> {
    Err(Error::Unavailable("GPU diagnostics are not built yet".into()))
}
