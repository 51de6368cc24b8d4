"""One rank of a multi-process engine: its share of the model, its KV cache, its loop.

`worker_main` is what the engine spawns per rank. It joins the process group, loads the
model and keeps its shard (`tensor_parallel.shard_model`) or its stage
(`pipeline.make_stage`), says it is ready, then serves commands from the engine's pipe until
told to stop: "execute_model" with the scheduler's plan of a step (every rank gets the same
plan; the driver rank answers with the sampled tokens, the others with None) or the name of
a `Worker` method. An exception is sent back with its traceback before the process exits, so
the engine can report it and stop the other ranks.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from minillm.core.scheduler import SchedulerOutput
from minillm.distributed.disaggregation import KVTransferConfig, disaggregated_worker
from minillm.distributed.parallel_state import (
    CollectiveCounts,
    Communicator,
    ParallelConfig,
    init_process_group,
    set_wait_flags,
)
from minillm.distributed.pipeline import (
    EarlyReceives,
    StageTiming,
    make_stage,
    run_stage,
    split_micro_batches,
)
from minillm.distributed.tensor_parallel import shard_model
from minillm.model.loader import load_model
from minillm.model.moe import routing_recorder
from minillm.outputs import SampledToken
from minillm.worker.model_runner import ModelRunner, prepare_inputs
from minillm.worker.sampler import Sampler

# per-step records kept on each rank (a bounded window, like the engine's statistics)
STEP_RECORDS = 1024
# steps whose random streams the driver keeps: more than the batches that may be in flight
STREAM_STEPS = 16


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every rank needs to build its part; the same for all ranks."""

    model: str
    dtype: str | None
    device_type: str  # "cpu" or "cuda"
    attention_backend: str
    parallel: ParallelConfig
    num_blocks: int
    block_size: int
    seed: int
    num_micro_batches: int  # pipeline parallelism: micro-batches per step (at most)
    port: int
    # pipeline parallelism: batches kept in flight across steps, each one micro-batch (a
    # stage does not wait for the next one to receive a batch before it takes the next)
    batches_in_flight: bool = False
    # prefill/decode disaggregation: a prefill rank and a decode rank (minillm.distributed.
    # disaggregation) instead of model parallelism
    kv_transfer: KVTransferConfig | None = None

    @property
    def world_size(self) -> int:
        return 2 if self.kv_transfer is not None else self.parallel.world_size


@dataclasses.dataclass(slots=True)
class StepRecord:
    """What one rank did in one step: tokens, collectives (calls and bytes), for a
    pipeline stage its timing, and for a mixture-of-experts model the tokens routed to each
    expert of each of its MoE layers ({layer: [count per expert]})."""

    step: int
    num_tokens: int
    num_sampled: int
    collectives: CollectiveCounts
    timing: StageTiming | None = None
    expert_load: dict[int, list[int]] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class StageFault:
    """A pipeline stage's answer to a step it raised on (the ranks stay in step)."""

    rank: int
    traceback: str


