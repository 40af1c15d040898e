"""FSDP2 float8 all-gather for blockwise weights (numbers/fsdp_blockwise.json): the gloo worker."""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.measures.gloo import (
    _Count,
    _data,
    _net,
    _shard,
    _train,
)
from float8kit import Float8LinearConfig, precompute_scales

BLOCK = Float8LinearConfig.from_recipe_name("blockwise")
BLOCK_AG = dataclasses.replace(BLOCK, enable_fsdp_float8_all_gather=True)
STEPS = 3


def _block_net(config: Float8LinearConfig, world: int, hidden_blocks: int | None = None):
    """One block, dim 128 x world, hidden 256 x world: every rank's dim-0 shard of both
    weights is whole 128-row blocks (``hidden_blocks`` overrides the hidden size)."""
    hidden = 128 * (hidden_blocks or 2 * world)
    return _net(config, dim=128 * world, hidden=hidden, n_blocks=1)


def _worker_blockwise(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    batch, dim = 4, 128 * world
    xs, ys = _data(STEPS, batch * world, dim, 16)
    local = slice(rank * batch, (rank + 1) * batch)
    res: dict = {}

    def fsdp_net(config=BLOCK_AG, **fsdp_kwargs):
        model = _block_net(config, world)
        _shard(model, mesh, model.layers, **fsdp_kwargs)
        return model

    if world in (2, 3):  # every shard whole blocks
        model = fsdp_net()
        res["local_rows"] = [b.fc1.weight.to_local().shape[0] for b in model.layers]
        res["split"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
        with _Count("all_reduce") as ar:
            precompute_scales(model)
        res["precompute_all_reduces"] = ar.calls
        with _Count("all_reduce") as ar:
            model(xs[0, local]).sum().backward()
        res["fwd_bwd_all_reduces"] = ar.calls
        # Every rank on the whole global batch: only the sharding differs from one device.
        res["replicated"], _ = _train(fsdp_net(), xs, ys, STEPS)

        # Bytes all-gathered in one forward + backward, bf16 parameters: float8 vs bf16.
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for name, config in (("fp8", BLOCK_AG), ("bf16", BLOCK)):
            model = fsdp_net(config, mp_policy=mp_policy, reshard_after_forward=True)
            with _Count("all_gather_single") as ag:
                model(xs[0, local]).sum().backward()
            res[f"all_gather_bytes_{name}"] = ag.bytes

    if world in (3, 4):
        # 1024- and 256-row weights: 3 ranks cut both into 342- and 86-row shards, 4 ranks
        # cut the 256-row one into 64-row shards. A straddling block's scale is the whole
        # block's (partial amaxes max-reduced, in precompute_scales' one all-reduce).
        cx, cy = _data(STEPS, batch * world, 256, 16)

        def cut_net(config=BLOCK_AG):
            model = _net(config, dim=256, hidden=1024, n_blocks=1)
            _shard(model, mesh, model.layers)
            return model

        model = cut_net()
        block = model.layers[0]
        res["cut_local_rows"] = [
            w.to_local().shape[0] for w in (block.fc1.weight, block.fc2.weight)
        ]
        res["cut_split"], _ = _train(model, cx[:, local], cy[:, local], STEPS)
        with _Count("all_reduce") as ar:
            precompute_scales(model)
        res["cut_precompute_all_reduces"] = ar.calls
        with _Count("all_reduce") as ar:
            model(cx[0, local]).sum().backward()
        res["cut_fwd_bwd_all_reduces"] = ar.calls
        res["cut_replicated"], _ = _train(cut_net(), cx, cy, STEPS)
        if rank == 0:
            ref = _net(BLOCK, dim=256, hidden=1024, n_blocks=1)
            res["cut_ref"], _ = _train(ref, cx, cy, STEPS, precompute=False, sharded=False)

    if rank == 0 and world in (2, 3):
        ref = _block_net(BLOCK, world)
        res["ref"], _ = _train(ref, xs, ys, STEPS, precompute=False, sharded=False)
    return res
