"""float8kit.optim.AdamW8bit / AdamW4bit against fp32 AdamW (torch's, and their own fp32
path), one device against FSDP2 on 2 and 3 gloo ranks (bitwise), before against after a
checkpoint (torch.save, DCP resharded 2 -> 3), and bad input."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks.measures import optim as measure
from benchmarks.measures.gloo import spawn
from float8kit.optim import AdamW4bit, AdamW8bit, adamw

LOW_BIT = [AdamW8bit, AdamW4bit]


# ---------------------------------------------------------------------------- one device


@pytest.mark.parametrize("name, most", [("adamw8bit", 2.1), ("adamw4bit", 1.1)])
def test_state_bytes_per_parameter_of_a_1m_mlp(name, most):
    fp32 = measure.bytes_per_param("adamw")
    low = measure.bytes_per_param(name)
    assert math.isclose(fp32, 8.0, rel_tol=1e-5)  # the count sees torch's m and v
    assert low <= most, f"{name}: {low:.3f} bytes of state per parameter"


@pytest.mark.parametrize("name", measure.LOW_BIT)
def test_trains_within_5_percent_of_fp32_adamw(name):
    """The mean loss of the last 20 of 80 steps on fresh batches, over 3 seeds."""
    for seed in range(3):
        ref = measure.tail_mean(measure.train_task("adamw", seed))
        low = measure.tail_mean(measure.train_task(name, seed))
        assert abs(low - ref) / ref < 0.05, (seed, low, ref)


@pytest.mark.parametrize("cls", LOW_BIT)
def test_fp32_state_path_is_adamw(cls):
    """Parameters below min_quantized_numel keep fp32 states and follow torch's AdamW (to
    fp32 rounding: torch fuses some of the same operations)."""
    torch.manual_seed(0)
    ours, ref = nn.Linear(32, 16), nn.Linear(32, 16)
    ref.load_state_dict(ours.state_dict())
    opt = cls(ours.parameters(), lr=1e-2, weight_decay=0.1, min_quantized_numel=10**9)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        x = torch.randn(8, 32)
        for model, o in ((ours, opt), (ref, opt_ref)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert "exp_avg_sq" in opt.state[ours.weight]  # fp32 state, torch's key


def test_the_root_of_v_is_correctly_rounded():
    """The step's sqrt(v) is the correctly rounded fp32 root (numpy's, the CPU's IEEE square
    root instruction), as CUDA's sqrt is: torch's CPU fp32 sqrt is an ulp off for about one
    element in 150, which made a CUDA step differ from the CPU's on an H200."""
    torch.manual_seed(0)
    v = torch.rand(200_000) * torch.exp(8 * torch.randn(200_000))
    got = adamw.root(v).numpy()
    want = np.sqrt(v.numpy())
    assert got.dtype == want.dtype == np.float32
    assert int((got.view(np.int32) != want.view(np.int32)).sum()) == 0


