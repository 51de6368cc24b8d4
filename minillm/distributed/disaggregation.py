"""Prefill/decode disaggregation: prompts run on one worker process, decode steps on another,
and each request's KV blocks move from the first to the second when its prefill is done.

`LLM(model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"})` spawns two
worker processes in one gloo (or NCCL) group, each with the whole model and a KV cache of the
same number of blocks: rank 0 is the KV producer (vLLM's `kv_role="kv_producer"`), rank 1 the
KV consumer (`"kv_consumer"`). The scheduler runs once, in the engine, and every step's plan
is split by phase (`split_plan`): prefill chunks go to rank 0, decode steps to rank 1, and
both run at the same time. The step is synchronous: it ends when both ranks have answered, KV
transfers included, so a decode step that shares a step with a long prefill chunk waits for it
(a decode gap is max(prefill chunk, decode step), not the decode step alone). Production
disaggregation (vLLM's connectors between separate engines) runs the two loops independently
and hands KV over asynchronously. A prefill chunk that reaches the end of its prompt samples
the first token on rank 0; then rank 0 sends the request's blocks, every layer's keys and
values, to rank 1 with one `torch.distributed` send (rank 1 writes them into the same block
ids, since one block table serves both), and the request decodes on rank 1 from the next step
on. The bytes and seconds of every transfer are recorded (`KVTransferRecord`).

vLLM's `KVTransferConfig` (v0.8 and later) names the connector (`kv_connector`: NIXL, P2P NCCL,
LMCache ...) and a role per instance, because there the producer and consumer are separate
engines behind a proxy. Here one engine owns both ranks, so `kv_role` can only be "kv_both"
(its default) and the connector only minillm's "TorchDistributedConnector".

What holds and what does not: greedy outputs equal a colocated engine's (the same model on
the same tokens, the same KV); prefix caching is off (a cached block may have been computed on
the other rank); a seeded sampled request draws its first token on rank 0 and the rest on
rank 1 from a fresh generator, so its tokens differ from a colocated run's; one rank per role.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from minillm.core.scheduler import SchedulerOutput
from minillm.distributed.parallel_state import in_collective
from minillm.model.loader import load_model
from minillm.outputs import SampledToken
from minillm.worker.model_runner import ModelRunner
from minillm.worker.sampler import Sampler

KV_CONNECTORS = ("TorchDistributedConnector",)
KV_ROLES = ("kv_both",)
PREFILL_RANK, DECODE_RANK = 0, 1


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """minillm's subset of vLLM's KVTransferConfig: the connector and the role."""

    kv_connector: str = "TorchDistributedConnector"
    kv_role: str = "kv_both"

    @classmethod
    def from_value(cls, value: object) -> KVTransferConfig:
        if isinstance(value, KVTransferConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(
                "kv_transfer_config must be a dict such as "
                f'{{"kv_connector": "TorchDistributedConnector"}}, got {type(value).__name__}'
            )
        unknown = sorted(set(value) - {"kv_connector", "kv_role"})
        if unknown:
            raise ValueError(
                f"kv_transfer_config has keys minillm does not use: {unknown}; "
                "expected kv_connector and kv_role"
            )
        config = cls(**value)
        if config.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config's kv_connector must be one of {list(KV_CONNECTORS)}, "
                f"got {config.kv_connector!r}"
            )
        if config.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config's kv_role must be 'kv_both' (one engine runs the producer "
                f"and the consumer), got {config.kv_role!r}"
            )
        return config


@dataclasses.dataclass(frozen=True, slots=True)
class KVTransferRecord:
    """One request's KV moved from the prefill rank to the decode rank."""

    request_id: str
    step: int
    num_blocks: int
    num_bytes: int
    seconds: float  # on the sender: from the start of the send until it completed


def split_plan(
    plan: SchedulerOutput, block_size: int
) -> tuple[SchedulerOutput, SchedulerOutput, list[tuple[str, list[int]]]]:
    """The step's prefill plan, its decode plan, and the (request id, block ids) whose KV
    moves after the step: the prefill chunks that sample (their prompt is done)."""
    prefill = [chunk for chunk in plan.scheduled if chunk.phase == "prefill"]
    decode = [chunk for chunk in plan.scheduled if chunk.phase != "prefill"]
    transfers = []
    for chunk in prefill:
        if chunk.samples:
            num_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            blocks = list(chunk.block_ids[: -(-num_tokens // block_size)])
            transfers.append((chunk.request.request_id, blocks))
    prefill_plan = dataclasses.replace(plan, scheduled=prefill)
    decode_plan = dataclasses.replace(plan, scheduled=decode)
    return prefill_plan, decode_plan, transfers


class DisaggregatedWorker:
    """One role's model runner, and its side of the KV transfers."""

    def __init__(self, rank: int, spec) -> None:
        self.rank = rank
        device = torch.device(f"cuda:{rank}" if spec.device_type == "cuda" else "cpu")
        model = load_model(spec.model, spec.dtype, device, spec.attention_backend).model
        generator = torch.Generator(device).manual_seed(spec.seed)
        self.runner = ModelRunner(model, Sampler(generator), spec.num_blocks, spec.block_size)
        self.is_driver = True  # both roles answer every step with the tokens they sampled
        self.transfers: list[KVTransferRecord] = []
        self.records: list = []

    @torch.inference_mode()
    def execute_model(
        self, plan: SchedulerOutput, transfers: list[tuple[str, list[int]]]
    ) -> dict[str, SampledToken]:
        sampled = self.runner.execute_model(plan)
        for request_id, blocks in transfers:
            if self.rank == PREFILL_RANK:
                self._send(request_id, plan.step, blocks)
            else:
                self._recv(blocks)
        return sampled

    def _send(self, request_id: str, step: int, blocks: list[int]) -> None:
        index = torch.tensor(blocks, device=self.runner.device)
        payload = torch.stack([cache.index_select(1, index) for cache in self.runner.kv_caches])
        start = time.perf_counter()
        with in_collective():
            dist.send(payload, DECODE_RANK)
        seconds = time.perf_counter() - start
        num_bytes = payload.numel() * payload.element_size()
        self.transfers.append(KVTransferRecord(request_id, step, len(blocks), num_bytes, seconds))

    def _recv(self, blocks: list[int]) -> None:
        caches = self.runner.kv_caches
        shape = (len(caches), 2, len(blocks), *caches[0].shape[2:])
        payload = torch.empty(shape, dtype=caches[0].dtype, device=self.runner.device)
        with in_collective():
            dist.recv(payload, PREFILL_RANK)
        index = torch.tensor(blocks, device=self.runner.device)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, index, payload[layer])

    def kv_transfer_records(self) -> list[KVTransferRecord]:
        return list(self.transfers)

    def clear_step_records(self) -> None:
        self.transfers.clear()

    def step_records(self) -> list:
        return []
