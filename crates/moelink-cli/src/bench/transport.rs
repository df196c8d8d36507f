//! `moelink bench transport`: the RDMA transport seam on this machine — latency (ping-pong between rank
//! pairs) and bandwidth (every rank streams into the next) of plain puts and of put_signal, per backend,
//! message size and QP count (a sweep 1, 2, 4, ... up to `--max-qps`), each after a conformance check of the
//! same backend (`moelink::rdma_probe`).
//!
//! Records use mode `"probe"`, op `"put"` or `"put_signal"`, extra `pattern` (`"ping-pong"` or `"stream"`),
//! `ordering` (how the receiver learns of the data: `"put_signal"`, or `"fence+signal"` after the plain
//! puts) and `qps`, and carry `transport`, `nodes`, `ranks_per_node`. Without a NIC (ptr, emu-nic, or
//! NVSHMEM over P2P) and above all with ranks sharing a GPU these are not network figures: the table and the
//! records (`shared_gpu`) say so.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use moelink::rdma_probe::{self, BenchMode, BenchOptions, BenchPoint, CheckMode, CheckOptions};
use moelink::{EmuNicOptions, Group, RdmaOptions, TcpGroup, Topology, Transport};

use crate::record::{self, Record, RunFacts, Status};
use crate::table::{num, Table};
use crate::{sys, CliError};

/// A transport backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TransportSel {
    /// Peer pointers (one host).
    Ptr,
    /// The emulated NIC (in order per QP, out of order across QPs; delay and link rate below).
    EmuNic,
    /// NVSHMEM (process mode: one process per rank).
    Nvshmem,
}

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProbeSel {
    /// Ping-pong between ranks r and r ^ 1 (one-way latency: half a round trip).
    Latency,
    /// Every rank streams puts into rank r + 1.
    Bandwidth,
}

/// Which operation carries the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OpSel {
    /// Plain puts; the receiver learns of them from a signal issued after a fence (latency: put, fence,
    /// signal per message; bandwidth: a warp's puts, then one fence and one signal).
    Put,
    /// put_signal: the signal rides with the data, applied once the data is visible.
    PutSignal,
}

impl OpSel {
    /// The record's `op`.
    pub fn name(self) -> &'static str {
        match self {
            OpSel::Put => "put",
            OpSel::PutSignal => "put_signal",
        }
    }

    /// The record's `ordering`: how the receiver learns the data arrived.
    fn ordering(self) -> &'static str {
        match self {
            OpSel::Put => "fence+signal",
            OpSel::PutSignal => "put_signal",
        }
    }
}

/// Options of `moelink bench transport`.
#[derive(Args, Debug, Clone)]
pub struct TransportArgs {
    /// Backends, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ptr,emu-nic")]
    pub transport: Vec<TransportSel>,
    /// Thread mode: ranks in this process (default: the GPU count, at least 2); ranks beyond the GPUs share
    /// them round-robin (correctness only: such times are not network figures).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Process mode: this process is one rank of a torchrun launch (needed for nvshmem).
    #[arg(long)]
    pub process: bool,
    /// Nodes x ranks per node written into the records (e.g. 2x2); default 1 x ranks.
    #[arg(long)]
    pub topology: Option<String>,
    /// Measurements, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "latency,bandwidth")]
    pub mode: Vec<ProbeSel>,
    /// Operations, comma-separated: each measurement runs once per operation.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "put,put-signal")]
    pub ops: Vec<OpSel>,
    /// Message sizes in bytes (multiples of 16), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,4096,65536,1048576")]
    pub sizes: Vec<usize>,
    /// QPs per peer (a buffer's num_qps_per_rank) of the largest point: the sweep is 1, 2, 4, ... below it,
    /// then it (8: 1,2,4,8; DeepEP's low-latency default 24: 1,2,4,8,16,24). At most 32.
    #[arg(long, default_value_t = 8)]
    pub max_qps: usize,
    /// QPs per peer to measure instead of the sweep, comma-separated (1..=32).
    #[arg(long, value_delimiter = ',')]
    pub qps: Option<Vec<usize>>,
    /// Bytes each rank sends per bandwidth measurement.
    #[arg(long, default_value_t = 64 << 20)]
    pub bandwidth_bytes: usize,
    /// Round trips per latency measurement.
    #[arg(long, default_value_t = 100)]
    pub round_trips: u32,
    /// Timed repetitions per point (median kept; one more as warm-up).
    #[arg(long, default_value_t = 5)]
    pub reps: u32,
    /// Worker blocks of the bandwidth kernel.
    #[arg(long, default_value_t = 16)]
    pub blocks: u32,
    /// emu-nic: the rank's link rate in GB/s (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub emu_rate_gbps: f64,
    /// emu-nic: a put runs no earlier than this after it was posted, microseconds.
    #[arg(long, default_value_t = 0)]
    pub emu_delay_us: u64,
    /// Skip the conformance check before timing.
    #[arg(long)]
    pub no_check: bool,
    /// Write one JSON record per measurement to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Seconds a rank waits for the others before giving up (1 to 86400: a day).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub timeout_s: u64,
}

