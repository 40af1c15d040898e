"""FSDP2 float8 all-gather (float8kit/fsdp.py) and the precompute_scales skeleton.

Multi-process tests run real FSDP2 on CPU with gloo, 2 or 3 ranks. To keep startup cost down,
each rank group runs once per module (a module-scoped fixture) and records numbers; the
tests below it assert them against references: single-device float8 training (losses), the
bf16 all-gather (bytes), the full weight's amax (scales), eager (compile), the run before a
checkpoint (resume).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import float8kit
from benchmarks.measures.gloo import (
    DELAYED_AG,
    FP8_AG,
    STATIC_AG,
    _bitwise,
    _Count,
    _data,
    _fp8_weights,
    _net,
    _OneRank,
    _rel_diff,
    _shard,
    _train,
    spawn,
)
from float8kit import (
    CastConfig,
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit.distributed.fsdp import Float8AllGatherWeight
from float8kit.linear import Float8Linear
from float8kit.tensor import Float8TrainingTensor
from tests.helpers import recipes

# ---------------------------------------------------------------------------- launcher


@pytest.fixture(scope="module")
def train2(tmp_path_factory):
    return spawn("benchmarks.measures.fsdp:_worker_train", 2, tmp_path_factory.mktemp("train2"))


@pytest.fixture(scope="module")
def uneven3(tmp_path_factory):
    return spawn("benchmarks.measures.fsdp:_worker_uneven", 3, tmp_path_factory.mktemp("uneven3"))


# ---------------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
def test_losses_match_single_device_fp32(train2):
    r = train2[0]
    diff = _rel_diff(r["fp32"], r["ref_fp32"])
    print(f"fp32 FSDP2 float8 all-gather vs single device: max rel loss diff {diff:.2e}")
    assert diff < 0.02
    # Both ranks see the same global loss.
    assert _bitwise(train2[1]["fp32"], r["fp32"])
    # With the same batch on every rank, the sharded float8 all-gather trains bitwise like one
    # device: the gathered fp8 weight and its scale are exactly the single-device cast.
    assert _bitwise(r["fp32_replicated_data"], r["ref_fp32"])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["delayed", "static"])
def test_delayed_and_static_weights_with_float8_all_gather(train2, policy):
    for r in train2:
        # Same batch on every rank: bitwise the single-device run of the same config.
        assert _bitwise(r[f"{policy}_replicated_data"], r[f"{policy}_ref"])
        diff = _rel_diff(r[f"{policy}_split"], r[f"{policy}_ref"])
        print(f"{policy} weight, FSDP2 float8 all-gather vs one device: max rel diff {diff:.2e}")
        assert diff < 0.02
        # delayed: all amax records (weight shards, inputs, grad_outputs) in one all-reduce;
        # static: nothing to reduce. Neither all-reduces in forward/backward once set.
        assert r[f"{policy}_precompute_all_reduces"] == (1 if policy == "delayed" else 0)
        assert r[f"{policy}_fwd_bwd_all_reduces"] == 0
        assert r[f"{policy}_steady_host_reads"] == []


@pytest.mark.slow
def test_hook_scale_path_equals_precomputed_path(train2):
    # Without precompute_scales the hook all-reduces each weight's amax itself: same scales,
    # so bitwise the same training.
    r = train2[0]
    assert _bitwise(r["fp32_no_precompute"], r["fp32"])
    assert r["forward_all_reduces_without_precompute"] == 4  # one per float8 weight


@pytest.mark.slow
def test_losses_match_single_device_bf16_mixed_precision(train2):
    r = train2[0]
    diff = _rel_diff(r["bf16"], r["ref_bf16"])
    print(f"bf16 MixedPrecisionPolicy, reshard_after_forward=False: max rel diff {diff:.2e}")
    assert diff < 0.02


@pytest.mark.slow
def test_all_gather_bytes_half_of_bf16(train2):
    r = train2[0]
    ratio = r["all_gather_bytes_fp8"] / r["all_gather_bytes_bf16"]
    print(
        f"all-gathered bytes, one fwd+bwd: fp8 {r['all_gather_bytes_fp8']} / bf16 "
        f"{r['all_gather_bytes_bf16']} = {ratio:.3f} ({r['all_gather_calls_fp8']} all-gathers)"
    )
    assert r["all_gather_calls_fp8"] == r["all_gather_calls_bf16"]
    assert ratio <= 0.55


@pytest.mark.slow
def test_precompute_one_collective_and_full_weight_scales(train2):
    for r in train2:
        assert r["precompute_all_reduces"] == 1
        assert r["fwd_bwd_all_reduces_after_precompute"] == 0
        assert r["steady_host_reads"] == []
        # Bitwise: the scale of the full, unsharded weight's amax.
        assert _bitwise(r["precomputed_scales"], r["full_weight_scales"])
        assert len(r["precomputed_scales"]) == 4


@pytest.mark.slow
def test_state_dict_optimizer_and_grads_see_plain_hp(train2):
    for r in train2:
        for key in ("state_dict_types", "optim_state_types", "grad_types"):
            assert r[key] == ["DTensor(Tensor)"], key
        # Gradient clipping works on the sharded grads: clipped to the max norm.
        assert r["clipped_norm"] == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.slow
def test_optimizer_matched_by_data_ptr_updates_every_parameter_once(train2):
    # Wrapper subclasses own no storage: their data_ptr() was 0 for every float8 weight, and
    # a trainer matching optimizer params by pointer held one weight 4 times, 3 never updated.
    for r in train2:
        d = r["optimizer_by_data_ptr"]
        assert d["distinct_nonzero_ptrs"] == d["params"] == 10
        assert d["held"] == d["held_distinct"] == 10
        assert d["unchanged"] == []


@pytest.mark.slow
def test_stale_precomputed_scale_is_not_used(train2):
    for r in train2:
        assert r["stale_warned"]
        assert r["stale_forward_all_reduces"] == 4
        assert r["stale_vs_fresh_max_abs_diff"] == 0.0


@pytest.mark.slow
def test_update_through_data_is_reported_at_the_next_precompute(train2):
    for r in train2:
        assert r["data_update_normal_step_warnings"] == []
        assert r["data_update_hook_warnings"] == []  # the hook cannot know: no collective
        stale = [w for w in r["data_update_precompute_warnings"] if "stale scale" in w]
        assert len(stale) == 1 and "layers.1.fc2 changed after precompute_scales" in stale[0]
        # what the warning is about: the stale scale clipped the 8x larger weight
        assert r["data_update_stale_vs_fresh_rel_diff"] > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["inf", "nan"])
@pytest.mark.parametrize("path", ["hook", "precompute"])
def test_nonfinite_weight_shard_stays_visible(train2, bad, path):
    for r in train2:
        assert r[f"finite_{float(bad)}_{path}"] is False


# ---------------------------------------------------------------------------- 3 ranks


@pytest.mark.slow
def test_uneven_and_empty_shards_all_float8_groups(uneven3):
    assert [r["local_rows"] for r in uneven3] == [[347, 6, 1], [347, 6, 1], [346, 4, 0]]
    r = uneven3[0]
    diff = _rel_diff(r["uneven"], r["ref"])
    print(f"3 ranks, uneven + empty shards: max rel loss diff {diff:.2e}")
    assert diff < 0.02
    assert _bitwise(r["uneven_no_precompute"], r["uneven"])
    assert _bitwise(r["uneven_replicated_data"], r["ref"])  # as in the 2-rank test


@pytest.mark.slow
def test_dcp_round_trip_and_bitwise_resume(uneven3):
    for r in uneven3:
        assert r["state_dict_types"] == ["DTensor(Tensor)"]
        assert r["before_load_max_diff"] > 0  # the fresh model really started elsewhere
        assert r["loaded_max_diff"] == 0.0
        assert r["weights_still_subclass"]
        assert _bitwise(r["resumed"], r["after"])


# ---------------------------------------------------------------------------- compile


@pytest.fixture(scope="module")
def compile2(tmp_path_factory):
    return spawn("benchmarks.measures.fsdp:_worker_compile", 2, tmp_path_factory.mktemp("compile2"))


@pytest.mark.slow
def test_compiled_blocks_match_eager(compile2):
    r = compile2[0]
    assert r["compiled_frames"] >= 1 and r["graph_breaks"] == 0
    assert _bitwise(r["compiled"], r["eager"])  # fp32 weights: no bf16 rounding to fuse away


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("setup", ["block", "whole"])
def test_compile_with_activation_checkpointing(compile2, setup, recipe):
    # The backward re-gather refills the weight's scale; it must not invalidate the scale a
    # compiled, checkpointed forward saved (it used to raise "modified by an inplace
    # operation" in backward).
    for r in compile2:
        losses = r[f"ac_{setup}_{recipe}"]
        assert isinstance(losses, list), losses
        diff = _rel_diff(losses, r[f"ac_ref_{recipe}"])
        print(f"{setup} compile + AC, {recipe}: max rel loss diff vs one device eager {diff:.2e}")
        assert diff < 1e-3


# ---------------------------------------------------------------------------- one process


def test_both_conversion_paths_install_the_weight_subclass():
    model = _net(FP8_AG)
    assert all(isinstance(m.weight, Float8AllGatherWeight) for m in _fp8_weights(model))
    root = convert_to_float8_training(nn.Linear(32, 16), config=FP8_AG)
    assert isinstance(root.weight, Float8AllGatherWeight)
    assert isinstance(Float8Linear(32, 16, config=FP8_AG).weight, Float8AllGatherWeight)
    assert not isinstance(_net(Float8LinearConfig()).layers[0].fc1.weight, Float8AllGatherWeight)


def test_weight_subclass_is_transparent_on_one_device():
    # Without FSDP the subclass changes nothing: bitwise the same training as without it.
    xs, ys = _data(3, 16, 64, 16)
    plain, _ = _train(_net(Float8LinearConfig()), xs, ys, 3)
    wrapped_model = _net(FP8_AG)
    wrapped, opt = _train(wrapped_model, xs, ys, 3)
    assert wrapped == plain
    w = wrapped_model.layers[0].fc1.weight
    assert isinstance(w, Float8AllGatherWeight)
    # Optimizer states, gradients and the state_dict see plain tensors.
    assert {type(v) for s in opt.state.values() for v in s.values()} == {torch.Tensor}
    assert {type(v) for v in wrapped_model.state_dict().values()} == {torch.Tensor}
    sd = wrapped_model.state_dict()
    assert sd["layers.0.fc1.weight"].data_ptr() == w._tensor.data_ptr()


class _Tied(nn.Module):
    """An embedding, two linears sharing one weight, and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)
        self.b.weight = self.a.weight
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.b(F.relu(self.a(self.emb(tokens)))))


