"""FSDP2 float8 all-gather at any world size, simulated in one process (no processes).

For N virtual ranks the test runs what FSDP2 runs on each of them: it shards a weight along
dim 0 like ``torch.chunk`` (uneven shards, empty shards on the last ranks), calls
``fsdp_pre_all_gather`` on every rank's shard, concatenates what the ranks would send (the
all-gather), and calls ``fsdp_post_all_gather`` on the result, then FSDP2's ``as_strided`` to
the full size. The gathered float8 weight must be bitwise the single-device cast of the whole
weight (data and scales), for every recipe that all-gathers in float8, at N in {1, 2, 3, 8,
64, 128, 1024}.

The one collective (the amax all-reduce that ``precompute_scales`` does) is simulated too:
every rank's granularity group amaxes, max-reduced, turned into the scale that
``precompute_scales`` stores on the module. DELAYED and STATIC weights use the layer's scale
buffer (set, as after the first step), so no rank needs a collective in the hook.

Shapes: the sharded dim (rows) of real layers (4096, 8192, 14336 rows: Llama-3 8B/70B
projections) with 256 columns, which no sharding touches (dim-0 shards), for the whole
matrix; two whole real weights (4096x14336 tensorwise at 128 ranks, 14336x4096 blockwise at
1024 ranks: 14-row shards) (a whole 8192x28672 weight takes ~15 s on 2 CPU cores: its row
count is in the matrix); and odd shapes for uneven and empty shards.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from float8kit import CastConfig, Float8LinearConfig, GemmRole, ScalingGranularity
from float8kit.cast import cast_to_float8, operand_scale
from float8kit.distributed.fsdp import (
    Float8AllGatherWeight,
    PrecomputedScale,
    _stamp,
    shard_spec,
)
from float8kit.formats import weight as weight_granularity
from float8kit.linear import Float8Linear
from tests.helpers import recipes

WORLDS = (1, 2, 3, 8, 64, 128, 1024)
# every recipe with an FSDP2 float8 all-gather and no layer-dim multiple (the simulation's
# weights have 144 columns), from the format registry, and a STATIC weight scale
RECIPES = [
    *recipes(lambda caps: caps.fsdp_float8_all_gather and caps.layer_multiple is None),
    "static",
]
WEIGHT_SCALE = 2.0**-2  # the DELAYED/STATIC weight scale (fits the test weights' range)


class FakeMesh:
    """FSDP2's 1-D shard mesh as the hooks see it: its size and this rank's index."""

    ndim = 1

    def __repr__(self) -> str:
        return f"FakeMesh(rank={self.rank}, world={self.world})"

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def size(self) -> int:
        return self.world

    def get_local_rank(self) -> int:
        return self.rank

    def get_group(self):
        raise AssertionError("a collective in the hook: the simulation provides the scales")


def _config(recipe: str) -> Float8LinearConfig:
    if recipe == "static":
        cast = CastConfig(scaling_type="static", static_scale=WEIGHT_SCALE)
        config = Float8LinearConfig(cast_config_weight=cast)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=True)


def _module(config: Float8LinearConfig) -> Float8Linear:
    """The layer the hooks read their scale state from (its weight's values are not used)."""
    module = Float8Linear(16, 16, bias=False, config=config).eval()
    if config.cast_config_weight.scaling_type.value == "delayed":
        module.fp8_scale_weight.fill_(WEIGHT_SCALE)
        module.fp8_state.mark_scales_set("weight")
    return module


def _shards(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    chunk = math.ceil(full.shape[0] / world)
    return [full[min(r * chunk, len(full)) : min((r + 1) * chunk, len(full))] for r in range(world)]


def simulate_all_gather(full: torch.Tensor, config: Float8LinearConfig, world: int):
    """The float8 weight FSDP2 would gather from ``world`` ranks' shards of ``full``."""
    module = _module(config)
    shards = _shards(full, world)
    outer = full.shape
    cast = config.cast_config_weight
    weights = [Float8AllGatherWeight(s, config) for s in shards]
    blocks = cast.scaling_granularity is ScalingGranularity.BLOCKWISE
    aligned_blocks = blocks and not weight_granularity(cast).cuts(outer[0], world)
    if cast.scaling_type.value == "dynamic" and not aligned_blocks:
        # precompute_scales: every rank's group amaxes, one all-reduce(MAX), the scale
        groups = weight_granularity(cast)
        specs = [
            shard_spec(s.shape, outer, FakeMesh(r, world), module, groups)
            for r, s in enumerate(shards)
        ]
        local = [groups.group_amaxes(s, spec) for s, spec in zip(shards, specs, strict=True)]
        amax = torch.stack(local).amax(0)
        scale = operand_scale(cast, GemmRole.WEIGHT, config, amax)
        module.fp8_state.all_gather_scale = PrecomputedScale(scale, *_stamp(module.weight), amax)
    sent = [
        w.fsdp_pre_all_gather(FakeMesh(r, world), outer, (outer[1], 1), module, None)
        for r, w in enumerate(weights)
    ]
    inputs, metas = zip(*sent, strict=True)
    for meta in metas[1:]:  # replicated metadata: the same scale on every rank
        assert all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(meta, metas[0], strict=True)
        )
    gathered = tuple(torch.cat(parts) for parts in zip(*inputs, strict=True))
    padded_rows = math.ceil(outer[0] / world) * world
    assert gathered[0].shape == (padded_rows, outer[1]) and gathered[0].dtype == torch.uint8
    weight, _ = weights[0].fsdp_post_all_gather(gathered, metas[0], full.dtype)
    return torch.as_strided(weight, outer, (outer[1], 1), storage_offset=0)


def _assert_single_device_cast(weight, full: torch.Tensor, config: Float8LinearConfig):
    cast = config.cast_config_weight
    module = _module(config)
    state_scale, _, scale_set = module.fp8_state.operand(module, GemmRole.WEIGHT, False)
    ref = cast_to_float8(full, cast, GemmRole.WEIGHT, -1, config, state_scale, None, scale_set)
    assert weight.shape == full.shape and weight.dtype == full.dtype
    assert weight._axiswise_dim == ref._axiswise_dim and weight._block == ref._block
    assert torch.equal(weight._scale.reshape(ref._scale.shape), ref._scale)
    data = weight._data.view(torch.uint8)[: full.shape[0]]
    assert torch.equal(data, ref._data.view(torch.uint8))


def _weight(rows: int, cols: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * 7 + cols)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float32)
    # rows of different magnitudes: row and block scales differ across shards
    w *= torch.logspace(-2, 2, rows).unsqueeze(1)
    return w.to(dtype)


