"""Numerics against two references: an fp32 nn.Linear (SQNR in dB) and torchao.float8 (the
peer: same algorithm, so the two should agree to rounding).

    python tests/test_numerics.py     # prints the SQNR table quoted in the README
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from float8kit import Float8LinearConfig, convert_to_float8_training
from tests.helpers import fwd_bwd, sqnr

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torchao_float8 = pytest.importorskip("torchao.float8")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def mlp():
    return nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256))


def compare(recipe: str, seed: int = 0):
    """SQNR (dB) of output, grad_input, grad_weight(first layer) for float8kit and torchao
    against fp32, and of float8kit against torchao."""
    torch.manual_seed(seed)
    base = mlp()
    x = torch.randn(8, 128, 256, dtype=torch.bfloat16)
    grad = torch.randn(8, 128, 256)
    ours = convert_to_float8_training(
        copy.deepcopy(base).bfloat16(), config=Float8LinearConfig.from_recipe_name(recipe)
    )
    peer = torchao_float8.convert_to_float8_training(
        copy.deepcopy(base).bfloat16(),
        config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe),
    )
    ref = fwd_bwd(base, x.float(), grad)
    results = {}
    for name, m in (("float8kit", ours), ("torchao", peer)):
        out, gx, g = fwd_bwd(m, x, grad)
        results[name] = (out, gx, g["0.weight"])
    ref = (ref[0], ref[1], ref[2]["0.weight"])
    return {
        "float8kit_vs_fp32": [sqnr(r, o) for r, o in zip(ref, results["float8kit"], strict=True)],
        "torchao_vs_fp32": [sqnr(r, o) for r, o in zip(ref, results["torchao"], strict=True)],
        "float8kit_vs_torchao": [
            sqnr(t, o) for t, o in zip(results["torchao"], results["float8kit"], strict=True)
        ],
    }


@pytest.mark.parametrize("recipe", RECIPES)
def test_agrees_with_torchao(recipe):
    table = compare(recipe)
    names = ["out", "grad_input", "grad_weight"]
    for what, value in zip(names, table["float8kit_vs_torchao"], strict=True):
        assert value >= 30, f"{recipe} {what}: float8kit vs torchao {value:.1f} dB"
    # and we are never less accurate than the peer (to within measurement noise)
    for ours, theirs in zip(table["float8kit_vs_fp32"], table["torchao_vs_fp32"], strict=True):
        assert ours >= theirs - 0.5


if __name__ == "__main__":
    print("| recipe | gemm output | float8kit vs fp32 (dB) | torchao vs fp32 (dB) | "
          "float8kit vs torchao (dB) |\n|---|---|---|---|---|")
    for recipe in RECIPES:
        t = compare(recipe)
        for i, what in enumerate(["output", "grad_input", "grad_weight"]):
            print(f"| {recipe} | {what} | {t['float8kit_vs_fp32'][i]:.2f} | "
                  f"{t['torchao_vs_fp32'][i]:.2f} | {t['float8kit_vs_torchao'][i]:.1f} |")
