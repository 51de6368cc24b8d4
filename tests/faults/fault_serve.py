"""`minillm serve` with two faults injected into the engine's steps, for the HTTP soak.

    python -m tests.faults.fault_serve [--transient-every N] serve --port 0 ...
                                              (then the arguments of `minillm`)

- A poisoned request, one whose prompt (given as token ids) starts with `POISON`, fails every
  step that runs it: a persistent fault of that request alone, as a bad adapter or a device
  fault tied to its shapes would be. The engine must fail it with an error and serve the rest.
- Every `TRANSIENT_EVERY`-th step of two or more requests fails once, for no request's
  fault: the engine must run that step's requests again and lose nothing.

Both are raised from the model runner's `execute_model`, where a real fault would come from.
"""

from __future__ import annotations

import sys

from minillm.cli.main import main
from minillm.worker.model_runner import ModelRunner

# token ids no text prompt of the soak starts with
POISON = [7, 7, 7, 7, 13]
TRANSIENT_EVERY = 40


def is_poisoned(scheduled) -> bool:
    return scheduled.request.prompt_token_ids[: len(POISON)] == POISON


def arm(transient_every: int = TRANSIENT_EVERY) -> None:
    """Patch the runner; each injected fault is logged to stderr, so that the soak counts
    them in the server's log."""
    original = ModelRunner.execute_model
    batches = [0]

    def execute_model(self, scheduler_output):
        scheduled = scheduler_output.scheduled
        if any(is_poisoned(s) for s in scheduled):
            print("injected fault: poisoned", file=sys.stderr, flush=True)
            raise RuntimeError("injected fault: this request's step fails")
        if len(scheduled) >= 2:
            batches[0] += 1
            if batches[0] % transient_every == 0:
                print("injected fault: transient", file=sys.stderr, flush=True)
                raise RuntimeError("injected fault: a transient failure of a whole step")
        return original(self, scheduler_output)

    ModelRunner.execute_model = execute_model


if __name__ == "__main__":
    argv = sys.argv[1:]
    every = TRANSIENT_EVERY
    if argv[:1] == ["--transient-every"]:
        every, argv = int(argv[1]), argv[2:]
    arm(every)
    sys.exit(main(argv))
