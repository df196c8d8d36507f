//! Low-latency dispatch/combine on GPUs (see `docs/protocols.md`). Placeholder: being implemented.

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use super::CudaBackend;
use crate::backend::PendingRecv as AnyPending;
use crate::error::{Error, Result};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::TensorMut;

/// Per-buffer low-latency state (buffer set parity, masks, ...).
pub(crate) struct LlState {
    pub mask: Vec<bool>,
}

impl LlState {
    pub(crate) fn new(num_ranks: usize) -> LlState {
        LlState { mask: vec![false; num_ranks] }
    }
}

pub(crate) struct PendingDispatch<'a> {
    _out: PhantomData<LlDispatchOutputs<'a>>,
}
pub(crate) struct PendingCombine<'a> {
    _out: PhantomData<LlCombineOutputs<'a>>,
}

fn todo<T>() -> Result<T> {
    Err(Error::Unavailable("CUDA low-latency kernels are not built yet".into()))
}

pub(crate) fn dispatch<'a>(
    _b: &mut CudaBackend,
    _s: LlSpec,
    _a: &LlDispatchArgs<'_>,
    _o: LlDispatchOutputs<'a>,
) -> Result<(Arc<dyn Any + Send + Sync>, Option<AnyPending<'a>>)> {
    todo()
}
pub(crate) fn combine<'a>(
    _b: &mut CudaBackend,
    _s: LlCombineSpec,
    _a: &LlCombineArgs<'_>,
    _o: LlCombineOutputs<'a>,
) -> Result<Option<AnyPending<'a>>> {
    todo()
}
pub(crate) fn finish_dispatch(_b: &mut CudaBackend, _p: PendingDispatch<'_>) -> Result<()> {
    todo()
}
pub(crate) fn finish_combine(_b: &mut CudaBackend, _p: PendingCombine<'_>) -> Result<()> {
    todo()
}
pub(crate) fn next_combine_buffer<'b>(_b: &'b mut CudaBackend, _s: &LlSpec) -> Result<TensorMut<'b>> {
    todo()
}
pub(crate) fn clean(_b: &mut CudaBackend, _t: usize, _h: usize, _e: usize) -> Result<()> {
    todo()
}
pub(crate) fn set_mask(b: &mut CudaBackend, rank: usize, masked: bool) -> Result<()> {
    b.ll.mask[rank] = masked;
    Ok(())
}
pub(crate) fn mask(b: &mut CudaBackend) -> Result<Vec<bool>> {
    Ok(b.ll.mask.clone())
}
pub(crate) fn clear_mask(b: &mut CudaBackend) -> Result<()> {
    b.ll.mask.iter_mut().for_each(|m| *m = false);
    Ok(())
}
