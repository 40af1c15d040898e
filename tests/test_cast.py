"""float8kit/cast.py's one-pass tensorwise cast (``float8kit::cast_tensorwise``): its
reference is the cast float8kit always did (``to_fp8_saturated``) byte for byte, in every
layout, with the amax a DELAYED cast records; the op compiles opaque (``fullgraph``) and
bitwise eager. Its CUDA kernel is checked against the reference on the GPU
(tests/test_gpu.py) and in Triton's interpreter (tests/test_fake_cuda.py)."""

from __future__ import annotations

import math

import pytest
import torch

from float8kit import CastConfig, Float8LinearConfig, ScalingType, cast, scaling
from float8kit.config import E4M3, E5M2, GemmRole

SHAPES = [(37, 70), (1, 64), (64, 1), (128, 256)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def sample(shape, dtype=torch.bfloat16, seed=0, non_finite=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 40
    if non_finite and x.numel() >= 4:
        flat = x.view(-1)
        flat[0], flat[1], flat[2], flat[3] = math.inf, -math.inf, math.nan, 1e6
    return x.to(dtype)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("guard", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_is_the_saturated_cast_in_both_layouts(fp8, guard, shape):
    x = sample(shape)
    scale = torch.tensor(3.7)
    want = cast.to_fp8_saturated(x, scale, fp8, guard_non_finite=guard)
    row, col, amax = cast.cast_tensorwise_reference(x, scale, fp8, guard, True, True, True)
    assert torch.equal(bits(row), bits(want))
    assert col.shape == (shape[1], shape[0]) and col.is_contiguous()
    assert torch.equal(bits(col), bits(want.t().contiguous()))
    assert amax.dtype == torch.float32 and amax.shape == ()
    assert math.isnan(amax.item())  # a NaN in the tensor: the record sees it
    finite = sample(shape, non_finite=False)
    _, _, amax = cast.cast_tensorwise_reference(finite, scale, fp8, guard, False, False, True)
    assert amax.item() == finite.float().abs().max().item()


def test_reference_keeps_non_finite_values_visible():
    x = torch.tensor([[math.inf, -math.inf, math.nan, 1e30]])
    one = torch.tensor(1.0)
    row, _, _ = cast.cast_tensorwise_reference(x, one, E4M3, True, True, False, False)
    assert row.float()[0, :3].isnan().all() and row.float()[0, 3].item() == 448.0
    row, _, _ = cast.cast_tensorwise_reference(x, one, E5M2, True, True, False, False)
    assert row.float()[0, 0].item() == math.inf and row.float()[0, 1].item() == -math.inf
    assert row.float()[0, 2].isnan() and row.float()[0, 3].item() == 57344.0


def test_outputs_not_asked_for_are_empty_and_empty_input_has_amax_zero():
    x = torch.zeros(0, 16, dtype=torch.bfloat16)
    row, col, amax = cast.cast_tensorwise_reference(
        x, torch.tensor(1.0), E4M3, True, True, True, True
    )
    assert row.shape == (0, 16) and col.shape == (16, 0) and amax.item() == 0.0
    y = sample((8, 16))
    row, col, amax = torch.ops.float8kit.cast_tensorwise(
        y, torch.tensor(1.0), E4M3, True, False, True, False
    )
    assert row.numel() == 0 and amax.numel() == 0 and col.shape == (16, 8)


def test_op_compiles_opaque_and_bitwise_eager():
    x = sample((96, 160))
    scale = torch.tensor(2.5)

    def f(x, scale):
        row, col, amax = torch.ops.float8kit.cast_tensorwise(x, scale, E4M3, True, True, True, True)
        return row.view(torch.uint8) + 0, col.view(torch.uint8) + 0, amax

    torch._dynamo.reset()
    eager = f(x, scale)
    compiled = torch.compile(f, fullgraph=True)(x, scale)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])
    assert eager[1].shape == (160, 96) and torch.equal(eager[1], eager[0].t())
    assert eager[2].isnan() and compiled[2].isnan()  # the NaN in the tensor reaches the amax
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["dynamic", "delayed", "static"])
@pytest.mark.parametrize("role", [GemmRole.INPUT, GemmRole.GRAD_OUTPUT])
def test_cast_to_float8_both_layouts_is_one_cast_and_records_the_amax(kind, role):
    """``cast_to_float8(col=True)``: the two tensors hold the bytes the single-layout cast
    makes; a DELAYED cast with its scale set records max|x| from the same pass, as the
    separate reduction did (``scaling.recorded_amax``)."""
    config = Float8LinearConfig()
    x = sample((48, 80), non_finite=False)
    stype = {"dynamic": ScalingType.DYNAMIC, "delayed": ScalingType.DELAYED}.get(
        kind, ScalingType.STATIC
    )
    cfg = CastConfig(scaling_type=stype, static_scale=0.5 if kind == "static" else None)
    state = (None, None, False)
    if kind != "dynamic":
        record = torch.zeros(()) if kind == "delayed" else None
        state = (torch.tensor(0.75), record, kind == "delayed")
    single = cast.cast_to_float8(x, cfg, role, -1, config, *state)
    if kind == "delayed":
        assert state[1].item() == scaling.recorded_amax(x).float().item()
        state = (state[0], torch.full((), 1e-3), True)
    row, col = cast.cast_to_float8(x, cfg, role, -1, config, *state, col=True)
    if kind == "delayed":
        assert state[1].item() == x.float().abs().max().item()
    assert torch.equal(bits(row._data), bits(single._data))
    assert not col._data.is_contiguous() and col._data.t().is_contiguous()
    assert torch.equal(bits(col._data.contiguous()), bits(single._data))
    assert torch.equal(row._scale, col._scale)
