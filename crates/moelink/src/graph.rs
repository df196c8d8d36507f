//! Pipelines of buffer operations captured once into CUDA graphs and replayed with new inputs.
//!
//! A pipeline owns every tensor its graphs use (inputs, outputs, the routing the captured dispatch leaves
//! in its handle), allocated at fixed addresses when it is built, so a replay is safe: nothing a graph
//! points at can be freed or reallocated while the pipeline exists. New inputs go in through
//! `write_inputs` (checked like the arguments of a call: lengths, and top-k ids in range and distinct per
//! token); outputs are read through accessors between replays.
//!
//! - [`HtGraph`]: layout → no-sync dispatch (`num_worst_tokens`) → combine of the received rows, the
//!   capturable form of the high-throughput path (DeepEP's CUDA-graph use).
//! - [`LlGraph`]: low-latency dispatch, optionally its receive hook, optionally a combine (of the received
//!   rows or of expert outputs written between replays), cut into one graph or one per call or phase.
//!
//! Building a pipeline is collective (every rank builds the same one): it runs the operations once
//! uncaptured (compiling the kernels and filling the handle pool; nothing may allocate device memory while
//! a capture runs), with every token routed nowhere (top-k ids `-1`), then captures them. Replaying is
//! collective too. CUDA backend only: on the host backend building fails with [`Error::Unavailable`].
//!
//! ```no_run
//! # fn demo(buf: &mut moelink::Buffer) -> moelink::Result<()> {
//! use moelink::graph::{HtGraph, HtGraphSpec};
//! let spec = HtGraphSpec { num_tokens: 48, hidden: 512, topk: 8, num_experts: 32, num_worst_tokens: 4 * 48, config: None };
//! let mut pipeline = HtGraph::new(buf, spec)?;
//! # let (x, idx, w) = (vec![moelink::bf16::ZERO; 48 * 512], vec![-1i64; 48 * 8], vec![0f32; 48 * 8]);
//! pipeline.write_inputs(&x, &idx, &w)?;
//! pipeline.replay(buf)?;
//! let combined = pipeline.combined_x().to_vec::<moelink::bf16>()?;
//! # Ok(()) }
//! ```

use std::cell::Cell;

use half::bf16;

use crate::backend::LayoutOutputs;
use crate::buffer::{Buffer, CapturedGraph};
use crate::config::Config;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ht::{CombineArgs, CombineOutputs, DispatchArgs, DispatchOutputs, HtHandle, LayoutRef, Payload, Routing};
use crate::ll::{LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlHandle, LlQuant};
use crate::tensor::Tensor;
use crate::validate::check_topk_values;

mod sealed {
    pub trait Sealed {}
}

/// A pipeline a [`crate::StreamScope`] can replay (implemented by [`HtGraph`] and [`LlGraph`] only).
pub trait GraphPipeline: sealed::Sealed {
    /// Replays every graph of the pipeline in order (collective).
    fn replay(&self, buf: &mut Buffer) -> Result<()>;
}

/// A tensor of zeros on `buf`'s location.
fn zeroed(buf: &Buffer, dtype: DType, shape: &[usize]) -> Result<Tensor> {
    let mut t = buf.alloc(dtype, shape)?;
    t.write_bytes(&vec![0u8; shape.iter().product::<usize>() * dtype.size_bytes()])?;
    Ok(t)
}

/// The inputs every pipeline owns: `x` `bf16 [T, H]`, `topk_idx` `int64 [T, K]` (every token routed nowhere
/// until written) and `topk_weights` `float32 [T, K]`.
struct GraphInputs {
    rank: usize,
    num_experts: usize,
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
}

