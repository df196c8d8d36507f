// moelink kernel family: high-throughput dispatch and combine when the ranks span nodes
// (moelink_kernels::ht_internode). DeepEP's hierarchy on moelink's transport seam: a token crosses the RDMA
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
//   RANKS_PER_NODE, NUM_NODES    the topology (the combine's trees unroll over them)
//   HIDDEN, FP8, TOPK            dispatch payload: channels, e4m3 + fp32 scales per 128 or bf16, top-k entries
//                                travelling with each token (0: none, e.g. a cached dispatch); combine: TOPK
//                                weights per row (0: none)
//   NUM_BIASES                   biases the combine adds (0, 1 or 2)
//   HTI_WARPS                    warps per block
//   HTI_MSG_BYTES, HTI_ROW_BYTES, HTI_CROW_BYTES, HTI_CMSG_BYTES  the row sizes as Rust computes them
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
//   sender (s):      chunks of Q tokens (in order, from a per-call counter). For each destination node b: wait
//                    until (b, l) handed round k - 1 back (d_consumed[b] >= base + k); write each token's
//                    message m (the token's index among this round's tokens for node b, node_prefix) into
//                    (b, l)'s receive part [a][m] in place where stores reach it (rdma::window), else at send
//                    part [b][m]; then the chunk's messages [m0, m1) go there with SET (seq << 32 | m1) on its
//                    chunk word d_chunk[a][chunk] (put_window_signal: one put_signal, or fenced stores and the
//                    signal; a bare signal for an empty chunk). Data, then its chunk word.
//   forwarder ((b, l), fwd_per_node warps per source node a, chunks dealt round-robin among them): per
//                    chunk (its word and the one before give its messages); each message goes to every rank j
//                    of this node it has a slot at: the row (payload + meta, top-k ids as j's local ids) into
//                    j's dispatch part [s][slot mod M] over NVLink, after j handed that part back for round k
//                    - 1 (nvl_consumed[j][a] >= base + k); every RELEASE rows, and at a chunk's end, a fence,
//                    then the rows' flags = seq. Records the message's ranks and round for combine
//                    (fwd_entries). The warp that finishes a round's last chunk ends the round: done[s] = seq
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
//   reducer (s):     token chunks in order, one round at a time: per token, the partial of every node it
//                    reached (chunk word c_chunk[b][chunk] >= cseq; a bf16 row where its routing says one rank
//                    of the node held it, + 0.0 as the node tree adds), summed as the tree's upper level, + 0.0,
//                    the biases, rounded to bf16; after a round's last token, c_consumed[a] = cseq at every
//                    rail peer (b, l).
// Every wait has the caller's deadline and names the peer and the domain (phase HTI_*_RDMA / _NVLINK); a
// kernel that timed out winds down without handing back, so its peers time out too. Argument problems found on
// the device (layout tensors that disagree with each other or with topk_idx, no-sync overflow) are reported
// and the protocol goes on.
#include "transport.cuh"

#if !defined(HTI_MAX_RANKS) || !defined(HTI_MAX_NODES) || !defined(HTI_MAX_CHUNKS) || !defined(RANKS_PER_NODE) || \
    !defined(NUM_NODES) || !defined(HIDDEN) || !defined(FP8) || !defined(TOPK) || !defined(NUM_BIASES) ||            \
    !defined(HTI_WARPS) || !defined(MOELINK_SIZEOF_HTI_LAYOUT_ARGS) || !defined(MOELINK_SIZEOF_HTI_NOTIFY_ARGS) ||  \
    !defined(MOELINK_SIZEOF_HTI_DISPATCH_ARGS) || !defined(MOELINK_SIZEOF_HTI_COMBINE_ARGS) || !defined(HTI_MSG_BYTES) ||      \
    !defined(HTI_ROW_BYTES) || !defined(HTI_CROW_BYTES) || !defined(HTI_CMSG_BYTES) || !defined(HTI_STATE_BYTES) ||  \
    !defined(HTI_TRACE_CHUNKS)
#error "ht_internode.cu needs every JIT constant listed at the top of the file"
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
// bytes of padding; i32 slot
// [8] (the row's slot at each local rank of the destination node, -1 elsewhere); i32 top-k ids (global, -1
// for none); f32 weights; f32 scales; the payload at a 16-byte boundary.
constexpr u32 MSG_SLOTS = 16;
constexpr u32 MSG_IDS = 48;
constexpr u32 MSG_WEIGHTS = MSG_IDS + 4 * TOPK;
constexpr u32 MSG_SCALES = MSG_WEIGHTS + 4 * TOPK;
constexpr u32 MSG_PAYLOAD = HTI_ALIGN16(MSG_SCALES + 4 * NUM_SCALES);
constexpr u32 MSG_BYTES = MSG_PAYLOAD + PAYLOAD_BYTES;
// What a message's layout depends on, so that a forwarder reading a message of another kernel variant (a
// host that chose the variant differently on one rank) stops with ERR_PEER_LAYOUT instead of forwarding
// garbage to addresses taken from it.
constexpr u32 MSG_TAG = 0xa0000000u | (FP8 ? 1u << 27 : 0u) | (TOPK << 20) | HIDDEN;
static_assert(HIDDEN < (1u << 20) && TOPK < 128, "the layout tag holds HIDDEN and TOPK");
// A row in an NVLink dispatch part: the payload, then u32 meta words: the top-k ids as the receiver's local
// i64 ids (two words each, low first), the scales, the weights (0 where the id is -1 there), the source's
// token index, the message index and the round (for combine); padded to 16 bytes.
constexpr u32 META_SCALES = 2 * TOPK;
constexpr u32 META_WEIGHTS = META_SCALES + NUM_SCALES;
constexpr u32 META_SRC = META_WEIGHTS + TOPK;
constexpr u32 META_MESSAGE = META_SRC + 1;
constexpr u32 META_ROUND = META_MESSAGE + 1;
constexpr u32 META_WORDS = META_ROUND + 1;
constexpr u32 ROW_BYTES = PAYLOAD_BYTES + HTI_ALIGN16(4 * META_WORDS);
// Combine: a row going to the forwarder is the bf16 payload and TOPK f32 weights; a partial going home is
// the fp32 sum and TOPK f32 weight sums.
constexpr u32 CPAYLOAD_BYTES = 2 * HIDDEN;
constexpr u32 CROW_BYTES = CPAYLOAD_BYTES + HTI_ALIGN16(4 * TOPK);
constexpr u32 CMSG_BYTES = 4 * HIDDEN + HTI_ALIGN16(4 * TOPK);
static_assert(CPAYLOAD_BYTES % VEC_BYTES == 0, "bf16 rows are whole 16-byte vectors");
static_assert(MSG_BYTES == HTI_MSG_BYTES && ROW_BYTES == HTI_ROW_BYTES && CROW_BYTES == HTI_CROW_BYTES && CMSG_BYTES == HTI_CMSG_BYTES,
              "row sizes mirror moelink_kernels::ht_internode::RowSizes");
