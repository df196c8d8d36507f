//! Low-latency dispatch/combine across nodes (`cuda/lli_dispatch.cu`, `cuda/lli_combine.cu` over
//! `cuda/lli.cuh`): the variant key, the argument
//! structs, and the layout of the RDMA region, the local state and the handle area (every offset the
//! kernels use is computed here, once).

use bytemuck::{NoUninit, Zeroable};
use moelink_cuda::DevPtr;

use crate::ll::{LlVariant, LL_SIG_WORDS, LL_THREADS};
use crate::transport::{RdmaArgs, Transport};
use crate::{Family, KernelSpec};

/// `cuda/lli.cuh`: what the two kernels share (the protocol, the layouts, the frame, the routing).
pub const LLI_HEADER: &str = include_str!("../cuda/lli.cuh");
/// `cuda/lli_dispatch.cu`.
pub const LLI_DISPATCH_SOURCE: &str = include_str!("../cuda/lli_dispatch.cu");
/// `cuda/lli_combine.cu`.
pub const LLI_COMBINE_SOURCE: &str = include_str!("../cuda/lli_combine.cu");
/// Ranks the kernels' shared arrays have room for (`LLI_MAX_RANKS`).
pub const LLI_MAX_RANKS: usize = 1024;
/// Shared words for the per-(source, local expert) bases (`LLI_SMEM_WORDS`): experts in all, at most.
pub const LLI_SMEM_WORDS: usize = 8192;
/// Bytes of a meta head (`LliMeta`).
pub const LLI_META_BYTES: usize = 64;
/// Bytes of `LliState` before its arrays.
pub const LLI_STATE_HEAD: usize = 64;

/// The constants of the low-latency kernels across nodes: the LL shape and the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LliVariant {
    /// Hidden size, top-k, FP8 (the single-node LL key).
    pub ll: LlVariant,
    /// The RDMA transport's backend.
    pub transport: Transport,
}

impl LliVariant {
    /// The compile key of dispatch.
    pub fn dispatch_spec(&self) -> KernelSpec {
        self.spec(Family::LliDispatch)
    }

    /// The compile key of combine.
    pub fn combine_spec(&self) -> KernelSpec {
        self.spec(Family::LliCombine)
    }

    /// The compile key of either kernel file: both take every constant (lli.cuh checks them).
    fn spec(&self, family: Family) -> KernelSpec {
        let mut defines = self.ll.dispatch_spec().defines;
        defines.extend([
            ("MOELINK_TRANSPORT".to_string(), self.transport.code().to_string()),
            ("LLI_MAX_RANKS".to_string(), LLI_MAX_RANKS.to_string()),
            ("LLI_SMEM_WORDS".to_string(), LLI_SMEM_WORDS.to_string()),
            ("MOELINK_SIZEOF_LLI_DISPATCH_ARGS".to_string(), std::mem::size_of::<LliDispatchArgs>().to_string()),
            ("MOELINK_SIZEOF_LLI_COMBINE_ARGS".to_string(), std::mem::size_of::<LliCombineArgs>().to_string()),
        ]);
        let stem = family.file_name().trim_end_matches(".cu");
        KernelSpec {
            family,
            variant: format!(
                "{stem}[h{},k{},{},{}]",
                self.ll.hidden,
                self.ll.topk,
                if self.ll.fp8 { "fp8" } else { "bf16" },
                self.transport.name()
            ),
            defines,
        }
    }

    /// The variants the compile check covers: DeepEP's decode shape and the test shapes, on every backend.
    pub fn all() -> Vec<LliVariant> {
        let mut v = Vec::new();
        for transport in Transport::ALL {
            for (hidden, topk, fp8) in [(7168, 8, true), (7168, 8, false), (512, 4, true), (256, 2, false), (1024, 8, true)] {
                v.push(LliVariant { ll: LlVariant::new(hidden, topk, fp8), transport });
            }
        }
        v
    }
}

