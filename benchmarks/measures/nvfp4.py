"""NVFP4 numerics (numbers/nvfp4_numerics.json): the nvfp4 recipe and its ablations against
fp64 math on the issue's bar (a 256 -> 512 layer, 128 tokens, fp32), with and without 4
outlier input columns (x100) or sparse input spikes, beside torchao 0.18's NVFP4 cast of
both operands of the output gemm; each gemm in one pass, and the grad_weight gemm averaged
over 64 backward passes of the same batch (stochastic rounding averages out, rounding to
nearest does not). tests/test_nvfp4.py asserts on these functions."""

from __future__ import annotations

import warnings

import torch

from benchmarks.measures.refs import sqnr
from float8kit import Float8Linear, Float8LinearConfig, nvfp4_config

GEMMS = ["output", "grad_input", "grad_weight"]
# randn; 4 outlier input columns (x100); sparse spikes (0.3% of the input's elements x50,
# the outliers a Hadamard transform along the tokens is meant to spread)
CASES = ["randn", "outliers", "spikes"]
OUTLIER_COLUMNS = [10, 11, 12, 13]  # 4 of the 256 input columns, x100
SPIKES = (0.003, 50.0)  # (share of the input's elements, factor)
AVERAGED_PASSES = 64
# the recipe and what it is without each gradient-side part; hp_forward: the paper's late
# switch of the forward gemms to hp (the backward gemms stay NVFP4)
VARIANTS = ["nvfp4", "no_rht", "no_sr", "hp_forward"]
# the bar, float8kit vs fp64 (output, grad_input, grad_weight), the nvfp4 recipe
ACCURACY_DB = (16.0, 12.0, 12.0)
# averaging 64 backward passes brings grad_weight at least this much closer to fp64
AVERAGING_GAIN_DB = 2.0


def variant_config(name: str) -> Float8LinearConfig:
    return {
        "nvfp4": nvfp4_config,
        "no_rht": lambda: nvfp4_config(hadamard=False),
        "no_sr": lambda: nvfp4_config(stochastic_rounding=False),
        "hp_forward": lambda: nvfp4_config().with_hp_forward(),
    }[name]()


def bar_case(case: str = "randn") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x (128, 256), weight (512, 256), grad_output (128, 512)), fp32, seeded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=g)
    w = torch.randn(512, 256, generator=g) / 16  # nn.Linear's init scale
    go = torch.randn(128, 512, generator=g)
    if case == "outliers":
        x[:, OUTLIER_COLUMNS] *= 100
    elif case == "spikes":
        share, factor = SPIKES
        x = torch.where(torch.rand(x.shape, generator=g) < share, x * factor, x)
    return x, w, go


def reference(x, w, go) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three gemms in fp64."""
    x, w, go = x.double(), w.double(), go.double()
    return x @ w.t(), go @ w, go.t() @ x


def run(config: Float8LinearConfig, x, w, go, passes: int = 1, seed: int = 0):
    """(output, grad_input, grad_weight) of one pass of a Float8Linear with ``config``, and
    grad_weight averaged over ``passes`` backward passes of the same batch (fresh random
    bits each: torch's generator, seeded with ``seed`` first)."""
    torch.manual_seed(seed)
    layer = Float8Linear(w.shape[1], w.shape[0], bias=False, config=config)
    with torch.no_grad():
        layer.weight.copy_(w)
    total, first = torch.zeros_like(w, dtype=torch.float64), None
    for _ in range(passes):
        xx = x.clone().requires_grad_()
        out = layer(xx)
        out.backward(go)
        if first is None:
            first = (out.detach(), xx.grad, layer.weight.grad.clone())
        total += layer.weight.grad
        layer.weight.grad = None
    return (*first, total / passes)


def torchao_cast_output_sqnr(case: str = "randn") -> float:
    """SQNR (dB) against fp64 of the output gemm on torchao 0.18's NVFP4 casts of both
    operands (``NVFP4Tensor.to_nvfp4`` with a per-tensor scale: 1x16 blocks for the weight
    too), dequantized and multiplied in fp64."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            per_tensor_amax_to_scale,
        )

    def cast(t):
        scale = per_tensor_amax_to_scale(t.abs().amax())
        return NVFP4Tensor.to_nvfp4(t, per_tensor_scale=scale).dequantize(torch.float32)

    x, w, go = bar_case(case)
    return sqnr(reference(x, w, go)[0], cast(x).double() @ cast(w).double().t())


def sqnr_table() -> list[dict]:
    """One row per case and variant: SQNR (dB) vs fp64 of each gemm in one pass, of
    grad_weight averaged over AVERAGED_PASSES passes, and torchao's cast's output."""
    rows = []
    for case in CASES:
        x, w, go = bar_case(case)
        ref = reference(x, w, go)
        peer = torchao_cast_output_sqnr(case)
        for name in VARIANTS:
            out, gi, gw, gw_avg = run(variant_config(name), x, w, go, AVERAGED_PASSES)
            rows.append(
                {
                    "case": case,
                    "variant": name,
                    **{g: sqnr(r, t) for g, r, t in zip(GEMMS, ref, (out, gi, gw), strict=True)},
                    "grad_weight_averaged": sqnr(ref[2], gw_avg),
                    "torchao_cast_output": peer,
                }
            )
    return rows
