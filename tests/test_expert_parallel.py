"""Expert parallelism (float8kit/distributed/expert_parallel.py) on real gloo ranks: one
rank's bits at EP 2 and 4, the bytes every all-to-all sends, one host read per step, and the
scale bytes on the wire."""

import dataclasses
import math

import pytest
import torch

from benchmarks.measures.expert_parallel import CASES, DIM, HIDDEN
from benchmarks.measures.gloo import spawn
from float8kit import Float8ExpertsConfig, formats
from float8kit.distributed import expert_parallel as ep
from float8kit.scaling import amax_to_scale


@pytest.fixture(scope="module")
def ep_ranks(request, tmp_path_factory):
    world = request.param
    name = "benchmarks.measures.expert_parallel:_worker_ep"
    return world, spawn(name, world, tmp_path_factory.mktemp(f"ep{world}"))


@pytest.mark.slow
@pytest.mark.parametrize("ep_ranks", [2, 4], indirect=True)
def test_expert_parallel_step_is_one_ranks_bits(ep_ranks):
    world, results = ep_ranks
    for rank, res in enumerate(results):
        # every case x {rowwise fp32, rowwise bf16, mxfp8 bf16, mxfp8_wgrad_with_hp bf16, hp
        # comm float8 experts, hp}
        assert len(res) == len(CASES) * 6
        for key, r in res.items():
            ok = r["out"] and r["grad_input"] and all(r["grad_weight"].values())
            assert ok, f"EP{world} rank {rank} {key}: {r}"
            assert r["finite"]
    # the routings reach the edges they are named for
    received = {k: [res[k]["rows_received"] for res in results] for k in results[0]}
    assert all(n[-1] == 0 for k, n in received.items() if k.startswith("last_rank_receives"))
    sent = {k: [res[k]["rows_sent"] for res in results] for k in results[0]}
    assert all(n[1] == 0 for k, n in sent.items() if k.startswith("rank1_sends_none"))


