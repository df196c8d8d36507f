// What the internode high-throughput kernels share (moelink_kernels::ht_internode; one kernel per file:
// hti_layout.cu, hti_notify.cu, hti_dispatch.cu, hti_combine.cu). DeepEP's hierarchy on moelink's transport seam: a token crosses the RDMA
// domain at most once per destination node — to the rank with the sender's local index there, its rail
// peer — which forwards it over NVLink to the ranks of its node that host the token's experts; combine runs
// backwards, the rail peer summing its node's rows for a token (fp32) so that one partial per (token, node)
// crosses the RDMA domain home. The outputs are the intranode kernels' (ht_dispatch.cu, ht_combine.cu), bit
// for bit: rows ordered by source rank then token, and the combine's hierarchical fp32 tree (docs/oracle.md).
//
// JIT constants (from moelink_kernels::ht_internode::HtiVariant):
//   MOELINK_TRANSPORT            the seam's backend (transport.cuh)
//   HTI_MAX_RANKS                ranks the shared arrays have room for (num_ranks <= this)
//   HTI_MAX_NODES                nodes (<= 32: one lane per node)
//   HTI_MAX_CHUNKS               chunk signal words per (peer node) and round
//   HTI_MAX_LOCAL_EXPERTS        experts per rank the dispatch's per-expert counts have room for
//   RANKS_PER_NODE, NUM_NODES    the topology (the combine's trees unroll over them)
//   HIDDEN, FP8, TOPK            dispatch payload: channels, e4m3 + fp32 scales per 128 or bf16, top-k entries
//                                travelling with each token (0: none, e.g. a cached dispatch); combine: TOPK
//                                weights per row (0: none)
//   NUM_BIASES                   biases the combine adds (0, 1 or 2)
//   HTI_WARPS                    warps per block
//   HTI_MSG_BYTES, HTI_ROW_BYTES, HTI_COMBINE_ROW_BYTES, HTI_COMBINE_MSG_BYTES  the row sizes as Rust computes them
//   HTI_STATE_BYTES              bytes of a rank's local state (HtiState + HtiForward)
//   HTI_TRACE_CHUNKS             chunk records per area of the timing trace
//   MOELINK_SIZEOF_HTI_*_ARGS    sizeof of each argument struct on the Rust side
//
// Topology: R = NUM_NODES x RANKS_PER_NODE ranks, rank r = node(r) * L + local(r). Rank (a, l) is the "rail
// source" of its rail peers (b, l) on every node b, its own node included (a token for its own node goes to
// itself first, through the same path).
//
// Rounds bound the buffers for any token count: round k of a source covers its tokens [k*M, (k+1)*M), M =
// round_tokens (the most a buffer part holds, the same on every rank), and every call runs K = ceil(T_max /
// M) rounds, T_max being the largest token count of any rank. Per (source, peer) pair rounds are sequential
// and handed back (below); different pairs run at their own pace. A round of call e has the sequence number
// seq = base + k + 1, base counting every earlier call's rounds (HtiState), so flags and signals only grow.
//
// Dispatch, round k of source s = (a, l):
//   sender (s):      tokens in order from a per-call counter, in chunks of Q. For each destination node b: wait
//                    until (b, l) handed round k - 1 back (d_consumed[b] >= base + k); write each token's
//                    message m (the token's index among this round's tokens for node b, node_prefix) into
//                    (b, l)'s receive part [a][m] in place where stores reach it (rdma::window), else at send
//                    part [b][m]; once the chunk's tokens are staged (by any warps), the warp that staged the
//                    last one sends the chunk's messages [m0, m1) there with SET (seq << 32 | m1) on its
//                    chunk word d_chunk[a][chunk] (put_window_signal: one put_signal, or fenced stores and the
//                    signal; a bare signal for an empty chunk). Data, then its chunk word.
//   forwarder ((b, l), fwd_per_node warps per source node a, units dealt round-robin among them: a chunk,
//                    or a contiguous share of one (every chunk through a NIC, a round's last ones by stores;
//                    FWD_UNITS)): per unit (its chunk's word and
//                    the one before give the chunk's messages); each message goes to every rank j
//                    of this node it has a slot at: the row (payload + meta, top-k ids as j's local ids) into
//                    j's dispatch part [s][slot mod M] over NVLink, after j handed that part back for round k
//                    - 1 (nvl_consumed[j][a] >= base + k); every RELEASE rows, and at a unit's end, a fence,
//                    then the rows' flags = seq. Records the message's ranks and round for combine
//                    (fwd_entries). The warp that finishes a round's last unit ends the round: done[s] = seq
//                    << 32 | rows at every j; then d_consumed[b] = seq at s (final round: base + K, what the next
//                    call's round 0 waits for).
//   receiver ((b, j), one lane per source, or S warps per source taking every S-th slot; the last of the S
//                    to finish a round hands it back): rows whose flag reached seq, in slot order, into the outputs at
//                    recv_offset[s] + slot, with the row's (round, message) into recv_route; once done[s]
//                    says the round's rows are all here, nvl_consumed[j][a] = seq at the forwarder.
// Combine, round k of home s = (a, l), messages as dispatch left them:
//   sender ((b, j), one lane per source, or S warps per source taking every S-th row): each received row
//                    goes back to its forwarder (b, l) into combine part
//                    [j][a][message mod M], after the forwarder handed it back (c_nvl_consumed[l][a] >= cbase +
//                    k); flags = cseq.
//   forwarder ((b, l), fwd_per_node warps per source node a): per message, waits for the rows of the ranks it went to,
//                    sums them as the tree's node level (fp32, absent ranks +0.0), writes the partial (fp32
//                    row and weights; where one rank held the token, its bf16 row as it is) for s's part
//                    [b][m] (in place or staged at [a][m], as dispatch's sender) once s handed round k - 1
//                    back (c_consumed[a] >= cbase + k),
//                    put_signals each chunk to s's combine receive part [b][m0, m1) with its chunk word; at
//                    round end c_nvl_consumed[l][a] = cseq at every j.
//   reducer (s):     tokens in order, one at a time, one round at a time: the partial of every node it
//                    reached (chunk word c_chunk[b][chunk] >= cseq; a bf16 row where its routing says one rank
//                    of the node held it, + 0.0 as the node tree adds), summed as the tree's upper level, + 0.0,
//                    the biases, rounded to bf16; after a round's last token, c_consumed[a] = cseq at every
//                    rail peer (b, l).
// Every wait has the caller's deadline and names the peer and the domain (phase HTI_*_RDMA / _NVLINK); a
// kernel that timed out winds down without handing back, so its peers time out too. Argument problems found on
// the device (layout tensors that disagree with each other or with topk_idx, no-sync overflow) are reported
// and the protocol goes on.
// Included by each kernel file; a guard, not #pragma once, so that the CPU emulator can include the kernels
// a second time with other constants inside a namespace.
#ifndef MOELINK_HTI_CUH
#define MOELINK_HTI_CUH
#include "transport.cuh"

