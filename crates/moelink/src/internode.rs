//! Across nodes: how the ranks map onto nodes ([`Topology`]), which engine carries bytes between nodes
//! ([`Transport`]) and the RDMA settings handed to it ([`RdmaOptions`]).
//!
//! A node is an NVLink domain: its ranks reach each other with peer pointers, as in single-node use. Ranks
//! of different nodes exchange through the RDMA transport seam (`moelink-kernels/cuda/transport.cuh`). A
//! buffer whose topology has one node needs none of this (and never loads NVSHMEM).
//!
//! Virtual nodes: [`BufferOptions::topology`](crate::BufferOptions::topology) can split the ranks of one host
//! into several nodes (4 ranks as 2 × 2), so that the internode protocols run — over `ptr` or `emu-nic` —
//! on a machine without a NIC, or with fewer GPUs than ranks.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::group::Group;

/// Ranks per node the NVLink kernels support (`moelink_kernels::abi::MAX_RANKS`).
pub const MAX_RANKS_PER_NODE: usize = moelink_kernels::abi::MAX_RANKS;

/// `num_nodes × ranks_per_node`: rank `r` is local rank `r % ranks_per_node` of node `r / ranks_per_node`
/// (ranks are numbered node by node, as torchrun does).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Topology {
    /// Nodes (NVLink domains).
    pub num_nodes: usize,
    /// Ranks of each node.
    pub ranks_per_node: usize,
}

impl Topology {
    /// One node holding every rank.
    pub fn single_node(num_ranks: usize) -> Topology {
        Topology { num_nodes: 1, ranks_per_node: num_ranks }
    }

    /// Ranks in all.
    pub fn num_ranks(&self) -> usize {
        self.num_nodes * self.ranks_per_node
    }

    /// True when ranks of several nodes take part (the RDMA transport is needed).
    pub fn is_internode(&self) -> bool {
        self.num_nodes > 1
    }

    /// The node of rank `r`.
    pub fn node_of(&self, r: usize) -> usize {
        r / self.ranks_per_node
    }

    /// Rank `r`'s index inside its node.
    pub fn local_rank_of(&self, r: usize) -> usize {
        r % self.ranks_per_node
    }

    /// The ranks of `node`, in order.
    pub fn ranks_of_node(&self, node: usize) -> std::ops::Range<usize> {
        node * self.ranks_per_node..(node + 1) * self.ranks_per_node
    }

    /// Checks the topology against a group of `num_ranks` (this is `rank`): every rank on exactly one
    /// node, at most [`MAX_RANKS_PER_NODE`] per node. The error names `topology`.
    pub fn validate(&self, num_ranks: usize, rank: usize) -> Result<()> {
        if self.num_nodes == 0 || self.ranks_per_node == 0 {
            return Err(Error::invalid("topology", rank, format!("{self}: nodes and ranks per node must be positive")));
        }
        if self.num_nodes.checked_mul(self.ranks_per_node) != Some(num_ranks) {
            return Err(Error::invalid("topology", rank, format!("{self} is not the group's {num_ranks} ranks")));
        }
        if self.ranks_per_node > MAX_RANKS_PER_NODE {
            return Err(Error::invalid(
                "topology",
                rank,
                format!("{self}: a node (NVLink domain) holds at most {MAX_RANKS_PER_NODE} ranks"),
            ));
        }
        Ok(())
    }

    /// The launcher's layout: ranks grouped by the host they run on (an all-gather of host names;
    /// collective). Ranks of one host must be consecutive and every host must hold as many ranks, as
    /// torchrun places them; otherwise the error asks for an explicit topology.
    pub fn detect(group: &dyn Group) -> Result<Topology> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let hosts = group.all_gather(host.trim().as_bytes())?;
        Topology::from_hosts(&hosts, group.rank())
    }

    /// [`Topology::detect`] waiting at most `timeout` for the other ranks ([`Group::all_gather_within`]):
    /// what [`crate::Buffer::new`] uses, with the buffer's `timeout_ms`.
    pub fn detect_within(group: &dyn Group, timeout: std::time::Duration) -> Result<Topology> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let hosts = group.all_gather_within(host.trim().as_bytes(), timeout)?;
        Topology::from_hosts(&hosts, group.rank())
    }

    /// [`Topology::detect`] on gathered host names (indexed by rank).
    pub fn from_hosts(hosts: &[Vec<u8>], rank: usize) -> Result<Topology> {
        let n = hosts.len();
        let per_node = hosts.iter().take_while(|h| **h == hosts[0]).count().max(1);
        let detected = Topology { num_nodes: n / per_node, ranks_per_node: per_node };
        let consistent = n % per_node == 0
            && hosts.chunks(per_node).all(|c| c.iter().all(|h| *h == c[0]))
            && hosts.chunks(per_node).enumerate().all(|(i, c)| hosts.chunks(per_node).skip(i + 1).all(|d| d[0] != c[0]));
        if !consistent {
            return Err(Error::invalid(
                "topology",
                rank,
                "the ranks are not grouped by host (consecutive ranks per host, as many on each); set BufferOptions::topology \
                 (Python: the MOELINK_TOPOLOGY variable, e.g. 2x4)"
                    .to_string(),
            ));
        }
        Ok(detected)
    }
}

