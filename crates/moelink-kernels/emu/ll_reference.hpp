// The documented semantics of the low-latency operations, for the emulation harnesses (ll_emu.cpp: the
// single-node kernels; lli_emu.cpp: the kernels across nodes): inputs, what a rank must receive (rows,
// scales, counts, DeepEP's handle tensors), expert outputs, and the combined result bit for bit. Written
// from crates/moelink/src/ll.rs and docs/oracle.md, not from the kernels. Needs runtime.hpp, ptx.cuh and
// ll.cuh included first (it uses their types and LL_* constants).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

// ============================================================================================ helpers
#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      std::fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                 \
      std::fprintf(stderr, "\n");                        \
      std::exit(1);                                      \
    }                                                    \
  } while (0)

static float bf16_to_f32(u16 b) { return __uint_as_float((u32)b << 16); }
static u16 f32_to_bf16(float f) { return ptx::cvt_rn_bf16_f32(f); }
static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

static float e4m3_to_f32(u8 b) {
  const bool neg = b & 0x80;
  const int exp = (b >> 3) & 0xf, man = b & 7;
  float m;
  if (exp == 0xf && man == 7) m = NAN;
  else if (exp == 0) m = man * std::ldexp(1.0f, -9);
  else m = (8 + man) * std::ldexp(1.0f, exp - 10);
  return neg ? -m : m;
}

// fp8::quantize_token, written from the documented rule (not from the kernel's lane decomposition).
static void quantize_token(const u16* x, bool round_scale, u8* q, float* scale_inv) {
  for (u32 g = 0; g < LL_HIDDEN / 128; g++) {
    float amax = 0.0f;
    for (u32 c = 0; c < 128; c++) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[g * 128 + c])));
    amax = std::fmax(amax, 1e-4f);
    float scale, inv;
    if (round_scale) {
      // ceil(log2(q)) from frexp: q = m * 2^x with m in [0.5, 1); exact powers of two have m == 0.5.
      int x;
      const float m = std::frexp(amax / 448.0f, &x);
      const int e = m == 0.5f ? x - 1 : x;
      scale = std::ldexp(1.0f, -e);
      inv = std::ldexp(1.0f, e);
    } else {
      scale = 448.0f / amax;
      inv = amax / 448.0f;
    }
    scale_inv[g] = inv;
    for (u32 c = 0; c < 128; c++) q[g * 128 + c] = ptx::e4m3_rn_satfinite(bf16_to_f32(x[g * 128 + c]) * scale);
  }
}

// ============================================================================================ the world
struct Shape {
  u32 ranks, experts, t_max;
  std::vector<u32> tokens;
  u32 el() const { return experts / ranks; }
  u32 rows() const { return ranks * t_max; }
};

struct Inputs {
  std::vector<u16> x;    // bf16 [T, H]
  std::vector<i64> idx;  // [T, K]
  std::vector<float> w;  // [T, K]
};

// Outputs of one dispatch on one rank (caller-owned, like the Rust API's).
struct DispatchOut {
  std::vector<u8> recv_x;
  std::vector<u32> scales;
  std::vector<i32> count, cum;
  std::vector<i64> wait;
  std::vector<i32> src_info;      // DeepEP's handle: [E_local][rows]
  std::vector<i64> layout_range;  // [E_local][R]
  u32 set = 0;
};

struct Quant {
  bool fp8, round_scale, ue8m0;
};

// What the references need of a world: its shape and its payload format.
struct RefWorld {
  Shape s;
  Quant q;
  RefWorld(Shape shape, Quant quant) : s(shape), q(quant) {}
  u32 cols() const { return !q.fp8 ? 0 : q.ue8m0 ? LL_HIDDEN / 512 : LL_HIDDEN / 128; }
  u32 row_bytes() const { return q.fp8 ? LL_HIDDEN : 2 * LL_HIDDEN; }
};

