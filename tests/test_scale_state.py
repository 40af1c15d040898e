"""DELAYED/STATIC scale state through a model's life: dtype casts, meta-device init with
``to_empty``, checkpoints saved before ``calibrate``, and checkpoints into the plain model."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import float8kit
from float8kit import (
    CastConfig,
    Float8LinearConfig,
    ScalingType,
    calibrate,
    convert_to_float8_training,
    precompute_scales,
    strip_float8_state,
)
from tests.helpers import sqnr

DELAYED = Float8LinearConfig.from_recipe_name("delayed")
GO_STATIC = CastConfig(scaling_type=ScalingType.STATIC, static_scale=2.0**12)
STATIC_CALIBRATED = Float8LinearConfig(  # input and weight scales come from calibrate()
    cast_config_input=CastConfig(scaling_type="static"),
    cast_config_weight=CastConfig(scaling_type="static"),
    cast_config_grad_output=GO_STATIC,
)
STATIC_FIXED = Float8LinearConfig(
    cast_config_input=CastConfig(scaling_type="static", static_scale=448.0 / 4),
    cast_config_weight=CastConfig(scaling_type="static", static_scale=448.0),
    cast_config_grad_output=GO_STATIC,
)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))


def float8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".fp8_" in k}


def train_step(model: nn.Module, x: torch.Tensor, grad_scale: float = 1.0) -> None:
    out = model(x)
    out.backward(torch.randn_like(out) * grad_scale)


# ---------------------------------------------------------------------------- dtype casts


@pytest.mark.parametrize("cast", ["to_bf16", "half", "double"])
def test_model_dtype_casts_keep_scale_state_fp32(cast):
    model = convert_to_float8_training(mlp(), config=DELAYED)
    train_step(model, torch.randn(16, 64))
    precompute_scales(model)
    before = {k: v.clone() for k, v in float8_state(model).items()}
    assert before and all(v.dtype == torch.float32 for v in before.values())
    {"to_bf16": lambda: model.to(torch.bfloat16), "half": model.half, "double": model.double}[
        cast
    ]()
    assert model[0].weight.dtype != torch.float32  # the parameters did change dtype
    after = float8_state(model)
    for key, value in before.items():
        assert after[key].dtype == torch.float32 and torch.equal(after[key], value), key
    # device moves still move the state (meta: the one other device every machine has)
    model.to("meta")
    assert all(v.is_meta and v.dtype == torch.float32 for v in float8_state(model).values())


@pytest.mark.parametrize("config", [DELAYED, STATIC_FIXED], ids=["delayed", "static"])
def test_state_built_under_another_default_dtype_is_fp32(config):
    # torchtitan builds models under torch.set_default_dtype(training dtype): the state is
    # created fp32 all the same, with the values an fp32 build gives
    ref = float8kit.Float8Linear(64, 32, config=config)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = float8kit.Float8Linear(64, 32, config=config)
    finally:
        torch.set_default_dtype(default)
    assert layer.weight.dtype == torch.bfloat16
    state = {k: v for k, v in layer.state_dict().items() if k.startswith("fp8_")}
    assert len(state) == (9 if config is DELAYED else 3)
    for key, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(value, ref.state_dict()[key]), key


def test_fp16_delayed_model_keeps_finite_grads_with_small_gradients():
    # 0.1.0: .half() made the scales fp16, where e5m2's 57344 / amax overflows to inf for any
    # amax < 0.875: the grad_output scale was inf and the grads NaN from the second step on
    torch.manual_seed(0)
    ref = mlp()
    fp32 = convert_to_float8_training(copy.deepcopy(ref), config=DELAYED)
    fp16 = convert_to_float8_training(copy.deepcopy(ref), config=DELAYED).half()
    x = torch.randn(16, 64)
    grad = torch.randn(16, 32) * 0.01  # amax well below 0.875
    for _ in range(2):
        for model, dtype in ((ref, torch.float32), (fp32, torch.float32), (fp16, torch.half)):
            model.zero_grad(set_to_none=True)
            model(x.to(dtype)).backward(grad.to(dtype))
            precompute_scales(model)
    assert fp16[2].fp8_scale_grad_output.dtype == torch.float32
    assert math.isfinite(fp16[2].fp8_scale_grad_output.item())
    # as accurate as the same float8 model in fp32 (both vs the fp32 nn.Linear model)
    for p, q, r in zip(ref.parameters(), fp16.parameters(), fp32.parameters(), strict=True):
        assert torch.isfinite(q.grad).all()
        assert sqnr(p.grad, q.grad) >= min(sqnr(p.grad, r.grad) - 1, 40)


# ---------------------------------------------------------------------------- meta init


@pytest.mark.parametrize("config", [DELAYED, STATIC_FIXED], ids=["delayed", "static"])
def test_meta_init_to_empty_and_nn_init_gives_valid_state(config, monkeypatch):
    # torchtitan's pattern: build on meta, convert, to_empty, then set weights with nn.init
    # only (no reset_parameters). to_empty's memory is uninitialised; make it NaN so that a
    # pass cannot be luck.
    real_empty_like = torch.empty_like
    monkeypatch.setattr(
        torch, "empty_like", lambda t, **kw: real_empty_like(t, **kw).fill_(math.nan)
    )
    with torch.device("meta"):
        model = convert_to_float8_training(mlp(), config=config)
    model.to_empty(device="cpu")
    monkeypatch.undo()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
    fresh = convert_to_float8_training(mlp(), config=config)
    fresh.load_state_dict(strip_float8_state(model.state_dict()), strict=False)
    for key, value in float8_state(fresh).items():
        assert torch.equal(float8_state(model)[key], value), key
    x = torch.randn(16, 64)
    out = model(x)
    assert torch.isfinite(out).all() and torch.equal(out, fresh(x))


# ---------------------------------------------------------------------------- checkpoints


def test_checkpoint_saved_before_calibrate_leaves_static_layers_uncalibrated():
    x = torch.randn(16, 64)
    uncalibrated = convert_to_float8_training(mlp(), config=STATIC_CALIBRATED)
    before = copy.deepcopy(uncalibrated.state_dict())
    calibrate(uncalibrated, [x])
    calibrated_state = copy.deepcopy(uncalibrated.state_dict())
    want = uncalibrated(x)
    # 0.1.0 counted the loaded scale -1 as calibrated and cast with it (sign-flipped output)
    uncalibrated.load_state_dict(before)
    with pytest.raises(RuntimeError, match="STATIC scale of input and weight is not set"):
        uncalibrated(x)
    # a calibrated checkpoint makes the layers calibrated again
    uncalibrated.load_state_dict(calibrated_state)
    assert torch.equal(uncalibrated(x), want)
    assert (
        sqnr(
            F.linear(
                F.relu(F.linear(x, *mlp_params(uncalibrated, 0))), *mlp_params(uncalibrated, 2)
            ),
            want,
        )
        >= 20
    )


def mlp_params(model: nn.Module, i: int):
    return model[i].weight.detach(), model[i].bias.detach()


def test_strip_float8_state_loads_a_delayed_checkpoint_into_the_plain_model():
    plain = mlp()
    model = convert_to_float8_training(copy.deepcopy(plain), config=DELAYED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        train_step(model, torch.randn(16, 64))
        opt.step()
        opt.zero_grad()
        precompute_scales(model)
    state = model.state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key"):
        plain.load_state_dict(state)  # why the helper exists
    stripped = strip_float8_state(state)
    assert list(stripped) == list(plain.state_dict()) and len(state) > len(stripped)
    assert float8_state(model) and set(state) - set(stripped) == set(float8_state(model))
    assert stripped._metadata == state._metadata
    plain.load_state_dict(stripped, strict=True)
    x = torch.randn(16, 64)
    ref = F.linear(F.relu(F.linear(x, *mlp_params(model, 0))), *mlp_params(model, 2))
    assert torch.equal(plain(x), ref)
    # the other way needs no helper: the plain checkpoint resets the float8 state
    again = convert_to_float8_training(mlp(), config=DELAYED)
    again.load_state_dict(plain.state_dict(), strict=True)
    fresh = convert_to_float8_training(copy.deepcopy(plain), config=DELAYED)
    assert torch.equal(again(x), fresh(x))
    assert sqnr(ref, again(x)) >= 20


def test_foreign_float8_state_names_strip_float8_state():
    delayed = convert_to_float8_training(
        nn.Sequential(nn.Linear(32, 32)), config=Float8LinearConfig.from_recipe_name("delayed")
    )
    tensorwise = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)))
    with pytest.raises(RuntimeError, match=r"0: the state_dict has float8 scale state .*strip"):
        tensorwise.load_state_dict(delayed.state_dict())
    tensorwise.load_state_dict(float8kit.strip_float8_state(delayed.state_dict()))
    assert torch.equal(tensorwise[0].weight, delayed[0].weight)


def test_dcp_plain_checkpoint_loads_into_a_delayed_model(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    with warnings.catch_warnings():  # no process group: DCP says it assumes one process
        warnings.simplefilter("ignore")
        dcp.save(plain.state_dict(), checkpoint_id=tmp_path / "plain")
        config = Float8LinearConfig.from_recipe_name("delayed")
        fresh = convert_to_float8_training(
            nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)), config=config
        )
        initial = {k: v.clone() for k, v in fresh.state_dict().items() if "fp8_" in k}
        sd = fresh.state_dict()
        # torch's default planner (DCP wraps the RuntimeError in a CheckpointException)
        with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
            dcp.load(sd, checkpoint_id=tmp_path / "plain")
        dcp.load(sd, checkpoint_id=tmp_path / "plain", planner=float8kit.Float8LoadPlanner())
    fresh.load_state_dict(sd)
    for k, v in plain.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert len(initial) == 18  # 2 layers x 3 operands x (history, amax, scale)
    for k, v in initial.items():
        assert torch.equal(fresh.state_dict()[k], v), k  # as after conversion