/// The RDMA options of one backend and QP count, NVSHMEM's paths from `NVSHMEM_HOME` / `CUDA_HOME`.
pub fn rdma_options(t: TransportSel, qps: usize, emu: EmuNicOptions) -> RdmaOptions {
    RdmaOptions {
        transport: match t {
            TransportSel::Ptr => Transport::Ptr,
            TransportSel::EmuNic => Transport::EmuNic(emu),
            TransportSel::Nvshmem => Transport::Nvshmem,
        },
        num_qps_per_rank: qps,
        nvshmem_home: std::env::var_os("NVSHMEM_HOME").map(PathBuf::from),
        cuda_home: std::env::var_os("CUDA_HOME").map(PathBuf::from),
        ..RdmaOptions::default()
    }
}

/// The QP counts to measure: `--qps` as given, or the sweep 1, 2, 4, ... up to `--max-qps`.
pub fn qp_counts(a: &TransportArgs) -> Result<Vec<usize>, CliError> {
    let max = RdmaOptions::MAX_QPS_PER_RANK;
    let counts = match &a.qps {
        Some(list) => list.clone(),
        None => {
            let top = a.max_qps;
            let mut v: Vec<usize> = std::iter::successors(Some(1usize), |q| Some(q * 2)).take_while(|&q| q < top).collect();
            v.push(top);
            v
        }
    };
    if let Some(bad) = counts.iter().find(|&&q| q == 0 || q > max) {
        return Err(CliError(format!("{bad} QPs per peer: must be 1..={max} (--qps, --max-qps)")));
    }
    if counts.is_empty() {
        return Err(CliError("--qps names no QP count".into()));
    }
    Ok(counts)
}

/// One rank's results for one (transport, QPs): the check's wrong bytes, then each (mode, op)'s points.
type RankOutcome = (Option<u64>, Vec<(ProbeSel, OpSel, moelink::Result<Vec<BenchPoint>>)>);

fn run_rank(g: &dyn Group, device: usize, a: &TransportArgs, rdma: &RdmaOptions) -> moelink::Result<RankOutcome> {
    let timeout_ms = a.timeout_s.saturating_mul(1000) / 4;
    let wrong = if a.no_check {
        None
    } else {
        let o = CheckOptions { rdma: rdma.clone(), mode: CheckMode::PutSignal, rounds: 2, timeout_ms, ..CheckOptions::default() };
        Some(rdma_probe::check(g, device, &o)?.wrong_bytes)
    };
    let mut out = Vec::new();
    for &m in &a.mode {
        for &op in &a.ops {
            if m == ProbeSel::Latency && g.size() < 2 {
                out.push((m, op, Err(moelink::Error::Unavailable("the latency probe pairs ranks: it needs at least 2".into()))));
                continue;
            }
            let o = BenchOptions {
                rdma: rdma.clone(),
                mode: if m == ProbeSel::Latency { BenchMode::Latency } else { BenchMode::Bandwidth },
                sizes: a.sizes.clone(),
                bandwidth_bytes: a.bandwidth_bytes,
                latency_round_trips: a.round_trips,
                use_signal: op == OpSel::PutSignal,
                blocks: a.blocks,
                repetitions: a.reps,
                timeout_ms,
            };
            out.push((m, op, rdma_probe::bench(g, device, &o)));
        }
    }
    Ok((wrong, out))
}

