//! `moelink bench nvlink`: the ceilings moelink's kernels are measured against — copy bandwidth into peer
//! GPUs (SM stores and TMA, one pair and all-to-all, over an SM sweep), the cross-GPU barrier latency, and
//! kernel JIT times. Records use mode `"probe"` and op `"copy"`, `"barrier"` or `"jit"`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use moelink::diag::{self, CopyBandwidth, CopyMethod, CopyPattern, JitTiming};
use moelink::Group;

use crate::record::{self, Record, RunFacts, Status};
use crate::table::{num, Table};
use crate::{sys, CliError};

/// How bytes move into peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MethodSel {
    /// 16-byte SM stores.
    Sm,
    /// TMA bulk copies.
    Tma,
}

/// Traffic pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PatternSel {
    /// Rank 0 writes into rank 1.
    Pair,
    /// Every rank writes into every other rank.
    AllToAll,
    /// Every rank copies within its own memory (no NVLink; a reference for local copies).
    Local,
}

/// Options of `moelink bench nvlink`.
#[derive(Args, Debug, Clone)]
pub struct NvlinkArgs {
    /// Ranks (GPUs) (default: all GPUs).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// SM counts to sweep, comma-separated (default: 8,16,24,32 and all SMs).
    #[arg(long, value_delimiter = ',')]
    pub sms: Vec<usize>,
    /// Copy methods, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sm,tma")]
    pub method: Vec<MethodSel>,
    /// Patterns, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "pair,all-to-all")]
    pub pattern: Vec<PatternSel>,
    /// Barrier round trips to time.
    #[arg(long, default_value_t = 1000)]
    pub barrier_iters: usize,
    /// Skip the JIT timings.
    #[arg(long)]
    pub no_jit: bool,
    /// Write one JSON record per measurement to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Seconds a rank waits for the others before giving up (1 to 86400: a day).
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub timeout_s: u64,
}

type RankResult = (moelink::Result<Vec<CopyBandwidth>>, moelink::Result<f64>);

/// Runs `moelink bench nvlink`.
pub fn run(a: &NvlinkArgs) -> Result<(), CliError> {
    if let Some(path) = &a.json {
        record::check_output("--json", path, None).map_err(CliError)?;
    }
    let info = sys::cuda_info();
    let gpus = info.as_ref().map(|i| i.devices.len()).unwrap_or(0);
    // Without a GPU the diagnostics only report that they are unavailable; two ranks make that report
    // complete (the pair pattern needs two).
    let ranks = a.ranks.unwrap_or(if gpus > 0 { gpus } else { 2 });
    if ranks == 0 {
        return Err(CliError("--ranks must be at least 1".into()));
    }
    if gpus > 0 && ranks > gpus {
        return Err(CliError(format!("--ranks {ranks} needs {ranks} GPUs, this machine has {gpus}")));
    }
    let sms = if a.sms.is_empty() {
        let all = info.as_ref().ok().and_then(|i| i.devices.first()).map(|d| d.multiprocessors);
        let mut v = vec![8, 16, 24, 32];
        v.extend(all.filter(|n| *n > 32));
        v
    } else {
        a.sms.clone()
    };
    let methods: Vec<CopyMethod> =
        a.method.iter().map(|m| if *m == MethodSel::Sm { CopyMethod::SmStores } else { CopyMethod::Tma }).collect();
    let patterns: Vec<CopyPattern> = a
        .pattern
        .iter()
        .map(|p| match p {
            PatternSel::Pair => CopyPattern::Pair,
            PatternSel::AllToAll => CopyPattern::AllToAll,
            PatternSel::Local => CopyPattern::Local,
        })
        .collect();
    let facts = RunFacts {
        system: "moelink".into(),
        backend: "cuda".into(),
        device: sys::device_name(moelink::BackendKind::Cuda),
        gpus: if gpus > 0 { ranks } else { 0 },
        date: sys::utc_now(),
        commit: sys::commit(),
    };
    println!("moelink bench nvlink | {ranks} ranks on {} | commit {} | {}", facts.device, facts.commit, facts.date);
    if let Err(why) = &info {
        println!("no GPU found ({why}): the probes will report unavailable");
    }

    let per_rank =
        moelink::group::run_ranks_with_timeout(ranks, Duration::from_secs(a.timeout_s.max(1)), |g| -> moelink::Result<RankResult> {
            let device = g.rank();
            let bw = diag::nvlink_bandwidth(&g, device, &sms, &methods, &patterns);
            let bar = diag::barrier_latency_us(&g, device, a.barrier_iters);
            Ok((bw, bar))
        });
    // The diagnostics report the slowest rank on every rank: rank 0's copy is the result.
    let (bw, bar): RankResult = match per_rank.into_iter().next() {
        Some(Ok(r)) => r,
        Some(Err(e)) => (Err(clone_err(&e)), Err(e)),
        None => return Err(CliError("no ranks ran".into())),
    };
    let jit = if a.no_jit { None } else { Some(diag::jit_timings(0)) };

    let mut records = Vec::new();
    copy_records(&facts, ranks, bw, &mut records);
    barrier_record(&facts, ranks, bar, a.barrier_iters, &mut records);
    if let Some(j) = jit {
        jit_records(&facts, ranks, j, &mut records);
    }
    println!("{}", render(&records));
    if let Some(path) = &a.json {
        record::write_json(path, &records).map_err(CliError)?;
        println!("wrote {} records to {}", records.len(), path.display());
    }
    let bad = records.iter().filter(|r| matches!(r.status, Status::Error | Status::Incorrect)).count();
    if bad > 0 {
        return Err(CliError(format!("{bad} of {} probe measurements failed", records.len())));
    }
    Ok(())
}

