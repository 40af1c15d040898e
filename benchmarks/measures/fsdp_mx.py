"""FSDP2 float8 all-gather of MX (mxfp8) weights on gloo ranks: losses and gradients against
the hp all-gather (FSDP2 without float8 all-gather, same recipe), the gathered copies against
the one-device casts (along K in forward, along N in backward), bytes per collective and
per pass against the bf16 all-gather, ``reshard_after_forward=False`` (backward gathers its
copy itself) and activation checkpointing. Run through ``gloo.spawn``."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measures.gloo import _Count, _data, _train
from float8kit import Float8LinearConfig, GemmRole, MXGranularity, convert_to_float8_training
from float8kit import linear as f8linear
from float8kit.cast import cast_to_float8
from float8kit.tensor import local

MX = Float8LinearConfig.from_recipe_name("mxfp8")
MX_AG = dataclasses.replace(MX, enable_fsdp_float8_all_gather=True)
# the OCP spec's scale rounding ("floor") for every cast
FLOOR = dataclasses.replace(
    MX,
    **{
        f.name: dataclasses.replace(getattr(MX, f.name), scaling_granularity=MXGranularity("floor"))
        for f in dataclasses.fields(MX)
        if f.name.startswith("cast_config_")
    },
)
FLOOR_AG = dataclasses.replace(FLOOR, enable_fsdp_float8_all_gather=True)
STEPS = 3
# (in, out) of the three bias-free float8 linears; the weights' rows are FSDP2's shard dim.
# 608 rows: 304 + 304 on 2 ranks (block 9 cut), 203 + 203 + 202 on 3 (blocks 6 and 12 cut);
# 192 rows: 96 x 2, 64 x 3 (whole 32-row blocks); 32 rows: 16 + 16 (block 0 cut), 11 + 11 +
# 10 (block 0 cut twice).
LAYERS = ((128, 608), (608, 192), (192, 32))
# FSDP2's all-gather and the hook's (torch 2.11's all_gather_into_tensor is counted under
# 2.13's name), the hook's all-reduce of cut blocks' amaxes
COLLECTIVES = ("all_gather_single", "all_reduce")


def mx_net(
    config: Float8LinearConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    non_finite: bool = False,
    tiny: bool = False,
) -> nn.Sequential:
    """The three linears; ``dtype`` other than fp32: weights in that dtype, and one column
    of 17 rows (across the first cut block of the 608-row weight on 3 ranks) near the
    dtype's max (fp16: above fp8_max * 2 ** 7, whose block's byte-carrying value,
    fp8_max * 2 ** 8, fp16 cannot hold). ``non_finite``: a NaN and an inf in the first
    weight's block 6 (cut by 3 ranks), on either side of the cut. ``tiny``: every weight
    scaled to a largest magnitude of 1.5e-7 first (in fp16: 0 to 2 of its smallest
    subnormal, 2 ** -24, where a block's byte value fp8_max * 2 ** (byte - 127) is not
    representable)."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i, (k, n) in enumerate(LAYERS):
        mods += [nn.Linear(k, n, bias=False)] + ([nn.ReLU()] if i < len(LAYERS) - 1 else [])
    net = nn.Sequential(*mods)
    if tiny:
        with torch.no_grad():
            for m in mods[::2]:  # the Linears
                m.weight.mul_(1.5e-7 / m.weight.abs().max())
    net = net.to(dtype)
    if dtype != torch.float32 and not tiny:
        with torch.no_grad():
            net[0].weight[195:212, 3] = 0.9 * torch.finfo(dtype).max
    if non_finite:
        with torch.no_grad():
            net[0].weight[200, 5], net[0].weight[210, 7] = math.nan, math.inf
    return convert_to_float8_training(net, config=config, module_filter_fn=lambda m, f: True)


def linears(net: nn.Sequential) -> list[nn.Module]:
    return [m for m in net.modules() if isinstance(m, f8linear.Float8Linear)]


