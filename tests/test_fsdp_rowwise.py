"""FSDP2 float8 all-gather of rowwise weights: the ``rowwise`` and ``rowwise_with_gw_hp`` recipes.

Same pattern as tests/test_fsdp.py (whose models, data, counters and launcher this reuses):
each rank group runs once per module and records numbers; the tests assert them against
references: single-device float8 training of the same recipe (losses, gradients), the bf16
all-gather (bytes), the full weight's row amaxes (scales), eager (compile), the run before a
checkpoint (resume).

The design under test (float8kit/fsdp.py): one cast is gathered, the row-scaled one the
output gemm uses; its N row scales come from ``precompute_scales``' single all-reduce; the
grad_input gemm re-casts the gathered weight locally (per column, or tensorwise), which with
power-of-2 scales equals casting the hp weight except in float8's subnormal range. So
forward is bitwise the unsharded model's, and gradients agree to >= 40 dB (measured ~inf).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from float8kit import Float8LinearConfig, GemmRole, convert_to_float8_training, precompute_scales
from float8kit.cast import cast_to_float8
from float8kit.linear import Float8Linear, _weight_for_grad_input
from float8kit.scaling import amax_to_scale
from tests.fsdp_harness import (
    DELAYED_AG,
    FP8_AG,
    STEPS,
    Net,
    _bitwise,
    _checkpoint_resume,
    _Count,
    _data,
    _fp8_weights,
    _net,
    _nonfinite_shard,
    _OneRank,
    _rel_diff,
    _shard,
    _train,
    _types,
    _uneven_net,
    spawn,
)
from tests.helpers import sqnr

RECIPES = ("rowwise", "rowwise_with_gw_hp")


def _plain(recipe: str) -> Float8LinearConfig:
    return Float8LinearConfig.from_recipe_name(recipe)


def _ag(recipe: str) -> Float8LinearConfig:
    return dataclasses.replace(_plain(recipe), enable_fsdp_float8_all_gather=True)


def _grads(model, x, y) -> list[torch.Tensor]:
    """Full (unsharded) gradients of one forward+backward, in parameter order."""
    F.mse_loss(model(x).float(), y).backward()
    return [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for p in model.parameters()
    ]


# ---------------------------------------------------------------------------- workers


def _worker_rowwise(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: losses and gradients vs single device, bytes, one collective, scales."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world,))
    batch = 8
    xs, ys = _data(STEPS, batch * world, 64, 16)
    local = slice(rank * batch, (rank + 1) * batch)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    res: dict = {}

    for recipe in RECIPES:
        config = _ag(recipe)

        def fsdp_net(config=config, **fsdp_kwargs):
            model = _net(config)
            _shard(model, mesh, model.layers, **fsdp_kwargs)
            return model

        # fp32, reshard after forward (the backward re-gathers), batch split over the ranks.
        model = fsdp_net(reshard_after_forward=True)
        res[f"{recipe}_split"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
        # precomputed row scales vs the full weight's row amaxes
        sd = model.state_dict()
        scales, refs = [], []
        for name, mod in model.named_modules():
            if isinstance(mod, Float8Linear):
                full = sd[f"{name}.weight"].full_tensor()
                amax = full.abs().amax(dim=-1, keepdim=True)
                refs.append(amax_to_scale(amax, torch.float8_e4m3fn, True))
                scales.append(mod.fp8_state.all_gather_scale.scale)
        res[f"{recipe}_scales_bitwise"] = all(
            torch.equal(a, b) for a, b in zip(scales, refs, strict=True)
        )
        res[f"{recipe}_scale_shapes"] = [tuple(s.shape) for s in scales]
        with _Count("all_reduce") as ar:
            model(xs[0, local]).sum().backward()
        res[f"{recipe}_fwd_bwd_all_reduces_after_precompute"] = ar.calls
        res[f"{recipe}_grad_types"] = _types(p.grad for p in model.parameters())
        # Every rank on the global batch: only the sharding differs from one device.
        res[f"{recipe}_replicated"], _ = _train(fsdp_net(reshard_after_forward=True), xs, ys, STEPS)
        # Without precompute_scales: the hook all-reduces each weight's row amaxes itself.
        model = fsdp_net(reshard_after_forward=True)
        with _Count("all_reduce") as ar:
            model(xs[0, local])
        res[f"{recipe}_forward_all_reduces_without_precompute"] = ar.calls
        res[f"{recipe}_no_precompute"], _ = _train(
            fsdp_net(reshard_after_forward=True),
            xs[:, local],
            ys[:, local],
            STEPS,
            precompute=False,
        )
        # bf16 params, fp32 reduce, no reshard after forward: backward uses the forward's
        # gathered weight (no re-gather).
        model = fsdp_net(reshard_after_forward=False, mp_policy=mp_policy)
        res[f"{recipe}_bf16"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
        # Gradients of one step on the global batch vs the unsharded float8 model's.
        for reshard in (True, False):
            model = fsdp_net(reshard_after_forward=reshard)
            precompute_scales(model)
            res[f"{recipe}_grads_reshard_{reshard}"] = _grads(model, xs[0], ys[0])
        res[f"{recipe}_grads_ref"] = _grads(_net(_plain(recipe)), xs[0], ys[0])

        # Bytes in one forward+backward: all-gathers, and the scales' share of
        # precompute_scales' all-reduce; float8 vs a bf16 all-gather of the same recipe.
        for reshard in (True, False):
            for name, cfg in (("fp8", config), ("bf16", _plain(recipe))):
                model = _net(cfg)
                _shard(
                    model, mesh, model.layers, mp_policy=mp_policy, reshard_after_forward=reshard
                )
                with _Count("all_reduce") as ar:
                    precompute_scales(model)
                with _Count("all_gather_single") as ag:
                    model(xs[0, local]).sum().backward()
                key = f"{recipe}_reshard_{reshard}_{name}"
                res[f"{key}_all_gather_bytes"] = ag.bytes
                res[f"{key}_all_gather_calls"] = ag.calls
                res[f"{key}_precompute_bytes"] = ar.bytes

        # inf / NaN in one rank's shard: every rank's output is non-finite, on both paths.
        res.update(_nonfinite_shard(fsdp_net, xs[0, local], rank == world - 1, f"{recipe}_"))

    # A mix of recipes and policies in one model: still one collective in precompute_scales.
    torch.manual_seed(0)
    model = Net(n_blocks=4)
    for block, config in zip(
        model.layers, (_ag("rowwise"), _ag("rowwise_with_gw_hp"), FP8_AG, DELAYED_AG), strict=True
    ):
        convert_to_float8_training(block, config=config)
    _shard(model, mesh, model.layers, reshard_after_forward=True)
    res["mix"], _ = _train(model, xs[:, local], ys[:, local], STEPS)
    with _Count("all_reduce") as ar:
        precompute_scales(model)
    res["mix_precompute_all_reduces"] = ar.calls
    with _Count("all_reduce") as ar:
        model(xs[0, local]).sum().backward()
    res["mix_fwd_bwd_all_reduces"] = ar.calls

    if rank == 0:
        for recipe in RECIPES:
            res[f"{recipe}_ref"], _ = _train(
                _net(_plain(recipe)), xs, ys, STEPS, precompute=False, sharded=False
            )
            res[f"{recipe}_ref_bf16"], _ = _train(
                _net(_plain(recipe)), xs, ys, STEPS, precompute=False, autocast=True, sharded=False
            )
    return res


def _worker_uneven_rowwise(rank: int, world: int, tmp: str) -> dict:
    """3 ranks, only float8 weights, 1040/16/2 rows (uneven and empty shards); DCP round
    trip and bitwise resume (rowwise)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    batch = 4
    xs, ys = _data(2 * STEPS, batch * world, 32, 2)
    local = slice(rank * batch, (rank + 1) * batch)
    res: dict = {}

    def fsdp_net(recipe, seed=0):
        model = _uneven_net(_ag(recipe), seed)
        _shard(model, mesh, [m for m in model if isinstance(m, torch.nn.Linear)])
        return model

    for recipe in RECIPES:
        model = fsdp_net(recipe)
        res["local_rows"] = [m.weight._local_tensor.shape[0] for m in _fp8_weights(model)]
        res[f"{recipe}_uneven"], _ = _train(model, xs[:STEPS, local], ys[:STEPS, local], STEPS)
        model = fsdp_net(recipe)
        res[f"{recipe}_uneven_replicated"], _ = _train(model, xs[:STEPS], ys[:STEPS], STEPS)
        model = fsdp_net(recipe)
        res[f"{recipe}_uneven_no_precompute"], _ = _train(
            model, xs[:STEPS, local], ys[:STEPS, local], STEPS, precompute=False
        )
        if rank == 0:
            res[f"{recipe}_ref"], _ = _train(
                _uneven_net(_plain(recipe)), xs[:STEPS], ys[:STEPS], STEPS, sharded=False
            )

    res.update(_checkpoint_resume(lambda seed=0: fsdp_net("rowwise", seed), xs, ys, local, tmp))
    return res


