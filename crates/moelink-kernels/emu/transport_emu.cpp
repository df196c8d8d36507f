// Host emulation of the RDMA transport seam (transport.cuh, through transport.cu's kernels) for
// tests/transport_emulation.rs: R ranks as threads, every launch one OS thread per block and one fiber per
// CUDA thread (runtime.hpp), RDMA regions as host allocations reached through a peer table — the `ptr`
// backend, or the emulated NIC (MOELINK_TRANSPORT=2) whose blocks run beside the workers.
//
// Scenarios: the conformance check in its correct modes (put_signal; put, fence, signal on another QP) at 2
// and 4 ranks, several QPs, random sizes (1 byte to 300), over rounds — with the NIC in order, reordering
// across QPs and delaying; the planted bug (a signal on another QP than its data, no fence), which the
// emulated NIC must catch; a rate cap that must slow the NIC down; a rank that never launches (the others
// time out naming it, the NIC winds down); and the micro-benchmark's two modes. Prints one line per
// scenario; exits non-zero on the first failure.
#include "runtime.hpp"
#include "ptx.cuh"
#include "transport.cu"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
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
constexpr u32 kWorkers = 2;  // worker blocks per launch

struct Aligned {
  void* p = nullptr;
  explicit Aligned(size_t bytes) {
    p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    std::memset(p, 0, (bytes + 255) / 256 * 256);
  }
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  u64 addr() const { return reinterpret_cast<u64>(p); }
};

struct NicOptions {
  u64 delay_ns = 0;
  u32 bytes_per_us = 0;
  u32 reorder_us = 0;
  u32 blocks = 1;
};

// R ranks' RDMA regions, NIC states and error sinks.
struct World {
  u32 ranks, qps;
  size_t region_bytes;
  std::vector<std::unique_ptr<Aligned>> region, nic, expected, scratch;
  std::vector<u64> peer_bases;
  std::vector<u32> claim;
  std::vector<ErrorRecord> record;
  NicOptions nic_opts;

  World(u32 r, u32 q, size_t bytes, NicOptions o = {}) : ranks(r), qps(q), region_bytes(bytes), claim(r, 0), record(r), nic_opts(o) {
    for (u32 p = 0; p < r; p++) {
      region.emplace_back(new Aligned(bytes));
      nic.emplace_back(new Aligned(sizeof(NicState)));
      expected.emplace_back(new Aligned(8 * r));
      scratch.emplace_back(new Aligned(64));
      peer_bases.push_back(region.back()->addr());
      std::memset(&record[p], 0, sizeof(ErrorRecord));
    }
  }

  RdmaArgs rdma(u32 me, u32 seed) const {
    RdmaArgs a{};
    a.local_base = region[me]->addr();
    a.peer_bases = reinterpret_cast<u64>(peer_bases.data());
    a.nic_state = kEmuNic ? nic[me]->addr() : 0;
    a.nic_delay_ns = nic_opts.delay_ns;
    a.nic_bytes_per_us = nic_opts.bytes_per_us;
    a.nic_reorder_us = nic_opts.reorder_us;
    a.nic_blocks = kEmuNic ? nic_opts.blocks : 0;
    a.nic_seed = seed;
    a.rank = me;
    a.num_ranks = ranks;
    a.num_qps = qps;
    return a;
  }

  u32 grid() const { return kWorkers + (kEmuNic ? nic_opts.blocks : 0); }

  // Runs body(rank) on one thread per rank in `who` (all by default), concurrently.
  void run(const std::function<void(u32)>& body, std::vector<u32> who = {}) {
    if (who.empty())
      for (u32 p = 0; p < ranks; p++) who.push_back(p);
    std::vector<std::thread> t;
    for (u32 p : who) t.emplace_back(body, p);
    for (auto& x : t) x.join();
  }
};

static u64 check_rounds(World& w, u32 mode, u32 rounds, u32 messages, u32 max_bytes, u64 timeout_ns = 20'000'000'000ull,
                        std::vector<u32> who = {}) {
  u64 total = 0;
  for (u32 round = 0; round < rounds; round++) {
    w.run(
        [&](u32 me) {
          TransportCheckArgs a{};
          a.rdma = w.rdma(me, 1234 + round);
          a.error_claim = reinterpret_cast<u64>(&w.claim[me]);
          a.error_record = reinterpret_cast<u64>(&w.record[me]);
          a.timeout_ns = timeout_ns;
          a.mismatches = w.scratch[me]->addr();
          a.expected = w.expected[me]->addr();
          a.seed = 77;
          a.round = round;
          a.messages = messages;
          a.max_bytes = max_bytes;
          a.slot_bytes = (max_bytes + 15) / 16 * 16;
          a.mode = mode;
          emu::launch(w.grid(), TRANSPORT_THREADS, [&a] { transport_check(a); });
        },
        who);
  }
  for (u32 p = 0; p < w.ranks; p++) total += *reinterpret_cast<u64*>(w.scratch[p]->p);
  return total;
}