impl GraphInputs {
    fn new(buf: &Buffer, num_tokens: usize, hidden: usize, topk: usize, num_experts: usize) -> Result<GraphInputs> {
        let mut topk_idx = buf.alloc(DType::I64, &[num_tokens, topk])?;
        topk_idx.write_bytes(bytemuck::cast_slice(&vec![-1i64; num_tokens * topk]))?;
        Ok(GraphInputs {
            rank: buf.rank(),
            num_experts,
            x: zeroed(buf, DType::BF16, &[num_tokens, hidden])?,
            topk_idx,
            topk_weights: zeroed(buf, DType::F32, &[num_tokens, topk])?,
        })
    }

    /// Writes new values, checked like a call's arguments (lengths; top-k ids in range, distinct per token).
    fn write(&mut self, x: &[bf16], topk_idx: &[i64], topk_weights: &[f32]) -> Result<()> {
        let (shape, k) = (self.x.shape(), self.topk_idx.shape()[1]);
        check_len("x", self.rank, x.len(), shape[0] * shape[1])?;
        check_len("topk_idx", self.rank, topk_idx.len(), shape[0] * k)?;
        check_len("topk_weights", self.rank, topk_weights.len(), shape[0] * k)?;
        check_topk_values(topk_idx, k, self.num_experts, "topk_idx", self.rank)?;
        self.x.write_bytes(bytemuck::cast_slice(x))?;
        self.topk_idx.write_bytes(bytemuck::cast_slice(topk_idx))?;
        self.topk_weights.write_bytes(bytemuck::cast_slice(topk_weights))
    }
}

fn check_len(arg: &'static str, rank: usize, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::invalid(arg, rank, format!("{got} values, the pipeline was built for {want}")));
    }
    Ok(())
}

/// Runs the pipeline's operations once uncaptured with `run`, then captures them: `run` calls its `cut`
/// argument where one graph ends and the next begins. Returns the captured run's value and the graphs.
fn warm_up_and_capture<T, R>(
    buf: &mut Buffer,
    tensors: &mut T,
    mut run: impl FnMut(&mut Buffer, &mut T, &mut dyn FnMut(&mut Buffer) -> Result<()>) -> Result<R>,
) -> Result<(R, Vec<CapturedGraph>)> {
    drop(run(buf, tensors, &mut |_| Ok(()))?);
    let mut graphs = Vec::new();
    buf.begin_capture()?;
    let captured = run(buf, tensors, &mut |b: &mut Buffer| {
        graphs.push(b.end_capture()?);
        b.begin_capture()
    });
    let last = buf.end_capture();
    let value = captured?;
    graphs.push(last?);
    Ok((value, graphs))
}

// ------------------------------------------------------------------ high-throughput

/// Shape of an [`HtGraph`] on this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtGraphSpec {
    /// Tokens this rank dispatches in every replay.
    pub num_tokens: usize,
    pub hidden: usize,
    pub topk: usize,
    pub num_experts: usize,
    /// Rows of the received tensors: at least every rank's tokens together (no-sync dispatch).
    pub num_worst_tokens: usize,
    /// SMs of the dispatch and combine kernels (`None`: the buffer's default).
    pub config: Option<Config>,
}

/// The tensors of an [`HtGraph`].
struct HtTensors {
    inputs: GraphInputs,
    num_tokens_per_rank: Tensor,
    num_tokens_per_expert: Tensor,
    is_token_in_rank: Tensor,
    recv_x: Tensor,
    recv_topk_idx: Tensor,
    recv_topk_weights: Tensor,
    combined_x: Tensor,
    combined_topk_weights: Tensor,
    rank_prefix_matrix: Tensor,
    recv_src_idx: Tensor,
}

/// Layout → no-sync dispatch (bf16 rows with top-k ids and weights) → combine of the received rows with the
/// received weights, as one CUDA graph. See the [module docs](self).
pub struct HtGraph {
    spec: HtGraphSpec,
    t: HtTensors,
    handle: HtHandle,
    graph: CapturedGraph,
}

impl sealed::Sealed for HtGraph {}

