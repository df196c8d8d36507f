//! Diagnostics of the RDMA transport seam on this machine's GPUs: the conformance check ([`check`]: every
//! byte of random messages between random peers on random QPs arrives before its signal) and the
//! micro-benchmark ([`bench()`]: put and put+signal latency, put and put+signal bandwidth). Both are
//! collective and run the kernels of `moelink-kernels/cuda/transport.cu` on a fresh RDMA domain; `moelink
//! selftest` and `moelink bench transport` call them, as do the GPU tests.
//!
//! Ranks that share a GPU (thread mode, or processes under CUDA MPS) measure the GPU's own memory, not a
//! network: such figures say that the seam works, not how fast a NIC is.

use std::time::{Duration, Instant};

use moelink_cuda::jit::JitCache;
use moelink_cuda::{Device, DeviceBuffer, Kernel, KernelParams, LaunchConfig, Stream};
use moelink_kernels::transport::{
    TransportBenchArgs, TransportCheckArgs, TransportVariant, BENCH_BANDWIDTH, BENCH_LATENCY, CHECK_PLANTED_BUG, CHECK_PUT_FENCE_SIGNAL,
    CHECK_PUT_SIGNAL, TRANSPORT_SIGNAL_BYTES, TRANSPORT_THREADS,
};

use crate::backend::cuda::gpu::ModuleLinker;
use crate::backend::cuda::internode::rdma::RdmaDomain;
use crate::diag::{timeout_from_record, ErrorSink};
use crate::error::{Error, Phase, Result};
use crate::group::Group;
use crate::internode::RdmaOptions;

/// How the check orders each message's data and its signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckMode {
    /// One put_signal: the signal rides with the data.
    PutSignal,
    /// A put on one QP, a fence, the signal on another QP.
    PutFenceSignal,
    /// A put on one QP and its signal on another, without a fence: wrong on purpose. The emulated NIC must
    /// report wrong bytes; peer pointers, and often a real NIC, let it pass.
    PlantedBug,
}

impl CheckMode {
    fn code(self) -> u32 {
        match self {
            CheckMode::PutSignal => CHECK_PUT_SIGNAL,
            CheckMode::PutFenceSignal => CHECK_PUT_FENCE_SIGNAL,
            CheckMode::PlantedBug => CHECK_PLANTED_BUG,
        }
    }
}

/// What [`check`] runs.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The transport and its settings (`num_qps_per_rank` QPs are used).
    pub rdma: RdmaOptions,
    /// How data and signal are ordered.
    pub mode: CheckMode,
    /// Launches, each with new messages.
    pub rounds: u32,
    /// Messages each rank sends per round (to random peers, itself included).
    pub messages: u32,
    /// Largest message in bytes (sizes are uniform in `1..=max_bytes`).
    pub max_bytes: u32,
    /// Worker blocks per launch.
    pub blocks: u32,
    /// Deadline of every wait, ms.
    pub timeout_ms: u64,
    /// Seed of the messages.
    pub seed: u32,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            rdma: RdmaOptions::default(),
            mode: CheckMode::PutSignal,
            rounds: 4,
            messages: 256,
            max_bytes: 9000,
            blocks: 4,
            timeout_ms: 10_000,
            seed: 2026,
        }
    }
}

/// What [`check`] saw on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckReport {
    /// This rank.
    pub rank: usize,
    /// Messages this rank received over all rounds.
    pub messages_received: u64,
    /// Bytes found wrong once their message's signal had arrived (0 for a correct transport and protocol).
    pub wrong_bytes: u64,
}

/// One rank's kernels, stream and error sink over a fresh RDMA domain.
struct Probe {
    device: Device,
    stream: Stream,
    domain: RdmaDomain,
    sink: ErrorSink,
    check: Kernel,
    bench: Kernel,
    timeout_ns: u64,
    rank: usize,
}

impl Probe {
    fn new(group: &dyn Group, device: usize, rdma: &RdmaOptions, region_bytes: usize, timeout_ms: u64) -> Result<Probe> {
        let device = Device::new(device)?;
        device.bind_to_thread()?;
        let stream = Stream::new(&device)?;
        let domain = RdmaDomain::new(&device, group, rdma, region_bytes)?;
        let spec = TransportVariant { transport: rdma.transport.kernel_transport() }.spec();
        let compiled = JitCache::global().compile(&domain.compile_request(&spec, &device.info().arch())?)?;
        let module = compiled.load_shared(&device)?;
        domain.register(&module)?;
        Ok(Probe {
            check: module.kernel("transport_check")?,
            bench: module.kernel("transport_bench")?,
            sink: ErrorSink::new(&device)?,
            timeout_ns: timeout_ms.saturating_mul(1_000_000),
            rank: group.rank(),
            stream,
            domain,
            device,
        })
    }

