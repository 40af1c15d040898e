"""precompute_scales: batched updates, the provider contract, and ONE collective for all
layers' scale state in a 2-process gloo group."""

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from float8kit import (
    CastConfig,
    Float8LinearConfig,
    ScalingType,
    calibrate,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit import precompute as precompute_mod

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _mlp(n_layers: int, recipe: str = "delayed") -> nn.Module:
    layers = [nn.Linear(32, 64)]
    for _ in range(n_layers - 2):
        layers += [nn.ReLU(), nn.Linear(64, 64)]
    layers += [nn.ReLU(), nn.Linear(64, 16)]
    return convert_to_float8_training(
        nn.Sequential(*layers), config=Float8LinearConfig.from_recipe_name(recipe)
    )


class _CountKernels(TorchDispatchMode):
    """Counts the aten ops that are not views (i.e. that may launch a kernel)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _kernels_of_one_precompute(n_layers: int) -> list[str]:
    model = _mlp(n_layers)
    model(torch.randn(8, 32)).sum().backward()
    with _CountKernels() as counter:
        precompute_scales(model)
    return counter.ops


def test_precompute_is_batched_not_a_per_layer_loop():
    few, many = _kernels_of_one_precompute(2), _kernels_of_one_precompute(8)
    assert len(many) == len(few), (few, many)  # 6 vs 24 amax records, same kernel count
    # two groups here: e4m3 (input, weight), e5m2 (grad_output); each group's scale is the
    # fp64 quotient rounded once (scaling._quotient: two dtype conversions more than 0.2's 47)
    assert len(few) <= 51, few


def test_provider_contract():
    """A new kind of scale state is one more provider; each apply gets its slice."""
    model = _mlp(2)
    model(torch.randn(8, 32)).sum().backward()
    got = []
    extra = lambda mod: [(torch.tensor([3.0, 5.0]), got.append)]
    old = list(precompute_mod._PROVIDERS)
    precompute_mod._PROVIDERS.append(extra)
    try:
        precompute_scales(model)
    finally:
        precompute_mod._PROVIDERS[:] = old
    assert got[0].tolist() == [3.0, 5.0]
    assert float(model[0].fp8_amax_history_input[0]) > 0  # the delayed provider ran too


def test_nothing_to_do_for_dynamic_or_static_models():
    assert precompute_mod._delayed_contributions(_mlp(3, "tensorwise")) == []
    assert precompute_scales(_mlp(3, "tensorwise")) is None


# ---------------------------------------------------------------------------- distributed

_COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
]


class _CountCollectives:
    """Patches torch.distributed's collectives to record their names."""

    def __enter__(self):
        self.calls, self.saved = [], {}
        for name in _COLLECTIVES:
            fn = getattr(dist, name)
            self.saved[name] = fn

            def wrapper(*args, _fn=fn, _name=name, **kwargs):
                self.calls.append(_name)
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _gather(t: torch.Tensor) -> torch.Tensor:
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return torch.stack(gathered)


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # DELAYED: 4 layers x 3 operands, different data per rank
        torch.manual_seed(0)
        model = _mlp(4)
        torch.manual_seed(10 + rank)
        model(torch.randn(8, 32) * (1 + 5 * rank)).square().sum().backward()
        names = [n for n, _ in model.named_buffers() if ".fp8_amax_" in n and "history" not in n]
        buffers = dict(model.named_buffers())
        local = torch.stack([buffers[n].clone() for n in names])
        per_rank = _gather(local)
        assert not torch.equal(per_rank[0], per_rank[1])  # the ranks saw different amaxes
        want = per_rank.amax(0)
        with _CountCollectives() as counted:
            precompute_scales(model, group=dist.group.WORLD)
        assert counted.calls == ["all_reduce"], counted.calls
        for name, amax in zip(names, want.tolist(), strict=True):
            prefix, op = name.split(".fp8_amax_")
            fp8_max = E5M2_MAX if op == "grad_output" else E4M3_MAX
            assert float(buffers[f"{prefix}.fp8_scale_{op}"]) == pytest.approx(
                fp8_max / amax, rel=1e-6
            ), name
            assert float(buffers[f"{prefix}.fp8_amax_history_{op}"][0]) == amax

        # nothing pending (dynamic only): no collective at all
        dyn = _mlp(4, "tensorwise")
        dyn(torch.randn(8, 32)).sum().backward()
        with _CountCollectives() as counted:
            precompute_scales(dyn)
        assert counted.calls == [], counted.calls

        # STATIC calibration: the same scales on every rank, one collective
        static = CastConfig(scaling_type=ScalingType.STATIC)
        cfg = Float8LinearConfig(
            cast_config_input=static,
            cast_config_weight=static,
            cast_config_grad_output=CastConfig(scaling_type="static", static_scale=1024.0),
        )
        torch.manual_seed(0)
        smodel = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=cfg)
        torch.manual_seed(20 + rank)
        batch = torch.randn(8, 32) * (1 + 5 * rank)
        want_in = _gather(batch.abs().max()).amax(0)
        with _CountCollectives() as counted:
            calibrate(smodel, [batch])
        assert counted.calls == ["all_reduce"], counted.calls
        assert float(smodel[0].fp8_scale_input) == pytest.approx(E4M3_MAX / float(want_in))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: destroying gloo's threads at exit sometimes aborted a
    # finished rank on a loaded machine ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_one_collective_and_max_over_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)
