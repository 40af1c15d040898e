"""Golden hashes: sha256 of float8kit's numbers (outputs, gradients, state_dicts, reports)
on fixed seeds and small shapes, to prove that a refactor changes no bits.

Usage (from the repository root; CPU, ~5 min on 2 cores):

    python tools/golden.py --record tools/golden_hashes.json   # before the refactor
    python tools/golden.py --check tools/golden_hashes.json    # after it: exit 1 on any change
    python tools/golden.py --check tools/golden_hashes.json --only fsdp/   # a subset

Only torch and float8kit's public API (``float8kit.__all__``) are used, so the script runs
unchanged before and after internal modules move. Cases (every key starts with its case):

- ``recipe/<name>/<dtype>/<eager|compiled>``: each named recipe and STATIC scaling (via
  ``calibrate``), fp32 and bf16, 3 AdamW steps with ``precompute_scales``: loss, output,
  input grad, every parameter grad, the final ``state_dict`` and an eval forward. Compiled:
  one dtype per recipe (fp32 for ``delayed``: torch 2.13 miscompiles its bf16 backward).
- ``fsdp/...``: FSDP2 float8 all-gather on 2 gloo ranks (even, uneven and empty shards,
  blocks cut by shards, bf16 mixed precision, MoE experts); ``tp/...``: Float8Colwise /
  Float8RowwiseParallel (plain and sequence parallel); ``qgz/...``: float8 gradient
  reduce-scatter. Losses, rank 0's outputs, full (gathered) gradients and state_dicts.
- ``experts/...``: float8 grouped gemms (an expert without tokens, a batch without tokens).
- ``monitor/...``: Float8Monitor reports (SQNR, saturation, scales) and its hp fallback.

A tensor's hash covers its dtype, shape and raw bytes; a DTensor is gathered first
(``full_tensor``), a ``Float8TrainingTensor`` is dequantized. Hashes depend on the CPU (its
kernels round differently: Intel and AMD CPUs of one capability too) and the torch version:
``--check`` on another machine than the recording's reports the difference in ``env``.

Recordings, one per kind of machine the project has run on (tests/test_golden.py picks the
one whose ``env`` matches):

- ``tools/golden_hashes.json``: AMD EPYC, before 0.4's restructuring (its ``env`` predates
  ``cpu_vendor``: AuthenticAMD).
- ``tools/golden_hashes_intel.json``: Intel Xeon (AVX512-BF16, AMX), recorded from a99e938,
  before 0.5's formats (HEAD of that day, whose library this recording ran).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in spawned ranks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import float8kit  # noqa: E402
from float8kit import (  # noqa: E402
    E5M2,
    BlockwiseGranularity,
    CastConfig,
    Float8ColwiseParallel,
    Float8ExpertsConfig,
    Float8Linear,
    Float8LinearConfig,
    Float8Monitor,
    Float8ReduceScatterConfig,
    Float8RowwiseParallel,
    Float8TrainingTensor,
    PrepareFloat8ModuleInput,
    ScalingType,
    calibrate,
    checkpoint_policy,
    convert_experts_to_float8_training,
    convert_to_float8_training,
    enable_float8_reduce_scatter,
    precompute_scales,
    recompute_norms,
    strip_float8_state,
)

torch.set_num_threads(1)
# inductor's advice to torch subclasses (Float8ExpertWeight) about its cache, once per run
warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching")

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEPS = 3
LR = 1e-2
WORLD = 2
STATIC = Float8LinearConfig(
    cast_config_input=CastConfig(scaling_type=ScalingType.STATIC),
    cast_config_weight=CastConfig(scaling_type=ScalingType.STATIC),
    cast_config_grad_output=CastConfig(scaling_type=ScalingType.STATIC, static_scale=2.0**16),
)


# ---------------------------------------------------------------------------- hashing


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor of ``t``'s values (a DTensor gathered: a collective on every rank)."""
    from torch.distributed.tensor import DTensor

    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, Float8TrainingTensor):
        t = t.dequantize()
    if type(t) is not torch.Tensor and callable(getattr(t, "wait", None)):
        t = t.wait()  # a functional collective's AsyncCollectiveTensor (tensor parallel)
    if type(t) not in (torch.Tensor, nn.Parameter):
        raise TypeError(f"golden: cannot hash a {type(t).__name__}; hash a plain tensor")
    return t.cpu().contiguous()


