//! The expert-parallel layer (dispatch → candle experts → combine through moelink, ranks as threads) equals
//! the same layer computed densely on each rank: on the host backend at 2 and 4 ranks, and on the CUDA
//! backend (ignored without a GPU; `--include-ignored` on a GPU machine, ranks sharing its GPUs).

use std::sync::Arc;

use candle_core::{DType, Device};
use candle_moe::{max_abs_diff, MoeConfig, MoeLayer, Rng};
use moelink::{group::run_ranks, BackendKind, Buffer, BufferOptions};

const CONFIG: MoeConfig = MoeConfig { hidden: 128, ffn: 64, num_experts: 8, topk: 2 };
const TOKENS: usize = 24;

fn check(num_ranks: usize, backend: BackendKind) {
    let results = run_ranks(num_ranks, |group| {
        let rank = moelink::Group::rank(&group);
        let device = Device::Cpu;
        let layer = MoeLayer::new(CONFIG, 7, &device).expect("layer");
        // Each rank has its own tokens; rank 1 has fewer, to cover uneven ranks.
        let tokens = if rank == 1 { TOKENS / 2 } else { TOKENS };
        let x = Rng::new(100 + rank as u64).tensor(tokens, CONFIG.hidden, 1.0, &device).expect("x");
        let options = BufferOptions {
            backend,
            num_nvl_bytes: Buffer::ht_bytes_needed(TOKENS, CONFIG.hidden, CONFIG.topk, num_ranks, false),
            ..Default::default()
        };
        let mut buf = Buffer::new(Arc::new(group), options)?;
        let ep = match backend {
            BackendKind::Cuda => layer.forward_expert_parallel_on_gpu(&mut buf, &x),
            _ => layer.forward_expert_parallel(&mut buf, &x),
        }
        .map_err(|e| moelink::Error::Unavailable(e.to_string()))?;
        let dense = layer.forward_dense(&x).map_err(|e| moelink::Error::Unavailable(e.to_string()))?;
        let shape = (ep.dims().to_vec(), ep.dtype());
        let (diff, scale) = max_abs_diff(&ep, &dense).map_err(|e| moelink::Error::Unavailable(e.to_string()))?;
        Ok((shape, diff, scale, tokens))
    });
    for (rank, r) in results.into_iter().enumerate() {
        let ((dims, dtype), diff, scale, tokens) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!((dims, dtype), (vec![tokens, CONFIG.hidden], DType::BF16), "rank {rank}");
        assert!(scale > 0.1, "rank {rank}: the layer's output is not trivially zero ({scale})");
        // bf16 roundings: each rank's partial sum and the combined sum (2^-8 relative each).
        assert!(diff <= 0.02 * scale, "rank {rank}: expert-parallel differs from dense by {diff} (scale {scale})");
    }
}

#[test]
fn expert_parallel_equals_dense_at_2_ranks() {
    check(2, BackendKind::Host);
}

#[test]
fn expert_parallel_equals_dense_at_4_ranks() {
    check(4, BackendKind::Host);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn expert_parallel_on_the_gpu_equals_dense() {
    // MOELINK_TEST_RANKS ranks (default 2), sharing the GPUs when there are fewer.
    let ranks = std::env::var("MOELINK_TEST_RANKS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    check(ranks, BackendKind::Cuda);
}