#if !defined(HTI_MAX_RANKS) || !defined(HTI_MAX_NODES) || !defined(HTI_MAX_CHUNKS) || !defined(HTI_MAX_LOCAL_EXPERTS) || !defined(RANKS_PER_NODE) || \
    !defined(NUM_NODES) || !defined(HIDDEN) || !defined(FP8) || !defined(TOPK) || !defined(NUM_BIASES) ||            \
    !defined(HTI_WARPS) || !defined(MOELINK_SIZEOF_HTI_LAYOUT_ARGS) || !defined(MOELINK_SIZEOF_HTI_NOTIFY_ARGS) ||  \
    !defined(MOELINK_SIZEOF_HTI_DISPATCH_ARGS) || !defined(MOELINK_SIZEOF_HTI_COMBINE_ARGS) || !defined(HTI_MSG_BYTES) ||      \
    !defined(HTI_ROW_BYTES) || !defined(HTI_COMBINE_ROW_BYTES) || !defined(HTI_COMBINE_MSG_BYTES) || !defined(HTI_STATE_BYTES) ||  \
    !defined(HTI_TRACE_CHUNKS)
#error "hti.cuh needs every JIT constant listed at the top of the file"
#endif
static_assert(NUM_NODES >= 1 && NUM_NODES <= HTI_MAX_NODES && HTI_MAX_NODES <= WARP_SIZE, "one lane per node");
static_assert(RANKS_PER_NODE >= 1 && RANKS_PER_NODE <= 8, "a node has at most 8 ranks (one mask byte)");
static_assert(NUM_NODES * RANKS_PER_NODE <= HTI_MAX_RANKS, "ranks fit the shared arrays");
static_assert(NUM_BIASES <= 2, "at most two biases");
static_assert(TOPK <= WARP_SIZE, "one lane per top-k entry");

constexpr u32 NUM_RANKS = NUM_NODES * RANKS_PER_NODE;
constexpr u32 THREADS = HTI_WARPS * WARP_SIZE;
constexpr u32 VEC_BYTES = 16;
constexpr u32 FP8_BLOCK = 128;
// Phases of the error records: which kernel, and which domain a wait was in.
constexpr u32 PHASE_HTI_NOTIFY = 10;
constexpr u32 PHASE_HTI_DISPATCH_RDMA = 11;
constexpr u32 PHASE_HTI_DISPATCH_NVLINK = 12;
constexpr u32 PHASE_HTI_COMBINE_RDMA = 13;
constexpr u32 PHASE_HTI_COMBINE_NVLINK = 14;

#define HTI_ALIGN16(x) (((x) + 15u) / 16u * 16u)
// Rows are whole 128-byte lines (moelink_kernels::ht_internode::ROW_ALIGN): every row starts on a line, and a
// warp's 512-byte runs of stores cover whole lines on their way over NVLink.
#define HTI_ALIGN_LINE(x) (((x) + 127u) / 128u * 128u)
// An RDMA dispatch message and its payload start on MSG_ALIGN bytes (moelink_kernels::ht_internode::msg_compact).
// Where a NIC carries the messages (the emulated NIC), the header is compact (i16 slots) on 64 bytes, two of
// a line's four sectors, so that an FP8 message's 320-byte header does not pad a line (0.85 % of what
// crosses the NIC). Where the senders write the messages in place over NVLink (`ptr`; NVSHMEM, whose peers
// on one host are mapped), whole lines and i32 slots: the compact form made the FP8 dispatch 5-14 us slower
// there (bench/results/2026-12-01-2xnvidia-h200-a8c3f75-internode-msg-align).
constexpr bool MSG_COMPACT = MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC;
constexpr u32 MSG_ALIGN = MSG_COMPACT ? 64u : 128u;
#define HTI_ALIGN_MSG(x) (((x) + MSG_ALIGN - 1u) / MSG_ALIGN * MSG_ALIGN)
// The smallest power of two >= N (N <= 64).
template <u32 N>
struct NextPow2 {
  static constexpr u32 value = N <= 1 ? 1 : N <= 2 ? 2 : N <= 4 ? 4 : N <= 8 ? 8 : N <= 16 ? 16 : N <= 32 ? 32 : 64;
};
__device__ __forceinline__ u32 hti_min(u32 x, u32 y) { return x < y ? x : y; }

