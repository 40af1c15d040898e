import copy
import warnings

import pytest
import torch
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.fsdp import fully_shard

from float8kit import (
    Float8Linear,
    Float8LinearConfig,
    Float8Recipe,
    convert_to_float8_training,
    default_module_filter,
    formats,
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
        "attn": "Float8Linear",
        "mlp.0": "Float8Linear",
        "mlp.2": "Float8Linear",
        "odd": "Linear",
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
    convert_to_float8_training(model)  # the same config again: nothing to do
    assert {n: m for n, m in model.named_modules()} == first
    assert model.attn.config == Float8LinearConfig()


def test_converting_again_with_another_config_raises_and_changes_nothing():
    # 0.1.0 silently ignored the second config
    model = convert_to_float8_training(Block())
    first = {n: m for n, m in model.named_modules()}
    x = torch.randn(8, 64)
    want = model(x)
    rowwise = Float8LinearConfig.from_recipe_name("rowwise")
    with pytest.raises(
        ValueError,
        match=r"attn is already a Float8Linear with another config.*"
        "module_filter_fn",
    ):
        convert_to_float8_training(model, config=rowwise, module_filter_fn=lambda m, f: True)
    assert {n: m for n, m in model.named_modules()} == first
    assert type(model.odd) is nn.Linear  # not converted before the error either
    assert torch.equal(model(x), want)
    # per-layer configs: a filter that leaves the converted layers out
    convert_to_float8_training(
        model, config=rowwise, module_filter_fn=lambda m, f: not isinstance(m, Float8Linear)
    )
    assert model.odd.config == rowwise and model.attn.config == Float8LinearConfig()


class LinearWithAdapter(nn.Linear):
    """A Linear with Linear submodules (e.g. a LoRA-style adapter registered on it)."""

    def __init__(self):
        super().__init__(32, 32)
        self.adapter = nn.Sequential(nn.Linear(32, 16, bias=False), nn.Linear(16, 32))

    def forward(self, x):
        return super().forward(x) + self.adapter(x)


@pytest.mark.parametrize("where", ["root", "nested"])
def test_every_linear_is_converted_including_a_linears_children(where):
    # 0.1.0 converted a root Linear and left its child Linears hp (nested: dropped them)
    torch.manual_seed(0)
    hp = LinearWithAdapter() if where == "root" else nn.Sequential(LinearWithAdapter())
    model = convert_to_float8_training(copy.deepcopy(hp))
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    prefix = "" if where == "root" else "0."
    assert kinds == {
        prefix.rstrip("."): "Float8Linear",
        f"{prefix}adapter.0": "Float8Linear",
        f"{prefix}adapter.1": "Float8Linear",
    }
    adapter = model.adapter if where == "root" else model[0].adapter
    hp_adapter = hp.adapter if where == "root" else hp[0].adapter
    x = torch.randn(16, 32)
    assert sqnr(hp_adapter(x), adapter(x)) >= 20
    assert list(model.state_dict()) == list(hp.state_dict())


@pytest.mark.parametrize("fp8_all_gather", [False, True])
def test_convert_after_fully_shard_says_to_convert_first(one_rank_group, fp8_all_gather):
    # 0.1.0: "list index out of range" / "mixed torch.Tensor and DTensor" / AssertionError
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    fully_shard(model, mesh=one_rank_group)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather)
    with pytest.raises(RuntimeError, match="0 is already sharded.*convert before fully_shard"):
        convert_to_float8_training(model, config=config)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear
    # the right order works, and trains like the hp model on one rank
    torch.manual_seed(0)
    hp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    f8 = convert_to_float8_training(copy.deepcopy(hp), config=config)
    fully_shard(f8, mesh=one_rank_group)
    x = torch.randn(16, 32)
    assert sqnr(hp(x), f8(x)) >= 20


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


def test_converting_no_layer_warns_naming_why():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 4))
    with pytest.warns(UserWarning, match=r"none of the 2 Linears .*of 16.*in_features=10"):
        convert_to_float8_training(model)
    with pytest.warns(UserWarning, match="module_filter_fn returned False for every one"):
        convert_to_float8_training(Block(), module_filter_fn=lambda mod, fqn: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_to_float8_training(Block())  # some converted: nothing to say
        convert_to_float8_training(nn.Sequential(nn.ReLU()))  # no Linear at all


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


# the formats whose layers need both dims in multiples (MX, NVFP4), from the registry
NEEDS_DIMS = {
    r.value: caps.layer_multiple
    for r in Float8Recipe
    for _, c in formats.enabled_casts(Float8LinearConfig.from_recipe_name(r))
    if (caps := formats.capabilities(c)).layer_multiple is not None
}


@pytest.mark.parametrize("recipe", sorted(NEEDS_DIMS))
@pytest.mark.parametrize("dims", [(48, 64), (40, 24), (100, 36), (64, 48)])
def test_conversion_refuses_dims_a_format_cannot_run(recipe, dims):
    # Before: NVFP4 accepted 48x64, 40x24, 100x36 here (it runs them on CPU) and would have
    # failed only at the CUDA gemm; MX refused them. Both now refuse at conversion, naming
    # the layer, its dims and the config field, and the default filter keeps them in hp.
    assert NEEDS_DIMS == {"mxfp8": 32, "nvfp4": 32}
    config = Float8LinearConfig.from_recipe_name(recipe)
    model = nn.Sequential(nn.Linear(*dims))
    bad = ", ".join(
        f"{n}={d}" for n, d in zip(("in_features", "out_features"), dims, strict=True) if d % 32
    )
    kind = config.cast_config_input.scaling_granularity.value.upper()
    with pytest.raises(
        ValueError,
        match=rf"0 \({bad}\) cannot run {kind} gemms: Float8LinearConfig\.cast_config_input "
        rf"casts {kind}, which needs in_features and out_features to be multiples of 32",
    ):
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, f: True)
    assert type(model[0]) is nn.Linear  # nothing converted
    convert_to_float8_training(model, config=config)  # the default filter keeps it hp
    assert type(model[0]) is nn.Linear
