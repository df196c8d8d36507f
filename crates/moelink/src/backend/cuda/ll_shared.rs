//! The host side both fabrics' low-latency calls share: hooks and their drains, the handle's routing, the
//! call signature and flags, and what the kernels report turned into typed errors.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use moelink_cuda::{DevPtr, Device, HostMapped};
use moelink_kernels::ll::{flag, problem, LlReport, LL_SIG_WORDS, LL_TRACE_CALLS, LL_TRACE_WORDS, SIG_FIELDS};

use crate::error::{Error, Result};
use crate::ll::{LlQuant, LlSpec};
use crate::tensor::TensorMut;

pub(crate) const HOOK_PENDING: u8 = 0;
pub(crate) const HOOK_RAN: u8 = 1;
const HOOK_DROPPED: u8 = 2;

/// State of one receive phase handed out as a hook: pending, ran, or dropped without running.
pub(crate) type HookMarker = Arc<AtomicU8>;

/// The receive phases handed out as hooks; one dropped unrun is drained by the next call (publishes its
/// consumed flags) so that the peers can reuse that buffer set. `D` is the fabric's receive launch.
pub(crate) struct Hooks<D> {
    outstanding: Vec<(HookMarker, D)>,
}

impl<D> Hooks<D> {
    pub(crate) fn new() -> Hooks<D> {
        Hooks { outstanding: Vec::new() }
    }

    /// Remembers a hook handed out, with the launch that drains it if it is dropped unrun.
    pub(crate) fn hand_out(&mut self, marker: HookMarker, drain: D) {
        self.outstanding.push((marker, drain));
    }

    /// The drains of the hooks dropped unrun since the last call; those that ran are forgotten, those still
    /// pending kept.
    pub(crate) fn take_dropped(&mut self) -> Vec<D> {
        let mut dropped = Vec::new();
        for (marker, drain) in std::mem::take(&mut self.outstanding) {
            match marker.load(Ordering::Acquire) {
                HOOK_PENDING => self.outstanding.push((marker, drain)),
                HOOK_DROPPED => dropped.push(drain),
                _ => {}
            }
        }
        dropped
    }

    /// Forgets every hook.
    pub(crate) fn clear(&mut self) {
        self.outstanding.clear();
    }
}

/// The low-latency calls of a buffer, whichever fabric runs them: the report the kernels write, the call
/// counts that pick buffer sets, the hooks handed out (`D`: the receive launch that drains a dropped one)
/// and the zero-copy buffer's shape.
pub(crate) struct LlCalls<D> {
    pub enable_shrink: bool,
    /// What the kernels report (argument problems, signature mismatches), host-mapped.
    pub report: HostMapped<LlReport>,
    /// Calls issued so far; the buffer set of the next call is `calls & 1`.
    pub dispatch_calls: u64,
    pub combine_calls: u64,
    hooks: Hooks<D>,
    /// Shape `[E_local, R*T_max, H]` of the zero-copy buffer handed out last.
    pub staging: Option<[usize; 3]>,
}

impl<D> LlCalls<D> {
    pub(crate) fn new(device: &Device, enable_shrink: bool) -> Result<LlCalls<D>> {
        Ok(LlCalls {
            enable_shrink,
            report: HostMapped::new(device, 1)?,
            dispatch_calls: 0,
            combine_calls: 0,
            hooks: Hooks::new(),
            staging: None,
        })
    }

    /// Remembers a hook handed out ([`Hooks::hand_out`]).
    pub(crate) fn hand_out(&mut self, marker: HookMarker, drain: D) {
        self.hooks.hand_out(marker, drain);
    }

    /// The drains of the hooks dropped unrun since the last call ([`Hooks::take_dropped`]).
    pub(crate) fn take_dropped(&mut self) -> Vec<D> {
        self.hooks.take_dropped()
    }

    /// Forgets every hook and report (`clean_low_latency_buffer` reset the flags they refer to).
    pub(crate) fn forget(&mut self) {
        self.hooks.clear();
        self.report.write(0, LlReport::default());
    }

