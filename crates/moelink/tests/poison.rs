//! Poisoning and teardown: after an error inside a collective a `Buffer` refuses every later operation with
//! `Error::Poisoned` naming the cause, until it is rebuilt; argument errors do not poison; dropping a buffer
//! with work in flight waits for that work instead of freeing memory under it.
//!
//! Host tests always run. CUDA tests (`cuda_*`) are ignored unless included (`--include-ignored` on a GPU
//! machine) and need 2 ranks (`MOELINK_TEST_RANKS`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use moelink::graph::{HtGraph, HtGraphSpec};
use moelink::{
    bf16, group::run_ranks, BackendKind, Buffer, BufferOptions, CombineArgs, DType, DispatchArgs, DispatchResult, Error, Group,
    LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlQuant, Payload, Result, Routing, Tensor, ThreadGroup,
};
use moelink_testkit::harness::{cuda_lock, ranks_up_to, skip};

const H: usize = 256;
const K: usize = 2;

fn host_opts() -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Host,
        num_nvl_bytes: 64 << 20,
        num_rdma_bytes: 256 << 20,
        low_latency_mode: true,
        ..Default::default()
    }
}

/// Tokens of `rank` (3 tokens, top-2 of `2 * ranks` experts, a -1 hole).
fn idx_of(rank: usize, ranks: usize) -> Vec<i64> {
    let e = 2 * ranks as i64;
    vec![rank as i64 % e, (rank as i64 + 1) % e, -1, (rank as i64 + 3) % e, 0, e - 1]
}

struct Inputs {
    x: Tensor,
    idx: Tensor,
    w: Tensor,
}

fn inputs(buf: &Buffer) -> Result<Inputs> {
    let (me, r) = (buf.rank(), buf.num_ranks());
    let x = Tensor::from_vec((0..3 * H).map(|i| bf16::from_f32(((i + me) % 7) as f32 - 3.0)).collect::<Vec<_>>(), &[3, H])?;
    let idx = Tensor::from_vec(idx_of(me, r), &[3, K])?;
    let w = Tensor::from_vec(vec![0.5f32; 3 * K], &[3, K])?;
    Ok(Inputs { x: buf.upload(&x)?, idx: buf.upload(&idx)?, w: buf.upload(&w)? })
}

/// A fresh BF16 dispatch without top-k (its handle outlives a later failure in the tests below).
fn plain_dispatch(buf: &mut Buffer, inp: &Inputs) -> Result<DispatchResult> {
    let layout = buf.get_dispatch_layout(inp.idx.view(), 2 * buf.num_ranks())?;
    buf.dispatch(&DispatchArgs {
        x: Payload::Bf16(inp.x.view()),
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    })
}

/// HT dispatch + combine; returns the combined rows.
fn ht_round_trip(buf: &mut Buffer, inp: &Inputs) -> Result<Vec<u16>> {
    let layout = buf.get_dispatch_layout(inp.idx.view(), 2 * buf.num_ranks())?;
    let d = buf.dispatch(&DispatchArgs {
        x: Payload::Bf16(inp.x.view()),
        routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(inp.idx.view()), topk_weights: Some(inp.w.view()) },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    })?;
    let c = buf.combine(&CombineArgs {
        x: d.recv_x.view(),
        handle: &d.handle,
        topk_weights: d.recv_topk_weights.as_ref().map(|t| t.view()),
        bias: [None, None],
        config: None,
    })?;
    Ok(c.combined_x.to_vec::<bf16>()?.iter().map(|v| v.to_bits()).collect())
}

fn ll_args(inp: &Inputs, r: usize, hook: bool) -> LlDispatchArgs<'_> {
    LlDispatchArgs {
        x: inp.x.view(),
        topk_idx: inp.idx.view(),
        topk_weights: None,
        num_max_dispatch_tokens_per_rank: 4,
        num_experts: 2 * r,
        quant: LlQuant::Bf16,
        return_recv_hook: hook,
    }
}

