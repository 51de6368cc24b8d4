"""Random fault scenarios against the public `LLMEngine` API, shared by the fault tests and
the soak run (`python -m tests.faults.soak`).

A scenario picks an engine configuration (tiny KV pools that preempt, the radix prefix cache,
async scheduling, speculative decoding, LoRA, two pipeline stages drained each step or with
batches in flight), queues requests that share prefixes (greedy,
seeded, n = 2, grammar-constrained), and mixes in aborts, a request the device always refuses
(a persistent per-request fault), a one-off batch fault, and a KeyboardInterrupt at a random
point of a step (planning, the forward, processing). With pipeline stages the refused
request and the one-off fault strike in the first stage's process (`_StageFaults`), where the
forward runs. It then checks:

- every request that was neither aborted nor faulty gets exactly the tokens it gets alone on a
  fresh engine, seeded ones too, also after a KeyboardInterrupt (the steps it takes back
  rewind their random streams: nothing is drawn twice);
- the faulty request ends with an error, and the engine never stops serving;
- afterwards nothing is left (`invariants.leftovers`) and a probe request gets a fresh
  engine's tokens.

`run_scenario(seed, env)` returns the problems found, an empty list when all held.
"""

from __future__ import annotations

import pathlib
import random
from dataclasses import dataclass, field

from minillm.engine.args import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.lora.request import LoRARequest
from minillm.sampling_params import SamplingParams, StructuredOutputsParams
from tests.faults.invariants import leftovers, probe

BASE = dict(device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=16)
TINY = dict(num_gpu_blocks=18, block_size=4)  # room for about one 64-token sequence
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
CONFIGS = {
    "plain": {},
    "tiny_pool": TINY,
    "radix_tiny": {**TINY, "prefix_caching_algo": "radix"},
    "no_prefix_cache": {"enable_prefix_caching": False, "max_num_seqs": 3},
    "async": {"async_scheduling": True},
    "async_tiny": {**TINY, "async_scheduling": True},
    "async_radix_tiny": {**TINY, "async_scheduling": True, "prefix_caching_algo": "radix"},
    "ngram": {"speculative_config": NGRAM},
    "ngram_tiny": {**TINY, "speculative_config": NGRAM},
    "lora_tiny": {**TINY, "enable_lora": True, "max_loras": 1, "max_lora_rank": 8},
}
# two pipeline stages in two worker processes: each step's batch cut into two micro-batches
# and drained, or two batches in flight across steps; the last with its layers split
# unevenly (two and one: the pipelined scenarios run a model of three layers, `NUM_LAYERS`)
NUM_LAYERS = 3
PIPELINED = {
    "pp_drained_tiny": {**TINY, "pipeline_parallel_size": 2, "pipeline_micro_batches": 2},
    "pp_in_flight": {"pipeline_parallel_size": 2, "pipeline_batches_in_flight": 2},
    "pp_in_flight_radix_tiny": {
        **TINY,
        "prefix_caching_algo": "radix",
        "pipeline_parallel_size": 2,
        "pipeline_batches_in_flight": 2,
    },
    "pp_uneven_in_flight_tiny": {
        **TINY,
        "pipeline_parallel_size": 2,
        "pipeline_batches_in_flight": 2,
        "pipeline_layer_partition": "2,1",
    },
}
ALL_CONFIGS = {**CONFIGS, **PIPELINED}
PREFIXES = [list(range(20, 44)), [5, 17, 42, 9, 77, 3, 11, 8, 8, 120, 33, 4], []]
PROBE_PROMPT = [3, 4, 5, 6, 7, 8, 9]
PROBE_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
GRAMMAR = StructuredOutputsParams(regex="[a-z]{1,6}( [a-z]{1,6}){0,2}")


