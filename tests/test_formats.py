"""The format contract (float8kit/formats/), parametrized over the registry: a format added to
``formats.FORMATS`` gets every test here without editing this file.

Each format's operands (every role, both reduced dims) are quantized with the format's own
scale rule and checked against fp64 (SQNR), against a requantization with the same scale
(bitwise: values on the grid stay on it), through transposes (the dequantized transpose is
the transpose of the dequantized), on zeros and non-finite input (zeros stay zeros, inf/NaN
stay visible), and for what its capabilities declare (the recipe lists come from the
registry too; conversion and tensor-parallel refusals: test_convert.py, test_tp.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.measures.gloo import spawn
from float8kit import (
    CastConfig,
    Float8ExpertsConfig,
    Float8LinearConfig,
    Float8Recipe,
    convert_to_float8_training,
    formats,
    gemm,
    precompute_scales,
)
from float8kit.cast import cast_to_float8
from float8kit.config import GemmRole, ScalingGranularity, ScalingType
from float8kit.formats import FORMATS, Format
from tests.helpers import sqnr

GRANULARITIES = list(FORMATS)


def _operands(granularity):
    """(format, role, reduce_dim, fp8 dtype) of every operand a format casts."""
    cast = CastConfig(scaling_granularity=granularity)
    out = []
    for role in (GemmRole.INPUT, GemmRole.WEIGHT, GemmRole.GRAD_OUTPUT):
        for reduce_dim in (-1, 0):
            fmt = formats.of(cast, role, reduce_dim, 2)
            out.append((fmt, cast, role, cast.dtype_for(role)))
    return out


def _x(shape=(96, 160), seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows and columns of different magnitudes: every scale layout sees varied groups
    return (
        torch.randn(shape, generator=g)
        * torch.logspace(-2, 2, shape[0])[:, None]
        * torch.logspace(1, -1, shape[1])[None, :]
    )


def _is_float8(data: torch.Tensor) -> bool:
    return data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_dequantize_tracks_fp64(granularity):
    x = _x()
    for fmt, cast, _, dtype in _operands(granularity):
        data, scale = fmt.quantize_dynamic(x, dtype, cast, False)
        assert data.shape == x.shape
        got = fmt.dequantize(data, scale)
        # float8 elements: e4m3 ~ 31 dB, e5m2 ~ 25 dB on varied data; 4-bit e2m1 ~ 14 dB
        floor = (28 if dtype == torch.float8_e4m3fn else 22) if _is_float8(data) else 12
        assert sqnr(x.double(), got.double()) > floor, (fmt, dtype)


def _same_values(a: torch.Tensor, b: torch.Tensor, fmt) -> bool:
    # the elements' values (the guarded cast writes -0 as +0: the same value)
    return torch.equal(fmt.elements(a), fmt.elements(b))


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_quantize_with_a_given_scale_redoes_the_cast(granularity):
    # what FSDP2's recast and a recomputation rely on: the cast again with the scale it
    # made gives the same elements, and so does the cast of its own dequantized values
    x = _x(seed=1)
    for fmt, cast, _, dtype in _operands(granularity):
        data, scale = fmt.quantize_dynamic(x, dtype, cast, False)
        redo, redo_scale = fmt.quantize(x, scale, dtype, True)
        assert torch.equal(redo_scale, scale) and _same_values(redo, data, fmt), fmt
        if getattr(fmt, "hadamard", False):
            continue  # the transform's fp32 round trip is not exact
        again, _ = fmt.quantize(fmt.dequantize(data, scale), scale, dtype, True)
        assert _same_values(again, data, fmt), fmt


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_transpose_commutes_with_dequantize(granularity):
    x = _x(seed=2)
    for fmt, cast, _, dtype in _operands(granularity):
        data, scale = fmt.quantize_dynamic(x, dtype, cast, False)
        t_fmt, t_scale = fmt.transpose(scale, 0, 1)
        assert torch.equal(t_fmt.dequantize(data.t(), t_scale), fmt.dequantize(data, scale).t())
        back, back_scale = t_fmt.transpose(t_scale, 0, 1)
        assert back == fmt and torch.equal(back_scale, scale)
        # a rebuilt object is equal and hashes equal (compiled graphs guard on formats)
        assert hash(back) == hash(fmt)


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_zeros_stay_zeros_and_non_finite_stays_visible(granularity):
    for fmt, cast, _, dtype in _operands(granularity):
        zeros = torch.zeros(64, 64)
        data, scale = fmt.quantize_dynamic(zeros, dtype, cast, False)
        assert torch.equal(fmt.dequantize(data, scale), zeros), fmt
        for bad in (float("nan"), float("inf")):
            x = _x((64, 64), seed=3)
            x[5, 7] = bad
            data, scale = fmt.quantize_dynamic(x, dtype, cast, False)
            got = fmt.dequantize(data, scale)
            assert not torch.isfinite(got[5, 7]), (fmt, bad)  # never saturated away


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_capabilities_are_declared_and_valid(granularity):
    caps = FORMATS[granularity].capabilities
    assert isinstance(caps, formats.Capabilities)
    assert ScalingType.DYNAMIC in caps.scaling_types
    assert caps.tensor_parallel in (None, formats.GLOBAL_AMAX, formats.LOCAL_BLOCKS)
    assert caps.gemm in gemm._FAMILIES
    assert caps.layer_multiple is None or caps.layer_multiple % 16 == 0
    assert caps.min_cuda_capability >= (8, 9)
    # a CastConfig with another policy than the format supports is refused by name
    for kind in (ScalingType.DELAYED, ScalingType.STATIC):
        if kind not in caps.scaling_types:
            with pytest.raises(ValueError, match="CastConfig.scaling_granularity="):
                CastConfig(scaling_type=kind, scaling_granularity=granularity, static_scale=None)


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_a_named_recipe_uses_every_format(granularity):
    # every registered format is reachable from a preset (the recipe lists tests use)
    used = {
        c.scaling_granularity
        for r in Float8Recipe
        for _, c in formats.enabled_casts(Float8LinearConfig.from_recipe_name(r))
    }
    assert granularity in used


def test_the_base_format_raises_for_everything():
    # nothing inherits tensorwise behaviour by accident: a format that forgets a method
    # raises naming itself (before: the base gave one scalar amax for MX's shard groups)
    @dataclasses.dataclass(frozen=True)
    class Bare(Format):
        pass

    bare, t = Bare(), torch.ones(4, 4)
    calls = [
        lambda: bare.short(),
        lambda: bare.quantize(t, t, torch.float8_e4m3fn, True),
        lambda: bare.amax(t),
        lambda: bare.expand(t, t.shape),
        lambda: bare.dequantize(t, t),
        lambda: bare.transpose(t, 0, 1),
        lambda: bare.view(t, t.shape, (16,), "view"),
        lambda: bare.group_amaxes(t, None),
        lambda: bare.cuts(4, 2),
        lambda: bare.dtensor_amax(t),
        lambda: bare.scale_bytes(t, "fp32"),
        lambda: bare.scale_from_bytes(t, "fp32"),
        lambda: bare.all_gather_inputs(None),
        lambda: bare.all_gathered((t,), (), None),
        lambda: bare.refill(None, (t,), ()),
        lambda: bare.precomputes(None, 2),
        lambda: bare.precompute_amaxes([t], [None]),
        lambda: bare.precomputed_scales(t, [t.shape], None, None),
        lambda: Bare.for_operand(CastConfig(), GemmRole.INPUT, -1, 2),
    ]
    for call in calls:
        with pytest.raises(NotImplementedError, match="Bare"):
            call()


def _recipe_of(granularity) -> Float8Recipe:
    """A named recipe whose weight is cast in ``granularity``."""
    return next(
        r
        for r in Float8Recipe
        if Float8LinearConfig.from_recipe_name(r).cast_config_weight.scaling_granularity
        is granularity
    )


def _accepted(make) -> bool:
    try:
        make()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("granularity", GRANULARITIES, ids=lambda g: g.value)
def test_config_validation_agrees_with_the_capabilities(granularity):
    # the data a format declares is what the configs accept: a policy, float8 all-gather,
    # MoE experts (Float8ExpertsConfig takes e4m3 operands)
    caps = FORMATS[granularity].capabilities
    for kind in (ScalingType.DYNAMIC, ScalingType.DELAYED, ScalingType.STATIC):
        extra = {"static_scale": 1.0} if kind is ScalingType.STATIC else {}
        ok = _accepted(
            lambda kind=kind, extra=extra: CastConfig(
                scaling_type=kind, scaling_granularity=granularity, **extra
            )
        )
        assert ok == (kind in caps.scaling_types), kind
    base = Float8LinearConfig.from_recipe_name(_recipe_of(granularity))
    assert caps.fsdp_float8_all_gather == _accepted(
        lambda: dataclasses.replace(base, enable_fsdp_float8_all_gather=True)
    )
    e4m3 = {} if granularity is ScalingGranularity.NVFP4 else {"target_dtype": torch.float8_e4m3fn}
    cast = CastConfig(scaling_granularity=granularity, **e4m3)
    assert caps.experts == _accepted(lambda: Float8ExpertsConfig(cast_config=cast))


# ---------------------------------------------------------------------------- FSDP2 all-gather

# every format that FSDP2 can all-gather in float8, from the registry
FSDP_FORMATS = [g for g in GRANULARITIES if FORMATS[g].capabilities.fsdp_float8_all_gather]
# a weight whose rows FSDP2 shards unevenly over 3 ranks (214, 214, 212), cutting every block
# size (16, 32, 128); over 2 ranks evenly (NVFP4's codes then travel packed)
ROWS, COLS = 640, 256


def _fsdp_layer(granularity):
    """A float8 all-gather Float8Linear of the named recipe of ``granularity`` (same weight on
    every rank), and its config."""
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(_recipe_of(granularity)),
        enable_fsdp_float8_all_gather=True,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(COLS, ROWS, bias=False))
    model = convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: True)
    return model, config


def _one_device_cast(granularity) -> tuple:
    model, config = _fsdp_layer(granularity)
    hp = model[0].weight._tensor
    want = cast_to_float8(hp, config.cast_config_weight, GemmRole.WEIGHT, -1, config)
    return want._gran, want._data.view(torch.uint8), want._scale


def _gathered(weight) -> tuple:
    """(format, bytes of the weight's rows, scale) of a gathered float8 weight."""
    w = weight._local_tensor if hasattr(weight, "_local_tensor") else weight
    return w._gran, w._data.view(torch.uint8)[:ROWS].clone(), w._scale.clone()


class _OneRank:
    def size(self) -> int:
        return 1


@pytest.mark.parametrize("granularity", FSDP_FORMATS, ids=lambda g: g.value)
def test_one_rank_all_gather_is_the_one_device_cast(granularity):
    # the lifecycle's hooks on one rank (no collective): the gathered weight is the cast of
    # the hp weight, bitwise, and a re-gather into FSDP2's ``out`` keeps it so
    model, _ = _fsdp_layer(granularity)
    layer = model[0]
    w = layer.weight.data
    want = _one_device_cast(granularity)

    def gather(out=None):
        inputs, meta = w.fsdp_pre_all_gather(_OneRank(), w.shape, (COLS, 1), layer, None)
        return w.fsdp_post_all_gather(inputs, meta, torch.float32, out=out)

    weight, _ = gather()
    got = _gathered(weight)
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert gather(out=weight) is None
    again = _gathered(weight)
    assert torch.equal(again[1], want[1]) and torch.equal(again[2], want[2])


def _all_gather_worker(rank: int, world: int, tmp: str) -> dict:
    """Every FSDP2 format's weight as FSDP2 gathers it in forward on ``world`` gloo ranks: by
    the hook's own collective (no precomputed scale), then after ``precompute_scales``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(8, COLS, generator=torch.Generator().manual_seed(1))
    out = {}
    for granularity in FSDP_FORMATS:
        model, _ = _fsdp_layer(granularity)
        fully_shard(model, mesh=mesh)
        seen = []
        model[0].register_forward_pre_hook(lambda m, a, seen=seen: seen.append(_gathered(m.weight)))
        model(x)
        precompute_scales(model)
        model(x)
        out[granularity.value] = seen
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_all_gather_is_the_one_device_cast(world, tmp_path):
    # the registry's FSDP2 formats on real gloo ranks, uneven shards and cut blocks at 3:
    # every rank's gathered weight is bitwise the one-device cast, with the hook's scale and
    # with the precomputed one
    ranks = spawn("tests.test_formats:_all_gather_worker", world, tmp_path)
    for granularity in FSDP_FORMATS:
        fmt, data, scale = _one_device_cast(granularity)
        for r, got in enumerate(ranks):
            for when, (g, d, s) in zip(
                ("hook", "precomputed"), got[granularity.value], strict=True
            ):
                assert g == fmt, (granularity, r, when)
                assert torch.equal(d, data), (granularity, r, when)
                assert torch.equal(s, scale), (granularity, r, when)
