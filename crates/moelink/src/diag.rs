//! GPU diagnostics used by `moelink selftest` and `moelink bench nvlink`: symmetric memory across ranks,
//! the cross-GPU barrier, deadlines, NVLink copy bandwidth and JIT timings.
//!
//! Every function is collective over a [`Group`] (except [`jit_timings`]): call it on every rank, in thread
//! mode (`moelink::group::run_ranks`, one thread per GPU) or in process mode (one process per GPU, e.g. a
//! TCP group under torchrun). Peers in the same process are reached through peer pointers, peers in other
//! processes through CUDA IPC; nothing here depends on which.
//!
//! Each call builds a private `DiagRank`: the rank's device, stream, kernels, symmetric memory and error sink. A
//! kernel that gives up on a deadline writes an error record; the host turns it into [`Error::Timeout`]
//! naming the peer, and the `DiagRank` refuses every later operation ([`Error::Poisoned`]), as a `Buffer`
//! does.

use std::time::{Duration, Instant};

use moelink_cuda::jit::{CacheSource, JitCache};
use moelink_cuda::{DevPtr, DevPtrs, Device, DeviceBuffer, Event, Exchange, Kernel, KernelParams, LaunchConfig, Stream, SymmetricBuffer};
use moelink_kernels::abi::{self, BarrierArgs, BarrierLatencyParams, CopyArgs, ErrorRecord, FillPatternParams, VerifyPatternParams};
use moelink_kernels::{all_variants, BarrierVariant, CopyVariant, KernelSpec};

pub(crate) use crate::backend::cuda::errors::{phase_of, ErrorSink};
use crate::error::{Error, Phase, Result};
use crate::group::Group;

/// How the copy primitive moves bytes into peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyMethod {
    /// 16-byte SM stores (`st.global.v4`) into peer memory.
    SmStores,
    /// TMA bulk copies (`cp.async.bulk`) shared → peer global.
    Tma,
}

/// Traffic pattern of a copy measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyPattern {
    /// Rank 0 writes into rank 1.
    Pair,
    /// Every rank writes an equal share into every other rank.
    AllToAll,
    /// Every rank copies within its own memory: the rate of the receivers' local copies, no NVLink.
    Local,
}

/// One bandwidth measurement.
#[derive(Clone, Debug)]
pub struct CopyBandwidth {
    /// Who sends to whom.
    pub pattern: CopyPattern,
    /// How the bytes move.
    pub method: CopyMethod,
    /// Blocks of the copy kernel, one per SM.
    pub num_sms: usize,
    /// Bytes each receiving GPU received per repetition.
    pub bytes_per_gpu: usize,
    /// Median over repetitions of the slowest rank's kernel time.
    pub time_us: f64,
    /// Per-GPU ingress, 1e9 B/s.
    pub gbps: f64,
    /// Every received word matched the pattern.
    pub verified: bool,
}

/// Bytes each rank sends to each peer in [`nvlink_bandwidth`] (256 MiB: long enough to reach the link's
/// ceiling, short enough to keep a sweep within seconds).
pub const BANDWIDTH_BYTES_PER_PEER: usize = 256 << 20;
/// Timed repetitions per bandwidth point (after one warm-up).
pub const BANDWIDTH_REPS: usize = 10;
/// Deadline of every spin-wait of the diagnostic kernels, unless a function takes its own.
pub const DIAG_TIMEOUT_MS: u64 = 10_000;
/// Launches of the barrier latency loop; the result is the median of their slowest ranks.
const LATENCY_LAUNCHES: usize = 5;
/// The host waits this much longer than the kernels' own deadline before it declares a kernel hung.
const HOST_SLACK: Duration = Duration::from_secs(5);

