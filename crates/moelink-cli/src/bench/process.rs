//! `moelink bench --process`: every rank is a process of a torchrun launch; each measures its own share and
//! the outcomes meet at every rank (rank 0 reports them) through the process group, in the order of ranks,
//! as thread mode's `run_ranks` returns them.

use moelink::{Error, Group, Result};
use serde::{Deserialize, Serialize};

use super::RankOutcome;

/// What crosses the group of a [`RankOutcome`]: everything the records are made of. Kernel traces stay on
/// their rank (trace records need thread mode).
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

/// This rank's outcomes (or its error) to every rank; the result is indexed by rank.
pub fn gather(group: &dyn Group, mine: Result<Vec<RankOutcome>>) -> Result<Vec<Result<Vec<RankOutcome>>>> {
    let wire: std::result::Result<Vec<WireOutcome>, String> = mine
        .map(|outs| {
            outs.into_iter()
                .map(|o| WireOutcome {
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
                })
                .collect()
        })
        .map_err(|e| e.to_string());
    let bytes = serde_json::to_vec(&wire).map_err(|e| Error::Group { rank: group.rank(), reason: format!("encoding outcomes: {e}") })?;
    let all = group.all_gather(&bytes)?;
    all.into_iter()
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
        .collect()
}