def _fsdp(config, mesh, ac=False, dtype=torch.float32, non_finite=False, tiny=False, **fsdp_kwargs):
    """``mx_net`` with each linear sharded by FSDP2 (``ac``: checkpoint-wrapped first,
    torchtitan's order: its forward is recomputed in backward, inside FSDP2's hooks)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    net = mx_net(config, dtype=dtype, non_finite=non_finite, tiny=tiny)
    for i, m in enumerate(net):
        if not isinstance(m, nn.ReLU):
            if ac:
                net[i] = m = checkpoint_wrapper(m)
            fully_shard(m, mesh=mesh, **fsdp_kwargs)
    fully_shard(net, mesh=mesh, **fsdp_kwargs)
    return net


def _spy_copies(net):
    """Record the weight each linear's output gemm receives (forward pre-hook: FSDP2's own
    pre-forward hook runs first) and the weight the grad_input gemm uses (by wrapping
    ``_weight_for_grad_input``): ``(forward, backward, undo)``."""
    fwd, bwd = [], []

    def snap(w):
        w = local(w)
        return (w._gran.short(), w._data.view(torch.uint8).clone(), w._scale.clone())

    hooks = [
        m.register_forward_pre_hook(lambda m, a: fwd.append(snap(m.weight))) for m in linears(net)
    ]
    real = f8linear._weight_for_grad_input

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        bwd.append(snap(out))
        return out

    f8linear._weight_for_grad_input = spy

    def undo():
        f8linear._weight_for_grad_input = real
        for h in hooks:
            h.remove()

    return fwd, bwd, undo


def _same_as_one_device(copies, dim, dtype=torch.float32, config=MX, non_finite=False, tiny=False):
    """Each copy (layer order) bitwise the one-device MX cast of the initial hp weight."""
    ref = linears(mx_net(config, dtype=dtype, non_finite=non_finite, tiny=tiny))
    cast = config.cast_config_weight if dim == -1 else config.cast_config_weight_for_grad_input
    out = []
    for (gran, data, scale), m in zip(copies, ref, strict=True):
        want = cast_to_float8(m.weight.detach(), cast, GemmRole.WEIGHT, dim, config)
        out.append(
            gran == want._gran.short()
            and torch.equal(data, want._data.view(torch.uint8))
            and torch.equal(scale, want._scale)
        )
    return out


def _worker_mx(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    batch = 4
    xs, ys = _data(STEPS, batch * world, LAYERS[0][0], LAYERS[-1][1])
    mine = slice(rank * batch, (rank + 1) * batch)
    res: dict = {"local_rows": [m.weight.to_local().shape[0] for m in linears(_fsdp(MX_AG, mesh))]}

    # Losses: float8 all-gather vs the hp all-gather, same shards, same local batches.
    res["losses_fp8"], _ = _train(_fsdp(MX_AG, mesh), xs[:, mine], ys[:, mine], STEPS)
    res["losses_hp"], _ = _train(_fsdp(MX, mesh), xs[:, mine], ys[:, mine], STEPS)

    # First step's gradients, and the copies each gemm received.
    grads = {}
    for name, config in (("fp8", MX_AG), ("hp", MX)):
        net = _fsdp(config, mesh)
        fwd, bwd, undo = _spy_copies(net) if name == "fp8" else ([], [], lambda: None)
        try:
            F.mse_loss(net(xs[0, mine]), ys[0, mine]).backward()
        finally:
            undo()
        grads[name] = [m.weight.grad.to_local() for m in linears(net)]
        if name == "fp8":
            res["forward_copies"] = [g for g, _, _ in fwd]
            res["backward_copies"] = [g for g, _, _ in reversed(bwd)]
            res["forward_bitwise"] = _same_as_one_device(fwd, -1)
            res["backward_bitwise"] = _same_as_one_device(list(reversed(bwd)), 0)
    # bf16 and fp16 weights (one block near the dtype's max), floor rounding: the copies
    # a NaN and an inf (both roundings): the copies, bitwise (NaN blocks included)
    for name, dtype, config, bad in (
        ("bfloat16", torch.bfloat16, MX_AG, False),
        ("float16", torch.float16, MX_AG, False),
        ("floor_bfloat16", torch.bfloat16, FLOOR_AG, False),
        ("non_finite", torch.float32, MX_AG, True),
        ("floor_non_finite", torch.float32, FLOOR_AG, True),
        ("float16_tiny", torch.float16, MX_AG, False),
        ("floor_float16_tiny", torch.float16, FLOOR_AG, False),
    ):
        tiny = name.endswith("tiny")
        net = _fsdp(config, mesh, dtype=dtype, non_finite=bad, tiny=tiny)
        fwd, bwd, undo = _spy_copies(net)
        try:
            net(xs[0, mine].to(dtype)).float().pow(2).mean().backward()
        finally:
            undo()
        ref = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        res[f"{name}_bitwise"] = _same_as_one_device(
            fwd, -1, dtype, ref, bad, tiny
        ) + _same_as_one_device(list(reversed(bwd)), 0, dtype, ref, bad, tiny)
        if bad:  # the gathered along-N copy of the NaN's block: NaN scale byte (255)
            res[f"{name}_nan_block"] = bwd[-1][2][6, 5].item()
    res["grads_bitwise"] = [
        torch.equal(a, b) for a, b in zip(grads["fp8"], grads["hp"], strict=True)
    ]

    # Bytes per collective and per pass, bf16 parameters: float8 (MX) vs the bf16 all-gather.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name, config in (("fp8", MX_AG), ("bf16", MX)):
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

    # reshard_after_forward=False: FSDP2 does not re-gather for backward; the grad_input
    # gemm gathers the along-N copy itself (fsdp_mx.gather_copy): the same bytes per pass.
    for name, config in (("fp8", MX_AG), ("bf16", MX)):
        net = _fsdp(config, mesh, mp_policy=mp, reshard_after_forward=False)
        with _Count(*COLLECTIVES) as fwd:
            out = net(xs[0, mine])
        with _Count(*COLLECTIVES) as bwd:
            out.float().pow(2).mean().backward()
        res[f"no_reshard_bytes_{name}"] = {"forward": fwd.bytes, "backward": bwd.bytes}
    res["no_reshard_losses_fp8"], _ = _train(
        _fsdp(MX_AG, mesh, reshard_after_forward=False), xs[:, mine], ys[:, mine], STEPS
    )
    # Activation checkpointing: the recomputed forward (after FSDP2's along-N re-gather)
    # gathers the along-K copy for its output gemm.
    for name, config in (("fp8", MX_AG), ("hp", MX)):
        net = _fsdp(config, mesh, ac=True)
        res[f"ac_losses_{name}"], _ = _train(net, xs[:, mine], ys[:, mine], STEPS)
    net = _fsdp(MX_AG, mesh, ac=True, mp_policy=mp)
    with _Count(*COLLECTIVES) as fwd:
        out = net(xs[0, mine])
    with _Count(*COLLECTIVES) as bwd:
        out.float().pow(2).mean().backward()
    res["ac_bytes_fp8"] = {"forward": fwd.bytes, "backward": bwd.bytes}
    return res