impl GraphPipeline for HtGraph {
    fn replay(&self, buf: &mut Buffer) -> Result<()> {
        HtGraph::replay(self, buf)
    }
}

impl HtGraph {
    /// Allocates the pipeline's tensors on `buf`'s GPU, runs it once and captures it (collective).
    pub fn new(buf: &mut Buffer, spec: HtGraphSpec) -> Result<HtGraph> {
        if spec.num_worst_tokens == 0 {
            return Err(Error::invalid(
                "num_worst_tokens",
                buf.rank(),
                "a captured dispatch cannot wait for the counts: give the worst case",
            ));
        }
        let (t, h, k, r) = (spec.num_tokens, spec.hidden, spec.topk, buf.num_ranks());
        let mut tensors = HtTensors {
            inputs: GraphInputs::new(buf, t, h, k, spec.num_experts)?,
            num_tokens_per_rank: buf.alloc(DType::I32, &[r])?,
            num_tokens_per_expert: buf.alloc(DType::I32, &[spec.num_experts])?,
            is_token_in_rank: buf.alloc(DType::Bool, &[t, r])?,
            recv_x: buf.alloc(DType::BF16, &[spec.num_worst_tokens, h])?,
            recv_topk_idx: buf.alloc(DType::I64, &[spec.num_worst_tokens, k])?,
            recv_topk_weights: buf.alloc(DType::F32, &[spec.num_worst_tokens, k])?,
            combined_x: buf.alloc(DType::BF16, &[t, h])?,
            combined_topk_weights: buf.alloc(DType::F32, &[t, k])?,
            rank_prefix_matrix: buf.alloc(DType::I32, &[r, r])?,
            recv_src_idx: buf.alloc(DType::I32, &[spec.num_worst_tokens])?,
        };
        let (handle, mut graphs) = warm_up_and_capture(buf, &mut tensors, |b, t, _| Self::run(b, t, &spec))?;
        let graph = graphs.pop().expect("one graph per capture");
        Ok(HtGraph { spec, t: tensors, handle, graph })
    }

    /// The captured operations: layout → no-sync dispatch → combine (outputs into the tensors).
    fn run(buf: &mut Buffer, t: &mut HtTensors, spec: &HtGraphSpec) -> Result<HtHandle> {
        let layout_out = LayoutOutputs {
            num_tokens_per_rdma_rank: None,
            num_tokens_per_rank: t.num_tokens_per_rank.view_mut(),
            num_tokens_per_expert: t.num_tokens_per_expert.view_mut(),
            is_token_in_rank: t.is_token_in_rank.view_mut(),
        };
        let inputs = &t.inputs;
        buf.get_dispatch_layout_into(inputs.topk_idx.view(), spec.num_experts, layout_out)?;
        let layout = LayoutRef {
            num_tokens_per_rank: t.num_tokens_per_rank.view(),
            num_tokens_per_expert: t.num_tokens_per_expert.view(),
            is_token_in_rank: t.is_token_in_rank.view(),
        };
        let args = DispatchArgs {
            x: Payload::Bf16(inputs.x.view()),
            routing: Routing::Fresh { layout, topk_idx: Some(inputs.topk_idx.view()), topk_weights: Some(inputs.topk_weights.view()) },
            expert_alignment: 1,
            num_worst_tokens: spec.num_worst_tokens,
            config: spec.config,
        };
        let plan = buf.prepare_dispatch(&args)?;
        let out = DispatchOutputs {
            recv_x: t.recv_x.view_mut(),
            recv_scales: None,
            recv_topk_idx: Some(t.recv_topk_idx.view_mut()),
            recv_topk_weights: Some(t.recv_topk_weights.view_mut()),
            rank_prefix_matrix: Some(t.rank_prefix_matrix.view_mut()),
            recv_src_idx: Some(t.recv_src_idx.view_mut()),
            channels: None,
        };
        let handle = buf.dispatch_into(plan, &args, out)?;
        let cargs = CombineArgs {
            x: t.recv_x.view(),
            handle: &handle,
            topk_weights: Some(t.recv_topk_weights.view()),
            bias: [None, None],
            config: spec.config,
        };
        let out = CombineOutputs { combined_x: t.combined_x.view_mut(), combined_topk_weights: Some(t.combined_topk_weights.view_mut()) };
        buf.combine_into(&cargs, out)?;
        Ok(handle)
    }

