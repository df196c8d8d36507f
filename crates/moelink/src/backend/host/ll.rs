//! Low-latency dispatch/combine on the host. (Being implemented: see the LL host work item.)

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use super::HostBackend;
use crate::backend::PendingRecv;
use crate::error::{Error, Result};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::{Tensor, TensorMut};

pub(crate) struct LlState {
    pub mask: Vec<bool>,
    pub combine_staging: Option<Tensor>,
}

impl LlState {
    pub fn new(num_ranks: usize) -> LlState {
        LlState { mask: vec![false; num_ranks], combine_staging: None }
    }
}

pub(crate) struct PendingDispatch<'a> {
    _out: PhantomData<LlDispatchOutputs<'a>>,
}
pub(crate) struct PendingCombine<'a> {
    _out: PhantomData<LlCombineOutputs<'a>>,
}

fn todo_err(b: &HostBackend) -> Error {
    Error::Unavailable(format!("rank {}: host low-latency path not implemented yet", b.rank()))
}

pub(crate) fn dispatch<'a>(
    b: &mut HostBackend,
    _s: LlSpec,
    _a: &LlDispatchArgs<'_>,
    _o: LlDispatchOutputs<'a>,
) -> Result<(Arc<dyn Any + Send + Sync>, Option<PendingRecv<'a>>)> {
    Err(todo_err(b))
}
pub(crate) fn combine<'a>(
    b: &mut HostBackend,
    _s: LlCombineSpec,
    _a: &LlCombineArgs<'_>,
    _o: LlCombineOutputs<'a>,
) -> Result<Option<PendingRecv<'a>>> {
    Err(todo_err(b))
}
pub(crate) fn finish_dispatch(b: &mut HostBackend, _p: PendingDispatch<'_>) -> Result<()> {
    Err(todo_err(b))
}
pub(crate) fn finish_combine(b: &mut HostBackend, _p: PendingCombine<'_>) -> Result<()> {
    Err(todo_err(b))
}
pub(crate) fn next_combine_buffer<'b>(b: &'b mut HostBackend, _s: &LlSpec) -> Result<TensorMut<'b>> {
    Err(todo_err(b))
}
