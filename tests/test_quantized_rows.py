"""Rows cast before a grouped gemm (float8kit/quantized_rows.py) and the experts' switch that
lets the weight-gradient gemm use them (Float8ExpertsConfig.wgrad_operands): the gemms take
float8 rows (dispatched_rows) without casting again, bit for bit what they compute from the
hp rows."""

import dataclasses

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn

from benchmarks.measures.experts import DIM, HIDDEN, OFFS, TOKENS, Experts, run
from benchmarks.measures.refs import sqnr
from float8kit import Float8ExpertsConfig, convert_experts_to_float8_training, formats
from float8kit.quantized_rows import dispatched_rows, quantize_rows, rows_format
from tests.helpers import assert_compiled_matches_eager

ROWWISE = Float8ExpertsConfig.from_recipe_name("rowwise")
MXFP8 = Float8ExpertsConfig.from_recipe_name("mxfp8")
DEQ = {
    "rowwise": dataclasses.replace(ROWWISE, wgrad_operands="dequantized"),
    "mx": dataclasses.replace(MXFP8, wgrad_operands="dequantized"),
}


def experts(config, dtype=torch.float32):
    torch.manual_seed(0)
    return convert_experts_to_float8_training(Experts().to(dtype), config=config)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, DIM, generator=g) * torch.logspace(-3, 3, DIM)  # decades apart
    return x.to(dtype), torch.randn(TOKENS, DIM, generator=g).to(dtype)


@pytest.mark.parametrize("kind", ["rowwise", "mx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemms_take_quantized_rows_bitwise_what_they_cast_from_hp(kind, dtype):
    config = DEQ[kind]
    x, grad = _data(dtype)
    want = run(experts(config, dtype), x, grad)
    data, scale = quantize_rows(x, config)
    m = experts(config, dtype)
    rows = dispatched_rows(data, scale, dtype, rows_format(config)).requires_grad_()
    out = m(rows, OFFS)
    out.backward(grad)
    got = (out.detach(), rows.grad, m.w1.grad, m.w2.grad)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["rowwise", "mx"])
def test_dequantized_wgrad_is_the_hp_wgrad_but_where_values_turn_subnormal(kind):
    # Rounding to e4m3's 3 mantissa bits commutes with power-of-two scaling, so re-casting
    # the rows' float8 values along the tokens gives the bytes the hp values give, except
    # where one of the two scales puts a value in e4m3's subnormal range (fewer bits).
    hp_config = ROWWISE if kind == "rowwise" else MXFP8
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    ref = Experts()
    for spread in ("randn", "six_decades"):
        x, grad = torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)
        if spread == "six_decades":
            x = x * torch.logspace(-3, 3, DIM)
        want = run(ref, x, grad)
        hp, deq = run(experts(hp_config), x, grad), run(experts(DEQ[kind]), x, grad)
        assert torch.equal(hp[0], deq[0]) and torch.equal(hp[1], deq[1])  # output, grad_input
        same = torch.equal(hp[2], deq[2]) and torch.equal(hp[3], deq[3])
        assert same == (spread == "randn")
        for i in (2, 3):
            s_hp, s_deq = sqnr(want[i], hp[i]), sqnr(want[i], deq[i])
            print(f"{kind} {spread} grad_w{i - 1}: hp {s_hp:.2f} dB, dequantized {s_deq:.2f} dB")
            assert abs(s_hp - s_deq) <= 1.0


def test_dequantize_is_exact_for_power_of_two_scales():
    x, _ = _data()
    x[3, 5], x[7] = 0.0, 0.0  # a zero element, an all-zero row
    for kind in ("rowwise", "mx"):
        data, scale = quantize_rows(x, DEQ[kind])
        back = rows_format(DEQ[kind]).dequantize(data, scale)
        if kind == "rowwise":
            exact = data.double() / scale.double()
        else:  # 2^(byte - 127) per 32-block
            exact = data.double() * torch.exp2(scale.double() - 127).repeat_interleave(32, 1)
        assert back.dtype == torch.float32 and torch.equal(back.double(), exact)
        assert torch.equal(back[7], torch.zeros(DIM))


