//! CUDA graphs captured from a stream ([`crate::Stream::capture`]).

use crate::device::{same_device, Device};
use crate::error::{Error, Result};
use crate::raw::driver::{self as drv, CUgraph, CUgraphExec};
use crate::stream::Stream;

/// A captured graph (not yet executable: [`Graph::instantiate`] it).
pub struct Graph {
    device: Device,
    raw: CUgraph,
    /// Whether the capture held only checked work ([`GraphExec::launch`]).
    checked: bool,
}

// SAFETY: graph handles may be used from any thread as long as calls on one graph are not concurrent,
// which `&self`/`&mut self` plus the driver's own locking guarantee for the calls made here.
unsafe impl Send for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph(GPU {})", self.device.ordinal())
    }
}

impl Graph {
    pub(crate) fn from_raw(device: &Device, raw: CUgraph, checked: bool) -> Graph {
        Graph { device: device.clone(), raw, checked }
    }

    /// Compiles the graph into an executable one.
    pub fn instantiate(&self) -> Result<GraphExec> {
        let _g = self.device.bind_scoped()?;
        // SAFETY: live graph of the current context; the exec is destroyed in its Drop.
        let raw = unsafe { drv::graph_instantiate(self.raw)? };
        Ok(GraphExec { device: self.device.clone(), raw, checked: self.checked })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.bind_scoped() {
            // SAFETY: we own the graph; instantiated execs do not depend on it.
            let _ = unsafe { drv::graph_destroy(self.raw) };
        }
    }
}

/// An instantiated graph: replays the captured work with one launch.
pub struct GraphExec {
    device: Device,
    raw: CUgraphExec,
    checked: bool,
}

// SAFETY: as for Graph; launches of one exec are serialised by the driver.
unsafe impl Send for GraphExec {}
// SAFETY: `launch` only submits work; concurrent launches of one exec are allowed by the driver.
unsafe impl Sync for GraphExec {}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphExec(GPU {})", self.device.ordinal())
    }
}

impl GraphExec {
    /// Whether the capture held only the layer's checked work: typed launches ([`crate::TypedKernel`]) and
    /// the copies and fills of spans and buffers, no `unsafe` submission.
    pub fn is_checked(&self) -> bool {
        self.checked
    }

    /// Replays a graph of checked work on `stream` (same device); refuses a graph whose capture saw an
    /// `unsafe` submission ([`GraphExec::launch_unchecked`] replays those).
    ///
    /// A replay issues the captured typed launches, copies and fills again with their captured arguments,
    /// so it rests on what each of them rested on when captured: [`crate::KernelParams`]' terms, under which
    /// the memory their `DevPtr`s address is kept alive by its owners (for a graph, as long as it can be
    /// replayed).
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        if !self.checked {
            return Err(Error::invalid(
                "GraphExec::launch: the graph's capture included an unsafe launch, copy or fill; replay it with launch_unchecked",
            ));
        }
        // SAFETY: every node is a checked submission of this layer (see above).
        unsafe { self.launch_unchecked(stream) }
    }

    /// Launches the whole graph on `stream` (same device), whatever its capture held.
    ///
    /// # Safety
    /// Replaying re-runs the captured kernels with the captured arguments: every pointer they were given
    /// must still be valid (the contract of [`crate::Kernel::launch`] holds again for each replay).
    pub unsafe fn launch_unchecked(&self, stream: &Stream) -> Result<()> {
        same_device("GraphExec::launch", &self.device, stream.device())?;
        let _g = self.device.bind_scoped()?;
        drv::graph_launch(self.raw, stream.raw())
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        if let Ok(_g) = self.device.bind_scoped() {
            // SAFETY: we own the exec.
            let _ = unsafe { drv::graph_exec_destroy(self.raw) };
        }
    }
}