// ---------------------------------------------------------------------------------------------- rows
// Dispatch payload.
constexpr u32 PAYLOAD_BYTES = HIDDEN * (FP8 ? 1 : 2);
constexpr u32 PAYLOAD_VECS = PAYLOAD_BYTES / VEC_BYTES;
constexpr u32 NUM_SCALES = FP8 ? HIDDEN / FP8_BLOCK : 0;
static_assert(PAYLOAD_BYTES % VEC_BYTES == 0 && PAYLOAD_VECS >= 1, "rows are whole 16-byte vectors");
static_assert(!FP8 || HIDDEN % FP8_BLOCK == 0, "FP8 hidden is a multiple of the scale block");
// An RDMA dispatch message: u32 token, u32 mask (bit j: goes to local rank j), u32 layout tag (MSG_TAG), 4
// bytes of padding; the row's slot at each local rank of the destination node, -1 elsewhere (MsgSlot [8]:
// compact, i16 within the round; else i32, the rank's running count); i32 top-k ids (global, -1 for none);
// f32 weights; f32 scales; the payload at HTI_ALIGN_MSG.
template <bool COMPACT>
struct MsgSlotOf {
  typedef i32 type;
};
template <>
struct MsgSlotOf<true> {
  typedef i16 type;
};
typedef MsgSlotOf<MSG_COMPACT>::type MsgSlot;
constexpr u32 MSG_SLOTS = 16;
constexpr u32 MSG_IDS = MSG_SLOTS + 8 * sizeof(MsgSlot);
constexpr u32 MSG_WEIGHTS = MSG_IDS + 4 * TOPK;
constexpr u32 MSG_SCALES = MSG_WEIGHTS + 4 * TOPK;
constexpr u32 MSG_PAYLOAD = HTI_ALIGN_MSG(MSG_SCALES + 4 * NUM_SCALES);
constexpr u32 MSG_BYTES = HTI_ALIGN_MSG(MSG_PAYLOAD + PAYLOAD_BYTES);
// What a message's layout depends on, so that a forwarder reading a message of another kernel variant (a
// host that chose the variant differently on one rank) stops with ERR_PEER_LAYOUT instead of forwarding
// garbage to addresses taken from it.
constexpr u32 MSG_TAG = 0xa0000000u | (FP8 ? 1u << 27 : 0u) | (TOPK << 20) | HIDDEN;
static_assert(HIDDEN < (1u << 20) && TOPK < 128, "the layout tag holds HIDDEN and TOPK");
// A row in an NVLink dispatch part: the payload, then u32 meta words: the top-k ids as the receiver's local
// i64 ids (two words each, low first), the scales, the weights (0 where the id is -1 there), the source's
// token index, the message index and the round (for combine); padded to 16 bytes, the row to a whole line.
constexpr u32 META_SCALES = 2 * TOPK;
constexpr u32 META_WEIGHTS = META_SCALES + NUM_SCALES;
constexpr u32 META_SRC = META_WEIGHTS + TOPK;
constexpr u32 META_MESSAGE = META_SRC + 1;
constexpr u32 META_ROUND = META_MESSAGE + 1;
constexpr u32 META_WORDS = META_ROUND + 1;
constexpr u32 ROW_BYTES = HTI_ALIGN_LINE(PAYLOAD_BYTES + HTI_ALIGN16(4 * META_WORDS));
// Combine: a row going to the forwarder is the bf16 payload and TOPK f32 weights; a partial going home is
// the fp32 sum and TOPK f32 weight sums.
constexpr u32 CPAYLOAD_BYTES = 2 * HIDDEN;
constexpr u32 COMBINE_ROW_BYTES = HTI_ALIGN_LINE(CPAYLOAD_BYTES + HTI_ALIGN16(4 * TOPK));
constexpr u32 COMBINE_MSG_BYTES = HTI_ALIGN_LINE(4 * HIDDEN + HTI_ALIGN16(4 * TOPK));
static_assert(CPAYLOAD_BYTES % VEC_BYTES == 0, "bf16 rows are whole 16-byte vectors");
// The partials of a round go home packed: where one rank of the node held the token, its bf16 row and the
// weights (COMBINE_ROW_BYTES, weights at CPAYLOAD_BYTES), else the fp32 partial (COMBINE_MSG_BYTES, weights
// at 4 * HIDDEN). Message m starts after m row-sized messages plus the extra of each fp32 one before it in
// the round (the reducer counts them with multi_prefix, the forwarder from its fwd_entries), so that a
// chunk's put carries only the bytes its messages hold.
constexpr u32 COMBINE_EXTRA_BYTES = COMBINE_MSG_BYTES - COMBINE_ROW_BYTES;
__device__ __forceinline__ u64 combine_msg_at(u32 m, u32 multi_before) {
  return (u64)m * COMBINE_ROW_BYTES + (u64)multi_before * COMBINE_EXTRA_BYTES;
}
static_assert(MSG_BYTES == HTI_MSG_BYTES && ROW_BYTES == HTI_ROW_BYTES && COMBINE_ROW_BYTES == HTI_COMBINE_ROW_BYTES && COMBINE_MSG_BYTES == HTI_COMBINE_MSG_BYTES,
              "row sizes mirror moelink_kernels::ht_internode::RowSizes");
// How many rows a warp writes before one fence releases their flags.
constexpr u32 RELEASE_ROWS = 4;
// A forwarder's fwd_entries word: bits 0..7 the local ranks the message went to, the round above.
constexpr u32 ENTRY_ROUND_SHIFT = 8;
__device__ __forceinline__ bool entry_is_multi(u32 entry) { return __popc(entry & 0xffu) > 1; }

