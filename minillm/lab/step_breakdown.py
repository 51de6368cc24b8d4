"""Where an engine step's time goes, and how many FLOPs it did: the breakdown `minillm bench
offline` prints beside its ratios.

Each engine step is split into four parts that add up to the step:

- attention: the attention backend (KV-cache write and attention), every layer;
- linear: the linear layers (q/k/v, o, gate/up, down, fused or not, and the LM head);
- other model: the rest of the forward (embedding, norms, RoPE, SiLU);
- outside the model: scheduling, preparing inputs, sampling, detokenizing, outputs.

Separately, `python_overhead_share` is the part of a step spent outside every `aten` operator
(Python, dispatch, the engine's bookkeeping), from one step run under `torch.profiler`: the
step's wall time less the sum of its operators' self times.

FLOPs are counted from the model's shapes and each step's batch (`step_flops`): 2 per weight
of every linear layer per token (the LM head only for tokens that sample), and for attention
4 * num_heads * head_dim per (query, visible key) pair per layer (QK^T and PV). MFU is the
achieved FLOP/s over the machine's fp32 GEMM peak, measured by `measure_gemm_peak` in the
same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PARTS = ("attention", "linear", "other model", "outside the model")


@dataclass(slots=True)
class StepRecord:
    """One engine step: its wall time, the time in each measured span, its FLOPs."""

    step_s: float
    model_s: float = 0.0
    attention_s: float = 0.0
    linear_s: float = 0.0
    flops: float = 0.0
    num_seqs: int = 0
    decode_only: bool = False


@dataclass(slots=True)
class Breakdown:
    """Totals over a set of steps; the shares of `PARTS` sum to 1."""

    num_steps: int
    step_s: float
    shares: dict[str, float]
    flops: float

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.step_s if self.step_s > 0 else 0.0


def breakdown(steps: list[StepRecord]) -> Breakdown:
    """Sum the steps and split their time into `PARTS`."""
    step_s = sum(s.step_s for s in steps)
    attention = sum(s.attention_s for s in steps)
    linear = sum(s.linear_s for s in steps)
    model = sum(s.model_s for s in steps)
    times = {
        "attention": attention,
        "linear": linear,
        "other model": model - attention - linear,
        "outside the model": step_s - model,
    }
    shares = {part: (t / step_s if step_s > 0 else 0.0) for part, t in times.items()}
    return Breakdown(len(steps), step_s, shares, sum(s.flops for s in steps))


def linear_weights_per_token(config) -> int:
    """Weights of one token's linear layers below the LM head: q, k, v, o, gate, up, down
    per layer (a dense model; biases ignored)."""
    hidden, heads, kv_heads = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    head_dim = config.head_dim
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp)


def step_flops(
    config, query_lens: list[int], seq_lens: list[int], num_sampled: int
) -> tuple[float, float]:
    """(FLOPs of the linear layers, FLOPs of attention) of one step: query_lens[i] new tokens
    of a sequence whose context, new tokens included, is seq_lens[i]; num_sampled rows go
    through the LM head."""
    num_tokens = sum(query_lens)
    linear = 2.0 * linear_weights_per_token(config) * num_tokens
    linear += 2.0 * config.hidden_size * config.vocab_size * num_sampled
    # new token j (0-based) of a sequence sees seq_len - q_len + j + 1 keys
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens, strict=True))
    attention = (
        4.0 * config.num_attention_heads * config.head_dim * pairs * config.num_hidden_layers
    )
    return linear, attention


def measure_gemm_peak(size: int = 1024, repeats: int = 5) -> float:
    """The best fp32 FLOP/s of a size^3 torch.mm on this machine, at torch's thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


