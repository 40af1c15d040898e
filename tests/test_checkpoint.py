"""Checkpoints of converted models: torch.save / torch.load(weights_only=True), and a DELAYED
fan-out model (tied input states) through torch.save, DCP and safetensors, resumed bitwise."""

import io

import pytest
import torch
from torch import nn

from float8kit import Float8LinearConfig, GemmRole, ScalingGranularity, convert_to_float8_training
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


class _FanOut(nn.Module):
    """q/k/v read one tensor, gate/up another: the delayed recipe ties their input states."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.q, self.k, self.v = (nn.Linear(32, 32) for _ in range(3))
        self.gate, self.up = nn.Linear(32, 64), nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        h = self.norm(x)
        a = self.q(h) * self.k(h) + self.v(h)
        return self.down(nn.functional.silu(self.gate(a)) * self.up(a))


def _fan_out(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return convert_to_float8_training(
        _FanOut(), config=Float8LinearConfig.from_recipe_name("delayed")
    )


def _save_load(fmt: str, model: nn.Module, path) -> nn.Module:
    """``model`` through a checkpoint of format ``fmt``, loaded into a freshly built one."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    if fmt == "torch.save(model)":  # the whole module, pickled
        torch.save(model, path / "model.pt")
        return torch.load(path / "model.pt", weights_only=False)
    fresh = _fan_out(123)  # another init: everything must come from the checkpoint
    if fmt == "torch.save":
        torch.save(model.state_dict(), path / "sd.pt")
        fresh.load_state_dict(torch.load(path / "sd.pt", weights_only=True))
    elif fmt == "safetensors":
        save_file(model.state_dict(), path / "model.safetensors")
        fresh.load_state_dict(load_file(path / "model.safetensors"))
    else:  # DCP
        dcp.save(model.state_dict(), checkpoint_id=path / "dcp")
        sd = fresh.state_dict()
        dcp.load(sd, checkpoint_id=path / "dcp")
        fresh.load_state_dict(sd)
    return fresh


@pytest.mark.parametrize("fmt", ["torch.save", "torch.save(model)", "DCP", "safetensors"])
def test_delayed_fan_out_resumes_bitwise_from_every_checkpoint_format(fmt, tmp_path):
    """Tied DELAYED input states (q/k/v, gate/up) keep one tensor per state_dict key, so every
    checkpoint format takes them; saved between optimizer.step() and precompute_scales (the
    pending amax records included), the resumed run's losses and state are bitwise those of
    the run that was not interrupted, and the layers tie again."""
    from float8kit import precompute_scales

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 16, 32, generator=g) * (1 + i % 3) for i in range(6)]

    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    model = _fan_out(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = []
    for x in batches:
        ref.append(step(model, opt, x))
        precompute_scales(model)

    first = _fan_out(0)
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    for i, x in enumerate(batches[:3]):
        step(first, opt1, x)
        if i < 2:
            precompute_scales(first)
    assert first.q.fp8_state.tie is first.k.fp8_state.tie is first.v.fp8_state.tie is not None
    torch.save(opt1.state_dict(), tmp_path / "opt.pt")
    second = _save_load(fmt, first, tmp_path)
    opt2 = torch.optim.AdamW(second.parameters(), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    precompute_scales(second)
    losses = []
    for x in batches[3:]:
        losses.append(step(second, opt2, x))
        precompute_scales(second)
    assert torch.equal(torch.stack(losses), torch.stack(ref[3:]))
    want, got = model.state_dict(), second.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert second.q.fp8_state.tie is second.k.fp8_state.tie is second.v.fp8_state.tie is not None
    assert second.gate.fp8_state.tie is second.up.fp8_state.tie is not None


def _mx_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False))
    return convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("mxfp8"))


def test_mxfp8_config_and_mx_tensor_pickle_under_weights_only():
    config = Float8LinearConfig.from_recipe_name("mxfp8")
    assert round_trip(config) == config
    x = cast_to_float8(torch.randn(16, 64), config.cast_config_input, GemmRole.INPUT, -1, config)
    y = round_trip(x)
    assert x._scale.dtype == torch.uint8 and y._scale.dtype == torch.uint8  # e8m0 bytes
    assert type(y) is type(x) and torch.equal(y._scale, x._scale)
    assert torch.equal(y._data.view(torch.uint8), x._data.view(torch.uint8))
    assert torch.equal(y.dequantize(), x.dequantize())


def test_mxfp8_resumes_bitwise_from_dcp(tmp_path):
    """model and AdamW state through DCP (get/set_state_dict: FQN keys) into a model built
    with another init; the resumed steps' losses and the final parameters are bitwise those
    of the run that was not interrupted."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 32, 64, generator=g) * (1 + i % 3) for i in range(6)]

    def step(m, opt, x):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    ref_model = _mx_model(0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref = torch.stack([step(ref_model, ref_opt, x) for x in batches])

    first = _mx_model(0)
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    head = torch.stack([step(first, opt1, x) for x in batches[:3]])
    msd, osd = get_state_dict(first, opt1)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "dcp")

    second = _mx_model(123)  # another init: everything must come from the checkpoint
    opt2 = torch.optim.AdamW(second.parameters(), lr=1e-2)
    step(second, opt2, batches[0])  # optimizer state to load into
    msd, osd = get_state_dict(second, opt2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=tmp_path / "dcp")
    set_state_dict(second, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    tail = torch.stack([step(second, opt2, x) for x in batches[3:]])
    assert torch.equal(torch.cat([head, tail]), ref)
    # the checkpoint carried it all: the fresh init differed, and MX ran (not hp)
    assert not torch.equal(_mx_model(123)[0].weight, _mx_model(0)[0].weight)
    assert second[0].config.cast_config_input.scaling_granularity is ScalingGranularity.MX
    plain = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32, bias=False))
    plain.load_state_dict(second.state_dict())
    assert not torch.equal(plain(batches[0]), second(batches[0]))
    for (k, a), b in zip(ref_model.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert all(type(v) is torch.Tensor for v in second.state_dict().values())  # hp, as Linear's
