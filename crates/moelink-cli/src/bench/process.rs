//! `moelink bench --process`: every rank is a process of a torchrun launch; each measures its own share and
//! the outcomes meet at every rank (rank 0 reports them) through the process group, in the order of ranks,
//! as thread mode's `run_ranks` returns them.

use moelink::{Error, Group, Result};
use serde::{Deserialize, Serialize};

use super::RankOutcome;

/// What crosses the group of a [`RankOutcome`]: everything the records are made of but the kernel traces,
/// which stay on their rank: each rank gets its own back from [`gather`], and rank 0 reports its own, as
/// thread mode reports rank 0's.
#[derive(Serialize, Deserialize)]
struct WireOutcome {
    times_us: Vec<f64>,
    timer: Option<String>,
    failures: Vec<String>,
    unavailable: Option<String>,
    error: Option<String>,
    num_sms: Option<usize>,
    matches_host: Option<bool>,
    send_us: Vec<f64>,
    recv_us: Vec<f64>,
    cached_us: Vec<f64>,
}

/// A timer name as the records spell it (the set `RankOutcome::timer` draws from).
fn timer_name(name: &str) -> Option<&'static str> {
    ["cuda-events", "cuda-graph-events", "wall"].into_iter().find(|t| *t == name)
}

/// A rank's kernel traces of one outcome, kept out of the wire: (`traces`, `loop_times`, `loop_traces`).
type KeptTraces = ([Vec<moelink::trace::KernelTrace>; 3], [Vec<f64>; 3], [Vec<moelink::trace::KernelTrace>; 2]);

/// This rank's outcomes (or its error) to every rank; the result is indexed by rank. This rank's own
/// outcomes come back with their kernel traces.
pub fn gather(group: &dyn Group, mine: Result<Vec<RankOutcome>>) -> Result<Vec<Result<Vec<RankOutcome>>>> {
    let mut kept: Vec<KeptTraces> = Vec::new();
    let wire: std::result::Result<Vec<WireOutcome>, String> = mine
        .map(|outs| {
            outs.into_iter()
                .map(|mut o| {
                    kept.push((std::mem::take(&mut o.traces), std::mem::take(&mut o.loop_times), std::mem::take(&mut o.loop_traces)));
                    WireOutcome {
                        times_us: o.times_us,
                        timer: o.timer.map(String::from),
                        failures: o.failures,
                        unavailable: o.unavailable,
                        error: o.error,
                        num_sms: o.num_sms,
                        matches_host: o.matches_host,
                        send_us: o.send_us,
                        recv_us: o.recv_us,
                        cached_us: o.cached_us,
                    }
                })
                .collect()
        })
        .map_err(|e| e.to_string());
    let bytes = serde_json::to_vec(&wire).map_err(|e| Error::Group { rank: group.rank(), reason: format!("encoding outcomes: {e}") })?;
    let all = group.all_gather(&bytes)?;
    let mut outcomes: Vec<Result<Vec<RankOutcome>>> = all
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            let w: std::result::Result<Vec<WireOutcome>, String> =
                serde_json::from_slice(&b).map_err(|e| Error::Group { rank: r, reason: format!("decoding rank {r}'s outcomes: {e}") })?;
            Ok(match w {
                Ok(outs) => Ok(outs
                    .into_iter()
                    .map(|w| RankOutcome {
                        times_us: w.times_us,
                        timer: w.timer.as_deref().and_then(timer_name),
                        failures: w.failures,
                        unavailable: w.unavailable,
                        error: w.error,
                        num_sms: w.num_sms,
                        matches_host: w.matches_host,
                        send_us: w.send_us,
                        recv_us: w.recv_us,
                        cached_us: w.cached_us,
                        ..RankOutcome::default()
                    })
                    .collect()),
                Err(reason) => Err(Error::Group { rank: r, reason }),
            })
        })
        .collect::<Result<_>>()?;
    if let Some(Ok(own)) = outcomes.get_mut(group.rank()) {
        for (o, (traces, loop_times, loop_traces)) in own.iter_mut().zip(kept) {
            (o.traces, o.loop_times, o.loop_traces) = (traces, loop_times, loop_traces);
        }
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use moelink::trace::KernelTrace;

    fn traced(rank: usize) -> RankOutcome {
        let trace = KernelTrace {
            kernel: "k",
            op: "combine",
            phases: "send+recv",
            start_ns: rank as u64,
            span_us: 1.0 + rank as f64,
            points: Vec::new(),
        };
        RankOutcome {
            times_us: vec![10.0 + rank as f64],
            timer: Some("cuda-events"),
            traces: [vec![trace.clone()], Vec::new(), Vec::new()],
            loop_times: [vec![2.0], vec![3.0], vec![4.0]],
            loop_traces: [Vec::new(), vec![trace]],
            ..RankOutcome::default()
        }
    }

    #[test]
    fn each_rank_keeps_its_own_traces_and_gets_everyones_times() {
        let gathered: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = moelink::ThreadGroup::new(2)
                .into_iter()
                .map(|g| s.spawn(move || gather(&g, Ok(vec![traced(g.rank())])).unwrap()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (me, all) in gathered.iter().enumerate() {
            for (r, outs) in all.iter().enumerate() {
                let o = &outs.as_ref().unwrap()[0];
                assert_eq!((o.times_us.clone(), o.timer), (vec![10.0 + r as f64], Some("cuda-events")));
                if r == me {
                    assert_eq!(o.traces[0][0].span_us, 1.0 + me as f64);
                    assert_eq!(o.loop_times, [vec![2.0], vec![3.0], vec![4.0]]);
                    assert_eq!(o.loop_traces[1][0].start_ns, me as u64);
                } else {
                    // Traces do not cross the group.
                    assert!(o.traces.iter().all(Vec::is_empty) && o.loop_traces.iter().all(Vec::is_empty));
                    assert!(o.loop_times.iter().all(Vec::is_empty));
                }
            }
        }
    }
}