// ---------------------------------------------------------------------------------------------- routing
// The handle's routing buffer (i32 words, written by notify): a header, then arrays whose offsets depend on
// R and T (moelink_kernels::ht_internode::RoutingLayout mirrors them).
constexpr u32 RT_STATUS = 0;        // HTI_STATUS_* (0: the call may move data)
constexpr u32 RT_STATUS_PEER = 1;   // the rank the status blames, or NO_PEER
constexpr u32 RT_NUM_RECV = 2;      // rows this rank receives
constexpr u32 RT_T_MAX = 3;         // the largest token count of any rank
constexpr u32 RT_NUM_ROUNDS = 4;    // K = ceil(T_max / M)
constexpr u32 RT_ROUND_TOKENS = 5;  // M
constexpr u32 RT_NUM_FWD = 6;       // messages this rank forwards (sum of fwd_count)
constexpr u32 RT_HEADER = 8;
struct RoutingAt {
  u32 recv_offset, recv_count, tokens_of, fwd_offset, fwd_count, rank_prefix, prefix, node_prefix, multi_prefix;
};
__device__ __forceinline__ RoutingAt routing_at(u32 num_tokens) {
  RoutingAt r;
  r.recv_offset = RT_HEADER;
  r.recv_count = r.recv_offset + NUM_RANKS;
  r.tokens_of = r.recv_count + NUM_RANKS;
  r.fwd_offset = r.tokens_of + NUM_RANKS;
  r.fwd_count = r.fwd_offset + NUM_NODES;
  r.rank_prefix = r.fwd_count + NUM_NODES;
  r.prefix = (r.rank_prefix + NUM_RANKS * NUM_RANKS + 3u) / 4u * 4u;
  r.node_prefix = r.prefix + (num_tokens + 1) * NUM_RANKS;
  r.multi_prefix = r.node_prefix + (num_tokens + 1) * NUM_NODES;
  return r;
}
// Status bits (the same on every rank: derived from every rank's notify message).
constexpr u32 HTI_STATUS_BAD_LAYOUT = 1;   // some rank's num_tokens_per_rank disagrees with its is_token_in_rank
constexpr u32 HTI_STATUS_MISMATCH = 2;
constexpr u32 HTI_STATUS_FAILED = 8;
constexpr u32 HTI_STATUS_BAD_EXPERTS = 16;  // some rank's num_tokens_per_expert disagrees with its num_tokens_per_rank

// Host-mapped words notify writes in CPU-synchronised mode; READY last (release).
constexpr u32 HN_READY = 0;
constexpr u32 HN_NUM_RECV = 1;
constexpr u32 HN_T_MAX = 2;
constexpr u32 HN_STATUS = 3;
constexpr u32 HN_STATUS_PEER = 4;
constexpr u32 HN_NUM_FWD = 5;
constexpr u32 HN_PER_EXPERT = 8;  // [E_local] received tokens per local expert

// Notify message words (what a rank tells every rank before a fresh dispatch).
constexpr u32 MSG_W_COUNT = 0;       // tokens the source sends to this destination
constexpr u32 MSG_W_TOKENS = 1;      // the source's token count
constexpr u32 MSG_W_STATUS = 2;      // HTI_STATUS_BAD_LAYOUT / _BAD_EXPERTS when its layout tensors disagree
constexpr u32 MSG_W_SIG_LO = 3;      // the source's call signature
constexpr u32 MSG_W_SIG_HI = 4;
constexpr u32 MSG_W_NODE_COUNT = 5;  // tokens the source sends to this destination's node
constexpr u32 MSG_W_ROW = 8;         // [R]: the source's tokens per rank (the count matrix row)
// then [E_local]: the source's tokens per local expert of this destination

// ---------------------------------------------------------------------------------------------- state
// A rank's local state (device memory; moelink_kernels::ht_internode::HtiState).
struct HtiState {
  u32 notify_epoch;
  u32 dispatch_base;       // rounds of every earlier dispatch
  u32 combine_base;        // rounds of every earlier combine
  u32 dispatch_done;       // blocks of the running dispatch that finished
  u32 combine_done;
  u32 dispatch_token;      // next sender token of the running dispatch
  u32 combine_token;       // next reducer token of the running combine
  u32 combine_round_tokens;  // tokens of the current round the reducers finished
  u32 combine_rounds_done;   // rounds of the running combine the reducers finished
  u32 pad[7];
};
static_assert(sizeof(HtiState) == 64, "HtiState is 64 bytes");
// After HtiState, per source node a: what the forwarder warps of a (several: fwd_per_node) share within a
// round — chunks done, the round's rows per local rank, messages of the rounds before — and the combine
// forwarders' chunks done; then what the dispatch's receiver warps and sender warps share
// (moelink_kernels::ht_internode::HTI_STATE_BYTES covers them).
struct HtiForward {
  u32 units_done[HTI_MAX_NODES];           // dispatch: the running round's units (fwd_unit) forwarded
  u32 messages_before[HTI_MAX_NODES];      // dispatch: messages of the rounds before the running one
  u32 round_rows[HTI_MAX_NODES][8];        // dispatch: the running round's rows per local rank
  u32 combine_chunks_done[HTI_MAX_NODES];  // combine: the running round's chunks the forwarders finished
  u32 combine_rounds_back[HTI_MAX_NODES];  // combine: rounds whose parts went back (hand-backs go out in round order)
  u32 recv_fin[HTI_MAX_RANKS];  // dispatch receivers: warps of a source done with its current round
  u32 chunk_staged[HTI_MAX_CHUNKS];  // dispatch senders: tokens staged, per chunk of a round, over the call's rounds
};
static_assert(sizeof(HtiState) + sizeof(HtiForward) == HTI_STATE_BYTES, "the local state mirrors moelink_kernels::ht_internode::HTI_STATE_BYTES");
__device__ __forceinline__ HtiForward* hti_forward(u64 state) { return reinterpret_cast<HtiForward*>(state + sizeof(HtiState)); }

