//! Kernel timing traces ([`crate::KernelTracing`], [`crate::Buffer::kernel_traces`]): the `%globaltimer`
//! stamps the high-throughput and low-latency kernels store when tracing is on, summarised into one
//! [`KernelTrace`] per launch. The library returns them; printing is the caller's (`moelink bench`).
//!
//! Both families stamp raw u64 nanoseconds of the GPU's global timer (0: not reached); the layouts differ
//! and are decoded here:
//! - high-throughput (`ht.cuh`, `HT_TRACE_*`): per block its start and end, then per warp the start and the
//!   end of its work (senders: after the hand-back wait until their last flag; receivers: after this rank's
//!   own rows until their last row). The first `send_blocks` blocks are senders.
//! - high-throughput across nodes (`hti.cuh`, `HTI_TRACE_*`): the same per block and warp (senders,
//!   forwarders, then receivers or reducers), then per chunk the stamps of the senders / reducers and of the
//!   forwarders (`hti_launch`).
//! - low-latency (`ll.cuh`, `LL_TRACE_*`, `moelink_kernels::ll::LL_TRACE_POINTS`): per launch slot
//!   (`(epoch % LL_TRACE_CALLS) * 2 + receive-only`) and block, one word per protocol point.

use moelink_kernels::ll::{LL_TRACE_CALLS, LL_TRACE_POINTS, LL_TRACE_WORDS};

/// When the stamps of one traced point fell, in µs after the launch's first block started.
#[derive(Clone, Debug, PartialEq)]
pub struct TracePoint {
    /// The point. Low-latency: `start`, `send_ready`, `send_issued`, `send_stored`, `send_done`,
    /// `recv_seen`, `recv_stored`, `end` (per block); block 0 of a dispatch send: `index_checked`; a
    /// dispatch receive: `recv_indexed`, the counts scanned into bases. High-throughput: `start` and `end`
    /// (per block), `send_start`, `send_end`, `recv_start`, `recv_end` (per warp of the role); across nodes
    /// also the forwarders' and per-chunk points (`HTI_TRACE_*` in hti.cuh), where a name ending in `_us` is a
    /// duration (min / median / max over chunks), not a time after the launch; a fresh CPU-synchronised
    /// dispatch across nodes also has the host's `host_ready_us` (notify's READY seen → the dispatch's
    /// launch called) and `host_launch_us` (the launch call).
    pub name: &'static str,
    /// How many stamps it has: blocks, or for the high-throughput role points warps.
    pub blocks: usize,
    pub min_us: f64,
    pub median_us: f64,
    pub max_us: f64,
    /// Block 0's stamp (the low-latency send phases' index/check block), for per-block points.
    pub block0_us: Option<f64>,
}

/// The trace of one kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTrace {
    /// The kernel as a profiler names it (`moelink_kernels::kernel_name`): `moelink::low_latency::dispatch`,
    /// `moelink::intranode::combine`, ...
    pub kernel: &'static str,
    /// The operation: `"dispatch"`, `"cached dispatch"` (high-throughput) or `"combine"`.
    pub op: &'static str,
    /// `"send+recv"` (one launch: every high-throughput call, a low-latency call without hook), `"send"` or
    /// `"recv"` (low-latency receive-hook mode).
    pub phases: &'static str,
    /// The first block's start, GPU `%globaltimer` nanoseconds (orders launches of one GPU).
    pub start_ns: u64,
    /// First block's start to last block's end: the kernel duration a profiler reports, without the launch.
    pub span_us: f64,
    /// The points the launch passed, in kernel order.
    pub points: Vec<TracePoint>,
}

impl KernelTrace {
    /// The point named `name`, if the launch passed it.
    pub fn point(&self, name: &str) -> Option<&TracePoint> {
        self.points.iter().find(|p| p.name == name)
    }
}

