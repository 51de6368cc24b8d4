"""The engine's side of a multi-process model: spawn the ranks, hand them each step, stop them.

`MultiprocExecutor` starts one process per rank (a free loopback port for the process
group). On the CPU they start with fork, as vLLM's workers do where CUDA is not in use
(`VLLM_WORKER_MULTIPROC_METHOD`'s default), so a script without an `if __name__ ==
"__main__":` guard, or `python -c`, works; CUDA cannot be used in a forked child once the
parent has initialized it, so GPU ranks start with spawn, which re-imports the script's main
module, and a failed start says to add the guard. It waits until every rank has built its
part, and then stands in for the model runner: `execute_model(plan)` sends the scheduler's
plan to every rank (the scheduler runs once, here, and its output is broadcast to all ranks)
and returns the driver rank's sampled tokens. Prefill/decode disaggregation is the exception:
there the engine hands the prefill rank its chunks without waiting for it, waits for the decode
rank's step alone, and collects the prefill rank's answers as they come (`take_arrived`).
Pipeline parallelism with batches in flight is the other: `submit_model` hands every rank a
batch without waiting, and `collect_model` waits for the oldest batch's tokens, so that the
first stage computes the next batch while the last one still computes the previous.

No wait is unbounded: while it waits for an answer it watches every process, and a rank
that raised or died makes it stop the others and raise `WorkerError` with the rank's
report. Every rank answers every step, and a step that has not ended on every rank within
`step_timeout_s` fails the same way, naming the rank that stalled: each rank flags, in an
array shared with this process, when it waits in a collective for its peers, so the rank
not waiting is the one the others wait for (a stopped process, a hung kernel). `shutdown`
(also run by `LLM.shutdown`, a `with` block's end, and at exit) asks the ranks to leave,
then terminates those that do not.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import signal
import time
import weakref
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from minillm.core.scheduler import SchedulerOutput
from minillm.distributed.disaggregation import DECODE_RANK, PREFILL_RANK, split_plan
from minillm.distributed.worker import StageFault, WorkerSpec, worker_main
from minillm.outputs import SampledToken

# the longest a rank may take to load and shard its model
STARTUP_TIMEOUT_S = 300.0
# the longest one step (or one method call) may take on any rank; far above any step of the
# models minillm runs, far below gloo's and NCCL's own collective timeout
STEP_TIMEOUT_S = 60.0
# how long ranks get to leave on their own before they are terminated
SHUTDOWN_GRACE_S = 10.0
EXIT_WAIT_S = 10.0  # how long a rank whose pipe closed may take to be reaped


class WorkerError(RuntimeError):
    """A rank raised, died, or did not answer; the executor has stopped all ranks."""


class StageError(RuntimeError):
    """A pipeline stage raised on a step's batch; the ranks carry on with the next steps."""


def start_method(device_type: str) -> str:
    """fork for CPU ranks (fast, and no main guard needed) unless the platform lacks it or
    this process has initialized CUDA; spawn for GPU ranks."""
    import torch

    if device_type == "cuda" or torch.cuda.is_initialized():
        return "spawn"
    return "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def spawn_hint(method: str) -> str | None:
    """What to add when spawned ranks failed to start from a script: spawn runs the script's
    main module again in every rank, and without a guard that builds another engine there."""
    import sys

    main = sys.modules.get("__main__")
    if method != "spawn" or not getattr(main, "__file__", None):
        return None
    return (
        f"worker processes start with spawn here, which imports {main.__file__} again in each "
        'rank: put the code that builds the LLM under `if __name__ == "__main__":`'
    )


class _Late(Exception):
    """A wait passed its deadline; the caller names the ranks in its WorkerError."""


