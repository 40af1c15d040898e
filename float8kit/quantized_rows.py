"""Rows already cast for a grouped gemm: the form MoE tokens cross ranks in.

Expert parallelism (float8kit/expert_parallel.py) casts each token once, on the rank that
owns it, in exactly the form the expert's first grouped gemm consumes, and sends the float8
rows with their scales. ``QuantizedRows`` is what arrives: a 2-D (M, K) tensor that reports
itself as its hp dtype (autograd and the model code see an hp activation) and carries

- ``_data``: float8 (M, K), row-major;
- ``_scale``: the rows' scales along K, in ``_format`` (the format the experts' cast config
  names, along K: ``rows_format``): rowwise fp32 (M, 1) multipliers (``data ~ hp *
  scale``), or MX's uint8 e8m0 bytes (M, ceil(K / 32)).

The grouped gemms (float8kit/experts.py) take its data and scales without casting again; a
gemm that needs the rows along another dim (the grad_weight gemm reduces the tokens) takes
``dequantize()``: exact for power-of-two scales. A per-row cast commutes with permuting rows,
so rows cast before a permutation equal, bit for bit, rows cast after it: that is why an
expert-parallel step gives one rank's bits. Only row permutations happen to it (in
expert_parallel.py, on its parts); any other op on it raises.
"""

from __future__ import annotations

import torch

from float8kit import formats
from float8kit.config import E4M3, Float8ExpertsConfig, GemmRole
from float8kit.formats import Format


def rows_format(config: Float8ExpertsConfig) -> Format:
    """The format of rows cast along K for the experts' first grouped gemm."""
    return formats.of(config.cast_config, GemmRole.INPUT, -1, 2)


class QuantizedRows(torch.Tensor):
    """Float8 rows standing in for an hp (M, K) activation (module docstring)."""

    _data: torch.Tensor
    _scale: torch.Tensor
    _format: Format

    __slots__ = ["_data", "_scale", "_format"]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, hp_dtype: torch.dtype, fmt: Format):
        if not isinstance(fmt, Format) or not fmt.capabilities.ep_dispatch:
            fine = [f.__name__ for f in formats.FORMATS.values() if f.capabilities.ep_dispatch]
            raise ValueError(
                f"float8kit: QuantizedRows needs a format of rows dispatched by expert "
                f"parallelism ({', '.join(fine)}), got {fmt!r}"
            )
        if data.dim() != 2 or scale.dim() != 2 or scale.size(0) != data.size(0):
            raise ValueError(
                f"float8kit: QuantizedRows needs (M, K) data and (M, s) scales, got data "
                f"{tuple(data.shape)}, scale {tuple(scale.shape)}"
            )
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), dtype=hp_dtype, device=data.device, requires_grad=False
        )
        self._data, self._scale, self._format = data, scale, fmt
        return self

    def __repr__(self):
        return (
            f"QuantizedRows({self._format.short()}, shape={tuple(self.shape)}, "
            f"hp_dtype={self.dtype}, data={self._data.dtype})"
        )

    def dequantize(self) -> torch.Tensor:
        return self._format.dequantize(self._data, self._scale)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._format)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        hp_dtype, fmt = ctx
        return QuantizedRows(inner_tensors["_data"], inner_tensors["_scale"], hp_dtype, fmt)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (t,) = args
            return QuantizedRows(t._data, t._scale, t.dtype, t._format)
        raise NotImplementedError(
            f"float8kit: {func} on QuantizedRows (tokens dispatched in float8 by expert "
            "parallelism): only float8kit's expert grouped gemms take them. Convert the "
            "experts with convert_experts_to_float8_training, or dispatch in hp "
            '(EPConfig(comm="hp"))'
        )

    __torch_function__ = torch._C._disabled_torch_function_impl


def quantize_rows(
    hp: torch.Tensor, config: Float8ExpertsConfig, fmt: Format | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of 2-D ``hp`` cast along its last dim as ``config``'s experts cast
    their first gemm's input (``fmt``: ``rows_format(config)``, if known already)."""
    fmt = rows_format(config) if fmt is None else fmt
    return fmt.quantize_dynamic(hp, E4M3, config.cast_config, config.round_scales_to_power_of_2)
