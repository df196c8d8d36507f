//! The kernel ↔ host ABI: argument structs passed by value, the error record in host-mapped memory, and the
//! constants both sides use. Each struct mirrors one in `cuda/*.cu`; every kernel family `static_assert`s
//! its struct's size against the `MOELINK_SIZEOF_*` constant the variant passes, and a test checks the
//! constants against `cuda/ptx.cuh`.

use bytemuck::{NoUninit, Pod, Zeroable};
use moelink_cuda::{DevPtr, DevPtrs, KernelArgs, KernelParams};

/// Ranks the argument structs have room for (one node).
pub const MAX_RANKS: usize = 8;

/// `ErrorRecord::code`: no error.
pub const ERR_NONE: u32 = 0;
/// `ErrorRecord::code`: a spin-wait passed its deadline.
pub const ERR_TIMEOUT: u32 = 1;
/// `ErrorRecord::code`: a `topk_idx` entry is outside `[-1, E)` or repeats an expert of its row (it was
/// treated as -1). Details: `elapsed_ns` = `t << 32 | k`, `timeout_ns` = the value (as `u64`).
pub const ERR_INVALID_TOPK: u32 = 2;
/// `ErrorRecord::code`: rank `peer`'s layout tensors disagree. Details: `elapsed_ns` = which argument
/// ([`layout_arg`]), `timeout_ns` = the token (for [`layout_arg::IN_RANK`]), or `expert << 32 | tokens` (for
/// [`layout_arg::EXPERT_TOKENS`] and [`layout_arg::RECV_EXPERT_TOKENS`]).
pub const ERR_INVALID_LAYOUT: u32 = 3;
/// [`ERR_INVALID_LAYOUT`]'s first detail: the argument that disagrees (`LAYOUT_ARG_*` in `ptx.cuh`).
pub mod layout_arg {
    /// `num_tokens_per_rank` is not the tokens `is_token_in_rank` sends to each rank (the notify kernel).
    pub const PER_RANK: u64 = 0;
    /// `num_tokens_per_expert` counts tokens for a rank's experts where none go to that rank, fewer than go
    /// there, or a negative number (the notify kernel).
    pub const PER_EXPERT: u64 = 1;
    /// `is_token_in_rank` sends a token to a rank where `topk_idx` selects none of its experts, or not to one
    /// where it selects one (the dispatch kernel's senders).
    pub const IN_RANK: u64 = 2;
    /// `num_tokens_per_expert[e]` is not the tokens whose `topk_idx` selects expert `e` (the dispatch kernel's
    /// senders count them; the last block compares).
    pub const EXPERT_TOKENS: u64 = 3;
    /// The rows that arrived for local expert `e` (by their top-k ids) are not what the sources' counts said
    /// (the number `num_recv_tokens_per_expert` reports): some rank's `num_tokens_per_expert` disagrees with
    /// its `topk_idx` (the dispatch kernel's receivers count them; the last block compares).
    pub const RECV_EXPERT_TOKENS: u64 = 4;
}
/// `ErrorRecord::code`: rank `peer` called with another signature. Details: this rank's and the peer's
/// `moelink_kernels::ht::call_signature`.
pub const ERR_RANK_MISMATCH: u32 = 4;
/// `ErrorRecord::code`: a receive slab cannot hold the call. Details: `elapsed_ns` = rows per source needed
/// (`T_max`), `timeout_ns` = `row_bytes << 32 | rows per source available`.
pub const ERR_BUFFER_TOO_SMALL: u32 = 5;
/// `ErrorRecord::code`: a no-sync dispatch received more rows than the outputs have. Details: rows received,
/// rows of the outputs.
pub const ERR_RECV_OVERFLOW: u32 = 6;
/// `ErrorRecord::code`, fatal like [`ERR_TIMEOUT`]: rank `peer`'s message has another layout than this rank's
/// kernel reads (the ranks launched different kernel variants). Details: `elapsed_ns` = the message's
/// layout tag << 32 | this kernel's.
pub const ERR_PEER_LAYOUT: u32 = 7;