def test_tied_weights_stay_tied_or_are_refused():
    tokens = torch.randint(0, 32, (3, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, config in (("plain", Float8LinearConfig()), ("fp8_ag", FP8_AG)):
        torch.manual_seed(0)
        model = convert_to_float8_training(
            _Tied(), config=config, module_filter_fn=lambda m, fqn: fqn != "head"
        )
        assert model.a.weight is model.b.weight  # one parameter, wrapped once
        assert len(list(model.parameters())) == 2  # emb(=head), a(=b): as before conversion
        losses[name], _ = _train(model, tokens, targets, 3)
    assert _bitwise(losses["fp8_ag"], losses["plain"])  # AdamW updated each weight once
    # A converted weight tied to a module that stays hp would be untied: refused, by name.
    with pytest.raises(ValueError, match=r"emb\.weight is tied to the weight of head"):
        convert_to_float8_training(_Tied(), config=FP8_AG, module_filter_fn=lambda m, f: True)


def test_weight_subclass_ops():
    hp = torch.randn(10, 4)
    w = Float8AllGatherWeight(hp.clone(), FP8_AG)
    kept = {
        "new_zeros": w.new_zeros(12, 4),
        "slice": w[2:5],
        "view": w.view(-1),
        "as_strided": torch.as_strided(w, (2, 4), (4, 1)),
        "split": torch.chunk(w, 3)[1],
        "to": w.to(torch.bfloat16),
        "clone": w.clone(),
        "detach": w.detach(),
        "empty_like": torch.empty_like(w),
    }
    for name, t in kept.items():
        assert isinstance(t, Float8AllGatherWeight), name
    assert torch.equal(kept["slice"]._tensor, hp[2:5])
    assert kept["to"].dtype == torch.bfloat16
    for plain in (w * 2, torch.zeros_like(w), w.abs(), w.sum()):
        assert type(plain) is torch.Tensor
    assert torch.equal(w * 2, hp * 2)
    # In-place ops run on the hp tensor and return the wrapper.
    assert w.mul_(2) is w
    torch._foreach_add_([w], [torch.ones_like(hp)])
    assert torch.equal(w._tensor, hp * 2 + 1)
    padded = w.new_zeros(12, 4)
    padded[:10].copy_(w)
    assert torch.equal(padded._tensor[:10], w._tensor)


def test_precompute_without_fp8_all_gather_weights_issues_no_collective():
    with _Count("all_reduce") as ar:
        precompute_scales(_net(FP8_AG))  # not sharded: nothing to precompute
    assert ar.calls == 0


def test_tensorwise_fp8_all_gather_needs_one_cast_for_both_gemms():
    # One tensorwise cast is gathered for both gemms (rowwise: tests/test_fsdp_rowwise.py).
    # (grad_output in e4m3, so the e5m2 weight cast is a legal gemm and only the all-gather
    # rule can refuse it.)
    e4m3 = CastConfig(target_dtype=torch.float8_e4m3fn)
    e5m2 = CastConfig(target_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="cast_config_weight_for_grad_input must equal"):
        Float8LinearConfig(
            cast_config_grad_output=e4m3,
            cast_config_weight_for_grad_input=e5m2,
            enable_fsdp_float8_all_gather=True,
        )


@pytest.mark.parametrize("policy", ["dynamic", "delayed", "static"])
def test_all_gather_scale_comes_from_operand_scale(monkeypatch, policy):
    # One scale decision: the FSDP2 hook asks operand_scale, as the gemms' casts do, and gets
    # the scale the layer's own forward cast of the full weight would use.
    config = {"dynamic": FP8_AG, "delayed": DELAYED_AG, "static": STATIC_AG}[policy]
    module = Float8Linear(16, 6, bias=False, config=config)
    w = module.weight
    state = module.fp8_state.operand(module, float8kit.GemmRole.WEIGHT, False)
    ref = float8kit.cast.cast_to_float8(
        w._tensor, config.cast_config_weight, float8kit.GemmRole.WEIGHT, -1, config, *state
    )
    real, calls = float8kit.cast.operand_scale, []

    def spy(cast, *args, **kwargs):
        calls.append(cast.scaling_type)
        return real(cast, *args, **kwargs)

    monkeypatch.setattr(float8kit.cast, "operand_scale", spy)
    _, (scale,) = w.fsdp_pre_all_gather(_OneRank(), w.shape, (16, 1), module, None)
    assert calls == [config.cast_config_weight.scaling_type]
    assert torch.equal(scale, ref._scale)
    assert not hasattr(module, "_scale_for")  # the old, unused second path is gone


def test_post_all_gather_builds_the_float8_weight():
    # The two hooks on one rank (world size 1 needs no collective when the scale is fresh).
    hp = torch.randn(6, 16)
    module = Float8Linear(16, 6, bias=False, config=FP8_AG)
    w = module.weight
    with torch.no_grad():
        w.copy_(hp)
    (data,), meta = w.fsdp_pre_all_gather(_OneRank(), hp.shape, (16, 1), module, None)
    assert data.dtype == torch.uint8 and data.shape == hp.shape
    weight, (inner,) = w.fsdp_post_all_gather((data,), meta, torch.bfloat16)
    assert isinstance(weight, Float8TrainingTensor) and weight.dtype == torch.bfloat16
    assert inner.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    ref = float8kit.cast.cast_to_float8(
        hp, FP8_AG.cast_config_weight, float8kit.GemmRole.WEIGHT, -1, FP8_AG
    )
    assert torch.equal(weight._data.view(torch.uint8), ref._data.view(torch.uint8))
    assert torch.equal(weight._scale, ref._scale)
    # Later all-gathers update the scale in place, without a version bump: autograd may hold
    # it as a saved tensor (compile + activation checkpointing), like the refilled data.
    scale, version = ref._scale, weight._scale._version
    assert w.fsdp_post_all_gather((data,), (scale * 2,), torch.bfloat16, out=weight) is None
    assert torch.equal(weight._scale, scale * 2)
    assert weight._scale._version == version


def test_precompute_splits_the_reduced_amaxes_back_per_contribution(monkeypatch):
    # The contract shared with other providers (delayed scaling): each apply gets back the
    # slice of the concatenated amaxes its contribution put in (unchanged on one process).
    got = {}

    def provider(name, values):
        def contributions(module):
            return [(torch.tensor(values), lambda reduced: got.setdefault(name, reduced.tolist()))]

        return contributions

    monkeypatch.setattr(
        float8kit.precompute,
        "_PROVIDERS",
        [provider("a", [1.0, 2.0]), lambda module: [], provider("b", [3.0])],
    )
    precompute_scales(nn.Linear(2, 2))
    assert got == {"a": [1.0, 2.0], "b": [3.0]}


# ---------------------------------------------------------------------------- a single rank


def test_set_hp_forward_keeps_the_precomputed_all_gather_scale(one_rank_group):
    """After ``set_hp_forward`` the weight is still gathered in float8 with the config it was
    sharded with (docs/numerics.md): ``precompute_scales`` keeps computing its scale from that
    config, and the all-gather uses it (it skipped the switched layers, and every step warned
    that the weight changed after precompute_scales)."""
    from torch.distributed.fsdp import fully_shard

    gather = dataclasses.replace(
        Float8LinearConfig.from_recipe_name("tensorwise"), enable_fsdp_float8_all_gather=True
    )
    model = convert_to_float8_training(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)), config=gather
    )
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=one_rank_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for step in range(4):
            if step == 2:
                assert float8kit.set_hp_forward(model) == 2
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            precompute_scales(model)
            kept = model[0].fp8_state.all_gather_scale
            assert kept is not None and kept.fresh(model[0].weight, backward=False)


