//! The CUDA backend across nodes: NVLink inside a node (the node's symmetric buffer), RDMA between nodes
//! through the transport seam ([`rdma`]). It adds to [`Gpu`] the topology, the RDMA domain (a region of
//! `num_rdma_bytes` on every rank) and a barrier of every rank through that seam; high throughput in `ht`
//! (`hti_*` kernels), low latency in `ll` (`lli_*`).
//!
//! Region of every rank, at the same offsets (`RDMA_CTRL_BYTES` of control first):
//! `[barrier words u64[R] | ...control... ][operation data: num_rdma_bytes]`.

pub(crate) mod ht;
pub(crate) mod ll;
pub(crate) mod rdma;

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use moelink_cuda::{DevPtr, DeviceBuffer, Kernel, LaunchConfig};
use moelink_kernels::transport::{TransportBarrierArgs, TransportVariant, TRANSPORT_THREADS};
use moelink_kernels::KernelSpec;

use super::gpu::{forward_gpu_operations, Gpu, Leakable, HT_DATA};
use crate::backend::Backend;
use crate::config::BufferOptions;
use crate::dtype::DType;
use crate::error::{Error, Phase, Result};
use crate::group::Group;
use crate::internode::Topology;
use crate::tensor::TensorMut;
use rdma::RdmaDomain;

/// The kind of buffer this fabric's handles, plans and hooks name when they reach another one.
const INTERNODE: &str = "CUDA internode";

/// Bytes at the start of the RDMA region for control words: the barrier's `u64[R]` (R <= 8192), then the
/// internode high-throughput signals (`moelink_kernels::ht_internode::signal_offsets`).
pub(crate) const RDMA_CTRL_BYTES: usize = 512 << 10;
/// Offset of the barrier words in the RDMA region.
const BARRIER_WORDS: usize = 0;
/// Offset of the internode high-throughput signal words in the RDMA region.
pub(crate) const HT_SIGNALS: usize = 64 << 10;
const _: () =
    assert!(HT_SIGNALS + moelink_kernels::ht_internode::HT_SIGNAL_BYTES <= RDMA_CTRL_BYTES, "the HT signals overflow the control area");

/// A CUDA buffer whose ranks span several nodes.
pub(crate) struct Internode {
    pub(crate) topology: Topology,
    /// Kept, as the fields below, while a kernel or a peer may still use it (`Drop for Internode`).
    pub(crate) rdma: Leakable<RdmaDomain>,
    /// Barriers this rank has entered (`u64`, device; the barrier kernel counts).
    barrier_counter: Leakable<DeviceBuffer>,
    /// Low-latency state across nodes (local state words, handle areas, calls and hooks).
    pub(crate) lli: Leakable<ll::LliState>,
    /// High-throughput state across nodes (local state words, host-mapped notify results).
    pub(crate) hti: Leakable<ht::HtiState>,
    /// Ranks per node the transport reaches over NVLink (`allow_nvlink_for_low_latency_mode`), or 0.
    nvlink_ranks_per_node: u32,
    /// Last: dropped after the state above, which lives in its device's memory.
    gpu: Gpu,
}

impl Internode {
    /// Binds the GPU, allocates the node's symmetric buffer and sets up the RDMA domain of `num_rdma_bytes`
    /// (plus control) on every rank (collective).
    pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions, topology: Topology) -> Result<Internode> {
        let rank = group.rank();
        if topology.num_ranks() * 8 > HT_SIGNALS {
            return Err(Error::invalid("topology", rank, format!("{topology}: the RDMA domain holds at most {} ranks", HT_SIGNALS / 8)));
        }
        let gpu = Gpu::new(group, options, topology, 0)?;
        let rdma = RdmaDomain::new(&gpu.device, gpu.group.as_ref(), &options.rdma, RDMA_CTRL_BYTES + options.num_rdma_bytes)?;
        // Same-node peers over NVLink: the seam's pointer path for the peer-pointer transports (NVSHMEM
        // takes its own P2P path, or not, from NVSHMEM_DISABLE_P2P).
        let nvlink_ranks_per_node = match options.rdma.transport {
            crate::Transport::EmuNic(_) if options.rdma.allow_nvlink_for_low_latency_mode => topology.ranks_per_node as u32,
            _ => 0,
        };
        Ok(Internode {
            topology,
            rdma: Leakable::new(rdma),
            barrier_counter: Leakable::new(DeviceBuffer::zeroed(&gpu.device, 8)?),
            lli: Leakable::new(ll::LliState::new(&gpu, options.enable_shrink)?),
            hti: Leakable::new(ht::HtiState::new(&gpu)?),
            nvlink_ranks_per_node,
            gpu,
        })
    }

    /// The seam's argument block for this buffer's kernels.
    pub(crate) fn rdma_args(&self) -> moelink_kernels::transport::RdmaArgs {
        moelink_kernels::transport::RdmaArgs { nvlink_ranks_per_node: self.nvlink_ranks_per_node, ..self.rdma.args() }
    }

    /// Kernel `name` of `variant`, compiled (or loaded from the cache) from `spec(&variant)` through the
    /// transport (NVSHMEM's kernels link against it) on first use. Every kernel of this fabric is loaded
    /// here, never by `Gpu::kernel_of`.
    pub(crate) fn kernel_of<V>(&mut self, variant: V, name: &'static str, spec: fn(&V) -> KernelSpec) -> Result<Kernel>
    where
        V: Copy + Eq + std::hash::Hash + Send + 'static,
    {
        self.gpu.kernel_of_linked(variant, name, spec, &*self.rdma)
    }

    /// A barrier of every rank of the RDMA domain, waited for (collective).
    pub(crate) fn rdma_barrier(&mut self) -> Result<()> {
        self.enqueue_barrier()?;
        self.gpu.finish(Phase::Barrier)
    }
}

