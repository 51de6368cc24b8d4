"""Mixture-of-experts MLP: a router picks k of E expert MLPs per token (Shazeer et al., 2017;
Mixtral: Jiang et al., 2024).

For each token x the router scores every expert, p = softmax(x W_g^T) over E experts, keeps
the k largest (`select_experts`), and the layer's output is the weighted sum of those k
experts' SwiGLU MLPs: y = sum_j w_j expert_{e_j}(x). Mixtral always renormalizes the k
weights to sum to 1; Qwen-MoE does when its config says `norm_topk_prob`. Qwen2-MoE adds a
shared expert that every token passes through, scaled by sigmoid(x w_s).

Parameter names follow the checkpoints of transformers' Qwen2-/Qwen3-MoE (`mlp.gate`,
`mlp.experts.N.gate_proj|up_proj|down_proj`, `mlp.shared_expert`, `mlp.shared_expert_gate`);
a Mixtral checkpoint's names (`block_sparse_moe.gate`, `block_sparse_moe.experts.N.w1|w3|w2`)
are renamed to those on load (`rename_checkpoint_tensors`) and back on save.

The block runs three ways (`SparseMoeBlock.parallel`):

- "local": one process holds every expert;
- "tensor": every rank holds a 1/p slice of every expert's width (column-parallel gate and up,
  row-parallel down) and one all-reduce sums the partial outputs;
- "expert": rank r holds experts [r E/p, (r+1) E/p) whole. Tokens are replicated on all ranks
  (attention is tensor-parallel), so each rank takes a 1/p share of the tokens, sends each
  (token, expert) pair to the rank owning the expert (dispatch: one all-to-all), runs its
  experts on what it received, sends the results back (combine: a second all-to-all), weights
  and sums them per token, and an all-gather puts the token shares back together.

Every rank routes every token itself (the router is replicated and cheap), so each rank knows
how many rows it will receive from every other rank without exchanging counts first.

`RoutingRecorder` watches the routers of a model: tokens sent to each expert per layer (the
load an EPLB-style balancer reads), and routing replay, which records the experts every token
went to in one run and forces the same experts in a later run of the same schedule, a
debugging tool for telling a routing change apart from a numerical one.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from minillm.model.config import ModelConfig

MIXTRAL_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)
MIXTRAL_SAVE_RENAMES = (
    (re.compile(r"(\.mlp\.experts\.\d+)\.gate_proj\."), r"\1.w1."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.up_proj\."), r"\1.w3."),
    (re.compile(r"(\.mlp\.experts\.\d+)\.down_proj\."), r"\1.w2."),
    (re.compile(r"\.mlp\.(gate|experts)\."), r".block_sparse_moe.\1."),
)


def rename_checkpoint_tensors(
    state: dict[str, torch.Tensor], architecture: str, saving: bool = False
) -> dict[str, torch.Tensor]:
    """A Mixtral checkpoint's tensor names as minillm's (or, saving, minillm's as Mixtral's);
    other architectures already share minillm's names."""
    if architecture != "MixtralForCausalLM":
        return state
    renames = MIXTRAL_SAVE_RENAMES if saving else MIXTRAL_RENAMES
    out = {}
    for name, tensor in state.items():
        for pattern, replacement in renames:
            name = pattern.sub(replacement, name)
        out[name] = tensor
    return out


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the experts in float32, the k largest: (weights [n, k] float32, expert ids
    [n, k] int64), the weights rescaled to sum to 1 per token when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertMLP(nn.Module):
    """One expert: SwiGLU down(silu(gate(x)) * up(x)) of its own width."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RoutingRecorder:
    """What the routers of one model did: per-layer expert load, and routes to replay.

    `load[layer]` counts the (token, expert) assignments of each expert since `reset_load`.
    With `record=True`, `trace` gets one entry per forward pass: {layer: expert ids [n, k]}.
    With `replay` set to such a trace, pass i uses the recorded ids of pass i instead of the
    router's top-k (the weights are still the router's probabilities of those experts), so a
    replay needs the same schedule: the same requests, options and order. A pass whose token
    count differs from the recorded one raises ValueError.

    A forward pass captured in a CUDA graph is not watched (the routers run as plain code in
    the graph); run with enforce_eager=True to count or replay every decode step on a GPU."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.load: dict[int, torch.Tensor] = {}
        self.record = False
        self.trace: list[dict[int, torch.Tensor]] = []
        self.replay: list[dict[int, torch.Tensor]] | None = None
        self.replay_pass = 0
        self._pass: dict[int, torch.Tensor] | None = None
        self._replaying: dict[int, torch.Tensor] | None = None
        self._last_layer: int | None = None

    def reset_load(self) -> None:
        self.load = {}

    def load_lists(self) -> dict[int, list[int]]:
        """Tokens routed to each expert per layer, as plain ints."""
        return {layer: counts.tolist() for layer, counts in sorted(self.load.items())}

    def start_record(self) -> None:
        self.record, self.trace, self._last_layer = True, [], None

    def stop_record(self) -> list[dict[int, torch.Tensor]]:
        self.record = False
        self._pass = None
        return self.trace

    def start_replay(self, trace: list[dict[int, torch.Tensor]]) -> None:
        if not isinstance(trace, list) or not all(isinstance(p, dict) for p in trace):
            raise TypeError("a routing trace is the list of passes that stop_record returned")
        self.replay, self.replay_pass, self._replaying = trace, 0, None
        self._last_layer = None

    def stop_replay(self) -> int:
        """Stop replaying; the number of passes replayed."""
        done, self.replay, self._replaying = self.replay_pass, None, None
        return done

    def begin_pass(self) -> None:
        """A new forward pass begins (the layers of one pass come in increasing order)."""
        if self.record:
            self._pass = {}
            self.trace.append(self._pass)
        if self.replay is not None:
            if self.replay_pass >= len(self.replay):
                raise ValueError(
                    f"routing replay: the trace holds {len(self.replay)} forward passes and "
                    "this run made more; replay needs the recorded run's schedule"
                )
            self._replaying = self.replay[self.replay_pass]
            self.replay_pass += 1

    def route(
        self, layer: int, router_logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (weights, ids) of `layer` for this pass: the router's, or the replayed ids."""
        if self._last_layer is None or layer <= self._last_layer:
            self.begin_pass()
        self._last_layer = layer
        if self._replaying is not None:
            if layer not in self._replaying:
                raise ValueError(f"routing replay: the trace has no routes for layer {layer}")
            ids = self._replaying[layer].to(router_logits.device)
            if ids.shape != (router_logits.shape[0], top_k):
                raise ValueError(
                    f"routing replay: layer {layer} was recorded with routes of shape "
                    f"{tuple(ids.shape)}, this pass needs ({router_logits.shape[0]}, {top_k}); "
                    "replay needs the recorded run's schedule"
                )
            probs = torch.softmax(router_logits.float(), dim=-1)
            weights = probs.gather(1, ids)
            if renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            weights, ids = select_experts(router_logits, top_k, renormalize)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)  # on the device
        self.load[layer] = self.load.get(layer, torch.zeros_like(counts)) + counts
        if self._pass is not None:
            self._pass[layer] = ids.cpu().clone()
        return weights, ids


