"""FSDP2 float8 all-gather of NVFP4 weights on gloo ranks (float8kit/distributed/
fsdp_nvfp4.py): losses and gradients against the hp all-gather (FSDP2 without float8
all-gather, same recipe, same random draws), the gathered weight against the one-device
cast in both passes (16x16 blocks cut by shard boundaries included), a NaN and an inf
visible alike, bytes per pass against the bf16 all-gather (packed codes on even shards,
one code per byte on uneven ones). Run through ``gloo.spawn``."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measures.fsdp_mx import _spy_copies, linears
from benchmarks.measures.gloo import _Count, _data, _train
from float8kit import convert_to_float8_training, nvfp4_config, precompute_scales
from float8kit.formats import nvfp4

NV = nvfp4_config()
NV_AG = dataclasses.replace(NV, enable_fsdp_float8_all_gather=True)
STEPS = 3
# (in, out) of the three bias-free linears; the weights' rows are FSDP2's shard dim. 608
# rows: 304 + 304 on 2 ranks (even: packed; whole 16-row blocks), 203 + 203 + 202 on 3
# (uneven: one code per byte; blocks 12 and 25 cut); 192 rows: 96 x 2, 64 x 3 (even,
# packed); 32 rows: 16 x 2, 11 + 11 + 10 (uneven; block 0 cut twice).
LAYERS = ((128, 608), (608, 192), (192, 32))
COLLECTIVES = ("all_gather_single", "all_reduce")


def nv_net(config, seed: int = 0, non_finite: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i, (k, n) in enumerate(LAYERS):
        mods += [nn.Linear(k, n, bias=False)] + ([nn.ReLU()] if i < len(LAYERS) - 1 else [])
    net = nn.Sequential(*mods)
    if non_finite:  # on either side of 3 ranks' first cut (rows 203 | 204) of the 608 rows
        with torch.no_grad():
            net[0].weight[200, 5], net[0].weight[206, 7] = math.nan, math.inf
    return convert_to_float8_training(net, config=config, module_filter_fn=lambda m, f: True)


def _fsdp(config, mesh, non_finite=False, **fsdp_kwargs):
    from torch.distributed.fsdp import fully_shard

    net = nv_net(config, non_finite=non_finite)
    for m in net:
        if not isinstance(m, nn.ReLU):
            fully_shard(m, mesh=mesh, **fsdp_kwargs)
    fully_shard(net, mesh=mesh, **fsdp_kwargs)
    return net


def _same_as_one_device(copies, non_finite=False) -> list[bool]:
    """Each copy (layer order) bitwise the one-device NVFP4 cast of the initial weight (NaN
    scales compared as NaN)."""
    ref = linears(nv_net(NV, non_finite=non_finite))
    out = []
    for (gran, codes, scale), m in zip(copies, ref, strict=True):
        want_codes, want_scale = nvfp4.quantize(m.weight.detach(), (16, 16))
        out.append(
            gran == "nvfp4(16x16)"
            and torch.equal(codes, want_codes)
            and torch.equal(scale.isnan(), want_scale.isnan())
            and torch.equal(scale.nan_to_num(), want_scale.nan_to_num())
        )
    return out


def _worker_nvfp4(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    batch = 4
    xs, ys = _data(STEPS, batch * world, LAYERS[0][0], LAYERS[-1][1])
    mine = slice(rank * batch, (rank + 1) * batch)
    res: dict = {"local_rows": [m.weight.to_local().shape[0] for m in linears(_fsdp(NV_AG, mesh))]}

    # Losses: NVFP4 all-gather vs the hp all-gather, same shards, batches and random draws
    # (stochastic rounding: torch's generator, seeded by nv_net alike for both).
    res["losses_fp4"], _ = _train(_fsdp(NV_AG, mesh), xs[:, mine], ys[:, mine], STEPS)
    res["losses_hp"], _ = _train(_fsdp(NV, mesh), xs[:, mine], ys[:, mine], STEPS)

    # First step's gradients, and the weight each gemm received.
    grads = {}
    for name, config in (("fp4", NV_AG), ("hp", NV)):
        net = _fsdp(config, mesh)
        fwd, bwd, undo = _spy_copies(net) if name == "fp4" else ([], [], lambda: None)
        try:
            F.mse_loss(net(xs[0, mine]), ys[0, mine]).backward()
        finally:
            undo()
        grads[name] = [m.weight.grad.to_local() for m in linears(net)]
        if name == "fp4":
            res["forward_bitwise"] = _same_as_one_device(fwd)
            res["backward_bitwise"] = _same_as_one_device(list(reversed(bwd)))
    res["grads_bitwise"] = [
        torch.equal(a, b) for a, b in zip(grads["fp4"], grads["hp"], strict=True)
    ]

    # A NaN and an inf in the first weight, on both sides of 3 ranks' first shard boundary.
    net = _fsdp(NV_AG, mesh, non_finite=True)
    fwd, bwd, undo = _spy_copies(net)
    try:
        out = net(xs[0, mine])
        out.float().pow(2).mean().backward()
    finally:
        undo()
    res["non_finite_bitwise"] = _same_as_one_device(fwd, True) + _same_as_one_device(
        list(reversed(bwd)), True
    )
    res["non_finite_output_nan"] = bool(out.isnan().all())

    # precompute_scales: the block amaxes join its one all-reduce after the optimizer step,
    # and the next step's hooks run no collective of their own.
    net = _fsdp(NV_AG, mesh)
    out = net(xs[0, mine])
    F.mse_loss(out, ys[0, mine]).backward()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    opt.step()
    with _Count("all_reduce") as pre:
        precompute_scales(net)
    with _Count(*COLLECTIVES) as step:
        net(xs[1, mine]).float().pow(2).mean().backward()
    res["precompute_all_reduce"] = {"calls": pre.calls, "bytes": pre.bytes}
    res["next_step_all_reduce_calls"] = step.log.count("all_reduce")

    # Bytes per pass, bf16 parameters: NVFP4 codes vs the bf16 all-gather.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name, config in (("fp4", NV_AG), ("bf16", NV)):
        net = _fsdp(config, mesh, mp_policy=mp, reshard_after_forward=True)
        with _Count(*COLLECTIVES) as fwd:
            out = net(xs[0, mine])
        with _Count(*COLLECTIVES) as bwd:
            out.float().pow(2).mean().backward()
        res[f"bytes_{name}"] = {"forward": dict(fwd.by_name), "backward": dict(bwd.by_name)}
        res[f"calls_{name}"] = {
            "forward": list(zip(fwd.log, fwd.sizes, strict=True)),
            "backward": list(zip(bwd.log, bwd.sizes, strict=True)),
        }
    return res
