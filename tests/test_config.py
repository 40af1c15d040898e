import dataclasses
import io

import pytest
import torch
from torch import nn

from float8kit import (
    E4M3,
    E5M2,
    BlockwiseGranularity,
    CastConfig,
    Float8ExpertsConfig,
    Float8LinearConfig,
    GemmRole,
    MXGranularity,
    NVFP4Granularity,
    ScalingGranularity,
    ScalingType,
    convert_to_float8_training,
)


def test_cast_config_accepts_enum_values_as_strings():
    assert CastConfig(scaling_type="dynamic", scaling_granularity="axiswise") == CastConfig(
        scaling_type=ScalingType.DYNAMIC, scaling_granularity=ScalingGranularity.AXISWISE
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"scaling_type": "fastest"}, "CastConfig.scaling_type"),
        ({"scaling_granularity": "blocky"}, "CastConfig.scaling_granularity"),
        ({"granularity_options": BlockwiseGranularity(64)}, "CastConfig.granularity_options"),
        (
            {"scaling_granularity": "mx", "granularity_options": BlockwiseGranularity()},
            "CastConfig.granularity_options",
        ),
        ({"target_dtype": torch.bfloat16}, "CastConfig.target_dtype"),
    ],
)
def test_cast_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CastConfig(**kwargs)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: BlockwiseGranularity(0), "BlockwiseGranularity.block_size=0"),
        (lambda: BlockwiseGranularity(True), "BlockwiseGranularity.block_size=True"),
        (lambda: MXGranularity("up"), "MXGranularity.scale_rounding='up'"),
        (lambda: NVFP4Granularity(stochastic_rounding=1), "NVFP4Granularity.stochastic_rounding"),
        (lambda: NVFP4Granularity(hadamard="yes"), "NVFP4Granularity.hadamard"),
    ],
)
def test_granularity_settings_errors_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_granularity_value_is_its_member_with_settings():
    """The member alone means the default settings; a value keeps its own; dataclass
    ``replace`` keeps them; a 0.4 pickle's four fields load into the settings."""
    assert CastConfig(scaling_granularity="blockwise") == CastConfig(
        scaling_granularity=BlockwiseGranularity(128)
    )
    cast = CastConfig(scaling_granularity=BlockwiseGranularity(64), target_dtype=E4M3)
    assert cast.scaling_granularity is ScalingGranularity.BLOCKWISE
    assert dataclasses.replace(cast, target_dtype=E5M2).granularity_options.block_size == 64
    assert CastConfig().granularity_options is None and CastConfig().option("hadamard") is False
    old = {
        "scaling_type": ScalingType.DYNAMIC, "scaling_granularity": ScalingGranularity.MX,
        "target_dtype": None, "amax_history_len": 16, "delayed_scale_from": "max",
        "static_scale": None, "block_size": 128, "mx_scale_rounding": "floor",
        "stochastic_rounding": False, "hadamard": False,
    }  # fmt: skip
    # the bytes 0.4 pickled: this class path with the old fields as its state
    pickled_by_04 = CastConfig.__new__(CastConfig)
    pickled_by_04.__dict__.update(old)
    buf = io.BytesIO()
    torch.save({"cast": pickled_by_04, "new": cast}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["cast"] == CastConfig(scaling_granularity=MXGranularity("floor"))
    assert loaded["new"] == cast


def test_role_default_dtypes():
    tw, axis = CastConfig(), CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)
    assert [tw.dtype_for(r) for r in GemmRole] == [E4M3, E4M3, E5M2]
    assert [axis.dtype_for(r) for r in GemmRole] == [E4M3, E4M3, E4M3]
    assert CastConfig(target_dtype=E5M2).dtype_for(GemmRole.INPUT) == E5M2


def test_second_use_defaults_to_first():
    delayed = CastConfig(scaling_type=ScalingType.DELAYED, amax_history_len=4)
    c = Float8LinearConfig(cast_config_input=delayed)
    assert c.cast_config_input_for_grad_weight == delayed
    assert c.cast_config_weight_for_grad_input == c.cast_config_weight