/// Whether a recorded error code is fatal (recorded with `raise_error`: waits gave up, the buffer is
/// poisoned) rather than an argument error the host clears after reporting it.
pub fn is_fatal(code: u32) -> bool {
    code == ERR_TIMEOUT || code == ERR_PEER_LAYOUT
}

/// Claim word values (`CLAIM_*` in `ptx.cuh`): nothing recorded, a fatal error, an argument error.
pub mod claim {
    /// Nothing recorded.
    pub const NONE: u32 = 0;
    /// A fatal error (timeout): waits give up, the buffer is poisoned.
    pub const FATAL: u32 = 1;
    /// An argument error: the protocol went on; the host clears the record once it has reported it.
    pub const ARGUMENT: u32 = 2;
}

/// `ErrorRecord::peer` when no single peer is to blame.
pub const NO_PEER: u32 = u32::MAX;

/// Phase codes written by kernels into [`ErrorRecord::phase`].
pub mod phase {
    /// The cross-GPU barrier.
    pub const BARRIER: u32 = 1;
    /// The copy primitive.
    pub const COPY: u32 = 2;
    /// Dispatch layout.
    pub const LAYOUT: u32 = 3;
    /// Count exchange before a high-throughput dispatch.
    pub const NOTIFY: u32 = 4;
    /// High-throughput dispatch.
    pub const DISPATCH: u32 = 5;
    /// High-throughput combine.
    pub const COMBINE: u32 = 6;
    /// Low-latency dispatch.
    pub const LL_DISPATCH: u32 = 7;
    /// Low-latency combine.
    pub const LL_COMBINE: u32 = 8;
    /// The RDMA transport seam's own kernels (conformance check, micro-benchmark).
    pub const TRANSPORT: u32 = 9;
    /// Anything else.
    pub const OTHER: u32 = 15;
}

/// A rank's first kernel failure, in host-mapped memory (`ErrorRecord` in `ptx.cuh`). The kernel writes the
/// fields, then `code` with release semantics: read `code` first; when non-zero, the rest is complete.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct ErrorRecord {
    /// [`ERR_TIMEOUT`], ...; [`ERR_NONE`] while nothing failed.
    pub code: u32,
    /// Rank that gave up.
    pub rank: u32,
    /// Rank it waited for, or [`NO_PEER`].
    pub peer: u32,
    /// One of [`phase`].
    pub phase: u32,
    /// How long it waited, ns.
    pub elapsed_ns: u64,
    /// Its deadline, ns.
    pub timeout_ns: u64,
}

/// Layout of a rank's barrier region inside symmetric memory (see `barrier.cu`).
pub mod barrier_region {
    use super::MAX_RANKS;
    /// `u32 arrive[MAX_RANKS]` at 0; the epoch counter at this offset.
    pub const EPOCH_OFFSET: usize = 4 * MAX_RANKS;
    /// Bytes to reserve per rank for one barrier (rounded up to a 128-byte line).
    pub const BYTES: usize = 128;
    const _: () = assert!(EPOCH_OFFSET + 4 <= BYTES);
}

/// Argument of `gpu_barrier` / `gpu_barrier_latency` (`BarrierArgs` in `barrier.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct BarrierArgs {
    /// Every rank's barrier region as addressable from this rank (own included); unused entries 0.
    pub regions: DevPtrs<MAX_RANKS>,
    /// Device address of the rank's error claim word (`u32`, device memory).
    pub error_claim: DevPtr,
    /// Device address of the rank's [`ErrorRecord`] (host-mapped).
    pub error_record: DevPtr,
    /// Deadline of each wait, ns.
    pub timeout_ns: u64,
    /// This rank.
    pub rank: u32,
    /// Ranks taking part (≤ [`MAX_RANKS`]).
    pub num_ranks: u32,
}