static size_t check_bytes(u32 ranks, u32 messages, u32 max_bytes) {
  return TRANSPORT_SIGNAL_BYTES + (size_t)(ranks + 1) * messages * ((max_bytes + 15) / 16 * 16);
}

static void expect_clean(const World& w, const char* what) {
  for (u32 p = 0; p < w.ranks; p++) CHECK(w.record[p].code == ERR_NONE, "%s: rank %u recorded error %u (peer %u)", what, p, w.record[p].code, w.record[p].peer);
}

static void conformance(u32 ranks, u32 qps, NicOptions o, const char* label) {
  const u32 messages = 40, max_bytes = 300, rounds = 3;
  for (u32 mode : {CHECK_PUT_SIGNAL, CHECK_PUT_FENCE_SIGNAL}) {
    World w(ranks, qps, check_bytes(ranks, messages, max_bytes), o);
    const u64 wrong = check_rounds(w, mode, rounds, messages, max_bytes);
    expect_clean(w, label);
    CHECK(wrong == 0, "%s, %u ranks, %u QPs, mode %u: %llu bytes wrong", label, ranks, qps, mode, (unsigned long long)wrong);
    // Every message landed: the counters hold exactly what the seeds say.
    for (u32 me = 0; me < ranks; me++) {
      const u64* sig = reinterpret_cast<const u64*>(w.region[me]->p);
      const u64* expected = reinterpret_cast<const u64*>(w.expected[me]->p);
      for (u32 s = 0; s < ranks; s++) CHECK(sig[s] == expected[s], "%s: rank %u counter of %u is %llu, expected %llu", label, me, s, (unsigned long long)sig[s], (unsigned long long)expected[s]);
    }
    std::printf("conformance %-28s ranks %u qps %u mode %u: %u rounds x %u messages, 0 bytes wrong\n", label, ranks, qps, mode, rounds,
                messages);
  }
}