    /// Writes the next replay's inputs: `x` `[T, H]`, `topk_idx` `[T, K]` (each id in `-1..num_experts`, no
    /// expert twice in a row) and `topk_weights` `[T, K]`, row-major.
    pub fn write_inputs(&mut self, x: &[bf16], topk_idx: &[i64], topk_weights: &[f32]) -> Result<()> {
        self.t.inputs.write(x, topk_idx, topk_weights)
    }

    /// Replays the graph (collective). Synchronous unless called in a [`Buffer::on_stream`] scope
    /// ([`crate::StreamScope::replay`]).
    pub fn replay(&self, buf: &mut Buffer) -> Result<()> {
        buf.replay_graph(&self.graph)
    }

    pub fn spec(&self) -> &HtGraphSpec {
        &self.spec
    }
    /// The captured dispatch's handle (its count is never known on the host).
    pub fn handle(&self) -> &HtHandle {
        &self.handle
    }
    /// `int32 [R]` of the last run.
    pub fn num_tokens_per_rank(&self) -> &Tensor {
        &self.t.num_tokens_per_rank
    }
    /// `int32 [E]`.
    pub fn num_tokens_per_expert(&self) -> &Tensor {
        &self.t.num_tokens_per_expert
    }
    /// `bool [T, R]`.
    pub fn is_token_in_rank(&self) -> &Tensor {
        &self.t.is_token_in_rank
    }
    /// `bf16 [num_worst_tokens, H]`: the received rows, then unspecified rows.
    pub fn recv_x(&self) -> &Tensor {
        &self.t.recv_x
    }
    /// `int64 [num_worst_tokens, K]`: local expert ids, `-1` past the received rows.
    pub fn recv_topk_idx(&self) -> &Tensor {
        &self.t.recv_topk_idx
    }
    /// `float32 [num_worst_tokens, K]`: zero past the received rows.
    pub fn recv_topk_weights(&self) -> &Tensor {
        &self.t.recv_topk_weights
    }
    /// `bf16 [T, H]`.
    pub fn combined_x(&self) -> &Tensor {
        &self.t.combined_x
    }
    /// `float32 [T, K]`.
    pub fn combined_topk_weights(&self) -> &Tensor {
        &self.t.combined_topk_weights
    }
    /// DeepEP's `rank_prefix_matrix`, `int32 [R, R]` ([`crate::DispatchOutputs`]).
    pub fn rank_prefix_matrix(&self) -> &Tensor {
        &self.t.rank_prefix_matrix
    }
    /// `int32 [num_worst_tokens]`: each received row's token index on its source; unspecified past the
    /// received rows.
    pub fn recv_src_idx(&self) -> &Tensor {
        &self.t.recv_src_idx
    }
}

// ------------------------------------------------------------------ low-latency

/// What an [`LlGraph`] combines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlGraphCombine {
    /// Nothing: the pipeline is a dispatch.
    None,
    /// The received rows themselves (identity experts; BF16 dispatch only).
    ReceivedRows,
    /// Expert outputs `bf16 [E_local, R*T_max, H]` written with [`LlGraph::write_expert_outputs`].
    ExpertOutputs,
}

/// How an [`LlGraph`]'s operations are cut into graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlGraphSplit {
    /// Everything in one graph.
    One,
    /// The dispatch (with its receive hook) in one graph, the combine (with its hook) in the next: expert
    /// outputs can be written between them.
    PerCall,
    /// Each phase its own graph: dispatch send, dispatch receive (the hook), combine send, combine
    /// receive. With `return_recv_hook` off, the same as `PerCall`.
    PerPhase,
}

