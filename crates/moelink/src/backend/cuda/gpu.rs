//! What both fabrics of the CUDA backend stand on: this rank's GPU and streams, the node's symmetric buffer,
//! the kernel cache, launches, the error record and its mapping to typed errors, the handle pool, the timed
//! regions, and the collective drop. Everything CUDA goes through `moelink_cuda`.
//!
//! Execution model: every operation runs on the buffer's communication stream. By default a call returns
//! once its kernels have finished (the host waits with the buffer's deadline). Inside
//! [`crate::Buffer::on_stream`] or [`crate::Buffer::on_foreign_stream`] an operation is enqueued on the
//! caller's stream and returns at once (the Python layer uses this for DeepEP's event semantics); errors
//! recorded by the kernels then surface when the scope waits, or at the next call.

use std::any::{Any, TypeId};
use std::cell::Cell;
use std::collections::HashMap;
use std::hash::Hash;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moelink_cuda::jit::CompileRequest;
use moelink_cuda::{
    DevPtr, DevPtrs, Device, DeviceBuffer, Event, Exchange, GraphExec, HostMapped, Kernel, KernelParams, LaunchConfig, Module, Stream,
    SymmetricBuffer,
};
use moelink_kernels::abi::{self, ErrorRecord};
use moelink_kernels::KernelSpec;

use super::errors::{self, ErrorSink};
use super::pool::BufferPool;
use crate::backend::BoundStream;
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::group::Group;
use crate::internode::Topology;
use crate::tensor::{Location, Tensor, TensorMut, TensorRef};
use crate::trace::KernelTrace;

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

/// How a fabric's modules are compiled and loaded: the internode kernels of the nvshmem transport compile
/// against NVSHMEM and register with it.
pub(crate) trait ModuleLinker {
    fn compile_request(&self, spec: &KernelSpec, arch: &str) -> Result<CompileRequest>;
    fn register(&self, module: &Module) -> Result<()>;
}

/// The linker of kernels that need nothing but NVRTC.
struct Plain;

impl ModuleLinker for Plain {
    fn compile_request(&self, spec: &KernelSpec, arch: &str) -> Result<CompileRequest> {
        Ok(spec.compile_request(arch))
    }
    fn register(&self, _module: &Module) -> Result<()> {
        Ok(())
    }
}

/// Most high-throughput traces kept between two timed regions (the oldest go first).
const HT_TRACES_KEPT: usize = 256;

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

impl StreamMode {
    /// The stream operations go to: `own` (the buffer's) or the caller's. Takes the field, not the `Gpu`, so
    /// that callers can borrow other fields mutably beside it.
    fn stream<'s>(&'s self, own: &'s Stream) -> &'s Stream {
        match self {
            StreamMode::Own => own,
            StreamMode::External(s) => s,
        }
    }
}

/// This rank's GPU, as both fabrics use it.
pub(crate) struct Gpu {
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
    /// Kept, as the error sink, when a kernel or a peer may still write it: see `Drop for Gpu`.
    pub(crate) sym: Leakable<SymmetricBuffer>,
    pub(crate) num_nvl_bytes: usize,
    pub(crate) num_rdma_bytes: usize,
    /// Where this rank's kernels report their first failure.
    errors: Leakable<ErrorSink>,
    pub(crate) timeout_ns: u64,
    /// Which kernels record timing traces (`BufferOptions::kernel_tracing`).
    pub(crate) tracing: crate::config::KernelTracing,
    /// Tuning overrides and timing experiments (`BufferOptions::tuning`).
    pub(crate) tuning: crate::config::Tuning,
    modules: HashMap<String, Arc<Module>>,
    /// The loaded kernels by the variant value that named them: one `HashMap<(V, &'static str), Kernel>` per
    /// variant type `V` ([`Gpu::kernel_of`]).
    kernels_by_variant: HashMap<TypeId, Box<dyn Any + Send>>,
    /// Device buffers for handles (routing words), recycled.
    pub(crate) pool: Arc<BufferPool>,
    /// Host-mapped words of the high-throughput timing trace (`KernelTracing::high_throughput`), grown to the
    /// largest kernel traced.
    ht_trace: Option<HostMapped<u64>>,
    /// The high-throughput traces of the calls since the last timed region opened (at most `HT_TRACES_KEPT`).
    ht_traces: Vec<KernelTrace>,
    /// Set when the buffer was poisoned (a collective failed): peers may still write into `sym`.
    pub(crate) poisoned: bool,
    /// Whether this buffer's kernels had all finished when it was dropped (`wait_idle_once`).
    idle_at_drop: Option<bool>,
    /// SMs this process may use (`Device::available_sms`: fewer under CUDA MPS), read once.
    available_sms: usize,
    /// Ranks that divide `available_sms`: this process's on this GPU, and other processes' too unless this
    /// context has an execution affinity of its own.
    ranks_dividing_sms: usize,
    /// Whether every rank of this rank's node runs on this GPU, so that no peer is across a link.
    node_on_one_gpu: bool,
    /// The stream of copy-engine copies and its fork and join events (created at first use).
    side: Option<SideStream>,
}

