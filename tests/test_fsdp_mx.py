"""FSDP2 float8 all-gather of MX (mxfp8) weights (MX's rule in float8kit/formats/mx.py): on real
gloo ranks (2, 3), losses and gradients bitwise the hp all-gather, the gathered copies
bitwise the one-device casts (along K in forward, along N in backward, blocks cut by shard
boundaries included), bytes per collective and per pass against bf16, the along-N copy
gathered by the grad_input gemm without a backward re-gather (reshard_after_forward=False),
activation checkpointing; in one process, the pass the hook sees, the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.measures.fsdp_mx import LAYERS, MX, MX_AG, mx_net
from benchmarks.measures.gloo import _bitwise, spawn
from float8kit import E5M2, CastConfig, Float8LinearConfig, GemmRole, ScalingGranularity
from float8kit.cast import cast_to_float8
from float8kit.formats import MX as MXGran
from float8kit.formats.mx import cut_blocks


@pytest.fixture(scope="module")
def mx_ranks(request, tmp_path_factory):
    world = request.param  # indirect: the tests name their rank counts
    name = "benchmarks.measures.fsdp_mx:_worker_mx"
    return world, spawn(name, world, tmp_path_factory.mktemp(f"mx{world}"))


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
def test_mx_float8_all_gather_trains_bitwise_like_the_hp_all_gather(mx_ranks):
    world, results = mx_ranks
    # uneven shards on 3 ranks (608 and 32 rows), blocks cut by shard boundaries on both
    expected = {2: [304, 96, 16], 3: [[203, 64, 11], [203, 64, 11], [202, 64, 10]]}[world]
    for rank, r in enumerate(results):
        assert r["local_rows"] == (expected if world == 2 else expected[rank])
        print(f"{world} ranks, rank {rank}: losses {r['losses_fp8']} (hp all-gather: same)")
        assert _bitwise(r["losses_fp8"], r["losses_hp"])
        assert r["grads_bitwise"] == [True] * len(LAYERS)


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
def test_each_pass_gathers_the_copy_its_gemm_needs_bitwise_the_one_device_cast(mx_ranks):
    world, results = mx_ranks
    assert any(cut_blocks(n, world) for _, n in LAYERS)  # some blocks are cut
    for r in results:
        assert r["forward_copies"] == ["mx(dim=1, 1x32)"] * len(LAYERS)  # along K
        assert r["backward_copies"] == ["mx(dim=0, 1x32)"] * len(LAYERS)  # along N
        assert r["forward_bitwise"] == [True] * len(LAYERS)
        assert r["backward_bitwise"] == [True] * len(LAYERS)


# Half-precision weights at the edges of their range, across a cut block (3 ranks): the value
# a cut block's padding row carries must keep its byte in the weight's dtype. Near the max
# (17 rows): fp8_max * 2 ** (byte - 127) is beyond bf16's and fp16's max there. Subnormal
# fp16 (near 1e-7): rounded to nearest, it went up a byte.
EDGES = {
    "near_max": ("bfloat16", "float16", "floor_bfloat16"),
    "subnormal": ("float16_tiny", "floor_float16_tiny"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
@pytest.mark.parametrize("edge", EDGES)
def test_copies_bitwise_for_half_precision_weights_at_the_edges_of_their_range(mx_ranks, edge):
    _, results = mx_ranks
    for r in results:
        for name in EDGES[edge]:
            assert r[f"{name}_bitwise"] == [True] * (2 * len(LAYERS)), name


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
def test_nan_and_inf_in_a_cut_block_stay_visible_like_one_device(mx_ranks):
    # a NaN on one side of a cut block (3 ranks) makes the whole block's byte 255 on every
    # rank (the all-reduced bytes), an inf likewise its byte: bitwise the one-device cast
    _, results = mx_ranks
    for r in results:
        for name in ("non_finite", "floor_non_finite"):
            assert r[f"{name}_bitwise"] == [True] * (2 * len(LAYERS)), name
            assert r[f"{name}_nan_block"] == 255


def _expected_bytes(world: int) -> dict[str, list[tuple[str, int]]]:
    """Per layer, in each pass's order: the collectives' bytes the design says. Forward: the
    hook's all-gather of the along-K scales (padded rows x ceil(K / 32)), then FSDP2's of
    the fp8 bytes (padded rows x K). Backward (last layer first): the all-reduce of the cut
    blocks' bytes (K each, only where blocks are cut), the along-N scales (ceil(chunk / 32)
    block rows per rank x K), the fp8 bytes."""
    fwd, bwd = [], []
    for k, n in LAYERS:
        chunk = -(-n // world)
        fwd += [("all_gather_single", world * chunk * (k // 32))]
        fwd += [("all_gather_single", world * chunk * k)]
    for k, n in reversed(LAYERS):
        chunk = -(-n // world)
        if cut_blocks(n, world):
            bwd += [("all_reduce", len(cut_blocks(n, world)) * k)]
        bwd += [("all_gather_single", world * -(-chunk // 32) * k)]
        bwd += [("all_gather_single", world * chunk * k)]
    return {"forward": fwd, "backward": bwd}


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
def test_mx_all_gather_bytes_per_collective_and_pass(mx_ranks):
    world, results = mx_ranks
    r = results[0]
    assert r["calls_fp8"] == _expected_bytes(world)
    for when in ("forward", "backward"):
        fp8 = sum(r["bytes_fp8"][when].values())
        bf16 = sum(r["bytes_bf16"][when].values())
        ratio = fp8 / bf16
        print(f"{world} ranks, {when}: MX / bf16 bytes {fp8} / {bf16} = {ratio:.4f}")
        # 1 byte per element + 1 per 32 (1.03125 / 2 = 0.5156) plus block-row padding and
        # the cut blocks' bytes; one copy per pass, never both (that would be > 1.03)
        assert 0.5156 <= ratio <= 0.52


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
def test_without_a_backward_re_gather_the_grad_input_gemm_gathers_its_copy(mx_ranks):
    # reshard_after_forward=False: FSDP2 gathers nothing in backward (bf16: 0 bytes); the
    # along-N copy is gathered by the grad_input gemm, the same bytes as FSDP2's re-gather
    # would be, never the along-K copy re-cast
    world, results = mx_ranks
    r = results[0]
    assert r["no_reshard_bytes_bf16"]["backward"] == 0
    for when in ("forward", "backward"):
        assert r["no_reshard_bytes_fp8"][when] == sum(r["bytes_fp8"][when].values())
    for r in results:
        assert _bitwise(r["no_reshard_losses_fp8"], r["losses_hp"])


@pytest.mark.slow
@pytest.mark.parametrize("mx_ranks", [2, 3], indirect=True)
def test_activation_checkpointing_recomputes_with_the_along_k_copy(mx_ranks):
    # A checkpoint-wrapped layer recomputes its forward after FSDP2's along-N re-gather: its
    # output gemm gathers the along-K copy (backward moves both copies' bytes), and training
    # is bitwise the hp all-gather's (with and without checkpointing)
    world, results = mx_ranks
    r = results[0]
    fwd, bwd = (sum(r["bytes_fp8"][w].values()) for w in ("forward", "backward"))
    assert r["ac_bytes_fp8"] == {"forward": fwd, "backward": fwd + bwd}
    for r in results:
        assert _bitwise(r["ac_losses_fp8"], r["ac_losses_hp"])
        assert _bitwise(r["ac_losses_fp8"], r["losses_hp"])


def test_an_mx_weight_blocked_along_k_is_never_re_cast_for_grad_input():
    # not an FSDP2 all-gather weight: no shards to gather the along-N copy from
    from float8kit.linear import _Float8Matmul, plan_of

    w = mx_net(MX)[0].weight.detach()
    fp8 = cast_to_float8(w, MX.cast_config_weight, GemmRole.WEIGHT, -1, MX)
    x = torch.randn(32, w.shape[1], requires_grad=True)
    out = _Float8Matmul.apply(x, fp8, plan_of(MX).index)
    with pytest.raises(RuntimeError, match=r"grad_input gemm needs the weight as mx\(dim=0"):
        out.sum().backward()


class _OneRank:
    def size(self) -> int:
        return 1


def test_hook_casts_along_k_in_forward_and_along_n_in_backward():
    # One rank: the hook's pass signal (the autograd engine running) picks the copy.
    module = mx_net(MX_AG)[0]
    hp = module.weight._tensor
    w = module.weight.data

    def gather():
        data, meta = w.fsdp_pre_all_gather(_OneRank(), hp.shape, (hp.shape[1], 1), module, None)
        weight, _ = w.fsdp_post_all_gather(data, meta, torch.float32)
        return weight

    got = {"forward": gather()}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            got["backward"] = gather()
            return g

    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    for when, dim in (("forward", -1), ("backward", 0)):
        cast = MX.cast_config_weight if dim == -1 else MX.cast_config_weight_for_grad_input
        want = cast_to_float8(hp, cast, GemmRole.WEIGHT, dim, MX)
        assert got[when]._gran == want._gran == MXGran(dim % 2)
        assert torch.equal(got[when]._data.view(torch.uint8), want._data.view(torch.uint8))
        assert torch.equal(got[when]._scale, want._scale)
    # a re-gather turns FSDP2's out tensor into the pass's copy in place
    data, meta = w.fsdp_pre_all_gather(_OneRank(), hp.shape, (hp.shape[1], 1), module, None)
    out = got["backward"]
    assert w.fsdp_post_all_gather(data, meta, torch.float32, out=out) is None
    assert out._gran == MXGran(1) and out._scale.shape == (hp.shape[0], hp.shape[1] // 32)


def test_cut_blocks():
    assert cut_blocks(608, 2) == [9] and cut_blocks(608, 3) == [6, 12]
    assert cut_blocks(192, 3) == [] and cut_blocks(640, 2) == []
    assert cut_blocks(32, 3) == [0]  # two boundaries (11, 22) in one block
    assert cut_blocks(64, 1) == []


def test_mx_strided_keeps_the_blocks_of_the_first_rows():
    scale = torch.arange(12, dtype=torch.uint8).reshape(3, 4)  # 96 x 4 data, along dim 0
    assert torch.equal(MXGran(0).strided(scale, 96, 2), scale)
    assert torch.equal(MXGran(0).strided(scale, 40, 2), scale[:2])
    assert MXGran(0).strided(scale, None, 2) is None


def test_config_refuses_mx_all_gathers_it_cannot_serve_naming_the_field():
    mx = CastConfig(scaling_granularity=ScalingGranularity.MX)
    assert MX_AG.enable_fsdp_float8_all_gather  # the mxfp8 recipe is accepted
    with pytest.raises(ValueError, match="cast_config_weight_for_grad_input") as e:
        Float8LinearConfig(
            cast_config_input=mx,
            cast_config_weight=mx,
            cast_config_grad_output=CastConfig(),
            cast_config_weight_for_grad_input=CastConfig(),
            cast_config_input_for_grad_weight=mx,
            cast_config_grad_output_for_grad_weight=mx,
            enable_fsdp_float8_all_gather=True,
        )
    assert "enable_fsdp_float8_all_gather=False" in str(e.value)
    with pytest.raises(ValueError, match="float8 dtype of cast_config_weight_for_grad_input"):
        dataclasses.replace(
            MX_AG,
            cast_config_weight_for_grad_input=dataclasses.replace(mx, target_dtype=E5M2),
        )
    # the same configs without the float8 all-gather are valid: the refusals are its own
    dataclasses.replace(
        MX,
        cast_config_weight_for_grad_input=dataclasses.replace(mx, target_dtype=E5M2),
    )
    dataclasses.replace(
        MX,
        cast_config_grad_output=CastConfig(),
        cast_config_weight_for_grad_input=CastConfig(),
    )
