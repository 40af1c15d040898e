"""What the FSDP2 tests share: the gloo launcher (real processes, one per rank), the small
models and data, the training loop, the collective counter. Not a test module: test modules
import it, never each other."""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from float8kit import (
    CastConfig,
    Float8LinearConfig,
    ScalingType,
    convert_to_float8_training,
    precompute_scales,
)

DELAYED = Float8LinearConfig.from_recipe_name("delayed")
DELAYED_AG = dataclasses.replace(DELAYED, enable_fsdp_float8_all_gather=True)
# Weights start within +-1/sqrt(64): 2048 fits amaxes up to 0.22.
STATIC_W = Float8LinearConfig(
    cast_config_weight=CastConfig(scaling_type=ScalingType.STATIC, static_scale=2048.0)
)
STATIC_AG = dataclasses.replace(STATIC_W, enable_fsdp_float8_all_gather=True)
STEPS = 4
LR = 1e-3


# ---------------------------------------------------------------------------- models, data


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    """Blocks of two float8 linears each and an hp head (``head`` is filtered out)."""

    def __init__(self, dim=64, hidden=128, n_blocks=2, out=16, bias=True):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden, bias) for _ in range(n_blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _net(config: Float8LinearConfig, seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    net = Net(**kwargs)
    return convert_to_float8_training(
        net, config=config, module_filter_fn=lambda mod, fqn: fqn != "head"
    )


def _uneven_net(config: Float8LinearConfig, seed: int = 0) -> nn.Sequential:
    """Only float8 weights, no biases: 1040 rows (347/347/346 on 3 ranks), 16 rows (6/6/4),
    2 rows (1/1/0: an empty shard)."""
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Linear(32, 1040, bias=False),
        nn.ReLU(),
        nn.Linear(1040, 16, bias=False),
        nn.ReLU(),
        nn.Linear(16, 2, bias=False),
    )
    return convert_to_float8_training(net, config=config, module_filter_fn=lambda m, f: True)


def _data(steps: int, batch: int, dim: int, out: int):
    g = torch.Generator().manual_seed(1234)
    return torch.randn(steps, batch, dim, generator=g), torch.randn(steps, batch, out, generator=g)


def _rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _bitwise(a: list[float], b: list[float]) -> bool:
    """Losses equal bit for bit (``torch.equal`` of the float64 values ``.item()`` gave)."""
    return torch.equal(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))


def _shard(model: nn.Module, mesh, blocks, **fsdp_kwargs) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)


def _train(model, xs, ys, steps, *, precompute=True, autocast=False, sharded=True):
    """Losses of ``steps`` AdamW steps; ``sharded``: the loss is averaged over ranks (equal
    local batches), i.e. the loss of the global batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(xs[step])
        loss = F.mse_loss(out.float(), ys[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_scales(model)
        loss = loss.detach()
        if sharded and dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses, opt


class _Count:
    """Counts calls (and bytes of the output tensor) of a torch.distributed collective."""

    def __init__(self, name: str):
        self.name, self.calls, self.bytes = name, 0, 0

    def __enter__(self):
        # torch 2.11's FSDP2 all-gathers through all_gather_into_tensor (no all_gather_single)
        if not hasattr(dist, self.name) and self.name == "all_gather_single":
            self.name = "all_gather_into_tensor"
        self.orig = getattr(dist, self.name)

        def counted(*args, **kwargs):
            self.calls += 1
            t = args[0] if args else next(iter(kwargs.values()))
            self.bytes += t.numel() * t.element_size()
            return self.orig(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(dist, self.name, self.orig)


# ---------------------------------------------------------------------------- launcher


def _entry(rank: int, name, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        # "module:function" names the worker (a test module's: imported here, by name)
        module, _, func = name.partition(":")
        worker = getattr(importlib.import_module(module), func)
        result = worker(rank, world, tmp)
        torch.save(result, f"{tmp}/rank{rank}.pt")
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """End a finished rank without interpreter teardown: on a loaded machine, destroying
    gloo's background threads at exit sometimes aborted the process ("terminate called
    without an active exception") after its result was written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(name: str, world: int, tmp: Path) -> list[dict]:
    """Run worker ``name`` (\"module:function\", ``fn(rank, world, tmp) -> result``) on ``world``
    real gloo processes; return every rank's result."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the children's torch at import
    try:
        mp.spawn(_entry, args=(name, world, str(tmp)), nprocs=world, join=True)
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
