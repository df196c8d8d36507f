//! High-throughput layout, notify, dispatch and combine across nodes (`cuda/hti_*.cu`, one kernel per file
//! over `cuda/hti.cuh`): the variant key, the argument structs, the row sizes, the routing buffer's layout,
//! and where everything lives in the RDMA region and in the node's symmetric (NVLink) buffer. Every offset
//! the kernels use is computed here, once; the protocol is described at the top of `hti.cuh`.

use bytemuck::{NoUninit, Pod, Zeroable};
use moelink_cuda::{DevPtr, DevPtrs};

use crate::transport::{RdmaArgs, Transport};
use crate::{Family, KernelSpec};

/// `cuda/hti.cuh`: what the four kernels share (the protocol, the layouts, the frame).
pub const HTI_HEADER: &str = include_str!("../cuda/hti.cuh");
/// `cuda/hti_layout.cu`.
pub const HTI_LAYOUT_SOURCE: &str = include_str!("../cuda/hti_layout.cu");
/// `cuda/hti_notify.cu`.
pub const HTI_NOTIFY_SOURCE: &str = include_str!("../cuda/hti_notify.cu");
/// `cuda/hti_dispatch.cu`.
pub const HTI_DISPATCH_SOURCE: &str = include_str!("../cuda/hti_dispatch.cu");
/// `cuda/hti_combine.cu`.
pub const HTI_COMBINE_SOURCE: &str = include_str!("../cuda/hti_combine.cu");
/// Ranks the kernels' shared arrays have room for (`HTI_MAX_RANKS`).
pub const HTI_MAX_RANKS: usize = 256;
/// Nodes (`HTI_MAX_NODES`: one lane per node).
pub const HTI_MAX_NODES: usize = 32;
/// Chunk signal words per peer node and round (`HTI_MAX_CHUNKS`): a round has at most this many chunks.
pub const HTI_MAX_CHUNKS: usize = 512;
/// Top-k entries (dispatch) and weights (combine) a row carries at most: one lane each.
pub const HTI_MAX_TOPK: usize = 32;
/// Experts per rank a notify message has room for.
pub const HTI_MAX_LOCAL_EXPERTS: usize = 1024;
/// Most tokens per round (flag slots per part). A dispatch message carries its slots within the round as i16.
pub const HTI_MAX_ROUND_TOKENS: usize = 16384;
const _: () = assert!(HTI_MAX_ROUND_TOKENS <= 1 << 15);
/// Warps per block (`HTI_WARPS`).
pub const HTI_WARPS: u32 = 16;
/// Threads per block.
pub const HTI_THREADS: u32 = HTI_WARPS * 32;
/// Sender chunk (tokens per put) when the config names none. Chunks are the unit of work of the sender
/// warps (taken from a counter) and of the forwarders: 8 tokens give a round of 4096 tokens 512 chunks, so
/// that every sender warp has some and the forwarders start on the first ones while the rest are written;
/// a put of 8 rows (59 KB in FP8 at DeepEP's hidden) is still a large RDMA message.
pub const DEFAULT_CHUNK_TOKENS: usize = 8;
/// Words of a notify message before the count row (`MSG_W_ROW`).
pub const NOTIFY_HEADER_WORDS: usize = 8;

/// Phases the internode kernels record (ptx.cuh's `PHASE_*` numbering continued in `hti.cuh`).
pub mod phase {
    /// The count exchange.
    pub const NOTIFY: u32 = 10;
    /// Dispatch, waiting in the RDMA domain.
    pub const DISPATCH_RDMA: u32 = 11;
    /// Dispatch, waiting in the NVLink domain.
    pub const DISPATCH_NVLINK: u32 = 12;
    /// Combine, waiting in the RDMA domain.
    pub const COMBINE_RDMA: u32 = 13;
    /// Combine, waiting in the NVLink domain.
    pub const COMBINE_NVLINK: u32 = 14;
}

/// The routing status bits (`HTI_STATUS_*`): the single-node notify's, less its slab capacity bit (rounds
/// make every token count fit).
pub use crate::ht::status;

