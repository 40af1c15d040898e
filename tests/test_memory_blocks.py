"""Activation memory on real transformer blocks: an HF ``LlamaDecoderLayer`` (built from a
``LlamaConfig``, no download) and the recipes' ``Block``, every recipe, without activation
checkpointing, with ``recompute_norms``, with ``checkpoint_policy`` and with full
checkpointing; against the same block in bf16 without checkpointing. Gradients are bitwise
those of per-layer casts (no shared cast, the float8 weight kept for backward)."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import float8kit
from float8kit import Float8LinearConfig, GemmRole, linear, shared_cast
from float8kit.cast import cast_to_float8
from float8kit.config import FP8_DTYPES
from tests.helpers import COMPILE_IS_BITWISE, sqnr
from tests.memory_harness import LiveTensors, _storages

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import model as recipes_model  # noqa: E402

DIM, HIDDEN, HEADS = 256, 768, 4
TOKENS = (128, 256)
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise"]
# The targets: bytes per token vs the bf16 block without checkpointing.
NO_AC_MAX = 0.95  # every recipe but rowwise_with_gw_hp (hp grad_weight gemm: hp input kept)
POLICY_MAX = 0.60  # tensorwise and rowwise with checkpoint_policy
MODES = ["none", "recompute_norms", "policy", "full"]


def hf_block(recipe: str):
    """A bf16 LlamaDecoderLayer (hidden 256, 4 heads, SwiGLU 768, SDPA), seeded; float8
    unless ``recipe`` is bf16. Returns (block, forward(block, x))."""
    cfg = LlamaConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        num_hidden_layers=1,
        vocab_size=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    block = LlamaDecoderLayer(cfg, 0).bfloat16()
    rope = LlamaRotaryEmbedding(cfg)

    def forward(b, x):
        pos = torch.arange(x.shape[1])[None]
        cos, sin = rope(x, pos)
        return b(x, position_embeddings=(cos.bfloat16(), sin.bfloat16()))

    return _convert(block, recipe), forward, torch.bfloat16


def recipes_block(recipe: str):
    """The recipes' Block (fp32 parameters, run under bf16 autocast as recipes/train.py
    does), dim 256, 4 heads (2 kv heads), SwiGLU 768."""
    args = recipes_model.ModelArgs(dim=DIM, n_heads=HEADS, n_kv_heads=2, ffn_hidden=HIDDEN)
    torch.manual_seed(0)
    block = recipes_model.Block(args)

    def forward(b, x):
        cos, sin = recipes_model.rope_table(args.head_dim, x.shape[1], args.rope_theta)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return b(x, cos, sin)

    return _convert(block, recipe), forward, torch.float32


BLOCKS = {"hf_llama": hf_block, "recipes": recipes_block}


def _convert(block, recipe):
    if recipe != "bf16":
        config = Float8LinearConfig.from_recipe_name(recipe)
        float8kit.convert_to_float8_training(block, config=config)
    return block


def _run(block, forward, x, mode):
    """The block's forward under ``mode``: none, recompute_norms (applied to ``block``
    before), policy (checkpoint_policy over the block) or full (checkpoint)."""
    if mode in ("none", "recompute_norms"):
        return forward(block, x)
    kwargs = {}
    if mode == "policy":
        policy = float8kit.checkpoint_policy()
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(forward, block, x, use_reentrant=False, **kwargs)


def kept_bytes(kind: str, recipe: str, mode: str, tokens: int) -> int:
    """Bytes a forward leaves for backward: every storage autograd saved (a float8 tensor by
    its fp8 data and scale; checkpointing: the region's inputs) or that an op of the forward
    made and is still alive when it returns (a selective-checkpointing cache), each once;
    parameters, buffers and the block's output excluded. The block input is created before
    and counted only where something keeps it."""
    block, forward, dtype = BLOCKS[kind](recipe)
    if mode == "recompute_norms":
        float8kit.recompute_norms(block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, DIM, generator=g, dtype=dtype).requires_grad_()
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    seen: dict[int, int] = {}

    def count(t):
        for inner in _storages(t):
            storage = inner.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        count(t)
        return t

    with LiveTensors() as live, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _run(block, forward, x, mode)
    skip.add(out.untyped_storage().data_ptr())
    for ref in live.refs:
        if (t := ref()) is not None:
            count(t)
    total = sum(n for ptr, n in seen.items() if ptr not in skip)
    out.float().sum().backward()
    return total


def memory_table(kinds=tuple(BLOCKS), recipes=RECIPES, modes=MODES) -> dict:
    """Per block kind, recipe and mode: bytes kept at 128 tokens, bytes per token (slope
    from 128 to 256 tokens) and the ratio to the bf16 block without checkpointing
    (tools/measure.py memory_blocks publishes this)."""
    out = {"dim": DIM, "hidden": HIDDEN, "heads": HEADS, "tokens": list(TOKENS), "blocks": {}}
    for kind in kinds:
        rows = []
        base = None
        for recipe in ["bf16", *recipes]:
            for mode in modes:
                if recipe == "bf16" and mode not in ("none", "recompute_norms"):
                    continue
                lo, hi = (kept_bytes(kind, recipe, mode, t) for t in TOKENS)
                per_token = (hi - lo) / (TOKENS[1] - TOKENS[0])
                if base is None:
                    base = {"bytes": lo, "per_token": per_token}
                rows.append(
                    {
                        "recipe": recipe,
                        "mode": mode,
                        "bytes_at_128": lo,
                        "bytes_per_token": per_token,
                        "ratio_vs_bf16": per_token / base["per_token"],
                        "total_ratio_vs_bf16": lo / base["bytes"],
                    }
                )
        out["blocks"][kind] = rows
    return out


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
    for recipe in ("tensorwise", "rowwise", "blockwise", "delayed"):
        assert _row(rows, recipe, "none")["ratio_vs_bf16"] <= NO_AC_MAX, recipe
    for recipe in ("tensorwise", "rowwise", "blockwise", "delayed"):
        assert _row(rows, recipe, "recompute_norms")["ratio_vs_bf16"] <= NO_AC_MAX, recipe
    for recipe in ("tensorwise", "rowwise"):
        # the policy keeps the float8 gemms' hp outputs and the block input, and recomputes
        # the input casts with the norms, attention and SwiGLU they read (keeping the casts
        # too measured 0.61x)
        assert _row(rows, recipe, "policy")["ratio_vs_bf16"] <= POLICY_MAX, recipe


def test_recipes_block_meets_the_targets():
    rows = memory_table(
        kinds=("recipes",), recipes=("tensorwise", "rowwise"), modes=("none", "policy")
    )["blocks"]["recipes"]
    for recipe in ("tensorwise", "rowwise"):
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


def _input_scales(block):
    return [m.fp8_scale_input for m in block.modules() if isinstance(m, float8kit.Float8Linear)]


@pytest.mark.parametrize("mode", ["none", "policy", "full"])
def test_delayed_fan_out_shares_one_state_and_cast_bitwise(mode):
    """q/k/v and gate/up tie their DELAYED input state at the first forward (equal initial
    states, one tensor read) and then share one float8 cast: over steps with
    precompute_scales (one record per tied state), under activation checkpointing, every
    grad and every scale buffer is bitwise that of per-layer state and casts."""
    block, forward, _ = hf_block("delayed")
    ref_block = copy.deepcopy(block)
    got = _delayed_steps(block, forward, mode, 3, seed=2)
    ref = _delayed_steps(ref_block, forward, mode, 3, seed=2, tie=False)
    _assert_steps_equal(got, ref)
    attn, mlp = block.self_attn, block.mlp
    scales = _input_scales(block)
    assert attn.q_proj.fp8_scale_input is attn.k_proj.fp8_scale_input is attn.v_proj.fp8_scale_input
    assert mlp.gate_proj.fp8_scale_input is mlp.up_proj.fp8_scale_input
    assert len({id(s) for s in scales}) == 4  # qkv, o, gate/up, down
    assert len({id(s) for s in _input_scales(ref_block)}) == 7
    # precompute_scales: one amax record per tied state (3 operands x 7 layers - 3)
    from float8kit.precompute import _delayed_contributions

    ((local, _),) = _delayed_contributions(block)
    assert local.numel() == 18 and _delayed_contributions(ref_block)[0][0].numel() == 21
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
    assert len({id(s) for s in _input_scales(fresh)}) == 7  # untied until it runs
    _assert_steps_equal(_delayed_steps(fresh, forward, "none", 2, seed=4), ref)
    assert len({id(s) for s in _input_scales(fresh)}) == 4

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
    assert attn.k_proj.fp8_scale_input is not attn.q_proj.fp8_scale_input
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
    assert lins[0].fp8_scale_input is not lins[1].fp8_scale_input
    assert lins[1].fp8_state.tie_refused[1:] == (
        lins[0].fp8_scale_input._version,
        lins[1].fp8_scale_input._version,
    )


class _CountFloat8Casts(CustomGraphPass):
    """An inductor post-grad pass that counts the hp -> float8 conversions of each graph it
    sees (forward, then backward)."""

    def __init__(self):
        self.counts = []

    def __call__(self, graph):
        n = 0
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _CONVERSIONS:
                dtype = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
                n += dtype in FP8_DTYPES
        self.counts.append(n)

    def uuid(self):
        return None


_CONVERSIONS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def compiled_saved(recipe: str, tokens: int) -> dict:
    """One forward of the HF block compiled (inductor, fullgraph): the bytes of the tensors
    its graph saves for backward (each storage once; parameters, buffers and the output
    excluded), how many of them are float8, and the float8 casts of its forward graph."""
    block, forward, dtype = hf_block(recipe)
    torch._dynamo.reset()
    count = _CountFloat8Casts()
    x = torch.randn(1, tokens, DIM, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x.requires_grad_()
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    seen, float8 = {}, 0

    def pack(t):
        nonlocal float8
        float8 += t.dtype in FP8_DTYPES
        for inner in _storages(t):
            if (ptr := inner.untyped_storage().data_ptr()) not in skip:
                seen[ptr] = inner.untyped_storage().nbytes()
        return t

    with inductor_config.patch(post_grad_custom_post_pass=count):
        f = torch.compile(forward, fullgraph=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = f(block, x)
        seen.pop(out.untyped_storage().data_ptr(), None)
        out.float().sum().backward()
    return {"bytes": sum(seen.values()), "float8_saved": float8, "casts": count.counts[0]}


def compiled_table(recipes=("tensorwise", "rowwise")) -> dict:
    """The HF block compiled: bytes per token its graph saves for backward (slope from 128
    to 256 tokens), bf16 and each recipe, against the compiled bf16 block and the eager
    bf16 block; the float8 tensors it saves and the float8 casts of its forward graph."""
    eager_bf16 = (
        kept_bytes("hf_llama", "bf16", "none", TOKENS[1])
        - kept_bytes("hf_llama", "bf16", "none", TOKENS[0])
    ) / (TOKENS[1] - TOKENS[0])
    rows, base = [], None
    for recipe in ("bf16", *recipes):
        lo, hi = (compiled_saved(recipe, t) for t in TOKENS)
        per_token = (hi["bytes"] - lo["bytes"]) / (TOKENS[1] - TOKENS[0])
        base = per_token if base is None else base
        rows.append(
            {
                "recipe": recipe,
                "bytes_per_token": per_token,
                "ratio_vs_compiled_bf16": per_token / base,
                "ratio_vs_eager_bf16": per_token / eager_bf16,
                "float8_saved": hi["float8_saved"],
                "forward_float8_casts": hi["casts"],
            }
        )
    return {"dim": DIM, "hidden": HIDDEN, "heads": HEADS, "tokens": list(TOKENS), "rows": rows}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_block_casts_each_shared_input_once_and_keeps_no_float8(recipe):
    """Under torch.compile no shared-cast cache runs, and none is needed: AOTAutograd's
    common-subexpression elimination merges the identical casts of the tensor q/k/v read
    (and of the one gate/up read) into one op, and the partitioner keeps no float8 tensor for
    backward at all (it keeps hp tensors that backward needs anyway, the attention's and the
    SwiGLU's, and casts again there). One graph, and gradients bitwise eager (torch 2.13 and
    newer; older torch: within float8 rounding)."""
    block, forward, dtype = hf_block(recipe)
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
    assert float8 == []
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


def test_delayed_tied_layer_that_reads_another_tensor_is_untied_with_a_warning():
    lins = [
        float8kit.Float8Linear(DIM, 64, config=Float8LinearConfig.from_recipe_name("delayed"))
        for _ in range(3)
    ]
    x = torch.randn(128, DIM, requires_grad=True)
    for _ in range(2):  # tie, then a forward as tied: no warning
        h = x * 2
        for lin in lins:
            lin(h)
    assert lins[0].fp8_scale_input is lins[1].fp8_scale_input is lins[2].fp8_scale_input
    ref = copy.deepcopy(lins[2])  # its own state, as it is now
    h, other = x * 2, x * 3
    lins[0](h)
    with pytest.warns(UserWarning, match="now reads another tensor"):
        out = lins[2](other)
    assert lins[2].fp8_scale_input is not lins[0].fp8_scale_input
    assert lins[1].fp8_scale_input is lins[0].fp8_scale_input  # the others stay tied
    lins[1](h)
    # untied before it cast: its output is the one its own state gives
    assert torch.equal(out, ref(other))
