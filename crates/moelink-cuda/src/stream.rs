//! Streams and events.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::{same_device, Device};
use crate::error::{Error, Result};
use crate::raw::driver::{self as drv, CUevent, CUstream};

/// A CUDA stream. [`Stream::new`] creates a non-blocking stream (it does not synchronise with the legacy
/// default stream) that is destroyed when its last clone is dropped; [`Stream::borrow_raw`] wraps someone
/// else's stream (torch's current stream) without owning it. Clones share one handle.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamHandle>,
}

/// The handle every clone of a [`Stream`] shares; an owned stream is destroyed when this drops.
struct StreamHandle {
    device: Device,
    raw: CUstream,
    owned: bool,
    /// Set by the `unsafe` submissions (raw launches, copies and fills), cleared by `begin_capture`: a graph
    /// captured while it stays clear holds only checked work ([`crate::GraphExec::launch`]).
    unchecked_work: AtomicBool,
}

// SAFETY: a CUstream handle may be used from any thread; the driver serialises submissions.
unsafe impl Send for StreamHandle {}
// SAFETY: as above; no method hands out interior mutability beyond driver calls.
unsafe impl Sync for StreamHandle {}

/// A raw `CUstream` handle from outside Rust (e.g. `torch.cuda.current_stream().cuda_stream`), whose work
/// its owner keeps alive: what `moelink::Buffer::on_foreign_stream` enqueues on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignStream {
    handle: u64,
}

impl ForeignStream {
    /// Wraps a raw stream handle.
    ///
    /// # Safety
    /// Once this value is used with a `moelink::Buffer`, `handle` is a live stream of that buffer's GPU (its
    /// primary context) until the buffer is dropped or enqueues on another foreign stream (dropping a buffer
    /// waits for the last foreign stream it used); and every tensor, handle and output an operation enqueued
    /// on it reads or writes stays alive, and is not written by anyone else, until the stream has executed
    /// that work (torch's caching allocator with `record_stream`, or an event the caller waits for, keeps
    /// this promise for moelink's Python layer).
    pub unsafe fn from_raw(handle: u64) -> ForeignStream {
        ForeignStream { handle }
    }

