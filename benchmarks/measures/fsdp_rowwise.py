"""FSDP2 float8 all-gather for the rowwise recipes (numbers/fsdp.json, "rowwise"): workers for 2
and 3 gloo ranks and compile, and the grad_input re-cast of the gathered weight."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from benchmarks.measures.gloo import (
    DELAYED_AG,
    FP8_AG,
    STEPS,
    Net,
    _checkpoint_resume,
    _Count,
    _data,
    _fp8_weights,
    _net,
    _nonfinite_shard,
    _shard,
    _train,
    _types,
    _uneven_net,
)
from benchmarks.measures.refs import sqnr
from float8kit import Float8LinearConfig, GemmRole, convert_to_float8_training, precompute_scales
from float8kit.cast import cast_to_float8
from float8kit.linear import Float8Linear, _weight_for_grad_input, plan_of
from float8kit.scaling import amax_to_scale

RECIPES = ("rowwise", "rowwise_with_gw_hp")


def _plain(recipe: str) -> Float8LinearConfig:
    return Float8LinearConfig.from_recipe_name(recipe)


def _ag(recipe: str) -> Float8LinearConfig:
    return dataclasses.replace(_plain(recipe), enable_fsdp_float8_all_gather=True)


def _grads(model, x, y) -> list[torch.Tensor]:
    """Full (unsharded) gradients of one forward+backward, in parameter order."""
    F.mse_loss(model(x).float(), y).backward()
    return [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for p in model.parameters()
    ]


# ---------------------------------------------------------------------------- workers


def _worker_rowwise(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: losses and gradients vs single device, bytes, one collective, scales."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    batch = 8
    xs, ys = _data(STEPS, batch * world, 64, 16)
    local = slice(rank * batch, (rank + 1) * batch)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    res: dict = {}

    for recipe in RECIPES:
        config = _ag(recipe)

        def fsdp_net(config=config, **fsdp_kwargs):
            model = _net(config)
            _shard(model, mesh, model.layers, **fsdp_kwargs)
            return model

        # fp32, reshard after forward (the backward re-gathers), batch split over the ranks.
        model = fsdp_net(reshard_after_forward=True)
        res[f"{recipe}_split"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
        # precomputed row scales vs the full weight's row amaxes
        sd = model.state_dict()
        scales, refs = [], []
        for name, mod in model.named_modules():
            if isinstance(mod, Float8Linear):
                full = sd[f"{name}.weight"].full_tensor()
                amax = full.abs().amax(dim=-1, keepdim=True)
                refs.append(amax_to_scale(amax, torch.float8_e4m3fn, True))
                scales.append(mod.fp8_state.all_gather_scale.scale)
        res[f"{recipe}_scales_bitwise"] = all(
            torch.equal(a, b) for a, b in zip(scales, refs, strict=True)
        )
        res[f"{recipe}_scale_shapes"] = [tuple(s.shape) for s in scales]
        with _Count("all_reduce") as ar:
            model(xs[0, local]).sum().backward()
        res[f"{recipe}_fwd_bwd_all_reduces_after_precompute"] = ar.calls
        res[f"{recipe}_grad_types"] = _types(p.grad for p in model.parameters())
        # Every rank on the global batch: only the sharding differs from one device.
        res[f"{recipe}_replicated"], _ = _train(fsdp_net(reshard_after_forward=True), xs, ys, STEPS)
        # Without precompute_scales: the hook all-reduces each weight's row amaxes itself.
        model = fsdp_net(reshard_after_forward=True)
        with _Count("all_reduce") as ar:
            model(xs[0, local])
        res[f"{recipe}_forward_all_reduces_without_precompute"] = ar.calls
        res[f"{recipe}_no_precompute"], _ = _train(
            fsdp_net(reshard_after_forward=True),
            xs[:, local],
            ys[:, local],
            STEPS,
            precompute=False,
        )
        # bf16 params, fp32 reduce, no reshard after forward: backward uses the forward's
        # gathered weight (no re-gather).
        model = fsdp_net(reshard_after_forward=False, mp_policy=mp_policy)
        res[f"{recipe}_bf16"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
        # Gradients of one step on the global batch vs the unsharded float8 model's.
        for reshard in (True, False):
            model = fsdp_net(reshard_after_forward=reshard)
            precompute_scales(model)
            res[f"{recipe}_grads_reshard_{reshard}"] = _grads(model, xs[0], ys[0])
        res[f"{recipe}_grads_ref"] = _grads(_net(_plain(recipe)), xs[0], ys[0])

        # Bytes in one forward+backward: all-gathers, and the scales' share of
        # precompute_scales' all-reduce; float8 vs a bf16 all-gather of the same recipe.
        for reshard in (True, False):
            for name, cfg in (("fp8", config), ("bf16", _plain(recipe))):
                model = _net(cfg)
                _shard(
                    model, mesh, model.layers, mp_policy=mp_policy, reshard_after_forward=reshard
                )
                with _Count("all_reduce") as ar:
                    precompute_scales(model)
                with _Count("all_gather_single") as ag:
                    model(xs[0, local]).sum().backward()
                key = f"{recipe}_reshard_{reshard}_{name}"
                res[f"{key}_all_gather_bytes"] = ag.bytes
                res[f"{key}_all_gather_calls"] = ag.calls
                res[f"{key}_precompute_bytes"] = ar.bytes

        # inf / NaN in one rank's shard: every rank's output is non-finite, on both paths.
        res.update(_nonfinite_shard(fsdp_net, xs[0, local], rank == world - 1, f"{recipe}_"))

    # A mix of recipes and policies in one model: still one collective in precompute_scales.
    torch.manual_seed(0)
    model = Net(n_blocks=4)
    for block, config in zip(
        model.layers, (_ag("rowwise"), _ag("rowwise_with_gw_hp"), FP8_AG, DELAYED_AG), strict=True
    ):
        convert_to_float8_training(block, config=config)
    _shard(model, mesh, model.layers, reshard_after_forward=True)
    res["mix"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
    with _Count("all_reduce") as ar:
        precompute_scales(model)
    res["mix_precompute_all_reduces"] = ar.calls
    with _Count("all_reduce") as ar:
        model(xs[0, local]).sum().backward()
    res["mix_fwd_bwd_all_reduces"] = ar.calls

    if rank == 0:
        for recipe in RECIPES:
            res[f"{recipe}_ref"], _ = _train(
                _net(_plain(recipe)), xs, ys, STEPS, precompute=False, sharded=False
            )
            res[f"{recipe}_ref_bf16"], _ = _train(
                _net(_plain(recipe)), xs, ys, STEPS, precompute=False, autocast=True, sharded=False
            )
    return res


def _worker_uneven_rowwise(rank: int, world: int, tmp: str) -> dict:
    """3 ranks, only float8 weights, 1040/16/2 rows (uneven and empty shards); DCP round
    trip and bitwise resume (rowwise)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    batch = 4
    xs, ys = _data(2 * STEPS, batch * world, 32, 2)
    local = slice(rank * batch, (rank + 1) * batch)
    res: dict = {}

    def fsdp_net(recipe, seed=0):
        model = _uneven_net(_ag(recipe), seed)
        _shard(model, mesh, [m for m in model if isinstance(m, torch.nn.Linear)])
        return model

    for recipe in RECIPES:
        model = fsdp_net(recipe)
        res["local_rows"] = [m.weight._local_tensor.shape[0] for m in _fp8_weights(model)]
        res[f"{recipe}_uneven"], _ = _train(model, xs[:STEPS, local], ys[:STEPS, local], STEPS)
        model = fsdp_net(recipe)
        res[f"{recipe}_uneven_replicated"], _ = _train(model, xs[:STEPS], ys[:STEPS], STEPS)
        model = fsdp_net(recipe)
        res[f"{recipe}_uneven_no_precompute"], _ = _train(
            model, xs[:STEPS, local], ys[:STEPS, local], STEPS, precompute=False
        )
        if rank == 0:
            res[f"{recipe}_ref"], _ = _train(
                _uneven_net(_plain(recipe)), xs[:STEPS], ys[:STEPS], STEPS, sharded=False
            )

    res.update(_checkpoint_resume(lambda seed=0: fsdp_net("rowwise", seed), xs, ys, local, tmp))
    return res


