"""FSDP2 float8 all-gather on 2-D meshes: FSDP2 x tensor parallel (dp, tp) and HSDP
(replicate, shard), for every recipe that all-gathers weights in float8, on real gloo ranks.

A tiny model whose norm stays dp-only (not TP-sharded) and whose two Float8Linear layers are
TP-sharded colwise and rowwise (torch's styles) trains 3 AdamW steps with
``precompute_scales`` on each mesh, with and without float8 all-gather: the losses must be
equal (the float8 all-gather casts every shard with the scale of the whole weight, over
every mesh dim it is sharded on, so the gathered weight is the one the hp all-gather would
be cast to). On the same meshes: the dp all-gather's bytes against the bf16 all-gather,
exactly one collective in ``precompute_scales`` and no extra one in forward/backward, and a
tensorwise weight's precomputed scale against the whole weight's amax.
Meshes (4 ranks): 2x2 (dp, tp), 2x2 HSDP, and 1x2 (dp, tp) sub-meshes of half the ranks.
"""

from __future__ import annotations

import pytest

from benchmarks.measures.fsdp_mesh import RECIPES
from benchmarks.measures.gloo import (
    _rel_diff,
    spawn,
)


@pytest.fixture(scope="module")
def mesh4(tmp_path_factory):
    return spawn("benchmarks.measures.fsdp_mesh:_worker_mesh", 4, tmp_path_factory.mktemp("mesh4"))


def _check_mesh(results: list[dict], name: str) -> None:
    for recipe in RECIPES:
        for r in results:
            hp, fp8 = r[name, recipe, False], r[name, recipe, True]
            diff = _rel_diff(fp8, hp)
            print(f"{name} {recipe}: float8 vs hp all-gather losses rel diff {diff:.1e}")
            assert diff <= 1e-5, (name, recipe, fp8, hp)
            # one collective in precompute_scales (none where nothing needs one: a static
            # weight with dynamic input and grad_output), none added to forward and backward
            # (nor for blockwise weights whose shards hold whole blocks: one dp rank)
            expected = 0 if recipe == "static" or (recipe, name) == ("blockwise", "1x2") else 1
            assert r[name, recipe, True, "precompute_all_reduces"] == expected
            extra = r[name, recipe, True, "fwd_bwd_all_reduces"]
            assert extra == r[name, recipe, False, "fwd_bwd_all_reduces"]
        fp8_bytes = results[0][name, recipe, True, "all_gather_bytes"]
        bf16_bytes = results[0][name, "tensorwise", False, "all_gather_bytes"]
        if name == "1x2":  # a dp mesh of one rank gathers nothing
            assert fp8_bytes == bf16_bytes == 0
            continue
        ratio = fp8_bytes / bf16_bytes
        print(f"{name} {recipe}: dp all-gather bytes float8 / bf16 = {ratio:.3f}")
        assert ratio <= 0.55
    assert all(r[name, "whole_weight_scales"] for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["2x2", "hsdp", "1x2"])
def test_float8_all_gather_equals_hp_all_gather(mesh4, name):
    _check_mesh(mesh4, name)
