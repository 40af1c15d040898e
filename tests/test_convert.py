import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn

from float8kit import (
    Float8Linear,
    Float8LinearConfig,
    convert_to_float8_training,
    default_module_filter,
)
from tests.helpers import sqnr


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(64, 64, bias=False)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.odd = nn.Linear(64, 10)  # not divisible by 16: stays hp by default

    def forward(self, x):
        return self.odd(self.mlp(self.attn(x)))


def test_swaps_eligible_linears_in_place():
    model = Block()
    mlp = model.mlp
    out = convert_to_float8_training(model)
    assert out is model and model.mlp is mlp  # containers kept, leaves swapped
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds == {
        "attn": "Float8Linear", "mlp.0": "Float8Linear", "mlp.2": "Float8Linear", "odd": "Linear"
    }


def test_filter_sees_module_and_fqn_and_replaces_default():
    seen = []

    def keep(mod, fqn):
        seen.append((fqn, mod.out_features))
        return fqn != "mlp.2"

    model = convert_to_float8_training(Block(), module_filter_fn=keep)
    assert seen == [("attn", 64), ("mlp.0", 128), ("mlp.2", 64), ("odd", 10)]
    assert isinstance(model.odd, Float8Linear)  # the custom filter said yes
    assert type(model.mlp[2]) is nn.Linear
    assert default_module_filter(nn.Linear(64, 10), "x") is False


def test_converting_twice_never_double_wraps():
    model = convert_to_float8_training(Block())
    first = {n: m for n, m in model.named_modules()}
    config = Float8LinearConfig.from_recipe_name("rowwise")
    convert_to_float8_training(model, config=config)
    assert {n: m for n, m in model.named_modules()} == first
    assert model.attn.config == Float8LinearConfig()


def test_root_linear_is_converted_in_place():
    root = nn.Linear(32, 32)
    weight = root.weight
    out = convert_to_float8_training(root)
    assert out is root and isinstance(root, Float8Linear) and root.weight is weight
    x = torch.randn(16, 32)
    assert sqnr(x @ weight.detach().t() + root.bias.detach(), root(x)) >= 25


def test_outputs_track_the_hp_model():
    torch.manual_seed(0)
    hp = Block()
    f8 = convert_to_float8_training(Block())
    f8.load_state_dict(hp.state_dict())
    x = torch.randn(8, 64)
    assert sqnr(hp(x), f8(x)) >= 20


def test_bad_config_type():
    with pytest.raises(TypeError, match="Float8LinearConfig"):
        convert_to_float8_training(Block(), config={"emulate": True})


def test_repr_of_converted_model():
    assert_expected_inline(
        repr(convert_to_float8_training(Block())),
        """\
Block(
  (attn): Float8Linear(in_features=64, out_features=64, bias=False, cast=[i:dyn_tensor_e4m3, w:dyn_tensor_e4m3, go:dyn_tensor_e5m2])
  (mlp): Sequential(
    (0): Float8Linear(in_features=64, out_features=128, bias=True, cast=[i:dyn_tensor_e4m3, w:dyn_tensor_e4m3, go:dyn_tensor_e5m2])
    (1): GELU(approximate='none')
    (2): Float8Linear(in_features=128, out_features=64, bias=True, cast=[i:dyn_tensor_e4m3, w:dyn_tensor_e4m3, go:dyn_tensor_e5m2])
  )
  (odd): Linear(in_features=64, out_features=10, bias=True)
)""",  # noqa: E501
    )
