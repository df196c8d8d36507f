//! `moelink selftest`: the group collectives, then the GPU diagnostics (symmetric memory across ranks, the
//! cross-GPU barrier, deadlines), each printed as PASS / FAIL / SKIP.
//!
//! Thread mode (default): one process, one thread per GPU. Process mode (`--process`): this process is one
//! rank of a torchrun launch (`torchrun --nproc_per_node=4 --no-python moelink selftest --process`), joined
//! through [`TcpGroup::from_env`]; the ranks gather their results and rank 0 prints them.

use std::time::{Duration, Instant};

use clap::Args;
use moelink::{diag, Group, TcpGroup};
use serde::{Deserialize, Serialize};

use crate::{sys, CliError};

/// Options of `moelink selftest`.
#[derive(Args, Debug, Clone)]
pub struct SelftestArgs {
    /// Process mode: this process is one rank of a torchrun launch (reads MASTER_ADDR, MASTER_PORT, RANK,
    /// WORLD_SIZE, LOCAL_RANK; moelink listens on MASTER_PORT + 1 or MOELINK_PORT).
    #[arg(long)]
    pub process: bool,
    /// Ranks in thread mode (default: number of GPUs; 2 without a GPU, to check the group alone).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Deadline the deadline check gives the barrier, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    pub deadline_ms: u64,
    /// Bytes each rank writes into each peer in the symmetric-memory check.
    #[arg(long, default_value_t = 64 << 20)]
    pub bytes_per_peer: usize,
    /// Barrier round trips timed by the barrier-latency check.
    #[arg(long, default_value_t = 1000)]
    pub barrier_iters: usize,
    /// Count skipped (unavailable) checks as failures.
    #[arg(long)]
    pub strict: bool,
    /// RDMA transport backends whose conformance is checked (every byte of random messages on random QPs
    /// before its signal; with emu-nic also that a missing fence is caught); nvshmem needs --process and
    /// NVSHMEM_HOME. Empty (`--transport ''`) skips them.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ptr,emu-nic")]
    pub transport: Vec<crate::bench::transport::TransportSel>,
}

/// Verdict of one check on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// The check ran and passed.
    Pass,
    /// The check ran and failed.
    Fail,
    /// The check could not run here (no GPU, diagnostics not built, too few ranks).
    Skip,
}

/// One check's result on one rank (gathered as JSON in process mode).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckResult {
    /// Check name (`group`, `symmetric-memory`, `barrier-latency`, `deadline`).
    pub name: String,
    /// Rank that ran it.
    pub rank: usize,
    /// Outcome.
    pub verdict: Verdict,
    /// What was seen (a number, or why it failed or was skipped).
    pub detail: String,
}

fn result(name: &str, rank: usize, verdict: Verdict, detail: impl Into<String>) -> CheckResult {
    CheckResult { name: name.into(), rank, verdict, detail: detail.into() }
}

/// A diagnostic's error as a verdict: unavailable is a skip, anything else a failure.
fn from_error(name: &str, rank: usize, e: moelink::Error) -> CheckResult {
    match e {
        moelink::Error::Unavailable(why) => result(name, rank, Verdict::Skip, format!("unavailable: {why}")),
        e => result(name, rank, Verdict::Fail, e.to_string()),
    }
}

/// The most ranks thread mode runs: one thread each, and every GPU check is collective over them; no node
/// has more GPUs than this, and more threads only test the machine's scheduler.
pub const MAX_THREAD_RANKS: usize = 64;

/// The GPU checks after the group check, in the order they run.
fn gpu_check_names(a: &SelftestArgs) -> Vec<String> {
    let mut names = vec!["symmetric-memory".to_string(), "barrier-latency".to_string()];
    names.extend(
        a.transport
            .iter()
            .map(|&t| format!("transport-{}", crate::bench::transport::rdma_options(t, 4, Default::default()).transport.name())),
    );
    names.push("deadline".into());
    names
}