static Inputs make_inputs(const RefWorld& w, u32 rank, u32 seed, u32 holes_every = 4, bool cancel = false) {
  std::mt19937_64 rng(seed * 7919u + rank);
  Inputs in;
  const u32 T = w.s.tokens[rank];
  std::normal_distribution<float> normal;
  in.x.resize((size_t)T * LL_HIDDEN);
  for (size_t i = 0; i < in.x.size(); i++) {
    const u32 t = (u32)(i / LL_HIDDEN), g = (u32)(i % LL_HIDDEN) / 128;
    const bool zero_group = (t + 3 * g + rank) % 11 == 10;
    in.x[i] = zero_group ? 0 : f32_to_bf16(normal(rng) * std::ldexp(1.0f, (int)((t * 7 + g * 3) % 11) - 5));
  }
  // Some groups get an amax of exactly 7 * 2^k, so that amax / 448 is a power of two (round_scale's
  // exact case) and the largest value maps to 448 itself.
  for (u32 t = 0; t < T; t++)
    for (u32 g = 0; g < LL_HIDDEN / 128; g++)
      if ((t + g + rank) % 4 == 1) {
        const float v = std::ldexp(7.0f, (int)((t * 7 + g * 3) % 11) - 5 + 2);
        in.x[(size_t)t * LL_HIDDEN + g * 128 + (t * 13 + g * 7) % 128] = f32_to_bf16((t + g) % 2 ? v : -v);
      }
  in.idx.resize((size_t)T * LL_TOPK);
  in.w.resize((size_t)T * LL_TOPK);
  std::vector<u32> perm(w.s.experts);
  for (u32 t = 0; t < T; t++) {
    for (u32 e = 0; e < w.s.experts; e++) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    // Cancellation on EP2: every token selects experts 0, 1, 2 of rank 0 (+B, -B, tiny) and otherwise tiny
    // ones (e % 3 == 2, on both ranks), in an order that rotates with the token, so that the order inside a
    // pre-reduced partial decides whether the tiny terms survive.
    u32 picks[LL_TOPK];
    for (u32 k = 0, e = 0; k < LL_TOPK; e++) {
      if (e < 3 || e % 3 == 2) picks[k++] = e;
    }
    for (u32 k = 0; k < LL_TOPK; k++) {
      const bool hole = holes_every != 0 && rng() % holes_every == 0;
      in.idx[t * LL_TOPK + k] = (k < w.s.experts && !hole) ? (i64)perm[k] : -1;
      if (cancel && w.s.ranks == 2) in.idx[t * LL_TOPK + k] = (i64)picks[(k + t) % LL_TOPK];
      // With `cancel`, equal weights whose products with the experts' values need rounding (see expert_outputs).
      in.w[t * LL_TOPK + k] = cancel ? 0.5f + std::ldexp(1.0f, -20) : (float)(rng() % 1000) / 997.0f + 0.01f;
    }
  }
  return in;
}

// What each rank's experts see: the sent payload of (src, t) as the kernel must have written it.
struct Sent {
  std::vector<u8> bytes;
  std::vector<float> inv;
};
static Sent sent_row(const RefWorld& w, const Inputs& in, u32 t) {
  Sent s;
  const u16* x = in.x.data() + (size_t)t * LL_HIDDEN;
  if (w.q.fp8) {
    s.bytes.resize(LL_HIDDEN);
    s.inv.resize(LL_HIDDEN / 128);
    quantize_token(x, w.q.round_scale, s.bytes.data(), s.inv.data());
  } else {
    s.bytes.resize(2 * LL_HIDDEN);
    std::memcpy(s.bytes.data(), x, s.bytes.size());
  }
  return s;
}

static u32 rank_of(const RefWorld& w, i64 e) { return (u32)(e / w.s.el()); }