    /// Launches `kernel` cooperatively on `blocks` workers (+ the emulated NIC's blocks) and waits for it.
    /// The memory `args` addresses (the domain's region and peers' mappings, the error sink, the caller's
    /// result buffers) stays until the synchronisation here.
    fn run<A: KernelParams>(&self, kernel: &Kernel, blocks: u32, args: &A) -> Result<()> {
        let cfg = LaunchConfig::linear(blocks + self.domain.nic_blocks(), TRANSPORT_THREADS).with_cooperative();
        kernel.typed::<A>()?.launch(&self.stream, &cfg, args)?;
        let limit = Duration::from_nanos(self.timeout_ns) * 2 + Duration::from_secs(5);
        let t0 = Instant::now();
        let done = self.stream.synchronize_timeout(limit)?;
        if let Some(r) = self.sink.check() {
            return Err(timeout_from_record(&r));
        }
        if !done {
            return Err(Error::Timeout {
                rank: self.rank,
                peer: self.rank,
                phase: Phase::Transport,
                waited_ms: t0.elapsed().as_millis() as u64,
            });
        }
        Ok(())
    }

    /// Ends a collective probe: on success a group barrier (no rank frees its region while a peer may still
    /// put into it) and the value; on failure, of the body or of that barrier, the region is leaked instead
    /// (a peer may still be inside the launch that failed here, or gone: its collective free would wait).
    fn finish<T>(self, group: &dyn Group, body: Result<T>) -> Result<T> {
        match body.and_then(|v| group.barrier().map(|()| v)) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.domain.leak();
                std::mem::forget(self.sink);
                Err(e)
            }
        }
    }

    fn read_u64s(buf: &DeviceBuffer, n: usize) -> Result<Vec<u64>> {
        let mut bytes = vec![0u8; 8 * n];
        buf.copy_to_host(&mut bytes)?;
        Ok(bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }
}

/// Runs the conformance check on every rank of `group` (collective; `device` is this rank's GPU).
pub fn check(group: &dyn Group, device: usize, o: &CheckOptions) -> Result<CheckReport> {
    let rank = group.rank();
    if o.messages == 0 || o.max_bytes == 0 || o.blocks == 0 || o.rounds == 0 {
        return Err(Error::invalid("check", rank, "rounds, messages, max_bytes and blocks must be positive"));
    }
    let n = group.size();
    let region = TransportCheckArgs::region_bytes(n, o.messages as usize, o.max_bytes as usize);
    let probe = Probe::new(group, device, &o.rdma, region, o.timeout_ms)?;
    let mismatches = DeviceBuffer::zeroed(&probe.device, 8)?;
    let expected = DeviceBuffer::zeroed(&probe.device, 8 * n)?;
    let body = (|| -> Result<CheckReport> {
        for round in 0..o.rounds {
            let args = TransportCheckArgs {
                rdma: probe.domain.args(),
                error_claim: probe.sink.claim_ptr(),
                error_record: probe.sink.record_ptr(),
                timeout_ns: probe.timeout_ns,
                mismatches: mismatches.device_ptr(),
                expected: expected.device_ptr(),
                seed: o.seed,
                round,
                messages: o.messages,
                max_bytes: o.max_bytes,
                slot_bytes: o.max_bytes.next_multiple_of(16),
                mode: o.mode.code(),
            };
            probe.run(&probe.check, o.blocks, &args)?;
            // A rank one round ahead would put the next round's messages into slots its peers may still
            // be checking.
            group.barrier()?;
        }
        let wrong_bytes = Probe::read_u64s(&mismatches, 1)?[0];
        let messages_received = Probe::read_u64s(&expected, n)?.iter().sum();
        Ok(CheckReport { rank, messages_received, wrong_bytes })
    })();
    probe.finish(group, body)
}

/// What [`bench()`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchMode {
    /// Ping-pong between ranks `r` and `r ^ 1` (a put_signal, or a put, a fence and a signal: see
    /// [`BenchOptions::use_signal`]), round `i` on QP `i % num_qps_per_rank`; reports one-way latency.
    Latency,
    /// Every rank streams puts into rank `r + 1`; reports what each rank received per second.
    Bandwidth,
}

