// Host emulation of the low-latency kernels across nodes (lli_*.cu) for tests/lli_emulation.rs: R
// ranks as threads, each launch one OS thread per block and one fiber per CUDA thread (runtime.hpp), every
// rank's RDMA region a host allocation behind the transport seam — peer pointers (MOELINK_TRANSPORT=1) or
// the emulated NIC (2), whose blocks run beside the workers, reordering across QPs. Every scenario is checked
// against ll_reference.hpp (the documented semantics, shared with the single-node harness): recv_count,
// every row and scale, DeepEP's src_info and layout_range, the combined output bit for bit. Prints one line
// per scenario; exits non-zero on the first mismatch.
#include "runtime.hpp"
#include "ptx.cuh"
#include "lli_dispatch.cu"
#include "lli_combine.cu"
#include "ll_reference.hpp"

#include <functional>
#include <memory>
#include <string>
#include <thread>

constexpr bool kEmuNic = MOELINK_TRANSPORT == MOELINK_TRANSPORT_EMU_NIC;

namespace run {
void kernel_of(const LliDispatchArgs& a) { moelink::internode_ll::dispatch(a); }
void kernel_of(const LliCombineArgs& a) { moelink::internode_ll::combine(a); }
template <typename Args>
void launch(const Args& args, u32 workers) {
  emu::launch(workers + args.rdma.nic_blocks, LL_THREADS, [&args] { kernel_of(args); });
}
}  // namespace run

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

// A layout of the RDMA region (the harness's own; the kernels take every offset from their arguments).
struct LliSetAt {
  size_t meta_sig, data_sig, consumed, meta, data, send_meta, send_data;
};
struct LliAt {
  size_t msg, meta_bytes, signals, signals_end, zero_copy, total;
  LliSetAt d[2], c[2];
  size_t htoken, hj, hrow, hweight, hmeta, home_idx, home_weight, handle_bytes;
  explicit LliAt(const Shape& s) {
    const size_t r = s.ranks, tm = s.t_max, k = LL_TOPK, el = s.el(), row = 2 * LL_HIDDEN;
    msg = LLI_MSG_BYTES;
    meta_bytes = 64 + align_up(4 * el, 16);
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t o = at;
      at = align_up(at + bytes, 256);
      return o;
    };
    signals = take(6 * 2 * r * 8);
    signals_end = signals + 6 * 2 * r * 8;
    auto sig = [&](size_t array, size_t set) { return signals + (array * 2 + set) * r * 8; };
    for (int set = 0; set < 2; set++) {
      d[set] = {sig(0, set), sig(1, set), sig(2, set), take(r * meta_bytes), take(r * tm * msg), take(r * meta_bytes), take(tm * msg)};
      c[set] = {sig(3, set), sig(4, set), sig(5, set), take(r * 64), take(tm * k * row), take(r * 64), take(r * tm * row)};
    }
    zero_copy = take(el * r * tm * row);
    total = at;
    size_t h = 0;
    auto hand = [&](size_t bytes) {
      const size_t o = h;
      h = align_up(h + bytes, 256);
      return o;
    };
    htoken = hand(4 * r * tm);
    hj = hand(4 * r * tm);
    hrow = hand(4 * r * tm * k);
    hweight = hand(4 * r * tm * k);
    hmeta = hand(8 * r);
    home_idx = hand(8 * tm * k);
    home_weight = hand(4 * tm * k);
    handle_bytes = h;
  }
};

struct Rank {
  std::unique_ptr<Buf> region, nic, state, handles;
  u32 claim = 0;
  ErrorRecord record{};
  LlReport report{};
  u32 dispatch_calls = 0, combine_calls = 0;
};