/// A stream beside the operation stream: work forked onto it after the operation stream's earlier work, and
/// joined back before the operation stream's later work, so that callers see one stream.
struct SideStream {
    stream: Stream,
    fork: Event,
    join: Event,
}

/// Whether the rank whose key (`host/pci bus id/process key`) is `key` runs on `gpu` (`host/pci bus id`).
fn runs_on(key: &[u8], gpu: &str) -> bool {
    key.starts_with(gpu.as_bytes()) && key.get(gpu.len()) == Some(&b'/')
}

impl Gpu {
    /// Binds this rank's GPU and allocates the node's symmetric buffer (collective over the node's ranks):
    /// `[CTRL_BYTES | HT region (num_nvl_bytes) | LL region (ll_region_bytes)]`.
    pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions, topology: Topology, ll_region_bytes: usize) -> Result<Gpu> {
        let rank = group.rank();
        let num_ranks = group.size();
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
        let ranks_dividing_sms = if processes_share { keys.iter().filter(|k| runs_on(k, &gpu)).count().max(1) } else { ranks_sharing_gpu };
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
        // lives in the RDMA domain instead (`ll_region_bytes` 0).
        let len = CTRL_BYTES + options.num_nvl_bytes.next_multiple_of(4096) + ll_region_bytes.next_multiple_of(4096);
        let node_ranks = topology.ranks_of_node(topology.node_of(rank));
        let node_on_one_gpu = keys[node_ranks.clone()].iter().all(|k| runs_on(k, &gpu));
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
        let errors = ErrorSink::new(&device)?;
        group.barrier()?;
        Ok(Gpu {
            group: group.clone(),
            rank,
            num_ranks,
            sym: Leakable::new(sym),
            num_nvl_bytes: options.num_nvl_bytes,
            num_rdma_bytes: options.num_rdma_bytes,
            errors: Leakable::new(errors),
            timeout_ns: options.timeout_ms.saturating_mul(1_000_000),
            tracing: options.kernel_tracing,
            tuning: options.tuning.clone(),
            modules: HashMap::new(),
            kernels_by_variant: HashMap::new(),
            pool: Arc::default(),
            ht_trace: None,
            ht_traces: Vec::new(),
            poisoned: false,
            idle_at_drop: None,
            available_sms: device.available_sms(),
            ranks_dividing_sms,
            node_on_one_gpu,
            side: None,
            mode: StreamMode::Own,
            last_foreign: None,
            capture: None,
            timer: None,
            stream,
            device,
        })
    }

    /// Enqueues later operations on `stream` (returning once they are enqueued) until `unbind_stream`.
    pub(crate) fn bind(&mut self, stream: BoundStream) -> Result<()> {
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
            BoundStream::Foreign(foreign) => {
                let s = Stream::from_foreign(&self.device, &foreign);
                self.last_foreign = Some(s.clone());
                s
            }
        };
        self.mode = StreamMode::External(stream);
        Ok(())
    }

    /// Back to the buffer's own stream; with `wait`, first waits (deadline + slack) for the work enqueued on
    /// the bound stream and reports what its kernels recorded.
    pub(crate) fn unbind(&mut self, wait: bool) -> Result<()> {
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
        self.mode.stream(&self.stream)
    }

    /// True when calls return before their kernels finish.
    pub(crate) fn is_async(&self) -> bool {
        matches!(self.mode, StreamMode::External(_))
    }

    /// Device address of byte `offset` of rank `r`'s symmetric buffer (an error past its end).
    pub(crate) fn peer_addr(&self, r: usize, offset: usize) -> Result<DevPtr> {
        Ok(self.sym.peer_ptr_at(r, offset)?)
    }

    /// Base pointers of every rank's symmetric buffer plus `offset` (a region of the control area or the
    /// start of a data region, inside every rank's buffer), padded with nulls to `MAX_RANKS`.
    pub(crate) fn peer_table(&self, offset: usize) -> DevPtrs<{ abi::MAX_RANKS }> {
        debug_assert!(offset <= self.sym.len_bytes());
        let mut t = DevPtrs::default();
        for (r, p) in t.iter_mut().enumerate().take(self.num_ranks) {
            *p = self.sym.peer_ptr(r).byte_add(offset);
        }
        t
    }

    /// (claim word, host-mapped record) device addresses every kernel reports errors to.
    pub(crate) fn error_sink(&self) -> (DevPtr, DevPtr) {
        (self.errors.claim_ptr(), self.errors.record_ptr())
    }

    /// Kernel `name` of `variant`, compiled from `spec(&variant)` on first use. Every launch of an operation
    /// finds its kernel here by hashing the variant's few integers: building the compile key (a `KernelSpec`,
    /// a dozen formatted strings) would cost each launch about half a microsecond of host time.
    pub(crate) fn kernel_of<V>(&mut self, variant: V, name: &'static str, spec: fn(&V) -> KernelSpec) -> Result<Kernel>
    where
        V: Copy + Eq + Hash + Send + 'static,
    {
        self.kernel_of_linked(variant, name, spec, &Plain)
    }

    /// [`Gpu::kernel_of`], the module compiled and loaded by `linker`.
    pub(crate) fn kernel_of_linked<V>(
        &mut self,
        variant: V,
        name: &'static str,
        spec: fn(&V) -> KernelSpec,
        linker: &dyn ModuleLinker,
    ) -> Result<Kernel>
    where
        V: Copy + Eq + Hash + Send + 'static,
    {
        if let Some(k) = self.variant_kernels::<V>().get(&(variant, name)) {
            return Ok(k.clone());
        }
        let k = self.kernel_linked(&spec(&variant), name, linker)?;
        self.variant_kernels::<V>().insert((variant, name), k.clone());
        Ok(k)
    }

    fn variant_kernels<V: Copy + Eq + Hash + Send + 'static>(&mut self) -> &mut HashMap<(V, &'static str), Kernel> {
        self.kernels_by_variant
            .entry(TypeId::of::<V>())
            .or_insert_with(|| Box::new(HashMap::<(V, &'static str), Kernel>::new()))
            .downcast_mut()
            .expect("the map under a variant type's id holds that type's kernels")
    }

    /// Kernel `name` of `spec`'s module, compiled (or loaded from the JIT's cache) with `linker` and loaded on
    /// this GPU once per variant; [`Gpu::kernel_of_linked`] keeps the kernels.
    fn kernel_linked(&mut self, spec: &KernelSpec, name: &'static str, linker: &dyn ModuleLinker) -> Result<Kernel> {
        let module = match self.modules.get(&spec.variant) {
            Some(m) => m.clone(),
            None => {
                let arch = moelink_cuda::jit::arch_for(self.device.info().compute_capability);
                let request = linker.compile_request(spec, &arch)?;
                let compiled = moelink_cuda::jit::JitCache::global().compile(&request)?;
                let m = Arc::new(compiled.load_shared(&self.device)?);
                linker.register(&m)?;
                self.modules.insert(spec.variant.clone(), m.clone());
                m
            }
        };
        Ok(module.kernel(name)?)
    }

    /// Makes the side stream's later work wait for the operation stream's work so far (creates it at first use).
    pub(crate) fn fork_side(&mut self) -> Result<()> {
        let side = match &mut self.side {
            Some(side) => side,
            none => none.insert(SideStream {
                stream: Stream::new(&self.device)?,
                fork: Event::new(&self.device, false)?,
                join: Event::new(&self.device, false)?,
            }),
        };
        side.fork.record(self.mode.stream(&self.stream))?;
        Ok(side.stream.wait_event(&side.fork)?)
    }

    /// The side stream ([`Gpu::fork_side`] created it).
    pub(crate) fn side_stream(&self) -> Result<&Stream> {
        self.side.as_ref().map(|s| &s.stream).ok_or_else(|| Error::invalid("stream", self.rank, "internal: no side stream forked"))
    }

    /// Later work of the operation stream waits for the side stream's work so far.
    pub(crate) fn join_side(&self) -> Result<()> {
        let Some(side) = &self.side else { return Ok(()) };
        side.join.record(&side.stream)?;
        Ok(self.op_stream().wait_event(&side.join)?)
    }

    /// Launches `kernel` with one by-value argument struct on `stream` (the side stream).
    pub(crate) fn launch_on<A: KernelParams>(&self, stream: &Stream, kernel: &Kernel, cfg: &LaunchConfig, args: &A) -> Result<()> {
        Ok(kernel.launch_typed(stream, cfg, args)?)
    }

    /// Launches `kernel` with one by-value argument struct on the operation stream.
    pub(crate) fn launch<A: KernelParams>(&self, kernel: &Kernel, cfg: &LaunchConfig, args: &A) -> Result<()> {
        Ok(kernel.launch_typed(self.op_stream(), cfg, args)?)
    }

    /// The error a kernel of this rank recorded, if any.
    pub(crate) fn recorded_error(&self) -> Option<Error> {
        let rec = self.errors.check()?;
        if rec.code != abi::ERR_TIMEOUT {
            return Some(self.argument_error(&rec));
        }
        Some(Error::Timeout {
            rank: rec.rank as usize,
            peer: if rec.peer == abi::NO_PEER { usize::MAX } else { rec.peer as usize },
            phase: errors::phase_of(rec.phase),
            waited_ms: rec.elapsed_ns / 1_000_000,
        })
    }

    /// The error an argument-error record (anything but a timeout) stands for.
    pub(crate) fn argument_error(&self, rec: &ErrorRecord) -> Error {
        errors::argument_error(self.buffer_shape(), rec)
    }

    /// What the error messages need to know about the buffer.
    pub(crate) fn buffer_shape(&self) -> errors::BufferShape {
        errors::BufferShape { rank: self.rank, num_ranks: self.num_ranks, num_nvl_bytes: self.num_nvl_bytes }
    }

    /// An argument error leaves the protocol intact: forget the record (once the stream is idle) so that the
    /// buffer stays usable, and pass the error on. Fatal errors stay recorded (they poison the buffer).
    pub(crate) fn settle(&mut self, e: Error) -> Error {
        if !e.poisons_buffer() {
            if let Err(clear) = self.clear_argument_error() {
                return clear;
            }
        }
        e
    }

    /// [`Gpu::finish`], an argument error settled ([`Gpu::settle`]).
    pub(crate) fn finish_settled(&mut self, phase: Phase) -> Result<()> {
        self.finish(phase).map_err(|e| self.settle(e))
    }

    /// Forgets a recorded argument error (`report_error` in `ptx.cuh`: the kernels kept the protocol going)
    /// once this rank's stream is idle, so that the buffer stays usable. A fatal record (timeout) stays.
    /// During a graph capture nothing can be waited for: the record stays until a later call.
    pub(crate) fn clear_argument_error(&mut self) -> Result<()> {
        if self.is_capturing() || self.errors.check().is_none() {
            return Ok(());
        }
        self.op_stream().synchronize()?;
        if self.errors.check().is_some_and(|r| abi::is_fatal(r.code)) {
            return Ok(());
        }
        self.errors.reset()
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
    pub(crate) fn addr_of(&self, t: &TensorRef<'_>) -> DevPtr {
        debug_assert_eq!(t.location(), Location::Cuda(self.device.ordinal()));
        t.device_ptr()
    }

    /// The NVLink barrier kernel over the barrier region at the start of the control area, enqueued on the
    /// operation stream without waiting for it (collective over the node's ranks); an error it records
    /// surfaces at the next operation's `finish`.
    pub(crate) fn enqueue_nvlink_barrier(&mut self) -> Result<()> {
        let k =
            self.kernel_of(moelink_kernels::BarrierVariant, moelink_kernels::kernel_name::BARRIER, moelink_kernels::BarrierVariant::spec)?;
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

    /// [`Gpu::enqueue_nvlink_barrier`], waited for.
    pub(crate) fn nvlink_barrier(&mut self) -> Result<()> {
        self.enqueue_nvlink_barrier()?;
        self.finish(Phase::Barrier)
    }

    /// Copies `bytes` into this rank's symmetric buffer at `offset` ([`Gpu::write_words`]).
    pub(crate) fn write_local_words(&mut self, offset: usize, bytes: &[u8]) -> Result<()> {
        let stream = self.mode.stream(&self.stream);
        write_words_on(stream, self.sym.local_mut(), offset, bytes)
    }

    /// Zeroes `len` bytes of this rank's symmetric buffer at `offset`, ordered on the operation stream.
    pub(crate) fn zero_symmetric(&mut self, offset: usize, len: usize) -> Result<()> {
        let stream = self.mode.stream(&self.stream);
        Ok(self.sym.local_mut().span_mut(offset, len)?.memset_u8_async(0, stream)?)
    }

    /// Reads `out.len()` bytes of this rank's symmetric buffer at `offset` ([`Gpu::read_words`]).
    pub(crate) fn read_local_words(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.read_words(self.sym.local(), offset, out)
    }

    /// Copies `bytes` into `dst` at `offset`, ordered after the operation stream's earlier work (a caller's
    /// stream in asynchronous mode); complete on return.
    pub(crate) fn write_words(&self, dst: &mut DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        write_words_on(self.op_stream(), dst, offset, bytes)
    }

    /// Reads `out.len()` bytes of `src` at `offset`, ordered after the operation stream's earlier work;
    /// complete on return.
    pub(crate) fn read_words(&self, src: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        Ok(src.copy_to_host_on(offset, out, self.op_stream())?)
    }

    /// Opens a timed region, enqueueing (not waiting for) the fabric's barrier of every rank (`barrier`), a
    /// memset of `TIMER_FLUSH_BYTES` of scratch memory and the start event on the operation stream. The
    /// ranks' regions thus start together on the devices (the memset takes the same time on each), with a
    /// cold L2, and the launches of the timed work, enqueued while the barrier and the memset run, stay out
    /// of the measured time.
    pub(crate) fn open_timer(&mut self, barrier: impl FnOnce(&mut Gpu) -> Result<()>) -> Result<()> {
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
        self.ht_traces.clear();
        barrier(self)?;
        let t = self.timer.as_mut().expect("created above");
        let stream = self.mode.stream(&self.stream);
        t.regions = t.regions.wrapping_add(1);
        t.scratch.memset_u32_async(t.regions, stream)?;
        t.start.record(stream)?;
        t.open = true;
        t.end_recorded.set(false);
        Ok(())
    }

    /// Closes the timed region: records the end event unless a synchronous operation already did, waits for
    /// it (deadline, kernel errors) and returns the microseconds between the two events.
    pub(crate) fn close_timer(&mut self) -> Result<f64> {
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

    /// Closes a timed region without reading it (the timed work failed).
    pub(crate) fn cancel_timer(&mut self) {
        if let Some(t) = self.timer.as_mut() {
            t.open = false;
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

    /// Whether every rank of this rank's node runs on this GPU (thread mode, or processes under CUDA MPS):
    /// then no peer is across a link. The same on every rank of the node.
    pub(crate) fn node_on_one_gpu(&self) -> bool {
        self.node_on_one_gpu
    }

    // -------------------------------------------------------------------------------- HT timing traces

    /// `words` zeroed high-throughput trace words for a launch, or 0 when not tracing this call: with
    /// `KernelTracing::high_throughput` every synchronous HT dispatch and combine records `%globaltimer`
    /// stamps; off (and the argument 0) in asynchronous calls and graph captures, whose kernels finish after
    /// the call returns.
    pub(crate) fn ht_trace_begin(&mut self, words: usize) -> Result<DevPtr> {
        if !self.tracing.high_throughput || self.is_async() || self.is_capturing() {
            return Ok(DevPtr::NULL);
        }
        if self.ht_trace.as_ref().is_none_or(|t| t.len() < words) {
            self.ht_trace = Some(HostMapped::new(&self.device, words)?);
        }
        let t = self.ht_trace.as_mut().expect("allocated above");
        t.clear();
        Ok(t.device_ptr())
    }

    /// The first `n` trace words of the call that just finished.
    pub(crate) fn ht_trace_words(&self, n: usize) -> Vec<u64> {
        self.ht_trace.as_ref().map_or_else(Vec::new, |t| (0..n.min(t.len())).map(|i| t.read(i)).collect())
    }

    /// Keeps a decoded trace for `Buffer::kernel_traces` (the oldest goes when `HT_TRACES_KEPT` are kept).
    pub(crate) fn ht_trace_push(&mut self, trace: KernelTrace) {
        if self.ht_traces.len() == HT_TRACES_KEPT {
            self.ht_traces.remove(0);
        }
        self.ht_traces.push(trace);
    }

    /// The high-throughput traces kept since the last timed region opened.
    pub(crate) fn ht_traces(&self) -> &[KernelTrace] {
        &self.ht_traces
    }

    // -------------------------------------------------------------------------------- Backend methods

    pub(crate) fn location(&self) -> Location {
        Location::Cuda(self.device.ordinal())
    }

    pub(crate) fn alloc(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let bytes: usize = shape.iter().product::<usize>() * dtype.size_bytes();
        Tensor::from_device(self.device_alloc(bytes)?, dtype, shape)
    }

    pub(crate) fn upload(&self, t: &Tensor) -> Result<Tensor> {
        let bytes = t.to_host_bytes()?;
        Tensor::from_device(DeviceBuffer::from_host(&self.device, &bytes)?, t.dtype(), t.shape())
    }

    /// Before this rank's resources are freed (collective): waits for this rank's streams, then for every
    /// rank to have done the same.
    pub(crate) fn quiesce(&mut self) -> Result<()> {
        // A peer's kernel can still be writing its last flags (slab hand-back, arrival counters) into this
        // rank's symmetric memory after this rank's own work is done; freeing it then faults the peer. After
        // every rank waited for its own streams, nobody writes here any more.
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

    pub(crate) fn begin_capture(&mut self) -> Result<()> {
        if self.capture.is_some() {
            return Err(Error::invalid("capture", self.rank, "a capture is already running on this buffer"));
        }
        let capturing = self.stream.clone();
        capturing.begin_capture()?;
        self.capture = Some(std::mem::replace(&mut self.mode, StreamMode::External(capturing)));
        Ok(())
    }

    pub(crate) fn end_capture(&mut self) -> Result<GraphExec> {
        let previous = self.capture.take().ok_or_else(|| Error::invalid("capture", self.rank, "no capture is running"))?;
        let graph = self.stream.end_capture();
        self.mode = previous;
        Ok(graph?.instantiate()?)
    }

    pub(crate) fn replay(&mut self, graph: &GraphExec) -> Result<()> {
        if self.capture.is_some() {
            return Err(Error::invalid("graph", self.rank, "cannot replay a graph while capturing"));
        }
        // The graph holds typed launches and span copies only, so its replay rests on what they rested on:
        // the memory they address outlives it. The pipelines of `crate::graph` own every tensor and handle
        // their graphs were captured with (inputs, outputs, routing) for as long as they can be replayed; a
        // replay inside `on_stream` borrows the pipeline until the scope has waited for the work. The rest
        // the graphs address is this buffer's own (`Buffer::replay_graph` refuses another buffer's graph),
        // which it never frees while it lives: the symmetric buffer, the error sink, the low-latency trace
        // words and the internode handle areas (a larger one retires, not frees, the old); captures take no
        // HT trace words and no host-mapped notify words (both only for synchronous calls).
        graph.launch(self.op_stream())?;
        self.finish(Phase::Other)
    }

    /// `len` bytes at byte `offset` of this rank's symmetric buffer as a 1-D `uint8` view.
    pub(crate) fn symmetric_view(&mut self, offset: usize, len: usize) -> Result<TensorMut<'_>> {
        TensorMut::from_memory(self.sym.local_mut().span_mut(offset, len)?, DType::U8, &[len], &[1])
    }
}

impl Gpu {
    /// Waits (bounded) until every kernel this buffer enqueued has finished: on its own stream and, with
    /// a stream scope ([`crate::Buffer::on_stream`]), on the caller's stream. Every wait inside a kernel has
    /// the buffer's deadline, so the kernels end within it; a `false` means they did not (or the context is
    /// broken). Asked once: the fabric's drop and this one's read the same answer.
    pub(crate) fn wait_idle_once(&mut self) -> bool {
        if let Some(idle) = self.idle_at_drop {
            return idle;
        }
        let limit = Duration::from_nanos(self.timeout_ns) + Duration::from_secs(5);
        let own = matches!(self.stream.synchronize_timeout(limit), Ok(true));
        let external = match (&self.mode, &self.last_foreign) {
            (StreamMode::External(s), _) if self.capture.is_none() => matches!(s.synchronize_timeout(limit), Ok(true)),
            (_, Some(s)) if self.capture.is_none() => matches!(s.synchronize_timeout(limit), Ok(true)),
            _ => true,
        };
        self.idle_at_drop = Some(own && external);
        own && external
    }
}

fn write_words_on(stream: &Stream, dst: &mut DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
    Ok(dst.copy_from_host_on(offset, bytes, stream)?)
}

/// Dropping a buffer never frees memory a kernel may still use:
/// - it first waits (bounded by the deadline + 5 s) for this buffer's own kernels, on its stream and on a
///   caller's stream bound by a stream scope;
/// - if they did not finish (a wedged GPU, a broken context), nothing they touch is freed: the symmetric
///   memory, the error records, the handle pool, the modules and the fabric's state are leaked;
/// - if the buffer was poisoned (a collective failed), a peer may still be inside that collective, or start a
///   later one, and write into this rank's symmetric memory: that memory (and the mappings of the peers'
///   memory) is leaked — the price of rebuilding after a failure, instead of a peer's late store landing in
///   someone else's allocation;
/// - when the group barrier of the collective drop fails (`quiesce`), the buffer counts as
///   poisoned: a peer may be gone.
///
/// The fabrics add their own memory to these rules (`internode`: the RDMA domain). A healthy buffer's memory
/// is freed. Peers of a healthy buffer may still publish the last call's hand-back flags into it for a few
/// microseconds after this rank's call returned: drop buffers collectively, after a `barrier()` (the Python
/// layer's `destroy` and DeepEP's do the same).
impl Drop for Gpu {
    fn drop(&mut self) {
        if !self.wait_idle_once() {
            self.sym.leak();
            self.errors.leak();
            std::mem::forget(self.ht_trace.take());
            std::mem::forget(std::mem::take(&mut self.modules));
            std::mem::forget(std::mem::take(&mut self.kernels_by_variant));
            std::mem::forget(std::mem::take(&mut self.pool));
            return;
        }
        // Freed first, as the device's other resources follow.
        drop(self.errors.take());
        if self.poisoned {
            self.sym.leak();
        }
        drop(self.sym.take());
    }
}

/// A value freed when its owner drops, unless [`Leakable::leak`] kept it: memory a kernel or a peer may
/// still use. Used only until its owner's drop leaks or takes it.
pub(crate) struct Leakable<T>(Option<T>);

impl<T> Leakable<T> {
    pub(crate) fn new(value: T) -> Leakable<T> {
        Leakable(Some(value))
    }

    /// Never frees the value.
    pub(crate) fn leak(&mut self) {
        std::mem::forget(self.0.take());
    }

    /// The value, to drop or leak in a chosen order (`None` once leaked or taken).
    pub(crate) fn take(&mut self) -> Option<T> {
        self.0.take()
    }
}

impl<T> Deref for Leakable<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.0.as_ref().expect("a Leakable is used only until its owner drops")
    }
}

impl<T> DerefMut for Leakable<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.0.as_mut().expect("a Leakable is used only until its owner drops")
    }
}

/// The `Backend` methods both fabrics implement alike, on their `gpu` field: expanded inside each fabric's
/// `impl Backend`.
macro_rules! forward_gpu_operations {
    () => {
        fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
            self
        }
        fn name(&self) -> &'static str {
            "cuda"
        }
        fn location(&self) -> $crate::tensor::Location {
            self.gpu.location()
        }
        fn default_num_sms(&self) -> usize {
            super::ht_shared::default_num_sms(self.gpu.num_rank_sms())
        }
        fn max_num_sms(&self) -> usize {
            self.gpu.num_rank_sms()
        }
        fn alloc(&self, dtype: $crate::dtype::DType, shape: &[usize]) -> $crate::Result<$crate::tensor::Tensor> {
            self.gpu.alloc(dtype, shape)
        }
        fn upload(&self, t: &$crate::tensor::Tensor) -> $crate::Result<$crate::tensor::Tensor> {
            self.gpu.upload(t)
        }
        fn quiesce(&mut self) -> $crate::Result<()> {
            self.gpu.quiesce()
        }
        fn poison(&mut self) {
            self.gpu.poisoned = true;
        }
        fn bind_stream(&mut self, stream: $crate::backend::BoundStream) -> $crate::Result<()> {
            self.gpu.bind(stream)
        }
        fn unbind_stream(&mut self, wait: bool) -> $crate::Result<()> {
            self.gpu.unbind(wait)
        }
        fn begin_capture(&mut self) -> $crate::Result<()> {
            self.gpu.begin_capture()
        }
        fn end_capture(&mut self) -> $crate::Result<moelink_cuda::GraphExec> {
            self.gpu.end_capture()
        }
        fn replay(&mut self, graph: &moelink_cuda::GraphExec) -> $crate::Result<()> {
            self.gpu.replay(graph)
        }
        fn timer_end(&mut self) -> $crate::Result<f64> {
            self.gpu.close_timer()
        }
        fn timer_cancel(&mut self) {
            self.gpu.cancel_timer()
        }
        fn timer_name(&self) -> &'static str {
            "cuda-events"
        }
    };
}
pub(crate) use forward_gpu_operations;

