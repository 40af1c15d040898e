import math

import pytest
import torch

from benchmarks.measures.numerics import correctly_rounded_scales, one_ulp_off_share, random_amaxes
from float8kit import E4M3, E5M2
from float8kit.cast import to_fp8_saturated
from float8kit.scaling import (
    amax,
    amax_floor,
    amax_to_scale,
    fp8_max,
    round_to_power_of_2,
    row_constants,
)
from tests.helpers import sqnr


def test_fp8_max():
    assert (fp8_max(E4M3), fp8_max(E5M2)) == (448.0, 57344.0)


def test_amax_tensorwise_and_axiswise():
    x = torch.tensor([[1.0, -5.0, 2.0], [-0.5, 0.25, 3.0]], dtype=torch.bfloat16)
    assert amax(x).item() == 5.0 and amax(x).dtype == torch.float32
    assert amax(x, -1).flatten().tolist() == [5.0, 3.0]
    assert amax(x, 0).flatten().tolist() == [1.0, 5.0, 3.0]
    assert amax(x, -1).shape == (2, 1) and amax(x, 0).shape == (1, 3)


def test_amax_to_scale_hand_cases():
    assert amax_to_scale(torch.tensor(2.0), E4M3).item() == 224.0
    assert amax_to_scale(torch.tensor(7.0), E5M2).item() == pytest.approx(57344.0 / 7.0)
    zero_scale = amax_to_scale(torch.tensor(0.0), E4M3).item()
    assert zero_scale == (torch.tensor(448.0) / amax_floor(E4M3)).item()
    assert math.isfinite(zero_scale)
    assert amax_to_scale(torch.tensor(3.0), E4M3, round_to_pow2=True).item() == 128.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_amax_to_scale_is_correctly_rounded(dtype, compiled):
    amaxes = random_amaxes()
    to_scale = torch.compile(amax_to_scale, fullgraph=True) if compiled else amax_to_scale
    got = to_scale(amaxes, dtype)
    want = correctly_rounded_scales(amaxes, dtype)
    wrong = (got != want).sum().item()
    assert wrong == 0, f"{wrong} of {len(amaxes)} scales are not correctly rounded"
    # the test has teeth: the two-rounding form misses about a quarter of them
    assert one_ulp_off_share(amaxes, dtype) > 0.2
    # power-of-2 rounding floors the correctly rounded scale, as before, except near fp32's
    # max (the 3e38 edge), where a floored scale would dequantize to inf: the quotient stays
    near_max = amaxes > fp8_max(dtype) * 2.0 ** (119 if dtype == E4M3 else 112)
    assert near_max.sum() == 1
    want_pow2 = torch.where(near_max, want, round_to_power_of_2(want))
    assert torch.equal(to_scale(amaxes, dtype, True), want_pow2)


@pytest.mark.parametrize("pow2", [False, True])
def test_rows_of_several_dtypes_get_each_dtypes_own_scale(pow2):
    """``row_constants``: one batch of amaxes, rows alternately e4m3 and e5m2 (a delayed
    layer's input, weight and grad_output in one precompute group): every scale is bitwise
    the one its dtype's scalar form gives, edges included (0, below the floor, fp32's max
    region, inf, NaN)."""
    edges = torch.tensor([0.0, 1e-45, 1e-30, 3.0, 448.0, 3.0e38, math.inf, math.nan])
    amaxes = torch.cat([random_amaxes(), edges])
    dtypes = [(E4M3, E5M2)[i % 2] for i in range(len(amaxes))]
    got = amax_to_scale(amaxes, row_constants(dtypes, amaxes.device), pow2)
    for dtype in (E4M3, E5M2):
        rows = torch.tensor([d == dtype for d in dtypes])
        want = amax_to_scale(amaxes[rows], dtype, pow2)
        assert torch.equal(got[rows].view(torch.int32), want.view(torch.int32)), dtype
    assert not torch.equal(amax_to_scale(amaxes, E4M3, pow2), got)  # the dtypes differ


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_power_of_2_scales_never_turn_a_finite_value_into_inf(dtype):
    # Every fp32 amax from 2^126 to fp32's max (1 in 16), and the max itself: its pow2
    # scale's cast comes back finite and within the format's rounding error (half an ulp of
    # its 3 or 2 mantissa bits). The floored scale 2^-120 sent 3.4e38 back as inf.
    top = torch.tensor(torch.finfo(torch.float32).max)
    start = torch.tensor(2.0**126).view(torch.int32).item()
    bits = torch.arange(start, top.view(torch.int32).item(), 16, dtype=torch.int32)
    values = torch.cat([bits.view(torch.float32), top[None], torch.tensor([3e38, 3.4e38])])
    scale = amax_to_scale(values, dtype, round_to_pow2=True)
    back = to_fp8_saturated(values, scale, dtype).float() / scale
    assert torch.isfinite(back).all(), values[~torch.isfinite(back)][:4]
    rel = ((back.double() - values.double()).abs() / values.double()).max().item()
    half_ulp = 2.0 ** -(4 if dtype == E4M3 else 3)
    assert rel <= half_ulp * (1 + 2**-20), rel
    # below the edge the scale is still a power of two
    low = values < fp8_max(dtype) * 2.0 ** (119 if dtype == E4M3 else 112)
    assert low.sum() > 0 and torch.equal(scale[low], round_to_power_of_2(scale[low]))


