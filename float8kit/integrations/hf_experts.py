"""Expert parallelism for Hugging Face MoE models: ``shard_hf_experts``.

    model = transformers.Qwen3MoeForCausalLM(config)  # or Mixtral, GPT-OSS, ...
    shard_hf_experts(model, group)  # this rank keeps experts [r * E / ep, (r + 1) * E / ep)
    convert_experts_to_float8_training(model, config=Float8ExpertsConfig(
        ..., wgrad_operands="dequantized"))  # EPConfig(comm="float8") needs it

transformers runs every experts module (the classes ``use_experts_implementation``
decorates) through the function ``config._experts_implementation`` names in its
``ALL_EXPERTS_FUNCTIONS``. ``shard_hf_experts`` keeps this rank's experts' weights (and
up-projection biases), registers ``experts_forward`` there as ``"float8kit_ep"`` and selects
it. ``experts_forward`` is transformers' ``grouped_mm_experts_forward`` with the tokens
crossing the group (float8kit/distributed/expert_parallel.py): stable sort by expert,
``dispatch`` (float8 rows in the experts' gemm form), the up projection, its bias and the
gate on the local experts, the down projection, ``combine``; then, on the rank that owns the
tokens, the down projection's bias, the routing weights and transformers' ``view(T, k,
H).sum(1)`` in the tokens' own order.

**One rank's bits.** On a model that was not sharded, ``experts_forward`` runs every expert
locally with the same ops (``use_float8kit_experts``): for the group's tokens concatenated it
computes bit for bit what the expert-parallel group computes, outputs, input gradients, the
experts' weight and up-bias gradients (float8 experts with ``wgrad_operands="dequantized"``,
or hp experts with ``EPConfig(comm="hp")``). transformers' own "grouped_mm" sorts unstably, so
its weight gradients may sum the tokens of an expert in another order.

**The down projection's bias** (GPT-OSS) stays whole on every rank and is added by the
token's owner after the combine: the combine's backward sends the gradient rows in float8, so
the expert's rank has no hp gradient to sum for it. It is a replicated, data-parallel
parameter like the router's: all-reduce its gradient with theirs. The sharded ones
(``expert_parallel_parameters``) already hold every rank's tokens' gradient.

Refused, with the fix named: transformers' own expert parallelism on the module
(``_is_expert_parallel``), experts with a post-expert norm, an expert count the group size
does not divide, and experts already sharded (DTensor, or ``shard_hf_experts`` twice).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from float8kit.distributed.expert_parallel import (
    EPConfig,
    checkpoint_as_global,
    combine,
    dispatch,
    expert_counts,
    plan_dispatch,
)
from float8kit.experts import Float8ExpertWeight, token_groups

__all__ = [
    "IMPLEMENTATION",
    "shard_hf_experts",
    "use_float8kit_experts",
    "expert_parallel_parameters",
    "experts_forward",
    "ExpertShard",
]

# the name experts_forward is registered under in transformers' ALL_EXPERTS_FUNCTIONS
IMPLEMENTATION = "float8kit_ep"
_SHARD = "_float8kit_expert_shard"


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """What ``shard_hf_experts`` kept of one experts module: experts ``[first, first +
    local)`` of ``num_experts``, and the group and ``EPConfig`` their tokens cross."""

    group: dist.ProcessGroup
    ep: EPConfig
    first: int
    local: int


def _is_hf_experts(m: nn.Module) -> bool:
    """An experts module transformers' ``use_experts_implementation`` decorated."""
    up = "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj"
    return all(hasattr(m, a) for a in ("num_experts", "has_gate", "is_transposed", "down_proj", up))


def _sharded_names(m: nn.Module) -> list[str]:
    up = "gate_up_proj" if m.has_gate else "up_proj"
    return [up, "down_proj"] + ([f"{up}_bias"] if m.has_bias else [])