@dataclass
class Env:
    """What scenarios share: the model, an adapter, and the outputs of fresh engines."""

    model_dir: pathlib.Path
    adapter: LoRARequest | None = None
    solo_cache: dict = field(default_factory=dict)
    probe_cache: dict = field(default_factory=dict)
    solo_engines: dict = field(default_factory=dict)

    def engine(self, config: str, stage_faults: _StageFaults | None = None) -> LLMEngine:
        """An engine of `config`; a pipelined one's worker processes start with `stage_faults`
        (forked, they inherit the first stage's forward as it is while they start)."""
        args = EngineArgs(model=self.model_dir, **BASE, **ALL_CONFIGS[config])
        if config not in PIPELINED:
            return LLMEngine(args)
        from minillm.distributed import pipeline

        saved = pipeline.prepare_inputs, pipeline.stage_forward
        (stage_faults or _StageFaults(None)).install(pipeline)
        try:
            return LLMEngine(args)
        finally:
            pipeline.prepare_inputs, pipeline.stage_forward = saved

    def solo(self, prompt: list[int], params: SamplingParams, lora: LoRARequest | None):
        """The request's completions alone on a roomy engine without speculation.

        The engine is shared by every scenario, so it caches no prefixes: a hit would make
        the reference depend on the scenarios before (float32 sums of a cached prefix and of
        a computed one may differ in the last bit, enough to flip a near-tie)."""
        key = (tuple(prompt), repr(params), lora)
        if key not in self.solo_cache:
            if lora not in self.solo_engines:
                options = {"enable_lora": True, "max_lora_rank": 8} if lora else {}
                options["enable_prefix_caching"] = False
                self.solo_engines[lora] = LLMEngine(
                    EngineArgs(model=self.model_dir, **BASE, **options)
                )
            engine = self.solo_engines[lora]
            engine.add_request("solo", list(prompt), params, lora_request=lora)
            final = None
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        final = output
            self.solo_cache[key] = [list(c.token_ids) for c in final.outputs]
        return self.solo_cache[key]

    def fresh_probe(self, config: str) -> list[list[int]]:
        """The probe's tokens on a fresh engine of `config` (pipelined: of its options on one
        process, whose tokens pipeline stages must reproduce)."""
        if config not in self.probe_cache:
            options = {k: v for k, v in ALL_CONFIGS[config].items() if "pipeline" not in k}
            engine = LLMEngine(EngineArgs(model=self.model_dir, **BASE, **options))
            self.probe_cache[config] = probe(engine, PROBE_PROMPT, PROBE_PARAMS)
        return self.probe_cache[config]


def make_env(model_dir: pathlib.Path, adapter_root: pathlib.Path | None = None) -> Env:
    """The shared state; with `adapter_root`, a random rank-8 adapter written there."""
    adapter = None
    if adapter_root is not None:
        from minillm.lab.lora_demo import random_lora_weights
        from minillm.model.loader import load_model
        from minillm.model.lora import save_lora_adapter

        model = load_model(model_dir, "float32").model
        weights = random_lora_weights(model, ("q_proj", "v_proj", "down_proj"), 8, seed=3)
        path = save_lora_adapter(adapter_root / "adapter", weights, 16.0)
        adapter = LoRARequest("adapter", 1, str(path))
    return Env(model_dir, adapter)


class _Armed:
    """Replace obj.name with a wrapper that raises `error()` on its `at`-th call (once), or
    on every call for which `when(*args)` holds."""

    def __init__(self, obj, name, error, at=None, when=None):
        self.calls, self.fired = 0, 0
        original = getattr(obj, name)
        self.disarm = lambda: setattr(obj, name, original)

        def wrapper(*args, **kwargs):
            self.calls += 1
            if (at is not None and self.calls == at) or (when is not None and when(*args)):
                self.fired += 1
                raise error()
            return original(*args, **kwargs)

        setattr(obj, name, wrapper)


class _StageFaults:
    """The first pipeline stage's forward as the pipelined scenarios attack it: it refuses
    every micro-batch that holds the request `refused` (a persistent per-request fault), and,
    with `at`, fails its `at`-th forward of two or more requests once (a one-off fault of the
    batch, counted in the first stage's process: a request rerun alone never meets it, as it
    would be that request's own fault)."""

    def __init__(self, at: int | None, refused: str | None = None) -> None:
        self.at, self.refused = at, refused

    def install(self, pipeline) -> None:
        """Wrap the pipeline module's functions (the worker processes forked next get them)."""
        calls, batch_ids = [0], [set()]
        prepare, forward = pipeline.prepare_inputs, pipeline.stage_forward

        def noting_prepare(batch, *args, **kwargs):  # the micro-batch the stage runs next
            batch_ids[0] = {chunk.request.request_id for chunk in batch}
            return prepare(batch, *args, **kwargs)

        def faulty(model, inputs, x, kv_caches):
            if x is None:  # the first stage: it embeds the input ids
                if self.refused in batch_ids[0]:
                    raise RuntimeError("the device refused this request")
                calls[0] += len(batch_ids[0]) >= 2
                if calls[0] == self.at and len(batch_ids[0]) >= 2:
                    raise RuntimeError("a transient fault")
            return forward(model, inputs, x, kv_caches)

        pipeline.prepare_inputs, pipeline.stage_forward = noting_prepare, faulty


def _params(rng: random.Random, config: str) -> SamplingParams:
    max_tokens = rng.randint(1, 8)
    kind = rng.choice(["greedy", "greedy", "seeded", "n2", "grammar"])
    # speculation and worker processes refuse grammars
    if kind == "grammar" and "ngram" not in config and config not in PIPELINED:
        return SamplingParams(temperature=0, max_tokens=8, structured_outputs=GRAMMAR)
    if kind == "seeded":
        return SamplingParams(temperature=0.8, seed=rng.randint(0, 99), max_tokens=max_tokens)
    if kind == "n2":
        return SamplingParams(
            n=2, temperature=0.8, seed=rng.randint(0, 99), max_tokens=max_tokens, ignore_eos=True
        )
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.7)


