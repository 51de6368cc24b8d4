"""Multi-LoRA serving, live on the bundled model: adapters made on the fly, one batch.

Trained adapters are fine-tunes; here they are random low-rank updates, large enough to
change greedy tokens, so the page can show what matters without a download:

- `random_lora_weights`: {module name: (A [r, in], B [out, r])} for the linear layers a
  PEFT `target_modules` list names;
- `write_random_adapters`: adapters in PEFT's layout on disk, with their `LoRARequest`s;
- `mixed_batch_run`: one engine with `enable_lora=True` serving a batch that mixes the
  adapters and the base model, and each adapter's requests alone, so the page can compare
  the tokens and the engine steps of the two;
- `time_adapter_steps`: what a decode step costs with k distinct adapters in its batch,
  timed on the engine's own path, configurations interleaved and repeated.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time
from collections.abc import Sequence

import torch

from minillm.llm import LLM
from minillm.lora.request import LoRARequest
from minillm.model.loader import load_model
from minillm.model.lora import save_lora_adapter
from minillm.sampling_params import SamplingParams

BUNDLED = "minillm-stdlib-target"


def random_lora_weights(
    model: torch.nn.Module, targets: Sequence[str], rank: int, seed: int, std: float = 0.3
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A [r, in], B [out, r])} for every linear layer of `model` whose last
    name is in `targets`, normal with standard deviation `std`, drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=gen) * std
            b = torch.randn(module.out_features, rank, generator=gen) * std
            weights[name] = (a, b)
    return weights


def write_random_adapters(
    root: str | pathlib.Path,
    names: Sequence[str] = ("sql", "chat"),
    targets: Sequence[str] = ("q_proj", "v_proj"),
    rank: int = 8,
    model: str = BUNDLED,
) -> dict[str, LoRARequest]:
    """One random adapter per name for `model`, written in PEFT's layout under `root`;
    returns their LoRARequests (ids 1, 2, ...), with lora_alpha = 2 * rank."""
    base = load_model(model, "float32").model
    requests = {}
    for lora_id, name in enumerate(names, start=1):
        weights = random_lora_weights(base, targets, rank, seed=lora_id)
        path = save_lora_adapter(pathlib.Path(root) / name, weights, lora_alpha=2.0 * rank)
        requests[name] = LoRARequest(name, lora_id, str(path))
    return requests


@dataclasses.dataclass
class MixedBatchRun:
    """What one engine did with a batch of mixed adapters and with each adapter alone."""

    adapters: list[str | None]  # each prompt's adapter name (None: the base model)
    mixed_tokens: list[list[int]]  # greedy tokens of each prompt in the mixed batch
    alone_tokens: list[list[int]]  # the same prompt's tokens, its adapter's requests alone
    base_tokens: list[list[int]]  # the same prompt on the base model
    mixed_steps: int  # engine steps of the mixed batch
    alone_steps: int  # engine steps of the per-adapter batches, one after the other

    @property
    def identical(self) -> bool:
        """Whether batching adapters together changed no token."""
        return self.mixed_tokens == self.alone_tokens

    @property
    def changed_by_adapter(self) -> int:
        """Prompts with an adapter whose tokens differ from the base model's."""
        rows = zip(self.adapters, self.mixed_tokens, self.base_tokens, strict=True)
        return sum(name is not None and got != base for name, got, base in rows)


def _run(llm: LLM, prompts, params, loras) -> tuple[list[list[int]], int]:
    scheduler = llm.engine.scheduler
    before = scheduler.num_steps
    outputs = llm.generate(list(prompts), params, lora_request=list(loras), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], scheduler.num_steps - before


def mixed_batch_run(
    requests: dict[str, LoRARequest],
    prompts: Sequence[str],
    adapters: Sequence[str | None],
    max_tokens: int = 12,
    max_lora_rank: int = 8,
    model: str = BUNDLED,
) -> MixedBatchRun:
    """Greedy completions of `prompts`, prompt i on adapter `adapters[i]` (a key of
    `requests`, or None for the base model): once as one mixed batch, then each adapter's
    prompts alone (base-model prompts as their own group), then all on the base model."""
    if len(prompts) != len(adapters):
        raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
    unknown = sorted({a for a in adapters if a is not None} - set(requests))
    if unknown:
        raise ValueError(f"adapters {unknown} are not among {sorted(requests)}")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(
        model=model,
        dtype="float32",
        enable_lora=True,
        max_loras=max(1, len(requests)),
        max_lora_rank=max_lora_rank,
        max_model_len=256,
        max_num_seqs=len(prompts),
    )
    loras = [requests[a] if a is not None else None for a in adapters]
    mixed, mixed_steps = _run(llm, prompts, params, loras)
    alone: list[list[int] | None] = [None] * len(prompts)
    alone_steps = 0
    for name in dict.fromkeys(adapters):
        rows = [i for i, a in enumerate(adapters) if a == name]
        tokens, steps = _run(llm, [prompts[i] for i in rows], params, [loras[i] for i in rows])
        alone_steps += steps
        for i, t in zip(rows, tokens, strict=True):
            alone[i] = t
    base, _ = _run(llm, prompts, params, [None] * len(prompts))
    return MixedBatchRun(list(adapters), mixed, alone, base, mixed_steps, alone_steps)


