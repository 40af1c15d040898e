"""``precompute_scales``: the per-step scale update, after ``optimizer.step()``."""

from __future__ import annotations

from torch import nn

from float8kit.linear import Float8Linear


def precompute_scales(module: nn.Module) -> None:
    """Compute every scale the next step needs, with at most one collective.

    Call it right after ``optimizer.step()``. With only dynamic scaling on a single device
    there is nothing to precompute and this returns at once; it stays correct to call.

    Args:
        module: the (possibly FSDP2-wrapped and compiled) model.
    """
    for mod in module.modules():
        if isinstance(mod, Float8Linear):
            # Dynamic scales are computed at cast time; nothing is pending.
            continue


# torchao's name, so scripts written for torchao switch by changing the import.
precompute_float8_dynamic_scale_for_fsdp = precompute_scales
