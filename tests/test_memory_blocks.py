"""Activation memory on real transformer blocks: an HF ``LlamaDecoderLayer`` (built from a
``LlamaConfig``, no download) and the recipes' ``Block``, every recipe, without activation
checkpointing, with ``recompute_norms``, with ``checkpoint_policy`` and with full
checkpointing; against the same block in bf16 without checkpointing. Gradients are bitwise
those of per-layer casts (no shared cast, the float8 weight kept for backward)."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch._inductor.config as inductor_config

import float8kit
from benchmarks.measures.memory_blocks import (
    BLOCKS,
    DIM,
    NO_AC_MAX,
    POLICY_MAX,
    RECIPES,
    _CountFloat8Casts,
    _run,
    hf_block,
    memory_table,
    recipes_model,
)
from float8kit import Float8LinearConfig, GemmRole, linear, shared_cast
from float8kit.cast import cast_to_float8
from float8kit.config import FP8_DTYPES
from tests.helpers import COMPILE_IS_BITWISE, sqnr


def _row(rows, recipe, mode):
    return next(r for r in rows if r["recipe"] == recipe and r["mode"] == mode)


@pytest.fixture(scope="module")
def hf_table():
    return memory_table(kinds=("hf_llama",), modes=("none", "recompute_norms", "policy"))


def test_hf_block_keeps_less_than_bf16_without_checkpointing(hf_table):
    rows = hf_table["blocks"]["hf_llama"]
    for recipe in RECIPES:
        for mode in ("none", "recompute_norms", "policy"):
            r = _row(rows, recipe, mode)
            # never more than bf16, in all at 128 tokens (a float8 weight copy kept per
            # layer would count here: none is) and per token
            assert r["total_ratio_vs_bf16"] <= 1.0, r
            assert r["ratio_vs_bf16"] <= 1.0, r
    # one float8 copy of the q/k/v input and one of the gate/up input (delayed: their input
    # states tied): every recipe but the hp-grad_weight one reaches the target without help
    # (a copy per layer kept 0.98x), and with the norms recomputed
    for recipe in ("tensorwise", "rowwise", "blockwise", "delayed", "mxfp8"):
        assert _row(rows, recipe, "none")["ratio_vs_bf16"] <= NO_AC_MAX, recipe
    for recipe in ("tensorwise", "rowwise", "blockwise", "delayed", "mxfp8"):
        assert _row(rows, recipe, "recompute_norms")["ratio_vs_bf16"] <= NO_AC_MAX, recipe
    for recipe in ("tensorwise", "rowwise", "mxfp8"):
        # the policy keeps the float8 gemms' hp outputs and the block input, and recomputes
        # the input casts with the norms, attention and SwiGLU they read (keeping the casts
        # too measured 0.61x)
        assert _row(rows, recipe, "policy")["ratio_vs_bf16"] <= POLICY_MAX, recipe
    # mxfp8 keeps what rowwise keeps: the input's float8 copy for grad_weight, quantized
    # along the tokens (1 byte + an e8m0 byte per 32 tokens per element; rowwise: 1 byte + a
    # 4-byte scale per column): measured 0.922x (rowwise 0.919x) without checkpointing,
    # 0.489x (0.489x) with the policy
    for mode in ("none", "policy"):
        mx, row = _row(rows, "mxfp8", mode), _row(rows, "rowwise", mode)
        assert abs(mx["ratio_vs_bf16"] - row["ratio_vs_bf16"]) < 0.01, (mode, mx, row)


def test_recipes_block_meets_the_targets():
    rows = memory_table(
        kinds=("recipes",), recipes=("tensorwise", "rowwise", "mxfp8"), modes=("none", "policy")
    )["blocks"]["recipes"]
    for recipe in ("tensorwise", "rowwise", "mxfp8"):
        assert _row(rows, recipe, "none")["ratio_vs_bf16"] <= NO_AC_MAX, recipe
        assert _row(rows, recipe, "policy")["ratio_vs_bf16"] <= POLICY_MAX, recipe


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_bitwise_per_layer_casts(kind, recipe, monkeypatch):
    """Shared casts, the weight re-cast in backward and recomputed norms change no bit of
    the gradients against per-layer casts with the float8 weight kept (the code before
    them)."""

    def grads(block, forward, dtype, mode):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 128, DIM, generator=g, dtype=dtype).requires_grad_()
        out = _run(block, forward, x, mode)
        go = torch.randn(out.shape, generator=g, dtype=out.dtype)
        out.backward(go)
        return [x.grad, *(p.grad for p in block.parameters())]

    block, forward, dtype = BLOCKS[kind](recipe)
    norms = copy.deepcopy(block)
    assert len(float8kit.recompute_norms(norms)) == 2
    policy = copy.deepcopy(block)
    with monkeypatch.context() as m:
        m.setattr(shared_cast, "source_for", lambda t: None)
        m.setattr(linear, "_RECAST_WEIGHT", False)
        ref = grads(copy.deepcopy(block), forward, dtype, "none")
    for got in (
        grads(block, forward, dtype, "none"),
        grads(norms, forward, dtype, "none"),
        grads(policy, forward, dtype, "policy"),
    ):
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b)


def test_shared_cast_is_one_storage_and_follows_versions():
    # q/k/v keep one float8 copy of their shared input; an in-place change makes a new cast
    lins = [float8kit.Float8Linear(DIM, 64, config=Float8LinearConfig()).bfloat16() for _ in "qkv"]
    x = torch.randn(128, DIM, dtype=torch.bfloat16, requires_grad=True)
    h = x * 2
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = [lin(h) for lin in lins[:2]]
        h.mul_(3)  # a new version: the third layer casts again
        outs.append(lins[2](h))
    fp8 = [t for t in saved if isinstance(t, float8kit.Float8TrainingTensor)]
    assert len(fp8) == 3
    assert fp8[0] is fp8[1] and fp8[2] is not fp8[0]
    c = lins[2].config
    ref = cast_to_float8(h.detach(), c.cast_config_input, GemmRole.INPUT, -1, c)
    assert torch.equal(fp8[2]._data.view(torch.uint8), ref._data.view(torch.uint8))
    assert not torch.equal(fp8[0]._data.view(torch.uint8), ref._data.view(torch.uint8))


def test_shared_cast_lives_no_longer_than_its_input():
    # the copy q/k share is held for the next reader of the same tensor only while that
    # tensor lives: once it and the graph are gone, the float8 copy is freed
    lins = [float8kit.Float8Linear(DIM, 64, config=Float8LinearConfig()).bfloat16() for _ in "qk"]
    h = torch.randn(128, DIM, dtype=torch.bfloat16, requires_grad=True) * 2
    refs = []

    def pack(t):
        if isinstance(t, float8kit.Float8TrainingTensor):
            refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = sum(lin(h).float().sum() for lin in lins)
    assert len(refs) == 2 and refs[0]() is refs[1]() is not None
    loss.backward()
    del loss, h
    gc.collect()
    assert refs[0]() is None


def test_recompute_norms_keeps_the_module_tree_and_is_idempotent():
    block, _, _ = hf_block("tensorwise")
    keys = list(block.state_dict())
    names = float8kit.recompute_norms(block)
    assert names == ["input_layernorm", "post_attention_layernorm"]
    assert float8kit.recompute_norms(block) == names  # again: nothing new
    assert list(block.state_dict()) == keys
    assert type(block.input_layernorm).__name__ == "LlamaRMSNorm"
    assert float8kit.recompute_norms(block, lambda m, fqn: False) == names
    lone = recipes_model.RMSNorm(DIM, 1e-5)
    assert float8kit.recompute_norms(lone) == [""]


def test_train_memory_report(capsys):
    import train

    train.main(["--preset", "tiny", "--float8", "rowwise", "--memory", "--batch-size", "2"])
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    ratios = {s.split("  ")[0]: float(s.split()[-1].rstrip("x")) for s in map(str.strip, lines)}
    assert ratios["bf16"] == 1.0
    assert ratios["rowwise + recompute_norms"] < ratios["rowwise"] < 1.0
    assert ratios["bf16 + recompute_norms"] < 1.0


def _delayed_steps(block, forward, mode, steps, seed, tie=True):
    """``steps`` SGD steps of a delayed block with precompute_scales after each: per step
    the input grad, every parameter's grad and every float8 state buffer."""
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    out = []
    with pytest.MonkeyPatch.context() as m:
        if not tie:
            m.setattr(shared_cast, "source_for", lambda t: None)
        for _ in range(steps):
            x = torch.randn(2, 64, DIM, generator=g, dtype=torch.bfloat16).requires_grad_()
            y = _run(block, forward, x, mode)
            y.backward(torch.randn(y.shape, generator=g, dtype=y.dtype))
            state = {k: v.clone() for k, v in block.state_dict().items() if "fp8_" in k}
            out.append((x.grad, [p.grad.clone() for p in block.parameters()], state))
            opt.step()
            opt.zero_grad()
            float8kit.precompute_scales(block)
    return out