class Worker:
    """The model shard, KV cache and sampler of one rank."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        self.rank, self.spec = rank, spec
        parallel = spec.parallel
        self.comm = Communicator(rank, parallel.world_size)
        device = torch.device(f"cuda:{rank}" if spec.device_type == "cuda" else "cpu")
        loaded = load_model(spec.model, spec.dtype, device, spec.attention_backend)
        model = loaded.model
        if parallel.tensor_parallel_size > 1:
            model = shard_model(model, rank, self.comm, parallel.enable_expert_parallel)
            del loaded
        else:
            model = make_stage(
                model, rank, parallel.pipeline_parallel_size, parallel.pipeline_layer_partition
            )
        self.is_driver = rank == parallel.driver_rank
        generator = torch.Generator(device).manual_seed(spec.seed)
        self.runner = ModelRunner(model, Sampler(generator), spec.num_blocks, spec.block_size)
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=STEP_RECORDS)
        self.routing = model.model.routing  # None for a dense model
        # pipeline batches in flight (one micro-batch each): the hidden states this stage sent
        # that the next one may not have received yet; None: every step waits for its sends
        self.sends: list | None = [] if spec.batches_in_flight else None
        # the driver: its sequences' random streams before each recent step sampled, by step,
        # so that a step run again (a batch a stage raised on, each request alone) draws
        # what a clean run draws
        self.streams_before: collections.OrderedDict[int, dict] = collections.OrderedDict()
        # a pipeline stage after the first, over gloo: its hidden states' receives, posted as
        # plans come. Over NCCL a receive is a kernel on the stage's stream, and one posted
        # from the thread that reads the commands could reach the stream out of the order the
        # ranks agree on; there the stage receives when it turns to the batch.
        self.receives: EarlyReceives | None = None
        if parallel.pipeline_parallel_size > 1 and rank > 0 and dist.get_backend() == "gloo":
            hidden_size = model.config.hidden_size
            self.receives = EarlyReceives(self.comm, hidden_size, self.runner.dtype, device)

    def plan_arrived(self, plan: SchedulerOutput) -> None:
        """A step's plan has reached the rank (called by the thread that reads the commands,
        before the plan's turn): a later pipeline stage posts the receives of its
        micro-batches' hidden states now, so that they land while it computes the batches
        before it."""
        if self.receives is not None and plan.scheduled:
            self.receives.post(split_micro_batches(plan.scheduled, self.spec.num_micro_batches))

    def step_answered(self, step: int, taken_s: float, answered_s: float) -> None:
        """A pipeline stage's step `step` began when its plan was taken and ended when its
        answer was handed back: widen the step's timing to that (`StageTiming.widen`)."""
        if self.records and self.records[-1].step == step and self.records[-1].timing:
            self.records[-1].timing.widen(taken_s, answered_s)

    @torch.inference_mode()
    def execute_model(self, plan: SchedulerOutput) -> dict[str, SampledToken] | None:
        """The step on this rank; the driver returns the sampled tokens, the others None."""
        runner = self.runner
        self.comm.counts = CollectiveCounts()
        for request_id in plan.finished_req_ids:
            runner.generators.pop(request_id, None)
        runner.copy_blocks(plan.block_copies)
        scheduled = plan.scheduled
        if not scheduled:
            return {} if self.is_driver else None
        rows = [chunk.sampling_seqs for chunk in scheduled if chunk.samples]
        if self.routing is not None:
            self.routing.reset_load()
        timing, faults = None, []
        if self.spec.parallel.pipeline_parallel_size > 1:
            micro_batches = split_micro_batches(scheduled, self.spec.num_micro_batches)
            logits, timing, faults = run_stage(
                runner, self.comm, micro_batches, self.sends, self.receives
            )
            logits = torch.cat(logits) if logits else None
        else:
            inputs = prepare_inputs(scheduled, runner.block_size, runner.device)
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
            logits = runner.model.compute_logits(hidden[inputs.logits_indices])
        self.records.append(
            StepRecord(
                plan.step,
                sum(chunk.num_new_tokens for chunk in scheduled),
                len(rows),
                self.comm.counts,
                timing,
                None if self.routing is None else self.routing.load_lists(),
            )
        )
        if faults:
            return StageFault(self.rank, "\n".join(faults))
        if not self.is_driver:
            return None
        if not rows:
            return {}
        self._rewind_streams(plan.step, [seq.request_id for seqs in rows for seq in seqs])
        sampled = runner.sample(logits, rows)
        if timing is not None:  # the last stage's step ends once it has sampled (its own work)
            now = time.monotonic()
            timing.busy_s += now - timing.end_s
            timing.end_s = now  # the step's record holds this timing
        return sampled

    def _rewind_streams(self, step: int, seq_ids: list[str]) -> None:
        """Before the driver samples for `step`: the first time, note where the sequences'
        random streams are; when the step runs again (an earlier stage raised on its batch,
        whose rows this rank sampled from zeros all the same), put them back there first."""
        before = self.streams_before.get(step)
        if before is None:
            self.streams_before[step] = self.runner.generator_states(seq_ids)
            while len(self.streams_before) > STREAM_STEPS:
                self.streams_before.popitem(last=False)
            return
        self.runner.restore_generators({s: before[s] for s in seq_ids if s in before})

    def rewind_streams(self, steps: dict[str, int]) -> None:
        """The engine took steps back (Ctrl-C) after this rank sampled for them: put each
        sequence's random stream back to where it was before `steps[seq_id]` sampled, so
        that it does not draw again for the same token. A step this rank never sampled
        for drew nothing."""
        for seq_id, step in steps.items():
            before = self.streams_before.get(step, {})
            if seq_id in before:
                self.runner.restore_generators({seq_id: before[seq_id]})

    def step_records(self) -> list[StepRecord]:
        return list(self.records)

    def clear_step_records(self) -> None:
        self.records.clear()

    def routing_call(self, method: str, *args):
        """A RoutingRecorder method on this rank's model: start_record, stop_record,
        start_replay, stop_replay."""
        if method not in ("start_record", "stop_record", "start_replay", "stop_replay"):
            raise ValueError(f"unknown routing method {method!r}")
        return getattr(routing_recorder(self.runner.model), method)(*args)

    def kv_cache_heads(self) -> int:
        """KV heads this rank's cache holds per layer."""
        return self.runner.kv_caches[0].shape[3]