/// Runs every check on this rank (collective: every rank calls it). `gpu`: whether this machine has a usable
/// GPU; without one the GPU checks are skipped, not run (the caller prints why, once).
pub fn run_checks(g: &dyn Group, device: usize, a: &SelftestArgs, gpu: bool) -> Vec<CheckResult> {
    let me = g.rank();
    let mut out = vec![group_check(g)];
    let skip_reason = if out[0].verdict == Verdict::Fail {
        // The GPU checks exchange handles through the group: without it they would only time out.
        Some("skipped: the group check failed")
    } else if !gpu {
        Some("skipped: no usable GPU (see above)")
    } else {
        None
    };
    if let Some(why) = skip_reason {
        out.extend(gpu_check_names(a).iter().map(|name| result(name, me, Verdict::Skip, why)));
        return out;
    }
    out.push(match diag::symmetric_memory_check(g, device, a.bytes_per_peer) {
        Ok(0) => result("symmetric-memory", me, Verdict::Pass, format!("{} MiB per peer verified", a.bytes_per_peer >> 20)),
        Ok(n) => result("symmetric-memory", me, Verdict::Fail, format!("{n} mismatching words received")),
        Err(e) => from_error("symmetric-memory", me, e),
    });
    out.push(match diag::barrier_latency_us(g, device, a.barrier_iters) {
        Ok(us) if us.is_finite() && us > 0.0 => {
            result("barrier-latency", me, Verdict::Pass, format!("{us:.2} us (median of {}, slowest rank)", a.barrier_iters))
        }
        Ok(us) => result("barrier-latency", me, Verdict::Fail, format!("implausible latency {us}")),
        Err(e) => from_error("barrier-latency", me, e),
    });
    for &t in &a.transport {
        out.push(transport_check(g, device, t));
    }
    let skip_rank = g.size() - 1;
    out.push(if g.size() < 2 {
        result("deadline", me, Verdict::Skip, "needs at least 2 ranks")
    } else {
        match diag::deadline_check(g, device, skip_rank, a.deadline_ms) {
            Ok(o) => judge_deadline(&o, me, skip_rank, a.deadline_ms),
            Err(e) => from_error("deadline", me, e),
        }
    });
    out
}

/// The transport seam's conformance on backend `t`: 0 wrong bytes with put_signal and with put + fence +
/// signal; with emu-nic also wrong bytes for the planted bug (a signal on another QP without a fence), which
/// proves the check can fail.
fn transport_check(g: &dyn Group, device: usize, t: crate::bench::transport::TransportSel) -> CheckResult {
    use moelink::rdma_probe::{check, CheckMode, CheckOptions};
    let me = g.rank();
    let rdma = crate::bench::transport::rdma_options(t, 4, moelink::EmuNicOptions::default());
    let name = format!("transport-{}", rdma.transport.name());
    let run = |mode| check(g, device, &CheckOptions { rdma: rdma.clone(), mode, ..CheckOptions::default() });
    // The planted bug runs with a 1 ms reorder window: data held that long is still in flight when the
    // receiver sees its early signal, whatever else the GPU is doing.
    let planted = || {
        let mut rdma = rdma.clone();
        if let moelink::Transport::EmuNic(o) = &mut rdma.transport {
            o.reorder_window_us = 1000;
        }
        check(g, device, &CheckOptions { rdma, mode: CheckMode::PlantedBug, ..CheckOptions::default() })
    };
    // Every rank runs every mode whatever an earlier one found, so that the ranks' collectives stay in step.
    let outcomes: Vec<_> = [CheckMode::PutSignal, CheckMode::PutFenceSignal].into_iter().map(|mode| (mode, run(mode))).collect();
    // Caught on some rank: every rank's wrong bytes are gathered so that all ranks agree.
    let planted_caught = matches!(rdma.transport, moelink::Transport::EmuNic(_)).then(|| {
        planted().and_then(|r| g.all_gather(&r.wrong_bytes.to_le_bytes())).map(|all| all.iter().any(|b| b.iter().any(|x| *x != 0)))
    });
    let mut received = 0;
    for (mode, outcome) in outcomes {
        match outcome {
            Ok(r) if r.wrong_bytes == 0 => received += r.messages_received,
            Ok(r) => {
                return result(
                    &name,
                    me,
                    Verdict::Fail,
                    format!("{mode:?}: {} bytes wrong of {} messages", r.wrong_bytes, r.messages_received),
                )
            }
            Err(e) => return from_error(&name, me, e),
        }
    }
    let mut detail = format!("{received} messages received intact (put_signal; put, fence, signal)");
    match planted_caught {
        Some(Ok(true)) => detail += "; a signal on another QP without a fence was caught",
        Some(Ok(false)) => return result(&name, me, Verdict::Fail, "the emulated NIC let a signal overtake its data unnoticed"),
        Some(Err(e)) => return from_error(&name, me, e),
        None => {}
    }
    result(&name, me, Verdict::Pass, detail)
}

