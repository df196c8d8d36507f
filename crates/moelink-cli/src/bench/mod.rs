//! `moelink bench`: dispatch/combine timings at DeepEP's benchmark shapes, correctness checked first.
//!
//! Every rank is a thread of this process (one GPU each on CUDA). A run is a list of batches, one per
//! (mode, shape, routing); for each, the inputs of all ranks are generated once from the seed together with
//! the results they must produce ([`moelink_testkit::inputs`]); each rank then creates its buffer (sized once per run for the
//! largest shape of its mode) and, case by case, runs the operation once and checks it (always against
//! those backend-independent expectations, on CUDA also bit for bit against the host backend on the same
//! inputs), then times warm-up + repetitions, each in its own [`moelink::Buffer::timed`] region (a barrier
//! of all ranks, then CUDA events on the device or the wall clock on the host):
//!
//! - HT dispatch: `prepare_dispatch` + `dispatch_into` in CPU-sync mode (the count exchange, the host's
//!   wait for it and the dispatch kernel) into the checked call's outputs; then, as `cached_us`, the cached
//!   dispatch of the same payload with that call's handle (no count exchange, no host wait, no top-k; its
//!   rows checked bit for bit against the fresh call's) — what DeepEP's benchmark times
//!   (`buffer.dispatch(x, handle=handle)` in its tests' tuning loop). HT combine: `combine_into` into the
//!   checked call's output. Nothing is allocated while timing.
//! - LL on CUDA: the call captured once into a CUDA graph (outputs of the checked call), each repetition
//!   one timed replay; with `--hook` the send phase and the receive phase (`run_hook`) as two graphs, timed
//!   apart. On the host backend the plain calls. With `MOELINK_LL_TRACE=1` also each kernel's span from the
//!   in-kernel trace (`kernel_us`, with the trace points), and DeepEP's way of timing: a graph of dispatch +
//!   combine replayed back to back on an asynchronous stream, no barrier or L2 flush between calls, each
//!   kernel's span (`loop_dispatch_kernel_us`, `loop_combine_kernel_us`, `loop_pair_us`) and trace points
//!   (`loop_dispatch_trace`, `loop_combine_trace`).
//!
//! The reported time is the median over repetitions of the slowest rank: per repetition the largest time of
//! any rank, then the median of those.

mod accounting;
mod args;
pub mod bytes;
mod ht;
mod ll;
pub mod nvlink;
mod plan;
pub mod plot;
mod process;
mod render;
mod stats;
pub mod transport;

use accounting::*;
pub use args::*;
use plan::*;
pub use plan::{Case, Dtype, Mode, Op};
use render::*;
use stats::*;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use moelink::{BackendKind, Buffer, BufferOptions, Result};

use crate::record::{self, Record, RunFacts, Status};
use crate::table::{num, Table};
use crate::{sys, CliError};
use moelink_testkit::inputs::{Inputs, Shape};
use moelink_testkit::RouteKind;

/// What one rank saw for one case.
#[derive(Debug, Default)]
pub struct RankOutcome {
    /// Timed repetitions, microseconds (empty when not timed).
    pub times_us: Vec<f64>,
    /// How they were taken: `"cuda-events"`, `"cuda-graph-events"` or `"wall"`.
    pub timer: Option<&'static str>,
    /// Correctness failures (empty = correct).
    pub failures: Vec<String>,
    /// `Some(why)` when the backend cannot run this case.
    pub unavailable: Option<String>,
    /// The operation failed with this error.
    pub error: Option<String>,
    /// SMs actually used (HT).
    pub num_sms: Option<usize>,
    /// Whether the result matched the host backend bit for bit (CUDA only).
    pub matches_host: Option<bool>,
    /// Receive-hook mode (LL, `--hook`): send-phase times, microseconds.
    pub send_us: Vec<f64>,
    /// Receive-hook mode: receive-phase (`run_hook`) times, microseconds.
    pub recv_us: Vec<f64>,
    /// HT dispatch: times of the cached dispatch (the call's handle re-used), microseconds.
    pub cached_us: Vec<f64>,
    /// LL with `MOELINK_LL_TRACE=1`: kernel traces of the timed repetitions (fused call; hook send; hook
    /// receive), whose spans are the kernels' durations without the launch.
    pub traces: [Vec<moelink::trace::KernelTrace>; 3],
    /// LL combine with `MOELINK_LL_TRACE=1`: DeepEP's way of timing — dispatch + combine back to back,
    /// kernel durations: [dispatch spans, combine spans, event µs per pair].
    pub loop_times: [Vec<f64>; 3],
    /// The same regions' kernel traces, [dispatch, combine]: where the time goes with no barrier between
    /// calls (the per-call traces above start every call after a barrier, so a late peer shows there).
    pub loop_traces: [Vec<moelink::trace::KernelTrace>; 2],
}