def tensor_hash(t: torch.Tensor) -> str:
    t = _plain(t)
    head = f"{t.dtype}|{tuple(t.shape)}|".encode()
    return hashlib.sha256(head + t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _jsonable(obj):
    if isinstance(obj, torch.Tensor):
        return {"dtype": str(obj.dtype), "values": _plain(obj).double().tolist()}
    raise TypeError(f"golden: cannot hash a {type(obj).__name__}")


def json_hash(obj) -> str:
    """Floats as Python's exact shortest repr (inf as Infinity), keys sorted."""
    text = json.dumps(obj, sort_keys=True, default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()


class Recorder:
    """Collects ``{case/key: sha256}``. Under torch.distributed every rank calls it alike
    (gathering a DTensor is a collective); rank 0 keeps the hashes."""

    def __init__(self, case: str, out: dict[str, str]):
        self.case, self.out = case, out
        self.keep = not dist.is_initialized() or dist.get_rank() == 0

    def __call__(self, key: str, t: torch.Tensor) -> None:
        digest = tensor_hash(t)
        if self.keep:
            self.out[f"{self.case}/{key}"] = digest

    def local(self, key: str, t: torch.Tensor) -> None:
        """Rank 0's local tensor (no collective)."""
        if self.keep:
            self.out[f"{self.case}/{key}"] = tensor_hash(t)

    def json(self, key: str, obj) -> None:
        if self.keep:
            self.out[f"{self.case}/{key}"] = json_hash(obj)

    def state_dict(self, model: nn.Module, prefix: str = "state") -> None:
        for name, value in model.state_dict().items():
            self(f"{prefix}/{name}", value)

    def grads(self, model: nn.Module, prefix: str) -> None:
        for name, p in model.named_parameters():
            if p.grad is not None:
                self(f"{prefix}/{name}", p.grad)


# ---------------------------------------------------------------------------- models, data


class MLP(nn.Module):
    """fc1, fc2 (float8 under the default filter) with a residual, and a 10-wide head that
    the default filter keeps in hp."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(x + self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.relu(self.fc1(x)))


class Net(nn.Module):
    """Blocks of two float8 linears each and an hp head (FSDP2 shards every block)."""

    def __init__(self, dim: int = 64, hidden: int = 128, n_blocks: int = 2, out: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class SwiGLU(nn.Module):
    """Llama's feed-forward: w1, w3 colwise, w2 rowwise under tensor parallel."""

    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """Two grouped gemms with SiLU between, (experts, in, out) weights, tokens sorted by
    expert: ``torch._grouped_mm`` first, ``F.grouped_mm`` second."""

    def __init__(self, n_experts: int = 4, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)

    def forward(self, x, offs):
        h = F.silu(torch._grouped_mm(x, self.w1, offs=offs))
        return F.grouped_mm(h, self.w2, offs=offs)


def _data(*shape_x: int, out: int, steps: int = STEPS, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, *shape_x, generator=g)
    return xs, torch.randn(steps, *shape_x[:-1], out, generator=g)


def _config(recipe: str, **changes) -> Float8LinearConfig:
    import dataclasses

    if recipe == "static":
        config = STATIC
    elif recipe == "static_weight":  # a fixed weight scale: weights start within +-1/8
        config = Float8LinearConfig(
            cast_config_weight=CastConfig(scaling_type=ScalingType.STATIC, static_scale=2048.0)
        )
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, **changes) if changes else config


def _converted(model: nn.Module) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


# ---------------------------------------------------------------------------- one device


def _train_steps(rec: Recorder, model: nn.Module, run: nn.Module, xs, ys, dtype) -> None:
    """``STEPS`` AdamW steps of ``run`` (``model`` or its compiled self), each hashed."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(len(xs)):
        x = xs[step].to(dtype).clone().requires_grad_()
        out = run(x)
        loss = F.mse_loss(out.float(), ys[step])
        loss.backward()
        rec(f"step{step}/loss", loss)
        rec(f"step{step}/output", out)
        rec(f"step{step}/grad_input", x.grad)
        rec.grads(model, f"step{step}/grad")
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_scales(model)
    rec.state_dict(model)


def _recipe_case(recipe: str, dtype_name: str, mode: str) -> Callable[[Recorder], None]:
    def case(rec: Recorder) -> None:
        dtype = DTYPES[dtype_name]
        dim, hidden = (128, 256) if recipe == "blockwise" else (64, 128)
        xs, ys = _data(2, 16, dim, out=10)
        torch.manual_seed(0)
        model = MLP(dim, hidden).to(dtype)
        convert_to_float8_training(model, config=_config(recipe))
        rec.json("converted", _converted(model))
        if recipe == "static":
            report = calibrate(model, [xs[i].to(dtype) * (i + 1) for i in range(STEPS)])
            rec.json("calibrate", report)
        if mode == "eager":
            _train_steps(rec, model, model, xs, ys, dtype)
        else:
            import torch._inductor.config as inductor_config

            torch._dynamo.reset()
            with inductor_config.patch(emulate_precision_casts=True):
                _train_steps(rec, model, torch.compile(model, fullgraph=True), xs, ys, dtype)
        with torch.no_grad():
            rec("eval_output", model.eval()(xs[0].to(dtype)))

    return case


def _autocast_case(recipe: str) -> Callable[[Recorder], None]:
    """fp32 weights under bf16 autocast."""

    def case(rec: Recorder) -> None:
        xs, ys = _data(2, 16, 64, out=10)
        torch.manual_seed(0)
        model = convert_to_float8_training(MLP(64, 128), config=_config(recipe))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            x = xs[step].clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = F.mse_loss(out.float(), ys[step])
            loss.backward()
            rec(f"step{step}/loss", loss)
            rec(f"step{step}/output", out)
            rec(f"step{step}/grad_input", x.grad)
            rec.grads(model, f"step{step}/grad")
            opt.step()
            opt.zero_grad(set_to_none=True)
            precompute_scales(model)
        rec.state_dict(model)

    return case


# 4 experts; expert 1 gets no tokens; rows past offs[-1] (60..63) belong to no expert.
OFFS = (16, 16, 40, 60)


def _experts_case(dtype_name: str, mode: str) -> Callable[[Recorder], None]:
    def case(rec: Recorder) -> None:
        dtype = DTYPES[dtype_name]
        offs = torch.tensor(OFFS, dtype=torch.int32)
        xs, ys = _data(64, 32, out=32)
        torch.manual_seed(0)
        model = convert_experts_to_float8_training(Experts().to(dtype))
        run = model
        if mode == "compiled":
            torch._dynamo.reset()
            run = torch.compile(model, fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        import torch._inductor.config as inductor_config

        with inductor_config.patch(emulate_precision_casts=True):
            for step in range(STEPS):
                x = xs[step].to(dtype).clone().requires_grad_()
                out = run(x, offs)
                loss = F.mse_loss(out.float(), ys[step])
                loss.backward()
                rec(f"step{step}/loss", loss)
                rec(f"step{step}/output", out)
                rec(f"step{step}/grad_input", x.grad)
                rec.grads(model, f"step{step}/grad")
                opt.step()
                opt.zero_grad(set_to_none=True)
        rec.state_dict(model)

    return case


def _experts_no_tokens(rec: Recorder) -> None:
    torch.manual_seed(0)
    model = convert_experts_to_float8_training(Experts())
    x = torch.zeros(0, 32, requires_grad=True)
    out = model(x, torch.zeros(4, dtype=torch.int32))
    out.sum().backward()
    rec("output", out)
    rec("grad_input", x.grad)
    rec.grads(model, "grad")


class _MonitorMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128)
        self.fc3 = nn.Linear(128, 64)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def _drift_model() -> nn.Module:
    """fc1 with a STATIC input scale calibrated on unit-scale data; fc2, fc3 tensorwise."""
    torch.manual_seed(0)
    model = convert_to_float8_training(_MonitorMLP())
    static_input = Float8LinearConfig(cast_config_input=CastConfig(scaling_type=ScalingType.STATIC))
    model.fc1 = Float8Linear.from_float(model.fc1, config=static_input)
    g = torch.Generator().manual_seed(7)
    calibrate(model, [torch.randn(32, 64, generator=g) for _ in range(4)])
    return model


def _monitor_case(fallback: bool) -> Callable[[Recorder], None]:
    """The drift case: training on 100x the calibration data's scale, sampled every 2 steps;
    with ``fallback``, the guardrail switches the failing layer to hp."""

    def case(rec: Recorder) -> None:
        model = _drift_model()
        if fallback:
            monitor = Float8Monitor(model, every=2, fallback_below_db=15)
        else:
            monitor = Float8Monitor(model, every=2)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in range(5 if fallback else 3):
                x = torch.randn(64, 64, generator=g) * 100
                loss = model(x).square().mean()
                loss.backward()
                rec(f"step{step}/loss", loss)
                rec.grads(model, f"step{step}/grad")
                opt.step()
                opt.zero_grad(set_to_none=True)
        rec.json("report", monitor.report())
        rec.json("report_all_steps", monitor.report(all_steps=True))
        rec.json("worst3", monitor.worst(3))
        rec.json("fallbacks", monitor.fallbacks)
        rec.json("monitor_state", monitor.state_dict())
        with torch.no_grad():
            rec("eval_output", model.eval()(torch.randn(16, 64, generator=g) * 100))
        rec.state_dict(model)

    return case


def _checkpointing_case(recipe: str) -> Callable[[Recorder], None]:
    """A bf16 block with a LayerNorm recomputed in backward (``recompute_norms``) under
    selective activation checkpointing (``checkpoint_policy``)."""

    def case(rec: Recorder) -> None:
        from functools import partial

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        torch.manual_seed(0)
        block = nn.Sequential(
            nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)
        ).bfloat16()
        convert_to_float8_training(block, config=_config(recipe))
        rec.json("recomputed_norms", recompute_norms(block))
        policy = checkpoint_policy(keep_input_casts=True)
        context_fn = partial(create_selective_checkpoint_contexts, policy)
        xs, ys = _data(2, 16, 64, out=64)
        opt = torch.optim.AdamW(block.parameters(), lr=LR)
        for step in range(STEPS):
            x = xs[step].bfloat16().requires_grad_()
            out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
            loss = F.mse_loss(out.float(), ys[step])
            loss.backward()
            rec(f"step{step}/loss", loss)
            rec(f"step{step}/output", out)
            rec(f"step{step}/grad_input", x.grad)
            rec.grads(block, f"step{step}/grad")
            opt.step()
            opt.zero_grad(set_to_none=True)
            precompute_scales(block)
        rec.state_dict(block)

    return case


def _strip_state(rec: Recorder) -> None:
    """``strip_float8_state`` of a trained DELAYED model loads into the plain model."""
    torch.manual_seed(0)
    plain = MLP(64, 128)
    model = convert_to_float8_training(MLP(64, 128), config=_config("delayed"))
    xs, ys = _data(2, 16, 64, out=10)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        F.mse_loss(model(xs[step]), ys[step]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_scales(model)
    stripped = strip_float8_state(model.state_dict())
    rec.json("keys", sorted(stripped))
    plain.load_state_dict(stripped, strict=True)
    rec("plain_output", plain(xs[0]))
    rec("float8_output", model(xs[0]))


def single_cases() -> dict[str, Callable[[Recorder], None]]:
    cases = {}
    for recipe in (*RECIPES, "static"):
        for dtype_name in DTYPES:
            cases[f"recipe/{recipe}/{dtype_name}/eager"] = _recipe_case(recipe, dtype_name, "eager")
        # torch 2.13's inductor miscompiles a bf16 DELAYED backward after precompute_scales
        dtype_name = "fp32" if recipe == "delayed" else "bf16"
        cases[f"recipe/{recipe}/{dtype_name}/compiled"] = _recipe_case(
            recipe, dtype_name, "compiled"
        )
    for recipe in ("tensorwise", "rowwise"):
        cases[f"recipe/{recipe}/autocast/eager"] = _autocast_case(recipe)
    for dtype_name in DTYPES:
        cases[f"experts/{dtype_name}/eager"] = _experts_case(dtype_name, "eager")
    cases["experts/bf16/compiled"] = _experts_case("bf16", "compiled")
    cases["experts/no_tokens"] = _experts_no_tokens
    for recipe in ("tensorwise", "delayed"):
        cases[f"checkpointing/{recipe}/bf16"] = _checkpointing_case(recipe)
    cases["strip_float8_state/delayed"] = _strip_state
    cases["monitor/drift"] = _monitor_case(fallback=False)
    cases["monitor/fallback"] = _monitor_case(fallback=True)
    return cases


# ---------------------------------------------------------------------------- 2 gloo ranks


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(model: nn.Module, blocks, **fsdp_kwargs) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    for block in blocks:
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def _uneven_net(config: Float8LinearConfig) -> nn.Sequential:
    """Only float8 weights, no biases: 1040 rows (520 per rank), 17 rows (9 / 8) and 1 row
    (1 / 0: an empty shard)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(32, 1040, bias=False),
        nn.ReLU(),
        nn.Linear(1040, 17, bias=False),
        nn.ReLU(),
        nn.Linear(17, 1, bias=False),
    )
    return convert_to_float8_training(net, config=config, module_filter_fn=lambda m, f: True)