/// A rank that skipped the barrier must see no error; every other rank a timeout naming it, within the
/// deadline plus slack, after which its buffer refuses work.
fn judge_deadline(o: &diag::DeadlineOutcome, me: usize, skip_rank: usize, deadline_ms: u64) -> CheckResult {
    let slack_ms = deadline_ms as f64 * 1.5 + 1000.0;
    if me == skip_rank {
        return match &o.error {
            None => result("deadline", me, Verdict::Pass, "skipped the barrier as planned"),
            Some(e) => result("deadline", me, Verdict::Fail, format!("the skipping rank got an error: {e}")),
        };
    }
    match (&o.error, o.peer) {
        (None, _) => result("deadline", me, Verdict::Fail, "no timeout although a rank skipped the barrier"),
        (Some(e), peer) if peer != Some(skip_rank) => {
            result("deadline", me, Verdict::Fail, format!("timeout named {peer:?} instead of rank {skip_rank}: {e}"))
        }
        (Some(_), _) if o.elapsed_ms > slack_ms => {
            result("deadline", me, Verdict::Fail, format!("took {:.0} ms for a {deadline_ms} ms deadline", o.elapsed_ms))
        }
        (Some(_), _) if !o.refused_afterwards => result("deadline", me, Verdict::Fail, "the buffer accepted work after the timeout"),
        (Some(_), _) => result(
            "deadline",
            me,
            Verdict::Pass,
            format!("timed out after {:.0} ms naming rank {skip_rank}; later use refused", o.elapsed_ms),
        ),
    }
}

/// all_gather, all_to_all and barrier deliver what was sent; also times barriers.
fn group_check(g: &dyn Group) -> CheckResult {
    let (me, n) = (g.rank(), g.size());
    let run = || -> moelink::Result<Result<String, String>> {
        let gathered = g.all_gather(&vec![me as u8; me + 1])?;
        if gathered != (0..n).map(|r| vec![r as u8; r + 1]).collect::<Vec<_>>() {
            return Ok(Err("all_gather delivered wrong bytes".into()));
        }
        let recv = g.all_to_all((0..n).map(|dst| vec![me as u8, dst as u8]).collect())?;
        if recv != (0..n).map(|src| vec![src as u8, me as u8]).collect::<Vec<_>>() {
            return Ok(Err("all_to_all delivered wrong bytes".into()));
        }
        let iters = 100;
        let t0 = Instant::now();
        for _ in 0..iters {
            g.barrier()?;
        }
        let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        Ok(Ok(format!("all_gather, all_to_all, barrier over {n} ranks; host barrier {us:.1} us")))
    };
    match run() {
        Ok(Ok(detail)) => result("group", me, Verdict::Pass, detail),
        Ok(Err(detail)) => result("group", me, Verdict::Fail, detail),
        Err(e) => result("group", me, Verdict::Fail, e.to_string()),
    }
}

/// Runs `moelink selftest`.
pub fn run(a: &SelftestArgs) -> Result<(), CliError> {
    if a.process {
        return run_process(a);
    }
    let gpus = sys::gpu_count();
    let ranks = a.ranks.unwrap_or(if gpus > 0 { gpus } else { 2 });
    if ranks == 0 || ranks > MAX_THREAD_RANKS {
        return Err(CliError(format!(
            "--ranks {ranks}: thread mode runs 1 to {MAX_THREAD_RANKS} ranks (one thread each); use --process under torchrun for more"
        )));
    }
    println!("moelink selftest | thread mode | {ranks} ranks | commit {}", sys::commit());
    if gpus == 0 {
        let why = sys::cuda_info().err().unwrap_or_else(|| "the driver reports no GPU".into());
        println!("no GPU found ({why}): the GPU checks are skipped");
    }
    // The deadline check holds ranks back on purpose: give the group room beyond it.
    let timeout = Duration::from_millis(a.deadline_ms.saturating_mul(4).max(60_000));
    // Ranks beyond the GPU count share them round-robin.
    let per_rank = moelink::group::run_ranks_with_timeout(ranks, timeout, |g| Ok(run_checks(&g, g.rank() % gpus.max(1), a, gpus > 0)));
    let mut all = Vec::new();
    for (rank, r) in per_rank.into_iter().enumerate() {
        match r {
            Ok(v) => all.extend(v),
            Err(e) => all.push(result("rank", rank, Verdict::Fail, e.to_string())),
        }
    }
    report(&all, a.strict)
}