/// Every entry point that runs (or may run) collective work, called once on a poisoned buffer; each must
/// fail with `Poisoned` naming the cause. `handle` comes from a dispatch before the failure.
fn every_later_call_is_refused(buf: &mut Buffer, inp: &Inputs, handle: &moelink::HtHandle, ll: &moelink::LlHandle, cause: &str) {
    let r = buf.num_ranks();
    let me = buf.rank();
    let mut results: Vec<(&str, Result<()>)> = Vec::new();
    results.push(("barrier", buf.barrier()));
    results.push(("get_dispatch_layout", buf.get_dispatch_layout(inp.idx.view(), 2 * r).map(|_| ())));
    let layout = Tensor::zeros(DType::I32, &[r]).unwrap();
    let per_expert = Tensor::zeros(DType::I32, &[2 * r]).unwrap();
    let in_rank = Tensor::zeros(DType::Bool, &[3, r]).unwrap();
    let (layout, per_expert, in_rank) = (buf.upload(&layout).unwrap(), buf.upload(&per_expert).unwrap(), buf.upload(&in_rank).unwrap());
    let lref = moelink::LayoutRef {
        num_tokens_per_rank: layout.view(),
        num_tokens_per_expert: per_expert.view(),
        is_token_in_rank: in_rank.view(),
    };
    let fresh = DispatchArgs {
        x: Payload::Bf16(inp.x.view()),
        routing: Routing::Fresh { layout: lref, topk_idx: None, topk_weights: None },
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    };
    results.push(("dispatch", buf.dispatch(&fresh).map(|_| ())));
    results.push(("prepare_dispatch", buf.prepare_dispatch(&fresh).map(|_| ())));
    let cached = DispatchArgs {
        x: Payload::Bf16(inp.x.view()),
        routing: Routing::Cached(handle),
        expert_alignment: 1,
        num_worst_tokens: 0,
        config: None,
    };
    results.push(("cached dispatch", buf.dispatch(&cached).map(|_| ())));
    let rows = buf.upload(&Tensor::zeros(DType::BF16, &[handle.num_recv_rows(), H]).unwrap()).unwrap();
    results.push((
        "combine",
        buf.combine(&CombineArgs { x: rows.view(), handle, topk_weights: None, bias: [None, None], config: None }).map(|_| ()),
    ));
    results.push(("low_latency_dispatch", buf.low_latency_dispatch(&ll_args(inp, r, false)).map(|_| ())));
    let y = buf.upload(&Tensor::zeros(DType::BF16, &[2, 4 * r, H]).unwrap()).unwrap();
    let cargs = LlCombineArgs {
        x: y.view(),
        topk_idx: inp.idx.view(),
        topk_weights: inp.w.view(),
        handle: ll,
        zero_copy: false,
        return_recv_hook: false,
    };
    results.push(("low_latency_combine", buf.low_latency_combine(&cargs).map(|_| ())));
    results.push(("get_next_low_latency_combine_buffer", buf.get_next_low_latency_combine_buffer(ll).map(|_| ())));
    results.push(("clean_low_latency_buffer", buf.clean_low_latency_buffer(4, H, 2 * r)));
    let spec = HtGraphSpec { num_tokens: 3, hidden: H, topk: K, num_experts: 2 * r, num_worst_tokens: 3 * r, config: None };
    results.push(("a graph pipeline", HtGraph::new(buf, spec).map(|_| ())));
    for (what, res) in results {
        match res {
            Err(Error::Poisoned { rank, cause: c }) => {
                assert_eq!(rank, me, "{what}");
                assert_eq!(c, cause, "{what}: the cause must be the first error");
                let msg = Error::Poisoned { rank, cause: c }.to_string();
                assert!(msg.contains("create a new Buffer") && msg.contains(cause), "{what}: {msg}");
            }
            other => panic!("rank {me}: {what} on a poisoned buffer returned {:?}, expected Poisoned", other.err()),
        }
    }
    assert_eq!(buf.poisoned(), Some(cause));
}