// Checks recv_count, every valid row and its scales of rank `me` against the routing (masked sources
// dropped). Returns the expected (src, t) of each row per local expert.
static std::vector<std::vector<std::pair<u32, u32>>> check_dispatch(const RefWorld& w, u32 me, const std::vector<Inputs>& all,
                                                                      const DispatchOut& o, const std::vector<bool>& masked,
                                                                      const char* what) {
  std::vector<std::vector<std::pair<u32, u32>>> rows(w.s.el());
  for (u32 el = 0; el < w.s.el(); el++) {
    const i64 e = (i64)me * w.s.el() + el;
    for (u32 src = 0; src < w.s.ranks; src++) {
      if (masked[src]) continue;
      for (u32 t = 0; t < w.s.tokens[src]; t++) {
        const i64* row = all[src].idx.data() + (size_t)t * LL_TOPK;
        if (std::find(row, row + LL_TOPK, e) != row + LL_TOPK) rows[el].push_back({src, t});
      }
    }
    CHECK(o.count[el] == (i32)rows[el].size(), "%s: rank %u expert %u recv_count %d, expected %zu", what, me, el, o.count[el], rows[el].size());
    // DeepEP's layout_range: begin << 32 | count of each source's rows (dropped sources count 0).
    u64 begin = 0;
    for (u32 src = 0; src < w.s.ranks; src++) {
      u64 n = 0;
      for (const auto& row : rows[el]) n += row.first == src ? 1u : 0u;
      const i64 want = (i64)((begin << 32) | n);
      CHECK(o.layout_range[(size_t)el * w.s.ranks + src] == want, "%s: rank %u layout_range[%u][%u] = %#llx, expected %#llx", what, me, el,
            src, (unsigned long long)o.layout_range[(size_t)el * w.s.ranks + src], (unsigned long long)want);
      begin += n;
    }
    for (u32 slot = 0; slot < rows[el].size(); slot++) {
      const auto [src, t] = rows[el][slot];
      CHECK(o.src_info[(size_t)el * w.s.rows() + slot] == (i32)t, "%s: rank %u src_info[%u][%u] = %d, expected token %u", what, me, el, slot,
            o.src_info[(size_t)el * w.s.rows() + slot], t);
      const Sent s = sent_row(w, all[src], t);
      const u8* got = o.recv_x.data() + ((size_t)el * w.s.rows() + slot) * w.row_bytes();
      CHECK(std::memcmp(got, s.bytes.data(), s.bytes.size()) == 0, "%s: rank %u expert %u row %u should be token %u of rank %u", what, me,
            el, slot, t, src);
      if (w.q.fp8) {
        const u32 cols = w.cols();
        for (u32 col = 0; col < cols; col++) {
          const u32 got_s = o.scales[((size_t)el * cols + col) * w.s.rows() + slot];
          u32 want;
          if (w.q.ue8m0) {
            want = 0;
            for (u32 i = 0; i < 4; i++) want |= ((__float_as_uint(s.inv[4 * col + i]) >> 23) & 0xffu) << (8 * i);
          } else {
            want = __float_as_uint(s.inv[col]);
          }
          CHECK(got_s == want, "%s: rank %u scale (%u, %u, %u) = %#x, expected %#x", what, me, el, slot, col, got_s, want);
        }
      }
    }
  }
  return rows;
}

