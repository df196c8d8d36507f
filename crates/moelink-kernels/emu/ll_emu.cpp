// Host emulation of the low-latency kernels (ll_dispatch.cu, ll_combine.cu) for tests/ll_emulation.rs: R ranks as threads, each
// launch as one OS thread per block and one fiber per CUDA thread (runtime.hpp), symmetric memory as
// host allocations. Every scenario compares what the kernels wrote with a reference computed here from the
// documented semantics (crates/moelink/src/ll.rs, docs/oracle.md): recv_count, every valid row (bytes),
// every scale, the combined output bit for bit, the reports and error records. Prints one line per
// scenario and exits non-zero on the first mismatch.
//
// Built by the test with the variant's -D constants (LL_HIDDEN, LL_TOPK, LL_FP8, ...) and LL_THREADS=64,
// next to copies of ll.cuh, ll_dispatch.cu, ll_combine.cu and the emulated ptx.cuh (ptx_emu.hpp spliced in).
#include "runtime.hpp"
#include "ptx.cuh"
#include "ll_dispatch.cu"
#include "ll_combine.cu"
#include "ll_reference.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>

// ============================================================================================ launching
namespace run {

void kernel_of(const LlDispatchArgs& a) { moelink::low_latency::dispatch(a); }
void kernel_of(const LlCombineArgs& a) { moelink::low_latency::combine(a); }

// Runs the kernel for `args` on `grid` blocks of LL_THREADS threads; returns when every block finished.
template <typename Args>
void launch(const Args& args, u32 grid) {
  emu::launch(grid, LL_THREADS, [&args] { kernel_of(args); });
}

}  // namespace run

// ============================================================================================ the world
// moelink_kernels::ll::LlLayout (same arithmetic).
struct Layout {
  size_t entries, weights, counts, rows, row_stride, dispatch_bytes, combine_bytes;
  size_t hweight, hmeta, home_idx, home_weight, handle_bytes;
  size_t dispatch_at[2], combine_at[2], handle_at[2], total;
  explicit Layout(const Shape& s) {
    const size_t r = s.ranks, tm = s.t_max, h = LL_HIDDEN, k = LL_TOPK, el = s.el(), A = 4096;
    const size_t eb = align_up(r * tm * k * 4, A);
    row_stride = align_up(2 * h, 16);
    entries = 0;
    weights = eb;
    counts = 2 * eb;
    rows = counts + align_up(r * el * 4, A);
    dispatch_bytes = align_up(rows + r * tm * row_stride, A);
    combine_bytes = align_up(std::max(r * tm, tm * k) * 2 * h, A);
    hweight = align_up(r * tm * k * 4, A);
    hmeta = 2 * hweight;
    home_idx = hmeta + align_up(r * 8, A);
    home_weight = home_idx + align_up(tm * k * 8, A);
    handle_bytes = home_weight + align_up(tm * k * 4, A);
    size_t at = 0;
    for (int i = 0; i < 2; i++) dispatch_at[i] = at, at += dispatch_bytes;
    for (int i = 0; i < 2; i++) combine_at[i] = at, at += combine_bytes;
    for (int i = 0; i < 2; i++) handle_at[i] = at, at += handle_bytes;
    total = at;
  }
};

struct RankState {
  u8* ctrl = nullptr;  // LlCtrl
  u8* data = nullptr;  // LL data region
  u32 claim = 0;
  ErrorRecord record{};
  LlReport report{};
  u32 dispatch_calls = 0, combine_calls = 0;
};

struct World : RefWorld {
  Layout L;
  u32 grid = 3;
  u64 timeout_ns = 20ull * 1000 * 1000 * 1000;
  std::vector<RankState> r;
  explicit World(Shape shape, Quant quant) : RefWorld(shape, quant), L(shape), r(shape.ranks) {
    for (auto& st : r) {
      st.ctrl = static_cast<u8*>(std::aligned_alloc(4096, align_up(sizeof(LlCtrl), 4096)));
      std::memset(st.ctrl, 0, align_up(sizeof(LlCtrl), 4096));
      st.data = static_cast<u8*>(std::aligned_alloc(4096, L.total));
      std::memset(st.data, 0xcd, L.total);  // garbage: nothing may depend on zeroed data
    }
  }
  ~World() {
    for (auto& st : r) {
      std::free(st.ctrl);
      std::free(st.data);
    }
  }
  LlCtrl& ctrl(u32 rank) { return *reinterpret_cast<LlCtrl*>(r[rank].ctrl); }

