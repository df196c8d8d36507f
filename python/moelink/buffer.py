"""``Buffer``: DeepEP's ``deep_ep.Buffer`` surface over moelink's native module.

Division of labour: this module does what is torch-specific (allocating every output with torch — after
checking that the device can hold what a size argument asks for, as the Rust API does before it allocates —
reusing outputs nothing references any more (``_Reuse``), streams, events, keeping tensors alive); the native
module reads the torch tensors passed to it (their address, dtype, shape, strides and device), validates
everything and moves the data, one native call per operation. Errors name the argument
(``ValueError``/``TypeError`` with ``argument`` and ``rank`` attributes).

Streams (CUDA backend). A call without ``previous_event``, ``async_finish`` or ``allocate_on_comm_stream`` runs
its kernels on the current stream: ordered after the caller's earlier work and before its later work, which is
all DeepEP's synchronous mode promises, without an event or a second stream. With any of them, as in DeepEP,
the operation runs on the buffer's communication stream (``get_comm_stream()``), which first waits for
``previous_event`` or else the current stream; outputs are allocated on the current stream, or on the
communication stream with ``allocate_on_comm_stream=True``; with ``async_finish=True`` the returned
``EventOverlap`` marks the end of the work and keeps inputs and outputs alive, otherwise the current stream
waits for the work before the call returns. With ``return_recv_hook=True`` a low-latency send phase runs on the
current stream and ``hook()`` runs the receive phase on the stream current when it is called. On the host
backend (CPU tensors) every call is synchronous and events are ``None``.

Environment: ``MOELINK_BACKEND`` (``auto`` | ``host`` | ``cuda``, default ``auto``: CUDA when torch sees a GPU
and the driver and NVRTC are usable; any other value raises ``ValueError`` naming it before CUDA is touched),
``MOELINK_TIMEOUT_MS`` (deadline of every wait, default 10000; on the host backend every exchange too, through
the torch group's store: see ``moelink.group.TorchStoreGroup``). Across nodes: ``MOELINK_TOPOLOGY``
(``NODESxRANKS_PER_NODE``, e.g. ``2x4``: virtual nodes on one host; default: ranks grouped by host),
``MOELINK_TRANSPORT`` (``nvshmem``, the default, ``ptr`` or ``emu-nic``), ``NVSHMEM_HOME`` (default: the
``nvidia-nvshmem-cu13`` wheel torch installs) and ``CUDA_HOME``; see docs/internode.md. For
measurements, as with the ``moelink`` command: ``MOELINK_LL_TRACE=1`` / ``MOELINK_HT_TRACE=1`` (kernel timing
traces), the tuning and timing-experiment variables (``MOELINK_LL_SMS``, ``MOELINK_LL_EXPERIMENT``,
``MOELINK_HT_*``; an unknown value raises ``ValueError`` when a buffer is created), and ``MOELINK_CACHE_DIR`` /
``MOELINK_JIT_VERBOSE=1`` (the kernel cache; read when the module is imported).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

from . import _env, _native
from ._args import check_fits as _check_fits
from ._args import count as _count
from ._args import host_memory_bytes as _host_memory_bytes
from ._args import invalid as _invalid
from ._torch import require_torch, torch
from .config import Config
from .event import EventOverlap, record_event
from .group import MpiGroup, torch_group

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor
else:
    Tensor = Any

_TensorTuple = Tuple[int, str, Tuple[int, ...], Tuple[int, ...], int]


_F = TypeVar("_F", bound=Callable[..., Any])


def _collective(method: _F) -> _F:
    """Marks a collective operation: the native buffer counts the call before this layer can refuse it, so a
    rank that raised on its own input and went on cannot pair its next call with its peers' current one (they
    time out naming it instead; see ``moelink._native.Buffer.begin_call``)."""

    @functools.wraps(method)
    def counted(self: "Buffer", *args: Any, **kwargs: Any) -> Any:
        self._native.begin_call()
        return method(self, *args, **kwargs)

    return counted  # type: ignore[return-value]


# torch's raw-stream and capture queries (what ``torch.cuda.current_stream().cuda_stream`` and
# ``is_current_stream_capturing()`` return, without building a Stream object or going through
# ``torch.cuda``'s Python wrappers): the calls without events ask for them on every call. None where this torch
# lacks them; the public wrappers stand in.
_raw_stream: Any = getattr(getattr(torch, "_C", None), "_cuda_getCurrentRawStream", None)
_is_capturing: Any = getattr(getattr(torch, "_C", None), "_cuda_isCurrentStreamCapturing", None)
_storage_use_count: Any = getattr(getattr(torch, "_C", None), "_storage_Use_Count", None)
_mode_enabled: Any = getattr(getattr(torch, "_C", None), "_is_torch_function_mode_enabled", None)
_DisableTorchFunction: Any = getattr(getattr(torch, "_C", None), "DisableTorchFunction", None)


def _without_torch_function_modes(method: _F) -> _F:
    """Runs a method that reads many tensors with torch's function modes off. Under a mode (such as
    ``torch.set_default_device``'s, which DeepEP's tests and some serving stacks set) every attribute of a tensor
    (``data_ptr()``, ``shape``, ``stride()``, ...) and every factory call go through Python-level dispatch:
    about 1 µs each instead of 0.1, tens of µs per call here. The methods create tensors with an explicit
    device and call no user code, so the mode has nothing to do in them."""
    if _mode_enabled is None or _DisableTorchFunction is None:
        return method

    @functools.wraps(method)
    def plain(self: "Buffer", *args: Any, **kwargs: Any) -> Any:
        if _mode_enabled():
            with _DisableTorchFunction():
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return plain  # type: ignore[return-value]


class _Reuse:
    """The outputs of earlier calls, handed out again once nothing but this object references them.

    A call's outputs are kept as one set under a key that names everything their shapes and dtypes depend on
    (and the stream they are used on). The next call with that key takes a kept set instead of allocating,
    if no Python reference, view, autograd record or storage alias of any of its tensors is left: nobody can
    see the difference from fresh memory, which the caching allocator would have handed out just the same
    (on the same stream). At most two sets per key are kept (two calls in flight, as with two micro-batches);
    a call that finds both busy allocates and keeps its own set in place of the oldest. Never while a CUDA
    graph is being captured: graph memory must not leave the graph, nor eager memory enter it.
    """

    __slots__ = ("_sets",)

    #: References to a kept tensor when nothing outside holds it: the set's tuple, the loop variable and
    #: ``sys.getrefcount``'s argument.
    _FREE_REFS = 3

    def __init__(self) -> None:
        self._sets: dict = {}

    @staticmethod
    def _free(outs: Tuple[Any, ...], counts: Tuple[Tuple[int, int, int], ...], refs: int = _FREE_REFS,
              getrefcount: Any = sys.getrefcount) -> bool:
        """Whether nothing but this object references any tensor of the set."""
        for i in range(len(outs)):
            t = outs[i]  # referenced by `outs`, `t` and getrefcount's argument: _FREE_REFS (a zip would add one)
            if t is None:
                continue
            uses, storage_uses, storage = counts[i]
            # The storage's address was taken at keep time: the kept tensor keeps the storage alive.
            if getrefcount(t) != refs or t._use_count() != uses or _storage_use_count(storage) != storage_uses:
                return False
        return True

    def take(self, key: Any) -> Optional[Tuple[Any, ...]]:
        """A kept set for ``key`` that nothing references any more, or None."""
        for outs, counts in self._sets.get(key, ()):
            if _Reuse._free(outs, counts):
                return outs
        return None

    def release(self, attr: str) -> None:
        """Drops ``attr`` (a handle's native routing, which a kept tensor carries) from every set nothing
        references any more: the routing's device memory goes back to the buffer's pool now, not when the set
        is next handed out. A CUDA graph capture needs that memory, since it cannot allocate any."""
        for sets in self._sets.values():
            for outs, counts in sets:
                if _Reuse._free(outs, counts):
                    for t in outs:
                        if t is not None and hasattr(t, attr):
                            delattr(t, attr)

    def keep(self, key: Any, outs: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """Keeps the fresh set ``outs`` for later calls with ``key`` (its tensors' use counts as they are now,
        referenced only by the call that allocated them, are what "free" means for them); returns it."""
        counts = tuple((0, 0, 0) if t is None else (t._use_count(), _storage_use_count(t.untyped_storage()._cdata),
                                                     t.untyped_storage()._cdata)
                       for t in outs)
        sets = self._sets.setdefault(key, [])
        if len(sets) >= 2:
            sets.pop(0)
        sets.append((outs, counts))
        return outs

    def clear(self) -> None:
        self._sets.clear()


def _dispatch_key(fresh: bool, rows: int, hidden: int, dtype: Any, is_fp8: bool, topk: int, channels: int,
                  in_rank_shape: Tuple[int, ...], stream: Optional[int]) -> Tuple[Any, ...]:
    """The ``_Reuse`` key of a dispatch's output set: what its shapes and dtypes depend on, and its stream
    (``topk`` -1 without top-k; ``in_rank_shape`` () for a cached dispatch). Both dispatch paths key their sets
    with it, so they share them."""
    return ("dispatch", fresh, rows, hidden, dtype, is_fp8, topk, channels, in_rank_shape, stream)


def _event_of(previous_event: Any) -> Any:
    """The CUDA event of an ``EventOverlap`` (or a bare ``torch.cuda.Event``)."""
    return getattr(previous_event, "event", previous_event)


# What a call without ``async_finish`` returns as its event: nothing to wait for (stateless, so one object serves).
_NO_EVENT = EventOverlap()

# The attribute one tensor of a handle carries (the first, or ``InternodeDispatchHandle.CARRIER``): the native
# routing, so that a handle copied into a plain tuple (``tuple(handle)``, or unpacked and packed again) still
# works with combine and cached dispatch.
_NATIVE_ATTR = "_moelink_routing"


class DispatchHandle(tuple):
    """DeepEP's intranode dispatch handle: a tuple ``(rank_prefix_matrix, channel_prefix_matrix,
    recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)``; pass it to ``combine`` or to a
    cached ``dispatch``.

    As DeepEP's (exact):

    - ``rank_prefix_matrix int32 [R, R]``: ``[i][j]`` = tokens rank ``j`` receives from ranks ``0..=i``, so
      this rank's rows from source ``i`` are ``recv_x[rank_prefix_matrix[i-1][rank] : rank_prefix_matrix[i][rank]]``
      (from 0 for ``i = 0``).
    - ``recv_src_idx int32 [N]``: the source rank's index of the token in each received row (``N`` rows:
      ``num_worst_tokens`` in no-sync mode, where rows past the received count are unspecified).
    - ``is_token_in_rank bool [T, R]``: the tensor the dispatch was given.

    The channel elements have DeepEP's shapes (``C = config.num_sms // 2`` channels) and moelink's meaning.
    moelink sends each (source, destination) pair's tokens as one ordered stream, not in channels; in
    DeepEP's terms that is one channel per pair holding every token, reported as the last channel (index
    ``C - 1``) with channels ``0 .. C-2`` empty:

    - ``channel_prefix_matrix int32 [R, C]``: ``[r][c]`` = this rank's tokens in channels ``0..=c`` that go to
      rank ``r``: 0 for ``c < C - 1``, ``num_tokens_per_rank[r]`` for ``c = C - 1``.
    - ``recv_channel_prefix_matrix int32 [R, C]``: where channel ``c`` of source ``s`` starts among the rows
      from ``s``: 0 everywhere.
    - ``send_head int32 [T, R]``: token ``t``'s position among the rows this rank sends to rank ``r`` (so it
      lands at row ``rank_prefix_matrix[rank-1][r] + send_head[t][r]`` of rank ``r``'s ``recv_x``), ``-1`` where
      ``is_token_in_rank[t][r]`` is False.

    Attributes (informative): ``native`` (the routing moelink's combine uses), ``num_tokens``,
    ``num_recv_tokens`` (None when unknown on the host, e.g. in no-sync mode), ``num_experts``.
    """

    native: Any

    def __new__(cls, elements: Sequence[Any] = (), native: Any = None) -> "DispatchHandle":
        handle = super().__new__(cls, tuple(elements))
        handle.native = native
        return handle

    num_tokens = property(lambda self: self.native.num_tokens if self.native is not None else 0)
    num_recv_tokens = property(lambda self: self.native.num_recv_tokens if self.native is not None else None)
    num_experts = property(lambda self: self.native.num_experts if self.native is not None else 0)


class InternodeDispatchHandle(tuple):
    """DeepEP's internode dispatch handle (a buffer whose ranks span nodes): a tuple ``(is_token_in_rank,
    rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
    recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
    send_rdma_head, send_nvl_head)``; pass it to ``combine`` or to a cached ``dispatch``.

    ``R`` ranks on ``N`` nodes of ``L`` ranks (rank ``r`` is on node ``r // L``), ``T`` tokens sent, ``n`` rows
    received (``num_worst_tokens`` in no-sync mode, where rows past the received count hold -1 in the elements
    below that describe rows), ``C = config.num_sms // 2`` channels. As DeepEP's (exact):

    - ``is_token_in_rank bool [T, R]``: the tensor the dispatch was given.
    - ``recv_gbl_rank_prefix_sum int32 [R]``: ``[i]`` = rows this rank received from ranks ``0..=i``, so the rows
      from source ``i`` are ``recv_x[recv_gbl_rank_prefix_sum[i-1] : recv_gbl_rank_prefix_sum[i]]`` (from 0 for
      ``i = 0``): column ``rank`` of the intranode ``rank_prefix_matrix``.
    - ``recv_gbl_channel_prefix_matrix int32 [R, C]``: ``[s][c]`` = the row where channel ``c`` of source ``s``
      starts in ``recv_x``; moelink's one ordered stream per pair starts every channel at the first row from
      ``s`` (``recv_gbl_rank_prefix_sum[s-1]``, 0 for ``s = 0``).
    - ``recv_src_meta uint8 [n, 8]``: two int32 per row; the first is the row's source node (DeepEP's
      ``src_rdma_rank``).

    moelink's meaning, DeepEP's shapes. moelink sends each (source, destination) pair's tokens as one ordered
    stream, not in channels: the channel elements report it as the last channel (index ``C - 1``) holding every
    token, channels ``0 .. C-2`` empty (as ``DispatchHandle``). The RDMA-level elements describe this rank's
    own tokens and rows by node; DeepEP's describe what the rank receives and forwards as the rail peer (the
    rank with its local index on every node), which moelink's kernels keep on the device:

    - ``rdma_channel_prefix_matrix int32 [N, C]``: ``[b][c]`` = this rank's tokens in channels ``0..=c`` that
      reach node ``b`` (a token counts once per node): 0 for ``c < C - 1``, ``num_tokens_per_rdma_rank[b]`` for
      ``c = C - 1``.
    - ``gbl_channel_prefix_matrix int32 [R, C]``: ``[r][c]`` = this rank's tokens in channels ``0..=c`` that go
      to rank ``r``: 0 for ``c < C - 1``, ``num_tokens_per_rank[r]`` for ``c = C - 1``.
    - ``recv_rdma_channel_prefix_matrix int32 [N, C]``: ``[a][c]`` = rows this rank received from node ``a``
      in channels ``0..=c``: 0 for ``c < C - 1``, all of them for ``c = C - 1`` (DeepEP: the tokens the rail
      peer received from node ``a``, for every rank of its node).
    - ``recv_rdma_rank_prefix_sum int32 [N]``: ``[a]`` = rows this rank received from nodes ``0..=a``, i.e.
      ``recv_gbl_rank_prefix_sum[(a + 1) * L - 1]`` (DeepEP: tokens the rail peer received from nodes
      ``0..=a``).
    - ``recv_src_meta``: the second int32 of a row is its token index on the source rank (the intranode
      ``recv_src_idx``; DeepEP: a bit mask of the node's ranks the token goes to).
    - ``send_rdma_head int32 [T, N]``: token ``t``'s position among this rank's tokens that reach node ``b``
      (the order moelink sends them to node ``b``'s rail peer in), -1 where it reaches no rank of ``b``
      (DeepEP: its RDMA ring-buffer slot).
    - ``send_nvl_head int32 [n, max(8, L)]`` (DeepEP: ``[num_rdma_recv_tokens, 8]``): for received row ``i``,
      column ``rank % L`` holds its position among this rank's rows from the row's source node, every other
      column -1 (DeepEP: for each token the rail peer received, its NVLink ring slot at each rank of the node).

    Attributes (informative): ``native``, ``num_tokens``, ``num_recv_tokens`` (None when unknown on the host),
    ``num_experts``.
    """

    #: The element that carries the native routing in a plain-tuple copy (a tensor this class allocates;
    #: ``is_token_in_rank`` belongs to the caller).
    CARRIER = 1

    native: Any

    def __new__(cls, elements: Sequence[Any] = (), native: Any = None) -> "InternodeDispatchHandle":
        handle = super().__new__(cls, tuple(elements))
        handle.native = native
        return handle

    num_tokens = property(lambda self: self.native.num_tokens if self.native is not None else 0)
    num_recv_tokens = property(lambda self: self.native.num_recv_tokens if self.native is not None else None)
    num_experts = property(lambda self: self.native.num_experts if self.native is not None else 0)


class LowLatencyHandle(tuple):
    """DeepEP's low-latency dispatch handle: a tuple ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``; pass it to ``low_latency_combine``.

    - ``src_info int32 [E_local, R * T_max]``: ``src_info[e][n]`` = the source rank's index of the token in
      row ``n`` of local expert ``e`` (rows past ``recv_count[e]`` are unspecified).
    - ``layout_range int64 [E_local, R]``: ``layout_range[e][j] = begin << 32 | count``: the rows of local
      expert ``e`` that came from rank ``j`` are ``begin .. begin + count`` (moelink orders them by source rank,
      so ``begin`` is the rows from lower ranks; counts sum to ``recv_count[e]``; a masked rank counts 0).

    With ``return_recv_hook=True`` both are written when ``hook()`` runs, as the received rows are.
    Attributes (informative): ``native``, ``num_tokens``, ``hidden``, ``num_max_dispatch_tokens_per_rank``,
    ``num_experts``.
    """

    native: Any

    def __new__(cls, elements: Sequence[Any] = (), native: Any = None) -> "LowLatencyHandle":
        handle = super().__new__(cls, elements)
        handle.native = native
        return handle

    # Read from the native routing when asked: a call makes one handle, which few callers inspect.
    num_tokens = property(lambda self: self.native.num_tokens if self.native is not None else 0)
    hidden = property(lambda self: self.native.hidden if self.native is not None else 0)
    num_max_dispatch_tokens_per_rank = property(
        lambda self: self.native.num_max_dispatch_tokens_per_rank if self.native is not None else 0)
    num_experts = property(lambda self: self.native.num_experts if self.native is not None else 0)


def _native_of(handle: Any, kind: type, size: int, first: str, rank: int, what: str, at: int = 0) -> Any:
    """The native routing of a handle ``kind`` returned, or of a plain tuple/list of its ``size`` elements
    whose tensor at index ``at`` (``first``) came from such a handle; else a ``TypeError`` naming ``handle``."""
    if isinstance(handle, kind) and getattr(handle, "native", None) is not None:
        return handle.native
    if isinstance(handle, (tuple, list)) and len(handle) == size:
        native = getattr(handle[at], _NATIVE_ATTR, None)
        if native is not None:
            return native
        raise _invalid(TypeError, "handle", rank,
                       f"a {len(handle)}-element {type(handle).__name__} whose {first} was not made by moelink's "
                       f"{what}: pass the handle {what} returned (or a tuple of its elements)")
    raise _invalid(TypeError, "handle", rank, f"expected the handle {what} returned, got {type(handle).__name__}")


def _send_head(in_rank: Tensor, out: Tensor) -> Tensor:
    """``out[t][r]`` = token ``t``'s position among the tokens sent to ``r``, -1 where it is not sent."""
    t = require_torch()
    # The running count over tokens, scanned as [R, T] along its inner dimension: torch scans dim 0 of [T, R] with
    # its outer-dimension kernel, one thread per column (230 µs for 4096 x 2 on an H200, measured), where the
    # inner-dimension scan of the transposed copy takes a few µs.
    out.t().copy_(t.cumsum(in_rank.t(), 1, dtype=t.int32))
    # Inclusive count - 1 where sent, 0 - 1 elsewhere: two in-place kernels.
    return out.mul_(in_rank).sub_(1)


# DeepEP's recommended chunk sizes per rank count, (nvl send, nvl recv, rdma send, rdma recv) after num_sms:
# the tables of its ``get_dispatch_config`` / ``get_combine_config``.
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128), 24: (32, 288, 8, 128),
    32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128), 96: (20, 480, 12, 128),
    128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128), 24: (1, 288, 8, 128),
    32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128), 96: (1, 480, 8, 128), 128: (1, 560, 8, 128),
    144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