class MultiprocExecutor:
    """Worker processes for every rank, driven by the engine's process."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.driver_rank = spec.parallel.driver_rank
        self.start_method = start_method(spec.device_type)
        context = mp.get_context(self.start_method)
        self.processes: list = []
        self.conns: list[Connection] = []
        self.is_shut_down = False
        self.step_timeout_s = STEP_TIMEOUT_S
        # answers that came before they were awaited, per rank in order
        self._answers: dict[int, collections.deque] = {
            rank: collections.deque() for rank in range(spec.world_size)
        }
        # disaggregation: prefill commands rank 0 has not answered (when each was sent), when
        # it last answered one, and the transfers: first tokens per id (with when they came),
        # ids landed on rank 1, and what is ready for the scheduler
        self._prefills_sent: collections.deque[float] = collections.deque()
        self._last_prefill_answer_s = 0.0
        self._transfer_ids = itertools.count()
        self._first_tokens: dict[int, tuple[float, list]] = {}
        self._landed: set[int] = set()
        self._pending_finished: list[str] = []
        # an interrupted step (Ctrl-C): the decode answers still owed, the transfers the step
        # handed rank 0 (id, request id), and those the engine cancelled, by id, whose KV is
        # still to land in blocks the scheduler holds for them meanwhile
        self._decode_owed = 0
        self._step_transfers: list[tuple[int, str]] = []
        self._cancelled: dict[int, str] = {}
        # pipeline batches in flight: how many submitted batches no rank has answered yet, and
        # the ranks' answers to those read early (by `call`, `execute_model`), oldest first
        self._batches_owed = 0
        self._batches_answered: collections.deque = collections.deque()
        # 1 while a rank waits in a collective (set by the rank, read here when a step is late)
        self.wait_flags = context.Array("b", spec.world_size, lock=False)
        for rank in range(spec.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(rank, spec, child, self.wait_flags),
                name=f"minillm-rank{rank}",
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
                try:
                    self._receive(rank, STARTUP_TIMEOUT_S)
                except _Late:
                    self._fail(f"rank {rank} was not ready within {STARTUP_TIMEOUT_S:g} s")
        except WorkerError as error:
            self.shutdown()
            hint = spawn_hint(self.start_method)
            if hint:
                raise WorkerError(f"{error}\n{hint}") from None
            raise
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        """Run one step on all ranks; the sampled token of every sampling sequence."""
        if self.spec.kv_transfer is not None:
            return self._execute_disaggregated(plan)
        self._answer_batches_in_flight()  # the ranks run them first
        self._broadcast("execute_model", plan)
        return self._step_answer(self._receive_all())

    def _step_answer(self, answers: list) -> dict[str, SampledToken]:
        """The driver's tokens, or StageError when a pipeline stage raised on the step."""
        faults = [answer for answer in answers if isinstance(answer, StageFault)]
        if faults:
            raise StageError(
                "; ".join(f"rank {f.rank}: {f.traceback.strip().splitlines()[-1]}" for f in faults)
            )
        return answers[self.driver_rank]

    def submit_model(self, plan: SchedulerOutput) -> None:
        """Pipeline batches in flight: hand every rank the batch and return at once; each rank
        runs its stage of the batches in the order they were handed."""
        self._broadcast("execute_model", plan)
        self._batches_owed += 1

    def collect_model(self) -> dict[str, SampledToken]:
        """The sampled tokens of the oldest batch submitted and not yet collected."""
        if not self._batches_answered:
            self._batches_answered.append(self._receive_all())
            self._batches_owed -= 1
        return self._step_answer(self._batches_answered.popleft())

    def _answer_batches_in_flight(self) -> None:
        """Read the answers of every batch in flight, for collect_model to hand out later."""
        while self._batches_owed:
            self._batches_answered.append(self._receive_all())
            self._batches_owed -= 1

    def batches_in_flight(self) -> int:
        """Batches submitted whose tokens have not been collected."""
        return self._batches_owed + len(self._batches_answered)

    def _execute_disaggregated(self, plan: SchedulerOutput) -> dict[str, SampledToken]:
        """Hand the prefill chunks to rank 0 without waiting for them, run the decode step on
        rank 1 and wait for that alone; collect whatever rank 0 answered meanwhile (the first
        tokens of the prompts it finished) and the transfers rank 1 received (`take_arrived`)."""
        self._step_transfers = []  # until the engine has this step back, cancel_step's
        self._take_owed_decode_answers()
        prefill, decode, transfers = split_plan(plan, self.spec.block_size)
        self._pending_finished += plan.finished_req_ids
        if prefill.scheduled:
            tagged = [(next(self._transfer_ids), rid, blocks) for rid, blocks in transfers]
            prefill.finished_req_ids, self._pending_finished = self._pending_finished, []
            self._step_transfers = [(transfer_id, rid) for transfer_id, rid, _ in tagged]
            self._send(PREFILL_RANK, pickle.dumps(("execute_model", (prefill, tagged))))
            self._prefills_sent.append(time.monotonic())
        self._send(DECODE_RANK, pickle.dumps(("execute_model", (decode, ()))))
        self._decode_owed += 1
        self._take_owed_decode_answers(keep_last=True)
        sampled, landed = self._decode_answer()
        self._landed.update(landed)
        self._take_prefill_answers()
        self._check_transfers()
        return sampled

    def _decode_answer(self) -> tuple[dict, list[int]]:
        """Rank 1's answer to the oldest decode step it owes, within step_timeout_s."""
        try:
            answer = self._receive(DECODE_RANK, self.step_timeout_s)
        except _Late:
            self._fail(self._stall_report([DECODE_RANK]))
        self._decode_owed -= 1
        return answer

    def _take_owed_decode_answers(self, keep_last: bool = False) -> None:
        """After an interrupted step: wait for the decode steps rank 1 still owes (it runs
        every command it was sent, in order), keep the transfers they report as landed and
        drop their tokens, which the scheduler has taken back; keep_last leaves the newest
        one, the step now being run."""
        while self._decode_owed > (1 if keep_last else 0):
            _, landed = self._decode_answer()
            self._landed.update(landed)

    def cancel_step(self) -> list[str]:
        """The step being run was interrupted (Ctrl-C) and the engine takes it back: the KV
        transfers it handed rank 0 still happen (rank 0 runs every command it was sent), so
        they are cancelled instead. Their first tokens are dropped; each lands as a release
        of the blocks it writes into (`take_arrived`). Returns the ids of their requests,
        whose blocks the scheduler must hold until then."""
        cancelled = self._step_transfers
        self._step_transfers = []
        self._cancelled.update(cancelled)
        return [request_id for _, request_id in cancelled]

    def _take_prefill_answers(self, wait_for_all: bool = False) -> None:
        """Rank 0's answers so far (each: first tokens by transfer id), or, with
        wait_for_all, every one still owed; a rank 0 that answers none within step_timeout_s
        of the last (or of the command) fails the engine."""
        while self._prefills_sent:
            if self._answers[PREFILL_RANK]:
                answer = self._answers[PREFILL_RANK].popleft()
            elif wait_for_all:
                try:
                    answer = self._receive(PREFILL_RANK, self._prefill_time_left())
                except _Late:
                    self._fail(self._stall_report([PREFILL_RANK]))
            else:
                if self._prefill_time_left() <= 0:
                    self._fail(self._stall_report([PREFILL_RANK]))
                return
            now = time.monotonic()
            self._prefills_sent.popleft()
            self._last_prefill_answer_s = now
            for transfer_id, tokens in answer.items():
                if transfer_id in self._cancelled:
                    tokens = [(self._cancelled[transfer_id], None)]  # releases its blocks
                self._first_tokens[transfer_id] = (now, tokens)

    def _prefill_time_left(self) -> float:
        since = max(self._prefills_sent[0], self._last_prefill_answer_s)
        return since + self.step_timeout_s - time.monotonic()

    def _check_transfers(self) -> None:
        """A transfer rank 0 finished that has not landed on rank 1 within step_timeout_s
        fails the engine."""
        now = time.monotonic()
        for transfer_id, (sent_s, _) in self._first_tokens.items():
            if transfer_id not in self._landed and now - sent_s > self.step_timeout_s:
                self._fail(
                    f"the KV transfer {transfer_id} from rank {PREFILL_RANK} did not land on "
                    f"rank {DECODE_RANK} within {self.step_timeout_s:g} s"
                )

    def take_arrived(self) -> list[tuple[str, SampledToken]]:
        """Disaggregation: (sequence id, first token) of every request whose KV has landed on
        the decode rank and whose first token rank 0 has reported, in transfer order. A
        cancelled transfer comes as (request id, None): the blocks held for it are free now."""
        ready = sorted(t for t in self._first_tokens if t in self._landed)
        # taken, a transfer of the step being run is no longer on its way (`cancel_step`)
        self._step_transfers = [(t, r) for t, r in self._step_transfers if t not in ready]
        arrived = []
        for transfer_id in ready:
            arrived += self._first_tokens.pop(transfer_id)[1]
            self._landed.discard(transfer_id)
            self._cancelled.pop(transfer_id, None)
        return arrived

    def kv_transfer_records(self) -> list:
        """Prefill/decode disaggregation: every request's KV transfer (KVTransferRecord)."""
        return self.call("kv_transfer_records")[PREFILL_RANK]

    def call(self, method: str, *args) -> list:
        """Run a `Worker` method on every rank; its results in rank order."""
        self._take_prefill_answers(wait_for_all=True)  # disaggregation: rank 0's steps first
        self._answer_batches_in_flight()  # pipeline batches in flight: their answers first
        self._broadcast(method, *args)
        return self._receive_all()

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

    def _receive_all(self) -> list:
        """Every rank's answer to the oldest command not answered, within step_timeout_s; none
        is taken before all have come, so that a wait interrupted (Ctrl-C) loses none."""
        deadline = time.monotonic() + self.step_timeout_s
        for rank in range(len(self.processes)):
            try:
                self._await(rank, max(0.0, deadline - time.monotonic()))
            except _Late:
                late = range(rank, len(self.processes))
                self._fail(self._stall_report([r for r in late if not self._answers[r]]))
        return [self._answers[rank].popleft() for rank in range(len(self.processes))]

    def _stall_report(self, late: list[int]) -> str:
        """Which ranks did not answer in time, and which of them are waiting on the others."""
        waiting = [rank for rank in late if self.wait_flags[rank]]
        stalled = [rank for rank in late if not self.wait_flags[rank]]
        for rank in stalled:  # each prints the Python stack of its threads on its stderr
            if hasattr(signal, "SIGUSR1"):
                self._signal(rank, signal.SIGUSR1)
        limit = f"within {self.step_timeout_s:g} s"
        if not stalled:
            return f"ranks {late} did not finish the step {limit}, each waiting in a collective"
        names = ", ".join(f"rank {rank}" for rank in stalled)
        report = f"{names} did not finish the step {limit} and is not waiting on another rank"
        if waiting:
            report += f" (ranks {waiting} wait for it in a collective)"
        return report

    def _signal(self, rank: int, signum: int) -> None:
        """Send a live rank a signal (a rank already gone is left alone); give it a moment."""
        pid = self.processes[rank].pid
        if pid is not None and self.processes[rank].exitcode is None:
            try:
                os.kill(pid, signum)
                time.sleep(0.5)
            except ProcessLookupError:
                pass

    def _receive(self, rank: int, timeout_s: float | None):
        """The answer of `rank`, while watching every process: a rank that reports an error
        or dies ends the wait (and all ranks) with WorkerError."""
        self._await(rank, timeout_s)
        return self._answers[rank].popleft()

    def _await(self, rank: int, timeout_s: float | None) -> None:
        """Wait until `rank` has an answer waiting (see `_receive`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._answers[rank]:
            timeout = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready = wait([*self.conns, *(p.sentinel for p in self.processes)], timeout=timeout)
            for other, conn in enumerate(self.conns):
                if conn in ready:
                    status, value = self._recv(other)
                    if status == "error":
                        self._fail(f"rank {other} failed:\n{value}")
                    self._answers[other].append(value)
            for other, process in enumerate(self.processes):
                if process.sentinel in ready and not self.conns[other].poll():
                    self._fail(f"rank {other} died (exit code {self._exit_code(other)})")
            if deadline is not None and time.monotonic() > deadline and not self._answers[rank]:
                raise _Late

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
