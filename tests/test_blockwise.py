"""The blockwise recipe (DeepSeek-V3 style): block scales against explicit per-block
references, the emulated block-scaled gemm against an fp64 matmul of the dequantized
operands, the CUDA kernel's scale layouts against torch's own meta checks (no GPU needed),
one weight cast for both gemms, and checkpoints. Numerics against fp32 with outliers are in
test_numerics.py, compile in test_compile.py, the CUDA kernel itself in test_gpu.py."""

import copy
import dataclasses
import io

import pytest
import torch
from torch import nn

from float8kit import (
    BlockwiseGranularity,
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    GemmRole,
    convert_to_float8_training,
    default_module_filter,
)
from float8kit import scaling as scaling_mod
from float8kit.cast import cast_to_float8
from float8kit.gemm import _kernel_block_mm, block_kernel_plan, scaled_mm
from tests.helpers import fwd_bwd, sqnr

BW = Float8LinearConfig.from_recipe_name("blockwise")


def cast(hp, role, reduce_dim, config=BW):
    return cast_to_float8(hp, config.cast_config_input, role, reduce_dim, config)


def test_recipe_is_e4m3_blockwise_everywhere():
    for name in ("input", "weight", "grad_output"):
        c = getattr(BW, f"cast_config_{name}")
        assert c.granularity_options == BlockwiseGranularity(128)
        assert c.dtype_for(GemmRole.GRAD_OUTPUT) == torch.float8_e4m3fn
    assert not BW.gemm_config_output.use_fast_accum


def test_block_of_a_gemm_pair_must_match():
    block = CastConfig(scaling_granularity="blockwise")
    with pytest.raises(ValueError, match="output gemm.*Blockwise.*both operands blockwise"):
        Float8LinearConfig(cast_config_input=block, cast_config_grad_output=block)
    with pytest.raises(ValueError, match="block_size"):
        Float8LinearConfig(
            cast_config_input=block,
            cast_config_weight=CastConfig(scaling_granularity=BlockwiseGranularity(64)),
            cast_config_grad_output=block,
        )
    with pytest.raises(ValueError, match="delayed and static scaling are tensorwise only"):
        CastConfig(scaling_type="delayed", scaling_granularity="blockwise")