/// Collective: measures the copy primitive writing into peers for each SM count in `sms`, for each method
/// and pattern (results in that nesting order: pattern, method, SMs). One block per SM; data verified after
/// the timed repetitions; time = median over [`BANDWIDTH_REPS`] of the slowest sending rank.
pub fn nvlink_bandwidth(
    group: &dyn Group,
    device: usize,
    sms: &[usize],
    methods: &[CopyMethod],
    patterns: &[CopyPattern],
) -> Result<Vec<CopyBandwidth>> {
    let (rank, n) = (group.rank(), group.size());
    if n < 2 {
        return Err(Error::invalid("group", rank, "NVLink bandwidth needs at least 2 ranks"));
    }
    let bytes = BANDWIDTH_BYTES_PER_PEER;
    let mut d = DiagRank::new(group, device, n * bytes, true, DIAG_TIMEOUT_MS)?;
    let r = d.bandwidth_sweep(bytes, sms, methods, patterns);
    d.finish_collective(r)
}

/// Collective: median round-trip time of the cross-GPU barrier kernel, in microseconds (slowest rank).
pub fn barrier_latency_us(group: &dyn Group, device: usize, iters: usize) -> Result<f64> {
    if iters == 0 || iters > u32::MAX as usize {
        return Err(Error::invalid("iters", group.rank(), format!("{iters} barriers; need 1..=2^32-1")));
    }
    let mut d = DiagRank::new(group, device, 0, false, DIAG_TIMEOUT_MS)?;
    let r = d.barrier_latency(iters);
    d.finish_collective(r)
}

/// Collective: every rank writes a rank-specific pattern into every peer's symmetric buffer; each rank
/// checks what it received. Returns the number of mismatching words seen by this rank (0 = pass).
pub fn symmetric_memory_check(group: &dyn Group, device: usize, bytes_per_peer: usize) -> Result<u64> {
    if bytes_per_peer == 0 || bytes_per_peer % 16 != 0 {
        return Err(Error::invalid("bytes_per_peer", group.rank(), format!("{bytes_per_peer}: must be a positive multiple of 16")));
    }
    let mut d = DiagRank::new(group, device, group.size() * bytes_per_peer, true, DIAG_TIMEOUT_MS)?;
    let r = d.symmetric_check(bytes_per_peer);
    d.finish_collective(r)
}

/// What happened to one rank in the deadline test.
#[derive(Clone, Debug)]
pub struct DeadlineOutcome {
    /// The rank this outcome describes.
    pub rank: usize,
    /// The error the rank got (None for the rank that skipped the barrier).
    pub error: Option<String>,
    /// Peer named by the timeout error.
    pub peer: Option<usize>,
    /// Wall time from launch to the error, ms.
    pub elapsed_ms: f64,
    /// A later operation on the same buffer was refused (poisoned).
    pub refused_afterwards: bool,
}

/// Collective: `skip_rank` does not enter the barrier; every other rank must get a timeout naming a peer
/// within `timeout_ms` (plus slack) and stay alive.
pub fn deadline_check(group: &dyn Group, device: usize, skip_rank: usize, timeout_ms: u64) -> Result<DeadlineOutcome> {
    let (rank, n) = (group.rank(), group.size());
    if skip_rank >= n {
        return Err(Error::invalid("skip_rank", rank, format!("rank {skip_rank} of a {n}-rank group")));
    }
    if timeout_ms == 0 {
        return Err(Error::invalid("timeout_ms", rank, "must be positive"));
    }
    let mut d = DiagRank::new(group, device, 0, false, timeout_ms)?;
    let r = d.deadline(skip_rank);
    d.finish_collective(r)
}

/// JIT time of one kernel variant.
#[derive(Clone, Debug)]
pub struct JitTiming {
    /// The variant (`KernelSpec::variant`), e.g. `copy[sm512x8,tma8192x4x4]`.
    pub kernel: String,
    /// Compile with an empty cache (seconds).
    pub cold_s: f64,
    /// Load from the disk cache (seconds).
    pub cached_s: f64,
    /// Size of the CUBIN.
    pub cubin_bytes: usize,
}

