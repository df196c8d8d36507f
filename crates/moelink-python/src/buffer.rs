//! `moelink._native.Buffer` and the objects its calls return (dispatch plans, handles, receive hooks).
//!
//! Every method mirrors a [`moelink::Buffer`] method. Tensor arguments are [`TensorArg`] tuples; outputs
//! are allocated by the caller. Long calls run with the GIL released (the buffer lock is taken after
//! releasing it, so a group callback that needs the GIL never waits on a thread that holds the lock and
//! waits for the GIL). Operations take an optional `stream`: a raw `CUstream` the CUDA backend enqueues on
//! (returning at once), or `None` for the buffer's own stream with the host waiting. The host backend
//! ignores it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use pyo3::prelude::*;

use moelink::{
    BackendKind, Buffer, BufferOptions, ChannelOutputs, CombineArgs, CombineOutputs, Config, DispatchArgs, DispatchOutputs, DispatchPlan,
    Error, ForeignStream, Group, HtHandle, KernelTracing, LayoutOutputs, LayoutRef, LlCombineArgs, LlCombineOutputs, LlDispatchArgs,
    LlDispatchOutputs, LlHandle, LlQuant, Location, Payload, RdmaOptions, RecvHook, Routing, TensorRef, Topology, Transport, Tuning,
};

use crate::errors::to_pyerr;
use crate::group::PyGroup;
use crate::tensor::{describe, opt_view, opt_view_mut, TensorArg, ViewTuple};

/// A tensor argument as Python passes it: a `torch.Tensor` or a description tuple ([`TensorArg::read`]).
type Obj<'py> = Bound<'py, PyAny>;
use crate::{config_from, ConfigTuple};

/// Identifies a `PyBuffer` so that plans, handles and hooks cannot cross buffers.
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// One rank's endpoint (`moelink::Buffer`). Collective calls must be made by every rank, in the same order.
#[pyclass(module = "moelink._native", name = "Buffer", frozen)]
pub(crate) struct PyBuffer {
    inner: Mutex<Option<Buffer>>,
    group: Arc<PyGroup>,
    uid: u64,
    rank: usize,
    num_ranks: usize,
    backend: &'static str,
    device: i64,
    default_num_sms: usize,
    topology: Topology,
    /// Collective calls begun ([`PyBuffer::begin_call`], or `begin_call=True`) but not yet counted by the
    /// core: they are counted under the buffer lock, first thing in the next call that takes it. Counting
    /// needs the lock, and the lock must not be taken while holding the GIL (see the module doc), so a call
    /// marks its start here before anything can refuse it, for the price of an atomic add.
    pending_calls: AtomicU64,
    /// Where the host time of the timed calls goes, while `set_host_timing(True)`.
    host_time: HostTime,
}

/// Host time of the calls that take tensors, split where the native module can see it: reading the tensor
/// arguments (attribute lookups on torch objects, under the GIL), the backend's work (with the GIL released:
/// the buffer lock, validation, kernel lookup, launch, and in synchronous mode the wait), and the rest (GIL
/// hand-back, results). Python's own work around the native call is the caller's total minus these.
#[derive(Default)]
struct HostTime {
    on: AtomicBool,
    /// Per operation: calls, reading ns, backend ns, rest ns, and of the backend's time the ns spent in the
    /// driver's launch call and the launches.
    ops: Mutex<Vec<(&'static str, [u64; 6])>>,
}

impl HostTime {
    /// Starts timing one call (None while off).
    fn start(&self) -> Option<Instant> {
        self.on.load(Ordering::Relaxed).then(Instant::now)
    }

    fn record(&self, op: &'static str, started: Instant, read_done: Instant, backend_ns: u64) {
        let total = started.elapsed().as_nanos() as u64;
        let read = read_done.duration_since(started).as_nanos() as u64;
        // The driver's launch time on this thread since the previous record (host timing runs on one thread).
        let (launches, launch_ns) = moelink_cuda::launch_timing::take();
        if let Ok(mut ops) = self.ops.lock() {
            let sample = [1, read, backend_ns, total.saturating_sub(read + backend_ns), launch_ns, launches];
            match ops.iter_mut().find(|(name, _)| *name == op) {
                Some((_, sums)) => sums.iter_mut().zip(sample).for_each(|(s, v)| *s += v),
                None => ops.push((op, sample)),
            }
        }
    }
}

/// The arguments of a dispatch, kept between `prepare_dispatch` and `dispatch_into`.
struct HtCall {
    x: Payload<'static>,
    routing: StoredRouting,
    expert_alignment: usize,
    num_worst_tokens: usize,
    config: Option<Config>,
}

enum StoredRouting {
    Fresh(Box<FreshRouting>),
    Cached(HtHandle),
}

struct FreshRouting {
    layout: LayoutRef<'static>,
    topk_idx: Option<TensorRef<'static>>,
    topk_weights: Option<TensorRef<'static>>,
}

impl HtCall {
    fn args(&self) -> DispatchArgs<'_> {
        let routing = match &self.routing {
            StoredRouting::Fresh(f) => Routing::Fresh { layout: f.layout, topk_idx: f.topk_idx, topk_weights: f.topk_weights },
            StoredRouting::Cached(h) => Routing::Cached(h),
        };
        DispatchArgs {
            x: self.x,
            routing,
            expert_alignment: self.expert_alignment,
            num_worst_tokens: self.num_worst_tokens,
            config: self.config,
        }
    }
}

/// A validated dispatch whose counts have been exchanged: the sizes to allocate outputs with. Pass it
/// to `Buffer.dispatch_into` once.
#[pyclass(module = "moelink._native", name = "DispatchPlan", frozen)]
pub(crate) struct PyDispatchPlan {
    state: Mutex<Option<(DispatchPlan, HtCall)>>,
    buffer_uid: u64,
    /// Rows every output must have (received tokens, or `num_worst_tokens`).
    #[pyo3(get)]
    num_recv_rows: usize,
    /// Tokens received, when known on the host (None in no-sync mode).
    #[pyo3(get)]
    num_recv_tokens: Option<usize>,
    /// Received tokens per local expert, aligned (empty in no-sync mode).
    #[pyo3(get)]
    num_recv_tokens_per_expert: Vec<usize>,
    #[pyo3(get)]
    hidden: usize,
    /// Top-k width of the routing outputs (0 without top-k).
    #[pyo3(get)]
    topk: usize,
    #[pyo3(get)]
    is_fp8: bool,
    /// Whether `recv_topk_idx`/`recv_topk_weights` outputs are expected.
    #[pyo3(get)]
    has_topk: bool,
}