impl std::fmt::Display for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} node(s) x {} rank(s)", self.num_nodes, self.ranks_per_node)
    }
}

impl std::str::FromStr for Topology {
    type Err = String;
    /// `NODESxRANKS`, e.g. `2x4`.
    fn from_str(s: &str) -> std::result::Result<Topology, String> {
        let (a, b) = s.trim().split_once(['x', 'X']).ok_or_else(|| format!("{s:?} is not NODESxRANKS_PER_NODE (e.g. 2x4)"))?;
        let num = |t: &str| t.trim().parse::<usize>().map_err(|_| format!("{s:?} is not NODESxRANKS_PER_NODE (e.g. 2x4)"));
        Ok(Topology { num_nodes: num(a)?, ranks_per_node: num(b)? })
    }
}

/// Settings of the emulated NIC (tests only; see `transport.cuh`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmuNicOptions {
    /// A put runs no earlier than this long after it was posted.
    pub delay_us: u64,
    /// Rate cap per rank, GB/s (0: none).
    pub rate_gbps: f64,
    /// Reorder window in microseconds: QPs are served in a random order and every put waits a random time
    /// below twice this after it was posted, while bare signals go at once, so that operations on
    /// different QPs are delivered out of order (0: in turn, no extra wait).
    pub reorder_window_us: u32,
    /// Seed of that reordering.
    pub seed: u32,
    /// Blocks of each internode launch that act as the NIC (1..=[`MAX_NIC_BLOCKS`]). Each copies the
    /// descriptors of its QPs in turn, at some 7–12 GB/s on an H200: a rate cap needs enough of them.
    pub nic_blocks: u32,
}

/// The most blocks an emulated NIC may have: one per QP.
pub const MAX_NIC_BLOCKS: u32 = moelink_kernels::transport::RDMA_MAX_QPS as u32;

impl Default for EmuNicOptions {
    fn default() -> Self {
        EmuNicOptions { delay_us: 0, rate_gbps: 0.0, reorder_window_us: 20, seed: 1, nic_blocks: 1 }
    }
}

/// Bytes of one low-latency dispatch message between nodes: a header, the token's top-k routing (expert
/// entries and weights, 16-byte aligned) and its row (FP8 with its scales, or bf16). One goes to each
/// distinct destination rank of a token; combine returns one bf16 row (`2 * hidden` bytes) per such message
/// when dispatch carried the weights. The unit of the byte model in `docs/internode.md`.
///
/// ```
/// assert_eq!(moelink::internode::ll_message_bytes(7168, 8, true), 7472);
/// ```
pub fn ll_message_bytes(hidden: usize, topk: usize, fp8: bool) -> usize {
    moelink_kernels::ll_internode::msg_bytes(hidden, topk, fp8)
}

/// The engine under the RDMA transport seam.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum Transport {
    /// NVSHMEM's device API: IBGDA (GPU-initiated RDMA) or its proxy on a cluster, P2P between PEs of one
    /// host. One process per rank.
    #[default]
    Nvshmem,
    /// Peer pointers: virtual nodes of one host (one process, or processes through CUDA IPC). No NIC.
    Ptr,
    /// The emulated NIC (tests): in order per QP, out of order across QPs, delays, a rate cap.
    EmuNic(EmuNicOptions),
}

