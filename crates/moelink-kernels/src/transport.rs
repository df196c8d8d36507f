//! The RDMA transport seam (`cuda/transport.cuh`): which engine carries internode bytes, the argument block
//! every internode kernel gets, the emulated NIC's state, and the seam's own kernels (`cuda/transport.cu`:
//! conformance check and micro-benchmark).

use bytemuck::{NoUninit, Zeroable};
use moelink_cuda::DevPtr;

use crate::{Family, KernelSpec};

/// `cuda/transport.cuh`.
pub const TRANSPORT_HEADER: &str = include_str!("../cuda/transport.cuh");
/// `cuda/transport_nvshmem.cuh`: the NVSHMEM backend (the only source with system includes).
pub const TRANSPORT_NVSHMEM_HEADER: &str = include_str!("../cuda/transport_nvshmem.cuh");
/// `cuda/transport.cu`.
pub const TRANSPORT_SOURCE: &str = include_str!("../cuda/transport.cu");

/// QPs a rank may name per peer (`RDMA_MAX_QPS`).
pub const RDMA_MAX_QPS: usize = 32;
/// Descriptors per emulated QP (`NIC_RING`).
pub const NIC_RING: usize = 256;
/// Bytes of one rank's emulated NIC state (`sizeof(NicState)`): 32 queues × 256 B, four counters on their
/// own 128-byte lines, then 32 rings of 256 descriptors × 64 B.
pub const NIC_STATE_BYTES: usize = RDMA_MAX_QPS * 256 + 4 * 128 + RDMA_MAX_QPS * NIC_RING * 64;
/// Bytes of signal words at the start of the seam kernels' region (`TRANSPORT_SIGNAL_BYTES`).
pub const TRANSPORT_SIGNAL_BYTES: usize = 4096;
/// Threads per block of the seam's kernels.
pub const TRANSPORT_THREADS: u32 = 256;

/// An emulated NIC block's statistics in a high-throughput timing trace (`NIC_STAT_*` in transport.cuh):
/// indices of u64 words among the block's trace words. Stamps (`%globaltimer` ns): the block's start and
/// end, its first put's start, its last put's end; durations (ns): executing descriptors, idle with nothing
/// posted, idle with a put held by the link or the delay; then descriptors executed and bytes put.
pub mod nic_stat {
    /// The block's start (ns).
    pub const START: usize = 0;
    /// The block's end (ns).
    pub const END: usize = 1;
    /// When its first put was admitted (ns).
    pub const FIRST_PUT: usize = 2;
    /// When its last put's copy ended (ns).
    pub const LAST_PUT: usize = 3;
    /// Time spent executing descriptors (ns).
    pub const BUSY_NS: usize = 4;
    /// Time idle with nothing posted (ns).
    pub const IDLE_NS: usize = 5;
    /// Time idle with a put posted but held by the link or the delay (ns).
    pub const CAPPED_NS: usize = 6;
    /// Descriptors executed.
    pub const DESCRIPTORS: usize = 7;
    /// Bytes put.
    pub const BYTES: usize = 8;
    /// Words per block.
    pub const WORDS: usize = 9;
}

/// The engine that carries bytes across the RDMA domain (`MOELINK_TRANSPORT`), fixed at JIT time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Peer pointers (virtual nodes on one host, tests).
    Ptr,
    /// The emulated NIC (tests): in order per QP, out of order across QPs, delays, a rate cap.
    EmuNic,
    /// NVSHMEM's device API (IBGDA / proxy on a cluster).
    Nvshmem,
}

impl Transport {
    /// The value of `MOELINK_TRANSPORT`.
    pub fn code(self) -> u32 {
        match self {
            Transport::Ptr => 1,
            Transport::EmuNic => 2,
            Transport::Nvshmem => 3,
        }
    }

    /// `ptr`, `emu-nic`, `nvshmem`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Ptr => "ptr",
            Transport::EmuNic => "emu-nic",
            Transport::Nvshmem => "nvshmem",
        }
    }

    /// Every backend.
    pub const ALL: [Transport; 3] = [Transport::Ptr, Transport::EmuNic, Transport::Nvshmem];

    /// The backend a kernel spec was compiled for, if it uses the seam.
    pub fn of_spec(spec: &KernelSpec) -> Option<Transport> {
        let code: u32 = spec.define("MOELINK_TRANSPORT")?.parse().ok()?;
        Transport::ALL.into_iter().find(|t| t.code() == code)
    }
}