@dataclass
class StepRecorder:
    """Wraps an engine's step, its model and the model's layers with timers (`clock`), and
    records a `StepRecord` per step. `uninstall` puts everything back."""

    engine: object
    clock: Callable[[], float] = time.perf_counter
    steps: list[StepRecord] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list)
    _current: StepRecord | None = None

    def install(self) -> StepRecorder:
        engine = self.engine
        runner = engine.model_runner
        model = runner.model
        self._wrap(engine, "step", self._time_step)
        self._wrap(runner, "forward", self._time_forward)
        self._wrap(model, "compute_logits", self._time_logits)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self._wrap(attn.backend, "forward", self._span("attention_s"))
            for owner, names in (
                (attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                (mlp, ("gate_proj", "up_proj", "down_proj")),
            ):
                for name in names:
                    if hasattr(owner, name):
                        self._wrap(getattr(owner, name), "forward", self._span("linear_s"))
            for name in ("fused_qkv", "fused_gate_up"):
                fused = getattr(attn if name == "fused_qkv" else mlp, name, None)
                if fused is not None:
                    owner = attn if name == "fused_qkv" else mlp
                    original = fused
                    setattr(owner, name, self._span("linear_s")(original))
                    self._undo.append(lambda o=owner, n=name, f=original: setattr(o, n, f))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap(self, obj, name: str, wrapper) -> None:
        original = getattr(obj, name)
        had_own = name in vars(obj)
        setattr(obj, name, wrapper(original))

        def undo() -> None:
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def _span(self, attr: str):
        def wrapper(fn):
            def timed(*args, **kwargs):
                start = self.clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self._current is not None:
                        setattr(
                            self._current, attr, getattr(self._current, attr) + self.clock() - start
                        )

            return timed

        return wrapper

    def _time_step(self, fn):
        def timed(*args, **kwargs):
            self._current = StepRecord(step_s=0.0)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._current.step_s = self.clock() - start
                if self._current.num_seqs:  # a step that ran the model
                    self.steps.append(self._current)
                self._current = None

        return timed

    def _time_forward(self, fn):
        model_span = self._span("model_s")(fn)
        config = self.engine.model_runner.model.config

        def timed(model_input):
            meta = model_input.meta
            if self._current is not None:
                starts = meta.query_start_loc.tolist()
                query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
                linear, attention = step_flops(config, query_lens, meta.seq_lens.tolist(), 0)
                self._current.flops += linear + attention
                self._current.num_seqs = len(query_lens)
                self._current.decode_only = meta.max_query_len == 1
            return model_span(model_input)

        return timed

    def _time_logits(self, fn):
        config = self.engine.model_runner.model.config

        def timed(hidden):
            start = self.clock()
            try:
                return fn(hidden)
            finally:
                if self._current is not None:
                    elapsed = self.clock() - start
                    self._current.model_s += elapsed
                    self._current.linear_s += elapsed
                    lm_head = 2.0 * config.hidden_size * config.vocab_size * hidden.shape[0]
                    self._current.flops += lm_head

        return timed


def python_overhead_share(engine, prompts: list[list[int]], repeats: int = 9) -> float:
    """The share of a decode step of len(prompts) sequences spent outside every aten operator:
    step wall time (unprofiled) less the operators' self time (the next step, profiled),
    median over `repeats` pairs (one pair against the next swings by several points on a
    shared machine, so the median is over nine by default). The requests ask for their final
    output only, as `LLM.generate` asks, and are aborted afterwards."""
    from minillm.lab.step_profile import profile_step
    from minillm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=4 * repeats + 8,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [f"overhead-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    recorder = StepRecorder(engine).install()
    try:  # prefill every prompt: then each step decodes all of them
        while not (recorder.steps and recorder.steps[-1].decode_only):
            engine.step()
    finally:
        recorder.uninstall()
    if recorder.steps[-1].num_seqs != len(prompts):
        raise RuntimeError("the engine did not run every prompt in one decode batch")
    shares = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step()
        wall_us = (time.perf_counter() - start) * 1e6
        ops, _ = profile_step(engine.step)
        # aten operators only: a traced forward's own scope ("forward") is the TorchScript
        # interpreter stepping from one operator to the next, overhead like Python's
        ops_us = sum(op.self_cpu_us for op in ops if op.name.startswith("aten::"))
        shares.append(max(0.0, 1.0 - ops_us / wall_us))
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return sorted(shares)[len(shares) // 2]