def _train_updates(model, xs, ys, update: str, precompute_after: set[int]):
    """Losses of AdamW steps (``update``: "foreach", "fused", or "param.data": the default
    optimizer, then every parameter halved through ``param.data``, an EMA-like update
    after any ``precompute_scales``), with ``precompute_scales`` after the steps in
    ``precompute_after``; and the warnings."""
    fused = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(update, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **fused)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(len(xs)):
            loss = F.mse_loss(model(xs[step]), ys[step])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step in precompute_after:
                precompute_scales(model)
            if update == "param.data":
                for p in model.parameters():
                    p.data.mul_(0.5)
            losses.append(loss.item())
    return losses, [str(w.message) for w in caught]


@pytest.mark.parametrize("recipe", ["tensorwise", "nvfp4"])
@pytest.mark.parametrize("update", ["foreach", "fused"])
@pytest.mark.parametrize("precompute_after", [(), (0,)], ids=["never", "first step"])
def test_one_rank_float8_all_gather_sees_foreach_and_fused_updates(
    one_rank_group, recipe, update, precompute_after
):
    """A foreach or fused optimizer (CUDA's default) updates a parameter without moving its
    version: neither the scale an NVFP4 hook kept for its backward re-gather nor a
    precomputed one may serve a later step's forward (the losses left the unsharded run's
    from step 2)."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    gather = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    xs, ys = _data(4, 8, 128, 16)
    model = _net(gather, dim=128, hidden=256, n_blocks=1)
    _shard(model, one_rank_group, model.layers)
    losses, _ = _train_updates(model, xs, ys, update, set(precompute_after))
    ref, _ = _train_updates(_net(config, dim=128, hidden=256, n_blocks=1), xs, ys, update, set())
    assert _bitwise(losses, ref), (losses, ref)


@pytest.mark.parametrize("recipe", ["tensorwise", "nvfp4"])
def test_one_rank_param_data_update_after_precompute_is_reported(one_rank_group, recipe):
    """An update through ``param.data`` after ``precompute_scales`` moves no signal: the
    next step's all-gather uses the stale scale, and the next ``precompute_scales`` names
    the layer (NVFP4 said nothing)."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    gather = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    xs, ys = _data(3, 8, 128, 16)
    model = _net(gather, dim=128, hidden=256, n_blocks=1)
    _shard(model, one_rank_group, model.layers)
    _, warned = _train_updates(model, xs, ys, "param.data", {0, 1, 2})
    stale = [w for w in warned if "without a version bump" in w]
    assert len(stale) == 2 and all("layers.0.fc1" in w for w in stale), warned