/// Host: one rank never joins a dispatch; the others time out (the buffer's deadline) naming it; their buffers are
/// poisoned and refuse every later call with the first error as the cause; a new buffer works.
#[test]
fn a_failed_collective_poisons_until_the_buffer_is_rebuilt() {
    let ranks = 3;
    let silent = 2;
    let groups = ThreadGroup::with_timeout(ranks, Duration::from_millis(400));
    let out: Vec<Result<Option<String>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<Option<String>> {
                    let mut buf = Buffer::new(Arc::new(g), BufferOptions { timeout_ms: 400, ..host_opts() })?;
                    let me = buf.rank();
                    let inp = inputs(&buf)?;
                    // One healthy round first: a handle from before the failure.
                    ht_round_trip(&mut buf, &inp)?;
                    let before = plain_dispatch(&mut buf, &inp)?;
                    let ll = buf.low_latency_dispatch(&ll_args(&inp, ranks, false))?;
                    if me == silent {
                        return Ok(None);
                    }
                    let t0 = Instant::now();
                    let err = ht_round_trip(&mut buf, &inp).expect_err("a rank is missing");
                    assert!(t0.elapsed() < Duration::from_secs(5), "the deadline must bound the wait");
                    assert!(err.poisons_buffer(), "{err}");
                    match &err {
                        Error::Timeout { peer, .. } => assert_eq!(*peer, silent, "{err}"),
                        Error::Group { reason, .. } => assert!(reason.contains("broken") || reason.contains("timed out"), "{err}"),
                        other => panic!("expected a timeout or a broken group, got {other}"),
                    }
                    let cause = err.to_string();
                    every_later_call_is_refused(&mut buf, &inp, &before.handle, &ll.handle, &cause);
                    // Local calls that launch nothing are still allowed (allocation, uploads).
                    assert!(buf.alloc(DType::F32, &[2]).is_ok());
                    Ok(Some(err.to_string()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("no panic")).collect()
    });
    let errors: Vec<String> = out.into_iter().filter_map(|r| r.expect("no setup error")).collect();
    assert_eq!(errors.len(), ranks - 1);
    assert!(errors.iter().any(|e| e.contains(&format!("rank {silent}"))), "one rank names the missing one: {errors:?}");

    // A new group and new buffers work.
    let again = run_ranks(ranks, |g| {
        let mut buf = Buffer::new(Arc::new(g), host_opts())?;
        let inp = inputs(&buf)?;
        ht_round_trip(&mut buf, &inp)
    });
    assert!(again.iter().all(|r| r.is_ok()), "{:?}", again.iter().map(|r| r.as_ref().err().map(|e| e.to_string())).collect::<Vec<_>>());
}

/// Argument errors and rank mismatches are reported without poisoning: the buffer keeps working.
#[test]
fn argument_errors_and_mismatches_do_not_poison() {
    let out = run_ranks(2, |g| {
        let mut buf = Buffer::new(Arc::new(g), host_opts())?;
        let me = buf.rank();
        let inp = inputs(&buf)?;
        // A local argument error.
        let bad = Tensor::from_vec(vec![0i64, 99], &[1, 2])?;
        let e = buf.get_dispatch_layout(bad.view(), 4).expect_err("expert 99 of 4");
        assert!(matches!(e, Error::InvalidArgument { arg: "topk_idx", .. }) && !e.poisons_buffer(), "{e}");
        // A collective disagreement: rank 1 passes another hidden size.
        let h = if me == 0 { H } else { 2 * H };
        let x = Tensor::from_vec(vec![bf16::ONE; 3 * h], &[3, h])?;
        let layout = buf.get_dispatch_layout(inp.idx.view(), 4)?;
        let e = buf
            .dispatch(&DispatchArgs {
                x: Payload::Bf16(x.view()),
                routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
                expert_alignment: 1,
                num_worst_tokens: 0,
                config: None,
            })
            .err()
            .expect("hidden sizes differ");
        assert!(matches!(e, Error::RankMismatch { what: "hidden", .. }), "{e}");
        assert!(!e.poisons_buffer());
        assert_eq!(buf.poisoned(), None);
        // Still usable.
        ht_round_trip(&mut buf, &inp)
    });
    let rows: Vec<Vec<u16>> = out.into_iter().map(|r| r.expect("the buffer stays usable")).collect();
    assert_eq!(rows.len(), 2);
}

