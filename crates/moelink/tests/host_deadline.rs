//! The host backend honours the buffer's deadline (`timeout_ms`) in every wait, as the kernels do on the GPU:
//! a rank that never arrives, or that raised on its own bad input and went on to its next call, is a
//! `Timeout` naming it on every other rank within the deadline, and their buffers are poisoned. The ranks'
//! group has a much longer deadline of its own (60 s), so only the buffer's can end these waits in time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moelink::{
    bf16, BackendKind, Buffer, BufferOptions, DispatchArgs, Error, Group, LlDispatchArgs, LlQuant, Payload, Result, Routing, Tensor,
    ThreadGroup,
};

const H: usize = 128;
const T: usize = 4;
const K: usize = 2;
const DEADLINE_MS: u64 = 400;

fn options() -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Host,
        num_nvl_bytes: Buffer::ht_bytes_needed(T, H, K, 4, false),
        num_rdma_bytes: Buffer::ll_bytes_needed(T, H, 4, 8),
        low_latency_mode: true,
        timeout_ms: DEADLINE_MS,
        ..Default::default()
    }
}

/// How the last rank misbehaves in the call under test.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// It never makes the call (it stays alive, doing something else, past the deadline).
    NeverArrives,
    /// It passes a malformed argument, gets its own `InvalidArgument`, and goes on to the next call.
    BadInputThenCarriesOn,
}

/// The operation under test.
#[derive(Clone, Copy, Debug)]
enum Op {
    Dispatch,
    LowLatencyDispatch,
}

struct Inputs {
    x: Tensor,
    x_f32: Tensor,
    idx: Tensor,
}

fn inputs(rank: usize, ranks: usize) -> Result<Inputs> {
    let e = 2 * ranks as i64;
    let idx: Vec<i64> = (0..T * K).map(|i| (rank as i64 + i as i64) % e).collect();
    Ok(Inputs {
        x: Tensor::from_vec((0..T * H).map(|i| bf16::from_f32((i % 5) as f32)).collect::<Vec<_>>(), &[T, H])?,
        x_f32: Tensor::from_vec(vec![0f32; T * H], &[T, H])?,
        idx: Tensor::from_vec(idx, &[T, K])?,
    })
}

/// One call of `op`; `bad` passes an f32 `x` (refused by validation, before any exchange).
fn call(buf: &mut Buffer, op: Op, inp: &Inputs, bad: bool) -> Result<()> {
    let x = if bad { inp.x_f32.view() } else { inp.x.view() };
    let num_experts = 2 * buf.num_ranks();
    match op {
        Op::Dispatch => {
            let layout = buf.get_dispatch_layout(inp.idx.view(), num_experts)?;
            buf.dispatch(&DispatchArgs {
                x: Payload::Bf16(x),
                routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
                expert_alignment: 1,
                num_worst_tokens: 0,
                config: None,
            })
            .map(|_| ())
        }
        Op::LowLatencyDispatch => buf
            .low_latency_dispatch(&LlDispatchArgs {
                x,
                topk_idx: inp.idx.view(),
                topk_weights: None,
                num_max_dispatch_tokens_per_rank: T,
                num_experts,
                quant: LlQuant::Bf16,
                return_recv_hook: false,
            })
            .map(|_| ()),
    }
}

/// What one rank saw in the call under test: its error, how long the call took, whether the buffer is
/// poisoned afterwards and whether a later call is refused with `Poisoned`.
struct Seen {
    err: Error,
    elapsed: Duration,
    poisoned: bool,
    refused_later: bool,
}

fn run(ranks: usize, op: Op, fault: Fault) -> Vec<Option<Seen>> {
    let faulty = ranks - 1;
    // The group's own deadline is the default 60 s: the buffer's 400 ms must end the waits.
    let groups = ThreadGroup::new(ranks);
    std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || -> Result<Option<Seen>> {
                    let me = g.rank();
                    let mut buf = Buffer::new(Arc::new(g), options())?;
                    let inp = inputs(me, ranks)?;
                    // One healthy round first.
                    call(&mut buf, op, &inp, false)?;
                    let t0 = Instant::now();
                    let result = if me == faulty {
                        match fault {
                            Fault::NeverArrives => {
                                // Alive, busy elsewhere, past the others' deadline.
                                std::thread::sleep(Duration::from_millis(3 * DEADLINE_MS));
                                return Ok(None);
                            }
                            Fault::BadInputThenCarriesOn => {
                                let own = call(&mut buf, op, &inp, true).expect_err("an f32 x is refused");
                                assert_eq!(own.argument(), Some("x"), "{own}");
                                assert!(buf.poisoned().is_none(), "an argument error does not poison");
                                // It carries on: the next call must not pair with the peers' current one.
                                call(&mut buf, op, &inp, false)
                            }
                        }
                    } else {
                        call(&mut buf, op, &inp, false)
                    };
                    let elapsed = t0.elapsed();
                    let err = result.expect_err("the call cannot complete with a rank missing");
                    let poisoned = buf.poisoned().is_some();
                    let refused_later = matches!(call(&mut buf, op, &inp, false), Err(Error::Poisoned { .. }));
                    Ok(Some(Seen { err, elapsed, poisoned, refused_later }))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("no panic").expect("no setup error")).collect()
    })
}

