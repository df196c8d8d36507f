//! Running a buffer's operations on a caller's CUDA stream.
//!
//! By default every operation runs on the buffer's own stream and returns once its kernels have finished.
//! Two scopes enqueue on a caller's stream instead, each call returning as soon as its work is enqueued:
//!
//! - [`Buffer::on_stream`] for a [`moelink_cuda::Stream`] of this process: a [`StreamScope`] offers the
//!   operations that write caller-provided outputs, with every tensor, handle and pipeline they use
//!   borrowed for the whole scope, and the scope waits for the stream before it returns. Nothing an
//!   enqueued kernel uses can be dropped or rewritten while it may still run.
//! - [`Buffer::on_foreign_stream`] for a stream from outside Rust (torch's, from the Python layer): the
//!   caller keeps the work's memory alive itself, as [`ForeignStream::from_raw`] requires, and nothing
//!   waits.

use std::marker::PhantomData;

use crate::backend::LayoutOutputs;
use crate::buffer::{timed_region, Buffer, RecvHook};
use crate::error::Result;
use crate::graph::GraphPipeline;
use crate::ht::{CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, DispatchPlan, HtHandle};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlHandle};
use crate::tensor::TensorRef;

/// A raw stream handle from outside Rust, for [`Buffer::on_foreign_stream`] (its unsafe constructor states
/// what the caller keeps alive).
pub use moelink_cuda::ForeignStream;

/// The operations of a [`Buffer::on_stream`] scope: the `_into` forms of the collectives, receive hooks,
/// pipeline replays, barriers and timed regions, each enqueued on the scope's stream. Every view, handle
/// and pipeline passed in lives for `'env`, which outlasts the scope, so nothing the enqueued work uses
/// can go away before the scope has waited for it.
pub struct StreamScope<'b, 'env> {
    buf: &'b mut Buffer,
    /// Invariant in `'env`: the scope cannot shorten the borrows it was given.
    _env: PhantomData<&'env mut &'env ()>,
}

impl<'b, 'env> StreamScope<'b, 'env> {
    pub(crate) fn new(buf: &'b mut Buffer) -> StreamScope<'b, 'env> {
        StreamScope { buf, _env: PhantomData }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.buf.rank()
    }

    /// [`Buffer::get_dispatch_layout_into`], enqueued.
    pub fn get_dispatch_layout_into(&mut self, topk_idx: TensorRef<'env>, num_experts: usize, out: LayoutOutputs<'env>) -> Result<()> {
        self.buf.get_dispatch_layout_into(topk_idx, num_experts, out)
    }

    /// [`Buffer::prepare_dispatch`]: in CPU-sync mode the host still waits for the counts (the outputs'
    /// sizes depend on them); with `num_worst_tokens` nothing waits.
    pub fn prepare_dispatch(&mut self, args: &DispatchArgs<'env>) -> Result<DispatchPlan> {
        self.buf.prepare_dispatch(args)
    }

    /// [`Buffer::dispatch_into`], enqueued. The handle can serve combines in later calls (a handle made in
    /// the scope does not live for `'env`).
    pub fn dispatch_into(&mut self, plan: DispatchPlan, args: &DispatchArgs<'env>, out: DispatchOutputs<'env>) -> Result<HtHandle> {
        self.buf.dispatch_into(plan, args, out)
    }

    /// [`Buffer::combine_into`], enqueued.
    pub fn combine_into(&mut self, args: &CombineArgs<'env>, out: CombineOutputs<'env>) -> Result<()> {
        self.buf.combine_into(args, out)
    }

    /// [`Buffer::low_latency_dispatch_into`], enqueued.
    pub fn low_latency_dispatch_into(
        &mut self,
        args: &LlDispatchArgs<'env>,
        out: LlDispatchOutputs<'env>,
    ) -> Result<(LlHandle, Option<RecvHook<'env>>)> {
        self.buf.low_latency_dispatch_into(args, out)
    }

    /// [`Buffer::low_latency_combine_into`], enqueued.
    pub fn low_latency_combine_into(&mut self, args: &LlCombineArgs<'env>, out: LlCombineOutputs<'env>) -> Result<Option<RecvHook<'env>>> {
        self.buf.low_latency_combine_into(args, out)
    }

    /// [`Buffer::run_hook`], enqueued.
    pub fn run_hook(&mut self, hook: RecvHook<'env>) -> Result<()> {
        self.buf.run_hook(hook)
    }

    /// Replays a pipeline's graphs ([`crate::graph`]), enqueued. The pipeline stays borrowed (no new inputs
    /// can be written) until the scope has waited.
    pub fn replay<G: GraphPipeline>(&mut self, pipeline: &'env G) -> Result<()> {
        pipeline.replay(self.buf)
    }

    /// A barrier of every rank's GPU, enqueued.
    pub fn barrier(&mut self) -> Result<()> {
        self.buf.barrier()
    }

    /// [`Buffer::timed`] inside the scope: the end mark is recorded on the scope's stream after `f`
    /// returns, and waited for.
    pub fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<(T, f64)> {
        timed_region(self, |s| &mut *s.buf, f)
    }
}