/// Summary of the stamps at or after `t0` (a 0 word, a point not reached, never counts: `t0 > 0`).
fn point(name: &'static str, stamps: impl Iterator<Item = u64>, t0: u64, block0: Option<u64>) -> Option<TracePoint> {
    let us = |v: u64| (v - t0) as f64 / 1e3;
    let mut p = summary(name, stamps.filter(|&s| s >= t0 && s != 0).map(us).collect())?;
    p.block0_us = block0.filter(|&s| s >= t0 && s != 0).map(us);
    Some(p)
}

/// Min / median / max of `values` (µs) as a point without a block-0 value; `None` when there are none.
pub(crate) fn summary(name: &'static str, mut values: Vec<f64>) -> Option<TracePoint> {
    values.sort_by(f64::total_cmp);
    let (&min_us, &max_us) = (values.first()?, values.last()?);
    Some(TracePoint { name, blocks: values.len(), min_us, median_us: values[values.len() / 2], max_us, block0_us: None })
}

/// One high-throughput launch from its words (`blocks` blocks of `warps` warps, the first `send_blocks`
/// sending); `None` when no block stamped its start.
pub(crate) fn ht_launch(
    words: &[u64],
    blocks: usize,
    warps: usize,
    send_blocks: usize,
    kernel: &'static str,
    op: &'static str,
) -> Option<KernelTrace> {
    let per_block = moelink_kernels::ht::trace_words_per_block(warps as u32);
    let word = |k: usize, w: usize| words.get(k * per_block + w).copied().unwrap_or(0);
    let t0 = (0..blocks).map(|k| word(k, 0)).filter(|&v| v != 0).min()?;
    let role = |range: std::ops::Range<usize>, end: bool| {
        let w = if end { 3 } else { 2 };
        range.flat_map(move |k| (0..warps).map(move |i| (k, w + 2 * i)))
    };
    let senders = 0..send_blocks.min(blocks);
    let receivers = send_blocks.min(blocks)..blocks;
    let points: Vec<TracePoint> = [
        point("start", (0..blocks).map(|k| word(k, 0)), t0, Some(word(0, 0))),
        point("send_start", role(senders.clone(), false).map(|(k, w)| word(k, w)), t0, None),
        point("send_end", role(senders, true).map(|(k, w)| word(k, w)), t0, None),
        point("recv_start", role(receivers.clone(), false).map(|(k, w)| word(k, w)), t0, None),
        point("recv_end", role(receivers, true).map(|(k, w)| word(k, w)), t0, None),
        point("end", (0..blocks).map(|k| word(k, 1)), t0, Some(word(0, 1))),
    ]
    .into_iter()
    .flatten()
    .collect();
    let span_us = points.iter().find(|p| p.name == "end").map_or(0.0, |p| p.max_us);
    Some(KernelTrace { kernel, op, phases: "send+recv", start_ns: t0, span_us, points })
}

/// The shape of an internode high-throughput launch, for decoding its trace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HtiTraceShape {
    /// Blocks of the grid (the emulated NIC's included: the trace has room for them).
    pub blocks: usize,
    /// Worker blocks: senders, then forwarders, then receivers (dispatch) or reducers (combine).
    pub workers: usize,
    pub send_blocks: usize,
    pub fwd_blocks: usize,
    pub nodes: usize,
}

