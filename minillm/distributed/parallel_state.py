"""Process groups and the communicator every parallel layer talks through.

`ParallelConfig` checks the sizes a user asks for against the model and the machine before
any process starts. `Communicator` wraps the collectives the layers use (all-reduce,
all-gather, all-to-all, send/recv) and counts each call and its bytes, so that the engine can
report the traffic of every step. Bytes are the payload one rank hands to the collective (the
tensor's size), not what a ring or tree algorithm puts on the wire.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minillm.model.config import ModelConfig

# a collective that waits longer than this on a peer fails instead of hanging forever
COLLECTIVE_TIMEOUT_S = 120.0

# This rank's flag in an array shared with the engine's process: 1 while the rank waits in a
# collective (for its peers), 0 otherwise. When a step is late, the engine reads the flags to
# tell the rank that stalled (flag 0: it is computing, or stopped) from those waiting on it.
_wait_flags = None
_wait_rank = 0


def set_wait_flags(flags, rank: int) -> None:
    """Called once per worker process with the shared array the engine created."""
    global _wait_flags, _wait_rank
    _wait_flags, _wait_rank = flags, rank


@contextlib.contextmanager
def in_collective() -> Iterator[None]:
    """Marks this rank as waiting on its peers for the duration of the block."""
    if _wait_flags is None:
        yield
        return
    _wait_flags[_wait_rank] = 1
    try:
        yield
    finally:
        _wait_flags[_wait_rank] = 0


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is spread over processes: one of tensor or pipeline parallelism, with
    the experts of a mixture-of-experts model over the tensor-parallel ranks when asked."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # layers per pipeline stage, first to last (vLLM's VLLM_PP_LAYER_PARTITION); None: equal
    # shares, the first stages one more
    pipeline_layer_partition: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers: the last pipeline stage holds the LM head."""
        return self.world_size - 1 if self.pipeline_parallel_size > 1 else 0

    def check_options(self, max_world_size: int, device_type: str) -> None:
        """What can be judged without the model: sizes, their combination, the machine."""
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be True or False, got {self.enable_expert_parallel!r}"
            )
        self._check_partition()
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size cannot both be > 1 in minillm; "
                "choose one kind of model parallelism"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError(
                "enable_expert_parallel spreads the experts over the tensor-parallel ranks; "
                "give tensor_parallel_size >= 2"
            )
        if self.world_size > max_world_size:
            raise ValueError(
                f"{self.world_size} ranks asked for, but this machine allows at most "
                f"{max_world_size} on {device_type} (one process per "
                f"{'GPU' if device_type == 'cuda' else 'CPU core'})"
            )

    def check_model(self, config: ModelConfig) -> None:
        """What needs the model: every split must be whole."""
        tp = self.tensor_parallel_size
        if tp > 1:
            if config.num_attention_heads % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} must divide num_attention_heads "
                    f"({config.num_attention_heads})"
                )
            kv = config.num_key_value_heads
            if kv % tp and tp % kv:
                raise ValueError(
                    f"tensor_parallel_size={tp} and num_key_value_heads ({kv}) must divide one "
                    "another: each rank holds whole KV heads, or shares one with its neighbours"
                )
            if config.intermediate_size % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} must divide intermediate_size "
                    f"({config.intermediate_size})"
                )
            self._check_experts(config)
        pp = self.pipeline_parallel_size
        if pp > config.num_hidden_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} is more stages than the model's "
                f"{config.num_hidden_layers} layers"
            )
        partition = self.pipeline_layer_partition
        if partition is not None and sum(partition) != config.num_hidden_layers:
            raise ValueError(
                f"pipeline_layer_partition {partition} holds {sum(partition)} layers; the "
                f"model has {config.num_hidden_layers}"
            )

    def _check_partition(self) -> None:
        """An uneven split of the layers: one positive count per pipeline stage."""
        partition = self.pipeline_layer_partition
        if partition is None:
            return
        if not isinstance(partition, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in partition
        ):
            raise ValueError(
                'pipeline_layer_partition must be layers per stage, ints >= 1 (as "4,2" or '
                f"(4, 2)), got {partition!r}"
            )
        if len(partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"pipeline_layer_partition {partition} names {len(partition)} stages; "
                f"pipeline_parallel_size is {self.pipeline_parallel_size}"
            )

    def _check_experts(self, config: ModelConfig) -> None:
        """Experts spread whole need p | num_experts; experts cut in width need p | their
        widths."""
        tp = self.tensor_parallel_size
        if self.enable_expert_parallel:
            if not config.is_moe:
                raise ValueError(
                    "enable_expert_parallel needs a mixture-of-experts model; "
                    f"{config.architecture} has no experts"
                )
            if config.num_experts % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} (the expert-parallel size) must divide "
                    f"num_experts ({config.num_experts})"
                )
            return
        if not config.is_moe:
            return
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(config, name) % tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} must divide {name} ({getattr(config, name)}); "
                    "or spread whole experts over the ranks with enable_expert_parallel=True"
                )


def max_world_size(device_type: str) -> int:
    """One rank per GPU on CUDA; one per CPU core on the CPU."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def ranks_device(world_size: int) -> tuple[str, str]:
    """Where `world_size` ranks of a demonstration run: ("cuda", why) with a GPU per rank,
    else ("cpu", why): CPU processes over gloo. NCCL needs one GPU per rank, so a one-GPU
    machine (Colab's GPU runtime) runs multi-rank demonstrations on its CPU instead of
    failing; `why` says which was chosen and why, for the caller to print."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world_size:
        return "cuda", f"{world_size} GPUs over NCCL"
    if gpus:
        return "cpu", (
            f"{world_size} CPU processes over gloo: NCCL needs a GPU per rank and "
            f"{gpus} GPU{'s' if gpus > 1 else ''} {'are' if gpus > 1 else 'is'} visible"
        )
    return "cpu", f"{world_size} CPU processes over gloo (no GPU visible)"


def free_port() -> int:
    """A TCP port on the loopback interface that nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, device_type: str) -> None:
    """Join the group of `world_size` ranks: NCCL between GPUs, gloo between CPU processes."""
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


@dataclass(slots=True)
class CollectiveCounts:
    """Calls and payload bytes of each kind of collective, e.g. {"all_reduce": 25}."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, num_bytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + num_bytes


class Communicator:
    """The collectives of one rank, each counted in `counts` (reset by the caller per step)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.counts = CollectiveCounts()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        self.counts.add("all_reduce", x.numel() * x.element_size())
        with in_collective():
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order."""
        self.counts.add("all_gather", x.numel() * x.element_size())
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        with in_collective():
            dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """Rows x[sum(send_counts[:j]) : ...] go to rank j; returns the rows received, in rank
        order: [sum(recv_counts), ...]."""
        self.counts.add("all_to_all", x.numel() * x.element_size())
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        with in_collective():
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts)
        return out

    def send(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Start sending x to rank dst; wait on the returned handle before reusing x."""
        self.counts.add("send", x.numel() * x.element_size())
        return dist.isend(x.contiguous(), dst)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into x from rank src (blocking)."""
        with in_collective():
            dist.recv(x, src)
        return x

    def irecv(self, x: torch.Tensor, src: int) -> dist.Work:
        """Start receiving into x from rank src; x holds the data once the handle's wait()
        returns."""
        return dist.irecv(x, src)