def _assert_steps_equal(got, ref):
    assert len(got) == len(ref)
    for (gx, gp, gs), (rx, rp, rs) in zip(got, ref, strict=True):
        assert torch.equal(gx, rx)
        for a, b in zip(gp, rp, strict=True):
            assert torch.equal(a, b)
        assert gs.keys() == rs.keys()
        for k in gs:
            assert torch.equal(gs[k], rs[k]), k


def _ties(block) -> int:
    return len(
        {
            id(m.fp8_state.tie)
            for m in block.modules()
            if isinstance(m, float8kit.Float8Linear) and m.fp8_state.tie is not None
        }
    )


def _input_scales(block):
    return [m.fp8_scale_input for m in block.modules() if isinstance(m, float8kit.Float8Linear)]


@pytest.mark.parametrize("mode", ["none", "policy", "full"])
def test_delayed_fan_out_shares_one_state_and_cast_bitwise(mode):
    """q/k/v and gate/up tie their DELAYED input state at the first forward (equal initial
    states, one tensor read) and then share one float8 cast, step after step: over steps
    with precompute_scales, under activation checkpointing, every grad and every scale
    buffer is bitwise that of per-layer state and casts."""
    block, forward, _ = hf_block("delayed")
    ref_block = copy.deepcopy(block)
    got = _delayed_steps(block, forward, mode, 3, seed=2)
    ref = _delayed_steps(ref_block, forward, mode, 3, seed=2, tie=False)
    _assert_steps_equal(got, ref)
    attn, mlp = block.self_attn, block.mlp
    ties = [m.fp8_state.tie for m in block.modules() if isinstance(m, float8kit.Float8Linear)]
    assert attn.q_proj.fp8_state.tie is attn.k_proj.fp8_state.tie is attn.v_proj.fp8_state.tie
    assert mlp.gate_proj.fp8_state.tie is mlp.up_proj.fp8_state.tie
    assert len({id(t) for t in ties if t is not None}) == 2 and ties.count(None) == 2
    # each layer keeps its own buffers (no tensor under two state_dict keys)
    assert len({id(s) for s in _input_scales(block)}) == 7
    # after 3 updates the tied layers still share one float8 copy of their input: 4 input
    # copies kept for backward (q/k/v's, o's, gate/up's, down's), where per-layer casts keep 7
    x = torch.randn(2, 64, DIM, dtype=torch.bfloat16, requires_grad=True)
    for b, n in ((block, 4), (ref_block, 7)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: None):
            with pytest.MonkeyPatch.context() as m:
                if b is ref_block:
                    m.setattr(shared_cast, "source_for", lambda t: None)
                forward(b, x)
        copies = {id(t) for t in saved if isinstance(t, float8kit.Float8TrainingTensor)}
        assert len(copies) == n
    # state_dict: every layer's keys, tied ones with the same values
    sd, ref_sd = block.state_dict(), ref_block.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k in sd:
        assert torch.equal(sd[k], ref_sd[k]), k