/// The kernel variants [`jit_timings`] compiles: every one the tests and the bench use, except those of the
/// `nvshmem` transport (they compile against an NVSHMEM installation and the CUDA headers, which a machine
/// without NVSHMEM lacks; `moelink-kernels`' `compile_all` covers them where they exist).
fn jit_timed_variants() -> Vec<KernelSpec> {
    use moelink_kernels::transport::Transport;
    all_variants().into_iter().filter(|spec| Transport::of_spec(spec) != Some(Transport::Nvshmem)).collect()
}

/// Compiles every kernel variant the tests and the bench use (but the `nvshmem` transport's, which need an
/// NVSHMEM installation), cold and from cache, for `device`, and loads each CUBIN on it. Uses a fresh
/// temporary cache directory (removed afterwards), not the user's cache.
pub fn jit_timings(device: usize) -> Result<Vec<JitTiming>> {
    let dev = Device::new(device)?;
    let arch = dev.info().arch();
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("moelink-jit-timings-{}-{stamp}", std::process::id()));
    let result = (|| -> Result<Vec<JitTiming>> {
        let mut out = Vec::new();
        for spec in jit_timed_variants() {
            let req = spec.compile_request(&arch);
            let t0 = Instant::now();
            let (cold, src) = JitCache::new(Some(dir.clone())).compile_traced(&req)?;
            let cold_s = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let (warm, src_warm) = JitCache::new(Some(dir.clone())).compile_traced(&req)?;
            let cached_s = t1.elapsed().as_secs_f64();
            if src != CacheSource::Compiled || src_warm != CacheSource::Disk || warm.cubin != cold.cubin {
                return Err(Error::Unavailable(format!(
                    "JIT cache misbehaved for {}: cold run came from {src:?}, second from {src_warm:?}",
                    spec.variant
                )));
            }
            let module = warm.load(&dev)?;
            for k in spec.kernels() {
                module.kernel(k.name)?;
            }
            out.push(JitTiming { kernel: spec.variant.clone(), cold_s, cached_s, cubin_bytes: cold.cubin.len() });
        }
        Ok(out)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

// ================================================================================================ internals

/// The error a kernel's record stands for. A record naming no peer blames the rank itself.
pub(crate) fn timeout_from_record(r: &ErrorRecord) -> Error {
    let peer = if r.peer == abi::NO_PEER { r.rank as usize } else { r.peer as usize };
    Error::Timeout { rank: r.rank as usize, peer, phase: phase_of(r.phase), waited_ms: r.elapsed_ns / 1_000_000 }
}

/// Offset of the data region in the diagnostic symmetric buffer; the barrier region comes first.
const DATA_OFFSET: usize = 4096;

struct CopyKernels {
    variant: CopyVariant,
    sm: Kernel,
    tma: Kernel,
    fill: Kernel,
    verify: Kernel,
}

/// One rank's diagnostic state.
struct DiagRank<'g> {
    group: &'g dyn Group,
    rank: usize,
    size: usize,
    device: Device,
    stream: Stream,
    barrier: Kernel,
    barrier_latency: Kernel,
    copy: Option<CopyKernels>,
    sym: SymmetricBuffer,
    sink: ErrorSink,
    timeout_ns: u64,
    /// Why this object refuses work, after a failure inside a collective.
    poisoned: Option<String>,
}

fn load_kernels(device: &Device, spec: &KernelSpec) -> Result<Vec<Kernel>> {
    let module = JitCache::global().compile(&spec.compile_request(&device.info().arch()))?.load(device)?;
    spec.kernels().iter().map(|k| module.kernel(k.name).map_err(Error::from)).collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

fn seed(src: usize, dst: usize) -> u32 {
    0x5eed_0000 ^ ((src as u32) << 8) ^ dst as u32
}

impl<'g> DiagRank<'g> {
    /// Collective setup: kernels, `data_bytes` of symmetric memory after the barrier region, error sink.
    fn new(group: &'g dyn Group, device: usize, data_bytes: usize, with_copy: bool, timeout_ms: u64) -> Result<DiagRank<'g>> {
        let (rank, size) = (group.rank(), group.size());
        if size > abi::MAX_RANKS {
            return Err(Error::invalid("group", rank, format!("{size} ranks; the diagnostic kernels support at most {}", abi::MAX_RANKS)));
        }
        let dev = Device::new(device)?;
        let stream = Stream::new(&dev)?;
        let mut barrier_kernels = load_kernels(&dev, &BarrierVariant.spec())?.into_iter();
        let (barrier, barrier_latency) = match (barrier_kernels.next(), barrier_kernels.next()) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(Error::Unavailable("the barrier family lost a kernel".into())),
        };
        let copy = if with_copy {
            let variant = CopyVariant::default();
            let mut k = load_kernels(&dev, &variant.spec())?.into_iter();
            let (Some(sm), Some(tma), Some(fill), Some(verify)) = (k.next(), k.next(), k.next(), k.next()) else {
                return Err(Error::Unavailable("the copy family lost a kernel".into()));
            };
            let optin = dev.info().max_shared_memory_per_block_optin as u32;
            sm.set_max_dynamic_smem(optin)?;
            tma.set_max_dynamic_smem(optin)?;
            Some(CopyKernels { variant, sm, tma, fill, verify })
        } else {
            None
        };
        let gather = |b: &[u8]| group.all_gather(b);
        let exchange = Exchange { rank, num_ranks: size, process_key: group.process_key(), all_gather: &gather };
        let sym = SymmetricBuffer::new(&dev, DATA_OFFSET + data_bytes, &exchange)?;
        let sink = ErrorSink::new(&dev)?;
        Ok(DiagRank {
            group,
            rank,
            size,
            device: dev,
            stream,
            barrier,
            barrier_latency,
            copy,
            sym,
            sink,
            timeout_ns: timeout_ms.saturating_mul(1_000_000),
            poisoned: None,
        })
    }

    /// Ends a collective diagnostic: a host barrier so that no rank frees memory a peer may still touch,
    /// then the body's result.
    fn finish_collective<T>(self, body: Result<T>) -> Result<T> {
        let _ = self.stream.synchronize_timeout(Duration::from_nanos(self.timeout_ns) + HOST_SLACK);
        let fence = self.group.barrier();
        let value = body?;
        fence?;
        Ok(value)
    }

    fn copy_kernels(&self) -> Result<&CopyKernels> {
        self.copy.as_ref().ok_or_else(|| Error::Unavailable("copy kernels were not loaded".into()))
    }

    fn ensure_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(cause) => Err(Error::Poisoned { rank: self.rank, cause: cause.clone() }),
            None => Ok(()),
        }
    }

    fn poison<T>(&mut self, e: Error) -> Result<T> {
        self.poisoned = Some(e.to_string());
        Err(e)
    }

    /// Launches `kernel` on this diagnostic's stream. The memory its arguments address (the symmetric buffer
    /// and its peers' mappings, the error sink, the calling method's scratch buffers) stays until `wait` or
    /// Drop has waited for the stream, and peers keep theirs until `finish_collective`'s group barrier.
    fn launch<A: KernelParams>(&self, kernel: &Kernel, cfg: LaunchConfig, args: &A) -> Result<()> {
        kernel.typed::<A>()?.launch(&self.stream, &cfg, args).map_err(Error::from)
    }

    /// Waits for the stream (bounded) and turns an error record into [`Error::Timeout`], poisoning `self`.
    fn wait(&mut self, phase: Phase) -> Result<()> {
        let limit = Duration::from_nanos(self.timeout_ns) * 2 + HOST_SLACK;
        let t0 = Instant::now();
        let done = self.stream.synchronize_timeout(limit)?;
        if let Some(r) = self.sink.check() {
            return self.poison(timeout_from_record(&r));
        }
        if !done {
            let waited_ms = t0.elapsed().as_millis() as u64;
            return self.poison(Error::Timeout { rank: self.rank, peer: self.rank, phase, waited_ms });
        }
        Ok(())
    }

    fn barrier_args(&self) -> BarrierArgs {
        let mut regions = DevPtrs::default();
        for (r, slot) in regions.iter_mut().enumerate().take(self.size) {
            *slot = self.sym.peer_ptr(r);
        }
        BarrierArgs {
            regions,
            error_claim: self.sink.claim_ptr(),
            error_record: self.sink.record_ptr(),
            timeout_ns: self.timeout_ns,
            rank: self.rank as u32,
            num_ranks: self.size as u32,
        }
    }

    /// Enqueues one cross-GPU barrier.
    fn enqueue_barrier(&self) -> Result<()> {
        self.launch(&self.barrier, LaunchConfig::linear(1, BarrierVariant::THREADS), &self.barrier_args())
    }

    /// One barrier, waited for. Refused once poisoned.
    fn barrier(&mut self) -> Result<()> {
        self.ensure_usable()?;
        self.enqueue_barrier()?;
        self.wait(Phase::Barrier)
    }

    fn data_ptr(&self, rank: usize) -> DevPtr {
        self.sym.peer_ptr(rank).byte_add(DATA_OFFSET)
    }

    fn fill(&self, dst: DevPtr, bytes: usize, seed: u32) -> Result<()> {
        let k = self.copy_kernels()?;
        let blocks = (self.device.info().multiprocessors * 4) as u32;
        let args = FillPatternParams { dst, num_vecs: (bytes / 16) as u64, seed, first_word: 0 };
        self.launch(&k.fill, LaunchConfig::linear(blocks, k.variant.pattern_threads), &args)
    }

    /// Enqueues a verification of `bytes` at `src` against `seed`; the counts land in `result[2*slot..]`.
    fn enqueue_verify(&self, src: DevPtr, bytes: usize, seed: u32, result: &DeviceBuffer, slot: usize) -> Result<()> {
        let k = self.copy_kernels()?;
        let blocks = (self.device.info().multiprocessors * 4) as u32;
        let result = result.ptr_at(16 * slot)?;
        let args = VerifyPatternParams { src, num_vecs: (bytes / 16) as u64, seed, first_word: 0, result };
        self.launch(&k.verify, LaunchConfig::linear(blocks, k.variant.pattern_threads), &args)
    }

    /// `slots` verification results, initialised to {0 mismatches, no first index}.
    fn verify_results(&self, slots: usize) -> Result<DeviceBuffer> {
        let init: Vec<u8> = (0..slots).flat_map(|_| [0u64.to_le_bytes(), u64::MAX.to_le_bytes()].concat()).collect();
        Ok(DeviceBuffer::from_host(&self.device, &init)?)
    }

    /// Mismatch counts of each slot (after `wait`).
    fn read_mismatches(&self, result: &DeviceBuffer, slots: usize) -> Result<Vec<u64>> {
        let mut host = vec![0u8; 16 * slots];
        result.copy_to_host(&mut host)?;
        Ok(host.chunks_exact(16).map(|c| u64::from_le_bytes(c[..8].try_into().unwrap_or_default())).collect())
    }

    /// Fills bytes `[offset, offset + bytes)` of this rank's data region with a pattern no check writes.
    fn poison_region(&mut self, offset: usize, bytes: usize) -> Result<()> {
        let mut span = self.sym.local_mut().span_mut(DATA_OFFSET + offset, bytes)?;
        Ok(span.memset_u32_async(0xdead_beef, &self.stream)?)
    }

    // -------------------------------------------------------------------------------------- bodies

    fn symmetric_check(&mut self, bytes_per_peer: usize) -> Result<u64> {
        self.ensure_usable()?;
        let (me, n) = (self.rank, self.size);
        // Slot n re-checks our own slot with a wrong seed (must fail: proves the check can fail).
        let result = self.verify_results(n + 1)?;
        // Poison what we will receive, then make sure every rank has done so before anyone writes.
        self.poison_region(0, n * bytes_per_peer)?;
        self.enqueue_barrier()?;
        // Write our pattern into slot `me` of every rank's buffer, through whatever mapping reaches it.
        for dst in 0..n {
            self.fill(self.data_ptr(dst).byte_add(me * bytes_per_peer), bytes_per_peer, seed(me, dst))?;
        }
        self.enqueue_barrier()?;
        // Check every slot we received.
        for src in 0..n {
            self.enqueue_verify(self.data_ptr(me).byte_add(src * bytes_per_peer), bytes_per_peer, seed(src, me), &result, src)?;
        }
        self.enqueue_verify(self.data_ptr(me).byte_add(me * bytes_per_peer), bytes_per_peer, seed(me, me) ^ 1, &result, n)?;
        self.wait(Phase::Barrier)?;
        let counts = self.read_mismatches(&result, n + 1)?;
        if counts[n] == 0 {
            return Err(Error::Unavailable("the verify kernel accepted data written with another seed; it is broken".into()));
        }
        Ok(counts[..n].iter().sum())
    }

    fn barrier_latency(&mut self, iters: usize) -> Result<f64> {
        self.ensure_usable()?;
        let out = DeviceBuffer::zeroed(&self.device, 8)?;
        let run = |d: &mut Self, iters: u32| -> Result<f64> {
            let args = BarrierLatencyParams { barrier: d.barrier_args(), iters, out_ns: out.device_ptr() };
            d.launch(&d.barrier_latency, LaunchConfig::linear(1, BarrierVariant::THREADS), &args)?;
            d.wait(Phase::Barrier)?;
            let mut ns = [0u8; 8];
            out.copy_to_host(&mut ns)?;
            Ok(u64::from_le_bytes(ns) as f64 / iters as f64 / 1e3)
        };
        run(self, iters.min(100) as u32)?; // warm-up
        let mut per_launch = Vec::with_capacity(LATENCY_LAUNCHES);
        for _ in 0..LATENCY_LAUNCHES {
            let mine = run(self, iters as u32)?;
            let all = gather_f64(self.group, &[mine])?;
            per_launch.push(all.iter().map(|v| v[0]).fold(f64::MIN, f64::max));
        }
        Ok(median(&mut per_launch))
    }

    fn deadline(&mut self, skip_rank: usize) -> Result<DeadlineOutcome> {
        // A barrier everyone joins first: the mechanism works and all epochs agree.
        self.barrier()?;
        self.group.barrier()?;
        let mut outcome = DeadlineOutcome { rank: self.rank, error: None, peer: None, elapsed_ms: 0.0, refused_afterwards: false };
        if self.rank == skip_rank {
            return Ok(outcome);
        }
        let t0 = Instant::now();
        let r = self.barrier();
        outcome.elapsed_ms = t0.elapsed().as_secs_f64() * 1e3;
        match r {
            Ok(()) => {}
            Err(e) => {
                if let Error::Timeout { peer, .. } = &e {
                    outcome.peer = Some(*peer);
                }
                outcome.error = Some(e.to_string());
            }
        }
        // The same object must now refuse work instead of running a barrier with stale epochs.
        outcome.refused_afterwards = matches!(self.barrier(), Err(Error::Poisoned { .. }));
        Ok(outcome)
    }

    fn bandwidth_sweep(
        &mut self,
        bytes: usize,
        sms: &[usize],
        methods: &[CopyMethod],
        patterns: &[CopyPattern],
    ) -> Result<Vec<CopyBandwidth>> {
        self.ensure_usable()?;
        let (me, n) = (self.rank, self.size);
        // Send buffer: slice `dst` holds the pattern rank `dst` must receive from us.
        let send = DeviceBuffer::alloc(&self.device, n * bytes)?;
        for dst in 0..n {
            self.fill(send.ptr_at(dst * bytes)?, bytes, seed(me, dst))?;
        }
        self.wait(Phase::Other)?;
        let mut events = Vec::with_capacity(2 * (BANDWIDTH_REPS + 1));
        for _ in 0..2 * (BANDWIDTH_REPS + 1) {
            events.push(Event::new(&self.device, true)?);
        }
        let mut out = Vec::new();
        for &pattern in patterns {
            // Who sends to whom.
            let dests: Vec<usize> = match pattern {
                CopyPattern::Pair if me == 0 => vec![1],
                CopyPattern::Pair => vec![],
                CopyPattern::AllToAll => (0..n).filter(|&d| d != me).collect(),
                CopyPattern::Local => vec![me],
            };
            let sources: Vec<usize> = match pattern {
                CopyPattern::Pair if me == 1 => vec![0],
                CopyPattern::Pair => vec![],
                CopyPattern::AllToAll => (0..n).filter(|&s| s != me).collect(),
                CopyPattern::Local => vec![me],
            };
            let bytes_per_gpu = match pattern {
                CopyPattern::Pair | CopyPattern::Local => bytes,
                CopyPattern::AllToAll => (n - 1) * bytes,
            };
            for &method in methods {
                for &num_sms in sms {
                    let point = self.bandwidth_point(&send, bytes, &dests, &sources, method, num_sms, &events)?;
                    let all = gather_f64(self.group, &point)?;
                    let senders: Vec<&Vec<f64>> = all.iter().filter(|v| v[0] > 0.0).collect();
                    let mut slowest: Vec<f64> = (0..BANDWIDTH_REPS)
                        .map(|i| senders.iter().map(|v| v.get(2 + i).copied().unwrap_or(f64::NAN)).fold(0.0, f64::max))
                        .collect();
                    let time_us = median(&mut slowest);
                    let verified = all.iter().all(|v| v[1] == 0.0);
                    out.push(CopyBandwidth {
                        pattern,
                        method,
                        num_sms,
                        bytes_per_gpu,
                        time_us,
                        gbps: bytes_per_gpu as f64 / (time_us * 1e-6) / 1e9,
                        verified,
                    });
                }
            }
        }
        Ok(out)
    }

    /// One (pattern, method, SMs) point on this rank. Returns `[is_sender, mismatches, t_0 .. t_REPS (us)]`.
    #[allow(clippy::too_many_arguments)]
    fn bandwidth_point(
        &mut self,
        send: &DeviceBuffer,
        bytes: usize,
        dests: &[usize],
        sources: &[usize],
        method: CopyMethod,
        num_sms: usize,
        events: &[Event],
    ) -> Result<Vec<f64>> {
        let me = self.rank;
        let k = self.copy_kernels()?;
        let info = self.device.info();
        let blocks = num_sms.clamp(1, info.multiprocessors) as u32;
        // More than half of the SM's shared memory per block: at most one block per SM, so blocks = SMs.
        let one_per_sm = (info.max_shared_memory_per_block_optin / 2 + 1024) as u32;
        let (kernel, cfg) = match method {
            CopyMethod::SmStores => (&k.sm, LaunchConfig::linear(blocks, k.variant.sm_threads).with_dynamic_smem(one_per_sm)),
            CopyMethod::Tma => (
                &k.tma,
                LaunchConfig::linear(blocks, k.variant.tma_threads()).with_dynamic_smem(k.variant.tma_smem_bytes().max(one_per_sm)),
            ),
        };
        let mut args = CopyArgs {
            bytes_per_peer: bytes as u64,
            error_claim: self.sink.claim_ptr(),
            error_record: self.sink.record_ptr(),
            timeout_ns: self.timeout_ns,
            num_peers: dests.len() as u32,
            rank: me as u32,
            ..CopyArgs::default()
        };
        for (i, &dst) in dests.iter().enumerate() {
            args.src[i] = send.ptr_at(dst * bytes)?;
            args.dst[i] = self.data_ptr(dst).byte_add(me * bytes);
            args.dst_rank[i] = dst as u32;
        }
        let kargs = args;
        let result = self.verify_results(sources.len().max(1))?;
        let (kernel, cfg) = (kernel.clone(), cfg);
        // Poison what we receive; a barrier makes sure nobody writes before everyone has.
        for &src in sources {
            self.poison_region(src * bytes, bytes)?;
        }
        self.enqueue_barrier()?;
        for rep in 0..=BANDWIDTH_REPS {
            // Each repetition starts from a barrier, so the ranks' copies overlap as in a real all-to-all.
            self.enqueue_barrier()?;
            if !dests.is_empty() {
                events[2 * rep].record(&self.stream)?;
                self.launch(&kernel, cfg, &kargs)?;
                events[2 * rep + 1].record(&self.stream)?;
            }
        }
        self.enqueue_barrier()?;
        for (slot, &src) in sources.iter().enumerate() {
            self.enqueue_verify(self.data_ptr(me).byte_add(src * bytes), bytes, seed(src, me), &result, slot)?;
        }
        self.wait(Phase::Other)?;
        let bad: u64 = if sources.is_empty() { 0 } else { self.read_mismatches(&result, sources.len())?.iter().sum() };
        let mut point = vec![if dests.is_empty() { 0.0 } else { 1.0 }, bad as f64];
        if !dests.is_empty() {
            for rep in 1..=BANDWIDTH_REPS {
                point.push(events[2 * rep].elapsed_ms(&events[2 * rep + 1])? as f64 * 1e3);
            }
        }
        Ok(point)
    }
}

