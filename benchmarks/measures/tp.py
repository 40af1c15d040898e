"""Tensor and sequence parallel, and FSDP2 x TP, on gloo ranks (numbers/tp.json): the workers
for 2 ranks (TP, SP, compiled) and 4 ranks (a 2-D mesh with DCP resume)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import float8kit
from benchmarks.measures.gloo import _Count
from float8kit import Float8LinearConfig, convert_to_float8_training, precompute_scales

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise")
STEPS = 4
LR = 1e-3
DIM, HIDDEN, BATCH, SEQ = 64, 128, 2, 8
LLAMA_STEPS, LLAMA_SEQ = 3, 16  # the sequence splits evenly over the TP ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))


class MLP(nn.Module):
    """SwiGLU MLP: w1 and w3 colwise, w2 rowwise (Llama's feed-forward)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _mlp(recipe: str) -> MLP:
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(MLP(), config=config, module_filter_fn=lambda m, f: True)


def _data(steps: int = STEPS):
    g = torch.Generator().manual_seed(1234)
    shape = (steps, BATCH, SEQ, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _train(model, xs, ys, *, seq_shard: slice | None = None, world: int = 1) -> list[float]:
    """Losses of AdamW steps. ``seq_shard``: this rank's sequence slice (sequence parallel:
    the model takes and returns local sequence shards); the loss is the global batch's."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        if seq_shard is not None:
            x, y = x[:, seq_shard], y[:, seq_shard]
        loss = F.mse_loss(model(x).float(), y)
        if seq_shard is not None:
            loss = loss / world  # the global mean is the sum over ranks of these
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_scales(model)
        loss = loss.detach()
        if seq_shard is not None:
            dist.all_reduce(loss)
        losses.append(loss.item())
    return losses


def _sp_plan(styles) -> dict:
    colwise, rowwise, prepare = styles
    from torch.distributed.tensor import Replicate, Shard

    return {
        "": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "w1": colwise(),
        "w3": colwise(),
        "w2": rowwise(output_layouts=Shard(1)),
    }


# ---------------------------------------------------------------------------- workers


def _worker_tp2(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: torch's styles on every recipe (plain TP), float8 sequence parallel (losses,
    bytes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    xs, ys = _data()
    res: dict = {}
    torch_styles = (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    fp8_styles = (
        float8kit.Float8ColwiseParallel,
        float8kit.Float8RowwiseParallel,
        float8kit.PrepareFloat8ModuleInput,
    )
    seq = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    for recipe in RECIPES:
        res[f"ref_{recipe}"] = _train(_mlp(recipe), xs, ys)
        # plain TP: torch's styles, replicated input and output
        model = _mlp(recipe)
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(model, mesh, plan)
        res[f"tp_{recipe}"] = _train(model, xs, ys)
    for recipe in ("tensorwise", "rowwise"):
        for name, styles in (("torch_sp", torch_styles), ("fp8_sp", fp8_styles)):
            model = parallelize_module(_mlp(recipe), mesh, _sp_plan(styles))
            res[f"{name}_{recipe}"] = _train(model, xs, ys, seq_shard=seq, world=world)
            # bytes of one bf16 step
            model = parallelize_module(_mlp(recipe).bfloat16(), mesh, _sp_plan(styles))
            # every DTensor and float8kit all-gather is a functional all_gather_single
            with _Count("all_gather_single", module=funcol) as forward:
                out = model(xs[0][:, seq].bfloat16())
            with _Count("all_gather_single", module=funcol) as backward:
                out.float().pow(2).mean().backward()
            res[f"bytes_{name}_{recipe}"] = {"forward": forward.bytes, "backward": backward.bytes}
    # sequence parallel without PrepareFloat8ModuleInput: w1 and w3 each gather the input
    from torch.distributed.tensor import Shard

    plan = {
        "w1": fp8_styles[0](input_layouts=Shard(1)),
        "w3": fp8_styles[0](input_layouts=Shard(1)),
        "w2": fp8_styles[1](output_layouts=Shard(1)),
    }
    model = parallelize_module(_mlp("tensorwise"), mesh, plan)
    res["fp8_sp_colwise_input"] = _train(model, xs, ys, seq_shard=seq, world=world)
    # torch.compile of the sequence-parallel float8 MLP (the unit a per-block compile sees);
    # one recipe: a compile costs ~30 s per rank on 2 cores
    for recipe in ("tensorwise",):
        torch._dynamo.reset()
        model = parallelize_module(_mlp(recipe), mesh, _sp_plan(fp8_styles))
        model = torch.compile(model, fullgraph=True)
        res[f"compiled_fp8_sp_{recipe}"] = _train(model, xs, ys, seq_shard=seq, world=world)
    res |= _compiled_llama_tp(mesh)
    return res


def _compiled_llama_tp(mesh) -> dict:
    """The recipes' tiny Llama with float8kit's sequence-parallel styles under bf16 autocast,
    eager and with each block compiled (as ``train.py --compile --tp``): losses, and the
    graph breaks and compiled frames dynamo counted. Without fullgraph, so that a break is
    counted rather than raised. One block: a compile costs about a minute per rank on 2
    shared cores."""
    from model import tp_plan
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from torch.distributed.tensor.parallel import parallelize_module

    tokens = _tokens(LLAMA_STEPS, 2)
    res = {}
    for recipe in ("tensorwise", "rowwise"):
        for compiled in (False, True):
            torch._dynamo.reset()
            counters.clear()
            model = _llama(recipe, n_layers=1)
            parallelize_module(model, mesh, tp_plan(model, float8=True))
            backend = CompileCounterWithBackend("inductor")
            if compiled:
                for block in model.layers:
                    block.compile(backend=backend)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses, _ = _train_llama(model, tokens)
            key = f"{'compiled' if compiled else 'eager'}_llama_{recipe}"
            res[key] = losses
            if compiled:
                res[f"graph_breaks_{recipe}"] = sum(counters["graph_break"].values())
                res[f"frames_{recipe}"] = backend.frame_count
    return res


def _llama(recipe: str, fp8_all_gather: bool = False, seed: int = 0, n_layers: int = 0):
    """The recipes' tiny Llama converted to float8 (the lm head kept in hp); ``n_layers``:
    fewer blocks than the preset's."""
    import dataclasses

    from model import ModelArgs, Transformer

    torch.manual_seed(seed)
    args = ModelArgs.from_name("tiny")
    if n_layers:
        args = dataclasses.replace(args, n_layers=n_layers)
    model = Transformer(args)
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: fqn != "output"
    )


def _tokens(steps: int, batch: int):
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 256, (steps, batch, LLAMA_SEQ + 1), generator=g)