struct World : RefWorld {
  LliAt L;
  u32 nodes;
  bool nvlink;  // emu-nic: peers of a node over NVLink (pointer stores)
  u32 workers = 2;
  u32 qps = 3;
  u64 timeout_ns = 20ull * 1000 * 1000 * 1000;
  std::vector<Rank> r;
  std::vector<u64> peer_bases;
  World(Shape shape, Quant quant, u32 num_nodes, bool over_nvlink) : RefWorld(shape, quant), L(shape), nodes(num_nodes), nvlink(over_nvlink), r(shape.ranks) {
    for (auto& st : r) {
      st.region.reset(new Buf(L.total, 0xcd));  // garbage: nothing may depend on zeroed data ...
      std::memset(st.region->p + L.signals, 0, L.signals_end - L.signals);  // ... but the signals start at 0
      st.nic.reset(new Buf(sizeof(NicState), 0));
      st.state.reset(new Buf(sizeof(LliState) + 44 * shape.ranks, 0));
      st.handles.reset(new Buf(2 * L.handle_bytes, 0xcd));
      peer_bases.push_back(st.region->addr());
    }
  }
  u32* mask(u32 rank) { return reinterpret_cast<u32*>(r[rank].state->p + sizeof(LliState) + 40 * s.ranks); }

  RdmaArgs rdma(u32 me) const {
    RdmaArgs a{};
    a.local_base = r[me].region->addr();
    a.peer_bases = reinterpret_cast<u64>(peer_bases.data());
    a.nic_state = kEmuNic ? r[me].nic->addr() : 0;
    a.nic_reorder_us = kEmuNic ? 30 : 0;
    a.nic_blocks = kEmuNic ? 1 : 0;
    a.nic_seed = 11 + me;
    a.rank = me;
    a.num_ranks = s.ranks;
    a.num_qps = qps;
    a.nvlink_ranks_per_node = nvlink ? s.ranks / nodes : 0;
    return a;
  }
  u32 flags(bool weights, bool shrink) const {
    return (q.round_scale ? LL_FLAG_ROUND_SCALE : 0) | (q.ue8m0 ? LL_FLAG_UE8M0 : 0) | (weights ? LL_FLAG_WEIGHTS : 0) |
           (shrink ? LL_FLAG_SHRINK : 0);
  }
  void handle(u32 me, u32 set, u64 h[7]) const {
    const u64 base = r[me].handles->addr() + set * L.handle_bytes;
    h[0] = base + L.htoken, h[1] = base + L.hj, h[2] = base + L.hrow, h[3] = base + L.hweight, h[4] = base + L.hmeta;
    h[5] = base + L.home_idx, h[6] = base + L.home_weight;
  }

  LliDispatchArgs dispatch_args(u32 me, const Inputs& in, DispatchOut& o, bool weights, bool shrink, u32 phases) {
    const u32 set = r[me].dispatch_calls & 1;
    o.set = set;
    o.recv_x.assign((size_t)s.el() * s.rows() * row_bytes(), 0xee);
    o.scales.assign((size_t)s.el() * std::max(cols(), 1u) * s.rows(), 0xeeeeeeeeu);
    o.count.assign(s.el(), -7);
    o.src_info.assign((size_t)s.el() * s.rows(), -7);
    o.layout_range.assign((size_t)s.el() * s.ranks, -7);
    if (o.cum.empty()) o.cum.assign(s.el(), 0);
    if (o.wait.empty()) o.wait.assign(s.ranks, 0);
    LliDispatchArgs a{};
    a.rdma = rdma(me);
    a.state = r[me].state->addr();
    a.x = (u64)in.x.data();
    a.topk_idx = (u64)in.idx.data();
    a.topk_weights = weights ? (u64)in.w.data() : 0;
    a.recv_x = (u64)o.recv_x.data();
    a.recv_scales = q.fp8 ? (u64)o.scales.data() : 0;
    a.recv_count = (u64)o.count.data();
    a.cum_stats = (u64)o.cum.data();
    a.wait_stats = (u64)o.wait.data();
    a.src_info = (u64)o.src_info.data();
    a.layout_range = (u64)o.layout_range.data();
    u64 h[7];
    handle(me, set, h);
    a.htoken = h[0], a.hj = h[1], a.hrow = h[2], a.hweight = h[3], a.hmeta = h[4], a.home_idx = h[5], a.home_weight = h[6];
    a.error_claim = (u64)&r[me].claim;
    a.error_record = (u64)&r[me].record;
    a.report = (u64)&r[me].report;
    a.timeout_ns = timeout_ns;
    const LliSetAt& at = L.d[set];
    a.off_meta_sig = at.meta_sig, a.off_data_sig = at.data_sig, a.off_consumed = at.consumed;
    a.off_meta = at.meta, a.off_msgs = at.data, a.off_send_meta = at.send_meta, a.off_send_msgs = at.send_data;
    a.meta_bytes = (u32)L.meta_bytes;
    a.num_tokens = s.tokens[me], a.max_tokens = s.t_max, a.num_experts = s.experts, a.num_local_experts = s.el();
    a.set = set, a.phases = phases, a.flags = flags(weights, shrink);
    const u32 quant = q.fp8 ? (1u | (q.round_scale ? 2u : 0u) | (q.ue8m0 ? 4u : 0u)) : 0u;
    const u32 sig[6] = {LL_HIDDEN, LL_TOPK, s.experts, s.t_max, quant, weights ? 1u : 0u};
    for (u32 i = 0; i < 6; i++) a.sig[i] = sig[i];
    r[me].dispatch_calls++;
    return a;
  }

