"""Counting the calls that make the host wait for the device: the decoding loop's host-sync budget.

On a GPU every read of a tensor's value on the host (`int(t)`, `t.item()`, `t.tolist()`, `if t:`), every op whose
output shape depends on values (`nonzero`, boolean-mask indexing, `unique`, `torch.equal`) and every copy to the
host (`.cpu()`, `.numpy()`, `.to("cpu")` of a device tensor) blocks the host until the device has finished all the
work queued before it: the host stops queueing, the device idles, and a step pays the launch latency again. On a
CPU nothing waits, so `SyncCounter` counts the calls that WOULD wait on a GPU; tests hold the loop to a budget
(tests/test_syncs.py) and benchmarks/speed/host_overhead.py reports the count per step.

Uploads wait too: `torch.tensor(data, device=cuda)` copies from pageable memory with a blocking copy, which
synchronises the stream (`memcpy_and_sync`), so it is counted as a sync ("upload"). `to_device` is the upload that
does not wait: pinned memory and a non-blocking copy on a GPU, a plain host tensor on the CPU. A host tensor
(`torch.tensor(data)` with no device) is not counted.

Nested calls inside a counted one are not counted again (a `TorchFunctionMode` is off while it handles a call).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and functions that read values on the host or size their output by them.
_SYNCING = {
    "__int__", "__float__", "__bool__", "__index__", "__complex__", "item", "tolist", "numpy", "cpu",
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "equal", "allclose", "is_nonzero",
}
_UPLOADS = {"tensor", "as_tensor"}


def to_device(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list, a number) as a tensor on `device` without making the host wait for the device's queue:
    on a GPU through pinned memory and a non-blocking copy (the caching host allocator keeps the pinned block
    until the copy has run), on the CPU the host tensor itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.tensor(data, dtype=dtype)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _is_host(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to(...)` call copies a non-CPU tensor to the host."""
    tensor = args[0]
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu":
        return False
    target = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            target = arg
    return _is_host(target)


def _bool_index(args: tuple) -> bool:
    """`t[mask]` with a boolean tensor index: its output size is the mask's count, read on the host."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter() as counter: ...` counts host syncs (`counter.syncs`, by name in `counter.by_name`; blocking
    uploads included) and host tensors made from Python data (`counter.uploads`) of the torch calls made inside, and
    all those calls (`counter.calls`: the host's dispatch work, which per-row Python makes grow with the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.uploads = 0
        self.calls = 0

    @property
    def syncs(self) -> int:
        return sum(self.by_name.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        name = getattr(func, "__name__", "")
        if name in _SYNCING:
            self.by_name[name] += 1
        elif name == "to" and _to_host(args, kwargs):
            self.by_name["to(cpu)"] += 1
        elif name == "__getitem__" and _bool_index(args):
            self.by_name["bool index"] += 1
        elif name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                                                         torch.Tensor) and kwargs.get("output_size") is None:
            self.by_name["repeat_interleave"] += 1
        elif name in _UPLOADS:
            if kwargs.get("device") is not None:  # straight onto a device: a blocking copy on a GPU
                self.by_name["upload"] += 1
            else:
                self.uploads += 1  # a host tensor (`to_device`'s, or host-side bookkeeping)
        return func(*args, **kwargs)
