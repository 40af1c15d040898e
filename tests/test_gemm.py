"""gemm.scaled_mm against an fp64 matmul of the dequantized operands, and emulate vs kernel."""

import dataclasses

import pytest
import torch

from float8kit import Float8LinearConfig, GemmRole, gemm
from float8kit.cast import cast_to_float8
from float8kit.gemm import (
    GemmPlan,
    KernelPlan,
    kernel_plan,
    mx_kernel_operands,
    mx_kernel_plan,
    scaled_mm,
    to_blocked,
)
from tests.helpers import (
    OnCuda,
    blocked_scale_index,
    blocked_scale_reference,
    count_scaled_mm,
    sqnr,
)

TW = Float8LinearConfig()
RW = Float8LinearConfig.from_recipe_name("rowwise")
MX = Float8LinearConfig.from_recipe_name("mxfp8")


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


@pytest.mark.parametrize("cfg", [TW, RW], ids=["tw", "rw"])
def test_zero_padding_the_token_dim_gives_the_unpadded_result(cfg):
    # the grad_weight gemm, grad_output.T (N, M) @ input (M, K), reduces over M tokens; on
    # CUDA an M that is not a multiple of 16 is zero-padded (see kernel_plan)
    m, n, k = 37, 48, 64
    go = cast_to_float8(
        torch.randn(m, n), cfg.cast_config_grad_output, GemmRole.GRAD_OUTPUT, 0, cfg
    )
    x = cast_to_float8(torch.randn(m, k), cfg.cast_config_input, GemmRole.INPUT, 0, cfg)
    unpadded = scaled_mm(go.t(), x, out_dtype=torch.float32)
    padded = scaled_mm(go.t(), x, pad_inner_dim=True, out_dtype=torch.float32)
    assert padded.shape == (n, k)
    assert torch.equal(padded, unpadded)
    assert sqnr(reference(go.t(), x), padded) > 100


@pytest.mark.parametrize("gemm", [None, "output", "grad_input", "grad_weight"])
def test_cpu_kernel_plan_takes_any_shape_and_dtype(gemm):
    plan = kernel_plan(37, 40, torch.float32, False, True, GemmPlan(gemm))
    assert plan == KernelPlan(pad_inner=0, kernel_out_dtype=torch.float32)
    padded = GemmPlan(gemm, pad_inner_dim=True)
    assert kernel_plan(37, 40, torch.bfloat16, False, False, padded) == (
        KernelPlan(pad_inner=11, kernel_out_dtype=torch.bfloat16, pad_out=8)
    )


def test_cuda_kernel_plan_pads_the_token_dim_and_names_the_real_cause():
    def plan(k, n, gemm, out_dtype=torch.bfloat16, rowwise=False, pad=False):
        # (fast accumulation, as a layer's output gemm asks: the rowwise kernel)
        return kernel_plan(k, n, out_dtype, True, rowwise, GemmPlan(gemm, True, False, pad))

    # grad_weight reduces over the tokens: any count works, padded to the next 16
    assert plan(37, 64, "grad_weight") == KernelPlan(11, torch.bfloat16)
    assert plan(48, 64, "grad_weight") == KernelPlan(0, torch.bfloat16)
    # a layer dim that is not aligned is named as such, with the fix
    with pytest.raises(ValueError, match=r"in_features \(here 40\).*output gemm.*pad_inner_dim"):
        plan(40, 64, "output")
    assert plan(40, 64, "output", pad=True) == KernelPlan(8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"out_features \(here 40\).*grad_input gemm.*pad_inner"):
        plan(40, 64, "grad_input")
    with pytest.raises(ValueError, match=r"out_features \(here 40\).*output gemm.*pad_inner"):
        plan(64, 40, "output")
    with pytest.raises(ValueError, match=r"in_features \(here 24\).*grad_weight gemm.*hp"):
        plan(37, 24, "grad_weight")
    # pad_inner_dim pads N too: a layer dim is K in one gemm and N in another
    assert plan(64, 40, "output", pad=True) == KernelPlan(0, torch.bfloat16, pad_out=8)
    assert plan(37, 24, "grad_weight", pad=True) == KernelPlan(11, torch.bfloat16, pad_out=8)
    # rowwise kernels write bf16 only: fp32 is produced as bf16 and upcast; tensorwise writes it
    assert plan(64, 64, "grad_weight", torch.float32, rowwise=True).kernel_out_dtype == (
        torch.bfloat16
    )
    assert plan(64, 64, "grad_weight", torch.float32).kernel_out_dtype == torch.float32