    /// Reads and clears what the kernels reported; `local` as in [`report_error`].
    pub(crate) fn take_report(&mut self, rank: usize, local: Option<(&'static str, String)>) -> Result<()> {
        let rep = self.report.read(0);
        if rep == LlReport::default() {
            return Ok(());
        }
        self.report.write(0, LlReport::default());
        match report_error(&rep, rank, local) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Problems of a combine's handle that only this rank can see (they travel with the call, so that every
    /// rank fails it): `(problem bits, (argument, reason))`.
    pub(crate) fn handle_problems(&self, routing: &CudaLlRouting) -> (u32, Option<(&'static str, String)>) {
        if self.dispatch_calls > routing.generation + 2 {
            let why = "expired: its buffer set was reused by a later dispatch (at most two low-latency dispatches are usable at once)";
            (problem::HANDLE, Some(("handle", why.to_string())))
        } else if routing.recv.load(Ordering::Acquire) != HOOK_RAN {
            (problem::HANDLE, Some(("handle", "the dispatch's receive hook has not run; run it before combining".to_string())))
        } else {
            (0, None)
        }
    }

    /// The kernels' flags for a call of `s`.
    pub(crate) fn flags(&self, s: &LlSpec) -> u32 {
        let mut f = 0;
        if let LlQuant::Fp8 { round_scale, use_ue8m0 } = s.quant {
            if round_scale {
                f |= flag::ROUND_SCALE;
            }
            if use_ue8m0 {
                f |= flag::UE8M0;
            }
        }
        if s.has_weights {
            f |= flag::WEIGHTS;
        }
        if self.enable_shrink {
            f |= flag::SHRINK;
        }
        f
    }
}

/// Handle data of a CUDA low-latency dispatch.
pub(crate) struct CudaLlRouting {
    /// Buffer set (and handle area) the dispatch used.
    pub(crate) set: usize,
    /// Index of the dispatch among this buffer's dispatches (the handle area is reused two calls later).
    pub(crate) generation: u64,
    /// The dispatch's receive phase (ran at once without a hook).
    pub(crate) recv: HookMarker,
}

/// A receive phase not run yet: its launch argument `A`, the outputs `O` it writes (borrowed until it has
/// run) and its kernel key `V`.
pub(crate) struct Pending<A, O, V> {
    pub(crate) args: A,
    pub(crate) variant: V,
    pub(crate) marker: HookMarker,
    _out: O,
}

impl<A, O, V> Pending<A, O, V> {
    pub(crate) fn new(args: A, variant: V, marker: HookMarker, out: O) -> Self {
        Pending { args, variant, marker, _out: out }
    }
}

impl<A, O, V> Drop for Pending<A, O, V> {
    fn drop(&mut self) {
        let _ = self.marker.compare_exchange(HOOK_PENDING, HOOK_DROPPED, Ordering::AcqRel, Ordering::Acquire);
    }
}

fn quant_code(q: LlQuant) -> u32 {
    match q {
        LlQuant::Bf16 => 0,
        LlQuant::Fp8 { round_scale, use_ue8m0 } => 1 | (u32::from(round_scale) << 1) | (u32::from(use_ue8m0) << 2),
    }
}

/// The call signature every rank must share, in [`SIG_FIELDS`] order.
pub(crate) fn signature(s: &LlSpec) -> [u32; LL_SIG_WORDS] {
    let mut sig = [0u32; LL_SIG_WORDS];
    let words =
        [s.hidden as u32, s.topk as u32, s.num_experts as u32, s.num_max_tokens as u32, quant_code(s.quant), u32::from(s.has_weights)];
    sig[..words.len()].copy_from_slice(&words);
    sig
}

pub(crate) fn opt_addr(t: Option<&TensorMut<'_>>) -> DevPtr {
    t.map_or(DevPtr::NULL, |t| t.device_ptr())
}

/// The argument a problem bit names, and why (for the rank whose argument it is).
pub(crate) fn problem_reason(bits: u32) -> (&'static str, &'static str) {
    if bits & problem::TOPK_IDX != 0 {
        ("topk_idx", "contains an expert id outside [-1, num_experts) or selects an expert twice in a row (checked on the GPU)")
    } else if bits & problem::TOPK_IDX_DIFFERS != 0 {
        ("topk_idx", "differs from the topk_idx given to low_latency_dispatch")
    } else if bits & problem::WEIGHTS_DIFFER != 0 {
        (
            "topk_weights",
            "differs from the topk_weights given to low_latency_dispatch; the expert side pre-reduces with the dispatch-time weights",
        )
    } else if bits & problem::ZERO_COPY != 0 {
        (
            "zero_copy",
            "no combine buffer of this shape: call get_next_low_latency_combine_buffer(handle) and write the expert outputs there",
        )
    } else {
        ("handle", "the handle is no longer usable")
    }
}

/// The error a report stands for, in the host backend's precedence: this rank's own argument problem (with
/// `local`'s reason when it names the same argument — a problem this rank found on the host), then a
/// call-signature mismatch, then a peer's argument problem.
fn report_error(rep: &LlReport, me: usize, local: Option<(&'static str, String)>) -> Option<Error> {
    if *rep == LlReport::default() {
        return None;
    }
    if rep.own_problem != 0 {
        let (arg, why) = problem_reason(rep.own_problem);
        return Some(match local {
            Some((local_arg, local_why)) if local_arg == arg => Error::invalid(arg, me, local_why),
            _ => Error::invalid(arg, me, why),
        });
    }
    if rep.mismatch_peer != 0 {
        return Some(Error::RankMismatch {
            what: SIG_FIELDS.get(rep.mismatch_field as usize).copied().unwrap_or("call signature"),
            rank: me,
            peer: rep.mismatch_peer as usize - 1,
            ours: rep.mismatch_ours.to_string(),
            theirs: rep.mismatch_theirs.to_string(),
        });
    }
    if rep.peer_problem_peer != 0 {
        let (arg, _) = problem_reason(rep.peer_problem);
        let peer = rep.peer_problem_peer - 1;
        return Some(Error::invalid(arg, me, format!("rank {peer} passed an invalid `{arg}`; the call is abandoned on every rank")));
    }
    None
}

/// The timing trace of a buffer's low-latency launches (`KernelTracing::low_latency`), both kernel families:
/// `2 * LL_TRACE_CALLS` launch slots of one row of `LL_TRACE_WORDS` u64 stamps per block (`ll.cuh`).
/// Allocated on the first traced call and never moved (captured graphs keep its address). Device memory, not
/// host-mapped: a system-scope fence after a stamp would wait for its PCIe write, ~1-2 µs, and distort
/// exactly the points being measured.
pub(crate) struct LlTrace {
    words: Option<moelink_cuda::DeviceBuffer>,
}

impl LlTrace {
    pub(crate) fn new() -> LlTrace {
        LlTrace { words: None }
    }

    /// Words of one family for launches of at most `max_blocks` blocks.
    fn family_words(max_blocks: usize) -> usize {
        2 * LL_TRACE_CALLS * max_blocks.max(1) * LL_TRACE_WORDS
    }

    /// The trace address of family `family` (0 dispatch, 1 combine) for launches of at most `max_blocks`
    /// blocks, allocating the words on first use; null when `enabled` is false.
    pub(crate) fn ptr(&mut self, device: &Device, enabled: bool, max_blocks: usize, family: usize) -> Result<DevPtr> {
        if !enabled {
            return Ok(DevPtr::NULL);
        }
        let words = Self::family_words(max_blocks);
        if self.words.is_none() {
            self.words = Some(moelink_cuda::DeviceBuffer::zeroed(device, 2 * words * 8)?);
        }
        Ok(self.words.as_ref().map_or(DevPtr::NULL, |t| t.device_ptr().byte_add(family * words * 8)))
    }

    /// Enqueues the clearing of the words (when a timed region opens, before its barrier).
    pub(crate) fn clear(&mut self, stream: &moelink_cuda::Stream) -> Result<()> {
        if let Some(t) = self.words.as_mut() {
            t.memset_u32_async(0, stream)?;
        }
        Ok(())
    }

    /// The traces of every launch since the words were last cleared (empty when tracing is off): launches of
    /// `blocks` blocks, the words sized for `max_blocks`. Called once the timed region's work has completed.
    pub(crate) fn summaries(&self, max_blocks: usize, blocks: usize, kernels: [&'static str; 2]) -> Vec<crate::trace::KernelTrace> {
        let Some(t) = self.words.as_ref() else { return Vec::new() };
        let mut bytes = vec![0u8; t.len_bytes()];
        if t.copy_to_host(&mut bytes).is_err() {
            return Vec::new();
        }
        let words: Vec<u64> = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
        let family = Self::family_words(max_blocks);
        let mut out = crate::trace::ll_launches(&words[..family], blocks, kernels[0], "dispatch");
        out.extend(crate::trace::ll_launches(&words[family..], blocks, kernels[1], "combine"));
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A low-latency call at DeepEP's shape, on rank 1 of 4 (the fabrics' tests use it too).
    pub(crate) fn spec(quant: LlQuant, has_weights: bool) -> LlSpec {
        LlSpec {
            rank: 1,
            num_ranks: 4,
            num_tokens: 100,
            hidden: 7168,
            topk: 8,
            num_experts: 288,
            num_max_tokens: 128,
            quant,
            has_weights,
            return_recv_hook: false,
        }
    }

    #[test]
    fn dropped_hooks_are_drained_once_and_pending_ones_kept() {
        let mut hooks = Hooks::new();
        let markers: Vec<HookMarker> = (0..3).map(|_| Arc::new(AtomicU8::new(HOOK_PENDING))).collect();
        for (i, m) in markers.iter().enumerate() {
            hooks.hand_out(m.clone(), i);
        }
        assert!(hooks.take_dropped().is_empty(), "every hook is still pending");
        // A pending phase dropped unrun (as `Pending`'s drop does), one that ran, one still pending.
        drop(Pending::new((), (), markers[0].clone(), ()));
        markers[1].store(HOOK_RAN, Ordering::Release);
        assert_eq!(hooks.take_dropped(), vec![0]);
        assert!(hooks.take_dropped().is_empty(), "a drain is handed out once, a hook that ran is forgotten");
        drop(Pending::new((), (), markers[2].clone(), ()));
        assert_eq!(hooks.take_dropped(), vec![2], "the pending hook was kept until it was dropped");
        // A phase that ran is not marked dropped when its `Pending` goes.
        let ran = Arc::new(AtomicU8::new(HOOK_RAN));
        drop(Pending::new((), (), ran.clone(), ()));
        assert_eq!(ran.load(Ordering::Acquire), HOOK_RAN);
    }

    #[test]
    fn signature_follows_the_host_check_order() {
        let s = spec(LlQuant::Fp8 { round_scale: true, use_ue8m0: true }, true);
        let sig = signature(&s);
        assert_eq!(&sig[..6], &[7168, 8, 288, 128, 0b111, 1]);
        assert_eq!(&sig[6..], &[0, 0]);
        assert_eq!(signature(&spec(LlQuant::Bf16, false))[4..6], [0, 0]);
        assert_eq!(SIG_FIELDS[0], "hidden");
        assert_eq!(SIG_FIELDS[5], "topk_weights");
    }

    #[test]
    fn problem_bits_name_arguments() {
        assert_eq!(problem_reason(problem::TOPK_IDX).0, "topk_idx");
        assert_eq!(problem_reason(problem::TOPK_IDX_DIFFERS).0, "topk_idx");
        assert_eq!(problem_reason(problem::WEIGHTS_DIFFER).0, "topk_weights");
        assert_eq!(problem_reason(problem::ZERO_COPY).0, "zero_copy");
        assert_eq!(problem_reason(problem::HANDLE).0, "handle");
        // The lowest bit wins when several are set.
        assert_eq!(problem_reason(problem::WEIGHTS_DIFFER | problem::TOPK_IDX_DIFFERS).0, "topk_idx");
    }

    #[test]
    fn reports_become_the_host_backends_errors() {
        assert!(report_error(&LlReport::default(), 0, None).is_none());
        // Own problem first, with the host-side reason when it names the same argument.
        let own =
            LlReport { own_problem: problem::ZERO_COPY, mismatch_peer: 2, peer_problem_peer: 1, peer_problem: 1, ..Default::default() };
        let e = report_error(&own, 3, Some(("zero_copy", "mine".into()))).unwrap();
        assert_eq!(e.argument(), Some("zero_copy"));
        assert!(e.to_string().contains("mine") && e.to_string().contains("rank 3"), "{e}");
        let e = report_error(&LlReport { own_problem: problem::WEIGHTS_DIFFER, ..Default::default() }, 0, Some(("zero_copy", "x".into())));
        assert_eq!(e.unwrap().argument(), Some("topk_weights"));
        // Then a signature mismatch naming the peer and the field.
        let mism = LlReport { mismatch_peer: 2, mismatch_field: 0, mismatch_ours: 128, mismatch_theirs: 256, ..Default::default() };
        match report_error(&mism, 0, None) {
            Some(Error::RankMismatch { what: "hidden", rank: 0, peer: 1, ours, theirs }) => {
                assert_eq!((ours.as_str(), theirs.as_str()), ("128", "256"))
            }
            other => panic!("{other:?}"),
        }
        // Then a peer's problem, naming the peer.
        let peer = LlReport { peer_problem_peer: 1, peer_problem: problem::WEIGHTS_DIFFER, ..Default::default() };
        let e = report_error(&peer, 1, None).unwrap();
        assert_eq!(e.argument(), Some("topk_weights"));
        assert!(e.to_string().contains("rank 0"), "{e}");
        assert!(!e.poisons_buffer());
    }
}