    /// The raw handle.
    pub fn handle(&self) -> u64 {
        self.handle
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(GPU {}, {:#x})", self.device().ordinal(), self.raw_handle())
    }
}

impl Stream {
    /// A new non-blocking stream on `device`.
    pub fn new(device: &Device) -> Result<Stream> {
        let _g = device.bind_scoped()?;
        // SAFETY: the device's context is current; the stream is destroyed in Drop.
        let raw = unsafe { drv::stream_create_non_blocking()? };
        Ok(Stream { inner: Arc::new(StreamHandle { device: device.clone(), raw, owned: true, unchecked_work: AtomicBool::new(false) }) })
    }

    /// The stream a [`ForeignStream`] names, on `device` (whose primary context the handle must belong to,
    /// by that type's contract).
    pub fn from_foreign(device: &Device, stream: &ForeignStream) -> Stream {
        // SAFETY: `ForeignStream::from_raw`'s contract: the handle is a live stream of this device's primary
        // context while work enqueued through it is pending.
        unsafe { Stream::borrow_raw(device, stream.handle) }
    }

    /// Wraps an existing stream handle (e.g. `torch.cuda.current_stream().cuda_stream`) without taking
    /// ownership; `0` is the legacy default stream.
    ///
    /// # Safety
    /// `handle` must be a stream of `device`'s primary context (or 0) that stays alive while the returned
    /// value or any of its clones is used.
    pub unsafe fn borrow_raw(device: &Device, handle: u64) -> Stream {
        Stream {
            inner: Arc::new(StreamHandle {
                device: device.clone(),
                raw: handle as usize as CUstream,
                owned: false,
                unchecked_work: AtomicBool::new(false),
            }),
        }
    }

    /// The raw `CUstream` as an integer (what torch calls `cuda_stream`).
    pub fn raw_handle(&self) -> u64 {
        self.inner.raw as usize as u64
    }

    pub(crate) fn raw(&self) -> CUstream {
        self.inner.raw
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Blocks until all work submitted so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.device().bind_scoped()?;
        // SAFETY: live stream of the current context.
        unsafe { drv::stream_synchronize(self.raw()) }
    }

    /// True when all work submitted so far has completed.
    pub fn query(&self) -> Result<bool> {
        let _g = self.device().bind_scoped()?;
        // SAFETY: live stream of the current context.
        unsafe { drv::stream_query(self.raw()) }
    }

    /// Polls until the stream is idle or `timeout` passes; `Ok(false)` on timeout. Unlike
    /// [`Stream::synchronize`] this never blocks the host for longer than asked.
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<bool> {
        let start = Instant::now();
        loop {
            if self.query()? {
                return Ok(true);
            }
            if start.elapsed() >= timeout {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Makes later work on this stream wait for `event` (recorded on any device).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let _g = self.device().bind_scoped()?;
        // SAFETY: both handles are live; cross-device event waits are allowed.
        unsafe { drv::stream_wait_event(self.raw(), event.raw) }
    }

    /// Makes later work on this stream wait for a raw event handle (e.g. from torch).
    ///
    /// # Safety
    /// `event` must be a live `CUevent` handle.
    pub unsafe fn wait_raw_event(&self, event: u64) -> Result<()> {
        let _g = self.device().bind_scoped()?;
        drv::stream_wait_event(self.raw(), event as usize as CUevent)
    }

    /// Records a new event on this stream and returns it.
    pub fn record_event(&self) -> Result<Event> {
        let e = Event::new(self.device(), false)?;
        e.record(self)?;
        Ok(e)
    }

    /// Copies `bytes` between device addresses (same device or a mapped peer) in stream order.
    ///
    /// # Safety
    /// Both ranges must be valid device memory of `bytes` bytes for as long as the copy runs.
    pub unsafe fn memcpy_dtod_async(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.mark_unchecked();
        self.copy_dtod(dst, src, bytes)
    }

    /// Fills `count` 32-bit words at `dst` with `value` in stream order.
    ///
    /// # Safety
    /// `dst` must be valid, 4-byte aligned device memory of `4 * count` bytes while the fill runs.
    pub unsafe fn memset_d32_async(&self, dst: u64, value: u32, count: usize) -> Result<()> {
        self.mark_unchecked();
        self.fill_d32(dst, value, count)
    }

    /// Fills `count` bytes at `dst` with `value` in stream order.
    ///
    /// # Safety
    /// `dst` must be valid device memory of `count` bytes while the fill runs.
    pub unsafe fn memset_d8_async(&self, dst: u64, value: u8, count: usize) -> Result<()> {
        self.mark_unchecked();
        self.fill_d8(dst, value, count)
    }

    /// [`Stream::memcpy_dtod_async`] for the layer's checked wrappers (spans and buffers): not marked unchecked.
    pub(crate) unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let _g = self.device().bind_scoped()?;
        drv::memcpy_dtod_async(dst, src, bytes, self.raw())
    }

    /// [`Stream::memset_d32_async`] for the layer's checked wrappers.
    pub(crate) unsafe fn fill_d32(&self, dst: u64, value: u32, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let _g = self.device().bind_scoped()?;
        drv::memset_d32_async(dst, value, count, self.raw())
    }

    /// [`Stream::memset_d8_async`] for the layer's checked wrappers.
    pub(crate) unsafe fn fill_d8(&self, dst: u64, value: u8, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let _g = self.device().bind_scoped()?;
        drv::memset_d8_async(dst, value, count, self.raw())
    }

    /// Records that work whose arguments the layer did not check was submitted here.
    pub(crate) fn mark_unchecked(&self) {
        self.inner.unchecked_work.store(true, Ordering::Relaxed);
    }

    /// Starts capturing this stream's work into a graph instead of running it (thread-local capture mode:
    /// other threads' CUDA calls are unaffected). End with [`Stream::end_capture`].
    pub fn begin_capture(&self) -> Result<()> {
        let _g = self.device().bind_scoped()?;
        self.inner.unchecked_work.store(false, Ordering::Relaxed);
        // SAFETY: live stream of the current context.
        unsafe { drv::stream_begin_capture(self.raw()) }
    }

    /// Ends a capture started with [`Stream::begin_capture`] and returns the captured graph.
    pub fn end_capture(&self) -> Result<crate::graph::Graph> {
        let _g = self.device().bind_scoped()?;
        // SAFETY: live stream of the current context; the graph is owned by the returned value.
        let raw = unsafe { drv::stream_end_capture(self.raw())? };
        let checked = !self.inner.unchecked_work.load(Ordering::Relaxed);
        Ok(crate::graph::Graph::from_raw(self.device(), raw, checked))
    }

    /// Captures what `f` submits to this stream into a graph. The capture is ended even when `f` fails,
    /// and `f`'s error is returned.
    pub fn capture<F>(&self, f: F) -> Result<crate::graph::Graph>
    where
        F: FnOnce(&Stream) -> Result<()>,
    {
        self.begin_capture()?;
        let r = f(self);
        let g = self.end_capture();
        r?;
        g
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Ok(_g) = self.device.bind_scoped() {
            // SAFETY: we created the stream and nobody else destroys it; pending work still completes.
            let _ = unsafe { drv::stream_destroy(self.raw) };
        }
    }
}

/// A CUDA event: a point in a stream that other streams (or the host) can wait for, and a timestamp.
pub struct Event {
    device: Device,
    raw: CUevent,
    timing: bool,
}

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(GPU {}, {:#x})", self.device.ordinal(), self.raw_handle())
    }
}

impl Event {
    /// A new event. `timing` enables [`Event::elapsed_ms`] (slightly more expensive to record).
    pub fn new(device: &Device, timing: bool) -> Result<Event> {
        let _g = device.bind_scoped()?;
        // SAFETY: context current; destroyed in Drop.
        let raw = unsafe { drv::event_create(timing)? };
        Ok(Event { device: device.clone(), raw, timing })
    }

    /// Records the event at the current end of `stream` (which must be on the same device).
    pub fn record(&self, stream: &Stream) -> Result<()> {
        same_device("Event::record", &self.device, stream.device())?;
        let _g = self.device().bind_scoped()?;
        // SAFETY: both handles live and of the same context.
        unsafe { drv::event_record(self.raw, stream.raw()) }
    }

    /// Blocks until the recorded work has completed.
    pub fn synchronize(&self) -> Result<()> {
        let _g = self.device().bind_scoped()?;
        // SAFETY: live event.
        unsafe { drv::event_synchronize(self.raw) }
    }

    /// True when the recorded work has completed (or the event was never recorded).
    pub fn query(&self) -> Result<bool> {
        let _g = self.device().bind_scoped()?;
        // SAFETY: live event.
        unsafe { drv::event_query(self.raw) }
    }

    /// Milliseconds from `self` to `end`; both must be timing events, recorded and completed.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::invalid("Event::elapsed_ms needs two events created with timing = true"));
        }
        let _g = self.device().bind_scoped()?;
        // SAFETY: both events live.
        unsafe { drv::event_elapsed_ms(self.raw, end.raw) }
    }

    /// The raw `CUevent` as an integer.
    pub fn raw_handle(&self) -> u64 {
        self.raw as usize as u64
    }

    /// The device the event was created on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_g) = self.device().bind_scoped() {
            // SAFETY: we created the event and destroy it once.
            let _ = unsafe { drv::event_destroy(self.raw) };
        }
    }
}
