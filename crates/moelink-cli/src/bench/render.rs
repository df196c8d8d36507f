//! What a run prints: the header, the per-batch summary, the results table, and the HT kernel-trace lines of
//! `MOELINK_HT_TRACE=1`.

use super::*;

/// What the times are, in a line.
pub(super) fn timer_line(backend: BackendKind) -> &'static str {
    match backend {
        BackendKind::Cuda => {
            "CUDA events behind a GPU barrier and an L2 flush, per rep: HT prepare_dispatch + dispatch_into (count exchange \
             + host wait + dispatch) and combine_into into preallocated outputs; LL one CUDA-graph replay (--hook: send and \
             receive graphs apart; MOELINK_LL_TRACE=1: kernel spans, and dispatch + combine back to back as DeepEP times)"
        }
        _ => "wall clock after a barrier, per rep, around the plain calls (preallocated outputs)",
    }
}

pub(super) fn header(p: &Plan, f: &RunFacts, nvl: usize, rdma: usize) -> String {
    let backend = match (p.backend, &p.fallback_reason) {
        (BackendKind::Cuda, _) => format!("cuda on {} x {}", p.gpus, f.device),
        (_, Some(why)) => format!(
            "host (CPU threads on {}; no usable GPU: {why}) -- these times measure the CPU reference, not GPU performance",
            f.device
        ),
        (_, None) => format!("host (CPU threads on {}) -- these times measure the CPU reference, not GPU performance", f.device),
    };
    let mib = |b: usize| b.div_ceil(1 << 20);
    let nodes = match &p.internode {
        Some((t, rdma)) => format!(
            "\n  nodes {t} ({} transport, peers of a node over {}){}",
            rdma.transport.name(),
            if rdma.allow_nvlink_for_low_latency_mode { "NVLink" } else { "the transport" },
            if p.backend == BackendKind::Cuda {
                " -- virtual nodes on this machine: no NIC is crossed, so the times are not network latency \
                 (rdma_bytes and rdma_floor_us_400g give the byte model's figures)"
            } else {
                ""
            }
        ),
        None => String::new(),
    };
    let shared = match p.gpus_shared_by {
        Some(n) => format!(
            "\n  up to {n} ranks share each GPU ({}): they exchange through its memory, so no time here is an \
             NVLink or network figure",
            if p.process { "one process each" } else { "thread mode" }
        ),
        None => String::new(),
    };
    format!(
        "moelink bench | backend: {backend}{nodes}{shared}\n  ranks {} | reps {} (+{} warm-up) | {} batches | buffers: HT {} MiB, LL {} MiB | commit {} | {}\n  \
         timer: {}",
        p.ranks,
        p.reps,
        p.warmup,
        p.batches.len(),
        mib(nvl),
        mib(rdma),
        f.commit,
        f.date,
        timer_line(p.backend)
    )
}

