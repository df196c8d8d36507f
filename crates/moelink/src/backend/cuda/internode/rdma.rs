//! The RDMA domain of one rank: the memory internode kernels put into and the argument block
//! ([`RdmaArgs`]) that tells `transport.cuh` how to reach it.
//!
//! - `ptr` and `emu-nic`: a [`SymmetricBuffer`] over every rank of the group (peer access or CUDA IPC, so
//!   every rank must be on this host), plus — for the emulated NIC — this rank's queues;
//! - `nvshmem`: the NVSHMEM symmetric heap (NVSHMEM initialised once per process, one PE per rank).
//!
//! The region is zeroed on every rank before a group barrier, so signals start at 0 everywhere.

use moelink_cuda::jit::CompileRequest;
use moelink_cuda::{
    DevPtr, Device, DeviceBuffer, DeviceSpanMut, Exchange, Module, Nvshmem, NvshmemHeap, NvshmemToolchain, SymmetricBuffer,
};
use moelink_kernels::transport::{RdmaArgs, Transport as KernelTransport, NIC_STATE_BYTES};
use moelink_kernels::KernelSpec;

use super::super::gpu::ModuleLinker;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::internode::{RdmaOptions, Transport};

enum Region {
    Peers(SymmetricBuffer),
    Heap(NvshmemHeap),
}

/// One rank's RDMA domain.
pub(crate) struct RdmaDomain {
    transport: Transport,
    region: Region,
    /// The emulated NIC's queues (zeroed once).
    nic: Option<DeviceBuffer>,
    toolchain: Option<NvshmemToolchain>,
    /// This domain's handle to the process's NVSHMEM runtime (the heap holds another): the runtime is
    /// finalised once the last handle of the last domain is dropped, unless a leak pinned it.
    nvshmem: Option<Nvshmem>,
    rank: usize,
    num_ranks: usize,
    num_qps: usize,
}

impl RdmaDomain {
    /// Sets up `region_bytes` of RDMA region on every rank of `group` (collective).
    pub(crate) fn new(device: &Device, group: &dyn Group, options: &RdmaOptions, region_bytes: usize) -> Result<RdmaDomain> {
        let (rank, num_ranks) = (group.rank(), group.size());
        options.validate(rank)?;
        let gather = |bytes: &[u8]| group.all_gather(bytes);
        let ex = Exchange { rank, num_ranks, process_key: group.process_key(), all_gather: &gather };
        let (region, nic, toolchain, nvshmem) = match options.transport {
            Transport::Ptr | Transport::EmuNic(_) => {
                // Peer pointers reach only this host's GPUs: every rank must be here.
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                let hosts = group.all_gather(host.trim().as_bytes())?;
                if let Some(other) = hosts.iter().position(|h| *h != hosts[rank]) {
                    return Err(Error::invalid(
                        "rdma.transport",
                        rank,
                        format!(
                            "the {} transport reaches peers through pointers on one host, but rank {other} runs on another host; \
                             use the nvshmem transport across hosts",
                            options.transport.name()
                        ),
                    ));
                }
                let mut sym = SymmetricBuffer::new(device, region_bytes.max(4096), &ex)?;
                sym.local_mut().memset_u8(0)?;
                let nic = match options.transport {
                    Transport::EmuNic(_) => Some(DeviceBuffer::zeroed(device, NIC_STATE_BYTES)?),
                    _ => None,
                };
                (Region::Peers(sym), nic, None, None)
            }
            Transport::Nvshmem => {
                let home = options.nvshmem_home.as_deref().ok_or_else(|| {
                    Error::Unavailable(format!(
                        "the nvshmem transport needs NVSHMEM: `pip install nvidia-nvshmem-cu13=={}` and set RdmaOptions::nvshmem_home \
                         to its nvidia/nvshmem folder (the moelink command, moelink-stress and the Python package set it from \
                         NVSHMEM_HOME)",
                        moelink_cuda::NvshmemVersion::TESTED
                    ))
                })?;
                if !one_rank_per_process(group)? {
                    return Err(Error::invalid(
                        "rdma.transport",
                        rank,
                        "the nvshmem transport needs one process per rank (NVSHMEM has one PE per process); ranks that share a process \
                         can use the ptr or emu-nic transport",
                    ));
                }
                let toolchain = NvshmemToolchain::locate(home, options.cuda_home.as_deref())?;
                let rt = Nvshmem::init(&toolchain, device, &options.nvshmem_env(), &ex)?;
                // nvshmem_malloc fails alike on every PE (same size, same heap): dropping `rt` then finalises
                // on all of them, and a retry (with a larger NVSHMEM_SYMMETRIC_SIZE) initialises afresh.
                let mut heap = rt.alloc(region_bytes.max(4096))?;
                if let Err(e) = heap.zero(device) {
                    // A failure of this GPU alone: the other PEs may never join a collective free.
                    heap.leak();
                    return Err(e.into());
                }
                (Region::Heap(heap), None, Some(toolchain), Some(rt))
            }
        };
        let domain = RdmaDomain {
            transport: options.transport,
            region,
            nic,
            toolchain,
            nvshmem,
            rank,
            num_ranks,
            num_qps: options.effective_num_qps(),
        };
        if let Err(e) = group.barrier() {
            // A peer that missed the barrier may be gone: nothing collective is waited for on its behalf.
            domain.leak();
            return Err(e);
        }
        Ok(domain)
    }

