//! `moelink bench`: dispatch/combine timings at DeepEP's benchmark shapes, correctness checked first.
//!
//! Every rank is a thread of this process (one GPU each on CUDA). For each (mode, routing) the inputs of all
//! ranks are generated once from the seed together with the results they must produce ([`inputs`]); each
//! rank then creates its buffer and, case by case, runs the operation once and checks it (always against
//! those backend-independent expectations, on CUDA also bit for bit against the host backend on the same
//! inputs), then times warm-up + repetitions with a group barrier before each. The reported time is the
//! median over repetitions of the slowest rank.

mod ht;
pub mod inputs;
mod ll;
pub mod nvlink;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use moelink::{BackendKind, Group, Result};

use crate::record::{self, Record, RunFacts, Status};
use crate::rng::RoutingKind;
use crate::table::{num, Table};
use crate::{sys, CliError};
use inputs::{Inputs, Shape};

/// `moelink bench [OPTIONS]` or `moelink bench nvlink [OPTIONS]`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchCmd {
    /// `nvlink`, or none for the dispatch/combine bench.
    #[command(subcommand)]
    pub probe: Option<BenchSub>,
    /// Options of the dispatch/combine bench.
    #[command(flatten)]
    pub args: BenchArgs,
}

/// Diagnostics under `bench`.
#[derive(Subcommand, Debug)]
pub enum BenchSub {
    /// NVLink copy bandwidth, cross-GPU barrier latency and JIT compile times (GPU diagnostics).
    Nvlink(nvlink::NvlinkArgs),
}

/// Which regime to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeSel {
    /// High-throughput (training / prefill).
    Ht,
    /// Low-latency (decode).
    Ll,
    /// Both.
    All,
}

/// Dispatch payload types to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeSel {
    /// bf16 rows.
    Bf16,
    /// FP8 E4M3 rows with one fp32 scale per 128 channels.
    Fp8,
    /// Both.
    All,
}

/// Backend choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendSel {
    /// CUDA when usable, else the host backend.
    Auto,
    /// CPU threads (the reference implementation; its times say nothing about GPUs).
    Host,
    /// CUDA kernels (fails when unavailable).
    Cuda,
}

impl BackendSel {
    fn kind(self) -> BackendKind {
        match self {
            BackendSel::Auto => BackendKind::Auto,
            BackendSel::Host => BackendKind::Host,
            BackendSel::Cuda => BackendKind::Cuda,
        }
    }
}

/// Options of `moelink bench`. Sizes left out take DeepEP's benchmark shapes (HT: 4096 tokens per rank,
/// hidden 7168, top-8 of 256 experts; LL: 128 tokens, hidden 7168, top-8 of 288, FP8 dispatch), or small
/// ones with `--quick`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Regime: ht, ll or all.
    #[arg(long, value_enum, default_value_t = ModeSel::All)]
    pub mode: ModeSel,
    /// Tokens per rank (default: HT 4096, LL 128).
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Hidden size (default: 7168).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Experts per token (default: 8).
    #[arg(long)]
    pub topk: Option<usize>,
    /// Experts in total (default: HT 256, LL 288).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Ranks (default: number of GPUs; 4 on the host backend).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Dispatch payload: bf16, fp8 or all (default: HT all, LL fp8). Combine is always bf16.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeSel>,
    /// Routing, comma-separated: uniform (scores |randn|+1, top-k) and/or skewed.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "uniform")]
    pub routing: Vec<RoutingKind>,
    /// SMs for HT kernels, comma-separated for a sweep (default: the backend's default).
    #[arg(long = "num-sms", value_delimiter = ',')]
    pub num_sms: Vec<usize>,
    /// Timed repetitions (default: CUDA 30; host 5; --quick 3).
    #[arg(long)]
    pub reps: Option<usize>,
    /// Untimed warm-up repetitions (default: CUDA 5; host and --quick 1).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Backend: auto, host or cuda.
    #[arg(long, value_enum, default_value_t = BackendSel::Auto)]
    pub backend: BackendSel,
    /// Write one JSON record per measurement to FILE (a JSON list).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Small sizes for CI and smoke tests (HT 256 tokens, LL 32 tokens, hidden 1024, top-8 of 64).
    #[arg(long)]
    pub quick: bool,
    /// Seed of the inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Per-GPU ingress ceiling in GB/s (from `moelink bench nvlink`): adds `pct_of_p2p_ceiling` to records.
    #[arg(long, value_name = "GBPS")]
    pub p2p_ceiling_gbps: Option<f64>,
    /// On CUDA, skip the bitwise comparison against the host backend.
    #[arg(long)]
    pub no_host_check: bool,
    /// Seconds a rank waits for the others in a collective before giving up.
    #[arg(long, default_value_t = 120)]
    pub timeout_s: u64,
    /// LL: also time receive-hook mode, the send phase and the receive phase apart (records get
    /// `send_us` and `recv_us`).
    #[arg(long)]
    pub hook: bool,
}

