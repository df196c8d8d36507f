// Drives the emulated HT kernels (see runtime.hpp) the way moelink's CUDA backend does, for R ranks in one
// process, and checks every output against a reference computed here. Included at the end of the translation
// unit tests/emulate_ht.rs assembles, after the kernel namespaces:
//   k_layout (ht_layout.cu), k_notify (ht_notify.cu), k_disp (ht_dispatch.cu for HIDDEN/FP8/TOPK),
//   k_disp0 (ht_dispatch.cu, bf16, no top-k: cached dispatch), k_comb / k_comb0 (ht_combine.cu for NUM_RANKS/HIDDEN/TOPK,
//   with two biases / none).
// Usage: harness <scenario>; prints "PASS <scenario>" or a diagnosis, exits non-zero on failure.
#include <cinttypes>
#include <cstring>
#include <mutex>
#include <string>

namespace h {

using u8 = unsigned char;
using u16 = unsigned short;
using u32 = unsigned int;
using i32 = int;
using u64 = unsigned long long;
using i64 = long long;

constexpr u32 R = EMU_RANKS;
constexpr u32 H = EMU_HIDDEN;
constexpr u32 K = EMU_TOPK;
constexpr bool F8 = EMU_FP8 != 0;
constexpr u32 EL = EMU_LOCAL_EXPERTS;
constexpr u32 E = EL * R;
constexpr u32 SCALES = F8 ? H / 128 : 0;

static int g_failures = 0;
static std::mutex g_print;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      std::lock_guard<std::mutex> lock(g_print);          \
      if (g_failures++ < 30) {                            \
        std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
        std::fprintf(stderr, __VA_ARGS__);                \
        std::fprintf(stderr, "\n");                       \
      }                                                   \
    }                                                     \
  } while (0)

// ---------------------------------------------------------------------------------------------- inputs