def _refuse_unsupported(m: nn.Module, fqn: str) -> None:
    if getattr(m, "_is_expert_parallel", False):
        raise ValueError(
            f"float8kit: {fqn} runs transformers' own expert parallelism (_is_expert_parallel"
            "): load the model without it (no distributed_config / tp_plan with expert "
            "parallelism) and let shard_hf_experts split the experts"
        )
    if getattr(m, "has_post_expert_norm", False):
        raise NotImplementedError(
            f"float8kit: {fqn} applies a norm after each expert (has_post_expert_norm), which "
            f"the {IMPLEMENTATION!r} experts do not run: keep experts_implementation="
            '"grouped_mm" without expert parallelism for this model'
        )


# ---------------------------------------------------------------------------- forward


def _expert_gemms(m: nn.Module, xs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' up projection (+ bias), gate or activation and down projection over
    rows ``xs`` sorted by (this module's) expert, groups ending at ``offs``: its
    ``_grouped_linear`` math, ``w`` used as is when ``is_transposed`` (experts, in, out),
    else as ``w.transpose(-2, -1)``. Returns the down projection's output itself (no bias:
    ``combine`` takes the gemm's output)."""
    up = m.gate_up_proj if m.has_gate else m.up_proj
    w = up if m.is_transposed else up.transpose(-2, -1)
    h = torch._grouped_mm(xs, w, offs=offs)
    if m.has_bias:
        bias = m.gate_up_proj_bias if m.has_gate else m.up_proj_bias
        h.add_(bias[token_groups(offs, h.size(0))])  # each row's (local) expert
    h = m._apply_gate(h) if m.has_gate else m.act_fn(h)
    down = m.down_proj if m.is_transposed else m.down_proj.transpose(-2, -1)
    return torch._grouped_mm(h.to(down.dtype), down, offs=offs)


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An HF experts module's forward (``self``), as transformers calls its experts
    implementations: ``hidden_states`` (T, H), ``top_k_index`` / ``top_k_weights`` (T, k).
    With the module sharded (``shard_hf_experts``) the rows cross its group; otherwise every
    expert runs here (the one-rank reference). Returns (T, H) in ``hidden_states``' dtype."""
    _refuse_unsupported(self, type(self).__name__)
    shard: ExpertShard | None = getattr(self, _SHARD, None)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    if up.size(0) != (want := self.num_experts if shard is None else shard.local):
        raise ValueError(
            f"float8kit: the {IMPLEMENTATION!r} experts expected {want} experts' weights on "
            f"this rank, found {up.size(0)}: shard a model with shard_hf_experts only (once)"
        )
    num_tokens, hidden = hidden_states.shape
    k = top_k_index.size(-1)
    expert_ids = top_k_index.reshape(-1)
    # a stable sort: each expert's rows in token order, the group's rows in rank order
    order = expert_ids.argsort(stable=True)
    token, row_expert = order // k, expert_ids[order]
    x = hidden_states.to(up.dtype)  # transformers' grouped_mm casts to the weight's dtype
    if shard is None:
        offs = expert_counts(row_expert, self.num_experts).cumsum(0).to(torch.int32)
        rows = _expert_gemms(self, x[token], offs)
    else:
        config = getattr(up, "_config", None)  # None: hp experts
        plan = plan_dispatch(row_expert, self.num_experts, shard.group)
        xs = dispatch(x, token, plan, config, shard.ep)
        rows = combine(_expert_gemms(self, xs, plan.offs), plan, config, shard.ep)
    if self.has_bias:  # whole on every rank: added where hp gradient rows exist
        rows.add_(self.down_proj_bias[row_expert])
    weighted = rows * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)  # (a scatter, no sort)
    out = weighted[inverse].view(num_tokens, k, hidden).sum(dim=1)
    return out.to(hidden_states.dtype)


# ---------------------------------------------------------------------------- setup


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = [(fqn, m) for fqn, m in model.named_modules() if _is_hf_experts(m)]
    if not found:
        raise ValueError(
            "float8kit: no Hugging Face experts module (one transformers' "
            "use_experts_implementation decorates: gate_up_proj / up_proj, down_proj, "
            "num_experts, has_gate, is_transposed) in this model"
        )
    return found


def use_float8kit_experts(model: nn.Module) -> None:
    """Register ``experts_forward`` in transformers' ``ALL_EXPERTS_FUNCTIONS`` as
    ``IMPLEMENTATION`` and select it for every experts module of ``model`` (through
    ``set_experts_implementation`` where the model has it). On a model ``shard_hf_experts``
    did not shard, every expert then runs on this rank: the one-rank reference."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    for fqn, m in _experts_modules(model):
        _refuse_unsupported(m, fqn)
        if m.config._experts_implementation != IMPLEMENTATION:
            m.config._experts_implementation = IMPLEMENTATION


def _local_experts(param: nn.Parameter, keep: slice) -> nn.Parameter:
    """This rank's experts of a (possibly float8-converted) expert parameter, as a new
    parameter of their own storage."""
    if isinstance(param, Float8ExpertWeight):
        mine = Float8ExpertWeight(param._tensor.detach()[keep].clone(), param._config)
    else:
        mine = param.detach()[keep].clone()
    return nn.Parameter(mine, requires_grad=param.requires_grad)


def shard_hf_experts(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    ep_config: EPConfig | None = None,
) -> list[str]:
    """Expert parallelism for every Hugging Face experts module in ``model``, in place.

    Rank r of ``group`` keeps experts ``[r * E / ep, (r + 1) * E / ep)``: their
    ``gate_up_proj`` (or ``up_proj``), ``down_proj`` and up-projection bias become
    parameters of those experts only; ``down_proj_bias`` stays whole (module docstring).
    Then ``use_float8kit_experts``: the model's experts run ``experts_forward``, their tokens
    crossing ``group`` as ``ep_config`` says. Call it before or after
    ``convert_experts_to_float8_training``, before building the optimizer and before
    ``fully_shard``. Checkpoints show the sharded weights (and an optimizer's state of them)
    whole, as ``shard_experts``' (``checkpoint_as_global``).

    Args:
        model: an HF model (or any module holding HF experts modules).
        group: the expert-parallel group; default the whole world.
        ep_config: how tokens cross it; default ``EPConfig()`` (float8 rows: the experts
            need ``Float8ExpertsConfig(wgrad_operands="dequantized")``).

    Returns:
        The fqns of the experts modules sharded.

    Raises:
        ValueError: no experts module, an expert count ``group``'s size does not divide,
            transformers' own expert parallelism on a module, a module sharded already.
        RuntimeError: an expert parameter that is already a DTensor.
        NotImplementedError: experts with a post-expert norm.
    """
    from torch.distributed.tensor import DTensor

    group = group or dist.group.WORLD
    ep_config = ep_config or EPConfig()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    found = _experts_modules(model)
    for fqn, m in found:  # every check first: nothing is cut when one module is refused
        _refuse_unsupported(m, fqn)
        if getattr(m, _SHARD, None) is not None:
            raise ValueError(f"float8kit: {fqn} is sharded already: call shard_hf_experts once")
        if m.num_experts % size:
            raise ValueError(
                f"float8kit: {fqn} has {m.num_experts} experts, which an expert-parallel group "
                f"of {size} ranks cannot split evenly: use a group whose size divides it"
            )
        for name in _sharded_names(m) + (["down_proj_bias"] if m.has_bias else []):
            if isinstance(getattr(m, name), DTensor):
                raise RuntimeError(
                    f"float8kit: {fqn}.{name} is already a DTensor: call shard_hf_experts "
                    "before fully_shard / parallelize_module"
                )
    for _, m in found:
        local = m.num_experts // size
        keep = slice(rank * local, (rank + 1) * local)
        for name in _sharded_names(m):
            setattr(m, name, _local_experts(getattr(m, name), keep))
        checkpoint_as_global(m, _sharded_names(m), group, local)
        setattr(m, _SHARD, ExpertShard(group, ep_config, rank * local, local))
    use_float8kit_experts(model)
    return [fqn for fqn, _ in found]


def expert_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``shard_hf_experts`` cut to this rank's experts. Their gradients sum
    every rank's tokens already: leave them out of the data-parallel all-reduce over the
    expert-parallel group (divide them by its size where the loss is a per-rank mean).
    Every other parameter, ``down_proj_bias`` included, is replicated."""
    return [
        getattr(m, name)
        for _, m in model.named_modules()
        if getattr(m, _SHARD, None) is not None
        for name in _sharded_names(m)
    ]
