//! High-throughput dispatch/combine on GPUs (see `docs/protocols.md`). Placeholder: being implemented.

use std::any::Any;
use std::sync::Arc;

use super::CudaBackend;
use crate::backend::{HtDispatched, LayoutOutputs};
use crate::error::{Error, Result};
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec};
use crate::tensor::TensorRef;

/// Per-buffer high-throughput state (kept across calls).
#[derive(Default)]
pub(crate) struct HtState {}

/// Handle data of a CUDA dispatch.
pub(crate) struct CudaHtRouting {}

fn todo<T>() -> Result<T> {
    Err(Error::Unavailable("CUDA high-throughput kernels are not built yet".into()))
}

/// SMs a high-throughput kernel uses by default.
pub(crate) fn default_num_sms(_b: &CudaBackend) -> usize {
    24
}

pub(crate) fn dispatch_layout(_b: &mut CudaBackend, _topk_idx: &TensorRef<'_>, _num_experts: usize, _out: LayoutOutputs<'_>) -> Result<()> {
    todo()
}
pub(crate) fn prepare_dispatch(_b: &mut CudaBackend, _s: HtSpec, _a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
    todo()
}
pub(crate) fn dispatch(_b: &mut CudaBackend, _p: DispatchPlan, _a: &DispatchArgs<'_>, _o: DispatchOutputs<'_>) -> Result<HtDispatched> {
    let _: Option<Arc<dyn Any + Send + Sync>> = None;
    todo()
}
pub(crate) fn combine(_b: &mut CudaBackend, _s: CombineSpec, _a: &CombineArgs<'_>, _o: CombineOutputs<'_>) -> Result<()> {
    todo()
}
