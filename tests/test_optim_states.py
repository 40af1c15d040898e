"""float8kit.optim.states: each codec against its reference (torch's e4m3 cast, NVFP4's e2m1,
the nearest power of sqrt(2) in fp64), SQNR floors, and the property the optimizers' mesh
invariance rests on: a row's codes do not depend on the rows beside it or on where a shard
cuts."""

from __future__ import annotations

import math

import pytest
import torch

from float8kit.config import E4M3
from float8kit.formats import nvfp4
from float8kit.optim import states
from tests.helpers import sqnr

CODECS = [states.E4M3_CODEC, states.E4M3_ROOT, states.E2M1_CODEC, states.ROOT4]
BLOCK = 128


def _sample(rows=16, cols=300, signed=True, seed=0):
    """Rows of very different magnitudes (1e-6 .. 1e2), a partial last block (300 = 2 x 128
    + 44)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 2, rows)[:, None]
    return x if signed else x.abs()


def _block_scale(x, largest):
    amax = torch.nn.functional.pad(x.abs(), (0, -x.shape[1] % BLOCK))
    amax = amax.reshape(x.shape[0], -1, BLOCK).amax(-1) / largest
    return amax.repeat_interleave(BLOCK, dim=1)[:, : x.shape[1]]


def _round_trip(x, codec):
    codes, scale = states.quantize(x, codec, BLOCK)
    return states.dequantize(codes, scale, codec, BLOCK, x.shape[1])


def test_e4m3_is_torchs_cast_per_block():
    x = _sample()
    scale = _block_scale(x, 448.0)
    ref = (x / scale).to(E4M3).float() * scale
    assert torch.equal(_round_trip(x, states.E4M3_CODEC), ref)


def test_e2m1_is_nvfp4s_element_per_block():
    x = _sample()
    scale = _block_scale(x, 6.0)
    ref = nvfp4.decode(nvfp4.round_nearest(x / scale)) * scale
    assert torch.equal(_round_trip(x, states.E2M1_CODEC), ref)


def test_e4m3_root_never_rounds_a_positive_value_to_zero():
    x = _sample(signed=False)
    x[:, 7] = 0.0
    x[:, 9] = x[:, 9] * 1e-9  # far below e4m3's smallest subnormal of the block
    back = _round_trip(x, states.E4M3_ROOT)
    scale = _block_scale(x, 448.0)
    assert torch.equal(back[:, 7], torch.zeros(16))
    assert torch.equal(back[:, 9], 2.0**-9 * scale[:, 9])
    others = torch.ones(300, dtype=torch.bool)
    others[9] = False
    ref = (x / scale).to(E4M3).float() * scale
    assert torch.equal(back[:, others], ref[:, others])


def test_root4_is_the_nearest_power_of_sqrt2_in_log_scale():
    x = _sample(signed=False)
    back = _round_trip(x, states.ROOT4)
    r = (x / _block_scale(x, 1.0)).double()
    grid = torch.tensor([2.0 ** (-k / 2) for k in range(16)], dtype=torch.float64)
    nearest = grid[(r.clamp_min(1e-300).log2()[..., None] - grid.log2()).abs().argmin(-1)]
    ref = nearest.float() * _block_scale(x, 1.0)
    assert torch.equal(back, ref)
    assert (back > 0).all()  # zero-free: the smallest code is 2**-7.5 of the block's amax


def test_root4_codes_at_the_midpoints_go_up():
    # the rule on fp32: code k = 15 - (midpoints 2**(-(j + 1/2)/2), in fp32, at or below r);
    # every midpoint, the fp32 numbers either side, the codes, zero, NaN and subnormals
    mids = torch.tensor([2.0 ** (-(j + 0.5) / 2) for j in range(15)][::-1])
    r = torch.cat([
        mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1.0)),
        torch.tensor([2.0 ** (-k / 2) for k in range(16)]), torch.rand(100_000) ** 16,
        torch.tensor([0.0, -0.0, 1.0, 1e-45, 1e-39, float("nan")]),
    ])  # fmt: skip
    want = 15 - torch.bucketize(r, mids, right=True)
    assert torch.equal(states.ROOT4.encode(r), want.to(torch.uint8))


@pytest.mark.parametrize(
    "codec, floor",
    [(states.E4M3_CODEC, 30.0), (states.E4M3_ROOT, 30.0), (states.E2M1_CODEC, 15.0),
     (states.ROOT4, 13.0)],
)  # fmt: skip
def test_sqnr_floor(codec, floor):
    x = _sample(signed=codec.name != "e4m3 root" and codec is not states.ROOT4)
    assert sqnr(x, _round_trip(x, codec)) >= floor


@pytest.mark.parametrize("codec", CODECS)
def test_zero_blocks_decode_to_zero_and_nonfinite_blocks_stay_nonfinite(codec):
    x = _sample(rows=4, signed=False)
    x[0] = 0.0
    x[1, 3] = math.nan
    x[2, 200] = math.inf
    back = _round_trip(x, codec)
    assert torch.equal(back[0], torch.zeros(300))
    assert back[1, :BLOCK].isnan().all()  # its whole block
    assert not torch.isfinite(back[2, BLOCK : 2 * BLOCK]).any()
    assert torch.isfinite(back[1, BLOCK:]).all() and torch.isfinite(back[3]).all()


@pytest.mark.parametrize("codec", CODECS)
def test_codes_do_not_depend_on_where_a_shard_cuts(codec):
    """Rows split at uneven cuts (and an empty piece), encoded apart, give the codes and
    scales of the whole: odd lengths put elements in vectorized loops' scalar tails."""
    x = _sample(rows=37, cols=1043)
    codes, scale = states.quantize(x, codec, BLOCK)
    pieces = [states.quantize(x[a:b], codec, BLOCK) for a, b in [(0, 13), (13, 13), (13, 37)]]
    assert torch.equal(torch.cat([c for c, _ in pieces]), codes)
    assert torch.equal(torch.cat([s for _, s in pieces]), scale)
    back = states.dequantize(codes[5:6], scale[5:6], codec, BLOCK, 1043)
    assert torch.equal(back, states.dequantize(codes, scale, codec, BLOCK, 1043)[5:6])


@pytest.mark.parametrize("codec", CODECS)
def test_bytes(codec):
    codes, scale = states.quantize(_sample(rows=2, cols=1024), codec, BLOCK)
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32
    assert codes.shape == (2, 1024 * codec.bits // 8) and scale.shape == (2, 8)