fn run_process(a: &SelftestArgs) -> Result<(), CliError> {
    let g = TcpGroup::from_env().map_err(|e| CliError(format!("cannot join the process group: {e}")))?;
    let (me, n) = (g.rank(), g.size());
    let gpus = sys::gpu_count();
    if me == 0 {
        println!("moelink selftest | process mode | {n} ranks over TCP | commit {}", sys::commit());
        if gpus == 0 {
            let why = sys::cuda_info().err().unwrap_or_else(|| "the driver reports no GPU".into());
            println!("no GPU found ({why}): the GPU checks are skipped");
        }
    }
    let mine = run_checks(&g, g.local_rank() % gpus.max(1), a, gpus > 0);
    // Each rank prints its own failures at once: torchrun ends every rank as soon as one exits non-zero,
    // so a report left to rank 0 alone can be cut off before it names the failing rank's check.
    for r in mine.iter().filter(|r| r.verdict == Verdict::Fail) {
        eprintln!("rank {me}: FAIL {} {}", r.name, r.detail);
    }
    let payload = serde_json::to_vec(&mine).map_err(|e| CliError(format!("cannot encode results: {e}")))?;
    match g.all_gather(&payload) {
        Ok(all) => {
            let mut merged = Vec::new();
            for (rank, bytes) in all.iter().enumerate() {
                match serde_json::from_slice::<Vec<CheckResult>>(bytes) {
                    Ok(v) => merged.extend(v),
                    Err(e) => merged.push(result("rank", rank, Verdict::Fail, format!("sent unreadable results: {e}"))),
                }
            }
            // Every rank reaches the same verdict; only rank 0 prints the report, and nobody exits before it
            // has (see above).
            let outcome = if me == 0 { report(&merged, a.strict) } else { verdict(&merged, a.strict).map(|_| ()) };
            let _ = g.barrier();
            outcome
        }
        Err(e) => {
            // The group broke: each rank reports what it saw itself.
            println!("rank {me}: cannot gather results ({e}); this rank's own results:");
            report(&mine, a.strict)
        }
    }
}

/// Counts (passed, failed, skipped) over checks, a check failing if it fails on any rank.
fn verdict(all: &[CheckResult], strict: bool) -> Result<(usize, usize, usize), CliError> {
    let names = check_names(all);
    let (mut pass, mut fail, mut skip) = (0, 0, 0);
    for name in &names {
        match worst(all, name) {
            Verdict::Pass => pass += 1,
            Verdict::Fail => fail += 1,
            Verdict::Skip => skip += 1,
        }
    }
    if fail > 0 {
        return Err(CliError(format!("selftest failed: {fail} of {} checks", names.len())));
    }
    if strict && skip > 0 {
        return Err(CliError(format!("selftest: {skip} of {} checks could not run (--strict)", names.len())));
    }
    Ok((pass, fail, skip))
}

fn check_names(all: &[CheckResult]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for r in all {
        if !names.contains(&r.name) {
            names.push(r.name.clone());
        }
    }
    names
}

fn worst(all: &[CheckResult], name: &str) -> Verdict {
    let vs: Vec<Verdict> = all.iter().filter(|r| r.name == name).map(|r| r.verdict).collect();
    if vs.contains(&Verdict::Fail) {
        Verdict::Fail
    } else if vs.iter().all(|v| *v == Verdict::Pass) {
        Verdict::Pass
    } else {
        Verdict::Skip
    }
}