def _train_llama(model, tokens, opt=None, group=None):
    """Losses of AdamW steps on ``tokens`` (steps, batch, seq + 1), averaged over ``group``
    (the data-parallel ranks); returns (losses, optimizer)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for idx in tokens:
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_scales(model)
        loss = loss.detach()
        if group is not None:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        losses.append(loss.item())
    return losses, opt


def _worker_2d(rank: int, world: int, tmp: str) -> dict:
    """4 ranks, FSDP2 (2) x TP (2) on the recipes' Llama with float8kit's sequence-parallel
    styles: losses vs one process, float8 all-gather in FSDP2, DCP round trip."""
    import torch.distributed.checkpoint as dcp
    from model import tp_plan
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from float8kit.distributed.fsdp import Float8AllGatherWeight

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    batch = 2
    tokens = _tokens(2 * LLAMA_STEPS, batch * dp.size())
    local = tokens[:, dp.get_local_rank() * batch : (dp.get_local_rank() + 1) * batch]
    first, second = local[:LLAMA_STEPS], local[LLAMA_STEPS:]
    res: dict = {}

    def parallel_llama(recipe: str, seed: int = 0):
        fp8_all_gather = recipe in ("tensorwise", "delayed")  # tensorwise weights only
        model = _llama(recipe, fp8_all_gather, seed)
        parallelize_module(model, mesh["tp"], tp_plan(model, float8=True))
        for block in model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
        return model

    for recipe in ("tensorwise", "rowwise"):
        model = parallel_llama(recipe)
        res[f"fp8_all_gather_{recipe}"] = all(
            isinstance(m.weight._local_tensor, Float8AllGatherWeight)
            for m in model.modules()
            if isinstance(m, float8kit.Float8Linear)
        )
        res[f"2d_{recipe}"], opt = _train_llama(model, first, group=dp.get_group())
        if recipe != "tensorwise":
            continue
        # DCP: checkpoint, train on; a fresh model (other init) loads and trains the same steps
        model_sd, optim_sd = get_state_dict(model, opt)
        ckpt = os.path.join(tmp, "ckpt")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
        res["after"], _ = _train_llama(model, second, opt, group=dp.get_group())
        resumed = parallel_llama(recipe, seed=1)
        opt2 = torch.optim.AdamW(resumed.parameters(), lr=LR)
        model_sd2, optim_sd2 = get_state_dict(resumed, opt2)
        res["before_load_differs"] = any(
            not torch.equal(v.full_tensor(), model_sd[k].full_tensor())
            for k, v in model_sd2.items()
        )
        state = {"model": model_sd2, "optim": optim_sd2}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(
            resumed, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        precompute_scales(resumed)
        res["resumed"], _ = _train_llama(resumed, second, opt2, group=dp.get_group())
    if rank == 0:
        for recipe in ("tensorwise", "rowwise"):
            res[f"ref_{recipe}"], _ = _train_llama(_llama(recipe), tokens[:LLAMA_STEPS])
    return res
