"""The float8 gradient reduce-scatter (qgZ) against FSDP2's default on gloo ranks
(numbers/qgz.json): the worker, its byte counter and the gradient SQNR."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.measures.gloo import (
    _Count,
    _data,
    _shard,
    _uneven_net,
)
from benchmarks.measures.refs import sqnr
from float8kit import (
    E5M2,
    CastConfig,
    Float8LinearConfig,
    Float8ReduceScatterConfig,
    enable_float8_reduce_scatter,
)

# ---------------------------------------------------------------------------- gloo ranks

STEPS = 20
LR = 1e-3
TENSORWISE = Float8LinearConfig()


def _worker_qgz(rank: int, world: int, tmp: str, steps: int = STEPS) -> dict:
    """The uneven 32 -> 1040 -> 16 -> 2 net (3 ranks: shards 347/347/346, 6/6/4, 1/1/0 rows),
    each rank its own batch; every variant run with FSDP2's default reduce-scatter and with
    the float8 one. Rank 0 keeps the first-step full gradients, the losses and the bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    hsdp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    batch = 8
    xs, ys = _data(steps, batch * world, 32, 2)
    local = slice(rank * batch, (rank + 1) * batch)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)

    def run(qgz, config=TENSORWISE, n_steps=1, divide=None, mesh=mesh, rs=None, **fsdp_kwargs):
        model = _uneven_net(config)
        if fsdp_kwargs.pop("compiled", False):
            # the 1040-wide layer compiled as an FSDP2 block would be (one compile: its cost)
            model[0] = torch.compile(model[0], fullgraph=True)
        _shard(model, mesh, [model[0], model[2], model[4]], **fsdp_kwargs)
        if divide is not None:
            for m in (model, model[0], model[2], model[4]):
                m.set_gradient_divide_factor(divide)
                # gloo has no PREMUL_SUM: the default reduce-scatter needs a SUM and a
                # separate division; the float8 one takes PREMUL_SUM's factor itself
                m.set_force_sum_reduction_for_comms(not qgz)
        if qgz:
            assert enable_float8_reduce_scatter(model, config=rs) is model
            assert enable_float8_reduce_scatter(model, config=rs) is model  # no-op
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        out = {"losses": [], "backward_s": []}
        for step in range(n_steps):
            loss = F.mse_loss(model(xs[step, local]).float(), ys[step, local])
            if step == 0:
                with _Count("all_to_all_single", "reduce_scatter_single") as sent:
                    loss.backward()
                out["bytes"] = sent.by_name
                grads = [p.grad.full_tensor().float() for p in model.parameters()]
                out["grads"] = grads if rank == 0 else None
            else:
                dist.barrier()  # time this rank's backward, not the wait for the others
                t0 = time.perf_counter()
                loss.backward()
                out["backward_s"].append(time.perf_counter() - t0)
            opt.step()
            opt.zero_grad()
            loss = loss.detach()
            dist.all_reduce(loss)
            out["losses"].append(loss.item() / world)
        return out

    res: dict = {"shard_rows": None}
    model = _uneven_net(TENSORWISE)
    _shard(model, mesh, [model[0], model[2], model[4]])
    res["shard_rows"] = [model[i].weight.to_local().shape[0] for i in (0, 2, 4)]
    variants = {
        "fp32": {"n_steps": steps},
        "bf16": {"mp_policy": bf16},
        "fp8_all_gather": {
            "config": dataclasses.replace(TENSORWISE, enable_fsdp_float8_all_gather=True)
        },
        "divide_by_1": {"divide": 1.0},
        "hsdp": {"mesh": hsdp_mesh},
        "e5m2": {
            "rs": Float8ReduceScatterConfig(
                CastConfig(scaling_granularity="blockwise", target_dtype=E5M2)
            )
        },
    }
    for name in ("rowwise", "rowwise_with_gw_hp", "delayed", "blockwise"):
        variants[name] = {"config": Float8LinearConfig.from_recipe_name(name)}
    for name, kwargs in variants.items():
        res[name] = {"default": run(False, **kwargs), "float8": run(True, **kwargs)}
    if world == 2:  # API errors that need real FSDP2 modules
        model = _uneven_net(TENSORWISE)
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        res["errors"] = {}
        try:  # the blocks are sharded, the root is not
            enable_float8_reduce_scatter(model)
        except ValueError as e:
            res["errors"]["unsharded_root"] = str(e)
        fully_shard(model, mesh=mesh)
        enable_float8_reduce_scatter(model)
        try:
            enable_float8_reduce_scatter(
                model,
                config=Float8ReduceScatterConfig(
                    CastConfig(scaling_granularity="blockwise", target_dtype=E5M2)
                ),
            )
        except ValueError as e:
            res["errors"]["other_config"] = str(e)
    if world == 2:  # compile once (test_compiled_layer_... runs on 2 ranks only)
        torch._dynamo.reset()
        res["compiled"] = run(True, n_steps=3, compiled=True)
        res["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    return res


def _grad_sqnr(run: dict) -> float:
    """SQNR of the float8 run's first-step gradients (all parameters as one vector) against
    the default reduce-scatter's."""
    ref = torch.cat([g.flatten() for g in run["default"]["grads"]])
    return sqnr(ref, torch.cat([g.flatten() for g in run["float8"]["grads"]]))
