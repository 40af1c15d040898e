"""float8kit.optim measured: state bytes per parameter, a fixed training task against fp32
AdamW, and FSDP2 on gloo ranks (the update's mesh invariance, DCP resharding, float8
all-gather). The tests assert on these; tools/measure.py publishes them."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from float8kit.optim import AdamW4bit, AdamW8bit

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}
LOW_BIT = ("adamw8bit", "adamw4bit")


def _inner_bytes(t: torch.Tensor) -> int:
    """Bytes ``t`` stores: a tensor subclass's inner tensors (a DTensor's local shard,
    torchao's codes and scales), recursively."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_inner_bytes(getattr(t, n)) for n in names)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt``'s state, inner tensors counted (this rank's)."""
    return sum(
        _inner_bytes(t)
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def torchao_optimizer(name: str):
    """torchao.optim's class of the same name (the peer)."""
    from torchao import optim

    return {"adamw8bit": optim.AdamW8bit, "adamw4bit": optim.AdamW4bit}[name]


def _optimizer(name: str, lib: str = "float8kit"):
    return torchao_optimizer(name) if lib == "torchao" else OPTIMIZERS[name]


def mlp_1m(seed: int = 0) -> nn.Sequential:
    """A 1M-parameter MLP (1,051,648 parameters: 512 -> 1024 -> 512, biases included)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))


def bytes_per_param(name: str, lib: str = "float8kit") -> float:
    """State bytes per parameter of optimizer ``name`` (``lib``'s) on ``mlp_1m`` after one
    step."""
    model = mlp_1m()
    opt = _optimizer(name, lib)(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    return state_bytes(opt) / sum(p.numel() for p in model.parameters())


def _mlp_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    """Step ``step``'s synthetic gradients of ``model``: rows of very different magnitudes,
    the same for every optimizer (so the updates compare directly), made on the parameters'
    device (a GPU's Llama-sized weights would wait seconds per step for the CPU's)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(10_000 + step)
    out = []
    for p in model.parameters():
        rows = torch.exp(torch.randn(p.shape[0], *[1] * (p.dim() - 1), generator=g, device=device))
        out.append(torch.randn(p.shape, generator=g, device=device) * rows * 1e-2)
    return out


def update_vs_fp32(
    name: str,
    lib: str = "float8kit",
    steps: int = 20,
    warmup: int = 3,
    model_fn=mlp_1m,
    device: str = "cpu",
) -> dict[str, float]:
    """``model_fn()`` (on ``device``) after ``steps`` steps of optimizer ``name`` (``lib``'s)
    on synthetic gradients: the SQNR (dB) of its total update against fp32 AdamW's (torch's
    default implementation on that device), and the median step time in ms over the steps
    after ``warmup`` (torchao compiles in its first), synchronized around each step."""
    import statistics
    import time

    from benchmarks.common import sync
    from benchmarks.measures.refs import sqnr

    dev = torch.device(device)

    def run(opt_cls):
        model = model_fn().to(dev)
        start = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
        opt = opt_cls(model.parameters(), lr=1e-3, weight_decay=0.01)
        times = []
        for step in range(steps):
            for p, g in zip(model.parameters(), _mlp_grads(model, step), strict=True):
                p.grad = g
            sync(dev)
            t0 = time.perf_counter()
            opt.step()
            sync(dev)
            times.append(time.perf_counter() - t0)
        end = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
        return end - start, 1000 * statistics.median(times[warmup:]), model, opt

    ref, ref_ms, _, _ = run(torch.optim.AdamW)
    update, ms, model, opt = run(_optimizer(name, lib))
    return {
        "update_sqnr_db": float(sqnr(ref, update)),
        "step_ms": ms,
        "adamw_step_ms": ref_ms,
        "bytes_per_param": state_bytes(opt) / sum(p.numel() for p in model.parameters()),
    }


def train_task(
    name: str, seed: int = 0, steps: int = 80, lr: float = 3e-3, lib: str = "float8kit"
) -> list[float]:
    """Losses of a student MLP (64 -> 256 -> 256 -> 16, GELU) fitting a fixed random teacher
    on fresh batches each step, trained by optimizer ``name`` (``lib``'s) with weight decay
    0.01."""
    torch.manual_seed(seed)
    student = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16)
    )
    teacher = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))
    opt = _optimizer(name, lib)(student.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000 + seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g)
        with torch.no_grad():
            y = teacher(x)
        loss = F.mse_loss(student(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def tail_mean(losses: list[float], n: int = 20) -> float:
    return sum(losses[-n:]) / n


# ---------------------------------------------------------------------------- FSDP2, gloo

# rows 1040 (347/347/346 on 3 ranks), 24 and 2 (1/1/0: an empty shard); a row of 1040
# elements ends in a partial block; the biases and the 48-element weight keep fp32 states
SHAPES = {"a": (1040, 40), "b": (24, 1040), "c": (2, 2048), "d": (2, 24)}
MESH_STEPS = 3


class _Params(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape) / math.sqrt(shape[1])))
            self.register_parameter(f"{name}_bias", nn.Parameter(torch.randn(shape[0]) / 10))