/// Runs `moelink bench transport`.
pub fn run(a: &TransportArgs) -> Result<(), CliError> {
    if let Some(path) = &a.json {
        record::check_output("--json", path, None).map_err(CliError)?;
    }
    let gpus = sys::gpu_count();
    let (group, thread_ranks): (Option<TcpGroup>, usize) = if a.process {
        (Some(TcpGroup::from_env().map_err(|e| CliError(format!("cannot join the process group: {e}")))?), 0)
    } else {
        (None, a.ranks.unwrap_or(gpus.max(2)))
    };
    let ranks = group.as_ref().map_or(thread_ranks, |g| g.size());
    if ranks == 0 {
        return Err(CliError("--ranks must be at least 1".into()));
    }
    if a.transport.contains(&TransportSel::Nvshmem) && !a.process {
        return Err(CliError("--transport nvshmem needs --process (NVSHMEM has one PE per process; launch with torchrun)".into()));
    }
    let topology = match &a.topology {
        Some(t) => t.parse::<Topology>().map_err(|e| CliError(format!("--topology: {e}")))?,
        None => Topology::single_node(ranks),
    };
    if topology.num_ranks() != ranks {
        return Err(CliError(format!("--topology {topology} is not {ranks} ranks")));
    }
    let qp_counts = qp_counts(a)?;
    let me = group.as_ref().map_or(0, |g| g.rank());
    // Ranks on this host: all of them in thread mode, torchrun's LOCAL_WORLD_SIZE in process mode.
    let local_ranks = if a.process { std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse().ok()).unwrap_or(ranks) } else { ranks };
    let shared_gpu = gpus == 0 || local_ranks > gpus;
    let facts = RunFacts {
        system: "moelink".into(),
        backend: "cuda".into(),
        device: sys::device_name(moelink::BackendKind::Cuda),
        gpus: gpus.min(ranks),
        date: sys::utc_now(),
        commit: sys::commit(),
    };
    if me == 0 {
        println!(
            "moelink bench transport | {ranks} ranks ({topology}) on {} | {} | commit {} | {}",
            facts.device,
            if a.process { "process mode" } else { "thread mode" },
            facts.commit,
            facts.date
        );
        println!(
            "not a network figure: no RDMA NIC takes part here{}",
            if shared_gpu { ", and the ranks share a GPU (they exchange through its own memory)" } else { "" }
        );
        println!(
            "put: plain puts, then a fence and a signal (latency: per message; bandwidth: per warp); put_signal: the signal \
             rides with the data | QPs {qp_counts:?}"
        );
    }
    let emu = EmuNicOptions { delay_us: a.emu_delay_us, rate_gbps: a.emu_rate_gbps, ..EmuNicOptions::default() };
    let mut records = Vec::new();
    for &t in &a.transport {
        for &qps in &qp_counts {
            let rdma = rdma_options(t, qps, emu);
            let outcome = match &group {
                Some(g) => run_rank(g, g.local_rank() % gpus.max(1), a, &rdma),
                None => {
                    let per = moelink::group::run_ranks_with_timeout(ranks, Duration::from_secs(a.timeout_s.max(1)), |g| {
                        run_rank(&g, g.rank() % gpus.max(1), a, &rdma)
                    });
                    per.into_iter().next().unwrap_or_else(|| Err(moelink::Error::Unavailable("no ranks ran".into())))
                }
            };
            let base = {
                // A failure before any measurement (domain, conformance check) is reported as the check's.
                let mut r = Record::new(&facts, "probe", "check", ranks);
                r.nodes = Some(topology.num_nodes);
                r.ranks_per_node = Some(topology.ranks_per_node);
                r.transport = Some(rdma.transport.name().into());
                r.extra.insert("qps".into(), serde_json::json!(qps));
                r.extra.insert("shared_gpu".into(), serde_json::json!(shared_gpu));
                if let Transport::EmuNic(o) = rdma.transport {
                    r.extra.insert("emu_rate_gbps".into(), serde_json::json!(o.rate_gbps));
                    r.extra.insert("emu_delay_us".into(), serde_json::json!(o.delay_us));
                }
                r
            };
            match outcome {
                Err(e) => records.push(failed(base, e)),
                Ok((wrong, modes)) => {
                    for (m, op, points) in modes {
                        let mut r = base.clone();
                        r.op = op.name().into();
                        r.extra.insert("pattern".into(), serde_json::json!(if m == ProbeSel::Latency { "ping-pong" } else { "stream" }));
                        r.extra.insert("ordering".into(), serde_json::json!(op.ordering()));
                        match points {
                            Err(e) => records.push(failed(r, e)),
                            Ok(points) => records.extend(points.into_iter().map(|p| point_record(&r, &p, m, wrong, a.reps))),
                        }
                    }
                }
            }
        }
    }
    if me != 0 {
        return Ok(());
    }
    println!("{}", render(&records));
    if let Some(path) = &a.json {
        record::write_json(path, &records).map_err(CliError)?;
        println!("wrote {} records to {}", records.len(), path.display());
    }
    let bad = records.iter().filter(|r| matches!(r.status, Status::Error | Status::Incorrect)).count();
    if bad > 0 {
        return Err(CliError(format!("{bad} of {} transport measurements failed", records.len())));
    }
    Ok(())
}

