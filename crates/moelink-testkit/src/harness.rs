//! The test harness: one test body run on every backend, buffers on threads, and what a test may ask of the
//! machine it runs on.
//!
//! - [`backend_tests!`](crate::backend_tests) expands a body into `host::name` (always runs) and
//!   `cuda::name`, which is `#[ignore]`d: without a GPU `cargo test` lists it as ignored, not passed; on a
//!   GPU machine `cargo test -- --include-ignored` (or a test executable run with `--include-ignored`) runs
//!   it. Stand-alone GPU tests carry the same attribute.
//! - A CUDA test runs with as many ranks as `MOELINK_TEST_RANKS` allows (default 1; ranks beyond the GPUs
//!   share them, rank r on GPU r % count). A test that needs more is skipped with a line on the process's
//!   stderr, which `cargo test` shows even for passing tests: [`ranks`], [`ranks_up_to`].
//! - `MOELINK_TEST_TIMEOUT_MS` shortens the buffers' deadline (default 20 s), so that a protocol bug costs
//!   seconds of a GPU lease, not minutes; the `moelink` command's tracing, tuning and JIT variables apply
//!   to the tests' buffers too ([`test_options`]).

use std::io::Write;
use std::sync::Arc;

use moelink::{group::run_ranks, BackendKind, Buffer, BufferOptions, Error, Result, Tensor, ThreadGroup};