// How many rows a warp writes before one fence releases their flags.
constexpr u32 RELEASE_ROWS = 4;
// A forwarder's fwd_entries word: bits 0..7 the local ranks the message went to, the round above.
constexpr u32 ENTRY_ROUND_SHIFT = 8;

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
  u32 recv_offset, recv_count, tokens_of, fwd_offset, fwd_count, rank_prefix, prefix, node_prefix;
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
  u32 dispatch_chunk;      // next sender chunk of the running dispatch
  u32 combine_chunk;       // next reducer chunk of the running combine
  u32 combine_round_tokens;  // tokens of the current round the reducers finished
  u32 combine_rounds_done;   // rounds of the running combine the reducers finished
  u32 pad[7];
};
static_assert(sizeof(HtiState) == 64, "HtiState is 64 bytes");
// After HtiState, per source node a: what the forwarder warps of a (several: fwd_per_node) share within a
// round — chunks done, the round's rows per local rank, messages of the rounds before — and the combine
// forwarders' chunks done (moelink_kernels::ht_internode::HTI_STATE_BYTES covers them).
struct HtiForward {
  u32 chunks_done[HTI_MAX_NODES];          // dispatch: the running round's chunks the forwarders finished
  u32 messages_before[HTI_MAX_NODES];      // dispatch: messages of the rounds before the running one
  u32 round_rows[HTI_MAX_NODES][8];        // dispatch: the running round's rows per local rank
  u32 combine_chunks_done[HTI_MAX_NODES];  // combine: the running round's chunks the forwarders finished
  u32 combine_rounds_back[HTI_MAX_NODES];  // combine: rounds whose parts went back (hand-backs go out in round order)
  u32 recv_fin[HTI_MAX_RANKS];  // dispatch receivers: warps of a source done with its current round
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
  u32 fwd_per_node;        // forwarder warps per source node (warp w: node w % N, chunks c with c % P == w / N)
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

// A warp copies `vecs` 16-byte vectors, COPY_UNROLL loads in flight per lane before their stores: a warp's
// copy rate is its bytes in flight over the load latency (8 KB per ~0.7 us), and every row a role moves is
// one warp's serial copy, so a 14 KB bf16 row takes two load latencies and an FP8 row one.
constexpr u32 COPY_UNROLL = 8;
template <bool SRC_READ_ONLY>
__device__ __forceinline__ void copy_vecs(u32x4* dst, const u32x4* src, u32 vecs, u32 lane) {
  constexpr u32 U = COPY_UNROLL;
  for (u32 base = 0; base < vecs; base += U * WARP_SIZE) {
    u32x4 v[U];
#pragma unroll
    for (u32 u = 0; u < U; u++) {
      const u32 i = base + u * WARP_SIZE + lane;
      if (i < vecs) v[u] = SRC_READ_ONLY ? ptx::ld_nc_na_v4(src + i) : ptx::ld_na_v4(src + i);
    }
#pragma unroll
    for (u32 u = 0; u < U; u++) {
      const u32 i = base + u * WARP_SIZE + lane;
      if (i < vecs) ptx::st_na_v4(dst + i, v[u]);
    }
  }
}

// A warp copies one token's payload (PAYLOAD_VECS vectors at `src`) into the message of every node in
// `nodes` (lane b holds node b's message address in `node_msg`): each batch of loads is stored to every
// node, so the row is read once however many nodes it reaches. SEND_UNROLL loads a lane: a bf16 row of
// 7168 channels (28 vectors a lane) in two batches, an FP8 row in one (the senders bound the dispatch).
constexpr u32 SEND_UNROLL = 14;
__device__ __forceinline__ void copy_to_messages(u32 nodes, u64 node_msg, const u32x4* src, u32 lane) {
  constexpr u32 U = SEND_UNROLL;
  for (u32 base = 0; base < PAYLOAD_VECS; base += U * WARP_SIZE) {
    u32x4 v[U];
#pragma unroll
    for (u32 u = 0; u < U; u++) {
      const u32 i = base + u * WARP_SIZE + lane;
      if (i < PAYLOAD_VECS) v[u] = ptx::ld_nc_na_v4(src + i);
    }
    for (u32 todo = nodes; todo != 0u; todo &= todo - 1) {
      u32x4* dst = reinterpret_cast<u32x4*>(__shfl_sync(FULL_WARP_MASK, node_msg, __ffs(todo) - 1) + MSG_PAYLOAD);
#pragma unroll
      for (u32 u = 0; u < U; u++) {
        const u32 i = base + u * WARP_SIZE + lane;
        if (i < PAYLOAD_VECS) ptx::st_na_v4(dst + i, v[u]);
      }
    }
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

// Block-wide exclusive scan of one u32 per thread; returns the thread's prefix, `total` gets the sum.
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32* s_warp, u32& total) {
  const u32 lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  u32 inclusive = v;
#pragma unroll
  for (u32 o = 1; o < WARP_SIZE; o <<= 1) {
    const u32 below = __shfl_up_sync(FULL_WARP_MASK, inclusive, o);
    if (lane >= o) inclusive += below;
  }
  if (lane == WARP_SIZE - 1) s_warp[warp] = inclusive;
  __syncthreads();
  u32 before = 0, sum = 0;
  for (u32 w = 0; w < blockDim.x / WARP_SIZE; w++) {
    if (w < warp) before += s_warp[w];
    sum += s_warp[w];
  }
  __syncthreads();
  total = sum;
  return before + inclusive - v;
}

// ---------------------------------------------------------------------------------------------- trace
// Timing trace (moelink::KernelTracing::high_throughput; `trace` is 0 otherwise): %globaltimer stamps in
// host-mapped u64 words (moelink::backend::cuda::ht_internode mirrors the layout):
//   per block of the grid HTI_TRACE_BLOCK_WORDS (the emulated NIC's stay 0): block start, block end, then per
//   warp the start and end of its role;
//   then HTI_TRACE_CHUNKS chunk records of 3 words, indexed by the sender's / reducer's chunk q:
//     dispatch sender [taken, staged, put], combine reducer [taken, first partial seen, reduced];
//   then per source node HTI_TRACE_CHUNKS forwarder chunk records of 3 words, indexed k * ceil(M / Q) + c:
//     dispatch [words seen, rows copied, released], combine [started, partials staged, put].
// Chunks past HTI_TRACE_CHUNKS are not stamped.
constexpr u32 HTI_TRACE_BLOCK_WORDS = 2 + 2 * HTI_WARPS;
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

// A node's partial when one of its ranks held the token: that rank's bf16 vector, as the node tree sums it
// with the +0.0 leaves of the absent ranks (x + 0.0: -0.0 becomes +0.0; a tree of one leaf adds nothing).
__device__ __forceinline__ void single_contributor_partial(const u32x4& v, float (&x)[8]) {
  bf16x8_to_f32(v, x);
  if (Tree<RANKS_PER_NODE, 8>::W > 1) {
#pragma unroll
    for (u32 c = 0; c < 8; c++) x[c] = ptx::add_rn_f32(x[c], 0.0f);
  }
}

// ============================================================================================== layout
namespace moelink::internode {
// moelink::internode::layout: get_dispatch_layout on a buffer across nodes. grid: any (grid-stride over
//   tokens), block THREADS; one thread per token. Per token: expert e counts once per row; rank e / (E / R)
//   is marked in is_token_in_rank and counted once per token, its node once per token. An entry outside
//   [-1, E) or repeated in its row is reported (ERR_INVALID_TOPK) and counts as -1. Counts accumulate in
//   shared memory, then one global atomic per non-zero counter and block. No flags, no waits.
__global__ void __launch_bounds__(THREADS) layout(const __grid_constant__ HtiLayoutArgs a) {
  __shared__ u32 s_rank[NUM_RANKS];
  __shared__ u32 s_node[NUM_NODES];
  const Deadline d = make_deadline(a.error_claim, a.error_record, 0, a.rank, PHASE_LAYOUT);
  for (u32 r = threadIdx.x; r < NUM_RANKS; r += THREADS) s_rank[r] = 0;
  for (u32 n = threadIdx.x; n < NUM_NODES; n += THREADS) s_node[n] = 0;
  __syncthreads();
  const i64* topk_idx = reinterpret_cast<const i64*>(a.topk_idx);
  u32* expert_count = reinterpret_cast<u32*>(a.num_tokens_per_expert);
  u8* in_rank = reinterpret_cast<u8*>(a.is_token_in_rank);
  const i64 num_experts = a.num_experts, per_rank = a.num_experts / NUM_RANKS;
  for (u32 t = blockIdx.x * THREADS + threadIdx.x; t < a.num_tokens; t += gridDim.x * THREADS) {
    const i64* row = topk_idx + (i64)t * a.topk_stride_token;
    for (u32 r = 0; r < NUM_RANKS; r++) in_rank[(u64)t * NUM_RANKS + r] = 0;
    u32 nodes = 0;
    for (u32 k = 0; k < a.topk; k++) {
      const i64 e = row[(i64)k * a.topk_stride_k];
      bool valid = e >= 0 && e < num_experts, bad = e < -1 || e >= num_experts;
      for (u32 j = 0; valid && j < k; j++) {
        if (row[(i64)j * a.topk_stride_k] == e) {
          valid = false;
          bad = true;
        }
      }
      if (bad) report_error(d, ERR_INVALID_TOPK, NO_PEER, ((u64)t << 32) | k, (u64)e);
      if (!valid) continue;
      atomicAdd(expert_count + e, 1u);
      const u32 r = (u32)(e / per_rank);
      u8* mark = in_rank + (u64)t * NUM_RANKS + r;
      if (*mark == 0) {
        *mark = 1;
        atomicAdd(&s_rank[r], 1u);
      }
      nodes |= 1u << node_of(r);
    }
    for (u32 n = 0; n < NUM_NODES; n++)
      if (((nodes >> n) & 1u) != 0u) atomicAdd(&s_node[n], 1u);
  }
  __syncthreads();
  for (u32 r = threadIdx.x; r < NUM_RANKS; r += THREADS)
    if (s_rank[r] != 0u) atomicAdd(reinterpret_cast<u32*>(a.num_tokens_per_rank) + r, s_rank[r]);
  if (a.num_tokens_per_rdma_rank != 0)
    for (u32 n = threadIdx.x; n < NUM_NODES; n += THREADS)
      if (s_node[n] != 0u) atomicAdd(reinterpret_cast<u32*>(a.num_tokens_per_rdma_rank) + n, s_node[n]);
}
}  // namespace moelink::internode

// ============================================================================================== notify
namespace moelink::internode {
// moelink::internode::notify: the count exchange before a fresh dispatch. One worker block (THREADS) plus,
//   with the emulated NIC, its blocks; launched cooperatively.
//   1. Prefixes (routing): for every destination rank r, prefix[t][r] = tokens before t that go to r (t's
//      slot there), and for every node n, node_prefix[t][n] = tokens before t that reach n (t's message
//      index in the stream to n's rail peer), t = 0..T; a block-wide scan per column.
//   2. A message to every rank r (itself included), staged in this rank's notify send area and put with
//      SET epoch on r's notify signal [parity][me]: {tokens to r, T, status, signature, tokens to r's
//      node, the whole count row, tokens per local expert of r}. Then wait (deadline, RDMA domain) for every
//      source's signal. Parity double-buffering holds as intranode: a rank writes call e's message only after
//      its call e-1 saw every call e-1 message, which each peer sent after its call e-2 (stream order); a
//      quiet at the end completes this call's puts before the next call rewrites the send area.
//   3. From the messages: recv_count / recv_offset per source, N, T_max, every rank's T, DeepEP's
//      rank_prefix_matrix, the forwarder's per-source-node message counts (from the rail sources (a, l)),
//      K = ceil(T_max / M), the agreed status (the first source with BAD_LAYOUT or BAD_EXPERTS, reported as
//      ERR_INVALID_LAYOUT naming it and the argument, else a signature differing from ours); with host_out
//      the same for the host, the received tokens per local expert, then READY = host_seq.
//   The layout checks read only what the message sends anyway: a send count differing from
//   num_tokens_per_rank marks the message BAD_LAYOUT; warp w checks the per-expert counts of ranks w,
//   w + HTI_WARPS, ... (expert_counts_disagree, ptx.cuh), a disagreement marks it BAD_EXPERTS.
__global__ void __launch_bounds__(THREADS, 1) notify(const __grid_constant__ HtiNotifyArgs a) {
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_NOTIFY);
  if (rdma::nic_block(a.rdma, d)) return;
  rdma::WorkerScope scope(a.rdma);
  __shared__ u32 s_warp[HTI_WARPS];
  __shared__ u32 s_send_count[NUM_RANKS];
  __shared__ u32 s_node_count[NUM_NODES];
  __shared__ u32 s_status, s_epoch, s_ok;
  const u32 tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
  const u32 me = a.rdma.rank, T = a.num_tokens;
  i32* routing = reinterpret_cast<i32*>(a.routing);
  const RoutingAt at = routing_at(T);
  const u8* in_rank = reinterpret_cast<const u8*>(a.is_token_in_rank);
  HtiState* st = hti_state(a.state);
  if (tid == 0) {
    s_epoch = ptx::ld_relaxed_gpu(&st->notify_epoch) + 1;
    s_status = 0;
    s_ok = 1;
  }
  __syncthreads();
  const u32 epoch = s_epoch, parity = epoch & 1u;

  // 1. Prefix columns: ranks, then nodes (a token reaches a node when it goes to one of its ranks).
  const u32 chunk = (T + THREADS - 1) / THREADS;
  const u32 t0 = hti_min(T, tid * chunk), t1 = hti_min(T, t0 + chunk);
  i32* prefix = routing + at.prefix;
  i32* node_prefix = routing + at.node_prefix;
  for (u32 col = 0; col < NUM_RANKS + NUM_NODES; col++) {
    const bool is_node = col >= NUM_RANKS;
    const u32 n = col - NUM_RANKS;
    auto hit = [&](u32 t) -> u32 {
      if (!is_node) return in_rank[(u64)t * NUM_RANKS + col] != 0 ? 1u : 0u;
      for (u32 j = 0; j < RANKS_PER_NODE; j++)
        if (in_rank[(u64)t * NUM_RANKS + n * RANKS_PER_NODE + j] != 0) return 1u;
      return 0u;
    };
    u32 count = 0;
    for (u32 t = t0; t < t1; t++) count += hit(t);
    u32 total = 0;
    u32 run = block_exclusive_scan(count, s_warp, total);
    i32* out = is_node ? node_prefix : prefix;
    const u32 stride = is_node ? NUM_NODES : NUM_RANKS, c = is_node ? n : col;
    for (u32 t = t0; t < t1; t++) {
      out[(u64)t * stride + c] = (i32)run;
      run += hit(t);
    }
    if (tid == 0) {
      out[(u64)T * stride + c] = (i32)total;
      if (is_node) s_node_count[n] = total;
      else s_send_count[col] = total;
    }
  }
  __syncthreads();
  for (u32 r = tid; r < NUM_RANKS; r += THREADS)
    if ((i32)s_send_count[r] != reinterpret_cast<const i32*>(a.num_tokens_per_rank)[r]) atomicOr(&s_status, HTI_STATUS_BAD_LAYOUT);
  const u32 el = a.num_local_experts, words = MSG_W_ROW + NUM_RANKS + el;
  const i32* per_expert = reinterpret_cast<const i32*>(a.num_tokens_per_expert);
  for (u32 r = warp; r < NUM_RANKS; r += HTI_WARPS) {
    const bool bad = expert_counts_disagree(per_expert + (u64)r * el, el, s_send_count[r], lane);
    if (lane == 0 && bad) atomicOr(&s_status, HTI_STATUS_BAD_EXPERTS);
  }
  __syncthreads();

  // 2. Messages: warp w builds and puts the messages of ranks w, w + HTI_WARPS, ...
  for (u32 r = warp; r < NUM_RANKS; r += HTI_WARPS) {
    u32* msg = reinterpret_cast<u32*>(rdma_bytes(a.rdma, a.at.off_notify_send)) + (u64)r * a.at.msg_words;
    for (u32 w = lane; w < words; w += WARP_SIZE) {
      u32 v = 0;
      if (w >= MSG_W_ROW + NUM_RANKS) v = (u32)per_expert[(u64)r * el + (w - MSG_W_ROW - NUM_RANKS)];
      else if (w >= MSG_W_ROW) v = s_send_count[w - MSG_W_ROW];
      else if (w == MSG_W_COUNT) v = s_send_count[r];
      else if (w == MSG_W_TOKENS) v = T;
      else if (w == MSG_W_STATUS) v = s_status;
      else if (w == MSG_W_SIG_LO) v = (u32)a.signature;
      else if (w == MSG_W_SIG_HI) v = (u32)(a.signature >> 32);
      else if (w == MSG_W_NODE_COUNT) v = s_node_count[node_of(r)];
      msg[w] = v;
    }
    const u64 bytes = (u64)words * 4;
    const u64 dst = a.at.off_notify + ((u64)parity * NUM_RANKS + me) * a.at.msg_words * 4;
    const u64 src = a.at.off_notify_send + (u64)r * a.at.msg_words * 4;
    const u64 sig = a.at.off_notify_sig + ((u64)parity * NUM_RANKS + me) * 8;
    if (!rdma::put_signal_warp(a.rdma, r % a.rdma.num_qps, r, dst, src, (u32)bytes, sig, epoch, SIGNAL_SET, d) && lane == 0) s_ok = 0;
  }
  for (u32 s = tid; s < NUM_RANKS; s += THREADS) {
    const u64 sig = a.at.off_notify_sig + ((u64)parity * NUM_RANKS + s) * 8;
    if (!rdma::wait_signal_geq(a.rdma, sig, epoch, for_peer(d, s, me), s)) s_ok = 0;
  }
  __syncthreads();
  const bool all_ok = s_ok != 0 && !error_raised(d);
  auto msg_of = [&](u32 s) -> const u32* {
    return reinterpret_cast<const u32*>(rdma_bytes(a.rdma, a.at.off_notify)) + ((u64)parity * NUM_RANKS + s) * a.at.msg_words;
  };

  // 3. What this rank receives and forwards, and the agreed status.
  u32* host = reinterpret_cast<u32*>(a.host_out);
  for (u32 j = tid; j < NUM_RANKS; j += THREADS) {
    u32 received = 0;
    for (u32 s = 0; s < NUM_RANKS; s++) {
      if (all_ok) received += msg_of(s)[MSG_W_ROW + j];
      routing[at.rank_prefix + s * NUM_RANKS + j] = (i32)received;
    }
  }
  if (all_ok && host != nullptr) {
    for (u32 e = tid; e < el; e += THREADS) {
      u32 sum = 0;
      for (u32 s = 0; s < NUM_RANKS; s++) sum += msg_of(s)[MSG_W_ROW + NUM_RANKS + e];
      host[HN_PER_EXPERT + e] = sum;
    }
  }
  if (tid == 0) {
    u32 status = HTI_STATUS_FAILED, peer = NO_PEER, num_recv = 0, t_max = 0, num_fwd = 0;
    if (all_ok) {
      status = 0;
      for (u32 s = 0; s < NUM_RANKS; s++) {
        const u32* m = msg_of(s);
        routing[at.recv_offset + s] = (i32)num_recv;
        routing[at.recv_count + s] = (i32)m[MSG_W_COUNT];
        routing[at.tokens_of + s] = (i32)m[MSG_W_TOKENS];
        num_recv += m[MSG_W_COUNT];
        t_max = m[MSG_W_TOKENS] > t_max ? m[MSG_W_TOKENS] : t_max;
        if (status == 0 && (m[MSG_W_STATUS] & (HTI_STATUS_BAD_LAYOUT | HTI_STATUS_BAD_EXPERTS)) != 0u) {
          // A bad num_tokens_per_rank first: the per-expert check rests on it.
          status = (m[MSG_W_STATUS] & HTI_STATUS_BAD_LAYOUT) != 0u ? HTI_STATUS_BAD_LAYOUT : HTI_STATUS_BAD_EXPERTS;
          peer = s;
        }
      }
      for (u32 n = 0; n < NUM_NODES; n++) {
        const u32 cnt = msg_of(n * RANKS_PER_NODE + local_of(me))[MSG_W_NODE_COUNT];
        routing[at.fwd_offset + n] = (i32)num_fwd;
        routing[at.fwd_count + n] = (i32)cnt;
        num_fwd += cnt;
      }
      for (u32 s = 0; s < NUM_RANKS && status == 0; s++) {
        const u32* m = msg_of(s);
        const u64 sig = (u64)m[MSG_W_SIG_LO] | ((u64)m[MSG_W_SIG_HI] << 32);
        if (sig != a.signature) {
          status = HTI_STATUS_MISMATCH;
          peer = s;
          report_error(d, ERR_RANK_MISMATCH, s, a.signature, sig);
        }
      }
      if (status == HTI_STATUS_BAD_LAYOUT) report_error(d, ERR_INVALID_LAYOUT, peer, LAYOUT_ARG_PER_RANK, 0);
      if (status == HTI_STATUS_BAD_EXPERTS) report_error(d, ERR_INVALID_LAYOUT, peer, LAYOUT_ARG_PER_EXPERT, 0);
    }
    const u32 rounds = a.round_tokens == 0 ? 0 : (t_max + a.round_tokens - 1) / a.round_tokens;
    routing[RT_STATUS] = (i32)status;
    routing[RT_STATUS_PEER] = (i32)peer;
    routing[RT_NUM_RECV] = (i32)num_recv;
    routing[RT_T_MAX] = (i32)t_max;
    routing[RT_NUM_ROUNDS] = (i32)rounds;
    routing[RT_ROUND_TOKENS] = (i32)a.round_tokens;
    routing[RT_NUM_FWD] = (i32)num_fwd;
    if (host != nullptr) {
      host[HN_NUM_RECV] = num_recv;
      host[HN_T_MAX] = t_max;
      host[HN_STATUS] = status;
      host[HN_STATUS_PEER] = peer;
      host[HN_NUM_FWD] = num_fwd;
    }
  }
  __syncthreads();
  if (tid == 0) {
    (void)rdma::quiet_thread(a.rdma, RDMA_ALL_QPS, d);
    if (host != nullptr) {
      ptx::fence_acq_rel_sys();
      ptx::st_release_sys(host + HN_READY, a.host_seq);
    }
    st->notify_epoch = epoch;
  }
}
}  // namespace moelink::internode

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
// the per-call counters (`reset()`) and stores base + K for the next call. Nothing moves, and the base stays, when the
// routing status is non-zero (every rank saw the same messages, so every rank returns here).
template <typename Args, typename Body, typename Reset>
__device__ __forceinline__ void hti_run(const Args& a, u32 num_tokens, u32* base_word, u32* done_word, const Deadline& d, Body body,
                                        Reset reset) {
  if (rdma::nic_block(a.rdma, d)) return;
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
  if (blockIdx.x < a.num_send_blocks)
    body(f, Role::SEND, blockIdx.x * HTI_WARPS + warp, a.num_send_blocks * HTI_WARPS);
  else if (blockIdx.x < fwd_end)
    body(f, Role::FORWARD, (blockIdx.x - a.num_send_blocks) * HTI_WARPS + warp, a.num_fwd_blocks * HTI_WARPS);
  else
    body(f, Role::RECEIVE, (blockIdx.x - fwd_end) * HTI_WARPS + warp, (workers - fwd_end) * HTI_WARPS);
  if (threadIdx.x % WARP_SIZE == 0) hti_stamp(a.trace, trace_block + 3 + 2 * warp);
  __syncthreads();
  if (threadIdx.x == 0) hti_stamp(a.trace, trace_block + 1);
  if (threadIdx.x == 0 && ptx::atom_add_acq_rel_gpu(done_word, 1u) == workers - 1) {
    *done_word = 0u;
    reset();
    ptx::st_release_gpu(base_word, f.base + f.rounds);
  }
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

// ============================================================================================== dispatch
namespace hti_dispatch {

// The meta word `w` of a dispatch row as local rank `j` of node `node` sees it (from the message `msg`).
__device__ __forceinline__ u32 meta_word(const HtiDispatchArgs& a, const u8* msg, u32 w, u32 dst_rank, u32 round, u32 message) {
  const u32* ids = reinterpret_cast<const u32*>(msg + MSG_IDS);
  if (w < META_SCALES) {
    const i32 e = (i32)ids[w / 2];
    const i64 first = (i64)dst_rank * a.num_local_experts;
    const i64 local = e >= 0 && e >= first && e < first + (i64)a.num_local_experts ? (i64)e - first : -1;
    return (w & 1u) != 0u ? (u32)((u64)local >> 32) : (u32)(u64)local;
  }
  if (w < META_WEIGHTS) return reinterpret_cast<const u32*>(msg + MSG_SCALES)[w - META_SCALES];
  if (w < META_SRC) {
    const i32 e = (i32)ids[w - META_WEIGHTS];
    const i64 first = (i64)dst_rank * a.num_local_experts;
    const bool here = e >= 0 && e >= first && e < first + (i64)a.num_local_experts;
    return here ? reinterpret_cast<const u32*>(msg + MSG_WEIGHTS)[w - META_WEIGHTS] : 0u;
  }
  if (w == META_SRC) return reinterpret_cast<const u32*>(msg)[0];
  if (w == META_MESSAGE) return message;
  return round;
}

// Checks token t's is_token_in_rank row (through the prefix) against the ranks of its top-k experts (TOPK
// > 0): lane k < TOPK loads its k-th expert's rank, lane i tests ranks i, i + 32, ... against them. A rank in
// one set and not in the other is reported (ERR_INVALID_LAYOUT, LAYOUT_ARG_IN_RANK, the token): a row sent
// where it selects no expert arrives with every top-k id -1, and an expert whose rank gets no row misses the
// token. The rows still travel as is_token_in_rank says; the call fails on this rank once the collective has
// run. The expert ids are the ones the message staging reads next (L1), the prefix rows the slots' (L2).
__device__ __forceinline__ void check_token_ranks(const HtiDispatchArgs& a, const Frame& f, const i32* prefix, u32 t, u32 lane,
                                                  const Deadline& d) {
  if (TOPK == 0) return;
  const i64 el = a.num_local_experts;
  i32 rank_of_k = -1;
  if (lane < TOPK) {
    const i64 e = reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + lane];
    if (e >= 0 && e < (i64)NUM_RANKS * el) rank_of_k = (i32)(e / el);
  }
  bool bad = false;
  for (u32 r = lane; r < (NUM_RANKS + WARP_SIZE - 1) / WARP_SIZE * WARP_SIZE; r += WARP_SIZE) {
    bool want = false;
#pragma unroll
    for (u32 k = 0; k < TOPK; k++) {
      const i32 rank_k = __shfl_sync(FULL_WARP_MASK, rank_of_k, k);  // every lane shuffles: no short circuit
      want = want || rank_k == (i32)r;
    }
    const bool sent = r < NUM_RANKS && prefix[(u64)(t + 1) * NUM_RANKS + r] > prefix[(u64)t * NUM_RANKS + r];
    bad = bad || (r < NUM_RANKS && want != sent);
  }
  if (__any_sync(FULL_WARP_MASK, bad) && lane == 0) report_error(d, ERR_INVALID_LAYOUT, f.me, LAYOUT_ARG_IN_RANK, t);
}

// Sender warp: chunks of Q tokens taken in order from the call's counter (a chunk never straddles a round:
// M is a multiple of Q). Lane b < N handles node b's hand-back wait, message range and put.
__device__ __forceinline__ void send(const HtiDispatchArgs& a, const Frame& f, const Deadline& dr) {
  const u32 lane = threadIdx.x % WARP_SIZE, T = a.num_tokens, Q = a.chunk_tokens, M = f.round_tokens;
  const i32* prefix = f.routing + f.at.prefix;
  const i32* node_prefix = f.routing + f.at.node_prefix;
  u32* counter = &hti_state(a.state)->dispatch_chunk;
  const u8* x = reinterpret_cast<const u8*>(a.x);
  for (;;) {
    u32 q = 0;
    if (lane == 0) q = ptx::atom_add_relaxed_gpu(counter, 1u);
    q = __shfl_sync(FULL_WARP_MASK, q, 0);
    if ((u64)q * Q >= T) break;
    const u32 t0 = q * Q, t1 = hti_min(t0 + Q, T), k = t0 / M, round_start = k * M, chunk = (t0 - round_start) / Q;
    const u64 seq = (u64)f.base + k + 1;
    hti_stamp_chunk(a.trace, q, 0);
    // The chunk's rows are contiguous in x: on their way to L2 while the warp waits and reads the routing.
    if (lane == 0) ptx::prefetch_l2_bulk(x + (u64)t0 * PAYLOAD_BYTES, (t1 - t0) * PAYLOAD_BYTES);
    // Lane b: this chunk's messages [m0, m1) for node b, after (b, l) handed round k - 1 back.
    u32 m0 = 0, m1 = 0;
    bool ok = true;
    if (lane < NUM_NODES) {
      const i32 start = node_prefix[(u64)round_start * NUM_NODES + lane];
      m0 = (u32)(node_prefix[(u64)t0 * NUM_NODES + lane] - start);
      m1 = (u32)(node_prefix[(u64)t1 * NUM_NODES + lane] - start);
      const u64* consumed = rdma_word(a.rdma, a.at.off_dconsumed + 8ull * lane);
      const u32 peer = lane * RANKS_PER_NODE + f.me_local;
      ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(consumed) - ((u64)f.base + k)) >= 0; }, for_peer(dr, peer, f.me), peer);
    }
    if (!__all_sync(FULL_WARP_MASK, ok)) return;
    // Stage every token's message once per node it reaches.
    for (u32 t = t0; t < t1; t++) {
      check_token_ranks(a, f, prefix, t, lane, dr);
      u32 m = 0;
      bool in = false;
      if (lane < NUM_NODES) {
        const i32 p0 = node_prefix[(u64)t * NUM_NODES + lane], p1 = node_prefix[(u64)(t + 1) * NUM_NODES + lane];
        in = p1 > p0;
        m = (u32)(p0 - node_prefix[(u64)round_start * NUM_NODES + lane]);
      }
      const u32 nodes = __ballot_sync(FULL_WARP_MASK, in);
      // What every node's message of t carries, read once: lane k < TOPK its top-k entry, lane i scales
      // i, i + 32, ...
      i32 id = -1;
      u32 weight = 0;
      if (TOPK > 0 && lane < TOPK) {
        id = (i32)reinterpret_cast<const i64*>(a.topk_idx)[(u64)t * TOPK + lane];
        weight = reinterpret_cast<const u32*>(a.topk_weights)[(u64)t * TOPK + lane];
      }
      constexpr u32 SCALES_PER_LANE = (NUM_SCALES + WARP_SIZE - 1) / WARP_SIZE;
      u32 scale[SCALES_PER_LANE > 0 ? SCALES_PER_LANE : 1];
#pragma unroll
      for (u32 i = 0; i < SCALES_PER_LANE; i++) {
        const u32 g = lane + i * WARP_SIZE;
        if (g < NUM_SCALES) scale[i] = reinterpret_cast<const u32*>(a.x_scales)[(i64)t * a.scale_stride_token + (i64)g * a.scale_stride_group];
      }
      u64 node_msg = 0;  // lane b: where node b's message goes
      for (u32 todo = nodes; todo != 0u; todo &= todo - 1) {
        const u32 b = __ffs(todo) - 1;
        const u32 mb = __shfl_sync(FULL_WARP_MASK, m, b);
        // In place at the rail peer where stores reach it, else staged for the put.
        u8* msg = rdma::window(a.rdma, b * RANKS_PER_NODE + f.me_local, a.at.off_drecv + (u64)f.me_node * a.at.part_bytes + (u64)mb * MSG_BYTES,
                               a.at.off_dsend + (u64)b * a.at.part_bytes + (u64)mb * MSG_BYTES)
                      .ptr;
        if (lane == b) node_msg = reinterpret_cast<u64>(msg);
        // Head and slots: lane j < L gives the slot at (b, j).
        u32 mask = 0;
        if (lane < RANKS_PER_NODE) {
          const u32 r = b * RANKS_PER_NODE + lane;
          const i32 s0 = prefix[(u64)t * NUM_RANKS + r], s1 = prefix[(u64)(t + 1) * NUM_RANKS + r];
          reinterpret_cast<i32*>(msg + MSG_SLOTS)[lane] = s1 > s0 ? s0 : -1;
          mask = s1 > s0 ? 1u : 0u;
        }
        mask = __ballot_sync(FULL_WARP_MASK, mask != 0u) & ((1u << RANKS_PER_NODE) - 1u);
        if (lane == 0) {
          reinterpret_cast<u32*>(msg)[0] = t;
          reinterpret_cast<u32*>(msg)[1] = mask;
          reinterpret_cast<u32*>(msg)[2] = MSG_TAG;
        }
        if (TOPK > 0 && lane < TOPK) {
          reinterpret_cast<i32*>(msg + MSG_IDS)[lane] = id;
          reinterpret_cast<u32*>(msg + MSG_WEIGHTS)[lane] = weight;
        }
#pragma unroll
        for (u32 i = 0; i < SCALES_PER_LANE; i++) {
          const u32 g = lane + i * WARP_SIZE;
          if (g < NUM_SCALES) reinterpret_cast<u32*>(msg + MSG_SCALES)[g] = scale[i];
        }
      }
      // The payload: read once, stored into every node's message.
      copy_to_messages(nodes, node_msg, reinterpret_cast<const u32x4*>(x + (u64)t * PAYLOAD_BYTES), lane);
    }
    __syncwarp();
    hti_stamp_chunk(a.trace, q, 1);
    // One put per node: the chunk's messages, then its chunk word (SET seq << 32 | m1).
    for (u32 b = 0; b < NUM_NODES; b++) {
      const u32 b0 = __shfl_sync(FULL_WARP_MASK, m0, b), b1 = __shfl_sync(FULL_WARP_MASK, m1, b);
      const u32 peer = b * RANKS_PER_NODE + f.me_local;
      const u64 sig = a.at.off_dchunk + ((u64)f.me_node * HTI_MAX_CHUNKS + chunk) * 8;
      const u64 value = (seq << 32) | b1;
      const u32 qp = chunk % a.rdma.num_qps;
      bool sent = true;
      if (b1 > b0) {
        const u64 dst = a.at.off_drecv + (u64)f.me_node * a.at.part_bytes + (u64)b0 * MSG_BYTES;
        const u64 src = a.at.off_dsend + (u64)b * a.at.part_bytes + (u64)b0 * MSG_BYTES;
        sent = rdma::put_window_signal_warp(a.rdma, qp, peer, rdma::window(a.rdma, peer, dst, src), dst, src, (b1 - b0) * MSG_BYTES, sig,
                                            value, SIGNAL_SET, dr);
      } else {
        if (lane == 0) sent = rdma::signal_thread(a.rdma, qp, peer, sig, value, SIGNAL_SET, dr);
        sent = __shfl_sync(FULL_WARP_MASK, sent ? 1u : 0u, 0) != 0;
      }
      if (!sent) return;
    }
    hti_stamp_chunk(a.trace, q, 2);
  }
}

