"""Numerics against two references: an fp32 nn.Linear (SQNR in dB) and torchao.float8 (the
peer: same algorithm and correctly rounded scales on both sides, so tensorwise, rowwise and
rowwise_with_gw_hp are bitwise torchao's, eager and compiled, bf16 and fp32 models, on an MLP
and on an HF LlamaDecoderLayer); and what each scaling policy does when the range of the
input moves.

The functions that measure (``sqnr_table``, ``scaling_policy_sqnrs``, ``outlier_sqnrs``)
also make the published tables: ``python tools/measure.py numerics scaling outliers`` writes
them to numbers/*.json.
"""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import float8kit
from float8kit import (
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    ScalingType,
    calibrate,
    convert_to_float8_training,
    precompute_scales,
)
from tests.helpers import fwd_bwd, peer_on_our_cpu_kernel, sqnr

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao_float8 = pytest.importorskip("torchao.float8")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
GEMMS = ["output", "grad_input", "grad_weight"]
E4M3_MAX = 448.0
# float8kit vs fp32, per gemm (output, grad_input, grad_weight): e5m2 grad_output costs the
# tensorwise backward gemms a few dB.
ACCURACY_DB = {
    "tensorwise": (25, 20, 20),
    "rowwise": (25, 25, 25),
    "rowwise_with_gw_hp": (25, 25, 25),
}


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256))


