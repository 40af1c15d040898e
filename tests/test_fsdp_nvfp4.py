"""FSDP2 float8 all-gather of NVFP4 weights (NVFP4's rule in float8kit/formats/nvfp4.py): on real
gloo ranks (2, 3), losses and gradients bitwise the hp all-gather, the gathered weight
bitwise the one-device cast in forward and backward (16x16 blocks cut by shard boundaries,
uneven shards, a NaN and an inf on both sides of a boundary), the bytes per pass against
bf16's: a quarter on even shards (packed codes), between a quarter and a half on uneven
ones; in one process, the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from benchmarks.measures.fsdp_nvfp4 import LAYERS, NV_AG
from benchmarks.measures.gloo import _bitwise, spawn
from float8kit import Float8Linear, convert_to_float8_training, nvfp4_config
from float8kit.formats.nvfp4 import packs


@pytest.fixture(scope="module")
def nv_ranks(request, tmp_path_factory):
    world = request.param
    name = "benchmarks.measures.fsdp_nvfp4:_worker_nvfp4"
    return world, spawn(name, world, tmp_path_factory.mktemp(f"nv{world}"))


@pytest.mark.slow
@pytest.mark.parametrize("nv_ranks", [2, 3], indirect=True)
def test_nvfp4_all_gather_trains_bitwise_like_the_hp_all_gather(nv_ranks):
    world, results = nv_ranks
    expected = {2: [[304, 96, 16]] * 2, 3: [[203, 64, 11], [203, 64, 11], [202, 64, 10]]}[world]
    for rank, r in enumerate(results):
        assert r["local_rows"] == expected[rank]
        assert _bitwise(r["losses_fp4"], r["losses_hp"]), (r["losses_fp4"], r["losses_hp"])
        assert r["grads_bitwise"] == [True] * len(LAYERS)
        assert r["forward_bitwise"] == r["backward_bitwise"] == [True] * len(LAYERS)
        assert r["non_finite_bitwise"] == [True] * 2 * len(LAYERS)
        assert r["non_finite_output_nan"]


@pytest.mark.slow
@pytest.mark.parametrize("nv_ranks", [2, 3], indirect=True)
def test_nvfp4_all_gather_bytes_per_pass(nv_ranks):
    world, results = nv_ranks
    r = results[0]
    # gathered bytes: FSDP2's padded rows, codes two per byte where the shards are even
    chunk_rows = [-(-n // world) * world for _, n in LAYERS]
    padded = sum(
        rows * k // (2 if packs(n, world) else 1)
        for (k, n), rows in zip(LAYERS, chunk_rows, strict=True)
    )
    bf16 = sum(rows * k * 2 for (k, _), rows in zip(LAYERS, chunk_rows, strict=True))
    if world == 2:  # even shards, no padding: exactly half a byte per weight element
        assert padded == sum(n * k for k, n in LAYERS) // 2
    for p in ("forward", "backward"):
        assert r["bytes_fp4"][p]["all_gather_single"] == padded
        assert r["bytes_bf16"][p]["all_gather_single"] == bf16
    # the scales, without precompute_scales: one all-reduce of each weight's block-amax grid
    # and NaN flags in forward; the backward re-gather reuses the forward's scale
    grids = sum(2 * -(-n // 16) * -(-k // 16) * 4 for k, n in LAYERS)
    assert r["bytes_fp4"]["forward"]["all_reduce"] == grids
    assert r["bytes_fp4"]["backward"]["all_reduce"] == 0
    # with precompute_scales after the optimizer step: the same grids in its one all-reduce,
    # and none in the next step's hooks
    assert r["precompute_all_reduce"] == {"calls": 1, "bytes": grids}
    assert r["next_step_all_reduce_calls"] == 0
    ratio = r["bytes_fp4"]["forward"]["all_gather_single"] / bf16
    assert ratio == 0.25 if world == 2 else 0.25 < ratio < 0.5


def test_odd_in_features_are_refused_by_name():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # conversion refuses it first, naming the field (NVFP4 needs multiples of 32) ...
    with pytest.raises(ValueError, match=r"\(in_features=33\) cannot run NVFP4 gemms"):
        convert_to_float8_training(
            nn.Sequential(nn.Linear(33, 64, bias=False)),
            config=NV_AG,
            module_filter_fn=lambda m, f: True,
        )
    # ... and a layer built directly still meets the hook's own check
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        linear = Float8Linear.from_float(nn.Linear(33, 64, bias=False), config=NV_AG)
        net = nn.Sequential(linear)
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match=r"in_features, which must be even \(here 33\)"):
            net(torch.randn(4, 33))
    finally:
        dist.destroy_process_group()
    assert packs(608, 2) and not packs(608, 3)
    assert NV_AG == dataclasses.replace(nvfp4_config(), enable_fsdp_float8_all_gather=True)