// Forwarder warp `p` of the `P` = fwd_per_node warps of source node `an` (rail source s = an * L + l): its
// rounds in order, and in each the chunks c with c % P == p (see the top of the file). Lane j < L keeps local
// rank j's state: the chunk's first slot not yet flagged and how many, the warp's rows to j this round,
// whether j handed this round's part back. The warps of `an` share, per round, the chunks done, the rows per
// local rank and the messages of earlier rounds (HtiForward); the one that finishes a round's last chunk
// ends the round: done words, then the RDMA hand-back. A round's chunks arrive only after the hand-back of
// the round before, which comes after that round's end reset the shared counts: no warp counts into a round
// that is still ending.
__device__ __forceinline__ void forward(const HtiDispatchArgs& a, const Frame& f, u32 an, u32 p, const Deadline& dr, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens, Q = a.chunk_tokens, P = a.fwd_per_node;
  const u32 s = an * RANKS_PER_NODE + f.me_local;
  const u32 tokens = (u32)f.routing[f.at.tokens_of + s];
  const u32 rounds = rounds_of(f, tokens);
  const u32 first = (u32)f.routing[f.at.fwd_offset + an];
  u32* entries = reinterpret_cast<u32*>(a.fwd_entries);
  HtiForward* shared = hti_forward(a.state);
  const u32 j_rank = f.me_node * RANKS_PER_NODE + lane;  // lane j's global rank (lanes < L)
  const u64* chunk_words = rdma_word(a.rdma, a.at.off_dchunk + (u64)an * HTI_MAX_CHUNKS * 8);
  auto consumed_of = [&](u32 j) {
    return reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_consumed) + (u64)j * NUM_NODES + an;
  };
  for (u32 k = 0; k < rounds; k++) {
    const u64 seq = (u64)f.base + k + 1;
    const u32 chunks = (round_tokens_of(f, tokens, k) + Q - 1) / Q;
    u32 rows = 0, pending_from = 0, pending = 0;  // lane j: rows to j this round; unflagged slots [from, from + n)
    bool handed_back = false;
    // Every lane fences its row stores, then lane j flags j's rows written since the last release.
    auto release = [&]() {
      __syncwarp();
      ptx::fence_acq_rel_sys();
      __syncwarp();
      if (lane < RANKS_PER_NODE && pending > 0) {
        u32* flags = reinterpret_cast<u32*>(a.nvl.base[lane] + a.nvl.off_dflags) + (u64)s * a.nvl.flag_slots;
        for (u32 i = 0; i < pending; i++) ptx::st_relaxed_sys(flags + (pending_from + i) % M, (u32)seq);
        pending = 0;
      }
      __syncwarp();
    };
    // Lane j waits until j handed its part for s back for the round before.
    auto wait_handed_back = [&]() -> bool {
      bool ok = true;
      if (lane < RANKS_PER_NODE && !handed_back) {
        ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(consumed_of(lane)) - ((u64)f.base + k)) >= 0; },
                        for_peer(dn, j_rank, f.me), j_rank);
        handed_back = ok;
      }
      return __all_sync(FULL_WARP_MASK, ok);
    };
    u32 g = 0;  // messages of s before this round (read once this warp has a chunk of it)
    for (u32 c = p; c < chunks; c += P) {
      // The chunk's messages [end of chunk c - 1, end of chunk c): both words carry this round's seq.
      if (!warp_wait_u64(chunk_words + c, seq << 32, for_peer(dr, s, f.me), s)) return;
      if (c > 0 && !warp_wait_u64(chunk_words + c - 1, seq << 32, for_peer(dr, s, f.me), s)) return;
      const u32 trace_chunk = k * ((M + Q - 1) / Q) + c;
      hti_stamp_fwd(a.trace, an, trace_chunk, 0);
      const u32 m_end = (u32)ptx::ld_relaxed_sys_u64(chunk_words + c);
      u32 m = c > 0 ? (u32)ptx::ld_relaxed_sys_u64(chunk_words + c - 1) : 0u;
      // The chunk's messages are contiguous: on their way to L2 while the warp reads the first.
      if (lane == 0 && m_end > m)
        ptx::prefetch_l2_bulk(rdma_bytes(a.rdma, a.at.off_drecv + (u64)an * a.at.part_bytes + (u64)m * MSG_BYTES), (m_end - m) * MSG_BYTES);
      if (c == p) g = ptx::ld_acquire_gpu(&shared->messages_before[an]);
      for (; m < m_end; m++) {
        const u8* msg = rdma_bytes(a.rdma, a.at.off_drecv + (u64)an * a.at.part_bytes + (u64)m * MSG_BYTES);
        const u32 tag = reinterpret_cast<const u32*>(msg)[2];
        if (tag != MSG_TAG) {
          if (lane == 0) raise_error(dr, ERR_PEER_LAYOUT, s, ((u64)tag << 32) | MSG_TAG);
          return;
        }
        const u32 mask = reinterpret_cast<const u32*>(msg)[1];
        i32 slot = -1;
        if (lane < RANKS_PER_NODE) slot = reinterpret_cast<const i32*>(msg + MSG_SLOTS)[lane];
        if (__any_sync(FULL_WARP_MASK, slot >= 0 && !handed_back) && !wait_handed_back()) return;
        __syncwarp();
        for (u32 todo = mask; todo != 0u; todo &= todo - 1) {
          const u32 j = __ffs(todo) - 1;
          const u32 slot_j = (u32)__shfl_sync(FULL_WARP_MASK, slot, j);
          u8* row = reinterpret_cast<u8*>(a.nvl.base[j] + a.nvl.off_dparts + (u64)s * a.nvl.part_bytes) + (u64)(slot_j % M) * ROW_BYTES;
          copy_vecs<false>(reinterpret_cast<u32x4*>(row), reinterpret_cast<const u32x4*>(msg + MSG_PAYLOAD), PAYLOAD_VECS, lane);
          const u32 dst_rank = f.me_node * RANKS_PER_NODE + j;
          for (u32 w = lane; w < META_WORDS; w += WARP_SIZE)
            reinterpret_cast<u32*>(row + PAYLOAD_BYTES)[w] = meta_word(a, msg, w, dst_rank, k, g + m);
        }
        if (lane < RANKS_PER_NODE && slot >= 0) {
          if (pending == 0) pending_from = (u32)slot;
          pending++;
          rows++;
        }
        if (lane == 0) {
          if (first + g + m < a.fwd_capacity)
            entries[first + g + m] = mask | (k << ENTRY_ROUND_SHIFT);
          else
            report_error(dr, ERR_RECV_OVERFLOW, NO_PEER, (u64)f.routing[RT_NUM_FWD], a.fwd_capacity);
        }
        if (__any_sync(FULL_WARP_MASK, pending >= RELEASE_ROWS)) release();
      }
      // A chunk's rows to j have consecutive slots; the next chunk of this warp does not follow them.
      hti_stamp_fwd(a.trace, an, trace_chunk, 1);
      release();
      hti_stamp_fwd(a.trace, an, trace_chunk, 2);
      if (lane < RANKS_PER_NODE && rows > 0) atomicAdd(&shared->round_rows[an][lane], rows);
      rows = 0;
      __syncwarp();
      u32 done = 0;
      if (lane == 0) done = ptx::atom_add_acq_rel_gpu(&shared->chunks_done[an], 1u) + 1;
      done = __shfl_sync(FULL_WARP_MASK, done, 0);
      if (done != chunks) continue;
      // The round's last chunk: every local rank learns the round's row count — once it is past the round
      // before, even when this round brought it no row (its done word still holds that round's count until
      // then); then s may reuse its part here.
      if (!wait_handed_back()) return;
      if (lane < RANKS_PER_NODE) {
        const u32 total = ptx::ld_acquire_gpu(&shared->round_rows[an][lane]);
        shared->round_rows[an][lane] = 0;
        u64* done_word = reinterpret_cast<u64*>(a.nvl.base[lane] + a.nvl.off_done) + s;
        ptx::st_relaxed_sys_u64(done_word, (seq << 32) | total);
      }
      if (lane == 0) {
        shared->messages_before[an] = g + (u32)ptx::ld_relaxed_sys_u64(chunk_words + chunks - 1);
        shared->chunks_done[an] = 0;
        ptx::fence_acq_rel_sys();
        const u64 sig = a.at.off_dconsumed + 8ull * f.me_node;
        (void)rdma::signal_thread(a.rdma, an % a.rdma.num_qps, s, sig, hand_back_value(f, k, rounds), SIGNAL_SET, dr);
      }
      __syncwarp();
    }
  }
  if (rounds == 0 && p == 0 && lane == 0) {
    const u64 sig = a.at.off_dconsumed + 8ull * f.me_node;
    (void)rdma::signal_thread(a.rdma, an % a.rdma.num_qps, s, sig, (u64)f.base + f.rounds, SIGNAL_SET, dr);
  }
}

