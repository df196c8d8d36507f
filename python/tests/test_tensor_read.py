"""How the native module reads torch tensors: through torch's stable C shim once it passed its check on a probe
tensor, else through the tensors' attributes. Whatever the route, it reads what the attributes say — for
strided views with offsets, every moved dtype, zero-size and 0-d tensors, under a torch function mode —
and tensor subclasses and dtypes moelink does not move go the attribute route (whose errors name them).
Skipped without torch (a CPU build is enough)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moelink import _native  # noqa: E402 - after the skip

MOVED = [torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int32, torch.int64, torch.bool, torch.uint8]


def attributes(t: "torch.Tensor"):
    return (t.data_ptr(), str(t.dtype).removeprefix("torch."), tuple(t.shape), tuple(t.stride()),
            t.get_device() if t.is_cuda else -1)


def read(t: "torch.Tensor"):
    ptr, dtype, shape, strides, device = _native.read_tensor(t)
    return ptr, dtype, tuple(shape), tuple(strides), device


def test_this_torch_passes_the_shim_check():
    # torch >= 2.3 ships the shim and torch._C._aoti; a CPU build of it must take the fast route.
    assert _native.tensor_route() == "shim"


@pytest.mark.parametrize("dtype", MOVED)
def test_every_moved_dtype_reads_as_its_attributes_say(dtype):
    base = torch.zeros((6, 8, 16), dtype=torch.float32).to(dtype)
    for t in (base, base[1:, ::2, 3:], base.transpose(0, 2), base[2], base[:, :, 5], base[0, 0, 0], base[:0], base[:, 3:3]):
        assert read(t) == attributes(t), f"{dtype} {tuple(t.shape)} {tuple(t.stride())}"


def test_a_subclass_and_a_mode_read_as_their_attributes_say():
    t = torch.nn.Parameter(torch.ones(4, 4))[1:]
    assert read(t) == attributes(t)
    p = torch.nn.Parameter(torch.ones(3, 5))
    assert read(p) == attributes(p)
    with torch.device("cpu"):
        u = torch.ones(2, 3)[:, 1:]
        assert read(u) == attributes(u)


def test_a_dtype_moelink_does_not_move_is_named():
    with pytest.raises(TypeError) as info:
        _native.read_tensor(torch.zeros(3, dtype=torch.float16))
    assert "float16" in str(info.value) and "tensor" in str(info.value), str(info.value)