// The fabric's modules read the shared part's fields and methods through `b.rank`, `b.launch(..)`.
impl Deref for Internode {
    type Target = Gpu;
    fn deref(&self) -> &Gpu {
        &self.gpu
    }
}

impl DerefMut for Internode {
    fn deref_mut(&mut self) -> &mut Gpu {
        &mut self.gpu
    }
}

/// [`Gpu`]'s drop rules, and the RDMA domain's: it is kept (leaked) when the buffer was poisoned, and in
/// shrink mode with a rank masked (dead, or too slow), which will not join the domain's collective free
/// (NVSHMEM's free waits for every PE); unreadable masks count as masked. With NVSHMEM, leaking the domain
/// pins the runtime (never finalised in this process: its finalize waits for every PE); a healthy drop of
/// the last internode buffer finalises it.
impl Drop for Internode {
    fn drop(&mut self) {
        if !self.gpu.wait_idle_once() {
            self.lli.leak();
            self.hti.leak();
            self.rdma.leak();
            self.barrier_counter.leak();
            return;
        }
        let rank_masked = self.lli.calls.enable_shrink && ll::mask(self).map_or(true, |m| m.iter().any(|&x| x));
        drop(self.lli.take());
        drop(self.hti.take());
        if let Some(rdma) = self.rdma.take() {
            if self.gpu.poisoned || rank_masked {
                rdma.leak();
                self.barrier_counter.leak();
            }
        }
    }
}

impl Backend for Internode {
    forward_gpu_operations!();
    super::super::forward_ht_operations!();
    super::super::forward_ll_operations!();

    fn barrier(&mut self) -> Result<()> {
        self.rdma_barrier()
    }
    fn timer_begin(&mut self) -> Result<bool> {
        let (rdma_args, nic_blocks, counter) = (self.rdma_args(), self.rdma.nic_blocks(), self.barrier_counter.device_ptr());
        let rdma = &*self.rdma;
        let lli = &mut self.lli;
        // The kernel is loaded inside, after open_timer's checks: a refused open during a capture loads nothing.
        self.gpu.open_timer(|gpu| {
            lli.trace.clear(gpu.op_stream())?;
            let kernel = barrier_kernel(gpu, rdma)?;
            launch_barrier(gpu, &kernel, rdma_args, nic_blocks, counter)
        })?;
        Ok(true)
    }
    fn kernel_traces(&self) -> Vec<crate::trace::KernelTrace> {
        let mut all = ll::trace_summaries(self);
        all.extend(self.gpu.ht_traces().iter().cloned());
        all.sort_by_key(|t| t.start_ns);
        all
    }
    fn local_buffer(&mut self, use_rdma_buffer: bool) -> Result<TensorMut<'_>> {
        if use_rdma_buffer {
            // The RDMA region holds RDMA_CTRL_BYTES + num_rdma_bytes bytes (Internode::new).
            let len = self.gpu.num_rdma_bytes;
            let span = self.rdma.local_span_mut(&self.gpu.device, RDMA_CTRL_BYTES, len)?;
            return TensorMut::from_memory(span, DType::U8, &[len], &[1]);
        }
        let len = self.gpu.num_nvl_bytes;
        self.gpu.symmetric_view(HT_DATA, len)
    }
}

impl Internode {
    /// Launches a barrier of every rank of the RDMA domain on the operation stream (collective); an error
    /// it records surfaces at the next `finish`.
    pub(crate) fn enqueue_barrier(&mut self) -> Result<()> {
        let kernel = barrier_kernel(&mut self.gpu, &self.rdma)?;
        launch_barrier(&self.gpu, &kernel, self.rdma_args(), self.rdma.nic_blocks(), self.barrier_counter.device_ptr())
    }
}

/// The transport's barrier kernel, linked with the RDMA domain.
fn barrier_kernel(gpu: &mut Gpu, rdma: &RdmaDomain) -> Result<Kernel> {
    let variant = TransportVariant { transport: rdma.transport().kernel_transport() };
    gpu.kernel_of_linked(variant, "transport_barrier", TransportVariant::spec, rdma)
}

fn launch_barrier(gpu: &Gpu, kernel: &Kernel, rdma: moelink_kernels::transport::RdmaArgs, nic_blocks: u32, counter: DevPtr) -> Result<()> {
    let (error_claim, error_record) = gpu.error_sink();
    let args =
        TransportBarrierArgs { rdma, error_claim, error_record, timeout_ns: gpu.timeout_ns, counter, signal_off: BARRIER_WORDS as u64 };
    let cfg = LaunchConfig::linear(1 + nic_blocks, TRANSPORT_THREADS).with_cooperative();
    gpu.launch(kernel, &cfg, &args)
}