/// Buffer sizes for the high-throughput kernels across nodes: what [`crate::BufferOptions::num_nvl_bytes`]
/// and [`crate::BufferOptions::num_rdma_bytes`] must be for rounds of `round_tokens` tokens per rank (a call
/// of more tokens runs several rounds; fewer bytes mean smaller rounds, and at least one token per round must
/// fit). For dispatch rows of `hidden` channels (FP8 or bf16) with `topk` entries, and combine rows with up to
/// 32 weights.
///
/// ```
/// use moelink::internode::{ht_bytes_needed, Topology};
/// let t: Topology = "2x8".parse().unwrap();
/// let need = ht_bytes_needed(t, 4096, 7168, 8, true);
/// assert!(need.num_nvl_bytes > 0 && need.num_rdma_bytes > 0);
/// ```
pub fn ht_bytes_needed(topology: Topology, round_tokens: usize, hidden: usize, topk: usize, fp8: bool) -> HtBytes {
    use moelink_kernels::ht_internode as hti_kernels;
    let rows = hti_kernels::RowSizes::new(hidden, fp8, topk, hti_kernels::HTI_MAX_TOPK);
    HtBytes {
        num_nvl_bytes: hti_kernels::nvl_bytes_needed(topology.num_ranks(), round_tokens, rows),
        num_rdma_bytes: hti_kernels::rdma_bytes_needed(topology.num_ranks(), topology.num_nodes, round_tokens, rows),
    }
}

/// What [`ht_bytes_needed`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtBytes {
    pub num_nvl_bytes: usize,
    pub num_rdma_bytes: usize,
}

/// The round shape of a high-throughput call across nodes, `(tokens per round, tokens per chunk)`, on a
/// buffer of these sizes — or the `BufferTooSmall` error every backend gives when not even one token per
/// round fits (the capacity rule of the internode high-throughput calls: any token count fits in rounds).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ht_round_shape(
    rank: usize,
    topology: Topology,
    num_nvl_bytes: usize,
    num_rdma_bytes: usize,
    hidden: usize,
    fp8: bool,
    topk: usize,
    chunk_tokens: usize,
) -> crate::Result<(usize, usize)> {
    use moelink_kernels::ht_internode as hti_kernels;
    let (r, n) = (topology.num_ranks(), topology.num_nodes);
    let rows = hti_kernels::RowSizes::new(hidden, fp8, topk, hti_kernels::HTI_MAX_TOPK);
    let hint = format!(
        "not even one token per round fits; create the Buffer with sizes from moelink::internode::ht_bytes_needed({topology}, tokens per round, {hidden}, {topk}, {fp8})"
    );
    let too_small = |what, needed, available| Error::BufferTooSmall { rank, what, needed, available, hint: hint.clone() };
    let nvl = hti_kernels::nvl_layout(0, 0, num_nvl_bytes, r, n);
    if (nvl.part_bytes as usize) < rows.dispatch_row.max(rows.combine_row) {
        return Err(too_small(
            "internode high-throughput NVLink parts (num_nvl_bytes)",
            hti_kernels::nvl_bytes_needed(r, 1, rows),
            num_nvl_bytes,
        ));
    }
    let rdma_needed = hti_kernels::rdma_bytes_needed(r, n, 1, rows);
    let rdma = hti_kernels::rdma_layout(0, 0, num_rdma_bytes, r, n)
        .ok_or_else(|| too_small("internode high-throughput RDMA parts (num_rdma_bytes)", rdma_needed, num_rdma_bytes))?;
    hti_kernels::round_shape(&rdma, &nvl, rows, chunk_tokens)
        .ok_or_else(|| too_small("internode high-throughput RDMA parts (num_rdma_bytes)", rdma_needed, num_rdma_bytes))
}

impl Transport {
    /// The kernels' JIT key.
    pub fn kernel_transport(&self) -> moelink_kernels::transport::Transport {
        match self {
            Transport::Nvshmem => moelink_kernels::transport::Transport::Nvshmem,
            Transport::Ptr => moelink_kernels::transport::Transport::Ptr,
            Transport::EmuNic(_) => moelink_kernels::transport::Transport::EmuNic,
        }
    }

    /// `nvshmem`, `ptr` or `emu-nic`.
    pub fn name(&self) -> &'static str {
        self.kernel_transport().name()
    }
}