// Copies one arrived row (part [s][slot % M]) to its output position, with its meta words.
__device__ __forceinline__ void copy_out(const HtiDispatchArgs& a, const Frame& f, u32 s, u32 slot, u32 pos, u32 lane) {
  const u8* row = reinterpret_cast<const u8*>(a.nvl.base[f.me_local] + a.nvl.off_dparts + (u64)s * a.nvl.part_bytes) +
                  (u64)(slot % f.round_tokens) * ROW_BYTES;
  copy_vecs<false>(reinterpret_cast<u32x4*>(a.recv_x) + (u64)pos * PAYLOAD_VECS, reinterpret_cast<const u32x4*>(row), PAYLOAD_VECS, lane);
  const u32* meta = reinterpret_cast<const u32*>(row + PAYLOAD_BYTES);
  for (u32 w = lane; w < META_WORDS; w += WARP_SIZE) {
    const u32 v = meta[w];
    if (w < META_SCALES) reinterpret_cast<u32*>(a.recv_topk_idx)[(u64)pos * 2 * TOPK + w] = v;
    else if (w < META_WEIGHTS) reinterpret_cast<u32*>(a.recv_scales)[(u64)pos * NUM_SCALES + (w - META_SCALES)] = v;
    else if (w < META_SRC) reinterpret_cast<u32*>(a.recv_topk_weights)[(u64)pos * TOPK + (w - META_WEIGHTS)] = v;
    else if (w == META_SRC && a.recv_src_idx != 0) reinterpret_cast<u32*>(a.recv_src_idx)[pos] = v;
  }
  if (lane == 0) {
    const u64 route = ((u64)meta[META_ROUND] << 32) | meta[META_MESSAGE];
    reinterpret_cast<u64*>(a.recv_route)[pos] = route;
  }
}

