"""Compiled vs eager float8kit on CUDA, with and without inductor's ``emulate_precision_casts``.

    python benchmarks/bench_compile_precision.py [--out PATH]     # needs a CUDA GPU

A two-layer bf16 MLP (Linear 1024->2048, SiLU, Linear 2048->1024, 2048 tokens), per recipe
and with/without bias: SQNR in dB of the compiled output, grad_input and first weight's grad
against eager's, and whether the output is bitwise equal. Inductor's Triton kernels keep bf16
intermediates in fp32 unless ``torch._inductor.config.emulate_precision_casts`` is set, which
moves the next layer's float8 casts; this measures by how much, and that the flag makes
compiled bitwise eager (tests/test_gpu.py asserts the latter on every GPU run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.measures.refs import fwd_bwd  # noqa: E402
from float8kit import Float8LinearConfig, convert_to_float8_training  # noqa: E402


def mlp(bias: bool) -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2048, bias=bias), nn.SiLU(), nn.Linear(2048, 1024, bias=bias)
    )


def measure(recipe: str, bias: bool, emulate_precision_casts: bool) -> dict:
    torch._dynamo.reset()
    torch._inductor.config.emulate_precision_casts = emulate_precision_casts
    torch.manual_seed(0)
    config = Float8LinearConfig.from_recipe_name(recipe)
    m = convert_to_float8_training(mlp(bias).cuda().bfloat16(), config=config)
    x = torch.randn(8, 256, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(8, 256, 1024, device="cuda")
    e = fwd_bwd(m, x, g)
    c = fwd_bwd(torch.compile(m, fullgraph=True), x, g)
    return {
        "recipe": recipe,
        "bias": bias,
        "emulate_precision_casts": emulate_precision_casts,
        "out_sqnr_db": common.finite_or_none(common.sqnr_db(e[0], c[0])),
        "grad_input_sqnr_db": common.finite_or_none(common.sqnr_db(e[1], c[1])),
        "grad_weight_sqnr_db": common.finite_or_none(
            common.sqnr_db(e[2]["0.weight"], c[2]["0.weight"])
        ),
        "bitwise_out": bool(torch.equal(e[0], c[0])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="JSON path (default runs/benchmarks/...)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_compile_precision needs a CUDA GPU (inductor's Triton kernels)")
    device = torch.device("cuda")
    rows = [
        measure(recipe, bias, epc)
        for recipe in ("tensorwise", "rowwise")
        for bias in (True, False)
        for epc in (False, True)
    ]
    payload = {**common.run_info(device), "kind": "compile_precision", "rows": rows}
    cols = [(k, k) for k in rows[0]]
    common.write_results(
        args.out or common.default_out(device, "compile_precision"),
        payload,
        common.markdown_table(rows, cols),
        "bench_compile_precision: compiled vs eager on CUDA",
    )


if __name__ == "__main__":
    main()
