//! Every malformed high-throughput input is rejected before any work, with an error naming the argument
//! (and the rank). Low-latency validation is covered in `ll.rs`.

use std::sync::Arc;

use moelink::{
    bf16, group::run_ranks, BackendKind, Buffer, BufferOptions, ChannelOutputs, CombineArgs, Config, DType, DispatchArgs, DispatchLayout,
    Error, Fp8E4M3, MemRef, Payload, Place, Routing, Tensor, TensorRef, Topology,
};

/// A host buffer with room for every call of these tests (the capacity rules apply on the host too).
fn host_options() -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Host,
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes: 1 << 30,
        low_latency_mode: true,
        ..Default::default()
    }
}

fn host_buffer(g: moelink::ThreadGroup) -> moelink::Result<Buffer> {
    Buffer::new(Arc::new(g), host_options())
}

/// Runs `f` on a single host rank and returns its error.
fn err_of(f: impl Fn(&mut Buffer) -> moelink::Result<()> + Sync) -> Error {
    let mut out = run_ranks(1, |g| {
        let mut b = host_buffer(g)?;
        f(&mut b)
    });
    out.pop().expect("one rank").expect_err("the call must be rejected")
}

fn assert_arg(e: Error, arg: &str) {
    assert_eq!(e.argument(), Some(arg), "wrong argument named: {e}");
    let msg = e.to_string();
    assert!(msg.contains(arg) && msg.contains("rank 0"), "message must name the argument and the rank: {msg}");
}

fn x_bf16(t: usize, h: usize) -> Tensor {
    Tensor::from_vec(vec![bf16::ONE; t * h], &[t, h]).unwrap()
}
fn topk(t: usize, v: Vec<i64>) -> Tensor {
    let k = v.len() / t.max(1);
    Tensor::from_vec(v, &[t, k]).unwrap()
}

/// A fresh dispatch of 2 tokens, hidden 128, top-2 of 4 experts, with one argument swapped by `edit`.
fn dispatch_with(edit: impl Fn(&mut DispatchArgs<'_>, &mut Buffer) -> moelink::Result<()> + Sync) -> Error {
    err_of(|b| {
        let x = x_bf16(2, 128);
        let idx = topk(2, vec![0, 1, 2, 3]);
        let w = Tensor::from_vec(vec![0.5f32; 4], &[2, 2])?;
        let layout = b.get_dispatch_layout(idx.view(), 4)?;
        let mut a = DispatchArgs {
            x: Payload::Bf16(x.view()),
            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
            expert_alignment: 1,
            num_worst_tokens: 0,
            config: None,
        };
        edit(&mut a, b)?;
        b.dispatch(&a).map(|_| ())
    })
}

#[test]
fn layout_rejects_out_of_range_and_duplicate_experts() {
    assert_arg(err_of(|b| b.get_dispatch_layout(topk(2, vec![0, 4]).view(), 4).map(|_| ())), "topk_idx");
    assert_arg(err_of(|b| b.get_dispatch_layout(topk(2, vec![-2, 1]).view(), 4).map(|_| ())), "topk_idx");
    assert_arg(err_of(|b| b.get_dispatch_layout(topk(1, vec![3, 3]).view(), 4).map(|_| ())), "topk_idx");
    // -1 may repeat.
    let ok = run_ranks(1, |g| host_buffer(g)?.get_dispatch_layout(topk(1, vec![-1, -1]).view(), 4).map(|_| ()));
    assert!(ok[0].is_ok());
}

#[test]
fn layout_rejects_wrong_dtype_and_rank() {
    let f32_idx = Tensor::from_vec(vec![0f32; 4], &[2, 2]).unwrap();
    assert_arg(err_of(|b| b.get_dispatch_layout(f32_idx.view(), 4).map(|_| ())), "topk_idx");
    let one_d = Tensor::from_vec(vec![0i64; 4], &[4]).unwrap();
    assert_arg(err_of(|b| b.get_dispatch_layout(one_d.view(), 4).map(|_| ())), "topk_idx");
}

#[test]
fn experts_must_divide_across_ranks() {
    let out = run_ranks(2, |g| host_buffer(g)?.get_dispatch_layout(topk(1, vec![0, 1]).view(), 3).map(|_| ()));
    for r in out {
        assert_arg_rank_any(r.expect_err("3 experts over 2 ranks"), "num_experts");
    }
    assert_arg(err_of(|b| b.get_dispatch_layout(topk(1, vec![0]).view(), 0).map(|_| ())), "num_experts");
}

fn assert_arg_rank_any(e: Error, arg: &str) {
    assert_eq!(e.argument(), Some(arg), "wrong argument named: {e}");
}

#[test]
fn dispatch_rejects_bad_x() {
    // wrong dtype
    let xf = Tensor::from_vec(vec![0f32; 256], &[2, 128]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Bf16(unsafe_leak(&xf));
            Ok(())
        }),
        "x",
    );
    // row bytes not a multiple of 16 (hidden 4 x 2 bytes)
    let small = x_bf16(2, 4);
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Bf16(unsafe_leak(&small));
            Ok(())
        }),
        "x",
    );
    // token count differs from the layout's is_token_in_rank
    let three = x_bf16(3, 128);
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Bf16(unsafe_leak(&three));
            Ok(())
        }),
        "is_token_in_rank",
    );
    // non-contiguous x
    let big = x_bf16(2, 256);
    let strided = big.view().with_layout(&[2, 128], &[256, 1]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Bf16(unsafe_leak_ref(strided));
            Ok(())
        }),
        "x",
    );
    // a device tensor given to a host buffer
    // SAFETY: never read: the host buffer refuses a device view before touching it.
    let dev_mem = unsafe { MemRef::from_raw(0x1000, 2 * 128 * 2, Place::Device(0)) };
    let dev = TensorRef::from_memory(dev_mem, DType::BF16, &[2, 128], &[128, 1]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Bf16(dev);
            Ok(())
        }),
        "x",
    );
}