/// `ll_internode_dispatch`'s argument (`LliDispatchArgs` in `lli.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct LliDispatchArgs {
    pub rdma: RdmaArgs,
    pub state: DevPtr,
    pub x: DevPtr,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    pub recv_x: DevPtr,
    pub recv_scales: DevPtr,
    pub recv_count: DevPtr,
    pub cum_stats: DevPtr,
    pub wait_stats: DevPtr,
    pub src_info: DevPtr,
    pub layout_range: DevPtr,
    pub htoken: DevPtr,
    pub hj: DevPtr,
    pub hrow: DevPtr,
    pub hweight: DevPtr,
    pub hmeta: DevPtr,
    pub home_idx: DevPtr,
    pub home_weight: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub report: DevPtr,
    pub timeout_ns: u64,
    pub off_meta_sig: u64,
    pub off_data_sig: u64,
    pub off_consumed: u64,
    pub off_meta: u64,
    pub off_msgs: u64,
    pub off_send_meta: u64,
    pub off_send_msgs: u64,
    /// Timing trace (`[slot][block][LL_TRACE_WORDS]` %globaltimer stamps, `ll.cuh`), or 0.
    pub trace: DevPtr,
    pub meta_bytes: u32,
    pub num_tokens: u32,
    pub max_tokens: u32,
    pub num_experts: u32,
    pub num_local_experts: u32,
    pub set: u32,
    pub phases: u32,
    pub flags: u32,
    pub host_problem: u32,
    pub pad: u32,
    pub sig: [u32; LL_SIG_WORDS],
}

/// `ll_internode_combine`'s argument (`LliCombineArgs` in `lli.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct LliCombineArgs {
    pub rdma: RdmaArgs,
    pub state: DevPtr,
    pub y: DevPtr,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    pub out: DevPtr,
    pub wait_stats: DevPtr,
    pub htoken: DevPtr,
    pub hj: DevPtr,
    pub hrow: DevPtr,
    pub hweight: DevPtr,
    pub hmeta: DevPtr,
    pub home_idx: DevPtr,
    pub home_weight: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub report: DevPtr,
    pub timeout_ns: u64,
    pub off_meta_sig: u64,
    pub off_data_sig: u64,
    pub off_consumed: u64,
    pub off_meta: u64,
    pub off_rows: u64,
    pub off_send_meta: u64,
    pub off_send_rows: u64,
    pub off_zero_copy: u64,
    /// Timing trace, as the dispatch's.
    pub trace: DevPtr,
    pub num_tokens: u32,
    pub max_tokens: u32,
    pub num_experts: u32,
    pub num_local_experts: u32,
    pub set: u32,
    pub phases: u32,
    pub flags: u32,
    pub host_problem: u32,
    pub y_is_zero_copy: u32,
    pub pad: [u32; 3],
}

fn align(n: usize, a: usize) -> Option<usize> {
    n.checked_add(a - 1).map(|v| v / a * a)
}

/// Bytes of one message (`LLI_MSG_BYTES`): header, routing (entries and weights, 16-byte aligned), the row.
/// Panics when the size overflows `usize` ([`LliLayout::new`] says `None` instead).
pub fn msg_bytes(hidden: usize, topk: usize, fp8: bool) -> usize {
    checked_msg_bytes(hidden, topk, fp8).expect("the message size overflows usize")
}

fn checked_msg_bytes(hidden: usize, topk: usize, fp8: bool) -> Option<usize> {
    let route = align(topk.checked_mul(8)?, 16)?;
    let row = if fp8 { hidden.checked_add((hidden / 128).checked_mul(4)?)? } else { hidden.checked_mul(2)? };
    align(row, 16)?.checked_add(16 + route)
}

/// The per-set regions of one operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LliSet {
    pub meta_sig: usize,
    pub data_sig: usize,
    pub consumed: usize,
    /// Receive: meta blocks `[R]`.
    pub meta: usize,
    /// Receive: dispatch messages `[R][T_max]` / combine rows `[T_max][K]`.
    pub data: usize,
    /// Staging of this rank's meta blocks `[R]`.
    pub send_meta: usize,
    /// Staging of this rank's messages `[T_max]` (dispatch) / rows `[R][T_max]` (combine).
    pub send_data: usize,
}

/// Where everything of the internode low-latency kernels lives, for `R` ranks, `T_max` tokens, hidden `H`,
/// top-k `K` and `E` experts: RDMA-region offsets (from the region's start, beginning at `base`), the
/// local state's size and the handle area's offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LliLayout {
    pub num_ranks: usize,
    pub max_tokens: usize,
    pub topk: usize,
    pub num_local_experts: usize,
    pub msg_bytes: usize,
    pub meta_bytes: usize,
    /// `[set]`.
    pub dispatch: [LliSet; 2],
    pub combine: [LliSet; 2],
    /// All signal words: `[signals, signals_end)` (zeroed by clean).
    pub signals: usize,
    pub signals_end: usize,
    /// The zero-copy combine buffer `bf16 [E_local][R*T_max][H]`.
    pub zero_copy: usize,
    /// End of the RDMA region used (from offset 0 of the region, `base` included).
    pub end: usize,
    /// Bytes of the local state (`LliState` + arrays).
    pub state_bytes: usize,
    /// Handle area of one set (local device memory).
    pub handle: LliHandle,
}