def _read_each(conn: Connection):
    """The commands from the engine's pipe, (command, args), each read when asked for."""
    while True:
        yield pickle.loads(conn.recv_bytes())


def _read_ahead(conn: Connection, arrived=None):
    """The commands from the engine's pipe, (command, args), read and unpickled by a thread
    into a queue as they arrive; `arrived(plan)` is called there for each step's plan."""
    commands: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            while True:
                command = pickle.loads(conn.recv_bytes())
                if arrived is not None and command[0] == "execute_model":
                    arrived(command[1][0])
                commands.put(command)
        except (EOFError, OSError):
            commands.put(None)
        except BaseException as error:  # noqa: BLE001 - raised by the rank's main thread
            commands.put(error)

    threading.Thread(target=read, name="commands", daemon=True).start()
    while (command := commands.get()) is not None:
        if isinstance(command, BaseException):
            raise command
        yield command
    raise EOFError


def worker_main(rank: int, spec: WorkerSpec, conn: Connection, wait_flags=None) -> None:
    """The body of a worker process: build the rank's Worker, then serve commands. Every
    command is answered, a step too (None from a rank that samples nothing), so the engine
    knows which rank finished; `wait_flags` is shared with the engine (`in_collective`)."""
    # a stalled rank: the engine asks for every thread's Python stack (SIGUSR1) before it
    # stops the ranks, so that the report says where it stood
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if wait_flags is not None:
            set_wait_flags(wait_flags, rank)
        init_process_group(rank, spec.world_size, spec.port, spec.device_type)
        if spec.device_type == "cuda":
            torch.cuda.set_device(rank)
        else:  # the ranks share the machine's cores instead of each taking all of them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        if spec.kv_transfer is not None:
            worker = disaggregated_worker(rank, spec)
            # the engine sends a prefill rank commands without waiting for it: read them as
            # they come, so that the pipe never fills and blocks the engine
            commands = _read_ahead(conn)
        elif spec.parallel.pipeline_parallel_size > 1:
            worker = Worker(rank, spec)
            # a pipeline stage reads them as they come too, so that a later stage posts the
            # receives of a batch's hidden states as soon as its plan is here
            commands = _read_ahead(conn, worker.plan_arrived)
        else:
            worker = Worker(rank, spec)
            commands = _read_each(conn)
        conn.send(("ready", None))
        for command, args in commands:
            if command == "shutdown":
                if hasattr(worker, "close"):
                    worker.close()
                break
            taken_s = time.monotonic()
            conn.send(("ok", getattr(worker, command)(*args)))
            if command == "execute_model" and isinstance(worker, Worker):
                worker.step_answered(args[0].step, taken_s, time.monotonic())
    except (EOFError, KeyboardInterrupt):
        pass  # the engine is gone or stopping us: nothing to report to
    except BaseException:  # noqa: BLE001 - reported to the engine, which raises it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