struct Rng {
  u64 s;
  explicit Rng(u64 seed) : s(seed ^ 0x9E3779B97F4A7C15ull) {}
  u64 next() {
    s += 0x9E3779B97F4A7C15ull;
    u64 z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  u32 below(u32 n) { return (u32)(next() % n); }
};

// bf16 of a value with a random sign, mantissa and an exponent spread over 2^-27..2^12: an f32 sum of a few
// of these rounds, so its bits depend on the order of the adds.
u16 random_bf16(Rng& r) {
  const u32 sign = r.below(2) << 15, exp = 100 + r.below(40), man = r.below(128);
  return (u16)(sign | (exp << 7) | man);
}

float bf16_to_f32(u16 v) {
  u32 u = (u32)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

u16 f32_to_bf16(float f) {
  u32 u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

// The HT combine's sum as moelink::reduce defines it, for one node of R ranks: leaves v[r] (+0.0 for a rank
// the token did not go to) padded with +0.0 to a power of two, tree(x_0..x_{2m-1}) = tree(x_0..x_{m-1}) +
// tree(x_m..x_{2m-1}), then +0.0 + T. Written out literally (the padding adds included), not as the kernel
// computes it.
float tree(const float* x, u32 n) { return n == 1 ? x[0] : tree(x, n / 2) + tree(x + n / 2, n / 2); }
float combine_sum(const float (&v)[R]) {
  u32 np = 1;
  while (np < R) np *= 2;
  float x[2 * R] = {};
  for (u32 r = 0; r < R; r++) x[r] = v[r];
  return 0.0f + tree(x, np);
}

enum class Route { Uniform, Holes, Skewed, EmptyLast };

struct RankInputs {
  u32 t = 0;
  std::vector<u8> x;             // [t, H] bf16 or fp8 bytes
  std::vector<float> scales;     // column-major [groups][t] (FP8)
  std::vector<i64> topk_idx;     // [t, K]
  std::vector<float> topk_w;     // [t, K]
  std::vector<u16> y;            // [t, H] bf16: a second payload (cached dispatch)
};

RankInputs make_inputs(u32 rank, u32 tokens, Route route, u64 seed) {
  Rng r(seed * 1000 + rank);
  RankInputs in;
  in.t = tokens;
  const u32 bytes = H * (F8 ? 1 : 2);
  in.x.resize((size_t)tokens * bytes);
  for (auto& b : in.x) b = (u8)(F8 ? (r.next() & 0x7e) : 0);
  if (!F8)
    for (u32 i = 0; i < tokens * H; i++) {
      const u16 v = random_bf16(r);
      std::memcpy(&in.x[2 * (size_t)i], &v, 2);
    }
  in.scales.resize((size_t)SCALES * tokens);
  for (auto& s : in.scales) s = (float)(r.below(1000) + 1) / 7.0f;
  in.topk_idx.resize((size_t)tokens * K);
  in.topk_w.resize((size_t)tokens * K);
  for (u32 t = 0; t < tokens; t++) {
    for (u32 k = 0; k < K; k++) {
      i64 e;
      bool again;
      do {
        switch (route) {
          case Route::Skewed: e = r.below(4) != 0 ? (i64)r.below(K + 1 < E ? K + 1 : E) : (i64)r.below(E); break;
          case Route::EmptyLast: e = R > 1 ? (i64)r.below(E - EL) : -1; break;
          default: e = (i64)r.below(E); break;
        }
        again = false;
        for (u32 j = 0; e >= 0 && j < k; j++) again |= in.topk_idx[(size_t)t * K + j] == e;
      } while (again);
      if (route == Route::Holes && r.below(4) == 0) e = -1;
      in.topk_idx[(size_t)t * K + k] = e;
      in.topk_w[(size_t)t * K + k] = (float)(r.below(1000) + 1) / 1024.0f;
    }
  }
  in.y.resize((size_t)tokens * H);
  for (auto& v : in.y) v = random_bf16(r);
  return in;
}

bool hits(const RankInputs& in, u32 t, u32 dst) {
  for (u32 k = 0; k < K; k++) {
    const i64 e = in.topk_idx[(size_t)t * K + k];
    if (e >= 0 && (u32)(e / EL) == dst) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------- world

template <typename T>
T* alloc16(std::vector<std::unique_ptr<u8[]>>& keep, size_t count) {
  const size_t bytes = count * sizeof(T) + 16;
  keep.emplace_back(new u8[bytes]());
  const uintptr_t p = ((uintptr_t)keep.back().get() + 15) & ~(uintptr_t)15;
  return reinterpret_cast<T*>(p);
}

struct Region {  // mirror of moelink_kernels::ht::HtRegion
  size_t nvl;
  u32 flag_slots() const { return (u32)(nvl / (R * 1024)); }
  size_t flag_array() const { return ((size_t)R * flag_slots() * 4 + 255) / 256 * 256; }
  size_t slab_bytes() const { return (nvl > 2 * flag_array() ? nvl - 2 * flag_array() : 0) / 2 / 256 * 256; }
  u64 dispatch_flags() const { return 0; }
  u64 combine_flags() const { return flag_array(); }
  u64 dispatch_slab() const { return 2 * flag_array(); }
  u64 combine_slab() const { return 2 * flag_array() + slab_bytes(); }
  u32 slab_rows(size_t row) const {
    const size_t by_bytes = slab_bytes() / (R * row);
    return (u32)(by_bytes < flag_slots() ? by_bytes : flag_slots());
  }
};

size_t dispatch_row_bytes(u32 hidden, bool fp8, u32 topk) {
  const size_t meta = 2 * topk + (fp8 ? hidden / 128 : 0) + topk + 1;
  return hidden * (fp8 ? 1 : 2) + (meta * 4 + 15) / 16 * 16;
}
size_t combine_row_bytes(u32 hidden, u32 topk) { return 2 * (size_t)hidden + (topk * 4 + 15) / 16 * 16; }

struct ErrorRec {
  u32 code, rank, peer, phase;
  u64 d0, d1;
};

struct Rank {
  std::vector<std::unique_ptr<u8[]>> keep;
  u8* ctrl = nullptr;
  u8* data = nullptr;
  u32* claim = nullptr;
  ErrorRec* record = nullptr;
  u32* host_notify = nullptr;
};

struct World {
  Region region;
  u64 timeout_ns;
  u32 num_sms;
  Rank ranks[R];
  u64 ctrl_table[8] = {}, data_table[8] = {};
  World(size_t nvl, u32 sms, u64 timeout) : region{nvl}, timeout_ns(timeout), num_sms(sms) {
    for (u32 r = 0; r < R; r++) {
      Rank& k = ranks[r];
      k.ctrl = alloc16<u8>(k.keep, k_notify::HT_CTRL_BYTES);
      k.data = alloc16<u8>(k.keep, nvl + 16);
      k.claim = alloc16<u32>(k.keep, 1);
      k.record = alloc16<ErrorRec>(k.keep, 1);
      k.host_notify = alloc16<u32>(k.keep, 16 + EL);
      ctrl_table[r] = (u64)k.ctrl;
      data_table[r] = (u64)k.data;
    }
  }
  // Like Gpu::clear_argument_error (crates/moelink, backend/cuda/gpu.rs).
  void clear_errors(u32 r) {
    *ranks[r].claim = 0;
    std::memset(ranks[r].record, 0, sizeof(ErrorRec));
  }
};

// Runs f(rank) for every rank concurrently (one "stream" per rank) and waits.
template <typename F>
void per_rank(F f) {
  std::vector<std::thread> th;
  for (u32 r = 0; r < R; r++) th.emplace_back([&, r] { f(r); });
  for (auto& t : th) t.join();
}

// ---------------------------------------------------------------------------------------------- one rank's calls

struct Layout {
  std::vector<i32> per_rank, per_expert;
  std::vector<u8> in_rank;
};

Layout run_layout(World& w, u32 me, const RankInputs& in) {
  Layout l;
  // Garbage, as a fresh torch.empty holds: the kernel stores every counter.
  l.per_rank.assign(R, 0x5a5a5a5a);
  l.per_expert.assign(E, 0x5a5a5a5a);
  l.in_rank.assign((size_t)in.t * R + 1, 0xcc);
  k_layout::HtLayoutArgs a{};
  a.topk_idx = (u64)in.topk_idx.data();
  a.topk_stride_token = K;
  a.topk_stride_k = 1;
  a.num_tokens_per_rank = (u64)l.per_rank.data();
  a.num_tokens_per_expert = (u64)l.per_expert.data();
  a.is_token_in_rank = (u64)l.in_rank.data();
  a.error_claim = (u64)w.ranks[me].claim;
  a.error_record = (u64)w.ranks[me].record;
  a.num_tokens = in.t;
  a.topk = K;
  a.num_experts = E;
  a.num_ranks = R;
  a.rank = me;
  // One block per range of LAYOUT_EXPERTS_PER_BLOCK experts, as the backend launches, but at most two, so that
  // a block owns several ranges when there are more.
  const u32 ranges = (E + LAYOUT_EXPERTS_PER_BLOCK - 1) / LAYOUT_EXPERTS_PER_BLOCK;
  emu::launch(ranges < 2 ? ranges : 2, LAYOUT_THREADS, [&] { k_layout::moelink::intranode::layout(a); });
  return l;
}

struct Handle {
  std::vector<i32> routing;  // header + prefix
  std::vector<i32> src_idx;
  u32 num_recv = 0;
  bool known = false;
};

// Notify (+ host wait in CPU-sync mode). Returns false when the call failed (status or timeout).
bool run_notify(World& w, u32 me, const RankInputs& in, const Layout& l, Handle& h, bool sync, u32 seq, size_t slab_row, u64 sig) {
  h.routing.assign(k_notify::HT_RT_PREFIX + (size_t)(in.t + 1) * R, -7);
  k_notify::HtNotifyArgs a{};
  a.is_token_in_rank = (u64)l.in_rank.data();
  a.num_tokens_per_rank = (u64)l.per_rank.data();
  a.num_tokens_per_expert = (u64)l.per_expert.data();
  a.routing = (u64)h.routing.data();
  a.host_out = sync ? (u64)w.ranks[me].host_notify : 0;
  for (u32 r = 0; r < 8; r++) a.ctrl[r] = w.ctrl_table[r];
  a.signature = sig;
  a.error_claim = (u64)w.ranks[me].claim;
  a.error_record = (u64)w.ranks[me].record;
  a.timeout_ns = w.timeout_ns;
  a.rank = me;
  a.num_ranks = R;
  a.num_tokens = in.t;
  a.num_local_experts = EL;
  a.slab_rows = w.region.slab_rows(slab_row);
  a.slab_row_bytes = (u32)slab_row;
  a.host_seq = seq;
  emu::launch(1, NOTIFY_THREADS, [&] { k_notify::moelink::intranode::notify(a); });
  if (sync) {
    // The kernel has finished (launch joins): READY must hold the sequence number.
    CHECK(__atomic_load_n(&w.ranks[me].host_notify[0], __ATOMIC_ACQUIRE) == seq, "rank %u: host READY %u != %u", me,
          w.ranks[me].host_notify[0], seq);
    h.num_recv = w.ranks[me].host_notify[k_notify::HT_HN_NUM_RECV];
    h.known = true;
  }
  return h.routing[k_notify::HT_RT_STATUS] == 0;
}

// Columns of DeepEP's channel matrices the harness asks the dispatch for (the backend passes the caller's).
constexpr u32 EMU_CHANNELS = 3;

struct Outputs {
  u32 rows = 0;
  std::vector<u8> x;
  std::vector<float> scales;
  std::vector<i64> idx;
  std::vector<float> w;
  std::vector<i32> send_head, channel_prefix, recv_channel_prefix;  // DeepEP's channel elements, one past the end
};

template <typename Args>
void fill_common(Args& a, World& w, u32 me) {
  for (u32 r = 0; r < 8; r++) {
    a.ctrl[r] = w.ctrl_table[r];
    a.data[r] = w.data_table[r];
  }
  a.error_claim = (u64)w.ranks[me].claim;
  a.error_record = (u64)w.ranks[me].record;
  a.timeout_ns = w.timeout_ns;
  a.rank = me;
}

// The dispatch arguments of both dispatch builds (k_disp, k_disp0: one struct in two namespaces) besides the
// payload and the outputs: the handle's routing, the slab of `row_bytes` rows, the shape, the work split.
template <typename Args>
void fill_dispatch(Args& a, World& w, u32 me, const RankInputs& in, const Handle& h, u32 rows, u32 row_bytes) {
  fill_common(a, w, me);
  a.routing = (u64)h.routing.data();
  a.flags_offset = w.region.dispatch_flags();
  a.slab_offset = w.region.dispatch_slab();
  a.num_ranks = R;
  a.num_tokens = in.t;
  a.num_local_experts = EL;
  a.num_out_rows = rows;
  a.slab_rows = w.region.slab_rows(row_bytes);
  a.flag_slots = w.region.flag_slots();
  a.num_send_blocks = w.num_sms / 2;
  a.send_chunk = EMU_SEND_CHUNK;
  a.recv_chunk = EMU_RECV_CHUNK;
  a.dynamic_send = EMU_DYNAMIC_SEND;
}

// Timing trace (MOELINK_HT_TRACE): scenario "trace" gives the dispatch and combine kernels a buffer per rank
// and checks every block's and warp's stamps (ht.cuh, HT_TRACE_*) are present and ordered.
bool g_trace_on = false;
std::vector<u64> g_trace[2][R];  // [dispatch, combine][rank]

u64 trace_buffer(u32 kind, u32 me, u32 blocks, u32 words_per_block) {
  if (!g_trace_on) return 0;
  g_trace[kind][me].assign((size_t)blocks * words_per_block, 0);
  return (u64)g_trace[kind][me].data();
}

void check_trace(u32 kind, u32 me, u32 blocks, u32 words_per_block) {
  const std::vector<u64>& t = g_trace[kind][me];
  const u32 warps = (words_per_block - 2) / 2;
  for (u32 b = 0; b < blocks; b++) {
    const u64* w = t.data() + (size_t)b * words_per_block;
    CHECK(w[0] != 0 && w[1] >= w[0], "rank %u: trace %u block %u: start %llu end %llu", me, kind, b, (unsigned long long)w[0],
          (unsigned long long)w[1]);
    for (u32 k = 0; k < warps; k++) {
      const u64 start = w[2 + 2 * k], end = w[3 + 2 * k];
      CHECK(start >= w[0] && end >= start && end <= w[1], "rank %u: trace %u block %u warp %u out of order", me, kind, b, k);
    }
  }
}

// Fresh dispatch (payload x, top-k when K > 0; with top-k its senders check l.per_expert against topk_idx).
// `stale`: a later notify has rewritten the host words before this dispatch started (READY moved on, the
// per-expert sums changed): the receivers' check must skip itself.
void run_dispatch(World& w, u32 me, const RankInputs& in, const Layout& l, Handle& h, Outputs& o, u32 rows, bool stale = false) {
  o.rows = rows;
  o.x.assign((size_t)rows * H * (F8 ? 1 : 2) + 16, 0xab);
  o.scales.assign((size_t)rows * SCALES + 1, -1.0f);
  o.idx.assign((size_t)rows * K + 1, 12345);
  o.w.assign((size_t)rows * K + 1, -2.0f);
  h.src_idx.assign(rows + 1, -9);
  o.send_head.assign((size_t)in.t * R + 1, -9);
  o.channel_prefix.assign(R * EMU_CHANNELS + 1, -9);
  o.recv_channel_prefix.assign(R * EMU_CHANNELS + 1, -9);
  k_disp::HtDispatchArgs a{};
  fill_dispatch(a, w, me, in, h, rows, dispatch_row_bytes(H, F8, K));
  a.x = (u64)in.x.data();
  a.x_scales = F8 ? (u64)in.scales.data() : 0;
  a.scale_stride_token = 1;  // column-major scales
  a.scale_stride_group = in.t;
  a.topk_idx = K ? (u64)in.topk_idx.data() : 0;
  a.topk_weights = K ? (u64)in.topk_w.data() : 0;
  a.num_tokens_per_expert = K ? (u64)l.per_expert.data() : 0;
  if (K && h.known) {  // CPU-sync: the rows that arrive are checked against notify's per-expert sums
    a.host_notify = (u64)w.ranks[me].host_notify;
    a.host_seq = w.ranks[me].host_notify[k_notify::HT_HN_READY];
    if (stale) {
      w.ranks[me].host_notify[k_notify::HT_HN_READY] = a.host_seq + 1;
      w.ranks[me].host_notify[k_notify::HT_HN_PER_EXPERT] += 7;
    }
  }
  a.recv_x = (u64)o.x.data();
  a.recv_scales = F8 ? (u64)o.scales.data() : 0;
  a.recv_topk_idx = K ? (u64)o.idx.data() : 0;
  a.recv_topk_weights = K ? (u64)o.w.data() : 0;
  a.recv_src_idx = (u64)h.src_idx.data();
  a.send_head = (u64)o.send_head.data();
  a.channel_prefix = (u64)o.channel_prefix.data();
  a.recv_channel_prefix = (u64)o.recv_channel_prefix.data();
  a.num_channels = EMU_CHANNELS;
  a.trace = trace_buffer(0, me, w.num_sms, k_disp::TRACE_WORDS);
  emu::launch(w.num_sms, k_disp::THREADS, [&] { k_disp::moelink::intranode::dispatch(a); });
  if (a.trace != 0) check_trace(0, me, w.num_sms, k_disp::TRACE_WORDS);
}

// Cached dispatch of the bf16 payload y (no top-k), on the handle's routing.
// (moelink passes no recv_src_idx for a cached dispatch; here it is written too, to check that path.)
void run_cached(World& w, u32 me, const RankInputs& in, const Handle& h, std::vector<u16>& out, u32 rows) {
  out.assign((size_t)rows * H + 8, 0xdead);
  std::vector<i32> src_idx(rows + 1, -5);
  k_disp0::HtDispatchArgs a{};
  fill_dispatch(a, w, me, in, h, rows, dispatch_row_bytes(H, false, 0));
  a.x = (u64)in.y.data();
  a.recv_x = (u64)out.data();
  a.recv_src_idx = (u64)src_idx.data();
  emu::launch(w.num_sms, k_disp0::THREADS, [&] { k_disp0::moelink::intranode::dispatch(a); });
  if (h.routing[k_notify::HT_RT_STATUS] == 0) {
    const u32 n = (u32)h.routing[k_notify::HT_RT_NUM_RECV];
    for (u32 i = 0; i < rows && i < n; i++)
      CHECK(src_idx[i] == h.src_idx[i], "rank %u: cached dispatch src_idx[%u] = %d, fresh %d", me, i, src_idx[i], h.src_idx[i]);
    CHECK(src_idx[rows] == -5, "rank %u: cached dispatch wrote src_idx past its rows", me);
  }
}

void run_combine(World& w, u32 me, u32 tokens, const Handle& h, const std::vector<u16>& x, const std::vector<float>& weights,
                 const u16* bias0, const u16* bias1, std::vector<u16>& cx, std::vector<float>& cw, u32 x_rows) {
  cx.assign((size_t)tokens * H + 8, 0xbeef);
  cw.assign((size_t)tokens * K + 1, -3.0f);
  k_comb::HtCombineArgs a{};
  fill_common(a, w, me);
  a.x = (u64)x.data();
  a.topk_weights = K ? (u64)weights.data() : 0;
  a.bias0 = (u64)bias0;
  a.bias1 = (u64)bias1;
  a.combined_x = (u64)cx.data();
  a.combined_topk_weights = K ? (u64)cw.data() : 0;
  a.routing = (u64)h.routing.data();
  a.flags_offset = w.region.combine_flags();
  a.slab_offset = w.region.combine_slab();
  a.num_tokens = tokens;
  a.num_x_rows = x_rows;
  a.slab_rows = w.region.slab_rows(combine_row_bytes(H, K));
  a.flag_slots = w.region.flag_slots();
  u32 send = w.num_sms / 3;
  a.num_send_blocks = send < 1 ? 1 : (send > w.num_sms - 1 ? w.num_sms - 1 : send);
  a.send_chunk = EMU_SEND_CHUNK;
  a.recv_chunk = EMU_RECV_CHUNK;
  a.dynamic_send = EMU_DYNAMIC_SEND;
  a.trace = trace_buffer(1, me, w.num_sms, k_comb::TRACE_WORDS);
  // NUM_BIASES is a JIT constant: k_comb adds two biases, k_comb0 none (same argument layout).
  CHECK((bias0 == nullptr) == (bias1 == nullptr), "the harness passes both biases or none");
  if (bias0 != nullptr) {
    emu::launch(w.num_sms, k_comb::THREADS, [&] { k_comb::moelink::intranode::combine(a); });
  } else {
    static_assert(sizeof(k_comb0::HtCombineArgs) == sizeof(k_comb::HtCombineArgs), "one argument layout");
    k_comb0::HtCombineArgs a0;
    std::memcpy(&a0, &a, sizeof a);
    emu::launch(w.num_sms, k_comb0::THREADS, [&] { k_comb0::moelink::intranode::combine(a0); });
  }
  if (a.trace != 0) check_trace(1, me, w.num_sms, k_comb::TRACE_WORDS);
}

// ---------------------------------------------------------------------------------------------- references

struct Expected {
  std::vector<std::pair<u32, u32>> rows;  // (source rank, token) in receive order
  std::vector<u32> recv_count;            // per source
};

Expected expected_rows(const std::vector<RankInputs>& all, u32 me) {
  Expected e;
  e.recv_count.assign(R, 0);
  for (u32 s = 0; s < R; s++)
    for (u32 t = 0; t < all[s].t; t++)
      if (hits(all[s], t, me)) {
        e.rows.push_back({s, t});
        e.recv_count[s]++;
      }
  return e;
}

void check_layout(const Layout& l, const RankInputs& in, u32 me) {
  std::vector<i32> pr(R, 0), pe(E, 0);
  for (u32 t = 0; t < in.t; t++) {
    for (u32 r = 0; r < R; r++) {
      const bool hit = hits(in, t, r);
      pr[r] += hit;
      CHECK(l.in_rank[(size_t)t * R + r] == (u8)hit, "rank %u: is_token_in_rank[%u][%u]", me, t, r);
    }
    for (u32 k = 0; k < K; k++)
      if (in.topk_idx[(size_t)t * K + k] >= 0) pe[in.topk_idx[(size_t)t * K + k]]++;
  }
  CHECK(l.in_rank[(size_t)in.t * R] == 0xcc, "rank %u: is_token_in_rank written past its end", me);
  CHECK(l.per_rank == pr, "rank %u: num_tokens_per_rank", me);
  CHECK(l.per_expert == pe, "rank %u: num_tokens_per_expert", me);
}

void check_dispatch(const std::vector<RankInputs>& all, u32 me, const Handle& h, const Outputs& o) {
  const Expected e = expected_rows(all, me);
  const u32 n = (u32)e.rows.size();
  CHECK((u32)h.routing[k_notify::HT_RT_NUM_RECV] == n, "rank %u: N %d != %u", me, h.routing[k_notify::HT_RT_NUM_RECV], n);
  u32 off = 0;
  for (u32 s = 0; s < R; s++) {
    CHECK((u32)h.routing[k_notify::HT_RT_RECV_OFFSET + s] == off, "rank %u: recv_offset[%u]", me, s);
    CHECK((u32)h.routing[k_notify::HT_RT_RECV_COUNT + s] == e.recv_count[s], "rank %u: recv_count[%u]", me, s);
    off += e.recv_count[s];
  }
  // DeepEP's rank_prefix_matrix: [i][j] = tokens rank j receives from ranks 0..=i, from every rank's routing.
  for (u32 j = 0; j < R; j++) {
    u32 received = 0;
    for (u32 i = 0; i < R; i++) {
      for (u32 t = 0; t < all[i].t; t++) received += hits(all[i], t, j) ? 1u : 0u;
      const i32 got = h.routing[k_notify::HT_RT_RANK_PREFIX + i * R + j];
      CHECK(got == (i32)received, "rank %u: rank_prefix_matrix[%u][%u] = %d, want %u", me, i, j, got, received);
    }
  }
  const u32 rb = H * (F8 ? 1 : 2);
  for (u32 i = 0; i < n && i < o.rows; i++) {
    const auto [s, t] = e.rows[i];
    const RankInputs& src = all[s];
    CHECK(std::memcmp(&o.x[(size_t)i * rb], &src.x[(size_t)t * rb], rb) == 0, "rank %u: payload of row %u (rank %u token %u)", me, i, s, t);
    for (u32 g = 0; g < SCALES; g++)
      CHECK(o.scales[(size_t)i * SCALES + g] == src.scales[(size_t)g * src.t + t], "rank %u: scale %u of row %u", me, g, i);
    for (u32 k = 0; k < K; k++) {
      const i64 ge = src.topk_idx[(size_t)t * K + k];
      const i64 local = ge >= (i64)(me * EL) && ge < (i64)((me + 1) * EL) ? ge - me * EL : -1;
      CHECK(o.idx[(size_t)i * K + k] == local, "rank %u: topk_idx[%u][%u] = %lld, want %lld", me, i, k, o.idx[(size_t)i * K + k], local);
      const float wv = local >= 0 ? src.topk_w[(size_t)t * K + k] : 0.0f;
      CHECK(std::memcmp(&o.w[(size_t)i * K + k], &wv, 4) == 0, "rank %u: weight[%u][%u]", me, i, k);
    }
    CHECK(h.src_idx[i] == (i32)t, "rank %u: src_idx[%u] = %d, want %u", me, i, h.src_idx[i], t);
  }
  // No-sync tails.
  for (u32 i = n; i < o.rows; i++)
    for (u32 k = 0; k < K; k++) {
      CHECK(o.idx[(size_t)i * K + k] == -1, "rank %u: tail row %u topk_idx", me, i);
      CHECK(o.w[(size_t)i * K + k] == 0.0f, "rank %u: tail row %u weight", me, i);
    }
  // DeepEP's channel elements: each token's slot among the tokens sent to r (-1: not sent), and the channel
  // matrices with every token in the last channel.
  const RankInputs& mine = all[me];
  for (u32 r = 0; r < R; r++) {
    i32 slot = 0;
    for (u32 t = 0; t < mine.t; t++) {
      const i32 want = hits(mine, t, r) ? slot++ : -1;
      CHECK(o.send_head[(size_t)t * R + r] == want, "rank %u: send_head[%u][%u] = %d, want %d", me, t, r, o.send_head[(size_t)t * R + r], want);
    }
    for (u32 c = 0; c < EMU_CHANNELS; c++) {
      const i32 want = c == EMU_CHANNELS - 1 ? slot : 0;
      CHECK(o.channel_prefix[r * EMU_CHANNELS + c] == want, "rank %u: channel_prefix_matrix[%u][%u] = %d, want %d", me, r, c,
            o.channel_prefix[r * EMU_CHANNELS + c], want);
      CHECK(o.recv_channel_prefix[r * EMU_CHANNELS + c] == 0, "rank %u: recv_channel_prefix_matrix[%u][%u] = %d", me, r, c,
            o.recv_channel_prefix[r * EMU_CHANNELS + c]);
    }
  }
  // Nothing written past the outputs.
  CHECK(o.x[(size_t)o.rows * rb] == 0xab && o.idx[(size_t)o.rows * K] == 12345, "rank %u: outputs written past their rows", me);
  CHECK(o.send_head[(size_t)mine.t * R] == -9 && o.channel_prefix[R * EMU_CHANNELS] == -9 && o.recv_channel_prefix[R * EMU_CHANNELS] == -9,
        "rank %u: channel elements written past their end", me);
}

// Expert output of rank `expert` for (source, token): order-sensitive bf16 values.
u16 expert_value(u32 expert, u32 src, u32 t, u32 c) {
  Rng r(((u64)expert << 48) ^ ((u64)src << 40) ^ ((u64)t << 20) ^ c);
  return random_bf16(r);
}

// ---------------------------------------------------------------------------------------------- scenarios

u64 signature() { return ((u64)H) | ((u64)E << 24) | ((u64)K << 44) | ((u64)F8 << 56) | ((u64)(K > 0) << 57); }

// Fresh dispatch, combine (weights, two biases), cached dispatch, a second fresh dispatch with other routing
// and its combine, in one world (epochs advance, slabs are handed back, row layouts change between calls).
void scenario_full(bool sync, u32 tokens, Route route, u32 sms, u32 worst_extra) {
  World w((size_t)64 << 20, sms, 20'000'000'000ull);
  for (u32 round = 0; round < 2; round++) {
    std::vector<RankInputs> all;
    for (u32 r = 0; r < R; r++) all.push_back(make_inputs(r, tokens > r % 2 ? tokens - r % 2 : 0, round == 0 ? route : Route::Uniform, 17 + round));
    std::vector<Layout> layouts(R);
    std::vector<Handle> handles(R);
    std::vector<Outputs> outs(R);
    const u32 worst = tokens * R + worst_extra;
    per_rank([&](u32 me) {
      layouts[me] = run_layout(w, me, all[me]);
      check_layout(layouts[me], all[me], me);
      const bool ok = run_notify(w, me, all[me], layouts[me], handles[me], sync, 1 + round, dispatch_row_bytes(H, F8, K), signature() | ((u64)!sync << 58));
      CHECK(ok, "rank %u: notify status %d", me, handles[me].routing[0]);
      const u32 rows = sync ? handles[me].num_recv : worst;
      run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], rows);
    });
    for (u32 me = 0; me < R; me++) {
      CHECK(w.ranks[me].record->code == 0, "rank %u: error record code %u (peer %u phase %u)", me, w.ranks[me].record->code, w.ranks[me].record->peer,
            w.ranks[me].record->phase);
      check_dispatch(all, me, handles[me], outs[me]);
    }
    // Combine: every expert rank returns expert_value(rank, src, t, c) for each received row.
    std::vector<std::vector<u16>> cx(R);
    std::vector<std::vector<float>> cw(R);
    std::vector<std::vector<u16>> bias0(R), bias1(R);
    for (u32 r = 0; r < R; r++) {
      Rng rng(99 + r);
      bias0[r].resize((size_t)all[r].t * H + 8);
      bias1[r].resize((size_t)all[r].t * H + 8);
      for (auto& v : bias0[r]) v = random_bf16(rng);
      for (auto& v : bias1[r]) v = random_bf16(rng);
    }
    per_rank([&](u32 me) {
      const Expected e = expected_rows(all, me);
      const u32 rows = outs[me].rows;
      std::vector<u16> x((size_t)rows * H + 8, 0);
      for (u32 i = 0; i < e.rows.size() && i < rows; i++)
        for (u32 c = 0; c < H; c++) x[(size_t)i * H + c] = expert_value(me, e.rows[i].first, e.rows[i].second, c);
      const bool biases = round == 0;
      run_combine(w, me, all[me].t, handles[me], x, outs[me].w, biases ? bias0[me].data() : nullptr, biases ? bias1[me].data() : nullptr, cx[me], cw[me], rows);
    });
    for (u32 me = 0; me < R; me++) {
      CHECK(w.ranks[me].record->code == 0, "rank %u: error record code %u after combine", me, w.ranks[me].record->code);
      const RankInputs& in = all[me];
      for (u32 t = 0; t < in.t; t++) {
        for (u32 c = 0; c < H; c++) {
          float v[R];
          for (u32 r = 0; r < R; r++) v[r] = hits(in, t, r) ? bf16_to_f32(expert_value(r, me, t, c)) : 0.0f;
          float acc = combine_sum(v);
          if (round == 0) {
            acc = acc + bf16_to_f32(bias0[me][(size_t)t * H + c]);
            acc = acc + bf16_to_f32(bias1[me][(size_t)t * H + c]);
          }
          const u16 want = f32_to_bf16(acc);
          CHECK(cx[me][(size_t)t * H + c] == want, "rank %u: combined[%u][%u] = %#x, want %#x", me, t, c, cx[me][(size_t)t * H + c], want);
        }
        for (u32 k = 0; k < K; k++) {
          const float want = in.topk_idx[(size_t)t * K + k] >= 0 ? in.topk_w[(size_t)t * K + k] : 0.0f;
          CHECK(std::memcmp(&cw[me][(size_t)t * K + k], &want, 4) == 0, "rank %u: combined weight[%u][%u] = %g want %g", me, t, k,
                cw[me][(size_t)t * K + k], want);
        }
      }
      CHECK(cx[me][(size_t)in.t * H] == 0xbeef, "rank %u: combined_x written past its end", me);
    }
    // Cached dispatch of y (bf16, no top-k): the same rows, from y.
    std::vector<std::vector<u16>> cached(R);
    per_rank([&](u32 me) { run_cached(w, me, all[me], handles[me], cached[me], outs[me].rows); });
    for (u32 me = 0; me < R; me++) {
      CHECK(w.ranks[me].record->code == 0, "rank %u: error record code %u after cached dispatch", me, w.ranks[me].record->code);
      const Expected e = expected_rows(all, me);
      for (u32 i = 0; i < e.rows.size(); i++)
        CHECK(std::memcmp(&cached[me][(size_t)i * H], &all[e.rows[i].first].y[(size_t)e.rows[i].second * H], 2 * H) == 0,
              "rank %u: cached row %u", me, i);
    }
  }
}

// Back-to-back calls with no host synchronisation between ranks: every rank runs fresh dispatch, then
// several cached dispatches and combines of different payloads in a row, so a fast rank writes the next
// call into a slow peer's slab while the peer may still be copying out the previous one — the consumed
// hand-back must hold it back.
void scenario_back_to_back() {
  World w((size_t)32 << 20, 4, 20'000'000'000ull);
  std::vector<RankInputs> all;
  for (u32 r = 0; r < R; r++) all.push_back(make_inputs(r, 41, Route::Holes, 23));
  constexpr u32 kCalls = 4;
  std::vector<Layout> layouts(R);
  std::vector<Handle> handles(R);
  std::vector<Outputs> outs(R);
  std::vector<std::vector<std::vector<u16>>> cached(R, std::vector<std::vector<u16>>(kCalls));
  std::vector<std::vector<std::vector<u16>>> combined(R, std::vector<std::vector<u16>>(kCalls));
  std::vector<std::vector<RankInputs>> payloads(kCalls);
  for (u32 c = 0; c < kCalls; c++)
    for (u32 r = 0; r < R; r++) payloads[c].push_back(make_inputs(r, 41, Route::Holes, 23));
  for (u32 c = 0; c < kCalls; c++)
    for (u32 r = 0; r < R; r++) {
      Rng rng(1000 + 10 * c + r);
      for (auto& v : payloads[c][r].y) v = random_bf16(rng);
    }
  per_rank([&](u32 me) {
    emu::t_slow_us = me == 0 ? 200 : 0;
    layouts[me] = run_layout(w, me, all[me]);
    run_notify(w, me, all[me], layouts[me], handles[me], true, 1, dispatch_row_bytes(H, F8, K), signature());
    run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], handles[me].num_recv);
    const u32 rows = handles[me].num_recv;
    std::vector<float> cw;
    // Dispatches back to back, then combines back to back (a combine between two dispatches would order
    // them through its own data dependencies; this way only the hand-back flags do).
    for (u32 c = 0; c < kCalls; c++) run_cached(w, me, payloads[c][me], handles[me], cached[me][c], rows);
    for (u32 c = 0; c < kCalls; c++) {
      // Combine what arrived (as expert outputs; weights: the dispatched ones).
      std::vector<u16> x((size_t)rows * H + 8, 0);
      std::memcpy(x.data(), cached[me][c].data(), (size_t)rows * H * 2);
      run_combine(w, me, all[me].t, handles[me], x, outs[me].w, nullptr, nullptr, combined[me][c], cw, rows);
    }
  });
  for (u32 me = 0; me < R; me++) {
    CHECK(w.ranks[me].record->code == 0, "rank %u: record code %u", me, w.ranks[me].record->code);
    const Expected e = expected_rows(all, me);
    for (u32 c = 0; c < kCalls; c++) {
      for (u32 i = 0; i < e.rows.size(); i++)
        CHECK(std::memcmp(&cached[me][c][(size_t)i * H], &payloads[c][e.rows[i].first].y[(size_t)e.rows[i].second * H], 2 * H) == 0,
              "rank %u: call %u row %u", me, c, i);
      // combined[t] = the tree sum over ranks the token went to of y[t] (its own row, sent out and back).
      for (u32 t = 0; t < all[me].t; t++)
        for (u32 ch = 0; ch < H; ch++) {
          float v[R];
          for (u32 r = 0; r < R; r++) v[r] = hits(all[me], t, r) ? bf16_to_f32(payloads[c][me].y[(size_t)t * H + ch]) : 0.0f;
          const float acc = combine_sum(v);
          CHECK(combined[me][c][(size_t)t * H + ch] == f32_to_bf16(acc), "rank %u: call %u combined[%u][%u]", me, c, t, ch);
        }
    }
  }
}

// No-sync dispatch into too few rows: the overflowing rank reports ERR_RECV_OVERFLOW, writes nothing past its
// outputs, and nobody hangs; the next call works.
void scenario_overflow() {
  World w((size_t)16 << 20, 4, 20'000'000'000ull);
  std::vector<RankInputs> all;
  for (u32 r = 0; r < R; r++) all.push_back(make_inputs(r, 24, Route::Uniform, 5));
  std::vector<Layout> layouts(R);
  std::vector<Handle> handles(R);
  std::vector<Outputs> outs(R);
  per_rank([&](u32 me) {
    layouts[me] = run_layout(w, me, all[me]);
    run_notify(w, me, all[me], layouts[me], handles[me], false, 0, dispatch_row_bytes(H, F8, K), signature() | (1ull << 58));
    run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], 3);
  });
  for (u32 me = 0; me < R; me++) {
    const u32 n = (u32)expected_rows(all, me).rows.size();
    if (n > 3) {
      CHECK(w.ranks[me].record->code == 6, "rank %u: overflow not reported (code %u)", me, w.ranks[me].record->code);
      CHECK(w.ranks[me].record->d0 == n && w.ranks[me].record->d1 == 3, "rank %u: overflow details", me);
    }
    check_dispatch(all, me, handles[me], outs[me]);
    w.clear_errors(me);
  }
}

// num_nvl_bytes too small for T_max: every rank's notify reports ERR_BUFFER_TOO_SMALL with the same status,
// the dispatch kernels return at once (no epoch advances), and a later call that fits works.
void scenario_too_small() {
  const size_t row = dispatch_row_bytes(H, F8, K);
  World w(R * 1024 * 8 + 2 * R * 8 * row, 4, 20'000'000'000ull);  // room for about 8 rows per source
  std::vector<RankInputs> big, small;
  for (u32 r = 0; r < R; r++) {
    big.push_back(make_inputs(r, r == R - 1 ? 40 : 4, Route::Uniform, 7));
    small.push_back(make_inputs(r, 5, Route::Uniform, 8));
  }
  std::vector<Layout> layouts(R);
  std::vector<Handle> handles(R);
  std::vector<Outputs> outs(R);
  per_rank([&](u32 me) {
    layouts[me] = run_layout(w, me, big[me]);
    const bool ok = run_notify(w, me, big[me], layouts[me], handles[me], false, 0, row, signature() | (1ull << 58));
    CHECK(!ok, "rank %u: a call that does not fit was accepted", me);
    run_dispatch(w, me, big[me], layouts[me], handles[me], outs[me], 40 * R);
  });
  for (u32 me = 0; me < R; me++) {
    CHECK(handles[me].routing[0] == 4, "rank %u: status %d, want TOO_SMALL", me, handles[me].routing[0]);
    CHECK(w.ranks[me].record->code == 5 && w.ranks[me].record->d0 == 40, "rank %u: too-small record (code %u, d0 %llu)", me,
          w.ranks[me].record->code, w.ranks[me].record->d0);
    CHECK(*(u32*)(w.ranks[me].ctrl + 4) == 0, "rank %u: a skipped dispatch advanced the epoch", me);
    CHECK(outs[me].x[0] == 0xab, "rank %u: a skipped dispatch wrote outputs", me);
    w.clear_errors(me);
  }
  per_rank([&](u32 me) {
    layouts[me] = run_layout(w, me, small[me]);
    CHECK(run_notify(w, me, small[me], layouts[me], handles[me], true, 5, row, signature()), "rank %u: small call refused", me);
    run_dispatch(w, me, small[me], layouts[me], handles[me], outs[me], handles[me].num_recv);
  });
  for (u32 me = 0; me < R; me++) {
    CHECK(w.ranks[me].record->code == 0, "rank %u: record after the fitting call", me);
    check_dispatch(small, me, handles[me], outs[me]);
  }
}

// Rank R-1 never shows up: every other rank's notify gives up after the deadline with a timeout record naming
// it, and the dispatch launched behind it (no-sync) returns at once.
void scenario_timeout() {
  if (R < 2) return;
  World w((size_t)16 << 20, 4, 300'000'000ull);
  std::vector<RankInputs> all;
  for (u32 r = 0; r < R; r++) all.push_back(make_inputs(r, 8, Route::Uniform, 9));
  std::vector<Layout> layouts(R);
  std::vector<Handle> handles(R);
  std::vector<Outputs> outs(R);
  const auto start = std::chrono::steady_clock::now();
  per_rank([&](u32 me) {
    if (me == R - 1) return;
    layouts[me] = run_layout(w, me, all[me]);
    CHECK(!run_notify(w, me, all[me], layouts[me], handles[me], false, 0, dispatch_row_bytes(H, F8, K), signature() | (1ull << 58)),
          "rank %u: notify succeeded without a peer", me);
    run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], 8 * R);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (u32 me = 0; me + 1 < R; me++) {
    CHECK(w.ranks[me].record->code == 1 && w.ranks[me].record->peer == R - 1, "rank %u: timeout record code %u peer %u", me,
          w.ranks[me].record->code, w.ranks[me].record->peer);
    CHECK(handles[me].routing[0] == 8, "rank %u: status %d, want FAILED", me, handles[me].routing[0]);
    for (u32 i = 0; i < R * R; i++)
      CHECK(handles[me].routing[k_notify::HT_RT_RANK_PREFIX + i] == 0, "rank %u: rank_prefix_matrix word %u after a failed exchange", me, i);
  }
  CHECK(secs < 10.0, "timeouts took %.1f s", secs);
}

// An invalid topk_idx: the layout kernel reports ERR_INVALID_TOPK with the entry, treats it as -1.
void scenario_invalid_topk() {
  if (K == 0) return;
  World w((size_t)4 << 20, 2, 1'000'000'000ull);
  RankInputs in = make_inputs(0, 6, Route::Uniform, 3);
  in.topk_idx[2 * K + (K - 1)] = E + 5;
  Layout l = run_layout(w, 0, in);
  CHECK(w.ranks[0].record->code == 2, "invalid topk not reported (code %u)", w.ranks[0].record->code);
  CHECK(w.ranks[0].record->d0 == ((2ull << 32) | (K - 1)) && (i64)w.ranks[0].record->d1 == (i64)(E + 5), "invalid topk details %llx %llx",
        w.ranks[0].record->d0, w.ranks[0].record->d1);
  in.topk_idx[2 * K + (K - 1)] = -1;
  check_layout(l, in, 0);
}

// Layout tensors that disagree. (a) Rank 0 sends nothing (is_token_in_rank all false, num_tokens_per_rank 0)
// but its num_tokens_per_expert still counts tokens: every rank's notify agrees on BAD_EXPERTS and reports
// ERR_INVALID_LAYOUT / LAYOUT_ARG_PER_EXPERT naming rank 0, and the dispatch launched behind it moves nothing.
// (b) Rank 0 does not send a token to a remote rank where one of its experts lives (its is_token_in_rank and
// num_tokens_per_rank agree, so the notify passes): rank 0's dispatch reports LAYOUT_ARG_IN_RANK with that
// token, that rank's LAYOUT_ARG_RECV_EXPERT_TOKENS (a row fewer than the counts say), the others no error.
void scenario_bad_layout() {
  if (R < 2 || K == 0) return;
  World w((size_t)16 << 20, 4, 20'000'000'000ull);
  std::vector<RankInputs> all;
  for (u32 r = 0; r < R; r++) all.push_back(make_inputs(r, 12, Route::Uniform, 11));
  std::vector<Layout> layouts(R);
  std::vector<Handle> handles(R);
  std::vector<Outputs> outs(R);
  per_rank([&](u32 me) {
    layouts[me] = run_layout(w, me, all[me]);
    if (me == 0) {
      std::fill(layouts[0].in_rank.begin(), layouts[0].in_rank.end() - 1, (u8)0);
      std::fill(layouts[0].per_rank.begin(), layouts[0].per_rank.end(), 0);
    }
    CHECK(!run_notify(w, me, all[me], layouts[me], handles[me], true, 1, dispatch_row_bytes(H, F8, K), signature()),
          "rank %u: a per-expert count without tokens was accepted", me);
    run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], 12 * R);
  });
  for (u32 me = 0; me < R; me++) {
    const ErrorRec& rec = *w.ranks[me].record;
    CHECK(handles[me].routing[0] == 16, "rank %u: status %d, want BAD_EXPERTS", me, handles[me].routing[0]);
    CHECK(rec.code == 3 && rec.peer == 0 && rec.d0 == 1, "rank %u: record code %u peer %u d0 %llu", me, rec.code, rec.peer, rec.d0);
    CHECK(outs[me].x[0] == 0xab, "rank %u: a refused dispatch wrote outputs", me);
    w.clear_errors(me);
  }
  // (b): the first token of rank 0 that goes to a remote rank r receiving at least two of its tokens.
  u32 bad_t = 0, bad_r = 0;
  per_rank([&](u32 me) { layouts[me] = run_layout(w, me, all[me]); });
  for (u32 t = 0; t < all[0].t && bad_r == 0; t++)
    for (u32 r = 1; r < R && bad_r == 0; r++)
      if (layouts[0].in_rank[(size_t)t * R + r] != 0 && layouts[0].per_rank[r] >= 2) {
        bad_t = t;
        bad_r = r;
      }
  CHECK(bad_r != 0, "no token of rank 0 to drop");
  layouts[0].in_rank[(size_t)bad_t * R + bad_r] = 0;
  layouts[0].per_rank[bad_r] -= 1;
  per_rank([&](u32 me) {
    CHECK(run_notify(w, me, all[me], layouts[me], handles[me], true, 2, dispatch_row_bytes(H, F8, K), signature()),
          "rank %u: notify refused a layout whose counts agree", me);
    run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], handles[me].num_recv);
  });
  // Rank bad_r's receivers count one row less for an expert than the sources' counts say: LAYOUT_ARG_RECV_EXPERT_TOKENS.
  for (u32 me = 0; me < R; me++) {
    const ErrorRec& rec = *w.ranks[me].record;
    if (me == 0)
      CHECK(rec.code == 3 && rec.peer == 0 && rec.d0 == 2 && rec.d1 == bad_t, "rank 0: record code %u peer %u d0 %llu d1 %llu (token %u)",
            rec.code, rec.peer, rec.d0, rec.d1, bad_t);
    else if (me == bad_r)
      CHECK(rec.code == 3 && rec.peer == me && rec.d0 == 4, "rank %u (missing a row): record code %u peer %u d0 %llu", me, rec.code, rec.peer, rec.d0);
    else
      CHECK(rec.code == 0, "rank %u: record code %u after another rank's bad layout", me, rec.code);
    w.clear_errors(me);
  }
  // (c): rank 0's num_tokens_per_expert 5 too high for an expert of rank 1 that its tokens select (the sums
  // per rank still pass notify): rank 0's dispatch reports LAYOUT_ARG_EXPERT_TOKENS with the expert and the
  // true count, rank 1's LAYOUT_ARG_RECV_EXPERT_TOKENS with its local expert 0 and the rows that arrived for it
  // (5 fewer than notify summed). (d): the same layouts again, right: no error anywhere (the counts start from
  // 0 each call). (e): right layouts, but a later notify rewrote the host words before the dispatch started
  // (another READY, other sums): the receivers do not check against words of another call, so no error.
  const u32 bad_e = E / R;
  for (int round = 0; round < 3; round++) {
    per_rank([&](u32 me) { layouts[me] = run_layout(w, me, all[me]); });
    const i32 true_count = layouts[0].per_expert[bad_e];
    if (round == 0) layouts[0].per_expert[bad_e] += 5;
    per_rank([&](u32 me) {
      CHECK(run_notify(w, me, all[me], layouts[me], handles[me], true, 3 + round, dispatch_row_bytes(H, F8, K), signature()),
            "rank %u: notify refused per-expert counts whose sums agree", me);
      run_dispatch(w, me, all[me], layouts[me], handles[me], outs[me], handles[me].num_recv, round == 2);
    });
    for (u32 me = 0; me < R; me++) {
      const ErrorRec& rec = *w.ranks[me].record;
      if (me == 0 && round == 0)
        CHECK(rec.code == 3 && rec.peer == 0 && rec.d0 == 3 && rec.d1 == (((u64)bad_e << 32) | (u32)true_count),
              "rank 0: record code %u peer %u d0 %llu d1 %llx (expert %u, %d tokens)", rec.code, rec.peer, rec.d0, rec.d1, bad_e,
              true_count);
      else if (me == 1 && round == 0)
        CHECK(rec.code == 3 && rec.peer == 1 && rec.d0 == 4 && (rec.d1 >> 32) == 0 &&
                  (u32)rec.d1 + 5 == w.ranks[1].host_notify[k_notify::HT_HN_PER_EXPERT],
              "rank 1: record code %u peer %u d0 %llu d1 %llx (notify summed %u)", rec.code, rec.peer, rec.d0, rec.d1,
              w.ranks[1].host_notify[k_notify::HT_HN_PER_EXPERT]);
      else
        CHECK(rec.code == 0, "rank %u, round %d: record code %u d0 %llu d1 %llx", me, round, rec.code, rec.d0, rec.d1);
      w.clear_errors(me);
    }
  }
}

}  // namespace h

