"""FSDP2 float8 all-gather of blockwise (128x128-block) weights, on real gloo ranks (2, 3, 4):
losses against single-device blockwise training, all-gathered bytes against the bf16
all-gather, no amax collective for block-aligned shards, and for shards that cut blocks the
straddling blocks' partial amaxes in precompute_scales' one all-reduce. Uses
tests/test_fsdp.py's launcher and helpers (one module-scoped spawn per rank count)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.measures.fsdp_blockwise import BLOCK, BLOCK_AG
from benchmarks.measures.gloo import (
    _bitwise,
    _rel_diff,
    spawn,
)


@pytest.fixture(scope="module")
def blockwise_ranks(request, tmp_path_factory):
    world = request.param  # indirect: the tests name their rank counts
    name = "benchmarks.measures.fsdp_blockwise:_worker_blockwise"
    return world, spawn(name, world, tmp_path_factory.mktemp(f"blockwise{world}"))


@pytest.mark.slow
@pytest.mark.parametrize("blockwise_ranks", [2, 3], indirect=True)
def test_blockwise_float8_all_gather_trains_like_one_device(blockwise_ranks):
    world, results = blockwise_ranks
    ref = results[0]["ref"]
    for r in results:
        assert r["local_rows"] == [256]  # hidden 256 x world rows, whole blocks per rank
        diff = _rel_diff(r["split"], ref)
        print(f"{world} ranks, blockwise float8 all-gather vs one device: rel diff {diff:.2e}")
        assert diff < 0.02
        # Same batch on every rank: the gathered weight is exactly the single-device cast.
        assert _bitwise(r["replicated"], ref)
        # Block scales are local to each shard: no amax collective, ever.
        assert r["precompute_all_reduces"] == 0 and r["fwd_bwd_all_reduces"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("blockwise_ranks", [2, 3], indirect=True)
def test_blockwise_all_gather_bytes_about_half_of_bf16(blockwise_ranks):
    world, results = blockwise_ranks
    r = results[0]
    ratio = r["all_gather_bytes_fp8"] / r["all_gather_bytes_bf16"]
    print(f"{world} ranks, blockwise fp8 / bf16 all-gathered bytes: {ratio:.3f}")
    assert ratio <= 0.55


@pytest.mark.slow
@pytest.mark.parametrize("blockwise_ranks", [3, 4], indirect=True)
def test_blockwise_shards_that_cut_blocks_train_like_one_device(blockwise_ranks):
    world, results = blockwise_ranks
    ref = results[0]["cut_ref"]
    for r in results:
        assert any(rows % 128 for rows in r["cut_local_rows"])  # shards that cut blocks
        diff = _rel_diff(r["cut_split"], ref)
        print(f"{world} ranks, blocks cut by shards, vs one device: rel diff {diff:.2e}")
        assert diff < 0.02
        assert _bitwise(r["cut_replicated"], ref)  # same batch: the one-device cast, bitwise
        # the straddling blocks' partial amaxes ride precompute_scales' one all-reduce
        assert r["cut_precompute_all_reduces"] == 1 and r["cut_fwd_bwd_all_reduces"] == 0


class _Ranks:
    """A stand-in for the FSDP mesh: the hooks only ask its size and this rank's index."""

    def __init__(self, n: int, rank: int = 0):
        self.n, self.rank = n, rank

    def size(self) -> int:
        return self.n

    def get_local_rank(self) -> int:
        return self.rank


def test_hooks_gather_a_partial_last_block_like_one_device_cast():
    # The two hooks on both shards of a 255-row weight over 2 "ranks" (128 + 127 rows: the
    # second shard is padded to 128 rows and one block row of scales), then FSDP2's
    # as_strided of the gathered buffer to 255 rows: bitwise the single-device cast.
    from float8kit import GemmRole
    from float8kit.cast import cast_to_float8
    from float8kit.linear import Float8Linear

    hp = torch.randn(255, 256)
    module = Float8Linear(256, 255, bias=False, config=BLOCK_AG)
    shards = []
    for rank, rows in enumerate((slice(0, 128), slice(128, 255))):
        w = type(module.weight)(hp[rows].clone(), BLOCK_AG)
        mesh = _Ranks(2, rank)
        (data, scale), meta = w.fsdp_pre_all_gather(mesh, hp.shape, (256, 1), module, None)
        assert data.shape == (128, 256) and scale.shape == (1, 2 * 4) and meta == ()
        shards.append((data, scale))
    gathered = [torch.cat(parts) for parts in zip(*shards, strict=True)]
    weight, inner = w.fsdp_post_all_gather(tuple(gathered), (), torch.bfloat16)
    assert len(inner) == 2 and weight._block == (128, 128)
    weight = torch.as_strided(weight, (255, 256), (256, 1), storage_offset=0)
    ref = cast_to_float8(hp, BLOCK.cast_config_weight, GemmRole.WEIGHT, -1, BLOCK)
    assert weight.shape == (255, 256) and weight.dtype == torch.bfloat16
    assert torch.equal(weight._data.view(torch.uint8), ref._data.view(torch.uint8))
    assert torch.equal(weight._scale, ref._scale)
    # Later all-gathers refill the buffers the weight views: nothing to rebuild.
    assert w.fsdp_post_all_gather(tuple(gathered), (), torch.bfloat16, out=weight) is None
