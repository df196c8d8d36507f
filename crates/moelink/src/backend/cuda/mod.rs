//! The CUDA backend: one GPU per rank, kernels JIT-compiled from `moelink-kernels`, peers reached through a
//! symmetric buffer. Everything CUDA goes through `moelink_cuda`; this module only decides what to launch.
//!
//! Execution model: every operation runs on the buffer's communication stream. By default a call returns
//! once its kernels have finished (the host waits with the buffer's deadline). Inside
//! [`crate::Buffer::on_stream`] or [`crate::Buffer::on_foreign_stream`] an operation is enqueued on the
//! caller's stream and returns at once (the Python layer uses this for DeepEP's event semantics); errors
//! recorded by the kernels then surface when the scope waits, or at the next call.

pub(crate) mod ht;
pub(crate) mod ht_internode;
pub(crate) mod internode;
pub(crate) mod ll;
pub(crate) mod ll_internode;
pub(crate) mod rdma;

use std::cell::Cell;
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moelink_cuda::{
    Device, DeviceBuffer, Event, Exchange, GraphExec, HostMapped, Kernel, KernelArgs, LaunchConfig, Module, Stream, SymmetricBuffer,
};
use moelink_kernels::abi::{self, ErrorRecord};
use moelink_kernels::KernelSpec;

use super::{Backend, BoundStream, LlRouting, PendingRecv as AnyPending};
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::group::Group;
use crate::internode::Topology;
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlCombineSpec, LlDispatchArgs, LlDispatchOutputs, LlSpec};
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};

/// Bytes at the start of the symmetric buffer reserved for flags, counters and epochs (offsets in
/// `ht::ctrl` and `ll::ctrl`).
pub(crate) const CTRL_BYTES: usize = 4 << 20;

/// Offsets inside the control area (`CTRL_BYTES`) of the symmetric buffer.
pub(crate) mod ctrl {
    /// The generic barrier's region (`moelink_kernels::abi::barrier_region::BYTES`).
    pub const BARRIER: usize = 0;
    /// High-throughput flags, counts and epochs: `[HT, LL)`.
    pub const HT: usize = 64 << 10;
    /// Low-latency flags, counters and epochs: `[LL, CTRL_BYTES)`.
    pub const LL: usize = 2 << 20;
    const _: () = assert!(BARRIER + moelink_kernels::abi::barrier_region::BYTES <= HT && HT < LL && LL < super::CTRL_BYTES);
}

/// Byte offset of the high-throughput data region (`num_nvl_bytes` long) in the symmetric buffer.
pub(crate) const HT_DATA: usize = CTRL_BYTES;