@pytest.mark.parametrize("recipe", recipes(lambda caps: caps.fsdp_float8_all_gather))
def test_one_rank_float8_all_gather_equals_unsharded(recipe):
    # World size 1 (one GPU, or a 1-D mesh of one): FSDP2 copies only the first all-gather
    # input and still runs both hooks, so a recipe whose scales travel as a second input
    # (blockwise) must send them another way. Same casts as one device: bitwise losses.
    from torch.distributed.device_mesh import init_device_mesh

    config = Float8LinearConfig.from_recipe_name(recipe)
    gather = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    dim = 128  # whole 128x128 blocks
    xs, ys = _data(3, 8, dim, 16)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = _net(gather, dim=dim, hidden=2 * dim, n_blocks=1)
        _shard(model, mesh, model.layers)
        losses, _ = _train(model, xs, ys, 3)
        gathered = model.layers[0].fc1.weight  # resharded after backward: the hp shard
        unsharded = _net(config, dim=dim, hidden=2 * dim, n_blocks=1)
        ref, _ = _train(unsharded, xs, ys, 3, sharded=False)
    finally:
        dist.destroy_process_group()
    assert type(gathered.to_local()).__name__ == "Float8AllGatherWeight"
    assert _bitwise(losses, ref), (losses, ref)