  u32 flags(bool weights, bool shrink) const {
    return (q.round_scale ? LL_FLAG_ROUND_SCALE : 0) | (q.ue8m0 ? LL_FLAG_UE8M0 : 0) | (weights ? LL_FLAG_WEIGHTS : 0) |
           (shrink ? LL_FLAG_SHRINK : 0);
  }
  u32 quant_code() const { return q.fp8 ? (1u | (q.round_scale ? 2u : 0u) | (q.ue8m0 ? 4u : 0u)) : 0u; }

  void handle_area(u32 rank, u32 set, u64 out[5]) {
    const u64 base = (u64)(r[rank].data + L.handle_at[set]);
    out[0] = base, out[1] = base + L.hweight, out[2] = base + L.hmeta, out[3] = base + L.home_idx, out[4] = base + L.home_weight;
  }

  LlDispatchArgs dispatch_args(u32 me, const Inputs& in, DispatchOut& o, bool weights, bool shrink, u32 phases) {
    const u32 set = r[me].dispatch_calls & 1;
    o.set = set;
    o.recv_x.assign((size_t)s.el() * s.rows() * row_bytes(), 0xee);
    o.scales.assign((size_t)s.el() * std::max(cols(), 1u) * s.rows(), 0xeeeeeeeeu);
    o.count.assign(s.el(), -7);
    o.src_info.assign((size_t)s.el() * s.rows(), -7);
    o.layout_range.assign((size_t)s.el() * s.ranks, -7);
    if (o.cum.empty()) o.cum.assign(s.el(), 0);
    if (o.wait.empty()) o.wait.assign(s.ranks, 0);
    LlDispatchArgs a{};
    for (u32 p = 0; p < s.ranks; p++) {
      a.ctrl[p] = (u64)r[p].ctrl;
      a.recv[p] = (u64)(r[p].data + L.dispatch_at[set]);
    }
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
    u64 h[5];
    handle_area(me, set, h);
    a.hrow = h[0], a.hweight = h[1], a.hmeta = h[2], a.home_idx = h[3], a.home_weight = h[4];
    a.error_claim = (u64)&r[me].claim;
    a.error_record = (u64)&r[me].record;
    a.report = (u64)&r[me].report;
    a.timeout_ns = timeout_ns;
    a.off_entries = L.entries, a.off_weights = L.weights, a.off_rows = L.rows, a.off_counts = L.counts;
    a.row_stride = (u32)L.row_stride;
    a.rank = me, a.num_ranks = s.ranks, a.num_tokens = s.tokens[me], a.max_tokens = s.t_max;
    a.num_experts = s.experts, a.num_local_experts = s.el(), a.set = set, a.phases = phases;
    a.flags = flags(weights, shrink);
    const u32 sig[6] = {LL_HIDDEN, LL_TOPK, s.experts, s.t_max, quant_code(), weights ? 1u : 0u};
    for (u32 i = 0; i < 6; i++) a.sig[i] = sig[i];
    r[me].dispatch_calls++;
    return a;
  }

  LlCombineArgs combine_args(u32 me, const Inputs& in, u32 dispatch_set, const std::vector<u16>& y, std::vector<u16>& out,
                             std::vector<i64>& wait, bool weights, bool shrink, u32 phases, u32 host_problem = 0) {
    const u32 set = r[me].combine_calls & 1;
    out.assign((size_t)s.tokens[me] * LL_HIDDEN, 0xeeee);
    if (wait.empty()) wait.assign(s.ranks, 0);
    LlCombineArgs a{};
    for (u32 p = 0; p < s.ranks; p++) {
      a.ctrl[p] = (u64)r[p].ctrl;
      a.recv[p] = (u64)(r[p].data + L.combine_at[set]);
    }
    a.y = (u64)y.data();
    a.topk_idx = (u64)in.idx.data();
    a.topk_weights = (u64)in.w.data();
    a.out = (u64)out.data();
    a.wait_stats = (u64)wait.data();
    u64 h[5];
    handle_area(me, dispatch_set, h);
    a.hrow = h[0], a.hweight = h[1], a.hmeta = h[2], a.home_idx = h[3], a.home_weight = h[4];
    a.error_claim = (u64)&r[me].claim;
    a.error_record = (u64)&r[me].record;
    a.report = (u64)&r[me].report;
    a.timeout_ns = timeout_ns;
    a.rank = me, a.num_ranks = s.ranks, a.num_tokens = s.tokens[me], a.max_tokens = s.t_max;
    a.num_experts = s.experts, a.num_local_experts = s.el(), a.set = set, a.phases = phases;
    a.flags = flags(weights, shrink);
    a.host_problem = host_problem;
    r[me].combine_calls++;
    return a;
  }