/// Shape and form of an [`LlGraph`] on this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlGraphSpec {
    /// Tokens this rank dispatches in every replay (at most `num_max_dispatch_tokens_per_rank`).
    pub num_tokens: usize,
    pub num_max_dispatch_tokens_per_rank: usize,
    pub hidden: usize,
    pub topk: usize,
    pub num_experts: usize,
    pub quant: LlQuant,
    /// Dispatch carries the top-k weights (the combine pre-reduces on the expert side).
    pub dispatch_weights: bool,
    /// Each receive phase runs through its hook (`return_recv_hook`).
    pub return_recv_hook: bool,
    pub combine: LlGraphCombine,
    pub graphs: LlGraphSplit,
}

impl LlGraphSpec {
    fn local_experts(&self, ranks: usize) -> usize {
        self.num_experts / ranks.max(1)
    }
    fn rows(&self, ranks: usize) -> usize {
        ranks * self.num_max_dispatch_tokens_per_rank
    }
    fn scale_cols(&self) -> usize {
        self.quant.num_scale_cols(self.hidden)
    }
}

/// The tensors of an [`LlGraph`].
struct LlTensors {
    inputs: GraphInputs,
    recv_x: Tensor,
    /// Stored `[E_local, packs, R*T_max]` (the logical `[E_local, R*T_max, packs]` is column-major).
    recv_x_scales: Option<Tensor>,
    recv_count: Tensor,
    src_info: Tensor,
    layout_range: Tensor,
    expert_outputs: Option<Tensor>,
    combined_x: Option<Tensor>,
}

/// A low-latency dispatch, optionally followed by a combine, captured as one or more CUDA graphs. See the
/// [module docs](self).
pub struct LlGraph {
    spec: LlGraphSpec,
    rank: usize,
    ranks: usize,
    t: LlTensors,
    handle: LlHandle,
    graphs: Vec<CapturedGraph>,
    /// `replayed[i]`: graph `i` has run since the capture (a graph may only run once every earlier one
    /// has: it reads what they write).
    replayed: Vec<Cell<bool>>,
}

impl sealed::Sealed for LlGraph {}

impl GraphPipeline for LlGraph {
    fn replay(&self, buf: &mut Buffer) -> Result<()> {
        LlGraph::replay(self, buf)
    }
}

impl LlGraph {
    /// Allocates the pipeline's tensors on `buf`'s GPU, runs it once and captures it (collective).
    pub fn new(buf: &mut Buffer, spec: LlGraphSpec) -> Result<LlGraph> {
        let (rank, ranks) = (buf.rank(), buf.num_ranks());
        if spec.num_tokens > spec.num_max_dispatch_tokens_per_rank {
            let why =
                format!("{} tokens exceed num_max_dispatch_tokens_per_rank {}", spec.num_tokens, spec.num_max_dispatch_tokens_per_rank);
            return Err(Error::invalid("num_tokens", rank, why));
        }
        if spec.combine == LlGraphCombine::ReceivedRows && spec.quant.is_fp8() {
            return Err(Error::invalid("combine", rank, "the received rows are FP8: combine expert outputs instead"));
        }
        let (t, h, k) = (spec.num_tokens, spec.hidden, spec.topk);
        let (el, rows, cols) = (spec.local_experts(ranks), spec.rows(ranks), spec.scale_cols());
        let mut tensors = LlTensors {
            inputs: GraphInputs::new(buf, t, h, k, spec.num_experts)?,
            recv_x: buf.alloc(if spec.quant.is_fp8() { DType::Fp8E4M3 } else { DType::BF16 }, &[el, rows, h])?,
            recv_x_scales: match spec.quant {
                LlQuant::Bf16 => None,
                LlQuant::Fp8 { use_ue8m0, .. } => Some(buf.alloc(if use_ue8m0 { DType::I32 } else { DType::F32 }, &[el, cols, rows])?),
            },
            recv_count: buf.alloc(DType::I32, &[el])?,
            src_info: buf.alloc(DType::I32, &[el, rows])?,
            layout_range: buf.alloc(DType::I64, &[el, ranks])?,
            expert_outputs: match spec.combine {
                LlGraphCombine::ExpertOutputs => Some(zeroed(buf, DType::BF16, &[el, rows, h])?),
                _ => None,
            },
            combined_x: match spec.combine {
                LlGraphCombine::None => None,
                _ => Some(buf.alloc(DType::BF16, &[t, h])?),
            },
        };
        let (handle, graphs) = warm_up_and_capture(buf, &mut tensors, |b, t, cut| Self::run(b, t, &spec, cut))?;
        let replayed = graphs.iter().map(|_| Cell::new(false)).collect();
        Ok(LlGraph { spec, rank, ranks, t: tensors, handle, graphs, replayed })
    }

