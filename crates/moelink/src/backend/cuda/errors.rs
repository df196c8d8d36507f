//! What the kernels' error records mean: the typed error each record stands for, and the phase a timeout
//! names. Both fabrics' kernels report through the same record (`moelink_kernels::abi::ErrorRecord`).

use moelink_cuda::{DevPtr, Device, DeviceBuffer, HostMapped};
use moelink_kernels::abi::{self, ErrorRecord};
use moelink_kernels::ht::CallSignature;

use crate::error::{Error, Phase, Result};

/// Where kernels of one rank report their first failure: a device-memory claim word (first writer wins)
/// and a host-mapped [`ErrorRecord`] the host can read while kernels run.
pub(crate) struct ErrorSink {
    claim: DeviceBuffer,
    record: HostMapped<ErrorRecord>,
}

impl ErrorSink {
    pub(crate) fn new(device: &Device) -> Result<ErrorSink> {
        Ok(ErrorSink { claim: DeviceBuffer::zeroed(device, 4)?, record: HostMapped::new(device, 1)? })
    }
    pub(crate) fn claim_ptr(&self) -> DevPtr {
        self.claim.device_ptr()
    }
    pub(crate) fn record_ptr(&self) -> DevPtr {
        self.record.device_ptr()
    }
    /// The record, once a kernel has completed it. Kernels write the fields, then `code` (release); so
    /// `code` is looked at first and the whole record read again after it was seen set.
    pub(crate) fn check(&self) -> Option<ErrorRecord> {
        if self.record.read(0).code == abi::ERR_NONE {
            return None;
        }
        Some(self.record.read(0))
    }
    /// Clears the claim and the record (no kernel may be running that could still report).
    pub(crate) fn reset(&mut self) -> Result<()> {
        self.claim.memset_u8(0)?;
        self.record.write(0, ErrorRecord::default());
        Ok(())
    }
}

/// What the error messages need to know about the buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BufferShape {
    pub rank: usize,
    pub num_ranks: usize,
    pub num_nvl_bytes: usize,
}

/// The `BufferTooSmall` error of the single-node slabs for `t_max` tokens per rank in rows of `row_bytes`.
pub(crate) fn too_small(b: BufferShape, what: &'static str, t_max: usize, row_bytes: usize) -> Error {
    crate::ht::ht_too_small(b.rank, b.num_ranks, b.num_nvl_bytes, what, t_max, row_bytes)
}