/// One internode high-throughput launch from its words (`HTI_TRACE_*` in hti.cuh); `None` when no
/// block stamped its start. Points: the blocks' start and end, each role's warps' start and end
/// (`send_*`, `fwd_*`, `recv_*` or for combine `reduce_*`), then per chunk its stamps and, named `*_us`,
/// the time between two of them (durations, not offsets): dispatch senders `chunk_taken`, `chunk_staged`,
/// `chunk_put`, `stage_us`, `put_us`; forwarders `fwd_seen`, `fwd_copied`, `fwd_released`, `fwd_copy_us`,
/// `fwd_release_us`; combine forwarders `fwd_started`, `fwd_summed`, `fwd_put`, `fwd_sum_us`, `fwd_put_us`;
/// reducers `reduce_taken`, `reduce_seen`, `reduce_done`, `reduce_wait_us`, `reduce_us`; with the emulated
/// NIC, per NIC block `nic_first_put`, `nic_last_put`, `nic_end` and the time it spent executing
/// descriptors, idle with nothing posted, and holding a put for the rate cap: `nic_busy_us`, `nic_idle_us`,
/// `nic_capped_us`.
pub(crate) fn hti_launch(words: &[u64], shape: HtiTraceShape, kernel: &'static str, op: &'static str) -> Option<KernelTrace> {
    use moelink_kernels::ht_internode::{HTI_TRACE_BLOCK_WORDS, HTI_TRACE_CHUNKS, HTI_TRACE_CHUNK_WORDS, HTI_WARPS};
    use moelink_kernels::transport::nic_stat;
    let word = |i: usize| words.get(i).copied().unwrap_or(0);
    let block = |k: usize, w: usize| word(k * HTI_TRACE_BLOCK_WORDS + w);
    let t0 = (0..shape.workers).map(|k| block(k, 0)).filter(|&v| v != 0).min()?;
    let warps = HTI_WARPS as usize;
    let role =
        |range: std::ops::Range<usize>, end: bool| range.flat_map(move |k| (0..warps).map(move |i| block(k, 2 + 2 * i + end as usize)));
    let send = 0..shape.send_blocks.min(shape.workers);
    let fwd = send.end..(send.end + shape.fwd_blocks).min(shape.workers);
    let last = fwd.end..shape.workers;
    let combine = op == "combine";
    let last_name = if combine { ["reduce_start", "reduce_end"] } else { ["recv_start", "recv_end"] };
    // Chunk records: area 0 the senders' / reducers', area 1 + n the forwarders' of source node n.
    let chunks_base = shape.blocks * HTI_TRACE_BLOCK_WORDS;
    let record = |area: usize, c: usize, p: usize| word(chunks_base + (area * HTI_TRACE_CHUNKS + c) * HTI_TRACE_CHUNK_WORDS + p);
    let records = |areas: std::ops::Range<usize>| areas.flat_map(move |a| (0..HTI_TRACE_CHUNKS).map(move |c| (a, c)));
    let stamps = |areas: std::ops::Range<usize>, p: usize| records(areas).map(move |(a, c)| record(a, c, p));
    let between = |name: &'static str, areas: std::ops::Range<usize>, from: usize, to: usize| {
        let spans = records(areas).filter_map(|(a, c)| {
            let (x, y) = (record(a, c, from), record(a, c, to));
            (x != 0 && y >= x).then(|| (y - x) as f64 / 1e3)
        });
        summary(name, spans.collect())
    };
    let (own, fwds) = (0..1, 1..1 + shape.nodes);
    let own_names = if combine { ["reduce_taken", "reduce_seen", "reduce_done"] } else { ["chunk_taken", "chunk_staged", "chunk_put"] };
    let own_spans = if combine { ["reduce_wait_us", "reduce_us"] } else { ["stage_us", "put_us"] };
    let fwd_names = if combine { ["fwd_started", "fwd_summed", "fwd_put"] } else { ["fwd_seen", "fwd_copied", "fwd_released"] };
    let fwd_spans = if combine { ["fwd_sum_us", "fwd_put_us"] } else { ["fwd_copy_us", "fwd_release_us"] };
    let mut points: Vec<Option<TracePoint>> = vec![
        point("start", (0..shape.workers).map(|k| block(k, 0)), t0, Some(block(0, 0))),
        point("send_start", role(send.clone(), false), t0, None),
        point("send_end", role(send, true), t0, None),
        point("fwd_start", role(fwd.clone(), false), t0, None),
        point("fwd_end", role(fwd, true), t0, None),
        point(last_name[0], role(last.clone(), false), t0, None),
        point(last_name[1], role(last, true), t0, None),
        point("end", (0..shape.workers).map(|k| block(k, 1)), t0, Some(block(0, 1))),
    ];
    for (p, name) in own_names.into_iter().enumerate() {
        points.push(point(name, stamps(own.clone(), p), t0, None));
    }
    points.push(between(own_spans[0], own.clone(), 0, 1));
    points.push(between(own_spans[1], own, 1, 2));
    for (p, name) in fwd_names.into_iter().enumerate() {
        points.push(point(name, stamps(fwds.clone(), p), t0, None));
    }
    points.push(between(fwd_spans[0], fwds.clone(), 0, 1));
    points.push(between(fwd_spans[1], fwds, 1, 2));
    // The emulated NIC's blocks (after the workers): when they put, and where their time went.
    let nics = shape.workers..shape.blocks;
    let nic_word = move |w: usize| nics.clone().map(move |k| block(k, w));
    points.push(point("nic_first_put", nic_word(nic_stat::FIRST_PUT), t0, None));
    points.push(point("nic_last_put", nic_word(nic_stat::LAST_PUT), t0, None));
    points.push(point("nic_end", nic_word(nic_stat::END), t0, None));
    let nic_ran = |k: &usize| block(*k, nic_stat::END) != 0;
    for (name, w) in [("nic_busy_us", nic_stat::BUSY_NS), ("nic_idle_us", nic_stat::IDLE_NS), ("nic_capped_us", nic_stat::CAPPED_NS)] {
        points.push(summary(name, (shape.workers..shape.blocks).filter(nic_ran).map(|k| block(k, w) as f64 / 1e3).collect()));
    }
    let points: Vec<TracePoint> = points.into_iter().flatten().collect();
    let span_us = points.iter().find(|p| p.name == "end").map_or(0.0, |p| p.max_us);
    Some(KernelTrace { kernel, op, phases: "send+recv", start_ns: t0, span_us, points })
}

