"""FSDP2 x TP (2x2, 1x2) and HSDP (2x2) on 4 gloo ranks (numbers/fsdp_mesh.json), every recipe
with and without the float8 all-gather: the worker."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.measures.gloo import (
    _Count,
    _train,
)
from float8kit import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    GemmRole,
    convert_to_float8_training,
    precompute_scales,
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