// ---------------------------------------------------------------------------------------------- arguments
// The node's symmetric buffers: every local rank's base and the offsets inside one.
struct NvlArgs {
  u64 base[8];           // local rank j's symmetric buffer, as addressable here
  u64 off_done;          // u64 [R]: done words (dispatch receiver side)
  u64 off_consumed;      // u64 [L][N]: dispatch NVLink hand-back, forwarder side
  u64 off_cconsumed;     // u64 [L][N]: combine NVLink hand-back, expert side
  u64 off_dflags;        // u32 [R][flag_slots]
  u64 off_cflags;        // u32 [L][N][flag_slots]
  u64 off_dparts;        // R parts of part_bytes: dispatch rows, per source
  u64 off_cparts;        // R parts: combine rows, per (sending local rank, source node)
  u64 part_bytes;
  u32 flag_slots;
  u32 pad;
};
// The RDMA region's offsets (from the region's base; every rank's are the same).
struct RdmaAt {
  u64 off_notify_sig;    // u64 [2][R]
  u64 off_dchunk;        // u64 [N][HTI_MAX_CHUNKS]
  u64 off_dconsumed;     // u64 [N]
  u64 off_cchunk;        // u64 [N][HTI_MAX_CHUNKS]
  u64 off_cconsumed;     // u64 [N]
  u64 off_notify;        // u32 [2][R][msg_words]
  u64 off_notify_send;   // u32 [R][msg_words]
  u64 off_drecv, off_dsend, off_crecv, off_csend;  // N parts each
  u64 part_bytes;
  u32 msg_words;
  u32 pad;
};

struct HtiLayoutArgs {
  u64 topk_idx;                  // i64 [T, K], any strides
  i64 topk_stride_token, topk_stride_k;
  u64 num_tokens_per_rank;       // i32 [R]
  u64 num_tokens_per_rdma_rank;  // i32 [N], or 0
  u64 num_tokens_per_expert;     // i32 [E]
  u64 is_token_in_rank;          // bool [T, R]
  u64 error_claim, error_record;
  u32 num_tokens, topk, num_experts, rank;
};
static_assert(sizeof(HtiLayoutArgs) == MOELINK_SIZEOF_HTI_LAYOUT_ARGS, "HtiLayoutArgs mirrors Rust");

struct HtiNotifyArgs {
  RdmaArgs rdma;
  RdmaAt at;
  u64 is_token_in_rank;       // bool [T, R]
  u64 num_tokens_per_rank;    // i32 [R]
  u64 num_tokens_per_expert;  // i32 [E]
  u64 routing;                // this call's routing buffer
  u64 host_out;               // host-mapped HN_* words, or 0 (no-sync)
  u64 state;                  // HtiState
  u64 signature;
  u64 error_claim, error_record, timeout_ns;
  u32 num_tokens, num_local_experts, round_tokens, host_seq;
  u64 trace;  // host-mapped NOTIFY_TRACE_* stamps, or 0
};
static_assert(sizeof(HtiNotifyArgs) == MOELINK_SIZEOF_HTI_NOTIFY_ARGS, "HtiNotifyArgs mirrors Rust");

struct HtiDispatchArgs {
  RdmaArgs rdma;
  RdmaAt at;
  NvlArgs nvl;
  u64 x;                   // [T, HIDDEN] bf16 / e4m3, contiguous
  u64 x_scales;            // f32 [T, H/128], any strides (FP8)
  i64 scale_stride_token, scale_stride_group;
  u64 topk_idx;            // i64 [T, TOPK] (TOPK > 0)
  u64 topk_weights;        // f32 [T, TOPK] (TOPK > 0)
  u64 num_tokens_per_expert;  // i32 [E] of a fresh dispatch, checked against topk_idx; 0: no check
  u64 expert_tokens;       // u32 words at fixed offsets (hti_dispatch.cu's ET_*): the copy of notify's READY word
                           // and per-expert sums (copy_expected), the receivers' count of the rows selecting each
                           // local expert, the senders' of the tokens selecting each expert (counts 0 between calls)
  u64 host_notify;         // notify's host-mapped words of call host_seq (CPU-sync; HN_PER_EXPERT checked); 0: none
  u64 recv_x, recv_scales, recv_topk_idx, recv_topk_weights;
  u64 recv_src_idx;        // i32 [num_out_rows], or 0
  u64 routing;
  u64 fwd_entries;         // u32 [fwd_capacity]
  u64 recv_route;          // u64 [num_out_rows]
  u64 state;
  u64 error_claim, error_record, timeout_ns;
  u32 num_tokens, num_out_rows, fwd_capacity, num_local_experts;
  u32 chunk_tokens;        // Q: tokens per sender chunk (M is a multiple)
  u32 num_send_blocks, num_fwd_blocks;
  u32 fwd_per_node;        // forwarder warps per source node (warp w: node w % N, units u with u % P == w / N)
  u32 host_seq;            // the notify call whose words host_notify holds for this dispatch
  u32 pad;
  u64 trace;               // host-mapped timing trace (HTI_TRACE_*), or 0
};
static_assert(sizeof(HtiDispatchArgs) == MOELINK_SIZEOF_HTI_DISPATCH_ARGS, "HtiDispatchArgs mirrors Rust");