/// Host-mapped words of notify in CPU-synchronised mode (`HN_*`).
pub mod host_notify {
    pub const READY: usize = 0;
    pub const NUM_RECV: usize = 1;
    pub const T_MAX: usize = 2;
    pub const STATUS: usize = 3;
    pub const STATUS_PEER: usize = 4;
    pub const NUM_FWD: usize = 5;
    pub const PER_EXPERT: usize = 8;
    /// Words for `num_local_experts`.
    pub fn words(num_local_experts: usize) -> usize {
        PER_EXPERT + num_local_experts
    }
}

/// Rows are whole multiples of this many bytes (`HTI_ALIGN_LINE` in hti.cuh).
pub const ROW_ALIGN: usize = 128;
/// Whether the RDMA dispatch messages over `transport` are compact (`MSG_COMPACT` in hti.cuh): i16 slots, the
/// header and payload on 64 bytes, where a NIC carries them; else i32 slots on whole lines, where the senders
/// write them in place over NVLink.
pub fn msg_compact(transport: Transport) -> bool {
    match transport {
        Transport::EmuNic => true,
        Transport::Ptr | Transport::Nvshmem => false,
    }
}

fn align(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Bytes of the rows the kernels move, for one call shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowSizes {
    /// An RDMA dispatch message (`MSG_BYTES`).
    pub dispatch_msg: usize,
    /// A dispatch row in an NVLink part (`ROW_BYTES`).
    pub dispatch_row: usize,
    /// A combine row going to the forwarder (`COMBINE_ROW_BYTES`).
    pub combine_row: usize,
    /// A combine partial going home over RDMA (`COMBINE_MSG_BYTES`).
    pub combine_msg: usize,
}

impl RowSizes {
    /// The sizes for hidden `h`, FP8 or bf16, `topk` entries per dispatch row and `combine_topk` weights per
    /// combine row, with messages on whole lines: the largest over every transport, for sizing buffers.
    pub fn new(h: usize, fp8: bool, topk: usize, combine_topk: usize) -> RowSizes {
        RowSizes::over(h, fp8, topk, combine_topk, false)
    }

    /// [`RowSizes::new`] with compact dispatch messages or not ([`msg_compact`]).
    pub fn over(h: usize, fp8: bool, topk: usize, combine_topk: usize, compact: bool) -> RowSizes {
        let payload = if fp8 { h } else { 2 * h };
        let scales = if fp8 { h / 128 } else { 0 };
        // Whole 128-byte lines: a row starts on a line, so that a warp's 512-byte runs of stores cover whole
        // lines on their way over NVLink. A message's header holds 16 bytes, 8 slots (i16 when compact, else
        // i32), the top-k ids and weights and the scales; it and the payload start on 64 bytes when compact,
        // else on lines (hti.cuh says why).
        let line = |n: usize| align(n, ROW_ALIGN);
        let (slot_bytes, msg_align) = if compact { (2, 64) } else { (4, ROW_ALIGN) };
        let msg = |n: usize| align(n, msg_align);
        RowSizes {
            dispatch_msg: msg(msg(16 + 8 * slot_bytes + 8 * topk + 4 * scales) + payload),
            dispatch_row: line(payload + align(4 * (3 * topk + scales + 3), 16)),
            combine_row: line(2 * h + align(4 * combine_topk, 16)),
            combine_msg: line(4 * h + align(4 * combine_topk, 16)),
        }
    }
}

/// The constants of the internode high-throughput kernels (each kernel file compiles with them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HtiVariant {
    pub hidden: usize,
    pub fp8: bool,
    /// Dispatch: top-k entries per row (0: none); combine: weights per row (0: none).
    pub topk: usize,
    pub num_biases: usize,
    pub num_nodes: usize,
    pub ranks_per_node: usize,
    pub transport: Transport,
}

impl HtiVariant {
    /// The variant layout and notify are launched from (they depend only on the topology and transport).
    pub fn control(num_nodes: usize, ranks_per_node: usize, transport: Transport) -> HtiVariant {
        HtiVariant { hidden: 128, fp8: false, topk: 0, num_biases: 0, num_nodes, ranks_per_node, transport }
    }

    pub fn rows(&self) -> RowSizes {
        RowSizes::over(self.hidden, self.fp8, self.topk, self.topk, msg_compact(self.transport))
    }

    /// The compile key of layout ([`HtiVariant::control`]'s).
    pub fn layout_spec(&self) -> KernelSpec {
        self.spec(Family::HtiLayout)
    }

