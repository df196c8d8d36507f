//! Fuzzing every input-validation path of the public API (proptest): arbitrary, mostly malformed argument
//! combinations for every `Buffer` entry point on the host backend — dtypes, shapes (0-d to 5-d, empty,
//! huge), strides (zero, non-contiguous, huge, overflowing), tensors on the wrong device, ids out of range
//! and repeated, sizes (0, off by one, huge, `usize::MAX`), handles and hooks from other buffers, outputs of
//! the wrong shape for the `_into` forms — plus the tensor constructors, the size hints and the launch
//! environment parser.
//!
//! Properties: no panic (a panic on a rank thread fails the case), no undefined behaviour (host views are
//! only ever built over memory that covers them; huge views live on a fake device address the host backend
//! must refuse before touching), and every rejection is `InvalidArgument`, `RankMismatch` or
//! `BufferTooSmall` naming an argument of that entry point (and the message says which). With several ranks
//! every rank gets the same arguments and must reach the same outcome (nobody left waiting).
//!
//! CI runs proptest's default 256 cases per property (a few seconds). The long run:
//! `PROPTEST_CASES=20000 cargo test --release -p moelink --test fuzz_validation`. Failing seeds are kept in
//! `tests/fuzz_validation.proptest-regressions` (replayed first on every run); the bugs this suite found
//! have their own regression tests at the end of the file.

use std::sync::Arc;
use std::time::Duration;

use moelink::group::TcpConfig;
use moelink::{
    BackendKind, Buffer, BufferOptions, CombineArgs, CombineOutputs, Config, DType, DispatchArgs, DispatchOutputs, Error, Fp8E4M3, Layout,
    LayoutOutputs, LlCombineArgs, LlCombineOutputs, LlDispatchArgs, LlDispatchOutputs, LlQuant, Location, MemMut, MemRef, Payload, Routing,
    Tensor, TensorMut, TensorRef, ThreadGroup,
};
use proptest::prelude::*;

// ================================================================================================ tensors

/// Host views are materialized only when they span at most this many bytes.
const MAX_HOST_BYTES: usize = 1 << 20;

const DTYPES: [DType; 7] = [DType::BF16, DType::Fp8E4M3, DType::F32, DType::I32, DType::I64, DType::Bool, DType::U8];

/// A tensor argument: dtype, shape, strides (`None`: contiguous), on the host or a (fake) device.
#[derive(Clone, Debug)]
struct TSpec {
    dtype: DType,
    shape: Vec<usize>,
    strides: Option<Vec<isize>>,
    device: bool,
    /// Seed of the contents (ids drawn around the expert range, repeats, -1; floats; bytes).
    fill: u64,
}

impl TSpec {
    /// This spec with [`RECV_ROWS`] dimensions replaced by `n`. Such a tensor keeps contiguous strides:
    /// explicit ones could make the view buildable on one rank and not on another (its row count differs),
    /// which would test the harness, not the library.
    fn rows(&self, n: usize) -> TSpec {
        self.resolve(&[(RECV_ROWS, n)])
    }

    /// This spec with placeholder dimensions replaced (contiguous strides when any was).
    fn resolve(&self, values: &[(usize, usize)]) -> TSpec {
        if !self.shape.iter().any(|d| values.iter().any(|(p, _)| p == d)) {
            return self.clone();
        }
        let shape = self.shape.iter().map(|&d| values.iter().find(|(p, _)| *p == d).map_or(d, |&(_, v)| v)).collect();
        TSpec { shape, strides: None, ..self.clone() }
    }
}

/// Element span (first to one past the last element) with checked arithmetic, `None` on overflow.
fn span_elems(shape: &[usize], strides: &[isize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    let mut s: usize = 1;
    for (&n, &st) in shape.iter().zip(strides) {
        s = s.checked_add((n - 1).checked_mul(usize::try_from(st).ok()?)?)?;
    }
    Some(s)
}

fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut st = vec![0isize; shape.len()];
    let mut acc: isize = 1;
    for i in (0..shape.len()).rev() {
        st[i] = acc;
        acc = acc.saturating_mul(shape[i].max(1).min(isize::MAX as usize) as isize);
    }
    st
}

/// A materialized argument: the backing memory (kept alive) and the view's parameters.
struct Made {
    _store: Vec<u128>,
    addr: u64,
    loc: Location,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
}

impl Made {
    fn new(t: &TSpec, num_experts: usize) -> Made {
        let strides = t.strides.clone().unwrap_or_else(|| contiguous_strides(&t.shape));
        let bytes = span_elems(&t.shape, &strides).and_then(|s| s.checked_mul(t.dtype.size_bytes()));
        match bytes {
            Some(b) if !t.device && b <= MAX_HOST_BYTES && t.shape.len() == strides.len() => {
                let mut store = vec![0u128; b.div_ceil(16).max(1)];
                fill(bytemuck::cast_slice_mut(&mut store), t.dtype, t.fill, num_experts);
                let addr = store.as_ptr() as u64;
                Made { _store: store, addr, loc: Location::Host, dtype: t.dtype, shape: t.shape.clone(), strides }
            }
            // Too big (or overflowing) for real memory: a device view at a fake address. The host backend must
            // refuse it for its location before reading anything.
            _ => Made { _store: Vec::new(), addr: 0x1000, loc: Location::Cuda(0), dtype: t.dtype, shape: t.shape.clone(), strides },
        }
    }

    /// The view, or `None` when even the raw constructor refuses the layout (then the case is about that).
    fn view(&self) -> Option<TensorRef<'_>> {
        let bytes = self.span_bytes()?;
        // SAFETY: host views cover `_store` (span checked above); device views are never dereferenced by the
        // host backend (location is checked before any read), and `self` outlives every use of the view.
        let mem = unsafe { MemRef::from_raw(self.addr, bytes, self.loc.into()) };
        TensorRef::from_memory(mem, self.dtype, &self.shape, &self.strides).ok()
    }

    fn view_mut(&mut self) -> Option<TensorMut<'_>> {
        let bytes = self.span_bytes()?;
        // SAFETY: as `view`; the view borrows `self` mutably.
        let mem = unsafe { MemMut::from_raw(self.addr, bytes, self.loc.into()) };
        TensorMut::from_memory(mem, self.dtype, &self.shape, &self.strides).ok()
    }

    /// The layout's bytes, or `None` when the layout itself is refused (then the case is about that).
    fn span_bytes(&self) -> Option<usize> {
        Some(Layout::new(&self.shape, &self.strides).ok()?.span_elems() * self.dtype.size_bytes())
    }
}

