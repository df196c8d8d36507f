//! Backends: the same operations on CPU threads (`host`, the oracle) and on GPUs (`cuda`). The core
//! validates every argument before a backend sees it; backends trust their inputs.

pub(crate) mod cuda;
pub(crate) mod host;

use std::any::Any;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::Result;
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

/// Outputs of `get_dispatch_layout`: `int32 [R]`, `int32 [E]`, `bool [T, R]`.
pub struct LayoutOutputs<'a> {
    pub num_tokens_per_rank: TensorMut<'a>,
    pub num_tokens_per_expert: TensorMut<'a>,
    pub is_token_in_rank: TensorMut<'a>,
}

/// A receive phase that has not run yet (`return_recv_hook`). Holds the output views it will write.
pub(crate) enum PendingRecv<'a> {
    HostLlDispatch(host::ll::PendingDispatch<'a>),
    HostLlCombine(host::ll::PendingCombine<'a>),
    Cuda(cuda::PendingRecv<'a>),
}

/// What a backend returns from a dispatch: handle data plus the host-known received count.
pub(crate) struct HtDispatched {
    pub data: Arc<dyn Any + Send + Sync>,
    pub num_recv_tokens: Option<usize>,
}

pub(crate) trait Backend: Send {
    /// `"host"` or `"cuda"`.
    fn name(&self) -> &'static str;
    /// Where this backend's tensors live.
    fn location(&self) -> Location;
    /// SMs a high-throughput kernel uses when the caller gives no config.
    fn default_num_sms(&self) -> usize;
    /// The most SMs a high-throughput call may ask for (`config.num_sms`): the rank's share of its GPU,
    /// whose kernels must run alongside the kernels of the ranks that share that GPU. Host backend: no limit.
    fn max_num_sms(&self) -> usize {
        usize::MAX
    }
    /// Allocates an output tensor on this backend's location (contents unspecified).
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor>;
    /// Copies a tensor to this backend's location (contiguous result).
    fn upload(&self, t: &Tensor) -> Result<Tensor>;
    fn barrier(&mut self) -> Result<()>;
    /// Told by the buffer before each of its collective calls, with the call's number (1, 2, ...), whether or
    /// not the call gets past validation: the host backend tags its exchanges with it, so that a rank that
    /// failed a call on its own and went on cannot pair its next call's exchanges with its peers' current
    /// ones. The CUDA kernels keep their own epochs.
    fn begin_call(&mut self, _call: u64) {}
    /// Before this rank's resources are freed: waits until no rank's kernels can still touch them
    /// (collective). Host backend: nothing to wait for.
    fn quiesce(&mut self) -> Result<()> {
        Ok(())
    }
    /// Runs later operations on a caller's raw stream (asynchronously), or with `None` on the backend's
    /// own stream with the host waiting. Host backend: ignored (always synchronous).
    fn set_stream(&mut self, _stream: Option<u64>) {}
    /// Told once when a collective failed and the buffer is poisoned (the CUDA backend then keeps its
    /// symmetric memory alive on drop: peers may still write into it).
    fn poison(&mut self) {}
    /// Starts capturing this backend's operations into a CUDA graph (CUDA only).
    fn begin_capture(&mut self) -> Result<()> {
        Err(crate::Error::Unavailable(format!("the {} backend cannot capture CUDA graphs", self.name())))
    }
    /// Ends the capture and instantiates the graph.
    fn end_capture(&mut self) -> Result<moelink_cuda::GraphExec> {
        Err(crate::Error::Unavailable(format!("the {} backend cannot capture CUDA graphs", self.name())))
    }
    /// Replays a captured graph; synchronous mode waits for it and reports kernel errors.
    ///
    /// # Safety
    /// As [`crate::Buffer::replay`].
    unsafe fn replay(&mut self, _graph: &moelink_cuda::GraphExec) -> Result<()> {
        Err(crate::Error::Unavailable(format!("the {} backend cannot replay CUDA graphs", self.name())))
    }
    /// Opens a timed region (collective; [`crate::Buffer::timed`]): lines the ranks up and marks the start.
    /// Returns `false` when the backend has no device clock: the caller then times with the wall clock, which
    /// this default makes meaningful by returning right after a barrier of all ranks.
    fn timer_begin(&mut self) -> Result<bool> {
        self.barrier()?;
        Ok(false)
    }
    /// Closes the region `timer_begin` opened with `true`, once its work has completed: microseconds of
    /// device time from the start mark to the end of the last operation enqueued since.
    fn timer_end(&mut self) -> Result<f64> {
        Err(crate::Error::Unavailable(format!("the {} backend has no device timer", self.name())))
    }
    /// Closes a timed region without reading it (the timed work failed).
    fn timer_cancel(&mut self) {}
    /// What [`crate::Buffer::timed`] measures here: `"cuda-events"` or `"wall"`.
    fn timer_name(&self) -> &'static str {
        "wall"
    }
    /// The kernel traces ([`crate::KernelTracing`]) since the last timed region opened, in start order.
    fn kernel_traces(&self) -> Vec<crate::trace::KernelTrace> {
        Vec::new()
    }

    fn dispatch_layout(&mut self, topk_idx: &TensorRef<'_>, num_experts: usize, out: LayoutOutputs<'_>) -> Result<()>;
    /// Count exchange (notify). Returns the plan with host-known sizes (CPU-sync) and backend state.
    fn prepare_dispatch(&mut self, spec: HtSpec, args: &DispatchArgs<'_>) -> Result<DispatchPlan>;
    fn dispatch(&mut self, plan: DispatchPlan, args: &DispatchArgs<'_>, out: DispatchOutputs<'_>) -> Result<HtDispatched>;
    fn combine(&mut self, spec: CombineSpec, args: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()>;

    /// Low-latency dispatch. Returns the handle data and, with `return_recv_hook`, the pending receive.
    fn ll_dispatch<'a>(
        &mut self,
        spec: LlSpec,
        args: &LlDispatchArgs<'_>,
        out: LlDispatchOutputs<'a>,
    ) -> Result<(Arc<dyn Any + Send + Sync>, Option<PendingRecv<'a>>)>;
    fn ll_combine<'a>(
        &mut self,
        spec: LlCombineSpec,
        args: &LlCombineArgs<'_>,
        out: LlCombineOutputs<'a>,
    ) -> Result<Option<PendingRecv<'a>>>;
    fn run_recv(&mut self, pending: PendingRecv<'_>) -> Result<()>;
    /// The buffer the next low-latency combine sends from (`[E_local, R*T_max, H]` bf16).
    fn ll_next_combine_buffer(&mut self, spec: &LlSpec) -> Result<TensorMut<'_>>;
    fn clean_ll_buffer(&mut self, num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_experts: usize) -> Result<()>;
    /// Shrink mode: mask / unmask a rank, read the mask, clear it.
    fn ll_set_mask(&mut self, rank: usize, masked: bool) -> Result<()>;
    fn ll_mask(&mut self) -> Result<Vec<bool>>;
    fn ll_clear_mask(&mut self) -> Result<()>;
    /// This rank's communication buffer as a 1-D `uint8` view: the high-throughput region, or the
    /// low-latency one with `use_rdma_buffer` (DeepEP's `get_local_buffer_tensor`).
    fn local_buffer(&mut self, _use_rdma_buffer: bool) -> Result<TensorMut<'_>> {
        Err(crate::error::Error::Unavailable(format!("the {} backend has no communication buffer to view", self.name())))
    }
}
