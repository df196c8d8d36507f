// Host emulation of the high-throughput kernels across nodes (hti_*.cu) for tests/hti_emulation.rs:
// R = NUM_NODES x RANKS_PER_NODE ranks as threads, each launch one OS thread per block and one fiber per CUDA
// thread (runtime.hpp); every rank's RDMA region is a host allocation behind the transport seam (peer
// pointers, MOELINK_TRANSPORT=1, or the emulated NIC, 2, reordering across QPs) and every node's symmetric
// buffers are host allocations too. Small rounds (a few tokens) make every call run several rounds and
// chunks. Each scenario is checked against a reference written here from the documented semantics
// (crates/moelink/src/ht.rs, docs/oracle.md), not from the kernels: the layout, every received row, scale,
// top-k id and weight, recv_src_idx, rank_prefix_matrix, the per-expert counts, and the combined output bit
// for bit (the hierarchical fp32 tree). Prints one line per scenario; exits non-zero on the first mismatch.
#include "runtime.hpp"
#include "ptx.cuh"
#include "transport.cuh"
// Each build of the kernels in a namespace of its own (their helpers take the seam's global types, so two
// builds side by side in the global namespace would be ambiguous to argument-dependent lookup).
namespace own_variant {
#include "hti_layout.cu"
#include "hti_notify.cu"
#include "hti_dispatch.cu"
#include "hti_combine.cu"
}  // namespace own_variant
using namespace own_variant;

// The same kernels built with another top-k (the test passes that variant's row sizes): what one rank
// launches when its host chooses the variant from anything but the call's signature, as a rank without
// tokens did when the choice followed topk_idx's address. The variant-mismatch scenario runs it on one rank.
#pragma push_macro("TOPK")
#pragma push_macro("HTI_MSG_BYTES")
#pragma push_macro("HTI_ROW_BYTES")
#pragma push_macro("HTI_COMBINE_ROW_BYTES")
#pragma push_macro("HTI_COMBINE_MSG_BYTES")
#undef TOPK
#undef HTI_MSG_BYTES
#undef HTI_ROW_BYTES
#undef HTI_COMBINE_ROW_BYTES
#undef HTI_COMBINE_MSG_BYTES
#define TOPK HTI_EMU_PEER_TOPK
#define HTI_MSG_BYTES HTI_EMU_PEER_HTI_MSG_BYTES
#define HTI_ROW_BYTES HTI_EMU_PEER_HTI_ROW_BYTES
#define HTI_COMBINE_ROW_BYTES HTI_EMU_PEER_HTI_COMBINE_ROW_BYTES
#define HTI_COMBINE_MSG_BYTES HTI_EMU_PEER_HTI_COMBINE_MSG_BYTES
// hti.cuh's guard is open again for this second build.
#undef MOELINK_HTI_CUH
namespace peer_variant {
#include "hti_layout.cu"
#include "hti_notify.cu"
#include "hti_dispatch.cu"
#include "hti_combine.cu"
}  // namespace peer_variant
#pragma pop_macro("TOPK")
#pragma pop_macro("HTI_MSG_BYTES")
#pragma pop_macro("HTI_ROW_BYTES")
#pragma pop_macro("HTI_COMBINE_ROW_BYTES")
#pragma pop_macro("HTI_COMBINE_MSG_BYTES")

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) {                                                \
      std::fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                          \
      std::fprintf(stderr, "\n");                                 \
      std::exit(1);                                               \
    }                                                             \
  } while (0)

