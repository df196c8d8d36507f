//! Kernel timing traces ([`crate::KernelTracing`], [`crate::Buffer::kernel_traces`]): the `%globaltimer`
//! stamps the high-throughput and low-latency kernels store when tracing is on, summarised into one
//! [`KernelTrace`] per launch. The library returns them; printing is the caller's (`moelink bench`).
//!
//! Both families stamp raw u64 nanoseconds of the GPU's global timer (0: not reached); the layouts differ
//! and are decoded here:
//! - high-throughput (`ht.cuh`, `HT_TRACE_*`): per block its start and end, then per warp the start and the
//!   end of its work (senders: after the hand-back wait until their last flag; receivers: after this rank's
//!   own rows until their last row). The first `send_blocks` blocks are senders.
//! - low-latency (`ll.cuh`, `LL_TRACE_*`, `moelink_kernels::ll::LL_TRACE_POINTS`): per launch slot
//!   (`(epoch % LL_TRACE_CALLS) * 2 + receive-only`) and block, one word per protocol point.

use moelink_kernels::ll::{LL_TRACE_CALLS, LL_TRACE_POINTS, LL_TRACE_WORDS};

/// When the stamps of one traced point fell, in µs after the launch's first block started.
#[derive(Clone, Debug, PartialEq)]
pub struct TracePoint {
    /// The point. Low-latency: `start`, `send_ready`, `send_issued`, `send_stored`, `send_done`,
    /// `recv_seen`, `recv_stored`, `end` (per block); block 0 of a dispatch send: `index_checked`; a
    /// dispatch receive: `recv_indexed`, the counts scanned into bases. High-throughput: `start` and `end`
    /// (per block), `send_start`, `send_end`, `recv_start`, `recv_end` (per warp of the role).
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
    let mut v: Vec<f64> = stamps.filter(|&s| s >= t0 && s != 0).map(us).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(TracePoint {
        name,
        blocks: v.len(),
        min_us: v[0],
        median_us: v[v.len() / 2],
        max_us: v[v.len() - 1],
        block0_us: block0.filter(|&s| s >= t0 && s != 0).map(us),
    })
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
