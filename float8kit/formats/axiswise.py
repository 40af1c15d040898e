"""Axiswise (rowwise): one float8 scale per slice along ``dim`` (the gemm's inner dim), the
data's shape with ``dim`` reduced to 1: the left operand's rows, the right one's columns."""

from __future__ import annotations

import dataclasses

import torch

from float8kit import scaling
from float8kit.config import ScalingType
from float8kit.formats.base import (
    GLOBAL_AMAX,
    AlongDim,
    Capabilities,
    Float8Elements,
    Format,
    GroupScaledGather,
    same_scales,
)


@dataclasses.dataclass(frozen=True)
class Axiswise(AlongDim, GroupScaledGather, Float8Elements, Format):
    capabilities = Capabilities(
        scaling_types=(ScalingType.DYNAMIC,),
        fsdp_float8_all_gather=True,
        tensor_parallel=GLOBAL_AMAX,
        experts=True,
        ep_dispatch=True,
        layer_multiple=None,
        min_cuda_capability=(8, 9),
        gemm="scaled",
    )

    # the dim the scales run along: one scale per slice of the other dims
    dim: int

    @property
    def axiswise_dim(self) -> int:
        return self.dim

    def short(self) -> str:
        return f"axiswise(dim={self.dim})"

    def amax(self, hp):
        return scaling.amax(hp, self.dim)

    def dtensor_amax(self, hp):
        return scaling.dtensor_amax(hp, self.dim)

    def view(self, scale, old, new, func):
        # Only views that keep the scaled-along dim at the same end with the same size
        # (flattening or unflattening the other dims) keep one scale per slice.
        if self.dim == len(old) - 1 and new[-1] == old[-1]:
            return Axiswise(len(new) - 1), scale.reshape(*new[:-1], 1)
        if self.dim == 0 and new[0] == old[0]:
            return self, scale.reshape(1, *new[1:])
        raise NotImplementedError(
            f"float8kit: {func} from {tuple(old)} to {tuple(new)} would mix the scales of an "
            f"axiswise tensor (scaled along dim {self.dim})"
        )

    def scale_bytes(self, scale, wire):
        # fp32 as its 4 bytes, or its exponent field (e8m0: exact for a positive power of
        # two and for 0, byte 255 = NaN otherwise)
        if wire == "fp32":
            return scale.contiguous().view(torch.uint8)
        bits = scale.contiguous().view(torch.int32)
        pow2 = (bits >= 0) & ((bits & 0x7FFFFF) == 0)  # positive, mantissa 0 (0.0 too)
        return torch.where(pow2, bits >> 23, 255).to(torch.uint8)

    def scale_from_bytes(self, data, wire):
        if wire == "fp32":
            return data.contiguous().view(torch.float32)
        bits = data.to(torch.int32) << 23
        return torch.where(data == 255, torch.nan, bits.view(torch.float32))

    def strided(self, scale, rows, ndim):
        # a gathered row-scaled weight: its first rows keep their row scales
        return scale[:rows] if rows is not None and self.dim == ndim - 1 else None

    def sliced(self, scale, dim, fn, func):
        return scale if self.dim == dim else fn(scale)

    def split(self, scale, dim, n, fn, func):
        return [scale] * n if self.dim == dim else fn(scale)

    def cat(self, scales, dim, fn, func):
        return same_scales(scales) if self.dim == dim else fn(scales)

    # A weight's rows (scales (N, 1) for the global N): under FSDP2's dim-0 sharding a rank
    # owns whole rows of the outer weight, so its rows' amaxes are complete over the columns
    # it holds; the all-reduce assembles the rows and, when tensor parallel splits the
    # columns, takes each row's max over the TP ranks. Other shard dims: refused (fsdp.shard_spec).
    def group_amaxes(self, shard, where):
        rows = scaling.nan_to_inf(scaling.amax(shard, reduce_dim=-1))
        if where.full_shape[0] == shard.shape[0]:
            return rows
        full = rows.new_zeros((where.full_shape[0], 1))
        start = where.global_start(0)
        full[start : start + shard.shape[0]] = rows
        return full

    def shard_scale(self, scale, shard, where):
        start = where.global_start(0)
        return scale[start : start + shard.shape[0]]

    def gathered_scale(self, scale, where):
        start = where.outer_offset[0]
        return scale[start : start + where.outer_shape[0]]

    def _gathered_rows(self, data, scale):
        # drop the padding rows here (a view: FSDP2 frees and refills the buffer), so the
        # weight has one scale per row; FSDP2's as_strided to the full size is the identity
        return data[: scale.shape[0]]
