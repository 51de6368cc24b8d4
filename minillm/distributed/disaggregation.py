"""Prefill/decode disaggregation: prompts run on one worker process, decode steps on another,
and each request's KV blocks move from the first to the second when its prefill is done.

`LLM(model, kv_transfer_config={"kv_connector": "TorchDistributedConnector"})` spawns two
worker processes in one gloo (or NCCL) group, each with the whole model and a KV cache of the
same number of blocks: rank 0 is the KV producer (vLLM's `kv_role="kv_producer"`), rank 1 the
KV consumer (`"kv_consumer"`). The scheduler runs once, in the engine, and every step's plan
is split by phase (`split_plan`): prefill chunks go to rank 0, decode steps to rank 1.

The two ranks do not wait for each other. The engine hands rank 0 its chunks and moves on; it
waits only for rank 1's decode step, so a decode step never waits for a prefill in flight
(its gap is the decode step plus the engine's own overhead, whatever the prompts arriving).
A chunk that reaches the end of its prompt samples the first token on rank 0, and rank 0 puts
a copy of the request's blocks, every layer's keys and values, in a transfer queue
(`PrefillWorker`): a thread of its own sends them with `torch.distributed` while rank 0 goes
on with the next prompt. On rank 1 a receiving thread writes them into the same block ids (one
block table serves both ranks) and the next decode step reports the transfer as landed
(`DecodeWorker`). Meanwhile the scheduler holds the request, with its blocks, in the state
vLLM V1 calls `WAITING_FOR_REMOTE_KVS`, and keeps stepping the running requests; once both
the first token (from rank 0) and the landing (from rank 1) are in, the request joins the
decode batch (`Scheduler.update_from_remote_kvs`). The bytes and seconds of every transfer
are recorded (`KVTransferRecord`). Every wait still has a deadline: a prefill rank that
answers nothing for `step_timeout_s`, or a transfer that does not land in that time, stops
the engine with an error that names the rank.

A step interrupted (Ctrl-C) is taken back by the engine, but both ranks still run what they
were sent: rank 0 still sends the KV of the prompts the step finished, into blocks the
scheduler would otherwise give to other requests at once. So those transfers are cancelled
(`MultiprocExecutor.cancel_step`): the scheduler keeps their blocks out of the pool until
each lands (`Scheduler.hold_for_transfer`), their first tokens are dropped, and the decode
answers still owed are taken in before the next step.

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
import queue
import threading
import time
import traceback

import torch
import torch.distributed as dist

from minillm.core.scheduler import SchedulerOutput
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
    moves after the step: the prefill chunks that sample (their prompt is done). Block copies
    (copy-on-write, for decodes) go with the decode plan only."""
    prefill = [chunk for chunk in plan.scheduled if chunk.phase == "prefill"]
    decode = [chunk for chunk in plan.scheduled if chunk.phase != "prefill"]
    transfers = []
    for chunk in prefill:
        if chunk.samples:
            num_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            blocks = list(chunk.block_ids[: -(-num_tokens // block_size)])
            transfers.append((chunk.request.request_id, blocks))
    prefill_plan = dataclasses.replace(plan, scheduled=prefill, block_copies=[])
    decode_plan = dataclasses.replace(plan, scheduled=decode)
    return prefill_plan, decode_plan, transfers


# the first message of every transfer: (transfer id, number of blocks); these ids say
# something else. The sender sends KEEPALIVE when idle, so that the receiver's wait never
# reaches the process group's timeout; STOP ends the receiver.
STOP, KEEPALIVE = -1, -2
KEEPALIVE_S = 10.0
# how long a decode step with nothing to run waits for a transfer to land before it answers
ARRIVAL_POLL_S = 0.005
# how long a closing rank waits for its transfer thread
CLOSE_TIMEOUT_S = 5.0


def _runner(rank: int, spec) -> ModelRunner:
    device = torch.device(f"cuda:{rank}" if spec.device_type == "cuda" else "cpu")
    model = load_model(spec.model, spec.dtype, device, spec.attention_backend).model
    generator = torch.Generator(device).manual_seed(spec.seed)
    return ModelRunner(model, Sampler(generator), spec.num_blocks, spec.block_size)


class PrefillWorker:
    """The prefill instance (rank 0): runs prompts' chunks, and puts the KV of every prompt
    it finishes in a transfer queue that a thread of its own sends to the decode rank, so
    that the next prompt's compute overlaps the send."""

    def __init__(self, rank: int, spec) -> None:
        self.runner = _runner(rank, spec)
        self.is_driver = True
        self.transfers: list[KVTransferRecord] = []
        self.queue: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.sender = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self.sender.start()

    @torch.inference_mode()
    def execute_model(
        self, plan: SchedulerOutput, transfers: list[tuple[int, str, list[int]]]
    ) -> dict[int, list[tuple[str, SampledToken]]]:
        """Run the prefill chunks; queue the KV of every prompt they finish. Returns, per
        transfer id, the first token of each of the request's sequences."""
        if self.error is not None:
            raise RuntimeError(f"the KV sender failed:\n{self.error}")
        sampled = self.runner.execute_model(plan)
        by_id = {chunk.request.request_id: chunk for chunk in plan.scheduled}
        first_tokens = {}
        for transfer_id, request_id, blocks in transfers:
            index = torch.tensor(blocks, device=self.runner.device)
            # a copy: later prompts may reuse these blocks on this rank before the send ends
            payload = torch.stack([c.index_select(1, index) for c in self.runner.kv_caches])
            self.queue.put((transfer_id, request_id, plan.step, index, payload))
            seqs = by_id[request_id].sampling_seqs
            first_tokens[transfer_id] = [(seq.request_id, sampled[seq.request_id]) for seq in seqs]
        return first_tokens

    def _send_loop(self) -> None:
        try:
            while True:
                try:
                    item = self.queue.get(timeout=KEEPALIVE_S)
                except queue.Empty:
                    dist.send(torch.tensor([KEEPALIVE, 0]), DECODE_RANK)
                    continue
                if item is None:
                    dist.send(torch.tensor([STOP, 0]), DECODE_RANK)
                    self.queue.task_done()
                    return
                transfer_id, request_id, step, index, payload = item
                start = time.perf_counter()
                dist.send(torch.tensor([transfer_id, len(index)]), DECODE_RANK)
                dist.send(index.cpu(), DECODE_RANK)
                dist.send(payload, DECODE_RANK)
                seconds = time.perf_counter() - start
                num_bytes = payload.numel() * payload.element_size()
                self.transfers.append(
                    KVTransferRecord(request_id, step, len(index), num_bytes, seconds)
                )
                self.queue.task_done()
        except Exception:  # noqa: BLE001 - reported by the next command
            self.error = traceback.format_exc()

    def _flush(self) -> None:
        """Wait until every queued transfer has been sent."""
        self.queue.join()
        if self.error is not None:
            raise RuntimeError(f"the KV sender failed:\n{self.error}")

    def kv_transfer_records(self) -> list[KVTransferRecord]:
        self._flush()
        return list(self.transfers)

    def clear_step_records(self) -> None:
        self._flush()
        self.transfers.clear()

    def step_records(self) -> list:
        return []

    def close(self) -> None:
        self.queue.put(None)
        self.sender.join(timeout=CLOSE_TIMEOUT_S)


class DecodeWorker:
    """The decode instance (rank 1): runs decode steps, never waiting for a prefill; a thread
    of its own receives each prompt's KV into the blocks the scheduler gave it and reports the
    transfer as landed with the next step's answer (vLLM V1: `finished_recving`)."""

    def __init__(self, rank: int, spec) -> None:
        self.runner = _runner(rank, spec)
        self.is_driver = True
        self.landed: list[int] = []
        self.lock = threading.Lock()
        self.arrival = threading.Event()
        self.error: str | None = None
        self.receiver = threading.Thread(target=self._recv_loop, name="kv-receiver", daemon=True)
        self.receiver.start()

    @torch.inference_mode()
    def execute_model(
        self, plan: SchedulerOutput, transfers=()
    ) -> tuple[dict[str, SampledToken], list[int]]:
        """The decode step's tokens, and the transfers that landed since the last step (with
        no decode to run, it waits a moment for one)."""
        if self.error is not None:
            raise RuntimeError(f"the KV receiver failed:\n{self.error}")
        sampled = self.runner.execute_model(plan)
        if not plan.scheduled:
            self.arrival.wait(ARRIVAL_POLL_S)
        with self.lock:
            landed, self.landed = self.landed, []
            self.arrival.clear()
        return sampled, landed

    @torch.inference_mode()
    def _recv_loop(self) -> None:
        caches = self.runner.kv_caches
        device = self.runner.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # a new thread starts on device 0
        try:
            while True:
                header = torch.empty(2, dtype=torch.int64)
                dist.recv(header, PREFILL_RANK)
                transfer_id, num_blocks = header.tolist()
                if transfer_id == STOP:
                    return
                if transfer_id == KEEPALIVE:
                    continue
                index = torch.empty(num_blocks, dtype=torch.int64)
                dist.recv(index, PREFILL_RANK)
                shape = (len(caches), 2, num_blocks, *caches[0].shape[2:])
                payload = torch.empty(shape, dtype=caches[0].dtype, device=device)
                dist.recv(payload, PREFILL_RANK)
                index = index.to(device)
                for layer, cache in enumerate(caches):
                    cache.index_copy_(1, index, payload[layer])
                with self.lock:
                    self.landed.append(transfer_id)
                    self.arrival.set()
        except Exception:  # noqa: BLE001 - reported by the next step
            self.error = traceback.format_exc()

    def kv_transfer_records(self) -> list[KVTransferRecord]:
        return []

    def clear_step_records(self) -> None:
        pass

    def step_records(self) -> list:
        return []

    def close(self) -> None:
        self.receiver.join(timeout=CLOSE_TIMEOUT_S)


def disaggregated_worker(rank: int, spec) -> PrefillWorker | DecodeWorker:
    return PrefillWorker(rank, spec) if rank == PREFILL_RANK else DecodeWorker(rank, spec)