    /// The compile key of notify ([`HtiVariant::control`]'s).
    pub fn notify_spec(&self) -> KernelSpec {
        self.spec(Family::HtiNotify)
    }

    /// The compile key of dispatch.
    pub fn dispatch_spec(&self) -> KernelSpec {
        self.spec(Family::HtiDispatch)
    }

    /// The compile key of combine.
    pub fn combine_spec(&self) -> KernelSpec {
        self.spec(Family::HtiCombine)
    }

    /// The compile key of one of the four kernel files: every one takes every constant (hti.cuh checks them).
    fn spec(&self, family: Family) -> KernelSpec {
        let rows = self.rows();
        let d = |k: &str, v: String| (k.to_string(), v);
        let stem = family.file_name().trim_end_matches(".cu");
        KernelSpec {
            family,
            variant: format!(
                "{stem}[{}x{},h{},{},k{},b{},{}]",
                self.num_nodes,
                self.ranks_per_node,
                self.hidden,
                if self.fp8 { "fp8" } else { "bf16" },
                self.topk,
                self.num_biases,
                self.transport.name()
            ),
            defines: vec![
                d("MOELINK_TRANSPORT", self.transport.code().to_string()),
                d("HTI_MAX_RANKS", HTI_MAX_RANKS.to_string()),
                d("HTI_MAX_NODES", HTI_MAX_NODES.to_string()),
                d("HTI_MAX_CHUNKS", HTI_MAX_CHUNKS.to_string()),
                d("HTI_MAX_LOCAL_EXPERTS", HTI_MAX_LOCAL_EXPERTS.to_string()),
                d("RANKS_PER_NODE", self.ranks_per_node.to_string()),
                d("NUM_NODES", self.num_nodes.to_string()),
                d("HIDDEN", self.hidden.to_string()),
                d("FP8", u32::from(self.fp8).to_string()),
                d("TOPK", self.topk.to_string()),
                d("NUM_BIASES", self.num_biases.to_string()),
                d("HTI_WARPS", HTI_WARPS.to_string()),
                d("HTI_MSG_BYTES", rows.dispatch_msg.to_string()),
                d("HTI_ROW_BYTES", rows.dispatch_row.to_string()),
                d("HTI_COMBINE_ROW_BYTES", rows.combine_row.to_string()),
                d("HTI_COMBINE_MSG_BYTES", rows.combine_msg.to_string()),
                d("HTI_STATE_BYTES", HTI_STATE_BYTES.to_string()),
                d("HTI_TRACE_CHUNKS", HTI_TRACE_CHUNKS.to_string()),
                d("MOELINK_SIZEOF_HTI_LAYOUT_ARGS", std::mem::size_of::<HtiLayoutArgs>().to_string()),
                d("MOELINK_SIZEOF_HTI_NOTIFY_ARGS", std::mem::size_of::<HtiNotifyArgs>().to_string()),
                d("MOELINK_SIZEOF_HTI_DISPATCH_ARGS", std::mem::size_of::<HtiDispatchArgs>().to_string()),
                d("MOELINK_SIZEOF_HTI_COMBINE_ARGS", std::mem::size_of::<HtiCombineArgs>().to_string()),
            ],
        }
    }

    /// The variants the compile check covers: DeepEP's shapes (FP8 and bf16 dispatch with top-8, a cached
    /// dispatch, combine with weights and two biases) at 2 x 8 and 4 x 8, and the test topologies, on every
    /// backend.
    pub fn all() -> Vec<HtiVariant> {
        let mut v = Vec::new();
        for transport in Transport::ALL {
            for (nodes, rpn) in [(2, 8), (4, 8), (2, 2)] {
                for (hidden, fp8, topk, num_biases) in [(7168, true, 8, 0), (7168, false, 8, 0), (7168, false, 0, 0), (7168, false, 8, 2)] {
                    v.push(HtiVariant { hidden, fp8, topk, num_biases, num_nodes: nodes, ranks_per_node: rpn, transport });
                }
            }
            v.push(HtiVariant { hidden: 256, fp8: true, topk: 4, num_biases: 1, num_nodes: 4, ranks_per_node: 2, transport });
        }
        v
    }