class SparseMoeBlock(nn.Module):
    """Router, experts and (optionally) a shared expert: hidden [n, hidden] -> [n, hidden].

    `experts` is keyed by the global expert id, so that a rank of an expert-parallel model
    holds only its own experts under the checkpoint's names."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleDict(
            {
                str(e): ExpertMLP(config.hidden_size, config.moe_intermediate_size)
                for e in range(config.num_experts)
            }
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(
                config.hidden_size, config.shared_expert_intermediate_size
            )
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
        self.recorder: RoutingRecorder | None = None  # set by attach_recorder
        # a tensor-parallel shard sets the Communicator whose all-reduce sums the partial
        # outputs; an expert-parallel one replaces moe_forward (minillm.distributed)
        self.comm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        router_logits = self.gate(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.recorder is None or capturing:
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        else:
            weights, ids = self.recorder.route(
                self.layer_idx, router_logits, self.top_k, self.renormalize
            )
        return self.moe_forward(x, weights, ids).reshape(*lead, -1)

    def moe_forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """The routed experts' weighted sum plus the shared expert, for every token."""
        out = self.experts_forward(x, weights, ids)
        if self.shared_expert is not None:
            out = out + self.shared_forward(x)
        return out if self.comm is None else self.comm.all_reduce(out)

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, scaled by its sigmoid gate."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def experts_forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_j weights[:, j] expert_{ids[:, j]}(x) over the experts this module holds."""
        out = torch.zeros_like(x)
        for key, expert in self.experts.items():
            token, slot = torch.nonzero(ids == int(key), as_tuple=True)
            if len(token):
                y = expert(x[token]) * weights[token, slot, None].to(x.dtype)
                out.index_add_(0, token, y)
        return out


def attach_recorder(model: nn.Module) -> RoutingRecorder | None:
    """Give every MoE block of `model` one shared RoutingRecorder (None for a dense model)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        return None
    recorder = RoutingRecorder(blocks[0].num_experts)
    for block in blocks:
        block.recorder = recorder
    return recorder


def require_moe(config: ModelConfig) -> None:
    """ValueError unless the model has experts."""
    if not config.is_moe:
        raise ValueError(
            f"{config.architecture} has no mixture-of-experts layers: expert load and routing "
            "replay need a Mixtral, Qwen2-MoE or Qwen3-MoE model"
        )


def routing_recorder(model: nn.Module) -> RoutingRecorder:
    """The model's RoutingRecorder; ValueError for a model without experts."""
    require_moe(model.config)
    return model.model.routing
