//! The host backend: every operation on CPU threads, one per rank, exchanging rows through the
//! [`Group`](crate::group::Group). It is the oracle for the GPU kernels: deterministic, with the exact
//! reduction orders and FP8 rounding documented in [`crate::ht`] and [`crate::ll`].

pub(crate) mod ht;
pub(crate) mod ll;

use std::any::Any;
use std::sync::Arc;

use super::{Backend, HtDispatched, LayoutOutputs, PendingRecv};
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

pub(crate) struct HostBackend {
    pub(crate) group: Arc<dyn Group>,
    pub(crate) ll: ll::LlState,
}

impl HostBackend {
    pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions) -> Result<HostBackend> {
        let n = group.size();
        // Buffer creation is collective: make sure every rank is here (and agrees on the shrink mode).
        crate::group::check_agreement(group.as_ref(), &[("enable_shrink", options.enable_shrink as u64)])?;
        Ok(HostBackend { group, ll: ll::LlState::new(n) })
    }
    pub(crate) fn rank(&self) -> usize {
        self.group.rank()
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
        self.group.barrier()
    }

    fn dispatch_layout(&mut self, topk_idx: &TensorRef<'_>, num_experts: usize, out: LayoutOutputs<'_>) -> Result<()> {
        ht::dispatch_layout(self, topk_idx, num_experts, out)
    }
    fn prepare_dispatch(&mut self, spec: HtSpec, args: &DispatchArgs<'_>) -> Result<DispatchPlan> {
        ht::prepare_dispatch(self, spec, args)
    }
    fn dispatch(&mut self, plan: DispatchPlan, args: &DispatchArgs<'_>, out: DispatchOutputs<'_>) -> Result<HtDispatched> {
        ht::dispatch(self, plan, args, out)
    }
    fn combine(&mut self, spec: CombineSpec, args: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()> {
        ht::combine(self, spec, args, out)
    }

    fn ll_dispatch<'a>(
        &mut self,
        spec: LlSpec,
        args: &LlDispatchArgs<'_>,
        out: LlDispatchOutputs<'a>,
    ) -> Result<(Arc<dyn Any + Send + Sync>, Option<PendingRecv<'a>>)> {
        ll::dispatch(self, spec, args, out)
    }
    fn ll_combine<'a>(
        &mut self,
        spec: LlCombineSpec,
        args: &LlCombineArgs<'_>,
        out: LlCombineOutputs<'a>,
    ) -> Result<Option<PendingRecv<'a>>> {
        ll::combine(self, spec, args, out)
    }
    fn run_recv(&mut self, pending: PendingRecv<'_>) -> Result<()> {
        match pending {
            PendingRecv::HostLlDispatch(p) => ll::finish_dispatch(self, p),
            PendingRecv::HostLlCombine(p) => ll::finish_combine(self, p),
            PendingRecv::Cuda(_) => Err(Error::invalid("hook", self.rank(), "a CUDA hook cannot run on the host backend")),
        }
    }
    fn ll_next_combine_buffer(&mut self, spec: &LlSpec) -> Result<TensorMut<'_>> {
        ll::next_combine_buffer(self, spec)
    }
    fn clean_ll_buffer(&mut self, _num_max_dispatch_tokens_per_rank: usize, _hidden: usize, _num_experts: usize) -> Result<()> {
        // Nothing persists between host low-latency calls except the zero-copy staging buffer.
        self.ll.combine_staging = None;
        self.group.barrier()
    }
    fn ll_set_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.ll.mask[rank] = masked;
        Ok(())
    }
    fn ll_mask(&mut self) -> Result<Vec<bool>> {
        Ok(self.ll.mask.clone())
    }
    fn ll_clear_mask(&mut self) -> Result<()> {
        self.ll.mask.iter_mut().for_each(|m| *m = false);
        Ok(())
    }
}

pub(crate) use {host_bytes as input_bytes, host_bytes_mut as output_bytes};
