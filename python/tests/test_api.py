"""The Python surface against shared/API.md: every method, argument name, default and order, by inspection.

Runs without torch (``import moelink`` defers torch); where torch is installed a few checks use it.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Tuple

import pytest

import moelink
from moelink import Buffer, Config, EventOverlap
from moelink._torch import torch

_ = inspect.Parameter.empty
REQUIRED = _

# (name, default) in order, `self` omitted; REQUIRED for parameters without a default.
EXPECTED: Dict[str, List[Tuple[str, Any]]] = {
    "__init__": [("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "get_dispatch_layout": [("topk_idx", REQUIRED), ("num_experts", REQUIRED), ("previous_event", None),
                            ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
                 ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                 ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
                 ("async_finish", False), ("allocate_on_comm_stream", False)],
    "combine": [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None), ("config", None),
                ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                 ("num_experts", REQUIRED)],
    "low_latency_dispatch": [("x", REQUIRED), ("topk_idx", REQUIRED), ("num_max_dispatch_tokens_per_rank", REQUIRED),
                             ("num_experts", REQUIRED), ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
                             ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False),
                             ("topk_weights", None)],  # (ext), last so positional DeepEP calls are unaffected
    "low_latency_combine": [("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED), ("handle", REQUIRED),
                            ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                            ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", REQUIRED)],
    "low_latency_update_mask_buffer": [("rank", REQUIRED), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", REQUIRED)],
    "low_latency_clean_mask_buffer": [],
    "get_comm_stream": [],
    "get_local_buffer_tensor": [("dtype", REQUIRED), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "destroy": [],
}

STATIC: Dict[str, List[Tuple[str, Any]]] = {
    "is_sm90_compiled": [],
    "set_num_sms": [("new_num_sms", REQUIRED)],
    "capture": [],
    "get_dispatch_config": [("num_ranks", REQUIRED)],
    "get_combine_config": [("num_ranks", REQUIRED)],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                       ("num_ranks", REQUIRED), ("num_experts", REQUIRED)],
}


def params(fn: Any, drop_self: bool) -> List[Tuple[str, Any]]:
    ps = list(inspect.signature(fn).parameters.values())
    if drop_self:
        assert ps[0].name == "self"
        ps = ps[1:]
    return [(p.name, p.default) for p in ps]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_buffer_method_signatures(name):
    assert params(getattr(Buffer, name), drop_self=True) == EXPECTED[name]
    assert getattr(Buffer, name).__doc__, f"Buffer.{name} has a docstring"


@pytest.mark.parametrize("name", list(STATIC))
def test_static_methods(name):
    assert isinstance(inspect.getattr_static(Buffer, name), staticmethod), f"Buffer.{name} is a staticmethod"
    assert params(getattr(Buffer, name), drop_self=False) == STATIC[name]


def test_module_surface():
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t", "TimeoutError"):
        assert name in moelink.__all__
    assert issubclass(moelink.TimeoutError, RuntimeError)
    assert Buffer.num_sms == 20
    if torch is None:
        with pytest.raises(ImportError, match="PyTorch"):
            moelink.topk_idx_t  # noqa: B018
    else:
        assert moelink.topk_idx_t is torch.int64


def test_config():
    assert params(Config.__init__, drop_self=True) == [
        ("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
        ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256)]
    c = Config(24, 8, 256, 6, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens) == (24, 8)
    assert c == Config(24, 8, 256, 6, 128) and c != Config()
    assert c.get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert c.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert "num_sms=24" in repr(c)
    with pytest.raises(TypeError, match="num_sms"):
        Config(num_sms="20")
    with pytest.raises(ValueError, match="hidden_bytes"):
        c.get_nvl_buffer_size_hint(-1, 8)
    cfg = Buffer.get_dispatch_config(4)
    assert isinstance(cfg, Config) and cfg.num_sms == Buffer.num_sms
    assert isinstance(Buffer.get_combine_config(8), Config)


def test_static_utilities_without_a_buffer():
    assert isinstance(Buffer.is_sm90_compiled(), bool)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 4, 288) > 0
    with pytest.raises(ValueError) as info:
        Buffer.get_low_latency_rdma_size_hint(-1, 7168, 4, 288)
    assert info.value.argument == "num_max_dispatch_tokens_per_rank"
    with pytest.raises(ValueError) as info:
        Buffer.set_num_sms(7)
    assert info.value.argument == "new_num_sms"
    old = Buffer.num_sms
    try:
        Buffer.set_num_sms(24)
        assert Buffer.num_sms == 24 and Buffer.get_dispatch_config(2).num_sms == 24
    finally:
        Buffer.num_sms = old


def test_event_overlap_without_an_event():
    assert params(EventOverlap.__init__, drop_self=True) == [("event", None), ("extra_tensors", None)]
    ev = EventOverlap(None, extra_tensors=[1, 2])
    assert ev.extra_tensors == (1, 2)
    ev.current_stream_wait()  # nothing to wait for
    with ev as entered:
        assert entered is ev


@pytest.mark.skipif(torch is not None, reason="checks the message given where torch is absent")
def test_buffer_without_torch_says_why():
    with pytest.raises(ImportError, match="PyTorch"):
        Buffer(group=None)


def test_the_native_module_names_the_commit_it_was_built_from():
    # scripts/test-python.sh builds the wheel from this checkout, so the stamp is its HEAD; built outside a
    # git checkout the stamp is empty.
    import os
    import subprocess

    built = moelink._native.__build_commit__
    assert isinstance(built, str)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    if head.returncode == 0:
        assert built == head.stdout.strip()