@pytest.mark.parametrize("cls", LOW_BIT)
def test_which_parameters_are_quantized(cls):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # 4096 and 512 elements
    opt = cls(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    kinds = {n: "exp_avg_scale" in opt.state[p] for n, p in model.named_parameters()}
    assert kinds == {"0.weight": True, "0.bias": False, "1.weight": False, "1.bias": False}
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.uint8


@pytest.mark.parametrize("cls", LOW_BIT)
def test_torch_save_round_trip_resumes_bitwise(cls):
    def run(steps, model, opt, start=0):
        for step in range(start, start + steps):
            for p, g in zip(model.parameters(), measure.global_grads(step).values(), strict=True):
                p.grad = g
            opt.step()

    a = measure._Params(0)
    opt_a = cls(a.parameters(), lr=1e-2)
    run(2, a, opt_a)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    run(2, a, opt_a, start=2)

    b = measure._Params(1)
    opt_b = cls(b.parameters(), lr=1e-2)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["optim"])
    run(2, b, opt_b, start=2)
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cls", LOW_BIT)
def test_a_bf16_parameter_keeps_fp32_scales_through_a_load(cls):
    model = nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    opt = cls(model.parameters())
    model(torch.randn(4, 128, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    sd = opt.state_dict()
    opt2 = cls(model.parameters())
    opt2.load_state_dict(sd)
    state = opt2.state[model.weight]
    assert state["exp_avg_scale"].dtype == torch.float32
    assert state["exp_avg"].dtype == torch.uint8
    assert torch.equal(state["exp_avg_scale"], sd["state"][0]["exp_avg_scale"])


@pytest.mark.parametrize("cls", LOW_BIT)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_gradient_stays_visible(cls, bad):
    model = nn.Linear(128, 64, bias=False)
    opt = cls(model.parameters())
    grad = torch.randn(64, 128)
    grad[3, 5] = bad
    model.weight.grad = grad
    opt.step()
    assert not torch.isfinite(model.weight[3, 5])
    assert torch.isfinite(model.weight[10]).all()  # other rows' blocks are not touched
    # and it stays in the state: the next finite step still sees it
    model.weight.grad = torch.randn(64, 128)
    opt.step()
    assert not torch.isfinite(model.weight[3]).all()


@pytest.mark.parametrize("cls", LOW_BIT)
def test_a_compiled_step_is_the_eager_step(cls):
    """torch.compile(opt.step) runs the step eagerly (it is compiler-disabled), the same bits:
    traced by dynamo, torch 2.13 fed one parameter's gradient to another's update."""
    results = []
    for compiled in (False, True):
        model = measure.mlp_1m()
        opt = cls(model.parameters(), lr=1e-3)
        step = torch.compile(opt.step) if compiled else opt.step
        for s in range(2):
            for p, g in zip(model.parameters(), measure._mlp_grads(model, s), strict=True):
                p.grad = g
            step()
        results.append([p.detach() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_maximize_ascends():
    w = nn.Parameter(torch.zeros(64, 64))
    opt = AdamW8bit([w], lr=0.1, weight_decay=0.0, maximize=True)
    w.grad = torch.ones(64, 64)
    opt.step()
    assert torch.allclose(w, torch.full_like(w, 0.1), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"amsgrad": True}, "amsgrad=True is not supported"),
        ({"foreach": True}, "foreach=True is not supported"),
        ({"fused": True}, "fused=True is not supported"),
        ({"capturable": True}, "capturable=True"),
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] must be in \[0, 1\)"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"eps": -1e-8}, "eps must be >= 0"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"min_quantized_numel": -1}, "min_quantized_numel must be an int >= 0"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW4bit([nn.Parameter(torch.zeros(4, 4))], **kwargs)


@pytest.mark.parametrize(
    "param, match",
    [
        (nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64)), "complex"),
        (nn.Parameter(torch.zeros(4, 4, dtype=torch.int64), requires_grad=False), "int64"),
    ],
)
def test_non_real_parameters_are_refused(param, match):
    with pytest.raises(TypeError, match=f"parameter 0 of param group 0 .*{match}"):
        AdamW8bit([param])


def test_a_group_added_later_is_checked_too():
    opt = AdamW8bit([nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match="AdamW8bit: param group 1: lr must be >= 0"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))], "lr": -1.0})
    bad = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
    with pytest.raises(TypeError, match="parameter 0 of param group 2 is torch.int32"):
        opt.add_param_group({"params": [bad]})


@pytest.mark.parametrize("cls", LOW_BIT)
def test_a_large_parameter_is_updated_in_row_chunks_bitwise(cls, monkeypatch):
    """The quantized step decodes CHUNK_ELEMENTS at a time (whole rows): any chunk size gives
    the same bits, so the fp32 temporaries stay small for a large embedding."""
    from float8kit.optim import adamw

    def run():
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(37, 300))
        opt = cls([w], lr=1e-2)
        for step in range(3):
            w.grad = torch.randn(37, 300, generator=torch.Generator().manual_seed(step))
            opt.step()
        return w.detach(), opt.state[w]

    whole = run()
    for chunk in (1500, 36 * 300 + 1, 7):  # 5 rows, 36 rows and a remainder, one row
        monkeypatch.setattr(adamw, "CHUNK_ELEMENTS", chunk)
        chunked = run()
        assert torch.equal(chunked[0], whole[0])
        for k, v in whole[1].items():
            assert torch.equal(chunked[1][k], v), k


def test_sparse_gradient_is_refused():
    emb = nn.Embedding(4096, 8, sparse=True)
    opt = AdamW8bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients.*SparseAdam"):
        opt.step()


# ---------------------------------------------------------------------------- FSDP2, gloo


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    base = tmp_path_factory.mktemp("optim")
    for sub in ("w2", "w3", "r3"):
        (base / sub).mkdir()
    two = spawn("benchmarks.measures.optim:mesh_worker", 2, base / "w2")
    three = spawn("benchmarks.measures.optim:mesh_worker", 3, base / "w3")
    resumed = spawn("benchmarks.measures.optim:resume_worker", 3, base / "r3")
    return {"two": two, "three": three, "resumed": resumed}