  // Runs body(rank) on one thread per rank (ranks listed in `who`), concurrently.
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
  CHECK(w.r[me].record.code == ERR_NONE, "%s: rank %u unexpected error record (peer %u)", what, me, w.r[me].record.peer);
}

// ============================================================================================ scenarios
// One full round on every rank: dispatch (fused or hooked), experts, combine (fused or hooked); checked.
struct RoundOpts {
  bool weights = true;
  bool hook = false;
  bool cancel = false;
  u32 seed = 1;
  std::vector<bool> masked;
};

static void round_trip(World& w, const RoundOpts& ro, const char* what) {
  const u32 R = w.s.ranks;
  std::vector<Inputs> in(R);
  for (u32 p = 0; p < R; p++) in[p] = make_inputs(w, p, ro.seed, 4, ro.cancel);
  std::vector<bool> masked = ro.masked.empty() ? std::vector<bool>(R, false) : ro.masked;
  std::vector<DispatchOut> d(R);
  w.ranks([&](u32 me) {
    if (ro.hook) {
      LlDispatchArgs a = w.dispatch_args(me, in[me], d[me], ro.weights, false, LL_PHASE_SEND);
      run::launch(a, w.grid);
      a.phases = LL_PHASE_RECV;
      run::launch(a, w.grid);
    } else {
      run::launch(w.dispatch_args(me, in[me], d[me], ro.weights, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid);
    }
  });
  std::vector<std::vector<std::vector<std::pair<u32, u32>>>> rows_of(R);
  std::vector<std::vector<u16>> ys(R);
  for (u32 me = 0; me < R; me++) {
    check_clean(w, me, what);
    // A masked rank drops its own tokens too (it is masked in its own mask).
    std::vector<bool> m = masked;
    rows_of[me] = check_dispatch(w, me, in, d[me], m, what);
    ys[me] = expert_outputs(w, me, d[me], ro.cancel);
  }
  std::vector<std::vector<u16>> out(R);
  std::vector<std::vector<i64>> cwait(R);
  w.ranks([&](u32 me) {
    if (ro.hook) {
      LlCombineArgs a = w.combine_args(me, in[me], d[me].set, ys[me], out[me], cwait[me], ro.weights, false, LL_PHASE_SEND);
      run::launch(a, w.grid);
      a.phases = LL_PHASE_RECV;
      run::launch(a, w.grid);
    } else {
      run::launch(w.combine_args(me, in[me], d[me].set, ys[me], out[me], cwait[me], ro.weights, false, LL_PHASE_SEND | LL_PHASE_RECV),
                  w.grid);
    }
  });
  for (u32 me = 0; me < R; me++) {
    check_clean(w, me, what);
    check_combined(w, me, out[me], combine_reference(w, me, in[me], ys, rows_of, masked, ro.weights), what);
    for (u32 p = 0; p < R; p++) CHECK(d[me].wait[p] >= 0 && cwait[me][p] >= 0, "%s: negative wait", what);
  }
}

static void set_mask(World& w, u32 masked_rank, bool on) {
  for (u32 p = 0; p < w.s.ranks; p++) w.ctrl(p).mask[masked_rank] = on ? 1 : 0;
}

int main() {
  const bool ue8m0_ok = LL_HIDDEN % 512 == 0;
  std::vector<Quant> quants;
  if (LL_FP8) {
    quants.push_back({true, false, false});
    quants.push_back({true, true, false});
    if (ue8m0_ok) quants.push_back({true, true, true});
  } else {
    quants.push_back({false, false, false});
  }
  const u32 E = 4 * 4;
  for (const Quant& q : quants) {
    const std::string qn = !q.fp8 ? "bf16" : q.ue8m0 ? "ue8m0" : q.round_scale ? "round" : "plain";
    // Several rounds on one world: buffer sets alternate, epochs grow, nothing is cleared.
    {
      World w(Shape{4, E, 6, {6, 3, 0, 5}}, q);
      for (u32 i = 0; i < 4; i++) {
        RoundOpts ro;
        ro.weights = i % 2 == 0;
        ro.hook = i == 2;
        ro.seed = 10 + i;
        w.grid = 1 + i % 3;
        round_trip(w, ro, (qn + " rounds").c_str());
      }
      std::printf("%s: 4 rounds (fused/hooked, pre-reduced/per-expert, 1..3 blocks, %s arrivals) ok\n", qn.c_str(),
                  LL_LAST_ARRIVES ? "last-block" : "per-block");
      for (bool weights : {true, false}) {
        RoundOpts ro;
        ro.weights = weights;
        ro.cancel = true;
        ro.seed = 15;
        round_trip(w, ro, (qn + " cancellation").c_str());
      }
      // Shrink-mode mask (set by the host): rank 1 masked everywhere.
      set_mask(w, 1, true);
      RoundOpts ro;
      ro.masked = {false, true, false, false};
      ro.seed = 20;
      round_trip(w, ro, (qn + " masked").c_str());
      set_mask(w, 1, false);
      ro.masked.clear();
      ro.weights = false;
      round_trip(w, ro, (qn + " unmasked").c_str());
      std::printf("%s: masks ok\n", qn.c_str());
    }
    // Many tokens per rank: a sender ranks each token over all earlier rows in passes of 32 x RANK_ROWS rows
    // (dispatch_routing), so the entries and the counts are checked past the first pass and past lane 31.
    if (&q == &quants.front()) {
      World w(Shape{2, E, 300, {300, 257}}, q);
      for (u32 i = 0; i < 2; i++) {
        RoundOpts ro;
        ro.weights = i == 0;
        ro.seed = 30 + i;
        w.grid = 2 + i;
        round_trip(w, ro, (qn + " many tokens").c_str());
      }
      std::printf("%s: 300 tokens per rank ok\n", qn.c_str());
    }
    {
      // Few experts per rank, so that tokens often select +B, -B and a tiny expert on the same rank (the
      // order inside a pre-reduced partial) as well as across ranks.
      const u32 e2 = std::max<u32>(6u, 4u * LL_TOPK);  // room for the tiny experts the tokens select
      World w(Shape{2, e2, 8, {8, 7}}, q);
      for (u32 i = 0; i < 4; i++) {
        RoundOpts ro;
        ro.weights = i % 2 == 0;
        ro.cancel = true;
        ro.seed = 16 + i;
        round_trip(w, ro, (qn + " cancellation (EP2)").c_str());
      }
      std::printf("%s: summation order under cancellation ok\n", qn.c_str());
    }
  }
  const Quant q = quants[0];

  // Two hooked dispatches in flight: send e, send e+1, receive e, receive e+1, then both combines.
  {
    World w(Shape{3, 12, 5, {5, 4, 2}}, q);
    const u32 R = 3;
    std::vector<Inputs> a(R), b(R);
    for (u32 p = 0; p < R; p++) a[p] = make_inputs(w, p, 31), b[p] = make_inputs(w, p, 32);
    std::vector<DispatchOut> da(R), db(R);
    w.ranks([&](u32 me) {
      LlDispatchArgs x = w.dispatch_args(me, a[me], da[me], true, false, LL_PHASE_SEND);
      LlDispatchArgs y = w.dispatch_args(me, b[me], db[me], true, false, LL_PHASE_SEND);
      run::launch(x, w.grid);
      run::launch(y, w.grid);
      x.phases = LL_PHASE_RECV;
      y.phases = LL_PHASE_RECV;
      run::launch(x, w.grid);
      run::launch(y, w.grid);
    });
    std::vector<bool> none(R, false);
    std::vector<std::vector<std::vector<std::pair<u32, u32>>>> ra(R), rb(R);
    std::vector<std::vector<u16>> ya(R), yb(R);
    for (u32 me = 0; me < R; me++) {
      check_clean(w, me, "two in flight");
      ra[me] = check_dispatch(w, me, a, da[me], none, "two in flight (first)");
      rb[me] = check_dispatch(w, me, b, db[me], none, "two in flight (second)");
      ya[me] = expert_outputs(w, me, da[me]);
      yb[me] = expert_outputs(w, me, db[me]);
    }
    std::vector<std::vector<u16>> oa(R), ob(R);
    std::vector<std::vector<i64>> wa(R), wb(R);
    w.ranks([&](u32 me) {
      run::launch(w.combine_args(me, a[me], da[me].set, ya[me], oa[me], wa[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid);
      run::launch(w.combine_args(me, b[me], db[me].set, yb[me], ob[me], wb[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid);
    });
    for (u32 me = 0; me < R; me++) {
      check_combined(w, me, oa[me], combine_reference(w, me, a[me], ya, ra, none, true), "two in flight (first combine)");
      check_combined(w, me, ob[me], combine_reference(w, me, b[me], yb, rb, none, true), "two in flight (second combine)");
    }
    std::printf("two hooked dispatches in flight ok\n");
  }

  // A dropped hook is drained; the set is reused afterwards; cumulative statistics accumulate.
  {
    World w(Shape{2, 8, 4, {4, 3}}, q);
    std::vector<Inputs> in(2);
    for (u32 p = 0; p < 2; p++) in[p] = make_inputs(w, p, 41);
    std::vector<DispatchOut> dropped(2);
    w.ranks([&](u32 me) {
      LlDispatchArgs x = w.dispatch_args(me, in[me], dropped[me], true, false, LL_PHASE_SEND);
      run::launch(x, w.grid);
      x.phases = LL_PHASE_DRAIN;
      run::launch(x, 1);
    });
    for (u32 i = 0; i < 3; i++) {
      RoundOpts ro;
      ro.seed = 42 + i;
      round_trip(w, ro, "after a drain");
    }
    std::printf("drained hook ok\n");
  }

  // Invalid top-k ids on rank 2: it reports its own problem, the others name it; the next round works.
  {
    World w(Shape{3, 12, 4, {4, 4, 3}}, q);
    std::vector<Inputs> in(3);
    for (u32 p = 0; p < 3; p++) in[p] = make_inputs(w, p, 51, 0);
    in[2].idx[1] = 12;  // == num_experts
    in[1].idx[LL_TOPK] = -1;
    std::vector<DispatchOut> d(3);
    w.ranks([&](u32 me) { run::launch(w.dispatch_args(me, in[me], d[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid); });
    CHECK(w.r[2].report.own_problem == LL_PROBLEM_TOPK_IDX, "rank 2 own problem %u", w.r[2].report.own_problem);
    for (u32 me = 0; me < 2; me++)
      CHECK(w.r[me].report.peer_problem_peer == 3 && w.r[me].report.peer_problem == LL_PROBLEM_TOPK_IDX, "rank %u peer problem %u/%u", me,
            w.r[me].report.peer_problem_peer, w.r[me].report.peer_problem);
    if (LL_TOPK >= 2) {
      // A repeated expert is a problem too.
      for (u32 p = 0; p < 3; p++) w.r[p].report = LlReport{};
      in[2].idx[1] = in[2].idx[0] >= 0 ? in[2].idx[0] : 3;
      in[2].idx[0] = in[2].idx[1];
      w.ranks([&](u32 me) { run::launch(w.dispatch_args(me, in[me], d[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid); });
      CHECK(w.r[2].report.own_problem == LL_PROBLEM_TOPK_IDX, "rank 2 repeat: own problem %u", w.r[2].report.own_problem);
      CHECK(w.r[0].report.peer_problem_peer == 3, "rank 0 should name rank 2 for the repeat");
    }
    for (u32 p = 0; p < 3; p++) w.r[p].report = LlReport{};
    RoundOpts ro;
    ro.seed = 52;
    round_trip(w, ro, "after invalid ids");
    std::printf("invalid top-k ids reported on every rank ok\n");
  }

  // Call-signature mismatch (rank 1 claims another expert count) and combine weights that differ from
  // dispatch's: reported, then the next round works.
  {
    World w(Shape{2, 8, 4, {4, 2}}, q);
    std::vector<Inputs> in(2);
    for (u32 p = 0; p < 2; p++) in[p] = make_inputs(w, p, 61);
    std::vector<DispatchOut> d(2);
    w.ranks([&](u32 me) {
      LlDispatchArgs a = w.dispatch_args(me, in[me], d[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV);
      if (me == 1) a.sig[2] = 9;
      run::launch(a, w.grid);
    });
    CHECK(w.r[0].report.mismatch_peer == 2 && w.r[0].report.mismatch_field == 2 && w.r[0].report.mismatch_ours == 8 &&
              w.r[0].report.mismatch_theirs == 9,
          "rank 0 mismatch report");
    CHECK(w.r[1].report.mismatch_peer == 1 && w.r[1].report.mismatch_theirs == 8, "rank 1 mismatch report");
    for (u32 p = 0; p < 2; p++) w.r[p].report = LlReport{};

    // A good dispatch, then a combine where rank 0 changed one weight by one ulp.
    w.ranks([&](u32 me) { run::launch(w.dispatch_args(me, in[me], d[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid); });
    std::vector<std::vector<u16>> ys(2), out(2);
    std::vector<std::vector<i64>> cw(2);
    for (u32 me = 0; me < 2; me++) ys[me] = expert_outputs(w, me, d[me]);
    Inputs changed = in[0];
    changed.w[0] = __uint_as_float(__float_as_uint(changed.w[0]) + 1);
    w.ranks([&](u32 me) {
      run::launch(w.combine_args(me, me == 0 ? changed : in[me], d[me].set, ys[me], out[me], cw[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV),
                  w.grid);
    });
    CHECK(w.r[0].report.own_problem == LL_PROBLEM_WEIGHTS_DIFFER, "rank 0 own problem %u", w.r[0].report.own_problem);
    CHECK(w.r[1].report.peer_problem_peer == 1 && w.r[1].report.peer_problem == LL_PROBLEM_WEIGHTS_DIFFER, "rank 1 should name rank 0");
    for (u32 p = 0; p < 2; p++) w.r[p].report = LlReport{};
    // The same handle with the dispatch-time weights still combines correctly.
    std::vector<std::vector<std::vector<std::pair<u32, u32>>>> rows_of(2);
    for (u32 me = 0; me < 2; me++) rows_of[me] = check_dispatch(w, me, in, d[me], {false, false}, "before the second combine");
    w.ranks([&](u32 me) {
      run::launch(w.combine_args(me, in[me], d[me].set, ys[me], out[me], cw[me], true, false, LL_PHASE_SEND | LL_PHASE_RECV), w.grid);
    });
    for (u32 me = 0; me < 2; me++) {
      check_clean(w, me, "second combine");
      check_combined(w, me, out[me], combine_reference(w, me, in[me], ys, rows_of, {false, false}, true), "second combine");
    }
    std::printf("signature mismatch and changed weights reported ok\n");
  }

  // A silent rank: hard mode names it; shrink mode masks it and finishes with the others' data.
  for (bool shrink : {false, true}) {
    World w(Shape{3, 12, 4, {4, 3, 4}}, q);
    w.timeout_ns = 1000ull * 1000 * 1000;
    std::vector<Inputs> in(3);
    for (u32 p = 0; p < 3; p++) in[p] = make_inputs(w, p, 71);
    std::vector<DispatchOut> d(3);
    std::vector<std::vector<u16>> ys(3), out(3);
    std::vector<std::vector<i64>> cw(3);
    w.ranks([&](u32 me) { run::launch(w.dispatch_args(me, in[me], d[me], true, shrink, LL_PHASE_SEND | LL_PHASE_RECV), w.grid); }, {0, 1});
    if (!shrink) {
      for (u32 me = 0; me < 2; me++)
        CHECK(w.r[me].record.code == ERR_TIMEOUT && w.r[me].record.peer == 2 && w.r[me].record.phase == PHASE_LL_DISPATCH,
              "rank %u: expected a timeout naming rank 2 (code %u peer %u)", me, w.r[me].record.code, w.r[me].record.peer);
      std::printf("silent rank: timeout names it ok\n");
      continue;
    }
    std::vector<bool> masked = {false, false, true};
    std::vector<std::vector<std::vector<std::pair<u32, u32>>>> rows_of(3);
    for (u32 me = 0; me < 2; me++) {
      check_clean(w, me, "shrink dispatch");
      CHECK(w.ctrl(me).mask[2] == 1 && w.ctrl(me).mask[0] == 0 && w.ctrl(me).mask[1] == 0, "rank %u: rank 2 should be masked", me);
      rows_of[me] = check_dispatch(w, me, in, d[me], masked, "shrink dispatch");
      ys[me] = expert_outputs(w, me, d[me]);
    }
    rows_of[2].resize(w.s.el());
    ys[2].assign(ys[0].size(), 0);
    w.ranks([&](u32 me) {
      run::launch(w.combine_args(me, in[me], d[me].set, ys[me], out[me], cw[me], true, true, LL_PHASE_SEND | LL_PHASE_RECV), w.grid);
    }, {0, 1});
    for (u32 me = 0; me < 2; me++) {
      check_clean(w, me, "shrink combine");
      check_combined(w, me, out[me], combine_reference(w, me, in[me], ys, rows_of, masked, true), "shrink combine");
    }
    std::printf("silent rank: shrink mode masks it ok\n");
  }

  std::printf("all scenarios passed (hidden %u, top-%u, %s)\n", LL_HIDDEN, LL_TOPK, LL_FP8 ? "fp8" : "bf16");
  return 0;
}
