//! The buffer-capacity and mode rules are the same on every backend, with the same errors: low-latency calls
//! need `low_latency_mode` and enough `num_rdma_bytes` (the zero-copy combine buffer too), high-throughput
//! calls need `num_nvl_bytes` whose receive slabs hold the rank with the most tokens, for the dispatch rows
//! and for the combine rows. None of these errors poisons the buffer. Each case runs on the host backend
//! always and on CUDA with `--include-ignored` (and `MOELINK_TEST_RANKS` of at least 2, or the CUDA
//! cases skip, saying so).

use moelink::{
    bf16, Buffer, BufferOptions, CombineArgs, DispatchArgs, Error, Fp8E4M3, LlDispatchArgs, LlQuant, Payload, Result, Routing, Tensor,
};
use moelink_kernels::ht::{bytes_needed, combine_row_bytes, dispatch_row_bytes};
use moelink_kernels::ll::LlLayout;
use moelink_testkit::backend_tests;
use moelink_testkit::harness::{ranks, test_options, with_buffers};

const R: usize = 2;
const H: usize = 256;
const K: usize = 2;
const E: usize = 4;

/// `tokens` tokens of this rank, each to experts (t, t + 1) mod E (both ranks receive some).
fn topk(tokens: usize) -> Vec<i64> {
    (0..tokens).flat_map(|t| [(t % E) as i64, ((t + 1) % E) as i64]).collect()
}

fn ht_dispatch(buf: &mut Buffer, tokens: usize, fp8: bool) -> Result<moelink::DispatchResult> {
    let idx = buf.upload(&Tensor::from_vec(topk(tokens), &[tokens, K])?)?;
    let x = buf.upload(&Tensor::from_vec(vec![bf16::from_f32(1.0); tokens * H], &[tokens, H])?)?;
    let x8 = buf.upload(&Tensor::from_vec(vec![Fp8E4M3(0x38); tokens * H], &[tokens, H])?)?;
    let sc = buf.upload(&Tensor::from_vec(vec![1f32; tokens * H / 128], &[tokens, H / 128])?)?;
    let layout = buf.get_dispatch_layout(idx.view(), E)?;
    let payload = if fp8 { Payload::Fp8 { x: x8.view(), scales: sc.view() } } else { Payload::Bf16(x.view()) };
    buf.dispatch(&DispatchArgs {
        x: payload,
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    })
}

fn ll_args<'a>(x: &'a Tensor, idx: &'a Tensor, t_max: usize) -> LlDispatchArgs<'a> {
    LlDispatchArgs {
        x: x.view(),
        topk_idx: idx.view(),
        topk_weights: None,
        num_max_dispatch_tokens_per_rank: t_max,
        num_experts: E,
        quant: LlQuant::Bf16,
        return_recv_hook: false,
    }
}

fn ll_dispatch(buf: &mut Buffer, t_max: usize) -> Result<moelink::LlDispatchResult> {
    let x = buf.upload(&Tensor::from_vec(vec![bf16::from_f32(1.0); t_max * H], &[t_max, H])?)?;
    let idx = buf.upload(&Tensor::from_vec(topk(t_max), &[t_max, K])?)?;
    buf.low_latency_dispatch(&ll_args(&x, &idx, t_max))
}

/// `BufferTooSmall` with the given `what`, `needed` and `available`, and a hint naming the size function.
fn assert_too_small(e: &Error, what: &str, needed: usize, available: usize, hint: &str) {
    match e {
        Error::BufferTooSmall { what: w, needed: n, available: a, hint: h, .. } => {
            assert_eq!((*w, *n, *a), (what, needed, available), "{e}");
            assert!(h.contains(hint), "{e}");
        }
        other => panic!("expected BufferTooSmall for {what}, got {other}"),
    }
}

