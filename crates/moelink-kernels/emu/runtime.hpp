// A CPU emulator of CUDA, good enough to run moelink's real kernel sources (HT and LL) on a machine without a
// GPU: every block is an OS thread, every CUDA thread a cooperative fiber (ucontext) of it, warp and block
// collectives are rendezvous between fibers, and the PTX primitives (ptx_emu.hpp, spliced into cuda/ptx.cuh
// in place of its inline-PTX `namespace ptx`) are C++ atomics on host memory. Fibers yield at every flag
// load, timer read and collective, so spin-waits make progress.
//
// What it checks: index arithmetic, the flag protocol (no lost rows, no waits that never end), the warp
// convergence discipline (a collective reached by only part of a warp deadlocks here, and would on a GPU;
// a partial mask aborts), and results against a reference. What it cannot check: the GPU memory model's weak
// orderings, timing, register pressure. Not part of the library: tests/emulate_ht.rs and
// tests/ll_emulation.rs (through tests/common/mod.rs) assemble it with the kernels and compile it with g++
// (C++17 or later).
//
// This header comes first in a translation unit: ptx.cuh, spliced, follows it (it defines u32, u32x4,
// WARP_SIZE, ..., so nothing here uses those names).
#pragma once
#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local

namespace emu {

struct Uint3 {
  unsigned x, y, z;
};

constexpr unsigned kWarp = 32;
constexpr size_t kStackBytes = 256 << 10;

struct WarpState {
  unsigned arrived = 0, generation = 0;
  unsigned long long value[kWarp];
  unsigned source[kWarp];
  unsigned long long result[kWarp];
};

struct Fiber {
  ucontext_t context;
  unsigned tid = 0;
  bool done = false;
  std::unique_ptr<char[]> stack;  // not zeroed: only touched as deep as a fiber goes
};

struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  unsigned current = 0;
  unsigned bar_arrived = 0, bar_generation = 0;
  int bar_and = 1, bar_and_result = 1;
  std::vector<WarpState> warps;
  std::function<void()> body;
};

inline thread_local Block* t_block = nullptr;
// A rank made slow on purpose (set on the thread that launches its kernels): the last block of each of its
// grids (a receiver / reducer in the HT kernels) sleeps now and then while its senders run at full speed, so
// that faster peers run ahead into its slabs — what the hand-back protocol must survive.
inline thread_local unsigned t_slow_us = 0;
inline thread_local unsigned t_yields = 0;
inline thread_local Uint3 t_block_idx{0, 0, 0};
inline thread_local Uint3 t_grid_dim{1, 1, 1};
inline thread_local Uint3 t_block_dim{1, 1, 1};

inline unsigned current_tid() { return t_block->fibers[t_block->current].tid; }
inline Uint3 thread_idx() { return Uint3{current_tid(), 0, 0}; }

// Gives the other fibers of this block a turn.
inline void yield() {
  Block* b = t_block;
  if (t_slow_us != 0 && t_block_idx.x + 1 == t_grid_dim.x && ++t_yields % 64 == 0)
    std::this_thread::sleep_for(std::chrono::microseconds(t_slow_us));
  swapcontext(&b->fibers[b->current].context, &b->scheduler);
}

inline void fiber_entry() {
  t_block->body();
  t_block->fibers[t_block->current].done = true;
  // uc_link returns to the scheduler.
}

// Runs `body` on `threads` fibers as block `block` of `grid` (on the calling OS thread).
inline void run_block(unsigned block, unsigned grid, unsigned threads, const std::function<void()>& body) {
  Block b;
  b.body = body;
  b.fibers.resize(threads);
  b.warps.resize((threads + kWarp - 1) / kWarp);
  t_block = &b;
  t_block_idx = Uint3{block, 0, 0};
  t_grid_dim = Uint3{grid, 1, 1};
  t_block_dim = Uint3{threads, 1, 1};
  for (unsigned i = 0; i < threads; i++) {
    Fiber& f = b.fibers[i];
    f.tid = i;
    f.stack.reset(new char[kStackBytes]);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &b.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  unsigned alive = threads;
  while (alive > 0) {
    alive = 0;
    for (unsigned i = 0; i < threads; i++) {
      if (b.fibers[i].done) continue;
      b.current = i;
      swapcontext(&b.scheduler, &b.fibers[i].context);
      if (!b.fibers[i].done) alive++;
    }
  }
  t_block = nullptr;
}

// Launches a grid: one OS thread per block, all running concurrently; returns when all finished.
inline void launch(unsigned grid, unsigned threads, const std::function<void()>& body) {
  std::vector<std::thread> blocks;
  const unsigned slow = t_slow_us;
  for (unsigned g = 0; g < grid; g++)
    blocks.emplace_back([=] {
      t_slow_us = slow;
      run_block(g, grid, threads, body);
    });
  for (auto& t : blocks) t.join();
}

inline void check_full(unsigned mask) {
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "emu: warp collective with a partial mask %#x\n", mask);
    std::abort();
  }
}