impl Drop for DiagRank<'_> {
    fn drop(&mut self) {
        // Kernels have deadlines, so this returns; only then may the memory they use be freed.
        let _ = self.stream.synchronize_timeout(Duration::from_nanos(self.timeout_ns) * 2 + HOST_SLACK);
    }
}

/// All-gathers a list of f64 per rank.
fn gather_f64(group: &dyn Group, values: &[f64]) -> Result<Vec<Vec<f64>>> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = group.all_gather(&bytes)?;
    all.iter()
        .enumerate()
        .map(|(r, b)| {
            if b.len() % 8 != 0 || b.is_empty() {
                return Err(Error::Group { rank: group.rank(), reason: format!("rank {r} sent {} bytes of measurements", b.len()) });
            }
            Ok(b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default())).collect())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_map_to_the_core_enum() {
        assert_eq!(phase_of(abi::phase::BARRIER), Phase::Barrier);
        assert_eq!(phase_of(abi::phase::LL_COMBINE), Phase::LowLatencyCombine);
        assert_eq!(phase_of(abi::phase::COPY), Phase::Other);
        assert_eq!(phase_of(999), Phase::Other);
    }

    #[test]
    fn an_error_record_becomes_a_timeout_naming_the_peer() {
        let r =
            ErrorRecord { code: abi::ERR_TIMEOUT, rank: 2, peer: 3, phase: abi::phase::BARRIER, elapsed_ns: 1_500_000_000, timeout_ns: 0 };
        match timeout_from_record(&r) {
            Error::Timeout { rank: 2, peer: 3, phase: Phase::Barrier, waited_ms: 1500 } => {}
            e => panic!("{e:?}"),
        }
        let r = ErrorRecord { peer: abi::NO_PEER, ..r };
        assert!(matches!(timeout_from_record(&r), Error::Timeout { rank: 2, peer: 2, .. }));
    }

    #[test]
    fn seeds_differ_for_every_pair() {
        let mut seen = std::collections::HashSet::new();
        for s in 0..abi::MAX_RANKS {
            for d in 0..abi::MAX_RANKS {
                assert!(seen.insert(seed(s, d)));
            }
        }
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    /// Without a GPU every diagnostic is a typed error, not a panic.
    #[test]
    fn diagnostics_without_a_gpu_are_errors() {
        if moelink_cuda::driver_available().is_ok() {
            return;
        }
        let out = crate::group::run_ranks(2, |g| symmetric_memory_check(&g, g.rank(), 4096));
        for r in out {
            assert!(matches!(r, Err(Error::Unavailable(_))), "{r:?}");
        }
        assert!(matches!(jit_timings(0), Err(Error::Unavailable(_))));
    }
}
