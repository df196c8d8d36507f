//! The CUDA backend: one GPU per rank, kernels JIT-compiled from `moelink-kernels`. It has two fabrics,
//! chosen once when the buffer is built: [`intranode`] (one node, every peer over NVLink) and [`internode`]
//! (several nodes: NVLink inside a node, RDMA between nodes through the transport seam). Both stand on
//! [`gpu`] (device, streams, symmetric buffer, kernel cache, launches, error records, timed regions, drop
//! rules), [`pool`] (handle buffers), [`errors`] (what error records mean) and the host-side helpers their
//! calls share ([`ht_shared`], [`ll_shared`]). Everything CUDA goes through `moelink_cuda`.

pub(crate) mod errors;
pub(crate) mod gpu;
pub(crate) mod ht_shared;
pub(crate) mod internode;
pub(crate) mod intranode;
pub(crate) mod ll_shared;
pub(crate) mod pool;

use std::sync::Arc;

use moelink_cuda::Device;

use super::Backend;
use crate::config::BufferOptions;
use crate::error::{Error, Result};
use crate::group::Group;

/// `Ok` when a CUDA driver, at least one GPU and NVRTC are present.
pub(crate) fn available() -> Result<()> {
    moelink_cuda::driver_available()?;
    if Device::count()? == 0 {
        return Err(Error::Unavailable("the CUDA driver reports no GPU".into()));
    }
    moelink_cuda::jit::nvrtc_version()?;
    Ok(())
}

/// The fabric `options.topology` asks for: several nodes, or one.
pub(crate) fn new(group: Arc<dyn Group>, options: &BufferOptions) -> Result<Box<dyn Backend>> {
    available()?;
    match options.topology.filter(|t| t.is_internode()) {
        Some(topology) => Ok(Box::new(internode::Internode::new(group, options, topology)?)),
        None => Ok(Box::new(intranode::Intranode::new(group, options)?)),
    }
}