// Rendezvous of the 32 lanes of this fiber's warp. `combine` runs once, on the last lane to arrive, and
// fills result[] from value[] / source[].
template <typename Combine>
inline unsigned long long warp_collective(unsigned long long value, unsigned source, Combine combine) {
  Block* b = t_block;
  const unsigned tid = current_tid();
  WarpState& w = b->warps[tid / kWarp];
  const unsigned lane = tid % kWarp;
  if (b->fibers.size() % kWarp != 0) {
    std::fprintf(stderr, "emu: block of %zu threads is not whole warps\n", b->fibers.size());
    std::abort();
  }
  w.value[lane] = value;
  w.source[lane] = source;
  const unsigned generation = w.generation;
  if (++w.arrived == kWarp) {
    combine(w);
    w.arrived = 0;
    w.generation++;
  } else {
    while (w.generation == generation) yield();
  }
  return w.result[lane];
}

// A full-warp reduction of one 32-bit value per lane: every lane gets op(...(op(v0, v1), ...), v31).
template <typename Op>
inline unsigned warp_reduce(unsigned mask, unsigned v, Op op) {
  check_full(mask);
  return (unsigned)warp_collective(v, 0, [op](WarpState& w) {
    unsigned r = (unsigned)w.value[0];
    for (unsigned l = 1; l < kWarp; l++) r = op(r, (unsigned)w.value[l]);
    for (unsigned l = 0; l < kWarp; l++) w.result[l] = r;
  });
}

inline void syncthreads_and_into(int pred, int& out) {
  Block* b = t_block;
  const unsigned generation = b->bar_generation;
  b->bar_and &= pred != 0;
  if (++b->bar_arrived == b->fibers.size()) {
    b->bar_and_result = b->bar_and;
    b->bar_and = 1;
    b->bar_arrived = 0;
    b->bar_generation++;
  } else {
    while (b->bar_generation == generation) yield();
  }
  out = b->bar_and_result;
}

template <typename To, typename From>
inline To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::t_block_idx)
#define gridDim (::emu::t_grid_dim)
#define blockDim (::emu::t_block_dim)

inline void __syncthreads() {
  int ignored;
  emu::syncthreads_and_into(1, ignored);
}

inline int __syncthreads_and(int pred) {
  int r;
  emu::syncthreads_and_into(pred, r);
  return r;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check_full(mask);
  emu::warp_collective(0, 0, [](emu::WarpState& w) {
    for (unsigned l = 0; l < emu::kWarp; l++) w.result[l] = 0;
  });
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
  emu::check_full(mask);
  return (unsigned)emu::warp_collective(pred != 0, 0, [](emu::WarpState& w) {
    unsigned bits = 0;
    for (unsigned l = 0; l < emu::kWarp; l++) bits |= (w.value[l] != 0 ? 1u : 0u) << l;
    for (unsigned l = 0; l < emu::kWarp; l++) w.result[l] = bits;
  });
}

inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == 0xffffffffu; }

// Lane `src` (mod 32) of the warp; every lane names its own source.
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src) {
  emu::check_full(mask);
  static_assert(sizeof(T) <= 8, "shfl of at most 64 bits");
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const unsigned long long r = emu::warp_collective(bits, (unsigned)src % emu::kWarp, [](emu::WarpState& w) {
    for (unsigned l = 0; l < emu::kWarp; l++) w.result[l] = w.value[w.source[l]];
  });
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  const unsigned lane = emu::current_tid() % emu::kWarp;
  return __shfl_sync(mask, v, lane >= delta ? (int)(lane - delta) : (int)lane);
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  const unsigned lane = emu::current_tid() % emu::kWarp;
  return __shfl_sync(mask, v, (int)(lane ^ (unsigned)lane_mask));
}

inline unsigned __reduce_or_sync(unsigned mask, unsigned v) {
  return emu::warp_reduce(mask, v, [](unsigned a, unsigned b) { return a | b; });
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
  return emu::warp_reduce(mask, v, [](unsigned a, unsigned b) { return a + b; });
}

inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline float __uint_as_float(unsigned v) { return emu::bit_cast<float>(v); }
inline unsigned __float_as_uint(float f) { return emu::bit_cast<unsigned>(f); }

// Atomic read-modify-writes (shared or global memory: blocks are OS threads that may share global words).
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