#[test]
fn dispatch_rejects_bad_fp8_payload() {
    let x8 = Tensor::from_vec(vec![Fp8E4M3(0); 2 * 128], &[2, 128]).unwrap();
    let bad_scales = Tensor::from_vec(vec![1f32; 4], &[2, 2]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Fp8 { x: unsafe_leak(&x8), scales: unsafe_leak(&bad_scales) };
            Ok(())
        }),
        "x_scales",
    );
    let x8_odd = Tensor::from_vec(vec![Fp8E4M3(0); 2 * 144], &[2, 144]).unwrap();
    let sc = Tensor::from_vec(vec![1f32; 2], &[2, 1]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            a.x = Payload::Fp8 { x: unsafe_leak(&x8_odd), scales: unsafe_leak(&sc) };
            Ok(())
        }),
        "x",
    );
    // column-major scales are fine
    let sc_t = Tensor::from_vec(vec![1f32; 2], &[1, 2]).unwrap();
    let col = sc_t.view().with_layout(&[2, 1], &[1, 2]).unwrap();
    let ok = run_ranks(1, |g| {
        let mut b = host_buffer(g)?;
        let idx = topk(2, vec![0, 1, 2, 3]);
        let layout = b.get_dispatch_layout(idx.view(), 4)?;
        b.dispatch(&DispatchArgs {
            x: Payload::Fp8 { x: x8.view(), scales: col },
            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
            expert_alignment: 1,
            num_worst_tokens: 0,
            config: None,
        })
        .map(|r| r.recv_x_scales.map(|s| s.to_vec::<f32>().unwrap()))
    });
    assert_eq!(ok.into_iter().next().unwrap().unwrap(), Some(vec![1.0, 1.0]));
}

