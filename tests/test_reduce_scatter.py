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
import torch.distributed as dist
from torch import nn

from benchmarks.measures.gloo import (
    spawn,
)
from benchmarks.measures.qgz import _grad_sqnr
from float8kit import (
    E4M3,
    E5M2,
    BlockwiseGranularity,
    CastConfig,
    Float8LinearConfig,
    Float8ReduceScatterConfig,
    enable_float8_reduce_scatter,
)
from float8kit.distributed.reduce_scatter import dequantize_sum, payload_bytes, quantize_chunks
from tests.helpers import sqnr

# ---------------------------------------------------------------------------- in-process


def _rs(dtype=None, block_size: int = 128, **kwargs) -> Float8ReduceScatterConfig:
    """A qgZ config sending ``dtype`` (default e4m3) in blocks of ``block_size``."""
    cast = CastConfig(scaling_granularity=BlockwiseGranularity(block_size), target_dtype=dtype)
    return Float8ReduceScatterConfig(cast, **kwargs)


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
        got = _exchange(inputs, _rs(dtype))
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
    config = _rs(dtype)
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
    small = _rs(block_size=blocks)
    assert payload_bytes(chunk, small) == chunk // blocks * (blocks + 4)
    assert sqnr(ref, _exchange(inputs, small)) >= fp32_scales - 1


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_power_of_2_scales_keep_gradients_near_fp32_max_finite(dtype):
    # A block whose amax is near fp32's max: the floored scale (2^-120 for e4m3) let 3.4e38
    # round up to 2^128 = inf on arrival. Now finite, within the format's rounding error.
    world, chunk = 2, 512
    top = torch.finfo(torch.float32).max
    inputs = [torch.randn(world * chunk) * 1e-3 for _ in range(world)]
    big = torch.tensor([3e38, -3.3e38, 3.4e38, top, -top, 2.9e38, 1.5e38, 1e38])
    for r, at in enumerate((5, chunk + 7)):  # one block on each destination, from rank r
        inputs[r][at : at + len(big)] = big
        inputs[r][at + 128 : at + 128 + len(big)] = big / 7  # not the block's amax
    got = _exchange(inputs, _rs(dtype, round_scales_to_power_of_2=True))
    assert torch.isfinite(got).all(), got[~torch.isfinite(got)]
    ref = sum(x.double() for x in inputs)
    half_ulp = 2.0 ** -(4 if dtype == E4M3 else 3)
    large = ref.abs() > 1e30
    rel = ((got.double() - ref).abs() / ref.abs())[large]
    assert large.sum() == 4 * len(big) and rel.max() <= half_ulp * (1 + 2**-20), rel.max()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _rs(torch.bfloat16), "CastConfig.target_dtype"),
        (lambda: _rs(block_size=0), "BlockwiseGranularity.block_size"),
        (lambda: _rs(block_size=128.0), "BlockwiseGranularity.block_size"),
        (lambda: Float8ReduceScatterConfig(CastConfig()), "Float8ReduceScatterConfig.cast_config"),
        (lambda: Float8ReduceScatterConfig(round_scales_to_power_of_2=1), "round_scales_to_power"),
    ],
)
def test_config_errors_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("field", ["dtype", "block_size"])
def test_030_fields_name_their_replacement(field):
    with pytest.raises(TypeError, match=rf"\({field}=...\) is 0.3's: it is now cast_config's"):
        Float8ReduceScatterConfig(**{field: 1})


def test_config_composes_the_cast_config():
    config = _rs(E5M2, block_size=64)
    assert (config.dtype, config.block_size) == (E5M2, 64)
    assert Float8ReduceScatterConfig().dtype == torch.float8_e4m3fn
    assert Float8ReduceScatterConfig().block_size == 128


def test_reduce_ops_fsdp2_passes():
    from float8kit.distributed.reduce_scatter import _op_factor

    assert _op_factor(dist.ReduceOp.SUM, 3) == 1.0
    assert _op_factor(dist.ReduceOp.AVG, 4) == 0.25
    premul = dist._make_nccl_premul_sum(0.125)
    if hasattr(premul, "factor"):
        assert _op_factor(premul, 3) == 0.125
    else:  # torch 2.11: the factor is not readable from Python; the module's divide factor
        assert _op_factor(premul, 3, divide_factor=8.0) == 0.125
        with pytest.raises(ValueError, match="no FSDP2 module to read"):
            _op_factor(premul, 3)
    with pytest.raises(ValueError, match="SUM, AVG and PREMUL_SUM"):
        _op_factor(dist.ReduceOp.MAX, 2)