    /// The captured operations; `cut` ends one graph and begins the next.
    fn run(buf: &mut Buffer, t: &mut LlTensors, spec: &LlGraphSpec, cut: &mut dyn FnMut(&mut Buffer) -> Result<()>) -> Result<LlHandle> {
        let (el, rows, cols) = (spec.local_experts(buf.num_ranks()), spec.rows(buf.num_ranks()), spec.scale_cols());
        let per_phase = spec.graphs == LlGraphSplit::PerPhase;
        let inputs = &t.inputs;
        let args = LlDispatchArgs {
            x: inputs.x.view(),
            topk_idx: inputs.topk_idx.view(),
            topk_weights: spec.dispatch_weights.then(|| inputs.topk_weights.view()),
            num_max_dispatch_tokens_per_rank: spec.num_max_dispatch_tokens_per_rank,
            num_experts: spec.num_experts,
            quant: spec.quant,
            return_recv_hook: spec.return_recv_hook,
        };
        let recv_scales = match t.recv_x_scales.as_mut() {
            Some(s) => Some(s.view_mut_strided(&[el, rows, cols], &[(cols * rows) as isize, 1, rows as isize])?),
            None => None,
        };
        let out = LlDispatchOutputs {
            recv_x: t.recv_x.view_mut(),
            recv_scales,
            recv_count: t.recv_count.view_mut(),
            cumulative_local_expert_recv_stats: None,
            dispatch_wait_recv_cost_stats: None,
            src_info: Some(t.src_info.view_mut()),
            layout_range: Some(t.layout_range.view_mut()),
        };
        // In a block: an unrun hook (dropped at the block's end) keeps the outputs borrowed.
        let handle = {
            let (handle, hook) = buf.low_latency_dispatch_into(&args, out)?;
            if let Some(hook) = hook {
                if per_phase {
                    cut(buf)?;
                }
                buf.run_hook(hook)?;
            }
            handle
        };
        let x = match (spec.combine, t.expert_outputs.as_ref()) {
            (LlGraphCombine::None, _) => return Ok(handle),
            (LlGraphCombine::ExpertOutputs, Some(y)) => y.view(),
            _ => t.recv_x.view(),
        };
        let Some(combined_x) = t.combined_x.as_mut() else { return Ok(handle) };
        if spec.graphs != LlGraphSplit::One {
            cut(buf)?;
        }
        let cargs = LlCombineArgs {
            x,
            topk_idx: inputs.topk_idx.view(),
            topk_weights: inputs.topk_weights.view(),
            handle: &handle,
            zero_copy: false,
            return_recv_hook: spec.return_recv_hook,
        };
        let hook = buf
            .low_latency_combine_into(&cargs, LlCombineOutputs { combined_x: combined_x.view_mut(), combine_wait_recv_cost_stats: None })?;
        if let Some(hook) = hook {
            if per_phase {
                cut(buf)?;
            }
            buf.run_hook(hook)?;
        }
        Ok(handle)
    }

