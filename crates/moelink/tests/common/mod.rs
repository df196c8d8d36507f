//! Shared test harness: one test body runs on every backend (host always; CUDA when a GPU is present),
//! plus seeded routing generators. Bodies get the backend kind and run on `num_ranks` threads.
#![allow(dead_code)]

use std::sync::Arc;

use moelink::{bf16, group::run_ranks, BackendKind, Buffer, BufferOptions, Result, Tensor, ThreadGroup};

/// Expands `fn name(kind: BackendKind) { ... }` bodies into `host::name` (always runs) and `cuda::name`
/// (skips, printing why, when the CUDA backend cannot start for enough GPUs).
#[macro_export]
macro_rules! backend_tests {
    ($(fn $name:ident($kind:ident : BackendKind) $body:block)*) => {
        $(fn $name($kind: moelink::BackendKind) $body)*
        mod host {
            $(#[test] fn $name() { super::$name(moelink::BackendKind::Host) })*
        }
        mod cuda {
            $(#[test] fn $name() {
                if let Some(why) = $crate::common::cuda_skip_reason() {
                    eprintln!("skipping cuda::{}: {why}", stringify!($name));
                    return;
                }
                super::$name(moelink::BackendKind::Cuda)
            })*
        }
    };
}

/// Why CUDA tests cannot run here, or `None` when they can (`MOELINK_TEST_CUDA=1` and a GPU is present).
pub fn cuda_skip_reason() -> Option<String> {
    if std::env::var("MOELINK_TEST_CUDA").ok().as_deref() != Some("1") {
        return Some("set MOELINK_TEST_CUDA=1 to run GPU tests (needs a CUDA GPU)".into());
    }
    None
}

/// Ranks used for CUDA tests: at most the number of GPUs (`MOELINK_TEST_GPUS`, default 1).
pub fn max_ranks(kind: BackendKind) -> usize {
    match kind {
        BackendKind::Cuda => std::env::var("MOELINK_TEST_GPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(1),
        _ => 8,
    }
}

/// Serialises the multi-GPU parts of the tests of one binary. Each rank's collective kernels spin on the
/// GPU until every peer's kernel has run; kernels of two tests interleaving on the same GPUs could each
/// hold the SMs the other's peers need, and every rank would wait out its deadline.
pub fn cuda_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs `f` on `num_ranks` threads, each with a fresh buffer of `kind`; panics with the first rank error.
/// CUDA runs hold [`cuda_lock`].
pub fn with_buffers<T: Send>(
    kind: BackendKind,
    num_ranks: usize,
    opts: BufferOptions,
    f: impl Fn(&mut Buffer) -> Result<T> + Sync,
) -> Vec<T> {
    let _gpus = (kind != BackendKind::Host).then(cuda_lock);
    let out = run_ranks(num_ranks, |g: ThreadGroup| {
        let mut buf = Buffer::new(Arc::new(g), BufferOptions { backend: kind, ..opts.clone() })?;
        f(&mut buf)
    });
    out.into_iter().enumerate().map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

/// Whether another rank of `buf`'s group has its buffer on the same GPU (ranks sharing a GPU: the tests
/// run with more ranks than GPUs, `MOELINK_TEST_GPUS`). Collective.
pub fn shares_gpu(buf: &Buffer) -> Result<bool> {
    let here = buf.location().to_string();
    let all = buf.group().all_gather(here.as_bytes())?;
    Ok(all.iter().enumerate().any(|(r, l)| r != buf.rank() && l.as_slice() == here.as_bytes() && here != "cpu"))
}

/// Default options for tests: room for the sizes the tests use, and what the environment asks for (the
/// harness is an edge: the library reads no variable) — the `moelink` command's tracing and tuning
/// variables (`MOELINK_LL_SMS=64` on the GPU machine, for instance) and the JIT's `MOELINK_CACHE_DIR` /
/// `MOELINK_JIT_VERBOSE`.
pub fn test_options() -> BufferOptions {
    let env = |k: &str| std::env::var(k).ok();
    fn print_report(line: &str) {
        eprintln!("{line}");
    }
    // The first call in a test binary sets the JIT's settings; later calls find them set.
    let _ = moelink_cuda::jit::configure(moelink_cuda::jit::JitSettings::from_vars(env, print_report));
    // MOELINK_TEST_TIMEOUT_MS shortens the kernels' deadline on the GPU machine, so a protocol bug costs
    // seconds of the lease, not minutes.
    let timeout_ms = std::env::var("MOELINK_TEST_TIMEOUT_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    BufferOptions {
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes: 1 << 30,
        low_latency_mode: true,
        timeout_ms,
        kernel_tracing: moelink::KernelTracing::from_vars(env).expect("the tracing variables"),
        tuning: moelink::Tuning::from_vars(env).expect("the tuning variables"),
        ..Default::default()
    }
}

/// A small, seeded generator (splitmix64) so every rank and backend sees the same inputs.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// How tokens pick experts.
#[derive(Clone, Copy, Debug)]
pub enum RoutingKind {
    /// Scores |randn| + 1, top-k (DeepEP's benchmark routing).
    Uniform,
    /// Most tokens pick expert 0 and its neighbours: one rank receives nearly everything.
    Skewed,
    /// Uniform, then each slot is -1 with probability 1/4.
    WithHoles,
    /// Uniform over the experts of ranks other than `empty_rank`, which receives nothing.
    EmptyRank(usize),
}

/// `topk_idx [T, K]` row-major for one rank.
pub fn routing(rng: &mut Rng, kind: RoutingKind, num_tokens: usize, topk: usize, num_experts: usize, num_ranks: usize) -> Vec<i64> {
    let el = num_experts / num_ranks;
    let mut out = Vec::with_capacity(num_tokens * topk);
    for _ in 0..num_tokens {
        let mut scores: Vec<(f64, usize)> = (0..num_experts).map(|e| (rng.normal().abs() + 1.0, e)).collect();
        match kind {
            // The guard draws only for skewed routing, as before.
            RoutingKind::Skewed if rng.uniform() < 0.9 => {
                for (s, e) in scores.iter_mut() {
                    if *e < topk {
                        *s += 100.0;
                    }
                }
            }
            RoutingKind::EmptyRank(r) => {
                for (s, e) in scores.iter_mut() {
                    if *e / el == r {
                        *s = -1.0;
                    }
                }
            }
            _ => {}
        }
        scores.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        for &(s, e) in scores.iter().take(topk) {
            let hole = matches!(kind, RoutingKind::WithHoles) && rng.below(4) == 0;
            out.push(if s < 0.0 || hole { -1 } else { e as i64 });
        }
    }
    out
}

/// Random bf16 values in roughly [-2, 2], never all zero.
pub fn random_bf16(rng: &mut Rng, n: usize) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f64(rng.normal())).collect()
}

/// Random positive weights.
pub fn random_weights(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform() as f32 + 0.01).collect()
}

/// A host tensor uploaded to the buffer's location.
pub fn on(buf: &Buffer, t: Tensor) -> Tensor {
    buf.upload(&t).expect("upload")
}