// Receiver warp `w` of `n`: lane i serves source s = w + i * n (one lane per source: n >= R / 32). Sources
// are served in turn without blocking on any: a window of up to 32 rows from the next slot, copied once
// their flags reached the round's seq; the round ends when done[s] says how many rows it had. The window
// stays inside [round start, round start + M): a slot further on aliases one of this round's.
// What every receiver warp `w` of `n` does first: no-sync outputs' rows past the received count get top-k -1
// and weight 0 (spread over the warps); more rows than the outputs hold is reported.
__device__ __forceinline__ void pad_outputs(const HtiDispatchArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE;
  const u32 num_recv = (u32)f.routing[RT_NUM_RECV];
  if (TOPK > 0 && a.num_out_rows > num_recv) {
    const u64 total = (u64)a.num_out_rows * TOPK;
    for (u64 i = (u64)num_recv * TOPK + (u64)w * WARP_SIZE + lane; i < total; i += (u64)n * WARP_SIZE) {
      reinterpret_cast<i64*>(a.recv_topk_idx)[i] = -1;
      reinterpret_cast<u32*>(a.recv_topk_weights)[i] = 0u;
    }
  }
  if (w == 0 && lane == 0 && num_recv > a.num_out_rows) report_error(dn, ERR_RECV_OVERFLOW, NO_PEER, num_recv, a.num_out_rows);
}

// The part of source `s` at this rank goes back to its forwarder (this node's rank with s's local index):
// s may write it again, after round k (the last: base + K).
__device__ __forceinline__ void receiver_hand_back(const HtiDispatchArgs& a, const Frame& f, u32 s, u64 value) {
  u64* consumed = reinterpret_cast<u64*>(a.nvl.base[local_of(s)] + a.nvl.off_consumed) + (u64)f.me_local * NUM_NODES + node_of(s);
  ptx::st_relaxed_sys_u64(consumed, value);
}

__device__ __forceinline__ void receive(const HtiDispatchArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dr, const Deadline& dn) {
  constexpr u32 UNKNOWN = 0xffffffffu;
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  pad_outputs(a, f, w, n, dn);
  const u32 s = w + lane * n;
  const bool mine = s < NUM_RANKS;
  // Lane state: round k of `rounds`; next slot; the round's first slot and end slot (UNKNOWN until done[s]).
  u32 k = 0, rounds = 0, next = 0, round_start = 0, round_end = UNKNOWN, offset = 0;
  if (mine) {
    rounds = rounds_of(f, (u32)f.routing[f.at.tokens_of + s]);
    offset = (u32)f.routing[f.at.recv_offset + s];
  }
  const u64* done = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_done);
  const u32* flags_base = reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_dflags);
  auto hand_back = [&](u64 value) { receiver_hand_back(a, f, s, value); };
  if (mine && rounds == 0) hand_back((u64)f.base + f.rounds);
  u32 pending = __ballot_sync(FULL_WARP_MASK, mine && k < rounds);
  IdleClock idle;
  while (pending != 0u) {
    bool progressed = false;
    for (u32 todo = pending; todo != 0u; todo &= todo - 1) {
      const u32 i = __ffs(todo) - 1;
      const u32 src = __shfl_sync(FULL_WARP_MASK, s, i);
      const u32 seq = (u32)(f.base + __shfl_sync(FULL_WARP_MASK, k, i) + 1);
      const u32 q = __shfl_sync(FULL_WARP_MASK, next, i), start = __shfl_sync(FULL_WARP_MASK, round_start, i);
      u32 end = __shfl_sync(FULL_WARP_MASK, round_end, i);
      const u32 base_pos = __shfl_sync(FULL_WARP_MASK, offset, i);
      // The round's row count, once its forwarder said it.
      if (end == UNKNOWN) {
        u64 dw = 0;
        if (lane == 0) dw = ptx::ld_acquire_sys_u64(done + src);
        dw = __shfl_sync(FULL_WARP_MASK, dw, 0);
        if ((u32)(dw >> 32) == seq) end = start + (u32)dw;
      }
      // Lane x polls the flag of slot q + x.
      const u32 limit = end == UNKNOWN ? start + M : end;
      const u32 slot = q + lane;
      const u32* flag = flags_base + (u64)src * a.nvl.flag_slots + slot % M;
      const bool arrived = slot < limit && ptx::ld_relaxed_sys(flag) == seq;
      const u32 arrived_mask = __ballot_sync(FULL_WARP_MASK, arrived);
      const u32 ready = arrived_mask == FULL_WARP_MASK ? WARP_SIZE : (u32)__ffs(~arrived_mask) - 1;
      for (u32 r = 0; r < ready; r++) {
        // Every lane reads part of the row: every lane acquires its flag.
        (void)ptx::ld_acquire_sys(flags_base + (u64)src * a.nvl.flag_slots + (q + r) % M);
        const u32 pos = base_pos + q + r;
        if (pos < a.num_out_rows) copy_out(a, f, src, q + r, pos, lane);
      }
      const bool complete = end != UNKNOWN && q + ready == end;
      if (ready > 0 || complete) progressed = true;
      // The round's rows are read by every lane: every lane's fence before the part goes back.
      if (complete) {
        __syncwarp();
        ptx::fence_acq_rel_sys();
        __syncwarp();
      }
      if (lane == i) {
        next = q + ready;
        round_end = end;
        if (complete) {
          hand_back(hand_back_value(f, k, rounds));
          k++;
          round_start = next;
          round_end = UNKNOWN;
        }
      }
      __syncwarp();
    }
    pending = __ballot_sync(FULL_WARP_MASK, mine && k < rounds);
    if (pending != 0u && idle.expired(progressed, pending, s, f, dr, dn)) break;
  }
}