def test_enable_without_fully_shard_raises_naming_the_fix():
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="call fully_shard on the blocks and the root first"):
        enable_float8_reduce_scatter(model)
    with pytest.raises(TypeError, match="Float8ReduceScatterConfig"):
        enable_float8_reduce_scatter(model, config=Float8LinearConfig())


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def qgz_ranks(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"qgz{world}")
    return world, spawn("benchmarks.measures.qgz:_worker_qgz", world, tmp)[0]


@pytest.mark.slow
def test_bytes_sent_under_030x_of_fp32_reduce_scatter(qgz_ranks):
    world, r = qgz_ranks
    if world == 3:
        assert r["shard_rows"] == [347, 6, 1]  # rank 0's rows; rank 2 holds an empty shard
    default, fp8 = r["fp32"]["default"]["bytes"], r["fp32"]["float8"]["bytes"]
    assert default["all_to_all_single"] == 0 and fp8["reduce_scatter_single"] == 0
    ratio = fp8["all_to_all_single"] / default["reduce_scatter_single"]
    bf16 = r["bf16"]["default"]["bytes"]["reduce_scatter_single"]
    print(f"{world} ranks: float8 / fp32 reduce-scatter bytes {ratio:.3f}")
    assert 0.25 <= ratio <= 0.30
    # bf16 reduce dtype: float8 sends the same bytes, about half of the bf16 reduce-scatter.
    assert r["bf16"]["float8"]["bytes"]["all_to_all_single"] == fp8["all_to_all_single"]
    assert fp8["all_to_all_single"] / bf16 <= 0.6


@pytest.mark.slow
def test_first_step_gradients_and_late_losses_match_default(qgz_ranks):
    world, r = qgz_ranks
    losses = {k: r["fp32"][k]["losses"] for k in ("default", "float8")}
    late = {k: sum(v[15:20]) / 5 for k, v in losses.items()}
    gap = late["float8"] / late["default"] - 1
    print(f"{world} ranks: grad SQNR {_grad_sqnr(r['fp32']):.1f} dB, loss gap {gap:+.2%}")
    assert _grad_sqnr(r["fp32"]) >= 25
    assert abs(gap) <= 0.02
    assert losses["float8"][0] == losses["default"][0]  # the same forward


@pytest.mark.slow
@pytest.mark.parametrize("qgz_ranks", [2], indirect=True, ids=["2ranks"])
def test_compiled_layer_gives_the_eager_gradients_bitwise(qgz_ranks):
    # FSDP2 runs its post-backward (and so the reduce-scatter) outside the compiled graph.
    world, r = qgz_ranks
    eager, compiled = r["fp32"]["float8"], r["compiled"]
    assert r["graph_breaks"] == 0
    assert compiled["losses"] == eager["losses"][:3]
    for a, b in zip(compiled["grads"], eager["grads"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("qgz_ranks", [2], indirect=True, ids=["2ranks"])
def test_enable_on_a_partly_sharded_model_or_twice_with_another_config_raises(qgz_ranks):
    errors = qgz_ranks[1]["errors"]
    assert "only modules inside it are FSDP2 modules" in errors["unsharded_root"]
    assert "fully_shard(model)" in errors["unsharded_root"]
    assert "already enabled" in errors["other_config"]
    assert "float8_e5m2" in errors["other_config"]


@pytest.mark.slow
def test_e4m3_beats_e5m2_on_real_gradients(qgz_ranks):
    world, r = qgz_ranks
    e4m3, e5m2 = _grad_sqnr(r["fp32"]), _grad_sqnr(r["e5m2"])
    print(f"{world} ranks: first-step grad SQNR e4m3 {e4m3:.1f} dB, e5m2 {e5m2:.1f} dB")
    assert e4m3 - e5m2 >= 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        "bf16",
        "fp8_all_gather",
        "divide_by_1",
        "hsdp",
        "rowwise",
        "rowwise_with_gw_hp",
        "delayed",
        "blockwise",
    ],
)
def test_every_setup_keeps_gradients(qgz_ranks, variant):
    world, r = qgz_ranks
    db = _grad_sqnr(r[variant])
    print(f"{world} ranks, {variant}: first-step grad SQNR {db:.1f} dB")
    assert db >= 25
    if variant == "divide_by_1":  # a sum, not a mean, for both reduce-scatters
        ref, got = r["fp32"]["default"]["grads"][0], r[variant]["float8"]["grads"][0]
        assert sqnr(ref * world, got) >= 25


def test_train_flag_without_fsdp_is_refused(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import train

    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--out", str(tmp_path), "--float8-reduce-scatter"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--float8-reduce-scatter changes FSDP2's" in err and "at least 2 data-parallel" in err