/// The internode notify's launch from its stamps (`NOTIFY_TRACE_*` in hti.cuh, one block); `None` when it
/// did not stamp its start and end.
pub(crate) fn notify_launch(words: &[u64], kernel: &'static str) -> Option<KernelTrace> {
    use moelink_kernels::ht_internode::NOTIFY_TRACE_POINTS;
    let t0 = words.first().copied().filter(|&v| v != 0)?;
    let points: Vec<TracePoint> =
        NOTIFY_TRACE_POINTS.iter().zip(words).filter_map(|(name, &w)| point(name, std::iter::once(w), t0, Some(w))).collect();
    let span_us = points.iter().find(|p| p.name == "end")?.max_us;
    Some(KernelTrace { kernel, op: "notify", phases: "send+recv", start_ns: t0, span_us, points })
}

/// Every low-latency launch in one kernel's words (`2 * LL_TRACE_CALLS` slots of `blocks` rows of
/// `LL_TRACE_WORDS`); launches that never reached their end are left out.
pub(crate) fn ll_launches(words: &[u64], blocks: usize, kernel: &'static str, op: &'static str) -> Vec<KernelTrace> {
    let mut out = Vec::new();
    for slot in 0..2 * LL_TRACE_CALLS {
        let base = slot * blocks * LL_TRACE_WORDS;
        let stamp = |k: usize, w: usize| words.get(base + k * LL_TRACE_WORDS + w).copied().unwrap_or(0);
        let Some(t0) = (0..blocks).map(|k| stamp(k, 0)).filter(|&v| v != 0).min() else { continue };
        let points: Vec<TracePoint> = LL_TRACE_POINTS
            .iter()
            .enumerate()
            .filter_map(|(w, name)| point(name, (0..blocks).map(|k| stamp(k, w)), t0, Some(stamp(0, w))))
            .collect();
        let Some(span_us) = points.iter().find(|p| p.name == "end").map(|p| p.max_us) else { continue };
        let sends = points.iter().any(|p| p.name == "send_ready");
        let phases = if slot % 2 == 1 {
            "recv"
        } else if sends && points.iter().any(|p| p.name == "recv_seen") {
            "send+recv"
        } else {
            "send"
        };
        out.push(KernelTrace { kernel, op, phases, start_ns: t0, span_us, points });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_words_become_points() {
        let t = notify_launch(&[1_000, 1_100, 1_500, 2_000, 3_000, 3_500, 9_000, 10_200], "k").unwrap();
        assert_eq!((t.op, t.start_ns, t.span_us), ("notify", 1_000, 9.2));
        let at: Vec<_> = t.points.iter().map(|p| (p.name, p.max_us)).collect();
        assert_eq!(at[0], ("start", 0.0));
        assert_eq!(at[5..], [("prefixed", 2.5), ("received", 8.0), ("end", 9.2)]);
        // A notify that never ended (a timeout) has no trace.
        assert!(notify_launch(&[1_000, 1_100, 1_500, 2_000, 3_000, 3_500, 0, 0], "k").is_none());
        assert!(notify_launch(&[0; 8], "k").is_none());
    }

    #[test]
    fn ht_words_become_role_points() {
        // 3 blocks of 2 warps, block 0 sends: [start, end, w0 start, w0 end, w1 start, w1 end] per block.
        let words = [
            1_000, 9_000, 2_000, 7_000, 2_500, 8_000, // sender block
            1_500, 9_500, 1_600, 6_000, 0, 0, // receiver block, warp 1 idle
            1_200, 9_200, 1_300, 5_000, 1_400, 5_500,
        ];
        let t = ht_launch(&words, 3, 2, 1, "moelink::intranode::dispatch", "dispatch").unwrap();
        assert_eq!((t.start_ns, t.span_us, t.phases), (1_000, 8.5, "send+recv"));
        let names: Vec<&str> = t.points.iter().map(|p| p.name).collect();
        assert_eq!(names, ["start", "send_start", "send_end", "recv_start", "recv_end", "end"]);
        let send_end = t.point("send_end").unwrap();
        assert_eq!((send_end.blocks, send_end.min_us, send_end.max_us, send_end.block0_us), (2, 6.0, 7.0, None));
        let recv_start = t.point("recv_start").unwrap();
        assert_eq!((recv_start.blocks, recv_start.min_us, recv_start.median_us, recv_start.max_us), (3, 0.3, 0.4, 0.6));
        assert_eq!(t.point("start").unwrap().block0_us, Some(0.0));
        assert!(ht_launch(&[0; 18], 3, 2, 1, "k", "dispatch").is_none(), "no block started");
    }

    #[test]
    fn hti_words_become_role_and_chunk_points() {
        use moelink_kernels::ht_internode::{trace_words, HTI_TRACE_BLOCK_WORDS, HTI_TRACE_CHUNKS, HTI_TRACE_CHUNK_WORDS};
        // 3 worker blocks (sender, forwarder, receiver) and one emulated NIC block, 2 nodes.
        let shape = HtiTraceShape { blocks: 4, workers: 3, send_blocks: 1, fwd_blocks: 1, nodes: 2 };
        let mut words = vec![0u64; trace_words(4, 2)];
        for k in 0..3 {
            words[k * HTI_TRACE_BLOCK_WORDS] = 1_000 + 100 * k as u64;
            words[k * HTI_TRACE_BLOCK_WORDS + 1] = 9_000 + 100 * k as u64;
            words[k * HTI_TRACE_BLOCK_WORDS + 2] = 1_100 + 100 * k as u64; // warp 0 start
            words[k * HTI_TRACE_BLOCK_WORDS + 3] = 8_000 + 100 * k as u64; // warp 0 end
        }
        let chunk = |area: usize, c: usize, p: usize| 4 * HTI_TRACE_BLOCK_WORDS + (area * HTI_TRACE_CHUNKS + c) * HTI_TRACE_CHUNK_WORDS + p;
        // Two sender chunks: staged after 1 and 3 us, put 2 and 4 us later.
        for (c, (taken, staged, put)) in [(2_000u64, 3_000u64, 5_000u64), (2_000, 5_000, 9_000)].into_iter().enumerate() {
            words[chunk(0, c, 0)] = taken;
            words[chunk(0, c, 1)] = staged;
            words[chunk(0, c, 2)] = put;
        }
        // One forwarder chunk of source node 1, copied 0.5 us after it was seen.
        words[chunk(2, 0, 0)] = 6_000;
        words[chunk(2, 0, 1)] = 6_500;
        words[chunk(2, 0, 2)] = 6_600;
        // No NIC statistics yet: no NIC points.
        let t = hti_launch(&words, shape, "moelink::internode::dispatch", "dispatch").unwrap();
        assert!(t.point("nic_busy_us").is_none() && t.point("nic_first_put").is_none());
        // The NIC block (block 3): put from 1.5 to 8.5 us, 5 us busy, 2 idle, 1.5 held by the rate cap.
        use moelink_kernels::transport::nic_stat;
        let nic = 3 * HTI_TRACE_BLOCK_WORDS;
        for (w, v) in [
            (nic_stat::START, 900),
            (nic_stat::END, 9_100),
            (nic_stat::FIRST_PUT, 2_500),
            (nic_stat::LAST_PUT, 9_500),
            (nic_stat::BUSY_NS, 5_000),
            (nic_stat::IDLE_NS, 2_000),
            (nic_stat::CAPPED_NS, 1_500),
        ] {
            words[nic + w] = v;
        }
        let t = hti_launch(&words, shape, "moelink::internode::dispatch", "dispatch").unwrap();
        assert_eq!((t.start_ns, t.span_us), (1_000, 8.2), "the NIC's block is not a worker: start and end are the workers'");
        let at = |n: &str| t.point(n).map(|p| (p.blocks, p.min_us, p.max_us));
        assert_eq!(at("send_start"), Some((1, 0.1, 0.1)));
        assert_eq!(at("fwd_end"), Some((1, 7.1, 7.1)));
        assert_eq!(at("recv_start"), Some((1, 0.3, 0.3)));
        assert_eq!(at("stage_us"), Some((2, 1.0, 3.0)));
        assert_eq!(at("put_us"), Some((2, 2.0, 4.0)));
        assert_eq!(at("chunk_put"), Some((2, 4.0, 8.0)));
        assert_eq!(at("fwd_copy_us"), Some((1, 0.5, 0.5)));
        assert_eq!(at("fwd_released"), Some((1, 5.6, 5.6)));
        assert_eq!(at("nic_first_put"), Some((1, 1.5, 1.5)));
        assert_eq!(at("nic_last_put"), Some((1, 8.5, 8.5)));
        assert_eq!(at("nic_busy_us"), Some((1, 5.0, 5.0)));
        assert_eq!(at("nic_idle_us"), Some((1, 2.0, 2.0)));
        assert_eq!(at("nic_capped_us"), Some((1, 1.5, 1.5)));
        assert!(t.point("reduce_start").is_none(), "a dispatch has receivers");
        let c = hti_launch(&words, shape, "moelink::internode::combine", "combine").unwrap();
        assert_eq!(c.point("reduce_us").map(|p| p.blocks), Some(2));
        assert!(hti_launch(&vec![0; trace_words(4, 2)], shape, "k", "dispatch").is_none(), "no block started");
    }

    #[test]
    fn ll_slots_become_launches_in_slot_order() {
        let blocks = 2;
        let mut words = vec![0u64; 2 * LL_TRACE_CALLS * blocks * LL_TRACE_WORDS];
        // Slot 2 (a fused send+recv call): both blocks pass every per-block point; slot 3: a receive-only launch.
        for k in 0..blocks {
            let row = (2 * blocks + k) * LL_TRACE_WORDS;
            for (w, v) in [(0, 100), (1, 200), (2, 300), (3, 400), (4, 500), (5, 600), (6, 700), (7, 800)] {
                words[row + w] = v + 10 * k as u64;
            }
            let row = (3 * blocks + k) * LL_TRACE_WORDS;
            words[row] = 5_000;
            words[row + 5] = 5_100;
            words[row + 7] = 5_300 + k as u64 * 100;
        }
        let t = ll_launches(&words, blocks, "moelink::low_latency::combine", "combine");
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].phases, t[0].start_ns, t[0].span_us), ("send+recv", 100, 0.71));
        assert_eq!(t[0].point("send_ready").unwrap().block0_us, Some(0.1));
        assert_eq!((t[1].phases, t[1].span_us), ("recv", 0.4));
        assert!(t[1].point("send_ready").is_none());
    }
}
