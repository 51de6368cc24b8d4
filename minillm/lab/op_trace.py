"""Count the operations an eager PyTorch function runs and the bytes each one moves.

In eager mode PyTorch runs one operation at a time: on a GPU each operation is (at least)
one kernel launch, and each kernel reads its inputs from memory and writes its outputs back
to it, even when the very next operation reads them again. Counting the operations of a
function therefore gives the launches a step pays for, and summing their bytes gives the
memory traffic that fusing them into one kernel would save. `trace_ops` records both, by
running the function under a `TorchDispatchMode`, PyTorch's hook below autograd where every
call reaches an `aten` operator with its real tensors.

What counts as an operation: every `aten` call that computes or copies data. Views
(`view`, `transpose`, `expand`, slicing: a new shape over the same memory) and `empty`
allocations launch nothing, and are skipped.

What counts as bytes: every tensor argument is read whole and every tensor result is
written whole, at its dtype's size. That is exact for elementwise operations, reductions
and matrix multiplies, the operations fusion is about. It is an upper bound for gathers
such as `embedding` or `index_select`, which read only the rows they pick; and it ignores
caches, which on a CPU may hold a small tensor between operations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# operations that allocate or relabel memory without running a kernel over it
_NO_KERNEL = frozenset(
    {"empty", "empty_like", "empty_strided", "detach", "detach_", "lift_fresh", "alias"}
)


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One operation: its `aten` name and the bytes it reads and writes."""

    name: str  # e.g. "mul.Tensor"
    bytes_read: int
    bytes_written: int

    @property
    def num_bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def _tensor_bytes(values: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor)
    )


def _launches_kernel(func: torch._ops.OpOverload) -> bool:
    return not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _launches_kernel(func):
            name = f"{func.overloadpacket.__name__}.{func._overloadname}"
            self.records.append(OpRecord(name, _tensor_bytes((args, kwargs)), _tensor_bytes(out)))
        return out


def trace_ops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[OpRecord]]:
    """Run `fn(*args, **kwargs)`; return its result and the operations it ran, in order.

    >>> x = torch.ones(1000)
    >>> _, ops = trace_ops(lambda: (x * 2).sum())
    >>> [(op.name, op.bytes_read, op.bytes_written) for op in ops]
    [('mul.Tensor', 4000, 4000), ('sum.default', 4000, 4)]
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    recorder = _Recorder()
    with torch.no_grad(), recorder:
        result = fn(*args, **kwargs)
    return result, recorder.records


def total_bytes(records: list[OpRecord]) -> int:
    """Bytes all the operations read and write together."""
    return sum(op.num_bytes for op in records)
