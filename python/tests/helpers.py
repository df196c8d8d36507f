"""Test helpers without torch: numpy arrays as native tensors, and ranks as threads of one process."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

NUMPY_NAMES = {np.dtype(np.int64): "int64", np.dtype(np.int32): "int32", np.dtype(np.float32): "float32",
               np.dtype(np.bool_): "bool", np.dtype(np.uint8): "uint8"}


class Arg(tuple):
    """The native module's tensor tuple ``(data_ptr, dtype, shape, strides, device)``, holding its array alive
    (``arg(bf16_bits(x))`` would otherwise pass the address of a freed temporary)."""

    array: np.ndarray


def arg(a: np.ndarray, dtype: Optional[str] = None) -> Arg:
    """A numpy array as a native tensor. bf16 arrays are uint16 bit patterns (``dtype="bfloat16"``), FP8 arrays
    uint8 (``dtype="float8_e4m3fn"``)."""
    name = dtype or NUMPY_NAMES[a.dtype]
    strides = tuple(s // a.itemsize for s in a.strides)
    t = Arg((a.__array_interface__["data"][0], name, tuple(a.shape), strides, -1))
    t.array = a
    return t


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values exactly representable in bf16 (e.g. small integers) as bf16 bit patterns."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any(), "values must be exact in bf16"
    return (bits >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """FP8 E4M3 (fn) bytes as float32."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = (8 + man) * np.exp2(exp - 10.0)
    sub = man * 2.0 ** -9
    v = np.where(exp == 0, sub, normal)
    v = np.where((exp == 0xF) & (man == 0x7), np.nan, v)
    return (sign * v).astype(np.float32)


def view_from_native(desc: Tuple[int, str, Sequence[int], Sequence[int], int], np_dtype: Any) -> np.ndarray:
    """A numpy view of native host memory ``(data_ptr, dtype, shape, strides, device)`` (contiguous)."""
    ptr, _, shape, strides, device = desc
    assert device == -1
    n = int(np.prod(shape))
    raw = (ctypes.c_char * (n * np.dtype(np_dtype).itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape)


class _Shared:
    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.slots: List[Optional[bytes]] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)


class ThreadGroup:
    """One rank of an in-process group for the native module: ``all_gather`` over a shared list."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared = shared
        self._rank = rank
        self.calls = 0

    @staticmethod
    def create(size: int, timeout: float = 30.0) -> List["ThreadGroup"]:
        shared = _Shared(size, timeout)
        return [ThreadGroup(shared, r) for r in range(size)]

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._shared.size

    def all_gather(self, data: bytes) -> List[bytes]:
        self.calls += 1
        sh = self._shared
        sh.slots[self._rank] = bytes(data)
        sh.barrier.wait()  # everyone has written
        out = [bytes(s) for s in sh.slots]  # type: ignore[arg-type]
        sh.barrier.wait()  # everyone has read before the next round writes
        return out


def run_ranks(size: int, fn: Callable[[ThreadGroup], Any], timeout: float = 60.0) -> List[Any]:
    """Runs ``fn(group)`` on ``size`` threads; returns results by rank, re-raising the first exception."""
    groups = ThreadGroup.create(size)
    results: List[Any] = [None] * size
    errors: List[Optional[BaseException]] = [None] * size

    def body(r: int) -> None:
        try:
            results[r] = fn(groups[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[r] = e
            groups[r]._shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank thread did not finish"
    # The root cause first: other ranks then fail inside the group (a broken barrier).
    def secondary(e: BaseException) -> bool:
        return isinstance(e, threading.BrokenBarrierError) or isinstance(e.__cause__, threading.BrokenBarrierError)

    for e in sorted((e for e in errors if e is not None), key=secondary):
        raise e
    return results
