"""FSDP2 float8 all-gather on 2-D meshes: FSDP2 x tensor parallel (dp, tp) and HSDP
(replicate, shard), for every recipe that all-gathers weights in float8, on real gloo ranks.

A tiny model whose norm stays dp-only (not TP-sharded) and whose two Float8Linear layers are
TP-sharded colwise and rowwise (torch's styles) trains 3 AdamW steps with
``precompute_scales`` on each mesh, with and without float8 all-gather: the losses must be
equal (the float8 all-gather casts every shard with the scale of the whole weight, over
every mesh dim it is sharded on, so the gathered weight is the one the hp all-gather would
be cast to). On the same meshes: the dp all-gather's bytes against the bf16 all-gather,
exactly one collective in ``precompute_scales`` and no extra one in forward/backward, and a
tensorwise weight's precomputed scale against the whole weight's amax.
Meshes (4 ranks): 2x2 (dp, tp), 2x2 HSDP, and 1x2 (dp, tp) sub-meshes of half the ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from float8kit import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    GemmRole,
    convert_to_float8_training,
    precompute_scales,
)
from tests.fsdp_harness import (
    _Count,
    _rel_diff,
    _train,
    spawn,
)

RECIPES = ("tensorwise", "delayed", "static", "rowwise", "rowwise_with_gw_hp", "blockwise")
STEPS = 3
DIM, HIDDEN, BATCH = 64, 256, 4


class Tiny(nn.Module):
    """norm (dp-only) -> w1 (TP colwise) -> relu -> w2 (TP rowwise)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.relu(self.w1(self.norm(x))))


def recipe_config(recipe: str, fp8_all_gather: bool) -> Float8LinearConfig:
    if recipe == "static":  # a static weight scale, dynamic input and grad_output
        cast = CastConfig(scaling_type="static", static_scale=2.0**8)
        config = Float8LinearConfig(cast_config_weight=cast)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=fp8_all_gather)


def parallel_tiny(recipe: str, fp8_all_gather: bool, kind: str, mesh, **fsdp_kwargs):
    """Tiny, converted, then TP (``kind`` "tp": mesh dims (dp, tp)) and FSDP2 (over dp; the
    whole 2-D mesh for "hsdp")."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    config = recipe_config(recipe, fp8_all_gather)
    model = convert_to_float8_training(Tiny(), config=config, module_filter_fn=lambda m, f: True)
    if kind == "tp":
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"], **fsdp_kwargs)
    else:
        fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _meshes():
    """(name, kind, mesh) on 4 ranks. "1x2": two independent 1x2 (dp, tp) meshes, ranks
    {0, 1} and {2, 3} (a sub-mesh that spans half the ranks: its amax group is the
    flattened sub-mesh, not the default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    yield "2x2", "tp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    yield "hsdp", "hsdp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    pairs = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pair", "dp", "tp"))
    yield "1x2", "tp", pairs["dp", "tp"]


def _dp_slice(kind: str, mesh) -> tuple[int, int]:
    """(this rank's data-parallel index, number of data-parallel ranks)."""
    if kind == "tp":
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    return mesh.get_local_rank(0) * mesh.size(1) + mesh.get_local_rank(1), mesh.size()


def _whole_weight_scales_ok(model) -> bool:
    """Every tensorwise precomputed scale is fp8_max / amax of the *whole* weight."""
    from float8kit.cast import operand_scale

    for m in model.modules():
        if not isinstance(m, Float8Linear):
            continue
        full = m.weight.full_tensor()  # the global weight, all dp and tp shards
        amax = full.abs().max().to(torch.float32)
        ref = operand_scale(m.config.cast_config_weight, GemmRole.WEIGHT, m.config, amax)
        if not torch.equal(m.fp8_state.all_gather_scale.scale, ref):
            return False
    return True


def _all_gather_bytes(recipe, fp8_ag, kind, mesh, x) -> int:
    """Bytes the dp all-gathers move in one forward + backward, bf16 parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = parallel_tiny(recipe, fp8_ag, kind, mesh, mp_policy=mp)
    with _Count("all_gather_single") as ag:
        model(x.bfloat16()).float().sum().backward()
    return ag.bytes


def _worker_mesh(rank: int, world: int, tmp: str) -> dict:
    g = torch.Generator().manual_seed(1234)
    res: dict = {}
    for name, kind, mesh in _meshes():
        dp_rank, n_dp = _dp_slice(kind, mesh)
        xs = torch.randn(STEPS, BATCH * n_dp, DIM, generator=g)
        ys = torch.randn(STEPS, BATCH * n_dp, DIM, generator=g)
        local = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
        for recipe in RECIPES:
            for fp8_ag in (False, True):
                model = parallel_tiny(recipe, fp8_ag, kind, mesh)
                losses, _ = _train(model, xs[:, local], ys[:, local], STEPS)
                res[name, recipe, fp8_ag] = losses
                with _Count("all_reduce") as ar:
                    precompute_scales(model)
                res[name, recipe, fp8_ag, "precompute_all_reduces"] = ar.calls
                with _Count("all_reduce") as ar:
                    model(xs[0, local]).sum().backward()
                res[name, recipe, fp8_ag, "fwd_bwd_all_reduces"] = ar.calls
                if recipe == "tensorwise" and fp8_ag:
                    res[name, "whole_weight_scales"] = _whole_weight_scales_ok(model)
                if fp8_ag or recipe == "tensorwise":  # the bf16 all-gather: any recipe's
                    res[name, recipe, fp8_ag, "all_gather_bytes"] = _all_gather_bytes(
                        recipe, fp8_ag, kind, mesh, xs[0, local]
                    )
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def mesh4(tmp_path_factory):
    return spawn("tests.test_fsdp_mesh:_worker_mesh", 4, tmp_path_factory.mktemp("mesh4"))


def _check_mesh(results: list[dict], name: str) -> None:
    for recipe in RECIPES:
        for r in results:
            hp, fp8 = r[name, recipe, False], r[name, recipe, True]
            diff = _rel_diff(fp8, hp)
            print(f"{name} {recipe}: float8 vs hp all-gather losses rel diff {diff:.1e}")
            assert diff <= 1e-5, (name, recipe, fp8, hp)
            # one collective in precompute_scales (none where nothing needs one: a static
            # weight with dynamic input and grad_output), none added to forward and backward
            # (nor for blockwise weights whose shards hold whole blocks: one dp rank)
            expected = 0 if recipe == "static" or (recipe, name) == ("blockwise", "1x2") else 1
            assert r[name, recipe, True, "precompute_all_reduces"] == expected
            extra = r[name, recipe, True, "fwd_bwd_all_reduces"]
            assert extra == r[name, recipe, False, "fwd_bwd_all_reduces"]
        fp8_bytes = results[0][name, recipe, True, "all_gather_bytes"]
        bf16_bytes = results[0][name, "tensorwise", False, "all_gather_bytes"]
        if name == "1x2":  # a dp mesh of one rank gathers nothing
            assert fp8_bytes == bf16_bytes == 0
            continue
        ratio = fp8_bytes / bf16_bytes
        print(f"{name} {recipe}: dp all-gather bytes float8 / bf16 = {ratio:.3f}")
        assert ratio <= 0.55
    assert all(r[name, "whole_weight_scales"] for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["2x2", "hsdp", "1x2"])
def test_float8_all_gather_equals_hp_all_gather(mesh4, name):
    _check_mesh(mesh4, name)