impl std::str::FromStr for Transport {
    type Err = String;
    /// `nvshmem`, `ptr`, `emu-nic` (default settings: reordering on), or `emu-nic:` with settings, comma
    /// separated: `rate=<GB/s>` (a NIC's rate cap, 0: none), `delay=<µs>`, `reorder=<µs>` (0: in order),
    /// `seed=<n>`, `nic-blocks=<1..=32>`; e.g. `emu-nic:rate=50,reorder=0` for one 400 Gb/s NIC per GPU.
    fn from_str(s: &str) -> std::result::Result<Transport, String> {
        let (name, settings) = s.trim().split_once(':').map_or((s.trim(), None), |(n, rest)| (n, Some(rest)));
        match (name, settings) {
            ("nvshmem", None) => Ok(Transport::Nvshmem),
            ("ptr", None) => Ok(Transport::Ptr),
            ("emu-nic", settings) => {
                let mut o = EmuNicOptions::default();
                for item in settings.unwrap_or("").split(',').map(str::trim).filter(|i| !i.is_empty()) {
                    let bad = || {
                        format!("emu-nic setting {item:?}: expected rate=<GB/s>, delay=<us>, reorder=<us>, seed=<n> or nic-blocks=<1..={MAX_NIC_BLOCKS}>")
                    };
                    let (key, value) = item.split_once('=').ok_or_else(bad)?;
                    let int = |v: &str| v.trim().parse::<u64>().map_err(|_| bad());
                    match key.trim() {
                        "rate" => {
                            o.rate_gbps = value.trim().parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0).ok_or_else(bad)?;
                        }
                        "delay" => o.delay_us = int(value)?,
                        "reorder" => o.reorder_window_us = u32::try_from(int(value)?).map_err(|_| bad())?,
                        "seed" => o.seed = u32::try_from(int(value)?).map_err(|_| bad())?,
                        "nic-blocks" => {
                            o.nic_blocks = u32::try_from(int(value)?).ok().filter(|n| (1..=MAX_NIC_BLOCKS).contains(n)).ok_or_else(bad)?
                        }
                        _ => return Err(bad()),
                    }
                }
                Ok(Transport::EmuNic(o))
            }
            (name @ ("nvshmem" | "ptr"), Some(_)) => Err(format!("the {name} transport takes no settings ({s:?})")),
            _ => Err(format!("unknown transport {s:?}: expected nvshmem, ptr or emu-nic[:settings]")),
        }
    }
}

/// RDMA settings (DeepEP's names where it has them). The NIC ones are handed to NVSHMEM before it
/// initialises (as the `NVSHMEM_*` variables in [`RdmaOptions::nvshmem_env`], overriding the environment);
/// an optional one left `None` leaves NVSHMEM's default, or what the environment already says.
/// `num_qps_per_rank` is not optional: it always sets `NVSHMEM_IBGDA_NUM_RC_PER_PE` (as DeepEP's `Buffer`
/// does), and `NVSHMEM_DISABLE_NVLS=1` is always set.
#[derive(Clone, Debug, PartialEq)]
pub struct RdmaOptions {
    /// The engine. Default: NVSHMEM.
    pub transport: Transport,
    /// QPs per peer (DeepEP's `num_qps_per_rank`), any positive count: the kernels spread their operations
    /// over this many, capped at [`RdmaOptions::MAX_QPS_PER_RANK`] ([`RdmaOptions::effective_num_qps`]; DeepEP's
    /// users pass `num_experts / num_ranks`, e.g. 144 at 2 ranks); with NVSHMEM it also sets
    /// `NVSHMEM_IBGDA_NUM_RC_PER_PE` to the capped count. Unused when the ranks are on one node.
    pub num_qps_per_rank: usize,
    /// Low-latency kernels reach peers of their own node over NVLink (DeepEP's
    /// `allow_nvlink_for_low_latency_mode`); otherwise every peer goes through the RDMA transport.
    pub allow_nvlink_for_low_latency_mode: bool,
    /// GPU-initiated RDMA (`NVSHMEM_IB_ENABLE_IBGDA`).
    pub ibgda: Option<bool>,
    /// Both ports of a dual-port NIC (`NVSHMEM_IBGDA_ENABLE_MULTI_PORT`).
    pub multi_port: Option<bool>,
    /// RoCE/IB traffic class (`NVSHMEM_IB_TRAFFIC_CLASS`).
    pub traffic_class: Option<u32>,
    /// IB service level (`NVSHMEM_IB_SL`).
    pub service_level: Option<u32>,
    /// RoCE GID index (`NVSHMEM_IB_GID_INDEX`).
    pub gid_index: Option<u32>,
    /// RoCE address family, `AF_INET` or `AF_INET6` (`NVSHMEM_IB_ADDR_FAMILY`).
    pub address_family: Option<String>,
    /// Send-queue depth per QP (`NVSHMEM_QP_DEPTH`).
    pub qp_depth: Option<u32>,
    /// NICs to use, e.g. `mlx5_0:1,mlx5_1:1` (`^` first excludes them instead): `NVSHMEM_HCA_LIST`. Each
    /// PE takes the nearest listed NIC (with `NVSHMEM_ENABLE_NIC_PE_MAPPING=1` in the environment: local PE
    /// `i` the `i % n`-th).
    pub hca_list: Option<String>,
    /// NIC per PE of a node, `hca:port:count` in PE order, e.g. `mlx5_0:1:2,mlx5_1:1:2` (local PEs 0, 1 on
    /// mlx5_0, 2, 3 on mlx5_1): `NVSHMEM_HCA_PE_MAPPING`, with `NVSHMEM_ENABLE_NIC_PE_MAPPING=1`, without
    /// which NVSHMEM ignores it. Ignored by NVSHMEM when `hca_list` is set too.
    pub hca_pe_mapping: Option<String>,
    /// NVSHMEM's installation (`include/`, `lib/`), e.g. the `nvidia/nvshmem` folder of the
    /// `nvidia-nvshmem-cu13` wheel. Needed for the `nvshmem` transport.
    pub nvshmem_home: Option<PathBuf>,
    /// The CUDA toolkit (its `include/` with the runtime and libcu++ headers), for compiling the `nvshmem`
    /// kernels; default: `/usr/local/cuda`, or beside a pip-installed NVSHMEM.
    pub cuda_home: Option<PathBuf>,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            transport: Transport::default(),
            num_qps_per_rank: 24,
            allow_nvlink_for_low_latency_mode: true,
            ibgda: None,
            multi_port: None,
            traffic_class: None,
            service_level: None,
            gid_index: None,
            address_family: None,
            qp_depth: None,
            hca_list: None,
            hca_pe_mapping: None,
            nvshmem_home: None,
            cuda_home: None,
        }
    }
}

