//! `Buffer`: one rank's endpoint of the expert-parallel collectives.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{self, Backend, BoundStream, LayoutOutputs, PendingRecv};
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::ht::{
    self, BufferFacts, CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, HtHandle, LayoutRef, Routing,
};
use crate::internode::Topology;
use crate::ll::{self, LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlHandle};
use crate::stream::{ForeignStream, StreamScope};
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Owned result of [`Buffer::get_dispatch_layout`].
#[derive(Debug)]
pub struct DispatchLayout {
    /// `int32 [R]`.
    pub num_tokens_per_rank: Tensor,
    /// `int32 [E]`.
    pub num_tokens_per_expert: Tensor,
    /// `bool [T, R]`.
    pub is_token_in_rank: Tensor,
    /// `int32 [num_nodes]`: tokens per destination node (DeepEP's `num_tokens_per_rdma_rank`), on a buffer
    /// whose ranks span nodes; `None` on one node, as DeepEP's intranode layout.
    pub num_tokens_per_rdma_rank: Option<Tensor>,
}

impl DispatchLayout {
    /// Views to pass as [`Routing::Fresh`]'s layout.
    pub fn as_ref(&self) -> LayoutRef<'_> {
        LayoutRef {
            num_tokens_per_rank: self.num_tokens_per_rank.view(),
            num_tokens_per_expert: self.num_tokens_per_expert.view(),
            is_token_in_rank: self.is_token_in_rank.view(),
        }
    }
}

/// Owned result of [`Buffer::dispatch`].
pub struct DispatchResult {
    pub recv_x: Tensor,
    /// `float32 [N, H/128]` for FP8 dispatch.
    pub recv_x_scales: Option<Tensor>,
    pub recv_topk_idx: Option<Tensor>,
    pub recv_topk_weights: Option<Tensor>,
    /// Received tokens per local expert, rounded up to `expert_alignment` (empty in no-sync mode).
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// `int32 [R, R]`: DeepEP's `rank_prefix_matrix` ([`DispatchOutputs`]).
    pub rank_prefix_matrix: Tensor,
    /// `int32 [N]`: the source rank's token index of each received row ([`DispatchOutputs`]).
    pub recv_src_idx: Tensor,
    pub handle: HtHandle,
}

/// Owned result of [`Buffer::combine`].
pub struct CombineResult {
    pub combined_x: Tensor,
    pub combined_topk_weights: Option<Tensor>,
}

/// Owned result of [`Buffer::low_latency_dispatch`].
pub struct LlDispatchResult {
    /// `[E_local, R*T_max, H]`.
    pub recv_x: Tensor,
    /// Scales *stored* as `[E_local, packs, R*T_max]` (the transpose of the logical column-major
    /// `[E_local, R*T_max, packs]`).
    pub recv_x_scales: Option<Tensor>,
    /// `int32 [E_local]`.
    pub recv_count: Tensor,
    /// `int32 [E_local, R*T_max]`: DeepEP's `src_info` ([`LlDispatchOutputs`]).
    pub src_info: Tensor,
    /// `int64 [E_local, R]`: DeepEP's `layout_range` ([`LlDispatchOutputs`]).
    pub layout_range: Tensor,
    pub handle: LlHandle,
}

/// A CUDA graph of buffer operations, captured and replayed by the pipelines of [`crate::graph`], which own
/// everything it uses.
pub(crate) struct CapturedGraph {
    buffer_id: u64,
    exec: moelink_cuda::GraphExec,
}

/// The receive phase of a low-latency call made with `return_recv_hook`. Run it with
/// [`Buffer::run_hook`]; until then the outputs it will write stay borrowed.
pub struct RecvHook<'a> {
    buffer_id: u64,
    pending: PendingRecv<'a>,
}

/// One rank's endpoint of the expert-parallel collectives. Every rank of the group creates one, and all
/// ranks call the same operations in the same order.
pub struct Buffer {
    group: Arc<dyn Group>,
    id: u64,
    options: BufferOptions,
    backend: Box<dyn Backend>,
    poisoned: Option<String>,
    /// Collective calls started so far ([`Buffer::begin_call`]).
    calls: u64,
    /// Across nodes, high-throughput calls have written the RDMA region the low-latency calls use (DeepEP's
    /// rule: the two share `num_rdma_bytes`) since the last `clean_low_latency_buffer`.
    ll_region_dirty: bool,
}