/// Everything a rank worker needs, shared by reference across rank threads.
pub struct Job<'a> {
    /// Inputs of every rank and the expected results.
    pub inputs: &'a Inputs,
    /// Cases to run, in order (the same on every rank).
    pub cases: &'a [Case],
    /// Backend to measure.
    pub backend: BackendKind,
    /// Also run the host backend on the same inputs and compare bit for bit (CUDA).
    pub host_check: bool,
    /// Untimed repetitions.
    pub warmup: usize,
    /// Timed repetitions.
    pub reps: usize,
    /// LL: also time receive-hook mode.
    pub hook: bool,
    /// LL: dispatch carries the top-k weights, so combine pre-reduces on the expert side (else per expert).
    pub ll_dispatch_weights: bool,
    /// Ticked once per repetition by rank 0.
    pub progress: &'a ProgressBar,
    /// What every buffer starts from (backend and sizes are set per buffer): tracing and tuning.
    pub base: &'a BufferOptions,
}

impl Job<'_> {
    /// Runs `op` warm-up + reps times, each in its own [`Buffer::timed`] region (a barrier of all ranks,
    /// then device events on CUDA or the wall clock on the host); returns the timed repetitions' µs.
    pub fn time(&self, buf: &mut Buffer, op: impl FnMut(&mut Buffer) -> Result<()>) -> Result<Vec<f64>> {
        self.time_reps(buf, op, true)
    }

    /// [`Job::time`] for a second measurement of a case, which the progress bar does not count.
    pub fn time_quietly(&self, buf: &mut Buffer, op: impl FnMut(&mut Buffer) -> Result<()>) -> Result<Vec<f64>> {
        self.time_reps(buf, op, false)
    }

    fn time_reps(&self, buf: &mut Buffer, mut op: impl FnMut(&mut Buffer) -> Result<()>, counted: bool) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(self.reps);
        for i in 0..self.warmup + self.reps {
            let ((), us) = buf.timed(&mut op)?;
            if self.base.kernel_tracing.high_throughput {
                print_ht_traces(buf);
            }
            if i >= self.warmup {
                times.push(us);
            }
            if counted {
                self.tick(buf.rank());
            }
        }
        Ok(times)
    }

    /// Counts one repetition on the progress bar (rank 0 only).
    pub fn tick(&self, rank: usize) {
        if rank == 0 {
            self.progress.inc(1);
        }
    }

    /// Advances the progress bar past a case that will not be timed.
    pub fn skip(&self, rank: usize) {
        if rank == 0 {
            self.progress.inc((self.warmup + self.reps) as u64);
        }
    }
}

/// Turns an operation's result into either a value or a finished outcome (unavailable / failed).
pub fn settle<T>(r: Result<T>, out: &mut RankOutcome) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(moelink::Error::Unavailable(why)) => {
            out.unavailable = Some(why);
            None
        }
        Err(e) => {
            out.error = Some(e.to_string());
            None
        }
    }
}

