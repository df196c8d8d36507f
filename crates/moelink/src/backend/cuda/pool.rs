//! Device buffers for handles (routing words, forwarding records), recycled: shared by both fabrics.

use std::sync::{Arc, Mutex};

use moelink_cuda::DeviceBuffer;

use super::gpu::Gpu;
use crate::error::{Error, Result};

/// Device buffers for handles, recycled by size class: a dispatch never frees (`cuMemFree` synchronises the
/// device) and, once warmed up, never allocates — which is what lets a no-sync dispatch run under CUDA graph
/// capture.
#[derive(Default)]
pub(crate) struct BufferPool {
    free: Mutex<Vec<DeviceBuffer>>,
}

impl BufferPool {
    fn size_class(bytes: usize) -> usize {
        bytes.max(4096).next_power_of_two()
    }

    /// A buffer of at least `bytes`; `gpu` allocates it when none is free (refused during a capture).
    pub(crate) fn take(self: &Arc<Self>, gpu: &Gpu, bytes: usize) -> Result<PooledBuffer> {
        let class = Self::size_class(bytes);
        let reused =
            self.free.lock().ok().and_then(|mut free| free.iter().position(|d| d.len_bytes() == class).map(|i| free.swap_remove(i)));
        let buf = match reused {
            Some(d) => d,
            None if gpu.is_capturing() => {
                return Err(Error::invalid(
                    "capture",
                    gpu.rank,
                    "a dispatch of this shape needs handle memory that cannot be allocated during CUDA graph capture: run the same \
                     dispatch once (and drop its handle) before capturing",
                ))
            }
            None => gpu.device_alloc(class)?,
        };
        Ok(PooledBuffer { buf: Some(buf), pool: self.clone() })
    }
}

/// A device buffer that returns to its pool when dropped.
pub(crate) struct PooledBuffer {
    buf: Option<DeviceBuffer>,
    pool: Arc<BufferPool>,
}

impl PooledBuffer {
    pub(crate) fn buffer(&self) -> &DeviceBuffer {
        self.buf.as_ref().expect("a PooledBuffer holds its buffer until dropped")
    }
    pub(crate) fn ptr(&self) -> moelink_cuda::DevPtr {
        self.buffer().device_ptr()
    }
}

/// A handle buffer of at least `bytes` from the buffer's pool (see `BufferPool`).
pub(crate) fn pool_take(gpu: &Gpu, bytes: usize) -> Result<PooledBuffer> {
    gpu.pool.clone().take(gpu, bytes)
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        if let (Some(b), Ok(mut free)) = (self.buf.take(), self.pool.free.lock()) {
            free.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moelink_kernels::ht::routing;

    #[test]
    fn pool_classes() {
        assert_eq!(BufferPool::size_class(0), 4096);
        assert_eq!(BufferPool::size_class(4097), 8192);
        assert_eq!(BufferPool::size_class(routing::bytes(4096, 4)), 128 << 10);
    }
}