int main(int argc, char** argv) {
  const std::string s = argc > 1 ? argv[1] : "all";
  const auto run = [&](const char* name, auto f) {
    if (s != "all" && s != name) return;
    const auto t0 = std::chrono::steady_clock::now();
    const int before = h::g_failures;
    f();
    std::printf("%s %s (%.2f s)\n", h::g_failures == before ? "PASS" : "FAIL", name,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  };
  run("sync", [] { h::scenario_full(true, 37, h::Route::Holes, 4, 0); });
  run("sync_skewed_2sms", [] { h::scenario_full(true, 29, h::Route::Skewed, 2, 0); });
  run("trace", [] {
    h::g_trace_on = true;
    h::scenario_full(true, 21, h::Route::Uniform, 3, 0);
    h::g_trace_on = false;
  });
  run("nosync", [] { h::scenario_full(false, 33, h::Route::EmptyLast, 6, 5); });
  run("zero_tokens", [] { h::scenario_full(true, 0, h::Route::Uniform, 2, 0); });
  run("back_to_back", [] { h::scenario_back_to_back(); });
  run("overflow", [] { h::scenario_overflow(); });
  run("too_small", [] { h::scenario_too_small(); });
  run("invalid_topk", [] { h::scenario_invalid_topk(); });
  run("bad_layout", [] { h::scenario_bad_layout(); });
  run("timeout", [] { h::scenario_timeout(); });
  return h::g_failures == 0 ? 0 : 1;
}
