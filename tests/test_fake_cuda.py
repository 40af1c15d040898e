"""Every CUDA code path of float8kit, traced without a GPU: tensors made under
``FakeTensorMode`` on device ``cuda`` (a CUDA build of torch imports without a GPU) take
float8kit's CUDA branches, and torch's meta functions run the CUDA kernels' shape, layout
and dtype checks (``torch._scaled_mm``, ``F.scaled_mm``, ``torch._scaled_grouped_mm``).

The autograd engine needs a real device, so the autograd Functions' ``forward`` and
``backward`` are called directly, with a stand-in ``ctx``. Covered: every recipe's three
gemms at awkward shapes (M = 0, 1, 37, 998; K, N at and off multiples of 16 and 128; fp32
and bf16 weights; autocast-style bf16 input with an fp32 weight), ``pad_inner_dim``, the
MoE grouped gemms with token counts and groups off multiples of 16 and an empty expert,
the FSDP2 float8 all-gather hooks on fake shards, and the low-bit optimizers' step.
``CALL_SITES`` lists the CUDA call sites; the last test asserts that each was reached. The
mxfp8 recipe's gemms are checked against torch's rules for MX scales (e8m0, cuBLAS's blocked
layout) and, on real CPU bytes, against the cuBLAS docs' layout formula.

Not traceable here: ``precompute_scales``' pinned-memory copy and CUDA event (a real device
only; ``pytest -m gpu``), and device-side rules that no meta function checks (grouped-gemm
group starts at multiples of 16: ``grouped_gemm.token_group_padding``, unit-tested on CPU).

Runs under ``make test-fake-cuda`` (the torch 2.11.0 CUDA wheel in a cached venv); skips
where torch is a CPU-only build.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from float8kit import (
    Float8ExpertsConfig,
    Float8Linear,
    Float8LinearConfig,
    formats,
    gemm,
)
from float8kit.config import GEMM_ROLES
from float8kit.experts import Float8ExpertWeight, _GroupedMM
from float8kit.linear import _Float8Matmul
from float8kit.quantized_rows import dispatched_rows, quantize_rows, rows_format
from tests.helpers import blocked_scale_reference, recipes

pytestmark = pytest.mark.skipif(
    not torch.backends.cuda.is_built(),
    reason=f"torch {torch.__version__} is a CPU-only build: the fake-CUDA lane needs a CUDA "
    "build (make test-fake-cuda installs the torch 2.11.0 CUDA wheel into a cached venv)",
)

RECIPES = recipes()  # every named recipe, from the format registry
TOKENS = [0, 1, 37, 998]
# (in_features K, out_features N, pad_inner_dim): aligned to 128, to 16 only, to nothing
SHAPES = [(256, 384, False), (48, 80, False), (40, 72, True)]
BLOCK_SHAPES = [(256, 384, False), (384, 128, False)]  # blockwise: whole 128x128 blocks
MX_SHAPES = [(256, 384, False), (96, 160, False)]  # MX: whole 32-blocks, not 128
# (weight dtype, input dtype): fp32, bf16, and autocast's bf16 input with an fp32 weight
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),
]

# The CUDA call sites of float8kit (gemm.py, grouped_gemm.py), as the recorder below names them.
CALL_SITES = {
    "scaled_mm:tensorwise",  # torch._scaled_mm, per-tensor scales
    "scaled_mm:rowwise",  # torch._scaled_mm, rowwise scales (fast-accum output gemm)
    "scaled_mm:post_scale",  # rowwise without fast accum: unit scales, then scaled
    "scaled_mm:pad_inner",  # zero-padded inner dim (pad_inner_dim, grad_weight's tokens)
    "scaled_mm:pad_out",  # zero-padded output dim (pad_inner_dim)
    "scaled_mm:fp32_out",  # tensorwise kernel writing fp32 (an fp32 grad_weight)
    "scaled_mm:mx",  # torch._scaled_mm, e8m0 scales in the blocked layout (mxfp8)
    "scaled_mm:mx_pad_inner",  # MX grad_weight: tokens padded to whole 32-blocks
    "scaled_mm:nvfp4",  # torch._scaled_mm, float4_e2m1fn_x2 with blocked e4m3 scales (nvfp4)
    "scaled_mm:nvfp4_pad_inner",  # NVFP4 grad_weight: tokens padded to a multiple of 32
    "block_scaled_mm:128x128",  # F.scaled_mm, 1x128 tiles x 128x128 blocks
    "block_scaled_mm:1x128",  # F.scaled_mm, 1x128 tiles x 128x1 tiles
    "scaled_grouped_mm:2d_3d",  # torch._scaled_grouped_mm, experts' output / grad_input
    "scaled_grouped_mm:2d_2d",  # torch._scaled_grouped_mm, experts' grad_weight
    "fsdp:pre_all_gather",  # Float8AllGatherWeight hooks on a CUDA shard
    "fsdp:post_all_gather",
    "fsdp_experts:pre_all_gather",  # Float8ExpertWeight hooks on a CUDA shard
    "fsdp_experts:post_all_gather",
}
HITS: collections.Counter = collections.Counter()


@pytest.fixture(autouse=True)
def record_cuda_calls(monkeypatch):
    """Count the CUDA kernel calls by kind, passing every call through to torch (whose
    meta functions check them)."""
    real_mm, real_block, real_grouped = torch._scaled_mm, F.scaled_mm, torch._scaled_grouped_mm
    # the MX and NVFP4 plans are their formats' (float8kit/formats/), called from there
    real_plan, real_mx_plan = gemm.kernel_plan, formats.mx.mx_kernel_plan
    real_fp4_plan = formats.nvfp4.nvfp4_kernel_plan

    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **kw):
        assert a.is_cuda
        if scale_a.dtype == torch.float8_e8m0fnu:
            HITS["scaled_mm:mx"] += 1
        elif a.dtype == torch.float4_e2m1fn_x2:
            HITS["scaled_mm:nvfp4"] += 1
        elif scale_a.numel() == 1 and scale_b.numel() == 1:
            HITS["scaled_mm:tensorwise"] += 1
        else:
            HITS["scaled_mm:rowwise"] += 1
        if out_dtype == torch.float32:
            HITS["scaled_mm:fp32_out"] += 1
        return real_mm(
            a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
            use_fast_accum=use_fast_accum, **kw,
        )  # fmt: skip

    def block(a, b, scale_a, recipe_a, scale_b, recipe_b, **kw):
        assert a.is_cuda
        HITS[f"block_scaled_mm:{recipe_b.name.removeprefix('BlockWise')}"] += 1
        return real_block(a, b, scale_a, recipe_a, scale_b, recipe_b, **kw)

    def grouped(a, b, *args, **kw):
        assert a.is_cuda
        HITS[f"scaled_grouped_mm:{a.dim()}d_{b.dim()}d"] += 1
        return real_grouped(a, b, *args, **kw)

    def plan(k, n, out_dtype, cuda, *rest):
        out = real_plan(k, n, out_dtype, cuda, *rest)
        if cuda:
            for field in ("post_scale", "pad_inner", "pad_out"):
                if getattr(out, field, None):
                    HITS[f"scaled_mm:{field}"] += 1
        return out

    def mx_plan(*args, **kw):
        out = real_mx_plan(*args, **kw)
        if out.pad_inner:
            HITS["scaled_mm:mx_pad_inner"] += 1
        return out

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(F, "scaled_mm", block)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", grouped)
    monkeypatch.setattr(gemm, "kernel_plan", plan)

    def fp4_plan(*args, **kw):
        out = real_fp4_plan(*args, **kw)
        if out.pad_inner:
            HITS["scaled_mm:nvfp4_pad_inner"] += 1
        return out

    monkeypatch.setattr(formats.mx, "mx_kernel_plan", mx_plan)
    monkeypatch.setattr(formats.nvfp4, "nvfp4_kernel_plan", fp4_plan)
    yield


class Ctx:
    """What ``forward``/``backward`` use of an autograd Function's ctx."""

    def __init__(self, n_inputs: int):
        self.needs_input_grad = (True, True) + (False,) * (n_inputs - 2)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def fake_cuda():
    return FakeTensorMode(allow_non_fake_inputs=False)