def global_grads(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s gradient of each parameter of ``_Params``: rows of very different
    magnitudes (a block's scale then matters), the same on every rank and mesh."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for name, shape in SHAPES.items():
        rows = torch.exp(2 * torch.randn(shape[0], 1, generator=g))
        out[name] = torch.randn(shape, generator=g) * rows
        out[f"{name}_bias"] = torch.randn(shape[0], generator=g)
    return out


def _step(model: nn.Module, opt, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    grads = global_grads(step)
    for name, p in model.named_parameters():
        g = grads[name]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for n, p in model.named_parameters()
    }


def _opt(name: str, model: nn.Module, lib: str = "float8kit"):
    return _optimizer(name, lib)(model.parameters(), lr=1e-2, weight_decay=0.1)


def one_device(name: str, steps: int = MESH_STEPS, lib: str = "float8kit") -> dict:
    """The parameters after ``steps`` steps of optimizer ``name`` (``lib``'s) on one device."""
    model = _Params(0)
    opt = _opt(name, model, lib)
    for step in range(steps):
        _step(model, opt, step)
    return _full(model)


def _sharded(world: int, seed: int = 0) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _Params(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model


def mesh_worker(rank: int, world: int, tmp: str) -> dict:
    """Each optimizer's parameters after MESH_STEPS steps on ``world`` FSDP2 ranks, and
    (world 2) the checkpoint after step 2 that ``resume_worker`` loads: saved in the folder
    beside ``tmp``, ``ckpt_<name>``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for name in OPTIMIZERS:
        model = _sharded(world)
        opt = _opt(name, model)
        for step in range(MESH_STEPS):
            if step == MESH_STEPS - 1:
                model_sd, optim_sd = get_state_dict(model, opt)
                ckpt = Path(tmp).parent / f"ckpt_{name}_{world}"
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt))
            _step(model, opt, step)
        out[name] = _full(model)
    return out


def resume_worker(rank: int, world: int, tmp: str) -> dict:
    """Each optimizer's parameters after loading the 2-rank checkpoint of ``mesh_worker``
    (saved before its last step) on ``world`` ranks and taking that last step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for name in OPTIMIZERS:
        model = _sharded(world, seed=1)  # another init: everything must come from the load
        opt = _opt(name, model)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(Path(tmp).parent / f"ckpt_{name}_2"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _step(model, opt, MESH_STEPS - 1)
        out[name] = _full(model)
    return out


def float8_worker(rank: int, world: int, tmp: str) -> dict:
    """Losses of the gloo measures' float8 Net (tensorwise, float8 all-gather,
    ``precompute_scales`` after each step) on ``world`` FSDP2 ranks, per optimizer."""
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.measures.gloo import FP8_AG, _data, _net, _shard, _train_continue

    xs, ys = _data(30, 16 * world, 64, 16)
    local = slice(16 * rank, 16 * (rank + 1))
    out = {}
    for name in OPTIMIZERS:
        model = _net(FP8_AG)
        _shard(model, init_device_mesh("cpu", (world,)), model.layers)
        opt = OPTIMIZERS[name](model.parameters(), lr=1e-3)
        out[name], _ = _train_continue(model, opt, xs[:, local], ys[:, local])
    return out


def torchao_mesh_worker(rank: int, world: int, tmp: str) -> dict:
    """torchao.optim's parameters after MESH_STEPS steps on ``world`` FSDP2 ranks (what
    ``mesh_worker`` checks of float8kit's), or the error a rank raised. Each rank compiles
    torchao's step into its own inductor cache: with one cache shared by the ranks, a rank
    of another shard length loads a kernel compiled for the first rank's local shape (the
    DTensor's global shape is the same) and fails its size assertion on uneven shards."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor{rank}")
    out = {}
    for name in LOW_BIT:
        model = _sharded(world)
        opt = _opt(name, model, "torchao")
        error = None
        try:
            for step in range(MESH_STEPS):
                _step(model, opt, step)
        except Exception as e:  # recorded: the comparison publishes what happened
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        errors = [None] * world
        dist.all_gather_object(errors, error)  # every rank learns of any rank's failure
        failed = next((e for e in errors if e), None)
        out[name] = failed if failed else _full(model)
    return out


def mesh_check(results: list[dict], name: str, ref: dict) -> dict:
    """Whether every rank's parameters in ``results`` (a mesh worker's) are ``ref``'s bit for
    bit, and the largest difference (or the error a rank raised)."""
    got = results[0][name]
    if isinstance(got, str):
        return {"bitwise": False, "max_abs_diff": None, "error": got}
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    equal = all(torch.equal(r[name][k], ref[k]) for r in results for k in ref)
    return {"bitwise": equal, "max_abs_diff": diff, "error": None}
