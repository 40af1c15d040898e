"""Checkpoints of converted models go through torch.save / torch.load(weights_only=True)."""

import io

import torch
from torch import nn

from float8kit import Float8LinearConfig, GemmRole, convert_to_float8_training
from float8kit.cast import cast_to_float8


def model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False))


def round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_state_dict_has_linear_keys_and_hp_values():
    plain = model()
    f8 = convert_to_float8_training(model())
    f8.load_state_dict(plain.state_dict())
    sd = f8.state_dict()
    assert list(sd) == list(plain.state_dict())
    for key, value in sd.items():
        assert type(value) is torch.Tensor and torch.equal(value, plain.state_dict()[key])


def test_float8_checkpoint_loads_into_plain_model_and_back():
    f8 = convert_to_float8_training(model())
    x = torch.randn(4, 64)
    want = f8(x)
    plain = model()
    plain.load_state_dict(round_trip(f8.state_dict()))
    for p, q in zip(plain.parameters(), f8.parameters(), strict=True):
        assert torch.equal(p, q)
    again = convert_to_float8_training(model())
    again.load_state_dict(round_trip(plain.state_dict()))
    assert torch.equal(again(x), want)


def test_training_resumes_bitwise_from_a_checkpoint():
    def steps(m, opt, n, start):
        losses = []
        for i in range(start, start + n):
            g = torch.Generator().manual_seed(i)
            loss = m(torch.randn(16, 64, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(0)
    a = convert_to_float8_training(model())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    straight = steps(a, opt_a, 6, 0)

    torch.manual_seed(0)
    b = convert_to_float8_training(model())
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    first = steps(b, opt_b, 3, 0)
    ckpt = round_trip({"model": b.state_dict(), "optim": opt_b.state_dict()})
    c = convert_to_float8_training(model())
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    c.load_state_dict(ckpt["model"])
    opt_c.load_state_dict(ckpt["optim"])
    assert first + steps(c, opt_c, 3, 3) == straight


def test_config_and_float8_tensor_pickle_under_weights_only():
    config = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    assert round_trip(config) == config
    x = cast_to_float8(torch.randn(16, 32), config.cast_config_input, GemmRole.INPUT, -1, config)
    y = round_trip(x)
    assert type(y) is type(x) and torch.equal(y.dequantize(), x.dequantize())
