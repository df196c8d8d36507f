//! The CUDA backend on one node: every rank reaches every other over NVLink through the node's symmetric
//! buffer. High throughput in `ht` (`ht_layout`, `ht_notify`, `ht_dispatch`, `ht_combine`), low latency in
//! `ll` (`ll_dispatch`, `ll_combine`), both over [`Gpu`].

pub(crate) mod ht;
pub(crate) mod ll;

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use super::gpu::{forward_gpu_operations, Gpu, Leakable, HT_DATA};
use crate::backend::Backend;
use crate::config::BufferOptions;
use crate::error::Result;
use crate::group::Group;
use crate::internode::Topology;
use crate::tensor::TensorMut;

/// The kind of buffer this fabric's handles, plans and hooks name when they reach another one.
const INTRANODE: &str = "single-node CUDA";

/// A CUDA buffer whose ranks share one node.
pub(crate) struct Intranode {
    /// Kept when a kernel may still use them (`Drop for Intranode`).
    ht: Leakable<ht::HtState>,
    ll: Leakable<ll::LlState>,
    /// Last: dropped after the state above, which lives in its device's memory.
    gpu: Gpu,
}

impl Intranode {
    pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions) -> Result<Intranode> {
        let topology = Topology::single_node(group.size());
        let gpu = Gpu::new(group, options, topology, options.num_rdma_bytes)?;
        Ok(Intranode {
            ht: Leakable::new(ht::HtState::default()),
            ll: Leakable::new(ll::LlState::new(&gpu.device, options.enable_shrink)?),
            gpu,
        })
    }
}

// The fabric's modules read the shared part's fields and methods through `b.rank`, `b.launch(..)`.
impl Deref for Intranode {
    type Target = Gpu;
    fn deref(&self) -> &Gpu {
        &self.gpu
    }
}

impl DerefMut for Intranode {
    fn deref_mut(&mut self) -> &mut Gpu {
        &mut self.gpu
    }
}

/// The state's memory (host-mapped notify words, the LL report and trace) is freed only when the buffer's
/// kernels have finished ([`Gpu`]'s drop rules).
impl Drop for Intranode {
    fn drop(&mut self) {
        if !self.gpu.wait_idle_once() {
            self.ht.leak();
            self.ll.leak();
        }
    }
}

impl Backend for Intranode {
    forward_gpu_operations!();
    super::super::forward_ht_operations!();
    super::super::forward_ll_operations!();

    fn barrier(&mut self) -> Result<()> {
        self.gpu.nvlink_barrier()
    }
    fn timer_begin(&mut self) -> Result<bool> {
        let ll = &mut self.ll;
        self.gpu.open_timer(|gpu| {
            ll.trace.clear(gpu.op_stream())?;
            gpu.enqueue_nvlink_barrier()
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
        // The layout `Gpu::new` allocates: [CTRL_BYTES | HT (num_nvl_bytes, 4 KiB-rounded) | LL (num_rdma_bytes)].
        let (offset, len) = if use_rdma_buffer {
            (HT_DATA + self.gpu.num_nvl_bytes.next_multiple_of(4096), self.gpu.num_rdma_bytes)
        } else {
            (HT_DATA, self.gpu.num_nvl_bytes)
        };
        self.gpu.symmetric_view(offset, len)
    }
}
