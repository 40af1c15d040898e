"""precompute_scales: batched updates, the provider contract, and ONE collective for all
layers' scale state in a 2-process gloo group."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import OpCounter
from benchmarks.measures.gloo import _Count, spawn
from float8kit import (
    CastConfig,
    Float8Linear,
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


def _kernels_of_one_precompute(n_layers: int) -> list[str]:
    model = _mlp(n_layers)
    model(torch.randn(8, 32)).sum().backward()
    with OpCounter() as counter:
        precompute_scales(model)
    return counter.kernels


def test_precompute_is_batched_not_a_per_layer_loop():
    few, many = _kernels_of_one_precompute(2), _kernels_of_one_precompute(8)
    assert len(many) == len(few), (few, many)  # 6 vs 24 amax records, same kernel count
    # one group: e4m3 (input, weight) and e5m2 (grad_output) rows share their ops through
    # per-row constants (scaling.row_constants; 51 kernels as two groups); the scale is the
    # fp64 quotient rounded once (scaling._quotient)
    assert len(few) <= 33, few


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    precompute_scales(model)


def _surgery(model: nn.Module, step: int) -> None:
    """What a training script may do to a model between steps, each of which the kept
    ``_DelayedPlan`` must notice."""
    delayed = Float8LinearConfig.from_recipe_name("delayed")
    if step == 2:  # a layer added to the tree
        model.append(Float8Linear(16, 64, config=delayed))
    elif step == 3:  # a layer put in without registering it (Sequential.insert)
        model.insert(len(model), Float8Linear(64, 64, config=delayed))
    elif step == 4:  # every buffer replaced (a checkpoint loaded with assign=True)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    elif step == 5:  # one layer's config replaced: its input scaled from the newest amax
        recent = CastConfig(scaling_type=ScalingType.DELAYED, delayed_scale_from="most_recent")
        input_casts = dict(cast_config_input=recent, cast_config_input_for_grad_weight=recent)
        model[0].config = dataclasses.replace(model[0].config, **input_casts)
    elif step == 7:  # a layer taken out
        del model[2]


def test_the_kept_plan_updates_what_a_fresh_walk_would():
    """precompute_scales keeps what it found per model (``_DelayedPlan``); with layers added
    (registered or not), buffers replaced, a config changed and a layer removed between
    steps, every buffer equals (bitwise) that of a twin model whose plan is dropped before
    every call."""
    torch.manual_seed(0)
    kept, fresh = _mlp(3), _mlp(3)
    fresh.load_state_dict(kept.state_dict())
    for step in range(8):
        for model in (kept, fresh):
            torch.manual_seed(step)
            _surgery(model, step)
            if model is fresh:
                precompute_mod._PLANS.pop(fresh, None)
            _step(model, torch.randn(8, 32))
        k, f = kept.state_dict(), fresh.state_dict()
        assert k.keys() == f.keys()
        for name in k:
            assert torch.equal(k[name], f[name]), (step, name)
    assert float(kept[-1].fp8_amax_history_input[0]) > 0  # the added layers' state moved
    assert float(kept[-2].fp8_amax_history_input[0]) > 0


def test_a_kept_plan_keeps_no_model_alive():
    """The plans are kept weakly by model, and hold no module: a layer given alone to
    precompute_scales is freed with its last reference."""
    import gc
    import weakref

    layer = _mlp(2)[0]
    layer(torch.randn(8, 32)).sum().backward()
    precompute_scales(layer)
    assert layer in precompute_mod._PLANS
    gone = weakref.ref(layer)
    del layer
    gc.collect()
    assert gone() is None


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

# every collective precompute_scales could call
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)


def _gather(t: torch.Tensor) -> torch.Tensor:
    gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return torch.stack(gathered)


def _worker(rank: int, world: int, tmp: str) -> dict:
    out = {}
    # DELAYED: 4 layers x 3 operands, different data per rank
    torch.manual_seed(0)
    model = _mlp(4)
    torch.manual_seed(10 + rank)
    model(torch.randn(8, 32) * (1 + 5 * rank)).square().sum().backward()
    names = [n for n, _ in model.named_buffers() if ".fp8_amax_" in n and "history" not in n]
    buffers = dict(model.named_buffers())
    per_rank = _gather(torch.stack([buffers[n].clone() for n in names]))
    out["ranks_differ"] = not torch.equal(per_rank[0], per_rank[1])
    with _Count(*_COLLECTIVES) as counted:
        precompute_scales(model, group=dist.group.WORLD)
    out["delayed_log"] = counted.log
    out["delayed"] = []  # (name, max amax over ranks, scale, newest history entry)
    for name, amax in zip(names, per_rank.amax(0).tolist(), strict=True):
        prefix, op = name.split(".fp8_amax_")
        scale = float(buffers[f"{prefix}.fp8_scale_{op}"])
        history = float(buffers[f"{prefix}.fp8_amax_history_{op}"][0])
        out["delayed"].append((name, op, amax, scale, history))

    # nothing pending (dynamic only): no collective at all
    dyn = _mlp(4, "tensorwise")
    dyn(torch.randn(8, 32)).sum().backward()
    with _Count(*_COLLECTIVES) as counted:
        precompute_scales(dyn)
    out["dynamic_log"] = counted.log

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
    out["want_input_amax"] = float(_gather(batch.abs().max()).amax(0))
    with _Count(*_COLLECTIVES) as counted:
        calibrate(smodel, [batch])
    out["static_log"] = counted.log
    out["static_input_scale"] = float(smodel[0].fp8_scale_input)
    return out


@pytest.mark.slow
def test_one_collective_and_max_over_ranks(tmp_path):
    for r in spawn("tests.test_precompute:_worker", 2, tmp_path):
        assert r["ranks_differ"]  # the ranks saw different amaxes
        assert r["delayed_log"] == ["all_reduce"]
        for name, op, amax, scale, history in r["delayed"]:
            fp8_max = E5M2_MAX if op == "grad_output" else E4M3_MAX
            assert scale == pytest.approx(fp8_max / amax, rel=1e-6), name
            assert history == amax
        assert r["dynamic_log"] == []
        assert r["static_log"] == ["all_reduce"]
        assert r["static_input_scale"] == pytest.approx(E4M3_MAX / r["want_input_amax"])