struct HtiCombineArgs {
  RdmaArgs rdma;
  RdmaAt at;
  NvlArgs nvl;
  u64 x;                      // bf16 [num_x_rows, HIDDEN]
  u64 topk_weights;           // f32 [num_x_rows, TOPK] (TOPK > 0)
  u64 bias0, bias1;           // bf16 [T, HIDDEN] or 0
  u64 combined_x;             // bf16 [T, HIDDEN]
  u64 combined_topk_weights;  // f32 [T, TOPK] (TOPK > 0)
  u64 routing, fwd_entries, recv_route, state;
  u64 error_claim, error_record, timeout_ns;
  u32 num_tokens, num_x_rows, chunk_tokens, num_send_blocks, num_fwd_blocks, fwd_per_node;
  u64 trace;  // host-mapped timing trace (HTI_TRACE_*), or 0
};
static_assert(sizeof(HtiCombineArgs) == MOELINK_SIZEOF_HTI_COMBINE_ARGS, "HtiCombineArgs mirrors Rust");

// ---------------------------------------------------------------------------------------------- helpers
__device__ __forceinline__ HtiState* hti_state(u64 s) { return reinterpret_cast<HtiState*>(s); }
__device__ __forceinline__ u32 node_of(u32 r) { return r / RANKS_PER_NODE; }
__device__ __forceinline__ u32 local_of(u32 r) { return r % RANKS_PER_NODE; }
__device__ __forceinline__ u64* rdma_word(const RdmaArgs& a, u64 off) { return reinterpret_cast<u64*>(a.local_base + off); }
__device__ __forceinline__ u8* rdma_bytes(const RdmaArgs& a, u64 off) { return reinterpret_cast<u8*>(a.local_base + off); }

// A warp copies `vecs` 16-byte vectors, U loads in flight per lane before their stores: a warp's copy rate is
// its bytes in flight (U * 512 bytes) over the load latency, and every row a role moves is one warp's serial
// copy, so a row takes one load latency per batch of U vectors a lane.
constexpr u32 COPY_UNROLL = 8;
// The dispatch rows' batches: as few as 14 loads a lane allow (an FP8 row of 7168 channels in one, a bf16
// row in two), evenly sized. The kernel then spills a few dozen to ~200 bytes (128 registers with 512
// threads), which costs less than a bf16 row's two extra latencies in every forwarder and receiver.
constexpr u32 ROW_VECS_PER_LANE = (PAYLOAD_VECS + WARP_SIZE - 1) / WARP_SIZE;
constexpr u32 ROW_BATCHES = (ROW_VECS_PER_LANE + 13) / 14;
constexpr u32 ROW_UNROLL = (ROW_VECS_PER_LANE + ROW_BATCHES - 1) / ROW_BATCHES;
// One batch of a warp's copy: U vectors a lane, vector base + u * 32 + lane (those below `vecs`).
template <u32 U>
struct VecBatch {
  u32x4 v[U];
};
template <u32 U, bool SRC_READ_ONLY>
__device__ __forceinline__ void load_batch(VecBatch<U>& b, const u32x4* src, u32 base, u32 vecs, u32 lane) {
#pragma unroll
  for (u32 u = 0; u < U; u++) {
    const u32 i = base + u * WARP_SIZE + lane;
    if (i < vecs) b.v[u] = SRC_READ_ONLY ? ptx::ld_nc_na_v4(src + i) : ptx::ld_na_v4(src + i);
  }
}
template <u32 U>
__device__ __forceinline__ void store_batch(const VecBatch<U>& b, u32x4* dst, u32 base, u32 vecs, u32 lane) {
#pragma unroll
  for (u32 u = 0; u < U; u++) {
    const u32 i = base + u * WARP_SIZE + lane;
    if (i < vecs) ptx::st_na_v4(dst + i, b.v[u]);
  }
}
template <u32 U, bool SRC_READ_ONLY>
__device__ __forceinline__ void copy_vecs(u32x4* dst, const u32x4* src, u32 vecs, u32 lane) {
  for (u32 base = 0; base < vecs; base += U * WARP_SIZE) {
    VecBatch<U> b;
    load_batch<U, SRC_READ_ONLY>(b, src, base, vecs, lane);
    store_batch<U>(b, dst, base, vecs, lane);
  }
}

// The deadline of a wait for `peer`: a wait for this rank itself (its own forwarder, receiver or rail-peer
// role) gets twice the time, so that the wait for the rank actually missing — which every such chain ends in
// — runs out first and is the one the error record names.
__device__ __forceinline__ Deadline for_peer(const Deadline& d, u32 peer, u32 me) {
  Deadline x = d;
  if (peer == me || peer == NO_PEER) x.timeout_ns = d.timeout_ns * 2;
  return x;
}

// Lane 0 waits (deadline) until the u64 at `p` reaches `target` (wrap-safe), then every lane acquires it
// (a lane's acquire does not cover the others' loads). Same result on every lane.
__device__ __forceinline__ bool warp_wait_u64(const u64* p, u64 target, const Deadline& d, u32 peer) {
  bool ok = true;
  if (threadIdx.x % WARP_SIZE == 0) ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(p) - target) >= 0; }, d, peer);
  ok = __shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) != 0;
  if (ok) (void)ptx::ld_acquire_sys_u64(p);
  __syncwarp();
  return ok;
}

