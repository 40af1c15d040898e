"""Scaling groups of a sharded weight: where each granularity's scales come from under FSDP2.

A weight's *scaling groups* are the slices that share one scale: the whole tensor
(tensorwise), or one row of the (N, K) weight (axiswise along dim -1, the output gemm's
rowwise cast). FSDP2 shards the weight along one dim (dim 0 by default, unevenly, with empty
shards on some ranks); a rank sees only its part of each group. Every group's amax over the
full weight is then the MAX over ranks of the group's amax over each rank's part, where a
rank that does not touch a group contributes 0 (amaxes are never negative). So the full
weight's group amaxes are one all-reduce(MAX) of tensors of the same shape on every rank:
the hook's fallback, or a slice of ``precompute_scales``' single collective.

This is where a weight granularity whose scales span shards plugs into the float8
all-gather (distributed/fsdp.py): a ``Layout`` says how a shard's group amaxes fill the full
weight's scale shape, which part of the full scale casts the shard, and the granularity of
the gathered ``Float8TrainingTensor``. Blockwise weights need it only where shards cut
128-row blocks (a block-aligned shard's block scales are its own; fsdp.py gathers them with
the bytes). Under tensor parallelism the full shape is the global weight's (``ShardSpec``).

Internal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from float8kit import scaling
from float8kit.config import CastConfig, ScalingGranularity
from float8kit.granularity import TENSORWISE, Axiswise, Blockwise, Granularity


@dataclass(frozen=True)
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
    blocks) reduce over ranks of the same slot only, see ``_Blockwise``.
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


class Layout:
    """How one weight granularity's scaling groups map onto a shard (see the module doc)."""

    # the gathered Float8TrainingTensor's granularity
    gran: Granularity = TENSORWISE

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """fp32 amaxes of the full weight's groups over ``shard``'s part of them (0 for the
        groups it does not touch), in the full scale's shape; NaN becomes inf."""
        raise NotImplementedError

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        """The part of the full weight's ``scale`` that casts ``shard`` (broadcasts to it)."""
        raise NotImplementedError

    def gathered_scale(self, scale: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """The part of the full weight's ``scale`` that the gathered (outer) weight needs."""
        raise NotImplementedError


class _Tensorwise(Layout):
    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        return scaling.nan_to_inf(scaling.amax(shard))

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        return scale

    def gathered_scale(self, scale: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        return scale


class _Rowwise(Layout):
    """One scale per row of the (N, K) weight: shape (N, 1) for the global N. Under FSDP2's
    dim-0 sharding a rank owns whole rows of the outer weight, so its rows' amaxes are
    complete over the columns it holds; the all-reduce assembles the rows and, when tensor
    parallel splits the columns (``RowwiseParallel``), takes each row's max over the TP
    ranks. Other FSDP2 shard dims are refused (the gathered weight would not be whole rows)."""

    gran = Axiswise(1)

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        rows = scaling.nan_to_inf(scaling.amax(shard, reduce_dim=-1))
        _check_dim0(where)
        if where.full_shape[0] == shard.shape[0]:
            return rows
        full = rows.new_zeros((where.full_shape[0], 1))
        start = where.global_start(0)
        full[start : start + shard.shape[0]] = rows
        return full

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        _check_dim0(where)
        start = where.global_start(0)
        return scale[start : start + shard.shape[0]]

    def gathered_scale(self, scale: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        start = where.outer_offset[0]
        return scale[start : start + where.outer_shape[0]]


class _Blockwise(Layout):
    """One scale per ``b`` x ``b`` block of the outer weight (the blocks a single device
    casts it in), shape (ceil(R / b), ceil(C / b)). Used only where FSDP2's dim-0 shards cut
    blocks (``cuts_blocks``): a block that straddles two (or more) shards gets the max of
    their partial amaxes, so every shard is cast with the whole block's scale and the
    gathered weight is bitwise the one-device cast. Shards of whole blocks need no amax
    collective at all (distributed/fsdp.py casts them alone).

    The full scale is (n_slots, ceil(R_max / b), ceil(C_max / b)): one block grid per slot
    (TP shard, HSDP replica), since the blocks are the outer weight's, and the ranks of other
    slots contribute 0 to it (the grid is sized from the global shape, so it is the same on
    every rank)."""

    def __init__(self, block_size: int):
        self.b = block_size
        self.gran = Blockwise(block_size, block_size)

    def grid(self, where: ShardSpec) -> tuple[int, int, int]:
        b = self.b
        return (where.n_slots, -(-where.full_shape[0] // b), -(-where.full_shape[1] // b))

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        b = self.b
        _check_dim0(where, "blockwise")
        full = torch.zeros(self.grid(where), dtype=torch.float32, device=shard.device)
        if shard.numel() == 0:
            return full
        start = where.offset if where.dim == 0 else 0
        amax = scaling.row_block_amax(shard, b, start)
        first = start // b
        full[where.slot, first : first + amax.shape[0], : amax.shape[1]] = amax
        return full

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        b = self.b
        start = where.offset if where.dim == 0 else 0
        rows = torch.arange(start, start + shard.shape[0], device=scale.device) // b
        grid = self.gathered_scale(scale, where)
        return grid[rows].repeat_interleave(b, dim=1)[:, : shard.shape[1]]

    def gathered_scale(self, scale: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        r, c = where.outer_shape
        return scale[where.slot, : -(-r // self.b), : -(-c // self.b)]


def _check_dim0(where: ShardSpec, what: str = "rowwise") -> None:
    if where.dim not in (None, 0):
        raise ValueError(
            f"float8kit: a {what} float8 all-gather weight must be sharded along dim 0 (FSDP2's "
            f"default), got a shard along dim {where.dim} of {tuple(where.outer_shape)}: drop "
            "the shard_placement_fn for it, or set enable_fsdp_float8_all_gather=False"
        )


_LAYOUTS: dict[ScalingGranularity, Layout] = {
    ScalingGranularity.TENSORWISE: _Tensorwise(),
    ScalingGranularity.AXISWISE: _Rowwise(),
}


def layout(cast: CastConfig) -> Layout:
    """The ``Layout`` of a weight cast (the output gemm's ``cast_config_weight``)."""
    if cast.scaling_granularity is ScalingGranularity.BLOCKWISE:
        return _Blockwise(cast.block_size)
    return _LAYOUTS[cast.scaling_granularity]


def cuts_blocks(cast: CastConfig, outer_rows: int, world: int) -> bool:
    """Whether FSDP2's dim-0 shards of a blockwise weight with ``outer_rows`` rows over
    ``world`` ranks cut its scale blocks (shards of ``ceil(rows / world)`` rows)."""
    if cast.scaling_granularity is not ScalingGranularity.BLOCKWISE or world == 1:
        return False
    return math.ceil(outer_rows / world) % cast.block_size != 0