def test_axiswise_scales_along_the_wrong_dim_raise():
    # M == K: per-column scales of the left operand have the per-row scales' element count,
    # and 0.1.0 applied them to the rows (relative error ~1 instead of ~0.05)
    x, w = torch.randn(64, 64), torch.randn(48, 64)
    x[:, 0] *= 100  # one large column: per-column and per-row scales differ a lot
    a_wrong = cast_to_float8(x, RW.cast_config_input, GemmRole.INPUT, 0, RW)
    a_right = cast_to_float8(x, RW.cast_config_input, GemmRole.INPUT, -1, RW)
    b = cast_to_float8(w, RW.cast_config_weight, GemmRole.WEIGHT, -1, RW).t()
    assert sqnr(x @ w.t(), scaled_mm(a_right, b, out_dtype=torch.float32)) > 25
    with pytest.raises(ValueError, match="left operand .* along dim 0.*one scale per row"):
        scaled_mm(a_wrong, b)
    b_wrong = cast_to_float8(w.t().contiguous(), RW.cast_config_weight, GemmRole.WEIGHT, -1, RW)
    with pytest.raises(ValueError, match="right operand .* along dim 1.*one scale per column"):
        scaled_mm(a_right, b_wrong)


@pytest.mark.parametrize("cfg", [TW, RW], ids=["tw", "rw"])
@pytest.mark.parametrize("m, k, n", [(0, 32, 48), (48, 0, 32), (16, 32, 0)])
def test_empty_operands_give_zeros_without_calling_the_kernel(cfg, m, k, n):
    a = cast_to_float8(torch.randn(m, k), cfg.cast_config_input, GemmRole.INPUT, -1, cfg)
    b = cast_to_float8(torch.randn(n, k), cfg.cast_config_weight, GemmRole.WEIGHT, -1, cfg).t()
    with count_scaled_mm() as calls:
        out = scaled_mm(a, b, out_dtype=torch.float32)
        assert len(calls) == 0
        scaled_mm(*operands(16, 32, 16))
    assert torch.equal(out, torch.zeros(m, n)) and len(calls) == 1  # the counter counts


def test_cuda_rowwise_without_fast_accum_takes_the_post_scale_route():
    # torchao's rule: the CUTLASS rowwise kernel is very slow without fast accumulation, so
    # such gemms run the tensorwise kernel with unit scales (fp32 out) and scale afterwards
    def plan(rowwise, fast, cuda=True):
        return kernel_plan(64, 64, torch.bfloat16, cuda, rowwise, GemmPlan(None, fast))

    assert plan(True, False) == KernelPlan(0, torch.float32, post_scale=True)
    assert plan(True, True) == KernelPlan(0, torch.bfloat16)  # the rowwise kernel
    assert plan(False, False) == KernelPlan(0, torch.bfloat16)  # tensorwise: as asked
    assert not plan(True, False, cuda=False).post_scale  # CPU: one kernel for both


@pytest.mark.parametrize("cfg", [TW, RW], ids=["tw", "rw"])
def test_pad_inner_dim_pads_the_output_dim_too(cfg):
    # a layer with in_features 40: the grad_input gemm's N is 40; zero columns appended to
    # the right operand (scales padded with 1) give extra output columns that are dropped
    go = cast_to_float8(torch.randn(37, 48), cfg.cast_config_grad_output, GemmRole.GRAD_OUTPUT,
                        -1, cfg)  # fmt: skip
    w = cast_to_float8(torch.randn(48, 40), cfg.cast_config_weight, GemmRole.WEIGHT, 0, cfg)
    unpadded = scaled_mm(go, w, out_dtype=torch.float32)
    padded = scaled_mm(go, w, pad_inner_dim=True, out_dtype=torch.float32)
    assert padded.shape == (37, 40)
    assert torch.equal(padded, unpadded)
    assert sqnr(reference(go, w), padded) > 100


def test_post_scale_route_gives_the_rowwise_result(monkeypatch):
    # the CUDA post-scale route's math, run on CPU: unit-scale kernel (fp32 out) times the
    # row and column scales equals the rowwise kernel's result, and the fp64 reference
    a, b = operands(64, 96, 48, RW, RW)
    direct = scaled_mm(a, b, out_dtype=torch.bfloat16)
    real_plan = gemm.kernel_plan

    def post_scale_plan(*args, **kwargs):
        return dataclasses.replace(
            real_plan(*args, **kwargs), kernel_out_dtype=torch.float32, post_scale=True
        )

    monkeypatch.setattr(gemm, "kernel_plan", post_scale_plan)
    routed = scaled_mm(a, b, out_dtype=torch.bfloat16)
    assert sqnr(reference(a, b), routed.double()) > 40  # bf16 output rounding only
    assert sqnr(direct.double(), routed.double()) > 40