fn point_record(base: &Record, p: &BenchPoint, m: ProbeSel, wrong: Option<u64>, reps: u32) -> Record {
    let mut r = base.clone();
    r.time_us = Some(p.us);
    if m == ProbeSel::Bandwidth {
        r.logical_gbps = Some(p.gbps);
        r.wire_gbps = Some(p.gbps);
    }
    r.correct = wrong.map(|w| w == 0);
    r.status = if wrong.unwrap_or(0) == 0 { Status::Ok } else { Status::Incorrect };
    if let Some(w) = wrong.filter(|w| *w > 0) {
        r.error = Some(format!("the conformance check found {w} wrong bytes"));
    }
    r.reps = Some(reps as usize);
    r.warmup = Some(1);
    r.timer = Some("globaltimer".into());
    r.extra.insert("bytes".into(), serde_json::json!(p.bytes));
    r.extra.insert("messages".into(), serde_json::json!(p.messages));
    r
}

fn failed(mut r: Record, e: moelink::Error) -> Record {
    r.status = if matches!(e, moelink::Error::Unavailable(_)) { Status::Unavailable } else { Status::Error };
    r.error = Some(match e {
        moelink::Error::Unavailable(why) => why,
        e => e.to_string(),
    });
    r
}

fn render(records: &[Record]) -> String {
    let mut t = Table::new(&["transport", "QPs", "what", "bytes", "µs", "GB/s", "checked"], &[false, true, false, true, true, true, false]);
    let extra = |r: &Record, k: &str| r.extra.get(k).map(|v| v.as_str().map_or_else(|| v.to_string(), String::from)).unwrap_or_default();
    for r in records {
        let lead = vec![r.transport.clone().unwrap_or_default(), extra(r, "qps"), format!("{} {}", r.op, extra(r, "pattern"))];
        match r.status {
            Status::Unavailable => t.note(lead, format!("unavailable: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Error => t.note(lead, format!("error: {}", r.error.as_deref().unwrap_or("?"))),
            _ => {
                let mut cells = lead;
                cells.push(extra(r, "bytes"));
                cells.push(r.time_us.map_or("-".into(), num));
                cells.push(r.logical_gbps.map_or("-".into(), num));
                cells.push(match r.correct {
                    Some(true) => "yes".into(),
                    Some(false) => "NO".into(),
                    None => "-".into(),
                });
                t.row(cells);
            }
        }
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TransportArgs,
    }

    fn args(flags: &[&str]) -> TransportArgs {
        let mut argv = vec!["transport"];
        argv.extend_from_slice(flags);
        Cli::try_parse_from(argv).expect("valid flags").args
    }

    #[test]
    fn by_default_both_operations_are_measured_over_a_qp_sweep() {
        let a = args(&[]);
        assert_eq!(a.ops, vec![OpSel::Put, OpSel::PutSignal]);
        assert_eq!(a.mode, vec![ProbeSel::Latency, ProbeSel::Bandwidth]);
        assert_eq!(qp_counts(&a).unwrap(), vec![1, 2, 4, 8]);
        assert_eq!(qp_counts(&args(&["--max-qps", "24"])).unwrap(), vec![1, 2, 4, 8, 16, 24]);
        assert_eq!(qp_counts(&args(&["--max-qps", "1"])).unwrap(), vec![1]);
        assert_eq!(qp_counts(&args(&["--max-qps", "32"])).unwrap(), vec![1, 2, 4, 8, 16, 32]);
        // An explicit list wins over the sweep.
        assert_eq!(qp_counts(&args(&["--qps", "3,1", "--max-qps", "16"])).unwrap(), vec![3, 1]);
        for bad in [&["--max-qps", "0"][..], &["--max-qps", "33"], &["--qps", "1,40"]] {
            let e = qp_counts(&args(bad)).unwrap_err().0;
            assert!(e.contains("1..=32"), "{bad:?}: {e}");
        }
        assert_eq!(args(&["--ops", "put-signal"]).ops, vec![OpSel::PutSignal]);
        assert_eq!((OpSel::Put.name(), OpSel::Put.ordering()), ("put", "fence+signal"));
        assert_eq!((OpSel::PutSignal.name(), OpSel::PutSignal.ordering()), ("put_signal", "put_signal"));
    }

    #[test]
    fn records_of_both_operations_keep_the_topology_fields_and_render() {
        let facts = RunFacts {
            system: "moelink".into(),
            backend: "cuda".into(),
            device: "test".into(),
            gpus: 1,
            date: "2026-01-01".into(),
            commit: "abc".into(),
        };
        let mut base = Record::new(&facts, "probe", "check", 4);
        base.nodes = Some(2);
        base.ranks_per_node = Some(2);
        base.transport = Some("emu-nic".into());
        base.extra.insert("qps".into(), serde_json::json!(2));
        let records: Vec<Record> = [OpSel::Put, OpSel::PutSignal]
            .into_iter()
            .map(|op| {
                let mut r = base.clone();
                r.op = op.name().into();
                r.extra.insert("pattern".into(), serde_json::json!("ping-pong"));
                r.extra.insert("ordering".into(), serde_json::json!(op.ordering()));
                point_record(&r, &BenchPoint { bytes: 4096, messages: 100, us: 3.5, gbps: 0.0 }, ProbeSel::Latency, Some(0), 5)
            })
            .collect();
        for (r, op) in records.iter().zip(["put", "put_signal"]) {
            let j = serde_json::to_value(r).unwrap();
            assert_eq!((j["op"].as_str(), j["nodes"].as_u64(), j["ranks_per_node"].as_u64()), (Some(op), Some(2), Some(2)), "{j}");
            assert_eq!(
                (j["transport"].as_str(), j["pattern"].as_str(), j["bytes"].as_u64()),
                (Some("emu-nic"), Some("ping-pong"), Some(4096)),
                "{j}"
            );
            assert_eq!(r.status, Status::Ok);
        }
        let table = render(&records);
        assert!(table.contains("put ping-pong") && table.contains("put_signal ping-pong"), "{table}");
    }
}