/// The error an argument-error record (anything but a timeout) stands for.
pub(crate) fn argument_error(b: BufferShape, rec: &ErrorRecord) -> Error {
    let rank = rec.rank as usize;
    let peer = rec.peer as usize;
    let (d0, d1) = (rec.elapsed_ns, rec.timeout_ns);
    match rec.code {
        abi::ERR_INVALID_TOPK => Error::invalid(
            "topk_idx",
            rank,
            format!(
                "entry [{}, {}] = {} is outside [-1, num_experts) or repeats an expert of its row",
                d0 >> 32,
                d0 & 0xffff_ffff,
                d1 as i64
            ),
        ),
        abi::ERR_INVALID_LAYOUT => {
            let (expert, tokens) = (d1 >> 32, d1 & 0xffff_ffff);
            if d0 == abi::layout_arg::EXPERT_TOKENS {
                return Error::invalid(
                    "num_tokens_per_expert",
                    rank,
                    format!("entry {expert} is not {tokens}, the number of tokens whose topk_idx selects expert {expert}"),
                );
            }
            if d0 == abi::layout_arg::RECV_EXPERT_TOKENS {
                return Error::invalid(
                    "num_tokens_per_expert",
                    rank,
                    format!(
                        "of some rank disagrees with its topk_idx: {tokens} rows arrived for local expert {expert} of this rank, not \
                         the number the ranks' counts give (num_recv_tokens_per_expert); the rank that passed it names itself"
                    ),
                );
            }
            let (arg, what) = match d0 {
                abi::layout_arg::PER_EXPERT => (
                    "num_tokens_per_expert",
                    "counts tokens for the experts of a rank that no token goes to, fewer tokens than go to that rank, or a \
                     negative number (num_tokens_per_rank, is_token_in_rank)",
                ),
                abi::layout_arg::IN_RANK => (
                    "is_token_in_rank",
                    "sends a token to a rank where topk_idx selects none of its experts, or not to a rank where it selects one",
                ),
                _ => ("num_tokens_per_rank", "does not match the tokens is_token_in_rank sends to each rank"),
            };
            match (peer == rank, d0) {
                (true, abi::layout_arg::IN_RANK) => {
                    Error::invalid(arg, rank, format!("{what} (token {d1}); the rows went as is_token_in_rank says"))
                }
                (true, _) => Error::invalid(arg, rank, what),
                (false, _) => Error::invalid(arg, rank, format!("rank {peer}'s {arg} {what}, so no rank dispatched")),
            }
        }
        abi::ERR_RANK_MISMATCH => Error::RankMismatch {
            what: "dispatch shape (hidden, experts, top-k, dtype, sync mode)",
            rank,
            peer,
            ours: CallSignature::decode(d0).to_string(),
            theirs: CallSignature::decode(d1).to_string(),
        },
        abi::ERR_BUFFER_TOO_SMALL => {
            let what = if rec.phase == abi::phase::COMBINE { "HT combine receive slab" } else { "HT dispatch receive slab" };
            too_small(b, what, d0 as usize, (d1 >> 32) as usize)
        }
        abi::ERR_RECV_OVERFLOW => {
            Error::invalid("num_worst_tokens", rank, format!("this rank receives {d0} tokens, but the outputs have {d1} rows"))
        }
        abi::ERR_PEER_LAYOUT => Error::Group {
            rank,
            reason: format!(
                "rank {peer}'s internode messages have layout {:#x}, this rank's kernel reads {:#x}: the ranks launched \
                 different kernel variants; nothing received is valid",
                d0 >> 32,
                d0 & 0xffff_ffff
            ),
        },
        code => Error::Group {
            rank,
            reason: format!(
                "a kernel recorded unknown error code {code} (phase {}, peer {}, details {d0:#x} {d1:#x})",
                rec.phase, rec.peer
            ),
        },
    }
}