# ---------------------------------------------------------------------------- MX


def mx_operand(hp: torch.Tensor, dim: int, role=GemmRole.INPUT):
    return cast_to_float8(hp, MX.cast_config_input, role, dim, MX)


def test_mx_kernel_plan_rules():
    bf16 = torch.bfloat16
    assert mx_kernel_plan(256, 384, "output") == KernelPlan(0, bf16)
    # grad_weight's K is the token count: a partial last 32-block is zero-padded
    assert mx_kernel_plan(74, 256, "grad_weight") == KernelPlan(22, bf16)
    assert mx_kernel_plan(1, 256, "grad_weight") == KernelPlan(31, bf16)
    assert mx_kernel_plan(96, 256, "grad_weight") == KernelPlan(0, bf16)
    # N (a layer dim) must be a multiple of 16: named as the gemm's dim, with the fix
    with pytest.raises(ValueError, match=r"out_features \(here 40\).*16 in the output gemm.*hp"):
        mx_kernel_plan(256, 40, "output")
    with pytest.raises(ValueError, match=r"in_features \(here 40\).*16 in the grad_input gemm"):
        mx_kernel_plan(384, 40, "grad_input")
    with pytest.raises(ValueError, match=r"in_features \(here 40\).*16 in the grad_weight gemm"):
        mx_kernel_plan(74, 40, "grad_weight")
    with pytest.raises(ValueError, match=r"the output dim N \(here 8\) .*multiple of 16: "):
        mx_kernel_plan(64, 8)
    # K (a layer dim outside grad_weight) must be whole 32-blocks: 48 is aligned to 16 only
    with pytest.raises(ValueError, match=r"in_features \(here 48\).*32 in the output gemm.*hp"):
        mx_kernel_plan(48, 64, "output")
    with pytest.raises(ValueError, match=r"out_features \(here 48\).*32 in the grad_input gemm"):
        mx_kernel_plan(48, 64, "grad_input")
    with pytest.raises(ValueError, match=r"the inner dim K \(here 37\) .*multiple of 32: "):
        mx_kernel_plan(37, 64)