/// Runs `moelink bench`.
pub fn run(a: &BenchArgs) -> std::result::Result<(), CliError> {
    // Every buffer of the run starts from these: the environment's tracing and tuning, and --ll-trace.
    let mut base = crate::env::buffer_options();
    base.kernel_tracing.low_latency |= a.ll_trace;
    let group: Option<Arc<dyn moelink::Group>> = if a.process {
        let g = moelink::TcpGroup::from_env().map_err(|e| CliError(format!("--process: cannot join the process group: {e}")))?;
        Some(Arc::new(g))
    } else {
        None
    };
    let p = plan(a, group.as_ref().map(|g| g.size()))?;
    // In process mode every rank measures; rank 0 alone reports.
    let quiet = group.as_ref().is_some_and(|g| g.rank() != 0);
    // Where the results go is checked before anything is measured: a bad path must not cost the run.
    if let Some(path) = a.json.as_ref().filter(|_| !quiet) {
        record::check_output("--json", path, None).map_err(CliError)?;
    }
    let mut plot_with = Vec::new();
    if let Some(path) = a.plot.as_ref().filter(|_| !quiet) {
        record::check_output("--plot", path, Some("png")).map_err(CliError)?;
        for extra in &a.plot_with {
            plot_with.push(plot::other_run(extra, record::read_json(extra).map_err(|e| CliError(format!("--plot-with {e}")))?));
        }
    }
    if let Some((topology, rdma)) = &p.internode {
        base.topology = Some(*topology);
        base.rdma = rdma.clone();
    }
    let facts = RunFacts {
        system: "moelink".into(),
        backend: sys::backend_name(p.backend).into(),
        device: sys::device_name(p.backend),
        gpus: p.gpus,
        date: sys::utc_now(),
        commit: sys::commit(),
    };
    let (num_nvl_bytes, num_rdma_bytes) = buffer_bytes(&p.batches, p.internode.as_ref().map(|(t, _)| *t));
    if !quiet {
        println!("{}", header(&p, &facts, num_nvl_bytes, num_rdma_bytes));
    }
    let all_cases: Vec<Vec<Case>> = p.batches.iter().map(cases).collect();
    let total = (all_cases.iter().map(Vec::len).sum::<usize>() * (p.warmup + p.reps)) as u64;
    let progress = if std::io::stderr().is_terminal() && !quiet { ProgressBar::new(total) } else { ProgressBar::hidden() };
    progress.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} reps  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut records = Vec::new();
    let started = Instant::now();
    for (i, (batch, case_list)) in p.batches.iter().zip(&all_cases).enumerate() {
        let batch_start = Instant::now();
        let what = format!("{} {} tokens {}", batch.mode.name(), batch.shape.tokens, batch.routing.name());
        progress.set_message(format!("{what}: inputs"));
        let want_fp8_payload = batch.mode == Mode::Ht && batch.dtypes.contains(&Dtype::Fp8);
        let nodes = p.internode.as_ref().map_or(1, |(t, _)| t.num_nodes);
        let inputs = Inputs::generate(batch.shape, batch.routing.kind(nodes, a.max_nodes), a.seed, want_fp8_payload);
        progress.set_message(what.clone());
        let job = Job {
            inputs: &inputs,
            cases: case_list,
            backend: p.backend,
            host_check: p.backend == BackendKind::Cuda && !a.no_host_check,
            warmup: p.warmup,
            reps: p.reps,
            hook: a.hook,
            ll_dispatch_weights: !a.ll_per_expert,
            progress: &progress,
            base: &base,
        };
        let run_rank = |g: Arc<dyn moelink::Group>| match batch.mode {
            Mode::Ht => ht::run_rank(g, &job, num_nvl_bytes, num_rdma_bytes),
            Mode::Ll => ll::run_rank(g, &job, num_rdma_bytes),
        };
        let results = match &group {
            Some(g) => process::gather(g.as_ref(), run_rank(g.clone())).map_err(|e| CliError(format!("--process: {e}")))?,
            None => {
                let timeout = Duration::from_secs(a.timeout_s.max(1));
                moelink::group::run_ranks_with_timeout(p.ranks, timeout, |g| run_rank(Arc::new(g)))
            }
        };
        if quiet {
            continue;
        }
        let mut new = summarize(case_list, &inputs, &results, &facts, &p, a);
        if batch.mode == Mode::Ll {
            let rows = if a.ll_per_expert { "per_expert" } else { "pre_reduced" };
            for r in new.iter_mut().filter(|r| r.op == "combine") {
                r.extra.insert("ll_combine".into(), serde_json::json!(rows));
            }
        }
        // Tuning and experiments act on the CUDA kernels only (the host backend ignores them).
        if p.backend == BackendKind::Cuda {
            for r in &mut new {
                r.extra.extend(crate::env::record_fields(&base.tuning).into_iter().map(|(k, v)| (k.to_string(), v)));
            }
        }
        let failed = new.iter().filter(|r| !matches!(r.status, Status::Ok | Status::Unavailable)).count();
        let line = format!(
            "batch {}/{}: {what}, {} cases{} in {:.1} s (total {:.1} s)",
            i + 1,
            p.batches.len(),
            new.len(),
            if failed > 0 { format!(", {failed} FAILED") } else { String::new() },
            batch_start.elapsed().as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        if progress.is_hidden() {
            println!("{line}");
        } else {
            progress.println(line);
        }
        records.extend(new);
        if let Some(path) = &a.json {
            record::write_json(path, &records).map_err(CliError)?;
        }
    }
    progress.finish_and_clear();
    if quiet {
        return Ok(());
    }

    println!("{}", render(&records, p.backend));
    if let Some(path) = &a.json {
        println!("wrote {} records to {}", records.len(), path.display());
    }
    if let Some(path) = &a.plot {
        let mut all = records.clone();
        all.extend(plot_with.into_iter().flatten());
        plot::draw(path, &all, a.plot_metric).map_err(CliError)?;
        println!("wrote the plot to {}", path.display());
    }
    let bad: Vec<&Record> = records.iter().filter(|r| matches!(r.status, Status::Incorrect | Status::Error)).collect();
    if !bad.is_empty() {
        return Err(CliError(format!(
            "{} of {} measurements failed (first: {} {} {}: {})",
            bad.len(),
            records.len(),
            bad[0].mode,
            bad[0].op,
            bad[0].dtype.as_deref().unwrap_or("-"),
            bad[0].error.as_deref().unwrap_or("?")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs the result checks must accept (seed 1) and inputs of the same shape they must reject (seed 2).
    pub(super) fn good_and_other(shape: Shape, fp8: bool) -> (Inputs, Inputs) {
        (Inputs::generate(shape, RouteKind::Uniform, 1, fp8), Inputs::generate(shape, RouteKind::Uniform, 2, fp8))
    }

    /// Runs `checks` on both ranks of a host-backend group (buffers of `opts`) and asserts the (check on the
    /// truth, check on other inputs) pairs it returns: the first finds nothing, the second finds something.
    pub(super) fn assert_checks_on_host<F>(opts: moelink::BufferOptions, checks: F)
    where
        F: Fn(&mut Buffer, usize) -> moelink::Result<Vec<(Vec<String>, Vec<String>)>> + Sync,
    {
        let per_rank = moelink::group::run_ranks(2, |g| {
            let me = moelink::Group::rank(&g);
            let mut buf = Buffer::new(std::sync::Arc::new(g), moelink::BufferOptions { backend: BackendKind::Host, ..opts.clone() })?;
            checks(&mut buf, me)
        });
        for (rank, r) in per_rank.into_iter().enumerate() {
            let pairs = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            for (i, (truth, wrong)) in pairs.into_iter().enumerate() {
                assert!(truth.is_empty(), "rank {rank} check {i}: {truth:?}");
                assert!(!wrong.is_empty(), "rank {rank} check {i} accepted results for other inputs");
            }
        }
    }
}