/// The routing of one high-throughput dispatch (for `combine` and cached dispatch).
#[pyclass(module = "moelink._native", name = "HtHandle", frozen)]
pub(crate) struct PyHtHandle {
    inner: HtHandle,
    buffer_uid: u64,
}

#[pymethods]
impl PyHtHandle {
    /// Tokens this rank dispatched.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    /// Tokens this rank received, when known on the host.
    #[getter]
    fn num_recv_tokens(&self) -> Option<usize> {
        self.inner.num_recv_tokens()
    }
    /// Rows of the received tensors.
    #[getter]
    fn num_recv_rows(&self) -> usize {
        self.inner.num_recv_rows()
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }
}

/// The routing of one low-latency dispatch (for `low_latency_combine`).
#[pyclass(module = "moelink._native", name = "LlHandle", frozen)]
pub(crate) struct PyLlHandle {
    inner: LlHandle,
    buffer_uid: u64,
}

#[pymethods]
impl PyLlHandle {
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.num_tokens()
    }
    #[getter]
    fn hidden(&self) -> usize {
        self.inner.hidden()
    }
    #[getter]
    fn num_max_dispatch_tokens_per_rank(&self) -> usize {
        self.inner.num_max_dispatch_tokens_per_rank()
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }
    /// True when dispatch carried `topk_weights` (combine pre-reduces on the expert side).
    #[getter]
    fn pre_reduced(&self) -> bool {
        self.inner.pre_reduced()
    }
}

/// The receive phase of a low-latency call made with `return_recv_hook=True`; run it with
/// `Buffer.run_hook` (once).
#[pyclass(module = "moelink._native", name = "RecvHook", frozen)]
pub(crate) struct PyRecvHook {
    inner: Mutex<Option<RecvHook<'static>>>,
    buffer_uid: u64,
}

#[pymethods]
impl PyRecvHook {
    /// True until the hook has run.
    #[getter]
    fn pending(&self) -> bool {
        self.inner.lock().map(|h| h.is_some()).unwrap_or(false)
    }
}

fn invalid(py: Python<'_>, arg: &'static str, rank: usize, reason: impl Into<String>) -> PyErr {
    to_pyerr(py, Error::invalid(arg, rank, reason), None)
}

fn required<T>(py: Python<'_>, v: Option<T>, arg: &'static str, rank: usize, why: &str) -> PyResult<T> {
    v.ok_or_else(|| invalid(py, arg, rank, format!("is required {why}")))
}