def _net(config: Float8LinearConfig, **kwargs) -> Net:
    torch.manual_seed(0)
    return convert_to_float8_training(
        Net(**kwargs), config=config, module_filter_fn=lambda m, fqn: fqn != "head"
    )


def _train_sharded(rec: Recorder, model: nn.Module, xs, ys, *, steps: int = STEPS) -> None:
    """Each rank its half of the global batch; the loss hashed is the global batch's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = xs.shape[1] // world
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        out = model(xs[step, local])
        loss = F.mse_loss(out.float(), ys[step, local])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rec(f"step{step}/loss", total / world)
        rec.local(f"step{step}/output_rank0", out)
        rec.grads(model, f"step{step}/grad")
        opt.step()
        opt.zero_grad(set_to_none=True)
        precompute_scales(model)
    rec.state_dict(model)


def _fsdp_case(recipe: str, shape: str, **fsdp_kwargs) -> Callable[[Recorder], None]:
    def case(rec: Recorder) -> None:
        config = _config(recipe, enable_fsdp_float8_all_gather=True)
        if shape == "uneven":
            model = _uneven_net(config)
            _shard(model, [model[0], model[2], model[4]], **fsdp_kwargs)
            xs, ys = _data(16, 32, out=1)
        elif shape == "cut_blocks":  # 384 and 128 rows: each rank's shard cuts a 128-block
            model = _net(config, dim=128, hidden=384, n_blocks=1)
            _shard(model, model.layers, **fsdp_kwargs)
            xs, ys = _data(16, 128, out=16)
        elif shape == "compiled_blocks":  # each block compiled, then sharded (torchtitan)
            import torch._inductor.config as inductor_config

            torch._dynamo.reset()
            model = _net(config)
            for i, block in enumerate(model.layers):
                model.layers[i] = torch.compile(block, fullgraph=True)
            _shard(model, model.layers, **fsdp_kwargs)
            xs, ys = _data(16, 64, out=16)
            with inductor_config.patch(emulate_precision_casts=True):
                _train_sharded(rec, model, xs, ys)
            return
        else:
            model = _net(config)
            _shard(model, model.layers, **fsdp_kwargs)
            xs, ys = _data(16, 64, out=16)
        _train_sharded(rec, model, xs, ys)

    return case


def _fsdp_experts(rec: Recorder) -> None:
    from torch.distributed.fsdp import fully_shard

    config = Float8ExpertsConfig(enable_fsdp_float8_all_gather=True)
    torch.manual_seed(0)
    model = convert_experts_to_float8_training(Experts(), config=config)
    fully_shard(model, mesh=_mesh())
    offs = torch.tensor((8, 8, 20, 32), dtype=torch.int32)  # expert 1: no tokens
    xs, ys = _data(2, 32, 32, out=32)
    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        out = model(xs[step, rank], offs)
        loss = F.mse_loss(out, ys[step, rank])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rec(f"step{step}/loss", total / dist.get_world_size())
        rec.local(f"step{step}/output_rank0", out)
        rec.grads(model, f"step{step}/grad")
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec.state_dict(model)


def _tp_case(recipe: str, sequence_parallel: bool) -> Callable[[Recorder], None]:
    def case(rec: Recorder) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import parallelize_module

        torch.manual_seed(0)
        config = _config(recipe)
        model = convert_to_float8_training(
            SwiGLU(), config=config, module_filter_fn=lambda m, f: True
        )
        if sequence_parallel:
            plan = {
                "": PrepareFloat8ModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "w1": Float8ColwiseParallel(),
                "w3": Float8ColwiseParallel(),
                "w2": Float8RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {
                "w1": Float8ColwiseParallel(),
                "w3": Float8ColwiseParallel(),
                "w2": Float8RowwiseParallel(),
            }
        parallelize_module(model, _mesh(), plan)
        xs, ys = _data(2, 16, 64, out=64)
        rank, world = dist.get_rank(), dist.get_world_size()
        seq = slice(rank * 16 // world, (rank + 1) * 16 // world)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = xs[step], ys[step]
            if sequence_parallel:
                x, y = x[:, seq], y[:, seq]
            x = x.clone().requires_grad_()
            out = model(x)
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            total = loss.detach().clone()
            if sequence_parallel:
                dist.all_reduce(total)
                total /= world
            rec(f"step{step}/loss", total)
            rec.local(f"step{step}/output_rank0", out)
            rec.local(f"step{step}/grad_input_rank0", x.grad)
            rec.grads(model, f"step{step}/grad")
            opt.step()
            opt.zero_grad(set_to_none=True)
            precompute_scales(model)
        rec.state_dict(model)

    return case


def _qgz_case(recipe: str, fp8_all_gather: bool = False, **kw) -> Callable[[Recorder], None]:
    def case(rec: Recorder) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        config = _config(recipe, enable_fsdp_float8_all_gather=fp8_all_gather)
        model = _uneven_net(config)
        fsdp_kwargs = {}
        if kw.get("bf16_reduce"):
            fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
            )
        _shard(model, [model[0], model[2], model[4]], **fsdp_kwargs)
        enable_float8_reduce_scatter(model, config=kw.get("rs"))
        xs, ys = _data(16, 32, out=1)
        _train_sharded(rec, model, xs, ys, steps=2)

    return case


def dist_cases() -> dict[str, Callable[[Recorder], None]]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cases = {}
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "static_weight"):
        cases[f"fsdp/{recipe}/even"] = _fsdp_case(recipe, "even")
    for recipe in ("tensorwise", "rowwise", "delayed"):
        cases[f"fsdp/{recipe}/uneven"] = _fsdp_case(recipe, "uneven")
    cases["fsdp/blockwise/cut_blocks"] = _fsdp_case("blockwise", "cut_blocks")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cases["fsdp/tensorwise/bf16_params"] = _fsdp_case(
        "tensorwise", "even", mp_policy=bf16, reshard_after_forward=False
    )
    cases["fsdp/experts"] = _fsdp_experts
    cases["fsdp/tensorwise/compiled_blocks"] = _fsdp_case("tensorwise", "compiled_blocks")
    for recipe in RECIPES:
        cases[f"tp/{recipe}/plain"] = _tp_case(recipe, sequence_parallel=False)
    for recipe in ("tensorwise", "rowwise"):
        cases[f"tp/{recipe}/sequence_parallel"] = _tp_case(recipe, sequence_parallel=True)
    cases["qgz/tensorwise/default"] = _qgz_case("tensorwise")
    cases["qgz/tensorwise/e5m2_pow2_block64"] = _qgz_case(
        "tensorwise",
        rs=Float8ReduceScatterConfig(
            CastConfig(scaling_granularity=BlockwiseGranularity(64), target_dtype=E5M2),
            round_scales_to_power_of_2=True,
        ),
    )
    cases["qgz/tensorwise/bf16_reduce"] = _qgz_case("tensorwise", bf16_reduce=True)
    cases["qgz/rowwise/fp8_all_gather"] = _qgz_case("rowwise", fp8_all_gather=True)
    cases["qgz/blockwise"] = _qgz_case("blockwise")
    return cases


def _rank_entry(rank: int, world: int, tmp: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        hashes: dict[str, str] = {}
        timings = {}
        cases = dist_cases()
        for name in names:
            t0 = time.perf_counter()
            cases[name](Recorder(name, hashes))
            timings[name] = time.perf_counter() - t0
        if rank == 0:
            with open(f"{tmp}/rank0.json", "w") as f:
                json.dump({"hashes": hashes, "timings": timings}, f)
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    # skip interpreter teardown (gloo's threads sometimes abort it on a loaded machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_dist(names: list[str]) -> tuple[dict[str, str], dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="golden") as tmp:
        mp.spawn(_rank_entry, args=(WORLD, tmp, names), nprocs=WORLD, join=True)
        with open(f"{tmp}/rank0.json") as f:
            result = json.load(f)
    return result["hashes"], result["timings"]


# ---------------------------------------------------------------------------- main


def cpu_vendor() -> str:
    """The CPU's vendor (``vendor_id`` in /proc/cpuinfo: GenuineIntel, AuthenticAMD): fp32
    and bf16 kernels round differently on Intel and AMD CPUs of the same capability."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    return {
        "torch": torch.__version__,
        "cpu_vendor": cpu_vendor(),
        "cpu_avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def compute(only: str | None) -> tuple[dict[str, str], list[str]]:
    """Hashes of the selected cases, and the selected case names."""
    singles = single_cases()
    selected = [n for n in singles if only is None or only in n]
    dist_names = [n for n in dist_cases() if only is None or only in n]
    hashes: dict[str, str] = {}
    for name in selected:
        t0 = time.perf_counter()
        singles[name](Recorder(name, hashes))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if dist_names:
        t0 = time.perf_counter()
        dist_hashes, timings = run_dist(dist_names)
        hashes.update(dist_hashes)
        for name, seconds in timings.items():
            print(f"{name}: {seconds:.1f} s", file=sys.stderr)
        print(f"{WORLD} gloo ranks in all: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return hashes, selected + dist_names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE", help="compute and write the golden hashes")
    mode.add_argument("--check", metavar="FILE", help="compute and compare with FILE")
    parser.add_argument("--only", metavar="SUBSTRING", help="only the cases whose name has it")
    args = parser.parse_args()
    print(f"float8kit from {os.path.dirname(float8kit.__file__)}", file=sys.stderr)

    t0 = time.perf_counter()
    hashes, cases = compute(args.only)
    print(f"computed in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.record:
        with open(args.record, "w") as f:
            json.dump({"env": environment(), "hashes": hashes}, f, indent=1, sort_keys=True)
            f.write("\n")
            f.write("\n")
        print(f"{len(hashes)} hashes written to {args.record}")
        return 0

    with open(args.check) as f:
        golden = json.load(f)
    env = environment()
    for key, value in golden["env"].items():
        if env.get(key) != value:
            print(f"env differs: {key} recorded {value!r}, now {env.get(key)!r}")
    prefixes = tuple(f"{c}/" for c in cases)
    want = {k: v for k, v in golden["hashes"].items() if k.startswith(prefixes)}
    bad = 0
    for key in sorted(want.keys() | hashes.keys()):
        if key not in hashes:
            print(f"MISSING {key}")
        elif key not in want:
            print(f"NEW {key}")
        elif hashes[key] != want[key]:
            print(f"MISMATCH {key}")
        else:
            continue
        bad += 1
    equal = sum(1 for k, v in hashes.items() if want.get(k) == v)
    print(f"{len(want)} hashes, {equal} equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