    /// The compile keys of [`HtiVariant::all`]: dispatch and combine of each, layout and notify once per
    /// topology and transport.
    pub fn all_specs() -> Vec<KernelSpec> {
        let mut specs = Vec::new();
        let mut controls = Vec::new();
        for v in HtiVariant::all() {
            let c = HtiVariant::control(v.num_nodes, v.ranks_per_node, v.transport);
            if !controls.contains(&c) {
                controls.push(c);
                specs.extend([c.layout_spec(), c.notify_spec()]);
            }
            specs.extend([v.dispatch_spec(), v.combine_spec()]);
        }
        specs
    }
}

/// The RDMA region's offsets (`RdmaAt`), from the region's base.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct RdmaAt {
    pub off_notify_sig: u64,
    pub off_dchunk: u64,
    pub off_dconsumed: u64,
    pub off_cchunk: u64,
    pub off_cconsumed: u64,
    pub off_notify: u64,
    pub off_notify_send: u64,
    pub off_drecv: u64,
    pub off_dsend: u64,
    pub off_crecv: u64,
    pub off_csend: u64,
    pub part_bytes: u64,
    pub msg_words: u32,
    pub pad: u32,
}

/// The node's symmetric buffers (`NvlArgs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct NvlArgs {
    pub base: DevPtrs<8>,
    pub off_done: u64,
    pub off_consumed: u64,
    pub off_cconsumed: u64,
    pub off_dflags: u64,
    pub off_cflags: u64,
    pub off_dparts: u64,
    pub off_cparts: u64,
    pub part_bytes: u64,
    pub flag_slots: u32,
    pub pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtiLayoutArgs {
    pub topk_idx: DevPtr,
    pub topk_stride_token: i64,
    pub topk_stride_k: i64,
    pub num_tokens_per_rank: DevPtr,
    pub num_tokens_per_rdma_rank: DevPtr,
    pub num_tokens_per_expert: DevPtr,
    pub is_token_in_rank: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub num_tokens: u32,
    pub topk: u32,
    pub num_experts: u32,
    pub rank: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtiNotifyArgs {
    pub rdma: RdmaArgs,
    pub at: RdmaAt,
    pub is_token_in_rank: DevPtr,
    pub num_tokens_per_rank: DevPtr,
    pub num_tokens_per_expert: DevPtr,
    pub routing: DevPtr,
    pub host_out: DevPtr,
    pub state: DevPtr,
    pub signature: u64,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub num_tokens: u32,
    pub num_local_experts: u32,
    pub round_tokens: u32,
    pub host_seq: u32,
    /// Host-mapped [`NOTIFY_TRACE_WORDS`] stamps, or 0.
    pub trace: DevPtr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtiDispatchArgs {
    pub rdma: RdmaArgs,
    pub at: RdmaAt,
    pub nvl: NvlArgs,
    pub x: DevPtr,
    pub x_scales: DevPtr,
    pub scale_stride_token: i64,
    pub scale_stride_group: i64,
    pub topk_idx: DevPtr,
    pub topk_weights: DevPtr,
    /// `i32 [E]`: the fresh dispatch's `num_tokens_per_expert`, checked against `topk_idx`; 0: no check.
    pub num_tokens_per_expert: DevPtr,
    /// `u32 [E + 2 E / R + 1]`: the senders' count of the tokens selecting each expert, the receivers' of the
    /// rows selecting each local expert (both 0 between calls), then the kernel's copy of notify's READY word
    /// and per-expert sums ([`HTI_EXPERT_TOKENS_BYTES`]).
    pub expert_tokens: DevPtr,
    /// Notify's host-mapped words of call `host_seq` (CPU-synchronised fresh dispatch with top-k): the rows
    /// per local expert it summed are checked against the arriving rows' top-k ids, unless the words hold
    /// another call's by then; 0: no check.
    pub host_notify: DevPtr,
    pub recv_x: DevPtr,
    pub recv_scales: DevPtr,
    pub recv_topk_idx: DevPtr,
    pub recv_topk_weights: DevPtr,
    pub recv_src_idx: DevPtr,
    pub routing: DevPtr,
    pub fwd_entries: DevPtr,
    pub recv_route: DevPtr,
    pub state: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub num_tokens: u32,
    pub num_out_rows: u32,
    pub fwd_capacity: u32,
    pub num_local_experts: u32,
    pub chunk_tokens: u32,
    pub num_send_blocks: u32,
    pub num_fwd_blocks: u32,
    pub fwd_per_node: u32,
    /// The notify call whose words `host_notify` holds for this dispatch.
    pub host_seq: u32,
    pub pad: u32,
    /// Host-mapped timing trace ([`trace_words`]), or 0.
    pub trace: DevPtr,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, NoUninit, Zeroable)]
pub struct HtiCombineArgs {
    pub rdma: RdmaArgs,
    pub at: RdmaAt,
    pub nvl: NvlArgs,
    pub x: DevPtr,
    pub topk_weights: DevPtr,
    pub bias0: DevPtr,
    pub bias1: DevPtr,
    pub combined_x: DevPtr,
    pub combined_topk_weights: DevPtr,
    pub routing: DevPtr,
    pub fwd_entries: DevPtr,
    pub recv_route: DevPtr,
    pub state: DevPtr,
    pub error_claim: DevPtr,
    pub error_record: DevPtr,
    pub timeout_ns: u64,
    pub num_tokens: u32,
    pub num_x_rows: u32,
    pub chunk_tokens: u32,
    pub num_send_blocks: u32,
    pub num_fwd_blocks: u32,
    pub fwd_per_node: u32,
    /// Host-mapped timing trace ([`trace_words`]), or 0.
    pub trace: DevPtr,
}

/// Notify's trace (`NOTIFY_TRACE_*` in hti.cuh): `%globaltimer` when it started, read its epoch, counted
/// every prefix column, had the totals and the layout checks, put its messages, stored the prefixes, saw
/// every message, and ended (before READY and the quiet).
pub const NOTIFY_TRACE_WORDS: usize = 8;
pub const NOTIFY_TRACE_POINTS: [&str; NOTIFY_TRACE_WORDS] = ["start", "epoch", "counted", "checked", "sent", "prefixed", "received", "end"];

/// Timing trace (`HTI_TRACE_*` in hti.cuh): per block of the grid [`HTI_TRACE_BLOCK_WORDS`] u64
/// words (block start and end, then each warp's role start and end), then [`HTI_TRACE_CHUNKS`] records of
/// [`HTI_TRACE_CHUNK_WORDS`] for the dispatch senders' / combine reducers' chunks, then as many per source
/// node for the forwarders' chunks. `%globaltimer` nanoseconds, 0 where not reached.
pub const HTI_TRACE_BLOCK_WORDS: usize = {
    let role_words = 2 + 2 * HTI_WARPS as usize;
    // An emulated NIC block stores its statistics in its block's words (hti.cuh takes the larger).
    if role_words > crate::transport::nic_stat::WORDS {
        role_words
    } else {
        crate::transport::nic_stat::WORDS
    }
};
/// Chunk records per area of the trace (chunks past it are not stamped).
pub const HTI_TRACE_CHUNKS: usize = 1024;
/// Words per chunk record.
pub const HTI_TRACE_CHUNK_WORDS: usize = 3;

/// u64 words of the timing trace of a launch of `blocks` blocks (the emulated NIC's included) on `num_nodes` nodes.
pub const fn trace_words(blocks: usize, num_nodes: usize) -> usize {
    blocks * HTI_TRACE_BLOCK_WORDS + (1 + num_nodes) * HTI_TRACE_CHUNKS * HTI_TRACE_CHUNK_WORDS
}

/// Bytes of a rank's per-expert token counts (`HtiDispatchArgs::expert_tokens`, at fixed offsets): notify's
/// READY word and one `u32` per local expert, the receivers' count per local expert, the senders' per expert
/// of the largest buffer.
pub const HTI_EXPERT_TOKENS_BYTES: usize = 4 * ((HTI_MAX_RANKS + 2) * HTI_MAX_LOCAL_EXPERTS + 1);

/// Bytes of the local state (`HtiState`, then `HtiForward`: per node, chunks done, messages before the
/// round, rows per local rank, combine chunks done, combine rounds handed back; per source, the receiver
/// warps done with its round; per chunk of a round, the dispatch tokens staged).
pub const HTI_STATE_BYTES: usize = 64 + 4 * (4 * HTI_MAX_NODES + 8 * HTI_MAX_NODES) + 4 * HTI_MAX_RANKS + 4 * HTI_MAX_CHUNKS;

/// The routing buffer's word offsets (`RoutingAt` and the `RT_*` header) for `R` ranks over `N` nodes and
/// `T` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoutingLayout {
    pub recv_offset: usize,
    pub recv_count: usize,
    pub tokens_of: usize,
    pub fwd_offset: usize,
    pub fwd_count: usize,
    pub rank_prefix: usize,
    pub prefix: usize,
    pub node_prefix: usize,
    /// `[T + 1][N]`: per node, the tokens before t that go to two or more of its ranks (their combine
    /// messages are fp32 partials; the others' are bf16 rows).
    pub multi_prefix: usize,
    /// Words in all.
    pub words: usize,
}

