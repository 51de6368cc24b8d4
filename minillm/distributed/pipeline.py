"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches in flight.

Stage s of p holds layers [start_s, end_s) (`stage_layers`); the first also holds the
embedding, the last the final norm and the LM head. One step's batch is cut into m
micro-batches of whole requests (`split_micro_batches`). Each stage runs micro-batch i as soon
as stage s-1 sends its hidden states and sends its own on without waiting for the receiver,
so while stage 1 works on micro-batch 0, stage 0 already computes micro-batch 1.

With equal micro-batches that each take t per stage, a step takes (m + p - 1) t of which each
stage is busy m t: the idle share, the pipeline bubble, is (p - 1) / (m + p - 1) (GPipe:
Huang et al., 2019). `run_stage` measures each stage's busy time so the bubble can be checked
against that formula. Stages need not take equal time: the last one also computes the
logits and samples, and `ParallelConfig.pipeline_layer_partition` may give the stages
unequal numbers of layers; the slowest stage then paces the pipeline
(`uneven_bubble_fraction`).

That bubble recurs every step when each step drains the pipeline before the next begins. A
serving engine can instead keep batches of different requests in flight across steps
(`EngineArgs.pipeline_batches_in_flight`): each batch is one micro-batch, the first stage
takes batch k + 1 while the second computes batch k, and over a run of n batches the pipeline
fills and drains once, (p - 1) / (n + p - 1). `run_bubble` measures the idle share over a
run of steps, whichever way they were run.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import traceback

import torch
from torch import nn

from minillm.core.scheduler import ScheduledRequest
from minillm.distributed.parallel_state import Communicator, in_collective
from minillm.model.llama import LlamaForCausalLM
from minillm.worker.model_runner import ModelRunner, prepare_inputs


