//! Backends: the same operations on CPU threads (`host`, the oracle) and on GPUs (`cuda`). The core
//! validates every argument before a backend sees it; backends trust their inputs.

pub(crate) mod cuda;
pub(crate) mod host;

use std::sync::Arc;

use crate::config::{BackendKind, BufferOptions};
use crate::dtype::DType;
use crate::error::Result;
use crate::group::Group;
use crate::ht::{CombineArgs, CombineOutputs, CombineSpec, DispatchArgs, DispatchOutputs, DispatchPlan, HtSpec};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
pub(crate) use crate::opaque::{BackendData, PendingRecv};
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

/// Outputs of `get_dispatch_layout`: `int32 [R]`, `int32 [E]`, `bool [T, R]`.
pub struct LayoutOutputs<'a> {
    pub num_tokens_per_rank: TensorMut<'a>,
    /// `int32 [num_nodes]`: tokens per destination node (DeepEP's `num_tokens_per_rdma_rank`); written when
    /// given (a buffer across nodes returns it from `get_dispatch_layout`).
    pub num_tokens_per_rdma_rank: Option<TensorMut<'a>>,
    pub num_tokens_per_expert: TensorMut<'a>,
    pub is_token_in_rank: TensorMut<'a>,
}

/// What a backend returns from a dispatch: handle data plus the host-known received count.
pub(crate) struct HtDispatched {
    pub data: Arc<BackendData>,
    pub num_recv_tokens: Option<usize>,
}

/// A stream a [`crate::Buffer`] enqueues on for a while, instead of its own.
pub(crate) enum BoundStream {
    /// A stream of this process ([`crate::Buffer::on_stream`]).
    Owned(moelink_cuda::Stream),
    /// A stream from outside Rust, valid under [`crate::ForeignStream`]'s contract.
    Foreign(crate::ForeignStream),
}

impl BackendKind {
    /// `Ok` when this backend can run on this machine; for [`BackendKind::Cuda`] the error says why not
    /// (no driver, no GPU, no NVRTC, not built). `Host` and `Auto` always can.
    pub fn check_available(self) -> Result<()> {
        match self {
            BackendKind::Cuda => cuda::available(),
            BackendKind::Host | BackendKind::Auto => Ok(()),
        }
    }

    /// The backend `Auto` picks on this machine (`Cuda` when available, else `Host`); `Host` and `Cuda`
    /// return themselves.
    pub fn resolve(self) -> BackendKind {
        match self {
            BackendKind::Auto if BackendKind::Cuda.check_available().is_ok() => BackendKind::Cuda,
            BackendKind::Auto => BackendKind::Host,
            other => other,
        }
    }
}

/// The backend `options.backend` selects, for this rank of `group`. The CUDA backend picks its fabric here,
/// once: one node, or several ([`crate::BufferOptions::topology`]).
pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions) -> Result<Box<dyn Backend>> {
    match options.backend.resolve() {
        BackendKind::Host => Ok(Box::new(host::HostBackend::new(group, options)?)),
        _ => cuda::new(group, options),
    }
}

pub(crate) trait Backend: Send {
    /// `"host"` or `"cuda"`.
    fn name(&self) -> &'static str;
    /// This backend as `Any`, for the receive phases it handed out ([`PendingRecv`]) to find their own type.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
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
    /// Enqueues later operations on `stream` and returns once they are enqueued, until `unbind_stream`.
    /// Host backend: ignored (always synchronous).
    fn bind_stream(&mut self, _stream: BoundStream) -> Result<()> {
        Ok(())
    }
    /// Back to the backend's own stream, the host waiting for every operation. With `wait`, first waits
    /// (bounded by the deadline) for the work enqueued on the bound stream and reports its kernels' errors.
    fn unbind_stream(&mut self, _wait: bool) -> Result<()> {
        Ok(())
    }
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
    /// Replays a captured graph; synchronous mode waits for it and reports kernel errors. Called only by
    /// the pipelines of [`crate::graph`], which own every tensor and handle their graphs use.
    fn replay(&mut self, _graph: &moelink_cuda::GraphExec) -> Result<()> {
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
    ) -> Result<(Arc<BackendData>, Option<PendingRecv<'a>>)>;
    fn ll_combine<'a>(
        &mut self,
        spec: LlCombineSpec,
        args: &LlCombineArgs<'_>,
        out: LlCombineOutputs<'a>,
    ) -> Result<Option<PendingRecv<'a>>>;
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
        Err(crate::Error::Unavailable(format!("the {} backend has no communication buffer to view", self.name())))
    }
}