impl RdmaOptions {
    /// The most QPs per peer a buffer may ask for (`num_qps_per_rank`).
    pub const MAX_QPS_PER_RANK: usize = moelink_kernels::transport::RDMA_MAX_QPS;

    /// The QPs per peer the kernels use: `num_qps_per_rank`, at most [`RdmaOptions::MAX_QPS_PER_RANK`] (the
    /// transport's per-peer queue table holds that many).
    pub fn effective_num_qps(&self) -> usize {
        self.num_qps_per_rank.clamp(1, Self::MAX_QPS_PER_RANK)
    }

    /// Checks the settings (this is `rank`); the error names the field.
    pub fn validate(&self, rank: usize) -> Result<()> {
        if self.num_qps_per_rank == 0 {
            return Err(Error::invalid("num_qps_per_rank", rank, "0 (must be positive)"));
        }
        if let Some(af) = &self.address_family {
            if af != "AF_INET" && af != "AF_INET6" {
                return Err(Error::invalid("address_family", rank, format!("{af:?} (expected AF_INET or AF_INET6)")));
            }
        }
        if let Transport::EmuNic(n) = &self.transport {
            if n.nic_blocks == 0 || n.nic_blocks > MAX_NIC_BLOCKS {
                return Err(Error::invalid("emu_nic.nic_blocks", rank, format!("{} (must be 1..={MAX_NIC_BLOCKS})", n.nic_blocks)));
            }
            if !(n.rate_gbps >= 0.0 && n.rate_gbps.is_finite()) {
                return Err(Error::invalid("emu_nic.rate_gbps", rank, format!("{} (must be finite and >= 0)", n.rate_gbps)));
            }
        }
        Ok(())
    }

