"""``precompute_scales``: the per-step scale update, after ``optimizer.step()``.

Built around *contributions*. A contribution is ``(local_amaxes, apply)``: a 1-D fp32 tensor
of amaxes this rank saw, and a callable that receives the same-shaped tensor of amaxes
all-reduced (MAX) over ranks and turns them into next-step scales. Providers turn a module
into contributions; ``precompute_scales`` concatenates every contribution's amaxes, does ONE
``all_reduce(MAX)`` (when distributed with world size > 1), splits the result back and
applies each. No contributions: no collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from float8kit.fsdp import fsdp_weight_contributions

Contribution = tuple[torch.Tensor, Callable[[torch.Tensor], None]]
ContributionProvider = Callable[[nn.Module], list[Contribution]]

# Each provider: module -> its contributions for this step.
_PROVIDERS: list[ContributionProvider] = [
    fsdp_weight_contributions,  # FSDP2 float8 all-gather weights (float8kit/fsdp.py)
]


def _default_group(module: nn.Module):
    """The FSDP mesh's process group (from the first DTensor parameter on a 1-D mesh), else
    None (the default group)."""
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1:
            return p.device_mesh.get_group()
    return None


@torch.no_grad()
def precompute_scales(module: nn.Module, *, group=None) -> None:
    """Compute every scale the next step needs, with at most one collective.

    Call it right after ``optimizer.step()``. With nothing to precompute (dynamic scaling
    without FSDP2 float8 all-gather) it returns at once, issuing no collective.

    Args:
        module: the (possibly FSDP2-wrapped and compiled) model.
        group: process group of the all-reduce; default: the FSDP mesh's group if the
            model has one (1-D mesh), else the default group. With a multi-dimensional mesh
            (HSDP, TP) pass the group explicitly if the default group is not right.
    """
    contributions = [c for provider in _PROVIDERS for c in provider(module)]
    if not contributions:
        return
    amaxes = torch.cat([local for local, _ in contributions])
    if dist.is_available() and dist.is_initialized():
        group = group if group is not None else _default_group(module)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for local, apply in contributions:
        apply(amaxes[offset : offset + local.numel()])
        offset += local.numel()


# torchao's name, so scripts written for torchao switch by changing the import.
precompute_float8_dynamic_scale_for_fsdp = precompute_scales