/// Header words of the routing buffer (`RT_*`).
pub mod routing {
    pub const STATUS: usize = 0;
    pub const STATUS_PEER: usize = 1;
    pub const NUM_RECV: usize = 2;
    pub const T_MAX: usize = 3;
    pub const NUM_ROUNDS: usize = 4;
    pub const ROUND_TOKENS: usize = 5;
    pub const NUM_FWD: usize = 6;
    pub const HEADER: usize = 8;
}

impl RoutingLayout {
    pub fn new(num_ranks: usize, num_nodes: usize, num_tokens: usize) -> RoutingLayout {
        let (r, n) = (num_ranks, num_nodes);
        let recv_offset = routing::HEADER;
        let recv_count = recv_offset + r;
        let tokens_of = recv_count + r;
        let fwd_offset = tokens_of + r;
        let fwd_count = fwd_offset + n;
        let rank_prefix = fwd_count + n;
        let prefix = align(rank_prefix + r * r, 4);
        let node_prefix = prefix + (num_tokens + 1) * r;
        let multi_prefix = node_prefix + (num_tokens + 1) * n;
        let words = multi_prefix + (num_tokens + 1) * n;
        RoutingLayout { recv_offset, recv_count, tokens_of, fwd_offset, fwd_count, rank_prefix, prefix, node_prefix, multi_prefix, words }
    }
}