def _worker_compile_rowwise(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: ``torch.compile(checkpoint_wrapper(block), fullgraph=True)`` per FSDP2 block
    (torchtitan's order) vs single-device eager. The recomputed forward runs on the weight
    the backward re-gathered, and the compiled backward re-casts the saved gathered weight.
    Every rank trains on the global batch: only sharding and compilation differ."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    xs, ys = _data(STEPS, 16, 64, 16)
    res: dict = {}
    for recipe in RECIPES:
        model = _net(_ag(recipe))
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(checkpoint_wrapper(block), fullgraph=True)
        _shard(model, mesh, model.layers)
        try:
            res[f"ac_{recipe}"], _ = _train(model, xs, ys, STEPS)
        except RuntimeError as e:  # both ranks fail alike: report it, do not hang
            res[f"ac_{recipe}"] = repr(e)
        res[f"ac_ref_{recipe}"], _ = _train(_net(_plain(recipe)), xs, ys, STEPS, sharded=False)
    res["compiled_frames"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return res


def recast_sqnr(recipe: str, spread: bool, pow2: bool = True) -> float:
    """SQNR (dB) of the grad_input gemm's weight re-cast from the gathered row-scaled float8
    weight against the same cast of the hp weight: a (1040, 64) weight, its rows' ranges
    spread over 5 decades when ``spread``; ``pow2=False`` turns power-of-2 scales off."""
    config = dataclasses.replace(_plain(recipe), round_scales_to_power_of_2=pow2)
    hp = torch.randn(1040, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    if spread:
        hp = hp * torch.logspace(-4, 1, 1040)[:, None]
    gathered = cast_to_float8(hp, config.cast_config_weight, GemmRole.WEIGHT, -1, config)
    plan = plan_of(config)
    got = _weight_for_grad_input(gathered, plan, (None, None, False))
    ref = _weight_for_grad_input(hp, plan, (None, None, False))
    assert got._axiswise_dim == ref._axiswise_dim
    return sqnr(ref.dequantize(torch.float32), got.dequantize(torch.float32))