    /// The `NVSHMEM_*` variables these settings stand for, set just before NVSHMEM initialises. Always
    /// `NVSHMEM_DISABLE_NVLS=1` (moelink uses no NVLink multicast); `NVSHMEM_DISABLE_P2P=1` when low-latency
    /// peers of a node must go through the NIC too.
    pub fn nvshmem_env(&self) -> Vec<(String, String)> {
        let mut env = vec![("NVSHMEM_DISABLE_NVLS".to_string(), "1".to_string())];
        let mut set = |k: &str, v: String| env.push((k.to_string(), v));
        let flag = |b: bool| if b { "1".to_string() } else { "0".to_string() };
        set("NVSHMEM_IBGDA_NUM_RC_PER_PE", self.effective_num_qps().to_string());
        if !self.allow_nvlink_for_low_latency_mode {
            set("NVSHMEM_DISABLE_P2P", "1".into());
        }
        if let Some(v) = self.ibgda {
            set("NVSHMEM_IB_ENABLE_IBGDA", flag(v));
            if v {
                set("NVSHMEM_IBGDA_NIC_HANDLER", "gpu".into());
            }
        }
        if let Some(v) = self.multi_port {
            set("NVSHMEM_IBGDA_ENABLE_MULTI_PORT", flag(v));
        }
        if let Some(v) = self.traffic_class {
            set("NVSHMEM_IB_TRAFFIC_CLASS", v.to_string());
        }
        if let Some(v) = self.service_level {
            set("NVSHMEM_IB_SL", v.to_string());
        }
        if let Some(v) = self.gid_index {
            set("NVSHMEM_IB_GID_INDEX", v.to_string());
        }
        if let Some(v) = &self.address_family {
            set("NVSHMEM_IB_ADDR_FAMILY", v.clone());
        }
        if let Some(v) = self.qp_depth {
            set("NVSHMEM_QP_DEPTH", v.to_string());
        }
        if let Some(v) = &self.hca_list {
            set("NVSHMEM_HCA_LIST", v.clone());
        }
        if let Some(v) = &self.hca_pe_mapping {
            set("NVSHMEM_HCA_PE_MAPPING", v.clone());
            // NVSHMEM applies the mapping only with this set (otherwise each PE takes the nearest NIC).
            set("NVSHMEM_ENABLE_NIC_PE_MAPPING", "1".into());
        }
        env
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn transports_parse_with_emulated_nic_settings() {
        use super::{EmuNicOptions, Transport};
        assert_eq!("ptr".parse::<Transport>(), Ok(Transport::Ptr));
        assert_eq!(" nvshmem ".parse::<Transport>(), Ok(Transport::Nvshmem));
        assert_eq!("emu-nic".parse::<Transport>(), Ok(Transport::EmuNic(EmuNicOptions::default())));
        let t: Transport = "emu-nic:rate=50, reorder=0,delay=3,seed=7,nic-blocks=2".parse().unwrap();
        let want = EmuNicOptions { rate_gbps: 50.0, reorder_window_us: 0, delay_us: 3, seed: 7, nic_blocks: 2 };
        assert_eq!(t, Transport::EmuNic(want));
        for bad in
            ["emu-nic:rate=-1", "emu-nic:speed=5", "emu-nic:nic-blocks=33", "emu-nic:nic-blocks=0", "emu-nic:rate", "ptr:rate=5", "rdma"]
        {
            assert!(bad.parse::<Transport>().is_err(), "{bad} must be refused");
        }
        assert!("emu-nic:rate=fast".parse::<Transport>().unwrap_err().contains("rate=fast"), "the error names the setting");
    }

    use super::*;

    #[test]
    fn topology_arithmetic_and_checks() {
        let t = Topology { num_nodes: 2, ranks_per_node: 4 };
        assert_eq!((t.num_ranks(), t.node_of(5), t.local_rank_of(5), t.ranks_of_node(1)), (8, 1, 1, 4..8));
        assert!(t.is_internode() && !Topology::single_node(8).is_internode());
        t.validate(8, 0).unwrap();
        let e = t.validate(6, 3).unwrap_err();
        assert_eq!(e.argument(), Some("topology"));
        assert!(e.to_string().contains("rank 3") && e.to_string().contains("6 ranks"), "{e}");
        let e = Topology { num_nodes: 1, ranks_per_node: 16 }.validate(16, 0).unwrap_err().to_string();
        assert!(e.contains("at most 8"), "{e}");
        assert!(Topology { num_nodes: 0, ranks_per_node: 4 }.validate(0, 0).is_err());
        assert_eq!("2x4".parse::<Topology>(), Ok(t));
        assert_eq!(" 4X2 ".parse::<Topology>(), Ok(Topology { num_nodes: 4, ranks_per_node: 2 }));
        assert!("8".parse::<Topology>().is_err() && "ax2".parse::<Topology>().is_err());
    }

    #[test]
    fn detection_groups_ranks_by_host() {
        let h = |v: &[&str]| v.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>();
        assert_eq!(Topology::from_hosts(&h(&["a", "a", "b", "b"]), 0).unwrap(), Topology { num_nodes: 2, ranks_per_node: 2 });
        assert_eq!(Topology::from_hosts(&h(&["a", "a", "a"]), 0).unwrap(), Topology::single_node(3));
        for bad in [&["a", "b", "a", "b"][..], &["a", "a", "b"], &["a", "b", "b", "a"]] {
            let e = Topology::from_hosts(&h(bad), 1).unwrap_err();
            assert_eq!(e.argument(), Some("topology"), "{bad:?}");
        }
    }

    #[test]
    fn detection_through_a_thread_group_is_one_node() {
        let out = crate::group::run_ranks(3, |g| Topology::detect(&g));
        assert!(out.iter().all(|t| matches!(t, Ok(t) if *t == Topology::single_node(3))), "{out:?}");
    }

    #[test]
    fn rdma_options_map_to_nvshmem_variables() {
        let o = RdmaOptions {
            num_qps_per_rank: 4,
            allow_nvlink_for_low_latency_mode: false,
            ibgda: Some(true),
            traffic_class: Some(106),
            gid_index: Some(3),
            address_family: Some("AF_INET6".into()),
            hca_list: Some("mlx5_0:1".into()),
            ..RdmaOptions::default()
        };
        o.validate(0).unwrap();
        let env = o.nvshmem_env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("NVSHMEM_DISABLE_NVLS"), Some("1"));
        assert_eq!(get("NVSHMEM_IBGDA_NUM_RC_PER_PE"), Some("4"));
        assert_eq!(get("NVSHMEM_DISABLE_P2P"), Some("1"));
        assert_eq!(get("NVSHMEM_IB_ENABLE_IBGDA"), Some("1"));
        assert_eq!(get("NVSHMEM_IBGDA_NIC_HANDLER"), Some("gpu"));
        assert_eq!(get("NVSHMEM_IB_TRAFFIC_CLASS"), Some("106"));
        assert_eq!(get("NVSHMEM_IB_GID_INDEX"), Some("3"));
        assert_eq!(get("NVSHMEM_IB_ADDR_FAMILY"), Some("AF_INET6"));
        assert_eq!(get("NVSHMEM_HCA_LIST"), Some("mlx5_0:1"));
        assert_eq!(get("NVSHMEM_IB_SL"), None);
        assert_eq!((get("NVSHMEM_HCA_PE_MAPPING"), get("NVSHMEM_ENABLE_NIC_PE_MAPPING")), (None, None));
        let mapped = RdmaOptions { hca_pe_mapping: Some("mlx5_0:1:2,mlx5_1:1:2".into()), ..RdmaOptions::default() }.nvshmem_env();
        let get = |k: &str| mapped.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!((get("NVSHMEM_HCA_PE_MAPPING"), get("NVSHMEM_ENABLE_NIC_PE_MAPPING")), (Some("mlx5_0:1:2,mlx5_1:1:2"), Some("1")));
        // Always set, whatever the environment says: QPs per peer and no NVLink multicast.
        assert_eq!((get("NVSHMEM_IBGDA_NUM_RC_PER_PE"), get("NVSHMEM_DISABLE_NVLS")), (Some("24"), Some("1")));
        assert_eq!(
            RdmaOptions { num_qps_per_rank: 0, ..RdmaOptions::default() }.validate(2).unwrap_err().argument(),
            Some("num_qps_per_rank")
        );
        // DeepEP's users pass num_experts / num_ranks (144 at 2 ranks): accepted, and capped where used.
        for (asked, used) in [(1, 1), (24, 24), (32, 32), (33, 32), (144, 32), (usize::MAX, 32)] {
            let o = RdmaOptions { num_qps_per_rank: asked, ..RdmaOptions::default() };
            o.validate(2).unwrap();
            assert_eq!(o.effective_num_qps(), used, "{asked}");
            let env = o.nvshmem_env();
            let rc = env.iter().find(|(n, _)| n == "NVSHMEM_IBGDA_NUM_RC_PER_PE").map(|(_, v)| v.clone());
            assert_eq!(rc, Some(used.to_string()));
        }
        assert_eq!(
            RdmaOptions { address_family: Some("inet".into()), ..RdmaOptions::default() }.validate(0).unwrap_err().argument(),
            Some("address_family")
        );
        assert_eq!("emu-nic".parse::<Transport>().map(|t| t.name()), Ok("emu-nic"));
        assert!("rdma".parse::<Transport>().is_err());
    }
}