impl Buffer {
    /// Creates this rank's buffer (collective: every rank of `group` must call it).
    ///
    /// ```
    /// use moelink::{group::run_ranks, Buffer, BufferOptions, BackendKind};
    /// let ok = run_ranks(2, |g| {
    ///     let buf = Buffer::new(std::sync::Arc::new(g), BufferOptions { backend: BackendKind::Host, ..Default::default() })?;
    ///     Ok(buf.num_ranks())
    /// });
    /// assert!(ok.iter().all(|r| matches!(r, Ok(2))));
    /// ```
    pub fn new(group: Arc<dyn Group>, options: BufferOptions) -> Result<Buffer> {
        let rank = group.rank();
        if group.size() == 0 || rank >= group.size() {
            return Err(Error::invalid("group", rank, format!("rank {rank} of {} ranks", group.size())));
        }
        if options.timeout_ms == 0 || options.timeout_ms > crate::config::MAX_TIMEOUT_MS {
            return Err(Error::invalid(
                "timeout_ms",
                rank,
                format!("{} ms: a deadline must be between 1 ms and {} ms (one day)", options.timeout_ms, crate::config::MAX_TIMEOUT_MS),
            ));
        }
        // Which node each rank is on: given, or the launcher's layout (collective: every rank detects).
        let topology = match options.topology {
            Some(t) => t,
            None => Topology::detect_within(group.as_ref(), std::time::Duration::from_millis(options.timeout_ms))?,
        };
        topology.validate(group.size(), rank)?;
        // Checked on one node too (where they are unused), so a bad value fails before a job spans nodes.
        options.rdma.validate(rank)?;
        let options = BufferOptions { topology: Some(topology), ..options };
        let backend = backend::new(group.clone(), &options)?;
        let id = NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed) ^ (crate::group::process_key() << 20);
        Ok(Buffer { group, id, options, backend, poisoned: None, calls: 0, ll_region_dirty: false })
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }
    pub fn num_ranks(&self) -> usize {
        self.group.size()
    }
    pub fn group(&self) -> &Arc<dyn Group> {
        &self.group
    }
    pub fn options(&self) -> &BufferOptions {
        &self.options
    }
    /// How the ranks map onto nodes (given in the options, or detected from the hosts the ranks run on).
    pub fn topology(&self) -> Topology {
        self.options.topology.unwrap_or_else(|| Topology::single_node(self.num_ranks()))
    }
    /// `"host"` or `"cuda"`.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }
    /// Where this buffer's tensors must live.
    pub fn location(&self) -> Location {
        self.backend.location()
    }
    /// The SM count high-throughput kernels use by default.
    pub fn default_num_sms(&self) -> usize {
        self.backend.default_num_sms()
    }
    /// The most SMs a high-throughput call may use (`Config::num_sms`): on the CUDA backend this rank's
    /// share of its GPU — all of its SMs, or an equal part when ranks of this process share the GPU (their
    /// kernels wait for each other, so they must all be resident at once); `usize::MAX` on the host.
    pub fn max_num_sms(&self) -> usize {
        self.backend.max_num_sms()
    }
    /// Why the buffer refuses work, if it does.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.as_deref()
    }

    /// Allocates a tensor on this buffer's location (host or its GPU); contents unspecified.
    pub fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        self.backend.alloc(dtype, shape)
    }

    /// [`Buffer::alloc`] for an output whose size comes from argument `arg`: a size the machine cannot hold
    /// is an error naming `arg` and the bytes needed, before anything is allocated.
    fn alloc_for(&self, arg: &'static str, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        self.alloc(dtype, shape).map_err(|e| match e {
            Error::InvalidArgument { arg: "shape", reason, .. } => Error::invalid(arg, self.rank(), format!("the output {reason}")),
            other => other,
        })
    }

    /// Copies `t` to this buffer's location (e.g. host inputs to the buffer's GPU).
    pub fn upload(&self, t: &Tensor) -> Result<Tensor> {
        self.backend.upload(t)
    }

    fn facts(&self) -> BufferFacts {
        BufferFacts {
            buffer_id: self.id,
            rank: self.rank(),
            num_ranks: self.num_ranks(),
            location: self.backend.location(),
            default_num_sms: self.backend.default_num_sms(),
            max_num_sms: self.backend.max_num_sms(),
            num_rdma_bytes: self.options.num_rdma_bytes,
            low_latency_mode: self.options.low_latency_mode,
        }
    }

    /// Marks the start of a collective call. Every collective method of this type calls it once, first, so
    /// that a call one rank refuses (its own bad input) still counts there: the host backend tags its
    /// exchanges with the count, and the peers of a rank that went on to its next call then time out naming
    /// it instead of pairing that call's exchanges with the current ones. A layer above this API that can
    /// refuse a call before reaching the buffer (the Python package) calls it at the start of each of its
    /// collective operations as well; the count only has to advance the same way on every rank when no
    /// rank fails.
    pub fn begin_call(&mut self) {
        self.calls += 1;
        self.backend.begin_call(self.calls);
    }

    fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(cause) => Err(Error::Poisoned { rank: self.rank(), cause: cause.clone() }),
            None => Ok(()),
        }
    }

    /// Runs a backend step; an error inside a collective poisons the buffer.
    fn step<T>(&mut self, f: impl FnOnce(&mut dyn Backend) -> Result<T>) -> Result<T> {
        self.check_usable()?;
        let r = f(self.backend.as_mut());
        if let Err(e) = &r {
            if e.poisons_buffer() {
                self.poisoned = Some(e.to_string());
                self.backend.poison();
            }
        }
        r
    }

    /// CUDA backend: runs the operations `f` issues on `stream` (a stream of this buffer's GPU) instead of
    /// the buffer's own, each returning as soon as it is enqueued, and waits for all of them (bounded by the
    /// buffer's deadline) before returning `f`'s result; a kernel error of any of them is the result then.
    /// Host backend: `f` runs as usual (every operation completes before it returns).
    ///
    /// The scope lets work overlap with the host and with other streams without giving up safety: the
    /// tensors, handles and pipelines an operation in the scope uses are borrowed for the whole call
    /// (`'env`), so none of them can be dropped, written or reused while the GPU may still use it.
    /// Results a call allocates (`dispatch`, `combine`, ...) are not available in the scope: allocate
    /// outputs before and use the `_into` forms. One stream at a time: scopes do not nest.
    ///
    /// ```no_run
    /// # fn demo(buf: &mut moelink::Buffer, stream: &moelink_cuda::Stream, pipeline: &moelink::graph::LlGraph) -> moelink::Result<()> {
    /// buf.on_stream(stream, |scope| {
    ///     scope.replay(pipeline)?; // enqueued on `stream`; the host goes on at once
    ///     scope.replay(pipeline)
    /// })?; // both replays have finished here
    /// # Ok(()) }
    /// ```
    pub fn on_stream<'env, T>(
        &mut self,
        stream: &moelink_cuda::Stream,
        f: impl for<'b> FnOnce(&mut StreamScope<'b, 'env>) -> Result<T>,
    ) -> Result<T> {
        self.check_usable()?;
        self.backend.bind_stream(BoundStream::Owned(stream.clone()))?;
        // The stream's work is waited for however `f` ends, a panic included: the borrows it uses end here.
        let value = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut StreamScope::new(self))));
        let waited = self.backend.unbind_stream(true);
        if let Err(e) = &waited {
            if e.poisons_buffer() && self.poisoned.is_none() {
                self.poisoned = Some(e.to_string());
                self.backend.poison();
            }
        }
        let value = value.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
        waited?;
        Ok(value)
    }

    /// As [`Buffer::on_stream`] for a stream from outside Rust (torch's current stream, from the Python
    /// layer), whose work the caller keeps alive ([`ForeignStream::from_raw`]): `f` gets the whole buffer,
    /// every operation returns once enqueued, and nothing waits for them; a kernel error surfaces at a later
    /// call. Host backend: `f` runs as usual.
    pub fn on_foreign_stream<T>(&mut self, stream: &ForeignStream, f: impl FnOnce(&mut Buffer) -> Result<T>) -> Result<T> {
        self.check_usable()?;
        self.backend.bind_stream(BoundStream::Foreign(*stream))?;
        let value = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self)));
        self.backend.unbind_stream(false)?;
        value.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// Starts recording this buffer's operations into a CUDA graph (CUDA backend; see [`crate::graph`]).
    pub(crate) fn begin_capture(&mut self) -> Result<()> {
        self.check_usable()?;
        self.backend.begin_capture()
    }

    /// Ends the recording [`Buffer::begin_capture`] started and instantiates the graph.
    pub(crate) fn end_capture(&mut self) -> Result<CapturedGraph> {
        let exec = self.backend.end_capture()?;
        Ok(CapturedGraph { buffer_id: self.id, exec })
    }

    /// Runs a captured graph (collective: every rank replays its graph); in the default synchronous mode it
    /// returns when the graph has finished, with any kernel error. Only the pipelines of [`crate::graph`]
    /// call it: they own everything their graphs use.
    pub(crate) fn replay_graph(&mut self, graph: &CapturedGraph) -> Result<()> {
        self.begin_call();
        if graph.buffer_id != self.id {
            return Err(Error::invalid("graph", self.rank(), "the graph was captured on another buffer"));
        }
        self.step(|b| b.replay(&graph.exec))
    }

    /// Runs `f` and measures how long the operations it issues on this buffer take; returns `f`'s result and
    /// the time in microseconds (collective: every rank times the same operations).
    ///
    /// CUDA backend: enqueues on the operation stream a barrier of all ranks' GPUs, a 128 MiB memset of
    /// scratch memory (it evicts the L2 cache, as DeepEP's and Triton's benchmarks do) and a timing event,
    /// runs `f`, records a second event right after the kernels of the last operation `f` issues (in the
    /// default synchronous mode before the host waits for them; with a caller's stream after `f` returns),
    /// waits for it and returns the device time between the two events. The ranks' regions so start together
    /// on the devices, the launches `f` enqueues while the barrier and the memset run stay out of the time,
    /// and so does the host's polling for completion; host work between operations inside `f` (the count
    /// exchange of a CPU-synchronised dispatch) is included, as on a real step. The events and the scratch
    /// memory are allocated once per buffer and reused. Not while a graph capture runs.
    ///
    /// Host backend: a barrier of all ranks, then the wall clock around `f`.
    ///
    /// ```
    /// use moelink::{group::run_ranks, Buffer, BufferOptions, BackendKind};
    /// let out = run_ranks(2, |g| {
    ///     let mut buf = Buffer::new(std::sync::Arc::new(g), BufferOptions { backend: BackendKind::Host, ..Default::default() })?;
    ///     let (rank, us) = buf.timed(|b| Ok(b.rank()))?;
    ///     Ok((rank, us >= 0.0, buf.timer_name()))
    /// });
    /// assert!(out.iter().all(|r| matches!(r, Ok((_, true, "wall")))));
    /// ```
    pub fn timed<T>(&mut self, f: impl FnOnce(&mut Buffer) -> Result<T>) -> Result<(T, f64)> {
        timed_region(self, |b| b, f)
    }

    /// What [`Buffer::timed`] measures on this buffer: `"cuda-events"` (device time between CUDA events) or
    /// `"wall"` (host clock).
    pub fn timer_name(&self) -> &'static str {
        self.backend.timer_name()
    }

    /// The kernel timing traces this buffer recorded ([`BufferOptions::kernel_tracing`](crate::BufferOptions),
    /// CUDA backend) since its last [`Buffer::timed`] region opened, in start order: each launch's span —
    /// what a profiler reports as the kernel's duration, without the launch — and when its blocks (or the
    /// high-throughput roles' warps) passed each point. Low-latency: up to 16 calls of each kind;
    /// high-throughput: synchronous calls, the last 256. Empty when tracing is off and on the host backend.
    pub fn kernel_traces(&self) -> Vec<crate::trace::KernelTrace> {
        self.backend.kernel_traces()
    }

    /// `num_nvl_bytes` a buffer needs for high-throughput calls of up to `num_tokens` tokens per rank (the
    /// largest count of any rank) of `hidden` channels with `topk` experts per token among `num_ranks` ranks,
    /// dispatched as FP8 (`fp8`) or BF16, including the BF16 combine and a cached BF16 dispatch (backward).
    ///
    /// ```
    /// let bytes = moelink::Buffer::ht_bytes_needed(4096, 7168, 8, 4, false);
    /// assert!(bytes > 4 * 4096 * 7168 * 2 * 2 && bytes < 480 << 20);
    /// ```
    pub fn ht_bytes_needed(num_tokens: usize, hidden: usize, topk: usize, num_ranks: usize, fp8: bool) -> usize {
        use moelink_kernels::ht::{bytes_needed, combine_row_bytes, dispatch_row_bytes};
        let rows = [dispatch_row_bytes(hidden, fp8, topk), dispatch_row_bytes(hidden, false, 0), combine_row_bytes(hidden, topk)];
        bytes_needed(num_tokens, num_ranks, &rows)
    }

    /// Waits for every rank (collective).
    pub fn barrier(&mut self) -> Result<()> {
        self.begin_call();
        self.step(|b| b.barrier())
    }

    /// Bytes of `num_rdma_bytes` that low-latency calls of this shape need on the CUDA backend, zero-copy
    /// combine included, for top-k up to 16 (DeepEP's `get_low_latency_rdma_size_hint`), whether the ranks
    /// share one node or span several (the larger of the two layouts). A call that does not fit fails with
    /// [`Error::BufferTooSmall`] before any launch.
    ///
    /// ```
    /// let bytes = moelink::Buffer::ll_bytes_needed(128, 7168, 4, 288);
    /// assert!(bytes > 128 * 7168 * 2 * 4 && bytes < 1 << 30);
    /// ```
    pub fn ll_bytes_needed(num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_ranks: usize, num_experts: usize) -> usize {
        let single = backend::cuda::intranode::ll::bytes_needed(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts);
        let across = backend::cuda::internode::ll::bytes_needed(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts);
        single.max(across)
    }

    // ------------------------------------------------------------------ high-throughput

    /// Computes `num_tokens_per_rank`, `num_tokens_per_expert` and `is_token_in_rank` from `topk_idx`
    /// (`int64 [T, K]`, `-1` = no expert). Local, not collective.
    pub fn get_dispatch_layout(&mut self, topk_idx: TensorRef<'_>, num_experts: usize) -> Result<DispatchLayout> {
        let (t, _) = ht::validate_layout(&topk_idx, num_experts, &self.facts())?;
        let r = self.num_ranks();
        let mut out = DispatchLayout {
            num_tokens_per_rank: self.alloc(DType::I32, &[r])?,
            num_tokens_per_expert: self.alloc_for("num_experts", DType::I32, &[num_experts])?,
            is_token_in_rank: self.alloc_for("topk_idx", DType::Bool, &[t, r])?,
            num_tokens_per_rdma_rank: match self.topology() {
                t if t.is_internode() => Some(self.alloc(DType::I32, &[t.num_nodes])?),
                _ => None,
            },
        };
        let views = LayoutOutputs {
            num_tokens_per_rdma_rank: out.num_tokens_per_rdma_rank.as_mut().map(|t| t.view_mut()),
            num_tokens_per_rank: out.num_tokens_per_rank.view_mut(),
            num_tokens_per_expert: out.num_tokens_per_expert.view_mut(),
            is_token_in_rank: out.is_token_in_rank.view_mut(),
        };
        self.step(|b| b.dispatch_layout(&topk_idx, num_experts, views))?;
        Ok(out)
    }

    /// As [`Buffer::get_dispatch_layout`], writing into caller-provided tensors.
    pub fn get_dispatch_layout_into(&mut self, topk_idx: TensorRef<'_>, num_experts: usize, out: LayoutOutputs<'_>) -> Result<()> {
        let f = self.facts();
        let (t, _) = ht::validate_layout(&topk_idx, num_experts, &f)?;
        let r = f.num_ranks;
        let expect = |arg, dtype, shape: &[usize], v: &TensorMut<'_>| {
            crate::validate::Expect {
                arg,
                rank: f.rank,
                location: f.location,
                dtypes: &[dtype],
                shape: &shape.iter().map(|&d| Some(d)).collect::<Vec<_>>(),
                contiguous: true,
            }
            .view_mut(v)
            .map(|_| ())
        };
        expect("num_tokens_per_rank", DType::I32, &[r], &out.num_tokens_per_rank)?;
        expect("num_tokens_per_expert", DType::I32, &[num_experts], &out.num_tokens_per_expert)?;
        expect("is_token_in_rank", DType::Bool, &[t, r], &out.is_token_in_rank)?;
        if let Some(v) = &out.num_tokens_per_rdma_rank {
            expect("num_tokens_per_rdma_rank", DType::I32, &[self.topology().num_nodes], v)?;
        }
        self.step(|b| b.dispatch_layout(&topk_idx, num_experts, out))
    }

    /// Validates a dispatch and exchanges counts with the other ranks (collective). In CPU-sync mode the
    /// plan knows the output sizes; allocate outputs with them and call [`Buffer::dispatch_into`].
    pub fn prepare_dispatch(&mut self, args: &DispatchArgs<'_>) -> Result<DispatchPlan> {
        self.begin_call();
        let spec = ht::validate_dispatch(args, &self.facts())?;
        self.ht_uses_rdma_region();
        self.step(|b| b.prepare_dispatch(spec, args))
    }

    /// Moves the tokens (collective). `args` must be the ones the plan was prepared with.
    pub fn dispatch_into(&mut self, plan: DispatchPlan, args: &DispatchArgs<'_>, out: DispatchOutputs<'_>) -> Result<HtHandle> {
        self.begin_call();
        ht::validate_dispatch_outputs(&plan, &out, self.location(), self.topology().num_nodes)?;
        let spec = plan.spec;
        let done = self.step(|b| b.dispatch(plan, args, out))?;
        Ok(HtHandle {
            buffer_id: self.id,
            rank: spec.rank,
            num_tokens: spec.num_tokens,
            num_experts: spec.num_experts,
            num_recv_tokens: done.num_recv_tokens,
            num_worst_tokens: spec.num_worst_tokens,
            data: done.data,
        })
    }

    /// Dispatch with outputs allocated by moelink (collective).
    pub fn dispatch(&mut self, args: &DispatchArgs<'_>) -> Result<DispatchResult> {
        let plan = self.prepare_dispatch(args)?;
        let n = plan.num_recv_rows();
        let s = plan.spec;
        // The rows: num_worst_tokens in no-sync mode, else what the ranks' `x` send here.
        let arg = if s.num_worst_tokens > 0 { "num_worst_tokens" } else { "x" };
        let mut recv_x = self.alloc_for(arg, if s.fp8 { DType::Fp8E4M3 } else { DType::BF16 }, &[n, s.hidden])?;
        let mut recv_x_scales = if s.fp8 { Some(self.alloc_for(arg, DType::F32, &[n, s.num_scales()])?) } else { None };
        let (mut idx, mut w) = if s.has_topk {
            (Some(self.alloc_for(arg, DType::I64, &[n, s.topk])?), Some(self.alloc_for(arg, DType::F32, &[n, s.topk])?))
        } else {
            (None, None)
        };
        let per_expert = plan.num_recv_tokens_per_expert.clone();
        let mut rank_prefix_matrix = self.alloc(DType::I32, &[s.num_ranks, s.num_ranks])?;
        let mut recv_src_idx = self.alloc(DType::I32, &[n])?;
        let out = DispatchOutputs {
            recv_x: recv_x.view_mut(),
            recv_scales: recv_x_scales.as_mut().map(|t| t.view_mut()),
            recv_topk_idx: idx.as_mut().map(|t| t.view_mut()),
            recv_topk_weights: w.as_mut().map(|t| t.view_mut()),
            rank_prefix_matrix: Some(rank_prefix_matrix.view_mut()),
            recv_src_idx: Some(recv_src_idx.view_mut()),
            channels: None,
        };
        let handle = self.dispatch_into(plan, args, out)?;
        Ok(DispatchResult {
            recv_x,
            recv_x_scales,
            recv_topk_idx: idx,
            recv_topk_weights: w,
            num_recv_tokens_per_expert: per_expert,
            rank_prefix_matrix,
            recv_src_idx,
            handle,
        })
    }

    /// Sums expert outputs back onto the tokens' home ranks (collective).
    pub fn combine_into(&mut self, args: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()> {
        self.begin_call();
        self.combine_into_counted(args, out)
    }

    fn combine_into_counted(&mut self, args: &CombineArgs<'_>, out: CombineOutputs<'_>) -> Result<()> {
        let spec = ht::validate_combine(args, &self.facts())?;
        ht::validate_combine_outputs(&spec, &out, self.location())?;
        self.ht_uses_rdma_region();
        self.step(|b| b.combine(spec, args, out))
    }

    /// Combine with outputs allocated by moelink (collective).
    pub fn combine(&mut self, args: &CombineArgs<'_>) -> Result<CombineResult> {
        self.begin_call();
        let spec = ht::validate_combine(args, &self.facts())?;
        let mut combined_x = self.alloc(DType::BF16, &[spec.num_tokens, spec.hidden])?;
        let mut w = if spec.topk > 0 { Some(self.alloc(DType::F32, &[spec.num_tokens, spec.topk])?) } else { None };
        let out = CombineOutputs { combined_x: combined_x.view_mut(), combined_topk_weights: w.as_mut().map(|t| t.view_mut()) };
        self.combine_into_counted(args, out)?;
        Ok(CombineResult { combined_x, combined_topk_weights: w })
    }

    // ------------------------------------------------------------------ low-latency

    /// Low-latency dispatch into caller-provided outputs (collective). With `return_recv_hook`, only the
    /// send phase runs; the returned hook runs the receive phase.
    pub fn low_latency_dispatch_into<'a>(
        &mut self,
        args: &LlDispatchArgs<'_>,
        out: LlDispatchOutputs<'a>,
    ) -> Result<(LlHandle, Option<RecvHook<'a>>)> {
        self.begin_call();
        self.low_latency_dispatch_into_counted(args, out)
    }

    fn low_latency_dispatch_into_counted<'a>(
        &mut self,
        args: &LlDispatchArgs<'_>,
        out: LlDispatchOutputs<'a>,
    ) -> Result<(LlHandle, Option<RecvHook<'a>>)> {
        self.check_ll_region_clean()?;
        let spec = ll::validate_ll_dispatch(args, &self.facts())?;
        ll::validate_ll_dispatch_outputs(&spec, &out, self.location())?;
        let id = self.id;
        let (data, pending) = self.step(|b| b.ll_dispatch(spec, args, out))?;
        Ok((LlHandle { buffer_id: id, spec, data }, pending.map(|pending| RecvHook { buffer_id: id, pending })))
    }

    /// Low-latency dispatch with outputs allocated by moelink (collective; no receive hook).
    pub fn low_latency_dispatch(&mut self, args: &LlDispatchArgs<'_>) -> Result<LlDispatchResult> {
        self.begin_call();
        let spec = ll::validate_ll_dispatch(args, &self.facts())?;
        if args.return_recv_hook {
            return Err(Error::invalid(
                "return_recv_hook",
                spec.rank,
                "use low_latency_dispatch_into to keep the outputs borrowed until the hook runs",
            ));
        }
        let (el, rows, cols) = (spec.num_local_experts(), spec.rows_per_expert(), spec.num_scale_cols());
        let arg = "num_max_dispatch_tokens_per_rank";
        let mut recv_x = self.alloc_for(arg, if spec.quant.is_fp8() { DType::Fp8E4M3 } else { DType::BF16 }, &[el, rows, spec.hidden])?;
        let mut scales = match spec.quant {
            ll::LlQuant::Bf16 => None,
            ll::LlQuant::Fp8 { use_ue8m0, .. } => {
                Some(self.alloc_for(arg, if use_ue8m0 { DType::I32 } else { DType::F32 }, &[el, cols, rows])?)
            }
        };
        let mut recv_count = self.alloc(DType::I32, &[el])?;
        let mut src_info = self.alloc(DType::I32, &[el, rows])?;
        let mut layout_range = self.alloc(DType::I64, &[el, spec.num_ranks])?;
        let out = LlDispatchOutputs {
            recv_x: recv_x.view_mut(),
            recv_scales: match scales.as_mut() {
                Some(t) => Some(t.view_mut_strided(&[el, rows, cols], &[(cols * rows) as isize, 1, rows as isize])?),
                None => None,
            },
            recv_count: recv_count.view_mut(),
            cumulative_local_expert_recv_stats: None,
            dispatch_wait_recv_cost_stats: None,
            src_info: Some(src_info.view_mut()),
            layout_range: Some(layout_range.view_mut()),
        };
        let (handle, _) = self.low_latency_dispatch_into_counted(args, out)?;
        Ok(LlDispatchResult { recv_x, recv_x_scales: scales, recv_count, src_info, layout_range, handle })
    }

    /// Low-latency combine into caller-provided outputs (collective).
    pub fn low_latency_combine_into<'a>(&mut self, args: &LlCombineArgs<'_>, out: LlCombineOutputs<'a>) -> Result<Option<RecvHook<'a>>> {
        self.begin_call();
        self.low_latency_combine_into_counted(args, out)
    }

    fn low_latency_combine_into_counted<'a>(
        &mut self,
        args: &LlCombineArgs<'_>,
        out: LlCombineOutputs<'a>,
    ) -> Result<Option<RecvHook<'a>>> {
        let spec = ll::validate_ll_combine(args, &self.facts())?;
        ll::validate_ll_combine_outputs(&spec, &out, self.location())?;
        self.check_ll_region_clean()?;
        let id = self.id;
        let pending = self.step(|b| b.ll_combine(spec, args, out))?;
        Ok(pending.map(|pending| RecvHook { buffer_id: id, pending }))
    }

    /// Low-latency combine with the output allocated by moelink (collective; no receive hook).
    pub fn low_latency_combine(&mut self, args: &LlCombineArgs<'_>) -> Result<Tensor> {
        self.begin_call();
        let spec = ll::validate_ll_combine(args, &self.facts())?;
        if args.return_recv_hook {
            return Err(Error::invalid(
                "return_recv_hook",
                spec.ll.rank,
                "use low_latency_combine_into to keep the output borrowed until the hook runs",
            ));
        }
        let mut out = self.alloc(DType::BF16, &[spec.ll.num_tokens, spec.ll.hidden])?;
        self.low_latency_combine_into_counted(args, LlCombineOutputs { combined_x: out.view_mut(), combine_wait_recv_cost_stats: None })?;
        Ok(out)
    }

    /// Runs the receive phase of a call made with `return_recv_hook`.
    pub fn run_hook(&mut self, hook: RecvHook<'_>) -> Result<()> {
        self.begin_call();
        if hook.buffer_id != self.id {
            return Err(Error::invalid("hook", self.rank(), "the hook comes from another buffer"));
        }
        let rank = self.rank();
        self.step(|b| hook.pending.run(b.as_any_mut(), rank))
    }

    /// The send buffer of the next low-latency combine, `bf16 [E_local, R*T_max, H]`: write expert outputs
    /// there and combine with `zero_copy = true` to skip a copy.
    pub fn get_next_low_latency_combine_buffer(&mut self, handle: &LlHandle) -> Result<TensorMut<'_>> {
        if handle.buffer_id != self.id {
            return Err(Error::invalid("handle", self.rank(), "the handle comes from another buffer"));
        }
        self.check_usable()?;
        let spec = handle.spec;
        ll::check_ll_buffer(&self.facts(), &spec, true)?;
        self.backend.ll_next_combine_buffer(&spec)
    }

    /// Clears the low-latency buffers (collective), e.g. after switching between high-throughput and
    /// low-latency use of the same memory.
    pub fn clean_low_latency_buffer(&mut self, num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_experts: usize) -> Result<()> {
        self.begin_call();
        ht::check_num_experts(num_experts, &self.facts())?;
        ll::check_low_latency_mode(&self.facts())?;
        self.step(|b| b.clean_ll_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts))?;
        self.ll_region_dirty = false;
        Ok(())
    }

    /// Across nodes the high-throughput and low-latency calls share the RDMA region (`num_rdma_bytes`), as
    /// in DeepEP: a high-throughput call leaves it unfit for low-latency calls until
    /// `clean_low_latency_buffer`. Every rank makes the same calls, so every rank refuses alike.
    fn ht_uses_rdma_region(&mut self) {
        if self.topology().is_internode() {
            self.ll_region_dirty = true;
        }
    }

    fn check_ll_region_clean(&self) -> Result<()> {
        if self.ll_region_dirty {
            return Err(Error::invalid(
                "buffer",
                self.rank(),
                "high-throughput calls across nodes used the RDMA region the low-latency calls share (num_rdma_bytes); call \
                 clean_low_latency_buffer before low-latency calls (DeepEP requires the same)",
            ));
        }
        Ok(())
    }

    /// Shrink mode: marks `rank` as failed (`masked = true`) or healthy again.
    pub fn low_latency_update_mask_buffer(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.require_shrink("low_latency_update_mask_buffer")?;
        if rank >= self.num_ranks() {
            return Err(Error::invalid("rank", self.rank(), format!("{rank} is not a rank of this {}-rank group", self.num_ranks())));
        }
        self.backend.ll_set_mask(rank, masked)
    }

    /// Shrink mode: which ranks are masked.
    pub fn low_latency_query_mask_buffer(&mut self) -> Result<Vec<bool>> {
        self.require_shrink("low_latency_query_mask_buffer")?;
        self.backend.ll_mask()
    }

    /// Shrink mode: unmasks every rank.
    pub fn low_latency_clean_mask_buffer(&mut self) -> Result<()> {
        self.require_shrink("low_latency_clean_mask_buffer")?;
        self.backend.ll_clear_mask()
    }

    /// This rank's communication buffer as a 1-D `uint8` view (DeepEP's `get_local_buffer_tensor`): the
    /// high-throughput region, or the low-latency one with `use_rdma_buffer`. Writing it while an
    /// operation is in flight corrupts that operation. The host backend has none (`Unavailable`).
    pub fn local_buffer(&mut self, use_rdma_buffer: bool) -> Result<TensorMut<'_>> {
        self.check_usable()?;
        self.backend.local_buffer(use_rdma_buffer)
    }

    fn require_shrink(&self, what: &'static str) -> Result<()> {
        if !self.options.enable_shrink {
            return Err(Error::invalid("enable_shrink", self.rank(), format!("{what} needs a buffer created with enable_shrink = true")));
        }
        Ok(())
    }
}