/// Seeded contents: ids mostly in `-1..num_experts` with some out of range and repeats; finite floats.
fn fill(bytes: &mut [u8], dtype: DType, seed: u64, num_experts: usize) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    match dtype {
        // Three seeds in four give well-formed ids (distinct within a row of up to 7, a -1 now and then), so that
        // calls get past the id checks to everything behind them; the rest are hostile.
        DType::I64 if seed % 4 != 0 => {
            let e = num_experts.max(1) as i64;
            for (i, c) in bytes.chunks_exact_mut(8).enumerate() {
                let v = if next() % 9 == 0 { -1 } else { (i as i64 * 7 + (seed >> 8) as i64 % e).rem_euclid(e) };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::I64 => {
            for c in bytes.chunks_exact_mut(8) {
                let r = next();
                let e = num_experts.max(1) as i64;
                let v = match r % 16 {
                    0 => -1,
                    1 => -2,
                    2 => e,
                    3 => i64::MAX,
                    4 => i64::MIN,
                    5 => 0, // repeats
                    _ => (r >> 8) as i64 % e,
                };
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F32 => bytes.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&((next() % 1000) as f32 / 100.0).to_le_bytes())),
        DType::I32 => bytes.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&((next() % 64) as i32 - 2).to_le_bytes())),
        DType::Bool => bytes.iter_mut().for_each(|b| *b = (next() % 3 == 0) as u8),
        _ => bytes.iter_mut().for_each(|b| *b = (next() as u8) & 0x7e),
    }
}

/// Dimension sizes: mostly small, sometimes empty or huge.
fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..6,
        2 => Just(8usize),
        2 => Just(128usize),
        1 => Just(256usize),
        1 => Just(512usize),
        1 => Just(1usize << 20),
        1 => Just(1usize << 40),
        1 => Just(usize::MAX),
    ]
}

fn stride() -> impl Strategy<Value = isize> {
    prop_oneof![4 => 0isize..4, 1 => Just(128isize), 1 => Just(1isize << 40), 1 => Just(isize::MAX), 1 => Just(-1isize)]
}

/// A tensor: usually near `want` (the right dtype and shape), often perturbed in one way or another.
fn tensor_near(want_dtype: DType, want_shape: Vec<usize>) -> impl Strategy<Value = TSpec> {
    let nd = want_shape.len();
    (
        prop_oneof![6 => Just(want_dtype), 1 => prop::sample::select(DTYPES.to_vec())],
        prop_oneof![
            6 => Just(want_shape.clone()),
            2 => prop::collection::vec(dim(), nd..=nd),
            1 => prop::collection::vec(dim(), 0..6),
            2 => (0..nd.max(1), dim()).prop_map(move |(i, d)| {
                let mut s = want_shape.clone();
                if let Some(x) = s.get_mut(i) {
                    *x = d;
                }
                s
            }),
        ],
        prop_oneof![8 => Just(None), 1 => prop::collection::vec(stride(), 0..6).prop_map(Some)],
        prop_oneof![12 => Just(false), 1 => Just(true)],
        any::<u64>(),
    )
        .prop_map(|(dtype, shape, strides, device, fill)| TSpec { dtype, shape, strides, device, fill })
}

/// Size arguments: small, off-by-one around `n`, or absurd.
fn size_near(n: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => Just(n),
        1 => Just(n.saturating_sub(1)),
        1 => Just(n + 1),
        1 => Just(0usize),
        1 => Just(2 * n),
        1 => Just(1usize << 32),
        1 => Just(1usize << 40),
        1 => Just(usize::MAX),
    ]
}

// ================================================================================================ checking