  LliCombineArgs combine_args(u32 me, const Inputs& in, u32 dispatch_set, const std::vector<u16>& y, bool zero_copy, std::vector<u16>& out,
                              std::vector<i64>& wait, bool weights, bool shrink, u32 phases) {
    const u32 set = r[me].combine_calls & 1;
    out.assign((size_t)s.tokens[me] * LL_HIDDEN, 0xeeee);
    if (wait.empty()) wait.assign(s.ranks, 0);
    LliCombineArgs a{};
    a.rdma = rdma(me);
    a.state = r[me].state->addr();
    if (zero_copy) {
      std::memcpy(r[me].region->p + L.zero_copy, y.data(), y.size() * 2);
      a.y = r[me].region->addr() + L.zero_copy;
      a.y_is_zero_copy = 1;
    } else {
      a.y = (u64)y.data();
    }
    a.topk_idx = (u64)in.idx.data();
    a.topk_weights = (u64)in.w.data();
    a.out = (u64)out.data();
    a.wait_stats = (u64)wait.data();
    u64 h[7];
    handle(me, dispatch_set, h);
    a.htoken = h[0], a.hj = h[1], a.hrow = h[2], a.hweight = h[3], a.hmeta = h[4], a.home_idx = h[5], a.home_weight = h[6];
    a.error_claim = (u64)&r[me].claim;
    a.error_record = (u64)&r[me].record;
    a.report = (u64)&r[me].report;
    a.timeout_ns = timeout_ns;
    const LliSetAt& at = L.c[set];
    a.off_meta_sig = at.meta_sig, a.off_data_sig = at.data_sig, a.off_consumed = at.consumed;
    a.off_meta = at.meta, a.off_rows = at.data, a.off_send_meta = at.send_meta, a.off_send_rows = at.send_data;
    a.off_zero_copy = L.zero_copy;
    a.num_tokens = s.tokens[me], a.max_tokens = s.t_max, a.num_experts = s.experts, a.num_local_experts = s.el();
    a.set = set, a.phases = phases, a.flags = flags(weights, shrink);
    r[me].combine_calls++;
    return a;
  }

  void ranks(const std::function<void(u32)>& body, std::vector<u32> who = {}) {
    if (who.empty())
      for (u32 p = 0; p < s.ranks; p++) who.push_back(p);
    std::vector<std::thread> t;
    for (u32 p : who) t.emplace_back(body, p);
    for (auto& x : t) x.join();
  }
};

static void check_clean(World& w, u32 me, const char* what) {
  const LlReport& rep = w.r[me].report;
  CHECK(rep.own_problem == 0 && rep.mismatch_peer == 0 && rep.peer_problem_peer == 0, "%s: rank %u unexpected report (%u, %u, %u)", what, me,
        rep.own_problem, rep.mismatch_peer, rep.peer_problem_peer);
  CHECK(w.r[me].record.code == ERR_NONE, "%s: rank %u unexpected error record %u (peer %u)", what, me, w.r[me].record.code, w.r[me].record.peer);
}

struct RoundOpts {
  bool weights = true;
  bool hook = false;
  bool cancel = false;
  bool zero_copy = false;
  bool shrink = false;
  u32 seed = 1;
  std::vector<bool> masked;
};