def run_both(
    recipe: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, compiled: bool = False
) -> dict[str, tuple]:
    """(output, grad_input, grad of the first weight) for fp32, float8kit and torchao, all
    from the same initial weights and the same input; the float8 models in ``dtype``, both
    ``torch.compile``d when ``compiled``."""
    torch.manual_seed(seed)
    base = mlp()
    x = torch.randn(8, 128, 256, dtype=dtype)
    grad = torch.randn(8, 128, 256)
    ours = convert_to_float8_training(
        copy.deepcopy(base).to(dtype), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    peer = torchao_float8.convert_to_float8_training(
        copy.deepcopy(base).to(dtype),
        config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
    )
    if compiled:
        ours, peer = torch.compile(ours), torch.compile(peer)
    results = {}
    for name, m, inp in (("fp32", base, x.float()), ("float8kit", ours, x), ("torchao", peer, x)):
        with peer_on_our_cpu_kernel() if name == "torchao" else contextlib.nullcontext():
            out, gx, g = fwd_bwd(m, inp, grad)
        results[name] = (out, gx, g["0.weight"])
    return results


def sqnr_table() -> list[dict]:
    """One row per recipe and gemm: SQNR (dB) of float8kit and torchao against fp32, of
    float8kit against torchao (None when bitwise equal), and whether they are bitwise equal."""
    rows = []
    for recipe in RECIPES:
        r = run_both(recipe)
        for i, gemm in enumerate(GEMMS):
            peer_db = sqnr(r["torchao"][i], r["float8kit"][i])
            rows.append(
                {
                    "recipe": recipe,
                    "gemm": gemm,
                    "float8kit_vs_fp32": sqnr(r["fp32"][i], r["float8kit"][i]),
                    "torchao_vs_fp32": sqnr(r["fp32"][i], r["torchao"][i]),
                    "float8kit_vs_torchao": None if peer_db == float("inf") else peer_db,
                    "bitwise_equal_to_torchao": torch.equal(r["torchao"][i], r["float8kit"][i]),
                }
            )
    return rows


def assert_bitwise_peer(r: dict[str, tuple], what: str) -> None:
    for i, gemm in enumerate(GEMMS):
        ours, theirs = r["float8kit"][i], r["torchao"][i]
        db = sqnr(theirs, ours)
        assert torch.equal(ours, theirs), f"{what} {gemm}: {db:.1f} dB from torchao's, not bitwise"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_bitwise_torchao(recipe, dtype):
    r = run_both(recipe, dtype=dtype)
    if recipe != "tensorwise" and dtype == torch.float32:
        # torchao rounds every rowwise gemm's result to bf16 (CUDA's rowwise kernels write
        # bf16 only), also on CPU; float8kit does that on CUDA only and keeps fp32 on CPU:
        # not bitwise (the first layer's rounding moves the second layer's casts), and never
        # less accurate.
        for i, gemm in enumerate(GEMMS):
            ours, theirs = (
                sqnr(r["fp32"][i], r["float8kit"][i]),
                sqnr(r["fp32"][i], r["torchao"][i]),
            )
            assert ours >= theirs, f"{recipe} fp32 {gemm}: {ours:.2f} < {theirs:.2f} dB"
        return
    assert_bitwise_peer(r, f"{recipe} {dtype}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bitwise_torchao_compiled(dtype):
    # inductor may rewrite a division (fp8_max / amax): the scales must stay correctly rounded
    assert_bitwise_peer(run_both("tensorwise", dtype=dtype, compiled=True), f"compiled {dtype}")


def llama_layer_grads(recipe: str, lib) -> tuple[torch.Tensor, ...]:
    """Output, grad_input and every projection's weight grad of an HF ``LlamaDecoderLayer``
    (hidden 256, SDPA, bf16, built from a config: no download), converted by ``lib``
    (float8kit or torchao.float8) with ``recipe``, on one fixed batch of 2 x 128 tokens."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = llama.LlamaDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16)
    rope = llama.LlamaRotaryEmbedding(cfg)
    lib.convert_to_float8_training(layer, config=lib.Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(2, 128, 256, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(128)[None].expand(2, -1)
    out = layer(x, position_embeddings=rope(x, position_ids), position_ids=position_ids)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.randn_like(out))
    weights = [p.grad for n, p in sorted(layer.named_parameters()) if n.endswith("proj.weight")]
    return (out.detach(), x.grad, *weights)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bitwise_torchao_on_hf_llama_layer(recipe):
    ours = llama_layer_grads(recipe, float8kit)
    with peer_on_our_cpu_kernel():
        theirs = llama_layer_grads(recipe, torchao_float8)
    assert len(ours) == 9  # output, grad_input, the 7 projections' weight grads
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"{recipe} tensor {i}: {sqnr(b, a):.1f} dB from torchao's"


@pytest.mark.parametrize("recipe", RECIPES)
def test_accuracy_against_fp32(recipe):
    r = run_both(recipe)
    for i, gemm in enumerate(GEMMS):
        got = sqnr(r["fp32"][i], r["float8kit"][i])
        assert got >= ACCURACY_DB[recipe][i], f"{recipe} {gemm}: {got:.2f} dB"


# ---------------------------------------------------------------------------- outliers

OUTLIER_RECIPES = ["tensorwise", "rowwise", "blockwise"]
OUTLIER_CHANNELS = [5, 17, 40]  # all in the first 128-tile of the input's 512 channels
BLOCKWISE_FLOOR_DB = 22.0


def outlier_sqnrs(seed: int = 0) -> list[dict]:
    """SQNR (dB) against fp32 of each gemm of one 512 -> 256 layer per recipe, on 1024 bf16
    tokens whose magnitudes vary (log-normal per token, as real activations and gradients
    do), with three 100x outlier input channels and one 100x outlier 128x128 weight block."""
    torch.manual_seed(seed)
    base = nn.Linear(512, 256)
    with torch.no_grad():
        base.weight[128:256, 256:384] *= 100
    x = torch.randn(8, 128, 512) * torch.exp(torch.randn(8, 128, 1))
    x[..., OUTLIER_CHANNELS] *= 100
    grad = torch.randn(8, 128, 256) * torch.exp(torch.randn(8, 128, 1))
    ref = fwd_bwd(base, x, grad)
    rows = []
    for recipe in OUTLIER_RECIPES:
        config = Float8LinearConfig.from_recipe_name(recipe)
        layer = convert_to_float8_training(copy.deepcopy(base).bfloat16(), config=config)
        out, gx, g = fwd_bwd(layer, x.bfloat16(), grad)
        for gemm, r, got in zip(
            GEMMS, (ref[0], ref[1], ref[2]["weight"]), (out, gx, g["weight"]), strict=True
        ):
            rows.append({"recipe": recipe, "gemm": gemm, "float8kit_vs_fp32": sqnr(r, got)})
    return rows


def test_blockwise_with_outliers_beats_the_floor_and_rowwise():
    db = {(r["recipe"], r["gemm"]): r["float8kit_vs_fp32"] for r in outlier_sqnrs()}
    for gemm in GEMMS:
        block, row = db["blockwise", gemm], db["rowwise", gemm]
        assert block >= BLOCKWISE_FLOOR_DB, f"{gemm}: {block:.2f} dB"
        assert block >= row, f"{gemm}: blockwise {block:.2f} dB < rowwise {row:.2f} dB"


# ---------------------------------------------------------------------------- scaling policies


def _cast(policy: ScalingType, **kwargs) -> CastConfig:
    return CastConfig(scaling_type=policy, **kwargs)


def _policy_config(policy: ScalingType, **kwargs) -> Float8LinearConfig:
    return Float8LinearConfig(
        cast_config_input=_cast(policy, **kwargs),
        cast_config_weight=_cast(policy, **kwargs),
        cast_config_grad_output=_cast(policy, **kwargs)
        if policy != ScalingType.STATIC
        else _cast(policy, static_scale=2.0**12),
    )


def _step(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = layer(x)
    y.backward(torch.ones_like(y))
    return y.detach()


def scaling_policy_sqnrs() -> dict[str, float]:
    """Output SQNR (dB) against fp32 ``F.linear`` of one 64x64 layer (fp32 params, e4m3
    inputs, the real ``torch._scaled_mm``) under each policy when the input range moves."""
    out = {}
    # DYNAMIC and DELAYED: three steps of randn inputs, then one 100x larger ("the spike")
    torch.manual_seed(0)
    delayed = Float8Linear(64, 64, config=_policy_config(ScalingType.DELAYED))
    dynamic = Float8Linear.from_float(copy.deepcopy(delayed), config=Float8LinearConfig())
    for _ in range(3):
        _step(delayed, torch.randn(128, 64))
        precompute_scales(delayed)
    spike = torch.randn(128, 64) * 100
    ref = F.linear(spike, delayed.weight, delayed.bias).detach()
    out["dynamic_spike"] = sqnr(ref, dynamic(spike))
    out["delayed_spike_stale"] = sqnr(ref, _step(delayed, spike))
    precompute_scales(delayed)
    out["delayed_spike_after_precompute"] = sqnr(ref, _step(delayed, spike))
    # STATIC 448/4: represents |input| <= 4; then the same inputs 100x larger
    torch.manual_seed(0)
    static = Float8Linear(
        64,
        64,
        config=Float8LinearConfig(
            cast_config_input=_cast(ScalingType.STATIC, static_scale=E4M3_MAX / 4),
            cast_config_weight=_cast(ScalingType.STATIC, static_scale=896.0),
            cast_config_grad_output=_cast(ScalingType.STATIC, static_scale=2.0**12),
        ),
    )
    inside = torch.rand(256, 64) * 8 - 4
    for name, x in (("static_inside", inside), ("static_100x", inside * 100)):
        out[name] = sqnr(F.linear(x, static.weight, static.bias), static(x))
    # STATIC after calibrate() on 100x-300x inputs, a two-layer MLP (both gemms float8)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    convert_to_float8_training(model, config=_policy_config(ScalingType.STATIC))
    batches = [torch.randn(64, 64) * 100 * (1 + i) for i in range(3)]
    calibrate(model, batches)
    x = batches[2]
    with torch.no_grad():
        ref = F.linear(
            F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias
        )
        out["static_calibrated"] = sqnr(ref, model(x))
    return out


def test_scaling_policies_when_the_range_moves():
    s = scaling_policy_sqnrs()
    assert s["dynamic_spike"] >= 25  # dynamic always fits the tensor at hand
    assert s["delayed_spike_stale"] < 5  # the stale scale saturates the 100x values
    assert s["delayed_spike_after_precompute"] >= 25  # and precompute_scales fixes it
    # in steady state DELAYED's scale is DYNAMIC's scale: the same numbers
    assert s["delayed_spike_after_precompute"] == s["dynamic_spike"]
    assert s["static_inside"] >= 25 and s["static_100x"] < 5
    assert s["static_calibrated"] >= 25


def test_non_finite_saturation_differs_from_torchao_as_documented():
    # README: torchao's saturated cast turns inf into +-448 (an overflow hidden from a loss
    # scaler); ours keeps inf/NaN non-finite (e4m3 has no inf: NaN).
    from torchao.float8.float8_utils import to_fp8_saturated as peer_saturated

    from float8kit.cast import to_fp8_saturated

    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan")])
    theirs = peer_saturated(x, torch.float8_e4m3fn).float()
    ours = to_fp8_saturated(x, torch.tensor(1.0), torch.float8_e4m3fn).float()
    assert torch.equal(theirs[:3], torch.tensor([1.0, 448.0, -448.0])) and theirs[3].isnan()
    assert ours[0] == 1.0 and ours[1:].isnan().all()
