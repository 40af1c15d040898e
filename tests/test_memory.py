"""Activation memory: the bytes a Float8Linear keeps for backward per token, against a bf16
nn.Linear, and the rowwise float8 save against 0.1.0's hp save (bitwise-equal gradients)."""

import pytest
import torch

from benchmarks.measures.memory import (
    MAX_RATIO,
    RECIPES,
    K,
    N,
    config,
    saved_bytes,
    saved_bytes_per_token,
    saved_bytes_table,
    train_step_saved_bytes,
)
from float8kit import Float8Linear, GemmRole
from float8kit.cast import cast_to_float8


def test_saved_bytes_per_token_vs_bf16_linear():
    t = saved_bytes_table()
    assert t["bf16_bytes_per_token"] == 2 * K  # nn.Linear keeps the bf16 input
    for row in t["rows"]:
        if row["hp_grad_weight"]:
            # the hp input, as bf16 nn.Linear: 1.0x (no float8 copy is kept as well)
            assert row["bytes_per_token"] == 2 * K, row
        elif row["recipe"] == "blockwise":
            # 1 byte per element, plus an fp32 scale per column per 128-token tile
            assert row["bytes_per_token"] == K + 4 * K / 128, row
            assert row["ratio_vs_bf16"] <= MAX_RATIO, row
        else:
            # 1 byte per input element (the scales are per tensor or per column of K)
            assert row["bytes_per_token"] == K, row
            assert row["ratio_vs_bf16"] <= MAX_RATIO, row


@pytest.mark.parametrize("recipe", RECIPES)
def test_frozen_weight_keeps_no_input_and_the_same_grad_input(recipe):
    # No grad_weight gemm runs for a frozen weight (fine-tuning adapters around frozen
    # layers): nothing of the input is kept, and grad_input is bitwise the trainable layer's.
    def frozen():
        layer = Float8Linear(K, N, config=config(recipe)).bfloat16()
        layer.weight.requires_grad_(False)
        return layer

    assert saved_bytes_per_token(frozen) == 0
    torch.manual_seed(0)
    trainable = Float8Linear(K, N, config=config(recipe)).bfloat16()
    layer = frozen()
    layer.load_state_dict(trainable.state_dict())
    x, grad = torch.randn(64, K, dtype=torch.bfloat16), torch.randn(64, N, dtype=torch.bfloat16)
    grads = []
    for m in (trainable, layer):
        xi = x.clone().requires_grad_()
        m(xi).backward(grad)
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    assert layer.weight.grad is None and trainable.weight.grad is not None


def test_saved_bytes_counts_float8_storage_not_the_hp_size_it_reports():
    # the counter itself: a float8 tensor reports bf16 (2 bytes) but holds 1 byte per element
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    c = config("tensorwise")
    fp8 = cast_to_float8(x, c.cast_config_input, GemmRole.INPUT, -1, c)
    assert fp8.element_size() == 2
    w = torch.randn(16, 64, requires_grad=True)
    with saved_bytes() as s:
        torch.mul(w, 2.0).sum()  # saves nothing
    assert s == {"bytes": 0, "tensors": 0}
    with saved_bytes() as s:

        class Keep(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a):
                ctx.save_for_backward(fp8, fp8)  # the same tensor twice: counted once
                return a.clone()

            @staticmethod
            def backward(ctx, g):
                return g

        Keep.apply(w)
    assert s == {"bytes": 32 * 64 + 4, "tensors": 2}


def test_train_step_saves_fewer_bytes_with_float8():
    names = ["none", "rowwise", "rowwise_with_gw_hp", "rowwise/selective", "rowwise/full"]
    t = train_step_saved_bytes("tiny", names)
    bf16, rowwise, gw_hp, sac, full = (t["modes"][m] for m in names)
    assert bf16["tensors"] == rowwise["tensors"] == gw_hp["tensors"]  # the same graph
    # measured 0.86x: the block Linears' inputs halve; attention, norms and logits do not
    assert rowwise["bytes"] < 0.9 * bf16["bytes"]
    # hp inputs as in bf16; only the bf16 weight copies autocast saves are gone
    assert rowwise["bytes"] < gw_hp["bytes"] < bf16["bytes"]
    # selective checkpointing keeps the float8 casts and gemm outputs (not saved tensors:
    # live ones), full checkpointing keeps the block inputs only
    assert full["live_bytes"] < sac["live_bytes"] < rowwise["live_bytes"]
    assert full["bytes"] == sac["bytes"] < rowwise["bytes"]
    for m in (bf16, rowwise, gw_hp):  # without checkpointing, what lives is what is saved
        assert m["live_bytes"] <= m["bytes"] < 1.05 * m["live_bytes"]


# ---------------------------------------------------------------------------- rowwise vs 0.1.0


def reference_0_1_0(layer: Float8Linear, x: torch.Tensor, grad: torch.Tensor):
    """0.1.0's dynamic float8 gemms, written out: it kept the hp input for backward and cast
    it along dim 0 there. Returns output, grad_input, grad_weight."""
    c, w = layer.config, layer.weight.detach()
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1]).contiguous()
    if torch.is_autocast_enabled("cpu"):
        x2 = x2.to(torch.get_autocast_dtype("cpu"))
    with torch.autocast("cpu", enabled=False):
        xi = cast_to_float8(x2, c.cast_config_input, GemmRole.INPUT, -1, c)
        wo = cast_to_float8(w, c.cast_config_weight, GemmRole.WEIGHT, -1, c)
        out = torch.mm(xi, wo.t())
        go = cast_to_float8(
            g2.to(out.dtype), c.cast_config_grad_output, GemmRole.GRAD_OUTPUT, -1, c
        )
        wi = cast_to_float8(w, c.cast_config_weight_for_grad_input, GemmRole.WEIGHT, 0, c)
        grad_input = torch.mm(go, wi)
        go_t = cast_to_float8(
            g2.to(out.dtype), c.cast_config_grad_output_for_grad_weight, GemmRole.GRAD_OUTPUT, 0, c
        )
        # the step that moved: 0.1.0 cast the saved hp input here, in backward
        x_t = cast_to_float8(x2, c.cast_config_input_for_grad_weight, GemmRole.INPUT, 0, c)
        grad_weight = torch.mm(go_t.t().to(w.dtype), x_t)
    return out, grad_input.reshape(x.shape), grad_weight


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast_fp32_weights"])
def test_rowwise_float8_save_gives_0_1_0_gradients_bitwise(autocast):
    dtype = torch.float32 if autocast else torch.bfloat16
    layer = Float8Linear(K, N, bias=False, config=config("rowwise")).to(dtype)
    x = (torch.randn(2, 48, K) * 3).to(dtype).requires_grad_()
    grad = torch.randn(2, 48, N)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
        ref_out, ref_gx, ref_gw = reference_0_1_0(layer, x.detach(), grad)
    out.backward(grad.to(out.dtype))
    assert torch.equal(out.reshape(-1, N), ref_out)
    assert torch.equal(x.grad.to(ref_gx.dtype), ref_gx)
    assert layer.weight.grad.dtype == dtype
    assert torch.equal(layer.weight.grad, ref_gw)
    assert ref_gw.abs().sum() > 0  # a real gradient, not two zeros
