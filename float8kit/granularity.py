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

- ``NVFP4(rows, cols)``: e2m1 codes with an e4m3 scale per 1x16 / 16x1 (activations,
  gradients) or 16x16 (weights) block and an fp32 scale per tensor (float8kit/nvfp4.py).

- ``MX(dim)``: OCP MX, one e8m0 power-of-two scale per 32 elements along ``dim`` (each
  gemm's inner dim), shape the data's with ``dim`` reduced to ceil(n / 32).

``of(cast, role, reduce_dim, ndim)`` maps a ``CastConfig`` to its object: where a new
format's scale layout plugs in. Objects are frozen and hashable: compiled graphs
guard on them.

Shard layout (the FSDP2 float8 all-gather, float8kit.distributed.fsdp). A weight's *scaling
groups* are the slices that share one scale. FSDP2 shards the weight along one dim (dim 0 by
default, unevenly, with empty shards on some ranks); a rank sees only its part of each group.
Every group's amax over the full weight is the MAX over ranks of the group's amax over each
rank's part, where a rank that does not touch a group contributes 0 (amaxes are never
negative): one all-reduce(MAX) of same-shape tensors on every rank (the hook's fallback, or a
slice of ``precompute_scales``' single collective). ``group_amaxes`` fills the full weight's
scale shape from a shard, ``shard_scale`` is the part of the full scale that casts the shard,
``gathered_scale`` the part the gathered weight needs; ``ShardSpec`` says where the shard sits
(under tensor parallelism the full shape is the global weight's). Internal.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from float8kit import nvfp4, scaling
from float8kit.config import NVFP4_BLOCK, CastConfig, GemmRole, ScalingGranularity


class Granularity:
    """The scale layout of a float8 tensor (see the module docstring)."""

    # for the gemm's kernel choice: the dim axiswise scales run along, the block of a
    # block-scaled operand (None where it does not apply)
    axiswise_dim: int | None = None
    block: tuple[int, int] | None = None
    # the dim an MX operand's 32-element blocks run along (None: not MX)
    mx_dim: int | None = None
    # the (rows, cols) of an NVFP4 operand's scale block (None: not NVFP4)
    nvfp4_block: tuple[int, int] | None = None

    def short(self) -> str:
        raise NotImplementedError

    def amax(self, hp: torch.Tensor) -> torch.Tensor:
        """The amax of each scaling group of ``hp``, in the scale's shape (float8kit.scaling)."""
        return scaling.amax(hp)

    def expand(self, scale: torch.Tensor, shape) -> torch.Tensor:
        """``scale`` broadcastable to one scale per element of data of ``shape``."""
        return scale

    def dequantize(self, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The fp32 values float8 ``data`` with ``scale`` stands for."""
        return data.to(torch.float32) / self.expand(scale, data.shape)

    def multiplier(self, scale: torch.Tensor, shape) -> torch.Tensor:
        """The fp32 factor per element that took hp to float8 (``fp8 ~ hp * factor``)."""
        return self.expand(scale, shape)

    def cast_input(self, hp: torch.Tensor) -> torch.Tensor:
        """What the cast multiplied by ``multiplier`` and rounded: ``hp`` itself (NVFP4 with a
        Hadamard transform: the transformed values)."""
        return hp

    def elements(self, data: torch.Tensor) -> torch.Tensor:
        """The fp32 values of the float8 elements ``data`` holds (before the scale)."""
        return data.to(torch.float32)

    def element_max(self, data: torch.Tensor) -> float:
        """The largest finite element value of ``data``'s format."""
        return scaling.fp8_max(data.dtype)

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

    # shard layout of a weight (see the module docstring)
    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """fp32 amaxes of the full weight's groups over ``shard``'s part of them (0 for the
        groups it does not touch), in the full scale's shape; NaN becomes inf."""
        return scaling.nan_to_inf(scaling.amax(shard))

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        """The part of the full weight's ``scale`` that casts ``shard`` (broadcasts to it)."""
        return scale

    def gathered_scale(self, scale: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """The part of the full weight's ``scale`` that the gathered (outer) weight needs."""
        return scale

    def cuts(self, outer_rows: int, world: int) -> bool:
        """Whether FSDP2's dim-0 shards of ``outer_rows`` rows over ``world`` ranks cut a
        scaling group whose scale is local to the rows (a block)."""
        return False


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

    # A weight's rows (scales (N, 1) for the global N): under FSDP2's dim-0 sharding a rank
    # owns whole rows of the outer weight, so its rows' amaxes are complete over the columns
    # it holds; the all-reduce assembles the rows and, when tensor parallel splits the
    # columns, takes each row's max over the TP ranks. Other shard dims are refused.
    def group_amaxes(self, shard, where):
        rows = scaling.nan_to_inf(scaling.amax(shard, reduce_dim=-1))
        _check_dim0(where)
        if where.full_shape[0] == shard.shape[0]:
            return rows
        full = rows.new_zeros((where.full_shape[0], 1))
        start = where.global_start(0)
        full[start : start + shard.shape[0]] = rows
        return full

    def shard_scale(self, scale, shard, where):
        _check_dim0(where)
        start = where.global_start(0)
        return scale[start : start + shard.shape[0]]

    def gathered_scale(self, scale, where):
        start = where.outer_offset[0]
        return scale[start : start + where.outer_shape[0]]


class _WholeBlocks:
    """Slicing, splitting and concatenating data in blocks of more than one row would cut
    through the blocks: refused (``_refuse``, the granularity's message)."""

    def sliced(self, scale, dim, fn, func):
        self._refuse(func)

    def split(self, scale, dim, n, fn, func):
        self._refuse(func)

    def cat(self, scales, dim, fn, func):
        self._refuse(func)


@dataclasses.dataclass(frozen=True)
class Blockwise(_WholeBlocks, Granularity):
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

    # One scale per block of the outer weight (the blocks a single device casts it in).
    # Where FSDP2's dim-0 shards cut blocks (``cuts``), a block that straddles shards gets the
    # max of their partial amaxes, so every shard is cast with the whole block's scale and
    # the gathered weight is bitwise the one-device cast (shards of whole blocks need no amax
    # collective: fsdp.py casts them alone). The full scale is (n_slots, ceil(R / b),
    # ceil(C / b)) for the global shape: one block grid per slot (TP shard, HSDP replica).
    def group_amaxes(self, shard, where):
        b = self.rows
        _check_dim0(where, "blockwise")
        grid = (where.n_slots, -(-where.full_shape[0] // b), -(-where.full_shape[1] // b))
        full = torch.zeros(grid, dtype=torch.float32, device=shard.device)
        if shard.numel() == 0:
            return full
        start = where.offset if where.dim == 0 else 0
        amax = scaling.row_block_amax(shard, b, start)
        first = start // b
        full[where.slot, first : first + amax.shape[0], : amax.shape[1]] = amax
        return full

    def shard_scale(self, scale, shard, where):
        start = where.offset if where.dim == 0 else 0
        rows = torch.arange(start, start + shard.shape[0], device=scale.device) // self.rows
        grid = self.gathered_scale(scale, where)
        return grid[rows].repeat_interleave(self.cols, dim=1)[:, : shard.shape[1]]

    def gathered_scale(self, scale, where):
        r, c = where.outer_shape
        return scale[where.slot, : -(-r // self.rows), : -(-c // self.cols)]

    def cuts(self, outer_rows, world):
        return world > 1 and math.ceil(outer_rows / world) % self.rows != 0

    def _refuse(self, func, shape=None):
        of = f" {tuple(shape)}" if shape is not None else ""
        raise NotImplementedError(
            f"float8kit: {func} on a blockwise Float8TrainingTensor{of} (blocks "
            f"{self.rows}x{self.cols}) would cut through its scale blocks; call "
            ".dequantize() first if hp math is really meant"
        )


@dataclasses.dataclass(frozen=True)
class MX(Granularity):
    """OCP MX blocks: one e8m0 scale byte (uint8 holding ``torch.float8_e8m0fnu``'s bits:
    ``2 ** (byte - 127)``,
    which *divides*: ``hp ~ fp8 * 2 ** (byte - 127)``) per 32 consecutive elements along
    ``dim``; the scale has the data's shape with ``dim`` reduced to ceil(n / 32). A partial
    last block (a token count) is a block of fewer elements. The cast is
    ``float8kit.cast.to_mx``; the gemm ``float8kit.gemm.mx_scaled_mm``."""

    dim: int

    @property
    def mx_dim(self) -> int:
        return self.dim

    def short(self) -> str:
        return f"mx(dim={self.dim}, 1x32)"

    def amax(self, hp):
        return scaling.mx_block_amax(hp, self.dim)

    def expand(self, scale, shape):
        full = scale.repeat_interleave(32, dim=self.dim)
        return full.narrow(self.dim, 0, shape[self.dim])

    def dequantize(self, data, scale):
        descale = scaling.mx_descale(scale)
        return data.to(torch.float32) * self.expand(descale, data.shape)

    def multiplier(self, scale, shape):
        return self.expand(scaling.mx_descale(scale).reciprocal(), shape)

    def transpose(self, scale, d0, d1):
        dim = {d0: d1, d1: d0}.get(self.dim, self.dim)
        return MX(dim), scale.transpose(d0, d1)

    def view(self, scale, old, new, func):
        # flattening / unflattening the leading dims of data blocked along its last dim
        if self.dim == len(old) - 1 and new[-1] == old[-1]:
            return MX(len(new) - 1), scale.reshape(*new[:-1], scale.shape[-1])
        if tuple(new) == tuple(old):
            return self, scale
        raise NotImplementedError(
            f"float8kit: {func} from {tuple(old)} to {tuple(new)} would cut through the 32-"
            f"element MX blocks of a Float8TrainingTensor (blocked along dim {self.dim}); call "
            ".dequantize() first if hp math is really meant"
        )

    def strided(self, scale, rows, ndim):
        # the first whole rows of data blocked along its last dim keep their rows' scales;
        # of 2-D data blocked along its rows (the FSDP2 weight gathered along N, already
        # ``rows`` rows: the identity) the blocks those rows lie in
        if rows is None:
            return None
        if self.dim == ndim - 1:
            return scale[:rows]
        return scale[: -(-rows // 32)] if self.dim == 0 and ndim == 2 else None

    def sliced(self, scale, dim, fn, func):
        if dim == self.dim:
            self._refuse(func)
        return fn(scale)

    def split(self, scale, dim, n, fn, func):
        if dim == self.dim:
            self._refuse(func)
        return fn(scale)

    def cat(self, scales, dim, fn, func):
        if dim == self.dim:
            self._refuse(func)
        return fn(scales)

    def _refuse(self, func):
        raise NotImplementedError(
            f"float8kit: {func} along the blocked dim {self.dim} of an MX Float8TrainingTensor "
            "would cut through its 32-element scale blocks; call .dequantize() first if hp "
            "math is really meant"
        )


@dataclasses.dataclass(frozen=True)
class NVFP4(_WholeBlocks, Granularity):
    """NVFP4 blocks of 2-D data (float8kit/nvfp4.py): the data are e2m1 codes (uint8, one
    per element); the scale is fp32 (2, ceil(R / rows), ceil(C / cols)): ``scale[0]`` one
    e4m3 block scale (its value) per ``rows`` x ``cols`` block, ``scale[1]`` the tensor's
    decode scale in every place; both *multiply* the e2m1 values back
    (``hp ~ e2m1 * scale[0] * scale[1]``). Blocks are 1 x 16 / 16 x 1 for activations and
    gradients (16 along the dim the gemm reduces), 16 x 16 for weights (their own transpose:
    one cast serves both gemms). ``hadamard``: the data are of the Hadamard-transformed
    tensor (``nvfp4.hadamard`` along the 16-long dim; the grad_weight gemm's operands),
    which ``dequantize`` undoes and the gemm does not need to (it cancels in the product)."""

    rows: int
    cols: int
    hadamard: bool = False

    @property
    def nvfp4_block(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def hadamard_dim(self) -> int | None:
        """The dim the transform runs along (the one the 16-element blocks do), or None."""
        if not self.hadamard:
            return None
        return 0 if self.rows > 1 else 1

    def short(self) -> str:
        return f"nvfp4({self.rows}x{self.cols}{', rht' if self.hadamard else ''})"

    def amax(self, hp):
        return scaling.block_amax(hp, self.nvfp4_block)

    def expand(self, scale, shape):
        return scaling.expand_block_scale(scale[0] * scale[1], self.nvfp4_block, shape)

    def dequantize(self, data, scale):
        values = nvfp4.values(data, scale, self.nvfp4_block)
        if self.hadamard:
            values = nvfp4.hadamard(values, self.hadamard_dim, inverse=True)
        return values

    def multiplier(self, scale, shape):
        return self.expand(scale, shape).reciprocal()

    def cast_input(self, hp):
        dim = self.hadamard_dim
        return hp if dim is None else nvfp4.hadamard(hp, dim)

    def elements(self, data):
        return nvfp4.decode(data)

    def element_max(self, data):
        return nvfp4.E2M1_MAX

    def transpose(self, scale, d0, d1):
        if d0 == d1:
            return self, scale
        return NVFP4(self.cols, self.rows, self.hadamard), scale.transpose(1, 2)

    def view(self, scale, old, new, func):
        if tuple(new) != tuple(old):
            self._refuse(func, old)
        return self, scale

    def strided(self, scale, rows, ndim):
        # FSDP2's view of the gathered weight: its first rows, the first rows of the grid
        return None if rows is None else scale[:, : -(-rows // self.rows)]

    def group_amaxes(self, shard, where):
        # the hook makes NVFP4 scales itself (float8kit/distributed/fsdp_nvfp4.py)
        raise NotImplementedError("float8kit: NVFP4 weight scales come from fsdp_nvfp4")

    shard_scale = gathered_scale = group_amaxes

    def _refuse(self, func, shape=None):
        of = f" {tuple(shape)}" if shape is not None else ""
        raise NotImplementedError(
            f"float8kit: {func} on an NVFP4 Float8TrainingTensor{of} (blocks "
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
    if gran is ScalingGranularity.NVFP4:
        b = NVFP4_BLOCK
        if ndim != 2:
            raise ValueError(f"float8kit: an NVFP4 cast takes 2-D operands, got {ndim}-D")
        if role is GemmRole.WEIGHT:
            return NVFP4(b, b, cast.hadamard)
        return NVFP4(1, b, cast.hadamard) if reduce_dim in (1, -1) else NVFP4(b, 1, cast.hadamard)
    if gran is ScalingGranularity.MX:
        return MX(reduce_dim % ndim)
    if gran is ScalingGranularity.AXISWISE:
        return Axiswise(reduce_dim % ndim)
    if gran is ScalingGranularity.BLOCKWISE:
        b = cast.block_size
        if role is GemmRole.WEIGHT:
            return Blockwise(b, b)
        return Blockwise(1, b) if reduce_dim in (1, -1) else Blockwise(b, 1)
    return TENSORWISE


def weight(cast: CastConfig) -> Granularity:
    """The granularity of a 2-D (N, K) weight cast per ``cast`` for the output gemm."""
    return of(cast, GemmRole.WEIGHT, -1, 2)


def _check_dim0(where: ShardSpec, what: str = "rowwise") -> None:
    if where.dim not in (None, 0):
        raise ValueError(
            f"float8kit: a {what} float8 all-gather weight must be sharded along dim 0 (FSDP2's "
            f"default), got a shard along dim {where.dim} of {tuple(where.outer_shape)}: drop "
            "the shard_placement_fn for it, or set enable_fsdp_float8_all_gather=False"
        )


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """Where a rank's shard sits in the FSDP2-unsharded weight and in the global one.

    FSDP2 shards the *outer* weight (``outer_shape``: the weight itself on a 1-D mesh or
    HSDP, this rank's tensor-parallel shard of it on a 2-D (dp, tp) mesh) along ``dim`` (None
    when the shard is the whole outer weight: one rank, or a dim FSDP2 did not need to split),
    from ``offset`` on. FSDP2 shards like ``torch.chunk``: every shard but the last non-empty
    ones has ``ceil(size / world)`` slices, so rank r starts at ``r * ceil(size / world)``.

    ``outer_offset`` is the outer weight's first index along each dim of the global weight
    (``full_shape``; all 0 without tensor parallelism). ``slot`` numbers this rank's place
    on the mesh dims other than FSDP2's shard dim (``n_slots`` of them: the TP shard, the
    HSDP replica): groups that live in the outer weight's own coordinates (blockwise
    blocks) reduce over ranks of the same slot only, see ``Blockwise``.
    """

    dim: int | None
    offset: int
    full_shape: torch.Size
    outer_shape: torch.Size | None = None
    outer_offset: tuple[int, ...] | None = None
    slot: int = 0
    n_slots: int = 1

    def __post_init__(self):
        if self.outer_shape is None:
            object.__setattr__(self, "outer_shape", torch.Size(self.full_shape))
        if self.outer_offset is None:
            object.__setattr__(self, "outer_offset", (0,) * len(self.full_shape))

    @staticmethod
    def of(local: torch.Size, full: torch.Size, rank: int, world: int, **outer) -> ShardSpec:
        """``local``: the shard's shape; ``full``: the outer weight's (FSDP2's
        ``outer_size``); ``outer``: the global placement (see the class doc), if any."""
        outer.setdefault("full_shape", torch.Size(full))
        outer["outer_shape"] = torch.Size(full)
        for dim, (n_local, n_full) in enumerate(zip(local, full, strict=True)):
            if n_local != n_full:
                return ShardSpec(dim, rank * math.ceil(n_full / world), **outer)
        return ShardSpec(None, 0, **outer)

    def global_start(self, dim: int) -> int:
        """The global index of the shard's first slice along ``dim``."""
        start = self.outer_offset[dim]
        return start + self.offset if dim == self.dim else start