// Receiver warps when there are at least as many as sources: source s = w % R has the S warps w = s, s + R,
// s + 2R, ...; warp j = w / R of them copies its round's slots start + j, start + j + S, ... — each polls the
// flags of its next 32 slots and copies the rows that arrived, in order — and once past the round's end (the
// done word) counts itself out in recv_fin[s]; the last of the S to finish hands the part back. A source's
// stream is then copied by S warps at once instead of one lane's warp.
__device__ __forceinline__ void receive_split(const HtiDispatchArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dr,
                                              const Deadline& dn) {
  constexpr u32 UNKNOWN = 0xffffffffu;
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  pad_outputs(a, f, w, n, dn);
  const u32 s = w % NUM_RANKS, j = w / NUM_RANKS, S = (n - s + NUM_RANKS - 1) / NUM_RANKS;
  const u32 rounds = rounds_of(f, (u32)f.routing[f.at.tokens_of + s]);
  const u32 offset = (u32)f.routing[f.at.recv_offset + s];
  const u64* done = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_done);
  const u32* flags = reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_dflags) + (u64)s * a.nvl.flag_slots;
  u32* fin = &hti_forward(a.state)->recv_fin[s];
  if (rounds == 0) {
    if (j == 0 && lane == 0) receiver_hand_back(a, f, s, (u64)f.base + f.rounds);
    return;
  }
  IdleClock idle;
  u32 start = 0;  // the round's first slot
  for (u32 k = 0; k < rounds; k++) {
    const u32 seq = (u32)(f.base + k + 1);
    u32 end = UNKNOWN, next = start + j;
    for (;;) {
      // The round's row count, once its forwarder said it.
      if (end == UNKNOWN) {
        u64 dw = 0;
        if (lane == 0) dw = ptx::ld_acquire_sys_u64(done + s);
        dw = __shfl_sync(FULL_WARP_MASK, dw, 0);
        if ((u32)(dw >> 32) == seq) end = start + (u32)dw;
      }
      if (end != UNKNOWN && next >= end) break;
      // Lane x polls this warp's slot next + x S (a slot past start + M aliases one of this round's).
      const u32 limit = end == UNKNOWN ? start + M : end;
      const u32 slot = next + lane * S;
      const bool arrived = slot < limit && ptx::ld_relaxed_sys(flags + slot % M) == seq;
      const u32 arrived_mask = __ballot_sync(FULL_WARP_MASK, arrived);
      const u32 ready = arrived_mask == FULL_WARP_MASK ? WARP_SIZE : (u32)__ffs(~arrived_mask) - 1;
      for (u32 r = 0; r < ready; r++) {
        const u32 q = next + r * S;
        // Every lane reads part of the row: every lane acquires its flag.
        (void)ptx::ld_acquire_sys(flags + q % M);
        if (offset + q < a.num_out_rows) copy_out(a, f, s, q, offset + q, lane);
      }
      next += ready * S;
      if (idle.expired(ready > 0, 1u, s, f, dr, dn)) return;
    }
    // This warp's rows of the round are out (every lane read some: every lane fences); the last warp of the
    // S resets the count for the next round, then hands the part back.
    __syncwarp();
    ptx::fence_acq_rel_sys();
    __syncwarp();
    if (lane == 0 && ptx::atom_add_acq_rel_gpu(fin, 1u) + 1 == S) {
      ptx::st_release_gpu(fin, 0u);
      ptx::fence_acq_rel_sys();
      receiver_hand_back(a, f, s, hand_back_value(f, k, rounds));
    }
    __syncwarp();
    start = end;
  }
}
}  // namespace hti_dispatch

namespace moelink::internode {
// moelink::internode::dispatch: grid = workers (persistent, cooperative) + the emulated NIC's blocks, block
//   THREADS. Blocks [0, num_send_blocks) send, the next num_fwd_blocks forward (warp w: source node w % N,
//   its chunks c with c % P == w / N; never one warp for two source nodes: it could wait for the first while
//   the second's sender waits for it, so the host gives num_fwd_blocks * HTI_WARPS >= N * P), the rest
//   receive: several warps per source when there are at least R (receive_split), else one lane per source
//   (receive; warps >= R / 32). Protocol: the top of this file. reads: x, scales, top-k, routing, own RDMA receive parts and NVLink parts, signals;
//   writes: own RDMA send parts or peers' RDMA parts in place, peers' RDMA parts and signals (puts), node
//   peers' NVLink parts, flags, done
//   and consumed words, the outputs, fwd_entries and recv_route (the handle), HtiState.
__global__ void __launch_bounds__(THREADS, 1) dispatch(const __grid_constant__ HtiDispatchArgs a) {
  const Deadline dr = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_DISPATCH_RDMA);
  const Deadline dn = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_DISPATCH_NVLINK);
  HtiState* st = hti_state(a.state);
  hti_run(
      a, a.num_tokens, &st->dispatch_base, &st->dispatch_done, dr,
      [&](const Frame& f, Role role, u32 w, u32 n) {
        if (role == Role::SEND) {
          hti_dispatch::send(a, f, dr);
        } else if (role == Role::FORWARD) {
          if (w < NUM_NODES * a.fwd_per_node) hti_dispatch::forward(a, f, w % NUM_NODES, w / NUM_NODES, dr, dn);
        } else if (n >= NUM_RANKS) {
          hti_dispatch::receive_split(a, f, w, n, dr, dn);
        } else {
          hti_dispatch::receive(a, f, w, n, dr, dn);
        }
      },
      [&]() {
        st->dispatch_chunk = 0u;
        for (u32 n = 0; n < NUM_NODES; n++) hti_forward(a.state)->messages_before[n] = 0u;
      });
}
}  // namespace moelink::internode

// ============================================================================================== combine
namespace hti_combine {

// A received row `pos` (its bf16 payload, then its TOPK weights) into `row` of a forwarder's combine part.
__device__ __forceinline__ void stage_combine_row(const HtiCombineArgs& a, u8* row, u32 pos, u32 lane) {
  copy_vecs<true>(reinterpret_cast<u32x4*>(row), reinterpret_cast<const u32x4*>(a.x) + (u64)pos * (CPAYLOAD_BYTES / VEC_BYTES),
                  CPAYLOAD_BYTES / VEC_BYTES, lane);
  if (TOPK > 0 && lane < TOPK)
    reinterpret_cast<u32*>(row + CPAYLOAD_BYTES)[lane] = reinterpret_cast<const u32*>(a.topk_weights)[(u64)pos * TOPK + lane];
}

// The rows just staged at `slots[0..sent)`: every lane fences its stores (each wrote part of every row), then
// lane x flags slot slots[x] with `cseq`.
__device__ __forceinline__ void release_combine_rows(u32* flag, const u32 (&slots)[RELEASE_ROWS], u32 sent, u32 cseq, u32 lane) {
  __syncwarp();
  ptx::fence_acq_rel_sys();
  __syncwarp();
  if (lane < sent) {
    u32 my_slot = 0;
#pragma unroll
    for (u32 x = 0; x < RELEASE_ROWS; x++)
      if (x == lane) my_slot = slots[x];
    ptx::st_relaxed_sys(flag + my_slot, cseq);
  }
  __syncwarp();
}

// Expert-side sender warp `w` of `n`: lane i serves source s = w + i * n. Each received row of s goes back
// to its forwarder (this node's rank with s's local index) into combine part [me_local][node(s)] at
// (message mod M), flagged cseq of its round, once that forwarder handed the part back for the round before.
// Sources are served in turn, up to RELEASE_ROWS rows of one round per turn, without blocking on any.
__device__ __forceinline__ void send(const HtiCombineArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dr, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  const u32 s = w + lane * n;
  const bool mine = s < NUM_RANKS;
  u32 next = 0, count = 0, offset = 0;
  if (mine) {
    offset = (u32)f.routing[f.at.recv_offset + s];
    count = (u32)f.routing[f.at.recv_count + s];
  }
  const u64* route = reinterpret_cast<const u64*>(a.recv_route);
  const u64* cconsumed = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_cconsumed);
  u32 pending = __ballot_sync(FULL_WARP_MASK, mine && next < count);
  IdleClock idle;
  while (pending != 0u) {
    bool progressed = false;
    for (u32 todo = pending; todo != 0u; todo &= todo - 1) {
      const u32 i = __ffs(todo) - 1;
      const u32 src = __shfl_sync(FULL_WARP_MASK, s, i);
      const u32 q0 = __shfl_sync(FULL_WARP_MASK, next, i), cnt = __shfl_sync(FULL_WARP_MASK, count, i);
      const u32 base_pos = __shfl_sync(FULL_WARP_MASK, offset, i);
      const u32 l = local_of(src), an = node_of(src);
      // The round of the next row (rows of a source come in round order).
      const u32 pos0 = base_pos + q0;
      if (pos0 >= a.num_x_rows) {
        // No-sync overflow (dispatch reported it): the row was never received, nothing goes back.
        if (lane == i) next = cnt;
        progressed = true;
        continue;
      }
      const u32 k = (u32)(route[pos0] >> 32);
      u64 handed = 0;
      if (lane == 0) handed = ptx::ld_acquire_sys_u64(cconsumed + (u64)l * NUM_NODES + an);
      handed = __shfl_sync(FULL_WARP_MASK, handed, 0);
      if ((i64)(handed - ((u64)f.base + k)) < 0) continue;
      (void)ptx::ld_acquire_sys_u64(cconsumed + (u64)l * NUM_NODES + an);
      const u32 cseq = f.base + k + 1;
      u32 sent = 0;
      u32 slots[RELEASE_ROWS];
      for (; sent < RELEASE_ROWS && q0 + sent < cnt; sent++) {
        const u32 pos = base_pos + q0 + sent;
        if (pos >= a.num_x_rows) break;
        const u64 r = route[pos];
        if ((u32)(r >> 32) != k) break;
        slots[sent] = (u32)r % M;
        stage_combine_row(a, reinterpret_cast<u8*>(a.nvl.base[l] + a.nvl.off_cparts + ((u64)f.me_local * NUM_NODES + an) * a.nvl.part_bytes) +
                                 (u64)slots[sent] * CROW_BYTES,
                          pos, lane);
      }
      release_combine_rows(reinterpret_cast<u32*>(a.nvl.base[l] + a.nvl.off_cflags) + ((u64)f.me_local * NUM_NODES + an) * a.nvl.flag_slots,
                           slots, sent, cseq, lane);
      if (sent > 0) progressed = true;
      if (lane == i) next += sent;
    }
    pending = __ballot_sync(FULL_WARP_MASK, mine && next < count);
    if (pending != 0u && idle.expired(progressed, pending, s, f, dr, dn)) break;
  }
}

// Expert-side sender warps when there are at least as many as sources: source s = w % R has the S warps w =
// s, s + R, ...; warp j = w / R of them sends the source's received rows j, j + S, ... (round order), up to
// RELEASE_ROWS of one round per fence, each round once its forwarder handed that round's part back.
__device__ __forceinline__ void send_split(const HtiCombineArgs& a, const Frame& f, u32 w, u32 n, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens;
  const u32 s = w % NUM_RANKS, j = w / NUM_RANKS, S = (n - s + NUM_RANKS - 1) / NUM_RANKS;
  const u32 offset = (u32)f.routing[f.at.recv_offset + s], count = (u32)f.routing[f.at.recv_count + s];
  const u32 l = local_of(s), an = node_of(s), forwarder = f.me_node * RANKS_PER_NODE + l;
  const u64* route = reinterpret_cast<const u64*>(a.recv_route);
  const u64* handed = reinterpret_cast<const u64*>(a.nvl.base[f.me_local] + a.nvl.off_cconsumed) + (u64)l * NUM_NODES + an;
  u8* part = reinterpret_cast<u8*>(a.nvl.base[l] + a.nvl.off_cparts + ((u64)f.me_local * NUM_NODES + an) * a.nvl.part_bytes);
  u32* flag = reinterpret_cast<u32*>(a.nvl.base[l] + a.nvl.off_cflags) + ((u64)f.me_local * NUM_NODES + an) * a.nvl.flag_slots;
  for (u32 q = j; q < count;) {
    // No-sync overflow (dispatch reported it): rows from here on were never received, nothing goes back.
    if (offset + q >= a.num_x_rows) break;
    const u32 k = (u32)(route[offset + q] >> 32);
    bool ok = true;
    if (lane == 0)
      ok = spin_until([&]() { return (i64)(ptx::ld_acquire_sys_u64(handed) - ((u64)f.base + k)) >= 0; }, for_peer(dn, forwarder, f.me),
                      forwarder);
    if (__shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) == 0u) return;
    (void)ptx::ld_acquire_sys_u64(handed);
    u32 sent = 0;
    u32 slots[RELEASE_ROWS];
    for (; sent < RELEASE_ROWS && q < count; sent++, q += S) {
      const u32 pos = offset + q;
      if (pos >= a.num_x_rows) break;
      const u64 r = route[pos];
      if ((u32)(r >> 32) != k) break;
      slots[sent] = (u32)r % M;
      stage_combine_row(a, part + (u64)slots[sent] * CROW_BYTES, pos, lane);
    }
    release_combine_rows(flag, slots, sent, (u32)(f.base + k + 1), lane);
  }
}