impl Drop for Buffer {
    /// Dropping a buffer is collective on the CUDA backend: it waits until every rank's kernels are done
    /// before freeing the communication memory peers write into. Every rank takes part, poisoned or not, so
    /// that the ranks' group collectives stay paired (a healthy rank waiting here while a poisoned one moved on
    /// to its next collective broke the rebuild after a timeout, on 4xH200); with a dead peer the wait ends
    /// with the group's error or deadline, and a poisoned buffer keeps (leaks) its memory anyway.
    fn drop(&mut self) {
        let _ = self.backend.quiesce();
    }
}

/// [`Buffer::timed`] over any context that reaches the buffer (the buffer itself, or a [`StreamScope`]).
pub(crate) fn timed_region<C, T>(ctx: &mut C, buf: fn(&mut C) -> &mut Buffer, f: impl FnOnce(&mut C) -> Result<T>) -> Result<(T, f64)> {
    buf(ctx).begin_call();
    let device = buf(ctx).step(|b| b.timer_begin())?;
    let t0 = std::time::Instant::now();
    let value = match f(ctx) {
        Ok(v) => v,
        Err(e) => {
            buf(ctx).backend.timer_cancel();
            return Err(e);
        }
    };
    let wall_us = t0.elapsed().as_secs_f64() * 1e6;
    let us = if device { buf(ctx).step(|b| b.timer_end())? } else { wall_us };
    Ok((value, us))
}

/// Shorthand for a fresh dispatch's routing.
pub fn fresh<'a>(layout: &'a DispatchLayout, topk_idx: Option<TensorRef<'a>>, topk_weights: Option<TensorRef<'a>>) -> Routing<'a> {
    Routing::Fresh { layout: layout.as_ref(), topk_idx, topk_weights }
}
