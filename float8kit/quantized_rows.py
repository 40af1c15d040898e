"""Rows already cast for a grouped gemm: the form MoE tokens cross ranks in.

Expert parallelism (float8kit/expert_parallel.py) casts each token once, on the rank that
owns it, in exactly the form the expert's first grouped gemm consumes, and sends the float8
rows with their scales. ``QuantizedRows`` is what arrives: a 2-D (M, K) tensor that reports
itself as its hp dtype (autograd and the model code see an hp activation) and carries

- ``_data``: float8 (M, K), row-major;
- ``_scale``: the rows' scales along K: ``"rowwise"``: fp32 (M, 1) multipliers
  (``data ~ hp * scale``, ``cast.cast_rowwise(hp, -1, ...)``); ``"mx"``: uint8 e8m0 bytes
  (M, ceil(K / 32)) (``cast.to_mx(hp, 1, ...)``).

The grouped gemms (float8kit/experts.py) take its data and scales without casting again; a
gemm that needs the rows along another dim (the grad_weight gemm reduces the tokens) takes
``dequantize()``: exact for power-of-two scales. A per-row cast commutes with permuting rows,
so rows cast before a permutation equal, bit for bit, rows cast after it: that is why an
expert-parallel step gives one rank's bits. Only row permutations happen to it (in
expert_parallel.py, on its parts); any other op on it raises.
"""

from __future__ import annotations

import torch

from float8kit import cast, formats
from float8kit.config import E4M3

KINDS = ("rowwise", "mx")


class QuantizedRows(torch.Tensor):
    """Float8 rows standing in for an hp (M, K) activation (module docstring)."""

    _data: torch.Tensor
    _scale: torch.Tensor
    _kind: str

    __slots__ = ["_data", "_scale", "_kind"]

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, hp_dtype: torch.dtype, kind: str):
        if kind not in KINDS:
            raise ValueError(f"float8kit: QuantizedRows kind must be one of {KINDS}, got {kind!r}")
        if data.dim() != 2 or scale.dim() != 2 or scale.size(0) != data.size(0):
            raise ValueError(
                f"float8kit: QuantizedRows needs (M, K) data and (M, s) scales, got data "
                f"{tuple(data.shape)}, scale {tuple(scale.shape)}"
            )
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), dtype=hp_dtype, device=data.device, requires_grad=False
        )
        self._data, self._scale, self._kind = data, scale, kind
        return self

    def __repr__(self):
        return (
            f"QuantizedRows({self._kind}, shape={tuple(self.shape)}, hp_dtype={self.dtype}, "
            f"data={self._data.dtype})"
        )

    def dequantize(self) -> torch.Tensor:
        return dequantize(self._data, self._scale, self._kind)

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._kind)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        hp_dtype, kind = ctx
        return QuantizedRows(inner_tensors["_data"], inner_tensors["_scale"], hp_dtype, kind)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            (t,) = args
            return QuantizedRows(t._data, t._scale, t.dtype, t._kind)
        raise NotImplementedError(
            f"float8kit: {func} on QuantizedRows (tokens dispatched in float8 by expert "
            "parallelism): only float8kit's expert grouped gemms take them. Convert the "
            "experts with convert_experts_to_float8_training, or dispatch in hp "
            '(EPConfig(comm="hp"))'
        )

    __torch_function__ = torch._C._disabled_torch_function_impl


def dequantize(data: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows' values in fp32 from ``quantize_rows``' output: ``data / scale`` (rowwise),
    ``data * 2^(byte - 127)`` per 32-block (mx). Exact for power-of-two scales (every MX
    scale; the rowwise scales of the recipes that round them)."""
    if kind == "mx":
        return formats.MX(1).dequantize(data, scale)
    return data.to(torch.float32) / scale


def quantize_rows(
    hp: torch.Tensor, kind: str, round_to_pow2: bool, mx_rounding: str = "rceil"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of 2-D ``hp`` cast along its last dim as ``kind`` says: the one
    cast the expert gemm would apply to these rows (float8kit/experts.py)."""
    if kind == "mx":
        return cast.to_mx(hp, 1, E4M3, mx_rounding)
    return cast.cast_rowwise(hp, -1, round_to_pow2)
