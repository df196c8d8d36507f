//! Typed errors. Every error names what went wrong in terms the caller can act on: the argument, the rank
//! that saw it and, for collective failures, the peer.

use std::fmt;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which collective step was running when something failed; carried by [`Error::Timeout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Barrier,
    Layout,
    Notify,
    Dispatch,
    Combine,
    LowLatencyDispatch,
    LowLatencyCombine,
    /// The RDMA transport seam's own kernels (conformance check, micro-benchmark).
    Transport,
    /// High-throughput dispatch across nodes, waiting for a peer in the RDMA domain (another node).
    DispatchRdma,
    /// High-throughput dispatch across nodes, waiting for a peer of this node (NVLink domain).
    DispatchNvlink,
    /// High-throughput combine across nodes, waiting for a peer in the RDMA domain (another node).
    CombineRdma,
    /// High-throughput combine across nodes, waiting for a peer of this node (NVLink domain).
    CombineNvlink,
    Group,
    Other,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Phase::Barrier => "barrier",
            Phase::Layout => "dispatch layout",
            Phase::Notify => "notify (count exchange)",
            Phase::Dispatch => "dispatch",
            Phase::Combine => "combine",
            Phase::LowLatencyDispatch => "low-latency dispatch",
            Phase::LowLatencyCombine => "low-latency combine",
            Phase::Transport => "RDMA transport",
            Phase::DispatchRdma => "dispatch (RDMA domain)",
            Phase::DispatchNvlink => "dispatch (NVLink domain)",
            Phase::CombineRdma => "combine (RDMA domain)",
            Phase::CombineNvlink => "combine (NVLink domain)",
            Phase::Group => "group collective",
            Phase::Other => "collective",
        };
        f.write_str(s)
    }
}

/// Everything that can go wrong in moelink.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller-supplied argument is malformed. Raised before any work starts.
    #[error("invalid argument `{arg}` on rank {rank}: {reason}")]
    InvalidArgument { arg: &'static str, rank: usize, reason: String },

    /// Ranks disagree on a value that must be identical on every rank (hidden size, number of experts, ...).
    #[error("rank {rank} and rank {peer} disagree on `{what}`: {ours} here, {theirs} there")]
    RankMismatch { what: &'static str, rank: usize, peer: usize, ours: String, theirs: String },

    /// A peer did not arrive within the deadline. The buffer is poisoned afterwards.
    #[error("timeout on rank {rank}: waited {waited_ms} ms for rank {peer} during {phase}")]
    Timeout { rank: usize, peer: usize, phase: Phase, waited_ms: u64 },

    /// The buffer saw an earlier failure inside a collective and must be re-created.
    #[error("buffer on rank {rank} is unusable after an earlier error ({cause}); create a new Buffer")]
    Poisoned { rank: usize, cause: String },

    /// The buffer was created too small for this call.
    #[error("buffer on rank {rank} is too small for this call: {what} needs {needed} bytes, {available} available; {hint}")]
    BufferTooSmall { rank: usize, what: &'static str, needed: usize, available: usize, hint: String },

    /// The requested backend or feature is not available on this machine (no GPU, no driver, no NVRTC, ...).
    #[error("{0}")]
    Unavailable(String),

    /// An error from the process group (connection lost, peer closed, protocol violation).
    #[error("group error on rank {rank}: {reason}")]
    Group { rank: usize, reason: String },

    /// An error from the CUDA layer (a failing driver or NVRTC call). A missing driver, device or NVRTC
    /// arrives as [`Error::Unavailable`] instead.
    #[error(transparent)]
    Cuda(moelink_cuda::Error),

    /// An I/O error (files, sockets).
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

impl From<moelink_cuda::Error> for Error {
    /// "Nothing to run on" (no driver, no GPU, no NVRTC) is `Unavailable`, so callers can tell a machine
    /// without CUDA from a CUDA failure with one match.
    fn from(e: moelink_cuda::Error) -> Self {
        if e.is_unavailable() {
            Error::Unavailable(e.to_string())
        } else {
            Error::Cuda(e)
        }
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(arg: &'static str, rank: usize, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { arg, rank, reason: reason.into() }
    }

    /// Name of the offending argument, when the error is about one.
    pub fn argument(&self) -> Option<&'static str> {
        match self {
            Error::InvalidArgument { arg, .. } => Some(arg),
            Error::RankMismatch { what, .. } => Some(what),
            _ => None,
        }
    }

    /// True when the error means a collective broke and the buffer can no longer be trusted: a timeout, a
    /// group or CUDA failure, or ranks that called different operations (their calls went separate ways).
    pub fn poisons_buffer(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::Group { .. } | Error::Cuda(_) | Error::RankMismatch { what: "operation", .. })
    }
}

/// `ensure!(cond, arg, rank, "fmt", ...)` returns an [`Error::InvalidArgument`] when `cond` is false.
#[macro_export]
macro_rules! ensure_arg {
    ($cond:expr, $arg:expr, $rank:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Error::invalid($arg, $rank, format!($($fmt)+)));
        }
    };
}