constexpr bool kEmuNic = MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC;
constexpr u32 R = NUM_RANKS, L = RANKS_PER_NODE, N = NUM_NODES;
constexpr u32 H = HIDDEN, K = TOPK;
// Top-k entries of the routing: the dispatch's own when it carries them, else (a dispatch of TOPK 0, as a
// cached one) the routing of the fresh dispatch it replays, whose ids do not travel.
constexpr u32 RK = K > 0 ? K : 3;

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
static float bf16_to_f32(u16 b) {
  u32 v = (u32)b << 16;
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
static u16 f32_to_bf16(float f) { return ptx::cvt_rn_bf16_f32(f); }
static u32 f32_bits(float f) {
  u32 v;
  std::memcpy(&v, &f, 4);
  return v;
}

struct Buf {
  u8* p = nullptr;
  size_t n = 0;
  Buf(size_t bytes, int fill) : n(bytes) {
    p = static_cast<u8*>(std::aligned_alloc(4096, align_up(bytes, 4096)));
    std::memset(p, fill, align_up(bytes, 4096));
  }
  ~Buf() { std::free(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  u64 addr() const { return reinterpret_cast<u64>(p); }
};

// The harness's own layout (the kernels take every offset from their arguments): small parts, so that a
// call of a few dozen tokens runs several rounds of several chunks.
struct At {
  u32 m, q, experts;
  RdmaAt rdma;
  size_t rdma_total, rdma_signals_end;
  NvlArgs nvl;
  size_t nvl_total, nvl_zero_end;
  At(u32 round_tokens, u32 chunk_tokens, u32 num_experts) : m(round_tokens), q(chunk_tokens), experts(num_experts) {
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t o = at;
      at = align_up(at + bytes, 256);
      return (u64)o;
    };
    rdma = RdmaAt{};
    rdma.off_notify_sig = take(2 * R * 8);
    rdma.off_dchunk = take(N * HTI_MAX_CHUNKS * 8);
    rdma.off_dconsumed = take(N * 8);
    rdma.off_cchunk = take(N * HTI_MAX_CHUNKS * 8);
    rdma.off_cconsumed = take(N * 8);
    rdma_signals_end = at;
    rdma.msg_words = 8 + R + num_experts / R;
    rdma.off_notify = take(2 * R * rdma.msg_words * 4);
    rdma.off_notify_send = take(R * rdma.msg_words * 4);
    rdma.part_bytes = align_up((size_t)m * std::max(MSG_BYTES, COMBINE_MSG_BYTES), 256);
    rdma.off_drecv = take(N * rdma.part_bytes);
    rdma.off_dsend = take(N * rdma.part_bytes);
    rdma.off_crecv = take(N * rdma.part_bytes);
    rdma.off_csend = take(N * rdma.part_bytes);
    rdma_total = at;
    at = 0;
    nvl = NvlArgs{};
    nvl.off_done = take(R * 8);
    nvl.off_consumed = take(L * N * 8);
    nvl.off_cconsumed = take(L * N * 8);
    nvl.flag_slots = m;
    nvl.off_dflags = take(R * m * 4);
    nvl.off_cflags = take(R * m * 4);
    nvl_zero_end = at;
    nvl.part_bytes = align_up((size_t)m * std::max(ROW_BYTES, COMBINE_ROW_BYTES), 128);
    nvl.off_dparts = take(R * nvl.part_bytes);
    nvl.off_cparts = take(R * nvl.part_bytes);
    nvl_total = at;
  }
};

struct Rank {
  std::unique_ptr<Buf> rdma, nvl, nic, state, expert_tokens;
  u32 claim = 0;
  ErrorRecord record{};
};

// One call's inputs on one rank.
struct Inputs {
  u32 t = 0;
  std::vector<u8> x;          // [T, PAYLOAD_BYTES]
  std::vector<float> scales;  // [T, NUM_SCALES] (FP8)
  std::vector<i64> idx;       // [T, K]
  std::vector<float> w;       // [T, K]
};

// What `get_dispatch_layout` and notify leave for a fresh dispatch.
struct Layout {
  std::vector<i32> per_rank, per_node, per_expert;
  std::vector<u8> in_rank;  // [T, R]
  std::vector<i32> routing;
  std::vector<u32> host;
};

enum class Route { Uniform, Skewed, NodeLimited };

struct World {
  At at;
  std::vector<Rank> r;
  std::vector<u64> peer_bases;
  u64 timeout_ns = 20ull * 1000 * 1000 * 1000;
  u32 send_blocks = 1;
  // Output rows past the received count (num_worst_tokens larger than needed: no-sync mode).
  u32 extra_rows = 0;
  World(u32 m, u32 q, u32 experts) : at(m, q, experts), r(R) {
    for (auto& st : r) {
      st.rdma.reset(new Buf(at.rdma_total, 0xcd));
      std::memset(st.rdma->p, 0, at.rdma_signals_end);
      st.nvl.reset(new Buf(at.nvl_total, 0xcd));
      std::memset(st.nvl->p, 0, at.nvl_zero_end);
      st.nic.reset(new Buf(sizeof(NicState), 0));
      st.state.reset(new Buf(sizeof(HtiState) + sizeof(HtiForward), 0));
      st.expert_tokens.reset(new Buf(4 * ((size_t)experts + 2 * HTI_MAX_LOCAL_EXPERTS + 1), 0));
      peer_bases.push_back(st.rdma->addr());
    }
  }
  u32 el() const { return at.experts / R; }
  // Forwarder warps per source node (chunks dealt round-robin among them).
  u32 fwd_per_node = 2;
  u32 fwd_blocks() const { return (N * fwd_per_node + HTI_WARPS - 1) / HTI_WARPS; }
  // Receiver (dispatch) / reducer (combine) blocks: at least one lane per source; more blocks give every
  // source warps of its own (the kernels' split receivers).
  u32 extra_recv_blocks = 0;
  u32 recv_blocks() const { return std::max(1u, (R + 32 * HTI_WARPS - 1) / (32 * HTI_WARPS)) + extra_recv_blocks; }
  u32 workers() const { return send_blocks + fwd_blocks() + recv_blocks(); }
  u32 nic_blocks() const { return kEmuNic ? 1 : 0; }

  RdmaArgs rdma(u32 me) const {
    RdmaArgs a{};
    a.local_base = r[me].rdma->addr();
    a.peer_bases = reinterpret_cast<u64>(peer_bases.data());
    a.nic_state = kEmuNic ? r[me].nic->addr() : 0;
    a.nic_reorder_us = kEmuNic ? 20 : 0;
    a.nic_blocks = nic_blocks();
    a.nic_seed = 5 + me;
    a.rank = me;
    a.num_ranks = R;
    a.num_qps = 3;
    a.nvlink_ranks_per_node = 0;  // every put through the (emulated) NIC, own node included
    return a;
  }
  NvlArgs nvl(u32 me) const {
    NvlArgs n = at.nvl;
    const u32 node = me / L;
    for (u32 j = 0; j < L; j++) n.base[j] = r[node * L + j].nvl->addr();
    return n;
  }
  // A rank whose last block (a receiver / reducer) sleeps now and then (runtime.hpp's t_slow_us), so that
  // the others run ahead into its parts: what the hand-backs must survive.
  u32 slow_rank = ~0u, slow_us = 0;
  void ranks(const std::function<void(u32)>& body, std::vector<u32> who = {}) {
    if (who.empty())
      for (u32 p = 0; p < R; p++) who.push_back(p);
    std::vector<std::thread> t;
    for (u32 p : who)
      t.emplace_back([&, p] {
        emu::t_slow_us = p == slow_rank ? slow_us : 0;
        body(p);
      });
    for (auto& x : t) x.join();
  }
  void launch(u32 grid, const std::function<void()>& body) { emu::launch(grid, THREADS, body); }
};

static void check_clean(World& w, u32 me, const char* what) {
  CHECK(w.r[me].record.code == ERR_NONE, "%s: rank %u unexpected error record %u (peer %u, phase %u)", what, me, w.r[me].record.code,
        w.r[me].record.peer, w.r[me].record.phase);
}

// ---------------------------------------------------------------------------------------------- inputs
static Inputs make_inputs(World& w, u32 me, u32 t, u32 seed, Route route) {
  std::mt19937 rng(seed * 7919 + me * 104729 + 17);
  Inputs in;
  in.t = t;
  in.x.resize((size_t)t * PAYLOAD_BYTES);
  for (auto& b : in.x) b = (u8)(rng() & 0xff);
  if (FP8) {
    for (size_t i = 0; i < in.x.size(); i++)
      if ((in.x[i] & 0x7f) == 0x7f) in.x[i] &= 0xfe;  // no NaN patterns
    in.scales.resize((size_t)t * NUM_SCALES);
    for (auto& s : in.scales) s = 0.001f * (float)(1 + rng() % 997);
  } else {
    for (size_t i = 0; i + 1 < in.x.size(); i += 2) {
      const float v = ((float)(rng() % 2001) - 1000.0f) / 128.0f;
      const u16 b = f32_to_bf16(v);
      in.x[i] = (u8)b;
      in.x[i + 1] = (u8)(b >> 8);
    }
  }
  const u32 E = w.at.experts;
  in.idx.assign((size_t)t * RK, -1);
  in.w.assign((size_t)t * RK, 0.0f);
  for (u32 tok = 0; tok < t; tok++) {
    // Every 7th token routes nowhere; the others pick distinct experts, some slots -1.
    if (tok % 7 == 3) continue;
    std::vector<i64> picked;
    const u32 home_node = rng() % N;
    for (u32 k = 0; k < RK; k++) {
      if (rng() % 5 == 0) continue;
      i64 e = 0;
      for (int tries = 0; tries < 64; tries++) {
        if (route == Route::Skewed) e = (rng() % 4 == 0) ? rng() % E : rng() % std::max(1u, E / N);  // most on node 0
        else if (route == Route::NodeLimited) e = (i64)((home_node + rng() % 2) % N) * (E / N) + rng() % (E / N);
        else e = rng() % E;
        if (std::find(picked.begin(), picked.end(), e) == picked.end()) break;
      }
      if (std::find(picked.begin(), picked.end(), e) != picked.end()) continue;
      picked.push_back(e);
      in.idx[(size_t)tok * RK + k] = e;
      in.w[(size_t)tok * RK + k] = 0.125f * (float)(1 + rng() % 8);
    }
  }
  return in;
}

// ---------------------------------------------------------------------------------------------- layout + notify
static std::vector<i32> routing_buffer(u32 t) {
  const RoutingAt ra = routing_at(t);
  return std::vector<i32>((size_t)ra.multi_prefix + (size_t)(t + 1) * N, -77);
}

static u64 signature() { return 0x5157ull * H + K; }

// Notify on every rank over the layouts in `lay` (the layout kernel's, or edited ones), host_seq 1; no checks.
static void notify(World& w, std::vector<Inputs>& in, std::vector<Layout>& lay) {
  w.ranks([&](u32 me) {
    Layout& l = lay[me];
    l.routing = routing_buffer(in[me].t);
    l.host.assign(HN_PER_EXPERT + w.el(), 0);
    HtiNotifyArgs a{};
    a.rdma = w.rdma(me);
    a.at = w.at.rdma;
    a.is_token_in_rank = (u64)l.in_rank.data();
    a.num_tokens_per_rank = (u64)l.per_rank.data();
    a.num_tokens_per_expert = (u64)l.per_expert.data();
    a.routing = (u64)l.routing.data();
    a.host_out = (u64)l.host.data();
    a.state = w.r[me].state->addr();
    a.signature = signature();
    a.error_claim = (u64)&w.r[me].claim;
    a.error_record = (u64)&w.r[me].record;
    a.timeout_ns = w.timeout_ns;
    a.num_tokens = in[me].t;
    a.num_local_experts = w.el();
    a.round_tokens = w.at.m;
    a.host_seq = 1;
    w.launch(1 + w.nic_blocks(), [&] { moelink::internode::notify(a); });
  });
}

static void layout_and_notify(World& w, std::vector<Inputs>& in, std::vector<Layout>& lay, const char* what) {
  const u32 E = w.at.experts;
  lay.assign(R, Layout{});
  w.ranks([&](u32 me) {
    Layout& l = lay[me];
    const Inputs& x = in[me];
    l.per_rank.assign(R, 0);
    l.per_node.assign(N, 0);
    l.per_expert.assign(E, 0);
    l.in_rank.assign((size_t)x.t * R, 0xee);
    HtiLayoutArgs a{};
    a.topk_idx = (u64)x.idx.data();
    a.topk_stride_token = RK;
    a.topk_stride_k = 1;
    a.num_tokens_per_rank = (u64)l.per_rank.data();
    a.num_tokens_per_rdma_rank = (u64)l.per_node.data();
    a.num_tokens_per_expert = (u64)l.per_expert.data();
    a.is_token_in_rank = (u64)l.in_rank.data();
    a.error_claim = (u64)&w.r[me].claim;
    a.error_record = (u64)&w.r[me].record;
    a.num_tokens = x.t, a.topk = RK, a.num_experts = E, a.rank = me;
    w.launch(2, [&] { moelink::internode::layout(a); });
    // The reference layout.
    std::vector<i32> per_rank(R, 0), per_node(N, 0), per_expert(E, 0);
    for (u32 t = 0; t < x.t; t++) {
      std::vector<bool> rank_hit(R, false), node_hit(N, false);
      for (u32 k = 0; k < RK; k++) {
        const i64 e = x.idx[(size_t)t * RK + k];
        if (e < 0) continue;
        per_expert[e]++;
        rank_hit[e / (E / R)] = true;
        node_hit[e / (E / R) / L] = true;
      }
      for (u32 r = 0; r < R; r++) {
        CHECK(l.in_rank[(size_t)t * R + r] == (rank_hit[r] ? 1 : 0), "%s: rank %u is_token_in_rank[%u][%u]", what, me, t, r);
        per_rank[r] += rank_hit[r];
      }
      for (u32 n = 0; n < N; n++) per_node[n] += node_hit[n];
    }
    CHECK(per_rank == l.per_rank && per_node == l.per_node && per_expert == l.per_expert, "%s: rank %u layout counts", what, me);
  });
  notify(w, in, lay);
  w.ranks([&](u32 me) {
    const Layout& l = lay[me];
    check_clean(w, me, what);
    CHECK(l.routing[RT_STATUS] == 0 && l.host[HN_READY] == 1, "%s: rank %u notify status %d", what, me, l.routing[RT_STATUS]);
  });
}

// ---------------------------------------------------------------------------------------------- dispatch
struct Received {
  std::vector<u8> x;
  std::vector<float> scales;
  std::vector<i64> idx;
  std::vector<float> w;
  std::vector<i32> src;
  std::vector<u64> route;
  std::vector<u32> fwd;
  u32 n = 0;
  u32 rows = 0;  // output rows: n, or more in no-sync mode
};

static void dispatch(World& w, std::vector<Inputs>& in, std::vector<Layout>& lay, std::vector<Received>& out, const char* what,
                     std::vector<u32> who = {}, u32 peer_variant_rank = ~0u) {
  out.assign(R, Received{});
  w.ranks(
      [&](u32 me) {
        Received& o = out[me];
        const Layout& l = lay[me];
        o.n = l.host[HN_NUM_RECV];
        o.rows = o.n + w.extra_rows;
        o.x.assign((size_t)o.rows * PAYLOAD_BYTES, 0xee);
        o.scales.assign((size_t)o.rows * std::max(NUM_SCALES, 1u), -1.0f);
        o.idx.assign((size_t)o.rows * std::max(K, 1u), -9);
        o.w.assign((size_t)o.rows * std::max(K, 1u), -9.0f);
        o.src.assign(std::max(o.rows, 1u), -9);
        o.route.assign(std::max(o.rows, 1u), ~0ull);
        o.fwd.assign(std::max(l.host[HN_NUM_FWD], 1u), 0xcdcdcdcdu);
        HtiDispatchArgs a{};
        a.rdma = w.rdma(me);
        a.at = w.at.rdma;
        a.nvl = w.nvl(me);
        a.x = (u64)in[me].x.data();
        a.x_scales = FP8 ? (u64)in[me].scales.data() : 0;
        a.scale_stride_token = NUM_SCALES;
        a.scale_stride_group = 1;
        a.topk_idx = (u64)in[me].idx.data();
        a.topk_weights = (u64)in[me].w.data();
        a.num_tokens_per_expert = K > 0 ? (u64)l.per_expert.data() : 0;  // the senders' per-expert check
        a.expert_tokens = w.r[me].expert_tokens->addr();
        a.host_notify = K > 0 ? (u64)l.host.data() : 0;  // the receivers' check against notify's sums
        a.host_seq = 1;
        a.recv_x = (u64)o.x.data();
        a.recv_scales = FP8 ? (u64)o.scales.data() : 0;
        a.recv_topk_idx = (u64)o.idx.data();
        a.recv_topk_weights = (u64)o.w.data();
        a.recv_src_idx = (u64)o.src.data();
        a.routing = (u64)l.routing.data();
        a.fwd_entries = (u64)o.fwd.data();
        a.recv_route = (u64)o.route.data();
        a.state = w.r[me].state->addr();
        a.error_claim = (u64)&w.r[me].claim;
        a.error_record = (u64)&w.r[me].record;
        a.timeout_ns = w.timeout_ns;
        a.num_tokens = in[me].t;
        a.num_out_rows = o.rows;
        a.fwd_capacity = (u32)o.fwd.size();
        a.num_local_experts = w.el();
        a.chunk_tokens = w.at.q;
        a.num_send_blocks = w.send_blocks;
        a.num_fwd_blocks = w.fwd_blocks();
        a.fwd_per_node = w.fwd_per_node;
        if (me == peer_variant_rank) {
          // The other build's argument struct is the same bytes (no member depends on TOPK).
          static_assert(sizeof(peer_variant::HtiDispatchArgs) == sizeof(HtiDispatchArgs), "one argument layout");
          peer_variant::HtiDispatchArgs pa;
          std::memcpy(&pa, &a, sizeof a);
          w.launch(w.workers() + w.nic_blocks(), [&] { peer_variant::moelink::internode::dispatch(pa); });
        } else {
          w.launch(w.workers() + w.nic_blocks(), [&] { moelink::internode::dispatch(a); });
        }
      },
      who);
}

// Checks rank `me`'s received rows against the documented order: source rank major, then the source's
// token order; top-k ids local to `me` (-1 elsewhere), weights 0 where the id is -1.
static void check_dispatch(World& w, u32 me, std::vector<Inputs>& in, std::vector<Layout>& lay, Received& o, const char* what) {
  check_clean(w, me, what);
  const u32 el = w.el();
  u32 pos = 0;
  std::vector<u32> per_expert(el, 0);
  for (u32 s = 0; s < R; s++) {
    CHECK((u32)lay[me].routing[routing_at(in[me].t).recv_offset + s] == pos, "%s: rank %u recv_offset[%u]", what, me, s);
    for (u32 t = 0; t < in[s].t; t++) {
      if (lay[s].in_rank[(size_t)t * R + me] == 0) continue;
      CHECK(pos < o.n, "%s: rank %u receives more rows than %u", what, me, o.n);
      CHECK(std::memcmp(&o.x[(size_t)pos * PAYLOAD_BYTES], &in[s].x[(size_t)t * PAYLOAD_BYTES], PAYLOAD_BYTES) == 0,
            "%s: rank %u row %u (source %u token %u) payload differs", what, me, pos, s, t);
      for (u32 g = 0; g < NUM_SCALES; g++)
        CHECK(o.scales[(size_t)pos * NUM_SCALES + g] == in[s].scales[(size_t)t * NUM_SCALES + g], "%s: rank %u row %u scale %u", what, me, pos, g);
      for (u32 k = 0; k < RK; k++) {
        const i64 e = in[s].idx[(size_t)t * RK + k];
        const bool here = e >= 0 && e / el == me;
        if (here) per_expert[e - (i64)me * el]++;
        if (k >= K) continue;
        CHECK(o.idx[(size_t)pos * K + k] == (here ? e - (i64)me * el : -1), "%s: rank %u row %u top-k %u", what, me, pos, k);
        CHECK(o.w[(size_t)pos * K + k] == (here ? in[s].w[(size_t)t * RK + k] : 0.0f), "%s: rank %u row %u weight %u", what, me, pos, k);
      }
      CHECK(o.src[pos] == (i32)t, "%s: rank %u row %u recv_src_idx %d, want %u", what, me, pos, o.src[pos], t);
      pos++;
    }
  }
  CHECK(pos == o.n, "%s: rank %u received %u rows, want %u", what, me, o.n, pos);
  // No-sync padding rows: top-k -1, weight 0.
  for (u32 r = o.n; r < o.rows; r++)
    for (u32 k = 0; k < K; k++)
      CHECK(o.idx[(size_t)r * K + k] == -1 && o.w[(size_t)r * K + k] == 0.0f, "%s: rank %u padding row %u", what, me, r);
  for (u32 e = 0; e < el; e++)
    CHECK(lay[me].host[HN_PER_EXPERT + e] == per_expert[e], "%s: rank %u per-expert count %u", what, me, e);
  // DeepEP's rank_prefix_matrix: [i][j] = rows j receives from ranks 0..=i.
  const i32* rpm = lay[me].routing.data() + routing_at(in[me].t).rank_prefix;
  for (u32 j = 0; j < R; j++) {
    i32 sum = 0;
    for (u32 i = 0; i < R; i++) {
      for (u32 t = 0; t < in[i].t; t++) sum += lay[i].in_rank[(size_t)t * R + j];
      CHECK(rpm[i * R + j] == sum, "%s: rank %u rank_prefix_matrix[%u][%u]", what, me, i, j);
    }
  }
}

// ---------------------------------------------------------------------------------------------- combine
// The expert outputs rank `me` returns for its received rows (bf16, with -0.0 and values whose sum order
// matters), and the reference: per token, the hierarchical tree over the ranks it went to.
static std::vector<u16> expert_outputs(u32 me, const Received& o, u32 seed) {
  std::mt19937 rng(seed * 31 + me * 7 + 3);
  std::vector<u16> y((size_t)o.rows * H);
  for (auto& v : y) {
    const u32 c = rng() % 11;
    v = c == 0 ? 0x8000 : f32_to_bf16((c == 1 ? 1024.0f : 1.0f) * (((float)(rng() % 4001) - 2000.0f) / 64.0f));
  }
  return y;
}

static float tree(std::vector<float> v) {
  while (v.size() > 1) {
    std::vector<float> n;
    for (size_t i = 0; i < v.size(); i += 2) n.push_back(v[i] + v[i + 1]);
    v = n;
  }
  return v[0];
}
static u32 pow2(u32 x) {
  u32 p = 1;
  while (p < x) p *= 2;
  return p;
}
// The documented sum: leaves by rank (+0.0 where the token did not go), a tree per node padded to a power of
// two, a tree over the nodes padded likewise, then +0.0 and the biases.
static float hierarchical(const std::function<bool(u32)>& present, const std::function<float(u32)>& value) {
  std::vector<float> nodes;
  for (u32 n = 0; n < pow2(N); n++) {
    std::vector<float> leaves;
    for (u32 j = 0; j < pow2(L); j++) {
      const u32 r = n * L + j;
      leaves.push_back(n < N && j < L && present(r) ? value(r) : 0.0f);
    }
    nodes.push_back(tree(leaves));
  }
  return 0.0f + tree(nodes);
}

static void combine(World& w, std::vector<Inputs>& in, std::vector<Layout>& lay, std::vector<Received>& rx, u32 seed, u32 biases,
                    const char* what) {
  std::vector<std::vector<u16>> y(R);
  for (u32 me = 0; me < R; me++) y[me] = expert_outputs(me, rx[me], seed);
  std::vector<std::vector<u16>> bias(R * 2), out(R);
  std::vector<std::vector<float>> out_w(R);
  for (u32 me = 0; me < R; me++)
    for (u32 b = 0; b < 2; b++) {
      std::mt19937 rng(seed + me * 3 + b);
      bias[me * 2 + b].resize((size_t)in[me].t * H);
      for (auto& v : bias[me * 2 + b]) v = f32_to_bf16(((float)(rng() % 201) - 100.0f) / 8.0f);
    }
  w.ranks([&](u32 me) {
    out[me].assign((size_t)in[me].t * H, 0xeeee);
    out_w[me].assign((size_t)in[me].t * std::max(K, 1u), -5.0f);
    HtiCombineArgs a{};
    a.rdma = w.rdma(me);
    a.at = w.at.rdma;
    a.nvl = w.nvl(me);
    a.x = (u64)y[me].data();
    a.topk_weights = (u64)rx[me].w.data();
    a.bias0 = biases >= 1 ? (u64)bias[me * 2].data() : 0;
    a.bias1 = biases >= 2 ? (u64)bias[me * 2 + 1].data() : 0;
    a.combined_x = (u64)out[me].data();
    a.combined_topk_weights = (u64)out_w[me].data();
    a.routing = (u64)lay[me].routing.data();
    a.fwd_entries = (u64)rx[me].fwd.data();
    a.recv_route = (u64)rx[me].route.data();
    a.state = w.r[me].state->addr();
    a.error_claim = (u64)&w.r[me].claim;
    a.error_record = (u64)&w.r[me].record;
    a.timeout_ns = w.timeout_ns;
    a.num_tokens = in[me].t;
    a.num_x_rows = rx[me].rows;
    a.chunk_tokens = w.at.q;
    a.num_send_blocks = w.send_blocks;
    a.num_fwd_blocks = w.fwd_blocks();
    a.fwd_per_node = w.fwd_per_node;
    w.launch(w.workers() + w.nic_blocks(), [&] { moelink::internode::combine(a); });
  });
  for (u32 me = 0; me < R; me++) {
    check_clean(w, me, what);
    for (u32 t = 0; t < in[me].t; t++) {
      // Where token t of rank me sits on each rank it went to.
      std::vector<i64> pos(R, -1);
      for (u32 r = 0; r < R; r++) {
        if (lay[me].in_rank[(size_t)t * R + r] == 0) continue;
        i64 p = 0;
        for (u32 s = 0; s < me; s++)
          for (u32 u = 0; u < in[s].t; u++) p += lay[s].in_rank[(size_t)u * R + r];
        for (u32 u = 0; u < t; u++) p += lay[me].in_rank[(size_t)u * R + r];
        pos[r] = p;
      }
      auto present = [&](u32 r) { return pos[r] >= 0; };
      for (u32 c = 0; c < H; c++) {
        float v = hierarchical(present, [&](u32 r) { return bf16_to_f32(y[r][(size_t)pos[r] * H + c]); });
        for (u32 b = 0; b < biases; b++) v = v + bf16_to_f32(bias[me * 2 + b][(size_t)t * H + c]);
        const u16 want = f32_to_bf16(v), got = out[me][(size_t)t * H + c];
        CHECK(want == got, "%s: rank %u token %u channel %u combined %#x, want %#x", what, me, t, c, got, want);
      }
      for (u32 k = 0; k < K; k++) {
        const float v = hierarchical(present, [&](u32 r) { return rx[r].w[(size_t)pos[r] * K + k]; });
        CHECK(f32_bits(v) == f32_bits(out_w[me][(size_t)t * K + k]), "%s: rank %u token %u combined weight %u", what, me, t, k);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- scenarios
static void round_trip(World& w, const std::vector<u32>& tokens, u32 seed, Route route, u32 biases, bool cached, const std::string& name) {
  const char* what = name.c_str();
  std::vector<Inputs> in(R);
  for (u32 p = 0; p < R; p++) in[p] = make_inputs(w, p, tokens[p], seed, route);
  std::vector<Layout> lay;
  layout_and_notify(w, in, lay, what);
  std::vector<Received> rx;
  dispatch(w, in, lay, rx, what);
  for (u32 me = 0; me < R; me++) check_dispatch(w, me, in, lay, rx[me], what);
  if (cached) {
    // A cached dispatch: the same routing again, no notify; the sequence bases move on.
    std::vector<Received> again;
    dispatch(w, in, lay, again, what);
    for (u32 me = 0; me < R; me++) {
      check_dispatch(w, me, in, lay, again[me], what);
      CHECK(again[me].route == rx[me].route && again[me].fwd == rx[me].fwd, "%s: rank %u cached dispatch handle differs", what, me);
    }
  }
  combine(w, in, lay, rx, seed, biases, what);
}

int main() {
  std::printf("transport: %s, %ux%u, hidden %u, %s, top-%u, %u biases\n", kEmuNic ? "emu-nic" : "ptr", N, L, H, FP8 ? "fp8" : "bf16", K,
              NUM_BIASES);
  const u32 E = 4 * R;
  {
    // Rounds of 8 tokens in chunks of 4: tens of tokens run several rounds; uneven ranks, one with none.
    World w(8, 4, E);
    std::vector<u32> t(R);
    for (u32 p = 0; p < R; p++) t[p] = p == 1 ? 0 : 5 + (p * 13) % 23;
    round_trip(w, t, 1, Route::Uniform, NUM_BIASES, true, "uniform, several rounds");
    for (u32 p = 0; p < R; p++) t[p] = 3 + (p * 7) % 17;
    w.send_blocks = 2;
    w.fwd_per_node = 3;  // more forwarder warps than a round's chunks: some have none
    round_trip(w, t, 2, Route::Skewed, NUM_BIASES, false, "skewed to node 0");
    w.fwd_per_node = 2;
    round_trip(w, t, 3, Route::NodeLimited, NUM_BIASES, false, "node-limited");
    std::printf("rounds of 8 (chunks of 4): uniform + cached, skewed, node-limited ok\n");
    // Zero tokens everywhere, then one token on one rank: nothing may hang or move.
    std::vector<u32> zero(R, 0);
    round_trip(w, zero, 4, Route::Uniform, NUM_BIASES, true, "zero tokens");
    zero[R - 1] = 1;
    round_trip(w, zero, 5, Route::Uniform, NUM_BIASES, false, "one token");
    std::printf("zero tokens, one token: ok\n");
    // No-sync outputs: more rows than received (padding rows get top-k -1 and weight 0).
    w.extra_rows = 5;
    round_trip(w, t, 8, Route::Skewed, NUM_BIASES, false, "no-sync rows");
    w.extra_rows = 0;
    std::printf("no-sync outputs: ok\n");
    // A slow rank: its receivers and reducers lag; every part is reused only after it handed it back.
    w.slow_rank = R - 1;
    w.slow_us = 200;
    for (u32 p = 0; p < R; p++) t[p] = 9 + (p * 5) % 20;
    round_trip(w, t, 7, Route::Uniform, NUM_BIASES, true, "slow rank");
    w.slow_rank = ~0u;
    std::printf("a slow rank: ok\n");
  }
  {
    // The round shape changes between calls of one buffer (other rows, other M): parts and flags stay where
    // they are; only sequence numbers tell rounds apart.
    World w(16, 4, E);
    w.fwd_per_node = 1;
    std::vector<u32> t(R);
    for (u32 p = 0; p < R; p++) t[p] = 10 + (p * 11) % 30;
    round_trip(w, t, 11, Route::Uniform, NUM_BIASES, false, "rounds of 16");
    w.at.m = 8;
    round_trip(w, t, 12, Route::Skewed, NUM_BIASES, true, "then rounds of 8");
    w.at.m = 12;
    round_trip(w, t, 13, Route::NodeLimited, NUM_BIASES, false, "then rounds of 12");
    std::printf("round shape changing between calls: ok\n");
  }
  {
    // One chunk per round (Q == M), as a GPU buffer sized for few tokens gets: every round's messages travel
    // in one chunk, and a call runs several rounds.
    World w(8, 8, E);
    w.fwd_per_node = 8;
    w.send_blocks = 8;
    // As many receiver warps as a GPU gives: several per source (uneven: R + 1 warps and more).
    w.extra_recv_blocks = (R + HTI_WARPS) / HTI_WARPS + 1;
    std::vector<u32> t(R);
    const u32 gpu_test[8] = {30, 7, 14, 1, 22, 0, 9, 30};
    for (u32 p = 0; p < R; p++) t[p] = gpu_test[p % 8];
    round_trip(w, t, 21, Route::Uniform, NUM_BIASES, true, "one chunk per round");
    std::printf("one chunk per round (several receiver and sender warps per source): ok\n");
    // The same warps with chunks of 2 and a slow rank, whose receivers lag behind their forwarders.
    w.at.q = 2;
    w.slow_rank = R - 1;
    w.slow_us = 200;
    round_trip(w, t, 22, Route::Skewed, NUM_BIASES, true, "split warps, chunks of 2, slow rank");
    w.slow_rank = ~0u;
    std::printf("several warps per source, chunks of 2, a slow rank: ok\n");
  }
  {
    // One round holds every token: a round of 64, chunks of 64.
    World w(64, 64, E);
    std::vector<u32> t(R);
    for (u32 p = 0; p < R; p++) t[p] = 20 + p;
    round_trip(w, t, 6, Route::Uniform, NUM_BIASES, true, "one round");
    std::printf("one round: ok\n");
  }
  {
    // Odd chunks and rounds (rounds of 9 in chunks of 3, then of 5 in chunks of 1): a sender's group of
    // consecutive tokens falls in two chunks, or in two rounds.
    World w(9, 3, E);
    std::vector<u32> t(R);
    for (u32 p = 0; p < R; p++) t[p] = 11 + (p * 7) % 19;
    round_trip(w, t, 31, Route::Uniform, NUM_BIASES, true, "rounds of 9, chunks of 3");
    w.at.m = 5;
    w.at.q = 1;
    round_trip(w, t, 32, Route::Skewed, NUM_BIASES, true, "rounds of 5, chunks of 1");
    std::printf("odd rounds and chunks: ok\n");
  }
  {
    // A silent rank: the others' dispatch ends with a timeout naming a peer, in an internode phase.
    World w(8, 4, E);
    w.timeout_ns = 300ull * 1000 * 1000;
    std::vector<Inputs> in(R);
    for (u32 p = 0; p < R; p++) in[p] = make_inputs(w, p, 12, 9, Route::Uniform);
    std::vector<Layout> lay;
    layout_and_notify(w, in, lay, "silent rank");
    std::vector<u32> who;
    for (u32 p = 0; p + 1 < R; p++) who.push_back(p);
    std::vector<Received> rx;
    dispatch(w, in, lay, rx, "silent rank", who);
    u32 timed_out = 0;
    for (u32 p : who) {
      const ErrorRecord& rec = w.r[p].record;
      if (rec.code == ERR_TIMEOUT) {
        CHECK(rec.phase == PHASE_HTI_DISPATCH_RDMA || rec.phase == PHASE_HTI_DISPATCH_NVLINK, "silent rank: rank %u phase %u", p, rec.phase);
        CHECK(rec.peer < R && rec.peer != p, "silent rank: rank %u blames peer %u", p, rec.peer);
        timed_out++;
      }
    }
    CHECK(timed_out > 0, "silent rank: nobody timed out");
    std::printf("silent rank: %u of %u ranks time out naming a peer and a domain ok\n", timed_out, R - 1);
  }
  if (K > 0) {
    // One rank (the one without tokens) launches the dispatch without top-k, as a host that chose the
    // variant from topk_idx's address did: its forwarder meets messages of another layout. Every rank must
    // end its call (no hang, no store through an address read from a misaligned message): that rank with
    // ERR_PEER_LAYOUT naming a source whose messages it read, the others with that, a timeout, or nothing (when they needed nothing from it).
    World w(8, 4, E);
    w.timeout_ns = 300ull * 1000 * 1000;
    std::vector<Inputs> in(R);
    for (u32 p = 0; p < R; p++) in[p] = make_inputs(w, p, p == 1 ? 0 : 12 + p, 9, Route::Uniform);
    std::vector<Layout> lay;
    layout_and_notify(w, in, lay, "variant mismatch");
    std::vector<Received> rx;
    dispatch(w, in, lay, rx, "variant mismatch", {}, 1);
    const ErrorRecord& odd = w.r[1].record;
    CHECK(odd.code == ERR_PEER_LAYOUT && odd.peer < R && odd.peer != 1, "variant mismatch: rank 1 recorded code %u peer %u", odd.code,
          odd.peer);
    // A rank that needed nothing from rank 1 may finish cleanly; one that did ends with an error, never with
    // rows taken from a misread message.
    for (u32 p = 0; p < R; p++) {
      const bool clean = w.r[p].claim == CLAIM_NONE;
      CHECK(clean || w.r[p].record.code == ERR_PEER_LAYOUT || w.r[p].record.code == ERR_TIMEOUT, "variant mismatch: rank %u ended with code %u",
            p, w.r[p].record.code);
    }
    std::printf("variant mismatch (rank 1 runs top-%u): ERR_PEER_LAYOUT naming rank %u, no hang ok\n", (u32)HTI_EMU_PEER_TOPK,
                odd.peer);
  }
  if (K > 0 && R >= 2) {
    // Layout tensors that disagree. (a) Rank 0 sends nothing (is_token_in_rank all false, num_tokens_per_rank
    // 0) while its num_tokens_per_expert still counts tokens: every rank's notify agrees on BAD_EXPERTS and
    // reports ERR_INVALID_LAYOUT / LAYOUT_ARG_PER_EXPERT naming rank 0; the dispatch behind it moves nothing.
    // (b) Rank 0 keeps a token from another rank where one of its experts lives (is_token_in_rank and
    // num_tokens_per_rank agree, so notify passes): rank 0's sender reports LAYOUT_ARG_IN_RANK with that token,
    // that rank's receivers LAYOUT_ARG_RECV_EXPERT_TOKENS (a row fewer than the counts say); the others see no
    // error.
    World w(8, 4, E);
    w.timeout_ns = 2000ull * 1000 * 1000;
    std::vector<Inputs> in(R);
    for (u32 p = 0; p < R; p++) in[p] = make_inputs(w, p, 12, 17, Route::Uniform);
    std::vector<Layout> lay;
    layout_and_notify(w, in, lay, "bad layout");
    const std::vector<Layout> good = lay;
    std::fill(lay[0].in_rank.begin(), lay[0].in_rank.end(), (u8)0);
    std::fill(lay[0].per_rank.begin(), lay[0].per_rank.end(), 0);
    notify(w, in, lay);
    std::vector<Received> rx;
    dispatch(w, in, lay, rx, "per-expert counts without tokens");
    for (u32 p = 0; p < R; p++) {
      const ErrorRecord& rec = w.r[p].record;
      CHECK(lay[p].routing[RT_STATUS] == (i32)HTI_STATUS_BAD_EXPERTS, "bad layout (a): rank %u status %d", p, lay[p].routing[RT_STATUS]);
      CHECK(rec.code == ERR_INVALID_LAYOUT && rec.peer == 0 && rec.elapsed_ns == LAYOUT_ARG_PER_EXPERT,
            "bad layout (a): rank %u record code %u peer %u detail %llu", p, rec.code, rec.peer, (unsigned long long)rec.elapsed_ns);
      w.r[p].record = ErrorRecord{};
      w.r[p].claim = CLAIM_NONE;
    }
    // (b): the first token of rank 0 that goes to another rank receiving at least two of its tokens.
    lay = good;
    u32 bad_t = 0, bad_r = 0;
    for (u32 t = 0; t < in[0].t && bad_r == 0; t++)
      for (u32 r = 1; r < R && bad_r == 0; r++)
        if (lay[0].in_rank[(size_t)t * R + r] != 0 && lay[0].per_rank[r] >= 2) bad_t = t, bad_r = r;
    CHECK(bad_r != 0, "bad layout (b): no token of rank 0 to keep back");
    lay[0].in_rank[(size_t)bad_t * R + bad_r] = 0;
    lay[0].per_rank[bad_r] -= 1;
    notify(w, in, lay);
    for (u32 p = 0; p < R; p++) {
      check_clean(w, p, "bad layout (b) notify");
      CHECK(lay[p].routing[RT_STATUS] == 0, "bad layout (b): rank %u notify status %d", p, lay[p].routing[RT_STATUS]);
    }
    dispatch(w, in, lay, rx, "a token kept from a rank of its experts");
    for (u32 p = 0; p < R; p++) {
      const ErrorRecord& rec = w.r[p].record;
      if (p == 0)
        CHECK(rec.code == ERR_INVALID_LAYOUT && rec.peer == 0 && rec.elapsed_ns == LAYOUT_ARG_IN_RANK && rec.timeout_ns == bad_t,
              "bad layout (b): rank 0 record code %u peer %u detail %llu token %llu (want %u)", rec.code, rec.peer,
              (unsigned long long)rec.elapsed_ns, (unsigned long long)rec.timeout_ns, bad_t);
      else if (p == bad_r)  // one row fewer for an expert than the sources' counts say
        CHECK(rec.code == ERR_INVALID_LAYOUT && rec.peer == p && rec.elapsed_ns == LAYOUT_ARG_RECV_EXPERT_TOKENS,
              "bad layout (b): rank %u record code %u peer %u detail %llu", p, rec.code, rec.peer, (unsigned long long)rec.elapsed_ns);
      else
        check_clean(w, p, "bad layout (b): another rank");
      w.r[p].record = ErrorRecord{};
      w.r[p].claim = CLAIM_NONE;
    }
    // (c) Rank 0's num_tokens_per_expert 5 too high for the first expert of rank 1 (the sums per rank still
    // pass notify): rank 0's dispatch reports LAYOUT_ARG_EXPERT_TOKENS with the expert and the true count, rank
    // 1's LAYOUT_ARG_RECV_EXPERT_TOKENS (5 rows fewer than notify summed for its local expert 0), the others
    // see no error. (d) The right layouts again: no error anywhere (the counts start from 0 each call). (e) The
    // right layouts, but a later notify rewrote the host words before the dispatch started (another READY,
    // other sums): the receivers do not check against words of another call, so no error.
    const u32 bad_e = w.el();
    for (int round = 0; round < 3; round++) {
      lay = good;
      const i32 true_count = lay[0].per_expert[bad_e];
      if (round == 0) lay[0].per_expert[bad_e] += 5;
      notify(w, in, lay);
      for (u32 p = 0; p < R; p++) CHECK(lay[p].routing[RT_STATUS] == 0, "bad layout (c): rank %u notify status %d", p, lay[p].routing[RT_STATUS]);
      if (round == 2)
        for (u32 p = 0; p < R; p++) {
          lay[p].host[HN_READY] += 1;
          lay[p].host[HN_PER_EXPERT] += 7;
        }
      dispatch(w, in, lay, rx, round == 0 ? "a per-expert count 5 too high" : round == 1 ? "the right counts again" : "stale host words");
      for (u32 p = 0; p < R; p++) {
        const ErrorRecord& rec = w.r[p].record;
        if (p == 0 && round == 0)
          CHECK(rec.code == ERR_INVALID_LAYOUT && rec.peer == 0 && rec.elapsed_ns == LAYOUT_ARG_EXPERT_TOKENS &&
                    rec.timeout_ns == (((u64)bad_e << 32) | (u32)true_count),
                "bad layout (c): rank 0 record code %u peer %u detail %llu %llx (expert %u, %d tokens)", rec.code, rec.peer,
                (unsigned long long)rec.elapsed_ns, (unsigned long long)rec.timeout_ns, bad_e, true_count);
        else if (p == 1 && round == 0)  // its local expert 0 gets 5 rows fewer than notify summed
          CHECK(rec.code == ERR_INVALID_LAYOUT && rec.peer == 1 && rec.elapsed_ns == LAYOUT_ARG_RECV_EXPERT_TOKENS &&
                    (rec.timeout_ns >> 32) == 0 && (u32)rec.timeout_ns + 5 == lay[1].host[HN_PER_EXPERT],
                "bad layout (c): rank 1 record code %u peer %u detail %llu %llx (notify summed %u)", rec.code, rec.peer,
                (unsigned long long)rec.elapsed_ns, (unsigned long long)rec.timeout_ns, lay[1].host[HN_PER_EXPERT]);
        else
          check_clean(w, p, round == 0 ? "bad layout (c): another rank" : round == 1 ? "bad layout (d)" : "bad layout (e)");
        w.r[p].record = ErrorRecord{};
        w.r[p].claim = CLAIM_NONE;
      }
    }
    std::printf("bad layouts: BAD_EXPERTS agreed on every rank naming rank 0; token %u kept from rank %u reported by its sender; "
                "expert %u's count 5 too high reported by rank 0's last block ok\n",
                bad_t, bad_r, bad_e);
  }
  std::printf("all internode HT scenarios passed\n");
  return 0;
}