static void round_trip(World& w, const RoundOpts& ro, const std::string& what_s) {
  const char* what = what_s.c_str();
  const u32 R = w.s.ranks;
  std::vector<Inputs> in(R);
  for (u32 p = 0; p < R; p++) in[p] = make_inputs(w, p, ro.seed, 4, ro.cancel);
  const std::vector<bool> masked = ro.masked.empty() ? std::vector<bool>(R, false) : ro.masked;
  std::vector<u32> live;
  for (u32 p = 0; p < R; p++)
    if (!masked[p]) live.push_back(p);
  std::vector<DispatchOut> d(R);
  w.ranks(
      [&](u32 me) {
        LliDispatchArgs a = w.dispatch_args(me, in[me], d[me], ro.weights, ro.shrink, LL_PHASE_SEND | (ro.hook ? 0 : LL_PHASE_RECV));
        run::launch(a, w.workers);
        if (ro.hook) {
          a.phases = LL_PHASE_RECV;
          run::launch(a, w.workers);
        }
      },
      live);
  std::vector<std::vector<std::vector<std::pair<u32, u32>>>> rows_of(R);
  std::vector<std::vector<u16>> ys(R);
  for (u32 me : live) {
    check_clean(w, me, what);
    rows_of[me] = check_dispatch(w, me, in, d[me], masked, what);
    ys[me] = expert_outputs(w, me, d[me], ro.cancel);
  }
  for (u32 p = 0; p < R; p++)
    if (masked[p]) {
      rows_of[p].resize(w.s.el());
      ys[p].assign((size_t)w.s.el() * w.s.rows() * LL_HIDDEN, 0);
    }
  std::vector<std::vector<u16>> out(R);
  std::vector<std::vector<i64>> cwait(R);
  w.ranks(
      [&](u32 me) {
        LliCombineArgs a = w.combine_args(me, in[me], d[me].set, ys[me], ro.zero_copy, out[me], cwait[me], ro.weights, ro.shrink,
                                          LL_PHASE_SEND | (ro.hook ? 0 : LL_PHASE_RECV));
        run::launch(a, w.workers);
        if (ro.hook) {
          a.phases = LL_PHASE_RECV;
          run::launch(a, w.workers);
        }
      },
      live);
  for (u32 me : live) {
    check_clean(w, me, what);
    check_combined(w, me, out[me], combine_reference(w, me, in[me], ys, rows_of, masked, ro.weights), what);
  }
}