/// Offsets inside one set's handle area (local device memory), and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LliHandle {
    pub htoken: usize,
    pub hj: usize,
    pub hrow: usize,
    pub hweight: usize,
    pub hmeta: usize,
    pub home_idx: usize,
    pub home_weight: usize,
    pub bytes: usize,
}

impl LliLayout {
    /// The layout, or `None` when a size overflows.
    pub fn new(
        base: usize,
        num_ranks: usize,
        max_tokens: usize,
        hidden: usize,
        topk: usize,
        num_experts: usize,
        fp8: bool,
    ) -> Option<LliLayout> {
        let (r, tm, k) = (num_ranks, max_tokens, topk);
        let el = num_experts / num_ranks.max(1);
        let msg = checked_msg_bytes(hidden, topk, fp8)?;
        let meta = align(el.checked_mul(4)?, 16)?.checked_add(LLI_META_BYTES)?;
        let row = hidden.checked_mul(2)?;
        let mut at = align(base, 256)?;
        let mut take = |bytes: usize| -> Option<usize> {
            let o = at;
            at = align(at.checked_add(bytes)?, 256)?;
            Some(o)
        };
        // Signals: six arrays (meta, data, consumed; dispatch then combine) of [2 sets][R] u64.
        let signals = take(r.checked_mul(6 * 2 * 8)?)?;
        let sig = |array: usize, set: usize| signals + ((array * 2 + set) * r) * 8;
        let mut dispatch = [LliSet { meta_sig: 0, data_sig: 0, consumed: 0, meta: 0, data: 0, send_meta: 0, send_data: 0 }; 2];
        let mut combine = dispatch;
        for s in 0..2 {
            dispatch[s] = LliSet {
                meta_sig: sig(0, s),
                data_sig: sig(1, s),
                consumed: sig(2, s),
                meta: take(r.checked_mul(meta)?)?,
                data: take(r.checked_mul(tm)?.checked_mul(msg)?)?,
                send_meta: take(r.checked_mul(meta)?)?,
                send_data: take(tm.checked_mul(msg)?)?,
            };
            combine[s] = LliSet {
                meta_sig: sig(3, s),
                data_sig: sig(4, s),
                consumed: sig(5, s),
                meta: take(r.checked_mul(LLI_META_BYTES)?)?,
                data: take(tm.checked_mul(k)?.checked_mul(row)?)?,
                send_meta: take(r.checked_mul(LLI_META_BYTES)?)?,
                send_data: take(r.checked_mul(tm)?.checked_mul(row)?)?,
            };
        }
        let zero_copy = take(el.checked_mul(r)?.checked_mul(tm)?.checked_mul(row)?)?;
        let end = at;
        // Handle area of one set.
        let mut h = 0usize;
        let mut hand = |bytes: usize| -> Option<usize> {
            let o = h;
            h = align(h.checked_add(bytes)?, 256)?;
            Some(o)
        };
        let rt = r.checked_mul(tm)?;
        let handle = LliHandle {
            htoken: hand(rt.checked_mul(4)?)?,
            hj: hand(rt.checked_mul(4)?)?,
            hrow: hand(rt.checked_mul(k)?.checked_mul(4)?)?,
            hweight: hand(rt.checked_mul(k)?.checked_mul(4)?)?,
            hmeta: hand(r.checked_mul(8)?)?,
            home_idx: hand(tm.checked_mul(k)?.checked_mul(8)?)?,
            home_weight: hand(tm.checked_mul(k)?.checked_mul(4)?)?,
            bytes: 0,
        };
        let handle = LliHandle { bytes: h, ..handle };
        Some(LliLayout {
            num_ranks: r,
            max_tokens: tm,
            topk: k,
            num_local_experts: el,
            msg_bytes: msg,
            meta_bytes: meta,
            dispatch,
            combine,
            signals,
            signals_end: signals + 6 * 2 * r * 8,
            zero_copy,
            end,
            state_bytes: LLI_STATE_HEAD + 44 * r,
            handle,
        })
    }
}

