"""float8 experts on a tiny Hugging Face Qwen3-MoE (numbers/moe_hf.json): expert-only and
whole-model SQNR, routing flips, float8 gemm counts per experts implementation, 30 training
steps fp32 vs float8 experts."""

from __future__ import annotations

import torch

from benchmarks.common import OpCounter
from benchmarks.measures.refs import sqnr
from float8kit import convert_experts_to_float8_training

FLOAT8_GEMM = "float8kit.emulated_grouped_mm.default"  # the CPU float8 grouped gemm (emulated)
VOCAB, LAYERS, EXPERTS = 64, 2, 4


def _transformers():
    import transformers
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

    return transformers


def qwen3_moe(seed=0, experts=EXPERTS):
    """(experts, out, in) weights, used as w.transpose(-2, -1): gate_up (4, 64, 32)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def gpt_oss(seed=0):
    """(experts, in, out) weights with biases, used as is: gate_up (4, 32, 64)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        layer_types=["full_attention"] * LAYERS,
    )
    return transformers.GptOssForCausalLM(config)


def mixtral(seed=0):
    """(experts, out, in) weights, used as w.transpose(-2, -1): gate_up (4, 64, 32)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(config)


def batch(seed=1, batch_size=2, seq=16):
    return torch.randint(0, VOCAB, (batch_size, seq), generator=torch.Generator().manual_seed(seed))


FSDP_STEPS = 3


def _train(model, ids, steps=FSDP_STEPS) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


TRAIN_STEPS = 30


def _experts_inputs(model, ids) -> list[tuple]:
    """Each MoE block's experts call arguments (hidden states, top-k ids, top-k weights)."""
    seen = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: seen.append(tuple(a.detach() for a in args)))
        for name, m in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    logits = model(ids).logits.detach()
    for h in hooks:
        h.remove()
    return logits, seen


def hf_numbers() -> dict:
    """What docs/moe.md publishes (tools/measure.py moe_hf), on the tiny Qwen3-MoE: expert-only
    SQNR vs fp32 (each experts module fed the fp32 model's own inputs), whole-model logits
    SQNR and the share of tokens whose top-k experts change, float8 gemm counts per experts
    implementation, and 30 training steps fp32 vs float8 experts. The comparisons run on the
    fp32 model after its training (a fresh batch): at init the experts barely move the
    residual stream and routing hardly ever flips."""
    ids = batch()
    hp = qwen3_moe()
    losses = {
        "fp32": _train(hp, ids, TRAIN_STEPS),
        "float8_experts": _train(convert_experts_to_float8_training(qwen3_moe()), ids, TRAIN_STEPS),
    }
    f8 = convert_experts_to_float8_training(qwen3_moe())
    f8.load_state_dict(hp.state_dict())
    held_out = batch(seed=2, batch_size=4, seq=32)
    hp_logits, hp_inputs = _experts_inputs(hp, held_out)
    f8_logits, f8_inputs = _experts_inputs(f8, held_out)
    experts = []
    hp_blocks = [m for n, m in hp.named_modules() if n.endswith("mlp.experts")]
    f8_blocks = [m for n, m in f8.named_modules() if n.endswith("mlp.experts")]
    for args, hp_e, f8_e in zip(hp_inputs, hp_blocks, f8_blocks, strict=True):
        x = args[0].clone().requires_grad_()
        x8 = args[0].clone().requires_grad_()
        want, got = hp_e(x, *args[1:]), f8_e(x8, *args[1:])
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
        want.backward(grad)
        got.backward(grad)
        experts.append(
            {
                "output": sqnr(want, got),
                "grad_input": sqnr(x.grad, x8.grad),
                "grad_gate_up_proj": sqnr(hp_e.gate_up_proj.grad, f8_e.gate_up_proj.grad),
                "grad_down_proj": sqnr(hp_e.down_proj.grad, f8_e.down_proj.grad),
            }
        )
    flips = [
        float((a[1].sort(-1).values != b[1].sort(-1).values).any(-1).float().mean())
        for a, b in zip(hp_inputs, f8_inputs, strict=True)
    ]
    counts = {}
    for impl in ("grouped_mm", "eager", "batched_mm"):
        model = convert_experts_to_float8_training(qwen3_moe())
        model.set_experts_implementation(impl)
        try:
            with OpCounter() as c:
                model(ids, labels=ids).loss.backward()
            counts[impl] = c.counts[FLOAT8_GEMM]
        except NotImplementedError:
            counts[impl] = "refused"
    return {
        "experts_sqnr_db": experts,
        "logits_sqnr_db": sqnr(hp_logits, f8_logits),
        "routing_flip_share": flips,
        "float8_gemms_per_step": counts,
        "losses": losses,
        "shapes": {
            "layers": LAYERS,
            "experts": EXPERTS,
            "top_k": 2,
            "gate_up_proj": list(f8_blocks[0].gate_up_proj.shape),
            "down_proj": list(f8_blocks[0].down_proj.shape),
            "train_tokens": ids.numel(),
            "train_steps": TRAIN_STEPS,
            "compared_tokens": held_out.numel(),
        },
    }
