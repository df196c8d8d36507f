//! The host backend: every operation on CPU threads, one per rank, exchanging rows through the
//! [`Group`](crate::group::Group). It is the oracle for the GPU kernels: deterministic, with the exact
//! reduction orders and FP8 rounding documented in [`crate::ht`] and [`crate::ll`].
//!
//! Deadlines: every exchange waits at most the buffer's `timeout_ms` ([`Group::all_gather_within`]), and
//! every message carries the buffer's call number and the exchange's index in the call. A rank that does
//! not arrive, or arrives in another call (it failed an earlier call on its own input and went on), is a
//! [`Error::Timeout`] naming it on every other rank, which poisons the buffer as a kernel deadline does on
//! the GPU; the ranks never pair the exchanges of different calls.

pub(crate) mod ht;
pub(crate) mod ll;

/// The kind of buffer the host backend's handles, plans and hooks name when they reach another one.
const HOST: &str = "host";

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Backend;
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::group::Group;
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

pub(crate) struct HostBackend {
    pub(crate) group: Arc<dyn Group>,
    pub(crate) ll: ll::LlState,
    /// The deadline of every exchange (`BufferOptions::timeout_ms`).
    timeout: Duration,
    /// `BufferOptions::num_nvl_bytes`: the high-throughput capacity, checked as on the GPU
    /// ([`crate::ht::check_ht_capacity`]).
    pub(crate) num_nvl_bytes: usize,
    /// `BufferOptions::num_rdma_bytes` and the topology: across nodes the high-throughput capacity rule is
    /// the internode kernels' ([`crate::internode::ht_round_shape`]).
    num_rdma_bytes: usize,
    topology: crate::internode::Topology,
    /// The buffer's number of the call in progress ([`crate::backend::Backend::begin_call`]; 0 while the
    /// buffer is created) and the exchanges made in it so far.
    call: u64,
    step: Cell<u32>,
}

/// Bytes of the tag in front of every exchanged message: call number (u64), exchange index (u32), phase (u32).
const TAG_BYTES: usize = 16;

fn phase_code(phase: Phase) -> u32 {
    match phase {
        Phase::Barrier => 1,
        Phase::Layout => 2,
        Phase::Notify => 3,
        Phase::Dispatch => 4,
        Phase::Combine => 5,
        Phase::LowLatencyDispatch => 6,
        Phase::LowLatencyCombine => 7,
        Phase::Group => 8,
        Phase::Other => 9,
        Phase::Transport => 10,
        Phase::DispatchRdma => 11,
        Phase::DispatchNvlink => 12,
        Phase::CombineRdma => 13,
        Phase::CombineNvlink => 14,
    }
}

/// The name of a phase from its [`phase_code`].
fn phase_name(code: u32) -> String {
    const PHASES: [Phase; 14] = [
        Phase::Barrier,
        Phase::Layout,
        Phase::Notify,
        Phase::Dispatch,
        Phase::Combine,
        Phase::LowLatencyDispatch,
        Phase::LowLatencyCombine,
        Phase::Group,
        Phase::Other,
        Phase::Transport,
        Phase::DispatchRdma,
        Phase::DispatchNvlink,
        Phase::CombineRdma,
        Phase::CombineNvlink,
    ];
    PHASES.iter().find(|&&p| phase_code(p) == code).map_or_else(|| format!("phase {code}"), |p| p.to_string())
}

