"""Expert parallelism at 8..256 ranks simulated in one process, and torchao 0.18's MXFP8
expert-parallel dispatch where its code runs on a CPU.

The simulation (benchmarks/measures/ep_simulated.py) runs float8kit's per-rank dispatch steps
(``expert_counts``, ``make_plan``, ``pack_rows``, ``unpack_rows``) for every virtual rank with
the two all-to-alls simulated, over routings with ranks without tokens, uneven token counts,
experts and ranks that receive nothing, top-k 1, 2 and 4, dims 64 and 128. Every rank's
received rows must be, bit for bit, the rows one rank holding every expert casts for those
experts (data, scales, group ends), for rowwise and MXFP8; each rank's experts' gemm on them
must give one rank's output rows; each rank's dispatch sends (K + 1) / 2K of the bf16 bytes
(rowwise, e8m0 scale byte) or (K + K/32) / 2K (MX).

torchao section: torchao's MXFP8 pipeline (``torchao.prototype.moe_training.ep``) sends the
same rows: its received and permuted data and scales equal float8kit's bit for bit, but for
its zero padding rows (groups padded to multiples of 32, an empty expert to 32 rows). Built
from its CPU parts: ``to_mx`` for the Triton quantizer, ``use_cpu=True`` for the Triton index
kernel. What stops its own functions on a CPU is asserted exactly, so the test fails the day
they run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from expecttest import assert_expected_inline

from benchmarks.measures import ep_simulated as sim
from float8kit import formats

CASES = {c.name: c for c in sim.CASES}
RECIPES = list(sim.CONFIGS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 4: torch.int32}[t.element_size()])


# ---------------------------------------------------------------------------- one rank's bits


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_receives_one_ranks_cast_of_its_experts_rows(case, recipe):
    world = sim.simulate(CASES[case], recipe)
    for r, rank in enumerate(world.ranks):
        got = rank.received
        want = formats.MX(1) if recipe == "mxfp8" else formats.Axiswise(1)
        assert got._gran == want, r
        assert got.dtype == torch.bfloat16 and got.shape == (len(rank.ref_data), world.case.dim)
        assert torch.equal(got._data.view(torch.uint8), rank.ref_data), r
        assert torch.equal(_bits(got._scale), _bits(rank.ref_scale)), r
        assert torch.equal(rank.plan.offs, rank.ref_offs), r
        assert rank.plan.num_received == len(rank.ref_data)
    if recipe == "rowwise":  # every rowwise scale survived its e8m0 byte (the zero row too)
        assert all(not torch.isnan(rk.received._scale).any() for rk in world.ranks)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", list(CASES))
def test_each_ranks_expert_gemm_on_received_rows_is_one_ranks_output(case, recipe):
    world = sim.simulate(CASES[case], recipe)
    for r, (mine, ref) in enumerate(sim.expert_gemm_rows(world)):
        assert torch.equal(mine.view(torch.int16), ref.view(torch.int16)), r


# ---------------------------------------------------------------------------- routing, bytes


def test_routing_tables_reach_the_edges():
    rows = [sim.summary(sim.simulate(c, "rowwise")) for c in sim.CASES]
    keys = ["world", "experts", "top_k", "dim", "tokens", "ranks_without_tokens"]
    keys += ["experts_without_rows", "rows_received_max", "rows_received_min"]
    keys += ["ranks_receiving_none"]
    table = "\n".join(" ".join(f"{r[k]:>4}" for k in keys) for r in rows)
    # world, experts, top-k, dim, tokens, ranks with no tokens, experts with no rows,
    # most/fewest rows a rank received, ranks that received none
    assert_expected_inline(
        table,
        """\
   8   16    2   64  310    2    0   88   66    0
   8    8    4  128  215    2    3  215    0    3
  16   32    1   64  402    4    9  279    0    4
  64  128    2   64 1441   10    0   57   30    0
  64   64    4  128  884    8   17  844    0   17
 256  256    1   64 1153   24   73  233    0   73
 256  256    4   64  706   20    0   21    3    0""",
    )


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_per_rank_against_bf16(case, recipe):
    c = CASES[case]
    world = sim.simulate(c, recipe)
    scale_bytes = 1 if recipe == "rowwise" else c.dim // 32  # e8m0 per row / per 32 along K
    for r, rank in enumerate(world.ranks):
        assert rank.rows_sent == c.tokens[r] * c.top_k
        assert rank.sent_bytes == rank.rows_sent * (c.dim + scale_bytes), r
    want = (c.dim + scale_bytes) / (2 * c.dim)  # 0.5078 (K 64), 0.5039 (K 128); MX 0.5156
    assert sim.summary(world)["ratio_per_rank"] == [want]


# ---------------------------------------------------------------------------- torchao 0.18


def _torchao_ep():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchao.prototype.moe_training.ep")


@pytest.mark.parametrize(
    "case", ["ep8_uniform_top2", "ep8_skewed_top4_dim128", "ep64_skewed_top4_dim128"]
)
def test_torchao_mxfp8_dispatch_sends_float8kits_rows(case):
    _torchao_ep()
    c = CASES[case]
    ours = sim.simulate(c, "mxfp8")
    theirs = sim.torchao_received(c)
    for r, (rank, (data, scale, ends)) in enumerate(zip(ours.ranks, theirs, strict=True)):
        # torchao pads each expert's group to a multiple of 32 rows (an empty one to 32)
        sizes = torch.diff(rank.plan.offs, prepend=rank.plan.offs.new_zeros(1))
        padded = ((sizes.clamp_min(1) + 31) // 32 * 32).to(torch.int32)
        assert torch.equal(ends, padded.cumsum(0).to(torch.int32)), r
        starts = (ends - padded).tolist()
        real = torch.cat(
            [torch.arange(lo, lo + n) for lo, n in zip(starts, sizes.tolist(), strict=True)]
        )
        pad = torch.ones(len(data), dtype=torch.bool)
        pad[real] = False
        assert torch.equal(data[real], rank.received._data.view(torch.uint8)), r
        assert torch.equal(scale[real], rank.received._scale), r
        assert not data[pad].any() and not scale[pad].any()  # zero rows, scale byte 0


def test_torchao_ep_dispatch_on_cpu_stops_at_its_triton_quantizer():
    if torch.cuda.is_available():
        pytest.skip("the CPU behavior")
    ep = _torchao_ep()
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    # a2a_dispatch.py: triton_to_mxfp8_dim0 is the "needs triton" stub without an SM100 GPU
    with pytest.raises(AssertionError, match="^needs triton$"):
        ep.a2a_dispatch_mxfp8_fwd_hp_bwd(x, [8], [8])
    # permute.py calls generate_permute_indices without use_cpu: the Triton index kernel
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    mx = MXTensor(
        torch.zeros(8, 64, dtype=torch.float8_e4m3fn),
        torch.zeros(8, 2, dtype=torch.float8_e8m0fnu),
        elem_dtype=torch.float8_e4m3fn,
        block_size=32,
        orig_dtype=torch.bfloat16,
        kernel_preference=None,
        act_quant_kwargs=None,
        is_swizzled_scales=False,
    )
    with pytest.raises(RuntimeError, match="0 active drivers"):
        ep.permute_mxfp8_fwd_hp_bwd(mx, torch.tensor([8]), 1, 1)


def test_torchao_ep_on_gloo_cannot_send_float8_data(tmp_path, monkeypatch):
    """With its quantizer replaced by torchao's own to_mx, ``a2a_dispatch`` reaches the
    all-to-all and gloo refuses the float8_e4m3fn data (torchao sends the scales as uint8,
    the data as float8); float8kit sends one uint8 buffer. The combine's hp forward and hp
    backward (``mxfp8_bwd=False``) run on gloo; its MXFP8 backward needs the Triton
    quantizer too."""
    import torch.distributed as dist

    ep = _torchao_ep()
    from torchao.prototype.moe_training.ep import a2a_dispatch

    def quantizer(x, inner_block_size=32, scaling_mode="rceil"):
        return sim.torchao_sent(x, torch.arange(len(x)))

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    monkeypatch.setattr(a2a_dispatch, "triton_to_mxfp8_dim0", quantizer)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
        with pytest.raises(RuntimeError, match="Invalid scalar type"):
            ep.a2a_dispatch_mxfp8_fwd_hp_bwd(x, [8], [8])
        y = ep.a2a_combine_hp_fwd_mxfp8_bwd(x, [8], [8], mxfp8_bwd=False)
        y.backward(torch.ones_like(y))
        assert torch.equal(y, x) and torch.equal(x.grad, torch.ones_like(x))
        y = ep.a2a_combine_hp_fwd_mxfp8_bwd(x, [8], [8])
        with pytest.raises(AssertionError, match="^needs triton$"):
            y.backward(torch.ones_like(y))
    finally:
        dist.destroy_process_group()