/// Host: dropping a buffer while a receive hook is outstanding (its outputs still borrowed), then dropping
/// the hook, is safe; the group carries on with new buffers.
#[test]
fn dropping_a_buffer_with_a_pending_hook_is_safe() {
    let out = run_ranks(2, |g| {
        let group: Arc<dyn Group> = Arc::new(g);
        let mut buf = Buffer::new(group.clone(), host_opts())?;
        let inp = inputs(&buf)?;
        let (el, rows) = (2, 4 * 2);
        let mut recv = Tensor::zeros(DType::BF16, &[el, rows, H])?;
        let mut count = Tensor::zeros(DType::I32, &[el])?;
        let out = LlDispatchOutputs {
            recv_x: recv.view_mut(),
            recv_scales: None,
            recv_count: count.view_mut(),
            cumulative_local_expert_recv_stats: None,
            dispatch_wait_recv_cost_stats: None,
            src_info: None,
            layout_range: None,
        };
        let (handle, hook) = buf.low_latency_dispatch_into(&ll_args(&inp, 2, true), out)?;
        assert!(hook.is_some());
        drop(buf);
        drop(hook);
        drop(handle);
        let mut fresh = Buffer::new(group, host_opts())?;
        let inp = inputs(&fresh)?;
        ht_round_trip(&mut fresh, &inp)
    });
    assert!(out.iter().all(|r| r.is_ok()));
}

fn cuda_opts(timeout_ms: u64) -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Cuda,
        num_nvl_bytes: 64 << 20,
        num_rdma_bytes: 256 << 20,
        low_latency_mode: true,
        timeout_ms,
        ..Default::default()
    }
}

/// Up to 4 ranks of `MOELINK_TEST_RANKS`, at least 2 (else the test is skipped, saying so).
fn cuda_ranks() -> Option<usize> {
    let r = ranks_up_to(BackendKind::Cuda, 4);
    if r < 2 {
        skip("needs 2 ranks (MOELINK_TEST_RANKS)");
        return None;
    }
    Some(r)
}

/// CUDA: a rank that never calls makes the others' kernels time out (error naming it, within the deadline);
/// their buffers refuse every later call; after a barrier every rank rebuilds and a round trip works.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn cuda_kernel_timeout_poisons_until_rebuilt() {
    let Some(ranks) = cuda_ranks() else { return };
    let _gpus = cuda_lock();
    let silent = ranks - 1;
    let timeout_ms = 1500;
    let out = run_ranks(ranks, |g| -> Result<Option<(String, f64)>> {
        let group: Arc<dyn Group> = Arc::new(g);
        let mut buf = Buffer::new(group.clone(), cuda_opts(timeout_ms))?;
        let me = buf.rank();
        let inp = inputs(&buf)?;
        let before = plain_dispatch(&mut buf, &inp)?;
        let ll = buf.low_latency_dispatch(&ll_args(&inp, ranks, false))?;
        let mut seen = None;
        if me != silent {
            let t0 = Instant::now();
            let err = buf.low_latency_dispatch(&ll_args(&inp, ranks, false)).err().expect("a rank is missing");
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            assert!(matches!(err, Error::Timeout { .. }), "rank {me}: {err}");
            assert!(ms < timeout_ms as f64 + 3000.0, "rank {me}: {ms:.0} ms for a {timeout_ms} ms deadline");
            let cause = err.to_string();
            every_later_call_is_refused(&mut buf, &inp, &before.handle, &ll.handle, &cause);
            seen = Some((cause, ms));
        }
        // Everyone past the failure before anyone frees memory peers could still touch.
        group.barrier()?;
        drop(ll);
        drop(before);
        drop(buf);
        let mut fresh = Buffer::new(group, cuda_opts(timeout_ms))?;
        let inp = inputs(&fresh)?;
        ht_round_trip(&mut fresh, &inp)?;
        fresh.low_latency_dispatch(&ll_args(&inp, ranks, false))?;
        fresh.barrier()?;
        Ok(seen)
    });
    let mut named = false;
    for (rank, r) in out.into_iter().enumerate() {
        match r {
            Ok(Some((cause, _))) => named |= cause.contains(&format!("rank {silent}")),
            Ok(None) => assert_eq!(rank, silent),
            Err(e) => panic!("rank {rank}: {e}"),
        }
    }
    assert!(named, "at least one rank's timeout names the silent rank");
}

