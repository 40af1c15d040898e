"""Expert parallelism composed with FSDP2, and fed inf and NaN.

Expert parallelism x FSDP2 on 4 gloo ranks (a 2 x 2 (dp, ep) mesh): each pair of ranks
splits the experts (EP), and the two ranks that hold the same experts shard them with FSDP2
(dp), gathering them in float8 (``Float8ExpertsConfig.enable_fsdp_float8_all_gather``) or in
hp. ``_worker_ep_fsdp`` trains both ways and reports losses, the experts' gradients and the
all-gather bytes, for tests/test_expert_parallel.py to hold against each other.
``_worker_ep_nonfinite`` sends tokens holding inf and NaN across 2 ranks and runs the one-rank
reference on the same tokens."""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.measures.expert_parallel import (
    CONFIGS,
    RESUME_STEPS,
    ROWWISE,
    _resume_optimizer,
    _resume_steps,
    _save_then_train_on,
    convert,
    fwd_bwd,
    moe,
    routing,
)
from benchmarks.measures.gloo import _Count
from float8kit import convert_experts_to_float8_training
from float8kit.distributed import expert_parallel as ep

STEPS = 3


def _train(fp8_all_gather: bool, mesh, rank: int) -> dict:
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    m = moe()
    m.shard_experts(mesh["ep"].get_group(), ep.EPConfig())  # 4 of the 8 experts
    # (experts, in, out) weights used as torch._grouped_mm(x, w): gathered scaled along K
    config = dataclasses.replace(
        ROWWISE, enable_fsdp_float8_all_gather=fp8_all_gather, weight_layout="in_out"
    )
    convert_experts_to_float8_training(m, config=config)
    fully_shard(m, mesh=mesh["dp"])  # 2 experts per rank, gathered (fp32 or float8) per use
    register_fsdp_forward_method(m, "routed")  # called directly (not through forward)
    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.SGD([m.w1, m.w2, m.w3], lr=0.05)
    losses, gathered = [], []
    for step in range(STEPS):
        data = routing("uniform", 4, [24, 31, 17, 40], 2, seed=200 + step)
        x, w, e, grad = data[rank]
        x = x.requires_grad_()
        with _Count("all_gather_single") as ag:
            out, _ = m.routed(x, w, e)
            out.backward(grad.to(out.dtype))
        gathered.append(ag.bytes)
        losses.append(float((out.float() * grad).sum()))
        opt.step()
        opt.zero_grad()
    experts = {n: getattr(m, n).full_tensor().detach() for n in ("w1", "w2", "w3")}
    return {"losses": losses, "experts": experts, "all_gather_bytes": gathered}


def _worker_ep_fsdp(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    return {"fp8": _train(True, mesh, rank), "hp": _train(False, mesh, rank)}


def _worker_ep_nonfinite(rank: int, world: int, tmp: str) -> dict:
    """Rank 0's token 3 holds an inf, rank 1's token 5 a NaN (rowwise and MXFP8 experts):
    this rank's outputs and gradients, and the one-rank reference's on the whole batch."""
    import torch.distributed as dist

    res = {}
    for name in ("rowwise", "mxfp8"):
        config = CONFIGS[name]
        data = routing("uniform", world, [20] * world, 2, seed=7)
        data[0][0][3, 11] = float("inf")
        data[1][0][5, 40] = float("nan")
        x, w, e, grad = data[rank]
        m = moe()
        m.shard_experts(dist.group.WORLD, ep.EPConfig())
        convert(m, config)
        got = fwd_bwd(m, x, w, e, grad, torch.bfloat16)
        cat = [torch.cat([d[i] for d in data]) for i in range(4)]
        want = fwd_bwd(convert(moe(), config), *cat, torch.bfloat16)
        res[name] = {"got": got, "want": want}
    return res


# ---------------------------------------------------------------------------- checkpoints


def _ep_fsdp_resume_model(mesh):
    """``expert_parallel``'s resume model on a (dp, ep) mesh: experts cut over ep, then
    FSDP2-sharded over dp and all-gathered in float8."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    m = moe()
    m.shard_experts(mesh["ep"].get_group(), ep.EPConfig())
    config = dataclasses.replace(
        ROWWISE, enable_fsdp_float8_all_gather=True, weight_layout="in_out"
    )
    convert_experts_to_float8_training(m, config=config)
    fully_shard(m, mesh=mesh["dp"])
    register_fsdp_forward_method(m, "routed")
    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return m


def _global_experts_and_state(m, opt, mesh) -> dict:
    """The whole (8, ...) expert weights and AdamW states, gathered by hand: each EP rank's
    experts from FSDP2's shards (``full_tensor`` over dp), then the EP ranks' in order."""
    import torch.distributed as dist

    def whole(t):
        mine = t.full_tensor().detach().clone()
        parts = [torch.empty_like(mine) for _ in range(mesh["ep"].size())]
        dist.all_gather(parts, mine, group=mesh["ep"].get_group())
        return torch.cat(parts)

    names = ("w1", "w2", "w3")
    return {
        **{n: whole(getattr(m, n)) for n in names},
        **{
            f"{n}.{k}": whole(opt.state[getattr(m, n)][k])
            for n in names
            for k in ("exp_avg", "exp_avg_sq")
        },
    }


def _worker_ep_fsdp_save(rank: int, world: int, tmp: str) -> dict:
    """(dp, ep) = (2, 2): the run a resume must reproduce (its experts and states gathered
    whole)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    m = _ep_fsdp_resume_model(mesh)

    def state(m, opt):
        return _global_experts_and_state(m, opt, mesh)

    return _save_then_train_on(m, _resume_optimizer(m), rank, world, tmp, state)


def _worker_ep_fsdp_load(rank: int, world: int, tmp: str) -> dict:
    """(dp, ep) = (2, 2) again: the checkpoint in ``tmp``'s parent folder loaded through DCP,
    and each rank's ``torch.save`` into another fresh model; both train on (their outputs,
    and their experts and states at the end)."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    saved = os.path.dirname(tmp)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
    res = {}
    for how in ("dcp", "torch.save"):
        m = _ep_fsdp_resume_model(mesh)
        opt = _resume_optimizer(m)
        if how == "dcp":
            msd, osd = get_state_dict(m, opt)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{saved}/ckpt")
            set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
        else:
            sd = torch.load(f"{saved}/ckpt_rank{rank}.pt", weights_only=False)
            m.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
        outs = _resume_steps(m, opt, rank, world, RESUME_STEPS, RESUME_STEPS)
        res[how] = {"outs": outs, "final": _global_experts_and_state(m, opt, mesh)}
    return res
