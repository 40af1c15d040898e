"""The low-bit optimizers' step on one device, beside fp32 AdamW and torchao.optim.

For float8kit's AdamW8bit / AdamW4bit and torchao.optim's classes of the same names, on a
model of Llama-3-8B-layer weight shapes (``--dims``): the step time (median of the
synchronized steps after the warm-up; torchao compiles its step in the first), over fp32
AdamW's (torch's default implementation on the device: foreach on CUDA), the state bytes per
parameter, and the SQNR of the total update after ``--steps`` steps on synthetic gradients
against fp32 AdamW's.

    python benchmarks/bench_optim.py --device cuda                 # 4096 / 14336 weights
    python benchmarks/bench_optim.py --device cpu --dims 512,1024  # small, on a CPU

Writes ``runs/benchmarks/<date>-<device>-optim.json`` (``--out`` to change) and its ``.md``
table. tools/measure.py's ``optim`` measures the same on a 1M-parameter MLP on CPU, with
training and FSDP2 mesh checks (docs/optim.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.measures import optim as measure  # noqa: E402


def weights(dim: int, hidden: int) -> nn.Module:
    """A Llama MLP's and attention's bias-free weights: (dim, dim) x 2, (hidden, dim),
    (dim, hidden)."""
    torch.manual_seed(0)
    return nn.ParameterList(
        nn.Parameter(torch.randn(shape) / shape[1] ** 0.5)
        for shape in [(dim, dim), (dim, dim), (hidden, dim), (dim, hidden)]
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dims", default="4096,14336", help="the model dim and MLP hidden dim")
    p.add_argument("--steps", type=int, default=12, help="steps per optimizer (3 warm up)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    p.add_argument("--threads", type=int, default=None, help=common.THREADS_HELP)
    p.add_argument("--out", type=Path, default=None, help="JSON path (.md beside it)")
    args = p.parse_args()
    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    dim, hidden = (int(x) for x in args.dims.split(","))
    info = common.run_info(device)
    print(f"# {info['device']} | torch {info['torch']}", flush=True)

    rows = []
    for name in measure.LOW_BIT:
        for lib in ("float8kit", "torchao"):
            r = measure.update_vs_fp32(
                name, lib, args.steps, 3, lambda: weights(dim, hidden), device.type
            )
            row = {
                "optimizer": f"{lib} {name}",
                "step_ms": round(r["step_ms"], 3),
                "adamw_step_ms": round(r["adamw_step_ms"], 3),
                "over_adamw": round(r["step_ms"] / r["adamw_step_ms"], 3),
                "bytes_per_param": round(r["bytes_per_param"], 4),
                "update_sqnr_db": round(r["update_sqnr_db"], 2),
            }
            rows.append(row)
            print(" ".join(f"{k}={common.fmt(v)}" for k, v in row.items()), flush=True)

    payload = {**info, "kind": "optim", "dims": [dim, hidden], "steps": args.steps, "rows": rows}
    columns = [
        ("optimizer", "optimizer"),
        ("step_ms", "step ms"),
        ("adamw_step_ms", "fp32 AdamW step ms"),
        ("over_adamw", "over fp32 AdamW"),
        ("bytes_per_param", "state bytes / param"),
        ("update_sqnr_db", f"update SQNR after {args.steps} steps (dB)"),
    ]
    table = common.markdown_table(rows, columns)
    out = args.out or common.default_out(device, "optim")
    json_path, md_path = common.write_results(
        out, payload, table, "bench_optim: the low-bit optimizers' step beside fp32 AdamW"
    )
    print("\n" + table + f"\n\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
