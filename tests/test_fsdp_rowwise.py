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

from benchmarks.measures.fsdp_rowwise import RECIPES, _ag, _plain, recast_sqnr
from benchmarks.measures.gloo import (
    DELAYED_AG,
    _bitwise,
    _OneRank,
    _rel_diff,
    spawn,
)
from float8kit import GemmRole
from float8kit.cast import cast_to_float8
from float8kit.linear import Float8Linear
from tests.helpers import sqnr


@pytest.fixture(scope="module")
def rowwise2(tmp_path_factory):
    return spawn(
        "benchmarks.measures.fsdp_rowwise:_worker_rowwise", 2, tmp_path_factory.mktemp("rowwise2")
    )


@pytest.fixture(scope="module")
def uneven_rowwise3(tmp_path_factory):
    return spawn(
        "benchmarks.measures.fsdp_rowwise:_worker_uneven_rowwise",
        3,
        tmp_path_factory.mktemp("uneven_rowwise3"),
    )


@pytest.fixture(scope="module")
def compile_rowwise2(tmp_path_factory):
    return spawn(
        "benchmarks.measures.fsdp_rowwise:_worker_compile_rowwise",
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