def test_round_to_power_of_2():
    s = torch.tensor([3.0, 224.0, 0.75, 4.0, 1e-30, 0.0, math.inf, math.nan])
    out = round_to_power_of_2(s)
    assert out[:6].tolist() == [2.0, 128.0, 0.5, 4.0, 2.0 ** math.floor(math.log2(1e-30)), 0.0]
    assert math.isinf(out[6]) and math.isnan(out[7])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_zeros_give_finite_scale_and_zeros(dtype, pow2):
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    for scale in (amax_to_scale(amax(x), dtype, pow2), amax_to_scale(amax(x, -1), dtype, pow2)):
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert torch.equal(to_fp8_saturated(x, scale, dtype).float(), torch.zeros(8, 16))


def test_amax_floor_is_the_smallest_amax_with_a_finite_scale():
    for dtype in (E4M3, E5M2):
        floor = torch.tensor(amax_floor(dtype))
        below = torch.nextafter(floor, torch.tensor(0.0))
        assert torch.isfinite(fp8_max(dtype) / floor)
        assert torch.isinf(fp8_max(dtype) / below)


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype, min_db", [(E4M3, 28.0), (E5M2, 22.0)])
def test_round_trip_sqnr_from_1e_minus_20_to_1e20(hp_dtype, dtype, min_db):
    # A fixed amax floor (1e-12 in 0.1.0) cast tensors of ~1e-20 to all zeros (SQNR 0 dB).
    base = torch.randn(128, 64, dtype=torch.float64)
    for exponent in range(-20, 21, 4):
        x = (base * 10.0**exponent).to(hp_dtype)
        for reduce_dim in (None, -1):
            scale = amax_to_scale(amax(x, reduce_dim), dtype)
            back = to_fp8_saturated(x, scale, dtype).double() / scale.double()
            got = sqnr(x, back)
            assert got >= min_db, f"1e{exponent}, reduce_dim={reduce_dim}: {got:.1f} dB"


def test_amax_of_an_empty_tensor_is_zero():
    x = torch.zeros(0, 16)
    assert amax(x).shape == () and amax(x).item() == 0.0
    assert torch.equal(amax(x, 0), torch.zeros(1, 16))  # reducing the empty dim
    assert amax(x, -1).shape == (0, 1)


def test_saturation_clamps_finite_overflow():
    x = torch.tensor([1.0, 2.0, -100.0, 100.0])
    out = to_fp8_saturated(x, torch.tensor(10.0), E4M3).float()
    assert out.tolist() == [10.0, 20.0, -448.0, 448.0]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_non_finite_values_stay_visible(dtype):
    x = torch.tensor([1.0, math.inf, -math.inf, math.nan])
    out = to_fp8_saturated(x, torch.tensor(1.0), dtype).float()
    assert out[0] == 1.0
    assert not torch.isfinite(out[1:]).any(), f"{dtype} saturated a non-finite value: {out}"
    # torch's own cast saturates inf to 448 in e4m3fn; ours must not.
    if dtype == E5M2:
        assert out[1:3].tolist() == [math.inf, -math.inf]
    # a dynamic scale from an inf amax is 0, so the whole cast goes non-finite rather than
    # quietly zeroing the other values' scale
    assert amax_to_scale(amax(x[:2]), dtype).item() == 0.0
    assert amax_to_scale(amax(x), dtype).isnan()


@pytest.mark.parametrize("dtype, min_db", [(E4M3, 28.0), (E5M2, 22.0)])
def test_round_trip_sqnr(dtype, min_db):
    x = torch.randn(256, 256, dtype=torch.float64)
    scale = amax_to_scale(amax(x), dtype)
    back = to_fp8_saturated(x, scale, dtype).double() / scale.double()
    assert sqnr(x, back) >= min_db


def test_compiled_scales_and_casts_are_bitwise_eager():
    # rows from 1e-20 to 1e20 and an all-zero row (scaled at the amax floor)
    magnitudes = 10.0 ** torch.linspace(-20, 20, 64)[:, None]
    x = (torch.randn(64, 48) * magnitudes).to(torch.bfloat16)
    x[0] = 0

    def cast(x):
        s_tw = amax_to_scale(amax(x), E4M3)
        s_rw = amax_to_scale(amax(x, -1), E4M3, round_to_pow2=True)
        return s_tw, s_rw, to_fp8_saturated(x, s_tw, E4M3), to_fp8_saturated(x, s_rw, E4M3)

    eager, compiled = cast(x), torch.compile(cast, fullgraph=True)(x)
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(
            e.view(torch.uint8) if e.element_size() == 1 else e,
            c.view(torch.uint8) if c.element_size() == 1 else c,
        )


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("reduce_dim", [None, -1])
@pytest.mark.parametrize("pow2", [False, True])
def test_dynamic_scale_needs_no_guard_to_keep_non_finite(dtype, reduce_dim, pow2):
    # linear.cast_to_float8 skips the guard pass for DYNAMIC scales: this is why that is safe.
    x = torch.randn(4, 8)
    x[1, 2], x[2, 3], x[3, 0] = math.inf, -math.inf, math.nan
    scale = amax_to_scale(amax(x, reduce_dim), dtype, round_to_pow2=pow2)
    out = to_fp8_saturated(x, scale, dtype, guard_non_finite=False).float()
    assert not torch.isfinite(out[~torch.isfinite(x)]).any()
    # and the guard-free cast has the guarded one's values (the guard's `+ 0` only turns
    # -0.0 into +0.0) and non-finite positions
    guarded = to_fp8_saturated(x, scale, dtype).float()
    unguarded = to_fp8_saturated(x, scale, dtype, guard_non_finite=False).float()
    finite = torch.isfinite(guarded)
    assert torch.equal(finite, torch.isfinite(unguarded))
    assert torch.equal(guarded[finite], unguarded[finite])