    /// Writes the next replay's inputs: `x` `[T, H]`, `topk_idx` `[T, K]` (each id in `-1..num_experts`, no
    /// expert twice in a row) and `topk_weights` `[T, K]`, row-major.
    pub fn write_inputs(&mut self, x: &[bf16], topk_idx: &[i64], topk_weights: &[f32]) -> Result<()> {
        self.t.inputs.write(x, topk_idx, topk_weights)
    }

    /// Writes the expert outputs the combine reads (`LlGraphCombine::ExpertOutputs`), `bf16 [E_local,
    /// R*T_max, H]` row-major (rows past each expert's count are ignored).
    pub fn write_expert_outputs(&mut self, y: &[bf16]) -> Result<()> {
        let want = self.spec.local_experts(self.ranks) * self.spec.rows(self.ranks) * self.spec.hidden;
        let Some(t) = self.t.expert_outputs.as_mut() else {
            return Err(Error::invalid("expert_outputs", self.rank, "the pipeline combines no expert outputs"));
        };
        check_len("expert_outputs", self.rank, y.len(), want)?;
        t.write_bytes(bytemuck::cast_slice(y))
    }

    /// Graphs of the pipeline, in order (see [`LlGraphSplit`]).
    pub fn num_graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Replays every graph in order (collective). Synchronous unless called in a [`Buffer::on_stream`] scope
    /// ([`crate::StreamScope::replay`]).
    pub fn replay(&self, buf: &mut Buffer) -> Result<()> {
        (0..self.graphs.len()).try_for_each(|i| self.replay_graph(buf, i))
    }

    /// Replays graph `index` alone (collective), e.g. to time one phase: every earlier graph must have run
    /// since the capture (it reads what they write).
    pub fn replay_graph(&self, buf: &mut Buffer, index: usize) -> Result<()> {
        let Some(graph) = self.graphs.get(index) else {
            return Err(Error::invalid("index", self.rank, format!("graph {index} of a {}-graph pipeline", self.graphs.len())));
        };
        if index > 0 && !self.replayed[index - 1].get() {
            return Err(Error::invalid("index", self.rank, format!("graph {index} before graph {} ever ran", index - 1)));
        }
        buf.replay_graph(graph)?;
        self.replayed[index].set(true);
        Ok(())
    }

    pub fn spec(&self) -> &LlGraphSpec {
        &self.spec
    }
    /// The captured dispatch's handle.
    pub fn handle(&self) -> &LlHandle {
        &self.handle
    }
    /// `[E_local, R*T_max, H]`, FP8 or bf16: valid rows up to each expert's count.
    pub fn recv_x(&self) -> &Tensor {
        &self.t.recv_x
    }
    /// FP8 scales, stored `[E_local, packs, R*T_max]` (`float32`, or `int32` of four UE8M0 bytes).
    pub fn recv_x_scales(&self) -> Option<&Tensor> {
        self.t.recv_x_scales.as_ref()
    }
    /// `int32 [E_local]`.
    pub fn recv_count(&self) -> &Tensor {
        &self.t.recv_count
    }
    /// DeepEP's `src_info`, `int32 [E_local, R*T_max]` ([`crate::LlDispatchOutputs`]): valid up to each
    /// expert's count.
    pub fn src_info(&self) -> &Tensor {
        &self.t.src_info
    }
    /// DeepEP's `layout_range`, `int64 [E_local, R]` ([`crate::LlDispatchOutputs`]).
    pub fn layout_range(&self) -> &Tensor {
        &self.t.layout_range
    }
    /// `bf16 [T, H]` when the pipeline combines.
    pub fn combined_x(&self) -> Option<&Tensor> {
        self.t.combined_x.as_ref()
    }
}