/// Bytes of the signal words [`signal_offsets`] lays out.
pub const HT_SIGNAL_BYTES: usize = 2 * HTI_MAX_RANKS * 8 + 2 * (HTI_MAX_NODES * HTI_MAX_CHUNKS * 8) + 2 * 256;

/// Where the internode HT kernels' signal words sit in the RDMA control area (offsets from the region's
/// base), and how many bytes they take from `base`.
pub fn signal_offsets(base: usize) -> (RdmaAt, usize) {
    let mut at = base;
    let mut take = |bytes: usize| {
        let o = at;
        at = align(at + bytes, 256);
        o as u64
    };
    let r = RdmaAt {
        off_notify_sig: take(2 * HTI_MAX_RANKS * 8),
        off_dchunk: take(HTI_MAX_NODES * HTI_MAX_CHUNKS * 8),
        off_dconsumed: take(HTI_MAX_NODES * 8),
        off_cchunk: take(HTI_MAX_NODES * HTI_MAX_CHUNKS * 8),
        off_cconsumed: take(HTI_MAX_NODES * 8),
        ..RdmaAt::default()
    };
    (r, at - base)
}

/// The RDMA region's layout for `num_rdma_bytes` of data from `data_base`, `R` ranks over `N` nodes: the
/// signal words at `signal_base` (inside the control area), the notify area, then four equal areas (dispatch
/// receive and send, combine receive and send) of `N` parts each. `None` when the notify area does not fit.
pub fn rdma_layout(signal_base: usize, data_base: usize, num_rdma_bytes: usize, num_ranks: usize, num_nodes: usize) -> Option<RdmaAt> {
    let (mut at, _) = signal_offsets(signal_base);
    let msg_words = NOTIFY_HEADER_WORDS + num_ranks + HTI_MAX_LOCAL_EXPERTS;
    let notify = align(2 * num_ranks * msg_words * 4, 256);
    let notify_send = align(num_ranks * msg_words * 4, 256);
    let rest = num_rdma_bytes.checked_sub(notify + notify_send)?;
    let part = rest / 4 / num_nodes / 256 * 256;
    at.off_notify = data_base as u64;
    at.off_notify_send = (data_base + notify) as u64;
    let parts = data_base + notify + notify_send;
    at.off_drecv = parts as u64;
    at.off_dsend = (parts + num_nodes * part) as u64;
    at.off_crecv = (parts + 2 * num_nodes * part) as u64;
    at.off_csend = (parts + 3 * num_nodes * part) as u64;
    at.part_bytes = part as u64;
    at.msg_words = msg_words as u32;
    Some(at)
}

