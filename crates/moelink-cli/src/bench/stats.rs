//! The statistics over ranks and repetitions: the slowest rank per repetition, medians, trace points.

pub(super) fn median(mut v: Vec<f64>) -> f64 {
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

/// Per repetition, the slowest rank's time.
pub(super) fn slowest_per_rep(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let reps = per_rank.iter().map(|v| v.len()).min().unwrap_or(0);
    (0..reps).map(|i| per_rank.iter().map(|v| v[i]).fold(0.0, f64::max)).collect()
}

/// Median over repetitions of the slowest rank.
pub(super) fn slowest_rank_median(per_rank: &[Vec<f64>]) -> f64 {
    median(slowest_per_rep(per_rank))
}

/// Kernel-trace points over ranks and repetitions: per point, the median over repetitions of the blocks'
/// median stamp, last stamp and block 0's stamp (µs after the kernel's first block started), the largest
/// over ranks.
pub(super) fn trace_points_json<'a>(per_rank: impl Iterator<Item = &'a [moelink::trace::KernelTrace]>) -> serde_json::Value {
    let mut points: Vec<(&'static str, f64, f64, f64)> = Vec::new();
    for traces in per_rank {
        let names: Vec<&'static str> = traces.first().map(|t| t.points.iter().map(|p| p.name).collect()).unwrap_or_default();
        for name in names {
            let of = |f: fn(&moelink::trace::TracePoint) -> f64| {
                median(traces.iter().filter_map(|t| t.points.iter().find(|p| p.name == name)).map(f).collect())
            };
            let (med, last, b0) = (of(|p| p.median_us), of(|p| p.max_us), of(|p| p.block0_us.unwrap_or(f64::NAN)));
            match points.iter_mut().find(|p| p.0 == name) {
                Some(p) => {
                    p.1 = p.1.max(med);
                    p.2 = p.2.max(last);
                    p.3 = p.3.max(b0);
                }
                None => points.push((name, med, last, b0)),
            }
        }
    }
    serde_json::Value::Array(
        points
            .into_iter()
            .map(|(n, m, l, b0)| serde_json::json!({"point": n, "median_us": m, "last_us": l, "block0_us": b0.is_finite().then_some(b0)}))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slowest_rank_median_takes_the_max_per_rep_then_the_median() {
        let per_rank = vec![vec![1.0, 5.0, 3.0], vec![2.0, 1.0, 9.0]];
        assert_eq!(slowest_per_rep(&per_rank), vec![2.0, 5.0, 9.0]);
        assert_eq!(slowest_rank_median(&per_rank), 5.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