/// The high-throughput `Backend` methods every backend implements as functions of the same name in its `ht`
/// module (taking the backend first): expanded inside each `impl Backend`, where that module is in scope.
macro_rules! forward_ht_operations {
    () => {
        fn dispatch_layout(
            &mut self,
            topk_idx: &$crate::tensor::TensorRef<'_>,
            num_experts: usize,
            out: $crate::backend::LayoutOutputs<'_>,
        ) -> $crate::Result<()> {
            ht::dispatch_layout(self, topk_idx, num_experts, out)
        }
        fn prepare_dispatch(
            &mut self,
            spec: $crate::ht::HtSpec,
            args: &$crate::ht::DispatchArgs<'_>,
        ) -> $crate::Result<$crate::ht::DispatchPlan> {
            ht::prepare_dispatch(self, spec, args)
        }
        fn dispatch(
            &mut self,
            plan: $crate::ht::DispatchPlan,
            args: &$crate::ht::DispatchArgs<'_>,
            out: $crate::ht::DispatchOutputs<'_>,
        ) -> $crate::Result<$crate::backend::HtDispatched> {
            ht::dispatch(self, plan, args, out)
        }
        fn combine(
            &mut self,
            spec: $crate::ht::CombineSpec,
            args: &$crate::ht::CombineArgs<'_>,
            out: $crate::ht::CombineOutputs<'_>,
        ) -> $crate::Result<()> {
            ht::combine(self, spec, args, out)
        }
    };
}
pub(crate) use forward_ht_operations;

/// The low-latency `Backend` methods every backend implements as functions of the same name in its `ll`
/// module (taking the backend first): expanded inside each `impl Backend`, where that module is in scope.
macro_rules! forward_ll_operations {
    () => {
        fn ll_dispatch<'a>(
            &mut self,
            spec: $crate::ll::LlSpec,
            args: &$crate::ll::LlDispatchArgs<'_>,
            out: $crate::ll::LlDispatchOutputs<'a>,
        ) -> $crate::Result<(std::sync::Arc<$crate::backend::BackendData>, Option<$crate::backend::PendingRecv<'a>>)> {
            ll::dispatch(self, spec, args, out)
        }
        fn ll_combine<'a>(
            &mut self,
            spec: $crate::ll::LlCombineSpec,
            args: &$crate::ll::LlCombineArgs<'_>,
            out: $crate::ll::LlCombineOutputs<'a>,
        ) -> $crate::Result<Option<$crate::backend::PendingRecv<'a>>> {
            ll::combine(self, spec, args, out)
        }
        fn ll_next_combine_buffer(&mut self, spec: &$crate::ll::LlSpec) -> $crate::Result<$crate::tensor::TensorMut<'_>> {
            ll::next_combine_buffer(self, spec)
        }
        fn clean_ll_buffer(&mut self, num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_experts: usize) -> $crate::Result<()> {
            ll::clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        }
        fn ll_set_mask(&mut self, rank: usize, masked: bool) -> $crate::Result<()> {
            ll::set_mask(self, rank, masked)
        }
        fn ll_mask(&mut self) -> $crate::Result<Vec<bool>> {
            ll::mask(self)
        }
        fn ll_clear_mask(&mut self) -> $crate::Result<()> {
            ll::clear_mask(self)
        }
    };
}
pub(crate) use forward_ll_operations;