// ---------------------------------------------------------------------------------------------- trace
// Timing trace (moelink::KernelTracing::high_throughput; `trace` is 0 otherwise): %globaltimer stamps in
// host-mapped u64 words (moelink::backend::cuda::ht_internode mirrors the layout):
//   per block of the grid HTI_TRACE_BLOCK_WORDS: block start, block end, then per warp the start and end of
//   its role (the emulated NIC's blocks: their NIC_STAT_WORDS, transport.cuh);
//   then HTI_TRACE_CHUNKS chunk records of 3 words, indexed by the sender's / reducer's chunk q:
//     dispatch sender [taken, staged, put], combine reducer [first token taken, its partials seen, last token
//     reduced];
//   then per source node HTI_TRACE_CHUNKS forwarder chunk records of 3 words, indexed k * ceil(M / Q) + c:
//     dispatch [words seen, rows copied, released], combine [started, partials staged, put].
// Chunks past HTI_TRACE_CHUNKS are not stamped.
// Notify's trace (its own words, one block, thread 0): when it started, read its epoch, counted every
// prefix column, had the totals and the layout checks, put its messages, stored the prefixes, saw every
// source's message, and ended (before READY and the quiet).
constexpr u32 NOTIFY_TRACE_START = 0, NOTIFY_TRACE_EPOCH = 1, NOTIFY_TRACE_COUNTED = 2, NOTIFY_TRACE_CHECKED = 3,
              NOTIFY_TRACE_SENT = 4, NOTIFY_TRACE_PREFIXED = 5, NOTIFY_TRACE_RECEIVED = 6, NOTIFY_TRACE_END = 7;
// A block's words: its start and end and each warp's two, or an emulated NIC block's statistics if more.
constexpr u32 HTI_TRACE_BLOCK_WORDS = 2 + 2 * HTI_WARPS > NIC_STAT_WORDS ? 2 + 2 * HTI_WARPS : NIC_STAT_WORDS;
constexpr u32 HTI_TRACE_CHUNK_WORDS = 3;
__device__ __forceinline__ void hti_stamp(u64 trace, u64 word) {
  if (trace != 0) reinterpret_cast<volatile u64*>(trace)[word] = ptx::globaltimer();
}
__device__ __forceinline__ u64 hti_trace_chunk(u32 blocks, u32 q, u32 point) {
  return (u64)blocks * HTI_TRACE_BLOCK_WORDS + (u64)q * HTI_TRACE_CHUNK_WORDS + point;
}
__device__ __forceinline__ u64 hti_trace_fwd(u32 blocks, u32 node, u32 c, u32 point) {
  return (u64)blocks * HTI_TRACE_BLOCK_WORDS + ((u64)(1 + node) * HTI_TRACE_CHUNKS + c) * HTI_TRACE_CHUNK_WORDS + point;
}
// Stamps chunk record point `point` (one lane; chunks past the trace's room are skipped).
__device__ __forceinline__ void hti_stamp_chunk(u64 trace, u32 q, u32 point) {
  if (trace != 0 && q < HTI_TRACE_CHUNKS && threadIdx.x % WARP_SIZE == 0) hti_stamp(trace, hti_trace_chunk(gridDim.x, q, point));
}
__device__ __forceinline__ void hti_stamp_fwd(u64 trace, u32 node, u32 c, u32 point) {
  if (trace != 0 && c < HTI_TRACE_CHUNKS && threadIdx.x % WARP_SIZE == 0) hti_stamp(trace, hti_trace_fwd(gridDim.x, node, c, point));
}

// ---------------------------------------------------------------------------------------------- fp32 trees
// The combine's sum is a pairwise tree (docs/oracle.md): leaves in order, absent leaves +0.0, padded with
// +0.0 to a power of two. tree_push folds leaves in one at a time (a binary counter of partial sums: level i
// holds the sum of the last 2^i leaves once complete), so a tree of W leaves keeps log2(W) + 1 partials of
// `N` floats, whatever W is.
template <u32 LEAVES, u32 N>
struct Tree {
  static constexpr u32 W = NextPow2<LEAVES>::value;
  static constexpr u32 LEVELS = W == 1 ? 1 : 1 + (W >= 2) + (W >= 4) + (W >= 8) + (W >= 16) + (W >= 32);
  float level[LEVELS][N];
  // Leaf `i` (in order 0, 1, ...). `x` is overwritten.
  __device__ __forceinline__ void push(u32 i, float (&x)[N]) {
#pragma unroll
    for (u32 l = 0; l + 1 < LEVELS; l++) {
      if (((i >> l) & 1u) == 0u) {
#pragma unroll
        for (u32 c = 0; c < N; c++) level[l][c] = x[c];
        return;
      }
#pragma unroll
      for (u32 c = 0; c < N; c++) x[c] = ptx::add_rn_f32(level[l][c], x[c]);
    }
#pragma unroll
    for (u32 c = 0; c < N; c++) level[LEVELS - 1][c] = x[c];
  }
  // The sum, once all W leaves were pushed.
  __device__ __forceinline__ float result(u32 c) const { return level[LEVELS - 1][c]; }
};

__device__ __forceinline__ void bf16x8_to_f32(const u32x4& v, float (&x)[8]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (u32 m = 0; m < 4; m++) {
    x[2 * m] = ptx::f32_from_bits(w[m] << 16);
    x[2 * m + 1] = ptx::f32_from_bits(w[m] & 0xffff0000u);
  }
}

// ============================================================================================== frame
// What dispatch and combine share: the routing's shape and this call's sequence base.
struct Frame {
  const i32* routing;
  RoutingAt at;
  u32 rounds;        // K
  u32 round_tokens;  // M
  u32 base;          // rounds of earlier calls of this operation
  u32 me, me_node, me_local;
};

// A worker warp's role, by block ranges: the first num_send_blocks blocks send (dispatch: a source's tokens over
// RDMA; combine: received rows back to their forwarders), the next num_fwd_blocks forward between the domains,
// the rest receive (dispatch: rows into the outputs) or reduce (combine: node partials into the outputs).
enum class Role : u32 { SEND, FORWARD, RECEIVE };