/// Expands `fn name(kind: BackendKind) { ... }` bodies into `host::name` (always runs) and `cuda::name`
/// (ignored unless included: `--include-ignored` on a GPU machine).
#[macro_export]
macro_rules! backend_tests {
    ($($(#[$meta:meta])* fn $name:ident($kind:ident : BackendKind) $body:block)*) => {
        $($(#[$meta])* fn $name($kind: moelink::BackendKind) $body)*
        mod host {
            $(#[test] fn $name() { super::$name(moelink::BackendKind::Host) })*
        }
        mod cuda {
            $(
                #[test]
                #[ignore = "needs a CUDA GPU: run with --include-ignored"]
                fn $name() { super::$name(moelink::BackendKind::Cuda) }
            )*
        }
    };
}

/// Says on the process's stderr (not the test's captured output, so `cargo test` shows it whether the test
/// passes or fails) that the running test skips the rest of its body, and why.
pub fn skip(reason: &str) {
    let name = std::thread::current().name().unwrap_or("a test").to_string();
    let _ = writeln!(std::io::stderr(), "skipping {name}: {reason}");
}

/// Ranks a test may use on `kind`: any number on the host backend, `MOELINK_TEST_RANKS` on CUDA (default 1).
pub fn available_ranks(kind: BackendKind) -> usize {
    match kind {
        BackendKind::Host => usize::MAX,
        _ => std::env::var("MOELINK_TEST_RANKS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(1),
    }
}

/// `wanted` ranks when `kind` has them; otherwise `None` after [`skip`] said so.
pub fn ranks(kind: BackendKind, wanted: usize) -> Option<usize> {
    let have = available_ranks(kind);
    if wanted > have {
        skip(&format!("needs {wanted} ranks, MOELINK_TEST_RANKS={have}"));
        return None;
    }
    Some(wanted)
}

/// At most `max` ranks, as many as `kind` has, saying so on stderr when that is fewer than `max` (for tests
/// whose body fits any rank count).
pub fn ranks_up_to(kind: BackendKind, max: usize) -> usize {
    let have = available_ranks(kind);
    if have < max {
        let _ = writeln!(std::io::stderr(), "note: {} runs with {have} of {max} ranks (MOELINK_TEST_RANKS)", thread_name());
    }
    have.min(max).max(1)
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("a test").to_string()
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

/// A peer that never calls, without and with shrink mode: on `ranks` buffers of `opts` (its backend, its
/// deadline) every rank but `silent` runs `round`. Without shrink mode each must fail with a timeout naming
/// `silent`; with it, each must mask `silent`, finish, and get what the host backend gets with the same mask
/// (`round` on host buffers of [`test_options`]). Every rank waits for the others before freeing its buffer,
/// as a rank's kernels may still write into a peer's.
pub fn check_silent_peer<T>(ranks: usize, silent: usize, opts: &BufferOptions, round: impl Fn(&mut Buffer) -> Result<T> + Sync)
where
    T: PartialEq + std::fmt::Debug + Send,
{
    for shrink in [false, true] {
        let opts = BufferOptions { enable_shrink: shrink, ..opts.clone() };
        let gpus = cuda_lock();
        let results = run_ranks(ranks, |g: ThreadGroup| -> Result<Option<(Result<T>, Vec<bool>)>> {
            let group: Arc<ThreadGroup> = Arc::new(g);
            let mut buf = Buffer::new(group.clone(), opts.clone())?;
            let r = if buf.rank() == silent {
                None
            } else {
                let seen = round(&mut buf);
                let mask = if shrink { buf.low_latency_query_mask_buffer()? } else { Vec::new() };
                Some((seen, mask))
            };
            moelink::Group::barrier(group.as_ref())?;
            Ok(r)
        });
        drop(gpus);
        let want = shrink.then(|| {
            with_buffers(BackendKind::Host, ranks, BufferOptions { enable_shrink: true, ..test_options() }, |buf| {
                buf.low_latency_update_mask_buffer(silent, true)?;
                round(buf)
            })
        });
        for (me, r) in results.into_iter().enumerate() {
            let r = r.unwrap_or_else(|e| panic!("rank {me}: {e}"));
            let Some((seen, mask)) = r else { continue };
            if shrink {
                let seen = seen.unwrap_or_else(|e| panic!("rank {me}: shrink mode should finish the call, got {e}"));
                assert_eq!(mask, (0..ranks).map(|r| r == silent).collect::<Vec<_>>(), "rank {me}: mask");
                assert_eq!(
                    seen,
                    want.as_ref().expect("the host run")[me],
                    "rank {me}: shrink-mode results differ from the host backend with the same mask"
                );
            } else {
                match seen {
                    Err(Error::Timeout { peer, .. }) => assert_eq!(peer, silent, "rank {me}: the timeout should name rank {silent}"),
                    other => panic!("rank {me}: expected a timeout naming rank {silent}, got {other:?}"),
                }
            }
        }
    }
}

/// Whether another rank of `buf`'s group has its buffer on the same GPU (ranks sharing a GPU: more ranks
/// than GPUs). Collective.
pub fn shares_gpu(buf: &Buffer) -> Result<bool> {
    let here = buf.location().to_string();
    let all = buf.group().all_gather(here.as_bytes())?;
    Ok(all.iter().enumerate().any(|(r, l)| r != buf.rank() && l.as_slice() == here.as_bytes() && here != "cpu"))
}

/// Buffer options for tests: room for the sizes the tests use, the deadline of `MOELINK_TEST_TIMEOUT_MS`, and
/// what the environment asks for (the harness is an edge: the library reads no variable) — the `moelink`
/// command's tracing and tuning variables (`MOELINK_LL_SMS=64` on the GPU machine, for instance) and the
/// JIT's `MOELINK_CACHE_DIR` / `MOELINK_JIT_VERBOSE`.
pub fn test_options() -> BufferOptions {
    let env = |k: &str| std::env::var(k).ok();
    fn print_report(line: &str) {
        eprintln!("{line}");
    }
    // The first call in a test binary sets the JIT's settings; later calls find them set.
    let _ = moelink_cuda::jit::configure(moelink_cuda::jit::JitSettings::from_vars(env, print_report));
    let timeout_ms = env("MOELINK_TEST_TIMEOUT_MS").and_then(|v| v.parse().ok()).unwrap_or(20_000);
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

/// A host tensor uploaded to the buffer's location.
pub fn on(buf: &Buffer, t: Tensor) -> Tensor {
    buf.upload(&t).expect("upload")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_backend_has_every_rank_count() {
        assert_eq!(ranks(BackendKind::Host, 8), Some(8));
        assert_eq!(ranks_up_to(BackendKind::Host, 4), 4);
    }
}
