//! What a CUDA buffer adds when its ranks span several nodes: the topology, the RDMA domain (region of
//! `num_rdma_bytes` behind the transport seam) and a barrier of every rank through that seam.
//!
//! Region of every rank, at the same offsets (`RDMA_CTRL_BYTES` of control first):
//! `[barrier words u64[R] | ...control... ][operation data: num_rdma_bytes]`.

use moelink_cuda::{DeviceBuffer, LaunchConfig};
use moelink_kernels::transport::{TransportBarrierArgs, TransportVariant, TRANSPORT_THREADS};

use super::rdma::RdmaDomain;
use super::CudaBackend;
use crate::error::{Error, Result};
use crate::internode::Topology;

/// Bytes at the start of the RDMA region for control words: the barrier's `u64[R]` (R <= 8192), then the
/// internode high-throughput signals (`moelink_kernels::ht_internode::signal_offsets`).
pub(crate) const RDMA_CTRL_BYTES: usize = 512 << 10;
/// Offset of the barrier words in the RDMA region.
const BARRIER_WORDS: usize = 0;
/// Offset of the internode high-throughput signal words in the RDMA region.
pub(crate) const HT_SIGNALS: usize = 64 << 10;
const _: () =
    assert!(HT_SIGNALS + moelink_kernels::ht_internode::HT_SIGNAL_BYTES <= RDMA_CTRL_BYTES, "the HT signals overflow the control area");

/// The internode part of a [`CudaBackend`].
pub(crate) struct Internode {
    pub(crate) topology: Topology,
    pub(crate) rdma: RdmaDomain,
    /// Barriers this rank has entered (`u64`, device; the barrier kernel counts).
    barrier_counter: DeviceBuffer,
    /// Low-latency state across nodes (local state words, handle areas).
    pub(crate) lli: super::ll_internode::LliState,
    /// High-throughput state across nodes (local state words, host-mapped notify results).
    pub(crate) hti: super::ht_internode::HtiState,
    /// Ranks per node the transport reaches over NVLink (`allow_nvlink_for_low_latency_mode`), or 0.
    nvlink_ranks_per_node: u32,
}

impl Internode {
    /// Sets up the RDMA domain of `num_rdma_bytes` (plus control) on every rank (collective).
    pub(crate) fn new(b: &CudaBackend, topology: Topology, options: &crate::RdmaOptions, num_rdma_bytes: usize) -> Result<Internode> {
        if topology.num_ranks() * 8 > HT_SIGNALS {
            return Err(Error::invalid("topology", b.rank, format!("{topology}: the RDMA domain holds at most {} ranks", HT_SIGNALS / 8)));
        }
        let rdma = RdmaDomain::new(&b.device, b.group.as_ref(), options, RDMA_CTRL_BYTES + num_rdma_bytes)?;
        // Same-node peers over NVLink: the seam's pointer path for the peer-pointer transports (NVSHMEM
        // takes its own P2P path, or not, from NVSHMEM_DISABLE_P2P).
        let nvlink_ranks_per_node = match options.transport {
            crate::Transport::EmuNic(_) if options.allow_nvlink_for_low_latency_mode => topology.ranks_per_node as u32,
            _ => 0,
        };
        Ok(Internode {
            topology,
            rdma,
            barrier_counter: DeviceBuffer::zeroed(&b.device, 8)?,
            lli: super::ll_internode::LliState::new(b)?,
            hti: super::ht_internode::HtiState::new(b)?,
            nvlink_ranks_per_node,
        })
    }

    /// The seam's argument block for this buffer's kernels.
    pub(crate) fn rdma_args(&self) -> moelink_kernels::transport::RdmaArgs {
        moelink_kernels::transport::RdmaArgs { nvlink_ranks_per_node: self.nvlink_ranks_per_node, ..self.rdma.args() }
    }

    /// Keeps the RDMA region when dropped (a peer may still put into it after a failure).
    pub(crate) fn leak(self) {
        self.rdma.leak();
        std::mem::forget(self.barrier_counter);
    }
}

/// Launches a barrier of every rank of the RDMA domain on the operation stream (collective); an error it
/// records surfaces at the next `finish`.
pub(crate) fn enqueue_barrier(b: &mut CudaBackend) -> Result<()> {
    let transport = match &b.internode {
        Some(i) => i.rdma.transport(),
        None => return Err(Error::invalid("topology", b.rank, "a transport barrier needs an internode buffer")),
    };
    let spec = TransportVariant { transport: transport.kernel_transport() }.spec();
    let k = b.kernel(&spec, "transport_barrier")?;
    let (error_claim, error_record) = b.error_sink();
    let inter = b.internode.as_ref().expect("checked above");
    let args = TransportBarrierArgs {
        rdma: inter.rdma_args(),
        error_claim,
        error_record,
        timeout_ns: b.timeout_ns,
        counter: inter.barrier_counter.device_ptr(),
        signal_off: BARRIER_WORDS as u64,
    };
    let cfg = LaunchConfig::linear(1 + inter.rdma.nic_blocks(), TRANSPORT_THREADS).with_cooperative();
    b.launch(&k, &cfg, &args)
}