#[test]
fn dispatch_rejects_bad_topk_and_layout() {
    let w_wrong = Tensor::from_vec(vec![0.5f32; 6], &[2, 3]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            if let Routing::Fresh { topk_weights, .. } = &mut a.routing {
                *topk_weights = Some(unsafe_leak(&w_wrong));
            }
            Ok(())
        }),
        "topk_weights",
    );
    assert_arg(
        dispatch_with(|a, _| {
            if let Routing::Fresh { topk_weights, .. } = &mut a.routing {
                *topk_weights = None;
            }
            Ok(())
        }),
        "topk_weights",
    );
    let bad_idx = topk(2, vec![0, 9, 1, 2]);
    assert_arg(
        dispatch_with(|a, _| {
            if let Routing::Fresh { topk_idx, .. } = &mut a.routing {
                *topk_idx = Some(unsafe_leak(&bad_idx));
            }
            Ok(())
        }),
        "topk_idx",
    );
    let per_rank_wrong = Tensor::from_vec(vec![5i32], &[1]).unwrap();
    assert_arg(
        dispatch_with(|a, _| {
            if let Routing::Fresh { layout, .. } = &mut a.routing {
                layout.num_tokens_per_rank = unsafe_leak(&per_rank_wrong);
            }
            Ok(())
        }),
        "num_tokens_per_rank",
    );
    let experts3 = Tensor::from_vec(vec![0i32; 3], &[3]).unwrap();
    let e3 = run_ranks(2, |g| {
        let mut b = host_buffer(g)?;
        let x = x_bf16(1, 128);
        let idx = topk(1, vec![0, 1]);
        let layout = b.get_dispatch_layout(idx.view(), 4)?;
        let mut l = layout.as_ref();
        l.num_tokens_per_expert = experts3.view();
        b.dispatch(&DispatchArgs {
            x: Payload::Bf16(x.view()),
            routing: Routing::Fresh { layout: l, topk_idx: None, topk_weights: None },
            expert_alignment: 1,
            num_worst_tokens: 0,
            config: None,
        })
        .map(|_| ())
    });
    for r in e3 {
        assert_arg_rank_any(r.expect_err("3 experts over 2 ranks"), "num_tokens_per_expert");
    }
}

#[test]
fn dispatch_rejects_bad_knobs() {
    assert_arg(
        dispatch_with(|a, _| {
            a.expert_alignment = 0;
            Ok(())
        }),
        "expert_alignment",
    );
    assert_arg(
        dispatch_with(|a, _| {
            a.config = Some(Config::with_sms(3));
            Ok(())
        }),
        "config.num_sms",
    );
    assert_arg(
        dispatch_with(|a, _| {
            a.config = Some(Config::with_sms(0));
            Ok(())
        }),
        "config.num_sms",
    );
    // num_worst_tokens smaller than what arrives (2 tokens, both to rank 0 of 1).
    assert_arg(
        dispatch_with(|a, _| {
            a.num_worst_tokens = 1;
            Ok(())
        }),
        "num_worst_tokens",
    );
}

/// Two bf16 tokens of hidden 128 routed to experts 0..3, and their layout on `b`: what the output checks below
/// dispatch.
fn two_tokens(b: &mut Buffer) -> moelink::Result<(Tensor, DispatchLayout)> {
    let idx = topk(2, vec![0, 1, 2, 3]);
    let layout = b.get_dispatch_layout(idx.view(), 4)?;
    Ok((x_bf16(2, 128), layout))
}

/// A fresh CPU-synchronised dispatch of `two_tokens`' tokens without top-k.
fn two_token_args<'a>(x: &'a Tensor, layout: &'a DispatchLayout) -> DispatchArgs<'a> {
    DispatchArgs {
        x: Payload::Bf16(x.view()),
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    }
}

