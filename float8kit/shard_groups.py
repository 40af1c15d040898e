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
all-gather (float8kit/fsdp.py): a ``Layout`` says how a shard's group amaxes fill the full
weight's scale shape, which part of the full scale casts the shard, and the granularity of
the gathered ``Float8TrainingTensor``. Blockwise weights need none of it (each block-aligned
shard's block scales are its own; fsdp.py gathers them with the bytes).

Internal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from float8kit import scaling
from float8kit.config import CastConfig, ScalingGranularity


@dataclass(frozen=True)
class ShardSpec:
    """Where a rank's shard sits in the full weight.

    ``dim`` is the sharded dim (None when the shard is the whole weight: one rank, or a dim
    FSDP2 did not need to split) and ``offset`` the shard's first index along it. FSDP2
    shards like ``torch.chunk``: every shard but the last non-empty ones has
    ``ceil(size / world)`` slices, so rank r starts at ``r * ceil(size / world)``.
    """

    dim: int | None
    offset: int
    full_shape: torch.Size

    @staticmethod
    def of(local: torch.Size, full: torch.Size, rank: int, world: int) -> ShardSpec:
        for dim, (n_local, n_full) in enumerate(zip(local, full, strict=True)):
            if n_local != n_full:
                return ShardSpec(dim, rank * math.ceil(n_full / world), torch.Size(full))
        return ShardSpec(None, 0, torch.Size(full))


def _nan_to_inf(amax: torch.Tensor) -> torch.Tensor:
    # An all-reduce(MAX) may drop a NaN (it compares) but keeps inf, and an inf amax gives
    # scale 0, which turns the cast into NaN: a bad shard stays visible on every rank.
    return torch.where(torch.isnan(amax), math.inf, amax)


class Layout:
    """How one weight granularity's scaling groups map onto a shard (see the module doc)."""

    # the gathered Float8TrainingTensor's ``_axiswise_dim`` (None: tensorwise)
    axiswise_dim: int | None = None

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        """fp32 amaxes of the full weight's groups over ``shard``'s part of them (0 for the
        groups it does not touch), in the full scale's shape; NaN becomes inf."""
        raise NotImplementedError

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        """The part of the full weight's ``scale`` that casts ``shard``."""
        raise NotImplementedError


class _Tensorwise(Layout):
    axiswise_dim = None

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        return _nan_to_inf(scaling.amax(shard))

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        return scale


class _Rowwise(Layout):
    """One scale per row of the (N, K) weight: shape (N, 1). Under FSDP2's dim-0 sharding a
    rank owns whole rows, so its rows' amaxes are complete; the all-reduce only assembles
    them. Other shard dims are refused (the gathered weight would not be row-major rows)."""

    axiswise_dim = 1

    def group_amaxes(self, shard: torch.Tensor, where: ShardSpec) -> torch.Tensor:
        rows = _nan_to_inf(scaling.amax(shard, reduce_dim=-1))
        if where.dim is None:
            return rows
        _check_dim0(where)
        full = rows.new_zeros((where.full_shape[0], 1))
        full[where.offset : where.offset + shard.shape[0]] = rows
        return full

    def shard_scale(self, scale: torch.Tensor, shard: torch.Tensor, where: ShardSpec):
        if where.dim is None:
            return scale
        _check_dim0(where)
        return scale[where.offset : where.offset + shard.shape[0]]


def _check_dim0(where: ShardSpec) -> None:
    if where.dim != 0:
        raise ValueError(
            "float8kit: a rowwise float8 all-gather weight must be sharded along dim 0 (FSDP2's "
            f"default), got a shard along dim {where.dim} of {tuple(where.full_shape)}: drop "
            "the shard_placement_fn for it, or set enable_fsdp_float8_all_gather=False"
        )


_LAYOUTS: dict[ScalingGranularity, Layout] = {
    ScalingGranularity.TENSORWISE: _Tensorwise(),
    ScalingGranularity.AXISWISE: _Rowwise(),
}


def layout(cast: CastConfig) -> Layout:
    """The ``Layout`` of a weight cast (the output gemm's ``cast_config_weight``)."""
    return _LAYOUTS[cast.scaling_granularity]
