"""What the two pages of chapter 4 (batching, scheduling and admission) share.

Each page of the book runs in a fresh kernel, so both pages import these instead of
redefining them:

- `make_engine(**options)`: a fresh engine on the bundled model, on the CPU, without prefix
  caching, with the given scheduler options (vLLM's names);
- `fixed_length(max_tokens)`: greedy sampling of exactly that many tokens, EOS ignored;
- `special_token_ids(tokenizer)`: the BOS and EOS ids, which random prompts leave out;
- `batching_workload(vocab_size, special_ids)`: the twelve requests on which the first page
  compares static and continuous batching;
- `batching_step_counts(workload, num_slots)`: the steps each batching type needs for them,
  replayed by the scheduler alone, so the second page's summary quotes them without rerunning
  the model;
- `exercise_points(path)`: the points of each graded cell of the exercise notebook.
"""

from __future__ import annotations

import pathlib

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.bench import Workload, make_workload
from minillm.lab.exercise_count import exercise_points as count_exercise_points
from minillm.lab.schedule_sim import simulate_schedule
from minillm.sampling_params import SamplingParams

MAX_MODEL_LEN = 1024  # the pages' engines: room for a 768-token prompt and its output
EXERCISE_NOTEBOOK = pathlib.Path(__file__).parents[2] / "exercises" / "ch04_scheduling.ipynb"


def make_engine(**options) -> LLMEngine:
    """A fresh engine on the bundled model, on the CPU, with the given scheduler options."""
    options.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLMEngine(EngineArgs(device="cpu", enable_prefix_caching=False, **options))


def fixed_length(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly max_tokens tokens: every system does the same work."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def special_token_ids(tokenizer) -> set[int]:
    """The tokenizer's BOS and EOS ids (those it has): random prompts avoid them."""
    return {t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None}


def batching_workload(vocab_size: int, special_ids: set[int]) -> Workload:
    """Twelve requests with prompts of 16 to 48 random ordinary tokens and 4 to 60 output
    tokens, the same for every call: the first page's static-versus-continuous comparison."""
    return make_workload(12, (16, 48), (4, 60), vocab_size, special_ids, seed=4)


def batching_step_counts(workload: Workload, num_slots: int) -> dict[str, int]:
    """Steps to serve `workload` with `num_slots` seats under static and under continuous
    batching, from minillm's scheduler without the model (`simulate_schedule`, at the
    engine's default budget of 2,048 tokens). The schedule depends on token counts only, so
    these are the step counts of the engine on the same requests."""
    requests = [(len(p), n) for p, n in zip(workload.prompts, workload.output_lens, strict=True)]
    return {
        batching_type: simulate_schedule(
            requests, max_num_seqs=num_slots, batching_type=batching_type
        ).num_steps
        for batching_type in ("static", "continuous")
    }


def exercise_points(path: str | pathlib.Path = EXERCISE_NOTEBOOK) -> list[int] | None:
    """The points of each graded cell of the exercise notebook at `path` (this chapter's by
    default), in order; None when it is not there."""
    return count_exercise_points(path)