int main() {
  std::printf("backend: %s\n", kEmuNic ? "emu-nic" : "ptr");
  conformance(2, 1, {}, "in order");
  conformance(4, 3, {}, "in order");
  if (kEmuNic) {
    conformance(4, 3, NicOptions{0, 0, 50, 1}, "reordering across QPs");
    conformance(3, 4, NicOptions{20'000, 0, 50, 2}, "reorder + 20 us delay, 2 NICs");

    // The planted bug: data on one QP, its signal on another, no fence. The NIC holds data back at random
    // within the window while bare signals go at once, so signals overtake their data; the receiver,
    // trusting the count, reads stale bytes. The window (20 ms) is far longer than an OS thread waits for
    // a core on a loaded machine, so the receiver looks before the data lands however the threads run.
    {
      const u32 messages = 64, max_bytes = 256;
      World w(4, 4, check_bytes(4, messages, max_bytes), NicOptions{0, 0, 20'000, 1});
      const u64 wrong = check_rounds(w, CHECK_PLANTED_BUG, 4, messages, max_bytes);
      expect_clean(w, "planted bug");
      CHECK(wrong > 0, "the emulated NIC did not catch a signal sent on another QP than its data without a fence");
      std::printf("planted bug (signal on another QP, no fence): caught, %llu bytes wrong\n", (unsigned long long)wrong);
    }

    // Rate cap: 2 MB/s for a few KB per rank must take at least bytes / rate.
    {
      const u32 messages = 24, max_bytes = 256, rate = 2;  // bytes per us
      World w(2, 2, check_bytes(2, messages, max_bytes), NicOptions{0, rate, 0, 1});
      const auto t0 = std::chrono::steady_clock::now();
      const u64 wrong = check_rounds(w, CHECK_PUT_SIGNAL, 1, messages, max_bytes);
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      expect_clean(w, "rate cap");
      CHECK(wrong == 0, "rate cap: %llu bytes wrong", (unsigned long long)wrong);
      // The bytes each rank's NIC put (from the same seeds the kernel uses).
      u64 most = 0;
      for (u32 me = 0; me < 2; me++) {
        TransportCheckArgs a{};
        a.rdma = w.rdma(me, 0);
        a.seed = 77, a.round = 0, a.messages = messages, a.max_bytes = max_bytes;
        u64 bytes = 0;
        for (u32 m = 0; m < messages; m++) bytes += check_message(a, me, m).bytes;
        most = bytes > most ? bytes : most;
      }
      const double floor_us = (double)most / rate;
      CHECK(us >= 0.9 * floor_us, "rate cap: %.0f us for %llu bytes at %u B/us (floor %.0f us)", us, (unsigned long long)most, rate, floor_us);
      std::printf("rate cap %u MB/s: %llu bytes in %.0f us (floor %.0f us)\n", rate, (unsigned long long)most, us, floor_us);
    }
  } else {
    const u32 messages = 64, max_bytes = 256;
    World w(4, 4, check_bytes(4, messages, max_bytes));
    const u64 wrong = check_rounds(w, CHECK_PLANTED_BUG, 2, messages, max_bytes);
    std::printf("planted bug over peer pointers: %llu bytes wrong (peer pointers deliver in issue order: not a check)\n",
                (unsigned long long)wrong);
  }

  // A rank that never launches: every other rank times out naming it, and every launch ends.
  {
    const u32 messages = 16, max_bytes = 64;
    World w(3, 2, check_bytes(3, messages, max_bytes), NicOptions{0, 0, kEmuNic ? 50u : 0u, 1});
    check_rounds(w, CHECK_PUT_SIGNAL, 1, messages, max_bytes, 200'000'000ull, {0, 1});
    for (u32 p : {0u, 1u}) {
      CHECK(w.record[p].code == ERR_TIMEOUT && w.record[p].peer == 2 && w.record[p].phase == PHASE_TRANSPORT,
            "silent peer: rank %u recorded code %u peer %u phase %u", p, w.record[p].code, w.record[p].peer, w.record[p].phase);
    }
    std::printf("silent peer: ranks 0 and 1 timed out naming rank 2, every launch ended\n");
  }

  // The barrier: three in a row at 3 ranks; every word ends at 3, and a rank that never comes is named.
  {
    World w(3, 2, TRANSPORT_SIGNAL_BYTES, NicOptions{0, 0, 50, 1});
    std::vector<u64> counter(3, 0);
    auto barrier = [&](u32 me, u64 timeout_ns) {
      TransportBarrierArgs a{};
      a.rdma = w.rdma(me, 5);
      a.error_claim = reinterpret_cast<u64>(&w.claim[me]);
      a.error_record = reinterpret_cast<u64>(&w.record[me]);
      a.timeout_ns = timeout_ns;
      a.counter = reinterpret_cast<u64>(&counter[me]);
      a.signal_off = 0;
      emu::launch(1 + (kEmuNic ? w.nic_opts.blocks : 0), TRANSPORT_THREADS, [&a] { transport_barrier(a); });
    };
    for (int i = 0; i < 3; i++) w.run([&](u32 me) { barrier(me, 20'000'000'000ull); });
    expect_clean(w, "barrier");
    for (u32 me = 0; me < 3; me++)
      for (u32 p = 0; p < 3; p++) CHECK(reinterpret_cast<const u64*>(w.region[me]->p)[p] == 3, "barrier word [%u] of rank %u", p, me);
    w.run([&](u32 me) { barrier(me, 100'000'000ull); }, {0, 2});
    for (u32 p : {0u, 2u})
      CHECK(w.record[p].code == ERR_TIMEOUT && w.record[p].peer == 1 && w.record[p].phase == PHASE_BARRIER, "barrier: rank %u recorded %u naming %u",
            p, w.record[p].code, w.record[p].peer);
    std::printf("barrier: 3 rounds at 3 ranks, then rank 1 missing is named by ranks 0 and 2\n");
  }

  // The micro-benchmark: both modes complete and report what they moved, with put_signal and with plain
  // puts (latency: put, fence, signal per message, on QP i % num_qps).
  for (u32 mode : {BENCH_LATENCY, BENCH_BANDWIDTH}) {
    const u32 ranks = 2, bytes = 512, msgs = 32;
    World w(ranks, 2, TRANSPORT_SIGNAL_BYTES + 2 * (size_t)msgs * bytes, NicOptions{0, 0, 50, 1});
    std::vector<u64> result(2 * ranks, 0);
    for (u32 use_signal : {1u, 0u}) {
      for (u32 epoch = 1; epoch <= 2; epoch++) {
        w.run([&](u32 me) {
          TransportBenchArgs a{};
          a.rdma = w.rdma(me, epoch);
          a.error_claim = reinterpret_cast<u64>(&w.claim[me]);
          a.error_record = reinterpret_cast<u64>(&w.record[me]);
          a.timeout_ns = 20'000'000'000ull;
          a.result = reinterpret_cast<u64>(&result[2 * me]);
          a.epoch = epoch + (use_signal ? 0 : 2);
          a.signal_base = *reinterpret_cast<const u64*>(w.region[me]->addr() + (mode == BENCH_LATENCY ? 0 : 8));
          a.mode = mode, a.bytes = bytes, a.messages = msgs, a.use_signal = use_signal;
          emu::launch(w.grid(), TRANSPORT_THREADS, [&a] { transport_bench(a); });
        });
        expect_clean(w, "bench");
        for (u32 me = 0; me < ranks; me++) CHECK(result[2 * me + 1] == (u64)msgs * bytes && result[2 * me] > 0, "bench mode %u rank %u: %llu ns, %llu bytes", mode, me, (unsigned long long)result[2 * me], (unsigned long long)result[2 * me + 1]);
        if (mode == BENCH_LATENCY) break;
      }
    }
    std::printf("bench mode %u: completes with put_signal and with put, %u bytes x %u messages per rank\n", mode, bytes, msgs);
  }
  std::printf("all transport scenarios passed\n");
  return 0;
}
