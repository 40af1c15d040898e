"""MX blocks (OCP MXFP8): the scale decision, the cast, the MX gemm and the mxfp8 recipe's
linear layer, against torchao 0.18 (the peer), exact fp64 math and fp32 references.

float8kit's MX cast is bitwise torchao's ``to_mx`` except two cases, named and asserted
here: an inf element becomes NaN (torchao saturates it to 448), and RCEIL's exponent is the
exact ceil(log2) of the quotient (as cuBLAS's and Transformer Engine's ``cvt.rp`` round),
where torchao's CPU fallback takes an fp32 ``log2`` that rounds a quotient a few ulps above
a power of two down onto it.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

from float8kit import (
    CastConfig,
    Float8LinearConfig,
    MXGranularity,
    ScalingGranularity,
    convert_to_float8_training,
)
from float8kit import scaling as scaling_mod
from float8kit.cast import cast_to_float8, to_mx
from float8kit.config import E4M3, E5M2, GemmRole, ScalingType
from float8kit.convert import default_module_filter
from float8kit.formats import MX
from tests.helpers import sqnr

MX_CAST = CastConfig(scaling_granularity=ScalingGranularity.MX, target_dtype=E4M3)
FLOOR_CAST = dataclasses.replace(MX_CAST, scaling_granularity=MXGranularity("floor"))


def mxfp8(rounding: str = "rceil") -> Float8LinearConfig:
    c = MX_CAST if rounding == "rceil" else FLOOR_CAST
    return Float8LinearConfig(cast_config_input=c, cast_config_weight=c, cast_config_grad_output=c)


def _peer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    return mx, ScaleCalculationMode


def peer_to_mx(x: torch.Tensor, rounding: str, dtype=E4M3):
    """torchao's to_mx along the last dim: (uint8 scale bytes (R, C / 32), fp8 data)."""
    mx, mode = _peer()
    scale, data = mx.to_mx(x, dtype, 32, getattr(mode, rounding.upper()))
    return scale.view(torch.uint8).reshape(x.shape[0], -1), data