def _worker_compile_rowwise(rank: int, world: int, tmp: str) -> dict:
    """2 ranks: ``torch.compile(checkpoint_wrapper(block), fullgraph=True)`` per FSDP2 block
    (torchtitan's order) vs single-device eager. The recomputed forward runs on the weight
    the backward re-gathered, and the compiled backward re-casts the saved gathered weight.
    Every rank trains on the global batch: only sharding and compilation differ."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    xs, ys = _data(STEPS, 16, 64, 16)
    res: dict = {}
    for recipe in RECIPES:
        model = _net(_ag(recipe))
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(checkpoint_wrapper(block), fullgraph=True)
        _shard(model, mesh, model.layers)
        try:
            res[f"ac_{recipe}"], _ = _train(model, xs, ys, STEPS)
        except RuntimeError as e:  # both ranks fail alike: report it, do not hang
            res[f"ac_{recipe}"] = repr(e)
        res[f"ac_ref_{recipe}"], _ = _train(_net(_plain(recipe)), xs, ys, STEPS, sharded=False)
    res["compiled_frames"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return res


@pytest.fixture(scope="module")
def rowwise2(tmp_path_factory):
    return spawn("tests.test_fsdp_rowwise:_worker_rowwise", 2, tmp_path_factory.mktemp("rowwise2"))


@pytest.fixture(scope="module")
def uneven_rowwise3(tmp_path_factory):
    return spawn(
        "tests.test_fsdp_rowwise:_worker_uneven_rowwise",
        3,
        tmp_path_factory.mktemp("uneven_rowwise3"),
    )


@pytest.fixture(scope="module")
def compile_rowwise2(tmp_path_factory):
    return spawn(
        "tests.test_fsdp_rowwise:_worker_compile_rowwise",
        2,
        tmp_path_factory.mktemp("compile_rowwise2"),
    )


# ---------------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_losses_match_single_device(rowwise2, recipe):
    r = rowwise2[0]
    split = _rel_diff(r[f"{recipe}_split"], r[f"{recipe}_ref"])
    same = _rel_diff(r[f"{recipe}_replicated"], r[f"{recipe}_ref"])
    bf16 = _rel_diff(r[f"{recipe}_bf16"], r[f"{recipe}_ref_bf16"])
    print(f"{recipe}: max rel loss diff split {split:.2e}, same batch {same:.2e}, bf16 {bf16:.2e}")
    assert split < 0.02 and bf16 < 0.02
    # Same batch on every rank: only the sharding differs (the grad_input re-cast equals the
    # direct cast outside the subnormal range).
    assert same < 1e-5
    assert _bitwise(rowwise2[1][f"{recipe}_split"], r[f"{recipe}_split"])
    # The hook's own all-reduce gives the precomputed scales: bitwise the same training.
    assert _bitwise(r[f"{recipe}_no_precompute"], r[f"{recipe}_split"])
    assert r[f"{recipe}_forward_all_reduces_without_precompute"] == 4  # one per weight


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_match_the_unsharded_float8_model(rowwise2, recipe, reshard):
    r = rowwise2[0]
    got, ref = r[f"{recipe}_grads_reshard_{reshard}"], r[f"{recipe}_grads_ref"]
    sqnrs = [sqnr(b, a) for a, b in zip(got, ref, strict=True)]
    print(f"{recipe}, reshard_after_forward={reshard}: grad SQNRs (dB) {sqnrs}")
    assert min(sqnrs) >= 40


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_all_gather_bytes_with_scales_at_most_055_of_bf16(rowwise2, recipe, reshard):
    r = rowwise2[0]
    fp8, bf16 = f"{recipe}_reshard_{reshard}_fp8", f"{recipe}_reshard_{reshard}_bf16"
    sent = r[f"{fp8}_all_gather_bytes"] + r[f"{fp8}_precompute_bytes"]
    ratio = sent / r[f"{bf16}_all_gather_bytes"]
    print(f"{recipe} reshard={reshard}: {sent} / {r[f'{bf16}_all_gather_bytes']} = {ratio:.3f}")
    assert r[f"{fp8}_all_gather_calls"] == r[f"{bf16}_all_gather_calls"] == (6 if reshard else 3)
    assert r[f"{bf16}_precompute_bytes"] == 0
    # the row scales: 4 bytes for each row of the 4 float8 weights (128 + 64 rows per block)
    assert r[f"{fp8}_precompute_bytes"] == 4 * 2 * (128 + 64)
    assert ratio <= 0.55


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_precomputed_row_scales_are_the_full_weights(rowwise2, recipe):
    for r in rowwise2:
        assert r[f"{recipe}_scales_bitwise"]
        assert r[f"{recipe}_scale_shapes"] == [(128, 1), (64, 1)] * 2
        assert r[f"{recipe}_fwd_bwd_all_reduces_after_precompute"] == 0
        assert r[f"{recipe}_grad_types"] == ["DTensor(Tensor)"]


@pytest.mark.slow
def test_mix_of_recipes_and_policies_one_collective(rowwise2):
    for r in rowwise2:
        assert r["mix_precompute_all_reduces"] == 1
        assert r["mix_fwd_bwd_all_reduces"] == 0
        assert all(math.isfinite(x) for x in r["mix"])


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["inf", "nan"])
@pytest.mark.parametrize("path", ["hook", "precompute"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_nonfinite_weight_shard_stays_visible(rowwise2, recipe, bad, path):
    for r in rowwise2:
        assert r[f"{recipe}_finite_{float(bad)}_{path}"] is False


# ---------------------------------------------------------------------------- 3 ranks


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_uneven_and_empty_shards(uneven_rowwise3, recipe):
    assert [r["local_rows"] for r in uneven_rowwise3] == [[347, 6, 1], [347, 6, 1], [346, 4, 0]]
    r = uneven_rowwise3[0]
    split = _rel_diff(r[f"{recipe}_uneven"], r[f"{recipe}_ref"])
    same = _rel_diff(r[f"{recipe}_uneven_replicated"], r[f"{recipe}_ref"])
    print(f"3 ranks, uneven + empty shards, {recipe}: split {split:.2e}, same batch {same:.2e}")
    assert split < 0.02 and same < 1e-5
    assert _bitwise(r[f"{recipe}_uneven_no_precompute"], r[f"{recipe}_uneven"])


@pytest.mark.slow
def test_dcp_round_trip_and_bitwise_resume(uneven_rowwise3):
    for r in uneven_rowwise3:
        assert r["state_dict_types"] == ["DTensor(Tensor)"]
        assert r["before_load_max_diff"] > 0
        assert r["loaded_max_diff"] == 0.0
        assert r["weights_still_subclass"]
        assert _bitwise(r["resumed"], r["after"])


# ---------------------------------------------------------------------------- compile


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_compile_with_activation_checkpointing(compile_rowwise2, recipe):
    for r in compile_rowwise2:
        losses = r[f"ac_{recipe}"]
        assert isinstance(losses, list), losses
        assert r["compiled_frames"] >= 1
        # Bitwise: the same casts as one device (forward and grad_input; see the module doc).
        assert _bitwise(losses, r[f"ac_ref_{recipe}"])


# ---------------------------------------------------------------------------- one process


@pytest.mark.parametrize("recipe", RECIPES)
def test_hooks_gather_the_forward_cast_bitwise(recipe):
    # The two hooks on one rank: the gathered weight is the layer's own forward cast (row
    # scales), bitwise; FSDP2's as_strided to the full size keeps it.
    config = _ag(recipe)
    module = Float8Linear(16, 6, bias=False, config=config)
    w = module.weight
    (data,), meta = w.fsdp_pre_all_gather(_OneRank(), w.shape, (16, 1), module, None)
    weight, _ = w.fsdp_post_all_gather((data,), meta, torch.float32)
    weight = torch.as_strided(weight, (6, 16), (16, 1), storage_offset=0)
    ref = cast_to_float8(w._tensor, config.cast_config_weight, GemmRole.WEIGHT, -1, config)
    assert weight._axiswise_dim == 1 and weight._scale.shape == (6, 1)
    assert torch.equal(weight._data.view(torch.uint8), ref._data.view(torch.uint8))
    assert torch.equal(weight._scale, ref._scale)
    # FSDP2's view of the leading rows keeps their scales; any other as_strided raises
    assert torch.equal(torch.as_strided(weight, (3, 16), (16, 1))._scale, ref._scale[:3])
    with pytest.raises(NotImplementedError, match="as_strided"):
        torch.as_strided(weight, (3, 16), (16, 1), storage_offset=16)


def recast_sqnr(recipe: str, spread: bool, pow2: bool = True) -> float:
    """SQNR (dB) of the grad_input gemm's weight re-cast from the gathered row-scaled float8
    weight against the same cast of the hp weight: a (1040, 64) weight, its rows' ranges
    spread over 5 decades when ``spread``; ``pow2=False`` turns power-of-2 scales off."""
    config = dataclasses.replace(_plain(recipe), round_scales_to_power_of_2=pow2)
    hp = torch.randn(1040, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    if spread:
        hp = hp * torch.logspace(-4, 1, 1040)[:, None]
    gathered = cast_to_float8(hp, config.cast_config_weight, GemmRole.WEIGHT, -1, config)
    got = _weight_for_grad_input(gathered, config, (None, None, False))
    ref = _weight_for_grad_input(hp, config, (None, None, False))
    assert got._axiswise_dim == ref._axiswise_dim
    return sqnr(ref.dequantize(torch.float32), got.dequantize(torch.float32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_grad_input_recast_of_the_gathered_weight(recipe):
    # rowwise: bitwise for a normal-range weight (tensorwise: the few values the smaller
    # tensor scale pushes into the subnormal range differ); with rows spread over 5 decades
    # (values in the subnormal range of their row's scale) still >= 90 dB. Without
    # power-of-2 scales the re-cast is a second rounding: why the config refuses it.
    normal, spread = recast_sqnr(recipe, False), recast_sqnr(recipe, True)
    no_pow2 = recast_sqnr(recipe, False, pow2=False)
    print(f"{recipe}: re-cast vs direct cast SQNR {normal} / {spread} / no pow2 {no_pow2} dB")
    assert normal == math.inf if recipe == "rowwise" else normal >= 120
    assert spread >= 90
    assert no_pow2 < 35


def test_config_accepts_rowwise_recipes_and_refuses_what_it_cannot_gather():
    for recipe in RECIPES:
        assert _ag(recipe).enable_fsdp_float8_all_gather
    rowwise = _plain("rowwise")
    with pytest.raises(ValueError, match="round_scales_to_power_of_2=True"):
        dataclasses.replace(
            rowwise, round_scales_to_power_of_2=False, enable_fsdp_float8_all_gather=True
        )
    delayed = dataclasses.replace(DELAYED_AG.cast_config_weight)
    with pytest.raises(ValueError, match="DYNAMIC cast_config_weight_for_grad_input"):
        dataclasses.replace(
            rowwise,
            cast_config_weight_for_grad_input=delayed,
            enable_fsdp_float8_all_gather=True,
        )
