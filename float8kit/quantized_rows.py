"""Rows already cast for a grouped gemm: the form MoE tokens cross ranks in.

Expert parallelism (float8kit/expert_parallel.py) casts each token once, on the rank that
owns it, in exactly the form the expert's first grouped gemm consumes, and sends the float8
rows with their scales. What arrives is a ``Float8TrainingTensor`` in the role of dispatched
rows (``dispatched_rows``): 2-D (M, K), reporting itself as its hp dtype (autograd and the
model code see an hp activation), with

- ``_data``: float8 (M, K), row-major;
- ``_scale``: the rows' scales along K, in ``_gran`` (the format the experts' cast config
  names, along K: ``rows_format``): rowwise fp32 (M, 1) multipliers (``data ~ hp *
  scale``), or MX's uint8 e8m0 bytes (M, ceil(K / 32)).

The grouped gemms (float8kit/experts.py) take its data and scales without casting again; a
gemm that needs the rows along another dim (the grad_weight gemm reduces the tokens) takes
``dequantize()``: exact for power-of-two scales. A per-row cast commutes with permuting rows,
so rows cast before a permutation equal, bit for bit, rows cast after it: that is why an
expert-parallel step gives one rank's bits. Only row permutations happen to it (in
expert_parallel.py, on its parts); an op the float8 tensor does not implement raises.
"""

from __future__ import annotations

import torch

from float8kit import formats
from float8kit.config import E4M3, Float8ExpertsConfig, GemmRole
from float8kit.formats import Format
from float8kit.tensor import Float8TrainingTensor


def rows_format(config: Float8ExpertsConfig) -> Format:
    """The format of rows cast along K for the experts' first grouped gemm."""
    return formats.of(config.cast_config, GemmRole.INPUT, -1, 2)


def dispatched_rows(
    data: torch.Tensor,
    scale: torch.Tensor,
    hp_dtype: torch.dtype,
    fmt: Format,
    role: GemmRole = GemmRole.INPUT,
) -> Float8TrainingTensor:
    """Float8 rows (``data`` (M, K), ``scale`` (M, s) in ``fmt``) standing in for an hp (M, K)
    activation of ``role`` (module docstring): what expert parallelism delivers."""
    if not isinstance(fmt, Format) or not fmt.capabilities.ep_dispatch:
        fine = [f.__name__ for f in formats.FORMATS.values() if f.capabilities.ep_dispatch]
        raise ValueError(
            f"float8kit: dispatched rows need a format of rows dispatched by expert "
            f"parallelism ({', '.join(fine)}), got {fmt!r}"
        )
    if data.dim() != 2 or scale.dim() != 2 or scale.size(0) != data.size(0):
        raise ValueError(
            f"float8kit: dispatched rows need (M, K) data and (M, s) scales, got data "
            f"{tuple(data.shape)}, scale {tuple(scale.shape)}"
        )
    return Float8TrainingTensor(data, scale, hp_dtype, role, fmt)


def quantize_rows(
    hp: torch.Tensor, config: Float8ExpertsConfig, fmt: Format | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of 2-D ``hp`` cast along its last dim as ``config``'s experts cast
    their first gemm's input (``fmt``: ``rows_format(config)``, if known already)."""
    fmt = rows_format(config) if fmt is None else fmt
    return fmt.quantize_dynamic(hp, E4M3, config.cast_config, config.round_scales_to_power_of_2)
