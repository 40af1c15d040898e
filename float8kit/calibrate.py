"""``calibrate``: set the per-layer STATIC scales from a pass over sample batches."""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from float8kit import scaling, state
from float8kit.config import GemmRole, ScalingType
from float8kit.linear import Float8Linear

_CALIBRATED_ROLES = (GemmRole.INPUT, GemmRole.WEIGHT)


def _static_roles(mod: Float8Linear) -> list[GemmRole]:
    static = state.stateful_casts(mod.config, ScalingType.STATIC)
    return [role for role, _ in static if role in _CALIBRATED_ROLES]


def _hp_forward_recording(self: Float8Linear, input: torch.Tensor) -> torch.Tensor:
    amax = self.fp8_state.calibration_amax
    torch.maximum(amax, scaling.amax(input).to(amax.device), out=amax)
    return F.linear(input, self.weight, self.bias)


@torch.no_grad()
def calibrate(
    model: nn.Module, batches: Iterable, *, group: dist.ProcessGroup | None = None
) -> dict[str, dict[str, float]]:
    """Run ``model`` in hp over ``batches`` and set the STATIC input and weight scales of
    every Float8Linear from the largest amax seen.

    Each batch is passed as ``model(*batch)`` if it is a tuple or list, ``model(**batch)``
    if a dict, else ``model(batch)``, under ``torch.no_grad()`` in the model's current
    train/eval mode, with every Float8Linear running plain hp ``F.linear``. Then each layer's
    STATIC input scale becomes ``fp8_max / max(input amax over all batches)`` and its STATIC
    weight scale ``fp8_max / weight amax`` (floored to a power of two when the config asks),
    written into its ``fp8_scale_input`` / ``fp8_scale_weight`` buffers (in the state_dict).
    It overrides a configured ``CastConfig.static_scale`` of those operands. grad_output is
    not calibrated (no backward runs): a STATIC grad_output needs ``static_scale``. With
    torch.distributed initialized (world > 1) the amaxes are max-reduced over ranks (one
    collective), so every rank gets the same scales. Call it before ``torch.compile``.

    Args:
        model: a converted model with STATIC layers.
        batches: an iterable of model inputs.
        group: process group for the max-reduction; default: the default group.

    Returns:
        ``{layer fqn: {"input": amax, "weight": amax}}`` for the calibrated operands.
    """
    layers = [(fqn, mod) for fqn, mod in model.named_modules() if isinstance(mod, Float8Linear)]
    layers = [(fqn, mod, _static_roles(mod)) for fqn, mod in layers]
    layers = [entry for entry in layers if entry[2]]
    if not layers:
        raise ValueError(
            "calibrate: the model has no Float8Linear with STATIC input or weight scaling; "
            "convert it with CastConfig(scaling_type=ScalingType.STATIC) first"
        )
    for _, mod, _ in layers:
        mod.fp8_state.calibration_amax = torch.full((), scaling.UNSET, device=mod.weight.device)
        mod.forward = types.MethodType(_hp_forward_recording, mod)
    try:
        for batch in batches:
            if isinstance(batch, (tuple, list)):
                model(*batch)
            elif isinstance(batch, dict):
                model(**batch)
            else:
                model(batch)
    finally:
        input_amaxes = []
        for _, mod, _ in layers:
            del mod.forward
            input_amaxes.append(mod.fp8_state.calibration_amax)
            mod.fp8_state.calibration_amax = None

    amaxes = torch.stack(
        [
            torch.stack([input_amaxes[i], scaling.amax(mod.weight).to(input_amaxes[i].device)])
            for i, (_, mod, _) in enumerate(layers)
        ]
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)

    report: dict[str, dict[str, float]] = {}
    unseen = []
    for (fqn, mod, roles), (input_amax, weight_amax) in zip(layers, amaxes, strict=True):
        done = {}
        for role in roles:
            amax = input_amax if role is GemmRole.INPUT else weight_amax
            if amax < 0:
                unseen.append(fqn)
                continue
            cast = mod.config.stateful_cast(role)
            scale = scaling.amax_to_scale(
                amax, cast.dtype_for(role), mod.config.round_scales_to_power_of_2
            )
            mod._buffers[state.scale_name(role)].copy_(scale)
            done[state.OPERAND_NAMES[role]] = float(amax)
        own = mod.fp8_state
        own.uncalibrated = tuple(op for op in own.uncalibrated if op not in done)
        report[fqn] = done
    if unseen:
        raise RuntimeError(
            f"calibrate: layers {', '.join(unseen)} never ran on the calibration batches, so "
            "their STATIC input scale is not set; feed batches that reach them"
        )
    return report