/// Argument of `copy_sm` / `copy_tma` (`CopyArgs` in `copy.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct CopyArgs {
    /// Source slice for destination `i` (this GPU), 16-byte aligned.
    pub src: DevPtrs<MAX_RANKS>,
    /// Destination slice `i` (usually peer memory), 16-byte aligned.
    pub dst: DevPtrs<MAX_RANKS>,
    /// Rank owning `dst[i]` (named in error records).
    pub dst_rank: [u32; MAX_RANKS],
    /// Bytes copied to each destination, a multiple of 16.
    pub bytes_per_peer: u64,
    /// Device address of the error claim word.
    pub error_claim: DevPtr,
    /// Device address of the [`ErrorRecord`].
    pub error_record: DevPtr,
    /// Deadline of each wait, ns.
    pub timeout_ns: u64,
    /// Destinations used (≤ [`MAX_RANKS`]).
    pub num_peers: u32,
    /// This rank.
    pub rank: u32,
}

/// Parameters of `gpu_barrier_latency` (`barrier.cu`): a barrier's arguments, the barriers to run, and
/// where the kernel stores the elapsed nanoseconds.
#[derive(Clone, Copy, Debug)]
pub struct BarrierLatencyParams {
    /// The barrier's arguments.
    pub barrier: BarrierArgs,
    /// Barriers to run back to back.
    pub iters: u32,
    /// Device `u64`: the nanoseconds they took.
    pub out_ns: DevPtr,
}

// SAFETY: the parameters of `gpu_barrier_latency(BarrierArgs, u32 iters, u64* out_ns)`, in order, the
// addresses `DevPtr`s (and `BarrierArgs`, itself `KernelParams`).
unsafe impl KernelParams for BarrierLatencyParams {
    fn param_sizes() -> Vec<usize> {
        vec![std::mem::size_of::<BarrierArgs>(), 4, 8]
    }
    fn args(&self) -> KernelArgs {
        KernelArgs::new().arg(self.barrier).arg(self.iters).arg(self.out_ns)
    }
}

/// Parameters of `fill_pattern` (`copy.cu`): writes the pattern of `seed` into `num_vecs` 16-byte vectors at
/// `dst`, the first 32-bit word numbered `first_word`.
#[derive(Clone, Copy, Debug)]
pub struct FillPatternParams {
    /// Device memory of `16 * num_vecs` bytes.
    pub dst: DevPtr,
    /// 16-byte vectors to write.
    pub num_vecs: u64,
    /// The pattern's seed.
    pub seed: u32,
    /// Index of the first word in the pattern.
    pub first_word: u64,
}

// SAFETY: the parameters of `fill_pattern(u64 dst, u64 num_vecs, u32 seed, u64 first_word)`, in order, the
// address a `DevPtr`.
unsafe impl KernelParams for FillPatternParams {
    fn param_sizes() -> Vec<usize> {
        vec![8, 8, 4, 8]
    }
    fn args(&self) -> KernelArgs {
        KernelArgs::new().arg(self.dst).arg(self.num_vecs).arg(self.seed).arg(self.first_word)
    }
}

/// Parameters of `verify_pattern` (`copy.cu`): counts the vectors at `src` that differ from the pattern of
/// `seed`, into `result` (`u64[2]`: mismatches, first bad index).
#[derive(Clone, Copy, Debug)]
pub struct VerifyPatternParams {
    /// Device memory of `16 * num_vecs` bytes.
    pub src: DevPtr,
    /// 16-byte vectors to check.
    pub num_vecs: u64,
    /// The pattern's seed.
    pub seed: u32,
    /// Index of the first word in the pattern.
    pub first_word: u64,
    /// Device `u64[2]`: mismatches, first bad index.
    pub result: DevPtr,
}