def run_scenario(seed: int, env: Env, config: str | None = None) -> list[str]:
    """One random scenario; the problems it found (empty: every check held)."""
    rng = random.Random(seed)
    config = config or rng.choice(sorted(CONFIGS))
    if config == "lora_tiny" and env.adapter is None:
        config = "tiny_pool"
    label = f"seed {seed} ({config})"
    faults = rng.sample(["transient", "interrupt", "poison", "abort"], rng.randint(0, 4))
    pipelined = config in PIPELINED
    if pipelined:
        at = rng.randint(1, 6) if "transient" in faults else None
        # the first request is the refused one (below)
        engine = env.engine(config, _StageFaults(at, "r0" if "poison" in faults else None))
    else:
        engine = env.engine(config)
    try:
        return _run(rng, env, engine, config, label, faults)
    finally:
        engine.shutdown()


def _run(rng, env: Env, engine: LLMEngine, config: str, label: str, faults: list) -> list[str]:
    pipelined = config in PIPELINED
    in_flight = bool(ALL_CONFIGS[config].get("pipeline_batches_in_flight"))
    poisoned: set[str] = set()
    armed = []
    if not pipelined:
        # a poisoned request fails every step that runs it (a persistent per-request fault)
        armed.append(
            _Armed(
                engine.runner,
                "execute_model",
                lambda: RuntimeError("the device refused this request"),
                when=lambda plan: any(s.request.request_id in poisoned for s in plan.scheduled),
            )
        )
    if "transient" in faults and not pipelined:
        # the k-th batch of two or more requests fails once; each request then runs alone,
        # where this fault never strikes (it would be that request's own fault)
        batches, at = [0], rng.randint(1, 6)

        def batch_fault(plan) -> bool:
            if len(plan.scheduled) < 2:
                return False
            batches[0] += 1
            return batches[0] == at

        armed.append(
            _Armed(
                engine.runner,
                "execute_model",
                lambda: RuntimeError("a transient fault"),
                when=batch_fault,
            )
        )
    if "interrupt" in faults:
        if in_flight:  # plans beside the batches in flight, waits for the oldest one
            plans, forward = "schedule_beside", (engine.executor, "collect_model")
        else:
            plans, forward = "schedule", (engine.runner, "execute_model")
        target, name = rng.choice([(engine.scheduler, plans), (engine, "_process"), forward])
        armed.append(_Armed(target, name, KeyboardInterrupt, at=rng.randint(1, 8)))

    added: dict[str, tuple[list[int], SamplingParams, LoRARequest | None]] = {}
    aborted, final = set(), {}
    problems: list[str] = []

    def step() -> None:
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            return  # as a notebook user would: run the cell again
        for output in outputs:
            if output.finished:
                if output.request_id in final:
                    problems.append(f"{label}: {output.request_id} finished twice")
                final[output.request_id] = output

    for i in range(rng.randint(2, 7)):
        request_id = f"r{i}"
        prefix = rng.choice(PREFIXES)
        prompt = prefix + [rng.randint(3, 250) for _ in range(rng.randint(1, 12))]
        lora = env.adapter if config == "lora_tiny" and rng.random() < 0.5 else None
        if "poison" in faults and not poisoned:
            poisoned.add(request_id)
        params = _params(rng, config)
        engine.add_request(request_id, prompt, params, lora_request=lora)
        added[request_id] = (prompt, params, lora)
        for _ in range(rng.randint(0, 3)):
            step()
        if "abort" in faults and rng.random() < 0.3:
            victim = rng.choice(sorted(added))
            if victim not in final:
                engine.abort_request(victim)
                aborted.add(victim)
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        step()
    else:
        problems.append(f"{label}: the engine never became idle")

    for request_id, (prompt, params, lora) in added.items():
        output = final.get(request_id)
        if output is None:
            problems.append(f"{label}: {request_id} never finished")
            continue
        if request_id in aborted:
            continue
        if request_id in poisoned:
            if output.error is None:
                problems.append(f"{label}: the faulty {request_id} ended without an error")
            continue
        if output.error is not None:
            problems.append(f"{label}: {request_id} failed: {output.error}")
            continue
        got = [list(c.token_ids) for c in output.outputs]
        if got != env.solo(prompt, params, lora):
            problems.append(
                f"{label}: {request_id} {got} != alone {env.solo(prompt, params, lora)}"
            )
    for fault in reversed(armed):  # in the order they wrap, so each restores the one below
        fault.disarm()
    left = leftovers(engine)
    if in_flight and (engine._batches or engine.executor.batches_in_flight()):
        left.append("a pipeline batch is still in flight")
    if left:
        problems.append(f"{label}: left behind: {left}")
        return problems
    try:
        got = probe(engine, PROBE_PROMPT, PROBE_PARAMS)
    except AssertionError as error:
        problems.append(f"{label}: probe: {error}")
        return problems
    if got != env.fresh_probe(config):
        problems.append(f"{label}: probe {got} != a fresh engine's {env.fresh_probe(config)}")
    left = leftovers(engine)
    if left:
        problems.append(f"{label}: left behind by the probe: {left}")
    return problems