impl PyBuffer {
    /// Runs `f` on the buffer with the GIL released; on the raw stream `stream` (returning once enqueued) when
    /// the call has one, else on the buffer's own stream (returning when done).
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        stream: Option<Option<u64>>,
        f: impl FnOnce(&mut Buffer) -> moelink::Result<T> + Send,
    ) -> PyResult<T> {
        self.run_timed(py, stream, None, f)
    }

    /// [`PyBuffer::run`] for a call that began at `started` (host timing on) as operation `op`.
    fn run_timed<T: Send>(
        &self,
        py: Python<'_>,
        stream: Option<Option<u64>>,
        started: Option<(&'static str, Instant)>,
        f: impl FnOnce(&mut Buffer) -> moelink::Result<T> + Send,
    ) -> PyResult<T> {
        // The clock is read only while host timing is on (`started`).
        let read_done = started.map(|_| Instant::now());
        let _stale = self.group.take_error();
        let rank = self.rank;
        let mut backend_ns = 0u64;
        let r = py.detach(|| {
            let entered = read_done.map(|_| Instant::now());
            let r = self.run_backend(rank, stream, f);
            backend_ns = entered.map_or(0, |t| t.elapsed().as_nanos() as u64);
            r
        });
        let out = r.map_err(|e| to_pyerr(py, e, self.group.take_error()));
        if let (Some((op, t0)), Some(read_done)) = (started, read_done) {
            self.host_time.record(op, t0, read_done, backend_ns);
        }
        out
    }

    fn run_backend<T: Send>(
        &self,
        rank: usize,
        stream: Option<Option<u64>>,
        f: impl FnOnce(&mut Buffer) -> moelink::Result<T> + Send,
    ) -> moelink::Result<T> {
        let mut guard = self.inner.lock().map_err(|_| Error::Poisoned { rank, cause: "a previous call panicked".into() })?;
        let buf = guard.as_mut().ok_or_else(|| Error::Unavailable(format!("the buffer on rank {rank} was destroyed")))?;
        for _ in 0..self.pending_calls.swap(0, Ordering::AcqRel) {
            buf.begin_call();
        }
        match stream.flatten() {
            Some(raw) => {
                // SAFETY: the package passes the handle of a live torch stream of this buffer's device
                // (`torch.cuda.Stream.cuda_stream`: the comm stream the Python Buffer keeps, or the
                // current stream), which outlives the buffer's use of it; it keeps every tensor of an
                // asynchronous operation alive until the stream work completes (EventOverlap's extra
                // tensors, `record_stream`).
                let foreign = unsafe { ForeignStream::from_raw(raw) };
                buf.on_foreign_stream(&foreign, f)
            }
            None => f(buf),
        }
    }

    fn check_uid(&self, py: Python<'_>, uid: u64, arg: &'static str) -> PyResult<()> {
        if uid != self.uid {
            return Err(invalid(py, arg, self.rank, "comes from another buffer"));
        }
        Ok(())
    }

    fn hook(&self, hook: Option<RecvHook<'static>>) -> Option<PyRecvHook> {
        hook.map(|h| PyRecvHook { inner: Mutex::new(Some(h)), buffer_uid: self.uid })
    }

    /// Marks the start of a collective call when `begin` (see `pending_calls`).
    fn mark_call(&self, begin: bool) {
        if begin {
            self.pending_calls.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Tensor argument `arg` ([`TensorArg::read`]).
    fn arg(&self, obj: &Obj<'_>, arg: &'static str) -> PyResult<TensorArg> {
        TensorArg::read(obj, arg, self.rank, self.device)
    }

    /// Optional tensor argument `arg` (absent or None: `None`).
    fn opt_arg(&self, obj: Option<&Obj<'_>>, arg: &'static str) -> PyResult<Option<TensorArg>> {
        TensorArg::read_opt(obj, arg, self.rank, self.device)
    }

    /// The arguments of a dispatch, read and kept for `prepare_dispatch` and `dispatch_into`.
    #[allow(clippy::too_many_arguments)]
    fn ht_call(
        &self,
        py: Python<'_>,
        x: &Obj<'_>,
        x_scales: Option<&Obj<'_>>,
        handle: Option<&Obj<'_>>,
        num_tokens_per_rank: Option<&Obj<'_>>,
        num_tokens_per_expert: Option<&Obj<'_>>,
        is_token_in_rank: Option<&Obj<'_>>,
        topk_idx: Option<&Obj<'_>>,
        topk_weights: Option<&Obj<'_>>,
        expert_alignment: usize,
        num_worst_tokens: usize,
        config: Option<ConfigTuple>,
    ) -> PyResult<HtCall> {
        let r = self.rank;
        let xv = self.arg(x, "x")?.view(py, "x", r)?;
        let payload = match opt_view(py, &self.opt_arg(x_scales, "x_scales")?, "x_scales", r)? {
            Some(scales) => Payload::Fp8 { x: xv, scales },
            None => Payload::Bf16(xv),
        };
        let topk_idx = self.opt_arg(topk_idx, "topk_idx")?;
        let topk_weights = self.opt_arg(topk_weights, "topk_weights")?;
        let routing = match handle.filter(|h| !h.is_none()) {
            Some(h) => {
                let h = h
                    .cast::<PyHtHandle>()
                    .map_err(|_| crate::errors::type_error(py, "handle", r, "expected the native handle of a dispatch".to_string()))?;
                let h = h.get();
                self.check_uid(py, h.buffer_uid, "handle")?;
                for (arg, given) in [("topk_idx", topk_idx.is_some()), ("topk_weights", topk_weights.is_some())] {
                    if given {
                        return Err(invalid(py, arg, r, "a cached dispatch (handle given) re-uses the handle's routing; pass no top-k"));
                    }
                }
                StoredRouting::Cached(h.inner.clone())
            }
            None => {
                let why = "for a fresh dispatch (or pass handle for a cached one)";
                let need = |obj: Option<&Obj<'_>>, arg: &'static str| -> PyResult<TensorRef<'static>> {
                    let view = opt_view(py, &self.opt_arg(obj, arg)?, arg, r)?;
                    required(py, view, arg, r, why)
                };
                let layout = LayoutRef {
                    num_tokens_per_rank: need(num_tokens_per_rank, "num_tokens_per_rank")?,
                    num_tokens_per_expert: need(num_tokens_per_expert, "num_tokens_per_expert")?,
                    is_token_in_rank: need(is_token_in_rank, "is_token_in_rank")?,
                };
                StoredRouting::Fresh(Box::new(FreshRouting {
                    layout,
                    topk_idx: opt_view(py, &topk_idx, "topk_idx", r)?,
                    topk_weights: opt_view(py, &topk_weights, "topk_weights", r)?,
                }))
            }
        };
        Ok(HtCall { x: payload, routing, expert_alignment, num_worst_tokens, config: config.map(config_from) })
    }

    /// The outputs of a dispatch from the tuple `(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
    /// rank_prefix_matrix, recv_src_idx, ...)` (None where not wanted; later elements are the caller's).
    fn dispatch_outputs(&self, py: Python<'_>, outputs: &Obj<'_>, channel_outputs: bool) -> PyResult<DispatchOutputs<'static>> {
        let r = self.rank;
        let item = |i: usize| outputs.get_item(i);
        let (x, scales, idx, w, prefix, src) = (item(0)?, item(1)?, item(2)?, item(3)?, item(4)?, item(5)?);
        let mut out = self.dispatch_outputs_of(py, &x, Some(&scales), Some(&idx), Some(&w), Some(&prefix), Some(&src))?;
        if channel_outputs {
            let required = |obj: &Obj<'_>, arg: &'static str| self.arg(obj, arg)?.view_mut(py, arg, r);
            out.channels = Some(ChannelOutputs {
                channel_prefix_matrix: required(&item(6)?, "channel_prefix_matrix")?,
                recv_channel_prefix_matrix: required(&item(7)?, "recv_channel_prefix_matrix")?,
                send_head: required(&item(8)?, "send_head")?,
            });
        }
        Ok(out)
    }

    /// Dispatch outputs from the caller's tensors (absent or None: not wanted), without DeepEP's channel elements.
    #[allow(clippy::too_many_arguments)]
    fn dispatch_outputs_of(
        &self,
        py: Python<'_>,
        recv_x: &Obj<'_>,
        recv_x_scales: Option<&Obj<'_>>,
        recv_topk_idx: Option<&Obj<'_>>,
        recv_topk_weights: Option<&Obj<'_>>,
        rank_prefix_matrix: Option<&Obj<'_>>,
        recv_src_idx: Option<&Obj<'_>>,
    ) -> PyResult<DispatchOutputs<'static>> {
        let r = self.rank;
        let optional = |obj: Option<&Obj<'_>>, arg: &'static str| opt_view_mut(py, &self.opt_arg(obj, arg)?, arg, r);
        Ok(DispatchOutputs {
            recv_x: self.arg(recv_x, "recv_x")?.view_mut(py, "recv_x", r)?,
            recv_scales: optional(recv_x_scales, "recv_x_scales")?,
            recv_topk_idx: optional(recv_topk_idx, "recv_topk_idx")?,
            recv_topk_weights: optional(recv_topk_weights, "recv_topk_weights")?,
            rank_prefix_matrix: optional(rank_prefix_matrix, "rank_prefix_matrix")?,
            recv_src_idx: optional(recv_src_idx, "recv_src_idx")?,
            channels: None,
        })
    }
}

