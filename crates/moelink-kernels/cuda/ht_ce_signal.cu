// moelink kernel family: the signals around the copy-engine pieces of a cached dispatch or a combine (two
// ranks; the staging is described in ht.cuh, "copy-engine staging"). The host issues, on a side stream of the
// sending rank: this kernel with piece HT_CE_WAIT, then per piece a copy-engine copy of the piece's rows into
// the peer's staging followed by this kernel with the piece's index. The receiving side is ht_dispatch or
// ht_combine with HT_CE.
//
// JIT constants (from moelink_kernels::ht::HtCeSignalVariant):
//   MAX_RANKS                           ranks the control region has room for
//   MOELINK_SIZEOF_HT_CE_SIGNAL_ARGS    sizeof(moelink_kernels::ht::HtCeSignalArgs)
#include "ht.cuh"

#if !defined(MOELINK_SIZEOF_HT_CE_SIGNAL_ARGS)
#error "ht_ce_signal.cu needs every JIT constant listed at the top of the file"
#endif

// Kernel argument (by value). Must match moelink_kernels::ht::HtCeSignalArgs byte for byte.
struct HtCeSignalArgs {
  u64 routing;             // the handle's routing buffer (HT_RT_STATUS, HT_RT_T_MAX)
  u64 ctrl;                // this rank's HT control region
  u64 peer_flags;          // the peer's dispatch row flags of this rank as source
  u64 peer_staging;        // this rank's staging in the peer's dispatch slab
  u64 error_claim;         // ErrorSink::claim
  i64 scale_stride_token;  // this rank's x_scales strides (elements), for the staging header
  i64 scale_stride_group;
  u64 error_record;        // ErrorSink::record
  u64 timeout_ns;          // the wait's deadline
  u64 reserved64;
  u32 rank;
  u32 num_ranks;
  u32 slab_rows;           // slab rows per source for the operation's row size
  u32 piece;               // the piece whose flag to store, or HT_CE_WAIT
  u32 combine;             // 0: a dispatch's pieces, 1: a combine's (HtOpWords)
  u32 reserved;
};
static_assert(sizeof(HtCeSignalArgs) == MOELINK_SIZEOF_HT_CE_SIGNAL_ARGS, "HtCeSignalArgs differs from the Rust definition");

namespace moelink::intranode {
// moelink::intranode::copy_engine_signal: one block of 32 threads.
//   The operation's control words are HtOpWords (combine: 1 for the combine's, else the dispatch's).
//   HT_CE_WAIT: the call's epoch is this rank's counter of the operation + 1 (the receiving kernel of this call
//   stores it only after it saw ce_seen hold it, so the counter cannot move under this read). Lane r waits
//   until peer r consumed call epoch - 1 (its slab may be written again; always, also for a call the dispatch
//   skips, because the pieces are copied regardless). Then ce_go = epoch after the staging header (the scale
//   strides), or 0 where the operation moves nothing (routing status, T_max over slab_rows) or the wait timed out:
//   no piece of this call is signalled then, and the receivers time out naming this rank. Last ce_seen = epoch,
//   which the receiving kernel's blocks wait for before the epoch can advance.
//   piece p: with ce_go non-zero, a system fence (the copy before this kernel on the stream has completed; the
//   fence orders its bytes before the flag for every observer) and the peer's flag [rank][p] = ce_go.
//   reads: routing, this rank's control region; writes: ce_go, ce_seen, the peer's staging header and row flags.
__global__ void __launch_bounds__(32, 1) copy_engine_signal(const __grid_constant__ HtCeSignalArgs a) {
  const HtOpWords w = a.combine != 0 ? HT_COMBINE_WORDS : HT_DISPATCH_WORDS;
  u32* go = ht_ctrl_word(a.ctrl, w.ce_go);
  if (a.piece != HT_CE_WAIT) {
    if (threadIdx.x != 0) return;
    const u32 epoch = ptx::ld_relaxed_gpu(go);
    if (epoch == 0u) return;
    ptx::fence_acq_rel_sys();
    ptx::st_relaxed_sys(reinterpret_cast<u32*>(a.peer_flags) + a.piece, epoch);
    return;
  }
  const i32* routing = reinterpret_cast<const i32*>(a.routing);
  const Deadline d = make_deadline(a.error_claim, a.error_record, a.timeout_ns, a.rank, a.combine != 0 ? PHASE_COMBINE : PHASE_DISPATCH);
  const u32 epoch = ptx::ld_relaxed_gpu(ht_ctrl_word(a.ctrl, w.epoch)) + 1;
  const bool ok = ht_wait_consumed(a.ctrl, w.consumed, a.rank, a.num_ranks, epoch, d);
  const bool moves = routing[HT_RT_STATUS] == 0 && (u32)routing[HT_RT_T_MAX] <= a.slab_rows;
  if (threadIdx.x == 0) {
    if (ok && moves) {
      i64* header = reinterpret_cast<i64*>(a.peer_staging);
      header[0] = a.scale_stride_token;
      header[1] = a.scale_stride_group;
      ptx::fence_acq_rel_sys();
    }
    ptx::st_relaxed_gpu(go, ok && moves ? epoch : 0u);
    ptx::st_release_gpu(ht_ctrl_word(a.ctrl, w.ce_seen), epoch);
  }
}
}  // namespace moelink::intranode