@pytest.mark.parametrize("name", measure.OPTIMIZERS)
@pytest.mark.parametrize("world", ["two", "three"])
def test_fsdp2_update_is_bitwise_one_device(meshes, world, name):
    """Even and uneven dim-0 shards (an empty one on 3 ranks), fp32 and quantized states:
    every parameter after 3 steps on the same global gradients is one device's, bit for bit
    (torch's AdamW too, the fp32 reference)."""
    ref = measure.one_device(name)
    for rank_result in meshes[world]:
        for key, value in rank_result[name].items():
            assert torch.equal(value, ref[key]), (world, name, key)


@pytest.mark.parametrize("name", measure.OPTIMIZERS)
def test_dcp_saved_at_2_ranks_loaded_at_3_resumes_bitwise(meshes, name):
    for rank_result in meshes["resumed"]:
        for key, value in rank_result[name].items():
            assert torch.equal(value, meshes["two"][0][name][key]), (name, key)


def test_float8_all_gather_training_within_5_percent_of_fp32_adamw(tmp_path):
    losses = spawn("benchmarks.measures.optim:float8_worker", 2, tmp_path)[0]
    ref = measure.tail_mean(losses["adamw"], 10)
    for name in measure.LOW_BIT:
        assert abs(measure.tail_mean(losses[name], 10) - ref) / ref < 0.05, name
    assert losses["adamw"][-1] < 0.9 * losses["adamw"][0]  # it learns


def test_a_shard_that_cuts_blocks_is_refused(one_rank_group):
    """Shards of a dim after dim 0 of a 3-D parameter would cut its rows' blocks (a one-rank
    mesh: the check is on the placements)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    w = nn.Parameter(distribute_tensor(torch.zeros(4, 64, 128), one_rank_group, [Shard(1)]))
    with pytest.raises(ValueError, match=r"Shard\(dim=1\) would cut a row's blocks"):
        AdamW8bit([w])
    assert "exp_avg_sq" in _one_step(AdamW8bit([w], cut_blocks="fp32"), w)  # fp32 states
    AdamW8bit([w], min_quantized_numel=10**9)  # fp32 states: any placement
    with pytest.raises(ValueError, match="cut_blocks must be 'error' or 'fp32'"):
        AdamW8bit([w], cut_blocks="skip")


def _one_step(opt, w):
    w.grad = torch.ones_like(w)
    opt.step()
    return opt.state[w]


def _tp_worker(rank: int, world: int, tmp: str) -> dict:
    """Tensor parallel rowwise weights (Shard(1)) on ``world`` ranks: 512 columns (whole
    blocks of 128 per rank) after 3 steps, and what a 384-column one (192 per rank) gives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for cls in LOW_BIT:
        torch.manual_seed(0)
        full = torch.randn(64, 512)
        w = nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
        opt = cls([w], lr=1e-2)
        for step in range(3):
            g = torch.randn(64, 512, generator=torch.Generator().manual_seed(step))
            # step 1: a replicated gradient (tensor parallel gives some), redistributed
            w.grad = distribute_tensor(g, mesh, [Replicate() if step == 1 else Shard(1)])
            opt.step()
        out[cls.__name__] = {
            "param": w.full_tensor(),
            "states": {k: v.full_tensor() for k, v in opt.state[w].items() if k != "step"},
        }
        cut = nn.Parameter(distribute_tensor(torch.randn(64, 384), mesh, [Shard(1)]))
        try:
            cls([cut])
            out[cls.__name__]["cut"] = None
        except ValueError as e:
            out[cls.__name__]["cut"] = str(e)
        kept = cls([cut], cut_blocks="fp32")
        out[cls.__name__]["cut_fp32_states"] = sorted(_one_step(kept, cut))
    return out


@pytest.mark.parametrize("cls", LOW_BIT)
def test_tensor_parallel_rowwise_weights_with_whole_blocks_are_bitwise_one_device(tmp_path, cls):
    got = spawn("tests.test_optim_adamw:_tp_worker", 2, tmp_path)[0][cls.__name__]
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 512))
    opt = cls([w], lr=1e-2)
    for step in range(3):
        w.grad = torch.randn(64, 512, generator=torch.Generator().manual_seed(step))
        opt.step()
    assert torch.equal(got["param"], w.detach())
    for k, v in got["states"].items():
        assert torch.equal(v, opt.state[w][k]), k
    assert "384 columns over 2 ranks are not whole blocks of 128" in got["cut"]
    assert got["cut_fp32_states"] == ["exp_avg", "exp_avg_sq", "step"]