def stage_layers(
    num_layers: int, stage: int, num_stages: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """[start, end) of the layers of `stage`: equal shares, the first stages one more, or
    `partition[s]` layers for stage s (`ParallelConfig.pipeline_layer_partition`, checked
    there)."""
    if partition is not None:
        start = sum(partition[:stage])
        return start, start + partition[stage]
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def make_stage(
    model: LlamaForCausalLM,
    stage: int,
    num_stages: int,
    partition: tuple[int, ...] | None = None,
) -> LlamaForCausalLM:
    """Trim a loaded model, in place, to what `stage` runs; its config counts its layers."""
    start, end = stage_layers(model.config.num_hidden_layers, stage, num_stages, partition)
    model.model.layers = nn.ModuleList(list(model.model.layers)[start:end])
    if stage > 0:
        model.model.embed_tokens = None
    if stage < num_stages - 1:
        model.model.norm = None
        model.lm_head = None
    model.config = dataclasses.replace(model.config, num_hidden_layers=end - start)
    return model


def split_micro_batches(
    scheduled: list[ScheduledRequest], num_micro_batches: int
) -> list[list[ScheduledRequest]]:
    """Cut the batch, in order, into at most num_micro_batches runs of whole requests with
    about the same number of tokens each (never an empty one)."""
    total = sum(chunk.num_new_tokens for chunk in scheduled)
    parts = min(num_micro_batches, len(scheduled))
    batches: list[list[ScheduledRequest]] = [[]]
    done = 0
    for i, chunk in enumerate(scheduled):
        left_requests, left_batches = len(scheduled) - i, parts - len(batches) + 1
        # start a new micro-batch once this one holds its share, or when every request left
        # is needed to fill the micro-batches still to come
        if batches[-1] and len(batches) < parts:
            if done >= total * len(batches) / parts or left_requests < left_batches:
                batches.append([])
        batches[-1].append(chunk)
        done += chunk.num_new_tokens
    return batches


@dataclasses.dataclass(slots=True)
class StageTiming:
    """One stage's share of one step: time busy, and when the stage began and ended the step
    (time.monotonic, one clock for every process of the machine).

    A worker's step begins when it takes the step's plan and ends once it has handed back
    its answer (`worker_main`). Busy is all the stage's own work on the step: taking the
    plan, preparing the micro-batches' inputs, its layers, on the last stage the logits and
    the sampling, and handing back the answer. Idle is waiting on another process: for the
    previous stage's hidden states, for the next stage to take this one's, and, between
    steps, for the engine's next plan. `host_s` is the part of busy spent outside the model
    on taking the plan and handing back the answer (0 until `worker_main` adds it)."""

    num_micro_batches: int
    busy_s: float
    start_s: float
    end_s: float
    host_s: float = 0.0

    def widen(self, taken_s: float, answered_s: float) -> None:
        """The step began when its plan was taken (taken_s) and ended once its answer was
        handed back (answered_s): the host work before and after counts as busy."""
        host_s = (self.start_s - taken_s) + (answered_s - self.end_s)
        self.busy_s += host_s
        self.host_s += host_s
        self.start_s, self.end_s = taken_s, answered_s


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of a pipelined step with equal micro-batches: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def uneven_bubble_fraction(stage_seconds: list[float], num_items: int) -> float:
    """The idle share of n equal items (micro-batches, or batches in flight) through stages
    that take t_s each per item, when a stage may run ahead of the next (its hidden states
    wait there): the first item crosses in sum(t), and after it the slowest stage lets one
    out every max(t), so the run takes sum(t) + (n - 1) max(t) while the stages are busy
    n sum(t) of p times that:

        1 - n sum(t) / (p (sum(t) + (n - 1) max(t))),

    which for equal stages (t_s = t) is (p - 1) / (n + p - 1), `bubble_fraction`."""
    total, slowest = sum(stage_seconds), max(stage_seconds)
    span = total + (num_items - 1) * slowest
    return 1.0 - num_items * total / (len(stage_seconds) * span)


def measured_bubble(step_timings: list[StageTiming]) -> float:
    """The idle share of one step as measured: 1 - (time all stages computed) / (stages x
    the step's span from the first stage's start to the last one's end)."""
    span_s = max(t.end_s for t in step_timings) - min(t.start_s for t in step_timings)
    busy_s = sum(t.busy_s for t in step_timings)
    return 1.0 - busy_s / (len(step_timings) * span_s)


def run_bubble(stage_timings: list[list[StageTiming]]) -> float:
    """The idle share of the stages over a run of steps (one list of step timings per stage):
    1 - (time all stages computed) / (stages x the run's span, from the first start of any
    stage to the last end)."""
    timings = [t for stage in stage_timings for t in stage]
    span_s = max(t.end_s for t in timings) - min(t.start_s for t in timings)
    busy_s = sum(t.busy_s for t in timings)
    return 1.0 - busy_s / (len(stage_timings) * span_s)


def bubble_parts(stage_timings: list[list[StageTiming]]) -> dict[str, float]:
    """Where the idle share of a run (`run_bubble`) goes; the three parts add up to it.

    - fill_and_drain: a stage has not begun its first step yet, or has ended its last;
    - within_steps: inside a step, the stage waits for another stage: for the hidden states
      it needs, or, when it runs ahead of a slower next stage, for that stage to take the
      ones it sent;
    - between_steps: the stage has ended one step and not begun the next: it waits for the
      other stages to end the step (steps drained), for the engine to take the tokens in
      and plan the next batch, and for that plan to reach it.
    With steps drained the schedule's own bubble falls in both of the last two (the last
    stage waits within the step for the first micro-batch; the first stage, done early,
    waits between steps). Each part is a share of stages x the run's span, as the bubble
    is."""
    timings = [t for stage in stage_timings for t in stage]
    first = min(t.start_s for t in timings)
    span_s = max(t.end_s for t in timings) - first
    total_s = len(stage_timings) * span_s
    fill_and_drain = within = between = 0.0
    for stage in stage_timings:
        fill_and_drain += stage[0].start_s - first + (first + span_s - stage[-1].end_s)
        within += sum(t.end_s - t.start_s - t.busy_s for t in stage)
        between += sum(b.start_s - a.end_s for a, b in zip(stage, stage[1:], strict=False))
    return {
        "fill_and_drain": fill_and_drain / total_s,
        "within_steps": within / total_s,
        "between_steps": between / total_s,
    }


class EarlyReceives:
    """A later stage's receives of hidden states, posted as soon as each plan reaches the
    rank, in the order the plans come (`Worker.plan_arrived`, from the thread that reads the
    engine's commands). While the stage computes one batch, the previous stage's hidden
    states for the next already land in their buffer, so the previous stage's send completes
    at once and the stage finds them there when it turns to that batch. Every plan reaches
    `run_stage` in the same order, one `take` per micro-batch."""

    def __init__(self, comm: Communicator, hidden_size: int, dtype, device) -> None:
        self.comm, self.hidden_size, self.dtype, self.device = comm, hidden_size, dtype, device
        self.posted: collections.deque = collections.deque()  # (rows, work, buffer)

    def post(self, micro_batches: list[list[ScheduledRequest]]) -> None:
        """Post the receives of one plan's micro-batches (each one's rows: its new tokens)."""
        for batch in micro_batches:
            rows = sum(chunk.num_new_tokens for chunk in batch)
            buffer = torch.empty((rows, self.hidden_size), dtype=self.dtype, device=self.device)
            self.posted.append((rows, self.comm.irecv(buffer, self.comm.rank - 1), buffer))

    def take(self, rows: int) -> torch.Tensor:
        """The oldest posted receive's hidden states, once they have landed."""
        posted_rows, work, buffer = self.posted.popleft()
        if posted_rows != rows:
            raise RuntimeError(f"posted a receive of {posted_rows} rows for a batch of {rows}")
        with in_collective():
            work.wait()
        return buffer


@torch.inference_mode()
def run_stage(
    runner: ModelRunner,
    comm: Communicator,
    micro_batches: list[list[ScheduledRequest]],
    sends: list | None = None,
    receives: EarlyReceives | None = None,
) -> tuple[list[torch.Tensor], StageTiming, list[str]]:
    """Run this stage over every micro-batch: receive hidden states from the previous stage
    (or embed the tokens), run the stage's layers, send on (or compute the logits of the
    sampling rows). Returns the last stage's logits per micro-batch, the timing, and the
    tracebacks of the micro-batches this stage raised on: such a micro-batch goes on as zeros
    of its shape, so that the next stages and the steps after stay in step, and its logits
    mean nothing (the engine runs its requests again, each alone).

    The step ends once the next stage has received every send, unless `sends` is given
    (batches in flight): the sends are then left in it, and this stage goes on to the next
    batch while the next stage finishes the previous one; the sends an earlier call left
    there are waited for before this one sends its own. So one batch's hidden states at most
    are on the way, the first stage at most one batch ahead of the next; letting it run
    further ahead (more sends on the way) measured no smaller bubble with three batches in
    flight (minillm.lab.pipeline_bench), since it then waits between steps for the engine's
    next plan instead. A later stage takes its hidden states from `receives` when given
    (posted as the plans arrived), else receives them now."""
    model, rank, size = runner.model, comm.rank, comm.world_size
    first, last = rank == 0, rank == size - 1
    start = time.monotonic()
    busy_s = 0.0
    logits, faults = [], []
    in_flight = sends is not None
    sends = [] if sends is None else sends
    for batch in micro_batches:
        began = time.monotonic()
        inputs = prepare_inputs(batch, runner.block_size, runner.device)
        if first:
            x = None
        else:  # waiting for the previous stage is idle time
            busy_s += time.monotonic() - began
            rows = len(inputs.input_ids)
            if receives is not None:
                x = receives.take(rows)
            else:
                shape = (rows, model.config.hidden_size)
                x = torch.empty(shape, dtype=runner.dtype, device=runner.device)
                x = comm.recv(x, rank - 1)
            began = time.monotonic()
        try:
            x = stage_forward(model, inputs, x, runner.kv_caches)
            if last:
                logits.append(model.compute_logits(x[inputs.logits_indices]))
        except Exception:  # noqa: BLE001 - reported to the engine with the step's answer
            faults.append(traceback.format_exc())
            rows = len(inputs.logits_indices) if last else len(inputs.input_ids)
            width = model.config.vocab_size if last else model.config.hidden_size
            x = torch.zeros(rows, width, dtype=runner.dtype, device=runner.device)
            if last:
                logits.append(x)
        if not last:
            if in_flight:  # at most one batch's hidden states on the way
                busy_s += time.monotonic() - began
                wait_sends(sends)
                began = time.monotonic()
            sends.append((comm.send(x, rank + 1), x))
        busy_s += time.monotonic() - began
    if not in_flight:
        wait_sends(sends)
    timing = StageTiming(len(micro_batches), busy_s, start, time.monotonic())
    return logits, timing, faults


def wait_sends(sends: list) -> None:
    """Wait until the next stage has received every send in `sends`, and empty it."""
    with in_collective():  # the next stage may still be busy with an earlier micro-batch
        for work, _ in sends:
            work.wait()
    sends.clear()


def stage_forward(model: LlamaForCausalLM, inputs, x: torch.Tensor | None, kv_caches):
    """The stage's layers over one micro-batch; the first stage embeds, the last normalizes."""
    inner = model.model
    if x is None:
        x = inner.embed_tokens(inputs.input_ids)
    rope = inner.make_rope(inputs.positions, x.dtype)
    for layer, kv_cache in zip(inner.layers, kv_caches, strict=True):
        x = layer(x, rope, kv_cache, inputs.meta)
    return x if inner.norm is None else inner.norm(x)