@pytest.mark.parametrize("recipe", RECIPES)
def test_any_world_size_gathers_the_single_device_cast(recipe):
    config = _config(recipe)
    for rows in (4096, 8192, 14336):
        full = _weight(rows, 128)
        for world in WORLDS:
            weight = simulate_all_gather(full, config, world)
            _assert_single_device_cast(weight, full, config)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    ("rows", "world"),
    [(1000, 64), (255, 2), (5, 8), (130, 3), (1, 1024), (300, 1024)],
    ids=["uneven-empty", "partial-block", "rows<ranks", "3-cut", "one-row", "300@1024"],
)
def test_uneven_and_empty_shards(recipe, rows, world):
    config = _config(recipe)
    full = _weight(rows, 144)  # a partial column block too
    weight = simulate_all_gather(full, config, world)
    _assert_single_device_cast(weight, full, config)


@pytest.mark.parametrize(
    ("shape", "world", "recipe"),
    [
        ((4096, 14336), 128, "tensorwise"),
        ((14336, 4096), 1024, "blockwise"),  # 14-row shards: nearly every block is cut
    ],
)
def test_whole_real_weights(shape, world, recipe):
    config = _config(recipe)
    full = _weight(*shape)
    weight = simulate_all_gather(full, config, world)
    _assert_single_device_cast(weight, full, config)


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_shards_along_dim_1_raise_naming_layer_mesh_and_fix(recipe):
    # shard_placement_fn=Shard(1): the row (or block) scales would span the ranks' columns
    config = _config(recipe)
    module = _module(config)
    shard = Float8AllGatherWeight(torch.randn(384, 96), config)
    mesh = FakeMesh(1, 3)
    with pytest.raises(ValueError, match="must be sharded along dim 0") as err:
        shard.fsdp_pre_all_gather(mesh, torch.Size([384, 288]), (288, 1), module, None)
    msg = str(err.value)
    assert "Float8Linear(in_features=16" in msg and "FakeMesh" in msg
    assert "shard_placement_fn" in msg and "enable_fsdp_float8_all_gather=False" in msg
