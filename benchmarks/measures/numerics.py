"""SQNR tables (numbers/numerics.json, scaling.json, outliers.json): float8kit and torchao.float8
(the peer) against fp32 per recipe and gemm, the recipes on outlier channels and an outlier
weight block, each scaling policy when the input range moves, and the scales the old
two-rounding form got one ulp off."""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import peer_on_our_cpu_kernel
from benchmarks.measures.refs import fwd_bwd, sqnr
from float8kit import (
    E4M3,
    E5M2,
    CastConfig,
    Float8Linear,
    Float8LinearConfig,
    MXGranularity,
    ScalingType,
    calibrate,
    convert_to_float8_training,
    precompute_scales,
)
from float8kit.scaling import amax_floor, fp8_max

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


def _torchao_float8():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.float8

    return torchao.float8


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256))


def run_both(
    recipe: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16, compiled: bool = False
) -> dict[str, tuple]:
    """(output, grad_input, grad of the first weight) for fp32, float8kit and torchao, all
    from the same initial weights and the same input; the float8 models in ``dtype``, both
    ``torch.compile``d when ``compiled``."""
    torchao_float8 = _torchao_float8()
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
        rows += peer_rows(r, recipe=recipe)
    return rows


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


def random_amaxes(n: int = 100_000, seed: int = 0) -> torch.Tensor:
    """fp32 amaxes with uniform mantissas over 2^-100 .. 2^100, plus the floors' edges."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(n, generator=g, dtype=torch.float64) + 1
    exponent = torch.randint(-100, 101, (n,), generator=g).double()
    edges = [amax_floor(E4M3), amax_floor(E5M2), 1.0, 448.0, 57344.0, 3.0e38]
    return torch.cat([(mantissa * torch.exp2(exponent)).float(), torch.tensor(edges)])


def correctly_rounded_scales(amaxes: torch.Tensor, dtype) -> torch.Tensor:
    """The reference: Python's fp64 division (IEEE, correctly rounded) rounded once to fp32,
    which for a quotient of two fp32 values is the correctly rounded fp32 quotient."""
    floor = amax_floor(dtype)
    quotients = [fp8_max(dtype) / max(a, floor) for a in amaxes.tolist()]
    return torch.tensor(quotients, dtype=torch.float64).float()


def one_ulp_off_share(amaxes: torch.Tensor, dtype) -> float:
    """Share of the amaxes whose scale in the old form ``fp8_max / amax`` (a Python float over
    an fp32 tensor: torch evaluates it as ``reciprocal(amax) * fp8_max``, two roundings) is
    not the correctly rounded one: how many scales the fp64 quotient changed."""
    old = fp8_max(dtype) / torch.clamp(amaxes, min=amax_floor(dtype))
    return (old != correctly_rounded_scales(amaxes, dtype)).double().mean().item()


# ---------------------------------------------------------------------------- MXFP8

MX_ROUNDINGS = ["rceil", "floor"]
MX_CASES = ["randn", "outliers"]
MX_OUTLIER_COLUMNS = [10, 11, 12, 13]  # 4 of the 256 input channels, all in one 32-block
MX_OUTLIER_BLOCK = (slice(0, 32), slice(0, 32))  # one 32x32 weight block (rows, cols)
# float8kit vs fp32 on the bar's case, per gemm (output, grad_input, grad_weight) and rounding:
# RCEIL never overflows a block, FLOOR clips each block's largest values and loses ~4 dB
# where the block maximum decides (output, grad_input).
MX_ACCURACY_DB = {"rceil": (28, 28, 28), "floor": (24, 24, 27)}


def mx_config(rounding: str = "rceil") -> Float8LinearConfig:
    """The mxfp8 recipe with every cast's e8m0 scale rounded ``rounding``."""
    mx = CastConfig(scaling_granularity=MXGranularity(rounding), target_dtype=E4M3)
    return Float8LinearConfig(
        cast_config_input=mx, cast_config_weight=mx, cast_config_grad_output=mx
    )


def mx_case(case: str = "randn", seed: int = 0) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """The issue's bar: one fp32 256 -> 512 Linear (torch's default init) on 128 randn tokens
    with a randn output gradient; ``outliers`` scales 4 input columns x100 and one 32x32
    weight block x50."""
    torch.manual_seed(seed)
    layer = nn.Linear(256, 512)
    x = torch.randn(128, 256)
    grad = torch.randn(128, 512)
    if case == "outliers":
        x[:, MX_OUTLIER_COLUMNS] *= 100
        with torch.no_grad():
            layer.weight[MX_OUTLIER_BLOCK] *= 50
    return layer, x, grad


def _torchao_mx_linear(layer: nn.Linear, x: torch.Tensor, grad: torch.Tensor, rounding: str):
    """torchao 0.18's emulated MXFP8 linear (``_to_mxfp8_then_scaled_mm``, runs on CPU)
    forward and backward: (output, grad_input, grad_weight); the bias added in fp32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference

    mode = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}[rounding]
    x = x.detach().clone().requires_grad_()
    w = layer.weight.detach().clone().requires_grad_()
    out = _to_mxfp8_then_scaled_mm(x, w, KernelPreference.EMULATED, mode) + layer.bias.detach()
    out.backward(grad)
    return out.detach(), x.grad.detach(), w.grad.detach()


def run_mx(rounding: str = "rceil", case: str = "randn") -> dict[str, tuple]:
    """(output, grad_input, grad_weight) of the bar's layer for fp32, float8kit's mxfp8 recipe
    (scales rounded ``rounding``) and torchao's emulated MXFP8, from the same weights and
    data, all in fp32."""
    base, x, grad = mx_case(case)
    ours = convert_to_float8_training(copy.deepcopy(base), config=mx_config(rounding))
    results = {}
    for name, m in (("fp32", base), ("float8kit", ours)):
        out, gx, g = fwd_bwd(m, x, grad)
        results[name] = (out, gx, g["weight"])
    results["torchao"] = _torchao_mx_linear(base, x, grad, rounding)
    return results


def mx_sqnr_table() -> list[dict]:
    """One row per case, rounding and gemm: SQNR (dB) of float8kit's mxfp8 and torchao's
    emulated MXFP8 against fp32, of float8kit against torchao (None when bitwise equal)."""
    rows = []
    for case in MX_CASES:
        for rounding in MX_ROUNDINGS:
            r = run_mx(rounding, case)
            rows += peer_rows(r, case=case, rounding=rounding)
    return rows


def peer_rows(r: dict, **labels) -> list[dict]:
    """One row per gemm: float8kit and torchao against fp32 and against each other (``r``:
    each side's outputs of the three gemms), with ``labels`` first."""
    rows = []
    for i, gemm in enumerate(GEMMS):
        peer_db = sqnr(r["torchao"][i], r["float8kit"][i])
        rows.append(
            {
                **labels,
                "gemm": gemm,
                "float8kit_vs_fp32": sqnr(r["fp32"][i], r["float8kit"][i]),
                "torchao_vs_fp32": sqnr(r["fp32"][i], r["torchao"][i]),
                "float8kit_vs_torchao": None if peer_db == float("inf") else peer_db,
                "bitwise_equal_to_torchao": torch.equal(r["torchao"][i], r["float8kit"][i]),
            }
        )
    return rows