def multi_scale(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Columns spanning six decades, so blocks get many different exponents."""
    return (torch.randn(rows, cols) * torch.logspace(-3, 3, cols)).to(dtype)


def edge_cases(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(8, 128).to(dtype)
    x[0, :32] = 0  # a zero block: byte 0, zeros
    x[1, 32:64] = 3e-38  # below the smallest scale: byte 0 (RCEIL) or the floor's clamp
    x[2, :32] = -0.0  # negative zeros keep their sign
    x[3, 64:96] *= 1e4  # large values
    x[4, 3] = float("nan")  # a NaN block
    x[5, 96:] = 448.0 * 2.0**-130  # a subnormal quotient
    return x


# ---------------------------------------------------------------------------- scale decision


def _exact_ceil_log2(d: float) -> int:
    m, e = math.frexp(d)  # d = m * 2**e, 0.5 <= m < 1: exact
    return e - 1 if m == 0.5 else e


def test_rceil_byte_is_the_exact_ceil_log2_of_the_fp32_quotient():
    # amaxes around powers of two, one ulp either side, subnormal and huge quotients
    base = torch.tensor([2.0**k * 448 for k in range(-140, 120, 7)], dtype=torch.float32)
    ulp = torch.cat([base, torch.nextafter(base, base * 2), torch.nextafter(base, base * 0)])
    amax = torch.cat([ulp, torch.rand(2000) * 10.0 ** torch.randint(-30, 30, (2000,))])
    got = scaling_mod.mx_scale_bits(amax, E4M3, "rceil")
    quotient = (amax / 448.0).tolist()  # fp32 division, as the cast does it
    for q, byte in zip(quotient, got.tolist(), strict=True):
        want = 0 if q == 0 else min(max(_exact_ceil_log2(q), -127), 127) + 127
        assert byte == want, q


def test_floor_byte_is_amax_exponent_minus_fp8_max_exponent():
    amax = torch.rand(3000) * 10.0 ** torch.randint(-37, 37, (3000,)).float()
    for dtype, emax in ((E4M3, 8), (E5M2, 15)):
        got = scaling_mod.mx_scale_bits(amax, dtype, "floor").tolist()
        for a, byte in zip(amax.tolist(), got, strict=True):
            want = 0 if a == 0 else min(max(math.frexp(a)[1] - 1 - emax, -127), 128) + 127
            assert byte == want, a


def test_non_finite_amax_bytes():
    amax = torch.tensor([float("nan"), float("inf"), 0.0])
    assert scaling_mod.mx_scale_bits(amax, E4M3, "rceil").tolist() == [255, 254, 0]
    assert scaling_mod.mx_scale_bits(amax, E4M3, "floor").tolist() == [255, 247, 0]
    assert torch.isnan(scaling_mod.mx_descale(torch.tensor([255], dtype=torch.uint8))).all()


# ---------------------------------------------------------------------------- the cast vs torchao


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["multi_scale", "edge_cases"])
def test_cast_bitwise_torchao(rounding, dtype, case):
    x = multi_scale(64, 512, dtype) if case == "multi_scale" else edge_cases(dtype)
    want_scale, want_data = peer_to_mx(x, rounding)
    data, scale = to_mx(x, -1, E4M3, rounding)
    assert torch.equal(scale, want_scale)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_cast_along_dim_0_is_the_cast_of_the_transpose(rounding):
    x = multi_scale(256, 96, torch.bfloat16)
    want_scale, want_data = peer_to_mx(x.t().contiguous(), rounding)
    data, scale = to_mx(x, 0, E4M3, rounding)
    assert data.shape == x.shape and scale.shape == (256 // 32, 96)
    assert data.stride() == (1, 256)  # column-major: the layout the gemm reducing dim 0 takes
    assert torch.equal(scale.t(), want_scale)
    assert torch.equal(data.t().view(torch.uint8), want_data.view(torch.uint8))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_inf_becomes_nan_where_torchao_saturates(rounding):
    x = torch.randn(4, 64)
    x[1, 5], x[2, 40] = float("inf"), float("-inf")
    want_scale, want_data = peer_to_mx(x, rounding)
    data, scale = to_mx(x, -1, E4M3, rounding)
    assert torch.equal(scale, want_scale)  # 254 (RCEIL) / 247 (FLOOR) in both
    d, w = data.float(), want_data.float()
    differ = (data.view(torch.uint8) != want_data.view(torch.uint8)).nonzero().tolist()
    assert differ == [[1, 5], [2, 40]]  # the two infs, nothing else
    assert torch.isnan(d[1, 5]) and torch.isnan(d[2, 40])
    assert w[1, 5] == 448 and w[2, 40] == -448  # torchao: saturated
    # and it stays visible through a gemm
    lin = convert_to_float8_training(nn.Linear(64, 32), config=mxfp8(rounding))
    assert torch.isnan(lin(x)[1]).all() and torch.isnan(lin(x)[2]).all()
    assert torch.isfinite(lin(x)[[0, 3]]).all()


def test_rceil_exponent_exact_where_torchao_log2_rounds_down():
    # amax 1.75000012 = 448 * 2**-8 one ulp up: the quotient is just above 2**-8, whose
    # exact ceil(log2) is -7 (byte 120); fp32 log2 rounds it to -8.0 (byte 119), so torchao
    # scales the block by 2**8 and its largest element saturates at 448
    x = torch.full((1, 32), 0.5)
    x[0, 0] = torch.nextafter(torch.tensor(1.75), torch.tensor(2.0))
    want_scale, want_data = peer_to_mx(x, "rceil")
    data, scale = to_mx(x, -1, E4M3, "rceil")
    assert want_scale.item() == 119 and scale.item() == 120
    assert want_data.float()[0, 0] == 448  # saturated
    deq = data.float() * 2.0 ** (scale.item() - 127)
    assert deq[0, 0] == 1.75  # nothing saturates with RCEIL's round-up


def test_partial_block_is_the_zero_padded_block():
    x = torch.randn(74, 64, dtype=torch.bfloat16)  # 2 x 37 tokens: 2 whole blocks + 10
    padded = torch.cat([x, x.new_zeros(22, 64)])
    data, scale = to_mx(x, 0, E4M3, "rceil")
    pdata, pscale = to_mx(padded, 0, E4M3, "rceil")
    assert scale.shape == (3, 64) and torch.equal(scale, pscale)
    assert torch.equal(data.view(torch.uint8), pdata[:74].view(torch.uint8))


def test_float8_tensor_dequantizes_like_torchao():
    mx, _ = _peer()
    x = multi_scale(32, 256, torch.bfloat16)
    fp8 = cast_to_float8(x, MX_CAST, GemmRole.INPUT, -1, mxfp8())
    assert fp8._gran == MX(1) and fp8._scale.dtype == torch.uint8
    scale, data = peer_to_mx(x, "rceil")
    want = mx.to_dtype(data, scale.view(torch.float8_e8m0fnu).reshape(-1), E4M3, 32, torch.bfloat16)
    assert torch.equal(fp8.dequantize(), want.reshape(x.shape))
    assert sqnr(x, fp8.dequantize()) > 30


def test_metadata_ops_keep_or_refuse_blocks():
    x = torch.randn(4, 8, 64)
    fp8 = cast_to_float8(x.reshape(32, 64), MX_CAST, GemmRole.INPUT, -1, mxfp8())
    t = fp8.t()
    assert t._gran == MX(0) and torch.equal(t.dequantize(), fp8.dequantize().t())
    v = fp8.view(4, 8, 64)  # unflatten the leading dims: blocks along the last dim kept
    assert torch.equal(v.dequantize(), fp8.dequantize().view(4, 8, 64))
    with pytest.raises(NotImplementedError, match="MX blocks"):
        fp8.view(32, 2, 32)
    with pytest.raises(NotImplementedError, match="32-element scale blocks"):
        fp8[:, :16]
    assert torch.equal(fp8[:5].dequantize(), fp8.dequantize()[:5])  # rows: whole blocks


# ---------------------------------------------------------------------------- the linear layer


def peer_linear(x, w, go, rounding):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    mode = getattr(ScaleCalculationMode, rounding.upper())
    y = lin._to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED, mode)
    y.backward(go)
    return y, x.grad, w.grad


def ours_linear(x, w, go, config):
    layer = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer = convert_to_float8_training(layer, config=config)
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(go)
    return y, x.grad, layer.weight.grad


def bar_case(dtype, outliers=False):
    """The issue's bar: a 256 -> 512 layer, 128 tokens."""
    x, w = torch.randn(128, 256), torch.randn(512, 256) * 0.05
    if outliers:
        x[:, :4] *= 100
        w[:32, :32] *= 50
    return x.to(dtype), w.to(dtype), torch.randn(128, 512).to(dtype)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("outliers", [False, True], ids=["plain", "outliers"])
def test_linear_fp32_bitwise_torchao_emulated(rounding, outliers):
    x, w, go = bar_case(torch.float32, outliers)
    for got, want in zip(
        ours_linear(x, w, go, mxfp8(rounding)), peer_linear(x, w, go, rounding), strict=True
    ):
        assert torch.equal(got, want)


def test_linear_bf16_against_torchao_emulated():
    # torchao's emulation multiplies the dequantized bf16 operands in bf16 (the CPU's bf16
    # matmul: its blocking and rounding vary with the CPU and oneDNN's ISA), float8kit in
    # fp32, rounded once at the end (the kernel's numerics): they agree far beyond float8's
    # own error (~29 dB), bitwise where the CPU's bf16 matmul rounds like fp32 + one round
    x, w, go = bar_case(torch.bfloat16)
    ours, peer = ours_linear(x, w, go, mxfp8()), peer_linear(x, w, go, "rceil")
    for got, want in zip(ours, peer, strict=True):
        assert sqnr(want, got) > 80


@pytest.mark.parametrize(
    "rounding, floor_db", [("rceil", (28.0, 28.0, 28.0)), ("floor", (27.0, 27.0, 27.0))]
)
def test_linear_sqnr_against_fp64(rounding, floor_db):
    x, w, go = bar_case(torch.float32)
    y, gi, gw = ours_linear(x, w, go, mxfp8(rounding))
    xd, wd, god = x.double(), w.double(), go.double()
    got = (sqnr(xd @ wd.t(), y), sqnr(god @ wd, gi), sqnr(god.t() @ xd, gw))
    assert all(g >= f for g, f in zip(got, floor_db, strict=True)), got
    if rounding == "rceil":  # RCEIL never saturates: better than FLOOR on every gemm
        floor = ours_linear(x, w, go, mxfp8("floor"))
        ref = (xd @ wd.t(), god @ wd, god.t() @ xd)
        assert all(sqnr(r, a) > sqnr(r, b) for r, a, b in zip(ref, (y, gi, gw), floor, strict=True))


def test_token_count_not_a_multiple_of_32_is_exact_zero_padding():
    torch.manual_seed(1)
    layer = convert_to_float8_training(nn.Linear(64, 96, bias=False), config=mxfp8())
    x, go = torch.randn(74, 64), torch.randn(74, 96)
    xp, gop = torch.cat([x, x.new_zeros(22, 64)]), torch.cat([go, go.new_zeros(22, 96)])
    x.requires_grad_()
    layer(x).backward(go)
    gw = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(xp).backward(gop)
    assert torch.equal(gw, layer.weight.grad)


def test_recipe_casts_every_operand_along_its_gemms_k():
    cfg = Float8LinearConfig.from_recipe_name("mxfp8")
    seen = []
    real = scaling_mod.mx_block_amax

    def spy(hp, dim):
        seen.append((tuple(hp.shape), dim))
        return real(hp, dim)

    scaling_mod.mx_block_amax = spy
    try:
        layer = convert_to_float8_training(nn.Linear(64, 96, bias=False), config=cfg)
        layer(torch.randn(128, 64, requires_grad=True)).sum().backward()
    finally:
        scaling_mod.mx_block_amax = real
    # output: x along K, w along K; grad_weight's x along tokens (cast in forward);
    # grad_input: go along N, w along N; grad_weight: go along tokens
    assert seen == [
        ((128, 64), 1), ((96, 64), 1), ((128, 64), 0),
        ((128, 96), 1), ((96, 64), 0), ((128, 96), 0),
    ]  # fmt: skip


def test_zero_input_gives_zeros_and_nan_stays_visible():
    layer = convert_to_float8_training(nn.Linear(64, 32), config=mxfp8())
    x = torch.zeros(32, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert torch.equal(y, layer.bias.expand(32, 32)) and torch.equal(
        layer.weight.grad, torch.zeros(32, 64)
    )
    x = torch.randn(32, 64)
    x[3, 7] = float("nan")
    y = layer(x)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(32) != 3]).all()