/// `num_rdma_bytes` the RDMA layout needs for rounds of `round_tokens` tokens of this shape.
pub fn rdma_bytes_needed(num_ranks: usize, num_nodes: usize, round_tokens: usize, rows: RowSizes) -> usize {
    let msg_words = NOTIFY_HEADER_WORDS + num_ranks + HTI_MAX_LOCAL_EXPERTS;
    let notify = align(2 * num_ranks * msg_words * 4, 256) + align(num_ranks * msg_words * 4, 256);
    let part = align(round_tokens * rows.dispatch_msg.max(rows.combine_msg), 256);
    notify + 4 * num_nodes * part
}

/// Where the internode HT kernels' words sit in the node's symmetric buffer: words at `ctrl_base` (in the
/// HT control area), flags and parts in the data region at `data_base` (`num_nvl_bytes`). Flag slots:
/// enough for the rounds the parts can hold of rows of at least 256 bytes, at most HTI_MAX_ROUND_TOKENS.
pub fn nvl_layout(ctrl_base: usize, data_base: usize, num_nvl_bytes: usize, num_ranks: usize, num_nodes: usize) -> NvlArgs {
    let rpn = num_ranks / num_nodes.max(1);
    let flag_slots = (num_nvl_bytes / (2 * num_ranks * (4 + 256))).clamp(1, HTI_MAX_ROUND_TOKENS);
    let flags = align(num_ranks * flag_slots * 4, 256);
    let part = num_nvl_bytes.saturating_sub(2 * flags) / (2 * num_ranks) / 128 * 128;
    let words = align(num_ranks * 8, 256);
    let pairs = align(rpn * num_nodes * 8, 256);
    NvlArgs {
        base: DevPtrs::default(),
        off_done: ctrl_base as u64,
        off_consumed: (ctrl_base + words) as u64,
        off_cconsumed: (ctrl_base + words + pairs) as u64,
        off_dflags: data_base as u64,
        off_cflags: (data_base + flags) as u64,
        off_dparts: (data_base + 2 * flags) as u64,
        off_cparts: (data_base + 2 * flags + num_ranks * part) as u64,
        part_bytes: part as u64,
        flag_slots: flag_slots as u32,
        pad: 0,
    }
}

/// Bytes of the HT control words `nvl_layout` puts at `ctrl_base`.
pub fn nvl_ctrl_bytes(num_ranks: usize, num_nodes: usize) -> usize {
    let rpn = num_ranks / num_nodes.max(1);
    align(num_ranks * 8, 256) + 2 * align(rpn * num_nodes * 8, 256)
}

/// `num_nvl_bytes` the NVLink layout needs for rounds of `round_tokens` tokens of this shape.
pub fn nvl_bytes_needed(num_ranks: usize, round_tokens: usize, rows: RowSizes) -> usize {
    let per_part = align(round_tokens * rows.dispatch_row.max(rows.combine_row), 128);
    // nvl_layout gives num_nvl_bytes / (2 R (4 + 256)) flag slots (up to HTI_MAX_ROUND_TOKENS), so the flag
    // areas grow with the size asked for: the least size whose parts, after the flags it gets, still hold
    // round_tokens rows (a fixed point, reached in a few steps: the flags take ~1.5 % of each step).
    let flag_bytes = |nvl: usize| align(num_ranks * (nvl / (2 * num_ranks * (4 + 256))).clamp(1, HTI_MAX_ROUND_TOKENS) * 4, 256);
    let mut nvl = 2 * num_ranks * per_part;
    loop {
        let need = (2 * num_ranks * per_part + 2 * flag_bytes(nvl)).max(2 * num_ranks * (4 + 256) * round_tokens);
        if need <= nvl {
            return nvl;
        }
        nvl = need;
    }
}