/// What a kernel needs to reach the RDMA domain (`RdmaArgs` in `transport.cuh`; 64 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct RdmaArgs {
    /// This rank's RDMA region (device address).
    pub local_base: DevPtr,
    /// `ptr` / `emu-nic`: device address of `u64[num_ranks]`, every rank's region mapped on this GPU.
    pub peer_bases: DevPtr,
    /// `emu-nic`: this rank's [`NIC_STATE_BYTES`] of NIC state.
    pub nic_state: DevPtr,
    /// `emu-nic`: a descriptor runs no earlier than this after it was posted.
    pub nic_delay_ns: u64,
    /// `emu-nic`: rate cap in bytes per microsecond (= MB/s); 0: none.
    pub nic_bytes_per_us: u32,
    /// `emu-nic`: reorder window in microseconds (0: in turn, no extra waits).
    pub nic_reorder_us: u32,
    /// `emu-nic`: blocks at the end of the grid that act as the NIC.
    pub nic_blocks: u32,
    /// `emu-nic`: scheduler seed.
    pub nic_seed: u32,
    /// This rank in the RDMA domain.
    pub rank: u32,
    /// Ranks of the RDMA domain.
    pub num_ranks: u32,
    /// QPs per peer (1..=[`RDMA_MAX_QPS`]).
    pub num_qps: u32,
    /// `emu-nic`: ranks per node whose peers go over NVLink (pointer stores) instead of the NIC; 0: none.
    pub nvlink_ranks_per_node: u32,
}

/// Arguments of `transport_barrier` (`TransportBarrierArgs` in `transport.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct TransportBarrierArgs {
    /// The domain.
    pub rdma: RdmaArgs,
    /// Error claim word (device).
    pub error_claim: DevPtr,
    /// Error record (host-mapped).
    pub error_record: DevPtr,
    /// Deadline of every wait.
    pub timeout_ns: u64,
    /// Device `u64`: barriers this rank has entered (the kernel increments it).
    pub counter: DevPtr,
    /// RDMA-region offset of the `u64[num_ranks]` barrier words.
    pub signal_off: u64,
}

/// `TransportCheckArgs::mode`: put_signal.
pub const CHECK_PUT_SIGNAL: u32 = 0;
/// `TransportCheckArgs::mode`: put, fence, signal on another QP.
pub const CHECK_PUT_FENCE_SIGNAL: u32 = 1;
/// `TransportCheckArgs::mode`: put, signal on another QP, no fence (a planted bug: `emu-nic` must catch it).
pub const CHECK_PLANTED_BUG: u32 = 2;

/// Arguments of `transport_check` (`TransportCheckArgs` in `transport.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct TransportCheckArgs {
    /// The domain.
    pub rdma: RdmaArgs,
    /// Error claim word (device).
    pub error_claim: DevPtr,
    /// Error record (host-mapped).
    pub error_record: DevPtr,
    /// Deadline of every wait.
    pub timeout_ns: u64,
    /// Device `u64`: wrong bytes seen (accumulates).
    pub mismatches: DevPtr,
    /// Device `u64[num_ranks]`: messages expected from each source so far.
    pub expected: DevPtr,
    /// Seed of every rank's messages.
    pub seed: u32,
    /// Round number (messages differ per round).
    pub round: u32,
    /// Messages per rank and round.
    pub messages: u32,
    /// Largest message, bytes (>= 1).
    pub max_bytes: u32,
    /// `max_bytes` rounded up to 16.
    pub slot_bytes: u32,
    /// [`CHECK_PUT_SIGNAL`], [`CHECK_PUT_FENCE_SIGNAL`] or [`CHECK_PLANTED_BUG`].
    pub mode: u32,
}

impl TransportCheckArgs {
    /// Bytes of RDMA region the check needs per rank: signals, `[R][messages]` receive slots, `[messages]`
    /// send slots.
    pub fn region_bytes(num_ranks: usize, messages: usize, max_bytes: usize) -> usize {
        TRANSPORT_SIGNAL_BYTES + (num_ranks + 1) * messages * max_bytes.next_multiple_of(16)
    }
}

/// `TransportBenchArgs::mode`: put_signal ping-pong between ranks `r` and `r ^ 1`.
pub const BENCH_LATENCY: u32 = 0;
/// `TransportBenchArgs::mode`: every rank streams puts to rank `r + 1`.
pub const BENCH_BANDWIDTH: u32 = 1;

/// Arguments of `transport_bench` (`TransportBenchArgs` in `transport.cu`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct TransportBenchArgs {
    /// The domain.
    pub rdma: RdmaArgs,
    /// Error claim word (device).
    pub error_claim: DevPtr,
    /// Error record (host-mapped).
    pub error_record: DevPtr,
    /// Deadline of every wait.
    pub timeout_ns: u64,
    /// Device `u64[2]`: elapsed ns, bytes.
    pub result: DevPtr,
    /// Launch number, from 1.
    pub epoch: u64,
    /// This rank's ping-pong word / counter before the launch.
    pub signal_base: u64,
    /// [`BENCH_LATENCY`] or [`BENCH_BANDWIDTH`].
    pub mode: u32,
    /// Bytes per message (multiple of 16).
    pub bytes: u32,
    /// Round trips (latency) or messages per rank (bandwidth).
    pub messages: u32,
    /// Bandwidth: 1 = every message a put_signal; 0 = puts, then a fence and one signal per warp.
    pub use_signal: u32,
}

