"""Bytes kept for backward by one transformer block (numbers/memory_blocks.json,
memory_compiled.json): an HF LlamaDecoderLayer and the recipes' Block, every recipe, without
checkpointing, with recompute_norms, checkpoint_policy and full checkpointing; and the HF block
compiled (the tensors its graph saves, the float8 casts of its forward)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import float8kit
from benchmarks.measures.memory import LiveTensors, _storages
from float8kit import Float8LinearConfig
from float8kit.config import FP8_DTYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import model as recipes_model  # noqa: E402

DIM, HIDDEN, HEADS = 256, 768, 4
TOKENS = (128, 256)
RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed", "blockwise", "mxfp8"]
# The targets: bytes per token vs the bf16 block without checkpointing.
NO_AC_MAX = 0.95  # every recipe but rowwise_with_gw_hp (hp grad_weight gemm: hp input kept)
POLICY_MAX = 0.60  # tensorwise, rowwise and mxfp8 with checkpoint_policy
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


class _CountFloat8Casts(CustomGraphPass):
    """An inductor post-grad pass that counts the hp -> float8 conversions of each graph it
    sees (forward, then backward): dtype conversions to float8, and float8kit's one-pass
    tensorwise cast (``float8kit::cast_tensorwise``, one cast whatever layouts it writes)."""

    def __init__(self):
        self.counts = []

    def __call__(self, graph):
        n = 0
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is torch.ops.float8kit.cast_tensorwise.default:
                n += 1
            elif node.target in _CONVERSIONS:
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