fn clone_err(e: &moelink::Error) -> moelink::Error {
    match e {
        moelink::Error::Unavailable(s) => moelink::Error::Unavailable(s.clone()),
        other => moelink::Error::Group { rank: 0, reason: other.to_string() },
    }
}

fn failed(mut r: Record, e: moelink::Error) -> Record {
    r.status = if matches!(e, moelink::Error::Unavailable(_)) { Status::Unavailable } else { Status::Error };
    r.error = Some(match e {
        moelink::Error::Unavailable(why) => why,
        e => e.to_string(),
    });
    r
}

fn pattern_name(p: CopyPattern) -> &'static str {
    match p {
        CopyPattern::Pair => "pair",
        CopyPattern::AllToAll => "all-to-all",
        CopyPattern::Local => "local",
    }
}

fn method_name(m: CopyMethod) -> &'static str {
    match m {
        CopyMethod::SmStores => "sm-stores",
        CopyMethod::Tma => "tma",
    }
}

fn copy_records(f: &RunFacts, ranks: usize, bw: moelink::Result<Vec<CopyBandwidth>>, out: &mut Vec<Record>) {
    let base = Record::new(f, "probe", "copy", ranks);
    match bw {
        Err(e) => out.push(failed(base, e)),
        Ok(rows) => out.extend(rows.into_iter().map(|c| {
            let mut r = base.clone();
            r.num_sms = Some(c.num_sms);
            r.time_us = Some(c.time_us);
            r.logical_gbps = Some(c.gbps);
            r.wire_gbps = Some(c.gbps);
            r.correct = Some(c.verified);
            r.status = if c.verified { Status::Ok } else { Status::Incorrect };
            if !c.verified {
                r.error = Some("received data did not match the pattern".into());
            }
            r.timer = Some("cuda-events".into());
            r.extra.insert("pattern".into(), serde_json::json!(pattern_name(c.pattern)));
            r.extra.insert("method".into(), serde_json::json!(method_name(c.method)));
            r.extra.insert("bytes_per_gpu".into(), serde_json::json!(c.bytes_per_gpu));
            r
        })),
    }
}

fn barrier_record(f: &RunFacts, ranks: usize, bar: moelink::Result<f64>, iters: usize, out: &mut Vec<Record>) {
    let mut r = Record::new(f, "probe", "barrier", ranks);
    r.extra.insert("iters".into(), serde_json::json!(iters));
    out.push(match bar {
        Ok(us) => {
            r.time_us = Some(us);
            r.correct = Some(true);
            r.status = Status::Ok;
            r
        }
        Err(e) => failed(r, e),
    });
}

fn jit_records(f: &RunFacts, ranks: usize, jit: moelink::Result<Vec<JitTiming>>, out: &mut Vec<Record>) {
    let base = Record::new(f, "probe", "jit", ranks);
    match jit {
        Err(e) => out.push(failed(base, e)),
        Ok(rows) => out.extend(rows.into_iter().map(|j| {
            let mut r = base.clone();
            r.time_us = Some(j.cold_s * 1e6);
            r.correct = Some(true);
            r.status = Status::Ok;
            r.extra.insert("kernel".into(), serde_json::json!(j.kernel));
            r.extra.insert("cached_us".into(), serde_json::json!(j.cached_s * 1e6));
            r.extra.insert("cubin_bytes".into(), serde_json::json!(j.cubin_bytes));
            r
        })),
    }
}

fn render(records: &[Record]) -> String {
    let mut t = Table::new(&["op", "what", "SMs", "bytes/GPU", "time µs", "GB/s", "ok"], &[false, false, true, true, true, true, false]);
    let extra = |r: &Record, k: &str| r.extra.get(k).map(|v| v.as_str().map_or_else(|| v.to_string(), String::from));
    for r in records {
        let what = match r.op.as_str() {
            "copy" => format!("{} {}", extra(r, "pattern").unwrap_or_default(), extra(r, "method").unwrap_or_default()),
            "barrier" => format!("{} ranks, x{}", r.ranks, extra(r, "iters").unwrap_or_default()),
            _ => extra(r, "kernel").unwrap_or_default(),
        };
        let lead = vec![r.op.clone(), what];
        match r.status {
            Status::Unavailable => t.note(lead, format!("unavailable: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Error => t.note(lead, format!("error: {}", r.error.as_deref().unwrap_or("?"))),
            _ => {
                let mut cells = lead;
                cells.push(r.num_sms.map_or("-".into(), |n| n.to_string()));
                cells.push(extra(r, "bytes_per_gpu").or_else(|| extra(r, "cubin_bytes")).unwrap_or_else(|| "-".into()));
                cells.push(r.time_us.map_or("-".into(), num));
                cells.push(r.logical_gbps.map_or("-".into(), num));
                cells.push(if r.correct == Some(true) { "yes".into() } else { "NO".into() });
                t.row(cells);
            }
        }
    }
    t.render()
}