def layer_fwd_bwd(layer: Float8Linear, x: torch.Tensor, weight=None):
    """One forward and backward of ``layer`` through its autograd Function, as
    ``Float8Linear.forward`` calls it; checks the shapes and dtypes that come back."""
    weight = layer.weight if weight is None else weight
    states = tuple(t for role in GEMM_ROLES for t in layer.fp8_state.operand(layer, role, True))
    ctx = Ctx(8)  # the Function's inputs, as Float8Linear.forward passes them
    out = _Float8Matmul.forward(ctx, x, weight, layer._plan_index, states)
    assert out.shape == (x.shape[0], layer.out_features) and out.dtype == x.dtype
    assert out.device.type == "cuda"
    grad_in, grad_w, *_ = _Float8Matmul.backward(ctx, torch.randn_like(out))
    assert grad_in.shape == x.shape and grad_in.dtype == x.dtype
    assert grad_w.shape == layer.weight.shape and grad_w.dtype == layer.weight.dtype
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_traces_on_fake_cuda(recipe):
    shapes = {"blockwise": BLOCK_SHAPES, "mxfp8": MX_SHAPES, "nvfp4": MX_SHAPES}.get(recipe, SHAPES)
    for (k, n, pad), (w_dtype, x_dtype), m in itertools.product(shapes, DTYPES, TOKENS):
        config = Float8LinearConfig.from_recipe_name(recipe)
        if pad:
            config = dataclasses.replace(config, pad_inner_dim=True)
        with fake_cuda(), torch.device("cuda"):
            layer = Float8Linear(k, n, bias=False, config=config, dtype=w_dtype)
            x = torch.randn(m, k, dtype=x_dtype)
            try:
                layer_fwd_bwd(layer, x)
            except Exception as e:
                raise AssertionError(f"{recipe} M={m} K={k} N={n} {w_dtype}/{x_dtype}") from e