    /// The engine.
    pub(crate) fn transport(&self) -> Transport {
        self.transport
    }

    /// Blocks an internode launch adds for the emulated NIC (0 otherwise).
    pub(crate) fn nic_blocks(&self) -> u32 {
        match self.transport {
            Transport::EmuNic(o) => o.nic_blocks,
            _ => 0,
        }
    }

    /// Device address of this rank's region.
    pub(crate) fn local_base(&self) -> DevPtr {
        match &self.region {
            Region::Peers(s) => s.local().device_ptr(),
            Region::Heap(h) => h.device_ptr(),
        }
    }

    /// Bytes `[offset, offset + bytes)` of this rank's region (on `device`), borrowed mutably.
    pub(crate) fn local_span_mut(&mut self, device: &Device, offset: usize, bytes: usize) -> Result<DeviceSpanMut<'_>> {
        Ok(match &mut self.region {
            Region::Peers(s) => s.local_mut().span_mut(offset, bytes)?,
            Region::Heap(h) => h.span_mut(device, offset, bytes)?,
        })
    }

    /// Copies `dst.len()` bytes of this rank's region from byte `offset` (diagnostics: it races with
    /// kernels still writing there).
    pub(crate) fn read_local(&self, device: &moelink_cuda::Device, offset: usize, dst: &mut [u8]) -> Result<()> {
        match &self.region {
            Region::Peers(s) => s.local().copy_to_host_at(offset, dst)?,
            Region::Heap(h) => h.copy_to_host_at(device, offset, dst)?,
        }
        Ok(())
    }

    /// The argument block of `transport.cuh` for this rank.
    pub(crate) fn args(&self) -> RdmaArgs {
        let mut a = RdmaArgs {
            local_base: self.local_base(),
            rank: self.rank as u32,
            num_ranks: self.num_ranks as u32,
            num_qps: self.num_qps as u32,
            ..RdmaArgs::default()
        };
        if let Region::Peers(s) = &self.region {
            a.peer_bases = s.peer_table_ptr();
        }
        if let (Transport::EmuNic(o), Some(nic)) = (self.transport, &self.nic) {
            a.nic_state = nic.device_ptr();
            a.nic_delay_ns = o.delay_us.saturating_mul(1000);
            // GB/s = 1000 bytes per microsecond.
            a.nic_bytes_per_us = (o.rate_gbps * 1000.0).round().clamp(0.0, u32::MAX as f64) as u32;
            a.nic_reorder_us = o.reorder_window_us;
            a.nic_blocks = o.nic_blocks;
            a.nic_seed = o.seed;
        }
        a
    }

    /// Keeps the region when dropped (a peer may still put into it, or may never join its collective
    /// free); with NVSHMEM this pins the runtime for the rest of the process (its finalize would wait for
    /// every PE too).
    pub(crate) fn leak(self) {
        match self.region {
            Region::Peers(s) => std::mem::forget(s),
            Region::Heap(mut h) => h.leak(),
        }
        std::mem::forget(self.nic);
    }
}

/// The modules of the internode kernels: linked against NVSHMEM and registered with it for the `nvshmem`
/// transport.
impl ModuleLinker for RdmaDomain {
    /// The compile request for `spec` on `arch`: linked against NVSHMEM for the `nvshmem` transport.
    fn compile_request(&self, spec: &KernelSpec, arch: &str) -> Result<CompileRequest> {
        let req = spec.compile_request(arch);
        match (KernelTransport::of_spec(spec), &self.toolchain) {
            (Some(KernelTransport::Nvshmem), Some(t)) => Ok(t.apply(req)),
            (Some(KernelTransport::Nvshmem), None) => {
                Err(Error::invalid("rdma.transport", self.rank, "an nvshmem kernel was asked of a domain without NVSHMEM"))
            }
            _ => Ok(req),
        }
    }

    /// Registers a loaded module with NVSHMEM (its kernels use the device API); nothing otherwise.
    fn register(&self, module: &Module) -> Result<()> {
        if let Some(rt) = &self.nvshmem {
            rt.register(module)?;
        }
        Ok(())
    }
}

/// True when no two ranks of `group` share a process (collective).
fn one_rank_per_process(group: &dyn Group) -> Result<bool> {
    let keys = group.all_gather(&group.process_key().to_le_bytes())?;
    let mut seen = std::collections::HashSet::new();
    Ok(keys.iter().all(|k| seen.insert(k.clone())))
}
