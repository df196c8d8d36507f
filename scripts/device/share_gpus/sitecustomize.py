"""Lets DeepEP's own tests, written for a GPU per rank and an NCCL group, run with their ranks sharing the GPUs
there are (processes under CUDA MPS): rank r binds GPU r mod count, and the group is gloo, since NCCL refuses
two ranks on one GPU. The tests themselves run unchanged.

Active only with MOELINK_SHARE_GPUS=1 and this folder on PYTHONPATH (scripts/device/steps/python.sh sets both
where fewer GPUs than ranks are lent). Nothing measured so is an NVLink figure: the ranks exchange through the
GPU's own memory.
"""

import os

if os.environ.get("MOELINK_SHARE_GPUS") == "1":
    import torch
    import torch.distributed as dist

    _count = torch.cuda.device_count()
    _set_device = torch.cuda.set_device
    _init_process_group = dist.init_process_group

    def _set_device_shared(device):  # type: ignore[no-untyped-def]
        index = torch.device(device).index if isinstance(device, (str, torch.device)) else int(device)
        _set_device((index or 0) % max(_count, 1))

    def _init_process_group_shared(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("backend") in (None, "nccl"):
            kwargs["backend"] = "gloo"
        kwargs.pop("device_id", None)  # a GPU per rank; with gloo the ranks bind theirs above
        return _init_process_group(*args, **kwargs)

    def _all_gather_into_tensor_shared(output, input, group=None, async_op=False):  # type: ignore[no-untyped-def]
        # As a list all-gather into views of `output` (gloo's all-gather into one tensor is not guaranteed).
        parts = list(output.view(-1, *input.shape).unbind(0))
        return dist.all_gather(parts, input, group=group, async_op=async_op)

    torch.cuda.set_device = _set_device_shared
    dist.init_process_group = _init_process_group_shared
    dist.all_gather_into_tensor = _all_gather_into_tensor_shared