def test_rows_refuse_hp_math_and_configs_name_the_field():
    data, scale = quantize_rows(torch.randn(4, 32), DEQ["rowwise"])
    rows = dispatched_rows(data, scale, torch.bfloat16, rows_format(ROWWISE))
    assert rows.dtype == torch.bfloat16 and rows.shape == (4, 32)
    with pytest.raises(NotImplementedError, match="call .dequantize.. first"):
        rows + 1
    with pytest.raises(NotImplementedError, match="mm of a float8 and an hp tensor"):
        nn.functional.linear(rows, torch.randn(8, 32))
    with pytest.raises(ValueError, match="rows dispatched by expert parallelism"):
        dispatched_rows(data, scale, torch.bfloat16, "rowwise")  # a format object, not a name
    with pytest.raises(ValueError, match="rows dispatched by expert parallelism"):
        dispatched_rows(data, scale, torch.bfloat16, formats.Blockwise(1, 128))
    assert rows_format(ROWWISE) == formats.Axiswise(1) and rows_format(MXFP8) == formats.MX(1)
    with pytest.raises(ValueError, match="wgrad_operands"):
        Float8ExpertsConfig(wgrad_operands="fp8")
    with pytest.raises(ValueError, match="round_scales_to_power_of_2"):
        Float8ExpertsConfig(wgrad_operands="dequantized", round_scales_to_power_of_2=False)
    # rows dispatched in float8 into experts whose weight gradient wants hp rows
    m = experts(ROWWISE)
    x, _ = _data()
    rows = dispatched_rows(*quantize_rows(x, DEQ["rowwise"]), torch.float32, formats.Axiswise(1))
    with pytest.raises(ValueError, match='wgrad_operands="dequantized"'):
        m(rows, OFFS)
    mx_rows = dispatched_rows(*quantize_rows(x, DEQ["mx"]), torch.float32, formats.MX(1))
    with pytest.raises(ValueError, match=r"arrived as mx\(dim=1, 1x32\) float8 rows"):
        experts(DEQ["rowwise"])(mx_rows, OFFS)


def test_dequantized_wgrad_saves_float8_rows_not_hp_ones():
    # what the weight-gradient gemm keeps for backward: fp8 data + scales instead of hp x
    x, _ = _data()
    saved = {}
    for name, config in (("hp", ROWWISE), ("dequantized", DEQ["rowwise"])):
        m = experts(config)
        sizes = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(x.requires_grad_(), OFFS)
        saved[name] = sum(sizes)
    x_bytes = TOKENS * DIM * 4
    # the first gemm's hp x (TOKENS x DIM fp32) becomes fp8 rows + one fp32 scale per row;
    # the second gemm's hp input (TOKENS x HIDDEN) likewise
    fewer = (TOKENS * DIM * 3 - TOKENS * 4) + (TOKENS * HIDDEN * 3 - TOKENS * 4)
    print(f"saved for backward: hp operands {saved['hp']} B, dequantized {saved['dequantized']} B")
    assert saved["hp"] - saved["dequantized"] == fewer and x_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rowwise", "mx"])
@inductor_config.patch(emulate_precision_casts=True)  # SiLU's bf16 rounding, as eager
def test_compiled_experts_take_quantized_rows_bitwise_eager(kind):
    # the expert block compiled (fullgraph) on rows dispatched in float8
    config = DEQ[kind]
    x, grad = _data(torch.bfloat16)
    data, scale = quantize_rows(x, config)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        m = experts(config, torch.bfloat16)
        rows = dispatched_rows(data, scale, torch.bfloat16, rows_format(config)).requires_grad_()
        out = (torch.compile(m, fullgraph=True) if compiled else m)(rows, OFFS)
        out.backward(grad)
        results.append((out.detach(), rows.grad, m.w1.grad, m.w2.grad))
    names = ("output", "grad_input", "grad_w1", "grad_w2")
    for name, a, b in zip(names, *results, strict=True):
        assert_compiled_matches_eager(a, b, name)  # bitwise on torch >= 2.13
