"""``Config``: tuning knobs of one high-throughput operation (DeepEP's ``Config``)."""

from __future__ import annotations

from . import _native
from ._args import count as _count


class Config:
    """Performance knobs of a high-throughput dispatch or combine.

    moelink's direct-write protocol uses ``num_sms`` (thread blocks, one per SM; must be even); the chunk
    sizes are accepted for compatibility with DeepEP and only bound the receiver's copy granularity where
    the protocol has one.
    """

    __slots__ = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        self.num_sms = _count(num_sms, "num_sms")
        self.num_max_nvl_chunked_send_tokens = _count(num_max_nvl_chunked_send_tokens, "num_max_nvl_chunked_send_tokens")
        self.num_max_nvl_chunked_recv_tokens = _count(num_max_nvl_chunked_recv_tokens, "num_max_nvl_chunked_recv_tokens")
        self.num_max_rdma_chunked_send_tokens = _count(num_max_rdma_chunked_send_tokens, "num_max_rdma_chunked_send_tokens")
        self.num_max_rdma_chunked_recv_tokens = _count(num_max_rdma_chunked_recv_tokens, "num_max_rdma_chunked_recv_tokens")

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        """The five knobs in constructor order (what the native module takes)."""
        return (self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink-domain buffer bytes this config needs for rows of ``hidden_bytes`` across ``num_ranks``."""
        return _native.nvl_buffer_size_hint(self.as_tuple(), _count(hidden_bytes, "hidden_bytes"), _count(num_ranks, "num_ranks"))

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes this config needs (0 within one node of at most 8 ranks)."""
        return _native.rdma_buffer_size_hint(self.as_tuple(), _count(hidden_bytes, "hidden_bytes"), _count(num_ranks, "num_ranks"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.as_tuple() == other.as_tuple()

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        names = self.__slots__
        return "Config(" + ", ".join(f"{n}={getattr(self, n)}" for n in names) + ")"