def test_delayed_tie_survives_checkpoints(tmp_path):
    """A checkpoint of a tied block (torch.save, DCP) loads into a fresh block, which ties
    again at its first forward and trains on bitwise as the per-layer block does; loading
    unties first, so a tie never mixes two layers' loaded values."""
    import io

    import torch.distributed.checkpoint as dcp

    block, forward, _ = hf_block("delayed")
    ref_block = copy.deepcopy(block)
    _delayed_steps(block, forward, "none", 2, seed=3)
    _delayed_steps(ref_block, forward, "none", 2, seed=3, tie=False)
    ref = _delayed_steps(ref_block, forward, "none", 2, seed=4, tie=False)

    buf = io.BytesIO()
    torch.save(block.state_dict(), buf)
    buf.seek(0)
    fresh, _, _ = hf_block("delayed")
    fresh.load_state_dict(torch.load(buf))
    assert _ties(fresh) == 0  # untied until it runs
    _assert_steps_equal(_delayed_steps(fresh, forward, "none", 2, seed=4), ref)
    assert _ties(fresh) == 2

    dcp.save(block.state_dict(), checkpoint_id=tmp_path)
    fresh, _, _ = hf_block("delayed")
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=tmp_path)
    fresh.load_state_dict(sd)
    _assert_steps_equal(_delayed_steps(fresh, forward, "none", 2, seed=4), ref)

    # loading different values into a tied layer unties it: each keeps its own
    sd = block.state_dict()
    sd["self_attn.k_proj.fp8_scale_input"] = torch.tensor(0.5)
    block.load_state_dict(sd)
    attn = block.self_attn
    assert attn.k_proj.fp8_state.tie is None
    assert float(attn.k_proj.fp8_scale_input) == 0.5 != float(attn.q_proj.fp8_scale_input)


def test_delayed_layers_with_unequal_state_do_not_tie():
    # equal scale, different amax history: two layers reading one tensor keep their own
    # state and casts (compared once; again only after a scale update)
    lins = [
        float8kit.Float8Linear(DIM, 64, config=Float8LinearConfig.from_recipe_name("delayed"))
        for _ in range(2)
    ]
    lins[1].fp8_amax_history_input[1] = 3.0
    x = torch.randn(128, DIM, requires_grad=True)
    h = x * 2
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        for lin in lins:
            lin(h)
    fp8 = [t for t in saved if isinstance(t, float8kit.Float8TrainingTensor)]
    assert len(fp8) == 2 and fp8[0] is not fp8[1]
    assert lins[0].fp8_state.tie is lins[1].fp8_state.tie is None
    assert lins[1].fp8_state.tie_refused[1:] == (
        lins[0].fp8_scale_input._version,
        lins[1].fp8_scale_input._version,
    )


