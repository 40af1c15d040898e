"""Expert parallelism on real gloo ranks: bitwise one rank, bytes per all-to-all, host syncs.

``_worker_ep(rank, world, tmp)`` (through ``gloo.spawn``) runs recipes/model.py's
``MoEFeedForward.routed`` with given routings, once with this rank's experts and the tokens
crossing the group (``shard_experts``), once with every expert on this rank over the whole
group's batch (the one-rank reference, the same float8 experts config), and reports, per
case, whether outputs, input gradients and the local experts' weight gradients are equal bit
for bit, the bytes each all-to-all sent, and the host reads a step made.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.measures.gloo import _Count
from benchmarks.measures.refs import bit_equal
from float8kit import Float8ExpertsConfig, convert_experts_to_float8_training
from float8kit.distributed import expert_parallel as ep

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

DIM, HIDDEN, EXPERTS = 64, 64, 8
ROWWISE = dataclasses.replace(
    Float8ExpertsConfig.from_recipe_name("rowwise"), wgrad_operands="dequantized"
)
MXFP8 = dataclasses.replace(
    Float8ExpertsConfig.from_recipe_name("mxfp8"), wgrad_operands="dequantized"
)
CONFIGS = {
    "rowwise": ROWWISE,
    "mxfp8": MXFP8,
    # the weight-gradient gemm in hp, of the dequantized rows the float8 dispatch delivers
    "mxfp8_wgrad_with_hp": dataclasses.replace(MXFP8, wgrad_with_hp=True),
    "rowwise_hp_wgrad": None,
    "hp": None,
}


def moe(seed: int = 0):
    from model import ModelArgs, MoEFeedForward

    torch.manual_seed(seed)
    args = ModelArgs(dim=DIM, n_experts=EXPERTS, top_k=2, moe_hidden=HIDDEN)
    m = MoEFeedForward(args)
    for w in (m.w1, m.w2, m.w3):
        torch.nn.init.normal_(w, std=DIM**-0.5)
    return m


def convert(m, config: Float8ExpertsConfig | None):
    if config is not None:
        convert_experts_to_float8_training(m, config=config)
    return m


def routing(case: str, world: int, tokens: list[int], k: int, seed: int = 1):
    """Every rank's (x, weights, experts, grad) for ``case``: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    local = EXPERTS // world
    for t in tokens:
        x = torch.randn(t, DIM, generator=g)
        w = torch.rand(t, k, generator=g) + 0.1
        if case == "skewed":  # experts 3 and 5 get nothing; expert 0 most
            pool = torch.tensor([0, 0, 0, 1, 2, 4, 6, 7])
        elif case == "last_rank_receives_none":
            pool = torch.arange(EXPERTS - local)
        else:
            pool = torch.arange(EXPERTS)
        picks = [pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)]
        e = torch.stack(picks) if t else torch.zeros(0, k, dtype=torch.long)
        grad = torch.randn(t, DIM, generator=g)
        out.append((x, w / w.sum(-1, keepdim=True), e, grad))
    return out


def fwd_bwd(m, x, w, e, grad, dtype):
    x = x.detach().to(dtype).clone().requires_grad_()
    out, _ = m.routed(x, w, e)
    out.backward(grad.to(out.dtype))
    grads = {n: getattr(m, n).grad for n in ("w1", "w2", "w3")}
    return out.detach(), x.grad, grads