@pytest.mark.parametrize(
    "role, reduce_dim, block",
    [
        (GemmRole.WEIGHT, -1, (128, 128)),
        (GemmRole.INPUT, -1, (1, 128)),
        (GemmRole.INPUT, 0, (128, 1)),
    ],
)
def test_block_scales_match_a_per_block_loop(role, reduce_dim, block):
    torch.manual_seed(0)
    hp = torch.randn(300, 200) * torch.logspace(-3, 3, 200)  # partial blocks in both dims
    t = cast(hp, role, reduce_dim)
    assert t._block == block
    br, bc = block
    rows, cols = -(-300 // br), -(-200 // bc)
    assert t._scale.shape == (rows, cols)
    for i in (0, rows - 1):
        for j in (0, cols - 1):
            amax = hp[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max()
            # amax_to_scale: fp8_max / amax correctly rounded to fp32
            assert t._scale[i, j] == (448.0 / amax.double()).float()
    # and the cast: every element within e4m3's half-ulp (2^-4 relative), or half the
    # subnormal step (2^-10 in fp8 units) of its own block
    deq = t.dequantize(torch.float64)
    step = scaling_mod.expand_block_scale(t._scale.double(), block, hp.shape).reciprocal()
    assert torch.all((deq - hp).abs() <= hp.abs() * 2.0**-4 + step * 2.0**-10)


def test_power_of_2_block_scales_are_the_floored_scales():
    pow2 = dataclasses.replace(BW, round_scales_to_power_of_2=True)
    hp = torch.randn(256, 384) * 3
    exact, floored = cast(hp, GemmRole.WEIGHT, -1), cast(hp, GemmRole.WEIGHT, -1, pow2)
    assert torch.equal(floored._scale, torch.exp2(torch.floor(torch.log2(exact._scale))))


def test_non_finite_input_stays_visible_in_its_tile():
    hp = torch.randn(4, 256)
    hp[1, 5] = float("inf")
    t = cast(hp, GemmRole.INPUT, -1)
    deq = t.dequantize(torch.float32)
    assert deq[1, :128].isnan().all()  # the tile with the inf
    assert deq[1, 128:].isfinite().all() and deq[[0, 2, 3]].isfinite().all()


def operands(m, k, n, a_block_dim=-1, b_role=GemmRole.WEIGHT):
    torch.manual_seed(1)
    a = cast(torch.randn(m, k) * torch.logspace(-2, 2, k), GemmRole.INPUT, a_block_dim)
    if b_role is GemmRole.WEIGHT:
        return a, cast(torch.randn(n, k), GemmRole.WEIGHT, -1).t()
    return a, cast(torch.randn(k, n), GemmRole.INPUT, 0)


@pytest.mark.parametrize("b_role", [GemmRole.WEIGHT, GemmRole.INPUT], ids=["128x128", "128x1"])
@pytest.mark.parametrize("m, k, n", [(64, 256, 384), (33, 200, 256)])
def test_emulated_gemm_is_the_dequantized_matmul(m, k, n, b_role):
    a, b = operands(m, k, n, b_role=b_role)
    out = scaled_mm(a, b, out_dtype=torch.float32)
    ref = a.dequantize(torch.float64) @ b.dequantize(torch.float64)
    assert sqnr(ref, out) > 100  # exact fp8 products, fp32 sums and scale products only
    # the definition, block by block: sum_kb (A_kb @ B_kb) / (scale_a[:, kb] * scale_b[kb])
    b_scale = b._scale if b._block == (128, 1) else b._scale.repeat_interleave(128, 1)[:, :n]
    loop = sum(
        (a._data[:, j : j + 128].double() @ b._data[j : j + 128].double())
        / (a._scale[:, j // 128, None].double() * b_scale[j // 128].double())
        for j in range(0, k, 128)
    )
    assert sqnr(loop, out) > 100


@pytest.mark.parametrize(
    "gemm, m, k, n, a_dim, b_role",
    [
        ("output", 200, 256, 384, -1, GemmRole.WEIGHT),
        ("grad_input", 70, 384, 256, -1, GemmRole.WEIGHT),
        ("grad_weight", 384, 200, 256, -1, GemmRole.INPUT),  # tokens K=200: padded to 256
    ],
)
def test_cuda_kernel_layouts_pass_torch_meta_checks(gemm, m, k, n, a_dim, b_role):
    # torch's meta function for scaled_mm_v2 checks the cuBLAS scale shapes and strides.
    a, b = operands(m, k, n, a_dim, b_role)
    inv_a, inv_b = a._scale.reciprocal().to("meta"), b._scale.reciprocal().to("meta")
    out = _kernel_block_mm(
        a._data.to("meta"), b._data.to("meta"), inv_a, inv_b, a._block, b._block, gemm
    )
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    plan = block_kernel_plan(m, k, n, a._block, b._block, gemm)
    assert (plan.pad_m, plan.pad_k) == (-m % 4, -k % 128)


def test_cuda_kernel_plan_names_the_fix():
    with pytest.raises(ValueError, match="out_features .here 200. to be a multiple of 128"):
        block_kernel_plan(64, 256, 200, (1, 128), (128, 128), "output")
    with pytest.raises(ValueError, match="block_size=128"):
        block_kernel_plan(64, 256, 256, (1, 64), (64, 64), "output")


def test_blockwise_operand_with_another_granularity_raises():
    a, _ = operands(16, 128, 128)
    tw = cast_to_float8(
        torch.randn(128, 128), CastConfig(), GemmRole.WEIGHT, -1, Float8LinearConfig()
    )
    with pytest.raises(ValueError, match="both operands blockwise"):
        scaled_mm(a, tw.t())


def test_blockwise_tensor_ops_keep_or_refuse_blocks():
    w = cast(torch.randn(256, 384), GemmRole.WEIGHT, -1)
    wt = w.t()
    assert wt._block == (128, 128) and wt._scale.shape == (3, 2)
    assert torch.equal(wt.dequantize(), w.dequantize().t())
    x = cast(torch.randn(4, 256), GemmRole.INPUT, -1).t()
    assert x._block == (128, 1) and x.shape == (256, 4)
    with pytest.raises(NotImplementedError, match="cut through its scale blocks"):
        w[:100]
    with pytest.raises(NotImplementedError, match="cut through its scale blocks"):
        w.reshape(-1)


def test_one_weight_cast_serves_forward_and_grad_input(monkeypatch):
    shapes, real = [], scaling_mod.block_amax

    def counting(hp, block):
        shapes.append((tuple(hp.shape), block))
        return real(hp, block)

    monkeypatch.setattr(scaling_mod, "block_amax", counting)
    layer = Float8Linear(256, 128, config=BW)
    x = torch.randn(3, 50, 256, requires_grad=True)
    layer(x).sum().backward()
    assert shapes.count(((128, 256), (128, 128))) == 1  # the weight: once, forward only
    assert sorted(shapes) == sorted(
        [
            ((150, 256), (1, 128)),  # input, output gemm
            ((128, 256), (128, 128)),  # weight, both gemms
            ((150, 128), (1, 128)),  # grad_output, grad_input gemm
            ((150, 128), (128, 1)),  # grad_output, grad_weight gemm
            ((150, 256), (128, 1)),  # input, grad_weight gemm
        ]
    )


def test_default_filter_wants_multiples_of_128():
    model = nn.Sequential(nn.Linear(256, 384), nn.Linear(384, 144), nn.Linear(144, 128))
    convert_to_float8_training(model, config=BW)
    assert [type(m) is Float8Linear for m in model] == [True, False, False]
    assert default_module_filter(nn.Linear(144, 128), "x")  # 16 without a config
    assert not default_module_filter(nn.Linear(144, 128), "x", BW)


def test_empty_batch_gives_zero_grads():
    layer = Float8Linear(128, 256, config=BW)
    x = torch.randn(0, 128, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 256) and torch.equal(layer.weight.grad, torch.zeros(256, 128))


def test_state_dict_is_plain_and_loads_weights_only():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 256))
    model = convert_to_float8_training(copy.deepcopy(plain), config=BW)
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    sd = model.state_dict()
    assert sd.keys() == plain.state_dict().keys()
    assert all(type(v) is torch.Tensor for v in sd.values())
    buf = io.BytesIO()
    torch.save({"model": sd, "config": BW}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["config"] == BW
    # into a plain model and back into a fresh float8 one: the same outputs, bitwise
    restored_plain = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 256))
    restored_plain.load_state_dict(loaded["model"])
    restored = convert_to_float8_training(restored_plain, config=loaded["config"])
    x, grad = torch.randn(64, 256), torch.randn(64, 256)
    before, after = fwd_bwd(model, x, grad), fwd_bwd(restored, x, grad)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    for name, g in before[2].items():
        assert torch.equal(g, after[2][name]), name


def test_blockwise_tensor_pickles_under_weights_only():
    w = cast(torch.randn(256, 200), GemmRole.WEIGHT, -1)
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded) is type(w) and loaded._block == (128, 128)
    assert torch.equal(loaded.dequantize(), w.dequantize())
