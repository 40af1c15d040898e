"""Tensorwise: one float8 scale for the whole tensor, shape ``()``; every metadata op keeps
it. The only format whose scale can come from a delayed or static policy, and the one
``float8kit::cast_tensorwise`` casts in one pass (float8kit/cast.py)."""

from __future__ import annotations

import dataclasses

import torch

from float8kit import scaling
from float8kit.config import ScalingType
from float8kit.formats.base import (
    GLOBAL_AMAX,
    Capabilities,
    Float8Elements,
    Format,
    GroupScaledGather,
    same_scales,
)


@dataclasses.dataclass(frozen=True)
class Tensorwise(GroupScaledGather, Float8Elements, Format):
    capabilities = Capabilities(
        scaling_types=(ScalingType.DYNAMIC, ScalingType.DELAYED, ScalingType.STATIC),
        fsdp_float8_all_gather=True,
        tensor_parallel=GLOBAL_AMAX,
        experts=False,
        ep_dispatch=False,
        layer_multiple=None,
        min_cuda_capability=(8, 9),
        gemm="scaled",
    )
    shards_any_dim = True  # one scale: every shard of any dim casts with it

    @classmethod
    def for_operand(cls, cast, role, reduce_dim, ndim):
        return TENSORWISE

    def short(self) -> str:
        return "tensorwise"

    def amax(self, hp):
        return scaling.amax(hp)

    def dtensor_amax(self, hp):
        return scaling.dtensor_amax(hp, None)

    def transpose(self, scale, d0, d1):
        return self, scale

    def view(self, scale, old, new, func):
        return self, scale

    def strided(self, scale, rows, ndim):
        return scale

    def sliced(self, scale, dim, fn, func):
        return scale

    def split(self, scale, dim, n, fn, func):
        return [scale] * n

    def cat(self, scales, dim, fn, func):
        return same_scales(scales)

    # the whole weight's amax: the MAX of every shard's
    def group_amaxes(self, shard, where):
        return scaling.nan_to_inf(scaling.amax(shard))

    def shard_scale(self, scale, shard, where):
        return scale

    def gathered_scale(self, scale, where):
        return scale

    def precompute_amaxes(self, shards, wheres):
        # every weight's one amax in one batched pass
        return [scaling.local_amaxes(shards)], [torch.Size([])] * len(shards)


TENSORWISE = Tensorwise()