class _CountHostReads:
    """Calls that read a tensor to the host (a device sync on a GPU)."""

    NAMES = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.n = 0
        self.real = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def wrap(name):
            real = self.real[name]

            def f(t, *a, **kw):
                self.n += 1
                return real(t, *a, **kw)

            return f

        for n in self.NAMES:
            setattr(torch.Tensor, n, wrap(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.real.items():
            setattr(torch.Tensor, n, f)


CASES = [
    # name, routing, tokens per rank (world -> list), top-k, config, comm, dtype
    ("uneven_top2", "uniform", lambda w: [37 + 11 * r for r in range(w)], 2),
    ("skewed_top1", "skewed", lambda w: [29] * w, 1),
    ("last_rank_receives_none_top3", "last_rank_receives_none", lambda w: [23] * w, 3),
    ("rank1_sends_none_top2", "uniform", lambda w: [40 if r != 1 else 0 for r in range(w)], 2),
]


def run_case(rank, world, group, case, config_name, comm, dtype) -> dict:
    name, how, tokens, k = case
    config = CONFIGS[config_name]
    if config_name == "rowwise_hp_wgrad":
        config = Float8ExpertsConfig.from_recipe_name("rowwise")
    data = routing(how, world, tokens(world), k)
    x, w, e, grad = data[rank]
    local = EXPERTS // world
    # expert parallel
    m = moe()
    m.shard_experts(group, ep.EPConfig(comm=comm))
    convert(m, config)
    with _Count("all_to_all_single") as a2a, _CountHostReads() as reads:
        out, gx, gw = fwd_bwd(m, x, w, e, grad, dtype)
    # one rank, every expert, the whole group's batch
    ref = convert(moe(), config)
    cat = [torch.cat([d[i] for d in data]) for i in range(4)]
    r_out, r_gx, r_gw = fwd_bwd(ref, *cat, dtype)
    lo = sum(tokens(world)[:rank])
    mine = slice(lo, lo + x.size(0))
    experts = slice(rank * local, (rank + 1) * local)
    return {
        "out": bit_equal(out, r_out[mine]),
        "grad_input": bit_equal(gx, r_gx[mine]),
        "grad_weight": {n: bit_equal(gw[n], r_gw[n][experts]) for n in gw},
        "all_to_all_bytes": a2a.sizes,
        "host_reads": reads.n,
        "rows_sent": int(x.size(0) * k),
        "rows_received": int(sum(1 for d in data for ee in d[2].flatten() if ee // local == rank)),
        "finite": bool(torch.isfinite(out).all()),
    }


def _worker_ep(rank: int, world: int, tmp: str) -> dict:
    group = dist.group.WORLD
    res = {}
    for case in CASES:
        for config_name, comm, dtype in [
            ("rowwise", "float8", torch.float32),
            ("rowwise", "float8", torch.bfloat16),
            ("mxfp8", "float8", torch.bfloat16),
            ("mxfp8_wgrad_with_hp", "float8", torch.bfloat16),
            ("rowwise_hp_wgrad", "hp", torch.bfloat16),
            ("hp", "hp", torch.bfloat16),
        ]:
            key = f"{case[0]}/{config_name}/{comm}/{str(dtype)[6:]}"
            res[key] = run_case(rank, world, group, case, config_name, comm, dtype)
    return res


# ---------------------------------------------------------------------------- resuming


RESUME_TOKENS, RESUME_STEPS = 48, 2


def _resume_model(group):
    m = moe()
    m.shard_experts(group, ep.EPConfig())
    return convert(m, ROWWISE)


def _resume_optimizer(m):
    return torch.optim.AdamW([m.w1, m.w2, m.w3], lr=0.05)


def _resume_steps(m, opt, rank, world, first_step, steps) -> list[torch.Tensor]:
    """AdamW steps on this rank's share of each step's global batch: the outputs per step."""
    outs = []
    per = RESUME_TOKENS // world
    for step in range(first_step, first_step + steps):
        (x, w, e, grad), *_ = routing("uniform", 1, [RESUME_TOKENS], 2, seed=100 + step)
        mine = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        out, _ = m.routed(x[mine], w[mine], e[mine])
        out.backward(grad[mine])
        opt.step()
        outs.append(out.detach())
    return outs


def _experts_and_state(m, opt) -> dict:
    """A copy of this rank's expert weights and their AdamW state (a state loaded by a plain
    ``load_state_dict`` before any step is still the checkpoint's DTensor: its local part,
    which the optimizer's first step takes)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    return {
        **{n: getattr(m, n).detach().clone() for n in ("w1", "w2", "w3")},
        **{
            f"{n}.{k}": local(opt.state[getattr(m, n)][k]).clone()
            for n in ("w1", "w2", "w3")
            for k in ("exp_avg", "exp_avg_sq")
        },
    }


def _save_then_train_on(m, opt, rank: int, world: int, tmp: str, state) -> dict:
    """Train, save with torch.distributed.checkpoint (model and AdamW state, through
    ``get_state_dict``) and with a per-rank ``torch.save``, train on: the reference to
    resume. ``state(m, opt)``: the experts and AdamW states, after the save ("saved") and at
    the end ("final"); "keys": what the state_dicts show."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _resume_steps(m, opt, rank, world, 0, RESUME_STEPS)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/ckpt")
    torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, f"{tmp}/ckpt_rank{rank}.pt")
    keys = {k: (type(v).__name__, tuple(v.shape)) for k, v in msd.items()}
    optim_keys = {k: (type(v).__name__, tuple(v.shape)) for k, v in osd["state"]["w1"].items()}
    saved = state(m, opt)
    outs = _resume_steps(m, opt, rank, world, RESUME_STEPS, RESUME_STEPS)
    final = state(m, opt)
    return {"outs": outs, "saved": saved, "final": final, "keys": keys, "optim_keys": optim_keys}


def _worker_ep_save(rank: int, world: int, tmp: str) -> dict:
    """Expert parallelism over every rank: the run a resume must reproduce."""
    m = _resume_model(dist.group.WORLD)
    return _save_then_train_on(m, _resume_optimizer(m), rank, world, tmp, _experts_and_state)


def _worker_ep_load(rank: int, world: int, tmp: str) -> dict:
    """Load the checkpoint in ``tmp``'s parent folder into another expert-parallel degree
    (``torch.save``'s: the same degree, each rank its own file) and train on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = os.path.dirname(tmp)  # each load runs in a folder of the save's
    m = _resume_model(dist.group.WORLD)
    opt = _resume_optimizer(m)
    if os.environ.get("EP_LOAD") == "torch.save":
        sd = torch.load(f"{saved}/ckpt_rank{rank}.pt")
        m.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    else:
        msd, osd = get_state_dict(m, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{saved}/ckpt")
        set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = _experts_and_state(m, opt)
    outs = _resume_steps(m, opt, rank, world, RESUME_STEPS, RESUME_STEPS)
    return {"outs": outs, "saved": loaded}


# ---------------------------------------------------------------------------- checkpointing


def _worker_ep_ac(rank: int, world: int, tmp: str) -> dict:
    """Activation checkpointing under EP: of the expert gemms (what to do: nothing crosses
    the group again), and of the whole routed block (recomputes the dispatch); and the
    expert gemms compiled (``fullgraph``, inductor rounding bf16 as eager does) between the
    eager dispatch and combine, which hands their backward the float8 gradient rows
    dequantized."""
    from functools import partial

    from torch._inductor import config as inductor_config
    from torch.utils.checkpoint import checkpoint

    data = routing("uniform", world, [37 + 5 * r for r in range(world)], 2)
    x, w, e, grad = data[rank]
    res = {}
    for how in ("none", "expert_gemms", "whole_block", "compiled"):
        m = moe()
        m.shard_experts(dist.group.WORLD, ep.EPConfig())
        convert(m, ROWWISE)
        if how == "expert_gemms":
            m.expert_gemms = partial(checkpoint, m.expert_gemms, use_reentrant=False)
        if how == "whole_block":
            m.routed = partial(checkpoint, m.routed, use_reentrant=False)
        if how == "compiled":
            m.expert_gemms = torch.compile(m.expert_gemms, fullgraph=True)
        with (
            inductor_config.patch(emulate_precision_casts=True),
            _Count("all_to_all_single") as a2a,
            _CountHostReads() as reads,
        ):
            got = fwd_bwd(m, x, w, e, grad, torch.bfloat16)
        res[how] = {"result": got, "all_to_alls": len(a2a.sizes), "host_reads": reads.n}
    return res