def _config_entry(table: dict, num_ranks: Any) -> Tuple[int, int, int, int]:
    """The table's entry for ``num_ranks``: its own, else the largest listed count below it (1: that of 2)."""
    n = _count(num_ranks, "num_ranks", -1)
    if n == 0:
        raise _invalid(ValueError, "num_ranks", -1, "must be positive")
    return table[max([k for k in table if k <= n], default=min(table))]


_qps_warned = False


def _warn_qps_capped(asked: int) -> None:
    """Says once per process that ``num_qps_per_rank`` was capped (across nodes, where it is used)."""
    global _qps_warned
    if not _qps_warned:
        _qps_warned = True
        warnings.warn(f"moelink: num_qps_per_rank={asked} is capped at {_native.MAX_QPS_PER_RANK} QPs per peer, the "
                      "most its RDMA transport uses", RuntimeWarning, stacklevel=3)


class _CudaMemory:
    """A ``__cuda_array_interface__`` over native device memory, for ``torch.as_tensor`` (keeps ``owner``)."""

    def __init__(self, ptr: int, num_bytes: int, owner: Any) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class Buffer:
    """The expert-parallel communication buffer of one rank (DeepEP's ``deep_ep.Buffer``).

    High-throughput ``dispatch``/``combine`` (training, prefill) and low-latency
    ``low_latency_dispatch``/``low_latency_combine`` (decoding, CUDA-graph capturable). Every rank of
    ``group`` creates one, and all ranks call the same collective operations in the same order.

    Attributes: ``rank``, ``group_size``, ``group``, ``num_nvl_bytes``, ``num_rdma_bytes``,
    ``low_latency_mode``, ``explicitly_destroy``, ``enable_shrink``, ``backend`` (``"host"`` or ``"cuda"``).
    """

    #: SMs high-throughput kernels use by default (class-wide, even); see ``set_num_sms``.
    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:
        """Creates this rank's buffer (collective over ``group``).

        Arguments:
            group: a ``torch.distributed`` process group, one process per GPU (gloo works on the host
                backend). Setup data is exchanged through it with ``all_gather_object``.
            num_nvl_bytes: per-rank buffer bytes for high-throughput (NVLink) communication.
            num_rdma_bytes: per-rank buffer bytes for low-latency communication, and when the ranks span nodes
                for high-throughput calls' RDMA-domain parts too (shared with low-latency calls, as in DeepEP:
                call ``clean_low_latency_buffer`` before low-latency calls that follow high-throughput ones).
                Across nodes high-throughput calls run in rounds that these sizes bound, so any token count fits
                (``moelink._native.ht_internode_bytes_needed`` gives the sizes for a round of so many tokens).
            low_latency_mode: whether the buffer serves the low-latency API.
            num_qps_per_rank: queue pairs per peer when the ranks span nodes, any positive count (DeepEP's
                users pass ``num_experts // num_ranks``); capped at ``moelink._native.MAX_QPS_PER_RANK`` (32, with
                a warning, once per process), which also sets NVSHMEM's ``NVSHMEM_IBGDA_NUM_RC_PER_PE``; unused
                inside a node.
            allow_nvlink_for_low_latency_mode: across nodes, low-latency kernels reach the ranks of their
                own node over NVLink (otherwise through the RDMA transport too).
            allow_mnnvl, use_fabric: accepted for DeepEP compatibility; moelink has no use for them.
            explicitly_destroy: call ``destroy()`` to release resources at a known point; without it they
                are released when the buffer is garbage-collected (``destroy()`` works either way).
            enable_shrink: low-latency fault tolerance (``low_latency_*_mask_buffer``).
            comm: an ``mpi4py.MPI.Comm`` to use when ``group`` is None.
        """
        t = require_torch()
        backend = _env.backend()  # before anything touches CUDA: a typo gets moelink's message, not torch's
        timeout_ms = _env.timeout_ms()
        if group is not None:
            if not (callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))):
                raise _invalid(TypeError, "group", -1,
                               f"expected a torch.distributed process group (e.g. dist.group.WORLD), got {type(group).__name__} "
                               f"{group!r:.40}")
            bytes_group: Any = torch_group(group)
        elif comm is not None:
            bytes_group = MpiGroup(comm)
        else:
            raise _invalid(ValueError, "group", -1, "either `group` or `comm` must be given")
        self.group = group if group is not None else comm
        self.rank: int = bytes_group.rank()
        self.group_size: int = bytes_group.size()
        self.num_nvl_bytes: int = _count(num_nvl_bytes, "num_nvl_bytes", self.rank)
        self.num_rdma_bytes: int = _count(num_rdma_bytes, "num_rdma_bytes", self.rank)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = _count(num_qps_per_rank, "num_qps_per_rank", self.rank)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = bool(allow_mnnvl)
        self.use_fabric = bool(use_fabric)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)

        if backend == "auto" and not t.cuda.is_available():
            backend = "host"  # the driver may be there, but torch cannot hand us CUDA tensors
        device = t.cuda.current_device() if backend != "host" else None
        self._native = _native.Buffer(bytes_group, self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode,
                                      backend=backend, timeout_ms=timeout_ms, device=device,
                                      enable_shrink=self.enable_shrink, num_qps_per_rank=self.num_qps_per_rank,
                                      allow_nvlink_for_low_latency_mode=self.allow_nvlink_for_low_latency_mode,
                                      topology=_env.topology(), transport=_env.transport(),
                                      nvshmem_home=_env.nvshmem_home(), cuda_home=_env.cuda_home())
        #: ``(num_nodes, ranks_per_node)``: how the buffer's ranks are spread over nodes.
        self.topology: tuple = tuple(self._native.topology)
        # Across nodes, high-throughput calls follow DeepEP's internode API (num_tokens_per_rdma_rank, the
        # 10-element handle).
        self._internode = self.topology[0] > 1
        if self._internode and self.num_qps_per_rank > _native.MAX_QPS_PER_RANK:
            _warn_qps_capped(self.num_qps_per_rank)
        self.backend: str = self._native.backend
        self._cuda = self.backend == "cuda"
        self._device = t.device("cuda", self._native.device) if self._cuda else t.device("cpu")
        self._comm_stream: Any = t.cuda.Stream(device=self._device) if self._cuda else None
        # The most the outputs of one call may take (``_alloc``): the GPU's memory, or this machine's.
        self._memory: Tuple[Optional[int], str] = (
            (t.cuda.get_device_properties(self._device).total_memory, f"memory of {self._device}") if self._cuda
            else (_host_memory_bytes(), "memory on this machine"))
        self._device_index: int = self._native.device
        # Outputs of earlier calls, reused once unreferenced (``_Reuse``); None where this torch cannot tell.
        self._reuse: Optional[_Reuse] = _Reuse() if _storage_use_count is not None else None

    #: Whether calls without events reuse the outputs of earlier calls once nothing references them
    #: (``_Reuse``). Class-wide; ``python -m moelink.bench --host-cost`` turns it off to measure what it saves.
    _reuse_outputs: bool = True

    # ------------------------------------------------------------------ static / utility

    def destroy(self) -> None:
        """Releases the buffer's resources now. Later calls raise ``RuntimeError``."""
        self._native.destroy()

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when Hopper features (FP8, TMA) are available: a usable CUDA driver, NVRTC and an sm_90+ GPU.

        moelink compiles its kernels at run time for the GPU it finds, so this reports the machine.
        """
        info = _native.cuda_info()
        return bool(info["available"]) and any(tuple(d["compute_capability"]) >= (9, 0) for d in info["devices"])

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the class-wide SM count of high-throughput kernels (must be even)."""
        n = _count(new_num_sms, "new_num_sms", -1)
        if n == 0 or n % 2 != 0:
            raise _invalid(ValueError, "new_num_sms", -1, f"{n}: the SM count must be even and positive")
        Buffer.num_sms = n

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` recorded on the current stream (event ``None`` without CUDA, or when
        ``MOELINK_BACKEND=host`` makes buffers use the host backend, whose calls return no events)."""
        t = require_torch()
        on_cuda = _env.backend() != "host" and t.cuda.is_available()
        return EventOverlap(record_event() if on_cuda else None)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """``num_rdma_bytes`` enough for low-latency calls of these sizes (bf16 or FP8)."""
        return _native.low_latency_rdma_size_hint(
            _count(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", -1),
            _count(hidden, "hidden", -1), _count(num_ranks, "num_ranks", -1), _count(num_experts, "num_experts", -1))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The recommended dispatch ``Config`` for ``num_ranks``: ``Buffer.num_sms`` SMs and DeepEP's chunk
        sizes for that rank count (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160; another count gets the
        entry of the largest listed count below it, 1 rank that of 2, where DeepEP asserts). Only ``num_sms``
        changes what moelink does; the chunk sizes are accepted for compatibility."""
        return Config(Buffer.num_sms, *_config_entry(_DISPATCH_CONFIGS, num_ranks))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The recommended combine ``Config`` for ``num_ranks`` (DeepEP's table; see ``get_dispatch_config``)."""
        return Config(Buffer.num_sms, *_config_entry(_COMBINE_CONFIGS, num_ranks))

    def get_comm_stream(self) -> Any:
        """The ``torch.cuda.Stream`` the kernels run on (``None`` on the host backend)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: Any, size: Any = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> Tensor:
        """A ``dtype`` view of this rank's communication buffer (the high-throughput region, or the
        low-latency one with ``use_rdma_buffer``), starting ``offset`` bytes in (as DeepEP's, whose ``offset``
        moves the start by bytes; a multiple of the element size here), shaped ``size`` (default: the rest of
        the region, 1-D)."""
        t = require_torch()
        if not isinstance(dtype, t.dtype):
            raise _invalid(TypeError, "dtype", self.rank, f"expected a torch.dtype, got {type(dtype).__name__}")
        offset = _count(offset, "offset", self.rank)
        ptr, num_bytes, device = self._native.local_buffer(bool(use_rdma_buffer))
        item = t.empty((), dtype=dtype).element_size()
        if offset > num_bytes or offset % item != 0:
            raise _invalid(ValueError, "offset", self.rank,
                           f"{offset} bytes: must be a multiple of {item} (the {dtype} element size) and at most the "
                           f"buffer's {num_bytes} bytes")
        numel = (num_bytes - offset) // item
        shape = (numel,) if size is None else tuple(t.Size(size))
        want = 1
        for d in shape:
            want *= d
        if want > numel:
            raise _invalid(ValueError, "size", self.rank,
                           f"{shape} needs {want} elements, {numel} remain after offset {offset} bytes")
        contiguous = tuple(int(s) for s in t.empty(shape, device="meta").stride())
        return self._wrap_view((ptr + offset, str(dtype).removeprefix("torch."), shape, contiguous, device))

    # ------------------------------------------------------------------ tensors and streams

    def _tensor(self, x: Any, name: str) -> _TensorTuple:
        t = torch
        if t is None or not isinstance(x, t.Tensor):
            raise _invalid(TypeError, name, self.rank, f"expected a torch.Tensor, got {type(x).__name__}")
        dev = x.device
        if dev.type == "cpu":
            index = -1
        elif dev.type == "cuda":
            index = dev.index if dev.index is not None else t.cuda.current_device()
        else:
            raise _invalid(ValueError, name, self.rank, f"tensor is on {dev}, the buffer works on {self._device}")
        return (x.data_ptr(), str(x.dtype).removeprefix("torch."), tuple(x.shape), tuple(x.stride()), index)

    def _opt(self, x: Any, name: str) -> Optional[_TensorTuple]:
        return None if x is None else self._tensor(x, name)

    def _empty(self, shape: Sequence[int], dtype: Any) -> Tensor:
        return require_torch().empty(tuple(shape), dtype=dtype, device=self._device)

    def _alloc(self, arg: str, *outputs: Optional[Tuple[str, Sequence[int], Any]]) -> List[Optional[Tensor]]:
        """Allocates outputs ``(name, shape, torch dtype)`` (None: not wanted) whose sizes come from argument
        ``arg``, after checking that this device can hold them all: else a ``ValueError`` naming ``arg`` and the
        bytes needed, before anything is allocated."""
        wanted = [(name, tuple(shape), str(dtype).removeprefix("torch."), dtype.itemsize)
                  for name, shape, dtype in filter(None, outputs)]
        _check_fits(arg, self.rank, wanted, *self._memory)
        return [None if o is None else self._empty(o[1], o[2]) for o in outputs]

    def _shape(self, x: Any, name: str) -> Any:
        """``x.shape``, or the ``TypeError`` naming ``name`` that the native module gives a non-tensor."""
        if torch is None or not isinstance(x, torch.Tensor):
            raise _invalid(TypeError, name, self.rank, f"expected a torch.Tensor, got {type(x).__name__}")
        return x.shape

    def _current_stream(self) -> Optional[int]:
        """The raw handle of the current stream (CUDA backend; None on the host): where calls without events
        run, ordered with the caller's work without an event or a second stream."""
        if not self._cuda:
            return None
        if _raw_stream is not None:
            return int(_raw_stream(self._device_index))
        return int(require_torch().cuda.current_stream(self._device).cuda_stream)

    def _capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (CUDA backend)."""
        return bool(_is_capturing() if _is_capturing is not None else require_torch().cuda.is_current_stream_capturing())

    def _reusable(self) -> Optional[_Reuse]:
        """The output sets to reuse on this call, or None (turned off, or while a CUDA graph is captured)."""
        if self._reuse is None or not Buffer._reuse_outputs:
            return None
        if self._cuda and self._capturing():
            self._release_for_capture()
            return None
        return self._reuse

    def _release_for_capture(self) -> None:
        """While a CUDA graph is captured: kept output sets give back the handle memory they carry (a captured
        dispatch takes its handle's memory from the pool, which cannot allocate during a capture)."""
        if self._reuse is not None and self._cuda and self._capturing():
            self._reuse.release(_NATIVE_ATTR)

    def _begun(self) -> None:
        """Counts a collective call that this layer refuses before the native module sees it (``_collective``)."""
        self._native.begin_call()

    def _launch_stream(self) -> Optional[int]:
        return self._comm_stream.cuda_stream if self._comm_stream is not None else None

    def _enter(self, previous_event: Any, allocate_on_comm_stream: bool) -> Any:
        """Orders the communication stream after ``previous_event`` (or the current stream) and, with
        ``allocate_on_comm_stream``, makes it current. Returns the caller's stream (None on the host)."""
        if not self._cuda:
            return None
        t = require_torch()
        compute = t.cuda.current_stream(self._device)
        if previous_event is not None:
            self._comm_stream.wait_event(_event_of(previous_event))
        else:
            self._comm_stream.wait_stream(compute)
        if allocate_on_comm_stream:
            t.cuda.set_stream(self._comm_stream)
        return compute

    def _leave(self, compute: Any, allocate_on_comm_stream: bool) -> None:
        if compute is not None and allocate_on_comm_stream:
            require_torch().cuda.set_stream(compute)

    def _finish(self, compute: Any, async_finish: bool, allocate_on_comm_stream: bool,
                inputs: Sequence[Any], outputs: Sequence[Any]) -> EventOverlap:
        """Ends an operation on the communication stream: an event (async) or the caller's stream waits."""
        if not self._cuda:
            return _NO_EVENT
        t = require_torch()
        comm = self._comm_stream
        live_in = [x for x in inputs if x is not None]
        live_out = [x for x in outputs if x is not None]
        # record_stream is not allowed while capturing a CUDA graph; extra_tensors keep things alive there.
        capturing = t.cuda.is_current_stream_capturing()
        if not capturing and allocate_on_comm_stream:
            for x in live_out:
                x.record_stream(compute)
        if async_finish:
            if not capturing:
                for x in live_in + live_out:
                    x.record_stream(comm)
            return EventOverlap(record_event(comm), live_in + live_out)
        compute.wait_stream(comm)
        return _NO_EVENT

    def _wrap_view(self, desc: _TensorTuple) -> Tensor:
        """A tensor over native memory ``(data_ptr, dtype, shape, strides, device)``, keeping the buffer alive."""
        t = require_torch()
        ptr, dtype_name, shape, strides, device = desc
        dtype = getattr(t, dtype_name)
        item = t.empty((), dtype=dtype).element_size()
        span = 0 if any(d == 0 for d in shape) else 1 + sum((d - 1) * s for d, s in zip(shape, strides, strict=True))
        num_bytes = span * item
        if num_bytes == 0:
            return t.empty(tuple(shape), dtype=dtype, device=self._device)
        if device < 0:
            raw = (ctypes.c_char * num_bytes).from_address(ptr)
            raw._moelink_owner = self._native  # type: ignore[attr-defined]
            flat = t.frombuffer(raw, dtype=t.uint8)
        else:
            flat = t.as_tensor(_CudaMemory(ptr, num_bytes, self._native), device=t.device("cuda", device))
        return flat.view(dtype).as_strided(tuple(shape), tuple(strides))

    def _config(self, config: Optional[Config], default: Callable[[int], Config]) -> Tuple[int, int, int, int, int]:
        if config is None:
            config = default(self.group_size)
        if not isinstance(config, Config):
            raise _invalid(TypeError, "config", self.rank, f"expected a moelink.Config, got {type(config).__name__}")
        return config.as_tuple()

    # ------------------------------------------------------------------ high-throughput

    @_without_torch_function_modes
    def get_dispatch_layout(self, topk_idx: Tensor, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor, EventOverlap]:
        """Computes the layout of a dispatch from ``topk_idx`` (``int64 [T, K]``, -1 = no expert).

        Returns ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank, num_tokens_per_expert int32 [E],
        is_token_in_rank bool [T, R], event)``. A token counts once per rank. ``num_tokens_per_rdma_rank`` is
        ``int32 [num_nodes]`` when the buffer's ranks span nodes (tokens per destination node: a token counts
        once per node it reaches), ``None`` on one node (as DeepEP's intranode).
        """
        shape = self._shape(topk_idx, "topk_idx")
        num_experts = _count(num_experts, "num_experts", self.rank)
        num_tokens = shape[0] if len(shape) else 0
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            # No events asked for: the kernel runs on the caller's stream, outputs reused where unreferenced.
            stream = self._current_stream()
            reuse = self._reusable()
            key = ("layout", num_tokens, num_experts, stream)
            outs = reuse.take(key) if reuse is not None else None
            if outs is None:
                outs = self._layout_outputs(num_tokens, num_experts)
                if reuse is not None:
                    reuse.keep(key, outs)
            per_rank, per_node, per_expert, in_rank = outs
            self._native.get_dispatch_layout_into(topk_idx, num_experts, per_rank, per_expert, in_rank, per_node, stream)
            return per_rank, per_node, per_expert, in_rank, _NO_EVENT
        compute = self._enter(previous_event, allocate_on_comm_stream)
        try:
            per_rank, per_node, per_expert, in_rank = self._layout_outputs(num_tokens, num_experts)
            self._native.get_dispatch_layout_into(topk_idx, num_experts, per_rank, per_expert, in_rank, per_node,
                                                  self._launch_stream())
        finally:
            self._leave(compute, allocate_on_comm_stream)
        event = self._finish(compute, async_finish, allocate_on_comm_stream, [topk_idx],
                             [per_rank, per_node, per_expert, in_rank])
        return per_rank, per_node, per_expert, in_rank, event

    def _layout_outputs(self, num_tokens: int, num_experts: int) -> Tuple[Any, ...]:
        """``(num_tokens_per_rank, num_tokens_per_rdma_rank or None, num_tokens_per_expert, is_token_in_rank)``."""
        t = require_torch()
        per_rank = self._empty((self.group_size,), t.int32)
        per_node = self._empty((self.topology[0],), t.int32) if self._internode else None
        [per_expert] = self._alloc("num_experts", ("num_tokens_per_expert", (num_experts,), t.int32))
        in_rank = self._empty((num_tokens, self.group_size), t.bool)
        return per_rank, per_node, per_expert, in_rank

    @_without_torch_function_modes
    def dispatch(self, x: Union[Tensor, Tuple[Tensor, Tensor]], handle: Optional[Sequence[Any]] = None,
                 num_tokens_per_rank: Optional[Tensor] = None, num_tokens_per_rdma_rank: Optional[Tensor] = None,
                 is_token_in_rank: Optional[Tensor] = None, num_tokens_per_expert: Optional[Tensor] = None,
                 topk_idx: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[Union[Tensor, Tuple[Tensor, Tensor]], Optional[Tensor], Optional[Tensor],
                            Optional[List[int]], Union[DispatchHandle, InternodeDispatchHandle, None], EventOverlap]:
        """Sends each token to every rank hosting one of its experts (collective).

        ``x``: ``bf16 [T, H]`` or ``(float8_e4m3fn [T, H], float32 scales [T, H/128] of any strides)``.
        Fresh dispatch: the layout tensors from ``get_dispatch_layout`` and (forward) ``topk_idx`` /
        ``topk_weights``. Cached dispatch: ``handle`` from an earlier dispatch (or a tuple of its elements) and
        no top-k.
        ``num_tokens_per_rdma_rank``: ignored on one node; across nodes, if given, an ``int32 [num_nodes]``
        tensor (what ``get_dispatch_layout`` returned; moelink counts the tokens per node itself).
        ``num_worst_tokens > 0``: no CPU synchronisation, outputs have that many rows (rows past the real count
        have ``recv_topk_idx = -1``) and the per-expert list is empty.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event)``; ``recv_x`` has the tuple-ness of ``x``; ``recv_topk_idx`` holds local expert ids (-1 for
        experts elsewhere, with weight 0); ``handle`` is DeepEP's tuple: on one node the 6-element intranode
        one (``DispatchHandle``), across nodes the 10-element internode one (``InternodeDispatchHandle``); their
        docstrings say what each element holds. A cached dispatch returns ``(recv_x, None, None, None, None,
        event)``.
        """
        try:  # what this layer refuses still counts as the collective call it began (`_collective`)
            if isinstance(x, tuple):
                if len(x) != 2:
                    raise _invalid(ValueError, "x", self.rank, f"an FP8 tuple has 2 tensors (x, scales), got {len(x)}")
                x_data, x_scales = x
            else:
                x_data, x_scales = x, None
            fresh = handle is None
            native_handle = None if fresh else self._ht_native(handle)
            config_tuple = self._config(config, self.get_dispatch_config)
            expert_alignment = _count(expert_alignment, "expert_alignment", self.rank)
            num_worst_tokens = _count(num_worst_tokens, "num_worst_tokens", self.rank)
            if self._internode and fresh and num_tokens_per_rdma_rank is not None:
                self._check_per_node(num_tokens_per_rdma_rank)
            in_rank_shape = tuple(getattr(is_token_in_rank, "shape", ())) if fresh else ()
            eventless = previous_event is None and not async_finish and not allocate_on_comm_stream
        except BaseException:
            self._begun()
            raise
        channels = config_tuple[0] // 2
        rows_arg = "num_worst_tokens" if num_worst_tokens > 0 else "x"
        if eventless:
            stream, reuse = self._current_stream(), self._reusable()
            if not fresh and num_worst_tokens == 0 and native_handle.num_recv_tokens is not None:
                return self._cached_dispatch(x_data, x_scales, native_handle, config_tuple, stream, reuse)
        else:
            stream, reuse = None, None
            self._release_for_capture()

        def alloc(n: int, hidden: int, topk: int, is_fp8: bool, has_topk: bool) -> Tuple[Any, ...]:
            """The outputs, once the count exchange has sized them: the native ones, then the handle's parts."""
            key = None
            if reuse is not None:
                key = _dispatch_key(fresh, n, hidden, x_data.dtype, is_fp8, topk if has_topk else -1, channels,
                                    in_rank_shape, stream)
                outs = reuse.take(key)
                if outs is not None:
                    return outs
            outs = self._dispatch_outputs(n, hidden, topk, is_fp8, has_topk, x_data.dtype, fresh, channels, rows_arg,
                                          in_rank_shape)
            return outs if key is None else reuse.keep(key, outs)

        # On one node the dispatch kernel writes DeepEP's channel elements of the handle (outs[6:9]); across
        # nodes the internode handle is filled here from the dispatch's outputs.
        fill_internode_handle = fresh and self._internode
        dispatch = functools.partial(
            self._native.dispatch, x_data, alloc, x_scales, native_handle, num_tokens_per_rank, num_tokens_per_expert,
            is_token_in_rank, topk_idx, topk_weights, expert_alignment, num_worst_tokens, config_tuple,
            channel_outputs=fresh and not self._internode)
        if eventless:
            native_handle, per_expert, outs = dispatch(stream, True)
            if fill_internode_handle:
                self._internode_handle_fill(outs, is_token_in_rank, num_tokens_per_rank)
            event = _NO_EVENT
        else:
            compute = self._enter(previous_event, allocate_on_comm_stream)
            try:
                native_handle, per_expert, outs = dispatch(self._launch_stream(), True)
                if fill_internode_handle:
                    with require_torch().cuda.stream(self._comm_stream) if self._cuda else contextlib.nullcontext():
                        self._internode_handle_fill(outs, is_token_in_rank, num_tokens_per_rank)
            finally:
                self._leave(compute, allocate_on_comm_stream)
            inputs = [x_data, x_scales, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                      is_token_in_rank, topk_idx, topk_weights]
            event = self._finish(compute, async_finish, allocate_on_comm_stream, inputs, list(outs))
        recv_x, recv_scales, recv_idx, recv_w, rank_prefix, recv_src_idx, *handle_parts = outs
        out_x = (recv_x, recv_scales) if recv_scales is not None else recv_x
        if not fresh:
            return out_x, None, None, None, None, event
        dispatch_handle: Union[DispatchHandle, InternodeDispatchHandle]
        if self._internode:
            setattr(handle_parts[InternodeDispatchHandle.CARRIER - 1], _NATIVE_ATTR, native_handle)
            dispatch_handle = InternodeDispatchHandle((is_token_in_rank, *handle_parts), native_handle)
        else:
            channel_prefix, recv_channel_prefix, send_head = handle_parts
            setattr(rank_prefix, _NATIVE_ATTR, native_handle)
            dispatch_handle = DispatchHandle((rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx,
                                              is_token_in_rank, send_head), native_handle)
        return out_x, recv_idx, recv_w, list(per_expert), dispatch_handle, event

    def _cached_dispatch(self, x_data: Any, x_scales: Optional[Tensor], native_handle: Any, config_tuple: Tuple[int, ...],
                         stream: Optional[int], reuse: Optional[_Reuse]) -> Tuple[Any, None, None, None, None, EventOverlap]:
        """``dispatch`` with a handle whose received rows the host knows, without events: the outputs come from
        here (kept sets under ``dispatch``'s own key, else fresh) and the native module moves the rows in one
        step, with ``dispatch``'s checks and errors."""
        try:  # what fails here still counts as the collective call it began (`_collective`)
            shape = self._shape(x_data, "x")
            rows, is_fp8 = native_handle.num_recv_tokens, x_scales is not None
            hidden = shape[1] if len(shape) == 2 else 0
            key = _dispatch_key(False, rows, hidden, x_data.dtype, is_fp8, -1, config_tuple[0] // 2, (), stream)
            outs = reuse.take(key) if reuse is not None else None
            if outs is None:
                outs = self._dispatch_outputs(rows, hidden, 0, is_fp8, False, x_data.dtype, False, config_tuple[0] // 2,
                                              "x", ())
                if reuse is not None:
                    reuse.keep(key, outs)
        except BaseException:
            self._begun()
            raise
        recv_x, recv_scales = outs[0], outs[1]
        self._native.cached_dispatch_into(x_data, native_handle, recv_x, x_scales, recv_scales, config_tuple, stream, True)
        return (recv_x, recv_scales) if recv_scales is not None else recv_x, None, None, None, None, _NO_EVENT

    def _dispatch_outputs(self, n: int, hidden: int, topk: int, is_fp8: bool, has_topk: bool, x_dtype: Any, fresh: bool,
                          channels: int, rows_arg: str, in_rank_shape: Tuple[int, ...]) -> Tuple[Any, ...]:
        """A dispatch's outputs, unfilled: ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
        rank_prefix_matrix, recv_src_idx, *handle parts)``, None where not wanted. The rows: ``num_worst_tokens``
        in no-sync mode, else what the ranks' ``x`` send here."""
        t = require_torch()
        r = self.group_size
        recv_x, recv_scales, recv_idx, recv_w, recv_src_idx = self._alloc(
            rows_arg,
            ("recv_x", (n, hidden), x_dtype),
            ("recv_x_scales", (n, hidden // 128), t.float32) if is_fp8 else None,
            ("recv_topk_idx", (n, topk), t.int64) if has_topk else None,
            ("recv_topk_weights", (n, topk), t.float32) if has_topk else None,
            ("recv_src_idx", (n,), t.int32) if fresh else None)
        rank_prefix = self._empty((r, r), t.int32) if fresh else None
        handle_parts: List[Any]
        if not fresh:
            handle_parts = []
        elif self._internode:
            handle_parts = self._internode_handle_alloc(n, channels, rows_arg, in_rank_shape)
        else:
            handle_parts = [*self._alloc("config.num_sms", ("channel_prefix_matrix", (r, channels), t.int32),
                                         ("recv_channel_prefix_matrix", (r, channels), t.int32)),
                            self._empty(in_rank_shape, t.int32)]
        return (recv_x, recv_scales, recv_idx, recv_w, rank_prefix, recv_src_idx, *handle_parts)

    def _ht_native(self, handle: Any) -> Any:
        """The native routing of a high-throughput handle of this buffer's kind (intranode 6-tuple, or
        internode 10-tuple across nodes), or a plain tuple of its elements."""
        if self._internode:
            return _native_of(handle, InternodeDispatchHandle, 10, "rdma_channel_prefix_matrix", self.rank, "dispatch",
                              at=InternodeDispatchHandle.CARRIER)
        return _native_of(handle, DispatchHandle, 6, "rank_prefix_matrix", self.rank, "dispatch")

    def _check_per_node(self, per_node: Any) -> None:
        """``num_tokens_per_rdma_rank`` across nodes: an ``int32 [num_nodes]`` tensor of this buffer's device."""
        t = require_torch()
        self._tensor(per_node, "num_tokens_per_rdma_rank")
        if per_node.dtype != t.int32:
            raise _invalid(TypeError, "num_tokens_per_rdma_rank", self.rank, f"dtype is {per_node.dtype}, expected torch.int32")
        if tuple(per_node.shape) != (self.topology[0],):
            raise _invalid(ValueError, "num_tokens_per_rdma_rank", self.rank,
                           f"shape {tuple(per_node.shape)}, expected ({self.topology[0]},): one count per node")
        if per_node.device != self._device:
            raise _invalid(ValueError, "num_tokens_per_rdma_rank", self.rank,
                           f"tensor is on {per_node.device}, the buffer works on {self._device}")

    def _internode_handle_alloc(self, n: int, channels: int, rows_arg: str, in_rank_shape: Tuple[int, ...]) -> List[Any]:
        """The nine tensors after ``is_token_in_rank`` of an internode handle, unfilled (DeepEP's order)."""
        t = require_torch()
        r, (nodes, per_node) = self.group_size, self.topology
        num_tokens = in_rank_shape[0] if in_rank_shape else 0
        rdma_cp, gbl_cp, recv_rdma_cp, recv_gbl_cp = self._alloc(
            "config.num_sms", ("rdma_channel_prefix_matrix", (nodes, channels), t.int32),
            ("gbl_channel_prefix_matrix", (r, channels), t.int32),
            ("recv_rdma_channel_prefix_matrix", (nodes, channels), t.int32),
            ("recv_gbl_channel_prefix_matrix", (r, channels), t.int32))
        meta, nvl_head = self._alloc(rows_arg, ("recv_src_meta", (n, 8), t.uint8),
                                     ("send_nvl_head", (n, max(8, per_node)), t.int32))
        return [rdma_cp, gbl_cp, recv_rdma_cp, self._empty((nodes,), t.int32), recv_gbl_cp, self._empty((r,), t.int32),
                meta, self._empty((num_tokens, nodes), t.int32), nvl_head]

    def _internode_handle_fill(self, outs: Sequence[Any], in_rank: Tensor, per_rank: Tensor) -> None:
        """Writes the internode handle's elements (``InternodeDispatchHandle`` says what each holds) from the
        dispatch's ``rank_prefix_matrix`` and ``recv_src_idx`` (in ``outs``) and the layout, on the current
        stream, without a host synchronisation (CUDA-graph capturable)."""
        _, _, _, _, rank_prefix, recv_src_idx, *parts = outs
        t = require_torch()
        (rdma_cp, gbl_cp, recv_rdma_cp, recv_rdma_sum, recv_gbl_cp, recv_gbl_sum, meta, send_rdma_head,
         send_nvl_head) = parts
        nodes, per_node = self.topology
        last = rdma_cp.shape[1] - 1
        # What this rank sends: per node (a token once per node it reaches) and per rank.
        reach = in_rank.reshape(in_rank.shape[0], nodes, per_node).any(2)
        _send_head(reach, send_rdma_head)
        rdma_cp.zero_()[:, last].copy_(reach.sum(0, dtype=t.int32))
        gbl_cp.zero_()[:, last].copy_(per_rank)
        # What it received: rows by source rank, then by source node.
        recv_gbl_sum.copy_(rank_prefix[:, self.rank])
        recv_gbl_cp[0].zero_()
        recv_gbl_cp[1:].copy_(recv_gbl_sum[:-1].unsqueeze(1).expand(-1, recv_gbl_cp.shape[1]))
        recv_rdma_sum.copy_(recv_gbl_sum.view(nodes, per_node)[:, per_node - 1])
        node_start = t.cat([recv_rdma_sum.new_zeros(1), recv_rdma_sum[:-1]])
        recv_rdma_cp.zero_()[:, last].copy_(recv_rdma_sum - node_start)
        # Per row: its source (searching the prefix; rows past the received count find none).
        n = meta.shape[0]
        rows = t.arange(n, dtype=t.int32, device=meta.device)
        src = t.searchsorted(recv_gbl_sum, rows, right=True)
        valid = src < self.group_size
        node = t.div(src, per_node, rounding_mode="floor").clamp_(max=nodes - 1)
        meta32 = meta.view(t.int32)
        meta32[:, 0].copy_(t.where(valid, node, -1))
        meta32[:, 1].copy_(t.where(valid, recv_src_idx, -1))
        send_nvl_head.fill_(-1)
        send_nvl_head[:, self.rank % per_node].copy_(t.where(valid, rows - node_start[node], -1))

    @_without_torch_function_modes
    def combine(self, x: Tensor, handle: Sequence[Any], topk_weights: Optional[Tensor] = None,
                bias: Union[Tensor, Tuple[Tensor, Tensor], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[Tensor, Optional[Tensor], EventOverlap]:
        """Sums expert outputs back onto each token's home rank (collective).

        ``x``: ``bf16 [N, H]``, one row per received token (gating weights already applied); ``handle``: what
        the dispatch returned (or a tuple of its elements): DeepEP's intranode 6-tuple on one node, its internode
        10-tuple across nodes, where a token's rows are summed on each node it reached and one partial per node
        crosses to its home rank. Returns ``(combined_x bf16 [T, H], combined_topk_weights float32 [T, K] or None, event)``: the fp32 sum over
        the ranks each token was sent to, plus ``bias`` (a tensor or a 2-tuple of ``[T, H]`` bf16 tensors),
        rounded to bf16; ``combined_topk_weights`` sums ``topk_weights`` the same way.
        """
        try:  # what this layer refuses still counts as the collective call it began (`_collective`)
            native_handle = self._ht_native(handle)
            if bias is None or isinstance(bias, tuple) and len(bias) == 0:
                bias_0, bias_1 = None, None
            elif isinstance(bias, tuple):
                if len(bias) != 2:
                    raise _invalid(ValueError, "bias", self.rank, f"a tuple of bias tensors has 2 entries, got {len(bias)}")
                bias_0, bias_1 = bias
            else:
                bias_0, bias_1 = bias, None
            config_tuple = self._config(config, self.get_combine_config)
            x_shape = self._shape(x, "x")
            hidden = x_shape[-1] if len(x_shape) else 0
            topk = None
            if topk_weights is not None:
                w_shape = self._shape(topk_weights, "topk_weights")
                topk = w_shape[-1] if len(w_shape) else 0
            num_tokens = native_handle.num_tokens
        except BaseException:
            self._begun()
            raise
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            stream, reuse = self._current_stream(), self._reusable()
            key = ("combine", num_tokens, hidden, topk, stream)
            outs = reuse.take(key) if reuse is not None else None
            if outs is None:
                outs = self._combine_outputs(num_tokens, hidden, topk)
                if reuse is not None:
                    reuse.keep(key, outs)
            combined_x, combined_w = outs
            self._native.combine_into(x, native_handle, combined_x, topk_weights, combined_w, bias_0, bias_1, config_tuple,
                                      stream, True)
            return combined_x, combined_w, _NO_EVENT
        compute = self._enter(previous_event, allocate_on_comm_stream)
        try:
            combined_x, combined_w = self._combine_outputs(num_tokens, hidden, topk)
            self._native.combine_into(x, native_handle, combined_x, topk_weights, combined_w, bias_0, bias_1, config_tuple,
                                      self._launch_stream(), True)
        finally:
            self._leave(compute, allocate_on_comm_stream)
        event = self._finish(compute, async_finish, allocate_on_comm_stream, [x, topk_weights, bias_0, bias_1],
                             [combined_x, combined_w])
        return combined_x, combined_w, event

    def _combine_outputs(self, num_tokens: int, hidden: int, topk: Optional[int]) -> Tuple[Any, Any]:
        t = require_torch()
        combined_x = self._empty((num_tokens, hidden), t.bfloat16)
        combined_w = None if topk is None else self._empty((num_tokens, topk), t.float32)
        return combined_x, combined_w

    # ------------------------------------------------------------------ low-latency

    def _collective_on_comm(self, fn: Callable[[Optional[int]], None]) -> None:
        """Runs a synchronous collective step on the communication stream, ordered with the caller's."""
        compute = self._enter(None, False)
        fn(self._launch_stream())
        self._finish(compute, False, False, [], [])

    @_collective
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Clears the low-latency buffers (collective), e.g. after high-throughput use of the buffer."""
        args = (_count(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", self.rank),
                _count(hidden, "hidden", self.rank), _count(num_experts, "num_experts", self.rank))
        self._collective_on_comm(lambda stream: self._native.clean_low_latency_buffer(*args, stream=stream))

    def _ll_stream(self, async_finish: bool, return_recv_hook: bool) -> Tuple[Any, Optional[int]]:
        """(caller's stream or None, launch stream handle) of a low-latency call. Without ``async_finish`` the
        kernels run on the caller's stream (a receive hook's send phase too), ordered with its work without an
        event; with it, on the communication stream after it waited for the caller's."""
        if async_finish and return_recv_hook:
            raise _invalid(ValueError, "return_recv_hook", self.rank, "return_recv_hook=True is incompatible with async_finish=True")
        if not async_finish or not self._cuda:
            return None, self._current_stream()
        compute = require_torch().cuda.current_stream(self._device)
        self._comm_stream.wait_stream(compute)
        return compute, self._comm_stream.cuda_stream

    def _ll_finish(self, compute: Any, tensors: Sequence[Any]) -> EventOverlap:
        """The event of an ``async_finish`` call (``compute`` not None): recorded on the communication stream,
        keeping the call's tensors alive."""
        if compute is None:
            return _NO_EVENT
        return EventOverlap(record_event(self._comm_stream), [x for x in tensors if x is not None])

    def _hook(self, native_hook: Any, keep: Sequence[Any]) -> Optional[Callable[[], None]]:
        """The Python ``hook()`` of a receive phase; it keeps the call's tensors alive until it has run."""
        if native_hook is None:
            return None
        kept: Tuple[Any, ...] = tuple(keep)

        def hook() -> None:
            nonlocal kept
            stream = require_torch().cuda.current_stream(self._device).cuda_stream if self._cuda else None
            self._native.run_hook(native_hook, stream=stream)
            kept = ()  # the tensors the receive phase writes were held until here

        return hook

    @_without_torch_function_modes
    def low_latency_dispatch(self, x: Tensor, topk_idx: Tensor, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, topk_weights: Optional[Tensor] = None
                             ) -> Tuple[Union[Tensor, Tuple[Tensor, Tensor]], Tensor, LowLatencyHandle, EventOverlap,
                                        Optional[Callable[[], None]]]:
        """Low-latency dispatch (collective; no CPU synchronisation, CUDA-graph capturable).

        ``x``: ``bf16 [T, H]`` with ``T <= num_max_dispatch_tokens_per_rank`` (the same on every rank).
        Returns ``(recv_x, recv_count, handle, event, hook)``: ``handle`` is DeepEP's 5-tuple
        ``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``
        (``LowLatencyHandle``); ``recv_x`` is ``bf16 [E_local, R*T_max, H]``,
        or with ``use_fp8`` a tuple ``(float8_e4m3fn [E_local, R*T_max, H], scales)`` with ``float32
        [E_local, R*T_max, H/128]`` scales (``use_ue8m0``: ``int32 [..., H/512]``, four exponent bytes each;
        requires ``round_scale``), column-major in the last two dims. ``recv_count int32 [E_local]`` counts
        the valid rows per local expert. ``cumulative_local_expert_recv_stats int32 [E_local]`` is
        incremented by the counts, ``dispatch_wait_recv_cost_stats int64 [R]`` by the nanoseconds waited
        per source rank. With ``return_recv_hook`` only the send phase runs; ``hook()`` runs the receive
        phase. **(ext)** ``topk_weights float32 [T, K]``: lets combine pre-reduce on the expert side (pass
        the same weights to ``low_latency_combine``).
        """
        try:  # what this layer refuses still counts as the collective call it began (`_collective`)
            x_shape = self._shape(x, "x")
            hidden = x_shape[-1] if len(x_shape) else 0
            t_max = _count(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", self.rank)
            num_experts = _count(num_experts, "num_experts", self.rank)
            if async_finish:
                compute, stream = self._ll_stream(async_finish, return_recv_hook)
                reuse = self._reusable() if compute is None else None
            else:  # the usual call: the caller's stream, outputs reused where unreferenced
                compute, stream, reuse = None, self._current_stream(), self._reusable()
            use_fp8, use_ue8m0 = bool(use_fp8), bool(use_ue8m0)
            key = ("ll_dispatch", t_max, num_experts, hidden, use_fp8, use_ue8m0, stream)
            outs = reuse.take(key) if reuse is not None else None
            if outs is None:
                outs = self._ll_dispatch_outputs(t_max, num_experts, hidden, use_fp8, use_ue8m0)
                if reuse is not None:
                    reuse.keep(key, outs)
        except BaseException:
            self._begun()
            raise
        recv_x, recv_scales, recv_count, src_info, layout_range = outs
        native_handle, native_hook = self._native.low_latency_dispatch_into(
            x, topk_idx, t_max, num_experts, recv_x, recv_count, topk_weights, recv_scales, use_fp8, bool(round_scale),
            use_ue8m0, bool(return_recv_hook), cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
            src_info, layout_range, stream, True)
        hook = None
        if compute is not None or native_hook is not None:
            tensors = [x, topk_idx, topk_weights, recv_x, recv_scales, recv_count, cumulative_local_expert_recv_stats,
                       dispatch_wait_recv_cost_stats, src_info, layout_range]
            event = self._ll_finish(compute, tensors)
            hook = self._hook(native_hook, tensors)
        else:
            event = _NO_EVENT
        out_x = (recv_x, recv_scales) if recv_scales is not None else recv_x
        setattr(src_info, _NATIVE_ATTR, native_handle)
        ll_handle = LowLatencyHandle((src_info, layout_range, t_max, hidden, num_experts), native_handle)
        return out_x, recv_count, ll_handle, event, hook

    def _ll_dispatch_outputs(self, t_max: int, num_experts: int, hidden: int, use_fp8: bool,
                             use_ue8m0: bool) -> Tuple[Any, ...]:
        """``(recv_x, recv_x_scales or None, recv_count, src_info, layout_range)``, unfilled."""
        t = require_torch()
        e_local, rows = num_experts // self.group_size, self.group_size * t_max
        packs = hidden // 512 if use_ue8m0 else hidden // 128
        recv_count, layout_range = self._alloc("num_experts", ("recv_count", (e_local,), t.int32),
                                               ("layout_range", (e_local, self.group_size), t.int64))
        recv_x, recv_scales, src_info = self._alloc(
            "num_max_dispatch_tokens_per_rank",
            ("recv_x", (e_local, rows, hidden), t.float8_e4m3fn if use_fp8 else t.bfloat16),
            ("recv_x_scales", (e_local, packs, rows), t.int32 if use_ue8m0 else t.float32) if use_fp8 else None,
            ("src_info", (e_local, rows), t.int32))
        if recv_scales is not None:
            recv_scales = recv_scales.transpose(1, 2)
        return recv_x, recv_scales, recv_count, src_info, layout_range

    @_without_torch_function_modes
    def low_latency_combine(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, handle: LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[Tensor] = None
                            ) -> Tuple[Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Low-latency combine (collective): ``combined_x[t] = Σ_k topk_weights[t,k]·y[t,k]`` in fp32,
        skipping -1 slots, rounded to bf16.

        ``x``: ``bf16 [E_local, R*T_max, H]`` laid out like ``recv_x`` (with ``zero_copy=True`` the buffer from
        ``get_next_low_latency_combine_buffer`` is sent instead). ``out``: an optional ``bf16 [T, H]`` output.
        ``combine_wait_recv_cost_stats int64 [R]`` is incremented by the nanoseconds waited per rank.
        ``use_logfmt`` is not supported. Returns ``(combined_x, event, hook)``.
        """
        try:  # what this layer refuses still counts as the collective call it began (`_collective`)
            if use_logfmt:
                raise _invalid(ValueError, "use_logfmt", self.rank, "LogFMT is not supported by moelink (combine sends bf16)")
            native_handle = _native_of(handle, LowLatencyHandle, 5, "src_info", self.rank, "low_latency_dispatch")
            if async_finish:
                compute, stream = self._ll_stream(async_finish, return_recv_hook)
            else:
                compute, stream = None, self._current_stream()
            if out is None:
                shape = (native_handle.num_tokens, native_handle.hidden)
                reuse = self._reusable() if compute is None else None
                key = ("ll_combine", shape, stream)
                kept = reuse.take(key) if reuse is not None else None
                if kept is None:
                    kept = (self._empty(shape, require_torch().bfloat16),)
                    if reuse is not None:
                        reuse.keep(key, kept)
                out = kept[0]
                del kept
        except BaseException:
            self._begun()
            raise
        native_hook = self._native.low_latency_combine_into(
            x, topk_idx, topk_weights, native_handle, out, bool(zero_copy), bool(return_recv_hook),
            combine_wait_recv_cost_stats, stream, True)
        if compute is None and native_hook is None:
            return out, _NO_EVENT, None
        tensors = [x, topk_idx, topk_weights, out, combine_wait_recv_cost_stats]
        return out, self._ll_finish(compute, tensors), self._hook(native_hook, tensors)

    @_without_torch_function_modes
    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> Tensor:
        """A ``bf16 [E_local, R*T_max, H]`` view of the next combine's send buffer: write expert outputs
        there and call ``low_latency_combine(..., zero_copy=True)`` to skip a copy. The view belongs to the
        buffer; it stays valid until a low-latency call with other sizes, ``clean_low_latency_buffer`` or
        ``destroy``."""
        native_handle = _native_of(handle, LowLatencyHandle, 5, "src_info", self.rank, "low_latency_dispatch")
        return self._wrap_view(self._native.get_next_low_latency_combine_buffer(native_handle))

    def low_latency_update_mask_buffer(self, rank: int, mask: bool = False) -> None:
        """Shrink mode (``enable_shrink=True``): masks ``rank`` (``mask=True``: treated as failed, neither
        sent to nor waited for) or unmasks it."""
        self._native.low_latency_update_mask_buffer(_count(rank, "rank", self.rank), bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: Tensor) -> None:
        """Shrink mode: writes each rank's mask status into ``mask_status`` (``int32 [R]``; 1 = masked)."""
        t = require_torch()
        self._tensor(mask_status, "mask_status")
        if mask_status.numel() != self.group_size:
            raise _invalid(ValueError, "mask_status", self.rank,
                           f"has {mask_status.numel()} elements, expected one per rank ({self.group_size})")
        masks = self._native.low_latency_query_mask_buffer()
        mask_status.copy_(t.tensor([int(m) for m in masks], dtype=mask_status.dtype).view(mask_status.shape))

    def low_latency_clean_mask_buffer(self) -> None:
        """Shrink mode: unmasks every rank."""
        self._native.low_latency_clean_mask_buffer()

    def __repr__(self) -> str:
        return f"<moelink.Buffer rank {self.rank} of {self.group_size} on {self._device} ({self.backend} backend)>"