#[pymethods]
impl PyBuffer {
    /// Creates this rank's buffer (collective). `group` implements `rank()`, `size()`,
    /// `all_gather(bytes) -> list[bytes]` and optionally `local_rank()`, `process_key()`.
    /// `backend`: `"auto"` (CUDA when usable, else host), `"host"` or `"cuda"`.
    /// Across nodes: `topology` (`"NODESxRANKS_PER_NODE"`, e.g. `"2x4"`; default: ranks grouped by host),
    /// `transport` (`"nvshmem"`, `"ptr"` or `"emu-nic"`; default `nvshmem`), `num_qps_per_rank`,
    /// `allow_nvlink_for_low_latency_mode`, and where NVSHMEM (`nvshmem_home`) and the CUDA headers
    /// (`cuda_home`) are.
    #[new]
    #[pyo3(signature = (group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=false, backend="auto", timeout_ms=10_000, device=None, enable_shrink=false, num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=true, topology=None, transport=None, nvshmem_home=None, cuda_home=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        group: &Bound<'_, PyAny>,
        num_nvl_bytes: usize,
        num_rdma_bytes: usize,
        low_latency_mode: bool,
        backend: &str,
        timeout_ms: u64,
        device: Option<usize>,
        enable_shrink: bool,
        num_qps_per_rank: usize,
        allow_nvlink_for_low_latency_mode: bool,
        topology: Option<&str>,
        transport: Option<&str>,
        nvshmem_home: Option<std::path::PathBuf>,
        cuda_home: Option<std::path::PathBuf>,
    ) -> PyResult<PyBuffer> {
        let group = Arc::new(PyGroup::new(group)?);
        let rank = group.rank();
        let kind =
            BackendKind::from_name(backend).ok_or_else(|| crate::errors::invalid_name(py, "backend", backend, BackendKind::NAMES))?;
        let topology = match topology {
            Some(t) => Some(t.parse::<Topology>().map_err(|e| invalid(py, "topology", rank, e))?),
            None => None,
        };
        let transport = match transport {
            Some(t) => t.parse::<Transport>().map_err(|e| invalid(py, "transport", rank, e))?,
            None => Transport::default(),
        };
        let rdma = RdmaOptions {
            transport,
            num_qps_per_rank,
            allow_nvlink_for_low_latency_mode,
            nvshmem_home,
            cuda_home,
            ..RdmaOptions::default()
        };
        // Tracing and tuning come from the environment (the variables of the `moelink` command); the
        // library itself reads none.
        let env = |k: &str| std::env::var(k).ok();
        let kernel_tracing = KernelTracing::from_vars(env).map_err(pyo3::exceptions::PyValueError::new_err)?;
        let tuning = Tuning::from_vars(env).map_err(pyo3::exceptions::PyValueError::new_err)?;
        // Every field is named today; the update keeps options added later at their defaults.
        #[allow(clippy::needless_update)]
        let options = BufferOptions {
            backend: kind,
            num_nvl_bytes,
            num_rdma_bytes,
            low_latency_mode,
            timeout_ms,
            device,
            enable_shrink,
            kernel_tracing,
            tuning,
            topology,
            rdma,
            ..BufferOptions::default()
        };
        let dyn_group: Arc<dyn Group> = group.clone();
        let buf = py.detach(|| Buffer::new(dyn_group, options)).map_err(|e| to_pyerr(py, e, group.take_error()))?;
        let device = match buf.location() {
            Location::Host => -1,
            Location::Cuda(d) => d as i64,
        };
        Ok(PyBuffer {
            rank,
            num_ranks: buf.num_ranks(),
            backend: buf.backend_name(),
            default_num_sms: buf.default_num_sms(),
            topology: buf.topology(),
            device,
            pending_calls: AtomicU64::new(0),
            host_time: HostTime::default(),
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            group,
            inner: Mutex::new(Some(buf)),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }
    #[getter]
    fn num_ranks(&self) -> usize {
        self.num_ranks
    }
    /// `"host"` or `"cuda"`.
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }
    /// `(num_nodes, ranks_per_node)` of the buffer's ranks.
    #[getter]
    fn topology(&self) -> (usize, usize) {
        (self.topology.num_nodes, self.topology.ranks_per_node)
    }
    /// The CUDA device index tensors must live on, or -1 for host memory.
    #[getter]
    fn device(&self) -> i64 {
        self.device
    }
    /// SMs high-throughput kernels use when no config is given.
    #[getter]
    fn default_num_sms(&self) -> usize {
        self.default_num_sms
    }
    /// The Python group object this buffer was created with.
    #[getter]
    fn group(&self, py: Python<'_>) -> Py<PyAny> {
        self.group.object().clone_ref(py)
    }
    /// Why the buffer refuses work (after a failed collective), or None.
    #[getter]
    fn poisoned(&self) -> Option<String> {
        self.inner.lock().ok()?.as_ref()?.poisoned().map(str::to_string)
    }
    /// True once `destroy()` was called.
    #[getter]
    fn destroyed(&self) -> bool {
        self.inner.lock().map(|b| b.is_none()).unwrap_or(true)
    }

    /// Releases the buffer's resources now; later calls raise `RuntimeError`.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            // A poisoned lock (a panicked call) still holds the buffer: release it all the same.
            let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            drop(guard.take());
        });
        Ok(())
    }

    /// Marks the start of one of the package's collective operations (`moelink::Buffer::begin_call`): a call
    /// the Python layer refuses before reaching this buffer still counts on this rank, so that its next call
    /// cannot pair its exchanges with the peers' current one. Not collective; never fails. The count is
    /// applied under the buffer lock at the start of the next call (operations that take `begin_call=True`
    /// mark their own start the same way, in the same native call).
    /// Host timing of the calls that take tensors (`low_latency_dispatch`, `low_latency_combine`,
    /// `get_dispatch_layout`, `dispatch`, `combine`), made on the calling thread: on or off; turning it on
    /// clears the sums.
    fn set_host_timing(&self, on: bool) {
        if let Ok(mut ops) = self.host_time.ops.lock() {
            ops.clear();
        }
        moelink_cuda::launch_timing::set_enabled(on);
        self.host_time.on.store(on, Ordering::Relaxed);
    }

    /// The sums since host timing was turned on: `{op: (calls, read_ns, backend_ns, rest_ns, launch_ns,
    /// launches)}` (see `set_host_timing`): reading the tensor arguments, the backend with the GIL released,
    /// the rest; and within the backend's time, the driver's launch calls (CUDA backend).
    #[allow(clippy::type_complexity)]
    fn host_times(&self) -> std::collections::HashMap<&'static str, (u64, u64, u64, u64, u64, u64)> {
        self.host_time
            .ops
            .lock()
            .map(|ops| ops.iter().map(|(op, s)| (*op, (s[0], s[1], s[2], s[3], s[4], s[5]))).collect())
            .unwrap_or_default()
    }

    fn begin_call(&self) {
        self.mark_call(true);
    }

    /// Waits for every rank (collective).
    #[pyo3(signature = (stream=None))]
    fn barrier(&self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        self.run(py, Some(stream), |b| b.barrier())
    }

    /// Writes the dispatch layout of `topk_idx` into the outputs (local, not collective). On a buffer whose
    /// ranks span nodes, `num_tokens_per_rdma_rank` (`int32 [num_nodes]`, optional) receives the tokens per
    /// destination node (a token counts once per node). Tensors are `torch.Tensor`s or description tuples
    /// (as in every method below).
    #[pyo3(signature = (topk_idx, num_experts, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, num_tokens_per_rdma_rank=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn get_dispatch_layout_into(
        &self,
        py: Python<'_>,
        topk_idx: &Obj<'_>,
        num_experts: usize,
        num_tokens_per_rank: &Obj<'_>,
        num_tokens_per_expert: &Obj<'_>,
        is_token_in_rank: &Obj<'_>,
        num_tokens_per_rdma_rank: Option<&Obj<'_>>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let started = self.host_time.start().map(|t| ("get_dispatch_layout", t));
        let r = self.rank;
        let topk_idx = self.arg(topk_idx, "topk_idx")?.view(py, "topk_idx", r)?;
        let out = LayoutOutputs {
            num_tokens_per_rdma_rank: opt_view_mut(
                py,
                &self.opt_arg(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank")?,
                "num_tokens_per_rdma_rank",
                r,
            )?,
            num_tokens_per_rank: self.arg(num_tokens_per_rank, "num_tokens_per_rank")?.view_mut(py, "num_tokens_per_rank", r)?,
            num_tokens_per_expert: self.arg(num_tokens_per_expert, "num_tokens_per_expert")?.view_mut(py, "num_tokens_per_expert", r)?,
            is_token_in_rank: self.arg(is_token_in_rank, "is_token_in_rank")?.view_mut(py, "is_token_in_rank", r)?,
        };
        self.run_timed(py, Some(stream), started, move |b| b.get_dispatch_layout_into(topk_idx, num_experts, out))
    }

    /// Validates a dispatch and exchanges counts (collective). Fresh dispatch: the three layout tensors
    /// (and optionally `topk_idx` with `topk_weights`); cached dispatch: `handle` and no layout or top-k.
    /// `x_scales` makes it an FP8 dispatch. `config`: `(num_sms, nvl send, nvl recv, rdma send, rdma recv)`.
    /// `begin_call`: this call marks the start of the package's collective operation itself (as
    /// `begin_call()` would, without a second native call).
    #[pyo3(signature = (x, x_scales=None, handle=None, num_tokens_per_rank=None, num_tokens_per_expert=None, is_token_in_rank=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None, stream=None, begin_call=false))]
    #[allow(clippy::too_many_arguments)]
    fn prepare_dispatch(
        &self,
        py: Python<'_>,
        x: &Obj<'_>,
        x_scales: Option<&Obj<'_>>,
        handle: Option<&Obj<'_>>,
        num_tokens_per_rank: Option<&Obj<'_>>,
        num_tokens_per_expert: Option<&Obj<'_>>,
        is_token_in_rank: Option<&Obj<'_>>,
        topk_idx: Option<&Obj<'_>>,
        topk_weights: Option<&Obj<'_>>,
        expert_alignment: usize,
        num_worst_tokens: usize,
        config: Option<ConfigTuple>,
        stream: Option<u64>,
        begin_call: bool,
    ) -> PyResult<PyDispatchPlan> {
        self.mark_call(begin_call);
        let call = self.ht_call(
            py,
            x,
            x_scales,
            handle,
            num_tokens_per_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
            config,
        )?;
        let (plan, call) = self.run(py, Some(stream), move |b| {
            let plan = b.prepare_dispatch(&call.args())?;
            Ok((plan, call))
        })?;
        Ok(PyDispatchPlan {
            buffer_uid: self.uid,
            num_recv_rows: plan.num_recv_rows(),
            num_recv_tokens: plan.num_recv_tokens(),
            num_recv_tokens_per_expert: plan.num_recv_tokens_per_expert().to_vec(),
            hidden: plan.hidden(),
            topk: plan.topk(),
            is_fp8: plan.is_fp8(),
            has_topk: plan.has_topk(),
            state: Mutex::new(Some((plan, call))),
        })
    }

    /// Moves the tokens of a prepared dispatch into the outputs (collective); returns the handle. The
    /// optional handle outputs (DeepEP's): `rank_prefix_matrix` (`int32 [R, R]`, `[i][j]` = tokens rank `j`
    /// receives from ranks `0..=i`) and `recv_src_idx` (`int32 [num_recv_rows]`, the source rank's token
    /// index of each received row).
    #[pyo3(signature = (plan, recv_x, recv_x_scales=None, recv_topk_idx=None, recv_topk_weights=None, rank_prefix_matrix=None, recv_src_idx=None, stream=None))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch_into(
        &self,
        py: Python<'_>,
        plan: &PyDispatchPlan,
        recv_x: &Obj<'_>,
        recv_x_scales: Option<&Obj<'_>>,
        recv_topk_idx: Option<&Obj<'_>>,
        recv_topk_weights: Option<&Obj<'_>>,
        rank_prefix_matrix: Option<&Obj<'_>>,
        recv_src_idx: Option<&Obj<'_>>,
        stream: Option<u64>,
    ) -> PyResult<PyHtHandle> {
        let r = self.rank;
        self.check_uid(py, plan.buffer_uid, "plan")?;
        let out =
            self.dispatch_outputs_of(py, recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, rank_prefix_matrix, recv_src_idx)?;
        let taken = plan.state.lock().ok().and_then(|mut s| s.take());
        let (p, call) = taken.ok_or_else(|| invalid(py, "plan", r, "was already used by dispatch_into"))?;
        let handle = self.run(py, Some(stream), move |b| b.dispatch_into(p, &call.args(), out))?;
        Ok(PyHtHandle { inner: handle, buffer_uid: self.uid })
    }

    /// `prepare_dispatch` and `dispatch_into` in one call (collective): after the count exchange,
    /// `alloc(num_recv_rows, hidden, topk, is_fp8, has_topk)` returns the outputs as a tuple `(recv_x,
    /// recv_x_scales, recv_topk_idx, recv_topk_weights, rank_prefix_matrix, recv_src_idx, ...)` (None where
    /// not wanted; elements after the sixth are the caller's and passed back untouched, except that with
    /// `channel_outputs` the dispatch writes DeepEP's intranode channel elements into elements 6 to 8:
    /// `channel_prefix_matrix`, `recv_channel_prefix_matrix`, `send_head`, moelink::ChannelOutputs). Returns `(handle,
    /// num_recv_tokens_per_expert, outputs)`. `alloc` runs with the buffer unlocked, as the Python code
    /// between the two calls did.
    #[pyo3(signature = (x, alloc, x_scales=None, handle=None, num_tokens_per_rank=None, num_tokens_per_expert=None, is_token_in_rank=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None, stream=None, begin_call=false, channel_outputs=false))]
    #[allow(clippy::too_many_arguments)]
    fn dispatch<'py>(
        &self,
        py: Python<'py>,
        x: &Obj<'py>,
        alloc: &Obj<'py>,
        x_scales: Option<&Obj<'py>>,
        handle: Option<&Obj<'py>>,
        num_tokens_per_rank: Option<&Obj<'py>>,
        num_tokens_per_expert: Option<&Obj<'py>>,
        is_token_in_rank: Option<&Obj<'py>>,
        topk_idx: Option<&Obj<'py>>,
        topk_weights: Option<&Obj<'py>>,
        expert_alignment: usize,
        num_worst_tokens: usize,
        config: Option<ConfigTuple>,
        stream: Option<u64>,
        begin_call: bool,
        channel_outputs: bool,
    ) -> PyResult<(PyHtHandle, Vec<usize>, Obj<'py>)> {
        let started = self.host_time.start();
        self.mark_call(begin_call);
        let call = self.ht_call(
            py,
            x,
            x_scales,
            handle,
            num_tokens_per_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
            config,
        )?;
        let now = || started.map(|_| Instant::now()); // the clock only while host timing is on
        let read_done = now();
        let (plan, call) = self.run(py, Some(stream), move |b| {
            let plan = b.prepare_dispatch(&call.args())?;
            Ok((plan, call))
        })?;
        let prepared = now();
        let per_expert = plan.num_recv_tokens_per_expert().to_vec();
        let outputs = alloc.call1((plan.num_recv_rows(), plan.hidden(), plan.topk(), plan.is_fp8(), plan.has_topk()))?;
        let out = self.dispatch_outputs(py, &outputs, channel_outputs)?;
        let launch = now();
        let handle = self.run(py, Some(stream), move |b| b.dispatch_into(plan, &call.args(), out))?;
        if let (Some(t0), Some(read_done), Some(prepared), Some(launch)) = (started, read_done, prepared, launch) {
            // Backend: both native steps (with their GIL hand-offs); the outputs' allocation is the rest.
            let backend = prepared.duration_since(read_done) + launch.elapsed();
            self.host_time.record("dispatch", t0, read_done, backend.as_nanos() as u64);
        }
        Ok((PyHtHandle { inner: handle, buffer_uid: self.uid }, per_expert, outputs))
    }

    /// A cached dispatch in one native step (collective), for callers that know its outputs' rows from the
    /// handle (`num_recv_tokens` of a CPU-synchronised one): `x` (bf16, or e4m3 with `x_scales`) sent by
    /// `handle`'s routing into `recv_x` (and `recv_x_scales` for FP8). The same checks and errors as
    /// `dispatch` with a handle; rows that differ from the handle's are refused naming `recv_x`.
    #[pyo3(signature = (x, handle, recv_x, x_scales=None, recv_x_scales=None, config=None, stream=None, begin_call=false))]
    #[allow(clippy::too_many_arguments)]
    fn cached_dispatch_into(
        &self,
        py: Python<'_>,
        x: &Obj<'_>,
        handle: &Obj<'_>,
        recv_x: &Obj<'_>,
        x_scales: Option<&Obj<'_>>,
        recv_x_scales: Option<&Obj<'_>>,
        config: Option<ConfigTuple>,
        stream: Option<u64>,
        begin_call: bool,
    ) -> PyResult<()> {
        let started = self.host_time.start();
        self.mark_call(begin_call);
        let call = self.ht_call(py, x, x_scales, Some(handle), None, None, None, None, None, 1, 0, config)?;
        let out = self.dispatch_outputs_of(py, recv_x, recv_x_scales, None, None, None, None)?;
        self.run_timed(py, Some(stream), started.map(|t0| ("cached dispatch", t0)), move |b| {
            let plan = b.prepare_dispatch(&call.args())?;
            b.dispatch_into(plan, &call.args(), out).map(|_| ())
        })
    }

    /// Sums expert outputs `x` back onto the tokens' home ranks (collective). `bias_0`/`bias_1`: up to two
    /// `[T, H]` bf16 tensors added to the output. `begin_call` as in `prepare_dispatch`.
    #[pyo3(signature = (x, handle, combined_x, topk_weights=None, combined_topk_weights=None, bias_0=None, bias_1=None, config=None, stream=None, begin_call=false))]
    #[allow(clippy::too_many_arguments)]
    fn combine_into(
        &self,
        py: Python<'_>,
        x: &Obj<'_>,
        handle: &Obj<'_>,
        combined_x: &Obj<'_>,
        topk_weights: Option<&Obj<'_>>,
        combined_topk_weights: Option<&Obj<'_>>,
        bias_0: Option<&Obj<'_>>,
        bias_1: Option<&Obj<'_>>,
        config: Option<ConfigTuple>,
        stream: Option<u64>,
        begin_call: bool,
    ) -> PyResult<()> {
        let started = self.host_time.start().map(|t| ("combine", t));
        self.mark_call(begin_call);
        let r = self.rank;
        let handle = handle
            .cast::<PyHtHandle>()
            .map_err(|_| crate::errors::type_error(py, "handle", r, "expected the native handle of a dispatch".to_string()))?;
        let handle = handle.get();
        self.check_uid(py, handle.buffer_uid, "handle")?;
        let x = self.arg(x, "x")?.view(py, "x", r)?;
        let topk_weights = opt_view(py, &self.opt_arg(topk_weights, "topk_weights")?, "topk_weights", r)?;
        let bias = [opt_view(py, &self.opt_arg(bias_0, "bias")?, "bias", r)?, opt_view(py, &self.opt_arg(bias_1, "bias")?, "bias", r)?];
        let out = CombineOutputs {
            combined_x: self.arg(combined_x, "combined_x")?.view_mut(py, "combined_x", r)?,
            combined_topk_weights: opt_view_mut(
                py,
                &self.opt_arg(combined_topk_weights, "combined_topk_weights")?,
                "combined_topk_weights",
                r,
            )?,
        };
        let h = handle.inner.clone();
        let config = config.map(config_from);
        self.run_timed(py, Some(stream), started, move |b| b.combine_into(&CombineArgs { x, handle: &h, topk_weights, bias, config }, out))
    }

    /// Low-latency dispatch into caller-allocated outputs (collective). Returns `(handle, hook)`; `hook`
    /// is None unless `return_recv_hook`, in which case only the send phase has run. The optional handle
    /// outputs (DeepEP's, written by the receive phase): `src_info` (`int32 [E_local, R*T_max]`, the source
    /// token index of each row) and `layout_range` (`int64 [E_local, R]`, `begin << 32 | count` of the rows
    /// from each rank). `begin_call` as in `prepare_dispatch`.
    #[pyo3(signature = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, recv_x, recv_count, topk_weights=None, recv_x_scales=None, use_fp8=true, round_scale=false, use_ue8m0=false, return_recv_hook=false, cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, src_info=None, layout_range=None, stream=None, begin_call=false))]
    #[allow(clippy::too_many_arguments)]
    fn low_latency_dispatch_into(
        &self,
        py: Python<'_>,
        x: &Obj<'_>,
        topk_idx: &Obj<'_>,
        num_max_dispatch_tokens_per_rank: usize,
        num_experts: usize,
        recv_x: &Obj<'_>,
        recv_count: &Obj<'_>,
        topk_weights: Option<&Obj<'_>>,
        recv_x_scales: Option<&Obj<'_>>,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        return_recv_hook: bool,
        cumulative_local_expert_recv_stats: Option<&Obj<'_>>,
        dispatch_wait_recv_cost_stats: Option<&Obj<'_>>,
        src_info: Option<&Obj<'_>>,
        layout_range: Option<&Obj<'_>>,
        stream: Option<u64>,
        begin_call: bool,
    ) -> PyResult<(PyLlHandle, Option<PyRecvHook>)> {
        let started = self.host_time.start().map(|t| ("low_latency_dispatch", t));
        self.mark_call(begin_call);
        let r = self.rank;
        let quant = LlQuant::from_flags(use_fp8, round_scale, use_ue8m0, r).map_err(|e| to_pyerr(py, e, None))?;
        let args = LlDispatchArgs {
            x: self.arg(x, "x")?.view(py, "x", r)?,
            topk_idx: self.arg(topk_idx, "topk_idx")?.view(py, "topk_idx", r)?,
            topk_weights: opt_view(py, &self.opt_arg(topk_weights, "topk_weights")?, "topk_weights", r)?,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            quant,
            return_recv_hook,
        };
        let cum = "cumulative_local_expert_recv_stats";
        let wait = "dispatch_wait_recv_cost_stats";
        let out = LlDispatchOutputs {
            recv_x: self.arg(recv_x, "recv_x")?.view_mut(py, "recv_x", r)?,
            recv_scales: opt_view_mut(py, &self.opt_arg(recv_x_scales, "recv_x_scales")?, "recv_x_scales", r)?,
            recv_count: self.arg(recv_count, "recv_count")?.view_mut(py, "recv_count", r)?,
            cumulative_local_expert_recv_stats: opt_view_mut(py, &self.opt_arg(cumulative_local_expert_recv_stats, cum)?, cum, r)?,
            dispatch_wait_recv_cost_stats: opt_view_mut(py, &self.opt_arg(dispatch_wait_recv_cost_stats, wait)?, wait, r)?,
            src_info: opt_view_mut(py, &self.opt_arg(src_info, "src_info")?, "src_info", r)?,
            layout_range: opt_view_mut(py, &self.opt_arg(layout_range, "layout_range")?, "layout_range", r)?,
        };
        let (handle, hook) = self.run_timed(py, Some(stream), started, move |b| b.low_latency_dispatch_into(&args, out))?;
        Ok((PyLlHandle { inner: handle, buffer_uid: self.uid }, self.hook(hook)))
    }

    /// Low-latency combine into `out` (collective): `out[t] = Σ_k topk_weights[t,k]·x[expert, slot]`.
    /// Returns the receive hook with `return_recv_hook`, else None. With `zero_copy`, `x` is ignored and
    /// the buffer from `get_next_low_latency_combine_buffer` is sent. `begin_call` as in `prepare_dispatch`.
    #[pyo3(signature = (x, topk_idx, topk_weights, handle, out, zero_copy=false, return_recv_hook=false, combine_wait_recv_cost_stats=None, stream=None, begin_call=false))]
    #[allow(clippy::too_many_arguments)]
    fn low_latency_combine_into(
        &self,
        py: Python<'_>,
        x: &Obj<'_>,
        topk_idx: &Obj<'_>,
        topk_weights: &Obj<'_>,
        handle: &Obj<'_>,
        out: &Obj<'_>,
        zero_copy: bool,
        return_recv_hook: bool,
        combine_wait_recv_cost_stats: Option<&Obj<'_>>,
        stream: Option<u64>,
        begin_call: bool,
    ) -> PyResult<Option<PyRecvHook>> {
        let started = self.host_time.start().map(|t| ("low_latency_combine", t));
        self.mark_call(begin_call);
        let r = self.rank;
        let handle = handle
            .cast::<PyLlHandle>()
            .map_err(|_| crate::errors::type_error(py, "handle", r, "expected the native handle of a low-latency dispatch".to_string()))?;
        let handle = handle.get();
        self.check_uid(py, handle.buffer_uid, "handle")?;
        let (x, topk_idx, topk_weights) = (
            self.arg(x, "x")?.view(py, "x", r)?,
            self.arg(topk_idx, "topk_idx")?.view(py, "topk_idx", r)?,
            self.arg(topk_weights, "topk_weights")?.view(py, "topk_weights", r)?,
        );
        let wait = "combine_wait_recv_cost_stats";
        let outputs = LlCombineOutputs {
            combined_x: self.arg(out, "out")?.view_mut(py, "out", r)?,
            combine_wait_recv_cost_stats: opt_view_mut(py, &self.opt_arg(combine_wait_recv_cost_stats, wait)?, wait, r)?,
        };
        let h = handle.inner.clone();
        let hook = self.run_timed(py, Some(stream), started, move |b| {
            b.low_latency_combine_into(&LlCombineArgs { x, topk_idx, topk_weights, handle: &h, zero_copy, return_recv_hook }, outputs)
        })?;
        Ok(self.hook(hook))
    }

    /// Runs the receive phase of a call made with `return_recv_hook` (once).
    #[pyo3(signature = (hook, stream=None))]
    fn run_hook(&self, py: Python<'_>, hook: &PyRecvHook, stream: Option<u64>) -> PyResult<()> {
        self.check_uid(py, hook.buffer_uid, "hook")?;
        let taken = hook.inner.lock().ok().and_then(|mut h| h.take());
        let pending = taken.ok_or_else(|| invalid(py, "hook", self.rank, "has already run"))?;
        self.run(py, Some(stream), move |b| b.run_hook(pending))
    }

    /// The send buffer of the next low-latency combine (`bf16 [E_local, R*T_max, H]`), as
    /// `(data_ptr, dtype, shape, strides, device)`. It belongs to the buffer and stays valid until the
    /// next low-latency call with other sizes, `clean_low_latency_buffer` or `destroy`.
    fn get_next_low_latency_combine_buffer(&self, py: Python<'_>, handle: PyRef<'_, PyLlHandle>) -> PyResult<ViewTuple> {
        self.check_uid(py, handle.buffer_uid, "handle")?;
        let h = handle.inner.clone();
        self.run(py, None, move |b| b.get_next_low_latency_combine_buffer(&h).map(|t| describe(&t)))
    }

    /// This rank's communication buffer as `(data_ptr, num_bytes, device)`: the high-throughput region,
    /// or the low-latency one with `use_rdma_buffer`. Owned by the buffer (valid until `destroy`).
    fn local_buffer(&self, py: Python<'_>, use_rdma_buffer: bool) -> PyResult<(u64, usize, i64)> {
        self.run(py, None, move |b| {
            b.local_buffer(use_rdma_buffer).map(|t| {
                let (addr, _, shape, _, device) = describe(&t);
                (addr, shape.first().copied().unwrap_or(0), device)
            })
        })
    }

    /// Clears the low-latency buffers (collective).
    #[pyo3(signature = (num_max_dispatch_tokens_per_rank, hidden, num_experts, stream=None))]
    fn clean_low_latency_buffer(
        &self,
        py: Python<'_>,
        num_max_dispatch_tokens_per_rank: usize,
        hidden: usize,
        num_experts: usize,
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.run(py, Some(stream), move |b| b.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts))
    }

    /// Shrink mode: masks `rank` (`mask=True`) or unmasks it.
    #[pyo3(signature = (rank, mask=false))]
    fn low_latency_update_mask_buffer(&self, py: Python<'_>, rank: i64, mask: bool) -> PyResult<()> {
        let rank = usize::try_from(rank).map_err(|_| invalid(py, "rank", self.rank, format!("{rank} is negative")))?;
        self.run(py, None, move |b| b.low_latency_update_mask_buffer(rank, mask))
    }

    /// Shrink mode: which ranks are masked, indexed by rank.
    fn low_latency_query_mask_buffer(&self, py: Python<'_>) -> PyResult<Vec<bool>> {
        self.run(py, None, |b| b.low_latency_query_mask_buffer())
    }

    /// Shrink mode: unmasks every rank.
    fn low_latency_clean_mask_buffer(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, None, |b| b.low_latency_clean_mask_buffer())
    }

    fn __repr__(&self) -> String {
        format!("<moelink._native.Buffer rank {} of {} on {}>", self.rank, self.num_ranks, self.backend)
    }
}