def test_unaligned_layer_without_pad_inner_dim_is_refused_by_name():
    with fake_cuda(), torch.device("cuda"):
        layer = Float8Linear(40, 64, bias=False)
        with pytest.raises(ValueError, match=r"in_features \(here 40\).*pad_inner_dim"):
            layer_fwd_bwd(layer, torch.randn(32, 40))


class Mesh1:
    """A one-rank shard mesh (the hooks' math does not depend on the process group)."""

    def size(self):
        return 1


# Every recipe with an FSDP2 float8 all-gather, but MX: its backward gemm needs the weight
# in the other block dim, which only FSDP2's backward re-gather provides (this harness runs
# the hooks once and feeds the forward's gather to both passes).
@pytest.mark.parametrize(
    "recipe", recipes(lambda caps: caps.fsdp_float8_all_gather and caps.gemm != "mx")
)
def test_fsdp_float8_all_gather_hooks_on_fake_cuda(recipe):
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=True
    )
    with fake_cuda(), torch.device("cuda"):
        layer = Float8Linear(256, 384, bias=False, config=config, dtype=torch.bfloat16)
        shard = layer.weight
        inputs, metadata = shard.fsdp_pre_all_gather(
            Mesh1(), shard.shape, shard.stride(), layer, None
        )
        HITS["fsdp:pre_all_gather"] += 1
        assert all(t.is_cuda and t.dtype == torch.uint8 for t in inputs)
        gathered, _ = shard.fsdp_post_all_gather(inputs, metadata, torch.bfloat16)
        HITS["fsdp:post_all_gather"] += 1
        assert gathered.shape == shard.shape
        layer_fwd_bwd(layer, torch.randn(37, 256, dtype=torch.bfloat16), weight=gathered)


# Token counts per expert (4 experts): off multiples of 16, an empty expert, all tokens in
# one expert, tokens past the last expert.
ROUTINGS = [[37, 0, 463, 37], [0, 0, 537, 0], [5, 16, 379, 30], [16, 16, 16, 16]]


def dispatched(hp: torch.Tensor, config: Float8ExpertsConfig) -> torch.Tensor:
    """``hp`` rows as expert parallelism delivers them: cast for the grouped gemm."""
    data, scale = quantize_rows(hp, config)
    return dispatched_rows(data, scale, hp.dtype, rows_format(config))