// Expert outputs y [E_local][rows][H] from what the rank received: bf16(dequantised * factor(e)). With
// `cancel` the experts ignore their input and return large values of both signs and tiny ones instead, so
// that the order of the combine sums (over k, over ranks) and every intermediate rounding shows in the bits.
static std::vector<u16> expert_outputs(const RefWorld& w, u32 me, const DispatchOut& o, bool cancel = false) {
  std::vector<u16> y((size_t)w.s.el() * w.s.rows() * LL_HIDDEN, 0x7fc0);  // NaN where nothing was received
  for (u32 el = 0; el < w.s.el(); el++) {
    const float f = (float)((me * w.s.el() + el) % 7) * 0.375f - 1.125f;
    for (u32 slot = 0; slot < (u32)std::max(o.count[el], 0); slot++) {
      for (u32 i = 0; i < LL_HIDDEN; i++) {
        float v;
        const size_t row = (size_t)el * w.s.rows() + slot;
        if (w.q.fp8) {
          const u32 cols = w.cols();
          const u32 col = w.q.ue8m0 ? i / 512 : i / 128;
          const u32 word = o.scales[((size_t)el * cols + col) * w.s.rows() + slot];
          const float inv = w.q.ue8m0 ? std::ldexp(1.0f, (int)((word >> (8 * ((i / 128) % 4))) & 0xff) - 127) : __uint_as_float(word);
          v = e4m3_to_f32(o.recv_x[row * LL_HIDDEN + i]) * inv;
        } else {
          u16 b;
          std::memcpy(&b, o.recv_x.data() + (row * LL_HIDDEN + i) * 2, 2);
          v = bf16_to_f32(b);
        }
        if (cancel) {
          // +B and -B cancel exactly only when each product is rounded before the add (no FMA) and they
          // meet before the tiny terms (order over k and over ranks); tiny terms vanish next to B.
          const u32 e = me * w.s.el() + el;
          const float big = std::ldexp(1.0f + std::ldexp(1.0f, -7), 8 + (int)(i % 3));
          v = e % 3 == 0 ? big : e % 3 == 1 ? -big : std::ldexp(1.0f + (float)(e % 5) / 8, -26 - (int)(i % 4));
          y[row * LL_HIDDEN + i] = f32_to_bf16(v);
        } else {
          y[row * LL_HIDDEN + i] = f32_to_bf16(v * f);
        }
      }
    }
  }
  return y;
}

// The documented combine of rank `me`'s tokens. `ys[r]` are rank r's expert outputs and `rows_of[r]` its
// (src, t) per local expert (to find which slot held the token).
static std::vector<u16> combine_reference(const RefWorld& w, u32 me, const Inputs& in, const std::vector<std::vector<u16>>& ys,
                                          const std::vector<std::vector<std::vector<std::pair<u32, u32>>>>& rows_of,
                                          const std::vector<bool>& masked, bool pre_reduced) {
  const u32 T = w.s.tokens[me];
  std::vector<u16> out((size_t)T * LL_HIDDEN);
  auto y_of = [&](u32 t, i64 e, u32 i) -> float {
    const u32 r = rank_of(w, e), el = (u32)(e % w.s.el());
    const auto& rows = rows_of[r][el];
    const auto it = std::find(rows.begin(), rows.end(), std::make_pair(me, t));
    const size_t slot = (size_t)(it - rows.begin());
    return bf16_to_f32(ys[r][((size_t)el * w.s.rows() + slot) * LL_HIDDEN + i]);
  };
  for (u32 t = 0; t < T; t++) {
    for (u32 i = 0; i < LL_HIDDEN; i++) {
      float acc = 0.0f;
      if (pre_reduced) {
        for (u32 r = 0; r < w.s.ranks; r++) {
          if (masked[r] || masked[me]) continue;
          float partial = 0.0f;
          bool any = false;
          for (u32 k = 0; k < LL_TOPK; k++) {
            const i64 e = in.idx[t * LL_TOPK + k];
            if (e < 0 || rank_of(w, e) != r) continue;
            any = true;
            const float term = in.w[t * LL_TOPK + k] * y_of(t, e, i);
            partial = partial + term;
          }
          if (any) acc = acc + bf16_to_f32(f32_to_bf16(partial));
        }
      } else {
        for (u32 k = 0; k < LL_TOPK; k++) {
          const i64 e = in.idx[t * LL_TOPK + k];
          if (e < 0 || masked[rank_of(w, e)] || masked[me]) continue;
          const float term = in.w[t * LL_TOPK + k] * y_of(t, e, i);
          acc = acc + term;
        }
      }
      out[(size_t)t * LL_HIDDEN + i] = f32_to_bf16(acc);
    }
  }
  return out;
}

static void check_combined(const RefWorld& w, u32 me, const std::vector<u16>& got, const std::vector<u16>& want, const char* what) {
  for (size_t i = 0; i < want.size(); i++)
    CHECK(got[i] == want[i], "%s: rank %u combined[%zu, %zu] = %#06x, expected %#06x", what, me, i / LL_HIDDEN, i % LL_HIDDEN, got[i],
          want[i]);
  (void)w;
}

