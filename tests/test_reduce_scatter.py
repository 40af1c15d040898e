"""qgZ float8 gradient reduce-scatter (float8kit/reduce_scatter.py).

In-process: the quantize -> exchange -> dequantize-sum path for N simulated ranks against an
fp64 sum (outliers, zeros, tiny values, inf/NaN), config and API errors. On real gloo ranks
(2 and 3, one spawn each): FSDP2 training with the float8 reduce-scatter against the same
run with FSDP2's default one (bytes sent, first-step gradient SQNR, late-step losses), across
reduce dtypes, recipes, float8 all-gather, divide factors and uneven/empty shards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from float8kit import (
    E4M3,
    E5M2,
    Float8LinearConfig,
    Float8ReduceScatterConfig,
    enable_float8_reduce_scatter,
)
from float8kit.reduce_scatter import dequantize_sum, payload_bytes, quantize_chunks
from tests.helpers import sqnr

# ---------------------------------------------------------------------------- in-process


def _exchange(inputs: list[torch.Tensor], config: Float8ReduceScatterConfig) -> torch.Tensor:
    """The float8 reduce-scatter of ``inputs`` (one flat tensor per simulated rank): each rank
    quantizes, the all-to-all hands rank r row r of every sender, r dequantizes and sums.
    Returns the concatenated outputs (the full reduced gradient)."""
    world = len(inputs)
    chunk = inputs[0].numel() // world
    sends = [quantize_chunks(x, world, config) for x in inputs]
    outs = [
        dequantize_sum(torch.stack([sends[s][r] for s in range(world)]), chunk, config)
        for r in range(world)
    ]
    return torch.cat(outs)


def TINY(chunk: int) -> slice:  # noqa: N802  (a constant that depends on the chunk)
    """Blocks 3-6 of the second chunk (block-aligned: a block mixing tiny and normal values
    flushes the tiny ones to zero, as any per-block scale must)."""
    return slice(chunk + 3 * 128, chunk + 7 * 128)


def _hard_gradients(world: int, chunk: int) -> list[torch.Tensor]:
    """Per-rank gradients with outliers, an all-zero stretch and a tiny-valued stretch."""
    g = torch.Generator().manual_seed(0)
    inputs = []
    for r in range(world):
        x = torch.randn(world * chunk, generator=g) * 1e-3
        x[17 + r] = 3.0  # outliers: one per rank, in the first chunk
        x[chunk : chunk + 300] = 0  # zeros on every rank
        x[TINY(chunk)] *= 1e-30  # tiny values, whole blocks of them
        inputs.append(x)
    return inputs


@pytest.mark.parametrize("world", [2, 3])
def test_dequantized_sum_against_fp64(world):
    chunk = 1000  # not a multiple of 128: every chunk ends with a padded block
    inputs = _hard_gradients(world, chunk)
    ref = sum(x.double() for x in inputs)
    result = {}
    for name, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
        got = _exchange(inputs, Float8ReduceScatterConfig(dtype=dtype))
        assert got.dtype == torch.float32 and got.shape == ref.shape
        tiny = TINY(chunk)
        result[name] = (sqnr(ref, got), sqnr(ref[tiny], got[tiny]))
        # zeros stay exactly zero; the outliers are their block's amax: exact
        assert torch.equal(got[chunk : chunk + 300], torch.zeros(300))
        bulk = slice(200, chunk)  # blocks without an outlier
        result[name] += (sqnr(ref[bulk], got[bulk]),)
    print(f"{world} ranks, SQNR (all, tiny, bulk) dB: {result}")
    e4m3, e5m2 = result["e4m3"], result["e5m2"]
    # Blockwise scales: tiny values keep the same relative precision as normal ones.
    assert min(e4m3) >= 28 and abs(e4m3[1] - e4m3[2]) < 3
    # e4m3's extra mantissa bit is worth ~6 dB over e5m2; blocks make e5m2's range useless.
    assert min(e5m2) >= 22 and e4m3[2] - e5m2[2] >= 4


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_nonfinite_gradients_stay_visible(dtype):
    world, chunk = 3, 512
    inputs = _hard_gradients(world, chunk)
    inputs[1][700] = float("inf")
    inputs[2][1300] = float("nan")
    inputs[0][100] = float("-inf")
    config = Float8ReduceScatterConfig(dtype=dtype)
    got = _exchange(inputs, config)
    ref = sum(x.double() for x in inputs)
    bad = ~torch.isfinite(ref)
    assert bad.sum() == 3
    # Every non-finite reference element is non-finite in the result (its whole block is).
    assert (~torch.isfinite(got[bad])).all()
    nonfinite_blocks = (~torch.isfinite(got)).view(world, chunk // 128, 128).all(-1)
    assert nonfinite_blocks.sum() == 3  # exactly the three blocks that held inf/NaN
    clean = torch.isfinite(got)
    assert sqnr(ref[clean], got[clean]) >= (28 if dtype == E4M3 else 22)
    # GradScaler's check: the sharded gradients hold a non-finite value.
    assert not torch.isfinite(got).all()


def test_bytes_per_element_and_power_of_2_scales():
    world, chunk = 2, 4096
    inputs = _hard_gradients(world, chunk)
    config = Float8ReduceScatterConfig()
    sent = quantize_chunks(inputs[0], world, config)
    assert sent.dtype == torch.uint8
    assert sent.numel() == world * payload_bytes(chunk, config) == world * 32 * (128 + 4)
    assert sent.numel() / (inputs[0].numel() * 4) == pytest.approx(0.2578, abs=1e-4)
    ref = sum(x.double() for x in inputs)
    fp32_scales = sqnr(ref, _exchange(inputs, config))
    pow2 = _exchange(inputs, Float8ReduceScatterConfig(round_scales_to_power_of_2=True))
    # Power-of-2 scales lose at most a few dB (up to half of e4m3's range goes unused).
    assert sqnr(ref, pow2) >= fp32_scales - 4
    blocks = 16
    small = Float8ReduceScatterConfig(block_size=blocks)
    assert payload_bytes(chunk, small) == chunk // blocks * (blocks + 4)
    assert sqnr(ref, _exchange(inputs, small)) >= fp32_scales - 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dtype": torch.bfloat16}, "Float8ReduceScatterConfig.dtype"),
        ({"block_size": 0}, "Float8ReduceScatterConfig.block_size"),
        ({"block_size": 128.0}, "Float8ReduceScatterConfig.block_size"),
        ({"round_scales_to_power_of_2": 1}, "round_scales_to_power_of_2"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8ReduceScatterConfig(**kwargs)


def test_enable_without_fully_shard_raises_naming_the_fix():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="call fully_shard on the blocks and the root first"):
        enable_float8_reduce_scatter(model)
    with pytest.raises(TypeError, match="Float8ReduceScatterConfig"):
        enable_float8_reduce_scatter(model, config=Float8LinearConfig())