/// Regime of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// High-throughput.
    Ht,
    /// Low-latency.
    Ll,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Ht => "ht",
            Mode::Ll => "ll",
        }
    }
}

/// Collective of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Tokens to the experts' ranks.
    Dispatch,
    /// Expert outputs back, summed.
    Combine,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
        }
    }
}

/// Payload type of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// bf16.
    Bf16,
    /// FP8 E4M3 + fp32 scales.
    Fp8,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }
}

/// One measurement to make.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    /// Regime.
    pub mode: Mode,
    /// Collective.
    pub op: Op,
    /// Payload type.
    pub dtype: Dtype,
    /// Routing of the inputs.
    pub routing: RoutingKind,
    /// HT: `Some(n)` from `--num-sms`, `None` for the backend's default. Always `None` for LL.
    pub num_sms: Option<usize>,
}

/// What one rank saw for one case.
#[derive(Debug, Default)]
pub struct RankOutcome {
    /// Timed repetitions, microseconds (empty when not timed).
    pub times_us: Vec<f64>,
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
    /// Ticked once per repetition by rank 0.
    pub progress: &'a ProgressBar,
}

impl Job<'_> {
    /// Times `op` on this rank: a group barrier, then the wall clock around the call.
    ///
    /// Seam for CUDA events: once the CUDA backend exposes its stream, record an event before and after the
    /// call there and report the elapsed device time instead (and set the records' `timer` accordingly).
    pub fn time(&self, group: &dyn Group, mut op: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(self.reps);
        for i in 0..self.warmup + self.reps {
            group.barrier()?;
            let t0 = Instant::now();
            op()?;
            let dt = t0.elapsed().as_secs_f64() * 1e6;
            if i >= self.warmup {
                times.push(dt);
            }
            if group.rank() == 0 {
                self.progress.inc(1);
            }
        }
        Ok(times)
    }

    /// Advances the progress bar past a case that will not be timed.
    pub fn skip(&self, group: &dyn Group) {
        if group.rank() == 0 {
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

/// Communication buffer bytes asked for: room for every rank's tokens at full width (the direct-write
/// protocol's worst case), twice for LL's double buffering. The CUDA backend may round up.
fn buffer_bytes(s: &Shape, mode: Mode) -> usize {
    let row = s.hidden * 2 + s.scale_cols() * 4 + s.topk * 12 + 64;
    let bytes = s.ranks * s.tokens * row * if mode == Mode::Ll { 4 } else { 1 };
    bytes.div_ceil(1 << 20) << 20
}

/// The resolved plan of one bench run.
struct Plan {
    backend: BackendKind,
    fallback_reason: Option<String>,
    ranks: usize,
    reps: usize,
    warmup: usize,
    /// (mode, shape, dtypes) to run.
    modes: Vec<(Mode, Shape, Vec<Dtype>)>,
    routings: Vec<RoutingKind>,
    sms: Vec<Option<usize>>,
}

fn plan(a: &BenchArgs) -> std::result::Result<Plan, CliError> {
    let (backend, fallback_reason) = sys::resolve_backend(a.backend.kind()).map_err(CliError)?;
    let gpus = sys::gpu_count();
    let ranks = match (a.ranks, backend) {
        (Some(r), _) => r,
        (None, BackendKind::Cuda) if gpus > 0 => gpus,
        (None, BackendKind::Cuda) => return Err(CliError("cannot tell how many GPUs there are; pass --ranks".into())),
        (None, _) => 4,
    };
    if ranks == 0 {
        return Err(CliError("--ranks must be at least 1".into()));
    }
    if backend == BackendKind::Cuda && gpus > 0 && ranks > gpus {
        return Err(CliError(format!("--ranks {ranks} needs {ranks} GPUs, this machine has {gpus}")));
    }
    let cuda = backend == BackendKind::Cuda;
    let reps = a.reps.unwrap_or(if a.quick {
        3
    } else if cuda {
        30
    } else {
        5
    });
    let warmup = a.warmup.unwrap_or(if cuda && !a.quick { 5 } else { 1 });
    if reps == 0 {
        return Err(CliError("--reps must be at least 1".into()));
    }
    for &n in &a.num_sms {
        if n < 2 || n % 2 != 0 {
            return Err(CliError(format!("--num-sms {n}: SM counts must be even and at least 2")));
        }
    }
    let mut modes = Vec::new();
    let wanted: &[Mode] = match a.mode {
        ModeSel::Ht => &[Mode::Ht],
        ModeSel::Ll => &[Mode::Ll],
        ModeSel::All => &[Mode::Ht, Mode::Ll],
    };
    for &mode in wanted {
        let (t, e) = match (mode, a.quick) {
            (Mode::Ht, false) => (4096, 256),
            (Mode::Ll, false) => (128, 288),
            (Mode::Ht, true) => (256, 64),
            (Mode::Ll, true) => (32, 64),
        };
        let shape = Shape {
            ranks,
            tokens: a.tokens.unwrap_or(t),
            hidden: a.hidden.unwrap_or(if a.quick { 1024 } else { 7168 }),
            topk: a.topk.unwrap_or(8),
            experts: a.experts.unwrap_or(e),
        };
        let dtypes = match (a.dtype, mode) {
            (Some(DtypeSel::Bf16), _) => vec![Dtype::Bf16],
            (Some(DtypeSel::Fp8), _) | (None, Mode::Ll) => vec![Dtype::Fp8],
            (Some(DtypeSel::All), _) | (None, Mode::Ht) => vec![Dtype::Bf16, Dtype::Fp8],
        };
        check_shape(mode, &shape, &dtypes)?;
        modes.push((mode, shape, dtypes));
    }
    let mut routings = a.routing.clone();
    routings.dedup();
    let sms = if a.num_sms.is_empty() { vec![None] } else { a.num_sms.iter().map(|&n| Some(n)).collect() };
    Ok(Plan { backend, fallback_reason, ranks, reps, warmup, modes, routings, sms })
}

fn check_shape(mode: Mode, s: &Shape, dtypes: &[Dtype]) -> std::result::Result<(), CliError> {
    let m = mode.name();
    let err = |msg: String| Err(CliError(format!("{m}: {msg}")));
    if s.tokens == 0 {
        return err("--tokens must be at least 1".into());
    }
    if s.topk == 0 || s.topk > s.experts {
        return err(format!("--topk {} must be between 1 and the number of experts ({})", s.topk, s.experts));
    }
    if s.experts % s.ranks != 0 {
        return err(format!("--experts {} must be a multiple of the {} ranks", s.experts, s.ranks));
    }
    if s.hidden == 0 || s.hidden % 8 != 0 {
        return err(format!("--hidden {} must be a positive multiple of 8 (rows of 16-byte multiples)", s.hidden));
    }
    if dtypes.contains(&Dtype::Fp8) && s.hidden % 128 != 0 {
        return err(format!("--hidden {} must be a multiple of 128 for FP8 (one scale per 128 channels)", s.hidden));
    }
    Ok(())
}

/// Cases of one (mode, routing), in the order the rank workers run them.
fn cases(mode: Mode, dtypes: &[Dtype], routing: RoutingKind, sms: &[Option<usize>]) -> Vec<Case> {
    let mut out = Vec::new();
    match mode {
        Mode::Ht => {
            for &num_sms in sms {
                for &dtype in dtypes {
                    out.push(Case { mode, op: Op::Dispatch, dtype, routing, num_sms });
                }
                out.push(Case { mode, op: Op::Combine, dtype: Dtype::Bf16, routing, num_sms });
            }
        }
        Mode::Ll => {
            for &dtype in dtypes {
                out.push(Case { mode, op: Op::Dispatch, dtype, routing, num_sms: None });
            }
            out.push(Case { mode, op: Op::Combine, dtype: Dtype::Bf16, routing, num_sms: None });
        }
    }
    out
}

/// Bytes per rank (mean over ranks) that a case moves: (logical, wire).
fn bytes_moved(case: &Case, inputs: &Inputs) -> (f64, f64) {
    let s = &inputs.shape;
    let r = &inputs.reference;
    let n = s.ranks as f64;
    match case.mode {
        Mode::Ht => {
            let row = match (case.op, case.dtype) {
                (Op::Dispatch, Dtype::Fp8) => s.hidden + s.scale_cols() * 4,
                _ => 2 * s.hidden,
            } as f64;
            let recv: usize = r.recv_rows.iter().map(|v| v.len()).sum();
            let own: usize = (0..s.ranks).map(|k| r.own_rows(k)).sum();
            (recv as f64 * row / n, (recv - own) as f64 * row / n)
        }
        Mode::Ll => {
            let row = match (case.op, case.dtype) {
                // DeepEP counts 16 bytes of per-token metadata with each FP8 row.
                (Op::Dispatch, Dtype::Fp8) => s.hidden + s.scale_cols() * 4 + 16,
                _ => 2 * s.hidden,
            } as f64;
            let sel: usize = r.selections.iter().sum();
            let cross: usize = r.cross_pairs.iter().sum();
            (sel as f64 * row / n, cross as f64 * row / n)
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median over repetitions of the slowest rank.
fn slowest_rank_median(per_rank: &[Vec<f64>]) -> f64 {
    let reps = per_rank.iter().map(|v| v.len()).min().unwrap_or(0);
    median((0..reps).map(|i| per_rank.iter().map(|v| v[i]).fold(0.0, f64::max)).collect())
}

/// Runs `moelink bench`.
pub fn run(a: &BenchArgs) -> std::result::Result<(), CliError> {
    let p = plan(a)?;
    let facts = RunFacts {
        system: "moelink".into(),
        backend: sys::backend_name(p.backend).into(),
        device: sys::device_name(p.backend),
        gpus: if p.backend == BackendKind::Cuda { p.ranks } else { 0 },
        date: sys::utc_now(),
        commit: sys::commit(),
    };
    println!("{}", header(&p, &facts));
    let per_routing: usize = p
        .modes
        .iter()
        .map(|(mode, _, dtypes)| match mode {
            Mode::Ht => p.sms.len() * (dtypes.len() + 1),
            Mode::Ll => dtypes.len() + 1,
        })
        .sum();
    let total = (per_routing * p.routings.len() * (p.warmup + p.reps)) as u64;
    let progress = if std::io::stderr().is_terminal() { ProgressBar::new(total) } else { ProgressBar::hidden() };
    progress.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} reps  {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut records = Vec::new();
    for (mode, shape, dtypes) in &p.modes {
        for &routing in &p.routings {
            progress.set_message(format!("{} {} inputs", mode.name(), routing.name()));
            let want_fp8_payload = *mode == Mode::Ht && dtypes.contains(&Dtype::Fp8);
            let inputs = Inputs::generate(*shape, routing, a.seed, want_fp8_payload);
            let case_list = cases(*mode, dtypes, routing, &p.sms);
            progress.set_message(format!("{} {}", mode.name(), routing.name()));
            let job = Job {
                inputs: &inputs,
                cases: &case_list,
                backend: p.backend,
                host_check: p.backend == BackendKind::Cuda && !a.no_host_check,
                warmup: p.warmup,
                reps: p.reps,
                hook: a.hook,
                progress: &progress,
            };
            let timeout = Duration::from_secs(a.timeout_s.max(1));
            let results = crate::ranks::run_threads(p.ranks, timeout, |g| match mode {
                Mode::Ht => ht::run_rank(g, &job, buffer_bytes(shape, Mode::Ht)),
                Mode::Ll => ll::run_rank(g, &job, buffer_bytes(shape, Mode::Ll)),
            });
            records.extend(summarize(&case_list, &inputs, &results, &facts, &p, a));
        }
    }
    progress.finish_and_clear();

    println!("{}", render(&records));
    for r in records.iter().filter(|r| r.extra.contains_key("send_us")) {
        let us = |k: &str| r.extra.get(k).and_then(|v| v.as_f64()).map_or("-".into(), num);
        println!(
            "receive-hook mode, {} {} {} {}: send {} µs + receive {} µs",
            r.mode,
            r.op,
            r.dtype.as_deref().unwrap_or("-"),
            r.routing.as_deref().unwrap_or("-"),
            us("send_us"),
            us("recv_us")
        );
    }
    if let Some(path) = &a.json {
        record::write_json(path, &records).map_err(CliError)?;
        println!("wrote {} records to {}", records.len(), path.display());
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

fn header(p: &Plan, f: &RunFacts) -> String {
    let backend = match (p.backend, &p.fallback_reason) {
        (BackendKind::Cuda, _) => format!("cuda on {} x {}", p.ranks, f.device),
        (_, Some(why)) => format!(
            "host (CPU threads on {}; no usable GPU: {why}) -- these times measure the CPU reference, not GPU performance",
            f.device
        ),
        (_, None) => format!("host (CPU threads on {}) -- these times measure the CPU reference, not GPU performance", f.device),
    };
    format!(
        "moelink bench | backend: {backend}\n  ranks {} | reps {} (+{} warm-up) | timer: wall clock after a barrier, median of the slowest rank | commit {} | {}",
        p.ranks, p.reps, p.warmup, f.commit, f.date
    )
}

/// Folds the ranks' outcomes of each case into a record.
fn summarize(
    cases: &[Case],
    inputs: &Inputs,
    results: &[Result<Vec<RankOutcome>>],
    facts: &RunFacts,
    p: &Plan,
    a: &BenchArgs,
) -> Vec<Record> {
    let s = &inputs.shape;
    let rank_errors: Vec<&moelink::Error> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let whole_run_error = crate::ranks::first_cause(&rank_errors);
    cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut rec = Record::new(facts, c.mode.name(), c.op.name(), p.ranks);
            rec.dtype = Some(c.dtype.name().into());
            rec.tokens = Some(s.tokens);
            rec.hidden = Some(s.hidden);
            rec.topk = Some(s.topk);
            rec.experts = Some(s.experts);
            rec.routing = Some(c.routing.name().into());
            rec.num_sms = c.num_sms;
            let outs: Vec<&RankOutcome> = results.iter().filter_map(|r| r.as_ref().ok()).filter_map(|v| v.get(i)).collect();
            if let Some(err) = &whole_run_error {
                rec.status = Status::Error;
                rec.error = Some(err.clone());
                return rec;
            }
            if c.mode == Mode::Ht {
                rec.num_sms = outs.iter().find_map(|o| o.num_sms).or(c.num_sms);
            }
            if let Some(why) = outs.iter().find_map(|o| o.unavailable.clone()) {
                rec.status = Status::Unavailable;
                rec.error = Some(why);
                return rec;
            }
            if let Some(e) = outs.iter().find_map(|o| o.error.clone()) {
                rec.status = Status::Error;
                rec.error = Some(e);
                return rec;
            }
            let per_rank: Vec<Vec<f64>> = outs.iter().map(|o| o.times_us.clone()).collect();
            let t = slowest_rank_median(&per_rank);
            let (logical, wire) = bytes_moved(c, inputs);
            rec.time_us = Some(t);
            rec.logical_gbps = Some(logical / (t * 1e3));
            rec.wire_gbps = Some(wire / (t * 1e3));
            rec.reps = Some(p.reps);
            rec.warmup = Some(p.warmup);
            rec.timer = Some("wall".into());
            let failures: Vec<String> =
                outs.iter().enumerate().flat_map(|(r, o)| o.failures.iter().map(move |f| format!("rank {r}: {f}"))).collect();
            rec.correct = Some(failures.is_empty());
            rec.status = if failures.is_empty() { Status::Ok } else { Status::Incorrect };
            if let Some(first) = failures.first() {
                rec.error =
                    Some(format!("{first}{}", if failures.len() > 1 { format!(" (+{} more)", failures.len() - 1) } else { String::new() }));
            }
            if p.backend == BackendKind::Cuda {
                if let Some(m) = outs.iter().map(|o| o.matches_host).collect::<Option<Vec<bool>>>() {
                    rec.extra.insert("matches_host".into(), serde_json::json!(m.iter().all(|&b| b)));
                }
            }
            if let Some(ceiling) = a.p2p_ceiling_gbps.filter(|c| *c > 0.0) {
                rec.extra.insert("pct_of_p2p_ceiling".into(), serde_json::json!(100.0 * wire / (t * 1e3) / ceiling));
            }
            let send: Vec<Vec<f64>> = outs.iter().map(|o| o.send_us.clone()).collect();
            let recv: Vec<Vec<f64>> = outs.iter().map(|o| o.recv_us.clone()).collect();
            if send.iter().all(|v| !v.is_empty()) && recv.iter().all(|v| !v.is_empty()) {
                rec.extra.insert("send_us".into(), serde_json::json!(slowest_rank_median(&send)));
                rec.extra.insert("recv_us".into(), serde_json::json!(slowest_rank_median(&recv)));
            }
            if c.mode == Mode::Ll {
                // Dispatch carried the top-k weights, so combine pre-reduces on the expert side (moelink's
                // extension; DeepEP sends one row per expert instead).
                rec.extra.insert("pre_reduced".into(), serde_json::json!(true));
            }
            rec
        })
        .collect()
}

fn render(records: &[Record]) -> String {
    let mut t = Table::new(
        &[
            "mode",
            "op",
            "dtype",
            "ranks",
            "tokens",
            "hidden",
            "topk",
            "experts",
            "routing",
            "SMs",
            "time µs",
            "logical GB/s",
            "wire GB/s",
            "correct",
        ],
        &[false, false, false, true, true, true, true, true, false, true, true, true, true, false],
    );
    let opt = |v: Option<usize>| v.map_or("-".to_string(), |n| n.to_string());
    for r in records {
        let lead = vec![
            r.mode.clone(),
            r.op.clone(),
            r.dtype.clone().unwrap_or_else(|| "-".into()),
            r.ranks.to_string(),
            opt(r.tokens),
            opt(r.hidden),
            opt(r.topk),
            opt(r.experts),
            r.routing.clone().unwrap_or_else(|| "-".into()),
            opt(r.num_sms),
        ];
        match r.status {
            Status::Unavailable => t.note(lead, format!("unavailable: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Error => t.note(lead, format!("error: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Ok | Status::Incorrect => {
                let mut cells = lead;
                cells.push(r.time_us.map_or("-".into(), num));
                cells.push(r.logical_gbps.map_or("-".into(), num));
                cells.push(r.wire_gbps.map_or("-".into(), num));
                cells.push(if r.correct == Some(true) { "yes".into() } else { format!("NO: {}", r.error.as_deref().unwrap_or("?")) });
                t.row(cells);
            }
        }
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowest_rank_median_takes_the_max_per_rep_then_the_median() {
        let per_rank = vec![vec![1.0, 5.0, 3.0], vec![2.0, 1.0, 9.0]];
        assert_eq!(slowest_rank_median(&per_rank), 5.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn ht_bytes_follow_deepep_accounting() {
        let shape = Shape { ranks: 2, tokens: 16, hidden: 256, topk: 2, experts: 4 };
        let inputs = Inputs::generate(shape, RoutingKind::Uniform, 1, false);
        let recv: usize = inputs.reference.recv_rows.iter().map(|v| v.len()).sum();
        let c = Case { mode: Mode::Ht, op: Op::Dispatch, dtype: Dtype::Fp8, routing: RoutingKind::Uniform, num_sms: None };
        let (logical, wire) = bytes_moved(&c, &inputs);
        assert_eq!(logical, recv as f64 * (256.0 + 2.0 * 4.0) / 2.0);
        assert!(wire < logical);
    }
}