/// Tokens per round (M) and per chunk (Q) for a call of `rows` on these layouts, with `chunk_tokens` asked
/// for: the most every part holds, rounded down to whole chunks, with at most HTI_MAX_CHUNKS chunks a
/// round. `None` when not even one token fits.
pub fn round_shape(rdma: &RdmaAt, nvl: &NvlArgs, rows: RowSizes, chunk_tokens: usize) -> Option<(usize, usize)> {
    let rdma_part = rdma.part_bytes as usize;
    let nvl_part = nvl.part_bytes as usize;
    let m = (rdma_part / rows.dispatch_msg.max(rows.combine_msg))
        .min(nvl_part / rows.dispatch_row.max(rows.combine_row))
        .min(nvl.flag_slots as usize);
    if m == 0 {
        return None;
    }
    let q = chunk_tokens.clamp(1, m).max(m.div_ceil(HTI_MAX_CHUNKS));
    let m = m / q * q;
    Some((m, q))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_kernel_formulas() {
        let r = RowSizes::new(7168, true, 8, 8);
        assert_eq!(r.dispatch_msg, 384 + 7168);
        assert_eq!(RowSizes::over(7168, true, 8, 8, true).dispatch_msg, 320 + 7168);
        assert_eq!(r.dispatch_row, 7168 + 384);
        assert_eq!(r.combine_row, 14336 + 128);
        assert_eq!(r.combine_msg, 28672 + 128);
        let b = RowSizes::new(256, false, 0, 0);
        assert_eq!((b.dispatch_msg, b.dispatch_row, b.combine_row, b.combine_msg), (128 + 512, 512 + 128, 512, 1024));
    }

    #[test]
    fn layouts_fit_their_regions_and_rounds_are_whole_chunks() {
        let (sig, sig_bytes) = signal_offsets(64 << 10);
        assert!(sig.off_cconsumed as usize + 8 * HTI_MAX_NODES <= (64 << 10) + sig_bytes);
        assert_eq!(sig_bytes, HT_SIGNAL_BYTES);
        let rdma = rdma_layout(64 << 10, 512 << 10, 1 << 30, 16, 2).unwrap();
        assert!(rdma.off_csend as usize + 2 * rdma.part_bytes as usize <= (512 << 10) + (1 << 30));
        let nvl = nvl_layout(1 << 20, 4 << 20, 1 << 30, 16, 2);
        assert!(nvl.off_cparts as usize + 16 * nvl.part_bytes as usize <= (4 << 20) + (1 << 30));
        let rows = RowSizes::new(7168, true, 8, HTI_MAX_TOPK);
        let (m, q) = round_shape(&rdma, &nvl, rows, 32).unwrap();
        assert!(m >= 1024 && m % q == 0 && m / q <= HTI_MAX_CHUNKS, "{m} {q}");
        // The sizes the helpers say are needed give those rounds back, whole (a round short of the tokens
        // asked for leaves a last round of a few tokens, which waits for every earlier one to drain).
        for (ranks, nodes, tokens, fp8) in
            [(16, 2, 512, true), (2, 2, 4096, false), (2, 2, 4096, true), (4, 2, 4096, false), (64, 8, 128, false)]
        {
            let rows = RowSizes::new(7168, fp8, 8, HTI_MAX_TOPK);
            let rdma = rdma_layout(64 << 10, 512 << 10, rdma_bytes_needed(ranks, nodes, tokens, rows), ranks, nodes).unwrap();
            let nvl = nvl_layout(1 << 20, 4 << 20, nvl_bytes_needed(ranks, tokens, rows), ranks, nodes);
            assert_eq!(round_shape(&rdma, &nvl, rows, 8).unwrap().0, tokens, "{ranks} ranks on {nodes} nodes, {tokens} tokens, fp8 {fp8}");
        }
        // Too small: no round at all.
        let tiny = rdma_layout(64 << 10, 512 << 10, rdma_bytes_needed(16, 2, 0, rows) + 1024, 16, 2).unwrap();
        assert!(round_shape(&tiny, &nvl, rows, 32).is_none());
    }

    #[test]
    fn routing_layout_is_aligned() {
        let l = RoutingLayout::new(16, 2, 4096);
        assert_eq!(l.prefix % 4, 0);
        assert_eq!(l.multi_prefix, l.node_prefix + 4097 * 2);
        assert_eq!(l.words, l.multi_prefix + 4097 * 2);
    }
}