/// The phase a kernel's record names.
pub(crate) fn phase_of(code: u32) -> Phase {
    match code {
        abi::phase::BARRIER => Phase::Barrier,
        abi::phase::LAYOUT => Phase::Layout,
        abi::phase::NOTIFY => Phase::Notify,
        abi::phase::DISPATCH => Phase::Dispatch,
        abi::phase::COMBINE => Phase::Combine,
        abi::phase::LL_DISPATCH => Phase::LowLatencyDispatch,
        abi::phase::LL_COMBINE => Phase::LowLatencyCombine,
        abi::phase::TRANSPORT => Phase::Transport,
        moelink_kernels::ht_internode::phase::NOTIFY => Phase::Notify,
        moelink_kernels::ht_internode::phase::DISPATCH_RDMA => Phase::DispatchRdma,
        moelink_kernels::ht_internode::phase::DISPATCH_NVLINK => Phase::DispatchNvlink,
        moelink_kernels::ht_internode::phase::COMBINE_RDMA => Phase::CombineRdma,
        moelink_kernels::ht_internode::phase::COMBINE_NVLINK => Phase::CombineNvlink,
        _ => Phase::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moelink_kernels::ht::{self as kht, HtRegion};

    #[test]
    fn argument_records_become_the_documented_errors() {
        let b = BufferShape { rank: 1, num_ranks: 4, num_nvl_bytes: 1 << 20 };
        let rec = |code, peer, d0, d1, phase| ErrorRecord { code, rank: 1, peer, phase, elapsed_ns: d0, timeout_ns: d1 };
        let e = argument_error(b, &rec(abi::ERR_INVALID_TOPK, abi::NO_PEER, (7 << 32) | 3, (-5i64) as u64, abi::phase::LAYOUT));
        assert!(matches!(&e, Error::InvalidArgument { arg: "topk_idx", rank: 1, reason } if reason.contains("[7, 3] = -5")), "{e}");
        let e = argument_error(b, &rec(abi::ERR_INVALID_LAYOUT, 1, 0, 0, abi::phase::NOTIFY));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_rank", reason, .. } if reason.contains("does not match")),
            "{e}"
        );
        let e = argument_error(b, &rec(abi::ERR_INVALID_LAYOUT, 3, 0, 0, abi::phase::NOTIFY));
        assert!(matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_rank", reason, .. } if reason.contains("rank 3")), "{e}");
        // Which layout argument: the notify kernel's per-expert check, the dispatch senders' top-k check.
        let e = argument_error(b, &rec(abi::ERR_INVALID_LAYOUT, 3, abi::layout_arg::PER_EXPERT, 0, abi::phase::NOTIFY));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_expert", rank: 1, reason } if reason.contains("rank 3's num_tokens_per_expert")),
            "{e}"
        );
        let e = argument_error(b, &rec(abi::ERR_INVALID_LAYOUT, 1, abi::layout_arg::IN_RANK, 17, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "is_token_in_rank", rank: 1, reason } if reason.contains("token 17") && reason.contains("topk_idx")),
            "{e}"
        );
        assert!(!e.poisons_buffer());
        let e = argument_error(b, &rec(abi::ERR_INVALID_LAYOUT, 1, abi::layout_arg::EXPERT_TOKENS, (33 << 32) | 6, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_expert", rank: 1, reason }
                if reason.contains("entry 33 is not 6") && reason.contains("selects expert 33")),
            "{e}"
        );
        assert!(!e.poisons_buffer());
        let e =
            argument_error(b, &rec(abi::ERR_INVALID_LAYOUT, 1, abi::layout_arg::RECV_EXPERT_TOKENS, (5 << 32) | 9, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_tokens_per_expert", rank: 1, reason }
                if reason.contains("9 rows arrived for local expert 5") && reason.contains("some rank")),
            "{e}"
        );
        let ours = CallSignature { hidden: 7168, num_experts: 256, topk: 8, fp8: true, has_topk: true, no_sync: false };
        let theirs = CallSignature { fp8: false, ..ours };
        let e =
            argument_error(b, &rec(abi::ERR_RANK_MISMATCH, 2, kht::call_signature(ours), kht::call_signature(theirs), abi::phase::NOTIFY));
        assert!(matches!(&e, Error::RankMismatch { peer: 2, ours: o, theirs: t, .. } if o.contains("fp8") && t.contains("bf16")), "{e}");
        let row = kht::dispatch_row_bytes(7168, false, 8);
        let e = argument_error(b, &rec(abi::ERR_BUFFER_TOO_SMALL, abi::NO_PEER, 4096, ((row as u64) << 32) | 17, abi::phase::NOTIFY));
        match &e {
            Error::BufferTooSmall { what, needed, available, hint, .. } => {
                assert_eq!(*what, "HT dispatch receive slab");
                assert_eq!(*available, 1 << 20);
                assert!(HtRegion { num_nvl_bytes: *needed, num_ranks: 4 }.slab_rows(row) >= 4096);
                assert!(hint.contains("ht_bytes_needed"));
            }
            other => panic!("{other}"),
        }
        let e = argument_error(b, &rec(abi::ERR_BUFFER_TOO_SMALL, abi::NO_PEER, 10, (64 << 32) | 1, abi::phase::COMBINE));
        assert!(matches!(e, Error::BufferTooSmall { what: "HT combine receive slab", .. }));
        let e = argument_error(b, &rec(abi::ERR_RECV_OVERFLOW, abi::NO_PEER, 90, 64, abi::phase::DISPATCH));
        assert!(
            matches!(&e, Error::InvalidArgument { arg: "num_worst_tokens", reason, .. } if reason.contains("90") && reason.contains("64"))
        );
        assert!(!e.poisons_buffer());
        let e = argument_error(b, &rec(99, abi::NO_PEER, 0, 0, abi::phase::OTHER));
        assert!(e.poisons_buffer(), "an unknown code must poison the buffer: {e}");
    }
}
