"""A traced decode forward: on a CPU, decode steps replay a recorded list of operators.

A decode step of a small model on a CPU runs about 200 operators, and between them Python
runs: argument parsing, `nn.Module` calls, the model's own branches. For the bundled model at
64 sequences that is over a millisecond of a 20 ms step, paid again every step. On a GPU, CUDA
graphs remove the launch cost (`minillm.worker.cuda_graphs`); the CPU's counterpart here is
`torch.jit.trace`: it runs one decode forward, records the operators it calls with every
Python branch taken as it was, and replays them from C++ with no Python between them.

A trace records sizes as they flow through the operators, not as constants, so one trace
serves every decode-only batch: any number of sequences, any context length. Only the
tensors change from step to step: token ids, positions, cache slots, and the torch backend's
per-step plan (the blocks to gather, the slots never written, the padding mask). Its output
is the eager forward's, bit for bit: the same operators on the same tensors.

What a trace cannot see is a decision Python would take differently later. The runner
replays a trace only while nothing it fixed has changed (`DecodeTrace.can_run`): every
module, parameter, child, attribute and attention-backend switch is the object it was, and
no hook is set. After a change, the step runs eagerly, or under a new trace when the model
can be traced as it now is: only the dense Llama modules (`TRACEABLE_MODULES`; a quantized
layer decodes eagerly), no hooks, no module with its own `forward` (timers and row-by-row
layers are Python a trace would skip), no batch-invariant attention. A trace that fails
leaves the step, and every decode step until the model changes, to the eager forward.
Never traced is what a trace does not record at all: LoRA adapters chosen per row, the routers of a
mixture-of-experts model (their load counts and replays run in Python), an FP8 KV cache
whose scales are calibrated on the first forward. `enforce_eager=True` turns it off, as it
turns off CUDA graphs.

Why `torch.jit.trace`, which PyTorch marks deprecated in favour of `torch.compile` and
`torch.export`: `torch.compile(dynamic=True)` of the bundled model's forward took minutes to
warm up on a 2-core CPU and compiled again as the batch and the gathered context changed
size, and what it runs is new code whose sums may round differently. A trace takes a few
tens of milliseconds, once, and runs the very operators the eager forward calls.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from minillm.model.attention import AttentionMetadata, TorchAttentionPlan
from minillm.model.llama import (
    FusedLinear,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
)

# the modules whose forward is known to take no branch on a batch's size or values, so that
# a trace of one decode batch holds for all (the tests check it, bit for bit); a model with
# any other module (a quantized linear layer, a LoRA wrapper) decodes eagerly
TRACEABLE_MODULES = frozenset(
    {
        LlamaForCausalLM,
        LlamaModel,
        LlamaDecoderLayer,
        LlamaAttention,
        LlamaMLP,
        RMSNorm,
        nn.Linear,
        nn.Embedding,
        nn.ModuleList,
    }
)


def can_trace(model: LlamaForCausalLM, kv_caches: list[torch.Tensor]) -> bool:
    """Whether decode steps of `model` over `kv_caches` may replay a trace at all: a dense
    model with the torch attention backend and a float KV cache, on a CPU."""
    return (
        kv_caches[0].device.type == "cpu"
        and model.attention_backend == "torch"
        and getattr(model.model, "routing", None) is None
        and kv_caches[0].dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


class _DecodeForward(nn.Module):
    """The model's forward over a decode-only batch, its per-step tensors as arguments (what
    the tracer needs): the rest of the metadata is the same in every decode step."""

    def __init__(self, model: LlamaForCausalLM, plan: TorchAttentionPlan, block_size: int):
        super().__init__()
        self.model = model
        # only the fields a decode-only batch of the torch backend reads; the others are
        # left empty so that reading one fails while tracing instead of freezing a value
        self.plan = dataclasses.replace(
            plan,
            decode_rows=None,
            decode_block_tables=None,
            decode_blocks=None,
            decode_unwritten_rows=None,
            decode_mask=None,
        )
        self.block_size = block_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        decode_blocks: torch.Tensor,
        decode_unwritten_rows: torch.Tensor,
        decode_mask: torch.Tensor,
        *kv_caches: torch.Tensor,
    ) -> torch.Tensor:
        plan = dataclasses.replace(
            self.plan,
            decode_blocks=decode_blocks,
            decode_unwritten_rows=decode_unwritten_rows,
            decode_mask=decode_mask,
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=None,
            seq_lens=None,
            block_tables=None,
            max_query_len=1,
            max_seq_len=0,
            block_size=self.block_size,
            torch_plan=plan,
        )
        return self.model(input_ids, positions, list(kv_caches), meta)


def _step_tensors(input_ids, positions, meta: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    plan = meta.torch_plan
    return (
        input_ids,
        positions,
        meta.slot_mapping,
        plan.decode_blocks,
        plan.decode_unwritten_rows,
        plan.decode_mask,
    )


class DecodeTrace:
    """The decode forward of one model over one runner's KV caches, traced on first use."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], block_size: int):
        if not can_trace(model, kv_caches):
            raise ValueError(
                "a traced decode forward needs a dense model with the torch attention "
                "backend and a float KV cache on a CPU"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.traced: torch.jit.ScriptModule | None = None
        self.snapshot: Snapshot | None = None  # the model as the trace recorded it
        self.refused: Snapshot | None = None  # the model as it was when tracing failed
        self.num_traces = 0  # traces made: the first, and one after each change of the model
        self.num_replays = 0  # decode steps a trace has run

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step may replay a trace: the one made before if nothing it fixed has
        changed, or else a new one, made by `run`, when the model can be traced as it is."""
        plan = meta.torch_plan
        if plan is None or not plan.all_decode or input_ids.numel() == 0:
            return False
        if torch.is_grad_enabled():
            return False
        if self.traced is not None and self._unchanged(self.snapshot):
            return True
        if self.refused is not None and self._unchanged(self.refused):
            return False  # tracing failed on the model as it still is
        if not self._traceable():
            return False
        self.traced = None  # the model changed in a way a new trace records
        return True

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states of a decode-only batch: [num_seqs, hidden_size]."""
        tensors = _step_tensors(input_ids, positions, meta)
        if self.traced is None:
            # tracing runs the forward once: its cache writes are this step's, made again
            # (the same values to the same slots) by the replay below
            wrapper = _DecodeForward(self.model, meta.torch_plan, self.block_size)
            try:
                with warnings.catch_warnings():
                    # torch.jit.trace is deprecated in favour of torch.compile and
                    # torch.export; see the module's docstring for why it is used here
                    warnings.simplefilter("ignore", torch.jit.TracerWarning)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    traced = torch.jit.trace(
                        wrapper, (*tensors, *self.kv_caches), check_trace=False
                    )
            except Exception:
                # an operator the tracer cannot record, or a fault while it ran: this step
                # runs eagerly (a fault strikes again there), and so does every decode step
                # until the model changes
                self.refused = self._take_snapshot()
                return self.model(input_ids, positions, self.kv_caches, meta)
            self.traced, self.refused = traced, None
            self.snapshot = self._take_snapshot()
            self.num_traces += 1
        self.num_replays += 1
        with torch.jit.optimized_execution(False):  # the recorded operators, none fused
            return self.traced(*tensors, *self.kv_caches)

    def _backends(self) -> list:
        return [layer.self_attn.backend for layer in self.model.model.layers]

    def _traceable(self) -> bool:
        """What a trace can record as it will run: only TRACEABLE_MODULES, no hooks, no
        module with its own `forward`, every attention backend plain (not batch-invariant,
        no FP8 scales to calibrate, its own `forward`), the fused projections themselves."""
        if _global_hooks():
            return False
        for module in self.model.modules():
            if type(module) not in TRACEABLE_MODULES:
                return False
            if module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module):
                return False
        for layer in self.model.model.layers:
            fused = (layer.self_attn.fused_qkv, getattr(layer.mlp, "fused_gate_up", None))
            if any(f is not None and type(f) is not FusedLinear for f in fused):
                return False
        return not any(
            b.batch_invariant or b.calculate_kv_scales or "forward" in vars(b)
            for b in self._backends()
        )

    def _take_snapshot(self) -> Snapshot:
        modules = list(self.model.modules())
        tables = [m._parameters for m in modules] + [m._modules for m in modules]
        tables += [vars(m) for m in modules] + [vars(b) for b in self._backends()]
        return Snapshot(
            modules=modules,
            sizes=[(table, len(table)) for table in tables],
            # a module's private attributes are torch's own tables (its hooks, buffers...),
            # checked above by content where they matter
            entries=[
                (table, key, value)
                for table in tables
                for key, value in table.items()
                if not key.startswith("_")
            ],
            forwards=list({type(m): type(m).forward for m in modules}.items()),
        )

    def _unchanged(self, snapshot: Snapshot) -> bool:
        """Every module, parameter, child, attribute and attention switch the very object
        it was when `snapshot` was taken, no table grown or shrunk, and no hook anywhere.
        About 80 modules: a few tens of microseconds, against a millisecond saved."""
        if _global_hooks():
            return False
        for module in snapshot.modules:
            if module._forward_hooks or module._forward_pre_hooks:
                return False
        for table, size in snapshot.sizes:
            if len(table) != size:  # a key added (an instance `forward`, say) or removed
                return False
        for table, key, value in snapshot.entries:
            if table.get(key, _MISSING) is not value:
                return False
        for cls, forward in snapshot.forwards:
            if cls.forward is not forward:
                return False
        return True


@dataclasses.dataclass(slots=True)
class Snapshot:
    """What a trace fixed: the model's modules, the size of each of their tables
    (parameters, children, attributes; the attention backends' attributes), every entry of
    those tables, and each module class's `forward`."""

    modules: list[nn.Module]
    sizes: list[tuple[dict, int]]
    entries: list[tuple[dict, str, object]]
    forwards: list[tuple[type, object]]


_MISSING = object()


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