int main() {
  std::vector<Quant> quants;
  if (LL_FP8) {
    quants.push_back({true, false, false});
    quants.push_back({true, true, false});
    if (LL_HIDDEN % 512 == 0) quants.push_back({true, true, true});
  } else {
    quants.push_back({false, false, false});
  }
  std::printf("transport: %s\n", kEmuNic ? "emu-nic" : "ptr");
  for (const Quant& q : quants) {
    const std::string qn = !q.fp8 ? "bf16" : q.ue8m0 ? "ue8m0" : q.round_scale ? "round" : "plain";
    // Virtual nodes 2 x 2, NVLink inside the node (emu-nic) or every peer through the transport; rounds
    // alternate sets, modes, hooks and grids; a rank with no tokens.
    for (bool nvlink : {false, true}) {
      if (nvlink && !kEmuNic) continue;
      World w(Shape{4, 16, 6, {6, 3, 0, 5}}, q, 2, nvlink);
      for (u32 i = 0; i < 4; i++) {
        RoundOpts ro;
        ro.weights = i % 2 == 0;
        ro.hook = i == 2;
        ro.zero_copy = i == 3;
        ro.seed = 10 + i;
        w.workers = 1 + i % 3;
        round_trip(w, ro, qn + " 2x2 rounds" + (nvlink ? " (nvlink in node)" : ""));
      }
      for (bool weights : {true, false}) {
        RoundOpts ro;
        ro.weights = weights;
        ro.cancel = true;
        ro.seed = 15;
        round_trip(w, ro, qn + " 2x2 cancellation");
      }
      std::printf("%s 2x2%s: 4 rounds (fused/hooked, pre-reduced/per-expert, zero-copy, 1..3 blocks), cancellation ok\n", qn.c_str(),
                  nvlink ? " (nvlink in node)" : "");
    }
    // 4 x 1 and 1 x 4 ... as world shapes the kernels see: the topology only changes NVLink routing.
    {
      World w(Shape{3, 12, 5, {5, 4, 2}}, q, 3, kEmuNic);
      RoundOpts ro;
      ro.seed = 21;
      round_trip(w, ro, qn + " 3x1");
      ro.weights = false;
      round_trip(w, ro, qn + " 3x1 per-expert");
      std::printf("%s 3x1: ok\n", qn.c_str());
    }
    if (&q == &quants.front()) {
      // Many tokens: the sender's routing (ranks per expert, slots per destination) counted past the first
      // pass of 32 x RANK_ROWS rows.
      World w(Shape{2, 8, 300, {300, 257}}, q, 2, false);
      for (u32 i = 0; i < 2; i++) {
        RoundOpts ro;
        ro.weights = i == 0;
        ro.seed = 30 + i;
        w.workers = 2 + i;
        round_trip(w, ro, qn + " many tokens");
      }
      std::printf("%s: 300 tokens per rank ok\n", qn.c_str());
    }
  }
  const Quant q = quants[0];
  // Shrink mode with a rank masked by the host, then a silent rank: hard mode names it, shrink mode masks
  // it and the others finish with each other's data.
  {
    World w(Shape{4, 16, 4, {4, 3, 4, 2}}, q, 2, kEmuNic);
    for (u32 p = 0; p < 4; p++) w.mask(p)[1] = 1;
    RoundOpts ro;
    ro.shrink = true;
    ro.masked = {false, true, false, false};
    ro.seed = 40;
    round_trip(w, ro, "masked rank 1");
    std::printf("shrink mask: ok\n");
  }
  for (bool shrink : {false, true}) {
    World w(Shape{3, 12, 4, {4, 3, 4}}, q, 3, false);
    w.timeout_ns = 300ull * 1000 * 1000;
    std::vector<Inputs> in(3);
    for (u32 p = 0; p < 3; p++) in[p] = make_inputs(w, p, 71);
    std::vector<DispatchOut> d(3);
    w.ranks([&](u32 me) { run::launch(w.dispatch_args(me, in[me], d[me], true, shrink, LL_PHASE_SEND | LL_PHASE_RECV), w.workers); }, {0, 1});
    if (!shrink) {
      for (u32 me = 0; me < 2; me++)
        CHECK(w.r[me].record.code == ERR_TIMEOUT && w.r[me].record.peer == 2 && w.r[me].record.phase == PHASE_LL_DISPATCH,
              "rank %u: expected a timeout naming rank 2 (code %u peer %u)", me, w.r[me].record.code, w.r[me].record.peer);
      std::printf("silent rank: timeout names it ok\n");
      continue;
    }
    const std::vector<bool> masked = {false, false, true};
    std::vector<std::vector<std::vector<std::pair<u32, u32>>>> rows_of(3);
    std::vector<std::vector<u16>> ys(3), out(3);
    std::vector<std::vector<i64>> cw(3);
    for (u32 me = 0; me < 2; me++) {
      check_clean(w, me, "shrink dispatch");
      CHECK(w.mask(me)[2] == 1 && w.mask(me)[0] == 0 && w.mask(me)[1] == 0, "rank %u: rank 2 should be masked", me);
      rows_of[me] = check_dispatch(w, me, in, d[me], masked, "shrink dispatch");
      ys[me] = expert_outputs(w, me, d[me]);
    }
    rows_of[2].resize(w.s.el());
    ys[2].assign(ys[0].size(), 0);
    w.ranks([&](u32 me) {
      run::launch(w.combine_args(me, in[me], d[me].set, ys[me], false, out[me], cw[me], true, true, LL_PHASE_SEND | LL_PHASE_RECV), w.workers);
    }, {0, 1});
    for (u32 me = 0; me < 2; me++) {
      check_clean(w, me, "shrink combine");
      check_combined(w, me, out[me], combine_reference(w, me, in[me], ys, rows_of, masked, true), "shrink combine");
    }
    std::printf("silent rank: shrink mode masks it ok\n");
  }
  std::printf("all internode scenarios passed (hidden %u, top-%u, %s, %s)\n", LL_HIDDEN, LL_TOPK, LL_FP8 ? "fp8" : "bf16",
              kEmuNic ? "emu-nic" : "ptr");
  return 0;
}
