"""The gloo launcher (real processes, one per rank) and what the FSDP2 measurements and tests
share: the small models and data, the training loop, the collective counters. The measuring
modules' workers and the tests' own workers run through ``spawn``."""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import math
import multiprocessing
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from float8kit import (
    CastConfig,
    Float8LinearConfig,
    ScalingType,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit.distributed.fsdp import Float8AllGatherWeight
from float8kit.linear import Float8Linear

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
    """The one collective counter of the tests and measures: while active, patches the
    torch.distributed collectives ``names`` and counts their calls and bytes: the gathered
    output of an all-gather, the sent input of a reduce-scatter or all-to-all, the tensor of
    an all-reduce or broadcast. ``calls`` / ``bytes``: totals; ``by_name``: bytes per name;
    ``log``: the names called, in order; ``sizes``: each call's bytes, in that order. torch
    2.11 names FSDP2's collectives differently (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``): counted under the 2.13 names."""

    # name -> (keyword, position) of the tensor whose bytes are counted
    TENSOR = {
        "all_gather_single": ("output_tensor", 0),
        "all_gather_into_tensor": ("output_tensor", 0),
        "reduce_scatter_single": ("input", 1),
        "reduce_scatter_tensor": ("input", 1),
        "all_to_all_single": ("input", 1),
    }
    # torch 2.11's names (torch.distributed's, then the functional collectives')
    OLD_NAMES = {
        "all_gather_single": ("all_gather_into_tensor", "all_gather_tensor"),
        "reduce_scatter_single": ("reduce_scatter_tensor",),
    }

    def __init__(self, *names: str, module=dist):
        """``module``: where the collectives live (torch.distributed, or its functional
        collectives ``torch.distributed._functional_collectives`` that DTensor uses)."""
        self.names, self.module, self.calls, self.bytes, self.log = names, module, 0, 0, []
        self.sizes: list[int] = []
        self.by_name = dict.fromkeys(names, 0)

    def __enter__(self):
        self.orig = {}
        for name in self.names:
            real = next(n for n in (name, *self.OLD_NAMES.get(name, ())) if hasattr(self.module, n))
            self.orig[real] = getattr(self.module, real)
            setattr(self.module, real, self._counted(name, self.orig[real]))
        return self

    def _counted(self, name: str, fn):
        key, pos = self.TENSOR.get(name, (None, 0))

        def counted(*args, **kwargs):
            t = kwargs[key] if key in kwargs else args[pos] if len(args) > pos else None
            if t is None and kwargs:
                t = next(iter(kwargs.values()))
            size = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            self.calls += 1
            self.bytes += size
            self.by_name[name] += size
            self.log.append(name)
            self.sizes.append(size)
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for real, fn in self.orig.items():
            setattr(self.module, real, fn)


FP8_AG = Float8LinearConfig(enable_fsdp_float8_all_gather=True)


class _HostReads(TorchDispatchMode):
    """Records ops that read a value back to the host (a device sync on CUDA) or copy a
    host value to the device."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default)

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _types(tensors) -> list[str]:
    """``DTensor(Tensor)`` for a DTensor of plain local tensors, ``Tensor`` for a plain one."""
    return sorted(
        {
            f"{type(t).__name__}({type(t._local_tensor).__name__})"
            if hasattr(t, "_local_tensor")
            else type(t).__name__
            for t in tensors
            if t.dim() > 0  # AdamW's step counters are 0-d
        }
    )


def _fp8_weights(model):
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def _nonfinite_shard(fsdp_net, x: torch.Tensor, bad_rank: bool, prefix: str = "") -> dict:
    """inf / NaN in one rank's shard (``bad_rank``) of ``layers[0].fc1``: whether each rank's
    output is finite, with the hook's scale and with a precomputed one
    (``{prefix}finite_{bad}_{path}``); it must be non-finite everywhere."""
    res = {}
    for bad in (math.inf, math.nan):
        for path in ("hook", "precompute"):
            model = fsdp_net(reshard_after_forward=True)
            if bad_rank:
                with torch.no_grad():
                    model.layers[0].fc1.weight._local_tensor._tensor[0, 0] = bad
            if path == "precompute":
                precompute_scales(model)
            res[f"{prefix}finite_{bad}_{path}"] = bool(torch.isfinite(model(x)).all())
    return res


def _checkpoint_resume(fsdp_net, xs, ys, local: slice, tmp: str) -> dict:
    """DCP round trip: checkpoint ``fsdp_net()`` after STEPS steps and train STEPS more
    (``after``); a fresh model (``fsdp_net(seed=1)``, another init) loads the checkpoint and
    trains the same STEPS (``resumed``: must match bitwise). Also the state_dict's types, how
    far the fresh model started from the checkpoint and how far it is after the load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    res: dict = {}
    model = fsdp_net()
    _, opt = _train(model, xs[:STEPS, local], ys[:STEPS, local], STEPS)
    model_sd, optim_sd = get_state_dict(model, opt)
    res["state_dict_types"] = _types(model_sd.values())
    saved_full = {k: v.full_tensor() for k, v in model_sd.items()}
    ckpt = os.path.join(tmp, "ckpt")
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    res["after"], _ = _train_continue(model, opt, xs[STEPS:, local], ys[STEPS:, local])

    resumed = fsdp_net(seed=1)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=LR)
    model_sd2, optim_sd2 = get_state_dict(resumed, opt2)
    res["before_load_max_diff"] = max(
        (v.full_tensor() - saved_full[k]).abs().max().item() for k, v in model_sd2.items()
    )
    state = {"model": model_sd2, "optim": optim_sd2}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(resumed, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    res["loaded_max_diff"] = max(
        (v.full_tensor() - saved_full[k]).abs().max().item()
        for k, v in resumed.state_dict().items()
    )
    res["weights_still_subclass"] = all(
        isinstance(m.weight._local_tensor, Float8AllGatherWeight) for m in _fp8_weights(resumed)
    )
    precompute_scales(resumed)
    res["resumed"], _ = _train_continue(resumed, opt2, xs[STEPS:, local], ys[STEPS:, local])
    return res


def _train_continue(model, opt, xs, ys):
    losses = []
    for x, y in zip(xs, ys, strict=True):
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_scales(model)
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append((loss / dist.get_world_size()).item())
    return losses, opt


class _OneRank:
    def size(self):
        return 1


# ---------------------------------------------------------------------------- launcher


def _entry(rank: int, name, world: int, tmp: str, env: dict, path: list) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        # "module:function" names the worker (imported here, by name: a measuring module's
        # or a test module's; the caller's sys.path comes with spawn)
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
    real gloo processes; return every rank's result.

    The ranks fork from multiprocessing's forkserver, a clean process that imported torch
    and float8kit once for this process (they never ran a kernel: no thread pool to inherit)
    instead of each starting a fresh interpreter (~5 s of CPU to import them, a rank). Each
    rank takes the caller's environment and ``sys.path`` as they are at this call."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the server's torch at import
    try:
        multiprocessing.set_forkserver_preload(["torch", "float8kit", __name__])
        args = (name, world, str(tmp), dict(os.environ), list(sys.path))
        mp.start_processes(_entry, args, nprocs=world, join=True, start_method="forkserver")
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