def _phases(calls: list[int]) -> dict[str, int]:
    names = ["counts", "dispatch", "combine", "combine_backward", "dispatch_backward"]
    assert len(calls) == len(names)
    return dict(zip(names, calls, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("ep_ranks", [2, 4], indirect=True)
def test_bytes_per_all_to_all_against_the_bf16_exchange(ep_ranks):
    world, results = ep_ranks
    for rank, res in enumerate(results):
        for case, *_ in CASES:
            f8 = _phases(res[f"{case}/rowwise/float8/bfloat16"]["all_to_all_bytes"])
            mx = _phases(res[f"{case}/mxfp8/float8/bfloat16"]["all_to_all_bytes"])
            bf16 = _phases(res[f"{case}/hp/hp/bfloat16"]["all_to_all_bytes"])
            sent = res[f"{case}/hp/hp/bfloat16"]["rows_sent"]
            got = res[f"{case}/hp/hp/bfloat16"]["rows_received"]
            # per row: K fp8 bytes + 1 e8m0 scale byte; MX: K + K/32; bf16: 2K
            assert f8["dispatch"] == sent * (DIM + 1) and bf16["dispatch"] == sent * 2 * DIM
            assert mx["dispatch"] == sent * (DIM + DIM // 32)
            assert f8["combine"] == bf16["combine"] == got * 2 * DIM  # hp out
            assert f8["combine_backward"] == sent * (DIM + 1)  # grad rows along N = DIM
            assert f8["dispatch_backward"] == bf16["dispatch_backward"] == got * 2 * DIM
            assert f8["counts"] == bf16["counts"] == 8 * 8  # the expert counts, int64
            if sent:
                ratio, mx_ratio = (
                    f8["dispatch"] / bf16["dispatch"],
                    mx["dispatch"] / bf16["dispatch"],
                )
                print(f"EP{world} rank {rank} {case}: dispatch {ratio:.4f}x (mx {mx_ratio:.4f}x)")
                assert ratio <= 0.53 and mx_ratio <= 0.52
        # a whole step over the group: <= 0.80x the bf16 step's all-to-all bytes
        total = {
            how: sum(sum(res[f"{c}/{how}/bfloat16"]["all_to_all_bytes"]) for c, *_ in CASES)
            for how in ("rowwise/float8", "hp/hp")
        }
        assert total["rowwise/float8"] / total["hp/hp"] <= 0.80


@pytest.mark.slow
@pytest.mark.parametrize("ep_ranks", [2], indirect=True)
def test_one_host_read_per_step(ep_ranks):
    # the dispatch's split sizes (.tolist()): forward, backward and combine reuse them
    _, results = ep_ranks
    for res in results:
        assert {r["host_reads"] for r in res.values()} == {1}


def test_e8m0_scale_bytes_are_exact_for_every_power_of_two_scale():
    amax = torch.cat([torch.logspace(-30, 38, 2000), torch.tensor([0.0, 1e-45, 448.0])])
    scale = amax_to_scale(amax, torch.float8_e4m3fn, round_to_pow2=True).view(-1, 1)
    pow2 = (scale.view(torch.int32) & 0x7FFFFF) == 0
    rows = formats.Axiswise(1)  # the format of rowwise rows on EP's wire
    back = rows.scale_from_bytes(rows.scale_bytes(scale, "e8m0"), "e8m0")
    assert torch.equal(back[pow2], scale[pow2])
    # the quotients kept for amaxes within 12% of fp32's max, a NaN, and an inf amax (scale 0)
    odd = amax_to_scale(torch.tensor([3.1e38, math.nan, math.inf]), torch.float8_e4m3fn, True)
    back = rows.scale_from_bytes(rows.scale_bytes(odd.view(-1, 1), "e8m0"), "e8m0").view(-1)
    assert back[0].isnan() and back[1].isnan() and back[2] == 0.0 == odd[2]
    fp32 = rows.scale_from_bytes(rows.scale_bytes(odd.view(-1, 1), "fp32"), "fp32").view(-1)
    assert torch.equal(fp32[[0, 2]], odd[[0, 2]]) and fp32[1].isnan()


def test_configs_and_misuse_name_the_field():
    with pytest.raises(ValueError, match="EPConfig.comm"):
        ep.EPConfig(comm="fp8")
    with pytest.raises(ValueError, match="EPConfig.scale_format"):
        ep.EPConfig(scale_format="bf16")
    plan = ep.EPPlan(None, 8, [3], [3], torch.arange(3), torch.tensor([3], dtype=torch.int32))
    x, token = torch.randn(2, DIM), torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match='wgrad_operands="dequantized"'):
        ep.dispatch(x, token, plan, Float8ExpertsConfig())
    with pytest.raises(ValueError, match="experts are hp"):
        ep.dispatch(x, token, plan, None)
    with pytest.raises(ValueError, match="routes 3"):
        ep.dispatch(x, token[:2], plan, None, ep.EPConfig(comm="hp"))
    with pytest.raises(ValueError, match="received"):
        ep.combine(torch.randn(2, HIDDEN), plan, None)


def _whole(results: list[dict]) -> dict:
    """Every rank's outputs per step, and its local experts and their AdamW state,
    concatenated in rank order (the global tensors)."""
    steps = len(results[0]["outs"])
    return {
        "outs": [torch.cat([r["outs"][s] for r in results]) for s in range(steps)],
        **{k: torch.cat([r["saved"][k] for r in results]) for k in results[0]["saved"]},
    }


@pytest.mark.slow
def test_checkpoint_resumes_bitwise_on_another_expert_parallel_degree(tmp_path, monkeypatch):
    """Expert weights and their AdamW state through ``get_state_dict`` +
    ``torch.distributed.checkpoint`` at EP 2, loaded at EP 2, 4 and 1, and through each
    rank's ``torch.save`` at EP 2: the state loaded and the steps after it are bitwise the
    uninterrupted run's (a plain local optimizer state under one key on every rank: DCP
    kept one rank's, and the other rank resumed with its exp_avg)."""
    saved = spawn("benchmarks.measures.expert_parallel:_worker_ep_save", 2, tmp_path)
    # the state_dicts show each expert weight, and its optimizer state, whole: a DTensor
    # sharded over the EP group
    assert saved[0]["keys"]["w1"] == ("DTensor", (8, DIM, HIDDEN))
    assert saved[0]["optim_keys"]["exp_avg"] == ("DTensor", (8, DIM, HIDDEN))
    want = _whole(saved)
    for world, how in ((2, "dcp"), (4, "dcp"), (1, "dcp"), (2, "torch.save")):
        monkeypatch.setenv("EP_LOAD", how)
        load = tmp_path / f"load_ep{world}_{how}"
        load.mkdir()
        got = _whole(spawn("benchmarks.measures.expert_parallel:_worker_ep_load", world, load))
        for key, value in want.items():
            same = (
                all(map(torch.equal, value, got[key]))
                if key == "outs"
                else torch.equal(value, got[key])
            )
            assert same, f"EP2 -> EP{world} ({how}): {key}"


@pytest.mark.slow
def test_checkpoint_of_experts_fsdp2_also_shards_resumes_bitwise(tmp_path, monkeypatch):
    """(dp, ep) = (2, 2), FSDP2 sharding each EP rank's experts (float8 all-gather): the
    state_dicts show each expert weight and AdamW state whole, a DTensor over the (ep, dp)
    mesh; through DCP and through each rank's torch.save the run resumes bitwise, and DCP's
    checkpoint loads into EP 2 without FSDP2 as the same experts and states (before, the
    state_dict of such experts raised)."""
    saved = spawn("benchmarks.measures.ep_compose:_worker_ep_fsdp_save", 4, tmp_path)
    assert saved[0]["keys"]["w1"] == ("DTensor", (8, DIM, HIDDEN))
    assert saved[0]["optim_keys"]["exp_avg"] == ("DTensor", (8, DIM, HIDDEN))
    load = tmp_path / "load_2x2"
    load.mkdir()
    resumed = spawn("benchmarks.measures.ep_compose:_worker_ep_fsdp_load", 4, load)
    for rank, (want, got) in enumerate(zip(saved, resumed, strict=True)):
        for how, run in got.items():
            assert all(map(torch.equal, want["outs"], run["outs"])), (rank, how)
            for key, value in want["final"].items():
                assert torch.equal(value, run["final"][key]), (rank, how, key)
    monkeypatch.setenv("EP_LOAD", "dcp")
    load = tmp_path / "load_ep2"
    load.mkdir()
    got = spawn("benchmarks.measures.expert_parallel:_worker_ep_load", 2, load)
    for key, value in saved[0]["saved"].items():
        loaded = torch.cat([r["saved"][key] for r in got])
        assert torch.equal(value, loaded), f"(2, 2) -> EP 2: {key}"


@pytest.mark.slow
def test_checkpointed_or_compiled_expert_gemms_keep_the_bits_and_send_nothing_again(tmp_path):
    results = spawn("benchmarks.measures.expert_parallel:_worker_ep_ac", 2, tmp_path)
    for res in results:
        want = res["none"]["result"]
        # compiled expert gemms between dispatch and combine under the float8 comm: their
        # backward failed on the float8 gradient rows; it gets them dequantized (exact)
        for how in ("expert_gemms", "whole_block", "compiled"):
            got = res[how]["result"]
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), how
            assert all(torch.equal(want[2][n], got[2][n]) for n in want[2]), how
        # counts, dispatch, combine forward; combine and dispatch backward
        assert res["none"]["all_to_alls"] == res["expert_gemms"]["all_to_alls"] == 5
        assert res["compiled"]["all_to_alls"] == 5
        assert res["none"]["host_reads"] == res["expert_gemms"]["host_reads"] == 1
        # checkpointing the whole block runs the counts, the dispatch and the combine again
        assert res["whole_block"]["all_to_alls"] == 8 and res["whole_block"]["host_reads"] == 2


@pytest.mark.slow
def test_ep_by_fsdp2_gathers_the_experts_in_float8_bitwise_the_hp_all_gather(tmp_path):
    # 4 ranks, (dp, ep) = (2, 2): the ranks that hold the same experts FSDP2-shard them and
    # all-gather them in float8 (rowwise, per expert column) or in hp, for every gemm
    results = spawn("benchmarks.measures.ep_compose:_worker_ep_fsdp", 4, tmp_path)
    for rank, r in enumerate(results):
        fp8, hp = r["fp8"], r["hp"]
        assert fp8["losses"] == hp["losses"], rank
        assert all(torch.equal(fp8["experts"][n], hp["experts"][n]) for n in hp["experts"])
        # float8 data (1 byte for fp32's 4) + an fp32 scale per expert column (4 / 64)
        ratio = sum(fp8["all_gather_bytes"]) / sum(hp["all_gather_bytes"])
        print(f"rank {rank}: expert all-gather bytes, float8 / fp32: {ratio:.3f}")
        assert 0.25 < ratio < 0.28


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same NaNs and infs in the same places, and the same bits everywhere else."""
    finite = torch.isfinite(a)
    return (
        torch.equal(torch.isnan(a), torch.isnan(b))
        and torch.equal(a.isinf(), b.isinf())
        and torch.equal(a[finite], b[finite])
    )


@pytest.mark.slow
def test_inf_and_nan_tokens_stay_visible_as_on_one_rank(tmp_path):
    results = spawn("benchmarks.measures.ep_compose:_worker_ep_nonfinite", 2, tmp_path)
    for rank, res in enumerate(results):
        for name, r in res.items():
            (out, gx, gw), (r_out, r_gx, r_gw) = r["got"], r["want"]
            mine = slice(20 * rank, 20 * (rank + 1))
            bad = 3 if rank == 0 else 5
            assert out[bad].isnan().all(), (name, rank)  # the token's output: NaN, not 448s
            assert torch.isfinite(out[[i for i in range(20) if i != bad]]).all()
            assert _same(out, r_out[mine]) and _same(gx, r_gx[mine]), (name, rank)
            local = gw["w1"].size(0)
            for n in gw:
                assert _same(gw[n], r_gw[n][rank * local : (rank + 1) * local]), (name, n)


def test_plan_dispatch_refuses_rows_not_sorted_by_expert(one_rank_group):
    """Token-major rows (``experts.flatten()`` unsorted) would run through other experts'
    weights without an error: refused, in the plan's one host read, naming the fix."""
    experts = torch.tensor([[2, 0], [1, 3], [0, 2]])  # (tokens, top_k)
    with pytest.raises(ValueError, match=r"sorted by expert .* 2 of 6 rows .*argsort"):
        ep.plan_dispatch(experts.flatten(), 4)
    order = experts.flatten().argsort(stable=True)
    plan = ep.plan_dispatch(experts.flatten()[order], 4)
    assert plan.send_sizes == [6] and plan.offs.tolist() == [2, 3, 5, 6]


def test_checkpoints_of_experts_fsdp2_shards_along_another_dim_are_refused(one_rank_group):
    # the (ep, dp) checkpoint layout cuts each EP rank's experts along dim 0, as FSDP2's
    # default does; FSDP2 along dim 1 is refused when a state_dict is taken, naming the fix
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from benchmarks.measures.expert_parallel import moe

    m = moe()
    m.shard_experts(one_rank_group.get_group(), ep.EPConfig())
    fully_shard(m, mesh=one_rank_group, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    with pytest.raises(ValueError, match=r"fully_shard on a 1-D mesh along dim 0.*Shard\(dim=2\)"):
        m.state_dict()


def test_combine_refuses_an_op_after_the_last_expert_gemm(one_rank_group):
    """combine's backward sends float8 gradient rows, which only the expert gemm's backward
    takes: an op between them (routing scores, a bias, a cast) failed in backward with an
    error about float8 tensor ops; it is refused at combine, naming where it goes."""
    from benchmarks.measures.expert_parallel import ROWWISE, convert, moe, routing

    m = moe()
    m.shard_experts(one_rank_group.get_group(), ep.EPConfig())
    m = convert(m, ROWWISE)
    (x, _, e, _), *_ = routing("uniform", 1, [16], 2, seed=1)
    order = e.flatten().argsort(stable=True)
    plan = ep.plan_dispatch(e.flatten()[order], m.n_experts)
    xs = ep.dispatch(x.requires_grad_(), order // 2, plan, m.w1._config)
    ys = m.expert_gemms(xs, plan.offs)
    with pytest.raises(ValueError, match=r"output of MulBackward0: apply routing scores before"):
        ep.combine(ys * 2.0, plan, m.w1._config)
    ep.combine(ys, plan, m.w1._config).sum().backward()  # the gemm's own output: fine
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_gradient_rows_dequantized_and_cast_again_stand_for_the_same_values(recipe):
    """combine's backward hands a compiled graph the float8 gradient rows dequantized, and
    its expert gemm casts them again: exact, with power-of-two scales, although a row whose
    cast rounded its amax down to 224 is cast again with twice the scale (the data doubled).
    The gemm's products are then the same bits."""
    from float8kit.quantized_rows import quantize_rows, rows_format

    config = dataclasses.replace(
        Float8ExpertsConfig.from_recipe_name(recipe), wgrad_operands="dequantized"
    )
    fmt = rows_format(config)
    g = torch.randn(6, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g[0, 5] = 12.0  # amax 12 * 2**-k rounds down: 225 * 2**-k -> 224 * 2**-k
    g[0] *= 225.0 / 12.0 * 2.0**-12
    g[1] *= 2.0**-140  # fp32 subnormal products
    g[2] = 0.0
    g[3, ::32] = 225.0 * 2.0**9  # one 225 in every MX block
    g = g.to(torch.bfloat16)
    data, scale = quantize_rows(g, config)
    rows = fmt.dequantize(data, scale).to(torch.bfloat16)
    again, again_scale = quantize_rows(rows, config)
    assert torch.equal(fmt.dequantize(again, again_scale), fmt.dequantize(data, scale))
    ratio = fmt.dequantize(torch.ones_like(again), again_scale) / fmt.dequantize(
        torch.ones_like(data), scale
    )
    assert torch.equal(ratio.log2(), ratio.log2().round())  # powers of two
    assert (ratio[[0, 3]] == 0.5).any(dim=-1).all()  # the rows cast with twice the scale