// Runs `body(frame, role, warp_id, num_warps)` on every worker warp (warp_id of num_warps within its role),
// then the end of the call: the last worker block to finish resets
// the per-call counters (`reset()`) and stores base + K for the next call, then every thread of that block runs
// `last_block()`: checks of what the whole grid counted (before its arrival every thread of each block runs
// `block_end(role)`: what the block counted goes out). Nothing moves, and the base stays, when the
// routing status is non-zero (every rank saw the same messages, so every rank returns here).
template <typename Args, typename Body, typename Reset, typename BlockEnd, typename LastBlock>
__device__ __forceinline__ void hti_run(const Args& a, u32 num_tokens, u32* base_word, u32* done_word, const Deadline& d, Body body,
                                        Reset reset, BlockEnd block_end, LastBlock last_block) {
  const u64 nic_stats = a.trace != 0 ? a.trace + 8 * (u64)blockIdx.x * HTI_TRACE_BLOCK_WORDS : 0;
  if (rdma::nic_block(a.rdma, d, nic_stats)) return;
  rdma::WorkerScope scope(a.rdma);
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  if (routing[RT_STATUS] != 0) return;
  __shared__ u32 s_base;
  if (threadIdx.x == 0) s_base = ptx::ld_relaxed_gpu(base_word);
  __syncthreads();
  Frame f;
  f.routing = routing;
  f.at = routing_at(num_tokens);
  f.rounds = (u32)routing[RT_NUM_ROUNDS];
  f.round_tokens = (u32)routing[RT_ROUND_TOKENS];
  f.base = s_base;
  f.me = a.rdma.rank;
  f.me_node = node_of(f.me);
  f.me_local = local_of(f.me);
  const u32 warp = threadIdx.x / WARP_SIZE, workers = rdma::num_worker_blocks(a.rdma);
  const u32 fwd_end = a.num_send_blocks + a.num_fwd_blocks;
  const u64 trace_block = (u64)blockIdx.x * HTI_TRACE_BLOCK_WORDS;
  if (threadIdx.x == 0) hti_stamp(a.trace, trace_block);
  if (threadIdx.x % WARP_SIZE == 0) hti_stamp(a.trace, trace_block + 2 + 2 * warp);
  const Role role = blockIdx.x < a.num_send_blocks ? Role::SEND : blockIdx.x < fwd_end ? Role::FORWARD : Role::RECEIVE;
  if (role == Role::SEND)
    body(f, role, blockIdx.x * HTI_WARPS + warp, a.num_send_blocks * HTI_WARPS);
  else if (role == Role::FORWARD)
    body(f, role, (blockIdx.x - a.num_send_blocks) * HTI_WARPS + warp, a.num_fwd_blocks * HTI_WARPS);
  else
    body(f, role, (blockIdx.x - fwd_end) * HTI_WARPS + warp, (workers - fwd_end) * HTI_WARPS);
  if (threadIdx.x % WARP_SIZE == 0) hti_stamp(a.trace, trace_block + 3 + 2 * warp);
  __syncthreads();
  block_end(role);
  __syncthreads();
  if (threadIdx.x == 0) hti_stamp(a.trace, trace_block + 1);
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    s_last = ptx::atom_add_acq_rel_gpu(done_word, 1u) == workers - 1;
    if (s_last) {
      *done_word = 0u;
      reset();
      ptx::st_release_gpu(base_word, f.base + f.rounds);
    }
  }
  __syncthreads();
  if (s_last) last_block();
}

// The idle clock of a warp that serves several sources in turn (lane i: source s): after a pass without
// progress it counts, and once the deadline has passed since the last progress it records the timeout and
// says stop (or as soon as this rank failed elsewhere). Named: the first pending source's forwarder — this
// node's rank with the source's local index — over NVLink, or, when that forwarder is this rank, the source
// over RDMA (for_peer's grace when that is this rank too).
struct IdleClock {
  u64 since = 0;
  u32 spins = 0;
  // Whether the warp must stop. Warp-uniform arguments.
  __device__ __forceinline__ bool expired(bool progressed, u32 pending, u32 s, const Frame& f, const Deadline& dr, const Deadline& dn) {
    if (progressed) {
      spins = 0;
      return false;
    }
    if (spins++ == 0) since = ptx::globaltimer();
    if (spins % DEADLINE_POLL_SPINS != 0) return false;
    const u32 src = __shfl_sync(FULL_WARP_MASK, s, __ffs(pending) - 1);
    const u32 forwarder = f.me_node * RANKS_PER_NODE + local_of(src);
    const u32 blamed = forwarder == f.me ? src : forwarder;
    const Deadline dl = for_peer(forwarder == f.me ? dr : dn, blamed, f.me);
    const u64 waited = __shfl_sync(FULL_WARP_MASK, ptx::globaltimer() - since, 0);
    if (waited > dl.timeout_ns) {
      if (threadIdx.x % WARP_SIZE == 0) raise_error(dl, ERR_TIMEOUT, blamed, waited);
      return true;
    }
    return __any_sync(FULL_WARP_MASK, error_raised(dn));
  }
};

// The round count of a source with `tokens` tokens, and the tokens of its round k.
__device__ __forceinline__ u32 rounds_of(const Frame& f, u32 tokens) { return (tokens + f.round_tokens - 1) / f.round_tokens; }
__device__ __forceinline__ u32 round_tokens_of(const Frame& f, u32 tokens, u32 k) { return hti_min(f.round_tokens, tokens - k * f.round_tokens); }
// The hand-back value after round k of a source with `rounds` rounds: its seq, or base + K after its last.
__device__ __forceinline__ u64 hand_back_value(const Frame& f, u32 k, u32 rounds) { return k + 1 == rounds ? f.base + f.rounds : f.base + k + 1; }

#endif  // MOELINK_HTI_CUH