@pytest.mark.parametrize(
    "h, w", [(1, 1), (37, 3), (128, 4), (130, 9), (256, 8), (384, 3), (998, 12), (74, 8)]
)
def test_to_blocked_is_the_cublas_layout_and_torchao_bitwise(h, w):
    blocked_ao = pytest.importorskip("torchao.prototype.mx_formats.utils").to_blocked
    scale = torch.randint(0, 256, (h, w), dtype=torch.uint8)
    ours = to_blocked(scale)
    assert ours.dtype == torch.uint8 and ours.is_contiguous()
    assert ours.numel() == 128 * -(-h // 128) * 4 * -(-w // 4)
    assert torch.equal(ours, blocked_scale_reference(scale))  # the cuBLAS docs' formula
    assert torch.equal(ours, blocked_ao(scale).reshape(-1))  # the peer
    # a transposed (non-contiguous) scale, as B's scale is handed over, gives its values' layout
    assert torch.equal(to_blocked(scale.t().contiguous().t()), ours)


@pytest.mark.parametrize(
    "gemm_name, m, k, n", [("output", 37, 256, 384), ("grad_weight", 384, 74, 160)]
)
def test_mx_kernel_operands_are_the_operands_bytes_in_the_kernel_layout(gemm_name, m, k, n):
    # what mx_scaled_mm hands torch._scaled_mm on CUDA, computed here on real CPU bytes: the
    # blocked scales decoded with the cuBLAS docs' formula and the (padded) data give back the
    # operands' values exactly, with zeros (scale or data) in every padding position
    a = mx_operand(torch.randn(m, k) * 4.0 ** torch.randint(-8, 8, (m, 1)), 1)
    b = mx_operand(torch.randn(n, k), 1, GemmRole.WEIGHT).t()  # (K, N), MX along K = dim 0
    a_data, b_data, scale_a, scale_b = mx_kernel_operands(a, b, gemm_name)
    kp = -(-k // 32) * 32
    assert a_data.shape == (m, kp) and a_data.stride() == (kp, 1)  # row-major
    assert b_data.shape == (kp, n) and b_data.stride() == (1, kp)  # column-major
    assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
    a_bytes, b_bytes = scale_a.view(torch.uint8), scale_b.view(torch.uint8)
    assert torch.equal(a_bytes, blocked_scale_reference(a._scale))
    assert torch.equal(b_bytes, blocked_scale_reference(b._scale.t()))
    kb = kp // 32
    sa = a_bytes[blocked_scale_index(m, kb)]  # (M, K / 32)
    sb = b_bytes[blocked_scale_index(n, kb)].t()  # (K / 32, N)
    assert a_bytes.count_nonzero() == sa.count_nonzero()  # padding bytes are zero
    assert b_bytes.count_nonzero() == sb.count_nonzero()
    descale = 2.0 ** (torch.arange(256, dtype=torch.float64) - 127)
    a_vals = a_data.to(torch.float64) * descale[sa.long()].repeat_interleave(32, dim=1)
    b_vals = b_data.to(torch.float64) * descale[sb.long()].repeat_interleave(32, dim=0)
    assert torch.equal(a_vals[:, :k], a.dequantize(torch.float64))
    assert torch.equal(b_vals[:k], b.dequantize(torch.float64))
    assert not a_vals[:, k:].any() and not b_vals[k:].any()
    # and the CPU path (dequantize, fp32 mm) is that product
    out = scaled_mm(a, b, out_dtype=torch.float32, gemm=gemm_name)
    assert sqnr(a_vals @ b_vals, out.double()) > 130


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_mx_gemm_on_cuda_checks_the_gpu_before_the_kernel(pretend_gpu, monkeypatch, capability):
    # an H200 (sm90) gets float8kit's error, not cuBLAS's NOT_SUPPORTED from the kernel; an
    # sm100 GPU gets the kernel call (spied: this machine has no GPU)
    pretend_gpu(capability)
    a, b = mx_operand(torch.randn(37, 64), 1), mx_operand(torch.randn(48, 64), 1).t()
    a._data, b._data = a._data.as_subclass(OnCuda), b._data.as_subclass(OnCuda)
    kernel_calls = []

    def kernel(a_data, b_data, scale_a, scale_b, out_dtype, use_fast_accum):
        kernel_calls.append((scale_a.dtype, out_dtype))
        return torch.zeros(a_data.shape[0], b_data.shape[1], dtype=out_dtype)

    monkeypatch.setattr(gemm, "_kernel", kernel)
    with count_scaled_mm() as scaled_mm_calls:
        if capability < (10, 0):
            with pytest.raises(RuntimeError) as e:
                scaled_mm(a, b, out_dtype=torch.float32)
            assert str(e.value) == (
                "float8kit: the mxfp8 recipe's MX gemms need an sm100 (Blackwell) GPU, CUDA "
                "capability >= 10.0; NVIDIA H200 (cuda:0) is sm90. Use a float8 recipe "
                "(tensorwise, rowwise, rowwise_with_gw_hp, delayed, blockwise) on this GPU, or "
                "Float8LinearConfig(emulate=True) to emulate MX in fp32"
            )
            assert kernel_calls == []
        else:
            out = scaled_mm(a, b, out_dtype=torch.float32)
            assert out.shape == (37, 48)
            assert kernel_calls == [(torch.float8_e8m0fnu, torch.bfloat16)]
    assert scaled_mm_calls == []
    # emulate=True needs no MX kernel, whatever the GPU: the fp32 definition, no kernel call
    emulated = gemm.mx_scaled_mm(a, b, emulate=True, out_dtype=torch.float32)
    assert sqnr(reference(a, b), emulated.double()) > 130
    assert len(kernel_calls) == (capability >= (10, 0))


def test_mx_scaled_mm_needs_both_operands_in_mx_blocks_along_k():
    x, w = torch.randn(64, 64), torch.randn(96, 64)  # M == K: a wrong dim has the right shape
    a, b = mx_operand(x, 1), mx_operand(w, 1, GemmRole.WEIGHT).t()
    assert sqnr(x @ w.t(), scaled_mm(a, b, out_dtype=torch.float32)) > 25
    a_wrong = mx_operand(x, 0)  # blocks along M
    b_wrong = mx_operand(w.t().contiguous(), 1, GemmRole.WEIGHT)  # (K, N) blocked along N
    tw = cast_to_float8(w, TW.cast_config_weight, GemmRole.WEIGHT, -1, TW).t()
    for left, right in ((a_wrong, b), (a, b_wrong), (a, tw), (tw.t(), b)):
        with pytest.raises(ValueError, match=r"an MX gemm needs both operands in MX blocks"):
            scaled_mm(left, right)
        with pytest.raises(ValueError, match=r"an MX gemm needs both operands in MX blocks"):
            mx_kernel_operands(left, right)