// Forwarder warp `p` of the `P` = fwd_per_node warps of source node `an`: per round, its chunks of Q
// messages (chunk c with c % P == p; fwd_entries say which ranks each message went to), each message the
// rows of those ranks summed as the node level of the tree; the chunk's partials staged and put home with
// its chunk word. The warp that finishes a round's last chunk hands the round's parts back to the node's
// ranks (HtiForward::combine_chunks_done counts; a round's rows arrive only after the hand-back of the round before).
__device__ __forceinline__ void forward(const HtiCombineArgs& a, const Frame& f, u32 an, u32 p, const Deadline& dr, const Deadline& dn) {
  const u32 lane = threadIdx.x % WARP_SIZE, M = f.round_tokens, Q = a.chunk_tokens, P = a.fwd_per_node;
  HtiForward* shared = hti_forward(a.state);
  const u32 s = an * RANKS_PER_NODE + f.me_local;
  const u32 tokens = (u32)f.routing[f.at.tokens_of + s];
  const u32 rounds = rounds_of(f, tokens);
  const u32 first = (u32)f.routing[f.at.fwd_offset + an], total = (u32)f.routing[f.at.fwd_count + an];
  const u32* entries = reinterpret_cast<const u32*>(a.fwd_entries);
  u32 g = 0;  // messages of s before this round
  // Round k's parts go back to the node's ranks, after round k - 1's: a round without messages from this
  // node goes back as soon as a warp reaches it, possibly before a warp still finishing the round before,
  // and a hand-back word must never go down. false: a deadline passed.
  auto nvl_hand_back = [&](u32 k, u64 value) -> bool {
    bool ok = true;
    if (lane == 0) ok = spin_until([&]() { return ptx::ld_acquire_gpu(&shared->combine_rounds_back[an]) >= k; }, for_peer(dn, NO_PEER, f.me), NO_PEER);
    if (__shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) == 0u) return false;
    __syncwarp();
    ptx::fence_acq_rel_sys();
    __syncwarp();
    if (lane < RANKS_PER_NODE) {
      u64* word = reinterpret_cast<u64*>(a.nvl.base[lane] + a.nvl.off_cconsumed) + (u64)f.me_local * NUM_NODES + an;
      ptx::st_relaxed_sys_u64(word, value);
    }
    __syncwarp();
    if (lane == 0) ptx::st_release_gpu(&shared->combine_rounds_back[an], k + 1);
    __syncwarp();
    return true;
  };
  for (u32 k = 0; k < rounds; k++) {
    const u32 cseq = f.base + k + 1;
    // This round's messages: entries [g, g + cnt) carry round k (entries of one source are in round order).
    u32 lo = g, hi = total;
    while (lo < hi) {
      const u32 mid = lo + (hi - lo) / 2;
      if ((entries[first + mid] >> ENTRY_ROUND_SHIFT) <= k) lo = mid + 1;
      else hi = mid;
    }
    const u32 cnt = lo - g;
    const u32 chunks = (cnt + Q - 1) / Q;
    if (p < chunks) {
      const u64* consumed = rdma_word(a.rdma, a.at.off_cconsumed + 8ull * an);
      if (!warp_wait_u64(consumed, (u64)f.base + k, for_peer(dr, s, f.me), s)) return;
    }
    for (u32 c0 = p * Q; c0 < cnt; c0 += P * Q) {
      const u32 c1 = hti_min(c0 + Q, cnt);
      const u32 trace_chunk = k * ((M + Q - 1) / Q) + c0 / Q;
      hti_stamp_fwd(a.trace, an, trace_chunk, 0);
      for (u32 m = c0; m < c1; m++) {
        const u32 message = g + m;
        const u32 mask = entries[first + message] & 0xffu;
        // Lane j waits for j's row (NVLink domain), then every lane acquires each flag.
        bool ok = true;
        const u32 slot = message % M;
        if (lane < RANKS_PER_NODE && ((mask >> lane) & 1u) != 0u) {
          const u32* flag = reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_cflags) +
                            ((u64)lane * NUM_NODES + an) * a.nvl.flag_slots + slot;
          const u32 peer = f.me_node * RANKS_PER_NODE + lane;
          ok = wait_flag_geq<true>(flag, cseq, for_peer(dn, peer, f.me), peer);
        }
        if (!__all_sync(FULL_WARP_MASK, ok)) return;
        for (u32 j = 0; j < RANKS_PER_NODE; j++)
          if (((mask >> j) & 1u) != 0u)
            (void)ptx::ld_acquire_sys(reinterpret_cast<const u32*>(a.nvl.base[f.me_local] + a.nvl.off_cflags) +
                                      ((u64)j * NUM_NODES + an) * a.nvl.flag_slots + slot);
        // In place at home where stores reach it, else staged for the put.
        u8* out = rdma::window(a.rdma, s, a.at.off_crecv + (u64)f.me_node * a.at.part_bytes + (u64)m * CMSG_BYTES,
                               a.at.off_csend + (u64)an * a.at.part_bytes + (u64)m * CMSG_BYTES)
                      .ptr;
        auto row_of = [&](u32 j) -> const u8* {
          return reinterpret_cast<const u8*>(a.nvl.base[f.me_local] + a.nvl.off_cparts + ((u64)j * NUM_NODES + an) * a.nvl.part_bytes) +
                 (u64)slot * CROW_BYTES;
        };
        // One rank of the node holds the token: its bf16 row goes home as it is (half the bytes of an fp32
        // partial; the reducer applies the tree's +0.0 padding, single_contributor_partial).
        constexpr u32 VECS = CPAYLOAD_BYTES / VEC_BYTES;
        if (__popc(mask) == 1) copy_vecs<false>(reinterpret_cast<u32x4*>(out), reinterpret_cast<const u32x4*>(row_of(__ffs(mask) - 1)), VECS, lane);
        // 8 channels (one bf16 vector) per lane and step: the node tree over the local ranks. A lane loads
        // the vectors of NODE_STEPS steps before it sums any (NODE_STEPS x ranks loads in flight): the sum
        // of a row is otherwise one load latency per step.
        constexpr u32 W = Tree<RANKS_PER_NODE, 8>::W;
        constexpr u32 NODE_STEPS = W >= 8 ? 1 : 8 / W;
        const u32x4* rows[RANKS_PER_NODE];
#pragma unroll
        for (u32 j = 0; j < RANKS_PER_NODE; j++) rows[j] = reinterpret_cast<const u32x4*>(row_of(j));
        for (u32 v0 = lane; v0 < VECS && __popc(mask) != 1; v0 += NODE_STEPS * WARP_SIZE) {
          u32x4 in[NODE_STEPS][RANKS_PER_NODE];
#pragma unroll
          for (u32 u = 0; u < NODE_STEPS; u++) {
            const u32 v = v0 + u * WARP_SIZE;
#pragma unroll
            for (u32 j = 0; j < RANKS_PER_NODE; j++)
              if (v < VECS && ((mask >> j) & 1u) != 0u) in[u][j] = ptx::ld_na_v4(rows[j] + v);
          }
#pragma unroll
          for (u32 u = 0; u < NODE_STEPS; u++) {
            const u32 v = v0 + u * WARP_SIZE;
            if (v >= VECS) break;
            Tree<RANKS_PER_NODE, 8> tree;
#pragma unroll
            for (u32 j = 0; j < W; j++) {
              float x[8];
              if (j < RANKS_PER_NODE && ((mask >> j) & 1u) != 0u) {
                bf16x8_to_f32(in[u][j < RANKS_PER_NODE ? j : 0], x);
              } else {
#pragma unroll
                for (u32 c = 0; c < 8; c++) x[c] = 0.0f;
              }
              tree.push(j, x);
            }
            u32x4 lo4, hi4;
            lo4.x = ptx::bits_from_f32(tree.result(0));
            lo4.y = ptx::bits_from_f32(tree.result(1));
            lo4.z = ptx::bits_from_f32(tree.result(2));
            lo4.w = ptx::bits_from_f32(tree.result(3));
            hi4.x = ptx::bits_from_f32(tree.result(4));
            hi4.y = ptx::bits_from_f32(tree.result(5));
            hi4.z = ptx::bits_from_f32(tree.result(6));
            hi4.w = ptx::bits_from_f32(tree.result(7));
            ptx::st_na_v4(reinterpret_cast<u32x4*>(out) + 2 * v, lo4);
            ptx::st_na_v4(reinterpret_cast<u32x4*>(out) + 2 * v + 1, hi4);
          }
        }
        if (TOPK > 0 && lane < TOPK) {
          Tree<RANKS_PER_NODE, 1> tree;
#pragma unroll
          for (u32 j = 0; j < Tree<RANKS_PER_NODE, 1>::W; j++) {
            float x[1] = {0.0f};
            if (j < RANKS_PER_NODE && ((mask >> j) & 1u) != 0u)
              x[0] = ptx::f32_from_bits(reinterpret_cast<const u32*>(row_of(j) + CPAYLOAD_BYTES)[lane]);
            tree.push(j, x);
          }
          reinterpret_cast<float*>(out + 4 * HIDDEN)[lane] = tree.result(0);
        }
      }
      // The chunk's partials, then its chunk word, in one operation.
      __syncwarp();
      hti_stamp_fwd(a.trace, an, trace_chunk, 1);
      const u32 chunk = c0 / Q;
      const u64 dst = a.at.off_crecv + (u64)f.me_node * a.at.part_bytes + (u64)c0 * CMSG_BYTES;
      const u64 src = a.at.off_csend + (u64)an * a.at.part_bytes + (u64)c0 * CMSG_BYTES;
      const u64 sig = a.at.off_cchunk + ((u64)f.me_node * HTI_MAX_CHUNKS + chunk) * 8;
      if (!rdma::put_window_signal_warp(a.rdma, chunk % a.rdma.num_qps, s, rdma::window(a.rdma, s, dst, src), dst, src, (c1 - c0) * CMSG_BYTES,
                                        sig, ((u64)cseq << 32) | c1, SIGNAL_SET, dr))
        return;
      hti_stamp_fwd(a.trace, an, trace_chunk, 2);
      // The round's last chunk read the last rows of the round: every local rank may write its part again.
      u32 done = 0;
      if (lane == 0) done = ptx::atom_add_acq_rel_gpu(&shared->combine_chunks_done[an], 1u) + 1;
      done = __shfl_sync(FULL_WARP_MASK, done, 0);
      if (done == chunks) {
        if (lane == 0) shared->combine_chunks_done[an] = 0;
        if (!nvl_hand_back(k, hand_back_value(f, k, rounds))) return;
      }
    }
    g += cnt;
    // A round without messages from this node: nothing to read, the part goes back at once.
    if (chunks == 0 && p == 0 && !nvl_hand_back(k, hand_back_value(f, k, rounds))) return;
  }
  if (rounds == 0 && p == 0) (void)nvl_hand_back(0, (u64)f.base + f.rounds);
}

