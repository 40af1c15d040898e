"""FSDP2 with the float8 all-gather on gloo ranks (numbers/fsdp.json): tensorwise, delayed and
static weights vs one device, all-gather bytes and collectives, uneven shards, DCP resume,
compile and activation checkpointing. Run through ``gloo.spawn``."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.measures.gloo import (
    DELAYED,
    DELAYED_AG,
    FP8_AG,
    STATIC_W,
    STEPS,
    _checkpoint_resume,
    _Count,
    _data,
    _fp8_weights,
    _HostReads,
    _net,
    _nonfinite_shard,
    _shard,
    _train,
    _types,
    _uneven_net,
)
from float8kit import (
    Float8LinearConfig,
    precompute_scales,
)
from float8kit.linear import Float8Linear
from float8kit.scaling import amax_to_scale

# ---------------------------------------------------------------------------- workers


def _worker_train(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: losses vs single device, bytes, one collective, stale scales, inf/NaN."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    batch = 8
    xs, ys = _data(STEPS, batch * world, 64, 16)
    local = slice(rank * batch, (rank + 1) * batch)
    res: dict = {}

    def fsdp_net(**fsdp_kwargs):
        model = _net(FP8_AG)
        _shard(model, mesh, model.layers, **fsdp_kwargs)
        return model

    # fp32 weights, no mixed precision, reshard after forward; precompute_scales each step.
    # At the end: precompute_scales' collective count and scales.
    model = fsdp_net(reshard_after_forward=True)
    res["fp32"], opt = _train(model, xs[:, local], ys[:, local], STEPS)
    with _Count("all_reduce") as ar:
        precompute_scales(model)
    res["precompute_all_reduces"] = ar.calls
    sd = model.state_dict()
    res["state_dict_types"] = _types(sd.values())
    res["optim_state_types"] = _types(v for st in opt.state.values() for v in st.values())
    scales, refs = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, Float8Linear):
            full = sd[f"{name}.weight"].full_tensor()
            refs.append(amax_to_scale(full.abs().max(), torch.float8_e4m3fn).item())
            scales.append(mod.fp8_state.all_gather_scale.scale.item())
    res["precomputed_scales"], res["full_weight_scales"] = scales, refs
    with _Count("all_reduce") as ar:
        model(xs[0, local]).sum().backward()
    res["fwd_bwd_all_reduces_after_precompute"] = ar.calls
    res["grad_types"] = _types(p.grad for p in model.parameters())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    res["clipped_norm"] = (
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor().item()
    )
    with _HostReads() as hr:  # steady state: nothing read back, no index tensor uploaded
        precompute_scales(model)
        model(xs[1, local]).sum().backward()
    res["steady_host_reads"] = hr.reads
    res["optimizer_by_data_ptr"] = _optimizer_by_data_ptr(mesh, xs[0, local], ys[0, local])

    # Same, never calling precompute_scales: the hook's own all-reduce (one per weight).
    model = fsdp_net(reshard_after_forward=True)
    with _Count("all_reduce") as ar:
        model(xs[0, local])
    res["forward_all_reduces_without_precompute"] = ar.calls
    model = fsdp_net(reshard_after_forward=True)
    res["fp32_no_precompute"], _ = _train(
        model, xs[:, local], ys[:, local], STEPS, precompute=False
    )
    # Every rank on the whole global batch: only the sharding differs from one device.
    model = fsdp_net(reshard_after_forward=True)
    res["fp32_replicated_data"], _ = _train(model, xs, ys, STEPS)

    # bf16 params, fp32 reduce, fp32 master weights, no reshard after forward.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp_net(reshard_after_forward=False, mp_policy=mp_policy)
    res["bf16"], _ = _train(model, xs[:, local], ys[:, local], STEPS)

    # Bytes all-gathered in one forward + backward: float8 vs bf16 all-gather.
    for name, config in (("fp8", FP8_AG), ("bf16", Float8LinearConfig())):
        model = _net(config)
        _shard(model, mesh, model.layers, mp_policy=mp_policy, reshard_after_forward=True)
        with _Count("all_gather_single") as ag:
            model(xs[0, local]).sum().backward()
        res[f"all_gather_bytes_{name}"] = ag.bytes
        res[f"all_gather_calls_{name}"] = ag.calls

    # A stale precomputed scale: optimizer.step() then forward without precompute_scales.
    model = fsdp_net(reshard_after_forward=True)
    _, opt = _train(model, xs[:1, local], ys[:1, local], 1)  # precomputes after its step
    model(xs[1, local]).sum().backward()
    opt.step()  # weights change; no precompute_scales
    with warnings.catch_warnings(record=True) as caught, _Count("all_reduce") as ar:
        warnings.simplefilter("always")
        stale_out = model(xs[2, local])
    res["stale_warned"] = any("precompute_scales" in str(w.message) for w in caught)
    res["stale_forward_all_reduces"] = ar.calls
    precompute_scales(model)
    fresh_out = model(xs[2, local])
    res["stale_vs_fresh_max_abs_diff"] = (stale_out - fresh_out).abs().max().item()

    # An update through .data keeps the parameter's version, so the hook uses the stale
    # precomputed scale (no rank can tell the others without a collective); the next
    # precompute_scales compares the shard amax the hook saw with the one the scale was made
    # from and warns, naming the layer. A normal step warns nothing.
    model = fsdp_net(reshard_after_forward=True)
    _train(model, xs[:1, local], ys[:1, local], 1)  # precomputes after its step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(xs[1, local]).sum().backward()
        precompute_scales(model)

        def ours() -> list[str]:  # only float8kit's warnings: torch may warn about itself
            return [str(w.message) for w in caught if "float8kit" in str(w.message)]

        res["data_update_normal_step_warnings"] = ours()
        with torch.no_grad():
            model.layers[1].fc2.weight.data.mul_(8.0)  # an EMA-like update: no version bump
        caught.clear()
        stale_out = model(xs[2, local])
        res["data_update_hook_warnings"] = ours()
        precompute_scales(model)
        res["data_update_precompute_warnings"] = ours()
    fresh_out = model(xs[2, local])
    res["data_update_stale_vs_fresh_rel_diff"] = (
        (stale_out - fresh_out).norm() / fresh_out.norm()
    ).item()

    res.update(_nonfinite_shard(fsdp_net, xs[0, local], rank == world - 1))

    # DELAYED and STATIC weights with float8 all-gather. References: the same config without
    # FSDP, run on every rank on the global batch (precompute_scales' all-reduce then sees
    # equal amaxes on both ranks, so it is the single-device computation).
    for name, config in (("delayed", DELAYED), ("static", STATIC_W)):
        ag_config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        model = _net(ag_config)
        _shard(model, mesh, model.layers, reshard_after_forward=True)
        res[f"{name}_split"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
        with _Count("all_reduce") as ar:
            precompute_scales(model)
        res[f"{name}_precompute_all_reduces"] = ar.calls
        with _HostReads() as hr:
            with _Count("all_reduce") as ar:
                model(xs[0, local]).sum().backward()
            precompute_scales(model)
        res[f"{name}_fwd_bwd_all_reduces"] = ar.calls
        res[f"{name}_steady_host_reads"] = hr.reads
        model = _net(ag_config)
        _shard(model, mesh, model.layers, reshard_after_forward=True)
        res[f"{name}_replicated_data"], _ = _train(model, xs, ys, STEPS)
        res[f"{name}_ref"], _ = _train(_net(config), xs, ys, STEPS, sharded=False)

    if rank == 0:
        # Single-device float8 references on the global batch.
        ref = _net(Float8LinearConfig())
        res["ref_fp32"], _ = _train(ref, xs, ys, STEPS, precompute=False, sharded=False)
        ref = _net(Float8LinearConfig())
        res["ref_bf16"], _ = _train(
            ref, xs, ys, STEPS, precompute=False, autocast=True, sharded=False
        )
    return res


def _worker_uneven(rank: int, world: int, tmp: str) -> dict:
    """3 ranks, only float8 weights, uneven and empty shards; DCP round trip and resume."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    batch = 4
    xs, ys = _data(2 * STEPS, batch * world, 32, 2)
    local = slice(rank * batch, (rank + 1) * batch)
    res: dict = {}

    def fsdp_net(seed=0):
        model = _uneven_net(FP8_AG, seed)
        _shard(model, mesh, [m for m in model if isinstance(m, nn.Linear)])
        return model

    model = fsdp_net()
    res["local_rows"] = [m.weight._local_tensor.shape[0] for m in _fp8_weights(model)]
    res["uneven"], _ = _train(model, xs[:STEPS, local], ys[:STEPS, local], STEPS)
    # Every rank on the whole global batch: only the sharding differs from one device.
    model = fsdp_net()
    res["uneven_replicated_data"], _ = _train(model, xs[:STEPS], ys[:STEPS], STEPS)
    model = fsdp_net()
    res["uneven_no_precompute"], _ = _train(
        model, xs[:STEPS, local], ys[:STEPS, local], STEPS, precompute=False
    )

    res.update(_checkpoint_resume(fsdp_net, xs, ys, local, tmp))

    if rank == 0:
        ref = _uneven_net(Float8LinearConfig())
        res["ref"], _ = _train(ref, xs[:STEPS], ys[:STEPS], STEPS, precompute=False, sharded=False)
    return res


