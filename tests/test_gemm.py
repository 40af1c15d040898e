"""gemm.scaled_mm against an fp64 matmul of the dequantized operands, and emulate vs kernel."""

import pytest
import torch

from float8kit import Float8LinearConfig, GemmRole
from float8kit.gemm import scaled_mm
from float8kit.linear import cast_to_float8
from tests.helpers import sqnr

TW = Float8LinearConfig()
RW = Float8LinearConfig.from_recipe_name("rowwise")


def operands(m, k, n, a_cfg=TW, b_cfg=TW):
    a = cast_to_float8(torch.randn(m, k), a_cfg.cast_config_input, GemmRole.INPUT, -1, a_cfg)
    b = cast_to_float8(torch.randn(n, k), b_cfg.cast_config_weight, GemmRole.WEIGHT, -1, b_cfg)
    return a, b.t()


def reference(a, b):
    return a.dequantize(torch.float64) @ b.dequantize(torch.float64)


@pytest.mark.parametrize(
    "a_cfg, b_cfg", [(TW, TW), (RW, RW), (RW, TW), (TW, RW)], ids=["tw", "rw", "rw-tw", "tw-rw"]
)
def test_kernel_matches_dequantized_matmul(a_cfg, b_cfg):
    a, b = operands(64, 96, 48, a_cfg, b_cfg)
    out = scaled_mm(a, b, out_dtype=torch.float32)
    assert out.shape == (64, 48) and out.dtype == torch.float32
    assert sqnr(reference(a, b), out) > 100  # exact products; fp32 accumulation only


def test_emulate_matches_kernel():
    a, b = operands(64, 96, 48, RW, RW)
    kernel = scaled_mm(a, b, out_dtype=torch.float32)
    emulated = scaled_mm(a, b, emulate=True, out_dtype=torch.float32)
    assert sqnr(kernel, emulated) > 100


def test_output_dtype_defaults_to_left_hp_dtype():
    a, b = operands(16, 32, 16)
    assert scaled_mm(a.to(torch.bfloat16), b).dtype == torch.bfloat16


def test_layouts_do_not_change_the_result():
    a, b = operands(32, 64, 48)
    want = scaled_mm(a, b, out_dtype=torch.float32)
    # a column-major A and a row-major B are copied to the layouts _scaled_mm wants
    a_cm = a.with_data(a._data.t().contiguous().t())
    b_rm = b.with_data(b._data.contiguous())
    assert torch.equal(scaled_mm(a_cm, b_rm, out_dtype=torch.float32), want)


def test_pad_inner_dim_keeps_the_result():
    a, b = operands(32, 40, 48)  # K = 40 is not a multiple of 16
    padded = scaled_mm(a, b, pad_inner_dim=True, out_dtype=torch.float32)
    assert sqnr(reference(a, b), padded) > 100


def test_bad_shapes_raise():
    a, b = operands(32, 64, 48)
    with pytest.raises(ValueError, match=r"\(M, K\) @ \(K, N\)"):
        scaled_mm(a, a)