/// The optional handle outputs of `dispatch_into` (DeepEP's `rank_prefix_matrix` and `recv_src_idx`) must
/// be contiguous int32 tensors of their shapes, checked before anything moves.
#[test]
fn dispatch_rejects_bad_handle_outputs() {
    for (arg, shape, dtype) in [
        ("rank_prefix_matrix", vec![1, 2], DType::I32),
        ("rank_prefix_matrix", vec![1, 1], DType::I64),
        ("recv_src_idx", vec![3], DType::I32),
        ("recv_src_idx", vec![2], DType::F32),
    ] {
        let e = err_of(|b| {
            let (x, layout) = two_tokens(b)?;
            let args = two_token_args(&x, &layout);
            let plan = b.prepare_dispatch(&args)?;
            assert_eq!(plan.num_recv_rows(), 2);
            let mut recv_x = b.alloc(DType::BF16, &[2, 128])?;
            let mut bad = b.alloc(dtype, &shape)?;
            let (mut rank_prefix, mut src_idx) = (b.alloc(DType::I32, &[1, 1])?, b.alloc(DType::I32, &[2])?);
            let (rank_prefix, src_idx) =
                if arg == "rank_prefix_matrix" { (bad.view_mut(), src_idx.view_mut()) } else { (rank_prefix.view_mut(), bad.view_mut()) };
            let out = moelink::DispatchOutputs {
                recv_x: recv_x.view_mut(),
                recv_scales: None,
                recv_topk_idx: None,
                recv_topk_weights: None,
                rank_prefix_matrix: Some(rank_prefix),
                recv_src_idx: Some(src_idx),
                channels: None,
            };
            b.dispatch_into(plan, &args, out).map(|_| ())
        });
        assert_arg(e, arg);
    }
}

/// A fresh dispatch of two tokens on `b` (R ranks, experts 0..3) through `dispatch_into`, writing DeepEP's
/// channel elements into tensors of the given (dtype, shape): send_head, channel_prefix_matrix,
/// recv_channel_prefix_matrix.
fn dispatch_with_channel_outputs(b: &mut Buffer, shapes: [(DType, &[usize]); 3]) -> moelink::Result<()> {
    let (x, layout) = two_tokens(b)?;
    let args = two_token_args(&x, &layout);
    let plan = b.prepare_dispatch(&args)?;
    let mut recv_x = b.alloc(DType::BF16, &[plan.num_recv_rows(), 128])?;
    let [mut head, mut prefix, mut recv_prefix] = shapes.map(|(dtype, shape)| b.alloc(dtype, shape).expect("host memory"));
    let out = moelink::DispatchOutputs {
        recv_x: recv_x.view_mut(),
        recv_scales: None,
        recv_topk_idx: None,
        recv_topk_weights: None,
        rank_prefix_matrix: None,
        recv_src_idx: None,
        channels: Some(ChannelOutputs {
            send_head: head.view_mut(),
            channel_prefix_matrix: prefix.view_mut(),
            recv_channel_prefix_matrix: recv_prefix.view_mut(),
        }),
    };
    b.dispatch_into(plan, &args, out).map(|_| ())
}

/// DeepEP's channel elements (`ChannelOutputs`) must be contiguous int32 tensors: `send_head [T, R]`, both
/// matrices `[R, C]` with the same `C >= 1`; checked before anything moves. They exist on one node only.
#[test]
fn dispatch_rejects_bad_channel_outputs() {
    let i32_ = DType::I32;
    let good: [(DType, &[usize]); 3] = [(i32_, &[2, 1]), (i32_, &[1, 4]), (i32_, &[1, 4])];
    assert!(run_ranks(1, |g| dispatch_with_channel_outputs(&mut host_buffer(g)?, good)).into_iter().all(|r| r.is_ok()));
    for (arg, shapes) in [
        ("send_head", [(i32_, &[2, 2][..]), good[1], good[2]]),
        ("send_head", [(DType::I64, &[2, 1][..]), good[1], good[2]]),
        ("channel_prefix_matrix", [good[0], (i32_, &[1, 0][..]), (i32_, &[1, 0][..])]),
        ("channel_prefix_matrix", [good[0], (i32_, &[2, 4][..]), good[2]]),
        ("recv_channel_prefix_matrix", [good[0], good[1], (i32_, &[1, 3][..])]),
        ("recv_channel_prefix_matrix", [good[0], good[1], (DType::F32, &[1, 4][..])]),
    ] {
        assert_arg(err_of(|b| dispatch_with_channel_outputs(b, shapes)), arg);
    }
    // Across nodes the handle is the internode one.
    let across = run_ranks(2, |g| {
        let options = BufferOptions { topology: Some(Topology { num_nodes: 2, ranks_per_node: 1 }), ..host_options() };
        let mut b = Buffer::new(Arc::new(g), options)?;
        let per_rank = [(i32_, &[2, 2][..]), (i32_, &[2, 4][..]), (i32_, &[2, 4][..])];
        dispatch_with_channel_outputs(&mut b, per_rank)
    });
    for (rank, result) in across.into_iter().enumerate() {
        let e = result.expect_err("channel outputs across nodes must be rejected");
        assert_eq!(e.argument(), Some("send_head"), "rank {rank}: {e}");
        assert!(e.to_string().contains("2 nodes"), "rank {rank}: {e}");
    }
}

