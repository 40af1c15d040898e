"""STATIC scaling: the configured scale fits or clips, calibrate() sets per-layer scales,
validation, state_dict, non-finite values stay visible."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from float8kit import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    ScalingType,
    calibrate,
    convert_to_float8_training,
)
from tests.helpers import sqnr

E4M3_MAX = 448.0
GO_STATIC = CastConfig(scaling_type=ScalingType.STATIC, static_scale=2.0**12)


def static_config(input_scale=None, weight_scale=None, go=GO_STATIC) -> Float8LinearConfig:
    return Float8LinearConfig(
        cast_config_input=CastConfig(scaling_type="static", static_scale=input_scale),
        cast_config_weight=CastConfig(scaling_type="static", static_scale=weight_scale),
        cast_config_grad_output=go,
    )


# ---------------------------------------------------------------------------- config


def test_static_grad_output_needs_a_scale():
    with pytest.raises(ValueError, match="cast_config_grad_output is STATIC with static_scale"):
        Float8LinearConfig(cast_config_grad_output=CastConfig(scaling_type="static"))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(scaling_type="static", scaling_granularity="axiswise"), "scaling_granularity"),
        (dict(scaling_type="static", static_scale=-2.0), "static_scale"),
        (dict(scaling_type="static", static_scale=float("inf")), "static_scale"),
        (dict(scaling_type="dynamic", static_scale=2.0), "static_scale"),
    ],
)
def test_cast_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=f"CastConfig.{field}="):
        CastConfig(**kwargs)


# ---------------------------------------------------------------------------- numerics


def test_static_scale_fits_inside_range_and_clips_beyond():
    torch.manual_seed(0)
    # fp8 = hp * S: S = 448 / 4 represents |input| <= 4 without clipping
    layer = Float8Linear(64, 64, config=static_config(input_scale=E4M3_MAX / 4, weight_scale=896.0))
    inside = torch.rand(256, 64) * 8 - 4
    beyond = inside * 100
    fit = sqnr(F.linear(inside, layer.weight, layer.bias), layer(inside))
    clipped = sqnr(F.linear(beyond, layer.weight, layer.bias), layer(beyond))
    print(f"static SQNR dB: inside range {fit:.1f}, 100x beyond {clipped:.1f}")
    assert fit >= 25
    assert clipped < 10
    # the cast used exactly S: an input at 4.0 maps to fp8 448 and back
    x = torch.zeros(1, 64)
    x[0, 0] = 4.0
    w_row = layer.weight.detach()[:, 0]
    got = layer(x) - layer.bias.detach()
    assert sqnr(4.0 * w_row, got[0]) >= 25


def test_calibrate_sets_per_layer_scales_and_fits_large_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    convert_to_float8_training(model, config=static_config())
    batches = [torch.randn(64, 64) * 100 * (1 + i) for i in range(3)]
    with pytest.raises(RuntimeError, match="calibrate"):
        model(batches[0])  # uncalibrated STATIC input/weight: a clear error, not garbage
    report = calibrate(model, [(b,) for b in batches])  # tuples are passed as model(*batch)
    want_in0 = max(float(b.abs().max()) for b in batches)
    assert report["0"]["input"] == want_in0
    assert float(model[0].fp8_scale_input) == pytest.approx(E4M3_MAX / want_in0, rel=1e-6)
    assert float(model[0].fp8_scale_weight) == pytest.approx(
        E4M3_MAX / float(model[0].weight.detach().abs().max()), rel=1e-6
    )
    with torch.no_grad():
        hidden = [F.relu(F.linear(b, model[0].weight, model[0].bias)) for b in batches]
    assert report["2"]["input"] == pytest.approx(max(float(h.abs().max()) for h in hidden))
    x = batches[2]
    with torch.no_grad():
        ref = F.linear(
            F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias
        )
    got = sqnr(ref, model(x))
    print(f"calibrated SQNR dB on 300x inputs: {got:.1f}")
    assert got >= 25


def test_static_grad_output_scale_is_used():
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    g = torch.rand(64, 32) * 2 - 1  # |grad_output| <= 1
    grads = {}
    for name, go_scale in [("fits", 2.0**15), ("clips", 2.0**25)]:
        go = CastConfig(scaling_type="static", static_scale=go_scale)  # e5m2 max 57344
        torch.manual_seed(1)
        layer = Float8Linear(64, 32, config=static_config(E4M3_MAX / 5, E4M3_MAX, go))
        xr = x.clone().requires_grad_()
        layer(xr).backward(g)
        grads[name] = xr.grad
    ref = g @ layer.weight.detach()
    assert sqnr(ref, grads["fits"]) >= 20  # e5m2
    assert sqnr(ref, grads["clips"]) < 10  # 1.0 * 2**25 >> 57344: saturated


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_stays_visible(bad):
    layer = Float8Linear(64, 64, config=static_config(E4M3_MAX / 4, 896.0))
    x = torch.randn(8, 64)
    x[2, 3] = bad
    y = layer(x)
    assert not torch.isfinite(y[2]).all()  # not saturated to a finite value
    assert torch.isfinite(y[0]).all()


# ---------------------------------------------------------------------------- state


def test_calibrated_scales_are_state(tmp_path):
    model = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=static_config())
    calibrate(model, [torch.randn(8, 32)])
    assert sorted(k for k in model.state_dict() if "fp8" in k) == [
        "0.fp8_scale_grad_output",
        "0.fp8_scale_input",
        "0.fp8_scale_weight",
    ]
    torch.save(model.state_dict(), tmp_path / "m.pt")
    other = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)), config=static_config())
    other.load_state_dict(torch.load(tmp_path / "m.pt", weights_only=True))
    x = torch.randn(8, 32)
    assert torch.equal(other(x), model(x))  # loaded scales count as calibrated
    # a plain nn.Linear checkpoint resets the static scales: calibrate again
    other.load_state_dict(nn.Sequential(nn.Linear(32, 32)).state_dict())
    with pytest.raises(RuntimeError, match="calibrate"):
        other(x)


def test_configured_static_scale_survives_plain_checkpoint():
    layer = Float8Linear(32, 32, config=static_config(E4M3_MAX / 4, 896.0))
    layer.load_state_dict(nn.Linear(32, 32).state_dict())
    assert float(layer.fp8_scale_input) == E4M3_MAX / 4
    assert float(layer.fp8_scale_weight) == 896.0