@pytest.mark.parametrize(
    "fsdp_gathered, rows",
    [(False, "hp"), (True, "hp"), (False, "dispatched")],
    ids=["hp", "fp8_all_gather", "ep_dispatched"],
)
def test_experts_grouped_gemms_on_fake_cuda(fsdp_gathered, rows):
    # rows="dispatched": the input and the grad_output arrive as expert parallelism's float8
    # rows (dispatched_rows), the weight gradient casts their dequantized values
    groups, dim, hidden = 4, 256, 512
    config = Float8ExpertsConfig(
        enable_fsdp_float8_all_gather=fsdp_gathered,
        wgrad_operands="dequantized" if rows == "dispatched" else "hp",
    )
    for counts in ROUTINGS:
        tokens = sum(counts) + (7 if counts[0] == 5 else 0)  # rows past offs[-1]
        with fake_cuda(), torch.device("cuda"):
            hp = torch.randn(groups, dim, hidden, dtype=torch.bfloat16)
            weight = Float8ExpertWeight(hp, config)
            if fsdp_gathered:
                inputs, metadata = weight.fsdp_pre_all_gather(
                    Mesh1(), weight.shape, weight.stride(), None, None
                )
                HITS["fsdp_experts:pre_all_gather"] += 1
                weight, _ = weight.fsdp_post_all_gather(inputs, metadata, torch.bfloat16)
                HITS["fsdp_experts:post_all_gather"] += 1
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
            x = torch.randn(tokens, dim, dtype=torch.bfloat16)
            ctx = Ctx(4)
            try:
                inp = dispatched(x, config) if rows == "dispatched" else x
                out = _GroupedMM.forward(ctx, inp, weight, offs, config)
                assert out.shape == (tokens, hidden) and out.dtype == torch.bfloat16
                go = torch.randn_like(out)
                go = dispatched(go, config) if rows == "dispatched" else go
                grad_x, grad_w, *_ = _GroupedMM.backward(ctx, go)
            except Exception as e:
                raise AssertionError(f"experts, tokens per expert {counts}") from e
            assert grad_x.shape == x.shape and grad_w.shape == hp.shape


# ---------------------------------------------------------------------------- MX