// SAFETY: the parameters of `verify_pattern(u64 src, u64 num_vecs, u32 seed, u64 first_word, u64 result)`,
// in order, the addresses `DevPtr`s.
unsafe impl KernelParams for VerifyPatternParams {
    fn param_sizes() -> Vec<usize> {
        vec![8, 8, 4, 8, 8]
    }
    fn args(&self) -> KernelArgs {
        KernelArgs::new().arg(self.src).arg(self.num_vecs).arg(self.seed).arg(self.first_word).arg(self.result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes() {
        assert_eq!(std::mem::size_of::<ErrorRecord>(), 32);
        assert_eq!(std::mem::size_of::<BarrierArgs>(), 8 * MAX_RANKS + 32);
        assert_eq!(std::mem::size_of::<CopyArgs>(), 16 * MAX_RANKS + 4 * MAX_RANKS + 40);
    }

    /// Every `constexpr u32 NAME = value;` of ptx.cuh that Rust mirrors has the same value here.
    #[test]
    fn constants_agree_with_ptx_header() {
        let header = crate::PTX_HEADER;
        let value_of = |name: &str| -> u64 {
            let needle = format!("constexpr u32 {name} = ");
            let start = header.find(&needle).unwrap_or_else(|| panic!("{name} is not defined in ptx.cuh")) + needle.len();
            let text: String = header[start..].chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
            let text = text.trim_end_matches('u');
            if let Some(hex) = text.strip_prefix("0x") {
                u64::from_str_radix(hex, 16).unwrap()
            } else {
                text.parse().unwrap()
            }
        };
        let pairs: &[(&str, u64)] = &[
            ("ERR_NONE", ERR_NONE as u64),
            ("ERR_TIMEOUT", ERR_TIMEOUT as u64),
            ("ERR_INVALID_TOPK", ERR_INVALID_TOPK as u64),
            ("ERR_INVALID_LAYOUT", ERR_INVALID_LAYOUT as u64),
            ("ERR_RANK_MISMATCH", ERR_RANK_MISMATCH as u64),
            ("ERR_BUFFER_TOO_SMALL", ERR_BUFFER_TOO_SMALL as u64),
            ("ERR_RECV_OVERFLOW", ERR_RECV_OVERFLOW as u64),
            ("ERR_PEER_LAYOUT", ERR_PEER_LAYOUT as u64),
            ("LAYOUT_ARG_PER_RANK", layout_arg::PER_RANK),
            ("LAYOUT_ARG_PER_EXPERT", layout_arg::PER_EXPERT),
            ("LAYOUT_ARG_IN_RANK", layout_arg::IN_RANK),
            ("LAYOUT_ARG_EXPERT_TOKENS", layout_arg::EXPERT_TOKENS),
            ("LAYOUT_ARG_RECV_EXPERT_TOKENS", layout_arg::RECV_EXPERT_TOKENS),
            ("CLAIM_NONE", claim::NONE as u64),
            ("CLAIM_FATAL", claim::FATAL as u64),
            ("CLAIM_ARGUMENT", claim::ARGUMENT as u64),
            ("NO_PEER", NO_PEER as u64),
            ("PHASE_BARRIER", phase::BARRIER as u64),
            ("PHASE_COPY", phase::COPY as u64),
            ("PHASE_LAYOUT", phase::LAYOUT as u64),
            ("PHASE_NOTIFY", phase::NOTIFY as u64),
            ("PHASE_DISPATCH", phase::DISPATCH as u64),
            ("PHASE_COMBINE", phase::COMBINE as u64),
            ("PHASE_LL_DISPATCH", phase::LL_DISPATCH as u64),
            ("PHASE_LL_COMBINE", phase::LL_COMBINE as u64),
            ("PHASE_TRANSPORT", phase::TRANSPORT as u64),
            ("PHASE_OTHER", phase::OTHER as u64),
        ];
        for &(name, rust) in pairs {
            assert_eq!(value_of(name), rust, "{name}");
        }
        assert!(crate::BARRIER_SOURCE.contains("constexpr u32 BARRIER_EPOCH_OFFSET = 4 * MAX_RANKS;"));
        assert_eq!(barrier_region::EPOCH_OFFSET, 4 * MAX_RANKS);
    }
}