/// Prints one line per check (one per failing rank for failures) and the totals.
fn report(all: &[CheckResult], strict: bool) -> Result<(), CliError> {
    for name in check_names(all) {
        let rows: Vec<&CheckResult> = all.iter().filter(|r| r.name == name).collect();
        match worst(all, &name) {
            Verdict::Pass => println!("PASS {name:<17} {}", rows[0].detail),
            Verdict::Skip => println!("SKIP {name:<17} {}", rows.iter().find(|r| r.verdict == Verdict::Skip).map_or("", |r| &r.detail)),
            Verdict::Fail => {
                // One line per distinct reason, naming the ranks that gave it.
                let mut reasons: Vec<(&str, Vec<usize>)> = Vec::new();
                for r in rows.iter().filter(|r| r.verdict == Verdict::Fail) {
                    match reasons.iter_mut().find(|(d, _)| *d == r.detail) {
                        Some((_, ranks)) => ranks.push(r.rank),
                        None => reasons.push((&r.detail, vec![r.rank])),
                    }
                }
                for (detail, ranks) in reasons {
                    println!("FAIL {name:<17} {}: {detail}", rank_list(&ranks));
                }
            }
        }
    }
    let result = verdict(all, strict);
    let count = |v: Verdict| check_names(all).iter().filter(|n| worst(all, n) == v).count();
    println!("selftest: {} passed, {} failed, {} skipped", count(Verdict::Pass), count(Verdict::Fail), count(Verdict::Skip));
    result.map(|_| ())
}

/// `rank 3`, or `ranks 0-2, 5 (4 ranks)`.
fn rank_list(ranks: &[usize]) -> String {
    if let [one] = ranks {
        return format!("rank {one}");
    }
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        runs.push(if j > i { format!("{}-{}", ranks[i], ranks[j]) } else { ranks[i].to_string() });
        i = j + 1;
    }
    format!("ranks {} ({} ranks)", runs.join(", "), ranks.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_ranks_are_listed_compactly() {
        assert_eq!(rank_list(&[3]), "rank 3");
        assert_eq!(rank_list(&[0, 1, 2, 5, 7, 8]), "ranks 0-2, 5, 7-8 (6 ranks)");
    }

    fn outcome(error: Option<&str>, peer: Option<usize>, elapsed_ms: f64, refused: bool) -> diag::DeadlineOutcome {
        diag::DeadlineOutcome { rank: 0, error: error.map(String::from), peer, elapsed_ms, refused_afterwards: refused }
    }

    #[test]
    fn deadline_verdicts() {
        let pass = |o: &diag::DeadlineOutcome, me| judge_deadline(o, me, 3, 1000).verdict;
        assert_eq!(pass(&outcome(Some("timeout"), Some(3), 1100.0, true), 0), Verdict::Pass);
        assert_eq!(pass(&outcome(None, None, 0.0, false), 3), Verdict::Pass);
        assert_eq!(pass(&outcome(None, None, 0.0, false), 0), Verdict::Fail);
        assert_eq!(pass(&outcome(Some("timeout"), Some(1), 1100.0, true), 0), Verdict::Fail);
        assert_eq!(pass(&outcome(Some("timeout"), Some(3), 9000.0, true), 0), Verdict::Fail);
        assert_eq!(pass(&outcome(Some("timeout"), Some(3), 1100.0, false), 0), Verdict::Fail);
        assert_eq!(pass(&outcome(Some("err"), None, 0.0, true), 3), Verdict::Fail);
    }

    #[test]
    fn a_check_fails_if_any_rank_fails_and_skips_fail_only_when_strict() {
        let all = vec![
            result("group", 0, Verdict::Pass, "ok"),
            result("group", 1, Verdict::Pass, "ok"),
            result("gpu", 0, Verdict::Skip, "unavailable"),
            result("gpu", 1, Verdict::Skip, "unavailable"),
        ];
        assert_eq!(verdict(&all, false).map_err(|e| e.0), Ok((1, 0, 1)));
        assert!(verdict(&all, true).is_err());
        let mut bad = all.clone();
        bad.push(result("group", 2, Verdict::Fail, "wrong bytes"));
        assert!(verdict(&bad, false).is_err());
    }

    #[test]
    fn the_group_check_passes_on_threads() {
        let out = moelink::group::run_ranks_with_timeout(3, Duration::from_secs(10), |g| Ok(group_check(&g)));
        for r in out {
            assert_eq!(r.map(|c| c.verdict).ok(), Some(Verdict::Pass));
        }
    }
}
