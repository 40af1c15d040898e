"""MoE expert gemms: bf16 ``torch._grouped_mm`` vs float8kit's float8 grouped gemms.

One expert projection ``torch._grouped_mm(x, w, offs=offs)`` with ``w`` (experts, K, N) and
the routed tokens split evenly over the experts, forward + backward (output, grad_input and
grad_weight: the three grouped gemms of a training step). The same weight is timed plain
(bf16) and converted by ``convert_experts_to_float8_training`` (rowwise float8, the CUDA
``torch._scaled_grouped_mm`` kernel on sm90; the emulation elsewhere). Times are medians
(CUDA events on GPU); the row's SQNR is the worst of output, grad_input and grad_weight
against the bf16 run.

GPU rows (H100; they are not measured on CPU, where float8 grouped gemms are emulated):

    python benchmarks/bench_experts.py --shapes deepseek-v3,llama4

DeepSeek-V3: dim 7168, expert hidden 2048, 256 routed experts; 8 local experts per GPU
(expert parallel 32). Llama 4: dim 5120, expert hidden 8192; Scout 16 experts, Maverick
128 (16 local per GPU at expert parallel 8). Each model contributes its gate/up (dim ->
hidden) and down (hidden -> dim) projections at 16384 routed tokens per GPU.

CPU smoke run (CI): ``python benchmarks/bench_experts.py --smoke --out /tmp/experts.json``.
Writes ``runs/benchmarks/<date>-<device>-experts.json`` (``--out`` to change) and ``.md``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import common
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from float8kit import convert_experts_to_float8_training  # noqa: E402

# (label, experts, routed tokens, K, N)
SHAPES = {
    "deepseek-v3": [
        ("deepseek-v3 w1/w3", 8, 16384, 7168, 2048),
        ("deepseek-v3 w2", 8, 16384, 2048, 7168),
    ],
    "llama4": [
        ("llama4-scout w1/w3", 16, 16384, 5120, 8192),
        ("llama4-scout w2", 16, 16384, 8192, 5120),
        ("llama4-maverick w1/w3 (16 local)", 16, 16384, 5120, 8192),
    ],
    "smoke": [("smoke", 4, 64, 32, 64)],
}


class Projection(torch.nn.Module):
    def __init__(self, experts: int, k: int, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(experts, k, n) / k**0.5)

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.w, offs=offs)


def bench_row(label, experts, tokens, k, n, device, warmup, iters) -> dict:
    torch.manual_seed(0)
    bf16 = Projection(experts, k, n).to(device, torch.bfloat16)
    f8 = convert_experts_to_float8_training(copy.deepcopy(bf16))
    offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (tokens // experts)
    xs = [torch.randn(tokens, k, device=device, dtype=torch.bfloat16) for _ in range(3)]
    grad = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)

    def step(model, i):
        x = xs[i % len(xs)].requires_grad_()
        model(x, offs).backward(grad)
        return x

    results = {}
    for name, model in (("bf16", bf16), ("float8kit", f8)):
        for t in (*xs, model.w):
            t.grad = None  # the other model's timing loop accumulated into them
        x = step(model, 0)
        results[name] = (model(x, offs).detach(), x.grad.clone(), model.w.grad.clone())
        times = common.time_ms(lambda i, m=model: step(m, i), device, warmup=warmup, iters=iters)
        results[f"{name}_ms"] = common.median(times)
    sqnr = min(
        common.sqnr_db(ref, got)
        for ref, got in zip(results["bf16"], results["float8kit"], strict=True)
    )
    return {
        "label": label,
        "experts": experts,
        "tokens": tokens,
        "K": k,
        "N": n,
        "bf16_ms": round(results["bf16_ms"], 4),
        "float8kit_ms": round(results["float8kit_ms"], 4),
        "speedup": round(results["bf16_ms"] / results["float8kit_ms"], 3),
        "float8kit_sqnr_db": common.finite_or_none(sqnr),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes", default="deepseek-v3,llama4", help="comma-separated: " + ", ".join(SHAPES)
    )
    p.add_argument("--smoke", action="store_true", help="the tiny CPU shape (CI)")
    p.add_argument("--device", help="cuda (default when available) or cpu")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, help="CPU intra-op threads")
    p.add_argument("--out", type=Path, help="result JSON path")
    args = p.parse_args(argv)
    common.set_threads(args.threads)
    device = common.pick_device("cpu" if args.smoke and not args.device else args.device)
    names = ["smoke"] if args.smoke else [s for s in args.shapes.split(",") if s]
    if unknown := [s for s in names if s not in SHAPES]:
        p.error(f"unknown --shapes {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    if device.type != "cuda" and names != ["smoke"]:
        p.error("the DeepSeek-V3 / Llama 4 rows are GPU rows (sm90): run them with --device cuda")
    rows = [
        bench_row(*shape, device, args.warmup, args.iters) for s in names for shape in SHAPES[s]
    ]
    payload = {**common.run_info(device), "rows": rows}
    out = args.out or common.default_out(device, "experts")
    columns = [
        ("label", "shape"),
        ("experts", "experts"),
        ("tokens", "tokens"),
        ("K", "K"),
        ("N", "N"),
        ("bf16_ms", "bf16 ms"),
        ("float8kit_ms", "float8kit ms"),
        ("speedup", "speedup"),
        ("float8kit_sqnr_db", "SQNR dB"),
    ]
    common.write_results(out, payload, common.markdown_table(rows, columns), "MoE expert gemms")
    print(common.markdown_table(rows, columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