# ---------------------------------------------------------------------------- config, filter


def test_config_errors_name_the_field():
    # (MXGranularity's own field errors: test_config's settings-errors test)
    with pytest.raises(ValueError, match="does not apply to scaling_granularity='tensorwise'"):
        CastConfig(granularity_options=MXGranularity("floor"))
    with pytest.raises(ValueError, match="scaling_granularity='mx' is not supported"):
        CastConfig(scaling_type=ScalingType.DELAYED, scaling_granularity="mx")
    with pytest.raises(ValueError, match="an MX gemm needs both operands"):
        Float8LinearConfig(cast_config_input=MX_CAST, cast_config_weight=CastConfig())


def test_default_filter_and_layer_dims():
    cfg = Float8LinearConfig.from_recipe_name("mxfp8")
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64), nn.Linear(64, 96))
    assert [default_module_filter(m, "", cfg) for m in model] == [False, False, True]
    assert [default_module_filter(m, "") for m in model] == [True, True, True]
    convert_to_float8_training(model, config=cfg)
    assert [type(m).__name__ for m in model] == ["Linear", "Linear", "Float8Linear"]
    with pytest.raises(ValueError, match=r"0 \(out_features=48\) cannot run MX gemms"):
        convert_to_float8_training(
            nn.Sequential(nn.Linear(64, 48)), config=cfg, module_filter_fn=lambda m, f: True
        )


def test_recipe_reads_as_mxfp8():
    cfg = Float8LinearConfig.from_recipe_name("mxfp8")
    layer = convert_to_float8_training(nn.Linear(64, 64), config=cfg)
    assert "mx32rceil_e4m3" in repr(layer)
    assert all(
        getattr(cfg, f).scaling_granularity is ScalingGranularity.MX
        and getattr(cfg, f).dtype_for(GemmRole.GRAD_OUTPUT) == E4M3
        for pair in cfg.operand_uses().values()
        for f in pair
    )