#[test]
fn handles_from_another_buffer_are_rejected() {
    let e = err_of(|b| {
        let mut other = Buffer::new(b.group().clone(), host_options())?;
        let x = x_bf16(2, 128);
        let idx = topk(2, vec![0, 1, 2, 3]);
        let layout = other.get_dispatch_layout(idx.view(), 4)?;
        let out = other.dispatch(&DispatchArgs {
            x: Payload::Bf16(x.view()),
            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
            expert_alignment: 1,
            num_worst_tokens: 0,
            config: None,
        })?;
        b.combine(&CombineArgs { x: out.recv_x.view(), handle: &out.handle, topk_weights: None, bias: [None, None], config: None })
            .map(|_| ())
    });
    assert_arg(e, "handle");
}

#[test]
fn combine_rejects_bad_inputs() {
    fn combine_with(edit: impl Fn(&mut CombineArgs<'_>) + Sync) -> Error {
        err_of(|b| {
            let x = x_bf16(2, 128);
            let idx = topk(2, vec![0, 1, 2, 3]);
            let w = Tensor::from_vec(vec![0.5f32; 4], &[2, 2])?;
            let layout = b.get_dispatch_layout(idx.view(), 4)?;
            let out = b.dispatch(&DispatchArgs {
                x: Payload::Bf16(x.view()),
                routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
                expert_alignment: 1,
                num_worst_tokens: 0,
                config: None,
            })?;
            let mut a = CombineArgs { x: out.recv_x.view(), handle: &out.handle, topk_weights: None, bias: [None, None], config: None };
            edit(&mut a);
            b.combine(&a).map(|_| ())
        })
    }
    let three_rows = x_bf16(3, 128);
    assert_arg(combine_with(|a| a.x = unsafe_leak(&three_rows)), "x");
    let bias_bad = x_bf16(2, 64);
    assert_arg(combine_with(|a| a.bias = [Some(unsafe_leak(&bias_bad)), None]), "bias");
    let bias_ok = x_bf16(2, 128);
    assert_arg(combine_with(|a| a.bias = [None, Some(unsafe_leak(&bias_ok))]), "bias");
    let w_bad = Tensor::from_vec(vec![0i32; 4], &[2, 2]).unwrap();
    assert_arg(combine_with(|a| a.topk_weights = Some(unsafe_leak(&w_bad))), "topk_weights");
    assert_arg(combine_with(|a| a.config = Some(Config::with_sms(5))), "config.num_sms");
}

#[test]
fn ranks_disagreeing_on_sizes_name_the_peer() {
    let out = run_ranks(2, |g| {
        let mut b = host_buffer(g)?;
        let hidden = if b.rank() == 0 { 128 } else { 256 };
        let x = x_bf16(1, hidden);
        let idx = topk(1, vec![0, 1]);
        let layout = b.get_dispatch_layout(idx.view(), 4)?;
        b.dispatch(&DispatchArgs {
            x: Payload::Bf16(x.view()),
            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
            expert_alignment: 1,
            num_worst_tokens: 0,
            config: None,
        })
        .map(|_| ())
    });
    for (rank, r) in out.into_iter().enumerate() {
        match r {
            Err(Error::RankMismatch { what: "hidden", rank: rr, peer, .. }) => {
                assert_eq!(rr, rank);
                assert_eq!(peer, 1 - rank);
            }
            other => panic!("rank {rank}: expected a hidden-size mismatch naming the peer, got {:?}", other.err()),
        }
    }
}

#[test]
fn view_constructors_check_bounds() {
    let data = vec![0f32; 6];
    assert!(TensorRef::from_slice(&data, &[2, 3]).is_ok());
    assert_eq!(TensorRef::from_slice(&data, &[3, 3]).err().and_then(|e| e.argument()), Some("data"));
    assert_eq!(TensorRef::from_slice_strided(&data, &[2, 3], &[4, 1]).err().and_then(|e| e.argument()), Some("data"));
    assert_eq!(TensorRef::from_slice_strided(&data, &[2, 3], &[-3, 1]).err().and_then(|e| e.argument()), Some("strides"));
}

/// Re-borrows a tensor's view for the closure's lifetime (the tensor outlives every use in these tests).
fn unsafe_leak(t: &Tensor) -> TensorRef<'static> {
    unsafe_leak_ref(t.view())
}
fn unsafe_leak_ref(v: TensorRef<'_>) -> TensorRef<'static> {
    // SAFETY: test-only: every tensor passed here lives until the end of the test function that owns it,
    // after all ranks have joined.
    let mem = unsafe { MemRef::from_raw(v.addr(), v.span_bytes(), v.location().into()) };
    TensorRef::from_memory(mem, v.dtype(), v.shape(), v.strides()).unwrap()
}

/// Sizes the machine cannot hold are refused before allocation with an error naming the argument they came
/// from and the bytes needed, never an abort.
#[test]
fn sizes_the_machine_cannot_hold_are_errors_naming_the_argument() {
    // A tensor: the bytes overflow, or are far beyond any machine's memory.
    let e = Tensor::zeros(DType::BF16, &[usize::MAX / 2, 4]).expect_err("overflows");
    assert_eq!(e.argument(), Some("shape"), "{e}");
    let e = Tensor::zeros(DType::BF16, &[1 << 40, 1 << 10]).expect_err("cannot be allocated");
    assert_eq!(e.argument(), Some("shape"), "{e}");
    assert!(e.to_string().contains(&format!("{} bytes", 1usize << 51)), "{e}");
    // A no-sync dispatch whose worst-case rows cannot be allocated names num_worst_tokens.
    let e = err_of(|b| {
        let idx = Tensor::from_vec(vec![0i64, 1, 1, 0], &[2, 2])?;
        let x = Tensor::from_vec(vec![bf16::ONE; 2 * 7168], &[2, 7168])?;
        let layout = b.get_dispatch_layout(idx.view(), 2)?;
        b.dispatch(&DispatchArgs {
            x: Payload::Bf16(x.view()),
            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
            expert_alignment: 1,
            num_worst_tokens: i32::MAX as usize,
            config: None,
        })
        .map(|_| ())
    });
    assert_eq!(e.argument(), Some("num_worst_tokens"), "{e}");
    assert!(e.to_string().contains(&format!("{} bytes", i32::MAX as usize * 7168 * 2)), "{e}");
}

/// Three inconsistent layouts (each would give silently wrong metadata if accepted), on 2 ranks. Rank 0 passes
/// the bad layout; rank 1 passes its own, correct one. Rank 0's error names the argument and rank 0; rank 1
/// learns that rank 0's argument was invalid; both buffers stay usable.
#[test]
fn layouts_that_disagree_with_topk_idx_or_each_other_are_refused() {
    #[derive(Clone, Copy, Debug)]
    enum Bad {
        /// `num_tokens_per_expert` off by 5 for one expert.
        ExpertCountOff,
        /// `is_token_in_rank` (and `num_tokens_per_rank` with it) from another routing than `topk_idx`.
        InRankFromOtherRouting,
        /// `is_token_in_rank` all false, `num_tokens_per_rank` zero, `num_tokens_per_expert` as computed.
        NothingSentButExpertsCounted,
    }
    for (bad, with_topk, arg) in [
        (Bad::ExpertCountOff, true, "num_tokens_per_expert"),
        (Bad::InRankFromOtherRouting, true, "is_token_in_rank"),
        (Bad::NothingSentButExpertsCounted, true, "is_token_in_rank"),
        (Bad::NothingSentButExpertsCounted, false, "num_tokens_per_expert"),
    ] {
        let out = run_ranks(2, |g| {
            let me = moelink::Group::rank(&g);
            let mut b = host_buffer(g)?;
            let (t, e) = (8usize, 4usize);
            let x = x_bf16(t, 128);
            let idx = topk(
                t,
                (0..2 * t as i64)
                    .map(|i| (i + me as i64) % e as i64)
                    .collect::<Vec<_>>()
                    .chunks(2)
                    .flat_map(|p| [p[0], (p[0] + 1) % 4])
                    .collect(),
            );
            let other = topk(t, (0..t).flat_map(|_| [0i64, 1]).collect());
            let w = Tensor::from_vec(vec![0.5f32; 2 * t], &[t, 2])?;
            let good = b.get_dispatch_layout(idx.view(), e)?;
            let from_other = b.get_dispatch_layout(other.view(), e)?;
            let mut per_expert: Vec<i32> = (0..e).map(|i| good.num_tokens_per_expert.view().get::<i32>(&[i]).unwrap_or(0)).collect();
            let zeros_rank = Tensor::from_vec(vec![0i32; 2], &[2])?;
            let no_rank = Tensor::from_bools(&vec![false; 2 * t], &[t, 2])?;
            let mut l = good.as_ref();
            if me == 0 {
                match bad {
                    Bad::ExpertCountOff => per_expert[1] += 5,
                    Bad::InRankFromOtherRouting => {
                        l.is_token_in_rank = from_other.is_token_in_rank.view();
                        l.num_tokens_per_rank = from_other.num_tokens_per_rank.view();
                    }
                    Bad::NothingSentButExpertsCounted => {
                        l.is_token_in_rank = no_rank.view();
                        l.num_tokens_per_rank = zeros_rank.view();
                    }
                }
            }
            let per_expert = Tensor::from_vec(per_expert, &[e])?;
            l.num_tokens_per_expert = per_expert.view();
            let routing = if with_topk {
                Routing::Fresh { layout: l, topk_idx: Some(idx.view()), topk_weights: Some(w.view()) }
            } else {
                Routing::Fresh { layout: l, topk_idx: None, topk_weights: None }
            };
            let args = DispatchArgs { x: Payload::Bf16(x.view()), routing, expert_alignment: 1, num_worst_tokens: 0, config: None };
            let err = b.dispatch(&args).err();
            // The buffer stays usable: the same call with the good layout goes through on both ranks.
            let good_args = DispatchArgs {
                routing: Routing::Fresh { layout: good.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
                ..args
            };
            let again = b.dispatch(&good_args).map(|d| d.num_recv_tokens_per_expert.iter().sum::<usize>());
            Ok((err, again))
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (err, again) = r.unwrap_or_else(|e| panic!("{bad:?}: rank {rank}: {e}"));
            let err = err.unwrap_or_else(|| panic!("{bad:?} (top-k {with_topk}): rank {rank} accepted the layout"));
            assert_eq!(err.argument(), Some(arg), "{bad:?} (top-k {with_topk}): {err}");
            let msg = err.to_string();
            assert!(msg.contains(&format!("on rank {rank}")), "{msg}");
            if rank == 1 {
                assert!(msg.contains("rank 0 passed an invalid"), "{msg}");
            }
            assert!(again.is_ok_and(|n| n > 0), "{bad:?}: rank {rank}: the buffer must stay usable");
        }
    }
}

/// A `topk_idx` without columns (`[16, 0]`, with the strides torch gives it) is refused for what it is, not
/// as a contiguity problem: an empty tensor is contiguous.
#[test]
fn topk_idx_without_columns_is_refused_as_such() {
    let none: [i64; 0] = [];
    let empty = TensorRef::from_slice_strided(&none, &[16, 0], &[1, 1]).unwrap();
    assert!(empty.is_contiguous());
    for e in [
        err_of(|b| b.get_dispatch_layout(unsafe_leak_ref(empty), 4).map(|_| ())),
        dispatch_with(|a, _| {
            if let Routing::Fresh { topk_idx, .. } = &mut a.routing {
                *topk_idx = Some(unsafe_leak_ref(TensorRef::from_slice_strided(&none, &[2, 0], &[1, 1])?));
            }
            Ok(())
        }),
    ] {
        let msg = e.to_string();
        assert!(msg.contains("0 columns"), "{msg}");
        assert_arg(e, "topk_idx");
    }
}