/// What [`bench()`] runs.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The transport and its settings.
    pub rdma: RdmaOptions,
    /// Latency or bandwidth.
    pub mode: BenchMode,
    /// Message sizes in bytes (multiples of 16).
    pub sizes: Vec<usize>,
    /// Bytes each rank sends per bandwidth measurement (messages = total / size), or round trips per
    /// latency measurement (`latency_round_trips`).
    pub bandwidth_bytes: usize,
    /// Round trips per latency measurement.
    pub latency_round_trips: u32,
    /// Every message a put_signal. Otherwise plain puts: latency — each put followed by a fence and a signal
    /// (what a protocol pays when its signal cannot ride with the data); bandwidth — a warp's puts, then one
    /// fence and one signal.
    pub use_signal: bool,
    /// Worker blocks (bandwidth).
    pub blocks: u32,
    /// Measurements per point (the median is kept).
    pub repetitions: u32,
    /// Deadline of every wait, ms.
    pub timeout_ms: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            rdma: RdmaOptions::default(),
            mode: BenchMode::Latency,
            sizes: vec![16, 4096, 65536],
            bandwidth_bytes: 64 << 20,
            latency_round_trips: 200,
            use_signal: true,
            blocks: 8,
            repetitions: 5,
            timeout_ms: 10_000,
        }
    }
}

/// One measured point of [`bench()`] (the slowest rank's median).
#[derive(Clone, Debug, PartialEq)]
pub struct BenchPoint {
    /// Message size, bytes.
    pub bytes: usize,
    /// Messages per rank (bandwidth) or round trips (latency).
    pub messages: u32,
    /// Latency: one-way microseconds (half a round trip); bandwidth: microseconds until the last message arrived.
    pub us: f64,
    /// Bandwidth: GB/s received per rank (bytes / time); latency: 0.
    pub gbps: f64,
}

/// Runs the micro-benchmark on every rank of `group` (collective).
pub fn bench(group: &dyn Group, device: usize, o: &BenchOptions) -> Result<Vec<BenchPoint>> {
    let rank = group.rank();
    if o.sizes.iter().any(|&s| s == 0 || s % 16 != 0 || s > u32::MAX as usize) || o.repetitions == 0 || o.blocks == 0 {
        return Err(Error::invalid("sizes", rank, "message sizes must be positive multiples of 16; repetitions and blocks positive"));
    }
    if o.mode == BenchMode::Latency && group.size() < 2 {
        return Err(Error::invalid("mode", rank, "the latency benchmark pairs ranks: it needs at least 2"));
    }
    let messages_for = |bytes: usize| -> u32 {
        match o.mode {
            BenchMode::Latency => o.latency_round_trips.max(1),
            // At most 65536 messages: a stream of tiny puts measures the per-message cost well before that.
            BenchMode::Bandwidth => (o.bandwidth_bytes / bytes).clamp(1, 1 << 16) as u32,
        }
    };
    let region =
        o.sizes.iter().map(|&b| TransportBenchArgs::region_bytes(messages_for(b) as usize, b)).max().unwrap_or(TRANSPORT_SIGNAL_BYTES);
    let probe = Probe::new(group, device, &o.rdma, region, o.timeout_ms)?;
    let result = DeviceBuffer::zeroed(&probe.device, 16)?;
    let body = (|| -> Result<Vec<BenchPoint>> {
        let (mut signal_base, mut epoch) = (0u64, 0u64);
        let mut points = Vec::new();
        for &bytes in &o.sizes {
            let messages = messages_for(bytes);
            let mut times = Vec::new();
            for _ in 0..o.repetitions + 1 {
                epoch += 1;
                let args = TransportBenchArgs {
                    rdma: probe.domain.args(),
                    error_claim: probe.sink.claim_ptr(),
                    error_record: probe.sink.record_ptr(),
                    timeout_ns: probe.timeout_ns,
                    result: result.device_ptr(),
                    epoch,
                    signal_base,
                    mode: if o.mode == BenchMode::Latency { BENCH_LATENCY } else { BENCH_BANDWIDTH },
                    bytes: bytes as u32,
                    messages,
                    use_signal: u32::from(o.use_signal),
                };
                probe.run(&probe.bench, if o.mode == BenchMode::Latency { 1 } else { o.blocks }, &args)?;
                signal_base += messages as u64;
                let r = Probe::read_u64s(&result, 2)?;
                // The slowest rank's time (ranks without a partner in latency mode report 0).
                let all = group.all_gather(&r[0].to_le_bytes())?;
                let slowest = all.iter().map(|b| u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]))).max().unwrap_or(0);
                times.push(slowest as f64 / 1e3);
            }
            times.remove(0); // warm-up
            times.sort_by(|a, b| a.total_cmp(b));
            let us = times[times.len() / 2];
            let (us, gbps) = match o.mode {
                BenchMode::Latency => (us / (2.0 * messages as f64), 0.0),
                BenchMode::Bandwidth => (us, (messages as f64 * bytes as f64) / (us * 1e3)),
            };
            points.push(BenchPoint { bytes, messages, us, gbps });
        }
        Ok(points)
    })();
    probe.finish(group, body)
}
