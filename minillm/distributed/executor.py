"""The engine's side of a multi-process model: spawn the ranks, hand them each step, stop them.

`MultiprocExecutor` starts one process per rank (`torch.multiprocessing`'s spawn, a free
loopback port for the process group), waits until every rank has built its part, and then
stands in for the model runner: `execute_model(plan)` sends the scheduler's plan to every rank
(the scheduler runs once, here, and its output is broadcast to all ranks) and returns the
driver rank's sampled tokens.

No wait is unbounded: while it waits for an answer it watches every process, and a rank
that raised or died makes it stop the others and raise `WorkerError` with the rank's
report. `shutdown` (also run by `LLM.shutdown`, a `with` block's end, and at exit) asks the
ranks to leave, then terminates those that do not.
"""

from __future__ import annotations

import pickle
import time
import weakref
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from minillm.core.scheduler import SchedulerOutput
from minillm.distributed.disaggregation import DECODE_RANK, PREFILL_RANK, split_plan
from minillm.distributed.worker import WorkerSpec, worker_main
from minillm.outputs import SampledToken

# the longest a rank may take to load and shard its model
STARTUP_TIMEOUT_S = 300.0
# how long ranks get to leave on their own before they are terminated
SHUTDOWN_GRACE_S = 10.0
EXIT_WAIT_S = 10.0  # how long a rank whose pipe closed may take to be reaped


class WorkerError(RuntimeError):
    """A rank raised, died, or did not answer; the executor has stopped all ranks."""


class MultiprocExecutor:
    """Worker processes for every rank, driven by the engine's process."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.driver_rank = spec.parallel.driver_rank
        context = mp.get_context("spawn")
        self.processes: list = []
        self.conns: list[Connection] = []
        self.is_shut_down = False
        self._answers: dict[int, object] = {}  # answers that came before they were awaited
        for rank in range(spec.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main, args=(rank, spec, child), name=f"minillm-rank{rank}"
            )
            process.daemon = True  # never outlives the engine's process
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        # stop the ranks of an engine that is garbage-collected, or alive at interpreter exit
        self._finalizer = weakref.finalize(self, _stop_processes, self.processes, self.conns)
        try:
            for rank in range(len(self.processes)):
                self._receive(rank, STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step on all ranks; the sampled token of every sampling sequence."""
        if self.spec.kv_transfer is not None:
            return self._execute_disaggregated(plan)
        self._broadcast("execute_model", plan)
        return self._receive(self.driver_rank, None)

    def _execute_disaggregated(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        """Prefill chunks on the prefill rank, decode steps on the decode rank, at once; the
        KV of each finished prefill moves between them at the end of the step."""
        prefill, decode, transfers = split_plan(plan, self.spec.block_size)
        for rank, part in ((PREFILL_RANK, prefill), (DECODE_RANK, decode)):
            self._send(rank, pickle.dumps(("execute_model", (part, transfers))))
        sampled = self._receive(PREFILL_RANK, None)
        sampled.update(self._receive(DECODE_RANK, None))
        return sampled

    def kv_transfer_records(self) -> list:
        """Prefill/decode disaggregation: every request's KV transfer (KVTransferRecord)."""
        return self.call("kv_transfer_records")[PREFILL_RANK]

    def call(self, method: str, *args) -> list:
        """Run a `Worker` method on every rank; its results in rank order."""
        self._broadcast(method, *args)
        return [self._receive(rank, None) for rank in range(len(self.processes))]

    def _broadcast(self, command: str, *args) -> None:
        if self.is_shut_down:
            raise WorkerError("the engine's worker processes have been shut down")
        payload = pickle.dumps((command, args))
        for rank in range(len(self.conns)):
            self._send(rank, payload)

    def _send(self, rank: int, payload: bytes) -> None:
        if self.is_shut_down:
            raise WorkerError("the engine's worker processes have been shut down")
        try:
            self.conns[rank].send_bytes(payload)
        except OSError as error:
            code = self._exit_code(rank)
            self._fail(f"rank {rank} cannot be reached ({error}, exit code {code})")

    def _receive(self, rank: int, timeout_s: float | None):
        """The answer of `rank`, while watching every process: a rank that reports an error
        or dies ends the wait (and all ranks) with WorkerError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while rank not in self._answers:
            ready = wait([*self.conns, *(p.sentinel for p in self.processes)], timeout=1.0)
            for other, conn in enumerate(self.conns):
                if conn in ready:
                    status, value = self._recv(other)
                    if status == "error":
                        self._fail(f"rank {other} failed:\n{value}")
                    self._answers[other] = value
            for other, process in enumerate(self.processes):
                if process.sentinel in ready and not self.conns[other].poll():
                    self._fail(f"rank {other} died (exit code {self._exit_code(other)})")
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"rank {rank} did not answer within {timeout_s:.0f} s")
        return self._answers.pop(rank)

    def _recv(self, rank: int) -> tuple[str, object]:
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            self._fail(f"rank {rank} died (exit code {self._exit_code(rank)})")

    def _exit_code(self, rank: int) -> int | None:
        """The exit code of a rank whose pipe has closed: it is dying, so wait for the
        kernel to reap it (on a loaded machine that can take more than a second)."""
        self.processes[rank].join(timeout=EXIT_WAIT_S)
        return self.processes[rank].exitcode

    def _fail(self, message: str):
        states = "; ".join(
            f"rank {rank} "
            + ("running" if p.exitcode is None else f"exited with code {p.exitcode}")
            for rank, p in enumerate(self.processes)
        )
        self.shutdown(grace_s=0.0)  # the others wait on the failed rank: no use asking them
        raise WorkerError(f"{message}\n(then: {states}); all worker processes have been stopped")

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask every rank to leave, terminate those that have not within grace_s; safe to
        call twice."""
        if self.is_shut_down:
            return
        self.is_shut_down = True
        self._finalizer.detach()
        _stop_processes(self.processes, self.conns, grace_s)


def _stop_processes(
    processes: list, conns: list[Connection], grace_s: float = SHUTDOWN_GRACE_S
) -> None:
    payload = pickle.dumps(("shutdown", ()))
    for conn, process in zip(conns, processes, strict=True):
        if process.is_alive():
            try:
                conn.send_bytes(payload)
            except OSError:
                pass
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()