impl TransportBenchArgs {
    /// Bytes of RDMA region the bench needs per rank for `messages` of `bytes`.
    pub fn region_bytes(messages: usize, bytes: usize) -> usize {
        TRANSPORT_SIGNAL_BYTES + 2 * messages * bytes
    }
}

/// One compilable variant of `transport.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransportVariant {
    /// The backend.
    pub transport: Transport,
}

impl TransportVariant {
    /// The compile key.
    pub fn spec(&self) -> KernelSpec {
        KernelSpec {
            family: Family::Transport,
            variant: format!("transport[{}]", self.transport.name()),
            defines: vec![
                ("MOELINK_TRANSPORT".into(), self.transport.code().to_string()),
                ("TRANSPORT_THREADS".into(), TRANSPORT_THREADS.to_string()),
                ("MOELINK_SIZEOF_TRANSPORT_CHECK_ARGS".into(), std::mem::size_of::<TransportCheckArgs>().to_string()),
                ("MOELINK_SIZEOF_TRANSPORT_BENCH_ARGS".into(), std::mem::size_of::<TransportBenchArgs>().to_string()),
                ("MOELINK_SIZEOF_NIC_STATE".into(), NIC_STATE_BYTES.to_string()),
                ("MOELINK_SIZEOF_TRANSPORT_BARRIER_ARGS".into(), std::mem::size_of::<TransportBarrierArgs>().to_string()),
            ],
        }
    }

    /// One variant per backend.
    pub fn all() -> Vec<TransportVariant> {
        Transport::ALL.into_iter().map(|transport| TransportVariant { transport }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nic_stat_words_agree_with_the_header() {
        let pairs = [
            ("START", nic_stat::START),
            ("END", nic_stat::END),
            ("FIRST_PUT", nic_stat::FIRST_PUT),
            ("LAST_PUT", nic_stat::LAST_PUT),
            ("BUSY_NS", nic_stat::BUSY_NS),
            ("IDLE_NS", nic_stat::IDLE_NS),
            ("CAPPED_NS", nic_stat::CAPPED_NS),
            ("DESCRIPTORS", nic_stat::DESCRIPTORS),
            ("BYTES", nic_stat::BYTES),
            ("WORDS", nic_stat::WORDS),
        ];
        for (name, value) in pairs {
            let needle = format!("NIC_STAT_{name} = {value}");
            assert!(TRANSPORT_HEADER.contains(&needle), "transport.cuh lacks `{needle}`");
        }
    }

    #[test]
    fn struct_sizes() {
        assert_eq!(std::mem::size_of::<RdmaArgs>(), 64);
        assert_eq!(std::mem::size_of::<TransportCheckArgs>(), 64 + 5 * 8 + 6 * 4);
        assert_eq!(std::mem::size_of::<TransportBenchArgs>(), 64 + 6 * 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<TransportBarrierArgs>(), 64 + 5 * 8);
        assert!(TRANSPORT_HEADER.contains("static_assert(sizeof(RdmaArgs) == 64"));
        assert!(TRANSPORT_HEADER.contains(&format!("constexpr u32 RDMA_MAX_QPS = {RDMA_MAX_QPS};")));
        assert!(TRANSPORT_HEADER.contains(&format!("constexpr u32 NIC_RING = {NIC_RING};")));
        assert!(TRANSPORT_SOURCE.contains(&format!("constexpr u64 TRANSPORT_SIGNAL_BYTES = {TRANSPORT_SIGNAL_BYTES};")));
        for (name, value) in [("CHECK_PUT_SIGNAL", CHECK_PUT_SIGNAL), ("CHECK_PUT_FENCE_SIGNAL", CHECK_PUT_FENCE_SIGNAL)] {
            assert!(TRANSPORT_SOURCE.contains(&format!("constexpr u32 {name} = {value};")), "{name}");
        }
        assert!(TRANSPORT_SOURCE.contains(&format!("constexpr u32 CHECK_PLANTED_BUG = {CHECK_PLANTED_BUG};")));
        assert!(TRANSPORT_SOURCE.contains(&format!("constexpr u32 BENCH_LATENCY = {BENCH_LATENCY};")));
        assert!(TRANSPORT_SOURCE.contains(&format!("constexpr u32 BENCH_BANDWIDTH = {BENCH_BANDWIDTH};")));
    }

    #[test]
    fn variants_name_their_backend() {
        for v in TransportVariant::all() {
            assert_eq!(Transport::of_spec(&v.spec()), Some(v.transport));
        }
        assert_eq!(Transport::of_spec(&crate::BarrierVariant.spec()), None);
    }
}