/// CUDA: every rank enqueues a low-latency dispatch on a stream of its own through the foreign-stream door
/// (what the Python layer does: nothing waits for the work) and drops its buffer at once; the last rank
/// joins late, so the others' kernels are still waiting when their buffers are dropped. Drop must wait for
/// them (it takes about the late rank's delay) and free nothing under them: afterwards every GPU still works
/// (a sticky illegal-address error would fail the next round trip).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored"]
fn cuda_drop_waits_for_in_flight_work() {
    let Some(ranks) = cuda_ranks() else { return };
    let _gpus = cuda_lock();
    let late = ranks - 1;
    let delay = Duration::from_millis(400);
    let out = run_ranks(ranks, |g| -> Result<f64> {
        let group: Arc<dyn Group> = Arc::new(g);
        let mut buf = Buffer::new(group.clone(), cuda_opts(10_000))?;
        let me = buf.rank();
        let inp = inputs(&buf)?;
        buf.low_latency_dispatch(&ll_args(&inp, ranks, false))?; // warm-up: kernels compiled
        group.barrier()?;
        let moelink::Location::Cuda(ordinal) = buf.location() else { unreachable!("a CUDA buffer") };
        let stream = moelink_cuda::Stream::new(&moelink_cuda::Device::new(ordinal)?)?;
        if me == late {
            std::thread::sleep(delay);
        }
        // SAFETY: the stream lives until the end of this closure, after the buffer (dropped below) waited
        // for it; the inputs and outputs outlive the stream work (`d` and `inp` are dropped after `buf`).
        let foreign = unsafe { moelink::ForeignStream::from_raw(stream.raw_handle()) };
        let d = buf.on_foreign_stream(&foreign, |b| b.low_latency_dispatch(&ll_args(&inp, ranks, false)))?;
        let t0 = Instant::now();
        drop(buf);
        let drop_ms = t0.elapsed().as_secs_f64() * 1e3;
        assert!(stream.query()?, "rank {me}: the stream must be idle once the buffer is dropped");
        drop(d);
        group.barrier()?;
        let mut fresh = Buffer::new(group, cuda_opts(10_000))?;
        let inp = inputs(&fresh)?;
        ht_round_trip(&mut fresh, &inp)?;
        fresh.barrier()?;
        Ok(drop_ms)
    });
    for (rank, r) in out.into_iter().enumerate() {
        let ms = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        if rank != late {
            assert!(ms > delay.as_secs_f64() * 1e3 * 0.5, "rank {rank}: drop returned after {ms:.0} ms, before its kernel could finish");
        }
    }
}

/// A `Buffer` is `Send`: it can be dropped on another thread than the one that used it.
#[test]
fn buffers_are_send() {
    fn send<T: Send>() {}
    send::<Buffer>();
    send::<LlCombineOutputs<'static>>();
}