// Home-side reducer warp: token chunks of Q in order from the call's counter, one round at a time (a chunk
// of round k waits until round k - 1 is reduced, so that hand-backs go out in round order). Per token, lane b
// finds node b's partial (chunk word, RDMA domain); the upper tree over the nodes, + 0.0, the biases, bf16.
__device__ __forceinline__ void reduce(const HtiCombineArgs& a, const Frame& f, const Deadline& dr) {
  const u32 lane = threadIdx.x % WARP_SIZE, T = a.num_tokens, Q = a.chunk_tokens, M = f.round_tokens;
  const i32* node_prefix = f.routing + f.at.node_prefix;
  HtiState* st = hti_state(a.state);
  const u32 rounds = rounds_of(f, T);
  auto hand_back_all = [&](u64 value) {
    if (lane < NUM_NODES) {
      const u32 peer = lane * RANKS_PER_NODE + f.me_local;
      (void)rdma::signal_thread(a.rdma, lane % a.rdma.num_qps, peer, a.at.off_cconsumed + 8ull * f.me_node, value, SIGNAL_SET, dr);
    }
    __syncwarp();
  };
  if (rounds == 0) {
    if (threadIdx.x < WARP_SIZE && blockIdx.x == a.num_send_blocks + a.num_fwd_blocks) hand_back_all((u64)f.base + f.rounds);
    return;
  }
  const u32* bias0 = reinterpret_cast<const u32*>(a.bias0);
  const u32* bias1 = reinterpret_cast<const u32*>(a.bias1);
  for (;;) {
    u32 q = 0;
    if (lane == 0) q = ptx::atom_add_relaxed_gpu(&st->combine_chunk, 1u);
    q = __shfl_sync(FULL_WARP_MASK, q, 0);
    if ((u64)q * Q >= T) break;
    const u32 t0 = q * Q, t1 = hti_min(t0 + Q, T), k = t0 / M, round_start = k * M;
    const u32 cseq = f.base + k + 1;
    hti_stamp_chunk(a.trace, q, 0);
    // Lane b: node b's partials of the chunk's tokens are contiguous, on their way to L2 while the warp waits.
    if (lane < NUM_NODES) {
      const i32 start = node_prefix[(u64)round_start * NUM_NODES + lane];
      const u32 m0 = (u32)(node_prefix[(u64)t0 * NUM_NODES + lane] - start), m1 = (u32)(node_prefix[(u64)t1 * NUM_NODES + lane] - start);
      if (m1 > m0) ptx::prefetch_l2_bulk(rdma_bytes(a.rdma, a.at.off_crecv + (u64)lane * a.at.part_bytes + (u64)m0 * CMSG_BYTES), (m1 - m0) * CMSG_BYTES);
    }
    // Rounds in order: wait until the reducers finished round k - 1.
    if (k > 0) {
      bool ok = true;
      if (lane == 0) ok = spin_until([&]() { return ptx::ld_acquire_gpu(&st->combine_rounds_done) >= k; }, for_peer(dr, NO_PEER, f.me), NO_PEER);
      if (__shfl_sync(FULL_WARP_MASK, ok ? 1u : 0u, 0) == 0u) return;
    }
    for (u32 t = t0; t < t1; t++) {
      u32 m = 0;
      bool in = false, ok = true;
      if (lane < NUM_NODES) {
        const i32 p0 = node_prefix[(u64)t * NUM_NODES + lane], p1 = node_prefix[(u64)(t + 1) * NUM_NODES + lane];
        in = p1 > p0;
        m = (u32)(p0 - node_prefix[(u64)round_start * NUM_NODES + lane]);
        if (in) {
          const u32 peer = lane * RANKS_PER_NODE + f.me_local;
          ok = rdma::wait_signal_geq(a.rdma, a.at.off_cchunk + ((u64)lane * HTI_MAX_CHUNKS + m / Q) * 8, (u64)cseq << 32,
                                     for_peer(dr, peer, f.me), peer);
        }
      }
      if (!__all_sync(FULL_WARP_MASK, ok)) return;
      if (t == t0) hti_stamp_chunk(a.trace, q, 1);
      const u32 nodes = __ballot_sync(FULL_WARP_MASK, in);
      // Nodes where one rank held the token sent its bf16 row instead of an fp32 partial.
      u32 holders = 0;
      if (in) {
        const i32* prefix = f.routing + f.at.prefix;
        for (u32 j = 0; j < RANKS_PER_NODE; j++) {
          const u32 r = lane * RANKS_PER_NODE + j;
          holders += prefix[(u64)(t + 1) * NUM_RANKS + r] > prefix[(u64)t * NUM_RANKS + r] ? 1u : 0u;
        }
      }
      const u32 single = __ballot_sync(FULL_WARP_MASK, in && holders == 1);
      for (u32 b = 0; b < NUM_NODES; b++)
        if (((nodes >> b) & 1u) != 0u) (void)ptx::ld_acquire_sys_u64(rdma_word(a.rdma, a.at.off_cchunk + ((u64)b * HTI_MAX_CHUNKS + __shfl_sync(FULL_WARP_MASK, m, b) / Q) * 8));
      u64 part[NUM_NODES];
#pragma unroll
      for (u32 b = 0; b < NUM_NODES; b++)
        part[b] = a.rdma.local_base + a.at.off_crecv + (u64)b * a.at.part_bytes + (u64)__shfl_sync(FULL_WARP_MASK, m, b) * CMSG_BYTES;
      u32x4* out = reinterpret_cast<u32x4*>(a.combined_x) + (u64)t * (CPAYLOAD_BYTES / VEC_BYTES);
      // 8 channels per lane and step; a lane loads the partials of REDUCE_STEPS steps before it sums any
      // (the sum of a token is otherwise one load latency per step).
      constexpr u32 VECS = CPAYLOAD_BYTES / VEC_BYTES;
      constexpr u32 W = Tree<NUM_NODES, 8>::W;
      constexpr u32 REDUCE_STEPS = W >= 4 ? 1 : 4 / W;
      for (u32 v0 = lane; v0 < VECS; v0 += REDUCE_STEPS * WARP_SIZE) {
        u32x4 in[REDUCE_STEPS][NUM_NODES][2];
#pragma unroll
        for (u32 u = 0; u < REDUCE_STEPS; u++) {
          const u32 v = v0 + u * WARP_SIZE;
#pragma unroll
          for (u32 b = 0; b < NUM_NODES; b++) {
            if (v < VECS && ((single >> b) & 1u) != 0u) {
              in[u][b][0] = ptx::ld_na_v4(reinterpret_cast<const u32x4*>(part[b]) + v);
            } else if (v < VECS && ((nodes >> b) & 1u) != 0u) {
              in[u][b][0] = ptx::ld_na_v4(reinterpret_cast<const u32x4*>(part[b]) + 2 * v);
              in[u][b][1] = ptx::ld_na_v4(reinterpret_cast<const u32x4*>(part[b]) + 2 * v + 1);
            }
          }
        }
#pragma unroll
        for (u32 u = 0; u < REDUCE_STEPS; u++) {
          const u32 v = v0 + u * WARP_SIZE;
          if (v >= VECS) break;
          Tree<NUM_NODES, 8> tree;
#pragma unroll
          for (u32 b = 0; b < W; b++) {
            float x[8];
            if (b < NUM_NODES && ((single >> b) & 1u) != 0u) {
              single_contributor_partial(in[u][b < NUM_NODES ? b : 0][0], x);
            } else if (b < NUM_NODES && ((nodes >> b) & 1u) != 0u) {
              const u32x4 lo4 = in[u][b < NUM_NODES ? b : 0][0], hi4 = in[u][b < NUM_NODES ? b : 0][1];
              x[0] = ptx::f32_from_bits(lo4.x);
              x[1] = ptx::f32_from_bits(lo4.y);
              x[2] = ptx::f32_from_bits(lo4.z);
              x[3] = ptx::f32_from_bits(lo4.w);
              x[4] = ptx::f32_from_bits(hi4.x);
              x[5] = ptx::f32_from_bits(hi4.y);
              x[6] = ptx::f32_from_bits(hi4.z);
              x[7] = ptx::f32_from_bits(hi4.w);
            } else {
#pragma unroll
              for (u32 c = 0; c < 8; c++) x[c] = 0.0f;
            }
            tree.push(b, x);
          }
          float acc[8];
#pragma unroll
          for (u32 c = 0; c < 8; c++) acc[c] = ptx::add_rn_f32(0.0f, tree.result(c));
          if (NUM_BIASES >= 1) {
            float bx[8];
            bf16x8_to_f32(ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(bias0) + (u64)t * VECS + v), bx);
#pragma unroll
            for (u32 c = 0; c < 8; c++) acc[c] = ptx::add_rn_f32(acc[c], bx[c]);
          }
          if (NUM_BIASES >= 2) {
            float bx[8];
            bf16x8_to_f32(ptx::ld_nc_na_v4(reinterpret_cast<const u32x4*>(bias1) + (u64)t * VECS + v), bx);
#pragma unroll
            for (u32 c = 0; c < 8; c++) acc[c] = ptx::add_rn_f32(acc[c], bx[c]);
          }
          u32x4 o;
          o.x = ptx::cvt_rn_bf16x2_f32(acc[1], acc[0]);
          o.y = ptx::cvt_rn_bf16x2_f32(acc[3], acc[2]);
          o.z = ptx::cvt_rn_bf16x2_f32(acc[5], acc[4]);
          o.w = ptx::cvt_rn_bf16x2_f32(acc[7], acc[6]);
          ptx::st_na_v4(out + v, o);
        }
      }
      if (TOPK > 0 && lane < TOPK) {
        Tree<NUM_NODES, 1> tree;
#pragma unroll
        for (u32 b = 0; b < Tree<NUM_NODES, 1>::W; b++) {
          float x[1] = {0.0f};
          if (b < NUM_NODES && ((nodes >> b) & 1u) != 0u) x[0] = reinterpret_cast<const float*>(part[b] + 4 * HIDDEN)[lane];
          tree.push(b, x);
        }
        reinterpret_cast<float*>(a.combined_topk_weights)[(u64)t * TOPK + lane] = ptx::add_rn_f32(0.0f, tree.result(0));
      }
    }
    // The chunk is reduced; the last chunk of a round hands the round back to every rail peer.
    __syncwarp();
    hti_stamp_chunk(a.trace, q, 2);
    u32 finished = 0;
    if (lane == 0) finished = ptx::atom_add_acq_rel_gpu(&st->combine_round_tokens, t1 - t0) + (t1 - t0);
    finished = __shfl_sync(FULL_WARP_MASK, finished, 0);
    if (finished == round_tokens_of(f, T, k)) {
      hand_back_all(hand_back_value(f, k, rounds));
      if (lane == 0) {
        st->combine_round_tokens = 0;
        ptx::st_release_gpu(&st->combine_rounds_done, k + 1);
      }
      __syncwarp();
    }
  }
}
}  // namespace hti_combine

namespace moelink::internode {
// moelink::internode::combine: grid = workers (persistent, cooperative) + the emulated NIC's blocks, block
//   THREADS. Blocks [0, num_send_blocks) send rows back to their forwarders (several warps per source when
//   there are at least R: send_split; else one lane per source), the next num_fwd_blocks forward (as
//   dispatch's), the rest reduce. Protocol: the top of this file. reads: x, weights,
//   biases, the handle (routing, fwd_entries, recv_route), own parts and signals; writes: node peers'
//   combine parts and flags, own RDMA send parts, peers' RDMA parts and signals, combined_x,
//   combined_topk_weights, HtiState.
__global__ void __launch_bounds__(THREADS, 1) combine(const __grid_constant__ HtiCombineArgs a) {
  const Deadline dr = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_COMBINE_RDMA);
  const Deadline dn = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rdma.rank, PHASE_HTI_COMBINE_NVLINK);
  HtiState* st = hti_state(a.state);
  hti_run(
      a, a.num_tokens, &st->combine_base, &st->combine_done, dr,
      [&](const Frame& f, Role role, u32 w, u32 n) {
        if (role == Role::SEND && n >= NUM_RANKS) {
          hti_combine::send_split(a, f, w, n, dn);
        } else if (role == Role::SEND) {
          hti_combine::send(a, f, w, n, dr, dn);
        } else if (role == Role::FORWARD) {
          if (w < NUM_NODES * a.fwd_per_node) hti_combine::forward(a, f, w % NUM_NODES, w / NUM_NODES, dr, dn);
        } else {
          hti_combine::reduce(a, f, dr);
        }
      },
      [&]() {
        st->combine_chunk = 0u;
        st->combine_round_tokens = 0u;
        st->combine_rounds_done = 0u;
        for (u32 n = 0; n < NUM_NODES; n++) hti_forward(a.state)->combine_rounds_back[n] = 0u;
      });
}
}  // namespace moelink::internode