/// Folds the ranks' outcomes of each case into a record.
pub(super) fn summarize(
    cases: &[Case],
    inputs: &Inputs,
    results: &[Result<Vec<RankOutcome>>],
    facts: &RunFacts,
    p: &Plan,
    a: &BenchArgs,
) -> Vec<Record> {
    let s = &inputs.shape;
    let rank_errors: Vec<&moelink::Error> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let whole_run_error = first_cause(&rank_errors);
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
            if c.routing == RoutingKind::NodeLimited {
                rec.extra.insert("max_nodes".into(), serde_json::json!(a.max_nodes));
            }
            rec.num_sms = c.num_sms;
            if let Some((topology, rdma)) = &p.internode {
                rec.nodes = Some(topology.num_nodes);
                rec.ranks_per_node = Some(topology.ranks_per_node);
                rec.transport = Some(rdma.transport.name().into());
                let paths = match c.mode {
                    Mode::Ll => ll_path_bytes(c, inputs, topology, rdma.allow_nvlink_for_low_latency_mode),
                    Mode::Ht => ht_path_bytes(c, inputs, topology),
                };
                let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
                let max_rdma = paths.rdma.iter().copied().max().unwrap_or(0);
                rec.extra.insert("rdma_bytes".into(), serde_json::json!(mean(&paths.rdma)));
                rec.extra.insert("rdma_bytes_max".into(), serde_json::json!(max_rdma));
                rec.extra.insert("nvlink_bytes".into(), serde_json::json!(mean(&paths.nvlink)));
                rec.extra.insert("nvl_bytes".into(), serde_json::json!(mean(&paths.nvlink)));
                // The floor one 400 Gb/s NIC per GPU (50 GB/s) would set: the busiest rank's RDMA bytes.
                rec.extra.insert("rdma_floor_us_400g".into(), serde_json::json!(max_rdma as f64 / 50e3));
            }
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
            let slowest = slowest_per_rep(&per_rank);
            let t = median(slowest.clone());
            let (logical, wire) = bytes_moved(c, inputs);
            rec.time_us = Some(t);
            rec.logical_gbps = Some(logical / (t * 1e3));
            // Across nodes, the byte model's bytes per rank over the slowest rank's time (DeepEP's "RDMA" and
            // "NVL" GB/s).
            for (bytes, gbps) in [("rdma_bytes", "rdma_gbps"), ("nvl_bytes", "nvl_gbps")] {
                if let Some(b) = rec.extra.get(bytes).and_then(|v| v.as_f64()) {
                    rec.extra.insert(gbps.into(), serde_json::json!(b / (t * 1e3)));
                }
            }
            rec.wire_gbps = Some(wire / (t * 1e3));
            rec.reps = Some(p.reps);
            rec.warmup = Some(p.warmup);
            rec.timer = outs.iter().find_map(|o| o.timer).map(String::from);
            if !slowest.is_empty() {
                rec.extra.insert("time_us_min".into(), serde_json::json!(slowest.iter().copied().fold(f64::INFINITY, f64::min)));
                rec.extra.insert("time_us_max".into(), serde_json::json!(slowest.iter().copied().fold(0.0, f64::max)));
            }
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
            // Kernel traces are of the ranks that hold them: every rank in thread mode, this process's rank
            // (rank 0, the reporter) in process mode (`trace_ranks` then says how many).
            let traced: Vec<&RankOutcome> =
                outs.iter().copied().filter(|o| o.traces.iter().chain(&o.loop_traces).any(|t| !t.is_empty())).collect();
            if !traced.is_empty() && traced.len() < outs.len() {
                rec.extra.insert("trace_ranks".into(), serde_json::json!(traced.len()));
            }
            for (i, key) in ["kernel", "send_kernel", "recv_kernel"].iter().enumerate() {
                let spans: Vec<Vec<f64>> = traced.iter().map(|o| o.traces[i].iter().map(|t| t.span_us).collect()).collect();
                if !spans.is_empty() && spans.iter().all(|v| !v.is_empty()) {
                    rec.extra.insert(format!("{key}_us"), serde_json::json!(slowest_rank_median(&spans)));
                    rec.extra.insert(format!("{key}_trace"), trace_points_json(traced.iter().map(|o| o.traces[i].as_slice())));
                }
            }
            for (i, key) in ["loop_dispatch_kernel_us", "loop_combine_kernel_us", "loop_pair_us"].iter().enumerate() {
                let v: Vec<Vec<f64>> = traced.iter().map(|o| o.loop_times[i].clone()).collect();
                if !v.is_empty() && v.iter().all(|v| !v.is_empty()) {
                    rec.extra.insert((*key).into(), serde_json::json!(slowest_rank_median(&v)));
                }
            }
            for (i, key) in ["loop_dispatch_trace", "loop_combine_trace"].iter().enumerate() {
                if !traced.is_empty() && traced.iter().all(|o| !o.loop_traces[i].is_empty()) {
                    rec.extra.insert((*key).into(), trace_points_json(traced.iter().map(|o| o.loop_traces[i].as_slice())));
                }
            }
            let cached: Vec<Vec<f64>> = outs.iter().map(|o| o.cached_us.clone()).collect();
            if cached.iter().all(|v| !v.is_empty()) {
                let ct = slowest_rank_median(&cached);
                rec.extra.insert("cached_us".into(), serde_json::json!(ct));
                rec.extra.insert("cached_logical_gbps".into(), serde_json::json!(logical / (ct * 1e3)));
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

/// One column of the bench's table: a title, whether it is numeric (right-aligned), each record's cell, and
/// what its unit means (printed under the table when the column is shown).
pub(super) struct Column {
    title: &'static str,
    numeric: bool,
    cells: Vec<String>,
    legend: Option<&'static str>,
}

/// The bench's one table: a row per measurement. Columns whose value is the same in every row (ranks, shape,
/// routing) move into a line above it; columns only some runs fill (cached dispatch, receive hook, kernel
/// spans, SMs on the GPU) appear when a row has them. Under the table, what each unit is.
pub(super) fn render(records: &[Record], backend: BackendKind) -> String {
    let opt = |v: Option<usize>| v.map_or("-".to_string(), |n| n.to_string());
    let measured = |r: &Record| matches!(r.status, Status::Ok | Status::Incorrect);
    let extra = |r: &Record, k: &str| r.extra.get(k).and_then(|v| v.as_f64());
    let col =
        |title, numeric, legend, f: &dyn Fn(&Record) -> String| Column { title, numeric, legend, cells: records.iter().map(f).collect() };
    // Identity columns: always mode/op/dtype; the others fold into the line above the table when constant.
    let mut lead = vec![
        col("mode", false, None, &|r| r.mode.clone()),
        col("op", false, None, &|r| r.op.clone()),
        col("dtype", false, None, &|r| r.dtype.clone().unwrap_or_else(|| "-".into())),
    ];
    let mut foldable = vec![
        col("ranks", true, None, &|r| r.ranks.to_string()),
        col("tokens", true, None, &|r| opt(r.tokens)),
        col("hidden", true, None, &|r| opt(r.hidden)),
        col("topk", true, None, &|r| opt(r.topk)),
        col("experts", true, None, &|r| opt(r.experts)),
        col("routing", false, None, &|r| r.routing.clone().unwrap_or_else(|| "-".into())),
    ];
    // Across nodes: the topology and the transport between nodes.
    if records.iter().any(|r| r.nodes.is_some()) {
        foldable.push(col("nodes", false, None, &|r| format!("{}x{}", r.nodes.unwrap_or(1), r.ranks_per_node.unwrap_or(r.ranks))));
        foldable.push(col("transport", false, None, &|r| r.transport.clone().unwrap_or_else(|| "-".into())));
    }
    // SMs only mean something for the GPU's kernels; the host backend runs on CPU threads.
    if backend == BackendKind::Cuda {
        foldable.push(col("SMs", true, Some("SMs: the blocks the high-throughput kernels ran on (one per SM)"), &|r| opt(r.num_sms)));
    }
    let mut same = Vec::new();
    for c in foldable {
        match c.cells.first() {
            Some(first) if records.len() > 1 && c.cells.iter().all(|v| v == first) => same.push(format!("{} {first}", c.title)),
            _ => lead.push(c),
        }
    }
    let time = |r: &Record, v: Option<f64>| if measured(r) { v.map_or("-".into(), num) } else { String::new() };
    let pair = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{}+{}", num(a), num(b)),
        _ => "-".into(),
    };
    let mut body = vec![
        col("time µs", true, Some("time µs: the median over repetitions of the slowest rank (per repetition the largest time of any rank)"), &|r| {
            time(r, r.time_us)
        }),
        col("min-max µs", true, Some("min-max µs: the fastest and the slowest repetition (slowest rank each)"), &|r| {
            match (extra(r, "time_us_min"), extra(r, "time_us_max")) {
                (Some(lo), Some(hi)) if measured(r) => format!("{}-{}", num(lo), num(hi)),
                _ => "-".into(),
            }
        }),
        col(
            "logical GB/s",
            true,
            Some("logical GB/s: the bytes of the rows a rank receives, its own rows included (DeepEP's accounting), per rank, over time µs"),
            &|r| time(r, r.logical_gbps),
        ),
        col(
            "wire GB/s",
            true,
            Some("wire GB/s: the same without the rows a rank sends to itself, i.e. the bytes that cross between ranks (NVLink on a GPU node)"),
            &|r| time(r, r.wire_gbps),
        ),
        col("cached µs", true, Some("cached µs: the same dispatch again with the first one's handle (no count exchange, no top-k), as DeepEP's benchmark times"), &|r| {
            extra(r, "cached_us").map_or("-".into(), num)
        }),
        col("send+recv µs", true, Some("send+recv µs: receive-hook mode (--hook), the send phase and the receive phase timed apart"), &|r| {
            pair(extra(r, "send_us"), extra(r, "recv_us"))
        }),
        col("kernel µs", true, Some("kernel µs: the kernel's own span from its trace (--ll-trace), without the launch"), &|r| {
            extra(r, "kernel_us").map_or("-".into(), num)
        }),
        col(
            "back-to-back µs",
            true,
            Some("back-to-back µs: dispatch+combine kernel spans replayed back to back with no barrier between calls (--ll-trace), as DeepEP times"),
            &|r| pair(extra(r, "loop_dispatch_kernel_us"), extra(r, "loop_combine_kernel_us")),
        ),
        col(
            "RDMA KB/rank",
            true,
            Some(
                "RDMA KB/rank (max), NVLink KB/rank: across nodes, the bytes a call sends per rank over each path by the byte model \
                 of docs/internode.md (HT as DeepEP's internode test counts them, LL per destination rank; meta blocks not \
                 counted), the mean over ranks and the busiest rank's",
            ),
            &|r| match (extra(r, "rdma_bytes"), extra(r, "rdma_bytes_max")) {
                (Some(mean), Some(max)) => format!("{:.1} ({:.1})", mean / 1e3, max / 1e3),
                _ => "-".into(),
            },
        ),
        col("NVLink KB/rank", true, None, &|r| extra(r, "nvlink_bytes").map_or("-".into(), |b| format!("{:.1}", b / 1e3))),
        col(
            "400G floor µs",
            true,
            Some("400G floor µs: the time the busiest rank's RDMA bytes take on one 400 Gb/s NIC (50 GB/s)"),
            &|r| extra(r, "rdma_floor_us_400g").map_or("-".into(), |v| format!("{v:.1}")),
        ),
        col(
            "RDMA GB/s",
            true,
            Some(
                "RDMA GB/s, NVL GB/s: those bytes over time µs (DeepEP's figures); ranks sharing one GPU or the emulated NIC \
                 cross no network, so these are not NIC or NVLink figures",
            ),
            &|r| time(r, extra(r, "rdma_gbps")),
        ),
        col("NVL GB/s", true, None, &|r| time(r, extra(r, "nvl_gbps"))),
        col("correct", false, Some("correct: checked bit for bit against the expected results before timing (on CUDA also against the host backend)"), &|r| {
            match r.status {
                Status::Ok => "yes".into(),
                Status::Incorrect => format!("NO: {}", r.error.as_deref().unwrap_or("?")),
                _ => String::new(),
            }
        }),
    ];
    // Optional measurements appear only when some row has them.
    body.retain(|c| c.cells.iter().any(|v| v != "-" && !v.is_empty()) || matches!(c.title, "time µs" | "correct"));
    let titles: Vec<&str> = lead.iter().chain(&body).map(|c| c.title).collect();
    let numeric: Vec<bool> = lead.iter().chain(&body).map(|c| c.numeric).collect();
    let mut t = Table::new(&titles, &numeric);
    for (i, r) in records.iter().enumerate() {
        let head: Vec<String> = lead.iter().map(|c| c.cells[i].clone()).collect();
        match r.status {
            Status::Unavailable => t.note(head, format!("unavailable: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Error => t.note(head, format!("error: {}", r.error.as_deref().unwrap_or("?"))),
            Status::Ok | Status::Incorrect => t.row(head.into_iter().chain(body.iter().map(|c| c.cells[i].clone())).collect()),
        }
    }
    let mut out = String::new();
    if !same.is_empty() {
        out += &format!("every row: {}\n", same.join(", "));
    }
    out += &t.render();
    for legend in lead.iter().chain(&body).filter_map(|c| c.legend) {
        out += &format!("  {legend}\n");
    }
    out
}

/// One stderr line per high-throughput kernel trace of the last timed region (`MOELINK_HT_TRACE=1`): when
/// the blocks started and ended and each role's warps started and finished their work, in µs after the
/// kernel's first block (min / median / max); across nodes every point of the trace, the chunk durations
/// (`*_us`) as min / median / max over chunks.
pub(super) fn print_ht_traces(buf: &Buffer) {
    let internode: Vec<_> = buf.kernel_traces().into_iter().filter(|t| t.kernel.starts_with("moelink::internode::")).collect();
    for (i, t) in internode.iter().enumerate() {
        // The GPU's idle time since the launch before (a fresh dispatch: notify, the host's wait, the launch).
        let gap = match i.checked_sub(1).map(|j| &internode[j]) {
            Some(prev) => {
                format!(" {:.1} us after the {}'s end;", (t.start_ns as f64 - prev.start_ns as f64) / 1e3 - prev.span_us, prev.op)
            }
            None => String::new(),
        };
        let points: Vec<String> = t
            .points
            .iter()
            .map(|p| {
                let sign = if p.name.ends_with("_us") { "" } else { "+" };
                format!("{} {sign}{:.1}/{sign}{:.1}/{sign}{:.1} ({})", p.name, p.min_us, p.median_us, p.max_us, p.blocks)
            })
            .collect();
        eprintln!("moelink trace: rank {} {} ({}): span {:.1} us;{gap} {}", buf.rank(), t.op, t.kernel, t.span_us, points.join(", "));
    }
    for t in buf.kernel_traces().iter().filter(|t| t.kernel.starts_with("moelink::intranode::")) {
        let at = |name: &str| t.point(name).map_or("-".to_string(), |p| format!("+{:.1}/+{:.1}/+{:.1}", p.min_us, p.median_us, p.max_us));
        eprintln!(
            "moelink trace: rank {} {} ({}): span {:.1} us; block start {}, senders start {} end {}, receivers start {} end {}, \
             block end {} (us, min/median/max)",
            buf.rank(),
            t.op,
            t.kernel,
            t.span_us,
            at("start"),
            at("send_start"),
            at("send_end"),
            at("recv_start"),
            at("recv_end"),
            at("end")
        );
    }
}

/// The most telling error among ranks: a rank's own failure rather than the timeouts it caused elsewhere.
fn first_cause(errors: &[&moelink::Error]) -> Option<String> {
    use moelink::Error;
    let secondary = |e: &Error| matches!(e, Error::Timeout { .. } | Error::Group { .. } | Error::Poisoned { .. });
    errors.iter().find(|e| !secondary(e)).or_else(|| errors.first()).map(|e| e.to_string())
}