@pytest.mark.slow
def test_compiled_block_casts_each_shared_input_once_and_keeps_no_float8():
    """Under torch.compile no shared-cast cache runs, and none is needed: AOTAutograd's
    common-subexpression elimination merges the identical casts of the tensor q/k/v read
    (and of the one gate/up read) into one op, and the partitioner keeps no float8
    activation for backward (it keeps hp tensors that backward needs anyway, the attention's
    and the SwiGLU's, and casts again there), and no float8 weight either: a dynamic cast is
    inductor's under compile (the weight's too, cast.fused_cast_applies), and it casts the
    weight again in backward rather than keep a copy. One graph, and gradients bitwise
    eager (torch 2.13 and newer; older torch: within float8 rounding). Tensorwise: the CSE
    and the partitioner do not depend on the format (rowwise took 84 s more of the suite)."""
    block, forward, dtype = hf_block("tensorwise")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 128, DIM, generator=g, dtype=dtype)
    go = torch.randn(1, 128, DIM, generator=g, dtype=dtype)

    def grads(f, saved):
        xi = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = f(block, xi)
        out.backward(go)
        out = [xi.grad, *(p.grad.clone() for p in block.parameters())]
        block.zero_grad(set_to_none=True)
        return out

    torch._dynamo.reset()
    count = _CountFloat8Casts()
    eager_saved, compiled_saved = [], []
    eager = grads(forward, eager_saved)
    with inductor_config.patch(post_grad_custom_post_pass=count, emulate_precision_casts=True):
        compiled = grads(torch.compile(forward, fullgraph=True), compiled_saved)
    float8 = [t for t in compiled_saved if t.dtype in FP8_DTYPES]
    weights = [p for p in block.parameters() if p.dim() == 2]
    assert float8 == [] and weights
    assert any(isinstance(t, float8kit.Float8TrainingTensor) for t in eager_saved)
    # forward: one cast per distinct input (the q/k/v input, o_proj's, the gate/up input,
    # down_proj's) and one per weight; eager without the cache casts 7 inputs
    assert count.counts[0] == 4 + 7, count.counts
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        if COMPILE_IS_BITWISE:
            assert torch.equal(a, b), f"gradient {i}"
        else:
            # torch 2.11's inductor does not round this bf16 block's intermediates as eager
            # does, so the float8 casts of the two differ by float8 roundings: the weight
            # gradients agree to float8 precision there (23.6 dB at the least, measured),
            # not to the 30 dB of the other compile tests; a wrong gradient is near 0 dB
            assert sqnr(b, a) >= 20, f"gradient {i}"


def test_delayed_tied_layer_that_reads_another_tensor_casts_with_its_own_state():
    """A tied layer that reads another tensor than the others (theirs still alive) casts it
    itself, with its own state, and records into its own state: no warning is needed, the
    others still share one cast, and at the next update the tie keeps only the layers that
    read the same tensors."""
    lins = [
        float8kit.Float8Linear(DIM, 64, config=Float8LinearConfig.from_recipe_name("delayed"))
        for _ in range(3)
    ]
    x = torch.randn(128, DIM, requires_grad=True)
    for _ in range(2):  # tie, then a forward as tied
        h = x * 2
        for lin in lins:
            lin(h)
        float8kit.precompute_scales(torch.nn.ModuleList(lins))
    tie = lins[0].fp8_state.tie
    assert tie is not None and lins[1].fp8_state.tie is tie and lins[2].fp8_state.tie is tie
    ref = copy.deepcopy(lins[2])  # its own state, as it is now (a copy starts untied)
    assert ref.fp8_state.tie is None
    h, other = x * 2, x * 3
    saved = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            lins[0](h)
            out = lins[2](other)
            lins[1](h)
    copies = {id(t) for t in saved if isinstance(t, float8kit.Float8TrainingTensor)}
    assert len(copies) == 2  # h's (lins[0] and lins[1]) and other's
    with pytest.MonkeyPatch.context() as m:
        m.setattr(shared_cast, "source_for", lambda t: None)  # ref: no shared cast, no tie
        assert torch.equal(out, ref(other))  # its own state's output, and its own record
    assert torch.equal(lins[2].fp8_amax_input, ref.fp8_amax_input)
    float8kit.precompute_scales(torch.nn.ModuleList(lins))
    assert lins[0].fp8_state.tie is lins[1].fp8_state.tie is not None
    assert lins[2].fp8_state.tie is None