backend_tests! {
    fn low_latency_calls_need_low_latency_mode(kind: BackendKind) {
        if ranks(kind, R).is_none() {
            return;
        }
        let opts = BufferOptions { low_latency_mode: false, ..test_options() };
        let out = with_buffers(kind, R, opts, |buf| {
            let e = ll_dispatch(buf, 8).err();
            let x = buf.upload(&Tensor::from_vec(vec![bf16::ZERO; 8 * H], &[8, H])?)?;
            let clean = buf.clean_low_latency_buffer(8, H, E).err();
            Ok((e, clean, buf.poisoned().is_none(), x.shape()[0]))
        });
        for (e, clean, usable, _) in out {
            for e in [e, clean] {
                let e = e.expect("refused without low_latency_mode");
                assert_eq!(e.argument(), Some("low_latency_mode"), "{e}");
                assert!(e.to_string().contains("ll_bytes_needed"), "{e}");
            }
            assert!(usable);
        }
    }

    fn low_latency_calls_need_num_rdma_bytes(kind: BackendKind) {
        if ranks(kind, R).is_none() {
            return;
        }
        let t_max = 16;
        let layout = LlLayout::new(R, t_max, H, K, E).unwrap();
        for (num_rdma_bytes, fits) in [(0, false), (layout.bytes_without_staging - 1, false), (layout.bytes_without_staging, true)] {
            let opts = BufferOptions { num_rdma_bytes, ..test_options() };
            let out = with_buffers(kind, R, opts, |buf| Ok((ll_dispatch(buf, t_max).err(), buf.poisoned().is_none())));
            for (e, usable) in out {
                match e {
                    None => assert!(fits, "{num_rdma_bytes} bytes must be refused"),
                    Some(e) => {
                        assert!(!fits, "{num_rdma_bytes} bytes must fit: {e}");
                        assert_too_small(&e, "low-latency region (num_rdma_bytes)", layout.bytes_without_staging, num_rdma_bytes, "ll_bytes_needed(16, 256, 2, 4)");
                        // The two byte counts of the message are told apart: the call's own need, and the size that
                        // holds every low-latency call of the shape.
                        let hint = Buffer::ll_bytes_needed(t_max, H, R, E);
                        let text = e.to_string();
                        assert!(text.contains(&format!("= {hint}, which is more than this call's {}", layout.bytes_without_staging)), "{text}");
                    }
                }
                assert!(usable);
            }
        }
    }

    fn zero_copy_combine_needs_its_buffer_in_num_rdma_bytes(kind: BackendKind) {
        if ranks(kind, R).is_none() {
            return;
        }
        let t_max = 16;
        let layout = LlLayout::new(R, t_max, H, K, E).unwrap();
        let opts = BufferOptions { num_rdma_bytes: layout.bytes_without_staging, ..test_options() };
        let out = with_buffers(kind, R, opts, |buf| {
            let d = ll_dispatch(buf, t_max)?;
            let e = buf.get_next_low_latency_combine_buffer(&d.handle).err();
            Ok((e, buf.poisoned().is_none()))
        });
        for (e, usable) in out {
            let e = e.expect("no room for the zero-copy buffer");
            assert_too_small(&e, "low-latency region with the zero-copy combine buffer (num_rdma_bytes)", layout.bytes, layout.bytes_without_staging, "ll_bytes_needed");
            assert!(usable);
        }
        // With Buffer::ll_bytes_needed the same calls fit.
        let opts = BufferOptions { num_rdma_bytes: Buffer::ll_bytes_needed(t_max, H, R, E), ..test_options() };
        with_buffers(kind, R, opts, |buf| {
            let d = ll_dispatch(buf, t_max)?;
            buf.get_next_low_latency_combine_buffer(&d.handle).map(|_| ())
        });
    }

    fn ht_dispatch_needs_num_nvl_bytes_for_the_rank_with_most_tokens(kind: BackendKind) {
        if ranks(kind, R).is_none() {
            return;
        }
        // Rank 1 has more tokens than the buffer holds per source; rank 0's would fit: both refuse the call,
        // because the rule is decided on T_max, which every rank learns in the count exchange.
        let (small, large) = (8, 2048);
        let row = dispatch_row_bytes(H, false, 0);
        for num_nvl_bytes in [0, bytes_needed(small, R, &[row])] {
            let opts = BufferOptions { num_nvl_bytes, ..test_options() };
            let out = with_buffers(kind, R, opts, |buf| {
                let tokens = if buf.rank() == 1 { large } else { small };
                Ok((ht_dispatch(buf, tokens, false).err(), buf.poisoned().is_none()))
            });
            for (e, usable) in out {
                let e = e.expect("refused on every rank");
                assert_too_small(&e, "HT dispatch receive slab", bytes_needed(large, R, &[row]), num_nvl_bytes, "ht_bytes_needed");
                assert!(e.to_string().contains(&format!("{large} tokens")), "{e}");
                assert!(usable);
            }
        }
        // Buffer::ht_bytes_needed for the largest rank is enough.
        let opts = BufferOptions { num_nvl_bytes: Buffer::ht_bytes_needed(large, H, K, R, false), ..test_options() };
        with_buffers(kind, R, opts, |buf| ht_dispatch(buf, if buf.rank() == 1 { large } else { small }, false).map(|_| ()));
    }

    fn ht_combine_needs_num_nvl_bytes_for_its_rows(kind: BackendKind) {
        if ranks(kind, R).is_none() {
            return;
        }
        // Room for the FP8 dispatch rows, not for the (larger) BF16 combine rows.
        let tokens = 1024;
        let num_nvl_bytes = bytes_needed(tokens, R, &[dispatch_row_bytes(H, true, 0)]);
        let combine_row = combine_row_bytes(H, 0);
        assert!(bytes_needed(tokens, R, &[combine_row]) > num_nvl_bytes, "the case needs larger combine rows");
        let opts = BufferOptions { num_nvl_bytes, ..test_options() };
        let out = with_buffers(kind, R, opts, |buf| {
            let d = ht_dispatch(buf, tokens, true)?;
            let n = d.recv_x.shape()[0];
            let y = buf.upload(&Tensor::from_vec(vec![bf16::from_f32(1.0); n * H], &[n, H])?)?;
            let e = buf
                .combine(&CombineArgs { x: y.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config: None })
                .err();
            Ok((e, buf.poisoned().is_none()))
        });
        for (e, usable) in out {
            let e = e.expect("combine rows do not fit");
            assert_too_small(&e, "HT combine receive slab", bytes_needed(tokens, R, &[combine_row]), num_nvl_bytes, "ht_bytes_needed");
            assert!(usable);
        }
    }
}