impl HostBackend {
    pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions) -> Result<HostBackend> {
        let n = group.size();
        let b = HostBackend {
            group,
            ll: ll::LlState::new(n),
            timeout: Duration::from_millis(options.timeout_ms),
            num_nvl_bytes: options.num_nvl_bytes,
            num_rdma_bytes: options.num_rdma_bytes,
            topology: options.topology.unwrap_or_else(|| crate::internode::Topology::single_node(n)),
            call: 0,
            step: Cell::new(0),
        };
        // Buffer creation is collective: make sure every rank is here (and agrees on the options that must
        // match, as the CUDA backend's symmetric memory requires).
        b.check_agreement(
            Phase::Group,
            &[
                ("enable_shrink", options.enable_shrink as u64),
                ("num_nvl_bytes", options.num_nvl_bytes as u64),
                ("num_rdma_bytes", options.num_rdma_bytes as u64),
                ("low_latency_mode", options.low_latency_mode as u64),
            ],
        )?;
        Ok(b)
    }
    pub(crate) fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The high-throughput capacity rule of the CUDA backend on this buffer: on one node
    /// [`crate::ht::check_ht_capacity`] (the slab holds `t_max` rows of `row_bytes`); across nodes
    /// [`crate::internode::ht_round_shape`] for the dispatch's rows (any token count fits in rounds; a
    /// combine re-uses its dispatch's rounds, `dispatch_shape` None).
    pub(crate) fn check_ht_capacity(
        &self,
        what: &'static str,
        t_max: usize,
        row_bytes: usize,
        dispatch_shape: Option<(usize, bool, usize)>,
    ) -> Result<()> {
        if self.topology.is_internode() {
            return match dispatch_shape {
                Some((hidden, fp8, topk)) => crate::internode::ht_round_shape(
                    self.rank(),
                    self.topology,
                    self.num_nvl_bytes,
                    self.num_rdma_bytes,
                    hidden,
                    fp8,
                    topk,
                    moelink_kernels::ht_internode::DEFAULT_CHUNK_TOKENS,
                )
                .map(|_| ()),
                None => Ok(()),
            };
        }
        crate::ht::check_ht_capacity(self.rank(), self.group.size(), self.num_nvl_bytes, what, t_max, row_bytes)
    }

    /// The tag of the next exchange of this call.
    fn next_tag(&self, phase: Phase) -> [u8; TAG_BYTES] {
        let step = self.step.get();
        self.step.set(step.wrapping_add(1));
        let mut tag = [0u8; TAG_BYTES];
        tag[..8].copy_from_slice(&self.call.to_le_bytes());
        tag[8..12].copy_from_slice(&step.to_le_bytes());
        tag[12..].copy_from_slice(&phase_code(phase).to_le_bytes());
        tag
    }

    /// A group error in terms of this operation: the group's timeouts name the phase that was running.
    fn in_phase(e: Error, phase: Phase) -> Error {
        match e {
            Error::Timeout { rank, peer, phase: Phase::Group, waited_ms } => Error::Timeout { rank, peer, phase, waited_ms },
            other => other,
        }
    }

    /// Strips the tags of one exchange's messages. A message of another call comes from a rank that is not in
    /// this call (it failed an earlier one on its own input and went on): for this rank, a rank that did not
    /// arrive. A message of the same call but another exchange or phase comes from a rank that called another
    /// operation: the ranks disagree on the operation, which [`Error::RankMismatch`] names with both phases.
    fn untag(&self, all: Vec<Vec<u8>>, tag: &[u8; TAG_BYTES], phase: Phase, start: Instant) -> Result<Vec<Vec<u8>>> {
        let me = self.rank();
        if let Some(peer) = all.iter().position(|m| m.get(..TAG_BYTES) != Some(&tag[..])) {
            let theirs = &all[peer];
            if theirs.len() >= TAG_BYTES && theirs[..8] == tag[..8] {
                let their_phase = u32::from_le_bytes([theirs[12], theirs[13], theirs[14], theirs[15]]);
                let their_step = u32::from_le_bytes([theirs[8], theirs[9], theirs[10], theirs[11]]);
                let our_step = u32::from_le_bytes([tag[8], tag[9], tag[10], tag[11]]);
                return Err(Error::RankMismatch {
                    what: "operation",
                    rank: me,
                    peer,
                    ours: format!("{phase} (exchange {our_step} of call {})", self.call),
                    theirs: format!("{} (exchange {their_step} of the same call)", phase_name(their_phase)),
                });
            }
            return Err(Error::Timeout { rank: me, peer, phase, waited_ms: start.elapsed().as_millis() as u64 });
        }
        Ok(all
            .into_iter()
            .map(|mut m| {
                m.drain(..TAG_BYTES);
                m
            })
            .collect())
    }

    /// Every rank's `bytes`, by rank, within the deadline (see the module docs).
    pub(crate) fn all_gather(&self, phase: Phase, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let tag = self.next_tag(phase);
        let mut msg = Vec::with_capacity(TAG_BYTES + bytes.len());
        msg.extend_from_slice(&tag);
        msg.extend_from_slice(bytes);
        let start = Instant::now();
        let all = self.group.all_gather_within(&msg, self.timeout).map_err(|e| Self::in_phase(e, phase))?;
        self.untag(all, &tag, phase, start)
    }

    /// `send[r]` to rank `r`; what each rank sent here, by source, within the deadline.
    pub(crate) fn all_to_all(&self, phase: Phase, send: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let tag = self.next_tag(phase);
        let send = send
            .into_iter()
            .map(|m| {
                let mut t = Vec::with_capacity(TAG_BYTES + m.len());
                t.extend_from_slice(&tag);
                t.extend_from_slice(&m);
                t
            })
            .collect();
        let start = Instant::now();
        let all = self.group.all_to_all_within(send, self.timeout).map_err(|e| Self::in_phase(e, phase))?;
        self.untag(all, &tag, phase, start)
    }

    /// [`crate::group::check_agreement`] within the deadline.
    pub(crate) fn check_agreement(&self, phase: Phase, items: &[(&'static str, u64)]) -> Result<()> {
        crate::group::check_agreement_with(self.rank(), items, |mine| self.all_gather(phase, mine))
    }
}

/// Reads bf16 bits as f32 (exact).
#[inline]
pub(crate) fn bf16_bits_to_f32(lo: u8, hi: u8) -> f32 {
    f32::from_bits((u16::from_le_bytes([lo, hi]) as u32) << 16)
}

/// Rounds f32 to bf16 bits, round-to-nearest-even (NaN stays NaN), as the GPU's `cvt.rn.bf16.f32`.
#[inline]
pub(crate) fn f32_to_bf16_bits(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

pub(crate) fn host_bytes<'a>(t: &TensorRef<'a>, arg: &'static str, rank: usize) -> Result<&'a [u8]> {
    t.host_bytes().ok_or_else(|| Error::invalid(arg, rank, "the host backend needs host tensors"))
}

pub(crate) fn host_bytes_mut<'t>(t: &'t mut TensorMut<'_>, arg: &'static str, rank: usize) -> Result<&'t mut [u8]> {
    t.host_bytes_mut().ok_or_else(|| Error::invalid(arg, rank, "the host backend needs host tensors"))
}

impl Backend for HostBackend {
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn name(&self) -> &'static str {
        "host"
    }
    fn location(&self) -> Location {
        Location::Host
    }
    fn default_num_sms(&self) -> usize {
        20
    }
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        Tensor::zeros(dtype, shape)
    }
    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        t.to_host()
    }
    fn barrier(&mut self) -> Result<()> {
        self.all_gather(Phase::Barrier, &[]).map(|_| ())
    }
    fn begin_call(&mut self, call: u64) {
        self.call = call;
        self.step.set(0);
    }

    super::forward_ht_operations!();
    super::forward_ll_operations!();
}

pub(crate) use {host_bytes as input_bytes, host_bytes_mut as output_bytes};
