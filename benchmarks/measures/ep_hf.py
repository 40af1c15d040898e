"""Hugging Face MoE models under float8kit expert parallelism (float8kit/integrations/
hf_experts.py) on real gloo ranks: Qwen3-MoE, Mixtral and GPT-OSS tiny configs.

``_worker_ep_hf(rank, world, tmp)`` (through ``gloo.spawn``), per model:

- the first MoE block with this rank's experts (``shard_hf_experts``) on this rank's tokens,
  and the same block with every expert on one rank (``use_float8kit_experts``) on the
  group's tokens concatenated: whether the outputs, the input gradients and the local
  experts' weight and up-bias gradients are equal bit for bit; the replicated parameters'
  gradients (router, GPT-OSS's down bias), summed over the group, against the reference's
  (largest absolute difference); float8 rowwise experts with ``wgrad_operands=
  "dequantized"`` and ``EPConfig()``, and bf16 experts with ``EPConfig(comm="hp")``;
- ``STEPS`` AdamW steps of the whole tiny model: expert parallel (dense gradients
  all-reduced and averaged, expert gradients divided by the group size) against one rank on
  the concatenated batch with the same float8 experts, and the bf16 EP baseline's losses;
- a checkpoint of the float8 EP model and its AdamW state through ``get_state_dict`` and
  ``torch.distributed.checkpoint``, loaded into a fresh EP model (``checkpoint_round_trip``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from benchmarks.measures.experts_hf import VOCAB, gpt_oss, mixtral, qwen3_moe
from benchmarks.measures.refs import bit_equal
from float8kit import Float8ExpertsConfig, convert_experts_to_float8_training
from float8kit.distributed.expert_parallel import EPConfig
from float8kit.integrations.hf_experts import (
    expert_parallel_parameters,
    shard_hf_experts,
    use_float8kit_experts,
)

MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "gpt_oss": gpt_oss}
ROWWISE = dataclasses.replace(
    Float8ExpertsConfig.from_recipe_name("rowwise"), wgrad_operands="dequantized"
)
# name -> (experts config (None: hp experts in bf16), EPConfig)
SETUPS = {"float8": (ROWWISE, EPConfig()), "bf16": (None, EPConfig(comm="hp"))}
TOKENS = [(3, 8), (2, 8)]  # (batch, seq) per rank: uneven
STEPS, LR, BATCH, SEQ = 4, 1e-3, 2, 16


def build(name: str, setup: str, group=None, convert_first: bool = False):
    """The tiny model ``name``, its experts as ``setup`` says, sharded over ``group`` (or
    every expert on this rank: ``group`` None), before converting them to float8 (or after:
    ``convert_first``)."""
    config, ep = SETUPS[setup]
    model = MODELS[name]()
    if config is None:
        for _, m in model.named_modules():
            if hasattr(m, "down_proj") and hasattr(m, "num_experts"):
                m.to(torch.bfloat16)
    if config is not None and convert_first:
        convert_experts_to_float8_training(model, config=config)
    if group is None:
        use_float8kit_experts(model)
    else:
        shard_hf_experts(model, group, ep)
    if config is not None and not convert_first:
        convert_experts_to_float8_training(model, config=config)
    return model


def _block_inputs(world: int):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(b, s, 32, generator=g) for b, s in TOKENS[:world]]
    grads = [torch.randn(x.shape, generator=g) for x in xs]
    return xs, grads


def _fwd_bwd(block, x, grad):
    x = x.clone().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)
    return out.detach(), x.grad


def block_check(rank: int, world: int, name: str, setup: str, convert_first=False) -> dict:
    group = dist.group.WORLD
    xs, grads = _block_inputs(world)
    ep_model = build(name, setup, group, convert_first)
    ref_model = build(name, setup)
    block, ref = ep_model.model.layers[0].mlp, ref_model.model.layers[0].mlp
    out, gx = _fwd_bwd(block, xs[rank], grads[rank])
    r_out, r_gx = _fwd_bwd(ref, torch.cat(xs), torch.cat(grads))
    lo = sum(x.size(0) for x in xs[:rank])
    mine = slice(lo, lo + xs[rank].size(0))
    sharded = {id(p) for p in expert_parallel_parameters(ep_model)}
    local = ref.experts.num_experts // world
    experts = slice(rank * local, (rank + 1) * local)
    ref_params = dict(ref.named_parameters())
    bitwise, replicated = {}, {}
    for n, p in block.named_parameters():
        want = ref_params[n].grad
        if id(p) in sharded:
            bitwise[n] = bit_equal(p.grad, want[experts])
        else:  # data parallel: the group's sum against the one-rank gradient
            total = p.grad.clone()
            dist.all_reduce(total)
            replicated[n] = (total - want).abs().max().item()
    return {
        "out": bit_equal(out, r_out[mine]),
        "grad_input": bit_equal(gx, r_gx[mine]),
        "grad_experts": bitwise,
        "replicated_grad_max_abs_diff": replicated,
        "finite": bool(torch.isfinite(out).all()),
    }


def _batch(world: int):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (STEPS, world * BATCH, SEQ), generator=g)


def train(model, ids, *, group=None) -> list[float]:
    """``STEPS`` AdamW steps; with ``group``, this rank's slice of each batch, dense
    gradients all-reduced and averaged, expert gradients divided by the group size (each
    rank's loss is its tokens' mean: the group's mean loss is their average)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sharded = {id(p) for p in expert_parallel_parameters(model)}
    losses = []
    for step in range(STEPS):
        batch = ids[step]
        if group is not None:
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            batch = batch.chunk(world)[rank]
        loss = model(batch, labels=batch).loss
        loss.backward()
        if group is not None:
            for p in model.parameters():
                if p.grad is None:
                    continue
                if id(p) not in sharded:
                    dist.all_reduce(p.grad, group=group)
                p.grad /= world
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
            loss /= world
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def checkpoint_round_trip(name: str, group, tmp: str) -> dict:
    """One AdamW step of the float8 EP model ``name``, saved with ``get_state_dict`` +
    ``torch.distributed.checkpoint`` and loaded into a fresh EP model: whether each sharded
    expert parameter and its AdamW state came back bit for bit, and what the saved state_dict
    held for it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    batch = _batch(world)[0].chunk(world)[rank]

    def model_and_optimizer():
        model = build(name, "float8", group)
        return model, torch.optim.AdamW(model.parameters(), lr=LR)

    model, opt = model_and_optimizer()
    model(batch, labels=batch).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/{name}")
    fresh, fresh_opt = model_and_optimizer()
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": fmsd, "optim": fosd}, checkpoint_id=f"{tmp}/{name}")
    set_state_dict(fresh, fresh_opt, model_state_dict=fmsd, optim_state_dict=fosd)

    def hp(t):  # a float8 expert weight's hp tensor
        return getattr(t, "_tensor", t).detach()

    sharded = {id(p) for p in expert_parallel_parameters(model)}
    loaded = dict(fresh.named_parameters())
    same, saved_as = {}, {}
    for n, p in model.named_parameters():
        if id(p) in sharded:
            q = loaded[n]
            states = [(opt.state[p][k], fresh_opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq")]
            same[n] = bit_equal(hp(p), hp(q)) and all(bit_equal(a, b) for a, b in states)
            saved_as[n] = (type(msd[n]).__name__, tuple(msd[n].shape))
    return {"same": same, "saved_as": saved_as}


def _worker_ep_hf(rank: int, world: int, tmp: str) -> dict:
    group = dist.group.WORLD
    res: dict = {}
    ids = _batch(world)
    for name in MODELS:
        for setup in SETUPS:
            res[f"{name}/{setup}/block"] = block_check(rank, world, name, setup)
        res[f"{name}/float8_converted_first/block"] = block_check(rank, world, name, "float8", True)
        res[f"{name}/float8/ep_losses"] = train(build(name, "float8", group), ids, group=group)
        res[f"{name}/bf16/ep_losses"] = train(build(name, "bf16", group), ids, group=group)
        if rank == 0:  # the one-rank reference: every expert, the whole batch
            res[f"{name}/float8/one_rank_losses"] = train(build(name, "float8"), ids)
    res["refusals"] = refusals(group)
    res["checkpoint"] = {name: checkpoint_round_trip(name, group, tmp) for name in MODELS}
    return res


def refusals(group) -> dict:
    """The errors ``shard_hf_experts`` raises (None where it did not)."""
    cases = {
        "experts_not_divisible": lambda m: None,
        "transformers_ep": lambda m: setattr(m, "_is_expert_parallel", True),
        "post_expert_norm": lambda m: setattr(m, "has_post_expert_norm", True),
    }
    out = {}
    for case, spoil in cases.items():
        model = qwen3_moe(experts=3 if case == "experts_not_divisible" else 4)
        spoil(model.model.layers[1].mlp.experts)
        try:
            shard_hf_experts(model, group)
            out[case] = None
        except (ValueError, NotImplementedError) as e:
            out[case] = str(e)
        # nothing is cut when a module is refused
        out[case + "_untouched"] = model.model.layers[0].mlp.experts.gate_up_proj.size(0)
    model = build("qwen3_moe", "float8", group)
    try:
        shard_hf_experts(model, group)
        out["twice"] = None
    except ValueError as e:
        out["twice"] = str(e)
    return out


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def report(results: list[dict]) -> dict:
    """Per model: the largest relative loss difference EP vs one rank (float8 experts),
    and the float8 EP losses next to the bf16 EP ones."""
    res = results[0]
    out = {}
    for name in MODELS:
        ep, one = res[f"{name}/float8/ep_losses"], res[f"{name}/float8/one_rank_losses"]
        bf16 = res[f"{name}/bf16/ep_losses"]
        out[name] = {
            "ep_vs_one_rank_max_rel": _max_rel(ep, one),
            "float8_ep": ep,
            "one_rank_float8": one,
            "bf16_ep": bf16,
            "float8_vs_bf16_ep_max_rel": _max_rel(ep, bf16),
        }
    return out
