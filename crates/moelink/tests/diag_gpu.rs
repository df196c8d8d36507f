//! GPU diagnostics in thread mode over every visible GPU (one rank per GPU). Ignored unless included
//! (`--include-ignored`, on a machine with a CUDA driver and GPU); NVRTC must be loadable.
//!
//! ```text
//! LD_LIBRARY_PATH=/usr/local/cuda/lib64 cargo test -p moelink --test diag_gpu -- --include-ignored --test-threads 1 --nocapture
//! ```

use moelink::diag::{barrier_latency_us, deadline_check, jit_timings, nvlink_bandwidth, symmetric_memory_check, CopyMethod, CopyPattern};
use moelink::group::run_ranks;
use moelink::Group;

/// Number of ranks (= visible GPUs, at most 8), or `None` after saying why the test skips (fewer than `min`
/// GPUs). Fails without a CUDA driver: the test was included to run on a GPU.
fn ranks(_test: &str, min: usize) -> Option<usize> {
    let n = moelink_cuda::Device::count().expect("a CUDA driver: this test runs on a GPU machine").min(moelink_kernels::abi::MAX_RANKS);
    if n < min {
        moelink_testkit::harness::skip(&format!("needs {min} GPUs, {n} visible"));
        return None;
    }
    Some(n)
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn symmetric_pattern_over_all_gpus() {
    let Some(n) = ranks("symmetric_pattern_over_all_gpus", 1) else { return };
    let out = run_ranks(n, |g| symmetric_memory_check(&g, g.rank(), 4 << 20));
    for (rank, r) in out.into_iter().enumerate() {
        assert_eq!(r.unwrap_or_else(|e| panic!("rank {rank}: {e}")), 0, "rank {rank} received mismatching words");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn barrier_over_all_gpus() {
    let Some(n) = ranks("barrier_over_all_gpus", 1) else { return };
    let out = run_ranks(n, |g| barrier_latency_us(&g, g.rank(), 2000));
    let values: Vec<f64> = out.into_iter().enumerate().map(|(r, v)| v.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect();
    eprintln!("{n}-GPU barrier: {:.2} us (median of the slowest rank)", values[0]);
    assert!(values.iter().all(|&v| v == values[0]), "every rank reports the same slowest-rank median: {values:?}");
    assert!(values[0] > 0.0 && values[0] < 100.0, "{} us per barrier", values[0]);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn deadline_names_the_missing_rank_and_the_process_survives() {
    let Some(n) = ranks("deadline_names_the_missing_rank_and_the_process_survives", 2) else { return };
    let skip = n - 1;
    let timeout_ms = 500;
    let out = run_ranks(n, |g| deadline_check(&g, g.rank(), skip, timeout_ms));
    for (rank, r) in out.into_iter().enumerate() {
        let o = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        eprintln!("{o:?}");
        assert_eq!(o.rank, rank);
        if rank == skip {
            assert!(o.error.is_none(), "the skipping rank saw {:?}", o.error);
            continue;
        }
        let err = o.error.as_deref().unwrap_or_else(|| panic!("rank {rank} did not time out"));
        assert!(err.contains("timeout"), "{err}");
        assert_eq!(o.peer, Some(skip), "rank {rank} must name rank {skip}: {err}");
        assert!(o.elapsed_ms >= timeout_ms as f64 * 0.9, "gave up after {} ms, before the deadline", o.elapsed_ms);
        assert!(o.elapsed_ms < timeout_ms as f64 + 3000.0, "took {} ms", o.elapsed_ms);
        assert!(o.refused_afterwards, "rank {rank} accepted work after the timeout");
    }
    // The process and the GPUs are still usable: a fresh collective succeeds.
    let again = run_ranks(n, |g| symmetric_memory_check(&g, g.rank(), 1 << 20));
    assert!(again.iter().all(|r| matches!(r, Ok(0))), "{again:?}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn nvlink_bandwidth_is_measured_and_verified() {
    let Some(n) = ranks("nvlink_bandwidth_is_measured_and_verified", 2) else { return };
    let t0 = std::time::Instant::now();
    let out = run_ranks(n, |g| {
        nvlink_bandwidth(
            &g,
            g.rank(),
            &[8, 32],
            &[CopyMethod::SmStores, CopyMethod::Tma],
            &[CopyPattern::Pair, CopyPattern::AllToAll, CopyPattern::Local],
        )
    });
    let results: Vec<_> = out.into_iter().enumerate().map(|(r, v)| v.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect();
    for p in &results[0] {
        eprintln!(
            "{:?} {:?} {:>3} SMs: {:>7.1} GB/s ({} B in {:.1} us) verified={}",
            p.pattern, p.method, p.num_sms, p.gbps, p.bytes_per_gpu, p.time_us, p.verified
        );
        assert!(p.verified, "{p:?}");
        // A local copy is bound by HBM (4.8 TB/s on H200), not NVLink.
        let ceiling = if p.pattern == CopyPattern::Local { 5000.0 } else { 2000.0 };
        assert!(p.gbps > 10.0 && p.gbps < ceiling, "{p:?}");
    }
    assert_eq!(results[0].len(), 12);
    for r in &results[1..] {
        assert_eq!(r.iter().map(|p| p.time_us).collect::<Vec<_>>(), results[0].iter().map(|p| p.time_us).collect::<Vec<_>>());
    }
    eprintln!("sweep took {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn jit_timings_cold_then_cached() {
    let Some(_) = ranks("jit_timings_cold_then_cached", 1) else { return };
    let timings = jit_timings(0).unwrap();
    // Every variant but the nvshmem transport's (those compile only against an NVSHMEM installation).
    use moelink_kernels::transport::Transport;
    let variants = moelink_kernels::all_variants().into_iter().filter(|s| Transport::of_spec(s) != Some(Transport::Nvshmem)).count();
    assert_eq!(timings.len(), variants);
    for t in &timings {
        eprintln!("{}: cold {:.3} s, cached {:.4} s, {} B", t.kernel, t.cold_s, t.cached_s, t.cubin_bytes);
        assert!(t.cubin_bytes > 0);
        assert!(t.cached_s < t.cold_s, "{t:?}");
    }
}

/// `Group` is object safe and what the diagnostics take: a compile-time check that thread groups fit.
#[allow(dead_code)]
fn takes_dyn_group(g: &dyn Group) -> usize {
    g.size()
}