/// Runs `f` on every rank of a fresh `ranks`-rank host group (same arguments everywhere) and checks the
/// outcomes: no panic, no hang, errors of the allowed kinds naming an allowed argument, the same outcome on
/// every rank.
fn check_ranks(ranks: usize, allowed: &[&str], f: impl Fn(&mut Buffer) -> moelink::Result<()> + Sync) -> Result<(), TestCaseError> {
    // A short deadline: every case is tiny, and a rank left waiting must fail the case quickly (a timeout is
    // not an allowed outcome), not stall the run.
    let groups = ThreadGroup::with_timeout(ranks, Duration::from_secs(2));
    let outcomes: Vec<std::thread::Result<moelink::Result<()>>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                let f = &f;
                s.spawn(move || {
                    let mut buf = Buffer::new(Arc::new(g), host_options())?;
                    f(&mut buf)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    let mut kinds = Vec::new();
    for (rank, o) in outcomes.into_iter().enumerate() {
        let r = o.map_err(|p| {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            TestCaseError::fail(format!("rank {rank} panicked: {msg}"))
        })?;
        kinds.push(match r {
            Ok(()) => "ok".to_string(),
            Err(e) => {
                check_error(&e, allowed).map_err(|m| TestCaseError::fail(format!("rank {rank}: {m}")))?;
                format!("{:?}", std::mem::discriminant(&e))
            }
        });
    }
    prop_assert!(kinds.windows(2).all(|w| w[0] == w[1]), "ranks disagree on the outcome: {kinds:?}");
    Ok(())
}

/// True when `mine` is true on every rank (a group exchange; every rank must call it).
fn all_ranks(buf: &Buffer, mine: bool) -> moelink::Result<bool> {
    Ok(buf.group().all_gather(&[u8::from(mine)])?.iter().all(|m| m.first() == Some(&1)))
}

/// Host buffers with room for the tests' shapes (the capacity rules apply on the host too: a case that does
/// not fit is `BufferTooSmall`) and a deadline short enough that a rank left waiting fails the case quickly.
fn host_options() -> BufferOptions {
    BufferOptions {
        backend: BackendKind::Host,
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes: 1 << 30,
        low_latency_mode: true,
        timeout_ms: 2_000,
        ..Default::default()
    }
}

fn check_error(e: &Error, allowed: &[&str]) -> Result<(), String> {
    match e {
        Error::InvalidArgument { arg, .. } | Error::RankMismatch { what: arg, .. } => {
            if !allowed.contains(arg) {
                return Err(format!("error names `{arg}`, not an argument of this call ({allowed:?}): {e}"));
            }
            if !e.to_string().contains(arg) {
                return Err(format!("the message does not name `{arg}`: {e}"));
            }
            Ok(())
        }
        Error::BufferTooSmall { .. } => Ok(()),
        other => Err(format!("expected an argument error, got: {other}")),
    }
}

const LAYOUT_ARGS: &[&str] = &["topk_idx", "num_experts", "num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"];
const DISPATCH_ARGS: &[&str] = &[
    "x",
    "x_scales",
    "topk_idx",
    "topk_weights",
    "num_experts",
    "num_tokens_per_rank",
    "num_tokens_per_expert",
    "is_token_in_rank",
    "expert_alignment",
    "num_worst_tokens",
    "config.num_sms",
    "handle",
    "recv_x",
    "recv_x_scales",
    "recv_topk_idx",
    "recv_topk_weights",
    "hidden",
    // combine, run after a successful dispatch
    "bias",
    "combined_x",
    "combined_topk_weights",
];
const LL_ARGS: &[&str] = &[
    "x",
    "topk_idx",
    "topk_weights",
    "num_experts",
    "num_max_dispatch_tokens_per_rank",
    "return_recv_hook",
    "recv_x",
    "recv_x_scales",
    "recv_count",
    "cumulative_local_expert_recv_stats",
    "dispatch_wait_recv_cost_stats",
    "handle",
    "zero_copy",
    "out",
    "combine_wait_recv_cost_stats",
    "hidden",
    "hook",
];

fn ranks() -> impl Strategy<Value = usize> {
    prop_oneof![6 => Just(1usize), 2 => Just(2usize), 1 => Just(3usize)]
}

// ================================================================================================ properties

/// Inputs of a well-formed HT call the properties perturb.
const T: usize = 3;
const HID: usize = 128;
const K: usize = 2;
/// A valid `topk_idx [T, K]` for `4 * ranks` experts: token 0 goes to this rank, token 1 to the next, token
/// 2 nowhere — so every rank receives exactly 2 rows and a tensor shaped for the received rows is right (or
/// wrong) on every rank alike.
fn good_idx(rank: usize, ranks: usize) -> Vec<i64> {
    vec![4 * rank as i64, -1, 4 * ((rank + 1) % ranks) as i64 + 1, -1, -1, -1]
}
/// A dimension resolved when the case runs: the rows this rank receives (rank-dependent), so that a "right"
/// output shape is right on every rank and a perturbed one wrong on every rank.
const RECV_ROWS: usize = usize::MAX - 7;
/// Placeholders of low-latency outputs: local experts and rows per expert (`R * T_max`) of the call.
const LL_EL: usize = usize::MAX - 8;
const LL_ROWS: usize = usize::MAX - 9;

proptest! {
    #![proptest_config(ProptestConfig { max_shrink_iters: 2000, ..ProptestConfig::default() })]

    /// `get_dispatch_layout(topk_idx, num_experts)` and its `_into` form with arbitrary outputs.
    #[test]
    fn layout(r in ranks(), idx in tensor_near(DType::I64, vec![T, K]), e in size_near(4),
              outs in (tensor_near(DType::I32, vec![2]), tensor_near(DType::I32, vec![4]), tensor_near(DType::Bool, vec![T, 2])),
              into in any::<bool>()) {
        check_ranks(r, LAYOUT_ARGS, |buf| {
            let m = Made::new(&idx, e);
            let Some(v) = m.view() else { return Ok(()) };
            if !into {
                return buf.get_dispatch_layout(v, e).map(|_| ());
            }
            let (mut a, mut b, mut c) = (Made::new(&outs.0, e), Made::new(&outs.1, e), Made::new(&outs.2, e));
            let (Some(a), Some(b), Some(c)) = (a.view_mut(), b.view_mut(), c.view_mut()) else { return Ok(()) };
            buf.get_dispatch_layout_into(v, e, LayoutOutputs { num_tokens_per_rank: a, num_tokens_per_expert: b, is_token_in_rank: c, num_tokens_per_rdma_rank: None })
        })?;
    }

    /// Fresh dispatch: payload (BF16 or FP8 + scales), layout tensors, top-k, knobs; then, when it
    /// succeeds, combine with arbitrary inputs.
    #[test]
    fn dispatch_and_combine(
        r in ranks(),
        fp8 in any::<bool>(),
        x in tensor_near(DType::BF16, vec![T, HID]),
        x8 in tensor_near(DType::Fp8E4M3, vec![T, HID]),
        scales in tensor_near(DType::F32, vec![T, HID / 128]),
        idx in tensor_near(DType::I64, vec![T, K]),
        w in tensor_near(DType::F32, vec![T, K]),
        topk in prop_oneof![4 => Just((true, true)), 1 => Just((false, false)), 1 => Just((true, false)), 1 => Just((false, true))],
        perturb_layout in prop::option::of((0usize..3, tensor_near(DType::I32, vec![2]))),
        align in size_near(1),
        worst in prop_oneof![6 => Just(0usize), 2 => size_near(2 * T)],
        sms in prop::option::of(prop_oneof![Just(0usize), Just(1), Just(2), Just(3), Just(24), Just(usize::MAX)]),
        cx in tensor_near(DType::BF16, vec![RECV_ROWS, HID]),
        cw in prop::option::of(tensor_near(DType::F32, vec![RECV_ROWS, K])),
        bias in (prop::option::of(tensor_near(DType::BF16, vec![T, HID])), prop::option::of(tensor_near(DType::BF16, vec![T, HID]))),
        csms in prop::option::of(prop_oneof![Just(1usize), Just(2), Just(7)]),
    ) {
        check_ranks(r, DISPATCH_ARGS, |buf| {
            let e = 4 * buf.num_ranks();
            let good_idx = Tensor::from_vec(good_idx(buf.rank(), buf.num_ranks()), &[T, K])?;
            let layout = buf.get_dispatch_layout(good_idx.view(), e)?;
            let (mx, m8, ms, mi, mw) = (Made::new(&x, e), Made::new(&x8, e), Made::new(&scales, e), Made::new(&idx, e), Made::new(&w, e));
            let (Some(xv), Some(x8v), Some(sv), Some(iv), Some(wv)) = (mx.view(), m8.view(), ms.view(), mi.view(), mw.view()) else {
                return Ok(());
            };
            let payload = if fp8 { Payload::Fp8 { x: x8v, scales: sv } } else { Payload::Bf16(xv) };
            let mut lref = layout.as_ref();
            let mp = perturb_layout.as_ref().map(|(_, t)| Made::new(t, e));
            if let (Some((which, _)), Some(mp)) = (&perturb_layout, &mp) {
                let Some(v) = mp.view() else { return Ok(()) };
                match which {
                    0 => lref.num_tokens_per_rank = v,
                    1 => lref.num_tokens_per_expert = v,
                    _ => lref.is_token_in_rank = v,
                }
            }
            let args = DispatchArgs {
                x: payload,
                routing: Routing::Fresh { layout: lref, topk_idx: topk.0.then_some(iv), topk_weights: topk.1.then_some(wv) },
                expert_alignment: align,
                num_worst_tokens: worst,
                config: sms.map(Config::with_sms),
            };
            let d = buf.dispatch(&args)?;
            // Combine with arbitrary inputs against the handle of this dispatch.
            let n = d.handle.num_recv_rows();
            let (mcx, mcw, mb0, mb1) = (
                Made::new(&cx.rows(n), e),
                cw.as_ref().map(|t| Made::new(&t.rows(n), e)),
                bias.0.as_ref().map(|t| Made::new(t, e)),
                bias.1.as_ref().map(|t| Made::new(t, e)),
            );
            let Some(cxv) = mcx.view() else { return Ok(()) };
            let cwv = match &mcw { Some(m) => match m.view() { Some(v) => Some(v), None => return Ok(()) }, None => None };
            let b0 = match &mb0 { Some(m) => match m.view() { Some(v) => Some(v), None => return Ok(()) }, None => None };
            let b1 = match &mb1 { Some(m) => match m.view() { Some(v) => Some(v), None => return Ok(()) }, None => None };
            buf.combine(&CombineArgs { x: cxv, handle: &d.handle, topk_weights: cwv, bias: [b0, b1], config: csms.map(Config::with_sms) })
                .map(|_| ())
        })?;
    }

    /// `prepare_dispatch` + `dispatch_into` / `combine_into` with outputs of arbitrary dtype and shape.
    #[test]
    fn into_forms_with_wrong_outputs(
        r in ranks(),
        fp8 in any::<bool>(),
        recv_x in tensor_near(DType::BF16, vec![RECV_ROWS, HID]),
        recv_scales in prop::option::of(tensor_near(DType::F32, vec![RECV_ROWS, 1])),
        recv_idx in prop::option::of(tensor_near(DType::I64, vec![RECV_ROWS, K])),
        recv_w in prop::option::of(tensor_near(DType::F32, vec![RECV_ROWS, K])),
        worst in prop_oneof![Just(0usize), Just(2 * T), Just(8 * T)],
        cx_out in tensor_near(DType::BF16, vec![T, HID]),
        cw_out in prop::option::of(tensor_near(DType::F32, vec![T, K])),
    ) {
        check_ranks(r, DISPATCH_ARGS, |buf| {
            let e = 4 * buf.num_ranks();
            let idx = Tensor::from_vec(good_idx(buf.rank(), buf.num_ranks()), &[T, K])?;
            let w = Tensor::from_vec(vec![0.5f32; T * K], &[T, K])?;
            let x = Tensor::from_vec(vec![moelink::bf16::ONE; T * HID], &[T, HID])?;
            let x8 = Tensor::from_vec(vec![Fp8E4M3(0x38); T * HID], &[T, HID])?;
            let sc = Tensor::from_vec(vec![1f32; T], &[T, 1])?;
            let layout = buf.get_dispatch_layout(idx.view(), e)?;
            let args = DispatchArgs {
                x: if fp8 { Payload::Fp8 { x: x8.view(), scales: sc.view() } } else { Payload::Bf16(x.view()) },
                routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
                expert_alignment: 1,
                num_worst_tokens: worst,
                config: None,
            };
            let plan = buf.prepare_dispatch(&args)?;
            let n = plan.num_recv_rows();
            let mut mx = Made::new(&recv_x.rows(n), e);
            let mut ms = recv_scales.as_ref().map(|t| Made::new(&t.rows(n), e));
            let mut mi = recv_idx.as_ref().map(|t| Made::new(&t.rows(n), e));
            let mut mw = recv_w.as_ref().map(|t| Made::new(&t.rows(n), e));
            // The row count differs between ranks, so one rank may be able to build a view another cannot
            // (an empty tensor with a huge other dimension): skip such cases on every rank together.
            let buildable = mx.view().is_some()
                && [&ms, &mi, &mw].iter().all(|m| m.as_ref().is_none_or(|m| m.view().is_some()));
            if !all_ranks(buf, buildable)? {
                return Ok(());
            }
            let Some(xo) = mx.view_mut() else { return Ok(()) };
            let out = DispatchOutputs {
                recv_x: xo,
                recv_scales: ms.as_mut().and_then(|m| m.view_mut()),
                recv_topk_idx: mi.as_mut().and_then(|m| m.view_mut()),
                recv_topk_weights: mw.as_mut().and_then(|m| m.view_mut()),
                rank_prefix_matrix: None,
                recv_src_idx: None,
                channels: None,
            };
            let handle = buf.dispatch_into(plan, &args, out)?;
            let rows = buf.alloc(DType::BF16, &[handle.num_recv_rows(), HID])?;
            let mut mo = Made::new(&cx_out, e);
            let mut mcw = cw_out.as_ref().map(|t| Made::new(t, e));
            let Some(o) = mo.view_mut() else { return Ok(()) };
            let rw = buf.alloc(DType::F32, &[handle.num_recv_rows(), K])?;
            buf.combine_into(
                &CombineArgs { x: rows.view(), handle: &handle, topk_weights: Some(rw.view()), bias: [None, None], config: None },
                CombineOutputs { combined_x: o, combined_topk_weights: mcw.as_mut().and_then(|m| m.view_mut()) },
            )
        })?;
    }

    /// Handles, hooks and combine buffers from another buffer (or another call) are refused.
    #[test]
    fn foreign_handles_and_hooks(r in ranks(), which in 0usize..5, cached_x in tensor_near(DType::BF16, vec![T, HID])) {
        check_ranks(r, &["handle", "hook", "x"], |buf| {
            let e = 4 * buf.num_ranks();
            let mut other = Buffer::new(buf.group().clone(), host_options())?;
            let idx = Tensor::from_vec(good_idx(buf.rank(), buf.num_ranks()), &[T, K])?;
            let w = Tensor::from_vec(vec![0.5f32; T * K], &[T, K])?;
            let x = Tensor::from_vec(vec![moelink::bf16::ONE; T * HID], &[T, HID])?;
            let layout = other.get_dispatch_layout(idx.view(), e)?;
            let d = other.dispatch(&DispatchArgs {
                x: Payload::Bf16(x.view()),
                routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: Some(idx.view()), topk_weights: Some(w.view()) },
                expert_alignment: 1,
                num_worst_tokens: 0,
                config: None,
            })?;
            let ll_args = LlDispatchArgs {
                x: x.view(),
                topk_idx: idx.view(),
                topk_weights: None,
                num_max_dispatch_tokens_per_rank: T,
                num_experts: e,
                quant: LlQuant::Bf16,
                return_recv_hook: false,
            };
            let lld = other.low_latency_dispatch(&ll_args)?;
            match which {
                0 => {
                    let m = Made::new(&cached_x, e);
                    let Some(v) = m.view() else { return Ok(()) };
                    buf.dispatch(&DispatchArgs { x: Payload::Bf16(v), routing: Routing::Cached(&d.handle), expert_alignment: 1, num_worst_tokens: 0, config: None })
                        .map(|_| ())
                }
                1 => buf.combine(&CombineArgs { x: d.recv_x.view(), handle: &d.handle, topk_weights: None, bias: [None, None], config: None }).map(|_| ()),
                2 => buf
                    .low_latency_combine(&LlCombineArgs {
                        x: lld.recv_x.view(),
                        topk_idx: idx.view(),
                        topk_weights: w.view(),
                        handle: &lld.handle,
                        zero_copy: false,
                        return_recv_hook: false,
                    })
                    .map(|_| ()),
                3 => buf.get_next_low_latency_combine_buffer(&lld.handle).map(|_| ()),
                _ => {
                    let (el, rows) = (4, buf.num_ranks() * T);
                    let mut rx = Tensor::zeros(DType::BF16, &[el, rows, HID])?;
                    let mut rc = Tensor::zeros(DType::I32, &[el])?;
                    let out = LlDispatchOutputs {
                        recv_x: rx.view_mut(),
                        recv_scales: None,
                        recv_count: rc.view_mut(),
                        cumulative_local_expert_recv_stats: None,
                        dispatch_wait_recv_cost_stats: None,
                        src_info: None,
                        layout_range: None,
                    };
                    let (_, hook) = other.low_latency_dispatch_into(&LlDispatchArgs { return_recv_hook: true, ..ll_args }, out)?;
                    // The other buffer's peers got their exchange in the send phase already: refusing the hook
                    // leaves nobody waiting.
                    buf.run_hook(hook.expect("a hook"))
                }
            }
        })?;
    }

    /// Low-latency dispatch and combine with arbitrary inputs, sizes, quantisation flags and outputs.
    #[test]
    fn low_latency(
        r in ranks(),
        x in tensor_near(DType::BF16, vec![T, 512]),
        idx in tensor_near(DType::I64, vec![T, K]),
        w in prop::option::of(tensor_near(DType::F32, vec![T, K])),
        t_max in size_near(4),
        e_mult in prop_oneof![8 => Just(2usize), 1 => Just(0usize), 1 => Just(1), 1 => Just(3), 1 => Just(1 << 20), 1 => Just(usize::MAX / 2)],
        quant in prop_oneof![
            3 => Just(Ok(LlQuant::Bf16)),
            2 => Just(Ok(LlQuant::Fp8 { round_scale: false, use_ue8m0: false })),
            1 => Just(Ok(LlQuant::Fp8 { round_scale: true, use_ue8m0: false })),
            1 => Just(Ok(LlQuant::Fp8 { round_scale: true, use_ue8m0: true })),
            1 => (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(Err),
        ],
        hook in any::<bool>(),
        into in any::<bool>(),
        outs in (
            tensor_near(DType::BF16, vec![LL_EL, LL_ROWS, 512]),
            prop::option::of((tensor_near(DType::F32, vec![LL_EL, LL_ROWS, 4]), any::<bool>())),
            tensor_near(DType::I32, vec![LL_EL]),
        ),
        stats in (prop::option::of(tensor_near(DType::I32, vec![LL_EL])), prop::option::of(tensor_near(DType::I64, vec![2]))),
        comb in (tensor_near(DType::BF16, vec![LL_EL, LL_ROWS, 512]), tensor_near(DType::I64, vec![T, K]), tensor_near(DType::F32, vec![T, K]), prop_oneof![4 => Just(false), 1 => Just(true)]),
        same_inputs in prop_oneof![3 => Just(true), 1 => Just(false)],
        comb_out in tensor_near(DType::BF16, vec![T, 512]),
    ) {
        check_ranks(r, LL_ARGS, |buf| {
            let e = buf.num_ranks().saturating_mul(e_mult);
            let quant = match quant {
                Ok(q) => q,
                Err((fp8, round, ue8m0)) => match LlQuant::from_flags(fp8, round, ue8m0, buf.rank()) {
                    Ok(q) => q,
                    Err(err) => {
                        assert!(matches!(err, Error::InvalidArgument { arg: "use_fp8" | "use_ue8m0", .. }), "{err}");
                        return Ok(());
                    }
                },
            };
            // Dimensions that depend on the call: local experts, rows per expert; FP8 scale columns.
            let (el, rows) = (e / buf.num_ranks().max(1), buf.num_ranks().saturating_mul(t_max));
            let fill_in = |t: &TSpec| t.resolve(&[(LL_EL, el), (LL_ROWS, rows)]);
            let (mx, mi) = (Made::new(&x, e), Made::new(&idx, e));
            let mw = w.as_ref().map(|t| Made::new(t, e));
            let (Some(xv), Some(iv)) = (mx.view(), mi.view()) else { return Ok(()) };
            let wv = match &mw { Some(m) => match m.view() { Some(v) => Some(v), None => return Ok(()) }, None => None };
            let args = LlDispatchArgs { x: xv, topk_idx: iv, topk_weights: wv, num_max_dispatch_tokens_per_rank: t_max, num_experts: e, quant, return_recv_hook: hook };
            let out_x = TSpec { dtype: if quant.is_fp8() && outs.0.dtype == DType::BF16 { DType::Fp8E4M3 } else { outs.0.dtype }, ..fill_in(&outs.0) };
            let mut rx = Made::new(&out_x, e);
            // Scales: shaped [E_local, rows, cols] with column-major strides (or as drawn), UE8M0 as int32.
            let mut rs = outs.1.as_ref().map(|(t, colmajor)| {
                let mut t = fill_in(t);
                let cols = match quant {
                    LlQuant::Fp8 { use_ue8m0: true, .. } => 1,
                    _ => 4,
                };
                if t.shape.len() == 3 && t.shape[2] == 4 {
                    t.shape[2] = cols;
                }
                if matches!(quant, LlQuant::Fp8 { use_ue8m0: true, .. }) && t.dtype == DType::F32 {
                    t.dtype = DType::I32;
                }
                if *colmajor && t.shape.len() == 3 {
                    let (r, c) = (t.shape[1], t.shape[2]);
                    t.strides = Some(vec![(r.saturating_mul(c)).min(isize::MAX as usize) as isize, 1, r.min(isize::MAX as usize) as isize]);
                }
                Made::new(&t, e)
            });
            let mut rc = Made::new(&fill_in(&outs.2), e);
            let mut s0 = stats.0.as_ref().map(|t| Made::new(&fill_in(t), e));
            let mut s1 = stats.1.as_ref().map(|t| Made::new(t, e));
            let handle = if into {
                let (Some(rxv), Some(rcv)) = (rx.view_mut(), rc.view_mut()) else { return Ok(()) };
                let out = LlDispatchOutputs {
                    recv_x: rxv,
                    recv_scales: rs.as_mut().and_then(|m| m.view_mut()),
                    recv_count: rcv,
                    cumulative_local_expert_recv_stats: s0.as_mut().and_then(|m| m.view_mut()),
                    dispatch_wait_recv_cost_stats: s1.as_mut().and_then(|m| m.view_mut()),
                    src_info: None,
                    layout_range: None,
                };
                let (h, pending) = buf.low_latency_dispatch_into(&args, out)?;
                if let Some(p) = pending {
                    buf.run_hook(p)?;
                }
                h
            } else if hook {
                // The allocating form refuses hooks (the outputs would be gone before the hook ran).
                let e = buf.low_latency_dispatch(&args).err().expect("hooks need the _into form");
                return Err(e);
            } else {
                buf.low_latency_dispatch(&args)?.handle
            };
            let (cx, ci, cw) = (Made::new(&fill_in(&comb.0), e), Made::new(&comb.1, e), Made::new(&comb.2, e));
            let (Some(cxv), Some(civ), Some(cwv)) = (cx.view(), ci.view(), cw.view()) else { return Ok(()) };
            // Mostly the dispatch's own top-k (combine must see the same), sometimes arbitrary ones.
            let (civ, cwv) = match (same_inputs, args.topk_weights) {
                (true, Some(w)) => (iv, w),
                (true, None) => (iv, cwv),
                (false, _) => (civ, cwv),
            };
            let cargs = LlCombineArgs { x: cxv, topk_idx: civ, topk_weights: cwv, handle: &handle, zero_copy: comb.3, return_recv_hook: hook };
            let mut co = Made::new(&comb_out, e);
            let Some(cov) = co.view_mut() else { return Ok(()) };
            let pending = buf.low_latency_combine_into(&cargs, LlCombineOutputs { combined_x: cov, combine_wait_recv_cost_stats: None })?;
            if let Some(p) = pending {
                buf.run_hook(p)?;
            }
            Ok(())
        })?;
    }

    /// The remaining entry points with size or rank arguments (on a second buffer built with arbitrary
    /// options).
    #[test]
    fn buffer_knobs(r in ranks(), t in size_near(4), h in size_near(128), e in size_near(8), rank in size_near(1), masked in any::<bool>(),
                    timeout in prop_oneof![Just(0u64), Just(1_000), Just(u64::MAX)], shrink in any::<bool>()) {
        // Not 1 ms: the new buffer's exchanges (the topology in Buffer::new, the clean's barrier) wait at most
        // timeout_ms, and three threads on a loaded machine miss a 1 ms deadline now and then — a correct
        // Timeout, not the argument error or success this property expects.
        check_ranks(r, &["num_experts", "enable_shrink", "rank", "timeout_ms"], |buf| {
            let _ = Buffer::ht_bytes_needed(t, h, 8, buf.num_ranks(), masked);
            let _ = Buffer::ll_bytes_needed(t, h, buf.num_ranks(), e);
            let opts = BufferOptions { timeout_ms: timeout, enable_shrink: shrink, ..host_options() };
            let mut nb = Buffer::new(buf.group().clone(), opts)?;
            nb.clean_low_latency_buffer(t, h, e)?;
            nb.low_latency_update_mask_buffer(rank, masked)?;
            let mask = nb.low_latency_query_mask_buffer()?;
            assert_eq!(mask.len(), nb.num_ranks());
            nb.low_latency_clean_mask_buffer()
        })?;
    }

    /// Safe tensor constructors never accept a layout reaching past their memory, never panic.
    #[test]
    fn tensor_constructors(shape in prop::collection::vec(dim(), 0..6), strides in prop::collection::vec(stride(), 0..6), len in 0usize..64) {
        let data = vec![0f32; len];
        if let Ok(v) = TensorRef::from_slice_strided(&data, &shape, &strides) {
            prop_assert!(v.host_bytes().map_or(0, |b| b.len()) <= len * 4, "{shape:?} {strides:?} over {len}");
            if let Ok(w) = v.with_layout(&shape, &strides) {
                prop_assert!(w.span_bytes() <= len * 4);
            }
        }
        if let Ok(v) = TensorRef::from_slice(&data, &shape) {
            prop_assert!(v.span_bytes() <= len * 4);
        }
        let bools = vec![false; len];
        if let Ok(v) = TensorRef::from_bools(&bools, &shape) {
            prop_assert!(v.span_bytes() <= len);
        }
        // Owned tensors: a shape whose byte size overflows is an error; small ones work.
        let bytes = if shape.contains(&0) { Some(0) } else { shape.iter().try_fold(4usize, |a, &d| a.checked_mul(d)) };
        match bytes {
            None => prop_assert!(Tensor::zeros(DType::F32, &shape).is_err(), "{shape:?}"),
            Some(b) if b <= 1 << 24 && shape.len() <= moelink::tensor::MAX_DIMS => {
                let mut t = Tensor::zeros(DType::F32, &shape).expect("a small tensor");
                if let Ok(v) = t.view_mut_strided(&shape, &strides) {
                    prop_assert!(v.span_bytes() <= t.numel() * 4);
                }
            }
            Some(_) => {} // valid but too big to allocate here
        }
        let numel = if shape.contains(&0) { Some(0) } else { shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) };
        prop_assert!(Tensor::from_vec(vec![0f32; len], &shape).map_or(true, |_| numel == Some(len)), "{shape:?} from {len}");
    }

    /// The launch environment (torchrun's variables) never panics and names the variable it rejects.
    #[test]
    fn launch_environment(vals in prop::collection::vec(prop_oneof![
            Just(None), Just(Some(String::new())), Just(Some("0".to_string())), Just(Some("3".to_string())),
            Just(Some("65535".to_string())), Just(Some("-1".to_string())), Just(Some("99999999999999999999".to_string())),
            Just(Some(" 7 ".to_string())), Just(Some("localhost".to_string())), ".{0,12}".prop_map(Some)], 8..=8)) {
        let names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOELINK_PORT", "MOELINK_GROUP_TIMEOUT_MS", "UNUSED"];
        let get = |k: &str| names.iter().position(|n| *n == k).and_then(|i| vals[i].clone());
        match TcpConfig::from_lookup(get) {
            Ok(c) => prop_assert!(c.rank < c.size),
            Err(e) => {
                let arg = e.argument().unwrap_or("");
                prop_assert!(names.contains(&arg), "{e}");
            }
        }
    }
}

// ================================================================================================ regressions

/// Bugs the fuzzer found, each as a plain test (the seeds are also in the regression file).
mod regressions {
    use super::*;

    fn one_rank(f: impl Fn(&mut Buffer) -> moelink::Result<()> + Sync, allowed: &[&str]) {
        check_ranks(1, allowed, f).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn a_huge_num_max_dispatch_tokens_is_an_argument_error() {
        one_rank(
            |buf| {
                let x = Tensor::from_vec(vec![moelink::bf16::ONE; 512], &[1, 512])?;
                let idx = Tensor::from_vec(vec![0i64, 1], &[1, 2])?;
                let r = buf.low_latency_dispatch(&LlDispatchArgs {
                    x: x.view(),
                    topk_idx: idx.view(),
                    topk_weights: None,
                    num_max_dispatch_tokens_per_rank: 1 << 40,
                    num_experts: 2,
                    quant: LlQuant::Bf16,
                    return_recv_hook: false,
                });
                assert!(matches!(r, Err(Error::InvalidArgument { arg: "num_max_dispatch_tokens_per_rank", .. })), "{:?}", r.err());
                Ok(())
            },
            LL_ARGS,
        );
    }

    #[test]
    fn huge_sizes_are_argument_errors_not_allocations() {
        // Unchecked, each of these reaches an allocation of terabytes (an abort), or an infinite loop.
        one_rank(
            |buf| {
                let idx = Tensor::from_vec(vec![0i64, 1], &[1, 2])?;
                let e = buf.get_dispatch_layout(idx.view(), 1 << 40).expect_err("2^40 experts");
                assert_eq!(e.argument(), Some("num_experts"), "{e}");
                // A broadcast view: 2^40 tokens backed by two elements.
                let data = [0i64, 1];
                let wide = TensorRef::from_slice_strided(&data, &[1 << 40, 2], &[0, 1])?;
                let e = buf.get_dispatch_layout(wide, 4).expect_err("2^40 tokens");
                assert_eq!(e.argument(), Some("topk_idx"), "{e}");
                let layout = buf.get_dispatch_layout(idx.view(), 4)?;
                let x = Tensor::from_vec(vec![moelink::bf16::ONE; 128], &[1, 128])?;
                for (worst, align) in [(1usize << 40, 1usize), (0, 1 << 40)] {
                    let e = buf
                        .dispatch(&DispatchArgs {
                            x: Payload::Bf16(x.view()),
                            routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
                            expert_alignment: align,
                            num_worst_tokens: worst,
                            config: None,
                        })
                        .err()
                        .expect("absurd sizes");
                    assert!(matches!(e.argument(), Some("num_worst_tokens" | "expert_alignment")), "{e}");
                }
                // Hints saturate instead of overflowing or looping forever.
                assert_eq!(Buffer::ht_bytes_needed(usize::MAX, 7168, 8, 4, false), usize::MAX);
                assert_eq!(Buffer::ht_bytes_needed(1 << 40, 1 << 40, 1 << 40, 1 << 40, true), usize::MAX);
                assert_eq!(Buffer::ll_bytes_needed(usize::MAX, usize::MAX, 8, 288), usize::MAX);
                assert_eq!(Buffer::ll_bytes_needed(4, usize::MAX, 1, 8), usize::MAX);
                let _ = Config::with_sms(usize::MAX).get_nvl_buffer_size_hint(usize::MAX, usize::MAX);
                let _ = Config::with_sms(usize::MAX).get_rdma_buffer_size_hint(usize::MAX, usize::MAX);
                Ok(())
            },
            &["num_experts", "topk_idx", "num_worst_tokens", "expert_alignment"],
        );
    }

    /// `num_worst_tokens` too small on one rank only (it receives more than the others): every rank fails the
    /// call naming it, instead of the others running on into the next exchange and waiting out the deadline.
    #[test]
    fn a_rank_local_overflow_fails_every_rank() {
        let out = moelink::group::run_ranks(2, |g| {
            let mut buf = Buffer::new(Arc::new(g), host_options())?;
            // Every token of both ranks goes to rank 0 (experts 0, 1): rank 0 receives 4 rows, rank 1 none.
            let idx = Tensor::from_vec(vec![0i64, 1, 1, 0], &[2, 2])?;
            let x = Tensor::from_vec(vec![moelink::bf16::ONE; 2 * 128], &[2, 128])?;
            let layout = buf.get_dispatch_layout(idx.view(), 4)?;
            let t0 = std::time::Instant::now();
            let r = buf.dispatch(&DispatchArgs {
                x: Payload::Bf16(x.view()),
                routing: Routing::Fresh { layout: layout.as_ref(), topk_idx: None, topk_weights: None },
                expert_alignment: 1,
                num_worst_tokens: 3,
                config: None,
            });
            assert!(t0.elapsed() < Duration::from_secs(5));
            let e = r.err().expect("rank 0 receives 4 rows into 3");
            assert_eq!(e.argument(), Some("num_worst_tokens"), "{e}");
            assert!(buf.poisoned().is_none());
            Ok(e.to_string())
        });
        let msgs: Vec<String> = out.into_iter().map(|r| r.expect("both ranks fail the call themselves")).collect();
        assert!(msgs[1].contains("rank 0"), "rank 1 names the rank at fault: {}", msgs[1]);
    }

    /// A negative expert count in a caller's layout is an argument error on every rank, not an overflow when
    /// the receivers add it up.
    #[test]
    fn a_negative_expert_count_is_an_argument_error() {
        let out = moelink::group::run_ranks(2, |g| {
            let mut buf = Buffer::new(Arc::new(g), host_options())?;
            let idx = Tensor::from_vec(vec![0i64, 1, 2, 3], &[2, 2])?;
            let x = Tensor::from_vec(vec![moelink::bf16::ONE; 2 * 128], &[2, 128])?;
            let layout = buf.get_dispatch_layout(idx.view(), 4)?;
            let mut per_expert = vec![1i32; 4];
            if buf.rank() == 1 {
                per_expert[0] = -5;
            }
            let per_expert = Tensor::from_vec(per_expert, &[4])?;
            let mut bad = layout.as_ref();
            bad.num_tokens_per_expert = per_expert.view();
            let r = buf.dispatch(&DispatchArgs {
                x: Payload::Bf16(x.view()),
                routing: Routing::Fresh { layout: bad, topk_idx: None, topk_weights: None },
                expert_alignment: 2,
                num_worst_tokens: 0,
                config: None,
            });
            let e = r.err().expect("rank 1's count is negative");
            assert_eq!(e.argument(), Some("num_tokens_per_expert"), "{e}");
            assert!(buf.poisoned().is_none());
            Ok(())
        });
        out.into_iter().for_each(|r| r.expect("both ranks refuse the call"));
    }

    #[test]
    fn an_overflowing_shape_is_refused_by_every_constructor() {
        let data = [0f32; 4];
        assert!(TensorRef::from_slice_strided(&data, &[usize::MAX, 2], &[1, 1]).is_err());
        assert!(TensorRef::from_slice_strided(&data, &[1 << 20, 1 << 20], &[0, 0]).is_ok(), "zero strides alias one element");
        assert!(TensorRef::from_slice_strided(&data, &[1 << 40, 1 << 40], &[0, 0]).is_err(), "too many elements to count");
        assert!(TensorRef::from_slice_strided(&data, &[3, 1 << 62], &[1 << 62, 1]).is_err());
        assert!(Tensor::zeros(DType::F32, &[1 << 40, 1 << 40]).is_err());
        assert!(Tensor::from_vec(Vec::<f32>::new(), &[1 << 32, 1 << 32]).is_err());
        // Empty tensors with a huge other dimension are fine (nothing to count or hold).
        assert_eq!(Tensor::zeros(DType::F32, &[usize::MAX, 0]).unwrap().numel(), 0);
        assert_eq!(Tensor::zeros(DType::F32, &[2, usize::MAX, 0]).unwrap().numel(), 0);
        // ... and have a contiguity answer, not a panic (the expected strides past isize must not overflow).
        let empty = Tensor::zeros(DType::I64, &[0, 8, 1 << 20, 1 << 40]).unwrap();
        let _ = empty.view().is_contiguous();
        let wide = Tensor::zeros(DType::F32, &[usize::MAX - 1, usize::MAX - 2, 0]).unwrap();
        let _ = wide.view().is_contiguous();
    }
}
