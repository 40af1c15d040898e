"""Granularity: how many scales a float8 tensor has, and how they follow its data.

A ``Float8TrainingTensor`` carries one granularity object (``_gran``). Everything that depends
on the scale layout asks it, instead of branching on the kind: the scale's shape per element
(``expand``), and what a metadata op (transpose, view, slice, split, cat, FSDP2's leading-rows
``as_strided``) does to the scale, or that it cannot keep one scale per group and raises.

- ``Tensorwise``: one scale, shape ``()``; every metadata op keeps it.
- ``Axiswise(dim)``: one scale per slice along ``dim`` (the gemm's inner dim), the data's
  shape with ``dim`` reduced to 1 (rowwise: the left operand's rows, the right one's columns).
- ``Blockwise(rows, cols)``: one scale per ``rows`` x ``cols`` block of 2-D data, shape
  (ceil(R / rows), ceil(C / cols)): 1x128 / 128x1 activation tiles, 128x128 weight blocks.

``of(cast, role, reduce_dim, ndim)`` maps a ``CastConfig`` to its object: where a new
format's scale layout (MX blocks) plugs in. Objects are frozen and hashable: compiled graphs
guard on them. Internal.
"""

from __future__ import annotations

import dataclasses

import torch

from float8kit import scaling
from float8kit.config import CastConfig, GemmRole, ScalingGranularity


class Granularity:
    """The scale layout of a float8 tensor (see the module docstring)."""

    # for the gemm's kernel choice: the dim axiswise scales run along, the block of a
    # block-scaled operand (None where it does not apply)
    axiswise_dim: int | None = None
    block: tuple[int, int] | None = None

    def short(self) -> str:
        raise NotImplementedError

    def amax(self, hp: torch.Tensor) -> torch.Tensor:
        """The amax of each scaling group of ``hp``, in the scale's shape (float8kit.scaling)."""
        return scaling.amax(hp)

    def expand(self, scale: torch.Tensor, shape) -> torch.Tensor:
        """``scale`` broadcastable to one scale per element of data of ``shape``."""
        return scale

    def transpose(self, scale: torch.Tensor, d0: int, d1: int):
        """(granularity, scale) of the data transposed along ``d0``, ``d1`` (non-negative)."""
        return self, scale

    def view(self, scale: torch.Tensor, old, new, func):
        """(granularity, scale) of the data viewed from shape ``old`` to ``new``."""
        return self, scale

    def strided(self, scale: torch.Tensor, rows: int | None, ndim: int) -> torch.Tensor | None:
        """The scale of an ``as_strided`` view: ``rows`` = the view is the first ``rows`` whole
        rows of 2-D data (FSDP2's view of an unsharded weight in its padded all-gather
        buffer), None = any other view. None when this layout cannot take the view."""
        return scale

    def sliced(self, scale: torch.Tensor, dim: int, fn, func) -> torch.Tensor:
        """The scale of the data sliced along ``dim`` by ``fn`` (applied to the scale where it
        varies along ``dim``)."""
        return scale

    def split(self, scale: torch.Tensor, dim: int, n: int, fn, func) -> list[torch.Tensor]:
        """The scales of ``n`` pieces of the data split along ``dim``."""
        return [scale] * n

    def cat(self, scales: list[torch.Tensor], dim: int, fn, func) -> torch.Tensor:
        """The scale of data concatenated along ``dim`` (raises if the scales cannot merge)."""
        for s in scales[1:]:
            if not torch.equal(s, scales[0]):
                raise ValueError("float8kit: cat of float8 tensors with different scales")
        return scales[0]


@dataclasses.dataclass(frozen=True)
class Tensorwise(Granularity):
    def short(self) -> str:
        return "tensorwise"


@dataclasses.dataclass(frozen=True)
class Axiswise(Granularity):
    # the dim the scales run along: one scale per slice of the other dims
    dim: int

    @property
    def axiswise_dim(self) -> int:
        return self.dim

    def short(self) -> str:
        return f"axiswise(dim={self.dim})"

    def amax(self, hp):
        return scaling.amax(hp, self.dim)

    def transpose(self, scale, d0, d1):
        dim = {d0: d1, d1: d0}.get(self.dim, self.dim)
        return Axiswise(dim), scale.transpose(d0, d1)

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

    def strided(self, scale, rows, ndim):
        # a gathered row-scaled weight: its first rows keep their row scales
        return scale[:rows] if rows is not None and self.dim == ndim - 1 else None

    def sliced(self, scale, dim, fn, func):
        return scale if self.dim == dim else fn(scale)

    def split(self, scale, dim, n, fn, func):
        return [scale] * n if self.dim == dim else fn(scale)

    def cat(self, scales, dim, fn, func):
        return Granularity.cat(self, scales, dim, fn, func) if self.dim == dim else fn(scales)


@dataclasses.dataclass(frozen=True)
class Blockwise(Granularity):
    # the (rows, cols) of a scale block of 2-D data
    rows: int
    cols: int

    @property
    def block(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def short(self) -> str:
        return f"blockwise({self.rows}x{self.cols})"

    def amax(self, hp):
        return scaling.block_amax(hp, self.block)

    def expand(self, scale, shape):
        return scaling.expand_block_scale(scale, self.block, shape)

    def transpose(self, scale, d0, d1):
        # the scale grid and the block shape transpose with the data
        return (self, scale) if d0 == d1 else (Blockwise(self.cols, self.rows), scale.t())

    def view(self, scale, old, new, func):
        if tuple(new) != tuple(old):
            self._refuse(func, old)
        return self, scale

    def strided(self, scale, rows, ndim):
        return None if rows is None else scale[: -(-rows // self.rows)]

    def sliced(self, scale, dim, fn, func):
        self._refuse(func)

    def split(self, scale, dim, n, fn, func):
        self._refuse(func)

    def cat(self, scales, dim, fn, func):
        self._refuse(func)

    def _refuse(self, func, shape=None):
        of = f" {tuple(shape)}" if shape is not None else ""
        raise NotImplementedError(
            f"float8kit: {func} on a blockwise Float8TrainingTensor{of} (blocks "
            f"{self.rows}x{self.cols}) would cut through its scale blocks; call "
            ".dequantize() first if hp math is really meant"
        )


TENSORWISE = Tensorwise()


def of(cast: CastConfig, role: GemmRole, reduce_dim: int, ndim: int) -> Granularity:
    """The granularity of an operand cast per ``cast`` for a gemm that reduces its dim
    ``reduce_dim``: blockwise weights in square blocks (which serve both of their gemms),
    activations in 1 x block_size tiles along ``reduce_dim`` (block_size x 1 when that is
    dim 0); axiswise scales along ``reduce_dim``."""
    gran = cast.scaling_granularity
    if gran is ScalingGranularity.AXISWISE:
        return Axiswise(reduce_dim % ndim)
    if gran is ScalingGranularity.BLOCKWISE:
        b = cast.block_size
        if role is GemmRole.WEIGHT:
            return Blockwise(b, b)
        return Blockwise(1, b) if reduce_dim in (1, -1) else Blockwise(b, 1)
    return TENSORWISE