/// Checks the kernels' limits for a shape: `Err((argument, reason))`.
pub fn check_limits(num_ranks: usize, max_tokens: usize, topk: usize, num_experts: usize) -> Result<(), (&'static str, String)> {
    if num_ranks > LLI_MAX_RANKS {
        return Err(("group", format!("{num_ranks} ranks; the internode low-latency kernels support at most {LLI_MAX_RANKS}")));
    }
    if num_experts > LLI_SMEM_WORDS {
        return Err(("num_experts", format!("{num_experts} experts; the internode low-latency kernels support at most {LLI_SMEM_WORDS}")));
    }
    if topk > 32 {
        return Err(("topk_idx", format!("top-k {topk} exceeds the 32 the CUDA low-latency kernels support")));
    }
    if max_tokens > 0xffff {
        return Err(("num_max_dispatch_tokens_per_rank", format!("{max_tokens} exceeds the 65535 the CUDA low-latency kernels support")));
    }
    Ok(())
}

/// Threads per block of the internode low-latency kernels (the single-node ones').
pub const LLI_THREADS: u32 = LL_THREADS;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_sizes_and_source_constants() {
        assert_eq!(std::mem::size_of::<LliDispatchArgs>() % 8, 0);
        assert_eq!(std::mem::size_of::<LliCombineArgs>() % 8, 0);
        assert!(LLI_HEADER.contains("static_assert(sizeof(LliMeta) == 64"));
        assert!(LLI_HEADER.contains("static_assert(sizeof(LliState) == 64"));
        assert!(LLI_HEADER.contains("constexpr u32 LLI_HDR_BYTES = 16;"));
        assert!(LLI_HEADER.contains("constexpr u32 LLI_ROUTE_BYTES = ((8 * LL_TOPK + 15) / 16) * 16;"));
        // The state's arrays at the offsets the kernel computes: expected at 64, decision at 64 + 32R, mask at
        // 64 + 40R.
        assert!(LLI_HEADER.contains("state + sizeof(LliState) + 32ull * num_ranks"));
        assert!(LLI_HEADER.contains("state + sizeof(LliState) + 40ull * num_ranks"));
    }

    #[test]
    fn message_sizes() {
        assert_eq!(msg_bytes(7168, 8, true), 16 + 64 + 7392);
        assert_eq!(msg_bytes(7168, 8, false), 16 + 64 + 14336);
        assert_eq!(msg_bytes(128, 3, true), 16 + 32 + 144);
        // A size past usize is no layout, not an overflow panic (Buffer::ll_bytes_needed asks with any hidden).
        for fp8 in [false, true] {
            assert!(LliLayout::new(0, 1, 4, usize::MAX, 8, 8, fp8).is_none());
            assert!(LliLayout::new(0, usize::MAX, 4, 128, 8, 8, fp8).is_none());
        }
    }

    #[test]
    fn layout_parts_do_not_overlap() {
        let l = LliLayout::new(65536, 16, 128, 7168, 8, 256, true).unwrap();
        let mut parts = vec![(l.signals, l.signals_end)];
        for s in 0..2 {
            let d = l.dispatch[s];
            let c = l.combine[s];
            parts.push((d.meta, d.meta + 16 * l.meta_bytes));
            parts.push((d.data, d.data + 16 * 128 * l.msg_bytes));
            parts.push((d.send_meta, d.send_meta + 16 * l.meta_bytes));
            parts.push((d.send_data, d.send_data + 128 * l.msg_bytes));
            parts.push((c.meta, c.meta + 16 * 64));
            parts.push((c.data, c.data + 128 * 8 * 14336));
            parts.push((c.send_meta, c.send_meta + 16 * 64));
            parts.push((c.send_data, c.send_data + 16 * 128 * 14336));
        }
        parts.push((l.zero_copy, l.zero_copy + 16 * 16 * 128 * 14336));
        parts.sort();
        assert!(parts[0].0 >= 65536);
        for w in parts.windows(2) {
            assert!(w[0].1 <= w[1].0, "{:?} overlaps {:?}", w[0], w[1]);
        }
        assert!(parts.last().unwrap().1 <= l.end);
        assert_eq!(l.state_bytes, 64 + 44 * 16);
        assert!(LliLayout::new(0, usize::MAX / 4, 128, 7168, 8, 256, true).is_none());
        assert!(check_limits(2048, 128, 8, 256).is_err() && check_limits(16, 128, 8, 256).is_ok());
    }
}
