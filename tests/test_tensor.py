"""Float8TrainingTensor and its op table: every op against the same op on the dequantized
tensor (the reference), for tensorwise and axiswise scales."""

import pytest
import torch
from expecttest import assert_expected_inline

from float8kit import E4M3, E5M2, Float8LinearConfig, Float8TrainingTensor, GemmRole
from float8kit.cast import cast_to_float8
from float8kit.ops import supported_ops
from tests.helpers import sqnr

aten = torch.ops.aten
TW = Float8LinearConfig()
RW = Float8LinearConfig.from_recipe_name("rowwise")


def make(shape=(32, 48), granularity="tensorwise", reduce_dim=-1, dtype=torch.bfloat16):
    hp = torch.randn(*shape, dtype=dtype)
    cfg = TW if granularity == "tensorwise" else RW
    return hp, cast_to_float8(hp, cfg.cast_config_input, GemmRole.INPUT, reduce_dim, cfg)


def same(fp8_result, hp_reference):
    """The op applied to float8 equals the op applied to the dequantized tensor, bitwise."""
    assert isinstance(fp8_result, Float8TrainingTensor)
    assert fp8_result.shape == hp_reference.shape and fp8_result.dtype == hp_reference.dtype
    assert torch.equal(fp8_result.dequantize(), hp_reference)


GRANULARITIES = [("tensorwise", -1), ("axiswise", -1), ("axiswise", 0)]


@pytest.mark.parametrize("gran, dim", GRANULARITIES)
def test_metadata_ops_match_dequantized(gran, dim):
    _, x = make(granularity=gran, reduce_dim=dim)
    ref = x.dequantize()
    same(x.t(), ref.t())
    same(x.transpose(0, 1), ref.transpose(0, 1))
    same(x.detach(), ref.detach())
    same(x.clone(), ref.clone())
    same(x[4:20], ref[4:20])
    same(x[:, 16:32], ref[:, 16:32])
    for got, want in zip(x.split(16), ref.split(16), strict=True):
        same(got, want)
    for got, want in zip(x.split(16, dim=1), ref.split(16, dim=1), strict=True):
        same(got, want)
    same(torch.cat([x[:8], x[8:]]), ref)
    same(torch.cat([x[:, :16], x[:, 16:]], dim=1), ref)
    # .to(hp dtype) changes the dtype it stands for; the float8 data stays
    same(x.to(torch.float32), x.dequantize(torch.float32))


def test_views_of_tensorwise_and_compatible_axiswise():
    _, x = make(shape=(4, 8, 48))
    same(x.view(32, 48), x.dequantize().view(32, 48))
    same(x.reshape(4, 384), x.dequantize().reshape(4, 384))
    _, r = make(shape=(4, 8, 48), granularity="axiswise", reduce_dim=-1)
    same(r.view(32, 48), r.dequantize().view(32, 48))
    with pytest.raises(NotImplementedError, match="mix the scales"):
        r.view(4, 384)
    same(x.as_strided((32, 48), (48, 1)), x.dequantize().as_strided((32, 48), (48, 1)))


def test_copy_in_and_out():
    hp, x = make()
    dst = x.clone()
    dst.copy_(x.t().t())  # float8 <- float8
    same(dst, x.dequantize())
    other = torch.randn_like(hp)
    dst.copy_(other)  # float8 <- hp: cast with the destination's scale
    ref = (other.float() * x._scale).to(E4M3).float() / x._scale
    assert torch.equal(dst.dequantize(), ref.to(hp.dtype))
    out = torch.empty_like(hp)
    out.copy_(x)  # hp <- float8
    assert torch.equal(out, x.dequantize())


def test_misc_ops():
    _, x = make()
    assert torch.ops.aten.is_same_size(x, x.t().t())
    assert torch.empty_like(x).shape == x.shape
    with pytest.raises(ValueError, match="different scales"):
        torch.cat([x, x.with_data(x._data, x._scale * 2)])
    with pytest.raises(ValueError, match="float8 dtype"):
        x.to(E5M2)


@pytest.mark.parametrize("gran", ["tensorwise", "axiswise"])
def test_mm_and_addmm_match_dequantized_matmul(gran):
    cfg = TW if gran == "tensorwise" else RW
    a_hp, b_hp = torch.randn(32, 64), torch.randn(48, 64)
    a = cast_to_float8(a_hp, cfg.cast_config_input, GemmRole.INPUT, -1, cfg)
    b = cast_to_float8(b_hp, cfg.cast_config_weight, GemmRole.WEIGHT, -1, cfg).t()
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64)
    assert sqnr(ref, torch.mm(a, b)) > 60  # fp32 output: only accumulation-order noise
    bias = torch.randn(48)
    assert sqnr(ref + bias.double(), torch.addmm(bias, a, b)) > 60


def test_unknown_op_raises_naming_it():
    _, x = make()
    with pytest.raises(NotImplementedError, match="aten.sin.default"):
        torch.sin(x)
    with pytest.raises(NotImplementedError, match="aten.add.Tensor"):
        x + x


def test_op_table_covers_what_gemms_autograd_and_fsdp_need():
    names = {str(op) for op in supported_ops()}
    needed = {
        "aten.t.default",
        "aten.transpose.int",
        "aten.view.default",
        "aten.clone.default",
        "aten.detach.default",
        "aten.split.Tensor",
        "aten.cat.default",
        "aten.slice.Tensor",
        "aten.copy_.default",
        "aten._to_copy.default",
        "aten.mm.default",
        "aten.addmm.default",
        "aten.as_strided.default",
        "aten._pin_memory.default",
        "aten.is_same_size.default",
    }
    assert needed <= names, needed - names


def test_flatten_unflatten_round_trip():
    _, x = make(granularity="axiswise")
    names, ctx = x.__tensor_flatten__()
    y = Float8TrainingTensor.__tensor_unflatten__(
        {n: getattr(x, n) for n in names}, ctx, x.shape, x.stride()
    )
    same(y, x.dequantize())
    assert (y._role, y._axiswise_dim, y._config) == (x._role, x._axiswise_dim, x._config)


def test_repr():
    _, x = make(shape=(4, 16), granularity="axiswise", reduce_dim=0)
    assert_expected_inline(
        repr(x),
        """Float8TrainingTensor(role=input, fp8=torch.float8_e4m3fn, hp=torch.bfloat16, axiswise(dim=0), shape=(4, 16))""",  # noqa: E501
    )
