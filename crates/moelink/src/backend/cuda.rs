//! The CUDA backend. (Being implemented: see the CUDA layer work item.)

use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;

use super::{Backend, HtDispatched, LayoutOutputs, PendingRecv as AnyPending};
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

pub(crate) struct PendingRecv<'a> {
    _out: PhantomData<&'a mut ()>,
}

pub(crate) struct CudaBackend {
    device: usize,
}

impl CudaBackend {
    pub(crate) fn available() -> Result<()> {
        Err(Error::Unavailable("the CUDA backend is not built yet".into()))
    }
    pub(crate) fn new(_group: Arc<dyn Group>, _options: &BufferOptions) -> Result<CudaBackend> {
        Self::available()?;
        Ok(CudaBackend { device: 0 })
    }
    fn unavailable<T>(&self) -> Result<T> {
        Err(Error::Unavailable("the CUDA backend is not built yet".into()))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn location(&self) -> Location {
        Location::Cuda(self.device)
    }
    fn default_num_sms(&self) -> usize {
        24
    }
    fn alloc(&self, _dtype: DType, _shape: &[usize]) -> Result<Tensor> {
        self.unavailable()
    }
    fn upload(&self, _t: &Tensor) -> Result<Tensor> {
        self.unavailable()
    }
    fn barrier(&mut self) -> Result<()> {
        self.unavailable()
    }
    fn dispatch_layout(&mut self, _t: &TensorRef<'_>, _e: usize, _o: LayoutOutputs<'_>) -> Result<()> {
        self.unavailable()
    }
    fn prepare_dispatch(&mut self, _s: HtSpec, _a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
        self.unavailable()
    }
    fn dispatch(&mut self, _p: DispatchPlan, _a: &DispatchArgs<'_>, _o: DispatchOutputs<'_>) -> Result<HtDispatched> {
        self.unavailable()
    }
    fn combine(&mut self, _s: CombineSpec, _a: &CombineArgs<'_>, _o: CombineOutputs<'_>) -> Result<()> {
        self.unavailable()
    }
    fn ll_dispatch<'a>(
        &mut self,
        _s: LlSpec,
        _a: &LlDispatchArgs<'_>,
        _o: LlDispatchOutputs<'a>,
    ) -> Result<(Arc<dyn Any + Send + Sync>, Option<AnyPending<'a>>)> {
        self.unavailable()
    }
    fn ll_combine<'a>(&mut self, _s: LlCombineSpec, _a: &LlCombineArgs<'_>, _o: LlCombineOutputs<'a>) -> Result<Option<AnyPending<'a>>> {
        self.unavailable()
    }
    fn run_recv(&mut self, _p: AnyPending<'_>) -> Result<()> {
        self.unavailable()
    }
    fn ll_next_combine_buffer(&mut self, _s: &LlSpec) -> Result<TensorMut<'_>> {
        self.unavailable()
    }
    fn clean_ll_buffer(&mut self, _t: usize, _h: usize, _e: usize) -> Result<()> {
        self.unavailable()
    }
    fn ll_set_mask(&mut self, _r: usize, _m: bool) -> Result<()> {
        self.unavailable()
    }
    fn ll_mask(&mut self) -> Result<Vec<bool>> {
        self.unavailable()
    }
    fn ll_clear_mask(&mut self) -> Result<()> {
        self.unavailable()
    }
}