def test_float8_all_gather_weights_the_grad_input_gemm_cannot_use_are_refused():
    # rowwise weights are gathered in float8 (tests/test_fsdp_rowwise.py) when the
    # grad_input re-cast of the gathered weight is exact: power-of-2 scales
    axis = CastConfig(scaling_granularity=ScalingGranularity.AXISWISE)
    with pytest.raises(ValueError, match="round_scales_to_power_of_2=True"):
        Float8LinearConfig(cast_config_weight=axis, enable_fsdp_float8_all_gather=True)
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        config = Float8LinearConfig.from_recipe_name(recipe)
        assert dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="cast_config_weight is DISABLED"):
        hp = CastConfig(scaling_type=ScalingType.DISABLED)
        Float8LinearConfig(  # only the grad_weight gemm runs in float8
            cast_config_input=hp,
            cast_config_weight=hp,
            cast_config_grad_output=hp,
            cast_config_input_for_grad_weight=CastConfig(),
            cast_config_grad_output_for_grad_weight=CastConfig(),
            enable_fsdp_float8_all_gather=True,
        )


def test_configs_that_would_be_silently_wrong_are_refused():
    # a history setting on a cast without history
    for field, value in (("amax_history_len", 8), ("delayed_scale_from", "most_recent")):
        with pytest.raises(ValueError, match=f"CastConfig.{field}=.*only used with .*DELAYED"):
            CastConfig(**{field: value})
        CastConfig(scaling_type=ScalingType.DELAYED, **{field: value})  # fine where it is used
    # nothing in float8
    hp = CastConfig(scaling_type=ScalingType.DISABLED)
    with pytest.raises(ValueError, match="every cast is ScalingType.DISABLED"):
        Float8LinearConfig(cast_config_input=hp, cast_config_weight=hp, cast_config_grad_output=hp)
    # e5m2 x e5m2: the grad_weight gemm (grad_output is e5m2 by default)
    with pytest.raises(ValueError, match="grad_weight gemm would multiply e5m2 by e5m2"):
        Float8LinearConfig(cast_config_input=CastConfig(target_dtype=E5M2))
    with pytest.raises(ValueError, match="output gemm would multiply e5m2 by e5m2"):
        e5 = CastConfig(target_dtype=E5M2)
        Float8LinearConfig(
            cast_config_input=e5,
            cast_config_weight=e5,
            cast_config_grad_output=CastConfig(target_dtype=E4M3),
        )


def test_gemm_with_one_hp_operand_is_refused():
    hp = CastConfig(scaling_type=ScalingType.DISABLED)
    with pytest.raises(ValueError, match="grad_weight gemm"):
        Float8LinearConfig(cast_config_input_for_grad_weight=hp)


@pytest.mark.parametrize("field", ["emulate", "pad_inner_dim", "round_scales_to_power_of_2"])
def test_bool_fields_are_checked(field):
    with pytest.raises(ValueError, match=f"Float8LinearConfig.{field}"):
        Float8LinearConfig(**{field: "yes"})


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Float8LinearConfig().emulate = True


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ValueError, match="'tensorwise'"):
        Float8LinearConfig.from_recipe_name("fastest")


def test_torchaos_recipe_names_and_config_are_understood():
    ao = pytest.importorskip("torchao.float8")
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        member = ao.Float8LinearRecipeName(name)
        assert Float8LinearConfig.from_recipe_name(member) == Float8LinearConfig.from_recipe_name(
            name
        )
    assert Float8ExpertsConfig.from_recipe_name(
        ao.Float8LinearRecipeName.ROWWISE
    ) == Float8ExpertsConfig.from_recipe_name("rowwise")
    with pytest.raises(TypeError, match=r"got torchao\.float8\.config\.Float8LinearConfig \(build"):
        convert_to_float8_training(nn.Linear(64, 64), config=ao.Float8LinearConfig())


def test_recipes():
    tw = Float8LinearConfig.from_recipe_name("tensorwise")
    assert tw == Float8LinearConfig()
    rw = Float8LinearConfig.from_recipe_name("rowwise")
    assert rw.round_scales_to_power_of_2
    for name in ("input", "weight", "grad_output"):
        cast = getattr(rw, f"cast_config_{name}")
        assert cast.scaling_granularity is ScalingGranularity.AXISWISE and cast.target_dtype == E4M3
    gw = Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
    assert not gw.cast_config_input_for_grad_weight.enabled
    assert not gw.cast_config_grad_output_for_grad_weight.enabled
    assert gw.cast_config_weight_for_grad_input.scaling_granularity is ScalingGranularity.TENSORWISE