#[cfg(test)]
mod tests {
    use super::{runs_on, Leakable};
    use std::rc::Rc;

    #[test]
    fn a_rank_runs_on_a_gpu_by_host_and_bus_id_whatever_its_process() {
        let gpu = "node-a/0000:19:00.0";
        assert!(runs_on(b"node-a/0000:19:00.0/4242", gpu));
        assert!(runs_on(b"node-a/0000:19:00.0/7", gpu), "another process under MPS");
        assert!(!runs_on(b"node-a/0000:19:00.0", gpu), "a key always has a process part");
        assert!(!runs_on(b"node-a/0000:19:00.01/7", gpu), "a longer bus id is another GPU");
        assert!(!runs_on(b"node-b/0000:19:00.0/7", gpu), "another host");
    }

    #[test]
    fn a_leaked_value_is_never_dropped_a_taken_one_is() {
        let value = Rc::new(());
        let mut kept = Leakable::new(value.clone());
        assert_eq!(Rc::strong_count(&*kept), 2);
        kept.leak();
        drop(kept);
        assert_eq!(Rc::strong_count(&value), 2, "the leaked clone lives on");
        let mut taken = Leakable::new(value.clone());
        drop(taken.take());
        drop(taken);
        assert_eq!(Rc::strong_count(&value), 2, "taken and dropped once, nothing left to drop");
        drop(Leakable::new(value.clone()));
        assert_eq!(Rc::strong_count(&value), 2, "an untouched Leakable drops its value");
    }
}