def _worker_compile(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: torch.compile of each FSDP2 block vs eager; compile + activation checkpointing
    (torchtitan's setup) vs single-device eager."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    batch = 8
    xs, ys = _data(STEPS, batch * world, 64, 16)
    local = slice(rank * batch, (rank + 1) * batch)
    res: dict = {}
    for mode in ("eager", "compiled"):
        model = _net(FP8_AG)
        if mode == "compiled":
            for i, block in enumerate(model.layers):
                model.layers[i] = torch.compile(block, fullgraph=True)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        res[mode], _ = _train(model, xs[:, local], ys[:, local], STEPS)
    res["compiled_frames"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    res["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())

    # Activation checkpointing re-gathers each weight in backward while compiled graphs hold
    # the forward's weight (and its scale) as saved tensors. Per-block: compile of the
    # checkpoint-wrapped block (torchtitan's order); whole: the model compiled around
    # checkpointed, sharded blocks (graph breaks at FSDP2's hooks). Every rank trains on the
    # global batch, so the only differences from one device are sharding and compilation.
    for name, config in (("tensorwise", FP8_AG), ("delayed", DELAYED_AG)):
        for setup in ("block", "whole"):
            model = _net(config)
            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block)
                if setup == "block":
                    model.layers[i] = torch.compile(model.layers[i], fullgraph=True)
            _shard(model, mesh, model.layers)
            if setup == "whole":
                model = torch.compile(model)
            try:
                res[f"ac_{setup}_{name}"], _ = _train(model, xs, ys, STEPS)
            except RuntimeError as e:  # both ranks fail alike: report it, do not hang
                res[f"ac_{setup}_{name}"] = repr(e)
        # on every rank, so that the delayed reference's precompute_scales sees equal amaxes
        ref_config = dataclasses.replace(config, enable_fsdp_float8_all_gather=False)
        res[f"ac_ref_{name}"], _ = _train(_net(ref_config), xs, ys, STEPS, sharded=False)
    return res


def _optimizer_by_data_ptr(mesh, x: torch.Tensor, y: torch.Tensor) -> dict:
    """A trainer's pattern (accelerate's FSDP2 preparation): the optimizer is built on the
    unsharded parameters, then each one is swapped for its sharded replacement, matched by
    ``data_ptr()``. One SGD step must then move every parameter."""
    model = _net(FP8_AG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    _shard(model, mesh, model.layers)
    by_ptr = {before[name]: p for name, p in model.named_parameters()}
    for group in opt.param_groups:
        group["params"] = [by_ptr[p.data_ptr()] for p in group["params"]]
    start = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    F.mse_loss(model(x), y).backward()
    opt.step()
    held = [id(p) for group in opt.param_groups for p in group["params"]]
    moved = {n: not torch.equal(p.full_tensor(), start[n]) for n, p in model.named_parameters()}
    return {
        "params": len(before),
        "distinct_nonzero_ptrs": len({ptr for ptr in before.values() if ptr != 0}),
        "held": len(held),
        "held_distinct": len(set(held)),
        "unchanged": [n for n, m in moved.items() if not m],
    }