def mx_scale_bytes(rows: int, k: int) -> int:
    """torch 2.11's meta rule for an MX operand's scale (``is_blockwise_scaling`` with e8m0
    scales): 128 * ceil(rows / 128) * round_up(ceil(K / 32), 4) bytes, contiguous."""

    def ceil(x, y):
        return -(-x // y)

    return 128 * ceil(rows, 128) * 4 * ceil(ceil(k, 32), 4)


def record_kernel_calls(monkeypatch) -> list:
    calls, recorder = [], torch._scaled_mm  # the fixture's recorder, which passes on to torch

    def record(a, b, *, scale_a, scale_b, **kw):
        calls.append((a, b, scale_a, scale_b, kw))
        return recorder(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", record)
    return calls


@pytest.mark.parametrize("k, n", [(256, 384), (96, 160)])
def test_mxfp8_linear_gemms_meet_the_mx_kernel_rules(monkeypatch, k, n):
    calls = record_kernel_calls(monkeypatch)
    m = 2 * 37  # a (2, 37) batch of tokens: grad_weight's K, padded to 96
    with fake_cuda(), torch.device("cuda"):
        config = Float8LinearConfig.from_recipe_name("mxfp8")
        layer = Float8Linear(k, n, bias=False, config=config, dtype=torch.bfloat16)
        layer_fwd_bwd(layer, torch.randn(2, 37, k, dtype=torch.bfloat16).reshape(m, k))
    # output (M, K) @ (K, N), grad_input (M, N) @ (N, K), grad_weight (N, M->96) @ (M->96, K)
    want = [(m, k, n), (m, n, k), (n, 96, k)]
    assert [(a.shape[0], a.shape[1], b.shape[1]) for a, b, *_ in calls] == want
    for a, b, scale_a, scale_b, kw in calls:
        (rows, inner), cols = a.shape, b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and kw["out_dtype"] == torch.bfloat16
        assert a.stride() == (inner, 1) and b.stride() == (1, inner)  # A row-, B column-major
        assert inner % 32 == 0 and cols % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu
        assert scale_a.shape == (mx_scale_bytes(rows, inner),) and scale_a.is_contiguous()
        assert scale_b.shape == (mx_scale_bytes(cols, inner),) and scale_b.is_contiguous()


def test_torchs_meta_check_refuses_mx_scales_off_the_blocked_layout():
    # the rules above are live in this lane: torch 2.11's meta function refuses row-major
    # (unswizzled) e8m0 scales and an unpadded token dim
    e8m0, e4m3 = torch.float8_e8m0fnu, torch.float8_e4m3fn
    with fake_cuda(), torch.device("cuda"):
        a = torch.empty(37, 256, dtype=e4m3)
        b = torch.empty(384, 256, dtype=e4m3).t()
        good_a, good_b = torch.empty(1024, dtype=e8m0), torch.empty(3072, dtype=e8m0)
        assert gemm._kernel(a, b, good_a, good_b, torch.bfloat16, False).shape == (37, 384)
        with pytest.raises(RuntimeError, match="scale_a should have 1024 elements, got 296"):
            gemm._kernel(a, b, torch.empty(37 * 8, dtype=e8m0), good_b, torch.bfloat16, False)
        unpadded = torch.empty(384, 74, dtype=e4m3)  # grad_weight's K = 74 tokens, unpadded
        with pytest.raises(RuntimeError, match="divisible by 16"):
            gemm._kernel(
                unpadded,
                torch.empty(256, 74, dtype=e4m3).t(),
                torch.empty(3072, dtype=e8m0),
                torch.empty(1024, dtype=e8m0),
                torch.bfloat16,
                False,
            )


def test_mxfp8_kernel_scales_are_the_cublas_layout_of_the_real_bytes(monkeypatch):
    # fake tensors have no values: the three gemms of a real CPU mxfp8 layer (2 x 37 tokens,
    # bf16), through the CUDA path's operand preparation, against the cuBLAS docs' formula
    seen, real = [], gemm.mx_scaled_mm

    def capture(a, b, **kw):
        seen.append((a, b, kw["gemm"]))
        return real(a, b, **kw)

    monkeypatch.setattr(gemm, "mx_scaled_mm", capture)
    config = Float8LinearConfig.from_recipe_name("mxfp8")
    layer = Float8Linear(96, 160, bias=False, config=config, dtype=torch.bfloat16)

    def varied(*shape):  # magnitudes over 2^-16 .. 2^14: many distinct scale bytes
        return (torch.randn(*shape) * 4.0 ** torch.randint(-8, 8, shape)).to(torch.bfloat16)

    with torch.no_grad():
        layer.weight.copy_(varied(160, 96))
    x = varied(2, 37, 96).requires_grad_()
    layer(x).backward(varied(2, 37, 160))
    assert [g for *_, g in seen] == ["output", "grad_input", "grad_weight"]
    for a, b, name in seen:
        a_data, b_data, scale_a, scale_b = gemm.mx_kernel_operands(a, b, name)
        assert torch.equal(scale_a.view(torch.uint8), blocked_scale_reference(a._scale))
        assert torch.equal(scale_b.view(torch.uint8), blocked_scale_reference(b._scale.t()))
        k = a.shape[1]
        assert torch.equal(a_data[:, :k].view(torch.uint8), a._data.view(torch.uint8))
        assert torch.equal(b_data[:k].view(torch.uint8), b._data.view(torch.uint8))
        assert not a_data[:, k:].view(torch.uint8).any() and not b_data[k:].view(torch.uint8).any()
        assert len(a._scale.unique()) > 1  # real, varied bytes (not a constant)


def nvfp4_scale_bytes(rows: int, k: int) -> int:
    """torch 2.11's meta rule for an NVFP4 operand's e4m3 block scales: 128 * ceil(rows /
    128) * round_up(ceil(K / 16), 4) elements, contiguous."""
    blocks = -(-k // 16)
    return 128 * -(-rows // 128) * 4 * -(-blocks // 4)


@pytest.mark.parametrize("k, n", [(256, 384), (96, 160)])
def test_nvfp4_linear_gemms_meet_the_fp4_kernel_rules(monkeypatch, k, n):
    calls = record_kernel_calls(monkeypatch)
    m = 2 * 37  # grad_weight's K: 74 tokens, padded to 96
    with fake_cuda(), torch.device("cuda"):
        config = Float8LinearConfig.from_recipe_name("nvfp4")
        layer = Float8Linear(k, n, bias=False, config=config, dtype=torch.bfloat16)
        layer_fwd_bwd(layer, torch.randn(m, k, dtype=torch.bfloat16))
    want = [(m, k, n), (m, n, k), (n, 96, k)]  # unpacked K
    assert [(a.shape[0], 2 * a.shape[1], b.shape[1]) for a, b, *_ in calls] == want
    for a, b, scale_a, scale_b, kw in calls:
        (rows, packed), cols = a.shape, b.shape[1]
        assert a.dtype == b.dtype == torch.float4_e2m1fn_x2 and kw["out_dtype"] == torch.float32
        assert a.stride() == (packed, 1) and b.stride() == (1, packed)  # A row-, B column-major
        assert packed % 16 == 0 and cols % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float8_e4m3fn
        assert scale_a.shape == (nvfp4_scale_bytes(rows, 2 * packed),)
        assert scale_b.shape == (nvfp4_scale_bytes(cols, 2 * packed),)


def test_every_cuda_call_site_was_traced():
    # runs last in this file (pytest keeps definition order): the tests above filled HITS
    if not HITS:
        pytest.skip("run the whole file: the tests above trace the call sites")
    missing = sorted(CALL_SITES - set(HITS))
    assert not missing, f"CUDA call sites never traced: {missing}; traced: {dict(HITS)}"
    unknown = sorted(set(HITS) - CALL_SITES)
    assert not unknown, f"CUDA call sites missing from CALL_SITES: {unknown}"


@pytest.mark.parametrize("rows", ["hp", "dispatched"], ids=["hp", "ep_dispatched"])
def test_mx_experts_grouped_gemms_on_fake_cuda(monkeypatch, rows):
    # MXFP8 experts: all three grouped gemms reach torch._scaled_grouped_mm with e8m0 scales
    # that pass torch's meta checks (2-D per-group blocked scales, 3-D per-expert
    # (G, round_up(K / 32, 4) * round_up(N, 128))), token groups off multiples of 32, an
    # empty expert, rows past the last expert
    from float8kit.experts import _GroupedMM

    seen = []
    inner = torch._scaled_grouped_mm

    def grouped(a, b, scale_a, scale_b, **kw):
        seen.append((a.dim(), b.dim(), scale_a.dtype, scale_b.dtype, tuple(scale_b.shape)))
        return inner(a, b, scale_a, scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", grouped)
    groups, dim, hidden = 4, 256, 512
    config = Float8ExpertsConfig.from_recipe_name("mxfp8")
    if rows == "dispatched":
        config = dataclasses.replace(config, wgrad_operands="dequantized")
    e8m0 = torch.float8_e8m0fnu
    for counts in ROUTINGS:
        seen.clear()
        tokens = sum(counts) + (7 if counts[0] == 5 else 0)  # rows past offs[-1]
        with fake_cuda(), torch.device("cuda"):
            weight = Float8ExpertWeight(torch.randn(groups, dim, hidden), config)
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
            x = torch.randn(tokens, dim, dtype=torch.bfloat16)
            ctx = Ctx(4)
            try:
                inp = dispatched(x, config) if rows == "dispatched" else x
                out = _GroupedMM.forward(ctx, inp, weight, offs, config)
                go = torch.randn_like(out)
                go = dispatched(go, config) if rows == "dispatched" else go
                grad_x, grad_w, *_ = _GroupedMM.backward(ctx, go)
            except Exception as e:
                raise AssertionError(f"MX experts, tokens per expert {counts}") from e
            assert out.shape == (tokens, hidden) and out.dtype == torch.bfloat16
            assert grad_x.shape == x.shape and grad_x.dtype == torch.bfloat16
            assert grad_w.shape == weight.shape and grad_w.dtype == torch.float32
        assert seen == [
            (2, 3, e8m0, e8m0, (groups, (dim // 32) * hidden)),  # output: K = dim
            (2, 3, e8m0, e8m0, (groups, (hidden // 32) * dim)),  # grad_input: K = hidden
            (2, 2, e8m0, e8m0, seen[2][4]),  # grad_weight: per-group blocked along tokens
        ], counts


_INTERPRETED_CAST = r"""
import torch
from float8kit import cast, triton_cast

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
for fp8 in (E4M3, E5M2):
    for guard in (True, False):
        for shape in ((37, 70), (1, 64), (64, 1), (130, 200)):
            g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
            # float8 grid values over the scale 2: the conversion is exact (the interpreter
            # emulates float8 rounding, not the GPU's instruction: rounding is checked on a
            # GPU, tests/test_gpu.py); inf, NaN and saturation take the kernel's own bytes
            grid = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(fp8)
            x = (grid.float().nan_to_num(0.0, 0.0, 0.0) / 2).to(torch.bfloat16)
            flat = x.view(-1)
            flat[: min(5, flat.numel())] = torch.tensor(
                [float("inf"), -float("inf"), float("nan"), 1e9, -1e9][: min(5, flat.numel())]
            ).to(torch.bfloat16)
            scale = torch.tensor(2.0)
            limit = torch.finfo(fp8).max
            for row, col, amax in ((True, True, True), (False, True, False), (True, False, True)):
                got = triton_cast.cast_tensorwise(x, scale, fp8, guard, row, col, amax, limit)
                want = cast.cast_tensorwise_reference(x, scale, fp8, guard, row, col, amax)
                for a, b in zip(got[:2], want[:2]):
                    same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    assert a.shape == b.shape and same, (fp8, guard, shape)
                if amax:
                    assert got[2].isnan() and want[2].isnan()
                    clean = x.float().nan_to_num(0.0, 0.0, 0.0)
                    args = (clean, scale, fp8, guard, False, False, True, limit)
                    _, _, a = triton_cast.cast_tensorwise(*args)
                    assert a.item() == clean.abs().max().item()
print("ok")
"""


def test_one_pass_cast_kernel_in_tritons_interpreter():
    """float8kit::cast_tensorwise's CUDA kernel (float8kit/triton_cast.py), run by Triton's
    interpreter on CPU tensors: both layouts (masks at tile edges: shapes off multiples of
    64, a single row and a single column), the amax, inf/NaN bytes and saturation equal the
    reference byte for byte."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_CAST],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_bit_optimizers_step_on_fake_cuda(monkeypatch, dtype):
    """AdamW8bit / AdamW4bit's step on CUDA parameters: quantized states (a partial block,
    row chunks of 5 rows and a remainder) and fp32 ones (the bias); every state on the
    parameter's device in its own dtype, the step count on the host."""
    from float8kit.optim import AdamW4bit, AdamW8bit, adamw

    monkeypatch.setattr(adamw, "CHUNK_ELEMENTS", 5 * 300)
    for cls, code_cols in ((AdamW8bit, 300), (AdamW4bit, 150)):
        with FakeTensorMode(allow_non_fake_inputs=True):
            w = torch.nn.Parameter(torch.randn(37, 300, device="cuda", dtype=dtype))
            b = torch.nn.Parameter(torch.randn(37, device="cuda", dtype=dtype))
            opt = cls([w, b], min_quantized_numel=0)
            for _ in range(2):
                w.grad, b.grad = torch.randn_like(w), torch.randn_like(b)
                opt.step()
        layout = {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in opt.state[w].items()}
        assert layout == {
            "step": ((), torch.float32, "cpu"),
            "exp_avg": ((37, code_cols), torch.uint8, "cuda"),
            "exp_avg_scale": ((37, 3), torch.float32, "cuda"),
            "exp_avg_sq_root": ((37, code_cols), torch.uint8, "cuda"),
            "exp_avg_sq_root_scale": ((37, 3), torch.float32, "cuda"),
        }, cls
        assert opt.state[b]["exp_avg_sq"].dtype == torch.float32
        assert w.dtype == dtype and w.device.type == "cuda"


def test_experts_hp_weight_gradient_outside_bf16_warns_on_cuda():
    """The hp weight gradient of MoE experts (wgrad_with_hp): bf16 is torch's grouped
    kernel; fp32 on CUDA takes one matmul per expert after a host sync, which it says."""
    from float8kit.grouped_gemm import hp_grad_weight

    with FakeTensorMode(allow_non_fake_inputs=True):
        offs = torch.tensor([16, 48, 64], device="cuda", dtype=torch.int32)
        x, go = torch.randn(64, 32, device="cuda"), torch.randn(64, 48, device="cuda")
        with pytest.warns(UserWarning, match=r"float32 on CUDA .* torch.autocast"):
            out = hp_grad_weight(x, go, offs)
        assert out.shape == (3, 32, 48) and out.dtype == torch.float32
        bf16 = hp_grad_weight(x.bfloat16(), go.bfloat16(), offs)  # the kernel: no warning
        assert bf16.shape == (3, 32, 48) and bf16.dtype == torch.bfloat16