/// A receive phase not yet run (`return_recv_hook`), CUDA flavour.
pub(crate) enum PendingRecv<'a> {
    LlDispatch(ll::PendingDispatch<'a>),
    LlCombine(ll::PendingCombine<'a>),
    LliDispatch(ll_internode::PendingDispatch<'a>),
    LliCombine(ll_internode::PendingCombine<'a>),
}

/// Bytes a timed region overwrites before its start event: more than twice the L2 cache of an H100/H200
/// (50 MB), so every region starts with a cold L2 (as DeepEP's and Triton's benchmarks do), and ~40 us of
/// device work behind which the host enqueues the timed launches.
const TIMER_FLUSH_BYTES: usize = 128 << 20;

/// The events of [`crate::Buffer::timed`]: created on first use, reused by every timed region.
struct Timer {
    start: Event,
    end: Event,
    /// `TIMER_FLUSH_BYTES` overwritten at the start of each region.
    scratch: DeviceBuffer,
    regions: u32,
    /// A timed region is open.
    open: bool,
    /// `end` was recorded in the open region, by the last synchronous operation just before its host wait.
    end_recorded: Cell<bool>,
}

/// Where the kernels of one operation run.
enum StreamMode {
    /// The buffer's own stream; the host waits for completion.
    Own,
    /// A caller's stream (raw handle); the call returns once the work is enqueued.
    External(Stream),
}

pub(crate) struct CudaBackend {
    pub(crate) group: Arc<dyn Group>,
    pub(crate) rank: usize,
    pub(crate) num_ranks: usize,
    pub(crate) device: Device,
    stream: Stream,
    mode: StreamMode,
    /// The last foreign stream (`on_foreign_stream`) operations were enqueued on: nothing waited for that
    /// work, so dropping the buffer waits for this stream too.
    last_foreign: Option<Stream>,
    /// While a graph capture runs (on `stream`): the mode to restore afterwards.
    capture: Option<StreamMode>,
    /// Events of timed regions (`None` until the first one).
    timer: Option<Timer>,
    /// `[CTRL_BYTES | HT region (num_nvl_bytes) | LL region (num_rdma_bytes)]` on every rank.
    /// `ManuallyDrop` (as the other fields kernels write): see `Drop for CudaBackend`.
    pub(crate) sym: ManuallyDrop<SymmetricBuffer>,
    pub(crate) num_nvl_bytes: usize,
    pub(crate) num_rdma_bytes: usize,
    error_claim: ManuallyDrop<DeviceBuffer>,
    error_record: ManuallyDrop<HostMapped<ErrorRecord>>,
    pub(crate) timeout_ns: u64,
    /// Which kernels record timing traces (`BufferOptions::kernel_tracing`).
    pub(crate) tracing: crate::config::KernelTracing,
    /// Tuning overrides and timing experiments (`BufferOptions::tuning`).
    pub(crate) tuning: crate::config::Tuning,
    modules: HashMap<String, Arc<Module>>,
    kernels: HashMap<(String, &'static str), Kernel>,
    pub(crate) ht: ManuallyDrop<ht::HtState>,
    pub(crate) ll: ManuallyDrop<ll::LlState>,
    /// Set when the buffer was poisoned (a collective failed): peers may still write into `sym`.
    poisoned: bool,
    /// SMs this process may use (`Device::available_sms`: fewer under CUDA MPS), read once.
    available_sms: usize,
    /// Ranks that divide `available_sms`: this process's on this GPU, and other processes' too unless this
    /// context has an execution affinity of its own.
    ranks_dividing_sms: usize,
    /// Set when the ranks span several nodes: the topology and the RDMA domain.
    pub(crate) internode: Option<internode::Internode>,
}

impl CudaBackend {
    /// `Ok` when a CUDA driver, at least one GPU and NVRTC are present.
    pub(crate) fn available() -> Result<()> {
        moelink_cuda::driver_available()?;
        if Device::count()? == 0 {
            return Err(Error::Unavailable("the CUDA driver reports no GPU".into()));
        }
        moelink_cuda::jit::nvrtc_version()?;
        Ok(())
    }

    pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions) -> Result<CudaBackend> {
        Self::available()?;
        let rank = group.rank();
        let num_ranks = group.size();
        let topology = options.topology.unwrap_or_else(|| Topology::single_node(num_ranks));
        if topology.ranks_per_node > abi::MAX_RANKS {
            return Err(Error::invalid(
                "topology",
                rank,
                format!("{topology}: the NVLink kernels support at most {} ranks per node", abi::MAX_RANKS),
            ));
        }
        let count = Device::count()?;
        let ordinal = options.device.unwrap_or(group.local_rank() % count);
        if ordinal >= count {
            return Err(Error::invalid("device", rank, format!("device {ordinal} requested, {count} visible")));
        }
        let device = Device::new(ordinal)?;
        device.bind_to_thread()?;
        let stream = Stream::new(&device)?;
        // Ranks on this GPU (of every node: virtual nodes may share a GPU) divide its SMs, since their
        // collective kernels wait for each other and must be resident together. Ranks of other processes
        // count too, unless this context has an execution affinity of its own (fewer SMs than the device
        // reports). An MPS active thread percentage is no such partition: the driver then reports the
        // limited count as the device's, and the clients' limits together may cover every SM, which leaves
        // no room for blocks that do not pack perfectly; so its SMs are still divided among all the ranks.
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let gpu = format!("{}/{}", host.trim(), device.info().pci_bus_id);
        let here = format!("{gpu}/{}", group.process_key());
        let keys = group.all_gather(here.as_bytes())?;
        let ranks_sharing_gpu = keys.iter().filter(|k| k.as_slice() == here.as_bytes()).count().max(1);
        let processes_share = device.available_sms() >= device.info().multiprocessors;
        let ranks_dividing_sms = if processes_share {
            keys.iter().filter(|k| k.starts_with(gpu.as_bytes()) && k.get(gpu.len()) == Some(&b'/')).count().max(1)
        } else {
            ranks_sharing_gpu
        };
        // A context's streams share CUDA_DEVICE_MAX_CONNECTIONS hardware queues (8 by default), and work
        // waits for whatever is ahead of it in its queue. Ranks of one process on one GPU share a context: a
        // rank's kernel or copy queued behind a peer's collective kernel, which waits for that very rank,
        // holds both until the deadline. Enough queues keep them apart: 8 per rank sharing the GPU, up to 32;
        // with 4 such ranks the default 8 stall.
        let info = device.info();
        let queues_needed = (8 * ranks_sharing_gpu).min(32);
        if ranks_sharing_gpu > 1 && info.max_connections < queues_needed {
            return Err(Error::invalid(
                "device",
                rank,
                format!(
                    "{ranks_sharing_gpu} ranks of this process share GPU {ordinal} with {} hardware queues, so one rank's work can \
                     queue behind a peer's kernel that waits for it, until the deadline; set CUDA_DEVICE_MAX_CONNECTIONS={queues_needed} \
                     (or more, up to 32) before CUDA starts, or run one process per rank",
                    info.max_connections
                ),
            ));
        }
        // The symmetric buffer spans the NVLink domain: this rank's node. Across nodes the low-latency region
        // (num_rdma_bytes) lives in the RDMA domain instead.
        let internode = topology.is_internode();
        let ll_bytes = if internode { 0 } else { options.num_rdma_bytes.next_multiple_of(4096) };
        let len = CTRL_BYTES + options.num_nvl_bytes.next_multiple_of(4096) + ll_bytes;
        let node_ranks = topology.ranks_of_node(topology.node_of(rank));
        let gather = |bytes: &[u8]| -> Result<Vec<Vec<u8>>> { Ok(group.all_gather(bytes)?[node_ranks.clone()].to_vec()) };
        let ex = Exchange {
            rank: topology.local_rank_of(rank),
            num_ranks: topology.ranks_per_node,
            process_key: group.process_key(),
            all_gather: &gather,
        };
        let mut sym = SymmetricBuffer::new(&device, len, &ex)?;
        // Flags and epochs start at zero on every rank; a barrier makes sure no peer writes before that.
        sym.local_mut().memset_u8(0)?;
        let mut error_claim = DeviceBuffer::alloc(&device, 4)?;
        error_claim.memset_u8(0)?;
        let error_record = HostMapped::new(&device, 1)?;
        group.barrier()?;
        let mut backend = CudaBackend {
            group: group.clone(),
            rank,
            num_ranks,
            sym: ManuallyDrop::new(sym),
            num_nvl_bytes: options.num_nvl_bytes,
            num_rdma_bytes: options.num_rdma_bytes,
            error_claim: ManuallyDrop::new(error_claim),
            error_record: ManuallyDrop::new(error_record),
            timeout_ns: options.timeout_ms.saturating_mul(1_000_000),
            tracing: options.kernel_tracing,
            tuning: options.tuning.clone(),
            modules: HashMap::new(),
            kernels: HashMap::new(),
            ht: ManuallyDrop::new(ht::HtState::default()),
            ll: ManuallyDrop::new(ll::LlState::new(&device, options.enable_shrink)?),
            poisoned: false,
            available_sms: device.available_sms(),
            ranks_dividing_sms,
            internode: None,
            mode: StreamMode::Own,
            last_foreign: None,
            capture: None,
            timer: None,
            stream,
            device,
        };
        if internode {
            backend.internode = Some(internode::Internode::new(&backend, topology, &options.rdma, options.num_rdma_bytes)?);
        }
        Ok(backend)
    }

    /// Enqueues later operations on `stream` (returning once they are enqueued) until `unbind_stream`.
    fn bind(&mut self, stream: BoundStream) -> Result<()> {
        if self.capture.is_some() || !matches!(self.mode, StreamMode::Own) {
            return Err(Error::invalid("stream", self.rank, "another stream is already bound to this buffer (or a capture runs)"));
        }
        let stream = match stream {
            BoundStream::Owned(s) => {
                if s.device().ordinal() != self.device.ordinal() {
                    let what = format!("is a stream of GPU {}, this buffer's GPU is {}", s.device().ordinal(), self.device.ordinal());
                    return Err(Error::invalid("stream", self.rank, what));
                }
                s
            }
            BoundStream::Foreign(handle) => {
                // SAFETY: `ForeignStream::from_raw`'s contract: the handle is a live stream of this buffer's
                // device until the buffer is dropped or enqueues on another foreign stream.
                let s = unsafe { Stream::borrow_raw(&self.device, handle) };
                self.last_foreign = Some(s.clone());
                s
            }
        };
        self.mode = StreamMode::External(stream);
        Ok(())
    }

    /// Back to the buffer's own stream; with `wait`, first waits (deadline + slack) for the work enqueued on
    /// the bound stream and reports what its kernels recorded.
    fn unbind(&mut self, wait: bool) -> Result<()> {
        let StreamMode::External(stream) = std::mem::replace(&mut self.mode, StreamMode::Own) else {
            return Ok(());
        };
        if !wait {
            return Ok(());
        }
        let slack = Duration::from_nanos(self.timeout_ns) + Duration::from_secs(5);
        let done = stream.synchronize_timeout(slack);
        if let Some(e) = self.recorded_error() {
            return Err(e);
        }
        if !done? {
            return Err(Error::Timeout { rank: self.rank, peer: usize::MAX, phase: Phase::Other, waited_ms: slack.as_millis() as u64 });
        }
        Ok(())
    }

    /// The stream operations are enqueued on.
    pub(crate) fn op_stream(&self) -> &Stream {
        match &self.mode {
            StreamMode::Own => &self.stream,
            StreamMode::External(s) => s,
        }
    }

    /// True when calls return before their kernels finish.
    pub(crate) fn is_async(&self) -> bool {
        matches!(self.mode, StreamMode::External(_))
    }

    /// Device address of byte `offset` of rank `r`'s symmetric buffer.
    pub(crate) fn peer_addr(&self, r: usize, offset: usize) -> u64 {
        self.sym.peer_ptr(r) + offset as u64
    }

    /// Base pointers of every rank's symmetric buffer plus `offset`, padded with zeros to `MAX_RANKS`.
    pub(crate) fn peer_table(&self, offset: usize) -> [u64; abi::MAX_RANKS] {
        let mut t = [0u64; abi::MAX_RANKS];
        for (r, p) in t.iter_mut().enumerate().take(self.num_ranks) {
            *p = self.peer_addr(r, offset);
        }
        t
    }

    /// (claim word, host-mapped record) device addresses every kernel reports errors to.
    pub(crate) fn error_sink(&self) -> (u64, u64) {
        (self.error_claim.device_ptr(), self.error_record.device_ptr())
    }

    /// Compiles (or loads from the cache) `spec` and returns its kernel `name`.
    pub(crate) fn kernel(&mut self, spec: &KernelSpec, name: &'static str) -> Result<Kernel> {
        let key = (spec.variant.clone(), name);
        if let Some(k) = self.kernels.get(&key) {
            return Ok(k.clone());
        }
        let module = match self.modules.get(&spec.variant) {
            Some(m) => m.clone(),
            None => {
                let arch = moelink_cuda::jit::arch_for(self.device.info().compute_capability);
                // Internode kernels of the nvshmem transport compile against NVSHMEM and register with it.
                let request = match &self.internode {
                    Some(i) => i.rdma.compile_request(spec, &arch)?,
                    None => spec.compile_request(&arch),
                };
                let compiled = moelink_cuda::jit::JitCache::global().compile(&request)?;
                let m = Arc::new(compiled.load_shared(&self.device)?);
                if let Some(i) = &self.internode {
                    i.rdma.register(&m)?;
                }
                self.modules.insert(spec.variant.clone(), m.clone());
                m
            }
        };
        let k = module.kernel(name)?;
        self.kernels.insert(key, k.clone());
        Ok(k)
    }

    /// Launches `kernel` with one by-value argument struct on the operation stream.
    pub(crate) fn launch<A: bytemuck::Pod>(&self, kernel: &Kernel, cfg: &LaunchConfig, args: &A) -> Result<()> {
        let a = KernelArgs::new().arg(*args);
        // SAFETY: every kernel of moelink-kernels takes exactly one argument struct whose Rust mirror (in
        // `abi` or the family's module) is size-checked by the kernel's static_assert against the constant
        // its KernelSpec passes; pointers inside were derived from live allocations of this backend or from
        // validated tensor views whose owners keep them alive until the stream work completes.
        unsafe { kernel.launch(self.op_stream(), cfg, &a)? };
        Ok(())
    }

    /// The error a kernel of this rank recorded, if any.
    pub(crate) fn recorded_error(&self) -> Option<Error> {
        let rec = self.error_record.read(0);
        if rec.code == abi::ERR_NONE {
            return None;
        }
        if rec.code != abi::ERR_TIMEOUT {
            return Some(ht::argument_error(self, &rec));
        }
        Some(Error::Timeout {
            rank: rec.rank as usize,
            peer: if rec.peer == abi::NO_PEER { usize::MAX } else { rec.peer as usize },
            phase: phase_of(rec.phase),
            waited_ms: rec.elapsed_ns / 1_000_000,
        })
    }

    /// Forgets a recorded argument error (`report_error` in `ptx.cuh`: the kernels kept the protocol going)
    /// once this rank's stream is idle, so that the buffer stays usable. A fatal record (timeout) stays.
    /// During a graph capture nothing can be waited for: the record stays until a later call.
    pub(crate) fn clear_argument_error(&mut self) -> Result<()> {
        if self.is_capturing() || self.error_record.read(0).code == abi::ERR_NONE {
            return Ok(());
        }
        self.op_stream().synchronize()?;
        if abi::is_fatal(self.error_record.read(0).code) {
            return Ok(());
        }
        self.error_claim.memset_u8(0)?;
        self.error_record.write(0, ErrorRecord::default());
        Ok(())
    }

    /// True while [`Backend::begin_capture`] is capturing this buffer's operations.
    pub(crate) fn is_capturing(&self) -> bool {
        self.capture.is_some()
    }

    /// Ends an operation: in synchronous mode waits for the stream (deadline + slack) and turns a recorded
    /// kernel error into an `Err`; in asynchronous mode only reports errors already recorded.
    pub(crate) fn finish(&self, phase: Phase) -> Result<()> {
        if let Some(e) = self.recorded_error() {
            return Err(e);
        }
        if self.is_async() {
            return Ok(());
        }
        // Inside a timed region the end mark goes right behind the kernels, so the host's polling below
        // stays out of the measured time.
        if let Some(t) = self.timer.as_ref().filter(|t| t.open) {
            t.end.record(&self.stream)?;
            t.end_recorded.set(true);
        }
        let slack = Duration::from_nanos(self.timeout_ns) + Duration::from_secs(5);
        let done = self.stream.synchronize_timeout(slack)?;
        if let Some(e) = self.recorded_error() {
            return Err(e);
        }
        if !done {
            return Err(Error::Timeout { rank: self.rank, peer: usize::MAX, phase, waited_ms: slack.as_millis() as u64 });
        }
        Ok(())
    }

    /// A device allocation on this rank's GPU.
    pub(crate) fn device_alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        Ok(DeviceBuffer::alloc(&self.device, bytes.max(1))?)
    }

    /// Checks that a view lives on this GPU (validation already did; kernels trust it).
    pub(crate) fn addr_of(&self, t: &TensorRef<'_>) -> u64 {
        debug_assert_eq!(t.location(), Location::Cuda(self.device.ordinal()));
        t.addr()
    }

    /// The cross-GPU barrier kernel over the barrier region at the start of the control area (collective).
    pub(crate) fn gpu_barrier(&mut self) -> Result<()> {
        self.enqueue_barrier()?;
        self.finish(Phase::Barrier)
    }

    /// Launches the cross-GPU barrier kernel on the operation stream without waiting for it (collective);
    /// an error it records surfaces at the next operation's `finish`.
    pub(crate) fn enqueue_barrier(&mut self) -> Result<()> {
        if self.internode.is_some() {
            return internode::enqueue_barrier(self);
        }
        let k = self.kernel(&moelink_kernels::BarrierVariant.spec(), moelink_kernels::kernel_name::BARRIER)?;
        let (error_claim, error_record) = self.error_sink();
        let args = abi::BarrierArgs {
            regions: self.peer_table(ctrl::BARRIER),
            error_claim,
            error_record,
            timeout_ns: self.timeout_ns,
            rank: self.rank as u32,
            num_ranks: self.num_ranks as u32,
        };
        self.launch(&k, &LaunchConfig::linear(1, moelink_kernels::BarrierVariant::THREADS), &args)
    }

    /// Opens a timed region, enqueueing (not waiting for) a GPU barrier, a memset of `TIMER_FLUSH_BYTES` of
    /// scratch memory and the start event on the operation stream. The ranks' regions thus start together on
    /// the devices (the memset takes the same time on each), with a cold L2, and the launches of the timed
    /// work, enqueued while the barrier and the memset run, stay out of the measured time.
    fn open_timer(&mut self) -> Result<()> {
        if self.is_capturing() {
            return Err(Error::invalid("timed", self.rank, "cannot time operations while a CUDA graph capture runs"));
        }
        if self.timer.as_ref().is_some_and(|t| t.open) {
            return Err(Error::invalid("timed", self.rank, "a timed region is already open on this buffer"));
        }
        if self.timer.is_none() {
            self.timer = Some(Timer {
                start: Event::new(&self.device, true)?,
                end: Event::new(&self.device, true)?,
                scratch: DeviceBuffer::alloc(&self.device, TIMER_FLUSH_BYTES)?,
                regions: 0,
                open: false,
                end_recorded: Cell::new(false),
            });
        }
        ll::trace_clear(self)?;
        self.ht.traces.clear();
        self.enqueue_barrier()?;
        let t = self.timer.as_mut().expect("created above");
        let stream = match &self.mode {
            StreamMode::Own => &self.stream,
            StreamMode::External(s) => s,
        };
        t.regions = t.regions.wrapping_add(1);
        t.scratch.memset_u32_async(t.regions, stream)?;
        t.start.record(stream)?;
        t.open = true;
        t.end_recorded.set(false);
        Ok(())
    }

    /// Closes the timed region: records the end event unless a synchronous operation already did, waits for
    /// it (deadline, kernel errors) and returns the microseconds between the two events.
    fn close_timer(&mut self) -> Result<f64> {
        let t = self.timer.as_mut().filter(|t| t.open).ok_or_else(|| Error::invalid("timed", self.rank, "no timed region is open"))?;
        t.open = false;
        let t = self.timer.as_ref().expect("checked above");
        if !t.end_recorded.get() {
            t.end.record(self.op_stream())?;
        }
        let start = Instant::now();
        let limit = Duration::from_nanos(self.timeout_ns) + Duration::from_secs(5);
        while !t.end.query()? {
            if let Some(e) = self.recorded_error() {
                return Err(e);
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout {
                    rank: self.rank,
                    peer: usize::MAX,
                    phase: Phase::Other,
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            std::thread::yield_now();
        }
        if let Some(e) = self.recorded_error() {
            return Err(e);
        }
        Ok(t.start.elapsed_ms(&t.end)? as f64 * 1e3)
    }

    /// Refuses an operation whose kernels exist only for one node, on a buffer whose ranks span several.
    pub(crate) fn single_node_only(&self, what: &str) -> Result<()> {
        match &self.internode {
            Some(i) => Err(Error::Unavailable(format!(
                "{what} across nodes ({}) is not implemented on the CUDA backend yet; use one node per buffer",
                i.topology
            ))),
            None => Ok(()),
        }
    }

    /// The SMs this process may use on its GPU: all of them, or its share under CUDA MPS.
    pub(crate) fn num_device_sms(&self) -> usize {
        self.available_sms
    }

    /// This rank's share of its GPU's SMs: all of them, or an equal part when ranks share the GPU (their
    /// kernels wait for each other, so they must be resident together).
    pub(crate) fn num_rank_sms(&self) -> usize {
        (self.num_device_sms() / self.ranks_dividing_sms).max(1)
    }
}

impl CudaBackend {
    /// Waits (bounded) until every kernel this buffer enqueued has finished: on its own stream and, with
    /// a stream scope ([`crate::Buffer::on_stream`]), on the caller's stream. Every wait inside a kernel has the buffer's
    /// deadline, so the kernels end within it; a `false` means they did not (or the context is broken).
    fn wait_idle(&self) -> bool {
        let limit = Duration::from_nanos(self.timeout_ns) + Duration::from_secs(5);
        let own = matches!(self.stream.synchronize_timeout(limit), Ok(true));
        let external = match (&self.mode, &self.last_foreign) {
            (StreamMode::External(s), _) if self.capture.is_none() => matches!(s.synchronize_timeout(limit), Ok(true)),
            (_, Some(s)) if self.capture.is_none() => matches!(s.synchronize_timeout(limit), Ok(true)),
            _ => true,
        };
        own && external
    }
}

/// Dropping a buffer never frees memory a kernel may still use:
/// - it first waits (bounded by the deadline + 5 s) for this buffer's own kernels, on its stream and on a
///   caller's stream bound by a stream scope;
/// - if they did not finish (a wedged GPU, a broken context), nothing they touch is freed: the symmetric
///   memory, the error records, the handle pool and the modules are leaked;
/// - if the buffer was poisoned (a collective failed), a peer may still be inside that collective, or start a
///   later one, and write into this rank's symmetric memory: that memory (and the mappings of the peers'
///   memory) is leaked — the price of rebuilding after a failure, instead of a peer's late store landing in
///   someone else's allocation;
/// - across nodes in shrink mode with a rank masked, the RDMA domain's memory is leaked too: freeing it is
///   collective, and the masked rank may never take part;
/// - when the group barrier of the collective drop fails (`quiesce`), the buffer counts as
///   poisoned: a peer may be gone.
///
/// With NVSHMEM, leaking the RDMA domain pins the runtime (never finalised in this process: its finalize
/// waits for every PE); a healthy drop of the last internode buffer finalises it.
///
/// A healthy buffer's memory is freed. Peers of a healthy buffer may still publish the last call's hand-back
/// flags into it for a few microseconds after this rank's call returned: drop buffers collectively, after a
/// `barrier()` (the Python layer's `destroy` and DeepEP's do the same).
impl Drop for CudaBackend {
    fn drop(&mut self) {
        let idle = self.wait_idle();
        if !idle {
            std::mem::forget(std::mem::take(&mut self.modules));
            std::mem::forget(std::mem::take(&mut self.kernels));
            if let Some(i) = self.internode.take() {
                i.leak();
            }
            return;
        }
        // A rank masked in shrink mode (dead, or too slow) will not join the RDMA domain's collective free
        // (NVSHMEM's free waits for every PE): its memory is kept, as after a failure. Unreadable masks
        // count as masked.
        let rank_masked =
            self.internode.is_some() && self.ll.enable_shrink && ll_internode::mask(self).map_or(true, |m| m.iter().any(|&x| x));
        // SAFETY: every ManuallyDrop field is dropped at most once, here, and `self` is not used afterwards;
        // the kernels that wrote them have finished (`wait_idle`).
        unsafe {
            ManuallyDrop::drop(&mut self.ht);
            ManuallyDrop::drop(&mut self.ll);
            ManuallyDrop::drop(&mut self.error_claim);
            ManuallyDrop::drop(&mut self.error_record);
            if !self.poisoned {
                ManuallyDrop::drop(&mut self.sym);
            }
        }
        if let Some(i) = self.internode.take() {
            if self.poisoned || rank_masked {
                i.leak();
            }
        }
    }
}

fn phase_of(code: u32) -> Phase {
    match code {
        abi::phase::BARRIER => Phase::Barrier,
        abi::phase::LAYOUT => Phase::Layout,
        abi::phase::NOTIFY => Phase::Notify,
        abi::phase::DISPATCH => Phase::Dispatch,
        abi::phase::COMBINE => Phase::Combine,
        abi::phase::LL_DISPATCH => Phase::LowLatencyDispatch,
        abi::phase::LL_COMBINE => Phase::LowLatencyCombine,
        abi::phase::TRANSPORT => Phase::Transport,
        moelink_kernels::ht_internode::phase::NOTIFY => Phase::Notify,
        moelink_kernels::ht_internode::phase::DISPATCH_RDMA => Phase::DispatchRdma,
        moelink_kernels::ht_internode::phase::DISPATCH_NVLINK => Phase::DispatchNvlink,
        moelink_kernels::ht_internode::phase::COMBINE_RDMA => Phase::CombineRdma,
        moelink_kernels::ht_internode::phase::COMBINE_NVLINK => Phase::CombineNvlink,
        _ => Phase::Other,
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn location(&self) -> Location {
        Location::Cuda(self.device.ordinal())
    }
    fn default_num_sms(&self) -> usize {
        ht::default_num_sms(self)
    }
    fn max_num_sms(&self) -> usize {
        self.num_rank_sms()
    }
    fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let bytes: usize = shape.iter().product::<usize>() * dtype.size_bytes();
        Tensor::from_device(self.device_alloc(bytes)?, dtype, shape)
    }
    fn upload(&self, t: &Tensor) -> Result<Tensor> {
        let bytes = t.to_host_bytes()?;
        Tensor::from_device(DeviceBuffer::from_host(&self.device, &bytes)?, t.dtype(), t.shape())
    }
    fn barrier(&mut self) -> Result<()> {
        self.gpu_barrier()
    }
    fn quiesce(&mut self) -> Result<()> {
        // A peer's kernel can still be writing its last flags (slab hand-back, arrival counters) into this
        // rank's symmetric memory after this rank's own work is done; freeing it then faults the peer (seen
        // on 4xH200 as CUDA_ERROR_ILLEGAL_ADDRESS in the next test). Wait for this rank's streams, then for
        // every rank to have done the same: after that nobody writes here any more.
        // Stream errors (a poisoned context) must not skip the barrier: the other ranks are waiting in it.
        let own = self.stream.synchronize();
        let external = match (&self.mode, &self.last_foreign) {
            (StreamMode::External(s), _) | (_, Some(s)) => s.synchronize(),
            _ => Ok(()),
        };
        if let Err(e) = self.group.barrier() {
            // Not every rank is known to be done (a peer is gone or late): it may still write here, and a
            // collective free of the RDMA domain (NVSHMEM's free and finalize wait for every PE) could wait
            // for it forever. Keep the memory, as after a failed collective.
            self.poisoned = true;
            return Err(e);
        }
        own?;
        Ok(external?)
    }
    fn poison(&mut self) {
        self.poisoned = true;
    }
    fn bind_stream(&mut self, stream: BoundStream) -> Result<()> {
        self.bind(stream)
    }
    fn unbind_stream(&mut self, wait: bool) -> Result<()> {
        self.unbind(wait)
    }
    fn begin_capture(&mut self) -> Result<()> {
        if self.capture.is_some() {
            return Err(Error::invalid("capture", self.rank, "a capture is already running on this buffer"));
        }
        let capturing = self.stream.clone();
        capturing.begin_capture()?;
        self.capture = Some(std::mem::replace(&mut self.mode, StreamMode::External(capturing)));
        Ok(())
    }
    fn end_capture(&mut self) -> Result<GraphExec> {
        let previous = self.capture.take().ok_or_else(|| Error::invalid("capture", self.rank, "no capture is running"))?;
        let graph = self.stream.end_capture();
        self.mode = previous;
        Ok(graph?.instantiate()?)
    }
    fn replay(&mut self, graph: &GraphExec) -> Result<()> {
        if self.capture.is_some() {
            return Err(Error::invalid("graph", self.rank, "cannot replay a graph while capturing"));
        }
        // SAFETY: only the pipelines of `crate::graph` replay, and each owns every tensor and handle its
        // graphs were captured with (inputs, outputs, routing) for as long as it can be replayed; a replay
        // inside `on_stream` borrows the pipeline until the scope has waited for the work.
        unsafe { graph.launch(self.op_stream())? };
        self.finish(Phase::Other)
    }
    fn timer_begin(&mut self) -> Result<bool> {
        self.open_timer()?;
        Ok(true)
    }
    fn timer_end(&mut self) -> Result<f64> {
        self.close_timer()
    }
    fn timer_cancel(&mut self) {
        if let Some(t) = self.timer.as_mut() {
            t.open = false;
        }
    }
    fn timer_name(&self) -> &'static str {
        "cuda-events"
    }
    fn kernel_traces(&self) -> Vec<crate::trace::KernelTrace> {
        let mut all = ll::trace_summaries(self);
        all.extend(self.ht.traces.iter().cloned());
        all.sort_by_key(|t| t.start_ns);
        all
    }
    super::forward_ht_operations!();
    // The low-latency operations choose the intranode or the internode kernels.
    fn ll_dispatch<'a>(
        &mut self,
        spec: LlSpec,
        args: &LlDispatchArgs<'_>,
        out: LlDispatchOutputs<'a>,
    ) -> Result<(Arc<LlRouting>, Option<AnyPending<'a>>)> {
        if self.internode.is_some() {
            return ll_internode::dispatch(self, spec, args, out);
        }
        ll::dispatch(self, spec, args, out)
    }
    fn ll_combine<'a>(
        &mut self,
        spec: LlCombineSpec,
        args: &LlCombineArgs<'_>,
        out: LlCombineOutputs<'a>,
    ) -> Result<Option<AnyPending<'a>>> {
        if self.internode.is_some() {
            return ll_internode::combine(self, spec, args, out);
        }
        ll::combine(self, spec, args, out)
    }
    fn run_recv(&mut self, pending: AnyPending<'_>) -> Result<()> {
        match pending {
            AnyPending::Cuda(PendingRecv::LlDispatch(p)) => ll::finish_dispatch(self, p),
            AnyPending::Cuda(PendingRecv::LlCombine(p)) => ll::finish_combine(self, p),
            AnyPending::Cuda(PendingRecv::LliDispatch(p)) => ll_internode::finish_dispatch(self, p),
            AnyPending::Cuda(PendingRecv::LliCombine(p)) => ll_internode::finish_combine(self, p),
            AnyPending::Host(_) => Err(Error::invalid("hook", self.rank, "a host hook cannot run on the CUDA backend")),
        }
    }
    fn ll_next_combine_buffer(&mut self, spec: &LlSpec) -> Result<TensorMut<'_>> {
        if self.internode.is_some() {
            return ll_internode::next_combine_buffer(self, spec);
        }
        ll::next_combine_buffer(self, spec)
    }
    fn clean_ll_buffer(&mut self, num_max_dispatch_tokens_per_rank: usize, hidden: usize, num_experts: usize) -> Result<()> {
        if self.internode.is_some() {
            return ll_internode::clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts);
        }
        ll::clean(self, num_max_dispatch_tokens_per_rank, hidden, num_experts)
    }
    fn ll_set_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        if self.internode.is_some() {
            return ll_internode::set_mask(self, rank, masked);
        }
        ll::set_mask(self, rank, masked)
    }
    fn ll_mask(&mut self) -> Result<Vec<bool>> {
        if self.internode.is_some() {
            return ll_internode::mask(self);
        }
        ll::mask(self)
    }
    fn ll_clear_mask(&mut self) -> Result<()> {
        if self.internode.is_some() {
            return ll_internode::clear_mask(self);
        }
        ll::clear_mask(self)
    }
    fn local_buffer(&mut self, use_rdma_buffer: bool) -> Result<TensorMut<'_>> {
        if let (true, Some(i)) = (use_rdma_buffer, &self.internode) {
            let addr = i.rdma.local_base() + internode::RDMA_CTRL_BYTES as u64;
            // SAFETY: the RDMA region holds RDMA_CTRL_BYTES + num_rdma_bytes bytes (Internode::new) and lives as
            // long as `self`; the view borrows `self` mutably.
            return unsafe { TensorMut::from_raw_parts(addr, self.location(), DType::U8, &[self.num_rdma_bytes], &[1]) };
        }
        // The layout `new` allocates: [CTRL_BYTES | HT (num_nvl_bytes, 4 KiB-rounded) | LL (num_rdma_bytes)].
        let (offset, len) = if use_rdma_buffer {
            (HT_DATA + self.num_nvl_bytes.next_multiple_of(4096), self.num_rdma_bytes)
        } else {
            (HT_DATA, self.num_nvl_bytes)
        };
        let addr = self.sym.local().device_ptr() + offset as u64;
        // SAFETY: `[offset, offset + len)` lies inside this rank's symmetric allocation (sized above in
        // `new`), which lives as long as `self`; the view borrows `self` mutably.
        unsafe { TensorMut::from_raw_parts(addr, self.location(), DType::U8, &[len], &[1]) }
    }
}
