//! `cargo run --release` (in examples/candle-moe): the candle MoE layer over moelink's host backend with 4
//! thread ranks, compared with the dense layer; prints PASS or FAIL per rank.

use std::sync::Arc;

use candle_core::Device;
use candle_moe::{max_abs_diff, MoeConfig, MoeLayer, Rng};
use moelink::{group::run_ranks, BackendKind, Buffer, BufferOptions, Group};

fn main() -> std::process::ExitCode {
    let config = MoeConfig { hidden: 512, ffn: 256, num_experts: 16, topk: 4 };
    let (num_ranks, tokens) = (4, 64);
    let results = run_ranks(num_ranks, |group| {
        let rank = group.rank();
        let layer = MoeLayer::new(config, 1, &Device::Cpu).map_err(|e| moelink::Error::Unavailable(e.to_string()))?;
        let x = Rng::new(rank as u64)
            .tensor(tokens, config.hidden, 1.0, &Device::Cpu)
            .map_err(|e| moelink::Error::Unavailable(e.to_string()))?;
        let options = BufferOptions {
            backend: BackendKind::Host,
            num_nvl_bytes: Buffer::ht_bytes_needed(tokens, config.hidden, config.topk, num_ranks, false),
            ..Default::default()
        };
        let mut buf = Buffer::new(Arc::new(group), options)?;
        let mut run = || -> candle_moe::Result<(f32, f32)> {
            let ep = layer.forward_expert_parallel(&mut buf, &x)?;
            max_abs_diff(&ep, &layer.forward_dense(&x)?)
        };
        run().map_err(|e| moelink::Error::Unavailable(e.to_string()))
    });
    let mut ok = true;
    for (rank, r) in results.iter().enumerate() {
        match r {
            Ok((diff, scale)) if *diff <= 0.02 * scale => {
                println!("[rank {rank}] PASS: max |ep - dense| = {diff:.4} (max |dense| {scale:.3})")
            }
            Ok((diff, scale)) => {
                ok = false;
                println!("[rank {rank}] FAIL: max |ep - dense| = {diff:.4} (max |dense| {scale:.3})")
            }
            Err(e) => {
                ok = false;
                println!("[rank {rank}] FAIL: {e}")
            }
        }
    }
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