fn check(ranks: usize, op: Op, fault: Fault) {
    let faulty = ranks - 1;
    let seen = run(ranks, op, fault);
    for (rank, s) in seen.iter().enumerate() {
        let Some(s) = s else {
            assert_eq!(rank, faulty, "only the absent rank reports nothing");
            continue;
        };
        let what = format!("{ranks} ranks, {op:?}, {fault:?}, rank {rank}: {}", s.err);
        // The peer named: the faulty rank, on every other rank; the faulty rank itself (which went on to its
        // next call) names the first rank that is not there.
        let expected_peer = if rank == faulty { 0 } else { faulty };
        match &s.err {
            Error::Timeout { rank: r, peer, .. } => {
                assert_eq!((*r, *peer), (rank, expected_peer), "{what}");
            }
            other => panic!("expected a timeout naming rank {expected_peer}, got {other}"),
        }
        assert!(s.elapsed < Duration::from_millis(DEADLINE_MS + 1500), "{what}: took {:?}", s.elapsed);
        assert!(s.poisoned && s.refused_later, "{what}: the buffer must be poisoned");
    }
    if matches!(fault, Fault::NeverArrives) {
        // A missing rank costs the others the whole deadline, not less.
        for s in seen.iter().flatten() {
            assert!(s.elapsed >= Duration::from_millis(DEADLINE_MS * 9 / 10), "gave up after {:?}", s.elapsed);
        }
    }
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_naming_it_at_2_and_4_ranks() {
    for ranks in [2, 4] {
        for op in [Op::Dispatch, Op::LowLatencyDispatch] {
            check(ranks, op, Fault::NeverArrives);
        }
    }
}

#[test]
fn a_rank_that_raised_on_its_own_input_and_went_on_is_a_timeout_naming_it_at_2_and_4_ranks() {
    for ranks in [2, 4] {
        for op in [Op::Dispatch, Op::LowLatencyDispatch] {
            check(ranks, op, Fault::BadInputThenCarriesOn);
        }
    }
}

/// Ranks that call different operations (the last rank a low-latency dispatch, the others a high-throughput
/// one) learn it at their first exchange: a `RankMismatch` on `operation` naming both phases, at once rather
/// than after the deadline, and the buffers are poisoned (the ranks' calls went separate ways).
#[test]
fn ranks_calling_different_operations_are_told_so_at_once() {
    for ranks in [2, 4] {
        let odd = ranks - 1;
        let groups = ThreadGroup::new(ranks);
        let seen: Vec<(Error, Duration, bool)> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    s.spawn(move || -> Result<(Error, Duration, bool)> {
                        let me = g.rank();
                        let mut buf = Buffer::new(Arc::new(g), options())?;
                        let inp = inputs(me, ranks)?;
                        call(&mut buf, Op::Dispatch, &inp, false)?;
                        let op = if me == odd { Op::LowLatencyDispatch } else { Op::Dispatch };
                        let t0 = Instant::now();
                        let err = call(&mut buf, op, &inp, false).expect_err("the ranks disagree on the operation");
                        Ok((err, t0.elapsed(), buf.poisoned().is_some()))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("no panic").expect("no setup error")).collect()
        });
        for (rank, (err, elapsed, poisoned)) in seen.iter().enumerate() {
            let expected_peer = if rank == odd { 0 } else { odd };
            match err {
                Error::RankMismatch { what, rank: r, peer, ours, theirs } => {
                    assert_eq!((*what, *r, *peer), ("operation", rank, expected_peer), "{err}");
                    let (mine, other) = if rank == odd { ("low-latency dispatch", "notify") } else { ("notify", "low-latency dispatch") };
                    assert!(ours.starts_with(mine) && theirs.starts_with(other), "{err}");
                }
                other => panic!("{ranks} ranks, rank {rank}: expected a RankMismatch on the operation, got {other}"),
            }
            assert!(*elapsed < Duration::from_millis(DEADLINE_MS / 2), "{ranks} ranks, rank {rank}: took {elapsed:?}");
            assert!(*poisoned, "rank {rank}: the buffer must be poisoned");
        }
    }
}