@dataclasses.dataclass
class AdapterStepTimes:
    """Decode steps of one batch whose rows spread over k distinct adapters, per k.

    `round_ms[k][i]` is the median step of round i (the configurations take turns within
    a round, in alternating order); `seen[k]` the distinct adapters `LoRAManager` grouped
    the rows into in every timed step of that configuration."""

    batch_size: int
    decode_steps: int
    round_ms: dict[int, list[float]]
    seen: dict[int, set[int]]

    def median_ms(self, k: int) -> float:
        return statistics.median(self.round_ms[k])

    def spread(self, k: int) -> float:
        """Interquartile range of the rounds' medians over their median."""
        q1, _, q3 = statistics.quantiles(self.round_ms[k], n=4, method="inclusive")
        return (q3 - q1) / self.median_ms(k)

    def slower_rounds(self, k: int, than: int) -> int:
        """Rounds in which the step with k adapters was slower than with `than`."""
        pairs = zip(self.round_ms[k], self.round_ms[than], strict=True)
        return sum(a > b for a, b in pairs)


def _decode_step_ms(
    llm: LLM, prompts, params, loras, steps: int, groups: list[int], seen: set[int]
) -> float:
    """Add the batch, run its prefill, then time `steps` decode steps of the engine; the
    median step in ms. `groups` grows by the adapters of each forward; those of the timed
    steps go into `seen`. The batch is finished before returning."""
    engine = llm.engine
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"t{time.perf_counter_ns()}-{i}", prompt, params, lora_request=lora)
    while engine.scheduler.waiting:  # the prefills (one step for a short batch)
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        seen.add(groups[-1])
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def time_adapter_steps(
    requests: dict[str, LoRARequest],
    distinct: Sequence[int] = (0, 1, 2, 4, 8),
    batch_size: int = 8,
    decode_steps: int = 6,
    rounds: int = 5,
    max_lora_rank: int = 8,
    model: str = BUNDLED,
) -> AdapterStepTimes:
    """Time the engine's decode step on one batch of `batch_size` requests whose rows
    spread, round robin, over k of the adapters in `requests` (k = 0: the base model), for
    each k in `distinct`. One engine serves every configuration; each round times them all,
    in alternating order (ABBA), so a slow spell of a shared machine falls on all alike."""
    names = list(requests)
    if not distinct or max(distinct) > len(names) or min(distinct) < 0:
        raise ValueError(f"distinct adapter counts {list(distinct)} must be in 0..{len(names)}")
    if max(distinct) > batch_size:
        raise ValueError(f"{max(distinct)} adapters do not fit a batch of {batch_size} rows")
    if rounds < 2 or decode_steps < 1:
        raise ValueError(f"need rounds >= 2 and decode_steps >= 1, got {rounds}, {decode_steps}")
    llm = LLM(
        model=model,
        dtype="float32",
        enable_lora=True,
        max_loras=max(1, max(distinct)),
        max_lora_rank=max_lora_rank,
        max_model_len=128,
        max_num_seqs=batch_size,
    )
    # count the adapters of every forward as the engine groups them (LoRAManager.groups)
    manager = llm.engine.lora_manager
    groups: list[int] = []
    set_active = manager.set_active

    def recording(token_lora_ids: list[int], device) -> None:
        set_active(token_lora_ids, device)
        groups.append(len(manager.groups))

    manager.set_active = recording
    # every request in flight for the whole timing: prefill, the timed steps, and one more
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 2, ignore_eos=True)
    prompts = [f"def f{i}(x):" for i in range(batch_size)]
    round_ms: dict[int, list[float]] = {k: [] for k in distinct}
    seen: dict[int, set[int]] = {k: set() for k in distinct}
    for r in range(rounds + 1):  # round 0 warms up the engine and the adapters
        for k in distinct if r % 2 else reversed(distinct):
            loras = [requests[names[i % k]] if k else None for i in range(batch_size)]
            ms = _decode_step_ms(llm, prompts, params, loras, decode_steps, groups, seen[k])
            if r:
                round_ms[k].append(ms)
    return AdapterStepTimes(batch_size, decode_steps, round_ms, seen)
